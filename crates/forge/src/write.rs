//! Writes a forged model: header first, then every tensor's rows generated, quantized with
//! ggml's own functions and written at their final offsets in parallel.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use hypura_gguf::{GgmlType, GgufWriter, Value};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::arch::Meta;
use crate::spec::{ForgeSpec, Init, TensorPlan};
use crate::vocab::Vocabulary;
use crate::ForgeError;

/// Rows are generated and written in pieces of about this many output bytes, so memory stays
/// at a few MiB per thread whatever the model size.
const PIECE_BYTES: u64 = 4 << 20;

/// ggml's K-quant quantizers search scales per block and run at about 20 M values/s per core,
/// which would make a 30B-parameter model take over ten minutes. Pieces with many blocks are
/// therefore assembled from a pool of this many blocks that ggml quantized, each block position
/// drawing a random pool entry. Every byte is still a block that ggml produced, blocks differ
/// between positions, experts and tensors, and the value statistics are unchanged.
const BLOCK_POOL: u64 = 2048;

/// What was written.
#[derive(Clone, Debug)]
pub struct ForgeSummary {
    pub file_bytes: u64,
    pub tensor_count: usize,
    pub n_vocab: u64,
}

/// Every metadata key llama.cpp needs to load the spec as its architecture: the keys every
/// architecture reads, the vocabulary, then the architecture's own keys (which may replace
/// them), then the chat template.
pub fn metadata(spec: &ForgeSpec, vocabulary: &Vocabulary) -> Vec<(String, Value)> {
    let shape = &spec.shape;
    let mut meta = Meta::new(spec.arch);
    meta.set_key("general.architecture", Value::String(spec.arch.name().into()));
    meta.set_key("general.name", Value::String(format!("hypura-forge {}", spec.name)));
    meta.set_key("general.file_type", Value::U32(spec.quant.file_type()));
    meta.set_key("general.quantization_version", Value::U32(2));
    meta.set_key("hypura.forge.seed", Value::U64(spec.seed));
    meta.set_key("hypura.forge.router_skew", Value::F32(spec.router_skew));
    meta.set_key("hypura.forge.router_locality", Value::F32(spec.router_locality));
    meta.set_key("hypura.forge.residual_scale", Value::F32(spec.residual_scale));
    meta.set_key("hypura.forge.varied_text", Value::Bool(spec.varied_text));
    meta.set_key("hypura.forge.topic_strength", Value::F32(spec.topic_strength));
    meta.set_key("hypura.forge.topic_span", Value::F32(spec.topic_span));
    meta.u32("context_length", shape.n_ctx_train);
    meta.u32("embedding_length", shape.n_embd);
    meta.u32("block_count", shape.n_layer);
    meta.u32("feed_forward_length", if spec.is_moe() && shape.n_ff_dense > 0 { shape.n_ff_dense } else { shape.n_ff });
    meta.u32("attention.head_count", shape.n_head);
    meta.u32("attention.head_count_kv", shape.n_head_kv);
    meta.u32("attention.key_length", shape.head_dim);
    meta.u32("attention.value_length", shape.head_dim);
    meta.f32("attention.layer_norm_rms_epsilon", 1e-6);
    meta.f32("rope.freq_base", shape.rope_freq_base);
    meta.u32("rope.dimension_count", shape.head_dim);
    meta.u32("vocab_size", vocabulary.len());
    if spec.is_moe() {
        meta.u32("expert_count", shape.n_expert);
        meta.u32("expert_used_count", shape.n_expert_used);
        meta.u32("expert_feed_forward_length", shape.n_ff);
    }
    for (key, value) in vocabulary.metadata() {
        meta.set_key(key, value);
    }
    crate::arch::metadata(spec, &mut meta);
    if let Some(template) = &spec.chat_template {
        meta.set_key("tokenizer.chat_template", Value::String(template.clone()));
    }
    meta.entries
}

/// One piece of work: rows `first_row..first_row + row_count` of tensor `tensor`.
struct Piece {
    tensor: usize,
    first_row: u64,
    row_count: u64,
}

