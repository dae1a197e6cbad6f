//! The engine: loads a model through `hypura-sys` and runs generation. It is the one API that
//! the CLI, the benchmark and the server generate through; the other modules that name
//! `hypura-sys` are listed in ARCHITECTURE.md ("The FFI fence").
//!
//! Data flow: `Engine::load` takes the inventory the plan was made from (so a bad file is a
//! typed error, never a ggml abort) and loads the file with llama.cpp. A `GenerateRequest`
//! (`request`) carries one generation from its caller to a batcher's slot. `prompt` renders
//! chat templates and tokenizes. `Batcher` is the one generation loop: it reuses the KV cache
//! for a shared prefix, prefills in batches and decodes every active sequence together with
//! its own sampler chain, streaming text out through a callback; `Session` is that loop with
//! one sequence. `stats` holds what a generation measured.
pub mod batch;
pub mod chat;
mod embed;
mod load;
pub mod prompt;
pub mod prompt_cache;
pub mod request;
mod session;
mod stats;
mod text;

use std::path::PathBuf;

pub use batch::{Batcher, Finished, Parked, SequenceEvent, SequenceSink};
pub use chat::{
    AssistantMessage, ChatDelta, ChatMessage, ChatRequest, ChatTemplate, TemplateCaps, Think, ToolCall, ToolChoice,
};
pub use embed::{Embedder, Embedding};
pub use load::{Engine, EngineOptions, Speculation, StreamDriver, Streaming, DEFAULT_NGRAM};
pub use prompt::Prompt;
pub use request::{Control, DoneReason, GenerateOutput, GenerateRequest};
pub use session::Session;
pub use stats::{DecodeLimit, DiskWhileBusy, GenerationStats, LimitFacts, TierFigures};
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
    #[error("the prompt is too long: {tokens} tokens exceed the context length of {n_ctx_seq}; use a larger --context (num_ctx) or a shorter prompt")]
    PromptTooLong { tokens: usize, n_ctx_seq: u32 },
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The weight store failed: setting up its streams, a read a decode waited for, or an eval
    /// hook that never drove them.
    #[error("weight streaming: {0}")]
    Store(#[from] crate::store::StoreError),
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
    #[error(transparent)]
    PromptCache(#[from] prompt_cache::PromptCacheError),
    /// Every sequence of the batcher's context is running (`Batcher::admit` was called
    /// without a free slot).
    #[error("all {n_sequences} sequences of the context are busy; admit only when free_slots() > 0")]
    Busy { n_sequences: usize },
}
