//! The expert-stream layout: every routed expert tensor of a layer the GPU does not hold is read
//! by (layer, expert) unit on the router's picks, through an expert cache sized to what the
//! budget leaves after the resident weights, the KV cache and the compute buffers (what a
//! prompt batch may pick in one layer, or smaller prompt batches where the budget holds less);
//! the stale-gate prefetch runs unless turned off.
use serde::Serialize;

use super::dense::choose_window;
use super::gpu::{place, GpuLayout};
use super::sizing::compute_buffer_bytes;
use super::types::{BudgetUse, CachePolicy, MachineFacts, Mode, ModeChoice, Plan, PlanError, PlanOptions, Tier};
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
    /// The largest prompt batch whose picks the cache holds at once (`cache_units` ÷ k), where
    /// the cache is smaller than what a batch of the asked size may pick; None where it is not.
    pub max_ubatch: Option<u32>,
    /// MoE layers whose experts stream (the cache is shared by all of them).
    pub moe_layers: u64,
    /// Bytes of every streamed expert, all layers together (what a prompt batch may sweep).
    pub expert_bytes: u64,
    /// Bytes of the dense FFN layers among them that stream through a window, read every token.
    pub dense_streamed_bytes: u64,
}

/// Expert slices at least this large are backed by huge pages inside (the store advises their
/// 2 MiB-aligned interior; decision 04). Prefetch once ran only for them; since reads land in
/// the pages of evicted units it pays on small slices too (decisions 07 and 25).
pub const HUGE_SLICE_MIN_BYTES: u64 = 4 << 20;

