//! What earlier runs measured about one model on this machine, kept as a small JSON file under
//! the cache directory so the next plan can use it: the decode compute time per token of
//! streaming runs (it sizes the dense window and states the physical limit). The key is the model file's identity (path,
//! size, modification time) and the machine key, so a changed file or machine starts afresh.
//! The model file itself is only ever read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cache::{fnv1a, machine_key, write_json_atomically};
use super::HwError;

/// Bumped when a field changes meaning; an older record is then ignored.
pub const RECORD_SCHEMA_VERSION: u32 = 1;

/// Measurements of one model on one machine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    pub schema_version: u32,
    pub model_path: PathBuf,
    /// Decode time per token of streaming runs not spent waiting on reads, by CPU thread
    /// count. On a machine with few cores it includes the share of the CPU the reader threads
    /// take, which is what the window must plan around.
    #[serde(default)]
    pub compute_by_threads: BTreeMap<u32, ComputeMeasurement>,
    /// Decode time per token of resident runs, by CPU thread count.
    #[serde(default)]
    pub resident_by_threads: BTreeMap<u32, ComputeMeasurement>,
    /// Prompt time per token of resident runs over prompts of at least `PROMPT_MIN_TOKENS`, by
    /// CPU thread count.
    #[serde(default)]
    pub prompt_by_threads: BTreeMap<u32, ComputeMeasurement>,
    /// How soon the router picked an expert again in streaming runs (expert-stream only).
    #[serde(default)]
    pub routing: Option<crate::plan::ReuseDepths>,
    /// Bytes streaming runs read and the time a read was in flight: the disk's rate as
    /// streaming finds it, which the next plan uses in place of the profile's.
    #[serde(default)]
    pub disk_busy: Option<BusyReads>,
    /// Bytes decode read for experts, and the bytes of the picks an LRU cache of the run's
    /// size missed (`plan::ReuseDepths`), summed over benchmark runs.
    #[serde(default)]
    pub expert_reads: Option<ExpertReads>,
    /// Weight bytes a token of this model touches (all tiers): with a resident run's time on
    /// the CPU alone, this machine's CPU rate for models never run here.
    #[serde(default)]
    pub touched_bytes_per_token: Option<f64>,
    /// Whether the model routes experts (MoE): with the CPU rate above, an estimate for MoE
    /// models never run here (a token's small expert matmuls run well below the rate of a dense
    /// model's: S6's host experts at about 20 GB/s within whole layers' 23.8 ms a token on the
    /// H100 machine's CPU, a dense 1B at 70 GB/s).
    /// None in records from before it was kept.
    #[serde(default)]
    pub routes_experts: Option<bool>,
    /// A GPU's expert pool in benchmark runs, summed (the next plan's stop and bus costs).
    #[serde(default)]
    pub pool: Option<PoolWork>,
    /// The machine the record was made on (`hw::machine_key`).
    #[serde(default)]
    pub machine_key: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertReads {
    pub read_bytes: f64,
    pub modelled_bytes: f64,
}

/// A GPU's expert pool at work: bytes moved over the bus (uploads and copies back) and the time
/// they took; the pool's stops and the host's time at them beside the transfers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolWork {
    pub moved_bytes: u64,
    pub transfer_seconds: f64,
    pub stops: u64,
    pub host_seconds: f64,
    /// Of runs with the same model's resident time on the device recorded: their stops, and
    /// what the device's side took beyond that resident time (the gaps the stops leave there).
    #[serde(default)]
    pub gap_stops: u64,
    #[serde(default)]
    pub device_gap_seconds: f64,
    /// Of split pools' runs: the misses' bytes the CPU computed, and the device's wait for
    /// their sums at the layers' second stops.
    #[serde(default)]
    pub cpu_bytes: u64,
    #[serde(default)]
    pub cpu_wait_seconds: f64,
}

/// This machine's CPU rate over the weight bytes other models' resident runs computed on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuRate {
    pub bytes_per_sec: f64,
    /// The models it is the median of.
    pub models: usize,
    /// Those models route experts.
    pub routes_experts: bool,
}

