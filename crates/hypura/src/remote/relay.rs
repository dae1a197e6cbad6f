//! The relay between ggml's RPC client and one worker: a loopback listener that ggml connects
//! to instead of the worker, forwarding each request frame and its response.
//!
//! It exists because ggml's RPC client aborts the whole process when a connection fails
//! (`RPC_STATUS_ASSERT` in its dispatcher thread). The relay never fails: when the worker stops
//! answering, it records why (sticky), and from then on answers every request that expects a
//! response with a well-formed one of zeros, so the client carries on, a model that uses the
//! worker can be freed, and the engine, which checks the relay after every decode, fails the
//! request with the worker's name instead of returning tokens computed on zeros. Every frame
//! also passes a counter (bytes each way, round trips), and an emulated link delay can hold each
//! response back by a round trip, for benchmarks where no real link is at hand.
//!
//! One more thing the relay does: a graph the client sends again byte for byte (ggml's client
//! sends every split graph whole while an eval callback is set, which Hypura's streaming always
//! sets) goes to the worker as ggml's own "compute the last graph again" command, which the
//! worker runs on the graph it already holds. Identical bytes are the same graph, so the result
//! is the same; a decoded token then costs the link a few kilobytes instead of a megabyte.
//!
//! The framing is ggml's (protocol 7): a request is `cmd: u8 | size: u64 | payload`, a response
//! `size: u64 | payload`; which commands have a response, and how long it is, is read from
//! `ggml-rpc.cpp`'s server loop.
use crate::sync::Lock;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::protocol::{
    le_u32, le_u64, response_bytes, CMD_COUNT, CMD_FREE_BUFFER, CMD_GRAPH_COMPUTE, CMD_GRAPH_RECOMPUTE, CMD_HELLO,
    HELLO_RESPONSE_BYTES,
};
use super::secure::{client_key, Channel};
/// Bytes copied per read or write of a large payload (a tensor's bytes at load).
const CHUNK_BYTES: usize = 1 << 20;
/// How long connecting to a worker may take before it counts as down.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a worker may take to answer one request (a prompt batch of a large layer range
/// on a slow CPU takes seconds, not minutes), and its link's keepalive probes.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(600);
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// Whether a command's payload is worth holding to parse (everything but a tensor's bytes).
fn holds_payload(cmd: u8) -> bool {
    // RPC_CMD_SET_TENSOR carries tensor bytes; the rest are small structures or graphs.
    cmd != 6
}

/// What a relay has seen: bytes each way, round trips, and the failure that ended it.
#[derive(Debug, Default)]
pub(crate) struct RelayState {
    pub worker: String,
    pub sent_bytes: AtomicU64,
    pub received_bytes: AtomicU64,
    pub round_trips: AtomicU64,
    /// Graph bytes not sent because the worker already held the graph.
    pub graph_bytes_saved: AtomicU64,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    /// Added before each response reaches the client (an emulated link's round trip).
    pub delay: Duration,
}

impl RelayState {
    /// Why the worker stopped answering, once it has.
    pub fn failure(&self) -> Option<String> {
        if !self.failed.load(Ordering::SeqCst) {
            return None;
        }
        self.failure.locked().clone()
    }

    fn fail(&self, why: String) {
        let mut failure = self.failure.locked();
        if failure.is_none() {
            tracing::warn!(worker = %self.worker, "RPC worker stopped answering: {why}");
            *failure = Some(why);
        }
        self.failed.store(true, Ordering::SeqCst);
    }
}

/// A running relay: ggml connects to `endpoint` (loopback), the relay to the worker.
pub(crate) struct Relay {
    pub endpoint: String,
    pub state: Arc<RelayState>,
}

impl Relay {
    /// Listen on an ephemeral loopback port and relay each connection to `worker`. The
    /// listener's thread lives as long as the process (ggml keeps the devices it made for the
    /// endpoint, and their buffers may still be freed through it).
    pub fn start(worker: &str, delay: Duration) -> std::io::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let endpoint = listener.local_addr()?.to_string();
        let state = Arc::new(RelayState { worker: worker.to_string(), delay, ..RelayState::default() });
        let accepting = state.clone();
        std::thread::Builder::new().name(format!("rpc-relay {worker}")).spawn(move || {
            for client in listener.incoming().flatten() {
                let state = accepting.clone();
                let _ = std::thread::Builder::new()
                    .name("rpc-relay-conn".into())
                    .spawn(move || relay_connection(client, &state));
            }
        })?;
        Ok(Relay { endpoint, state })
    }
}

