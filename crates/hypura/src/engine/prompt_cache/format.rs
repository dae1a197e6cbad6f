//! The files on disk: a block's and a snapshot's header, the SHA-256 each ends with, and the
//! checks that a file is whole and is what its name promised before it is loaded.
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use hypura_sys::state::Section;
use hypura_sys::Token;
use sha2::{Digest, Sha256};

use super::digest::chain_step;
use super::{io_error, Hash, PromptCacheError, BLOCK_TOKENS};
use crate::format::hex;

const MAGIC: &[u8; 8] = b"HYPKV\0\0\x01";
pub(super) const BLOCK_EXTENSION: &str = "kv";
const SNAPSHOT_MAGIC: &[u8; 8] = b"HYPSN\0\0\x01";
pub(super) const SNAPSHOT_EXTENSION: &str = "snap";

/// Write into `file` (new and empty) what `body` writes, then a SHA-256 of all of it (blocks
/// and snapshots end so).
pub(super) fn write_sealed<E: From<std::io::Error>>(
    file: &File,
    body: impl FnOnce(&mut HashingWriter<BufWriter<&File>>) -> Result<(), E>,
) -> Result<(), E> {
    let mut out = HashingWriter { inner: BufWriter::new(file), hasher: Sha256::new() };
    body(&mut out)?;
    let HashingWriter { mut inner, hasher } = out;
    inner.write_all(&hasher.finalize())?;
    inner.flush()?;
    Ok(())
}

pub(super) struct HashingWriter<W: Write> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buffer: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buffer)?;
        self.hasher.update(&buffer[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// magic, settings digest, the chain hash before this block, its first position and token
/// count, and its tokens.
pub(super) fn block_header(digest: &Hash, previous: &Hash, index: usize, tokens: &[Token]) -> Vec<u8> {
    let mut header = Vec::with_capacity(MAGIC.len() + 72 + tokens.len() * 4);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(digest);
    header.extend_from_slice(previous);
    header.extend_from_slice(&((index * BLOCK_TOKENS) as u32).to_le_bytes());
    header.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for token in tokens {
        header.extend_from_slice(&token.to_le_bytes());
    }
    header
}

/// Check a block file against what its name promised and return its section.
pub(super) fn read_block(
    file: &File,
    path: &Path,
    digest: &Hash,
    previous: &Hash,
    index: usize,
    tokens: &[Token],
) -> Result<Section, PromptCacheError> {
    let invalid = |reason: &str| PromptCacheError::Invalid { path: path.to_path_buf(), reason: reason.to_string() };
    let expected = block_header(digest, previous, index, tokens);
    let len = file.metadata().map_err(io_error(path))?.len();
    if len < (expected.len() + 32) as u64 {
        return Err(invalid("truncated"));
    }
    let mut header = vec![0u8; expected.len()];
    std::os::unix::fs::FileExt::read_exact_at(file, &mut header, 0).map_err(io_error(path))?;
    if header[..MAGIC.len()] != MAGIC[..] {
        return Err(invalid("not a prompt cache block of this build"));
    }
    if header != expected {
        return Err(invalid("made for another model, settings or prompt"));
    }
    let mut hasher = Sha256::new();
    let mut reader = file.take(len - 32);
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let read = reader.read(&mut buffer).map_err(io_error(path))?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    let mut stored = [0u8; 32];
    std::os::unix::fs::FileExt::read_exact_at(file, &mut stored, len - 32).map_err(io_error(path))?;
    if hasher.finalize()[..] != stored {
        return Err(invalid("its checksum does not match (a corrupt file)"));
    }
    let section = Section::read(file, expected.len() as u64, len - 32)
        .map_err(|source| PromptCacheError::State { path: path.to_path_buf(), source })?;
    let first = (index * BLOCK_TOKENS) as i32;
    if !section.positions().iter().copied().eq(first..first + tokens.len() as i32) {
        return Err(invalid("its cells are not its block's positions"));
    }
    Ok(section)
}

pub(super) fn snapshot_path(dir: &Path, digest: &Hash, tokens: &[Token]) -> PathBuf {
    dir.join(format!("{}-{}.{SNAPSHOT_EXTENSION}", tokens.len(), hex(&chain_step(digest, tokens))))
}

/// The lengths of the snapshots in `dir`, from their names.
pub(super) fn snapshot_lengths(dir: &Path) -> Vec<usize> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| {
            let path = entry.path();
            if path.extension()? != SNAPSHOT_EXTENSION {
                return None;
            }
            let (length, _) = path.file_stem()?.to_str()?.split_once('-')?;
            length.parse().ok()
        })
        .collect()
}

/// magic, settings digest, token count, the tokens, and the state's length.
pub(super) fn snapshot_header(digest: &Hash, tokens: &[Token], state_bytes: u64) -> Vec<u8> {
    let mut header = Vec::with_capacity(SNAPSHOT_MAGIC.len() + 44 + tokens.len() * 4);
    header.extend_from_slice(SNAPSHOT_MAGIC);
    header.extend_from_slice(digest);
    header.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for token in tokens {
        header.extend_from_slice(&token.to_le_bytes());
    }
    header.extend_from_slice(&state_bytes.to_le_bytes());
    header
}

/// Read a snapshot file and check it against what its name promised: returns its bytes and
/// where the state lies in them.
pub(super) fn read_snapshot(
    path: &Path,
    digest: &Hash,
    tokens: &[Token],
    max_bytes: u64,
) -> Result<(Vec<u8>, std::ops::Range<usize>), PromptCacheError> {
    let invalid = |reason: &str| PromptCacheError::Invalid { path: path.to_path_buf(), reason: reason.to_string() };
    let len = std::fs::metadata(path).map_err(io_error(path))?.len();
    if len > max_bytes {
        return Err(invalid("larger than the prompt cache may be"));
    }
    let bytes = std::fs::read(path).map_err(io_error(path))?;
    let header_len = snapshot_header(digest, tokens, 0).len();
    if bytes.len() < header_len + 32 {
        return Err(invalid("truncated"));
    }
    if bytes[..SNAPSHOT_MAGIC.len()] != SNAPSHOT_MAGIC[..] {
        return Err(invalid("not a prompt cache snapshot of this build"));
    }
    let (body, stored) = bytes.split_at(bytes.len() - 32);
    if Sha256::digest(body)[..] != *stored {
        return Err(invalid("its checksum does not match (a corrupt file)"));
    }
    let state = header_len..body.len();
    if body[..header_len] != snapshot_header(digest, tokens, state.len() as u64)[..] {
        return Err(invalid("made for another model, settings or prompt"));
    }
    Ok((bytes, state))
}
