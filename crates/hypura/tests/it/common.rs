//! Shared helpers for the integration tests: forged models in a temp dir, the real test models,
//! a `hypura serve` process to drive, and the turns by which tests share the machine.
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use hypura_forge::{preset, write_model};

// Sharing the machine. The tests were once 16 binaries, which cargo ran one after another, each
// with its tests two at a time (libtest's default on CI's two cores), so a test only ever ran
// beside a test of its own file. Five files then kept their tests one at a time with a mutex of
// their own, and so had the machine to themselves: `agent_openclaw` (an agent turn that keeps
// both cores busy for minutes), `real_routing` (converts with every core, then runs llama.cpp
// with two threads whose barriers spin), and `server_clients`, `server_greedy` and
// `server_tools` (each starts `hypura serve` with two threads, driven by Python clients with
// timeouts). In one binary any two tests may meet, so every test takes a turn first, and those
// five files' tests take the whole machine: a reader-writer lock, where they are the writers
// (one at a time, and nothing beside them, as before) and every other test is a reader (two
// at a time, beside any other reader: each uses one or two threads and measures only its own
// processes' memory, as it did beside its own file's tests). A panicking test's turn ends with
// it; the lock's poison only says a test failed, which libtest reports already.
// A new test takes its turn in its first line.
//
// What one process holds is now shared by every test too. No test sets an environment variable
// (child processes get theirs through `Command::env`), changes the working directory or installs
// a tracing subscriber; llama.cpp's backend is initialised once per process behind
// `hypura_sys::Backend::get`'s OnceLock, by whichever test comes first; and the RPC workers a
// test connects to in process stay out of ggml's device registry, so no other test's plan or
// `Backend::devices` sees them.

/// The lock the turns are taken on.
static MACHINE: RwLock<()> = RwLock::new(());

