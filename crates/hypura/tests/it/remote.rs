//! The remote tier on loopback: two `hypura rpc-server` workers, each in a memory cgroup of its
//! own (two small machines), hold the last layers of a model the local budget cannot hold;
//! the greedy text is the resident run's. A worker that is down at start is named; a worker
//! killed mid-answer fails that request with its name, the server stays up, and the next
//! request is planned again without it.
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common;

const PROMPT: &str = "Write a Python function that adds two numbers.";
/// What each worker lends, and the host's budget: the model (463 MiB of weights) fits in
/// none of them alone.
const LENT: &str = "200MiB";
const HOST_BUDGET: &str = "300MiB";

/// A `hypura rpc-server` on a free loopback port, in a memory cgroup of its own where this
/// machine lets the test make one; killed (and its cgroup removed) on drop.
struct Worker {
    child: Child,
    endpoint: String,
    cgroup: Option<PathBuf>,
}

impl Worker {
    fn start(lent: &str, cgroup_limit_bytes: u64) -> Worker {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = common::hypura_command()
            .args(["rpc-server", "--port", &port.to_string(), "--mem", lent, "-t", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The worker allocates nothing before a client connects, so moving it in now is in time.
        let cgroup = memory_cgroup(&format!("hypura-test-worker-{port}"), cgroup_limit_bytes);
        if let Some(cgroup) = &cgroup {
            std::fs::write(cgroup.join("cgroup.procs"), child.id().to_string()).unwrap();
        }
        let endpoint = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&endpoint).is_err() {
            assert!(Instant::now() < deadline, "the worker on {endpoint} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // That connection was its one client until it closed; give the server a moment to
        // take the next.
        std::thread::sleep(Duration::from_millis(50));
        Worker { child, endpoint, cgroup }
    }

    /// The worker's peak resident memory (VmHWM), in bytes.
    fn peak_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmHWM")
            * 1024
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
        if let Some(cgroup) = &self.cgroup {
            let _ = std::fs::remove_dir(cgroup);
        }
    }
}

/// A fresh memory cgroup with `limit` bytes (v1 or v2), or None where this machine does not let
/// the test make one.
fn memory_cgroup(name: &str, limit: u64) -> Option<PathBuf> {
    let (directory, limit_file) = if std::path::Path::new("/sys/fs/cgroup/memory").is_dir() {
        (PathBuf::from("/sys/fs/cgroup/memory").join(name), "memory.limit_in_bytes")
    } else {
        (PathBuf::from("/sys/fs/cgroup").join(name), "memory.max")
    };
    std::fs::create_dir(&directory).ok()?;
    if std::fs::write(directory.join(limit_file), limit.to_string()).is_err() {
        let _ = std::fs::remove_dir(&directory);
        eprintln!("no memory cgroup for {name}: the worker runs without a limit");
        return None;
    }
    Some(directory)
}

use common::hypura;

fn greedy_run(model: &str, extra: &[&str]) -> (String, String) {
    let mut args = vec!["run", model, "-p", PROMPT, "-n", "24", "--temperature", "0", "-c", "512", "--stats"];
    args.extend_from_slice(extra);
    let output = hypura(&args);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "hypura {args:?}: {stderr}");
    (String::from_utf8_lossy(&output.stdout).into_owned(), stderr)
}

/// Two workers hold the last layers, each its own range, and the text is the resident text.
#[test]
fn two_workers_hold_the_last_layers_and_the_greedy_text_is_the_resident_text() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let model = model.to_str().unwrap();
    let lent = hypura::cli::settings::parse_bytes(LENT).unwrap();
    let workers = [Worker::start(LENT, lent + (160 << 20)), Worker::start(LENT, lent + (160 << 20))];
    let rpc = format!("{},{}", workers[0].endpoint, workers[1].endpoint);
    let flags = ["--rpc", rpc.as_str(), "--memory-budget", HOST_BUDGET];

    let inspect = hypura(&[&["inspect", model, "--json", "-c", "512"][..], &flags].concat());
    assert!(inspect.status.success(), "{}", String::from_utf8_lossy(&inspect.stderr));
    let report: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    let shares =
        report["plan"]["remote"]["shares"].as_array().unwrap_or_else(|| panic!("no remote tier: {}", report["plan"]));
    assert_eq!(shares.len(), 2, "both workers hold layers: {shares:?}");
    let n_layer = report["hparams"]["n_layer"].as_u64().unwrap();
    assert_eq!(shares[1]["layers"]["end"].as_u64(), Some(n_layer), "the last device holds the last layers");
    assert_eq!(shares[0]["layers"]["end"], shares[1]["layers"]["start"], "contiguous ranges in device order");
    for share in shares {
        assert!(share["layers"]["end"].as_u64() > share["layers"]["start"].as_u64(), "{share}");
    }

