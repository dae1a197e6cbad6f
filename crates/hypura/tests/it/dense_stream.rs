//! Invariant 1 for dense-stream: greedy tokens and logits are bit-identical to resident mode
//! (same kernels: repacking off on both sides), with most FFN layers streamed from disk.
use std::path::Path;
use std::sync::Arc;

use hypura::engine::{Control, Engine, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session};
use hypura::model::Inventory;
use hypura::plan::{self, KvTypes, MachineFacts, Mode, ModeChoice, PlanOptions};
use hypura_gguf::GgmlType;

use crate::common;

const N_CTX: u32 = 512;

/// A budget that holds everything but the FFN layers, plus the window and `pinned` layers.
fn tight_budget(inventory: &Inventory, window: usize, pinned: u64, kv: KvTypes) -> u64 {
    let ffn: Vec<u64> = (0..inventory.hparams.n_layer as u32)
        .map(|layer| {
            inventory
                .tensors
                .iter()
                .filter(|tensor| tensor.layer == Some(layer) && tensor.role.is_dense_ffn())
                .map(|tensor| tensor.bytes)
                .sum()
        })
        .collect();
    let largest = *ffn.iter().max().unwrap();
    let fixed = inventory.tensor_data_bytes() - ffn.iter().sum::<u64>();
    fixed
        + plan::kv_cache_bytes(inventory, N_CTX, kv)
        + plan::compute_buffer_bytes(inventory, N_CTX, 512)
        + largest * (window as u64 + 1 + pinned)
}

fn engines(path: &Path, pinned: u64, kv: KvTypes) -> (Arc<Engine>, Arc<Engine>) {
    let inventory = Inventory::open(path).unwrap();
    let window = 2;
    let facts = MachineFacts {
        memory_budget_bytes: tight_budget(&inventory, window, pinned, kv),
        disk_bytes_per_sec: Some(1e9),
        ..MachineFacts::default()
    };
    let options = PlanOptions {
        mode: ModeChoice::Forced(Mode::DenseStream),
        n_ctx: N_CTX,
        n_ubatch: 512,
        window_layers: Some(window),
        kv,
        ..PlanOptions::default()
    };
    let plan = plan::plan(&inventory, &facts, &options).unwrap();
    let dense = plan.dense.as_ref().unwrap();
    assert_eq!(dense.pinned_layers.len() as u64, pinned, "{}", plan.render());
    let base = EngineOptions { n_ctx_seq: N_CTX, n_threads: Some(1), repack: false, kv, ..EngineOptions::default() };
    let resident = Arc::new(Engine::open(path, base.clone()).unwrap());
    let streaming = Arc::new(Engine::open(path, EngineOptions { plan: Some(plan), ..base }).unwrap());
    assert_eq!(streaming.mode(), Mode::DenseStream);
    (resident, streaming)
}

/// Bytes of one sweep over the streamed layers, as the store reads them (whole pages).
fn streaming_plan_bytes(engine: &Engine) -> u64 {
    let residency = engine.streaming().unwrap().driver.residency().clone();
    residency
        .units()
        .iter()
        .flat_map(|unit| unit.ranges.iter())
        .map(|range| range.end.div_ceil(4096) * 4096 - range.start / 4096 * 4096)
        .sum()
}

fn assert_identical(path: &Path, pinned: u64, prompt: &str, kv: KvTypes) {
    let (resident, streaming) = engines(path, pinned, kv);
    let ours = Session::new(streaming.clone()).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
    let theirs = Session::new(resident.clone()).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
    assert!(ours == theirs, "logits differ between dense-stream and resident");
    let streamed = common::greedy(&streaming, prompt, 24);
    let reference = common::greedy(&resident, prompt, 24);
    assert_eq!(streamed.tokens, reference.tokens);
    let io = streamed.stats.io.expect("streaming stats");
    assert!(io.bytes_read > 0, "nothing was streamed: {io:?}");
    // Invariant 5: the hook stops the graph exactly once per layer per evaluated graph (the
    // prompt, then each generated token but the last, which ends the answer undecoded), never
    // per node.
    let n_layer = streaming.inventory().hparams.n_layer;
    assert_eq!(u64::from(streamed.stats.weight_passes()), 1 + 23);
    assert_eq!(io.observations, n_layer * (1 + 23), "{io:?}");
    // Every streamed layer is read once per graph: 24 sweeps, give or take the window that was
    // prefetched before the request (at load) or for the token after it.
    let sweep = streaming_plan_bytes(&streaming);
    assert!(
        (23 * sweep..=25 * sweep).contains(&io.bytes_read),
        "{} bytes read for a sweep of {sweep}: {io:?}",
        io.bytes_read
    );
}

