//! The GPU expert pool's policy at a real model's size, computed on this machine's CPU: the plan
//! for a GPU budget (with or without the model's recorded routing), then a greedy decode after a
//! prompt, and what the pool's slots served of the decode's picks. Without a GPU, llama.cpp
//! computes the "GPU" layers and the pool's slots on the CPU with the same code, so the slots'
//! hits, uploads and stops are the GPU's; only the speed is not.
//!
//! `cargo run --release --example pool_policy -- MODEL GPU_GIB [--record] [--words N] [--tokens N]`
//!
//! `--record` plans with the routing earlier runs of MODEL recorded on this machine (as `run`
//! and `bench` do); without it, as a first run. `--words` (default 50) sets the prompt's length
//! in words, `--tokens` (default 256) the decode's.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use hypura::engine::{Control, Engine, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session};
use hypura::model::Inventory;
use hypura::plan::{self, MachineFacts, ModeChoice, PlanOptions};
use hypura::store::StopSplit;

const N_CTX: u32 = 4096;

fn main() -> anyhow::Result<()> {
    let mut arguments = std::env::args().skip(1);
    let usage = "usage: pool_policy MODEL GPU_GIB [--record] [--words N] [--tokens N]";
    let path = PathBuf::from(arguments.next().context(usage)?);
    let gpu_gib: u64 = arguments.next().context(usage)?.parse().context("GPU_GIB")?;
    let (mut record, mut words, mut tokens) = (false, 50usize, 256u32);
    while let Some(argument) = arguments.next() {
        match argument.as_str() {
            "--record" => record = true,
            "--words" => words = arguments.next().context(usage)?.parse()?,
            "--tokens" => tokens = arguments.next().context(usage)?.parse()?,
            _ => anyhow::bail!(usage),
        }
    }
    let inventory = Inventory::open(&path)?;
    let routing = hypura::hw::ModelRecords::new(hypura::hw::default_cache_dir()).load(&path).routing;
    anyhow::ensure!(!record || routing.is_some(), "no recorded routing for {}: `hypura run` it first", path.display());
    let facts = MachineFacts {
        memory_budget_bytes: 8 << 30,
        disk_bytes_per_sec: Some(1.3e9),
        gpu_budget_bytes: gpu_gib << 30,
        gpu_runtime_bytes: 384 << 20,
        expert_reuse: routing.filter(|_| record),
        ..MachineFacts::default()
    };
    let options = PlanOptions { mode: ModeChoice::Auto, n_ctx: N_CTX, n_ubatch: 1024, ..PlanOptions::default() };
    let planned = plan::plan(&inventory, &facts, &options)?;
    for line in planned.render().lines().filter(|line| line.starts_with("gpu") || line.starts_with("expert pool")) {
        println!("{line}");
    }
    let pooled_layers =
        planned.gpu.as_ref().and_then(|gpu| gpu.expert_pool.as_ref()).map_or(0, |pool| pool.layers.len());
    let engine_options =
        EngineOptions { n_ctx_seq: N_CTX, n_threads: Some(2), plan: Some(planned), ..EngineOptions::default() };
    let engine = Arc::new(Engine::open(&path, engine_options)?);
    let experts = engine
        .streaming()
        .and_then(|streaming| streaming.driver.experts.clone())
        .context("the plan streams no experts: no pool to watch")?;
    let vocabulary = ["the", "king", "of", "paris", "walked", "to", "river", "and", "sea", "ships", "sail", "north"];
    let prompt: Vec<&str> = (0..words).map(|index| vocabulary[(index * 7 + index / 5) % vocabulary.len()]).collect();
    let request = GenerateRequest {
        max_tokens: Some(tokens),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Raw(prompt.join(" ")))
    };
    let mut session = Session::new(engine.clone())?;
    let mut at_first_token = None;
    let output = session.generate(&request, &mut |_| {
        at_first_token.get_or_insert_with(|| experts.snapshot());
        Control::Continue
    })?;
    let decode = experts.snapshot() - at_first_token.context("no token generated")?;
    let (device, generated) = (decode.device, output.stats.eval_count.max(1) as f64);
    let stop = StopSplit::of(&device, generated);
    println!(
        "prompt {} tokens; decode {} tokens: {pooled_layers} stops a token; slot hits {}, uploads {} ({:.3}% of the slots' picks), {:.2} MB uploaded a token; host cache misses {}; the host's work {:.1} µs a stop, {:.1} µs of it moving bytes",
        output.stats.prompt_eval_count,
        output.stats.eval_count,
        device.hits,
        device.uploads,
        100.0 * device.uploads as f64 / (device.hits + device.uploads).max(1) as f64,
        device.upload_bytes as f64 / 1e6 / generated,
        decode.misses,
        1e6 * stop.host_seconds,
        1e6 * stop.transfer_seconds,
    );
    println!(
        "a stop: the ids read and written {:.1} µs; the callback's questions about the {:.0} nodes since the stop before {:.1} µs; its segment launched, computed and synchronised {:.1} µs",
        1e6 * stop.ids_seconds,
        stop.asked_nodes,
        1e6 * stop.asks_seconds,
        1e6 * stop.segment_seconds,
    );
    Ok(())
}
