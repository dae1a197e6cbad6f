//! The HTTP server through its router, without a socket (`tower::ServiceExt::oneshot`): every
//! endpoint, every error code, streaming framing, the queue bound, cancellation by dropping the
//! response, and parallel sequences giving the same answers as one at a time.
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use axum::Router;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use hypura::server::wire::KeepAlive;
use hypura::server::{router, AppState, Catalog, HttpConfig, SchedulerConfig};
use hypura::setup::RunSpec;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::common;

/// How the test models load: batch-invariant kernels (`hypura serve --batch-invariant`), so
/// parallel sequences give exactly the answers they give alone.
fn run() -> RunSpec {
    RunSpec {
        n_ctx_seq: Some(512),
        n_batch: 256,
        n_threads: Some(2),
        repack: false,
        batch_invariant: true,
        ..RunSpec::default()
    }
}

fn app_with(files: Vec<PathBuf>, n_parallel: u32, max_queue: usize, http: HttpConfig) -> Router {
    let catalog = Catalog { files, ..Catalog::default() };
    let scheduler = SchedulerConfig {
        n_parallel,
        max_queue,
        default_keep_alive: KeepAlive::For(Duration::from_secs(300)),
        run: run(),
        embedding_context: 128,
    };
    router(AppState::new(catalog, scheduler, http))
}

fn app(files: Vec<PathBuf>) -> Router {
    app_with(files, 4, 8, HttpConfig::default())
}

struct Reply {
    status: StatusCode,
    content_type: String,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|error| panic!("{error}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn lines(&self) -> Vec<Value> {
        let text = String::from_utf8(self.body.clone()).unwrap();
        assert!(text.ends_with('\n'), "{text}");
        text.split_terminator('\n')
            .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("{error}: {line:?}")))
            .collect()
    }

    fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error string: {}", String::from_utf8_lossy(&self.body)))
            .to_string()
    }
}

fn request(method: Method, uri: &str, body: Option<&str>) -> Request<Body> {
    let builder = Request::builder().method(method).uri(uri).header("content-type", "application/json");
    builder.body(body.map(|text| Body::from(text.to_string())).unwrap_or_else(Body::empty)).unwrap()
}

async fn call(app: &Router, method: Method, uri: &str, body: Option<&str>) -> Reply {
    send(app, request(method, uri, body)).await
}

async fn send(app: &Router, request: Request<Body>) -> Reply {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type =
        response.headers().get("content-type").map(|value| value.to_str().unwrap().to_string()).unwrap_or_default();
    let body = response.into_body().collect().await.unwrap().to_bytes().to_vec();
    Reply { status, content_type, body }
}

async fn post(app: &Router, uri: &str, body: Value) -> Reply {
    call(app, Method::POST, uri, Some(&body.to_string())).await
}

fn tiny(directory: &Path) -> PathBuf {
    common::forge("tiny-dense-1b", directory)
}

const MODEL: &str = "tiny-dense-1b";

