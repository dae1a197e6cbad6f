//! The RPC link's key: a worker started with one (`rpc-server --key-file`) serves only clients
//! that prove it, over an encrypted channel, and Hypura's relay (`--rpc-key-file`) proves it.
//!
//! The channel is Noise's `NNpsk0` handshake (X25519, ChaCha20-Poly1305, BLAKE2s) from the snow
//! crate, keyed by 32 random bytes both sides hold: the client's first message is already
//! authenticated by the key, so a worker reads one message from a client without it, finds it
//! does not decrypt, and closes the connection having sent nothing. Every message after the
//! handshake is encrypted and authenticated; a tampered, replayed or reordered one fails to
//! decrypt and ends the connection. A message carries at most 65,535 bytes, framed by a 2-byte
//! length, so a stream is sealed in pieces: writers flush at each request or response boundary.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

const NOISE: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
/// Bound into the handshake, so a key made for another protocol or version does not match.
const PROLOGUE: &[u8] = b"hypura rpc 1 / ggml rpc 7";
/// Noise's largest message, and its authentication tag.
const MESSAGE_BYTES: usize = 65535;
const TAG_BYTES: usize = 16;
/// How long a client may take to complete the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The environment variable that may hold the key instead of a file.
pub const KEY_VARIABLE: &str = "HYPURA_RPC_KEY";

/// A link key: 32 bytes, written as 64 hexadecimal digits (`openssl rand -hex 32`).
#[derive(Clone)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Key(..)")
    }
}

impl Key {
    /// Parse 64 hexadecimal digits (surrounding whitespace ignored); `source` names where they
    /// came from in the error.
    pub fn parse(text: &str, source: &str) -> Result<Key, String> {
        let digits = text.trim();
        let bad = || {
            format!("{source} must hold an RPC key: 32 random bytes as 64 hexadecimal digits (make one with `openssl rand -hex 32`)")
        };
        if digits.len() != 64 || !digits.is_ascii() {
            return Err(bad());
        }
        let mut key = [0u8; 32];
        for (byte, pair) in key.iter_mut().zip(digits.as_bytes().chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
        }
        Ok(Key(key))
    }

    /// The key from `file`, else from `HYPURA_RPC_KEY`; None where neither is given.
    pub fn from_file_or_environment(file: Option<&Path>) -> Result<Option<Key>, String> {
        if let Some(file) = file {
            let text = std::fs::read_to_string(file)
                .map_err(|error| format!("cannot read the RPC key file {}: {error}", file.display()))?;
            return Key::parse(&text, &format!("the RPC key file {}", file.display())).map(Some);
        }
        match std::env::var(KEY_VARIABLE) {
            Ok(text) if !text.trim().is_empty() => Key::parse(&text, KEY_VARIABLE).map(Some),
            _ => Ok(None),
        }
    }

    fn builder(&self) -> snow::Builder<'_> {
        let params = NOISE.parse().expect("a valid Noise pattern");
        snow::Builder::new(params)
            .prologue(PROLOGUE)
            .and_then(|builder| builder.psk(0, &self.0))
            .expect("a prologue and one pre-shared key")
    }
}

/// The key this process's relays prove to workers (`--rpc-key-file`), set once at startup.
static CLIENT_KEY: OnceLock<Option<Key>> = OnceLock::new();

/// Set the key relays use; a later call changes nothing (one key per process).
pub fn use_client_key(key: Option<Key>) {
    let _ = CLIENT_KEY.set(key);
}

pub fn client_key() -> Option<&'static Key> {
    CLIENT_KEY.get().and_then(Option::as_ref)
}

/// A connection to or from a worker: plain TCP, or sealed by a key.
pub enum Channel {
    Plain(TcpStream),
    Sealed(Box<Sealed>),
}

