//! The speed a plan is predicted to run at, before it runs: decode and prompt tokens per
//! second from the bytes each token or prompt batch must read, the disk's rate, and the
//! compute this machine measured for the model (or, for a model never run here, its weight
//! bytes at the rate this machine computed others'). For expert streaming the bytes follow from
//! the cache's expected hit rate (`reuse`): the model's recorded routing where a run recorded
//! it, else real models' routing (`ReuseDepths::real_routing`).
use serde::Serialize;

use super::reuse::{uniform_hit_rate, ReuseDepths};
use super::types::{MachineFacts, Mode, Plan, Tier};
use crate::format::{format_bytes, format_bytes_per_sec};
use crate::model::{Inventory, Role};

/// Where a hit rate comes from for a model no run recorded: real models' routing, never
/// uniform routing (`ReuseDepths::real_routing`).
pub const REAL_ROUTING_FROM: &str = "real models' routing: no run of this model recorded its own";

/// A GPU's decode rate over the weight bytes a token touches there, for a plan no run on this
/// machine measured: the H200 machine's, the forged Qwen3.6-35B-A3B resident on the device at
/// 5.92 ms a token (2026-12-04; `plan::gpu::POOL_STOP_DEVICE_SECONDS` has the same source).
pub const GPU_DECODE_BYTES_PER_SEC: f64 = 3.0e11;

/// The host's CPU rate over the weight bytes it computes, for a GPU plan on a machine whose CPU
/// never ran a model resident: so that `--gpu-experts auto` can weigh the CPU's share of
/// whole layers against the pool. Records replace it after one resident run of any model.
pub const CPU_BYTES_PER_SEC_UNMEASURED: f64 = 2.0e10;

/// The disk's rate for a GPU plan on a machine whose disk was never profiled nor streamed from,
/// so that `--gpu-experts auto` weighs its options by their reads too, instead of taking one by
/// rule: about the sustained rates profiled on the machines the GPU figures come from (1.09 and
/// 1.74 GB/s on the H100 machines, 2026-12-06 and -07; 2.27 on the 2-core machine). A profile or
/// one streaming run replaces it.
pub const DISK_BYTES_PER_SEC_UNPROFILED: f64 = 1.5e9;
const DISK_RATE_ASSUMED: &str = "assumed: no disk profile, `hypura profile`";

/// What `predict` says, with the figures it used (`inspect` prints them; `--json` carries them).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Prediction {
    /// Generated tokens per second at decode; None where the compute time is not known (the
    /// model has not run on this machine) and nothing streams.
    pub decode_tokens_per_sec: Option<f64>,
    /// Prompt tokens per second over a prompt of one full batch; None where the prompt's compute
    /// time is not known.
    pub prompt_tokens_per_sec: Option<f64>,
    /// Bytes read from disk per generated token, as expected (the cache's hits taken off).
    pub bytes_per_token: f64,
    /// Bytes read from disk per prompt batch.
    pub bytes_per_prompt_batch: f64,
    /// The share of expert picks the expert cache (and a GPU pool's slots) is expected to serve.
    pub expert_hit_rate: Option<f64>,
    /// Bytes read for experts ÷ the bytes of the picks an LRU cache misses, as earlier runs
    /// measured it (the prefetch's reads the router did not use, the policy's differences);
    /// 1 without a record.
    pub expert_read_factor: f64,
    /// Where that share comes from: "recorded routing" (an earlier run of this model) or
    /// `REAL_ROUTING_FROM` (no record).
    pub hit_rate_from: Option<&'static str>,
    /// The disk's rate used, and where it comes from ("streaming runs", "profile").
    pub disk_bytes_per_sec: Option<f64>,
    pub disk_rate_from: Option<&'static str>,
    /// The decode compute per token used, and where it comes from ("streaming runs",
    /// "resident runs", either "scaled to this plan's CPU share").
    pub compute_seconds_per_token: Option<f64>,
    pub compute_from: Option<String>,
    /// The prompt compute per token used (resident runs of the model).
    pub prompt_seconds_per_token: Option<f64>,
    /// The share of a token's weight bytes this plan computes on the host's CPU (1 without a
    /// GPU tier): a measured compute is scaled by it where it was measured at another share.
    pub host_share: f64,
    /// Weight bytes a token touches, all tiers together (`touched`).
    pub touched_bytes_per_token: f64,
    /// Tokens per prompt batch.
    pub prompt_batch: u32,
}

