//! `Session`: one conversation, run by the engine's one loop (`Batcher`) with one sequence.
//! `generate` drives the loop until the answer is done, streaming text through a callback, and
//! returns Ollama's statistics. The KV cache keeps the conversation, so the next turn reuses
//! its shared prefix.
use std::sync::mpsc;
use std::sync::Arc;

use hypura_sys::{SamplerParams, Token};

use super::batch::{Batcher, SequenceEvent};
use super::prompt::{self, Prompt};
use super::request::{Control, DoneReason, GenerateOutput, GenerateRequest};
use super::{Engine, EngineError};

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

    pub fn n_ctx_seq(&self) -> u32 {
        self.batcher.n_ctx_seq() as u32
    }

    /// Tokenize a prompt the way `generate` does.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<Token>, EngineError> {
        prompt::tokenize(self.engine(), prompt)
    }

    /// Evaluate a prompt from an empty cache and return the logits after its last token
    /// (for comparisons with llama.cpp).
    pub fn prompt_logits(&mut self, prompt: &Prompt) -> Result<Vec<f32>, EngineError> {
        self.reset();
        let request = GenerateRequest {
            max_tokens: Some(0),
            sampling: SamplerParams::greedy(),
            prompt_logits: true,
            ..GenerateRequest::new(prompt.clone())
        };
        let output = self.generate(&request, &mut |_| Control::Continue)?;
        output.prompt_logits.ok_or_else(|| EngineError::Decode("the prompt gave no logits".into()))
    }

    /// Forget the conversation (the KV cache).
    pub fn reset(&mut self) {
        self.batcher.forget_cache();
    }

    /// Generate. `on_text` receives text as it becomes final (never part of a stop string).
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        on_text: &mut dyn FnMut(&str) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        let (sender, receiver) = mpsc::channel();
        let sink = Box::new(move |event: SequenceEvent<'_>| {
            let _ = sender.send(match event {
                SequenceEvent::Text(text) => Event::Text(text.to_string()),
                // The reasoning is in the output's message; the callback gets the content.
                SequenceEvent::Thinking(_) => return Control::Continue,
                SequenceEvent::Done(finished) => Event::Done(Box::new(finished.output)),
                SequenceEvent::Failed(error) => Event::Failed(error),
            });
            Control::Continue
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
