//! `qwen35moe`: Qwen3.5/3.6 MoE (Qwen3.6-35B-A3B). As llama.cpp's `src/models/qwen35moe.cpp`
//! reads it: a hybrid of gated delta-net (linear attention) layers and gated full-attention
//! layers (every `full_attention_interval`-th layer, IMROPE on a quarter of each head), every
//! layer an MoE FFN (softmax top-k, weights renormalized) plus a sigmoid-gated shared expert,
//! and one MTP (`nextn`) block after the trunk, counted in `block_count` and skipped when
//! llama.cpp loads the model for plain decoding.
use hypura_gguf::{GgmlType, Value, ValueType};

use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Qwen35Moe, presets, metadata, tensors };

/// Every `FULL_ATTENTION_INTERVAL`-th layer (1-based) is full attention, the others gated
/// delta-net: Qwen3.5 and Qwen3-Next both use 4.
pub(super) const FULL_ATTENTION_INTERVAL: u64 = 4;

/// MTP blocks after the trunk (`nextn_predict_layers`): one in every released Qwen3.5/3-Next.
pub(super) const NEXTN_LAYERS: u64 = 1;

/// Gated delta-net kernel width (`linear_conv_kernel_dim`).
pub(super) const CONV_KERNEL: u64 = 4;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // 4 trunk layers (3 delta-net, 1 full attention) and the MTP block; 16 experts, top-4.
        (
            "tiny-qwen35moe",
            Shape { n_ff_shared: 128, rope_freq_base: 10_000_000.0, ..moe(4, 256, 4, 2, 64, 128, 16, 4) },
        ),
        // Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B): 40 layers, hidden 2048, 16 q heads and 2 kv heads
        // of 256, 256 experts top-8 of width 512, a shared expert of 512; the delta-net layers
        // have 16 key heads and 32 value heads of 128 and a conv kernel of 4.
        (
            "qwen3.6-35b-a3b",
            Shape {
                n_ff_shared: 512,
                n_ctx_train: 262_144,
                rope_freq_base: 10_000_000.0,
                ..moe(40, 2048, 16, 2, 256, 512, 256, 8)
            },
        ),
    ]
}

/// The widths of the gated delta-net layers, derived from the attention shape the way the
/// Qwen3.5/3-Next releases relate them: as many key heads as query heads, twice as many value
/// heads, each head half the attention head width (35B-A3B and 80B-A3B: 16, 32, 128).
#[derive(Clone, Copy, Debug)]
pub(super) struct DeltaNet {
    /// `ssm.group_count`: key (and query) heads.
    pub n_k_heads: u64,
    /// `ssm.time_step_rank`: value heads (one gate, beta and decay each).
    pub n_v_heads: u64,
    /// `ssm.state_size`: width of a key head and of a value head.
    pub head_dim: u64,
}

impl DeltaNet {
    pub fn of(shape: &Shape) -> DeltaNet {
        DeltaNet { n_k_heads: shape.n_head, n_v_heads: 2 * shape.n_head, head_dim: shape.head_dim / 2 }
    }

    pub fn key_dim(self) -> u64 {
        self.n_k_heads * self.head_dim
    }

    /// `ssm.inner_size`.
    pub fn value_dim(self) -> u64 {
        self.n_v_heads * self.head_dim
    }

    /// Channels of the causal convolution: q, k and v.
    pub fn conv_dim(self) -> u64 {
        2 * self.key_dim() + self.value_dim()
    }
}

/// Whether trunk layer `layer` is a gated delta-net layer (llama.cpp's default `is_recr`).
pub(super) fn is_recurrent(layer: u64) -> bool {
    !(layer + 1).is_multiple_of(FULL_ATTENTION_INTERVAL)
}

/// RoPE covers a quarter of each head (`partial_rotary_factor` 0.25).
pub(super) fn rope_dims(shape: &Shape) -> u64 {
    shape.head_dim / 4
}

