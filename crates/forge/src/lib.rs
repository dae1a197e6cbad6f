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
