//! Chat: the model's template renders a conversation (with tools and the thinking switch), and
//! the model's answer is read back into content, reasoning and tool calls. Both are llama.cpp's
//! own chat layer (`common/chat.h`, through the fence): its Jinja engine renders the file's
//! template, its per-format parsers (Hermes/Qwen `<tool_call>`, Llama 3.x, Mistral, gpt-oss
//! channels, DeepSeek, GLM, Qwen3.5, and what its autoparser reads from other templates) read the
//! output, and its lazy grammar keeps a call well formed once the model starts one.
//!
//! A file without a template runs as plain completion, as Ollama does: the messages' text is
//! the prompt. `--chat-template` (or `EngineOptions::chat_template`) supplies one.
use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};

use hypura_sys::{ChatTemplates, Grammar, Model, RenderedChat, Token};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

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

#[derive(Deserialize)]
struct Describe {
    explicit: bool,
    tools: bool,
    thinking: bool,
}

/// The model's chat template.
pub struct ChatTemplate {
    templates: Option<ChatTemplates>,
    caps: TemplateCaps,
}

/// Why a conversation cannot be rendered: the request's fault (a 400), not the server's.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Template(String),
}

impl ChatTemplate {
    /// The file's template, or `override_template` in its place.
    pub fn new(model: &Model, override_template: Option<&str>) -> Result<ChatTemplate, String> {
        let templates = ChatTemplates::new(model, override_template.filter(|text| !text.trim().is_empty()))
            .map_err(|error| error.to_string())?;
        ChatTemplate::with(templates)
    }

    pub fn caps(&self) -> TemplateCaps {
        self.caps
    }

    /// A template text alone, without the model (its BOS and EOS tokens render empty): what
    /// `/api/show` reads a file's template with.
    pub fn from_text(template: &str) -> Result<ChatTemplate, String> {
        let templates = ChatTemplates::from_text(template).map_err(|error| error.to_string())?;
        ChatTemplate::with(templates)
    }

    fn with(templates: ChatTemplates) -> Result<ChatTemplate, String> {
        let describe: Describe = serde_json::from_str(&templates.describe().map_err(|error| error.to_string())?)
            .map_err(|error| error.to_string())?;
        if !describe.explicit {
            return Ok(ChatTemplate { templates: None, caps: TemplateCaps::default() });
        }
        Ok(ChatTemplate {
            templates: Some(templates),
            caps: TemplateCaps { template: true, tools: describe.tools, thinking: describe.thinking },
        })
    }

    /// What a file's template text can do, without loading the model (`/api/show`). A
    /// template llama.cpp cannot parse can do nothing.
    pub fn caps_of(template: Option<&str>) -> TemplateCaps {
        template
            .filter(|text| !text.trim().is_empty())
            .and_then(|text| ChatTemplate::from_text(text).ok())
            .map(|template| template.caps)
            .unwrap_or_default()
    }

    pub fn describe(&self) -> String {
        match (&self.templates, self.caps.tools, self.caps.thinking) {
            (None, _, _) => "none (plain completion)".into(),
            (Some(_), tools, thinking) => format!("the file's Jinja template (tools: {tools}, thinking: {thinking})"),
        }
    }