#[tokio::test]
async fn meta_endpoints_answer_like_ollama() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);

    let root = call(&app, Method::GET, "/", None).await;
    assert_eq!((root.status, root.body.as_slice()), (StatusCode::OK, b"Ollama is running".as_slice()));
    assert!(root.content_type.starts_with("text/plain"), "{}", root.content_type);
    let head = call(&app, Method::HEAD, "/", None).await;
    assert_eq!(head.status, StatusCode::OK);
    assert!(head.body.is_empty());

    let version = call(&app, Method::GET, "/api/version", None).await;
    assert!(version.json()["version"].as_str().unwrap().contains('.'));

    let tags = call(&app, Method::GET, "/api/tags", None).await.json();
    let model = &tags["models"][0];
    assert_eq!(model["name"], "tiny-dense-1b:latest");
    assert_eq!(model["details"]["format"], "gguf");
    assert_eq!(model["details"]["family"], "llama");
    assert!(model["size"].as_u64().unwrap() > 0);
    assert!(model["modified_at"].as_str().unwrap().ends_with('Z'));

    assert_eq!(call(&app, Method::GET, "/api/ps", None).await.json(), json!({"models": []}));

    let models = call(&app, Method::GET, "/v1/models", None).await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "tiny-dense-1b:latest");
    assert_eq!(models["data"][0]["owned_by"], "library");
    let one = call(&app, Method::GET, "/v1/models/tiny-dense-1b", None).await;
    assert_eq!(one.json()["id"], "tiny-dense-1b:latest");
    let missing = call(&app, Method::GET, "/v1/models/nothing", None).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.json()["error"]["type"], "not_found_error");

    let show = post(&app, "/api/show", json!({"model": MODEL})).await;
    assert_eq!(show.status, StatusCode::OK);
    let show = show.json();
    assert_eq!(show["model_info"]["general.architecture"], "llama");
    assert!(show["model_info"]["general.parameter_count"].as_u64().unwrap() > 0);
    assert_eq!(show["model_info"]["tokenizer.ggml.tokens"], json!([]), "long arrays are emptied unless verbose");
    assert_eq!(show["capabilities"], json!(["completion", "embedding"]));
    // The context each request is served (the test server's 512), not the trained one.
    assert_eq!(show["model_info"]["llama.context_length"], 512);
    assert!(show["model_info"]["hypura.context_length_trained"].as_u64().unwrap() > 512);
    let verbose = post(&app, "/api/show", json!({"name": MODEL, "verbose": true})).await.json();
    assert!(verbose["model_info"]["tokenizer.ggml.tokens"].as_array().unwrap().len() > 64);
    assert!(!verbose["tensors"].as_array().unwrap().is_empty());

    assert_eq!(call(&app, Method::GET, "/api/nothing", None).await.status, StatusCode::NOT_FOUND);
    assert_eq!(call(&app, Method::GET, "/api/chat", None).await.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn bad_requests_get_400_and_unknown_models_404() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app =
        app_with(vec![tiny(directory.path())], 1, 1, HttpConfig { body_limit_bytes: 4096, ..HttpConfig::default() });

    for uri in ["/api/generate", "/api/chat", "/api/show", "/api/embed", "/api/embeddings"] {
        let empty = call(&app, Method::POST, uri, None).await;
        assert_eq!((empty.status, empty.error().as_str()), (StatusCode::BAD_REQUEST, "missing request body"), "{uri}");
        let malformed = call(&app, Method::POST, uri, Some("{\"model\": ")).await;
        assert_eq!(malformed.status, StatusCode::BAD_REQUEST, "{uri}");
        assert!(!malformed.error().is_empty());
        let unknown = post(
            &app,
            uri,
            json!({"model": "nothing", "prompt": "x", "input": "x", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
        assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{uri}");
        assert!(unknown.error().contains("not found"), "{uri}: {}", unknown.error());
        let invalid = post(&app, uri, json!({"model": "../../etc/passwd", "prompt": "x"})).await;
        assert_eq!(
            (invalid.status, invalid.error().as_str()),
            (StatusCode::BAD_REQUEST, "invalid model name"),
            "{uri}"
        );
        let nameless = post(&app, uri, json!({"prompt": "x"})).await;
        assert_eq!(
            (nameless.status, nameless.error().as_str()),
            (StatusCode::BAD_REQUEST, "model is required"),
            "{uri}"
        );
    }
    let cases = [
        (json!({"model": MODEL, "prompt": 5}), "invalid type"),
        (
            json!({"model": MODEL, "prompt": "x", "options": {"temperature": "hot"}}),
            "option \"temperature\" must be of type float32",
        ),
        (json!({"model": MODEL, "prompt": "x", "options": {"stop": "x"}}), "must be of type []string"),
        (json!({"model": MODEL, "prompt": "x", "options": {"top_p": 3.0}}), "top_p"),
        (
            json!({"model": MODEL, "prompt": "x", "raw": true, "system": "s"}),
            "raw mode does not support template, system, or context",
        ),
        (json!({"model": MODEL, "prompt": "x", "think": true}), "does not support thinking"),
        (json!({"model": MODEL, "prompt": "x", "images": ["aGk="]}), "does not support images"),
        (json!({"model": MODEL, "prompt": "x", "suffix": "y"}), "does not support insert"),
        (json!({"model": MODEL, "prompt": "x", "format": "xml"}), "invalid format"),
        (json!({"model": MODEL, "prompt": "x", "format": {"type": "thing"}}), "unknown type"),
        (json!({"model": MODEL, "prompt": "x", "keep_alive": "soon"}), "invalid duration"),
        (json!({"model": MODEL, "prompt": "x", "context": [999_999_999]}), "outside the vocabulary"),
        // Worded so that agents' overflow detectors compact and retry.
        (json!({"model": MODEL, "prompt": "word ".repeat(600)}), "the prompt is too long"),
        (json!({"model": MODEL, "prompt": "word ".repeat(600)}), "exceed the context length of 512"),
    ];
    for (body, expected) in cases {
        let reply = post(&app, "/api/generate", body.clone()).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}: {}", String::from_utf8_lossy(&reply.body));
        assert!(reply.error().contains(expected), "{body}: {:?} lacks {expected:?}", reply.error());
    }
    let tools = post(&app, "/api/chat", json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]})).await;
    assert_eq!(tools.status, StatusCode::BAD_REQUEST);
    assert!(tools.error().contains("does not support tools"));
    let empty_tools = post(&app, "/api/chat", json!({"model": MODEL, "messages": [], "tools": []})).await;
    assert_eq!(empty_tools.status, StatusCode::OK, "the Python client always sends tools: []");

    let too_big = post(&app, "/api/generate", json!({"model": MODEL, "prompt": "x".repeat(8192)})).await;
    assert_eq!(too_big.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(!too_big.error().is_empty());

    // OpenAI's routes answer in OpenAI's shape.
    let openai =
        post(&app, "/v1/chat/completions", json!({"model": "nothing", "messages": [{"role": "user", "content": "x"}]}))
            .await;
    assert_eq!(openai.status, StatusCode::NOT_FOUND);
    let error = &openai.json()["error"];
    assert_eq!(error["type"], "not_found_error");
    assert!(error["message"].as_str().unwrap().contains("not found"));
    assert!(error.get("param").is_some() && error.get("code").is_some());
    let no_messages = post(&app, "/v1/chat/completions", json!({"model": MODEL, "messages": []})).await;
    assert_eq!(no_messages.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_messages.json()["error"]["type"], "invalid_request_error");
    let malformed = call(&app, Method::POST, "/v1/completions", Some("[")).await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(malformed.json()["error"]["type"], "invalid_request_error");
    let bad_encoding =
        post(&app, "/v1/embeddings", json!({"model": MODEL, "input": "x", "encoding_format": "hex"})).await;
    assert_eq!(bad_encoding.status, StatusCode::BAD_REQUEST);
    let bad_input = post(&app, "/api/embed", json!({"model": MODEL, "input": [1, 2]})).await;
    assert_eq!((bad_input.status, bad_input.error().as_str()), (StatusCode::BAD_REQUEST, "invalid input type"));
}

