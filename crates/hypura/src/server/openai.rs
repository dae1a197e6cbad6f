//! The OpenAI-compatible API: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
//! `/v1/models` and `/v1/models/{model}`, translated onto the same scheduler as Ollama's API.
//!
//! As Ollama does: `stream` defaults to false; omitted `temperature` and `top_p` mean 1.0;
//! streams are server-sent events ending in `data: [DONE]`, with a role chunk first, a finish
//! chunk with `finish_reason`, and a usage chunk when `stream_options.include_usage` is set;
//! errors use OpenAI's `{"error": {"message", "type", "param", "code"}}`, and an error in the
//! middle of a stream is one `data: {"error": ...}` event. `/v1/completions` sends the prompt
//! to the model as is (no chat template), which is what a completion is. Chat takes `tools`,
//! `tool_choice` and `reasoning_effort`, and answers with `tool_calls` (ids, JSON-string
//! arguments, `finish_reason: "tool_calls"`) and `reasoning_content`.
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{AppError, OpenAiError};
use super::generation::{self, done_reason};
use super::model::Event;
use super::ollama::{dimensions, embed_inputs, normalise};
use super::options::{float, integer, max_tokens, seed, RequestOptions};
use super::tools;
use super::wire::{parse_body, sse_event, stream_response, unix_seconds};
use super::AppState;
use crate::engine::Prompt;
use crate::engine::{ChatMessage, ChatRequest, Finished, GenerateRequest, SamplerParams};

type OpenAiResult<T> = Result<T, OpenAiError>;

const FINGERPRINT: &str = "fp_hypura";

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Sampling fields both completion endpoints share.
#[derive(Deserialize)]
struct Sampling {
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
    temperature: Option<Value>,
    top_p: Option<Value>,
    seed: Option<Value>,
    stop: Option<Value>,
    frequency_penalty: Option<Value>,
    presence_penalty: Option<Value>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<Value>,
}

impl Sampling {
    fn options(&self) -> Result<RequestOptions, AppError> {
        let present = |value: &Option<Value>| value.as_ref().filter(|value| !value.is_null()).cloned();
        let mut sampling = SamplerParams {
            temperature: 1.0,
            top_p: 1.0,
            seed: super::options::random_seed(),
            ..SamplerParams::default()
        };
        if let Some(value) = present(&self.temperature) {
            sampling.temperature = float("temperature", &value)?;
        }
        if let Some(value) = present(&self.top_p) {
            sampling.top_p = float("top_p", &value)?;
        }
        if let Some(value) = present(&self.frequency_penalty) {
            sampling.frequency_penalty = float("frequency_penalty", &value)?;
        }
        if let Some(value) = present(&self.presence_penalty) {
            sampling.presence_penalty = float("presence_penalty", &value)?;
        }
        if let Some(value) = present(&self.seed) {
            sampling.seed = seed(integer("seed", &value)?);
        }
        let max = match present(&self.max_tokens).or_else(|| present(&self.max_completion_tokens)) {
            Some(value) => max_tokens(integer("max_tokens", &value)?),
            None => None,
        };
        let stop = match present(&self.stop) {
            None => Vec::new(),
            Some(Value::String(text)) => vec![text],
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| AppError::bad_request("stop must be a string or a list of strings"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(AppError::bad_request("stop must be a string or a list of strings")),
        };
        if let Some(count) = present(&self.n) {
            if integer("n", &count)? != 1 {
                return Err(AppError::bad_request("only n = 1 is supported"));
            }
        }
        Ok(RequestOptions { sampling, max_tokens: max, stop, ..RequestOptions::default() })
    }

    fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|options| options.include_usage)
    }
}

#[derive(Deserialize)]
struct ChatBody {
    model: Option<String>,
    messages: Option<Vec<MessageBody>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    reasoning_effort: Option<String>,
    response_format: Option<Value>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Deserialize)]
