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
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use crate::sync::Lock;

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

/// `rpc_tensor`: the fields the checks read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub id: u64,
    pub kind: u32,
    pub buffer: u64,
    pub ne: [u32; MAX_DIMS],
    pub nb: [u32; MAX_DIMS],
    pub op: u32,
    pub op_params: [i32; 16],
    pub src: [u64; MAX_SRC],
    pub view_src: u64,
    pub view_offs: u64,
    pub data: u64,
}

impl Tensor {
    /// Parse the first `TENSOR_BYTES` of `bytes`.
    pub fn parse(bytes: &[u8]) -> Tensor {
        let bytes = &bytes[..TENSOR_BYTES];
        let u32s = |at: usize| -> [u32; MAX_DIMS] { std::array::from_fn(|i| le_u32(&bytes[at + 4 * i..])) };
        Tensor {
            id: le_u64(&bytes[0..]),
            kind: le_u32(&bytes[8..]),
            buffer: le_u64(&bytes[12..]),
            ne: u32s(20),
            nb: u32s(36),
            op: le_u32(&bytes[52..]),
            op_params: std::array::from_fn(|i| le_u32(&bytes[56 + 4 * i..]) as i32),
            src: std::array::from_fn(|i| le_u64(&bytes[124 + 8 * i..])),
            view_src: le_u64(&bytes[204..]),
            view_offs: le_u64(&bytes[212..]),
            data: le_u64(&bytes[220..]),
        }
    }

    /// The bytes the tensor spans from its data pointer, as `ggml_nbytes` counts them (0 when a
    /// dimension is 0); an error for a type ggml does not have or a row that is not whole blocks.
    pub fn nbytes(&self) -> Result<u64, Refusal> {
        if self.kind >= hypura_sys::ggml_ops::TYPE_COUNT {
            return refuse(format!("tensor type {} is past ggml's types", self.kind));
        }
        let (Ok(block), Ok(size)) =
            (hypura_sys::ggml_type_block_size(self.kind), hypura_sys::ggml_type_size(self.kind))
        else {
            return refuse(format!("tensor type {} is not a live ggml type", self.kind));
        };
        if block == 0 || u64::from(self.ne[0]) % block != 0 {
            return refuse(format!("a row of {} elements is not whole blocks of type {}", self.ne[0], self.kind));
        }
        if self.ne.contains(&0) {
            return Ok(0);
        }
        let far = |from: usize| -> u128 {
            (from..MAX_DIMS).map(|i| u128::from(self.ne[i] - 1) * u128::from(self.nb[i])).sum()
        };
        let bytes = if block == 1 {
            u128::from(size) + far(0)
        } else {
            u128::from(self.ne[0]) * u128::from(self.nb[0]) / u128::from(block) + far(1)
        };
        u64::try_from(bytes).or_else(|_| refuse("a tensor larger than the address space"))
    }

    /// The operation is one ggml computes itself: in range, no custom or map operation, and a
    /// unary or gated operation's own number in range.
    fn check_op(&self) -> Result<(), Refusal> {
        use hypura_sys::ggml_ops as ops;
        let sub = self.op_params[0];
        if self.op >= ops::COUNT {
            return refuse(format!("operation {} is past ggml's {} operations", self.op, ops::COUNT));
        }
        if ops::CUSTOM.contains(&self.op) {
            return refuse(format!("operation {} is a custom operation (a function pointer)", self.op));
        }
        let (family, count) = match self.op {
            op if op == ops::UNARY => ("unary", ops::UNARY_COUNT),
            op if op == ops::GLU => ("gated", ops::GLU_COUNT),
            _ => return Ok(()),
        };
        if sub < 0 || sub as u32 >= count {
            return refuse(format!("{family} operation {sub} is past ggml's {count}"));
        }
        Ok(())
    }
}

/// A buffer one client allocated: its device and the addresses it spans.
#[derive(Debug, Clone, Copy)]
struct Buffer {
    device: u32,
    base: u64,
    size: u64,
}

/// Memory lent per device and how much of it every client's buffers hold; shared by the
/// front's connections.
#[derive(Debug)]
pub struct Ledger {
    /// Bytes each device lends (None: the device's own memory is the limit, as for a GPU).
    limits: Vec<Option<u64>>,
    held: Mutex<Vec<u64>>,
}

impl Ledger {
    pub fn new(limits: Vec<Option<u64>>) -> Arc<Ledger> {
        let held = Mutex::new(vec![0; limits.len()]);
        Arc::new(Ledger { limits, held })
    }

    /// Reserve `bytes` on `device`; false where that is more than it has left to lend.
    fn reserve(&self, device: u32, bytes: u64) -> bool {
        let mut held = self.held.locked();
        let Some(slot) = held.get_mut(device as usize) else { return true };
        let limit = self.limits.get(device as usize).copied().flatten().unwrap_or(u64::MAX);
        if slot.saturating_add(bytes) > limit {
            return false;
        }
        *slot += bytes;
        true
    }

    fn release(&self, device: u32, bytes: u64) {
        if let Some(slot) = self.held.locked().get_mut(device as usize) {
            *slot = slot.saturating_sub(bytes);
        }
    }

