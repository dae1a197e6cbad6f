//! The device's expert pool (decision 29): the top tier of the expert hierarchy. Every pooled
//! MoE layer's routed expert tensors are placed in device memory that holds `slots` of their
//! experts; the host's expert cache (the region) is the tier below and the disk the last.
//!
//! After the router's weights of layer L (`ffn_moe_weights-L`, kept for its ids, and their
//! normalisation) and before any expert matmul reads the ids, the expert stream hands the
//! layer's picks here:
//! - where the picks fit the slots, the experts not in a slot are made ready in the host cache,
//!   uploaded into the least recently used slots that this batch does not use, and the ids are
//!   rewritten to slot numbers: the kernels read slots only;
//! - where a prompt batch picks more experts than the layer has slots, the layer's tensors are
//!   pointed at the staging area, which holds a layer whole, its picks are put at their own
//!   positions (copied on the device from the slots that hold them, uploaded from the host
//!   cache otherwise) and the ids stay as they are; empty slots take the batch's most picked
//!   experts from there.
//!
//! Either way the device computes every routed expert, from the same bytes as the file's, unless
//! the pool splits (decision 33): then, at decode, a pick no slot holds is computed by the CPU
//! from the host cache while the device computes the slots' picks, its id pointing at the
//! layer's zero slot (zero bytes decode to zero weights in every ggml type, so that expert adds
//! nothing), and an expert is uploaded into a slot only once its recent picks outweigh those of
//! the slot's expert by `SPLIT_UPLOAD_MARGIN` (`Popularity`).
use hypura_sys::{DevicePool, ModelTensor};
use serde::Serialize;

use crate::io::Region;
use crate::plan::POOL_ALIGNMENT;
use crate::store::residency::ResidencyError;

/// One pooled expert tensor: where its experts lie in the file (and so in the region), and
/// where its slots and its staging copy lie in the pool.
pub struct PooledTensor {
    tensor: ModelTensor,
    file_offset: u64,
    slice_bytes: u64,
    slots_at: usize,
    staging_at: usize,
}

impl PooledTensor {
    pub fn new(tensor: ModelTensor, file_offset: u64, slice_bytes: u64) -> PooledTensor {
        PooledTensor { tensor, file_offset, slice_bytes, slots_at: 0, staging_at: 0 }
    }
}

/// Picks, decayed by half every `SPLIT_HALF_LIFE` decode batches of the layer: how often each
/// expert has been picked lately (the split's measure of what earns a slot).
const SPLIT_HALF_LIFE: f64 = 128.0;
/// How many more recent picks a missed expert needs than a slot's expert to take its slot. An
/// upload is on the decode's path (the device waits for it), where the CPU computes a miss beside
/// the device's own work: only an expert that will be picked much more often than the one it
/// replaces is worth moving.
pub const SPLIT_UPLOAD_MARGIN: f64 = 8.0;

/// Each expert's recent picks in one layer (`SPLIT_HALF_LIFE`), decayed lazily.
struct Popularity {
    score: Vec<f64>,
    stamp: Vec<u64>,
    now: u64,
}

impl Popularity {
    fn new(n_expert: usize) -> Popularity {
        Popularity { score: vec![0.0; n_expert], stamp: vec![0; n_expert], now: 0 }
    }

    fn value(&self, expert: usize) -> f64 {
        let age = self.now.saturating_sub(self.stamp[expert]) as f64;
        self.score[expert] * (-age * std::f64::consts::LN_2 / SPLIT_HALF_LIFE).exp()
    }

    /// A decode batch of the layer picked `picks`.
    fn pick(&mut self, picks: &[usize]) {
        self.now += 1;
        for &expert in picks {
            self.score[expert] = self.value(expert) + 1.0;
            self.stamp[expert] = self.now;
        }
    }
}

/// One pooled layer's tensors and slot table.
struct PooledLayer {
    tensors: Vec<PooledTensor>,
    /// Per expert, its slot.
    slot_of: Vec<Option<u32>>,
    /// Per slot, its expert and when it was last used.
    expert_in: Vec<Option<usize>>,
    last_used: Vec<u64>,
    /// Whether the tensors point at the staging area now.
    staged: bool,
    /// Split pools: each expert's recent picks.
    popularity: Popularity,
}

