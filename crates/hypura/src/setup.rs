//! Assembling a run, above the engine: the machine facts read from `hw` (budgets, reserves,
//! the disk's measured rates, the compute time earlier runs measured), the planner's choice
//! made with them (`plan::choose`), and the engine options that load it. The CLI and the server
//! both call `prepare`; the CLI only parses flags into a `RunSpec`.
use std::path::Path;

use crate::engine::{EngineError, EngineOptions, Speculation};
use crate::format::format_bytes;
use crate::hw::{default_cache_dir, machine_key, memory_info, ModelRecords, ProfileCache};
use crate::model::Inventory;
use crate::plan::{self, Ask, Choice, MachineFacts, Plan, PlanOptions};

/// What a run asks for, in library types. `None` means the machine's default.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Context length of each sequence in tokens: None chooses it from the budget, Some(0) is
    /// the model's training context (`plan::context_for`).
    pub n_ctx_seq: Option<u32>,
    /// Sequences decoded together (the server's parallel requests); the plan reserves KV cache
    /// for each.
    pub n_sequences: u32,
    /// Logical and physical batch size for prompt processing.
    pub n_batch: u32,
    /// The user did not choose `n_batch` (`Ask::grow_batch`).
    pub grow_batch: bool,
    pub n_threads: Option<i32>,
    /// Let llama.cpp repack CPU weights (resident mode only; streaming never repacks).
    pub repack: bool,
    pub load_mode: hypura_sys::LoadMode,
    /// Batch-invariant kernels (see `EngineOptions::batch_invariant`).
    pub batch_invariant: bool,
    pub memory_budget_bytes: Option<u64>,
    /// Device memory for the GPU tier; Some(0) turns it off.
    pub gpu_budget_bytes: Option<u64>,
    /// Reader threads for streaming; None: the profile's best queue depth.
    pub io_workers: Option<usize>,
    /// Record the router's choices (expert-stream).
    pub trace_routing: bool,
    /// Mode, window, expert cache and prefetch choices (the search sets its `n_ctx`,
    /// `n_sequences` and `n_ubatch` from the fields above).
    pub plan: PlanOptions,
    /// Speculative decoding; a draft model's memory comes out of the budget before the plan. A
    /// draft length (`n_max`) of 0 and a negative `p_min` are chosen with the plan
    /// (`Speculation::defaults_for`).
    pub speculation: Option<Speculation>,
    /// Connected RPC workers, whose devices the plan may put the last layers on.
    pub remote: Option<std::sync::Arc<crate::remote::Workers>>,
    /// The prompt cache on disk (`EngineOptions::prompt_cache`).
    pub prompt_cache: Option<crate::engine::prompt_cache::PromptCacheOptions>,
}

impl RunSpec {
    /// The planning half of the spec: the planner's options with the MTP layers planned in host
    /// memory where they draft (`draft-mtp`), without a draft model (no file is read).
    pub fn ask(&self) -> Ask {
        Ask {
            n_ctx_seq: self.n_ctx_seq,
            n_sequences: self.n_sequences.max(1),
            n_batch: self.n_batch,
            grow_batch: self.grow_batch,
            options: PlanOptions {
                mtp: self.speculation.as_ref().is_some_and(Speculation::uses_mtp),
                ..self.plan.clone()
            },
            draft: None,
        }
    }

    /// `ask`, with the draft model's index where one drafts (its memory is set aside).
    pub fn ask_with_draft(&self) -> Result<Ask, EngineError> {
        let draft = self
            .speculation
            .as_ref()
            .and_then(|speculation| speculation.draft_model.as_deref())
            .map(Inventory::open)
            .transpose()?;
        Ok(Ask { draft, ..self.ask() })
    }
}

