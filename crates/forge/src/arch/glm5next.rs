//! `glm5-next` (GLM-5.3-Flash, llama.cpp's `LLM_ARCH_GLM5_NEXT`, `src/models/glm5-next.cpp`):
//! a hybrid of Kimi-style KDA linear attention (recurrent: short causal convolutions on q, k and
//! v, a low-rank decay gate, a delta-rule state of `head_dim x head_dim` per head, a low-rank
//! sigmoid output gate) and nope-only MLA layers (no RoPE: `rope.dimension_count = 0`) whose
//! keys and values are the compressed latent, attended sparsely through a DSA "lightning"
//! indexer over pools of `kpool` tokens. An indexer is "full" (its own projections and cache)
//! or "shared" (reuses the previous full layer's selection, `attention.indexer.types`).
//! A layer is recurrent where its `head_count_kv` is 0. The residual stream is mHC: four
//! streams mixed around both sub-layers by `hc_{attn,ffn}_{fn,base,scale}` (Sinkhorn-normalized
//! combination). The FFN is DeepSeek-style: `leading_dense_block_count` dense SwiGLU layers,
//! then a sigmoid router with `exp_probs_b`, normalized and scaled top-k weights and one shared
//! expert of the routed width.
//!
//! The file ends with one MTP block (`nextn_predict_layers = 1`, counted in `block_count`): an
//! MLA layer with a full indexer and an MoE FFN plus `nextn.eh_proj`, `nextn.enorm`,
//! `nextn.hnorm` and `nextn.shared_head_norm`, without mHC tensors. Plain decoding loads it with
//! `TENSOR_SKIP` and never runs it. The shape's `n_layer` is the trunk's layer count
//! (`llama_model_n_layer`); the MTP block is layer `n_layer`. `head_dim` is the KDA head width;
//! the MLA and indexer widths derive from the shape (see `Dims`).
//!
//! Types follow llama.cpp's quantizer for this architecture: it leaves `hc_*`, the indexer's
//! projections, `ssm_{f,g}_{a,b}`, `ssm_beta`, `attn_kv_a_mqa`, `attn_k_b` and `attn_v_b`
//! unquantized (BF16, as the checkpoint ships; F32 for the mHC and the pool position
//! embedding), and raises `attn_q_a`, `attn_q_b` and `nextn.eh_proj` to Q8_0.
use hypura_gguf::GgmlType;

use super::{block, use_more_bits, Definition, Meta, Tensors};
use crate::spec::{moe, Arch, ForgeSpec, Init, QuantMix, Shape};

pub(super) const DEFINITION: Definition = Definition { arch: Arch::Glm5Next, presets, metadata, tensors };

/// MTP blocks after the trunk.
const NEXTN_LAYERS: u64 = 1;
/// Every third trunk layer is MLA, the others KDA.
const ATTENTION_PERIOD: u64 = 3;
/// KDA's causal convolution width (`ssm.conv_kernel`).
const CONV_KERNEL: u64 = 4;
/// mHC streams (llama.cpp supports only 4) and the width of their mixing coefficients:
/// 4 pre weights, 4 post weights and the 4 x 4 combination.
const HC: u64 = 4;
const HC_MIX: u64 = (2 + HC) * HC;
const HC_SINKHORN_ITERATIONS: u64 = 20;
/// Tokens per indexer pool, and the keys each query keeps (a multiple of the pool).
const KPOOL: u64 = 4;
const INDEXER_TOP_K: u64 = 16;

fn presets() -> Vec<(&'static str, Shape)> {
    vec![
        // Six trunk layers, KDA, KDA, MLA (full indexer), KDA, KDA, MLA (shared indexer); layer 0
        // has a dense FFN of 512, the others 16 experts of 256, top-4, and a shared expert of
        // 256; 4 heads (KDA heads of 64); the MTP block is layer 6.
        (
            "tiny-glm5-next",
            Shape {
                n_ff_shared: 256,
                n_dense_lead: 1,
                n_ff_dense: 512,
                rope_freq_base: 10_000.0,
                ..moe(6, 256, 4, 1, 64, 256, 16, 4)
            },
        ),
    ]
}

