//! `glm4moe` (GLM-4.5 / GLM-4.5-Air / GLM-4.6, llama.cpp's `LLM_ARCH_GLM4_MOE`,
//! `src/models/glm4-moe.cpp`): grouped-query attention with q/k/v biases and per-head q/k
//! RMS norms (GLM-4.5 and 4.6; Air has none), partial NeoX RoPE over half of each head, a
//! post-attention norm in front of the FFN, `leading_dense_block_count` dense SwiGLU layers,
//! then MoE layers: a sigmoid router with DeepSeek-V3's selection bias (`exp_probs_b`),
//! normalized top-k weights scaled by `expert_weights_scale`, and one always-on shared expert
//! of the routed experts' width beside the routed ones.
//!
//! Real files end with one multi-token-prediction block (`nextn_predict_layers = 1`, counted
//! in `block_count`): a full MoE layer plus `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm` and
//! `nextn.shared_head_norm` (its token embedding and head are the trunk's, so the optional
//! `nextn.embed_tokens` / `nextn.shared_head_head` are absent). Plain decoding loads that block
//! with `TENSOR_SKIP` and never runs it. The shape's `n_layer` is the trunk's layer count
//! (`llama_model_n_layer`, which is `block_count - nextn_predict_layers`); the MTP block is
//! layer `n_layer`.
use hypura_gguf::GgmlType;

use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Glm4Moe, presets, metadata, tensors };

/// MTP blocks after the trunk (`num_nextn_predict_layers` of every GLM-4.5/4.6 config).
const NEXTN_LAYERS: u64 = 1;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // One leading dense layer (width 512) and three MoE layers of 16 experts of width 256,
        // top-4, one shared expert of 256; 4 query heads over 2 KV heads of 128 (half rotated),
        // plus the MTP block as layer 4.
        (
            "tiny-glm4moe",
            Shape { n_ff_shared: 256, n_dense_lead: 1, n_ff_dense: 512, ..moe(4, 256, 4, 2, 128, 256, 16, 4) },
        ),
        // GLM-4.5-Air: 46 layers (+1 MTP), hidden 4096, 96 query heads and 8 KV heads of 128,
        // one dense layer of 10944, 128 experts of 1408, top-8, one shared expert of 1408.
        (
            "glm-4.5-air",
            Shape {
                n_ff_shared: 1408,
                n_dense_lead: 1,
                n_ff_dense: 10944,
                n_ctx_train: 131_072,
                ..moe(46, 4096, 96, 8, 128, 1408, 128, 8)
            },
        ),
        // GLM-4.5 / 4.6: 92 layers (+1 MTP), hidden 5120, 96 query heads and 8 KV heads of 128,
        // three dense layers of 12288, 160 experts of 1536, top-8, one shared expert of 1536.
        (
            "glm-4.5",
            Shape {
                n_ff_shared: 1536,
                n_dense_lead: 3,
                n_ff_dense: 12288,
                n_ctx_train: 131_072,
                ..moe(92, 5120, 96, 8, 128, 1536, 160, 8)
            },
        ),
    ]
}

/// GLM-4.5/4.6 carry q/k norms (`use_qk_norm`); Air does not. Every preset but Air has them.
fn has_qk_norm(spec: &ForgeSpec) -> bool {
    spec.name != "glm-4.5-air"
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    // The trunk plus the MTP block.
    meta.u32("block_count", shape.n_layer + NEXTN_LAYERS);
    meta.u32("nextn_predict_layers", NEXTN_LAYERS);
    // GLM's rms_norm_eps.
    meta.f32("attention.layer_norm_rms_epsilon", 1e-5);
    // partial_rotary_factor 0.5: RoPE (NeoX) over the first half of each head.
    meta.u32("rope.dimension_count", shape.head_dim / 2);
    meta.u32("leading_dense_block_count", shape.n_dense_lead);
    // The shared expert is `n_ff_exp * expert_shared_count` wide.
    meta.u32("expert_shared_count", (shape.n_ff_shared / shape.n_ff).max(1));
    // routed_scaling_factor (2.5 for GLM-4.5/4.6, 1.0 for Air) and norm_topk_prob.
    meta.f32("expert_weights_scale", if spec.name == "glm-4.5-air" { 1.0 } else { 2.5 });
    meta.bool("expert_weights_norm", true);
    // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
    meta.u32("expert_gating_func", 2);
}

fn tensors(tensors: &mut Tensors) {
    let spec = tensors.spec;
    let shape = spec.shape.clone();
    let n_embd = shape.n_embd;
    let q_width = shape.n_head * shape.head_dim;
    let kv_width = shape.n_head_kv * shape.head_dim;
    let qk_norm = has_qk_norm(spec);
    let n_block = shape.n_layer + NEXTN_LAYERS;

    let embd_type = tensors.quant(GgmlType::Q4_K, false, n_embd);
    tensors.add("token_embd.weight", &[n_embd, tensors.n_vocab], embd_type, Init::Embedding);
    // llama.cpp counts `attn_v` and `ffn_down` over every block, the MTP block included.
    tensors.count_more_bits_over(n_block);
    for layer in 0..n_block {
        tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
        tensors.weight(block(layer, "attn_q.weight"), &[n_embd, q_width]);
        tensors.bias(block(layer, "attn_q.bias"), &[q_width]);
        tensors.weight(block(layer, "attn_k.weight"), &[n_embd, kv_width]);
        tensors.bias(block(layer, "attn_k.bias"), &[kv_width]);
        tensors.value(layer, block(layer, "attn_v.weight"), &[n_embd, kv_width]);
        tensors.bias(block(layer, "attn_v.bias"), &[kv_width]);
        tensors.residual(block(layer, "attn_output.weight"), &[q_width, n_embd]);
        if qk_norm {
            tensors.norm(block(layer, "attn_q_norm.weight"), &[shape.head_dim]);
            tensors.norm(block(layer, "attn_k_norm.weight"), &[shape.head_dim]);
        }
        tensors.norm(block(layer, "post_attention_norm.weight"), &[n_embd]);
        tensors.deepseek_ffn(layer);
        if layer >= shape.n_layer {
            // The MTP block's own tensors: the projection of [enorm(embedding); hnorm(hidden)]
            // back to the model width, its two norms and the norm in front of the shared head.
            tensors.weight(block(layer, "nextn.eh_proj.weight"), &[2 * n_embd, n_embd]);
            tensors.norm(block(layer, "nextn.enorm.weight"), &[n_embd]);
            tensors.norm(block(layer, "nextn.hnorm.weight"), &[n_embd]);
            tensors.norm(block(layer, "nextn.shared_head_norm.weight"), &[n_embd]);
        }
    }
    tensors.output();
}
