//! Raw-memory file I/O: page-aligned buffers, `O_DIRECT` positional reads and page-cache eviction.
//!
//! This is the bottom of the weight-streaming data flow. The streaming store reads tensor bytes
//! from the GGUF file into [`AlignedBuf`]s through a [`DirectFile`], so reads bypass the page cache
//! and the memory budget the planner computed is not silently doubled by cached pages; `hw` uses
//! the same calls to measure what the disk delivers. Filesystems that refuse `O_DIRECT` (older
//! tmpfs, procfs, some network filesystems) fall back to buffered reads, and the fallback is
//! recorded in [`DirectFile::read_path`] so reports can say which path a figure came from.
//
// Unsafe is needed here, and only here in the crate, for three things std does not offer: heap
// memory with an alignment chosen at run time (`std::alloc`), `posix_fadvise`, and `fcntl` to drop
// `O_DIRECT` from an open file. Every unsafe block carries its own SAFETY note.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use serde::{Deserialize, Serialize};

/// Alignment that satisfies `O_DIRECT` on every common Linux block device: logical block sizes
/// are 512 or 4096 bytes, and the page size is 4096.
pub const DEFAULT_ALIGNMENT_BYTES: usize = 4096;

/// The smallest alignment `O_DIRECT` can ever accept (one 512-byte sector).
pub const MIN_ALIGNMENT_BYTES: usize = 512;

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

/// A zero-initialised heap buffer whose start address and length are multiples of its alignment,
/// as `O_DIRECT` requires. Freed on drop.
pub struct AlignedBuf {
    pointer: NonNull<u8>,
    /// The usable length: the requested length rounded up to the alignment.
    len_bytes: usize,
    /// The layout actually allocated; never zero-sized (see `with_alignment`).
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>); nothing else holds the
// pointer, so moving it to another thread or sharing `&AlignedBuf` (read-only slice access) is as
// safe as it is for Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send above; `&AlignedBuf` only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len_bytes`, aligned to [`DEFAULT_ALIGNMENT_BYTES`].
    pub fn new(len_bytes: usize) -> AlignedBuf {
        match AlignedBuf::with_alignment(len_bytes, DEFAULT_ALIGNMENT_BYTES) {
            Ok(buffer) => buffer,
            // The alignment is valid, so only a length near usize::MAX can fail; that is a caller
            // bug of the same kind as `vec![0; usize::MAX]`.
            Err(error) => panic!("{error}"),
        }
    }

    /// A zeroed buffer of `len_bytes` rounded up to `alignment_bytes` (a power of two >= 512).
    pub fn with_alignment(len_bytes: usize, alignment_bytes: usize) -> Result<AlignedBuf, IoError> {
        let layout_error = || IoError::BufferLayout { len_bytes, alignment_bytes };
        if !alignment_bytes.is_power_of_two() || alignment_bytes < MIN_ALIGNMENT_BYTES {
            return Err(layout_error());
        }
        let rounded_bytes = len_bytes.checked_next_multiple_of(alignment_bytes).ok_or_else(layout_error)?;
        // A zero-sized allocation is undefined behaviour for `alloc_zeroed`, so an empty buffer
        // still owns one alignment unit; `len()` reports 0.
        let allocated_bytes = rounded_bytes.max(alignment_bytes);
        let layout = Layout::from_size_align(allocated_bytes, alignment_bytes).map_err(|_| layout_error())?;
        // SAFETY: `layout` has a non-zero size (at least one alignment unit) and a valid
        // power-of-two alignment, which is all `alloc_zeroed` requires.
        let raw_pointer = unsafe { alloc::alloc_zeroed(layout) };
        let Some(pointer) = NonNull::new(raw_pointer) else {
            alloc::handle_alloc_error(layout);
        };
        Ok(AlignedBuf { pointer, len_bytes: rounded_bytes, layout })
    }

    /// Length in bytes (the requested length rounded up to the alignment).
    pub fn len(&self) -> usize {
        self.len_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// The alignment of the start address and of the length, in bytes.
    pub fn alignment_bytes(&self) -> usize {
        self.layout.align()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `pointer` is a live allocation of `layout.size() >= len_bytes` bytes, zeroed at
        // allocation so every byte is initialised; it stays valid until `drop`, which cannot run
        // while the returned borrow of `self` exists.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.len_bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` guarantees this is the only live slice, and the
        // allocation outlives the borrow.
        unsafe { std::slice::from_raw_parts_mut(self.pointer.as_ptr(), self.len_bytes) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `pointer` came from `alloc_zeroed(self.layout)` and is freed exactly once, here.
        unsafe { alloc::dealloc(self.pointer.as_ptr(), self.layout) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("AlignedBuf").field("len_bytes", &self.len_bytes).field("alignment_bytes", &self.layout.align()).finish()
    }
}

/// How a [`DirectFile`] actually reads: bypassing the page cache, or through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadPath {
    Direct,
    Buffered,
}

impl fmt::Display for ReadPath {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            ReadPath::Direct => "direct",
            ReadPath::Buffered => "buffered",
        })
    }
}

