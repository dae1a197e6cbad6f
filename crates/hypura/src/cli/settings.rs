//! Settings: flags, environment and defaults resolved into library types.
use std::path::PathBuf;

use anyhow::Context;

use crate::cli::args::{ModelArgs, PlanArgs, SamplingArgs};
use crate::engine::{EngineOptions, SamplerParams};
use crate::hw::{default_cache_dir, format_bytes, machine_key, memory_info, ModelRecords, ProfileCache};
use crate::model::Inventory;
use crate::plan::{self, MachineFacts, Mode, ModeChoice, Plan, PlanOptions};

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

/// Engine options for a model: flags, plus the plan for this machine's memory.
pub fn engine_options(args: &ModelArgs, model: &std::path::Path) -> anyhow::Result<EngineOptions> {
    Ok(engine_setup(args, model)?.0)
}

/// As `engine_options`, with the machine facts the plan was made from.
pub fn engine_setup(args: &ModelArgs, model: &std::path::Path) -> anyhow::Result<(EngineOptions, MachineFacts)> {
    let inventory = Inventory::open(model)?;
    let facts = machine_facts(&args.plan, model, threads(args.threads))?;
    let io_workers = facts.read_queue_depth.map_or(DEFAULT_IO_WORKERS, |depth| depth as usize);
    let plan = plan_with(&inventory, &args.plan, args.context, args.batch_size, &facts)?;
    let options = EngineOptions {
        n_ctx: args.context,
        n_batch: args.batch_size,
        n_ubatch: args.batch_size,
        n_threads: args.threads,
        repack: !args.no_repack,
        load_mode: if args.no_mmap { hypura_sys::LoadMode::Read } else { hypura_sys::LoadMode::Mmap },
        plan: Some(plan),
        io_workers,
        trace_routing: args.plan.trace.is_some(),
        ..EngineOptions::default()
    };
    Ok((options, facts))
}

/// CPU threads a context gets: the flag, or llama.cpp's default.
pub fn threads(flag: Option<i32>) -> i32 {
    flag.unwrap_or_else(|| hypura_sys::ContextParams::default().n_threads)
}

/// Keep the compute time per generated token of a streaming run for the next plan of this
/// model. Failures to write are logged, never fatal (the record is a hint).
pub fn record_compute(model: &std::path::Path, threads: i32, streamed: bool, seconds: f64, tokens: u64) {
    if !streamed || tokens < 2 {
        return;
    }
    let result = ModelRecords::new(default_cache_dir())
        .update(model, |record| record.add_compute(threads.max(1) as u32, seconds * tokens as f64, tokens));
    if let Err(error) = result {
        tracing::warn!("could not record the measured compute time: {error}");
    }
}

/// Reader threads when neither the flag nor a profile says.
const DEFAULT_IO_WORKERS: usize = 4;

/// Reader threads: the flag, or the queue depth of the profile's best direct reads.
fn io_workers(args: &PlanArgs, disk: Option<&crate::hw::DiskProfile>) -> usize {
    args.io_workers
        .or_else(|| disk.map(|disk| disk.best_direct.queue_depth as usize))
        .unwrap_or(DEFAULT_IO_WORKERS)
        .clamp(1, 64)
}

