//! MoE expert streaming: only the experts the router picks are read, an expert cache serves
//! repeats, and nothing else of the expert tensors is ever in memory.
//!
//! The eval hook stops once per MoE layer, after the router: it keeps `ffn_moe_weights-L` (the
//! router's weights gathered by its top-k ids; input 1 is the ids the expert matmuls read) and
//! stops at the first node after the weights' normalisation, so that a backend that fuses the
//! router's ops (CUDA's top-k kernel) computes them as it does without the hook. There it reads
//! the chosen ids, makes exactly those (layer, expert) units ready — the union over the batch's
//! tokens — and returns before the expert matmul runs. Units stay cached until the policy
//! evicts them to make room; the units of the layer about to compute are never evicted.
//!
//! Prefetch (optional) predicts the next layer's experts by the stale gate: layer L+1's router
//! applied to the hidden state layer L's router saw (the residual stream changes little from
//! one layer to the next). Predicted units are queued behind this layer's misses, only into
//! cache room that evicts nothing protected, are kept from eviction until their layer runs,
//! and a mispredicted read that has not started by then is cancelled.
use crate::sync::Lock;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypura_sys::{EvalHook, ObservedNode};
use serde::Serialize;

use super::layout::ExpertUnits;
use super::pool::{ExpertPool, PoolSnapshot, Serving, StopTimes, Tiers};
use super::residency::{FailureLatch, Residency, ResidencyError, UnitState};
use super::split::{CpuJob, PlainCheck, SplitLayer, SplitWorker, MOE_OUT_NODE};
use crate::plan::{ReuseDepths, ReuseTracker};

/// The router's weights gathered by its ids (`get_rows(probs, ids)`), kept for the stop after
/// it. Input 1 is the ids the expert matmuls read: where a pooled layer's are rewritten to slots.
const WEIGHTS_NODE: &str = "ffn_moe_weights-";
/// The router's weights' own nodes after `ffn_moe_weights-L` (llama.cpp expands them together,
/// early, for its fused top-k kernel): `ffn_moe_weights-L (reshaped)`, `_softmax-L`, `_sum-L`,
/// `_sum_clamped-L`, `_norm-L`, `_norm-L (reshaped)`, `_scaled-L`, and a softmax it leaves
/// unnamed. The first node after them (the FFN input's reshape, before any expert matmul) is
/// the stop.
const WEIGHTS_RUN: &str = "ffn_moe_weights";
/// No layer's router is being passed.
const NO_LAYER: usize = usize::MAX;
/// The expert matmuls that read a pooled layer's ids; the last of them ends its layer.
const EXPERT_MATMULS: [&str; 3] = ["ffn_moe_gate-", "ffn_moe_up-", "ffn_moe_gate_up-"];
const LAST_EXPERT_MATMUL: &str = "ffn_moe_down-";
/// The router's matmul (`gate_inp × hidden`); its input 1 is the hidden state.
const ROUTER_LOGITS_NODE: &str = "ffn_moe_logits-";

