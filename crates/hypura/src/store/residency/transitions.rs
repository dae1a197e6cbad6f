//! A unit's transitions: a load requested (cut into chunks on huge-page boundaries and queued
//! for the readers), waited for, cancelled, filled from memory or released, with its slot taken
//! from the unit holding it and its pages parked or given back.
use std::time::{Duration, Instant};

use super::{Chunk, Residency, ResidencyError, UnitRecord, UnitState, CHUNK_BYTES};
use crate::io::{Region, HUGE_PAGE_BYTES};
use crate::sync::Lock;

impl Residency {
    /// Keep a released unit's pages for the next chunks read instead of giving them back: the
    /// pages wholly inside its ranges join the parked set (a unit in a slot keeps its pages
    /// anyway). Bookkeeping only, so eviction costs the compute thread nothing. The unit is
    /// empty, so nothing reads them; a cache evicts one unit per unit it admits, so parked
    /// pages never hold more than the units it gave up and has not refilled yet.
    fn park(&self, unit: usize) -> Result<(), ResidencyError> {
        if self.units[unit].slot.is_some() {
            return Ok(());
        }
        let mut parked = self.shared.parked.lock();
        if !parked.has_room(self.units[unit].ranges.len()) {
            drop(parked);
            return self.give_back_pages(unit);
        }
        for range in &self.units[unit].ranges {
            parked.park(self.region.interior(range.clone()));
        }
        Ok(())
    }

    fn check(&self, unit: usize) -> Result<(), ResidencyError> {
        if unit >= self.units.len() {
            return Err(ResidencyError::NoSuchUnit { unit, count: self.units.len() });
        }
        Ok(())
    }

    /// The unit other than `unit` that holds `unit`'s slot (loading or loaded), if any.
    fn slot_holder(&self, units: &[UnitRecord], unit: usize) -> Option<usize> {
        let slot = self.units[unit].slot?;
        self.slot_units[slot].iter().copied().find(|&other| other != unit && units[other].state != UnitState::Empty)
    }

    /// Start loading `unit` if it is empty. Never blocks on I/O. A unit whose slot another
    /// unit still holds is not loaded yet (a read-ahead that comes too early); `wait_ready`
    /// takes the slot. Its chunks are read before every background read's (and a background
    /// load of it under way moves ahead with them).
    pub fn request(&self, unit: usize) -> Result<(), ResidencyError> {
        self.enqueue(unit, false)
    }

    /// `request`, for a read no computation waits for yet (the host cache's warm fill): queued
    /// behind every other read, so that it takes only the time the disk would idle.
    pub fn request_background(&self, unit: usize) -> Result<(), ResidencyError> {
        self.enqueue(unit, true)
    }

    fn enqueue(&self, unit: usize, background: bool) -> Result<(), ResidencyError> {
        self.check(unit)?;
        let mut units = self.shared.units.locked();
        if units[unit].state == UnitState::Loading && !background && units[unit].background {
            units[unit].background = false;
            drop(units);
            self.promote(unit);
            return Ok(());
        }
        if units[unit].state != UnitState::Empty || self.slot_holder(&units, unit).is_some() {
            return Ok(());
        }
        let shift = self.units[unit].shift;
        let phase = (self.region.huge_phase() + shift) % HUGE_PAGE_BYTES;
        let state = &mut units[unit];
        let chunks: Vec<Chunk> = self.units[unit]
            .ranges
            .iter()
            .flat_map(|range| {
                let mut pieces = Vec::new();
                let mut start = range.start;
                while start < range.end {
                    // Chunks end on huge-page boundaries of the address space, so each huge
                    // page of the unit is read, and backed with parked pages, by one chunk.
                    let aligned = (start + CHUNK_BYTES + phase) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES - phase;
                    let end = aligned.min(range.end);
                    pieces.push(start..end);
                    start = end;
                }
                pieces
            })
            .map(|range| Chunk {
                unit,
                generation: state.generation,
                range,
                shift,
                recycle: self.units[unit].slot.is_none(),
                background,
            })
            .collect();
        if chunks.is_empty() {
            state.state = UnitState::Ready;
            return Ok(());
        }
        state.state = UnitState::Loading;
        state.pending_chunks = chunks.len();
        state.background = background;
        state.error = None;
        drop(units);
        let woken = chunks.len();
        let mut queue = self.shared.queue.locked();
        // Behind the other reads asked for, ahead of the background ones.
        let at = if background {
            queue.len()
        } else {
            queue.iter().position(|chunk| chunk.background).unwrap_or(queue.len())
        };
        let behind = queue.split_off(at);
        queue.extend(chunks);
        queue.extend(behind);
        drop(queue);
        // One reader per chunk: waking all of them for a chunk or two makes the idle ones
        // preempt the compute thread only to find the queue empty.
        for _ in 0..woken {
            self.shared.queue_changed.notify_one();
        }
        Ok(())
    }

