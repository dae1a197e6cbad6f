//! The expert cache's replacement bookkeeping (LRU and SLRU), apart from I/O so that the trace
//! simulator replays it as the stream runs it.
use std::collections::BTreeSet;

pub use crate::plan::CachePolicy;

/// Replacement bookkeeping, independent of I/O so the trace simulator can replay it. Resident
/// units are kept ordered by last use in two sets (SLRU's probationary and protected segments;
/// LRU uses the first alone), so finding a victim costs O(log units) however many experts the
/// model has: tens of thousands of units (Qwen3-Next: 48 layers × 512) cost no more per token
/// than eight.
#[derive(Clone, Debug)]
pub struct CacheModel {
    policy: CachePolicy,
    capacity: usize,
    resident: Vec<bool>,
    protected_segment: Vec<bool>,
    last_used: Vec<u64>,
    /// Resident units outside the protected segment, by (last use, unit).
    probation: BTreeSet<(u64, usize)>,
    /// Resident units in SLRU's protected segment, by (last use, unit).
    protected: BTreeSet<(u64, usize)>,
    resident_count: usize,
    clock: u64,
}

impl CacheModel {
    pub fn new(policy: CachePolicy, units: usize, capacity: usize) -> CacheModel {
        CacheModel {
            policy,
            capacity: capacity.max(1),
            resident: vec![false; units],
            protected_segment: vec![false; units],
            last_used: vec![0; units],
            probation: BTreeSet::new(),
            protected: BTreeSet::new(),
            resident_count: 0,
            clock: 0,
        }
    }

