//! How soon the router picks an expert again, and what that makes of an expert cache: the
//! recorded routing of a model (`ReuseDepths`, counted by the expert stream at every decode
//! and kept by `hw::measured` for the next plan) turned into the share of picks a cache of a
//! given size serves (`hit_rate`). Without a record the planner assumes real models' routing
//! (`ReuseDepths::real_routing`), never uniform routing.
use serde::{Deserialize, Serialize};

/// At most this many bins: a record stays a few kilobytes however many experts a model has.
const MAX_BINS: u64 = 1024;

/// A histogram of LRU stack distances over (layer, expert) units: for each decode pick, how
/// many other units were picked since that unit's previous pick (Mattson's stack distance). An
/// LRU cache of `C` units serves exactly the picks of distance below `C`, so one recording
/// answers for every cache size.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReuseDepths {
    /// `depths[i]`: picks at a distance in `[i × bin, (i + 1) × bin)`.
    pub depths: Vec<u64>,
    /// Units per bin.
    pub bin: u64,
    /// Streamed MoE layers the picks came from (distances scale with them).
    pub layers: u64,
    /// Picks of a unit not picked before in the run (compulsory misses).
    pub first: u64,
    /// Decode picks per (layer, expert) unit, layer by layer (`layer × n_expert + expert`):
    /// which experts the pool's slots and the host cache start with (`plan::gpu`'s warm order).
    /// Empty where not recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unit_picks: Vec<u64>,
}

impl ReuseDepths {
    pub fn picks(&self) -> u64 {
        self.depths.iter().sum::<u64>() + self.first
    }

    /// Fold in another record; its distances are scaled to this record's layers and bins.
    pub fn add(&mut self, other: &ReuseDepths) {
        if self.picks() == 0 {
            *self = other.clone();
            return;
        }
        let scale = self.layers.max(1) as f64 / other.layers.max(1) as f64;
        for (index, &count) in other.depths.iter().enumerate() {
            let depth = (index as f64 + 0.5) * other.bin.max(1) as f64 * scale;
            let target = (depth / self.bin.max(1) as f64) as usize;
            if self.depths.len() <= target {
                self.depths.resize(target + 1, 0);
            }
            self.depths[target] += count;
        }
        self.first += other.first;
        if self.unit_picks.len() == other.unit_picks.len() {
            self.unit_picks.iter_mut().zip(&other.unit_picks).for_each(|(mine, theirs)| *mine += theirs);
        } else if !other.unit_picks.is_empty() {
            self.unit_picks.clone_from(&other.unit_picks);
        }
    }

    /// The counts since `earlier` (a snapshot of the same tracker).
    pub fn since(&self, earlier: &ReuseDepths) -> ReuseDepths {
        ReuseDepths {
            depths: self
                .depths
                .iter()
                .enumerate()
                .map(|(index, count)| count - earlier.depths.get(index).copied().unwrap_or(0))
                .collect(),
            first: self.first - earlier.first,
            unit_picks: self
                .unit_picks
                .iter()
                .enumerate()
                .map(|(unit, count)| count - earlier.unit_picks.get(unit).copied().unwrap_or(0))
                .collect(),
            ..self.clone()
        }
    }

    /// The units of `layer` (of `n_expert` experts) by recorded decode picks, most picked
    /// first; those never picked left out. Empty without a record of picks for this shape.
    pub fn most_picked(&self, layer: usize, n_expert: usize) -> Vec<usize> {
        let Some(counts) = self.unit_picks.get(layer * n_expert..(layer + 1) * n_expert) else { return Vec::new() };
        let mut experts: Vec<usize> = (0..n_expert).filter(|&expert| counts[expert] > 0).collect();
        experts.sort_by_key(|&expert| (std::cmp::Reverse(counts[expert]), expert));
        experts
    }

    /// The share of picks an LRU cache of `units` (layer, expert) units over `layers` streamed
    /// MoE layers serves: the picks of distance below `units`, the distances scaled from the
    /// recorded layers to `layers` (every token visits every layer, so the units picked between
    /// two picks of one grow with the layers). None for an empty record.
    pub fn hit_rate(&self, units: f64, layers: u64) -> Option<f64> {
        Some((self.served(units, layers)? / self.picks() as f64).clamp(0.0, 1.0))
    }

