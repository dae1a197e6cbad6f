//! The placement planner: `(inventory, machine facts, options) -> Plan`. Pure: no I/O, no ggml.
//!
//! It decides the mode (resident, dense-stream, expert-stream), the tier of every tensor, the
//! dense layout (which FFN layers are pinned in RAM, which stream through a window of `D`
//! layers), and checks that weights + window + KV cache + compute buffers fit the budget. For a
//! cyclic sweep over layers, LRU caching gets nothing; a fixed pinned set gets exactly its share,
//! so the planner pins a fixed set and streams the rest.
use std::fmt::Write as _;

use serde::Serialize;

use crate::hw::format::format_bytes;
use crate::model::{Inventory, TensorEntry};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Resident,
    DenseStream,
    ExpertStream,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Resident => "resident",
            Mode::DenseStream => "dense-stream",
            Mode::ExpertStream => "expert-stream",
        }
    }
}

/// `--mode`: automatic, or forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeChoice {
    Auto,
    Forced(Mode),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Device memory of the GPU(s), loaded once; computed there.
    Gpu,
    /// Host memory, loaded once.
    Ram,
    /// Read from disk on demand through the stream window.
    Stream,
}

/// Facts about the machine the planner needs (from `hw`, resolved by the caller).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MachineFacts {
    /// Memory Hypura may use in total (weights, KV cache, compute buffers).
    pub memory_budget_bytes: u64,
    /// Direct-read bandwidth of the model's volume; None if not measured.
    pub disk_bytes_per_sec: Option<f64>,
    /// Reads the store keeps in flight (its reader threads: the profile's best queue depth).
    pub read_queue_depth: Option<u32>,
    /// The profile's direct-read points: bytes in flight (block × queue depth) and the rate
    /// measured with them. Empty if not measured.
    pub disk_read_points: Vec<(u64, f64)>,
    /// Decode compute time per token of this model with the streaming kernels, measured by an
    /// earlier run on this machine (stall time excluded); None if never measured.
    pub compute_seconds_per_token: Option<f64>,
    /// Device memory Hypura may use on dedicated GPUs (weights, KV cache, compute buffers);
    /// 0: no GPU tier.
    pub gpu_budget_bytes: u64,
    /// Device memory the GPU backend takes beyond the buffers the plan counts (kernels loaded
    /// on first use, memory pools), kept free inside the GPU budget.
    pub gpu_runtime_bytes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    pub mode: ModeChoice,
    pub n_ctx: u32,
    pub n_ubatch: u32,
    /// Streamed layers read ahead of the one computing (dense-stream); None: the cost model
    /// sizes it.
    pub window_layers: Option<usize>,
    /// Expert cache size in (layer, expert) units (expert-stream); None: what the budget holds.
    pub expert_cache_units: Option<usize>,
    /// Stale-gate expert prefetch (expert-stream); None: on where it measured a win, for
    /// slices large enough for huge pages.
    pub expert_prefetch: Option<bool>,
    pub cache_policy: crate::store::CachePolicy,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            mode: ModeChoice::Auto,
            n_ctx: 4096,
            n_ubatch: 512,
            window_layers: None,
            expert_cache_units: None,
            expert_prefetch: None,
            cache_policy: crate::store::CachePolicy::Slru,
        }
    }
}

/// The expert-stream layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertLayout {
    pub n_expert: u64,
    pub n_expert_used: u64,
    /// Bytes of one (layer, expert) unit: its gate, up and down slices (largest layer).
    pub unit_bytes: u64,
    /// How many units the expert cache holds.
    pub cache_units: usize,
    pub policy: crate::store::CachePolicy,
    /// The smallest expert slice (one expert's part of one tensor).
    pub min_slice_bytes: u64,
    /// Stale-gate prefetch of the next layer's experts.
    pub prefetch: bool,
}

/// Expert slices at least this large are backed by huge pages inside (the store advises their
/// 2 MiB-aligned interior), which makes reading them cheap enough in CPU that prefetching
/// them alongside compute pays: +29% and +21% on forge moe-8x at residual scale 1 and 0.3
/// (slices of 8–12 MB, 2 cores), while on moe-30b (slices of about 1 MB) prefetch cost half
/// the speed.
pub const HUGE_SLICE_MIN_BYTES: u64 = 4 << 20;

/// The GPU tier: what every token touches (attention, norms, router, shared experts, the
/// output matrix) and the KV cache in device memory, then the FFN of whole layers while the
/// budget lasts; or, where every layer's attention and KV cache do not fit, the output and the
/// last layers whole. The token embedding stays in host memory (llama.cpp looks tokens up on
/// the CPU).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuLayout {
    pub budget_bytes: u64,
    /// Weights in device memory, the tied output matrix's copy included.
    pub weight_bytes: u64,
    /// A copy of the token embedding that a model without `output.weight` computes its logits
    /// with, on the device (llama.cpp duplicates it there).
    pub tied_output_bytes: u64,
    pub kv_cache_bytes: u64,
    pub compute_buffer_bytes: u64,
    /// Kept for the backend's own use (`MachineFacts::gpu_runtime_bytes`), or for op offload's
    /// copy of the largest host layer's FFN when that is larger.
    pub runtime_bytes: u64,
    /// Layers whose FFN (dense, or every routed expert) is in device memory too.
    pub ffn_layers: Vec<u32>,
    /// None: every layer's attention is on the device. Some(range): the budget cannot hold
    /// every layer's attention and KV cache, so only these last layers are on the device, whole,
    /// as llama.cpp's `n_gpu_layers` places them (their count and the output).
    pub whole_layers: Option<std::ops::Range<u32>>,
    /// Whether ggml may run host layers' prompt batches on the device (op offload); off where
    /// the budget holds every layer's attention only without room for a host layer's copy.
    pub op_offload: bool,
}

impl GpuLayout {
    pub fn total_bytes(&self) -> u64 {
        self.weight_bytes + self.kv_cache_bytes + self.compute_buffer_bytes + self.runtime_bytes
    }

    fn holds(&self, tensor: &TensorEntry) -> bool {
        if is_streamable(tensor) {
            tensor.layer.is_some_and(|layer| self.ffn_layers.contains(&layer))
        } else {
            !on_input_layer(tensor) && self.offloads(tensor.layer)
        }
    }

    /// Whether llama.cpp's `n_gpu_layers` for this layout puts a tensor of `layer` (None: not in
    /// a layer, as the output) on the device, unless an override keeps it on the host.
    fn offloads(&self, layer: Option<u32>) -> bool {
        match (&self.whole_layers, layer) {
            (Some(range), Some(layer)) => range.contains(&layer),
            _ => true,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorPlacement {
    pub name: String,
    pub layer: Option<u32>,
    pub tier: Tier,
    pub bytes: u64,
    pub why: &'static str,
}

/// The dense-stream layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DenseLayout {
    pub streamed_layers: Vec<u32>,
    pub pinned_layers: Vec<u32>,
    /// Streamed layers read ahead of the one computing.
    pub window_layers: usize,
    /// Whether the cost model chose the window (else `--window` set it).
    pub window_sized: bool,
    /// The windows the cost model weighed: (layers ahead, predicted seconds per token).
    pub windows_costed: Vec<(usize, f64)>,
}

/// Where the host memory budget goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BudgetUse {
    pub budget_bytes: u64,
    /// Weights loaded once into RAM (everything neither streamed nor on the GPU).
    pub resident_weight_bytes: u64,
    /// Streamed bytes that can be in memory at once (the window, plus the layer computing).
    pub window_bytes: u64,
    pub kv_cache_bytes: u64,
    pub compute_buffer_bytes: u64,
    pub total_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub mode: Mode,
    pub budget: BudgetUse,
    pub tensors: Vec<TensorPlacement>,
    pub dense: Option<DenseLayout>,
    pub experts: Option<ExpertLayout>,
    /// The GPU tier; None without a GPU budget.
    pub gpu: Option<GpuLayout>,
    /// Why a GPU budget was given but not used.
    pub gpu_unused: Option<String>,
    /// Bytes that must come from disk for every token (the streamed FFN layers).
    pub streamed_bytes_per_token: u64,
    /// Upper bound from the disk alone: bandwidth ÷ streamed bytes per token.
    pub io_bound_tokens_per_sec: Option<f64>,
    /// The physical limit (ARCHITECTURE.md §6), when the compute time has been measured.
    pub limit_tokens_per_sec: Option<f64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error(
        "the memory budget of {} is too small: even streaming every FFN layer needs {} \
         ({} resident weights + {} window of {} layers + {} KV cache + {} compute buffers)",
        format_bytes(*budget), format_bytes(*needed), format_bytes(*resident), format_bytes(*window), layers,
        format_bytes(*kv), format_bytes(*compute)
    )]
    BudgetTooSmall { budget: u64, needed: u64, resident: u64, window: u64, layers: usize, kv: u64, compute: u64 },
    #[error("{mode} mode needs {what}, which this model does not have")]
    ModeUnavailable { mode: &'static str, what: &'static str },
    #[error("the model fits in the budget ({} of {}), but {mode} was forced: nothing would stream", format_bytes(*needed), format_bytes(*budget))]
    NothingToStream { mode: &'static str, needed: u64, budget: u64 },
}

/// KV cache bytes at f16 for `n_ctx` tokens (an upper bound for sliding-window models).
pub fn kv_cache_bytes(inventory: &Inventory, n_ctx: u32) -> u64 {
    let hparams = &inventory.hparams;
    hparams.n_layer * u64::from(n_ctx) * hparams.n_head_kv * (hparams.head_dim_k + hparams.head_dim_v) * 2
}

/// llama.cpp's CPU compute buffer, estimated: the logits and a few FFN-wide and model-wide
/// activations of one ubatch (flash attention keeps the attention scores out of it), plus a
/// margin. Measured against llama.cpp's own report at n_ubatch 512 it is 8% over on Gemma 3
/// 270M (the logits dominate) and 40–70% over on the forge's models; an underestimate would
/// break the budget.
pub fn compute_buffer_bytes(inventory: &Inventory, _n_ctx: u32, n_ubatch: u32) -> u64 {
    let hparams = &inventory.hparams;
    let ff = hparams.n_ff.max(hparams.n_ff_expert * hparams.n_expert_used.max(1));
    let per_token = hparams.n_vocab + 4 * hparams.n_embd + 4 * ff;
    4 * u64::from(n_ubatch) * per_token + (32 << 20)
}

/// Tensors llama.cpp keeps on its input layer, always on the CPU (they are looked up by
/// token or position): the token embeddings and the few other input tables.
fn on_input_layer(tensor: &TensorEntry) -> bool {
    const INPUT_TABLES: [&str; 4] = ["position_embd", "token_types", "masked_embd_centroids", "masked_embd_ordering"];
    tensor.role == crate::model::Role::TokenEmbedding
        || (tensor.layer.is_none() && INPUT_TABLES.iter().any(|table| tensor.name.strip_prefix(table).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))))
}

