//! `hypura serve`: an HTTP server that speaks Ollama's API and OpenAI's, on top of `engine`.
//!
//! Data flow: a request is parsed into typed fields (`wire`; a bad body is a 400) and, for a
//! generation, into one `engine::GenerateRequest`; its model name is found in the `catalog`
//! (404 if unknown), and a lease from the `scheduler` (the registry of loaded models, its types
//! in `model`) hands the request to the model's `worker` thread, which batches it with the
//! model's other requests in one llama.cpp context. Text comes back through a channel and leaves
//! as NDJSON (`ollama`) or server-sent events (`openai`). `router` builds the whole service
//! without a socket, so tests drive it with `tower::ServiceExt::oneshot`; `serve` binds it.
pub mod catalog;
pub mod error;
pub mod fuzz;
pub mod generation;
pub mod grammar;
pub mod metrics;
pub mod model;
pub mod model_details;
pub mod ollama;
pub mod openai;
pub mod options;
pub mod pull;
pub mod scheduler;
pub mod tools;
pub mod wire;
pub mod worker;

use crate::sync::Lock;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, Method, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

pub use catalog::{Catalog, ModelEntry};
pub use error::AppError;
pub use model::SchedulerConfig;
pub use model_details::show_model;
pub use scheduler::Scheduler;

use model::{EmbedOutput, Lease};
use model_details::Details;

/// HTTP-level settings.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// Origins allowed by CORS besides localhost's (`*` allows any).
    pub cors_origins: Vec<String>,
    /// Largest request body accepted (413 beyond).
    pub body_limit_bytes: usize,
    /// Every request but `GET /`, `/api/version` and CORS preflights must carry
    /// `Authorization: Bearer <key>` (401 otherwise), as llama-server's `--api-key` asks.
    pub api_key: Option<ApiKey>,
    /// Serve `GET /metrics` (`--metrics`).
    pub metrics: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig { cors_origins: Vec::new(), body_limit_bytes: 16 << 20, api_key: None, metrics: false }
    }
}

/// The server's API key, kept as its SHA-256 so that a check compares two digests of one length
/// in time that does not depend on where they differ.
#[derive(Clone)]
pub struct ApiKey {
    digest: [u8; 32],
}

impl ApiKey {
    /// None for an empty key (after trimming whitespace, as a key file's newline).
    pub fn new(key: &str) -> Option<ApiKey> {
        let key = key.trim();
        (!key.is_empty()).then(|| ApiKey { digest: Self::digest(key) })
    }

    fn digest(key: &str) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(key.as_bytes()).into()
    }

    /// Whether `header` (an `Authorization` value) is `Bearer <this key>`.
    fn accepts(&self, header: Option<&HeaderValue>) -> bool {
        let Some(given) = header.and_then(|value| value.to_str().ok()) else { return false };
        let Some(given) = given.strip_prefix("Bearer ").or_else(|| given.strip_prefix("bearer ")) else { return false };
        let given = Self::digest(given.trim());
        given.iter().zip(&self.digest).fold(0u8, |differ, (a, b)| differ | (a ^ b)) == 0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("ApiKey(..)")
    }
}

