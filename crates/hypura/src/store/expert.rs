//! MoE expert streaming: only the experts the router picks are read, an expert cache serves
//! repeats, and nothing else of the expert tensors is ever in memory.
//!
//! The eval hook stops once per MoE layer, at `ffn_moe_topk-L` (the router's top-k choice),
//! reads the chosen ids, makes exactly those (layer, expert) units ready — the union over the
//! batch's tokens — and returns before the expert matmul runs. Units stay cached until the
//! policy evicts them to make room; the units of the layer about to compute are never evicted.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hypura_sys::{EvalHook, ObservedNode};
use serde::Serialize;

use super::residency::{FailureLatch, Residency, ResidencyError, SliceState};

const TOP_K_NODE: &str = "ffn_moe_topk-";

/// Which cached unit to evict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Segmented LRU: a unit enters a probationary segment and moves to the protected one on
    /// its second use; eviction takes the probationary LRU first, so one-off experts do not
    /// push out the ones in steady use.
    Slru,
}

impl CachePolicy {
    pub fn parse(text: &str) -> Option<CachePolicy> {
        match text {
            "lru" => Some(CachePolicy::Lru),
            "slru" => Some(CachePolicy::Slru),
            _ => None,
        }
    }
}

/// Replacement bookkeeping, independent of I/O so the trace simulator can replay it.
#[derive(Clone, Debug)]
pub struct CacheModel {
    policy: CachePolicy,
    capacity: usize,
    resident: Vec<bool>,
    protected_segment: Vec<bool>,
    last_used: Vec<u64>,
    resident_count: usize,
    protected_count: usize,
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
            resident_count: 0,
            protected_count: 0,
            clock: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn is_resident(&self, unit: usize) -> bool {
        self.resident[unit]
    }

    /// Record a use of resident `unit`.
    pub fn touch(&mut self, unit: usize) {
        self.clock += 1;
        self.last_used[unit] = self.clock;
        if self.policy == CachePolicy::Slru && !self.protected_segment[unit] {
            self.protected_segment[unit] = true;
            self.protected_count += 1;
            // Keep the protected segment at most 80% of the cache: demote its LRU.
            let limit = self.capacity * 4 / 5;
            if self.protected_count > limit {
                if let Some(victim) = self.lru_where(|model, candidate| model.protected_segment[candidate] && candidate != unit, &[]) {
                    self.protected_segment[victim] = false;
                    self.protected_count -= 1;
                }
            }
        }
    }

    /// Admit `unit` (a miss), returning the units to evict first so that it fits. `pinned`
    /// units (the layer about to compute) are never chosen.
    pub fn admit(&mut self, unit: usize, pinned: &[usize]) -> Vec<usize> {
        let mut evicted = Vec::new();
        while self.resident_count >= self.capacity {
            let victim = match self.policy {
                CachePolicy::Lru => self.lru_where(|model, candidate| model.resident[candidate], pinned),
                CachePolicy::Slru => self
                    .lru_where(|model, candidate| model.resident[candidate] && !model.protected_segment[candidate], pinned)
                    .or_else(|| self.lru_where(|model, candidate| model.resident[candidate], pinned)),
            };
            let Some(victim) = victim else { break };
            self.remove(victim);
            evicted.push(victim);
        }
        self.resident[unit] = true;
        self.resident_count += 1;
        self.clock += 1;
        self.last_used[unit] = self.clock;
        evicted
    }

    fn remove(&mut self, unit: usize) {
        if self.resident[unit] {
            self.resident[unit] = false;
            self.resident_count -= 1;
        }
        if self.protected_segment[unit] {
            self.protected_segment[unit] = false;
            self.protected_count -= 1;
        }
    }

    fn lru_where(&self, eligible: impl Fn(&CacheModel, usize) -> bool, pinned: &[usize]) -> Option<usize> {
        (0..self.resident.len())
            .filter(|&candidate| eligible(self, candidate) && !pinned.contains(&candidate))
            .min_by_key(|&candidate| self.last_used[candidate])
    }
}

/// Counts per (token, layer, expert) — never per graph node.
#[derive(Debug, Default)]
pub struct ExpertCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    layer_visits: AtomicU64,
    misses_by_layer: Vec<AtomicU64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ExpertSnapshot {
    /// Selected (layer, expert) units already resident when the router chose them.
    pub hits: u64,
    /// Selected units that had to be read.
    pub misses: u64,
    /// Router observations (MoE layers computed).
    pub layer_visits: u64,
    pub misses_by_layer: Vec<u64>,
    /// Units read ahead on a co-activation prediction, and how many the router then picked.
    pub prefetch_issued: u64,
    pub prefetch_used: u64,
}

impl ExpertSnapshot {
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

impl std::ops::Sub for ExpertSnapshot {
    type Output = ExpertSnapshot;

