//! One file's download: written as `FILE.partial`, resumed from its length with a range
//! request, hashed as it arrives (a resumed part hashed again from disk first), checked against
//! the size and SHA-256 the hub gave, and renamed into place only then. A mismatch deletes the
//! file; a connection cut off keeps the part for the next pull.
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{check_status, io_error, is_sha256, Hub, HubError, PulledFile, RemoteFile};
use crate::format::{format_bytes, hex};

/// What a pull is doing, for a progress bar or Ollama's `/api/pull` lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Reading the repository's files.
    Resolving,
    /// Bytes of file `index` of `count`: `completed` of `total` (None: not said).
    File {
        index: usize,
        count: usize,
        name: String,
        sha256: Option<String>,
        completed: u64,
        total: Option<u64>,
    },
    /// Checking a whole file's hash.
    Verifying {
        name: String,
    },
    Done,
}

const READ_CHUNK: usize = 1 << 20;
/// How often progress is told while bytes arrive.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);

fn partial_path(destination: &Path) -> PathBuf {
    let mut name = destination.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    destination.with_file_name(name)
}

/// Refuse up front when the files still to come do not fit the free space under `directory`.
pub(super) fn check_space(directory: &Path, files: &[RemoteFile], models: &Path) -> Result<(), HubError> {
    let needed: u64 = files
        .iter()
        .map(|file| {
            let destination = models.join(&file.relative);
            let have = if destination.is_file() {
                file.size.unwrap_or(0)
            } else {
                std::fs::metadata(partial_path(&destination)).map_or(0, |metadata| metadata.len())
            };
            file.size.unwrap_or(0).saturating_sub(have)
        })
        .sum();
    let stats = rustix::fs::statvfs(directory)
        .map_err(|error| HubError::Io { path: directory.to_path_buf(), source: error.into() })?;
    let free = stats.f_bavail.saturating_mul(stats.f_frsize);
    if needed > free {
        return Err(HubError::Refused(format!(
            "not enough disk space: the pull needs {} and {} holds {} free",
            format_bytes(needed),
            directory.display(),
            format_bytes(free)
        )));
    }
    Ok(())
}

/// Hash what a file holds.
fn hash_file(path: &Path, hasher: &mut Sha256) -> Result<u64, HubError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let mut buffer = vec![0u8; READ_CHUNK];
    let mut total = 0;
    loop {
        let read = file.read(&mut buffer).map_err(io_error(path))?;
        if read == 0 {
            return Ok(total);
        }
        hasher.update(&buffer[..read]);
        total += read as u64;
    }
}

