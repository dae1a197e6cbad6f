//! `gpt-oss` (llama.cpp's `LLM_ARCH_OPENAI_MOE`, `src/models/openai-moe.cpp`): every layer is
//! MoE (no dense FFN, no shared expert), attention with q/k/v/output biases and per-head
//! attention sinks, a post-attention norm in front of the router, and sliding-window attention
//! on even layers (llama.cpp's default pattern of 2: layers 0, 2, 4, ... use the window, odd
//! layers full attention). Experts carry per-expert biases on gate, up and down, and ship as
//! MXFP4 in every real file; the router has a bias too. Routing is softmax over the top-k router
//! logits (`SOFTMAX_WEIGHT`, fixed in the graph), and the expert activation is the clamped
//! SwiGLU of gpt-oss (`swiglu_oai`, alpha 1.702, limit 7).
//!
//! gpt-oss-20b's width 2880 is not a multiple of 256, so under Q4_K_M its token embedding and
//! q/k/v projections take llama.cpp's fallback types (Q4_K -> Q5_0, Q6_K -> Q8_0), while the
//! attention output (rows of 64 * 64 = 4096) stays Q4_K. The tiny preset has width 288 for the
//! same reason, so it carries the same types.
use hypura_gguf::GgmlType;

use super::{block, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::GptOss, presets, metadata, tensors };

/// gpt-oss's attention window (`sliding_window` in its config).
const SLIDING_WINDOW: u64 = 128;
/// YaRN factor of gpt-oss: the trained context is 32 times the original one (4096).
const YARN_FACTOR: u64 = 32;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // Two sliding-window and two full-attention layers, 16 experts top-4, width 288 (not a
        // multiple of 256, as 2880 is not), 8 query heads of 64 over 2 KV heads.
        ("tiny-gpt-oss", Shape { rope_freq_base: 150_000.0, ..moe(4, 288, 8, 2, 64, 288, 16, 4) }),
        // gpt-oss-20b: 24 layers, hidden 2880, 64 query heads and 8 KV heads of 64, 32 experts
        // of width 2880, top-4, 131072 context (YaRN 32 x 4096), rope base 150000.
        (
            "gpt-oss-20b",
            Shape { n_ctx_train: 131_072, rope_freq_base: 150_000.0, ..moe(24, 2880, 64, 8, 64, 2880, 32, 4) },
        ),
    ]
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    // gpt-oss's rms_norm_eps.
    meta.f32("attention.layer_norm_rms_epsilon", 1e-5);
    // Required by load_arch_hparams; the per-layer pattern is llama.cpp's default of 2 (even
    // layers windowed), as real files carry no `sliding_window_pattern`.
    meta.u32("attention.sliding_window", SLIDING_WINDOW);
    // YaRN, as the real files set it.
    meta.set("rope.scaling.type", hypura_gguf::Value::String("yarn".into()));
    meta.f32("rope.scaling.factor", YARN_FACTOR as f32);
    meta.u32("rope.scaling.original_context_length", (shape.n_ctx_train / YARN_FACTOR).max(1));
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let (n_embd, n_ff, n_expert) = (shape.n_embd, shape.n_ff, shape.n_expert);
    let q_width = shape.n_head * shape.head_dim;
    let kv_width = shape.n_head_kv * shape.head_dim;
    let projection = |fan_in| Init::Projection { fan_in };

    tensors.token_embedding();
    for layer in 0..shape.n_layer {
        tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
        tensors.weight(block(layer, "attn_q.weight"), &[n_embd, q_width]);
        tensors.bias(block(layer, "attn_q.bias"), &[q_width]);
        tensors.weight(block(layer, "attn_k.weight"), &[n_embd, kv_width]);
        tensors.bias(block(layer, "attn_k.bias"), &[kv_width]);
        tensors.value(layer, block(layer, "attn_v.weight"), &[n_embd, kv_width]);
        tensors.bias(block(layer, "attn_v.bias"), &[kv_width]);
        tensors.residual(block(layer, "attn_output.weight"), &[q_width, n_embd]);
        tensors.bias(block(layer, "attn_output.bias"), &[n_embd]);
        // One learned logit per head, added to the softmax's denominator.
        tensors.uniform(block(layer, "attn_sinks.weight"), &[shape.n_head], -1.0, 1.0);
        tensors.norm(block(layer, "post_attention_norm.weight"), &[n_embd]);
        tensors.router(block(layer, "ffn_gate_inp.weight"), &[n_embd, n_expert]);
        tensors.bias(block(layer, "ffn_gate_inp.bias"), &[n_expert]);
        // The routed experts, MXFP4 whatever the mix (real files never requantize them), each
        // with its own bias row.
        tensors.add(
            block(layer, "ffn_gate_exps.weight"),
            &[n_embd, n_ff, n_expert],
            GgmlType::MXFP4,
            projection(n_embd),
        );
        tensors.bias(block(layer, "ffn_gate_exps.bias"), &[n_ff, n_expert]);
        tensors.add(block(layer, "ffn_up_exps.weight"), &[n_embd, n_ff, n_expert], GgmlType::MXFP4, projection(n_embd));
        tensors.bias(block(layer, "ffn_up_exps.bias"), &[n_ff, n_expert]);
        tensors.add(
            block(layer, "ffn_down_exps.weight"),
            &[n_ff, n_embd, n_expert],
            GgmlType::MXFP4,
            Init::Residual { fan_in: n_ff },
        );
        tensors.bias(block(layer, "ffn_down_exps.bias"), &[n_embd, n_expert]);
    }
    tensors.output();
}

#[cfg(test)]
mod tests {
    use crate::spec::preset;
    use crate::vocab::Vocabulary;

    fn tensor_bytes(name: &str) -> u64 {
        let spec = preset(name).unwrap();
        spec.tensors(Vocabulary::build().len())
            .iter()
            .map(|plan| plan.ggml_type.row_bytes(plan.dims[0]).unwrap() * plan.dims[1..].iter().product::<u64>())
            .sum()
    }

    #[test]
    fn gpt_oss_20b_is_about_12_gb() {
        let bytes = tensor_bytes("gpt-oss-20b");
        assert!((10_000_000_000..14_000_000_000).contains(&bytes), "gpt-oss-20b has {bytes} tensor bytes");
    }

    #[test]
    fn experts_are_mxfp4_and_wide_rows_fall_back() {
        let spec = preset("gpt-oss-20b").unwrap();
        let plans = spec.tensors(Vocabulary::build().len());
        let type_of = |name: &str| plans.iter().find(|plan| plan.name == name).unwrap().ggml_type;
        assert_eq!(type_of("blk.0.ffn_down_exps.weight"), hypura_gguf::GgmlType::MXFP4);
        assert_eq!(type_of("blk.5.attn_q.weight"), hypura_gguf::GgmlType::Q5_0);
        assert_eq!(type_of("blk.5.attn_output.weight"), hypura_gguf::GgmlType::Q4_K);
        assert_eq!(type_of("output.weight"), hypura_gguf::GgmlType::Q8_0);
    }
}
