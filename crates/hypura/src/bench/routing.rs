//! Routing traces and what they say about an expert cache: `hypura run --trace`'s records
//! (`{"layer", "experts": [[ids of a token] ...]}`, one a layer and batch) and recorded traces of
//! real models (`{"pos", "layer", "experts": [ids]}`, one a token and layer, gzipped or not)
//! read into one form, and the three statistics real routing is judged by (`RoutingStats`).
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::plan::{ReuseDepths, ReuseTracker};
use crate::store::RouteRecord;

/// One line of either trace format.
#[derive(Deserialize)]
#[serde(untagged)]
enum Line {
    /// `hypura run --trace`: a layer's picks for every token of a batch.
    Batch { layer: u32, experts: Vec<Vec<i32>> },
    /// A recorded real model: one token's picks in one layer, at its position.
    Token { layer: u32, experts: Vec<i32> },
}

/// A trace file's records, in order. A `.gz` file is read through gzip.
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<RouteRecord>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut file| file.read_to_end(&mut bytes))
        .with_context(|| format!("reading {}", path.display()))?;
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_string(&mut text)
            .with_context(|| format!("{} is not a readable gzip of text", path.display()))?;
        text
    } else {
        String::from_utf8(bytes).with_context(|| format!("{} is not text", path.display()))?
    };
    parse_trace(&text).with_context(|| format!("reading {}", path.display()))
}

/// The records of a trace's text (either format; blank lines skipped).
pub fn parse_trace(text: &str) -> anyhow::Result<Vec<RouteRecord>> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            let line: Line = serde_json::from_str(line).with_context(|| format!("line {}", number + 1))?;
            Ok(match line {
                Line::Batch { layer, experts } => RouteRecord { layer, experts },
                Line::Token { layer, experts } => RouteRecord { layer, experts: vec![experts] },
            })
        })
        .collect()
}

/// The layers and experts a trace shows: one more than the largest layer and id it names.
pub fn trace_shape(traces: &[Vec<RouteRecord>]) -> (usize, usize) {
    let records = traces.iter().flatten();
    let layers = records.clone().map(|record| record.layer as usize + 1).max().unwrap_or(0);
    let experts = records
        .flat_map(|record| record.experts.iter().flatten())
        .filter_map(|&id| usize::try_from(id).ok())
        .max()
        .map_or(0, |id| id + 1);
    (layers, experts)
}

/// How real a routing is, per layer, then the median over layers (as the recorded real traces
/// are summarised):
/// - `top_tenth_share`: the share of picks taken by the layer's most picked tenth of the experts,
///   counted over every trace together (0.1 for uniform routing; Qwen3-30B-A3B: 0.27);
/// - `next_token_reuse`: the share of a token's picks that the next token picks again (k/E for
///   independent picks; Qwen3-30B-A3B: 0.42);
/// - `lru_quarter_hit`: the hit rate of an LRU cache of a quarter of the layer's experts, each
///   trace replayed cold (Qwen3-30B-A3B: 0.75).
///
/// Only single-token records count (decoded tokens, and every line of a real trace); a trace of
/// prompt batches is read token by token first (`simulate::token_by_token`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RoutingStats {
    pub top_tenth_share: f64,
    pub next_token_reuse: f64,
    pub lru_quarter_hit: f64,
    /// Tokens counted (per layer, the most any layer saw).
    pub tokens: usize,
}

