//! The reader threads' side: the trait that reads a unit's bytes into the region, and the loop
//! each thread runs over the chunk queue, marking a unit ready when its last chunk lands.
use std::ops::Range;
use std::time::Instant;

use super::{Shared, UnitState};
use crate::io::{DirectFile, IoError, Region};
use crate::store::stats::IoStats;
use crate::sync::Lock;

/// The reader of a unit's bytes: file `range` to region offset `range.start + shift`. Tests
/// substitute failing readers.
pub trait UnitReader: Send + Sync {
    fn read(&self, region: &Region, range: Range<u64>, shift: u64) -> Result<u64, IoError>;
}

impl UnitReader for DirectFile {
    fn read(&self, region: &Region, range: Range<u64>, shift: u64) -> Result<u64, IoError> {
        region.read_in_shifted(self, range, shift)
    }
}

pub(super) fn worker(shared: &Shared, region: &Region, reader: &dyn UnitReader, stats: &IoStats) {
    loop {
        let chunk = {
            let mut queue = shared.queue.locked();
            loop {
                if shared.shutdown.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                if let Some(chunk) = queue.pop_front() {
                    break chunk;
                }
                queue = crate::sync::wait(&shared.queue_changed, queue);
            }
        };
        {
            // A chunk of a load given up after a read error is not read (and takes no pages).
            if !chunk.is_current(&shared.units.locked()) {
                continue;
            }
        }
        if chunk.recycle {
            shared.parked.adopt(region, chunk.range.clone(), stats);
        }
        let started = Instant::now();
        stats.read_started();
        let result = reader.read(region, chunk.range.clone(), chunk.shift);
        match &result {
            Ok(bytes) => stats.record_read(*bytes, started.elapsed()),
            Err(_) => stats.read_ended(),
        }
        let mut units = shared.units.locked();
        if !chunk.is_current(&units) {
            continue; // a stale chunk of a load that was abandoned
        }
        let state = &mut units[chunk.unit];
        if let Err(error) = result {
            state.error.get_or_insert_with(|| error.to_string());
        }
        state.pending_chunks -= 1;
        if state.pending_chunks == 0 {
            if state.error.is_none() {
                state.state = UnitState::Ready;
                stats.record_unit_loaded(shared.unit_bytes[chunk.unit]);
            } else {
                // The waiter reports the error and resets the unit; keep it Loading until then
                // so nobody computes on it.
                state.state = UnitState::Evicting;
            }
            shared.changed.notify_all();
        }
    }
}