#[tokio::test]
async fn generate_streams_ndjson_and_answers_whole_objects() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);
    let options = json!({"temperature": 0, "num_predict": 8});

    let stream =
        post(&app, "/api/generate", json!({"model": MODEL, "prompt": "once upon a time", "options": options})).await;
    assert_eq!(stream.status, StatusCode::OK);
    assert_eq!(stream.content_type, "application/x-ndjson");
    let lines = stream.lines();
    let (last, chunks) = lines.split_last().unwrap();
    assert!(chunks
        .iter()
        .all(|chunk| chunk["done"] == false && chunk["model"] == MODEL && chunk["created_at"].is_string()));
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 8);
    for key in ["total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_duration"] {
        assert!(last[key].as_u64().is_some_and(|value| value > 0), "{key}: {last}");
    }
    let streamed: String = lines.iter().map(|line| line["response"].as_str().unwrap()).collect();

    let whole = post(
        &app,
        "/api/generate",
        json!({"model": MODEL, "prompt": "once upon a time", "options": options, "stream": false}),
    )
    .await;
    assert!(whole.content_type.starts_with("application/json"), "{}", whole.content_type);
    let whole = whole.json();
    assert_eq!(whole["response"], streamed.as_str(), "greedy answers are the same streamed or not");
    assert!(whole.get("load_duration").is_none() || whole["load_duration"].as_u64().unwrap() < 1_000_000_000);
    let context: Vec<i64> = serde_json::from_value(whole["context"].clone()).unwrap();
    assert_eq!(context.len() as u64, whole["prompt_eval_count"].as_u64().unwrap() + 8);

    // The context continues the conversation: its tokens come first.
    let next = post(
        &app,
        "/api/generate",
        json!({"model": MODEL, "prompt": "and then", "context": context, "stream": false, "options": options}),
    )
    .await
    .json();
    assert!(next["prompt_eval_count"].as_u64().unwrap() > context.len() as u64);

    // Raw prompts carry no context; stop strings are cut with what follows.
    let raw = post(&app, "/api/generate", json!({"model": MODEL, "prompt": "the king", "raw": true, "stream": false, "options": {"temperature": 0, "num_predict": 16}})).await.json();
    assert!(raw.get("context").is_none());
    let text = raw["response"].as_str().unwrap().to_string();
    if let Some(stop) = text.split_whitespace().nth(2) {
        let stopped =
            post(&app, "/api/generate", json!({"model": MODEL, "prompt": "the king", "raw": true, "stream": false, "options": {"temperature": 0, "num_predict": 16, "stop": [stop]}})).await.json();
        assert_eq!(stopped["done_reason"], "stop");
        assert_eq!(stopped["response"].as_str().unwrap(), &text[..text.find(stop).unwrap()]);
    }

    // A seed makes sampling reproducible.
    let seeded = json!({"model": MODEL, "prompt": "the sea", "stream": false, "options": {"temperature": 1.0, "seed": 7, "num_predict": 12}});
    assert_eq!(
        post(&app, "/api/generate", seeded.clone()).await.json()["response"],
        post(&app, "/api/generate", seeded).await.json()["response"]
    );
}