impl Default for RunSpec {
    fn default() -> Self {
        let engine = EngineOptions::default();
        RunSpec {
            n_ctx_seq: None,
            n_sequences: 1,
            n_batch: engine.n_batch,
            grow_batch: false,
            n_threads: None,
            repack: engine.repack,
            load_mode: engine.load_mode,
            batch_invariant: engine.batch_invariant,
            memory_budget_bytes: None,
            gpu_budget_bytes: None,
            io_workers: None,
            trace_routing: false,
            plan: PlanOptions::default(),
            speculation: None,
            remote: None,
            prompt_cache: None,
        }
    }
}

impl RunSpec {
    /// CPU threads a context gets: the spec's, or llama.cpp's default.
    pub fn threads(&self) -> i32 {
        self.n_threads.unwrap_or_else(|| hypura_sys::ContextParams::default().n_threads)
    }
}

/// A run ready to load: the inventory the plan was made from, the facts it was made with, and
/// the engine options that carry it.
pub struct Setup {
    pub inventory: Inventory,
    /// The machine facts the plan was chosen with (before a draft model's memory was set
    /// aside: the plan's `BudgetUse::draft_bytes` holds that).
    pub facts: MachineFacts,
    pub options: EngineOptions,
}

impl Setup {
    pub fn plan(&self) -> &Plan {
        self.options.plan.as_ref().expect("a setup always has a plan")
    }
}

