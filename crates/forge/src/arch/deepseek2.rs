//! `deepseek2`: DeepSeek-V3/R1 and Kimi-K2 (`src/models/deepseek2.cpp`). MLA attention in the
//! absorbed layout that current conversions write (`attn_k_b`/`attn_v_b`, not the legacy
//! `attn_kv_b`), a low-rank query (`attn_q_a`/`attn_q_b`), leading dense layers, then MoE layers
//! with a sigmoid router, a selection bias (`exp_probs_b`), expert groups and one shared expert,
//! and a trailing MTP (`nextn`) block that `block_count` counts and plain decoding skips.
//!
//! Widths beyond the shape follow DeepSeek-V3's ratios from the shape's `head_dim` (the MLA key
//! width, 192 in V3): RoPE part `head_dim / 3` (64), no-RoPE part and value width the rest (128),
//! `kv_lora_rank = 4 * 128 = 512`, `q_lora_rank = 3 * 512 = 1536`.
use hypura_gguf::{GgmlType, Value};

use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Deepseek2, presets, metadata, tensors };

/// MTP blocks after the trunk (DeepSeek-V3/R1 ship one; Kimi-K2 none).
const N_NEXTN: u64 = 1;
/// Expert groups and the groups each token may pick from (V3: 8 and 4).
const N_EXPERT_GROUPS: u64 = 4;
const N_GROUP_USED: u64 = 2;
/// YaRN as V3 sets it: factor 40 over a 4096-token original context.
const YARN_FACTOR: f32 = 40.0;
const YARN_ORIGINAL_CONTEXT: u64 = 4096;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![(
        "tiny-deepseek2",
        Shape {
            // 4 trunk layers (1 dense, 3 MoE) + 1 MTP block; 16 experts in 4 groups, top-4.
            n_head_kv: 1,
            n_ff_shared: 256,
            n_dense_lead: 1,
            n_ff_dense: 512,
            n_ctx_train: 163_840,
            rope_freq_base: 10_000.0,
            ..moe(4, 256, 4, 1, 96, 256, 16, 4)
        },
    )]
}

/// The MLA widths derived from the shape (DeepSeek-V3's ratios; Kimi-K3 shares them).
pub(super) struct Mla {
    /// Per-head key width as MHA sees it (`key_length_mla`): no-RoPE + RoPE parts.
    pub k_head: u64,
    pub rope: u64,
    pub nope: u64,
    pub v_head: u64,
    pub kv_lora: u64,
    pub q_lora: u64,
}

pub(super) fn mla(shape: &Shape) -> Mla {
    let rope = shape.head_dim / 3;
    let nope = shape.head_dim - rope;
    let kv_lora = 4 * nope;
    Mla { k_head: shape.head_dim, rope, nope, v_head: nope, kv_lora, q_lora: 3 * kv_lora }
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    let mla = mla(shape);
    // `block_count` counts the MTP block; llama.cpp's n_layer() is block_count - nextn.
    meta.u32("block_count", shape.n_layer + N_NEXTN);
    meta.u32("nextn_predict_layers", N_NEXTN);
    meta.u32("leading_dense_block_count", shape.n_dense_lead);
    meta.u32("feed_forward_length", shape.n_ff_dense);
    meta.u32("expert_feed_forward_length", shape.n_ff);
    meta.u32("expert_shared_count", shape.n_ff_shared / shape.n_ff);
    meta.f32("expert_weights_scale", 2.5);
    meta.bool("expert_weights_norm", true);
    // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
    meta.u32("expert_gating_func", 2);
    meta.u32("expert_group_count", N_EXPERT_GROUPS);
    meta.u32("expert_group_used_count", N_GROUP_USED);
    // MLA as converted for the absorbed cache: one KV head holding the compressed latent and
    // the RoPE part; the MHA-view head widths go in the *_mla keys.
    meta.u32("attention.head_count_kv", 1);
    mla_metadata(meta, &mla);
    meta.set("rope.scaling.type", Value::String("yarn".into()));
    meta.f32("rope.scaling.factor", YARN_FACTOR);
    meta.u32("rope.scaling.original_context_length", YARN_ORIGINAL_CONTEXT);
    // The converter writes 0.1 * mscale_all_dim (1.0); llama.cpp divides the 0.1 back out.
    meta.f32("rope.scaling.yarn_log_multiplier", 0.1);
}

