//! One client's connection as the front sees it: each request's header and payload checked
//! against the handshake, the buffers the client allocated and the memory lent.
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::sync::Lock;

use super::{
    le_u32, le_u64, refuse, request_bytes, Framing, Ledger, Refusal, Tensor, Verdict, CMD_ALLOC_BUFFER,
    CMD_BUFFER_CLEAR, CMD_BUFFER_GET_BASE, CMD_COPY_TENSOR, CMD_COUNT, CMD_DEVICE_COUNT, CMD_FREE_BUFFER,
    CMD_GET_ALIGNMENT, CMD_GET_ALLOC_SIZE, CMD_GET_DEVICE_MEMORY, CMD_GET_MAX_SIZE, CMD_GET_TENSOR, CMD_GRAPH_COMPUTE,
    CMD_GRAPH_RECOMPUTE, CMD_HELLO, CMD_INIT_TENSOR, CMD_MEMSET_TENSOR, CMD_SET_TENSOR, CMD_SET_TENSOR_HASH,
    MAX_GRAPH_ENTRIES, MAX_SRC, SET_TENSOR_HEADER, TENSOR_BYTES,
};

/// A buffer one client allocated: its device and the addresses it spans.
#[derive(Debug, Clone, Copy)]
pub(super) struct Buffer {
    device: u32,
    base: u64,
    pub(super) size: u64,
}

/// One client's connection as the front sees it: the handshake, the devices, the buffers it
/// allocated and the graphs the worker holds for it.
pub struct Session {
    ledger: Arc<Ledger>,
    hello: bool,
    devices: Option<u32>,
    pub(super) buffers: HashMap<u64, Buffer>,
    /// Devices whose last graph passed the checks (and may be computed again).
    graphs: HashSet<u32>,
    /// An allocation forwarded and not yet answered: its device and the bytes reserved.
    pub(super) pending: Option<(u32, u64)>,
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

#[cfg(test)]
mod tests {
    use super::super::craft::{graph_bytes, tensor_bytes};
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
}
