//! Benchmarks: Hypura against plain llama.cpp in the same process, on the same file,
//! alternating, with llama-bench-like tables and JSON. A benchmark reports; it never asserts
//! timings. Ratios measured side by side are what we quote: absolute times on shared machines
//! drift.
pub mod peer;
pub mod picture;
pub mod routing;
pub mod simulate;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::engine::{
    Control, DiskWhileBusy, Engine, EngineError, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session,
};
use hypura_sys::Token;
use peer::PlainLlama;

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

/// Tokens per second over repetitions.
#[derive(Clone, Debug, Serialize)]
pub struct Rate {
    pub mean: f64,
    pub sd: f64,
    pub samples: Vec<f64>,
}

impl Rate {
    fn from_samples(samples: Vec<f64>) -> Rate {
        let count = samples.len().max(1) as f64;
        let mean = samples.iter().sum::<f64>() / count;
        let variance = if samples.len() > 1 {
            samples.iter().map(|sample| (sample - mean).powi(2)).sum::<f64>() / (samples.len() - 1) as f64
        } else {
            0.0
        };
        Rate { mean, sd: variance.sqrt(), samples }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TestResult {
    /// llama-bench's names: `pp512`, `tg128`.
    pub test: String,
    pub hypura: Option<Rate>,
    pub llama_cpp: Option<Rate>,
    /// Hypura's mean ÷ llama.cpp's mean.
    pub ratio: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct BenchReport {
    pub model: PathBuf,
    pub model_description: String,
    pub file_bytes: u64,
    pub n_params: u64,
    pub mode: &'static str,
    /// Streaming: bytes read from disk per evaluated token in tg runs (the start token's graph
    /// included), averaged.
    pub bytes_read_per_token: Option<f64>,
    /// Streaming: share of tg wall time that compute waited for I/O.
    pub stall_fraction: Option<f64>,
    /// Streaming: share of the bytes read that landed in pages reused from released units
    /// (no page fault, no zeroing).
    pub recycled_fraction: Option<f64>,
    /// Streaming beside a device pool: the host cache's warm fill per token, within
    /// `bytes_read_per_token` (no token asked for it; the limit leaves it out).
    pub warm_bytes_per_token: Option<f64>,
    /// Peak resident memory of the process (both sides when they run in one process).
    pub peak_memory_bytes: Option<u64>,
    /// Hypura's tg time per token not spent waiting on reads (the compute term of the limit),
    /// over `generated_tokens`.
    pub compute_seconds_per_token: Option<f64>,
    pub generated_tokens: u64,
    /// Expert-stream, over tg runs: share of router picks the cache served, and prefetches
    /// (issued, used by the router, cancelled unstarted).
    pub expert_hit_rate: Option<f64>,
    pub prefetch_issued_used_cancelled: Option<[u64; 3]>,
    /// The device's expert pool, over tg runs: the share of all router picks its slots served
    /// (the host cache's `expert_hit_rate` is of the rest), and bytes uploaded per pass.
    pub gpu_expert_hit_rate: Option<f64>,
    pub gpu_upload_bytes_per_token: Option<f64>,
    /// A split pool, over tg runs: the share of all router picks the CPU computed, the CPU's
    /// time for them per token (beside the device's), and the decode's wait for it per token.
    pub split_cpu_share_seconds_wait: Option<[f64; 3]>,
    /// Speculative decoding, over tg runs: share of drafted tokens accepted, generated tokens
    /// per decode (pass over the weights), and bytes read per generated token.
    pub draft_acceptance: Option<f64>,
    pub tokens_per_pass: Option<f64>,
    pub bytes_read_per_generated_token: Option<f64>,
    /// Streaming, over tg runs: the physical limit with this run's compute per pass and bytes
    /// read per pass at `disk_bytes_per_sec` (the profile's streaming rate, or tg's rate while
    /// reads were in flight where that was faster: the profile was low), and the share of it
    /// Hypura's tg reached.
    pub disk_bytes_per_sec: Option<f64>,
    /// The profile's streaming rate, as measured.
    pub profile_disk_bytes_per_sec: Option<f64>,
    pub limit_tokens_per_sec: Option<f64>,
    pub limit_fraction: Option<f64>,
    /// With a device expert pool, the limit's compute term is the device's side: tg's compute
    /// per token less the host's work at the pool's stops (the device idles through them; the
    /// gaps each stop leaves in the device's queue stay in it, so the model resident on the GPU
    /// is the tighter limit where it can be measured); beside it the bus, the pool's transfers
    /// per pass at the rate they ran.
    pub pool_limit: Option<PoolLimit>,
    /// Share of the tg runs' wall time with a read in flight, the rate the disk delivered
    /// then, and the limit at that rate with the decode's share of it.
    pub disk_busy_fraction: Option<f64>,
    pub busy_read_bytes_per_sec: Option<f64>,
    pub busy_limit_tokens_per_sec: Option<f64>,
    pub busy_limit_fraction: Option<f64>,
    /// Streaming: bytes the plan streams per token, and the disk-only bound it implies.
    pub planned_bytes_per_token: Option<u64>,
    /// A remote tier, over tg runs: bytes over the links and round trips per decoded token.
    pub link_bytes_per_token: Option<f64>,
    pub link_round_trips_per_token: Option<f64>,
    /// The same for llama.cpp's own `--rpc` (the baseline with RPC workers).
    pub llama_cpp_link_bytes_per_token: Option<f64>,
    pub llama_cpp_link_round_trips_per_token: Option<f64>,
    /// The plan's predicted time per token (`Prediction::decode_tokens_per_sec`), to set beside
    /// the measured tg.
    pub predicted_seconds_per_token: Option<f64>,
    /// The plan's prediction with what it was made from (`plan::predict`), made before the run.
    pub prediction: Option<crate::plan::Prediction>,
    /// Hypura's pp runs: prompt time and tokens; its tg runs' stack distances and bytes read
    /// with the time a read was in flight (what the next plan of the model keeps).
    #[serde(skip)]
    pub prompt_seconds: f64,
    #[serde(skip)]
    pub prompt_tokens: u64,
    #[serde(skip)]
    pub reuse: Option<crate::plan::ReuseDepths>,
    #[serde(skip)]
    pub read_bytes: u64,
    #[serde(skip)]
    pub busy_seconds: f64,
    /// Expert-stream tg runs: bytes read for experts, and the bytes of the picks an LRU cache
    /// of the plan's size missed by the runs' own stack distances.
    #[serde(skip)]
    pub expert_reads: Option<(f64, f64)>,
    pub io_bound_tokens_per_sec: Option<f64>,
    pub threads: i32,
    pub repack: bool,
    pub reps: usize,
    pub hypura_version: &'static str,
    pub llama_build: String,
    pub hypura_load_seconds: Option<f64>,
    pub llama_cpp_load_seconds: Option<f64>,
    /// "mmap" or "no-mmap", and whether llama.cpp repacked weights.
    pub llama_cpp_load_mode: Option<&'static str>,
    pub llama_cpp_repack: Option<bool>,
    /// Where the peer put tensors: GPU layers and host-memory patterns as llama.cpp got them.
    pub llama_cpp_placement: Option<String>,
    pub results: Vec<TestResult>,
    /// sha256 of the token ids each side generated greedily after the pp prompt (warm-up).
    pub hypura_output_sha256: Option<String>,
    pub llama_cpp_output_sha256: Option<String>,
    pub same_output: Option<bool>,
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
}

/// The device's and the bus's terms of a pooled decode's limit (`BenchReport::pool_limit`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolLimit {
    /// tg's compute per token less the host's work at the pool's stops (the gaps the stops
    /// leave on the device still in it).
    pub device_seconds_per_token: f64,
    /// The same model resident on the device, as an earlier run recorded it: the GPU's compute
    /// without the stops, where known (`BenchOptions::device_resident_seconds_per_token`).
    pub resident_seconds_per_token: Option<f64>,
    pub host_seconds_per_token: f64,
    /// The pool's transfers per pass, and the rate they ran at.
    pub bus_seconds_per_token: f64,
    pub bus_bytes_per_sec: f64,
    /// The bytes of the decode's picks that no slot held, per pass (uploaded or computed by
    /// the CPU), and the CPU's rate beside the bus's: the least time those misses take is
    /// their bytes over both (`miss_seconds_per_token`). Copies back and staging are this
    /// run's own way of moving them, not part of it.
    pub miss_bytes_per_token: f64,
    pub cpu_bytes_per_sec: Option<f64>,
    /// The totals they come from, as the model's record keeps them for the next plan: bytes
    /// moved both ways and the time it took, the pool's stops and the host's time at them
    /// beside the transfers (the plan counts those as the misses' bus time).
    pub work: crate::hw::PoolWork,
    /// Where a stop's time goes, per stop.
    pub stop: StopSplit,
}

/// A pool's stop in a decode, on average (`PoolSnapshot`'s stop times per stop): what the
/// device waits for at each, beside its compute.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StopSplit {
    pub stops_per_token: f64,
    /// The host's work, and of it the router's ids read and the slots' written back, and the
    /// experts moved between the tiers.
    pub host_seconds: f64,
    pub ids_seconds: f64,
    pub transfer_seconds: f64,
    /// The eval callback's questions about the nodes since the stop before (the device idle),
    /// and how many nodes that was.
    pub asks_seconds: f64,
    pub asked_nodes: f64,
    /// The segment before the stop: launched, computed and synchronised.
    pub segment_seconds: f64,
}

impl StopSplit {
    /// The pool's stops in `graphs` decode graphs (tokens), each part per stop.
    pub fn of(pool: &crate::store::PoolSnapshot, graphs: f64) -> StopSplit {
        let per = |total: f64, count: u64| total / count.max(1) as f64;
        StopSplit {
            stops_per_token: pool.stops as f64 / graphs,
            host_seconds: per(pool.host_seconds, pool.stops),
            ids_seconds: per(pool.ids_seconds, pool.stops),
            transfer_seconds: per(pool.transfer_seconds, pool.stops),
            asks_seconds: per(pool.asks_seconds, pool.asked_stops),
            asked_nodes: per(pool.asked_nodes as f64, pool.asked_stops),
            segment_seconds: per(pool.segment_seconds, pool.stops),
        }
    }
}

impl PoolLimit {
    /// From tg's totals and the model's recorded time resident on the device, if any; None
    /// without a pool's stops or a decode. The host's and the bus's times are the tg requests'
    /// (their start tokens' passes too) per pass.
    fn from_totals(totals: &TgTotals, resident: Option<f64>, cpu_bytes_per_sec: Option<f64>) -> Option<PoolLimit> {
        let pool = &totals.pool;
        if pool.host_seconds <= 0.0 || totals.generated == 0 || totals.graphs == 0 {
            return None;
        }
        let graphs = totals.graphs as f64;
        let host_seconds_per_token = pool.host_seconds / graphs;
        let moved = pool.bus_bytes();
        let device_seconds_per_token =
            (totals.compute_seconds / totals.generated as f64 - host_seconds_per_token).max(0.0);
        let resident = resident.filter(|seconds| seconds.is_finite() && *seconds > 0.0);
        // Beside the resident time, what the stops cost the device: its side beyond it.
        let gap = resident.map(|resident| (device_seconds_per_token - resident).max(0.0) * graphs);
        Some(PoolLimit {
            device_seconds_per_token,
            host_seconds_per_token,
            resident_seconds_per_token: resident,
            bus_seconds_per_token: pool.transfer_seconds / graphs,
            bus_bytes_per_sec: if pool.transfer_seconds > 0.0 { moved as f64 / pool.transfer_seconds } else { 0.0 },
            miss_bytes_per_token: pool.miss_bytes() as f64 / graphs,
            cpu_bytes_per_sec: cpu_bytes_per_sec.filter(|rate| *rate > 0.0),
            work: crate::hw::PoolWork {
                moved_bytes: moved,
                transfer_seconds: pool.transfer_seconds,
                stops: totals.layer_visits,
                host_seconds: (pool.host_seconds - pool.transfer_seconds).max(0.0),
                gap_stops: if gap.is_some() { totals.layer_visits } else { 0 },
                device_gap_seconds: gap.unwrap_or(0.0),
            },
            stop: StopSplit::of(pool, graphs),
        })
    }

