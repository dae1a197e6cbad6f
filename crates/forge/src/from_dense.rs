//! A real dense model turned into a mixture of experts whose router follows the model's own
//! hidden states (`hypura-forge --from-dense FILE`).
//!
//! The dense model first reads a calibration text (built in: prose, code, a dialogue), and
//! every layer's FFN input is recorded. Each neuron's importance for each token is what it adds
//! to the output, |silu(gate·x)·(up·x)| times the length of its down column. Neurons whose
//! importance rises and falls together are clustered (balanced spherical k-means over those
//! patterns, so every expert has the same width), and each cluster becomes an expert: its gate
//! and up rows are the source's quantized rows, copied byte for byte, and its down columns are
//! quantized again, to Q8_0. The router is a ridge regression of each cluster's importance on
//! the FFN input: experts are picked by what the model computes on the text it reads. Its
//! logits are scaled to within 0.1% of one another, so the softmax weights are all but equal, and
//! each expert's down projection is scaled back by the weight it gets; with every expert used
//! the layer is the dense FFN again (up to re-quantization), and with top-k it is the dense FFN
//! restricted to the k clusters predicted to matter most for that token.
//!
//! Targets: `qwen2` becomes `qwen2moe` (which also needs a shared expert: the clusters that do
//! the most over the whole text, gated by their fitted score, whose sigmoid is all but 0.5 and
//! is scaled back the same way), and `llama` becomes Mixtral-style `llama` with experts (top-k
//! weights renormalized). Every layer's experts are held in memory until the file is written
//! (about the size of the FFN weights, 0.8 GB for Qwen2.5-Coder-1.5B).
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use std::sync::{Arc, Mutex};

use hypura_gguf::{GgmlType, Gguf, GgufWriter, TensorInfo, Value};
use hypura_sys::{
    dequantize_rows, quantize_rows, Backend, Batch, Context, ContextParams, EvalHook, Model, ModelParams, ObservedNode,
    Placement,
};
use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::ForgeError;

/// How far apart the router's logits may be (their largest magnitude on the calibration text).
/// Small, so the softmax weights stay within 0.1% of equal; the top-k order, which is all that
/// routing uses, does not depend on the scale.
const ROUTER_SPREAD: f32 = 0.001;
/// Rounds of assignment and centroid update.
const KMEANS_ROUNDS: usize = 10;
/// The down projections' columns are regrouped, so their blocks are quantized again: to Q8_0,
/// which adds next to nothing to the source's own quantization error (a second 4- or 6-bit
/// rounding of regrouped values would add as much again).
const DOWN_TYPE: GgmlType = GgmlType::Q8_0;