/// Tensors the dense-stream mode may stream: dense FFN weights and routed experts.
fn is_streamable(tensor: &TensorEntry) -> bool {
    tensor.layer.is_some() && (tensor.role.is_dense_ffn() || tensor.role.is_expert())
}

/// Per-layer bytes of streamable tensors.
fn ffn_bytes_by_layer(inventory: &Inventory) -> Vec<u64> {
    let mut bytes = vec![0; inventory.hparams.n_layer as usize];
    for tensor in inventory.tensors.iter().filter(|tensor| is_streamable(tensor)) {
        bytes[tensor.layer.expect("streamable tensors have a layer") as usize] += tensor.bytes;
    }
    bytes
}

/// `count` of `total` indices spread evenly (so streaming I/O overlaps pinned layers' compute).
fn spread(count: usize, total: usize) -> Vec<usize> {
    (0..count).map(|index| (index * total + total / 2) / count.max(1)).map(|index| index.min(total - 1)).collect()
}

/// What the GPU tier is planned from: the budget and the model's device-side costs.
struct DeviceCosts<'a> {
    budget: u64,
    /// The runtime's own reserve (`MachineFacts::gpu_runtime_bytes`).
    runtime: u64,
    kv: u64,
    compute: u64,
    /// What every token touches, per layer: attention, norms, router, shared experts.
    layer_attention: Vec<u64>,
    /// Streamable bytes (FFN or routed experts) per layer.
    layer_ffn: &'a [u64],
    /// What every token touches outside the layers: output matrix, final norm.
    outside_layers: u64,
    /// The token embedding's copy that a model without an output matrix computes logits with.
    tied_output_bytes: u64,
}

/// The GPU tier for `budget` bytes of device memory: Ok(None) without a budget, Err(why) when
/// the budget cannot hold even one whole layer. With `ffn`, whole layers' FFN fill what is left
/// after what every token touches, from the last layer down; where every layer's attention and
/// KV cache do not fit, the last layers go on the device whole instead.
fn gpu_tier(inventory: &Inventory, options: &PlanOptions, machine: &MachineFacts, layer_ffn: &[u64], ffn: bool) -> Result<Option<GpuLayout>, String> {
    if machine.gpu_budget_bytes == 0 || layer_ffn.is_empty() {
        return Ok(None);
    }
    let n_layer = layer_ffn.len();
    let mut layer_attention = vec![0u64; n_layer];
    let mut outside_layers = 0u64;
    for tensor in inventory.tensors.iter().filter(|tensor| !is_streamable(tensor) && !on_input_layer(tensor)) {
        match tensor.layer {
            Some(layer) if (layer as usize) < n_layer => layer_attention[layer as usize] += tensor.bytes,
            _ => outside_layers += tensor.bytes,
        }
    }
    let has_output = inventory.tensors.iter().any(|tensor| tensor.role == crate::model::Role::Output);
    // Only `token_embd.weight` is copied for the logits (not, say, a per-layer embedding).
    let tied_output_bytes =
        if has_output { 0 } else { inventory.tensors.iter().filter(|tensor| tensor.name == TOKEN_EMBEDDING).map(|tensor| tensor.bytes).sum() };
    let costs = DeviceCosts {
        budget: machine.gpu_budget_bytes,
        runtime: machine.gpu_runtime_bytes,
        kv: kv_cache_bytes(inventory, options.n_ctx),
        compute: compute_buffer_bytes(inventory, options.n_ctx, options.n_ubatch),
        layer_attention,
        layer_ffn,
        outside_layers,
        tied_output_bytes,
    };
    costs.every_layers_attention(ffn).map_or_else(|| costs.whole_last_layers(ffn), |gpu| Ok(Some(gpu)))
}

impl DeviceCosts<'_> {
    /// The design's layout: every layer's attention, the output and the KV cache, then whole
    /// layers' FFN (with `ffn`) from the last layer down. None where that does not fit.
    fn every_layers_attention(&self, ffn: bool) -> Option<GpuLayout> {
        let every_token = self.outside_layers + self.tied_output_bytes + self.layer_attention.iter().sum::<u64>();
        let base = every_token + self.kv + self.compute;
        // For a prompt batch, ggml's op offload runs host layers on the device from a copy of
        // their weights in the compute buffer, one layer at a time. Unless every layer's FFN is
        // on the device, the reserve holds the largest host layer's (never less than the
        // runtime's own). Every layer's attention on the device is worth more at decode than
        // prompt batches of the host layers there: where only that fits, op offload is off.
        let all_on_device = ffn && base + self.runtime + self.layer_ffn.iter().sum::<u64>() <= self.budget;
        let copy = if all_on_device { 0 } else { self.layer_ffn.iter().copied().max().unwrap_or(0) };
        let (runtime, op_offload) = match () {
            _ if base + self.runtime.max(copy) <= self.budget => (self.runtime.max(copy), true),
            _ if base + self.runtime <= self.budget => (self.runtime, false),
            _ => return None,
        };
        let mut spare = self.budget - base - runtime;
        let mut ffn_layers = Vec::new();
        for (layer, &bytes) in self.layer_ffn.iter().enumerate().rev().filter(|_| ffn) {
            if bytes > spare {
                break;
            }
            spare -= bytes;
            ffn_layers.push(layer as u32);
        }
        ffn_layers.reverse();
        let ffn_bytes: u64 = ffn_layers.iter().map(|&layer| self.layer_ffn[layer as usize]).sum();
        Some(GpuLayout {
            budget_bytes: self.budget,
            weight_bytes: every_token + ffn_bytes,
            tied_output_bytes: self.tied_output_bytes,
            kv_cache_bytes: self.kv,
            compute_buffer_bytes: self.compute,
            runtime_bytes: runtime,
            ffn_layers,
            whole_layers: None,
            op_offload,
        })
    }

    /// llama.cpp's own partial offload, where every layer's attention does not fit: the output
    /// and the last layers whole (attention, KV cache and, with `ffn`, FFN), as many as the
    /// budget holds after the output, the compute buffers and the reserve. Op offload then
    /// copies whole host layers (attention too), so the reserve holds the largest layer.
    fn whole_last_layers(&self, ffn: bool) -> Result<Option<GpuLayout>, String> {
        let n_layer = self.layer_ffn.len();
        let kv_per_layer = self.kv / n_layer as u64;
        let largest_layer = (0..n_layer).map(|layer| self.layer_attention[layer] + self.layer_ffn[layer]).max().unwrap_or(0);
        let runtime = self.runtime.max(largest_layer);
        let whole = |layer: usize| self.layer_attention[layer] + if ffn { self.layer_ffn[layer] } else { 0 };
        let output = self.outside_layers + self.tied_output_bytes;
        let mut spare = self.budget.saturating_sub(output + self.compute + runtime);
        let mut count = 0;
        for layer in (0..n_layer).rev() {
            let bytes = whole(layer) + kv_per_layer;
            if bytes > spare {
                break;
            }
            spare -= bytes;
            count += 1;
        }
        if count == 0 {
            let attention = output + self.layer_attention.iter().sum::<u64>() + self.kv;
            return Err(format!(
                "the GPU budget of {} cannot hold every layer's attention with the output and KV cache ({}), nor one whole layer with the output, compute buffers ({}) and the runtime's reserve ({}); everything runs on the CPU",
                format_bytes(self.budget),
                format_bytes(attention),
                format_bytes(self.compute),
                format_bytes(runtime)
            ));
        }
        let layers = (n_layer - count) as u32..n_layer as u32;
        Ok(Some(GpuLayout {
            budget_bytes: self.budget,
            weight_bytes: output + layers.clone().map(|layer| whole(layer as usize)).sum::<u64>(),
            tied_output_bytes: self.tied_output_bytes,
            kv_cache_bytes: kv_per_layer * count as u64,
            compute_buffer_bytes: self.compute,
            runtime_bytes: runtime,
            ffn_layers: if ffn { layers.clone().collect() } else { Vec::new() },
            whole_layers: Some(layers),
            op_offload: true,
        }))
    }
}

