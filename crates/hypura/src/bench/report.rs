//! What a benchmark reports: the per-test rates of both sides, the streaming, pool and link
//! figures of Hypura's tg runs with their physical limits (`BenchReport`, also its JSON), and the
//! llama-bench-like text of it (`render`).
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;

/// The device's and the bus's terms of a pooled decode's limit (`BenchReport::pool_limit`), the
/// store's arithmetic with its totals in the model record's form.
pub type PoolLimit = crate::store::PoolLimit<crate::hw::PoolWork>;

/// Tokens per second over repetitions.
#[derive(Clone, Debug, Serialize)]
pub struct Rate {
    pub mean: f64,
    pub sd: f64,
    pub samples: Vec<f64>,
}

impl Rate {
    pub(super) fn from_samples(samples: Vec<f64>) -> Rate {
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

impl TestResult {
    /// A test's rates on each side that ran it, and their ratio where both did.
    pub(super) fn from_samples(test: String, ours: Vec<f64>, theirs: Vec<f64>) -> TestResult {
        let hypura = (!ours.is_empty()).then(|| Rate::from_samples(ours));
        let llama_cpp = (!theirs.is_empty()).then(|| Rate::from_samples(theirs));
        let ratio = match (&hypura, &llama_cpp) {
            (Some(ours), Some(theirs)) => Some(ours.mean / theirs.mean),
            _ => None,
        };
        TestResult { test, hypura, llama_cpp, ratio }
    }
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
    /// Streaming, over tg runs: the physical limit with this run's compute per decode and the
    /// decodes' own bytes read per decode (the start token's pass is not timed) at
    /// `disk_bytes_per_sec` (the profile's streaming rate, or tg's rate while
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

/// A llama-bench-like markdown table, and beneath it the tg runs' streaming, links, prediction,
/// speculation, load and output.
pub fn render(report: &BenchReport) -> String {
    let mut out = String::new();
    table(&mut out, report);
    if let Some(bytes) = report.bytes_read_per_token {
        streaming(&mut out, report, bytes);
        expert_tiers(&mut out, report);
        pool_stops(&mut out, report);
        physical_limit(&mut out, report);
        disk_busy(&mut out, report);
    }
    links(&mut out, report);
    time_per_token(&mut out, report);
    speculation(&mut out, report);
    load_and_output(&mut out, report);
    out
}

/// The table: a row per test, each side's mean and deviation, and their ratio.
fn table(out: &mut String, report: &BenchReport) {
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
}

/// Streaming: bytes read per token against the plan's, the share of them into recycled pages,
/// the warm fill, compute's wait for I/O and the disk's bound.
fn streaming(out: &mut String, report: &BenchReport, bytes: f64) {
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
}

/// Where the picks were served (the GPU's slots, the host cache, the disk), and a split pool's
/// CPU share.
fn expert_tiers(out: &mut String, report: &BenchReport) {
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
}

/// Where a pool's stop spends its time (`StopSplit`).
fn pool_stops(out: &mut String, report: &BenchReport) {
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
}

/// The physical limit, what its compute term was and where the disk's rate came from, and the
/// share of it tg reached.
fn physical_limit(out: &mut String, report: &BenchReport) {
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
        let compute = report.pool_limit.map_or_else(|| "this run's compute".to_string(), |pool| pool_compute(&pool));
        let _ = writeln!(out, "physical limit {limit:.2} tok/s ({compute} reads per pass, the disk at {:.2} GB/s, {source}): tg reached {fraction:.2} of it", rate / 1e9);
    }
}

/// A pooled decode's compute terms: the GPU's compute (resident where recorded) and the slots'
/// misses over the bus and the CPU together.
fn pool_compute(pool: &PoolLimit) -> String {
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
    let cpu = pool.cpu_rate_text();
    format!(
        "{gpu}; the slots' misses {:.2} ms a token: {:.1} MB over the bus at {:.1} GB/s and {cpu} together (this run's transfers took {:.2} ms);",
        pool.miss_seconds_per_token() * 1e3,
        pool.miss_bytes_per_token / 1e6,
        pool.bus_bytes_per_sec / 1e9,
        pool.bus_seconds_per_token * 1e3,
    )
}

/// The disk while tg ran: the share of time with a read in flight, its rate then, and the limit
/// at that rate.
fn disk_busy(out: &mut String, report: &BenchReport) {
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

/// Each side's traffic over the RPC workers' links.
fn links(out: &mut String, report: &BenchReport) {
    for (side, bytes, round_trips) in [
        ("hypura", report.link_bytes_per_token, report.link_round_trips_per_token),
        ("llama.cpp", report.llama_cpp_link_bytes_per_token, report.llama_cpp_link_round_trips_per_token),
    ] {
        if let (Some(bytes), Some(round_trips)) = (bytes, round_trips) {
            let _ = writeln!(out, "links ({side}): {:.1} KB and {round_trips:.1} round trips per decoded token over the RPC workers' links", bytes / 1e3);
        }
    }
}

/// The plan's predicted time per token beside tg's.
fn time_per_token(out: &mut String, report: &BenchReport) {
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
}

/// Speculative decoding: drafts accepted, tokens per pass and bytes per generated token.
fn speculation(out: &mut String, report: &BenchReport) {
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
}

/// Both sides' load times and llama.cpp's load, its placement, the peak memory, and whether
/// the greedy outputs matched.
fn load_and_output(out: &mut String, report: &BenchReport) {
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
}