/// What to make of the dense model.
#[derive(Clone, Debug)]
pub struct FromDense {
    /// Routed experts per layer.
    pub n_expert: u64,
    /// Experts each token uses.
    pub n_expert_used: u64,
    /// Clusters merged into the shared expert (`qwen2moe` needs at least one; `llama` has none).
    /// `None`: 1 where the target has a shared expert, else 0.
    pub n_shared: Option<u64>,
    /// Seed of the k-means starting centroids.
    pub seed: u64,
    /// Text the dense model reads to measure which neurons work together and to fit the router
    /// (`None`: a built-in mix of prose and code).
    pub calibration: Option<String>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct FromDenseSummary {
    pub architecture: String,
    pub n_layer: u64,
    /// Neurons per expert.
    pub expert_width: u64,
    /// Neurons in the shared expert (0 where there is none).
    pub shared_width: u64,
    pub down_type: GgmlType,
    pub tensor_count: usize,
    pub file_bytes: u64,
}

/// The MoE architecture a dense one becomes.
struct Target {
    arch: &'static str,
    /// The target needs a shared expert (`qwen2moe`).
    shared: bool,
    /// The selected experts' weights are renormalized to sum to 1 (else they are the softmax
    /// over all experts).
    normalized: bool,
    /// The target needs a separate output matrix (it cannot tie it to the token embedding).
    needs_output: bool,
    /// The target reads the expert width from `feed_forward_length` (it has no
    /// `expert_feed_forward_length`).
    width_is_feed_forward_length: bool,
}

fn target(source_arch: &str) -> Option<Target> {
    match source_arch {
        "qwen2" => Some(Target {
            arch: "qwen2moe",
            shared: true,
            normalized: false,
            needs_output: true,
            width_is_feed_forward_length: false,
        }),
        "llama" => Some(Target {
            arch: "llama",
            shared: false,
            normalized: true,
            needs_output: false,
            width_is_feed_forward_length: true,
        }),
        _ => None,
    }
}

/// The dimensions every layer's FFN must have.
#[derive(Clone, Copy, Debug)]
struct Dims {
    n_embd: usize,
    n_ff: usize,
    width: usize,
    n_clusters: usize,
    n_shared: usize,
}

/// Where a tensor of the output comes from.
enum Source {
    /// The source tensor's bytes, copied.
    Copy(TensorInfo),
    /// Part `part` of layer `layer`'s experts.
    Expert { layer: usize, part: usize },
}

fn bad(path: &Path, reason: impl Into<String>) -> ForgeError {
    ForgeError::Source { path: path.to_path_buf(), reason: reason.into() }
}

/// Reads the dense model at `source` (opened read-only) and writes its mixture-of-experts form
/// to `output`.
pub fn moe_from_dense(source: &Path, output: &Path, options: &FromDense) -> Result<FromDenseSummary, ForgeError> {
    let model = Gguf::open(source)?;
    let source_arch = model.architecture().ok_or_else(|| bad(source, "no general.architecture"))?.to_string();
    let target = target(&source_arch).ok_or_else(|| {
        bad(
            source,
            format!("architecture {source_arch:?} has no mixture-of-experts form here; supported: qwen2, llama"),
        )
    })?;
    let key = |name: &str| {
        model.get_u64(&format!("{source_arch}.{name}")).ok_or_else(|| bad(source, format!("no {source_arch}.{name}")))
    };
    let n_layer = key("block_count")? as usize;
    let n_embd = key("embedding_length")? as usize;
    let n_ff = key("feed_forward_length")? as usize;
    if model.get_u64(&format!("{source_arch}.expert_count")).unwrap_or(0) > 0 {
        return Err(bad(source, "the model already has experts"));
    }
    let n_shared = options.n_shared.unwrap_or(u64::from(target.shared)) as usize;
    if target.shared && n_shared == 0 {
        return Err(bad(source, format!("{} needs a shared expert (at least one cluster)", target.arch)));
    }
    if !target.shared && n_shared > 0 {
        return Err(bad(source, format!("{} has no shared expert", target.arch)));
    }
    let (n_expert, n_used) = (options.n_expert as usize, options.n_expert_used as usize);
    if n_expert < 2 || n_used == 0 || n_used > n_expert {
        return Err(bad(
            source,
            format!("{n_used} of {n_expert} experts: need at least 2 experts and 1 to {n_expert} used"),
        ));
    }
    let n_clusters = n_expert + n_shared;
    if !n_ff.is_multiple_of(n_clusters) {
        return Err(bad(source, format!("{n_ff} FFN neurons do not split into {n_clusters} equal experts")));
    }
    let dims = Dims { n_embd, n_ff, width: n_ff / n_clusters, n_clusters, n_shared };
    if !(dims.width as u64).is_multiple_of(DOWN_TYPE.block_size()) {
        return Err(bad(
            source,
            format!(
                "experts of {} neurons are not a whole number of {}-value blocks",
                dims.width,
                DOWN_TYPE.block_size()
            ),
        ));
    }
    for layer in 0..n_layer {
        for (part, expected) in [("gate", [n_embd, n_ff]), ("up", [n_embd, n_ff]), ("down", [n_ff, n_embd])] {
            let name = format!("blk.{layer}.ffn_{part}.weight");
            let tensor = model.tensor(&name).ok_or_else(|| bad(source, format!("no {name}")))?;
            if tensor.dims != expected.map(|d| d as u64) {
                return Err(bad(source, format!("{name} has shape {:?}, expected {expected:?}", tensor.dims)));
            }
        }
    }

    let file = File::open(source).map_err(|error| ForgeError::Io { path: source.to_path_buf(), source: error })?;
    let read = |tensor: &TensorInfo| -> Result<Vec<u8>, ForgeError> {
        let mut bytes = vec![0u8; tensor.bytes as usize];
        file.read_exact_at(&mut bytes, model.data_offset + tensor.offset)
            .map_err(|error| ForgeError::Io { path: source.to_path_buf(), source: error })?;
        Ok(bytes)
    };
    let inputs = ffn_inputs(source, options.calibration.as_deref().unwrap_or(CALIBRATION_TEXT), n_layer, n_embd)?;
    let weight_scale = if target.normalized { n_used } else { n_expert } as f32;
    let layers: Vec<Vec<Vec<u8>>> = (0..n_layer)
        .into_par_iter()
        .map(|layer| {
            let tensor = |part: &str| model.tensor(&format!("blk.{layer}.ffn_{part}.weight")).expect("checked above");
            let (gate, up, down) = (tensor("gate"), tensor("up"), tensor("down"));
            let layer_seed = options.seed ^ (layer as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            expert_layer(
                dims,
                &inputs[layer],
                (gate.ggml_type, &read(gate)?),
                (up.ggml_type, &read(up)?),
                (down.ggml_type, &read(down)?),
                weight_scale,
                layer_seed,
            )
        })
        .collect::<Result<_, ForgeError>>()?;

    let mut writer = GgufWriter::new();
    writer.alignment = model.alignment;
    let prefix = format!("{source_arch}.");
    for (name, value) in &model.metadata {
        let renamed = match name.strip_prefix(&prefix) {
            Some(rest) => format!("{}.{rest}", target.arch),
            None => name.clone(),
        };
        let value = match name.as_str() {
            "general.architecture" => Value::String(target.arch.to_string()),
            "general.name" => Value::String(format!("{} (experts from dense)", value.as_str().unwrap_or("model"))),
            _ if target.width_is_feed_forward_length && renamed == format!("{}.feed_forward_length", target.arch) => {
                Value::U32(dims.width as u32)
            }
            _ => value.clone(),
        };
        writer.add_metadata(renamed, value);
    }
    let arch_key = |name: &str| format!("{}.{name}", target.arch);
    writer.add_metadata(arch_key("expert_count"), Value::U32(n_expert as u32));
    writer.add_metadata(arch_key("expert_used_count"), Value::U32(n_used as u32));
    if !target.width_is_feed_forward_length {
        writer.add_metadata(arch_key("expert_feed_forward_length"), Value::U32(dims.width as u32));
    }
    if target.shared {
        writer.add_metadata(arch_key("expert_shared_feed_forward_length"), Value::U32((dims.width * n_shared) as u32));
    }

    let mut sources = Vec::new();
    let mut emitted = vec![false; n_layer];
    for tensor in &model.tensors {
        let ffn_layer = tensor
            .name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .filter(|(_, part)| matches!(*part, "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight"))
            .and_then(|(layer, _)| layer.parse::<usize>().ok())
            .filter(|&layer| layer < n_layer);
        match ffn_layer {
            Some(layer) if !emitted[layer] => {
                emitted[layer] = true;
                for (part, (name, shape, ggml_type)) in
                    expert_tensors(dims, &model, layer, target.shared).into_iter().enumerate()
                {
                    writer.add_tensor(name, &shape, ggml_type);
                    sources.push(Source::Expert { layer, part });
                }
            }
            Some(_) => {}
            None => {
                writer.add_tensor(tensor.name.clone(), &tensor.dims, tensor.ggml_type);
                sources.push(Source::Copy(tensor.clone()));
            }
        }
    }
    if target.needs_output && model.tensor("output.weight").is_none() {
        let embedding = model.tensor("token_embd.weight").ok_or_else(|| bad(source, "no token_embd.weight"))?;
        writer.add_tensor("output.weight", &embedding.dims, embedding.ggml_type);
        sources.push(Source::Copy(embedding.clone()));
    }

    // Written beside the output and renamed into place, so a failure leaves no partial model.
    let partial = output.with_extension("partial");
    let mut layers = layers;
    let mut failure = None;
    let layout = writer.write_file(&partial, |index| match &sources[index] {
        Source::Copy(tensor) => read(tensor).unwrap_or_else(|error| {
            failure.get_or_insert(error);
            Vec::new()
        }),
        Source::Expert { layer, part } => std::mem::take(&mut layers[*layer][*part]),
    });
    let written = match (failure, layout) {
        (Some(error), _) => Err(error),
        (None, layout) => layout.map_err(ForgeError::from),
    };
    let layout = written.inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
    })?;
    std::fs::rename(&partial, output).map_err(|error| ForgeError::Io { path: output.to_path_buf(), source: error })?;
    Ok(FromDenseSummary {
        architecture: target.arch.to_string(),
        n_layer: n_layer as u64,
        expert_width: dims.width as u64,
        shared_width: (dims.width * n_shared) as u64,
        down_type: DOWN_TYPE,
        tensor_count: writer.tensors.len(),
        file_bytes: layout.file_bytes,
    })
}