/// The widths beyond the shape's, derived from it.
struct Dims {
    q_lora_rank: u64,
    kv_lora_rank: u64,
    /// Per-head width of the MLA query/key (all "nope") and of its value.
    key_mla: u64,
    value_mla: u64,
    indexer_heads: u64,
    indexer_width: u64,
    /// KDA: `head_dim * n_head`.
    d_inner: u64,
}

fn dims(shape: &Shape) -> Dims {
    Dims {
        q_lora_rank: shape.n_embd / 2,
        kv_lora_rank: 2 * shape.head_dim,
        key_mla: shape.head_dim,
        value_mla: shape.head_dim,
        indexer_heads: shape.n_head,
        indexer_width: shape.head_dim,
        d_inner: shape.head_dim * shape.n_head,
    }
}

/// Whether block `layer` is MLA (the MTP block is); the others are KDA.
fn is_attention(layer: u64, n_layer: u64) -> bool {
    layer >= n_layer || (layer + 1).is_multiple_of(ATTENTION_PERIOD)
}

/// Whether MLA trunk layer `layer` has a full indexer: the first MLA layer and every other one
/// after it; the rest share the previous full layer's selection.
fn is_indexer_full(layer: u64) -> bool {
    (layer / ATTENTION_PERIOD).is_multiple_of(2)
}

fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    let shape = &spec.shape;
    let dims = dims(shape);
    let n_block = shape.n_layer + NEXTN_LAYERS;
    meta.u32("block_count", n_block);
    meta.u32("nextn_predict_layers", NEXTN_LAYERS);
    meta.f32("attention.layer_norm_rms_epsilon", 1e-5);
    // The indexer's key LayerNorm.
    meta.f32("attention.layer_norm_epsilon", 1e-6);
    // KDA layers have no KV heads (that is what makes them recurrent); MLA layers one latent.
    meta.u32_array("attention.head_count_kv", (0..n_block).map(|layer| u64::from(is_attention(layer, shape.n_layer))));
    // The MLA cache row is the latent: key_length is the latent width, without RoPE.
    meta.u32("attention.key_length", dims.kv_lora_rank);
    meta.u32("attention.value_length", dims.kv_lora_rank);
    meta.u32("attention.key_length_mla", dims.key_mla);
    meta.u32("attention.value_length_mla", dims.value_mla);
    meta.u32("attention.q_lora_rank", dims.q_lora_rank);
    meta.u32("attention.kv_lora_rank", dims.kv_lora_rank);
    meta.u32("rope.dimension_count", 0);
    meta.u32("ssm.conv_kernel", CONV_KERNEL);
    meta.u32("kda.head_dim", shape.head_dim);
    // The DSA indexer over pools of KPOOL tokens, with the incomplete tail kept.
    meta.u32("attention.indexer.head_count", dims.indexer_heads);
    meta.u32("attention.indexer.key_length", dims.indexer_width);
    meta.u32("attention.indexer.top_k", INDEXER_TOP_K);
    meta.u32("attention.indexer.kpool", KPOOL);
    meta.bool("attention.indexer.kpool_select_tail", true);
    meta.u32_array(
        "attention.indexer.types",
        (0..shape.n_layer).map(|layer| u64::from(is_attention(layer, shape.n_layer) && is_indexer_full(layer))),
    );
    meta.u32("hyper_connection.count", HC);
    meta.u32("hyper_connection.sinkhorn_iterations", HC_SINKHORN_ITERATIONS);
    meta.f32("hyper_connection.epsilon", 1e-6);
    meta.u32("leading_dense_block_count", shape.n_dense_lead);
    meta.u32("expert_shared_count", (shape.n_ff_shared / shape.n_ff).max(1));
    meta.f32("expert_weights_scale", 2.5);
    meta.bool("expert_weights_norm", true);
    // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
    meta.u32("expert_gating_func", 2);
}

/// The tensor list with the counter llama.cpp's quantizer keeps for `attn_v`: over the tensors
/// of that name (KDA layers only). `ffn_down` counts every block (`Tensors::count_more_bits_over`).
struct Layers<'t, 'a> {
    tensors: &'t mut Tensors<'a>,
    n_value: u64,
    value_index: u64,
}

impl Layers<'_, '_> {
    fn shape(&self) -> &Shape {
        self.tensors.shape()
    }

