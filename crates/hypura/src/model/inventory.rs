//! `Inventory`: every tensor with its role, layer, bytes and (for experts) per-expert slices.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hypura_gguf::{GgmlType, GgufError, ModelFiles, Value};
use serde::Serialize;

use super::architectures::KNOWN_ARCHITECTURES;
use super::role::{layer_of, Role};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error("{path}: {source}")]
    Gguf { path: PathBuf, source: GgufError },
    #[error("{path}: no general.architecture key; this is not a llama.cpp model file")]
    NoArchitecture { path: PathBuf },
    #[error("{path}: unknown architecture {arch:?}; this build of llama.cpp knows {known} architectures (see `hypura inspect --help`)")]
    UnknownArchitecture { path: PathBuf, arch: String, known: usize },
    #[error("{path}: metadata key {key} is missing or not a number")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: tensor {tensor} has {bytes} bytes, which do not split into {n_expert} experts")]
    BadExpertTensor { path: PathBuf, tensor: String, bytes: u64, n_expert: u64 },
    #[error("{path}: tensor {tensor} is in layer {layer} but the model has {n_layer} layers")]
    LayerOutOfRange { path: PathBuf, tensor: String, layer: u32, n_layer: u64 },
}

/// The hparams Hypura plans with, in llama.cpp's words.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hparams {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    /// Width of one key head (`attention.key_length`, default n_embd / n_head).
    pub head_dim_k: u64,
    pub head_dim_v: u64,
    pub n_ctx_train: u64,
    pub n_ff: u64,
    pub n_expert: u64,
    pub n_expert_used: u64,
    pub n_ff_expert: u64,
    pub n_vocab: u64,
    /// Trailing multi-token-prediction layers (`nextn_predict_layers`), counted in `n_layer`;
    /// decode does not run them.
    pub n_layer_mtp: u64,
    /// Layers with a KV cache: all but the MTP ones, less the recurrent layers of hybrid models
    /// (Qwen3.5/3.6 attend in every 4th layer) whose state size is known.
    pub n_layer_kv: u64,
    /// Elements of one token's KV row in one layer: K and V of every KV head, or K alone where
    /// the cache holds multi-head latent attention's compressed row (V is a view of it).
    pub kv_row_elements: u64,
    /// The recurrent layers' state for one sequence (conv and SSM state, F32), 0 without.
    pub recurrent_state_bytes: u64,
}

impl Hparams {
    /// The model routes each token to some of several experts (MoE).
    pub fn routes_experts(&self) -> bool {
        self.n_expert > 1
    }
}

/// Where each expert's bytes lie inside an expert tensor (`[.., .., n_expert]`, expert-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertSlices {
    pub n_expert: u64,
    pub slice_bytes: u64,
}

