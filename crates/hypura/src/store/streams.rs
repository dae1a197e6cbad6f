//! The store builds its own streams: everything a streaming load needs from the store, before
//! and after llama.cpp loads the model.
//!
//! Before the load, [`StreamLoad::prepare`] lays out the stream units, reserves the region that
//! mirrors the file (with the dense layers' reused slots after it) and the sink that absorbs
//! llama.cpp's load-time copies, and says where every streamed or mapped tensor lives in the
//! region ([`StreamLoad::offsets`], for the stream buffer type); [`StreamLoad::load_reader`]
//! serves llama.cpp's reads (resident bytes with direct I/O, streamed bytes skipped). After the
//! load, [`StreamLoad::finish`] maps the tables left in the file's pages and builds the drivers
//! the eval hook runs: the expert cache (with the router weights of the stale-gate prefetch)
//! and the dense window, each with its residency over the one region. The engine hands the
//! offsets and the reader to llama.cpp and wraps the drivers in its hook; it assembles none of
//! the store's parts.
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::layout::{advise_huge_slices, dense_units, place_in_slots, ExpertUnits, StreamedTensor};
use super::load::StoreLoadReader;
use super::residency::{Residency, ResidencyError, StreamUnit};
use super::{DenseWindow, ExpertPool, ExpertStream, IoStats, PooledTensor, RouterWeights, SplitLayer};
use crate::io::{DirectFile, IoError, Region};
use crate::model::{ExpertSlices, Inventory, TensorEntry};
use crate::plan::{Plan, Tier};

/// Why the store could not set up or run its streams. Messages name the file, tensor or number
/// at fault where there is one.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    #[error("streaming split models ({files} files) is not supported yet")]
    SplitModel { files: usize },
    #[error("{placed} streamed and mapped tensors were placed, {planned} planned")]
    Placed { placed: usize, planned: usize },
    #[error("opening {}: {source}", .path.display())]
    Open { path: PathBuf, source: std::io::Error },
    #[error("reading {tensor}: {source}")]
    ReadTensor { tensor: String, source: std::io::Error },
    #[error("a streaming plan without a dense or expert layout")]
    NoLayout,
    /// A decode during which the eval hook never stopped: the architecture does not name its
    /// nodes as the drivers expect, so streamed layers computed on bytes nobody loaded.
    #[error("llama.cpp's graph for {arch} has no {node} node, so streamed weights were never loaded; use --mode resident or another mode")]
    HookNeverFired { arch: String, node: String },
    /// A failure that fails every sequence of a batch: each sequence gets the failure's words
    /// (the typed failure, an I/O error among them, cannot be cloned).
    #[error("{message}")]
    Batch { message: String },
}

/// The dense layers' units, placed in reused slots after the file's mirror.
struct DenseUnits {
    units: Vec<StreamUnit>,
    /// Per layer, its unit (None: the layer is pinned).
    unit_of_layer: Vec<Option<usize>>,
    /// The slots' bytes, after the mirror.
    slot_bytes: u64,
}

/// A streaming load under way: prepared before llama.cpp loads the model, finished after.
///
/// Keep it until the model is dropped on an error path: the model's streamed tensors point
/// into its region (the stream buffer type's contract), so declare it before the model.
pub struct StreamLoad<'a> {
    path: &'a Path,
    inventory: &'a Inventory,
    plan: &'a Plan,
    /// Tensors that stream.
    streamed: Vec<&'a TensorEntry>,
    /// Tables left in the file's pages; they live in the region too, mapped from the file
    /// after the load.
    mapped: Vec<&'a TensorEntry>,
    layout: Vec<StreamedTensor>,
    dense: Option<DenseUnits>,
    region: Arc<Region>,
    /// Reserved until `finish`.
    sink: Option<Arc<Region>>,
    stats: Arc<IoStats>,
}

/// What a finished load hands the engine: the drivers its eval hook runs, and the counters.
pub struct Streams {
    pub dense: Option<Arc<DenseWindow>>,
    pub experts: Option<Arc<ExpertStream>>,
    pub stats: Arc<IoStats>,
    /// Bytes read at load (resident tensors), not counting streamed ones.
    pub load_bytes: u64,
    /// Whether anything streams. A plan that only leaves tables in the file's pages (beside a
    /// remote tier that holds what would stream) runs without the eval hook.
    pub hooked: bool,
}