/// Download `file` (file `index` of `count`) into the models directory.
pub(super) fn fetch(
    hub: &Hub,
    file: &RemoteFile,
    index: usize,
    count: usize,
    progress: &mut dyn FnMut(Progress),
) -> Result<PulledFile, HubError> {
    let destination = hub.models.join(&file.relative);
    let name = file.relative.file_name().map_or_else(|| file.url.clone(), |name| name.to_string_lossy().into_owned());
    let pulled = |bytes: u64, sha256: String, verified: bool| PulledFile {
        path: file.relative.clone(),
        bytes,
        sha256,
        verified,
        url: file.url.clone(),
    };
    // A file an earlier pull finished (one of a split model, or the whole name) is kept when it
    // still has its hash.
    if let (true, Some(expected)) = (destination.is_file(), &file.sha256) {
        let mut hasher = Sha256::new();
        let bytes = hash_file(&destination, &mut hasher)?;
        if hex(&hasher.finalize()) == *expected {
            progress(Progress::File {
                index,
                count,
                name: name.clone(),
                sha256: file.sha256.clone(),
                completed: bytes,
                total: Some(bytes),
            });
            return Ok(pulled(bytes, expected.clone(), true));
        }
    }
    let directory = destination.parent().expect("a pulled file has a directory");
    std::fs::create_dir_all(directory).map_err(io_error(directory))?;
    let partial = partial_path(&destination);
    let mut hasher = Sha256::new();
    let mut have = if partial.is_file() { hash_file(&partial, &mut hasher)? } else { 0 };
    if file.size.is_some_and(|size| have > size) {
        hasher = Sha256::new();
        have = 0;
    }

    let agent = hub.agent();
    let mut request = hub.authorize(agent.get(&file.url), &file.url);
    if have > 0 {
        request = request.header("Range", format!("bytes={have}-"));
    }
    let response =
        request.call().map_err(|error| HubError::Http { url: file.url.clone(), message: error.to_string() })?;
    let status = response.status().as_u16();
    let header = |name: &str| response.headers().get(name).and_then(|value| value.to_str().ok()).map(str::to_string);
    let linked =
        header("x-linked-etag").map(|etag| etag.trim_matches('"').to_ascii_lowercase()).filter(|etag| is_sha256(etag));
    let sha256 = file.sha256.clone().or(linked);
    let mut total = file.size;
    let resumed = match status {
        206 => {
            let range = header("content-range").unwrap_or_default();
            let start = range
                .strip_prefix("bytes ")
                .and_then(|rest| rest.split('-').next())
                .and_then(|start| start.parse::<u64>().ok());
            if start != Some(have) {
                return Err(HubError::Http {
                    url: file.url.clone(),
                    message: format!("asked for bytes {have}-, the server sent {range:?}"),
                });
            }
            total = total.or_else(|| range.rsplit('/').next().and_then(|size| size.parse().ok()));
            true
        }
        // A server that ignores the range sends the whole file: start over.
        200 => {
            hasher = Sha256::new();
            have = 0;
            total = total.or_else(|| header("content-length").and_then(|length| length.parse().ok()));
            false
        }
        _ => {
            check_status(status, &name, &file.url)?;
            return Err(HubError::Http { url: file.url.clone(), message: format!("the server answered {status}") });
        }
    };
    let mut out = File::options()
        .create(true)
        .write(true)
        .append(resumed)
        .truncate(!resumed)
        .open(&partial)
        .map_err(io_error(&partial))?;
    let mut body = response.into_body().into_with_config().reader();
    let mut buffer = vec![0u8; READ_CHUNK];
    let mut told = Instant::now() - PROGRESS_EVERY;
    let tell = |progress: &mut dyn FnMut(Progress), have: u64| {
        progress(Progress::File { index, count, name: name.clone(), sha256: sha256.clone(), completed: have, total });
    };
    loop {
        let read = match body.read(&mut buffer) {
            Ok(read) => read,
            Err(error) => {
                let _ = out.flush();
                return Err(HubError::Http {
                    url: file.url.clone(),
                    message: format!(
                        "cut off after {} ({error}); the {} kept are resumed by pulling again",
                        format_bytes(have),
                        format_bytes(have)
                    ),
                });
            }
        };
        if read == 0 {
            break;
        }
        out.write_all(&buffer[..read]).map_err(io_error(&partial))?;
        hasher.update(&buffer[..read]);
        have += read as u64;
        if told.elapsed() >= PROGRESS_EVERY {
            tell(progress, have);
            told = Instant::now();
        }
    }
    out.flush().map_err(io_error(&partial))?;
    drop(out);
    tell(progress, have);
    if let Some(total) = total.filter(|total| *total != have) {
        return Err(HubError::Http {
            url: file.url.clone(),
            message: format!("the body ended at {have} of {total} bytes; pulling again resumes it"),
        });
    }
    progress(Progress::Verifying { name: name.clone() });
    let digest = hex(&hasher.finalize());
    if let Some(expected) = &sha256 {
        if digest != *expected {
            let _ = std::fs::remove_file(&partial);
            return Err(HubError::Refused(format!(
                "{name}: its SHA-256 is {digest} where the hub says {expected}; the download was deleted"
            )));
        }
    }
    std::fs::rename(&partial, &destination).map_err(io_error(&destination))?;
    Ok(pulled(have, digest, sha256.is_some()))
}
