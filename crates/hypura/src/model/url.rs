//! A model's index read over HTTP(S) before any download: `hypura inspect URL` plans a GGUF from
//! its header alone, fetched with range requests (`Range: bytes=A-B`), so only the index's bytes
//! cross the network, never the tensor data. Split models are read the same way, each split's
//! index from the URL next to the first's; `hf://ORG/REPO/FILE.gguf` is Hugging Face's address
//! of a file on its main branch.
//!
//! A server that ignores ranges (it answers 200 with the whole file) is refused before its body
//! is read; a connection that drops, a body shorter than its range, or an index cut short are
//! errors naming the URL.
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hypura_gguf::{Gguf, GgufError, ModelFiles};

/// The first range asked for; each next one is twice the last, up to `MAX_CHUNK` (a large
/// vocabulary makes an index of several MiB).
const FIRST_CHUNK: u64 = 1 << 20;
const MAX_CHUNK: u64 = 16 << 20;
/// The most of one file read for its index: a real index is tens of MiB at most (a 256K-token
/// vocabulary), so a server that keeps a reader going past this is not serving a model's index.
const MAX_INDEX_BYTES: u64 = 512 << 20;

/// What reading the index over the network cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Fetched {
    pub bytes: u64,
    pub requests: u32,
    /// The indexes' own size (each file's bytes before its tensor data): what was needed.
    pub index_bytes: u64,
}

/// Whether `model` names a file on a server rather than on this machine.
pub fn is_url(model: &str) -> bool {
    ["http://", "https://", "hf://"].iter().any(|scheme| model.starts_with(scheme))
}

/// The HTTP(S) address of `model`: itself, or for `hf://ORG/REPO/FILE` the file on the
/// repository's main branch, on the hub `HF_ENDPOINT` names (a mirror), else huggingface.co.
pub fn resolve(model: &str) -> Result<String, GgufError> {
    let Some(rest) = model.strip_prefix("hf://") else { return Ok(model.to_string()) };
    let mut parts = rest.splitn(3, '/');
    let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|endpoint| !endpoint.trim().is_empty());
    let endpoint = endpoint.as_deref().unwrap_or("https://huggingface.co").trim().trim_end_matches('/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(org), Some(repo), Some(file)) if !org.is_empty() && !repo.is_empty() && !file.is_empty() => {
            Ok(format!("{endpoint}/{org}/{repo}/resolve/main/{file}"))
        }
        _ => Err(io_error(model, "an hf:// address is hf://ORG/REPO/FILE.gguf".into())),
    }
}

/// The index of the model at `url` (and of its splits), and what fetching it cost.
pub fn open(url: &str) -> Result<(ModelFiles, Fetched), GgufError> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(120)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut fetched = Fetched::default();
    let files = ModelFiles::open_with(Path::new(url), |name| {
        let Some(name) = name.to_str() else { return Ok(None) };
        let Some(mut reader) = RangeReader::open(&agent, name)? else { return Ok(None) };
        let total = reader.total;
        let parsed = Gguf::parse_named(&mut reader, total, Path::new(name));
        fetched.bytes += reader.fetched.bytes;
        fetched.requests += reader.fetched.requests;
        fetched.index_bytes += parsed.as_ref().map_or(0, |gguf| gguf.data_offset);
        parsed.map(Some)
    })?;
    Ok((files, fetched))
}

fn io_error(url: &str, message: String) -> GgufError {
    GgufError::Io { path: PathBuf::from(url), source: std::io::Error::other(message) }
}

/// A file on a server read front to back through range requests of growing size.
struct RangeReader<'a> {
    agent: &'a ureq::Agent,
    url: &'a str,
    total: u64,
    /// File offset of `buffer[0]`.
    start: u64,
    buffer: Vec<u8>,
    /// Bytes of `buffer` already read.
    consumed: usize,
    chunk: u64,
    fetched: Fetched,
}