#[tokio::test]
async fn chat_load_unload_and_ps() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);

    let load = post(&app, "/api/chat", json!({"model": MODEL, "messages": []})).await.json();
    assert_eq!(load["done_reason"], "load");
    assert_eq!(load["message"], json!({"role": "assistant", "content": ""}));
    let ps = call(&app, Method::GET, "/api/ps", None).await.json();
    let loaded = &ps["models"][0];
    assert_eq!(loaded["name"], "tiny-dense-1b:latest");
    assert!(loaded["size"].as_u64().unwrap() > 0);
    assert_eq!(loaded["size_vram"], 0);
    assert_eq!(loaded["context_length"], 512);
    assert!(loaded["expires_at"].as_str().unwrap().ends_with('Z'));

    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]);
    let stream = post(
        &app,
        "/api/chat",
        json!({"model": MODEL, "messages": messages, "options": {"temperature": 0, "num_predict": 6}}),
    )
    .await;
    let lines = stream.lines();
    let last = lines.last().unwrap();
    assert_eq!((last["done"].clone(), last["done_reason"].clone()), (json!(true), json!("length")));
    assert!(last.get("context").is_none(), "chat has no context");
    assert!(lines.iter().all(|line| line["message"]["role"] == "assistant"));
    let streamed: String = lines.iter().map(|line| line["message"]["content"].as_str().unwrap()).collect();
    let whole = post(
        &app,
        "/api/chat",
        json!({"model": MODEL, "messages": messages, "stream": false, "options": {"temperature": 0, "num_predict": 6}}),
    )
    .await
    .json();
    assert_eq!(whole["message"]["content"], streamed.as_str());

    let unload = post(&app, "/api/generate", json!({"model": MODEL, "keep_alive": 0})).await.json();
    assert_eq!(unload["done_reason"], "unload");
    assert_eq!(call(&app, Method::GET, "/api/ps", None).await.json(), json!({"models": []}));

    // keep_alive 0 on a generation unloads once it is done.
    let once = post(
        &app,
        "/api/generate",
        json!({"model": MODEL, "prompt": "hi", "keep_alive": 0, "stream": false, "options": {"num_predict": 2}}),
    )
    .await;
    assert_eq!(once.status, StatusCode::OK);
    assert_eq!(call(&app, Method::GET, "/api/ps", None).await.json(), json!({"models": []}));
}

