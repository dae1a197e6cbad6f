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
//! A sequence's own state is in `sequence`.
//!
//! The batcher is synchronous and owned by one thread (the server's model worker, or the
//! caller of `Session::generate`); text and the final statistics leave through a per-sequence
//! callback.
mod sequence;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hypura_sys::{Batch, Context, DraftRequest, Grammar, Sampler, Speculator, Token};

use self::sequence::{Active, Feed, Output, Sampling, Statistics};
use super::prompt::{self, Prompt};
use super::prompt_cache::{Layout, Loaded, PromptCache};
use super::request::{Control, DoneReason, GenerateOutput, GenerateRequest};
use super::stats::{Counters, GenerationStats};
use super::text::{StopMatcher, Utf8Stream};
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

/// Idle sequences' KV caches in host memory between two batchers of one model (`Batcher::park`).
#[derive(Default)]
pub struct Parked {
    /// The settings the caches were computed with (`Engine::settings_digest`).
    settings: Option<[u8; 32]>,
    /// Each sequence's tokens and llama.cpp's copy of its cache.
    sequences: Vec<(Vec<Token>, Vec<u8>)>,
}

impl Parked {
    pub fn bytes(&self) -> u64 {
        self.sequences.iter().map(|(_, state)| state.len() as u64).sum()
    }
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

    /// The idle slots' KV caches, copied into host memory for the next batcher of the same
    /// model and settings (`unpark`): a reload for a longer context or a model loaded again
    /// after its keep-alive then starts from the prefixes this one held. At most `max_bytes`.
    pub fn park(&mut self, max_bytes: u64) -> Parked {
        let mut parked = Parked { settings: self.engine.settings_digest().ok(), sequences: Vec::new() };
        let mut bytes = 0u64;
        for slot in self.slots.iter().filter(|slot| slot.active.is_none() && !slot.cached.is_empty()) {
            // Measured before it is copied: the copy is made while the model and its KV cache
            // still hold their memory, so one past `max_bytes` could take the process over its
            // budget (a 16K-token prefix is 140 MB at q8_0/q4_0).
            if bytes + self.context.sequence_state_size(slot.seq_id) as u64 > max_bytes {
                break;
            }
            match self.context.sequence_state(slot.seq_id) {
                Ok(state) => {
                    bytes += state.len() as u64;
                    parked.sequences.push((slot.cached.clone(), state));
                }
                Err(error) => tracing::warn!("the prefix of sequence {} is not kept: {error}", slot.seq_id),
            }
        }
        parked
    }

    /// Put prefixes that an earlier batcher of this model parked into free slots, where the
    /// settings match and they fit this context. Returns the tokens restored.
    pub fn unpark(&mut self, parked: Parked) -> usize {
        if parked.settings.is_none() || parked.settings != self.engine.settings_digest().ok() {
            return 0;
        }
        let mut restored = 0;
        let mut free = self.slots.iter_mut().filter(|slot| slot.active.is_none() && slot.cached.is_empty());
        for (tokens, state) in parked.sequences {
            if tokens.len() >= self.n_ctx_seq {
                continue;
            }
            let Some(slot) = free.next() else { break };
            match self.context.set_sequence_state(slot.seq_id, &state) {
                Ok(()) => {
                    restored += tokens.len();
                    slot.cached = tokens;
                }
                Err(error) => tracing::warn!("a parked prefix was not restored: {error}"),
            }
        }
        restored
    }