    /// A background load of `unit` is now asked for: its chunks still queued move ahead of the
    /// background ones (behind the other reads asked for).
    fn promote(&self, unit: usize) {
        let mut queue = self.shared.queue.locked();
        let (mut mine, mut rest): (Vec<Chunk>, Vec<Chunk>) =
            queue.drain(..).partition(|chunk| chunk.unit == unit && chunk.background);
        for chunk in &mut mine {
            chunk.background = false;
        }
        let at = rest.iter().position(|chunk| chunk.background).unwrap_or(rest.len());
        let background = rest.split_off(at);
        queue.extend(rest);
        queue.extend(mine);
        queue.extend(background);
    }

    /// Take `unit`'s slot from the unit holding it: that unit's load is waited for, then it is
    /// empty (its bytes are overwritten by the next read). Only the caller that computes knows
    /// the holder is not in use (the dense window, at the entry of `unit`'s layer).
    fn claim_slot(&self, unit: usize) {
        let mut units = self.shared.units.locked();
        while let Some(holder) = self.slot_holder(&units, unit) {
            if units[holder].state == UnitState::Loading {
                units = crate::sync::wait(&self.shared.changed, units);
                continue;
            }
            units[holder].state = UnitState::Empty;
            units[holder].generation += 1;
            units[holder].error = None;
            self.stats.record_unit_released();
            self.shared.changed.notify_all();
        }
    }

    /// Block until `unit` is ready (loading it if needed, into its slot if it has one).
    /// Returns the time spent waiting, counted as the compute's stall.
    pub fn wait_ready(&self, unit: usize) -> Result<Duration, ResidencyError> {
        let waited = self.wait_ready_quietly(unit)?;
        if !waited.is_zero() {
            self.stats.record_stall(waited);
        }
        Ok(waited)
    }

    /// `wait_ready` for a thread beside the compute (the split's CPU lanes): its wait is not
    /// the compute's stall, which waits for that thread's result instead.
    pub fn wait_ready_quietly(&self, unit: usize) -> Result<Duration, ResidencyError> {
        self.check(unit)?;
        self.claim_slot(unit);
        self.request(unit)?;
        let started = Instant::now();
        let mut units = self.shared.units.locked();
        let mut waited = false;
        loop {
            let state = &mut units[unit];
            if state.state == UnitState::Evicting {
                if let Some(reason) = state.error.take() {
                    // Drop what the failed load wrote and forget it, so a later request tries
                    // again from scratch.
                    drop(units);
                    let _ = self.give_back_pages(unit);
                    let mut units = self.shared.units.locked();
                    units[unit].state = UnitState::Empty;
                    units[unit].generation += 1;
                    self.shared.changed.notify_all();
                    return Err(ResidencyError::Read { unit, reason });
                }
            }
            match state.state {
                UnitState::Ready => break,
                UnitState::Empty => {
                    drop(units);
                    self.claim_slot(unit);
                    self.request(unit)?;
                    units = self.shared.units.locked();
                }
                UnitState::Loading | UnitState::Evicting => {
                    waited = true;
                    units = crate::sync::wait(&self.shared.changed, units);
                }
            }
        }
        Ok(if waited { started.elapsed() } else { Duration::ZERO })
    }

