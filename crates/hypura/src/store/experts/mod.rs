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
//!
//! The rooms, one per tier of the expert hierarchy and what serves it: this module holds the
//! hook (its node walk and stops) and routing into the host cache; `cache` the cache's
//! replacement bookkeeping; `prefetch` the stale gate; `warm` the host cache's warm fill beside
//! a device pool; `pool` the device's slots and staging area (decision 29) with their counters,
//! and `limit` their arithmetic over a decode (where a stop's time goes, the pooled limit);
//! `serve` a pooled layer's stop (the pool's serving, the host cache as the tier below it);
//! `split` the CPU's share of a split pool (decision 33).
use crate::sync::Lock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypura_sys::{EvalHook, ObservedNode};
use serde::Serialize;

mod cache;
pub mod limit;
pub mod pool;
mod prefetch;
mod serve;
pub mod split;
mod warm;

pub use cache::{CacheModel, CachePolicy};
pub use prefetch::RouterWeights;

use super::layout::ExpertUnits;
use super::residency::{FailureLatch, Residency, ResidencyError, UnitState};
use crate::plan::{ReuseDepths, ReuseTracker};
use pool::{ExpertPool, PoolSnapshot, StopTimes};
use prefetch::PREDICT_MAX_TOKENS;
use serve::SplitSide;
use split::{PlainCheck, SplitLayer, SplitWorker, MOE_OUT_NODE};
use warm::WarmFill;

/// Whether a batch of these rows (one a token) is a prompt batch, which sweeps each layer's
/// experts (decision 34): more tokens than a decode's prediction serves.
fn sweeps(rows: &[Vec<i32>]) -> bool {
    rows.len() > PREDICT_MAX_TOKENS
}

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
        let worker = SplitWorker::start(self.residency.clone(), self.numbering, layers.clone(), threads)?;
        self.split = Some(SplitSide { worker, layers, plain: PlainCheck::new(self.numbering.n_layer) });
        Ok(self)
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
        if sweeps(rows) {
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
        self.route_units(layer, chosen, &[], rows, hidden, &|_| false)
    }

    /// Make `chosen` (units of `layer`) ready in the cache, and prefetch the next layer's
    /// predicted units that `skip` (the device's slots) does not hold. The units of `later`
    /// (some of `chosen`) are requested and pinned but not waited for: their reader waits
    /// (the split's CPU lanes), while the device computes.
    fn route_units(
        &self,
        layer: usize,
        chosen: Vec<usize>,
        later: &[usize],
        rows: &[Vec<i32>],
        hidden: Option<&[Vec<f32>]>,
        skip: &dyn Fn(usize) -> bool,
    ) -> Result<(), ResidencyError> {
        self.counters.layer_visits.fetch_add(1, Ordering::Relaxed);
        // A prompt batch sweeps the layers, each nearly whole, and the next batch again: its
        // hits are not the reuse a decode's are, and its misses (and the next layer's reads
        // ahead) evict the most recent units (decision 34).
        let sweeping = sweeps(rows);
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
                    if sweeping {
                        state.cache.refresh(unit);
                    } else {
                        state.cache.touch(unit);
                    }
                } else {
                    self.counters.misses.fetch_add(1, Ordering::Relaxed);
                    self.counters.misses_by_layer[layer].fetch_add(1, Ordering::Relaxed);
                    let pinned = state.pinned.clone();
                    for victim in state.cache.admit_evicting(unit, &pinned, sweeping) {
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
                let Some(victims) = state.cache.try_admit(unit, &protect, sweeping) else { break };
                for victim in victims {
                    self.residency.release(victim)?;
                }
                state.prefetched[layer + 1].push(unit);
                self.prefetch_issued.fetch_add(1, Ordering::Relaxed);
                self.residency.request(unit)?;
            }
        }
        for &unit in chosen.iter().filter(|unit| !later.contains(unit)) {
            // A hit on a unit a failed read left empty reloads it here.
            if self.residency.state(unit).map(|(state, _)| state) != Some(UnitState::Ready) {
                self.residency.wait_ready(unit)?;
            }
        }
        Ok(())
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
        // A split layer's CPU share is added before the next layer routes (its `ffn_moe_out`
        // comes first): one still pending here was never added, and its experts may be evicted
        // now. Fail the decode rather than compute without it.
        let pending = self.split_pending.load(Ordering::Acquire);
        let unadded = (pending != NO_LAYER).then(|| {
            self.drain_cpu_share();
            ResidencyError::Pool(format!("layer {pending}'s CPU share was never added to its sum"))
        });
        let (asks, segment) = {
            let clock = self.clock.locked();
            (clock.asks, clock.asked.map_or(Duration::ZERO, |asked| asked.elapsed()))
        };
        let times = StopTimes { asks, segment, ..StopTimes::default() };
        let weights_name = format!("{WEIGHTS_NODE}{layer}");
        let served = match (unadded, node.kept(&weights_name)) {
            (Some(error), _) => Err(error),
            (None, Some(weights)) if self.pooled(layer) => self.serve_pooled(layer, node, &weights, times),
            (None, Some(weights)) => self.serve_streamed(layer, &weights),
            (None, None) => Err(ResidencyError::Read { unit: layer, reason: format!("{weights_name} was not kept") }),
        };
        let result = served.and_then(|()| self.warm_step());
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
}