/// The plan chooses the policy; the cache below carries it out.
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
        let mut evicted = Vec::new();
        while self.resident_count >= self.capacity {
            // The least recent unpinned unit: probationary first (for LRU, the only segment).
            let oldest = |segment: &BTreeSet<(u64, usize)>| {
                segment.iter().map(|&(_, candidate)| candidate).find(|candidate| !pinned.contains(candidate))
            };
            let Some(victim) = oldest(&self.probation).or_else(|| oldest(&self.protected)) else { break };
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
    pub fn try_admit(&mut self, unit: usize, protected: &[usize]) -> Option<Vec<usize>> {
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
        Some(self.admit(unit, protected))
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
    /// Units read ahead on a stale-gate prediction, how many the router then picked, and how
    /// many mispredicted reads were cancelled before they started.
    pub prefetch_issued: u64,
    pub prefetch_used: u64,
    pub prefetch_cancelled: u64,
    /// Units read into the host cache's free room while the disk was idle (with a device pool:
    /// `ExpertStream::warm_step`).
    pub warm_reads: u64,
    /// Their bytes: read from disk, though no token asked for them (a decode's limit leaves
    /// them out).
    pub warm_bytes: u64,
    /// The device's expert pool: picks served from its slots, uploads, staged prompt layers
    /// (all zero without a pool). `hits` and `misses` above count the host cache's share.
    pub device: PoolSnapshot,
    /// Each decode pick's LRU stack distance: the (layer, expert) units picked since its unit's
    /// last pick (the next plan's expected hit rate at any cache size follows from it).
    #[serde(skip)]
    pub reuse: ReuseDepths,
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
            misses_by_layer: self
                .misses_by_layer
                .iter()
                .zip(&earlier.misses_by_layer)
                .map(|(now, then)| now - then)
                .collect(),
            prefetch_issued: self.prefetch_issued - earlier.prefetch_issued,
            prefetch_used: self.prefetch_used - earlier.prefetch_used,
            prefetch_cancelled: self.prefetch_cancelled - earlier.prefetch_cancelled,
            warm_reads: self.warm_reads - earlier.warm_reads,
            warm_bytes: self.warm_bytes - earlier.warm_bytes,
            device: self.device - earlier.device,
            reuse: self.reuse.since(&earlier.reuse),
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
    /// Units prefetched for each layer and not yet routed: the accuracy count, and what to
    /// cancel when the router picks otherwise.
    prefetched: Vec<Vec<usize>>,
    /// The stack distances of decode picks.
    reuse: ReuseTracker,
}

/// The host cache's warm fill: beside a device pool, the disk is idle most of a decode (the
/// slots serve most picks), while each pick the slots miss and the host cache does not hold is
/// read at a queue depth of one. So the cache's free room is filled in the background, expert
/// `e` of every streamed layer before expert `e + 1`, at most `WARM_IN_FLIGHT` reads at once
/// (the reader threads stay free for the misses), each unit once, never evicting anything: a
/// cold start's misses become host hits, uploaded over the bus instead of read from disk.
#[derive(Default)]
struct WarmFill {
    /// Units to fill first, the recorded routing's most picked first (`with_warm_order`).
    order: Vec<usize>,
    /// The next candidate: `order`'s, then every unit in fill order (`position / n_layer` is the
    /// expert, `% n_layer` the layer); the fill is done when it reaches the end of both.
    next: usize,
    in_flight: Vec<usize>,
    issued: u64,
    /// The bytes of the units issued.
    bytes: u64,
}

/// Warm-fill reads in flight at once.
const WARM_IN_FLIGHT: usize = 2;

/// Every MoE layer's router weights (F32, `[n_expert][n_embd]` row-major), for the stale gate.
#[derive(Clone, Debug, Default)]
pub struct RouterWeights {
    pub n_embd: usize,
    /// None for a layer without a router (or one not stored as F32).
    pub layers: Vec<Option<Vec<f32>>>,
}

impl RouterWeights {
    /// The `k` experts layer `layer`'s router scores highest for `hidden`.
    pub fn top_k(&self, layer: usize, hidden: &[f32], k: usize) -> Option<Vec<usize>> {
        let weights = self.layers.get(layer)?.as_ref()?;
        if hidden.len() != self.n_embd || self.n_embd == 0 {
            return None;
        }
        let scores: Vec<f32> = weights.chunks_exact(self.n_embd).map(|row| dot(row, hidden)).collect();
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        order.truncate(k);
        Some(order)
    }
}

/// A dot product the compiler turns into vector instructions: sixteen partial sums (a plain
/// sum of f32 products must add in order, one at a time). The prediction runs on the compute
/// thread at every streamed layer, so its speed is decode time: on moe-30b (128 experts of
/// 2048 inputs, 47 predicted layers) the ordered sum took about a tenth of a token's compute.
fn dot(row: &[f32], hidden: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut sums = [0f32; LANES];
    let (row_body, row_rest) = row.split_at(row.len() / LANES * LANES);
    let (hidden_body, hidden_rest) = hidden.split_at(row_body.len().min(hidden.len()));
    for (weights, values) in row_body.chunks_exact(LANES).zip(hidden_body.chunks_exact(LANES)) {
        for lane in 0..LANES {
            sums[lane] += weights[lane] * values[lane];
        }
    }
    let rest: f32 = row_rest.iter().zip(hidden_rest).map(|(weight, value)| weight * value).sum();
    sums.iter().sum::<f32>() + rest
}

/// Predict only for batches this small (decode); a prefill batch loads the union anyway.
const PREDICT_MAX_TOKENS: usize = 4;

/// Within the graph being computed: when the hook asked for its stop, and how long the eval
/// callback's questions took since the stop before ended (ggml asks about each node of the
/// next segment before launching it, the device idle meanwhile), and when that stop ended.
#[derive(Debug, Default)]
struct StopClock {
    asked: Option<Instant>,
    /// The questions' time and how many nodes they were about.
    asks: Option<(Duration, u64)>,
    ended: Option<(Instant, u64)>,
}

/// A split pool's CPU side (`store::split`).
struct SplitSide {
    worker: SplitWorker,
    layers: Arc<Vec<Option<SplitLayer>>>,
    plain: PlainCheck,
}

/// Drives expert residency from the router's choices.
pub struct ExpertStream {
    residency: Arc<Residency>,
    numbering: ExpertUnits,
    /// Prefetch likely next-layer experts into idle I/O (stale-gate prediction).
    routers: Option<RouterWeights>,
    /// Layers whose experts stream (the others are in device memory).
    streamed_layers: Vec<bool>,
    prefetch_issued: AtomicU64,
    prefetch_used: AtomicU64,
    prefetch_cancelled: AtomicU64,
    state: Mutex<State>,
    counters: ExpertCounters,
    trace: Option<Mutex<Vec<RouteRecord>>>,
    /// The device's expert pool above the cache, and per layer whether it serves the layer.
    pool: Option<Mutex<ExpertPool>>,
    pooled_layers: Vec<bool>,
    /// Per pooled layer, whether its ids were rewritten in this graph (its matmuls may run).
    served: Vec<AtomicBool>,
    /// The layer whose router's weights the graph is computing (its `ffn_moe_weights-L` kept),
    /// and the layer the hook stopped for; NO_LAYER where none. Compute thread only.
    in_router: AtomicUsize,
    stopped_for: AtomicUsize,
    /// When the hook asked for its stop and finished the one before (`StopClock`), and the
    /// nodes `wants` was asked about.
    clock: Mutex<StopClock>,
    nodes_asked: AtomicU64,
    /// With a device pool: the host cache's free room filled from disk while it is idle.
    warm: Option<Mutex<WarmFill>>,
    /// A split pool's CPU side (`store::split`): the worker, which layers' graphs compute plain
    /// SwiGLU experts, the layer whose CPU share is computing, and the layer the hook stopped
    /// at the sum of (NO_LAYER where none).
    split: Option<SplitSide>,
    split_pending: AtomicUsize,
    stopped_at_sum: AtomicUsize,
    /// The first read error and the abort flag it raises.
    pub failure: FailureLatch,
}

impl std::fmt::Debug for ExpertStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStream").field("numbering", &self.numbering).finish_non_exhaustive()
    }
}

