//! Fixtures the planner's unit tests share: a llama-like inventory, plan options, and machines
//! with a queue-hungry disk or a GPU budget.
use hypura_gguf::GgmlType;

use super::types::{MachineFacts, ModeChoice, PlanOptions};
use crate::model::{Hparams, Inventory, Role, TensorEntry};

/// A llama-like inventory: per layer one attention tensor and three FFN tensors.
pub(super) fn inventory(n_layer: u64, attention_bytes: u64, ffn_bytes: u64, embedding_bytes: u64) -> Inventory {
    let mut tensors = Vec::new();
    let mut offset = 0;
    let mut add = |name: String, role: Role, layer: Option<u32>, bytes: u64| {
        tensors.push(TensorEntry {
            name,
            role,
            layer,
            ggml_type: GgmlType::Q4_K,
            dims: vec![256, bytes / 144],
            bytes,
            split: 0,
            file_offset: offset,
            experts: None,
        });
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
            n_layer_mtp: 0,
            n_layer_kv: n_layer,
            kv_row_elements: 4 * 256,
            recurrent_state_bytes: 0,
        },
        tensors,
        file_bytes: offset + 4096,
    }
}

/// An MoE inventory: per layer one attention tensor and gate/up/down expert tensors of
/// `n_expert` slices of `slice_bytes`, `n_expert_used` picked per token.
pub(crate) fn moe_inventory(n_layer: u64, n_expert: u64, n_expert_used: u64, slice_bytes: u64) -> Inventory {
    let mut inventory = inventory(n_layer, 1 << 20, 0, 8 << 20);
    inventory.tensors.retain(|tensor| !tensor.role.is_dense_ffn());
    let mut offset = inventory.file_bytes;
    for layer in 0..n_layer as u32 {
        for (suffix, role) in
            [("ffn_gate_exps", Role::ExpertGate), ("ffn_up_exps", Role::ExpertUp), ("ffn_down_exps", Role::ExpertDown)]
        {
            let bytes = n_expert * slice_bytes;
            let experts = Some(crate::model::ExpertSlices { n_expert, slice_bytes });
            inventory.tensors.push(TensorEntry {
                name: format!("blk.{layer}.{suffix}.weight"),
                role,
                layer: Some(layer),
                ggml_type: GgmlType::Q4_K,
                dims: vec![256, slice_bytes / 144, n_expert],
                bytes,
                split: 0,
                file_offset: offset,
                experts,
            });
            offset += bytes;
        }
    }
    inventory.file_bytes = offset;
    inventory.hparams = Hparams { n_expert, n_expert_used, n_ff_expert: 768, n_ff: 0, ..inventory.hparams };
    inventory
}

/// DeepSeek's layout: `n_dense` leading layers with a dense FFN of 3 × `ffn_bytes`, then MoE
/// layers as `moe_inventory` makes them.
pub(super) fn mixed_inventory(
    n_dense: u64,
    n_layer: u64,
    ffn_bytes: u64,
    n_expert: u64,
    n_expert_used: u64,
    slice_bytes: u64,
) -> Inventory {
    let dense = inventory(n_layer, 1 << 20, ffn_bytes, 8 << 20);
    let mut mixed = moe_inventory(n_layer, n_expert, n_expert_used, slice_bytes);
    mixed
        .tensors
        .retain(|tensor| !tensor.layer.is_some_and(|layer| u64::from(layer) < n_dense && tensor.experts.is_some()));
    let mut offset = mixed.file_bytes;
    for tensor in dense
        .tensors
        .into_iter()
        .filter(|tensor| tensor.role.is_dense_ffn() && tensor.layer.is_some_and(|layer| u64::from(layer) < n_dense))
    {
        mixed.tensors.push(TensorEntry { file_offset: offset, ..tensor });
        offset += ffn_bytes;
    }
    mixed.file_bytes = offset;
    mixed.hparams.n_ff = 4096;
    mixed
}

pub(super) fn options(mode: ModeChoice, window_layers: usize) -> PlanOptions {
    PlanOptions { mode, n_ctx: 1024, n_ubatch: 256, window_layers: Some(window_layers), ..PlanOptions::default() }
}

pub(super) fn auto_window(mode: ModeChoice) -> PlanOptions {
    PlanOptions { mode, n_ctx: 1024, n_ubatch: 256, window_layers: None, ..PlanOptions::default() }
}

/// A disk that needs 64 MiB in flight for its full rate, a third of it with 4 MiB.
pub(super) fn queue_hungry_disk() -> Vec<(u64, f64)> {
    vec![(4 << 20, 0.6e9), (16 << 20, 1.2e9), (64 << 20, 2e9)]
}

/// A machine with `host` bytes of memory and a GPU budget of `gpu` bytes.
pub(super) fn with_gpu(host: u64, gpu: u64) -> MachineFacts {
    MachineFacts {
        memory_budget_bytes: host,
        disk_bytes_per_sec: Some(2e9),
        gpu_budget_bytes: gpu,
        ..MachineFacts::default()
    }
}
