//! The hashes that name the cache's files: the settings digest a model's chain starts from, and
//! each step of the chain over a block's tokens.
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::time::SystemTime;

use hypura_sys::Token;
use sha2::{Digest, Sha256};

use super::{io_error, Hash, PromptCacheError};
use crate::engine::Engine;

pub(super) fn chain_step(previous: &Hash, tokens: &[Token]) -> Hash {
    let mut hasher = Sha256::new();
    hasher.update(previous);
    for token in tokens {
        hasher.update(token.to_le_bytes());
    }
    hasher.finalize().into()
}

/// Everything the KV cache's bits depend on: the model file (its path, size, modification time
/// and first MiB), this build (the executable's size and modification time), the kernels
/// (repacking, batch invariance, the micro-batch), and which tensors compute on a GPU or
/// another machine. Memory budgets and streaming are left out: every mode computes the same
/// bits (the bit-identity tests).
pub fn settings_digest(engine: &Engine) -> Result<Hash, PromptCacheError> {
    let model = &engine.inventory().path;
    let mut hasher = Sha256::new();
    hasher.update(b"hypura prompt cache 1\n");
    let identity = |path: &Path| -> Result<String, PromptCacheError> {
        let canonical = std::fs::canonicalize(path).map_err(io_error(path))?;
        let metadata = std::fs::metadata(&canonical).map_err(io_error(path))?;
        let modified = metadata
            .modified()
            .ok()
            .and_then(|time| time.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |since| since.as_nanos());
        Ok(format!("{} {} {modified}\n", canonical.display(), metadata.len()))
    };
    hasher.update(identity(model)?);
    let mut head = Vec::with_capacity(1 << 20);
    File::open(model).and_then(|file| file.take(1 << 20).read_to_end(&mut head)).map_err(io_error(model))?;
    hasher.update(&head);
    let executable = std::env::current_exe().map_err(io_error(Path::new("the executable")))?;
    hasher.update(identity(&executable)?);
    hasher.update(env!("CARGO_PKG_VERSION"));
    let options = engine.options();
    hasher.update(format!(
        "repacked {} batch_invariant {} n_ubatch {} n_gpu_layers {} kv {} {}\n",
        engine.repacked(),
        options.batch_invariant,
        engine.n_ubatch(),
        if options.plan.is_some() { 0 } else { options.n_gpu_layers },
        options.kv.k,
        options.kv.v,
    ));
    if let Some(plan) = &options.plan {
        for tensor in &plan.tensors {
            if matches!(tensor.tier, crate::plan::Tier::Gpu | crate::plan::Tier::Remote) {
                hasher.update(format!("{} {:?}\n", tensor.name, tensor.tier));
            }
        }
        // The device's expert pool computes its layers' routed experts there.
        if let Some(pool) = plan.gpu.as_ref().and_then(|gpu| gpu.expert_pool.as_ref()) {
            hasher.update(format!("expert pool {:?}\n", pool.layers));
        }
    }
    Ok(hasher.finalize().into())
}
