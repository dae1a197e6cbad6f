//! The GPU tier: which tensors go to device memory (`gpu_tier`, from the model's `DeviceCosts`:
//! whole layers, or an expert pool fitted beside them, `with_expert_pool`), the resulting
//! `GpuLayout`, each tensor's tier under it (`place`), and how llama.cpp is told: `n_gpu_layers`
//! and the override patterns that keep host tensors in host memory.
use serde::Serialize;

use super::pool::{
    splits, ExpertPoolLayout, PoolCosts, PoolRates, POOL_ALIGNMENT, POOL_BUS_BYTES_PER_SEC, POOL_STOP_DEVICE_SECONDS,
    POOL_STOP_HOST_SECONDS,
};
use super::remote::RemoteLayout;
use super::reuse::ReuseDepths;
use super::sizing::{
    context_memory_bytes, device_compute_bytes, is_streamable, on_input_layer, output_is_tied, TOKEN_EMBEDDING,
};
use super::types::{GpuExperts, MachineFacts, Mode, ModeChoice, Plan, PlanOptions, TensorPlacement, Tier};
use crate::format::format_bytes;
use crate::model::{Inventory, TensorEntry};

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
    /// The expert pool: the routed experts of every MoE layer stream from the host cache into
    /// device slots and compute on the device (decision 29). None: whole layers' FFN only.
    pub expert_pool: Option<ExpertPoolLayout>,
    /// What `--gpu-experts auto` weighed, with each option's predicted decode speed; empty where
    /// the choice was asked for or there was none.
    pub experts_options: Vec<GpuExpertsOption>,
}

/// One way the GPU may hold a MoE model's routed experts, as `--gpu-experts auto` predicted it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuExpertsOption {
    /// `--gpu-experts`' name for it: "split", "pool" or "layers".
    pub name: &'static str,
    /// None where the plan could not be predicted.
    pub decode_tokens_per_sec: Option<f64>,
    pub chosen: bool,
}

impl GpuLayout {
    pub fn total_bytes(&self) -> u64 {
        self.weight_bytes
            + self.kv_cache_bytes
            + self.compute_buffer_bytes
            + self.runtime_bytes
            + self.expert_pool.as_ref().map_or(0, ExpertPoolLayout::total_bytes)
    }

    /// Whether every layer's attention, and so every layer's hidden state, is on the device
    /// (not llama.cpp's partial offload of the last layers whole).
    pub fn attends_on_device(&self) -> bool {
        self.whole_layers.is_none()
    }

    pub(super) fn holds(&self, tensor: &TensorEntry) -> bool {
        if is_streamable(tensor) {
            tensor.layer.is_some_and(|layer| self.ffn_layers.contains(&layer))
        } else {
            !on_input_layer(tensor) && self.offloads(tensor.layer)
        }
    }

    /// Whether llama.cpp's `n_gpu_layers` for this layout puts a tensor of `layer` (None: not in
    /// a layer, as the output) on the device, unless an override keeps it on the host.
    pub(super) fn offloads(&self, layer: Option<u32>) -> bool {
        match (&self.whole_layers, layer) {
            (Some(range), Some(layer)) => range.contains(&layer),
            _ => true,
        }
    }
}

/// What the GPU tier is planned from: the budget and the model's device-side costs.
pub(super) struct DeviceCosts<'a> {
    pub(super) budget: u64,
    /// The runtime's own reserve (`MachineFacts::gpu_runtime_bytes`).
    pub(super) runtime: u64,
    pub(super) kv: u64,
    pub(super) compute: u64,
    /// What every token touches, per layer: attention, norms, router, shared experts.
    pub(super) layer_attention: Vec<u64>,
    /// Streamable bytes (FFN or routed experts) per layer.
    pub(super) layer_ffn: &'a [u64],
    /// What every token touches outside the layers: output matrix, final norm.
    pub(super) outside_layers: u64,
    /// The token embedding's copy that a model without an output matrix computes logits with.
    pub(super) tied_output_bytes: u64,
    /// What an expert pool is sized from; None where the model's experts cannot be pooled.
    pub(super) pool: Option<PoolCosts>,
    /// What a pool layout's cost is weighed with (the recorded routing: how few slots serve it,
    /// and so which MoE layers are worth more whole; the stops', the bus's and the CPU's rates).
    pub(super) rates: PoolRates<'a>,
}

