//! The region: a fixed range of address space that mirrors the model file. The store reads
//! streamed tensors into it, gives their pages back or moves them under the next read, and maps
//! tables from the file's own pages; the stream buffer type points llama.cpp's streamed tensors
//! into it.
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use super::direct::DirectFile;
use super::IoError;

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
// the store's unit state machine (`store::residency::UnitState`), not by this type.
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
        let len_bytes = usize::try_from(len_bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES)
            .map_err(|_| IoError::BufferLayout { len_bytes: usize::MAX, alignment_bytes: PAGE_BYTES as usize })?;
        // SAFETY: an anonymous private mapping with no address hint; the kernel picks a free
        // range or fails. We own the mapping until Drop unmaps it.
        let pointer = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
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
        unsafe {
            libc::madvise(
                self.base.as_ptr().add(inner.start as usize).cast(),
                (inner.end - inner.start) as usize,
                libc::MADV_HUGEPAGE,
            ) == 0
        }
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
    /// store's state machine: a unit is `Loading` until this returns).
    pub fn read_in(&self, file: &DirectFile, range: std::ops::Range<u64>) -> Result<u64, IoError> {
        self.read_in_shifted(file, range, 0)
    }

    /// `read_in`, to region offset `range.start + shift` instead of the mirror position (a unit
    /// in a reused slot); `shift` is a page multiple, so the read stays page-aligned.
    pub fn read_in_shifted(&self, file: &DirectFile, range: std::ops::Range<u64>, shift: u64) -> Result<u64, IoError> {
        debug_assert_eq!(shift % PAGE_BYTES, 0, "a shift must keep the page phase");
        let start = range.start / PAGE_BYTES * PAGE_BYTES;
        let end = range.end.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let span = start
            ..end.min(file.len().div_ceil(PAGE_BYTES) * PAGE_BYTES).min((self.len_bytes as u64).saturating_sub(shift));
        if span.start >= span.end {
            return Ok(0);
        }
        let len = (span.end - span.start) as usize;
        // SAFETY: `span + shift` is inside the region (clamped above) and the mapping lives as
        // long as `self`. Writers of these pages are serialised by the store's state machine
        // (documented contract above), and no Rust reference into the region outlives a call.
        let target =
            unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add((span.start + shift) as usize), len) };
        let available = file.len().saturating_sub(span.start);
        let read = file.read_at(target, span.start)?;
        if (read as u64) < (len as u64).min(available) {
            return Err(IoError::ShortRead {
                path: file.path().to_path_buf(),
                offset: span.start,
                wanted: len,
                got: read,
            });
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
        // anonymous mapping only drops contents (they read back as zeros), and no compute reads
        // these pages: their unit is `Evicting` (`store::residency::UnitState`), or they are
        // parked pages of an `Empty` unit, out of the parked set or listed as moving.
        let status = unsafe {
            libc::madvise(self.base.as_ptr().add(start as usize).cast(), (end - start) as usize, libc::MADV_DONTNEED)
        };
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
        assert!(
            from.is_multiple_of(PAGE_BYTES) && to.is_multiple_of(PAGE_BYTES) && len.is_multiple_of(PAGE_BYTES),
            "page moves are page-aligned"
        );
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
            libc::mremap(
                base.add(from as usize).cast(),
                len as usize,
                len as usize,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP,
                base.add(to as usize).cast::<libc::c_void>(),
            )
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
        let inner = range.start.div_ceil(PAGE_BYTES) * PAGE_BYTES
            ..(range.end / PAGE_BYTES * PAGE_BYTES).min(self.len_bytes as u64);
        if inner.start >= inner.end {
            return self.read_in(direct, range).map(|_| ());
        }
        let len = (inner.end - inner.start) as usize;
        // SAFETY: `inner` is page-aligned and inside our live mapping (clamped above), so
        // MAP_FIXED replaces only pages of this region, which no compute reads yet (load time);
        // the file offset equals the region offset, as the mirror requires, and is page-aligned.
        let pointer = unsafe {
            libc::mmap(
                self.base.as_ptr().add(inner.start as usize).cast(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                file.as_raw_fd(),
                inner.start as libc::off_t,
            )
        };
        if pointer == libc::MAP_FAILED {
            return Err(IoError::Map {
                path: direct.path().to_path_buf(),
                offset: inner.start,
                len_bytes: len as u64,
                source: io::Error::last_os_error(),
            });
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
        unsafe {
            std::slice::from_raw_parts(self.base.as_ptr().add(range.start as usize), (range.end - range.start) as usize)
        }
        .to_vec()
    }

    /// The bytes at `range`, borrowed: the caller keeps them resident while it reads them
    /// (the store reads a unit it holds ready, e.g. to upload an expert to a device).
    pub fn bytes(&self, range: std::ops::Range<u64>) -> &[u8] {
        assert!(range.end as usize <= self.len_bytes && range.start <= range.end, "range {range:?} outside the region");
        // SAFETY: the range lies inside the live mapping, which outlives `&self`; its pages are
        // readable (a released page reads as zeros, never faults), and the store does not
        // release a unit while it holds it ready for a reader.
        unsafe {
            std::slice::from_raw_parts(self.base.as_ptr().add(range.start as usize), (range.end - range.start) as usize)
        }
    }

    /// Let `write` fill the bytes at `range` (a unit the store holds as loading, which nothing
    /// else reads or writes meanwhile: the device's expert pool copies an expert back so).
    pub fn fill(
        &self,
        range: std::ops::Range<u64>,
        write: impl FnOnce(&mut [u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        assert!(range.end as usize <= self.len_bytes && range.start <= range.end, "range {range:?} outside the region");
        // SAFETY: the range lies inside the live, writable mapping; the store serialises
        // writers of a unit's range (it is loading, and only this caller fills it).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                self.base.as_ptr().add(range.start as usize),
                (range.end - range.start) as usize,
            )
        };
        write(bytes)
    }

    /// Copy `source` into the region at `offset`, bypassing the file (load-time fills of small
    /// edge pieces). Same contract as `read_in`.
    pub fn write(&self, offset: u64, source: &[u8]) {
        assert!(offset as usize + source.len() <= self.len_bytes, "write outside the region");
        // SAFETY: checked to lie inside the mapping; writers are serialised by the store.
        unsafe {
            std::ptr::copy_nonoverlapping(source.as_ptr(), self.base.as_ptr().add(offset as usize), source.len())
        };
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in `reserve`, once. The engine drops the
        // model (whose tensors point here) before the region.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes.max(1)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::test_support::{disk_test_directory, patterned_bytes, write_file};

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
}
