//! `hypura serve` as a process on a free loopback port, driven by the real `ollama` and `openai`
//! Python clients (installed from PyPI by `scripts/test`): Gemma 3 270M and a forged tiny MoE
//! resident, a forged dense model streaming its FFN layers from disk (dense-stream), the tiny
//! MoE streaming its experts (expert-stream), and a bounded load test. Each test fails when its
//! Python script fails.
use std::process::Command;

use hypura::plan::Mode;

use crate::common::{self, streaming_budget, Server};

fn require_clients() {
    let status = Command::new("python3")
        .args(["-c", "import ollama, openai, httpx"])
        .status()
        .expect("python3 is needed for the client tests");
    assert!(status.success(), "the Python clients are missing: pip install ollama openai (scripts/test does)");
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| item.to_string()).collect()
}

#[test]
fn python_clients_against_gemma_and_tiny_moe() {
    let _machine = common::whole_machine();
    require_clients();
    let directory = tempfile::tempdir().unwrap();
    let moe = common::forge("tiny-moe-8x", directory.path());
    let gemma = common::gemma_path();
    // Without repacking, a row's arithmetic does not depend on the batch it is in, so a seeded
    // request gives the same answer whether or not its prompt prefix was cached.
    let mut arguments = vec![gemma.display().to_string(), moe.display().to_string()];
    arguments.extend(strings(&[
        "--context",
        "1024",
        "--parallel",
        "4",
        "--mode",
        "resident",
        "--no-repack",
        "--threads",
        "2",
    ]));
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let stem = gemma.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let output = server.python("clients.py", &[stem, "tiny-moe-8x".into()]);
    assert!(
        output.contains("ollama client: ok")
            && output.contains("openai client: ok")
            && output.contains("tiny-moe-8x: ok"),
        "{output}"
    );
}

/// Serve one forged model in a streaming mode, through the plan, and drive it with the clients.
fn streaming_model(preset: &str, mode: Mode) {
    let _machine = common::whole_machine();
    require_clients();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge(preset, directory.path());
    let (context, parallel) = (256, 4);
    // `serve` plans KV cache for every parallel sequence.
    let budget = streaming_budget(&model, mode, context * parallel);
    let mut arguments = vec![model.display().to_string()];
    arguments.extend(strings(&[
        "--context",
        &context.to_string(),
        "--parallel",
        &parallel.to_string(),
        "--mode",
        mode.name(),
        "--window",
        "2",
    ]));
    arguments.extend(["--memory-budget".to_string(), budget.to_string(), "--threads".into(), "2".into()]);
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let output = server.python("clients.py", &["--extra-only".into(), preset.into()]);
    assert!(output.contains(&format!("{preset}: ok")), "{output}");
    let ps = server.python("ps.py", &[]);
    assert!(ps.contains(&format!("\"hypura_mode\": \"{}\"", mode.name())), "{ps}");
}

#[test]
fn python_clients_against_a_dense_stream_model() {
    streaming_model("tiny-dense-8b", Mode::DenseStream);
}

#[test]
fn python_clients_against_tiny_moe_in_expert_stream() {
    streaming_model("tiny-moe-8x", Mode::ExpertStream);
}

/// 4 clients for `HYPURA_LOAD_SECONDS` (default 10): no request lost, no error, memory flat.
#[test]
fn load_four_clients_on_loopback() {
    let _machine = common::whole_machine();
    require_clients();
    let seconds: u64 = std::env::var("HYPURA_LOAD_SECONDS").ok().and_then(|text| text.parse().ok()).unwrap_or(10);
    let directory = tempfile::tempdir().unwrap();
    let gemma = common::gemma_path();
    let mut arguments = vec![gemma.display().to_string()];
    arguments.extend(strings(&["--context", "1024", "--parallel", "4", "--mode", "resident", "--threads", "2"]));
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let stem = gemma.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let summary = server.python("load.py", &[stem, seconds.to_string(), "4".into(), server.child.id().to_string()]);
    eprintln!("load test: {summary}");
}

/// A chat longer than the context, as Ollama handles one: the system prompt and the newest
/// messages are kept and the reply says how many were dropped; `truncate: false` is refused as
/// too long.
#[test]
fn a_chat_longer_than_the_context_keeps_its_newest_messages() {
    let _machine = common::shared_machine();
    require_clients();
    let directory = tempfile::tempdir().unwrap();
    let model = common::smollm_path();
    let mut arguments = vec![model.display().to_string()];
    // Batch-invariant: the streamed request reuses the first one's prefix and must answer the same.
    arguments.extend(strings(&["--context", "512", "--parallel", "1", "--threads", "1", "--batch-invariant"]));
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let stem = model.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let output = server.python("long_chat.py", &[stem, "512".into()]);
    assert!(output.contains("dropped") && output.contains("truncate false"), "{output}");
    assert!(server.log_text().contains("oldest messages were left out"), "{}", server.log_text());
}

/// `serve --api-key-file`: the `ollama` and `openai` Python clients with the key are answered,
/// without it or with another they get 401, and the server's log never holds the key.
#[test]
fn python_clients_with_the_servers_api_key() {
    let _machine = common::shared_machine();
    require_clients();
    let directory = tempfile::tempdir().unwrap();
    let model = common::smollm_path();
    let key = "hypura-test-key-5f1c";
    let key_file = directory.path().join("api-key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let mut arguments = vec![model.display().to_string()];
    arguments.extend(strings(&["--context", "512", "--parallel", "1", "--threads", "1", "--api-key-file"]));
    arguments.push(key_file.display().to_string());
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let stem = model.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let output = server.python("api_key.py", &[stem, key.into()]);
    assert!(output.contains("401 without it"), "{output}");
    let log = server.log_text();
    assert!(log.contains("401 for POST /api/chat: no API key"), "{log}");
    assert!(log.contains("a wrong API key") && !log.contains(key), "{log}");
}