    /// Start a sequence in a free slot. Errors (a bad prompt, bad sampling values, a grammar
    /// llama.cpp cannot parse, a prompt longer than the context, no free slot) are returned
    /// with the sink, before anything is decoded.
    pub fn admit(&mut self, request: GenerateRequest, sink: SequenceSink) -> Result<(), (EngineError, SequenceSink)> {
        // The prompt's time counts from here: rendering, tokenizing and a prompt cache load too.
        let started = Instant::now();
        let fit = request.truncate_history.then(|| self.limit(&request));
        let prepared = prompt::prepare(&self.engine, &request.context, &request.prompt, fit).and_then(|prepared| {
            let prompt::Prepared { tokens, turn, dropped_messages } = prepared;
            let chat_grammar = match turn.as_ref().and_then(|turn| turn.chat.as_ref()) {
                Some(chat) => chat.grammar(self.engine.model())?,
                None => None,
            };
            let prepared = self.prepare(&request, tokens, chat_grammar)?;
            Ok((prepared, turn, dropped_messages))
        });
        match prepared {
            Ok(((index, tokens, sampler, grammar, (reused, from_disk)), turn, dropped_messages)) => {
                let limit = self.limit(&request);
                let checkpoint = self.checkpoint(&request, &tokens, reused);
                let shift_keep = request
                    .shift_keep
                    .filter(|_| self.context.can_shift())
                    .map(|keep| (keep as usize).min(tokens.len()));
                if dropped_messages > 0 {
                    tracing::info!(
                        "sequence {index}: the {dropped_messages} oldest messages were left out to fit {limit} tokens"
                    );
                }
                let mut stop = request.stop.clone();
                let (chat, keep_special) = match turn {
                    Some(turn) => {
                        stop.extend(turn.stops.iter().cloned());
                        let keep = turn.preserved_tokens(self.engine.model());
                        (turn.chat, keep)
                    }
                    None => (None, HashSet::new()),
                };
                tracing::debug!("sequence {index}: a prompt of {} tokens, {reused} of them cached", tokens.len());
                let seq_id = self.slots[index].seq_id;
                if let Some(error) =
                    self.speculator.as_mut().and_then(|speculator| speculator.begin(seq_id, &tokens).err())
                {
                    self.stop_speculating(&error);
                }
                let stats = GenerationStats {
                    reused_prompt_tokens: reused as u32,
                    prompt_cache_tokens: from_disk.tokens as u32,
                    prompt_cache_bytes_read: from_disk.bytes,
                    dropped_messages: dropped_messages as u32,
                    prompt_eval_count: (tokens.len() - reused) as u32,
                    ..GenerationStats::default()
                };
                self.slots[index].active = Some(Active {
                    cancel: request.cancel.unwrap_or_default(),
                    sampling: Sampling {
                        sampler,
                        grammar,
                        // Ollama bounds an answer that may shift forever at ten contexts.
                        max_tokens: request.max_tokens.or(shift_keep.map(|_| limit.saturating_mul(10) as u32)),
                        ignore_eos: request.ignore_eos,
                        limit,
                        shift_keep,
                    },
                    feed: Feed {
                        next_prompt: reused,
                        checkpoint,
                        prompt: tokens,
                        pending: None,
                        draft: Vec::new(),
                        queued: Vec::new(),
                        queued_generated: false,
                        logits_row: None,
                        shifted_after: None,
                    },
                    output: Output {
                        generated: Vec::new(),
                        text: String::new(),
                        utf8: Utf8Stream::default(),
                        stops: StopMatcher::new(&stop),
                        flushed: false,
                        chat,
                        keep_special,
                        keep_prompt_logits: request.prompt_logits,
                        prompt_logits: None,
                        sink,
                    },
                    statistics: Statistics {
                        stats,
                        started,
                        counters: Counters::read(&self.engine),
                        eval_started: None,
                        decodes: 0,
                    },
                });
                Ok(())
            }
            Err(error) => Err((error, sink)),
        }
    }

    /// Where to stop the prompt's evaluation for a snapshot (`Layout::Snapshots`): the end of a
    /// conversation's system prompt and tools, where the next session's prompt or the next
    /// question parts from this one, when that is past what the slot holds and not on disk.
    fn checkpoint(&self, request: &GenerateRequest, tokens: &[Token], reused: usize) -> Option<usize> {
        let cache = self.prompt_cache.as_ref().filter(|cache| cache.layout() == Layout::Snapshots)?;
        let Prompt::Chat(chat) = &request.prompt else { return None };
        if !request.context.is_empty() {
            return None;
        }
        let at = prompt::stable_prefix(&self.engine, chat, tokens)?;
        (at > reused && at < tokens.len() && cache.wants_snapshot(&tokens[..at])).then_some(at)
    }

