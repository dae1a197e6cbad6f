//! `qwen3next`: Qwen3-Next (Qwen3-Next-80B-A3B), the hybrid layout before Qwen3.5. As
//! llama.cpp's `src/models/qwen3next.cpp` reads it, it is `qwen35moe`'s layout (gated delta-net
//! layers, gated full attention every 4th layer, an MoE FFN with a sigmoid-gated shared expert
//! in every layer, one MTP block after the trunk) with three differences: beta and alpha come
//! from one merged projection (`ssm_ba`), RoPE is plain NeoX (no IMROPE sections), and the
//! delta-net heads broadcast key heads to value heads in the Qwen3-Next order.
use super::qwen35moe::{hybrid_metadata, hybrid_tensors, DeltaNet};
use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Qwen3Next, presets, metadata, tensors };

fn presets() -> Vec<(&'static str, Shape)> {
    // 4 trunk layers (3 delta-net, 1 full attention) and the MTP block; 16 experts, top-4 (the
    // 80B-A3B: 48 layers, hidden 2048, 512 experts top-10 of 512, a shared expert of 512).
    vec![(
        "tiny-qwen3next",
        Shape { n_ff_shared: 128, rope_freq_base: 10_000_000.0, ..moe(4, 256, 4, 2, 64, 128, 16, 4) },
    )]
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    hybrid_metadata(spec, meta);
}

/// Qwen3-Next projects beta and alpha together: per key head, its value heads' betas then
/// their alphas.
fn beta_alpha(tensors: &mut Tensors, layer: u64) {
    let shape = tensors.shape().clone();
    let delta = DeltaNet::of(&shape);
    tensors.weight(block(layer, "ssm_ba.weight"), &[shape.n_embd, 2 * delta.n_v_heads]);
}

fn tensors(tensors: &mut Tensors) {
    hybrid_tensors(tensors, beta_alpha);
}
