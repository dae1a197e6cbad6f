//! ggml's RPC backend: a worker that lends its devices to other machines (`serve`), and the
//! devices of a worker as this process sees them (`connect`), which a model places layers on
//! like GPUs. The protocol, its transport and its tensor cache are ggml's (`ggml-rpc.h`, built
//! with `GGML_RPC=ON` from the workspace's cargo configuration); nothing here speaks it.
//!
//! ggml's RPC client aborts the process when a connection fails. Callers therefore connect to a
//! worker only through something that never fails (Hypura's relay, `hypura::remote`), which
//! answers for a worker that died and reports it.
use std::ffi::{c_char, CString};
use std::path::Path;

use llama_cpp_sys_2 as raw;

use crate::backend::Backend;
use crate::error::SysError;

extern "C" {
    // csrc/rpc_device.c
    fn hypura_capped_device(
        inner: raw::ggml_backend_dev_t,
        free_bytes: usize,
        total_bytes: usize,
    ) -> raw::ggml_backend_dev_t;
}

// ggml-rpc.h's entry points, as the RPC backend's registry hands them out: linked in, or from
// the loadable `ggml-rpc` library where backends are loaded at run time (the GPU recipe).
type StartServer = unsafe extern "C" fn(
    endpoint: *const c_char,
    cache_dir: *const c_char,
    n_threads: usize,
    n_devices: usize,
    devices: *mut raw::ggml_backend_dev_t,
);
type AddServer = unsafe extern "C" fn(endpoint: *const c_char) -> raw::ggml_backend_reg_t;

/// The address of `name` in the RPC backend's registry; an error where this build has none.
fn rpc_function(name: &std::ffi::CStr) -> Result<*mut std::ffi::c_void, SysError> {
    // SAFETY: the registry is initialised before any caller (they hold a Backend); both names are
    // valid C strings; the registry and the addresses it returns live for the process.
    let address = unsafe {
        let registry = raw::ggml_backend_reg_by_name(c"RPC".as_ptr());
        if registry.is_null() {
            return Err(SysError::Rpc(
                "this build has no RPC backend (ggml built without GGML_RPC, or its library not loaded)".into(),
            ));
        }
        raw::ggml_backend_reg_get_proc_address(registry, name.as_ptr())
    };
    if address.is_null() {
        return Err(SysError::Rpc(format!("ggml's RPC backend has no {}", name.to_string_lossy())));
    }
    Ok(address)
}

/// The protocol version this build speaks (`RPC_PROTO_MAJOR_VERSION` and the minor version of
/// the pinned ggml): a worker must answer HELLO with this major version.
pub const RPC_PROTOCOL_MAJOR: u8 = 7;

/// The numbers of the pinned ggml's graph operations that the validating front of `hypura
/// rpc-server` needs: how many there are, the ones whose parameters name a sub-operation, and
/// the ones whose parameters carry a function pointer (never accepted from a client).
pub mod ops {
    use llama_cpp_sys_2 as raw;

    pub const COUNT: u32 = raw::GGML_OP_COUNT;
    pub const NONE: u32 = raw::GGML_OP_NONE;
    pub const UNARY: u32 = raw::GGML_OP_UNARY;
    pub const UNARY_COUNT: u32 = raw::GGML_UNARY_OP_COUNT;
    pub const GLU: u32 = raw::GGML_OP_GLU;
    pub const GLU_COUNT: u32 = raw::GGML_GLU_OP_COUNT;
    pub const CUSTOM: [u32; 4] =
        [raw::GGML_OP_MAP_CUSTOM1, raw::GGML_OP_MAP_CUSTOM2, raw::GGML_OP_MAP_CUSTOM3, raw::GGML_OP_CUSTOM];
    pub const TYPE_COUNT: u32 = raw::GGML_TYPE_COUNT;
    /// A copy (whose element counts ggml's CPU kernel asserts).
    pub const DUP: u32 = raw::GGML_OP_DUP;
}

/// A ggml device handle that lives as long as the process (ggml never frees registered devices,
/// nor those an RPC registry or `hypura_capped_device` creates).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceHandle(pub(crate) raw::ggml_backend_dev_t);

// SAFETY: a device handle is an immutable descriptor owned by ggml for the process's life; ggml's
// device functions may be called from any thread.
unsafe impl Send for DeviceHandle {}
// SAFETY: as above.
unsafe impl Sync for DeviceHandle {}

impl DeviceHandle {
    /// The device's name (`CPU`, `RPC0`, ...).
    pub fn name(&self) -> String {
        // SAFETY: the handle is valid for the process; ggml returns a NUL-terminated string owned
        // by the device.
        crate::backend::c_string(unsafe { raw::ggml_backend_dev_name(self.0) })
    }