/// The keys both hybrid Qwen layouts read: the MTP block in `block_count`, the shared expert,
/// the delta-net sizes and the layer pattern.
pub(super) fn hybrid_metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    let delta = DeltaNet::of(shape);
    meta.u32("block_count", shape.n_layer + NEXTN_LAYERS);
    meta.u32("nextn_predict_layers", NEXTN_LAYERS);
    meta.u32("expert_shared_feed_forward_length", shape.n_ff_shared);
    meta.u32("rope.dimension_count", rope_dims(shape));
    meta.u32("ssm.conv_kernel", CONV_KERNEL);
    meta.u32("ssm.state_size", delta.head_dim);
    meta.u32("ssm.group_count", delta.n_k_heads);
    meta.u32("ssm.time_step_rank", delta.n_v_heads);
    meta.u32("ssm.inner_size", delta.value_dim());
    meta.u32("full_attention_interval", FULL_ATTENTION_INTERVAL);
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    hybrid_metadata(spec, meta);
    // IMROPE sections over the rotated pairs, split like the release's [11, 11, 10] of 32.
    let pairs = rope_dims(&spec.shape) / 2;
    let temporal = (pairs * 11 + 16) / 32;
    let sections = [temporal, temporal, pairs - 2 * temporal, 0];
    meta.set(
        "rope.dimension_sections",
        Value::Array(ValueType::I32, sections.iter().map(|&section| Value::I32(section as i32)).collect()),
    );
}

/// The gated full attention: `attn_q` carries the query and its sigmoid gate (twice the
/// query width), per-head q/k RMS norms.
pub(super) fn gated_attention(tensors: &mut Tensors, layer: u64) {
    let shape = tensors.shape().clone();
    let q_width = shape.n_head * shape.head_dim;
    let kv_width = shape.n_head_kv * shape.head_dim;
    tensors.weight(block(layer, "attn_q.weight"), &[shape.n_embd, 2 * q_width]);
    tensors.weight(block(layer, "attn_k.weight"), &[shape.n_embd, kv_width]);
    tensors.value(layer, block(layer, "attn_v.weight"), &[shape.n_embd, kv_width]);
    tensors.residual(block(layer, "attn_output.weight"), &[q_width, shape.n_embd]);
    tensors.norm(block(layer, "attn_q_norm.weight"), &[shape.head_dim]);
    tensors.norm(block(layer, "attn_k_norm.weight"), &[shape.head_dim]);
}

/// The delta-net tensors both layouts share, around their beta/alpha projections:
/// `attn_qkv` and `attn_gate` (z) in, the conv kernel, `ssm_dt` bias and `ssm_a` (= -exp(A_log),
/// negative so the state decays), then `beta_alpha`, the gated output norm and `ssm_out`.
pub(super) fn delta_net(tensors: &mut Tensors, layer: u64, beta_alpha: impl FnOnce(&mut Tensors)) {
    let shape = tensors.shape().clone();
    let delta = DeltaNet::of(&shape);
    // Q4_K_M treats attn_qkv as it treats attn_v.
    tensors.value(layer, block(layer, "attn_qkv.weight"), &[shape.n_embd, delta.conv_dim()]);
    tensors.weight(block(layer, "attn_gate.weight"), &[shape.n_embd, delta.value_dim()]);
    tensors.add(
        block(layer, "ssm_conv1d.weight"),
        &[CONV_KERNEL, delta.conv_dim()],
        GgmlType::F32,
        Init::Projection { fan_in: CONV_KERNEL },
    );
    tensors.uniform(block(layer, "ssm_dt.bias"), &[delta.n_v_heads], -4.0, -1.0);
    tensors.uniform(block(layer, "ssm_a"), &[delta.n_v_heads], -4.0, -0.5);
    beta_alpha(tensors);
    tensors.norm(block(layer, "ssm_norm.weight"), &[delta.head_dim]);
    tensors.residual(block(layer, "ssm_out.weight"), &[delta.value_dim(), shape.n_embd]);
}

