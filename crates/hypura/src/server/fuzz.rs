//! The server's request bodies as its fuzz target (`fuzz/fuzz_targets/server_bodies.rs`) sends
//! them, and as the tests replay what fuzzing kept: one input is an endpoint (its first byte)
//! and a body (the rest), sent through the real router to a model that loads and answers.
//!
//! Generation is capped so each input stays quick: a JSON body's `num_predict`, `max_tokens`
//! and `max_completion_tokens` become at most 8 (what the handlers then see). A handler that
//! panics, or a 500 (a fault of ours, never the client's), fails the input.
use std::path::Path;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use tower::ServiceExt;

use crate::server::wire::KeepAlive;
use crate::server::{router, AppState, Catalog, HttpConfig, SchedulerConfig};
use crate::setup::RunSpec;

/// The endpoints an input's first byte picks from.
pub const ENDPOINTS: [&str; 8] = [
    "/api/generate",
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
    "/api/show",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
];
/// The most tokens one input may ask to generate.
const MOST_TOKENS: u64 = 8;

/// A server for one model, driven without a socket.
pub struct Harness {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

impl Harness {
    /// Serve `model` (its name is its file stem) with a small context.
    pub fn new(model: &Path) -> Harness {
        let catalog = Catalog { files: vec![model.to_path_buf()], ..Catalog::default() };
        let run =
            RunSpec { n_ctx_seq: Some(256), n_batch: 64, n_threads: Some(1), repack: false, ..RunSpec::default() };
        let scheduler = SchedulerConfig {
            n_parallel: 1,
            max_queue: 4,
            default_keep_alive: KeepAlive::For(Duration::from_secs(3600)),
            run,
            embedding_context: 64,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let app = router(AppState::new(catalog, scheduler, HttpConfig::default()));
        Harness { runtime, app }
    }

    /// Send one input; the status, or why it failed (a 500 with its body).
    pub fn request(&self, input: &[u8]) -> Result<u16, String> {
        let Some((&pick, body)) = input.split_first() else { return Ok(0) };
        let path = ENDPOINTS[usize::from(pick) % ENDPOINTS.len()];
        let body = capped(path, body);
        let request = Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .expect("a request");
        self.runtime.block_on(async {
            let response = self.app.clone().oneshot(request).await.expect("the router answers");
            let status = response.status().as_u16();
            let bytes =
                axum::body::to_bytes(response.into_body(), 64 << 20).await.map_err(|error| error.to_string())?;
            if status == 500 {
                return Err(format!("{path}: 500 {}", String::from_utf8_lossy(&bytes)));
            }
            Ok(status)
        })
    }
}

/// The body with its generation length capped (and set where absent), where it is a JSON
/// object: Ollama's `options.num_predict`, OpenAI's `max_tokens` and `max_completion_tokens`.
fn capped(path: &str, body: &[u8]) -> Vec<u8> {
    let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return body.to_vec();
    };
    let cap = |value: &mut serde_json::Value| {
        if !value.as_f64().is_some_and(|number| (0.0..=MOST_TOKENS as f64).contains(&number)) {
            *value = MOST_TOKENS.into();
        }
    };
    if path.starts_with("/v1/") {
        cap(object.entry("max_tokens").or_insert(MOST_TOKENS.into()));
        if let Some(value) = object.get_mut("max_completion_tokens") {
            cap(value);
        }
    } else if let Some(options) = object.entry("options").or_insert_with(|| serde_json::json!({})).as_object_mut() {
        cap(options.entry("num_predict").or_insert(MOST_TOKENS.into()));
    }
    serde_json::to_vec(&object).expect("a JSON object")
}