    /// Free and total memory as the device reports them. For a remote device this asks the
    /// worker (one round trip).
    pub fn memory(&self) -> (u64, u64) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the handle is valid for the process; both out-pointers are live locals.
        unsafe { raw::ggml_backend_dev_memory(self.0, &mut free, &mut total) };
        (free as u64, total as u64)
    }

    /// The rates of `ggml_backend_tensor_set` into this device's own memory (the path a
    /// model's weights take at load) and of `ggml_backend_tensor_get` back: the best of `reps`
    /// copies of `bytes` each way, in bytes per second. None for a device that computes on host
    /// memory, or that cannot allocate `bytes`.
    pub fn transfer_bytes_per_sec(&self, bytes: usize, reps: usize) -> Option<(f64, f64)> {
        crate::backend::transfer_bytes_per_sec(self.0, bytes, reps)
    }
}

/// The ggml device named `name` (`CPU`, `CUDA0`, ...), for `hypura rpc-server --device`.
pub fn local_device(_backend: &Backend, name: &str) -> Result<DeviceHandle, SysError> {
    let c_name = CString::new(name).map_err(|_| SysError::Rpc(format!("device name {name:?} contains a NUL byte")))?;
    // SAFETY: the registry is initialised (we hold a Backend); the name is a valid C string for
    // the call; the returned handle (or null) is owned by ggml.
    let device = unsafe { raw::ggml_backend_dev_by_name(c_name.as_ptr()) };
    if device.is_null() {
        let known: Vec<String> = crate::backend::device_handles().iter().map(DeviceHandle::name).collect();
        return Err(SysError::Rpc(format!("no ggml device named {name:?} (this build has {})", known.join(", "))));
    }
    Ok(DeviceHandle(device))
}

/// `device` reporting `free_bytes` free of `total_bytes` instead of what it reports itself.
pub fn capped_device(device: DeviceHandle, free_bytes: u64, total_bytes: u64) -> Result<DeviceHandle, SysError> {
    // SAFETY: `device` is a valid handle for the process; the shim copies its interface and
    // returns a new handle that is never freed (or null, checked below).
    let capped = unsafe { hypura_capped_device(device.0, free_bytes as usize, total_bytes as usize) };
    if capped.is_null() {
        return Err(SysError::Allocation("a memory-capped device for the RPC server"));
    }
    Ok(DeviceHandle(capped))
}

/// Serve `devices` to RPC clients on `endpoint` (`host:port`), one client at a time, with
/// `n_threads` CPU threads and ggml's tensor cache in `cache_dir`. Returns only when the server
/// cannot start (the port is taken, say): ggml prints why on stderr.
pub fn serve(
    _backend: &Backend,
    endpoint: &str,
    cache_dir: Option<&Path>,
    n_threads: usize,
    devices: &[DeviceHandle],
) -> Result<(), SysError> {
    if devices.is_empty() {
        return Err(SysError::Rpc("an RPC server needs at least one device".into()));
    }
    let c_endpoint =
        CString::new(endpoint).map_err(|_| SysError::Rpc(format!("endpoint {endpoint:?} contains a NUL byte")))?;
    let c_cache = cache_dir.map(crate::error::c_path).transpose()?;
    let mut handles: Vec<raw::ggml_backend_dev_t> = devices.iter().map(|device| device.0).collect();
    let address = rpc_function(c"ggml_backend_rpc_start_server")?;
    // SAFETY: the registry hands out `ggml_backend_rpc_start_server` under its own name, whose
    // signature `StartServer` repeats from ggml-rpc.h. The strings are valid C strings and the
    // device array holds `handles.len()` valid handles, all alive for the call (which runs the
    // server loop on this thread).
    unsafe {
        let start_server: StartServer = std::mem::transmute::<*mut std::ffi::c_void, StartServer>(address);
        start_server(
            c_endpoint.as_ptr(),
            c_cache.as_ref().map_or(std::ptr::null(), |cache| cache.as_ptr()),
            n_threads.max(1),
            handles.len(),
            handles.as_mut_ptr(),
        );
    }
    Err(SysError::Rpc(format!("the RPC server on {endpoint} stopped (see the messages above)")))
}

/// The devices of the RPC worker at `endpoint`, registered with ggml's RPC backend (once per
/// endpoint; a later call returns the same devices). The endpoint must answer: ggml aborts the
/// process when it cannot connect, so callers check the worker first (or connect through a
/// relay that always answers).
pub fn connect(_backend: &Backend, endpoint: &str) -> Result<Vec<DeviceHandle>, SysError> {
    let c_endpoint =
        CString::new(endpoint).map_err(|_| SysError::Rpc(format!("endpoint {endpoint:?} contains a NUL byte")))?;
    let address = rpc_function(c"ggml_backend_rpc_add_server")?;
    // SAFETY: the registry hands out `ggml_backend_rpc_add_server` under its own name, whose
    // signature `AddServer` repeats from ggml-rpc.h. The endpoint is a valid C string for the
    // call; the registry returned (or null) is owned by ggml and never freed, and so are its
    // devices.
    unsafe {
        let add_server: AddServer = std::mem::transmute::<*mut std::ffi::c_void, AddServer>(address);
        let registry = add_server(c_endpoint.as_ptr());
        if registry.is_null() {
            return Err(SysError::Rpc(format!("the RPC worker at {endpoint} offers no device")));
        }
        let count = raw::ggml_backend_reg_dev_count(registry);
        Ok((0..count).map(|index| DeviceHandle(raw::ggml_backend_reg_dev_get(registry, index))).collect())
    }
}