/// A test's turn on the machine, held until the test ends (a value, not a lock guard: no task of
/// an async test takes the lock, so holding the turn across its awaits cannot deadlock).
pub enum Turn {
    Whole { _guard: RwLockWriteGuard<'static, ()> },
    Shared { _guard: RwLockReadGuard<'static, ()> },
}

/// The whole machine: for the tests that used to run one at a time with nothing beside them.
pub fn whole_machine() -> Turn {
    Turn::Whole { _guard: MACHINE.write().unwrap_or_else(PoisonError::into_inner) }
}

/// A share of the machine, beside other shared tests but never beside a whole-machine test.
pub fn shared_machine() -> Turn {
    Turn::Shared { _guard: MACHINE.read().unwrap_or_else(PoisonError::into_inner) }
}

/// The `hypura` binary, with a cache directory of its own (profile, measured compute, bench
/// reports) under cargo's scratch directory for tests. A plan reads the compute time earlier
/// streaming runs of the model measured; a run one test made under the load of others would
/// otherwise steer another test's plan (a 4-token run measured at 0.27 s a token made the
/// remote tier lose to local streaming in a later test).
pub fn hypura_command() -> Command {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "hypura-cache-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut command = Command::new(env!("CARGO_BIN_EXE_hypura"));
    command.env("HYPURA_CACHE_DIR", cache);
    command
}

/// Run `hypura` with `args` to the end (its log off: stderr holds only what the command prints).
pub fn hypura(args: &[&str]) -> std::process::Output {
    hypura_command().args(args).env("HYPURA_LOG", "off").output().expect("run hypura")
}

/// The names of an inventory's tensors that got no role (every architecture's should get one).
pub fn tensors_without_a_role(inventory: &hypura::model::Inventory) -> Vec<&str> {
    inventory
        .tensors
        .iter()
        .filter(|tensor| tensor.role == hypura::model::Role::Other)
        .map(|tensor| tensor.name.as_str())
        .collect()
}

/// Forge `name` into `directory` and return its path.
pub fn forge(name: &str, directory: &Path) -> PathBuf {
    forge_with(name, directory, |_| {})
}

/// Forge `name`, changed by `adjust`, into `directory`.
pub fn forge_with(name: &str, directory: &Path, adjust: impl FnOnce(&mut hypura_forge::ForgeSpec)) -> PathBuf {
    let mut spec = preset(name).unwrap_or_else(|| panic!("no preset {name}"));
    adjust(&mut spec);
    let path = directory.join(format!("{name}.gguf"));
    write_model(&spec, &path, &|_, _| {}).unwrap_or_else(|error| panic!("forging {name}: {error}"));
    path
}

/// The real Gemma 3 270M file, fetched by `scripts/fetch-test-model` (CI runs it before the
/// tests). `HYPURA_TEST_MODEL` overrides the path.
pub fn gemma_path() -> PathBuf {
    cached_model("HYPURA_TEST_MODEL", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m")
}

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M: an instruct model whose template renders tools.
pub fn chat_model_path() -> PathBuf {
    cached_model("HYPURA_CHAT_MODEL", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b")
}

/// SmolLM2-135M-Instruct Q4_1: a ChatML template without tools.
pub fn smollm_path() -> PathBuf {
    cached_model("HYPURA_SMOLLM_MODEL", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m")
}

/// A model `scripts/fetch-model` put in the cache, or the file the environment names.
fn cached_model(variable: &str, file: &str, fetch_name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return PathBuf::from(path);
    }
    let cache = std::env::var_os("HYPURA_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|dir| dir.join("hypura")))
        .expect("a cache directory");
    let path = cache.join("models").join(file);
    assert!(path.exists(), "{} is missing: run scripts/fetch-model {fetch_name} first", path.display());
    path
}

/// A running `hypura serve`, killed on drop.
pub struct Server {
    pub child: Child,
    pub base: String,
    log: PathBuf,
}

impl Server {
    pub fn start(arguments: &[String], log: PathBuf) -> Server {
        Server::start_with(arguments, log, &[])
    }

    /// With more environment variables.
    pub fn start_with(arguments: &[String], log: PathBuf, environment: &[(&str, &str)]) -> Server {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log_file = std::fs::File::create(&log).unwrap();
        let child = hypura_command()
            .envs(environment.iter().copied())
            .arg("serve")
            .args(arguments)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .env("OLLAMA_MODELS", "/nonexistent")
            // Info: the log shows loads, reloads and an agent's tool calls and results.
            .env("HYPURA_LOG", std::env::var("HYPURA_LOG").unwrap_or_else(|_| "hypura=info".into()))
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

    pub fn log_text(&self) -> String {
        let mut text = String::new();
        let _ = std::fs::File::open(&self.log).and_then(|mut file| file.read_to_string(&mut text));
        text
    }

    pub fn python(&self, script: &str, arguments: &[String]) -> String {
        let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python");
        let output =
            Command::new("python3").arg(scripts.join(script)).arg(&self.base).args(arguments).output().unwrap();
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

    pub fn child_alive(&self) -> bool {
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

impl Server {
    /// POST a JSON body and return the JSON reply (a plain HTTP/1.1 exchange: replies with
    /// `stream: false` have a length, not chunks).
    pub fn post(&self, path: &str, body: &serde_json::Value) -> serde_json::Value {
        let (status, payload) = self.post_status(path, body);
        assert_eq!(status, 200, "{path}: {payload}\n--- server log\n{}", self.log_text());
        serde_json::from_str(&payload).unwrap_or_else(|error| panic!("{path}: {error}: {payload:?}"))
    }

    /// POST a JSON body and return the status and the body, whatever the status.
    pub fn post_status(&self, path: &str, body: &serde_json::Value) -> (u16, String) {
        let body = body.to_string();
        self.exchange(
            &format!("POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len()),
            &body,
        )
    }

    /// GET a JSON reply.
    pub fn get(&self, path: &str) -> serde_json::Value {
        let (status, payload) = self.get_status(path);
        assert_eq!(status, 200, "{path}: {payload}");
        serde_json::from_str(&payload).unwrap_or_else(|error| panic!("{path}: {error}: {payload:?}"))
    }

    /// GET: the status and the body, whatever the status.
    pub fn get_status(&self, path: &str) -> (u16, String) {
        self.exchange(&format!("GET {path} HTTP/1.1\r\n"), "")
    }

    /// Send the server a signal (`TERM`, `INT`, `KILL`).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args([&format!("-{signal}"), &pid]).status().unwrap().success());
    }

    /// Wait at most `limit` for the server to exit; its status, or a panic with its log.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "serve did not exit within {limit:?}: {}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stop the server as a supervisor does (SIGTERM), and check that it drained and exited 0.
    pub fn terminate(mut self) {
        self.signal("TERM");
        let status = self.wait_exit(Duration::from_secs(60));
        assert!(status.success(), "serve exited with {status} after SIGTERM: {}", self.log_text());
    }

    fn exchange(&self, head: &str, body: &str) -> (u16, String) {
        let address = self.base.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        write!(stream, "{head}Host: {address}\r\nConnection: close\r\n\r\n{body}").unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        let (head, payload) = reply.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP reply: {reply:?}"));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head:?}"));
        (status, payload.to_string())
    }
}

/// The smallest budget the planner accepts for `mode`: what it says it needs when given none.
/// Every streamable layer then streams.
pub fn streaming_budget(path: &Path, mode: hypura::plan::Mode, n_ctx: u32) -> u64 {
    let inventory = hypura::model::Inventory::open(path).unwrap();
    let facts = hypura::plan::MachineFacts {
        memory_budget_bytes: 1,
        disk_bytes_per_sec: Some(1e9),
        ..hypura::plan::MachineFacts::default()
    };
    let options = hypura::plan::PlanOptions {
        mode: hypura::plan::ModeChoice::Forced(mode),
        n_ctx,
        n_ubatch: 512,
        window_layers: Some(2),
        ..hypura::plan::PlanOptions::default()
    };
    match hypura::plan::plan(&inventory, &facts, &options) {
        Err(hypura::plan::PlanError::BudgetTooSmall { needed, .. }) => needed + (1 << 20),
        other => panic!("expected the planner to ask for more memory: {other:?}"),
    }
}

/// Put `model` into an Ollama store at `store` as `library/NAME:TAG`: a blob named by its
/// sha256 and a manifest pointing at it (the file is moved).
pub fn ollama_store(store: &Path, model: &Path, name: &str, tag: &str) {
    use sha2::Digest as _;
    let bytes = std::fs::read(model).unwrap();
    let digest: String = sha2::Sha256::digest(&bytes).iter().map(|byte| format!("{byte:02x}")).collect();
    std::fs::create_dir_all(store.join("blobs")).unwrap();
    std::fs::rename(model, store.join(format!("blobs/sha256-{digest}"))).unwrap();
    let manifests = store.join("manifests/registry.ollama.ai/library").join(name);
    std::fs::create_dir_all(&manifests).unwrap();
    let manifest = serde_json::json!({"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": format!("sha256:{digest}"), "size": bytes.len()}]});
    std::fs::write(manifests.join(tag), manifest.to_string()).unwrap();
}

/// The peak resident memory `run --stats` printed ("peak memory X (N bytes resident)"), in bytes.
pub fn peak_rss(stderr: &str) -> u64 {
    stderr
        .lines()
        .find_map(|line| {
            line.strip_prefix("peak memory ")
                .and_then(|rest| rest.split('(').nth(1))
                .and_then(|rest| rest.split(' ').next())
        })
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no peak memory line in {stderr}"))
}

/// What an expert pool costs per slot (one expert of every MoE layer) and for its staging area
/// (the largest layer's expert tensors, aligned as the pool lays them out).
pub fn expert_pool_costs(inventory: &hypura::model::Inventory) -> (u64, u64) {
    let experts: Vec<&hypura::model::TensorEntry> = inventory
        .tensors
        .iter()
        .filter(|tensor| tensor.role.is_expert() && tensor.role != hypura::model::Role::Mtp)
        .collect();
    let per_slot: u64 = experts.iter().map(|tensor| tensor.experts.unwrap().slice_bytes).sum();
    let staging = (0..inventory.hparams.n_layer as u32)
        .map(|layer| {
            experts
                .iter()
                .filter(|tensor| tensor.layer == Some(layer))
                .map(|tensor| tensor.bytes.next_multiple_of(hypura::plan::POOL_ALIGNMENT))
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    (per_slot, staging)
}

/// A GPU budget whose plan has an expert pool of about `slots` slots per MoE layer (the plan's
/// own estimates of the other terms may leave a few more): what every token touches, the KV
/// cache and compute buffers of `n_ctx` and `n_ubatch`, room to copy the largest dense FFN
/// layer for a prompt batch, a staging area for the largest layer's experts, and the slots.
/// Without a GPU, llama.cpp computes the "GPU" layers on the CPU, and so does the pool.
pub fn expert_pool_budget(inventory: &hypura::model::Inventory, n_ctx: u32, n_ubatch: u32, slots: u64) -> u64 {
    use hypura::model::Role;
    let loaded = || inventory.tensors.iter().filter(|tensor| tensor.role != Role::Mtp);
    let streamable = |tensor: &&hypura::model::TensorEntry| {
        tensor.layer.is_some() && (tensor.role.is_dense_ffn() || tensor.role.is_expert())
    };
    let embedding: u64 = loaded().filter(|tensor| tensor.role == Role::TokenEmbedding).map(|tensor| tensor.bytes).sum();
    let tied = if loaded().any(|tensor| tensor.role == Role::Output) { 0 } else { embedding };
    let every_token: u64 =
        loaded().filter(|tensor| !streamable(tensor)).map(|tensor| tensor.bytes).sum::<u64>() - embedding;
    let (per_slot, staging) = expert_pool_costs(inventory);
    let expert_tensors = loaded().filter(|tensor| tensor.role.is_expert()).count() as u64;
    // The largest dense FFN layer among the MoE layers: room for op offload's copy of it.
    let dense_layer = (0..inventory.hparams.n_layer as u32)
        .map(|layer| {
            loaded()
                .filter(|tensor| tensor.layer == Some(layer) && tensor.role.is_dense_ffn())
                .map(|tensor| tensor.bytes)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    every_token
        + tied
        + dense_layer
        + hypura::plan::kv_cache_bytes(inventory, n_ctx, Default::default())
        + hypura::plan::device_compute_bytes(inventory, n_ctx, n_ubatch)
        + staging
        + slots * per_slot
        + expert_tensors * hypura::plan::POOL_ALIGNMENT
}

/// `count` greedy tokens after `prompt` (raw, no template), past the end token, in a session of
/// its own: how the agreement tests compare a placement with the resident model.
pub fn greedy(
    engine: &std::sync::Arc<hypura::engine::Engine>,
    prompt: &str,
    count: u32,
) -> hypura::engine::GenerateOutput {
    use hypura::engine::{Control, GenerateRequest, Prompt, SamplerParams, Session};
    let mut session = Session::new(engine.clone()).unwrap();
    let request = GenerateRequest {
        max_tokens: Some(count),
        sampling: SamplerParams::greedy(),
        ignore_eos: true,
        ..GenerateRequest::new(Prompt::Raw(prompt.into()))
    };
    session.generate(&request, &mut |_| Control::Continue).unwrap()
}
