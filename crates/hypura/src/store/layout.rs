//! The stream-unit layout: which file ranges make up each unit the residency machine streams.
//!
//! A dense layer's unit is its streamed FFN tensors, with small gaps between them read along
//! (one larger read beats two small ones). An expert layer has one unit per expert: that
//! expert's slice of each of the layer's expert tensors, numbered `layer * n_expert + expert`
//! (`ExpertUnits`). The engine builds units here from the plan's streamed tensors; the expert
//! cache, the stale-gate prefetch and the cache simulator number them the same way.
use std::ops::Range;

use super::residency::StreamUnit;
use crate::io::Region;
use crate::model::ExpertSlices;

/// Gaps smaller than this between a layer's streamed tensors are read along with them.
pub const MERGE_GAP_BYTES: u64 = 1 << 20;

/// Expert slices advised to use huge pages, at most: each splits the mapping in up to three,
/// and the kernel's default map count is 65530.
pub const MAX_HUGE_SLICES: usize = 16_384;

/// A streamed tensor as the layout sees it: its layer, its bytes in the file, and for expert
/// tensors where each expert's slice lies.
#[derive(Clone, Copy, Debug)]
pub struct StreamedTensor {
    pub layer: u32,
    pub file_offset: u64,
    pub bytes: u64,
    pub experts: Option<ExpertSlices>,
}

/// The numbering of expert units: `layer * n_expert + expert`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertUnits {
    pub n_layer: usize,
    pub n_expert: usize,
}

impl ExpertUnits {
    pub fn count(&self) -> usize {
        self.n_layer * self.n_expert
    }

    pub fn unit(&self, layer: usize, expert: usize) -> usize {
        layer * self.n_expert + expert
    }

    /// The units of one layer's experts.
    pub fn layer(&self, layer: usize) -> Range<usize> {
        layer * self.n_expert..(layer + 1) * self.n_expert
    }

    /// One unit per (layer, expert), each holding that expert's slice of every expert tensor
    /// of its layer, sorted. Layers without streamed expert tensors get empty units.
    pub fn build(&self, tensors: &[StreamedTensor]) -> Vec<StreamUnit> {
        let mut units: Vec<StreamUnit> = (0..self.count()).map(|_| StreamUnit::default()).collect();
        for tensor in tensors {
            let Some(slices) = tensor.experts else { continue };
            for expert in 0..self.n_expert {
                units[self.unit(tensor.layer as usize, expert)]
                    .ranges
                    .push(slices.range(tensor.file_offset, expert as u64));
            }
        }
        for unit in &mut units {
            unit.ranges.sort_by_key(|range| range.start);
        }
        units
    }

    /// Which layers stream: those with a unit holding bytes (a layer whose experts are all in
    /// device memory has none, and the hook lets it be).
    pub fn streamed_layers(&self, units: &[StreamUnit]) -> Vec<bool> {
        (0..self.n_layer).map(|layer| units[self.layer(layer)].iter().any(|unit| !unit.ranges.is_empty())).collect()
    }
}

/// One unit per streamed dense layer, in the order given: its tensors' ranges merged across
/// gaps below `MERGE_GAP_BYTES`. Returns the units and, per layer of `n_layer`, its unit.
pub fn dense_units(
    layers: &[u32],
    tensors: &[StreamedTensor],
    n_layer: usize,
) -> (Vec<StreamUnit>, Vec<Option<usize>>) {
    let mut unit_of_layer = vec![None; n_layer];
    let mut units = Vec::with_capacity(layers.len());
    for &layer in layers {
        let mut ranges: Vec<Range<u64>> = tensors
            .iter()
            .filter(|tensor| tensor.layer == layer)
            .map(|tensor| tensor.file_offset..tensor.file_offset + tensor.bytes)
            .collect();
        ranges.sort_by_key(|range| range.start);
        let mut merged: Vec<Range<u64>> = Vec::new();
        for range in ranges {
            match merged.last_mut() {
                Some(last) if range.start <= last.end + MERGE_GAP_BYTES => last.end = last.end.max(range.end),
                _ => merged.push(range),
            }
        }
        if let Some(slot) = unit_of_layer.get_mut(layer as usize) {
            *slot = Some(units.len());
        }
        units.push(StreamUnit::mirrored(merged));
    }
    (units, unit_of_layer)
}

