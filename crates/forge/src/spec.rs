//! Model specifications: architecture, shape, quantization mix, seed and routing knobs, and the
//! named presets that the benchmark scenarios use.
use std::fmt;

/// The llama.cpp architectures the forge writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama`: dense (TinyLlama, Llama 3) or, with experts, the Mixtral layout.
    Llama,
    /// `qwen3`: dense with per-head q/k norms.
    Qwen3,
    /// `qwen3moe`: Qwen3-30B-A3B layout (q/k norms, many small experts).
    Qwen3Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    pub fn parse(text: &str) -> Option<Arch> {
        match text {
            "llama" => Some(Arch::Llama),
            "qwen3" => Some(Arch::Qwen3),
            "qwen3moe" => Some(Arch::Qwen3Moe),
            _ => None,
        }
    }

    fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }
}

/// How tensors are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// llama.cpp's Q4_K_M recipe: Q4_K, with Q6_K for `output` and for `attn_v`/`ffn_down` in
    /// the layers where llama.cpp spends more bits.
    Q4KM,
    Q8_0,
    F16,
}

impl QuantMix {
    pub fn parse(text: &str) -> Option<QuantMix> {
        match text.to_ascii_lowercase().as_str() {
            "q4_k_m" | "q4km" => Some(QuantMix::Q4KM),
            "q8_0" | "q8" => Some(QuantMix::Q8_0),
            "f16" => Some(QuantMix::F16),
            _ => None,
        }
    }

    /// `general.file_type` (llama_ftype).
    pub fn file_type(self) -> u32 {
        match self {
            QuantMix::Q4KM => 15,
            QuantMix::Q8_0 => 7,
            QuantMix::F16 => 1,
        }
    }
}

impl fmt::Display for QuantMix {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            QuantMix::Q4KM => "Q4_K_M",
            QuantMix::Q8_0 => "Q8_0",
            QuantMix::F16 => "F16",
        })
    }
}

/// Shape in llama.cpp's hparam words.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    /// Per-head width; Qwen3 sets it apart from n_embd / n_head.
    pub head_dim: u64,
    /// Dense FFN width (dense models), or the per-expert width (MoE).
    pub n_ff: u64,
    /// 0 for dense models.
    pub n_expert: u64,
    pub n_expert_used: u64,
    pub n_ctx_train: u64,
    pub rope_freq_base: f32,
}

/// Everything that determines a forged file, byte for byte.
#[derive(Clone, Debug, PartialEq)]
pub struct ForgeSpec {
    pub name: String,
    pub arch: Arch,
    pub shape: Shape,
    pub quant: QuantMix,
    pub seed: u64,
    /// Spread of router row norms across experts: 0 routes uniformly; larger values make
    /// low-numbered experts win top-k more often (real routers are skewed).
    pub router_skew: f32,
    /// Strength of a direction shared by every token embedding and aligned with the router:
    /// 0 makes each token's routing independent; larger values keep consecutive tokens on
    /// the same experts (real routers show strong recency).
    pub router_locality: f32,
    /// Scale of what each layer adds to the residual stream: 1 keeps every projection at unit
    /// variance; real models add little per layer, so their hidden state (and routing) drifts
    /// slowly from layer to layer, which is what makes the stale gate predict.
    pub residual_scale: f32,
    /// `tokenizer.chat_template`: the Qwen3 presets carry a Qwen3-style template with a
    /// reasoning section (`<think>`), the others none (base models).
    pub chat_template: Option<String>,
}

/// A Qwen3-style chat template: ChatML turns, the assistant's reasoning in `<think>` tags,
/// and `enable_thinking=false` closing an empty reasoning block.
pub const QWEN3_TEMPLATE: &str = concat!(
    "{%- for message in messages %}",
    "{%- if message.role == 'assistant' %}",
    "{{- '<|im_start|>assistant\\n' }}",
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}",
    "{{- message.content + '<|im_end|>\\n' }}",
    "{%- else %}",
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}",
    "{{- '<|im_start|>assistant\\n' }}",
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{%- endif %}",
);

impl ForgeSpec {
    pub fn is_moe(&self) -> bool {
        self.shape.n_expert > 0
    }
}

