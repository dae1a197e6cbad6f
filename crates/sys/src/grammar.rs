//! Grammar-constrained sampling: llama.cpp's GBNF grammar sampler, kept outside the sampler
//! chain so that prompt tokens never reach it (the grammar only ever sees generated tokens,
//! and only tokens it allowed: accepting anything else aborts inside llama.cpp).
use std::ffi::CString;
use std::ptr::NonNull;

use llama_cpp_sys_2 as raw;

use crate::error::SysError;
use crate::vocab::{Token, Vocab};

/// A compiled GBNF grammar with its parse state. Freed on drop.
pub struct Grammar {
    pointer: NonNull<raw::llama_sampler>,
    vocab: Vocab,
}

// SAFETY: the grammar sampler is owned and only used through &mut self.
unsafe impl Send for Grammar {}

impl Grammar {
    /// Compile `gbnf` starting at rule `root`. A grammar llama.cpp cannot parse (syntax error,
    /// undefined rule, left recursion) is an error, never an abort: the parser catches its own
    /// exceptions and returns null.
    pub fn new(vocab: &Vocab, gbnf: &str, root: &str) -> Result<Grammar, SysError> {
        // SAFETY: the vocab pointer is valid while `vocab` (which holds the model) lives, and the
        // grammar keeps a clone of it for as long as it lives.
        let pointer = unsafe { compile(vocab.as_ptr(), gbnf, root) }?;
        Ok(Grammar { pointer, vocab: vocab.clone() })
    }

    /// Check that llama.cpp's parser accepts `gbnf` from rule `root`, as `new` would, without
    /// a vocabulary: the parser reads one only for token literals (`<[id]>`), which are then
    /// an error.
    pub(crate) fn check(gbnf: &str, root: &str) -> Result<(), SysError> {
        // SAFETY: a null vocabulary, for a sampler that is only built.
        let pointer = unsafe { compile(std::ptr::null(), gbnf, root) }?;
        // SAFETY: just created, in no chain, freed once here.
        unsafe { raw::llama_sampler_free(pointer.as_ptr()) };
        Ok(())
    }

    /// Take a grammar sampler llama.cpp built (the chat layer's tool-call grammar).
    pub(crate) fn from_raw(pointer: NonNull<raw::llama_sampler>, vocab: &Vocab) -> Grammar {
        Grammar { pointer, vocab: vocab.clone() }
    }

    pub(crate) fn as_ptr(&self) -> *mut raw::llama_sampler {
        self.pointer.as_ptr()
    }

    /// Whether the grammar allows `token` next.
    pub fn allows(&mut self, token: Token) -> bool {
        if token < 0 || token >= self.vocab.n_tokens() {
            return false;
        }
        let mut candidate = raw::llama_token_data { id: token, logit: 0.0, p: 0.0 };
        let mut array = raw::llama_token_data_array { data: &mut candidate, size: 1, selected: -1, sorted: false };
        // SAFETY: the grammar is valid; the array points to one live candidate for the call.
        unsafe { raw::llama_sampler_apply(self.as_ptr(), &mut array) };
        candidate.logit.is_finite()
    }

    /// Set the logits of every token the grammar forbids to -inf.
    pub(crate) fn apply(&mut self, array: &mut raw::llama_token_data_array) {
        // SAFETY: the grammar is valid; the caller's array describes live candidates.
        unsafe { raw::llama_sampler_apply(self.as_ptr(), array) };
    }

    /// Advance the grammar over a generated token. Returns false (and changes nothing) for a
    /// token the grammar does not allow, because llama.cpp aborts on those. End-of-generation
    /// tokens are never fed to it: the caller stops there.
    pub fn accept(&mut self, token: Token) -> bool {
        if self.vocab.is_end_of_generation(token) || !self.allows(token) {
            return false;
        }
        // SAFETY: the grammar is valid and the token was just checked to be allowed, so the
        // grammar's stacks stay non-empty.
        unsafe { raw::llama_sampler_accept(self.as_ptr(), token) };
        true
    }
}

impl Drop for Grammar {
    fn drop(&mut self) {
        // SAFETY: the sampler came from llama_sampler_init_grammar, is not in any chain, and is
        // freed exactly once.
        unsafe { raw::llama_sampler_free(self.pointer.as_ptr()) };
    }
}

/// llama.cpp's grammar sampler for `gbnf` from rule `root`.
///
/// # Safety
/// `vocab` is valid for as long as the sampler is used, or null for a sampler that is only built
/// and freed (building parses the grammar and checks its rules; the vocabulary is read when
/// sampling, and for token literals).
unsafe fn compile(
    vocab: *const raw::llama_vocab,
    gbnf: &str,
    root: &str,
) -> Result<NonNull<raw::llama_sampler>, SysError> {
    let text = CString::new(gbnf).map_err(|_| SysError::Grammar("the grammar contains a NUL byte".into()))?;
    let root_name =
        CString::new(root).map_err(|_| SysError::Grammar("the root rule name contains a NUL byte".into()))?;
    if gbnf.trim().is_empty() {
        return Err(SysError::Grammar("the grammar is empty".into()));
    }
    crate::log::clear_last_error();
    // SAFETY: `vocab` is valid or null (this function's contract); both strings are
    // NUL-terminated and outlive the call (llama.cpp copies them).
    let pointer = unsafe { raw::llama_sampler_init_grammar(vocab, text.as_ptr(), root_name.as_ptr()) };
    NonNull::new(pointer).ok_or_else(|| {
        SysError::Grammar(
            crate::log::take_last_error().unwrap_or_else(|| "llama.cpp could not parse the grammar".into()),
        )
    })
}