impl ExpertStream {
    /// Units are numbered as `numbering` says; `capacity` is how many the cache holds (at least
    /// what one graph's batch picks in a layer, which the plan sees to).
    pub fn new(
        residency: Arc<Residency>,
        numbering: ExpertUnits,
        capacity: usize,
        policy: CachePolicy,
        trace: bool,
    ) -> ExpertStream {
        let ExpertUnits { n_layer, .. } = numbering;
        let units = numbering.count();
        ExpertStream {
            residency,
            numbering,
            routers: None,
            streamed_layers: vec![true; n_layer],
            prefetch_issued: AtomicU64::new(0),
            prefetch_used: AtomicU64::new(0),
            prefetch_cancelled: AtomicU64::new(0),
            state: Mutex::new(State {
                cache: CacheModel::new(policy, units, capacity),
                pinned: Vec::new(),
                prefetched: vec![Vec::new(); n_layer],
                reuse: ReuseTracker::new(n_layer, numbering.n_expert),
            }),
            counters: ExpertCounters {
                misses_by_layer: (0..n_layer).map(|_| AtomicU64::new(0)).collect(),
                ..ExpertCounters::default()
            },
            trace: trace.then(|| Mutex::new(Vec::new())),
            pool: None,
            pooled_layers: vec![false; n_layer],
            served: (0..n_layer).map(|_| AtomicBool::new(false)).collect(),
            in_router: AtomicUsize::new(NO_LAYER),
            stopped_for: AtomicUsize::new(NO_LAYER),
            clock: Mutex::new(StopClock::default()),
            nodes_asked: AtomicU64::new(0),
            warm: None,
            split: None,
            split_pending: AtomicUsize::new(NO_LAYER),
            stopped_at_sum: AtomicUsize::new(NO_LAYER),
            failure: FailureLatch::default(),
        }
    }

    /// Serve the pool's layers from device slots above the cache (decision 29).
    pub fn with_pool(mut self, pool: ExpertPool) -> ExpertStream {
        let mut pooled = pool.pooled_layers();
        pooled.resize(self.numbering.n_layer, false);
        self.pooled_layers = pooled;
        self.pool = Some(Mutex::new(pool));
        self.warm = Some(Mutex::new(WarmFill::default()));
        self
    }

    /// Compute a split pool's misses on the CPU with `threads` threads, for the layers that
    /// `layers` describes (after `with_pool`).
    pub fn with_split(
        mut self,
        layers: Vec<Option<SplitLayer>>,
        threads: usize,
    ) -> Result<ExpertStream, ResidencyError> {
        let layers = Arc::new(layers);
        let worker = SplitWorker::start(self.residency.clone(), layers.clone(), threads)?;
        self.split = Some(SplitSide { worker, layers, plain: PlainCheck::new(self.numbering.n_layer) });
        Ok(self)
    }

    /// Fill the host cache's free room beside the pool with these units first (the recorded
    /// routing's most picked, after those the slots took), then in the usual order.
    pub fn with_warm_order(self, order: Vec<usize>) -> ExpertStream {
        if let Some(warm) = &self.warm {
            warm.locked().order = order;
        }
        self
    }

    /// Whether the device's pool holds expert `expert` of `layer` in a slot now.
    pub fn slot_holds(&self, layer: usize, expert: usize) -> bool {
        self.pool.as_ref().is_some_and(|pool| pool.locked().holds(layer, expert))
    }

    pub fn residency(&self) -> &Arc<Residency> {
        &self.residency
    }

    /// Stream only the layers marked true (the others' experts are in device memory): the
    /// graph runs through the rest without stopping.
    pub fn with_streamed_layers(mut self, streamed: Vec<bool>) -> ExpertStream {
        assert_eq!(streamed.len(), self.numbering.n_layer, "one flag per layer");
        self.streamed_layers = streamed;
        self
    }

    /// Turn stale-gate prefetch on with these router weights (before use).
    pub fn with_prefetch(mut self, routers: RouterWeights) -> ExpertStream {
        self.routers = Some(routers);
        self
    }

    pub fn snapshot(&self) -> ExpertSnapshot {
        let (warm_reads, warm_bytes) = self.warm.as_ref().map_or((0, 0), |warm| {
            let warm = warm.locked();
            (warm.issued, warm.bytes)
        });
        ExpertSnapshot {
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            layer_visits: self.counters.layer_visits.load(Ordering::Relaxed),
            misses_by_layer: self
                .counters
                .misses_by_layer
                .iter()
                .map(|misses| misses.load(Ordering::Relaxed))
                .collect(),
            prefetch_issued: self.prefetch_issued.load(Ordering::Relaxed),
            prefetch_used: self.prefetch_used.load(Ordering::Relaxed),
            prefetch_cancelled: self.prefetch_cancelled.load(Ordering::Relaxed),
            warm_reads,
            warm_bytes,
            device: self.pool.as_ref().map(|pool| pool.locked().snapshot()).unwrap_or_default(),
            reuse: self.state.locked().reuse.counts().clone(),
        }
    }

    /// Count a decode batch's picks in `layer` (token by token) for the stack distances; a
    /// prompt batch's picks are made recent without a count (decode is what is predicted, but
    /// the cache holds what the prompt read).
    fn record_reuse(&self, layer: usize, rows: &[Vec<i32>], picks: &[usize]) {
        let mut state = self.state.locked();
        if rows.len() > PREDICT_MAX_TOKENS {
            state.reuse.touch(layer, picks);
            return;
        }
        for row in rows {
            let experts: Vec<usize> = row.iter().filter_map(|&expert| usize::try_from(expert).ok()).collect();
            state.reuse.record(layer, &experts);
        }
    }

    /// The recorded routing so far (with `--trace`), taken.
    pub fn take_trace(&self) -> Vec<RouteRecord> {
        self.trace.as_ref().map(|trace| std::mem::take(&mut *trace.locked())).unwrap_or_default()
    }

    fn streams(&self, layer: usize) -> bool {
        self.streamed_layers.get(layer).copied().unwrap_or(false)
    }

