//! Models from the hub by name, against a local server that answers the hub's paths: a
//! repository's tree (`/api/models/ORG/REPO/tree/main`, LFS sizes and SHA-256) and its files
//! (`/ORG/REPO/resolve/main/FILE`, with ranges). Nothing is fetched from the internet.
//! `hypura pull` with its progress, a pull cut off and resumed, a body refused by its hash,
//! split files, `:QUANT` picking its file, `run` pulling on first use, `list` and `rm`,
//! `/api/pull` streaming to the `ollama` client and `/api/delete`, no disk space, and a 404 and a
//! 401 each named in one line.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::common::{self, Server};

/// The fake hub's state: the repositories' root, the files whose next whole-file answer is cut
/// in the middle, hashes it lies about, sizes it lies about, and the Range headers it saw.
#[derive(Clone, Default)]
struct Hub {
    root: PathBuf,
    cut_once: Arc<Mutex<Vec<String>>>,
    wrong_hash: Arc<Mutex<Vec<String>>>,
    huge: Arc<Mutex<Vec<String>>>,
    ranges: Arc<Mutex<Vec<String>>>,
    hashes: Arc<Mutex<HashMap<PathBuf, String>>>,
}

const TOKEN: &str = "hf_secret";

impl Hub {
    fn sha256(&self, path: &Path) -> String {
        let mut hashes = self.hashes.lock().unwrap();
        hashes
            .entry(path.to_path_buf())
            .or_insert_with(|| {
                Sha256::digest(std::fs::read(path).unwrap()).iter().map(|byte| format!("{byte:02x}")).collect()
            })
            .clone()
    }

    /// Repositories named `private-*` need the token.
    fn allowed(repo: &str, headers: &HeaderMap) -> bool {
        !repo.starts_with("private-")
            || headers.get("authorization").and_then(|value| value.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
    }
}

async fn tree(State(hub): State<Hub>, UrlPath((org, repo)): UrlPath<(String, String)>, headers: HeaderMap) -> Response {
    if !Hub::allowed(&repo, &headers) {
        return (StatusCode::UNAUTHORIZED, Json(json!({"error": "Invalid credentials"}))).into_response();
    }
    let directory = hub.root.join(&org).join(&repo);
    let Ok(entries) = std::fs::read_dir(&directory) else {
        return (StatusCode::NOT_FOUND, Json(json!({"error": "Repository not found"}))).into_response();
    };
    let mut files: Vec<Value> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let size = entry.metadata().unwrap().len();
        let mut oid = hub.sha256(&entry.path());
        if hub.wrong_hash.lock().unwrap().contains(&name) {
            oid = "0".repeat(64);
        }
        let size = if hub.huge.lock().unwrap().contains(&name) { 1 << 50 } else { size };
        files.push(json!({"type": "file", "oid": "1234", "size": size, "path": name, "lfs": {"oid": oid, "size": size, "pointerSize": 134}}));
    }
    files.push(json!({"type": "file", "oid": "5678", "size": 12, "path": "README.md"}));
    Json(Value::Array(files)).into_response()
}

use axum::Json;

