//! ggml's RPC protocol as the pinned llama.cpp speaks it (version 7.0.0), and the checks the
//! validating front of `hypura rpc-server` (`front.rs`) applies to every request before ggml's
//! server sees it.
//!
//! The framing: a request is `cmd: u8 | size: u64 | payload`, a response `size: u64 |
//! payload`; which commands have a response, and how long it is, is read from `ggml-rpc.cpp`'s
//! server loop (`rpc_serve_client`), the request layouts from its `rpc_msg_*` structures
//! (packed, little-endian), a tensor from `rpc_tensor` (296 bytes).
//!
//! What a client may do is what its own allocations allow: a request that names a command past
//! the protocol, has the wrong size for its command, names a buffer this client did not
//! allocate, points a tensor (or a view, or a source) outside the buffer it names, uses an
//! operation that is not a plain ggml operation (the custom and map operations carry function
//! pointers), counts more nodes or tensors than its frame holds, or asks for memory past what
//! the worker lends, is refused with a reason. Everything ggml's server would refuse by itself
//! is refused here first, so no request reaches code that aborts on it.
//!
//! The parts: this file holds the wire's commands, sizes and verdicts; `tensor` reads an
//! `rpc_tensor`, `ledger` counts the memory lent, `session` checks one connection's requests,
//! `replay` runs those checks over a byte stream (for fuzzing), and `craft` writes requests for
//! tests.
pub mod craft;
mod ledger;
mod replay;
mod session;
mod tensor;

pub use ledger::Ledger;
pub use replay::{replay, Replayed};
pub use session::Session;
pub use tensor::Tensor;

pub const CMD_ALLOC_BUFFER: u8 = 0;
pub const CMD_GET_ALIGNMENT: u8 = 1;
pub const CMD_GET_MAX_SIZE: u8 = 2;
pub const CMD_BUFFER_GET_BASE: u8 = 3;
pub const CMD_FREE_BUFFER: u8 = 4;
pub const CMD_BUFFER_CLEAR: u8 = 5;
pub const CMD_SET_TENSOR: u8 = 6;
pub const CMD_SET_TENSOR_HASH: u8 = 7;
pub const CMD_GET_TENSOR: u8 = 8;
pub const CMD_COPY_TENSOR: u8 = 9;
pub const CMD_GRAPH_COMPUTE: u8 = 10;
pub const CMD_GET_DEVICE_MEMORY: u8 = 11;
pub const CMD_INIT_TENSOR: u8 = 12;
pub const CMD_GET_ALLOC_SIZE: u8 = 13;
pub const CMD_HELLO: u8 = 14;
pub const CMD_DEVICE_COUNT: u8 = 15;
pub const CMD_GRAPH_RECOMPUTE: u8 = 16;
pub const CMD_MEMSET_TENSOR: u8 = 17;
/// `RPC_CMD_NONE` (18) is the client's own marker and never goes on the wire.
pub const CMD_COUNT: u8 = 19;

/// `rpc_tensor`, packed.
pub const TENSOR_BYTES: usize = 296;
/// `rpc_msg_hello_req`: the transport's capability bytes.
pub const HELLO_REQUEST_BYTES: u64 = 24;
/// `rpc_msg_hello_rsp`: major, minor, patch, padding, then the transport's 24 capability bytes.
pub const HELLO_RESPONSE_BYTES: u64 = 4 + 24;
/// SET_TENSOR's payload before the tensor's bytes: the tensor, a cache flag, the offset.
pub const SET_TENSOR_HEADER: usize = TENSOR_BYTES + 1 + 8;
/// The most nodes, and the most tensors, one graph may have: llama.cpp's graphs have at most
/// eight nodes a weight tensor (tens of thousands for the largest models), and a frame this
/// size is at most 20 MB.
pub const MAX_GRAPH_ENTRIES: u64 = 1 << 16;
const MAX_DIMS: usize = 4;
const MAX_SRC: usize = 10;

/// The length of the response `cmd` gets, from its request's payload; None for a command
/// without one.
pub fn response_bytes(cmd: u8, payload: &[u8]) -> Option<u64> {
    Some(match cmd {
        CMD_HELLO => HELLO_RESPONSE_BYTES,
        CMD_DEVICE_COUNT => 4,
        // The remote pointer and size; free and total memory.
        CMD_ALLOC_BUFFER | CMD_GET_DEVICE_MEMORY => 16,
        CMD_GET_ALIGNMENT | CMD_GET_MAX_SIZE | CMD_BUFFER_GET_BASE | CMD_GET_ALLOC_SIZE => 8,
        // A result byte.
        CMD_SET_TENSOR_HASH | CMD_COPY_TENSOR => 1,
        // The size the request asks for, its payload's last 8 bytes.
        CMD_GET_TENSOR => payload.len().checked_sub(8).map_or(0, |at| le_u64(&payload[at..])),
        // FREE_BUFFER, BUFFER_CLEAR, SET_TENSOR, INIT_TENSOR, GRAPH_COMPUTE, GRAPH_RECOMPUTE,
        // MEMSET_TENSOR.
        _ => return None,
    })
}

/// The payload length each fixed-size request must have (`recv_msg` insists on it); None for
/// SET_TENSOR and GRAPH_COMPUTE, whose payloads vary.
fn request_bytes(cmd: u8) -> Option<u64> {
    let tensor = TENSOR_BYTES as u64;
    Some(match cmd {
        CMD_ALLOC_BUFFER => 4 + 8,
        CMD_GET_ALIGNMENT | CMD_GET_MAX_SIZE | CMD_GET_DEVICE_MEMORY | CMD_GRAPH_RECOMPUTE => 4,
        CMD_BUFFER_GET_BASE | CMD_FREE_BUFFER => 8,
        CMD_BUFFER_CLEAR => 8 + 1,
        CMD_SET_TENSOR_HASH | CMD_GET_TENSOR => tensor + 8 + 8,
        CMD_COPY_TENSOR => 2 * tensor,
        CMD_INIT_TENSOR => tensor,
        CMD_GET_ALLOC_SIZE => 4 + tensor * (1 + MAX_SRC as u64),
        CMD_HELLO => HELLO_REQUEST_BYTES,
        CMD_DEVICE_COUNT => 0,
        CMD_MEMSET_TENSOR => tensor + 8 + 8 + 1,
        _ => return None,
    })
}

/// The little-endian u32 at the start of `bytes` (ggml's wire order).
pub(crate) fn le_u32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"))
}

/// The little-endian u64 at the start of `bytes`.
pub(crate) fn le_u64(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
}

/// Why a request was refused (the front logs it and closes the connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

fn refuse<T>(why: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal(why.into()))
}

/// How much of a request the front reads before it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// The whole payload (this many bytes).
    Whole(u64),
    /// SET_TENSOR: its header; the tensor's bytes then stream through.
    Header(usize),
}

/// What to do with a request that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Forward,
    /// Answer the client with this response frame, without forwarding (an allocation past what
    /// is lent is answered as ggml answers a failed one).
    Answer(Vec<u8>),
}