    /// Abandon a load nobody needs any more (a mispredicted prefetch) if none of its reads has
    /// started: its chunks leave the queue and the unit is empty again, with nothing written.
    /// Returns whether it was cancelled; a load already under way finishes normally.
    pub fn cancel(&self, unit: usize) -> Result<bool, ResidencyError> {
        self.check(unit)?;
        let mut units = self.shared.units.locked();
        if units[unit].state != UnitState::Loading || units[unit].error.is_some() {
            return Ok(false);
        }
        let generation = units[unit].generation;
        let ours = |chunk: &Chunk| chunk.unit == unit && chunk.generation == generation;
        // Lock order: units, then queue (workers never hold the queue while taking units).
        let mut queue = self.shared.queue.locked();
        if queue.iter().filter(|chunk| ours(chunk)).count() != units[unit].pending_chunks {
            return Ok(false);
        }
        queue.retain(|chunk| !ours(chunk));
        drop(queue);
        let state = &mut units[unit];
        state.state = UnitState::Empty;
        state.generation += 1;
        state.pending_chunks = 0;
        self.shared.changed.notify_all();
        Ok(true)
    }

    /// Give `unit`'s pages back to the kernel, unless it lives in a slot (whose pages the next
    /// unit of the slot is read into). The first error, after trying every range.
    fn give_back_pages(&self, unit: usize) -> Result<(), ResidencyError> {
        if self.units[unit].slot.is_some() {
            return Ok(());
        }
        let mut parked = self.shared.parked.lock();
        let mut result = Ok(());
        for range in &self.units[unit].ranges {
            // Its pages still parked are given back here, so they leave the set.
            parked.claim(&self.region.interior(range.clone()));
            if let (Err(error), true) = (self.region.release(range.clone()), result.is_ok()) {
                result = Err(error.into());
            }
        }
        result
    }

    /// Fill empty `unit` from memory instead of the file: `fill` writes the unit's bytes at their
    /// region positions (the device's expert pool hands an expert it evicts back to the
    /// cache so). Its pages are claimed as a read's are. Returns whether the unit was empty and
    /// is now ready; a unit loading, ready or in a slot is left as it is.
    pub fn fill(&self, unit: usize, fill: impl FnOnce(&Region) -> Result<(), String>) -> Result<bool, ResidencyError> {
        self.check(unit)?;
        {
            let mut units = self.shared.units.locked();
            if units[unit].state != UnitState::Empty || self.units[unit].slot.is_some() {
                return Ok(false);
            }
            units[unit].state = UnitState::Loading;
            units[unit].pending_chunks = 0;
            units[unit].error = None;
        }
        for range in &self.units[unit].ranges {
            self.shared.parked.adopt(&self.region, range.clone(), &self.stats);
        }
        let result = fill(&self.region);
        let mut units = self.shared.units.locked();
        if result.is_ok() {
            units[unit].state = UnitState::Ready;
        } else {
            units[unit].state = UnitState::Empty;
            units[unit].generation += 1;
        }
        self.shared.changed.notify_all();
        result.map(|()| true).map_err(|reason| ResidencyError::Read { unit, reason })
    }

    /// Empty `unit`: its pages are parked for the next unit loaded (or given back), and a unit
    /// in a slot keeps them for the next unit of the slot. A unit still loading is waited for
    /// first (a read must never land in pages that move); an empty unit is left alone.
    pub fn release(&self, unit: usize) -> Result<(), ResidencyError> {
        self.check(unit)?;
        let mut units = self.shared.units.locked();
        while units[unit].state == UnitState::Loading {
            units = crate::sync::wait(&self.shared.changed, units);
        }
        if units[unit].state != UnitState::Ready {
            return Ok(());
        }
        units[unit].state = UnitState::Evicting;
        drop(units);
        let result = self.park(unit);
        let mut units = self.shared.units.locked();
        units[unit].state = UnitState::Empty;
        units[unit].generation += 1;
        self.stats.record_unit_released();
        self.shared.changed.notify_all();
        result
    }
}

