//! Page recycling: the pages of released stream units, parked for the next chunks read.
//!
//! `Residency` parks a released unit's pages here instead of giving them back to the kernel,
//! and each reader thread, before it reads a chunk at its mirror position, moves parked pages
//! under it (`Region::move_pages`), so the read lands in memory already faulted in: no page
//! fault, no zeroing. `Parked` is the allocator (which parked range backs which hole, huge
//! pages kept whole); `ParkedPages` is its lock, shared by the compute thread that parks and
//! the reader threads that adopt.
use crate::sync::Lock;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};

use super::stats::IoStats;
use crate::io::{huge_interior, IoError, Region};

/// The parked set, and the signal of moves finished; one per residency.
#[derive(Debug)]
pub(super) struct ParkedPages {
    /// Pages of released units kept for the next chunks read (see `Residency::park`).
    parked: Mutex<Parked>,
    /// Signalled when moves finish (`Parked::moving` shrinks).
    moved: Condvar,
}

impl ParkedPages {
    /// An empty set for a region that starts `phase` bytes past a huge-page boundary.
    pub(super) fn new(phase: u64) -> ParkedPages {
        ParkedPages { parked: Mutex::new(Parked::new(phase)), moved: Condvar::new() }
    }

    /// The parked set, locked (a lock poisoned by a panicking thread is taken over).
    pub(super) fn lock(&self) -> MutexGuard<'_, Parked> {
        self.parked.locked()
    }

    /// Back the pages wholly inside a chunk about to be read with parked pages, so the read lands
    /// in memory already faulted in (no page fault, no zeroing): its own pages where they are
    /// still parked stay put, the rest are moved over from other released units. Whatever no
    /// parked page covers faults in as the read writes it. Runs on the reader thread, before the
    /// read, so the compute thread waits for the moves only where it parks a unit meanwhile;
    /// chunk interiors never share a page with another chunk or unit, so no other read touches
    /// these pages. A refused move turns recycling off for good, except a source that spans two
    /// mappings, which is given back alone.
    pub(super) fn adopt(&self, region: &Region, range: Range<u64>, stats: &IoStats) {
        let target = region.interior(range);
        let mut parked = self.lock();
        // A source is a released unit's range, and that unit's own next read may claim it once
        // it has left the set: pages moved in while the old ones are still being moved out could
        // be carried away with its freshly read bytes. So a chunk waits for moves out of its range.
        while parked.moving.iter().any(|source| source.start < target.end && target.start < source.end) {
            parked = crate::sync::wait(&self.moved, parked);
        }
        if !parked.recycle || target.is_empty() {
            return;
        }
        let holes = parked.claim(&target);
        let uncovered: u64 = holes.iter().map(|hole| hole.end - hole.start).sum();
        stats.record_recycled(target.end - target.start - uncovered);
        let Backing { moves, given_back } = parked.take_for(holes);
        if moves.is_empty() && given_back.is_empty() {
            return;
        }
        parked.count_moves(moves.len(), region);
        parked
            .moving
            .extend(moves.iter().map(|&(from, _, bytes)| from..from + bytes).chain(given_back.iter().cloned()));
        drop(parked);
        for range in &given_back {
            let _ = region.release(range.clone());
        }
        let mut failure = None;
        for (index, &(from, to, bytes)) in moves.iter().enumerate() {
            match region.move_pages(from, to, bytes) {
                Ok(()) => stats.record_recycled(bytes),
                // A parked range that earlier moves filled from several places spans several
                // mappings, which one `mremap` cannot take on older kernels: give this one back,
                // keep recycling.
                Err(IoError::Move { source, .. }) if source.raw_os_error() == Some(libc::EFAULT) => {
                    let _ = region.release(from..from + bytes);
                }
                Err(error) => {
                    failure = Some((index, error));
                    break;
                }
            }
        }
        let mut parked = self.lock();
        parked
            .moving
            .retain(|source| !moves.iter().any(|&(from, _, _)| from == source.start) && !given_back.contains(source));
        if let Some((index, error)) = failure {
            tracing::warn!("reusing released pages failed, giving them back from now on: {error}");
            for &(from, _, bytes) in &moves[index..] {
                let _ = region.release(from..from + bytes);
            }
            parked.stop(region);
        }
        self.moved.notify_all();
    }
}

