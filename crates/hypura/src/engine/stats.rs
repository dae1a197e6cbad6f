//! Statistics of one generation: Ollama's timings, and for streaming modes the bytes read,
//! the stall, and the expert cache's hits. `run --stats`, `bench` and the server's timings
//! all read these numbers.
use std::time::Duration;

use crate::store::{ExpertSnapshot, IoSnapshot, PoolSnapshot};

use super::Engine;
use crate::remote::Traffic;

/// Ollama's statistics, as durations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationStats {
    pub load_duration: Duration,
    /// Tokens actually evaluated for the prompt (a reused prefix is not counted).
    pub prompt_eval_count: u32,
    pub prompt_eval_duration: Duration,
    pub eval_count: u32,
    /// Generated tokens decoded (passes over the weights after the prompt): an answer that
    /// ends on its last sampled token (max tokens, a stop string, a full context) never
    /// decodes that token; one that ends on end-of-generation decoded every counted token.
    pub eval_decodes: u32,
    pub eval_duration: Duration,
    pub total_duration: Duration,
    /// Prompt tokens whose KV entries were reused from an earlier request.
    pub reused_prompt_tokens: u32,
    /// Of those, the tokens loaded from the prompt cache on disk, and the bytes read for them.
    pub prompt_cache_tokens: u32,
    pub prompt_cache_bytes_read: u64,
    /// The conversation's oldest messages left out so that it fits the context (Ollama's
    /// `truncate`).
    pub dropped_messages: u32,
    /// Times the context filled during the answer and shifted (Ollama's `shift`).
    pub context_shifts: u32,
    /// Streaming I/O during this request (streaming modes only). Sequences decoded together
    /// share their reads, so each one counts every read made while it was active.
    pub io: Option<IoSnapshot>,
    /// Traffic over the links to RPC workers (a plan with a remote tier): the request's, and
    /// generation's alone (from the first sampled token).
    pub links: Option<Traffic>,
    pub eval_links: Option<Traffic>,
    /// Expert cache hits and misses during this request (expert-stream only), shared as `io`.
    pub experts: Option<ExpertSnapshot>,
    /// Time the generation phase (after the prompt) waited on streamed reads.
    pub eval_stall: Duration,
    /// The bytes the generation phase read on demand (the host cache's warm fill left out):
    /// the decodes' own reads, without the prompt's. None without streaming.
    pub eval_demand_bytes: Option<u64>,
    /// Speculative decoding: tokens drafted, and how many of them the target accepted.
    pub draft_tokens: u32,
    pub draft_accepted: u32,
}

impl GenerationStats {
    pub fn prompt_tokens_per_sec(&self) -> f64 {
        rate(self.prompt_eval_count, self.prompt_eval_duration)
    }

    /// Ollama's rate: generated tokens over the generation time.
    pub fn eval_tokens_per_sec(&self) -> f64 {
        rate(self.eval_count, self.eval_duration)
    }

    /// Decoded tokens over the generation time: what llama.cpp's `tg` measures.
    pub fn decode_tokens_per_sec(&self) -> f64 {
        rate(self.eval_decodes, self.eval_duration)
    }

    /// Passes over the weights this request made: the prompt's (counted once) and each decode.
    pub fn weight_passes(&self) -> u32 {
        u32::from(self.prompt_eval_count > 0) + self.eval_decodes
    }

    /// Share of the drafted tokens the target accepted; None without a draft.
    pub fn draft_acceptance(&self) -> Option<f64> {
        (self.draft_tokens > 0).then(|| f64::from(self.draft_accepted) / f64::from(self.draft_tokens))
    }

    /// Generated tokens per decode (pass over the weights) after the prompt: 1 without
    /// speculation, more where drafts were accepted. None without a decode.
    pub fn tokens_per_pass(&self) -> Option<f64> {
        (self.eval_decodes > 0).then(|| f64::from(self.eval_count) / f64::from(self.eval_decodes))
    }

    /// Generation time per decoded token that was not spent waiting on reads: the compute term
    /// of the physical limit. None without a decode.
    pub fn eval_compute_seconds_per_token(&self) -> Option<f64> {
        (self.eval_decodes > 0)
            .then(|| self.eval_duration.saturating_sub(self.eval_stall).as_secs_f64() / f64::from(self.eval_decodes))
    }

