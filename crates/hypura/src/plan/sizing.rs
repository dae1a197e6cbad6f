//! What a model's tensors cost and which of them the planner may move: the KV cache and CPU
//! compute buffer estimates, the tensors that may stream (dense FFN weights, routed experts) and
//! their bytes per layer, and the input tables llama.cpp always keeps in host memory.
use hypura_gguf::GgmlType;

use crate::model::{Inventory, TensorEntry};

/// The KV cache's element types (llama.cpp's `--cache-type-k` and `--cache-type-v`; Ollama's
/// `OLLAMA_KV_CACHE_TYPE` sets both). f16 unless the user asks: a quantized cache changes the
/// logits, so it is never chosen for the user.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvTypes {
    pub k: GgmlType,
    pub v: GgmlType,
}

impl Default for KvTypes {
    fn default() -> Self {
        KvTypes { k: GgmlType::F16, v: GgmlType::F16 }
    }
}

impl KvTypes {
    /// The types llama.cpp's KV cache takes, in its spelling.
    pub const ALLOWED: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::IQ4_NL,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
    ];

    /// One of `ALLOWED` by its name (`q8_0`, case-insensitive).
    pub fn parse(name: &str) -> Result<GgmlType, String> {
        KvTypes::ALLOWED.into_iter().find(|kind| kind.name().eq_ignore_ascii_case(name.trim())).ok_or_else(|| {
            format!(
                "unknown KV cache type {name:?}: use {}",
                KvTypes::ALLOWED.iter().map(|kind| kind.name()).collect::<Vec<_>>().join(", ")
            )
        })
    }
}

/// Bytes of `elements` values of `kind`, whole blocks.
fn typed_bytes(kind: GgmlType, elements: u64) -> u64 {
    elements.div_ceil(kind.block_size()) * kind.type_size()
}

/// KV cache bytes for `n_ctx` tokens in the layers that keep one, at the cache's types (an
/// upper bound for sliding-window models, whose window layers llama.cpp may size to the full
/// context).
pub fn kv_cache_bytes(inventory: &Inventory, n_ctx: u32, kv: KvTypes) -> u64 {
    let hparams = &inventory.hparams;
    let k_elements = (hparams.n_head_kv * hparams.head_dim_k).min(hparams.kv_row_elements);
    let v_elements = hparams.kv_row_elements - k_elements;
    hparams.n_layer_kv * u64::from(n_ctx) * (typed_bytes(kv.k, k_elements) + typed_bytes(kv.v, v_elements))
}

/// The context's memory: the KV cache for `n_ctx` tokens in all, and the recurrent layers'
/// state for each of `n_sequences`.
pub fn context_memory_bytes(inventory: &Inventory, n_ctx: u32, n_sequences: u32, kv: KvTypes) -> u64 {
    kv_cache_bytes(inventory, n_ctx, kv) + inventory.hparams.recurrent_state_bytes * u64::from(n_sequences.max(1))
}

/// llama.cpp's CPU compute buffer, estimated: the logits and a few FFN-wide and model-wide
/// activations of one ubatch (flash attention keeps the attention scores out of it), plus a
/// margin. Measured against llama.cpp's own report at n_ubatch 512 it is 8% over on Gemma 3
/// 270M (the logits dominate) and 40–70% over on the forge's models; an underestimate would
/// break the budget.
pub fn compute_buffer_bytes(inventory: &Inventory, _n_ctx: u32, n_ubatch: u32) -> u64 {
    let hparams = &inventory.hparams;
    let ff = hparams.n_ff.max(hparams.n_ff_expert * hparams.n_expert_used.max(1));
    let per_token = hparams.n_vocab + 4 * hparams.n_embd + 4 * ff;
    4 * u64::from(n_ubatch) * per_token + (32 << 20)
}

/// A GPU's compute buffers and the kernels' scratch, estimated: the CPU's estimate above, the
/// attention mask of a batch over the context (an F32 input and its F16 cast), and for a model
/// with routed experts four `n_embd × n_expert_used` F32 rows per token (the experts' gathered
/// inputs and their outputs, and CUDA's copies of both in its memory pool). Measured on the
/// H200 machine with Qwen3.6-35B-A3B's shape and the expert pool: the device used 0.30 GiB more
/// than the CPU's estimate planned at batches of 1,024 tokens and context 1,024, 0.56 GiB at
/// 2,048 and 5,120, 0.61 GiB at 2,048 and 17,408 (the terms here: 0.25, 0.54 and 0.63 GiB).
pub fn device_compute_bytes(inventory: &Inventory, n_ctx: u32, n_ubatch: u32) -> u64 {
    let hparams = &inventory.hparams;
    let mask = 4 * u64::from(n_ctx) * u64::from(n_ubatch);
    let experts = if hparams.n_expert > 0 { 16 * hparams.n_embd * hparams.n_expert_used } else { 0 };
    compute_buffer_bytes(inventory, n_ctx, n_ubatch) + mask + experts * u64::from(n_ubatch)
}

/// llama.cpp's name for the token embedding, which it keeps in host memory (tokens are looked up
/// on the CPU). Models without an output matrix compute logits with a copy of it, under the
/// same name, so overriding the name would move that copy off the GPU too.
pub(super) const TOKEN_EMBEDDING: &str = "token_embd.weight";

/// Whether the file has no output matrix, so that the token embedding is the output too (read
/// whole by every token).
pub(super) fn output_is_tied(inventory: &Inventory) -> bool {
    !inventory.tensors.iter().any(|tensor| tensor.role == crate::model::Role::Output)
}

/// Tensors llama.cpp keeps on its input layer, always on the CPU (they are looked up by
/// token or position): the token embeddings and the few other input tables.
pub(super) fn on_input_layer(tensor: &TensorEntry) -> bool {
    const INPUT_TABLES: [&str; 4] = ["position_embd", "token_types", "masked_embd_centroids", "masked_embd_ordering"];
    tensor.role == crate::model::Role::TokenEmbedding
        || (tensor.layer.is_none()
            && INPUT_TABLES.iter().any(|table| {
                tensor.name.strip_prefix(table).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
            }))
}

/// Tensors the dense-stream mode may stream: dense FFN weights and routed experts.
pub(super) fn is_streamable(tensor: &TensorEntry) -> bool {
    tensor.layer.is_some() && (tensor.role.is_dense_ffn() || tensor.role.is_expert())
}

/// Per-layer bytes of streamable tensors.
pub(super) fn ffn_bytes_by_layer(inventory: &Inventory) -> Vec<u64> {
    let mut bytes = vec![0; inventory.hparams.n_layer as usize];
    for tensor in inventory.tensors.iter().filter(|tensor| is_streamable(tensor)) {
        bytes[tensor.layer.expect("streamable tensors have a layer") as usize] += tensor.bytes;
    }
    bytes
}
