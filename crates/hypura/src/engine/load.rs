//! `Engine`: a loaded model with its inventory and chat template.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypura_sys::{
    Backend, ContextParams, LoadMode, Model, ModelParams, Placement, SpeculativeParams, Speculator, StreamBufferType,
};

use super::chat::ChatTemplate;
use super::EngineError;
use crate::model::Inventory;
use crate::plan::{Mode, Plan, Tier};
use crate::remote::Workers;
use crate::store::{DenseWindow, ExpertStream, IoStats, Residency, ResidencyError, StoreError, StreamLoad};

/// How to load and run a model. Defaults match llama.cpp's own.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Context length of each sequence in tokens; 0 means the model's training context.
    /// Capped at that.
    pub n_ctx_seq: u32,
    pub n_batch: u32,
    pub n_ubatch: u32,
    /// Parallel sequences one context serves (the server's concurrent requests).
    pub n_seq_max: u32,
    /// CPU threads; None means every core.
    pub n_threads: Option<i32>,
    /// Let llama.cpp repack CPU weights at load ("extra buffer types"). Faster, but streamed
    /// tensors cannot be repacked, so comparisons must use the same setting on both sides.
    pub repack: bool,
    pub load_mode: LoadMode,
    pub n_gpu_layers: i32,
    /// Placement. None (or a resident plan) loads the way plain llama.cpp does.
    pub plan: Option<Plan>,
    /// Reader threads for streaming (the queue depth).
    pub io_workers: usize,
    /// Record the router's choices (expert-stream), for traces and the cache simulator.
    pub trace_routing: bool,
    /// Batch-invariant kernels: ggml's reference CPU kernels and no weight repacking, so that a
    /// token's logits do not depend on the shape of the batch it is computed in (a cached
    /// prefix, other sequences). Measured on Gemma 3 270M: prompt processing about 40% slower,
    /// generation unchanged. Op offload is off with it (prompt batches stay on the CPU); layers
    /// in a GPU tier run the GPU's kernels, which are not batch-invariant.
    pub batch_invariant: bool,
    /// A Jinja chat template to use instead of the file's (a file without one runs chat as
    /// plain completion).
    pub chat_template: Option<String>,
    /// Speculative decoding: drafts (a draft model's, or n-grams of the sequence's own tokens)
    /// verified several tokens to one pass over the weights.
    pub speculation: Option<Speculation>,
    /// RPC workers whose devices hold the plan's remote layers (`Plan::remote`).
    pub remote: Option<Arc<Workers>>,
    /// Prompt prefixes' KV caches on disk (`--prompt-cache`); None keeps them in memory only.
    pub prompt_cache: Option<super::prompt_cache::PromptCacheOptions>,
    /// The KV cache's element types (f16 unless asked; a quantized cache needs flash
    /// attention, which llama.cpp turns on where the backends have it).
    pub kv: crate::plan::KvTypes,
}

/// Tokens the n-gram drafters match by default (`Speculation::new`).
pub const DEFAULT_NGRAM: u32 = 4;

/// Speculative decoding for every sequence of an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Speculation {
    /// A draft model with the target's vocabulary (`--model-draft`), loaded resident.
    pub draft_model: Option<PathBuf>,
    /// llama.cpp's drafter types and draft limits; `draft-simple` needs `draft_model`, and
    /// `draft-mtp` a target with MTP layers.
    pub params: SpeculativeParams,
}

impl Speculation {
    /// llama.cpp's defaults (`--spec-draft-n-max 3`, `--spec-draft-n-min 0`,
    /// `--spec-draft-p-min 0`), with `draft-simple` when there is a draft model, and n-grams
    /// of 4 tokens (llama.cpp's lookup decoding matched 1 to 4; its n-gram drafters' default of
    /// 12 rarely matches in an answer that rewrites its prompt).
    pub fn new(draft_model: Option<PathBuf>, types: Vec<String>) -> Speculation {
        let types = if types.is_empty() && draft_model.is_some() { vec!["draft-simple".to_string()] } else { types };
        Speculation {
            draft_model,
            params: SpeculativeParams { types, n_max: 3, n_min: 0, p_min: 0.0, ngram_n: DEFAULT_NGRAM },
        }
    }

