//! The memory a worker lends per device, and how much of it every client's buffers hold,
//! shared by the front's connections.
use std::sync::{Arc, Mutex};

use crate::sync::Lock;

/// Memory lent per device and how much of it every client's buffers hold; shared by the
/// front's connections.
#[derive(Debug)]
pub struct Ledger {
    /// Bytes each device lends (None: the device's own memory is the limit, as for a GPU).
    limits: Vec<Option<u64>>,
    pub(super) held: Mutex<Vec<u64>>,
}

impl Ledger {
    pub fn new(limits: Vec<Option<u64>>) -> Arc<Ledger> {
        let held = Mutex::new(vec![0; limits.len()]);
        Arc::new(Ledger { limits, held })
    }

    /// Reserve `bytes` on `device`; false where that is more than it has left to lend.
    pub(super) fn reserve(&self, device: u32, bytes: u64) -> bool {
        let mut held = self.held.locked();
        let Some(slot) = held.get_mut(device as usize) else { return true };
        let limit = self.limits.get(device as usize).copied().flatten().unwrap_or(u64::MAX);
        if slot.saturating_add(bytes) > limit {
            return false;
        }
        *slot += bytes;
        true
    }

    pub(super) fn release(&self, device: u32, bytes: u64) {
        if let Some(slot) = self.held.locked().get_mut(device as usize) {
            *slot = slot.saturating_sub(bytes);
        }
    }

    /// What `device` has left to lend, where it lends a set amount.
    pub(super) fn left(&self, device: u32) -> Option<u64> {
        let limit = self.limits.get(device as usize).copied().flatten()?;
        Some(limit.saturating_sub(self.held.locked().get(device as usize).copied().unwrap_or(0)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Session, Verdict, CMD_ALLOC_BUFFER, CMD_HELLO};
    use super::*;

    #[test]
    fn allocations_past_what_is_lent_are_answered_as_failed_and_freed_memory_returns() {
        let ledger = Ledger::new(vec![Some(10_000)]);
        let mut first = Session::new(ledger.clone());
        let mut second = Session::new(ledger.clone());
        for session in [&mut first, &mut second] {
            session.check(CMD_HELLO, &[0; 24], 24).unwrap();
            session.set_devices(1);
        }
        let alloc = |bytes: u64| {
            let mut payload = 0u32.to_le_bytes().to_vec();
            payload.extend_from_slice(&bytes.to_le_bytes());
            payload
        };
        assert_eq!(first.check(CMD_ALLOC_BUFFER, &alloc(6_000), 12), Ok(Verdict::Forward));
        first.allocated(0x1, 6_000, 0x1000);
        assert_eq!(second.device_memory(0, 1 << 40), 4_000);
        let mut failed = 16u64.to_le_bytes().to_vec();
        failed.extend_from_slice(&[0; 16]);
        assert_eq!(second.check(CMD_ALLOC_BUFFER, &alloc(6_000), 12), Ok(Verdict::Answer(failed)));
        drop(first);
        assert_eq!(second.device_memory(0, 1 << 40), 10_000);
        assert_eq!(second.check(CMD_ALLOC_BUFFER, &alloc(6_000), 12), Ok(Verdict::Forward));
    }
}
