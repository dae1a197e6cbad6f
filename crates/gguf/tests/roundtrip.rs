//! Writer -> reader round trips.

use std::io::{Read, Seek, SeekFrom};

use hypura_gguf::{GgmlType, Gguf, GgufError, GgufWriter, Value, ValueType};
use proptest::prelude::*;

fn pattern(index: usize, length: u64) -> Vec<u8> {
    (0..length).map(|byte| (byte as usize * 31 + index * 7 + 1) as u8).collect()
}

fn read_at(path: &std::path::Path, offset: u64, length: u64) -> Vec<u8> {
    let mut file = std::fs::File::open(path).unwrap();
    file.seek(SeekFrom::Start(offset)).unwrap();
    let mut bytes = vec![0u8; length as usize];
    file.read_exact(&mut bytes).unwrap();
    bytes
}

#[test]
fn basic_round_trip() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("model.gguf");
    let mut writer = GgufWriter::new();
    writer
        .add_metadata("general.architecture", Value::String("llama".into()))
        .add_metadata("llama.block_count", Value::U32(2))
        .add_metadata("llama.rope.freq_base", Value::F32(10000.0))
        .add_metadata(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, vec![Value::String("<s>".into()), Value::String("é".into())]),
        )
        .add_tensor("token_embd.weight", &[256, 4], GgmlType::Q4_K)
        .add_tensor("output_norm.weight", &[7], GgmlType::F32)
        .add_tensor("blk.0.attn_q.weight", &[32, 3], GgmlType::Q8_0);
    let layout = writer.write_file(&path, |index| pattern(index, writer_bytes(&writer, index))).unwrap();

    let gguf = Gguf::open(&path).unwrap();
    assert_eq!(gguf.version, 3);
    assert_eq!(gguf.alignment, 32);
    assert_eq!(gguf.architecture(), Some("llama"));
    assert_eq!(gguf.get_u64("llama.block_count"), Some(2));
    assert_eq!(gguf.get_f64("llama.rope.freq_base"), Some(10000.0));
    assert_eq!(gguf.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap().len(), 2);
    assert_eq!(gguf.metadata, writer.metadata);
    assert_eq!(gguf.data_offset, layout.data_offset);
    assert_eq!(gguf.data_offset % 32, 0);
    assert_eq!(gguf.file_bytes, layout.file_bytes);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), layout.file_bytes);
    assert_eq!(gguf.tensors.len(), 3);
    let embedding = gguf.tensor("token_embd.weight").unwrap();
    assert_eq!(embedding.dims, vec![256, 4]);
    assert_eq!(embedding.ggml_type, GgmlType::Q4_K);
    assert_eq!(embedding.bytes, 4 * 144);
    assert_eq!(gguf.tensor("output_norm.weight").unwrap().bytes, 28);
    assert_eq!(gguf.tensor("blk.0.attn_q.weight").unwrap().bytes, 3 * 34);
    assert_eq!(gguf.tensor_data_bytes(), 4 * 144 + 28 + 3 * 34);
    assert!(gguf.tensor("missing").is_none());
    for (index, tensor) in gguf.tensors.iter().enumerate() {
        assert_eq!(gguf.data_offset + tensor.offset, layout.tensor_offsets[index]);
        assert_eq!(read_at(&path, layout.tensor_offsets[index], tensor.bytes), pattern(index, tensor.bytes));
    }

    // The same bytes through the streaming entry point.
    let bytes = std::fs::read(&path).unwrap();
    let streamed = Gguf::parse(&bytes[..], bytes.len() as u64).unwrap();
    assert_eq!(streamed.tensors, gguf.tensors);
    assert_eq!(streamed.metadata, gguf.metadata);
}

fn writer_bytes(writer: &GgufWriter, index: usize) -> u64 {
    let tensor = &writer.tensors[index];
    tensor.ggml_type.tensor_bytes(&tensor.dims).unwrap()
}

