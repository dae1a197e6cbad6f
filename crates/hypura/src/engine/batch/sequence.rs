//! One running sequence of the `Batcher`, its state kept by concern: what its request asked of
//! the sampler (`Sampling`), its tokens on their way into the batch (`Feed`, the speculative
//! draft included), its answer on its way out (`Output`: UTF-8 assembly, stop strings, a
//! conversation's parser, the callback), and what it measured (`Statistics`). The batcher
//! decides when a sequence samples, stops or fails; the sequence turns that into events.
use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypura_sys::{Grammar, Sampler, Token, Vocab};

use super::{Finished, SequenceEvent, SequenceSink};
use crate::engine::chat::{AssistantMessage, ChatStream};
use crate::engine::request::{Control, DoneReason, GenerateOutput};
use crate::engine::stats::{Counters, GenerationStats};
use crate::engine::text::{StopMatcher, StopScan, Utf8Stream};
use crate::engine::{Engine, EngineError};

/// A sequence admitted into a slot.
pub(super) struct Active {
    /// Set by the requester to stop the sequence within one step.
    pub cancel: Arc<AtomicBool>,
    pub sampling: Sampling,
    pub feed: Feed,
    pub output: Output,
    pub statistics: Statistics,
}

/// How the next token is chosen, and when the answer is long enough.
pub(super) struct Sampling {
    pub sampler: Sampler,
    pub grammar: Option<Grammar>,
    pub max_tokens: Option<u32>,
    pub ignore_eos: bool,
    /// Tokens the sequence may hold, prompt and answer.
    pub limit: usize,
    /// Shift the context when it fills, keeping this many tokens at its start.
    pub shift_keep: Option<usize>,
}

/// Tokens on their way into the batch.
pub(super) struct Feed {
    pub prompt: Vec<Token>,
    /// Index of the next prompt token to decode.
    pub next_prompt: usize,
    /// A prompt length to stop a chunk at and snapshot the sequence (`Batcher::checkpoint`).
    pub checkpoint: Option<usize>,
    /// A sampled token not yet decoded.
    pub pending: Option<Token>,
    /// Drafted tokens queued after `pending` in the batch being decoded, each with logits.
    pub draft: Vec<Token>,
    /// Tokens of this sequence in the batch being decoded.
    pub queued: Vec<Token>,
    /// Whether `queued` holds a generated token (not a prompt chunk).
    pub queued_generated: bool,
    /// Row of this sequence's logits in the last decoded batch.
    pub logits_row: Option<i32>,
    /// Set once the context has shifted: the KV cells from here on no longer hold what a fresh
    /// evaluation of the tokens would, so they are dropped when the sequence ends.
    pub shifted_after: Option<usize>,
}

/// The answer on its way to the requester.
pub(super) struct Output {
    pub generated: Vec<Token>,
    pub text: String,
    pub utf8: Utf8Stream,
    pub stops: StopMatcher,
    /// The text is final (a stop string matched): nothing held back is flushed.
    pub flushed: bool,
    /// Reads a conversation's answer into content, reasoning and tool calls.
    pub chat: Option<ChatStream>,
    /// Control tokens whose text stays in the output (a template's tool-call markers).
    pub keep_special: HashSet<Token>,
    /// Keep the logits after the prompt's last token (comparisons with llama.cpp).
    pub keep_prompt_logits: bool,
    pub prompt_logits: Option<Vec<f32>>,
    pub sink: SequenceSink,
}

/// What the sequence measured.
pub(super) struct Statistics {
    pub stats: GenerationStats,
    pub started: Instant,
    /// Streaming counters when the sequence was admitted.
    pub counters: Counters,
    /// When the prompt was done, and the streaming and link counters then.
    pub eval_started: Option<(Instant, Counters)>,
    /// Generated tokens decoded so far.
    pub decodes: u32,
}

impl Active {
    /// Whether the answer has all the tokens its request allows.
    pub fn at_max_tokens(&self) -> bool {
        self.sampling.max_tokens.is_some_and(|limit| self.output.generated.len() >= limit as usize)
    }

    pub fn fail(mut self, error: EngineError) {
        (self.output.sink)(SequenceEvent::Failed(error));
    }

