//! Invariant 1 for expert-stream: tokens and logits are bit-identical to resident mode with a
//! cache small enough to force misses and evictions; bytes read are exactly the misses' units.
use std::path::Path;
use std::sync::Arc;

use hypura::engine::{Engine, EngineOptions, Prompt, Session};
use hypura::model::Inventory;
use hypura::plan::{self, MachineFacts, Mode, ModeChoice, PlanOptions};
use hypura::store::CachePolicy;

use crate::common;

fn engine(path: &Path, mode: Mode, cache_units: usize, policy: CachePolicy) -> Arc<Engine> {
    engine_with(path, mode, cache_units, policy, false)
}

fn engine_with(path: &Path, mode: Mode, cache_units: usize, policy: CachePolicy, prefetch: bool) -> Arc<Engine> {
    engine_batched(path, mode, cache_units, policy, prefetch, 512)
}

fn engine_batched(
    path: &Path,
    mode: Mode,
    cache_units: usize,
    policy: CachePolicy,
    prefetch: bool,
    n_ubatch: u32,
) -> Arc<Engine> {
    let inventory = Inventory::open(path).unwrap();
    let options = PlanOptions {
        mode: ModeChoice::Forced(mode),
        n_ctx: 512,
        n_ubatch,
        window_layers: Some(2),
        expert_cache_units: Some(cache_units),
        expert_prefetch: Some(prefetch),
        cache_policy: Some(policy),
        ..PlanOptions::default()
    };
    let plan = plan::plan(
        &inventory,
        &MachineFacts { memory_budget_bytes: 8 << 30, disk_bytes_per_sec: None, ..MachineFacts::default() },
        &options,
    )
    .unwrap();
    let engine_options = EngineOptions {
        n_ctx_seq: 512,
        n_ubatch,
        n_threads: Some(1),
        repack: false,
        plan: Some(plan),
        ..EngineOptions::default()
    };
    let engine = Arc::new(Engine::open(path, engine_options).unwrap());
    assert_eq!(engine.mode(), mode);
    engine
}

/// Bytes of one expert of `layer`: its slice of each expert tensor.
fn unit_bytes(inventory: &Inventory, layer: u32) -> u64 {
    inventory
        .expert_tensors()
        .filter(|tensor| tensor.layer == Some(layer))
        .map(|tensor| tensor.experts.unwrap().slice_bytes)
        .sum()
}

#[test]
fn expert_stream_is_bit_identical_to_resident_and_reads_only_misses() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    for preset in ["tiny-moe-8x", "tiny-moe-30b"] {
        let path = common::forge(preset, directory.path());
        let inventory = Inventory::open(&path).unwrap();
        let n_expert = inventory.hparams.n_expert as usize;
        let resident = engine(&path, Mode::Resident, 0, CachePolicy::Lru);
        let prompt = "the king of paris and the queen of the sea walked to the river";
        let reference = common::greedy(&resident, prompt, 20);
        let reference_logits =
            Session::new(resident.clone()).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
        for policy in [CachePolicy::Lru, CachePolicy::Slru] {
            // The smallest cache: one layer's experts, so every layer evicts the previous one's.
            let streaming = engine(&path, Mode::ExpertStream, n_expert, policy);
            let logits = Session::new(streaming.clone()).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
            assert!(logits == reference_logits, "{preset} {policy:?}: logits differ from resident");
            let output = common::greedy(&streaming, prompt, 20);
            assert_eq!(output.tokens, reference.tokens, "{preset} {policy:?}");
            let passes = output.stats.weight_passes();
            let experts = output.stats.experts.expect("expert stats");
            let io = output.stats.io.expect("io stats");
            assert!(
                experts.misses > 0 && io.units_released > 0,
                "{preset} {policy:?}: the cache must miss and evict: {experts:?} {io:?}"
            );
            // One router call per MoE layer per graph (the prompt and each of 20 tokens but the
            // last, which ends the answer without a decode).
            assert_eq!(experts.layer_visits, inventory.hparams.n_layer * u64::from(passes), "{preset}");
            assert_eq!(passes, 20);
            assert_eq!(io.observations, experts.layer_visits);
            // Each miss is read exactly once, and nothing else is.
            assert_eq!(io.units_loaded, experts.misses, "{preset} {policy:?}: {io:?}");
            let expected: u64 = experts
                .misses_by_layer
                .iter()
                .enumerate()
                .map(|(layer, misses)| misses * unit_bytes(&inventory, layer as u32))
                .sum();
            assert_eq!(io.unit_bytes_loaded, expected, "{preset} {policy:?}");
            // Each pick is a hit or a miss: k per token per layer at most.
            let picks = experts.hits + experts.misses;
            assert!(picks <= 21 * inventory.hparams.n_layer * inventory.hparams.n_expert_used * 20, "{picks}");
        }
    }
}