    /// A projection llama.cpp keeps at Q8_0 or above (`attn_q_a`, `attn_q_b`, `nextn.eh_proj`).
    fn weight_q8(&mut self, name: String, dims: &[u64]) {
        let ggml_type = match self.tensors.spec.quant {
            QuantMix::F16 => GgmlType::F16,
            _ => GgmlType::Q8_0,
        };
        self.tensors.add(name, dims, ggml_type, Init::Projection { fan_in: dims[0] });
    }

    /// A projection llama.cpp leaves unquantized: BF16 as the checkpoint ships (F16 under the
    /// F16 mix).
    fn weight_kept(&mut self, name: String, dims: &[u64]) {
        let ggml_type = match self.tensors.spec.quant {
            QuantMix::F16 => GgmlType::F16,
            _ => GgmlType::BF16,
        };
        self.tensors.add(name, dims, ggml_type, Init::Projection { fan_in: dims[0] });
    }

    /// An F32 projection (the mHC mixing weights).
    fn weight_f32(&mut self, name: String, dims: &[u64]) {
        self.tensors.add(name, dims, GgmlType::F32, Init::Projection { fan_in: dims[0] });
    }

    /// KDA's `attn_v`: Q6_K for the `attn_v` tensors where Q4_K_M spends more bits.
    fn value(&mut self, name: String, dims: &[u64]) {
        let more_bits = use_more_bits(self.value_index, self.n_value);
        self.value_index += 1;
        let ggml_type = self.tensors.quant(GgmlType::Q4_K, more_bits, dims[0]);
        self.tensors.add(name, dims, ggml_type, Init::Projection { fan_in: dims[0] });
    }

    /// mHC around one sub-layer (`kind` "attn" or "ffn"): the mixing projection of the four
    /// RMS-normed streams, its bias and the three scales (pre, post, combination).
    fn hyper_connection(&mut self, layer: u64, kind: &str) {
        let n_embd = self.shape().n_embd;
        self.weight_f32(block(layer, &format!("hc_{kind}_fn.weight")), &[HC * n_embd, HC_MIX]);
        self.tensors.uniform(block(layer, &format!("hc_{kind}_base.weight")), &[HC_MIX], -0.5, 0.5);
        self.tensors.uniform(block(layer, &format!("hc_{kind}_scale.weight")), &[3], 0.1, 0.5);
    }

    /// A KDA layer's attention: q/k/v projections, each through its causal convolution, the
    /// decay gate (`ssm_f_a` -> `ssm_f_b` + `ssm_dt.bias`, times `ssm_a`), beta, the output
    /// gate (`ssm_g_a` -> `ssm_g_b`), the per-head output norm and the output projection.
    fn kda(&mut self, layer: u64) {
        let shape = self.shape().clone();
        let Dims { d_inner, .. } = dims(&shape);
        let (n_embd, head_dim) = (shape.n_embd, shape.head_dim);
        for conv in ["ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v"] {
            self.tensors.add(
                block(layer, &format!("{conv}.weight")),
                &[CONV_KERNEL, 1, d_inner],
                GgmlType::F32,
                Init::Projection { fan_in: CONV_KERNEL },
            );
        }
        self.tensors.weight(block(layer, "attn_q.weight"), &[n_embd, d_inner]);
        self.tensors.weight(block(layer, "attn_k.weight"), &[n_embd, d_inner]);
        self.value(block(layer, "attn_v.weight"), &[n_embd, d_inner]);
        self.weight_kept(block(layer, "ssm_f_a.weight"), &[n_embd, head_dim]);
        self.weight_kept(block(layer, "ssm_f_b.weight"), &[head_dim, d_inner]);
        self.weight_kept(block(layer, "ssm_beta.weight"), &[n_embd, shape.n_head]);
        // -exp(A_log), A in 1..16 as Kimi initializes it: must be negative (decay).
        self.tensors.uniform(block(layer, "ssm_a"), &[shape.n_head], -8.0, -1.0);
        // dt bias: softplus of it stays small, so the decay per token is moderate.
        self.tensors.uniform(block(layer, "ssm_dt.bias"), &[d_inner], -4.0, -1.0);
        self.weight_kept(block(layer, "ssm_g_a.weight"), &[n_embd, head_dim]);
        self.weight_kept(block(layer, "ssm_g_b.weight"), &[head_dim, d_inner]);
        self.tensors.norm(block(layer, "ssm_norm.weight"), &[head_dim]);
        self.tensors.residual(block(layer, "attn_output.weight"), &[d_inner, n_embd]);
    }

