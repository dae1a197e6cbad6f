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
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use hypura_sys::state::{self, Part, Section, StateError};
use hypura_sys::{Context, Token};
use sha2::{Digest, Sha256};

use super::Engine;
use crate::format::hex;

/// Tokens per block: a 2,500-token system prompt is cached but for the last partial block.
pub const BLOCK_TOKENS: usize = 64;
/// `--prompt-cache-size` when not given.
pub const DEFAULT_MAX_BYTES: u64 = 8 << 30;
const MAGIC: &[u8; 8] = b"HYPKV\0\0\x01";
const BLOCK_EXTENSION: &str = "kv";
const SNAPSHOT_MAGIC: &[u8; 8] = b"HYPSN\0\0\x01";
const SNAPSHOT_EXTENSION: &str = "snap";
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

struct BlockJob {
    saved: Temporary,
    tokens: Vec<Token>,
    chain: Vec<Hash>,
    from_block: usize,
}

enum WriteJob {
    Blocks(BlockJob),
    /// A sequence's state as `Context::sequence_state` copied it, with its tokens.
    Snapshot {
        tokens: Vec<Token>,
        state: Vec<u8>,
    },
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

/// The writer thread's half.
struct Writer {
    root: PathBuf,
    dir: PathBuf,
    digest: Hash,
    max_bytes: u64,
    unsupported: Arc<AtomicBool>,
    pending: Arc<AtomicUsize>,
}

impl Writer {
    fn write(&self, job: WriteJob) {
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
    fn evict(&self) {
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

/// Write into `file` (new and empty) what `body` writes, then a SHA-256 of all of it (blocks
/// and snapshots end so).
fn write_sealed<E: From<std::io::Error>>(
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

struct HashingWriter<W: Write> {
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
fn block_header(digest: &Hash, previous: &Hash, index: usize, tokens: &[Token]) -> Vec<u8> {
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
fn read_block(
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

fn snapshot_path(dir: &Path, digest: &Hash, tokens: &[Token]) -> PathBuf {
    dir.join(format!("{}-{}.{SNAPSHOT_EXTENSION}", tokens.len(), hex(&chain_step(digest, tokens))))
}

/// The lengths of the snapshots in `dir`, from their names.
fn snapshot_lengths(dir: &Path) -> Vec<usize> {
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
fn snapshot_header(digest: &Hash, tokens: &[Token], state_bytes: u64) -> Vec<u8> {
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
fn read_snapshot(
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

/// A block's modification time when it is used or written at `now`: eviction goes by
/// modification time, and a block is worth nothing without the blocks before it, so each is
/// made a microsecond older than the one before (the chain's tail goes first).
fn recency(now: SystemTime, index: usize) -> SystemTime {
    now - Duration::from_micros(index as u64)
}

fn chain_step(previous: &Hash, tokens: &[Token]) -> Hash {
    let mut hasher = Sha256::new();
    hasher.update(previous);
    for token in tokens {
        hasher.update(token.to_le_bytes());
    }
    hasher.finalize().into()
}

/// Everything the KV cache's bits depend on: the model file (its path, size, modification time
/// and first MiB), this build (the executable's size and modification time), the kernels
/// (repacking, batch invariance, the micro-batch), and which tensors compute on a GPU or
/// another machine. Memory budgets and streaming are left out: every mode computes the same
/// bits (the bit-identity tests).
pub fn settings_digest(engine: &Engine) -> Result<Hash, PromptCacheError> {
    let model = &engine.inventory().path;
    let mut hasher = Sha256::new();
    hasher.update(b"hypura prompt cache 1\n");
    let identity = |path: &Path| -> Result<String, PromptCacheError> {
        let canonical = std::fs::canonicalize(path).map_err(io_error(path))?;
        let metadata = std::fs::metadata(&canonical).map_err(io_error(path))?;
        let modified = metadata
            .modified()
            .ok()
            .and_then(|time| time.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |since| since.as_nanos());
        Ok(format!("{} {} {modified}\n", canonical.display(), metadata.len()))
    };
    hasher.update(identity(model)?);
    let mut head = Vec::with_capacity(1 << 20);
    File::open(model).and_then(|file| file.take(1 << 20).read_to_end(&mut head)).map_err(io_error(model))?;
    hasher.update(&head);
    let executable = std::env::current_exe().map_err(io_error(Path::new("the executable")))?;
    hasher.update(identity(&executable)?);
    hasher.update(env!("CARGO_PKG_VERSION"));
    let options = engine.options();
    hasher.update(format!(
        "repacked {} batch_invariant {} n_ubatch {} n_gpu_layers {} kv {} {}\n",
        engine.repacked(),
        options.batch_invariant,
        engine.n_ubatch(),
        if options.plan.is_some() { 0 } else { options.n_gpu_layers },
        options.kv.k,
        options.kv.v,
    ));
    if let Some(plan) = &options.plan {
        for tensor in &plan.tensors {
            if matches!(tensor.tier, crate::plan::Tier::Gpu | crate::plan::Tier::Remote) {
                hasher.update(format!("{} {:?}\n", tensor.name, tensor.tier));
            }
        }
        // The device's expert pool computes its layers' routed experts there.
        if let Some(pool) = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.as_ref()) {
            hasher.update(format!("expert pool {:?}\n", pool.layers));
        }
    }
    Ok(hasher.finalize().into())
}

static TEMPORARY_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A name no other process or call uses: `<dir>/.tmp-<what>-<pid>-<n>`.
fn temporary_path(dir: &Path, what: &str) -> PathBuf {
    let n = TEMPORARY_COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("{TEMPORARY_PREFIX}{what}-{}-{n}", std::process::id()))
}

const TEMPORARY_PREFIX: &str = ".tmp-";

/// A temporary file of this process's, locked (`flock`) for as long as it lives and removed
/// when dropped, unless `persist` renamed it into place. The lock tells a start that a live
/// process is writing the file; the kernel drops it with the process, however it ends.
#[derive(Debug)]
struct Temporary {
    path: PathBuf,
    file: File,
}

impl Temporary {
    fn create(dir: &Path, what: &str) -> std::io::Result<Temporary> {
        use std::os::unix::fs::MetadataExt;
        loop {
            let path = temporary_path(dir, what);
            let file = File::options().read(true).write(true).create_new(true).open(&path)?;
            file.lock()?;
            // A start's sweep may have taken the file between its creation and the lock: then
            // the name is gone (or another file's), and a new name is tried.
            let (ours, named) = (file.metadata()?, std::fs::metadata(&path));
            if named.is_ok_and(|named| named.ino() == ours.ino() && named.dev() == ours.dev()) {
                return Ok(Temporary { path, file });
            }
        }
    }

    /// Rename the file to `path`; it is no longer removed when dropped.
    fn persist(mut self, path: &Path) -> std::io::Result<()> {
        std::fs::rename(&self.path, path)?;
        // The name is gone: nothing is left to remove, and the lock goes with the file.
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Remove the temporary files in `root` that no live process holds, and say so.
fn sweep(root: &Path) {
    let removed = remove_stale_temporaries(root);
    if removed > 0 {
        tracing::info!("prompt cache: {removed} temporary file(s) that no running process writes removed");
    }
}

/// Remove the temporary files in `root` that no live process holds (see `Temporary`); returns
/// how many.
fn remove_stale_temporaries(root: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(root) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(TEMPORARY_PREFIX) {
            continue;
        }
        let Ok(file) = File::open(entry.path()) else { continue };
        // Held: its writer lives. Taken: nobody writes it, and holding the lock while removing
        // it keeps a writer that just created the name from believing it still has it.
        if file.try_lock().is_ok() && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}
