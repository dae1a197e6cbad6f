//! Page-aligned heap buffers, as `O_DIRECT` reads need them: the store's load reader bounces
//! llama.cpp's load-time reads through one, and `hw` reads the disk into them to measure it.
use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

use super::IoError;

/// Alignment that satisfies `O_DIRECT` on every common Linux block device: logical block sizes
/// are 512 or 4096 bytes, and the page size is 4096.
pub const DEFAULT_ALIGNMENT_BYTES: usize = 4096;

/// The smallest alignment `O_DIRECT` can ever accept (one 512-byte sector).
pub const MIN_ALIGNMENT_BYTES: usize = 512;

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
        formatter
            .debug_struct("AlignedBuf")
            .field("len_bytes", &self.len_bytes)
            .field("alignment_bytes", &self.layout.align())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