    /// What `device` has left to lend, where it lends a set amount.
    fn left(&self, device: u32) -> Option<u64> {
        let limit = self.limits.get(device as usize).copied().flatten()?;
        Some(limit.saturating_sub(self.held.locked().get(device as usize).copied().unwrap_or(0)))
    }
}

/// One client's connection as the front sees it: the handshake, the devices, the buffers it
/// allocated and the graphs the worker holds for it.
pub struct Session {
    ledger: Arc<Ledger>,
    hello: bool,
    devices: Option<u32>,
    buffers: HashMap<u64, Buffer>,
    /// Devices whose last graph passed the checks (and may be computed again).
    graphs: HashSet<u32>,
    /// An allocation forwarded and not yet answered: its device and the bytes reserved.
    pending: Option<(u32, u64)>,
}

impl Session {
    pub fn new(ledger: Arc<Ledger>) -> Session {
        Session { ledger, hello: false, devices: None, buffers: HashMap::new(), graphs: HashSet::new(), pending: None }
    }

    /// Check a request's header: a known command, in order, with a size it may have. The
    /// largest payload a client may send is bounded by what it was lent.
    pub fn framing(&self, cmd: u8, size: u64) -> Result<Framing, Refusal> {
        if cmd >= CMD_COUNT || cmd == CMD_COUNT - 1 {
            return refuse(format!("command {cmd} is not one of ggml's RPC commands"));
        }
        if !self.hello && cmd != CMD_HELLO {
            return refuse(format!("command {cmd} before HELLO"));
        }
        if self.hello && cmd == CMD_HELLO {
            return refuse("a second HELLO");
        }
        if let Some(expected) = request_bytes(cmd) {
            if size != expected {
                return refuse(format!("command {cmd} with a {size}-byte payload where ggml's is {expected} bytes"));
            }
            return Ok(Framing::Whole(size));
        }
        match cmd {
            CMD_SET_TENSOR => {
                let largest = self.buffers.values().map(|buffer| buffer.size).max().unwrap_or(0);
                if size < SET_TENSOR_HEADER as u64 || size - SET_TENSOR_HEADER as u64 > largest {
                    return refuse(format!("SET_TENSOR of {size} bytes, past every buffer of this client"));
                }
                Ok(Framing::Header(SET_TENSOR_HEADER))
            }
            _ => {
                // GRAPH_COMPUTE: a device, the node count, the nodes, the tensor count, the
                // tensors; each count bounded.
                let most = 12 + MAX_GRAPH_ENTRIES * 8 + MAX_GRAPH_ENTRIES * TENSOR_BYTES as u64;
                if !(12..=most).contains(&size) {
                    return refuse(format!("GRAPH_COMPUTE of {size} bytes"));
                }
                Ok(Framing::Whole(size))
            }
        }
    }

    /// Check a request's payload (for SET_TENSOR, its header, with the whole frame's `size`).
    pub fn check(&mut self, cmd: u8, payload: &[u8], size: u64) -> Result<Verdict, Refusal> {
        match cmd {
            CMD_HELLO => {
                self.hello = true;
            }
            CMD_DEVICE_COUNT => {}
            CMD_ALLOC_BUFFER => {
                let device = self.device(le_u32(payload))?;
                let bytes = le_u64(&payload[4..]);
                if !self.ledger.reserve(device, bytes) {
                    tracing::warn!(
                        device,
                        bytes,
                        "RPC client asked for more memory than this worker has left to lend; answered as a failed allocation"
                    );
                    let mut answer = 16u64.to_le_bytes().to_vec();
                    answer.extend_from_slice(&[0; 16]);
                    return Ok(Verdict::Answer(answer));
                }
                self.pending = Some((device, bytes));
            }
            CMD_GET_ALIGNMENT | CMD_GET_MAX_SIZE | CMD_GET_DEVICE_MEMORY => {
                self.device(le_u32(payload))?;
            }
            CMD_BUFFER_GET_BASE | CMD_BUFFER_CLEAR => {
                self.buffer(le_u64(payload))?;
            }
            CMD_FREE_BUFFER => {
                let remote = le_u64(payload);
                let buffer = self.buffer(remote)?;
                self.buffers.remove(&remote);
                self.ledger.release(buffer.device, buffer.size);
                // ggml's server may drop the graphs that point into a freed buffer.
                self.graphs.clear();
            }
            CMD_SET_TENSOR => {
                let tensor = Tensor::parse(payload);
                let offset = le_u64(&payload[TENSOR_BYTES + 1..]);
                self.check_range(&tensor, offset, size - SET_TENSOR_HEADER as u64)?;
            }
            CMD_SET_TENSOR_HASH => {
                // The bytes come from the worker's cache, sized by its file: ggml checks that
                // range itself; the tensor's own must hold.
                let tensor = Tensor::parse(payload);
                self.check_range(&tensor, le_u64(&payload[TENSOR_BYTES..]), 0)?;
            }
            CMD_GET_TENSOR => {
                let tensor = Tensor::parse(payload);
                let offset = le_u64(&payload[TENSOR_BYTES..]);
                self.check_range(&tensor, offset, le_u64(&payload[TENSOR_BYTES + 8..]))?;
            }
            CMD_MEMSET_TENSOR => {
                let tensor = Tensor::parse(payload);
                let offset = le_u64(&payload[TENSOR_BYTES..]);
                self.check_range(&tensor, offset, le_u64(&payload[TENSOR_BYTES + 8..]))?;
            }
            CMD_COPY_TENSOR => {
                let source = Tensor::parse(payload);
                let target = Tensor::parse(&payload[TENSOR_BYTES..]);
                let bytes = self.check_tensor(&source, true)?;
                self.check_range(&target, 0, bytes)?;
            }
            CMD_INIT_TENSOR => {
                self.check_tensor(&Tensor::parse(payload), true)?;
            }
            CMD_GET_ALLOC_SIZE => {
                self.device(le_u32(payload))?;
                self.check_tensor(&Tensor::parse(&payload[4..]), false)?;
                for at in (0..MAX_SRC).map(|i| 4 + TENSOR_BYTES * (1 + i)) {
                    let source = Tensor::parse(&payload[at..]);
                    if source.id != 0 {
                        self.check_tensor(&source, false)?;
                    }
                }
            }
            CMD_GRAPH_COMPUTE => {
                let device = self.check_graph(payload)?;
                self.graphs.insert(device);
            }
            CMD_GRAPH_RECOMPUTE => {
                let device = self.device(le_u32(payload))?;
                if !self.graphs.contains(&device) {
                    return refuse(format!("GRAPH_RECOMPUTE on device {device}, which holds no graph of this client"));
                }
            }
            _ => return refuse(format!("command {cmd} is not served")),
        }
        Ok(Verdict::Forward)
    }

