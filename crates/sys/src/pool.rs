//! A device's expert pool: memory on the device the layers compute on (the first GPU; the CPU
//! where there is none), in which the store places streamed expert tensors after the load.
//!
//! A pooled tensor keeps its shape (every expert) but only `slots` experts' worth of memory
//! backs it: the store uploads an expert's slice into a slot and, before the expert matmuls
//! run, rewrites the router's ids to slot numbers (`ObservedNode::write_input_i32_rows`), so
//! the kernels read slots only. A prompt batch whose experts do not fit the slots points the
//! layer's tensors at a staging area that holds the whole layer instead, ids unchanged. The
//! tensors are moved between graphs or from the eval hook, before any node that reads them
//! runs: ggml's scheduler has synchronised the device when the hook is called.
use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use llama_cpp_sys_2 as raw;

use crate::backend::c_string;
use crate::{Backend, SysError};

/// Memory on a device for expert tensors' slots, freed on drop.
pub struct DevicePool {
    buffer: NonNull<raw::ggml_backend_buffer>,
    base: usize,
    bytes: usize,
    alignment: usize,
    device: String,
    host: bool,
}

// SAFETY: the buffer is a plain device allocation; ggml's buffer calls used here (set through
// tensors, free) are safe from any thread, and the pool is never resized.
unsafe impl Send for DevicePool {}
// SAFETY: as above; `&self` methods only read the fields.
unsafe impl Sync for DevicePool {}

