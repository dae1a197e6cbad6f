//! `Session`: one conversation, run by the engine's one loop (`Batcher`) with one sequence.
//! `generate` drives the loop until the answer is done, streaming text through a callback, and
//! returns Ollama's statistics. The KV cache keeps the conversation, so the next turn reuses
//! its shared prefix.
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::Arc;

use hypura_sys::{SamplerParams, Token};
use serde::Serialize;

use super::batch::{Batcher, SequenceEvent};
use super::chat::AssistantMessage;
use super::prompt::{self, Prompt};
use super::stats::GenerationStats;
use super::{Engine, EngineError};

/// One generation: the prompt and how to answer it.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// None: until end of generation or a full context.
    pub max_tokens: Option<u32>,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    /// A GBNF grammar (root rule `root`) that the answer must follow.
    pub grammar: Option<String>,
    /// Tokens this request may hold in total (prompt and answer); capped at the sequence's
    /// share of the context.
    pub n_ctx: Option<u32>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Return the logits after the prompt's last token (comparisons with llama.cpp).
    pub prompt_logits: bool,
    /// Set from another thread to stop within one step of the loop.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> GenerateRequest {
        GenerateRequest { prompt, max_tokens: None, sampling: SamplerParams::default(), stop: Vec::new(), grammar: None, n_ctx: None, ignore_eos: false, prompt_logits: false, cancel: None }
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

/// One conversation on a one-sequence batcher.
pub struct Session {
    batcher: Batcher,
}

/// A sequence's events, moved out of the batcher's callback.
enum Event {
    Text(String),
    Done(Box<GenerateOutput>),
    Failed(EngineError),
}

impl Session {
    pub fn new(engine: Arc<Engine>) -> Result<Session, EngineError> {
        Ok(Session { batcher: Batcher::new(engine, 1)? })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        self.batcher.engine()
    }

    pub fn n_ctx(&self) -> u32 {
        self.batcher.n_ctx_per_sequence() as u32
    }

    /// Tokenize a prompt the way `generate` does.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<Token>, EngineError> {
        prompt::tokenize(self.engine(), prompt)
    }

    /// Evaluate a prompt from an empty cache and return the logits after its last token
    /// (for comparisons with llama.cpp).
    pub fn prompt_logits(&mut self, prompt: &Prompt) -> Result<Vec<f32>, EngineError> {
        self.reset();
        let request = GenerateRequest { max_tokens: Some(0), sampling: SamplerParams::greedy(), prompt_logits: true, ..GenerateRequest::new(prompt.clone()) };
        let output = self.generate(&request, &mut |_| Control::Continue)?;
        output.prompt_logits.ok_or_else(|| EngineError::Decode("the prompt gave no logits".into()))
    }

    /// Forget the conversation (the KV cache).
    pub fn reset(&mut self) {
        self.batcher.forget_cache();
    }

    /// Generate. `on_text` receives text as it becomes final (never part of a stop string).
    pub fn generate(&mut self, request: &GenerateRequest, on_text: &mut dyn FnMut(&str) -> Control) -> Result<GenerateOutput, EngineError> {
        let (sender, receiver) = mpsc::channel();
        let sink = Box::new(move |event: SequenceEvent<'_>| {
            let _ = sender.send(match event {
                SequenceEvent::Text(text) => Event::Text(text.to_string()),
                // The reasoning is in the output's message; the callback gets the content.
                SequenceEvent::Thinking(_) => return Control::Continue,
                SequenceEvent::Done(finished) => Event::Done(Box::new(finished.output)),
                SequenceEvent::Failed(error) => Event::Failed(error),
            });
            super::Control::Continue
        });
        // The caller's flag aborts a decode in progress (a long prompt) between graph nodes.
        self.batcher.admit(request.clone(), sink).map_err(|(error, _)| error)?;
        // What the callback was given: after it says Stop, the answer ends at once and is what
        // the callback saw.
        let mut seen = String::new();
        let mut stopped = false;
        loop {
            let stepped = self.batcher.step();
            let mut events = receiver.try_iter().peekable();
            if !stepped && events.peek().is_none() {
                return Err(EngineError::Decode("the sequence ended without an answer".into()));
            }
            for event in events {
                match event {
                    Event::Text(text) if !stopped => {
                        seen.push_str(&text);
                        if on_text(&text) == Control::Stop {
                            stopped = true;
                            self.batcher.cancel_all();
                        }
                    }
                    Event::Text(_) => {}
                    Event::Done(mut output) => {
                        if stopped {
                            output.text = seen;
                            output.done_reason = DoneReason::Cancelled;
                        }
                        return Ok(*output);
                    }
                    Event::Failed(error) => return Err(error),
                }
            }
        }
    }
}