/// Whether a streamed tensor with these expert slices belongs to a dense unit: every tensor of
/// a plan without an expert layout, and the tensors without experts otherwise.
fn streams_dense(plan: &Plan, experts: Option<ExpertSlices>) -> bool {
    experts.is_none() || plan.experts.is_none()
}

impl<'a> StreamLoad<'a> {
    /// Lay out the units and reserve the region and the sink for `plan`, which was made from
    /// `inventory` (the file at `path`).
    pub fn prepare(path: &'a Path, inventory: &'a Inventory, plan: &'a Plan) -> Result<StreamLoad<'a>, StoreError> {
        if inventory.split_paths.len() > 1 {
            return Err(StoreError::SplitModel { files: inventory.split_paths.len() });
        }
        // The plan's placements are the inventory's tensors, in order (checked at load).
        let with_tier = |tier: Tier| -> Vec<&'a TensorEntry> {
            plan.tensors
                .iter()
                .zip(&inventory.tensors)
                .filter(|(placement, _)| placement.tier == tier)
                .map(|(_, tensor)| tensor)
                .collect()
        };
        let streamed = with_tier(Tier::Stream);
        let mapped = with_tier(Tier::Mapped);
        let layout: Vec<StreamedTensor> = streamed
            .iter()
            .filter_map(|tensor| {
                Some(StreamedTensor {
                    layer: tensor.layer?,
                    file_offset: tensor.file_offset,
                    bytes: tensor.bytes,
                    experts: tensor.experts,
                })
            })
            .collect();
        let n_layer = inventory.hparams.n_layer as usize;
        // Dense layers stream through reused slots after the file's mirror (as many as the window
        // holds), expert slices through their mirror positions.
        let mirror_bytes = inventory.file_bytes.next_multiple_of(2 << 20);
        let dense = plan.dense.as_ref().map(|dense| {
            let dense_tensors: Vec<StreamedTensor> =
                layout.iter().filter(|tensor| streams_dense(plan, tensor.experts)).copied().collect();
            let (mut units, unit_of_layer) = dense_units(&dense.streamed_layers, &dense_tensors, n_layer);
            // As many slots as the window holds layers (`DenseWindow` reads at least one ahead).
            let slot_bytes = place_in_slots(&mut units, dense.window_layers.max(1) + 1, mirror_bytes);
            DenseUnits { units, unit_of_layer, slot_bytes }
        });
        // Huge pages pay off for dense layers (tens of MB each), not for expert slices.
        let slot_bytes = dense.as_ref().map_or(0, |dense| dense.slot_bytes);
        let region = Arc::new(Region::reserve(mirror_bytes + slot_bytes, plan.experts.is_none())?);
        // llama.cpp copies placeholder bytes into every host tensor at load; a sink the size of the
        // largest streamed tensor absorbs them, so the region is never faulted in by the load.
        let largest = streamed.iter().chain(&mapped).map(|tensor| tensor.bytes).max().unwrap_or(0);
        let sink = Arc::new(Region::reserve(largest, false)?);
        Ok(StreamLoad {
            path,
            inventory,
            plan,
            streamed,
            mapped,
            layout,
            dense,
            region,
            sink: Some(sink),
            stats: Arc::new(IoStats::default()),
        })
    }

    /// Every tensor the region holds: the streamed ones, then the mapped tables.
    fn in_region(&self) -> impl Iterator<Item = &'a TensorEntry> + '_ {
        self.streamed.iter().chain(&self.mapped).copied()
    }

    /// The names of the tensors llama.cpp places in the stream buffer type.
    pub fn tensor_names(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.in_region().map(|tensor| tensor.name.as_str())
    }

    /// The region's address and length.
    pub fn region_span(&self) -> (usize, usize) {
        (self.region.address(), self.region.len())
    }

    /// The sink's address and length, until `finish`.
    pub fn sink_span(&self) -> Option<(usize, usize)> {
        self.sink.as_ref().map(|sink| (sink.address(), sink.len()))
    }

    /// Where every tensor of `tensor_names` lives, as a region offset: a streamed tensor in its
    /// dense unit's slot, else at its mirror position; a mapped table at its mirror position.
    pub fn offsets(&self) -> HashMap<String, u64> {
        let region_offset = |tensor: &TensorEntry| -> u64 {
            let shift = self.dense.as_ref().filter(|_| streams_dense(self.plan, tensor.experts)).and_then(|dense| {
                Some(dense.units[dense.unit_of_layer.get(tensor.layer? as usize).copied().flatten()?].shift)
            });
            tensor.file_offset + shift.unwrap_or(0)
        };
        self.streamed
            .iter()
            .map(|tensor| (tensor.name.clone(), region_offset(tensor)))
            .chain(self.mapped.iter().map(|tensor| (tensor.name.clone(), tensor.file_offset)))
            .collect()
    }