/// The MoE FFN of every layer: router, routed experts (separate gate and up, experts last),
/// the shared expert's sigmoid gate (one value per token) and the shared expert.
pub(super) fn moe_ffn(tensors: &mut Tensors, layer: u64) {
    let shape = tensors.shape().clone();
    tensors.routed_experts(layer);
    tensors.add(
        block(layer, "ffn_gate_inp_shexp.weight"),
        &[shape.n_embd],
        GgmlType::F32,
        Init::Projection { fan_in: shape.n_embd },
    );
    tensors.ffn(layer, "_shexp", shape.n_ff_shared);
}

/// The MTP block: a full-attention layer with the MoE FFN, fed by `eh_proj` from the
/// normalized token embedding and hidden state; it shares `token_embd` and `output` (no
/// `nextn.embed_tokens` or `nextn.shared_head_head`) and has its own head norm.
pub(super) fn nextn_block(tensors: &mut Tensors, layer: u64) {
    let n_embd = tensors.shape().n_embd;
    tensors.weight(block(layer, "nextn.eh_proj.weight"), &[2 * n_embd, n_embd]);
    tensors.norm(block(layer, "nextn.enorm.weight"), &[n_embd]);
    tensors.norm(block(layer, "nextn.hnorm.weight"), &[n_embd]);
    tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
    gated_attention(tensors, layer);
    tensors.norm(block(layer, "post_attention_norm.weight"), &[n_embd]);
    moe_ffn(tensors, layer);
    tensors.norm(block(layer, "nextn.shared_head_norm.weight"), &[n_embd]);
}

/// Both layouts' file: embeddings, the trunk (delta-net or attention, then the MoE FFN), the
/// MTP block, the output head.
pub(super) fn hybrid_tensors(tensors: &mut Tensors, beta_alpha: fn(&mut Tensors, u64)) {
    let shape = tensors.shape().clone();
    tensors.token_embedding();
    for layer in 0..shape.n_layer {
        tensors.norm(block(layer, "attn_norm.weight"), &[shape.n_embd]);
        if is_recurrent(layer) {
            delta_net(tensors, layer, |tensors| beta_alpha(tensors, layer));
        } else {
            gated_attention(tensors, layer);
        }
        tensors.norm(block(layer, "post_attention_norm.weight"), &[shape.n_embd]);
        moe_ffn(tensors, layer);
    }
    for layer in shape.n_layer..shape.n_layer + NEXTN_LAYERS {
        nextn_block(tensors, layer);
    }
    tensors.output();
}

/// Qwen3.5 projects beta and alpha (the decay input) separately, one value per value head.
fn beta_alpha(tensors: &mut Tensors, layer: u64) {
    let shape = tensors.shape().clone();
    let delta = DeltaNet::of(&shape);
    tensors.weight(block(layer, "ssm_beta.weight"), &[shape.n_embd, delta.n_v_heads]);
    tensors.weight(block(layer, "ssm_alpha.weight"), &[shape.n_embd, delta.n_v_heads]);
}

fn tensors(tensors: &mut Tensors) {
    hybrid_tensors(tensors, beta_alpha);
}

#[cfg(test)]
mod tests {
    use crate::spec::preset;
    use crate::vocab::Vocabulary;

    #[test]
    fn full_preset_is_about_twenty_gigabytes() {
        let spec = preset("qwen3.6-35b-a3b").expect("the preset exists");
        let bytes: u64 = spec
            .tensors(Vocabulary::build().len())
            .iter()
            .map(|plan| {
                plan.ggml_type.row_bytes(plan.dims[0]).expect("whole blocks") * plan.dims[1..].iter().product::<u64>()
            })
            .sum();
        let gigabytes = bytes as f64 / 1e9;
        assert!((17.0..=23.0).contains(&gigabytes), "{gigabytes:.2} GB");
    }
}
