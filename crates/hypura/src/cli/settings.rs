//! Settings: flags, environment and defaults resolved into library types. What a run's flags
//! become is a `RunSpec`; the library assembles the plan and the engine from it.
use std::path::PathBuf;

use anyhow::Context;

use crate::cli::args::{ModelArgs, PlanArgs, PromptCacheArgs, SamplingArgs, SpeculativeArgs};
use crate::engine::SamplerParams;
use crate::plan::{Mode, ModeChoice, PlanOptions};
use crate::setup::{RunSpec, Setup};

/// The default model's file name, as `scripts/fetch-model` stores it in the cache: an instruct
/// model whose template renders tools.
pub const DEFAULT_MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// The model a command names: a GGUF path, or the name of a model pulled by Ollama (as
/// `ollama run NAME` takes it); with none, the default model `scripts/fetch-model` put in the
/// cache.
pub fn model_path(model: Option<&str>) -> anyhow::Result<PathBuf> {
    let Some(model) = model else {
        let path = crate::hw::default_cache_dir().join("models").join(DEFAULT_MODEL);
        if !path.exists() {
            anyhow::bail!(
                "no model given and the default model {} is missing; run scripts/fetch-model",
                path.display()
            );
        }
        return Ok(path);
    };
    let path = PathBuf::from(model);
    if path.exists() {
        return Ok(path);
    }
    if let Some(path) = crate::cli::models::local_path(model)? {
        return Ok(path);
    }
    let catalog = crate::server::Catalog {
        ollama_stores: crate::server::Catalog::default_ollama_store().into_iter().collect(),
        ..crate::server::Catalog::default()
    };
    match catalog.resolve(model) {
        Ok(entry) => Ok(entry.path),
        Err(_) => anyhow::bail!(
            "{model} is neither a file nor a model pulled by Ollama (looked in {})",
            crate::server::Catalog::default_ollama_store()
                .map_or("no Ollama store".into(), |store| store.display().to_string())
        ),
    }
}

/// The prompt batch when `--batch-size` is not given (llama.cpp's default).
const DEFAULT_BATCH: u32 = 512;

/// The run the flags ask for, in library types (`setup` turns it into a plan and
/// engine options).
pub fn run_spec(args: &ModelArgs) -> anyhow::Result<RunSpec> {
    Ok(RunSpec {
        n_batch: args.batch_size.unwrap_or(DEFAULT_BATCH),
        grow_batch: args.batch_size.is_none(),
        repack: !args.no_repack,
        load_mode: if args.no_mmap { crate::engine::LoadMode::Read } else { crate::engine::LoadMode::Mmap },
        batch_invariant: args.batch_invariant.unwrap_or(false),
        speculation: speculation(&args.speculative)?,
        ..plan_spec(&args.plan, args.context, args.threads)?
    })
}

/// The speculative flags, or None without a draft model or a drafter type. The draft length
/// left unset is chosen with the plan (`setup`).
pub fn speculation(args: &SpeculativeArgs) -> anyhow::Result<Option<crate::engine::Speculation>> {
    if args.model_draft.is_none() && args.spec_type.is_empty() {
        return Ok(None);
    }
    if let Some(unknown) = args.spec_type.iter().find(|name| !hypura_sys::SPECULATIVE_TYPES.contains(&name.as_str())) {
        anyhow::bail!("unknown --spec-type {unknown:?}: use {}", hypura_sys::SPECULATIVE_TYPES.join(", "));
    }
    let draft_model =
        args.model_draft.as_deref().map(|model| model_path(Some(model))).transpose().context("--model-draft")?;
    let mut speculation = crate::engine::Speculation::new(draft_model, args.spec_type.clone());
    // 0: chosen with the plan.
    speculation.params.n_max = args.draft_max.unwrap_or(0);
    speculation.params.n_min = args.draft_min;
    // Negative: chosen with the plan.
    speculation.params.p_min = args.draft_p_min.unwrap_or(-1.0);
    speculation.params.ngram_n = args.ngram_size_n;
    if args.draft_max == Some(0) {
        anyhow::bail!("--draft-max must be at least 1");
    }
    if args.draft_max.is_some_and(|n_max| args.draft_min > n_max) {
        anyhow::bail!("--draft-min ({}) is more than --draft-max ({})", args.draft_min, speculation.params.n_max);
    }
    Ok(Some(speculation))
}