    /// The reader that serves llama.cpp's load-time reads: resident bytes with direct I/O, the
    /// region's tensors skipped.
    pub fn load_reader(&self) -> Result<StoreLoadReader, StoreError> {
        let skipped: Vec<Range<u64>> =
            self.in_region().map(|tensor| tensor.file_offset..tensor.file_offset + tensor.bytes).collect();
        Ok(StoreLoadReader::new(DirectFile::open(self.path)?, skipped, self.sink.clone(), self.stats.clone()))
    }

    /// After llama.cpp's load into `buffer_type`: point its tensors at the region, give the sink
    /// back, map the tables left in the file's pages, and build the drivers, each with its
    /// residency over the one region and `io_workers` reader threads, and the device's expert
    /// pool where the plan has one (split: its misses computed with `cpu_threads` threads).
    /// `trace_routing` records the router's choices. The region
    /// stays held here too until this load is dropped.
    pub fn finish(
        &mut self,
        buffer_type: &hypura_sys::StreamBufferType,
        io_workers: usize,
        cpu_threads: usize,
        trace_routing: bool,
    ) -> Result<Streams, StoreError> {
        let placed = buffer_type.finalize();
        drop(self.sink.take());
        let planned = self.streamed.len() + self.mapped.len();
        if placed != planned {
            return Err(StoreError::Placed { placed, planned });
        }
        let (path, inventory, plan, region) = (self.path, self.inventory, self.plan, &self.region);

        let file = Arc::new(DirectFile::open(path)?);
        if !self.mapped.is_empty() {
            let plain =
                std::fs::File::open(path).map_err(|source| StoreError::Open { path: path.to_path_buf(), source })?;
            for tensor in &self.mapped {
                region.map_file(&plain, &file, tensor.file_offset..tensor.file_offset + tensor.bytes)?;
            }
        }
        let n_layer = inventory.hparams.n_layer as usize;
        // Expert units are (layer, expert) slices of the expert tensors; dense units whole layers of
        // the other streamed tensors. Each driver has its own residency over the one region.
        let experts = match &plan.experts {
            Some(experts) => {
                let numbering = ExpertUnits { n_layer, n_expert: experts.n_expert as usize };
                let units = numbering.build(&self.layout);
                advise_huge_slices(region, &units, crate::plan::HUGE_SLICE_MIN_BYTES);
                let streamed_layers = numbering.streamed_layers(&units);
                let residency =
                    Arc::new(Residency::new(region.clone(), file.clone(), units, io_workers, self.stats.clone()));
                let mut driver =
                    ExpertStream::new(residency, numbering, experts.cache_units, experts.policy, trace_routing)
                        .with_streamed_layers(streamed_layers);
                if experts.prefetch {
                    driver = driver.with_prefetch(read_router_weights(path, inventory)?);
                }
                if let Some(pool) = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.as_ref()) {
                    let mut device = expert_pool(inventory, plan, pool, buffer_type)?;
                    preload(&mut device, &file, &pool.warm_order)?;
                    let order =
                        pool.warm_order.iter().map(|&(layer, expert)| numbering.unit(layer as usize, expert as usize));
                    driver = driver.with_pool(device).with_warm_order(order.collect());
                    if pool.split {
                        driver = driver.with_split(split_layers(inventory, pool), cpu_threads)?;
                    }
                    let started = std::time::Instant::now();
                    let (units, bytes) = driver.warm_now()?;
                    tracing::info!(
                        "host cache warm: {units} experts ({:.2} GiB) read in {:.2} s",
                        bytes as f64 / (1u64 << 30) as f64,
                        started.elapsed().as_secs_f64()
                    );
                }
                Some(Arc::new(driver))
            }
            None => None,
        };
        let dense = match (&plan.dense, self.dense.take()) {
            (Some(dense), Some(DenseUnits { units, mut unit_of_layer, .. })) => {
                // The window observes the layers the host computes only: a node observed in a remote
                // device's layers would cut its graph into pieces, each sent whole over the link.
                if let Some(remote) = &plan.remote {
                    unit_of_layer.truncate(remote.layers.start as usize);
                }
                if plan.experts.is_some() {
                    // The region was reserved without huge pages, for the expert slices: advise the
                    // dense layers' interiors as the expert slices' are.
                    advise_huge_slices(region, &units, crate::plan::HUGE_SLICE_MIN_BYTES);
                }
                let residency = Arc::new(Residency::new(region.clone(), file, units, io_workers, self.stats.clone()));
                let window = Arc::new(DenseWindow::new(
                    residency,
                    unit_of_layer,
                    dense.window_layers,
                    crate::model::ffn_entry_node(&inventory.arch),
                ));
                window.prefetch_start()?;
                Some(window)
            }
            _ if experts.is_none() => return Err(StoreError::NoLayout),
            _ => None,
        };
        // The load's reads: llama.cpp's, and the host cache's warm fill.
        let load_bytes = self.stats.snapshot().bytes_read;
        Ok(Streams { dense, experts, stats: self.stats.clone(), load_bytes, hooked: !self.streamed.is_empty() })
    }
}

