//! `Batcher`: the engine's one generation loop. Several generations decode together as
//! parallel sequences of one context; a CLI run or a benchmark is the same loop with one
//! sequence (`Session`).
//!
//! Each step builds one llama.cpp batch holding the next token of every sequence that is
//! generating (with its speculative draft, decision 18), then fills the rest of the batch with
//! prompt chunks of sequences that are still prefilling, decodes it once, and samples every
//! sequence from its own row of logits with its own sampler chain (and grammar). One decode is
//! one pass over the weights, so in streaming modes every weight read from disk serves every
//! active request at once.
//!
//! Each sequence is kept within its share of the context (`n_ctx_seq` of the engine, the context
//! being `n_sequences` times that), so one long conversation can never starve the others. A
//! freed slot keeps its KV entries, and a new request goes to the free slot sharing the longest
//! prefix with it, so a chat that comes back for its next turn reuses its cache. With
//! batch-invariant kernels each sequence has a KV buffer of its own, so that greedy answers
//! repeat whatever shares the batch (decision 10); otherwise one buffer serves them all, since
//! with buffers of their own llama.cpp runs one graph (one more pass over the weights) for
//! each run of consecutive sequences with equal token counts.
//!
//! A request's prompt is rendered and tokenized here, after Ollama's `context` when it has one;
//! a conversation goes through the model's template in llama.cpp's chat layer (decision 12),
//! and its answer is read back as it streams: content (`SequenceEvent::Text`) apart from
//! reasoning (`SequenceEvent::Thinking`), the tool calls in the finished output's `message`.
//! A sequence's own state is in `sequence`. The batcher's work is in rooms of its own: `admit`
//! takes a request into a slot (its prompt, its sampler, a cached prefix), `fill` builds each
//! step's batch (drafts, prompt chunks, a full context's shift, the abort flags), `sample`
//! samples each row and ends sequences, and `park` keeps idle prefixes between two batchers.
//!
//! The batcher is synchronous and owned by one thread (the server's model worker, or the
//! caller of `Session::generate`); text and the final statistics leave through a per-sequence
//! callback.
mod admit;
mod fill;
mod park;
mod sample;
mod sequence;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hypura_sys::{Batch, Context, Speculator, Token};

pub use self::park::Parked;
use self::sequence::Active;
use super::prompt_cache::{Layout, PromptCache};
use super::request::{Control, DoneReason, GenerateOutput};
use super::{Engine, EngineError};
use crate::store::StoreError;

/// The end of a sequence: the engine's output plus the prompt it was generated from (Ollama's
/// `context` is both).
#[derive(Clone, Debug)]
pub struct Finished {
    pub output: GenerateOutput,
    pub prompt: Vec<Token>,
}

