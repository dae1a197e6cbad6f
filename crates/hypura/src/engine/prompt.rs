//! Prompts: what a generation starts from, and how it becomes tokens. The chat template
//! renders conversations (`chat`); tokenizing turns special-token text into control
//! tokens, adds BOS when the model wants it, and never doubles a BOS the template wrote itself.
//! A prompt may follow Ollama's `context` (an earlier exchange's tokens), which it continues
//! without a BOS. A conversation longer than the context may lose its oldest messages, as
//! Ollama's `truncate` does (`fit_history`). The CLI, the benchmark and the server (through the
//! batcher) all tokenize here.
use hypura_sys::{SysError, Token};

use super::chat::{ChatError, ChatMessage, ChatRequest, RenderedTurn};
use super::{Engine, EngineError};

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text passed to the tokenizer as is (BOS added when the model wants it).
    Raw(String),
    /// A conversation rendered with the model's chat template, the assistant's turn opened
    /// (with its tools and thinking switch); the answer is parsed back (`chat::ChatStream`).
    Chat(ChatRequest),
    /// Token ids, used as they are (benchmarks and comparisons with llama.cpp).
    Tokens(Vec<Token>),
}

/// The prompt's tokens. Token ids are checked against the vocabulary (an id out of range would
/// be an out-of-bounds read inside llama.cpp).
pub fn tokenize(engine: &Engine, prompt: &Prompt) -> Result<Vec<Token>, EngineError> {
    prepare(engine, &[], prompt, None).map(|prepared| prepared.tokens)
}

/// A prompt ready to decode.
pub struct Prepared {
    pub tokens: Vec<Token>,
    /// For a conversation: the answer's parser, the template's stop strings and marker tokens.
    pub turn: Option<RenderedTurn>,
    /// Messages left out so that the conversation fits (`fit`).
    pub dropped_messages: usize,
}

/// The tokens of `context` (Ollama's: an earlier exchange's tokens, usually none) followed by
/// the prompt's and, for a conversation, its rendering. A prompt after a context gets no BOS of
/// its own. With `fit`, a conversation of `fit` tokens or more loses its oldest messages until
/// it is shorter (`fit_history`); one that cannot get shorter is returned whole, for the
/// caller's "too long" error.
pub fn prepare(
    engine: &Engine,
    context: &[Token],
    prompt: &Prompt,
    fit: Option<usize>,
) -> Result<Prepared, EngineError> {
    let add_special = context.is_empty();
    let render = |request: &ChatRequest| -> Result<(Vec<Token>, RenderedTurn), EngineError> {
        let turn = render_chat(engine, request)?;
        Ok((tokenize_text(engine, &turn.prompt, add_special)?, turn))
    };
    let (tokens, turn, dropped_messages) = match prompt {
        Prompt::Tokens(tokens) => (tokens.clone(), None, 0),
        Prompt::Raw(text) => (tokenize_text(engine, text, add_special)?, None, 0),
        Prompt::Chat(request) => {
            let (tokens, turn) = render(request)?;
            match fit.map(|limit| limit.saturating_sub(context.len())) {
                Some(room) if tokens.len() >= room => match fit_history(request, room, &render)? {
                    Some((tokens, turn, dropped)) => (tokens, Some(turn), dropped),
                    None => (tokens, Some(turn), 0),
                },
                _ => (tokens, Some(turn), 0),
            }
        }
    };
    let tokens = if context.is_empty() { tokens } else { [context, tokens.as_slice()].concat() };
    if !context.is_empty() || matches!(prompt, Prompt::Tokens(_)) {
        check_tokens(engine, &tokens)?;
    }
    Ok(Prepared { tokens, turn, dropped_messages })
}

/// Ollama's truncation of a conversation longer than the context: keep the system messages and
/// the newest messages, dropping the oldest others, so that the rendering is shorter than
/// `room` tokens. The kept part starts at a user message (a tool result is not kept without its
/// call, and templates that insist on alternating roles still render), and the last message is
/// always kept. Fewer messages render shorter,
/// so the first start that fits is found by bisection. None when even the last message with
/// the system messages does not fit. Returns the tokens, the rendering and the messages dropped.
#[allow(clippy::type_complexity)]
fn fit_history(
    request: &ChatRequest,
    room: usize,
    render: &dyn Fn(&ChatRequest) -> Result<(Vec<Token>, RenderedTurn), EngineError>,
) -> Result<Option<(Vec<Token>, RenderedTurn, usize)>, EngineError> {
    let messages = &request.messages;
    let starts: Vec<usize> = (1..messages.len()).filter(|&start| messages[start].role == "user").collect();
    let from = |start: usize| -> ChatRequest {
        let kept: Vec<ChatMessage> = messages[..start]
            .iter()
            .filter(|message| message.role == "system")
            .chain(&messages[start..])
            .cloned()
            .collect();
        ChatRequest { messages: kept, ..request.clone() }
    };
    let Some(&last) = starts.last() else { return Ok(None) };
    let shortest = render(&from(last))?;
    if shortest.0.len() >= room {
        return Ok(None);
    }
    // starts[high] fits; find the first that does.
    let (mut low, mut high, mut best) = (0, starts.len() - 1, shortest);
    while low < high {
        let middle = (low + high) / 2;
        let rendered = render(&from(starts[middle]))?;
        if rendered.0.len() < room {
            high = middle;
            best = rendered;
        } else {
            low = middle + 1;
        }
    }
    let start = starts[high];
    let dropped = messages[..start].iter().filter(|message| message.role != "system").count();
    Ok(Some((best.0, best.1, dropped)))
}

