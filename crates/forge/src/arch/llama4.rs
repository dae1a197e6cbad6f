//! `llama4`: Llama 4 (Scout, Maverick), as llama.cpp's `src/models/llama4.cpp` loads it.
//!
//! Every `interleave_moe_layer_step`-th layer (counting from 1) is an MoE layer: a sigmoid
//! router picking the top expert (its weight multiplies the expert's input, not its output)
//! and a shared expert as wide as a routed one, both reading the same `ffn_norm` output. The
//! other layers have a dense SwiGLU FFN of `feed_forward_length`. Attention is chunked (8192
//! tokens, set by llama.cpp, not by the file) in three layers of four with RoPE and a weightless
//! L2 norm of q and k; every fourth layer attends globally without RoPE. The llama3-style RoPE
//! factors are one global `rope_freqs.weight`.
use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Llama4, presets, metadata, tensors };

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // Maverick's interleaving (dense, MoE, dense, MoE) reduced: 4 layers, 16 experts of 256
        // top-1 with a shared expert of 256, dense FFN of 512; layer 3 is the global NoPE layer.
        (
            "tiny-llama4",
            Shape { n_ff_shared: 256, n_ff_dense: 512, rope_freq_base: 500_000.0, ..moe(4, 256, 4, 2, 64, 256, 16, 1) },
        ),
    ]
}

/// Every second layer is MoE where the model has dense layers (Maverick), every layer where it
/// has none (Scout).
fn moe_layer_step(shape: &Shape) -> u64 {
    if shape.n_ff_dense > 0 {
        2
    } else {
        1
    }
}

fn is_moe_layer(shape: &Shape, layer: u64) -> bool {
    (layer + 1).is_multiple_of(moe_layer_step(shape))
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    meta.u32("interleave_moe_layer_step", moe_layer_step(&spec.shape));
    meta.f32("attention.layer_norm_rms_epsilon", 1e-5);
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    tensors.token_embedding();
    // llama3 RoPE scaling (factor 16 beyond the first 8192 positions): one tensor, every layer.
    tensors.uniform("rope_freqs.weight", &[shape.head_dim / 2], 1.0, 16.0);
    for layer in 0..shape.n_layer {
        tensors.norm(block(layer, "attn_norm.weight"), &[shape.n_embd]);
        tensors.attention(layer);
        tensors.norm(block(layer, "ffn_norm.weight"), &[shape.n_embd]);
        if is_moe_layer(&shape, layer) {
            tensors.routed_experts(layer);
            // llama.cpp makes the shared expert as wide as a routed one.
            tensors.ffn(layer, "_shexp", shape.n_ff);
        } else {
            tensors.ffn(layer, "", shape.n_ff_dense);
        }
    }
    tensors.output();
}
