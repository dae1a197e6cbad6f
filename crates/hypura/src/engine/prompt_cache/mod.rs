//! `PromptCache`: a sequence's KV cache on disk, by prefix, so that a prompt that starts like an
//! earlier one (the same system prompt, the same tool definitions, an agent's next session)
//! loads that prefix instead of evaluating it, after a restart or a reload too (decision 28).
//!
//! The cache is cut into blocks of `BLOCK_TOKENS` positions. A block's file is named by a hash
//! chained over every token up to its end (`chain`), so two prompts that share a system prompt
//! share its blocks, and a prompt's cached prefix is the run of blocks whose files exist. The
//! chain starts from the settings digest (`settings_digest`): the model file's identity, the
//! build, and the settings that change the bits of the KV cache; a file of another model or
//! build is never looked up, and each file repeats the digest, its block's tokens and a SHA-256
//! of itself, so a file that is truncated, corrupt or misplaced is skipped with a warning (and
//! removed), never loaded.
//!
//! Saving happens when a sequence ends: llama.cpp writes the sequence to a temporary file (a
//! layer's range at a time, no copy of the cache in memory), and a writer thread cuts the
//! missing blocks out of it (`hypura_sys::state`), writes each to a temporary name and renames
//! it, then evicts the least recently used blocks beyond the size limit. Loading joins the
//! blocks into one sequence file that llama.cpp reads into the sequence. Two processes may
//! share a directory: names are unique per process until the rename, a rename replaces a block
//! with an equal one, and a block evicted under a reader is a miss.
//!
//! Every temporary file is locked (`flock`) by the process writing it for as long as it lives
//! (`Temporary`). The kernel drops the lock with the process, so a start removes every
//! temporary that no live process holds: what a `kill -9` cut short costs that write and is
//! cleaned by the next start, and a file cut short is never loaded (a block or snapshot exists
//! under its name only once it was written whole and renamed). Everything in the directory,
//! temporaries included, counts against `--prompt-cache-size`.
//!
//! Sliding-window, recurrent and hybrid memories (Gemma 3, Qwen3.5) hold state that is not a run
//! of positions: a prefix of it cannot be cut out of a longer sequence. Their sequences are kept
//! whole instead (`Layout::Snapshots`): llama.cpp's copy of the sequence as it was at that
//! length, taken where prompts are likely to part (the end of the system prompt and tools,
//! which the batcher stops the prompt's evaluation at, `prompt::stable_prefix`) and where each
//! request ends, named by the length and a hash of every token to it. A later prompt loads the
//! longest snapshot it starts with. Each file repeats the digest and its tokens and ends with a
//! SHA-256 of itself, as blocks do.
//!
//! The parts: this file is the cache's policy (what a prompt loads, what a sequence saves);
//! `format` is the files' layout and checks, `digest` the hashes that name them, `writer` the
//! thread that writes and evicts, and `temporary` the locked temporary files.
mod digest;
mod format;
mod temporary;
mod writer;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use hypura_sys::state::{self, Part, StateError};
use hypura_sys::{Context, Token};

use crate::format::hex;
use digest::chain_step;
use format::{read_block, read_snapshot, snapshot_lengths, snapshot_path, BLOCK_EXTENSION};
use temporary::{sweep, Temporary};
use writer::{BlockJob, WriteJob, Writer};

pub use digest::settings_digest;

/// Tokens per block: a 2,500-token system prompt is cached but for the last partial block.
pub const BLOCK_TOKENS: usize = 64;
/// `--prompt-cache-size` when not given.
pub const DEFAULT_MAX_BYTES: u64 = 8 << 30;
/// Saves copied out of the context and not yet written (a snapshot in memory, or a sequence in
/// a temporary file that the writer cuts into blocks): more are skipped, so that a slow disk
/// holds at most this many copies of a sequence. A skipped save costs that sequence's new
/// blocks only: a later save of a sequence that starts with it writes every block not on disk.
const MAX_PENDING_SAVES: usize = 2;

type Hash = [u8; 32];

/// Where and how much (`--prompt-cache DIR`, `--prompt-cache-size`).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptCacheOptions {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PromptCacheError {
    #[error("prompt cache {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("prompt cache {path}: {source}")]
    State { path: PathBuf, source: StateError },
    #[error("prompt cache {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Sys(#[from] hypura_sys::SysError),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PromptCacheError + '_ {
    move |source| PromptCacheError::Io { path: path.to_path_buf(), source }
}