    /// The worker's device count, which the front asks for itself after the HELLO.
    pub fn set_devices(&mut self, count: u32) {
        self.devices = Some(count);
    }

    /// An allocation's response: the buffer (0 where it failed), its size and its base address.
    pub fn allocated(&mut self, remote: u64, size: u64, base: u64) {
        let Some((device, reserved)) = self.pending.take() else { return };
        self.ledger.release(device, reserved);
        if remote == 0 {
            return;
        }
        // The buffer may be larger than asked (alignment): count what it holds, even where
        // that is a little past the limit (the next allocation is refused then).
        if let Some(held) = self.ledger.held.locked().get_mut(device as usize) {
            *held += size;
        }
        self.buffers.insert(remote, Buffer { device, base, size });
    }

    /// Free memory as the front reports it: the worker's figure, no more than the device has
    /// left to lend among every client.
    pub fn device_memory(&self, device: u32, free: u64) -> u64 {
        self.ledger.left(device).map_or(free, |left| free.min(left))
    }

    fn device(&self, device: u32) -> Result<u32, Refusal> {
        match self.devices {
            Some(count) if device < count => Ok(device),
            Some(count) => refuse(format!("device {device} where the worker has {count}")),
            None => refuse("a device named before DEVICE_COUNT"),
        }
    }

    fn buffer(&self, remote: u64) -> Result<Buffer, Refusal> {
        self.buffers
            .get(&remote)
            .copied()
            .ok_or_else(|| Refusal(format!("buffer {remote:#x} is not one this client allocated")))
    }

    /// A tensor's checks: a live type, whole blocks, a plain operation, and its data inside a
    /// buffer this client allocated (or no data and no buffer, where `needs_buffer` is false).
    /// Returns the bytes it spans.
    fn check_tensor(&self, tensor: &Tensor, needs_buffer: bool) -> Result<u64, Refusal> {
        let bytes = tensor.nbytes()?;
        tensor.check_op()?;
        if tensor.buffer == 0 {
            if needs_buffer || tensor.data != 0 {
                return refuse(format!("tensor {:#x} has data but no buffer of this client", tensor.id));
            }
            return Ok(bytes);
        }
        let buffer = self.buffer(tensor.buffer)?;
        let inside = tensor.data >= buffer.base
            && tensor.data.checked_add(bytes).is_some_and(|end| end <= buffer.base.saturating_add(buffer.size));
        if !inside {
            return refuse(format!(
                "tensor {:#x}'s {bytes} bytes at {:#x} run outside its buffer [{:#x}, +{})",
                tensor.id, tensor.data, buffer.base, buffer.size
            ));
        }
        Ok(bytes)
    }

    /// `bytes` at `offset` of a tensor with a buffer: inside the tensor's buffer.
    fn check_range(&self, tensor: &Tensor, offset: u64, bytes: u64) -> Result<(), Refusal> {
        self.check_tensor(tensor, true)?;
        let buffer = self.buffer(tensor.buffer)?;
        let end = tensor.data.checked_add(offset).and_then(|start| start.checked_add(bytes));
        if end.is_none_or(|end| end > buffer.base.saturating_add(buffer.size)) {
            return refuse(format!(
                "{bytes} bytes at offset {offset} of tensor {:#x} run past the end of its buffer",
                tensor.id
            ));
        }
        Ok(())
    }

