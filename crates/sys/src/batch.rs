//! An owned `llama_batch` with checked appends.
use llama_cpp_sys_2 as raw;

use crate::error::SysError;
use crate::vocab::Token;

/// A batch of tokens for `Context::decode`. Freed on drop.
pub struct Batch {
    inner: raw::llama_batch,
    capacity: usize,
    n_seq_max: u32,
}

// SAFETY: the batch owns its arrays (allocated by llama_batch_init); nothing else aliases them.
unsafe impl Send for Batch {}

impl Batch {
    /// A batch for up to `capacity` tokens, each in at most `n_seq_max` sequences.
    pub fn new(capacity: usize, n_seq_max: u32) -> Batch {
        let capacity = capacity.max(1);
        // SAFETY: llama_batch_init allocates arrays of `capacity` entries (and `n_seq_max`
        // sequence ids per entry); embd = 0 means token input.
        let inner = unsafe { raw::llama_batch_init(capacity as i32, 0, n_seq_max.max(1) as i32) };
        Batch { inner, capacity, n_seq_max: n_seq_max.max(1) }
    }

    pub fn clear(&mut self) {
        self.inner.n_tokens = 0;
    }

    pub fn len(&self) -> usize {
        self.inner.n_tokens as usize
    }

    pub fn is_empty(&self) -> bool {
        self.inner.n_tokens == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Append one token at `position` in `seq_ids`; `wants_logits` marks it as an output.
    pub fn push(&mut self, token: Token, position: i32, seq_ids: &[i32], wants_logits: bool) -> Result<(), SysError> {
        let index = self.len();
        if index >= self.capacity {
            return Err(SysError::BatchFull { capacity: self.capacity, index });
        }
        if seq_ids.is_empty() || seq_ids.len() > self.n_seq_max as usize {
            return Err(SysError::BadSequence { seq_id: seq_ids.len() as i32, n_seq_max: self.n_seq_max });
        }
        if let Some(&bad) = seq_ids.iter().find(|&&seq| seq < 0) {
            return Err(SysError::BadSequence { seq_id: bad, n_seq_max: self.n_seq_max });
        }
        // SAFETY: index < capacity, and every array was allocated with `capacity` entries; each
        // seq_id entry points to an array of n_seq_max ids and we write at most that many.
        unsafe {
            *self.inner.token.add(index) = token;
            *self.inner.pos.add(index) = position;
            *self.inner.n_seq_id.add(index) = seq_ids.len() as i32;
            let slot = *self.inner.seq_id.add(index);
            for (offset, &seq) in seq_ids.iter().enumerate() {
                *slot.add(offset) = seq;
            }
            *self.inner.logits.add(index) = i8::from(wants_logits);
        }
        self.inner.n_tokens += 1;
        Ok(())
    }

    pub(crate) fn raw(&self) -> raw::llama_batch {
        self.inner
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: `inner` came from llama_batch_init and is freed exactly once here.
        unsafe { raw::llama_batch_free(self.inner) };
    }
}