    /// Render a conversation, the assistant's turn opened.
    pub fn render(&self, request: &ChatRequest) -> Result<RenderedTurn, ChatError> {
        if matches!(request.think, Some(Think::On | Think::Level(_))) && !self.caps.thinking {
            return Err(ChatError::Unsupported("does not support thinking".into()));
        }
        let Some(templates) = &self.templates else {
            if !request.tools.is_empty() {
                return Err(ChatError::Unsupported("does not support tools (the model has no chat template)".into()));
            }
            let prompt = request
                .messages
                .iter()
                .map(|message| message.content.as_str())
                .filter(|text| !text.is_empty())
                .collect::<Vec<_>>()
                .join("\n\n");
            return Ok(RenderedTurn { prompt, chat: None, stops: Vec::new(), preserved: Vec::new() });
        };
        if !request.tools.is_empty() && !self.caps.tools {
            return Err(ChatError::Unsupported(
                "does not support tools (its chat template does not render them)".into(),
            ));
        }
        for tool in &request.tools {
            check_tool(tool)?;
        }
        // A named function is "required" over that one tool (llama.cpp's chat layer knows no
        // named choice), so the template renders it alone and the grammar allows only its call.
        let tools: Vec<Value> = match &request.tool_choice {
            ToolChoice::Function(name) => {
                let named =
                    request.tools.iter().find(|tool| tool_name(tool) == Some(name.as_str())).ok_or_else(|| {
                        ChatError::Template(format!(
                            "tool_choice names the function {name:?}, which is not among the tools"
                        ))
                    })?;
                vec![named.clone()]
            }
            _ => request.tools.clone(),
        };
        let tool_choice = match request.tool_choice {
            ToolChoice::Auto => "auto",
            ToolChoice::Required | ToolChoice::Function(_) => "required",
            ToolChoice::None => "none",
        };
        let mut body = json!({
            "messages": request.messages.iter().map(ChatMessage::to_openai).collect::<Vec<_>>(),
            "tool_choice": tool_choice,
            "parallel_tool_calls": true,
            "reasoning_format": "deepseek",
            "add_generation_prompt": true,
        });
        if !tools.is_empty() {
            body["tools"] = Value::Array(tools.clone());
        }
        match &request.think {
            Some(Think::Off) => body["enable_thinking"] = json!(false),
            Some(Think::On) => body["enable_thinking"] = json!(true),
            Some(Think::Level(level)) => {
                body["enable_thinking"] = json!(true);
                body["chat_template_kwargs"] = json!({ "reasoning_effort": level });
            }
            None => {}
        }
        let rendered = templates.apply(&body.to_string()).map_err(|error| ChatError::Template(error.to_string()))?;
        tracing::debug!("chat layer: {}", rendered.json());
        let params: RenderedParams = serde_json::from_str(rendered.json())
            .map_err(|error| ChatError::Template(format!("the chat layer's answer: {error}")))?;
        // The parser runs only where it has something to find: tool calls, or a reasoning section.
        let parse = !request.tools.is_empty() || params.supports_thinking;
        Ok(RenderedTurn {
            prompt: params.prompt,
            stops: params.additional_stops,
            preserved: params.preserved_tokens,
            chat: parse.then(|| ChatStream {
                rendered,
                text: String::new(),
                sent_content: 0,
                sent_thinking: 0,
                // With tool_choice "none" nothing is read as a call (as llama.cpp's parser does).
                tool_names: match request.tool_choice {
                    ToolChoice::None => Vec::new(),
                    _ => tools.iter().filter_map(|tool| tool_name(tool).map(str::to_string)).collect(),
                },
                last: AssistantMessage::default(),
                tail: Tail::Other,
                parsed: 0,
                parsed_total: 0,
            }),
        })
    }
}

/// A tool definition's function name.
fn tool_name(tool: &Value) -> Option<&str> {
    tool.pointer("/function/name").and_then(Value::as_str)
}

/// A tool definition has a function with a name, and parameters (if any) that are a JSON
/// Schema object: checked here so a malformed one is a clear 400, not a template's error.
fn check_tool(tool: &Value) -> Result<(), ChatError> {
    let function = tool.get("function").filter(|function| function.is_object()).ok_or_else(|| {
        ChatError::Template(format!("a tool must be {{\"type\": \"function\", \"function\": {{...}}}}, not {tool}"))
    })?;
    if let Some(kind) = tool.get("type") {
        if kind != "function" {
            return Err(ChatError::Template(format!("tool type {kind} is not supported; only \"function\" is")));
        }
    }
    match function.get("name") {
        Some(Value::String(name)) if !name.trim().is_empty() => {}
        _ => return Err(ChatError::Template(format!("a tool's function needs a name: {function}"))),
    }
    match function.get("parameters") {
        None | Some(Value::Null) => Ok(()),
        // llama.cpp's chat layer builds the call grammar from it with the converter that crashes
        // or stalls on hostile schemas: the fence's limits check it first.
        Some(parameters @ Value::Object(_)) => hypura_sys::check_json_schema(parameters)
            .map_err(|error| ChatError::Template(format!("a tool's parameters: {error}"))),
        Some(other) => {
            Err(ChatError::Template(format!("a tool's parameters must be a JSON Schema object, not {other}")))
        }
    }
}

#[derive(Deserialize)]
struct RenderedParams {
    prompt: String,
    #[serde(default)]
    preserved_tokens: Vec<String>,
    #[serde(default)]
    additional_stops: Vec<String>,
    #[serde(default)]
    supports_thinking: bool,
}

/// A rendered conversation: the prompt, extra stop strings, the template's marker tokens whose
/// text must stay in the output (a tool call's `<tool_call>`), and the parser for the answer.
pub struct RenderedTurn {
    pub prompt: String,
    pub stops: Vec<String>,
    pub preserved: Vec<String>,
    /// None: the answer is plain content.
    pub chat: Option<ChatStream>,
}

impl RenderedTurn {
    /// The preserved markers that are single tokens.
    pub fn preserved_tokens(&self, model: &Model) -> HashSet<Token> {
        let vocab = model.vocab();
        self.preserved
            .iter()
            .filter_map(|text| vocab.tokenize(text, false, true).ok())
            .filter(|tokens| tokens.len() == 1)
            .map(|tokens| tokens[0])
            .collect()
    }
}

