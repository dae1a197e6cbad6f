//! `Session`: one conversation on one context. Generation streams text through a callback and
//! returns Ollama's statistics.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypura_sys::{Batch, Context, Sampler, SamplerParams, SysError, Token};
use serde::{Deserialize, Serialize};

use super::text::{StopMatcher, StopScan, Utf8Stream};
use super::{Engine, EngineError};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text passed to the tokenizer as is (BOS added when the model wants it).
    Raw(String),
    /// A conversation rendered with the model's chat template, the assistant's turn opened.
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are (benchmarks, and Ollama's `context`).
    Tokens(Vec<Token>),
}

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// None: until end of generation or a full context.
    pub max_tokens: Option<u32>,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Set from another thread to stop within one token.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> GenerateRequest {
        GenerateRequest { prompt, max_tokens: None, sampling: SamplerParams::default(), stop: Vec::new(), ignore_eos: false, cancel: None }
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

/// Ollama's statistics, as durations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationStats {
    pub load_duration: Duration,
    /// Tokens actually evaluated for the prompt (a reused prefix is not counted).
    pub prompt_eval_count: u32,
    pub prompt_eval_duration: Duration,
    pub eval_count: u32,
    pub eval_duration: Duration,
    pub total_duration: Duration,
    /// Prompt tokens whose KV entries were reused from the previous turn.
    pub reused_prompt_tokens: u32,
    /// Streaming I/O during this request (streaming modes only).
    pub io: Option<crate::store::IoSnapshot>,
    /// Expert cache hits and misses during this request (expert-stream only).
    pub experts: Option<crate::store::ExpertSnapshot>,
    /// Time the generation phase (after the prompt) waited on streamed reads.
    pub eval_stall: Duration,
}

impl GenerationStats {
    pub fn prompt_tokens_per_sec(&self) -> f64 {
        rate(self.prompt_eval_count, self.prompt_eval_duration)
    }

    pub fn eval_tokens_per_sec(&self) -> f64 {
        rate(self.eval_count, self.eval_duration)
    }

    /// Generation time per token that was not spent waiting on reads: the compute term of the
    /// physical limit. None without generated tokens.
    pub fn eval_compute_seconds_per_token(&self) -> Option<f64> {
        (self.eval_count > 0).then(|| self.eval_duration.saturating_sub(self.eval_stall).as_secs_f64() / f64::from(self.eval_count))
    }
}