    /// Whether the target's own MTP layers draft (`draft-mtp`): they are then loaded, resident.
    pub fn uses_mtp(&self) -> bool {
        self.params.types.iter().any(|name| name == "draft-mtp")
    }

    /// The draft length and the draft model's confidence floor when the user sets neither: a
    /// pass over streamed weights costs a read of every one of them, so a streaming plan drafts
    /// longer than llama.cpp's default of 3, but only tokens the draft model is fairly sure of
    /// (each drafted token is a decode of the draft model and a row of the verify batch, on the
    /// same cores): decision 18, and `docs/benchmarks/2026-12-02-limit/` for what speculation
    /// then gains against the same streamed plan.
    pub fn defaults_for(mode: Mode) -> (u32, f32) {
        if mode == Mode::Resident {
            (3, 0.0)
        } else {
            (6, 0.75)
        }
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            n_ctx_seq: 4096,
            n_batch: 512,
            n_ubatch: 512,
            n_seq_max: 1,
            n_threads: None,
            repack: true,
            load_mode: LoadMode::Mmap,
            n_gpu_layers: -1,
            plan: None,
            io_workers: 4,
            trace_routing: false,
            batch_invariant: false,
            chat_template: None,
            speculation: None,
            remote: None,
            prompt_cache: None,
            kv: crate::plan::KvTypes::default(),
        }
    }
}

/// What decides residency from the eval hook: the dense window, the expert cache, or both (an
/// MoE model whose dense FFN layers stream too).
pub struct StreamDriver {
    pub dense: Option<Arc<DenseWindow>>,
    pub experts: Option<Arc<ExpertStream>>,
    hook: Arc<dyn hypura_sys::EvalHook>,
}

/// Both drivers on one graph: each stops at its own nodes and observes only its own stops (the
/// dense window by the node's name, the expert cache by the stop it asked for).
struct BothHooks(Arc<DenseWindow>, Arc<ExpertStream>);

impl hypura_sys::EvalHook for BothHooks {
    fn wants(&self, name: &str) -> bool {
        // Both are asked about every node: the expert cache's `wants` follows the graph.
        self.0.wants(name) | self.1.wants(name)
    }

    fn keeps(&self, name: &str) -> bool {
        self.1.keeps(name)
    }

    fn observe(&self, node: &hypura_sys::ObservedNode<'_>) {
        self.0.observe(node);
        self.1.observe(node);
    }

    fn begin_decode(&self) {
        self.1.begin_decode();
    }
}

impl StreamDriver {
    fn new(dense: Option<Arc<DenseWindow>>, experts: Option<Arc<ExpertStream>>) -> StreamDriver {
        let hook: Arc<dyn hypura_sys::EvalHook> = match (&dense, &experts) {
            (Some(dense), Some(experts)) => Arc::new(BothHooks(dense.clone(), experts.clone())),
            (Some(dense), None) => dense.clone(),
            (None, Some(experts)) => experts.clone(),
            (None, None) => unreachable!("a streaming engine has a driver"),
        };
        StreamDriver { dense, experts, hook }
    }

    pub fn hook(&self) -> Arc<dyn hypura_sys::EvalHook> {
        self.hook.clone()
    }

    fn failures(&self) -> impl Iterator<Item = &crate::store::FailureLatch> {
        self.dense.iter().map(|dense| &dense.failure).chain(self.experts.iter().map(|experts| &experts.failure))
    }

    /// The read error of the dense window, else the expert cache's; both latches are cleared.
    pub fn take_failure(&self) -> Option<ResidencyError> {
        self.failures().fold(None, |first, latch| first.or(latch.take()))
    }

    /// The flags that abort a decode when a read fails, one per driver.
    pub fn abort_flags(&self) -> Vec<Arc<std::sync::atomic::AtomicBool>> {
        self.failures().map(crate::store::FailureLatch::abort_flag).collect()
    }

    /// The dense window's residency, or the expert cache's.
    pub fn residency(&self) -> &Arc<Residency> {
        match (&self.dense, &self.experts) {
            (Some(dense), _) => dense.residency(),
            (None, Some(experts)) => experts.residency(),
            (None, None) => unreachable!("a streaming engine has a driver"),
        }
    }

    pub fn experts(&self) -> Option<&Arc<ExpertStream>> {
        self.experts.as_ref()
    }
}