impl ExpertSlices {
    /// Absolute file range of expert `expert` for a tensor whose data starts at `file_offset`.
    pub fn range(&self, file_offset: u64, expert: u64) -> std::ops::Range<u64> {
        let start = file_offset + expert * self.slice_bytes;
        start..start + self.slice_bytes
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TensorEntry {
    pub name: String,
    pub role: Role,
    pub layer: Option<u32>,
    #[serde(serialize_with = "serialize_ggml_type")]
    pub ggml_type: GgmlType,
    pub dims: Vec<u64>,
    pub bytes: u64,
    pub split: usize,
    /// Absolute offset of the tensor's data in its split file.
    pub file_offset: u64,
    pub experts: Option<ExpertSlices>,
}

fn serialize_ggml_type<S: serde::Serializer>(ggml_type: &GgmlType, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(ggml_type.name())
}

impl TensorEntry {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Inventory {
    pub path: PathBuf,
    pub split_paths: Vec<PathBuf>,
    pub arch: String,
    pub name: Option<String>,
    pub hparams: Hparams,
    pub tensors: Vec<TensorEntry>,
    pub file_bytes: u64,
}

impl Inventory {
    /// Read the GGUF index (and split files) and classify every tensor. Reads nothing past the
    /// index.
    pub fn open(path: &Path) -> Result<Inventory, ModelError> {
        let files = ModelFiles::open(path).map_err(|source| ModelError::Gguf { path: path.to_path_buf(), source })?;
        Inventory::from_files(path, &files)
    }

    pub fn from_files(path: &Path, files: &ModelFiles) -> Result<Inventory, ModelError> {
        let first = files.first();
        let arch =
            first.architecture().ok_or_else(|| ModelError::NoArchitecture { path: path.to_path_buf() })?.to_string();
        if !KNOWN_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(ModelError::UnknownArchitecture {
                path: path.to_path_buf(),
                arch,
                known: KNOWN_ARCHITECTURES.len(),
            });
        }
        let hparams = read_hparams(path, &arch, first)?;
        let mut tensors = Vec::with_capacity(first.tensors.len());
        for tensor in files.tensors() {
            let layer = layer_of(&tensor.info.name);
            // Every tensor of an MTP layer belongs to the MTP head, whatever its name.
            let mtp = layer.is_some_and(|layer| u64::from(layer) + hparams.n_layer_mtp >= hparams.n_layer);
            let role = if mtp { Role::Mtp } else { Role::from_tensor_name(&tensor.info.name) };
            if let Some(layer) = layer {
                if u64::from(layer) >= hparams.n_layer {
                    return Err(ModelError::LayerOutOfRange {
                        path: path.to_path_buf(),
                        tensor: tensor.info.name.clone(),
                        layer,
                        n_layer: hparams.n_layer,
                    });
                }
            }
            let experts = if role.is_expert() {
                // Experts are the outermost dimension, so each expert is one contiguous slice.
                let n_expert = tensor.info.dims.last().copied().unwrap_or(1);
                if tensor.info.dims.len() < 3 || n_expert == 0 || tensor.info.bytes % n_expert != 0 {
                    return Err(ModelError::BadExpertTensor {
                        path: path.to_path_buf(),
                        tensor: tensor.info.name.clone(),
                        bytes: tensor.info.bytes,
                        n_expert,
                    });
                }
                Some(ExpertSlices { n_expert, slice_bytes: tensor.info.bytes / n_expert })
            } else {
                None
            };
            tensors.push(TensorEntry {
                name: tensor.info.name.clone(),
                role,
                layer,
                ggml_type: tensor.info.ggml_type,
                dims: tensor.info.dims.clone(),
                bytes: tensor.info.bytes,
                split: tensor.split,
                file_offset: tensor.file_offset,
                experts,
            });
        }
        Ok(Inventory {
            path: path.to_path_buf(),
            split_paths: files.splits.iter().map(|split| split.path.clone()).collect(),
            arch,
            name: first.get_str("general.name").map(str::to_string),
            hparams,
            tensors,
            file_bytes: files.total_file_bytes(),
        })
    }

    pub fn tensor_data_bytes(&self) -> u64 {
        self.tensors.iter().map(|tensor| tensor.bytes).sum()
    }

    pub fn n_params(&self) -> u64 {
        self.tensors.iter().map(TensorEntry::n_elements).sum()
    }

    pub fn bytes_by_role(&self) -> BTreeMap<Role, u64> {
        let mut totals = BTreeMap::new();
        for tensor in &self.tensors {
            *totals.entry(tensor.role).or_insert(0) += tensor.bytes;
        }
        totals
    }

    /// Bytes per layer; tensors outside any layer (embeddings, output) are not counted here.
    pub fn bytes_by_layer(&self) -> Vec<u64> {
        let mut totals = vec![0; self.hparams.n_layer as usize];
        for tensor in &self.tensors {
            if let Some(layer) = tensor.layer {
                totals[layer as usize] += tensor.bytes;
            }
        }
        totals
    }

    /// (type, tensor count, bytes) for each ggml type present, largest first.
    pub fn quantization_mix(&self) -> Vec<(GgmlType, usize, u64)> {
        let mut mix: BTreeMap<&'static str, (GgmlType, usize, u64)> = BTreeMap::new();
        for tensor in &self.tensors {
            let entry = mix.entry(tensor.ggml_type.name()).or_insert((tensor.ggml_type, 0, 0));
            entry.1 += 1;
            entry.2 += tensor.bytes;
        }
        let mut mix: Vec<_> = mix.into_values().collect();
        mix.sort_by_key(|entry| std::cmp::Reverse(entry.2));
        mix
    }

    /// The per-expert slice of expert tensors, if the model has experts (all expert tensors of
    /// a model share n_expert; slice sizes differ by tensor type).
    pub fn expert_tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.iter().filter(|tensor| tensor.experts.is_some())
    }
}

fn read_hparams(path: &Path, arch: &str, gguf: &hypura_gguf::Gguf) -> Result<Hparams, ModelError> {
    let key = |suffix: &str| format!("{arch}.{suffix}");
    // Some keys are per-layer arrays (e.g. head_count_kv in hybrid models): plan with the largest.
    let number = |suffix: &str| -> Option<u64> {
        match gguf.get(&key(suffix))? {
            Value::Array(_, values) => values.iter().filter_map(Value::as_u64).max(),
            value => value.as_u64(),
        }
    };
    let required = |suffix: &str| {
        number(suffix).ok_or_else(|| ModelError::MissingKey { path: path.to_path_buf(), key: key(suffix) })
    };
    let n_layer = required("block_count")?;
    let n_embd = required("embedding_length")?;
    let n_head = number("attention.head_count").unwrap_or(0);
    let n_head_kv = number("attention.head_count_kv").unwrap_or(n_head);
    let default_head_dim = n_embd.checked_div(n_head).unwrap_or(0);
    let head_dim_k = number("attention.key_length").unwrap_or(default_head_dim);
    let n_vocab = number("vocab_size")
        .or_else(|| gguf.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(|tokens| tokens.len() as u64))
        .unwrap_or(0);
    let n_layer_mtp = number("nextn_predict_layers").unwrap_or(0).min(n_layer);
    let head_dim_v = number("attention.value_length").unwrap_or(head_dim_k);
    let (n_layer_kv, recurrent_state_bytes) = attention_layers(gguf, arch, &key, n_layer - n_layer_mtp);
    let latent = number("attention.key_length_mla").is_some();
    Ok(Hparams {
        n_layer,
        n_embd,
        n_head,
        n_head_kv,
        head_dim_k,
        head_dim_v,
        n_ctx_train: number("context_length").unwrap_or(0),
        n_ff: number("feed_forward_length").unwrap_or(0),
        n_expert: number("expert_count").unwrap_or(0),
        n_expert_used: number("expert_used_count").unwrap_or(0),
        n_ff_expert: number("expert_feed_forward_length").unwrap_or(0),
        n_vocab,
        n_layer_mtp,
        n_layer_kv,
        kv_row_elements: n_head_kv * (head_dim_k + if latent { 0 } else { head_dim_v }),
        recurrent_state_bytes,
    })
}

/// Of the `trunk` layers (all but MTP): how many keep a KV cache, and the recurrent layers'
/// state per sequence. A hybrid model says which layers attend by a per-layer
/// `head_count_kv` (0 for a recurrent layer) or, in Qwen3-Next and Qwen3.5/3.6, by
/// `full_attention_interval` (every 4th by default). The recurrent state is llama.cpp's for a
/// Mamba-style layer: (conv kernel − 1) × (inner + 2 × groups × state) conv values and
/// state × inner SSM values, F32. Where the file does not give those sizes (Kimi's and GLM's
/// KDA layers), every trunk layer is counted as attending instead, which is more.
fn attention_layers(gguf: &hypura_gguf::Gguf, arch: &str, key: &dyn Fn(&str) -> String, trunk: u64) -> (u64, u64) {
    let get = |suffix: &str| gguf.get(&key(suffix)).and_then(Value::as_u64);
    let attends: Vec<bool> = match gguf.get(&key("attention.head_count_kv")) {
        Some(Value::Array(_, values)) => {
            values.iter().take(trunk as usize).map(|value| value.as_u64().unwrap_or(1) > 0).collect()
        }
        _ if matches!(arch, "qwen35moe" | "qwen3next") => {
            let interval = get("full_attention_interval").unwrap_or(4).max(1);
            (0..trunk).map(|layer| (layer + 1) % interval == 0).collect()
        }
        _ => return (trunk, 0),
    };
    let recurrent = attends.iter().filter(|&&attends| !attends).count() as u64;
    let (Some(state), Some(inner), Some(conv)) = (get("ssm.state_size"), get("ssm.inner_size"), get("ssm.conv_kernel"))
    else {
        return (trunk, 0);
    };
    let groups = get("ssm.group_count").unwrap_or(1);
    let per_layer = 4 * (conv.saturating_sub(1) * (inner + 2 * groups * state) + state * inner);
    (trunk - recurrent, recurrent * per_layer)
}
