//! Backend initialisation as a token, and the list of ggml devices.
use std::ffi::CStr;
use std::sync::OnceLock;

use llama_cpp_sys_2 as raw;

/// Proof that libllama and ggml are initialised. Everything that touches a device takes one.
/// It is created once per process and never torn down (llama.cpp's global state is not
/// re-initialisable).
#[derive(Debug)]
pub struct Backend {
    _private: (),
}

static BACKEND: OnceLock<Backend> = OnceLock::new();

impl Backend {
    /// Initialise once. With dynamically loaded backends (`HYPURA_GGML_BACKEND_DIR` or the
    /// directory of the executable), ggml loads them here.
    pub fn get() -> &'static Backend {
        BACKEND.get_or_init(|| {
            crate::log::install();
            // SAFETY: called exactly once per process (guarded by the OnceLock) before any other
            // llama.cpp call; it takes no arguments.
            unsafe { raw::llama_backend_init() };
            if let Some(dir) = std::env::var_os("HYPURA_GGML_BACKEND_DIR") {
                if let Ok(dir) = std::ffi::CString::new(dir.as_encoded_bytes()) {
                    // SAFETY: `dir` is a valid NUL-terminated string for the duration of the call.
                    unsafe { raw::ggml_backend_load_all_from_path(dir.as_ptr()) };
                }
            }
            Backend { _private: () }
        })
    }

    /// Every ggml device with its free and total memory.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        // SAFETY: the registry is initialised (we hold a Backend); device handles are owned by
        // ggml's global registry and live for the whole process; strings it returns are static.
        unsafe {
            let count = raw::ggml_backend_dev_count();
            (0..count)
                .map(|index| {
                    let device = raw::ggml_backend_dev_get(index);
                    let mut free: usize = 0;
                    let mut total: usize = 0;
                    raw::ggml_backend_dev_memory(device, &mut free, &mut total);
                    let kind = match raw::ggml_backend_dev_type(device) {
                        raw::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
                        raw::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
                        raw::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::IntegratedGpu,
                        _ => DeviceKind::Accelerator,
                    };
                    DeviceInfo {
                        name: c_string(raw::ggml_backend_dev_name(device)),
                        description: c_string(raw::ggml_backend_dev_description(device)),
                        kind,
                        free_bytes: free as u64,
                        total_bytes: total as u64,
                    }
                })
                .collect()
        }
    }
}

impl Backend {
    /// The rate of copying `bytes` from ordinary (pageable) host memory into device
    /// `device_index`'s own memory with `ggml_backend_tensor_set`, the path llama.cpp's loader
    /// takes: the best of `reps` copies, in bytes per second. None for a device that computes
    /// on host memory, or when the device cannot allocate `bytes`.
    pub fn host_to_device_bytes_per_sec(&self, device_index: usize, bytes: usize, reps: usize) -> Option<f64> {
        device_handles()
            .get(device_index)
            .and_then(|device| device.transfer_bytes_per_sec(bytes, reps))
            .map(|(upload, _)| upload)
    }
}

/// Whether ggml's CPU backend reports `feature` (a name of its `ggml_backend_get_features`
/// list, such as `AMX_INT8` or `AVX512`). Asked of the CPU backend's registry entry, so it holds
/// whether the backend is linked in or loaded as a library (where its `ggml_cpu_has_*`
/// functions are not linked into the binary at all). False where no CPU backend is registered.
pub fn cpu_has_feature(feature: &str) -> bool {
    Backend::get();
    // SAFETY: the registry is initialised (`Backend::get`); the names are NUL-terminated
    // literals; a registry entry and the procedure it returns live for the whole process.
    let get_features = unsafe {
        let registry = raw::ggml_backend_reg_by_name(c"CPU".as_ptr());
        if registry.is_null() {
            return false;
        }
        let address = raw::ggml_backend_reg_get_proc_address(registry, c"ggml_backend_get_features".as_ptr());
        if address.is_null() {
            return false;
        }
        // SAFETY: ggml registers this name for a `ggml_backend_get_features_t` (ggml-backend.h).
        let function: raw::ggml_backend_get_features_t = std::mem::transmute(address);
        function.map(|function| (function, registry))
    };
    let Some((function, registry)) = get_features else { return false };
    // SAFETY: the function returns a static array of name/value pairs that ends with a null
    // name; its strings are static and NUL-terminated.
    unsafe {
        let mut entry = function(registry);
        while !entry.is_null() && !(*entry).name.is_null() {
            if CStr::from_ptr((*entry).name).to_bytes() == feature.as_bytes() {
                return true;
            }
            entry = entry.add(1);
        }
    }
    false
}

/// Every device in ggml's registry, in its order.
pub(crate) fn device_handles() -> Vec<crate::rpc::DeviceHandle> {
    // SAFETY: the registry lives for the process; every index below the count names a device.
    unsafe {
        (0..raw::ggml_backend_dev_count())
            .map(|index| crate::rpc::DeviceHandle(raw::ggml_backend_dev_get(index)))
            .collect()
    }
}

