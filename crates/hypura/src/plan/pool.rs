//! The device's expert pool as the plan lays it out (decision 29): the layout (`ExpertPoolLayout`),
//! what the model's experts cost a slot (`PoolCosts`), what a layout costs a decoded token by the
//! recorded routing, split or not (`PoolRates`, decision 33), and which experts it starts with.
//! The GPU tier (`gpu.rs`) fits it in the budget beside whole layers.
use serde::Serialize;

use super::reuse::ReuseDepths;
use crate::model::Inventory;

/// The device's expert pool: `slots` experts of each pooled layer in device memory (the most
/// recently routed), the rest in the host's expert cache and on disk, and a staging area that
/// holds one layer's experts whole for prompt batches that pick more experts than a layer has
/// slots.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertPoolLayout {
    /// The layers whose routed experts are pooled: every MoE layer but `whole_layers`.
    pub layers: Vec<u32>,
    /// MoE layers whose experts are all on the device instead (in `GpuLayout::ffn_layers`),
    /// from the last layer down: each saves the pool's stop a token, where the recorded routing
    /// says the slots left to the others serve it as well as more would (`pool_decode_cost`).
    pub whole_layers: Vec<u32>,
    /// Expert slots per pooled layer (a split pool's zero slot among them).
    pub slots: u32,
    /// Split (decision 33): at decode the CPU computes the picks no slot holds, from the host
    /// cache, beside the device; each layer's last slot holds zeros, where their ids point.
    pub split: bool,
    /// The slots' bytes, every pooled layer together.
    pub slot_bytes: u64,
    /// The largest pooled layer's expert tensors, whole.
    pub staging_bytes: u64,
    /// The (layer, expert) units the recorded routing picked most, most first (pooled layers'
    /// units only): each layer's slots start with its first ones, and the host cache's warm fill
    /// reads the rest in this order. Empty without a record of picks. Not printed.
    #[serde(skip)]
    pub warm_order: Vec<(u32, u32)>,
    /// What the pooled layers add to a decoded token beside the model's compute on the device,
    /// by the recorded routing (`pool_decode_cost`): their stops and the misses' transfers.
    /// None without a record.
    pub decode_overhead_seconds: Option<f64>,
}

/// Device memory the pool loses to alignment per pooled tensor: each tensor's slots start at a
/// device-aligned offset (CUDA wants 256 bytes).
pub const POOL_ALIGNMENT: u64 = 256;

/// What one pooled layer's stop costs a decoded token, beyond its compute and its misses'
/// transfers: the graph stops after the router to rewrite its ids, the device drains its queue,
/// the host serves the picks, and the rest of the graph is launched again. Measured on the H200
/// machine (2026-12-04, S6a and S6b): the host's 1.29 ms a token at 40 stops less the 0.43 ms its
/// transfers took, 22 µs a stop (which benchmark runs record for the next plan:
/// `MachineFacts::pool_stop_host_seconds`), and the device's 7.75 ms a token against the model
/// resident there, 5.92 ms, 46 µs a stop (benchmark runs beside a record of the same model
/// resident on the device record it: `MachineFacts::pool_stop_device_seconds`).
pub const POOL_STOP_HOST_SECONDS: f64 = 22e-6;

pub const POOL_STOP_DEVICE_SECONDS: f64 = 46e-6;

/// The rate the pool's transfers ran at there (uploads into slots and copies back to the host
/// cache, from pageable memory): 4.1–5.3 GB/s. Benchmark runs record this machine's
/// (`MachineFacts::pool_bus_bytes_per_sec`).
pub const POOL_BUS_BYTES_PER_SEC: f64 = 5.0e9;

/// The share of a pooled layer's slots whose hits the recorded routing is trusted for. The
/// record is one LRU over every layer's experts, from runs of a few hundred tokens; the pool is
/// an LRU per layer. The cost is lowest just where the slots stop serving every pick, so the
/// choice lands on that knee, where a few slots fewer than the record says cost more misses
/// than the stops they save: a pooled layer's slots count as four fifths of them.
const POOL_SLOTS_TRUSTED: f64 = 0.8;

