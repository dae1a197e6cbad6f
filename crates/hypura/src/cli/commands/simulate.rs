//! `hypura simulate TRACE...`: the routing's statistics, and expert-cache policies compared on
//! the recorded picks.
use anyhow::Context;

use crate::bench::routing::{read_trace, trace_shape, RoutingStats};
use crate::bench::simulate::{render, simulate, token_by_token, SimulationResult};
use crate::cli::args::SimulateArgs;
use crate::model::Inventory;
use crate::store::CachePolicy;

pub fn run(args: &SimulateArgs) -> anyhow::Result<()> {
    let traces = args.trace.iter().map(|path| read_trace(path)).collect::<anyhow::Result<Vec<_>>>()?;
    let traces: Vec<_> =
        if args.token_by_token { traces.iter().map(|trace| token_by_token(trace)).collect() } else { traces };
    let (n_layer, n_expert) = match &args.model {
        Some(model) => {
            let inventory = Inventory::open(model)?;
            (inventory.hparams.n_layer as usize, inventory.hparams.n_expert as usize)
        }
        None => {
            let (layers, experts) = trace_shape(&traces);
            (layers, args.n_expert.unwrap_or(experts).max(experts))
        }
    };
    anyhow::ensure!(n_expert > 0 && n_layer > 0, "the traces name no expert");
    let policies: Vec<CachePolicy> = args
        .policy
        .iter()
        .map(|name| CachePolicy::parse(name).with_context(|| format!("unknown policy {name:?}: use lru or slru")))
        .collect::<anyhow::Result<_>>()?;
    let total = n_layer * n_expert;
    let capacities = if args.capacity.is_empty() {
        (0..5).map(|step| n_expert + (total / 2 - n_expert.min(total / 2)) * step / 4).collect()
    } else {
        args.capacity.clone()
    };
    // Each trace replayed cold; the hits and misses of one size and policy summed over them.
    let results: Vec<SimulationResult> = capacities
        .iter()
        .flat_map(|&capacity| policies.iter().map(move |&policy| (capacity, policy)))
        .map(|(capacity, policy)| {
            let runs: Vec<_> =
                traces.iter().map(|trace| simulate(trace, n_layer, n_expert, policy, capacity)).collect();
            let (hits, misses) = runs.iter().fold((0, 0), |(hits, misses), run| (hits + run.hits, misses + run.misses));
            SimulationResult {
                policy,
                capacity_units: runs.first().map_or(capacity, |run| run.capacity_units),
                hits,
                misses,
                hit_rate: hits as f64 / (hits + misses).max(1) as f64,
            }
        })
        .collect();
    let stats = RoutingStats::of(&traces, n_expert);
    if args.json {
        let json = serde_json::json!({ "routing": stats, "caches": results });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    let records: usize = traces.iter().map(Vec::len).sum();
    println!("{records} router calls in {} traces, {n_layer} layers × {n_expert} experts", traces.len());
    match stats {
        Some(stats) => println!(
            "routing, the median layer over {} decoded tokens: top tenth of the experts take {:.2} of picks, the next token picks {:.2} of a token's again, an LRU of a quarter of the experts hits {:.2} (real models, Qwen3-30B-A3B: 0.27, 0.42, 0.75)",
            stats.tokens, stats.top_tenth_share, stats.next_token_reuse, stats.lru_quarter_hit
        ),
        None => println!("routing: no decoded tokens (prompt batches only; --token-by-token reads them as decoded)"),
    }
    print!("{}", render(&results));
    Ok(())
}
