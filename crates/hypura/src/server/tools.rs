//! Tool calls and thinking on the wire, for both APIs: what a request's history and options
//! mean for the engine's `ChatRequest`, and how the parsed answer's calls are written back
//! (Ollama: `arguments` is a JSON object; OpenAI: a JSON string, with ids and
//! `finish_reason: "tool_calls"`).
use serde_json::{json, Value};

use super::error::AppError;
use crate::engine::{ChatMessage, Think, ToolCall, ToolChoice};

/// One call from a request's history: `{"id"?, "type"?, "function": {"name", "arguments"}}`,
/// arguments an object (Ollama) or a JSON string (OpenAI).
pub fn parse_call(value: &Value) -> Result<ToolCall, AppError> {
    let function = value
        .get("function")
        .filter(|function| function.is_object())
        .ok_or_else(|| AppError::bad_request(format!("a tool call needs a \"function\" object: {value}")))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .filter(|name| !name.is_empty())
        .ok_or_else(|| AppError::bad_request(format!("a tool call's function needs a name: {value}")))?;
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(text)) => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone())),
        Some(other) => other.clone(),
    };
    let id = value.get("id").and_then(Value::as_str).filter(|id| !id.is_empty()).map(str::to_string);
    Ok(ToolCall { id, name: name.to_string(), arguments })
}

/// A history's calls, if the field is there.
pub fn parse_calls(value: Option<&Value>) -> Result<Vec<ToolCall>, AppError> {
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(calls)) => calls.iter().map(parse_call).collect(),
        Some(other) => Err(AppError::bad_request(format!("tool_calls must be a list, not {other}"))),
    }
}

/// A tool result names its tool; where it gives only the call's id, the tool is found among
/// the calls before it (as Ollama's OpenAI layer does), and where it gives neither (LangChain
/// sends ids its calls did not carry), the n-th result after an assistant's calls answers the
/// n-th call.
pub fn resolve_tool_names(messages: &mut [ChatMessage]) {
    for index in 0..messages.len() {
        if messages[index].role != "tool" || messages[index].tool_name.is_some() {
            continue;
        }
        let by_id = messages[index].tool_call_id.clone().and_then(|id| {
            messages[..index]
                .iter()
                .rev()
                .flat_map(|message| message.tool_calls.iter())
                .find(|call| call.id.as_deref() == Some(id.as_str()))
                .map(|call| call.name.clone())
        });
        let by_position = || {
            let caller = messages[..index].iter().rposition(|message| message.role != "tool")?;
            let position = index - caller - 1;
            messages[caller].tool_calls.get(position).map(|call| call.name.clone())
        };
        messages[index].tool_name = by_id.or_else(by_position);
    }
}

/// The request's tools: each a `{"type": "function", "function": {...}}` object (the engine
/// checks each one's name and parameters).
pub fn parse_tools(tools: Option<Vec<Value>>) -> Result<Vec<Value>, AppError> {
    let tools = tools.unwrap_or_default();
    if let Some(bad) = tools.iter().find(|tool| !tool.is_object()) {
        return Err(AppError::bad_request(format!("a tool must be an object, not {bad}")));
    }
    Ok(tools)
}

/// OpenAI's `tool_choice`: "auto", "none", "required", or `{"type": "function", "function":
/// {"name"}}`, which forces that function: it must be one of `tools`.
pub fn parse_tool_choice(value: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, AppError> {
    match value {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(choice)) => match choice.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(AppError::bad_request(format!(
                "tool_choice must be \"auto\", \"none\", \"required\" or a function, not {other:?}"
            ))),
        },
        Some(Value::Object(choice)) => {
            let name = choice
                .get("function")
                .and_then(|function| function.get("name"))
                .and_then(Value::as_str)
                .filter(|name| !name.is_empty())
                .ok_or_else(|| {
                    AppError::bad_request(format!(
                        "tool_choice must name a function: {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, not {}",
                        Value::Object(choice.clone())
                    ))
                })?;
            if !tools.iter().any(|tool| tool.pointer("/function/name").and_then(Value::as_str) == Some(name)) {
                return Err(AppError::bad_request(format!(
                    "tool_choice names the function {name:?}, which is not among the request's tools"
                )));
            }
            Ok(ToolChoice::Function(name.to_string()))
        }
        Some(other) => Err(AppError::bad_request(format!("invalid tool_choice: {other}"))),
    }
}

/// Ollama's `think`: true, false, or a level ("low", "medium", "high", "max").
pub fn parse_think(value: Option<&Value>) -> Result<Option<Think>, AppError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(false)) => Ok(Some(Think::Off)),
        Some(Value::Bool(true)) => Ok(Some(Think::On)),
        Some(Value::String(level)) => reasoning_effort(level),
        Some(other) => Err(AppError::bad_request(format!(
            "think must be a boolean or one of \"low\", \"medium\", \"high\", not {other}"
        ))),
    }
}