/// The device's expert pool for `layout`: device memory for its slots and staging area, and
/// every pooled layer's streamed expert tensors placed on their slots.
fn expert_pool(
    inventory: &Inventory,
    plan: &Plan,
    layout: &crate::plan::ExpertPoolLayout,
    buffer_type: &hypura_sys::StreamBufferType,
) -> Result<ExpertPool, StoreError> {
    let n_layer = inventory.hparams.n_layer as usize;
    let mut layers: Vec<Option<Vec<PooledTensor>>> = (0..n_layer).map(|_| None).collect();
    for (placement, tensor) in plan.tensors.iter().zip(&inventory.tensors) {
        let (Some(layer), Some(slices)) = (tensor.layer, tensor.experts) else { continue };
        if placement.tier != Tier::Stream || !layout.layers.contains(&layer) || layer as usize >= n_layer {
            continue;
        }
        let handle = buffer_type.tensor(&tensor.name).ok_or_else(|| {
            ResidencyError::Pool(format!("{} is not in the stream buffer type after the load", tensor.name))
        })?;
        layers[layer as usize].get_or_insert_with(Vec::new).push(PooledTensor::new(
            handle,
            tensor.file_offset,
            slices.slice_bytes,
        ));
    }
    let device = hypura_sys::DevicePool::new(hypura_sys::Backend::get(), layout.total_bytes() as usize)
        .map_err(|error| ResidencyError::Pool(error.to_string()))?;
    let pool =
        ExpertPool::new(device, layout.slots as usize, inventory.hparams.n_expert as usize, layers, layout.split)?;
    tracing::info!(
        "expert pool on {}: {} slots in each of {} layers, {} with the staging area",
        pool.device(),
        layout.slots,
        layout.layers.len(),
        crate::format::format_bytes(layout.total_bytes())
    );
    Ok(pool)
}

