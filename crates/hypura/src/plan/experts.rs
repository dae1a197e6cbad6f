//! The expert-stream layout: every routed expert tensor of a layer the GPU does not hold is read
//! by (layer, expert) unit on the router's picks, through an expert cache sized to what the
//! budget leaves after the resident weights, the KV cache and the compute buffers (at least one
//! layer's every expert); whether the stale-gate prefetch runs follows from the slice size.
use serde::Serialize;

use super::gpu::place;
use super::types::{BudgetUse, CachePolicy, MachineFacts, Plan, PlanError, PlanOptions, Tier};
use crate::model::{Inventory, TensorEntry};

/// The expert-stream layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertLayout {
    pub n_expert: u64,
    pub n_expert_used: u64,
    /// Bytes of one (layer, expert) unit: its gate, up and down slices (largest layer).
    pub unit_bytes: u64,
    /// How many units the expert cache holds.
    pub cache_units: usize,
    pub policy: CachePolicy,
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

/// Expert-stream: every routed expert tensor of a layer the GPU does not hold streams by
/// expert; the rest is resident, and what the budget leaves is the expert cache.
pub(super) fn plan_experts(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions, base: Plan) -> Result<Plan, PlanError> {
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
        return Err(PlanError::BudgetTooSmall { budget, needed, resident: fixed, window: minimum_units as u64 * unit_bytes, layers: 1, kv, compute });
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
