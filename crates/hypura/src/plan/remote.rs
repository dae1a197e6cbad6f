//! The remote tier: whole layers (attention, FFN and their KV cache) on other machines' devices
//! through ggml's RPC backend, as llama.cpp's layer split places them: the last layers, in
//! device order, each device a contiguous range. The host plans the layers before them as
//! before (resident, dense-stream or expert-stream), and keeps the output.
//!
//! A token crosses each device boundary once with its hidden state, so the link costs
//! `round trips × round trip + activation bytes ÷ link rate` per token: one round trip per
//! device (the host fetches each device's output; ggml copies between two workers through the
//! host), and bytes for the hidden state in and out of each device plus its inputs. The planner
//! takes the remote tier only where its predicted time per token beats streaming locally alone
//! (`plan::weigh`: at one prompt batch in `plan`, each at its own in `plan::choose`), and says
//! both.
use std::ops::Range;

use serde::Serialize;

use super::types::{MachineFacts, PlanOptions};
use crate::format::format_bytes;
use crate::model::{Inventory, TensorEntry};

/// Kept free on every remote device beyond its layers, KV cache and compute buffer: the worker's
/// own use of its memory (ggml's graph allocator, the socket's buffers).
pub const REMOTE_RESERVE_BYTES: u64 = 64 << 20;

/// A remote device as the planner sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RemoteDeviceFacts {
    /// ggml's name for it (`RPC0`).
    pub name: String,
    /// The worker's `host:port`.
    pub worker: String,
    /// Free memory as the worker reports it.
    pub free_bytes: u64,
    /// The link to its worker: one request's round trip, and bytes per second.
    pub round_trip_secs: f64,
    pub link_bytes_per_sec: Option<f64>,
}

/// One device's share of the remote tier.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RemoteShare {
    pub name: String,
    pub worker: String,
    pub layers: Range<u32>,
    pub weight_bytes: u64,
    pub kv_cache_bytes: u64,
    pub compute_buffer_bytes: u64,
    pub free_bytes: u64,
}

impl RemoteShare {
    pub fn total_bytes(&self) -> u64 {
        self.weight_bytes + self.kv_cache_bytes + self.compute_buffer_bytes + REMOTE_RESERVE_BYTES
    }
}

/// The remote tier of a plan: the last layers, split over the devices in llama.cpp's order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RemoteLayout {
    /// Devices with at least one layer, in the order llama.cpp gets them.
    pub shares: Vec<RemoteShare>,
    /// Every remote layer: the last ones.
    pub layers: Range<u32>,
    /// Bytes that cross the links per token: the hidden state (a row of f32) at each hop and
    /// each device's inputs (positions, a row of the attention mask).
    pub activation_bytes_per_token: u64,
    /// The links' predicted cost per generated token.
    pub link_seconds_per_token: f64,
    /// Context memory (KV cache, recurrent state) the host no longer holds.
    pub host_context_bytes_moved: u64,
    /// Predicted seconds per token with this tier, and streaming locally alone (the planner's
    /// comparison; relative where the disk's rate or the compute time is unknown).
    pub predicted_seconds_per_token: f64,
    pub local_seconds_per_token: f64,
}

impl RemoteLayout {
    pub(super) fn holds(&self, tensor: &TensorEntry) -> bool {
        tensor.layer.is_some_and(|layer| self.layers.contains(&layer))
    }

    /// llama.cpp's `n_gpu_layers` for this tier: its layers and the output, which an override
    /// then keeps on the host (`Plan::host_patterns`).
    pub fn n_gpu_layers(&self) -> i32 {
        self.layers.len() as i32 + 1
    }

    /// llama.cpp's tensor split over the devices: each device's layer count, the last one's
    /// with the output's slot (llama.cpp counts it as one more layer, on the last device), so
    /// that its split points fall exactly between the shares.
    pub fn tensor_split(&self) -> Vec<f32> {
        let last = self.shares.len().saturating_sub(1);
        self.shares
            .iter()
            .enumerate()
            .map(|(index, share)| share.layers.len() as f32 + if index == last { 1.0 } else { 0.0 })
            .collect()
    }

