//! Replays a routing trace (`hypura run --trace`) against expert-cache policies and sizes, so
//! policies can be compared on the same real routing without touching a disk.
use std::fmt::Write as _;

use serde::Serialize;

use crate::store::{CacheModel, CachePolicy, ExpertUnits, RouteRecord};

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimulationResult {
    pub policy: CachePolicy,
    pub capacity_units: usize,
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
}

/// Replay `records` (units numbered as the expert store numbers them) through one policy and
/// size, exactly as the expert store admits and evicts: a layer's picks are pinned while it runs.
pub fn simulate(
    records: &[RouteRecord],
    n_layer: usize,
    n_expert: usize,
    policy: CachePolicy,
    capacity_units: usize,
) -> SimulationResult {
    let numbering = ExpertUnits { n_layer, n_expert };
    let mut cache = CacheModel::new(policy, numbering.count(), capacity_units.max(n_expert));
    let (mut hits, mut misses) = (0u64, 0u64);
    for record in records {
        let mut chosen: Vec<usize> = Vec::new();
        for &expert in record.experts.iter().flatten() {
            if expert < 0 || expert as usize >= n_expert || record.layer as usize >= n_layer {
                continue;
            }
            let unit = numbering.unit(record.layer as usize, expert as usize);
            if !chosen.contains(&unit) {
                chosen.push(unit);
            }
        }
        for &unit in &chosen {
            if cache.is_resident(unit) {
                hits += 1;
                cache.touch(unit);
            } else {
                misses += 1;
                cache.admit(unit, &chosen);
            }
        }
    }
    let total = (hits + misses).max(1);
    SimulationResult { policy, capacity_units: cache.capacity(), hits, misses, hit_rate: hits as f64 / total as f64 }
}

/// The trace as decoding the same text one token at a time would route it: each pass over the
/// layers (a run of records whose layers rise) that routed several tokens at once, as a
/// prompt batch does, becomes one pass per token, in token order. A token's picks are the same
/// whether it was batched or decoded; only the cache's order of visits changes. Decode passes
/// (one token) are unchanged.
pub fn token_by_token(records: &[RouteRecord]) -> Vec<RouteRecord> {
    let mut out = Vec::with_capacity(records.len());
    let mut start = 0;
    while start < records.len() {
        let mut end = start + 1;
        while end < records.len()
            && records[end].layer > records[end - 1].layer
            && records[end].experts.len() == records[start].experts.len()
        {
            end += 1;
        }
        let pass = &records[start..end];
        for token in 0..pass[0].experts.len() {
            out.extend(
                pass.iter()
                    .map(|record| RouteRecord { layer: record.layer, experts: vec![record.experts[token].clone()] }),
            );
        }
        start = end;
    }
    out
}

/// The comparison table: one row per capacity, one column per policy.
pub fn render(results: &[SimulationResult]) -> String {
    let mut capacities: Vec<usize> = results.iter().map(|result| result.capacity_units).collect();
    capacities.dedup();
    let mut policies: Vec<CachePolicy> = Vec::new();
    for result in results {
        if !policies.contains(&result.policy) {
            policies.push(result.policy);
        }
    }
    let mut out = String::new();
    let _ = write!(out, "| cache units |");
    for policy in &policies {
        let _ = write!(out, " {policy:?} hit rate |");
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "| ---: |{}", " ---: |".repeat(policies.len()));
    for capacity in capacities {
        let _ = write!(out, "| {capacity} |");
        for policy in &policies {
            match results.iter().find(|result| result.capacity_units == capacity && result.policy == *policy) {
                Some(result) => {
                    let _ = write!(out, " {:.1}% |", 100.0 * result.hit_rate);
                }
                None => {
                    let _ = write!(out, " - |");
                }
            }
        }
        let _ = writeln!(out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(layer: u32, experts: &[i32]) -> RouteRecord {
        RouteRecord { layer, experts: vec![experts.to_vec()] }
    }

    #[test]
    fn a_cache_holding_everything_misses_only_once_per_unit() {
        let records: Vec<RouteRecord> = (0..10).flat_map(|_| [record(0, &[0, 1]), record(1, &[2, 3])]).collect();
        let result = simulate(&records, 2, 4, CachePolicy::Lru, 8);
        assert_eq!(result.misses, 4);
        assert_eq!(result.hits, 36);
    }

    #[test]
    fn a_batched_pass_replays_token_by_token() {
        let batched = RouteRecord { layer: 0, experts: vec![vec![0, 1], vec![2, 3]] };
        let next_layer = RouteRecord { layer: 1, experts: vec![vec![1, 2], vec![3, 0]] };
        let decode = [record(0, &[3, 1]), record(1, &[0, 2])];
        let records = [vec![batched, next_layer], decode.to_vec()].concat();
        let replayed = token_by_token(&records);
        let expected = [
            record(0, &[0, 1]),
            record(1, &[1, 2]),
            record(0, &[2, 3]),
            record(1, &[3, 0]),
            record(0, &[3, 1]),
            record(1, &[0, 2]),
        ];
        assert_eq!(replayed, expected);
    }

    #[test]
    fn a_cyclic_sweep_larger_than_the_cache_defeats_lru() {
        // 3 layers × 2 picks = 6 units cycling through a cache of 4 (minimum is n_expert = 4).
        let records: Vec<RouteRecord> =
            (0..10).flat_map(|_| [record(0, &[0, 1]), record(1, &[0, 1]), record(2, &[0, 1])]).collect();
        assert_eq!(simulate(&records, 3, 4, CachePolicy::Lru, 4).hits, 0);
        assert!(simulate(&records, 3, 4, CachePolicy::Lru, 6).hits > 0);
    }
}