    /// GRAPH_COMPUTE's payload: counts that match the frame, every tensor checked, every node,
    /// source and view's source present, every view inside its source. Returns the device.
    fn check_graph(&self, payload: &[u8]) -> Result<u32, Refusal> {
        let device = self.device(le_u32(payload))?;
        let nodes = u64::from(le_u32(&payload[4..]));
        let at_tensors = 8 + nodes * 8;
        if nodes > MAX_GRAPH_ENTRIES || at_tensors + 4 > payload.len() as u64 {
            return refuse(format!("a graph of {nodes} nodes in a {}-byte frame", payload.len()));
        }
        let at_tensors = at_tensors as usize;
        let count = u64::from(le_u32(&payload[at_tensors..]));
        if count > MAX_GRAPH_ENTRIES || at_tensors as u64 + 4 + count * TENSOR_BYTES as u64 != payload.len() as u64 {
            return refuse(format!("a graph of {nodes} nodes and {count} tensors in a {}-byte frame", payload.len()));
        }
        let mut tensors: HashMap<u64, (Tensor, u64)> = HashMap::with_capacity(count as usize);
        for chunk in payload[at_tensors + 4..].chunks_exact(TENSOR_BYTES) {
            let tensor = Tensor::parse(chunk);
            let bytes = self.check_tensor(&tensor, false)?;
            if tensor.id == 0 || tensors.contains_key(&tensor.id) {
                return refuse(format!("tensor id {:#x} is zero or repeated", tensor.id));
            }
            tensors.insert(tensor.id, (tensor, bytes));
        }
        for (tensor, bytes) in tensors.values() {
            for &source in tensor.src.iter().filter(|&&id| id != 0) {
                if !tensors.contains_key(&source) {
                    return refuse(format!("tensor {:#x}'s source {source:#x} is not in the graph", tensor.id));
                }
            }
            if tensor.view_src == 0 {
                continue;
            }
            let Some((source, source_bytes)) = tensors.get(&tensor.view_src) else {
                return refuse(format!("tensor {:#x}'s view source is not in the graph", tensor.id));
            };
            let within = tensor.view_offs.checked_add(*bytes).is_some_and(|end| end <= *source_bytes);
            let placed = source.data == 0 || source.data.checked_add(tensor.view_offs) == Some(tensor.data);
            if !within || !placed {
                return refuse(format!(
                    "view {:#x} ({bytes} bytes at offset {}) runs outside its source {:#x} ({source_bytes} bytes)",
                    tensor.id, tensor.view_offs, source.id
                ));
            }
        }
        for node in payload[8..at_tensors].chunks_exact(8).map(le_u64) {
            match tensors.get(&node) {
                Some((tensor, _)) if tensor.data != 0 => {}
                Some(_) => return refuse(format!("graph node {node:#x} has no data")),
                None if node == 0 => {}
                None => return refuse(format!("graph node {node:#x} is not among the graph's tensors")),
            }
        }
        Ok(device)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The worker frees a client's buffers when its connection ends: so does the ledger.
        for buffer in self.buffers.values() {
            self.ledger.release(buffer.device, buffer.size);
        }
        if let Some((device, reserved)) = self.pending.take() {
            self.ledger.release(device, reserved);
        }
    }
}

/// What `replay` made of a stream of requests.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Requests that passed (answered by the front itself or to be forwarded).
    pub passed: usize,
    /// The refusal that would close the connection, if one came.
    pub refused: Option<Refusal>,
}

/// Read `stream` as a client's side of a connection, the way the front reads it, against a
/// worker with one device that lends `lent` bytes and allocates every buffer it is asked for
/// (at addresses of its own): the checks alone, for fuzzing and for replaying what fuzzing
/// found. A stream cut short ends the replay as a connection cut short ends the front's.
pub fn replay(stream: &[u8], lent: u64) -> Replayed {
    let ledger = Ledger::new(vec![Some(lent)]);
    let mut session = Session::new(ledger.clone());
    let mut replayed = Replayed::default();
    let mut rest = stream;
    let mut next_buffer = 1u64;
    while rest.len() >= 9 {
        let (cmd, size) = (rest[0], le_u64(&rest[1..]));
        rest = &rest[9..];
        let framing = match session.framing(cmd, size) {
            Ok(framing) => framing,
            Err(refusal) => return Replayed { refused: Some(refusal), ..replayed },
        };
        let held = match framing {
            Framing::Whole(bytes) => bytes as usize,
            Framing::Header(bytes) => bytes,
        };
        if rest.len() < held {
            break;
        }
        let (payload, after) = rest.split_at(held);
        match session.check(cmd, payload, size) {
            Ok(_) => replayed.passed += 1,
            Err(refusal) => return Replayed { refused: Some(refusal), ..replayed },
        }
        if cmd == CMD_HELLO {
            session.set_devices(1);
        }
        if cmd == CMD_ALLOC_BUFFER && session.pending.is_some() {
            let bytes = le_u64(&payload[4..]);
            session.allocated(next_buffer, bytes, next_buffer << 40);
            next_buffer += 1;
        }
        // SET_TENSOR's bytes follow its header; the rest of the stream is the next request.
        let streamed = usize::try_from(size - held as u64).unwrap_or(usize::MAX);
        rest = after.get(streamed..).unwrap_or_default();
        let held_bytes: u64 = session.buffers.values().map(|buffer| buffer.size).sum();
        assert!(held_bytes <= lent, "buffers of {held_bytes} bytes past the {lent} lent");
    }
    drop(session);
    assert_eq!(ledger.left(0), Some(lent), "a finished connection left memory counted");
    replayed
}