/// Names of all presets, for help text and tests.
pub const PRESETS: &[&str] = &["dense-1b", "dense-8b", "moe-8x", "moe-30b", "tiny-dense-1b", "tiny-dense-8b", "tiny-qwen3", "tiny-moe-8x", "tiny-moe-30b"];

/// A named preset. `tiny-dense`, `tiny-moe` and `tiny-moe30b` are aliases.
pub fn preset(name: &str) -> Option<ForgeSpec> {
    let canonical = match name {
        "tiny-dense" => "tiny-dense-1b",
        "tiny-moe" => "tiny-moe-8x",
        "tiny-moe30b" => "tiny-moe-30b",
        other => other,
    };
    let (arch, shape) = match canonical {
        // TinyLlama 1.1B.
        "dense-1b" => (Arch::Llama, dense(22, 2048, 32, 4, 5632, 10_000.0)),
        // Llama 3 8B.
        "dense-8b" => (Arch::Llama, dense(32, 4096, 32, 8, 14336, 500_000.0)),
        // Mixtral layout (8 experts, top-2), reduced to about 5 GB at Q4_K_M.
        "moe-8x" => (Arch::Llama, moe(24, 2048, 16, 4, 128, 7168, 8, 2)),
        // Qwen3-30B-A3B: 48 layers, 128 experts, top-8.
        "moe-30b" => (Arch::Qwen3Moe, moe(48, 2048, 32, 4, 128, 768, 128, 8)),
        "tiny-dense-1b" => (Arch::Llama, dense(4, 256, 4, 2, 512, 10_000.0)),
        "tiny-dense-8b" => (Arch::Llama, dense(6, 512, 8, 2, 1024, 500_000.0)),
        "tiny-qwen3" => (Arch::Qwen3, Shape { head_dim: 128, ..dense(4, 256, 4, 2, 512, 1_000_000.0) }),
        "tiny-moe-8x" => (Arch::Llama, moe(4, 256, 4, 2, 64, 512, 8, 2)),
        "tiny-moe-30b" => (Arch::Qwen3Moe, moe(4, 256, 4, 2, 128, 256, 16, 4)),
        _ => return None,
    };
    let chat_template = matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe).then(|| QWEN3_TEMPLATE.to_string());
    Some(ForgeSpec { name: canonical.to_string(), arch, shape, quant: QuantMix::Q4KM, seed: 42, router_skew: 0.0, router_locality: 0.0, residual_scale: 1.0, chat_template })
}

fn dense(n_layer: u64, n_embd: u64, n_head: u64, n_head_kv: u64, n_ff: u64, rope_freq_base: f32) -> Shape {
    Shape { n_layer, n_embd, n_head, n_head_kv, head_dim: n_embd / n_head, n_ff, n_expert: 0, n_expert_used: 0, n_ctx_train: 4096, rope_freq_base }
}

#[allow(clippy::too_many_arguments)]
fn moe(n_layer: u64, n_embd: u64, n_head: u64, n_head_kv: u64, head_dim: u64, n_ff: u64, n_expert: u64, n_expert_used: u64) -> Shape {
    Shape { n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_expert, n_expert_used, n_ctx_train: 4096, rope_freq_base: 1_000_000.0 }
}

/// What each tensor is, which decides how its values are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// RMS-norm weights: around 1.
    Norm,
    /// A projection whose input width is `fan_in`.
    Projection { fan_in: u64 },
    /// A projection that writes into the residual stream (attention output, FFN down), scaled
    /// by the spec's residual scale.
    Residual { fan_in: u64 },
    /// Token embeddings, with the shared locality direction.
    Embedding,
    /// Router rows, scaled per expert by the skew.
    Router { fan_in: u64 },
}

/// One tensor of the forged file.
#[derive(Clone, Debug)]
pub struct TensorPlan {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: hypura_gguf::GgmlType,
    pub init: Init,
}

/// llama.cpp's `use_more_bits`: the layers where Q4_K_M spends Q6_K on attn_v and ffn_down.
fn use_more_bits(layer: u64, n_layer: u64) -> bool {
    // Written as llama.cpp writes it (the middle test's first half is implied by the first).
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}