    fn pooled(&self, layer: usize) -> bool {
        self.pooled_layers.get(layer).copied().unwrap_or(false)
    }

    fn layer_of(name: &str, node: &str) -> Option<usize> {
        name.strip_prefix(node)?.parse().ok()
    }

    /// The distinct experts of `rows` (the router's ids per token), in order of first pick.
    fn picks(&self, rows: &[Vec<i32>]) -> Result<Vec<usize>, ResidencyError> {
        let mut picks: Vec<usize> = Vec::new();
        for &expert in rows.iter().flatten() {
            // An id outside the expert count would make ggml read outside the tensor.
            let expert = usize::try_from(expert)
                .ok()
                .filter(|&expert| expert < self.numbering.n_expert)
                .ok_or(ResidencyError::NoSuchUnit { unit: expert.max(0) as usize, count: self.numbering.n_expert })?;
            if !picks.contains(&expert) {
                picks.push(expert);
            }
        }
        Ok(picks)
    }

    /// Serve a pooled layer from its kept `ffn_moe_weights-L`: its picks' experts that no slot
    /// holds are made ready in the host cache, then uploaded; the ids are rewritten to slots (or
    /// the layer staged whole, for a prompt batch of more picks than slots).
    /// `times` brings the stop's asks and segment (`StopClock`).
    fn serve_pooled(
        &self,
        layer: usize,
        stop: &ObservedNode<'_>,
        weights: &ObservedNode<'_>,
        mut times: StopTimes,
    ) -> Result<(), ResidencyError> {
        let pool = self.pool.as_ref().ok_or_else(|| ResidencyError::Pool(format!("layer {layer} has no pool")))?;
        let (started, stalled) = (Instant::now(), self.residency.stats().stall_nanos());
        let rows = self.routed_ids(layer, weights)?;
        times.ids = started.elapsed();
        let picks = self.picks(&rows)?;
        self.record_reuse(layer, &rows, &picks);
        let mut pool = pool.locked();
        let serving = pool.serve(layer, &picks, self.splits(layer));
        let units: Vec<usize> =
            serving.from_host().into_iter().map(|expert| self.numbering.unit(layer, expert)).collect();
        let hidden = self.predicting(&rows, layer).then(|| Self::router_input(layer, weights)).flatten();
        let next_pooled = |unit: usize| pool.holds(layer + 1, unit % self.numbering.n_expert);
        self.route_units(layer, units, &rows, hidden.as_deref(), &next_pooled)?;
        let mut tiers = HostTier { stream: self, layer };
        let moving = Instant::now();
        let remapped = pool.load(layer, &picks, &serving, self.residency.region(), &rows, &mut tiers)?;
        times.transfer = moving.elapsed();
        if let Some(remapped) = remapped {
            let writing = Instant::now();
            weights.write_input_i32_rows(1, &remapped).map_err(|error| ResidencyError::Pool(error.to_string()))?;
            times.ids += writing.elapsed();
        }
        if let Serving::Split { cpu, .. } = &serving {
            if !cpu.is_empty() {
                let bytes = self.submit_cpu_share(layer, stop, weights, &rows, cpu)?;
                pool.add_cpu_bytes(bytes);
            }
        }
        let waited = Duration::from_nanos(self.residency.stats().stall_nanos() - stalled);
        times.host = started.elapsed().saturating_sub(waited);
        pool.add_times(&times);
        self.served[layer].store(true, Ordering::Release);
        Ok(())
    }

    /// Whether `layer`'s misses may be computed by the CPU: a split pool, and a graph of the
    /// layer seen computing plain SwiGLU experts.
    fn splits(&self, layer: usize) -> bool {
        self.split
            .as_ref()
            .is_some_and(|split| split.layers.get(layer).is_some_and(Option::is_some) && split.plain.plain(layer))
    }

    /// Hand the CPU `layer`'s picks of `cpu` (their ids now at the zero slot): the FFN's input
    /// rows (the router's), and each pick's token and final weight (the weights' run's last
    /// node, kept up to `stop`). The sum is added at the layer's `ffn_moe_out` stop. The bytes
    /// of the picks computed.
    fn submit_cpu_share(
        &self,
        layer: usize,
        stop: &ObservedNode<'_>,
        weights: &ObservedNode<'_>,
        rows: &[Vec<i32>],
        cpu: &[usize],
    ) -> Result<u64, ResidencyError> {
        let split = self.split.as_ref().ok_or_else(|| ResidencyError::Pool(format!("layer {layer} does not split")))?;
        let unreadable = |what: &str| ResidencyError::Pool(format!("layer {layer}'s split: {what} could not be read"));
        let x = Self::router_input(layer, weights).ok_or_else(|| unreadable("the FFN's input"))?;
        let final_weights =
            stop.last_kept().and_then(|node| node.f32_values()).ok_or_else(|| unreadable("the router's weights"))?;
        let width = rows.first().map_or(0, Vec::len);
        if x.len() != rows.len() || final_weights.len() != width * rows.len() {
            return Err(unreadable("the router's weights in the ids' shape"));
        }
        let mut picks = Vec::new();
        for (token, row) in rows.iter().enumerate() {
            for (k, &expert) in row.iter().enumerate() {
                let expert = expert as usize;
                if cpu.contains(&expert) {
                    picks.push((token, expert, final_weights[token * width + k]));
                }
            }
        }
        let bytes = split.layers[layer].map_or(0, |shape| shape.expert_bytes()) * picks.len() as u64;
        split.worker.submit(CpuJob { layer, x, picks })?;
        self.split_pending.store(layer, Ordering::Release);
        Ok(bytes)
    }

