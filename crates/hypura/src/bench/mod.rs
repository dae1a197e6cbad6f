//! Benchmarks: Hypura against plain llama.cpp in the same process, on the same file,
//! alternating, with llama-bench-like tables and JSON. A benchmark reports; it never asserts
//! timings. Ratios measured side by side are what we quote: absolute times on shared machines
//! drift.
pub mod peer;
pub mod picture;
mod report;
pub mod routing;
pub mod simulate;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::engine::{
    Control, DiskWhileBusy, Engine, EngineError, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session,
};
use hypura_sys::Token;
use peer::PlainLlama;
pub use report::{render, BenchReport, PoolLimit, Rate, TestResult};

/// How the llama.cpp peer loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerConfig {
    pub load_mode: hypura_sys::LoadMode,
    pub repack: bool,
    pub placement: PeerPlacement,
    /// The devices llama.cpp offloads to (its `--rpc` workers' devices); empty: its own GPUs.
    pub devices: Vec<hypura_sys::DeviceHandle>,
    /// The KV cache's types: Hypura's, so that both sides attend over the same cache.
    pub kv: crate::plan::KvTypes,
}

impl Default for PeerConfig {
    /// llama.cpp's own defaults.
    fn default() -> Self {
        PeerConfig {
            load_mode: hypura_sys::LoadMode::Mmap,
            repack: true,
            placement: PeerPlacement::Default,
            devices: Vec::new(),
            kv: crate::plan::KvTypes::default(),
        }
    }
}

/// Where the peer puts tensors when there is a GPU: the GPU options of llama.cpp's tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerPlacement {
    /// llama.cpp's default: every layer on the GPU.
    Default,
    /// `--fit`: llama.cpp's automatic placement for a device memory target (free memory less
    /// `gpu_budget_bytes` is left as its margin, which emulates a card of that size).
    Fit { gpu_budget_bytes: u64 },
    /// `-ot exps=CPU`: every layer on the GPU but the routed experts, in host memory.
    ExpertsOnHost,
    /// `--n-cpu-moe N`: every layer on the GPU but the routed experts of the first N layers.
    CpuMoe { layers: u32 },
    /// Hypura's placement from its plan: the same layers on the GPU and the same tensors in
    /// host memory (streamed ones loaded whole), for output comparisons.
    Same { n_gpu_layers: i32, host_patterns: Vec<String> },
}

impl PeerPlacement {
    /// llama.cpp's `-ot` pattern for routed experts.
    pub const EXPERTS_PATTERN: &'static str = "exps";