/// Fewer moved bytes than this say little about the bus's rate (a few dozen experts).
const POOL_MIN_MOVED_BYTES: u64 = 64 << 20;

/// Fewer stops than this say little about their cost (a few tokens of a large MoE).
const POOL_MIN_STOPS: u64 = 1000;

/// Reads of streaming runs, summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BusyReads {
    pub bytes: u64,
    pub seconds: f64,
}

/// Prompts shorter than this are not timed for the prompt rate: a handful of tokens runs
/// below the rate of a batch.
pub const PROMPT_MIN_TOKENS: u64 = 32;

/// Reads fewer than this many bytes say little about the disk's rate.
const DISK_MIN_BYTES: u64 = 64 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeMeasurement {
    pub seconds_per_token: f64,
    /// Tokens the figure averages over.
    pub tokens: u64,
    /// The share of a token's weight bytes the runs computed on the host's CPU (absent in
    /// records from before it was kept: all of them).
    #[serde(default = "all_on_the_host")]
    pub host_share: f64,
}

fn all_on_the_host() -> f64 {
    1.0
}

/// Fold a run's `seconds` over `tokens` into `map`'s entry for `threads`: a running mean over
/// all measured tokens.
fn add_to(map: &mut BTreeMap<u32, ComputeMeasurement>, threads: u32, seconds: f64, tokens: u64, host_share: f64) {
    if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
        return;
    }
    let entry = map.entry(threads).or_insert(ComputeMeasurement { seconds_per_token: 0.0, tokens: 0, host_share: 0.0 });
    let total = entry.tokens + tokens;
    let mean = |then: f64, now: f64| (then * entry.tokens as f64 + now) / total as f64;
    entry.seconds_per_token = mean(entry.seconds_per_token, seconds);
    entry.host_share = mean(entry.host_share, host_share.clamp(0.0, 1.0) * tokens as f64);
    entry.tokens = total;
}

impl ModelRecord {
    /// Fold in a streaming run's decode compute.
    /// `host_share`: of a token's weight bytes, the share the run computed on the host.
    pub fn add_compute(&mut self, threads: u32, seconds: f64, tokens: u64, host_share: f64) {
        add_to(&mut self.compute_by_threads, threads, seconds, tokens, host_share);
    }

    /// Fold in a resident run's decode time.
    pub fn add_resident(&mut self, threads: u32, seconds: f64, tokens: u64, host_share: f64) {
        add_to(&mut self.resident_by_threads, threads, seconds, tokens, host_share);
    }

    /// Fold in a resident run's prompt time (prompts of at least `PROMPT_MIN_TOKENS`).
    pub fn add_prompt(&mut self, threads: u32, seconds: f64, tokens: u64, host_share: f64) {
        if tokens >= PROMPT_MIN_TOKENS {
            add_to(&mut self.prompt_by_threads, threads, seconds, tokens, host_share);
        }
    }

    /// Fold in a streaming run's routing.
    pub fn add_routing(&mut self, depths: &crate::plan::ReuseDepths) {
        if depths.picks() > 0 {
            self.routing.get_or_insert_with(Default::default).add(depths);
        }
    }

    /// Fold in a streaming run's reads: `bytes` with a read in flight for `seconds`.
    pub fn add_reads(&mut self, bytes: u64, seconds: f64) {
        if bytes > 0 && seconds.is_finite() && seconds > 0.0 {
            let busy = self.disk_busy.get_or_insert_with(BusyReads::default);
            busy.bytes += bytes;
            busy.seconds += seconds;
        }
    }

    /// Fold in a run's expert reads against the LRU model's.
    pub fn add_expert_reads(&mut self, read_bytes: f64, modelled_bytes: f64) {
        if read_bytes.is_finite() && modelled_bytes.is_finite() && read_bytes > 0.0 && modelled_bytes > 0.0 {
            let reads = self.expert_reads.get_or_insert_with(ExpertReads::default);
            reads.read_bytes += read_bytes;
            reads.modelled_bytes += modelled_bytes;
        }
    }