    /// The least time a pass's misses take: their bytes moved over the bus and computed by the
    /// CPU at once, each at its rate (the bus's as this run measured it).
    pub fn miss_seconds_per_token(&self) -> f64 {
        let rate = self.bus_bytes_per_sec + self.cpu_bytes_per_sec.unwrap_or(0.0);
        if rate > 0.0 {
            self.miss_bytes_per_token / rate
        } else {
            self.bus_seconds_per_token
        }
    }

    /// The GPU's compute term of the limit: the model resident on the device where a run
    /// recorded it (never more than this run's own GPU side), else this run's GPU side.
    pub fn device_compute_seconds_per_token(&self) -> f64 {
        self.resident_seconds_per_token
            .map_or(self.device_seconds_per_token, |resident| resident.min(self.device_seconds_per_token))
    }
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

/// Run pp and tg on Hypura and/or plain llama.cpp, alternating the order each rep.
pub fn run(path: &Path, options: &BenchOptions, progress: &dyn Fn(&str)) -> Result<BenchReport, BenchError> {
    let mut hypura = match options.hypura {
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
    let mut peer = match &options.peer {
        Some(config) => Some(PlainLlama::load_configured(path, n_ctx, options.threads, config)?),
        None => None,
    };
    let vocab = match (&hypura, &peer) {
        (Some(side), _) => side.engine.model().vocab(),
        (None, Some(peer)) => peer.vocab(),
        (None, None) => return Err(BenchError::NothingToRun),
    };
    let prompt = bench_tokens(&vocab, options.n_prompt, 0);
    // tg starts from BOS and one ordinary token that changes every repetition (the same on
    // both sides), so each run generates, and routes, differently.
    let start_for = |rep: u64| bench_tokens(&vocab, 2, rep + 1);
    let rate = |count: usize, duration: Duration| count as f64 / duration.as_secs_f64().max(1e-9);

    // Warm-up, as llama-bench does: first runs pay for page faults and thread start-up.
    progress("warm-up");
    let mut hypura_tokens = None;
    if let Some(side) = hypura.as_mut() {
        side.prefill_rate(&prompt)?;
        hypura_tokens = Some(side.generate_rate(&prompt, options.n_gen)?.1);
        side.totals = TgTotals::default();
    }
    let mut peer_tokens = None;
    if let Some(peer) = peer.as_mut() {
        peer.time_prefill(&prompt)?;
        peer_tokens = Some(peer.greedy(&prompt, options.n_gen)?);
    }

    let mut samples: [Vec<f64>; 4] = Default::default();
    // The peer's traffic over the RPC workers' links in its tg runs, and the tokens they made.
    let mut peer_links = (crate::remote::Traffic::default(), 0u64);
    let traffic = || options.engine.remote.as_ref().map(|workers| workers.traffic());
    for rep in 0..options.reps {
        progress(&format!("rep {}/{}", rep + 1, options.reps));
        let start = start_for(rep as u64 + 1);
        let peer_first = rep % 2 == 1;
        for test in 0..2 {
            let mut run_peer = |samples: &mut [Vec<f64>; 4]| -> Result<(), BenchError> {
                if let Some(peer) = peer.as_mut() {
                    let before = traffic();
                    let value = if test == 0 {
                        rate(options.n_prompt, peer.time_prefill(&prompt)?)
                    } else {
                        rate(options.n_gen, peer.time_generate(&start, options.n_gen)?)
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
            if let Some(side) = hypura.as_mut() {
                let value =
                    if test == 0 { side.prefill_rate(&prompt)? } else { side.generate_rate(&start, options.n_gen)?.0 };
                samples[test].push(value);
            }
            if !peer_first {
                run_peer(&mut samples)?;
            }
        }
    }
    let [hypura_pp_samples, hypura_tg_samples, peer_pp_samples, peer_tg_samples] = samples;
    let result = |test: String, ours: Vec<f64>, theirs: Vec<f64>| {
        let hypura = (!ours.is_empty()).then(|| Rate::from_samples(ours));
        let llama_cpp = (!theirs.is_empty()).then(|| Rate::from_samples(theirs));
        let ratio = match (&hypura, &llama_cpp) {
            (Some(ours), Some(theirs)) => Some(ours.mean / theirs.mean),
            _ => None,
        };
        TestResult { test, hypura, llama_cpp, ratio }
    };
    let inventory = crate::model::Inventory::open(path).map_err(EngineError::from)?;
    let totals = hypura.as_ref().map_or_else(TgTotals::default, |side| side.totals.clone());
    let plan = hypura
        .as_ref()
        .and_then(|side| side.engine.options().plan.clone().filter(|_| side.engine.streaming().is_some()));
    let any_plan = hypura.as_ref().and_then(|side| side.engine.options().plan.clone());
    let tg = result(format!("tg{}", options.n_gen), hypura_tg_samples, peer_tg_samples);
    // The physical limit of the tg runs: their compute per decode, their bytes per pass, and
    // the tokens a decode yielded (one without drafts).
    let tokens_per_pass = if totals.drafted > 0 { totals.tokens as f64 / totals.passes as f64 } else { 1.0 };
    let pool_limit =
        PoolLimit::from_totals(&totals, options.device_resident_seconds_per_token, options.cpu_bytes_per_sec);
    let compute_per_token = pool_limit.map_or(totals.compute_seconds / totals.generated as f64, |pool| {
        pool.device_compute_seconds_per_token().max(pool.miss_seconds_per_token())
    });
    let limit_at = |rate: f64| {
        crate::plan::limit_tokens_per_sec(
            compute_per_token,
            totals.demand_bytes() as f64 / totals.graphs as f64,
            rate,
            tokens_per_pass,
        )
    };
    let measured = totals.graphs > 0 && totals.generated > 0;
    // The rate the disk delivered in the tg runs while a read was in flight, the limit at it,
    // and every pass of the tg requests (their start token's too) against it, over the same
    // span as the busy time and the bytes.
    let busy = measured
        .then(|| {
            DiskWhileBusy::from_totals(
                totals.bytes_read,
                totals.disk_busy_seconds,
                totals.wall_seconds,
                totals.graphs,
                tokens_per_pass,
                limit_at,
            )
        })
        .flatten();
    // Where that rate beats the profile's, the profile is low: the limit takes the faster rate
    // (no run exceeds its limit).
    let limit_rate = match (options.disk_bytes_per_sec, busy.map(|disk| disk.bytes_per_sec)) {
        (Some(profile), Some(busy)) => Some(profile.max(busy)),
        (profile, busy) => profile.or(busy),
    };
    let limit = limit_rate.filter(|_| measured).and_then(limit_at);
    Ok(BenchReport {
        model: path.to_path_buf(),
        model_description: vocab.model_description(),
        file_bytes: inventory.file_bytes,
        n_params: inventory.n_params(),
        mode: hypura.as_ref().map_or("llama.cpp only", |side| side.engine.mode().name()),
        bytes_read_per_token: (totals.graphs > 0).then(|| totals.bytes_read as f64 / totals.graphs as f64),
        stall_fraction: (totals.wall_seconds > 0.0).then(|| totals.stall_seconds / totals.wall_seconds),
        recycled_fraction: (totals.bytes_read > 0).then(|| totals.recycled_bytes as f64 / totals.bytes_read as f64),
        warm_bytes_per_token: (totals.graphs > 0 && totals.warm_bytes > 0)
            .then(|| totals.warm_bytes as f64 / totals.graphs as f64),
        peak_memory_bytes: crate::hw::peak_rss_bytes(),
        compute_seconds_per_token: (totals.generated > 0).then(|| totals.compute_seconds / totals.generated as f64),
        generated_tokens: totals.generated,
        expert_hit_rate: (totals.expert_hits + totals.expert_misses > 0)
            .then(|| totals.expert_hits as f64 / (totals.expert_hits + totals.expert_misses) as f64),
        prefetch_issued_used_cancelled: (totals.prefetch[0] > 0).then_some(totals.prefetch),
        gpu_expert_hit_rate: (totals.pool.hits + totals.pool.uploads > 0).then(|| {
            totals.pool.hits as f64 / (totals.pool.hits + totals.expert_hits + totals.expert_misses).max(1) as f64
        }),
        gpu_upload_bytes_per_token: (totals.pool.upload_bytes > 0 && totals.graphs > 0)
            .then(|| totals.pool.upload_bytes as f64 / totals.graphs as f64),
        split_cpu_share_seconds_wait: (totals.pool.cpu_picks > 0 && totals.generated > 0).then(|| {
            let picks = (totals.pool.hits + totals.expert_hits + totals.expert_misses).max(1) as f64;
            let tokens = totals.generated as f64;
            [
                totals.pool.cpu_picks as f64 / picks,
                totals.pool.cpu_seconds / tokens,
                totals.pool.cpu_wait_seconds / tokens,
            ]
        }),
        draft_acceptance: (totals.drafted > 0).then(|| totals.accepted as f64 / totals.drafted as f64),
        tokens_per_pass: (totals.drafted > 0 && totals.passes > 0).then(|| totals.tokens as f64 / totals.passes as f64),
        bytes_read_per_generated_token: (totals.drafted > 0 && totals.tokens > 0 && totals.graphs > 0)
            .then(|| totals.bytes_read as f64 / totals.tokens as f64),
        disk_bytes_per_sec: limit_rate.filter(|_| limit.is_some()),
        profile_disk_bytes_per_sec: options.disk_bytes_per_sec,
        limit_tokens_per_sec: limit,
        limit_fraction: limit.zip(tg.hypura.as_ref()).map(|(limit, rate)| rate.mean / limit),
        pool_limit,
        disk_busy_fraction: busy.map(|disk| disk.busy),
        busy_read_bytes_per_sec: busy.map(|disk| disk.bytes_per_sec),
        busy_limit_tokens_per_sec: busy.map(|disk| disk.limit_tokens_per_sec),
        busy_limit_fraction: busy.map(|disk| disk.fraction),
        planned_bytes_per_token: plan.as_ref().map(|plan| plan.streamed_bytes_per_token),
        link_bytes_per_token: (totals.link_decodes > 0).then(|| totals.link_bytes as f64 / totals.link_decodes as f64),
        link_round_trips_per_token: (totals.link_decodes > 0)
            .then(|| totals.link_round_trips as f64 / totals.link_decodes as f64),
        llama_cpp_link_bytes_per_token: (peer_links.1 > 0).then(|| peer_links.0.bytes() as f64 / peer_links.1 as f64),
        llama_cpp_link_round_trips_per_token: (peer_links.1 > 0)
            .then(|| peer_links.0.round_trips as f64 / peer_links.1 as f64),
        predicted_seconds_per_token: any_plan
            .as_ref()
            .and_then(|plan| plan.prediction.as_ref()?.decode_tokens_per_sec)
            .map(|rate| 1.0 / rate),
        prediction: any_plan.as_ref().and_then(|plan| plan.prediction.clone()),
        prompt_seconds: totals.prompt_seconds,
        prompt_tokens: totals.prompt_tokens,
        reuse: (totals.reuse.picks() > 0).then(|| totals.reuse.clone()),
        read_bytes: totals.bytes_read,
        busy_seconds: totals.disk_busy_seconds,
        expert_reads: plan.as_ref().and_then(|plan| {
            let experts = plan.experts.as_ref()?;
            let served = totals.reuse.hit_rate(crate::plan::cached_units(plan), experts.moe_layers)?;
            let modelled = totals.reuse.picks() as f64 * (1.0 - served) * experts.unit_bytes as f64;
            let read = totals.demand_bytes() as f64 - (totals.graphs * experts.dense_streamed_bytes) as f64;
            Some((read, modelled))
        }),
        io_bound_tokens_per_sec: plan.as_ref().and_then(|plan| plan.io_bound_tokens_per_sec),
        threads: options.threads,
        repack: hypura.as_ref().map_or(options.engine.repack, |side| side.engine.repacked()),
        reps: options.reps,
        hypura_version: env!("CARGO_PKG_VERSION"),
        llama_build: hypura_sys::llama_build_info(),
        hypura_load_seconds: hypura.as_ref().map(|side| side.engine.load_duration().as_secs_f64()),
        llama_cpp_load_seconds: peer.as_ref().map(|peer| peer.load_duration().as_secs_f64()),
        llama_cpp_load_mode: options.peer.as_ref().map(|config| {
            if config.load_mode == hypura_sys::LoadMode::Mmap {
                "mmap"
            } else {
                "no-mmap"
            }
        }),
        llama_cpp_repack: options.peer.as_ref().map(|config| config.repack && hypura_sys::repacking_available()),
        llama_cpp_placement: peer.as_ref().map(|peer| peer.placement().to_string()),
        results: vec![result(format!("pp{}", options.n_prompt), hypura_pp_samples, peer_pp_samples), tg],
        hypura_output_sha256: hypura_tokens.as_deref().map(token_hash),
        same_output: match (&peer_tokens, &hypura_tokens) {
            (Some(theirs), Some(ours)) => Some(theirs == ours),
            _ => None,
        },
        llama_cpp_output_sha256: peer_tokens.as_deref().map(token_hash),
    })
}

/// A llama-bench-like markdown table.
pub fn render(report: &BenchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| model | size | params | mode | threads | test | hypura t/s | llama.cpp t/s | ratio |");
    let _ = writeln!(out, "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |");
    for result in &report.results {
        let peer = result
            .llama_cpp
            .as_ref()
            .map_or_else(|| "-".to_string(), |rate| format!("{:.2} ± {:.2}", rate.mean, rate.sd));
        let ratio = result.ratio.map_or_else(|| "-".to_string(), |ratio| format!("{ratio:.3}"));
        let ours =
            result.hypura.as_ref().map_or_else(|| "-".to_string(), |rate| format!("{:.2} ± {:.2}", rate.mean, rate.sd));
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} M | {} | {} | {} | {} | {} | {} |",
            report.model_description,
            crate::format::format_bytes(report.file_bytes),
            report.n_params as f64 / 1e6,
            report.mode,
            report.threads,
            result.test,
            ours,
            peer,
            ratio
        );
    }
    if let Some(bytes) = report.bytes_read_per_token {
        let experts = report.expert_hit_rate.is_some();
        let _ = writeln!(
            out,
            "\nstreaming: {:.1} MB read per token (plan: {}{:.1} MB{}{}), compute waited for I/O {:.0}% of the time{}",
            bytes / 1e6,
            // An expert plan streams its worst case, every pick a miss; what a token reads is
            // what the caches miss.
            if experts { "at most " } else { "" },
            report.planned_bytes_per_token.unwrap_or(0) as f64 / 1e6,
            // Dense layers in slots reuse their pages without moving any, so only a share of
            // moved pages is worth a word.
            report
                .recycled_fraction
                .filter(|&share| share > 0.0)
                .map_or_else(String::new, |share| format!(", {:.0}% into pages of evicted units", 100.0 * share)),
            report.warm_bytes_per_token.map_or_else(String::new, |warm| format!(
                "; {:.1} MB of it the host cache's warm fill, which no token asked for and the limit leaves out",
                warm / 1e6
            )),
            100.0 * report.stall_fraction.unwrap_or(0.0),
            report.io_bound_tokens_per_sec.map_or_else(String::new, |bound| if experts {
                format!("; at least {bound:.2} tok/s from the disk were every pick a miss")
            } else {
                format!("; disk bound {bound:.2} tok/s")
            })
        );
        if let (Some(hits), Some(uploads)) = (report.gpu_expert_hit_rate, report.gpu_upload_bytes_per_token) {
            let _ = writeln!(
                out,
                "expert tiers: {:.1}% of picks from the GPU's slots, {:.1}% from the host cache, the rest from disk; {:.1} MB uploaded to the GPU per token",
                100.0 * hits,
                100.0 * (1.0 - hits) * report.expert_hit_rate.unwrap_or(0.0),
                uploads / 1e6
            );
        }
        if let Some([share, cpu, wait]) = report.split_cpu_share_seconds_wait {
            let _ = writeln!(
                out,
                "split: {:.1}% of picks computed by the CPU beside the GPU, {:.2} ms a token, of which the GPU waited {:.2} ms at the layers' sums",
                100.0 * share,
                cpu * 1e3,
                wait * 1e3
            );
        }
        if let Some(stop) = report.pool_limit.map(|pool| pool.stop).filter(|stop| stop.stops_per_token > 0.0) {
            let micros = |seconds: f64| seconds * 1e6;
            let _ = writeln!(
                out,
                "pool stops: {:.1} a token, each {:.1} us of the host's (the ids read and written {:.1} us, experts moved {:.1} us), after the callback's questions about the {:.0} nodes since the stop before {:.1} us and its segment launched, computed and synchronised {:.1} us",
                stop.stops_per_token,
                micros(stop.host_seconds),
                micros(stop.ids_seconds),
                micros(stop.transfer_seconds),
                stop.asked_nodes,
                micros(stop.asks_seconds),
                micros(stop.segment_seconds)
            );
        }
        if let (Some(limit), Some(fraction), Some(rate)) =
            (report.limit_tokens_per_sec, report.limit_fraction, report.disk_bytes_per_sec)
        {
            let source = match report.profile_disk_bytes_per_sec {
                Some(profile) if profile < rate => {
                    format!("tg's reads while busy, faster than the profile's {:.2} GB/s", profile / 1e9)
                }
                Some(_) => "the profile's".to_string(),
                None => "tg's reads while busy".to_string(),
            };
            let compute = report.pool_limit.map_or_else(
                || "this run's compute".to_string(),
                |pool| {
                    let this_run = (pool.device_seconds_per_token + pool.host_seconds_per_token) * 1e3;
                    let gpu = match pool.resident_seconds_per_token {
                        Some(_) => format!(
                            "the GPU's compute, {:.2} ms a token: the model resident on the GPU as an earlier run here measured it (this run's {this_run:.2} ms: the host's {:.2} ms at the pool's stops, the GPU's side {:.2} ms with the gaps the stops leave on the device)",
                            pool.device_compute_seconds_per_token() * 1e3,
                            pool.host_seconds_per_token * 1e3,
                            pool.device_seconds_per_token * 1e3,
                        ),
                        None => format!(
                            "the GPU's side, {:.2} ms a token: this run's {this_run:.2} ms less the host's {:.2} ms at the pool's stops, the gaps the stops leave on the device still in it (a run of the model resident on the GPU would give the GPU's compute alone)",
                            pool.device_seconds_per_token * 1e3,
                            pool.host_seconds_per_token * 1e3,
                        ),
                    };
                    let cpu = pool.cpu_bytes_per_sec.map_or_else(
                        || "no CPU rate recorded here yet".to_string(),
                        |rate| format!("the CPU at {:.1} GB/s", rate / 1e9),
                    );
                    format!(
                        "{gpu}; the slots' misses {:.2} ms a token: {:.1} MB over the bus at {:.1} GB/s and {cpu} together (this run's transfers took {:.2} ms);",
                        pool.miss_seconds_per_token() * 1e3,
                        pool.miss_bytes_per_token / 1e6,
                        pool.bus_bytes_per_sec / 1e9,
                        pool.bus_seconds_per_token * 1e3,
                    )
                },
            );
            let _ = writeln!(out, "physical limit {limit:.2} tok/s ({compute} reads per pass, the disk at {:.2} GB/s, {source}): tg reached {fraction:.2} of it", rate / 1e9);
        }
        if let (Some(busy), Some(rate), Some(limit), Some(fraction)) = (
            report.disk_busy_fraction,
            report.busy_read_bytes_per_sec,
            report.busy_limit_tokens_per_sec,
            report.busy_limit_fraction,
        ) {
            let _ = writeln!(
                out,
                "disk: reads in flight {:.0}% of tg's time at {:.2} GB/s (idle {:.0}%); the limit at that rate {limit:.2} tok/s: tg's passes reached {fraction:.2} of it",
                100.0 * busy,
                rate / 1e9,
                100.0 * (1.0 - busy)
            );
        }
    }
    for (side, bytes, round_trips) in [
        ("hypura", report.link_bytes_per_token, report.link_round_trips_per_token),
        ("llama.cpp", report.llama_cpp_link_bytes_per_token, report.llama_cpp_link_round_trips_per_token),
    ] {
        if let (Some(bytes), Some(round_trips)) = (bytes, round_trips) {
            let _ = writeln!(out, "links ({side}): {:.1} KB and {round_trips:.1} round trips per decoded token over the RPC workers' links", bytes / 1e3);
        }
    }
    if let Some(predicted) = report.predicted_seconds_per_token {
        let measured = report
            .results
            .iter()
            .find(|result| result.test.starts_with("tg"))
            .and_then(|result| result.hypura.as_ref())
            .map(|rate| 1.0 / rate.mean.max(1e-9));
        let _ = writeln!(
            out,
            "time per token: predicted {:.1} ms, measured {}",
            predicted * 1e3,
            measured.map_or_else(|| "-".to_string(), |seconds| format!("{:.1} ms (tg)", seconds * 1e3))
        );
    }
    if let (Some(acceptance), Some(per_pass)) = (report.draft_acceptance, report.tokens_per_pass) {
        let _ = writeln!(
            out,
            "speculation: {:.1}% of drafted tokens accepted, {per_pass:.2} tokens per pass{}",
            100.0 * acceptance,
            report
                .bytes_read_per_generated_token
                .map_or_else(String::new, |bytes| format!(", {:.1} MB read per generated token", bytes / 1e6))
        );
    }
    let load = |seconds: Option<f64>| seconds.map_or_else(|| "-".to_string(), |seconds| format!("{seconds:.2} s"));
    let _ = writeln!(
        out,
        "\nload: hypura {} | llama.cpp {} ({})",
        load(report.hypura_load_seconds),
        load(report.llama_cpp_load_seconds),
        match (report.llama_cpp_load_mode, report.llama_cpp_repack) {
            (Some(mode), Some(repack)) => format!("{mode}, repack {}", if repack { "on" } else { "off" }),
            _ => "not run".to_string(),
        }
    );
    if let Some(placement) = &report.llama_cpp_placement {
        let _ = writeln!(out, "llama.cpp placement: {placement}");
    }
    if let Some(peak) = report.peak_memory_bytes {
        let _ = writeln!(out, "peak memory: {}", crate::format::format_bytes(peak));
    }
    if let (Some(same), Some(hash)) = (report.same_output, &report.hypura_output_sha256) {
        let _ =
            writeln!(out, "greedy output after the pp prompt identical to llama.cpp: {same} (sha256 {})", &hash[..16]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooled decode's limit: the device's compute is tg's less the host's work at the stops,
    /// the bus is the transfers' time at the rate they ran; no pool, no such terms.
    #[test]
    fn a_pooled_decodes_limit_leaves_the_hosts_work_at_the_stops_out() {
        let pool = crate::store::PoolSnapshot {
            upload_bytes: 4_000_000,
            copied_back_bytes: 1_000_000,
            transfer_seconds: 0.005,
            host_seconds: 0.022,
            ..Default::default()
        };
        let totals =
            TgTotals { graphs: 11, generated: 10, compute_seconds: 0.1, layer_visits: 44, pool, ..Default::default() };
        let limit = PoolLimit::from_totals(&totals, None, None).expect("a pooled run");
        assert!((limit.host_seconds_per_token - 0.002).abs() < 1e-12, "{limit:?}");
        assert!((limit.device_seconds_per_token - 0.008).abs() < 1e-12, "{limit:?}");
        assert!((limit.bus_seconds_per_token - 0.005 / 11.0).abs() < 1e-12, "{limit:?}");
        assert!((limit.bus_bytes_per_sec - 1e9).abs() < 1.0, "{limit:?}");
        assert_eq!((limit.work.moved_bytes, limit.work.stops), (5_000_000, 44), "{limit:?}");
        assert!((limit.work.host_seconds - 0.017).abs() < 1e-12, "{limit:?}");
        let unpooled = TgTotals { graphs: 11, generated: 10, compute_seconds: 0.1, ..Default::default() };
        assert_eq!(PoolLimit::from_totals(&unpooled, Some(0.005), None), None);
        assert!((limit.device_compute_seconds_per_token() - 0.008).abs() < 1e-12, "{limit:?}");
        // The model resident on the device, recorded: the GPU's compute without the stops' gaps;
        // never more than this run's own GPU side (the limit stays a limit).
        let resident = PoolLimit::from_totals(&totals, Some(0.005), None).expect("a pooled run");
        assert!((resident.device_compute_seconds_per_token() - 0.005).abs() < 1e-12, "{resident:?}");
        let slower = PoolLimit::from_totals(&totals, Some(0.02), None).expect("a pooled run");
        assert!((slower.device_compute_seconds_per_token() - 0.008).abs() < 1e-12, "{slower:?}");
        // What the stops cost the device, for the next plan: its side beyond the resident time
        // (3 ms a pass over 11 passes, at 44 stops), none without that time, none below it.
        assert_eq!((limit.work.gap_stops, limit.work.device_gap_seconds), (0, 0.0), "{limit:?}");
        assert_eq!(resident.work.gap_stops, 44, "{resident:?}");
        assert!((resident.work.device_gap_seconds - 0.033).abs() < 1e-12, "{resident:?}");
        assert_eq!((slower.work.gap_stops, slower.work.device_gap_seconds), (44, 0.0), "{slower:?}");
    }

    /// A stop's split is each total over the stops it belongs to: the callback's questions
    /// over the stops that had a stop before them in their graph; no stops, all zero.
    #[test]
    fn a_stops_split_divides_each_part_by_its_own_stops() {
        let pool = crate::store::PoolSnapshot {
            stops: 40,
            host_seconds: 0.004,
            ids_seconds: 0.002,
            transfer_seconds: 0.001,
            asked_stops: 30,
            asks_seconds: 0.0003,
            asked_nodes: 2_880,
            segment_seconds: 0.008,
            ..Default::default()
        };
        let split = StopSplit::of(&pool, 10.0);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(split.stops_per_token, 4.0) && close(split.host_seconds, 1e-4), "{split:?}");
        assert!(close(split.ids_seconds, 5e-5) && close(split.transfer_seconds, 2.5e-5), "{split:?}");
        assert!(close(split.asks_seconds, 1e-5) && close(split.asked_nodes, 96.0), "{split:?}");
        assert!(close(split.segment_seconds, 2e-4), "{split:?}");
        let none = StopSplit::of(&crate::store::PoolSnapshot::default(), 10.0);
        assert_eq!(
            (none.stops_per_token, none.host_seconds, none.asks_seconds, none.asked_nodes),
            (0.0, 0.0, 0.0, 0.0)
        );
    }
}
