//! Files for positional reads, opened with `O_DIRECT` where the filesystem allows it, and
//! page-cache eviction.
//!
//! The streaming store reads tensor bytes through a [`DirectFile`], so they bypass the page cache;
//! `hw` reads the disk the same way, from an evicted page cache, to measure it. Filesystems that
//! refuse `O_DIRECT` (older tmpfs, procfs, some network filesystems) fall back to buffered reads,
//! and the fallback is recorded in [`DirectFile::read_path`] so reports can say which path a
//! figure came from.
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use serde::{Deserialize, Serialize};

use super::aligned::DEFAULT_ALIGNMENT_BYTES;
use super::IoError;

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
        let file = OpenOptions::new()
            .read(true)
            .open(path)
            .map_err(|source| IoError::Open { path: path.to_path_buf(), source })?;
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
    /// [`alignment_bytes`](Self::alignment_bytes) (use an [`AlignedBuf`](super::AlignedBuf)), else [`IoError::Unaligned`].
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
                Err(source) => {
                    return Err(IoError::Read {
                        path: self.path.clone(),
                        offset: position,
                        len: buffer.len() - filled,
                        source,
                    })
                }
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
            return Err(IoError::Unaligned {
                path: self.path.clone(),
                offset,
                len: buffer.len(),
                buffer_address,
                alignment_bytes: alignment,
            });
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
    std::fs::read_link(format!("/proc/self/fd/{descriptor}"))
        .unwrap_or_else(|_| PathBuf::from(format!("<file descriptor {descriptor}>")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::test_support::{disk_test_directory, patterned_bytes, write_file};
    use crate::io::AlignedBuf;

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
        assert!(matches!(
            file.read_exact_at(&mut buffer.as_mut_slice()[..1000], 0),
            Err(IoError::Unaligned { len: 1000, .. })
        ));
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
        let mapping =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
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