/// The GPU tier for `budget` bytes of device memory: Ok(None) without a budget, Err(why) when
/// the budget cannot hold even one whole layer. With `ffn`, whole layers' FFN fill what is left
/// after what every token touches, from the last layer down; where every layer's attention and
/// KV cache do not fit, the last layers go on the device whole instead.
pub(super) fn gpu_tier(
    inventory: &Inventory,
    options: &PlanOptions,
    machine: &MachineFacts,
    layer_ffn: &[u64],
    ffn: bool,
) -> Result<Option<GpuLayout>, String> {
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
    // Only `token_embd.weight` is copied for the logits (not, say, a per-layer embedding).
    let tied_output_bytes = if output_is_tied(inventory) {
        inventory.tensors.iter().filter(|tensor| tensor.name == TOKEN_EMBEDDING).map(|tensor| tensor.bytes).sum()
    } else {
        0
    };
    // A model without a record of its own routing is planned for real models' (never uniform).
    let moe_layers: std::collections::BTreeSet<u32> =
        inventory.expert_tensors().filter_map(|tensor| tensor.layer).collect();
    let real_routing = ReuseDepths::real_routing(moe_layers.len() as u64, inventory.hparams.n_expert);
    let costs = DeviceCosts {
        budget: machine.gpu_budget_bytes,
        runtime: machine.gpu_runtime_bytes,
        kv: context_memory_bytes(inventory, options.n_ctx, options.n_sequences, options.kv),
        compute: device_compute_bytes(inventory, options.n_ctx, options.n_ubatch),
        layer_attention,
        layer_ffn,
        outside_layers,
        tied_output_bytes,
        // Pooled experts stream (expert-stream mode): only where the pool is asked for and no
        // other mode is forced.
        pool: (options.gpu_experts.is_some_and(GpuExperts::pooled)
            && matches!(options.mode, ModeChoice::Auto | ModeChoice::Forced(Mode::ExpertStream)))
        .then(|| PoolCosts::of(inventory, n_layer))
        .flatten(),
        rates: PoolRates {
            reuse: machine.expert_reuse.as_ref().unwrap_or(&real_routing),
            stop_seconds: machine.pool_stop_host_seconds.unwrap_or(POOL_STOP_HOST_SECONDS)
                + machine.pool_stop_device_seconds.unwrap_or(POOL_STOP_DEVICE_SECONDS),
            bus_bytes_per_sec: machine
                .pool_bus_bytes_per_sec
                .filter(|rate| *rate > 0.0)
                .unwrap_or(POOL_BUS_BYTES_PER_SEC),
            split: options.gpu_experts == Some(GpuExperts::Split) && splits(inventory),
            // A split's misses at the rate earlier split runs' CPU took them, else the CPU's.
            cpu_bytes_per_sec: machine
                .pool_split_bytes_per_sec
                .or(machine.cpu_bytes_per_sec)
                .filter(|rate| *rate > 0.0)
                .unwrap_or(super::predict::CPU_BYTES_PER_SEC_UNMEASURED),
        },
    };
    costs.every_layers_attention(ffn).map_or_else(|| costs.whole_last_layers(ffn), |gpu| Ok(Some(gpu)))
}