struct MessageBody {
    role: String,
    content: Option<Value>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

#[derive(Deserialize)]
struct CompletionBody {
    model: Option<String>,
    prompt: Option<Value>,
    suffix: Option<String>,
    #[serde(flatten)]
    sampling: Sampling,
}

fn model_name(model: Option<String>) -> Result<String, AppError> {
    model.filter(|name| !name.is_empty()).ok_or_else(|| AppError::bad_request("model is required"))
}

/// Message content: a string, or a list of parts of which only text is supported.
fn content_text(content: Option<Value>) -> Result<String, AppError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(text)) => Ok(text),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => text.push_str(part.get("text").and_then(Value::as_str).unwrap_or("")),
                    Some(kind) => {
                        return Err(AppError::bad_request(format!("content parts of type {kind:?} are not supported")))
                    }
                    None => return Err(AppError::bad_request("a content part has no type")),
                }
            }
            Ok(text)
        }
        Some(other) => Err(AppError::bad_request(format!("invalid message content: {other}"))),
    }
}

/// `response_format`: text, `json_object` (any JSON object) or `json_schema`.
fn response_grammar(format: Option<&Value>) -> Result<Option<String>, AppError> {
    let Some(format) = format.filter(|format| !format.is_null()) else { return Ok(None) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => super::options::format_grammar(Some(&json!("json"))),
        Some("json_schema") => {
            let schema = format
                .pointer("/json_schema/schema")
                .ok_or_else(|| AppError::bad_request("response_format json_schema needs json_schema.schema"))?;
            super::options::format_grammar(Some(schema))
        }
        _ => Err(AppError::bad_request(format!("invalid response_format: {format}"))),
    }
}

fn next_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos =
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|elapsed| elapsed.as_nanos() as u64).unwrap_or(0);
    format!("{prefix}-{:x}{:04x}", nanos & 0xffff_ffff_ffff, COUNTER.fetch_add(1, Ordering::Relaxed) & 0xffff)
}

fn usage(finished: &Finished) -> Value {
    let prompt = finished.prompt.len();
    let completion = finished.output.tokens.len();
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

/// Chat and text completions differ only in their objects' shapes.
#[derive(Clone)]
enum Kind {
    Chat,
    Text,
}

struct Envelope {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Envelope {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "system_fingerprint": FINGERPRINT, "choices": choices })
    }

    fn delta(&self, text: &str) -> Value {
        match self.kind {
            Kind::Chat => self.chat_delta(json!({ "content": text })),
            Kind::Text => self.chunk(json!([{ "index": 0, "text": text, "finish_reason": null }])),
        }
    }

    /// A chat delta: the opening role, content, reasoning, or the answer's tool calls.
    fn chat_delta(&self, delta: Value) -> Value {
        self.chunk(json!([{ "index": 0, "delta": delta, "finish_reason": null }]))
    }

    fn finish(&self, finished: &Finished) -> Value {
        let reason = finish_reason(finished);
        match self.kind {
            Kind::Chat => self.chunk(json!([{ "index": 0, "delta": {}, "finish_reason": reason }])),
            Kind::Text => self.chunk(json!([{ "index": 0, "text": "", "finish_reason": reason }])),
        }
    }

    fn usage_chunk(&self, finished: &Finished) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = usage(finished);
        chunk
    }

    fn whole(&self, text: &str, thinking: &str, finished: &Finished) -> Value {
        let reason = finish_reason(finished);
        let (object, choice) = match self.kind {
            Kind::Chat => {
                let mut message = json!({ "role": "assistant", "content": text });
                if !thinking.is_empty() {
                    // llama.cpp's field, and Ollama's.
                    message["reasoning_content"] = json!(thinking);
                    message["reasoning"] = json!(thinking);
                }
                if let Some(calls) = tool_calls(finished) {
                    message["tool_calls"] = tools::openai_calls(calls);
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                ("chat.completion", json!({ "index": 0, "message": message, "finish_reason": reason }))
            }
            Kind::Text => ("text_completion", json!({ "index": 0, "text": text, "finish_reason": reason })),
        };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "system_fingerprint": FINGERPRINT, "choices": [choice], "usage": usage(finished) })
    }
}

