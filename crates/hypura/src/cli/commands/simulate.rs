//! `hypura simulate TRACE --model MODEL`: expert-cache policies compared on a recorded trace.
use anyhow::Context;

use crate::bench::simulate::{render, simulate, token_by_token};
use crate::cli::args::SimulateArgs;
use crate::model::Inventory;
use crate::store::{CachePolicy, RouteRecord};

pub fn run(args: &SimulateArgs) -> anyhow::Result<()> {
    let inventory = Inventory::open(&args.model)?;
    let n_layer = inventory.hparams.n_layer as usize;
    let n_expert = inventory.hparams.n_expert as usize;
    anyhow::ensure!(n_expert > 0, "{} has no experts", args.model.display());
    let text = std::fs::read_to_string(&args.trace).with_context(|| format!("reading {}", args.trace.display()))?;
    let records: Vec<RouteRecord> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(number, line)| {
            serde_json::from_str(line).with_context(|| format!("{} line {}", args.trace.display(), number + 1))
        })
        .collect::<anyhow::Result<_>>()?;
    let records = if args.token_by_token { token_by_token(&records) } else { records };
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
    let results: Vec<_> = capacities
        .iter()
        .flat_map(|&capacity| policies.iter().map(move |&policy| (capacity, policy)))
        .map(|(capacity, policy)| simulate(&records, n_layer, n_expert, policy, capacity))
        .collect();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        println!("{} router calls, {} layers × {} experts", records.len(), n_layer, n_expert);
        print!("{}", render(&results));
    }
    Ok(())
}