/// Names, shapes and types of one layer's expert tensors, in the order `expert_layer` makes
/// their bytes.
fn expert_tensors(dims: Dims, model: &Gguf, layer: usize, shared: bool) -> Vec<(String, Vec<u64>, GgmlType)> {
    let (n_embd, width, n_expert) = (dims.n_embd as u64, dims.width as u64, (dims.n_clusters - dims.n_shared) as u64);
    let source_type =
        |part: &str| model.tensor(&format!("blk.{layer}.ffn_{part}.weight")).expect("checked by the caller").ggml_type;
    let name = |part: &str| format!("blk.{layer}.{part}.weight");
    let mut tensors = vec![
        (name("ffn_gate_inp"), vec![n_embd, n_expert], GgmlType::F32),
        (name("ffn_gate_exps"), vec![n_embd, width, n_expert], source_type("gate")),
        (name("ffn_up_exps"), vec![n_embd, width, n_expert], source_type("up")),
        (name("ffn_down_exps"), vec![width, n_embd, n_expert], DOWN_TYPE),
    ];
    if shared {
        let shared_width = width * dims.n_shared as u64;
        tensors.extend([
            (name("ffn_gate_inp_shexp"), vec![n_embd], GgmlType::F32),
            (name("ffn_gate_shexp"), vec![n_embd, shared_width], source_type("gate")),
            (name("ffn_up_shexp"), vec![n_embd, shared_width], source_type("up")),
            (name("ffn_down_shexp"), vec![shared_width, n_embd], DOWN_TYPE),
        ]);
    }
    tensors
}