/// The streaming machinery of a streaming engine.
pub struct Streaming {
    pub driver: StreamDriver,
    pub stats: Arc<IoStats>,
    /// Bytes read at load (resident tensors), not counting streamed ones.
    pub load_bytes: u64,
    /// The model's `general.architecture`, for the refusal below.
    arch: String,
    /// Whether anything streams. A plan that only leaves tables in the file's pages (beside a
    /// remote tier that holds what would stream) runs without the eval hook, which would cut
    /// every graph split into views (and each remote device's graph with them).
    pub hooked: bool,
}

impl Streaming {
    /// Eval-hook observations so far; pass to `ensure_hook_fired` after a decode.
    pub fn observations(&self) -> u64 {
        self.stats.snapshot().observations
    }

    /// A decode during which the hook never stopped the graph computed streamed layers on
    /// bytes nobody loaded: the architecture does not name its nodes as the driver expects.
    /// Refuse it rather than return wrong tokens.
    pub fn ensure_hook_fired(&self, observations_before: u64) -> Result<(), StoreError> {
        if self.observations() > observations_before {
            return Ok(());
        }
        let node = match (&self.driver.experts, &self.driver.dense) {
            (Some(_), _) => "ffn_moe_weights-<layer>".to_string(),
            (None, Some(dense)) => format!("{}-<layer>", dense.entry_node()),
            (None, None) => unreachable!("a streaming engine has a driver"),
        };
        Err(StoreError::HookNeverFired { arch: self.arch.clone(), node })
    }
}

/// A loaded model. Share it between sessions with `Arc`.
pub struct Engine {
    // Declared first so it drops first: streamed tensors point into the region below.
    pub(super) model: Model,
    /// The draft model of speculative decoding, resident.
    draft: Option<Model>,
    streaming: Option<Streaming>,
    inventory: Inventory,
    template: ChatTemplate,
    options: EngineOptions,
    load_duration: Duration,
    /// What the KV cache's bits depend on (`prompt_cache::settings_digest`), read once when
    /// first asked for.
    settings: std::sync::OnceLock<Result<[u8; 32], String>>,
}

impl Engine {
    /// Open the file's inventory (a typed error for bad or unknown files, before llama.cpp sees
    /// them), then load it.
    pub fn open(path: &Path, options: EngineOptions) -> Result<Engine, EngineError> {
        Engine::load(Inventory::open(path)?, options)
    }

    /// Load the model `inventory` describes, placed by `options.plan`, which must have been
    /// made from this inventory.
    pub fn load(inventory: Inventory, options: EngineOptions) -> Result<Engine, EngineError> {
        let started = Instant::now();
        if let Some(plan) = &options.plan {
            check_plan_matches(plan, &inventory)?;
        }
        let path = inventory.path.clone();
        let path = path.as_path();
        let backend = Backend::get();
        let streams = options.plan.as_ref().is_some_and(|plan| {
            plan.mode != Mode::Resident
                && plan.tensors.iter().any(|tensor| matches!(tensor.tier, Tier::Stream | Tier::Mapped))
        });
        let (model, streaming) = if streams {
            let plan = options.plan.as_ref().expect("checked above");
            let (model, streaming) = load_streaming(backend, path, &inventory, plan, &options)?;
            (model, Some(streaming))
        } else {
            let (devices, tensor_split) = remote_devices(&options)?;
            // Layers on other machines are read once to be sent: mapped, their pages would count
            // as this process's memory.
            let load_mode = if devices.is_empty() { options.load_mode } else { LoadMode::Read };
            let params = ModelParams {
                n_gpu_layers: options.plan.as_ref().map_or(options.n_gpu_layers, Plan::n_gpu_layers),
                load_mode,
                use_extra_bufts: options.repack && !options.batch_invariant,
                vocab_only: false,
                devices,
                tensor_split,
                load_mtp: loads_mtp(&options),
            };
            let host_patterns = options.plan.as_ref().map(|plan| plan.host_patterns(&[Tier::Ram])).unwrap_or_default();
            (Model::load_placed(backend, path, &params, Placement { host_patterns, ..Placement::default() })?, None)
        };
        // A worker that died during the load was answered for with zeros: the model is not whole.
        if let Some(workers) = &options.remote {
            workers.check()?;
        }
        let template = ChatTemplate::new(&model, options.chat_template.as_deref())
            .map_err(|reason| EngineError::Template { path: inventory.path.clone(), reason })?;
        tracing::debug!("chat template: {}", template.describe());
        let draft = match &options.speculation {
            Some(speculation) => load_draft(backend, &inventory, &model, speculation, &options)?,
            None => None,
        };
        Ok(Engine {
            model,
            draft,
            streaming,
            inventory,
            template,
            options,
            load_duration: started.elapsed(),
            settings: std::sync::OnceLock::new(),
        })
    }