/// Write `spec` to `path`. `progress(done_bytes, total_bytes)` is called as pieces land.
pub fn write_model(
    spec: &ForgeSpec,
    path: &Path,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<ForgeSummary, ForgeError> {
    let (plans, layout, n_vocab) = layout(spec)?;
    let io_error = |source| ForgeError::Io { path: path.to_path_buf(), source };
    let file = File::create(path).map_err(io_error)?;
    file.set_len(layout.file_bytes).map_err(io_error)?;
    file.write_all_at(&layout.header, 0).map_err(io_error)?;

    let pieces = pieces(&plans);
    let total = layout.file_bytes;
    let done = AtomicU64::new(layout.header.len() as u64);
    let locality_direction = unit_direction(spec.seed, spec.shape.n_embd);
    let cycle = text_cycle(spec);
    let topics = topic_rows(spec, &cycle);
    let mut shared = Shared { locality_direction: &locality_direction, topics: topics.as_deref(), successors: None };
    let successors = successor_rows(spec, &plans, &pieces, &shared, &cycle);
    shared.successors = successors.as_deref();
    pieces.par_iter().try_for_each(|piece| -> Result<(), ForgeError> {
        let plan = &plans[piece.tensor];
        let row_elements = plan.dims[0];
        let row_bytes = plan.ggml_type.row_bytes(row_elements).expect("validated by layout");
        let bytes = piece_bytes(spec, plan, piece, &shared)?;
        let offset = layout.tensor_offsets[piece.tensor] + piece.first_row * row_bytes;
        file.write_all_at(&bytes, offset).map_err(io_error)?;
        let now = done.fetch_add(bytes.len() as u64, Ordering::Relaxed) + bytes.len() as u64;
        progress(now, total);
        Ok(())
    })?;
    file.sync_all().map_err(io_error)?;
    progress(total, total);
    Ok(ForgeSummary { file_bytes: layout.file_bytes, tensor_count: plans.len(), n_vocab })
}

/// What `write_model` would write, without writing it.
pub fn plan_model(spec: &ForgeSpec) -> Result<ForgeSummary, ForgeError> {
    let (plans, layout, n_vocab) = layout(spec)?;
    Ok(ForgeSummary { file_bytes: layout.file_bytes, tensor_count: plans.len(), n_vocab })
}

/// The spec's tensors and the file layout (header bytes, offsets) they take.
fn layout(spec: &ForgeSpec) -> Result<(Vec<TensorPlan>, hypura_gguf::Layout, u64), ForgeError> {
    validate(spec)?;
    let vocabulary = Vocabulary::build();
    let plans = spec.tensors(vocabulary.len());
    let mut writer = GgufWriter::new();
    for (key, value) in metadata(spec, &vocabulary) {
        writer.add_metadata(key, value);
    }
    for plan in &plans {
        writer.add_tensor(plan.name.clone(), &plan.dims, plan.ggml_type);
    }
    let layout = writer.layout()?;
    Ok((plans, layout, vocabulary.len()))
}

fn validate(spec: &ForgeSpec) -> Result<(), ForgeError> {
    let shape = &spec.shape;
    let bad = |reason: String| Err(ForgeError::BadShape { name: spec.name.clone(), reason });
    if shape.n_layer == 0
        || shape.n_embd == 0
        || shape.n_head == 0
        || shape.n_head_kv == 0
        || shape.head_dim == 0
        || shape.n_ff == 0
    {
        return bad("every dimension must be positive".into());
    }
    if !shape.n_head.is_multiple_of(shape.n_head_kv) {
        return bad(format!("n_head {} is not a multiple of n_head_kv {}", shape.n_head, shape.n_head_kv));
    }
    if !shape.head_dim.is_multiple_of(2) {
        return bad(format!("head_dim {} must be even for RoPE", shape.head_dim));
    }
    if !shape.n_embd.is_multiple_of(32) || !shape.n_ff.is_multiple_of(32) {
        return bad(format!("n_embd {} and n_ff {} must be multiples of 32", shape.n_embd, shape.n_ff));
    }
    if shape.n_expert > 0 && (shape.n_expert_used == 0 || shape.n_expert_used > shape.n_expert) {
        return bad(format!("n_expert_used {} must be in 1..={}", shape.n_expert_used, shape.n_expert));
    }
    if !(spec.residual_scale.is_finite() && spec.residual_scale > 0.0) {
        return bad(format!("the residual scale {} must be positive", spec.residual_scale));
    }
    Ok(())
}

/// Split every tensor into pieces of whole rows of about PIECE_BYTES.
fn pieces(plans: &[TensorPlan]) -> Vec<Piece> {
    let mut pieces = Vec::new();
    for (tensor, plan) in plans.iter().enumerate() {
        let row_bytes = plan.ggml_type.row_bytes(plan.dims[0]).unwrap_or(1).max(1);
        let rows: u64 = plan.dims[1..].iter().product();
        let rows_per_piece = (PIECE_BYTES / row_bytes).max(1);
        let mut first_row = 0;
        while first_row < rows {
            let row_count = rows_per_piece.min(rows - first_row);
            pieces.push(Piece { tensor, first_row, row_count });
            first_row += row_count;
        }
    }
    pieces
}

/// A deterministic generator for one piece: the same spec gives the same bytes whatever the
/// number of threads.
fn piece_rng(seed: u64, tensor: usize, first_row: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&(tensor as u64).to_le_bytes());
    key[16..24].copy_from_slice(&first_row.to_le_bytes());
    key[24..].copy_from_slice(b"hypura-f");
    ChaCha8Rng::from_seed(key)
}

