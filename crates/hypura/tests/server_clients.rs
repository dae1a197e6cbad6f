//! `hypura serve` as a process on a free loopback port, driven by the real `ollama` and `openai`
//! Python clients (installed from PyPI by `scripts/test`): Gemma 3 270M and a forged tiny MoE
//! resident, a forged dense model streaming its FFN layers from disk (dense-stream), the tiny
//! MoE streaming its experts (expert-stream), and a bounded load test. Each test fails when its
//! Python script fails.
mod common;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hypura::model::Inventory;
use hypura::plan::{self, MachineFacts, Mode, ModeChoice, PlanError, PlanOptions};

/// Tests here each start a server; one at a time keeps two cores from being shared four ways.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn python_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python")
}

fn require_clients() {
    let status = Command::new("python3").args(["-c", "import ollama, openai, httpx"]).status().expect("python3 is needed for the client tests");
    assert!(status.success(), "the Python clients are missing: pip install ollama openai (scripts/test does)");
}

/// A running `hypura serve`, killed on drop.
struct Server {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Server {
    fn start(arguments: &[String], log: PathBuf) -> Server {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log_file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_hypura"))
            .arg("serve")
            .args(arguments)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .env("OLLAMA_MODELS", "/nonexistent")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap();
        let mut server = Server { child, base: format!("http://127.0.0.1:{port}"), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("hypura serve exited with {status}: {}", server.log_text());
            }
            assert!(Instant::now() < deadline, "hypura serve did not start: {}", server.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn log_text(&self) -> String {
        let mut text = String::new();
        let _ = std::fs::File::open(&self.log).and_then(|mut file| file.read_to_string(&mut text));
        text
    }

    fn python(&self, script: &str, arguments: &[String]) -> String {
        let output = Command::new("python3").arg(python_dir().join(script)).arg(&self.base).args(arguments).output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{script} failed\n--- stdout\n{stdout}\n--- stderr\n{}\n--- server log\n{}",
            String::from_utf8_lossy(&output.stderr),
            self.log_text()
        );
        assert!(self.child_alive(), "the server died: {}", self.log_text());
        stdout
    }

    fn child_alive(&self) -> bool {
        // try_wait needs &mut self; the child's /proc entry says the same (Z: it has exited).
        std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).is_ok_and(|stat| !stat.contains(") Z "))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|item| item.to_string()).collect()
}

#[test]
fn python_clients_against_gemma_and_tiny_moe() {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|poison| poison.into_inner());
    require_clients();
    let directory = tempfile::tempdir().unwrap();
    let moe = common::forge("tiny-moe-8x", directory.path());
    let gemma = common::gemma_path();
    // Without repacking, a row's arithmetic does not depend on the batch it is in, so a seeded
    // request gives the same answer whether or not its prompt prefix was cached.
    let mut arguments = vec![gemma.display().to_string(), moe.display().to_string()];
    arguments.extend(strings(&["--context", "1024", "--parallel", "4", "--mode", "resident", "--no-repack", "--threads", "2"]));
    let server = Server::start(&arguments, directory.path().join("serve.log"));
    let stem = gemma.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase();
    let output = server.python("clients.py", &[stem, "tiny-moe-8x".into()]);
    assert!(output.contains("ollama client: ok") && output.contains("openai client: ok") && output.contains("tiny-moe-8x: ok"), "{output}");
}

/// The smallest budget the planner accepts for `mode`: what it says it needs when given none.
/// Every streamable layer then streams.
fn streaming_budget(path: &Path, mode: Mode, n_ctx: u32) -> u64 {
    let inventory = Inventory::open(path).unwrap();
    let facts = MachineFacts { memory_budget_bytes: 1, disk_bytes_per_sec: Some(1e9), ..MachineFacts::default() };
    let options = PlanOptions { mode: ModeChoice::Forced(mode), n_ctx, n_ubatch: 512, window_layers: Some(2), ..PlanOptions::default() };
    match plan::plan(&inventory, &facts, &options) {
        Err(PlanError::BudgetTooSmall { needed, .. }) => needed + (1 << 20),
        other => panic!("expected the planner to ask for more memory: {other:?}"),
    }
}

/// Serve one forged model in a streaming mode, through the plan, and drive it with the clients.
fn streaming_model(preset: &str, mode: Mode) {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|poison| poison.into_inner());
    require_clients();
    let directory = tempfile::tempdir().unwrap();
    let model = common::forge(preset, directory.path());
    let (context, parallel) = (256, 4);
    // `serve` plans KV cache for every parallel sequence.
    let budget = streaming_budget(&model, mode, context * parallel);
    let mut arguments = vec![model.display().to_string()];
    arguments.extend(strings(&["--context", &context.to_string(), "--parallel", &parallel.to_string(), "--mode", mode.name(), "--window", "2"]));
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
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|poison| poison.into_inner());
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