    let (remote_text, stderr) = greedy_run(model, &flags);
    assert!(stderr.contains("remote       layers"), "{stderr}");
    let (resident_text, _) = greedy_run(model, &["--no-repack"]);
    assert!(!resident_text.trim().is_empty());
    assert_eq!(remote_text, resident_text, "remote layers changed the greedy text");

    // Each worker's memory holds its layers' weights, within what it lends.
    for (worker, share) in workers.iter().zip(shares) {
        let peak = worker.peak_bytes();
        let weights = share["weight_bytes"].as_u64().unwrap();
        assert!(peak >= weights, "{}: peak {peak} bytes below its layers' {weights}", worker.endpoint);
        assert!(peak <= lent + (96 << 20), "{}: peak {peak} bytes over the {lent} it lends", worker.endpoint);
    }
    // The host stays under its budget + 5%, the load included (invariant 3).
    let budget = hypura::cli::settings::parse_bytes(HOST_BUDGET).unwrap();
    let peak = common::peak_rss(&stderr);
    assert!(peak as f64 <= budget as f64 * 1.05, "host peak {peak} bytes over the budget {budget}: {stderr}");
}

#[test]
fn a_worker_that_is_down_at_start_is_named() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("127.0.0.1:{port}");
    for command in ["run", "inspect"] {
        let output = hypura(
            &[command, model.to_str().unwrap(), "--rpc", &endpoint, "-p", "hi"][..if command == "run" { 6 } else { 4 }],
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(&format!("RPC worker {endpoint} is not answering")), "{stderr}");
    }
    let output = hypura(&["run", model.to_str().unwrap(), "--rpc", "nowhere", "-p", "hi"]);
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("\"nowhere\" is not HOST:PORT"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Kill a worker while the server streams an answer through it: that request ends with an error
/// naming the worker, the server stays up, and the next request is answered by a model planned
/// again with the worker that is left, with the resident text.
#[test]
fn a_worker_killed_mid_answer_fails_that_request_and_the_next_one_is_planned_without_it() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let lent = hypura::cli::settings::parse_bytes(LENT).unwrap();
    let mut workers = [Worker::start(LENT, lent + (160 << 20)), Worker::start(LENT, lent + (160 << 20))];
    let rpc = format!("{},{}", workers[0].endpoint, workers[1].endpoint);
    let directory = tempfile::tempdir().unwrap();
    let server = common::Server::start(
        &[
            model.to_str().unwrap().to_string(),
            "--rpc".into(),
            rpc,
            "--memory-budget".into(),
            HOST_BUDGET.into(),
            "-c".into(),
            "512".into(),
            "--parallel".into(),
            "1".into(),
        ],
        directory.path().join("serve.log"),
    );
    let name = server.get("/api/tags")["models"][0]["name"].as_str().expect("the served model").to_string();

    // A long streamed answer; the second worker dies after a few tokens.
    let body = serde_json::json!({"model": name, "prompt": "Write a long essay about the sea.", "stream": true, "options": {"temperature": 0, "num_predict": 400}}).to_string();
    let address = server.base.trim_start_matches("http://").to_string();
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    write!(stream, "POST /api/generate HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut lines = BufReader::new(stream).lines();
    let mut tokens = 0;
    let mut error = None;
    let mut done = false;
    for line in lines.by_ref() {
        let line = line.unwrap();
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line.trim()) else { continue };
        if let Some(message) = event.get("error") {
            error = Some(message.as_str().unwrap_or_default().to_string());
            break;
        }
        if event["done"] == true {
            done = true;
            break;
        }
        tokens += 1;
        if tokens == 5 {
            workers[1].kill();
        }
    }
    assert!(!done, "the answer finished although its worker died after 5 tokens: {}", server.log_text());
    let error = error.unwrap_or_else(|| panic!("no error line: {}", server.log_text()));
    assert!(error.contains(&format!("RPC worker {} stopped answering", workers[1].endpoint)), "{error}");
    assert!(server.child_alive(), "the server died: {}", server.log_text());

    // The next request: planned again with the first worker alone, and the resident text.
    let reply = server.post("/api/generate", &serde_json::json!({"model": name, "prompt": PROMPT, "raw": false, "stream": false, "options": {"temperature": 0, "num_predict": 24}}));
    let log = server.log_text();
    assert!(log.contains(&format!("without a worker: RPC worker {} is not answering", workers[1].endpoint)), "{log}");
    let resident = common::Server::start(
        &[
            model.to_str().unwrap().to_string(),
            "--no-repack".into(),
            "-c".into(),
            "512".into(),
            "--parallel".into(),
            "1".into(),
        ],
        directory.path().join("resident.log"),
    );
    let expected = resident.post("/api/generate", &serde_json::json!({"model": name, "prompt": PROMPT, "stream": false, "options": {"temperature": 0, "num_predict": 24}}));
    assert_eq!(reply["response"], expected["response"], "{log}");
}