#[tokio::test]
async fn structured_output_follows_the_schema() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}}, "required": ["ok", "color", "count"]});
    for seed in 0..3 {
        let reply = post(&app, "/api/generate", json!({"model": MODEL, "prompt": "json please", "format": schema, "stream": false, "options": {"seed": seed, "temperature": 1.0, "num_predict": 64}}))
            .await
            .json();
        let text = reply["response"].as_str().unwrap();
        if reply["done_reason"] == "stop" {
            let value: Value = serde_json::from_str(text).unwrap_or_else(|error| panic!("{error}: {text:?}"));
            assert!(value["ok"].is_boolean() && value["count"].is_i64(), "{value}");
            assert!(["red", "green", "blue"].contains(&value["color"].as_str().unwrap()), "{value}");
        } else {
            assert!(text.starts_with('{'), "{text:?}");
        }
    }
    let reply = post(
        &app,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 48, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": {"type": "object", "properties": {"flag": {"type": "boolean"}}}}}}),
    )
    .await
    .json();
    let content = reply["choices"][0]["message"]["content"].as_str().unwrap();
    if reply["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(content).unwrap()["flag"].is_boolean(), "{content}");
    }
}

#[tokio::test]
async fn embeddings_in_both_apis() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);
    let embed =
        post(&app, "/api/embed", json!({"model": MODEL, "input": ["the king", "the queen of the sea"]})).await.json();
    let vectors: Vec<Vec<f64>> = serde_json::from_value(embed["embeddings"].clone()).unwrap();
    assert_eq!(vectors.len(), 2);
    for vector in &vectors {
        assert_eq!(vector.len(), 256);
        let norm: f64 = vector.iter().map(|value| value * value).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-3, "{norm}");
    }
    assert_ne!(vectors[0], vectors[1]);
    assert!(embed["prompt_eval_count"].as_u64().unwrap() >= 4);
    let cut = post(&app, "/api/embed", json!({"model": MODEL, "input": "the king", "dimensions": 16})).await.json();
    assert_eq!(cut["embeddings"][0].as_array().unwrap().len(), 16);
    assert_eq!(post(&app, "/api/embed", json!({"model": MODEL, "input": []})).await.json()["embeddings"], json!([]));
    let too_long =
        post(&app, "/api/embed", json!({"model": MODEL, "input": "word ".repeat(300), "truncate": false})).await;
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);

    let legacy = post(&app, "/api/embeddings", json!({"model": MODEL, "prompt": "the king"})).await.json();
    let legacy: Vec<f64> = serde_json::from_value(legacy["embedding"].clone()).unwrap();
    let norm: f64 = legacy.iter().map(|value| value * value).sum::<f64>().sqrt();
    let cosine: f64 = legacy.iter().zip(&vectors[0]).map(|(left, right)| left * right).sum::<f64>() / norm;
    assert!((cosine - 1.0).abs() < 1e-3, "the legacy vector is the same direction, not normalised: {cosine}");

    let openai = post(&app, "/v1/embeddings", json!({"model": MODEL, "input": "the king"})).await.json();
    assert_eq!(openai["object"], "list");
    assert_eq!(openai["data"][0]["embedding"].as_array().unwrap().len(), 256);
    let encoded =
        post(&app, "/v1/embeddings", json!({"model": MODEL, "input": ["the king"], "encoding_format": "base64"}))
            .await
            .json();
    use base64::Engine as _;
    let bytes =
        base64::engine::general_purpose::STANDARD.decode(encoded["data"][0]["embedding"].as_str().unwrap()).unwrap();
    assert_eq!(bytes.len(), 256 * 4);
}

#[tokio::test]
async fn openai_chat_and_completions_stream_server_sent_events() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}], "max_tokens": 5, "temperature": 0});
    let whole = post(&app, "/v1/chat/completions", body.clone()).await.json();
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 5);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    streaming["stream_options"] = json!({"include_usage": true});
    let reply = post(&app, "/v1/chat/completions", streaming).await;
    assert_eq!(reply.content_type, "text/event-stream");
    let text = String::from_utf8(reply.body).unwrap();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|event| serde_json::from_str(event).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    let content: String = chunks.iter().filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, whole["choices"][0]["message"]["content"].as_str().unwrap());
    assert!(chunks.iter().all(|chunk| chunk["id"] == chunks[0]["id"] && chunk["object"] == "chat.completion.chunk"));

    let completion = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "the king", "max_tokens": 4, "temperature": 0, "stop": "zzz"}),
    )
    .await
    .json();
    assert_eq!(completion["object"], "text_completion");
    assert!(completion["choices"][0]["text"].is_string());
    let streamed = post(
        &app,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "the king", "max_tokens": 4, "temperature": 0, "stream": true}),
    )
    .await;
    let text = String::from_utf8(streamed.body).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
}