/// The pool's warm start: each pooled layer's slots take its experts in `order` (the recorded
/// routing's most picked first) until they are full, read from the file before the first graph.
fn preload(pool: &mut ExpertPool, file: &DirectFile, order: &[(u32, u32)]) -> Result<(), StoreError> {
    if order.is_empty() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let align = file.alignment_bytes().max(1);
    let mut read = |offset: u64, bytes: u64| -> Result<Vec<u8>, ResidencyError> {
        // A direct read of whole aligned blocks around the slice.
        let start = offset / align * align;
        let end = (offset + bytes).next_multiple_of(align);
        let mut buffer = crate::io::AlignedBuf::with_alignment((end - start) as usize, align as usize)
            .map_err(|error| ResidencyError::Pool(error.to_string()))?;
        let got = file
            .read_at(buffer.as_mut_slice(), start)
            .map_err(|error| ResidencyError::Pool(format!("the pool's warm start: {error}")))?;
        let (from, to) = ((offset - start) as usize, (offset - start + bytes) as usize);
        if got < to {
            return Err(ResidencyError::Pool(format!("the pool's warm start: a short read at {offset}")));
        }
        Ok(buffer.as_slice()[from..to].to_vec())
    };
    for &(layer, expert) in order {
        pool.preload(layer as usize, expert as usize, &mut read)?;
    }
    let done = pool.snapshot();
    tracing::info!(
        "expert pool warm: {} experts the recorded routing picks most put into slots ({} in {:.1} s)",
        done.preloaded,
        crate::format::format_bytes(done.preloaded_bytes),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Each pooled layer's routed experts as a split pool's CPU computes them: their types and
/// widths, and where expert 0's gate, up and down slices lie. None for a layer without all three.
fn split_layers(inventory: &Inventory, layout: &crate::plan::ExpertPoolLayout) -> Vec<Option<SplitLayer>> {
    use crate::model::Role;
    let n_layer = inventory.hparams.n_layer as usize;
    (0..n_layer as u32)
        .map(|layer| {
            if !layout.layers.contains(&layer) {
                return None;
            }
            let find = |role: Role| {
                inventory
                    .tensors
                    .iter()
                    .find(|tensor| tensor.layer == Some(layer) && tensor.role == role && tensor.experts.is_some())
            };
            let (gate, up, down) = (find(Role::ExpertGate)?, find(Role::ExpertUp)?, find(Role::ExpertDown)?);
            let (&n_embd, &n_ff) = (gate.dims.first()?, gate.dims.get(1)?);
            let slice =
                |tensor: &TensorEntry| (tensor.file_offset, tensor.experts.map_or(0, |experts| experts.slice_bytes));
            Some(SplitLayer {
                shape: hypura_sys::ExpertShape {
                    gate_type: gate.ggml_type.id() as i32,
                    up_type: up.ggml_type.id() as i32,
                    down_type: down.ggml_type.id() as i32,
                    n_embd: n_embd as usize,
                    n_ff: n_ff as usize,
                },
                slices: [slice(gate), slice(up), slice(down)],
            })
        })
        .collect()
}

/// Every layer's F32 router weights, read from the file (read-only) for the stale gate.
fn read_router_weights(path: &Path, inventory: &Inventory) -> Result<RouterWeights, StoreError> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).map_err(|source| StoreError::Open { path: path.to_path_buf(), source })?;
    let mut routers = RouterWeights {
        n_embd: inventory.hparams.n_embd as usize,
        layers: vec![None; inventory.hparams.n_layer as usize],
    };
    for tensor in &inventory.tensors {
        let (Some(layer), true) = (tensor.layer, tensor.name.ends_with("ffn_gate_inp.weight")) else { continue };
        if tensor.ggml_type != hypura_gguf::GgmlType::F32
            || tensor.split != 0
            || tensor.dims.first() != Some(&inventory.hparams.n_embd)
        {
            tracing::info!(
                "{} is {:?}, not F32 [n_embd, n_expert]: no stale-gate prediction for layer {layer}",
                tensor.name,
                tensor.ggml_type
            );
            continue;
        }
        let mut bytes = vec![0u8; tensor.bytes as usize];
        file.read_exact_at(&mut bytes, tensor.file_offset)
            .map_err(|source| StoreError::ReadTensor { tensor: tensor.name.clone(), source })?;
        routers.layers[layer as usize] = Some(
            bytes.chunks_exact(4).map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])).collect(),
        );
    }
    Ok(routers)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages name what is at fault, worded as the engine's were before the store built
    /// its own streams.
    #[test]
    fn messages_name_the_file_tensor_and_number_at_fault() {
        assert_eq!(
            StoreError::SplitModel { files: 3 }.to_string(),
            "streaming split models (3 files) is not supported yet"
        );
        assert_eq!(
            StoreError::Placed { placed: 7, planned: 9 }.to_string(),
            "7 streamed and mapped tensors were placed, 9 planned"
        );
        let missing = || std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(
            StoreError::Open { path: "/models/m.gguf".into(), source: missing() }.to_string(),
            format!("opening /models/m.gguf: {}", missing())
        );
        assert_eq!(
            StoreError::ReadTensor { tensor: "blk.3.ffn_gate_inp.weight".into(), source: missing() }.to_string(),
            format!("reading blk.3.ffn_gate_inp.weight: {}", missing())
        );
        assert_eq!(
            StoreError::HookNeverFired { arch: "llama".into(), node: "ffn_norm-<layer>".into() }.to_string(),
            "llama.cpp's graph for llama has no ffn_norm-<layer> node, so streamed weights were never loaded; use --mode resident or another mode"
        );
        // Errors of the layers below pass through unchanged.
        let residency = ResidencyError::NoSuchUnit { unit: 4, count: 2 };
        let text = residency.to_string();
        assert_eq!(StoreError::from(residency).to_string(), text);
    }
}
