use std::path::PathBuf;

/// Errors raised at the FFI fence. Each names the file, the value and the limit involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SysError {
    #[error("llama.cpp could not load {path}: {reason}")]
    ModelLoad { path: PathBuf, reason: String },
    #[error("path {0} contains a NUL byte")]
    PathNul(PathBuf),
    #[error("llama.cpp could not create a context (n_ctx {n_ctx}, n_batch {n_batch}): {reason}")]
    ContextCreate { n_ctx: u32, n_batch: u32, reason: String },
    #[error("batch holds {capacity} tokens; cannot add token {index}")]
    BatchFull { capacity: usize, index: usize },
    #[error("sequence id {seq_id} is outside 0..{n_seq_max}")]
    BadSequence { seq_id: i32, n_seq_max: u32 },
    #[error("llama_decode failed with code {code}: {reason}")]
    Decode { code: i32, reason: String },
    #[error("decode was aborted")]
    Aborted,
    #[error("token {index} of the last batch ({batch_tokens} tokens) has no logits")]
    NoLogits { index: i32, batch_tokens: i32 },
    #[error("token id {token} is outside the vocabulary of {n_vocab} tokens")]
    BadToken { token: i32, n_vocab: i32 },
    #[error("text of {bytes} bytes is too long to tokenize")]
    TextTooLong { bytes: usize },
    #[error("invalid sampling value {name} = {value}: must be {allowed}")]
    BadSampling { name: &'static str, value: f64, allowed: &'static str },
    #[error("llama.cpp could not allocate {0}")]
    Allocation(&'static str),
    #[error("quantize: {0}")]
    Quantize(String),
    #[error("grammar: {0}")]
    Grammar(String),
    #[error("JSON schema: {0}")]
    Schema(String),
    #[error("chat template: {0}")]
    Chat(String),
    #[error("speculative decoding: {0}")]
    Speculative(String),
    #[error("embedding: {0}")]
    Embedding(String),
    #[error("sequence state: {0}")]
    State(String),
    #[error("RPC: {0}")]
    Rpc(String),
}

/// A path as the C string llama.cpp and ggml take.
pub(crate) fn c_path(path: &std::path::Path) -> Result<std::ffi::CString, SysError> {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| SysError::PathNul(path.to_path_buf()))
}