/// Each tensor's tier: the GPU's where it holds the tensor, else what `host` says.
fn place(inventory: &Inventory, gpu: Option<&GpuLayout>, host: impl Fn(&TensorEntry) -> (Tier, &'static str)) -> Vec<TensorPlacement> {
    inventory
        .tensors
        .iter()
        .map(|tensor| {
            let (tier, why) = match gpu {
                Some(gpu) if gpu.holds(tensor) => (Tier::Gpu, gpu_reason(gpu, tensor)),
                _ => host(tensor),
            };
            TensorPlacement { name: tensor.name.clone(), layer: tensor.layer, tier, bytes: tensor.bytes, why }
        })
        .collect()
}

/// Why a tensor on the GPU is there.
fn gpu_reason(gpu: &GpuLayout, tensor: &TensorEntry) -> &'static str {
    match (&gpu.whole_layers, is_streamable(tensor)) {
        (Some(_), _) => "a layer the GPU budget holds whole: computed on the GPU",
        (None, true) => "FFN of a layer the GPU budget holds: computed on the GPU",
        (None, false) => "touched by every token: on the GPU with the KV cache",
    }
}

pub fn plan(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions) -> Result<Plan, PlanError> {
    let all_layer_ffn = ffn_bytes_by_layer(inventory);
    // Forced streaming (tests, benchmarks) streams every FFN layer the host cannot hold: none
    // of them goes to the GPU.
    let forced_stream = matches!(options.mode, ModeChoice::Forced(Mode::DenseStream | Mode::ExpertStream));
    let (gpu, gpu_unused) = match gpu_tier(inventory, options, machine, &all_layer_ffn, !forced_stream) {
        Ok(gpu) => (gpu, None),
        Err(why) => (None, Some(why)),
    };
    let on_gpu = |tensor: &TensorEntry| gpu.as_ref().is_some_and(|gpu| gpu.holds(tensor));
    // What the host holds: weights not on the GPU, the KV cache unless the GPU holds it, and
    // the CPU's compute buffers (the CPU still computes host-resident and streamed layers).
    let weights: u64 = inventory.tensors.iter().filter(|tensor| !on_gpu(tensor)).map(|tensor| tensor.bytes).sum();
    let kv = kv_cache_bytes(inventory, options.n_ctx) - gpu.as_ref().map_or(0, |gpu| gpu.kv_cache_bytes);
    let compute = compute_buffer_bytes(inventory, options.n_ctx, options.n_ubatch);
    let budget = machine.memory_budget_bytes;
    let everything = weights + kv + compute;
    let has_experts = inventory.expert_tensors().next().is_some();
    let mode = match options.mode {
        ModeChoice::Forced(mode) => mode,
        ModeChoice::Auto if everything <= budget => Mode::Resident,
        ModeChoice::Auto if has_experts => Mode::ExpertStream,
        ModeChoice::Auto => Mode::DenseStream,
    };
    let base = Plan {
        mode,
        budget: BudgetUse { budget_bytes: budget, resident_weight_bytes: weights, window_bytes: 0, kv_cache_bytes: kv, compute_buffer_bytes: compute, total_bytes: everything },
        tensors: Vec::new(),
        dense: None,
        experts: None,
        gpu: gpu.clone(),
        gpu_unused,
        streamed_bytes_per_token: 0,
        io_bound_tokens_per_sec: None,
        // The measured compute is that of streaming runs; nothing streams here.
        limit_tokens_per_sec: None,
    };
    if mode == Mode::ExpertStream {
        return plan_experts(inventory, machine, options, base);
    }
    if mode == Mode::Resident {
        let why = if gpu.is_some() { "the host holds what the GPU does not" } else { "the whole model fits" };
        return Ok(Plan { tensors: place(inventory, gpu.as_ref(), |_| (Tier::Ram, why)), ..base });
    }

    // Dense-stream over the layers whose FFN the GPU does not hold.
    let host_layers: Vec<u32> = (0..all_layer_ffn.len() as u32).filter(|layer| !gpu.as_ref().is_some_and(|gpu| gpu.ffn_layers.contains(layer))).collect();
    let layer_ffn: Vec<u64> = host_layers.iter().map(|&layer| all_layer_ffn[layer as usize]).collect();
    if layer_ffn.iter().all(|&bytes| bytes == 0) {
        if all_layer_ffn.iter().any(|&bytes| bytes > 0) {
            // The GPU holds every FFN layer: nothing is left to stream, and the host cannot
            // hold the rest.
            return Err(PlanError::BudgetTooSmall { budget, needed: everything, resident: weights, window: 0, layers: 0, kv, compute });
        }
        return Err(PlanError::ModeUnavailable { mode: "dense-stream", what: "FFN tensors in layers" });
    }
    let n_layer = layer_ffn.len();
    let fixed_weights = weights - layer_ffn.iter().sum::<u64>();
    let forced = options.mode == ModeChoice::Forced(Mode::DenseStream);
    let fits = everything <= budget;
    let candidates: Vec<usize> = match options.window_layers {
        Some(layers) => vec![layers.clamp(1, n_layer)],
        None => (1..=MAX_WINDOW_LAYERS.min(n_layer)).collect(),
    };
    let costed: Vec<DenseCandidate> = candidates
        .iter()
        .filter_map(|&window| dense_candidate(&layer_ffn, fixed_weights + kv + compute, budget, window, forced, fits, machine))
        .collect();
    // The least predicted time per token; a larger window must win by more than 2% to be
    // worth the layer it takes from the pinned set.
    let Some(chosen) = costed.iter().fold(None::<&DenseCandidate>, |best, candidate| match best {
        Some(best) if candidate.seconds_per_token >= best.seconds_per_token * 0.98 => Some(best),
        _ => Some(candidate),
    }) else {
        let window = candidates[0];
        let largest = layer_ffn.iter().copied().max().unwrap_or(0);
        let window_bytes = largest * (window as u64 + 1).min(n_layer as u64);
        return Err(PlanError::BudgetTooSmall {
            budget,
            needed: fixed_weights + window_bytes + kv + compute,
            resident: fixed_weights,
            window: window_bytes,
            layers: window,
            kv,
            compute,
        });
    };
    // The candidate numbers host layers; name them by layer.
    let streamed_layers: Vec<u32> = chosen.streamed_layers.iter().map(|&index| host_layers[index as usize]).collect();
    let pinned_layers: Vec<u32> = host_layers.iter().copied().filter(|layer| !streamed_layers.contains(layer)).collect();
    let streamed_bytes_per_token = chosen.streamed_bytes;
    let tensors = place(inventory, gpu.as_ref(), |tensor| {
        let streamed = is_streamable(tensor) && streamed_layers.contains(&tensor.layer.expect("streamable tensors have a layer"));
        match (streamed, is_streamable(tensor)) {
            (true, _) => (Tier::Stream, "FFN of a streamed layer: read through the window each token"),
            (false, true) => (Tier::Ram, "FFN of a pinned layer: the budget holds it"),
            (false, false) => (Tier::Ram, "touched by every token and small: always resident"),
        }
    });
    let resident_weight_bytes = weights - streamed_bytes_per_token;
    let window_bytes = chosen.window_bytes;
    let io_bound_tokens_per_sec = machine
        .disk_bytes_per_sec
        .filter(|_| streamed_bytes_per_token > 0)
        .map(|bandwidth| bandwidth / streamed_bytes_per_token as f64);
    Ok(Plan {
        budget: BudgetUse {
            budget_bytes: budget,
            resident_weight_bytes,
            window_bytes,
            kv_cache_bytes: kv,
            compute_buffer_bytes: compute,
            total_bytes: resident_weight_bytes + window_bytes + kv + compute,
        },
        tensors,
        dense: Some(DenseLayout {
            streamed_layers,
            pinned_layers,
            window_layers: chosen.window,
            window_sized: options.window_layers.is_none(),
            windows_costed: costed.iter().map(|candidate| (candidate.window, candidate.seconds_per_token)).collect(),
        }),
        streamed_bytes_per_token,
        io_bound_tokens_per_sec,
        limit_tokens_per_sec: physical_limit(machine, streamed_bytes_per_token),
        ..base
    })
}

/// The largest window the cost model considers: past a few layers in flight the disk queue is
/// full and each more layer only takes one from the pinned set.
const MAX_WINDOW_LAYERS: usize = 8;

