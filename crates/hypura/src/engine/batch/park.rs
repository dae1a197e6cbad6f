//! `Parked`: idle sequences' KV caches copied into host memory by one batcher (`Batcher::park`)
//! and put back into free slots by the next batcher of the same model and settings.
use hypura_sys::Token;

use super::Batcher;

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

impl Batcher {
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
}