/// A plan made when a worker had more memory than it has at load is refused there, with the
/// numbers, before any weight is sent; the link profile times round trips and transfers.
#[test]
fn a_worker_with_less_memory_than_planned_is_refused_at_load_and_its_link_is_profiled() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let lent = hypura::cli::settings::parse_bytes(LENT).unwrap();
    let worker = Worker::start(LENT, lent + (160 << 20));
    let workers =
        hypura::remote::Workers::connect(std::slice::from_ref(&worker.endpoint), Duration::ZERO, false).unwrap();
    assert_eq!(workers.devices.len(), 1);
    // What it lends, less what the server itself took since it started (a client's
    // connection: a few MiB at most).
    let free = workers.devices[0].free_bytes;
    assert!(free <= lent && free + (16 << 20) >= lent, "the worker reports what it lends: {free} of {lent}");
    let spec = hypura::setup::RunSpec {
        n_ctx_seq: Some(512),
        n_batch: 64,
        memory_budget_bytes: Some(hypura::cli::settings::parse_bytes(HOST_BUDGET).unwrap()),
        remote: Some(workers.clone()),
        ..hypura::setup::RunSpec::default()
    };
    let inventory = hypura::model::Inventory::open(&model).unwrap();
    // The machine as it is now (the worker's free memory), without what earlier runs measured.
    let facts_now = || hypura::plan::MachineFacts {
        compute_seconds_per_token: None,
        ..hypura::setup::machine_facts(&spec, &model).unwrap()
    };
    let mut facts = facts_now();
    // The plan believes in twice the memory.
    facts.remote_devices[0].free_bytes = 2 * lent;
    // The engine options that load a choice with the workers.
    let options_for = |choice: hypura::plan::Choice| hypura::engine::EngineOptions {
        n_ctx_seq: choice.n_ctx_seq,
        n_batch: choice.n_batch,
        n_ubatch: choice.n_batch,
        repack: false,
        plan: Some(choice.plan),
        remote: Some(workers.clone()),
        ..hypura::engine::EngineOptions::default()
    };
    let choice = hypura::setup::choose(&inventory, &spec, &facts).unwrap();
    let share = choice.plan.remote.as_ref().expect("a remote tier").shares[0].clone();
    assert!(share.total_bytes() > lent, "{share:?}");
    let options = options_for(choice);
    let error = hypura::engine::Engine::load(inventory.clone(), options).err().expect("refused at load").to_string();
    assert!(
        error.contains(&format!("RPC worker {}", worker.endpoint)) && error.contains("MiB free, and the plan puts"),
        "{error}"
    );

    // Planned with what it has, the model loads; the worker then reports what its layers took
    // out of what it lends, and a second model is planned in what is left.
    let facts = facts_now();
    let choice = hypura::setup::choose(&inventory, &spec, &facts).unwrap();
    let share = choice.plan.remote.as_ref().expect("a remote tier").shares[0].clone();
    let options = options_for(choice);
    let engine = hypura::engine::Engine::load(inventory.clone(), options).unwrap();
    let left = workers.facts()[0].free_bytes;
    assert!(
        left + share.weight_bytes <= free,
        "{left} bytes left of {free} with {} of weights there",
        share.weight_bytes
    );
    let second = hypura::setup::choose(&inventory, &spec, &facts_now()).unwrap().plan;
    assert!(
        second.remote.as_ref().is_none_or(|remote| remote.layers.len() < share.layers.len()),
        "{}",
        second.render()
    );
    drop(engine);

    let link = hypura::remote::profile_link(&worker.endpoint, 10, 4 << 20).unwrap();
    assert!(link.round_trip_median_secs > 0.0 && link.round_trip_median_secs <= link.round_trip_p90_secs, "{link:?}");
    assert!(link.upload_bytes_per_sec.unwrap() > 1e6 && link.download_bytes_per_sec.unwrap() > 1e6, "{link:?}");
    assert_eq!(link.devices.len(), 1);
    assert!(link.devices[0].1 <= lent && link.devices[0].2 >= lent, "{link:?}");
}