/// One dense layout the cost model weighs: a window of `window` layers ahead, and as many
/// pinned layers as the rest of the budget holds.
#[derive(Clone, Debug)]
struct DenseCandidate {
    window: usize,
    streamed_layers: Vec<u32>,
    streamed_bytes: u64,
    window_bytes: u64,
    /// Predicted decode time per token: max(compute, disk), the disk term at the bandwidth
    /// this window's reads in flight reach (relative units when the bandwidth is unknown).
    seconds_per_token: f64,
}

fn dense_candidate(layer_ffn: &[u64], fixed: u64, budget: u64, window: usize, forced: bool, fits: bool, machine: &MachineFacts) -> Option<DenseCandidate> {
    let n_layer = layer_ffn.len();
    // The window holds `window` layers read ahead plus the one computing.
    let largest = layer_ffn.iter().copied().max().unwrap_or(0);
    let full_window = largest * (window as u64 + 1).min(n_layer as u64);
    if fixed + full_window > budget {
        return None;
    }
    // Pin as many layers as the rest of the budget holds (counted by the largest layer, as
    // layers are nearly equal): a fixed set, never LRU over the cyclic sweep.
    let spare = budget - fixed - full_window;
    let mut pinned_count = spare.checked_div(largest).map_or(n_layer, |count| count as usize);
    if forced && pinned_count >= n_layer {
        // Forced streaming of a model that fits: stream one layer more than the window holds,
        // so layers still rotate through it (tests, benchmarks), and pin the rest.
        pinned_count = if fits { n_layer.saturating_sub(window + 2) } else { n_layer - 1 };
    }
    let streamed_count = n_layer - pinned_count.min(n_layer);
    let streamed_set = spread(streamed_count, n_layer);
    let streamed_layers: Vec<u32> = (0..n_layer as u32).filter(|layer| streamed_set.contains(&(*layer as usize))).collect();
    let streamed_bytes: u64 = streamed_layers.iter().map(|&layer| layer_ffn[layer as usize]).sum();
    let window_bytes = if streamed_layers.is_empty() { 0 } else { largest * (window as u64 + 1).min(streamed_layers.len() as u64) };
    // What can be in flight: the window's layers, as far as the store's reader threads take
    // them (`queue_depth` chunks at once). The disk's rate at that depth is the profile's.
    let mean_layer = streamed_bytes / streamed_layers.len().max(1) as u64;
    let reader_limit = u64::from(machine.read_queue_depth.unwrap_or(4).max(1)) * crate::store::CHUNK_BYTES;
    let bandwidth = rate_in_flight(machine, (window as u64 * mean_layer).min(reader_limit));
    let disk_seconds = streamed_bytes as f64 / bandwidth;
    let seconds_per_token = disk_seconds.max(machine.compute_seconds_per_token.unwrap_or(0.0));
    Some(DenseCandidate { window, streamed_layers, streamed_bytes, window_bytes, seconds_per_token })
}

/// The disk's rate with `in_flight` bytes outstanding: the best profile point that needs no more
/// in flight than that; below the smallest point, its rate scaled down. Without points, the
/// best direct rate (or 1, a relative unit, when nothing was measured).
fn rate_in_flight(machine: &MachineFacts, in_flight: u64) -> f64 {
    let best = machine.disk_bytes_per_sec.unwrap_or(1.0);
    if machine.disk_read_points.is_empty() {
        return best;
    }
    let reachable = machine.disk_read_points.iter().filter(|(needed, _)| *needed <= in_flight).map(|(_, rate)| *rate).fold(0.0, f64::max);
    if reachable > 0.0 {
        return reachable;
    }
    let (needed, rate) = machine.disk_read_points.iter().copied().min_by_key(|(needed, _)| *needed).expect("not empty");
    (rate * in_flight as f64 / needed.max(1) as f64).max(f64::MIN_POSITIVE)
}

/// ARCHITECTURE.md §6: `1 / max(t_compute, bytes streamed per token / disk bandwidth)`, when
/// both terms are known.
fn physical_limit(machine: &MachineFacts, streamed_bytes_per_token: u64) -> Option<f64> {
    let compute = machine.compute_seconds_per_token?;
    let disk = match machine.disk_bytes_per_sec {
        Some(bandwidth) => streamed_bytes_per_token as f64 / bandwidth,
        None if streamed_bytes_per_token == 0 => 0.0,
        None => return None,
    };
    let seconds = compute.max(disk);
    (seconds > 0.0).then(|| 1.0 / seconds)
}

/// Expert-stream: every routed expert tensor of a layer the GPU does not hold streams by
/// expert; the rest is resident, and what the budget leaves is the expert cache.
fn plan_experts(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions, base: Plan) -> Result<Plan, PlanError> {
    let hparams = &inventory.hparams;
    let n_expert = hparams.n_expert;
    let on_gpu = |tensor: &TensorEntry| base.gpu.as_ref().is_some_and(|gpu| gpu.holds(tensor));
    let streamed: Vec<&TensorEntry> = inventory.expert_tensors().filter(|tensor| !on_gpu(tensor)).collect();
    if n_expert == 0 || inventory.expert_tensors().next().is_none() {
        return Err(PlanError::ModeUnavailable { mode: "expert-stream", what: "routed expert tensors" });
    }
    let (kv, compute) = (base.budget.kv_cache_bytes, base.budget.compute_buffer_bytes);
    let mut unit_bytes_by_layer = vec![0u64; hparams.n_layer as usize];
    for tensor in &streamed {
        let slices = tensor.experts.expect("expert tensors have slices");
        unit_bytes_by_layer[tensor.layer.expect("experts have a layer") as usize] += slices.slice_bytes;
    }
    let unit_bytes = unit_bytes_by_layer.iter().copied().max().unwrap_or(0);
    let min_slice_bytes = streamed.iter().filter_map(|tensor| tensor.experts.map(|slices| slices.slice_bytes)).min().unwrap_or(0);
    let moe_layers = unit_bytes_by_layer.iter().filter(|&&bytes| bytes > 0).count() as u64;
    let expert_bytes: u64 = streamed.iter().map(|tensor| tensor.bytes).sum();
    let fixed = base.budget.resident_weight_bytes - expert_bytes;
    let budget = machine.memory_budget_bytes;
    // The cache must hold one layer's every expert: a prefill batch may pick them all.
    let minimum_units = if moe_layers == 0 { 0 } else { n_expert as usize };
    let needed = fixed + kv + compute + minimum_units as u64 * unit_bytes;
    if needed > budget {
        return Err(PlanError::BudgetTooSmall {
            budget,
            needed,
            resident: fixed,
            window: minimum_units as u64 * unit_bytes,
            layers: 1,
            kv,
            compute,
        });
    }
    let affordable = ((budget - fixed - kv - compute) / unit_bytes.max(1)) as usize;
    let total_units = (moe_layers * n_expert) as usize;
    let cache_units = options.expert_cache_units.map_or(affordable, |units| units.min(affordable)).clamp(minimum_units, total_units.max(minimum_units));
    let tensors = place(inventory, base.gpu.as_ref(), |tensor| {
        if tensor.experts.is_some() {
            (Tier::Stream, "routed experts: only the router's picks are read, through the expert cache")
        } else {
            (Tier::Ram, "touched by every token and small: always resident")
        }
    });
    let worst_case = moe_layers * hparams.n_expert_used.max(1) * unit_bytes;
    let cache_bytes = cache_units as u64 * unit_bytes;
    Ok(Plan {
        budget: BudgetUse {
            budget_bytes: budget,
            resident_weight_bytes: fixed,
            window_bytes: cache_bytes,
            kv_cache_bytes: kv,
            compute_buffer_bytes: compute,
            total_bytes: fixed + cache_bytes + kv + compute,
        },
        tensors,
        experts: Some(ExpertLayout {
            n_expert,
            n_expert_used: hparams.n_expert_used,
            unit_bytes,
            cache_units,
            policy: options.cache_policy,
            min_slice_bytes,
            prefetch: options.expert_prefetch.unwrap_or(min_slice_bytes >= HUGE_SLICE_MIN_BYTES),
        }),
        streamed_bytes_per_token: worst_case,
        io_bound_tokens_per_sec: machine.disk_bytes_per_sec.filter(|_| worst_case > 0).map(|bandwidth| bandwidth / worst_case as f64),
        // What streams per token depends on the cache's hit rate, known only once it runs.
        limit_tokens_per_sec: None,
        ..base
    })
}

/// llama.cpp's name for the token embedding, which it keeps in host memory (tokens are looked up
/// on the CPU). Models without an output matrix compute logits with a copy of it, under the
/// same name, so overriding the name would move that copy off the GPU too.
const TOKEN_EMBEDDING: &str = "token_embd.weight";

impl Plan {
    /// llama.cpp's `n_gpu_layers` for this plan: every layer (and the output) with a GPU tier,
    /// the output and the last layers where the tier holds just those, none without.
    pub fn n_gpu_layers(&self) -> i32 {
        match &self.gpu {
            // llama.cpp counts the output as one more layer, offloaded first.
            Some(GpuLayout { whole_layers: Some(layers), .. }) => layers.len() as i32 + 1,
            Some(_) => -1,
            None => 0,
        }
    }

