//! `hypura serve` itself, as a process: greedy answers repeat to the bit whether the prompt's
//! prefix was cached and whatever other request shares the batch, and greedy answers in
//! dense-stream and expert-stream equal resident ones.
use std::time::Duration;

use hypura::plan::Mode;
use serde_json::{json, Value};

use crate::common::{self, streaming_budget, Server};

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| item.to_string()).collect()
}

fn greedy(model: &str, prompt: &str, count: u32) -> Value {
    json!({"model": model, "prompt": prompt, "stream": false, "options": {"temperature": 0, "num_predict": count, "seed": 1}})
}

fn model_name(path: &std::path::Path) -> String {
    path.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase()
}

/// Each greedy request three times: first with no cache of its own, then twice with its prefix
/// cached while another request is prefilling and generating in the same batches. The requests
/// come one after another, so later ones meet a KV cache that earlier ones used and freed.
/// With llama.cpp's fastest kernels and one KV buffer for every sequence, the fourth prompt's
/// answer changed on its second round and the fifth's with reference kernels alone.
#[test]
fn a_greedy_answer_repeats_with_its_prefix_cached_and_another_request_in_the_batch() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let gemma = common::gemma_path();
    let mut arguments = vec![gemma.display().to_string()];
    arguments.extend(strings(&["--context", "1024", "--parallel", "4", "--threads", "2", "--batch-invariant"]));
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let model = model_name(&gemma);
    let neighbour = greedy(&model, "List the planets of the solar system, from the closest to the sun to the farthest, with one fact about each of them.", 64);
    let prompts = [
        "Name three colours.",
        "What is two plus two?",
        "Describe a cat.",
        "Write a limerick about a frog.",
        "Why is the sky blue? Explain it to a child.",
    ];
    for prompt in prompts {
        let request = greedy(&model, prompt, 64);
        let first = server.post("/api/generate", &request);
        assert!(first["eval_count"].as_u64().unwrap() > 0, "{first}");
        for round in 1..=2 {
            std::thread::scope(|scope| {
                let answer = scope.spawn(|| server.post("/api/generate", &request));
                // The neighbour arrives while the request decodes, so their tokens share batches.
                std::thread::sleep(Duration::from_millis(50));
                let other = scope.spawn(|| server.post("/api/generate", &neighbour));
                let answer = answer.join().unwrap();
                let other = other.join().unwrap();
                assert!(
                    answer["hypura_prompt_cached"].as_u64().unwrap() > 0,
                    "{prompt:?} round {round}: the prefix was not reused: {answer}"
                );
                assert!(other["eval_count"].as_u64().unwrap() > 0, "{other}");
                assert_eq!(answer["response"], first["response"], "{prompt:?} round {round}: a greedy answer changed with its prefix cached and a neighbour in the batch");
            });
        }
    }
}

/// Greedy text from the server in a streaming mode equals the text from a resident server.
fn streaming_equals_resident(model: &std::path::Path, mode: Mode, prompts: &[&str]) {
    let directory = tempfile::tempdir().unwrap();
    let (context, parallel) = (256, 2);
    let common_arguments = strings(&[
        "--context",
        &context.to_string(),
        "--parallel",
        &parallel.to_string(),
        "--threads",
        "2",
        "--batch-invariant",
    ]);
    let answers = |extra: Vec<String>| -> Vec<Value> {
        let mut arguments = vec![model.display().to_string()];
        arguments.extend(common_arguments.clone());
        arguments.extend(extra);
        let server = Server::start(&arguments, directory.path().join("serve.log"));
        prompts.iter().map(|prompt| server.post("/api/generate", &greedy(&model_name(model), prompt, 24))).collect()
    };
    let resident = answers(strings(&["--mode", "resident"]));
    let budget = streaming_budget(model, mode, context * parallel);
    let streamed = answers(vec![
        "--mode".into(),
        mode.name().into(),
        "--window".into(),
        "2".into(),
        "--memory-budget".into(),
        budget.to_string(),
    ]);
    for ((prompt, resident), streamed) in prompts.iter().zip(&resident).zip(&streamed) {
        assert!(resident.get("hypura_bytes_read").is_none(), "the resident server streamed: {resident}");
        assert!(streamed["hypura_bytes_read"].as_u64().unwrap() > 0, "{} read nothing: {streamed}", mode.name());
        assert_eq!(streamed["response"], resident["response"], "{prompt:?} in {}", mode.name());
        assert_eq!(streamed["eval_count"], 24);
    }
}

#[test]
fn greedy_text_from_the_server_in_dense_stream_equals_resident() {
    let _machine = common::whole_machine();
    streaming_equals_resident(
        &common::gemma_path(),
        Mode::DenseStream,
        &["The capital of France is", "Write a haiku about the sea."],
    );
}

#[test]
fn greedy_text_from_the_server_in_expert_stream_equals_resident() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge("tiny-moe-8x", directory.path());
    streaming_equals_resident(&model, Mode::ExpertStream, &["the king of paris", "once upon a time"]);
}