    /// Fold in a benchmark's pool work.
    pub fn add_pool(&mut self, work: &PoolWork) {
        let finite = work.transfer_seconds.is_finite() && work.host_seconds.is_finite();
        if finite && work.transfer_seconds >= 0.0 && work.host_seconds >= 0.0 && work.stops > 0 {
            let total = self.pool.get_or_insert_with(PoolWork::default);
            total.moved_bytes += work.moved_bytes;
            total.transfer_seconds += work.transfer_seconds;
            total.stops += work.stops;
            total.host_seconds += work.host_seconds;
            if work.device_gap_seconds.is_finite() && work.device_gap_seconds >= 0.0 && work.gap_stops > 0 {
                total.gap_stops += work.gap_stops;
                total.device_gap_seconds += work.device_gap_seconds;
            }
            if work.cpu_wait_seconds.is_finite() && work.cpu_wait_seconds >= 0.0 {
                total.cpu_bytes += work.cpu_bytes;
                total.cpu_wait_seconds += work.cpu_wait_seconds;
            }
        }
    }

    /// The rate the pool's transfers ran at, once they moved enough to say.
    pub fn pool_bus_bytes_per_sec(&self) -> Option<f64> {
        self.pool
            .filter(|pool| pool.moved_bytes >= POOL_MIN_MOVED_BYTES && pool.transfer_seconds > 0.0)
            .map(|pool| pool.moved_bytes as f64 / pool.transfer_seconds)
    }

    /// The bytes a split pool's CPU computed per second of the device's wait for them (the
    /// misses' cost on the decode's path: what the CPU took beyond the device's own share),
    /// once enough were computed to say.
    pub fn pool_split_bytes_per_sec(&self) -> Option<f64> {
        self.pool
            .filter(|pool| pool.cpu_bytes >= POOL_MIN_MOVED_BYTES && pool.cpu_wait_seconds > 0.0)
            .map(|pool| pool.cpu_bytes as f64 / pool.cpu_wait_seconds)
    }

    /// The host's time at one of the pool's stops, once there were enough to say.
    pub fn pool_stop_host_seconds(&self) -> Option<f64> {
        self.pool.filter(|pool| pool.stops >= POOL_MIN_STOPS).map(|pool| pool.host_seconds / pool.stops as f64)
    }

    /// The device's time at one of the pool's stops (its gaps beyond the model resident there),
    /// once runs beside a resident record made enough stops to say.
    pub fn pool_stop_device_seconds(&self) -> Option<f64> {
        self.pool
            .filter(|pool| pool.gap_stops >= POOL_MIN_STOPS)
            .map(|pool| pool.device_gap_seconds / pool.gap_stops as f64)
    }

    /// Expert bytes read ÷ the LRU model's, within 0.5-4 (outside: the model is off, not the
    /// reads); None without a record.
    pub fn expert_read_factor(&self) -> Option<f64> {
        self.expert_reads.map(|reads| (reads.read_bytes / reads.modelled_bytes).clamp(0.5, 4.0))
    }

    pub fn compute_seconds_per_token(&self, threads: u32) -> Option<f64> {
        self.compute_by_threads.get(&threads).map(|measurement| measurement.seconds_per_token)
    }

    /// Streaming runs' compute and the share of the weights they computed on the host.
    pub fn compute(&self, threads: u32) -> Option<(f64, f64)> {
        self.compute_by_threads.get(&threads).map(|measurement| (measurement.seconds_per_token, measurement.host_share))
    }

    /// Resident runs' decode time and the share of the weights they computed on the host.
    pub fn resident(&self, threads: u32) -> Option<(f64, f64)> {
        self.resident_by_threads
            .get(&threads)
            .map(|measurement| (measurement.seconds_per_token, measurement.host_share))
    }

    pub fn prompt_seconds_per_token(&self, threads: u32) -> Option<f64> {
        self.prompt_by_threads.get(&threads).map(|measurement| measurement.seconds_per_token)
    }

