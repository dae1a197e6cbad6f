//! The remote tier: whole layers (attention, FFN and their KV cache) on other machines' devices
//! through ggml's RPC backend, as llama.cpp's layer split places them: the last layers, in
//! device order, each device a contiguous range. The host plans the layers before them as
//! before (resident, dense-stream or expert-stream), and keeps the output.
//!
//! A token crosses each device boundary once with its hidden state, so the link costs
//! `hops × round trip + activation bytes ÷ link rate` per token, hops being the remote devices
//! used plus one (back to the host). The planner takes the remote tier only where its predicted
//! time per token beats streaming locally alone (`choose`), and says both.
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
    /// Hidden-state bytes that cross the links per token (each hop carries one row of f32).
    pub activation_bytes_per_token: u64,
    /// The links' predicted cost per generated token.
    pub link_seconds_per_token: f64,
    /// Predicted seconds per token with this tier, and streaming locally alone (the planner's
    /// comparison; relative where the disk's rate or the compute time is unknown).
    pub predicted_seconds_per_token: f64,
    pub local_seconds_per_token: f64,
}

impl RemoteLayout {
    pub(super) fn holds(&self, tensor: &TensorEntry) -> bool {
        tensor.layer.is_some_and(|layer| self.layers.contains(&layer))
    }

    pub fn kv_cache_bytes(&self) -> u64 {
        self.shares.iter().map(|share| share.kv_cache_bytes).sum()
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
        self.shares.iter().enumerate().map(|(index, share)| share.layers.len() as f32 + if index == last { 1.0 } else { 0.0 }).collect()
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
    let kv = super::context_memory_bytes(inventory, options.n_ctx, options.n_sequences) / n_layer.max(1) as u64;
    weights.into_iter().map(|bytes| (bytes, kv)).collect()
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
pub(super) fn remote_tier(inventory: &Inventory, options: &PlanOptions, machine: &MachineFacts) -> Option<RemoteLayout> {
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
    let hops = shares.len() as u64 + 1;
    let row_bytes = 4 * inventory.hparams.n_embd;
    let activation_bytes_per_token = hops * row_bytes;
    // Each device's hidden state comes back over its link in one round trip (the last one's is
    // the hop back to the host), and its bytes go at the link's rate.
    let device_of = |share: &RemoteShare| machine.remote_devices.iter().find(|device| device.name == share.name).expect("a share's device");
    let hop = |share: &RemoteShare| {
        let device = device_of(share);
        device.round_trip_secs + device.link_bytes_per_sec.map_or(0.0, |rate| row_bytes as f64 / rate)
    };
    let link_seconds_per_token = shares.iter().map(hop).sum::<f64>() + shares.last().map_or(0.0, hop);
    Some(RemoteLayout {
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
pub(super) fn host_seconds_per_token(machine: &MachineFacts, streamed_bytes_per_token: u64, host_layer_share: f64) -> f64 {
    let disk = match machine.disk_bytes_per_sec {
        Some(rate) if rate > 0.0 => streamed_bytes_per_token as f64 / rate,
        // Unknown: relative units, in which any stream costs more than none.
        _ => streamed_bytes_per_token as f64 / 1e9,
    };
    let compute = machine.compute_seconds_per_token.unwrap_or(0.0) * host_layer_share;
    disk.max(compute)
}
