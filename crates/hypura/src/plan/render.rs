//! The human explanation of a plan that `inspect` prints (`Plan::render`): the budget, the GPU
//! tier, the mode's layout and bounds, and the tensors grouped by tier and reason; plus the byte
//! sizes it and the planner's errors are written in. The JSON form is the types' `Serialize`.
use std::fmt::Write as _;

use super::experts::HUGE_SLICE_MIN_BYTES;
use super::types::{Plan, Tier};
use crate::format::format_bytes;

impl Plan {
    /// The human explanation `inspect` prints.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let budget = &self.budget;
        let _ = writeln!(out, "plan         mode {}", self.mode.name());
        let _ = writeln!(
            out,
            "memory       {} of a {} budget: {} resident weights + {} stream window + {} KV cache + {} compute buffers{}",
            format_bytes(budget.total_bytes),
            format_bytes(budget.budget_bytes),
            format_bytes(budget.resident_weight_bytes),
            format_bytes(budget.window_bytes),
            format_bytes(budget.kv_cache_bytes),
            format_bytes(budget.compute_buffer_bytes),
            [(budget.draft_bytes, "draft model"), (budget.mtp_bytes, "MTP layers")]
                .iter()
                .filter(|(bytes, _)| *bytes > 0)
                .map(|(bytes, what)| format!(" + {} {what}", format_bytes(*bytes)))
                .collect::<String>()
        );
        if let Some(gpu) = &self.gpu {
            let layers = match &gpu.whole_layers {
                Some(layers) => {
                    format!("layers {}-{} whole on the GPU with the output ({} of {}; every layer's attention and KV cache do not fit)", layers.start, layers.end - 1, layers.len(), layers.end)
                }
                None => format!(
                    "FFN of {} layer{} on the GPU{}",
                    gpu.ffn_layers.len(),
                    if gpu.ffn_layers.len() == 1 { "" } else { "s" },
                    if gpu.ffn_layers.is_empty() { String::new() } else { format!(" {:?}", gpu.ffn_layers) }
                ),
            };
            let pool = gpu
                .expert_pool
                .as_ref()
                .map_or(String::new(), |pool| format!(" + {} expert pool", format_bytes(pool.total_bytes())));
            let _ = writeln!(
                out,
                "gpu          {} of a {} budget: {} weights + {} KV cache + {} compute buffers + {} runtime{pool}; {layers}",
                format_bytes(gpu.total_bytes()),
                format_bytes(gpu.budget_bytes),
                format_bytes(gpu.weight_bytes),
                format_bytes(gpu.kv_cache_bytes),
                format_bytes(gpu.compute_buffer_bytes),
                format_bytes(gpu.runtime_bytes),
            );
            if let Some(pool) = &gpu.expert_pool {
                let whole = match pool.whole_layers.len() {
                    0 => String::new(),
                    count => format!(
                        "; {count} MoE layer{} whole on the GPU instead, without the pool's stop (the recorded routing needs no more slots)",
                        if count == 1 { "" } else { "s" }
                    ),
                };
                let served = if pool.split {
                    "split: the CPU computes a decode's picks that no slot holds from the host's expert cache (or disk) beside the GPU, which computes the slots' (one slot a layer holds zeros for them); an expert is uploaded once picked often; prompt batches compute on the GPU"
                } else {
                    "routed experts compute on the GPU, served from the slots, the host's expert cache, then disk"
                };
                let _ = writeln!(
                    out,
                    "expert pool  {} slots in each of {} MoE layers ({}) + a {} staging area for prompt batches that pick more: {served}{whole}",
                    pool.slots,
                    pool.layers.len(),
                    format_bytes(pool.slot_bytes),
                    format_bytes(pool.staging_bytes),
                );
            } else {
                let prompts = if gpu.op_offload {
                    "ggml may move large prompt batches to the GPU"
                } else {
                    "prompt batches too (op offload off: the budget has no room for a host layer's copy)"
                };
                let _ = writeln!(out, "             host-memory weights and streamed layers compute on the CPU at decode (copying them costs more than computing them); {prompts}");
            }
            if !gpu.experts_options.is_empty() {
                let options: Vec<String> = gpu
                    .experts_options
                    .iter()
                    .map(|option| {
                        let rate = option
                            .decode_tokens_per_sec
                            .map_or("not predictable".to_string(), |rate| format!("{rate:.2} tok/s"));
                        format!("{} {rate}{}", option.name, if option.chosen { " (chosen)" } else { "" })
                    })
                    .collect();
                let _ = writeln!(out, "gpu experts  --gpu-experts auto predicted decode: {}", options.join(", "));
            }
        }
        if let Some(why) = &self.gpu_unused {
            let _ = writeln!(out, "gpu          unused: {why}");
        }
        if let Some(remote) = &self.remote {
            let _ = writeln!(
                out,
                "remote       layers {}-{} whole on other machines: {}",
                remote.layers.start,
                remote.layers.end - 1,
                remote.describe()
            );
            let local = if remote.local_seconds_per_token.is_finite() {
                format!("against {:.2} ms streaming locally alone", remote.local_seconds_per_token * 1e3)
            } else {
                "streaming locally alone does not fit the budget".to_string()
            };
            let _ = writeln!(
                out,
                "             links: {} round trips and {} per token, {:.2} ms per token predicted; {:.2} ms per token predicted, {local}",
                remote.shares.len(),
                format_bytes(remote.activation_bytes_per_token),
                remote.link_seconds_per_token * 1e3,
                remote.predicted_seconds_per_token * 1e3,
            );
        }
        if let Some(why) = &self.remote_unused {
            let _ = writeln!(out, "remote       unused: {why}");
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
                    format!(" (slices of {} and up, read into huge pages)", format_bytes(experts.min_slice_bytes))
                } else {
                    format!(" (slices of {} and up, read into 4 KiB pages)", format_bytes(experts.min_slice_bytes))
                }
            );
            if let Some(ubatch) = experts.max_ubatch {
                let _ = writeln!(out, "batches      prompt batches of at most {ubatch} tokens: the cache holds fewer units than a larger batch may pick in a layer");
            }
            let also = if self.dense.is_some() { ", and the streamed dense layers" } else { "" };
            let _ = writeln!(
                out,
                "per token    at most {} read from disk (every pick a miss{also})",
                format_bytes(self.streamed_bytes_per_token)
            );
            if let Some(bound) = self.io_bound_tokens_per_sec {
                let _ = writeln!(
                    out,
                    "bound        at least {bound:.2} tok/s from disk bandwidth alone, before cache hits"
                );
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
                let costs: Vec<String> = dense
                    .windows_costed
                    .iter()
                    .map(|(window, seconds)| format!("{window}: {:.0} ms", seconds * 1e3))
                    .collect();
                let _ = writeln!(out, "window       chosen by predicted time per token, max(compute, disk at the reads in flight), each layer of window one fewer pinned: {}", costs.join(", "));
            }
            // With experts, their lines above already count the dense layers' bytes.
            if self.experts.is_none() {
                let _ = writeln!(out, "per token    {} read from disk", format_bytes(self.streamed_bytes_per_token));
                if let Some(bound) = self.io_bound_tokens_per_sec {
                    let _ = writeln!(out, "bound        at most {bound:.2} tok/s from disk bandwidth alone");
                }
            }
        }
        if let Some(limit) = self.limit_tokens_per_sec {
            let _ = writeln!(
                out,
                "limit        {limit:.2} tok/s: 1 / max(measured compute per token, streamed bytes / disk bandwidth)"
            );
        }
        if let Some(prediction) = &self.prediction {
            let _ = writeln!(out, "predicted    {}", prediction.render());
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
            let _ = writeln!(
                out,
                "  {:<6} {:>4} tensors {:>12}  {why}",
                format!("{tier:?}").to_lowercase(),
                count,
                format_bytes(bytes)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_keep_three_digits() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(4 << 10), "4.00 KiB");
        assert_eq!(format_bytes(236 << 20), "236.0 MiB");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
    }
}