/// Put dense units (in the order the window sweeps them) in `slots` reused slots of memory
/// from region offset `area_start` on: unit `i` in slot `i mod slots`, each slot as large as the
/// largest unit's page span, the page phase of every byte kept (O_DIRECT reads stay aligned).
/// A window of `slots - 1` layers read ahead never has two of its layers in one slot, so the
/// slots are all the memory the window needs, faulted in once and read into again for every
/// layer after (no fault, no zeroing, no release per token). Returns the slots' bytes.
pub fn place_in_slots(units: &mut [StreamUnit], slots: usize, area_start: u64) -> u64 {
    let page = crate::io::PAGE_BYTES;
    let span = |unit: &StreamUnit| match (unit.ranges.first(), unit.ranges.last()) {
        (Some(first), Some(last)) => first.start / page * page..last.end.div_ceil(page) * page,
        _ => 0..0,
    };
    let slots = slots.clamp(1, units.len().max(1));
    let slot_bytes = units.iter().map(|unit| span(unit).end - span(unit).start).max().unwrap_or(0);
    let area_start = area_start.div_ceil(page) * page;
    for (index, unit) in units.iter_mut().enumerate() {
        let at = area_start + (index % slots) as u64 * slot_bytes;
        unit.shift = at - span(unit).start;
        unit.slot = Some(index % slots);
    }
    slots as u64 * slot_bytes
}

/// Advise huge pages inside every range of at least `min_bytes` (at most `MAX_HUGE_SLICES` of
/// them): slices of several MB fault in far faster that way, and the edges stay small pages, so
/// a resident slice still costs exactly its bytes. Returns how many were advised.
pub fn advise_huge_slices(region: &Region, units: &[StreamUnit], min_bytes: u64) -> usize {
    let mut advised = 0;
    for (range, shift) in units
        .iter()
        .flat_map(|unit| unit.ranges.iter().map(|range| (range, unit.shift)))
        .filter(|(range, _)| range.end - range.start >= min_bytes)
    {
        if advised >= MAX_HUGE_SLICES {
            break;
        }
        if region.advise_huge_interior(range.start + shift..range.end + shift) {
            advised += 1;
        }
    }
    advised
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(layer: u32, file_offset: u64, bytes: u64, n_expert: Option<u64>) -> StreamedTensor {
        StreamedTensor {
            layer,
            file_offset,
            bytes,
            experts: n_expert.map(|n_expert| ExpertSlices { n_expert, slice_bytes: bytes / n_expert }),
        }
    }

    #[test]
    fn expert_units_hold_one_slice_of_each_tensor_of_their_layer() {
        let numbering = ExpertUnits { n_layer: 3, n_expert: 2 };
        // Layer 1's gate and down tensors, two experts each; layers 0 and 2 do not stream.
        let units = numbering.build(&[tensor(1, 1000, 200, Some(2)), tensor(1, 100, 40, Some(2))]);
        assert_eq!(units.len(), 6);
        assert_eq!(units[numbering.unit(1, 0)].ranges, vec![100..120, 1000..1100]);
        assert_eq!(units[numbering.unit(1, 1)].ranges, vec![120..140, 1100..1200]);
        assert!(units[numbering.unit(0, 1)].ranges.is_empty());
        assert_eq!(numbering.streamed_layers(&units), vec![false, true, false]);
    }

    #[test]
    fn dense_units_in_slots_keep_their_page_phase_and_alternate() {
        let tensors =
            [tensor(0, 5000, 3 * 4096, None), tensor(1, 40_000, 9000, None), tensor(2, 90_000, 2 * 4096 + 17, None)];
        let (mut units, _) = dense_units(&[0, 1, 2], &tensors, 3);
        let area = place_in_slots(&mut units, 2, 1 << 20);
        // The largest page span: layer 0's, 4 pages (5000 + 12288 crosses into a fourth).
        assert_eq!(area, 2 * 4 * 4096);
        assert_eq!(units.iter().map(|unit| unit.slot).collect::<Vec<_>>(), vec![Some(0), Some(1), Some(0)]);
        for unit in &units {
            assert_eq!(unit.shift % 4096, 0);
            let start = unit.ranges[0].start + unit.shift;
            let slot_start = (1 << 20) + unit.slot.unwrap() as u64 * 4 * 4096;
            assert!(
                start >= slot_start && unit.ranges.last().unwrap().end + unit.shift <= slot_start + 4 * 4096,
                "{unit:?}"
            );
        }
    }

    #[test]
    fn dense_units_merge_small_gaps_and_keep_large_ones() {
        let gap = MERGE_GAP_BYTES;
        let tensors = [
            tensor(2, 0, 100, None),
            tensor(2, 100 + gap, 50, None),
            tensor(2, 10 * gap, 10, None),
            tensor(4, 0, 8, None),
        ];
        let (units, unit_of_layer) = dense_units(&[4, 2], &tensors, 5);
        assert_eq!(unit_of_layer, vec![None, None, Some(1), None, Some(0)]);
        assert_eq!(units[0].ranges, vec![0..8]);
        assert_eq!(units[1].ranges, vec![0..150 + gap, 10 * gap..10 * gap + 10]);
    }
}