/// Read a streaming response until its first line.
async fn first_line(body: Body) -> (String, impl futures_util::Stream) {
    let mut stream = body.into_data_stream();
    let mut buffer = Vec::new();
    while !buffer.contains(&b'\n') {
        buffer.extend_from_slice(&stream.next().await.expect("a first line").unwrap());
    }
    (String::from_utf8_lossy(&buffer).into_owned(), stream)
}

#[tokio::test]
async fn a_full_queue_is_503_and_a_dropped_stream_frees_its_place() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app_with(vec![tiny(directory.path())], 1, 0, HttpConfig::default());
    // It must still be generating when the next requests come: no end-of-generation token.
    let long = json!({"model": MODEL, "prompt": "the king", "options": {"num_predict": 100_000, "num_ctx": 100_000, "ignore_eos": true}}).to_string();
    let response = app.clone().oneshot(request(Method::POST, "/api/generate", Some(&long))).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let (line, stream) = first_line(response.into_body()).await;
    assert!(line.contains("\"done\":false"), "{line}");

    let busy = post(&app, "/api/generate", json!({"model": MODEL, "prompt": "x", "stream": false})).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(busy.error().contains("server busy"), "{}", busy.error());
    let busy =
        post(&app, "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}))
            .await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(busy.json()["error"]["type"], "api_error");

    // The client goes away: its generation stops within a token and the place frees up.
    drop(stream);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = post(
            &app,
            "/api/generate",
            json!({"model": MODEL, "prompt": "x", "stream": false, "options": {"num_predict": 1}}),
        )
        .await;
        if reply.status == StatusCode::OK {
            break;
        }
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(std::time::Instant::now() < deadline, "the cancelled generation still holds the model");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn parallel_requests_decode_together_and_match_sequential_answers() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app(vec![tiny(directory.path())]);
    let prompts = ["the king of paris", "a queen", "the sea and the sky and the land", "paris"];
    let body = |prompt: &str| json!({"model": MODEL, "prompt": prompt, "raw": true, "stream": false, "options": {"temperature": 0, "num_predict": 24}});
    let mut sequential = Vec::new();
    for prompt in prompts {
        sequential.push(post(&app, "/api/generate", body(prompt)).await.json()["response"].clone());
    }
    let parallel = futures_util::future::join_all(prompts.iter().map(|prompt| {
        let app = app.clone();
        let body = body(prompt);
        async move { post(&app, "/api/generate", body).await.json()["response"].clone() }
    }))
    .await;
    assert_eq!(parallel, sequential);
}

#[tokio::test]
async fn ollama_store_names_resolve_and_never_escape_it() {
    let _machine = common::shared_machine();
    let store = tempfile::tempdir().unwrap();
    let model = tiny(store.path());
    common::ollama_store(store.path(), &model, "tiny", "q4");

    let catalog = Catalog { ollama_stores: vec![store.path().to_path_buf()], ..Catalog::default() };
    let scheduler = SchedulerConfig {
        n_parallel: 1,
        max_queue: 1,
        default_keep_alive: KeepAlive::For(Duration::from_secs(60)),
        run: run(),
        embedding_context: 64,
    };
    let app = router(AppState::new(catalog, scheduler, HttpConfig::default()));
    let tags = call(&app, Method::GET, "/api/tags", None).await.json();
    assert_eq!(tags["models"][0]["name"], "tiny:q4");
    let reply = post(
        &app,
        "/api/generate",
        json!({"model": "TINY:q4", "prompt": "hi", "stream": false, "options": {"num_predict": 2}}),
    )
    .await
    .json();
    assert_eq!(reply["model"], "TINY:q4", "the name is echoed as sent");
    for name in ["tiny", "../tiny:q4", "registry.ollama.ai/library/../../blobs:q4", "/etc/passwd"] {
        let status = post(&app, "/api/show", json!({"model": name})).await.status;
        assert!(status == StatusCode::NOT_FOUND || status == StatusCode::BAD_REQUEST, "{name}: {status}");
    }
}

