//! The placement planner: `(inventory, machine facts, options) -> Plan`. Pure: no I/O, no ggml.
//!
//! It decides the mode (resident, dense-stream, expert-stream), the tier of every tensor, the
//! dense layout (which FFN layers are pinned in RAM, which stream through a window of `D`
//! layers), and checks that weights + window + KV cache + compute buffers fit the budget. For a
//! cyclic sweep over layers, LRU caching gets nothing; a fixed pinned set gets exactly its share,
//! so the planner pins a fixed set and streams the rest.
use std::fmt::Write as _;

use serde::Serialize;

use crate::hw::format::format_bytes;
use crate::model::{Inventory, TensorEntry};

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
    /// Host memory, loaded once.
    Ram,
    /// Read from disk on demand through the stream window.
    Stream,
}

/// Facts about the machine the planner needs (from `hw`, resolved by the caller).
#[derive(Clone, Debug, PartialEq)]
pub struct MachineFacts {
    /// Memory Hypura may use in total (weights, KV cache, compute buffers).
    pub memory_budget_bytes: u64,
    /// Direct-read bandwidth of the model's volume; None if not measured.
    pub disk_bytes_per_sec: Option<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    pub mode: ModeChoice,
    pub n_ctx: u32,
    pub n_ubatch: u32,
    /// Streamed layers prefetched ahead of the one computing (dense-stream).
    pub window_layers: usize,
    /// Expert cache size in (layer, expert) units (expert-stream); None: what the budget holds.
    pub expert_cache_units: Option<usize>,
    pub cache_policy: crate::store::CachePolicy,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            mode: ModeChoice::Auto,
            n_ctx: 4096,
            n_ubatch: 512,
            window_layers: 2,
            expert_cache_units: None,
            cache_policy: crate::store::CachePolicy::Slru,
        }
    }
}

/// The expert-stream layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertLayout {
    pub n_expert: u64,
    pub n_expert_used: u64,
    /// Bytes of one (layer, expert) unit: its gate, up and down slices (largest layer).
    pub unit_bytes: u64,
    /// How many units the expert cache holds.
    pub cache_units: usize,
    pub policy: crate::store::CachePolicy,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorPlacement {
    pub name: String,
    pub tier: Tier,
    pub bytes: u64,
    pub why: &'static str,
}

/// The dense-stream layout.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DenseLayout {
    pub streamed_layers: Vec<u32>,
    pub pinned_layers: Vec<u32>,
    pub window_layers: usize,
}

/// Where the budget goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BudgetUse {
    pub budget_bytes: u64,
    /// Weights loaded once into RAM (everything not streamed).
    pub resident_weight_bytes: u64,
    /// Streamed bytes that can be in memory at once (the window, plus the layer computing).
    pub window_bytes: u64,
    pub kv_cache_bytes: u64,
    pub compute_buffer_bytes: u64,
    pub total_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub mode: Mode,
    pub budget: BudgetUse,
    pub tensors: Vec<TensorPlacement>,
    pub dense: Option<DenseLayout>,
    pub experts: Option<ExpertLayout>,
    /// Bytes that must come from disk for every token (the streamed FFN layers).
    pub streamed_bytes_per_token: u64,
    /// Upper bound from the disk alone: bandwidth ÷ streamed bytes per token.
    pub io_bound_tokens_per_sec: Option<f64>,
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
    #[error("{mode} mode needs {what}, which this model does not have")]
    ModeUnavailable { mode: &'static str, what: &'static str },
    #[error("the model fits in the budget ({} of {}), but {mode} was forced: nothing would stream", format_bytes(*needed), format_bytes(*budget))]
    NothingToStream { mode: &'static str, needed: u64, budget: u64 },
}

/// KV cache bytes at f16 for `n_ctx` tokens (an upper bound for sliding-window models).
pub fn kv_cache_bytes(inventory: &Inventory, n_ctx: u32) -> u64 {
    let hparams = &inventory.hparams;
    hparams.n_layer * u64::from(n_ctx) * hparams.n_head_kv * (hparams.head_dim_k + hparams.head_dim_v) * 2
}

/// llama.cpp's CPU compute buffer, estimated: logits and activations for one ubatch, plus
/// attention scores. Deliberately generous: an underestimate would break the budget.
pub fn compute_buffer_bytes(inventory: &Inventory, n_ctx: u32, n_ubatch: u32) -> u64 {
    let hparams = &inventory.hparams;
    let ff = hparams.n_ff.max(hparams.n_ff_expert * hparams.n_expert_used.max(1));
    let per_token = hparams.n_vocab + 4 * hparams.n_embd + 2 * ff + hparams.n_head * u64::from(n_ctx);
    4 * u64::from(n_ubatch) * per_token + (64 << 20)
}