impl PromptCacheOptions {
    /// Create the directory and prove it writable, so that a bad `--prompt-cache` is an error at
    /// startup rather than a warning per request; remove the temporaries no live process holds.
    pub fn check(&self) -> Result<(), PromptCacheError> {
        std::fs::create_dir_all(&self.dir).map_err(io_error(&self.dir))?;
        sweep(&self.dir);
        let probe = Temporary::create(&self.dir, "probe").map_err(io_error(&self.dir))?;
        (&probe.file).write_all(b"hypura").map_err(io_error(&probe.path))?;
        Ok(())
    }
}

/// What a load brought in.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Loaded {
    pub tokens: usize,
    /// Bytes of the block files read.
    pub bytes: u64,
}

/// How a model's sequences are kept on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// A plain KV cache: blocks of positions cut out of a sequence, shared by every prompt that
    /// starts with them.
    Blocks,
    /// Sliding-window, recurrent or hybrid memory: whole sequences at chosen lengths.
    Snapshots,
}

/// The prompt cache of one engine's settings. See the module documentation.
pub struct PromptCache {
    root: PathBuf,
    /// `root/<digest>`: this model's and settings' blocks.
    dir: PathBuf,
    digest: Hash,
    layout: Layout,
    /// A snapshot larger than this is no file of ours (`--prompt-cache-size`).
    max_bytes: u64,
    writer: Option<(mpsc::Sender<WriteJob>, JoinHandle<()>)>,
    /// Set once a sequence turned out not to be what `layout` keeps.
    unsupported: Arc<AtomicBool>,
    /// Snapshots sent to the writer and not yet written.
    pending: Arc<AtomicUsize>,
}

