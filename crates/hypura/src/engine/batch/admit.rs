//! Admission: a request into a free slot. Its prompt is rendered and tokenized, its sampler and
//! grammar built, and its slot chosen by the longest shared prefix, which is kept, or loaded
//! from the prompt cache where more of it is on disk.
use std::collections::HashSet;
use std::time::Instant;

use hypura_sys::{Grammar, Sampler, Token};

use super::sequence::{Active, Feed, Output, Sampling, Statistics};
use super::{Batcher, SequenceSink};
use crate::engine::prompt::{self, Prompt};
use crate::engine::prompt_cache::{Layout, Loaded};
use crate::engine::request::GenerateRequest;
use crate::engine::stats::{Counters, GenerationStats};
use crate::engine::text::{StopMatcher, Utf8Stream};
use crate::engine::EngineError;

impl Batcher {
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
}

fn shared_prefix(cached: &[Token], tokens: &[Token]) -> usize {
    cached.iter().zip(tokens).take_while(|(cached, new)| cached == new).count()
}