    /// At `layer`'s `ffn_moe_out` (`node`): wait for the CPU's share and add it.
    fn add_cpu_share(&self, layer: usize, node: &ObservedNode<'_>) -> Result<(), ResidencyError> {
        let split = self.split.as_ref().ok_or_else(|| ResidencyError::Pool(format!("layer {layer} does not split")))?;
        let waiting = Instant::now();
        let done = split.worker.take()?;
        let waited = waiting.elapsed();
        let mut rows = node.f32_rows().ok_or_else(|| {
            ResidencyError::Pool(format!("layer {layer}'s split: {} is not an F32 matrix", node.name()))
        })?;
        if rows.len() != done.sums.len() {
            return Err(ResidencyError::Pool(format!(
                "layer {layer}'s split: the CPU's sums are not the layer's tokens"
            )));
        }
        for (row, sum) in rows.iter_mut().zip(&done.sums) {
            for (value, add) in row.iter_mut().zip(sum) {
                *value += add;
            }
        }
        node.write_f32_rows(&rows).map_err(|error| ResidencyError::Pool(error.to_string()))?;
        if let Some(pool) = &self.pool {
            pool.locked().add_cpu_times(done.seconds, waited.as_secs_f64());
        }
        Ok(())
    }

    /// Take a CPU share that no stop will add (a decode aborted before the layer's sum), so that
    /// the worker is idle and its experts free to evict.
    fn drain_cpu_share(&self) {
        if self.split_pending.swap(NO_LAYER, Ordering::AcqRel) != NO_LAYER {
            if let Some(split) = &self.split {
                let _ = split.worker.take();
            }
        }
    }

    /// Top up the warm fill (`WarmFill`): forget the reads that finished, then issue the next
    /// candidates that no slot holds and the cache does not, while there is free room.
    fn warm_step(&self) -> Result<(), ResidencyError> {
        let Some(warm) = &self.warm else { return Ok(()) };
        let mut warm = warm.locked();
        warm.in_flight.retain(|&unit| matches!(self.residency.state(unit), Some((UnitState::Loading, _))));
        let ExpertUnits { n_layer, n_expert } = self.numbering;
        while warm.in_flight.len() < WARM_IN_FLIGHT && warm.next < warm.order.len() + n_layer * n_expert {
            let (expert, layer) = match warm.order.get(warm.next) {
                Some(&unit) => (unit % n_expert, unit / n_expert),
                None => {
                    let position = warm.next - warm.order.len();
                    (position / n_layer, position % n_layer)
                }
            };
            if !self.streams(layer) {
                warm.next += 1;
                continue;
            }
            if self.pool.as_ref().is_some_and(|pool| pool.locked().holds(layer, expert)) {
                warm.next += 1;
                continue;
            }
            let unit = self.numbering.unit(layer, expert);
            let mut state = self.state.locked();
            if state.cache.is_resident(unit) {
                warm.next += 1;
                continue;
            }
            if state.cache.is_full() {
                break;
            }
            let evicted = state.cache.admit(unit, &[]);
            debug_assert!(evicted.is_empty());
            drop(state);
            warm.next += 1;
            warm.issued += 1;
            warm.bytes += self.residency.units()[unit].bytes();
            self.residency.request(unit)?;
            warm.in_flight.push(unit);
        }
        Ok(())
    }

    /// Serve a streamed layer from the host cache: `weights` is its kept `ffn_moe_weights-L`,
    /// whose input 1 holds the router's ids.
    fn serve_streamed(&self, layer: usize, weights: &ObservedNode<'_>) -> Result<(), ResidencyError> {
        let rows = self.routed_ids(layer, weights)?;
        // The hidden state is read (from the device, on a GPU) only when a prediction will use
        // it: prefetch on, a decode-sized batch, and a next layer that streams.
        let hidden = self.predicting(&rows, layer).then(|| Self::router_input(layer, weights)).flatten();
        self.route(layer, &rows, hidden.as_deref())
    }

    /// The router's ids per token: input 1 of the layer's kept `ffn_moe_weights-L`.
    fn routed_ids(&self, layer: usize, weights: &ObservedNode<'_>) -> Result<Vec<Vec<i32>>, ResidencyError> {
        let rows = weights.input_i32_rows(1).ok_or_else(|| ResidencyError::Read {
            unit: layer,
            reason: format!("{}'s ids are not a readable I32 tensor", weights.name()),
        })?;
        if let Some(trace) = &self.trace {
            trace.locked().push(RouteRecord { layer: layer as u32, experts: rows.clone() });
        }
        Ok(rows)
    }

    /// Whether the next layer's experts are predicted from this batch.
    fn predicting(&self, rows: &[Vec<i32>], layer: usize) -> bool {
        self.routers.is_some() && rows.len() <= PREDICT_MAX_TOKENS && self.streams(layer + 1)
    }

    /// The hidden state the layer's router saw: input 1 of `ffn_moe_logits-L`, an ancestor of
    /// the weights.
    fn router_input(layer: usize, weights: &ObservedNode<'_>) -> Option<Vec<Vec<f32>>> {
        weights.ancestor_input_f32_rows(&format!("{ROUTER_LOGITS_NODE}{layer}"), 1, 8)
    }

    /// Whether `name` is one of the router's weights' nodes of `layer` (`WEIGHTS_RUN`).
    fn in_weights_run(name: &str, layer: usize) -> bool {
        // ggml names a node llama.cpp left unnamed `node_<index>` (gpt-oss's softmax of the
        // weights).
        if name.strip_prefix("node_").is_some_and(|index| index.bytes().all(|byte| byte.is_ascii_digit())) {
            return true;
        }
        let Some(rest) = name.strip_prefix(WEIGHTS_RUN) else { return false };
        let rest = rest.strip_suffix(" (reshaped)").unwrap_or(rest);
        rest.rsplit_once('-').and_then(|(_, number)| number.parse().ok()) == Some(layer)
    }

