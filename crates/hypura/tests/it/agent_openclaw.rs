//! A real agent against `hypura serve`: OpenClaw (npm `openclaw` 2026.9.6, installed with its
//! Node by `scripts/tools/install-openclaw`, which `scripts/test` runs) with its tools on, pointed at
//! Hypura as an Ollama provider, on Qwen2.5-Coder-0.5B-Instruct. The agent is asked to read
//! `notes.txt` in its workspace with the `read` tool and reply with the secret word in it: the
//! turn must exit 0, the server's log must show the `read` call and the tool result coming
//! back, and the reply must hold the word. Once at the server's defaults (resident), once
//! under a memory budget that makes the model stream its FFN layers.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::common::{self, Server};

/// The Node directory and the openclaw binary `scripts/tools/install-openclaw` installed.
fn openclaw() -> (PathBuf, PathBuf) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tools/install-openclaw");
    let output = Command::new(&script).output().expect("run scripts/tools/install-openclaw");
    assert!(
        output.status.success(),
        "scripts/tools/install-openclaw failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let mut lines = stdout.lines();
    let node = PathBuf::from(lines.next().expect("the Node directory"));
    let binary = PathBuf::from(lines.next().expect("the openclaw binary"));
    (node, binary)
}

/// One agent turn against a server started with `extra` arguments, OpenClaw's provider given
/// `api_key` (the server's `--api-key`, where it has one); returns the reply and the server's
/// log.
fn agent_turn(extra: &[&str], api_key: &str) -> (String, String) {
    let (node, binary) = openclaw();
    let directory = tempfile::tempdir().unwrap();
    let qwen = common::chat_model_path();
    let name = qwen.file_stem().unwrap().to_string_lossy().into_owned();
    let mut arguments = vec![qwen.display().to_string()];
    arguments.extend(extra.iter().map(|argument| argument.to_string()));
    let server = Server::start(&arguments, directory.path().join("serve.log"));

    let workspace = directory.path().join("workspace");
    std::fs::create_dir_all(&workspace).unwrap();
    // A word the model cannot guess: it must come from the file.
    let secret = format!("heron{}", std::process::id() % 9000 + 1000);
    std::fs::write(workspace.join("notes.txt"), format!("Notes for the agent.\nThe secret word is {secret}.\n"))
        .unwrap();
    let config = serde_json::json!({
        "models": {"providers": {"ollama": {
            "baseUrl": server.base, "apiKey": api_key, "api": "ollama",
            "models": [{"id": name, "name": name, "input": ["text"], "contextWindow": 16384, "maxTokens": 256, "params": {"temperature": 0, "num_predict": 256}}],
        }}},
        // Changes from OpenClaw's defaults, all for a 0.5B model: greedy sampling, so that the
        // turn is the same every run, and at most 256 tokens an answer (a small model that
        // repeats itself otherwise runs to the end of the context); no first-run bootstrap
        // (BOOTSTRAP.md asks a new agent to introduce itself and choose a name and an avatar:
        // 15,000 characters this model then follows instead of the task); and the one tool the
        // task needs. With OpenClaw's twelve default tools it does call `read` and gets the
        // result, but then calls it again instead of answering.
        "agents": {"defaults": {"workspace": workspace, "model": {"primary": format!("ollama/{name}")}, "skipBootstrap": true}},
        "tools": {"allow": ["read"]},
    });
    let config_path = directory.path().join("openclaw.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let home = directory.path().join("home");
    let state = directory.path().join("state");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&state).unwrap();

    let started = Instant::now();
    let path = format!("{}:{}", node.display(), std::env::var("PATH").unwrap_or_default());
    let output = Command::new(&binary)
        .args([
            "agent",
            "--local",
            "--timeout",
            "2400",
            "-m",
            "Use the read tool to read notes.txt. Then tell me the secret word from that file.",
        ])
        .env("PATH", path)
        .env("HOME", &home)
        .env("OPENCLAW_CONFIG_PATH", &config_path)
        .env("OPENCLAW_STATE_DIR", &state)
        .current_dir(&workspace)
        .output()
        .expect("run openclaw");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let log = server.log_text();
    eprintln!("openclaw agent turn: {:.0} s", started.elapsed().as_secs_f64());
    assert!(
        output.status.success(),
        "openclaw exited with {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- server log\n{log}",
        output.status
    );
    assert!(
        log.contains("tool call read("),
        "the server's log shows no read call\n--- stdout\n{stdout}\n--- server log\n{log}"
    );
    assert!(
        log.contains("tool result for read"),
        "the server's log shows no read result coming back\n--- stdout\n{stdout}\n--- server log\n{log}"
    );
    assert!(
        stdout.contains(&secret),
        "the reply does not hold {secret}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- server log\n{log}"
    );
    (stdout, log)
}

#[test]
fn openclaw_reads_a_file_with_its_tool_at_the_server_defaults() {
    let _machine = common::whole_machine();
    agent_turn(&[], "ollama-local");
}

#[test]
fn openclaw_reads_a_file_while_the_model_streams_behind_an_api_key() {
    let _machine = common::whole_machine();
    // One sequence, and a budget below what the resident model needs with a 16K context (the
    // default context under this budget, and OpenClaw's context window): the plan streams FFN
    // layers. The server wants a key, which OpenClaw's provider setting sends as a bearer token.
    let key = "hypura-openclaw-key-81d2";
    let (_, log) = agent_turn(&["--parallel", "1", "--memory-budget", "900MiB", "--api-key", key], key);
    assert!(log.contains("dense-stream mode"), "the model did not stream:\n{log}");
    assert!(!log.contains("401 for"), "OpenClaw was refused:\n{log}");
}
