//! Per-architecture tensor sets and metadata. Each module writes what llama.cpp's
//! `src/models/<arch>.cpp` (`load_arch_hparams`, `load_arch_tensors`) in the pinned crate reads:
//! the same names, shapes and hparam keys, with the quantization types a real Q4_K_M file of
//! that architecture carries.
use hypura_gguf::{GgmlType, Value, ValueType};

use crate::spec::{Arch, ForgeSpec, Init, QuantMix, Shape, TensorPlan};

mod classic;
mod deepseek2;
mod deepseek4;
mod gemma4;
mod glm4moe;
mod glm5next;
mod gpt_oss;
mod kimi_k3;
mod llama4;
mod minimax_m2;
mod qwen35moe;
mod qwen3next;

/// What one architecture contributes: its presets, the metadata keys beyond the common ones,
/// and its tensors in file order.
pub(crate) struct Definition {
    pub arch: Arch,
    /// Named shapes: `tiny-<arch>` for tests, full shapes for benchmarks.
    pub presets: fn() -> Vec<(&'static str, Shape)>,
    pub metadata: fn(&ForgeSpec, &mut Meta),
    pub tensors: fn(&mut Tensors),
}

/// Every architecture the forge writes. The classic layouts (`llama`, `qwen3`, `qwen3moe`)
/// keep their presets in `spec.rs`.
pub(crate) const DEFINITIONS: &[Definition] = &[
    classic::LLAMA,
    classic::QWEN3,
    classic::QWEN3MOE,
    qwen35moe::DEFINITION,
    qwen3next::DEFINITION,
    gpt_oss::DEFINITION,
    deepseek2::DEFINITION,
    deepseek4::DEFINITION,
    kimi_k3::DEFINITION,
    glm4moe::DEFINITION,
    glm5next::DEFINITION,
    gemma4::DEFINITION,
    llama4::DEFINITION,
    minimax_m2::DEFINITION,
];

fn definition(arch: Arch) -> &'static Definition {
    DEFINITIONS.iter().find(|definition| definition.arch == arch).expect("every architecture has a definition")
}

pub(crate) fn tensors(spec: &ForgeSpec, n_vocab: u64) -> Vec<TensorPlan> {
    let mut tensors = Tensors { spec, n_vocab, bits_layers: spec.shape.n_layer, plans: Vec::new() };
    (definition(spec.arch).tensors)(&mut tensors);
    tensors.plans
}

pub(crate) fn metadata(spec: &ForgeSpec, meta: &mut Meta) {
    (definition(spec.arch).metadata)(spec, meta)
}

/// Metadata under construction: the common keys first, then each architecture's, which may
/// replace them.
pub struct Meta {
    arch: &'static str,
    pub(crate) entries: Vec<(String, Value)>,
}

impl Meta {
    pub(crate) fn new(arch: Arch) -> Meta {
        Meta { arch: arch.name(), entries: Vec::new() }
    }

    /// Set `key` (a full key such as `general.name`), replacing an earlier value.
    pub fn set_key(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.entries.iter_mut().find(|(existing, _)| *existing == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key, value)),
        }
    }

    /// Set `<arch>.<suffix>`.
    pub fn set(&mut self, suffix: &str, value: Value) {
        self.set_key(format!("{}.{suffix}", self.arch), value);
    }

    pub fn u32(&mut self, suffix: &str, value: u64) {
        self.set(suffix, Value::U32(u32::try_from(value).expect("metadata value fits in u32")));
    }

    pub fn f32(&mut self, suffix: &str, value: f32) {
        self.set(suffix, Value::F32(value));
    }

    pub fn bool(&mut self, suffix: &str, value: bool) {
        self.set(suffix, Value::Bool(value));
    }

    /// A per-layer array of u32 (`head_count_kv`, `expert_feed_forward_length`, ...).
    pub fn u32_array(&mut self, suffix: &str, values: impl IntoIterator<Item = u64>) {
        let values = values
            .into_iter()
            .map(|value| Value::U32(u32::try_from(value).expect("metadata value fits in u32")))
            .collect();
        self.set(suffix, Value::Array(ValueType::U32, values));
    }

    /// A per-layer array of booleans (`swa_layers`, ...).
    pub fn bool_array(&mut self, suffix: &str, values: impl IntoIterator<Item = bool>) {
        self.set(suffix, Value::Array(ValueType::Bool, values.into_iter().map(Value::Bool).collect()));
    }

    pub fn remove(&mut self, suffix: &str) {
        let key = format!("{}.{suffix}", self.arch);
        self.entries.retain(|(existing, _)| *existing != key);
    }
}

