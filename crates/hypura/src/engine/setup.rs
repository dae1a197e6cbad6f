//! Assembling a run: the machine facts (budgets, reserves, the disk's measured rates, the
//! compute time earlier runs measured), the plan made from them, and the engine options that
//! load it. The CLI and the server both call `prepare`; the CLI only parses flags into a
//! `RunSpec`.
use std::path::Path;

use crate::hw::{default_cache_dir, format_bytes, machine_key, memory_info, ModelRecords, ProfileCache};
use crate::model::Inventory;
use crate::plan::{self, MachineFacts, Plan, PlanOptions};

use super::{EngineError, EngineOptions, Speculation};

/// What a run asks for, in library types. `None` means the machine's default.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// Context length of each sequence in tokens: None chooses it from the budget
    /// (`auto_context`), Some(0) is the model's training context.
    pub n_ctx: Option<u32>,
    /// Sequences decoded together (the server's parallel requests); the plan reserves KV cache
    /// for each.
    pub n_sequences: u32,
    /// Logical and physical batch size for prompt processing.
    pub n_batch: u32,
    /// The user did not choose `n_batch`: a streaming plan may use a larger prompt batch where
    /// the budget holds it (`grow_batch`), and a budget that does not hold the compute buffers
    /// of `n_batch` gets a smaller one before it is refused (`fit_batch`).
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
    /// Mode, window, expert cache and prefetch choices (its `n_ctx` and `n_ubatch` are set
    /// from the fields above).
    pub plan: PlanOptions,
    /// Speculative decoding; a draft model's memory comes out of the budget before the plan. A
    /// draft length (`n_max`) of 0 and a negative `p_min` are chosen with the plan
    /// (`Speculation::defaults_for`).
    pub speculation: Option<Speculation>,
    /// Connected RPC workers, whose devices the plan may put the last layers on.
    pub remote: Option<std::sync::Arc<crate::remote::Workers>>,
}

impl RunSpec {
    /// The planner's options: the spec's, with the MTP layers planned in host memory where they
    /// draft (`draft-mtp`).
    fn plan_options(&self) -> PlanOptions {
        PlanOptions { mtp: self.speculation.as_ref().is_some_and(Speculation::uses_mtp), ..self.plan.clone() }
    }
}

