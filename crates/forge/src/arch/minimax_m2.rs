//! `minimax-m2` (`src/models/minimax-m2.cpp`): MiniMax-M2's layout. Every layer is MoE (no
//! dense layers, no shared expert) behind full attention (no sliding window, no linear
//! attention), with RMS q/k norms over the whole q and k projections (not per head), partial
//! RoPE (half of each head), sigmoid routing with a selection bias (`exp_probs_b`) and
//! normalized top-k weights. Real GGUFs carry no MTP layers (the converter drops them, and
//! llama.cpp loads none).
use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::MinimaxM2, presets, metadata, tensors };

/// `LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID`: MiniMax-M2's `scoring_func`. Without the key the
/// gating function is NONE and build_moe_ffn aborts.
const GATING_SIGMOID: u64 = 2;

fn presets() -> Vec<(&'static str, Shape)> {
    // MiniMax-M2 has 62 layers of width 3072, 48 query heads and 8 KV heads of 128 (RoPE on
    // 64), 256 experts of width 1536, top-8. The tiny one keeps the ratios: q width twice the
    // hidden width, expert width a whole number of 256-blocks (as 1536 is), 16 experts top-4.
    vec![("tiny-minimax-m2", Shape { rope_freq_base: 5_000_000.0, ..moe(4, 256, 8, 2, 64, 256, 16, 4) })]
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    meta.u32("expert_gating_func", GATING_SIGMOID);
    // `rotary_dim`: RoPE on the first half of each head.
    meta.u32("rope.dimension_count", spec.shape.head_dim / 2);
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let q_width = shape.n_head * shape.head_dim;
    let kv_width = shape.n_head_kv * shape.head_dim;
    tensors.token_embedding();
    for layer in 0..shape.n_layer {
        tensors.norm(block(layer, "attn_norm.weight"), &[shape.n_embd]);
        tensors.attention(layer);
        tensors.norm(block(layer, "attn_q_norm.weight"), &[q_width]);
        tensors.norm(block(layer, "attn_k_norm.weight"), &[kv_width]);
        tensors.norm(block(layer, "ffn_norm.weight"), &[shape.n_embd]);
        tensors.routed_experts(layer);
        // The selection bias (`e_score_correction_bias`), added to the sigmoid scores for top-k
        // only.
        tensors.uniform(block(layer, "exp_probs_b.bias"), &[shape.n_expert], -0.05, 0.05);
    }
    tensors.output();
}