    /// The rate the disk delivered while at least one read was in flight, the share of the
    /// request's wall time that was so (the rest it idled), and the request's passes against
    /// the limit at that rate (all over the whole request, as the busy time is). None without
    /// reads.
    pub fn disk_while_busy(&self, facts: &LimitFacts) -> Option<DiskWhileBusy> {
        let io = self.io.as_ref()?;
        let limit_at = |rate| self.decode_limit(rate, facts).map(|limit| limit.tokens_per_sec);
        DiskWhileBusy::from_totals(
            io.bytes_read,
            io.busy_seconds,
            self.total_duration.as_secs_f64(),
            u64::from(self.weight_passes()),
            self.tokens_per_weight_pass(),
            limit_at,
        )
    }

    /// The bytes the request's passes read for themselves: all it read less the host cache's
    /// warm fill (`ExpertSnapshot::warm_bytes`), which fills idle time and free room with
    /// units no token asked for. None without reads.
    pub fn demand_bytes_read(&self) -> Option<u64> {
        let warm = self.experts.as_ref().map_or(0, |experts| experts.warm_bytes);
        Some(self.io.as_ref()?.bytes_read.saturating_sub(warm))
    }

    /// Tokens each pass over the weights yielded: 1 without drafts.
    fn tokens_per_weight_pass(&self) -> f64 {
        if self.draft_tokens > 0 {
            self.tokens_per_pass().unwrap_or(1.0)
        } else {
            1.0
        }
    }

    /// The bytes a decode read on demand: the generation phase's over its decodes where known,
    /// else the request's over its passes (the prompt's among them).
    fn decode_bytes_per_pass(&self) -> Option<f64> {
        match self.eval_demand_bytes.filter(|_| self.eval_decodes > 0) {
            Some(bytes) => Some(bytes as f64 / f64::from(self.eval_decodes)),
            None => Some(self.demand_bytes_read()? as f64 / f64::from(self.weight_passes().max(1))),
        }
    }

    /// Where a streaming decode stands against its physical limit at `disk_bytes_per_sec`,
    /// with this run's own figures: its compute per decode while streaming, the bytes a decode
    /// read (not the prompt's: a prompt that read the model whole would lower the decodes'
    /// limit below what they reached) and the tokens each decode yielded. With a device expert
    /// pool the compute term is the pool's (`crate::store::PoolLimit`): the device's time
    /// resident (`facts`, else this run's device side without the host's work at the stops),
    /// or the misses moved over the bus and computed by the CPU at once where that takes
    /// longer; never this run's waits for its own transfers or its CPU share. None without
    /// reads or decodes.
    pub fn decode_limit(&self, disk_bytes_per_sec: f64, facts: &LimitFacts) -> Option<DecodeLimit> {
        let io = self.io.as_ref()?;
        let compute_seconds = match self.pool_limit(facts) {
            Some(pool) => pool.compute_seconds_per_token(),
            None => self.eval_compute_seconds_per_token()?,
        };
        let bytes_per_pass = self.decode_bytes_per_pass()?;
        let tokens_per_sec = crate::plan::limit_tokens_per_sec(
            compute_seconds,
            bytes_per_pass,
            disk_bytes_per_sec,
            self.tokens_per_weight_pass(),
        )?;
        let achieved = if self.draft_tokens > 0 { self.eval_tokens_per_sec() } else { self.decode_tokens_per_sec() };
        let wall = self.total_duration.as_secs_f64();
        Some(DecodeLimit {
            compute_seconds,
            read_seconds: bytes_per_pass / disk_bytes_per_sec,
            tokens_per_sec,
            fraction: achieved / tokens_per_sec,
            disk_busy: if wall > 0.0 { io.bytes_read as f64 / disk_bytes_per_sec / wall } else { 0.0 },
        })
    }

    /// A pooled decode's limit terms from this request's counters (`PoolLimit::from_decode`);
    /// None without a pool's stops or a decode.
    pub fn pool_limit(&self, facts: &LimitFacts) -> Option<crate::store::PoolLimit> {
        let experts = self.experts.as_ref()?;
        let decode = crate::store::PooledDecode {
            pool: experts.device,
            graphs: u64::from(self.weight_passes()),
            generated: u64::from(self.eval_decodes),
            compute_seconds: self.eval_compute_seconds_per_token()? * f64::from(self.eval_decodes),
            layer_visits: experts.layer_visits,
        };
        crate::store::PoolLimit::from_decode(&decode, facts.resident_seconds_per_token, facts.cpu_bytes_per_sec)
    }