    /// The same share once every expert has been picked: the first picks (a miss for a cache of
    /// any size) left out. What a long session settles at, and what tells cache sizes apart.
    /// None for a record of first picks only.
    pub fn steady_hit_rate(&self, units: f64, layers: u64) -> Option<f64> {
        let again = self.picks() - self.first;
        if again == 0 {
            return None;
        }
        Some((self.served(units, layers)? / again as f64).clamp(0.0, 1.0))
    }

    /// The picks of distance below `units` scaled to `layers` (see `hit_rate`).
    fn served(&self, units: f64, layers: u64) -> Option<f64> {
        if self.picks() == 0 || layers == 0 || self.layers == 0 {
            return None;
        }
        let reach = units.max(0.0) * self.layers as f64 / layers as f64 / self.bin.max(1) as f64;
        let whole = reach.floor() as usize;
        Some(
            self.depths.iter().take(whole).map(|&count| count as f64).sum::<f64>()
                + self.depths.get(whole).map_or(0.0, |&count| count as f64 * reach.fract()),
        )
    }
}

/// Real routing, for a model without a record of its own: the stack distances of
/// Qwen3-30B-A3B's recorded picks (ten prompts of about 140 tokens each, every prompt replayed
/// cold over its 48 layers × 128 experts; `data/routing/`), as the share of picks whose distance
/// is below each 128th of the units, and the share that are an expert's first pick.
/// `bench::routing`'s test recomputes both from the traces.
pub const REAL_ROUTING_BELOW: [f64; 129] = [
    0.0000, 0.0747, 0.0752, 0.0752, 0.0752, 0.0752, 0.0752, 0.0752, 0.4486, 0.4488, 0.4491, 0.4518, 0.4706, 0.5034,
    0.5323, 0.5470, 0.5621, 0.5770, 0.5928, 0.6072, 0.6198, 0.6317, 0.6413, 0.6519, 0.6621, 0.6729, 0.6825, 0.6934,
    0.7044, 0.7164, 0.7276, 0.7401, 0.7514, 0.7627, 0.7738, 0.7843, 0.7940, 0.8043, 0.8147, 0.8219, 0.8298, 0.8384,
    0.8465, 0.8527, 0.8597, 0.8649, 0.8704, 0.8750, 0.8795, 0.8840, 0.8875, 0.8908, 0.8944, 0.8976, 0.9005, 0.9032,
    0.9058, 0.9082, 0.9109, 0.9128, 0.9142, 0.9158, 0.9174, 0.9187, 0.9200, 0.9211, 0.9223, 0.9235, 0.9245, 0.9252,
    0.9261, 0.9271, 0.9279, 0.9284, 0.9288, 0.9292, 0.9295, 0.9297, 0.9299, 0.9301, 0.9302, 0.9304, 0.9305, 0.9305,
    0.9306, 0.9306, 0.9306, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307,
    0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307,
    0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307, 0.9307,
    0.9307, 0.9307, 0.9307,
];
pub const REAL_ROUTING_FIRST: f64 = 0.0693;

impl ReuseDepths {
    /// A record of real routing (`REAL_ROUTING_BELOW`) for a model of `layers` MoE layers of
    /// `n_expert` experts: the distances scaled to its units. What a plan assumes until a run of
    /// the model records its own; never uniform routing, which no trained router has.
    pub fn real_routing(layers: u64, n_expert: u64) -> ReuseDepths {
        const PICKS: f64 = 1e6;
        let units = (layers * n_expert).max(1);
        let bin = units.div_ceil(MAX_BINS).max(1);
        // The table's share below a fraction of the units, between its steps linearly.
        let below = |fraction: f64| {
            let at = fraction.clamp(0.0, 1.0) * (REAL_ROUTING_BELOW.len() - 1) as f64;
            let (step, part) = (at.floor() as usize, at.fract());
            let next = REAL_ROUTING_BELOW.get(step + 1).copied().unwrap_or(REAL_ROUTING_BELOW[step]);
            REAL_ROUTING_BELOW[step] * (1.0 - part) + next * part
        };
        ReuseDepths {
            depths: (0..units.div_ceil(bin))
                .map(|index| {
                    let (from, to) = (index * bin, ((index + 1) * bin).min(units));
                    ((below(to as f64 / units as f64) - below(from as f64 / units as f64)) * PICKS).round() as u64
                })
                .collect(),
            bin,
            layers: layers.max(1),
            first: (REAL_ROUTING_FIRST * PICKS).round() as u64,
            // Which experts are popular is the model's own: nothing to assume.
            unit_picks: Vec::new(),
        }
    }

