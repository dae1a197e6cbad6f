//! Invariant 1 for dense-stream: greedy tokens and logits are bit-identical to resident mode
//! (same kernels: repacking off on both sides), with most FFN layers streamed from disk.
mod common;

use std::path::Path;
use std::sync::Arc;

use hypura::engine::{Control, Engine, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session};
use hypura::model::Inventory;
use hypura::plan::{self, MachineFacts, Mode, ModeChoice, PlanOptions};

const N_CTX: u32 = 512;

/// A budget that holds everything but the FFN layers, plus the window and `pinned` layers.
fn tight_budget(inventory: &Inventory, window: usize, pinned: u64) -> u64 {
    let ffn: Vec<u64> = (0..inventory.hparams.n_layer as u32)
        .map(|layer| inventory.tensors.iter().filter(|tensor| tensor.layer == Some(layer) && tensor.role.is_dense_ffn()).map(|tensor| tensor.bytes).sum())
        .collect();
    let largest = *ffn.iter().max().unwrap();
    let fixed = inventory.tensor_data_bytes() - ffn.iter().sum::<u64>();
    fixed + plan::kv_cache_bytes(inventory, N_CTX) + plan::compute_buffer_bytes(inventory, N_CTX, 512) + largest * (window as u64 + 1 + pinned)
}

fn engines(path: &Path, pinned: u64) -> (Arc<Engine>, Arc<Engine>) {
    let inventory = Inventory::open(path).unwrap();
    let window = 2;
    let facts = MachineFacts { memory_budget_bytes: tight_budget(&inventory, window, pinned), disk_bytes_per_sec: Some(1e9) };
    let options = PlanOptions { mode: ModeChoice::Forced(Mode::DenseStream), n_ctx: N_CTX, n_ubatch: 512, window_layers: window };
    let plan = plan::plan(&inventory, &facts, &options).unwrap();
    let dense = plan.dense.as_ref().unwrap();
    assert_eq!(dense.pinned_layers.len() as u64, pinned, "{}", plan.render());
    let base = EngineOptions { n_ctx: N_CTX, n_threads: Some(1), repack: false, ..EngineOptions::default() };
    let resident = Arc::new(Engine::load(path, base.clone()).unwrap());
    let streaming = Arc::new(Engine::load(path, EngineOptions { plan: Some(plan), ..base }).unwrap());
    assert_eq!(streaming.mode(), Mode::DenseStream);
    (resident, streaming)
}

fn greedy(engine: &Arc<Engine>, prompt: &str, count: u32) -> hypura::engine::GenerateOutput {
    let mut session = Session::new(engine.clone()).unwrap();
    let request = GenerateRequest { max_tokens: Some(count), sampling: SamplerParams::greedy(), ignore_eos: true, ..GenerateRequest::new(Prompt::Raw(prompt.into())) };
    session.generate(&request, &mut |_| Control::Continue).unwrap()
}

/// Bytes of one sweep over the streamed layers, as the store reads them (whole pages).
fn streaming_plan_bytes(engine: &Engine) -> u64 {
    let residency = engine.streaming().unwrap().window.residency().clone();
    residency
        .units()
        .iter()
        .flat_map(|unit| unit.ranges.iter())
        .map(|range| range.end.div_ceil(4096) * 4096 - range.start / 4096 * 4096)
        .sum()
}

fn assert_identical(path: &Path, pinned: u64, prompt: &str) {
    let (resident, streaming) = engines(path, pinned);
    let ours = Session::new(streaming.clone()).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
    let theirs = Session::new(resident.clone()).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
    assert!(ours == theirs, "logits differ between dense-stream and resident");
    let streamed = greedy(&streaming, prompt, 24);
    let reference = greedy(&resident, prompt, 24);
    assert_eq!(streamed.tokens, reference.tokens);
    let io = streamed.stats.io.expect("streaming stats");
    assert!(io.bytes_read > 0, "nothing was streamed: {io:?}");
    // Invariant 5: the hook stops the graph exactly once per layer per evaluated graph (the
    // prompt, then each of the 24 generated tokens), never per node.
    let n_layer = streaming.inventory().hparams.n_layer;
    assert_eq!(io.observations, n_layer * (1 + 24), "{io:?}");
    // Every streamed layer is read once per graph: 25 sweeps, give or take the window that was
    // prefetched before the request (at load) or for the token after it.
    let sweep = streaming_plan_bytes(&streaming);
    assert!((24 * sweep..=26 * sweep).contains(&io.bytes_read), "{} bytes read for a sweep of {sweep}: {io:?}", io.bytes_read);
}

#[test]
fn tiny_dense_stream_is_bit_identical_to_resident() {
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-dense-8b", directory.path());
    assert_identical(&path, 1, "the king of paris and the queen of the sea");
}

#[test]
fn gemma_dense_stream_is_bit_identical_to_resident() {
    assert_identical(&common::gemma_path(), 3, "The capital of France is");
}
