//! Serving a pooled layer at its stop (decision 29): the picks no slot holds made ready in the
//! host cache, then uploaded or, split, handed to the CPU (decision 33); the ids rewritten to
//! slots; the host cache as the tier below the slots (`HostTier`); and the check that a pooled
//! layer's matmuls never run on ids that were not rewritten.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypura_sys::ObservedNode;

use super::pool::{Serving, StopTimes, Tiers};
use super::split::{CpuJob, PlainCheck, SplitLayer, SplitWorker};
use super::{ExpertStream, ResidencyError, EXPERT_MATMULS, LAST_EXPERT_MATMUL, NO_LAYER};
use crate::sync::Lock;

/// A split pool's CPU side (`split`).
pub(super) struct SplitSide {
    pub(super) worker: SplitWorker,
    pub(super) layers: Arc<Vec<Option<SplitLayer>>>,
    pub(super) plain: PlainCheck,
}

/// The host cache as the tier below a layer's device slots: an expert a slot gives up moves
/// into it (copied back from the device, so it is not read from disk again), and an expert
/// uploaded into a slot leaves it. The two tiers hold different experts, so together they hold
/// as many as their sizes add up to. In a prompt batch's sweep (decision 34) an expert copied
/// back evicts the most recent unit, as the sweep's own misses do.
pub(super) struct HostTier<'a> {
    stream: &'a ExpertStream,
    layer: usize,
    sweeping: bool,
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
        for victim in state.cache.admit_evicting(unit, &pinned, self.sweeping) {
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
    /// Serve a pooled layer from its kept `ffn_moe_weights-L`: its picks' experts that no slot
    /// holds are made ready in the host cache, then uploaded (split: those that earned a slot;
    /// the CPU computes the others, their ids at the zero slot, handed over here from `stop`'s
    /// kept weights); the ids are rewritten to slots (or the layer staged whole, for a prompt
    /// batch of more picks than slots). `times` brings the stop's asks and segment (`StopClock`).
    pub(super) fn serve_pooled(
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
        // The CPU's picks are waited for by the lane that computes each, beside the device.
        let later: Vec<usize> = match &serving {
            Serving::Split { cpu, .. } => cpu.iter().map(|&expert| self.numbering.unit(layer, expert)).collect(),
            _ => Vec::new(),
        };
        self.route_units(layer, units, &later, &rows, hidden.as_deref(), &next_pooled)?;
        let mut tiers = HostTier { stream: self, layer, sweeping: super::sweeps(&rows) };
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
                let bytes = self.submit_cpu_share(layer, stop, weights, hidden, &rows, cpu)?;
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
    pub(super) fn splits(&self, layer: usize) -> bool {
        self.split
            .as_ref()
            .is_some_and(|split| split.layers.get(layer).is_some_and(Option::is_some) && split.plain.plain(layer))
    }

    /// Hand the CPU `layer`'s picks of `cpu` (their ids now at the zero slot): the FFN's input
    /// rows (the router's: `hidden` where already read), and each pick's token and final weight
    /// (the weights' run's last node, kept up to `stop`). The sum is added at the layer's
    /// `ffn_moe_out` stop. The bytes of the picks computed.
    pub(super) fn submit_cpu_share(
        &self,
        layer: usize,
        stop: &ObservedNode<'_>,
        weights: &ObservedNode<'_>,
        hidden: Option<Vec<Vec<f32>>>,
        rows: &[Vec<i32>],
        cpu: &[usize],
    ) -> Result<u64, ResidencyError> {
        let split = self.split.as_ref().ok_or_else(|| ResidencyError::Pool(format!("layer {layer} does not split")))?;
        let unreadable = |what: &str| ResidencyError::Pool(format!("layer {layer}'s split: {what} could not be read"));
        // The router's input, already read where the next layer is predicted from it.
        let x = hidden.or_else(|| Self::router_input(layer, weights)).ok_or_else(|| unreadable("the FFN's input"))?;
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
    pub(super) fn add_cpu_share(&self, layer: usize, node: &ObservedNode<'_>) -> Result<(), ResidencyError> {
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
            pool.locked().add_cpu_times(&done, waited.as_secs_f64());
        }
        Ok(())
    }

    /// Take a CPU share that no stop will add (a decode aborted before the layer's sum), so that
    /// the worker is idle and its experts free to evict.
    pub(super) fn drain_cpu_share(&self) {
        if self.split_pending.swap(NO_LAYER, Ordering::AcqRel) != NO_LAYER {
            if let Some(split) = &self.split {
                let _ = split.worker.take();
            }
        }
    }

    /// A pooled layer's expert matmul is about to be scheduled: its ids must have been
    /// rewritten to slots in this graph, or the kernels would read past the slots. Fails the
    /// decode where they were not; the layer's last matmul ends its turn.
    pub(super) fn check_served(&self, name: &str) {
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