    /// The expert hierarchy's figures for the request: picks served by each tier, bytes a pass
    /// over the weights from the disk and over the bus, and each link's rate while it moved
    /// them. None in modes that stream nothing.
    pub fn tiers(&self) -> Option<TierFigures> {
        let io = self.io.as_ref()?;
        let passes = f64::from(self.weight_passes().max(1));
        let experts = self.experts.as_ref();
        let device = experts.map(|experts| &experts.device);
        let bus_bytes = device.map_or(0, PoolSnapshot::bus_bytes);
        let over = |bytes: u64, seconds: f64| (bytes > 0 && seconds > 0.0).then(|| bytes as f64 / seconds);
        Some(TierFigures {
            picks_gpu: device.map_or(0, |device| device.hits),
            picks_host: experts.map_or(0, |experts| experts.hits),
            picks_disk: experts.map_or(0, |experts| experts.misses),
            picks_cpu: device.map_or(0, |device| device.cpu_picks),
            disk_bytes_per_pass: io.bytes_read as f64 / passes,
            warm_bytes_per_pass: experts.map_or(0, |experts| experts.warm_bytes) as f64 / passes,
            bus_bytes_per_pass: bus_bytes as f64 / passes,
            disk_bytes_per_sec: over(io.bytes_read, io.busy_seconds),
            bus_bytes_per_sec: device.and_then(|device| over(bus_bytes, device.transfer_seconds)),
        })
    }
}

/// Where a request's weights came from (`GenerationStats::tiers`): the expert picks each tier
/// served (a GPU pool's slots, the host's expert cache, the disk; whole layers on the GPU are
/// not counted, their experts need no pick), the bytes a pass over the weights moved from the
/// disk and over the bus between host and GPU (uploads and copies back), and each link's rate
/// while it was busy.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierFigures {
    pub picks_gpu: u64,
    pub picks_host: u64,
    pub picks_disk: u64,
    /// Of the host's and the disk's picks, those a split pool's CPU computed (the others were
    /// uploaded to the GPU).
    pub picks_cpu: u64,
    pub disk_bytes_per_pass: f64,
    /// Of `disk_bytes_per_pass`, the host cache's warm fill beside a GPU pool (read while the
    /// disk idled, for no token: `ExpertSnapshot::warm_bytes`).
    pub warm_bytes_per_pass: f64,
    pub bus_bytes_per_pass: f64,
    /// Bytes read ÷ time with a read in flight; None without reads.
    pub disk_bytes_per_sec: Option<f64>,
    /// Bytes moved ÷ the transfers' time; None without a transfer.
    pub bus_bytes_per_sec: Option<f64>,
}

/// The disk as a request found it (`GenerationStats::disk_while_busy`).
#[derive(Clone, Copy, Debug)]
pub struct DiskWhileBusy {
    /// Bytes read ÷ wall time with a read in flight.
    pub bytes_per_sec: f64,
    /// Share of the request's wall time with a read in flight.
    pub busy: f64,
    /// The physical limit with the disk at `bytes_per_sec`, and the request's passes (tokens
    /// per pass included) over its wall time as a share of it.
    pub limit_tokens_per_sec: f64,
    pub fraction: f64,
}

impl DiskWhileBusy {
    /// From a span's totals (one request's, or a benchmark's tg runs'): bytes read, wall time
    /// with a read in flight, wall time, passes over the weights and the tokens each yielded;
    /// `limit_at` is the physical limit at a disk rate. None without reads or time.
    pub fn from_totals(
        bytes_read: u64,
        busy_seconds: f64,
        wall_seconds: f64,
        passes: u64,
        tokens_per_pass: f64,
        limit_at: impl FnOnce(f64) -> Option<f64>,
    ) -> Option<DiskWhileBusy> {
        if bytes_read == 0 || busy_seconds <= 0.0 || wall_seconds <= 0.0 {
            return None;
        }
        let bytes_per_sec = bytes_read as f64 / busy_seconds;
        let limit_tokens_per_sec = limit_at(bytes_per_sec)?;
        Some(DiskWhileBusy {
            bytes_per_sec,
            busy: (busy_seconds / wall_seconds).min(1.0),
            limit_tokens_per_sec,
            fraction: passes as f64 * tokens_per_pass / wall_seconds / limit_tokens_per_sec,
        })
    }
}

