//! `gemma4`: Gemma 4 in its MoE configuration (Gemma 4 26B-A4B), as llama.cpp's
//! `src/models/gemma4.cpp` loads it.
//!
//! Every layer has both a dense GeGLU FFN (`ffn_{gate,up,down}`, llama.cpp's "shared expert")
//! and routed experts with merged `ffn_gate_up_exps`, each branch with its own pre and post
//! norms; the router reads its own RMS-normed copy of the attention output, scaled per channel
//! by `ffn_gate_inp.scale`, and each expert's output is scaled by `ffn_down_exps.scale`.
//! Attention alternates five sliding-window layers with one full-attention layer; the full
//! layers have wider heads, fewer KV heads, no `attn_v` (V is K, `attention_k_eq_v`) and a
//! proportional RoPE whose frequency factors are the one global `rope_freqs.weight`. Every
//! layer ends with a scalar `layer_output_scale`. The output is tied to `token_embd`. The MoE
//! model has no per-layer embeddings (`embedding_length_per_layer_input` = 0) and no shared KV
//! layers; those belong to the small E2B/E4B models.
use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, Shape};
use hypura_gguf::GgmlType;

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Gemma4, presets, metadata, tensors };

/// Attention layers per full-attention layer: five sliding, then one full.
const PATTERN: u64 = 6;
/// Sliding-window width of the sliding layers (Gemma 4 26B-A4B).
const SLIDING_WINDOW: u64 = 1024;
/// `final_logit_softcapping`.
const SOFTCAP: f32 = 30.0;
/// RoPE base of the sliding layers (the full layers use the shape's).
const ROPE_BASE_SWA: f32 = 10_000.0;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // Gemma 4 26B-A4B reduced: 6 layers (five sliding, one full), every layer a dense GeGLU
        // FFN of 384 beside 16 experts of 128, top-4.
        ("tiny-gemma4", Shape { n_ff_dense: 384, n_ctx_train: 4096, ..moe(6, 256, 4, 2, 64, 128, 16, 4) }),
    ]
}

/// Layer `layer` is a full-attention layer (the last of each group of six).
fn is_full(layer: u64) -> bool {
    layer % PATTERN == PATTERN - 1
}

/// Per-head width of a layer: the shape's for sliding layers, twice that for full ones
/// (256 and 512 in the 26B model).
fn head_dim(shape: &Shape, layer: u64) -> u64 {
    if is_full(layer) {
        2 * shape.head_dim
    } else {
        shape.head_dim
    }
}

/// KV heads of a layer: the shape's for sliding layers, a quarter of that for full ones (8 and
/// 2 in the 26B model).
fn head_count_kv(shape: &Shape, layer: u64) -> u64 {
    if is_full(layer) {
        (shape.n_head_kv / 4).max(1)
    } else {
        shape.n_head_kv
    }
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    let full_head = 2 * shape.head_dim;
    meta.u32_array("attention.head_count_kv", (0..shape.n_layer).map(|layer| head_count_kv(shape, layer)));
    // The common keys describe the full-attention layers; the `_swa` keys the sliding ones.
    meta.u32("attention.key_length", full_head);
    meta.u32("attention.value_length", full_head);
    meta.u32("attention.key_length_swa", shape.head_dim);
    meta.u32("attention.value_length_swa", shape.head_dim);
    meta.u32("rope.dimension_count", full_head);
    meta.u32("rope.dimension_count_swa", shape.head_dim);
    meta.f32("rope.freq_base_swa", ROPE_BASE_SWA);
    meta.u32("attention.sliding_window", SLIDING_WINDOW);
    meta.bool_array("attention.sliding_window_pattern", (0..shape.n_layer).map(|layer| !is_full(layer)));
    meta.u32("attention.shared_kv_layers", 0);
    meta.u32("embedding_length_per_layer_input", 0);
    meta.f32("final_logit_softcapping", SOFTCAP);
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let n_embd = shape.n_embd;
    // Tied output: llama.cpp's Q4_K_M gives the embedding the output's Q6_K.
    let embd_type = tensors.quant(GgmlType::Q6_K, false, n_embd);
    tensors.add("token_embd.weight", &[n_embd, tensors.n_vocab], embd_type, Init::Embedding);
    // Proportional RoPE of the full layers: one tensor, shared by all of them.
    // llama.cpp divides each pair's frequency by its factor (the real model: 1 for the rotated
    // quarter, 1e30 for the rest); its width is half the full-attention head.
    tensors.uniform("rope_freqs.weight", &[head_dim(&shape, PATTERN - 1) / 2], 1.0, 2.0);
    for layer in 0..shape.n_layer {
        let head = head_dim(&shape, layer);
        let q_width = shape.n_head * head;
        let kv_width = head_count_kv(&shape, layer) * head;
        tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
        tensors.weight(block(layer, "attn_q.weight"), &[n_embd, q_width]);
        tensors.weight(block(layer, "attn_k.weight"), &[n_embd, kv_width]);
        if !is_full(layer) {
            tensors.value(layer, block(layer, "attn_v.weight"), &[n_embd, kv_width]);
        }
        tensors.residual(block(layer, "attn_output.weight"), &[q_width, n_embd]);
        tensors.norm(block(layer, "attn_q_norm.weight"), &[head]);
        tensors.norm(block(layer, "attn_k_norm.weight"), &[head]);
        tensors.norm(block(layer, "post_attention_norm.weight"), &[n_embd]);
        tensors.uniform(block(layer, "layer_output_scale.weight"), &[1], 0.5, 1.0);
        // The dense GeGLU FFN every layer has beside its experts.
        tensors.norm(block(layer, "ffn_norm.weight"), &[n_embd]);
        tensors.ffn(layer, "", shape.n_ff_dense);
        tensors.norm(block(layer, "post_ffw_norm.weight"), &[n_embd]);
        // The router reads rms_norm(x) / sqrt(n_embd) * scale: a scale near sqrt(n_embd) gives
        // unit-variance logits.
        tensors.router(block(layer, "ffn_gate_inp.weight"), &[n_embd, shape.n_expert]);
        let root = (n_embd as f32).sqrt();
        tensors.uniform(block(layer, "ffn_gate_inp.scale"), &[n_embd], 0.9 * root, 1.1 * root);
        tensors.norm(block(layer, "pre_ffw_norm_2.weight"), &[n_embd]);
        tensors.norm(block(layer, "post_ffw_norm_1.weight"), &[n_embd]);
        tensors.norm(block(layer, "post_ffw_norm_2.weight"), &[n_embd]);
        // Routed experts, gate and up merged (gate rows first), experts last.
        tensors.weight(block(layer, "ffn_gate_up_exps.weight"), &[n_embd, 2 * shape.n_ff, shape.n_expert]);
        tensors.down(layer, block(layer, "ffn_down_exps.weight"), &[shape.n_ff, n_embd, shape.n_expert]);
        tensors.uniform(block(layer, "ffn_down_exps.scale"), &[shape.n_expert], 0.5, 1.5);
    }
    tensors.norm("output_norm.weight", &[n_embd]);
}