/// Expert-stream: every routed expert tensor of a layer the GPU does not hold streams by
/// expert, dense FFN layers among them through a dense window where the budget needs it; the
/// rest is resident, and what the budget leaves is the expert cache.
pub(super) fn plan_experts(
    inventory: &Inventory,
    machine: &MachineFacts,
    options: &PlanOptions,
    base: Plan,
) -> Result<Plan, PlanError> {
    let hparams = &inventory.hparams;
    let n_expert = hparams.n_expert;
    let on_gpu = |tensor: &TensorEntry| {
        base.gpu.as_ref().is_some_and(|gpu| gpu.holds(tensor))
            || base.remote.as_ref().is_some_and(|remote| remote.holds(tensor))
    };
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
    let min_slice_bytes =
        streamed.iter().filter_map(|tensor| tensor.experts.map(|slices| slices.slice_bytes)).min().unwrap_or(0);
    let moe_layers = unit_bytes_by_layer.iter().filter(|&&bytes| bytes > 0).count() as u64;
    let expert_bytes: u64 = streamed.iter().map(|tensor| tensor.bytes).sum();
    let fixed = base.budget.resident_weight_bytes - expert_bytes;
    let mut dense_bytes_by_layer = vec![0u64; hparams.n_layer as usize];
    for tensor in inventory.tensors.iter().filter(|tensor| tensor.role.is_dense_ffn() && !on_gpu(tensor)) {
        if let Some(layer) = tensor.layer {
            dense_bytes_by_layer[layer as usize] += tensor.bytes;
        }
    }
    let budget = machine.memory_budget_bytes;
    // Every expert a graph's batch picks in a layer must be resident while that layer computes:
    // k per token, at most the layer's every expert. A cache that holds fewer than a full
    // prompt batch may pick takes smaller prompt batches (down to one token, k units).
    let k = hparams.n_expert_used.clamp(1, n_expert);
    let batch_units = |ubatch: u64| if moe_layers == 0 { 0 } else { n_expert.min(k * ubatch.max(1)) as usize };
    let full_units = batch_units(u64::from(options.n_ubatch));
    // Dense FFN layers among the MoE layers (DeepSeek's and GLM's first layers, Llama 4's
    // interleave) stay resident while the budget holds them beside a cache of what a prompt
    // batch picks; otherwise, or where expert-stream was forced, they stream through a dense
    // window in the same plan.
    let dense_layers: Vec<u32> =
        (0..hparams.n_layer as u32).filter(|&layer| dense_bytes_by_layer[layer as usize] > 0).collect();
    let dense_ffn: Vec<u64> = dense_layers.iter().map(|&layer| dense_bytes_by_layer[layer as usize]).collect();
    let forced = options.mode == ModeChoice::Forced(Mode::ExpertStream);
    let tight = fixed + kv + compute + full_units as u64 * unit_bytes > budget;
    let dense = if dense_layers.is_empty() || !(forced || tight) {
        None
    } else {
        let without_dense = fixed - dense_ffn.iter().sum::<u64>() + kv + compute;
        // Room for a full batch's picks first; failing that, for one token's.
        [full_units, batch_units(1)].into_iter().find_map(|units| {
            choose_window(
                &dense_layers,
                &dense_ffn,
                without_dense + units as u64 * unit_bytes,
                budget,
                options,
                machine,
                forced,
                !tight,
            )
            .ok()
        })
    };
    let (dense_streamed, dense_window) =
        dense.as_ref().map_or((0, 0), |dense| (dense.streamed_bytes, dense.window_bytes));
    // From here, `fixed` is what is not the expert cache: resident weights and the dense window.
    let resident = fixed - dense_streamed;
    let fixed = resident + dense_window;
    let total_units = (moe_layers * n_expert) as usize;
    let cache_for = |compute: u64| {
        let affordable = (budget.saturating_sub(fixed + kv + compute) / unit_bytes.max(1)) as usize;
        options.expert_cache_units.map_or(affordable, |units| units.min(affordable)).min(total_units.max(full_units))
    };
    let mut cache_units = cache_for(compute);
    let (max_ubatch, compute) = if cache_units >= full_units {
        (None, compute)
    } else {
        // Smaller prompt batches need smaller compute buffers, which leave the cache more room
        // (so it still holds k units for each token of the batch).
        let decode_units = batch_units(1);
        let ubatch = ((cache_units.max(decode_units) as u64 / k) as u32).clamp(1, options.n_ubatch.max(1));
        let compute = compute_buffer_bytes(inventory, options.n_ctx, ubatch);
        cache_units = cache_for(compute);
        // A cache asked for smaller than one token's picks is the reason, not the budget.
        if let Some(units) = options.expert_cache_units.filter(|&units| units < decode_units) {
            return Err(PlanError::ExpertCacheTooSmall {
                units,
                picks: decode_units,
                smallest_bytes: decode_units as u64 * unit_bytes,
            });
        }
        if cache_units < decode_units {
            let needed = fixed + kv + compute + decode_units as u64 * unit_bytes;
            return Err(PlanError::BudgetTooSmall {
                budget,
                needed,
                resident: fixed,
                window: decode_units as u64 * unit_bytes,
                layers: 1,
                kv,
                compute,
            });
        }
        (Some(ubatch), compute)
    };
    let dense_streamed_layers = dense.as_ref().map_or(&[][..], |dense| &dense.layout.streamed_layers[..]);
    let tensors = place(inventory, base.gpu.as_ref(), base.remote.as_ref(), |tensor| {
        if tensor.experts.is_some() {
            (Tier::Stream, "routed experts: only the router's picks are read, through the expert cache")
        } else if tensor.role.is_dense_ffn() && tensor.layer.is_some_and(|layer| dense_streamed_layers.contains(&layer))
        {
            (Tier::Stream, "FFN of a streamed dense layer: read through the window each token")
        } else if tensor.role.is_dense_ffn() && tensor.layer.is_some() {
            (Tier::Ram, "FFN of a pinned dense layer: the budget holds it")
        } else {
            (Tier::Ram, "touched by every token and small: always resident")
        }
    });
    let worst_case = moe_layers * hparams.n_expert_used.max(1) * unit_bytes + dense_streamed;
    let cache_bytes = cache_units as u64 * unit_bytes;
    Ok(Plan {
        budget: BudgetUse {
            budget_bytes: budget,
            resident_weight_bytes: resident,
            window_bytes: cache_bytes + dense_window,
            kv_cache_bytes: kv,
            compute_buffer_bytes: compute,
            total_bytes: fixed + cache_bytes + kv + compute,
            ..BudgetUse::default()
        },
        tensors,
        dense: dense.map(|dense| dense.layout),
        experts: Some(ExpertLayout {
            n_expert,
            n_expert_used: hparams.n_expert_used,
            unit_bytes,
            cache_units,
            policy: options
                .cache_policy
                .unwrap_or_else(|| CachePolicy::automatic(cache_units, (moe_layers * k) as usize)),
            min_slice_bytes,
            // Auto: on where the streamed layers attend on the CPU, off where every layer's
            // attention is on a GPU. There the prediction reads the layer's hidden state back
            // from the device and applies the next router on the CPU inside the hook, while the
            // device waits: on the H200 that took 0.3–0.4 ms a streamed
            // layer, more than the rare misses it hid (S6a: 40.0 tok/s on, 56.3 off).
            prefetch: options.expert_prefetch.unwrap_or(!base.gpu.as_ref().is_some_and(GpuLayout::attends_on_device)),
            max_ubatch,
            moe_layers,
            expert_bytes,
            dense_streamed_bytes: dense_streamed,
        }),
        streamed_bytes_per_token: worst_case,
        io_bound_tokens_per_sec: machine
            .disk_bytes_per_sec
            .filter(|_| worst_case > 0)
            .map(|bandwidth| bandwidth / worst_case as f64),
        // What streams per token depends on the cache's hit rate, known only once it runs.
        limit_tokens_per_sec: None,
        ..base
    })
}