/// Units the experts' tiers hold together: the host's expert cache and a GPU pool's slots.
pub fn cached_units(plan: &Plan) -> f64 {
    let Some(experts) = &plan.experts else { return 0.0 };
    let slots = plan
        .gpu
        .as_ref()
        .and_then(|gpu| gpu.expert_pool.as_ref())
        .map_or(0, |pool| u64::from(pool.slots) * experts.moe_layers);
    (experts.cache_units as u64 + slots) as f64
}

/// Weight bytes a token touches, and the share of them `plan` computes on the host: every
/// tensor's bytes (a routed expert tensor's `k / n` of them; the token embedding's none, one row
/// is read, unless it is also the output), those the GPU tier or a remote device holds, or a GPU
/// pool computes, taken off the host's.
pub fn touched(inventory: &Inventory, plan: &Plan) -> (f64, f64) {
    let tiers: std::collections::HashMap<&str, Tier> =
        plan.tensors.iter().map(|tensor| (tensor.name.as_str(), tensor.tier)).collect();
    let hparams = &inventory.hparams;
    let routed = hparams.n_expert_used.max(1) as f64 / hparams.n_expert.max(1) as f64;
    let pooled = plan.gpu.as_ref().is_some_and(|gpu| gpu.expert_pool.is_some());
    let tied = !inventory.tensors.iter().any(|tensor| tensor.role == Role::Output);
    let (mut host, mut total) = (0.0, 0.0);
    for tensor in inventory.tensors.iter().filter(|tensor| tied || tensor.role != Role::TokenEmbedding) {
        // MTP layers that do not draft are never loaded.
        if tiers.get(tensor.name.as_str()) == Some(&Tier::Unused) {
            continue;
        }
        let touched = tensor.bytes as f64 * if tensor.experts.is_some() { routed } else { 1.0 };
        let elsewhere = plan.remote.as_ref().is_some_and(|remote| remote.holds(tensor))
            || (pooled && tensor.experts.is_some())
            || tiers.get(tensor.name.as_str()) == Some(&Tier::Gpu);
        total += touched;
        if !elsewhere {
            host += touched;
        }
    }
    (total, if total > 0.0 { host / total } else { 1.0 })
}

/// A compute time measured at `measured_share` of the weights on the host, for a plan that
/// computes `share` of them there: as it is within five points, else in proportion (the
/// host's CPU sets the pace where it computes a fair share); None where one of the two computes
/// (nearly) nothing on the host, as a GPU-resident run says nothing of a CPU's speed.
fn at_share(seconds: f64, measured_share: f64, share: f64) -> Option<(f64, bool)> {
    if (measured_share - share).abs() <= 0.05 {
        Some((seconds, false))
    } else if measured_share >= 0.05 && share >= 0.05 {
        Some((seconds * share / measured_share, true))
    } else {
        None
    }
}

/// A GPU expert pool's decode: the model's compute on the device, as a run of it resident on
/// the GPU here measured (its host share under 5%), and what the pooled layers add by the
/// recorded routing (`ExpertPoolLayout::decode_overhead_seconds`: their stops and the misses'
/// transfers). A pooled run's own record holds the stops of its layout, which another layout
/// (more layers whole) does not have, so this comes first where both are known.
fn pooled_on_device(plan: &Plan, facts: &MachineFacts, touched_bytes: f64) -> Option<(f64, String)> {
    let pool = plan.gpu.as_ref()?.expert_pool.as_ref()?;
    let overhead = pool.decode_overhead_seconds?;
    let (device, device_from) = match facts.device_resident_seconds_per_token() {
        Some(seconds) => (seconds, "resident runs"),
        None => (touched_bytes / GPU_DECODE_BYTES_PER_SEC, "estimated at the H200 machine's rate"),
    };
    let routing = if facts.expert_reuse.is_some() { "recorded routing" } else { "real models' routing" };
    Some((
        device + overhead,
        format!(
            "the model on the GPU {:.1} ms ({device_from}) + the pool's {} stops and misses' transfers {:.1} ms ({routing})",
            device * 1e3,
            pool.layers.len(),
            overhead * 1e3
        ),
    ))
}