#[test]
fn tiny_dense_stream_is_bit_identical_to_resident() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-dense-8b", directory.path());
    assert_identical(&path, 1, "the king of paris and the queen of the sea", KvTypes::default());
}

/// With a quantized KV cache (`--cache-type-k q8_0 --cache-type-v q4_0`) streaming still gives
/// resident's bits at the same types, and those bits are not f16's: the types reached llama.cpp.
#[test]
fn a_quantized_kv_cache_streams_with_the_same_bits() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-dense-8b", directory.path());
    let prompt = "the king of paris and the queen of the sea";
    let quantized = KvTypes { k: GgmlType::Q8_0, v: GgmlType::Q4_0 };
    assert_identical(&path, 1, prompt, quantized);
    let logits = |kv| {
        let (resident, _) = engines(&path, 1, kv);
        Session::new(resident).unwrap().prompt_logits(&Prompt::Raw(prompt.into())).unwrap()
    };
    assert!(logits(quantized) != logits(KvTypes::default()), "a q8_0/q4_0 cache gave f16's logits");
}

#[test]
fn gemma_dense_stream_is_bit_identical_to_resident() {
    let _machine = common::shared_machine();
    assert_identical(&common::gemma_path(), 3, "The capital of France is", KvTypes::default());
}

/// A file truncated after the engine loaded (a disk read error in effect) gives a clear error
/// for the request, never tokens computed on missing weights; the plan refuses budgets that
/// cannot hold the non-streamed part.
#[test]
fn a_read_failure_fails_the_request_clearly() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-dense-8b", directory.path());
    let (_, streaming) = engines(&path, 0, KvTypes::default());
    let inventory = streaming.inventory();
    // Cut the file inside the last streamed layer's FFN.
    let last = inventory
        .tensors
        .iter()
        .filter(|tensor| tensor.role.is_dense_ffn())
        .map(|tensor| tensor.file_offset)
        .max()
        .unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(last + 100).unwrap();
    let mut session = Session::new(streaming.clone()).unwrap();
    let request = GenerateRequest {
        max_tokens: Some(4),
        sampling: SamplerParams::greedy(),
        ..GenerateRequest::new(Prompt::Raw("the sea".into()))
    };
    let mut seen = String::new();
    let error = session.generate(&request, &mut |text| {
        seen.push_str(text);
        Control::Continue
    });
    let message = error.expect_err("a truncated model must fail").to_string();
    assert!(message.contains("short read") || message.contains("end of file"), "{message}");
    assert!(seen.is_empty(), "no text may come from a failed graph: {seen:?}");
}

#[test]
fn too_small_a_budget_is_refused_at_plan_time() {
    let _machine = common::shared_machine();
    let inventory = Inventory::open(&common::gemma_path()).unwrap();
    let facts = MachineFacts { memory_budget_bytes: 64 << 20, disk_bytes_per_sec: None, ..MachineFacts::default() };
    let error = plan::plan(&inventory, &facts, &PlanOptions::default()).unwrap_err();
    assert!(matches!(error, plan::PlanError::BudgetTooSmall { .. }), "{error}");
    let output = common::hypura_command()
        .args(["inspect", common::gemma_path().to_str().unwrap(), "--memory-budget", "64MiB"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("64.0 MiB is too small") && stderr.contains("resident weights"), "{stderr}");
}

/// Invariant 3: a dense-stream run's peak resident memory stays under its budget + 5%, the load
/// included: Qwen2.5-Coder-0.5B's 89 MiB token embedding, left in the file's pages, passes
/// through the load's sink, which took the peak to 344.5 MiB of a 300 MiB budget before the load
/// gave the sink's pages back as it went.
#[test]
fn peak_memory_stays_under_the_budget() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let tiny = common::forge("tiny-dense-8b", directory.path());
    let gemma = common::gemma_path();
    let qwen = common::chat_model_path();
    for (path, budget) in [(tiny.as_path(), "140MiB"), (gemma.as_path(), "850MiB"), (qwen.as_path(), "300MiB")] {
        let output = common::hypura_command()
            .args([
                "run",
                path.to_str().unwrap(),
                "--raw",
                "-p",
                "the sea and the king",
                "-n",
                "8",
                "--temperature",
                "0",
            ])
            .args(["--mode", "dense-stream", "--memory-budget", budget, "--context", "512", "--stats", "-t", "1"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        assert!(stderr.contains("mode dense-stream") && stderr.contains("streamed"), "{stderr}");
        let peak = common::peak_rss(&stderr);
        let budget_bytes = hypura::cli::settings::parse_bytes(budget).unwrap();
        assert!(
            peak as f64 <= budget_bytes as f64 * 1.05,
            "{}: peak {peak} bytes over the budget {budget_bytes}: {stderr}",
            path.display()
        );
        assert!(stderr.contains("io "), "{stderr}");
    }
}