/// Tensors the dense-stream mode may stream: dense FFN weights and routed experts.
fn is_streamable(tensor: &TensorEntry) -> bool {
    tensor.layer.is_some() && (tensor.role.is_dense_ffn() || tensor.role.is_expert())
}

/// Per-layer bytes of streamable tensors.
fn ffn_bytes_by_layer(inventory: &Inventory) -> Vec<u64> {
    let mut bytes = vec![0; inventory.hparams.n_layer as usize];
    for tensor in inventory.tensors.iter().filter(|tensor| is_streamable(tensor)) {
        bytes[tensor.layer.expect("streamable tensors have a layer") as usize] += tensor.bytes;
    }
    bytes
}

/// `count` of `total` indices spread evenly (so streaming I/O overlaps pinned layers' compute).
fn spread(count: usize, total: usize) -> Vec<usize> {
    (0..count).map(|index| (index * total + total / 2) / count.max(1)).map(|index| index.min(total - 1)).collect()
}

pub fn plan(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions) -> Result<Plan, PlanError> {
    let weights: u64 = inventory.tensor_data_bytes();
    let kv = kv_cache_bytes(inventory, options.n_ctx);
    let compute = compute_buffer_bytes(inventory, options.n_ctx, options.n_ubatch);
    let budget = machine.memory_budget_bytes;
    let everything = weights + kv + compute;
    let has_experts = inventory.expert_tensors().next().is_some();
    let mode = match options.mode {
        ModeChoice::Forced(mode) => mode,
        ModeChoice::Auto if everything <= budget => Mode::Resident,
        ModeChoice::Auto if has_experts => Mode::ExpertStream,
        ModeChoice::Auto => Mode::DenseStream,
    };
    if mode == Mode::ExpertStream {
        return plan_experts(inventory, machine, options, kv, compute);
    }
    if mode == Mode::Resident {
        let tensors = inventory
            .tensors
            .iter()
            .map(|tensor| TensorPlacement { name: tensor.name.clone(), tier: Tier::Ram, bytes: tensor.bytes, why: "the whole model fits" })
            .collect();
        return Ok(Plan {
            mode,
            budget: BudgetUse {
                budget_bytes: budget,
                resident_weight_bytes: weights,
                window_bytes: 0,
                kv_cache_bytes: kv,
                compute_buffer_bytes: compute,
                total_bytes: everything,
            },
            tensors,
            dense: None,
            experts: None,
            streamed_bytes_per_token: 0,
            io_bound_tokens_per_sec: None,
        });
    }

    let layer_ffn = ffn_bytes_by_layer(inventory);
    let n_layer = layer_ffn.len();
    if layer_ffn.iter().all(|&bytes| bytes == 0) {
        return Err(PlanError::ModeUnavailable { mode: "dense-stream", what: "FFN tensors in layers" });
    }
    let streamable_total: u64 = layer_ffn.iter().sum();
    let fixed_weights = weights - streamable_total;
    let window_layers = options.window_layers.clamp(1, n_layer);
    // The window holds D prefetched layers plus the one computing.
    let largest = layer_ffn.iter().copied().max().unwrap_or(0);
    let window_bytes = largest * (window_layers as u64 + 1).min(n_layer as u64);
    let needed = fixed_weights + window_bytes + kv + compute;
    if needed > budget {
        return Err(PlanError::BudgetTooSmall {
            budget,
            needed,
            resident: fixed_weights,
            window: window_bytes,
            layers: window_layers,
            kv,
            compute,
        });
    }
    // Pin as many layers as the rest of the budget holds (largest-first would favour few big
    // layers; layers are nearly equal, so count by the largest to stay safe).
    let spare = budget - needed;
    let mut pinned_count = if largest == 0 { n_layer } else { (spare / largest) as usize };
    if options.mode == ModeChoice::Forced(Mode::DenseStream) && pinned_count >= n_layer {
        if everything <= budget {
            // Forced streaming of a model that fits: keep streaming the layers the window
            // cannot hold, so the mode is exercised (tests, benchmarks), but pin the rest.
            pinned_count = n_layer.saturating_sub(window_layers + 1);
        } else {
            pinned_count = n_layer - 1;
        }
    }
    let pinned_count = pinned_count.min(n_layer);
    let streamed_count = n_layer - pinned_count;
    let streamed_set = spread(streamed_count, n_layer);
    let streamed_layers: Vec<u32> = (0..n_layer as u32).filter(|layer| streamed_set.contains(&(*layer as usize))).collect();
    let pinned_layers: Vec<u32> = (0..n_layer as u32).filter(|layer| !streamed_set.contains(&(*layer as usize))).collect();
    let streamed_bytes_per_token: u64 = streamed_layers.iter().map(|&layer| layer_ffn[layer as usize]).sum();
    let tensors = inventory
        .tensors
        .iter()
        .map(|tensor| {
            let streamed = is_streamable(tensor) && streamed_layers.contains(&tensor.layer.expect("streamable tensors have a layer"));
            let (tier, why) = match (streamed, is_streamable(tensor)) {
                (true, _) => (Tier::Stream, "FFN of a streamed layer: read through the window each token"),
                (false, true) => (Tier::Ram, "FFN of a pinned layer: the budget holds it"),
                (false, false) => (Tier::Ram, "touched by every token and small: always resident"),
            };
            TensorPlacement { name: tensor.name.clone(), tier, bytes: tensor.bytes, why }
        })
        .collect();
    let resident_weight_bytes = weights - streamed_bytes_per_token;
    let window_bytes = if streamed_layers.is_empty() { 0 } else { largest * (window_layers as u64 + 1).min(streamed_layers.len() as u64) };
    Ok(Plan {
        mode,
        budget: BudgetUse {
            budget_bytes: budget,
            resident_weight_bytes,
            window_bytes,
            kv_cache_bytes: kv,
            compute_buffer_bytes: compute,
            total_bytes: resident_weight_bytes + window_bytes + kv + compute,
        },
        tensors,
        dense: Some(DenseLayout { streamed_layers, pinned_layers, window_layers }),
        experts: None,
        streamed_bytes_per_token,
        io_bound_tokens_per_sec: machine
            .disk_bytes_per_sec
            .filter(|_| streamed_bytes_per_token > 0)
            .map(|bandwidth| bandwidth / streamed_bytes_per_token as f64),
    })
}