/// Page-aligned, disjoint region ranges whose pages belong to released units and wait to be
/// moved under a chunk about to be read.
#[derive(Debug)]
pub(super) struct Parked {
    ranges: Vec<Range<u64>>,
    /// The region's offset past a huge-page boundary (`Region::huge_phase`).
    phase: u64,
    /// Off when the kernel refused a move, or when moves split the process's memory into
    /// half as many mappings as the kernel allows: released pages are then given back.
    recycle: bool,
    /// The kernel's limit on mappings per process, and the moves since they were last counted.
    map_limit: usize,
    moves_since_count: usize,
    /// Sources of moves under way: left the set, their pages not yet moved out.
    moving: Vec<Range<u64>>,
}

/// How a chunk's holes are backed (`Parked::take_for`).
#[derive(Debug, Default, PartialEq)]
struct Backing {
    /// (from, to, bytes): parked pages moved under the chunk.
    moves: Vec<(u64, u64, u64)>,
    /// Parked ranges given back, as many bytes as fault in afresh.
    given_back: Vec<Range<u64>>,
}

/// At most this many ranges wait to be reused; past it, released pages go back to the kernel.
const MAX_PARKED_RANGES: usize = 4096;

/// Moves between counts of the process's mappings (each move can add a few).
const MOVES_PER_MAP_COUNT: usize = 256;

impl Parked {
    fn new(phase: u64) -> Parked {
        let map_limit = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(65_530);
        Parked { ranges: Vec::new(), phase, recycle: true, map_limit, moves_since_count: 0, moving: Vec::new() }
    }

    /// Whether `ranges` more parked ranges fit: recycling is on and the set stays within
    /// `MAX_PARKED_RANGES` (past it, released pages go back to the kernel).
    pub(super) fn has_room(&self, ranges: usize) -> bool {
        self.recycle && self.ranges.len() + ranges <= MAX_PARKED_RANGES
    }

    /// Add a released unit's whole pages (`Region::interior` of one of its ranges) to the set.
    pub(super) fn park(&mut self, pages: Range<u64>) {
        if !pages.is_empty() {
            self.ranges.push(pages);
        }
    }

    /// The whole huge pages inside `range` (empty where there is none).
    fn huge_part(&self, range: &Range<u64>) -> Range<u64> {
        huge_interior(range, self.phase)
    }

    /// The parts of `range` of one kind: its whole huge pages, or the pages around them.
    fn parts(&self, range: &Range<u64>, huge: bool) -> Vec<Range<u64>> {
        let inner = self.huge_part(range);
        let parts = if huge {
            vec![inner]
        } else if inner.is_empty() {
            vec![range.clone()]
        } else {
            vec![range.start..inner.start, inner.end..range.end]
        };
        parts.into_iter().filter(|part| !part.is_empty()).collect()
    }

    /// Take `piece` (inside parked range `index`) out of the set, keeping what lies around it.
    fn cut(&mut self, index: usize, piece: &Range<u64>) {
        let range = self.ranges[index].clone();
        let left = [range.start..piece.start, piece.end..range.end].into_iter().filter(|part| !part.is_empty());
        self.ranges.splice(index..=index, left);
    }

    /// Turn recycling off for good and give every parked page back.
    fn stop(&mut self, region: &Region) {
        self.recycle = false;
        for range in self.ranges.drain(..) {
            let _ = region.release(range);
        }
    }

    /// Every move lands in a mapping of its own (pages moved with `mremap` keep their origin,
    /// so the kernel cannot merge them with their new neighbours), and a process that runs
    /// out of mappings fails every later `mmap`, its allocator's included. So every so many
    /// moves the mappings are counted, and at half the limit recycling stops.
    fn count_moves(&mut self, moves: usize, region: &Region) {
        self.moves_since_count += moves;
        if self.moves_since_count < MOVES_PER_MAP_COUNT {
            return;
        }
        self.moves_since_count = 0;
        let mappings = std::fs::read_to_string("/proc/self/maps").map_or(usize::MAX, |maps| maps.lines().count());
        if mappings > self.map_limit / 2 {
            tracing::warn!(
                mappings,
                limit = self.map_limit,
                "reused pages split memory into too many mappings; giving released pages back from now on"
            );
            self.stop(region);
        }
    }

