//! Model loading with placement: devices, `n_gpu_layers`, load mode and repacking.
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as raw;

use crate::backend::{cpu_buffer_type, Backend};
use crate::error::SysError;
use crate::load_reader::{new_cookie, open_stream, LoadReader};
use crate::rpc::DeviceHandle;
use crate::stream::StreamBufferType;
use crate::vocab::Vocab;

/// Where tensors go beyond llama.cpp's defaults, and who reads the file.
#[derive(Default)]
pub struct Placement {
    /// Tensors (by exact name) placed in a stream buffer type.
    pub streamed: Vec<(String, Arc<StreamBufferType>)>,
    /// Tensors kept in host memory (the CPU device's buffer type) although their layer is on a
    /// GPU, as regexes in llama.cpp's `--override-tensor` syntax (`exps` matches every routed
    /// expert tensor). Streamed names win over these.
    pub host_patterns: Vec<String>,
    /// Serve llama.cpp's reads (requires `LoadMode::Read`; single-file models).
    pub reader: Option<Box<dyn LoadReader>>,
}

/// An override pattern (a regex, as llama.cpp's `--override-tensor` takes) that matches the
/// tensor `name` alone.
pub fn exact_name_pattern(name: &str) -> String {
    format!("^{}$", name.replace('.', "\\."))
}

/// How llama.cpp reads tensor bytes at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMode {
    /// mmap the file (llama.cpp's default on CPU).
    Mmap,
    /// Read into allocated buffers (`--no-mmap`).
    Read,
}

/// Placement and load options for `Model::load`.
#[derive(Clone, Debug)]
pub struct ModelParams {
    /// Layers to place on the GPU; negative means all. Ignored without a GPU device.
    pub n_gpu_layers: i32,
    pub load_mode: LoadMode,
    /// llama.cpp's "extra buffer types" repack some CPU weights at load. Repacking changes the
    /// numerics, so comparisons must use the same setting on both sides.
    pub use_extra_bufts: bool,
    /// Only load the vocabulary (used by tests and by tokenizer-only tools).
    pub vocab_only: bool,
    /// The devices `n_gpu_layers` places layers on, in order (llama.cpp's `devices`); empty:
    /// every GPU ggml registered.
    pub devices: Vec<DeviceHandle>,
    /// The share of the offloaded layers (the output counted as one more, on the last device)
    /// each of `devices` takes, as llama.cpp's `--tensor-split`; empty: by free memory.
    pub tensor_split: Vec<f32>,
    /// Load the model's multi-token-prediction layers (llama.cpp skips them otherwise), for a
    /// context made with `Context::new_mtp`.
    pub load_mtp: bool,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams {
            n_gpu_layers: -1,
            load_mode: LoadMode::Mmap,
            use_extra_bufts: true,
            vocab_only: false,
            devices: Vec::new(),
            tensor_split: Vec::new(),
            load_mtp: false,
        }
    }
}

impl ModelParams {
    /// llama.cpp's parameters for these (no overrides, no devices: `load_placed` points them at
    /// arrays that live through the load).
    pub(crate) fn to_raw(&self) -> raw::llama_model_params {
        // SAFETY: returns a plain struct by value.
        let mut raw_params = unsafe { raw::llama_model_default_params() };
        raw_params.n_gpu_layers = self.n_gpu_layers;
        raw_params.load_mode = match self.load_mode {
            LoadMode::Mmap => raw::LLAMA_LOAD_MODE_MMAP,
            LoadMode::Read => raw::LLAMA_LOAD_MODE_NONE,
        };
        raw_params.use_extra_bufts = self.use_extra_bufts && repacking_available();
        raw_params.vocab_only = self.vocab_only;
        raw_params.load_mtp = self.load_mtp;
        raw_params
    }
}

/// Whether `ModelParams::use_extra_bufts` takes effect in this build. Not where the CPU backend
/// offers the AMX weight buffer type, whose matrix product crashes (a segfault in
/// `ggml_backend_amx_mul_mat` at the first decode on Sapphire Rapids, llama.cpp issue 20824,
/// reproduced here on a plain resident run of Qwen2.5-Coder-0.5B): the extra buffer types come
/// as one list, so they are all left out, for every model, the comparison baseline's included,
/// and weights stay in plain CPU buffers as with `--no-repack`. Logged once.
pub fn repacking_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let amx = crate::backend::cpu_has_feature("AMX_INT8");
        if amx {
            tracing::warn!("this CPU backend has AMX, whose weight buffers crash llama.cpp's matrix products: weights are not repacked");
        }
        !amx
    })
}