/// Connect to a worker's `host:port`, within `CONNECT_TIMEOUT` for each address it resolves to,
/// and prove this process's key where it has one (`--rpc-key-file`).
pub(crate) fn connect_worker(worker: &str) -> std::io::Result<Channel> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, format!("{worker} resolves to no address"));
    let addresses: Vec<SocketAddr> = worker.to_socket_addrs()?.collect();
    for address in addresses {
        match TcpStream::connect_timeout(&address, CONNECT_TIMEOUT) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                // A worker that goes quiet without closing (a partition, a frozen host) is found
                // by keepalive probes; one that answers nothing at all for a long time fails too.
                let keepalive =
                    socket2::TcpKeepalive::new().with_time(KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL);
                socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive)?;
                stream.set_read_timeout(Some(RESPONSE_TIMEOUT))?;
                return Channel::connect(stream, client_key());
            }
            Err(error) => last = error,
        }
    }
    Err(last)
}

/// Serve one client connection until the client closes it.
fn relay_connection(mut client: TcpStream, state: &RelayState) {
    let _ = client.set_nodelay(true);
    let mut worker = match state.failure() {
        Some(_) => None,
        None => match connect_worker(&state.worker) {
            Ok(stream) => Some(stream),
            Err(error) => {
                state.fail(format!("cannot connect: {error}"));
                None
            }
        },
    };
    let mut chunk = vec![0u8; CHUNK_BYTES];
    // The last graph forwarded for each of the worker's devices.
    let mut last_graphs: std::collections::HashMap<u32, Vec<u8>> = std::collections::HashMap::new();
    loop {
        let mut header = [0u8; 9];
        if client.read_exact(&mut header).is_err() {
            break;
        }
        let cmd = header[0];
        let size = le_u64(&header[1..]);
        if cmd >= CMD_COUNT {
            break;
        }
        // The request: held whole where it is small, streamed through otherwise.
        let mut payload = Vec::new();
        if holds_payload(cmd) {
            payload.resize(size as usize, 0);
            if client.read_exact(&mut payload).is_err() {
                break;
            }
        }
        let (mut header, mut payload) = (header, payload);
        // The worker drops every graph it holds when a buffer is freed (their nodes may point
        // into it): so does the relay, so it never asks for a graph the worker no longer has.
        if cmd == CMD_FREE_BUFFER {
            last_graphs.clear();
        }
        if cmd == CMD_GRAPH_COMPUTE && payload.len() >= 4 {
            let device = le_u32(&payload[..4]);
            if last_graphs.get(&device) == Some(&payload) {
                state.graph_bytes_saved.fetch_add(payload.len() as u64, Ordering::Relaxed);
                payload.truncate(4);
                header = recompute_header();
            } else {
                last_graphs.insert(device, payload.clone());
            }
        }
        let size = if holds_payload(cmd) { payload.len() as u64 } else { size };
        if let Some(stream) = worker.as_mut() {
            let forwarded = forward_request(stream, &mut client, &header, &payload, size, &mut chunk, state);
            match forwarded {
                Ok(()) => {}
                Err(Side::Client) => break,
                Err(Side::Worker(error)) => {
                    state.fail(format!("the connection broke: {error}"));
                    worker = None;
                }
            }
        } else if !holds_payload(cmd) && drain(&mut client, size, &mut chunk).is_err() {
            break;
        }
        let Some(expected) = response_bytes(cmd, &payload) else { continue };
        if !state.delay.is_zero() {
            std::thread::sleep(state.delay);
        }
        state.round_trips.fetch_add(1, Ordering::Relaxed);
        let answered = match worker.as_mut() {
            Some(stream) => forward_response(stream, &mut client, expected, &mut chunk, state),
            None => Ok(0),
        };
        let sent = match answered {
            Ok(sent) => sent,
            Err(Side::Client) => break,
            Err(Side::Worker((error, sent))) => {
                state.fail(format!("the connection broke: {error}"));
                worker = None;
                sent
            }
        };
        // A worker that stopped answering: the rest of the response, as zeros (a HELLO as
        // this build's protocol version, so a late connection still completes its handshake).
        if worker.is_none() && fabricate(&mut client, cmd, expected, sent).is_err() {
            break;
        }
    }
    if let Some(stream) = worker {
        let _ = stream.tcp().shutdown(Shutdown::Both);
    }
}

