//! The planner's vocabulary: what it is asked (`MachineFacts`, `PlanOptions`), what it answers
//! (`Plan`: the mode, every tensor's tier and why, where the host memory budget goes) and how it
//! refuses (`PlanError`). The layouts of each mode (`DenseLayout`, `ExpertLayout`, `GpuLayout`)
//! live with the code that plans them.
use serde::Serialize;

use super::dense::DenseLayout;
use super::experts::ExpertLayout;
use super::gpu::GpuLayout;
use super::remote::{RemoteDeviceFacts, RemoteLayout};
use crate::format::format_bytes;

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
    /// Left in the file's pages (page cache, reclaimable), faulted in a row at a time: input
    /// tables that each token reads one row of, in streaming plans. Takes no budget.
    Mapped,
    /// Never loaded: MTP layers, which llama.cpp skips unless they draft (then they are `Ram`).
    Unused,
    /// Another machine's device (a ggml RPC worker), loaded once; computed there.
    Remote,
}

/// Which cached (layer, expert) unit the expert cache evicts to make room (expert-stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Segmented LRU: a unit enters a probationary segment and moves to the protected one on
    /// its second use; eviction takes the probationary LRU first, so one-off experts do not
    /// push out the ones in steady use.
    Slru,
}

impl CachePolicy {
    /// The policy for a cache of `cache_units` when a token's picks touch `token_units`
    /// (MoE layers × experts used): LRU below one and a half tokens' picks, SLRU above. On real
    /// routing (a token changes about half its picks) SLRU's protected segment holds experts
    /// the next token no longer picks, and a cache that small then serves a third to a half of
    /// what LRU serves; from about 1.5 tokens' picks up the two agree within a few points, and
    /// SLRU keeps steady experts when one-off picks pass through
    /// (`docs/benchmarks/2026-12-01-routing/`).
    pub fn automatic(cache_units: usize, token_units: usize) -> CachePolicy {
        if 2 * cache_units < 3 * token_units {
            CachePolicy::Lru
        } else {
            CachePolicy::Slru
        }
    }

    pub fn parse(text: &str) -> Option<CachePolicy> {
        match text {
            "lru" => Some(CachePolicy::Lru),
            "slru" => Some(CachePolicy::Slru),
            _ => None,
        }
    }
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
    /// The share of a token's weight bytes those runs computed on the host's CPU (None: all).
    pub compute_host_share: Option<f64>,
    /// Decode time per token of this model resident, measured by an earlier run on this
    /// machine; None if never measured.
    pub resident_seconds_per_token: Option<f64>,
    pub resident_host_share: Option<f64>,
    /// Weight bytes per second this machine's CPU computed in resident runs of other models,
    /// all on the CPU (their median): a model never run here is estimated at it.
    pub cpu_bytes_per_sec: Option<f64>,
    /// `cpu_bytes_per_sec` is MoE models' rate (else dense models').
    pub cpu_rate_of_moe: bool,
    /// Prompt time per token of this model resident over prompts of at least a few dozen
    /// tokens, measured by an earlier run; None if never measured.
    pub prompt_seconds_per_token: Option<f64>,
    /// How soon the router of this model picks an expert again, recorded by earlier streaming
    /// runs (the expert cache's hit rate at any size follows from it); None if never recorded.
    pub expert_reuse: Option<super::reuse::ReuseDepths>,
    /// `disk_bytes_per_sec` is the rate earlier streaming runs of this model read at while
    /// busy, not the profile's.
    pub disk_rate_from_runs: bool,
    /// Bytes earlier streaming runs read for experts ÷ the bytes of the picks an LRU cache of
    /// their size missed (prefetch reads the router did not use, the policy's differences);
    /// None if never measured.
    pub expert_read_factor: Option<f64>,
    /// The rate a GPU's expert pool moved experts at in earlier benchmark runs of this model,
    /// and the host's time at one of its stops beside the transfers; None if never measured
    /// (`plan::gpu` then takes the H200 machine's).
    pub pool_bus_bytes_per_sec: Option<f64>,
    pub pool_stop_host_seconds: Option<f64>,
    /// The device's time at one of those stops, where runs beside the model resident on the
    /// device measured it; None otherwise (`plan::gpu` then takes the H200 machine's).
    pub pool_stop_device_seconds: Option<f64>,
    /// The rate a split pool's CPU took its misses at, as the device waited for them, in
    /// earlier benchmark runs of this model; None if never measured (the CPU's rate is taken).
    pub pool_split_bytes_per_sec: Option<f64>,
    /// The profile's streaming rate, as measured (a run's limit is stated against it, or
    /// against the run's own rate where that was faster).
    pub profile_disk_bytes_per_sec: Option<f64>,
    /// Device memory Hypura may use on dedicated GPUs (weights, KV cache, compute buffers);
    /// 0: no GPU tier.
    pub gpu_budget_bytes: u64,
    /// Device memory the GPU backend takes beyond the buffers the plan counts (kernels loaded
    /// on first use, memory pools), kept free inside the GPU budget.
    pub gpu_runtime_bytes: u64,
    /// Other machines' devices (ggml RPC workers), in the order llama.cpp gets them.
    pub remote_devices: Vec<RemoteDeviceFacts>,
}