    /// An MLA layer: the query through its low-rank path, the compressed latent, the per-head
    /// key and value up-projections (absorbed at decode) and, where `full`, the indexer.
    fn mla(&mut self, layer: u64, full: bool) {
        let shape = self.shape().clone();
        let dims = dims(&shape);
        let (n_embd, n_head) = (shape.n_embd, shape.n_head);
        self.tensors.norm(block(layer, "attn_q_a_norm.weight"), &[dims.q_lora_rank]);
        self.tensors.norm(block(layer, "attn_kv_a_norm.weight"), &[dims.kv_lora_rank]);
        self.weight_q8(block(layer, "attn_q_a.weight"), &[n_embd, dims.q_lora_rank]);
        self.weight_q8(block(layer, "attn_q_b.weight"), &[dims.q_lora_rank, n_head * dims.key_mla]);
        self.weight_kept(block(layer, "attn_kv_a_mqa.weight"), &[n_embd, dims.kv_lora_rank]);
        self.weight_kept(block(layer, "attn_k_b.weight"), &[dims.key_mla, dims.kv_lora_rank, n_head]);
        self.weight_kept(block(layer, "attn_v_b.weight"), &[dims.kv_lora_rank, dims.value_mla, n_head]);
        self.tensors.residual(block(layer, "attn_output.weight"), &[n_head * dims.value_mla, n_embd]);
        if full {
            self.tensors.norm(block(layer, "indexer.k_norm.weight"), &[dims.indexer_width]);
            self.tensors.bias(block(layer, "indexer.k_norm.bias"), &[dims.indexer_width]);
            self.weight_kept(block(layer, "indexer.proj.weight"), &[n_embd, dims.indexer_heads]);
            self.weight_kept(block(layer, "indexer.attn_k.weight"), &[n_embd, dims.indexer_width]);
            self.weight_kept(
                block(layer, "indexer.attn_q_b.weight"),
                &[dims.q_lora_rank, dims.indexer_heads * dims.indexer_width],
            );
            self.weight_kept(block(layer, "indexer_compressor_gate.weight"), &[n_embd, dims.indexer_width]);
            // The pool's position embedding, added to the gate logits.
            self.tensors.uniform(
                block(layer, "indexer_compressor_ape.weight"),
                &[dims.indexer_width, KPOOL],
                -0.5,
                0.5,
            );
        }
    }
}

fn tensors(tensors: &mut Tensors) {
    let shape = tensors.shape().clone();
    let n_embd = shape.n_embd;
    let n_block = shape.n_layer + NEXTN_LAYERS;
    let n_value = (0..n_block).filter(|&layer| !is_attention(layer, shape.n_layer)).count() as u64;

    let embd_type = tensors.quant(GgmlType::Q4_K, false, n_embd);
    tensors.add("token_embd.weight", &[n_embd, tensors.n_vocab], embd_type, Init::Embedding);
    // `ffn_down` counts every block, the MTP block included.
    tensors.count_more_bits_over(n_block);
    let mut layers = Layers { tensors, n_value, value_index: 0 };
    for layer in 0..n_block {
        let nextn = layer >= shape.n_layer;
        layers.tensors.norm(block(layer, "attn_norm.weight"), &[n_embd]);
        layers.tensors.norm(block(layer, "ffn_norm.weight"), &[n_embd]);
        if !nextn {
            layers.hyper_connection(layer, "attn");
            layers.hyper_connection(layer, "ffn");
        }
        if is_attention(layer, shape.n_layer) {
            layers.mla(layer, nextn || is_indexer_full(layer));
        } else {
            layers.kda(layer);
        }
        layers.tensors.deepseek_ffn(layer);
        if nextn {
            layers.weight_q8(block(layer, "nextn.eh_proj.weight"), &[2 * n_embd, n_embd]);
            layers.tensors.norm(block(layer, "nextn.enorm.weight"), &[n_embd]);
            layers.tensors.norm(block(layer, "nextn.hnorm.weight"), &[n_embd]);
            layers.tensors.norm(block(layer, "nextn.shared_head_norm.weight"), &[n_embd]);
        }
    }
    layers.tensors.output();
}