fn unit_direction(seed: u64, width: u64) -> Vec<f32> {
    let mut rng = piece_rng(seed, usize::MAX, u64::MAX);
    let mut direction: Vec<f32> = (0..width).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let norm = direction.iter().map(|value| value * value).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
    direction.iter_mut().for_each(|value| *value /= norm);
    direction
}

/// What every piece's rows may draw on beside its own generator.
struct Shared<'a> {
    locality_direction: &'a [f32],
    /// Per token, the topic its embedding carries (`ForgeSpec::topic_strength`); None without.
    topics: Option<&'a [f32]>,
    /// `Init::Successor`'s rows, every token's (None unless the spec has an output matrix to
    /// make them for).
    successors: Option<&'a [f32]>,
}

/// The order greedy text walks the ordinary tokens in under `ForgeSpec::varied_text`: one
/// cycle through them, drawn from the seed. Empty without varied text.
fn text_cycle(spec: &ForgeSpec) -> Vec<usize> {
    if !spec.varied_text {
        return Vec::new();
    }
    let vocabulary = Vocabulary::build();
    let mut cycle: Vec<usize> = (0..vocabulary.len() as usize).filter(|&token| vocabulary.is_ordinary(token)).collect();
    let mut rng = piece_rng(spec.seed ^ 0x6379_636c, usize::MAX, 0);
    for index in (1..cycle.len()).rev() {
        cycle.swap(index, rng.gen_range(0..=index));
    }
    cycle
}

/// Per token (rows of `n_embd`), the topic its embedding carries: along the text cycle, a
/// vector that drifts (each step keeps `exp(-1 / topic_span)` of the last one and draws the
/// rest), at unit variance a component, times `topic_strength`; zero off the cycle. Tokens
/// that follow each other in text share most of their topic, as words of one passage do, so
/// the router picks much of the same experts for them, and less the farther apart they are.
fn topic_rows(spec: &ForgeSpec, cycle: &[usize]) -> Option<Vec<f32>> {
    if cycle.is_empty() || spec.topic_strength <= 0.0 {
        return None;
    }
    let width = spec.shape.n_embd as usize;
    let n_vocab = Vocabulary::build().len() as usize;
    let keep = (-1.0 / spec.topic_span.max(f32::MIN_POSITIVE)).exp();
    let fresh = (1.0 - keep * keep).sqrt();
    let mut rng = piece_rng(spec.seed ^ 0x746f_7069, usize::MAX, 1);
    let draw = |rng: &mut ChaCha8Rng| rng.gen_range(-1.0f32..1.0) * 3f32.sqrt();
    let mut topic: Vec<f32> = (0..width).map(|_| draw(&mut rng)).collect();
    let mut rows = vec![0f32; n_vocab * width];
    for &token in cycle {
        for value in topic.iter_mut() {
            *value = keep * *value + fresh * draw(&mut rng);
        }
        for (out, value) in rows[token * width..(token + 1) * width].iter_mut().zip(&topic) {
            *out = spec.topic_strength * value;
        }
    }
    Some(rows)
}