/// `--prompt-cache`, its directory created and proved writable; None without the flag.
pub fn prompt_cache(args: &PromptCacheArgs) -> anyhow::Result<Option<crate::engine::prompt_cache::PromptCacheOptions>> {
    let Some(dir) = &args.prompt_cache else { return Ok(None) };
    let options = crate::engine::prompt_cache::PromptCacheOptions {
        dir: dir.clone(),
        max_bytes: parse_bytes(&args.prompt_cache_size).context("--prompt-cache-size")?,
    };
    options.check().context("--prompt-cache")?;
    Ok(Some(options))
}

/// The part of a run the planner reads (`inspect` has only these flags).
pub fn plan_spec(args: &PlanArgs, context: Option<u32>, threads: Option<i32>) -> anyhow::Result<RunSpec> {
    Ok(RunSpec {
        n_ctx_seq: context,
        n_threads: threads,
        memory_budget_bytes: args.memory_budget.as_deref().map(parse_bytes).transpose().context("--memory-budget")?,
        gpu_budget_bytes: args.gpu_budget.as_deref().map(parse_gpu_budget).transpose().context("--gpu-budget")?,
        io_workers: args.io_workers,
        trace_routing: args.trace.is_some(),
        plan: plan_options(args)?,
        remote: remote_workers(args)?,
        ..RunSpec::default()
    })
}

/// Set the key this process's RPC links prove (`--rpc-key-file`, else `HYPURA_RPC_KEY`).
pub fn use_rpc_key(file: Option<&std::path::Path>) -> anyhow::Result<()> {
    let key = crate::remote::secure::Key::from_file_or_environment(file).map_err(anyhow::Error::msg)?;
    crate::remote::secure::use_client_key(key);
    Ok(())
}

/// The RPC workers of `--rpc`, checked and connected; None without the flag.
pub fn remote_workers(args: &PlanArgs) -> anyhow::Result<Option<std::sync::Arc<crate::remote::Workers>>> {
    if args.rpc.is_empty() {
        return Ok(None);
    }
    use_rpc_key(args.rpc_key_file.as_deref())?;
    let delay = match args.rpc_link_delay {
        Some(ms) if !(0.0..=10_000.0).contains(&ms) => {
            anyhow::bail!("--rpc-link-delay {ms} must be between 0 and 10000 ms")
        }
        Some(ms) => std::time::Duration::from_secs_f64(ms / 1e3),
        None => std::time::Duration::ZERO,
    };
    Ok(Some(crate::remote::Workers::connect(&args.rpc, delay, true)?))
}

/// A duration flag in Ollama's forms (`10s`, `1m30s`, or seconds), not negative.
pub fn duration(text: &str) -> anyhow::Result<std::time::Duration> {
    match crate::server::wire::KeepAlive::parse(&serde_json::Value::String(text.to_string())) {
        Ok(crate::server::wire::KeepAlive::For(duration)) => Ok(duration),
        Ok(crate::server::wire::KeepAlive::Forever) => anyhow::bail!("{text:?} is negative"),
        Err(error) => anyhow::bail!("{error}"),
    }
}

/// The flags' plan, for this machine: facts read once, plan, engine options.
pub fn setup(args: &ModelArgs, model: &std::path::Path) -> anyhow::Result<Setup> {
    Ok(crate::setup::prepare(model, &run_spec(args)?)?)
}

/// CPU threads a context gets: the flag, or llama.cpp's default.
pub fn threads(flag: Option<i32>) -> i32 {
    RunSpec { n_threads: flag, ..RunSpec::default() }.threads()
}