    /// The digest of what this engine's KV caches depend on: a cache computed by an engine with
    /// the same digest is the same bits (`prompt_cache::settings_digest`).
    pub fn settings_digest(&self) -> Result<[u8; 32], String> {
        self.settings
            .get_or_init(|| super::prompt_cache::settings_digest(self).map_err(|error| error.to_string()))
            .clone()
    }

    /// Fails where a remote worker of the plan stopped answering.
    pub fn check_remote(&self) -> Result<(), crate::remote::RemoteError> {
        self.options.remote.as_ref().map_or(Ok(()), |workers| workers.check())
    }

    /// Traffic over the links to the remote workers so far (None without them).
    pub fn remote_traffic(&self) -> Option<crate::remote::Traffic> {
        self.options.remote.as_ref().map(|workers| workers.traffic())
    }

    /// The draft model of speculative decoding, if the engine has one.
    pub fn draft_model(&self) -> Option<&Model> {
        self.draft.as_ref()
    }

    /// The context for the draft model: the target's length, sequences and batches, without
    /// the target's streaming hook.
    pub(super) fn draft_context_params(&self, target: &ContextParams) -> ContextParams {
        ContextParams {
            n_ubatch: target.n_ubatch.min(crate::plan::DRAFT_UBATCH),
            eval_hook: None,
            batch_invariant: false,
            op_offload: true,
            ..target.clone()
        }
    }

    /// The streaming machinery, in dense-stream mode.
    pub fn streaming(&self) -> Option<&Streaming> {
        self.streaming.as_ref()
    }

    /// The streaming machinery where something streams, whose hook a context carries.
    pub fn hooked_streaming(&self) -> Option<&Streaming> {
        self.streaming.as_ref().filter(|streaming| streaming.hooked)
    }

    pub fn mode(&self) -> Mode {
        match self.streaming.as_ref().map(|streaming| &streaming.driver) {
            None => Mode::Resident,
            Some(driver) if driver.experts.is_some() => Mode::ExpertStream,
            Some(_) => Mode::DenseStream,
        }
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Whether llama.cpp repacked the CPU weights (never when streaming or batch-invariant).
    pub fn repacked(&self) -> bool {
        self.streaming.is_none()
            && self.options.repack
            && !self.options.batch_invariant
            && hypura_sys::repacking_available()
    }

    pub fn load_duration(&self) -> Duration {
        self.load_duration
    }

    /// The context length sessions get: the requested one, capped at the training context.
    pub fn n_ctx_seq(&self) -> u32 {
        let trained = u32::try_from(self.model.n_ctx_train()).unwrap_or(u32::MAX).max(1);
        match self.options.n_ctx_seq {
            0 => trained,
            requested => requested.min(trained),
        }
    }

    /// The prompt batch: the asked one, at most the logical batch, and at most what the plan's
    /// expert cache holds the picks of.
    pub fn n_ubatch(&self) -> u32 {
        let planned = self.options.plan.as_ref().and_then(|plan| plan.experts.as_ref()?.max_ubatch).unwrap_or(u32::MAX);
        self.options.n_ubatch.min(self.options.n_batch).min(planned)
    }

    pub(super) fn context_params(&self) -> ContextParams {
        let defaults = ContextParams::default();
        let threads = self.options.n_threads.unwrap_or(defaults.n_threads);
        ContextParams {
            // One sequence's: a batcher multiplies it by its sequences.
            n_ctx: self.n_ctx_seq(),
            n_batch: self.options.n_batch,
            n_ubatch: self.n_ubatch(),
            n_seq_max: self.options.n_seq_max,
            n_threads: threads,
            n_threads_batch: threads,
            eval_hook: self.hooked_streaming().map(|streaming| streaming.driver.hook()),
            // Without a GPU tier nothing goes to a GPU, prompt batches included; a tier without
            // room for op offload's copies keeps prompt batches of host layers on the CPU.
            // Batch-invariant runs keep prompt batches on the CPU too, where the reference
            // kernels are.
            op_offload: !self.options.batch_invariant
                && self.options.plan.as_ref().is_none_or(|plan| plan.gpu.as_ref().is_some_and(|gpu| gpu.op_offload)),
            batch_invariant: self.options.batch_invariant,
            type_k: self.options.kv.k.id(),
            type_v: self.options.kv.v.id(),
            // A split pool's CPU lanes compute while the graph waits on the device.
            cpu_threads_poll: !self.options.plan.as_ref().is_some_and(|plan| {
                plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.as_ref()).is_some_and(|pool| pool.split)
            }),
            ..defaults
        }
    }
}