/// The API key's check: open paths and preflights pass; anything else without the key gets a
/// 401 in the error shape of its API, and a log line that names the request, not the key.
async fn require_api_key(
    axum::extract::State(key): axum::extract::State<Option<ApiKey>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let Some(key) = key else { return next.run(request).await };
    let path = request.uri().path();
    let open = matches!(path, "/" | "/api/version" | "/health" | "/v1/health")
        && matches!(*request.method(), Method::GET | Method::HEAD);
    if open
        || request.method() == Method::OPTIONS
        || key.accepts(request.headers().get(axum::http::header::AUTHORIZATION))
    {
        return next.run(request).await;
    }
    let missing = !request.headers().contains_key(axum::http::header::AUTHORIZATION);
    tracing::warn!("401 for {} {path}: {} API key", request.method(), if missing { "no" } else { "a wrong" });
    let body = if path.starts_with("/v1/") {
        serde_json::json!({"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}})
    } else {
        serde_json::json!({"error": "unauthorized: a missing or wrong API key"})
    };
    let mut response = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    response.headers_mut().insert(axum::http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Everything a handler needs. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub catalog: Arc<Catalog>,
    pub scheduler: Scheduler,
    pub http: HttpConfig,
    /// The counters `/metrics` serves (`--metrics`; None: nothing is counted).
    pub metrics: Option<Arc<metrics::Metrics>>,
    /// `details` by file, keyed by its modification time, so listings do not re-read indexes.
    details_cache: Arc<Mutex<HashMap<PathBuf, (SystemTime, Details)>>>,
}

impl AppState {
    pub fn new(catalog: Catalog, scheduler: SchedulerConfig, http: HttpConfig) -> AppState {
        let scheduler = Scheduler::new(scheduler);
        let metrics = http.metrics.then(|| Arc::new(metrics::Metrics::new(scheduler.clone())));
        AppState { catalog: Arc::new(catalog), scheduler, http, metrics, details_cache: Arc::default() }
    }

    /// Where a generation on `endpoint` for `entry` counts its tokens (with `--metrics`).
    pub fn recorder(&self, endpoint: &'static str, entry: &ModelEntry) -> Option<metrics::Recorder> {
        self.metrics.as_ref().map(|metrics| metrics.recorder(endpoint, &entry.name))
    }

    /// Scan the catalog off the async runtime (it reads directories).
    pub async fn scan(&self) -> Result<Vec<ModelEntry>, AppError> {
        let catalog = self.catalog.clone();
        tokio::task::spawn_blocking(move || catalog.scan()).await.map_err(|error| AppError::internal(error.to_string()))
    }

    pub async fn resolve(&self, name: &str) -> Result<ModelEntry, AppError> {
        let catalog = self.catalog.clone();
        let name = name.to_string();
        tokio::task::spawn_blocking(move || catalog.resolve(&name))
            .await
            .map_err(|error| AppError::internal(error.to_string()))?
    }

    /// Ollama's `details` object for a model.
    pub async fn details(&self, entry: &ModelEntry) -> Result<serde_json::Value, AppError> {
        let cached = self
            .details_cache
            .locked()
            .get(&entry.path)
            .filter(|(modified, _)| *modified == entry.modified)
            .map(|(_, details)| details.clone());
        let details = match cached {
            Some(details) => details,
            None => {
                let path = entry.path.clone();
                let details = tokio::task::spawn_blocking(move || model_details::read_details(&path))
                    .await
                    .map_err(|error| AppError::internal(error.to_string()))??;
                self.details_cache.locked().insert(entry.path.clone(), (entry.modified, details.clone()));
                details
            }
        };
        Ok(model_details::details_object(&details))
    }

    pub async fn embed(&self, lease: Lease, inputs: Vec<String>, truncate: bool) -> Result<EmbedOutput, AppError> {
        ollama::run_embed(lease, inputs, truncate).await
    }
}

/// The whole service: both APIs, health and metrics, CORS and the body limit.
pub fn router(state: AppState) -> Router {
    let cors = cors_layer(&state.http.cors_origins);
    let body_limit = state.http.body_limit_bytes;
    let counted = state.metrics.clone();
    Router::new()
        .route("/", get(ollama::root))
        .route("/health", get(metrics::health))
        .route("/v1/health", get(metrics::health))
        .route("/metrics", get(metrics::metrics))
        .route("/api/version", get(ollama::version))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/pull", post(pull::pull))
        .route("/api/delete", axum::routing::delete(pull::delete))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{model}", get(openai::model))
        .route_layer(axum::middleware::from_fn_with_state(counted, metrics::count))
        .fallback(|| async { (StatusCode::NOT_FOUND, "404 page not found") })
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(state.http.api_key.clone(), require_api_key))
        .layer(cors)
        .with_state(state)
}

/// CORS: localhost origins always (any port, http or https), plus the configured ones.
fn cors_layer(origins: &[String]) -> CorsLayer {
    let any = origins.iter().any(|origin| origin == "*");
    let configured: Vec<String> =
        origins.iter().map(|origin| origin.trim_end_matches('/').to_ascii_lowercase()).collect();
    let allow = AllowOrigin::predicate(move |origin: &HeaderValue, _| {
        let Ok(origin) = origin.to_str() else { return false };
        let origin = origin.to_ascii_lowercase();
        any || configured.contains(&origin) || is_local_origin(&origin)
    });
    CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST, Method::HEAD, Method::OPTIONS, Method::DELETE])
        .allow_headers(AllowHeaders::mirror_request())
}

