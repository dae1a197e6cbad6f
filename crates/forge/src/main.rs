//! `hypura-forge PRESET -o FILE`: write a synthetic model; `hypura-forge --from-dense FILE -o FILE`:
//! turn a real dense model into a mixture of experts.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use hypura_forge::{moe_from_dense, plan_model, preset, presets, write_model, Arch, FromDense, QuantMix};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Parser, Debug)]
#[command(
    name = "hypura-forge",
    version,
    about = "Write synthetic GGUF models that llama.cpp loads as real architectures"
)]
struct Args {
    /// Preset: dense-1b, dense-8b, moe-8x, moe-30b, qwen3.6-35b-a3b, gpt-oss-20b, glm-4.5-air,
    /// glm-4.5, deepseek4-flash, and tiny-<arch> for tests (an unknown name lists them all).
    #[arg(required_unless_present = "from_dense")]
    preset: Option<String>,
    /// Instead of a preset: a real dense model (qwen2 or llama) whose FFN neurons are clustered
    /// into experts by what they do on a calibration text, with a router fitted to predict each
    /// cluster's part from the layer's input. Takes --n-expert (default 8), --n-expert-used
    /// (default 2), --n-shared, --calibration and --seed.
    #[arg(long, value_name = "FILE", conflicts_with = "preset")]
    from_dense: Option<PathBuf>,
    /// Clusters that form the shared expert, with --from-dense (default: 1 for qwen2moe, which
    /// needs one; 0 for llama).
    #[arg(long, requires = "from_dense")]
    n_shared: Option<u64>,
    /// A text file the dense model reads to find which neurons work together and to fit the
    /// router, with --from-dense (default: a built-in mix of prose, code and dialogue).
    #[arg(long, value_name = "FILE", requires = "from_dense")]
    calibration: Option<PathBuf>,
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
    /// Router skew (0 = uniform popularity). Default: the preset's (an MoE preset's routing is
    /// calibrated to real models': `spec::RoutingDefaults::real`).
    #[arg(long)]
    router_skew: Option<f32>,
    /// Router temporal locality (0 = independent per token). Default: the preset's.
    #[arg(long)]
    router_locality: Option<f32>,
    /// Scale of each layer's update to the residual stream (1 = unit variance; real models add
    /// little per layer). Default: the preset's.
    #[arg(long)]
    residual_scale: Option<f32>,
    /// With varied text, how strongly each token's embedding carries its place's topic (0:
    /// none), and over how many tokens the topic drifts. Default: the preset's.
    #[arg(long)]
    topic_strength: Option<f32>,
    #[arg(long)]
    topic_span: Option<f32>,
    /// Greedy text from a random output matrix (it falls into short loops), instead of the
    /// walk through the vocabulary that an MoE preset's default makes (`ForgeSpec::varied_text`).
    #[arg(long)]
    looping_text: bool,
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
    if let Some(source) = &args.from_dense {
        return from_dense(source, &args);
    }
    let name = args.preset.as_deref().expect("clap requires a preset without --from-dense");
    let Some(mut spec) = preset(name) else {
        bail!("unknown preset {name:?}; presets: {}", presets().join(", "));
    };
    spec.seed = args.seed;
    spec.router_skew = args.router_skew.unwrap_or(spec.router_skew);
    spec.router_locality = args.router_locality.unwrap_or(spec.router_locality);
    spec.residual_scale = args.residual_scale.unwrap_or(spec.residual_scale);
    spec.varied_text &= !args.looping_text;
    spec.topic_strength = args.topic_strength.unwrap_or(spec.topic_strength);
    spec.topic_span = args.topic_span.unwrap_or(spec.topic_span);
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
        println!(
            "{} ({} {}): {} tensors, {} bytes",
            spec.name,
            spec.arch.name(),
            spec.quant,
            summary.tensor_count,
            summary.file_bytes
        );
        return Ok(());
    }
    let output = args.output.expect("clap requires it without --dry-run");
    let bar = ProgressBar::new(0);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(ProgressStyle::with_template(
        "{spinner} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta} {wide_bar}",
    )?);
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

fn from_dense(source: &std::path::Path, args: &Args) -> anyhow::Result<()> {
    let output = args.output.as_ref().context("--from-dense writes a file: give -o")?;
    let calibration = match &args.calibration {
        Some(path) => Some(std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?),
        None => None,
    };
    let options = FromDense {
        n_expert: args.n_expert.unwrap_or(8),
        n_expert_used: args.n_expert_used.unwrap_or(2),
        n_shared: args.n_shared,
        seed: args.seed,
        calibration,
    };
    let started = Instant::now();
    let summary = moe_from_dense(source, output, &options)
        .with_context(|| format!("turning {} into experts", source.display()))?;
    println!(
        "wrote {} ({}, {} layers of {} experts of {} neurons, {} used{}, down {}; {} tensors, {} bytes) in {:.1} s",
        output.display(),
        summary.architecture,
        summary.n_layer,
        options.n_expert,
        summary.expert_width,
        options.n_expert_used,
        if summary.shared_width > 0 { format!(", a shared expert of {}", summary.shared_width) } else { String::new() },
        summary.down_type.name(),
        summary.tensor_count,
        summary.file_bytes,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
