//! Dense-FFN streaming: attention and norms stay resident; the FFN weights of streamed layers
//! pass through a window of `D` layers prefetched ahead of the forward pass.
//!
//! The eval hook stops once per layer, at the node just before layer L's FFN (`ffn_norm-L` in
//! most architectures; `model::ffn_entry_node` names it).
//! There it releases the previous streamed layer (its FFN has run), asks for this layer and the
//! next `D` streamed layers in forward order (wrapping to the first layers for the next token),
//! and blocks until layer L's FFN bytes are ready. So at most `D + 1` streamed layers are in
//! memory. Pinned layers are ordinary resident tensors.
use std::sync::Arc;

use hypura_sys::{EvalHook, ObservedNode};

use super::residency::{FailureLatch, Residency, ResidencyError};

/// Drives the dense window from the eval hook.
pub struct DenseWindow {
    residency: Arc<Residency>,
    /// unit index per layer (None: the layer is pinned).
    unit_of_layer: Vec<Option<usize>>,
    /// Streamed layers in forward order.
    streamed_layers: Vec<u32>,
    window: usize,
    /// The entry node's name up to its layer number (`ffn_norm-`).
    entry_prefix: String,
    /// The first read error and the abort flag it raises.
    pub failure: FailureLatch,
}

impl DenseWindow {
    /// `unit_of_layer[L]` is the residency unit holding layer L's FFN, if it streams;
    /// `entry_node` the graph node before each layer's FFN (`ffn_norm`).
    pub fn new(
        residency: Arc<Residency>,
        unit_of_layer: Vec<Option<usize>>,
        window: usize,
        entry_node: &str,
    ) -> DenseWindow {
        let streamed_layers = unit_of_layer
            .iter()
            .enumerate()
            .filter(|(_, unit)| unit.is_some())
            .map(|(layer, _)| layer as u32)
            .collect();
        DenseWindow {
            residency,
            unit_of_layer,
            streamed_layers,
            window: window.max(1),
            entry_prefix: format!("{entry_node}-"),
            failure: FailureLatch::default(),
        }
    }

    /// The entry node's name, for messages.
    pub fn entry_node(&self) -> &str {
        self.entry_prefix.trim_end_matches('-')
    }

    pub fn residency(&self) -> &Arc<Residency> {
        &self.residency
    }

    /// Load the first window before the first token.
    pub fn prefetch_start(&self) -> Result<(), ResidencyError> {
        for &layer in self.streamed_layers.iter().take(self.span()) {
            if let Some(unit) = self.unit_of_layer[layer as usize] {
                self.residency.request(unit)?;
            }
        }
        Ok(())
    }

    /// Streamed layers wanted at once: the one computing (or next) and `window` ahead.
    fn span(&self) -> usize {
        (self.window + 1).min(self.streamed_layers.len())
    }

    /// The layer whose FFN entry node `name` is (the stops this window asks for), else None.
    fn layer_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix(&self.entry_prefix)?.parse().ok().filter(|&layer| layer < self.unit_of_layer.len())
    }

    /// The work at the entry of layer `layer`'s FFN.
    fn enter_layer(&self, layer: usize) -> Result<(), ResidencyError> {
        let n_streamed = self.streamed_layers.len();
        if n_streamed == 0 {
            return Ok(());
        }
        // Position of the first streamed layer at or after `layer`.
        let position = self.streamed_layers.partition_point(|&streamed| (streamed as usize) < layer);
        // Release the streamed layer before this one: its FFN has run. At the first layer, that
        // is the last streamed layer of the previous sweep, unless it is in the coming window.
        let previous = (position + n_streamed - 1) % n_streamed;
        let previous_layer = self.streamed_layers[previous] as usize;
        let in_window = |candidate: usize| (0..self.span()).any(|step| (position + step) % n_streamed == candidate);
        if previous_layer != layer && !in_window(previous) {
            if let Some(unit) = self.unit_of_layer[previous_layer] {
                self.residency.release(unit)?;
            }
        }
        // Ask for the window ahead, in forward order, wrapping into the next token's sweep.
        for step in 0..self.span() {
            let streamed = self.streamed_layers[(position + step) % n_streamed] as usize;
            if let Some(unit) = self.unit_of_layer[streamed] {
                self.residency.request(unit)?;
            }
        }
        if let Some(unit) = self.unit_of_layer[layer] {
            self.residency.wait_ready(unit)?;
        }
        Ok(())
    }
}

impl EvalHook for DenseWindow {
    fn wants(&self, name: &str) -> bool {
        self.layer_of(name).is_some()
    }

    fn observe(&self, node: &ObservedNode<'_>) {
        let Some(layer) = self.layer_of(node.name()) else {
            return;
        };
        self.residency.stats().record_observation();
        if let Err(error) = self.enter_layer(layer) {
            tracing::error!("dense streaming at layer {layer}: {error}");
            // Stop the decode before the FFN of this layer runs on missing bytes.
            self.failure.fail(error);
        }
    }
}