    pub fn describe(&self) -> String {
        let shares: Vec<String> = self
            .shares
            .iter()
            .map(|share| {
                format!(
                    "layers {}-{} on {} ({}): {} weights + {} KV cache + {} compute of {} free",
                    share.layers.start,
                    share.layers.end - 1,
                    share.name,
                    share.worker,
                    format_bytes(share.weight_bytes),
                    format_bytes(share.kv_cache_bytes),
                    format_bytes(share.compute_buffer_bytes),
                    format_bytes(share.free_bytes)
                )
            })
            .collect();
        shares.join("; ")
    }
}

/// What each layer costs a remote device: its weights (attention, FFN) and its KV cache.
fn layer_bytes(inventory: &Inventory, options: &PlanOptions) -> Vec<(u64, u64)> {
    let n_layer = inventory.hparams.n_layer as usize;
    let mut weights = vec![0u64; n_layer];
    for tensor in &inventory.tensors {
        if let Some(layer) = tensor.layer.filter(|&layer| (layer as usize) < n_layer) {
            weights[layer as usize] += tensor.bytes;
        }
    }
    // Which layers attend is not in the inventory (hybrid models keep a KV cache in some layers
    // and a recurrent state in the others): each remote layer is planned as the larger of an
    // attending layer's KV cache and a recurrent layer's state, so no device is under-planned.
    let hparams = &inventory.hparams;
    let sequences = u64::from(options.n_sequences.max(1));
    let attending = super::kv_cache_bytes(inventory, options.n_ctx, options.kv) / hparams.n_layer_kv.max(1);
    let recurrent_layers = hparams.n_layer.saturating_sub(hparams.n_layer_kv);
    let recurrent = (hparams.recurrent_state_bytes * sequences).checked_div(recurrent_layers).unwrap_or(0);
    weights.into_iter().map(|bytes| (bytes, attending.max(recurrent))).collect()
}

/// The host's context memory that a remote tier of `layers` takes away: exact where every layer
/// attends alike, none where the model mixes layer kinds (which of them attend is not known
/// here, so the host keeps room for all of it).
fn context_bytes_moved(inventory: &Inventory, options: &PlanOptions, layers: u64) -> u64 {
    let hparams = &inventory.hparams;
    if hparams.n_layer_kv != hparams.n_layer || hparams.recurrent_state_bytes > 0 {
        return 0;
    }
    super::context_memory_bytes(inventory, options.n_ctx, options.n_sequences, options.kv) / hparams.n_layer.max(1)
        * layers
}

/// The compute buffer of a device that runs layers only (no logits): activations of a prompt
/// batch through one layer, as `compute_buffer_bytes` counts them without the vocabulary.
fn layer_compute_bytes(inventory: &Inventory, n_ubatch: u32) -> u64 {
    let hparams = &inventory.hparams;
    let ff = hparams.n_ff.max(hparams.n_ff_expert * hparams.n_expert_used.max(1));
    4 * u64::from(n_ubatch) * (4 * hparams.n_embd + 4 * ff) + (32 << 20)
}

