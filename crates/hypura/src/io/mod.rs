//! Raw-memory file I/O, the bottom floor: page-aligned buffers, `O_DIRECT` positional reads
//! with page-cache eviction, and the region of address space that mirrors a model file.
//!
//! This is the bottom of the weight-streaming data flow. The streaming store reads tensor bytes
//! from the GGUF file into [`AlignedBuf`]s and its [`Region`] through a [`DirectFile`], so reads
//! bypass the page cache and the memory budget the planner computed is not silently doubled by
//! cached pages; `hw` uses the same calls to measure what the disk delivers. `aligned` holds the
//! buffers, `direct` the files (with the buffered fallback) and page-cache eviction, `region` the
//! mirror of the file that llama.cpp's streamed tensors point into.
//
// Unsafe is needed here, and only here in the crate outside the FFI fence, for what std does not
// offer: heap memory with an alignment chosen at run time (`std::alloc`), `posix_fadvise`, `fcntl`
// to drop `O_DIRECT` from an open file, and the region's mappings (`mmap`, `madvise`, `mremap`).
// Every unsafe block carries its own SAFETY note.
#![allow(unsafe_code)]

mod aligned;
mod direct;
mod region;
#[cfg(test)]
mod test_support;

use std::io;
use std::path::PathBuf;

pub use aligned::{AlignedBuf, DEFAULT_ALIGNMENT_BYTES, MIN_ALIGNMENT_BYTES};
pub use direct::{evict_file, evict_from_page_cache, DirectFile, ReadPath};
pub use region::{huge_interior, Region, HUGE_PAGE_BYTES, PAGE_BYTES};

/// Errors of the raw I/O layer. Every message names the file and, for reads, the offset.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("cannot open {path} for reading: {source}")]
    Open { path: PathBuf, source: io::Error },

    #[error("cannot reserve {len_bytes} bytes of address space for a stream region: {source}")]
    Reserve { len_bytes: u64, source: io::Error },

    #[error("cannot release {len_bytes} bytes at region offset {offset}: {source}")]
    Release { offset: u64, len_bytes: u64, source: io::Error },

    #[error("cannot move {len_bytes} bytes of pages from region offset {from} to {to}: {source}")]
    Move { from: u64, to: u64, len_bytes: u64, source: io::Error },

    #[error("cannot map {len_bytes} bytes of {path} at offset {offset} into a stream region: {source}")]
    Map { path: PathBuf, offset: u64, len_bytes: u64, source: io::Error },

    #[error("cannot read the metadata of {path}: {source}")]
    Metadata { path: PathBuf, source: io::Error },

    #[error("reading {len} bytes at offset {offset} of {path} failed: {source}")]
    Read { path: PathBuf, offset: u64, len: usize, source: io::Error },

    #[error("short read of {path} at offset {offset}: wanted {wanted} bytes, got {got} (end of file)")]
    ShortRead { path: PathBuf, offset: u64, wanted: usize, got: usize },

    #[error(
        "direct read of {path} at offset {offset} ({len} bytes, buffer address {buffer_address:#x}) \
         is not aligned to {alignment_bytes} bytes"
    )]
    Unaligned { path: PathBuf, offset: u64, len: usize, buffer_address: usize, alignment_bytes: u64 },

    #[error("cannot evict {path} from the page cache: {source}")]
    Evict { path: PathBuf, source: io::Error },

    #[error("cannot switch {path} from direct to buffered reads: {source}")]
    SwitchToBuffered { path: PathBuf, source: io::Error },

    #[error(
        "invalid aligned buffer: alignment {alignment_bytes} must be a power of two >= 512, \
         and {len_bytes} bytes rounded up to it must fit in memory"
    )]
    BufferLayout { len_bytes: usize, alignment_bytes: usize },
}
