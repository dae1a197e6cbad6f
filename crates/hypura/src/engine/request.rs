//! `GenerateRequest`: one generation, as it travels from whoever asks for it (the CLI, the
//! benchmark, an HTTP handler) to the batcher's slot that runs it, the way llama.cpp's server
//! moves one `task_params` from its handler to its slot; and what the generation gives back
//! (`GenerateOutput`). The server wraps a request with what is only its own (the reply
//! channel, the guard that cancels when the client goes) and never copies its fields.
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use hypura_sys::{SamplerParams, Token};
use serde::Serialize;

use super::chat::AssistantMessage;
use super::prompt::Prompt;
use super::stats::GenerationStats;

/// One generation: the prompt and how to answer it.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Token ids put before the prompt: Ollama's `context`, the tokens of an earlier exchange.
    /// The prompt after them is rendered and tokenized as usual, without a BOS of its own.
    pub context: Vec<Token>,
    /// None: until end of generation or a full context.
    pub max_tokens: Option<u32>,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    /// A GBNF grammar (root rule `root`) that the answer must follow.
    pub grammar: Option<String>,
    /// Tokens this request may hold in total (prompt and answer); capped at the sequence's
    /// share of the context.
    pub n_ctx_seq: Option<u32>,
    /// A conversation longer than the context loses its oldest messages (Ollama's `truncate`,
    /// on by default there) instead of being refused as too long.
    pub truncate_history: bool,
    /// Some(n): when the context fills during the answer, the sequence keeps its first `n`
    /// tokens (at most the prompt's), drops half of the rest and goes on (Ollama's `shift`, with
    /// `num_keep`); an answer without `max_tokens` then ends at ten times the context, as
    /// Ollama's does. None: the answer ends there, `length` (llama-server's default).
    pub shift_keep: Option<u32>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Return the logits after the prompt's last token (comparisons with llama.cpp).
    pub prompt_logits: bool,
    /// Set from another thread to stop within one step of the loop.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> GenerateRequest {
        GenerateRequest {
            prompt,
            context: Vec::new(),
            max_tokens: None,
            sampling: SamplerParams::default(),
            stop: Vec::new(),
            grammar: None,
            n_ctx_seq: None,
            truncate_history: false,
            shift_keep: None,
            ignore_eos: false,
            prompt_logits: false,
            cancel: None,
        }
    }
}

/// What the text callback wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    Stop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DoneReason {
    /// End of generation token or a stop string.
    Stop,
    /// max_tokens reached or the context is full.
    Length,
    /// Cancelled by the caller or the callback.
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    /// The generated text as the model wrote it (tool-call markup included).
    pub text: String,
    /// A conversation's answer read back: content, reasoning and tool calls (None for plain
    /// prompts, and for templates with neither tools nor reasoning, whose answer is `text`).
    pub message: Option<AssistantMessage>,
    pub tokens: Vec<Token>,
    pub done_reason: DoneReason,
    pub stats: GenerationStats,
    /// The logits after the prompt's last token, when the request asked for them.
    pub prompt_logits: Option<Vec<f32>>,
}