/// The largest remote tier the devices hold: layers from the last one down, the last device
/// taking the last layers. None without devices or where no device holds one layer.
pub(super) fn remote_tier(
    inventory: &Inventory,
    options: &PlanOptions,
    machine: &MachineFacts,
) -> Option<RemoteLayout> {
    if machine.remote_devices.is_empty() || inventory.hparams.n_layer == 0 {
        return None;
    }
    let layers = layer_bytes(inventory, options);
    let compute = layer_compute_bytes(inventory, options.n_ubatch);
    let mut next = layers.len();
    let mut shares = Vec::new();
    for device in machine.remote_devices.iter().rev() {
        let mut spare = device.free_bytes.saturating_sub(compute + REMOTE_RESERVE_BYTES);
        let end = next;
        let (mut weight_bytes, mut kv_cache_bytes) = (0, 0);
        // Keep the first layer on the host: it holds the token embedding's lookup anyway, and a
        // plan with no host layer would leave nothing to compare against.
        while next > 1 && layers[next - 1].0 + layers[next - 1].1 <= spare {
            spare -= layers[next - 1].0 + layers[next - 1].1;
            weight_bytes += layers[next - 1].0;
            kv_cache_bytes += layers[next - 1].1;
            next -= 1;
        }
        if next < end {
            shares.push(RemoteShare {
                name: device.name.clone(),
                worker: device.worker.clone(),
                layers: next as u32..end as u32,
                weight_bytes,
                kv_cache_bytes,
                compute_buffer_bytes: compute,
                free_bytes: device.free_bytes,
            });
        }
    }
    if shares.is_empty() {
        return None;
    }
    shares.reverse();
    // A token's hidden state goes to the first device, from each device to the next and back
    // to the host; the host fetches each device's output (one round trip each: ggml copies
    // between two workers through the host) and sends each device its inputs (positions and a
    // row of the attention mask over the context) without waiting.
    let hops = shares.len() as u64 + 1;
    let row_bytes = 4 * inventory.hparams.n_embd;
    let activation_bytes_per_token = hops * row_bytes + shares.len() as u64 * 4 * u64::from(options.n_ctx);
    let device_of = |share: &RemoteShare| {
        machine.remote_devices.iter().find(|device| device.name == share.name).expect("a share's device")
    };
    let link_seconds_per_token = shares
        .iter()
        .map(|share| {
            let device = device_of(share);
            let bytes = 2 * row_bytes + 4 * u64::from(options.n_ctx);
            device.round_trip_secs + device.link_bytes_per_sec.map_or(0.0, |rate| bytes as f64 / rate)
        })
        .sum::<f64>();
    let remote_layers = layers.len() as u64 - u64::from(shares[0].layers.start);
    Some(RemoteLayout {
        host_context_bytes_moved: context_bytes_moved(inventory, options, remote_layers),
        layers: shares[0].layers.start..layers.len() as u32,
        shares,
        activation_bytes_per_token,
        link_seconds_per_token,
        predicted_seconds_per_token: 0.0,
        local_seconds_per_token: 0.0,
    })
}

