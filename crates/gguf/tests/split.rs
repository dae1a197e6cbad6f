//! Models split into several files the way llama.cpp's gguf-split names and tags them.

use std::path::Path;

use hypura_gguf::{split_file_name, GgmlType, GgufError, GgufWriter, ModelFiles, Value};

/// Writes `prefix-0000i-of-0000N.gguf` with `tensors_per_split[i]` f32 tensors each; returns
/// the data each tensor was written with, by name.
fn write_split_model(directory: &Path, prefix: &str, tensors_per_split: &[usize]) -> Vec<(String, Vec<u8>)> {
    let count = tensors_per_split.len() as u64;
    let total: usize = tensors_per_split.iter().sum();
    let mut written = Vec::new();
    for (split, &tensor_count) in tensors_per_split.iter().enumerate() {
        let mut writer = GgufWriter::new();
        if split == 0 {
            writer.add_metadata("general.architecture", Value::String("llama".into()));
        }
        writer
            .add_metadata("split.no", Value::U16(split as u16))
            .add_metadata("split.count", Value::U16(count as u16))
            .add_metadata("split.tensors.count", Value::I32(total as i32));
        let mut data = Vec::new();
        for index in 0..tensor_count {
            let name = format!("blk.{split}.weight{index}");
            let elements = 8 * (index as u64 + 1);
            writer.add_tensor(name.clone(), &[elements], GgmlType::F32);
            let bytes: Vec<u8> = (0..elements * 4).map(|byte| (byte as usize + split * 13 + index) as u8).collect();
            data.push(bytes.clone());
            written.push((name, bytes));
        }
        let path = directory.join(split_file_name(prefix, split as u64, count));
        writer.write_file(&path, |index| data[index].clone()).unwrap();
    }
    written
}

#[test]
fn split_file_names_follow_llama_cpp() {
    assert_eq!(split_file_name("model", 0, 3), "model-00001-of-00003.gguf");
    assert_eq!(split_file_name("a/b", 11, 12), "a/b-00012-of-00012.gguf");
}

#[test]
fn three_way_split_is_found_from_the_first_file() {
    let directory = tempfile::tempdir().unwrap();
    let written = write_split_model(directory.path(), "model", &[2, 3, 1]);
    let first_path = directory.path().join("model-00001-of-00003.gguf");
    let files = ModelFiles::open(&first_path).unwrap();

    assert_eq!(files.splits.len(), 3);
    assert_eq!(files.first().architecture(), Some("llama"));
    assert_eq!(files.splits[2].path, directory.path().join("model-00003-of-00003.gguf"));
    let expected_bytes: u64 = files.splits.iter().map(|split| std::fs::metadata(&split.path).unwrap().len()).sum();
    assert_eq!(files.total_file_bytes(), expected_bytes);

    let tensors: Vec<_> = files.tensors().collect();
    assert_eq!(tensors.len(), 6);
    assert_eq!(tensors.iter().map(|tensor| tensor.split).collect::<Vec<_>>(), vec![0, 0, 1, 1, 1, 2]);
    for (tensor, (name, bytes)) in tensors.iter().zip(&written) {
        assert_eq!(&tensor.info.name, name);
        assert_eq!(tensor.path, files.splits[tensor.split].path.as_path());
        assert_eq!(tensor.file_offset, files.splits[tensor.split].gguf.data_offset + tensor.info.offset);
        let file = std::fs::read(tensor.path).unwrap();
        let start = tensor.file_offset as usize;
        assert_eq!(&file[start..start + tensor.info.bytes as usize], &bytes[..], "{name}");
    }
}

#[test]
fn plain_file_is_a_single_split() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("plain.gguf");
    let mut writer = GgufWriter::new();
    writer.add_tensor("w", &[4], GgmlType::F32);
    writer.write_file(&path, |_| vec![1; 16]).unwrap();
    let files = ModelFiles::open(&path).unwrap();
    assert_eq!(files.splits.len(), 1);
    let tensors: Vec<_> = files.tensors().collect();
    assert_eq!(tensors.len(), 1);
    assert_eq!(tensors[0].file_offset, files.first().data_offset);
    assert_eq!(files.total_file_bytes(), std::fs::metadata(&path).unwrap().len());
}

