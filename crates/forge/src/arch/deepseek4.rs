//! `deepseek4`: DeepSeek-V4 (Flash). Every layer is MoE (sqrt-softplus routing, `exp_probs_b`,
//! one shared expert, SwiGLU clamped at 10), attention is single-KV-head MQA with a low-rank
//! query (`attn_q_a`/`attn_q_b`), per-head sinks and a grouped low-rank output
//! (`attn_output_a`/`attn_output_b`), over a sliding window plus, per `compress_ratios`, a
//! compressed KV stream: ratio 4 (CSA, with a lightning indexer that picks the top-k compressed
//! blocks) or ratio 128 (HCA); ratio 0 is window-only. The residual stream is four
//! hyper-connection copies mixed by `hc_*` before and after each sublayer and collapsed by
//! `output_hc_*` before the head. One MTP (`nextn`) block follows the trunk; `block_count`
//! counts it and libllama loads it with `TENSOR_SKIP`.
//! The first `hash_layer_count` layers are hash-routed: `blk.N.ffn_gate_tid2eid.weight`, an I32
//! `[n_expert_used, n_vocab]` table, picks each token's experts from its id instead of the
//! router's scores (the graph still names the ids `ffn_moe_topk-N`).
use hypura_gguf::{GgmlType, Value, ValueType};

use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, QuantMix, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Deepseek4, presets, metadata, tensors };

/// Hyper-connection copies of the residual stream (llama.cpp asserts 4).
const HC_MULT: u64 = 4;
/// Width of the rotary part of every head (query, KV and indexer heads alike).
const N_ROT: u64 = 64;
/// The MTP blocks after the trunk.
const N_NEXTN: u64 = 1;
/// The layers at the start that attend through the window only (compression ratio 0).
const N_WINDOW_ONLY_LEAD: u64 = 2;
/// The SwiGLU clamp of routed and shared experts.
const SWIGLU_LIMIT: f32 = 10.0;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // 5 trunk layers (window-only, window-only, CSA, HCA, CSA) and the MTP block; 16
        // experts, top-4, one shared expert. head_dim stays apart from the indexer's 128: where
        // they are equal, libllama's KV cache forces a Hadamard rotation onto its (empty)
        // non-window part and divides by zero.
        (
            "tiny-deepseek4",
            Shape {
                n_ff_shared: 256,
                n_ctx_train: 4096,
                rope_freq_base: 10_000.0,
                ..moe(5, 256, 8, 1, 256, 256, 16, 4)
            },
        ),
        // DeepSeek-V4-Flash: 43 layers, 256 experts, top-6, head_dim 512, 1M context.
        (
            "deepseek4-flash",
            Shape {
                n_ff_shared: 2048,
                n_ctx_train: 1 << 20,
                rope_freq_base: 10_000.0,
                ..moe(43, 4096, 64, 1, 512, 2048, 256, 6)
            },
        ),
    ]
}

/// The widths beyond the shape, as DeepSeek-V4-Flash sets them (q_lora_rank 1024, 8 output
/// groups of rank 1024, 64 indexer heads of 128, top-512, window 128) and scaled down for the
/// small shapes.
struct Dims {
    q_lora_rank: u64,
    o_groups: u64,
    o_lora_rank: u64,
    indexer_heads: u64,
    indexer_head_dim: u64,
    indexer_top_k: u64,
    sliding_window: u64,
}

fn dims(shape: &Shape) -> Dims {
    let q_lora_rank = (shape.n_embd / 4).max(256);
    let full = shape.n_embd >= 2048;
    Dims {
        q_lora_rank,
        o_groups: (shape.n_head / 8).max(2),
        o_lora_rank: q_lora_rank,
        indexer_heads: shape.n_head,
        indexer_head_dim: 2 * N_ROT,
        indexer_top_k: if full { 512 } else { 8 },
        sliding_window: if full { 128 } else { 8 },
    }
}

/// Every block, trunk and MTP.
fn n_layer_all(shape: &Shape) -> u64 {
    shape.n_layer + N_NEXTN
}

/// Shared experts, each as wide as a routed one (one in DeepSeek-V4).
fn n_expert_shared(shape: &Shape) -> u64 {
    shape.n_ff_shared / shape.n_ff
}