/// The predicted seconds per token of a host plan: the longer of its compute (where measured,
/// in proportion to the layers it computes) and its streamed bytes at the disk's rate.
pub(super) fn host_seconds_per_token(
    machine: &MachineFacts,
    streamed_bytes_per_token: u64,
    host_layer_share: f64,
) -> f64 {
    // An unknown disk rate gives relative units, in which any stream costs more than none.
    let rate = machine.disk_bytes_per_sec.filter(|rate| *rate > 0.0).unwrap_or(1e9);
    let compute = machine.compute_seconds_per_token.unwrap_or(0.0) * host_layer_share;
    super::limit_tokens_per_sec(compute, streamed_bytes_per_token as f64, rate, 1.0)
        .map_or(0.0, |tokens_per_sec| 1.0 / tokens_per_sec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::*;
    use crate::plan::{plan, Mode, ModeChoice, Plan, Tier};

    fn device(name: &str, free_bytes: u64, round_trip_secs: f64) -> RemoteDeviceFacts {
        RemoteDeviceFacts {
            name: name.into(),
            worker: format!("10.0.0.{}:50052", name.trim_start_matches("RPC")),
            free_bytes,
            round_trip_secs,
            link_bytes_per_sec: Some(1e9),
        }
    }

    /// 16 layers of 16 MiB attention and 3 × 32 MiB FFN (112 MiB a layer), a 64 MiB embedding.
    fn machine(host: u64, devices: Vec<RemoteDeviceFacts>) -> MachineFacts {
        MachineFacts {
            memory_budget_bytes: host,
            disk_bytes_per_sec: Some(2e9),
            remote_devices: devices,
            ..MachineFacts::default()
        }
    }

    fn remote_plan(host: u64, devices: Vec<RemoteDeviceFacts>) -> Plan {
        plan(&inventory(16, 16 << 20, 32 << 20, 64 << 20), &machine(host, devices), &auto_window(ModeChoice::Auto))
            .unwrap()
    }

    /// Room on each device for `layers` layers with their KV cache, compute buffer and reserve.
    fn room_for(layers: u64) -> u64 {
        let inventory = inventory(16, 16 << 20, 32 << 20, 64 << 20);
        let kv = crate::plan::context_memory_bytes(&inventory, 1024, 1, Default::default()) / 16;
        layers * ((112 << 20) + kv) + layer_compute_bytes(&inventory, 256) + REMOTE_RESERVE_BYTES
    }

    #[test]
    fn devices_take_the_last_layers_in_order_and_the_split_counts_the_output_last() {
        let plan = remote_plan(1536 << 20, vec![device("RPC0", room_for(3), 2e-4), device("RPC1", room_for(5), 2e-4)]);
        let remote = plan.remote.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        assert_eq!(remote.layers, 8..16);
        let ranges: Vec<_> = remote.shares.iter().map(|share| share.layers.clone()).collect();
        assert_eq!(ranges, vec![8..11, 11..16]);
        assert_eq!(remote.n_gpu_layers(), 9, "the layers and llama.cpp's output slot");
        assert_eq!(remote.tensor_split(), vec![3.0, 6.0]);
        // llama.cpp's split points: layer i of the 9 slots goes to the first device whose
        // cumulative share exceeds i / 9.
        let split = remote.tensor_split();
        let cumulative = [split[0] / 9.0, 1.0];
        let device_of = |slot: usize| cumulative.iter().position(|&point| slot as f32 / 9.0 < point).unwrap();
        assert_eq!((0..8).map(device_of).collect::<Vec<_>>(), vec![0, 0, 0, 1, 1, 1, 1, 1]);
        for share in &remote.shares {
            assert!(share.total_bytes() <= share.free_bytes, "{share:?}");
        }
        // Their tensors are on the remote tier, the host keeps the rest and the output.
        let tier = |name: &str| plan.tensors.iter().find(|tensor| tensor.name == name).unwrap().tier;
        assert_eq!(
            (tier("blk.7.ffn_up.weight"), tier("blk.8.attn_q.weight"), tier("blk.15.ffn_down.weight")),
            (Tier::Ram, Tier::Remote, Tier::Remote)
        );
        assert_eq!(plan.mode, Mode::Resident, "the host holds its 8 layers: {}", plan.render());
        assert_eq!(plan.budget.resident_weight_bytes, (64 << 20) + 8 * (112 << 20));
        assert_eq!(plan.n_gpu_layers(), 9);
        assert!(plan.render().contains("remote       layers 8-15 whole on other machines"), "{}", plan.render());
    }

    #[test]
    fn the_host_streams_what_neither_it_nor_the_devices_hold() {
        // The devices hold 4 layers; the host's budget holds far fewer than the other 12.
        let plan = remote_plan(700 << 20, vec![device("RPC0", room_for(4), 2e-4)]);
        let remote = plan.remote.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        assert_eq!(remote.layers, 12..16);
        assert_eq!(plan.mode, Mode::DenseStream);
        let dense = plan.dense.as_ref().unwrap();
        assert!(dense.streamed_layers.iter().chain(&dense.pinned_layers).all(|&layer| layer < 12), "{dense:?}");
        assert_eq!(dense.streamed_layers.len() + dense.pinned_layers.len(), 12);
        assert!(plan.budget.total_bytes <= plan.budget.budget_bytes);
        assert!(remote.predicted_seconds_per_token < remote.local_seconds_per_token, "{remote:?}");
    }

    #[test]
    fn a_model_the_host_holds_stays_local() {
        let plan = remote_plan(8 << 30, vec![device("RPC0", room_for(8), 2e-4)]);
        assert!(plan.remote.is_none());
        assert!(plan.tensors.iter().all(|tensor| tensor.tier != Tier::Remote));
        assert!(
            plan.remote_unused.as_deref().unwrap().contains("streaming locally alone is predicted faster"),
            "{:?}",
            plan.remote_unused
        );
    }

    /// The planner switches to local streaming where the links cost more than the streamed
    /// bytes they save.
    #[test]
    fn a_slow_link_loses_to_local_streaming() {
        let budget = 1400 << 20;
        let near = remote_plan(budget, vec![device("RPC0", room_for(2), 2e-4)]);
        let near_remote = near.remote.as_ref().unwrap_or_else(|| panic!("{}", near.render()));
        // What the two remote layers save: their streamed FFN at the disk's rate.
        let saved = near_remote.local_seconds_per_token
            - (near_remote.predicted_seconds_per_token - near_remote.link_seconds_per_token);
        assert!(saved > 0.0, "{near_remote:?}");
        let far = remote_plan(budget, vec![device("RPC0", room_for(2), saved * 1.5)]);
        assert!(far.remote.is_none(), "{}", far.render());
        assert!(far.remote_unused.as_deref().unwrap().contains("predicted faster"), "{:?}", far.remote_unused);
        assert!(far.streamed_bytes_per_token > near.streamed_bytes_per_token);
    }

    /// A hybrid model (a KV cache in every 4th layer, a recurrent state in the others): each
    /// remote layer is planned as an attending one, and the host keeps room for all of its
    /// context, since which remote layers attend is not known here.
    #[test]
    fn hybrid_layers_are_planned_for_the_larger_context_on_both_sides() {
        let mut hybrid = inventory(16, 16 << 20, 32 << 20, 64 << 20);
        hybrid.hparams.n_layer_kv = 4;
        hybrid.hparams.recurrent_state_bytes = 12 << 20;
        let options = auto_window(ModeChoice::Auto);
        let attending = crate::plan::kv_cache_bytes(&hybrid, 1024, Default::default()) / 4;
        assert!(attending > (12 << 20) / 12, "the attending layer is the larger here");
        let plan =
            plan(&hybrid, &machine(1536 << 20, vec![device("RPC0", room_for(4) + 4 * attending, 2e-4)]), &options)
                .unwrap();
        let remote = plan.remote.as_ref().unwrap_or_else(|| panic!("{}", plan.render()));
        let share = &remote.shares[0];
        assert_eq!(share.kv_cache_bytes, share.layers.len() as u64 * attending, "{share:?}");
        assert_eq!(remote.host_context_bytes_moved, 0);
        assert_eq!(plan.budget.kv_cache_bytes, crate::plan::context_memory_bytes(&hybrid, 1024, 1, Default::default()));
    }

    #[test]
    fn devices_too_small_for_a_layer_are_unused_and_say_so() {
        let plan = remote_plan(700 << 20, vec![device("RPC0", 64 << 20, 2e-4)]);
        assert!(plan.remote.is_none());
        assert!(
            plan.remote_unused.as_deref().unwrap().contains("no remote device holds one layer"),
            "{:?}",
            plan.remote_unused
        );
    }

    #[test]
    fn forced_streaming_with_remote_devices_streams_only_host_layers() {
        let inventory = inventory(16, 16 << 20, 32 << 20, 64 << 20);
        let options = auto_window(ModeChoice::Forced(Mode::DenseStream));
        let plan = plan(&inventory, &machine(900 << 20, vec![device("RPC0", room_for(6), 2e-4)]), &options).unwrap();
        assert_eq!(plan.remote.as_ref().map(|remote| remote.layers.clone()), Some(10..16), "{}", plan.render());
        assert!(plan.streamed_tensors().all(|tensor| tensor.layer.is_some_and(|layer| layer < 10)));
    }
}