async fn resolve(
    State(hub): State<Hub>,
    UrlPath((org, repo, file)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    if !Hub::allowed(&repo, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let path = hub.root.join(&org).join(&repo).join(&file);
    let Ok(bytes) = std::fs::read(&path) else { return StatusCode::NOT_FOUND.into_response() };
    let total = bytes.len();
    let range = headers.get("range").and_then(|value| value.to_str().ok()).map(str::to_string);
    if let Some(range) = &range {
        hub.ranges.lock().unwrap().push(format!("{file} {range}"));
        let (first, last) = range.strip_prefix("bytes=").and_then(|range| range.split_once('-')).unwrap();
        let first: usize = first.parse().unwrap();
        let last: usize = if last.is_empty() { total - 1 } else { last.parse::<usize>().unwrap().min(total - 1) };
        return Response::builder()
            .status(StatusCode::PARTIAL_CONTENT)
            .header("content-range", format!("bytes {first}-{last}/{total}"))
            .header("content-length", last + 1 - first)
            .body(Body::from(bytes[first..=last].to_vec()))
            .unwrap();
    }
    let cut = {
        let mut cut_once = hub.cut_once.lock().unwrap();
        let position = cut_once.iter().position(|name| *name == file);
        position.map(|position| cut_once.remove(position)).is_some()
    };
    if cut {
        // The connection drops in the middle of the body.
        let half = bytes[..total / 2].to_vec();
        let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
            vec![Ok(half), Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut"))];
        return Response::builder()
            .header("content-length", total)
            .body(Body::from_stream(futures_util::stream::iter(chunks)))
            .unwrap();
    }
    Response::builder().header("content-length", total).body(Body::from(bytes)).unwrap()
}

/// Serve `hub` on a free loopback port; returns its base URL.
fn serve(hub: Hub) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let app = axum::Router::new()
                .route("/api/models/{org}/{repo}/tree/main", axum::routing::get(tree))
                .route("/{org}/{repo}/resolve/main/{file}", axum::routing::get(resolve))
                .with_state(hub);
            axum::serve(tokio::net::TcpListener::from_std(listener).unwrap(), app).await.unwrap();
        });
    });
    base
}

/// A hub with `org/models` holding SmolLM2 as `m-Q4_K_M.gguf` and the same bytes with a byte
/// changed at its end as `m-Q8_0.gguf`, `org/private-models` the first under a token, and
/// `org/split` a model in two parts.
fn hub(directory: &Path) -> (Hub, String) {
    let root = directory.join("hub");
    let model = common::smollm_path();
    let models = root.join("org/models");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::copy(&model, models.join("m-Q4_K_M.gguf")).unwrap();
    let mut q8 = std::fs::read(&model).unwrap();
    *q8.last_mut().unwrap() ^= 1;
    std::fs::write(models.join("m-Q8_0.gguf"), q8).unwrap();
    std::fs::create_dir_all(root.join("org/private-models")).unwrap();
    std::fs::copy(&model, root.join("org/private-models/p-Q4_K_M.gguf")).unwrap();
    let split = root.join("org/split");
    std::fs::create_dir_all(&split).unwrap();
    let first = crate::cli_inspect::split_in_two(&model, &split);
    for part in [first.clone(), split.join(hypura_gguf::split_file_name("split", 1, 2))] {
        let name = part.file_name().unwrap().to_string_lossy().replace("split-", "big-Q4_K_M-");
        std::fs::rename(&part, split.join(name)).unwrap();
    }
    let hub = Hub { root, ..Hub::default() };
    let base = serve(hub.clone());
    (hub, base)
}

/// A directory, the hub in it, its address, and the models directory to pull into.
fn setup() -> (tempfile::TempDir, Hub, String, PathBuf) {
    let directory = tempfile::tempdir().unwrap();
    let (hub, base) = hub(directory.path());
    let models = directory.path().join("models");
    (directory, hub, base, models)
}