    /// Take the parts of `target` that are still parked out of the set (pages already in place)
    /// and return the parts that are not.
    pub(super) fn claim(&mut self, target: &Range<u64>) -> Vec<Range<u64>> {
        let mut holes = vec![target.clone()];
        let mut kept = Vec::with_capacity(self.ranges.len() + 1);
        for parked in self.ranges.drain(..) {
            let overlap = parked.start.max(target.start)..parked.end.min(target.end);
            if overlap.is_empty() {
                kept.push(parked);
                continue;
            }
            kept.extend(
                [parked.start..overlap.start, overlap.end..parked.end].into_iter().filter(|piece| !piece.is_empty()),
            );
            holes = holes
                .into_iter()
                .flat_map(|hole| [hole.start..hole.end.min(overlap.start), hole.start.max(overlap.end)..hole.end])
                .filter(|piece| !piece.is_empty())
                .collect();
        }
        self.ranges = kept;
        holes
    }

    /// Plan the moves that back `holes` with parked pages, taking them out of the set, and
    /// the parked pages to give back for what faults in afresh.
    ///
    /// Huge pages stay whole: a hole's whole huge pages are backed from parked whole huge
    /// pages, each from the parked part that fits best (the smallest that covers it, else the
    /// largest, and the next for what is left); the kernel moves each as one page-table entry,
    /// and the weights read into it keep their 2 MiB TLB entries. The pages around them come
    /// from one parked part around huge pages, the smallest that covers them, or fault in
    /// afresh: every `mremap` shoots down the compute threads' TLBs once per page table it
    /// touches, and edges gathered from fragments cost a shootdown every few pages. So memory
    /// stays bounded, as many parked bytes as fault in afresh are given back, the smallest
    /// parts first (the fragments no hole would take).
    fn take_for(&mut self, holes: Vec<Range<u64>>) -> Backing {
        let length = |range: &Range<u64>| range.end - range.start;
        let mut moves = Vec::new();
        let mut fresh = 0;
        for hole in holes {
            let inner = self.huge_part(&hole);
            let pieces = if inner.is_empty() {
                vec![(hole, false)]
            } else {
                vec![(hole.start..inner.start, false), (inner.clone(), true), (inner.end..hole.end, false)]
            };
            for (mut piece, huge) in pieces {
                // An edge takes one covering part or none; whole huge pages gather from several.
                while !piece.is_empty() {
                    let need = length(&piece);
                    let parts = self.parts_of_kind(huge);
                    let covering = parts
                        .iter()
                        .filter(|(_, part)| length(part) >= need)
                        .min_by_key(|(_, part)| length(part))
                        .cloned();
                    let largest = || parts.into_iter().max_by_key(|(_, part)| length(part));
                    let Some((index, part)) = covering.or_else(|| if huge { largest() } else { None }) else { break };
                    let bytes = need.min(length(&part));
                    moves.push((part.start, piece.start, bytes));
                    self.cut(index, &(part.start..part.start + bytes));
                    piece.start += bytes;
                }
                fresh += length(&piece);
            }
        }
        Backing { moves, given_back: self.take_smallest(fresh) }
    }

    /// (parked range index, part) for every part of one kind: whole huge pages, or the pages
    /// around them.
    fn parts_of_kind(&self, huge: bool) -> Vec<(usize, Range<u64>)> {
        self.ranges
            .iter()
            .enumerate()
            .flat_map(|(index, range)| self.parts(range, huge).into_iter().map(move |part| (index, part)))
            .collect()
    }

