//! `kimi-k3`: Kimi-K3 (`src/models/kimi-k3.cpp`). Hybrid attention as in Kimi-Linear: KDA
//! (gated delta-net, recurrent) layers marked by `head_count_kv = 0`, and MLA layers in the
//! absorbed layout (`attn_k_b`/`attn_v_b`) with no RoPE applied and a sigmoid output gate
//! (`attn_gate`). On top: cross-layer residual attention (`attn_res_score`, `ffn_res_score`,
//! `output_res_score`), a latent MoE (the routed experts run at `expert_latent_length` between
//! `ffn_routed_down` and `ffn_routed_up`, the router and the shared expert at `n_embd`), the
//! situ activation everywhere, and leading dense layers.
//!
//! Widths beyond the shape: the MLA ones follow Kimi's ratios from the shape's `head_dim` (the
//! MLA key width, 192): RoPE-slot part `head_dim / 3` (64; sliced but never rotated), no-RoPE
//! part and value width the rest (128), `kv_lora_rank = 4 * 128`, `q_lora_rank = 3 * kv_lora`;
//! the KDA head width is the no-RoPE width (128, as Kimi-Linear) with the same head count; the
//! expert latent is `n_embd / 2`. Every third layer (2, 5, 8, ...) is MLA, the rest KDA.
use hypura_gguf::GgmlType;

use super::deepseek2::{mla, mla_metadata, mla_projections, Mla};
use super::{block, use_more_bits, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::KimiK3, presets, metadata, tensors };

/// Layers between residual-attention checkpoints (a checkpoint is banked at `il % size == 0`).
const ATTN_RES_BLOCK_SIZE: u64 = 2;
const SSM_CONV_KERNEL: u64 = 4;
/// Not a clamp: when set, the KDA decay gate is `lower_bound * sigmoid(...)`, in (-5, 0).
const KDA_GATE_LOWER_BOUND: f32 = -5.0;
const SITU_BETA: f32 = 4.0;
const SITU_LINEAR_BETA: f32 = 8.0;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![(
        "tiny-kimi-k3",
        Shape {
            // 6 layers: KDA 0 (dense FFN), KDA 1, MLA 2, KDA 3, KDA 4, MLA 5; 16 experts, top-4,
            // expert latent 256 under n_embd 512.
            n_head_kv: 1,
            n_ff_shared: 256,
            n_dense_lead: 1,
            n_ff_dense: 512,
            n_ctx_train: 262_144,
            rope_freq_base: 50_000.0,
            ..moe(6, 512, 8, 1, 96, 256, 16, 4)
        },
    )]
}

/// Kimi-K3's widths: DeepSeek's MLA ratios, KDA heads as wide as MLA's no-RoPE part, and
/// experts on a latent half the model's width.
struct Widths {
    mla: Mla,
    kda_head: u64,
    latent: u64,
}

fn widths(shape: &Shape) -> Widths {
    let mla = mla(shape);
    Widths { kda_head: mla.nope, latent: shape.n_embd / 2, mla }
}