/// Text for the client as the answer grows: content and reasoning kept apart.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatDelta {
    pub content: String,
    pub thinking: String,
}

/// The parsed answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AssistantMessage {
    pub content: String,
    pub thinking: String,
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Deserialize)]
struct ParsedMessage {
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ParsedCall>,
}

#[derive(Deserialize)]
struct ParsedCall {
    #[serde(default)]
    id: Option<String>,
    function: ParsedFunction,
}

#[derive(Deserialize)]
struct ParsedFunction {
    name: String,
    #[serde(default)]
    arguments: String,
}

/// Reads the answer as it streams and returns what is new in the content and the reasoning.
/// Tool calls come out whole, when the answer ends.
///
/// The formats' markers can span tokens, so llama.cpp's parser reads the whole text so far; to
/// keep that from growing with the square of the answer, it runs only where the answer may have
/// changed course. While the last parse ended in plain content (or reasoning), a piece of plain
/// text (`is_plain`: letters, digits, spaces and punctuation that starts no format's marker)
/// extends it as written; a piece with anything else is parsed with the whole text, at most
/// once per `PARSE_EVERY`th of the text's length (the pieces between are held, then sent
/// together), so the parsing of an answer is linear in its length. The final message is always
/// parsed whole.
///
/// Small models often write a call as bare JSON, without their template's markers
/// (Qwen2.5-Coder-0.5B answers `{"name": "read", "arguments": {...}}` rather than
/// `<tool_call>...</tool_call>`). When tools were offered, an answer that is only such JSON,
/// naming an offered tool, is read as that call, as Ollama's parser reads it; content that
/// starts like one is held back until the answer shows what it is.
pub struct ChatStream {
    rendered: RenderedChat,
    text: String,
    sent_content: usize,
    sent_thinking: usize,
    /// The offered tools' names (empty: no tools).
    tool_names: Vec<String>,
    /// The last parse's message, extended by plain pieces while `tail` says where they go.
    last: AssistantMessage,
    tail: Tail,
    /// The text's length at the last parse.
    parsed: usize,
    /// Bytes of text the parser has read in all (`ChatStream::parsed_bytes`).
    parsed_total: usize,
}

/// Where the last parse left the end of the text.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tail {
    /// In the content (or reasoning) as written: plain text appended extends it.
    Content,
    Thinking,
    /// In a marker, a call, escaped text or anything else: the next piece is parsed.
    Other,
}

/// Pieces after the last parse wait for the next one until they are this fraction of the text.
/// A 16 KB answer is parsed every 128 bytes at most (the first 128 bytes at every piece), and
/// its parsing reads about 128 times its length in all (llama.cpp's parser reads tens of MB a
/// second).
const PARSE_EVERY: usize = 128;

impl ChatStream {
    /// The grammar that keeps tool calls well formed (None without tools).
    pub fn grammar(&self, model: &Model) -> Result<Option<Grammar>, hypura_sys::SysError> {
        if self.tool_names.is_empty() {
            return Ok(None);
        }
        self.rendered.grammar(&model.vocab())
    }

    pub fn push(&mut self, piece: &str) -> ChatDelta {
        self.text.push_str(piece);
        let caught_up = self.parsed + piece.len() == self.text.len();
        if caught_up && self.tail != Tail::Other && is_plain(piece) {
            match self.tail {
                Tail::Content => self.last.content.push_str(piece),
                _ => self.last.thinking.push_str(piece),
            }
            self.parsed = self.text.len();
            let message = std::mem::take(&mut self.last);
            let delta = self.delta(&message, false);
            self.last = message;
            return delta;
        }
        if self.text.len() - self.parsed < self.parsed / PARSE_EVERY {
            return ChatDelta::default();
        }
        self.parse_now()
    }

    /// Parse the whole text so far and send what is new.
    fn parse_now(&mut self) -> ChatDelta {
        self.parsed = self.text.len();
        self.parsed_total += self.text.len();
        match self.parse(true) {
            Some(message) => {
                self.tail = tail_of(&self.text, &message);
                let delta = self.delta(&message, false);
                self.last = message;
                delta
            }
            None => {
                self.tail = Tail::Other;
                ChatDelta::default()
            }
        }
    }

    /// Bytes of text the parser has read so far, for the test that parsing stays linear.
    pub fn parsed_bytes(&self) -> usize {
        self.parsed_total
    }