    /// Weight bytes per second a resident run on the CPU alone computed at, for `threads`.
    pub fn cpu_bytes_per_sec(&self, threads: u32) -> Option<f64> {
        let touched = self.touched_bytes_per_token?;
        self.resident(threads)
            .filter(|(_, share)| *share > 0.95)
            .map(|(seconds, _)| touched / seconds)
            .filter(|rate| rate.is_finite() && *rate > 0.0)
    }

    /// The rate streaming runs read at while busy, once they read enough to say.
    pub fn disk_bytes_per_sec(&self) -> Option<f64> {
        self.disk_busy.filter(|busy| busy.bytes >= DISK_MIN_BYTES).map(|busy| busy.bytes as f64 / busy.seconds)
    }
}

/// The records under one cache directory.
#[derive(Clone, Debug)]
pub struct ModelRecords {
    dir: PathBuf,
}

impl ModelRecords {
    pub fn new(cache_dir: impl AsRef<Path>) -> ModelRecords {
        ModelRecords { dir: cache_dir.as_ref().join("measured") }
    }

    /// `<cache>/measured/<hash of machine and file identity>.json`.
    pub fn path_for(&self, model: &Path) -> Option<PathBuf> {
        let canonical = std::fs::canonicalize(model).ok()?;
        let metadata = std::fs::metadata(&canonical).ok()?;
        let modified =
            metadata.modified().ok()?.duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_nanos());
        let key = fnv1a(&[
            machine_key().as_bytes(),
            canonical.as_os_str().as_encoded_bytes(),
            &metadata.len().to_le_bytes(),
            &modified.to_le_bytes(),
        ]);
        Some(self.dir.join(format!("{key:016x}.json")))
    }

    /// The record for `model`, or an empty one (never an error: a record is only a hint).
    pub fn load(&self, model: &Path) -> ModelRecord {
        let empty = ModelRecord {
            schema_version: RECORD_SCHEMA_VERSION,
            model_path: model.to_path_buf(),
            ..ModelRecord::default()
        };
        let Some(path) = self.path_for(model) else { return empty };
        let Ok(text) = std::fs::read_to_string(&path) else { return empty };
        match serde_json::from_str::<ModelRecord>(&text) {
            Ok(record) if record.schema_version == RECORD_SCHEMA_VERSION => record,
            Ok(_) => empty,
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "ignoring an unreadable measurement record");
                empty
            }
        }
    }

    /// The median CPU rate (`ModelRecord::cpu_bytes_per_sec`) of this machine's records of
    /// models other than `except` of its kind (routing experts or not), else of the other kind;
    /// None without one.
    pub fn cpu_bytes_per_sec(&self, threads: u32, except: &Path, routes_experts: bool) -> Option<CpuRate> {
        let except = std::fs::canonicalize(except).unwrap_or_else(|_| except.to_path_buf());
        let key = machine_key();
        let (mut same, mut other): (Vec<_>, Vec<_>) = std::fs::read_dir(&self.dir)
            .ok()?
            .flatten()
            .filter_map(|entry| serde_json::from_str::<ModelRecord>(&std::fs::read_to_string(entry.path()).ok()?).ok())
            .filter(|record| {
                record.schema_version == RECORD_SCHEMA_VERSION && record.machine_key.as_deref() == Some(key.as_str())
            })
            .filter(|record| std::fs::canonicalize(&record.model_path).map_or(true, |path| path != except))
            .filter_map(|record| Some((record.cpu_bytes_per_sec(threads)?, record.routes_experts.unwrap_or(false))))
            .partition(|&(_, routes)| routes == routes_experts);
        let (rates, routes_experts) =
            if same.is_empty() { (&mut other, !routes_experts) } else { (&mut same, routes_experts) };
        rates.sort_by(|a, b| a.0.total_cmp(&b.0));
        let &(bytes_per_sec, _) = rates.get(rates.len() / 2)?;
        Some(CpuRate { bytes_per_sec, models: rates.len(), routes_experts })
    }

    /// Load, change and write back the record of `model` (through a temporary file and a
    /// rename, so a reader never sees half a file).
    pub fn update(&self, model: &Path, change: impl FnOnce(&mut ModelRecord)) -> Result<(), HwError> {
        let Some(path) = self.path_for(model) else { return Ok(()) };
        let mut record = self.load(model);
        change(&mut record);
        record.machine_key = Some(machine_key());
        write_json_atomically(&self.dir, &path, &record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small "model" file and the records under the same temporary directory.
    fn fixture() -> (tempfile::TempDir, PathBuf, ModelRecords) {
        let directory = tempfile::tempdir().unwrap();
        let model = directory.path().join("model.gguf");
        std::fs::write(&model, b"GGUF").unwrap();
        let records = ModelRecords::new(directory.path());
        (directory, model, records)
    }

    #[test]
    fn records_round_trip_and_average_over_tokens() {
        let (directory, model, records) = fixture();
        assert_eq!(records.load(&model).compute_seconds_per_token(2), None);
        records.update(&model, |record| record.add_compute(2, 1.0, 10, 1.0)).unwrap();
        records.update(&model, |record| record.add_compute(2, 3.0, 10, 1.0)).unwrap();
        records.update(&model, |record| record.add_compute(4, 0.0, 10, 1.0)).unwrap();
        let record = records.load(&model);
        assert!((record.compute_seconds_per_token(2).unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(record.compute_by_threads[&2].tokens, 20);
        assert_eq!(record.compute_seconds_per_token(4), None, "a zero time is not a measurement");
        // Only the record, no temporary file.
        assert_eq!(std::fs::read_dir(directory.path().join("measured")).unwrap().count(), 1);
    }

    /// A pool's work adds up across runs and saves through the record; its rate and stop cost
    /// are given only once enough was moved and stopped, and bad figures are not added.
    #[test]
    fn pool_work_adds_up_and_speaks_once_there_is_enough() {
        let (_directory, model, records) = fixture();
        let run = PoolWork {
            moved_bytes: 40 << 20,
            transfer_seconds: 0.01,
            stops: 600,
            host_seconds: 0.03,
            gap_stops: 600,
            device_gap_seconds: 0.024,
            cpu_bytes: 40 << 20,
            cpu_wait_seconds: 0.05,
        };
        records.update(&model, |record| record.add_pool(&run)).unwrap();
        let record = records.load(&model);
        assert_eq!((record.pool_bus_bytes_per_sec(), record.pool_stop_host_seconds()), (None, None));
        assert_eq!((record.pool_stop_device_seconds(), record.pool_split_bytes_per_sec()), (None, None));
        records
            .update(&model, |record| {
                record.add_pool(&run);
                record.add_pool(&PoolWork { host_seconds: f64::NAN, ..run });
                record.add_pool(&PoolWork { stops: 0, ..run });
                // A run without the model's resident time adds no device gap, nor does a bad one.
                record.add_pool(&PoolWork { gap_stops: 0, device_gap_seconds: 0.0, ..run });
                record.add_pool(&PoolWork { device_gap_seconds: f64::INFINITY, ..run });
                record.add_pool(&PoolWork { cpu_wait_seconds: f64::NAN, ..run });
            })
            .unwrap();
        let record = records.load(&model);
        let rate = record.pool_bus_bytes_per_sec().expect("80 MiB moved");
        assert!((rate - (80u64 << 20) as f64 / 0.02).abs() < 1.0, "{rate}");
        let stop = record.pool_stop_host_seconds().expect("2,400 stops");
        assert!((stop - 0.12 / 2400.0).abs() < 1e-12, "{stop}");
        let device = record.pool_stop_device_seconds().expect("1,200 stops beside a resident time");
        assert!((device - 0.048 / 1200.0).abs() < 1e-12, "{device}");
        // Four runs' CPU shares (a bad wait adds none): 160 MiB over 0.2 s of waiting.
        let split = record.pool_split_bytes_per_sec().expect("160 MiB computed");
        assert!((split - (160u64 << 20) as f64 / 0.2).abs() < 1.0, "{split}");
    }

    #[test]
    fn a_changed_file_or_garbage_starts_afresh() {
        let (_directory, model, records) = fixture();
        records.update(&model, |record| record.add_compute(2, 1.0, 10, 1.0)).unwrap();
        let old_path = records.path_for(&model).unwrap();
        std::fs::write(&model, b"GGUF and more").unwrap();
        assert_ne!(records.path_for(&model).unwrap(), old_path, "another size is another file");
        assert_eq!(records.load(&model).compute_seconds_per_token(2), None);
        std::fs::write(records.path_for(&model).unwrap(), "{ not json").unwrap();
        assert_eq!(records.load(&model).compute_seconds_per_token(2), None);
        records.update(&model, |record| record.add_compute(2, 0.5, 5, 1.0)).unwrap();
        assert_eq!(records.load(&model).compute_seconds_per_token(2), Some(0.1));
    }

    #[test]
    fn other_models_resident_runs_give_the_machines_cpu_rate() {
        let (directory, model, records) = fixture();
        let mut other_models = Vec::new();
        for (name, seconds, share) in [("a.gguf", 0.1, 1.0), ("b.gguf", 0.05, 1.0), ("c.gguf", 0.01, 0.2)] {
            let path = directory.path().join(name);
            std::fs::write(&path, name).unwrap();
            records
                .update(&path, |record| {
                    record.add_resident(2, seconds * 10.0, 10, share);
                    record.touched_bytes_per_token = Some(1e9);
                })
                .unwrap();
            other_models.push(path);
        }
        // a: 10 GB/s, b: 20 GB/s; c computed mostly on a GPU and says nothing of the CPU.
        let rate = |threads, except: &Path, routes| {
            records
                .cpu_bytes_per_sec(threads, except, routes)
                .map(|rate| (rate.bytes_per_sec, rate.models, rate.routes_experts))
        };
        assert_eq!(rate(2, &model, false), Some((20e9, 2, false)));
        assert_eq!(rate(2, &other_models[1], false), Some((10e9, 1, false)), "not its own");
        assert_eq!(rate(4, &model, false), None);
        // An MoE model with no MoE model run here: the dense ones' rate, said to be theirs.
        assert_eq!(rate(2, &model, true), Some((20e9, 2, false)));
        // Once one ran, MoE models are estimated at MoE models' rate alone, and dense at dense.
        let moe = directory.path().join("moe.gguf");
        std::fs::write(&moe, "moe").unwrap();
        records
            .update(&moe, |record| {
                record.add_resident(2, 0.25 * 10.0, 10, 1.0);
                record.touched_bytes_per_token = Some(1e9);
                record.routes_experts = Some(true);
            })
            .unwrap();
        assert_eq!(rate(2, &model, true), Some((4e9, 1, true)));
        assert_eq!(rate(2, &model, false), Some((20e9, 2, false)));
    }

    #[test]
    fn prompts_routing_and_reads_fold_in() {
        let (_directory, model, records) = fixture();
        records
            .update(&model, |record| {
                record.add_prompt(2, 1.0, 8, 1.0);
                record.add_prompt(2, 2.0, 100, 1.0);
                record.add_resident(2, 0.5, 10, 0.25);
                record.add_reads(32 << 20, 0.1);
                let mut tracker = crate::plan::ReuseTracker::new(1, 4);
                tracker.record(0, &[1]);
                tracker.record(0, &[1]);
                record.add_routing(tracker.counts());
            })
            .unwrap();
        let record = records.load(&model);
        assert_eq!(record.prompt_seconds_per_token(2), Some(0.02), "the 8-token prompt is not a rate");
        assert_eq!(record.resident(2), Some((0.05, 0.25)));
        assert_eq!(record.disk_bytes_per_sec(), None, "32 MiB says too little");
        assert_eq!(record.routing.as_ref().map(|routing| (routing.first, routing.depths[0])), Some((1, 1)));
        records.update(&model, |record| record.add_reads(64 << 20, 0.3)).unwrap();
        assert_eq!(records.load(&model).disk_bytes_per_sec(), Some(f64::from(96u32 << 20) / 0.4));
    }
}