/// Requests as ggml's client writes them, for the front's tests (a client that misbehaves on
/// purpose).
pub mod craft {
    use super::TENSOR_BYTES;

    /// An `rpc_tensor` as ggml's client serializes it: f32, contiguous.
    pub fn tensor_bytes(
        id: u64,
        buffer: u64,
        ne: [u32; 4],
        op: u32,
        src: &[u64],
        view: (u64, u64),
        data: u64,
    ) -> Vec<u8> {
        let mut bytes = vec![0u8; TENSOR_BYTES];
        bytes[0..8].copy_from_slice(&id.to_le_bytes());
        // Type 0: f32.
        bytes[12..20].copy_from_slice(&buffer.to_le_bytes());
        let mut stride = 4u32;
        for (i, &n) in ne.iter().enumerate() {
            bytes[20 + 4 * i..24 + 4 * i].copy_from_slice(&n.to_le_bytes());
            bytes[36 + 4 * i..40 + 4 * i].copy_from_slice(&stride.to_le_bytes());
            stride *= n;
        }
        bytes[52..56].copy_from_slice(&op.to_le_bytes());
        // GGML_TENSOR_FLAG_COMPUTE, which ggml's graph builder sets on what it computes (a node
        // without it is skipped).
        if op != 0 {
            bytes[120..124].copy_from_slice(&16i32.to_le_bytes());
        }
        for (i, id) in src.iter().enumerate() {
            bytes[124 + 8 * i..132 + 8 * i].copy_from_slice(&id.to_le_bytes());
        }
        bytes[204..212].copy_from_slice(&view.0.to_le_bytes());
        bytes[212..220].copy_from_slice(&view.1.to_le_bytes());
        bytes[220..228].copy_from_slice(&data.to_le_bytes());
        bytes
    }

    pub fn graph_bytes(nodes: &[u64], tensors: &[Vec<u8>]) -> Vec<u8> {
        let mut payload = 0u32.to_le_bytes().to_vec();
        payload.extend_from_slice(&(nodes.len() as u32).to_le_bytes());
        for node in nodes {
            payload.extend_from_slice(&node.to_le_bytes());
        }
        payload.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
        for tensor in tensors {
            payload.extend_from_slice(tensor);
        }
        payload
    }
}

#[cfg(test)]
mod tests {
    use super::craft::{graph_bytes, tensor_bytes};
    use super::*;

    const BUFFER: u64 = 0x5000;
    const BASE: u64 = 0x10_0000;
    const SIZE: u64 = 4096;

    /// A session past HELLO with one device (lending 1 MiB) and one 4 KiB buffer.
    fn session() -> Session {
        let mut session = Session::new(Ledger::new(vec![Some(1 << 20)]));
        assert_eq!(session.framing(CMD_HELLO, 24), Ok(Framing::Whole(24)));
        session.check(CMD_HELLO, &[0; 24], 24).unwrap();
        session.set_devices(1);
        let mut alloc = 0u32.to_le_bytes().to_vec();
        alloc.extend_from_slice(&SIZE.to_le_bytes());
        assert_eq!(session.check(CMD_ALLOC_BUFFER, &alloc, 12), Ok(Verdict::Forward));
        session.allocated(BUFFER, SIZE, BASE);
        session
    }

    fn refused(result: Result<Verdict, Refusal>, words: &str) {
        match result {
            Err(Refusal(why)) => assert!(why.contains(words), "refused for {why:?}, not {words:?}"),
            Ok(verdict) => panic!("passed ({verdict:?}); should be refused for {words:?}"),
        }
    }

    #[test]
    fn a_plain_graph_in_its_buffer_passes() {
        let mut session = session();
        let a = tensor_bytes(1, BUFFER, [4, 4, 1, 1], 0, &[], (0, 0), BASE);
        let b = tensor_bytes(2, BUFFER, [4, 4, 1, 1], 0, &[], (0, 0), BASE + 64);
        let sum = tensor_bytes(3, BUFFER, [4, 4, 1, 1], 2, &[1, 2], (0, 0), BASE + 128);
        let view = tensor_bytes(4, BUFFER, [4, 1, 1, 1], hypura_sys::ggml_ops::NONE, &[], (3, 16), BASE + 144);
        let graph = graph_bytes(&[3, 4], &[a, b, sum, view]);
        assert_eq!(session.framing(CMD_GRAPH_COMPUTE, graph.len() as u64), Ok(Framing::Whole(graph.len() as u64)));
        assert_eq!(session.check(CMD_GRAPH_COMPUTE, &graph, graph.len() as u64), Ok(Verdict::Forward));
        assert_eq!(session.check(CMD_GRAPH_RECOMPUTE, &[0; 4], 4), Ok(Verdict::Forward));
    }

