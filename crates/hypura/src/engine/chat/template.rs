//! Rendering a conversation through the model's chat template (llama.cpp's Jinja engine), with
//! its tools and thinking switch checked first; the rendered turn carries the answer's parser.
use std::collections::HashSet;

use hypura_sys::{ChatTemplates, Model, Token};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ChatMessage, ChatRequest, ChatStream, TemplateCaps, Think, ToolChoice};

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
            chat: parse.then(|| {
                ChatStream::new(
                    rendered,
                    // With tool_choice "none" nothing is read as a call (as llama.cpp's parser does).
                    match request.tool_choice {
                        ToolChoice::None => Vec::new(),
                        _ => tools.iter().filter_map(|tool| tool_name(tool).map(str::to_string)).collect(),
                    },
                )
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

#[cfg(test)]
mod tests {
    use super::super::fixtures::{qwen3, weather_tool};
    use super::*;

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
}