fn rate(count: u32, duration: Duration) -> f64 {
    if duration.is_zero() {
        0.0
    } else {
        f64::from(count) / duration.as_secs_f64()
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub text: String,
    pub tokens: Vec<Token>,
    pub done_reason: DoneReason,
    pub stats: GenerationStats,
}

/// One conversation: a context whose KV cache holds `cached` tokens of sequence 0.
pub struct Session {
    engine: Arc<Engine>,
    context: Context,
    cached: Vec<Token>,
    batch: Batch,
}

impl Session {
    pub fn new(engine: Arc<Engine>) -> Result<Session, EngineError> {
        let params = engine.context_params();
        let context = Context::new(engine.model(), &params)?;
        let batch = Batch::new(params.n_batch as usize, 1);
        Ok(Session { engine, context, cached: Vec::new(), batch })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn n_ctx(&self) -> u32 {
        self.context.n_ctx()
    }

    /// Tokenize a prompt the way `generate` does.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<Token>, EngineError> {
        let vocab = self.engine.model().vocab();
        let text = match prompt {
            Prompt::Tokens(tokens) => {
                let n_vocab = vocab.n_tokens();
                if let Some(&bad) = tokens.iter().find(|&&token| token < 0 || token >= n_vocab) {
                    return Err(SysError::BadToken { token: bad, n_vocab }.into());
                }
                return Ok(tokens.clone());
            }
            Prompt::Raw(text) => text.clone(),
            Prompt::Chat(messages) => self.engine.template().render(messages, true).map_err(|reason| EngineError::Template {
                path: self.engine.inventory().path.clone(),
                reason,
            })?,
        };
        let mut tokens = vocab.tokenize(&text, true, true)?;
        // Templates that write the BOS text themselves would get a second BOS.
        if tokens.len() >= 2 && tokens[0] == vocab.bos() && tokens[1] == vocab.bos() {
            tokens.remove(0);
        }
        Ok(tokens)
    }

    /// Evaluate a prompt from an empty cache and return the logits after its last token
    /// (for comparisons with llama.cpp).
    pub fn prompt_logits(&mut self, prompt: &Prompt) -> Result<Vec<f32>, EngineError> {
        let tokens = self.tokenize_prompt(prompt)?;
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.reset();
        self.arm_abort(None);
        self.decode_tokens(&tokens)?;
        Ok(self.context.logits(-1)?.to_vec())
    }

    /// A cancel flag aborts a decode in progress (a long prefill) between graph nodes, and so
    /// does a streaming read failure, before any node computes on missing weights.
    fn arm_abort(&mut self, cancel: Option<Arc<AtomicBool>>) {
        let mut flags = vec![cancel.unwrap_or_default()];
        if let Some(streaming) = self.engine.streaming() {
            streaming.driver.take_failure();
            flags.push(streaming.driver.abort_flag());
        }
        self.context.set_abort_flags(flags);
    }

    /// Forget the conversation (the KV cache).
    pub fn reset(&mut self) {
        self.context.clear_memory();
        self.cached.clear();
    }

    /// Generate. `on_text` receives text as it becomes final (never part of a stop string).
    pub fn generate(&mut self, request: &GenerateRequest, on_text: &mut dyn FnMut(&str) -> Control) -> Result<GenerateOutput, EngineError> {
        let started = Instant::now();
        request.sampling.validate()?;
        let prompt = self.tokenize_prompt(&request.prompt)?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let n_ctx = self.context.n_ctx();
        if prompt.len() >= n_ctx as usize {
            return Err(EngineError::PromptTooLong { tokens: prompt.len(), n_ctx });
        }
        self.arm_abort(request.cancel.clone());
        let cancelled = || request.cancel.as_ref().is_some_and(|flag| flag.load(Ordering::Relaxed));

        let mut stats = GenerationStats { load_duration: self.engine.load_duration(), ..GenerationStats::default() };
        let io_before = self.engine.streaming().map(|streaming| streaming.stats.snapshot());
        let experts_before = self.engine.streaming().and_then(|streaming| streaming.driver.experts()).map(|experts| experts.snapshot());
        let reused = self.reuse_prefix(&prompt);
        stats.reused_prompt_tokens = reused as u32;
        let prefill_started = Instant::now();
        match self.decode_tokens(&prompt[reused..]) {
            Err(EngineError::Sys(SysError::Aborted)) if cancelled() => {
                self.reset();
                stats.total_duration = started.elapsed();
                return Ok(GenerateOutput { text: String::new(), tokens: Vec::new(), done_reason: DoneReason::Cancelled, stats });
            }
            other => other?,
        }
        // On a GPU the decode is still running: the prompt's time includes finishing it.
        self.context.synchronize();
        stats.prompt_eval_count = (prompt.len() - reused) as u32;
        stats.prompt_eval_duration = prefill_started.elapsed();

        let mut sampler = Sampler::new(&request.sampling, &self.context)?;
        for &token in &prompt {
            sampler.accept(token);
        }
        let vocab = self.engine.model().vocab();
        let mut utf8 = Utf8Stream::default();
        let mut stops = StopMatcher::new(&request.stop);
        let mut text = String::new();
        let mut tokens = Vec::new();
        let eval_started = Instant::now();
        let eval_stall_before = self.engine.streaming().map(|streaming| streaming.stats.snapshot().stall_seconds);
        let mut emit = |piece: &str, text: &mut String| -> Control {
            if piece.is_empty() {
                return Control::Continue;
            }
            text.push_str(piece);
            on_text(piece)
        };
        let done_reason = loop {
            if cancelled() {
                break DoneReason::Cancelled;
            }
            if request.max_tokens.is_some_and(|limit| tokens.len() >= limit as usize) {
                break DoneReason::Length;
            }
            let token = sampler.sample(&mut self.context, -1)?;
            if !request.ignore_eos && vocab.is_end_of_generation(token) {
                break DoneReason::Stop;
            }
            tokens.push(token);
            let piece = utf8.push(&vocab.token_bytes(token, false)?);
            match stops.push(&piece) {
                StopScan::Stopped(before) => {
                    emit(&before, &mut text);
                    break DoneReason::Stop;
                }
                StopScan::Continue(ready) => {
                    if emit(&ready, &mut text) == Control::Stop {
                        break DoneReason::Cancelled;
                    }
                }
            }
            if self.cached.len() + 1 >= n_ctx as usize {
                break DoneReason::Length;
            }
            match self.decode_tokens(&[token]) {
                Err(EngineError::Sys(SysError::Aborted)) if cancelled() => break DoneReason::Cancelled,
                other => other?,
            }
        };
        self.context.synchronize();
        stats.eval_count = tokens.len() as u32;
        stats.eval_duration = eval_started.elapsed();
        if let (Some(before), Some(streaming)) = (eval_stall_before, self.engine.streaming()) {
            stats.eval_stall = Duration::from_secs_f64((streaming.stats.snapshot().stall_seconds - before).max(0.0));
        }
        if done_reason != DoneReason::Cancelled {
            let rest = utf8.finish();
            let tail = match stops.push(&rest) {
                StopScan::Stopped(before) => before,
                StopScan::Continue(ready) => ready + &stops.finish(),
            };
            emit(&tail, &mut text);
        }
        stats.total_duration = started.elapsed();
        if let (Some(before), Some(streaming)) = (io_before, self.engine.streaming()) {
            stats.io = Some(streaming.stats.snapshot() - before);
            if let (Some(before), Some(experts)) = (experts_before, streaming.driver.experts()) {
                stats.experts = Some(experts.snapshot() - before);
            }
        }
        Ok(GenerateOutput { text, tokens, done_reason, stats })
    }

    /// Keep the KV entries of the longest prefix shared with the previous prompt and answer,
    /// dropping the rest. At least one prompt token is always decoded again so that there are
    /// logits to sample from.
    fn reuse_prefix(&mut self, prompt: &[Token]) -> usize {
        let shared = self.cached.iter().zip(prompt).take_while(|(cached, new)| cached == new).count();
        let keep = shared.min(prompt.len() - 1);
        if keep == self.cached.len() {
            return keep;
        }
        // Sliding-window caches cannot drop a tail; then start over.
        if keep > 0 && self.context.truncate_sequence(0, keep as i32) {
            self.cached.truncate(keep);
            keep
        } else {
            self.reset();
            0
        }
    }

    /// Decode tokens after the cached ones, in batches of n_batch; the last token gets logits.
    fn decode_tokens(&mut self, tokens: &[Token]) -> Result<(), EngineError> {
        let capacity = self.batch.capacity();
        for (chunk_index, chunk) in tokens.chunks(capacity).enumerate() {
            let is_last_chunk = (chunk_index + 1) * capacity >= tokens.len();
            self.batch.clear();
            for (offset, &token) in chunk.iter().enumerate() {
                let position = (self.cached.len() + offset) as i32;
                self.batch.push(token, position, &[0], is_last_chunk && offset + 1 == chunk.len())?;
            }
            let observations_before = self.engine.streaming().map(|streaming| streaming.observations());
            if let Err(error) = self.context.decode(&self.batch) {
                // The KV cache may hold part of this batch: start the next request from scratch.
                self.reset();
                // A read failure aborts the graph from the eval hook: report the read, not the abort.
                if let Some(failure) = self.engine.streaming().and_then(|streaming| streaming.driver.take_failure()) {
                    return Err(EngineError::Store(failure.to_string()));
                }
                return Err(error.into());
            }
            if let (Some(before), Some(streaming)) = (observations_before, self.engine.streaming()) {
                if let Err(error) = streaming.ensure_hook_fired(before) {
                    self.reset();
                    return Err(error);
                }
            }
            self.cached.extend_from_slice(chunk);
        }
        Ok(())
    }
}