pub(crate) struct ModelHandle {
    pointer: NonNull<raw::llama_model>,
    /// Buffer types the model's tensors live in; dropped only after the model is freed.
    _stream_types: Vec<Arc<StreamBufferType>>,
}

// SAFETY: a llama_model is immutable after load; llama.cpp documents that several contexts on
// different threads may share one model.
unsafe impl Send for ModelHandle {}
// SAFETY: as above, all methods we call on a shared model only read it.
unsafe impl Sync for ModelHandle {}

impl Drop for ModelHandle {
    fn drop(&mut self) {
        // SAFETY: the pointer came from llama_model_load_from_file and is freed exactly once,
        // here; every Context holds an Arc to this handle, so none outlives it.
        unsafe { raw::llama_model_free(self.pointer.as_ptr()) };
    }
}

/// A loaded model. Cheap to clone; contexts keep it alive.
#[derive(Clone)]
pub struct Model {
    pub(crate) handle: Arc<ModelHandle>,
    path: PathBuf,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Model").field("path", &self.path).finish()
    }
}

impl Model {
    /// Load a GGUF file. The caller should have validated the file with `hypura-gguf` first:
    /// llama.cpp throws (and we turn that into an error) on most bad input, but some malformed
    /// shapes reach a ggml assert, which aborts.
    pub fn load(backend: &Backend, path: &Path, params: &ModelParams) -> Result<Model, SysError> {
        Model::load_placed(backend, path, params, Placement::default())
    }