    /// Override patterns (exact names) that keep the tensors of `tiers` in host memory where
    /// `n_gpu_layers` would put them on the GPU: empty without a GPU tier.
    pub fn host_patterns(&self, tiers: &[Tier]) -> Vec<String> {
        let Some(gpu) = &self.gpu else {
            return Vec::new();
        };
        self.tensors
            .iter()
            .filter(|tensor| tiers.contains(&tensor.tier) && tensor.name != TOKEN_EMBEDDING && gpu.offloads(tensor.layer))
            .map(|tensor| hypura_sys::exact_name_pattern(&tensor.name))
            .collect()
    }

    /// What a model loaded with this plan holds in memory with a KV cache of `kv_bytes`, and
    /// the part of it in device memory (Ollama's `size` and `size_vram`): host weights (the
    /// stream window's, not every streamed byte), the GPU tier's weights, and the KV cache,
    /// which is on the GPU with a GPU tier.
    pub fn memory_use(&self, kv_bytes: u64) -> (u64, u64) {
        let host = self.budget.resident_weight_bytes + self.budget.window_bytes;
        match &self.gpu {
            Some(gpu) => {
                // The device's share of the KV cache as planned (all of it, or its layers').
                let planned = u128::from(gpu.kv_cache_bytes + self.budget.kv_cache_bytes).max(1);
                let device_kv = (u128::from(kv_bytes) * u128::from(gpu.kv_cache_bytes) / planned) as u64;
                (host + gpu.weight_bytes + kv_bytes, gpu.weight_bytes + device_kv)
            }
            None => (host + kv_bytes, 0),
        }
    }

    pub fn streamed_tensors(&self) -> impl Iterator<Item = &TensorPlacement> {
        self.tensors.iter().filter(|tensor| tensor.tier == Tier::Stream)
    }

    /// The human explanation `inspect` prints.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let budget = &self.budget;
        let _ = writeln!(out, "plan         mode {}", self.mode.name());
        let _ = writeln!(
            out,
            "memory       {} of a {} budget: {} resident weights + {} stream window + {} KV cache + {} compute buffers",
            format_bytes(budget.total_bytes),
            format_bytes(budget.budget_bytes),
            format_bytes(budget.resident_weight_bytes),
            format_bytes(budget.window_bytes),
            format_bytes(budget.kv_cache_bytes),
            format_bytes(budget.compute_buffer_bytes)
        );
        if let Some(gpu) = &self.gpu {
            let layers = match &gpu.whole_layers {
                Some(layers) => format!(
                    "layers {}-{} whole on the GPU with the output ({} of {}; every layer's attention and KV cache do not fit)",
                    layers.start,
                    layers.end - 1,
                    layers.len(),
                    layers.end
                ),
                None => format!(
                    "FFN of {} layer{} on the GPU{}",
                    gpu.ffn_layers.len(),
                    if gpu.ffn_layers.len() == 1 { "" } else { "s" },
                    if gpu.ffn_layers.is_empty() { String::new() } else { format!(" {:?}", gpu.ffn_layers) }
                ),
            };
            let _ = writeln!(
                out,
                "gpu          {} of a {} budget: {} weights + {} KV cache + {} compute buffers + {} runtime; {layers}",
                format_bytes(gpu.total_bytes()),
                format_bytes(gpu.budget_bytes),
                format_bytes(gpu.weight_bytes),
                format_bytes(gpu.kv_cache_bytes),
                format_bytes(gpu.compute_buffer_bytes),
                format_bytes(gpu.runtime_bytes),
            );
            let prompts = if gpu.op_offload {
                "ggml may move large prompt batches to the GPU"
            } else {
                "prompt batches too (op offload off: the budget has no room for a host layer's copy)"
            };
            let _ = writeln!(out, "             host-memory weights and streamed layers compute on the CPU at decode (copying them costs more than computing them); {prompts}");
        }
        if let Some(why) = &self.gpu_unused {
            let _ = writeln!(out, "gpu          unused: {why}");
        }
        if let Some(experts) = &self.experts {
            let _ = writeln!(
                out,
                "experts      cache of {} (layer, expert) units of {} ({}), {:?} replacement; {} of {} experts per token",
                experts.cache_units,
                format_bytes(experts.unit_bytes),
                format_bytes(experts.cache_units as u64 * experts.unit_bytes),
                experts.policy,
                experts.n_expert_used,
                experts.n_expert
            );
            let _ = writeln!(
                out,
                "prefetch     {}: the next layer's router on this layer's hidden state{}",
                if experts.prefetch { "on" } else { "off" },
                if experts.min_slice_bytes >= HUGE_SLICE_MIN_BYTES {
                    format!(" (slices of {} and up are read into huge pages)", format_bytes(experts.min_slice_bytes))
                } else {
                    format!(" (slices of {} cost more CPU to read than overlapping saves on few cores)", format_bytes(experts.min_slice_bytes))
                }
            );
            let _ = writeln!(out, "per token    at most {} read from disk (every pick a miss)", format_bytes(self.streamed_bytes_per_token));
            if let Some(bound) = self.io_bound_tokens_per_sec {
                let _ = writeln!(out, "bound        at least {bound:.2} tok/s from disk bandwidth alone, before cache hits");
            }
        }
        if let Some(dense) = &self.dense {
            let _ = writeln!(
                out,
                "dense        {} FFN layers pinned in RAM {:?}; {} streamed {:?}, read {} layer{} ahead of the one computing",
                dense.pinned_layers.len(),
                dense.pinned_layers,
                dense.streamed_layers.len(),
                dense.streamed_layers,
                dense.window_layers,
                if dense.window_layers == 1 { "" } else { "s" }
            );
            if dense.window_sized && dense.windows_costed.len() > 1 && self.io_bound_tokens_per_sec.is_some() {
                let costs: Vec<String> = dense.windows_costed.iter().map(|(window, seconds)| format!("{window}: {:.0} ms", seconds * 1e3)).collect();
                let _ = writeln!(
                    out,
                    "window       chosen by predicted time per token, max(compute, disk at the reads in flight), each layer of window one fewer pinned: {}",
                    costs.join(", ")
                );
            }
            let _ = writeln!(out, "per token    {} read from disk", format_bytes(self.streamed_bytes_per_token));
            if let Some(bound) = self.io_bound_tokens_per_sec {
                let _ = writeln!(out, "bound        at most {bound:.2} tok/s from disk bandwidth alone");
            }
        }
        if let Some(limit) = self.limit_tokens_per_sec {
            let _ = writeln!(out, "limit        {limit:.2} tok/s: 1 / max(measured compute per token, streamed bytes / disk bandwidth)");
        }
        let mut reasons: Vec<(&str, Tier, usize, u64)> = Vec::new();
        for tensor in &self.tensors {
            match reasons.iter_mut().find(|(why, tier, _, _)| *why == tensor.why && *tier == tensor.tier) {
                Some(entry) => {
                    entry.2 += 1;
                    entry.3 += tensor.bytes;
                }
                None => reasons.push((tensor.why, tensor.tier, 1, tensor.bytes)),
            }
        }
        for (why, tier, count, bytes) in reasons {
            let _ = writeln!(out, "  {:<6} {:>4} tensors {:>12}  {why}", format!("{tier:?}").to_lowercase(), count, format_bytes(bytes));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Hparams, Inventory, Role, TensorEntry};
    use hypura_gguf::GgmlType;
    use proptest::prelude::*;

    /// A llama-like inventory: per layer one attention tensor and three FFN tensors.
    fn inventory(n_layer: u64, attention_bytes: u64, ffn_bytes: u64, embedding_bytes: u64) -> Inventory {
        let mut tensors = Vec::new();
        let mut offset = 0;
        let mut add = |name: String, role: Role, layer: Option<u32>, bytes: u64| {
            tensors.push(TensorEntry { name, role, layer, ggml_type: GgmlType::Q4_K, dims: vec![256, bytes / 144], bytes, split: 0, file_offset: offset, experts: None });
            offset += bytes;
        };
        add("token_embd.weight".into(), Role::TokenEmbedding, None, embedding_bytes);
        for layer in 0..n_layer as u32 {
            add(format!("blk.{layer}.attn_q.weight"), Role::AttentionQ, Some(layer), attention_bytes);
            for (suffix, role) in [("ffn_gate", Role::FfnGate), ("ffn_up", Role::FfnUp), ("ffn_down", Role::FfnDown)] {
                add(format!("blk.{layer}.{suffix}.weight"), role, Some(layer), ffn_bytes);
            }
        }
        Inventory {
            path: "test.gguf".into(),
            split_paths: vec!["test.gguf".into()],
            arch: "llama".into(),
            name: None,
            hparams: Hparams {
                n_layer,
                n_embd: 2048,
                n_head: 16,
                n_head_kv: 4,
                head_dim_k: 128,
                head_dim_v: 128,
                n_ctx_train: 4096,
                n_ff: 5632,
                n_expert: 0,
                n_expert_used: 0,
                n_ff_expert: 0,
                n_vocab: 32000,
            },
            tensors,
            file_bytes: offset + 4096,
        }
    }

