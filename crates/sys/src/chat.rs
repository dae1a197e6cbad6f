//! llama.cpp's chat layer (`common/chat.h`) through the C shim in `csrc/chat.cpp`: the model's
//! Jinja template rendered with messages, tools and the thinking switch, and the parser that
//! reads tool calls and reasoning back out of the model's output, with the lazy grammar that
//! keeps a call well formed. The interface is JSON text
//! both ways (OpenAI's message and tool shapes, which llama.cpp's layer reads natively); the
//! engine gives it types.
use std::ffi::{c_char, CStr, CString};
use std::ptr::NonNull;

use crate::error::SysError;
use crate::grammar::Grammar;
use crate::model::Model;
use crate::vocab::Vocab;

#[repr(C)]
struct RawChat {
    _private: [u8; 0],
}

#[repr(C)]
struct RawChatResult {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn hypura_chat_init(
        model: *const llama_cpp_sys_2::llama_model,
        template_override: *const c_char,
        error: *mut *mut c_char,
    ) -> *mut RawChat;
    fn hypura_chat_free(chat: *mut RawChat);
    fn hypura_chat_describe(chat: *const RawChat, error: *mut *mut c_char) -> *mut c_char;
    fn hypura_chat_apply(
        chat: *const RawChat,
        request_json: *const c_char,
        error: *mut *mut c_char,
    ) -> *mut RawChatResult;
    fn hypura_chat_result_free(result: *mut RawChatResult);
    fn hypura_chat_result_json(result: *const RawChatResult, error: *mut *mut c_char) -> *mut c_char;
    fn hypura_chat_result_grammar(
        result: *const RawChatResult,
        vocab: *const llama_cpp_sys_2::llama_vocab,
        none: *mut bool,
        error: *mut *mut c_char,
    ) -> *mut llama_cpp_sys_2::llama_sampler;
    fn hypura_chat_parse(
        result: *const RawChatResult,
        text: *const c_char,
        partial: bool,
        error: *mut *mut c_char,
    ) -> *mut c_char;
    fn hypura_chat_string_free(text: *mut c_char);
}

/// Take ownership of a string the shim allocated: copy it out and free it.
pub(crate) fn take_string(pointer: *mut c_char) -> Option<String> {
    if pointer.is_null() {
        return None;
    }
    // SAFETY: non-null strings from the shim are NUL-terminated malloc'd copies that nothing
    // else holds; we copy the text out before freeing it, once.
    let text = unsafe { CStr::from_ptr(pointer) }.to_string_lossy().into_owned();
    // SAFETY: allocated by the shim with malloc, freed by the shim's free, exactly once.
    unsafe { hypura_chat_string_free(pointer) };
    Some(text)
}

/// The shim's error message (or a generic one) after a null return.
fn shim_error(error: *mut c_char) -> SysError {
    SysError::Chat(take_string(error).unwrap_or_else(|| "llama.cpp's chat layer failed without a message".into()))
}

fn c_text(text: &str, what: &str) -> Result<CString, SysError> {
    CString::new(text).map_err(|_| SysError::Chat(format!("the {what} contains a NUL byte")))
}

/// A model's chat templates (the default one and, if the file has it, the tool-use one),
/// parsed once by llama.cpp's Jinja engine.
pub struct ChatTemplates {
    pointer: NonNull<RawChat>,
    /// Held so that the model (whose vocabulary the templates read) outlives them.
    _model: Option<Model>,
}

// SAFETY: after init the templates are only read (apply and describe take a const pointer and
// copy what they use), so sharing them between threads is sound.
unsafe impl Send for ChatTemplates {}
// SAFETY: as above: every use is a read of immutable state.
unsafe impl Sync for ChatTemplates {}

impl ChatTemplates {
    /// The model's templates, or `template` in their place. With neither, llama.cpp falls back
    /// to ChatML; `describe` says whether the template was the file's (or the override).
    pub fn new(model: &Model, template: Option<&str>) -> Result<ChatTemplates, SysError> {
        let template = template.map(|text| c_text(text, "chat template")).transpose()?;
        let mut error = std::ptr::null_mut();
        // SAFETY: the model pointer is valid while `model` lives (we keep a clone); the override
        // is NUL-terminated or null; `error` is a valid out pointer.
        let pointer = unsafe {
            hypura_chat_init(
                model.as_ptr(),
                template.as_ref().map_or(std::ptr::null(), |text| text.as_ptr()),
                &mut error,
            )
        };
        let pointer = NonNull::new(pointer).ok_or_else(|| shim_error(error))?;
        Ok(ChatTemplates { pointer, _model: Some(model.clone()) })
    }