    /// Load with Hypura's placement: streamed tensors in their buffer types, and (optionally)
    /// every byte read through `placement.reader`.
    pub fn load_placed(
        _backend: &Backend,
        path: &Path,
        params: &ModelParams,
        placement: Placement,
    ) -> Result<Model, SysError> {
        let c_path = crate::error::c_path(path)?;
        // Regexes in llama.cpp's override format (the first match wins), terminated by a null
        // entry: streamed tensors by exact name, then the host patterns.
        let host = if placement.host_patterns.is_empty() { std::ptr::null_mut() } else { cpu_buffer_type()? };
        let patterns: Vec<(CString, raw::ggml_backend_buffer_type_t)> = placement
            .streamed
            .iter()
            .map(|(name, buft)| (exact_name_pattern(name), buft.as_raw()))
            .chain(placement.host_patterns.iter().map(|pattern| (pattern.clone(), host)))
            .map(|(pattern, buft)| {
                CString::new(pattern).map(|pattern| (pattern, buft)).map_err(|_| SysError::PathNul(path.to_path_buf()))
            })
            .collect::<Result<_, _>>()?;
        let mut overrides: Vec<raw::llama_model_tensor_buft_override> = patterns
            .iter()
            .map(|(pattern, buft)| raw::llama_model_tensor_buft_override { pattern: pattern.as_ptr(), buft: *buft })
            .collect();
        overrides.push(raw::llama_model_tensor_buft_override { pattern: std::ptr::null(), buft: std::ptr::null_mut() });
        let stream_types: Vec<Arc<StreamBufferType>> =
            placement.streamed.iter().map(|(_, buft)| buft.clone()).collect();
        let mut raw_params = params.to_raw();
        if !patterns.is_empty() {
            raw_params.tensor_buft_overrides = overrides.as_ptr();
        }
        // A null-terminated device list, and a split llama.cpp reads `llama_max_devices()` of.
        let mut devices: Vec<raw::ggml_backend_dev_t> = params.devices.iter().map(|device| device.0).collect();
        devices.push(std::ptr::null_mut());
        // SAFETY: a plain query of a compile-time constant.
        let max_devices = unsafe { raw::llama_max_devices() };
        if params.devices.len() > max_devices || params.tensor_split.len() > max_devices {
            return Err(SysError::ModelLoad {
                path: path.to_path_buf(),
                reason: format!("{} devices, and llama.cpp takes at most {max_devices}", params.devices.len()),
            });
        }
        let mut split = params.tensor_split.clone();
        split.resize(max_devices, 0.0);
        if !params.devices.is_empty() {
            raw_params.devices = devices.as_mut_ptr();
        }
        if !params.tensor_split.is_empty() {
            raw_params.tensor_split = split.as_ptr();
        }
        crate::log::clear_last_error();
        let mut read_error = None;
        let pointer = match placement.reader {
            None => {
                // SAFETY: c_path is a valid NUL-terminated string for the call; the override
                // array (null-terminated) and its pattern strings, the device list
                // (null-terminated) and the split (`llama_max_devices()` long) outlive the call.
                unsafe { raw::llama_model_load_from_file(c_path.as_ptr(), raw_params) }
            }
            Some(reader) => {
                if params.load_mode != LoadMode::Read {
                    return Err(SysError::ModelLoad {
                        path: path.to_path_buf(),
                        reason: "a custom reader needs LoadMode::Read".into(),
                    });
                }
                let mut cookie = new_cookie(reader);
                let stream =
                    open_stream(&mut cookie).ok_or(SysError::Allocation("a stdio stream for the model file"))?;
                // SAFETY: the stream is valid until fclose below and its cookie outlives it; the
                // override array and its strings, the device list and the split outlive the call.
                let pointer = unsafe { raw::llama_model_load_from_file_ptr(stream.cast(), raw_params) };
                // SAFETY: the stream came from fopencookie and is closed once; llama.cpp does
                // not keep it (the loader is gone when the load returns).
                unsafe { libc::fclose(stream) };
                read_error = cookie.error.take();
                pointer
            }
        };
        match NonNull::new(pointer) {
            Some(pointer) => Ok(Model {
                handle: Arc::new(ModelHandle { pointer, _stream_types: stream_types }),
                path: path.to_path_buf(),
            }),
            None => Err(SysError::ModelLoad {
                path: path.to_path_buf(),
                reason: match read_error {
                    Some(error) => format!("read error: {error}"),
                    None => crate::log::take_last_error().unwrap_or_else(|| "unknown reason".to_string()),
                },
            }),
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut raw::llama_model {
        self.handle.pointer.as_ptr()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn vocab(&self) -> Vocab {
        Vocab::new(self.clone())
    }

    pub fn n_layer(&self) -> i32 {
        // SAFETY: the model pointer is valid while `self` lives.
        unsafe { raw::llama_model_n_layer(self.as_ptr()) }
    }

    pub fn n_embd(&self) -> i32 {
        // SAFETY: the model pointer is valid while `self` lives.
        unsafe { raw::llama_model_n_embd(self.as_ptr()) }
    }

    /// The kind of memory llama.cpp gives the model's contexts when it is not a plain KV cache
    /// (a run of positions per sequence): "sliding-window", "recurrent" or "hybrid".
    pub fn memory_kind(&self) -> Option<&'static str> {
        // SAFETY: the model pointer is valid while `self` lives; these read its hyperparameters.
        let (swa, recurrent, hybrid) = unsafe {
            (
                raw::llama_model_n_swa(self.as_ptr()),
                raw::llama_model_is_recurrent(self.as_ptr()),
                raw::llama_model_is_hybrid(self.as_ptr()),
            )
        };
        if hybrid {
            Some("hybrid")
        } else if recurrent {
            Some("recurrent")
        } else if swa > 0 {
            Some("sliding-window")
        } else {
            None
        }
    }

    pub fn n_ctx_train(&self) -> i32 {
        // SAFETY: the model pointer is valid while `self` lives.
        unsafe { raw::llama_model_n_ctx_train(self.as_ptr()) }
    }

    pub fn n_params(&self) -> u64 {
        // SAFETY: the model pointer is valid while `self` lives.
        unsafe { raw::llama_model_n_params(self.as_ptr()) }
    }

    /// Bytes of all weights as llama.cpp counts them.
    pub fn size_bytes(&self) -> u64 {
        // SAFETY: the model pointer is valid while `self` lives.
        unsafe { raw::llama_model_size(self.as_ptr()) }
    }

    /// llama.cpp's one-line description, e.g. "gemma3 270M Q4_K - Medium".
    pub fn description(&self) -> String {
        let mut buffer = vec![0u8; 256];
        // SAFETY: the buffer is writable for its full length; llama.cpp writes at most
        // buffer_size bytes including the NUL.
        let written = unsafe { raw::llama_model_desc(self.as_ptr(), buffer.as_mut_ptr().cast(), buffer.len()) };
        buffer.truncate(written.clamp(0, 255) as usize);
        String::from_utf8_lossy(&buffer).into_owned()
    }

    /// The model's own chat template (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: the model pointer is valid; a null name asks for the default template; the
        // returned string is owned by the model and copied out at once.
        let pointer = unsafe { raw::llama_model_chat_template(self.as_ptr(), std::ptr::null()) };
        if pointer.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated, owned by the model which we hold.
        Some(unsafe { std::ffi::CStr::from_ptr(pointer) }.to_string_lossy().into_owned())
    }
}