impl<'a> RangeReader<'a> {
    /// The reader, after fetching the file's first range; None when the server has no such file
    /// (404).
    fn open(agent: &'a ureq::Agent, url: &'a str) -> Result<Option<RangeReader<'a>>, GgufError> {
        let mut reader = RangeReader {
            agent,
            url,
            total: u64::MAX,
            start: 0,
            buffer: Vec::new(),
            consumed: 0,
            chunk: FIRST_CHUNK,
            fetched: Fetched::default(),
        };
        match reader.fetch(0) {
            Ok(true) => Ok(Some(reader)),
            Ok(false) => Ok(None),
            Err(message) => Err(io_error(url, message)),
        }
    }

    /// Fetch the range from `from`; false for a 404.
    fn fetch(&mut self, from: u64) -> Result<bool, String> {
        if from >= MAX_INDEX_BYTES {
            return Err(format!(
                "the index goes on past {} MiB, more than any model's index; this is not a GGUF Hypura plans from a URL",
                MAX_INDEX_BYTES >> 20
            ));
        }
        let last = from.saturating_add(self.chunk).min(self.total) - 1;
        let mut response = self
            .agent
            .get(self.url)
            .header("Range", format!("bytes={from}-{last}"))
            .call()
            .map_err(|error| format!("the request for bytes {from}-{last} failed: {error}"))?;
        self.fetched.requests += 1;
        match response.status().as_u16() {
            206 => {}
            404 if from == 0 => return Ok(false),
            200 => {
                return Err("the server does not answer range requests (it sent the whole file, status 200); \
                            Hypura reads only a model's index, so it needs a server that does"
                    .into())
            }
            status => return Err(format!("the server answered {status} for bytes {from}-{last}")),
        }
        let content_range = response
            .headers()
            .get("content-range")
            .and_then(|value| value.to_str().ok())
            .ok_or("a partial answer without a Content-Range header")?;
        let (first, end, total) = parse_content_range(content_range)
            .ok_or_else(|| format!("a Content-Range header Hypura cannot read: {content_range:?}"))?;
        if first != from || end < first || end > last || end >= total || (self.total != u64::MAX && total != self.total)
        {
            return Err(format!("asked for bytes {from}-{last}, the server sent {content_range:?}"));
        }
        self.total = total;
        let expected = end - first + 1;
        let body = response
            .body_mut()
            .with_config()
            .limit(expected + 1)
            .read_to_vec()
            .map_err(|error| format!("reading bytes {from}-{end}: {error}"))?;
        if body.len() as u64 != expected {
            return Err(format!("the server sent {} of the {expected} bytes of range {from}-{end}", body.len()));
        }
        self.fetched.bytes += expected;
        self.start = from;
        self.buffer = body;
        self.consumed = 0;
        self.chunk = (self.chunk * 2).min(MAX_CHUNK);
        Ok(true)
    }
}

/// `bytes FIRST-LAST/TOTAL`.
fn parse_content_range(value: &str) -> Option<(u64, u64, u64)> {
    let (range, total) = value.strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    Some((first.trim().parse().ok()?, last.trim().parse().ok()?, total.trim().parse().ok()?))
}

impl Read for RangeReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.consumed == self.buffer.len() {
            let next = self.start + self.buffer.len() as u64;
            if next >= self.total || out.is_empty() {
                return Ok(0);
            }
            self.fetch(next).map_err(std::io::Error::other)?;
        }
        let count = out.len().min(self.buffer.len() - self.consumed);
        out[..count].copy_from_slice(&self.buffer[self.consumed..self.consumed + count]);
        self.consumed += count;
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert!(is_url("https://host/m.gguf") && is_url("hf://org/repo/m.gguf") && !is_url("/models/m.gguf"));
        assert_eq!(
            resolve("hf://Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/q4_k_m/model.gguf").unwrap(),
            "https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/resolve/main/q4_k_m/model.gguf"
        );
        assert!(resolve("hf://org/model.gguf").is_err());
        assert_eq!(parse_content_range("bytes 0-1023/4096"), Some((0, 1023, 4096)));
        assert_eq!(parse_content_range("bytes */4096"), None);
    }
}