    /// The layer of an expert matmul node, else None.
    fn expert_matmul_layer(name: &str) -> Option<usize> {
        EXPERT_MATMULS.iter().chain([&LAST_EXPERT_MATMUL]).find_map(|node| Self::layer_of(name, node))
    }

    /// Make the chosen experts of `layer` ready. `hidden` is the state the router saw (per
    /// token), given when the next layer's experts should be predicted.
    fn route(&self, layer: usize, rows: &[Vec<i32>], hidden: Option<&[Vec<f32>]>) -> Result<(), ResidencyError> {
        let picks = self.picks(rows)?;
        self.record_reuse(layer, rows, &picks);
        let chosen = picks.into_iter().map(|expert| self.numbering.unit(layer, expert)).collect();
        self.route_units(layer, chosen, rows, hidden, &|_| false)
    }

    /// Make `chosen` (units of `layer`) ready in the cache, and prefetch the next layer's
    /// predicted units that `skip` (the device's slots) does not hold.
    fn route_units(
        &self,
        layer: usize,
        chosen: Vec<usize>,
        rows: &[Vec<i32>],
        hidden: Option<&[Vec<f32>]>,
        skip: &dyn Fn(usize) -> bool,
    ) -> Result<(), ResidencyError> {
        self.counters.layer_visits.fetch_add(1, Ordering::Relaxed);
        let mut to_load = Vec::new();
        {
            let mut state = self.state.locked();
            // Every pick must be resident at once; the plan sizes prompt batches so they fit.
            if chosen.len() > state.cache.capacity() {
                return Err(ResidencyError::CacheTooSmall {
                    layer,
                    picked: chosen.len(),
                    capacity: state.cache.capacity(),
                });
            }
            state.pinned.clone_from(&chosen);
            // Score the prediction for this layer; cancel the reads it got wrong that have not
            // started, so they neither take I/O from real misses nor hold cache room.
            for unit in std::mem::take(&mut state.prefetched[layer]) {
                if chosen.contains(&unit) {
                    self.prefetch_used.fetch_add(1, Ordering::Relaxed);
                } else if self.residency.cancel(unit)? {
                    state.cache.forget(unit);
                    self.prefetch_cancelled.fetch_add(1, Ordering::Relaxed);
                }
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
        }
        for &unit in &to_load {
            self.residency.request(unit)?;
        }
        let predicted: Vec<usize> = match (hidden, &self.routers) {
            (Some(hidden), Some(routers)) => {
                self.predict(routers, layer + 1, rows, hidden).into_iter().filter(|&unit| !skip(unit)).collect()
            }
            // A prompt batch picks nearly every expert of a pooled layer: the next layer's that
            // the device's slots do not hold are read while this one computes.
            _ if rows.len() > PREDICT_MAX_TOKENS && self.pooled(layer + 1) => {
                self.numbering.layer(layer + 1).filter(|&unit| !skip(unit)).collect()
            }
            _ => Vec::new(),
        };
        // Prefetch behind this layer's misses (the queue is first in, first out, so they are
        // never delayed), only into cache room that costs no unit of this layer or another
        // predicted one. Mispredictions still queued when the next layer routes are cancelled
        // there, so they never hold up its real misses.
        if !predicted.is_empty() {
            let mut state = self.state.locked();
            let mut protect = state.pinned.clone();
            protect.extend_from_slice(&predicted);
            for unit in predicted {
                if state.cache.is_resident(unit) {
                    // Predicted to be used next: keep it from being the next victim.
                    state.cache.refresh(unit);
                    continue;
                }
                let Some(victims) = state.cache.try_admit(unit, &protect) else { break };
                for victim in victims {
                    self.residency.release(victim)?;
                }
                state.prefetched[layer + 1].push(unit);
                self.prefetch_issued.fetch_add(1, Ordering::Relaxed);
                self.residency.request(unit)?;
            }
        }
        for &unit in &chosen {
            // A hit on a unit a failed read left empty reloads it here.
            if self.residency.state(unit).map(|(state, _)| state) != Some(UnitState::Ready) {
                self.residency.wait_ready(unit)?;
            }
        }
        Ok(())
    }

    /// The next layer's likely units: per token, the experts layer `next`'s router scores
    /// highest for this layer's hidden state, as many as the router picks.
    fn predict(&self, routers: &RouterWeights, next: usize, rows: &[Vec<i32>], hidden: &[Vec<f32>]) -> Vec<usize> {
        let mut predicted = Vec::new();
        for (token, state) in rows.iter().zip(hidden) {
            for expert in routers.top_k(next, state, token.len()).unwrap_or_default() {
                let unit = self.numbering.unit(next, expert);
                if expert < self.numbering.n_expert && !predicted.contains(&unit) {
                    predicted.push(unit);
                }
            }
        }
        predicted
    }
}

impl EvalHook for ExpertStream {
    fn wants(&self, name: &str) -> bool {
        let asked = self.nodes_asked.fetch_add(1, Ordering::Relaxed) + 1;
        let layer = self.in_router.load(Ordering::Relaxed);
        if layer != NO_LAYER {
            if Self::in_weights_run(name, layer) {
                return false;
            }
            self.in_router.store(NO_LAYER, Ordering::Relaxed);
            if Self::expert_matmul_layer(name) == Some(layer) {
                // Stopping here would compute the matmul before its experts are ready.
                self.failure.fail(ResidencyError::Unserved { layer, node: name.to_string() });
                return false;
            }
            self.stopped_for.store(layer, Ordering::Relaxed);
            let mut clock = self.clock.locked();
            let now = Instant::now();
            clock.asks = clock.ended.map(|(ended, nodes)| (now - ended, asked - nodes));
            clock.asked = Some(now);
            return true;
        }
        if self.pool.is_some() && name.starts_with("ffn_moe_") {
            self.check_served(name);
            if let Some(split) = &self.split {
                split.plain.watch(name);
                let pending = self.split_pending.load(Ordering::Acquire);
                if pending != NO_LAYER && Self::layer_of(name, MOE_OUT_NODE) == Some(pending) {
                    self.stopped_at_sum.store(pending, Ordering::Relaxed);
                    return true;
                }
            }
        }
        false
    }

