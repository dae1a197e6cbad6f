//! Ollama's `/api/pull` and `/api/delete` over the hub (`crate::hub`): a pull streams Ollama's
//! NDJSON progress (`status`, `digest`, `total`, `completed`), as Open WebUI's model box and
//! the `ollama` client read it; a delete removes a pulled model's files.
//!
//! The name is resolved before the answer starts, so an unknown repository (404), a refused
//! token (401) or a bad name (400) is an ordinary error status; a failure during the download
//! is the stream's last line (`{"error": ...}`), as Ollama sends it.
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::error::AppError;
use super::wire::{ndjson_line, parse_body, stream_response};
use super::AppState;
use crate::hub::{Hub, HubError, Progress, Source};

#[derive(Deserialize)]
struct PullBody {
    model: Option<String>,
    name: Option<String>,
    #[serde(default = "yes")]
    stream: bool,
}

fn yes() -> bool {
    true
}

impl From<HubError> for AppError {
    fn from(error: HubError) -> AppError {
        let status = match &error {
            HubError::Name(_) | HubError::Refused(_) => StatusCode::BAD_REQUEST,
            HubError::NotFound(_) => StatusCode::NOT_FOUND,
            HubError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            HubError::Http { .. } | HubError::Io { .. } => StatusCode::BAD_GATEWAY,
        };
        AppError::new(status, error.to_string())
    }
}

/// The hub the catalog lists pulled models from, or the environment's.
fn hub(state: &AppState) -> Hub {
    state.catalog.hub.clone().unwrap_or_else(|| Hub::from_env(&crate::hw::default_cache_dir()))
}

fn model_name(model: Option<String>, name: Option<String>) -> Result<String, AppError> {
    model.or(name).filter(|name| !name.trim().is_empty()).ok_or_else(|| AppError::bad_request("model is required"))
}

/// Ollama's progress line for a step of the pull.
fn progress_line(progress: &Progress) -> serde_json::Value {
    match progress {
        Progress::Resolving => json!({"status": "pulling manifest"}),
        Progress::File { name, sha256, completed, total, .. } => {
            let mut line = json!({
                "status": match sha256 { Some(sha256) => format!("pulling {}", &sha256[..12]), None => format!("pulling {name}") },
                "completed": completed,
            });
            // Every progress line has a digest, as Ollama's do: clients (Open WebUI) read a line
            // with one as progress and any other as a message to show. Without the hub's hash,
            // the file's name.
            line["digest"] = json!(sha256.as_ref().map_or_else(|| name.clone(), |sha256| format!("sha256:{sha256}")));
            if let Some(total) = total {
                line["total"] = json!(total);
            }
            line
        }
        Progress::Verifying { .. } => json!({"status": "verifying sha256 digest"}),
        Progress::Done => json!({"status": "writing manifest"}),
    }
}

/// `POST /api/pull`.
pub async fn pull(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, AppError> {
    let body: PullBody = parse_body(body)?;
    let name = model_name(body.model, body.name)?;
    let source = Source::parse(&name).ok_or_else(|| {
        AppError::bad_request(format!(
            "{name:?}: Hypura pulls from the hub by hf.co/ORG/REPO[:QUANT], hf://ORG/REPO/FILE.gguf or an https:// URL"
        ))
    })??;
    let hub = hub(&state);
    let resolved = {
        let (hub, source) = (hub.clone(), source.clone());
        tokio::task::spawn_blocking(move || hub.resolve(&source))
            .await
            .map_err(|error| AppError::internal(error.to_string()))?
    }?;
    tracing::info!("pulling {} ({} file(s))", source.name(), resolved.len());
    let (sender, lines) = tokio::sync::mpsc::unbounded_channel::<serde_json::Value>();
    let pulling = tokio::task::spawn_blocking(move || {
        let _ = sender.send(progress_line(&Progress::Resolving));
        let mut last = std::time::Instant::now();
        let result = hub.pull_files(&source, &resolved, &mut |progress| {
            // Byte counts at most every 100 ms; every other step as it comes.
            let bytes = matches!(&progress, Progress::File { completed, total, .. } if Some(*completed) != *total);
            if !bytes || last.elapsed() >= std::time::Duration::from_millis(100) {
                last = std::time::Instant::now();
                let _ = sender.send(progress_line(&progress));
            }
        });
        match result {
            Ok(manifest) => {
                tracing::info!("pulled {}", manifest.name);
                let _ = sender.send(json!({"status": "success"}));
                Ok(())
            }
            Err(error) => {
                tracing::warn!("pull failed: {error}");
                let _ = sender.send(json!({"error": error.to_string()}));
                Err(AppError::from(error))
            }
        }
    });
    if !body.stream {
        drop(lines);
        let outcome = pulling.await.map_err(|error| AppError::internal(error.to_string()))?;
        outcome?;
        return Ok(Json(json!({"status": "success"})).into_response());
    }
    let stream = futures_util::stream::unfold(lines, |mut lines| async move {
        let line = lines.recv().await?;
        Some((Ok::<Bytes, std::convert::Infallible>(ndjson_line(&line)), lines))
    });
    Ok(stream_response("application/x-ndjson", stream))
}

#[derive(Deserialize)]
struct DeleteBody {
    model: Option<String>,
    name: Option<String>,
}

/// `DELETE /api/delete`: remove a pulled model (404 for a name that was not pulled).
pub async fn delete(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, AppError> {
    let body: DeleteBody = parse_body(body)?;
    let name = model_name(body.model, body.name)?;
    let hub = hub(&state);
    // The catalog's display name (lower case) or the name it was pulled as.
    let pulled = state.resolve(&name).await.ok().map(|entry| entry.path);
    let manifest = tokio::task::spawn_blocking(move || {
        let by_path = pulled.and_then(|path| hub.list().into_iter().find(|manifest| hub.path_of(manifest) == path));
        match by_path {
            Some(manifest) => hub.remove(&manifest.name),
            None => hub.remove(&name).map_err(|_| HubError::NotFound(format!("model '{name}' not found"))),
        }
    })
    .await
    .map_err(|error| AppError::internal(error.to_string()))??;
    tracing::info!("deleted {}", manifest.name);
    Ok(StatusCode::OK.into_response())
}
