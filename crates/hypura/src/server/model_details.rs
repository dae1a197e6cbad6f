//! What `/api/show`, `/api/tags` and `/api/ps` say about a model, read from its GGUF index
//! (never its tensor data) with `hypura-gguf`, so a model does not have to be loaded to be
//! described.
use std::path::Path;

use hypura_gguf::{Gguf, Value as GgufValue};
use serde_json::{json, Map, Value};

use super::error::AppError;

/// Arrays longer than this (the vocabulary, merges, token types) are shown empty unless the
/// request asks for `verbose`, as Ollama does.
const LONG_ARRAY: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Details {
    pub family: String,
    pub parameter_size: String,
    pub quantization_level: String,
}

/// `details` for tags, ps and show.
pub fn details_object(details: &Details) -> Value {
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": details.family,
        "families": [details.family],
        "parameter_size": details.parameter_size,
        "quantization_level": details.quantization_level,
    })
}

pub fn read_details(path: &Path) -> Result<Details, AppError> {
    let gguf = open(path)?;
    Ok(details(&gguf))
}

fn open(path: &Path) -> Result<Gguf, AppError> {
    Gguf::open(path).map_err(|error| AppError::internal(format!("reading {}: {error}", path.display())))
}

fn details(gguf: &Gguf) -> Details {
    Details {
        family: gguf.architecture().unwrap_or("").to_string(),
        parameter_size: parameter_size(parameter_count(gguf)),
        quantization_level: quantization_level(gguf),
    }
}

fn parameter_count(gguf: &Gguf) -> u64 {
    gguf.tensors.iter().map(|tensor| tensor.dims.iter().product::<u64>()).sum()
}

/// Ollama's short form: `3.2B`, `268.10M`.
fn parameter_size(count: u64) -> String {
    let count = count as f64;
    if count >= 1e9 {
        format!("{:.1}B", count / 1e9)
    } else if count >= 1e6 {
        format!("{:.2}M", count / 1e6)
    } else {
        format!("{:.2}K", count / 1e3)
    }
}

/// llama.cpp's file type name (`general.file_type`), else the type holding the most bytes.
fn quantization_level(gguf: &Gguf) -> String {
    const FILE_TYPES: &[(u64, &str)] = &[
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (7, "Q8_0"),
        (8, "Q5_0"),
        (9, "Q5_1"),
        (10, "Q2_K"),
        (11, "Q3_K_S"),
        (12, "Q3_K_M"),
        (13, "Q3_K_L"),
        (14, "Q4_K_S"),
        (15, "Q4_K_M"),
        (16, "Q5_K_S"),
        (17, "Q5_K_M"),
        (18, "Q6_K"),
        (19, "IQ2_XXS"),
        (20, "IQ2_XS"),
        (21, "Q2_K_S"),
        (22, "IQ3_XS"),
        (23, "IQ3_XXS"),
        (24, "IQ1_S"),
        (25, "IQ4_NL"),
        (26, "IQ3_S"),
        (27, "IQ3_M"),
        (28, "IQ2_S"),
        (29, "IQ2_M"),
        (30, "IQ4_XS"),
        (31, "IQ1_M"),
        (32, "BF16"),
        (36, "TQ1_0"),
        (37, "TQ2_0"),
        (38, "MXFP4"),
    ];
    if let Some(name) = gguf
        .get_u64("general.file_type")
        .and_then(|id| FILE_TYPES.iter().find(|(known, _)| *known == id))
        .map(|(_, name)| *name)
    {
        return name.to_string();
    }
    let mut bytes_by_type: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for tensor in &gguf.tensors {
        *bytes_by_type.entry(tensor.ggml_type.name()).or_default() += tensor.bytes;
    }
    bytes_by_type
        .into_iter()
        .max_by_key(|(_, bytes)| *bytes)
        .map(|(name, _)| name.to_ascii_uppercase())
        .unwrap_or_default()
}

fn to_json(value: &GgufValue, verbose: bool) -> Value {
    match value {
        GgufValue::U8(number) => json!(number),
        GgufValue::I8(number) => json!(number),
        GgufValue::U16(number) => json!(number),
        GgufValue::I16(number) => json!(number),
        GgufValue::U32(number) => json!(number),
        GgufValue::I32(number) => json!(number),
        GgufValue::U64(number) => json!(number),
        GgufValue::I64(number) => json!(number),
        GgufValue::F32(number) => json!(number),
        GgufValue::F64(number) => json!(number),
        GgufValue::Bool(flag) => json!(flag),
        GgufValue::String(text) => json!(text),
        GgufValue::Array(_, items) if !verbose && items.len() > LONG_ARRAY => json!([]),
        GgufValue::Array(_, items) => Value::Array(items.iter().map(|item| to_json(item, verbose)).collect()),
    }
}

/// The body of `/api/show` (without `modified_at`).
pub fn show_model(path: &Path, verbose: bool) -> Result<Map<String, Value>, AppError> {
    let gguf = open(path)?;
    let details = details(&gguf);
    let mut model_info = Map::new();
    for (key, value) in &gguf.metadata {
        model_info.insert(key.clone(), to_json(value, verbose));
    }
    model_info.entry("general.parameter_count").or_insert_with(|| json!(parameter_count(&gguf)));
    let arch = details.family.clone();
    // Every generative model also answers /api/embed (mean pooling), so it lists both; tools
    // and thinking are what its chat template renders (llama.cpp's chat layer reads it).
    let capabilities = if gguf.get(&format!("{arch}.pooling_type")).is_some() {
        vec!["embedding"]
    } else {
        let caps = crate::engine::ChatTemplate::caps_of(gguf.get_str("tokenizer.chat_template"));
        let mut capabilities = vec!["completion"];
        if caps.tools {
            capabilities.push("tools");
        }
        if caps.thinking {
            capabilities.push("thinking");
        }
        capabilities.push("embedding");
        capabilities
    };
    let mut object = Map::new();
    object.insert("license".into(), json!(gguf.get_str("general.license").unwrap_or("")));
    object.insert("modelfile".into(), json!(format!("# Modelfile generated by \"hypura\"\nFROM {}\n", path.display())));
    object.insert("parameters".into(), json!(""));
    object.insert("template".into(), json!(gguf.get_str("tokenizer.chat_template").unwrap_or("")));
    object.insert("details".into(), details_object(&details));
    object.insert("model_info".into(), Value::Object(model_info));
    object.insert("capabilities".into(), json!(capabilities));
    if verbose {
        let tensors: Vec<Value> = gguf
            .tensors
            .iter()
            .map(|tensor| json!({"name": tensor.name, "type": tensor.ggml_type.name(), "shape": tensor.dims}))
            .collect();
        object.insert("tensors".into(), Value::Array(tensors));
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes_read_like_ollama() {
        assert_eq!(parameter_size(3_212_749_888), "3.2B");
        assert_eq!(parameter_size(268_098_176), "268.10M");
        assert_eq!(parameter_size(12_345), "12.35K");
    }
}