/// A prompt in many batches sweeps every layer's experts again and again through a cache of
/// half of them: each batch after the first finds much of what the cache holds (under LRU,
/// every pick of such a sweep was a miss), and the tokens stay the resident model's.
#[test]
fn a_long_prompts_sweeps_keep_what_the_cache_holds() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-moe-30b", directory.path());
    let inventory = Inventory::open(&path).unwrap();
    let units = (inventory.hparams.n_layer * inventory.hparams.n_expert) as usize;
    let prompt = "the king of paris and the queen of the sea walked to the river ".repeat(8);
    let reference = common::greedy(&engine(&path, Mode::Resident, 0, CachePolicy::Lru), &prompt, 2);
    let streaming = engine_batched(&path, Mode::ExpertStream, units / 2, CachePolicy::Slru, false, 16);
    let output = common::greedy(&streaming, &prompt, 2);
    assert_eq!(output.tokens, reference.tokens);
    let batches = u64::from(output.stats.prompt_eval_count.div_ceil(16));
    assert!(batches >= 4, "{batches} batches");
    let experts = output.stats.experts.expect("expert stats");
    assert!(experts.hits >= (batches - 1) * units as u64 / 4, "{batches} batches: {experts:?}");
}

#[test]
fn expert_ids_from_the_router_are_recorded_in_the_trace() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-moe-8x", directory.path());
    let trace = directory.path().join("trace.jsonl");
    let output = common::hypura_command()
        .args([
            "run",
            path.to_str().unwrap(),
            "--raw",
            "-p",
            "the sea",
            "-n",
            "4",
            "--temperature",
            "0",
            "-t",
            "1",
            "--context",
            "512",
        ])
        .args(["--mode", "expert-stream", "--expert-cache", "8", "--stats", "--trace", trace.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let text = std::fs::read_to_string(&trace).unwrap();
    let records: Vec<hypura::store::RouteRecord> =
        text.lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    // 4 layers × (prompt + 3 decoded tokens: the 4th ends the answer), top-2 of 8 experts per
    // token.
    assert_eq!(records.len(), 4 * 4);
    for record in &records {
        assert!(record.layer < 4);
        for token in &record.experts {
            assert_eq!(token.len(), 2);
            assert!(token.iter().all(|&expert| (0..8).contains(&expert)));
            assert_ne!(token[0], token[1], "top-k ids are distinct");
        }
    }
    assert!(records[0].experts.len() > 1, "the prompt's router call covers every prompt token");
}

#[test]
fn prefetch_changes_no_token() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    // Small per-layer updates to the residual stream, as in real models: the stale gate can
    // only predict where the hidden state drifts slowly from layer to layer.
    let path = common::forge_with("tiny-moe-30b", directory.path(), |spec| spec.residual_scale = 0.3);
    let prompt = "gold and iron and stone";
    let reference = common::greedy(&engine(&path, Mode::Resident, 0, CachePolicy::Lru), prompt, 20);
    let streaming = engine_with(&path, Mode::ExpertStream, 24, CachePolicy::Slru, true);
    let output = common::greedy(&streaming, prompt, 20);
    assert_eq!(output.tokens, reference.tokens);
    let experts = output.stats.experts.unwrap();
    let io = output.stats.io.unwrap();
    assert!(experts.prefetch_issued > 0, "{experts:?}");
    // Reads are the misses plus the prefetches not cancelled, never more; a last mispredicted
    // read already under way may finish after the request's stats were taken.
    let expected = experts.misses + experts.prefetch_issued - experts.prefetch_cancelled;
    let in_flight_at_most = inventory_k(&path);
    assert!(io.units_loaded <= expected && io.units_loaded + in_flight_at_most >= expected, "{experts:?} {io:?}");
    // The stale gate predicts far better than chance (k of E experts per pick).
    let inventory = Inventory::open(&path).unwrap();
    let chance = inventory.hparams.n_expert_used as f64 / inventory.hparams.n_expert as f64;
    let accuracy = experts.prefetch_used as f64 / experts.prefetch_issued as f64;
    eprintln!("stale-gate accuracy {accuracy:.3} (chance {chance:.3}): {experts:?}");
    assert!(accuracy > 2.0 * chance, "accuracy {accuracy:.3}, chance {chance:.3}");
}

/// Experts the router picks per token: the most prefetches one layer can have in flight.
fn inventory_k(path: &Path) -> u64 {
    Inventory::open(path).unwrap().hparams.n_expert_used
}

/// An embedding of a streaming MoE model goes through the same eval hook as a decode (its
/// context carries the hook's cell, which keeps the router's weights node until the stop) and
/// equals the resident model's.
#[test]
fn embeddings_of_a_streaming_moe_equal_resident() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-moe-30b", directory.path());
    let n_expert = Inventory::open(&path).unwrap().hparams.n_expert as usize;
    let embed = |engine: &Arc<Engine>| {
        let mut embedder = hypura::engine::Embedder::new(engine.clone(), 64).unwrap();
        let tokens = embedder.tokenize("the king of paris and the queen of the sea").unwrap();
        embedder.embed(&tokens).unwrap().vector
    };
    let resident = embed(&engine(&path, Mode::Resident, 0, CachePolicy::Lru));
    let streaming = engine(&path, Mode::ExpertStream, n_expert, CachePolicy::Lru);
    let before = streaming.hooked_streaming().expect("a hooked stream").observations();
    let streamed = embed(&streaming);
    assert!(streaming.hooked_streaming().unwrap().observations() > before, "the hook stopped in the embedding");
    assert!(!resident.is_empty() && streamed == resident, "the streaming model's embedding differs");
}