/// Predict `plan`'s decode and prompt speed on `facts` with prompt batches of `n_batch`.
///
/// Decode: for dense streaming `1 / max(compute, bytes per token / disk rate)`, the physical
/// limit's form: the window reads ahead, so the longer of the two sets the pace. For routed
/// experts the two add: a layer's stop waits for the misses of the picks its router just made
/// (S6a's whole layers, 23.8 ms of compute and 15.5 ms of reads a token, measured 38.5 ms),
/// beside a GPU pool too (its stop waits for the host cache's misses before it uploads them).
/// The stale-gate prefetch reads some of them a layer ahead, but under real routing it read
/// more than it hid: on moe-small in a cgroup, 42.3 ms a token with it and 40.1 without,
/// against 15 ms of compute and 33 (26) MB of reads at 1.43 GB/s
/// (`docs/benchmarks/2026-12-07-prediction-sum/`). Prompt:
/// each batch of `n_batch` tokens reads the streamed bytes it needs once (dense layers all of
/// them; expert layers the distinct experts its tokens pick, less what the cache holds), and
/// takes the longer of that read and its compute.
pub fn predict(plan: &Plan, facts: &MachineFacts, n_batch: u32, (touched_bytes, host_share): (f64, f64)) -> Prediction {
    // The record of the plan's own kind first (a streaming run's compute includes the
    // streaming's own work), at this plan's share of the weights on the host.
    let streaming =
        facts.compute_seconds_per_token.map(|seconds| (seconds, facts.compute_host_share, "streaming runs"));
    let resident =
        facts.resident_seconds_per_token.map(|seconds| (seconds, facts.resident_host_share, "resident runs"));
    let order = if plan.mode == Mode::Resident { [resident, streaming] } else { [streaming, resident] };
    let recorded = |scale: bool| {
        order.into_iter().flatten().find_map(|(seconds, measured_share, from)| {
            let (seconds, scaled) = at_share(seconds, measured_share.unwrap_or(1.0), host_share)?;
            (scale || !scaled).then(|| {
                (seconds, if scaled { format!("{from}, scaled to this plan's CPU share") } else { from.to_string() })
            })
        })
    };
    // The host's bytes at the rate this machine's CPU computed models resident (MoE ones first),
    // beside the device's share: the model's own time resident on the GPU, for the share of its
    // bytes there, else the H200 machine's rate. `measured`: only with both rates measured here,
    // and only for a plan that streams nothing (a streamed layer's stop costs what neither rate
    // holds: S6a's whole layers computed their host experts at about 20 GB/s, stops included,
    // where the CPU computes S6's model resident at 41). A GPU plan is always predicted
    // (`--gpu-experts auto` weighs its options): a CPU that never ran a model at an assumed rate.
    let estimated = |measured: bool| {
        let gpu = plan.gpu.is_some();
        let device_resident = facts.device_resident_seconds_per_token();
        let (rate, rate_from) = match facts.cpu_bytes_per_sec.filter(|rate| *rate > 0.0) {
            Some(rate) if facts.cpu_rate_of_moe => (rate, "other MoE models computed at here"),
            Some(rate) => (rate, "other models, dense, computed at here"),
            None if gpu && !measured => (CPU_BYTES_PER_SEC_UNMEASURED, "assumed: no model ran on this CPU yet"),
            None => return None,
        };
        if (host_share < 0.05 && !gpu)
            || (measured && (!gpu || device_resident.is_none() || plan.mode != Mode::Resident))
        {
            return None;
        }
        let (device, device_from) = match device_resident {
            Some(seconds) if gpu => (
                seconds * (1.0 - host_share),
                format!(", the rest on the GPU at this model's time resident there ({:.1} ms)", seconds * 1e3),
            ),
            _ if gpu => (
                touched_bytes * (1.0 - host_share) / GPU_DECODE_BYTES_PER_SEC,
                ", the rest on the GPU at the H200 machine's rate".to_string(),
            ),
            _ => (0.0, String::new()),
        };
        Some((
            touched_bytes * host_share / rate + device,
            format!(
                "estimated: {} a token on the CPU at {} ({rate_from}){device_from}",
                crate::format::format_bytes((touched_bytes * host_share) as u64),
                format_bytes_per_sec(rate),
            ),
        ))
    };
    // The model's own record at this plan's share first; then, on a GPU, the two tiers' rates as
    // measured here (S6b's whole layers: S6a's streaming runs scaled to S6b's share predicted
    // 53.1 tok/s, the run measured 92.6, these rates 91); then a record scaled; then estimates.
    let (compute, compute_from) = pooled_on_device(plan, facts, touched_bytes)
        .or_else(|| recorded(false))
        .or_else(|| estimated(true))
        .or_else(|| recorded(true))
        .or_else(|| estimated(false))
        .unzip();
    let (disk, disk_rate_from) = match facts.disk_bytes_per_sec.filter(|rate| *rate > 0.0) {
        Some(rate) => (Some(rate), Some(if facts.disk_rate_from_runs { "streaming runs" } else { "profile" })),
        // A GPU plan is always predicted, as its CPU's share is: a disk never profiled at an
        // assumed rate.
        None if plan.gpu.is_some() => (Some(DISK_BYTES_PER_SEC_UNPROFILED), Some(DISK_RATE_ASSUMED)),
        None => (None, None),
    };
    let ubatch =
        plan.experts.as_ref().and_then(|experts| experts.max_ubatch).unwrap_or(n_batch).clamp(1, n_batch.max(1));
    let mut prediction = Prediction {
        compute_seconds_per_token: compute,
        compute_from,
        disk_bytes_per_sec: disk,
        disk_rate_from,
        prompt_seconds_per_token: facts.prompt_seconds_per_token,
        host_share,
        touched_bytes_per_token: touched_bytes,
        prompt_batch: ubatch,
        expert_read_factor: facts.expert_read_factor.unwrap_or(1.0),
        ..Prediction::default()
    };
    if let Some(remote) = &plan.remote {
        prediction.decode_tokens_per_sec = Some(1.0 / remote.predicted_seconds_per_token.max(1e-9));
        return prediction;
    }
    let (bytes_per_token, bytes_per_batch) = match &plan.experts {
        Some(experts) => {
            let units = cached_units(plan);
            let (hit, from) =
                match facts.expert_reuse.as_ref().and_then(|reuse| reuse.hit_rate(units, experts.moe_layers)) {
                    Some(hit) => (hit, "recorded routing"),
                    None => (
                        ReuseDepths::real_routing(experts.moe_layers, experts.n_expert)
                            .hit_rate(units, experts.moe_layers)
                            .unwrap_or_else(|| uniform_hit_rate(units, experts.moe_layers, experts.n_expert)),
                        REAL_ROUTING_FROM,
                    ),
                };
            prediction.expert_hit_rate = Some(hit);
            prediction.hit_rate_from = Some(from);
            let k = experts.n_expert_used.clamp(1, experts.n_expert.max(1));
            let per_token =
                (experts.moe_layers * k * experts.unit_bytes) as f64 * (1.0 - hit) * prediction.expert_read_factor;
            // A batch of u tokens picks n(1 - (1 - k/n)^u) distinct experts of a layer (uniform
            // routing); the cache's share of the layer's experts is already there.
            let n = experts.n_expert.max(1) as f64;
            let distinct = n * (1.0 - (1.0 - k as f64 / n).powf(f64::from(ubatch)));
            let cached = (units / (experts.moe_layers.max(1) as f64 * n)).min(1.0);
            let per_batch = experts.expert_bytes as f64 * distinct / n * (1.0 - cached);
            let dense = experts.dense_streamed_bytes as f64;
            (per_token + dense, per_batch + dense)
        }
        None => (plan.streamed_bytes_per_token as f64, plan.streamed_bytes_per_token as f64),
    };
    prediction.bytes_per_token = bytes_per_token;
    prediction.bytes_per_prompt_batch = bytes_per_batch;
    let read = |bytes: f64| if bytes <= 0.0 { Some(0.0) } else { disk.map(|rate| bytes / rate) };
    // An expert layer's stop waits for its picks' misses (a GPU pool's, for the host cache's
    // before it uploads them): their reads add to the token's time. A dense window's reads
    // overlap the compute.
    let stops_wait = plan.experts.is_some();
    prediction.decode_tokens_per_sec = match (compute, read(bytes_per_token)) {
        (Some(compute), Some(read)) if stops_wait => Some(compute + read),
        (Some(compute), Some(read)) => Some(compute.max(read)),
        // Only the disk is known: a plan that must read is at most that fast, but its compute
        // is unknown, so no figure is claimed.
        _ => None,
    }
    .filter(|seconds| *seconds > 0.0)
    .map(|seconds| 1.0 / seconds);
    prediction.prompt_tokens_per_sec = match (facts.prompt_seconds_per_token, read(bytes_per_batch)) {
        (Some(per_token), Some(read)) => Some(f64::from(ubatch) / (per_token * f64::from(ubatch)).max(read)),
        _ => None,
    }
    .filter(|rate| rate.is_finite() && *rate > 0.0);
    prediction
}