    /// The whole answer, and whatever of it was not yet sent. Output the parser cannot read
    /// (a botched call) is returned as plain content.
    pub fn finish(&mut self) -> (ChatDelta, AssistantMessage) {
        let mut message = self
            .parse(false)
            .unwrap_or_else(|| AssistantMessage { content: self.text.clone(), ..AssistantMessage::default() });
        if message.tool_calls.is_empty() && self.sent_content == 0 {
            if let Some(calls) = bare_calls(&message.content, &self.tool_names) {
                message.tool_calls = calls;
                message.content.clear();
            }
        }
        let delta = self.delta(&message, true);
        (delta, message)
    }

    /// Content that may still turn out to be a bare JSON call is not sent yet.
    fn may_be_bare_call(&self, content: &str) -> bool {
        self.sent_content == 0 && may_become_bare_calls(content, &self.tool_names)
    }

    /// What the content and reasoning gained since the last delta (`last`: the answer is
    /// complete, so nothing is held back any more). A parse that rewrites text
    /// already sent (rare: a marker the partial parse read as content) sends nothing more for
    /// that part; the final message has it right.
    fn delta(&mut self, message: &AssistantMessage, last: bool) -> ChatDelta {
        let mut delta = ChatDelta::default();
        if message.content.len() > self.sent_content
            && message.content.is_char_boundary(self.sent_content)
            && (last || !self.may_be_bare_call(&message.content))
        {
            delta.content = message.content[self.sent_content..].to_string();
            self.sent_content = message.content.len();
        }
        if message.thinking.len() > self.sent_thinking && message.thinking.is_char_boundary(self.sent_thinking) {
            delta.thinking = message.thinking[self.sent_thinking..].to_string();
            self.sent_thinking = message.thinking.len();
        }
        delta
    }

    fn parse(&self, partial: bool) -> Option<AssistantMessage> {
        let json = match self.rendered.parse(&self.text, partial) {
            Ok(json) => json,
            Err(error) => {
                if !partial {
                    tracing::warn!(
                        "the answer does not parse as the template's format ({error}); it is returned as plain text"
                    );
                }
                return None;
            }
        };
        let parsed: ParsedMessage = serde_json::from_str(&json).ok()?;
        let content = match parsed.content {
            Some(Value::String(text)) => text,
            Some(Value::Array(parts)) => {
                parts.iter().filter_map(|part| part.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
            }
            _ => String::new(),
        };
        let tool_calls = parsed
            .tool_calls
            .into_iter()
            .map(|call| ToolCall {
                id: Some(call.id.filter(|id| !id.is_empty()).unwrap_or_else(new_call_id)),
                arguments: serde_json::from_str(&call.function.arguments)
                    .unwrap_or(Value::String(call.function.arguments)),
                name: call.function.name,
            })
            .collect();
        Some(AssistantMessage { content, thinking: parsed.reasoning_content.unwrap_or_default(), tool_calls })
    }
}

/// Text that extends plain content as written in every format llama.cpp parses: ASCII letters,
/// digits, spaces and punctuation that opens no marker, quote, escape or JSON value.
fn is_plain(piece: &str) -> bool {
    piece.bytes().all(|byte| byte.is_ascii_alphanumeric() || b" .,;:!?'()-_=+*/%#@$&^~".contains(&byte))
}

/// Where the parse of `text` into `message` left the end: the content's (or the reasoning's)
/// last bytes are the text's own last bytes, and no call is open.
fn tail_of(text: &str, message: &AssistantMessage) -> Tail {
    let ends_with = |part: &str| {
        let start = part.len().saturating_sub(32);
        !part.is_empty() && part.is_char_boundary(start) && text.ends_with(&part[start..])
    };
    match (message.tool_calls.is_empty(), ends_with(&message.content), ends_with(&message.thinking)) {
        (true, true, false) => Tail::Content,
        (true, false, true) => Tail::Thinking,
        _ => Tail::Other,
    }
}

/// The calls in an answer that is nothing but JSON calls of offered tools: one object
/// `{"name", "arguments"}` (or `"parameters"`), a list of them, or several in a row, optionally
/// in a ```json fence. None for anything else, which stays content.
fn bare_calls(content: &str, tool_names: &[String]) -> Option<Vec<ToolCall>> {
    if tool_names.is_empty() {
        return None;
    }
    let mut text = content.trim();
    if let Some(fenced) = text.strip_prefix("```") {
        let fenced = fenced.strip_prefix("json").unwrap_or(fenced);
        text = fenced.strip_suffix("```")?.trim();
    }
    let mut values = Vec::new();
    for value in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
        match value.ok()? {
            Value::Array(items) => values.extend(items),
            other => values.push(other),
        }
    }
    let calls: Vec<ToolCall> = values.iter().map(|value| call_of(value, tool_names)).collect::<Option<_>>()?;
    (!calls.is_empty()).then_some(calls)
}