#[test]
fn custom_alignment_is_written_and_read() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("aligned.gguf");
    let mut writer = GgufWriter { alignment: 4096, ..GgufWriter::default() };
    writer.add_tensor("a", &[3], GgmlType::F32).add_tensor("b", &[5], GgmlType::I8);
    let layout = writer.write_file(&path, |index| pattern(index, writer_bytes(&writer, index))).unwrap();
    assert_eq!(layout.tensor_offsets, vec![4096, 8192]);
    let gguf = Gguf::open(&path).unwrap();
    assert_eq!(gguf.alignment, 4096);
    assert_eq!(gguf.get("general.alignment"), Some(&Value::U32(4096)));
    assert_eq!(gguf.tensors[1].offset, 4096);
}

#[test]
fn empty_file_has_no_tensors() {
    let layout = GgufWriter::new().layout().unwrap();
    let gguf = Gguf::parse(&layout.header[..], layout.file_bytes).unwrap();
    assert!(gguf.tensors.is_empty() && gguf.metadata.is_empty());
    assert_eq!(gguf.tensor_data_bytes(), 0);
}

#[test]
fn writer_rejects_invalid_specs() {
    let mut writer = GgufWriter::new();
    writer.add_metadata("a", Value::U8(1)).add_metadata("a", Value::U8(2));
    assert!(matches!(writer.layout(), Err(GgufError::DuplicateKey { key }) if key == "a"));

    let mut writer = GgufWriter::new();
    writer.add_tensor("t", &[3], GgmlType::F32).add_tensor("t", &[3], GgmlType::F32);
    assert!(matches!(writer.layout(), Err(GgufError::DuplicateTensor { name }) if name == "t"));

    let mut writer = GgufWriter::new();
    writer.add_tensor("t", &[100], GgmlType::Q4_K);
    assert!(matches!(writer.layout(), Err(GgufError::BadDims { tensor, .. }) if tensor == "t"));

    let mut writer = GgufWriter::new();
    writer.add_tensor("t", &[1, 0], GgmlType::F32);
    assert!(matches!(writer.layout(), Err(GgufError::BadDims { .. })));

    let mut writer = GgufWriter::new();
    writer.add_tensor("t", &[1, 1, 1, 1, 1], GgmlType::F32);
    assert!(matches!(writer.layout(), Err(GgufError::BadDims { .. })));

    let mut writer = GgufWriter::new();
    writer.add_tensor("x".repeat(64), &[1], GgmlType::F32);
    assert!(matches!(writer.layout(), Err(GgufError::TensorNameTooLong { length: 64, .. })));

    let writer = GgufWriter { alignment: 48, ..GgufWriter::default() };
    assert!(matches!(writer.layout(), Err(GgufError::BadAlignment { alignment: 48 })));

    let mut writer = GgufWriter::new();
    writer.add_metadata("mixed", Value::Array(ValueType::U8, vec![Value::U8(1), Value::I8(1)]));
    assert!(matches!(writer.layout(), Err(GgufError::BadValue { key, .. }) if key == "mixed"));

    let mut writer = GgufWriter::new();
    writer.add_metadata("general.alignment", Value::U64(64));
    assert!(matches!(writer.layout(), Err(GgufError::WrongKeyType { .. })));

    let directory = tempfile::tempdir().unwrap();
    let mut writer = GgufWriter::new();
    writer.add_tensor("t", &[4], GgmlType::F32);
    let result = writer.write_file(&directory.path().join("short.gguf"), |_| vec![0; 15]);
    assert!(matches!(result, Err(GgufError::DataLength { expected: 16, actual: 15, .. })));
}

// ---- property test ----