impl PooledLayer {
    /// `expert` is in `slot` now, used at `now`.
    fn put(&mut self, slot: usize, expert: usize, now: u64) {
        self.expert_in[slot] = Some(expert);
        self.slot_of[expert] = Some(slot as u32);
        self.last_used[slot] = now;
    }

    /// Copies on the device of each (slot, expert)'s slices, every tensor's: from the slot to
    /// the expert's place in the staging area, or back (`to_slots`). As `(from, to, bytes)`
    /// offsets in the pool.
    fn staging_copies(&self, pairs: &[(usize, usize)], to_slots: bool) -> Vec<(usize, usize, usize)> {
        let mut copies = Vec::with_capacity(pairs.len() * self.tensors.len());
        for &(slot, expert) in pairs {
            for tensor in &self.tensors {
                let slice = tensor.slice_bytes as usize;
                let (in_slot, staged) = (tensor.slots_at + slot * slice, tensor.staging_at + expert * slice);
                copies.push(if to_slots { (staged, in_slot, slice) } else { (in_slot, staged, slice) });
            }
        }
        copies
    }

    /// Split: which of `missing` (picks no slot holds) earn a slot, and which the CPU computes.
    /// The most popular first, each takes the empty slot or the slot of the least popular
    /// expert this batch does not pick, where it is `SPLIT_UPLOAD_MARGIN` picks more popular.
    fn earned(&self, missing: &[usize], picks: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let popular = |expert: usize| self.popularity.value(expert);
        let mut order = missing.to_vec();
        order.sort_by(|&a, &b| popular(b).total_cmp(&popular(a)).then(a.cmp(&b)));
        let mut free: Vec<(f64, usize)> = (0..self.expert_in.len())
            .filter_map(|slot| match self.expert_in[slot] {
                None => Some((0.0, slot)),
                Some(expert) if !picks.contains(&expert) => Some((popular(expert), slot)),
                Some(_) => None,
            })
            .collect();
        free.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        let (mut upload, mut cpu) = (Vec::new(), Vec::new());
        for expert in order {
            match free.last() {
                Some(&(held, _)) if popular(expert) >= held + SPLIT_UPLOAD_MARGIN => {
                    free.pop();
                    upload.push(expert);
                }
                _ => cpu.push(expert),
            }
        }
        (upload, cpu)
    }

    /// The empty ones of `slots`, each paired with one of the batch's `picks` that no slot
    /// holds, the most picked in `rows` first.
    fn empty_slots_fill(&self, slots: usize, picks: &[usize], rows: &[Vec<i32>]) -> Vec<(usize, usize)> {
        let empty: Vec<usize> = (0..slots).filter(|&slot| self.expert_in[slot].is_none()).collect();
        if empty.is_empty() {
            return Vec::new();
        }
        let mut counts = vec![0u32; self.slot_of.len()];
        for &expert in rows.iter().flatten() {
            if let Some(count) = usize::try_from(expert).ok().and_then(|expert| counts.get_mut(expert)) {
                *count += 1;
            }
        }
        let mut candidates: Vec<usize> =
            picks.iter().copied().filter(|&expert| self.slot_of[expert].is_none()).collect();
        candidates.sort_by_key(|&expert| (std::cmp::Reverse(counts[expert]), expert));
        empty.into_iter().zip(candidates).collect()
    }
}