#[test]
fn missing_split_is_reported() {
    let directory = tempfile::tempdir().unwrap();
    write_split_model(directory.path(), "model", &[1, 1, 1]);
    let missing = directory.path().join("model-00002-of-00003.gguf");
    std::fs::remove_file(&missing).unwrap();
    let error = ModelFiles::open(&directory.path().join("model-00001-of-00003.gguf")).unwrap_err();
    assert!(matches!(&error, GgufError::SplitMissing { path, index: 1, count: 3 } if path == &missing), "{error}");
    assert!(error.to_string().contains("model-00002-of-00003.gguf"));
}

#[test]
fn opening_a_later_split_is_rejected() {
    let directory = tempfile::tempdir().unwrap();
    write_split_model(directory.path(), "model", &[1, 1]);
    let error = ModelFiles::open(&directory.path().join("model-00002-of-00002.gguf")).unwrap_err();
    assert!(matches!(error, GgufError::NotFirstSplit { index: 1, .. }), "{error}");
}

#[test]
fn misnamed_first_split_is_rejected() {
    let directory = tempfile::tempdir().unwrap();
    write_split_model(directory.path(), "model", &[1, 1]);
    let renamed = directory.path().join("model.gguf");
    std::fs::rename(directory.path().join("model-00001-of-00002.gguf"), &renamed).unwrap();
    let error = ModelFiles::open(&renamed).unwrap_err();
    assert!(matches!(error, GgufError::SplitName { index: 0, count: 2, .. }), "{error}");
}

#[test]
fn split_with_the_wrong_index_is_rejected() {
    let directory = tempfile::tempdir().unwrap();
    write_split_model(directory.path(), "model", &[1, 1, 1]);
    // Put split 3's file where split 2 should be.
    let second = directory.path().join("model-00002-of-00003.gguf");
    std::fs::copy(directory.path().join("model-00003-of-00003.gguf"), &second).unwrap();
    let error = ModelFiles::open(&directory.path().join("model-00001-of-00003.gguf")).unwrap_err();
    assert!(matches!(error, GgufError::SplitIndex { expected: 1, found: 2, .. }), "{error}");
}

#[test]
fn split_from_another_model_is_rejected() {
    let directory = tempfile::tempdir().unwrap();
    write_split_model(directory.path(), "model", &[1, 1, 1]);
    let other = tempfile::tempdir().unwrap();
    write_split_model(other.path(), "model", &[1, 1]);
    // A 2-way split's second file has split.no 1 but split.count 2.
    std::fs::copy(other.path().join("model-00002-of-00002.gguf"), directory.path().join("model-00002-of-00003.gguf"))
        .unwrap();
    let error = ModelFiles::open(&directory.path().join("model-00001-of-00003.gguf")).unwrap_err();
    assert!(matches!(error, GgufError::SplitCount { expected: 3, found: 2, .. }), "{error}");
}

#[test]
fn wrong_total_tensor_count_is_rejected() {
    let directory = tempfile::tempdir().unwrap();
    let written = write_split_model(directory.path(), "m", &[1, 1]);
    assert_eq!(written.len(), 2);
    // Rewrite the first split claiming 5 tensors in total.
    let mut first = GgufWriter::new();
    first
        .add_metadata("split.no", Value::U16(0))
        .add_metadata("split.count", Value::U16(2))
        .add_metadata("split.tensors.count", Value::I32(5))
        .add_tensor("blk.0.weight0", &[8], GgmlType::F32);
    first.write_file(&directory.path().join("m-00001-of-00002.gguf"), |_| vec![0; 32]).unwrap();
    let error = ModelFiles::open(&directory.path().join("m-00001-of-00002.gguf")).unwrap_err();
    assert!(matches!(error, GgufError::SplitTensorCount { expected: 5, found: 2 }), "{error}");
}

#[test]
fn duplicate_tensor_across_splits_is_rejected() {
    let directory = tempfile::tempdir().unwrap();
    write_split_model(directory.path(), "m", &[1, 1]);
    let mut second = GgufWriter::new();
    second.add_metadata("split.no", Value::U16(1)).add_metadata("split.count", Value::U16(2)).add_tensor(
        "blk.0.weight0",
        &[8],
        GgmlType::F32,
    );
    second.write_file(&directory.path().join("m-00002-of-00002.gguf"), |_| vec![0; 32]).unwrap();
    let error = ModelFiles::open(&directory.path().join("m-00001-of-00002.gguf")).unwrap_err();
    assert!(
        matches!(&error, GgufError::DuplicateTensorAcrossSplits { name, first: 0, second: 1 } if name == "blk.0.weight0"),
        "{error}"
    );
}