    /// A template text alone, without a model (for what it can do: `describe`). Its BOS and
    /// EOS tokens render empty.
    pub fn from_text(template: &str) -> Result<ChatTemplates, SysError> {
        if template.trim().is_empty() {
            return Err(SysError::Chat("the chat template is empty".into()));
        }
        let template = c_text(template, "chat template")?;
        let mut error = std::ptr::null_mut();
        // SAFETY: a null model is allowed with a non-empty template (llama.cpp reads the model
        // only for its own template and tokens); the text is NUL-terminated; `error` is valid.
        let pointer = unsafe { hypura_chat_init(std::ptr::null(), template.as_ptr(), &mut error) };
        let pointer = NonNull::new(pointer).ok_or_else(|| shim_error(error))?;
        Ok(ChatTemplates { pointer, _model: None })
    }

    /// JSON: `explicit`, `tools`, `thinking`, and the template's capability flags (`caps`).
    pub fn describe(&self) -> Result<String, SysError> {
        let mut error = std::ptr::null_mut();
        // SAFETY: the templates are valid while `self` lives; `error` is a valid out pointer.
        let text = unsafe { hypura_chat_describe(self.pointer.as_ptr(), &mut error) };
        take_string(text).ok_or_else(|| shim_error(error))
    }

    /// Render a request (JSON: `messages`, `tools`, `tool_choice`, `enable_thinking`,
    /// `reasoning_format`, `add_generation_prompt`, ...). Template errors (a role the template
    /// refuses, a malformed message or tool) are errors, never aborts.
    pub fn apply(&self, request_json: &str) -> Result<RenderedChat, SysError> {
        let request = c_text(request_json, "chat request")?;
        let mut error = std::ptr::null_mut();
        // SAFETY: the templates are valid; the request is NUL-terminated and outlives the call;
        // the shim copies what it keeps.
        let pointer = unsafe { hypura_chat_apply(self.pointer.as_ptr(), request.as_ptr(), &mut error) };
        let pointer = NonNull::new(pointer).ok_or_else(|| shim_error(error))?;
        let mut rendered = RenderedChat { pointer, json: String::new() };
        let mut error = std::ptr::null_mut();
        // SAFETY: the result was just created and is valid; `error` is a valid out pointer.
        let json = unsafe { hypura_chat_result_json(rendered.pointer.as_ptr(), &mut error) };
        rendered.json = take_string(json).ok_or_else(|| shim_error(error))?;
        Ok(rendered)
    }
}

impl Drop for ChatTemplates {
    fn drop(&mut self) {
        // SAFETY: created by hypura_chat_init, freed once here.
        unsafe { hypura_chat_free(self.pointer.as_ptr()) };
    }
}

/// One rendered request: the prompt and grammar (as JSON, from `json`) and the parser for the
/// model's answer.
pub struct RenderedChat {
    pointer: NonNull<RawChatResult>,
    json: String,
}

// SAFETY: the result is owned (nothing else points at it) and parse only reads it.
unsafe impl Send for RenderedChat {}

impl RenderedChat {
    /// JSON: `prompt`, `grammar`, `grammar_lazy`, `trigger_patterns`, `trigger_tokens`,
    /// `preserved_tokens`, `additional_stops`, `generation_prompt`, `supports_thinking`, `format`.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// The grammar that keeps a tool call well formed (lazy: it starts at the call's opening
    /// marker), built as llama.cpp builds it; None when the request has no tools.
    pub fn grammar(&self, vocab: &Vocab) -> Result<Option<Grammar>, SysError> {
        let mut none = false;
        let mut error = std::ptr::null_mut();
        // SAFETY: the result is valid while `self` lives and the vocabulary while `vocab` does
        // (the grammar keeps a clone); both out pointers are valid.
        let pointer =
            unsafe { hypura_chat_result_grammar(self.pointer.as_ptr(), vocab.as_ptr(), &mut none, &mut error) };
        if none {
            return Ok(None);
        }
        let pointer = NonNull::new(pointer).ok_or_else(|| shim_error(error))?;
        Ok(Some(Grammar::from_raw(pointer, vocab)))
    }

    /// The assistant message in `text` as OpenAI JSON (`content`, `reasoning_content`,
    /// `tool_calls`). `partial`: the text may still grow.
    pub fn parse(&self, text: &str, partial: bool) -> Result<String, SysError> {
        let text = c_text(text, "model output")?;
        let mut error = std::ptr::null_mut();
        // SAFETY: the result is valid while `self` lives; the text is NUL-terminated and
        // outlives the call.
        let json = unsafe { hypura_chat_parse(self.pointer.as_ptr(), text.as_ptr(), partial, &mut error) };
        take_string(json).ok_or_else(|| shim_error(error))
    }
}

impl Drop for RenderedChat {
    fn drop(&mut self) {
        // SAFETY: created by hypura_chat_apply, freed once here.
        unsafe { hypura_chat_result_free(self.pointer.as_ptr()) };
    }
}