/// What the pool did, counted per (token batch, layer, expert), and the time it took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PoolSnapshot {
    /// Picks served from a device slot.
    pub hits: u64,
    /// Experts uploaded into a slot (a pick that was not in one).
    pub uploads: u64,
    /// Experts a slot gave up for another, copied back to the host cache.
    pub evictions: u64,
    /// Bytes copied to the device, slots and staging together.
    pub upload_bytes: u64,
    /// Layers computed from the staging area (prompt batches), the bytes uploaded into it,
    /// and the bytes copied into it from slots on the device's side.
    pub staged_layers: u64,
    pub staged_bytes: u64,
    pub staged_on_device_bytes: u64,
    /// Experts a staged prompt layer put into empty slots (copied on the device).
    pub staged_into_slots: u64,
    /// Bytes copied back from the device into the host cache (experts a slot gave up).
    pub copied_back_bytes: u64,
    /// Experts put into slots at load, the model's most picked by its recorded routing, and
    /// their bytes (read from disk before the first graph).
    pub preloaded: u64,
    pub preloaded_bytes: u64,
    /// Split pools: picks the CPU computed from the host cache (their ids at the zero slot),
    /// their bytes, and the time the CPU took for them (beside the device's compute) and the
    /// time the decode then waited for it at the layer's end.
    pub cpu_picks: u64,
    pub cpu_bytes: u64,
    pub cpu_seconds: f64,
    pub cpu_wait_seconds: f64,
    /// Of `cpu_seconds`, per layer summed: the hand-over to the lanes (the last lane's start),
    /// and the longest wait of a lane for its picks' reads (host cache misses read from disk).
    pub cpu_start_seconds: f64,
    pub cpu_read_wait_seconds: f64,
    /// Time moving experts between the tiers (uploads, copies back, staging): the bus's share.
    pub transfer_seconds: f64,
    /// Time the host spent at the pool's stops, waits for the disk left out: reading the
    /// router's ids, serving them and writing them back. The device idles meanwhile, so the
    /// rest of a decode's compute time is the device's (with the stops' launch gaps).
    pub host_seconds: f64,
    /// The stops, and where a stop's time goes beside the host's work (`StopTimes`): reading the
    /// router's ids and writing the slots' back (within `host_seconds`), the eval callback's
    /// questions about the nodes since the stop before in the same graph (`asked_stops` of
    /// them: the first stop of a graph has none), and the segment up to the stop launched,
    /// computed and synchronised.
    pub stops: u64,
    pub ids_seconds: f64,
    pub asked_stops: u64,
    pub asks_seconds: f64,
    pub asked_nodes: u64,
    pub segment_seconds: f64,
}

impl PoolSnapshot {
    /// Bytes moved over the bus between host and device: uploads and copies back.
    pub fn bus_bytes(&self) -> u64 {
        self.upload_bytes + self.copied_back_bytes
    }

    /// Bytes of the picks no slot held, outside staged prompt layers: each was uploaded into a
    /// slot or, split, computed by the CPU from the host cache.
    pub fn miss_bytes(&self) -> u64 {
        self.upload_bytes.saturating_sub(self.staged_bytes) + self.cpu_bytes
    }
}

/// `Add` and `Sub` for a struct of counters, field by field (a later snapshot less an earlier
/// one, or two runs' together).
macro_rules! counters_add_sub {
    ($name:ident { $($field:ident),* $(,)? }) => {
        impl std::ops::Add for $name {
            type Output = $name;

            fn add(self, other: $name) -> $name {
                $name { $($field: self.$field + other.$field),* }
            }
        }

        impl std::ops::Sub for $name {
            type Output = $name;

            fn sub(self, earlier: $name) -> $name {
                $name { $($field: self.$field - earlier.$field),* }
            }
        }
    };
}

counters_add_sub!(PoolSnapshot {
    hits,
    uploads,
    evictions,
    upload_bytes,
    staged_layers,
    staged_bytes,
    staged_on_device_bytes,
    staged_into_slots,
    copied_back_bytes,
    preloaded,
    preloaded_bytes,
    cpu_picks,
    cpu_bytes,
    cpu_seconds,
    cpu_wait_seconds,
    cpu_start_seconds,
    cpu_read_wait_seconds,
    transfer_seconds,
    host_seconds,
    stops,
    ids_seconds,
    asked_stops,
    asks_seconds,
    asked_nodes,
    segment_seconds,
});

/// Where one of the pool's stops spent its time (`ExpertPool::add_times`).
#[derive(Clone, Copy, Debug, Default)]
pub struct StopTimes {
    /// Moving experts between the tiers (the pool's `load`).
    pub transfer: std::time::Duration,
    /// The host's work at the stop in all, waits for the disk left out.
    pub host: std::time::Duration,
    /// Of that, reading the router's ids from the device and writing the slots' ids back.
    pub ids: std::time::Duration,
    /// The eval callback's questions since the graph's stop before, if there was one, and
    /// how many nodes they were about.
    pub asks: Option<(std::time::Duration, u64)>,
    /// From the hook's asking for the stop to its call: the segment launched, computed and
    /// synchronised.
    pub segment: std::time::Duration,
}