    fn sub(self, earlier: ExpertSnapshot) -> ExpertSnapshot {
        ExpertSnapshot {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            layer_visits: self.layer_visits - earlier.layer_visits,
            misses_by_layer: self.misses_by_layer.iter().zip(&earlier.misses_by_layer).map(|(now, then)| now - then).collect(),
            prefetch_issued: self.prefetch_issued - earlier.prefetch_issued,
            prefetch_used: self.prefetch_used - earlier.prefetch_used,
        }
    }
}

/// One router decision, for `--trace`.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct RouteRecord {
    pub layer: u32,
    /// Expert ids per token of the batch.
    pub experts: Vec<Vec<i32>>,
}

struct State {
    cache: CacheModel,
    /// The units of the layer computing now: never evicted.
    pinned: Vec<usize>,
    /// Co-activation counts: `coactivation[layer][a * n_expert + b]` is how often a token that
    /// used expert `a` at `layer` used expert `b` at `layer + 1`.
    coactivation: Vec<Vec<u32>>,
    /// The previous router call (layer and per-token picks), to count co-activations.
    previous: Option<(usize, Vec<Vec<i32>>)>,
    /// Units prefetched and not yet used, per layer: the accuracy count.
    prefetched: Vec<Vec<usize>>,
}


/// Drives expert residency from the router's choices.
pub struct ExpertStream {
    residency: Arc<Residency>,
    n_layer: usize,
    n_expert: usize,
    /// Prefetch likely next-layer experts into idle I/O (co-activation prediction).
    prefetch: bool,
    prefetch_issued: AtomicU64,
    prefetch_used: AtomicU64,
    state: Mutex<State>,
    counters: ExpertCounters,
    trace: Option<Mutex<Vec<RouteRecord>>>,
    /// The first read error and the abort flag it raises.
    pub failure: FailureLatch,
}

impl ExpertStream {
    /// Units are numbered `layer * n_expert + expert`; `capacity` is how many the cache holds.
    pub fn new(residency: Arc<Residency>, n_layer: usize, n_expert: usize, capacity: usize, policy: CachePolicy, trace: bool) -> ExpertStream {
        let units = n_layer * n_expert;
        ExpertStream {
            residency,
            n_layer,
            n_expert,
            prefetch: false,
            prefetch_issued: AtomicU64::new(0),
            prefetch_used: AtomicU64::new(0),
            state: Mutex::new(State {
                cache: CacheModel::new(policy, units, capacity.max(n_expert)),
                pinned: Vec::new(),
                coactivation: vec![vec![0; n_expert * n_expert]; n_layer],
                previous: None,
                prefetched: vec![Vec::new(); n_layer],
            }),
            counters: ExpertCounters { misses_by_layer: (0..n_layer).map(|_| AtomicU64::new(0)).collect(), ..ExpertCounters::default() },
            trace: trace.then(|| Mutex::new(Vec::new())),
            failure: FailureLatch::default(),
        }
    }

    pub fn residency(&self) -> &Arc<Residency> {
        &self.residency
    }

    /// Turn co-activation prefetch on or off (before use).
    pub fn with_prefetch(mut self, prefetch: bool) -> ExpertStream {
        self.prefetch = prefetch;
        self
    }


    pub fn snapshot(&self) -> ExpertSnapshot {
        ExpertSnapshot {
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            layer_visits: self.counters.layer_visits.load(Ordering::Relaxed),
            misses_by_layer: self.counters.misses_by_layer.iter().map(|misses| misses.load(Ordering::Relaxed)).collect(),
            prefetch_issued: self.prefetch_issued.load(Ordering::Relaxed),
            prefetch_used: self.prefetch_used.load(Ordering::Relaxed),
        }
    }

