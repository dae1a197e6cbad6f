//! The front's checks over a raw byte stream, against a worker that allocates what it is asked
//! for: what the fuzz target drives, and what replays the inputs it kept.
use super::{le_u64, Framing, Ledger, Refusal, Session, CMD_ALLOC_BUFFER, CMD_HELLO};

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

#[cfg(test)]
mod tests {
    use super::super::craft::{graph_bytes, tensor_bytes};
    use super::super::*;
    use super::*;

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
}