impl ExpertPoolLayout {
    pub fn total_bytes(&self) -> u64 {
        self.slot_bytes + self.staging_bytes
    }
}

/// An expert pool's costs: per layer, the bytes of one expert's slices (0 for a layer without
/// routed experts) and of its expert tensors whole; and the pooled tensors (for alignment).
pub(super) struct PoolCosts {
    pub(super) expert_bytes: Vec<u64>,
    pub(super) layer_bytes: Vec<u64>,
    pub(super) tensors: Vec<u64>,
    pub(super) n_expert: u64,
    pub(super) n_expert_used: u64,
}

impl PoolCosts {
    /// Where every MoE layer's routed experts can be pooled: a model with routed experts whose
    /// layers have no per-expert biases or scales (those are indexed by the router's ids too,
    /// and stay where llama.cpp put them).
    pub(super) fn of(inventory: &Inventory, n_layer: usize) -> Option<PoolCosts> {
        let hparams = &inventory.hparams;
        if hparams.n_expert < 2 || inventory.tensors.iter().any(|tensor| tensor.role == crate::model::Role::ExpertBias)
        {
            return None;
        }
        let mut costs = PoolCosts {
            expert_bytes: vec![0; n_layer],
            layer_bytes: vec![0; n_layer],
            tensors: vec![0; n_layer],
            n_expert: hparams.n_expert,
            n_expert_used: hparams.n_expert_used.max(1),
        };
        for tensor in inventory.expert_tensors() {
            let (Some(layer), Some(slices)) = (tensor.layer, tensor.experts) else { continue };
            let layer = layer as usize;
            if layer >= n_layer {
                continue;
            }
            if slices.n_expert != hparams.n_expert {
                return None;
            }
            costs.expert_bytes[layer] += slices.slice_bytes;
            costs.layer_bytes[layer] += tensor.bytes.next_multiple_of(POOL_ALIGNMENT);
            costs.tensors[layer] += 1;
        }
        costs.expert_bytes.iter().any(|&bytes| bytes > 0).then_some(costs)
    }
}

/// Whether a pool of this model's routed experts may split: separate gate, up and down experts
/// without biases (what the CPU computes; the graph's node names are checked again at run time).
pub(super) fn splits(inventory: &Inventory) -> bool {
    use crate::model::Role;
    let has = |role: Role| inventory.tensors.iter().any(|tensor| tensor.role == role);
    has(Role::ExpertGate)
        && has(Role::ExpertUp)
        && has(Role::ExpertDown)
        && !has(Role::ExpertGateUp)
        && !has(Role::ExpertBias)
}

/// What a pool layout's cost is weighed with: the model's routing as earlier runs recorded it
/// (else real models'), what a stop costs a token and the rate a miss moves at over the bus (as
/// benchmark runs recorded them here, else the H200 machine's), and for a split pool the rate the
/// CPU takes its misses at (as split runs recorded it, else the CPU's, else
/// `predict::CPU_BYTES_PER_SEC_UNMEASURED`).
pub(super) struct PoolRates<'a> {
    pub(super) reuse: &'a ReuseDepths,
    pub(super) stop_seconds: f64,
    pub(super) bus_bytes_per_sec: f64,
    /// A split pool (`ExpertPoolLayout::split`).
    pub(super) split: bool,
    pub(super) cpu_bytes_per_sec: f64,
}

