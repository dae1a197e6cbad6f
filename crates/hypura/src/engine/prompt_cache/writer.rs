//! The writer thread: cuts a saved sequence's missing blocks out of llama.cpp's file, writes
//! blocks and snapshots under temporary names and renames them, then evicts the least recently
//! used files beyond the size limit.
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use hypura_sys::state::{self, Part, StateError};
use hypura_sys::Token;

use super::format::{block_header, snapshot_header, snapshot_path, write_sealed, BLOCK_EXTENSION, SNAPSHOT_EXTENSION};
use super::temporary::Temporary;
use super::{io_error, recency, Hash, PromptCacheError, BLOCK_TOKENS};
use crate::format::hex;

pub(super) struct BlockJob {
    pub(super) saved: Temporary,
    pub(super) tokens: Vec<Token>,
    pub(super) chain: Vec<Hash>,
    pub(super) from_block: usize,
}

pub(super) enum WriteJob {
    Blocks(BlockJob),
    /// A sequence's state as `Context::sequence_state` copied it, with its tokens.
    Snapshot {
        tokens: Vec<Token>,
        state: Vec<u8>,
    },
}

/// The writer thread's half.
pub(super) struct Writer {
    pub(super) root: PathBuf,
    pub(super) dir: PathBuf,
    pub(super) digest: Hash,
    pub(super) max_bytes: u64,
    pub(super) unsupported: Arc<AtomicBool>,
    pub(super) pending: Arc<AtomicUsize>,
}

impl Writer {
    pub(super) fn write(&self, job: WriteJob) {
        match job {
            WriteJob::Blocks(job) => {
                self.write_block_job(job);
                self.pending.fetch_sub(1, Ordering::Relaxed);
            }
            WriteJob::Snapshot { tokens, state } => {
                match self.write_snapshot(&tokens, &state) {
                    Ok(bytes) => {
                        tracing::debug!("prompt cache: a {bytes}-byte snapshot written for {} tokens", tokens.len());
                        self.evict();
                    }
                    Err(error) => tracing::warn!("{error}; the snapshot is not saved"),
                }
                self.pending.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Write a snapshot to a temporary name and rename it; returns its size.
    fn write_snapshot(&self, tokens: &[Token], state: &[u8]) -> Result<u64, PromptCacheError> {
        let path = snapshot_path(&self.dir, &self.digest, tokens);
        let temporary = Temporary::create(&self.root, "snapshot").map_err(io_error(&self.root))?;
        let result = write_sealed(&temporary.file, |out| {
            out.write_all(&snapshot_header(&self.digest, tokens, state.len() as u64))?;
            out.write_all(state)
        })
        .and_then(|()| temporary.file.metadata().map(|metadata| metadata.len()));
        match result {
            Ok(bytes) => {
                temporary.persist(&path).map_err(io_error(&path))?;
                Ok(bytes)
            }
            Err(source) => Err(PromptCacheError::Io { path, source }),
        }
    }

    fn write_block_job(&self, job: BlockJob) {
        let written = self.write_blocks(&job);
        let tokens = job.tokens.len();
        // The sequence's copy goes before the eviction, which counts everything on disk.
        drop(job);
        match written {
            Ok(written) if written > 0 => {
                tracing::debug!("prompt cache: {written} bytes written for {tokens} tokens");
                self.evict();
            }
            Ok(_) => {}
            Err(PromptCacheError::State { source: StateError::Layout(reason), .. }) => {
                if !self.unsupported.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "prompt cache: this model's cache is not a plain KV cache ({reason}); its prompts are not saved"
                    );
                }
            }
            Err(error) => tracing::warn!("{error}; the prompt's blocks are not all saved"),
        }
    }

    /// Write the job's missing blocks; returns the bytes written.
    fn write_blocks(&self, job: &BlockJob) -> Result<u64, PromptCacheError> {
        let file = File::open(&job.saved.path).map_err(io_error(&job.saved.path))?;
        let state_error = |source| PromptCacheError::State { path: job.saved.path.clone(), source };
        let (tokens, section) = state::read_sequence(&file).map_err(state_error)?;
        if !tokens.starts_with(&job.tokens) {
            return Err(PromptCacheError::Invalid {
                path: job.saved.path.clone(),
                reason: "the saved sequence holds other tokens".into(),
            });
        }
        // Cells by position; every position of the blocks must be there exactly once.
        let mut by_position = vec![usize::MAX; job.tokens.len()];
        for (cell, &position) in section.positions().iter().enumerate() {
            if let Some(slot) = usize::try_from(position).ok().and_then(|position| by_position.get_mut(position)) {
                if *slot != usize::MAX {
                    return Err(PromptCacheError::Invalid {
                        path: job.saved.path.clone(),
                        reason: format!("position {position} is held twice"),
                    });
                }
                *slot = cell;
            }
        }
        if by_position.contains(&usize::MAX) {
            return Err(PromptCacheError::Invalid {
                path: job.saved.path.clone(),
                reason: "the sequence does not hold every position of its prompt".into(),
            });
        }
        let mut written = 0;
        let now = SystemTime::now();
        for index in job.from_block..job.chain.len() {
            let path = self.dir.join(format!("{}.{BLOCK_EXTENSION}", hex(&job.chain[index])));
            if path.is_file() {
                continue;
            }
            let range = index * BLOCK_TOKENS..(index + 1) * BLOCK_TOKENS;
            let previous = if index == 0 { self.digest } else { job.chain[index - 1] };
            let cells = &by_position[range.clone()];
            let temporary = Temporary::create(&self.root, "block").map_err(io_error(&self.root))?;
            let result = write_sealed(&temporary.file, |out| {
                out.write_all(&block_header(&self.digest, &previous, index, &job.tokens[range.clone()]))?;
                state::write_section(out, &[Part { file: &file, section: &section, cells }])?;
                Ok::<(), StateError>(())
            })
            .and_then(|()| {
                temporary.file.set_modified(recency(now, index))?;
                Ok(temporary.file.metadata()?.len())
            });
            match result {
                Ok(bytes) => {
                    temporary.persist(&path).map_err(io_error(&path))?;
                    written += bytes;
                }
                Err(source) => return Err(PromptCacheError::State { path, source }),
            }
        }
        Ok(written)
    }

    /// Remove the least recently used blocks and snapshots (of every model) until everything in
    /// the directory, temporaries and foreign files included, is within the size limit.
    pub(super) fn evict(&self) {
        let mut total = 0;
        let mut blocks: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
        let mut directories = vec![self.root.clone()];
        while let Some(directory) = directories.pop() {
            let Ok(entries) = std::fs::read_dir(&directory) else { continue };
            for entry in entries.flatten() {
                let Ok(metadata) = entry.metadata() else { continue };
                let path = entry.path();
                if metadata.is_dir() {
                    directories.push(path);
                    continue;
                }
                total += metadata.len();
                if path
                    .extension()
                    .is_some_and(|extension| extension == BLOCK_EXTENSION || extension == SNAPSHOT_EXTENSION)
                {
                    blocks.push((metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH), metadata.len(), path));
                }
            }
        }
        if total <= self.max_bytes {
            return;
        }
        blocks.sort();
        for (_, bytes, path) in blocks {
            if total <= self.max_bytes {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= bytes;
            }
        }
    }
}
