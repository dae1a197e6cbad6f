//! Chat: the model's template renders a conversation (with tools and the thinking switch), and
//! the model's answer is read back into content, reasoning and tool calls. Both are llama.cpp's
//! own chat layer (`common/chat.h`, through the fence): its Jinja engine renders the file's
//! template, its per-format parsers (Hermes/Qwen `<tool_call>`, Llama 3.x, Mistral, gpt-oss
//! channels, DeepSeek, GLM, Qwen3.5, and what its autoparser reads from other templates) read the
//! output, and its lazy grammar keeps a call well formed once the model starts one.
//!
//! A file without a template runs as plain completion, as Ollama does: the messages' text is
//! the prompt. `--chat-template` (or `EngineOptions::chat_template`) supplies one.
//!
//! The parts: `template` renders a conversation through the model's template, `stream` reads
//! the answer back as it streams, and `bare` reads the calls small models write as bare JSON.
mod bare;
mod stream;
mod template;

use std::hash::{BuildHasher, Hasher};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use bare::BARE_CALL_HOLD_BYTES;
pub use stream::{AssistantMessage, ChatDelta, ChatStream};
pub use template::{ChatError, ChatTemplate, RenderedTurn};

/// One turn of a conversation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The assistant's reasoning (Ollama's `thinking`, OpenAI's `reasoning_content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    /// Calls the assistant made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result: which tool, and which call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), ..ChatMessage::default() }
    }

    /// OpenAI's message shape, which llama.cpp's chat layer reads.
    fn to_openai(&self) -> Value {
        let mut message = json!({ "role": self.role, "content": self.content });
        if let Some(thinking) = self.thinking.as_ref().filter(|text| !text.is_empty()) {
            message["reasoning_content"] = json!(thinking);
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self
                .tool_calls
                .iter()
                .map(|call| {
                    let arguments = match &call.arguments {
                        Value::String(text) => text.clone(),
                        other => other.to_string(),
                    };
                    let mut value =
                        json!({ "type": "function", "function": { "name": call.name, "arguments": arguments } });
                    if let Some(id) = &call.id {
                        value["id"] = json!(id);
                    }
                    value
                })
                .collect();
            message["tool_calls"] = Value::Array(calls);
        }
        if let Some(name) = &self.tool_name {
            message["name"] = json!(name);
        }
        if let Some(id) = &self.tool_call_id {
            message["tool_call_id"] = json!(id);
        }
        message
    }
}

/// A tool call: the function's name and its arguments (a JSON object).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub name: String,
    pub arguments: Value,
}

/// Whether the model may think first, and how hard (gpt-oss's levels).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Think {
    Off,
    On,
    Level(String),
}

/// Which tool the model must call: OpenAI's `tool_choice`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    #[default]
    Auto,
    Required,
    None,
    /// This function, by name: the model sees only that tool, and the grammar allows only its
    /// call.
    Function(String),
}

/// A conversation to answer.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// OpenAI tool definitions: `{"type": "function", "function": {name, description, parameters}}`.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// None: the template's default.
    pub think: Option<Think>,
}

impl ChatRequest {
    pub fn new(messages: Vec<ChatMessage>) -> ChatRequest {
        ChatRequest { messages, ..ChatRequest::default() }
    }
}

/// What the model's template can do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TemplateCaps {
    /// The file (or the override) has a template; without one, chat is plain completion.
    pub template: bool,
    /// The template renders tools.
    pub tools: bool,
    /// The template has a reasoning section.
    pub thinking: bool,
}

/// An id for a call the model did not number itself ("call_" and 24 random letters and digits,
/// OpenAI's shape).
fn new_call_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut id = String::from("call_");
    let mut bits = 0u64;
    for index in 0..24 {
        if index % 8 == 0 {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_usize(index);
            bits = hasher.finish();
        }
        id.push(ALPHABET[(bits % ALPHABET.len() as u64) as usize] as char);
        bits /= ALPHABET.len() as u64;
    }
    id
}

/// Templates and tools the parts' tests share.
#[cfg(test)]
mod fixtures {
    use super::ChatTemplate;
    use serde_json::{json, Value};

    pub(super) fn qwen3() -> ChatTemplate {
        ChatTemplate::from_text(hypura_forge::QWEN3_TEMPLATE).unwrap()
    }

    pub(super) fn weather_tool() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    /// A Hermes-style template with tools (llama.cpp reads `<tool_call>` JSON out of the answer).
    pub(super) fn hermes() -> ChatTemplate {
        ChatTemplate::from_text(concat!(
            "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n",
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}",
            "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}",
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
        ))
        .unwrap()
    }
}