/// Parse a byte size: `8GiB`, `4.5G`, `512MiB`, `300MB`, `1000000`. Binary units for both
/// spellings of K/M/G/T (as memory sizes usually are), decimal for KB/MB/GB/TB.
pub fn parse_bytes(text: &str) -> anyhow::Result<u64> {
    let trimmed = text.trim();
    let split = trimmed.find(|character: char| !(character.is_ascii_digit() || character == '.')).unwrap_or(trimmed.len());
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

/// What the default budget leaves for the rest of the machine: 10% of what is available,
/// between 256 MiB and 2 GiB.
pub fn headroom_bytes(available: u64) -> u64 {
    (available / 10).clamp(256 << 20, 2 << 30)
}

/// Host memory a GPU backend's runtime takes beside the plan's buffers: a CUDA run of a tiny
/// model peaked at 497 MiB resident on the H200 machine (driver, runtime and cuBLAS state).
const GPU_RUNTIME_HOST_BYTES: u64 = 512 << 20;

/// The default memory budget: what is available less the headroom, and less the GPU
/// runtime's own host memory when a GPU is used.
pub fn default_memory_budget(available: u64, gpu: bool) -> u64 {
    let runtime = if gpu { GPU_RUNTIME_HOST_BYTES } else { 0 };
    available.saturating_sub(headroom_bytes(available) + runtime)
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

/// The machine facts the planner needs: the budget (flag, or available memory minus headroom),
/// the disk bandwidth from the cached profile (if `hypura profile` has run), the reader
/// threads, and the compute time per token earlier runs of this model measured.
pub fn machine_facts(args: &PlanArgs, model: &std::path::Path, threads: i32) -> anyhow::Result<MachineFacts> {
    let gpu_free = dedicated_gpu_free(&hypura_sys::Backend::get().devices());
    let gpu_budget_bytes = gpu_budget(args, &gpu_free)?;
    // Asking a GPU for its free memory already starts its runtime in this process, so its host
    // memory is kept whether or not the plan uses the GPU.
    let memory_budget_bytes = match &args.memory_budget {
        Some(text) => parse_bytes(text).context("--memory-budget")?,
        None => default_memory_budget(memory_info().effective_available_bytes(), !gpu_free.is_empty()),
    };
    let disk = ProfileCache::new(default_cache_dir()).load(&machine_key()).and_then(|profile| profile.disk);
    let disk_bytes_per_sec = disk.as_ref().map(|disk| disk.best_direct.bytes_per_sec);
    let disk_read_points = disk
        .iter()
        .flat_map(|disk| disk.direct.iter())
        .map(|point| (point.block_bytes * u64::from(point.queue_depth), point.bytes_per_sec))
        .collect();
    let compute_seconds_per_token = ModelRecords::new(default_cache_dir()).load(model).compute_seconds_per_token(threads.max(1) as u32);
    Ok(MachineFacts {
        memory_budget_bytes,
        disk_bytes_per_sec,
        read_queue_depth: Some(io_workers(args, disk.as_ref()) as u32),
        disk_read_points,
        compute_seconds_per_token,
        gpu_budget_bytes,
        gpu_runtime_bytes: if gpu_budget_bytes > 0 { GPU_RUNTIME_DEVICE_BYTES } else { 0 },
    })
}

/// Device memory the GPU backend takes beyond the plan's buffers: on the H200 machine, moe-30b
/// with an 8 GiB budget used 297 MiB more than planned, dense-8b with 2 GiB 20 MiB more. Most
/// of that is the compute buffer's copy of a host layer's weights for prompt batches (one
/// moe-30b layer's experts are 349 MiB), which the plan reserves instead where it is larger;
/// the rest is kernels loaded on first use and memory pools.
const GPU_RUNTIME_DEVICE_BYTES: u64 = 384 << 20;

/// Free memory of each dedicated GPU. Devices that share host memory get no tier of their own:
/// the host budget covers them.
pub fn dedicated_gpu_free(devices: &[hypura_sys::DeviceInfo]) -> Vec<u64> {
    devices.iter().filter(|device| device.kind == hypura_sys::DeviceKind::Gpu).map(|device| device.free_bytes).collect()
}

/// `--gpu-budget`, or the default for GPUs with `gpu_free` bytes free.
fn gpu_budget(args: &PlanArgs, gpu_free: &[u64]) -> anyhow::Result<u64> {
    let Some(text) = &args.gpu_budget else {
        let budget = default_gpu_budget(gpu_free);
        if gpu_free.len() > 1 {
            tracing::warn!(
                "{} GPUs: the default GPU budget is the smallest one's free memory less 1 GiB ({}), since llama.cpp may put every planned layer on one of them; --gpu-budget sets it",
                gpu_free.len(),
                format_bytes(budget)
            );
        }
        return Ok(budget);
    };
    let bytes = parse_gpu_budget(text).context("--gpu-budget")?;
    match gpu_free.iter().copied().min() {
        // A plan with a GPU tier would count the KV cache and the GPU's tensors in device
        // memory that does not exist.
        None if bytes > 0 => {
            tracing::warn!("--gpu-budget {text}: ggml sees no dedicated GPU here, so everything runs on the CPU");
            Ok(0)
        }
        Some(free) if bytes > free => {
            tracing::warn!("--gpu-budget {text} is more than the {} free on a GPU here: loading may run out of device memory", format_bytes(free));
            Ok(bytes)
        }
        _ => Ok(bytes),
    }
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

/// What the default GPU budget leaves free on each device (llama.cpp's fit leaves the same).
const GPU_RESERVE_BYTES: u64 = 1 << 30;

/// The default GPU budget for dedicated GPUs with `gpu_free` bytes free: one GPU's free
/// memory less a reserve (the smallest GPU's, where there are several). llama.cpp splits the
/// layers across GPUs by their free memory while the plan fills layers from the last one down,
/// so what the plan puts on the GPU can all land on the last card: one card's worth is what is
/// sure to fit.
pub fn default_gpu_budget(gpu_free: &[u64]) -> u64 {
    gpu_free.iter().map(|free| free.saturating_sub(GPU_RESERVE_BYTES)).min().unwrap_or(0)
}

pub fn make_plan(inventory: &Inventory, args: &PlanArgs, n_ctx: u32, n_ubatch: u32, threads: i32) -> anyhow::Result<Plan> {
    plan_with(inventory, args, n_ctx, n_ubatch, &machine_facts(args, &inventory.path, threads)?)
}

/// The plan for these flags and machine facts (the profile read once by the caller).
fn plan_with(inventory: &Inventory, args: &PlanArgs, n_ctx: u32, n_ubatch: u32, facts: &MachineFacts) -> anyhow::Result<Plan> {
    let cache_policy = crate::store::CachePolicy::parse(&args.cache_policy)
        .with_context(|| format!("unknown cache policy {:?}: use slru or lru", args.cache_policy))?;
    let options = PlanOptions {
        mode: parse_mode(&args.mode)?,
        n_ctx,
        n_ubatch,
        window_layers: args.window.map(|layers| layers.max(1)),
        expert_cache_units: args.expert_cache,
        expert_prefetch: match args.prefetch.as_str() {
            "auto" => None,
            "on" => Some(true),
            "off" => Some(false),
            other => anyhow::bail!("unknown --prefetch {other:?}: use auto, on or off"),
        },
        cache_policy,
    };
    Ok(plan::plan(inventory, facts, &options)?)
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
    fn headroom_is_a_tenth_within_limits() {
        assert_eq!(headroom_bytes(1 << 30), 256 << 20);
        assert_eq!(headroom_bytes(10 << 30), 1 << 30);
        assert_eq!(headroom_bytes(100 << 30), 2 << 30);
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
    fn a_gpu_leaves_room_for_its_runtime_in_the_default_budget() {
        assert_eq!(default_memory_budget(10 << 30, false), 9 << 30);
        assert_eq!(default_memory_budget(10 << 30, true), (9 << 30) - (512 << 20));
        assert_eq!(default_memory_budget(256 << 20, true), 0);
    }

    #[test]
    fn the_default_gpu_budget_is_one_dedicated_gpu_less_a_reserve() {
        let device = |kind, free: u64| hypura_sys::DeviceInfo { name: String::new(), description: String::new(), kind, free_bytes: free, total_bytes: free };
        let devices = [
            device(hypura_sys::DeviceKind::Cpu, 64 << 30),
            device(hypura_sys::DeviceKind::Gpu, 24 << 30),
            device(hypura_sys::DeviceKind::Gpu, 12 << 30),
            device(hypura_sys::DeviceKind::Gpu, 512 << 20),
        ];
        let budget = |devices: &[hypura_sys::DeviceInfo]| default_gpu_budget(&dedicated_gpu_free(devices));
        assert_eq!(budget(&devices[..2]), 23 << 30);
        // Several GPUs: the smallest one's, since the plan's layers may all land on one card.
        assert_eq!(budget(&devices[..3]), 11 << 30);
        assert_eq!(budget(&devices), 0);
        assert_eq!(budget(&devices[..1]), 0);
    }

    #[test]
    fn modes_parse() {
        assert_eq!(parse_mode("dense-stream").unwrap(), ModeChoice::Forced(Mode::DenseStream));
        assert_eq!(parse_mode("auto").unwrap(), ModeChoice::Auto);
        assert!(parse_mode("fast").is_err());
    }
}