impl MachineFacts {
    /// This model's decode time a token resident on the device, where a resident run recorded
    /// it with under 5% of the weights computed on the host: a pooled decode's device term.
    pub fn device_resident_seconds_per_token(&self) -> Option<f64> {
        self.resident_seconds_per_token.filter(|_| self.resident_host_share.is_some_and(|share| share < 0.05))
    }
}

/// What the GPU tier does with routed experts it cannot hold whole (`--gpu-experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuExperts {
    /// Whole layers' experts on the device, the rest computed by the CPU (llama.cpp's way).
    Layers,
    /// The expert pool (decision 29): every pick computed by the device, from its slots, a miss
    /// uploaded first.
    Pool,
    /// The pool split (decision 33): at decode the CPU computes the picks no slot holds, from the
    /// host cache, while the device computes the slots'; an expert earns a slot by its picks.
    Split,
}

impl GpuExperts {
    pub fn name(self) -> &'static str {
        match self {
            GpuExperts::Layers => "layers",
            GpuExperts::Pool => "pool",
            GpuExperts::Split => "split",
        }
    }

    /// Whether the device's expert pool is laid out.
    pub fn pooled(self) -> bool {
        self != GpuExperts::Layers
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    pub mode: ModeChoice,
    /// Context tokens of every sequence together (the KV cache's size).
    pub n_ctx: u32,
    /// Sequences decoded at once: each keeps its own recurrent state in hybrid models.
    pub n_sequences: u32,
    pub n_ubatch: u32,
    /// Streamed layers read ahead of the one computing (dense-stream); None: the cost model
    /// sizes it.
    pub window_layers: Option<usize>,
    /// Expert cache size in (layer, expert) units (expert-stream); None: what the budget holds.
    pub expert_cache_units: Option<usize>,
    /// Stale-gate expert prefetch (expert-stream); None: on.
    pub expert_prefetch: Option<bool>,
    /// The expert cache's policy; None chooses by the cache's size (`CachePolicy::automatic`).
    pub cache_policy: Option<CachePolicy>,
    /// The model's MTP layers draft tokens (speculative decoding): they are loaded, in host
    /// memory, and their bytes come out of the budget first. Otherwise they are unused.
    pub mtp: bool,
    /// With a GPU tier, where the routed experts the device does not hold whole go
    /// (`--gpu-experts`): None predicts each choice for this machine and routing and takes the
    /// fastest (`plan::plan_local`).
    pub gpu_experts: Option<GpuExperts>,
    /// The KV cache's element types.
    pub kv: super::KvTypes,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            mode: ModeChoice::Auto,
            n_ctx: 4096,
            n_sequences: 1,
            n_ubatch: 512,
            window_layers: None,
            expert_cache_units: None,
            expert_prefetch: None,
            cache_policy: None,
            mtp: false,
            gpu_experts: None,
            kv: super::KvTypes::default(),
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

/// Where the host memory budget goes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BudgetUse {
    pub budget_bytes: u64,
    /// Weights loaded once into RAM (everything neither streamed nor on the GPU).
    pub resident_weight_bytes: u64,
    /// Streamed bytes that can be in memory at once (the window, plus the layer computing).
    pub window_bytes: u64,
    pub kv_cache_bytes: u64,
    pub compute_buffer_bytes: u64,
    /// A draft model of speculative decoding: its weights, KV cache and compute buffer
    /// (`plan::choose`), resident beside the target.
    pub draft_bytes: u64,
    /// The model's own MTP layers where they draft, resident in host memory (`plan::plan`).
    pub mtp_bytes: u64,
    pub total_bytes: u64,
}

