//! `hypura bench MODEL`: Hypura against plain llama.cpp, alternating, in one process.
use anyhow::Context;

use crate::bench::{self, BenchOptions, PeerConfig, PeerPlacement};
use crate::cli::args::BenchArgs;
use crate::cli::settings;
use crate::format::format_bytes;

/// The baseline loads the whole model the way llama.cpp does; refuse it when that cannot fit.
const BASELINE_HEADROOM_BYTES: u64 = 4 << 30;

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let path = settings::model_path(args.model.as_deref().or(args.model_flag.as_deref()))?;
    let file_bytes = std::fs::metadata(&path).with_context(|| format!("reading {}", path.display()))?.len();
    let available = crate::hw::memory_info().effective_available_bytes();
    let baseline = !args.no_baseline;
    if baseline && !args.force && file_bytes > available.saturating_sub(BASELINE_HEADROOM_BYTES) {
        anyhow::bail!(
            "the llama.cpp baseline would map {} but only {} is available (minus {} headroom); pass --force to run it anyway, or --no-baseline",
            format_bytes(file_bytes),
            format_bytes(available),
            format_bytes(BASELINE_HEADROOM_BYTES)
        );
    }
    let setup = settings::setup(&args.model_args, &path)?;
    let routes_experts = setup.inventory.hparams.routes_experts();
    let (engine, facts) = (setup.options, setup.facts);
    let threads = settings::threads(engine.n_threads);
    let placement = PeerPlacement::parse(&args.baseline_placement, engine.plan.as_ref(), facts.gpu_budget_bytes)
        .with_context(|| {
            format!(
                "unknown --baseline-placement {:?}: use default, fit, exps-cpu, n-cpu-moe:N or same",
                args.baseline_placement
            )
        })?;
    // With --rpc the baseline is llama.cpp's own --rpc on the same workers. A worker serves one
    // client at a time, so the two sides cannot share them in one process.
    let devices: Vec<hypura_sys::DeviceHandle> =
        engine.remote.iter().flat_map(|workers| workers.devices.iter().map(|device| device.device)).collect();
    if !devices.is_empty() && baseline && !args.baseline_only {
        anyhow::bail!("with --rpc, run each side in its own process (--no-baseline, then --baseline-only): an RPC worker serves one client at a time");
    }
    let peer = baseline.then_some(PeerConfig {
        load_mode: if args.baseline_no_mmap { crate::engine::LoadMode::Read } else { crate::engine::LoadMode::Mmap },
        repack: !args.baseline_no_repack,
        placement,
        devices,
        kv: engine.kv,
    });
    let options = BenchOptions {
        n_prompt: args.n_prompt,
        n_gen: args.n_gen,
        reps: args.reps.max(1),
        hypura: !args.baseline_only,
        peer,
        engine,
        threads,
        disk_bytes_per_sec: facts.profile_disk_bytes_per_sec,
        device_resident_seconds_per_token: facts.device_resident_seconds_per_token(),
        cpu_bytes_per_sec: facts.cpu_bytes_per_sec,
    };
    let report = bench::run(&path, &options, &|stage| tracing::info!("bench: {stage}"))?;
    // A run with remote layers measured other machines and links too: not this machine's
    // compute for the model.
    if report.link_bytes_per_token.is_none() && !args.baseline_only {
        crate::setup::record_run(
            &path,
            &crate::setup::RunMeasurements {
                threads,
                streamed: report.bytes_read_per_token.is_some(),
                decode_seconds_per_token: report.compute_seconds_per_token,
                decode_tokens: report.generated_tokens,
                prompt_seconds: report.prompt_seconds,
                prompt_tokens: report.prompt_tokens,
                routing: report.reuse.clone(),
                read_bytes: report.read_bytes,
                busy_seconds: report.busy_seconds,
                host_share: report.prediction.as_ref().map_or(1.0, |prediction| prediction.host_share),
                touched_bytes_per_token: report
                    .prediction
                    .as_ref()
                    .map(|prediction| prediction.touched_bytes_per_token),
                routes_experts,
                expert_reads: report.expert_reads,
                pool: report.pool_limit.map(|pool| pool.work),
                pooled: report.pool_limit.is_some(),
            },
        );
    }
    print!("{}", bench::render(&report));
    if let Some(json) = &args.json {
        std::fs::write(json, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", json.display()))?;
    }
    if let Some(svg) = &args.svg {
        let picture = bench::picture::svg(&report).map_err(|error| anyhow::anyhow!("drawing the picture: {error}"))?;
        std::fs::write(svg, picture).with_context(|| format!("writing {}", svg.display()))?;
    }
    Ok(())
}

/// `hypura summary-picture SUMMARY --svg FILE` (hidden): `scripts/bench/bench-limited`'s picture.
pub fn summary_picture(args: &crate::cli::args::SummaryPictureArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.summary).with_context(|| format!("reading {}", args.summary.display()))?;
    let summary: bench::picture::Summary = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench-limited summary", args.summary.display()))?;
    let picture =
        bench::picture::summary_svg(&summary).map_err(|error| anyhow::anyhow!("drawing the picture: {error}"))?;
    std::fs::write(&args.svg, picture).with_context(|| format!("writing {}", args.svg.display()))?;
    Ok(())
}