fn is_mla(layer: u64) -> bool {
    layer % 3 == 2
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    let widths = widths(shape);
    meta.u32("feed_forward_length", shape.n_ff_dense);
    // 0 marks a KDA (recurrent) layer; an MLA layer has the one latent KV head.
    meta.u32_array("attention.head_count_kv", (0..shape.n_layer).map(|layer| u64::from(is_mla(layer))));
    mla_metadata(meta, &widths.mla);
    meta.u32("ssm.conv_kernel", SSM_CONV_KERNEL);
    meta.u32("kda.head_dim", widths.kda_head);
    meta.f32("kda.gate_lower_bound", KDA_GATE_LOWER_BOUND);
    meta.u32("leading_dense_block_count", shape.n_dense_lead);
    meta.u32("expert_feed_forward_length", shape.n_ff);
    meta.u32("expert_shared_count", shape.n_ff_shared / shape.n_ff);
    meta.u32("expert_latent_length", widths.latent);
    meta.f32("expert_weights_scale", 2.827);
    meta.bool("expert_weights_norm", true);
    // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
    meta.u32("expert_gating_func", 2);
    // As Kimi-K2 writes them: one group, so no group-limited routing.
    meta.u32("expert_group_count", 1);
    meta.u32("expert_group_used_count", 1);
    meta.u32("attn_res.block_size", ATTN_RES_BLOCK_SIZE);
    meta.f32("activation.situ_beta", SITU_BETA);
    meta.f32("activation.situ_linear_beta", SITU_LINEAR_BETA);
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let widths = widths(&shape);
    let n_embd = shape.n_embd;
    let n_head = shape.n_head;
    let d_inner = n_head * widths.kda_head;
    // Q4_K_M spends Q6_K on attn_v by its index among the attn_v tensors (KDA layers only).
    let n_kda = (0..shape.n_layer).filter(|&layer| !is_mla(layer)).count() as u64;
    let mut kda_index = 0;
    tensors.token_embedding();
    for layer in 0..shape.n_layer {
        tensors.uniform(block(layer, "attn_res_score.weight"), &[n_embd], -0.05, 0.05);
        tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
        if is_mla(layer) {
            mla_projections(tensors, layer, &widths.mla);
            tensors.weight(block(layer, "attn_gate.weight"), &[n_embd, n_head * widths.mla.v_head]);
            tensors.residual(block(layer, "attn_output.weight"), &[n_head * widths.mla.v_head, n_embd]);
        } else {
            for conv in ["ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight"] {
                tensors.add(
                    block(layer, conv),
                    &[SSM_CONV_KERNEL, 1, d_inner],
                    GgmlType::F32,
                    Init::Projection { fan_in: SSM_CONV_KERNEL },
                );
            }
            tensors.weight(block(layer, "attn_q.weight"), &[n_embd, d_inner]);
            tensors.weight(block(layer, "attn_k.weight"), &[n_embd, d_inner]);
            tensors.projection(block(layer, "attn_v.weight"), &[n_embd, d_inner], use_more_bits(kda_index, n_kda));
            kda_index += 1;
            tensors.weight(block(layer, "ssm_f_a.weight"), &[n_embd, widths.kda_head]);
            tensors.weight(block(layer, "ssm_f_b.weight"), &[widths.kda_head, d_inner]);
            tensors.weight(block(layer, "ssm_beta.weight"), &[n_embd, n_head]);
            // -exp(A_log), folded at conversion: must be negative.
            tensors.uniform(block(layer, "ssm_a"), &[n_head], -2.0, -0.5);
            tensors.uniform(block(layer, "ssm_dt.bias"), &[d_inner], -0.5, 0.5);
            tensors.weight(block(layer, "ssm_g.weight"), &[n_embd, d_inner]);
            tensors.norm(block(layer, "ssm_norm.weight"), &[widths.kda_head]);
            tensors.residual(block(layer, "attn_output.weight"), &[d_inner, n_embd]);
        }
        tensors.uniform(block(layer, "ffn_res_score.weight"), &[n_embd], -0.05, 0.05);
        tensors.norm(block(layer, "ffn_norm.weight"), &[n_embd]);
        if layer < shape.n_dense_lead {
            tensors.ffn(layer, "", shape.n_ff_dense);
        } else {
            tensors.router(block(layer, "ffn_gate_inp.weight"), &[n_embd, shape.n_expert]);
            tensors.uniform(block(layer, "exp_probs_b.bias"), &[shape.n_expert], -0.05, 0.05);
            tensors.weight(block(layer, "ffn_routed_down.weight"), &[n_embd, widths.latent]);
            tensors.weight(block(layer, "ffn_gate_exps.weight"), &[widths.latent, shape.n_ff, shape.n_expert]);
            tensors.weight(block(layer, "ffn_up_exps.weight"), &[widths.latent, shape.n_ff, shape.n_expert]);
            tensors.down(layer, block(layer, "ffn_down_exps.weight"), &[shape.n_ff, widths.latent, shape.n_expert]);
            tensors.norm(block(layer, "ffn_routed_norm.weight"), &[widths.latent]);
            tensors.residual(block(layer, "ffn_routed_up.weight"), &[widths.latent, n_embd]);
            tensors.ffn(layer, "_shexp", shape.n_ff_shared);
        }
    }
    tensors.uniform("output_res_score.weight", &[n_embd], -0.05, 0.05);
    tensors.output();
}