impl BudgetUse {
    /// Count `bytes` set aside before the rest was planned in what was left: they are part of
    /// the budget and of its use, in the entry `entry` picks.
    pub(super) fn set_aside(&mut self, bytes: u64, entry: impl FnOnce(&mut BudgetUse) -> &mut u64) {
        self.budget_bytes += bytes;
        self.total_bytes += bytes;
        *entry(self) += bytes;
    }
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
    /// The last layers on other machines' devices; None without remote devices, or where
    /// streaming locally alone is predicted faster.
    pub remote: Option<RemoteLayout>,
    /// Why remote devices were given but not used (with both predictions).
    pub remote_unused: Option<String>,
    /// Bytes that must come from disk for every token (the streamed FFN layers).
    pub streamed_bytes_per_token: u64,
    /// Upper bound from the disk alone: bandwidth ÷ streamed bytes per token.
    pub io_bound_tokens_per_sec: Option<f64>,
    /// The physical limit (ARCHITECTURE.md, "The physical limit"), when the compute time has been measured.
    pub limit_tokens_per_sec: Option<f64>,
    /// The predicted decode and prompt speed (`plan::predict`), set by `choose`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<super::predict::Prediction>,
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
    /// `--expert-cache` asked for fewer units than one token picks in a layer, all of which
    /// must be in memory while the layer computes.
    #[error(
        "an expert cache of {units} (layer, expert) units is too small: one token picks {picks} experts in a layer, and all of them must be in memory while it computes; the smallest cache that works is --expert-cache {picks} ({})",
        format_bytes(*smallest_bytes)
    )]
    ExpertCacheTooSmall { units: usize, picks: usize, smallest_bytes: u64 },
    #[error("{mode} mode needs {what}, which this model does not have")]
    ModeUnavailable { mode: &'static str, what: &'static str },
    #[error("the model fits in the budget ({} of {}), but {mode} was forced: nothing would stream", format_bytes(*needed), format_bytes(*budget))]
    NothingToStream { mode: &'static str, needed: u64, budget: u64 },
    /// A context the budget does not hold, with the longest one it would (so that a client can
    /// ask for that).
    #[error("{reason}; a context of {n_ctx_seq} tokens for {n_sequences} sequence(s) does not fit: at most {fits} tokens would")]
    ContextTooLong { reason: Box<PlanError>, n_ctx_seq: u32, n_sequences: u32, fits: u64 },
    #[error("{reason}; even without a KV cache it needs {}", format_bytes(*needed))]
    TooSmallWithoutContext { reason: Box<PlanError>, needed: u64 },
    /// The refusal at the smallest prompt batch a budget was tried with.
    #[error("{reason} (with prompt batches shrunk to {n_batch} tokens)")]
    BatchShrunk { reason: Box<PlanError>, n_batch: u32 },
    #[error("the draft model {} needs {} (weights, KV cache and compute buffer), more than the budget of {}", model.display(), format_bytes(*needed), format_bytes(*budget))]
    DraftTooLarge { model: std::path::PathBuf, needed: u64, budget: u64 },
    #[error("no remote device holds one layer with its KV cache and compute buffer")]
    NoRemoteRoom,
    #[error("the host cannot hold the layers before {remote}: {reason}")]
    HostBeforeRemote { remote: String, reason: Box<PlanError> },
}

impl Plan {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::*;
    use crate::plan::{compute_buffer_bytes, kv_cache_bytes, plan};

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
        let host_fixed = (64 << 20)
            + compute_buffer_bytes(&inventory, 1024, 256)
            + kv_cache_bytes(&inventory, 1024, Default::default());
        let streamed =
            plan(&inventory, &with_gpu(host_fixed + 4 * (96 << 20), 0), &options(ModeChoice::Auto, 1)).unwrap();
        assert_eq!(streamed.mode, Mode::DenseStream, "{}", streamed.render());
        let (size, vram) = streamed.memory_use(kv);
        assert_eq!(size, streamed.budget.resident_weight_bytes + streamed.budget.window_bytes + kv);
        assert!(size < inventory.tensor_data_bytes());
        assert_eq!(vram, 0);
    }
}
