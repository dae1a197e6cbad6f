//! Ollama's native API: `/`, `/api/version`, `/api/tags`, `/api/ps`, `/api/show`,
//! `/api/generate`, `/api/chat`, `/api/embed` and `/api/embeddings`, field by field as Ollama
//! answers them (see the research notes on its wire format). Generations stream NDJSON by
//! default; `stream: false` answers one object. Chat takes tools and tool results in its
//! history, and answers with `message.tool_calls` and `message.thinking` (`tools.rs`). What
//! Hypura does not do (images, `suffix`, `template` overrides) is refused with a 400 that says
//! so, never ignored.
use std::time::{Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::catalog::ModelEntry;
use super::error::AppError;
use super::generation::{self, done_reason};
use super::model::{EmbedJob, Event};
use super::options::{format_grammar, off_runtime, parse_options, RequestOptions};
use super::tools;
use super::wire::{nanos, ndjson_line, parse_body, rfc3339, stream_response, KeepAlive};
use super::AppState;
use crate::engine::Prompt;
use crate::engine::{ChatMessage, ChatRequest, Finished, GenerateRequest};

/// The Ollama version Hypura's API matches. Clients gate features on it, so it is Ollama's
/// numbering, not Hypura's.
pub const COMPATIBLE_VERSION: &str = "0.12.0";

pub async fn root() -> &'static str {
    "Ollama is running"
}

pub async fn version() -> Json<Value> {
    Json(json!({ "version": COMPATIBLE_VERSION, "hypura_version": env!("CARGO_PKG_VERSION") }))
}

pub async fn tags(State(state): State<AppState>) -> Result<Json<Value>, AppError> {
    let entries = state.scan().await?;
    let mut models = Vec::new();
    for entry in entries {
        let details = state.details(&entry).await.unwrap_or_else(|_| json!({"parent_model": "", "format": "gguf", "family": "", "families": null, "parameter_size": "", "quantization_level": ""}));
        models.push(json!({
            "name": entry.name,
            "model": entry.name,
            "modified_at": rfc3339(entry.modified),
            "size": entry.size,
            "digest": entry.digest,
            "details": details,
        }));
    }
    Ok(Json(json!({ "models": models })))
}

pub async fn ps(State(state): State<AppState>) -> Result<Json<Value>, AppError> {
    let mut models = Vec::new();
    for model in state.scheduler.loaded() {
        let Some(info) = model.info() else { continue };
        let details = state.details(&model.entry).await.unwrap_or(Value::Null);
        // "Forever" is far in the future, as Ollama shows it.
        let expires_at = model
            .expires_at()
            .unwrap_or_else(|| SystemTime::now() + std::time::Duration::from_secs(100 * 365 * 86_400));
        models.push(json!({
            "name": model.entry.name,
            "model": model.entry.name,
            "size": info.size_bytes,
            "digest": model.entry.digest,
            "details": details,
            "expires_at": rfc3339(expires_at),
            "size_vram": info.vram_bytes,
            "context_length": info.context_length,
            "hypura_mode": info.mode,
            "hypura_active_requests": model.active_requests(),
            "hypura_bytes_streamed": info.io.as_ref().map(|io| io.snapshot().bytes_read),
            "hypura_tiers": load_tiers(&info),
        }));
    }
    Ok(Json(json!({ "models": models })))
}

/// The expert hierarchy since the load, for `/api/ps`: the picks each tier served (a GPU pool's
/// slots, the host's expert cache, the disk) and the bytes read from disk (the host cache's warm
/// fill among them) and moved over the GPU's bus. None in modes that stream nothing.
fn load_tiers(info: &super::model::EngineInfo) -> Option<Value> {
    let io = info.io.as_ref()?.snapshot();
    let experts = info.experts.as_ref().map(|experts| experts.snapshot()).unwrap_or_default();
    let device = &experts.device;
    Some(json!({
        "expert_picks": { "gpu": device.hits, "host": experts.hits, "disk": experts.misses },
        "bytes": {
            "disk": io.bytes_read,
            "warm_fill": experts.warm_bytes,
            "bus": device.bus_bytes(),
        },
    }))
}