/// The output matrix of `ForgeSpec::varied_text`, whole: the token embedding's rows (as its
/// pieces draw them), each ordinary token's row the unit-norm embedding of its predecessor in
/// the text cycle, other rows zero.
fn successor_rows(
    spec: &ForgeSpec,
    plans: &[TensorPlan],
    pieces: &[Piece],
    shared: &Shared<'_>,
    cycle: &[usize],
) -> Option<Vec<f32>> {
    plans.iter().find(|plan| plan.init == Init::Successor)?;
    let embedding = plans.iter().position(|plan| plan.init == Init::Embedding)?;
    let width = plans[embedding].dims[0] as usize;
    let rows: Vec<f32> = pieces
        .iter()
        .filter(|piece| piece.tensor == embedding)
        .flat_map(|piece| generate_rows(spec, &plans[embedding], piece, shared))
        .collect();
    let mut output = vec![0f32; rows.len()];
    for (position, &token) in cycle.iter().enumerate() {
        let before = cycle[(position + cycle.len() - 1) % cycle.len()];
        let source = &rows[before * width..(before + 1) * width];
        let norm = source.iter().map(|value| value * value).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
        for (value, from) in output[token * width..(token + 1) * width].iter_mut().zip(source) {
            *value = from / norm;
        }
    }
    Some(output)
}

fn generate_rows(spec: &ForgeSpec, plan: &TensorPlan, piece: &Piece, shared: &Shared<'_>) -> Vec<f32> {
    let locality_direction = shared.locality_direction;
    let row_elements = plan.dims[0] as usize;
    let mut rng = piece_rng(spec.seed, piece.tensor, piece.first_row);
    let mut values = vec![0f32; row_elements * piece.row_count as usize];
    match plan.init {
        Init::Norm => values.iter_mut().for_each(|value| *value = 1.0 + rng.gen_range(-0.1f32..0.1)),
        Init::Projection { fan_in } => {
            // Uniform with unit variance per output: keeps activations in range through layers.
            let limit = (3.0 / fan_in as f32).sqrt();
            values.iter_mut().for_each(|value| *value = rng.gen_range(-limit..limit));
        }
        Init::Residual { fan_in } => {
            let limit = (3.0 / fan_in as f32).sqrt() * spec.residual_scale;
            values.iter_mut().for_each(|value| *value = rng.gen_range(-limit..limit));
        }
        Init::Embedding => {
            let sqrt_width = (row_elements as f32).sqrt();
            for (offset, row) in values.chunks_mut(row_elements).enumerate() {
                let token = piece.first_row as usize + offset;
                let topic = shared.topics.map(|topics| &topics[token * row_elements..(token + 1) * row_elements]);
                for (index, (value, shared)) in row.iter_mut().zip(locality_direction).enumerate() {
                    *value = rng.gen_range(-1.0f32..1.0)
                        + spec.router_locality * shared * sqrt_width
                        + topic.map_or(0.0, |topic| topic[index]);
                }
            }
        }
        Init::Successor => {
            let successors = shared.successors.expect("successor rows are made before the pieces");
            let start = (piece.first_row * row_elements as u64) as usize;
            let count = values.len();
            values.copy_from_slice(&successors[start..start + count]);
        }
        Init::Uniform { low, high } => values.iter_mut().for_each(|value| *value = rng.gen_range(low..high)),
        Init::ExpertIds { n_expert } => {
            // A partial shuffle per row: distinct ids, held exactly as floats until encoded.
            let mut experts: Vec<u32> = (0..n_expert as u32).collect();
            for row in values.chunks_mut(row_elements) {
                for (slot, value) in row.iter_mut().enumerate() {
                    let pick = rng.gen_range(slot..experts.len());
                    experts.swap(slot, pick);
                    *value = experts[slot] as f32;
                }
            }
        }
        Init::Router { fan_in } => {
            let limit = (3.0 / fan_in as f32).sqrt();
            let n_expert = spec.shape.n_expert.max(1) as f32;
            for (offset, row) in values.chunks_mut(row_elements).enumerate() {
                let expert = (piece.first_row + offset as u64) as f32;
                // Larger router norm -> larger logit spread -> wins top-k more often.
                let scale = (-spec.router_skew * expert / n_expert).exp();
                for (value, shared) in row.iter_mut().zip(locality_direction) {
                    let aligned = spec.router_locality * shared * (expert + 1.0).recip().sqrt();
                    *value = scale * (rng.gen_range(-limit..limit) + aligned);
                }
            }
        }
    }
    values
}