    /// The share of picks whose distance is below each `1/steps` of `units` (0 to `steps`
    /// steps), and the share of first picks: the table `REAL_ROUTING_BELOW` is.
    pub fn shares_below(&self, units: u64, steps: u64) -> (Vec<f64>, f64) {
        let picks = self.picks().max(1) as f64;
        let below = (0..=steps)
            .map(|step| self.served((units * step) as f64 / steps as f64, self.layers).unwrap_or(0.0) / picks)
            .collect();
        (below, self.first as f64 / picks)
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

/// Counts stack distances as picks arrive: each unit's last pick time, and a Fenwick tree over
/// times marking the times that are some unit's last pick, so a distance is one prefix sum.
/// Times are renumbered when they run out, so memory stays a few times the unit count.
#[derive(Clone, Debug, Default)]
pub struct ReuseTracker {
    n_expert: usize,
    /// Per unit, its last pick's time (0: never).
    last: Vec<usize>,
    /// Fenwick tree over times 1..tree.len().
    tree: Vec<i64>,
    now: usize,
    layer_seen: Vec<bool>,
    counts: ReuseDepths,
}

impl ReuseTracker {
    pub fn new(n_layer: usize, n_expert: usize) -> ReuseTracker {
        let units = n_layer * n_expert;
        ReuseTracker {
            n_expert,
            last: vec![0; units],
            tree: vec![0; 4 * units + 64],
            now: 0,
            layer_seen: vec![false; n_layer],
            counts: ReuseDepths {
                depths: Vec::new(),
                bin: (units as u64).div_ceil(MAX_BINS).max(1),
                layers: 0,
                first: 0,
                unit_picks: vec![0; units],
            },
        }
    }

    fn mark(&mut self, time: usize, delta: i64) {
        let mut index = time;
        while index < self.tree.len() {
            self.tree[index] += delta;
            index += index & index.wrapping_neg();
        }
    }

    /// Marked times at or before `time`.
    fn prefix(&self, time: usize) -> i64 {
        let (mut index, mut sum) = (time, 0);
        while index > 0 {
            sum += self.tree[index];
            index -= index & index.wrapping_neg();
        }
        sum
    }

    /// Renumber the live times 1..=m in their order, when the next time would not fit.
    fn compact(&mut self) {
        let mut live: Vec<(usize, usize)> =
            self.last.iter().enumerate().filter(|(_, &time)| time > 0).map(|(unit, &time)| (time, unit)).collect();
        live.sort_unstable();
        self.tree.iter_mut().for_each(|node| *node = 0);
        for (time, &(_, unit)) in live.iter().enumerate() {
            self.last[unit] = time + 1;
            self.mark(time + 1, 1);
        }
        self.now = live.len();
    }

    /// One token's picks in `layer` (distinct experts): their distances are counted against the
    /// order before this token, then they become the most recent.
    pub fn record(&mut self, layer: usize, experts: &[usize]) {
        if layer >= self.layer_seen.len() {
            return;
        }
        if !self.layer_seen[layer] {
            self.layer_seen[layer] = true;
            self.counts.layers += 1;
        }
        let units: Vec<usize> = experts
            .iter()
            .filter(|&&expert| expert < self.n_expert)
            .map(|&expert| layer * self.n_expert + expert)
            .collect();
        let marked = self.prefix(self.now);
        for &unit in &units {
            self.counts.unit_picks[unit] += 1;
            match self.last[unit] {
                0 => self.counts.first += 1,
                time => {
                    // Units whose last pick came after this one's, less this token's own.
                    let distance = (marked - self.prefix(time)) as u64;
                    let bin = (distance / self.counts.bin) as usize;
                    if self.counts.depths.len() <= bin {
                        self.counts.depths.resize(bin + 1, 0);
                    }
                    self.counts.depths[bin] += 1;
                }
            }
        }
        if self.now + units.len() + 1 >= self.tree.len() {
            self.compact();
        }
        for unit in units {
            self.advance(unit);
        }
    }

    /// A prompt batch's picks in `layer`: they become the most recent (the cache holds them
    /// after the batch, as it does), without a distance counted (decode is what is predicted).
    pub fn touch(&mut self, layer: usize, experts: &[usize]) {
        if layer >= self.layer_seen.len() {
            return;
        }
        if self.now + experts.len() + 1 >= self.tree.len() {
            self.compact();
        }
        let n_expert = self.n_expert;
        for &expert in experts.iter().filter(|&&expert| expert < n_expert) {
            self.advance(layer * n_expert + expert);
        }
    }

    /// Make `unit`'s last pick the newest time.
    fn advance(&mut self, unit: usize) {
        if self.last[unit] > 0 {
            let time = self.last[unit];
            self.mark(time, -1);
        }
        self.now += 1;
        self.last[unit] = self.now;
        let now = self.now;
        self.mark(now, 1);
    }

    pub fn counts(&self) -> &ReuseDepths {
        &self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain LRU list of units, for the distances the tracker must give.
    fn lru_hits(picks: &[(usize, Vec<usize>)], n_expert: usize, capacity: usize) -> f64 {
        let mut order: Vec<usize> = Vec::new();
        let (mut hits, mut total) = (0, 0);
        for (layer, experts) in picks {
            for &expert in experts {
                let unit = layer * n_expert + expert;
                total += 1;
                if let Some(position) = order.iter().position(|&seen| seen == unit) {
                    hits += usize::from(position < capacity);
                    order.remove(position);
                }
                order.insert(0, unit);
            }
        }
        hits as f64 / total as f64
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn distances_count_the_units_picked_since() {
        let mut tracker = ReuseTracker::new(2, 8);
        tracker.record(0, &[1, 2]);
        tracker.record(1, &[3]);
        tracker.record(0, &[1]);
        // Since 1 was last picked: 2 (after it in its token) and layer 1's 3.
        assert_eq!(tracker.counts().first, 3);
        assert_eq!(tracker.counts().depths, vec![0, 0, 1]);
        tracker.record(0, &[1]);
        assert_eq!(tracker.counts().depths[0], 1, "picked again at once: distance 0");
        assert_eq!(tracker.counts().layers, 2);
        // A prompt batch's picks are recent afterwards, but not counted.
        tracker.touch(1, &[5, 6, 7]);
        assert_eq!(tracker.counts().picks(), 5);
        tracker.record(1, &[6]);
        assert_eq!((tracker.counts().first, tracker.counts().depths[1]), (3, 1), "only 7 came after 6");
    }

    #[test]
    fn the_hit_rate_is_an_lru_caches_at_every_size() {
        // Skewed picks of 2 of 16 experts in 4 layers, over enough tokens to renumber times.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut picks = Vec::new();
        for _ in 0..3000 {
            for layer in 0..4 {
                let first = (xorshift(&mut state) % 16) as usize % (1 + (xorshift(&mut state) % 16) as usize);
                let second = (first + 1 + (xorshift(&mut state) % 15) as usize) % 16;
                picks.push((layer, vec![first, second]));
            }
        }
        let mut tracker = ReuseTracker::new(4, 16);
        for (layer, experts) in &picks {
            tracker.record(*layer, experts);
        }
        for capacity in [4, 12, 24, 40, 64] {
            let predicted = tracker.counts().hit_rate(capacity as f64, 4).unwrap();
            let simulated = lru_hits(&picks, 16, capacity);
            assert!((predicted - simulated).abs() < 0.01, "{capacity} units: {predicted} against {simulated}");
        }
        assert!(tracker.counts().hit_rate(24.0, 4).unwrap() > uniform_hit_rate(24.0, 4, 16), "skew helps");
        assert_eq!(ReuseDepths::default().hit_rate(8.0, 4), None);
    }

    #[test]
    fn records_add_subtract_and_scale() {
        let mut tracker = ReuseTracker::new(1, 4);
        tracker.record(0, &[0, 1]);
        let earlier = tracker.counts().clone();
        tracker.record(0, &[0]);
        let since = tracker.counts().since(&earlier);
        assert_eq!((since.first, since.picks()), (0, 1));
        let mut total = earlier.clone();
        total.add(&since);
        assert_eq!(&total, tracker.counts());
        // A record over 2 layers, read for 4: distances double, so a cache twice the size
        // serves the same share.
        let record = ReuseDepths { depths: vec![10, 10, 0, 0], bin: 1, layers: 2, first: 0, ..Default::default() };
        assert_eq!(record.hit_rate(1.0, 2), Some(0.5));
        assert_eq!(record.hit_rate(2.0, 4), Some(0.5));
    }
}
