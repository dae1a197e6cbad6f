//! What residency's failures are (`ResidencyError`), and the latch a stream driver's eval hook
//! records its first failure in, raising the abort flag the decode checks.
use std::sync::{Arc, Mutex};

use crate::io::IoError;
use crate::sync::Lock;

#[derive(Debug, thiserror::Error)]
pub enum ResidencyError {
    #[error("reading stream unit {unit} failed: {reason}")]
    Read { unit: usize, reason: String },
    #[error("stream unit {unit} does not exist (there are {count})")]
    NoSuchUnit { unit: usize, count: usize },
    #[error("layer {layer} picked {picked} experts in one batch, more than the expert cache's {capacity}")]
    CacheTooSmall { layer: usize, picked: usize, capacity: usize },
    #[error(transparent)]
    Io(#[from] IoError),
    /// The device's expert pool could not be set up or serve a layer.
    #[error("the device's expert pool: {0}")]
    Pool(String),
    /// A pooled layer's expert matmuls came without the router's ids rewritten to slots: the
    /// graph did not stop at `ffn_moe_weights` first, so the pool cannot serve it.
    #[error("layer {layer}'s expert matmul ran before its experts were placed in the device's pool (no ffn_moe_weights node before it in llama.cpp's graph); use --gpu-experts layers")]
    PoolUnserved { layer: usize },
    /// The node after a streamed layer's router weights was its expert matmul: the graph left
    /// no node to stop at before the matmul reads the experts.
    #[error("layer {layer}'s expert matmul {node} directly follows its router's weights in llama.cpp's graph, so its experts cannot be made ready before it runs; this architecture cannot stream its experts")]
    Unserved { layer: usize, node: String },
}

/// The first error of a stream driver's eval hook, and the abort flag it raises. The hook
/// cannot fail the graph itself (see `hypura_sys::EvalHook`), so it records the error here and
/// sets the flag, which sessions register with their context to abort the decode.
#[derive(Debug, Default)]
pub struct FailureLatch {
    failure: Mutex<Option<ResidencyError>>,
    failed: Arc<std::sync::atomic::AtomicBool>,
}

impl FailureLatch {
    /// Record the first error and raise the abort flag.
    pub fn fail(&self, error: ResidencyError) {
        self.failure.locked().get_or_insert(error);
        self.failed.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The recorded error, if any (taken once; lowers the flag).
    pub fn take(&self) -> Option<ResidencyError> {
        let failure = self.failure.locked().take();
        self.failed.store(false, std::sync::atomic::Ordering::Relaxed);
        failure
    }

    /// The flag a session registers as an abort flag of its context.
    pub fn abort_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.failed.clone()
    }
}
