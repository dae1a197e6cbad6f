//! Requests as ggml's client writes them, for the front's tests (a client that misbehaves on
//! purpose).
use super::TENSOR_BYTES;

/// An `rpc_tensor` as ggml's client serializes it: f32, contiguous.
pub fn tensor_bytes(id: u64, buffer: u64, ne: [u32; 4], op: u32, src: &[u64], view: (u64, u64), data: u64) -> Vec<u8> {
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