/// Whether the model's MTP layers are loaded: only for MTP speculation (the plan then places
/// them in host memory).
fn loads_mtp(options: &EngineOptions) -> bool {
    options.speculation.as_ref().is_some_and(Speculation::uses_mtp)
}

/// Check that speculation can run on this target, and load its draft model (resident, the way
/// plain llama.cpp loads a model).
fn load_draft(
    backend: &Backend,
    inventory: &Inventory,
    target: &Model,
    speculation: &Speculation,
    options: &EngineOptions,
) -> Result<Option<Model>, EngineError> {
    let unsupported = |reason: String| Err(EngineError::Setup(format!("speculative decoding: {reason}")));
    // Rejected drafts are removed from the KV cache; a recurrent state cannot drop tokens.
    if inventory.hparams.recurrent_state_bytes > 0 {
        return unsupported(format!(
            "{} keeps a recurrent state, which cannot drop rejected drafts; run without a draft",
            inventory.arch
        ));
    }
    if speculation.uses_mtp() {
        if inventory.hparams.n_layer_mtp == 0 {
            return unsupported(format!(
                "the draft-mtp type drafts with the model's own MTP layers, and {} has none",
                inventory.path.display()
            ));
        }
        if speculation.draft_model.is_some() {
            return unsupported("draft-mtp drafts with the target's own layers: give no draft model beside it".into());
        }
    }
    let needs_model = speculation.params.types.iter().any(|name| name == "draft-simple");
    let Some(path) = &speculation.draft_model else {
        return if needs_model {
            unsupported("the draft-simple type needs a draft model (--model-draft)".into())
        } else {
            Ok(None)
        };
    };
    if !needs_model {
        return unsupported(format!(
            "a draft model was given but no draft-simple type (types: {})",
            speculation.params.types.join(",")
        ));
    }
    // The draft is checked like the target: a bad file is a typed error before llama.cpp sees it.
    Inventory::open(path)?;
    let on_gpu = options.plan.as_ref().is_some_and(|plan| plan.n_gpu_layers() > 0);
    // Beside a streaming target the draft's weights are read into memory of their own: mapped,
    // they would be page cache that the streamed reads evict.
    let streams = options.plan.as_ref().is_some_and(|plan| plan.mode != Mode::Resident);
    let load_mode = if streams { LoadMode::Read } else { options.load_mode };
    // The draft computes locally: its layers never go to a remote tier's devices.
    let on_gpu = on_gpu && options.plan.as_ref().is_some_and(|plan| plan.remote.is_none());
    let params = ModelParams {
        n_gpu_layers: if on_gpu { -1 } else { 0 },
        load_mode,
        use_extra_bufts: options.repack,
        ..ModelParams::default()
    };
    let draft = Model::load(backend, path, &params)?;
    if !Speculator::compatible(target, &draft) {
        return unsupported(format!(
            "the vocabulary of the draft model {} does not match the target's",
            path.display()
        ));
    }
    Ok(Some(draft))
}

/// A plan made for another file (or another version of it) would place tensors by the wrong
/// offsets.
fn check_plan_matches(plan: &Plan, inventory: &Inventory) -> Result<(), EngineError> {
    let same = plan.tensors.len() == inventory.tensors.len()
        && plan.tensors.iter().zip(&inventory.tensors).all(|(placement, tensor)| {
            placement.name == tensor.name && placement.bytes == tensor.bytes && placement.layer == tensor.layer
        });
    if same {
        Ok(())
    } else {
        Err(EngineError::Setup(format!("the plan was not made from the inventory of {}", inventory.path.display())))
    }
}

