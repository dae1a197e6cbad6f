//! How soon the router picks an expert again, and what that makes of an expert cache: the
//! recorded routing of a model (`ReuseDepths`, counted by the expert stream at every decode
//! and kept by `hw::measured` for the next plan) turned into the share of picks a cache of a
//! given size serves (`hit_rate`). Without a record the planner assumes uniform routing, which
//! is the least a cache of that size can do for a router that is not adversarial.
use serde::{Deserialize, Serialize};

/// A histogram of per-layer reuse depths: for each pick of an expert, how many other experts
/// of its layer were picked since its previous pick (Mattson's stack distance, per layer).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReuseDepths {
    /// `depths[d]`: picks with `d` other experts of the layer picked since the last one.
    pub depths: Vec<u64>,
    /// Picks of an expert its layer had not picked before in the run (compulsory misses).
    pub first: u64,
}

impl ReuseDepths {
    pub fn picks(&self) -> u64 {
        self.depths.iter().sum::<u64>() + self.first
    }

    /// Fold in another run's counts.
    pub fn add(&mut self, other: &ReuseDepths) {
        if self.depths.len() < other.depths.len() {
            self.depths.resize(other.depths.len(), 0);
        }
        for (mine, theirs) in self.depths.iter_mut().zip(&other.depths) {
            *mine += theirs;
        }
        self.first += other.first;
    }

    /// The counts since `earlier` (a snapshot of the same tracker).
    pub fn since(&self, earlier: &ReuseDepths) -> ReuseDepths {
        ReuseDepths {
            depths: self
                .depths
                .iter()
                .enumerate()
                .map(|(depth, count)| count - earlier.depths.get(depth).copied().unwrap_or(0))
                .collect(),
            first: self.first - earlier.first,
        }
    }

    /// The share of picks an LRU cache of `units` (layer, expert) units spread over `layers`
    /// streamed MoE layers serves. Every token visits every layer, so between two picks of
    /// one expert the other layers see about as many distinct experts as its own: the cache
    /// holds a pick whose layer saw `d` others since when `(d + 1) × layers ≤ units`, that is
    /// the picks of depth below `units / layers` (the fractional depth counted in proportion).
    /// None for an empty record.
    pub fn hit_rate(&self, units: f64, layers: u64) -> Option<f64> {
        let picks = self.picks();
        if picks == 0 || layers == 0 {
            return None;
        }
        let reach = (units / layers as f64).max(0.0);
        let whole = reach.floor() as usize;
        let served: f64 = self.depths.iter().take(whole).map(|&count| count as f64).sum::<f64>()
            + self.depths.get(whole).map_or(0.0, |&count| count as f64 * reach.fract());
        Some((served / picks as f64).clamp(0.0, 1.0))
    }
}

/// The hit rate of an LRU cache of `units` over `layers` layers of `n_expert` experts when the
/// router picks uniformly: the cache's share of the units.
pub fn uniform_hit_rate(units: f64, layers: u64, n_expert: u64) -> f64 {
    let total = (layers * n_expert) as f64;
    if total <= 0.0 {
        0.0
    } else {
        (units / total).clamp(0.0, 1.0)
    }
}

/// Counts reuse depths as picks arrive: a most-recent-first list of each layer's experts.
#[derive(Clone, Debug, Default)]
pub struct ReuseTracker {
    recent: Vec<Vec<u32>>,
    counts: ReuseDepths,
}

impl ReuseTracker {
    pub fn new(n_layer: usize, n_expert: usize) -> ReuseTracker {
        ReuseTracker { recent: vec![Vec::new(); n_layer], counts: ReuseDepths { depths: vec![0; n_expert], first: 0 } }
    }

    /// One token's picks in `layer` (distinct experts): each one's depth is counted against the
    /// layer's order before this token, then they all become the most recent.
    pub fn record(&mut self, layer: usize, experts: &[usize]) {
        let Some(recent) = self.recent.get_mut(layer) else { return };
        for &expert in experts {
            match recent.iter().position(|&seen| seen as usize == expert) {
                Some(depth) => {
                    if let Some(count) = self.counts.depths.get_mut(depth) {
                        *count += 1;
                    }
                }
                None => self.counts.first += 1,
            }
        }
        recent.retain(|seen| !experts.contains(&(*seen as usize)));
        let mut front: Vec<u32> = experts.iter().map(|&expert| expert as u32).collect();
        front.append(recent);
        *recent = front;
    }

    pub fn counts(&self) -> &ReuseDepths {
        &self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_count_the_other_experts_picked_since() {
        let mut tracker = ReuseTracker::new(1, 8);
        tracker.record(0, &[1, 2]);
        tracker.record(0, &[3]);
        tracker.record(0, &[1]);
        // Since 1 was last picked, only 3 was (2 came with it).
        assert_eq!(tracker.counts().first, 3);
        assert_eq!(tracker.counts().depths[..3], [0, 1, 0]);
        tracker.record(0, &[1]);
        assert_eq!(tracker.counts().depths[0], 1, "picked again at once: depth 0");
    }

    #[test]
    fn uniform_routing_gives_the_caches_share_and_a_hot_set_more() {
        // Uniform picks over 16 experts of 4 layers: LRU serves the cache's share of the units.
        let mut tracker = ReuseTracker::new(4, 16);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            for layer in 0..4 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                tracker.record(layer, &[(state % 16) as usize]);
            }
        }
        let depths = tracker.counts();
        for units in [8.0, 16.0, 32.0, 48.0] {
            let hit = depths.hit_rate(units, 4).unwrap();
            let uniform = uniform_hit_rate(units, 4, 16);
            assert!((hit - uniform).abs() < 0.02, "{units} units: {hit} against {uniform}");
        }
        // Two experts of a layer take every pick: a cache of two per layer serves them all.
        let mut hot = ReuseTracker::new(4, 16);
        for token in 0..1000 {
            for layer in 0..4 {
                hot.record(layer, &[token % 2]);
            }
        }
        assert!(hot.counts().hit_rate(8.0, 4).unwrap() > 0.99);
        assert!(hot.counts().hit_rate(4.0, 4).unwrap() < 0.01, "one per layer: each pick is the other one");
        assert_eq!(ReuseDepths::default().hit_rate(8.0, 4), None);
    }

    #[test]
    fn records_add_and_subtract() {
        let mut tracker = ReuseTracker::new(1, 4);
        tracker.record(0, &[0, 1]);
        let earlier = tracker.counts().clone();
        tracker.record(0, &[0]);
        let since = tracker.counts().since(&earlier);
        assert_eq!((since.first, since.picks()), (0, 1));
        let mut total = earlier.clone();
        total.add(&since);
        assert_eq!(&total, tracker.counts());
    }
}