impl DeviceCosts<'_> {
    /// Every layer's attention, the output and the KV cache, then the layers without routed
    /// experts' FFN from the last layer down, then an expert pool in what is left: a staging
    /// area for one layer's experts whole and as many slots per pooled MoE layer as fit. With a
    /// recorded routing, the MoE layers whose experts whole are worth more than their stop and
    /// the slots they would take go on the device whole, from the last layer down: the count
    /// with the least `PoolRates::pool_decode_cost`. None where the pool would hold fewer slots than the
    /// router picks per token, or every expert.
    pub(super) fn with_expert_pool(&self, every_token: u64, base: u64) -> Option<GpuLayout> {
        let pool = self.pool.as_ref()?;
        let staging = pool.layer_bytes.iter().copied().max()?;
        let mut spare = self.budget.checked_sub(base + self.runtime + staging)?;
        let mut ffn_layers = Vec::new();
        for (layer, &bytes) in self.layer_ffn.iter().enumerate().rev() {
            if pool.expert_bytes[layer] == 0 && bytes > 0 && bytes <= spare {
                spare -= bytes;
                ffn_layers.push(layer as u32);
            }
        }
        // A layer left without its FFN on the device would be copied there for prompt batches.
        let dense_left = (0..self.layer_ffn.len())
            .filter(|&layer| pool.expert_bytes[layer] == 0 && !ffn_layers.contains(&(layer as u32)))
            .map(|layer| self.layer_ffn[layer])
            .max()
            .unwrap_or(0);
        let spare = spare.checked_sub(self.runtime.max(dense_left) - self.runtime)?;
        let moe: Vec<u32> =
            (0..pool.expert_bytes.len() as u32).filter(|&layer| pool.expert_bytes[layer as usize] > 0).collect();
        let candidates = (0..moe.len()).map_while(|whole| {
            let (pooled, whole) = moe.split_at(moe.len() - whole);
            let spare = spare.checked_sub(whole.iter().map(|&layer| self.layer_ffn[layer as usize]).sum())?;
            let per_slot: u64 = pooled.iter().map(|&layer| pool.expert_bytes[layer as usize]).sum();
            let alignment = pooled.iter().map(|&layer| pool.tensors[layer as usize]).sum::<u64>() * POOL_ALIGNMENT;
            // A split pool's zero slot is one more.
            let zero = u64::from(self.rates.split);
            let slots = (spare.checked_sub(alignment)? / per_slot.max(1)).min(pool.n_expert - 1 + zero);
            (slots >= pool.n_expert_used + zero).then(|| ExpertPoolLayout {
                layers: pooled.to_vec(),
                whole_layers: whole.to_vec(),
                slots: slots as u32,
                split: self.rates.split,
                warm_order: Vec::new(),
                slot_bytes: slots * per_slot + alignment,
                staging_bytes: staging,
                decode_overhead_seconds: None,
            })
        });
        let chosen = candidates
            .map(|layout| (self.rates.pool_decode_cost(&layout, pool), layout))
            .min_by(|(one, _), (other, _)| one.total_cmp(other))
            .map(|(cost, layout)| ExpertPoolLayout {
                decode_overhead_seconds: Some(cost),
                warm_order: self.rates.warm_order(&layout.layers, self.layer_ffn.len(), pool.n_expert as usize),
                ..layout
            })?;
        ffn_layers.extend_from_slice(&chosen.whole_layers);
        ffn_layers.sort_unstable();
        Some(self.with_every_layers_attention(
            every_token,
            ffn_layers,
            self.runtime.max(dense_left),
            true,
            Some(chosen),
        ))
    }

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
        if !all_on_device {
            if let Some(gpu) = self.with_expert_pool(every_token, base) {
                return Some(gpu);
            }
        }
        let copy = if all_on_device { 0 } else { self.layer_ffn.iter().copied().max().unwrap_or(0) };
        let (runtime, op_offload) = match () {
            _ if base + self.runtime.max(copy) <= self.budget => (self.runtime.max(copy), true),
            _ if base + self.runtime <= self.budget => (self.runtime, false),
            _ => return None,
        };
        let mut spare = self.budget - base - runtime;
        let mut ffn_layers = Vec::new();
        // Layers without FFN bytes (an MTP layer llama.cpp does not load) hold nothing to place.
        for (layer, &bytes) in self.layer_ffn.iter().enumerate().rev().filter(|&(_, &bytes)| ffn && bytes > 0) {
            if bytes > spare {
                break;
            }
            spare -= bytes;
            ffn_layers.push(layer as u32);
        }
        ffn_layers.reverse();
        Some(self.with_every_layers_attention(every_token, ffn_layers, runtime, op_offload, None))
    }

    /// The layout with every layer's attention on the device, the FFN of `ffn_layers` and the
    /// expert pool, if any.
    pub(super) fn with_every_layers_attention(
        &self,
        every_token: u64,
        ffn_layers: Vec<u32>,
        runtime: u64,
        op_offload: bool,
        expert_pool: Option<ExpertPoolLayout>,
    ) -> GpuLayout {
        let ffn_bytes: u64 = ffn_layers.iter().map(|&layer| self.layer_ffn[layer as usize]).sum();
        GpuLayout {
            budget_bytes: self.budget,
            weight_bytes: every_token + ffn_bytes,
            tied_output_bytes: self.tied_output_bytes,
            kv_cache_bytes: self.kv,
            compute_buffer_bytes: self.compute,
            runtime_bytes: runtime,
            ffn_layers,
            whole_layers: None,
            op_offload,
            expert_pool,
            experts_options: Vec::new(),
        }
    }

    /// llama.cpp's own partial offload, where every layer's attention does not fit: the output
    /// and the last layers whole (attention, KV cache and, with `ffn`, FFN), as many as the
    /// budget holds after the output, the compute buffers and the reserve. Op offload then
    /// copies whole host layers (attention too), so the reserve holds the largest layer.
    fn whole_last_layers(&self, ffn: bool) -> Result<Option<GpuLayout>, String> {
        let n_layer = self.layer_ffn.len();
        let kv_per_layer = self.kv / n_layer as u64;
        let largest_layer =
            (0..n_layer).map(|layer| self.layer_attention[layer] + self.layer_ffn[layer]).max().unwrap_or(0);
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
            expert_pool: None,
            experts_options: Vec::new(),
        }))
    }
}