/// The tier below the pool (the host's expert cache), told what moves between them.
pub trait Tiers {
    /// `expert` left its slot; `copy` writes its bytes at its place in the region.
    fn evicted(&mut self, expert: usize, copy: &dyn Fn(&Region) -> Result<(), String>) -> Result<(), ResidencyError>;
    /// `expert` is in a slot now.
    fn uploaded(&mut self, expert: usize) -> Result<(), ResidencyError>;
}

/// How a layer's batch is served: the experts to make ready in the host cache first.
pub enum Serving {
    /// The picks fit the slots: these experts need uploading.
    Slots(Vec<usize>),
    /// Split: `upload` earned a slot, the CPU computes `cpu` (their ids at the zero slot).
    Split { upload: Vec<usize>, cpu: Vec<usize> },
    /// A prompt batch: every pick is staged, these from the host cache (the others from
    /// their slots).
    Staged(Vec<usize>),
}

impl Serving {
    /// The experts the host cache must hold before `ExpertPool::load`.
    pub fn from_host(&self) -> Vec<usize> {
        match self {
            Serving::Slots(experts) | Serving::Staged(experts) => experts.clone(),
            Serving::Split { upload, cpu } => upload.iter().chain(cpu).copied().collect(),
        }
    }
}

pub struct ExpertPool {
    pool: DevicePool,
    /// Slots that hold experts; a split pool has one more per layer, of zeros, past them.
    slots: usize,
    split: bool,
    layers: Vec<Option<PooledLayer>>,
    clock: u64,
    counters: PoolSnapshot,
}

impl ExpertPool {
    /// Lay `layers`' tensors out in `pool` (per layer: its tensors' `slots` slots, each tensor
    /// aligned; after every layer, one staging area the size of the largest layer) and place
    /// them on their slots. `pool` must hold that layout (an error says so otherwise). A `split`
    /// pool keeps the last slot of each layer as its zero slot.
    pub fn new(
        pool: DevicePool,
        slots: usize,
        n_expert: usize,
        layers: Vec<Option<Vec<PooledTensor>>>,
        split: bool,
    ) -> Result<ExpertPool, ResidencyError> {
        let (slot_bytes, staging_bytes) = Self::layout(slots, &layers);
        let usable = if split { slots.saturating_sub(1) } else { slots };
        if slot_bytes + staging_bytes > pool.bytes() as u64 || usable == 0 {
            return Err(ResidencyError::Pool(format!(
                "{} of device memory holds no {slots} expert slots per layer and a staging area ({} needed)",
                crate::format::format_bytes(pool.bytes() as u64),
                crate::format::format_bytes(slot_bytes + staging_bytes)
            )));
        }
        let mut at = 0usize;
        let mut placed = Vec::with_capacity(layers.len());
        for tensors in layers {
            let Some(mut tensors) = tensors else {
                placed.push(None);
                continue;
            };
            let mut staged_at = slot_bytes as usize;
            for tensor in &mut tensors {
                tensor.slots_at = at;
                tensor.staging_at = staged_at;
                tensor.tensor.place(&pool, at, slots * tensor.slice_bytes as usize).map_err(pool_error)?;
                at = (at + slots * tensor.slice_bytes as usize).next_multiple_of(POOL_ALIGNMENT as usize);
                staged_at = (staged_at + tensor.tensor.nbytes()).next_multiple_of(POOL_ALIGNMENT as usize);
            }
            if split {
                for tensor in &tensors {
                    let slice = tensor.slice_bytes as usize;
                    tensor.tensor.write(usable * slice, &vec![0u8; slice]).map_err(pool_error)?;
                }
            }
            placed.push(Some(PooledLayer {
                tensors,
                slot_of: vec![None; n_expert],
                expert_in: vec![None; usable],
                last_used: vec![0; usable],
                staged: false,
                popularity: Popularity::new(n_expert),
            }));
        }
        Ok(ExpertPool { pool, slots: usable, split, layers: placed, clock: 0, counters: PoolSnapshot::default() })
    }