    /// Whether admitting another unit would evict one.
    pub fn is_full(&self) -> bool {
        self.resident_count >= self.capacity
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn is_resident(&self, unit: usize) -> bool {
        self.resident[unit]
    }

    /// The segment resident `unit` is in.
    fn segment(&mut self, unit: usize) -> &mut BTreeSet<(u64, usize)> {
        if self.protected_segment[unit] {
            &mut self.protected
        } else {
            &mut self.probation
        }
    }

    /// Stamp resident `unit` as used now, in `protect`ed segment or not.
    fn stamp(&mut self, unit: usize, protect: bool) {
        let key = (self.last_used[unit], unit);
        self.segment(unit).remove(&key);
        self.clock += 1;
        self.last_used[unit] = self.clock;
        self.protected_segment[unit] = protect;
        let key = (self.clock, unit);
        self.segment(unit).insert(key);
    }

    /// Record a use of resident `unit`.
    pub fn touch(&mut self, unit: usize) {
        let promote = self.policy == CachePolicy::Slru;
        let newly = promote && !self.protected_segment[unit];
        self.stamp(unit, promote || self.protected_segment[unit]);
        // Keep the protected segment at most 80% of the cache: demote its LRU.
        if newly && self.protected.len() > self.capacity * 4 / 5 {
            if let Some(&(used, victim)) = self.protected.iter().find(|(_, candidate)| *candidate != unit) {
                self.protected.remove(&(used, victim));
                self.protected_segment[victim] = false;
                self.probation.insert((used, victim));
            }
        }
    }

    /// Admit `unit` (a miss), returning the units to evict first so that it fits. `pinned`
    /// units (the layer about to compute) are never chosen.
    pub fn admit(&mut self, unit: usize, pinned: &[usize]) -> Vec<usize> {
        self.admit_evicting(unit, pinned, false)
    }

    /// `admit`, with the victims unpinned units, probationary first (for LRU, the only
    /// segment), the least recent of each segment; or, `sweeping`, the most recent. A sweep over
    /// every layer (a prompt batch picks nearly every expert of each layer in turn, and the
    /// next batch does again) is a cycle, whose least recent unit is the one needed soonest:
    /// evicting the most recent (Belady's choice for a cycle), a sweep reads what the cache
    /// cannot hold, where under LRU every unit of a cycle longer than the cache is a miss.
    pub fn admit_evicting(&mut self, unit: usize, pinned: &[usize], sweeping: bool) -> Vec<usize> {
        let mut evicted = Vec::new();
        while self.resident_count >= self.capacity {
            let pick = |segment: &BTreeSet<(u64, usize)>| {
                let unpinned = |candidate: &usize| !pinned.contains(candidate);
                let mut units = segment.iter().map(|&(_, candidate)| candidate);
                if sweeping {
                    units.rev().find(unpinned)
                } else {
                    units.find(unpinned)
                }
            };
            let Some(victim) = pick(&self.probation).or_else(|| pick(&self.protected)) else { break };
            self.remove(victim);
            evicted.push(victim);
        }
        self.remove(unit);
        self.resident[unit] = true;
        self.resident_count += 1;
        self.stamp(unit, false);
        evicted
    }

    /// Admit `unit` only if that needs no eviction of a `protected` unit and keeps the cache
    /// within its capacity (for prefetches, which must never overfill it); None otherwise.
    /// `sweeping`: the victims are a sweep's (`admit_evicting`).
    pub fn try_admit(&mut self, unit: usize, protected: &[usize], sweeping: bool) -> Option<Vec<usize>> {
        if self.resident_count >= self.capacity {
            // Only a full cache needs victims: count the unprotected ones then.
            let mut shielded = protected.to_vec();
            shielded.sort_unstable();
            shielded.dedup();
            let evictable =
                self.resident_count - shielded.iter().filter(|&&candidate| self.resident[candidate]).count();
            if self.resident_count + 1 - self.capacity > evictable {
                return None;
            }
        }
        Some(self.admit_evicting(unit, protected, sweeping))
    }

    /// Mark resident `unit` as recently used without counting it as a use (no promotion to
    /// SLRU's protected segment): a prediction, not a hit.
    pub fn refresh(&mut self, unit: usize) {
        let protect = self.protected_segment[unit];
        self.stamp(unit, protect);
    }

    /// Drop a unit that is no longer in memory (a cancelled read).
    pub fn forget(&mut self, unit: usize) {
        self.remove(unit);
    }

    fn remove(&mut self, unit: usize) {
        if self.resident[unit] {
            let key = (self.last_used[unit], unit);
            self.segment(unit).remove(&key);
            self.resident[unit] = false;
            self.resident_count -= 1;
        }
        self.protected_segment[unit] = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recent_and_never_a_pinned_unit() {
        let mut cache = CacheModel::new(CachePolicy::Lru, 10, 3);
        assert!(cache.admit(0, &[]).is_empty());
        assert!(cache.admit(1, &[]).is_empty());
        assert!(cache.admit(2, &[]).is_empty());
        cache.touch(0);
        assert_eq!(cache.admit(3, &[]), vec![1]);
        // 2 is the LRU now, but pinned: 0 goes instead.
        assert_eq!(cache.admit(4, &[2, 4]), vec![0]);
        assert!(cache.is_resident(2) && cache.is_resident(3) && cache.is_resident(4));
    }

    #[test]
    fn a_prefetch_never_overfills_the_cache_or_evicts_a_protected_unit() {
        let mut cache = CacheModel::new(CachePolicy::Slru, 10, 3);
        for unit in 0..3 {
            cache.admit(unit, &[]);
        }
        // Everything resident is protected: no room, and nothing changes.
        assert_eq!(cache.try_admit(5, &[0, 1, 2, 5], false), None);
        assert!(!cache.is_resident(5) && (0..3).all(|unit| cache.is_resident(unit)));
        // One unprotected unit: it makes room.
        assert_eq!(cache.try_admit(5, &[0, 2, 5], false), Some(vec![1]));
        assert!(cache.is_resident(5));
        // A refresh is not a use: 0 stays probationary and is the first SLRU victim after 2.
        cache.refresh(0);
        assert_eq!(cache.admit(6, &[6]), vec![2]);
    }

    /// Sweeps over 10 units (one layer after another, again and again) through a cache of 6:
    /// under LRU every pick is a miss; sweeping, the cache keeps most of what it holds, and a
    /// pinned unit (the layer computing) is never a victim.
    #[test]
    fn a_sweep_keeps_what_the_cache_holds_where_lru_keeps_nothing() {
        let hits = |sweeping: bool| {
            let mut cache = CacheModel::new(CachePolicy::Slru, 10, 6);
            let mut hits = 0;
            for _ in 0..5 {
                for unit in 0..10 {
                    if cache.is_resident(unit) {
                        hits += 1;
                        if sweeping {
                            cache.refresh(unit);
                        } else {
                            cache.touch(unit);
                        }
                    } else if sweeping {
                        assert!(!cache.admit_evicting(unit, &[unit], true).contains(&unit));
                    } else {
                        cache.admit(unit, &[unit]);
                    }
                }
            }
            hits
        };
        assert_eq!(hits(false), 0);
        // After the first sweep, each of the four keeps at least 5 of its 10 picks.
        assert!(hits(true) >= 4 * 5, "{}", hits(true));
        let mut cache = CacheModel::new(CachePolicy::Lru, 10, 2);
        cache.admit(0, &[]);
        cache.admit(1, &[]);
        assert_eq!(cache.admit_evicting(2, &[1, 2], true), vec![0]);
    }

    #[test]
    fn slru_keeps_reused_units_over_one_off_ones() {
        let mut cache = CacheModel::new(CachePolicy::Slru, 100, 4);
        for unit in 0..4 {
            cache.admit(unit, &[]);
        }
        cache.touch(0);
        cache.touch(1);
        // A scan of one-off units evicts probationary ones only.
        for unit in 10..20 {
            cache.admit(unit, &[]);
        }
        assert!(cache.is_resident(0) && cache.is_resident(1), "reused units must survive a scan");
        let mut lru = CacheModel::new(CachePolicy::Lru, 100, 4);
        for unit in 0..4 {
            lru.admit(unit, &[]);
        }
        lru.touch(0);
        lru.touch(1);
        for unit in 10..20 {
            lru.admit(unit, &[]);
        }
        assert!(!lru.is_resident(0) && !lru.is_resident(1), "plain LRU loses them to the scan");
    }
}
