//! The engine: loads a model through `hypura-sys` and runs generation sessions. It is the one
//! API that the CLI, the benchmark and the server use.
//!
//! Data flow: `Engine::load` validates the file with the pure inventory first (so a bad file is
//! a typed error, never a ggml abort), then loads it with llama.cpp. `Session::generate` renders
//! the chat template, tokenizes, reuses the KV cache for a shared prefix, prefills in batches,
//! then decodes token by token with the sampler chain, streaming text out through a callback.
pub mod batch;
mod load;
mod session;
mod template;
mod text;

use std::path::PathBuf;

pub use batch::{Batcher, Finished, SequenceEvent, SequenceRequest, SequenceSink};
pub use load::{Engine, EngineOptions, StreamDriver, Streaming};
pub use session::{ChatMessage, Control, DoneReason, GenerateOutput, GenerateRequest, GenerationStats, Prompt, Session};
pub use template::ChatTemplate;
pub use text::{StopMatcher, Utf8Stream};

pub use hypura_sys::SamplerParams;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Sys(#[from] hypura_sys::SysError),
    #[error("the prompt is {tokens} tokens but the context holds {n_ctx}; use a larger --context or a shorter prompt")]
    PromptTooLong { tokens: usize, n_ctx: u32 },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("weight streaming: {0}")]
    Store(String),
    #[error("chat template of {path}: {reason}")]
    Template { path: PathBuf, reason: String },
}
