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
    // Each prompt's answer, then `/api/ps`.
    let answers = |extra: Vec<String>| -> (Vec<Value>, Value) {
        let mut arguments = vec![model.display().to_string()];
        arguments.extend(common_arguments.clone());
        arguments.extend(extra);
        let server = Server::start(&arguments, directory.path().join("serve.log"));
        let answers = prompts
            .iter()
            .map(|prompt| server.post("/api/generate", &greedy(&model_name(model), prompt, 24)))
            .collect();
        (answers, server.get("/api/ps"))
    };
    let (resident, resident_ps) = answers(strings(&["--mode", "resident"]));
    let budget = streaming_budget(model, mode, context * parallel);
    let (streamed, streamed_ps) = answers(vec![
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
        // The tiers' figures: the disk's bytes a pass (a share of the request's reads) and its
        // rate; expert picks from the host's cache or disk in expert-stream, none without
        // experts; nothing over a GPU's bus on this CPU machine.
        assert!(resident.get("hypura_tiers").is_none(), "{resident}");
        let tiers = &streamed["hypura_tiers"];
        let per_pass = tiers["bytes_per_pass"]["disk"].as_f64().unwrap();
        assert!(per_pass > 0.0 && per_pass <= streamed["hypura_bytes_read"].as_f64().unwrap(), "{tiers}");
        assert!(tiers["bytes_per_sec"]["disk"].as_f64().unwrap() > 0.0, "{tiers}");
        assert_eq!(
            (tiers["bytes_per_pass"]["bus"].as_f64(), tiers["bytes_per_sec"]["bus"].as_f64()),
            (Some(0.0), None)
        );
        let picks = &tiers["expert_picks"];
        let host_and_disk = picks["host"].as_u64().unwrap() + picks["disk"].as_u64().unwrap();
        assert_eq!(picks["gpu"].as_u64(), Some(0), "{tiers}");
        assert_eq!(host_and_disk > 0, mode == Mode::ExpertStream, "{tiers}");
        assert_eq!(streamed["response"], resident["response"], "{prompt:?} in {}", mode.name());
        assert_eq!(streamed["eval_count"], 24);
    }
    // `/api/ps`: the tiers since the load hold every request's.
    assert!(resident_ps["models"][0]["hypura_tiers"].is_null(), "{resident_ps}");
    let since_load = &streamed_ps["models"][0]["hypura_tiers"];
    let sum = |field: &str| {
        streamed.iter().map(|reply| reply["hypura_tiers"]["expert_picks"][field].as_u64().unwrap()).sum::<u64>()
    };
    for tier in ["gpu", "host", "disk"] {
        assert!(since_load["expert_picks"][tier].as_u64().unwrap() >= sum(tier), "{tier}: {since_load}");
    }
    let read: u64 = streamed.iter().map(|reply| reply["hypura_bytes_read"].as_u64().unwrap()).sum();
    assert!(since_load["bytes"]["disk"].as_u64().unwrap() >= read, "{since_load}");
    assert_eq!(since_load["bytes"]["bus"].as_u64(), Some(0), "{since_load}");
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

/// An answer longer than the context goes on past it on Ollama's API, as Ollama's does (`shift`,
/// on by default): the context keeps its first `num_keep` tokens and drops half of the rest,
/// and the model keeps counting where it was, the same in dense-stream as resident (the keys'
/// rotation computes with the streamed weights' hooks in place). `shift: false`, and OpenAI's
/// API, end the answer at the context, `length`, as llama-server does.
#[test]
fn an_answer_past_the_context_shifts_it_and_goes_on() {
    let _machine = common::whole_machine();
    let directory = tempfile::tempdir().unwrap();
    let model = common::smollm_path();
    let name = model_name(&model);
    let context = 256;
    let count = |shift: bool, num_keep: i64| {
        json!({"model": name, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "raw": true, "stream": false, "shift": shift,
            "options": {"temperature": 0, "num_predict": 600, "num_keep": num_keep}})
    };
    let numbers = |answer: &Value| -> Vec<u64> {
        let text = answer["response"].as_str().unwrap();
        text.split(|c: char| !c.is_ascii_digit())
            .filter(|part| !part.is_empty())
            .map(|part| part.parse().unwrap())
            .collect()
    };
    let serve = |extra: &[String]| {
        let mut arguments = vec![model.display().to_string()];
        arguments.extend(strings(&[
            "--context",
            &context.to_string(),
            "--parallel",
            "1",
            "--threads",
            "2",
            "--batch-invariant",
        ]));
        arguments.extend_from_slice(extra);
        Server::start(&arguments, directory.path().join("serve.log"))
    };
    let resident = serve(&strings(&["--mode", "resident"]));
    let mut shifted = Vec::new();
    for num_keep in [4, -1] {
        let answer = resident.post("/api/generate", &count(true, num_keep));
        assert_eq!(
            (answer["done_reason"].as_str(), answer["eval_count"].as_u64()),
            (Some("length"), Some(600)),
            "{answer}"
        );
        assert!(answer["hypura_context_shifts"].as_u64().unwrap() >= 2, "{answer}");
        // With the whole prompt kept the 135M model skips a number after a shift (99, seen
        // here); with four tokens kept it counts on without a gap.
        let mut numbers = numbers(&answer);
        numbers.pop(); // the answer may end inside a number
        let step_ok = |pair: &[u64]| if num_keep == 4 { pair[1] == pair[0] + 1 } else { pair[1] > pair[0] };
        assert!(
            numbers.first() == Some(&11) && numbers.windows(2).all(step_ok) && numbers.len() > 100,
            "num_keep {num_keep}: the count broke where the context shifted: {answer}"
        );
        shifted.push(answer);
    }
    let ended = resident.post("/api/generate", &count(false, 4));
    assert_eq!(ended["done_reason"], "length", "{ended}");
    assert!(ended["eval_count"].as_u64().unwrap() < context && ended.get("hypura_context_shifts").is_none(), "{ended}");
    let openai = resident.post(
        "/v1/completions",
        &json!({"model": name, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 600, "temperature": 0}),
    );
    assert_eq!(openai["choices"][0]["finish_reason"], "length", "{openai}");
    assert!(openai["usage"]["completion_tokens"].as_u64().unwrap() < context, "{openai}");
    drop(resident);

    let budget = streaming_budget(&model, Mode::DenseStream, context as u32);
    let streamed = serve(&["--mode".into(), "dense-stream".into(), "--memory-budget".into(), budget.to_string()]);
    let answer = streamed.post("/api/generate", &count(true, 4));
    assert!(answer["hypura_bytes_read"].as_u64().unwrap() > 0, "dense-stream read nothing: {answer}");
    assert_eq!(answer["response"], shifted[0]["response"], "a shifted answer in dense-stream differs from resident");
}