pub struct Sealed {
    stream: TcpStream,
    transport: snow::TransportState,
    /// Decrypted bytes not yet read, from `inbox_at`.
    inbox: Vec<u8>,
    inbox_at: usize,
    /// Bytes written and not yet sealed.
    outbox: Vec<u8>,
    message: Vec<u8>,
}

fn noise_error(error: snow::Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("the RPC link's encryption: {error}"))
}

fn send_message(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<()> {
    let length = u16::try_from(message.len()).expect("a Noise message fits 16 bits");
    let mut frame = Vec::with_capacity(2 + message.len());
    frame.extend_from_slice(&length.to_be_bytes());
    frame.extend_from_slice(message);
    stream.write_all(&frame)
}

fn receive_message(stream: &mut TcpStream, message: &mut Vec<u8>) -> std::io::Result<()> {
    let mut length = [0u8; 2];
    stream.read_exact(&mut length)?;
    message.resize(usize::from(u16::from_be_bytes(length)), 0);
    stream.read_exact(message)
}

impl Channel {
    /// The client's side: plain, or the handshake with `key`.
    pub fn connect(mut stream: TcpStream, key: Option<&Key>) -> std::io::Result<Channel> {
        let Some(key) = key else { return Ok(Channel::Plain(stream)) };
        let mut handshake = key.builder().build_initiator().map_err(noise_error)?;
        let mut message = vec![0u8; MESSAGE_BYTES];
        let written = handshake.write_message(&[], &mut message).map_err(noise_error)?;
        send_message(&mut stream, &message[..written])?;
        let mut reply = Vec::new();
        receive_message(&mut stream, &mut reply)
            .map_err(|error| std::io::Error::new(error.kind(), format!("the worker refused the key ({error})")))?;
        handshake.read_message(&reply, &mut message).map_err(noise_error)?;
        Channel::sealed(stream, handshake)
    }

    /// The worker's side: plain, or the handshake with `key`, in which the client's first
    /// message must prove the key before anything is sent.
    pub fn accept(mut stream: TcpStream, key: Option<&Key>) -> std::io::Result<Channel> {
        let Some(key) = key else { return Ok(Channel::Plain(stream)) };
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let mut handshake = key.builder().build_responder().map_err(noise_error)?;
        let mut first = Vec::new();
        receive_message(&mut stream, &mut first)?;
        let mut payload = vec![0u8; MESSAGE_BYTES];
        handshake.read_message(&first, &mut payload).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, "the client does not hold the key")
        })?;
        let written = handshake.write_message(&[], &mut payload).map_err(noise_error)?;
        send_message(&mut stream, &payload[..written])?;
        stream.set_read_timeout(None)?;
        Channel::sealed(stream, handshake)
    }

    fn sealed(stream: TcpStream, handshake: snow::HandshakeState) -> std::io::Result<Channel> {
        let transport = handshake.into_transport_mode().map_err(noise_error)?;
        Ok(Channel::Sealed(Box::new(Sealed {
            stream,
            transport,
            inbox: Vec::new(),
            inbox_at: 0,
            outbox: Vec::with_capacity(MESSAGE_BYTES),
            message: vec![0u8; MESSAGE_BYTES],
        })))
    }

    pub fn tcp(&self) -> &TcpStream {
        match self {
            Channel::Plain(stream) => stream,
            Channel::Sealed(sealed) => &sealed.stream,
        }
    }
}

impl Sealed {
    fn seal(&mut self) -> std::io::Result<()> {
        if self.outbox.is_empty() {
            return Ok(());
        }
        let written = self.transport.write_message(&self.outbox, &mut self.message).map_err(noise_error)?;
        self.outbox.clear();
        send_message(&mut self.stream, &self.message[..written])
    }
}