/// Each tensor's tier: the GPU's where it holds the tensor, a remote device's where the remote
/// tier holds its layer, else what `host` says.
pub(super) fn place(
    inventory: &Inventory,
    gpu: Option<&GpuLayout>,
    remote: Option<&RemoteLayout>,
    host: impl Fn(&TensorEntry) -> (Tier, &'static str),
) -> Vec<TensorPlacement> {
    inventory
        .tensors
        .iter()
        .map(|tensor| {
            let (tier, why) = match (gpu, remote) {
                (Some(gpu), _) if gpu.holds(tensor) => (Tier::Gpu, gpu_reason(gpu, tensor)),
                (_, Some(remote)) if remote.holds(tensor) => {
                    (Tier::Remote, "a layer a remote device holds whole: computed there")
                }
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

impl Plan {
    /// llama.cpp's `n_gpu_layers` for this plan: every layer (and the output) with a GPU tier,
    /// the output and the last layers where the tier (or the remote tier) holds just those,
    /// none without.
    pub fn n_gpu_layers(&self) -> i32 {
        if let Some(remote) = &self.remote {
            return remote.n_gpu_layers();
        }
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
        if self.remote.is_some() {
            // `n_gpu_layers` gives the last device the output layer too: it stays on the host,
            // where the logits are read (a hidden state per token over the link instead of the
            // logits). A model without an output matrix computes its logits with a copy of the
            // token embedding under the same name, placed with the output.
            let tied = !self.tensors.iter().any(|tensor| tensor.name == "output.weight");
            let output_layer = |name: &str| name.starts_with("output.") || name.starts_with("output_norm.");
            return self
                .tensors
                .iter()
                .filter(|tensor| {
                    tiers.contains(&tensor.tier)
                        && tensor.layer.is_none()
                        && (output_layer(&tensor.name) || (tied && tensor.name == TOKEN_EMBEDDING))
                })
                .map(|tensor| exact_name_pattern(&tensor.name))
                .collect();
        }
        let Some(gpu) = &self.gpu else {
            return Vec::new();
        };
        self.tensors
            .iter()
            .filter(|tensor| {
                tiers.contains(&tensor.tier) && tensor.name != TOKEN_EMBEDDING && gpu.offloads(tensor.layer)
            })
            .map(|tensor| exact_name_pattern(&tensor.name))
            .collect()
    }
}

/// llama.cpp's tensor-override patterns are regular expressions: this one matches `name` only.
fn exact_name_pattern(name: &str) -> String {
    format!("^{}$", name.replace('.', "\\."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Role;
    use crate::plan::test_support::*;
    use crate::plan::{compute_buffer_bytes, kv_cache_bytes, plan, Mode, ModeChoice};

    #[test]
    fn the_gpu_takes_what_every_token_touches_then_whole_ffn_layers_from_the_last() {
        // 8 layers of 16 MiB attention and 3 × 32 MiB FFN; the embedding is tied (no output
        // matrix), so the GPU holds a copy of it for the logits.
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let options = auto_window(ModeChoice::Auto);
        let fixed = 8 * (16 << 20)
            + (64 << 20)
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + device_compute_bytes(&inventory, 1024, 256);
        // What every token touches, op offload's copy of one host layer's FFN, 3 FFN layers.
        let plan =
            plan(&inventory, &with_gpu(8 << 30, fixed + (96 << 20) + 3 * (96 << 20) + (50 << 20)), &options).unwrap();
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
        let fixed = 8 * (16 << 20)
            + (64 << 20)
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + device_compute_bytes(&inventory, 1024, 256);
        let all = plan(&inventory, &with_gpu(8 << 30, fixed + 8 * (96 << 20)), &auto_window(ModeChoice::Auto)).unwrap();
        let gpu = all.gpu.as_ref().unwrap();
        assert_eq!(gpu.ffn_layers.len(), 8, "{}", all.render());
        assert_eq!(gpu.runtime_bytes, 0);
        // One byte less: a layer stays on the host, and room for its copy costs another layer.
        let short =
            plan(&inventory, &with_gpu(8 << 30, fixed + 8 * (96 << 20) - 1), &auto_window(ModeChoice::Auto)).unwrap();
        assert_eq!(short.gpu.as_ref().unwrap().ffn_layers, vec![2, 3, 4, 5, 6, 7], "{}", short.render());
        // The runtime's own reserve counts when it is the larger.
        let machine = MachineFacts { gpu_runtime_bytes: 200 << 20, ..with_gpu(8 << 30, fixed + 8 * (96 << 20)) };
        assert_eq!(
            plan(&inventory, &machine, &auto_window(ModeChoice::Auto)).unwrap().gpu.unwrap().runtime_bytes,
            200 << 20
        );
    }

    #[test]
    fn a_gpu_too_small_for_every_layers_attention_takes_the_last_layers_whole() {
        // 8 layers of 64 MiB attention and 3 × 32 MiB FFN, a tied 64 MiB embedding. Every
        // layer's attention (512 MiB) with the output's copy does not fit; the output's copy,
        // two whole layers (160 MiB and 2 MiB of KV cache each) and room to copy a host layer
        // do: llama.cpp's own partial offload.
        let inventory = inventory(8, 64 << 20, 32 << 20, 64 << 20);
        let kv = kv_cache_bytes(&inventory, 1024, Default::default());
        assert_eq!(kv, 16 << 20);
        let compute = device_compute_bytes(&inventory, 1024, 256);
        let budget = compute + (64 << 20) + (160 << 20) + 2 * (162 << 20);
        let plan = plan_for(&inventory, budget);
        let gpu = plan.gpu.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        assert_eq!(gpu.whole_layers, Some(6..8));
        assert_eq!(gpu.ffn_layers, vec![6, 7]);
        assert_eq!(
            (gpu.weight_bytes, gpu.kv_cache_bytes, gpu.tied_output_bytes, gpu.runtime_bytes),
            ((64 << 20) + 2 * (160 << 20), 4 << 20, 64 << 20, 160 << 20)
        );
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
        for (name, role, bytes) in
            [("output_norm.weight", Role::Norm, 1u64 << 20), ("output.weight", Role::Output, 96 << 20)]
        {
            let last = inventory.tensors.last().unwrap();
            let entry = TensorEntry {
                name: name.into(),
                role,
                layer: None,
                bytes,
                file_offset: last.file_offset + last.bytes,
                ..inventory.tensors[0].clone()
            };
            inventory.tensors.push(entry);
        }
        let compute = device_compute_bytes(&inventory, 1024, 256);
        let budget = compute + (97 << 20) + (160 << 20) + 2 * (162 << 20);
        let plan = plan_for(&inventory, budget);
        let gpu = plan.gpu.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        assert_eq!(gpu.whole_layers, Some(6..8));
        assert_eq!((gpu.weight_bytes, gpu.tied_output_bytes), ((97 << 20) + 2 * (160 << 20), 0));
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!(
            (tier("output.weight"), tier("output_norm.weight"), tier("token_embd.weight")),
            (Tier::Gpu, Tier::Gpu, Tier::Ram)
        );
        assert_eq!(plan_for(&inventory, budget - 1).gpu.unwrap().whole_layers, Some(7..8));
    }

    #[test]
    fn every_layers_attention_without_room_for_a_copy_turns_op_offload_off() {
        // Every layer's attention, the tied output's copy and the KV cache fit, but not with
        // the 96 MiB copy of a host layer's FFN as well: that layout without op offload.
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let fixed = 8 * (16 << 20)
            + (64 << 20)
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + device_compute_bytes(&inventory, 1024, 256);
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
    fn a_layer_without_ffn_bytes_is_not_counted_among_the_gpus_ffn_layers() {
        // An MTP layer that llama.cpp does not load is planned without its tensors: its FFN is
        // 0 bytes, and "FFN of N layers" must not count it.
        let mut inventory = inventory(4, 16 << 20, 32 << 20, 64 << 20);
        inventory.tensors.retain(|tensor| !(tensor.layer == Some(3) && tensor.role.is_dense_ffn()));
        let gpu = plan_for(&inventory, 4 << 30).gpu.unwrap();
        assert_eq!(gpu.ffn_layers, vec![0, 1, 2]);
    }

    #[test]
    fn input_tables_stay_on_the_host_as_llama_cpp_keeps_them() {
        let mut inventory = inventory(4, 16 << 20, 32 << 20, 64 << 20);
        let last = inventory.tensors.last().unwrap();
        let entry = TensorEntry {
            name: "position_embd.weight".into(),
            role: Role::Other,
            layer: None,
            bytes: 8 << 20,
            file_offset: last.file_offset + last.bytes,
            ..inventory.tensors[0].clone()
        };
        inventory.tensors.push(entry);
        let plan = plan_for(&inventory, 4 << 30);
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!((tier("position_embd.weight"), tier("blk.0.attn_q.weight")), (Tier::Ram, Tier::Gpu));
        assert_eq!(plan.budget.resident_weight_bytes, (64 << 20) + (8 << 20));
    }

    #[test]
    fn only_the_token_embedding_is_copied_for_tied_logits() {
        // A per-layer embedding (Gemma 3n) is looked up on the host, never used for the logits.
        let mut inventory = inventory(4, 16 << 20, 32 << 20, 64 << 20);
        let last = inventory.tensors.last().unwrap();
        let offset = last.file_offset + last.bytes;
        inventory.tensors.push(TensorEntry {
            name: "per_layer_token_embd.weight".into(),
            role: Role::TokenEmbedding,
            layer: None,
            file_offset: offset,
            ..inventory.tensors[0].clone()
        });
        let plan = plan(&inventory, &with_gpu(8 << 30, 4 << 30), &auto_window(ModeChoice::Auto)).unwrap();
        let gpu = plan.gpu.as_ref().unwrap();
        assert_eq!(gpu.tied_output_bytes, 64 << 20);
        assert_eq!(
            plan.tensors.iter().find(|tensor| tensor.name == "per_layer_token_embd.weight").unwrap().tier,
            Tier::Ram
        );
    }

    #[test]
    fn ffn_layers_the_gpu_holds_leave_the_host_stream_plan() {
        let inventory = inventory(16, 16 << 20, 32 << 20, 64 << 20);
        let gpu_fixed = 16 * (16 << 20)
            + (64 << 20)
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + device_compute_bytes(&inventory, 1024, 256);
        let host_fixed = (64 << 20) + compute_buffer_bytes(&inventory, 1024, 256);
        // The GPU holds 4 FFN layers (and room to copy a fifth); the host the window (2 layers)
        // and 4 pinned.
        let plan = plan(
            &inventory,
            &with_gpu(host_fixed + 6 * (96 << 20), gpu_fixed + 5 * (96 << 20)),
            &options(ModeChoice::Auto, 1),
        )
        .unwrap();
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
        assert!(
            plan.render().contains("gpu          unused: the GPU budget of 64.0 MiB cannot hold"),
            "{}",
            plan.render()
        );
    }

    #[test]
    fn forced_streaming_keeps_the_ffn_off_the_gpu() {
        let inventory = inventory(8, 1 << 20, 4 << 20, 8 << 20);
        let plan =
            plan(&inventory, &with_gpu(8 << 30, 8 << 30), &options(ModeChoice::Forced(Mode::DenseStream), 1)).unwrap();
        assert!(plan.gpu.as_ref().unwrap().ffn_layers.is_empty());
        assert!(plan.streamed_tensors().count() > 0);
        assert_eq!(plan.tensors.iter().find(|tensor| tensor.name == "blk.0.attn_q.weight").unwrap().tier, Tier::Gpu);
    }
}