// `ReadPath` stored in an atomic, because a direct read that fails with EINVAL at run time
// switches the file to buffered while other threads may be reading through `&DirectFile`.
const PATH_DIRECT: u8 = 0;
const PATH_BUFFERED: u8 = 1;

/// A read-only file for positional reads, opened with `O_DIRECT` where the filesystem allows it.
///
/// `read_exact_at` takes `&self`, so one `DirectFile` can serve many reader threads at once.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    path: PathBuf,
    /// `PATH_DIRECT` or `PATH_BUFFERED`; only ever moves from direct to buffered.
    path_kind: AtomicU8,
    alignment_bytes: u64,
    /// File length at open time; model files are not modified while we read them.
    len_bytes: u64,
    /// Test hook: make the next direct `pread` fail with EINVAL, as a filesystem that accepts
    /// `O_DIRECT` at open but not at read time would.
    #[cfg(test)]
    inject_direct_einval: std::sync::atomic::AtomicBool,
}

impl DirectFile {
    /// Open read-only with `O_DIRECT`. If the filesystem refuses `O_DIRECT` (EINVAL), open buffered
    /// instead and record [`ReadPath::Buffered`]. Never opens for writing.
    pub fn open(path: &Path) -> Result<DirectFile, IoError> {
        match OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            Ok(file) => DirectFile::from_file(file, path, ReadPath::Direct),
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(
                    path = %path.display(),
                    "filesystem refuses O_DIRECT; reading through the page cache instead"
                );
                DirectFile::open_buffered(path)
            }
            Err(source) => Err(IoError::Open { path: path.to_path_buf(), source }),
        }
    }

    /// Open read-only through the page cache (no alignment rules).
    pub fn open_buffered(path: &Path) -> Result<DirectFile, IoError> {
        let file = OpenOptions::new().read(true).open(path).map_err(|source| IoError::Open { path: path.to_path_buf(), source })?;
        DirectFile::from_file(file, path, ReadPath::Buffered)
    }

    fn from_file(file: File, path: &Path, read_path: ReadPath) -> Result<DirectFile, IoError> {
        let metadata = file.metadata().map_err(|source| IoError::Metadata { path: path.to_path_buf(), source })?;
        Ok(DirectFile {
            file,
            path: path.to_path_buf(),
            path_kind: AtomicU8::new(match read_path {
                ReadPath::Direct => PATH_DIRECT,
                ReadPath::Buffered => PATH_BUFFERED,
            }),
            alignment_bytes: DEFAULT_ALIGNMENT_BYTES as u64,
            len_bytes: metadata.len(),
            #[cfg(test)]
            inject_direct_einval: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// File length in bytes, as of `open`.
    pub fn len(&self) -> u64 {
        self.len_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which path reads take now. Moves from `Direct` to `Buffered` if a direct read hit EINVAL.
    pub fn read_path(&self) -> ReadPath {
        match self.path_kind.load(Ordering::Relaxed) {
            PATH_DIRECT => ReadPath::Direct,
            _ => ReadPath::Buffered,
        }
    }

    /// The alignment that offsets, lengths and buffer addresses need while the path is direct.
    pub fn alignment_bytes(&self) -> u64 {
        self.alignment_bytes
    }

    /// The underlying file, e.g. for [`evict_file`].
    pub fn as_file(&self) -> &File {
        &self.file
    }

    /// Fill `buffer` from `offset`. Reaching end of file first is [`IoError::ShortRead`].
    /// On the direct path, `offset`, `buffer.len()` and the buffer address must be multiples of
    /// [`alignment_bytes`](Self::alignment_bytes) (use an [`AlignedBuf`]), else [`IoError::Unaligned`].
    pub fn read_exact_at(&self, buffer: &mut [u8], offset: u64) -> Result<(), IoError> {
        let wanted = buffer.len();
        let got = self.read_at(buffer, offset)?;
        if got < wanted {
            return Err(IoError::ShortRead { path: self.path.clone(), offset, wanted, got });
        }
        Ok(())
    }

    /// Like [`read_exact_at`](Self::read_exact_at), but stopping at end of file and returning the
    /// number of bytes read. The streaming store uses it for a file's last, partial block: a
    /// direct read must be a whole number of aligned blocks, even past the end.
    pub fn read_at(&self, buffer: &mut [u8], offset: u64) -> Result<usize, IoError> {
        if self.read_path() == ReadPath::Direct {
            self.check_alignment(buffer, offset)?;
        }
        let mut filled = 0usize;
        while filled < buffer.len() {
            let position = offset + filled as u64;
            match self.pread(&mut buffer[filled..], position) {
                Ok(0) => break,
                Ok(count) => filled += count,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) && self.read_path() == ReadPath::Direct => {
                    // The filesystem accepted O_DIRECT at open but refuses this read (e.g. a device
                    // with a logical block larger than our alignment). Buffered reads still work.
                    self.switch_to_buffered(position)?;
                }
                Err(source) => return Err(IoError::Read { path: self.path.clone(), offset: position, len: buffer.len() - filled, source }),
            }
        }
        Ok(filled)
    }

    fn pread(&self, buffer: &mut [u8], offset: u64) -> io::Result<usize> {
        #[cfg(test)]
        if self.read_path() == ReadPath::Direct && self.inject_direct_einval.swap(false, Ordering::Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.file.read_at(buffer, offset)
    }

    fn check_alignment(&self, buffer: &[u8], offset: u64) -> Result<(), IoError> {
        let alignment = self.alignment_bytes;
        let buffer_address = buffer.as_ptr() as usize;
        // The alignment is a power of two, so the low bits below it must all be zero.
        let misaligned = |value: u64| value & (alignment - 1) != 0;
        if misaligned(offset) || misaligned(buffer.len() as u64) || misaligned(buffer_address as u64) {
            return Err(IoError::Unaligned { path: self.path.clone(), offset, len: buffer.len(), buffer_address, alignment_bytes: alignment });
        }
        Ok(())
    }

    /// Clear `O_DIRECT` on the open file description and record the buffered path for the rest of
    /// this file's life. Idempotent, so racing reader threads may all call it.
    fn switch_to_buffered(&self, offset: u64) -> Result<(), IoError> {
        let descriptor = self.file.as_raw_fd();
        let switch_error = |source| IoError::SwitchToBuffered { path: self.path.clone(), source };
        // SAFETY: `descriptor` belongs to `self.file`, which is open for as long as `&self` lives;
        // F_GETFL reads only the descriptor's status flags.
        let flags = unsafe { libc::fcntl(descriptor, libc::F_GETFL) };
        if flags < 0 {
            return Err(switch_error(io::Error::last_os_error()));
        }
        // SAFETY: same descriptor, still open; F_SETFL only changes status flags, and clearing
        // O_DIRECT cannot invalidate any buffer or read in flight on other threads.
        if unsafe { libc::fcntl(descriptor, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
            return Err(switch_error(io::Error::last_os_error()));
        }
        if self.path_kind.compare_exchange(PATH_DIRECT, PATH_BUFFERED, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            tracing::warn!(
                path = %self.path.display(),
                offset,
                "direct read failed with EINVAL; reading this file through the page cache from now on"
            );
        }
        Ok(())
    }
}

/// A fixed range of address space that mirrors a model file: byte `o` of the file lives at
/// `address() + o`. It is reserved with `MAP_NORESERVE`, so only pages the store reads into are
/// ever backed by memory, and [`Region::release`] gives them back with `MADV_DONTNEED`.
///
/// The stream buffer type points llama.cpp's streamed tensors into this range, so the addresses
/// stay fixed for the life of the model: the store never rewrites a tensor pointer.
pub struct Region {
    base: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: the region is plain anonymous memory; who may touch which bytes when is governed by
// the store's slice state machine, not by this type.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

/// The page size the region's bookkeeping assumes (Linux on x86-64 and arm64 default).
pub const PAGE_BYTES: u64 = 4096;

/// A transparent huge page (x86-64 and arm64 with 4 KiB pages), aligned in the address space.
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;

/// The whole huge pages inside `range` of a region that starts `phase` bytes past a huge-page
/// boundary (`Region::huge_phase`), as region offsets; empty where there is none.
pub fn huge_interior(range: &std::ops::Range<u64>, phase: u64) -> std::ops::Range<u64> {
    let start = (range.start + phase).next_multiple_of(HUGE_PAGE_BYTES) - phase;
    let end = ((range.end + phase) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES).saturating_sub(phase);
    start..end.max(start)
}

impl Region {
    /// Reserve `len_bytes` (rounded up to a page) of address space. No memory is committed.
    ///
    /// `huge_pages` asks for transparent huge pages: a streamed dense layer is tens of MB, and
    /// faulting it in 2 MiB pages instead of 4 KiB ones cuts page faults 512-fold (it doubled
    /// dense-stream throughput here). Small units (experts of a few MB) should not: a unit
    /// boundary inside a huge page backs the whole 2 MiB, inflating memory beyond the budget.
    pub fn reserve(len_bytes: u64, huge_pages: bool) -> Result<Region, IoError> {
        let len_bytes = usize::try_from(len_bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES).map_err(|_| IoError::BufferLayout { len_bytes: usize::MAX, alignment_bytes: PAGE_BYTES as usize })?;
        // SAFETY: an anonymous private mapping with no address hint; the kernel picks a free
        // range or fails. We own the mapping until Drop unmaps it.
        let pointer = unsafe { libc::mmap(std::ptr::null_mut(), len_bytes.max(1), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0) };
        if pointer == libc::MAP_FAILED {
            return Err(IoError::Reserve { len_bytes: len_bytes as u64, source: io::Error::last_os_error() });
        }
        let base = NonNull::new(pointer as *mut u8).expect("mmap returned a non-null mapping");
        let advice = if huge_pages { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
        // SAFETY: advice on our own fresh mapping, whole range. Advisory: failure changes nothing.
        unsafe { libc::madvise(pointer, len_bytes.max(1), advice) };
        Ok(Region { base, len_bytes })
    }

    /// Let the kernel back the 2 MiB-aligned interior of `range` with transparent huge pages
    /// (for a region reserved without them). The pages at the range's edges stay 4 KiB, so no
    /// huge page reaches into a neighbouring unit and memory use stays exactly the unit's.
    /// Advisory: returns whether there was an interior and the kernel took the advice.
    pub fn advise_huge_interior(&self, range: std::ops::Range<u64>) -> bool {
        let inner = huge_interior(&(range.start..range.end.min(self.len_bytes as u64)), self.huge_phase());
        if inner.is_empty() {
            return false;
        }
        // SAFETY: `inner` lies within `range` clamped to the region's length, and is not
        // empty, so it is inside our own live mapping; madvise only changes how future faults
        // are served.
        unsafe { libc::madvise(self.base.as_ptr().add(inner.start as usize).cast(), (inner.end - inner.start) as usize, libc::MADV_HUGEPAGE) == 0 }
    }

    /// The start of the range, as a number (handed to the stream buffer type).
    pub fn address(&self) -> usize {
        self.base.as_ptr() as usize
    }

    /// How far past a huge-page boundary of the address space the region starts: offset `o`
    /// lies on a boundary when `(o + phase) % HUGE_PAGE_BYTES == 0`.
    pub fn huge_phase(&self) -> u64 {
        self.address() as u64 % HUGE_PAGE_BYTES
    }

    pub fn len(&self) -> usize {
        self.len_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// Whether `address .. address + len` lies inside the region.
    pub fn contains(&self, address: usize, len: usize) -> bool {
        address >= self.address() && address.checked_add(len).is_some_and(|end| end <= self.address() + self.len_bytes)
    }

    /// Read the file bytes `range` into their mirror position. The read covers whole pages
    /// (direct I/O needs them), so it also rewrites neighbouring bytes of the same pages with
    /// their own file contents, which is harmless: every byte of the region only ever holds
    /// its file byte or nothing.
    ///
    /// The caller must ensure no compute reads these pages while they are being written (the
    /// store's state machine: a slice is `Loading` until this returns).
    pub fn read_in(&self, file: &DirectFile, range: std::ops::Range<u64>) -> Result<u64, IoError> {
        self.read_in_shifted(file, range, 0)
    }

    /// `read_in`, to region offset `range.start + shift` instead of the mirror position (a unit
    /// in a reused slot); `shift` is a page multiple, so the read stays page-aligned.
    pub fn read_in_shifted(&self, file: &DirectFile, range: std::ops::Range<u64>, shift: u64) -> Result<u64, IoError> {
        debug_assert_eq!(shift % PAGE_BYTES, 0, "a shift must keep the page phase");
        let start = range.start / PAGE_BYTES * PAGE_BYTES;
        let end = range.end.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let span = start..end.min(file.len().div_ceil(PAGE_BYTES) * PAGE_BYTES).min((self.len_bytes as u64).saturating_sub(shift));
        if span.start >= span.end {
            return Ok(0);
        }
        let len = (span.end - span.start) as usize;
        // SAFETY: `span + shift` is inside the region (clamped above) and the mapping lives as
        // long as `self`. Writers of these pages are serialised by the store's state machine
        // (documented contract above), and no Rust reference into the region outlives a call.
        let target = unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add((span.start + shift) as usize), len) };
        let available = file.len().saturating_sub(span.start);
        let read = file.read_at(target, span.start)?;
        if (read as u64) < (len as u64).min(available) {
            return Err(IoError::ShortRead { path: file.path().to_path_buf(), offset: span.start, wanted: len, got: read });
        }
        Ok(read as u64)
    }

    /// The pages wholly inside `range` (and inside the region): the ones no neighbouring byte
    /// shares. Empty when there are none.
    pub fn interior(&self, range: std::ops::Range<u64>) -> std::ops::Range<u64> {
        let start = range.start.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let end = (range.end / PAGE_BYTES * PAGE_BYTES).min(self.len_bytes as u64);
        start..end.max(start)
    }

    /// Give the pages wholly inside `range` back to the kernel; they read as zeros afterwards.
    /// Pages shared with bytes outside `range` are kept (a neighbour may still need them).
    pub fn release(&self, range: std::ops::Range<u64>) -> Result<(), IoError> {
        let std::ops::Range { start, end } = self.interior(range);
        if start >= end {
            return Ok(());
        }
        // SAFETY: the page-aligned range lies inside our mapping; MADV_DONTNEED on a private
        // anonymous mapping only drops contents (they read back as zeros), which the state
        // machine allows because the slice is `Evicting` and no compute reads it.
        let status = unsafe { libc::madvise(self.base.as_ptr().add(start as usize).cast(), (end - start) as usize, libc::MADV_DONTNEED) };
        if status != 0 {
            return Err(IoError::Release { offset: start, len_bytes: end - start, source: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Move the pages backing `from .. from + len` to `to .. to + len` without copying or
    /// zeroing them (`mremap` with `MREMAP_DONTUNMAP`): the destination holds the source's
    /// bytes, whatever it held is dropped, and the source reads as zeros afterwards. Both
    /// ranges are page-aligned, disjoint and inside the region. A unit read into moved pages
    /// costs no page faults and no zeroing, which for expert streaming is most of the CPU that
    /// reading costs beyond the copy (the kernel zeroes every freshly faulted page).
    ///
    /// The caller must ensure no compute or read touches either range during the move (the
    /// store moves pages only from a released unit into a chunk its reader is about to read).
    /// Older kernels want the source in one mapping (`EFAULT` otherwise; pages moved in by
    /// earlier moves form mappings of their own); 6.18 moves across mappings.
    pub fn move_pages(&self, from: u64, to: u64, len: u64) -> Result<(), IoError> {
        let region = self.len_bytes as u64;
        assert!(from.is_multiple_of(PAGE_BYTES) && to.is_multiple_of(PAGE_BYTES) && len.is_multiple_of(PAGE_BYTES), "page moves are page-aligned");
        assert!(from + len <= region && to + len <= region, "page moves stay inside the region");
        assert!(from + len <= to || to + len <= from, "page moves do not overlap");
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are page-aligned, disjoint and inside our live private anonymous
        // mapping (asserted above). MREMAP_FIXED replaces only pages of this region at `to`,
        // and MREMAP_DONTUNMAP leaves `from` mapped (empty, zero-filled on the next fault), so
        // no address of the region ever becomes unmapped. Nobody reads or writes either range
        // meanwhile (the caller's contract).
        let moved = unsafe {
            let base = self.base.as_ptr();
            libc::mremap(base.add(from as usize).cast(), len as usize, len as usize, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP, base.add(to as usize).cast::<libc::c_void>())
        };
        if moved == libc::MAP_FAILED {
            return Err(IoError::Move { from, to, len_bytes: len, source: io::Error::last_os_error() });
        }
        Ok(())
    }

    /// Back `range` with the file's own pages: the pages wholly inside it become a read-only
    /// private mapping of the same file offsets (page cache, which the kernel reclaims under
    /// pressure and faults back in on use, so it takes no budget), and the partial pages at its
    /// edges, which neighbours share, are read in as `read_in` does. For tables read a few rows
    /// at a time (the token embedding). The range must never be released or read into again.
    pub fn map_file(&self, file: &File, direct: &DirectFile, range: std::ops::Range<u64>) -> Result<(), IoError> {
        let inner = range.start.div_ceil(PAGE_BYTES) * PAGE_BYTES..(range.end / PAGE_BYTES * PAGE_BYTES).min(self.len_bytes as u64);
        if inner.start >= inner.end {
            return self.read_in(direct, range).map(|_| ());
        }
        let len = (inner.end - inner.start) as usize;
        // SAFETY: `inner` is page-aligned and inside our live mapping (clamped above), so
        // MAP_FIXED replaces only pages of this region, which no compute reads yet (load time);
        // the file offset equals the region offset, as the mirror requires, and is page-aligned.
        let pointer =
            unsafe { libc::mmap(self.base.as_ptr().add(inner.start as usize).cast(), len, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_FIXED, file.as_raw_fd(), inner.start as libc::off_t) };
        if pointer == libc::MAP_FAILED {
            return Err(IoError::Map { path: direct.path().to_path_buf(), offset: inner.start, len_bytes: len as u64, source: io::Error::last_os_error() });
        }
        if range.start < inner.start {
            self.read_in(direct, range.start..inner.start)?;
        }
        if inner.end < range.end {
            self.read_in(direct, inner.end..range.end)?;
        }
        Ok(())
    }

    /// A copy of the bytes at `range` (tests and checksums).
    pub fn copy_out(&self, range: std::ops::Range<u64>) -> Vec<u8> {
        assert!(range.end as usize <= self.len_bytes && range.start <= range.end, "range {range:?} outside the region");
        // SAFETY: the range was checked to lie inside the live mapping; we copy it out at once.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(range.start as usize), (range.end - range.start) as usize) }.to_vec()
    }

    /// Copy `source` into the region at `offset`, bypassing the file (load-time fills of small
    /// edge pieces). Same contract as `read_in`.
    pub fn write(&self, offset: u64, source: &[u8]) {
        assert!(offset as usize + source.len() <= self.len_bytes, "write outside the region");
        // SAFETY: checked to lie inside the mapping; writers are serialised by the store.
        unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), self.base.as_ptr().add(offset as usize), source.len()) };
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `reserve`, once. The engine drops the
        // model (whose tensors point here) before the region.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes.max(1)) };
    }
}

/// Drop the cached pages of the file at `path`, so the next read comes from the device.
/// Opens read-only; model files are never written, so there are no dirty pages to flush first.
pub fn evict_from_page_cache(path: &Path) -> Result<(), IoError> {
    let file = File::open(path).map_err(|source| IoError::Open { path: path.to_path_buf(), source })?;
    advise_dont_need(&file).map_err(|source| IoError::Evict { path: path.to_path_buf(), source })
}

/// Drop the cached pages of an open file. `POSIX_FADV_DONTNEED` skips dirty pages, so for a file
/// this process wrote, call `file.sync_all()` first.
pub fn evict_file(file: &File) -> Result<(), IoError> {
    advise_dont_need(file).map_err(|source| IoError::Evict { path: describe_descriptor(file), source })
}

fn advise_dont_need(file: &File) -> io::Result<()> {
    // SAFETY: the descriptor belongs to `file`, borrowed and therefore open for the whole call;
    // offset 0 with length 0 means "to the end of the file"; fadvise touches no user memory.
    let status = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    // posix_fadvise returns the error number instead of setting errno.
    if status != 0 {
        return Err(io::Error::from_raw_os_error(status));
    }
    Ok(())
}

/// A path for error messages about a bare `File`: where /proc says it points, else its descriptor.
fn describe_descriptor(file: &File) -> PathBuf {
    let descriptor = file.as_raw_fd();
    std::fs::read_link(format!("/proc/self/fd/{descriptor}")).unwrap_or_else(|_| PathBuf::from(format!("<file descriptor {descriptor}>")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A directory on the disk the build lives on (next to the test binary, inside the ignored
    /// target directory), because /tmp may be tmpfs, where O_DIRECT behaves differently.
    fn disk_test_directory() -> tempfile::TempDir {
        let executable = std::env::current_exe().expect("test binary path");
        let directory = executable.parent().expect("test binary directory");
        tempfile::Builder::new().prefix(".hypura-io-test-").tempdir_in(directory).expect("create a test directory on the build disk")
    }

    /// Bytes that differ at every offset, so a read from the wrong offset cannot pass.
    fn patterned_bytes(len: usize) -> Vec<u8> {
        (0..len).map(|index| ((index * 7 + index / 4096) % 251) as u8).collect()
    }

    fn write_file(directory: &Path, name: &str, contents: &[u8]) -> PathBuf {
        let path = directory.join(name);
        let mut file = File::create(&path).unwrap();
        file.write_all(contents).unwrap();
        file.sync_all().unwrap();
        path
    }

    #[test]
    fn aligned_buffer_is_aligned_rounded_and_zeroed() {
        for alignment in [512usize, 4096, 65536] {
            for requested in [0usize, 1, 511, 4096, 10_000] {
                let buffer = AlignedBuf::with_alignment(requested, alignment).unwrap();
                assert_eq!(buffer.as_slice().as_ptr() as usize % alignment, 0);
                assert_eq!(buffer.len() % alignment, 0);
                assert!(buffer.len() >= requested && buffer.len() < requested + alignment);
                assert!(buffer.as_slice().iter().all(|&byte| byte == 0));
            }
        }
        let mut buffer = AlignedBuf::new(5000);
        assert_eq!(buffer.len(), 8192);
        assert_eq!(buffer.alignment_bytes(), DEFAULT_ALIGNMENT_BYTES);
        buffer.as_mut_slice()[8191] = 9;
        assert_eq!(buffer.as_slice()[8191], 9);
    }

    #[test]
    fn aligned_buffer_rejects_bad_alignment() {
        for alignment in [0usize, 256, 3000, 4097] {
            assert!(matches!(AlignedBuf::with_alignment(4096, alignment), Err(IoError::BufferLayout { .. })));
        }
        assert!(AlignedBuf::with_alignment(usize::MAX - 10, 4096).is_err());
    }

    /// A mapped table reads as the file at every byte, edges included, and a neighbour's
    /// release leaves it whole.
    #[test]
    fn a_range_mapped_from_the_file_reads_as_the_file() {
        let directory = disk_test_directory();
        let contents = patterned_bytes(40 * 4096 + 123);
        let path = write_file(directory.path(), "model.bin", &contents);
        let direct = DirectFile::open(&path).unwrap();
        let plain = File::open(&path).unwrap();
        let region = Region::reserve(contents.len() as u64, false).unwrap();
        // Unaligned at both ends, as tensors are; a neighbour shares each edge page.
        let table = 5000u64..30 * 4096 + 77;
        region.map_file(&plain, &direct, table.clone()).unwrap();
        assert_eq!(region.copy_out(table.clone()), contents[table.start as usize..table.end as usize]);
        region.read_in(&direct, 30 * 4096 + 77..40 * 4096).unwrap();
        region.release(30 * 4096 + 77..40 * 4096).unwrap();
        region.release(0..5000).unwrap();
        assert_eq!(region.copy_out(table.clone()), contents[table.start as usize..table.end as usize]);
        // A table inside one page is read in.
        region.map_file(&plain, &direct, 40 * 4096 + 3..40 * 4096 + 100).unwrap();
        assert_eq!(region.copy_out(40 * 4096 + 3..40 * 4096 + 100), contents[40 * 4096 + 3..40 * 4096 + 100]);
    }

    #[test]
    fn read_path_serialises_lowercase() {
        assert_eq!(serde_json::to_string(&ReadPath::Direct).unwrap(), "\"direct\"");
        assert_eq!(serde_json::from_str::<ReadPath>("\"buffered\"").unwrap(), ReadPath::Buffered);
    }

    fn assert_reads_match(file: &DirectFile, expected: &[u8]) {
        let mut buffer = AlignedBuf::new(3 * 4096);
        for offset in [0u64, 4096, 8192 * 3, 65536] {
            file.read_exact_at(buffer.as_mut_slice(), offset).unwrap();
            let start = offset as usize;
            assert_eq!(buffer.as_slice(), &expected[start..start + buffer.len()], "offset {offset}");
        }
    }

    #[test]
    fn direct_and_buffered_reads_return_the_file_bytes() {
        let directory = disk_test_directory();
        let path = write_file(directory.path(), "data.bin", &patterned_bytes(1 << 20));
        let expected = std::fs::read(&path).unwrap();

        let direct = DirectFile::open(&path).unwrap();
        assert_eq!(direct.read_path(), ReadPath::Direct, "the build disk should support O_DIRECT");
        assert_eq!(direct.len(), 1 << 20);
        evict_from_page_cache(&path).unwrap();
        assert_reads_match(&direct, &expected);

        let buffered = DirectFile::open_buffered(&path).unwrap();
        assert_eq!(buffered.read_path(), ReadPath::Buffered);
        assert_reads_match(&buffered, &expected);
        // Buffered reads have no alignment rules.
        let mut odd = vec![0u8; 1001];
        buffered.read_exact_at(&mut odd, 12_345).unwrap();
        assert_eq!(odd, &expected[12_345..13_346]);
    }

    #[test]
    fn reading_past_the_end_is_a_short_read() {
        let directory = disk_test_directory();
        // Not a multiple of the alignment, like a real GGUF file's tail.
        let path = write_file(directory.path(), "tail.bin", &patterned_bytes(10_000));
        let expected = std::fs::read(&path).unwrap();
        for file in [DirectFile::open(&path).unwrap(), DirectFile::open_buffered(&path).unwrap()] {
            let mut buffer = AlignedBuf::new(4096);
            match file.read_exact_at(buffer.as_mut_slice(), 8192) {
                Err(IoError::ShortRead { offset, wanted, got, .. }) => {
                    assert_eq!((offset, wanted, got), (8192, 4096, 10_000 - 8192));
                }
                other => panic!("expected ShortRead from {:?} path, got {other:?}", file.read_path()),
            }
            // read_at returns the partial tail instead.
            let got = file.read_at(buffer.as_mut_slice(), 8192).unwrap();
            assert_eq!(&buffer.as_slice()[..got], &expected[8192..]);
            assert!(matches!(file.read_exact_at(buffer.as_mut_slice(), 16384), Err(IoError::ShortRead { got: 0, .. })));
        }
    }

    #[test]
    fn unaligned_direct_read_is_refused() {
        let directory = disk_test_directory();
        let path = write_file(directory.path(), "data.bin", &patterned_bytes(65536));
        let file = DirectFile::open(&path).unwrap();
        assert_eq!(file.read_path(), ReadPath::Direct);
        let mut buffer = AlignedBuf::new(8192);
        // Unaligned offset, unaligned length, unaligned address.
        assert!(matches!(file.read_exact_at(buffer.as_mut_slice(), 100), Err(IoError::Unaligned { offset: 100, .. })));
        assert!(matches!(file.read_exact_at(&mut buffer.as_mut_slice()[..1000], 0), Err(IoError::Unaligned { len: 1000, .. })));
        assert!(matches!(file.read_exact_at(&mut buffer.as_mut_slice()[512..4608], 0), Err(IoError::Unaligned { .. })));
        // A refused read does not switch the file to buffered.
        assert_eq!(file.read_path(), ReadPath::Direct);
    }

    #[test]
    fn filesystem_refusing_o_direct_falls_back_to_buffered() {
        // procfs refuses O_DIRECT at open with EINVAL, on every kernel.
        let path = Path::new("/proc/self/mountinfo");
        let file = DirectFile::open(path).unwrap();
        assert_eq!(file.read_path(), ReadPath::Buffered);
        let mut buffer = vec![0u8; 16];
        file.read_exact_at(&mut buffer, 0).unwrap();
        // Every mountinfo line starts with a mount id, so the first byte is a digit.
        assert!(buffer[0].is_ascii_digit(), "{buffer:?}");
    }

    #[test]
    fn tmpfs_reads_are_correct_and_the_path_matches_what_the_kernel_allows() {
        let shared_memory = Path::new("/dev/shm");
        if !shared_memory.is_dir() {
            eprintln!("skipped: no /dev/shm");
            return;
        }
        let directory = tempfile::tempdir_in(shared_memory).unwrap();
        let path = write_file(directory.path(), "data.bin", &patterned_bytes(1 << 20));
        let expected = std::fs::read(&path).unwrap();
        // tmpfs refused O_DIRECT before Linux 6.6 and accepts it since; ask the kernel directly.
        let kernel_accepts_direct = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path).is_ok();
        let file = DirectFile::open(&path).unwrap();
        let expected_path = if kernel_accepts_direct { ReadPath::Direct } else { ReadPath::Buffered };
        assert_eq!(file.read_path(), expected_path);
        evict_from_page_cache(&path).unwrap();
        assert_reads_match(&file, &expected);
    }

    #[test]
    fn einval_from_a_direct_read_switches_to_buffered_for_good() {
        let directory = disk_test_directory();
        let path = write_file(directory.path(), "data.bin", &patterned_bytes(1 << 20));
        let expected = std::fs::read(&path).unwrap();
        let file = DirectFile::open(&path).unwrap();
        assert_eq!(file.read_path(), ReadPath::Direct);
        file.inject_direct_einval.store(true, Ordering::Relaxed);
        assert_reads_match(&file, &expected);
        assert_eq!(file.read_path(), ReadPath::Buffered);
        // The descriptor really lost O_DIRECT: an unaligned read now succeeds.
        let mut odd = vec![0u8; 777];
        file.read_exact_at(&mut odd, 4097).unwrap();
        assert_eq!(odd, &expected[4097..4097 + 777]);
    }

    /// How many of the file's pages are in the page cache, via mmap + mincore.
    fn resident_pages(path: &Path) -> usize {
        let file = File::open(path).unwrap();
        let len = file.metadata().unwrap().len() as usize;
        let page_bytes = 4096;
        // SAFETY: a fresh read-only shared mapping of a file we keep open for the call; the
        // kernel picks the address. Mapping does not fault pages in, so it does not change the
        // residency we measure.
        let mapping = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        assert_ne!(mapping, libc::MAP_FAILED, "{}", io::Error::last_os_error());
        let mut residency = vec![0u8; len.div_ceil(page_bytes)];
        // SAFETY: `mapping` is the page-aligned start of a live mapping of `len` bytes, and
        // `residency` has one byte per page of it, as mincore requires.
        let status = unsafe { libc::mincore(mapping, len, residency.as_mut_ptr()) };
        assert_eq!(status, 0, "{}", io::Error::last_os_error());
        // SAFETY: unmapping exactly the mapping created above, which nothing else references.
        unsafe { libc::munmap(mapping, len) };
        residency.iter().filter(|&&page| page & 1 != 0).count()
    }

    /// Moved pages keep their bytes at the destination and leave zeros behind; a range that
    /// two moves filled spans two mappings: a kernel moves it whole, or (older ones) refuses
    /// with `EFAULT`, which the store answers by giving that range back, and each piece moves.
    #[test]
    fn pages_move_with_their_bytes_and_a_range_of_two_mappings_moves_in_pieces() {
        const P: u64 = PAGE_BYTES;
        let region = Region::reserve(64 * P, false).unwrap();
        region.write(0, &[1u8; 4 * P as usize]);
        region.write(8 * P, &[2u8; 4 * P as usize]);
        region.move_pages(0, 20 * P, 4 * P).unwrap();
        region.move_pages(8 * P, 24 * P, 4 * P).unwrap();
        assert!(region.copy_out(0..12 * P).iter().all(|&byte| byte == 0));
        assert!(region.copy_out(20 * P..24 * P).iter().all(|&byte| byte == 1));
        assert!(region.copy_out(24 * P..28 * P).iter().all(|&byte| byte == 2));
        match region.move_pages(20 * P, 40 * P, 8 * P) {
            Err(IoError::Move { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::EFAULT)),
            // A kernel that moves across mappings moves it whole.
            Ok(()) => {
                assert!(region.copy_out(40 * P..44 * P).iter().all(|&byte| byte == 1));
                return;
            }
            Err(other) => panic!("{other}"),
        }
        region.move_pages(20 * P, 40 * P, 4 * P).unwrap();
        region.move_pages(24 * P, 44 * P, 4 * P).unwrap();
        assert!(region.copy_out(40 * P..44 * P).iter().all(|&byte| byte == 1));
        assert!(region.copy_out(44 * P..48 * P).iter().all(|&byte| byte == 2));
    }

    #[test]
    fn eviction_empties_the_page_cache_and_direct_reads_do_not_fill_it() {
        let directory = disk_test_directory();
        let path = write_file(directory.path(), "data.bin", &patterned_bytes(4 << 20));
        std::fs::read(&path).unwrap();
        assert!(resident_pages(&path) > 0, "a buffered read should leave pages cached");
        evict_from_page_cache(&path).unwrap();
        assert_eq!(resident_pages(&path), 0);

        let file = DirectFile::open(&path).unwrap();
        let mut buffer = AlignedBuf::new(1 << 20);
        file.read_exact_at(buffer.as_mut_slice(), 0).unwrap();
        assert_eq!(resident_pages(&path), 0, "direct reads must bypass the page cache");

        std::fs::read(&path).unwrap();
        evict_file(&File::open(&path).unwrap()).unwrap();
        assert_eq!(resident_pages(&path), 0);
    }

    #[test]
    fn eviction_works_on_paths_and_open_files() {
        let directory = disk_test_directory();
        let path = write_file(directory.path(), "data.bin", &patterned_bytes(65536));
        evict_from_page_cache(&path).unwrap();
        evict_file(&File::open(&path).unwrap()).unwrap();
        let missing = directory.path().join("missing");
        assert!(matches!(evict_from_page_cache(&missing), Err(IoError::Open { .. })));
    }
}
