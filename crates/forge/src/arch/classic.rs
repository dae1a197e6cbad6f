//! The classic layouts: `llama` (dense, or Mixtral-style experts), `qwen3` and `qwen3moe`
//! (the same with per-head q/k norms). Their presets live in `spec.rs`.
use super::{block, Definition, Meta, Tensors};
use crate::spec::{Arch, ForgeSpec};

pub(super) const LLAMA: Definition = Definition { arch: Arch::Llama, presets: Vec::new, metadata, tensors };
pub(super) const QWEN3: Definition = Definition { arch: Arch::Qwen3, presets: Vec::new, metadata, tensors };
pub(super) const QWEN3MOE: Definition = Definition { arch: Arch::Qwen3Moe, presets: Vec::new, metadata, tensors };

/// The common keys are all these layouts read.
fn metadata(_: &ForgeSpec, _: &mut Meta) {}

fn tensors(tensors: &mut Tensors) {
    let spec = tensors.spec;
    let shape = spec.shape.clone();
    tensors.token_embedding();
    for layer in 0..shape.n_layer {
        tensors.norm(block(layer, "attn_norm.weight"), &[shape.n_embd]);
        tensors.attention(layer);
        if spec.arch.has_qk_norm() {
            tensors.norm(block(layer, "attn_q_norm.weight"), &[shape.head_dim]);
            tensors.norm(block(layer, "attn_k_norm.weight"), &[shape.head_dim]);
        }
        tensors.norm(block(layer, "ffn_norm.weight"), &[shape.n_embd]);
        if spec.is_moe() {
            tensors.routed_experts(layer);
        } else {
            tensors.ffn(layer, "", shape.n_ff);
        }
    }
    tensors.output();
}