    /// Whether a pick no slot holds is computed by the CPU at decode.
    pub fn splits(&self) -> bool {
        self.split
    }

    /// The slots' and the staging area's bytes for this layout.
    fn layout(slots: usize, layers: &[Option<Vec<PooledTensor>>]) -> (u64, u64) {
        let align = |bytes: u64| bytes.next_multiple_of(POOL_ALIGNMENT);
        let slot_bytes = layers.iter().flatten().flatten().map(|tensor| align(slots as u64 * tensor.slice_bytes)).sum();
        let staging_bytes = layers
            .iter()
            .flatten()
            .map(|tensors| tensors.iter().map(|tensor| align(tensor.tensor.nbytes() as u64)).sum::<u64>())
            .max()
            .unwrap_or(0);
        (slot_bytes, staging_bytes)
    }

    pub fn device(&self) -> &str {
        self.pool.device()
    }

    pub fn pooled_layers(&self) -> Vec<bool> {
        self.layers.iter().map(Option::is_some).collect()
    }

    /// Put `expert` of `layer` into an empty slot before the first graph (the pool's warm
    /// start), each tensor's slice read by `read` (its file offset and bytes). False where the
    /// layer has no empty slot left, is not pooled, or holds the expert already.
    pub fn preload(
        &mut self,
        layer: usize,
        expert: usize,
        read: &mut dyn FnMut(u64, u64) -> Result<Vec<u8>, ResidencyError>,
    ) -> Result<bool, ResidencyError> {
        let Some(pooled) = self.layers.get_mut(layer).and_then(Option::as_mut) else { return Ok(false) };
        let empty = (0..pooled.expert_in.len()).find(|&slot| pooled.expert_in[slot].is_none());
        let (Some(slot), Some(None)) = (empty, pooled.slot_of.get(expert)) else { return Ok(false) };
        for tensor in &pooled.tensors {
            let bytes = read(tensor.file_offset + expert as u64 * tensor.slice_bytes, tensor.slice_bytes)?;
            tensor.tensor.write(slot * tensor.slice_bytes as usize, &bytes).map_err(pool_error)?;
            self.counters.preloaded_bytes += tensor.slice_bytes;
        }
        pooled.put(slot, expert, 0);
        self.counters.preloaded += 1;
        Ok(true)
    }

    /// Whether expert `expert` of `layer` is in a slot.
    pub fn holds(&self, layer: usize, expert: usize) -> bool {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .is_some_and(|pooled| pooled.slot_of.get(expert).copied().flatten().is_some())
    }

    /// How `picks` (the batch's distinct experts of `layer`) will be served. Slot hits count
    /// here; the caller makes the returned experts ready in the host cache, then calls `load`.
    /// `split`: the layer may split (a split pool, and the layer's graph computes plain SwiGLU
    /// experts, which the CPU computes alike).
    pub fn serve(&mut self, layer: usize, picks: &[usize], split: bool) -> Serving {
        let Some(pooled) = self.layers.get(layer).and_then(Option::as_ref) else {
            return Serving::Staged(picks.to_vec());
        };
        if picks.len() > self.slots {
            // Experts in slots are copied on the device's side; the host cache serves the rest.
            return Serving::Staged(picks.iter().copied().filter(|&expert| pooled.slot_of[expert].is_none()).collect());
        }
        let missing: Vec<usize> = picks.iter().copied().filter(|&expert| pooled.slot_of[expert].is_none()).collect();
        self.counters.hits += (picks.len() - missing.len()) as u64;
        if !(self.split && split) {
            return Serving::Slots(missing);
        }
        let Some(pooled) = self.layers.get_mut(layer).and_then(Option::as_mut) else {
            return Serving::Slots(missing);
        };
        pooled.popularity.pick(picks);
        let (upload, cpu) = pooled.earned(&missing, picks);
        self.counters.cpu_picks += cpu.len() as u64;
        Serving::Split { upload, cpu }
    }