    /// The recorded routing so far (with `--trace`), taken.
    pub fn take_trace(&self) -> Vec<RouteRecord> {
        self.trace.as_ref().map(|trace| std::mem::take(&mut *trace.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))).unwrap_or_default()
    }


    fn layer_of(name: &str) -> Option<usize> {
        name.strip_prefix(TOP_K_NODE)?.parse().ok()
    }

    /// Make the chosen experts of `layer` ready.
    fn route(&self, layer: usize, rows: &[Vec<i32>]) -> Result<(), ResidencyError> {
        let mut chosen: Vec<usize> = Vec::new();
        for &expert in rows.iter().flatten() {
            // An id outside the expert count would make ggml read outside the tensor.
            let expert = usize::try_from(expert).ok().filter(|&expert| expert < self.n_expert).ok_or(ResidencyError::NoSuchUnit {
                unit: expert.max(0) as usize,
                count: self.n_expert,
            })?;
            let unit = layer * self.n_expert + expert;
            if !chosen.contains(&unit) {
                chosen.push(unit);
            }
        }
        self.counters.layer_visits.fetch_add(1, Ordering::Relaxed);
        let mut to_load = Vec::new();
        let mut predicted = Vec::new();
        {
            let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            state.pinned.clone_from(&chosen);
            self.learn(&mut state, layer, rows);
            if self.prefetch {
                let prefetched = std::mem::take(&mut state.prefetched[layer]);
                let used = chosen.iter().filter(|unit| prefetched.contains(unit)).count();
                self.prefetch_used.fetch_add(used as u64, Ordering::Relaxed);
            }
            for &unit in &chosen {
                if state.cache.is_resident(unit) {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    state.cache.touch(unit);
                } else {
                    self.counters.misses.fetch_add(1, Ordering::Relaxed);
                    self.counters.misses_by_layer[layer].fetch_add(1, Ordering::Relaxed);
                    let pinned = state.pinned.clone();
                    for victim in state.cache.admit(unit, &pinned) {
                        self.residency.release(victim)?;
                    }
                    to_load.push(unit);
                }
            }
            if self.prefetch && layer + 1 < self.n_layer {
                predicted = self.predict(&state, layer, rows);
            }
        }
        for &unit in &to_load {
            self.residency.request(unit)?;
        }
        // Prefetch only into I/O that this layer's own misses leave idle, and only into cache
        // room that does not cost a unit of this layer.
        if !predicted.is_empty() && to_load.is_empty() {
            let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let mut protect = state.pinned.clone();
            protect.extend_from_slice(&predicted);
            for unit in predicted {
                if state.cache.is_resident(unit) {
                    continue;
                }
                for victim in state.cache.admit(unit, &protect) {
                    self.residency.release(victim)?;
                }
                state.prefetched[layer + 1].push(unit);
                self.prefetch_issued.fetch_add(1, Ordering::Relaxed);
                self.residency.request(unit)?;
            }
        }
        for &unit in &chosen {
            // A hit on a unit a failed read left empty reloads it here.
            if self.residency.state(unit).map(|(state, _)| state) != Some(SliceState::Ready) {
                self.residency.wait_ready(unit)?;
            }
        }
        Ok(())
    }
}

impl ExpertStream {
    /// Count, for each token, which experts at the previous layer led to which experts here.
    fn learn(&self, state: &mut State, layer: usize, rows: &[Vec<i32>]) {
        if let Some((previous_layer, previous_rows)) = state.previous.take() {
            if previous_layer + 1 == layer && previous_rows.len() == rows.len() {
                let n_expert = self.n_expert;
                let counts = &mut state.coactivation[previous_layer];
                for (before, after) in previous_rows.iter().zip(rows) {
                    for &from in before.iter().filter(|&&expert| (expert as usize) < n_expert) {
                        for &to in after.iter().filter(|&&expert| (expert as usize) < n_expert) {
                            let cell = &mut counts[from as usize * n_expert + to as usize];
                            *cell = cell.saturating_add(1);
                        }
                    }
                }
            }
        }
        state.previous = Some((layer, rows.to_vec()));
    }

    /// The next layer's likely units for this batch's tokens: per token, the experts most
    /// often co-activated with its current ones, as many as the router will pick.
    fn predict(&self, state: &State, layer: usize, rows: &[Vec<i32>]) -> Vec<usize> {
        let n_expert = self.n_expert;
        let counts = &state.coactivation[layer];
        let mut predicted = Vec::new();
        for token in rows.iter().take(4) {
            let mut scores = vec![0u64; n_expert];
            for &from in token.iter().filter(|&&expert| (expert as usize) < n_expert) {
                for (to, score) in scores.iter_mut().enumerate() {
                    *score += u64::from(counts[from as usize * n_expert + to]);
                }
            }
            let mut order: Vec<usize> = (0..n_expert).filter(|&expert| scores[expert] > 0).collect();
            order.sort_by_key(|&expert| std::cmp::Reverse(scores[expert]));
            for expert in order.into_iter().take(token.len()) {
                let unit = (layer + 1) * n_expert + expert;
                if !predicted.contains(&unit) {
                    predicted.push(unit);
                }
            }
        }
        predicted
    }
}

impl EvalHook for ExpertStream {
    fn wants(&self, name: &str) -> bool {
        Self::layer_of(name).is_some_and(|layer| layer < self.n_layer)
    }

    fn observe(&self, node: &ObservedNode<'_>) {
        let Some(layer) = Self::layer_of(node.name()) else {
            return;
        };
        self.residency.stats().record_observation();
        let result = match node.i32_rows() {
            Some(rows) => {
                if let Some(trace) = &self.trace {
                    trace.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(RouteRecord { layer: layer as u32, experts: rows.clone() });
                }
                self.route(layer, &rows)
            }
            None => Err(ResidencyError::Read { unit: layer, reason: format!("{} is not a readable I32 tensor", node.name()) }),
        };
        if let Err(error) = result {
            tracing::error!("expert streaming at layer {layer}: {error}");
            self.failure.fail(error);
        }
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