impl ForgeSpec {
    /// Every tensor in file order, with its type under the quantization mix.
    pub fn tensors(&self, n_vocab: u64) -> Vec<TensorPlan> {
        use hypura_gguf::GgmlType;
        let shape = &self.shape;
        let quant = self.quant;
        let pick = |base: GgmlType, more_bits: bool, row: u64| -> GgmlType {
            let wanted = match quant {
                QuantMix::F16 => GgmlType::F16,
                QuantMix::Q8_0 => GgmlType::Q8_0,
                QuantMix::Q4KM if more_bits => GgmlType::Q6_K,
                QuantMix::Q4KM => base,
            };
            // K-quants need rows of 256; llama.cpp falls back to a 32-block type otherwise.
            if row.is_multiple_of(wanted.block_size()) {
                wanted
            } else {
                GgmlType::Q8_0
            }
        };
        let mut plans = Vec::new();
        let mut add = |name: String, dims: Vec<u64>, ggml_type: GgmlType, init: Init| {
            plans.push(TensorPlan { name, dims, ggml_type, init });
        };
        let q_width = shape.n_head * shape.head_dim;
        let kv_width = shape.n_head_kv * shape.head_dim;
        add("token_embd.weight".into(), vec![shape.n_embd, n_vocab], pick(GgmlType::Q4_K, false, shape.n_embd), Init::Embedding);
        for layer in 0..shape.n_layer {
            let more_bits = use_more_bits(layer, shape.n_layer);
            let block = |suffix: &str| format!("blk.{layer}.{suffix}");
            let projection = |fan_in| Init::Projection { fan_in };
            let residual = |fan_in| Init::Residual { fan_in };
            add(block("attn_norm.weight"), vec![shape.n_embd], GgmlType::F32, Init::Norm);
            add(block("attn_q.weight"), vec![shape.n_embd, q_width], pick(GgmlType::Q4_K, false, shape.n_embd), projection(shape.n_embd));
            add(block("attn_k.weight"), vec![shape.n_embd, kv_width], pick(GgmlType::Q4_K, false, shape.n_embd), projection(shape.n_embd));
            add(block("attn_v.weight"), vec![shape.n_embd, kv_width], pick(GgmlType::Q4_K, more_bits, shape.n_embd), projection(shape.n_embd));
            add(block("attn_output.weight"), vec![q_width, shape.n_embd], pick(GgmlType::Q4_K, false, q_width), residual(q_width));
            if self.arch.has_qk_norm() {
                add(block("attn_q_norm.weight"), vec![shape.head_dim], GgmlType::F32, Init::Norm);
                add(block("attn_k_norm.weight"), vec![shape.head_dim], GgmlType::F32, Init::Norm);
            }
            add(block("ffn_norm.weight"), vec![shape.n_embd], GgmlType::F32, Init::Norm);
            if shape.n_expert == 0 {
                add(block("ffn_gate.weight"), vec![shape.n_embd, shape.n_ff], pick(GgmlType::Q4_K, false, shape.n_embd), projection(shape.n_embd));
                add(block("ffn_up.weight"), vec![shape.n_embd, shape.n_ff], pick(GgmlType::Q4_K, false, shape.n_embd), projection(shape.n_embd));
                add(block("ffn_down.weight"), vec![shape.n_ff, shape.n_embd], pick(GgmlType::Q4_K, more_bits, shape.n_ff), residual(shape.n_ff));
            } else {
                // llama.cpp keeps the router in F32.
                add(block("ffn_gate_inp.weight"), vec![shape.n_embd, shape.n_expert], GgmlType::F32, Init::Router { fan_in: shape.n_embd });
                let experts = shape.n_expert;
                add(block("ffn_gate_exps.weight"), vec![shape.n_embd, shape.n_ff, experts], pick(GgmlType::Q4_K, false, shape.n_embd), projection(shape.n_embd));
                add(block("ffn_up_exps.weight"), vec![shape.n_embd, shape.n_ff, experts], pick(GgmlType::Q4_K, false, shape.n_embd), projection(shape.n_embd));
                add(block("ffn_down_exps.weight"), vec![shape.n_ff, shape.n_embd, experts], pick(GgmlType::Q4_K, more_bits, shape.n_ff), residual(shape.n_ff));
            }
        }
        add("output_norm.weight".into(), vec![shape.n_embd], GgmlType::F32, Init::Norm);
        add("output.weight".into(), vec![shape.n_embd, n_vocab], pick(GgmlType::Q6_K, false, shape.n_embd), Init::Projection { fan_in: shape.n_embd });
        plans
    }
}