    /// Carry out `serving` for `layer`'s `picks`, reading the experts' bytes from `region`
    /// (ready there): upload into slots and return the ids rewritten to slots, or stage the
    /// layer and return None (the ids stay). The tiers are exclusive: `tiers` is handed each
    /// expert a slot gives up, with a copy of it into the region for the host cache to keep,
    /// and each expert now in a slot, which the host cache drops.
    pub fn load(
        &mut self,
        layer: usize,
        picks: &[usize],
        serving: &Serving,
        region: &Region,
        rows: &[Vec<i32>],
        tiers: &mut dyn Tiers,
    ) -> Result<Option<Vec<Vec<i32>>>, ResidencyError> {
        let slots = self.slots;
        let placed_slots = slots + usize::from(self.split);
        let Some(pooled) = self.layers.get_mut(layer).and_then(Option::as_mut) else {
            return Err(ResidencyError::Pool(format!("layer {layer} has no expert pool")));
        };
        match serving {
            Serving::Staged(from_host) => {
                let mut bytes = 0u64;
                // The picks the slots hold are copied on the device's side, from their slot
                // to their expert's place in the staging area (which lies past every slot).
                let held: Vec<(usize, usize)> =
                    picks.iter().filter_map(|&expert| Some((pooled.slot_of[expert]? as usize, expert))).collect();
                let from_slots = pooled.staging_copies(&held, false);
                for tensor in &pooled.tensors {
                    tensor.tensor.place(&self.pool, tensor.staging_at, tensor.tensor.nbytes()).map_err(pool_error)?;
                    for &expert in from_host {
                        bytes += upload(tensor, region, expert, expert)?;
                    }
                }
                self.pool.copy_within(&from_slots).map_err(pool_error)?;
                // Empty slots take the batch's most picked experts from the staging area, on the
                // device (no bus, nothing given up): a first long prompt leaves the slots as a
                // decode after it will want them, not empty. The slot table names an expert
                // only once its bytes are there.
                let filled = pooled.empty_slots_fill(slots, picks, rows);
                self.pool.copy_within(&pooled.staging_copies(&filled, true)).map_err(pool_error)?;
                self.clock += 1;
                for (slot, expert) in filled {
                    pooled.put(slot, expert, self.clock);
                    self.counters.staged_into_slots += 1;
                    tiers.uploaded(expert)?;
                }
                pooled.staged = true;
                self.counters.staged_layers += 1;
                self.counters.staged_bytes += bytes;
                self.counters.staged_on_device_bytes +=
                    from_slots.iter().map(|&(_, _, bytes)| bytes as u64).sum::<u64>();
                self.counters.upload_bytes += bytes;
                Ok(None)
            }
            Serving::Slots(missing) | Serving::Split { upload: missing, .. } => {
                let on_cpu: &[usize] = match serving {
                    Serving::Split { cpu, .. } => cpu,
                    _ => &[],
                };
                if pooled.staged {
                    for tensor in &pooled.tensors {
                        tensor
                            .tensor
                            .place(&self.pool, tensor.slots_at, placed_slots * tensor.slice_bytes as usize)
                            .map_err(pool_error)?;
                    }
                    pooled.staged = false;
                }
                self.clock += 1;
                let now = self.clock;
                for &expert in picks {
                    if let Some(slot) = pooled.slot_of[expert] {
                        pooled.last_used[slot as usize] = now;
                    }
                }
                for &expert in missing {
                    // The least recently used slot that this batch does not use (one exists:
                    // the picks are no more than the slots, and each used slot is stamped now);
                    // split, an empty one or the least popular one's (`PooledLayer::earned`).
                    let unused = (0..slots).filter(|&slot| pooled.last_used[slot] != now);
                    let slot = if !matches!(serving, Serving::Split { .. }) {
                        unused.min_by_key(|&slot| pooled.last_used[slot])
                    } else {
                        let popular =
                            |slot: usize| pooled.expert_in[slot].map_or(-1.0, |held| pooled.popularity.value(held));
                        unused.min_by(|&a, &b| popular(a).total_cmp(&popular(b)).then(a.cmp(&b)))
                    }
                    .ok_or_else(|| ResidencyError::Pool(format!("layer {layer}: no free slot for expert {expert}")))?;
                    if let Some(previous) = pooled.expert_in[slot].take() {
                        pooled.slot_of[previous] = None;
                        let tensors = &pooled.tensors;
                        let copied = std::cell::Cell::new(0u64);
                        let copy_back = |region: &Region| -> Result<(), String> {
                            for tensor in tensors {
                                copied.set(copied.get() + tensor.slice_bytes);
                                let start = tensor.file_offset + previous as u64 * tensor.slice_bytes;
                                region.fill(start..start + tensor.slice_bytes, |bytes| {
                                    tensor
                                        .tensor
                                        .read(slot * tensor.slice_bytes as usize, bytes)
                                        .map_err(|error| error.to_string())
                                })?;
                            }
                            Ok(())
                        };
                        tiers.evicted(previous, &copy_back)?;
                        self.counters.evictions += 1;
                        self.counters.copied_back_bytes += copied.get();
                    }
                    let mut bytes = 0;
                    for tensor in &pooled.tensors {
                        bytes += upload(tensor, region, expert, slot)?;
                    }
                    pooled.put(slot, expert, now);
                    self.counters.uploads += 1;
                    self.counters.upload_bytes += bytes;
                    tiers.uploaded(expert)?;
                }
                // The CPU's picks read the zero slot, past the others.
                let zero_slot = slots as i32;
                let remapped = rows
                    .iter()
                    .map(|row| {
                        row.iter()
                            .map(|&expert| match pooled.slot_of[expert as usize] {
                                Some(slot) => slot as i32,
                                None if on_cpu.contains(&(expert as usize)) => zero_slot,
                                None => -1,
                            })
                            .collect::<Vec<i32>>()
                    })
                    .collect::<Vec<_>>();
                if remapped.iter().flatten().any(|&slot| slot < 0) {
                    return Err(ResidencyError::Pool(format!("layer {layer}: a picked expert has no slot")));
                }
                Ok(Some(remapped))
            }
        }
    }

