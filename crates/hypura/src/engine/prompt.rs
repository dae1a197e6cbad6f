//! Prompts: what a generation starts from, and how it becomes tokens. The chat template
//! renders conversations (`chat.rs`); tokenizing turns special-token text into control
//! tokens, adds BOS when the model wants it, and never doubles a BOS the template wrote itself.
//! A prompt may follow Ollama's `context` (an earlier exchange's tokens), which it continues
//! without a BOS. The CLI, the benchmark and the server (through the batcher) all tokenize here.
use hypura_sys::{SysError, Token};

use super::chat::{ChatError, ChatRequest, RenderedTurn};
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
    prepare(engine, &[], prompt).map(|(tokens, _)| tokens)
}

/// The tokens of `context` (Ollama's: an earlier exchange's tokens, usually none) followed by
/// the prompt's and, for a conversation, its rendering (the answer's parser, the template's
/// stop strings and marker tokens). A prompt after a context gets no BOS of its own.
pub fn prepare(
    engine: &Engine,
    context: &[Token],
    prompt: &Prompt,
) -> Result<(Vec<Token>, Option<RenderedTurn>), EngineError> {
    let add_special = context.is_empty();
    let (tokens, turn) = match prompt {
        Prompt::Tokens(tokens) => (tokens.clone(), None),
        Prompt::Raw(text) => (tokenize_text(engine, text, add_special)?, None),
        Prompt::Chat(request) => {
            let turn = render_chat(engine, request)?;
            (tokenize_text(engine, &turn.prompt, add_special)?, Some(turn))
        }
    };
    let tokens = if context.is_empty() { tokens } else { [context, tokens.as_slice()].concat() };
    if !context.is_empty() || matches!(prompt, Prompt::Tokens(_)) {
        check_tokens(engine, &tokens)?;
    }
    Ok((tokens, turn))
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