/// The remote tier is weighed against streaming locally alone at each one's own prompt batch:
/// a budget that holds local streaming only with small batches still compares with it.
#[test]
fn remote_and_local_streaming_are_weighed_each_at_its_own_batch() {
    let _machine = common::shared_machine();
    let model = common::chat_model_path();
    let inventory = hypura::model::Inventory::open(&model).unwrap();
    let spec = hypura::setup::RunSpec {
        n_ctx_seq: Some(512),
        n_batch: 512,
        grow_batch: true,
        memory_budget_bytes: Some(hypura::cli::settings::parse_bytes(HOST_BUDGET).unwrap()),
        ..hypura::setup::RunSpec::default()
    };
    let facts = |round_trip_secs: f64| hypura::plan::MachineFacts {
        disk_bytes_per_sec: Some(1e9),
        compute_seconds_per_token: None,
        remote_devices: vec![hypura::plan::RemoteDeviceFacts {
            name: "RPC0".into(),
            worker: "10.0.0.2:50052".into(),
            free_bytes: 400 << 20,
            round_trip_secs,
            link_bytes_per_sec: Some(1e8),
        }],
        ..hypura::setup::machine_facts(&spec, &model).unwrap()
    };
    // At the default batch the host cannot stream alone (its compute buffers are too large).
    let at_default = hypura::plan::plan_for(
        &inventory,
        &hypura::plan::MachineFacts { remote_devices: Vec::new(), ..facts(1e-4) },
        &spec.ask(),
    );
    assert!(at_default.is_err(), "the test needs a budget too small for 512-token batches alone");

    let near = hypura::setup::choose(&inventory, &spec, &facts(1e-4)).unwrap().plan;
    let remote = near.remote.as_ref().unwrap_or_else(|| panic!("{}", near.render()));
    assert!(
        remote.local_seconds_per_token.is_finite()
            && remote.local_seconds_per_token > remote.predicted_seconds_per_token,
        "{remote:?}"
    );

    // A link whose round trip costs more than the streamed bytes it saves: local streaming, at
    // the batch it fits.
    let hypura::plan::Choice { n_batch, plan: far, .. } =
        hypura::setup::choose(&inventory, &spec, &facts(remote.local_seconds_per_token)).unwrap();
    assert!(far.remote.is_none(), "{}", far.render());
    assert!(n_batch < 512);
    let why = far.remote_unused.as_deref().unwrap_or_default();
    assert!(
        why.contains("streaming locally alone is predicted faster")
            && why.contains(&format!("prompt batches of {n_batch}")),
        "{why}"
    );
}

/// A model without an output matrix computes its logits with a copy of the token embedding,
/// which llama.cpp places with the output: it stays on the host too, so the logits do not cross
/// the link, and the text is the resident text.
#[test]
fn a_tied_output_stays_on_the_host() {
    let _machine = common::shared_machine();
    let model = common::smollm_path();
    let model = model.to_str().unwrap();
    let worker = Worker::start("200MiB", 360 << 20);
    let (remote_text, stderr) = greedy_run(model, &["--rpc", &worker.endpoint, "--memory-budget", "90MiB"]);
    assert!(stderr.contains("remote       layers"), "{stderr}");
    let (resident_text, _) = greedy_run(model, &["--no-repack"]);
    assert_eq!(remote_text, resident_text);
    // SmolLM2's 49,152-token vocabulary: 196 KB of logits a token, were they sent back.
    let per_token: f64 = stderr
        .lines()
        .find_map(|line| line.split("per decoded token: ").nth(1))
        .and_then(|rest| rest.split(" KB").next())
        .and_then(|number| number.trim().parse().ok())
        .unwrap_or_else(|| panic!("no links line in {stderr}"));
    assert!(per_token < 98.0, "{per_token} KB a token over the link: {stderr}");
}