/// OpenAI's `reasoning_effort` (and Ollama's string `think`): "none" turns thinking off.
pub fn reasoning_effort(level: &str) -> Result<Option<Think>, AppError> {
    match level {
        "none" => Ok(Some(Think::Off)),
        "true" => Ok(Some(Think::On)),
        "false" => Ok(Some(Think::Off)),
        "minimal" | "low" | "medium" | "high" | "xhigh" | "max" => Ok(Some(Think::Level(level.to_string()))),
        other => Err(AppError::bad_request(format!(
            "think must be a boolean or one of \"low\", \"medium\", \"high\", not {other:?}"
        ))),
    }
}

/// Log the tool results a turn sends back (those after the last assistant message), so that the
/// server's log shows an agent's loop: `info` level.
pub fn log_results(model: &str, request: &crate::engine::ChatRequest) {
    let start = request.messages.iter().rposition(|message| message.role == "assistant").map_or(0, |index| index + 1);
    for message in request.messages[start..].iter().filter(|message| message.role == "tool") {
        let preview: String = message.content.chars().take(120).collect();
        tracing::info!(
            "{model}: tool result for {} ({} bytes): {preview:?}",
            message.tool_name.as_deref().unwrap_or("?"),
            message.content.len()
        );
    }
}

/// Log the calls an answer made (`info` level).
pub fn log_calls(model: &str, calls: &[ToolCall]) {
    for call in calls {
        tracing::info!("{model}: tool call {}({})", call.name, call.arguments);
    }
}

/// Ollama's shape: `[{"id", "function": {"index", "name", "arguments": {...}}}]`.
pub fn ollama_calls(calls: &[ToolCall]) -> Value {
    Value::Array(calls.iter().enumerate().map(|(index, call)| json!({ "id": call.id, "function": { "index": index, "name": call.name, "arguments": call.arguments } })).collect())
}

/// OpenAI's shape: `[{"index", "id", "type": "function", "function": {"name", "arguments": "<JSON>"}}]`.
pub fn openai_calls(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(index, call)| {
                let arguments = match &call.arguments {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                };
                json!({ "index": index, "id": call.id, "type": "function", "function": { "name": call.name, "arguments": arguments } })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_parse_from_both_shapes_and_write_back_in_each() {
        let ollama = parse_call(&json!({"function": {"name": "read", "arguments": {"path": "notes.txt"}}})).unwrap();
        let openai = parse_call(&json!({"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"notes.txt\"}"}})).unwrap();
        assert_eq!(ollama.arguments, openai.arguments);
        assert_eq!(openai.id.as_deref(), Some("call_1"));
        assert_eq!(ollama_calls(std::slice::from_ref(&openai))[0]["function"]["arguments"]["path"], "notes.txt");
        assert_eq!(openai_calls(&[openai])[0]["function"]["arguments"], "{\"path\":\"notes.txt\"}");
        assert!(parse_call(&json!({"function": {"arguments": {}}})).is_err(), "a call without a name is refused");
        assert!(parse_calls(Some(&json!("read"))).is_err());
    }

    #[test]
    fn a_tool_result_finds_its_tool_by_call_id() {
        let mut messages = vec![
            ChatMessage {
                tool_calls: vec![ToolCall { id: Some("call_7".into()), name: "read".into(), arguments: json!({}) }],
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage { tool_call_id: Some("call_7".into()), ..ChatMessage::new("tool", "the secret is heron") },
        ];
        resolve_tool_names(&mut messages);
        assert_eq!(messages[1].tool_name.as_deref(), Some("read"));
        // No name and an id no call carries: the results answer the calls in order.
        let mut messages = vec![
            ChatMessage {
                tool_calls: vec![
                    ToolCall { id: None, name: "read".into(), arguments: json!({}) },
                    ToolCall { id: None, name: "ls".into(), arguments: json!({}) },
                ],
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage { tool_call_id: Some("lc-1".into()), ..ChatMessage::new("tool", "file text") },
            ChatMessage::new("tool", "a.txt b.txt"),
        ];
        resolve_tool_names(&mut messages);
        assert_eq!((messages[1].tool_name.as_deref(), messages[2].tool_name.as_deref()), (Some("read"), Some("ls")));
    }

    #[test]
    fn think_and_tool_choice_values() {
        assert_eq!(parse_think(Some(&json!(false))).unwrap(), Some(Think::Off));
        assert_eq!(parse_think(Some(&json!("high"))).unwrap(), Some(Think::Level("high".into())));
        assert!(parse_think(Some(&json!(3))).is_err());
        assert!(parse_think(Some(&json!("loud"))).is_err());
        assert_eq!(parse_tool_choice(Some(&json!("none")), &[]).unwrap(), ToolChoice::None);
        assert!(parse_tool_choice(Some(&json!("sometimes")), &[]).is_err());
        // A named function is forced, and must be one of the request's tools.
        let tools = [json!({"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}})];
        let named = json!({"type": "function", "function": {"name": "read"}});
        assert_eq!(parse_tool_choice(Some(&named), &tools).unwrap(), ToolChoice::Function("read".into()));
        let unknown = json!({"type": "function", "function": {"name": "write"}});
        assert!(parse_tool_choice(Some(&unknown), &tools).unwrap_err().message.contains("not among"));
        assert!(parse_tool_choice(Some(&json!({"type": "function"})), &tools).is_err());
    }
}