impl Prediction {
    /// One line for `inspect`: the two speeds, then what they were made from.
    pub fn render(&self) -> String {
        let speed = |rate: Option<f64>| rate.map_or("not known".to_string(), |rate| format!("{rate:.2} tok/s"));
        let mut basis = Vec::new();
        match (self.compute_seconds_per_token, &self.compute_from) {
            (Some(seconds), Some(from)) => basis.push(format!("compute {:.1} ms a token ({from})", seconds * 1e3)),
            _ => basis.push("compute not measured yet: a run of this model records it".to_string()),
        }
        if self.bytes_per_token > 0.0 {
            let rate = match (self.disk_bytes_per_sec, self.disk_rate_from) {
                (Some(rate), Some(from)) => format!(" at {} ({from})", format_bytes_per_sec(rate)),
                _ => " (no disk profile: `hypura profile`)".to_string(),
            };
            basis.push(format!("{} read a token{rate}", format_bytes(self.bytes_per_token as u64)));
        }
        if let (Some(hit), Some(from)) = (self.expert_hit_rate, self.hit_rate_from) {
            basis.push(format!("expert hit rate {hit:.3} ({from})"));
            if self.expert_read_factor != 1.0 {
                basis.push(format!("{:.2}× the misses' bytes read (earlier runs: prefetch)", self.expert_read_factor));
            }
        }
        if self.prompt_seconds_per_token.is_none() {
            basis.push("prompt compute not measured yet: a resident run records it".to_string());
        } else if self.bytes_per_prompt_batch > 0.0 {
            basis.push(format!("{} read a prompt batch", format_bytes(self.bytes_per_prompt_batch as u64)));
        }
        format!(
            "decode {}, prompt {} in batches of {}: {}",
            speed(self.decode_tokens_per_sec),
            speed(self.prompt_tokens_per_sec),
            self.prompt_batch,
            basis.join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::*;
    use crate::plan::{compute_buffer_bytes, kv_cache_bytes, plan, ModeChoice, PlanOptions, ReuseTracker};

    /// 4 MoE layers of 128 experts of 3 × 1 MiB, 8 picked per token, with room for 256 units.
    fn expert_plan(facts: &MachineFacts) -> Plan {
        let inventory = moe_inventory(4, 128, 8, 1 << 20);
        let fixed =
            inventory.tensors.iter().filter(|tensor| tensor.experts.is_none()).map(|tensor| tensor.bytes).sum::<u64>();
        let budget = fixed
            + kv_cache_bytes(&inventory, 1024, Default::default())
            + compute_buffer_bytes(&inventory, 1024, 512)
            + 256 * (3 << 20);
        let options = PlanOptions { mode: ModeChoice::Auto, n_ctx: 1024, n_ubatch: 512, ..PlanOptions::default() };
        plan(&inventory, &MachineFacts { memory_budget_bytes: budget, ..facts.clone() }, &options).unwrap()
    }

    #[test]
    fn an_expert_decode_takes_its_compute_and_its_expected_reads() {
        let facts = MachineFacts {
            disk_bytes_per_sec: Some(1e9),
            compute_seconds_per_token: Some(0.01),
            ..MachineFacts::default()
        };
        let plan = expert_plan(&facts);
        assert_eq!(plan.mode, Mode::ExpertStream);
        // No record: real models' routing. The cache holds half of the 512 units, which serves
        // the recorded real picks' share below half of the units (never uniform routing's 0.5);
        // the rest of the 4 × 8 picks of 3 MiB miss, read at 1 GB/s.
        let unrecorded = predict(&plan, &facts, 512, (1e9, 1.0));
        assert_eq!(unrecorded.hit_rate_from, Some(REAL_ROUTING_FROM));
        let hit = unrecorded.expert_hit_rate.unwrap();
        assert!((hit - crate::plan::REAL_ROUTING_BELOW[64]).abs() < 1e-3, "{unrecorded:?}");
        let missed = 32.0 * f64::from(3u32 << 20) * (1.0 - hit);
        assert!((unrecorded.bytes_per_token - missed).abs() < 1.0, "{unrecorded:?}");
        // The stops wait for the misses: the reads add to the compute.
        let expected = 1.0 / (missed / 1e9 + 0.01);
        assert!((unrecorded.decode_tokens_per_sec.unwrap() - expected).abs() < 1e-6, "{unrecorded:?}");
        assert_eq!(unrecorded.prompt_tokens_per_sec, None, "no prompt compute measured");

        // Recorded routing that picks the same 8 experts of each layer every token: every pick
        // but the first hits, and the compute all but sets the pace.
        let mut tracker = ReuseTracker::new(4, 128);
        for _ in 0..100 {
            for layer in 0..4 {
                tracker.record(layer, &[0, 1, 2, 3, 4, 5, 6, 7]);
            }
        }
        let recorded = MachineFacts {
            expert_reuse: Some(tracker.counts().clone()),
            prompt_seconds_per_token: Some(0.001),
            ..facts.clone()
        };
        let sticky = predict(&plan, &recorded, 512, (1e9, 1.0));
        assert_eq!(sticky.hit_rate_from, Some("recorded routing"));
        assert!((sticky.expert_hit_rate.unwrap() - 0.99).abs() < 1e-9);
        let sticky_reads = sticky.bytes_per_token / 1e9;
        assert!(sticky_reads > 0.0 && sticky_reads < 0.002, "{sticky:?}");
        assert!((sticky.decode_tokens_per_sec.unwrap() - 1.0 / (0.01 + sticky_reads)).abs() < 1e-6, "{sticky:?}");
        // A prompt batch of 512 tokens picks nearly every expert: the half the cache does not
        // hold is read once (768 MiB at 1 GB/s), against 0.512 s of compute.
        let read = 0.5 * f64::from(1536u32 << 20) / 1e9;
        assert!((sticky.prompt_tokens_per_sec.unwrap() - 512.0 / read).abs() < 1.0, "{sticky:?}");
        assert!(sticky.render().contains("recorded routing"), "{}", sticky.render());
    }

    /// Whole layers on a GPU, nothing streamed, at a share no run of the model had: the host's bytes at the CPU's
    /// MoE rate and the rest at the model's own time resident on the device, before any record
    /// scaled to the share. S6b on the H100 machine (2026-12-07): 18% of a token's 1.56 GB on
    /// the CPU at 41 GB/s (S6's model resident there: 26.5 tok/s), 5.2 ms resident on the GPU:
    /// 10.9 ms (91 tok/s) against the 10.8 ms measured, where S6a's streaming runs (25% on the
    /// CPU) scaled to S6b's share had predicted 18.8 ms.
    #[test]
    fn a_gpu_plan_at_a_new_share_takes_both_tiers_measured_rates() {
        let inventory = moe_inventory(4, 128, 8, 1 << 20);
        let options = PlanOptions { gpu_experts: Some(crate::plan::GpuExperts::Layers), ..PlanOptions::default() };
        let facts = MachineFacts {
            resident_seconds_per_token: Some(0.0052),
            resident_host_share: Some(0.0),
            compute_seconds_per_token: Some(0.0195),
            compute_host_share: Some(0.253),
            cpu_bytes_per_sec: Some(41.2e9),
            cpu_rate_of_moe: true,
            ..with_gpu(64 << 30, 64 << 30)
        };
        let plan = plan(&inventory, &facts, &options).unwrap();
        assert!(plan.gpu.is_some() && plan.mode == Mode::Resident, "{}", plan.render());
        let at = |share: f64| predict(&plan, &facts, 512, (1.556e9, share));
        let new_share = at(0.176);
        let expected: f64 = 0.176 * 1.556e9 / 41.2e9 + 0.0052 * 0.824;
        assert!((1.0 / expected / 92.6 - 1.0).abs() < 0.05, "S6b measured 92.6 tok/s: {expected}");
        assert!((new_share.compute_seconds_per_token.unwrap() - expected).abs() < 1e-12, "{new_share:?}");
        assert!(new_share.compute_from.as_deref().unwrap().contains("this model's time resident there"));
        // The streaming runs' own share: their record as it is.
        assert_eq!(at(0.253).compute_seconds_per_token, Some(0.0195));
        // No CPU rate measured here: the record scaled, as before.
        let unmeasured = MachineFacts { cpu_bytes_per_sec: None, ..facts.clone() };
        let scaled = predict(&plan, &unmeasured, 512, (1.556e9, 0.176));
        assert!((scaled.compute_seconds_per_token.unwrap() - 0.0195 * 0.176 / 0.253).abs() < 1e-12, "{scaled:?}");
        // A plan that streams: its stops cost what neither rate holds, so the streaming record
        // scaled to its share comes first.
        let streams = MachineFacts { memory_budget_bytes: 400 << 20, gpu_budget_bytes: 1 << 30, ..facts.clone() };
        let streaming = super::super::plan(&inventory, &streams, &options).unwrap();
        assert!(streaming.gpu.is_some() && streaming.mode == Mode::ExpertStream, "{}", streaming.render());
        let streamed = predict(&streaming, &streams, 512, (1.556e9, 0.176));
        assert!((streamed.compute_seconds_per_token.unwrap() - 0.0195 * 0.176 / 0.253).abs() < 1e-12, "{streamed:?}");
    }

    #[test]
    fn a_resident_plan_needs_a_measured_compute() {
        let inventory = inventory(8, 16 << 20, 32 << 20, 64 << 20);
        let facts =
            MachineFacts { memory_budget_bytes: 8 << 30, disk_bytes_per_sec: Some(1e9), ..MachineFacts::default() };
        let options = PlanOptions::default();
        let resident = plan(&inventory, &facts, &options).unwrap();
        assert_eq!(resident.mode, Mode::Resident);
        assert_eq!(predict(&resident, &facts, 512, (1e9, 1.0)).decode_tokens_per_sec, None);
        let measured = MachineFacts {
            resident_seconds_per_token: Some(0.02),
            prompt_seconds_per_token: Some(0.004),
            ..facts.clone()
        };
        let prediction = predict(&resident, &measured, 512, (1e9, 1.0));
        assert_eq!(prediction.compute_from.as_deref(), Some("resident runs"));
        // Half the weights on a GPU: the host's half of the time; all of them there: a
        // CPU-resident run says nothing.
        let half = predict(&resident, &measured, 512, (1e9, 0.5));
        assert!((half.decode_tokens_per_sec.unwrap() - 100.0).abs() < 1e-9, "{half:?}");
        assert_eq!(half.compute_from.as_deref(), Some("resident runs, scaled to this plan's CPU share"));
        assert_eq!(predict(&resident, &measured, 512, (1e9, 0.0)).decode_tokens_per_sec, None);
        // Never run: a gigabyte a token at the 20 GB/s other models ran at here, 50 ms.
        let elsewhere = MachineFacts { cpu_bytes_per_sec: Some(20e9), ..facts.clone() };
        let estimated = predict(&resident, &elsewhere, 512, (1e9, 1.0));
        assert!((estimated.decode_tokens_per_sec.unwrap() - 20.0).abs() < 1e-9, "{estimated:?}");
        assert!(estimated.compute_from.unwrap().starts_with("estimated"));
        assert!((prediction.decode_tokens_per_sec.unwrap() - 50.0).abs() < 1e-9);
        assert!((prediction.prompt_tokens_per_sec.unwrap() - 250.0).abs() < 1e-9);
    }
}