    #[test]
    fn each_hostile_request_is_refused_with_its_reason() {
        use hypura_sys::ggml_ops as ops;
        let mut session = session();
        let graph = |session: &mut Session, tensors: Vec<Vec<u8>>, nodes: &[u64]| {
            let payload = graph_bytes(nodes, &tensors);
            session.check(CMD_GRAPH_COMPUTE, &payload, payload.len() as u64)
        };
        let node = |op: u32| tensor_bytes(1, BUFFER, [4, 1, 1, 1], op, &[], (0, 0), BASE);
        refused(graph(&mut session, vec![node(ops::COUNT)], &[1]), "past ggml's");
        refused(graph(&mut session, vec![node(ops::CUSTOM[3])], &[1]), "custom operation");
        let mut unary = node(ops::UNARY);
        unary[56..60].copy_from_slice(&(ops::UNARY_COUNT + 3).to_le_bytes());
        refused(graph(&mut session, vec![unary], &[1]), "unary operation");
        // Data with no buffer, and a buffer this client never allocated.
        let loose = tensor_bytes(1, 0, [4, 1, 1, 1], 0, &[], (0, 0), 0xdead_0000);
        refused(graph(&mut session, vec![loose], &[1]), "no buffer of this client");
        let foreign = tensor_bytes(1, 0x7777, [4, 1, 1, 1], 0, &[], (0, 0), BASE);
        refused(graph(&mut session, vec![foreign], &[1]), "not one this client allocated");
        // Outside its own buffer, by start and by end.
        refused(
            graph(&mut session, vec![tensor_bytes(1, BUFFER, [4, 1, 1, 1], 0, &[], (0, 0), BASE - 4)], &[1]),
            "outside its buffer",
        );
        refused(
            graph(&mut session, vec![tensor_bytes(1, BUFFER, [1024, 2, 1, 1], 0, &[], (0, 0), BASE)], &[1]),
            "outside its buffer",
        );
        // A view past its source, and one not where its offset says.
        let source = tensor_bytes(1, BUFFER, [4, 1, 1, 1], 0, &[], (0, 0), BASE);
        let past = tensor_bytes(2, BUFFER, [4, 1, 1, 1], ops::NONE, &[], (1, 1024), BASE + 1024);
        refused(graph(&mut session, vec![source.clone(), past], &[2]), "runs outside its source");
        let moved = tensor_bytes(2, BUFFER, [2, 1, 1, 1], ops::NONE, &[], (1, 0), BASE + 8);
        refused(graph(&mut session, vec![source.clone(), moved], &[2]), "runs outside its source");
        // Sources and nodes that are not in the graph; repeated ids.
        let orphan = tensor_bytes(2, BUFFER, [4, 1, 1, 1], 2, &[9], (0, 0), BASE + 16);
        refused(graph(&mut session, vec![source.clone(), orphan], &[2]), "is not in the graph");
        refused(graph(&mut session, vec![source.clone()], &[5]), "not among the graph's tensors");
        refused(graph(&mut session, vec![source.clone(), source.clone()], &[1]), "repeated");
        // Counts that the frame does not hold.
        let mut huge = graph_bytes(&[1], std::slice::from_ref(&source));
        huge[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        refused(session.check(CMD_GRAPH_COMPUTE, &huge, huge.len() as u64), "nodes in a");
        let mut short = graph_bytes(&[1], std::slice::from_ref(&source));
        short.truncate(short.len() - 1);
        refused(session.check(CMD_GRAPH_COMPUTE, &short, short.len() as u64), "tensors in a");
        // A type ggml does not have, and a row that is not whole blocks.
        let mut kind = source.clone();
        kind[8..12].copy_from_slice(&4u32.to_le_bytes());
        refused(graph(&mut session, vec![kind], &[1]), "not a live ggml type");
        let mut blocks = tensor_bytes(1, BUFFER, [5, 1, 1, 1], 0, &[], (0, 0), BASE);
        blocks[8..12].copy_from_slice(&2u32.to_le_bytes());
        refused(graph(&mut session, vec![blocks], &[1]), "whole blocks");
        // Writes and reads past the buffer's end.
        let mut set = tensor_bytes(1, BUFFER, [4, 1, 1, 1], 0, &[], (0, 0), BASE + SIZE - 16);
        set.push(0);
        set.extend_from_slice(&0u64.to_le_bytes());
        refused(session.check(CMD_SET_TENSOR, &set, (SET_TENSOR_HEADER + 64) as u64), "past the end of its buffer");
        assert_eq!(session.check(CMD_SET_TENSOR, &set, (SET_TENSOR_HEADER + 16) as u64), Ok(Verdict::Forward));
        let mut get = source.clone();
        get.extend_from_slice(&0u64.to_le_bytes());
        get.extend_from_slice(&(SIZE + 1).to_le_bytes());
        refused(session.check(CMD_GET_TENSOR, &get, get.len() as u64), "past the end of its buffer");
        // A recompute before any graph passed, on a fresh session.
        refused(self::session().check(CMD_GRAPH_RECOMPUTE, &[0; 4], 4), "holds no graph");
        refused(session.check(CMD_FREE_BUFFER, &0x7777u64.to_le_bytes(), 8), "not one this client allocated");
    }

    #[test]
    fn frames_are_refused_by_their_header() {
        let fresh = Session::new(Ledger::new(vec![None]));
        assert!(fresh.framing(CMD_ALLOC_BUFFER, 12).unwrap_err().0.contains("before HELLO"));
        let session = session();
        assert!(session.framing(CMD_HELLO, 24).unwrap_err().0.contains("second HELLO"));
        assert!(session.framing(CMD_COUNT - 1, 0).unwrap_err().0.contains("not one of"));
        assert!(session.framing(200, 0).unwrap_err().0.contains("not one of"));
        assert!(session.framing(CMD_GET_TENSOR, 313).unwrap_err().0.contains("ggml's is 312"));
        assert!(session.framing(CMD_SET_TENSOR, u64::MAX).unwrap_err().0.contains("past every buffer"));
        assert!(session.framing(CMD_GRAPH_COMPUTE, u64::MAX).is_err());
        // A frame no graph of 2^16 nodes and tensors needs is refused before it is read.
        assert!(session.framing(CMD_GRAPH_COMPUTE, 100 << 20).unwrap_err().0.contains("GRAPH_COMPUTE of"));
        assert_eq!(
            session.framing(CMD_SET_TENSOR, (SET_TENSOR_HEADER as u64) + SIZE),
            Ok(Framing::Header(SET_TENSOR_HEADER))
        );
    }

    fn frame(cmd: u8, payload: &[u8]) -> Vec<u8> {
        let mut frame = vec![cmd];
        frame.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        frame.extend_from_slice(payload);
        frame
    }

    /// A well-behaved connection as `replay` sees it (its first buffer is 1, based at 1 << 40):
    /// every command once, in an order ggml's client could send them.
    fn well_behaved() -> (Vec<u8>, usize) {
        let (buffer, base) = (1u64, 1u64 << 40);
        let tensor = |id: u64, offset: u64| tensor_bytes(id, buffer, [4, 1, 1, 1], 0, &[], (0, 0), base + offset);
        let device = 0u32.to_le_bytes();
        let mut alloc = device.to_vec();
        alloc.extend_from_slice(&4096u64.to_le_bytes());
        let mut set = tensor(1, 0);
        set.push(0);
        set.extend_from_slice(&0u64.to_le_bytes());
        set.extend_from_slice(&[1u8; 16]);
        let with = |mut bytes: Vec<u8>, tail: &[u8]| {
            bytes.extend_from_slice(tail);
            bytes
        };
        let mut get = with(tensor(1, 0), &0u64.to_le_bytes());
        get.extend_from_slice(&16u64.to_le_bytes());
        let mut memset = with(tensor(2, 16), &0u64.to_le_bytes());
        memset.extend_from_slice(&16u64.to_le_bytes());
        memset.push(0);
        let mut alloc_size = with(device.to_vec(), &tensor(3, 32));
        alloc_size.extend_from_slice(&vec![0u8; TENSOR_BYTES * MAX_SRC]);
        let sum = tensor_bytes(3, buffer, [4, 1, 1, 1], 2, &[1, 2], (0, 0), base + 32);
        let frames = [
            frame(CMD_HELLO, &[0; 24]),
            frame(CMD_DEVICE_COUNT, &[]),
            frame(CMD_GET_ALIGNMENT, &device),
            frame(CMD_GET_MAX_SIZE, &device),
            frame(CMD_GET_DEVICE_MEMORY, &device),
            frame(CMD_ALLOC_BUFFER, &alloc),
            frame(CMD_BUFFER_GET_BASE, &buffer.to_le_bytes()),
            frame(CMD_SET_TENSOR, &set),
            frame(CMD_GET_TENSOR, &get),
            frame(CMD_MEMSET_TENSOR, &memset),
            frame(CMD_COPY_TENSOR, &with(tensor(1, 0), &tensor(2, 16))),
            frame(CMD_INIT_TENSOR, &tensor(1, 0)),
            frame(CMD_GET_ALLOC_SIZE, &alloc_size),
            frame(CMD_GRAPH_COMPUTE, &graph_bytes(&[3], &[tensor(1, 0), tensor(2, 16), sum])),
            frame(CMD_GRAPH_RECOMPUTE, &device),
            frame(CMD_BUFFER_CLEAR, &with(buffer.to_le_bytes().to_vec(), &[0])),
            frame(CMD_FREE_BUFFER, &buffer.to_le_bytes()),
        ];
        (frames.concat(), frames.len())
    }

    /// The streams the fuzz target starts from: a well-behaved connection, and each hostile
    /// request after its first half. They replay as they should; with HYPURA_FUZZ_SEED_DIR set
    /// they are also written there (`fuzz/corpus/rpc_front`).
    #[test]
    fn the_fuzz_seeds_replay_as_they_should() {
        let (good, requests) = well_behaved();
        assert_eq!(replay(&good, 1 << 20), Replayed { passed: requests, refused: None });
        let prefix_end = {
            // Through the SET_TENSOR: HELLO .. BUFFER_GET_BASE, SET_TENSOR (8 requests).
            let mut at = 0;
            for _ in 0..8 {
                at += 9 + le_u64(&good[at + 1..]) as usize;
            }
            at
        };
        let prefix = &good[..prefix_end];
        let (buffer, base) = (1u64, 1u64 << 40);
        let node = |op: u32| tensor_bytes(1, buffer, [4, 1, 1, 1], op, &[], (0, 0), base);
        let mut huge = graph_bytes(&[1], &[node(0)]);
        huge[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        let source = node(0);
        let view = tensor_bytes(2, buffer, [4, 1, 1, 1], 0, &[], (1, 1024), base + 1024);
        let mut past = tensor_bytes(1, buffer, [4, 1, 1, 1], 0, &[], (0, 0), base + 4096 - 16);
        past.push(0);
        past.extend_from_slice(&0u64.to_le_bytes());
        past.extend_from_slice(&[7u8; 64]);
        let hostile: [(&str, Vec<u8>, &str); 6] = [
            (
                "op-past-count",
                frame(CMD_GRAPH_COMPUTE, &graph_bytes(&[1], &[node(hypura_sys::ggml_ops::COUNT)])),
                "past ggml's",
            ),
            (
                "data-without-buffer",
                frame(
                    CMD_GRAPH_COMPUTE,
                    &graph_bytes(&[1], &[tensor_bytes(1, 0, [4, 1, 1, 1], 0, &[], (0, 0), 0xdead)]),
                ),
                "no buffer",
            ),
            (
                "foreign-buffer",
                frame(CMD_GRAPH_COMPUTE, &graph_bytes(&[1], &[tensor_bytes(1, 9, [4, 1, 1, 1], 0, &[], (0, 0), base)])),
                "not one this client",
            ),
            ("view-past-source", frame(CMD_GRAPH_COMPUTE, &graph_bytes(&[2], &[source, view])), "outside its source"),
            ("nodes-2-31", frame(CMD_GRAPH_COMPUTE, &huge), "nodes in a"),
            ("set-past-buffer", frame(CMD_SET_TENSOR, &past), "past the end"),
        ];
        let directory = std::env::var_os("HYPURA_FUZZ_SEED_DIR").map(std::path::PathBuf::from);
        for (name, request, reason) in &hostile {
            let stream = [prefix, request.as_slice()].concat();
            let replayed = replay(&stream, 1 << 20);
            assert_eq!(replayed.passed, 8, "{name}");
            assert!(replayed.refused.as_ref().is_some_and(|why| why.0.contains(reason)), "{name}: {replayed:?}");
            if let Some(directory) = &directory {
                std::fs::write(directory.join(name), &stream).unwrap();
            }
        }
        // A truncated frame ends the replay, as a connection cut short.
        assert_eq!(replay(&good[..good.len() - 3], 1 << 20).passed, requests - 1);
        if let Some(directory) = &directory {
            std::fs::write(directory.join("well-behaved"), &good).unwrap();
        }
    }

    /// Every input the fuzz target kept (`fuzz/corpus/rpc_front`) replays without a panic and
    /// with nothing left counted (`replay` asserts both).
    #[test]
    fn the_fuzz_corpus_replays_clean() {
        let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/rpc_front");
        let mut files = 0;
        for entry in std::fs::read_dir(&directory).unwrap() {
            replay(&std::fs::read(entry.unwrap().path()).unwrap(), 1 << 20);
            files += 1;
        }
        assert!(files >= 7, "{files} files in {}", directory.display());
    }

    #[test]
    fn allocations_past_what_is_lent_are_answered_as_failed_and_freed_memory_returns() {
        let ledger = Ledger::new(vec![Some(10_000)]);
        let mut first = Session::new(ledger.clone());
        let mut second = Session::new(ledger.clone());
        for session in [&mut first, &mut second] {
            session.check(CMD_HELLO, &[0; 24], 24).unwrap();
            session.set_devices(1);
        }
        let alloc = |bytes: u64| {
            let mut payload = 0u32.to_le_bytes().to_vec();
            payload.extend_from_slice(&bytes.to_le_bytes());
            payload
        };
        assert_eq!(first.check(CMD_ALLOC_BUFFER, &alloc(6_000), 12), Ok(Verdict::Forward));
        first.allocated(0x1, 6_000, 0x1000);
        assert_eq!(second.device_memory(0, 1 << 40), 4_000);
        let mut failed = 16u64.to_le_bytes().to_vec();
        failed.extend_from_slice(&[0; 16]);
        assert_eq!(second.check(CMD_ALLOC_BUFFER, &alloc(6_000), 12), Ok(Verdict::Answer(failed)));
        drop(first);
        assert_eq!(second.device_memory(0, 1 << 40), 10_000);
        assert_eq!(second.check(CMD_ALLOC_BUFFER, &alloc(6_000), 12), Ok(Verdict::Forward));
    }
}