/// One layer's expert tensors' bytes, in `expert_tensors` order. `inputs` are the layer's FFN
/// inputs on the calibration text, one row of `n_embd` per token.
#[allow(clippy::too_many_arguments)]
fn expert_layer(
    dims: Dims,
    inputs: &[f32],
    gate: (GgmlType, &[u8]),
    up: (GgmlType, &[u8]),
    down: (GgmlType, &[u8]),
    weight_scale: f32,
    seed: u64,
) -> Result<Vec<Vec<u8>>, ForgeError> {
    let Dims { n_embd, n_ff, n_clusters, n_shared, .. } = dims;
    let gate_values = dequantize_rows(gate.0.id(), gate.1, n_embd)?;
    let up_values = dequantize_rows(up.0.id(), up.1, n_embd)?;
    let down_values = dequantize_rows(down.0.id(), down.1, n_ff)?;
    let n_tokens = inputs.len() / n_embd;
    let token = |t: usize| &inputs[t * n_embd..(t + 1) * n_embd];

    // How much each neuron adds to each token's output: |silu(gate·x) · (up·x)| times the
    // length of its down column. Row j holds neuron j's importance over the tokens.
    let mut column_norms = vec![0f32; n_ff];
    for row in down_values.chunks_exact(n_ff) {
        column_norms.iter_mut().zip(row).for_each(|(norm, value)| *norm += value * value);
    }
    column_norms.iter_mut().for_each(|norm| *norm = norm.sqrt());
    let importance: Vec<f32> = (0..n_ff)
        .into_par_iter()
        .flat_map_iter(|j| {
            let (g, u) = (&gate_values[j * n_embd..(j + 1) * n_embd], &up_values[j * n_embd..(j + 1) * n_embd]);
            let column_norm = column_norms[j];
            (0..n_tokens).map(move |t| (silu(dot(g, token(t))) * dot(u, token(t))).abs() * column_norm)
        })
        .collect();
    // Experts are neurons that work together: clusters of the importance patterns. A
    // cluster's score for a token is its neurons' summed importance.
    let mut clusters: Vec<(Vec<usize>, Vec<f32>)> = cluster_rows(&importance, n_tokens, n_clusters, seed)
        .into_iter()
        .map(|members| {
            let scores = (0..n_tokens).map(|t| members.iter().map(|&j| importance[j * n_tokens + t]).sum()).collect();
            (members, scores)
        })
        .collect();
    // The clusters that do the most over the whole text form the shared expert.
    let total = |scores: &[f32]| scores.iter().sum::<f32>();
    clusters.sort_by(|a, b| total(&b.1).total_cmp(&total(&a.1)));
    let (shared, routed) = clusters.split_at(n_shared);
    let shared_members: Vec<usize> = shared.iter().flat_map(|(members, _)| members.iter().copied()).collect();

    // Router: each cluster's score, fitted linearly to the FFN input (ridge regression). The
    // shared expert's gate is fitted the same way: llama.cpp computes its sigmoid as
    // silu(x) / x, which is NaN at exactly 0, so it cannot be a zero vector.
    let mut targets: Vec<Vec<f32>> = routed.iter().map(|(_, scores)| scores.clone()).collect();
    if n_shared > 0 {
        targets
            .push((0..n_tokens).map(|t| shared_members.iter().map(|&j| importance[j * n_tokens + t]).sum()).collect());
    }
    let rows_fitted = fit_linear(inputs, n_embd, &targets);
    let largest = rows_fitted[..routed.len()]
        .iter()
        .flat_map(|row| (0..n_tokens).map(move |t| dot(row, token(t)).abs()))
        .fold(0f32, f32::max);
    let scale = if largest > 0.0 { ROUTER_SPREAD / largest } else { 0.0 };
    let scaled = |rows: &[Vec<f32>]| -> Vec<u8> {
        rows.iter().flatten().flat_map(|value| (value * scale).to_le_bytes()).collect()
    };
    let router = scaled(&rows_fitted[..routed.len()]);

    let rows = |(ggml_type, bytes): (GgmlType, &[u8]), members: &[&[usize]]| -> Vec<u8> {
        let row_bytes = ggml_type.row_bytes(n_embd as u64).expect("checked shape") as usize;
        members
            .iter()
            .flat_map(|cluster| cluster.iter())
            .flat_map(|&neuron| bytes[neuron * row_bytes..(neuron + 1) * row_bytes].iter().copied())
            .collect()
    };
    let columns = |members: &[&[usize]], factor: f32| -> Result<Vec<u8>, ForgeError> {
        let mut packed = Vec::new();
        for neurons in members {
            let down_values = &down_values;
            let values: Vec<f32> = (0..n_embd)
                .flat_map(|row| neurons.iter().map(move |&neuron| down_values[row * n_ff + neuron] * factor))
                .collect();
            packed.extend(quantize_rows(DOWN_TYPE.id(), &values, neurons.len())?);
        }
        Ok(packed)
    };
    let routed: Vec<&[usize]> = routed.iter().map(|(members, _)| members.as_slice()).collect();
    let mut parts = vec![router, rows(gate, &routed), rows(up, &routed), columns(&routed, weight_scale)?];
    if n_shared > 0 {
        let shared = [shared_members.as_slice()];
        // Its logit is within 0.001 of 0, so its sigmoid is within 0.03% of 0.5: scaled back by 2.
        parts.extend([
            scaled(&rows_fitted[routed.len()..]),
            rows(gate, &shared),
            rows(up, &shared),
            columns(&shared, 2.0)?,
        ]);
    }
    Ok(parts)
}

