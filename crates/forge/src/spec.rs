//! Model specifications: architecture, shape, quantization mix, seed and routing knobs, and the
//! named presets that the benchmark scenarios use.
use std::fmt;

/// The llama.cpp architectures the forge writes, each named by its `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `llama`: dense (TinyLlama, Llama 3) or, with experts, the Mixtral layout.
    Llama,
    /// `qwen3`: dense with per-head q/k norms.
    Qwen3,
    /// `qwen3moe`: Qwen3-30B-A3B layout (q/k norms, many small experts).
    Qwen3Moe,
    /// `qwen35moe`: Qwen3.5/3.6 MoE: gated delta-net and attention layers, a gated shared expert.
    Qwen35Moe,
    /// `qwen3next`: Qwen3-Next, the hybrid layout before Qwen3.5.
    Qwen3Next,
    /// `gpt-oss`: MXFP4 experts with biases, attention sinks, a sliding window.
    GptOss,
    /// `deepseek2`: DeepSeek-V3/R1 and Kimi-K2: MLA attention, leading dense layers, shared
    /// experts, `exp_probs_b`.
    Deepseek2,
    /// `deepseek4`: DeepSeek-V4.
    Deepseek4,
    /// `kimi-k3`: Kimi-K3.
    KimiK3,
    /// `glm4moe`: GLM-4.5/4.6: leading dense layers, a shared expert, an MTP layer.
    Glm4Moe,
    /// `glm5-next`: GLM-5.
    Glm5Next,
    /// `gemma4`: Gemma 4 (MoE).
    Gemma4,
    /// `llama4`: Llama 4: MoE and dense layers interleaved, a shared expert.
    Llama4,
    /// `minimax-m2`: MiniMax-M2.
    MinimaxM2,
}

impl Arch {
    pub const ALL: [Arch; 14] = [
        Arch::Llama,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Qwen35Moe,
        Arch::Qwen3Next,
        Arch::GptOss,
        Arch::Deepseek2,
        Arch::Deepseek4,
        Arch::KimiK3,
        Arch::Glm4Moe,
        Arch::Glm5Next,
        Arch::Gemma4,
        Arch::Llama4,
        Arch::MinimaxM2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen35Moe => "qwen35moe",
            Arch::Qwen3Next => "qwen3next",
            Arch::GptOss => "gpt-oss",
            Arch::Deepseek2 => "deepseek2",
            Arch::Deepseek4 => "deepseek4",
            Arch::KimiK3 => "kimi-k3",
            Arch::Glm4Moe => "glm4moe",
            Arch::Glm5Next => "glm5-next",
            Arch::Gemma4 => "gemma4",
            Arch::Llama4 => "llama4",
            Arch::MinimaxM2 => "minimax-m2",
        }
    }

    pub fn parse(text: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|arch| arch.name() == text)
    }

    pub(crate) fn has_qk_norm(self) -> bool {
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

/// Shape in llama.cpp's hparam words. Each architecture's module derives the widths it has
/// beyond these (latent ranks, recurrent state, windows) from them.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// Width of the shared expert(s) beside the routed ones; 0 for none.
    pub n_ff_shared: u64,
    /// Leading layers with a dense FFN instead of experts (DeepSeek, GLM); 0 for none.
    pub n_dense_lead: u64,
    /// Width of the dense FFN layers of an MoE model (its `feed_forward_length`); 0 for none.
    pub n_ff_dense: u64,
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
    /// The output matrix makes greedy text walk the vocabulary: each ordinary token's logits
    /// peak at its successor in one long cycle through the ordinary tokens (row j of
    /// `output.weight` is the embedding of the token before j). A random output matrix makes
    /// greedy text fall into short loops, and a loop repeats its routing, which no real model's
    /// text does. Where the model has no output matrix (tied to the embedding) it does nothing.
    pub varied_text: bool,
    /// With varied text, how strongly a token's embedding carries the topic of its place in
    /// the text (0: none), and over how many tokens that topic drifts (`write::topic_rows`):
    /// the temporal locality of routing, which real text has and the forge's other settings
    /// lack (consecutive tokens pick many of the same experts).
    pub topic_strength: f32,
    pub topic_span: f32,
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

    /// Every tensor in file order, with its type under the quantization mix.
    pub fn tensors(&self, n_vocab: u64) -> Vec<TensorPlan> {
        crate::arch::tensors(self, n_vocab)
    }
}

/// The benchmark presets and the tiny variants of the classic layouts; every other
/// architecture's presets come from its module (`tiny-<arch>`, and full shapes).
const CLASSIC_PRESETS: &[&str] = &[
    "dense-1b",
    "dense-8b",
    "moe-8x",
    "moe-30b",
    "tiny-dense-1b",
    "tiny-dense-8b",
    "tiny-qwen3",
    "tiny-moe-8x",
    "tiny-moe-30b",
];