/// The encoded bytes of one piece, pooled where quantizing every block would be too slow.
fn piece_bytes(spec: &ForgeSpec, plan: &TensorPlan, piece: &Piece, shared: &Shared<'_>) -> Result<Vec<u8>, ForgeError> {
    let ggml_type = plan.ggml_type;
    let row_elements = plan.dims[0];
    let block_elements = ggml_type.block_size();
    let blocks = row_elements / block_elements * piece.row_count;
    // The K-quants and MXFP4 (whose quantizer is also slow enough to matter at 20 GB).
    let pooled = (block_elements == 256 || ggml_type == GgmlType::MXFP4)
        && matches!(plan.init, Init::Projection { .. } | Init::Residual { .. })
        && blocks > 4 * BLOCK_POOL;
    if !pooled {
        let values = generate_rows(spec, plan, piece, shared);
        return encode(ggml_type, &values, row_elements);
    }
    // The pool: BLOCK_POOL one-block rows drawn like the tensor's own rows.
    let pool_plan = TensorPlan { dims: vec![block_elements, BLOCK_POOL], ..plan.clone() };
    let pool_piece = Piece { tensor: piece.tensor, first_row: piece.first_row, row_count: BLOCK_POOL };
    let pool_values = generate_rows(spec, &pool_plan, &pool_piece, shared);
    let pool = encode(ggml_type, &pool_values, block_elements)?;
    let block_bytes = ggml_type.type_size() as usize;
    let mut rng = piece_rng(spec.seed ^ 0x706f_6f6c, piece.tensor, piece.first_row);
    let mut bytes = Vec::with_capacity(blocks as usize * block_bytes);
    for _ in 0..blocks {
        let entry = rng.gen_range(0..BLOCK_POOL as usize) * block_bytes;
        bytes.extend_from_slice(&pool[entry..entry + block_bytes]);
    }
    Ok(bytes)
}

fn encode(ggml_type: GgmlType, values: &[f32], row_elements: u64) -> Result<Vec<u8>, ForgeError> {
    match ggml_type {
        GgmlType::F32 => Ok(values.iter().flat_map(|value| value.to_le_bytes()).collect()),
        GgmlType::I32 => Ok(values.iter().flat_map(|value| (*value as i32).to_le_bytes()).collect()),
        other => Ok(hypura_sys::quantize_rows(other.id(), values, row_elements as usize)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under varied text, the output matrix makes each ordinary token's logits, with the last
    /// hidden state at its own embedding, peak at its successor in one cycle through every
    /// ordinary token: greedy text walks the whole vocabulary before it repeats.
    #[test]
    fn varied_text_peaks_at_each_tokens_successor_in_one_cycle() {
        let spec = crate::spec::preset("tiny-moe-30b").expect("a preset");
        assert!(spec.varied_text && spec.topic_strength > 0.0, "an MoE preset's default");
        let (plans, _, _) = layout(&spec).unwrap();
        let pieces = pieces(&plans);
        let direction = unit_direction(spec.seed, spec.shape.n_embd);
        let cycle = text_cycle(&spec);
        let topics = topic_rows(&spec, &cycle);
        let shared = Shared { locality_direction: &direction, topics: topics.as_deref(), successors: None };
        let output = successor_rows(&spec, &plans, &pieces, &shared, &cycle).expect("an output matrix");
        let embedding = plans.iter().position(|plan| plan.init == Init::Embedding).unwrap();
        let width = spec.shape.n_embd as usize;
        let rows: Vec<f32> = pieces
            .iter()
            .filter(|piece| piece.tensor == embedding)
            .flat_map(|piece| generate_rows(&spec, &plans[embedding], piece, &shared))
            .collect();
        let vocabulary = Vocabulary::build();
        assert_eq!(cycle.len(), (0..vocabulary.len() as usize).filter(|&token| vocabulary.is_ordinary(token)).count());
        for (position, &token) in cycle.iter().enumerate() {
            let hidden = &rows[token * width..(token + 1) * width];
            let logit = |candidate: usize| -> f32 {
                output[candidate * width..(candidate + 1) * width].iter().zip(hidden).map(|(a, b)| a * b).sum()
            };
            let best = (0..vocabulary.len() as usize).max_by(|&a, &b| logit(a).total_cmp(&logit(b))).unwrap();
            assert_eq!(best, cycle[(position + 1) % cycle.len()], "token {token} at {position}");
        }
        // Consecutive tokens of the cycle share their topic; tokens far apart do not.
        let topics = topics.unwrap();
        let correlation = |a: usize, b: usize| -> f32 {
            let (a, b) = (&topics[a * width..(a + 1) * width], &topics[b * width..(b + 1) * width]);
            let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            dot / (a.iter().map(|x| x * x).sum::<f32>() * b.iter().map(|y| y * y).sum::<f32>()).sqrt()
        };
        assert!(correlation(cycle[10], cycle[11]) > 0.7);
        assert!(correlation(cycle[10], cycle[110]).abs() < 0.3);
    }
}