/// The answer's tool calls, if it made any.
fn tool_calls(finished: &Finished) -> Option<&[crate::engine::ToolCall]> {
    finished.output.message.as_ref().map(|message| message.tool_calls.as_slice()).filter(|calls| !calls.is_empty())
}

/// "tool_calls" when the answer ended by calling tools.
fn finish_reason(finished: &Finished) -> &'static str {
    match (finished.output.done_reason, tool_calls(finished)) {
        (crate::engine::DoneReason::Stop, Some(_)) => "tool_calls",
        (reason, _) => done_reason(reason),
    }
}

pub async fn chat_completions(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> OpenAiResult<Response> {
    let body: ChatBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    let tools = tools::parse_tools(body.tools)?;
    let tool_choice = tools::parse_tool_choice(body.tool_choice.as_ref(), &tools)?;
    let think = body.reasoning_effort.as_deref().map(tools::reasoning_effort).transpose()?.flatten();
    let messages = body.messages.unwrap_or_default();
    if messages.is_empty() {
        return Err(AppError::bad_request("[] is too short - 'messages'").into());
    }
    let mut messages = messages
        .into_iter()
        .map(|message| {
            let role = message.role.to_ascii_lowercase();
            Ok(ChatMessage {
                content: content_text(message.content)?,
                thinking: message.reasoning_content.or(message.reasoning),
                tool_calls: tools::parse_calls(message.tool_calls.as_ref())?,
                tool_name: message.name.filter(|_| role == "tool"),
                tool_call_id: message.tool_call_id,
                role,
            })
        })
        .collect::<Result<Vec<_>, AppError>>()?;
    tools::resolve_tool_names(&mut messages);
    let options = body.sampling.options()?;
    let format = body.response_format.clone();
    let grammar = super::options::off_runtime(move || response_grammar(format.as_ref())).await?;
    let request = ChatRequest { tools, tool_choice, think, ..ChatRequest::new(messages) };
    let request = GenerateRequest { grammar, ..options.request(Prompt::Chat(request)) };
    let envelope =
        Envelope { kind: Kind::Chat, id: next_id("chatcmpl"), created: unix_seconds(SystemTime::now()), model: name };
    respond(&state, &entry, request, envelope, body.sampling.stream, body.sampling.include_usage()).await
}

pub async fn completions(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> OpenAiResult<Response> {
    let body: CompletionBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    if body.suffix.as_deref().is_some_and(|suffix| !suffix.is_empty()) {
        return Err(AppError::bad_request(format!("\"{name}\" does not support insert")).into());
    }
    let prompt = match body.prompt {
        Some(Value::String(text)) => text,
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        _ => return Err(AppError::bad_request("prompt must be a string").into()),
    };
    if prompt.is_empty() {
        return Err(AppError::bad_request("prompt is empty").into());
    }
    let options = body.sampling.options()?;
    let request = options.request(Prompt::Raw(prompt));
    let envelope =
        Envelope { kind: Kind::Text, id: next_id("cmpl"), created: unix_seconds(SystemTime::now()), model: name };
    respond(&state, &entry, request, envelope, body.sampling.stream, body.sampling.include_usage()).await
}

async fn respond(
    state: &AppState,
    entry: &super::catalog::ModelEntry,
    request: GenerateRequest,
    envelope: Envelope,
    stream: bool,
    include_usage: bool,
) -> OpenAiResult<Response> {
    let endpoint = match envelope.kind {
        Kind::Chat => "/v1/chat/completions",
        Kind::Text => "/v1/completions",
    };
    let recorder = state.recorder(endpoint, entry);
    let generation = generation::start(&state.scheduler, entry, None, request, recorder).await?;
    if !stream {
        let collected = generation.collect().await?;
        let (text, thinking) = match &collected.finished.output.message {
            Some(message) => (message.content.as_str(), message.thinking.as_str()),
            None => (collected.text.as_str(), collected.thinking.as_str()),
        };
        return Ok(Json(envelope.whole(text, thinking, &collected.finished)).into_response());
    }
    // A chat stream opens with the role chunk at once, as llama-server's and OpenAI's do: the
    // client has its headers and a first line before the prompt is evaluated.
    let role = matches!(envelope.kind, Kind::Chat).then(|| {
        Ok::<_, std::convert::Infallible>(sse_event(
            &envelope.chat_delta(json!({ "role": "assistant", "content": "" })),
        ))
    });
    let events = generation.into_stream().map(move |event| {
        let mut bytes = Vec::new();
        match event {
            Event::Text(text) => bytes.extend_from_slice(&sse_event(&envelope.delta(&text))),
            Event::Thinking(thinking) => bytes.extend_from_slice(&sse_event(
                &envelope.chat_delta(json!({ "reasoning_content": thinking, "reasoning": thinking })),
            )),
            Event::Done(finished) => {
                if let Some(calls) = tool_calls(&finished) {
                    bytes.extend_from_slice(&sse_event(
                        &envelope.chat_delta(json!({ "tool_calls": tools::openai_calls(calls) })),
                    ));
                }
                bytes.extend_from_slice(&sse_event(&envelope.finish(&finished)));
                if include_usage {
                    bytes.extend_from_slice(&sse_event(&envelope.usage_chunk(&finished)));
                }
                bytes.extend_from_slice(b"data: [DONE]\n\n");
            }
            Event::Failed(error) => bytes.extend_from_slice(&sse_event(&OpenAiError::body(&error))),
            // The stream passes over the admission.
            Event::Started => {}
        }
        Ok(Bytes::from(bytes))
    });
    Ok(stream_response("text/event-stream", futures_util::stream::iter(role).chain(events)))
}

#[derive(Deserialize)]
struct EmbeddingsBody {
    model: Option<String>,
    input: Option<Value>,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
}

pub async fn embeddings(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> OpenAiResult<Json<Value>> {
    let body: EmbeddingsBody = parse_body(body)?;
    let name = model_name(body.model)?;
    let entry = state.resolve(&name).await?;
    let inputs = match &body.input {
        Some(Value::String(text)) if text.is_empty() => vec![String::new()],
        Some(Value::Array(items)) if items.is_empty() => return Err(AppError::bad_request("invalid input").into()),
        None | Some(Value::Null) => return Err(AppError::bad_request("invalid input").into()),
        input => embed_inputs(input.as_ref())?,
    };
    let base64 = match body.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(AppError::bad_request(format!("invalid encoding_format {other:?}: use float or base64")).into())
        }
    };
    let dimensions = dimensions(body.dimensions)?;
    let lease = state.scheduler.acquire(&entry, None)?;
    let output = state.embed(lease, inputs, true).await?;
    let data: Vec<Value> = output
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, vector)| {
            let vector = normalise(vector, dimensions);
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|value| value.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({ "object": "embedding", "embedding": embedding, "index": index })
        })
        .collect();
    Ok(Json(
        json!({ "object": "list", "data": data, "model": name, "usage": { "prompt_tokens": output.prompt_tokens, "total_tokens": output.prompt_tokens } }),
    ))
}

fn model_object(entry: &super::catalog::ModelEntry) -> Value {
    json!({ "id": entry.name, "object": "model", "created": unix_seconds(entry.modified), "owned_by": entry.owner })
}

pub async fn models(State(state): State<AppState>) -> OpenAiResult<Json<Value>> {
    let entries = state.scan().await?;
    let data: Vec<Value> = entries.iter().map(model_object).collect();
    Ok(Json(json!({ "object": "list", "data": data })))
}

pub async fn model(State(state): State<AppState>, Path(name): Path<String>) -> OpenAiResult<Json<Value>> {
    let entry = state.resolve(&name).await?;
    Ok(Json(model_object(&entry)))
}
