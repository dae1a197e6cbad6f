//! The dense-stream layout: the FFN layers the GPU does not hold are pinned in RAM while the
//! budget lasts and the rest stream through a window of `D` layers read ahead. A cost model
//! chooses `D`: for each window it pins what the budget leaves and predicts a token's time as
//! max(compute, streamed bytes ÷ the disk's rate with that window's reads in flight).
use serde::Serialize;

use super::gpu::place;
use super::sizing::is_streamable;
use super::types::{BudgetUse, MachineFacts, Mode, ModeChoice, Plan, PlanError, PlanOptions, Tier};
use crate::model::Inventory;

// A test calls the planner as `super::plan`, where a local named `plan` shadows it.
#[cfg(test)]
use super::plan;

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

/// The store's read chunk (its reader threads each have one such read in flight). The planner
/// keeps its own copy so it depends on no store code; the store's `CHUNK_BYTES` must equal it.
pub const READ_CHUNK_BYTES: u64 = 4 << 20;

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

/// Dense-stream over the layers whose FFN the GPU does not hold: `all_layer_ffn` is every
/// layer's streamable bytes, `base` the plan so far (mode, host budget use, GPU tier).
pub(super) fn plan_dense(
    inventory: &Inventory,
    machine: &MachineFacts,
    options: &PlanOptions,
    all_layer_ffn: &[u64],
    base: Plan,
) -> Result<Plan, PlanError> {
    let gpu = &base.gpu;
    let BudgetUse {
        budget_bytes: budget,
        resident_weight_bytes: weights,
        kv_cache_bytes: kv,
        compute_buffer_bytes: compute,
        total_bytes: everything,
        ..
    } = base.budget;
    let remote = &base.remote;
    let host_layers: Vec<u32> = (0..all_layer_ffn.len() as u32)
        .filter(|layer| {
            !gpu.as_ref().is_some_and(|gpu| gpu.ffn_layers.contains(layer))
                && !remote.as_ref().is_some_and(|remote| remote.layers.contains(layer))
        })
        .collect();
    let layer_ffn: Vec<u64> = host_layers.iter().map(|&layer| all_layer_ffn[layer as usize]).collect();
    if layer_ffn.iter().all(|&bytes| bytes == 0) {
        if all_layer_ffn.iter().any(|&bytes| bytes > 0) {
            // The GPU holds every FFN layer: nothing is left to stream, and the host cannot
            // hold the rest.
            return Err(PlanError::BudgetTooSmall {
                budget,
                needed: everything,
                resident: weights,
                window: 0,
                layers: 0,
                kv,
                compute,
            });
        }
        return Err(PlanError::ModeUnavailable { mode: "dense-stream", what: "FFN tensors in layers" });
    }
    let fixed_weights = weights - layer_ffn.iter().sum::<u64>();
    let forced = options.mode == ModeChoice::Forced(Mode::DenseStream);
    let DenseChoice { layout, streamed_bytes: streamed_bytes_per_token, window_bytes } = choose_window(
        &host_layers,
        &layer_ffn,
        fixed_weights + kv + compute,
        budget,
        options,
        machine,
        forced,
        everything <= budget,
    )
    .map_err(|(window, window_bytes)| PlanError::BudgetTooSmall {
        budget,
        needed: fixed_weights + window_bytes + kv + compute,
        resident: fixed_weights,
        window: window_bytes,
        layers: window,
        kv,
        compute,
    })?;
    let tensors = place(inventory, gpu.as_ref(), remote.as_ref(), |tensor| {
        let streamed = is_streamable(tensor)
            && layout.streamed_layers.contains(&tensor.layer.expect("streamable tensors have a layer"));
        match (streamed, is_streamable(tensor)) {
            (true, _) => (Tier::Stream, "FFN of a streamed layer: read through the window each token"),
            (false, true) => (Tier::Ram, "FFN of a pinned layer: the budget holds it"),
            (false, false) => (Tier::Ram, "touched by every token and small: always resident"),
        }
    });
    let resident_weight_bytes = weights - streamed_bytes_per_token;
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
            ..BudgetUse::default()
        },
        tensors,
        dense: Some(layout),
        streamed_bytes_per_token,
        io_bound_tokens_per_sec,
        limit_tokens_per_sec: physical_limit(machine, streamed_bytes_per_token),
        ..base
    })
}