#[tokio::test]
async fn cors_allows_localhost_and_configured_origins_only() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let app = app_with(
        vec![tiny(directory.path())],
        1,
        1,
        HttpConfig { cors_origins: vec!["https://webui.example".into()], ..HttpConfig::default() },
    );
    for (origin, allowed) in
        [("http://localhost:3000", true), ("https://webui.example", true), ("http://evil.example", false)]
    {
        let preflight = Request::builder()
            .method(Method::OPTIONS)
            .uri("/api/chat")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "content-type")
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(preflight).await.unwrap();
        let allow =
            response.headers().get("access-control-allow-origin").map(|value| value.to_str().unwrap().to_string());
        assert_eq!(allow.as_deref() == Some(origin), allowed, "{origin}: {allow:?}");
    }
}

/// In a streaming mode, requests that decode together share each pass over the weights: four
/// parallel answers read about what one answer reads, not four times as much.
#[tokio::test]
async fn parallel_sequences_share_each_streamed_read() {
    let _machine = common::shared_machine();
    use hypura::plan::{self, MachineFacts, Mode, ModeChoice, PlanError, PlanOptions};
    let directory = tempfile::tempdir().unwrap();
    let path = common::forge("tiny-dense-8b", directory.path());
    let inventory = hypura::model::Inventory::open(&path).unwrap();
    let plan_options = PlanOptions {
        mode: ModeChoice::Forced(Mode::DenseStream),
        n_ctx: 2048,
        n_ubatch: 256,
        window_layers: Some(2),
        ..PlanOptions::default()
    };
    let needed = match plan::plan(
        &inventory,
        &MachineFacts { memory_budget_bytes: 1, disk_bytes_per_sec: Some(1e9), ..MachineFacts::default() },
        &plan_options,
    ) {
        Err(PlanError::BudgetTooSmall { needed, .. }) => needed,
        other => panic!("{other:?}"),
    };
    let plan = plan::plan(
        &inventory,
        &MachineFacts {
            memory_budget_bytes: needed + (1 << 20),
            disk_bytes_per_sec: Some(1e9),
            ..MachineFacts::default()
        },
        &plan_options,
    )
    .unwrap();
    let catalog = Catalog { files: vec![path], ..Catalog::default() };
    let scheduler = SchedulerConfig {
        n_parallel: 4,
        max_queue: 4,
        default_keep_alive: KeepAlive::Forever,
        run: RunSpec { memory_budget_bytes: Some(plan.budget.budget_bytes), plan: plan_options, ..run() },
        embedding_context: 64,
    };
    let app = router(AppState::new(catalog, scheduler, HttpConfig::default()));
    let model = "tiny-dense-8b";
    let body = |prompt: &str| json!({"model": model, "prompt": prompt, "raw": true, "stream": false, "options": {"temperature": 0, "num_predict": 32}});
    let streamed = || async {
        let ps = call(&app, Method::GET, "/api/ps", None).await.json();
        assert_eq!(ps["models"][0]["hypura_mode"], "dense-stream");
        ps["models"][0]["hypura_bytes_streamed"].as_u64().unwrap()
    };
    let load = post(&app, "/api/generate", json!({"model": model})).await.json();
    assert_eq!(load["done_reason"], "load");

    let before = streamed().await;
    let one = post(&app, "/api/generate", body("the king of paris")).await.json();
    assert_eq!(one["eval_count"], 32);
    let single = streamed().await - before;
    assert!(single > 0, "nothing was streamed");

    let before = streamed().await;
    let replies = futures_util::future::join_all(["the queen", "the sea and", "a land of", "paris in"].map(|prompt| {
        let app = app.clone();
        let body = body(prompt);
        async move { post(&app, "/api/generate", body).await.json() }
    }))
    .await;
    assert!(replies.iter().all(|reply| reply["eval_count"] == 32), "{replies:?}");
    let parallel = streamed().await - before;
    assert!(parallel < single * 3 / 2, "four parallel answers read {parallel} bytes, one answer {single}");
}