fn scalar_strategy(value_type: ValueType) -> BoxedStrategy<Value> {
    match value_type {
        ValueType::U8 => any::<u8>().prop_map(Value::U8).boxed(),
        ValueType::I8 => any::<i8>().prop_map(Value::I8).boxed(),
        ValueType::U16 => any::<u16>().prop_map(Value::U16).boxed(),
        ValueType::I16 => any::<i16>().prop_map(Value::I16).boxed(),
        ValueType::U32 => any::<u32>().prop_map(Value::U32).boxed(),
        ValueType::I32 => any::<i32>().prop_map(Value::I32).boxed(),
        ValueType::F32 => any::<f32>().prop_map(Value::F32).boxed(),
        ValueType::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        ValueType::String => ".{0,12}".prop_map(Value::String).boxed(),
        ValueType::U64 => any::<u64>().prop_map(Value::U64).boxed(),
        ValueType::I64 => any::<i64>().prop_map(Value::I64).boxed(),
        ValueType::F64 => any::<f64>().prop_map(Value::F64).boxed(),
        ValueType::Array => unreachable!("arrays are built by array_strategy"),
    }
}

const SCALAR_TYPES: [ValueType; 12] = [
    ValueType::U8,
    ValueType::I8,
    ValueType::U16,
    ValueType::I16,
    ValueType::U32,
    ValueType::I32,
    ValueType::F32,
    ValueType::Bool,
    ValueType::String,
    ValueType::U64,
    ValueType::I64,
    ValueType::F64,
];

fn array_strategy(depth: u32) -> BoxedStrategy<Value> {
    let flat = prop::sample::select(&SCALAR_TYPES[..])
        .prop_flat_map(|element_type| {
            prop::collection::vec(scalar_strategy(element_type), 0..6)
                .prop_map(move |elements| Value::Array(element_type, elements))
        })
        .boxed();
    if depth == 0 {
        return flat;
    }
    let nested = prop::collection::vec(array_strategy(depth - 1), 0..4)
        .prop_map(|elements| Value::Array(ValueType::Array, elements))
        .boxed();
    prop_oneof![2 => flat, 1 => nested].boxed()
}

fn value_strategy() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => prop::sample::select(&SCALAR_TYPES[..]).prop_flat_map(scalar_strategy),
        1 => array_strategy(2),
    ]
    .boxed()
}

/// Equality that treats NaNs with the same bits as equal, since the file stores bits.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(a), Value::F32(b)) => a.to_bits() == b.to_bits(),
        (Value::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
        (Value::Array(type_a, a), Value::Array(type_b, b)) => {
            type_a == type_b && a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_value(a, b))
        }
        _ => a == b,
    }
}