/// The tensor list under construction, with the spec's quantization mix applied.
pub struct Tensors<'a> {
    pub spec: &'a ForgeSpec,
    pub n_vocab: u64,
    /// The layer count over which `value` and `down` pick the layers that get more bits.
    bits_layers: u64,
    plans: Vec<TensorPlan>,
}

/// The name of a tensor of layer `layer`: `blk.{layer}.{suffix}`.
pub fn block(layer: u64, suffix: &str) -> String {
    format!("blk.{layer}.{suffix}")
}

impl Tensors<'_> {
    pub fn shape(&self) -> &Shape {
        &self.spec.shape
    }

    /// Pick the layers that get more bits over `n_layer` blocks: llama.cpp's quantizer counts
    /// every block, MTP blocks included (the default is the shape's layers).
    pub fn count_more_bits_over(&mut self, n_layer: u64) {
        self.bits_layers = n_layer;
    }

    /// Any tensor, with its type and values given.
    pub fn add(&mut self, name: impl Into<String>, dims: &[u64], ggml_type: GgmlType, init: Init) {
        self.plans.push(TensorPlan { name: name.into(), dims: dims.to_vec(), ggml_type, init });
    }

    /// The type a quantized tensor gets: `base` under Q4_K_M (Q6_K where `more_bits`), Q8_0 or
    /// F16 under the other mixes; where the row does not split into that type's blocks,
    /// llama.cpp's fallback (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), and F16 where even that
    /// does not split it.
    pub fn quant(&self, base: GgmlType, more_bits: bool, row: u64) -> GgmlType {
        let wanted = match self.spec.quant {
            QuantMix::F16 => GgmlType::F16,
            QuantMix::Q8_0 => GgmlType::Q8_0,
            QuantMix::Q4KM if more_bits => GgmlType::Q6_K,
            QuantMix::Q4KM => base,
        };
        if row.is_multiple_of(wanted.block_size()) {
            return wanted;
        }
        let fallback = match wanted {
            GgmlType::Q4_K => GgmlType::Q5_0,
            GgmlType::Q5_K => GgmlType::Q5_1,
            _ => GgmlType::Q8_0,
        };
        if row.is_multiple_of(fallback.block_size()) {
            fallback
        } else {
            GgmlType::F16
        }
    }

    /// An RMS-norm weight (F32, around 1).
    pub fn norm(&mut self, name: impl Into<String>, dims: &[u64]) {
        self.add(name, dims, GgmlType::F32, Init::Norm);
    }

    /// An F32 tensor with uniform values: biases, recurrent-state parameters, sinks.
    pub fn uniform(&mut self, name: impl Into<String>, dims: &[u64], low: f32, high: f32) {
        self.add(name, dims, GgmlType::F32, Init::Uniform { low, high });
    }

    /// A small bias (F32, within ±0.02).
    pub fn bias(&mut self, name: impl Into<String>, dims: &[u64]) {
        self.uniform(name, dims, -0.02, 0.02);
    }

    /// A projection read from its first dimension (Q4_K under Q4_K_M).
    pub fn weight(&mut self, name: impl Into<String>, dims: &[u64]) {
        self.projection(name, dims, false);
    }

    /// A projection, Q6_K under Q4_K_M where `more_bits`.
    pub fn projection(&mut self, name: impl Into<String>, dims: &[u64], more_bits: bool) {
        let ggml_type = self.quant(GgmlType::Q4_K, more_bits, dims[0]);
        self.add(name, dims, ggml_type, Init::Projection { fan_in: dims[0] });
    }

    /// A value projection: Q6_K in the layers where Q4_K_M spends more bits.
    pub fn value(&mut self, layer: u64, name: impl Into<String>, dims: &[u64]) {
        self.projection(name, dims, use_more_bits(layer, self.bits_layers));
    }

    /// A projection into the residual stream that Q4_K_M keeps at Q4_K (attention output).
    pub fn residual(&mut self, name: impl Into<String>, dims: &[u64]) {
        self.residual_bits(name, dims, false);
    }

    /// A projection into the residual stream, Q6_K under Q4_K_M where `more_bits`.
    pub fn residual_bits(&mut self, name: impl Into<String>, dims: &[u64], more_bits: bool) {
        let ggml_type = self.quant(GgmlType::Q4_K, more_bits, dims[0]);
        self.add(name, dims, ggml_type, Init::Residual { fan_in: dims[0] });
    }

    /// An FFN down projection (dense, expert or shared): into the residual stream, Q6_K in the
    /// layers where Q4_K_M spends more bits.
    pub fn down(&mut self, layer: u64, name: impl Into<String>, dims: &[u64]) {
        self.residual_bits(name, dims, use_more_bits(layer, self.bits_layers));
    }

    /// The router (`ffn_gate_inp`), F32 as llama.cpp keeps it, `[n_embd, n_expert]`.
    pub fn router(&mut self, name: impl Into<String>, dims: &[u64]) {
        self.add(name, dims, GgmlType::F32, Init::Router { fan_in: dims[0] });
    }

    /// `token_embd.weight`.
    pub fn token_embedding(&mut self) {
        let n_embd = self.shape().n_embd;
        let ggml_type = self.quant(GgmlType::Q4_K, false, n_embd);
        self.add("token_embd.weight", &[n_embd, self.n_vocab], ggml_type, Init::Embedding);
    }

    /// `output_norm.weight` and `output.weight` (Q6_K under Q4_K_M).
    pub fn output(&mut self) {
        let n_embd = self.shape().n_embd;
        self.norm("output_norm.weight", &[n_embd]);
        let ggml_type = self.quant(GgmlType::Q6_K, false, n_embd);
        let init = if self.spec.varied_text { Init::Successor } else { Init::Projection { fan_in: n_embd } };
        self.add("output.weight", &[n_embd, self.n_vocab], ggml_type, init);
    }

    /// Separate q, k, v and output projections of grouped-query attention, with widths from
    /// the shape.
    pub fn attention(&mut self, layer: u64) {
        let shape = self.shape().clone();
        let q_width = shape.n_head * shape.head_dim;
        let kv_width = shape.n_head_kv * shape.head_dim;
        self.weight(block(layer, "attn_q.weight"), &[shape.n_embd, q_width]);
        self.weight(block(layer, "attn_k.weight"), &[shape.n_embd, kv_width]);
        self.value(layer, block(layer, "attn_v.weight"), &[shape.n_embd, kv_width]);
        self.residual(block(layer, "attn_output.weight"), &[q_width, shape.n_embd]);
    }

    /// A SwiGLU FFN of width `n_ff`: `ffn_gate{infix}`, `ffn_up{infix}`, `ffn_down{infix}`, with
    /// `infix` `""` (dense) or `"_shexp"` (a shared expert).
    pub fn ffn(&mut self, layer: u64, infix: &str, n_ff: u64) {
        let n_embd = self.shape().n_embd;
        self.weight(block(layer, &format!("ffn_gate{infix}.weight")), &[n_embd, n_ff]);
        self.weight(block(layer, &format!("ffn_up{infix}.weight")), &[n_embd, n_ff]);
        self.down(layer, block(layer, &format!("ffn_down{infix}.weight")), &[n_ff, n_embd]);
    }

    /// DeepSeek's FFN layout (DeepSeek-V3, GLM-4.5, GLM-5): a dense FFN in the leading layers,
    /// else the router, the selection bias `exp_probs_b`, the routed experts and the shared
    /// expert.
    pub fn deepseek_ffn(&mut self, layer: u64) {
        let shape = self.shape().clone();
        let (n_embd, n_ff, n_expert) = (shape.n_embd, shape.n_ff, shape.n_expert);
        if layer < shape.n_dense_lead {
            self.ffn(layer, "", shape.n_ff_dense);
            return;
        }
        self.router(block(layer, "ffn_gate_inp.weight"), &[n_embd, n_expert]);
        // e_score_correction_bias: added to the scores for the selection only.
        self.uniform(block(layer, "exp_probs_b.bias"), &[n_expert], -0.05, 0.05);
        self.weight(block(layer, "ffn_gate_exps.weight"), &[n_embd, n_ff, n_expert]);
        self.weight(block(layer, "ffn_up_exps.weight"), &[n_embd, n_ff, n_expert]);
        self.down(layer, block(layer, "ffn_down_exps.weight"), &[n_ff, n_embd, n_expert]);
        self.ffn(layer, "_shexp", shape.n_ff_shared);
    }

    /// The router and the routed experts (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`) with the
    /// shape's expert count and width.
    pub fn routed_experts(&mut self, layer: u64) {
        let shape = self.shape().clone();
        self.router(block(layer, "ffn_gate_inp.weight"), &[shape.n_embd, shape.n_expert]);
        self.weight(block(layer, "ffn_gate_exps.weight"), &[shape.n_embd, shape.n_ff, shape.n_expert]);
        self.weight(block(layer, "ffn_up_exps.weight"), &[shape.n_embd, shape.n_ff, shape.n_expert]);
        self.down(layer, block(layer, "ffn_down_exps.weight"), &[shape.n_ff, shape.n_embd, shape.n_expert]);
    }
}

/// llama.cpp's `use_more_bits`: the layers where Q4_K_M spends Q6_K on attn_v and ffn_down.
pub(super) fn use_more_bits(layer: u64, n_layer: u64) -> bool {
    // Written as llama.cpp writes it (the middle test's first half is implied by the first).
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}