/// Expert-stream: every routed expert tensor streams by expert; the rest is resident, and what
/// the budget leaves is the expert cache.
fn plan_experts(inventory: &Inventory, machine: &MachineFacts, options: &PlanOptions, kv: u64, compute: u64) -> Result<Plan, PlanError> {
    let hparams = &inventory.hparams;
    let n_expert = hparams.n_expert;
    if n_expert == 0 || inventory.expert_tensors().next().is_none() {
        return Err(PlanError::ModeUnavailable { mode: "expert-stream", what: "routed expert tensors" });
    }
    let mut unit_bytes_by_layer = vec![0u64; hparams.n_layer as usize];
    for tensor in inventory.expert_tensors() {
        let slices = tensor.experts.expect("expert tensors have slices");
        unit_bytes_by_layer[tensor.layer.expect("experts have a layer") as usize] += slices.slice_bytes;
    }
    let unit_bytes = unit_bytes_by_layer.iter().copied().max().unwrap_or(0);
    let moe_layers = unit_bytes_by_layer.iter().filter(|&&bytes| bytes > 0).count() as u64;
    let expert_bytes: u64 = inventory.expert_tensors().map(|tensor| tensor.bytes).sum();
    let fixed = inventory.tensor_data_bytes() - expert_bytes;
    let budget = machine.memory_budget_bytes;
    // The cache must hold one layer's every expert: a prefill batch may pick them all.
    let minimum_units = n_expert as usize;
    let needed = fixed + kv + compute + minimum_units as u64 * unit_bytes;
    if needed > budget {
        return Err(PlanError::BudgetTooSmall {
            budget,
            needed,
            resident: fixed,
            window: minimum_units as u64 * unit_bytes,
            layers: 1,
            kv,
            compute,
        });
    }
    let affordable = ((budget - fixed - kv - compute) / unit_bytes.max(1)) as usize;
    let total_units = (moe_layers * n_expert) as usize;
    let cache_units = options.expert_cache_units.map_or(affordable, |units| units.min(affordable)).clamp(minimum_units, total_units.max(minimum_units));
    let tensors = inventory
        .tensors
        .iter()
        .map(|tensor| {
            let (tier, why) = if tensor.experts.is_some() {
                (Tier::Stream, "routed experts: only the router's picks are read, through the expert cache")
            } else {
                (Tier::Ram, "touched by every token and small: always resident")
            };
            TensorPlacement { name: tensor.name.clone(), tier, bytes: tensor.bytes, why }
        })
        .collect();
    let worst_case = moe_layers * hparams.n_expert_used.max(1) * unit_bytes;
    let cache_bytes = cache_units as u64 * unit_bytes;
    Ok(Plan {
        mode: Mode::ExpertStream,
        budget: BudgetUse {
            budget_bytes: budget,
            resident_weight_bytes: fixed,
            window_bytes: cache_bytes,
            kv_cache_bytes: kv,
            compute_buffer_bytes: compute,
            total_bytes: fixed + cache_bytes + kv + compute,
        },
        tensors,
        dense: None,
        experts: Some(ExpertLayout { n_expert, n_expert_used: hparams.n_expert_used, unit_bytes, cache_units, policy: options.cache_policy }),
        streamed_bytes_per_token: worst_case,
        io_bound_tokens_per_sec: machine.disk_bytes_per_sec.filter(|_| worst_case > 0).map(|bandwidth| bandwidth / worst_case as f64),
    })
}