    fn options(mode: ModeChoice, window_layers: usize) -> PlanOptions {
        PlanOptions { mode, n_ctx: 1024, n_ubatch: 256, window_layers: Some(window_layers), ..PlanOptions::default() }
    }

    #[test]
    fn a_model_that_fits_is_resident() {
        let inventory = inventory(8, 1 << 20, 4 << 20, 8 << 20);
        let plan = plan(&inventory, &MachineFacts { memory_budget_bytes: 8 << 30, disk_bytes_per_sec: None, ..MachineFacts::default() }, &options(ModeChoice::Auto, 2)).unwrap();
        assert_eq!(plan.mode, Mode::Resident);
        assert!(plan.tensors.iter().all(|tensor| tensor.tier == Tier::Ram));
        assert_eq!(plan.streamed_bytes_per_token, 0);
    }

    #[test]
    fn a_budget_below_the_fixed_part_is_refused_with_the_numbers() {
        let inventory = inventory(8, 64 << 20, 64 << 20, 256 << 20);
        let error = plan(&inventory, &MachineFacts { memory_budget_bytes: 300 << 20, disk_bytes_per_sec: None, ..MachineFacts::default() }, &options(ModeChoice::Auto, 2)).unwrap_err();
        match &error {
            PlanError::BudgetTooSmall { budget, needed, resident, layers, .. } => {
                assert_eq!(*budget, 300 << 20);
                assert!(needed > budget);
                assert_eq!(*resident, (256 << 20) + 8 * (64 << 20));
                assert_eq!(*layers, 2);
            }
            other => panic!("{other:?}"),
        }
        let message = error.to_string();
        assert!(message.contains("300.0 MiB") && message.contains("768.0 MiB resident weights"), "{message}");
    }

    #[test]
    fn the_io_bound_follows_from_streamed_bytes() {
        let inventory = inventory(10, 16 << 20, 32 << 20, 64 << 20);
        let fixed = (64 << 20) + 10 * (16 << 20) + kv_cache_bytes(&inventory, 1024) + compute_buffer_bytes(&inventory, 1024, 256);
        // Room for the window (3 layers of 96 MiB) and 2 pinned layers.
        let budget = fixed + 5 * (96 << 20);
        let plan = plan(&inventory, &MachineFacts { memory_budget_bytes: budget, disk_bytes_per_sec: Some(2e9), ..MachineFacts::default() }, &options(ModeChoice::Auto, 2)).unwrap();
        let dense = plan.dense.as_ref().unwrap();
        assert_eq!(dense.pinned_layers.len(), 2);
        assert_eq!(dense.streamed_layers.len(), 8);
        assert_eq!(plan.streamed_bytes_per_token, 8 * (96 << 20));
        let bound = plan.io_bound_tokens_per_sec.unwrap();
        assert!((bound - 2e9 / (8.0 * (96u64 << 20) as f64)).abs() < 1e-9);
    }

    #[test]
    fn forced_dense_stream_of_a_model_that_fits_still_rotates_layers_through_the_window() {
        let inventory = inventory(12, 1 << 20, 4 << 20, 8 << 20);
        for window in 1..4 {
            let plan = plan(&inventory, &MachineFacts { memory_budget_bytes: 8 << 30, ..MachineFacts::default() }, &options(ModeChoice::Forced(Mode::DenseStream), window)).unwrap();
            let dense = plan.dense.as_ref().unwrap();
            // The window holds `window + 1` layers; one more must stream, or nothing is read
            // after the first token.
            assert_eq!(dense.streamed_layers.len(), window + 2, "{}", plan.render());
        }
    }

    fn auto_window(mode: ModeChoice) -> PlanOptions {
        PlanOptions { mode, n_ctx: 1024, n_ubatch: 256, window_layers: None, ..PlanOptions::default() }
    }

    /// A 2 GB/s disk with a queue-hungry profile and a budget with room for everything but
    /// the FFN layers, plus `layers` FFN layers of `ffn` × 3 bytes.
    fn machine_with_room(inventory: &Inventory, ffn: u64, layers: u64, compute_seconds_per_token: Option<f64>) -> MachineFacts {
        let fixed = inventory.tensor_data_bytes() - inventory.tensors.iter().filter(|tensor| tensor.role.is_dense_ffn()).map(|tensor| tensor.bytes).sum::<u64>();
        MachineFacts {
            memory_budget_bytes: fixed + kv_cache_bytes(inventory, 1024) + compute_buffer_bytes(inventory, 1024, 256) + layers * 3 * ffn,
            disk_bytes_per_sec: Some(2e9),
            read_queue_depth: Some(16),
            disk_read_points: queue_hungry_disk(),
            compute_seconds_per_token,
            ..MachineFacts::default()
        }
    }

    #[test]
    fn layers_larger_than_the_read_queue_get_a_window_of_one() {
        // 96 MiB layers, 16 reads of 4 MiB in flight: one layer ahead fills the queue, and a
        // wider window would only stream more.
        let inventory = inventory(16, 16 << 20, 32 << 20, 64 << 20);
        let machine = machine_with_room(&inventory, 32 << 20, 8, None);
        let plan = plan(&inventory, &machine, &auto_window(ModeChoice::Auto)).unwrap();
        let dense = plan.dense.as_ref().unwrap();
        assert_eq!(dense.window_layers, 1, "{}", plan.render());
        assert!(dense.window_sized);
        assert_eq!(dense.pinned_layers.len(), 6);
        assert!(plan.render().contains("read 1 layer ahead"), "{}", plan.render());
    }

    /// A disk that needs 64 MiB in flight for its full rate, a third of it with 4 MiB.
    fn queue_hungry_disk() -> Vec<(u64, f64)> {
        vec![(4 << 20, 0.6e9), (16 << 20, 1.2e9), (64 << 20, 2e9)]
    }

    #[test]
    fn small_layers_get_a_window_that_fills_the_read_queue() {
        // 6 MiB layers: one layer ahead reaches a third of the disk's rate; several layers
        // ahead are worth the pinned layers they cost.
        let inventory = inventory(32, 1 << 20, 2 << 20, 8 << 20);
        let machine = machine_with_room(&inventory, 2 << 20, 16, None);
        let plan = plan(&inventory, &machine, &auto_window(ModeChoice::Auto)).unwrap();
        let dense = plan.dense.as_ref().unwrap();
        assert!(dense.window_layers >= 3, "{}", plan.render());
        let costs: Vec<f64> = dense.windows_costed.iter().map(|(_, seconds)| *seconds).collect();
        let chosen = dense.windows_costed.iter().find(|(window, _)| *window == dense.window_layers).unwrap().1;
        assert!(costs.iter().all(|&cost| chosen <= cost / 0.98), "{costs:?}");
    }

    #[test]
    fn a_compute_bound_model_keeps_the_smallest_window_and_states_the_limit() {
        // Same small layers, but compute takes a second per token: the disk at one layer in
        // flight already keeps up, so the window stays at one and pins the most.
        let inventory = inventory(32, 1 << 20, 2 << 20, 8 << 20);
        let machine = machine_with_room(&inventory, 2 << 20, 16, Some(1.0));
        let plan = plan(&inventory, &machine, &auto_window(ModeChoice::Auto)).unwrap();
        assert_eq!(plan.dense.as_ref().unwrap().window_layers, 1, "{}", plan.render());
        assert!((plan.limit_tokens_per_sec.unwrap() - 1.0).abs() < 1e-9);
        // A given window is kept, whatever the cost model would choose.
        let forced = super::plan(&inventory, &machine, &options(ModeChoice::Auto, 3)).unwrap();
        assert_eq!(forced.dense.as_ref().unwrap().window_layers, 3);
        assert!(!forced.dense.as_ref().unwrap().window_sized);
    }

    /// A machine with `host` bytes of memory and a GPU budget of `gpu` bytes.
    fn with_gpu(host: u64, gpu: u64) -> MachineFacts {
        MachineFacts { memory_budget_bytes: host, disk_bytes_per_sec: Some(2e9), gpu_budget_bytes: gpu, ..MachineFacts::default() }
    }