impl RoutingStats {
    /// The statistics of `traces` (one per prompt) of a model with `n_expert` experts a layer;
    /// None where no layer has two tokens.
    pub fn of(traces: &[Vec<RouteRecord>], n_expert: usize) -> Option<RoutingStats> {
        let n_expert = n_expert.max(1);
        // Per layer, per trace, the picks of each token in order.
        let mut by_layer: HashMap<u32, Vec<Vec<Vec<usize>>>> = HashMap::new();
        for (index, trace) in traces.iter().enumerate() {
            for record in trace.iter().filter(|record| record.experts.len() == 1) {
                let picks: Vec<usize> = record.experts[0]
                    .iter()
                    .filter_map(|&id| usize::try_from(id).ok())
                    .filter(|&id| id < n_expert)
                    .collect();
                let layer = by_layer.entry(record.layer).or_default();
                layer.resize(traces.len(), Vec::new());
                layer[index].push(picks);
            }
        }
        let (mut top, mut reuse, mut lru, mut tokens) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for sequences in by_layer.values() {
            let count: usize = sequences.iter().map(Vec::len).sum();
            if count < 2 {
                continue;
            }
            tokens = tokens.max(count);
            let mut uses = vec![0u64; n_expert];
            sequences.iter().flatten().flatten().for_each(|&id| uses[id] += 1);
            uses.sort_unstable_by(|a, b| b.cmp(a));
            let total: u64 = uses.iter().sum();
            let tenth: u64 = uses.iter().take((n_expert / 10).max(1)).sum();
            top.push(tenth as f64 / total.max(1) as f64);
            let (mut again, mut picked) = (0usize, 0usize);
            for pair in sequences.iter().flat_map(|sequence| sequence.windows(2)) {
                again += pair[0].iter().filter(|id| pair[1].contains(id)).count();
                picked += pair[0].len();
            }
            reuse.push(again as f64 / picked.max(1) as f64);
            let (mut hits, mut lookups) = (0usize, 0usize);
            for sequence in sequences {
                let (served, asked) = lru_replay(sequence, (n_expert / 4).max(1));
                hits += served;
                lookups += asked;
            }
            lru.push(hits as f64 / lookups.max(1) as f64);
        }
        (!top.is_empty()).then(|| RoutingStats {
            top_tenth_share: median(&mut top),
            next_token_reuse: median(&mut reuse),
            lru_quarter_hit: median(&mut lru),
            tokens,
        })
    }
}

/// The LRU stack distances of `traces` over every layer's experts (`plan::reuse`), each trace
/// replayed cold, in token order, a token's layers in order: the record a decode of them
/// would leave.
pub fn recorded_depths(traces: &[Vec<RouteRecord>], n_layer: usize, n_expert: usize) -> ReuseDepths {
    let mut depths = ReuseDepths::default();
    for trace in traces {
        let mut tracker = ReuseTracker::new(n_layer, n_expert);
        for record in trace {
            for row in &record.experts {
                let picks: Vec<usize> = row.iter().filter_map(|&id| usize::try_from(id).ok()).collect();
                tracker.record(record.layer as usize, &picks);
            }
        }
        depths.add(tracker.counts());
    }
    depths
}

