//! `hypura-forge PRESET -o FILE`: write a synthetic model.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use hypura_forge::{plan_model, preset, presets, write_model, Arch, QuantMix};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Parser, Debug)]
#[command(name = "hypura-forge", version, about = "Write synthetic GGUF models that llama.cpp loads as real architectures")]
struct Args {
    /// Preset: dense-1b, dense-8b, moe-8x, moe-30b, qwen3.6-35b-a3b, gpt-oss-20b, glm-4.5-air,
    /// glm-4.5, deepseek4-flash, and tiny-<arch> for tests (an unknown name lists them all).
    preset: String,
    /// Output file.
    #[arg(short, long, required_unless_present = "dry_run")]
    output: Option<PathBuf>,
    /// Print the file's size and tensor count without writing it.
    #[arg(long)]
    dry_run: bool,
    /// Seed for every weight.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Quantization mix: q4_k_m, q8_0 or f16.
    #[arg(long, default_value = "q4_k_m")]
    quant: String,
    /// Router skew (0 = uniform routing).
    #[arg(long, default_value_t = 0.0)]
    router_skew: f32,
    /// Router temporal locality (0 = independent per token).
    #[arg(long, default_value_t = 0.0)]
    router_locality: f32,
    /// Scale of each layer's update to the residual stream (1 = unit variance; real models add
    /// little per layer, e.g. 0.1).
    #[arg(long, default_value_t = 1.0)]
    residual_scale: f32,
    /// Override the architecture (its `general.architecture` name, e.g. llama, qwen3moe).
    #[arg(long)]
    arch: Option<String>,
    #[arg(long)]
    n_layer: Option<u64>,
    #[arg(long)]
    n_embd: Option<u64>,
    #[arg(long)]
    n_head: Option<u64>,
    #[arg(long)]
    n_head_kv: Option<u64>,
    #[arg(long)]
    head_dim: Option<u64>,
    /// Dense FFN width, or per-expert width for MoE.
    #[arg(long)]
    n_ff: Option<u64>,
    #[arg(long)]
    n_expert: Option<u64>,
    #[arg(long)]
    n_expert_used: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let Some(mut spec) = preset(&args.preset) else {
        bail!("unknown preset {:?}; presets: {}", args.preset, presets().join(", "));
    };
    spec.seed = args.seed;
    spec.router_skew = args.router_skew;
    spec.router_locality = args.router_locality;
    spec.residual_scale = args.residual_scale;
    spec.quant = QuantMix::parse(&args.quant).with_context(|| format!("unknown quantization {:?}", args.quant))?;
    if let Some(arch) = &args.arch {
        spec.arch = Arch::parse(arch).with_context(|| format!("unknown architecture {arch:?}"))?;
    }
    let shape = &mut spec.shape;
    let overrides = [
        (&mut shape.n_layer, args.n_layer),
        (&mut shape.n_embd, args.n_embd),
        (&mut shape.n_head, args.n_head),
        (&mut shape.n_head_kv, args.n_head_kv),
        (&mut shape.head_dim, args.head_dim),
        (&mut shape.n_ff, args.n_ff),
        (&mut shape.n_expert, args.n_expert),
        (&mut shape.n_expert_used, args.n_expert_used),
    ];
    for (field, value) in overrides {
        if let Some(value) = value {
            *field = value;
        }
    }
    if args.dry_run {
        let summary = plan_model(&spec).with_context(|| format!("planning {}", spec.name))?;
        println!("{} ({} {}): {} tensors, {} bytes", spec.name, spec.arch.name(), spec.quant, summary.tensor_count, summary.file_bytes);
        return Ok(());
    }
    let output = args.output.expect("clap requires it without --dry-run");
    let bar = ProgressBar::new(0);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(ProgressStyle::with_template("{spinner} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {wide_bar}")?);
    let started = Instant::now();
    let summary = write_model(&spec, &output, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("forging {}", output.display()))?;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "wrote {} ({}, {} {}, {} tensors, {} bytes) in {:.1} s ({:.0} MB/s)",
        output.display(),
        spec.name,
        spec.arch.name(),
        spec.quant,
        summary.tensor_count,
        summary.file_bytes,
        seconds,
        summary.file_bytes as f64 / seconds / 1e6
    );
    Ok(())
}