impl PromptCache {
    /// The cache in `options.dir` (which `PromptCacheOptions::check` proved writable at
    /// startup) for an engine whose settings digest is `digest`, keeping sequences as `layout`.
    pub fn open(options: &PromptCacheOptions, digest: Hash, layout: Layout) -> Result<PromptCache, PromptCacheError> {
        let dir = options.dir.join(hex(&digest[..8]));
        std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        sweep(&options.dir);
        let unsupported = Arc::new(AtomicBool::new(false));
        let pending = Arc::new(AtomicUsize::new(0));
        let (sender, receiver) = mpsc::channel::<WriteJob>();
        let writer = Writer {
            root: options.dir.clone(),
            dir: dir.clone(),
            digest,
            max_bytes: options.max_bytes,
            unsupported: unsupported.clone(),
            pending: pending.clone(),
        };
        // A directory over its size (a smaller --prompt-cache-size than last time) is trimmed
        // before the first save.
        writer.evict();
        let handle = std::thread::Builder::new()
            .name("hypura-prompt-cache".into())
            .spawn(move || {
                for job in receiver {
                    writer.write(job);
                }
            })
            .map_err(io_error(&dir))?;
        Ok(PromptCache {
            root: options.dir.clone(),
            dir,
            digest,
            layout,
            max_bytes: options.max_bytes,
            writer: Some((sender, handle)),
            unsupported,
            pending,
        })
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The chain hash at the end of each whole block of `tokens`.
    fn chain(&self, tokens: &[Token]) -> Vec<Hash> {
        let mut previous = self.digest;
        tokens
            .chunks_exact(BLOCK_TOKENS)
            .map(|block| {
                previous = chain_step(&previous, block);
                previous
            })
            .collect()
    }

    fn block_path(&self, hash: &Hash) -> PathBuf {
        self.dir.join(format!("{}.{BLOCK_EXTENSION}", hex(hash)))
    }

    /// `<dir>/<tokens>-<hash of the digest and every token>.snap`.
    fn snapshot_path(&self, tokens: &[Token]) -> PathBuf {
        snapshot_path(&self.dir, &self.digest, tokens)
    }

    /// Whether a snapshot of a sequence holding `tokens` is worth taking: the layout keeps
    /// snapshots, none of these tokens is on disk yet, and there are at least a block's worth.
    pub fn wants_snapshot(&self, tokens: &[Token]) -> bool {
        self.layout == Layout::Snapshots
            && tokens.len() >= BLOCK_TOKENS
            && !self.unsupported.load(Ordering::Relaxed)
            && !self.snapshot_path(tokens).is_file()
    }

    /// Load the cached prefix of `tokens` into sequence `seq_id` of `context`, whose KV cache
    /// has `n_stream` streams, where more than `beyond` tokens of it are on disk. A block that
    /// fails its checks is removed with a warning and the prefix before it is loaded.
    /// `Ok(None)` when no more than `beyond` tokens are cached (the sequence is untouched); an
    /// error leaves the sequence empty.
    pub fn load(
        &self,
        context: &mut Context,
        seq_id: i32,
        n_stream: u32,
        tokens: &[Token],
        beyond: usize,
    ) -> Result<Option<Loaded>, PromptCacheError> {
        if self.unsupported.load(Ordering::Relaxed) {
            return Ok(None);
        }
        if self.layout == Layout::Snapshots {
            return self.load_snapshot(context, seq_id, tokens, beyond);
        }
        let chain = self.chain(tokens);
        if chain.iter().take_while(|hash| self.block_path(hash).is_file()).count() * BLOCK_TOKENS <= beyond {
            return Ok(None);
        }
        let mut blocks = Vec::new();
        let mut previous = self.digest;
        for (index, hash) in chain.iter().enumerate() {
            let path = self.block_path(hash);
            let Ok(file) = File::open(&path) else { break };
            let block_tokens = &tokens[index * BLOCK_TOKENS..(index + 1) * BLOCK_TOKENS];
            match read_block(&file, &path, &self.digest, &previous, index, block_tokens) {
                Ok(section) => blocks.push((file, section)),
                Err(error) => {
                    tracing::warn!("{error}; the file is removed and the prompt evaluated from there");
                    let _ = std::fs::remove_file(&path);
                    break;
                }
            }
            previous = *hash;
        }
        // The valid run may be shorter than the files (a bad block): then the slot may hold more.
        if blocks.len() * BLOCK_TOKENS <= beyond {
            return Ok(None);
        }
        let n_tokens = blocks.len() * BLOCK_TOKENS;
        let all: Vec<usize> = (0..BLOCK_TOKENS).collect();
        let parts: Vec<Part<'_>> = blocks.iter().map(|(file, section)| Part { file, section, cells: &all }).collect();
        let bytes_read =
            blocks.iter().filter_map(|(file, _)| file.metadata().ok()).map(|metadata| metadata.len()).sum();
        let joined = Temporary::create(&self.root, "load").map_err(io_error(&self.root))?;
        let written = (|| {
            let mut out = BufWriter::new(&joined.file);
            let written = state::write_sequence(&mut out, &tokens[..n_tokens], n_stream, &parts)?;
            out.flush()?;
            Ok::<u64, StateError>(written)
        })();
        let result =
            written.map_err(|source| PromptCacheError::State { path: joined.path.clone(), source }).and_then(|_| {
                let loaded = context.load_sequence(seq_id, &joined.path, n_tokens)?;
                if loaded != tokens[..n_tokens] {
                    context.truncate_sequence(seq_id, 0);
                    return Err(PromptCacheError::Invalid {
                        path: joined.path.clone(),
                        reason: "llama.cpp read back other tokens than were written".into(),
                    });
                }
                Ok(Loaded { tokens: n_tokens, bytes: bytes_read })
            });
        drop(joined);
        let now = SystemTime::now();
        for (index, (file, _)) in blocks.iter().enumerate() {
            let _ = file.set_modified(recency(now, index));
        }
        result.map(Some)
    }

    /// The longest snapshot that `tokens` starts with and that is longer than `beyond`, into
    /// sequence `seq_id`. A snapshot that fails its checks is removed with a warning and the
    /// next shorter one tried.
    fn load_snapshot(
        &self,
        context: &mut Context,
        seq_id: i32,
        tokens: &[Token],
        beyond: usize,
    ) -> Result<Option<Loaded>, PromptCacheError> {
        let mut lengths = snapshot_lengths(&self.dir);
        lengths.retain(|&length| length > beyond && length <= tokens.len());
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        lengths.dedup();
        for length in lengths {
            let path = self.snapshot_path(&tokens[..length]);
            if !path.is_file() {
                continue;
            }
            let (bytes, state) = match read_snapshot(&path, &self.digest, &tokens[..length], self.max_bytes) {
                Ok(read) => read,
                Err(error) => {
                    tracing::warn!("{error}; the file is removed");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            context.set_sequence_state(seq_id, &bytes[state])?;
            // The sequence must end where the snapshot did, or it is not that snapshot.
            if context.sequence_positions(seq_id).map(|(_, last)| last) != Some(length as i32 - 1) {
                context.truncate_sequence(seq_id, 0);
                return Err(PromptCacheError::Invalid {
                    path,
                    reason: format!("llama.cpp restored a sequence that does not end at position {}", length - 1),
                });
            }
            if let Ok(file) = File::options().append(true).open(&path) {
                let _ = file.set_modified(SystemTime::now());
            }
            return Ok(Some(Loaded { tokens: length, bytes: bytes.len() as u64 }));
        }
        Ok(None)
    }

    /// Keep sequence `seq_id`, which holds `tokens`: the blocks of it not on disk yet, or with
    /// `Layout::Snapshots` the whole sequence at its length. The context copies the sequence
    /// here (to a temporary file, or for a snapshot into memory); the writer thread does the
    /// rest.
    pub fn save(&self, context: &mut Context, seq_id: i32, tokens: &[Token]) {
        if self.unsupported.load(Ordering::Relaxed) {
            return;
        }
        if self.layout == Layout::Snapshots {
            return self.snapshot(context, seq_id, tokens);
        }
        let chain = self.chain(tokens);
        let Some(from_block) = chain.iter().position(|hash| !self.block_path(hash).is_file()) else { return };
        let Some((sender, _)) = &self.writer else { return };
        if self.pending.load(Ordering::Relaxed) >= MAX_PENDING_SAVES {
            tracing::debug!("prompt cache: {MAX_PENDING_SAVES} saves still being written; this one is skipped");
            return;
        }
        let saved = match Temporary::create(&self.root, "save") {
            Ok(saved) => saved,
            Err(error) => {
                tracing::warn!("prompt cache {}: {error}; this prompt is not cached", self.root.display());
                return;
            }
        };
        // llama.cpp opens the file by its name; this process's lock on it holds meanwhile.
        if let Err(error) = context.save_sequence(seq_id, &saved.path, tokens) {
            tracing::warn!("prompt cache: {error}; this prompt is not cached");
            return;
        }
        let job = BlockJob { saved, tokens: tokens[..chain.len() * BLOCK_TOKENS].to_vec(), chain, from_block };
        self.pending.fetch_add(1, Ordering::Relaxed);
        if sender.send(WriteJob::Blocks(job)).is_err() {
            // The job, and with it the temporary file, is dropped with the error.
            self.pending.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn snapshot(&self, context: &mut Context, seq_id: i32, tokens: &[Token]) {
        if !self.wants_snapshot(tokens) {
            return;
        }
        let Some((sender, _)) = &self.writer else { return };
        if self.pending.load(Ordering::Relaxed) >= MAX_PENDING_SAVES {
            tracing::debug!("prompt cache: {MAX_PENDING_SAVES} saves still being written; this snapshot is skipped");
            return;
        }
        match context.sequence_state(seq_id) {
            Ok(state) => {
                self.pending.fetch_add(1, Ordering::Relaxed);
                if sender.send(WriteJob::Snapshot { tokens: tokens.to_vec(), state }).is_err() {
                    self.pending.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Err(error) => {
                if !self.unsupported.swap(true, Ordering::Relaxed) {
                    tracing::warn!("prompt cache: {error}; this model's prompts are not saved");
                }
            }
        }
    }
}

impl Drop for PromptCache {
    /// Finish the writes in flight, so that a restart finds them.
    fn drop(&mut self) {
        if let Some((sender, handle)) = self.writer.take() {
            drop(sender);
            let _ = handle.join();
        }
    }
}

/// A block's modification time when it is used or written at `now`: eviction goes by
/// modification time, and a block is worth nothing without the blocks before it, so each is
/// made a microsecond older than the one before (the chain's tail goes first).
fn recency(now: SystemTime, index: usize) -> SystemTime {
    now - Duration::from_micros(index as u64)
}