/// An LRU cache of `capacity` experts replayed cold over one layer's picks: (hits, picks).
fn lru_replay(sequence: &[Vec<usize>], capacity: usize) -> (usize, usize) {
    // Most recent last.
    let mut cache: Vec<usize> = Vec::with_capacity(capacity + 1);
    let (mut hits, mut picks) = (0, 0);
    for token in sequence {
        for &id in token {
            picks += 1;
            if let Some(at) = cache.iter().position(|&cached| cached == id) {
                hits += 1;
                cache.remove(at);
            } else if cache.len() == capacity {
                cache.remove(0);
            }
            cache.push(id);
        }
    }
    (hits, picks)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(layer: u32, experts: &[i32]) -> RouteRecord {
        RouteRecord { layer, experts: vec![experts.to_vec()] }
    }

    fn recorded(prefix: &str) -> Vec<Vec<RouteRecord>> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/routing");
        let mut paths: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.file_name().unwrap().to_string_lossy().starts_with(prefix))
            .collect();
        paths.sort();
        assert_eq!(paths.len(), 10, "ten recorded prompts of {prefix}");
        paths.iter().map(|path| read_trace(path).unwrap()).collect()
    }

    #[test]
    fn the_recorded_real_traces_say_what_their_summary_says() {
        let qwen = RoutingStats::of(&recorded("qwen3-30b-a3b-"), 128).unwrap();
        assert!((qwen.top_tenth_share - 0.27).abs() < 0.01, "{qwen:?}");
        assert!((qwen.next_token_reuse - 0.42).abs() < 0.01, "{qwen:?}");
        assert!((qwen.lru_quarter_hit - 0.75).abs() < 0.01, "{qwen:?}");
        let gpt_oss = RoutingStats::of(&recorded("gpt-oss-20b-"), 32).unwrap();
        assert!((gpt_oss.top_tenth_share - 0.20).abs() < 0.01, "{gpt_oss:?}");
        assert!((gpt_oss.next_token_reuse - 0.44).abs() < 0.01, "{gpt_oss:?}");
        assert!((gpt_oss.lru_quarter_hit - 0.61).abs() < 0.01, "{gpt_oss:?}");
    }

    #[test]
    fn the_planners_real_routing_is_the_recorded_traces_distances() {
        let depths = recorded_depths(&recorded("qwen3-30b-a3b-"), 48, 128);
        let steps = crate::plan::REAL_ROUTING_BELOW.len() as u64 - 1;
        let (below, first) = depths.shares_below(48 * 128, steps);
        println!("REAL_ROUTING_BELOW = {below:.4?}\nREAL_ROUTING_FIRST = {first:.4}");
        assert!((first - crate::plan::REAL_ROUTING_FIRST).abs() < 0.001, "{first}");
        for (share, table) in below.iter().zip(crate::plan::REAL_ROUTING_BELOW) {
            assert!((share - table).abs() < 0.001, "{below:?}");
        }
        // Scaled to another model's units, the table gives the same shares at the same fractions.
        let scaled = ReuseDepths::real_routing(24, 32);
        let quarter = scaled.hit_rate(24.0 * 32.0 / 4.0, 24).unwrap();
        let recorded_quarter = depths.hit_rate(48.0 * 128.0 / 4.0, 48).unwrap();
        assert!((quarter - recorded_quarter).abs() < 0.01, "{quarter} against {recorded_quarter}");
    }

    #[test]
    fn both_trace_formats_read_into_the_same_records() {
        let ours = "{\"layer\": 3, \"experts\": [[1, 2], [4, 5]]}\n\n";
        let recorded = "{\"pos\": 7, \"layer\": 3, \"experts\": [1, 2]}\n";
        assert_eq!(parse_trace(ours).unwrap(), vec![RouteRecord { layer: 3, experts: vec![vec![1, 2], vec![4, 5]] }]);
        assert_eq!(parse_trace(recorded).unwrap(), vec![token(3, &[1, 2])]);
        assert!(parse_trace("{\"layer\": 1}").is_err());
    }

    #[test]
    fn a_gzipped_trace_reads_as_its_text() {
        use std::io::Write as _;
        let dir = std::env::temp_dir().join(format!("hypura-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.jsonl.gz");
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(b"{\"pos\": 0, \"layer\": 1, \"experts\": [5, 6]}\n").unwrap();
        std::fs::write(&path, encoder.finish().unwrap()).unwrap();
        let records = read_trace(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(records, vec![token(1, &[5, 6])]);
        assert_eq!(trace_shape(&[records]), (2, 7));
    }

    #[test]
    fn a_router_stuck_on_its_experts_reuses_them_all_and_a_rotating_one_none() {
        // 40 experts, top 2: the same two every token.
        let stuck: Vec<RouteRecord> = (0..20).map(|_| token(0, &[3, 7])).collect();
        let stats = RoutingStats::of(&[stuck], 40).unwrap();
        assert_eq!(stats.next_token_reuse, 1.0);
        assert_eq!(stats.top_tenth_share, 1.0);
        // Two cold misses in 40 picks.
        assert!((stats.lru_quarter_hit - 38.0 / 40.0).abs() < 1e-9);
        // Every token two new experts, cycling through all 40: nothing reused, an even spread,
        // and a cache of 10 never holds the next pick.
        let rotating: Vec<RouteRecord> = (0..40).map(|step| token(0, &[2 * step % 40, (2 * step + 1) % 40])).collect();
        let stats = RoutingStats::of(&[rotating], 40).unwrap();
        assert_eq!(stats.next_token_reuse, 0.0);
        assert!((stats.top_tenth_share - 0.1).abs() < 1e-9);
        assert_eq!(stats.lru_quarter_hit, 0.0);
    }

    #[test]
    fn prompt_batches_do_not_count_and_the_median_is_over_layers() {
        let batch = RouteRecord { layer: 0, experts: vec![vec![0, 1], vec![0, 1]] };
        let layer0: Vec<RouteRecord> = (0..10).map(|_| token(0, &[0, 1])).collect();
        let layer1: Vec<RouteRecord> = (0..10).map(|step| token(1, &[2 * step, 2 * step + 1])).collect();
        let layer2: Vec<RouteRecord> = (0..10).map(|_| token(2, &[4, 5])).collect();
        let trace = [vec![batch], layer0, layer1, layer2].concat();
        let stats = RoutingStats::of(&[trace], 20).unwrap();
        assert_eq!(stats.next_token_reuse, 1.0);
        assert_eq!(stats.tokens, 10);
    }
}
