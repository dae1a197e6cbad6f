//! The validating front of `hypura rpc-server`: the worker's port is Hypura's, and ggml's own
//! server only ever sees commands that passed `protocol::Session`'s checks.
//!
//! Each client gets a ggml server of its own, in a child process (`rpc-server
//! --serve-one-client`) that listens on a random loopback address and port the front alone
//! connects to. A graph that ggml fails to compute, or an assert that a check did not foresee,
//! ends that child and closes that client's connection; the front and every other client go
//! on, and no client can reach another's buffers, which live in another process. The front
//! counts every client's allocations against what the worker lends, and reports free memory
//! net of them.
//!
//! A connection is closed, with its reason logged, on the first request that fails a check;
//! the client's buffers are freed with its ggml server.
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::protocol::{self, le_u32, le_u64, Framing, Ledger, Refusal, Session, Verdict};
use super::secure::{Channel, Key, HANDSHAKE_TIMEOUT};

/// Clients served at once; more are closed at once with a logged line.
const MAX_CLIENTS: usize = 32;
/// How long a client's ggml server may take to start listening (a GPU's runtime starts in
/// seconds).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the HELLO may take once connected: ggml's server serves one client at a time, so
/// one that does not answer is serving someone else.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest ggml's server may take to answer one request (as the relay allows a worker).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(600);
/// Bytes copied per read or write of a tensor's bytes.
const CHUNK_BYTES: usize = 1 << 20;

/// How to start a client's ggml server: this program and the arguments that lend the same
/// devices (`--host` and `--port` are added).
#[derive(Debug, Clone)]
pub struct ChildCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// The front's settings.
pub struct Front {
    pub child: ChildCommand,
    pub ledger: Arc<Ledger>,
    pub key: Option<Key>,
    clients: AtomicUsize,
    /// Set by a stop: connections accepted from then on are closed at once.
    stopping: AtomicBool,
}

impl Front {
    pub fn new(child: ChildCommand, ledger: Arc<Ledger>, key: Option<Key>) -> Arc<Front> {
        Arc::new(Front { child, ledger, key, clients: AtomicUsize::new(0), stopping: AtomicBool::new(false) })
    }

    /// Take no more clients; the connected ones go on.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Clients being served now.
    pub fn clients(&self) -> usize {
        self.clients.load(Ordering::SeqCst)
    }
}

/// Serve every connection `listener` accepts, each on a thread of its own, for the life of the
/// process.
pub fn serve(listener: TcpListener, front: Arc<Front>) -> std::io::Result<()> {
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!("RPC front: accepting a connection failed: {error}");
                continue;
            }
        };
        let peer = stream.peer_addr().map_or_else(|_| "an unknown peer".to_string(), |peer| peer.to_string());
        if front.stopping.load(Ordering::SeqCst) {
            tracing::info!(client = %peer, "RPC client closed: the server is stopping");
            continue;
        }
        if front.clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            front.clients.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(client = %peer, "RPC client closed: {MAX_CLIENTS} clients are already served");
            continue;
        }
        let serving = front.clone();
        let client = peer.clone();
        let spawned = std::thread::Builder::new().name("rpc-front".into()).spawn(move || {
            match serve_client(stream, &serving) {
                Ok(()) => tracing::info!(%client, "RPC client disconnected"),
                Err(End::ClientGone) => {
                    tracing::warn!(%client, "RPC client closed: its connection ended in the middle of a request")
                }
                Err(End::Refused(Refusal(why)) | End::Worker(why)) => {
                    tracing::warn!(%client, "RPC client closed: {why}")
                }
            }
            serving.clients.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(error) = spawned {
            front.clients.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(client = %peer, "RPC client closed: no thread for it ({error})");
        }
    }
    Ok(())
}

/// How a connection ended, where it did not end cleanly.
enum End {
    /// The client closed or broke its connection mid-request.
    ClientGone,
    /// A request failed a check.
    Refused(Refusal),
    /// The client's ggml server failed or ended.
    Worker(String),
}

impl From<Refusal> for End {
    fn from(refusal: Refusal) -> End {
        End::Refused(refusal)
    }
}