/// The MLA keys: the latent and query ranks, the cache row (latent + RoPE part, one KV head's
/// worth) and the MHA-view head widths.
pub(super) fn mla_metadata(meta: &mut Meta, mla: &Mla) {
    meta.u32("attention.q_lora_rank", mla.q_lora);
    meta.u32("attention.kv_lora_rank", mla.kv_lora);
    meta.u32("attention.key_length", mla.kv_lora + mla.rope);
    meta.u32("attention.value_length", mla.kv_lora);
    meta.u32("attention.key_length_mla", mla.k_head);
    meta.u32("attention.value_length_mla", mla.v_head);
    meta.u32("rope.dimension_count", mla.rope);
}

/// An MLA layer's norms and projections before its output: the low-rank query, the latent KV
/// with its RoPE part, and the absorbed per-head k and v up-projections (3-D, heads last).
pub(super) fn mla_projections(tensors: &mut Tensors, layer: u64, mla: &Mla) {
    let (n_embd, n_head) = (tensors.shape().n_embd, tensors.shape().n_head);
    tensors.norm(block(layer, "attn_q_a_norm.weight"), &[mla.q_lora]);
    tensors.norm(block(layer, "attn_kv_a_norm.weight"), &[mla.kv_lora]);
    tensors.weight(block(layer, "attn_q_a.weight"), &[n_embd, mla.q_lora]);
    tensors.weight(block(layer, "attn_q_b.weight"), &[mla.q_lora, n_head * mla.k_head]);
    tensors.weight(block(layer, "attn_kv_a_mqa.weight"), &[n_embd, mla.kv_lora + mla.rope]);
    tensors.weight(block(layer, "attn_k_b.weight"), &[mla.nope, mla.kv_lora, n_head]);
    tensors.weight(block(layer, "attn_v_b.weight"), &[mla.kv_lora, mla.v_head, n_head]);
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let mla = mla(&shape);
    let n_embd = shape.n_embd;
    let n_head = shape.n_head;
    let n_block = shape.n_layer + N_NEXTN;
    tensors.token_embedding();
    // llama.cpp counts `ffn_down` over every block, the MTP block included.
    tensors.count_more_bits_over(n_block);
    for layer in 0..n_block {
        tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
        mla_projections(tensors, layer, &mla);
        tensors.residual(block(layer, "attn_output.weight"), &[n_head * mla.v_head, n_embd]);
        tensors.norm(block(layer, "ffn_norm.weight"), &[n_embd]);
        tensors.deepseek_ffn(layer);
        if layer >= shape.n_layer {
            // The MTP head: its own embedding and LM head copies, as the checkpoint has them.
            tensors.weight(block(layer, "nextn.eh_proj.weight"), &[2 * n_embd, n_embd]);
            let ggml_type = tensors.quant(GgmlType::Q4_K, false, n_embd);
            tensors.add(
                block(layer, "nextn.embed_tokens.weight"),
                &[n_embd, tensors.n_vocab],
                ggml_type,
                Init::Embedding,
            );
            tensors.norm(block(layer, "nextn.enorm.weight"), &[n_embd]);
            tensors.norm(block(layer, "nextn.hnorm.weight"), &[n_embd]);
            tensors.weight(block(layer, "nextn.shared_head_head.weight"), &[n_embd, tensors.n_vocab]);
            tensors.norm(block(layer, "nextn.shared_head_norm.weight"), &[n_embd]);
        }
    }
    tensors.output();
}