/// A JSON value read as a call of an offered tool: `{"name", "arguments" | "parameters"}`, the
/// arguments an object or a JSON string of one.
fn call_of(value: &Value, tool_names: &[String]) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_string();
    if !tool_names.contains(&name) {
        return None;
    }
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        Some(Value::String(text)) => serde_json::from_str(text).ok()?,
        Some(arguments @ Value::Object(_)) => arguments.clone(),
        None => json!({}),
        Some(_) => return None,
    };
    Some(ToolCall { id: Some(new_call_id()), name, arguments })
}

/// The most content held back while it may still become bare calls. Past it the answer streams
/// as content, so a looping answer that keeps the shape of a call (an argument string that never
/// ends) cannot keep a client waiting: on two cores a 0.5B model writes 4 KiB in about half a
/// minute. A bare call longer than this is returned as content, as the model wrote it.
pub const BARE_CALL_HOLD_BYTES: usize = 4096;

/// Whether an answer that starts with `content` may still be nothing but bare calls of
/// `tool_names` (what `bare_calls` reads once it is whole): an opening fence, then JSON whose
/// complete values are calls of offered tools and whose last value, cut short, opens with a key
/// a call has and, where the name has begun, a prefix of an offered tool's name. Content that
/// cannot become calls is released at once instead of waiting for the end of the answer.
fn may_become_bare_calls(content: &str, tool_names: &[String]) -> bool {
    if tool_names.is_empty() || content.len() > BARE_CALL_HOLD_BYTES {
        return false;
    }
    let mut text = content.trim_start();
    if let Some(fenced) = text.strip_prefix("```") {
        if "json".starts_with(fenced) {
            return true;
        }
        text = fenced.strip_prefix("json").unwrap_or(fenced);
        // The closing fence, whole or begun.
        text = text.trim_end().trim_end_matches('`');
    } else if "```".starts_with(text) {
        // Nothing yet, or a fence begun.
        return true;
    }
    let text = text.trim();
    if text.is_empty() {
        return true;
    }
    if !text.starts_with('{') && !text.starts_with('[') {
        return false;
    }
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    loop {
        let offset = values.byte_offset();
        match values.next() {
            None => return true,
            Some(Ok(Value::Array(items))) if items.iter().all(|item| call_of(item, tool_names).is_some()) => {}
            Some(Ok(value)) if call_of(&value, tool_names).is_some() => {}
            Some(Ok(_)) => return false,
            Some(Err(error)) if error.is_eof() => return opens_like_a_call(&text[offset..], tool_names),
            Some(Err(_)) => return false,
        }
    }
}

/// Whether a JSON value cut short (`{...` or `[{...`) may still be a call: any keys (a call may
/// carry others, such as Llama 3's `"type"`), unless its top-level `"name"` has begun with a
/// value that is no offered tool's name, or is no string.
fn opens_like_a_call(partial: &str, tool_names: &[String]) -> bool {
    let rest = partial.trim_start();
    let rest = rest.strip_prefix('[').map_or(rest, str::trim_start);
    let Some(mut rest) = rest.strip_prefix('{') else { return rest.is_empty() };
    loop {
        rest = rest.trim_start();
        let Some(after_quote) = rest.strip_prefix('"') else { return true };
        let Some((key, after_key)) = json_string(after_quote) else { return true };
        let after_key = after_key.trim_start();
        let Some(value) = after_key.strip_prefix(':') else { return true };
        let value = value.trim_start();
        if key == "name" {
            if value.is_empty() {
                return true;
            }
            let Some(name) = value.strip_prefix('"') else { return false };
            return match json_string(name) {
                Some((name, _)) => tool_names.iter().any(|tool| *tool == name),
                None => tool_names.iter().any(|tool| tool.starts_with(name)),
            };
        }
        match skip_json_value(value) {
            Some(next) => match next.trim_start().strip_prefix(',') {
                Some(next) => rest = next,
                None => return true,
            },
            None => return true,
        }
    }
}

/// A JSON string's text up to its closing quote (escapes kept as written), and what follows; None
/// when it does not close yet.
fn json_string(text: &str) -> Option<(&str, &str)> {
    let mut escaped = false;
    for (index, character) in text.char_indices() {
        match character {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some((&text[..index], &text[index + 1..])),
            _ => {}
        }
    }
    None
}