/// A chosen dense window: the layout, the bytes streamed per token and the window's bytes.
pub(super) struct DenseChoice {
    pub layout: DenseLayout,
    pub streamed_bytes: u64,
    pub window_bytes: u64,
}

/// The window over `layers` (whose FFN bytes are `layer_ffn`, in the same order) that the cost
/// model predicts fastest, pinning what the budget leaves after `fixed` bytes. Err: the first
/// window weighed and its bytes, which the budget cannot hold.
#[allow(clippy::too_many_arguments)]
pub(super) fn choose_window(
    layers: &[u32],
    layer_ffn: &[u64],
    fixed: u64,
    budget: u64,
    options: &PlanOptions,
    machine: &MachineFacts,
    forced: bool,
    fits: bool,
) -> Result<DenseChoice, (usize, u64)> {
    let n_layer = layer_ffn.len();
    let candidates: Vec<usize> = match options.window_layers {
        Some(layers) => vec![layers.clamp(1, n_layer)],
        None => (1..=MAX_WINDOW_LAYERS.min(n_layer)).collect(),
    };
    let costed: Vec<DenseCandidate> = candidates
        .iter()
        .filter_map(|&window| dense_candidate(layer_ffn, fixed, budget, window, forced, fits, machine))
        .collect();
    // The least predicted time per token; a larger window must win by more than 2% to be
    // worth the layer it takes from the pinned set.
    let Some(chosen) = costed.iter().fold(None::<&DenseCandidate>, |best, candidate| match best {
        Some(best) if candidate.seconds_per_token >= best.seconds_per_token * 0.98 => Some(best),
        _ => Some(candidate),
    }) else {
        let window = candidates[0];
        let largest = layer_ffn.iter().copied().max().unwrap_or(0);
        return Err((window, largest * (window as u64 + 1).min(n_layer as u64)));
    };
    // The candidate numbers the given layers; name them by layer.
    let streamed_layers: Vec<u32> = chosen.streamed_layers.iter().map(|&index| layers[index as usize]).collect();
    let pinned_layers: Vec<u32> = layers.iter().copied().filter(|layer| !streamed_layers.contains(layer)).collect();
    let layout = DenseLayout {
        streamed_layers,
        pinned_layers,
        window_layers: chosen.window,
        window_sized: options.window_layers.is_none(),
        windows_costed: costed.iter().map(|candidate| (candidate.window, candidate.seconds_per_token)).collect(),
    };
    Ok(DenseChoice { layout, streamed_bytes: chosen.streamed_bytes, window_bytes: chosen.window_bytes })
}

fn dense_candidate(
    layer_ffn: &[u64],
    fixed: u64,
    budget: u64,
    window: usize,
    forced: bool,
    fits: bool,
    machine: &MachineFacts,
) -> Option<DenseCandidate> {
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
    let streamed_layers: Vec<u32> =
        (0..n_layer as u32).filter(|layer| streamed_set.contains(&(*layer as usize))).collect();
    let streamed_bytes: u64 = streamed_layers.iter().map(|&layer| layer_ffn[layer as usize]).sum();
    let window_bytes =
        if streamed_layers.is_empty() { 0 } else { largest * (window as u64 + 1).min(streamed_layers.len() as u64) };
    // What can be in flight: the window's layers, as far as the store's reader threads take
    // them (`queue_depth` chunks at once). The disk's rate at that depth is the profile's.
    let mean_layer = streamed_bytes / streamed_layers.len().max(1) as u64;
    let reader_limit = u64::from(machine.read_queue_depth.unwrap_or(4).max(1)) * READ_CHUNK_BYTES;
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
    let reachable = machine
        .disk_read_points
        .iter()
        .filter(|(needed, _)| *needed <= in_flight)
        .map(|(_, rate)| *rate)
        .fold(0.0, f64::max);
    if reachable > 0.0 {
        return reachable;
    }
    let (needed, rate) = machine.disk_read_points.iter().copied().min_by_key(|(needed, _)| *needed).expect("not empty");
    (rate * in_flight as f64 / needed.max(1) as f64).max(f64::MIN_POSITIVE)
}