/// The header of `GRAPH_RECOMPUTE` (its payload is the device's 4 bytes).
fn recompute_header() -> [u8; 9] {
    let mut header = [0u8; 9];
    header[0] = CMD_GRAPH_RECOMPUTE;
    header[1..].copy_from_slice(&4u64.to_le_bytes());
    header
}

/// Which side of a relayed exchange failed.
enum Side<E> {
    Client,
    Worker(E),
}

fn forward_request(
    worker: &mut Channel,
    client: &mut TcpStream,
    header: &[u8; 9],
    payload: &[u8],
    size: u64,
    chunk: &mut [u8],
    state: &RelayState,
) -> Result<(), Side<std::io::Error>> {
    let mut failed = worker.write_all(header).err();
    if holds_payload(header[0]) {
        failed = failed.or_else(|| worker.write_all(payload).err());
    } else {
        // Past a failed write the rest of the payload is still read, so the next frame starts
        // where the client's next request does.
        let mut left = size;
        while left > 0 {
            let take = left.min(chunk.len() as u64) as usize;
            client.read_exact(&mut chunk[..take]).map_err(|_| Side::Client)?;
            if failed.is_none() {
                failed = worker.write_all(&chunk[..take]).err();
            }
            left -= take as u64;
        }
    }
    // A sealed link sends what it holds at the request's end.
    failed = failed.or_else(|| worker.flush().err());
    match failed {
        Some(error) => Err(Side::Worker(error)),
        None => {
            state.sent_bytes.fetch_add(9 + size, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// Forward a response of `expected` payload bytes; returns how many bytes of the whole frame
/// (size and payload) reached the client, with the error where the worker failed.
fn forward_response(
    worker: &mut Channel,
    client: &mut TcpStream,
    expected: u64,
    chunk: &mut [u8],
    state: &RelayState,
) -> Result<u64, Side<(String, u64)>> {
    let mut size = [0u8; 8];
    worker.read_exact(&mut size).map_err(|error| Side::Worker((error.to_string(), 0)))?;
    if u64::from_le_bytes(size) != expected {
        return Err(Side::Worker((
            format!("a response of {} bytes where {expected} were due", u64::from_le_bytes(size)),
            0,
        )));
    }
    client.write_all(&size).map_err(|_| Side::Client)?;
    let mut sent = 8u64;
    let mut left = expected;
    while left > 0 {
        let take = left.min(chunk.len() as u64) as usize;
        let read = worker.read(&mut chunk[..take]).map_err(|error| Side::Worker((error.to_string(), sent)))?;
        if read == 0 {
            return Err(Side::Worker(("the worker closed the connection".into(), sent)));
        }
        client.write_all(&chunk[..read]).map_err(|_| Side::Client)?;
        sent += read as u64;
        left -= read as u64;
    }
    state.received_bytes.fetch_add(sent, Ordering::Relaxed);
    Ok(sent)
}

/// The part of a response frame the client has not had (`sent` bytes of it have gone): zeros,
/// but where ggml's client would trip on a zero (an assert, a division), a harmless value.
fn fabricate(client: &mut TcpStream, cmd: u8, expected: u64, sent: u64) -> std::io::Result<()> {
    let mut frame = expected.to_le_bytes().to_vec();
    match cmd {
        CMD_HELLO => {
            let mut hello = vec![0u8; HELLO_RESPONSE_BYTES as usize];
            hello[0] = hypura_sys::RPC_PROTOCOL_MAJOR;
            frame.extend_from_slice(&hello);
        }
        // GET_ALIGNMENT (a divisor), GET_MAX_SIZE, BUFFER_GET_BASE (asserted non-null).
        1 => frame.extend_from_slice(&32u64.to_le_bytes()),
        2 => frame.extend_from_slice(&u64::MAX.to_le_bytes()),
        3 => frame.extend_from_slice(&0x1000u64.to_le_bytes()),
        _ => {}
    }
    let total = 8 + expected;
    let mut position = sent;
    if position < frame.len() as u64 {
        client.write_all(&frame[position as usize..])?;
        position = frame.len() as u64;
    }
    let zeros = vec![0u8; CHUNK_BYTES];
    while position < total {
        let take = (total - position).min(CHUNK_BYTES as u64) as usize;
        client.write_all(&zeros[..take])?;
        position += take as u64;
    }
    Ok(())
}

/// Read and drop `size` bytes of a request that cannot be forwarded.
fn drain(client: &mut TcpStream, size: u64, chunk: &mut [u8]) -> std::io::Result<()> {
    let mut left = size;
    while left > 0 {
        let take = left.min(chunk.len() as u64) as usize;
        client.read_exact(&mut chunk[..take])?;
        left -= take as u64;
    }
    Ok(())
}

/// A HELLO request that offers no transport upgrade (TCP only).
fn hello_request() -> Vec<u8> {
    let mut hello = vec![CMD_HELLO];
    hello.extend_from_slice(&24u64.to_le_bytes());
    hello.extend_from_slice(&[0u8; 24]);
    hello
}

/// Ask a worker directly (not through a relay) for its protocol version and device count:
/// HELLO, then DEVICE_COUNT `pings` times. Returns the major version, the device count and the
/// round trips' times. ggml's server takes one client at a time, so this waits while another
/// client holds the worker.
pub(crate) fn probe(worker: &str, pings: usize) -> std::io::Result<(u8, u32, Vec<Duration>)> {
    let mut stream = connect_worker(worker)?;
    stream.tcp().set_read_timeout(Some(Duration::from_secs(30)))?;
    stream.write_all(&hello_request())?;
    stream.flush()?;
    let mut response = [0u8; 8 + HELLO_RESPONSE_BYTES as usize];
    stream.read_exact(&mut response)?;
    let major = response[8];
    let mut count = 0u32;
    let mut times = Vec::with_capacity(pings);
    for _ in 0..pings.max(1) {
        let started = std::time::Instant::now();
        let mut request = vec![15u8];
        request.extend_from_slice(&0u64.to_le_bytes());
        stream.write_all(&request)?;
        stream.flush()?;
        let mut answer = [0u8; 12];
        stream.read_exact(&mut answer)?;
        times.push(started.elapsed());
        count = le_u32(&answer[8..]);
    }
    let _ = stream.tcp().shutdown(Shutdown::Both);
    Ok((major, count, times))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_sized_as_the_server_sends_them() {
        assert_eq!(response_bytes(CMD_HELLO, &[0; 24]), Some(28));
        assert_eq!(response_bytes(15, &[]), Some(4));
        assert_eq!(response_bytes(0, &[0; 12]), Some(16));
        let mut get_tensor = vec![0u8; 300];
        get_tensor.extend_from_slice(&7u64.to_le_bytes());
        get_tensor.extend_from_slice(&4096u64.to_le_bytes());
        assert_eq!(response_bytes(8, &get_tensor), Some(4096));
        for silent in [4u8, 5, 6, 10, 12, 16, 17] {
            assert_eq!(response_bytes(silent, &[]), None, "command {silent}");
        }
    }

    /// A relay whose worker is gone answers as the worker would have, with zeros, and says why.
    #[test]
    fn a_dead_worker_is_answered_for_and_reported() {
        // A worker that takes the connection, answers HELLO, then dies.
        let worker = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = worker.local_addr().unwrap().to_string();
        let dying = std::thread::spawn(move || {
            let (mut stream, _) = worker.accept().unwrap();
            let mut request = [0u8; 9 + 24];
            stream.read_exact(&mut request).unwrap();
            let mut hello = 28u64.to_le_bytes().to_vec();
            hello.extend_from_slice(&[7, 0, 0, 0]);
            hello.extend_from_slice(&[0; 24]);
            stream.write_all(&hello).unwrap();
        });
        let relay = Relay::start(&address, Duration::ZERO).unwrap();
        let mut client = TcpStream::connect(&relay.endpoint).unwrap();
        client.write_all(&hello_request()).unwrap();
        let mut response = [0u8; 36];
        client.read_exact(&mut response).unwrap();
        assert_eq!(response[8], 7);
        dying.join().unwrap();
        assert!(relay.state.failure().is_none());
        // GET_DEVICE_MEMORY after the worker is gone: 16 bytes of zeros, and a failure.
        let mut request = vec![11u8];
        request.extend_from_slice(&4u64.to_le_bytes());
        request.extend_from_slice(&0u32.to_le_bytes());
        client.write_all(&request).unwrap();
        let mut answer = [0xffu8; 24];
        client.read_exact(&mut answer).unwrap();
        assert_eq!(u64::from_le_bytes(answer[..8].try_into().unwrap()), 16);
        assert!(answer[8..].iter().all(|&byte| byte == 0));
        let failure = relay.state.failure().expect("the worker's failure is recorded");
        assert!(failure.contains("broke") || failure.contains("closed"), "{failure}");
        // Requests without a response are taken and dropped; the connection stays usable.
        let mut free = vec![4u8];
        free.extend_from_slice(&8u64.to_le_bytes());
        free.extend_from_slice(&[0u8; 8]);
        client.write_all(&free).unwrap();
        let mut count = vec![15u8];
        count.extend_from_slice(&0u64.to_le_bytes());
        client.write_all(&count).unwrap();
        let mut answer = [0xffu8; 12];
        client.read_exact(&mut answer).unwrap();
        assert_eq!(u64::from_le_bytes(answer[..8].try_into().unwrap()), 4);
        // Where a zero would trip ggml's client: an alignment it can divide by, a non-null base.
        for (cmd, value) in [(1u8, 32u64), (3, 0x1000)] {
            let mut request = vec![cmd];
            request.extend_from_slice(&8u64.to_le_bytes());
            request.extend_from_slice(&[0u8; 8]);
            client.write_all(&request).unwrap();
            let mut answer = [0u8; 16];
            client.read_exact(&mut answer).unwrap();
            assert_eq!(u64::from_le_bytes(answer[8..].try_into().unwrap()), value, "command {cmd}");
        }
    }

    /// A graph sent again byte for byte reaches the worker as "compute the last graph again";
    /// any other graph goes whole.
    #[test]
    fn a_repeated_graph_is_recomputed_not_sent() {
        let worker = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = worker.local_addr().unwrap().to_string();
        let seen = std::thread::spawn(move || {
            let (mut stream, _) = worker.accept().unwrap();
            let mut commands = Vec::new();
            for _ in 0..6 {
                let mut header = [0u8; 9];
                stream.read_exact(&mut header).unwrap();
                let mut payload = vec![0u8; u64::from_le_bytes(header[1..].try_into().unwrap()) as usize];
                stream.read_exact(&mut payload).unwrap();
                commands.push((header[0], payload));
            }
            commands
        });
        let relay = Relay::start(&address, Duration::ZERO).unwrap();
        let mut client = TcpStream::connect(&relay.endpoint).unwrap();
        let graph = |device: u32, fill: u8| {
            let mut payload = device.to_le_bytes().to_vec();
            payload.extend_from_slice(&[fill; 100]);
            let mut frame = vec![CMD_GRAPH_COMPUTE];
            frame.extend_from_slice(&(payload.len() as u64).to_le_bytes());
            frame.extend_from_slice(&payload);
            frame
        };
        // A freed buffer drops the worker's graphs: the same graph after it goes whole.
        let mut free = vec![CMD_FREE_BUFFER];
        free.extend_from_slice(&8u64.to_le_bytes());
        free.extend_from_slice(&[0u8; 8]);
        for frame in [graph(0, 1), graph(0, 1), graph(1, 1), graph(0, 2), free, graph(0, 2)] {
            client.write_all(&frame).unwrap();
        }
        let commands = seen.join().unwrap();
        let kinds: Vec<u8> = commands.iter().map(|(cmd, _)| *cmd).collect();
        assert_eq!(
            kinds,
            vec![
                CMD_GRAPH_COMPUTE,
                CMD_GRAPH_RECOMPUTE,
                CMD_GRAPH_COMPUTE,
                CMD_GRAPH_COMPUTE,
                CMD_FREE_BUFFER,
                CMD_GRAPH_COMPUTE
            ]
        );
        assert_eq!(commands[1].1, 0u32.to_le_bytes().to_vec(), "the device to recompute");
        assert_eq!(commands[3].1[4], 2);
        assert_eq!(relay.state.graph_bytes_saved.load(Ordering::Relaxed), 104);
    }

    #[test]
    fn a_worker_that_is_down_fails_the_relay_at_once() {
        // A port nobody listens on.
        let address = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let relay = Relay::start(&address, Duration::ZERO).unwrap();
        let mut client = TcpStream::connect(&relay.endpoint).unwrap();
        client.write_all(&hello_request()).unwrap();
        let mut response = [0u8; 36];
        client.read_exact(&mut response).unwrap();
        assert_eq!(response[8], hypura_sys::RPC_PROTOCOL_MAJOR, "a handshake ggml accepts");
        assert!(relay.state.failure().unwrap().contains("cannot connect"));
        assert!(probe(&address, 1).is_err());
    }
}