/// A client's ggml server: its process and the front's connection to it. Dropping it ends both.
/// The process's stdin is a pipe the front holds, and it exits when that closes, so it ends
/// with the front too.
struct Worker {
    process: Child,
    stream: TcpStream,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Worker {
    /// Start a ggml server on a random loopback address and port, and connect to it.
    fn start(command: &ChildCommand) -> Result<Worker, End> {
        let mut last = String::new();
        for _ in 0..3 {
            let address = private_address().map_err(|error| End::Worker(format!("no loopback port: {error}")))?;
            let mut process = Command::new(&command.program)
                .args(&command.args)
                .args(["--host", &address.ip().to_string(), "--port", &address.port().to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .map_err(|error| End::Worker(format!("cannot start a ggml server: {error}")))?;
            let started = Instant::now();
            while started.elapsed() < START_TIMEOUT {
                if let Ok(Some(status)) = process.try_wait() {
                    last = format!("the ggml server exited at start ({status})");
                    break;
                }
                if let Ok(stream) = TcpStream::connect_timeout(&address, Duration::from_secs(1)) {
                    stream.set_nodelay(true).map_err(|error| End::Worker(error.to_string()))?;
                    return Ok(Worker { process, stream });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if last.is_empty() {
                last = "the ggml server did not listen in time".into();
            }
            let _ = process.kill();
            let _ = process.wait();
        }
        Err(End::Worker(last))
    }

    /// What became of the process, for a connection that failed.
    fn failure(&mut self, error: &std::io::Error) -> End {
        std::thread::sleep(Duration::from_millis(50));
        match self.process.try_wait() {
            Ok(Some(status)) => End::Worker(format!("its ggml server ended ({status})")),
            _ => End::Worker(format!("its ggml server's connection failed ({error})")),
        }
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), End> {
        self.stream.write_all(bytes).map_err(|error| self.failure(&error))
    }

    fn receive(&mut self, bytes: &mut [u8]) -> Result<(), End> {
        self.stream.read_exact(bytes).map_err(|error| self.failure(&error))
    }

    /// A request the front makes itself; returns the response's payload.
    fn ask(&mut self, cmd: u8, payload: &[u8], answer: usize) -> Result<Vec<u8>, End> {
        let mut request = vec![cmd];
        request.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        request.extend_from_slice(payload);
        self.send(&request)?;
        let mut response = vec![0u8; 8 + answer];
        self.receive(&mut response)?;
        if le_u64(&response[..8]) != answer as u64 {
            return Err(End::Worker(format!("its ggml server answered command {cmd} with another size")));
        }
        Ok(response.split_off(8))
    }
}

/// A loopback address no one else is told: on Linux a random one of 127.0.0.0/8 (all of it is
/// loopback there) and a free port on it.
fn private_address() -> std::io::Result<SocketAddr> {
    let ip = if cfg!(target_os = "linux") {
        let [a, b, c]: [u8; 3] = rand::random();
        Ipv4Addr::new(127, a.max(1), b, c.clamp(1, 254))
    } else {
        Ipv4Addr::LOCALHOST
    };
    let probe = TcpListener::bind(SocketAddr::new(IpAddr::V4(ip), 0))?;
    probe.local_addr()
}

fn read_client(client: &mut Channel, bytes: &mut [u8]) -> Result<(), End> {
    client.read_exact(bytes).map_err(|_| End::ClientGone)
}

fn write_client(client: &mut Channel, bytes: &[u8]) -> Result<(), End> {
    client.write_all(bytes).map_err(|_| End::ClientGone)
}

/// Serve one connection: the key's handshake, then requests, each checked, until the client
/// closes it (Ok) or something ends it.
fn serve_client(stream: TcpStream, front: &Front) -> Result<(), End> {
    let _ = stream.set_nodelay(true);
    let mut client = Channel::accept(stream, front.key.as_ref())
        .map_err(|error| End::Refused(Refusal(format!("no handshake: {error}"))))?;
    // A client has as long to say HELLO as to complete the key's handshake; after it, a
    // connection may idle as long as its model is loaded.
    client.tcp().set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|error| End::Worker(error.to_string()))?;
    let mut session = Session::new(front.ledger.clone());
    let mut worker: Option<Worker> = None;
    let mut chunk = vec![0u8; CHUNK_BYTES];
    loop {
        let mut header = [0u8; 9];
        match client.read_exact(&mut header) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof && header == [0; 9] => return Ok(()),
            Err(error) if matches!(error.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(End::Refused(Refusal(format!("no HELLO within {} s", HANDSHAKE_TIMEOUT.as_secs()))));
            }
            Err(_) => return Err(End::ClientGone),
        }
        let cmd = header[0];
        let size = le_u64(&header[1..]);
        let framing = session.framing(cmd, size)?;
        let held = match framing {
            Framing::Whole(bytes) => bytes as usize,
            Framing::Header(bytes) => bytes,
        };
        // Held as it arrives: a client that names a large frame and sends little holds
        // little.
        let mut payload = Vec::new();
        (&mut client).take(held as u64).read_to_end(&mut payload).map_err(|_| End::ClientGone)?;
        if payload.len() != held {
            return Err(End::ClientGone);
        }
        match session.check(cmd, &payload, size)? {
            Verdict::Answer(answer) => {
                write_client(&mut client, &answer)?;
                client.flush().map_err(|_| End::ClientGone)?;
                continue;
            }
            Verdict::Forward => {}
        }
        let worker = match worker.as_mut() {
            Some(worker) => worker,
            None => {
                // The HELLO: the client's ggml server starts; no transport upgrade is offered
                // (the front reads every byte).
                let started = worker.insert(Worker::start(&front.child)?);
                started.stream.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(|error| End::Worker(error.to_string()))?;
                let mut hello = started.ask(
                    cmd,
                    &[0; protocol::HELLO_REQUEST_BYTES as usize],
                    protocol::HELLO_RESPONSE_BYTES as usize,
                )?;
                hello[4..].fill(0);
                let count = started.ask(protocol::CMD_DEVICE_COUNT, &[], 4)?;
                session.set_devices(le_u32(&count[..4]));
                started
                    .stream
                    .set_read_timeout(Some(RESPONSE_TIMEOUT))
                    .map_err(|error| End::Worker(error.to_string()))?;
                client.tcp().set_read_timeout(None).map_err(|error| End::Worker(error.to_string()))?;
                write_client(&mut client, &(hello.len() as u64).to_le_bytes())?;
                write_client(&mut client, &hello)?;
                client.flush().map_err(|_| End::ClientGone)?;
                continue;
            }
        };
        worker.send(&header)?;
        worker.send(&payload)?;
        let mut left = size - held as u64;
        while left > 0 {
            let take = left.min(CHUNK_BYTES as u64) as usize;
            read_client(&mut client, &mut chunk[..take])?;
            worker.send(&chunk[..take])?;
            left -= take as u64;
        }
        let Some(expected) = protocol::response_bytes(cmd, &payload) else { continue };
        let mut length = [0u8; 8];
        worker.receive(&mut length)?;
        if u64::from_le_bytes(length) != expected {
            return Err(End::Worker(format!("its ggml server answered command {cmd} with another size")));
        }
        write_client(&mut client, &length)?;
        match cmd {
            protocol::CMD_ALLOC_BUFFER => {
                let mut answer = [0u8; 16];
                worker.receive(&mut answer)?;
                let remote = le_u64(&answer[..8]);
                let bytes = le_u64(&answer[8..]);
                let base = match remote {
                    0 => 0,
                    _ => le_u64(&worker.ask(protocol::CMD_BUFFER_GET_BASE, &remote.to_le_bytes(), 8)?),
                };
                session.allocated(remote, bytes, base);
                write_client(&mut client, &answer)?;
            }
            protocol::CMD_GET_DEVICE_MEMORY => {
                let mut answer = [0u8; 16];
                worker.receive(&mut answer)?;
                let device = le_u32(&payload[..4]);
                let free = le_u64(&answer[..8]);
                answer[..8].copy_from_slice(&session.device_memory(device, free).to_le_bytes());
                write_client(&mut client, &answer)?;
            }
            _ => {
                let mut left = expected;
                while left > 0 {
                    let take = left.min(CHUNK_BYTES as u64) as usize;
                    worker.receive(&mut chunk[..take])?;
                    write_client(&mut client, &chunk[..take])?;
                    left -= take as u64;
                }
            }
        }
        client.flush().map_err(|_| End::ClientGone)?;
    }
}