    /// Take parked parts of at least `bytes` in all out of the set, the smallest first.
    fn take_smallest(&mut self, bytes: u64) -> Vec<Range<u64>> {
        let mut parts: Vec<Range<u64>> =
            self.parts_of_kind(false).into_iter().chain(self.parts_of_kind(true)).map(|(_, part)| part).collect();
        parts.sort_by_key(|part| part.end - part.start);
        let mut left = bytes;
        let taken: Vec<Range<u64>> = parts
            .into_iter()
            .take_while(|part| {
                let take = left > 0;
                left = left.saturating_sub(part.end - part.start);
                take
            })
            .collect();
        for part in &taken {
            self.claim(part);
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::HUGE_PAGE_BYTES;

    /// A chunk's own parked pages stay where they are and leave the set; pages around huge
    /// ones come from the one parked part that covers them best, or fault in afresh while as
    /// many parked bytes go back, the smallest parts first.
    #[test]
    fn parked_pages_are_claimed_in_place_then_taken_best_fit() {
        const P: u64 = 4096;
        let mut parked = Parked { ranges: vec![0..8 * P, 20 * P..23 * P, 30 * P..40 * P], ..Parked::new(0) };
        // Pages 4..8 of the chunk 4..14 are still parked: they stay put.
        let holes = parked.claim(&(4 * P..14 * P));
        assert_eq!(holes, vec![8 * P..14 * P]);
        assert_eq!(parked.ranges, vec![0..4 * P, 20 * P..23 * P, 30 * P..40 * P]);
        // Six pages: the 10-page range is the only one that covers them; what is left of it stays.
        assert_eq!(parked.take_for(holes), Backing { moves: vec![(30 * P, 8 * P, 6 * P)], given_back: Vec::new() });
        assert_eq!(parked.ranges, vec![0..4 * P, 20 * P..23 * P, 36 * P..40 * P]);
        // Three pages: the three-page range fits exactly.
        assert_eq!(
            parked.take_for(std::iter::once(50 * P..53 * P).collect()),
            Backing { moves: vec![(20 * P, 50 * P, 3 * P)], given_back: Vec::new() }
        );
        // Nine pages: nothing covers them, and gathering them from pieces would cost a TLB
        // shootdown for each: they fault in afresh, and the parked eight pages go back.
        assert_eq!(
            parked.take_for(std::iter::once(60 * P..69 * P).collect()),
            Backing { moves: Vec::new(), given_back: vec![0..4 * P, 36 * P..40 * P] }
        );
        assert!(parked.ranges.is_empty());
        // Nothing parked: the hole faults in, and there is nothing to give back.
        assert_eq!(parked.take_for(std::iter::once(0..P).collect()), Backing::default());
    }

    /// Huge pages stay whole: a hole's whole huge pages come from parked huge pages in 2 MiB
    /// moves that keep the alignment, gathered from several where one does not cover them; the
    /// pages around them from parked pages around huge ones, never from a huge page.
    #[test]
    fn parked_huge_pages_back_huge_pages_and_edges_back_edges() {
        const P: u64 = 4096;
        const H: u64 = HUGE_PAGE_BYTES;
        let mut parked = Parked { ranges: std::iter::once(H - 4 * P..3 * H + 8 * P).collect(), ..Parked::new(0) };
        let backing = parked.take_for(std::iter::once(10 * H - 4 * P..12 * H + 8 * P).collect());
        assert_eq!(
            backing,
            Backing {
                moves: vec![(H - 4 * P, 10 * H - 4 * P, 4 * P), (H, 10 * H, 2 * H), (3 * H, 12 * H, 8 * P)],
                given_back: Vec::new()
            }
        );
        assert!(parked.ranges.is_empty());
        // Two huge pages parked apart back a two-page hole in two whole-page moves.
        parked.ranges = vec![H..2 * H, 5 * H..6 * H];
        let Backing { moves, given_back } = parked.take_for(std::iter::once(20 * H..22 * H).collect());
        assert!(given_back.is_empty());
        assert_eq!(moves.iter().map(|&(_, to, bytes)| (to, bytes)).collect::<Vec<_>>(), vec![(20 * H, H), (21 * H, H)]);
        let mut sources: Vec<u64> = moves.iter().map(|&(from, _, _)| from).collect();
        sources.sort_unstable();
        assert_eq!(sources, vec![H, 5 * H]);
        // Only a huge page parked: an edge hole does not split it; it faults in afresh and the
        // huge page goes back whole.
        parked.ranges = std::iter::once(H..2 * H).collect();
        assert_eq!(
            parked.take_for(std::iter::once(30 * H..30 * H + 4 * P).collect()),
            Backing { moves: Vec::new(), given_back: std::iter::once(H..2 * H).collect() }
        );
        // The region's phase moves the boundaries: at phase 4 pages, offset H - 4 pages is one.
        let parked = Parked { ranges: Vec::new(), ..Parked::new(4 * P) };
        assert_eq!(parked.huge_part(&(0..3 * H)), H - 4 * P..3 * H - 4 * P);
        assert!(parked.huge_part(&(0..H)).is_empty());
    }
}