fn is_local_origin(origin: &str) -> bool {
    let Some(rest) = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://")) else { return false };
    let host = match rest.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().map(|host| format!("[{host}]")).unwrap_or_default(),
        None => rest.split(':').next().unwrap_or("").to_string(),
    };
    matches!(host.as_str(), "localhost" | "127.0.0.1" | "0.0.0.0" | "[::1]")
}

/// After a stop's bound, how long cancelled answers get to end and connections to close before
/// the server stops waiting for them.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serve on `listener`, unloading models whose `keep_alive` lapses, until `stop` resolves (the
/// first SIGTERM or Ctrl-C). Then drain: new requests get 503 and `/health` 503, running
/// answers go on for at most `timeout` and are then cancelled, and once the connections have
/// closed every model is unloaded, its prompt cache finishing the writes it holds.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    timeout: Duration,
) -> std::io::Result<()> {
    let scheduler = state.scheduler.clone();
    let reaper = tokio::spawn(async move {
        let mut ticks = tokio::time::interval(Duration::from_millis(500));
        loop {
            ticks.tick().await;
            scheduler.reap();
        }
    });
    let scheduler = state.scheduler.clone();
    let drained = Arc::new(tokio::sync::Notify::new());
    let drain = {
        let (scheduler, drained) = (scheduler.clone(), drained.clone());
        async move {
            stop.await;
            scheduler.drain();
            let running = scheduler.active_requests();
            tracing::info!("stopping: {running} request(s) running get {} s; new ones get 503", timeout.as_secs_f64());
            let finished = wait_idle(&scheduler, timeout).await;
            if !finished {
                let cancelled = scheduler.cancel_all();
                tracing::warn!(
                    "stopping: {cancelled} answer(s) still running after {} s cancelled",
                    timeout.as_secs_f64()
                );
                wait_idle(&scheduler, CLOSE_GRACE).await;
            }
            drained.notify_one();
        }
    };
    let app = router(state).into_make_service_with_connect_info::<SocketAddr>();
    let server = axum::serve(listener, app).with_graceful_shutdown(drain);
    // A client that keeps its connection after its answer was cancelled does not hold the stop.
    let result = tokio::select! {
        result = server => result,
        () = async { drained.notified().await; tokio::time::sleep(CLOSE_GRACE).await } => {
            tracing::warn!("stopping: connections still open {} s after the drain are closed", CLOSE_GRACE.as_secs());
            Ok(())
        }
    };
    reaper.abort();
    scheduler.unload_all();
    // Let the workers drop their engines (and finish writing their prompt caches).
    let waited = tokio::task::spawn_blocking(move || scheduler.wait_unloaded(Duration::from_secs(30))).await;
    if !waited.unwrap_or(false) {
        tracing::warn!("a model was still busy at shutdown");
    }
    result
}

/// Wait until no request holds a model, at most `limit`; returns whether none does.
async fn wait_idle(scheduler: &Scheduler, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while scheduler.active_requests() > 0 {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// Whether `path` is a GGUF file (by extension), for the command line.
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .and_then(|extension| extension.to_str())
        .is_some_and(|extension| extension.eq_ignore_ascii_case("gguf"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_origins() {
        for origin in ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8080", "http://[::1]:5173"] {
            assert!(is_local_origin(origin), "{origin}");
        }
        for origin in ["http://evil.com", "http://localhost.evil.com", "file://", "null"] {
            assert!(!is_local_origin(origin), "{origin}");
        }
    }
}
