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

fn c_string(pointer: *const std::ffi::c_char) -> String {
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
