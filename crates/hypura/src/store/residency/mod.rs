//! Residency of stream units: one state machine per unit (empty, loading, ready, evicting)
//! with a generation counter, a pool of reader threads, and waits that compute blocks on.
//!
//! A unit is whatever the planner streams as one piece: a dense layer's FFN tensors, or one
//! expert's slices of a layer. Its bytes are one or more file ranges read into their mirror
//! position in the region. Compute may touch a unit only while it is `Ready`. A released unit's
//! pages are parked (`parked`) and moved under the next chunks read.
//!
//! The state machine's transitions (request, wait, cancel, fill, release) are in
//! `transitions`, the reader threads' side in `reader`, and the errors and the eval hook's
//! failure latch in `error`.
mod error;
mod reader;
mod transitions;

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

pub use self::error::{FailureLatch, ResidencyError};
use self::reader::worker;
pub use self::reader::UnitReader;
use super::parked::ParkedPages;
use super::stats::IoStats;
use crate::io::Region;
use crate::sync::Lock;

/// Reads are issued in pieces of this size, spread over the worker threads.
pub const CHUNK_BYTES: u64 = crate::plan::READ_CHUNK_BYTES;

/// Where a stream unit is in its life: compute may touch it only when `Ready`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitState {
    Empty,
    Loading,
    Ready,
    Evicting,
}

/// One streamed unit: its file ranges (sorted, disjoint), and where they land in the region.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StreamUnit {
    pub ranges: Vec<Range<u64>>,
    /// File byte `o` of the unit lives at region offset `o + shift`: 0 in the mirror of the
    /// file, a page multiple for a unit that lives in a slot.
    pub shift: u64,
    /// The reused slot of memory the unit lives in (dense layers), shared with other units
    /// of which at most one is loaded at a time; None: its own mirror range, released after use.
    pub slot: Option<usize>,
}

impl StreamUnit {
    /// A unit at its mirror position.
    pub fn mirrored(ranges: Vec<Range<u64>>) -> StreamUnit {
        StreamUnit { ranges, shift: 0, slot: None }
    }

    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|range| range.end - range.start).sum()
    }
}

/// A unit's state, the generation of its current load, and that load's progress.
#[derive(Debug)]
struct UnitRecord {
    state: UnitState,
    generation: u64,
    pending_chunks: usize,
    /// The current load was asked for in the background and not asked for since: its queued
    /// chunks wait behind the others (`Residency::request_background`).
    background: bool,
    /// The first read error of the current load.
    error: Option<String>,
}

#[derive(Debug)]
struct Shared {
    units: Mutex<Vec<UnitRecord>>,
    unit_bytes: Vec<u64>,
    changed: Condvar,
    queue: Mutex<VecDeque<Chunk>>,
    queue_changed: Condvar,
    shutdown: std::sync::atomic::AtomicBool,
    /// Pages of released units kept for the next chunks read (see `Residency::park`).
    parked: ParkedPages,
}

#[derive(Clone, Debug)]
struct Chunk {
    unit: usize,
    generation: u64,
    range: Range<u64>,
    shift: u64,
    /// At its mirror position (not in a slot): read into parked pages where there are some.
    recycle: bool,
    /// A read no computation waits for yet (`Residency::request_background`): queued behind
    /// every other.
    background: bool,
}

impl Chunk {
    /// Whether the load this chunk belongs to is still under way (not given up or redone).
    fn is_current(&self, units: &[UnitRecord]) -> bool {
        units[self.unit].generation == self.generation && units[self.unit].state == UnitState::Loading
    }
}

/// Owns the region's residency and the reader threads.
pub struct Residency {
    region: Arc<Region>,
    units: Vec<StreamUnit>,
    /// The units of each slot.
    slot_units: Vec<Vec<usize>>,
    shared: Arc<Shared>,
    stats: Arc<IoStats>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Residency {
    pub fn new(
        region: Arc<Region>,
        reader: Arc<dyn UnitReader>,
        units: Vec<StreamUnit>,
        workers: usize,
        stats: Arc<IoStats>,
    ) -> Residency {
        let shared = Arc::new(Shared {
            units: Mutex::new(
                units
                    .iter()
                    .map(|_| UnitRecord {
                        state: UnitState::Empty,
                        generation: 0,
                        pending_chunks: 0,
                        background: false,
                        error: None,
                    })
                    .collect(),
            ),
            unit_bytes: units.iter().map(StreamUnit::bytes).collect(),
            changed: Condvar::new(),
            queue: Mutex::new(VecDeque::new()),
            queue_changed: Condvar::new(),
            shutdown: std::sync::atomic::AtomicBool::new(false),
            parked: ParkedPages::new(region.huge_phase()),
        });
        let workers = (0..workers.max(1))
            .map(|index| {
                let shared = shared.clone();
                let region = region.clone();
                let reader = reader.clone();
                let stats = stats.clone();
                std::thread::Builder::new()
                    .name(format!("hypura-io-{index}"))
                    .spawn(move || worker(&shared, &region, reader.as_ref(), &stats))
                    .expect("spawning an I/O worker")
            })
            .collect();
        let n_slots = units.iter().filter_map(|unit| unit.slot).max().map_or(0, |slot| slot + 1);
        let mut slot_units = vec![Vec::new(); n_slots];
        for (index, unit) in units.iter().enumerate() {
            if let Some(slot) = unit.slot {
                slot_units[slot].push(index);
            }
        }
        Residency { region, units, slot_units, shared, stats, workers }
    }

    pub fn units(&self) -> &[StreamUnit] {
        &self.units
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    pub fn stats(&self) -> &Arc<IoStats> {
        &self.stats
    }

    pub fn state(&self, unit: usize) -> Option<(UnitState, u64)> {
        let units = self.shared.units.locked();
        units.get(unit).map(|state| (state.state, state.generation))
    }
}

impl Drop for Residency {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, std::sync::atomic::Ordering::Relaxed);
        self.shared.queue_changed.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