/// The rates of copying `bytes` from ordinary host memory into `device`'s own memory with
/// `ggml_backend_tensor_set`, and back with `ggml_backend_tensor_get`: the best of `reps`
/// copies each way, in bytes per second. None for a device that computes on host memory, or
/// when the device cannot allocate `bytes`.
pub(crate) fn transfer_bytes_per_sec(device: raw::ggml_backend_dev_t, bytes: usize, reps: usize) -> Option<(f64, f64)> {
    let mut host = vec![0x5au8; bytes];
    let best = |best: Option<f64>, started: std::time::Instant| {
        let rate = bytes as f64 / started.elapsed().as_secs_f64().max(1e-9);
        Some(best.map_or(rate, |best: f64| best.max(rate)))
    };
    // SAFETY: `device` is a valid handle for the process (a DeviceHandle). The context is
    // created with no_alloc and room for one tensor header; the tensor's memory comes from a
    // device buffer allocated for it, and `tensor_set`/`tensor_get` copy exactly `bytes` between
    // `host`, which is that long, and the `bytes`-byte tensor. Buffer and context are freed
    // before returning, once each.
    unsafe {
        let buffer_type = raw::ggml_backend_dev_buffer_type(device);
        if buffer_type.is_null() || raw::ggml_backend_buft_is_host(buffer_type) {
            return None;
        }
        let context = raw::ggml_init(raw::ggml_init_params {
            mem_size: 2 * raw::ggml_tensor_overhead(),
            mem_buffer: std::ptr::null_mut(),
            no_alloc: true,
        });
        if context.is_null() {
            return None;
        }
        let tensor = raw::ggml_new_tensor_1d(context, raw::GGML_TYPE_I8, bytes as i64);
        let buffer = if tensor.is_null() {
            std::ptr::null_mut()
        } else {
            raw::ggml_backend_alloc_ctx_tensors_from_buft(context, buffer_type)
        };
        let (mut upload, mut download) = (None, None);
        if !buffer.is_null() {
            for _ in 0..reps.max(1) {
                let started = std::time::Instant::now();
                raw::ggml_backend_tensor_set(tensor, host.as_ptr().cast(), 0, bytes);
                upload = best(upload, started);
                let started = std::time::Instant::now();
                raw::ggml_backend_tensor_get(tensor, host.as_mut_ptr().cast(), 0, bytes);
                download = best(download, started);
            }
            raw::ggml_backend_buffer_free(buffer);
        }
        raw::ggml_free(context);
        upload.zip(download)
    }
}

/// The CPU device's buffer type (llama.cpp's `--override-tensor PATTERN=CPU`).
pub(crate) fn cpu_buffer_type() -> Result<raw::ggml_backend_buffer_type_t, crate::SysError> {
    // SAFETY: the device registry lives for the process; with dynamically loaded backends the
    // CPU device exists once a variant was loaded, else the call returns null, checked below.
    let buffer_type = unsafe {
        let device = raw::ggml_backend_dev_by_type(raw::GGML_BACKEND_DEVICE_TYPE_CPU);
        if device.is_null() {
            std::ptr::null_mut()
        } else {
            raw::ggml_backend_dev_buffer_type(device)
        }
    };
    if buffer_type.is_null() {
        return Err(crate::SysError::Allocation("the CPU device's buffer type (no CPU backend is loaded)"));
    }
    Ok(buffer_type)
}

pub(crate) fn c_string(pointer: *const std::ffi::c_char) -> String {
    if pointer.is_null() {
        return String::new();
    }
    // SAFETY: ggml returns NUL-terminated strings owned by the device, valid for the process.
    unsafe { CStr::from_ptr(pointer) }.to_string_lossy().into_owned()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
    IntegratedGpu,
    Accelerator,
}

impl DeviceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Gpu => "gpu",
            DeviceKind::IntegratedGpu => "igpu",
            DeviceKind::Accelerator => "accel",
        }
    }

    /// Whether the device computes on host memory (CPU, or an integrated GPU sharing RAM).
    pub fn unified_memory(self) -> bool {
        matches!(self, DeviceKind::Cpu | DeviceKind::IntegratedGpu)
    }
}

#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub description: String,
    pub kind: DeviceKind,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry's answer is the CPU backend's own, for the feature that switches repacking
    /// off and for one every x86-64 build reports on; nothing for a name it does not know.
    #[test]
    #[cfg(not(feature = "dynamic-backends"))]
    fn the_cpu_registry_reports_the_features_the_backend_was_built_with() {
        // SAFETY: pure queries of how the linked CPU backend was compiled.
        let (amx, avx2, sse3) =
            unsafe { (raw::ggml_cpu_has_amx_int8(), raw::ggml_cpu_has_avx2(), raw::ggml_cpu_has_sse3()) };
        assert_eq!(cpu_has_feature("AMX_INT8"), amx != 0);
        assert_eq!(cpu_has_feature("AVX2"), avx2 != 0);
        assert_eq!(cpu_has_feature("SSE3"), sse3 != 0);
        assert!(!cpu_has_feature("NO_SUCH_FEATURE"));
    }
}