/// With an API key, every request but `GET /`, `/api/version` and CORS preflights needs
/// `Authorization: Bearer KEY`: without it or with another key, a 401 in its API's error shape;
/// with it, the usual answer. The log names the request, never a key.
#[tokio::test]
async fn an_api_key_guards_every_path_but_the_liveness_checks() {
    let _machine = common::shared_machine();
    let directory = tempfile::tempdir().unwrap();
    let http = HttpConfig { api_key: hypura::server::ApiKey::new("s3cret-key\n"), ..HttpConfig::default() };
    let app = app_with(vec![tiny(directory.path())], 1, 4, http);
    let with = |method: Method, uri: &str, authorization: Option<&str>, body: Option<&str>| {
        let mut request = request(method, uri, body);
        if let Some(value) = authorization {
            request.headers_mut().insert("authorization", value.parse().unwrap());
        }
        request
    };
    for uri in ["/", "/api/version"] {
        assert_eq!(call(&app, Method::GET, uri, None).await.status, StatusCode::OK, "{uri}");
    }
    let preflight = Request::builder()
        .method(Method::OPTIONS)
        .uri("/api/chat")
        .header("origin", "http://localhost:3000")
        .header("access-control-request-method", "POST")
        .body(Body::empty())
        .unwrap();
    assert_ne!(send(&app, preflight).await.status, StatusCode::UNAUTHORIZED);
    for authorization in [None, Some("Bearer wrong"), Some("s3cret-key"), Some("Basic s3cret-key")] {
        let tags = send(&app, with(Method::GET, "/api/tags", authorization, None)).await;
        assert_eq!(tags.status, StatusCode::UNAUTHORIZED, "{authorization:?}");
        assert!(tags.error().contains("API key"), "{}", tags.error());
        let openai = send(&app, with(Method::GET, "/v1/models", authorization, None)).await;
        assert_eq!(openai.status, StatusCode::UNAUTHORIZED);
        assert_eq!(openai.json()["error"]["type"], "authentication_error");
        let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": false});
        let refused = send(&app, with(Method::POST, "/api/chat", authorization, Some(&chat.to_string()))).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    }
    let tags = send(&app, with(Method::GET, "/api/tags", Some("Bearer s3cret-key"), None)).await;
    assert_eq!(tags.status, StatusCode::OK);
    assert_eq!(tags.json()["models"].as_array().unwrap().len(), 1);
    let models = send(&app, with(Method::GET, "/v1/models", Some("Bearer s3cret-key"), None)).await;
    assert_eq!(models.status, StatusCode::OK);
    let body = json!({"model": MODEL, "prompt": "the king", "stream": false, "options": {"num_predict": 2}});
    let generated =
        send(&app, with(Method::POST, "/api/generate", Some("Bearer s3cret-key"), Some(&body.to_string()))).await;
    assert_eq!(generated.status, StatusCode::OK, "{}", String::from_utf8_lossy(&generated.body));
    assert_eq!(generated.json()["done"], true);
    // An empty key is no key.
    assert!(hypura::server::ApiKey::new(" \n").is_none());
}

/// Every body the server's fuzz target kept (`fuzz/corpus/server_bodies`: the seeds, Ollama's
/// and OpenAI's chat, generate, embed and show with tools, options and formats, and what
/// fuzzing added) goes through the real handlers to a forged model without a panic or a 500.
#[test]
fn the_fuzz_corpus_of_request_bodies_gets_no_500() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("tiny-qwen3.gguf");
    let spec = hypura_forge::preset("tiny-qwen3").unwrap();
    hypura_forge::write_model(&spec, &path, &|_, _| {}).unwrap();
    let harness = hypura::server::fuzz::Harness::new(&path);
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/server_bodies");
    let mut statuses = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&corpus).unwrap() {
        let path = entry.unwrap().path();
        let status =
            harness.request(&std::fs::read(&path).unwrap()).unwrap_or_else(|why| panic!("{}: {why}", path.display()));
        *statuses.entry(status).or_insert(0) += 1;
    }
    // The seeds alone answer 200 at least sixteen times (every endpoint, tools and formats).
    assert!(statuses.get(&200).copied().unwrap_or(0) >= 16, "{statuses:?}");
}