/// What a sequence's callback receives.
pub enum SequenceEvent<'a> {
    /// Final text (never part of a stop string); for a conversation whose template has tools
    /// or reasoning, the answer's content. Returning `Control::Stop` cancels.
    Text(&'a str),
    /// Reasoning text, kept out of the content (templates with a reasoning section).
    Thinking(&'a str),
    Done(Box<Finished>),
    /// The decode failed; the sequence is gone.
    Failed(EngineError),
}

/// Receives a sequence's events on the batcher's thread.
pub type SequenceSink = Box<dyn FnMut(SequenceEvent<'_>) -> Control + Send>;

struct Slot {
    seq_id: i32,
    /// Tokens whose KV entries this sequence holds.
    cached: Vec<Token>,
    active: Option<Active>,
}

/// Parallel sequences on one context. See the module documentation.
pub struct Batcher {
    engine: Arc<Engine>,
    context: Context,
    batch: Batch,
    slots: Vec<Slot>,
    n_ctx_seq: usize,
    /// Which prefilling sequence goes first in the next batch, so that long prompts share.
    prefill_turn: usize,
    /// Flags that abort a decode between graph nodes: the streaming failure latch's, plus the
    /// cancel flag of the one sequence in the batch when it is alone there (`armed`), so that
    /// cancelling a long prompt stops it within a node rather than a batch.
    abort_base: Vec<Arc<AtomicBool>>,
    armed: Option<(i32, Arc<AtomicBool>)>,
    /// Speculative decoding's drafters (and the draft model's context), when the engine has them.
    speculator: Option<Speculator>,
    /// Prefixes on disk (`--prompt-cache`), and the KV cache's streams their loads are for.
    prompt_cache: Option<PromptCache>,
    n_stream: u32,
}

impl Batcher {
    /// A context for `n_sequences` parallel sequences, each with the engine's context length.
    pub fn new(engine: Arc<Engine>, n_sequences: u32) -> Result<Batcher, EngineError> {
        let n_sequences = n_sequences.clamp(1, 64);
        let mut params = engine.context_params();
        let per_sequence = params.n_ctx;
        params.n_ctx = per_sequence.saturating_mul(n_sequences);
        params.n_seq_max = n_sequences;
        // Batch-invariant runs give each sequence its own KV buffer (see the module notes).
        params.kv_unified = !engine.options().batch_invariant;
        let mut context = Context::new(engine.model(), &params)?;
        // A streaming read failure aborts the decode before any node computes on missing
        // weights; the failure is then reported to the sequences in that batch.
        let abort_base: Vec<Arc<AtomicBool>> =
            engine.streaming().map(|streaming| streaming.driver.abort_flags()).unwrap_or_default();
        if let Some(streaming) = engine.streaming() {
            streaming.driver.take_failure();
        }
        context.set_abort_flags(abort_base.clone());
        let n_ctx_seq = (context.n_ctx() / n_sequences) as usize;
        let batch = Batch::new(params.n_batch as usize, 1);
        let slots = (0..n_sequences as i32).map(|seq_id| Slot { seq_id, cached: Vec::new(), active: None }).collect();
        let speculator = match &engine.options().speculation {
            Some(speculation) => {
                let draft = if speculation.uses_mtp() {
                    Some(Context::new_mtp(&engine.draft_context_params(&params), &context)?)
                } else {
                    engine
                        .draft_model()
                        .map(|model| Context::new_beside(model, &engine.draft_context_params(&params), &context))
                        .transpose()?
                };
                Some(Speculator::new(&context, draft, &speculation.params)?)
            }
            None => None,
        };
        let prompt_cache = match &engine.options().prompt_cache {
            Some(options) => {
                let digest = engine.settings_digest().map_err(EngineError::Setup)?;
                // Memory that is not a run of positions is kept as whole sequences.
                let layout = match engine.model().memory_kind() {
                    Some(kind) => {
                        tracing::info!(
                            "prompt cache: this model's {kind} memory is kept as whole sequences, at the end of \
                             the system prompt and of each answer"
                        );
                        Layout::Snapshots
                    }
                    None => Layout::Blocks,
                };
                Some(PromptCache::open(options, digest, layout)?)
            }
            None => None,
        };
        let n_stream = if params.kv_unified { 1 } else { n_sequences };
        Ok(Batcher {
            engine,
            context,
            batch,
            slots,
            n_ctx_seq,
            prefill_turn: 0,
            abort_base,
            armed: None,
            speculator,
            prompt_cache,
            n_stream,
        })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Tokens one sequence may hold.
    pub fn n_ctx_seq(&self) -> usize {
        self.n_ctx_seq
    }

    pub fn n_sequences(&self) -> usize {
        self.slots.len()
    }

    pub fn free_slots(&self) -> usize {
        self.slots.iter().filter(|slot| slot.active.is_none()).count()
    }

    pub fn is_idle(&self) -> bool {
        self.slots.iter().all(|slot| slot.active.is_none())
    }

    /// Forget every idle sequence's KV entries (a running sequence keeps its own).
    pub fn forget_cache(&mut self) {
        for slot in self.slots.iter_mut().filter(|slot| slot.active.is_none()) {
            self.context.truncate_sequence(slot.seq_id, 0);
            slot.cached.clear();
        }
    }

    /// One decode over every active sequence, then one sampled token for each sequence whose
    /// prompt is done. Returns false when there was nothing to do.
    pub fn step(&mut self) -> bool {
        for index in 0..self.slots.len() {
            if self.slots[index].active.as_ref().is_some_and(|active| active.cancel.load(Ordering::Relaxed)) {
                self.finish(index, DoneReason::Cancelled);
            }
        }
        if !self.fill_batch() {
            return false;
        }
        self.arm_abort();
        let observations_before = self.engine.hooked_streaming().map(|streaming| streaming.observations());
        let decoded = self.context.decode(&self.batch);
        // A read failure stops the graph from the eval hook (or, where the rest of the graph
        // ran where no abort flag is checked, leaves it computed on missing weights): either
        // way the batch fails with the read's error.
        if let Some(failure) = self.engine.streaming().and_then(|streaming| streaming.driver.take_failure()) {
            let message = failure.to_string();
            self.fail_batch(|| StoreError::Batch { message: message.clone() }.into());
            return true;
        }
        // A remote worker that stopped answering was answered for with zeros by its relay: the
        // batch's logits are wrong, and the request fails with the worker's name.
        if let Err(error) = self.engine.check_remote() {
            let message = error.to_string();
            self.fail_batch(|| EngineError::Decode(message.clone()));
            return true;
        }
        if let Err(error) = decoded {
            // The one sequence in the batch was cancelled mid-decode: it ends, cancelled.
            let cancelled = self
                .armed
                .as_ref()
                .filter(|(_, cancel)| cancel.load(Ordering::Relaxed))
                .and_then(|(seq_id, _)| self.slots.iter().position(|slot| slot.seq_id == *seq_id));
            if let (hypura_sys::SysError::Aborted, Some(index)) = (&error, cancelled) {
                let seq_id = self.slots[index].seq_id;
                // The KV cache may hold part of the batch.
                self.context.truncate_sequence(seq_id, 0);
                self.slots[index].cached.clear();
                self.finish(index, DoneReason::Cancelled);
                return true;
            }
            let message = EngineError::from(error).to_string();
            self.fail_batch(|| EngineError::Decode(message.clone()));
            return true;
        }
        // A graph whose streamed layers were never loaded computed on missing weights.
        if let (Some(before), Some(streaming)) = (observations_before, self.engine.streaming()) {
            if let Err(error) = streaming.ensure_hook_fired(before) {
                let message = error.to_string();
                self.fail_batch(|| StoreError::Batch { message: message.clone() }.into());
                return true;
            }
        }
        // The drafters follow what the target decoded (the draft model decodes it too).
        if let Some(error) = self.speculator.as_mut().and_then(|speculator| speculator.process(&self.batch).err()) {
            self.stop_speculating(&error);
        }
        // On a GPU the decode may still be running: the clocks read below must include it.
        self.context.synchronize();
        let mut ready = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Some(active) = slot.active.as_mut() else { continue };
            slot.cached.append(&mut active.feed.queued);
            active.statistics.decodes += u32::from(active.feed.queued_generated);
            if active.feed.checkpoint == Some(slot.cached.len()) {
                active.feed.checkpoint = None;
                if let Some(cache) = &self.prompt_cache {
                    cache.save(&mut self.context, slot.seq_id, &slot.cached);
                }
            }
            if active.feed.logits_row.is_some() {
                ready.push(index);
            }
        }
        for index in ready {
            self.sample_next(index);
        }
        true
    }

    /// Cancel every sequence (shutdown).
    pub fn cancel_all(&mut self) {
        for index in 0..self.slots.len() {
            self.finish(index, DoneReason::Cancelled);
        }
    }
}
