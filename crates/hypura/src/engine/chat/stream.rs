//! Reading the model's answer as it streams: content and reasoning sent as they grow, tool calls
//! read whole at the end, and llama.cpp's parser run only where the answer may change course.
use hypura_sys::{Grammar, Model, RenderedChat};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::bare::{bare_calls, may_become_bare_calls};
use super::{new_call_id, ToolCall};

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
    /// A stream for the answer to `rendered`, reading calls of `tool_names` (empty: none).
    pub(super) fn new(rendered: RenderedChat, tool_names: Vec<String>) -> ChatStream {
        ChatStream {
            rendered,
            text: String::new(),
            sent_content: 0,
            sent_thinking: 0,
            tool_names,
            last: AssistantMessage::default(),
            tail: Tail::Other,
            parsed: 0,
            parsed_total: 0,
        }
    }

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

#[cfg(test)]
mod tests {
    use super::super::fixtures::{hermes, qwen3, weather_tool};
    use super::super::{ChatMessage, ChatRequest, ChatTemplate, RenderedTurn};
    use super::*;

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