#[derive(Deserialize)]
struct ShowBody {
    model: Option<String>,
    name: Option<String>,
    #[serde(default)]
    verbose: bool,
}

pub async fn show(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Json<Value>, AppError> {
    let body: ShowBody = parse_body(body)?;
    let name = body
        .model
        .or(body.name)
        .filter(|name| !name.is_empty())
        .ok_or_else(|| AppError::bad_request("model is required"))?;
    let entry = state.resolve(&name).await?;
    let verbose = body.verbose;
    let path = entry.path.clone();
    let shown = tokio::task::spawn_blocking(move || super::show_model(&path, verbose))
        .await
        .map_err(|error| AppError::internal(error.to_string()))??;
    let mut object = shown;
    object.insert("modified_at".into(), json!(rfc3339(entry.modified)));
    served_context(&state, &entry.path, &mut object);
    Ok(Json(Value::Object(object)))
}

/// Clients size their prompts by `model_info["<arch>.context_length"]`: report the context the
/// server serves each request (the loaded context, or the one it will load with), and keep the
/// trained length beside it.
fn served_context(state: &AppState, path: &std::path::Path, object: &mut Map<String, Value>) {
    let Some(Value::Object(info)) = object.get_mut("model_info") else { return };
    let Some(arch) = info.get("general.architecture").and_then(Value::as_str).map(str::to_string) else { return };
    let key = format!("{arch}.context_length");
    let trained = info.get(&key).and_then(Value::as_u64).filter(|&trained| trained > 0);
    let loaded = state
        .scheduler
        .loaded()
        .into_iter()
        .find(|model| model.entry.path == path)
        .and_then(|model| model.info())
        .map(|info| info.context_length as u64);
    let configured = match state.scheduler.config().run.n_ctx_seq.map(u64::from) {
        Some(0) => trained,
        Some(asked) => Some(trained.map_or(asked, |trained| asked.min(trained))),
        None => state.scheduler.default_context(path).map(u64::from),
    };
    let Some(served) = loaded.or(configured) else { return };
    if let Some(trained) = trained {
        info.insert("hypura.context_length_trained".into(), json!(trained));
    }
    info.insert(key, json!(served));
}

/// Fields both generate and chat share.
#[derive(Deserialize)]
struct Common {
    format: Option<Value>,
    options: Option<Value>,
    stream: Option<bool>,
    keep_alive: Option<Value>,
    think: Option<Value>,
    /// Drop a conversation's oldest messages to fit the context (default), or refuse it.
    truncate: Option<bool>,
    /// Shift the context when the answer fills it (default), or end the answer there.
    shift: Option<bool>,
}

impl Common {
    /// Tokens a context shift keeps at the start, where the request shifts (Ollama's default).
    fn shift_keep(&self, options: &RequestOptions) -> Option<u32> {
        self.shift.unwrap_or(true).then_some(options.num_keep)
    }
}

#[derive(Deserialize)]
struct GenerateBody {
    model: Option<String>,
    prompt: Option<String>,
    suffix: Option<String>,
    system: Option<String>,
    template: Option<String>,
    context: Option<Vec<i32>>,
    #[serde(default)]
    raw: bool,
    images: Option<Vec<String>>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct MessageBody {
    role: String,
    content: Option<String>,
    images: Option<Vec<String>>,
    thinking: Option<String>,
    tool_calls: Option<Value>,
    tool_name: Option<String>,
    tool_call_id: Option<String>,
}

#[derive(Deserialize)]
struct ChatBody {
    model: Option<String>,
    messages: Option<Vec<MessageBody>>,
    tools: Option<Vec<Value>>,
    #[serde(flatten)]
    common: Common,
}

fn model_name(model: Option<String>) -> Result<String, AppError> {
    model.filter(|name| !name.is_empty()).ok_or_else(|| AppError::bad_request("model is required"))
}

fn keep_alive(value: Option<&Value>) -> Result<Option<KeepAlive>, AppError> {
    value.filter(|value| !value.is_null()).map(KeepAlive::parse).transpose()
}

fn check_images(name: &str, images: Option<&Vec<String>>) -> Result<(), AppError> {
    match images {
        Some(images) if !images.is_empty() => Err(AppError::bad_request(format!("\"{name}\" does not support images"))),
        _ => Ok(()),
    }
}

/// Insert the final object's fields: done, done_reason and the statistics (omitted when zero,
/// as Ollama's `omitempty` does).
fn final_fields(object: &mut Map<String, Value>, finished: &Finished, with_context: bool) {
    let stats = &finished.output.stats;
    object.insert("done".into(), json!(true));
    object.insert("done_reason".into(), json!(done_reason(finished.output.done_reason)));
    if with_context {
        let mut context = finished.prompt.clone();
        context.extend(&finished.output.tokens);
        object.insert("context".into(), json!(context));
    }
    let fields = [
        ("total_duration", nanos(stats.total_duration)),
        ("load_duration", nanos(stats.load_duration)),
        // Ollama counts the whole prompt, a reused prefix included.
        ("prompt_eval_count", finished.prompt.len() as u64),
        ("prompt_eval_duration", nanos(stats.prompt_eval_duration)),
        ("eval_count", u64::from(stats.eval_count)),
        ("eval_duration", nanos(stats.eval_duration)),
    ];
    for (key, value) in fields {
        if value > 0 {
            object.insert(key.into(), json!(value));
        }
    }
    // Hypura's own figures, the ones `run --stats` and `bench` print.
    object.insert("hypura_prompt_cached".into(), json!(stats.reused_prompt_tokens));
    if stats.dropped_messages > 0 {
        object.insert("hypura_messages_dropped".into(), json!(stats.dropped_messages));
    }
    if stats.context_shifts > 0 {
        object.insert("hypura_context_shifts".into(), json!(stats.context_shifts));
    }
    if stats.prompt_cache_tokens > 0 {
        object.insert("hypura_prompt_cache_loaded".into(), json!(stats.prompt_cache_tokens));
        object.insert("hypura_prompt_cache_bytes_read".into(), json!(stats.prompt_cache_bytes_read));
    }
    if let Some(io) = &stats.io {
        object.insert("hypura_bytes_read".into(), json!(io.bytes_read));
        object.insert(
            "hypura_stall_duration".into(),
            json!(nanos(std::time::Duration::from_secs_f64(io.stall_seconds.max(0.0)))),
        );
    }
    if let Some(experts) = &stats.experts {
        object.insert("hypura_expert_hit_rate".into(), json!(experts.hit_rate()));
        if experts.device.hits + experts.device.uploads + experts.device.staged_layers > 0 {
            object.insert("hypura_gpu_expert_hits".into(), json!(experts.device.hits));
            object.insert("hypura_gpu_expert_uploads".into(), json!(experts.device.uploads));
            object.insert("hypura_gpu_upload_bytes".into(), json!(experts.device.upload_bytes));
        }
    }
    // Where the weights came from: the expert picks each tier served, the bytes a pass over the
    // weights moved from disk and over the GPU's bus, and each link's rate while busy.
    if let Some(tiers) = stats.tiers() {
        object.insert(
            "hypura_tiers".into(),
            json!({
                "expert_picks": { "gpu": tiers.picks_gpu, "host": tiers.picks_host, "disk": tiers.picks_disk, "cpu": tiers.picks_cpu },
                "bytes_per_pass": {
                    "disk": tiers.disk_bytes_per_pass.round(),
                    "warm_fill": tiers.warm_bytes_per_pass.round(),
                    "bus": tiers.bus_bytes_per_pass.round(),
                },
                "bytes_per_sec": { "disk": tiers.disk_bytes_per_sec.map(f64::round), "bus": tiers.bus_bytes_per_sec.map(f64::round) },
            }),
        );
    }
    if let Some(peak) = crate::hw::peak_rss_bytes() {
        object.insert("hypura_peak_memory".into(), json!(peak));
    }
}

enum Shape {
    Generate { with_context: bool },
    Chat,
}

/// What one object carries: text, reasoning and (chat) tool calls; empty fields are left out,
/// as Ollama's `omitempty` does.
#[derive(Default)]
struct Piece<'a> {
    text: &'a str,
    thinking: &'a str,
    tool_calls: &'a [crate::engine::ToolCall],
}

impl Shape {
    fn object(&self, model: &str, piece: &Piece<'_>) -> Map<String, Value> {
        let mut object = Map::new();
        object.insert("model".into(), json!(model));
        object.insert("created_at".into(), json!(rfc3339(SystemTime::now())));
        match self {
            Shape::Generate { .. } => {
                object.insert("response".into(), json!(piece.text));
                if !piece.thinking.is_empty() {
                    object.insert("thinking".into(), json!(piece.thinking));
                }
            }
            Shape::Chat => {
                let mut message = json!({"role": "assistant", "content": piece.text});
                if !piece.thinking.is_empty() {
                    message["thinking"] = json!(piece.thinking);
                }
                if !piece.tool_calls.is_empty() {
                    message["tool_calls"] = tools::ollama_calls(piece.tool_calls);
                }
                object.insert("message".into(), message);
            }
        };
        object
    }

    fn chunk(&self, model: &str, piece: &Piece<'_>) -> Value {
        let mut object = self.object(model, piece);
        object.insert("done".into(), json!(false));
        Value::Object(object)
    }

    fn last(&self, model: &str, piece: &Piece<'_>, finished: &Finished) -> Value {
        let mut object = self.object(model, piece);
        final_fields(&mut object, finished, matches!(self, Shape::Generate { with_context: true }));
        Value::Object(object)
    }

    /// The answer to an empty prompt: the model was loaded (or unloaded).
    fn loaded(&self, model: &str, reason: &str) -> Value {
        let mut object = self.object(model, &Piece::default());
        object.insert("done".into(), json!(true));
        object.insert("done_reason".into(), json!(reason));
        Value::Object(object)
    }
}

pub async fn generate(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AppError> {
    let body: GenerateBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    if body.raw && (body.system.is_some() || body.template.is_some() || body.context.is_some()) {
        return Err(AppError::bad_request("raw mode does not support template, system, or context"));
    }
    if body.template.as_deref().is_some_and(|template| !template.is_empty()) {
        return Err(AppError::bad_request(
            "template overrides are not supported: Hypura renders the model's own chat template",
        ));
    }
    if body.suffix.as_deref().is_some_and(|suffix| !suffix.is_empty()) {
        return Err(AppError::bad_request(format!("\"{name}\" does not support insert")));
    }
    check_images(&name, body.images.as_ref())?;
    let think = tools::parse_think(body.common.think.as_ref())?;
    let keep_alive = keep_alive(body.common.keep_alive.as_ref())?;
    let options = parse_options(body.common.options.as_ref())?;
    let format = body.common.format.clone();
    let grammar = off_runtime(move || format_grammar(format.as_ref())).await?;
    let prompt = body.prompt.unwrap_or_default();
    let shape = Shape::Generate { with_context: !body.raw };
    if prompt.is_empty() && body.context.as_ref().is_none_or(Vec::is_empty) {
        return load_only(&state, &entry, &name, keep_alive, &shape).await;
    }
    let prompt = if body.raw {
        Prompt::Raw(prompt)
    } else {
        let mut messages = Vec::new();
        if let Some(system) = body.system.filter(|system| !system.is_empty()) {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", prompt));
        Prompt::Chat(ChatRequest { think, ..ChatRequest::new(messages) })
    };
    let request = GenerateRequest {
        context: body.context.unwrap_or_default(),
        grammar,
        shift_keep: body.common.shift_keep(&options),
        ..options.request(prompt)
    };
    respond(&state, &entry, name, keep_alive, request, body.common.stream.unwrap_or(true), shape).await
}

pub async fn chat(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, AppError> {
    let body: ChatBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    let tools = tools::parse_tools(body.tools)?;
    let think = tools::parse_think(body.common.think.as_ref())?;
    let keep_alive = keep_alive(body.common.keep_alive.as_ref())?;
    tracing::debug!(
        "chat {name}: {} tools, think {:?}, options {}",
        tools.len(),
        body.common.think,
        body.common.options.as_ref().map_or_else(|| "none".to_string(), |options| options.to_string())
    );
    let options = parse_options(body.common.options.as_ref())?;
    let format = body.common.format.clone();
    let grammar = off_runtime(move || format_grammar(format.as_ref())).await?;
    let mut messages = Vec::new();
    for message in body.messages.unwrap_or_default() {
        check_images(&name, message.images.as_ref())?;
        messages.push(ChatMessage {
            role: message.role.to_ascii_lowercase(),
            content: message.content.unwrap_or_default(),
            thinking: message.thinking,
            tool_calls: tools::parse_calls(message.tool_calls.as_ref())?,
            tool_name: message.tool_name,
            tool_call_id: message.tool_call_id,
        });
    }
    if messages.is_empty() {
        return load_only(&state, &entry, &name, keep_alive, &Shape::Chat).await;
    }
    tools::resolve_tool_names(&mut messages);
    let request = ChatRequest { tools, think, ..ChatRequest::new(messages) };
    let request = GenerateRequest {
        grammar,
        truncate_history: body.common.truncate.unwrap_or(true),
        shift_keep: body.common.shift_keep(&options),
        ..options.request(Prompt::Chat(request))
    };
    respond(&state, &entry, name, keep_alive, request, body.common.stream.unwrap_or(true), Shape::Chat).await
}

/// An empty prompt loads the model (`done_reason: "load"`), or with `keep_alive: 0` unloads it.
async fn load_only(
    state: &AppState,
    entry: &ModelEntry,
    name: &str,
    keep_alive: Option<KeepAlive>,
    shape: &Shape,
) -> Result<Response, AppError> {
    if keep_alive == Some(KeepAlive::For(std::time::Duration::ZERO)) {
        state.scheduler.unload(&entry.path);
        return Ok(Json(shape.loaded(name, "unload")).into_response());
    }
    let lease = state.scheduler.acquire(entry, keep_alive)?;
    lease.load().await?;
    Ok(Json(shape.loaded(name, "load")).into_response())
}

async fn respond(
    state: &AppState,
    entry: &ModelEntry,
    name: String,
    keep_alive: Option<KeepAlive>,
    request: GenerateRequest,
    stream: bool,
    shape: Shape,
) -> Result<Response, AppError> {
    let endpoint = match shape {
        Shape::Generate { .. } => "/api/generate",
        Shape::Chat => "/api/chat",
    };
    let recorder = state.recorder(endpoint, entry);
    let generation = generation::start(&state.scheduler, entry, keep_alive, request, recorder).await?;
    if !stream {
        let collected = generation.collect().await?;
        let message = collected.finished.output.message.as_ref();
        let piece = match message {
            Some(message) => {
                Piece { text: &message.content, thinking: &message.thinking, tool_calls: &message.tool_calls }
            }
            None => Piece { text: &collected.text, thinking: &collected.thinking, tool_calls: &[] },
        };
        return Ok(Json(shape.last(&name, &piece, &collected.finished)).into_response());
    }
    let lines = generation.into_stream().map(move |event| {
        let line = match event {
            Event::Text(text) => ndjson_line(&shape.chunk(&name, &Piece { text: &text, ..Piece::default() })),
            Event::Thinking(thinking) => {
                ndjson_line(&shape.chunk(&name, &Piece { thinking: &thinking, ..Piece::default() }))
            }
            Event::Done(finished) => {
                // The calls come whole, in a chunk of their own before the last line.
                let calls =
                    finished.output.message.as_ref().map(|message| message.tool_calls.as_slice()).unwrap_or_default();
                let mut lines = Vec::new();
                if !calls.is_empty() {
                    lines.extend_from_slice(&ndjson_line(
                        &shape.chunk(&name, &Piece { tool_calls: calls, ..Piece::default() }),
                    ));
                }
                lines.extend_from_slice(&ndjson_line(&shape.last(&name, &Piece::default(), &finished)));
                Bytes::from(lines)
            }
            Event::Failed(error) => ndjson_line(&json!({ "error": error.message })),
            // The stream passes over the admission.
            Event::Started => Bytes::new(),
        };
        Ok(line)
    });
    Ok(stream_response("application/x-ndjson", lines))
}

#[derive(Deserialize)]
struct EmbedBody {
    model: Option<String>,
    input: Option<Value>,
    truncate: Option<bool>,
    dimensions: Option<i64>,
    keep_alive: Option<Value>,
    #[allow(dead_code)] // Accepted for compatibility; embeddings take no sampling options.
    options: Option<Value>,
}

/// The inputs of an embed request: a string or a list of strings.
pub fn embed_inputs(input: Option<&Value>) -> Result<Vec<String>, AppError> {
    match input {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(text)) if text.is_empty() => Ok(Vec::new()),
        Some(Value::String(text)) => Ok(vec![text.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_string).ok_or_else(|| AppError::bad_request("invalid input type")))
            .collect(),
        Some(_) => Err(AppError::bad_request("invalid input type")),
    }
}

/// Cut to `dimensions` (if given) and scale to unit length.
pub fn normalise(mut vector: Vec<f32>, dimensions: Option<usize>) -> Vec<f32> {
    if let Some(dimensions) = dimensions {
        vector.truncate(dimensions);
    }
    let norm = vector.iter().map(|value| f64::from(*value) * f64::from(*value)).sum::<f64>().sqrt();
    if norm > 0.0 {
        for value in &mut vector {
            *value = (f64::from(*value) / norm) as f32;
        }
    }
    vector
}

pub fn dimensions(value: Option<i64>) -> Result<Option<usize>, AppError> {
    match value {
        None | Some(0) => Ok(None),
        Some(count) if count > 0 => Ok(Some(count as usize)),
        Some(count) => Err(AppError::bad_request(format!("dimensions must be positive, not {count}"))),
    }
}

pub async fn embed(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, AppError> {
    let started = Instant::now();
    let body: EmbedBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    let inputs = embed_inputs(body.input.as_ref())?;
    let dimensions = dimensions(body.dimensions)?;
    let keep_alive = keep_alive(body.keep_alive.as_ref())?;
    let lease = state.scheduler.acquire(&entry, keep_alive)?;
    if inputs.is_empty() {
        lease.load().await?;
        return Ok(Json(json!({ "model": name, "embeddings": [] })));
    }
    let output = state.embed(lease, inputs, body.truncate.unwrap_or(true)).await?;
    let embeddings: Vec<Vec<f32>> = output.vectors.into_iter().map(|vector| normalise(vector, dimensions)).collect();
    Ok(Json(json!({
        "model": name,
        "embeddings": embeddings,
        "total_duration": nanos(started.elapsed()),
        "load_duration": nanos(output.load_duration),
        "prompt_eval_count": output.prompt_tokens,
    })))
}

#[derive(Deserialize)]
struct EmbeddingsBody {
    model: Option<String>,
    prompt: Option<String>,
    keep_alive: Option<Value>,
    #[allow(dead_code)] // Accepted for compatibility; embeddings take no sampling options.
    options: Option<Value>,
}

/// The legacy endpoint: one un-normalised vector.
pub async fn embeddings(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, AppError> {
    let body: EmbeddingsBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    let keep_alive = keep_alive(body.keep_alive.as_ref())?;
    let lease = state.scheduler.acquire(&entry, keep_alive)?;
    let prompt = body.prompt.unwrap_or_default();
    if prompt.is_empty() {
        lease.load().await?;
        return Ok(Json(json!({ "embedding": [] })));
    }
    let mut output = state.embed(lease, vec![prompt], true).await?;
    let vector: Vec<f64> = output.vectors.pop().unwrap_or_default().into_iter().map(f64::from).collect();
    Ok(Json(json!({ "embedding": vector })))
}

/// Embed through the model's worker.
pub async fn run_embed(
    lease: super::model::Lease,
    inputs: Vec<String>,
    truncate: bool,
) -> Result<super::model::EmbedOutput, AppError> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    lease.embed(EmbedJob { inputs, truncate, reply })?;
    answer.await.map_err(|_| AppError::internal("the model's worker stopped before answering"))?
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::Router;
    use http_body_util::BodyExt;
    use serde_json::{json, Value};
    use tower::ServiceExt;

    use crate::server::wire::KeepAlive;
    use crate::server::{router, AppState, Catalog, HttpConfig, SchedulerConfig};
    use crate::setup::RunSpec;

    /// The forge's Qwen3 template, but opening the reasoning block when thinking is on (as
    /// Qwen3.5's and DeepSeek-R1's templates do): whatever a forged model writes is then
    /// reasoning, so a test can tell reasoning read apart from plain content.
    fn open_think_template() -> String {
        let closed = "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}";
        assert!(hypura_forge::QWEN3_TEMPLATE.contains(closed), "the forge's Qwen3 template changed");
        hypura_forge::QWEN3_TEMPLATE
            .replace(closed, "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}")
    }

    async fn generate(app: &Router, body: Value) -> Value {
        let request = Request::builder()
            .method("POST")
            .uri("/api/generate")
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&bytes));
        serde_json::from_slice(&bytes).unwrap()
    }

    /// A generate prompt after Ollama's `context` is rendered like any other: its answer's
    /// reasoning comes back as `thinking`, not as the response.
    #[tokio::test]
    async fn a_generate_after_a_context_splits_the_reasoning_out() {
        let directory = tempfile::tempdir().unwrap();
        let mut spec = hypura_forge::preset("tiny-qwen3").unwrap();
        spec.chat_template = Some(open_think_template());
        let path = directory.path().join("tiny-qwen3.gguf");
        hypura_forge::write_model(&spec, &path, &|_, _| {}).unwrap();
        let catalog = Catalog { files: vec![path], ..Catalog::default() };
        let run =
            RunSpec { n_ctx_seq: Some(512), n_batch: 256, n_threads: Some(2), repack: false, ..RunSpec::default() };
        let scheduler = SchedulerConfig {
            n_parallel: 1,
            max_queue: 1,
            default_keep_alive: KeepAlive::For(Duration::from_secs(60)),
            run,
            embedding_context: 64,
        };
        let app = router(AppState::new(catalog, scheduler, HttpConfig::default()));
        let options = json!({"temperature": 0, "num_predict": 6, "ignore_eos": true});
        let first = generate(&app, json!({"model": "tiny-qwen3", "prompt": "why is the sky blue", "think": true, "stream": false, "options": options})).await;
        assert!(first["thinking"].as_str().is_some_and(|thinking| !thinking.is_empty()), "{first}");
        assert_eq!(first["response"], "", "{first}");
        let context = first["context"].clone();
        let next = generate(&app, json!({"model": "tiny-qwen3", "prompt": "and the sea", "context": context, "think": true, "stream": false, "options": options})).await;
        assert!(next["thinking"].as_str().is_some_and(|thinking| !thinking.is_empty()), "{next}");
        assert_eq!(next["response"], "", "{next}");
        assert!(next["prompt_eval_count"].as_u64().unwrap() > context.as_array().unwrap().len() as u64, "{next}");
    }
}
