//! The FFI fence. This is the only crate that names `llama_cpp_sys_2` or a raw pointer.
//!
//! It wraps libllama and ggml (built by the pinned `llama-cpp-sys-2` crate) in types that free
//! themselves on drop, and it checks shapes and indices in Rust before they reach C, because a
//! ggml assert aborts the whole process. Everything above this crate (`hypura::engine`, the forge)
//! speaks safe Rust.
#![allow(unsafe_code)] // The fence: every unsafe block below carries its own SAFETY note,
#![deny(clippy::undocumented_unsafe_blocks)] // and clippy checks that it does.

mod backend;
mod batch;
mod chat;
mod context;
mod embedding;
mod error;
mod eval_hook;
mod fit;
mod grammar;
mod json_schema;
mod load_reader;
mod log;
mod model;
mod pool;
mod quantize;
mod rpc;
mod sampler;
mod speculative;
pub mod state;
mod stream;
mod vocab;

pub use backend::{Backend, DeviceInfo, DeviceKind};
pub use batch::Batch;
pub use chat::{ChatTemplates, RenderedChat};
pub use context::{Context, ContextParams};
pub use embedding::EmbeddingContext;
pub use error::SysError;
pub use eval_hook::{CpuExperts, EvalHook, ExpertShape, HostExpert, ObservedNode};
pub use fit::{fit_placement, FitPlacement};
pub use grammar::Grammar;
pub use json_schema::{check_json_schema, json_schema_to_grammar};
pub use load_reader::LoadReader;
pub use model::{exact_name_pattern, repacking_available, LoadMode, Model, ModelParams, Placement};
pub use pool::{DevicePool, ModelTensor};
pub use quantize::{dequantize_rows, ggml_type_block_size, ggml_type_name, ggml_type_size, quantize_rows};
pub use rpc::{
    capped_device, connect as rpc_connect, local_device, ops as ggml_ops, serve as rpc_serve, DeviceHandle,
    RPC_PROTOCOL_MAJOR,
};
pub use sampler::{first_maximum, Sampler, SamplerParams};
pub use speculative::{DraftRequest, SpeculativeParams, Speculator, SPECULATIVE_TYPES};
pub use stream::StreamBufferType;
pub use vocab::{Token, Vocab};

/// The exact llama.cpp build this crate links, for bench reports.
pub fn llama_build_info() -> String {
    // SAFETY: llama_print_system_info returns a pointer to a static, NUL-terminated buffer
    // owned by libllama that stays valid until the next call; we copy it out at once.
    let system = unsafe { std::ffi::CStr::from_ptr(llama_cpp_sys_2::llama_print_system_info()) };
    system.to_string_lossy().into_owned()
}