/// The compression ratio of each block: two window-only layers, then CSA (4) and HCA (128)
/// alternating, and the MTP block window-only, as in DeepSeek-V4-Flash.
fn compress_ratio(shape: &Shape, layer: u64) -> u64 {
    if layer < N_WINDOW_ONLY_LEAD || layer >= shape.n_layer {
        0
    } else if (layer - N_WINDOW_ONLY_LEAD).is_multiple_of(2) {
        4
    } else {
        128
    }
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    let dims = dims(shape);
    let n_layer_all = n_layer_all(shape);
    meta.u32("block_count", n_layer_all);
    meta.u32("nextn_predict_layers", N_NEXTN);
    // No dense FFN anywhere.
    meta.remove("feed_forward_length");
    meta.u32("rope.dimension_count", N_ROT);
    meta.set("rope.scaling.type", Value::String("yarn".into()));
    meta.f32("rope.scaling.factor", 16.0);
    meta.u32("rope.scaling.original_context_length", shape.n_ctx_train / 16);
    meta.u32("attention.q_lora_rank", dims.q_lora_rank);
    meta.u32("attention.sliding_window", dims.sliding_window);
    // libllama sizes the shared expert as expert_feed_forward_length × expert_shared_count.
    meta.u32("expert_shared_count", n_expert_shared(shape));
    meta.f32("expert_weights_scale", 1.5);
    meta.bool("expert_weights_norm", true);
    // LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only one the loader takes.
    meta.u32("expert_gating_func", 4);
    let clamp = || Value::Array(ValueType::F32, (0..n_layer_all).map(|_| Value::F32(SWIGLU_LIMIT)).collect());
    meta.set("swiglu_clamp_exp", clamp());
    meta.set("swiglu_clamp_shexp", clamp());
    meta.u32("attention.indexer.head_count", dims.indexer_heads);
    meta.u32("attention.indexer.key_length", dims.indexer_head_dim);
    meta.u32("attention.indexer.top_k", dims.indexer_top_k);
    meta.u32("attention.output_group_count", dims.o_groups);
    meta.u32("attention.output_lora_rank", dims.o_lora_rank);
    meta.set(
        "attention.compress_ratios",
        Value::Array(
            ValueType::I32,
            (0..n_layer_all).map(|layer| Value::I32(compress_ratio(shape, layer) as i32)).collect(),
        ),
    );
    meta.f32("attention.compress_rope_freq_base", 160_000.0);
    meta.u32("hyper_connection.count", HC_MULT);
    meta.u32("hyper_connection.sinkhorn_iterations", 20);
    meta.f32("hyper_connection.epsilon", 1e-6);
    meta.u32("hash_layer_count", hash_layers(&spec.shape));
}

/// The leading hash-routed layers: Flash's 3 of 43, one in the tiny preset.
fn hash_layers(shape: &Shape) -> u64 {
    (shape.n_layer * 3 / 43).max(1)
}

/// The quantized type of a tensor llama-quantize treats as "other" (Q4_K under Q4_K_M).
fn other(tensors: &Tensors, row: u64) -> GgmlType {
    tensors.quant(GgmlType::Q4_K, false, row)
}