    /// A split layer's CPU share: its picks' bytes, handed to the CPU.
    pub fn add_cpu_bytes(&mut self, bytes: u64) {
        self.counters.cpu_bytes += bytes;
    }

    /// A split layer's CPU share was added: the CPU's times for it (`CpuDone`), and the
    /// decode's wait for it.
    pub fn add_cpu_times(&mut self, done: &super::split::CpuDone, waited: f64) {
        self.counters.cpu_seconds += done.seconds;
        self.counters.cpu_start_seconds += done.start_seconds;
        self.counters.cpu_read_wait_seconds += done.read_wait_seconds;
        self.counters.cpu_wait_seconds += waited;
    }

    /// A stop's times (`PoolSnapshot`).
    pub fn add_times(&mut self, times: &StopTimes) {
        let counters = &mut self.counters;
        counters.stops += 1;
        counters.transfer_seconds += times.transfer.as_secs_f64();
        counters.host_seconds += times.host.as_secs_f64();
        counters.ids_seconds += times.ids.as_secs_f64();
        if let Some((asks, nodes)) = times.asks {
            counters.asked_stops += 1;
            counters.asks_seconds += asks.as_secs_f64();
            counters.asked_nodes += nodes;
        }
        counters.segment_seconds += times.segment.as_secs_f64();
    }

    pub fn snapshot(&self) -> PoolSnapshot {
        self.counters
    }
}

/// Copy expert `expert`'s slice of `tensor` from the region into position `at` of the tensor's
/// device memory; the bytes copied.
fn upload(tensor: &PooledTensor, region: &Region, expert: usize, at: usize) -> Result<u64, ResidencyError> {
    let start = tensor.file_offset + expert as u64 * tensor.slice_bytes;
    let bytes = region.bytes(start..start + tensor.slice_bytes);
    tensor.tensor.write(at * tensor.slice_bytes as usize, bytes).map_err(pool_error)?;
    Ok(tensor.slice_bytes)
}

fn pool_error(error: hypura_sys::SysError) -> ResidencyError {
    ResidencyError::Pool(error.to_string())
}