/// ARCHITECTURE.md, "The physical limit": `1 / max(t_compute, bytes streamed per token / disk bandwidth)`, when
/// both terms are known.
fn physical_limit(machine: &MachineFacts, streamed_bytes_per_token: u64) -> Option<f64> {
    let compute = machine.compute_seconds_per_token?;
    match machine.disk_bytes_per_sec {
        Some(bandwidth) => limit_tokens_per_sec(compute, streamed_bytes_per_token as f64, bandwidth, 1.0),
        None if streamed_bytes_per_token == 0 => limit_tokens_per_sec(compute, 0.0, 1.0, 1.0),
        None => None,
    }
}

/// The physical limit (ARCHITECTURE.md, "The physical limit"): a pass over the weights takes the longer of its
/// compute and the reading of its streamed bytes at the disk's rate, and yields
/// `tokens_per_pass` tokens (more than one with speculative decoding). None if a pass would
/// take no time.
pub fn limit_tokens_per_sec(
    compute_seconds_per_pass: f64,
    bytes_per_pass: f64,
    disk_bytes_per_sec: f64,
    tokens_per_pass: f64,
) -> Option<f64> {
    let seconds = compute_seconds_per_pass.max(bytes_per_pass / disk_bytes_per_sec);
    (seconds > 0.0 && seconds.is_finite()).then(|| tokens_per_pass / seconds)
}

/// `count` of `total` indices spread evenly (so streaming I/O overlaps pinned layers' compute).
fn spread(count: usize, total: usize) -> Vec<usize> {
    (0..count).map(|index| (index * total + total / 2) / count.max(1)).map(|index| index.min(total - 1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::*;
    use crate::plan::{compute_buffer_bytes, kv_cache_bytes, plan};

    #[test]
    fn the_io_bound_follows_from_streamed_bytes() {
        let inventory = inventory(10, 16 << 20, 32 << 20, 64 << 20);
        let fixed = (64 << 20)
            + 10 * (16 << 20)
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + compute_buffer_bytes(&inventory, 1024, 256);
        // Room for the window (3 layers of 96 MiB) and 2 pinned layers.
        let budget = fixed + 5 * (96 << 20);
        let plan = plan(
            &inventory,
            &MachineFacts { memory_budget_bytes: budget, disk_bytes_per_sec: Some(2e9), ..MachineFacts::default() },
            &options(ModeChoice::Auto, 2),
        )
        .unwrap();
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
            let plan = plan(
                &inventory,
                &MachineFacts { memory_budget_bytes: 8 << 30, ..MachineFacts::default() },
                &options(ModeChoice::Forced(Mode::DenseStream), window),
            )
            .unwrap();
            let dense = plan.dense.as_ref().unwrap();
            // The window holds `window + 1` layers; one more must stream, or nothing is read
            // after the first token.
            assert_eq!(dense.streamed_layers.len(), window + 2, "{}", plan.render());
        }
    }

    /// A 2 GB/s disk with a queue-hungry profile and a budget with room for everything but
    /// the FFN layers, plus `layers` FFN layers of `ffn` × 3 bytes.
    fn machine_with_room(
        inventory: &Inventory,
        ffn: u64,
        layers: u64,
        compute_seconds_per_token: Option<f64>,
    ) -> MachineFacts {
        let fixed = inventory.tensor_data_bytes()
            - inventory
                .tensors
                .iter()
                .filter(|tensor| tensor.role.is_dense_ffn())
                .map(|tensor| tensor.bytes)
                .sum::<u64>();
        MachineFacts {
            memory_budget_bytes: fixed
                + kv_cache_bytes(inventory, 1024, Default::default())
                + compute_buffer_bytes(inventory, 1024, 256)
                + layers * 3 * ffn,
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
}