    /// Parse `--baseline-placement`; `same` and `fit` take what they need from the plan and
    /// the GPU budget.
    pub fn parse(text: &str, plan: Option<&crate::plan::Plan>, gpu_budget_bytes: u64) -> Option<PeerPlacement> {
        Some(match text {
            "default" => PeerPlacement::Default,
            "fit" => PeerPlacement::Fit { gpu_budget_bytes },
            "exps-cpu" => PeerPlacement::ExpertsOnHost,
            other if other.starts_with("n-cpu-moe:") => {
                PeerPlacement::CpuMoe { layers: other.strip_prefix("n-cpu-moe:")?.parse().ok()? }
            }
            "same" => {
                let plan = plan?;
                let tiers = [crate::plan::Tier::Ram, crate::plan::Tier::Stream];
                PeerPlacement::Same { n_gpu_layers: plan.n_gpu_layers(), host_patterns: plan.host_patterns(&tiers) }
            }
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub reps: usize,
    /// Run Hypura's side (false: only the peer, for runs where each side needs its own process).
    pub hypura: bool,
    pub peer: Option<PeerConfig>,
    pub engine: EngineOptions,
    pub threads: i32,
    /// The profile's streaming rate, for the physical limit; None if not measured.
    pub disk_bytes_per_sec: Option<f64>,
    /// Decode time per token of this model resident on the device, as an earlier run here
    /// recorded it (a resident run that computed under 5% of the weights on the host): a pooled
    /// decode's physical compute term, without the pool's stops. None if never measured.
    pub device_resident_seconds_per_token: Option<f64>,
    /// The weight bytes a second this machine's CPU computed in resident runs (`MachineFacts::
    /// cpu_bytes_per_sec`): where a pooled decode's misses could have been computed instead of
    /// moved (the limit's misses term). None if never measured.
    pub cpu_bytes_per_sec: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("llama.cpp baseline: {0}")]
    Baseline(#[from] hypura_sys::SysError),
    #[error("nothing to benchmark: neither Hypura nor the llama.cpp peer was asked for")]
    NothingToRun,
    #[error("the test needs {needed} tokens of context but the model's context is {n_ctx}")]
    ContextTooSmall { needed: usize, n_ctx: u32 },
}

/// Deterministic prompt tokens, like llama-bench's random ones but repeatable: ordinary tokens
/// only (control tokens can end generation or confuse templates). Each `seed` gives another
/// sequence, so repetitions route through other experts instead of replaying a warm cache.
fn bench_tokens(vocab: &hypura_sys::Vocab, count: usize, seed: u64) -> Vec<Token> {
    let n_vocab = vocab.n_tokens().max(1) as u64;
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut tokens = vec![vocab.bos()];
    while tokens.len() < count {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let token = (state % n_vocab) as Token;
        if !vocab.is_end_of_generation(token) && token != vocab.bos() {
            tokens.push(token);
        }
    }
    tokens.truncate(count);
    tokens
}

fn token_hash(tokens: &[Token]) -> String {
    let mut hasher = Sha256::new();
    for token in tokens {
        hasher.update(token.to_le_bytes());
    }
    format!("{:x}", hasher.finalize())
}

/// Totals over the tg runs of Hypura's side.
#[derive(Clone, Debug, Default)]
struct TgTotals {
    /// Prompt runs (pp): their time and tokens.
    prompt_seconds: f64,
    prompt_tokens: u64,
    /// Expert-stream: the stack distances of the tg runs' picks.
    reuse: crate::plan::ReuseDepths,
    bytes_read: u64,
    /// Of `bytes_read`, the bytes read into pages reused from released units.
    recycled_bytes: u64,
    /// Of `bytes_read`, the host cache's warm fill (`ExpertSnapshot::warm_bytes`): no token
    /// asked for them, so the limit leaves them out.
    warm_bytes: u64,
    /// The decodes' own reads (`GenerationStats::eval_demand_bytes`): the passes the tg rate
    /// times, without the start token's.
    decode_demand_bytes: u64,
    stall_seconds: f64,
    /// Wall time with a read in flight.
    disk_busy_seconds: f64,
    /// Evaluated graphs: the start tokens' and each generated token's.
    graphs: u64,
    wall_seconds: f64,
    /// Generation time not spent waiting on reads, and the tokens it produced.
    compute_seconds: f64,
    generated: u64,
    /// Expert-stream: cache hits and misses, and prefetches issued, used and cancelled.
    expert_hits: u64,
    expert_misses: u64,
    /// The expert stream's layer visits: where it has a pool, the pool's stops.
    layer_visits: u64,
    prefetch: [u64; 3],
    /// The device's expert pool: picks served from its slots, and its uploads.
    pool: crate::store::PoolSnapshot,
    /// Speculative decoding: tokens drafted and accepted, tokens generated and the decodes
    /// that produced them.
    drafted: u64,
    accepted: u64,
    tokens: u64,
    passes: u64,
    /// A remote tier: bytes and round trips over the links while generating, and the decodes.
    link_bytes: u64,
    link_round_trips: u64,
    link_decodes: u64,
}

impl TgTotals {
    /// The bytes the tg runs' passes read for themselves: the warm fill left out.
    fn demand_bytes(&self) -> u64 {
        self.bytes_read.saturating_sub(self.warm_bytes)
    }

    /// A pooled decode's limit from these totals, with the model's recorded time resident on the
    /// device and the CPU's rate, its totals in the model record's form; None without a pool's
    /// stops or a decode.
    fn pool_limit(&self, options: &BenchOptions) -> Option<PoolLimit> {
        let decode = crate::store::PooledDecode {
            pool: self.pool,
            graphs: self.graphs,
            generated: self.generated,
            compute_seconds: self.compute_seconds,
            layer_visits: self.layer_visits,
        };
        let limit = crate::store::PoolLimit::from_decode(
            &decode,
            options.device_resident_seconds_per_token,
            options.cpu_bytes_per_sec,
        )?;
        Some(limit.with_work(|work| crate::hw::PoolWork {
            moved_bytes: work.moved_bytes,
            transfer_seconds: work.transfer_seconds,
            stops: work.stops,
            host_seconds: work.host_seconds,
            gap_stops: work.gap_stops,
            device_gap_seconds: work.device_gap_seconds,
            cpu_bytes: work.cpu_bytes,
            cpu_wait_seconds: work.cpu_wait_seconds,
        }))
    }

    /// The physical limits of the tg runs: their compute per decode, their bytes per pass, and
    /// the tokens a decode yielded (one without drafts).
    fn limits(&self, options: &BenchOptions) -> Limits {
        let tokens_per_pass = if self.drafted > 0 { self.tokens as f64 / self.passes as f64 } else { 1.0 };
        let pool = self.pool_limit(options);
        let compute_per_token =
            pool.map_or(self.compute_seconds / self.generated as f64, |pool| pool.compute_seconds_per_token());
        let limit = |bytes_per_pass: f64, rate: f64| {
            crate::plan::limit_tokens_per_sec(compute_per_token, bytes_per_pass, rate, tokens_per_pass)
        };
        // Every pass of the requests (the busy figure's span), and the passes the tg rate times:
        // the decodes with their own reads. The start token's pass is not timed, and a decode
        // after it finds what it read (with one decoded token, a bytes-per-graph average put the
        // limit below the run).
        let limit_at = |rate: f64| limit(self.demand_bytes() as f64 / self.graphs as f64, rate);
        let decode_limit_at = |rate: f64| limit(self.decode_demand_bytes as f64 / self.passes as f64, rate);
        let measured = self.graphs > 0 && self.generated > 0 && self.passes > 0;
        // The rate the disk delivered in the tg runs while a read was in flight, the limit at it,
        // and every pass of the tg requests (their start token's too) against it, over the same
        // span as the busy time and the bytes.
        let busy = measured
            .then(|| {
                DiskWhileBusy::from_totals(
                    self.bytes_read,
                    self.disk_busy_seconds,
                    self.wall_seconds,
                    self.graphs,
                    tokens_per_pass,
                    limit_at,
                )
            })
            .flatten();
        // Where that rate beats the profile's, the profile is low: the limit takes the faster rate
        // (no run exceeds its limit).
        let rate = match (options.disk_bytes_per_sec, busy.map(|disk| disk.bytes_per_sec)) {
            (Some(profile), Some(busy)) => Some(profile.max(busy)),
            (profile, busy) => profile.or(busy),
        };
        let tokens_per_sec = rate.filter(|_| measured).and_then(decode_limit_at);
        Limits { pool, busy, rate, tokens_per_sec }
    }

    /// The report's figures that come from these totals alone (the rest at their defaults).
    fn figures(&self) -> BenchReport {
        BenchReport {
            bytes_read_per_token: (self.graphs > 0).then(|| self.bytes_read as f64 / self.graphs as f64),
            stall_fraction: (self.wall_seconds > 0.0).then(|| self.stall_seconds / self.wall_seconds),
            recycled_fraction: (self.bytes_read > 0).then(|| self.recycled_bytes as f64 / self.bytes_read as f64),
            warm_bytes_per_token: (self.graphs > 0 && self.warm_bytes > 0)
                .then(|| self.warm_bytes as f64 / self.graphs as f64),
            compute_seconds_per_token: (self.generated > 0).then(|| self.compute_seconds / self.generated as f64),
            generated_tokens: self.generated,
            expert_hit_rate: (self.expert_hits + self.expert_misses > 0)
                .then(|| self.expert_hits as f64 / (self.expert_hits + self.expert_misses) as f64),
            prefetch_issued_used_cancelled: (self.prefetch[0] > 0).then_some(self.prefetch),
            gpu_expert_hit_rate: (self.pool.hits + self.pool.uploads > 0).then(|| {
                self.pool.hits as f64 / (self.pool.hits + self.expert_hits + self.expert_misses).max(1) as f64
            }),
            gpu_upload_bytes_per_token: (self.pool.upload_bytes > 0 && self.graphs > 0)
                .then(|| self.pool.upload_bytes as f64 / self.graphs as f64),
            split_cpu_share_seconds_wait: (self.pool.cpu_picks > 0 && self.generated > 0).then(|| {
                let picks = (self.pool.hits + self.expert_hits + self.expert_misses).max(1) as f64;
                let tokens = self.generated as f64;
                [
                    self.pool.cpu_picks as f64 / picks,
                    self.pool.cpu_seconds / tokens,
                    self.pool.cpu_wait_seconds / tokens,
                ]
            }),
            draft_acceptance: (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64),
            tokens_per_pass: (self.drafted > 0 && self.passes > 0).then(|| self.tokens as f64 / self.passes as f64),
            bytes_read_per_generated_token: (self.drafted > 0 && self.tokens > 0 && self.graphs > 0)
                .then(|| self.bytes_read as f64 / self.tokens as f64),
            link_bytes_per_token: (self.link_decodes > 0).then(|| self.link_bytes as f64 / self.link_decodes as f64),
            link_round_trips_per_token: (self.link_decodes > 0)
                .then(|| self.link_round_trips as f64 / self.link_decodes as f64),
            prompt_seconds: self.prompt_seconds,
            prompt_tokens: self.prompt_tokens,
            reuse: (self.reuse.picks() > 0).then(|| self.reuse.clone()),
            read_bytes: self.bytes_read,
            busy_seconds: self.disk_busy_seconds,
            ..BenchReport::default()
        }
    }

    /// Expert-stream tg runs under `plan`: bytes read for experts, and the bytes of the picks an
    /// LRU cache of the plan's size missed by the runs' own stack distances.
    fn expert_reads(&self, plan: &crate::plan::Plan) -> Option<(f64, f64)> {
        let experts = plan.experts.as_ref()?;
        let served = self.reuse.hit_rate(crate::plan::cached_units(plan), experts.moe_layers)?;
        let modelled = self.reuse.picks() as f64 * (1.0 - served) * experts.unit_bytes as f64;
        let read = self.demand_bytes() as f64 - (self.graphs * experts.dense_streamed_bytes) as f64;
        Some((read, modelled))
    }
}

/// The tg runs' physical limits (`TgTotals::limits`): a pooled decode's terms, the disk while a
/// read was in flight, and the rate the limit takes with the limit at it.
struct Limits {
    pool: Option<PoolLimit>,
    busy: Option<DiskWhileBusy>,
    rate: Option<f64>,
    tokens_per_sec: Option<f64>,
}

/// Hypura's side of a benchmark: one session, with totals for tg runs.
struct HypuraSide {
    engine: Arc<Engine>,
    session: Session,
    totals: TgTotals,
}

impl HypuraSide {
    fn prefill_rate(&mut self, prompt: &[Token]) -> Result<f64, BenchError> {
        self.session.reset();
        let request = GenerateRequest {
            max_tokens: Some(0),
            sampling: SamplerParams::greedy(),
            ..GenerateRequest::new(Prompt::Tokens(prompt.to_vec()))
        };
        let output = self.session.generate(&request, &mut |_| Control::Continue)?;
        self.totals.prompt_seconds += output.stats.prompt_eval_duration.as_secs_f64();
        self.totals.prompt_tokens += u64::from(output.stats.prompt_eval_count);
        Ok(output.stats.prompt_tokens_per_sec())
    }

    /// `tg`: `count` decoded tokens after `start`, timed as llama.cpp's side is (each token
    /// sampled and decoded). The loop ends an answer on its last sampled token without
    /// decoding it, so one more token is asked for and not counted. With speculative decoding
    /// the same `count` tokens take fewer decodes.
    fn generate_rate(&mut self, start: &[Token], count: usize) -> Result<(f64, Vec<Token>), BenchError> {
        self.session.reset();
        let request = GenerateRequest {
            max_tokens: Some(count as u32 + 1),
            sampling: SamplerParams::greedy(),
            ignore_eos: true,
            ..GenerateRequest::new(Prompt::Tokens(start.to_vec()))
        };
        let mut output = self.session.generate(&request, &mut |_| Control::Continue)?;
        let stats = &output.stats;
        if let Some(io) = stats.io {
            self.totals.bytes_read += io.bytes_read;
            self.totals.recycled_bytes += io.recycled_bytes;
            self.totals.stall_seconds += io.stall_seconds;
            self.totals.disk_busy_seconds += io.busy_seconds;
            self.totals.graphs += u64::from(stats.weight_passes());
            self.totals.wall_seconds += stats.total_duration.as_secs_f64();
            self.totals.decode_demand_bytes += stats.eval_demand_bytes.unwrap_or(0);
        }
        if let Some(experts) = &stats.experts {
            self.totals.expert_hits += experts.hits;
            self.totals.expert_misses += experts.misses;
            self.totals.layer_visits += experts.layer_visits;
            self.totals.warm_bytes += experts.warm_bytes;
            self.totals.prefetch[0] += experts.prefetch_issued;
            self.totals.prefetch[1] += experts.prefetch_used;
            self.totals.prefetch[2] += experts.prefetch_cancelled;
            self.totals.pool = self.totals.pool + experts.device;
            self.totals.reuse.add(&experts.reuse);
        }
        if let Some(links) = stats.eval_links {
            self.totals.link_bytes += links.bytes();
            self.totals.link_round_trips += links.round_trips;
            self.totals.link_decodes += u64::from(stats.eval_decodes);
        }
        self.totals.drafted += u64::from(stats.draft_tokens);
        self.totals.accepted += u64::from(stats.draft_accepted);
        self.totals.tokens += u64::from(stats.eval_count);
        self.totals.passes += u64::from(stats.eval_decodes);
        if let Some(seconds) = stats.eval_compute_seconds_per_token() {
            self.totals.compute_seconds += seconds * f64::from(stats.eval_decodes);
            self.totals.generated += u64::from(stats.eval_decodes);
        }
        // Tokens over time, not decodes: with speculative decoding a decode yields several
        // (without it, the `count` tokens are `count` decodes).
        let rate = f64::from(stats.eval_count.saturating_sub(1)) / stats.eval_duration.as_secs_f64().max(1e-9);
        output.tokens.truncate(count);
        Ok((rate, output.tokens))
    }
}

/// Both sides of a benchmark, either of them absent where not asked for (the peer first, as it
/// is dropped first).
struct Sides {
    peer: Option<PlainLlama>,
    hypura: Option<HypuraSide>,
}

/// The reps' rates (Hypura's pp and tg, the peer's pp and tg), and the peer's traffic over the
/// RPC workers' links in its tg runs with the tokens they made.
struct Samples {
    rates: [Vec<f64>; 4],
    peer_links: (crate::remote::Traffic, u64),
}

/// Tokens a second: `count` tokens in `duration`.
fn per_second(count: usize, duration: Duration) -> f64 {
    count as f64 / duration.as_secs_f64().max(1e-9)
}

impl Sides {
    /// Open the sides asked for, Hypura's first, the peer with Hypura's context; the test must
    /// fit that context.
    fn open(path: &Path, options: &BenchOptions) -> Result<Sides, BenchError> {
        let hypura = match options.hypura {
            true => {
                let engine = Arc::new(Engine::open(path, options.engine.clone())?);
                let session = Session::new(engine.clone())?;
                Some(HypuraSide { engine, session, totals: TgTotals::default() })
            }
            false => None,
        };
        let n_ctx = hypura.as_ref().map_or(options.engine.n_ctx_seq, |side| side.session.n_ctx_seq());
        // The warm-up generates after the whole prompt (so outputs are compared after a prompt
        // batch too, the path where ggml may move work to a GPU).
        let needed = options.n_prompt.max(2) + options.n_gen + 1;
        if needed > n_ctx as usize {
            return Err(BenchError::ContextTooSmall { needed, n_ctx });
        }
        let peer = match &options.peer {
            Some(config) => Some(PlainLlama::load_configured(path, n_ctx, options.threads, config)?),
            None => None,
        };
        Ok(Sides { peer, hypura })
    }

    fn vocab(&self) -> Result<hypura_sys::Vocab, BenchError> {
        match (&self.hypura, &self.peer) {
            (Some(side), _) => Ok(side.engine.model().vocab()),
            (None, Some(peer)) => Ok(peer.vocab()),
            (None, None) => Err(BenchError::NothingToRun),
        }
    }

    /// Warm-up, as llama-bench does: first runs pay for page faults and thread start-up. Each
    /// side's greedy output after the prompt (Hypura's totals start again after it).
    fn warm_up(&mut self, prompt: &[Token], n_gen: usize) -> Result<[Option<Vec<Token>>; 2], BenchError> {
        let mut hypura_tokens = None;
        if let Some(side) = self.hypura.as_mut() {
            side.prefill_rate(prompt)?;
            hypura_tokens = Some(side.generate_rate(prompt, n_gen)?.1);
            side.totals = TgTotals::default();
        }
        let mut peer_tokens = None;
        if let Some(peer) = self.peer.as_mut() {
            peer.time_prefill(prompt)?;
            peer_tokens = Some(peer.greedy(prompt, n_gen)?);
        }
        Ok([hypura_tokens, peer_tokens])
    }

    /// The reps: pp then tg on each side, the order of the sides alternating each rep.
    fn alternate(
        &mut self,
        options: &BenchOptions,
        vocab: &hypura_sys::Vocab,
        prompt: &[Token],
        progress: &dyn Fn(&str),
    ) -> Result<Samples, BenchError> {
        // tg starts from BOS and one ordinary token that changes every repetition (the same on
        // both sides), so each run generates, and routes, differently.
        let start_for = |rep: u64| bench_tokens(vocab, 2, rep + 1);
        let mut samples: [Vec<f64>; 4] = Default::default();
        let mut peer_links = (crate::remote::Traffic::default(), 0u64);
        let traffic = || options.engine.remote.as_ref().map(|workers| workers.traffic());
        for rep in 0..options.reps {
            progress(&format!("rep {}/{}", rep + 1, options.reps));
            let start = start_for(rep as u64 + 1);
            let peer_first = rep % 2 == 1;
            for test in 0..2 {
                let mut run_peer = |samples: &mut [Vec<f64>; 4]| -> Result<(), BenchError> {
                    if let Some(peer) = self.peer.as_mut() {
                        let before = traffic();
                        let value = if test == 0 {
                            per_second(options.n_prompt, peer.time_prefill(prompt)?)
                        } else {
                            per_second(options.n_gen, peer.time_generate(&start, options.n_gen)?)
                        };
                        samples[2 + test].push(value);
                        if let (1, Some(before), Some(after)) = (test, before, traffic()) {
                            peer_links.0 = peer_links.0 + after.since(before);
                            peer_links.1 += options.n_gen as u64;
                        }
                    }
                    Ok(())
                };
                if peer_first {
                    run_peer(&mut samples)?;
                }
                if let Some(side) = self.hypura.as_mut() {
                    let value = if test == 0 {
                        side.prefill_rate(prompt)?
                    } else {
                        side.generate_rate(&start, options.n_gen)?.0
                    };
                    samples[test].push(value);
                }
                if !peer_first {
                    run_peer(&mut samples)?;
                }
            }
        }
        Ok(Samples { rates: samples, peer_links })
    }

    /// The report: each test's rates side by side, and what Hypura's tg totals, its plan, the
    /// peer and the greedy outputs say.
    fn report(
        &self,
        path: &Path,
        options: &BenchOptions,
        vocab: &hypura_sys::Vocab,
        samples: Samples,
        [hypura_tokens, peer_tokens]: [Option<Vec<Token>>; 2],
    ) -> Result<BenchReport, BenchError> {
        let (hypura, peer) = (self.hypura.as_ref(), self.peer.as_ref());
        let Samples { rates: [hypura_pp_samples, hypura_tg_samples, peer_pp_samples, peer_tg_samples], peer_links } =
            samples;
        let inventory = crate::model::Inventory::open(path).map_err(EngineError::from)?;
        let totals = hypura.map_or_else(TgTotals::default, |side| side.totals.clone());
        let plan =
            hypura.and_then(|side| side.engine.options().plan.clone().filter(|_| side.engine.streaming().is_some()));
        let any_plan = hypura.and_then(|side| side.engine.options().plan.clone());
        let tg = TestResult::from_samples(format!("tg{}", options.n_gen), hypura_tg_samples, peer_tg_samples);
        let limits = totals.limits(options);
        Ok(BenchReport {
            model: path.to_path_buf(),
            model_description: vocab.model_description(),
            file_bytes: inventory.file_bytes,
            n_params: inventory.n_params(),
            mode: hypura.map_or("llama.cpp only", |side| side.engine.mode().name()),
            peak_memory_bytes: crate::hw::peak_rss_bytes(),
            disk_bytes_per_sec: limits.rate.filter(|_| limits.tokens_per_sec.is_some()),
            profile_disk_bytes_per_sec: options.disk_bytes_per_sec,
            limit_tokens_per_sec: limits.tokens_per_sec,
            limit_fraction: limits.tokens_per_sec.zip(tg.hypura.as_ref()).map(|(limit, rate)| rate.mean / limit),
            pool_limit: limits.pool,
            disk_busy_fraction: limits.busy.map(|disk| disk.busy),
            busy_read_bytes_per_sec: limits.busy.map(|disk| disk.bytes_per_sec),
            busy_limit_tokens_per_sec: limits.busy.map(|disk| disk.limit_tokens_per_sec),
            busy_limit_fraction: limits.busy.map(|disk| disk.fraction),
            planned_bytes_per_token: plan.as_ref().map(|plan| plan.streamed_bytes_per_token),
            llama_cpp_link_bytes_per_token: (peer_links.1 > 0)
                .then(|| peer_links.0.bytes() as f64 / peer_links.1 as f64),
            llama_cpp_link_round_trips_per_token: (peer_links.1 > 0)
                .then(|| peer_links.0.round_trips as f64 / peer_links.1 as f64),
            predicted_seconds_per_token: any_plan
                .as_ref()
                .and_then(|plan| plan.prediction.as_ref()?.decode_tokens_per_sec)
                .map(|rate| 1.0 / rate),
            prediction: any_plan.as_ref().and_then(|plan| plan.prediction.clone()),
            expert_reads: plan.as_ref().and_then(|plan| totals.expert_reads(plan)),
            io_bound_tokens_per_sec: plan.as_ref().and_then(|plan| plan.io_bound_tokens_per_sec),
            threads: options.threads,
            repack: hypura.map_or(options.engine.repack, |side| side.engine.repacked()),
            reps: options.reps,
            hypura_version: env!("CARGO_PKG_VERSION"),
            llama_build: hypura_sys::llama_build_info(),
            hypura_load_seconds: hypura.map(|side| side.engine.load_duration().as_secs_f64()),
            llama_cpp_load_seconds: peer.map(|peer| peer.load_duration().as_secs_f64()),
            llama_cpp_load_mode: options.peer.as_ref().map(|config| {
                if config.load_mode == hypura_sys::LoadMode::Mmap {
                    "mmap"
                } else {
                    "no-mmap"
                }
            }),
            llama_cpp_repack: options.peer.as_ref().map(|config| config.repack && hypura_sys::repacking_available()),
            llama_cpp_placement: peer.map(|peer| peer.placement().to_string()),
            results: vec![
                TestResult::from_samples(format!("pp{}", options.n_prompt), hypura_pp_samples, peer_pp_samples),
                tg,
            ],
            hypura_output_sha256: hypura_tokens.as_deref().map(token_hash),
            same_output: match (&peer_tokens, &hypura_tokens) {
                (Some(theirs), Some(ours)) => Some(theirs == ours),
                _ => None,
            },
            llama_cpp_output_sha256: peer_tokens.as_deref().map(token_hash),
            ..totals.figures()
        })
    }
}

/// Run pp and tg on Hypura and/or plain llama.cpp, alternating the order each rep.
pub fn run(path: &Path, options: &BenchOptions, progress: &dyn Fn(&str)) -> Result<BenchReport, BenchError> {
    let mut sides = Sides::open(path, options)?;
    let vocab = sides.vocab()?;
    let prompt = bench_tokens(&vocab, options.n_prompt, 0);
    progress("warm-up");
    let outputs = sides.warm_up(&prompt, options.n_gen)?;
    let samples = sides.alternate(options, &vocab, &prompt, progress)?;
    sides.report(path, options, &vocab, samples, outputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tg1 after a cold start token: the start pass read 100 MB, the one timed decode 10 MB.
    /// The limit is the decode's (its compute, 30 ms, outweighs its 10 ms of reads), not an
    /// average over both passes (50 ms of reads each), which a run beats.
    #[test]
    fn the_limit_counts_the_timed_decodes_reads_not_the_start_tokens() {
        let totals = TgTotals {
            bytes_read: 110_000_000,
            decode_demand_bytes: 10_000_000,
            graphs: 2,
            passes: 1,
            tokens: 1,
            generated: 1,
            compute_seconds: 0.03,
            wall_seconds: 0.2,
            disk_busy_seconds: 0.11,
            ..TgTotals::default()
        };
        let options = BenchOptions {
            n_prompt: 0,
            n_gen: 1,
            reps: 1,
            hypura: true,
            peer: None,
            engine: EngineOptions::default(),
            threads: 2,
            disk_bytes_per_sec: Some(1e9),
            device_resident_seconds_per_token: None,
            cpu_bytes_per_sec: None,
        };
        let limits = totals.limits(&options);
        let limit = limits.tokens_per_sec.expect("a limit");
        assert!((limit - 1.0 / 0.03).abs() < 1e-6, "limit {limit}");
        // The busy figure keeps every pass of the requests over their wall time.
        assert!(limits.busy.is_some());
    }
}
