//! `hypura-forge`: synthetic GGUF models that plain llama.cpp loads as real architectures.
//!
//! Real large models cannot be downloaded in our test and benchmark environments, so the
//! forge writes them: any shape up to tens of GB, quantized with ggml's own functions,
//! deterministic from a seed, with a small SentencePiece vocabulary and knobs for router skew
//! and temporal locality. The text they produce is meaningless but their logits are real, so
//! every correctness invariant and benchmark applies to them. Presets are named after the
//! benchmark scenarios (`dense-1b`, `dense-8b`, `moe-8x`, `moe-30b`) plus `tiny-*` variants
//! for tests. `--from-dense` turns a real dense model into a mixture of experts whose router
//! follows the model's own hidden states, for routing traces from real text.
mod arch;
mod from_dense;
mod spec;
mod vocab;
mod write;

use std::path::PathBuf;

pub use arch::{block, Meta, Tensors};
pub use from_dense::{cluster_rows, moe_from_dense, FromDense, FromDenseSummary};
pub use spec::{preset, presets, Arch, ForgeSpec, Init, QuantMix, Shape, TensorPlan, QWEN3_TEMPLATE};
pub use vocab::Vocabulary;
pub use write::{metadata, plan_model, write_model, ForgeSummary};

/// Calls `$callback! { test_name => "tiny-preset", ... }` with every tiny MoE preset, after any
/// pairs given first: the one list the tests make a test per preset from (each test file also
/// checks it against `presets()`).
#[macro_export]
macro_rules! with_tiny_moe_presets {
    ($callback:ident $(, $test:ident => $preset:literal)* $(,)?) => {
        $callback! {
            $($test => $preset,)*
            tiny_moe_8x => "tiny-moe-8x",
            tiny_moe_30b => "tiny-moe-30b",
            tiny_qwen35moe => "tiny-qwen35moe",
            tiny_qwen3next => "tiny-qwen3next",
            tiny_gpt_oss => "tiny-gpt-oss",
            tiny_deepseek2 => "tiny-deepseek2",
            tiny_deepseek4 => "tiny-deepseek4",
            tiny_kimi_k3 => "tiny-kimi-k3",
            tiny_glm4moe => "tiny-glm4moe",
            tiny_glm5_next => "tiny-glm5-next",
            tiny_gemma4 => "tiny-gemma4",
            tiny_llama4 => "tiny-llama4",
            tiny_minimax_m2 => "tiny-minimax-m2",
        }
    };
}

/// Calls `$callback! { test_name => "tiny-preset", ... }` with every tiny preset, dense then MoE
/// (`with_tiny_moe_presets`).
#[macro_export]
macro_rules! with_tiny_presets {
    ($callback:ident) => {
        $crate::with_tiny_moe_presets! {
            $callback,
            tiny_dense_1b => "tiny-dense-1b",
            tiny_dense_8b => "tiny-dense-8b",
            tiny_qwen3 => "tiny-qwen3",
        }
    };
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ForgeError {
    #[error("cannot write {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {reason}")]
    Source { path: PathBuf, reason: String },
    #[error("preset {name}: {reason}")]
    BadShape { name: String, reason: String },
    #[error(transparent)]
    Gguf(#[from] hypura_gguf::GgufError),
    #[error(transparent)]
    Quantize(#[from] hypura_sys::SysError),
}