impl Plan {
    pub fn streamed_tensors(&self) -> impl Iterator<Item = &TensorPlacement> {
        self.tensors.iter().filter(|tensor| tensor.tier == Tier::Stream)
    }

    /// The human explanation `inspect` prints.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let budget = &self.budget;
        let _ = writeln!(out, "plan         mode {}", self.mode.name());
        let _ = writeln!(
            out,
            "memory       {} of a {} budget: {} resident weights + {} stream window + {} KV cache + {} compute buffers",
            format_bytes(budget.total_bytes),
            format_bytes(budget.budget_bytes),
            format_bytes(budget.resident_weight_bytes),
            format_bytes(budget.window_bytes),
            format_bytes(budget.kv_cache_bytes),
            format_bytes(budget.compute_buffer_bytes)
        );
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
            let _ = writeln!(out, "per token    at most {} read from disk (every pick a miss)", format_bytes(self.streamed_bytes_per_token));
            if let Some(bound) = self.io_bound_tokens_per_sec {
                let _ = writeln!(out, "bound        at least {bound:.2} tok/s from disk bandwidth alone, before cache hits");
            }
        }
        if let Some(dense) = &self.dense {
            let _ = writeln!(
                out,
                "dense        {} FFN layers pinned in RAM {:?}; {} streamed {:?} through a window of {} layers",
                dense.pinned_layers.len(),
                dense.pinned_layers,
                dense.streamed_layers.len(),
                dense.streamed_layers,
                dense.window_layers
            );
            let _ = writeln!(out, "per token    {} read from disk", format_bytes(self.streamed_bytes_per_token));
            if let Some(bound) = self.io_bound_tokens_per_sec {
                let _ = writeln!(out, "bound        at most {bound:.2} tok/s from disk bandwidth alone");
            }
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
            let _ = writeln!(out, "  {:<6} {:>4} tensors {:>12}  {why}", format!("{tier:?}").to_lowercase(), count, format_bytes(bytes));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Hparams, Inventory, Role, TensorEntry};
    use hypura_gguf::GgmlType;
    use proptest::prelude::*;

    /// A llama-like inventory: per layer one attention tensor and three FFN tensors.
    fn inventory(n_layer: u64, attention_bytes: u64, ffn_bytes: u64, embedding_bytes: u64) -> Inventory {
        let mut tensors = Vec::new();
        let mut offset = 0;
        let mut add = |name: String, role: Role, layer: Option<u32>, bytes: u64| {
            tensors.push(TensorEntry { name, role, layer, ggml_type: GgmlType::Q4_K, dims: vec![256, bytes / 144], bytes, split: 0, file_offset: offset, experts: None });
            offset += bytes;
        };
        add("token_embd.weight".into(), Role::TokenEmbedding, None, embedding_bytes);
        for layer in 0..n_layer as u32 {
            add(format!("blk.{layer}.attn_q.weight"), Role::AttentionQ, Some(layer), attention_bytes);
            for (suffix, role) in [("ffn_gate", Role::FfnGate), ("ffn_up", Role::FfnUp), ("ffn_down", Role::FfnDown)] {
                add(format!("blk.{layer}.{suffix}.weight"), role, Some(layer), ffn_bytes);
            }
        }
        Inventory {
            path: "test.gguf".into(),
            split_paths: vec!["test.gguf".into()],
            arch: "llama".into(),
            name: None,
            hparams: Hparams {
                n_layer,
                n_embd: 2048,
                n_head: 16,
                n_head_kv: 4,
                head_dim_k: 128,
                head_dim_v: 128,
                n_ctx_train: 4096,
                n_ff: 5632,
                n_expert: 0,
                n_expert_used: 0,
                n_ff_expert: 0,
                n_vocab: 32000,
            },
            tensors,
            file_bytes: offset + 4096,
        }
    }

    fn options(mode: ModeChoice, window_layers: usize) -> PlanOptions {
        PlanOptions { mode, n_ctx: 1024, n_ubatch: 256, window_layers, ..PlanOptions::default() }
    }

    #[test]
    fn a_model_that_fits_is_resident() {
        let inventory = inventory(8, 1 << 20, 4 << 20, 8 << 20);
        let plan = plan(&inventory, &MachineFacts { memory_budget_bytes: 8 << 30, disk_bytes_per_sec: None }, &options(ModeChoice::Auto, 2)).unwrap();
        assert_eq!(plan.mode, Mode::Resident);
        assert!(plan.tensors.iter().all(|tensor| tensor.tier == Tier::Ram));
        assert_eq!(plan.streamed_bytes_per_token, 0);
    }

    #[test]
    fn a_budget_below_the_fixed_part_is_refused_with_the_numbers() {
        let inventory = inventory(8, 64 << 20, 64 << 20, 256 << 20);
        let error = plan(&inventory, &MachineFacts { memory_budget_bytes: 300 << 20, disk_bytes_per_sec: None }, &options(ModeChoice::Auto, 2)).unwrap_err();
        match &error {
            PlanError::BudgetTooSmall { budget, needed, resident, layers, .. } => {
                assert_eq!(*budget, 300 << 20);
                assert!(needed > budget);
                assert_eq!(*resident, (256 << 20) + 8 * (64 << 20));
                assert_eq!(*layers, 2);
            }
            other => panic!("{other:?}"),
        }
        let message = error.to_string();
        assert!(message.contains("300.0 MiB") && message.contains("768.0 MiB resident weights"), "{message}");
    }

    #[test]
    fn the_io_bound_follows_from_streamed_bytes() {
        let inventory = inventory(10, 16 << 20, 32 << 20, 64 << 20);
        let fixed = (64 << 20) + 10 * (16 << 20) + kv_cache_bytes(&inventory, 1024) + compute_buffer_bytes(&inventory, 1024, 256);
        // Room for the window (3 layers of 96 MiB) and 2 pinned layers.
        let budget = fixed + 5 * (96 << 20);
        let plan = plan(&inventory, &MachineFacts { memory_budget_bytes: budget, disk_bytes_per_sec: Some(2e9) }, &options(ModeChoice::Auto, 2)).unwrap();
        let dense = plan.dense.as_ref().unwrap();
        assert_eq!(dense.pinned_layers.len(), 2);
        assert_eq!(dense.streamed_layers.len(), 8);
        assert_eq!(plan.streamed_bytes_per_token, 8 * (96 << 20));
        let bound = plan.io_bound_tokens_per_sec.unwrap();
        assert!((bound - 2e9 / (8.0 * (96u64 << 20) as f64)).abs() < 1e-9);
    }

    proptest! {
        /// No plan exceeds its budget, and every tensor has exactly one tier.
        #[test]
        fn plans_respect_the_budget_and_place_every_tensor(
            n_layer in 1u64..48,
            attention in 1u64..64,
            ffn in 1u64..256,
            embedding in 1u64..512,
            budget_mib in 1u64..40_000,
            window in 1usize..6,
            forced in any::<bool>(),
        ) {
            let inventory = inventory(n_layer, attention << 20, ffn << 20, embedding << 20);
            let machine = MachineFacts { memory_budget_bytes: budget_mib << 20, disk_bytes_per_sec: Some(1e9) };
            let mode = if forced { ModeChoice::Forced(Mode::DenseStream) } else { ModeChoice::Auto };
            match plan(&inventory, &machine, &options(mode, window)) {
                Ok(plan) => {
                    prop_assert!(plan.budget.total_bytes <= plan.budget.budget_bytes, "{:?}", plan.budget);
                    prop_assert_eq!(plan.tensors.len(), inventory.tensors.len());
                    for (placement, tensor) in plan.tensors.iter().zip(&inventory.tensors) {
                        prop_assert_eq!(&placement.name, &tensor.name);
                    }
                    let streamed: u64 = plan.streamed_tensors().map(|tensor| tensor.bytes).sum();
                    prop_assert_eq!(streamed, plan.streamed_bytes_per_token);
                    prop_assert_eq!(plan.budget.resident_weight_bytes + streamed, inventory.tensor_data_bytes());
                    if let Some(dense) = &plan.dense {
                        prop_assert_eq!(dense.pinned_layers.len() + dense.streamed_layers.len(), n_layer as usize);
                        prop_assert!(plan.streamed_tensors().all(|tensor| inventory.tensors.iter().any(|entry| entry.name == tensor.name && entry.role.is_dense_ffn())));
                    }
                }
                Err(PlanError::BudgetTooSmall { needed, budget, .. }) => prop_assert!(needed > budget),
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
        }
    }
}
