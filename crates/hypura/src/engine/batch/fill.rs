//! Each step's batch: the next token of every generating sequence (with its speculative draft),
//! then prompt chunks in turn; a sequence whose context is full shifts first, and the abort
//! flags are armed for the one sequence a batch may hold alone.
use std::sync::Arc;

use hypura_sys::{DraftRequest, Token};

use super::Batcher;
use crate::engine::request::DoneReason;

impl Batcher {
    /// Next tokens of generating sequences first (one each, with its draft when speculating),
    /// then prompt chunks.
    pub(super) fn fill_batch(&mut self) -> bool {
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
    pub(super) fn stop_speculating(&mut self, error: &hypura_sys::SysError) {
        tracing::warn!("{error}; generation continues without speculative decoding");
        self.speculator = None;
    }

    /// Abort flags for the next decode: the one sequence in the batch may stop it mid-graph
    /// (with several, one request's cancel must not fail the others' shared decode).
    pub(super) fn arm_abort(&mut self) {
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
}