    /// End the sequence: flush held-back text (unless cancelled) and send the statistics.
    pub fn finish(mut self, engine: &Engine, done_reason: DoneReason) {
        let message = self.output.finish(done_reason);
        let mut stats = self.statistics.finish(engine);
        stats.eval_count = self.output.generated.len() as u32;
        let output = GenerateOutput {
            text: self.output.text,
            message,
            tokens: self.output.generated,
            done_reason,
            stats,
            prompt_logits: self.output.prompt_logits,
        };
        (self.output.sink)(SequenceEvent::Done(Box::new(Finished { output, prompt: self.feed.prompt })));
    }
}

impl Output {
    /// Take a sampled token into the answer. Some: the answer ends with it (a stop string
    /// matched, or the callback asked to stop).
    pub fn push_token(&mut self, vocab: &Vocab, token: Token) -> Option<DoneReason> {
        self.generated.push(token);
        let bytes = vocab.token_bytes(token, self.keep_special.contains(&token)).unwrap_or_default();
        let piece = self.utf8.push(&bytes);
        match self.stops.push(&piece) {
            StopScan::Stopped(before) => {
                self.emit(&before);
                self.flushed = true;
                Some(DoneReason::Stop)
            }
            StopScan::Continue(ready) => (self.emit(&ready) == Control::Stop).then_some(DoneReason::Cancelled),
        }
    }

    /// Flush held-back text (unless cancelled) and read a conversation's answer back.
    fn finish(&mut self, done_reason: DoneReason) -> Option<AssistantMessage> {
        if done_reason != DoneReason::Cancelled && !self.flushed {
            let rest = self.utf8.finish();
            let tail = match self.stops.push(&rest) {
                StopScan::Stopped(before) => before,
                StopScan::Continue(ready) => ready + &self.stops.finish(),
            };
            self.emit(&tail);
        }
        self.chat.as_mut().map(|chat| {
            let (delta, message) = chat.finish();
            if done_reason != DoneReason::Cancelled {
                send_delta(&mut self.sink, &delta.thinking, &delta.content);
            }
            message
        })
    }

    fn emit(&mut self, piece: &str) -> Control {
        if piece.is_empty() {
            return Control::Continue;
        }
        self.text.push_str(piece);
        match self.chat.as_mut() {
            Some(chat) => {
                let delta = chat.push(piece);
                send_delta(&mut self.sink, &delta.thinking, &delta.content)
            }
            None => (self.sink)(SequenceEvent::Text(piece)),
        }
    }
}

impl Statistics {
    /// The prompt is done (its logits are about to be sampled): the answer's clock starts.
    /// False when it had already started.
    pub fn prompt_done(&mut self, engine: &Engine) -> bool {
        if self.eval_started.is_some() {
            return false;
        }
        let now = Instant::now();
        self.stats.prompt_eval_duration = now - self.started;
        self.eval_started = Some((now, Counters::read(engine)));
        true
    }

    /// The statistics at the end (all but the answer's token count).
    fn finish(&mut self, engine: &Engine) -> GenerationStats {
        let now = Instant::now();
        let mut stats = std::mem::take(&mut self.stats);
        stats.load_duration = engine.load_duration();
        match self.eval_started.take() {
            Some((eval_started, before)) => {
                let counters = Counters::read(engine);
                stats.eval_duration = now - eval_started;
                stats.eval_stall =
                    Duration::from_secs_f64((counters.stall_seconds() - before.stall_seconds()).max(0.0));
                stats.eval_links = counters.links_since(&before);
                stats.eval_demand_bytes =
                    counters.demand_bytes().zip(before.demand_bytes()).map(|(now, then)| now.saturating_sub(then));
            }
            None => stats.prompt_eval_duration = now - self.started,
        }
        stats.eval_decodes = self.decodes;
        stats.total_duration = now - self.started;
        self.counters.fill_since(engine, &mut stats);
        stats
    }
}

/// A conversation's new reasoning, then its new content.
fn send_delta(sink: &mut SequenceSink, thinking: &str, content: &str) -> Control {
    if !thinking.is_empty() && sink(SequenceEvent::Thinking(thinking)) == Control::Stop {
        return Control::Stop;
    }
    if !content.is_empty() {
        return sink(SequenceEvent::Text(content));
    }
    Control::Continue
}