    #[test]
    fn the_gpu_takes_what_every_token_touches_then_whole_ffn_layers_from_the_last() {
        // 8 layers of 16 MiB attention and 3 × 32 MiB FFN; the embedding is tied (no output
        // matrix), so the GPU holds a copy of it for the logits.
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let options = auto_window(ModeChoice::Auto);
        let fixed = 8 * (16 << 20) + (64 << 20) + kv_cache_bytes(&inventory, 1024) + compute_buffer_bytes(&inventory, 1024, 256);
        // What every token touches, op offload's copy of one host layer's FFN, 3 FFN layers.
        let plan = plan(&inventory, &with_gpu(8 << 30, fixed + (96 << 20) + 3 * (96 << 20) + (50 << 20)), &options).unwrap();
        let gpu = plan.gpu.as_ref().expect("a GPU tier");
        assert_eq!(gpu.ffn_layers, vec![5, 6, 7], "{}", plan.render());
        assert_eq!(gpu.tied_output_bytes, 64 << 20);
        assert_eq!(gpu.runtime_bytes, 96 << 20, "the copy of a host layer's FFN for prompt batches");
        assert_eq!(plan.mode, Mode::Resident);
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!(tier("token_embd.weight"), Tier::Ram);
        assert_eq!(tier("blk.0.attn_q.weight"), Tier::Gpu);
        assert_eq!(tier("blk.0.ffn_up.weight"), Tier::Ram);
        assert_eq!(tier("blk.7.ffn_up.weight"), Tier::Gpu);
        // The host keeps the embedding and five FFN layers, and no KV cache.
        assert_eq!(plan.budget.resident_weight_bytes, (64 << 20) + 5 * (96 << 20));
        assert_eq!(plan.budget.kv_cache_bytes, 0);
        // llama.cpp gets every layer, with the host layers' FFN kept in host memory by name.
        assert_eq!(plan.n_gpu_layers(), -1);
        let patterns = plan.host_patterns(&[Tier::Ram]);
        assert_eq!(patterns.len(), 15);
        assert!(patterns.contains(&"^blk\\.0\\.ffn_up\\.weight$".to_string()), "{patterns:?}");
        assert!(plan.render().contains("FFN of 3 layers on the GPU [5, 6, 7]"), "{}", plan.render());
    }

    #[test]
    fn a_gpu_holding_every_layer_keeps_no_room_for_copies_of_host_weights() {
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let fixed = 8 * (16 << 20) + (64 << 20) + kv_cache_bytes(&inventory, 1024) + compute_buffer_bytes(&inventory, 1024, 256);
        let all = plan(&inventory, &with_gpu(8 << 30, fixed + 8 * (96 << 20)), &auto_window(ModeChoice::Auto)).unwrap();
        let gpu = all.gpu.as_ref().unwrap();
        assert_eq!(gpu.ffn_layers.len(), 8, "{}", all.render());
        assert_eq!(gpu.runtime_bytes, 0);
        // One byte less: a layer stays on the host, and room for its copy costs another layer.
        let short = plan(&inventory, &with_gpu(8 << 30, fixed + 8 * (96 << 20) - 1), &auto_window(ModeChoice::Auto)).unwrap();
        assert_eq!(short.gpu.as_ref().unwrap().ffn_layers, vec![2, 3, 4, 5, 6, 7], "{}", short.render());
        // The runtime's own reserve counts when it is the larger.
        let machine = MachineFacts { gpu_runtime_bytes: 200 << 20, ..with_gpu(8 << 30, fixed + 8 * (96 << 20)) };
        assert_eq!(plan(&inventory, &machine, &auto_window(ModeChoice::Auto)).unwrap().gpu.unwrap().runtime_bytes, 200 << 20);
    }

    #[test]
    fn a_gpu_too_small_for_every_layers_attention_takes_the_last_layers_whole() {
        // 8 layers of 64 MiB attention and 3 × 32 MiB FFN, a tied 64 MiB embedding. Every
        // layer's attention (512 MiB) with the output's copy does not fit; the output's copy,
        // two whole layers (160 MiB and 2 MiB of KV cache each) and room to copy a host layer
        // do: llama.cpp's own partial offload.
        let inventory = inventory(8, 64 << 20, 32 << 20, 64 << 20);
        let kv = kv_cache_bytes(&inventory, 1024);
        assert_eq!(kv, 16 << 20);
        let compute = compute_buffer_bytes(&inventory, 1024, 256);
        let budget = compute + (64 << 20) + (160 << 20) + 2 * (162 << 20);
        let plan = plan_for(&inventory, budget);
        let gpu = plan.gpu.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        assert_eq!(gpu.whole_layers, Some(6..8));
        assert_eq!(gpu.ffn_layers, vec![6, 7]);
        assert_eq!((gpu.weight_bytes, gpu.kv_cache_bytes, gpu.tied_output_bytes, gpu.runtime_bytes), ((64 << 20) + 2 * (160 << 20), 4 << 20, 64 << 20, 160 << 20));
        assert_eq!(gpu.total_bytes(), budget);
        // Two layers and the output, as llama.cpp counts them.
        assert_eq!(plan.n_gpu_layers(), 3);
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!((tier("blk.5.attn_q.weight"), tier("blk.5.ffn_up.weight")), (Tier::Ram, Tier::Ram));
        assert_eq!((tier("blk.6.attn_q.weight"), tier("blk.6.ffn_up.weight")), (Tier::Gpu, Tier::Gpu));
        assert_eq!(tier("token_embd.weight"), Tier::Ram);
        // The host keeps six layers, the embedding and their KV cache.
        assert_eq!(plan.budget.resident_weight_bytes, (64 << 20) + 6 * (160 << 20));
        assert_eq!(plan.budget.kv_cache_bytes, 12 << 20);
        // llama.cpp's n_gpu_layers puts no host tensor on the device: no overrides needed.
        assert!(plan.host_patterns(&[Tier::Ram, Tier::Stream]).is_empty());
        assert!(plan.render().contains("layers 6-7 whole on the GPU with the output (2 of 8;"), "{}", plan.render());
        // The device holds two of the eight layers' KV cache.
        assert_eq!(plan.memory_use(80 << 20).1, (64 << 20) + 2 * (160 << 20) + (20 << 20));
        // One byte less: one layer.
        assert_eq!(plan_for(&inventory, budget - 1).gpu.unwrap().whole_layers, Some(7..8));
        // Not even one layer with the output and the copy: unused.
        let unused = plan_for(&inventory, compute + (64 << 20) + (160 << 20) + (161 << 20));
        assert!(unused.gpu.is_none());
        assert!(unused.gpu_unused.unwrap().contains("nor one whole layer"));
    }

    #[test]
    fn whole_layers_carry_the_output_matrix_and_final_norm() {
        // The same model with its own 96 MiB output matrix and a final norm (no tied copy).
        let mut inventory = inventory(8, 64 << 20, 32 << 20, 64 << 20);
        for (name, role, bytes) in [("output_norm.weight", Role::Norm, 1u64 << 20), ("output.weight", Role::Output, 96 << 20)] {
            let last = inventory.tensors.last().unwrap();
            let entry = TensorEntry { name: name.into(), role, layer: None, bytes, file_offset: last.file_offset + last.bytes, ..inventory.tensors[0].clone() };
            inventory.tensors.push(entry);
        }
        let compute = compute_buffer_bytes(&inventory, 1024, 256);
        let budget = compute + (97 << 20) + (160 << 20) + 2 * (162 << 20);
        let plan = plan_for(&inventory, budget);
        let gpu = plan.gpu.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        assert_eq!(gpu.whole_layers, Some(6..8));
        assert_eq!((gpu.weight_bytes, gpu.tied_output_bytes), ((97 << 20) + 2 * (160 << 20), 0));
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!((tier("output.weight"), tier("output_norm.weight"), tier("token_embd.weight")), (Tier::Gpu, Tier::Gpu, Tier::Ram));
        assert_eq!(plan_for(&inventory, budget - 1).gpu.unwrap().whole_layers, Some(7..8));
    }

    #[test]
    fn every_layers_attention_without_room_for_a_copy_turns_op_offload_off() {
        // Every layer's attention, the tied output's copy and the KV cache fit, but not with
        // the 96 MiB copy of a host layer's FFN as well: that layout without op offload.
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let fixed = 8 * (16 << 20) + (64 << 20) + kv_cache_bytes(&inventory, 1024) + compute_buffer_bytes(&inventory, 1024, 256);
        let plan = plan_for(&inventory, fixed + (95 << 20));
        let gpu = plan.gpu.as_ref().unwrap();
        assert_eq!((gpu.whole_layers.clone(), gpu.op_offload, gpu.runtime_bytes), (None, false, 0));
        assert!(gpu.ffn_layers.is_empty());
        assert!(plan.render().contains("op offload off"), "{}", plan.render());
        assert!(plan_for(&inventory, fixed + (96 << 20)).gpu.unwrap().op_offload);
    }

    fn plan_for(inventory: &Inventory, gpu_budget: u64) -> Plan {
        plan(inventory, &with_gpu(8 << 30, gpu_budget), &auto_window(ModeChoice::Auto)).unwrap()
    }

    #[test]
    fn input_tables_stay_on_the_host_as_llama_cpp_keeps_them() {
        let mut inventory = inventory(4, 16 << 20, 32 << 20, 64 << 20);
        let last = inventory.tensors.last().unwrap();
        let entry = TensorEntry { name: "position_embd.weight".into(), role: Role::Other, layer: None, bytes: 8 << 20, file_offset: last.file_offset + last.bytes, ..inventory.tensors[0].clone() };
        inventory.tensors.push(entry);
        let plan = plan_for(&inventory, 4 << 30);
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!((tier("position_embd.weight"), tier("blk.0.attn_q.weight")), (Tier::Ram, Tier::Gpu));
        assert_eq!(plan.budget.resident_weight_bytes, (64 << 20) + (8 << 20));
    }