    fn begin_decode(&self) {
        self.in_router.store(NO_LAYER, Ordering::Relaxed);
        self.stopped_for.store(NO_LAYER, Ordering::Relaxed);
        self.stopped_at_sum.store(NO_LAYER, Ordering::Relaxed);
        self.drain_cpu_share();
        *self.clock.locked() = StopClock::default();
    }

    fn keeps(&self, name: &str) -> bool {
        match Self::layer_of(name, WEIGHTS_NODE) {
            Some(layer) if self.streams(layer) || self.pooled(layer) => {
                self.in_router.store(layer, Ordering::Relaxed);
                true
            }
            // A split keeps the weights' run too: its last node is the weights the experts'
            // outputs are scaled by (`submit_cpu_share`).
            _ => {
                let layer = self.in_router.load(Ordering::Relaxed);
                layer != NO_LAYER && self.split.is_some() && Self::in_weights_run(name, layer)
            }
        }
    }

    fn observe(&self, node: &ObservedNode<'_>) {
        let summed = self.stopped_at_sum.swap(NO_LAYER, Ordering::Relaxed);
        if summed != NO_LAYER {
            self.residency.stats().record_observation();
            self.split_pending.store(NO_LAYER, Ordering::Release);
            if let Err(error) = self.add_cpu_share(summed, node) {
                tracing::error!("the split at layer {summed}: {error}");
                self.failure.fail(error);
            }
            return;
        }
        let layer = self.stopped_for.swap(NO_LAYER, Ordering::Relaxed);
        if layer == NO_LAYER {
            return;
        }
        self.residency.stats().record_observation();
        let (asks, segment) = {
            let clock = self.clock.locked();
            (clock.asks, clock.asked.map_or(Duration::ZERO, |asked| asked.elapsed()))
        };
        let times = StopTimes { asks, segment, ..StopTimes::default() };
        let weights_name = format!("{WEIGHTS_NODE}{layer}");
        let result = match node.kept(&weights_name) {
            Some(weights) if self.pooled(layer) => self.serve_pooled(layer, node, &weights, times),
            Some(weights) => self.serve_streamed(layer, &weights),
            None => Err(ResidencyError::Read { unit: layer, reason: format!("{weights_name} was not kept") }),
        }
        .and_then(|()| self.warm_step());
        if let Err(error) = result {
            tracing::error!("expert streaming at layer {layer}: {error}");
            self.failure.fail(error);
            if let Some(weights) = node.kept(&weights_name).filter(|_| self.pooled(layer)) {
                // The decode is aborted, but a device runs the rest of its graph: point every
                // id at slot 0, which lies inside the tensors wherever they point now.
                if let Some(rows) = weights.input_i32_rows(1) {
                    let zeros: Vec<Vec<i32>> = rows.iter().map(|row| vec![0; row.len()]).collect();
                    let _ = weights.write_input_i32_rows(1, &zeros);
                }
            }
        }
        let mut clock = self.clock.locked();
        *clock = StopClock {
            ended: Some((Instant::now(), self.nodes_asked.load(Ordering::Relaxed))),
            ..StopClock::default()
        };
    }
}

/// The host cache as the tier below a layer's device slots: an expert a slot gives up moves
/// into it (copied back from the device, so it is not read from disk again), and an expert
/// uploaded into a slot leaves it. The two tiers hold different experts, so together they hold
/// as many as their sizes add up to.
struct HostTier<'a> {
    stream: &'a ExpertStream,
    layer: usize,
}

impl Tiers for HostTier<'_> {
    fn evicted(
        &mut self,
        expert: usize,
        copy: &dyn Fn(&crate::io::Region) -> Result<(), String>,
    ) -> Result<(), ResidencyError> {
        let unit = self.stream.numbering.unit(self.layer, expert);
        let mut state = self.stream.state.locked();
        if state.cache.is_resident(unit) {
            return Ok(());
        }
        let pinned = state.pinned.clone();
        for victim in state.cache.admit(unit, &pinned) {
            self.stream.residency.release(victim)?;
        }
        drop(state);
        self.stream.residency.fill(unit, copy)?;
        Ok(())
    }

    fn uploaded(&mut self, expert: usize) -> Result<(), ResidencyError> {
        let unit = self.stream.numbering.unit(self.layer, expert);
        let mut state = self.stream.state.locked();
        if state.cache.is_resident(unit) {
            state.cache.forget(unit);
            self.stream.residency.release(unit)?;
        }
        Ok(())
    }
}