impl PoolRates<'_> {
    /// `layers`' units by the recorded decode picks, most picked first (`warm_order`).
    pub(super) fn warm_order(&self, layers: &[u32], n_layer: usize, n_expert: usize) -> Vec<(u32, u32)> {
        let picks = &self.reuse.unit_picks;
        if picks.len() != n_layer * n_expert {
            return Vec::new();
        }
        let mut units: Vec<(u32, u32)> = layers
            .iter()
            .flat_map(|&layer| (0..n_expert as u32).map(move |expert| (layer, expert)))
            .filter(|&(layer, expert)| picks[layer as usize * n_expert + expert as usize] > 0)
            .collect();
        units.sort_by_key(|&(layer, expert)| std::cmp::Reverse(picks[layer as usize * n_expert + expert as usize]));
        units
    }

    /// What a pool layout's pooled layers add to a decoded token, by the recorded routing: a
    /// stop each, and each pick the slots miss moved over the bus (uploaded, and a slot's
    /// expert copied back). Misses are counted in the steady state (a first pick of an expert
    /// is a miss for any layout), at the slots trusted (`POOL_SLOTS_TRUSTED`). Whole layers add
    /// neither.
    ///
    /// Split, a miss is computed by the CPU from the host cache instead (at the CPU's rate, not
    /// counted as hidden behind the device's compute), and a layer with misses stops twice.
    pub(super) fn pool_decode_cost(&self, layout: &ExpertPoolLayout, pool: &PoolCosts) -> f64 {
        let layers = layout.layers.len() as u64;
        let usable = layout.slots - u32::from(layout.split);
        let trusted = f64::from(usable) * POOL_SLOTS_TRUSTED;
        let hit = self.reuse.steady_hit_rate(trusted * layers as f64, layers).unwrap_or(0.0);
        let experts: u64 = layout.layers.iter().map(|&layer| pool.expert_bytes[layer as usize]).sum();
        let misses = pool.n_expert_used as f64 * (1.0 - hit);
        if layout.split {
            return 2.0 * layers as f64 * self.stop_seconds + misses * experts as f64 / self.cpu_bytes_per_sec;
        }
        layers as f64 * self.stop_seconds + misses * 2.0 * experts as f64 / self.bus_bytes_per_sec
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::sizing::{device_compute_bytes, is_streamable, kv_cache_bytes, on_input_layer, output_is_tied};
    use crate::plan::test_support::*;
    use crate::plan::{plan, GpuExperts, MachineFacts, Mode, ModeChoice, PlanOptions, Tier};

    /// What a pooled plan of `auto_window`'s context holds on the device besides the pool: what
    /// every token touches (the tied output's 8 MiB copy too), the KV cache and the compute
    /// buffers.
    fn pool_fixed_bytes(inventory: &Inventory) -> u64 {
        let every_token = inventory
            .tensors
            .iter()
            .filter(|tensor| !is_streamable(tensor) && !on_input_layer(tensor))
            .map(|tensor| tensor.bytes)
            .sum::<u64>()
            + if output_is_tied(inventory) { 8 << 20 } else { 0 };
        every_token + kv_cache_bytes(inventory, 1024, Default::default()) + device_compute_bytes(inventory, 1024, 256)
    }

    /// The GPU budget left after what every token touches, the KV cache and the compute
    /// buffers: a staging area for one layer's experts, then as many slots per MoE layer as
    /// fit, every MoE layer's experts streaming (however much of them the host could hold) and
    /// computing on the device. Too small a budget for the router's picks, every expert fitting,
    /// or the pool not asked for: no pool.
    #[test]
    fn the_expert_pool_takes_what_the_gpu_budget_leaves_in_slots_per_moe_layer() {
        let slice = 1 << 20;
        // 8 layers of 64 experts, 3 tensors each: a layer's experts are 192 MiB, an expert
        // across every layer 24 MiB.
        let inventory = moe_inventory(8, 64, 4, slice);
        let options = PlanOptions { gpu_experts: Some(GpuExperts::Pool), ..auto_window(ModeChoice::Auto) };
        let fixed = pool_fixed_bytes(&inventory);
        let staging = 3 * 64 * slice;
        let alignment = 24 * POOL_ALIGNMENT;
        let gpu_budget = fixed + staging + alignment + 10 * 24 * slice + slice;
        // The host could hold the whole model: pooled experts stream anyway.
        let pooled = plan(&inventory, &with_gpu(64 << 30, gpu_budget), &options).unwrap();
        let gpu = pooled.gpu.as_ref().expect("a GPU tier");
        let pool = gpu.expert_pool.as_ref().unwrap_or_else(|| panic!("{}", pooled.render()));
        assert_eq!((pool.slots, pool.layers.len()), (10, 8), "{}", pooled.render());
        assert_eq!(pool.staging_bytes, staging);
        assert_eq!(pool.slot_bytes, 10 * 24 * slice + alignment);
        assert!(gpu.total_bytes() <= gpu_budget);
        assert!(gpu.ffn_layers.is_empty());
        assert_eq!(pooled.mode, Mode::ExpertStream, "{}", pooled.render());
        assert!(pooled
            .tensors
            .iter()
            .filter(|tensor| tensor.name.contains("_exps"))
            .all(|tensor| tensor.tier == Tier::Stream));
        // Fewer slots than the router picks per token: whole layers' FFN instead.
        let small =
            plan(&inventory, &with_gpu(64 << 30, fixed + staging + alignment + 3 * 24 * slice), &options).unwrap();
        assert!(small.gpu.as_ref().unwrap().expert_pool.is_none(), "{}", small.render());
        // Static placement asked for: whole layers, the host's share resident.
        let layers = PlanOptions { gpu_experts: Some(GpuExperts::Layers), ..options.clone() };
        let static_plan = plan(&inventory, &with_gpu(64 << 30, gpu_budget), &layers).unwrap();
        assert!(static_plan.gpu.as_ref().unwrap().expert_pool.is_none(), "{}", static_plan.render());
        assert_eq!(static_plan.mode, Mode::Resident, "{}", static_plan.render());
        // Left to the plan where whole layers would leave experts with the host, resident (the
        // CPU would compute them) or streamed from disk: both are predicted and the faster is
        // taken, both listed with their predictions. A slow CPU makes the pool the faster; a
        // fast one whole layers (the CPU computes the host's experts, nothing crosses the bus).
        let auto = PlanOptions { gpu_experts: None, ..options.clone() };
        let cpu_at = |rate: f64, host: u64| MachineFacts {
            cpu_bytes_per_sec: Some(rate),
            disk_bytes_per_sec: Some(2e9),
            ..with_gpu(host, gpu_budget)
        };
        for (rate, pool_wins) in [(1e8, true), (1e13, false)] {
            let chosen = plan(&inventory, &cpu_at(rate, 64 << 30), &auto).unwrap();
            let gpu = chosen.gpu.as_ref().unwrap();
            let listed: Vec<(&str, bool)> =
                gpu.experts_options.iter().map(|option| (option.name, option.chosen)).collect();
            // The split is weighed too: a slow CPU computes its misses slower than the bus moves
            // them, a fast one's whole layers need no stops.
            assert_eq!(listed, [("split", false), ("pool", pool_wins), ("layers", !pool_wins)], "{}", chosen.render());
            let rates: Vec<f64> =
                gpu.experts_options.iter().map(|option| option.decode_tokens_per_sec.unwrap()).collect();
            assert_eq!(rates[1] > rates[2], pool_wins, "{rates:?}");
            assert!(rates[0] < rates[1].max(rates[2]), "{rates:?}");
            assert_eq!(gpu.expert_pool.is_some(), pool_wins, "{}", chosen.render());
            let asked = PlanOptions {
                gpu_experts: Some(if pool_wins { GpuExperts::Pool } else { GpuExperts::Layers }),
                ..auto.clone()
            };
            let same = plan(&inventory, &cpu_at(rate, 64 << 30), &asked).unwrap();
            assert_eq!(same.gpu.as_ref().unwrap().expert_pool, gpu.expert_pool, "{}", same.render());
            assert!(same.gpu.as_ref().unwrap().experts_options.is_empty(), "asked for: nothing weighed");
            // Beside the pool the host cache's reads add to the token's time (its stop waits for
            // them); beside whole layers they overlap the CPU's compute.
            let prediction = crate::plan::predict(
                &chosen,
                &cpu_at(rate, 64 << 30),
                256,
                crate::plan::predict::touched(&inventory, &chosen),
            );
            let (compute, read) = (prediction.compute_seconds_per_token.unwrap(), prediction.bytes_per_token / 2e9);
            let seconds = if pool_wins { compute + read } else { compute.max(read) };
            assert!((1.0 / prediction.decode_tokens_per_sec.unwrap() - seconds).abs() < 1e-12, "{prediction:?}");
            assert!(!pool_wins || read > 0.0, "the pooled plan reads its misses: {prediction:?}");
        }
        let host = 1 << 30;
        let streaming = plan(&inventory, &cpu_at(1e8, host), &auto).unwrap();
        let layered = plan(
            &inventory,
            &with_gpu(host, gpu_budget),
            &PlanOptions { gpu_experts: Some(GpuExperts::Layers), ..auto.clone() },
        )
        .unwrap();
        assert_eq!(layered.mode, Mode::ExpertStream, "{}", layered.render());
        assert!(streaming.gpu.as_ref().unwrap().expert_pool.is_some(), "{}", streaming.render());
        // A machine never profiled and no model run on it: every option is predicted all the
        // same (its disk and CPU at assumed rates) and the fastest is taken, not one by rule.
        let fresh = MachineFacts { disk_bytes_per_sec: None, ..with_gpu(host, gpu_budget) };
        let chosen = plan(&inventory, &fresh, &auto).unwrap();
        let options = &chosen.gpu.as_ref().unwrap().experts_options;
        let rates: Vec<f64> = options.iter().filter_map(|option| option.decode_tokens_per_sec).collect();
        assert_eq!(rates.len(), 3, "{}", chosen.render());
        let fastest = rates.iter().copied().fold(0.0, f64::max);
        assert!(options.iter().any(|option| option.chosen && option.decode_tokens_per_sec == Some(fastest)));
        let prediction = crate::plan::predict(&chosen, &fresh, 256, crate::plan::predict::touched(&inventory, &chosen));
        assert_eq!(prediction.disk_bytes_per_sec, Some(crate::plan::predict::DISK_BYTES_PER_SEC_UNPROFILED));
        assert!(prediction.render().contains("assumed: no disk profile"), "{}", prediction.render());
        let small_gpu = fixed + staging + alignment + 3 * 24 * slice;
        let too_small = plan(&inventory, &with_gpu(host, small_gpu), &auto).unwrap();
        assert!(too_small.gpu.as_ref().unwrap().expert_pool.is_none(), "{}", too_small.render());
    }

    /// With a recorded routing, MoE layers go on the device whole, from the last layer down,
    /// while the slots left to the others still serve the routing: each saves a stop a token.
    /// Without a record, real models' routing stands in for it.
    #[test]
    fn whole_moe_layers_beside_the_pool_as_far_as_the_recorded_routing_allows() {
        let slice = 1 << 20;
        // 8 layers of 64 experts, 3 tensors each: a layer's experts are 192 MiB, a slot in
        // every layer 24 MiB.
        let inventory = moe_inventory(8, 64, 4, slice);
        let options = PlanOptions { gpu_experts: Some(GpuExperts::Pool), ..auto_window(ModeChoice::Auto) };
        let fixed = pool_fixed_bytes(&inventory);
        // Room for 30 slots a layer, or 3 layers whole and 9 slots in each of the other 5.
        let gpu_budget = fixed + 3 * 64 * slice + 24 * POOL_ALIGNMENT + 30 * 24 * slice;
        let layout_on = |machine: MachineFacts, reuse: Option<ReuseDepths>| {
            let machine = MachineFacts { expert_reuse: reuse, ..machine };
            let planned = plan(&inventory, &machine, &options).unwrap();
            let gpu = planned.gpu.clone().unwrap();
            assert!(gpu.total_bytes() <= gpu_budget, "{}", planned.render());
            let pool = gpu.expert_pool.clone().unwrap_or_else(|| panic!("{}", planned.render()));
            assert_eq!(gpu.ffn_layers, pool.whole_layers, "{}", planned.render());
            for (tensor, placed) in
                inventory.tensors.iter().zip(&planned.tensors).filter(|(tensor, _)| tensor.role.is_expert())
            {
                let whole = pool.whole_layers.contains(&tensor.layer.unwrap());
                assert_eq!(placed.tier, if whole { Tier::Gpu } else { Tier::Stream }, "{}", planned.render());
            }
            (pool, planned.render())
        };
        let layout = |reuse: Option<ReuseDepths>| layout_on(with_gpu(64 << 30, gpu_budget), reuse);
        // No record: planned for real models' routing (`ReuseDepths::real_routing`), with a figure.
        let (pool, render) = layout(None);
        let real = ReuseDepths::real_routing(8, 64);
        let (unrecorded, _) = layout(Some(real));
        assert_eq!(pool, unrecorded, "{render}");
        assert!(pool.decode_overhead_seconds.is_some(), "{render}");
        // Every expert picked again within a slot's reach: 4 slots would do, so 3 layers whole.
        let (bin, layers) = (8, 8);
        let near = ReuseDepths { depths: vec![1000], bin, layers, first: 64, ..Default::default() };
        let (pool, render) = layout(Some(near.clone()));
        assert_eq!(pool.whole_layers, vec![5, 6, 7], "{render}");
        assert_eq!((pool.slots, pool.layers), (9, (0..5).collect::<Vec<_>>()), "{render}");
        assert!(render.contains("3 MoE layers whole on the GPU instead"), "{render}");
        // Its slots serve every pick: the five pooled layers add their stops alone.
        let stop = POOL_STOP_HOST_SECONDS + POOL_STOP_DEVICE_SECONDS;
        assert!((pool.decode_overhead_seconds.unwrap() - 5.0 * stop).abs() < 1e-12, "{render}");
        // The plan's predicted decode: the model resident on the GPU, as a run here measured
        // it, and the pooled layers' stops; a resident record that computed on the host's CPU
        // says nothing of the device alone, and the other records speak instead.
        let predicted = |resident_host_share: f64| {
            let machine = MachineFacts {
                expert_reuse: Some(near.clone()),
                resident_seconds_per_token: Some(0.005),
                resident_host_share: Some(resident_host_share),
                ..with_gpu(64 << 30, gpu_budget)
            };
            let planned = plan(&inventory, &machine, &options).unwrap();
            crate::plan::predict(&planned, &machine, 256, crate::plan::predict::touched(&inventory, &planned))
        };
        let on_device = predicted(0.01);
        assert!((on_device.compute_seconds_per_token.unwrap() - (0.005 + 5.0 * stop)).abs() < 1e-12, "{on_device:?}");
        assert!(on_device.render().contains("on the GPU 5.0 ms (resident runs)"), "{}", on_device.render());
        let mixed = predicted(0.5);
        assert!(!mixed.render().contains("(resident runs)"), "{}", mixed.render());
        assert_ne!(mixed.compute_seconds_per_token, on_device.compute_seconds_per_token);
        // Picks come back 16 to 17 slots apart (per layer): one layer whole leaves 25 slots,
        // trusted for 20, that serve them; two would leave 18, trusted for 14, that miss them.
        let mut depths = vec![0; 17];
        depths[16] = 1000;
        let far = ReuseDepths { depths, bin, layers, first: 64, ..Default::default() };
        let (pool, render) = layout(Some(far.clone()));
        assert_eq!((pool.whole_layers, pool.slots), (vec![7], 25), "{render}");
        // Where benchmark runs recorded costly stops and a fast bus, misses cost less than
        // stops: as many layers whole as leave the router's picks their slots.
        let recorded = MachineFacts {
            pool_stop_host_seconds: Some(0.01),
            pool_bus_bytes_per_sec: Some(1e15),
            ..with_gpu(64 << 30, gpu_budget)
        };
        let (pool, render) = layout_on(recorded, Some(far.clone()));
        assert_eq!((pool.whole_layers, pool.slots), (vec![5, 6, 7], 9), "{render}");
        // The same where the device's side of a stop was recorded costly.
        let recorded = MachineFacts {
            pool_stop_device_seconds: Some(0.01),
            pool_bus_bytes_per_sec: Some(1e15),
            ..with_gpu(64 << 30, gpu_budget)
        };
        let (pool, render) = layout_on(recorded, Some(far));
        assert_eq!((pool.whole_layers, pool.slots), (vec![5, 6, 7], 9), "{render}");
    }
}
