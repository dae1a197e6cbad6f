//! Parses a real model if one is available: `HYPURA_TEST_MODEL`, else the gemma-3 270M
//! Q4_K_M file that CI downloads to ~/.cache/hypura/models.

use std::path::PathBuf;

use hypura_gguf::{GgmlType, Gguf, ModelFiles};

fn model_path() -> Option<PathBuf> {
    let path = match std::env::var_os("HYPURA_TEST_MODEL") {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/hypura/models/gemma-3-270m-q4_k_m.gguf"),
    };
    if path.is_file() {
        Some(path)
    } else {
        eprintln!("skipping: model file {} not found (set HYPURA_TEST_MODEL)", path.display());
        None
    }
}

#[test]
fn gemma3_270m_index() {
    let Some(path) = model_path() else { return };
    let gguf = Gguf::open(&path).unwrap();
    assert_eq!(gguf.architecture(), Some("gemma3"));
    assert_eq!(gguf.tensors.len(), 236);
    assert_eq!(gguf.get_u64("gemma3.block_count"), Some(18));
    assert_eq!(gguf.file_bytes, std::fs::metadata(&path).unwrap().len());
    assert_eq!(gguf.data_offset % gguf.alignment, 0);
    assert!(gguf.tensor_data_bytes() <= gguf.file_bytes - gguf.data_offset);
    for tensor in &gguf.tensors {
        assert_eq!(tensor.ggml_type.tensor_bytes(&tensor.dims), Some(tensor.bytes), "{}", tensor.name);
        assert!(gguf.data_offset + tensor.offset + tensor.bytes <= gguf.file_bytes, "{}", tensor.name);
    }
    let tokens = gguf.get("tokenizer.ggml.tokens").and_then(|value| value.as_array()).unwrap();
    assert!(tokens.len() > 1000);
    // A Q4_K_M file holds mostly k-quants.
    assert!(gguf.tensors.iter().any(|tensor| tensor.ggml_type == GgmlType::Q4_K));

    let files = ModelFiles::open(&path).unwrap();
    assert_eq!(files.splits.len(), 1);
    assert_eq!(files.tensors().count(), 236);
}