impl Read for Channel {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let sealed = match self {
            Channel::Plain(stream) => return stream.read(buf),
            Channel::Sealed(sealed) => sealed,
        };
        while sealed.inbox_at == sealed.inbox.len() {
            let mut message = std::mem::take(&mut sealed.inbox);
            match receive_message(&mut sealed.stream, &mut message) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(error) => return Err(error),
            }
            let mut plain = vec![0u8; message.len()];
            let read = sealed.transport.read_message(&message, &mut plain).map_err(noise_error)?;
            plain.truncate(read);
            sealed.inbox = plain;
            sealed.inbox_at = 0;
        }
        let take = buf.len().min(sealed.inbox.len() - sealed.inbox_at);
        buf[..take].copy_from_slice(&sealed.inbox[sealed.inbox_at..sealed.inbox_at + take]);
        sealed.inbox_at += take;
        Ok(take)
    }
}

impl Write for Channel {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let sealed = match self {
            Channel::Plain(stream) => return stream.write(buf),
            Channel::Sealed(sealed) => sealed,
        };
        let room = MESSAGE_BYTES - TAG_BYTES - sealed.outbox.len();
        let take = buf.len().min(room);
        sealed.outbox.extend_from_slice(&buf[..take]);
        if sealed.outbox.len() == MESSAGE_BYTES - TAG_BYTES {
            sealed.seal()?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Channel::Plain(stream) => stream.flush(),
            Channel::Sealed(sealed) => {
                sealed.seal()?;
                sealed.stream.flush()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const OTHER: &str = "ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn pair(
        client_key: Option<&str>,
        worker_key: Option<&str>,
    ) -> (std::io::Result<Channel>, std::io::Result<Channel>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let worker_key = worker_key.map(|text| Key::parse(text, "test").unwrap());
        let worker = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            Channel::accept(stream, worker_key.as_ref())
        });
        let client_key = client_key.map(|text| Key::parse(text, "test").unwrap());
        let client = Channel::connect(TcpStream::connect(address).unwrap(), client_key.as_ref());
        (client, worker.join().unwrap())
    }

    #[test]
    fn a_sealed_channel_carries_large_frames_both_ways() {
        let (client, worker) = pair(Some(KEY), Some(KEY));
        let (mut client, mut worker) = (client.unwrap(), worker.unwrap());
        let frame: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let echo = std::thread::spawn(move || {
            let mut got = vec![0u8; 300_000];
            worker.read_exact(&mut got).unwrap();
            worker.write_all(&got[..1000]).unwrap();
            worker.flush().unwrap();
            got
        });
        client.write_all(&frame).unwrap();
        client.flush().unwrap();
        let mut back = vec![0u8; 1000];
        client.read_exact(&mut back).unwrap();
        assert_eq!(echo.join().unwrap(), frame);
        assert_eq!(back, frame[..1000]);
    }

    #[test]
    fn a_client_without_the_key_gets_nothing() {
        let (client, worker) = pair(Some(OTHER), Some(KEY));
        assert_eq!(worker.err().unwrap().kind(), std::io::ErrorKind::PermissionDenied);
        assert!(client.err().unwrap().to_string().contains("refused the key"));
        // A plain client (ggml's HELLO) is not answered either.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let worker = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            Channel::accept(stream, Some(&Key::parse(KEY, "test").unwrap())).err().unwrap()
        });
        let mut plain = TcpStream::connect(address).unwrap();
        let mut hello = vec![14u8];
        hello.extend_from_slice(&24u64.to_le_bytes());
        hello.extend_from_slice(&[0u8; 24]);
        plain.write_all(&hello).unwrap();
        plain.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        plain.read_to_end(&mut answer).unwrap();
        assert!(answer.is_empty(), "a plain client got {} bytes", answer.len());
        worker.join().unwrap();
    }

    #[test]
    fn keys_are_64_hex_digits() {
        assert!(Key::parse(&format!(" {KEY}\n"), "test").is_ok());
        for bad in ["", "00", &KEY[..63], &format!("{}zz", &KEY[..62]), &format!("{KEY}00")] {
            let error = Key::parse(bad, "the RPC key file k").unwrap_err();
            assert!(error.contains("openssl rand -hex 32"), "{error}");
        }
    }
}
