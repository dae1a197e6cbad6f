//! Settings: flags, environment and defaults resolved into library types.
use std::path::PathBuf;

use anyhow::Context;

use crate::cli::args::{ModelArgs, SamplingArgs};
use crate::engine::{EngineOptions, SamplerParams};

/// The model path, or the default model that `scripts/fetch-test-model` put in the cache.
pub fn model_path(model: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = model {
        return Ok(path.clone());
    }
    let path = crate::hw::default_cache_dir().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        anyhow::bail!("no model given and the default model {} is missing; run scripts/fetch-test-model", path.display());
    }
    Ok(path)
}

pub fn engine_options(args: &ModelArgs) -> EngineOptions {
    EngineOptions {
        n_ctx: args.context,
        n_batch: args.batch_size,
        n_ubatch: args.batch_size,
        n_threads: args.threads,
        repack: !args.no_repack,
        ..EngineOptions::default()
    }
}

pub fn sampler_params(args: &SamplingArgs) -> anyhow::Result<SamplerParams> {
    let params = SamplerParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        penalty_last_n: args.repeat_last_n,
        seed: args.seed.unwrap_or_else(rand_seed),
    };
    params.validate().context("sampling flags")?;
    Ok(params)
}

fn rand_seed() -> u32 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|elapsed| elapsed.subsec_nanos()).unwrap_or(0);
    nanos ^ std::process::id()
}