impl DevicePool {
    /// `bytes` of memory on the first GPU (or integrated GPU) ggml has, else on the CPU
    /// device: the device llama.cpp puts offloaded layers on.
    pub fn new(_backend: &Backend, bytes: usize) -> Result<DevicePool, SysError> {
        // SAFETY: the registry lives for the process (we hold a Backend); a null device or
        // buffer type is checked; the buffer is ours until Drop frees it.
        unsafe {
            let device = [
                raw::GGML_BACKEND_DEVICE_TYPE_GPU,
                raw::GGML_BACKEND_DEVICE_TYPE_IGPU,
                raw::GGML_BACKEND_DEVICE_TYPE_CPU,
            ]
            .into_iter()
            .map(|kind| raw::ggml_backend_dev_by_type(kind))
            .find(|device| !device.is_null())
            .ok_or(SysError::Allocation("an expert pool (no device)"))?;
            let buffer_type = raw::ggml_backend_dev_buffer_type(device);
            if buffer_type.is_null() {
                return Err(SysError::Allocation("an expert pool (the device has no buffer type)"));
            }
            let buffer = NonNull::new(raw::ggml_backend_buft_alloc_buffer(buffer_type, bytes.max(1)))
                .ok_or(SysError::Allocation("an expert pool in device memory"))?;
            raw::ggml_backend_buffer_set_usage(buffer.as_ptr(), raw::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            Ok(DevicePool {
                buffer,
                base: raw::ggml_backend_buffer_get_base(buffer.as_ptr()) as usize,
                bytes,
                alignment: raw::ggml_backend_buft_get_alignment(buffer_type).max(1),
                device: c_string(raw::ggml_backend_dev_name(device)),
                host: raw::ggml_backend_buft_is_host(buffer_type),
            })
        }
    }

    /// The device's name as ggml gives it (`CUDA0`, `CPU`).
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Whether the pool is host memory (no GPU: the layers compute on the CPU).
    pub fn on_host(&self) -> bool {
        self.host
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The offset alignment the device's buffers want for a tensor's data.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Copy bytes within the pool, on the device's side: each `(from, to, bytes)` copies
    /// `bytes` from offset `from` to offset `to`. The spans must lie inside the pool, and a
    /// copy's source and destination must not overlap; no graph may read the destinations now.
    pub fn copy_within(&self, copies: &[(usize, usize, usize)]) -> Result<(), SysError> {
        let inside = |offset: usize, bytes: usize| offset.checked_add(bytes).is_some_and(|end| end <= self.bytes);
        for &(from, to, bytes) in copies {
            let apart = from.checked_add(bytes).is_some_and(|end| end <= to) || to.saturating_add(bytes) <= from;
            if !inside(from, bytes) || !inside(to, bytes) || !apart {
                return Err(SysError::Allocation("a copy within the expert pool (outside it or overlapping)"));
            }
        }
        if copies.is_empty() {
            return Ok(());
        }
        // SAFETY: the context holds headers only (no_alloc) for two tensors per copy; each
        // tensor is a byte vector pointed into this pool's live buffer at a span checked above
        // to lie inside it, so ggml's copy (on the device for a device buffer, memcpy for a
        // host one) touches pool memory only. The context is freed before returning.
        unsafe {
            let context = raw::ggml_init(raw::ggml_init_params {
                mem_size: 2 * copies.len() * raw::ggml_tensor_overhead(),
                mem_buffer: std::ptr::null_mut(),
                no_alloc: true,
            });
            if context.is_null() {
                return Err(SysError::Allocation("a ggml context for copies within the expert pool"));
            }
            for &(from, to, bytes) in copies {
                let source = raw::ggml_new_tensor_1d(context, raw::GGML_TYPE_I8, bytes as i64);
                let destination = raw::ggml_new_tensor_1d(context, raw::GGML_TYPE_I8, bytes as i64);
                if source.is_null() || destination.is_null() {
                    raw::ggml_free(context);
                    return Err(SysError::Allocation("a ggml context for copies within the expert pool"));
                }
                for (tensor, offset) in [(source, from), (destination, to)] {
                    (*tensor).buffer = self.buffer.as_ptr();
                    (*tensor).data = (self.base + offset) as *mut c_void;
                }
                raw::ggml_backend_tensor_copy(source, destination);
            }
            raw::ggml_free(context);
        }
        Ok(())
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once here. Tensors placed in it belong to a model
        // whose contexts are gone by now (the engine drops them first) and are not read again.
        unsafe { raw::ggml_backend_buffer_free(self.buffer.as_ptr()) };
    }
}

/// One of a loaded model's weight tensors, as the stream buffer type recorded it: it can be
/// placed in a `DevicePool` and written there. The model must outlive the handle, and the
/// handle is used only where no graph reads the tensor (between graphs, or from the eval hook
/// before the tensor's nodes run).
pub struct ModelTensor {
    tensor: NonNull<raw::ggml_tensor>,
    /// Bytes from the tensor's data that its placement backs (0: not placed in a pool).
    span: AtomicUsize,
}

// SAFETY: the tensor header belongs to the model, which outlives the handle (contract above);
// it is only changed where no graph reads it, from one thread at a time (the store's lock).
unsafe impl Send for ModelTensor {}
// SAFETY: as above.
unsafe impl Sync for ModelTensor {}

impl ModelTensor {
    pub(crate) fn new(tensor: NonNull<raw::ggml_tensor>) -> ModelTensor {
        ModelTensor { tensor, span: AtomicUsize::new(0) }
    }

    pub fn name(&self) -> String {
        // SAFETY: a live tensor's name is NUL-terminated within its array.
        unsafe { CStr::from_ptr(self.tensor.as_ref().name.as_ptr()) }.to_string_lossy().into_owned()
    }

    /// The bytes the tensor's shape covers (every expert).
    pub fn nbytes(&self) -> usize {
        // SAFETY: the tensor is live (contract of the handle).
        unsafe { raw::ggml_nbytes(self.tensor.as_ptr()) }
    }

    /// Point the tensor at `pool`'s memory from `offset`, which backs `span` bytes of it; the
    /// kernels must then read no byte past `span` (the store remaps the router's ids so).
    pub fn place(&self, pool: &DevicePool, offset: usize, span: usize) -> Result<(), SysError> {
        let fits = offset.checked_add(span).is_some_and(|end| end <= pool.bytes);
        if !fits || span > self.nbytes() || !offset.is_multiple_of(pool.alignment) {
            return Err(SysError::Allocation("an expert tensor's place in the pool (outside it or misaligned)"));
        }
        // SAFETY: the handle's contract: the model is live and no graph reads the tensor now.
        // The data pointer lies inside the pool's buffer, which outlives the model's contexts.
        unsafe {
            let tensor = self.tensor.as_ptr();
            (*tensor).buffer = pool.buffer.as_ptr();
            (*tensor).data = (pool.base + offset) as *mut c_void;
        }
        self.span.store(span, Ordering::Release);
        Ok(())
    }

    /// Copy the placed tensor's bytes at `offset` into `bytes` (a download on a GPU).
    pub fn read(&self, offset: usize, bytes: &mut [u8]) -> Result<(), SysError> {
        let span = self.span.load(Ordering::Acquire);
        if span == 0 || offset.checked_add(bytes.len()).is_none_or(|end| end > span) {
            return Err(SysError::Allocation("an expert slot (a read outside the tensor's placed span)"));
        }
        // SAFETY: as in `write`: the span is backed by the pool and `bytes` is that long.
        unsafe { raw::ggml_backend_tensor_get(self.tensor.as_ptr(), bytes.as_mut_ptr().cast(), offset, bytes.len()) };
        Ok(())
    }

    /// Copy `bytes` into the placed tensor at `offset` (an upload on a GPU).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), SysError> {
        let span = self.span.load(Ordering::Acquire);
        if span == 0 || offset.checked_add(bytes.len()).is_none_or(|end| end > span) {
            return Err(SysError::Allocation("an expert slot (a write outside the tensor's placed span)"));
        }
        // SAFETY: the tensor is placed in a live pool, and `offset + len` lies inside the span
        // its placement backs (checked above); `bytes` is that long.
        unsafe { raw::ggml_backend_tensor_set(self.tensor.as_ptr(), bytes.as_ptr().cast(), offset, bytes.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies within the pool refuse a span past its end or a destination that overlaps its
    /// source (before any is made); spans inside and apart, or none, are copied.
    #[test]
    fn copies_within_the_pool_stay_inside_it_and_apart() {
        let pool = DevicePool::new(Backend::get(), 4096).unwrap();
        assert!(pool.copy_within(&[(0, 2048, 2048), (2048, 0, 1024)]).is_ok());
        assert!(pool.copy_within(&[]).is_ok());
        assert!(pool.copy_within(&[(0, 3000, 2048)]).is_err());
        assert!(pool.copy_within(&[(0, 1024, 2048)]).is_err());
        assert!(pool.copy_within(&[(2048, 1024, 2048)]).is_err());
        assert!(pool.copy_within(&[(usize::MAX - 1, 0, 2)]).is_err());
        assert!(pool.copy_within(&[(0, 2048, 16), (0, 8, 16)]).is_err());
    }
}
