//! Tokenize and detokenize through the model's own vocabulary.
use llama_cpp_sys_2 as raw;

use crate::error::SysError;
use crate::model::Model;

/// A token id, as llama.cpp numbers them.
pub type Token = i32;

/// The vocabulary of a loaded model. Holds the model alive.
#[derive(Clone, Debug)]
pub struct Vocab {
    model: Model,
}

impl Vocab {
    pub(crate) fn new(model: Model) -> Vocab {
        Vocab { model }
    }

    pub(crate) fn as_ptr(&self) -> *const raw::llama_vocab {
        // SAFETY: the model pointer is valid while `self.model` lives; the vocab is owned by it.
        unsafe { raw::llama_model_get_vocab(self.model.as_ptr()) }
    }

    /// The description of the model this vocabulary belongs to.
    pub fn model_description(&self) -> String {
        self.model.description()
    }

    pub fn n_tokens(&self) -> i32 {
        // SAFETY: the vocab pointer is valid while the model lives.
        unsafe { raw::llama_vocab_n_tokens(self.as_ptr()) }
    }

    pub fn bos(&self) -> Token {
        // SAFETY: the vocab pointer is valid while the model lives.
        unsafe { raw::llama_vocab_bos(self.as_ptr()) }
    }

    pub fn eos(&self) -> Token {
        // SAFETY: the vocab pointer is valid while the model lives.
        unsafe { raw::llama_vocab_eos(self.as_ptr()) }
    }

    /// End of generation: EOS, EOT and the other stop tokens the vocabulary marks.
    pub fn is_end_of_generation(&self, token: Token) -> bool {
        // SAFETY: the vocab pointer is valid; out-of-range ids are answered false by llama.cpp's
        // set lookup, but we check the range first anyway.
        token >= 0 && token < self.n_tokens() && unsafe { raw::llama_vocab_is_eog(self.as_ptr(), token) }
    }

    /// Tokenize `text`. `add_special` adds BOS/EOS as the model wants; `parse_special` turns
    /// text such as `<start_of_turn>` into its control token.
    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<Token>, SysError> {
        let text_len = i32::try_from(text.len()).map_err(|_| SysError::TextTooLong { bytes: text.len() })?;
        let mut tokens: Vec<Token> = vec![0; text.len() + 2];
        loop {
            let capacity = i32::try_from(tokens.len()).map_err(|_| SysError::TextTooLong { bytes: text.len() })?;
            // SAFETY: text points to text_len readable bytes; tokens is writable for capacity
            // entries; llama.cpp writes at most capacity tokens and returns minus the needed
            // count when that is too few.
            let count = unsafe {
                raw::llama_tokenize(
                    self.as_ptr(),
                    text.as_ptr().cast(),
                    text_len,
                    tokens.as_mut_ptr(),
                    capacity,
                    add_special,
                    parse_special,
                )
            };
            if count >= 0 {
                tokens.truncate(count as usize);
                return Ok(tokens);
            }
            if count == i32::MIN {
                return Err(SysError::TextTooLong { bytes: text.len() });
            }
            tokens.resize((-count) as usize, 0);
        }
    }

    /// The bytes of one token. They may be a partial UTF-8 sequence; the caller joins them.
    /// `special` renders control tokens as text.
    pub fn token_bytes(&self, token: Token, special: bool) -> Result<Vec<u8>, SysError> {
        let n_vocab = self.n_tokens();
        if token < 0 || token >= n_vocab {
            return Err(SysError::BadToken { token, n_vocab });
        }
        let mut buffer = vec![0u8; 64];
        loop {
            // SAFETY: buffer is writable for its full length; llama.cpp returns minus the needed
            // length when it is too short and writes nothing past the length we pass.
            let written = unsafe {
                raw::llama_token_to_piece(
                    self.as_ptr(),
                    token,
                    buffer.as_mut_ptr().cast(),
                    buffer.len() as i32,
                    0,
                    special,
                )
            };
            if written >= 0 {
                buffer.truncate(written as usize);
                return Ok(buffer);
            }
            buffer.resize((-written) as usize, 0);
        }
    }
}