/// Parse a byte size: `8GiB`, `4.5G`, `512MiB`, `300MB`, `1000000`. Binary units for both
/// spellings of K/M/G/T (as memory sizes usually are), decimal for KB/MB/GB/TB.
pub fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    let trimmed = text.trim();
    let split =
        trimmed.find(|character: char| !(character.is_ascii_digit() || character == '.')).unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number.parse().with_context(|| format!("{text:?} is not a size like 8GiB or 512MB"))?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => anyhow::bail!("unknown size unit {other:?} in {text:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"),
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        anyhow::bail!("size {text:?} is out of range");
    }
    Ok(bytes as u64)
}

pub fn parse_mode(text: &str) -> anyhow::Result<ModeChoice> {
    Ok(match text {
        "auto" => ModeChoice::Auto,
        "resident" => ModeChoice::Forced(Mode::Resident),
        "dense-stream" => ModeChoice::Forced(Mode::DenseStream),
        "expert-stream" => ModeChoice::Forced(Mode::ExpertStream),
        other => anyhow::bail!("unknown mode {other:?}: use auto, resident, dense-stream or expert-stream"),
    })
}

/// A GPU budget: a size, or zero in any unit ("0", "0GiB"), which turns the GPU tier off.
pub fn parse_gpu_budget(text: &str) -> anyhow::Result<u64> {
    let text = text.trim();
    let rest = text.trim_start_matches(['0', '.']);
    if text.starts_with('0') && rest.chars().next().is_none_or(|next| next.is_ascii_alphabetic() || next == ' ') {
        return Ok(0);
    }
    parse_bytes(text)
}

/// Mode, window, expert cache and prefetch flags.
fn plan_options(args: &PlanArgs) -> anyhow::Result<PlanOptions> {
    let cache_policy = match args.cache_policy.as_str() {
        "auto" => None,
        name => Some(
            crate::store::CachePolicy::parse(name)
                .with_context(|| format!("unknown cache policy {name:?}: use auto, slru or lru"))?,
        ),
    };
    Ok(PlanOptions {
        mode: parse_mode(&args.mode)?,
        window_layers: args.window.map(|layers| layers.max(1)),
        expert_cache_units: args.expert_cache,
        expert_prefetch: match args.prefetch.as_str() {
            "auto" => None,
            "on" => Some(true),
            "off" => Some(false),
            other => anyhow::bail!("unknown --prefetch {other:?}: use auto, on or off"),
        },
        cache_policy,
        gpu_experts: match args.gpu_experts.as_str() {
            "auto" => None,
            "layers" => Some(crate::plan::GpuExperts::Layers),
            "pool" => Some(crate::plan::GpuExperts::Pool),
            "split" => Some(crate::plan::GpuExperts::Split),
            other => anyhow::bail!("unknown --gpu-experts {other:?}: use auto, split, pool or layers"),
        },
        kv: crate::plan::KvTypes {
            k: crate::plan::KvTypes::parse(&args.cache_type_k).map_err(anyhow::Error::msg).context("--cache-type-k")?,
            v: crate::plan::KvTypes::parse(&args.cache_type_v).map_err(anyhow::Error::msg).context("--cache-type-v")?,
        },
        ..PlanOptions::default()
    })
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
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("8G").unwrap(), 8 << 30);
        assert_eq!(parse_bytes("4.5g").unwrap(), (4.5 * (1u64 << 30) as f64) as u64);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("300MB").unwrap(), 300_000_000);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes(" 2 TiB ").unwrap(), 2 << 40);
        for bad in ["", "GiB", "-1G", "8 parsecs", "0", "1e400"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn a_gpu_budget_of_zero_in_any_unit_turns_the_tier_off() {
        for zero in ["0", "0GiB", " 0.0 MB", "00"] {
            assert_eq!(parse_gpu_budget(zero).unwrap(), 0, "{zero:?}");
        }
        assert_eq!(parse_gpu_budget("0.5GiB").unwrap(), 512 << 20);
        assert_eq!(parse_gpu_budget("8GiB").unwrap(), 8 << 30);
        assert!(parse_gpu_budget("lots").is_err());
    }

    #[test]
    fn modes_parse() {
        assert_eq!(parse_mode("dense-stream").unwrap(), ModeChoice::Forced(Mode::DenseStream));
        assert_eq!(parse_mode("auto").unwrap(), ModeChoice::Auto);
        assert!(parse_mode("fast").is_err());
    }
}