/// A decode against its physical limit (`GenerationStats::decode_limit`).
#[derive(Clone, Copy, Debug)]
pub struct DecodeLimit {
    /// Compute per decode while streaming (stall time excluded).
    pub compute_seconds: f64,
    /// Reading one pass's bytes at the disk's rate.
    pub read_seconds: f64,
    /// The limit: tokens per pass ÷ the longer of the two.
    pub tokens_per_sec: f64,
    /// The decode rate reached, as a share of the limit.
    pub fraction: f64,
    /// Bytes read over the request ÷ what the disk reads at its rate in that time.
    pub disk_busy: f64,
}

fn rate(count: u32, duration: Duration) -> f64 {
    if duration.is_zero() {
        0.0
    } else {
        f64::from(count) / duration.as_secs_f64()
    }
}

/// What a pooled decode's limit takes from earlier runs on this machine
/// (`GenerationStats::decode_limit`): the model's decode time resident on the device, and the
/// weight bytes a second the CPU computes. Either may be unknown.
#[derive(Clone, Copy, Debug, Default)]
pub struct LimitFacts {
    pub resident_seconds_per_token: Option<f64>,
    pub cpu_bytes_per_sec: Option<f64>,
}

/// The engine's streaming counters at one moment, to subtract from a later reading.
#[derive(Clone, Debug, Default)]
pub(super) struct Counters {
    io: Option<IoSnapshot>,
    experts: Option<ExpertSnapshot>,
    links: Option<Traffic>,
}

impl Counters {
    pub(super) fn read(engine: &Engine) -> Counters {
        let links = engine.remote_traffic();
        let Some(streaming) = engine.streaming() else { return Counters { links, ..Counters::default() } };
        Counters {
            io: Some(streaming.stats.snapshot()),
            experts: streaming.driver.experts().map(|experts| experts.snapshot()),
            links,
        }
    }

    /// Bytes read on demand so far, the host cache's warm fill left out (None without
    /// streaming).
    pub(super) fn demand_bytes(&self) -> Option<u64> {
        let warm = self.experts.as_ref().map_or(0, |experts| experts.warm_bytes);
        self.io.map(|io| io.bytes_read.saturating_sub(warm))
    }

    /// Seconds spent waiting on reads so far (0 without streaming).
    pub(super) fn stall_seconds(&self) -> f64 {
        self.io.map_or(0.0, |io| io.stall_seconds)
    }

    /// Traffic over the RPC links between `earlier` and `self` (a plan with a remote tier).
    pub(super) fn links_since(&self, earlier: &Counters) -> Option<Traffic> {
        self.links.zip(earlier.links).map(|(now, before)| now.since(before))
    }

