//! Ollama's `options` object and `format` field, resolved into the engine's settings.
//!
//! Known keys with the wrong JSON type are a 400 naming the option; integers may come as JSON
//! floats (`8.0`), as Ollama allows; unknown keys and options that only matter to Ollama's own
//! runner (`num_gpu`, `use_mmap`, `mirostat`, ...) are ignored. `num_ctx` cannot grow a loaded
//! context: a request gets at most its sequence's share of the context (`--context`), and a
//! smaller `num_ctx` limits it further.
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;

use super::error::AppError;
use super::grammar::{json_object_grammar, schema_grammar};
use crate::engine::{GenerateRequest, Prompt, SamplerParams};

/// What a request's options decide.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOptions {
    pub sampling: SamplerParams,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub n_ctx_seq: Option<u32>,
    /// Generate past the end-of-generation token, up to `num_predict` (llama.cpp's server
    /// option `ignore_eos`; Ollama has none).
    pub ignore_eos: bool,
    /// Tokens at the prompt's start that a context shift keeps (`num_keep`, 4 as in Ollama;
    /// negative: the whole prompt).
    pub num_keep: u32,
}

impl RequestOptions {
    /// A generation of `prompt` with these options.
    pub fn request(self, prompt: Prompt) -> GenerateRequest {
        GenerateRequest {
            max_tokens: self.max_tokens,
            sampling: self.sampling,
            stop: self.stop,
            n_ctx_seq: self.n_ctx_seq,
            ignore_eos: self.ignore_eos,
            ..GenerateRequest::new(prompt)
        }
    }
}

impl Default for RequestOptions {
    /// Ollama's defaults (the engine's, which follow llama.cpp's), with a random seed.
    fn default() -> Self {
        RequestOptions {
            sampling: SamplerParams { seed: random_seed(), ..SamplerParams::default() },
            max_tokens: None,
            stop: Vec::new(),
            n_ctx_seq: None,
            ignore_eos: false,
            num_keep: 4,
        }
    }
}

const IGNORED: &[&str] = &[
    "typical_p",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "use_mmap",
    "num_thread",
    "numa",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mlock",
    "embedding_only",
    "tfs_z",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "penalize_newline",
    "draft_num_predict",
];

/// Parse `options` (absent or null: defaults).
pub fn parse_options(options: Option<&Value>) -> Result<RequestOptions, AppError> {
    let mut resolved = RequestOptions::default();
    let Some(options) = options.filter(|value| !value.is_null()) else { return Ok(resolved) };
    let options = options.as_object().ok_or_else(|| AppError::bad_request("options must be an object"))?;
    for (key, value) in options {
        if value.is_null() {
            continue;
        }
        let sampling = &mut resolved.sampling;
        match key.as_str() {
            "temperature" => sampling.temperature = float(key, value)?,
            "top_p" => sampling.top_p = float(key, value)?,
            "min_p" => sampling.min_p = float(key, value)?,
            "repeat_penalty" => sampling.repeat_penalty = float(key, value)?,
            "presence_penalty" => sampling.presence_penalty = float(key, value)?,
            "frequency_penalty" => sampling.frequency_penalty = float(key, value)?,
            "top_k" => sampling.top_k = clamp_i32(integer(key, value)?),
            "repeat_last_n" => sampling.penalty_last_n = clamp_i32(integer(key, value)?),
            "seed" => sampling.seed = seed(integer(key, value)?),
            "num_predict" => resolved.max_tokens = max_tokens(integer(key, value)?),
            "num_ctx" => {
                let n_ctx = integer(key, value)?;
                resolved.n_ctx_seq = (n_ctx > 0).then(|| n_ctx.min(u32::MAX as i64) as u32);
            }
            "stop" => resolved.stop = strings(key, value)?,
            "num_keep" => resolved.num_keep = u32::try_from(integer(key, value)?).unwrap_or(u32::MAX),
            "ignore_eos" => resolved.ignore_eos = value.as_bool().ok_or_else(|| type_error(key, "bool"))?,
            other if IGNORED.contains(&other) => {}
            other => tracing::warn!("ignoring unknown option {other:?}"),
        }
    }
    Ok(resolved)
}

fn type_error(key: &str, kind: &str) -> AppError {
    AppError::bad_request(format!("option \"{key}\" must be of type {kind}"))
}

pub fn float(key: &str, value: &Value) -> Result<f32, AppError> {
    value.as_f64().map(|number| number as f32).ok_or_else(|| type_error(key, "float32"))
}