/// How many leading tokens of a conversation's rendering (`tokens`) come from its system
/// messages and tools alone, whatever follows them: the part an agent's next session, or the
/// next question under the same system prompt, starts with too. Found without knowing the
/// template: those messages are rendered with two different one-word user messages, and the
/// part both renderings share (and `tokens` shares with them) is the answer. None where the
/// conversation has no system message or tools before its first other message.
pub fn stable_prefix(engine: &Engine, request: &ChatRequest, tokens: &[Token]) -> Option<usize> {
    let leading = request.messages.iter().take_while(|message| message.role == "system").count();
    if leading == 0 && request.tools.is_empty() {
        return None;
    }
    let with_question = |question: &str| -> Option<Vec<Token>> {
        let mut messages = request.messages[..leading].to_vec();
        messages.push(ChatMessage::new("user", question));
        let turn = render_chat(engine, &ChatRequest { messages, ..request.clone() }).ok()?;
        tokenize_text(engine, &turn.prompt, true).ok()
    };
    let (first, second) = (with_question("Alpha")?, with_question("Zulu")?);
    let shared = |a: &[Token], b: &[Token]| a.iter().zip(b).take_while(|(a, b)| a == b).count();
    Some(shared(&first, &second).min(shared(&first, tokens)))
}

/// Every token id within the vocabulary.
fn check_tokens(engine: &Engine, tokens: &[Token]) -> Result<(), EngineError> {
    let n_vocab = engine.model().vocab().n_tokens();
    match tokens.iter().find(|&&token| token < 0 || token >= n_vocab) {
        Some(&bad) => Err(SysError::BadToken { token: bad, n_vocab }.into()),
        None => Ok(()),
    }
}

/// Render a conversation with the engine's chat template, the assistant's turn opened.
pub fn render_chat(engine: &Engine, request: &ChatRequest) -> Result<RenderedTurn, EngineError> {
    engine.template().render(request).map_err(|error| match error {
        ChatError::Unsupported(reason) => EngineError::Unsupported(reason),
        ChatError::Template(reason) => EngineError::Template { path: engine.inventory().path.clone(), reason },
    })
}

/// Tokenize text: special-token text becomes control tokens, BOS is added when `add_special`
/// and the model wants it, and a BOS that the template already wrote is not doubled.
pub fn tokenize_text(engine: &Engine, text: &str, add_special: bool) -> Result<Vec<Token>, EngineError> {
    let vocab = engine.model().vocab();
    let mut tokens = vocab.tokenize(text, add_special, true)?;
    if tokens.len() >= 2 && tokens[0] == vocab.bos() && tokens[1] == vocab.bos() {
        tokens.remove(0);
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for the template: a token per character of each message, in order.
    #[allow(clippy::type_complexity)]
    fn by_characters() -> impl Fn(&ChatRequest) -> Result<(Vec<Token>, RenderedTurn), EngineError> {
        |request: &ChatRequest| {
            let prompt: String =
                request.messages.iter().map(|message| format!("{}:{};", message.role, message.content)).collect();
            let tokens = prompt.chars().map(|character| character as Token).collect();
            Ok((tokens, RenderedTurn { prompt, stops: Vec::new(), preserved: Vec::new(), chat: None }))
        }
    }

    fn conversation(roles: &[&str]) -> ChatRequest {
        let messages = roles
            .iter()
            .enumerate()
            .map(|(index, role)| ChatMessage::new(*role, format!("message {index:02}")))
            .collect();
        ChatRequest::new(messages)
    }

    fn kept(rendered: &RenderedTurn) -> Vec<String> {
        rendered.prompt.split(';').filter(|part| !part.is_empty()).map(|part| part.to_string()).collect()
    }

    #[test]
    fn the_oldest_messages_go_first_and_the_system_prompt_stays() {
        let request = conversation(&["system", "user", "assistant", "user", "assistant", "user"]);
        let render = by_characters();
        // Each message is 17 or 22 characters; room for the system prompt and the last three.
        let room = render(&ChatRequest::new(request.messages[3..].to_vec())).unwrap().0.len() + 24;
        let (tokens, rendered, dropped) = fit_history(&request, room, &render).unwrap().unwrap();
        assert!(tokens.len() < room);
        assert_eq!(
            kept(&rendered),
            ["system:message 00", "user:message 03", "assistant:message 04", "user:message 05"]
        );
        assert_eq!(dropped, 2);
    }

    /// The kept part starts at a user message: a tool result is not kept without the call it
    /// answers. The last message stays even when nothing before it fits.
    #[test]
    fn a_tool_result_is_not_kept_without_its_call() {
        let roles = ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "user"];
        let request = conversation(&roles);
        let render = by_characters();
        // Room for everything from the tool result on: the cut moves on to the next user message.
        let room =
            render(&ChatRequest::new([&request.messages[..1], &request.messages[3..]].concat())).unwrap().0.len() + 1;
        let (_, rendered, dropped) = fit_history(&request, room, &render).unwrap().unwrap();
        assert_eq!(
            kept(&rendered),
            ["system:message 00", "user:message 05", "assistant:message 06", "user:message 07"]
        );
        assert_eq!(dropped, 4);
        let (_, rendered, _) = fit_history(&request, 40, &render).unwrap().unwrap();
        assert_eq!(kept(&rendered), ["system:message 00", "user:message 07"]);
        assert!(
            fit_history(&request, 20, &render).unwrap().is_none(),
            "the last message with the system prompt does not fit"
        );
    }
}