/// Load a streaming plan: streamed tensors go to a stream buffer type over the region the store
/// reserved to mirror the file, llama.cpp's reads are served by the store (resident bytes with
/// direct I/O, streamed bytes skipped), and the store's drivers (the dense window, the expert
/// cache) decide residency from the eval hook.
fn load_streaming(
    backend: &Backend,
    path: &Path,
    inventory: &Inventory,
    plan: &Plan,
    options: &EngineOptions,
) -> Result<(Model, Streaming), EngineError> {
    // Declared before the model, so that it drops after it: streamed tensors point into its region.
    let mut load = StreamLoad::prepare(path, inventory, plan)?;
    let (region_address, region_bytes) = load.region_span();
    let buffer_type = Arc::new(StreamBufferType::new(region_address, region_bytes, load.sink_span(), load.offsets())?);
    let placement = Placement {
        streamed: load.tensor_names().map(|name| (name.to_string(), buffer_type.clone())).collect(),
        host_patterns: plan.host_patterns(&[Tier::Ram]),
        reader: Some(Box::new(load.load_reader()?)),
    };
    // Streamed tensors cannot be repacked, and resident ones must not be either, or streamed
    // and resident runs would compute with different kernels.
    let (devices, tensor_split) = remote_devices(options)?;
    let params = ModelParams {
        n_gpu_layers: plan.n_gpu_layers(),
        load_mode: LoadMode::Read,
        use_extra_bufts: false,
        vocab_only: false,
        devices,
        tensor_split,
        load_mtp: loads_mtp(options),
    };
    let model = Model::load_placed(backend, path, &params, placement)?;
    let cpu_threads = options.n_threads.map_or_else(
        || std::thread::available_parallelism().map_or(4, std::num::NonZero::get),
        |threads| threads.max(1) as usize,
    );
    let streams = load.finish(&buffer_type, options.io_workers, cpu_threads, options.trace_routing)?;
    Ok((
        model,
        Streaming {
            driver: StreamDriver::new(streams.dense, streams.experts),
            stats: streams.stats,
            load_bytes: streams.load_bytes,
            arch: inventory.arch.clone(),
            hooked: streams.hooked,
        },
    ))
}

/// llama.cpp's device list and tensor split for a plan with a remote tier: its devices in
/// order, each taking its share of the layers; empty otherwise (llama.cpp's own GPUs).
fn remote_devices(options: &EngineOptions) -> Result<(Vec<hypura_sys::DeviceHandle>, Vec<f32>), EngineError> {
    let Some(remote) = options.plan.as_ref().and_then(|plan| plan.remote.as_ref()) else {
        return Ok((Vec::new(), Vec::new()));
    };
    let workers = options.remote.as_ref().ok_or_else(|| {
        EngineError::Setup("the plan puts layers on remote devices, but no RPC worker is connected".into())
    })?;
    workers.check()?;
    let names: Vec<&str> = remote.shares.iter().map(|share| share.name.as_str()).collect();
    let devices = workers.handles(&names);
    if devices.len() != names.len() {
        return Err(EngineError::Setup(format!(
            "the plan names remote devices {names:?}, and the connected workers offer {:?}",
            workers.devices.iter().map(|device| &device.name).collect::<Vec<_>>()
        )));
    }
    // A worker that has less memory now than it had when the plan was made is refused here,
    // with the numbers, before any weight is sent.
    for (share, device) in remote.shares.iter().zip(&devices) {
        let (free, _) = device.memory();
        workers.check()?;
        if free < share.total_bytes() {
            return Err(EngineError::Setup(format!(
                "RPC worker {} ({}) has {} free, and the plan puts {} there (layers {}-{}: {} weights + {} KV cache + {} compute + {} reserve)",
                share.worker,
                share.name,
                crate::format::format_bytes(free),
                crate::format::format_bytes(share.total_bytes()),
                share.layers.start,
                share.layers.end - 1,
                crate::format::format_bytes(share.weight_bytes),
                crate::format::format_bytes(share.kv_cache_bytes),
                crate::format::format_bytes(share.compute_buffer_bytes),
                crate::format::format_bytes(crate::plan::REMOTE_RESERVE_BYTES)
            )));
        }
    }
    Ok((devices, remote.tensor_split()))
}