#[cfg(test)]
mod tests {
    use crate::plan::test_support::*;
    use crate::plan::{
        compute_buffer_bytes, kv_cache_bytes, plan, CachePolicy, MachineFacts, Mode, ModeChoice, PlanError,
        PlanOptions, Tier,
    };

    /// 128 experts of 3 × 1 MiB per layer, 8 picked per token; a budget with room for `units`
    /// units beside the rest, at a prompt batch of 512.
    fn planned(units: u64, cache: Option<usize>) -> Result<crate::plan::Plan, PlanError> {
        planned_with(units, 0, PlanOptions { expert_cache_units: cache, ..PlanOptions::default() })
    }

    /// `planned`'s model and host budget beside a GPU budget of `gpu` bytes, with `options`'
    /// other choices.
    fn planned_with(units: u64, gpu: u64, options: PlanOptions) -> Result<crate::plan::Plan, PlanError> {
        let inventory = moe_inventory(4, 128, 8, 1 << 20);
        let fixed =
            inventory.tensors.iter().filter(|tensor| tensor.experts.is_none()).map(|tensor| tensor.bytes).sum::<u64>();
        let budget = fixed
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + compute_buffer_bytes(&inventory, 1024, 512)
            + units * (3 << 20);
        let options = PlanOptions { mode: ModeChoice::Auto, n_ctx: 1024, n_ubatch: 512, ..options };
        let machine = MachineFacts { memory_budget_bytes: budget, gpu_budget_bytes: gpu, ..MachineFacts::default() };
        plan(&inventory, &machine, &options)
    }

    #[test]
    fn a_cache_of_a_layers_experts_keeps_the_prompt_batch() {
        let plan = planned(200, None).unwrap();
        assert_eq!(plan.mode, Mode::ExpertStream);
        let experts = plan.experts.as_ref().unwrap();
        assert_eq!(experts.cache_units, 200);
        assert_eq!(experts.max_ubatch, None);
        assert!(plan.budget.total_bytes <= plan.budget.budget_bytes);
    }

    #[test]
    fn prefetch_is_off_only_where_every_layer_attends_on_a_gpu_unless_given() {
        // A host that streams experts (room for 200 units), with and without a GPU budget for
        // what every token touches (every layer's attention; no layer's experts: 384 MiB each).
        let prefetch = |gpu: u64, given: Option<bool>| {
            let plan =
                planned_with(200, gpu, PlanOptions { expert_prefetch: given, ..PlanOptions::default() }).unwrap();
            assert_eq!(plan.mode, Mode::ExpertStream);
            assert_eq!(plan.gpu.is_some(), gpu > 0, "{}", plan.render());
            plan.experts.unwrap().prefetch
        };
        assert!(prefetch(0, None));
        assert!(!prefetch(320 << 20, None));
        assert!(prefetch(320 << 20, Some(true)));
        assert!(!prefetch(0, Some(false)));
        // llama.cpp's partial offload (a 64K context's KV cache does not fit 600 MiB beside every
        // layer's attention; the last layer goes whole): the streamed layers attend on the CPU,
        // their hidden state is in host memory, and the prediction stays on.
        let inventory = moe_inventory(4, 128, 8, 64 << 10);
        let options = PlanOptions {
            mode: ModeChoice::Forced(Mode::ExpertStream),
            n_ctx: 65536,
            n_ubatch: 512,
            ..PlanOptions::default()
        };
        let machine =
            MachineFacts { memory_budget_bytes: 1 << 30, gpu_budget_bytes: 600 << 20, ..MachineFacts::default() };
        let partial = plan(&inventory, &machine, &options).unwrap();
        assert_eq!(partial.gpu.as_ref().and_then(|gpu| gpu.whole_layers.clone()), Some(3..4), "{}", partial.render());
        assert!(partial.experts.unwrap().prefetch);
    }

    #[test]
    fn the_cache_policy_follows_the_cache_size_unless_given() {
        // 4 MoE layers × 8 picks: a token touches 32 units.
        let policy = |units: usize, given: Option<CachePolicy>| {
            let options =
                PlanOptions { expert_cache_units: Some(units), cache_policy: given, ..PlanOptions::default() };
            let experts = planned_with(200, 0, options).unwrap().experts.unwrap();
            assert_eq!(experts.cache_units, units);
            experts.policy
        };
        assert_eq!(policy(40, None), CachePolicy::Lru);
        assert_eq!(policy(200, None), CachePolicy::Slru);
        assert_eq!(policy(40, Some(CachePolicy::Slru)), CachePolicy::Slru);
        assert_eq!(CachePolicy::automatic(47, 32), CachePolicy::Lru);
        assert_eq!(CachePolicy::automatic(48, 32), CachePolicy::Slru);
    }

