//! Hypura's stream buffer type (C shim in `csrc/stream_buft.c`): a ggml host buffer type whose
//! tensors live at `region base + file offset` in a reservation that Hypura's store owns, and
//! are never filled by llama.cpp's loader.
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::NonNull;

use llama_cpp_sys_2 as raw;

use crate::error::SysError;

extern "C" {
    fn hypura_stream_buft_new(
        base: *mut c_void,
        size: usize,
        sink: *mut c_void,
        sink_size: usize,
        offset_of: unsafe extern "C" fn(*mut c_void, *const c_char) -> i64,
        user: *mut c_void,
    ) -> raw::ggml_backend_buffer_type_t;
    fn hypura_stream_buft_finalize(buft: raw::ggml_backend_buffer_type_t) -> usize;
    fn hypura_stream_buft_free(buft: raw::ggml_backend_buffer_type_t);
    fn hypura_stream_buft_tensor(buft: raw::ggml_backend_buffer_type_t, name: *const c_char) -> *mut raw::ggml_tensor;
}

unsafe extern "C" fn offset_of(user: *mut c_void, name: *const c_char) -> i64 {
    if user.is_null() || name.is_null() {
        return -1;
    }
    // SAFETY: `user` is the Box<HashMap> owned by the StreamBufferType that registered this
    // callback; ggml calls it only while tensors of that type are being allocated, which is
    // while the type is alive. `name` is a tensor's NUL-terminated name.
    let (offsets, name) = unsafe { (&*(user as *const HashMap<String, u64>), CStr::from_ptr(name)) };
    name.to_str().ok().and_then(|name| offsets.get(name)).map_or(-1, |&offset| offset as i64)
}

/// A buffer type placing each named tensor at `region_address + its file offset`.
pub struct StreamBufferType {
    buft: NonNull<raw::ggml_backend_buffer_type>,
    // Boxed so its address is stable for the C side, which holds a pointer to the map itself.
    #[allow(clippy::box_collection)]
    _offsets: Box<HashMap<String, u64>>,
}

// SAFETY: the type is immutable after creation; ggml only reads it.
unsafe impl Send for StreamBufferType {}
// SAFETY: as above.
unsafe impl Sync for StreamBufferType {}

impl StreamBufferType {
    /// `region_address .. + region_bytes` must be a mapping that the caller keeps alive longer
    /// than every model loaded with this type (the store's region; `hypura::engine` orders the
    /// drops). `offsets` maps tensor names to their absolute file offsets. `sink` (address and
    /// size, at least the largest tensor) absorbs llama.cpp's load-time copies until
    /// `finalize`; the caller keeps it mapped until then.
    pub fn new(
        region_address: usize,
        region_bytes: usize,
        sink: Option<(usize, usize)>,
        offsets: HashMap<String, u64>,
    ) -> Result<StreamBufferType, SysError> {
        let offsets = Box::new(offsets);
        let (sink_address, sink_bytes) = sink.unwrap_or((0, 0));
        // SAFETY: the region and sink are the caller's live reservations (documented contract
        // above); the callback data is the boxed map, which lives as long as the returned value.
        let buft = unsafe {
            hypura_stream_buft_new(
                region_address as *mut c_void,
                region_bytes,
                sink_address as *mut c_void,
                sink_bytes,
                offset_of,
                &*offsets as *const HashMap<String, u64> as *mut c_void,
            )
        };
        let buft = NonNull::new(buft).ok_or(SysError::Allocation("a stream buffer type"))?;
        Ok(StreamBufferType { buft, _offsets: offsets })
    }

    /// Point every tensor at its mirror address (after the load, before any graph runs; the
    /// sink may be unmapped afterwards). Returns how many tensors moved.
    pub fn finalize(&self) -> usize {
        // SAFETY: the type is alive; the recorded tensors belong to the model just loaded,
        // which is alive (the caller holds it) and not computing yet.
        unsafe { hypura_stream_buft_finalize(self.buft.as_ptr()) }
    }

    /// The tensor of this type named `name`, after the load (`finalize`): a handle that can
    /// place it in a device's expert pool. The model that owns it must outlive the handle, and
    /// the caller keeps it (see `ModelTensor`).
    pub fn tensor(&self, name: &str) -> Option<crate::pool::ModelTensor> {
        let name = std::ffi::CString::new(name).ok()?;
        // SAFETY: the type is alive and `name` is NUL-terminated for the call; the records it
        // searches are tensors of the model loaded with it.
        let tensor = unsafe { hypura_stream_buft_tensor(self.buft.as_ptr(), name.as_ptr()) };
        NonNull::new(tensor).map(crate::pool::ModelTensor::new)
    }

    pub(crate) fn as_raw(&self) -> raw::ggml_backend_buffer_type_t {
        self.buft.as_ptr()
    }
}

impl Drop for StreamBufferType {
    fn drop(&mut self) {
        // SAFETY: created by hypura_stream_buft_new; models holding it keep an Arc, so this
        // runs only after they are freed.
        unsafe { hypura_stream_buft_free(self.buft.as_ptr()) };
    }
}