/// Routed experts ship in FP4 (MXFP4 blocks) in DeepSeek-V4; Q8_0/F16 mixes follow the mix.
fn expert_type(tensors: &Tensors, row: u64) -> GgmlType {
    match tensors.spec.quant {
        QuantMix::Q4KM if row.is_multiple_of(GgmlType::MXFP4.block_size()) => GgmlType::MXFP4,
        _ => tensors.quant(GgmlType::Q4_K, false, row),
    }
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let dims = dims(&shape);
    let n_embd = shape.n_embd;
    let n_layer_all = n_layer_all(&shape);
    let head_dim = shape.head_dim;
    let q_width = shape.n_head * head_dim;
    let hc_dim = HC_MULT * n_embd;
    let hc_mix = (2 + HC_MULT) * HC_MULT;
    let n_ff_exp = shape.n_ff;
    let n_expert = shape.n_expert;

    tensors.token_embedding();
    // llama.cpp counts `ffn_down` over every block, the MTP block included.
    tensors.count_more_bits_over(n_layer_all);
    for layer in 0..n_layer_all {
        let name = |suffix: &str| block(layer, suffix);
        // Attention: low-rank query, one shared K=V head, sinks, grouped low-rank output.
        tensors.norm(name("attn_norm.weight"), &[n_embd]);
        tensors.uniform(name("attn_sinks.weight"), &[shape.n_head], -0.5, 0.5);
        tensors.weight(name("attn_q_a.weight"), &[n_embd, dims.q_lora_rank]);
        tensors.norm(name("attn_q_a_norm.weight"), &[dims.q_lora_rank]);
        tensors.weight(name("attn_q_b.weight"), &[dims.q_lora_rank, q_width]);
        tensors.weight(name("attn_kv.weight"), &[n_embd, head_dim]);
        tensors.norm(name("attn_kv_a_norm.weight"), &[head_dim]);
        // Stored 2-D; libllama reshapes it to [q_width / o_groups, o_lora_rank, o_groups].
        let o_a_row = q_width / dims.o_groups;
        tensors.weight(name("attn_output_a.weight"), &[o_a_row, dims.o_lora_rank * dims.o_groups]);
        tensors.residual(name("attn_output_b.weight"), &[dims.o_groups * dims.o_lora_rank, n_embd]);

        // Hyper-connection mixing around the attention and the FFN.
        for sublayer in ["attn", "ffn"] {
            let fn_type = other(tensors, hc_dim);
            tensors.add(
                name(&format!("hc_{sublayer}_fn.weight")),
                &[hc_dim, hc_mix],
                fn_type,
                Init::Projection { fan_in: hc_dim },
            );
            tensors.uniform(name(&format!("hc_{sublayer}_base.weight")), &[hc_mix], -0.5, 0.5);
            tensors.uniform(name(&format!("hc_{sublayer}_scale.weight")), &[3], 0.5, 1.0);
        }

        // The KV compressor (CSA ratio 4 overlaps two windows, so its width doubles) and, for
        // CSA, the lightning indexer with its own compressor.
        let ratio = compress_ratio(&shape, layer);
        if ratio != 0 {
            let coff = if ratio == 4 { 2 } else { 1 };
            let width = coff * head_dim;
            tensors.weight(name("attn_compressor_kv.weight"), &[n_embd, width]);
            tensors.weight(name("attn_compressor_gate.weight"), &[n_embd, width]);
            let ape_type = other(tensors, width);
            tensors.add(
                name("attn_compressor_ape.weight"),
                &[width, ratio],
                ape_type,
                Init::Uniform { low: -0.1, high: 0.1 },
            );
            tensors.norm(name("attn_compressor_norm.weight"), &[head_dim]);
            if ratio == 4 {
                let indexer_width = 2 * dims.indexer_head_dim;
                tensors.weight(name("indexer.proj.weight"), &[n_embd, dims.indexer_heads]);
                tensors.weight(
                    name("indexer.attn_q_b.weight"),
                    &[dims.q_lora_rank, dims.indexer_heads * dims.indexer_head_dim],
                );
                tensors.weight(name("indexer_compressor_kv.weight"), &[n_embd, indexer_width]);
                tensors.weight(name("indexer_compressor_gate.weight"), &[n_embd, indexer_width]);
                let ape_type = other(tensors, indexer_width);
                tensors.add(
                    name("indexer_compressor_ape.weight"),
                    &[indexer_width, ratio],
                    ape_type,
                    Init::Uniform { low: -0.1, high: 0.1 },
                );
                tensors.norm(name("indexer_compressor_norm.weight"), &[dims.indexer_head_dim]);
            }
        }

        // MoE: router, selection bias, routed experts (3-D, experts last), one shared expert.
        tensors.router(name("ffn_gate_inp.weight"), &[n_embd, n_expert]);
        if layer < hash_layers(&shape) {
            tensors.add(
                name("ffn_gate_tid2eid.weight"),
                &[shape.n_expert_used, tensors.n_vocab],
                GgmlType::I32,
                Init::ExpertIds { n_expert },
            );
        } else {
            tensors.uniform(name("exp_probs_b.bias"), &[n_expert], -0.05, 0.05);
        }
        tensors.norm(name("ffn_norm.weight"), &[n_embd]);
        let up_type = expert_type(tensors, n_embd);
        let down_type = expert_type(tensors, n_ff_exp);
        tensors.add(
            name("ffn_gate_exps.weight"),
            &[n_embd, n_ff_exp, n_expert],
            up_type,
            Init::Projection { fan_in: n_embd },
        );
        tensors.add(
            name("ffn_down_exps.weight"),
            &[n_ff_exp, n_embd, n_expert],
            down_type,
            Init::Residual { fan_in: n_ff_exp },
        );
        tensors.add(
            name("ffn_up_exps.weight"),
            &[n_embd, n_ff_exp, n_expert],
            up_type,
            Init::Projection { fan_in: n_embd },
        );
        let n_ff_shexp = n_ff_exp * n_expert_shared(&shape);
        tensors.weight(name("ffn_gate_shexp.weight"), &[n_embd, n_ff_shexp]);
        tensors.down(layer, name("ffn_down_shexp.weight"), &[n_ff_shexp, n_embd]);
        tensors.weight(name("ffn_up_shexp.weight"), &[n_embd, n_ff_shexp]);

        // The MTP block: its input projection and norms (it shares token_embd and output).
        if layer >= shape.n_layer {
            tensors.weight(name("nextn.eh_proj.weight"), &[2 * n_embd, n_embd]);
            tensors.norm(name("nextn.enorm.weight"), &[n_embd]);
            tensors.norm(name("nextn.hnorm.weight"), &[n_embd]);
        }
    }
    // The hyper-connection head that collapses the four copies, then the usual head.
    let head_fn_type = other(tensors, hc_dim);
    tensors.add("output_hc_fn.weight", &[hc_dim, HC_MULT], head_fn_type, Init::Projection { fan_in: hc_dim });
    tensors.uniform("output_hc_base.weight", &[HC_MULT], -0.5, 0.5);
    tensors.uniform("output_hc_scale.weight", &[1], 0.5, 1.0);
    tensors.output();
}