    /// Tokens a request may hold: its own `n_ctx_seq`, capped at the sequence's share.
    fn limit(&self, request: &GenerateRequest) -> usize {
        request.n_ctx_seq.map_or(self.n_ctx_seq, |limit| (limit as usize).clamp(1, self.n_ctx_seq))
    }

    /// Validate a request and pick its slot: the free one sharing the longest prefix.
    #[allow(clippy::type_complexity)]
    fn prepare(
        &mut self,
        request: &GenerateRequest,
        tokens: Vec<Token>,
        chat_grammar: Option<Grammar>,
    ) -> Result<(usize, Vec<Token>, Sampler, Option<Grammar>, (usize, Loaded)), EngineError> {
        request.sampling.validate()?;
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let limit = self.limit(request);
        if tokens.len() >= limit {
            return Err(EngineError::PromptTooLong { tokens: tokens.len(), n_ctx_seq: limit as u32 });
        }
        let grammar = match (&request.grammar, chat_grammar) {
            (Some(_), Some(_)) => {
                return Err(EngineError::Unsupported("a request cannot have both a format (grammar) and tools".into()))
            }
            (Some(text), None) => Some(Grammar::new(&self.engine.model().vocab(), text, "root")?),
            (None, chat_grammar) => chat_grammar,
        };
        let mut sampler = Sampler::new(&request.sampling, &self.context)?;
        for &token in &tokens {
            sampler.accept(token);
        }
        // Without a shared prefix the lowest free slot: with a KV buffer per sequence, a step
        // where every sequence generates is one graph as long as their slots are consecutive.
        let index = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.active.is_none())
            .max_by_key(|(index, slot)| (shared_prefix(&slot.cached, &tokens), std::cmp::Reverse(*index)))
            .map(|(index, _)| index)
            .ok_or(EngineError::Busy { n_sequences: self.slots.len() })?;
        let reused = self.reuse_prefix(index, &tokens);
        let reused = self.load_cached_prefix(index, &tokens, reused);
        Ok((index, tokens, sampler, grammar, reused))
    }

    /// Load the prompt's prefix from the prompt cache when more of it is on disk than in the
    /// slot (`reused` tokens). Returns the tokens the slot then holds and what was loaded.
    fn load_cached_prefix(&mut self, index: usize, tokens: &[Token], reused: usize) -> (usize, Loaded) {
        let Some(cache) = &self.prompt_cache else { return (reused, Loaded::default()) };
        // At least one prompt token is decoded, for the logits.
        let usable = &tokens[..tokens.len() - 1];
        let slot = &mut self.slots[index];
        let started = Instant::now();
        match cache.load(&mut self.context, slot.seq_id, self.n_stream, usable, reused) {
            Ok(Some(loaded)) => {
                tracing::info!(
                    "prompt cache: {} tokens ({:.1} MB) loaded in {:.3} s",
                    loaded.tokens,
                    loaded.bytes as f64 / 1e6,
                    started.elapsed().as_secs_f64()
                );
                slot.cached = usable[..loaded.tokens].to_vec();
                (loaded.tokens, loaded)
            }
            // No more on disk than in the slot: the slot is as it was.
            Ok(None) => (reused, Loaded::default()),
            Err(error) => {
                tracing::warn!("{error}; the prompt is evaluated");
                self.context.truncate_sequence(slot.seq_id, 0);
                slot.cached.clear();
                (0, Loaded::default())
            }
        }
    }

    /// Keep the KV entries of the longest prefix the slot shares with `tokens`, dropping the
    /// rest. At least one prompt token is decoded again so that there are logits to sample.
    fn reuse_prefix(&mut self, index: usize, tokens: &[Token]) -> usize {
        let slot = &mut self.slots[index];
        let keep = shared_prefix(&slot.cached, tokens).min(tokens.len() - 1);
        if keep == slot.cached.len() {
            return keep;
        }
        // Sliding-window caches cannot always drop a tail; then the sequence starts over.
        if keep > 0 && self.context.truncate_sequence(slot.seq_id, keep as i32) {
            slot.cached.truncate(keep);
            keep
        } else {
            self.context.truncate_sequence(slot.seq_id, 0);
            slot.cached.clear();
            0
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

    /// Next tokens of generating sequences first (one each, with its draft when speculating),
    /// then prompt chunks.
    fn fill_batch(&mut self) -> bool {
        for index in 0..self.slots.len() {
            self.shift_if_full(index);
        }
        self.batch.clear();
        let capacity = self.batch.capacity();
        let mut drafts = self.make_drafts();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Some(feed) = slot.active.as_mut().map(|active| &mut active.feed) else { continue };
            feed.queued.clear();
            feed.queued_generated = false;
            feed.logits_row = None;
            feed.draft.clear();
            if let Some(token) = feed.pending.take() {
                let row = self.batch.len() as i32;
                if self.batch.push(token, slot.cached.len() as i32, &[slot.seq_id], true).is_ok() {
                    feed.queued.push(token);
                    feed.queued_generated = true;
                    feed.logits_row = Some(row);
                    // Each drafted token is verified from its own row of logits.
                    for token in drafts.get_mut(index).map(std::mem::take).unwrap_or_default() {
                        let position = (slot.cached.len() + feed.queued.len()) as i32;
                        if self.batch.push(token, position, &[slot.seq_id], true).is_err() {
                            break;
                        }
                        feed.queued.push(token);
                        feed.draft.push(token);
                    }
                } else {
                    feed.pending = Some(token);
                }
            }
        }
        let count = self.slots.len();
        for turn in 0..count {
            let slot = &mut self.slots[(self.prefill_turn + turn) % count];
            let Some(feed) = slot.active.as_mut().map(|active| &mut active.feed) else { continue };
            if feed.next_prompt >= feed.prompt.len() {
                continue;
            }
            let room = capacity - self.batch.len();
            if room == 0 {
                break;
            }
            // A chunk ends at the checkpoint, so that the sequence is snapshotted there.
            let end = feed.checkpoint.filter(|&at| at > feed.next_prompt).unwrap_or(feed.prompt.len());
            let take = room.min(end - feed.next_prompt);
            for offset in 0..take {
                let position = feed.next_prompt + offset;
                let is_last = position + 1 == feed.prompt.len();
                let row = self.batch.len() as i32;
                if self.batch.push(feed.prompt[position], position as i32, &[slot.seq_id], is_last).is_err() {
                    break;
                }
                feed.queued.push(feed.prompt[position]);
                if is_last {
                    feed.logits_row = Some(row);
                }
            }
            feed.next_prompt += feed.queued.len();
        }
        self.prefill_turn = (self.prefill_turn + 1) % count.max(1);
        !self.batch.is_empty()
    }

    /// A sequence whose next token would not fit its share of the context, and that asked for
    /// shifting, drops half of what follows its kept start (as Ollama and llama.cpp's server
    /// do): the cells after the dropped ones move back, and generation goes on. One whose start
    /// leaves nothing to drop ends, `length`.
    fn shift_if_full(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        let Some(active) = slot.active.as_mut() else { return };
        let (Some(keep), true) = (active.sampling.shift_keep, active.feed.pending.is_some()) else { return };
        let limit = active.sampling.limit;
        if slot.cached.len() + 1 < limit {
            return;
        }
        let keep = keep.min(limit.saturating_sub(2));
        let discard = (slot.cached.len() - keep) / 2;
        if discard == 0 || !self.context.shift_sequence(slot.seq_id, keep as i32, discard as i32) {
            return self.finish(index, DoneReason::Length);
        }
        slot.cached.drain(keep..keep + discard);
        active.feed.shifted_after = Some(keep);
        active.statistics.stats.context_shifts += 1;
        tracing::debug!("sequence {index}: the context is full; {discard} tokens after the first {keep} dropped");
    }

    /// Drafts for every generating sequence, by slot index (empty where none): at most what the
    /// sequence's context and token limit leave after its pending token.
    fn make_drafts(&mut self) -> Vec<Vec<Token>> {
        let Some(speculator) = self.speculator.as_mut() else { return Vec::new() };
        let room = self.batch.capacity().saturating_sub(self.slots.len());
        let mut indices = Vec::new();
        let mut requests = Vec::new();
        for (index, slot) in self.slots.iter().enumerate() {
            let Some(active) = slot.active.as_ref() else { continue };
            let Some(last) = active.feed.pending else { continue };
            // A shifted sequence's drafters hold cells at the old positions.
            if active.feed.shifted_after.is_some() {
                continue;
            }
            // The pending token and the draft take cells; one more is needed to sample after them.
            let by_context = active.sampling.limit.saturating_sub(slot.cached.len() + 2);
            // A pass yields up to draft + 1 tokens, the pending one already counted.
            let by_tokens = active
                .sampling
                .max_tokens
                .map_or(usize::MAX, |limit| (limit as usize).saturating_sub(active.output.generated.len() + 1));
            let n_max = speculator.n_max().min(by_context).min(by_tokens).min(room);
            if n_max > 0 {
                indices.push(index);
                requests.push(DraftRequest { seq_id: slot.seq_id, n_max, last, history: &slot.cached });
            }
        }
        let mut drafts = vec![Vec::new(); self.slots.len()];
        match speculator.draft(&requests) {
            Ok(made) => {
                for (index, draft) in indices.into_iter().zip(made) {
                    drafts[index] = draft;
                }
            }
            Err(error) => self.stop_speculating(&error),
        }
        drafts
    }

    /// The drafters failed (the draft model's context, most likely): generation goes on without
    /// drafts, which changes no token.
    fn stop_speculating(&mut self, error: &hypura_sys::SysError) {
        tracing::warn!("{error}; generation continues without speculative decoding");
        self.speculator = None;
    }

    /// Abort flags for the next decode: the one sequence in the batch may stop it mid-graph
    /// (with several, one request's cancel must not fail the others' shared decode).
    fn arm_abort(&mut self) {
        let mut involved =
            self.slots.iter().filter(|slot| slot.active.as_ref().is_some_and(|active| !active.feed.queued.is_empty()));
        let alone = match (involved.next(), involved.next()) {
            (Some(slot), None) => Some(slot),
            _ => None,
        };
        let wanted = alone.and_then(|slot| Some((slot.seq_id, slot.active.as_ref()?.cancel.clone())));
        let same = match (&wanted, &self.armed) {
            (Some((wanted_seq, wanted_flag)), Some((armed_seq, armed_flag))) => {
                wanted_seq == armed_seq && Arc::ptr_eq(wanted_flag, armed_flag)
            }
            (None, None) => true,
            _ => false,
        };
        if same {
            return;
        }
        let mut flags = self.abort_base.clone();
        flags.extend(wanted.as_ref().map(|(_, cancel)| cancel.clone()));
        self.context.set_abort_flags(flags);
        self.armed = wanted;
    }

    /// A failed decode: the KV cache may hold part of the batch, so every sequence in it starts
    /// over and its request gets the error.
    fn fail_batch(&mut self, error: impl Fn() -> EngineError) {
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            let involved = slot.active.as_ref().is_some_and(|active| !active.feed.queued.is_empty());
            if !involved {
                continue;
            }
            self.context.truncate_sequence(slot.seq_id, 0);
            slot.cached.clear();
            if let Some(active) = slot.active.take() {
                active.fail(error());
            }
        }
    }

    /// Sample the sequence's next token from its row of logits and, where the batch held its
    /// draft, go on from the next row while each sampled token is the drafted one: every
    /// accepted token was sampled from the target's own logits, so the text is the one
    /// generation without drafts gives (to the bit with batch-invariant kernels). The KV cells
    /// of the rejected drafted tokens are dropped.
    fn sample_next(&mut self, index: usize) {
        let Some(active) = self.slots[index].active.as_mut() else { return };
        let Some(first_row) = active.feed.logits_row.take() else { return };
        let draft = std::mem::take(&mut active.feed.draft);
        active.statistics.stats.draft_tokens += draft.len() as u32;
        // Cells that hold history when no drafted token is accepted.
        let valid = self.slots[index].cached.len() - draft.len();
        let mut accepted = 0;
        let next = loop {
            match self.sample_row(index, first_row + accepted as i32, valid + accepted) {
                Some(token) if accepted < draft.len() && token == draft[accepted] => {
                    accepted += 1;
                    if let Some(active) = self.slots[index].active.as_mut() {
                        active.statistics.stats.draft_accepted += 1;
                    }
                }
                other => break other,
            }
        };
        let slot = &mut self.slots[index];
        if let (Some(token), Some(active)) = (next, slot.active.as_mut()) {
            active.feed.pending = Some(token);
        }
        if draft.is_empty() {
            return;
        }
        let keep = valid + accepted;
        if keep < slot.cached.len() {
            slot.cached.truncate(keep);
            if !self.context.truncate_sequence(slot.seq_id, keep as i32) {
                // Only a recurrent state refuses, and speculation is refused for those at load.
                self.context.truncate_sequence(slot.seq_id, 0);
                slot.cached.clear();
                return self.fail(
                    index,
                    EngineError::Decode("the KV cache could not drop the rejected drafted tokens".into()),
                );
            }
        }
        if let Some(error) =
            self.speculator.as_mut().and_then(|speculator| speculator.accept(slot.seq_id, accepted).err())
        {
            self.stop_speculating(&error);
        }
    }

    /// Sample one token from `row` for the sequence, whose KV cache holds `cached` valid cells
    /// at that row; returns it unless the sequence ended (or failed) with it.
    fn sample_row(&mut self, index: usize, row: i32, cached: usize) -> Option<Token> {
        let vocab = self.engine.model().vocab();
        let active = self.slots[index].active.as_mut()?;
        if active.statistics.prompt_done(&self.engine) && active.output.keep_prompt_logits {
            match self.context.logits(row) {
                Ok(logits) => active.output.prompt_logits = Some(logits.to_vec()),
                Err(error) => {
                    self.fail(index, error.into());
                    return None;
                }
            }
        }
        if active.at_max_tokens() {
            self.finish(index, DoneReason::Length);
            return None;
        }
        let sampling = &mut active.sampling;
        let sampled = match sampling.grammar.as_mut() {
            Some(grammar) => sampling.sampler.sample_constrained(&mut self.context, row, grammar),
            None => sampling.sampler.sample(&mut self.context, row),
        };
        let token = match sampled {
            Ok(token) => token,
            Err(error) => {
                self.fail(index, error.into());
                return None;
            }
        };
        if !sampling.ignore_eos && vocab.is_end_of_generation(token) {
            self.finish(index, DoneReason::Stop);
            return None;
        }
        if let Some(done_reason) = active.output.push_token(&vocab, token) {
            self.finish(index, done_reason);
            return None;
        }
        let full = cached + 1 >= active.sampling.limit && active.sampling.shift_keep.is_none();
        if active.at_max_tokens() || full {
            self.finish(index, DoneReason::Length);
            return None;
        }
        Some(token)
    }

    fn fail(&mut self, index: usize, error: EngineError) {
        if let Some(active) = self.slots[index].active.take() {
            active.fail(error);
        }
    }

    /// End a sequence: flush held-back text (unless cancelled) and send the statistics. The
    /// slot keeps its KV entries for the next request that shares the prefix.
    fn finish(&mut self, index: usize, done_reason: DoneReason) {
        if let Some(active) = self.slots[index].active.take() {
            // Past a shift only the kept start is what its tokens alone would give.
            if let Some(keep) = active.feed.shifted_after {
                let slot = &mut self.slots[index];
                slot.cached.truncate(keep);
                if !self.context.truncate_sequence(slot.seq_id, keep as i32) {
                    self.context.truncate_sequence(slot.seq_id, 0);
                    slot.cached.clear();
                }
            }
            active.finish(&self.engine, done_reason);
            if let Some(cache) = &self.prompt_cache {
                let slot = &self.slots[index];
                cache.save(&mut self.context, slot.seq_id, &slot.cached);
            }
        }
    }

    /// Cancel every sequence (shutdown).
    pub fn cancel_all(&mut self) {
        for index in 0..self.slots.len() {
            self.finish(index, DoneReason::Cancelled);
        }
    }
}

fn shared_prefix(cached: &[Token], tokens: &[Token]) -> usize {
    cached.iter().zip(tokens).take_while(|(cached, new)| cached == new).count()
}
