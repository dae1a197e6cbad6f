//! The server as a service: SIGTERM drains it (running answers finish or, past
//! `--shutdown-timeout`, are cancelled; new requests and `/health` get 503; a second signal
//! exits at once), `/health` is 503 while a model loads, `/metrics` is Prometheus text whose
//! counters move with a request, and `rpc-server` stops on SIGTERM once its clients are gone.
use std::net::TcpListener;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{self, Server};

fn model_name(path: &Path) -> String {
    path.file_stem().unwrap().to_str().unwrap().to_ascii_lowercase()
}

fn arguments(model: &Path, flags: &[&str]) -> Vec<String> {
    let mut arguments = vec![model.display().to_string()];
    arguments.extend(["--context", "2048", "--parallel", "1", "--threads", "1"].map(String::from));
    arguments.extend(flags.iter().map(|flag| flag.to_string()));
    arguments
}

fn generate(model: &str, tokens: u32) -> Value {
    json!({
        "model": model,
        "prompt": "Write a long story about a lighthouse keeper.",
        "stream": false,
        "options": {"temperature": 0, "num_predict": tokens, "ignore_eos": true},
    })
}

/// Wait until the model holds a request (its answer has begun).
fn wait_active(server: &Server) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ps = server.get("/api/ps");
        if ps["models"].as_array().into_iter().flatten().any(|model| model["hypura_active_requests"] == 1) {
            return;
        }
        assert!(Instant::now() < deadline, "no request became active: {ps}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn health_is_503_while_a_model_loads_and_while_the_server_drains() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::chat_model_path();
    let name = model_name(&path);
    let mut server =
        Server::start(&arguments(&path, &["--shutdown-timeout", "2m"]), directory.path().join("serve.log"));
    assert_eq!(server.get("/health"), json!({"status": "ok"}));

    // A load: an empty prompt only loads the model, and /health says so meanwhile.
    let mut loading = None;
    std::thread::scope(|scope| {
        let load = scope.spawn(|| server.post("/api/generate", &json!({"model": name})));
        while !load.is_finished() {
            let (status, body) = server.get_status("/health");
            if status == 503 {
                loading = Some(body);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(load.join().unwrap()["done_reason"], "load");
    });
    let loading = loading.expect("/health never answered 503 during the load");
    assert!(loading.contains("Loading model"), "{loading}");
    assert_eq!(server.get("/health"), json!({"status": "ok"}));

    // A drain: the running answer finishes whole; a new request and /health get 503.
    std::thread::scope(|scope| {
        let running = scope.spawn(|| server.post_status("/api/generate", &generate(&name, 48)));
        wait_active(&server);
        server.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        let health = loop {
            let (status, body) = server.get_status("/health");
            if status == 503 {
                break body;
            }
            assert!(Instant::now() < deadline, "/health stayed {status} after SIGTERM");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(health.contains("Shutting down"), "{health}");
        let (status, refused) = server.post_status("/api/generate", &generate(&name, 4));
        assert_eq!(status, 503, "{refused}");
        let (status, answer) = running.join().unwrap();
        assert_eq!(status, 200, "{answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(answer["eval_count"], 48, "the running answer was cut short: {answer}");
    });
    let status = server.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "serve exited with {status}: {}", server.log_text());
}

#[test]
fn a_stop_cancels_answers_past_its_bound_and_a_second_signal_exits_at_once() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::chat_model_path();
    let name = model_name(&path);

    // Past the bound: the answer is cancelled and the server exits 0.
    let mut server =
        Server::start(&arguments(&path, &["--shutdown-timeout", "1s"]), directory.path().join("bounded.log"));
    std::thread::scope(|scope| {
        let running = scope.spawn(|| server.post_status("/api/generate", &generate(&name, 100_000)));
        wait_active(&server);
        let stopped = Instant::now();
        server.signal("TERM");
        let (status, answer) = running.join().unwrap();
        assert_eq!(status, 200, "{answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert!(answer["eval_count"].as_u64().unwrap() < 100_000, "{answer}");
        assert!(stopped.elapsed() < Duration::from_secs(20), "the answer ran {:?} past SIGTERM", stopped.elapsed());
    });
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "serve exited with {status}: {}", server.log_text());
    assert!(server.log_text().contains("cancelled"), "{}", server.log_text());

    // A second signal does not wait for the bound.
    let mut server =
        Server::start(&arguments(&path, &["--shutdown-timeout", "10m"]), directory.path().join("twice.log"));
    std::thread::scope(|scope| {
        let running = scope.spawn(|| {
            let _ = std::panic::catch_unwind(|| server.post_status("/api/generate", &generate(&name, 100_000)));
        });
        wait_active(&server);
        server.signal("TERM");
        std::thread::sleep(Duration::from_millis(300));
        let stopped = Instant::now();
        server.signal("INT");
        while server.child_alive() {
            assert!(stopped.elapsed() < Duration::from_secs(5), "a second signal did not exit: {}", server.log_text());
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = running.join();
    });
    let status = server.wait_exit(Duration::from_secs(5));
    assert!(!status.success(), "a forced exit reported success");
}

/// The samples of `/metrics`, parsed by the Prometheus project's own parser (Python's
/// `prometheus_client`, strict OpenMetrics): "name{label=value,...}" to value.
fn scrape(server: &Server) -> serde_json::Map<String, Value> {
    let samples = server.python("metrics.py", &[]);
    serde_json::from_str::<Value>(&samples).unwrap().as_object().unwrap().clone()
}

fn sample(samples: &serde_json::Map<String, Value>, key: &str) -> f64 {
    samples.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

#[test]
fn metrics_parse_as_prometheus_text_and_move_with_a_request() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let path = common::smollm_path();
    let name = model_name(&path);

    let plain = Server::start(&arguments(&path, &[]), directory.path().join("plain.log"));
    assert_eq!(plain.get_status("/metrics").0, 404, "/metrics is served without --metrics");
    drop(plain);

    let server = Server::start(&arguments(&path, &["--metrics"]), directory.path().join("metrics.log"));
    let before = scrape(&server);
    let answer = server.post("/api/generate", &generate(&name, 8));
    let after = scrape(&server);
    // The catalog's name for the model, with its tag.
    let tags = server.get("/api/tags");
    let name = tags["models"][0]["name"].as_str().unwrap();
    let labels = format!("{{endpoint=\"/api/generate\",model=\"{name}\"}}");
    let moved =
        |metric: &str| sample(&after, &format!("{metric}{labels}")) - sample(&before, &format!("{metric}{labels}"));
    assert_eq!(moved("llamacpp:tokens_predicted_total"), answer["eval_count"].as_f64().unwrap(), "{after:?}");
    assert_eq!(moved("llamacpp:prompt_tokens_total"), answer["prompt_eval_count"].as_f64().unwrap(), "{after:?}");
    assert!(moved("llamacpp:tokens_predicted_seconds_total") > 0.0, "{after:?}");
    assert!(moved("llamacpp:prompt_seconds_total") > 0.0, "{after:?}");
    let requests = "hypura_requests_total{endpoint=\"/api/generate\",status=\"200\"}";
    assert_eq!(sample(&after, requests) - sample(&before, requests), 1.0, "{after:?}");
    // The loaded model's gauges: nothing running now.
    let processing = format!("llamacpp:requests_processing{{model=\"{name}\"}}");
    assert_eq!(after.get(&processing).and_then(Value::as_f64), Some(0.0), "{after:?}");
}

/// An `rpc-server` on a free loopback port, with its log in `log`.
fn rpc_server(flags: &[&str], log: &Path) -> (std::process::Child, String) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = common::hypura_command()
        .args(["rpc-server", "--port", &port.to_string(), "--mem", "256MiB", "-t", "1"])
        .args(flags)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let endpoint = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&endpoint).is_err() {
        assert!(Instant::now() < deadline, "the rpc-server on {endpoint} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, endpoint)
}

fn exit_within(child: &mut std::process::Child, limit: Duration, log: &Path) -> (std::process::ExitStatus, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, started.elapsed());
        }
        assert!(started.elapsed() < limit, "rpc-server did not exit: {}", std::fs::read_to_string(log).unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_rpc_server_stops_on_sigterm_once_its_clients_are_gone_or_its_bound_passes() {
    use std::io::Read;
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let term = |child: &std::process::Child| {
        assert!(std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success())
    };

    // No client: it exits 0 at once.
    let log = directory.path().join("idle.log");
    let (mut child, _) = rpc_server(&[], &log);
    term(&child);
    let (status, took) = exit_within(&mut child, Duration::from_secs(10), &log);
    assert!(status.success(), "{status}: {}", std::fs::read_to_string(&log).unwrap());
    assert!(took < Duration::from_secs(2), "took {took:?} with no client");

    // A connected client holds the stop until the bound; a new connection is closed meanwhile.
    let log = directory.path().join("client.log");
    let (mut child, endpoint) = rpc_server(&["--shutdown-timeout", "2s"], &log);
    let client = std::net::TcpStream::connect(&endpoint).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    term(&child);
    std::thread::sleep(Duration::from_millis(200));
    let mut late = std::net::TcpStream::connect(&endpoint).unwrap();
    late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(late.read(&mut [0u8; 16]).unwrap_or(0), 0, "a connection after SIGTERM was served");
    let (status, took) = exit_within(&mut child, Duration::from_secs(20), &log);
    assert!(status.success(), "{status}: {}", std::fs::read_to_string(&log).unwrap());
    assert!(took >= Duration::from_millis(1200), "exited {took:?} after SIGTERM with a client connected");
    drop(client);
}