/// An integer, also from a float with no fraction.
pub fn integer(key: &str, value: &Value) -> Result<i64, AppError> {
    if let Some(number) = value.as_i64() {
        return Ok(number);
    }
    match value.as_f64() {
        Some(number) if number.fract() == 0.0 && number.abs() < 9.0e18 => Ok(number as i64),
        _ => Err(type_error(key, "int")),
    }
}

pub fn strings(key: &str, value: &Value) -> Result<Vec<String>, AppError> {
    let items = value.as_array().ok_or_else(|| type_error(key, "[]string"))?;
    items.iter().map(|item| item.as_str().map(str::to_string).ok_or_else(|| type_error(key, "[]string"))).collect()
}

fn clamp_i32(value: i64) -> i32 {
    value.clamp(i32::MIN as i64, i32::MAX as i64) as i32
}

/// `num_predict`: negative means until the model stops or the context is full.
pub fn max_tokens(value: i64) -> Option<u32> {
    (value >= 0).then(|| value.min(u32::MAX as i64) as u32)
}

/// A seed: negative means random.
pub fn seed(value: i64) -> u32 {
    if value < 0 {
        random_seed()
    } else {
        value as u32
    }
}

pub fn random_seed() -> u32 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id().rotate_left(16) ^ COUNTER.fetch_add(0x9E37_79B9, Ordering::Relaxed)
}

/// `convert` on a blocking thread: a JSON schema at the fence's limits takes up to a few hundred
/// milliseconds to become a grammar, which must not hold one of the runtime's threads (two of
/// them on two cores).
pub async fn off_runtime<T: Send + 'static>(
    convert: impl FnOnce() -> Result<T, AppError> + Send + 'static,
) -> Result<T, AppError> {
    tokio::task::spawn_blocking(convert)
        .await
        .map_err(|error| AppError::internal(format!("converting the schema stopped: {error}")))?
}

/// `format`: null or `""` for none, `"json"` for any JSON object, or a JSON schema.
pub fn format_grammar(format: Option<&Value>) -> Result<Option<String>, AppError> {
    match format {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) if text.is_empty() => Ok(None),
        Some(Value::String(text)) if text == "json" => Ok(Some(json_object_grammar())),
        Some(schema @ Value::Object(_)) => {
            schema_grammar(schema).map(Some).map_err(|error| AppError::bad_request(error.to_string()))
        }
        Some(other) => Err(AppError::bad_request(format!(
            "invalid format: {other}; expected \"json\" or a valid JSON Schema object"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn options_map_onto_the_engine() {
        let options = json!({"temperature": 0, "top_k": 5.0, "top_p": 0.5, "min_p": 0.1, "repeat_penalty": 1.1, "seed": 42,
            "num_predict": 7, "num_ctx": 256, "stop": ["\n"], "repeat_last_n": -1, "num_gpu": 99, "mirostat": 2, "brand_new": true, "ignore_eos": true});
        let resolved = parse_options(Some(&options)).unwrap();
        assert_eq!(resolved.sampling.temperature, 0.0);
        assert_eq!(resolved.sampling.top_k, 5);
        assert_eq!(resolved.sampling.seed, 42);
        assert_eq!(resolved.sampling.penalty_last_n, -1);
        assert_eq!(resolved.max_tokens, Some(7));
        assert_eq!(resolved.n_ctx_seq, Some(256));
        assert_eq!(resolved.stop, ["\n"]);
        assert!(resolved.ignore_eos && !parse_options(None).unwrap().ignore_eos);
        assert_eq!(parse_options(Some(&json!({"num_predict": -1}))).unwrap().max_tokens, None);
        assert_eq!(parse_options(None).unwrap().sampling.temperature, 0.8);
    }

    #[test]
    fn wrong_types_name_the_option() {
        for (options, message) in [
            (json!({"temperature": "hot"}), "option \"temperature\" must be of type float32"),
            (json!({"top_k": 1.5}), "option \"top_k\" must be of type int"),
            (json!({"stop": "x"}), "option \"stop\" must be of type []string"),
            (json!([1]), "options must be an object"),
        ] {
            let error = parse_options(Some(&options)).unwrap_err();
            assert_eq!(error.status, axum::http::StatusCode::BAD_REQUEST);
            assert_eq!(error.message, message);
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_grammar(None).unwrap(), None);
        assert_eq!(format_grammar(Some(&json!(""))).unwrap(), None);
        assert!(format_grammar(Some(&json!("json"))).unwrap().unwrap().starts_with("root ::= object"));
        assert!(format_grammar(Some(&json!({"type": "object", "properties": {"a": {"type": "boolean"}}})))
            .unwrap()
            .is_some());
        assert_eq!(
            format_grammar(Some(&json!("xml"))).unwrap_err().message,
            "invalid format: \"xml\"; expected \"json\" or a valid JSON Schema object"
        );
    }
}
