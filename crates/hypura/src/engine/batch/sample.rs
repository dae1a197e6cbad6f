//! Sampling and ending: each sequence's next token from its row of logits (a draft checked row
//! by row), and a sequence's end, finished, failed, or failed with its batch.
use hypura_sys::Token;

use super::Batcher;
use crate::engine::request::DoneReason;
use crate::engine::EngineError;

impl Batcher {
    /// A failed decode: the KV cache may hold part of the batch, so every sequence in it starts
    /// over and its request gets the error.
    pub(super) fn fail_batch(&mut self, error: impl Fn() -> EngineError) {
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
    pub(super) fn sample_next(&mut self, index: usize) {
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
    pub(super) fn finish(&mut self, index: usize, done_reason: DoneReason) {
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
}