/// Names of all presets, for help text and tests.
pub fn presets() -> Vec<&'static str> {
    let mut names = CLASSIC_PRESETS.to_vec();
    for definition in crate::arch::DEFINITIONS {
        names.extend((definition.presets)().into_iter().map(|(name, _)| name));
    }
    names
}

/// The routing settings an MoE preset gets by default, calibrated so that greedy text (128
/// tokens after each of four short prompts, `hypura run --trace`, then `hypura simulate`)
/// routes as Qwen3-30B-A3B's recorded picks do (`data/routing/`: the top tenth of a layer's
/// experts take 0.27 of picks, a token picks 0.42 of the last one's experts again, an LRU of a
/// quarter of a layer's experts hits 0.75), on narrow models of the presets' layers, experts and
/// top-k (docs/benchmarks/2026-12-06-real-routing/): `moe-30b`'s 128 experts gave 0.26, 0.43 and
/// 0.74; `qwen3.6-35b-a3b`'s 256 (sparser: a token picks 8) 0.31, 0.41 and 0.74.
pub struct RoutingDefaults {
    pub router_skew: f32,
    pub residual_scale: f32,
    pub topic_strength: f32,
    pub topic_span: f32,
}

impl RoutingDefaults {
    /// The calibrated settings nearest a model of `n_expert` experts.
    pub fn real(n_expert: u64) -> RoutingDefaults {
        if n_expert >= 192 {
            RoutingDefaults { router_skew: 0.2, residual_scale: 0.1, topic_strength: 1.4, topic_span: 12.0 }
        } else {
            RoutingDefaults { router_skew: 0.6, residual_scale: 0.1, topic_strength: 1.1, topic_span: 10.0 }
        }
    }
}

/// A named preset. `tiny-dense`, `tiny-moe` and `tiny-moe30b` are aliases.
pub fn preset(name: &str) -> Option<ForgeSpec> {
    let canonical = match name {
        "tiny-dense" => "tiny-dense-1b",
        "tiny-moe" => "tiny-moe-8x",
        "tiny-moe30b" => "tiny-moe-30b",
        other => other,
    };
    let (name, arch, shape) = match classic(canonical) {
        Some((arch, shape)) => (canonical, arch, shape),
        None => crate::arch::DEFINITIONS.iter().find_map(|definition| {
            (definition.presets)()
                .into_iter()
                .find(|(preset, _)| *preset == canonical)
                .map(|(preset, shape)| (preset, definition.arch, shape))
        })?,
    };
    let chat_template = matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe).then(|| QWEN3_TEMPLATE.to_string());
    let moe = shape.n_expert > 0;
    let routing = RoutingDefaults::real(shape.n_expert);
    Some(ForgeSpec {
        name: name.to_string(),
        arch,
        shape,
        quant: QuantMix::Q4KM,
        seed: 42,
        router_skew: if moe { routing.router_skew } else { 0.0 },
        router_locality: 0.0,
        residual_scale: if moe { routing.residual_scale } else { 1.0 },
        varied_text: moe,
        topic_strength: if moe { routing.topic_strength } else { 0.0 },
        topic_span: routing.topic_span,
        chat_template,
    })
}

fn classic(name: &str) -> Option<(Arch, Shape)> {
    Some(match name {
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
    })
}

pub(crate) fn dense(n_layer: u64, n_embd: u64, n_head: u64, n_head_kv: u64, n_ff: u64, rope_freq_base: f32) -> Shape {
    Shape {
        n_layer,
        n_embd,
        n_head,
        n_head_kv,
        head_dim: n_embd / n_head,
        n_ff,
        n_ctx_train: 4096,
        rope_freq_base,
        ..Shape::default()
    }
}

/// An MoE shape: `n_ff` is each routed expert's width.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe(
    n_layer: u64,
    n_embd: u64,
    n_head: u64,
    n_head_kv: u64,
    head_dim: u64,
    n_ff: u64,
    n_expert: u64,
    n_expert_used: u64,
) -> Shape {
    Shape {
        n_layer,
        n_embd,
        n_head,
        n_head_kv,
        head_dim,
        n_ff,
        n_expert,
        n_expert_used,
        n_ctx_train: 4096,
        rope_freq_base: 1_000_000.0,
        ..Shape::default()
    }
}

/// What each tensor is, which decides how its values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// `output.weight` under `ForgeSpec::varied_text`: row j is the embedding of j's
    /// predecessor in the cycle through the ordinary tokens, at unit norm.
    Successor,
    /// Router rows, scaled per expert by the skew.
    Router { fan_in: u64 },
    /// Uniform in `low..high`: biases, recurrent-state parameters, sinks.
    Uniform { low: f32, high: f32 },
    /// I32 rows of distinct expert ids below `n_expert` (DeepSeek-V4's token-to-expert table
    /// of its hash-routed layers).
    ExpertIds { n_expert: u64 },
}

/// One tensor of the forged file.
#[derive(Clone, Debug)]
pub struct TensorPlan {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: hypura_gguf::GgmlType,
    pub init: Init,
}