impl Default for RunSpec {
    fn default() -> Self {
        let engine = EngineOptions::default();
        RunSpec {
            n_ctx: None,
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
    pub facts: MachineFacts,
    pub options: EngineOptions,
}

impl Setup {
    pub fn plan(&self) -> &Plan {
        self.options.plan.as_ref().expect("a setup always has a plan")
    }
}

/// Open the model's index, read the machine facts once, plan, and build the engine options.
pub fn prepare(path: &Path, spec: &RunSpec) -> Result<Setup, EngineError> {
    let inventory = Inventory::open(path)?;
    let mut facts = machine_facts(spec, path)?;
    let spec = &set_aside_draft(&inventory, spec, &mut facts)?;
    let (n_ctx, n_batch, plan) = plan_run(&inventory, spec, &facts)?;
    let mode = plan.mode;
    let options = EngineOptions {
        n_ctx,
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
        ..EngineOptions::default()
    };
    Ok(Setup { inventory, facts, options })
}

/// The prompt batch of a draft model's context: its prompt batches are split into ubatches
/// this size, which keeps its compute buffer (the logits of a ubatch) small.
pub const DRAFT_UBATCH: u32 = 64;

/// Take a draft model's memory out of the budget the target is planned in: its weights and
/// compute buffer first, then, once the target's context is chosen in what is left, its KV
/// cache for that context and every sequence. The spec comes back with that context fixed.
fn set_aside_draft(inventory: &Inventory, spec: &RunSpec, facts: &mut MachineFacts) -> Result<RunSpec, EngineError> {
    let Some(path) = spec.speculation.as_ref().and_then(|speculation| speculation.draft_model.as_ref()) else { return Ok(spec.clone()) };
    let draft = Inventory::open(path)?;
    let n_sequences = spec.n_sequences.max(1);
    let weights: u64 = draft.tensors.iter().map(|tensor| tensor.bytes).sum();
    let compute = plan::compute_buffer_bytes(&draft, 0, DRAFT_UBATCH.min(spec.n_batch));
    let too_small = |needed: u64, facts: &MachineFacts| {
        EngineError::Setup(format!(
            "the draft model {} needs {} (weights, KV cache and compute buffer), more than the budget of {}",
            path.display(),
            format_bytes(needed),
            format_bytes(facts.memory_budget_bytes)
        ))
    };
    facts.memory_budget_bytes = facts.memory_budget_bytes.checked_sub(weights + compute).ok_or_else(|| too_small(weights + compute, facts))?;
    let n_ctx = context_for(inventory, spec, facts);
    let kv = plan::context_memory_bytes(&draft, n_ctx.saturating_mul(n_sequences), n_sequences);
    facts.memory_budget_bytes = facts.memory_budget_bytes.checked_sub(kv).ok_or_else(|| too_small(weights + compute + kv, facts))?;
    tracing::info!(
        "the draft model takes {} ({} of weights, {} of KV cache, {} of compute buffer); the target is planned in the {} left",
        format_bytes(weights + compute + kv),
        format_bytes(weights),
        format_bytes(kv),
        format_bytes(compute),
        format_bytes(facts.memory_budget_bytes)
    );
    Ok(RunSpec { n_ctx: Some(n_ctx), ..spec.clone() })
}

/// The plan for this spec and these facts. The KV cache is planned for every sequence.
pub fn plan_for(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> Result<Plan, EngineError> {
    let n_ctx = context_for(inventory, spec, facts);
    let options = PlanOptions { n_ctx: n_ctx.saturating_mul(spec.n_sequences.max(1)), n_sequences: spec.n_sequences.max(1), n_ubatch: spec.n_batch, ..spec.plan_options() };
    plan::plan(inventory, facts, &options).map_err(|error| match error {
        // Say how long a context the budget holds, so that a client can ask for that.
        plan::PlanError::BudgetTooSmall { budget, needed, kv, .. } => {
            let n_sequences = u64::from(spec.n_sequences.max(1));
            let per_token = plan::kv_cache_bytes(inventory, 1).max(1) * n_sequences;
            let rest = needed.saturating_sub(kv);
            if rest >= budget {
                return EngineError::Setup(format!("{error}; even without a KV cache it needs {}", format_bytes(rest)));
            }
            let fits = (budget - rest) / per_token;
            EngineError::Setup(format!("{error}; a context of {n_ctx} tokens for {n_sequences} sequence(s) does not fit: at most {fits} tokens would"))
        }
        other => other.into(),
    })
}

/// The context, the prompt batch and the plan a run gets (what `prepare` loads and `inspect`
/// prints): the batch shrunk to what the budget holds (`fit_batch`), then grown where streaming
/// gains from it (`grow_batch`), for a batch the user did not choose.
///
/// With remote devices, the planner weighs their tier against streaming locally alone at one
/// prompt batch, and local streaming may only fit a smaller batch (the compute buffers of 512
/// tokens of Qwen2.5's vocabulary are 311 MB): each is planned at its own batch here, and the
/// faster prediction wins.
pub fn plan_run(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> Result<(u32, u32, Plan), EngineError> {
    let chosen = plan_run_at_batch(inventory, spec, facts);
    if facts.remote_devices.is_empty() {
        return chosen;
    }
    let local = plan_run_at_batch(inventory, spec, &MachineFacts { remote_devices: Vec::new(), ..facts.clone() });
    match (chosen, local) {
        (Ok((n_ctx, n_batch, mut plan)), Ok(local)) if plan.remote.is_some() => {
            let local_seconds = plan::local_seconds_per_token(facts, &local.2);
            let remote = plan.remote.as_mut().expect("checked above");
            if local_seconds <= remote.predicted_seconds_per_token {
                let why = format!(
                    "streaming locally alone is predicted faster ({:.2} ms per token, prompt batches of {}, against {:.2} ms with {})",
                    local_seconds * 1e3,
                    local.1,
                    remote.predicted_seconds_per_token * 1e3,
                    remote.describe()
                );
                return Ok((local.0, local.1, Plan { remote_unused: Some(why), ..local.2 }));
            }
            remote.local_seconds_per_token = remote.local_seconds_per_token.min(local_seconds);
            Ok((n_ctx, n_batch, plan))
        }
        (Err(_), Ok(local)) => Ok(local),
        (chosen, _) => chosen,
    }
}

/// `plan_run` for the facts as they are (the planner weighs a remote tier at each batch).
fn plan_run_at_batch(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> Result<(u32, u32, Plan), EngineError> {
    // The default context does not depend on the batch (`auto_context`): choose it once for
    // every plan weighed below.
    let n_ctx = context_for(inventory, spec, facts);
    let spec = &RunSpec { n_ctx: Some(n_ctx), ..spec.clone() };
    let (n_batch, plan) = fit_batch(inventory, spec, facts)?;
    let (n_batch, plan) = grow_batch(inventory, &RunSpec { n_batch, ..spec.clone() }, facts, plan);
    Ok((n_ctx, n_batch, plan))
}

/// Prompt batch sizes a budget too small for the default's compute buffers may shrink to,
/// largest first: the logits of a batch alone take 4 bytes × vocabulary × batch (311 MB for
/// Qwen2.5's 152K tokens at 512).
const SMALLER_BATCHES: [u32; 4] = [256, 128, 64, 32];

/// The plan at the spec's prompt batch or, where the budget does not hold that batch's compute
/// buffers and the user did not choose the batch, at the largest smaller one it does hold,
/// said in the log. Refused with the first plan's reason when none fits.
fn fit_batch(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> Result<(u32, Plan), EngineError> {
    let refusal = match plan_for(inventory, spec, facts) {
        Ok(plan) => return Ok((spec.n_batch, plan)),
        Err(refusal) => refusal,
    };
    if !spec.grow_batch {
        return Err(refusal);
    }
    let mut smallest = None;
    for n_batch in SMALLER_BATCHES.into_iter().filter(|&n_batch| n_batch < spec.n_batch) {
        match plan_for(inventory, &RunSpec { n_batch, ..spec.clone() }, facts) {
            Ok(plan) => {
                tracing::info!("prompt batches of {n_batch} tokens: the budget does not hold the compute buffers of {}", spec.n_batch);
                return Ok((n_batch, plan));
            }
            Err(error) => smallest = Some((n_batch, error)),
        }
    }
    // The refusal at the smallest batch says what the budget lacks after every shrink.
    Err(match smallest {
        Some((n_batch, error)) => EngineError::Setup(format!("{error} (with prompt batches shrunk to {n_batch} tokens)")),
        None => refusal,
    })
}

/// Prompt batch sizes a streaming plan weighs, largest first.
const STREAMING_BATCHES: [u32; 8] = [4096, 2048, 1024, 512, 256, 128, 64, 32];

/// The smallest prompt batch a streaming plan takes for the sake of its cache or pinned
/// layers: below it, a long prompt's graphs cost more than the bytes they save.
const MIN_STREAMING_BATCH: u32 = 64;

/// The request a streaming plan's prompt batch is chosen for: a prompt of this many tokens
/// (a system prompt, some history) and an answer of this many.
const REFERENCE_PROMPT_TOKENS: f64 = 2048.0;
const REFERENCE_ANSWER_TOKENS: f64 = 256.0;

/// The prompt batch for a streaming plan. Each batch of prompt tokens is one sweep over the
/// streamed weights, and each generated token another, so a larger batch sweeps a prompt
/// fewer times but its compute buffer (the logits alone are 4 bytes × vocabulary × batch)
/// takes memory from the pinned layers or the expert cache, and every generated token then
/// streams more. The batch (at most the context, the same mode) that streams the fewest bytes
/// for a reference request, `streamed per token × (prompt ÷ batch + answer)`, is taken: on
/// Qwen2.5-Coder-1.5B in 1.2 GiB, 512-token batches stream 436 MiB per token and 128-token ones
/// 162 MiB, so 128 wins even for prompts of 16K tokens. An expert cache serves part of the
/// picks, so an expert plan's bytes are weighed with its misses (`reference_request_bytes`).
/// A resident plan, or a batch the user chose, stays as it is.
fn grow_batch(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts, plan: Plan) -> (u32, Plan) {
    if !spec.grow_batch || plan.mode == plan::Mode::Resident {
        return (spec.n_batch, plan);
    }
    let n_ctx = context_for(inventory, spec, facts);
    let cost = |n_batch: u32, plan: &Plan| reference_request_bytes(inventory, plan, n_batch);
    let mut best = (spec.n_batch, cost(spec.n_batch, &plan), plan);
    for n_batch in STREAMING_BATCHES.into_iter().filter(|&n_batch| n_batch != spec.n_batch && n_batch <= n_ctx && n_batch >= MIN_STREAMING_BATCH.min(spec.n_batch)) {
        let Ok(candidate) = plan_for(inventory, &RunSpec { n_batch, ..spec.clone() }, facts) else { continue };
        let candidate_cost = cost(n_batch, &candidate);
        // A larger batch wins ties: its prompts take fewer graphs.
        let better = candidate_cost < best.1 * 0.99 || (candidate_cost <= best.1 && n_batch > best.0);
        if candidate.mode == best.2.mode && better {
            best = (n_batch, candidate_cost, candidate);
        }
    }
    if best.0 != spec.n_batch {
        tracing::info!("prompt batches of {} tokens: the fewest bytes streamed for a {REFERENCE_PROMPT_TOKENS}-token prompt and a {REFERENCE_ANSWER_TOKENS}-token answer", best.0);
    }
    (best.0, best.2)
}

/// Bytes `plan` streams for the reference request in prompt batches of `n_batch`. A dense
/// window reads all it streams for every pass. An expert plan's passes read the picks its
/// cache misses: routing spread over the experts hits about the share of the streamed experts
/// the cache holds, so the cache's size counts (weighing the worst case alone, every pick a
/// miss, let a larger compute buffer win and shrink the cache to a few units). A prompt batch
/// of `b` tokens picks a share `1 − (1 − k/n)^b` of each layer's experts, a decode `k`; prompt
/// batches are at most what the cache holds the picks of (`max_ubatch`).
fn reference_request_bytes(inventory: &Inventory, plan: &Plan, n_batch: u32) -> f64 {
    let per_pass = plan.streamed_bytes_per_token.max(1) as f64;
    let Some(experts) = plan.experts.as_ref().filter(|experts| experts.n_expert > 0) else {
        return per_pass * (REFERENCE_PROMPT_TOKENS / f64::from(n_batch.max(1)) + REFERENCE_ANSWER_TOKENS);
    };
    let streamed: std::collections::HashSet<&str> = plan.tensors.iter().filter(|tensor| tensor.tier == plan::Tier::Stream).map(|tensor| tensor.name.as_str()).collect();
    let mut layers = std::collections::BTreeSet::new();
    let mut expert_bytes = 0u64;
    for tensor in inventory.expert_tensors().filter(|tensor| streamed.contains(tensor.name.as_str())) {
        expert_bytes += tensor.bytes;
        layers.extend(tensor.layer);
    }
    let k = experts.n_expert_used.clamp(1, experts.n_expert) as f64;
    let decode_experts = layers.len() as f64 * k * experts.unit_bytes as f64;
    let dense = (per_pass - decode_experts).max(0.0);
    let misses = 1.0 - (experts.cache_units as f64 * experts.unit_bytes as f64 / (expert_bytes.max(1) as f64)).min(1.0);
    let ubatch = experts.max_ubatch.map_or(n_batch, |most| most.min(n_batch)).max(1);
    let picked = 1.0 - (1.0 - k / experts.n_expert as f64).powi(ubatch.min(4096) as i32);
    let prompt_pass = dense + expert_bytes as f64 * picked * misses;
    let decode_pass = dense + decode_experts * misses;
    (REFERENCE_PROMPT_TOKENS / f64::from(ubatch)).ceil() * prompt_pass + REFERENCE_ANSWER_TOKENS * decode_pass
}

/// The context each sequence gets: the spec's, the training context for 0, or by default the
/// one the budget affords (`auto_context`). Never more than the training context.
pub fn context_for(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> u32 {
    let trained = trained_context(inventory);
    match spec.n_ctx {
        Some(0) => trained,
        Some(n_ctx) => n_ctx.min(trained),
        None => auto_context(inventory, spec, facts),
    }
}

/// The model's training context (4096 where the file does not say).
fn trained_context(inventory: &Inventory) -> u32 {
    match u32::try_from(inventory.hparams.n_ctx_train) {
        Ok(0) => 4096,
        Ok(trained) => trained,
        Err(_) => u32::MAX,
    }
}

/// Context lengths the default tries, longest first: agents' prompts (a system prompt with
/// tool definitions, then the conversation) need 16K and more.
const AUTO_CONTEXTS: [u32; 5] = [32768, 16384, 8192, 4096, 2048];

/// The default context: the longest of `AUTO_CONTEXTS` (at most the training context) whose KV
/// cache, for every sequence, takes at most a quarter of the memory budget, so that the
/// weights keep the rest, and with which the plan fits the budget at some prompt batch (the
/// batch shrinks first, then the context, before the budget is refused). 2048 tokens at least.
pub fn auto_context(inventory: &Inventory, spec: &RunSpec, facts: &MachineFacts) -> u32 {
    let trained = trained_context(inventory);
    let n_sequences = spec.n_sequences.max(1);
    let fits = |n_ctx: u32| {
        let total = n_ctx.saturating_mul(n_sequences);
        // A prompt batch the user did not choose shrinks before the context does (`fit_batch`).
        let n_ubatch = if spec.grow_batch { SMALLER_BATCHES[SMALLER_BATCHES.len() - 1].min(spec.n_batch) } else { spec.n_batch };
        plan::kv_cache_bytes(inventory, total) <= facts.memory_budget_bytes / 4 && plan::plan(inventory, facts, &PlanOptions { n_ctx: total, n_sequences, n_ubatch, ..spec.plan_options() }).is_ok()
    };
    AUTO_CONTEXTS.iter().map(|&n_ctx| n_ctx.min(trained)).find(|&n_ctx| fits(n_ctx)).unwrap_or(AUTO_CONTEXTS[AUTO_CONTEXTS.len() - 1].min(trained))
}

/// Keep the compute time per generated token of a streaming run for the next plan of this
/// model. Failures to write are logged, never fatal (the record is a hint).
pub fn record_compute(model: &Path, threads: i32, streamed: bool, seconds: f64, tokens: u64) {
    if !streamed || tokens < 2 {
        return;
    }
    let result = ModelRecords::new(default_cache_dir()).update(model, |record| record.add_compute(threads.max(1) as u32, seconds * tokens as f64, tokens));
    if let Err(error) = result {
        tracing::warn!("could not record the measured compute time: {error}");
    }
}

/// Reader threads when the spec does not say, and the most a profile's best queue depth gives.
/// Four readers of 4 MiB chunks keep 16 MiB in flight, which this machine's disk and an NVMe
/// drive both serve at their rate; a profile's best depth comes from 16 MiB sequential blocks,
/// and sixteen readers put read-ahead and mispredicted prefetches in flight beside the reads
/// the compute waits for, which then take longer: measured on this 2-core machine, 16 readers
/// against 4 cost moe-30b 11% (3.89 against 4.39 tok/s), moe-8x a fifth and dense-stream
/// 0.80 against 0.92 of its read limit.
const DEFAULT_IO_WORKERS: usize = 4;

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
pub fn machine_facts(spec: &RunSpec, model: &Path) -> Result<MachineFacts, EngineError> {
    let gpu_free = dedicated_gpu_free(&hypura_sys::Backend::get().devices());
    let gpu_budget_bytes = gpu_budget(spec.gpu_budget_bytes, &gpu_free);
    // Asking a GPU for its free memory already starts its runtime in this process, so its host
    // memory is kept whether or not the plan uses the GPU.
    let memory_budget_bytes = spec.memory_budget_bytes.unwrap_or_else(|| default_memory_budget(memory_info().effective_available_bytes(), !gpu_free.is_empty()));
    let disk = ProfileCache::new(default_cache_dir()).load(&machine_key()).and_then(|profile| profile.disk);
    let disk_bytes_per_sec = disk.as_ref().map(crate::hw::DiskProfile::streaming_bytes_per_sec);
    let disk_read_points = disk.iter().flat_map(|disk| disk.direct.iter()).map(|point| (point.block_bytes * u64::from(point.queue_depth), point.bytes_per_sec)).collect();
    let io_workers = spec.io_workers.or_else(|| disk.as_ref().map(|disk| (disk.best_direct.queue_depth as usize).min(DEFAULT_IO_WORKERS))).unwrap_or(DEFAULT_IO_WORKERS).clamp(1, 64);
    let compute_seconds_per_token = ModelRecords::new(default_cache_dir()).load(model).compute_seconds_per_token(spec.threads().max(1) as u32);
    Ok(MachineFacts {
        memory_budget_bytes,
        disk_bytes_per_sec,
        read_queue_depth: Some(io_workers as u32),
        disk_read_points,
        compute_seconds_per_token,
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
    hypura_sys::Backend::get().devices().into_iter().filter(|device| device.kind == hypura_sys::DeviceKind::Gpu).map(|device| (device.name, device.free_bytes)).collect()
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
            tracing::warn!("a GPU budget of {} was given, but ggml sees no dedicated GPU here, so everything runs on the CPU", format_bytes(bytes));
            0
        }
        Some(free) if bytes > free => {
            tracing::warn!("the GPU budget of {} is more than the {} free on a GPU here: loading may run out of device memory", format_bytes(bytes), format_bytes(free));
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

    #[test]
    fn an_expert_plan_weighs_its_cache_against_a_larger_prompt_batch() {
        // Qwen's vocabulary: the logits of a 4096-token batch alone are 2.5 GB of compute buffer.
        let mut inventory = crate::plan::test_support::moe_inventory(24, 8, 2, 8 << 20);
        inventory.hparams.n_vocab = 152_064;
        let facts = MachineFacts { memory_budget_bytes: 4 << 30, disk_bytes_per_sec: Some(2e9), ..MachineFacts::default() };
        let spec = RunSpec { n_ctx: Some(1024), n_batch: 512, grow_batch: true, ..RunSpec::default() };
        let (n_batch, chosen) = grow_batch(&inventory, &spec, &facts, plan_for(&inventory, &spec, &facts).unwrap());
        let largest = plan_for(&inventory, &RunSpec { n_batch: 4096, ..spec.clone() }, &facts).unwrap();
        let cache = |plan: &Plan| plan.experts.as_ref().expect("an expert plan").cache_units;
        // Weighed by the worst case alone (every pick a miss, the same at every batch) the
        // largest batch won and its compute buffer took the cache.
        assert_eq!(chosen.streamed_bytes_per_token, largest.streamed_bytes_per_token);
        assert!(n_batch < 4096 && cache(&chosen) > cache(&largest), "batch {n_batch}: {} units against {} at 4096", cache(&chosen), cache(&largest));
        assert!(reference_request_bytes(&inventory, &chosen, n_batch) < reference_request_bytes(&inventory, &largest, 4096));
        // A cache of every streamed expert reads nothing more once it is warm.
        let all = crate::plan::plan(
            &inventory,
            &MachineFacts { memory_budget_bytes: 64 << 30, ..facts.clone() },
            &PlanOptions { n_ctx: 1024, n_ubatch: 512, mode: plan::ModeChoice::Forced(plan::Mode::ExpertStream), ..PlanOptions::default() },
        )
        .unwrap();
        assert_eq!(reference_request_bytes(&inventory, &all, 512), 0.0);
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
        let device = |kind, free: u64| hypura_sys::DeviceInfo { name: String::new(), description: String::new(), kind, free_bytes: free, total_bytes: free };
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