fn pull(base: &str, models: &Path, arguments: &[&str], environment: &[(&str, &str)]) -> std::process::Output {
    common::hypura_command()
        .args(arguments)
        .env("HF_ENDPOINT", base)
        .env("HYPURA_MODELS", models)
        .env_remove("HF_TOKEN")
        .envs(environment.iter().copied())
        .env("HYPURA_LOG", "off")
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn sha256_of(path: &Path) -> String {
    Sha256::digest(std::fs::read(path).unwrap()).iter().map(|byte| format!("{byte:02x}")).collect()
}

#[test]
fn pull_shows_the_plan_and_its_progress_picks_the_quant_and_lists_and_removes() {
    let _machine = common::shared_machine();
    let (_directory, hub, base, models) = setup();

    let output = pull(&base, &models, &["pull", "hf.co/org/models:Q8_0", "--context", "512"], &[]);
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    // The plan before the download, then the progress.
    assert!(stdout.contains("plan ") && stdout.contains("mode"), "no plan shown: {stdout}");
    assert!(stderr.contains("pulling m-Q8_0.gguf") && stderr.contains(" of "), "no progress: {stderr}");
    let pulled = models.join("hf.co/org/models/m-Q8_0.gguf");
    assert_eq!(sha256_of(&pulled), hub.sha256(&hub.root.join("org/models/m-Q8_0.gguf")));
    assert!(!models.join("hf.co/org/models/m-Q4_K_M.gguf").exists(), "the other quantization was pulled too");

    let listed = pull(&base, &models, &["list"], &[]);
    let listing = text(&listed.stdout);
    assert!(listing.contains("hf.co/org/models:Q8_0"), "{listing}");

    // Split files come together.
    let output = pull(&base, &models, &["pull", "hf.co/org/split", "--yes"], &[]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    for part in 1..=2 {
        let name = format!("big-Q4_K_M-{part:05}-of-00002.gguf");
        assert_eq!(
            sha256_of(&models.join("hf.co/org/split").join(&name)),
            hub.sha256(&hub.root.join("org/split").join(&name))
        );
    }

    let removed = pull(&base, &models, &["rm", "hf.co/org/models:Q8_0"], &[]);
    assert!(removed.status.success(), "{}", text(&removed.stderr));
    assert!(!pulled.exists());
    assert!(!text(&pull(&base, &models, &["list"], &[]).stdout).contains("models:Q8_0"));
}

#[test]
fn a_pull_cut_off_resumes_and_a_wrong_hash_deletes_the_file() {
    let _machine = common::shared_machine();
    let (_directory, hub, base, models) = setup();
    let size = std::fs::metadata(hub.root.join("org/models/m-Q4_K_M.gguf")).unwrap().len();

    hub.cut_once.lock().unwrap().push("m-Q4_K_M.gguf".into());
    let cut = pull(&base, &models, &["pull", "hf.co/org/models", "--yes"], &[]);
    assert!(!cut.status.success());
    let partial = models.join("hf.co/org/models/m-Q4_K_M.gguf.partial");
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept > 0 && kept < size, "{kept} of {size} bytes kept: {}", text(&cut.stderr));
    assert!(text(&cut.stderr).contains("pulling again"), "{}", text(&cut.stderr));

    let resumed = pull(&base, &models, &["pull", "hf.co/org/models", "--yes"], &[]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert!(hub.ranges.lock().unwrap().contains(&format!("m-Q4_K_M.gguf bytes={kept}-")), "{:?}", hub.ranges);
    let pulled = models.join("hf.co/org/models/m-Q4_K_M.gguf");
    assert_eq!(sha256_of(&pulled), hub.sha256(&hub.root.join("org/models/m-Q4_K_M.gguf")));
    assert!(!partial.exists());

    hub.wrong_hash.lock().unwrap().push("m-Q8_0.gguf".into());
    let refused = pull(&base, &models, &["pull", "hf.co/org/models:Q8_0", "--yes"], &[]);
    let stderr = text(&refused.stderr);
    assert!(!refused.status.success());
    assert!(stderr.contains("SHA-256") && stderr.contains("deleted"), "{stderr}");
    assert!(
        !models.join("hf.co/org/models/m-Q8_0.gguf").exists()
            && !models.join("hf.co/org/models/m-Q8_0.gguf.partial").exists()
    );
}

#[test]
fn a_missing_repository_a_refused_token_and_no_space_are_each_one_line() {
    let _machine = common::shared_machine();
    let (_directory, hub, base, models) = setup();
    // The error is the last line, and no other line names the failure.
    let error_lines = |output: &std::process::Output, mark: &str| -> Vec<String> {
        let stderr = text(&output.stderr);
        assert!(stderr.lines().last().is_some_and(|line| line.contains(mark)), "{stderr}");
        stderr.lines().filter(|line| line.contains(mark)).map(str::to_string).collect()
    };

    let missing = pull(&base, &models, &["pull", "hf.co/org/nothing", "--yes"], &[]);
    assert!(!missing.status.success());
    let lines = error_lines(&missing, "404");
    assert_eq!(lines.len(), 1, "{}", text(&missing.stderr));
    assert!(lines[0].contains("org/nothing") && lines[0].contains("404"), "{lines:?}");

    let refused = pull(&base, &models, &["pull", "hf.co/org/private-models", "--yes"], &[]);
    let lines = error_lines(&refused, "401");
    assert_eq!(lines.len(), 1, "{}", text(&refused.stderr));
    assert!(lines[0].contains("401") && lines[0].contains("HF_TOKEN"), "{lines:?}");
    let allowed = pull(&base, &models, &["pull", "hf.co/org/private-models", "--yes"], &[("HF_TOKEN", TOKEN)]);
    assert!(allowed.status.success(), "{}", text(&allowed.stderr));

    hub.huge.lock().unwrap().push("m-Q8_0.gguf".into());
    let full = pull(&base, &models, &["pull", "hf.co/org/models:Q8_0", "--yes"], &[]);
    let lines = error_lines(&full, "disk space");
    assert!(!full.status.success());
    assert!(lines.len() == 1 && lines[0].contains("not enough disk space"), "{}", text(&full.stderr));
    assert!(!models.join("hf.co/org/models/m-Q8_0.gguf.partial").exists(), "a pull that cannot fit started");
}

#[test]
fn run_pulls_a_name_on_first_use() {
    let _machine = common::shared_machine();
    let (_directory, _hub, base, models) = setup();
    let run = |name: &str| {
        pull(
            &base,
            &models,
            &["run", name, "-p", "Hello", "--max-tokens", "4", "--threads", "1", "--temperature", "0"],
            &[],
        )
    };
    let first = run("hf.co/org/models");
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(text(&first.stderr).contains("not pulled yet; pulling it"), "{}", text(&first.stderr));
    let second = run("hf.co/org/models:Q4_K_M");
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert!(!text(&second.stderr).contains("pulling"), "pulled twice: {}", text(&second.stderr));
    assert_eq!(first.stdout, second.stdout, "the same file answers the same");
}

#[test]
fn api_pull_streams_progress_to_the_ollama_client_and_api_delete_removes() {
    let _machine = common::shared_machine();
    let (directory, hub, base, models) = setup();
    let models_text = models.display().to_string();
    let server = Server::start_with(
        &["--models-dir".to_string(), directory.path().display().to_string()],
        directory.path().join("serve.log"),
        &[("HF_ENDPOINT", base.as_str()), ("HYPURA_MODELS", models_text.as_str())],
    );
    let report: Value = serde_json::from_str(&server.python("pull.py", &["hf.co/org/models:Q8_0".into()])).unwrap();
    let statuses: Vec<&str> =
        report["statuses"].as_array().unwrap().iter().map(|status| status.as_str().unwrap()).collect();
    assert_eq!(statuses.first(), Some(&"pulling manifest"), "{report}");
    assert_eq!(statuses.last(), Some(&"success"), "{report}");
    let sha = hub.sha256(&hub.root.join("org/models/m-Q8_0.gguf"));
    assert!(statuses.contains(&format!("pulling {}", &sha[..12]).as_str()), "{report}");
    assert!(statuses.contains(&"verifying sha256 digest"), "{report}");
    let size = std::fs::metadata(hub.root.join("org/models/m-Q8_0.gguf")).unwrap().len();
    assert_eq!(report["last_digest"], format!("sha256:{sha}"), "{report}");
    assert_eq!(report["last_completed"], size, "{report}");
    assert_eq!(report["last_total"], size, "{report}");
    let tags = report["tags"].as_array().unwrap();
    assert!(tags.iter().any(|name| name == "hf.co/org/models:q8_0"), "{report}");
    assert!(
        !report["tags_after_delete"].as_array().unwrap().iter().any(|name| name == "hf.co/org/models:q8_0"),
        "{report}"
    );
    assert!(!models.join("hf.co/org/models/m-Q8_0.gguf").exists());
    // An unknown repository is a 404 before any progress.
    let (status, body) = server.post_status("/api/pull", &json!({"model": "hf.co/org/nothing"}));
    assert_eq!(status, 404, "{body}");
}