/// The planner's choice for `spec` on `facts` (what `prepare` loads and `inspect` prints).
pub fn choose(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> Result<Choice, EngineError> {
    Ok(plan::choose(inventory, facts, &spec.ask_with_draft()?)?)
}

/// Open the model's index, read the machine facts once, plan, and build the engine options.
pub fn prepare(path: &Path, spec: &RunSpec) -> Result<Setup, EngineError> {
    let inventory = Inventory::open(path)?;
    let facts = machine_facts(spec, &inventory)?;
    let Choice { n_ctx_seq, n_batch, plan } = choose(&inventory, spec, &facts)?;
    let mode = plan.mode;
    let options = EngineOptions {
        n_ctx_seq,
        n_batch,
        n_ubatch: n_batch,
        n_seq_max: spec.n_sequences.max(1),
        n_threads: spec.n_threads,
        repack: spec.repack,
        load_mode: spec.load_mode,
        batch_invariant: spec.batch_invariant,
        plan: Some(plan),
        io_workers: facts.read_queue_depth.map_or(DEFAULT_IO_WORKERS, |depth| depth as usize),
        trace_routing: spec.trace_routing,
        speculation: spec.speculation.clone().map(|mut speculation| {
            let (n_max, p_min) = Speculation::defaults_for(mode);
            if speculation.params.n_max == 0 {
                speculation.params.n_max = n_max.max(speculation.params.n_min);
            }
            if speculation.params.p_min < 0.0 {
                speculation.params.p_min = p_min;
            }
            speculation
        }),
        remote: spec.remote.clone(),
        prompt_cache: spec.prompt_cache.clone(),
        kv: spec.plan.kv,
        ..EngineOptions::default()
    };
    Ok(Setup { inventory, facts, options })
}

/// The context each sequence of a run of `spec` gets on this machine, chosen as the planner
/// chooses it (`plan::context_for`: the asked length up to the trained one, or, where none is
/// asked, the default chosen from the budget) without planning the rest and without a draft model's
/// memory set aside. The server reports it for a model it has not loaded yet.
pub fn context(path: &Path, spec: &RunSpec) -> Result<u32, EngineError> {
    let inventory = Inventory::open(path)?;
    let facts = machine_facts(spec, &inventory)?;
    Ok(plan::context_for(&inventory, &facts, &spec.ask()))
}

/// What one run measured about its model, for the next plan of it (`record_run`).
#[derive(Clone, Debug, Default)]
pub struct RunMeasurements {
    pub threads: i32,
    /// The run streamed (its decode compute is the streaming kernels' and hooks').
    pub streamed: bool,
    /// Decode time per generated token not spent waiting on reads, over `decode_tokens`.
    pub decode_seconds_per_token: Option<f64>,
    pub decode_tokens: u64,
    /// Prompt time and tokens evaluated (resident runs only are kept).
    pub prompt_seconds: f64,
    pub prompt_tokens: u64,
    /// The router's stack distances (expert-stream).
    pub routing: Option<crate::plan::ReuseDepths>,
    /// Bytes read and the time a read was in flight (streaming).
    pub read_bytes: u64,
    pub busy_seconds: f64,
    /// Of a token's weight bytes, the share the run computed on the host's CPU, and the bytes.
    pub host_share: f64,
    pub touched_bytes_per_token: Option<f64>,
    /// The model routes experts (MoE).
    pub routes_experts: bool,
    /// Decode's expert bytes read, and the bytes of the picks an LRU cache of the run's size
    /// missed (benchmarks' tg runs).
    pub expert_reads: Option<(f64, f64)>,
    /// A GPU's expert pool at work (benchmarks' tg runs).
    pub pool: Option<crate::hw::PoolWork>,
    /// The run's plan had a GPU expert pool: its decode time is the device's and the pool's
    /// stops and transfers, not a CPU's share of the weights, so it is kept as the pool's work
    /// only (mixed into the streaming compute record, a share scaled from it predicted whole
    /// layers several times too slow: S6b's `auto` then took the pool, 19.96 tok/s where
    /// llama.cpp made 89.2).
    pub pooled: bool,
}

/// Keep what a run measured for the next plan of this model: a streaming run's decode compute,
/// routing and disk rate, a resident run's decode and prompt time. Failures to write are
/// logged, never fatal (the record is a hint).
pub fn record_run(model: &Path, run: &RunMeasurements) {
    let threads = run.threads.max(1) as u32;
    let result = ModelRecords::new(default_cache_dir()).update(model, |record| fold_run(record, threads, run));
    if let Err(error) = result {
        tracing::warn!("could not record the run's measurements: {error}");
    }
}

/// `run`'s measurements into the model's `record`.
fn fold_run(record: &mut crate::hw::ModelRecord, threads: u32, run: &RunMeasurements) {
    if let Some(seconds) = run.decode_seconds_per_token.filter(|_| run.decode_tokens >= 2) {
        let total = seconds * run.decode_tokens as f64;
        match (run.streamed, run.pooled) {
            (_, true) => {}
            (true, false) => record.add_compute(threads, total, run.decode_tokens, run.host_share),
            (false, false) => record.add_resident(threads, total, run.decode_tokens, run.host_share),
        }
    }
    if !run.streamed {
        record.add_prompt(threads, run.prompt_seconds, run.prompt_tokens, run.host_share);
    }
    if let Some(routing) = &run.routing {
        record.add_routing(routing);
    }
    record.add_reads(run.read_bytes, run.busy_seconds);
    record.touched_bytes_per_token = run.touched_bytes_per_token.or(record.touched_bytes_per_token);
    record.routes_experts = Some(run.routes_experts);
    if let Some((read, modelled)) = run.expert_reads {
        record.add_expert_reads(read, modelled);
    }
    if let Some(pool) = &run.pool {
        record.add_pool(pool);
    }
}

/// Reader threads when the spec does not say, and the most a profile's best queue depth gives:
/// four readers of 4 MiB chunks keep 16 MiB in flight, and more put read-ahead beside the reads
/// the compute waits for (decision 06).
const DEFAULT_IO_WORKERS: usize = crate::hw::STORE_READERS as usize;

/// What the default budget leaves for the rest of the machine: 10% of what is available,
/// between 128 MiB and 2 GiB. The process itself takes about 75 MiB beyond its plan
/// (Qwen2.5-Coder-1.5B streaming in a 450 MiB plan peaked at 503 MiB resident: the vocabulary,
/// the binary, thread stacks), so in a small cgroup the floor leaves that and some page cache.
pub fn headroom_bytes(available: u64) -> u64 {
    (available / 10).clamp(128 << 20, 2 << 30)
}

/// Host memory a GPU backend's runtime takes beside the plan's buffers: a CUDA run of a tiny
/// model peaked at 497 MiB resident on the H200 machine (driver, runtime and cuBLAS state).
const GPU_RUNTIME_HOST_BYTES: u64 = 512 << 20;

/// The default memory budget: what is available less the headroom, and less the GPU
/// runtime's own host memory when a GPU is used.
pub fn default_memory_budget(available: u64, gpu: bool) -> u64 {
    let runtime = if gpu { GPU_RUNTIME_HOST_BYTES } else { 0 };
    available.saturating_sub(headroom_bytes(available) + runtime)
}

/// The machine facts the planner needs: the budget (the spec's, or available memory minus
/// headroom), the disk bandwidth from the cached profile (if `hypura profile` has run), the
/// reader threads, and the compute time per token earlier runs of this model measured.
pub fn machine_facts(spec: &RunSpec, inventory: &Inventory) -> Result<MachineFacts, EngineError> {
    let model = inventory.path.as_path();
    let gpu_free = dedicated_gpu_free(&hypura_sys::Backend::get().devices());
    let gpu_budget_bytes = gpu_budget(spec.gpu_budget_bytes, &gpu_free);
    // Asking a GPU for its free memory already starts its runtime in this process, so its host
    // memory is kept whether or not the plan uses the GPU.
    let memory_budget_bytes = spec
        .memory_budget_bytes
        .unwrap_or_else(|| default_memory_budget(memory_info().effective_available_bytes(), !gpu_free.is_empty()));
    let disk = ProfileCache::new(default_cache_dir()).load(&machine_key()).and_then(|profile| profile.disk);
    let disk_bytes_per_sec = disk.as_ref().map(crate::hw::DiskProfile::streaming_bytes_per_sec);
    let disk_read_points = disk
        .iter()
        .flat_map(|disk| disk.direct.iter())
        .map(|point| (point.block_bytes * u64::from(point.queue_depth), point.bytes_per_sec))
        .collect();
    let io_workers = spec
        .io_workers
        .or_else(|| disk.as_ref().map(|disk| (disk.best_direct.queue_depth as usize).min(DEFAULT_IO_WORKERS)))
        .unwrap_or(DEFAULT_IO_WORKERS)
        .clamp(1, 64);
    let threads = spec.threads().max(1) as u32;
    let record = ModelRecords::new(default_cache_dir()).load(model);
    // Streaming runs of this model read at this rate while busy: where they did, that is the
    // rate streaming gets here, whatever the profile's short reads said.
    let from_runs = record.disk_bytes_per_sec();
    let cpu_rate =
        ModelRecords::new(default_cache_dir()).cpu_bytes_per_sec(threads, model, inventory.hparams.routes_experts());
    Ok(MachineFacts {
        memory_budget_bytes,
        disk_bytes_per_sec: from_runs.or(disk_bytes_per_sec),
        disk_rate_from_runs: from_runs.is_some(),
        profile_disk_bytes_per_sec: disk_bytes_per_sec,
        resident_seconds_per_token: record.resident(threads).map(|(seconds, _)| seconds),
        resident_host_share: record.resident(threads).map(|(_, share)| share),
        prompt_seconds_per_token: record.prompt_seconds_per_token(threads),
        expert_reuse: record.routing.clone(),
        expert_read_factor: record.expert_read_factor(),
        pool_bus_bytes_per_sec: record.pool_bus_bytes_per_sec(),
        pool_stop_host_seconds: record.pool_stop_host_seconds(),
        pool_stop_device_seconds: record.pool_stop_device_seconds(),
        pool_split_bytes_per_sec: record.pool_split_bytes_per_sec(),
        cpu_bytes_per_sec: cpu_rate.map(|rate| rate.bytes_per_sec),
        cpu_rate_of_moe: cpu_rate.is_some_and(|rate| rate.routes_experts),
        read_queue_depth: Some(io_workers as u32),
        disk_read_points,
        compute_seconds_per_token: record.compute(threads).map(|(seconds, _)| seconds),
        compute_host_share: record.compute(threads).map(|(_, share)| share),
        gpu_budget_bytes,
        gpu_runtime_bytes: if gpu_budget_bytes > 0 { GPU_RUNTIME_DEVICE_BYTES } else { 0 },
        remote_devices: spec.remote.as_ref().map(|workers| workers.facts()).unwrap_or_default(),
    })
}

/// Device memory the GPU backend takes beyond the plan's buffers: on the H200 machine, moe-30b
/// with an 8 GiB budget used 297 MiB more than planned, dense-8b with 2 GiB 20 MiB more. Most
/// of that is the compute buffer's copy of a host layer's weights for prompt batches (one
/// moe-30b layer's experts are 349 MiB), which the plan reserves instead where it is larger;
/// the rest is kernels loaded on first use and memory pools.
const GPU_RUNTIME_DEVICE_BYTES: u64 = 384 << 20;

/// Free memory of each dedicated GPU. Devices that share host memory get no tier of their own:
/// the host budget covers them.
pub fn dedicated_gpu_free(devices: &[hypura_sys::DeviceInfo]) -> Vec<u64> {
    devices.iter().filter(|device| device.kind == hypura_sys::DeviceKind::Gpu).map(|device| device.free_bytes).collect()
}

/// Free memory of each dedicated GPU, by name (what `run --stats` compares before and after).
pub fn gpu_free_by_name() -> Vec<(String, u64)> {
    hypura_sys::Backend::get()
        .devices()
        .into_iter()
        .filter(|device| device.kind == hypura_sys::DeviceKind::Gpu)
        .map(|device| (device.name, device.free_bytes))
        .collect()
}

/// The GPU budget asked for (None: the default), checked against GPUs with `gpu_free` bytes free.
fn gpu_budget(asked: Option<u64>, gpu_free: &[u64]) -> u64 {
    let Some(bytes) = asked else {
        let budget = default_gpu_budget(gpu_free);
        if gpu_free.len() > 1 {
            tracing::warn!(
                "{} GPUs: the default GPU budget is the smallest one's free memory less 1 GiB ({}), since llama.cpp may put every planned layer on one of them; --gpu-budget sets it",
                gpu_free.len(),
                format_bytes(budget)
            );
        }
        return budget;
    };
    match gpu_free.iter().copied().min() {
        // A plan with a GPU tier would count the KV cache and the GPU's tensors in device
        // memory that does not exist.
        None if bytes > 0 => {
            tracing::warn!(
                "a GPU budget of {} was given, but ggml sees no dedicated GPU here, so everything runs on the CPU",
                format_bytes(bytes)
            );
            0
        }
        Some(free) if bytes > free => {
            tracing::warn!(
                "the GPU budget of {} is more than the {} free on a GPU here: loading may run out of device memory",
                format_bytes(bytes),
                format_bytes(free)
            );
            bytes
        }
        _ => bytes,
    }
}

/// What the default GPU budget leaves free on each device (llama.cpp's fit leaves the same).
const GPU_RESERVE_BYTES: u64 = 1 << 30;

/// The default GPU budget for dedicated GPUs with `gpu_free` bytes free: one GPU's free
/// memory less a reserve (the smallest GPU's, where there are several). llama.cpp splits the
/// layers across GPUs by their free memory while the plan fills layers from the last one down,
/// so what the plan puts on the GPU can all land on the last card: one card's worth is what is
/// sure to fit.
pub fn default_gpu_budget(gpu_free: &[u64]) -> u64 {
    gpu_free.iter().map(|free| free.saturating_sub(GPU_RESERVE_BYTES)).min().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooled run's decode time is the pool's (stops, transfers), not a CPU's share: it never
    /// enters the compute records a whole-layer plan is predicted from.
    #[test]
    fn a_pooled_run_leaves_the_compute_records_alone() {
        let layers = RunMeasurements {
            threads: 16,
            streamed: true,
            decode_seconds_per_token: Some(0.02),
            decode_tokens: 100,
            host_share: 0.6,
            ..RunMeasurements::default()
        };
        let pooled =
            RunMeasurements { decode_seconds_per_token: Some(0.09), host_share: 0.01, pooled: true, ..layers.clone() };
        let mut record = crate::hw::ModelRecord::default();
        fold_run(&mut record, 16, &layers);
        let before = record.compute(16);
        assert_eq!(before, Some((0.02, 0.6)));
        fold_run(&mut record, 16, &pooled);
        assert_eq!(record.compute(16), before);
        assert_eq!(record.resident(16), None);
        // A run without a pool is folded in.
        fold_run(&mut record, 16, &RunMeasurements { decode_seconds_per_token: Some(0.04), ..layers });
        assert!((record.compute(16).unwrap().0 - 0.03).abs() < 1e-12);
    }

    /// A run says whether its model routes experts, so that MoE models never run here are
    /// estimated at MoE models' CPU rate (`ModelRecords::cpu_bytes_per_sec`).
    #[test]
    fn a_run_records_whether_its_model_routes_experts() {
        let mut record = crate::hw::ModelRecord::default();
        assert_eq!(record.routes_experts, None);
        let moe = RunMeasurements { threads: 2, routes_experts: true, ..RunMeasurements::default() };
        fold_run(&mut record, 2, &moe);
        assert_eq!(record.routes_experts, Some(true));
        fold_run(&mut record, 2, &RunMeasurements { routes_experts: false, ..moe });
        assert_eq!(record.routes_experts, Some(false));
    }

    #[test]
    fn headroom_is_a_tenth_within_limits() {
        assert_eq!(headroom_bytes(2 << 30), (2 << 30) / 10);
        assert_eq!(headroom_bytes(640 << 20), 128 << 20);
        assert_eq!(headroom_bytes(10 << 30), 1 << 30);
        assert_eq!(headroom_bytes(100 << 30), 2 << 30);
    }

    #[test]
    fn a_gpu_leaves_room_for_its_runtime_in_the_default_budget() {
        assert_eq!(default_memory_budget(10 << 30, false), 9 << 30);
        assert_eq!(default_memory_budget(10 << 30, true), (9 << 30) - (512 << 20));
        assert_eq!(default_memory_budget(128 << 20, true), 0);
    }

    #[test]
    fn the_default_gpu_budget_is_one_dedicated_gpu_less_a_reserve() {
        let device = |kind, free: u64| hypura_sys::DeviceInfo {
            name: String::new(),
            description: String::new(),
            kind,
            free_bytes: free,
            total_bytes: free,
        };
        let devices = [
            device(hypura_sys::DeviceKind::Cpu, 64 << 30),
            device(hypura_sys::DeviceKind::Gpu, 24 << 30),
            device(hypura_sys::DeviceKind::Gpu, 12 << 30),
            device(hypura_sys::DeviceKind::Gpu, 512 << 20),
        ];
        let budget = |devices: &[hypura_sys::DeviceInfo]| default_gpu_budget(&dedicated_gpu_free(devices));
        assert_eq!(budget(&devices[..2]), 23 << 30);
        // Several GPUs: the smallest one's, since the plan's layers may all land on one card.
        assert_eq!(budget(&devices[..3]), 11 << 30);
        assert_eq!(budget(&devices), 0);
        assert_eq!(budget(&devices[..1]), 0);
    }

    #[test]
    fn a_gpu_budget_without_a_gpu_turns_the_tier_off() {
        assert_eq!(gpu_budget(Some(8 << 30), &[]), 0);
        assert_eq!(gpu_budget(Some(0), &[]), 0);
        assert_eq!(gpu_budget(Some(8 << 30), &[4 << 30]), 8 << 30);
        assert_eq!(gpu_budget(None, &[4 << 30]), 3 << 30);
    }
}