fn tensor_strategy() -> impl Strategy<Value = (Vec<u64>, GgmlType)> {
    (prop::sample::select(&GgmlType::ALL[..]), prop::collection::vec(1u64..4, 1..=4), 1u64..3).prop_map(
        |(ggml_type, mut dims, blocks)| {
            dims[0] = ggml_type.block_size() * blocks;
            (dims, ggml_type)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn random_files_round_trip(
        metadata in prop::collection::vec(("[a-z]{1,6}(\\.[a-z_]{1,6}){0,2}", value_strategy()), 0..8),
        tensors in prop::collection::vec(tensor_strategy(), 0..8),
        alignment_power in 0u32..8,
    ) {
        let mut writer = GgufWriter { alignment: 1 << alignment_power, ..GgufWriter::default() };
        let mut seen = std::collections::HashSet::new();
        for (key, value) in metadata {
            if key != "general.alignment" && seen.insert(key.clone()) {
                writer.add_metadata(key, value);
            }
        }
        for (index, (dims, ggml_type)) in tensors.iter().enumerate() {
            writer.add_tensor(format!("tensor.{index}"), dims, *ggml_type);
        }
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("random.gguf");
        let layout = writer.write_file(&path, |index| pattern(index, writer_bytes(&writer, index))).unwrap();
        let gguf = Gguf::open(&path).unwrap();

        let expected_alignment = 1u64 << alignment_power;
        prop_assert_eq!(gguf.alignment, expected_alignment);
        let read_metadata: Vec<_> = gguf
            .metadata
            .iter()
            .filter(|(key, _)| expected_alignment == 32 || key != "general.alignment")
            .collect();
        prop_assert_eq!(read_metadata.len(), writer.metadata.len());
        for ((read_key, read_value), (key, value)) in read_metadata.into_iter().zip(&writer.metadata) {
            prop_assert_eq!(read_key, key);
            prop_assert!(same_value(read_value, value), "{key}: {read_value:?} != {value:?}");
            prop_assert!(same_value(gguf.get(key).unwrap(), value));
        }
        prop_assert_eq!(gguf.data_offset, layout.data_offset);
        prop_assert_eq!(gguf.file_bytes, layout.file_bytes);
        prop_assert_eq!(gguf.tensors.len(), writer.tensors.len());
        for (index, (tensor, spec)) in gguf.tensors.iter().zip(&writer.tensors).enumerate() {
            prop_assert_eq!(&tensor.name, &spec.name);
            prop_assert_eq!(&tensor.dims, &spec.dims);
            prop_assert_eq!(tensor.ggml_type, spec.ggml_type);
            prop_assert_eq!(tensor.bytes, layout.tensor_bytes[index]);
            prop_assert_eq!(gguf.data_offset + tensor.offset, layout.tensor_offsets[index]);
            prop_assert_eq!(tensor.offset % expected_alignment, 0);
            prop_assert_eq!(read_at(&path, layout.tensor_offsets[index], tensor.bytes), pattern(index, tensor.bytes));
        }
    }
}

/// Writes small valid files as fuzzing seeds into `$HYPURA_FUZZ_SEED_DIR` (see
/// fuzz/seed_corpus.sh). Without the variable it writes to a temp dir; it also checks that every seed parses.
#[test]
fn write_fuzz_seeds() {
    // Without HYPURA_FUZZ_SEED_DIR the seeds go to a temporary directory: the test still
    // checks that every seed parses.
    let scratch = tempfile::tempdir().unwrap();
    let directory = std::env::var_os("HYPURA_FUZZ_SEED_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| scratch.path().to_path_buf());
    let mut seeds = Vec::new();

    let mut writer = GgufWriter::new();
    writer
        .add_metadata("general.architecture", Value::String("llama".into()))
        .add_metadata("llama.block_count", Value::U32(1))
        .add_tensor("token_embd.weight", &[32, 2], GgmlType::Q8_0);
    seeds.push(("llama_q8.gguf.bin", writer));

    let mut writer = GgufWriter { alignment: 64, ..GgufWriter::default() };
    writer
        .add_metadata("a", Value::Array(ValueType::String, vec![Value::String("x".into()), Value::String("yz".into())]))
        .add_metadata("b", Value::Array(ValueType::Array, vec![Value::Array(ValueType::F32, vec![Value::F32(1.5)])]))
        .add_metadata("c", Value::Bool(true))
        .add_metadata("d", Value::I64(-5))
        .add_metadata("e", Value::F64(2.5))
        .add_tensor("x", &[256], GgmlType::Q4_K)
        .add_tensor("y", &[4, 2, 1, 3], GgmlType::F16);
    seeds.push(("all_types_aligned_64.gguf.bin", writer));

    let mut writer = GgufWriter::new();
    writer.add_metadata("split.no", Value::U16(0)).add_metadata("split.count", Value::U16(2));
    for (index, ggml_type) in
        [GgmlType::IQ4_XS, GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::BF16].into_iter().enumerate()
    {
        writer.add_tensor(format!("t{index}"), &[ggml_type.block_size() * 2], ggml_type);
    }
    seeds.push(("split_many_types.gguf.bin", writer));

    seeds.push(("empty.gguf.bin", GgufWriter::new()));

    for (name, writer) in seeds {
        let path = directory.join(name);
        writer.write_file(&path, |index| pattern(index, writer_bytes(&writer, index))).unwrap();
        assert!(Gguf::open(&path).is_ok(), "{name}");
    }
}