/// Most calibration tokens read (the FFN inputs of every layer are kept, as f32).
const MAX_CALIBRATION_TOKENS: usize = 1024;
/// Calibration tokens per decode.
const CALIBRATION_BATCH: usize = 256;

/// The built-in calibration text: prose, code and a dialogue, so that neurons for each get used.
const CALIBRATION_TEXT: &str = include_str!("calibration.txt");

/// Records each layer's FFN input (`ffn_norm-L`, one row per token) as the dense model runs.
struct FfnInputs {
    layers: Vec<Mutex<Vec<f32>>>,
}

impl EvalHook for FfnInputs {
    fn wants(&self, name: &str) -> bool {
        name.starts_with("ffn_norm-")
    }

    fn observe(&self, node: &ObservedNode<'_>) {
        let layer = node.name().strip_prefix("ffn_norm-").and_then(|layer| layer.parse::<usize>().ok());
        if let (Some(slot), Some(rows)) = (layer.and_then(|layer| self.layers.get(layer)), node.f32_rows()) {
            slot.lock().expect("no panics while held").extend(rows.into_iter().flatten());
        }
    }
}

/// Every layer's FFN inputs while the dense model at `source` reads `text`: one row of `n_embd`
/// per token, per layer.
fn ffn_inputs(source: &Path, text: &str, n_layer: usize, n_embd: usize) -> Result<Vec<Vec<f32>>, ForgeError> {
    let model = Model::load_placed(
        Backend::get(),
        source,
        &ModelParams { use_extra_bufts: false, ..ModelParams::default() },
        Placement::default(),
    )?;
    let mut tokens = model.vocab().tokenize(text, true, true)?;
    tokens.truncate(MAX_CALIBRATION_TOKENS);
    if tokens.len() < 16 {
        return Err(bad(source, format!("the calibration text is {} tokens; it needs at least 16", tokens.len())));
    }
    let hook = Arc::new(FfnInputs { layers: (0..n_layer).map(|_| Mutex::new(Vec::new())).collect() });
    let batch_size = CALIBRATION_BATCH as u32;
    let params = ContextParams {
        n_ctx: tokens.len() as u32,
        n_batch: batch_size,
        n_ubatch: batch_size,
        eval_hook: Some(hook.clone()),
        ..ContextParams::default()
    };
    let mut context = Context::new(&model, &params)?;
    let mut batch = Batch::new(CALIBRATION_BATCH, 1);
    for (index, chunk) in tokens.chunks(CALIBRATION_BATCH).enumerate() {
        batch.clear();
        for (offset, &token) in chunk.iter().enumerate() {
            // Every token asks for logits: the last layer computes its FFN only for those.
            batch.push(token, (index * CALIBRATION_BATCH + offset) as i32, &[0], true)?;
        }
        context.decode(&batch)?;
    }
    drop(context);
    let inputs: Vec<Vec<f32>> =
        hook.layers.iter().map(|layer| std::mem::take(&mut *layer.lock().expect("no panics while held"))).collect();
    if let Some(layer) = inputs.iter().position(|rows| rows.len() != tokens.len() * n_embd) {
        return Err(bad(
            source,
            format!(
                "layer {layer}: saw {} FFN input values, expected {} tokens × {n_embd}",
                inputs[layer].len(),
                tokens.len()
            ),
        ));
    }
    Ok(inputs)
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums, so the compiler can keep them in vector registers.
    let mut sums = [0f32; 8];
    let (chunks_a, chunks_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = chunks_a.remainder().iter().zip(chunks_b.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in chunks_a.zip(chunks_b) {
        for lane in 0..8 {
            sums[lane] += x[lane] * y[lane];
        }
    }
    sums.iter().sum::<f32>() + tail
}

/// Ridge regression of each target (one value per row of `inputs`, rows of `n`) on the inputs:
/// the row r minimising |X r − y|² + λ|r|², with λ a thousandth of X's mean squared column
/// length, solved through one Cholesky factorisation of XᵀX + λI (in f64).
pub fn fit_linear(inputs: &[f32], n: usize, targets: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let n_rows = inputs.len() / n;
    let row = |t: usize| &inputs[t * n..(t + 1) * n];
    // Lower triangle of XᵀX, row i the sum over tokens of x_i times x[..=i].
    let mut gram = vec![0f64; n * n];
    gram.par_chunks_mut(n).enumerate().for_each(|(i, gram_row)| {
        for t in 0..n_rows {
            let x = row(t);
            let xi = f64::from(x[i]);
            for (g, &xk) in gram_row[..=i].iter_mut().zip(&x[..=i]) {
                *g += xi * f64::from(xk);
            }
        }
    });
    let ridge = 1e-3 * (0..n).map(|i| gram[i * n + i]).sum::<f64>() / n as f64 + f64::MIN_POSITIVE;
    // Cholesky, lower triangle in place: gram = L Lᵀ.
    for j in 0..n {
        let diagonal = gram[j * n + j] + ridge - (0..j).map(|k| gram[j * n + k].powi(2)).sum::<f64>();
        gram[j * n + j] = diagonal.max(f64::MIN_POSITIVE).sqrt();
        for i in j + 1..n {
            let value = gram[i * n + j] - (0..j).map(|k| gram[i * n + k] * gram[j * n + k]).sum::<f64>();
            gram[i * n + j] = value / gram[j * n + j];
        }
    }
    targets
        .par_iter()
        .map(|target| {
            let mut solution = vec![0f64; n];
            for (t, &y) in target.iter().enumerate() {
                for (s, &x) in solution.iter_mut().zip(row(t)) {
                    *s += f64::from(x) * f64::from(y);
                }
            }
            for i in 0..n {
                let value = solution[i] - (0..i).map(|k| gram[i * n + k] * solution[k]).sum::<f64>();
                solution[i] = value / gram[i * n + i];
            }
            for i in (0..n).rev() {
                let value = solution[i] - (i + 1..n).map(|k| gram[k * n + i] * solution[k]).sum::<f64>();
                solution[i] = value / gram[i * n + i];
            }
            solution.iter().map(|&v| v as f32).collect()
        })
        .collect()
}

fn norm2(row: &[f32]) -> f32 {
    row.iter().map(|v| v * v).sum::<f32>().sqrt()
}

/// The mean of the rows `members` of `values` (rows of `n`), each first scaled to unit length.
fn mean_unit_row(values: &[f32], n: usize, members: &[usize]) -> Vec<f32> {
    let mut mean = vec![0f32; n];
    for &member in members {
        let row = &values[member * n..(member + 1) * n];
        let scale = 1.0 / norm2(row).max(f32::MIN_POSITIVE);
        for (m, v) in mean.iter_mut().zip(row) {
            *m += v * scale;
        }
    }
    mean.iter_mut().for_each(|m| *m /= members.len().max(1) as f32);
    mean
}

/// Balanced spherical k-means: the rows of `values` (each `n` long) in `n_clusters` clusters of
/// equal size, by cosine similarity to the clusters' mean directions. Each cluster's members
/// are in ascending order; the result is deterministic for a seed.
pub fn cluster_rows(values: &[f32], n: usize, n_clusters: usize, seed: u64) -> Vec<Vec<usize>> {
    let n_rows = values.len() / n;
    assert!(n_clusters > 0 && n_rows.is_multiple_of(n_clusters), "{n_rows} rows in {n_clusters} equal clusters");
    let capacity = n_rows / n_clusters;
    let units: Vec<Vec<f32>> = (0..n_rows)
        .map(|row| {
            let row = &values[row * n..(row + 1) * n];
            let length = norm2(row).max(f32::MIN_POSITIVE);
            row.iter().map(|v| v / length).collect()
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut centroids: Vec<Vec<f32>> =
        sample(&mut rng, n_rows, n_clusters).iter().map(|row| units[row].clone()).collect();
    let mut clusters = Vec::new();
    for _ in 0..KMEANS_ROUNDS {
        let mut pairs: Vec<(f32, usize, usize)> = (0..n_rows)
            .flat_map(|row| centroids.iter().enumerate().map(move |(cluster, centroid)| (row, cluster, centroid)))
            .map(|(row, cluster, centroid)| {
                (units[row].iter().zip(centroid).map(|(a, b)| a * b).sum::<f32>(), row, cluster)
            })
            .collect();
        // Most similar first; ties in row then cluster order, so the result is deterministic.
        pairs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut assigned = vec![false; n_rows];
        clusters = vec![Vec::with_capacity(capacity); n_clusters];
        for (_, row, cluster) in pairs {
            if !assigned[row] && clusters[cluster].len() < capacity {
                assigned[row] = true;
                clusters[cluster].push(row);
            }
        }
        for (centroid, members) in centroids.iter_mut().zip(&clusters) {
            let mean = mean_unit_row(values, n, members);
            let length = norm2(&mean).max(f32::MIN_POSITIVE);
            *centroid = mean.iter().map(|v| v / length).collect();
        }
    }
    clusters.iter_mut().for_each(|members| members.sort_unstable());
    clusters
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clusters_are_equal_sized_partitions_that_group_similar_rows() {
        // Three well-separated directions, four noisy rows around each, interleaved.
        let directions = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]];
        let mut values = Vec::new();
        for index in 0..12 {
            let direction = directions[index % 3];
            let noise = 0.05 * (index as f32 / 12.0);
            values.extend(direction.iter().map(|v| v * (1.0 + index as f32) + noise));
        }
        let clusters = cluster_rows(&values, 3, 3, 7);
        let mut all: Vec<usize> = clusters.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..12).collect::<Vec<_>>());
        for members in &clusters {
            assert_eq!(members.len(), 4);
            assert!(members.iter().all(|m| m % 3 == members[0] % 3), "a cluster mixes directions: {members:?}");
        }
        assert_eq!(clusters, cluster_rows(&values, 3, 3, 7), "not deterministic");
    }

    #[test]
    fn the_router_fit_recovers_a_linear_map() {
        // y = 2·x0 − x2 on 64 pseudo-random inputs of 4 values: the ridge fit is within 1%.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let inputs: Vec<f32> = (0..64 * 4).map(|_| rand::Rng::gen_range(&mut rng, -1.0f32..1.0)).collect();
        let target: Vec<f32> = inputs.chunks(4).map(|x| 2.0 * x[0] - x[2]).collect();
        let fitted = fit_linear(&inputs, 4, &[target]);
        for (value, expected) in fitted[0].iter().zip([2.0, 0.0, -1.0, 0.0]) {
            assert!((value - expected).abs() < 0.02, "{:?}", fitted[0]);
        }
    }
}
