//! Routes llama.cpp and ggml log lines into `tracing`, and keeps the last error line so that a
//! failed load can say why (llama.cpp reports the reason only through its log).
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;

use llama_cpp_sys_2 as raw;

static LAST_ERROR: Mutex<String> = Mutex::new(String::new());

/// The most recent line llama.cpp logged at error level, cleared by `take_last_error`.
pub(crate) fn take_last_error() -> Option<String> {
    let mut last = LAST_ERROR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if last.is_empty() {
        None
    } else {
        Some(std::mem::take(&mut *last))
    }
}

pub(crate) fn clear_last_error() {
    LAST_ERROR.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clear();
}

unsafe extern "C" fn forward(level: raw::ggml_log_level, text: *const c_char, _user_data: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: ggml passes a NUL-terminated string that lives for the duration of this call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let line = text.trim_end();
    if line.is_empty() {
        return;
    }
    match level {
        raw::GGML_LOG_LEVEL_ERROR => {
            tracing::debug!(target: "llama", "{line}");
            let mut last = LAST_ERROR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            *last = line.to_string();
        }
        raw::GGML_LOG_LEVEL_WARN => tracing::debug!(target: "llama", "{line}"),
        _ => tracing::trace!(target: "llama", "{line}"),
    }
}

pub(crate) fn install() {
    // SAFETY: `forward` is a plain function that is valid for the life of the program and
    // touches no user data; llama.cpp and ggml call it from any thread, which it tolerates.
    unsafe {
        raw::llama_log_set(Some(forward), std::ptr::null_mut());
    }
}