#[cfg(test)]
mod tests {
    use std::ops::Range;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar, Mutex};

    use crate::io::{IoError, Region, HUGE_PAGE_BYTES};
    use crate::store::residency::{Residency, ResidencyError, StreamUnit, UnitReader, UnitState, CHUNK_BYTES};
    use crate::store::stats::IoStats;

    /// Writes a recognisable pattern, or fails on the chosen calls.
    struct FakeReader {
        calls: AtomicUsize,
        fail_on: Vec<usize>,
    }

    impl UnitReader for FakeReader {
        fn read(&self, region: &Region, range: Range<u64>, shift: u64) -> Result<u64, IoError> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            if self.fail_on.contains(&call) {
                return Err(IoError::ShortRead { path: "model.gguf".into(), offset: range.start, wanted: 10, got: 3 });
            }
            let bytes: Vec<u8> = (range.start..range.end).map(|offset| (offset % 251) as u8 + 1).collect();
            region.write(range.start + shift, &bytes);
            Ok(range.end - range.start)
        }
    }

    /// Holds every read until the gate opens, counting them.
    struct GatedReader {
        open: Mutex<bool>,
        opened: Condvar,
        calls: AtomicUsize,
    }

    impl UnitReader for GatedReader {
        fn read(&self, region: &Region, range: Range<u64>, shift: u64) -> Result<u64, IoError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            region.write(range.start + shift, &vec![7u8; (range.end - range.start) as usize]);
            Ok(range.end - range.start)
        }
    }

    #[test]
    fn a_load_not_yet_started_is_cancelled_and_one_under_way_is_not() {
        let region = Arc::new(Region::reserve(64 << 20, false).unwrap());
        let units = vec![
            StreamUnit::mirrored(std::iter::once(0..(9 << 20)).collect()),
            StreamUnit::mirrored(vec![(16 << 20)..(17 << 20), (20 << 20)..(21 << 20)]),
        ];
        let reader =
            Arc::new(GatedReader { open: Mutex::new(false), opened: Condvar::new(), calls: AtomicUsize::new(0) });
        let residency = Residency::new(region.clone(), reader.clone(), units, 1, Arc::new(IoStats::default()));
        residency.request(0).unwrap();
        while reader.calls.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        residency.request(1).unwrap();
        // Unit 0's first chunk is being read: it must finish. Unit 1 has not started.
        assert!(!residency.cancel(0).unwrap());
        assert!(residency.cancel(1).unwrap());
        assert_eq!(residency.state(1), Some((UnitState::Empty, 1)));
        assert!(!residency.cancel(1).unwrap(), "nothing left to cancel");
        *reader.open.lock().unwrap() = true;
        reader.opened.notify_all();
        residency.wait_ready(0).unwrap();
        assert_eq!(reader.calls.load(Ordering::SeqCst), 3, "unit 0's three chunks only: unit 1 was never read");
        assert_eq!(region.copy_out((16 << 20)..(16 << 20) + 1)[0], 0, "a cancelled unit's pages were never written");
        // It loads again on demand.
        residency.wait_ready(1).unwrap();
        assert_eq!(residency.state(1).unwrap().0, UnitState::Ready);
        assert_eq!(region.copy_out((20 << 20)..(20 << 20) + 1)[0], 7);
    }

    fn residency(fail_on: Vec<usize>) -> Residency {
        let region = Arc::new(Region::reserve(64 << 20, false).unwrap());
        let units = vec![
            StreamUnit::mirrored(std::iter::once(0..(9 << 20)).collect()),
            StreamUnit::mirrored(vec![(16 << 20)..(17 << 20) + 123, (20 << 20)..(21 << 20)]),
        ];
        Residency::new(
            region,
            Arc::new(FakeReader { calls: AtomicUsize::new(0), fail_on }),
            units,
            3,
            Arc::new(IoStats::default()),
        )
    }

    #[test]
    fn a_unit_becomes_ready_with_its_bytes_and_its_pages_back_the_next_unit_read_after_release() {
        let region = Arc::new(Region::reserve(64 << 20, false).unwrap());
        let units = vec![
            StreamUnit::mirrored(std::iter::once((4 << 20)..(5 << 20)).collect()),
            StreamUnit::mirrored(vec![(16 << 20)..(17 << 20) + 123, (20 << 20)..(21 << 20)]),
        ];
        let residency = Residency::new(
            region,
            Arc::new(FakeReader { calls: AtomicUsize::new(0), fail_on: Vec::new() }),
            units,
            3,
            Arc::new(IoStats::default()),
        );
        let pattern = |range: Range<u64>| range.map(|offset| (offset % 251) as u8 + 1).collect::<Vec<u8>>();
        assert_eq!(residency.state(1), Some((UnitState::Empty, 0)));
        residency.wait_ready(1).unwrap();
        assert_eq!(residency.state(1), Some((UnitState::Ready, 0)));
        assert_eq!(residency.region().copy_out((16 << 20)..(17 << 20) + 123), pattern((16 << 20)..(17 << 20) + 123));
        residency.release(1).unwrap();
        assert_eq!(residency.state(1), Some((UnitState::Empty, 1)));
        // Unit 0's 1 MiB is read into the first of unit 1's parked 1 MiB ranges that covers it
        // (moved away, those pages read as zeros where they were); the other stays parked.
        residency.wait_ready(0).unwrap();
        assert_eq!(residency.region().copy_out((4 << 20)..(5 << 20)), pattern((4 << 20)..(5 << 20)));
        assert!(residency.region().copy_out((16 << 20)..(17 << 20)).iter().all(|&byte| byte == 0));
        assert_eq!(residency.stats().snapshot().recycled_bytes, 1 << 20);
        // Unit 1 loads again: its second range's pages are still in place, its first faults in
        // afresh.
        residency.wait_ready(1).unwrap();
        for range in [(16 << 20)..(17 << 20) + 123, (20 << 20)..(21 << 20)] {
            assert_eq!(residency.region().copy_out(range.clone()), pattern(range));
        }
        let stats = residency.stats().snapshot();
        assert_eq!(stats.recycled_bytes, 2 << 20);
        assert_eq!((stats.units_loaded, stats.units_released), (3, 1));
        // 1 MiB + 123 bytes rounds up to whole pages, plus 1 MiB, twice; and 1 MiB.
        assert_eq!(stats.bytes_read, 2 * ((1 << 20) + 123 + (1 << 20)) + (1 << 20));
    }

    /// Writes the whole range on its first call, and only the first page of every later one.
    struct FirstPageReader {
        calls: AtomicUsize,
    }

    impl UnitReader for FirstPageReader {
        fn read(&self, region: &Region, range: Range<u64>, shift: u64) -> Result<u64, IoError> {
            let end = if self.calls.fetch_add(1, Ordering::SeqCst) == 0 { range.end } else { range.start + 4096 };
            region.write(
                range.start + shift,
                &(range.start..end).map(|offset| (offset % 251) as u8 + 1).collect::<Vec<u8>>(),
            );
            Ok(range.end - range.start)
        }
    }

    /// The pages a released unit gave up are the very pages the next unit is read into (moved,
    /// not faulted in afresh): where the read does not write, they still hold the released
    /// unit's bytes, and the released unit's range reads as zeros.
    #[test]
    fn the_next_unit_is_read_into_the_released_units_pages() {
        let region = Arc::new(Region::reserve(8 << 20, false).unwrap());
        let units = vec![
            StreamUnit::mirrored(std::iter::once(0..(1 << 20)).collect()),
            StreamUnit::mirrored(std::iter::once((4 << 20)..(5 << 20)).collect()),
        ];
        let residency = Residency::new(
            region.clone(),
            Arc::new(FirstPageReader { calls: AtomicUsize::new(0) }),
            units,
            1,
            Arc::new(IoStats::default()),
        );
        residency.wait_ready(0).unwrap();
        residency.release(0).unwrap();
        residency.wait_ready(1).unwrap();
        let first = (0..(1 << 20)).map(|offset| (offset % 251) as u8 + 1).collect::<Vec<u8>>();
        assert_eq!(region.copy_out((4 << 20) + 4096..(5 << 20)), first[4096..], "unit 1's pages are unit 0's");
        assert!(region.copy_out(0..(1 << 20)).iter().all(|&byte| byte == 0), "unit 0's range gave its pages up");
        assert_eq!(residency.stats().snapshot().recycled_bytes, 1 << 20);
    }

    /// Units sharing a slot: a read-ahead waits while another unit holds the slot, the unit
    /// that computes takes it, and the slot's pages stay faulted in across units.
    #[test]
    fn units_in_one_slot_take_turns_and_keep_its_pages() {
        let region = Arc::new(Region::reserve(64 << 20, false).unwrap());
        // Two file ranges that both live at region offset 32 MiB.
        let in_slot = |start: u64| StreamUnit {
            ranges: std::iter::once(start..start + (1 << 20)).collect(),
            shift: (32 << 20) - start,
            slot: Some(0),
        };
        let units = vec![in_slot(0), in_slot(4 << 20)];
        let residency = Residency::new(
            region.clone(),
            Arc::new(FakeReader { calls: AtomicUsize::new(0), fail_on: vec![] }),
            units,
            2,
            Arc::new(IoStats::default()),
        );
        let pattern =
            |start: u64| (start..start + (1 << 20)).map(|offset| (offset % 251) as u8 + 1).collect::<Vec<u8>>();
        residency.wait_ready(0).unwrap();
        assert_eq!(region.copy_out((32 << 20)..(33 << 20)), pattern(0));
        // Unit 0 holds the slot: a read-ahead of unit 1 does nothing yet.
        residency.request(1).unwrap();
        assert_eq!(residency.state(1).unwrap().0, UnitState::Empty);
        // Released, unit 0's bytes stay (no page is given back), and unit 1 loads over them.
        residency.release(0).unwrap();
        assert_eq!(region.copy_out((32 << 20)..(33 << 20)), pattern(0));
        residency.request(1).unwrap();
        residency.wait_ready(1).unwrap();
        assert_eq!(region.copy_out((32 << 20)..(33 << 20)), pattern(4 << 20));
        // The unit that computes takes the slot from a loaded one.
        residency.wait_ready(0).unwrap();
        assert_eq!(residency.state(1).unwrap().0, UnitState::Empty);
        assert_eq!(region.copy_out((32 << 20)..(33 << 20)), pattern(0));
        // Nothing was read at the mirror positions.
        assert!(region.copy_out(0..(8 << 20)).iter().all(|&byte| byte == 0));
    }

    /// Records the ranges it is asked to read.
    struct RecordingReader {
        ranges: Mutex<Vec<Range<u64>>>,
    }

    impl UnitReader for RecordingReader {
        fn read(&self, _region: &Region, range: Range<u64>, _shift: u64) -> Result<u64, IoError> {
            self.ranges.lock().unwrap().push(range.clone());
            Ok(range.end - range.start)
        }
    }

    /// A unit is read in chunks of at most `CHUNK_BYTES` that meet on huge-page boundaries of
    /// the address space, so no huge page is split between two chunks' moves.
    #[test]
    fn chunks_meet_on_huge_page_boundaries() {
        let region = Arc::new(Region::reserve(64 << 20, false).unwrap());
        let unit = 12_345..(30 << 20) + 77;
        let reader = Arc::new(RecordingReader { ranges: Mutex::new(Vec::new()) });
        let residency = Residency::new(
            region.clone(),
            reader.clone(),
            vec![StreamUnit::mirrored(std::iter::once(unit.clone()).collect())],
            1,
            Arc::new(IoStats::default()),
        );
        residency.wait_ready(0).unwrap();
        let mut chunks = reader.ranges.lock().unwrap().clone();
        chunks.sort_by_key(|chunk| chunk.start);
        assert_eq!((chunks[0].start, chunks.last().unwrap().end), (unit.start, unit.end));
        for pair in chunks.windows(2) {
            assert_eq!(pair[0].end, pair[1].start);
            assert_eq!((pair[0].end + region.huge_phase()) % HUGE_PAGE_BYTES, 0, "{chunks:?}");
        }
        assert!(chunks.iter().all(|chunk| chunk.end - chunk.start <= CHUNK_BYTES));
    }

    #[test]
    fn a_failed_read_is_reported_once_and_the_unit_can_load_again() {
        // The 9 MiB unit is read in three chunks; the second fails.
        let residency = residency(vec![1]);
        let error = residency.wait_ready(0).unwrap_err();
        assert!(error.to_string().contains("short read"), "{error}");
        assert_eq!(residency.state(0).unwrap().0, UnitState::Empty);
        // Nothing the failed load wrote survives.
        assert!(residency.region().copy_out(0..(9 << 20)).iter().all(|&byte| byte == 0));
        residency.wait_ready(0).unwrap();
        assert_eq!(residency.state(0).unwrap().0, UnitState::Ready);
    }

    /// Background reads (the warm fill) queue behind every read asked for: with one reader
    /// held on unit 0, units 1 and 2 asked in the background, then unit 3 asked for and unit 2
    /// waited for, the reader takes 3, then 2 (moved ahead when waited for), then 1.
    #[test]
    fn background_reads_wait_behind_the_reads_asked_for() {
        let region = Arc::new(Region::reserve(64 << 20, false).unwrap());
        let unit = |mib: u64| StreamUnit::mirrored(std::iter::once((mib << 20)..((mib + 1) << 20)).collect());
        let units = vec![unit(0), unit(8), unit(16), unit(24)];
        let reader =
            Arc::new(GatedReader { open: Mutex::new(false), opened: Condvar::new(), calls: AtomicUsize::new(0) });
        let order = Arc::new(Mutex::new(Vec::new()));
        struct Recorded {
            gate: Arc<GatedReader>,
            order: Arc<Mutex<Vec<u64>>>,
        }
        impl UnitReader for Recorded {
            fn read(&self, region: &Region, range: Range<u64>, shift: u64) -> Result<u64, IoError> {
                self.order.lock().unwrap().push(range.start >> 23);
                self.gate.read(region, range, shift)
            }
        }
        let recorded = Arc::new(Recorded { gate: reader.clone(), order: order.clone() });
        let residency = Residency::new(region, recorded, units, 1, Arc::new(IoStats::default()));
        residency.request_background(0).unwrap();
        while reader.calls.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        residency.request_background(1).unwrap();
        residency.request_background(2).unwrap();
        residency.request(3).unwrap();
        // Asked for while its background load waits: it moves ahead of unit 1, behind unit 3.
        residency.request(2).unwrap();
        *reader.open.lock().unwrap() = true;
        reader.opened.notify_all();
        for unit in 0..4 {
            residency.wait_ready(unit).unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 3, 2, 1]);
    }

    #[test]
    fn unknown_units_are_errors() {
        let residency = residency(vec![]);
        assert!(matches!(residency.request(7), Err(ResidencyError::NoSuchUnit { unit: 7, count: 2 })));
    }
}