/// What follows one whole JSON value at the start of `text` (strings and nesting followed), or
/// None when the value does not end in `text`.
fn skip_json_value(text: &str) -> Option<&str> {
    let mut depth = 0usize;
    let mut rest = text;
    loop {
        let character = rest.chars().next()?;
        match character {
            '"' => rest = json_string(&rest[1..])?.1,
            '{' | '[' => {
                depth += 1;
                rest = &rest[1..];
            }
            '}' | ']' => {
                depth = depth.checked_sub(1)?;
                rest = &rest[1..];
            }
            ',' if depth == 0 => return Some(rest),
            _ => rest = &rest[character.len_utf8()..],
        }
        if depth == 0 && matches!(character, '"' | '}' | ']') {
            return Some(rest);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> ChatTemplate {
        ChatTemplate::from_text(hypura_forge::QWEN3_TEMPLATE).unwrap()
    }

    fn weather_tool() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn a_reasoning_template_is_read_as_thinking_and_its_answer_split() {
        let template = qwen3();
        assert!(template.caps().template && template.caps().thinking, "{:?}", template.caps());
        assert!(!template.caps().tools, "this template does not render tools");
        let mut turn =
            template.render(&ChatRequest::new(vec![ChatMessage::new("user", "Why is the sky blue?")])).unwrap();
        assert!(
            turn.prompt.ends_with("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"),
            "{}",
            turn.prompt
        );
        let chat = turn.chat.as_mut().expect("a reasoning template's answer is parsed");
        let mut thinking = String::new();
        let mut content = String::new();
        for piece in ["<think>\nRay", "leigh scattering.", "\n</think>\n\nBlue light", " scatters most."] {
            let delta = chat.push(piece);
            thinking.push_str(&delta.thinking);
            content.push_str(&delta.content);
        }
        let (delta, message) = chat.finish();
        thinking.push_str(&delta.thinking);
        content.push_str(&delta.content);
        assert_eq!(message.thinking.trim_end(), "Rayleigh scattering.");
        assert_eq!(message.content, "Blue light scatters most.");
        assert_eq!(
            (thinking.as_str(), content.as_str()),
            (message.thinking.as_str(), message.content.as_str()),
            "the stream's deltas add up to the message"
        );
    }

    #[test]
    fn think_false_closes_the_reasoning_block_and_history_keeps_reasoning() {
        let template = qwen3();
        let request = ChatRequest { think: Some(Think::Off), ..ChatRequest::new(vec![ChatMessage::new("user", "Hi")]) };
        let turn = template.render(&request).unwrap();
        assert!(turn.prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{}", turn.prompt);
        let history = vec![
            ChatMessage::new("user", "Hi"),
            ChatMessage { thinking: Some("greet back".into()), ..ChatMessage::new("assistant", "Hello.") },
            ChatMessage::new("user", "Bye"),
        ];
        let turn = template.render(&ChatRequest::new(history)).unwrap();
        assert!(turn.prompt.contains("<think>\ngreet back\n</think>\n\nHello.<|im_end|>"), "{}", turn.prompt);
    }

    #[test]
    fn capabilities_the_template_lacks_are_refused() {
        let template = qwen3();
        let tools =
            ChatRequest { tools: vec![weather_tool()], ..ChatRequest::new(vec![ChatMessage::new("user", "Weather?")]) };
        assert!(
            matches!(template.render(&tools), Err(ChatError::Unsupported(reason)) if reason.contains("does not support tools"))
        );
        let chatml =
            ChatTemplate::from_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
                .unwrap();
        assert!(!chatml.caps().thinking);
        let think = ChatRequest { think: Some(Think::On), ..ChatRequest::new(vec![ChatMessage::new("user", "Hi")]) };
        assert!(
            matches!(chatml.render(&think), Err(ChatError::Unsupported(reason)) if reason.contains("does not support thinking"))
        );
        // A plain ChatML answer is content as it streams: no parser is needed.
        assert!(chatml.render(&ChatRequest::new(vec![ChatMessage::new("user", "Hi")])).unwrap().chat.is_none());
    }

    #[test]
    fn malformed_tools_are_clear_errors() {
        for (tool, needle) in [
            (json!({"type": "function"}), "\"function\""),
            (json!({"type": "function", "function": {"description": "no name"}}), "needs a name"),
            (json!({"type": "function", "function": {"name": "f", "parameters": "a string"}}), "JSON Schema object"),
            (json!({"type": "retrieval", "function": {"name": "f"}}), "only \"function\""),
        ] {
            let error = check_tool(&tool).unwrap_err().to_string();
            assert!(error.contains(needle), "{error:?} should contain {needle:?}");
        }
        assert!(check_tool(&weather_tool()).is_ok());
        // A schema past the fence's limits never reaches llama.cpp's converter.
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "object", "properties": {"a": deep}});
        }
        let error =
            check_tool(&json!({"type": "function", "function": {"name": "f", "parameters": deep}})).unwrap_err();
        assert!(error.to_string().contains("a tool's parameters"), "{error}");
    }

    #[test]
    fn bare_json_calls_of_offered_tools_are_calls() {
        let names = vec!["get_weather".to_string()];
        let calls = bare_calls("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", &names).unwrap();
        assert_eq!((calls[0].name.as_str(), calls[0].arguments["city"].as_str()), ("get_weather", Some("Paris")));
        assert!(calls[0].id.as_deref().is_some_and(|id| id.starts_with("call_") && id.len() == 29));
        let fenced =
            bare_calls("```json\n[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}]\n```", &names)
                .unwrap();
        assert_eq!(fenced[0].arguments["city"], "Oslo");
        assert_eq!(
            bare_calls(
                "{\"name\": \"get_weather\", \"arguments\": {}}\n{\"name\": \"get_weather\", \"arguments\": {}}",
                &names
            )
            .unwrap()
            .len(),
            2
        );
        // Anything else stays content: an unknown tool, prose, JSON that is not a call.
        assert!(bare_calls("{\"name\": \"delete_everything\", \"arguments\": {}}", &names).is_none());
        assert!(bare_calls("It is sunny in Paris.", &names).is_none());
        assert!(bare_calls("{\"city\": \"Paris\"}", &names).is_none());
        assert!(bare_calls("{\"name\": \"get_weather\"} and more", &names).is_none());
        assert!(
            bare_calls("{\"name\": \"get_weather\", \"arguments\": {}}", &[]).is_none(),
            "no tools offered: no calls"
        );
    }

    /// An answer is held back only while it may still become bare calls: released as soon as
    /// its JSON cannot be a call of an offered tool, or once it is longer than the bound.
    #[test]
    fn content_is_held_back_only_while_it_may_become_a_call() {
        let names = vec!["get_weather".to_string(), "read".to_string()];
        let held = |content: &str| may_become_bare_calls(content, &names);
        // May still become calls: nothing yet, a fence begun, a call or list of calls cut short.
        for content in [
            "",
            "  \n",
            "`",
            "``",
            "```js",
            "```json\n",
            "{",
            "{\"na",
            "{\"name\": \"get_w",
            "{\"name\": \"read\", \"arguments\": {\"path\": \"notes",
            "[{\"name\": \"read\", \"arguments\": {}}, {\"name\": \"get",
            "{\"arguments\": {\"city\": \"Oslo\"}, \"na",
            "{\"type\": \"function\", \"name\": \"get_weather\", \"parameters\": {\"city",
            "{\"id\": 7, \"arguments\": {\"name\": \"Bob\"}, \"name\": \"re",
            "{\"name\": \"read\", \"arguments\": {}}\n{\"name\": \"re",
            "```json\n{\"name\": \"read\", \"arguments\": {}}\n``",
        ] {
            assert!(held(content), "{content:?} may still become a call");
        }
        // Cannot: prose, another first key, a tool not offered, a whole value that is no call,
        // text after a call, anything past the bound.
        for content in [
            "The weather",
            "{\"type\": \"function\", \"name\": \"delete",
            "{\"name\": 3",
            "{\"name\": \"delete",
            "{\"name\": \"read_all\"",
            "{\"city\": \"Paris\"}",
            "[1, 2",
            "{\"name\": \"read\", \"arguments\": {}} and then",
            "```python\n",
        ] {
            assert!(!held(content), "{content:?} cannot become a call");
        }
        let looping =
            format!("{{\"name\": \"read\", \"arguments\": {{\"path\": \"{}", "a".repeat(BARE_CALL_HOLD_BYTES));
        assert!(!held(&looping), "a looping call is released past the bound");
        assert!(!may_become_bare_calls("{", &[]), "no tools offered: nothing is held");
        // Whatever is held until the end is read by `bare_calls` as the same calls.
        for whole in
            ["{\"name\": \"read\", \"arguments\": {\"path\": \"a\"}}", "```json\n[{\"name\": \"get_weather\"}]\n```"]
        {
            assert!(held(whole) && bare_calls(whole, &names).is_some(), "{whole:?}");
        }
    }

    /// A Hermes-style template with tools (llama.cpp reads `<tool_call>` JSON out of the answer).
    fn hermes() -> ChatTemplate {
        ChatTemplate::from_text(concat!(
            "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n",
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}",
            "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}",
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}",
        ))
        .unwrap()
    }

    /// Pieces as a tokenizer cuts text: words with their leading space, and markers apart.
    fn pieces(text: &str) -> Vec<String> {
        let mut pieces: Vec<String> = Vec::new();
        for (index, part) in text.split(' ').enumerate() {
            let word = if index == 0 { part.to_string() } else { format!(" {part}") };
            let mut rest = word.as_str();
            while let Some(at) = rest.find(['<', '{', '"', '\n']) {
                let (before, marker) = rest.split_at(at);
                if !before.is_empty() {
                    pieces.push(before.to_string());
                }
                pieces.push(marker[..1].to_string());
                rest = &marker[1..];
            }
            if !rest.is_empty() {
                pieces.push(rest.to_string());
            }
        }
        pieces
    }

    fn stream(turn: &mut RenderedTurn, text: &str) -> (String, String, AssistantMessage, usize) {
        let chat = turn.chat.as_mut().unwrap();
        let (mut content, mut thinking) = (String::new(), String::new());
        for piece in pieces(text) {
            let delta = chat.push(&piece);
            content.push_str(&delta.content);
            thinking.push_str(&delta.thinking);
        }
        let parsed = chat.parsed_bytes();
        let (delta, message) = chat.finish();
        content.push_str(&delta.content);
        thinking.push_str(&delta.thinking);
        (content, thinking, message, parsed)
    }

    /// Streamed pieces, parsed only where the answer may change course, add up to the answer
    /// parsed whole: reasoning, prose, code with quotes and braces, and a tool call.
    #[test]
    fn streamed_deltas_add_up_to_the_answer_parsed_whole() {
        let code = "Here is the fix:\n```rust\nfn main() { println!(\"{}\", 1 < 2); }\n```\nIt prints \"true\".";
        let cases: Vec<(ChatTemplate, ChatRequest, String)> = vec![
            (
                qwen3(),
                ChatRequest::new(vec![ChatMessage::new("user", "Why?")]),
                format!("<think>\nThe user asks why, so I reason about it: first, then second.\n</think>\n\nBecause of {code} And that is all."),
            ),
            (
                hermes(),
                ChatRequest { tools: vec![weather_tool()], ..ChatRequest::new(vec![ChatMessage::new("user", "Weather?")]) },
                "Let me check the weather in Paris for you, one moment.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>".to_string(),
            ),
            (
                hermes(),
                ChatRequest { tools: vec![weather_tool()], ..ChatRequest::new(vec![ChatMessage::new("user", "Code?")]) },
                format!("{code} {code} Done, with no call at all."),
            ),
        ];
        for (template, request, answer) in cases {
            let (content, thinking, message, _) = stream(&mut template.render(&request).unwrap(), &answer);
            let mut whole = template.render(&request).unwrap();
            let chat = whole.chat.as_mut().unwrap();
            chat.push(&answer);
            let (_, expected) = chat.finish();
            assert_eq!(message.content, expected.content, "{answer:?}");
            assert_eq!(message.thinking, expected.thinking, "{answer:?}");
            assert_eq!(
                message.tool_calls.iter().map(|call| (&call.name, &call.arguments)).collect::<Vec<_>>(),
                expected.tool_calls.iter().map(|call| (&call.name, &call.arguments)).collect::<Vec<_>>()
            );
            assert_eq!(content, expected.content, "streamed content of {answer:?}");
            assert_eq!(thinking, expected.thinking, "streamed reasoning of {answer:?}");
        }
    }

    /// A 4,000-piece answer of prose and code: the parser reads a bounded multiple of the
    /// answer, and the last thousand pieces cost it no more per piece than the second thousand
    /// (re-parsing at every piece would read 21 MB here, growing with the square of the length).
    #[test]
    fn parsing_a_long_answer_stays_linear() {
        let template = hermes();
        let request =
            ChatRequest { tools: vec![weather_tool()], ..ChatRequest::new(vec![ChatMessage::new("user", "Explain.")]) };
        let mut turn = template.render(&request).unwrap();
        let chat = turn.chat.as_mut().unwrap();
        let sentence = pieces("The value of {x} is \"set\" when a < b, so the loop ends.\n");
        let mut marks = Vec::new();
        let mut text = 0;
        for index in 0..4000 {
            let piece = &sentence[index % sentence.len()];
            text += piece.len();
            chat.push(piece);
            if index % 1000 == 999 {
                marks.push(chat.parsed_bytes());
            }
        }
        let total = chat.parsed_bytes();
        assert!(total <= (PARSE_EVERY + 8) * text, "{total} bytes parsed for an answer of {text}");
        // Past the first kilobytes (parsed at more pieces) the cost per piece is flat.
        let second = marks[1] - marks[0];
        let last = marks[3] - marks[2];
        assert!(2 * last <= 3 * second, "the last thousand pieces parsed {last} bytes, the second thousand {second}");
        eprintln!("{total} bytes parsed for {text}; every piece parsed would read {}", text * 4000 / 2);
        let (_, message) = chat.finish();
        assert_eq!(message.content.len(), text, "the answer is content");
    }
}