    /// What happened since `self`: fills `stats.io`, `stats.experts` and `stats.links`.
    pub(super) fn fill_since(&self, engine: &Engine, stats: &mut GenerationStats) {
        let now = Counters::read(engine);
        stats.links = now.links_since(self);
        if let (Some(before), Some(after)) = (self.io, now.io) {
            stats.io = Some(after - before);
        }
        if let (Some(before), Some(after)) = (self.experts.clone(), now.experts) {
            stats.experts = Some(after - before);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streaming_run(decodes: u32, compute_ms: u64, stall_ms: u64, bytes_per_pass: u64) -> GenerationStats {
        let passes = u64::from(decodes) + 1;
        GenerationStats {
            prompt_eval_count: 8,
            eval_count: decodes + 1,
            eval_decodes: decodes,
            eval_duration: Duration::from_millis(u64::from(decodes) * (compute_ms + stall_ms)),
            eval_stall: Duration::from_millis(u64::from(decodes) * stall_ms),
            total_duration: Duration::from_millis(passes * (compute_ms + stall_ms)),
            io: Some(IoSnapshot { bytes_read: passes * bytes_per_pass, ..IoSnapshot::default() }),
            ..GenerationStats::default()
        }
    }

    #[test]
    fn a_disk_bound_decode_that_waits_only_for_reads_is_at_its_limit() {
        // 100 MB per pass at 1 GB/s is 100 ms; compute 60 ms, stall 40 ms: the limit is 10 tok/s
        // and a decode every 100 ms reaches it.
        let limit = streaming_run(20, 60, 40, 100_000_000).decode_limit(1e9, &LimitFacts::default()).unwrap();
        assert!((limit.read_seconds - 0.1).abs() < 1e-9 && (limit.compute_seconds - 0.06).abs() < 1e-9, "{limit:?}");
        assert!((limit.tokens_per_sec - 10.0).abs() < 1e-6, "{limit:?}");
        assert!((limit.fraction - 1.0).abs() < 1e-6, "{limit:?}");
        assert!((limit.disk_busy - 1.0).abs() < 1e-6, "{limit:?}");
    }

    #[test]
    fn stalls_beyond_the_read_time_fall_short_of_the_limit() {
        // 50 MB per pass reads in 50 ms, compute 60 ms: the limit is 1 / 60 ms; 40 ms of stall
        // per decode makes it 100 ms, 0.6 of the limit, with the disk busy half the time.
        let limit = streaming_run(20, 60, 40, 50_000_000).decode_limit(1e9, &LimitFacts::default()).unwrap();
        assert!((limit.tokens_per_sec - 1.0 / 0.06).abs() < 1e-6, "{limit:?}");
        assert!((limit.fraction - 0.6).abs() < 1e-6, "{limit:?}");
        assert!((limit.disk_busy - 0.5).abs() < 1e-6, "{limit:?}");
        assert!(
            GenerationStats { io: None, ..streaming_run(20, 60, 40, 1) }
                .decode_limit(1e9, &LimitFacts::default())
                .is_none(),
            "a resident run has no streaming limit"
        );
    }

    #[test]
    fn the_limit_at_the_disks_own_rate_counts_its_idle_time() {
        // 21 passes of 100 ms (60 computing, 40 waiting), 100 MB each, with a read in flight
        // for 1.05 s of the 2.1 s: the disk delivered 2 GB/s while busy, so a pass's reads take
        // 50 ms at that rate and compute (60 ms) is the limit: 1 / 60 ms, of which one pass per
        // 100 ms is 0.6, with the disk idle half the time.
        let mut stats = streaming_run(20, 60, 40, 100_000_000);
        stats.io.as_mut().unwrap().busy_seconds = 1.05;
        let disk = stats.disk_while_busy(&LimitFacts::default()).unwrap();
        assert!((disk.bytes_per_sec - 2e9).abs() < 1.0 && (disk.busy - 0.5).abs() < 1e-9, "{disk:?}");
        assert!(
            (disk.limit_tokens_per_sec - 1.0 / 0.06).abs() < 1e-6 && (disk.fraction - 0.6).abs() < 1e-6,
            "{disk:?}"
        );
        // Busy the whole request: the disk was the limit, and the passes reached it.
        stats.io.as_mut().unwrap().busy_seconds = 2.1;
        let disk = stats.disk_while_busy(&LimitFacts::default()).unwrap();
        assert!((disk.busy - 1.0).abs() < 1e-9 && (disk.fraction - 1.0).abs() < 1e-6, "{disk:?}");
        // No busy time recorded (nothing read): no figure.
        stats.io.as_mut().unwrap().busy_seconds = 0.0;
        assert!(stats.disk_while_busy(&LimitFacts::default()).is_none());
    }

    #[test]
    fn the_warm_fill_is_not_a_pass_s_reads() {
        // Beside a device pool the disk reads 100 MB a pass for 100 ms, busy the whole request,
        // but 95 MB of it is the host cache's warm fill: the passes need 5 MB (5 ms at 1 GB/s),
        // so compute (60 ms) is the limit and a pass every 100 ms reaches 0.6 of it, not 1.
        let mut stats = streaming_run(20, 60, 40, 100_000_000);
        stats.io.as_mut().unwrap().busy_seconds = 2.1;
        stats.experts = Some(ExpertSnapshot { warm_bytes: 21 * 95_000_000, ..ExpertSnapshot::default() });
        assert_eq!(stats.demand_bytes_read(), Some(21 * 5_000_000));
        let limit = stats.decode_limit(1e9, &LimitFacts::default()).unwrap();
        assert!((limit.read_seconds - 0.005).abs() < 1e-9, "{limit:?}");
        assert!((limit.tokens_per_sec - 1.0 / 0.06).abs() < 1e-6 && (limit.fraction - 0.6).abs() < 1e-6, "{limit:?}");
        let disk = stats.disk_while_busy(&LimitFacts::default()).unwrap();
        assert!((disk.bytes_per_sec - 1e9).abs() < 1.0 && (disk.fraction - 0.6).abs() < 1e-6, "{disk:?}");
    }

    #[test]
    fn the_prompts_reads_are_not_a_decodes() {
        // The prompt read 2 GB (the model whole), the 20 decodes 50 MB each: at 1 GB/s a
        // decode's reads take 50 ms and compute (60 ms) is the limit, which a decode every
        // 100 ms reaches 0.6 of. Counted over the request's passes, the prompt's reads would
        // make a pass 143 ms and the decodes "1.43" of that limit.
        let mut stats = streaming_run(20, 60, 40, 50_000_000);
        stats.io.as_mut().unwrap().bytes_read = 2_000_000_000 + 20 * 50_000_000;
        let request = stats.decode_limit(1e9, &LimitFacts::default()).unwrap();
        assert!(request.fraction > 1.4, "{request:?}");
        stats.eval_demand_bytes = Some(20 * 50_000_000);
        let limit = stats.decode_limit(1e9, &LimitFacts::default()).unwrap();
        assert!((limit.read_seconds - 0.05).abs() < 1e-9, "{limit:?}");
        assert!((limit.tokens_per_sec - 1.0 / 0.06).abs() < 1e-6 && (limit.fraction - 0.6).abs() < 1e-6, "{limit:?}");
    }

    #[test]
    fn a_split_decodes_wait_for_its_cpu_share_is_not_its_limit() {
        // A split pool: 100 ms a decode, 60 of them "compute", of which the host's work at the
        // stops took 4 ms a pass and most of the rest the device waiting for the CPU's share
        // (100 MB of misses a pass). The model resident on the device decodes in 5 ms and the
        // CPU computes 50 GB/s: the misses take 2 ms, so the limit's compute is 5 ms, the
        // reads (5 MB at 1 GB/s) 5 ms, and the run reaches 0.05 of 200 tok/s, not 0.6 of its
        // own compute.
        let mut stats = streaming_run(20, 60, 40, 5_000_000);
        stats.eval_demand_bytes = Some(20 * 5_000_000);
        let device = crate::store::PoolSnapshot {
            hits: 2_000,
            cpu_picks: 1_000,
            cpu_bytes: 21 * 100_000_000,
            host_seconds: 21.0 * 0.004,
            stops: 21 * 80,
            ..crate::store::PoolSnapshot::default()
        };
        stats.experts = Some(ExpertSnapshot { device, layer_visits: 21 * 40, ..ExpertSnapshot::default() });
        let facts = LimitFacts { resident_seconds_per_token: Some(0.005), cpu_bytes_per_sec: Some(50e9) };
        let limit = stats.decode_limit(1e9, &facts).unwrap();
        assert!((limit.compute_seconds - 0.005).abs() < 1e-9, "{limit:?}");
        assert!((limit.tokens_per_sec - 200.0).abs() < 1e-6 && (limit.fraction - 0.05).abs() < 1e-6, "{limit:?}");
        // Without a resident record the device's side is the run's less the host's work at
        // the stops (the wait within it: only a resident run tells the device's own time)...
        let unknown = stats.decode_limit(1e9, &LimitFacts::default()).unwrap();
        assert!((unknown.compute_seconds - 0.056).abs() < 1e-9, "{unknown:?}");
        // ...and a run without a pool keeps its own compute.
        stats.experts = None;
        assert!((stats.decode_limit(1e9, &facts).unwrap().compute_seconds - 0.06).abs() < 1e-9);
    }

    #[test]
    fn a_pass_that_verifies_drafts_yields_its_tokens() {
        assert_eq!(crate::plan::limit_tokens_per_sec(0.05, 1e8, 1e9, 3.0), Some(30.0));
        assert_eq!(crate::plan::limit_tokens_per_sec(0.0, 0.0, 1e9, 1.0), None);
    }
}
