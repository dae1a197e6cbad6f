//! The engine: loads a model through `hypura-sys` and runs generation. It is the one API that
//! the CLI, the benchmark and the server use, and the only door above `hypura-sys`.
//!
//! Data flow: `Engine::load` takes the inventory the plan was made from (so a bad file is a
//! typed error, never a ggml abort) and loads the file with llama.cpp. `prompt` renders chat
//! templates and tokenizes. `Batcher` is the one generation loop: it reuses the KV cache for a
//! shared prefix, prefills in batches and decodes every active sequence together with its own
//! sampler chain, streaming text out through a callback; `Session` is that loop with one
//! sequence. `stats` holds what a generation measured.
pub mod batch;
pub mod chat;
mod embed;
mod load;
pub mod prompt;
mod session;
pub mod setup;
mod stats;
mod text;

use std::path::PathBuf;

pub use batch::{Batcher, Finished, SequenceEvent, SequenceSink};
pub use chat::{AssistantMessage, ChatDelta, ChatMessage, ChatRequest, ChatTemplate, TemplateCaps, Think, ToolCall, ToolChoice};
pub use embed::{Embedder, Embedding};
pub use load::{Engine, EngineOptions, Speculation, StreamDriver, Streaming, DEFAULT_NGRAM};
pub use prompt::Prompt;
pub use session::{Control, DoneReason, GenerateOutput, GenerateRequest, Session};
pub use stats::{DecodeLimit, DiskWhileBusy, GenerationStats};
pub use text::{StopMatcher, Utf8Stream};

pub use hypura_sys::{json_schema_to_grammar, LoadMode, SamplerParams, SysError, Token};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Sys(#[from] hypura_sys::SysError),
    /// Worded as agents' overflow detectors expect ("prompt is too long", "exceeds the context
    /// length"), so a client compacts its history and retries instead of giving up.
    #[error("the prompt is too long: {tokens} tokens exceed the context length of {n_ctx}; use a larger --context (num_ctx) or a shorter prompt")]
    PromptTooLong { tokens: usize, n_ctx: u32 },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("weight streaming: {0}")]
    Store(String),
    #[error("decoding: {0}")]
    Decode(String),
    /// The model cannot do what the request asks (tools without a template that renders them).
    #[error("{0}")]
    Unsupported(String),
    #[error("chat template of {path}: {reason}")]
    Template { path: PathBuf, reason: String },
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
}
