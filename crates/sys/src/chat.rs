//! llama.cpp's built-in chat template matcher (no Jinja): it recognises a fixed list of
//! templates by name or by their text.
use std::ffi::CString;

use llama_cpp_sys_2 as raw;

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTurn {
    pub role: String,
    pub content: String,
}

/// Render `turns` with `template` (a template text or a built-in name such as "gemma",
/// "chatml", "llama3"). None if llama.cpp does not recognise the template.
pub fn apply_builtin_template(template: &str, turns: &[ChatTurn], add_assistant: bool) -> Option<String> {
    let template = CString::new(template).ok()?;
    let owned: Vec<(CString, CString)> = turns.iter().map(|turn| Some((CString::new(turn.role.as_str()).ok()?, CString::new(turn.content.as_str()).ok()?))).collect::<Option<_>>()?;
    let messages: Vec<raw::llama_chat_message> = owned.iter().map(|(role, content)| raw::llama_chat_message { role: role.as_ptr(), content: content.as_ptr() }).collect();
    let mut buffer = vec![0u8; 256 + 2 * turns.iter().map(|turn| turn.content.len() + turn.role.len()).sum::<usize>()];
    loop {
        let length = i32::try_from(buffer.len()).ok()?;
        // SAFETY: template and every role/content string are NUL-terminated and outlive the
        // call (held in `owned`); messages has n_msg entries; the buffer is writable for
        // `length` bytes and llama.cpp writes at most that many.
        let needed = unsafe { raw::llama_chat_apply_template(template.as_ptr(), messages.as_ptr(), messages.len(), add_assistant, buffer.as_mut_ptr().cast(), length) };
        if needed < 0 {
            return None;
        }
        let needed = needed as usize;
        if needed <= buffer.len() {
            buffer.truncate(needed);
            return String::from_utf8(buffer).ok();
        }
        buffer.resize(needed, 0);
    }
}