    #[test]
    fn a_cache_smaller_than_a_layers_experts_takes_smaller_prompt_batches() {
        let plan = planned(40, None).unwrap();
        let experts = plan.experts.as_ref().unwrap();
        let ubatch = experts.max_ubatch.expect("a smaller batch");
        // Its picks fit: 8 per token.
        assert!(ubatch >= 5 && experts.cache_units >= 8 * ubatch as usize, "{experts:?}");
        assert!(plan.budget.total_bytes <= plan.budget.budget_bytes, "{:?}", plan.budget);
        assert!(plan.render().contains(&format!("prompt batches of at most {ubatch} tokens")), "{}", plan.render());
        // A cache forced to one token's picks: one token per batch.
        let forced = planned(200, Some(8)).unwrap();
        assert_eq!(
            (forced.experts.as_ref().unwrap().cache_units, forced.experts.as_ref().unwrap().max_ubatch),
            (8, Some(1))
        );
    }

    #[test]
    fn dense_layers_among_moe_layers_stream_in_the_same_plan_only_where_the_budget_needs_it() {
        // Four dense layers of 3 × 64 MiB, then 6 MoE layers of 64 experts of 3 × 1 MiB.
        let layer: u64 = 3 * (64 << 20);
        let inventory = mixed_inventory(4, 10, 64 << 20, 64, 4, 1 << 20);
        let fixed =
            inventory.tensors.iter().filter(|tensor| tensor.experts.is_none()).map(|tensor| tensor.bytes).sum::<u64>();
        let extra = kv_cache_bytes(&inventory, 1024, Default::default()) + compute_buffer_bytes(&inventory, 1024, 512);
        let options = PlanOptions { mode: ModeChoice::Auto, n_ctx: 1024, n_ubatch: 512, ..PlanOptions::default() };
        let plan_at = |budget: u64| {
            plan(&inventory, &MachineFacts { memory_budget_bytes: budget, ..MachineFacts::default() }, &options)
        };
        // Room for the dense layers and a full batch's picks (64 units): they stay resident.
        let roomy = plan_at(fixed + extra + 100 * (3 << 20)).unwrap();
        assert_eq!(roomy.mode, Mode::ExpertStream);
        assert!(roomy.dense.is_none(), "{}", roomy.render());
        // Room for a full batch's picks and two dense layers, not four: the dense layers stream
        // through a window (one ahead and the one computing).
        let tight = plan_at(fixed - 4 * layer + extra + 64 * (3 << 20) + 2 * layer + (8 << 20)).unwrap();
        let dense = tight.dense.as_ref().expect("a dense window");
        assert!(
            dense.streamed_layers.len() >= 3 && dense.streamed_layers.iter().all(|&layer| layer < 4),
            "{}",
            tight.render()
        );
        assert!(tight.budget.total_bytes <= tight.budget.budget_bytes, "{:?}", tight.budget);
        assert!(tight.experts.as_ref().unwrap().cache_units >= 64, "{}", tight.render());
        let streamed_dense: u64 = tight
            .tensors
            .iter()
            .zip(&inventory.tensors)
            .filter(|(placement, tensor)| placement.tier == Tier::Stream && tensor.role.is_dense_ffn())
            .map(|(_, tensor)| tensor.bytes)
            .sum();
        assert_eq!(streamed_dense, dense.streamed_layers.len() as u64 * layer);
        let rendered = tight.render();
        assert!(
            rendered.contains("and the streamed dense layers")
                && rendered.lines().filter(|line| line.starts_with("per token")).count() == 1,
            "{rendered}"
        );
    }

    #[test]
    fn a_budget_below_one_tokens_picks_is_refused() {
        // Room for the compute buffers of a one-token batch and 7 units, one fewer than a
        // token picks.
        let inventory = moe_inventory(4, 128, 8, 1 << 20);
        let fixed =
            inventory.tensors.iter().filter(|tensor| tensor.experts.is_none()).map(|tensor| tensor.bytes).sum::<u64>();
        let budget = fixed
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + compute_buffer_bytes(&inventory, 1024, 1)
            + 7 * (3 << 20);
        let options = PlanOptions { mode: ModeChoice::Auto, n_ctx: 1024, n_ubatch: 512, ..PlanOptions::default() };
        match plan(&inventory, &MachineFacts { memory_budget_bytes: budget, ..MachineFacts::default() }, &options) {
            Err(PlanError::BudgetTooSmall { needed, budget, .. }) => assert!(needed > budget),
            other => panic!("{other:?}"),
        }
    }
}