impl ExpertStream {
    /// A pooled layer's expert matmul is about to be scheduled: its ids must have been
    /// rewritten to slots in this graph, or the kernels would read past the slots. Fails the
    /// decode where they were not; the layer's last matmul ends its turn.
    fn check_served(&self, name: &str) {
        let (layer, last) = match Self::layer_of(name, LAST_EXPERT_MATMUL) {
            Some(layer) => (layer, true),
            None => match EXPERT_MATMULS.iter().find_map(|node| Self::layer_of(name, node)) {
                Some(layer) => (layer, false),
                None => return,
            },
        };
        if !self.pooled(layer) {
            return;
        }
        let served = if last {
            self.served[layer].swap(false, Ordering::AcqRel)
        } else {
            self.served[layer].load(Ordering::Acquire)
        };
        if !served {
            self.failure.fail(ResidencyError::PoolUnserved { layer });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that writes nothing (the hook's tests read no bytes).
    struct NoBytes;

    impl super::super::residency::UnitReader for NoBytes {
        fn read(
            &self,
            _region: &crate::io::Region,
            range: std::ops::Range<u64>,
            _shift: u64,
        ) -> Result<u64, crate::io::IoError> {
            Ok(range.end - range.start)
        }
    }

    /// An expert stream over `n_layer` × 4 units of a page each, every layer streamed.
    fn stream(n_layer: usize) -> ExpertStream {
        let numbering = ExpertUnits { n_layer, n_expert: 4 };
        let units: Vec<super::super::residency::StreamUnit> = (0..numbering.count() as u64)
            .map(|unit| {
                super::super::residency::StreamUnit::mirrored(std::iter::once(unit * 4096..(unit + 1) * 4096).collect())
            })
            .collect();
        let region = Arc::new(crate::io::Region::reserve(numbering.count() as u64 * 4096, false).unwrap());
        let stats = Arc::new(super::super::stats::IoStats::default());
        let residency = Arc::new(Residency::new(region, Arc::new(NoBytes), units, 1, stats));
        ExpertStream::new(residency, numbering, 8, CachePolicy::Lru, false)
    }

    /// The hook's walk through a graph: it keeps a streamed layer's `ffn_moe_weights-L`, passes
    /// the weights' own nodes, stops at the next; a decode that begins forgets a kept layer whose
    /// stop never came (an aborted decode); an expert matmul right after the weights fails the
    /// decode instead of being computed on experts not made ready.
    #[test]
    fn the_hook_stops_once_after_the_weights_and_a_new_decode_forgets_a_pending_stop() {
        let stream = stream(4);
        assert!(!stream.wants("ffn_moe_weights-1") && stream.keeps("ffn_moe_weights-1"));
        assert!(!stream.wants("ffn_moe_weights_norm-1"));
        assert!(stream.wants("ffn_norm-1 (reshaped)"));
        assert!(!stream.wants("ffn_moe_gate-1"), "one stop per layer");
        assert!(stream.failure.take().is_none());

        assert!(stream.keeps("ffn_moe_weights-2"));
        stream.begin_decode();
        assert!(!stream.wants("attn_norm-0"), "the aborted decode's pending stop is void");

        assert!(stream.keeps("ffn_moe_weights-3"));
        assert!(!stream.wants("ffn_moe_gate_up-3"));
        assert!(matches!(stream.failure.take(), Some(ResidencyError::Unserved { layer: 3, .. })));
    }

    /// The stop after a router's weights, on the node orders llama.cpp gives layer 1 of these
    /// architectures: the first node past the weights' own (so a fused top-k kernel stays
    /// whole), never an expert matmul.
    #[test]
    fn the_stop_is_the_first_node_after_the_routers_weights() {
        let orders: [(&str, &[&str], &str); 4] = [
            ("llama4: no normalisation", &["ffn_moe_weights-1"], "node_64 (reshaped)"),
            (
                "gpt-oss: softmax of the picked weights, left unnamed",
                &["ffn_moe_weights-1", "ffn_moe_weights-1 (reshaped)", "node_97", "ffn_moe_weights_softmax-1"],
                "attn_post_norm-1 (reshaped)",
            ),
            (
                "glm4moe: normalised and scaled",
                &[
                    "ffn_moe_weights-1",
                    "ffn_moe_weights-1 (reshaped)",
                    "ffn_moe_weights_sum-1",
                    "ffn_moe_weights_sum_clamped-1",
                    "ffn_moe_weights_norm-1",
                    "ffn_moe_weights_norm-1 (reshaped)",
                    "ffn_moe_weights_scaled-1",
                ],
                "post_attn_norm-1 (reshaped)",
            ),
            ("a graph with no node before the matmul", &["ffn_moe_weights-1"], "ffn_moe_gate_up-1"),
        ];
        for (case, run, next) in orders {
            assert!(run.iter().skip(1).all(|name| ExpertStream::in_weights_run(name, 1)), "{case}");
            assert!(!ExpertStream::in_weights_run(next, 1), "{case}");
            let is_matmul = ExpertStream::expert_matmul_layer(next) == Some(1);
            assert_eq!(is_matmul, case.starts_with("a graph with no node"), "{case}");
        }
        // Another layer's weights end layer 1's run.
        assert!(!ExpertStream::in_weights_run("ffn_moe_weights-2", 1));
        assert!(!ExpertStream::in_weights_run("ffn_moe_weights_norm-11 (reshaped)", 1));
        assert_eq!(ExpertStream::expert_matmul_layer("ffn_moe_down-3"), Some(3));
        assert_eq!(ExpertStream::expert_matmul_layer("ffn_moe_down_scaled-3"), None);
    }

    #[test]
    fn the_vector_dot_product_matches_the_ordered_sum_at_every_length() {
        for len in [0, 1, 15, 16, 17, 37, 2048] {
            let row: Vec<f32> = (0..len).map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0).collect();
            let hidden: Vec<f32> = (0..len).map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0).collect();
            let ordered: f32 = row.iter().zip(&hidden).map(|(a, b)| a * b).sum();
            // Eighths times quarters add exactly in f32 at these sizes, so any order agrees.
            assert_eq!(dot(&row, &hidden), ordered, "length {len}");
        }
    }

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
        assert_eq!(cache.try_admit(5, &[0, 1, 2, 5]), None);
        assert!(!cache.is_resident(5) && (0..3).all(|unit| cache.is_resident(unit)));
        // One unprotected unit: it makes room.
        assert_eq!(cache.try_admit(5, &[0, 2, 5]), Some(vec![1]));
        assert!(cache.is_resident(5));
        // A refresh is not a use: 0 stays probationary and is the first SLRU victim after 2.
        cache.refresh(0);
        assert_eq!(cache.admit(6, &[6]), vec![2]);
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
