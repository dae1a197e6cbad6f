//! llama.cpp's automatic fit (`--fit`): the placement its own tools choose for a device memory
//! target, used as a benchmark peer.
use std::ffi::CStr;
use std::path::Path;

use llama_cpp_sys_2 as raw;

use crate::backend::Backend;
use crate::context::ContextParams;
use crate::error::SysError;
use crate::model::ModelParams;

/// The placement llama.cpp's fit chose: layers on the GPU, and tensors kept in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct FitPlacement {
    pub n_gpu_layers: i32,
    /// Override patterns whose tensors stay in host memory (`Placement::host_patterns`).
    pub host_patterns: Vec<String>,
}

/// Ask llama.cpp's fit for a placement of `path` under `model` and `context` that leaves
/// `margin_bytes` free on every device (so free memory minus a budget emulates a smaller
/// card). It loads the model without allocating, several times: seconds, no device memory.
pub fn fit_placement(
    _backend: &Backend,
    path: &Path,
    model: &ModelParams,
    context: &ContextParams,
    margin_bytes: u64,
) -> Result<FitPlacement, SysError> {
    let c_path = crate::error::c_path(path)?;
    let mut model_params = model.to_raw();
    // The fit only changes what is still at llama.cpp's default: start from all layers.
    // SAFETY: returns a plain struct by value.
    model_params.n_gpu_layers = unsafe { raw::llama_model_default_params() }.n_gpu_layers;
    let mut context_params = context.to_raw();
    // SAFETY: plain getters of compile-time limits.
    let (max_devices, max_overrides) = unsafe { (raw::llama_max_devices(), raw::llama_max_tensor_buft_overrides()) };
    let mut tensor_split = vec![0f32; max_devices];
    let mut overrides =
        vec![
            raw::llama_model_tensor_buft_override { pattern: std::ptr::null(), buft: std::ptr::null_mut() };
            max_overrides
        ];
    let mut margins = vec![margin_bytes as usize; max_devices];
    crate::log::clear_last_error();
    // SAFETY: every buffer is as long as llama.cpp requires (llama_max_devices floats and
    // margins, llama_max_tensor_buft_overrides overrides) and outlives the call; the path is
    // NUL-terminated; no extra model (null). The fit writes the overrides' patterns as
    // pointers to static strings of libllama's common code, read below while loaded.
    let status = unsafe {
        raw::llama_rs_fit_params(
            c_path.as_ptr(),
            &mut model_params,
            &mut context_params,
            tensor_split.as_mut_ptr(),
            overrides.as_mut_ptr(),
            margins.as_mut_ptr(),
            context.n_ctx,
            std::ptr::null(),
            raw::GGML_LOG_LEVEL_INFO,
        )
    };
    if status != 0 {
        return Err(SysError::ModelLoad {
            path: path.to_path_buf(),
            reason: format!(
                "llama.cpp's fit found no placement (status {status}): {}",
                crate::log::take_last_error().unwrap_or_else(|| "no reason given".to_string())
            ),
        });
    }
    let mut host_patterns = Vec::new();
    for entry in overrides.iter().take_while(|entry| !entry.pattern.is_null()) {
        // SAFETY: a non-null buffer type written by the fit, owned by ggml's registry.
        if entry.buft.is_null() || !unsafe { raw::ggml_backend_buft_is_host(entry.buft) } {
            return Err(SysError::ModelLoad {
                path: path.to_path_buf(),
                reason: "llama.cpp's fit moved tensors to another device, which Hypura's peer does not reproduce"
                    .into(),
            });
        }
        // SAFETY: non-null, NUL-terminated, static (see above).
        host_patterns.push(unsafe { CStr::from_ptr(entry.pattern) }.to_string_lossy().into_owned());
    }
    Ok(FitPlacement { n_gpu_layers: model_params.n_gpu_layers, host_patterns })
}
