//! Invariant 2: with the same placement, Hypura's engine gives llama.cpp's tokens and logits.
use std::sync::Arc;

use hypura::bench::peer::PlainLlama;
use hypura::engine::{Control, DoneReason, Engine, EngineOptions, GenerateRequest, Prompt, SamplerParams, Session};

use crate::common;

// One thread each: tests run in parallel on small machines, and ggml threads spin at barriers.
const THREADS: i32 = 1;

fn engine(path: &std::path::Path, repack: bool) -> Arc<Engine> {
    let options = EngineOptions { n_ctx_seq: 512, n_threads: Some(THREADS), repack, ..EngineOptions::default() };
    Arc::new(Engine::open(path, options).unwrap())
}

fn greedy(session: &mut Session, prompt: &str, count: u32) -> hypura::engine::GenerateOutput {
    let request = GenerateRequest {
        max_tokens: Some(count),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Raw(prompt.to_string()))
    };
    session.generate(&request, &mut |_| Control::Continue).unwrap()
}

#[test]
fn gemma_first_32_greedy_tokens_equal_plain_llama_cpp() {
    let _machine = common::shared_machine();
    let path = common::gemma_path();
    let engine = engine(&path, true);
    let mut session = Session::new(engine).unwrap();
    let mut peer = PlainLlama::load(&path, 512, THREADS, true).unwrap();
    for prompt in ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"] {
        // From an empty cache, as llama.cpp starts: with repacked weights a reused prefix
        // (the BOS) would change the shape of the prompt's batch, and with it the logits.
        session.reset();
        let ours = greedy(&mut session, prompt, 32);
        assert_eq!(ours.done_reason, DoneReason::Length);
        let theirs = peer.greedy(&peer.tokenize(prompt).unwrap(), 32).unwrap();
        assert_eq!(ours.tokens, theirs, "prompt {prompt:?}: Hypura {:?}", ours.text);
    }
}

/// The test file is the base (not instruction-tuned) Gemma 3 270M. Its greedy continuation of
/// "The capital of France is" circles ("the capital of the country of France. It is the largest
/// city in France."; llama.cpp gives the same tokens), so the question is put the way a base
/// model answers it.
#[test]
fn gemma_knows_the_capital_of_france() {
    let _machine = common::shared_machine();
    let engine = engine(&common::gemma_path(), true);
    let mut session = Session::new(engine).unwrap();
    let output = greedy(&mut session, "Question: What is the capital of France?\nAnswer: The capital of France is", 8);
    assert!(output.text.contains("Paris"), "{:?}", output.text);
}

#[test]
fn every_tiny_preset_has_llama_cpp_logits() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    for preset in ["tiny-dense-1b", "tiny-dense-8b", "tiny-qwen3", "tiny-moe-8x", "tiny-moe-30b"] {
        let path = common::forge(preset, directory.path());
        for repack in [false, true] {
            let mut session = Session::new(engine(&path, repack)).unwrap();
            let mut peer = PlainLlama::load(&path, 512, THREADS, repack).unwrap();
            let prompt = "the king of paris and the queen of the sea";
            let ours = session.prompt_logits(&Prompt::Raw(prompt.into())).unwrap();
            peer.prefill(&peer.tokenize(prompt).unwrap()).unwrap();
            let theirs = peer.last_logits().unwrap();
            assert_eq!(ours.len(), theirs.len());
            let range = theirs.iter().fold(f32::MIN, |a, &b| a.max(b)) - theirs.iter().fold(f32::MAX, |a, &b| a.min(b));
            let max_difference = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(
                max_difference <= 1e-3 * range,
                "{preset} repack={repack}: max |Δlogit| {max_difference} over range {range}"
            );
            // Same placement, same kernels: in fact bit-identical.
            assert_eq!(ours, theirs, "{preset} repack={repack}");
            // From an empty cache, so both sides batch the prompt the same way.
            session.reset();
            let ours_tokens = greedy(&mut session, prompt, 16).tokens;
            let theirs_tokens = peer.greedy(&peer.tokenize(prompt).unwrap(), 16).unwrap();
            assert_eq!(ours_tokens, theirs_tokens, "{preset} repack={repack}");
        }
    }
}

/// A cancel flag set while a long prompt decodes stops that decode between graph nodes: the
/// answer ends cancelled with no token generated, and the half-filled cache is dropped, so the
/// same prompt afterwards reuses nothing. (Checked only at the next step, the whole prompt
/// would be decoded, one token sampled and the prompt kept for reuse.)
#[test]
fn cancelling_a_long_prompt_stops_its_decode_between_graph_nodes() {
    let _machine = common::shared_machine();
    let path = common::gemma_path();
    let options = EngineOptions {
        n_ctx_seq: 4096,
        n_batch: 2048,
        n_ubatch: 2048,
        n_threads: Some(2),
        ..EngineOptions::default()
    };
    let mut session = Session::new(Arc::new(Engine::open(&path, options).unwrap())).unwrap();
    let text = "The sea was calm and the sky was grey over the harbour that morning. ".repeat(120);
    let tokens = session.tokenize_prompt(&Prompt::Raw(text)).unwrap();
    assert!(tokens.len() > 1500 && tokens.len() < 2048, "{}", tokens.len());
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let setter = {
        let cancel = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    };
    let request = GenerateRequest {
        max_tokens: Some(4),
        sampling: SamplerParams::greedy(),
        cancel: Some(cancel),
        ..GenerateRequest::new(Prompt::Tokens(tokens.clone()))
    };
    let output = session.generate(&request, &mut |_| Control::Continue).unwrap();
    setter.join().unwrap();
    assert_eq!(output.done_reason, DoneReason::Cancelled);
    assert_eq!(output.stats.eval_count, 0, "a token was generated: the prompt's decode ran to its end");
    let again = greedy_tokens(&mut session, tokens, 2);
    assert_eq!(again.stats.reused_prompt_tokens, 0, "the cancelled prompt's cache was kept");
    assert_eq!(again.tokens.len(), 2);
}

fn greedy_tokens(
    session: &mut Session,
    tokens: Vec<hypura::engine::Token>,
    count: u32,
) -> hypura::engine::GenerateOutput {
    let request = GenerateRequest {
        max_tokens: Some(count),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Tokens(tokens))
    };
    session.generate(&request, &mut |_| Control::Continue).unwrap()
}
