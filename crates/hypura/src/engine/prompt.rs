//! Prompts: what a generation starts from, and how it becomes tokens. The chat template
//! renders conversations (`template.rs`); tokenizing turns special-token text into control
//! tokens, adds BOS when the model wants it, and never doubles a BOS the template wrote itself.
//! The CLI, the benchmark and the server all tokenize here.
use hypura_sys::{SysError, Token};
use serde::{Deserialize, Serialize};

use super::{Engine, EngineError};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Text passed to the tokenizer as is (BOS added when the model wants it).
    Raw(String),
    /// A conversation rendered with the model's chat template, the assistant's turn opened.
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are (benchmarks, and Ollama's `context`).
    Tokens(Vec<Token>),
}

/// The prompt's tokens. Token ids are checked against the vocabulary (an id out of range would
/// be an out-of-bounds read inside llama.cpp).
pub fn tokenize(engine: &Engine, prompt: &Prompt) -> Result<Vec<Token>, EngineError> {
    match prompt {
        Prompt::Tokens(tokens) => {
            check_tokens(engine, tokens)?;
            Ok(tokens.clone())
        }
        Prompt::Raw(text) => tokenize_text(engine, text, true),
        Prompt::Chat(messages) => tokenize_text(engine, &render_chat(engine, messages)?, true),
    }
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
pub fn render_chat(engine: &Engine, messages: &[ChatMessage]) -> Result<String, EngineError> {
    engine.template().render(messages, true).map_err(|reason| EngineError::Template { path: engine.inventory().path.clone(), reason })
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