    #[test]
    fn memory_use_splits_host_and_device_as_planned() {
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let kv = 10 << 20;
        let host_only = plan(&inventory, &with_gpu(8 << 30, 0), &auto_window(ModeChoice::Auto)).unwrap();
        assert_eq!(host_only.memory_use(kv), (inventory.tensor_data_bytes() + kv, 0));
        let with_tier = plan(&inventory, &with_gpu(8 << 30, 4 << 30), &auto_window(ModeChoice::Auto)).unwrap();
        let gpu = with_tier.gpu.as_ref().unwrap();
        // The embedding stays on the host; the device holds the rest and the tied output's copy.
        assert_eq!(gpu.weight_bytes, inventory.tensor_data_bytes() - (64 << 20) + (64 << 20));
        assert_eq!(with_tier.memory_use(kv), ((64 << 20) + gpu.weight_bytes + kv, gpu.weight_bytes + kv));
        // Streaming: the host part is the resident weights and the window, not the whole file.
        let host_fixed = (64 << 20) + compute_buffer_bytes(&inventory, 1024, 256) + kv_cache_bytes(&inventory, 1024);
        let streamed = plan(&inventory, &with_gpu(host_fixed + 4 * (96 << 20), 0), &options(ModeChoice::Auto, 1)).unwrap();
        assert_eq!(streamed.mode, Mode::DenseStream, "{}", streamed.render());
        let (size, vram) = streamed.memory_use(kv);
        assert_eq!(size, streamed.budget.resident_weight_bytes + streamed.budget.window_bytes + kv);
        assert!(size < inventory.tensor_data_bytes());
        assert_eq!(vram, 0);
    }

    #[test]
    fn only_the_token_embedding_is_copied_for_tied_logits() {
        // A per-layer embedding (Gemma 3n) is looked up on the host, never used for the logits.
        let mut inventory = inventory(4, 16 << 20, 32 << 20, 64 << 20);
        let last = inventory.tensors.last().unwrap();
        let offset = last.file_offset + last.bytes;
        inventory.tensors.push(TensorEntry { name: "per_layer_token_embd.weight".into(), role: Role::TokenEmbedding, layer: None, file_offset: offset, ..inventory.tensors[0].clone() });
        let plan = plan(&inventory, &with_gpu(8 << 30, 4 << 30), &auto_window(ModeChoice::Auto)).unwrap();
        let gpu = plan.gpu.as_ref().unwrap();
        assert_eq!(gpu.tied_output_bytes, 64 << 20);
        assert_eq!(plan.tensors.iter().find(|tensor| tensor.name == "per_layer_token_embd.weight").unwrap().tier, Tier::Ram);
    }

    #[test]
    fn ffn_layers_the_gpu_holds_leave_the_host_stream_plan() {
        let inventory = inventory(16, 16 << 20, 32 << 20, 64 << 20);
        let gpu_fixed = 16 * (16 << 20) + (64 << 20) + kv_cache_bytes(&inventory, 1024) + compute_buffer_bytes(&inventory, 1024, 256);
        let host_fixed = (64 << 20) + compute_buffer_bytes(&inventory, 1024, 256);
        // The GPU holds 4 FFN layers (and room to copy a fifth); the host the window (2 layers)
        // and 4 pinned.
        let plan = plan(&inventory, &with_gpu(host_fixed + 6 * (96 << 20), gpu_fixed + 5 * (96 << 20)), &options(ModeChoice::Auto, 1)).unwrap();
        let dense = plan.dense.as_ref().expect("dense-stream");
        assert_eq!(plan.gpu.as_ref().unwrap().ffn_layers, vec![12, 13, 14, 15]);
        assert_eq!(dense.pinned_layers.len(), 4, "{}", plan.render());
        assert_eq!(dense.streamed_layers.len(), 8);
        assert!(dense.streamed_layers.iter().chain(&dense.pinned_layers).all(|layer| *layer < 12));
        assert_eq!(plan.streamed_bytes_per_token, 8 * (96 << 20));
        assert!(plan.budget.total_bytes <= plan.budget.budget_bytes);
    }

    #[test]
    fn a_gpu_budget_too_small_for_attention_and_kv_leaves_the_gpu_unused() {
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let plan = plan(&inventory, &with_gpu(8 << 30, 64 << 20), &auto_window(ModeChoice::Auto)).unwrap();
        assert!(plan.gpu.is_none());
        assert_eq!(plan.n_gpu_layers(), 0);
        assert!(plan.host_patterns(&[Tier::Ram]).is_empty());
        assert!(plan.tensors.iter().all(|tensor| tensor.tier == Tier::Ram));
        assert!(plan.render().contains("gpu          unused: the GPU budget of 64.0 MiB cannot hold"), "{}", plan.render());
    }

    #[test]
    fn forced_streaming_keeps_the_ffn_off_the_gpu() {
        let inventory = inventory(8, 1 << 20, 4 << 20, 8 << 20);
        let plan = plan(&inventory, &with_gpu(8 << 30, 8 << 30), &options(ModeChoice::Forced(Mode::DenseStream), 1)).unwrap();
        assert!(plan.gpu.as_ref().unwrap().ffn_layers.is_empty());
        assert!(plan.streamed_tensors().count() > 0);
        assert_eq!(plan.tensors.iter().find(|tensor| tensor.name == "blk.0.attn_q.weight").unwrap().tier, Tier::Gpu);
    }

    proptest! {
        /// No plan exceeds its budgets (host and GPU), and every tensor has exactly one tier.
        #[test]
        fn plans_respect_the_budget_and_place_every_tensor(
            n_layer in 1u64..48,
            attention in 1u64..64,
            ffn in 1u64..256,
            embedding in 1u64..512,
            budget_mib in 1u64..40_000,
            window in proptest::option::of(1usize..6),
            forced in any::<bool>(),
            compute in proptest::option::of(0.001f64..10.0),
            queue_depth in 1u32..64,
            gpu_mib in prop_oneof![Just(0u64), 1u64..20_000],
            runtime_mib in 0u64..512,
        ) {
            let inventory = inventory(n_layer, attention << 20, ffn << 20, embedding << 20);
            let machine = MachineFacts {
                memory_budget_bytes: budget_mib << 20,
                disk_bytes_per_sec: Some(1e9),
                read_queue_depth: Some(queue_depth),
                disk_read_points: queue_hungry_disk(),
                compute_seconds_per_token: compute,
                gpu_budget_bytes: gpu_mib << 20,
                gpu_runtime_bytes: runtime_mib << 20,
            };
            let mode = if forced { ModeChoice::Forced(Mode::DenseStream) } else { ModeChoice::Auto };
            let options = PlanOptions { window_layers: window, ..options(mode, 1) };
            match plan(&inventory, &machine, &options) {
                Ok(plan) => {
                    prop_assert!(plan.budget.total_bytes <= plan.budget.budget_bytes, "{:?}", plan.budget);
                    prop_assert_eq!(plan.tensors.len(), inventory.tensors.len());
                    for (placement, tensor) in plan.tensors.iter().zip(&inventory.tensors) {
                        prop_assert_eq!(&placement.name, &tensor.name);
                    }
                    let streamed: u64 = plan.streamed_tensors().map(|tensor| tensor.bytes).sum();
                    prop_assert_eq!(streamed, plan.streamed_bytes_per_token);
                    let on_gpu: u64 = plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Gpu).map(|tensor| tensor.bytes).sum();
                    prop_assert_eq!(plan.budget.resident_weight_bytes + streamed + on_gpu, inventory.tensor_data_bytes());
                    let gpu_layers = match &plan.gpu {
                        Some(gpu) => {
                            prop_assert!(gpu.total_bytes() <= gpu.budget_bytes, "{:?}", gpu);
                            prop_assert_eq!(gpu.weight_bytes, on_gpu + gpu.tied_output_bytes);
                            // The token embedding stays on the host, where tokens are looked up.
                            prop_assert!(plan.tensors.iter().all(|tensor| tensor.name != "token_embd.weight" || tensor.tier == Tier::Ram));
                            if let Some(layers) = &gpu.whole_layers {
                                // llama.cpp's partial offload: the last layers and the output.
                                prop_assert_eq!(layers.end, n_layer as u32);
                                prop_assert_eq!(plan.n_gpu_layers(), layers.len() as i32 + 1);
                                let device_tensors = plan.tensors.iter().filter(|tensor| tensor.tier == Tier::Gpu);
                                prop_assert!(device_tensors.clone().all(|tensor| tensor.layer.is_none_or(|layer| layers.contains(&layer))));
                                prop_assert!(forced || plan.host_patterns(&[Tier::Ram, Tier::Stream]).is_empty());
                            }
                            gpu.ffn_layers.len()
                        }
                        None => {
                            prop_assert_eq!(on_gpu, 0);
                            prop_assert_eq!(plan.gpu_unused.is_some(), gpu_mib > 0);
                            0
                        }
                    };
                    if let Some(dense) = &plan.dense {
                        prop_assert_eq!(dense.pinned_layers.len() + dense.streamed_layers.len() + gpu_layers, n_layer as usize);
                        prop_assert!(plan.streamed_tensors().all(|tensor| inventory.tensors.iter().any(|entry| entry.name == tensor.name && entry.role.is_dense_ffn())));
                    }
                }
                Err(PlanError::BudgetTooSmall { needed, budget, .. }) => prop_assert!(needed > budget),
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
        }
    }
}
