//! Malformed and hostile inputs. Each case asserts the specific error variant; the parser must
//! never panic, loop or allocate by an unchecked count on any of them.

use std::path::Path;

use hypura_gguf::{GgmlType, Gguf, GgufError, GgufWriter, Value, ValueType};

/// Little-endian byte builder for hand-made files.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensor_count: u64, key_count: u64) -> Raw {
        Raw::default().bytes(b"GGUF").u32(version).u64(tensor_count).u64(key_count)
    }
    fn bytes(mut self, bytes: &[u8]) -> Raw {
        self.0.extend_from_slice(bytes);
        self
    }
    fn u32(self, value: u32) -> Raw {
        self.bytes(&value.to_le_bytes())
    }
    fn u64(self, value: u64) -> Raw {
        self.bytes(&value.to_le_bytes())
    }
    fn string(self, text: &[u8]) -> Raw {
        self.u64(text.len() as u64).bytes(text)
    }
    /// A key with a u32 value.
    fn key_u32(self, key: &[u8], value: u32) -> Raw {
        self.string(key).u32(ValueType::U32.id()).u32(value)
    }
    fn tensor(self, name: &[u8], dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut raw = self.string(name).u32(dims.len() as u32);
        for &dim in dims {
            raw = raw.u64(dim);
        }
        raw.u32(type_id).u64(offset)
    }
    /// Zero padding to `alignment`, then `data_bytes` bytes of data.
    fn data(self, alignment: usize, data_bytes: usize) -> Raw {
        let mut bytes = self.0;
        bytes.resize(bytes.len().div_ceil(alignment) * alignment + data_bytes, 0);
        Raw(bytes)
    }
}

fn parse(bytes: &[u8]) -> Result<Gguf, GgufError> {
    Gguf::parse(bytes, bytes.len() as u64)
}

/// A file with one f32 tensor of `dims` at `offset` and 64 data bytes.
fn one_tensor(dims: &[u64], type_id: u32, offset: u64) -> Vec<u8> {
    Raw::header(3, 1, 0).tensor(b"t", dims, type_id, offset).data(32, 64).0
}

/// Debug output starts with the variant name, which is what the corpus file names encode.
fn variant(error: &GgufError) -> String {
    let debug = format!("{error:?}");
    debug.split([' ', '(', '{']).next().unwrap_or_default().to_string()
}

fn valid_file() -> (Vec<u8>, hypura_gguf::Layout) {
    let mut writer = GgufWriter::new();
    writer
        .add_metadata("general.architecture", Value::String("llama".into()))
        .add_metadata("llama.block_count", Value::U32(1))
        .add_metadata(
            "list",
            Value::Array(ValueType::String, vec![Value::String("a".into()), Value::String("bc".into())]),
        )
        .add_metadata(
            "nested",
            Value::Array(ValueType::Array, vec![Value::Array(ValueType::I16, vec![Value::I16(-1)])]),
        )
        .add_tensor("a", &[8], GgmlType::F32)
        .add_tensor("b", &[32, 2], GgmlType::Q8_0);
    let layout = writer.layout().unwrap();
    let mut bytes = layout.header.clone();
    bytes.resize(layout.file_bytes as usize, 0xAB);
    (bytes, layout)
}

#[test]
fn the_valid_base_file_parses() {
    let (bytes, layout) = valid_file();
    let gguf = parse(&bytes).unwrap();
    assert_eq!(gguf.tensors.len(), 2);
    assert_eq!(gguf.data_offset, layout.data_offset);
}

#[test]
fn every_truncation_is_an_error() {
    let (bytes, layout) = valid_file();
    let last_end = layout.tensor_offsets[1] + layout.tensor_bytes[1];
    for length in 0..last_end as usize {
        let prefix = &bytes[..length];
        // Honest length: the cut is visible up front.
        let error = parse(prefix).expect_err(&format!("cut at {length}"));
        assert!(
            matches!(error, GgufError::Truncated { .. } | GgufError::OutOfBounds { .. }),
            "cut at {length}: {error}"
        );
        if length < layout.data_offset as usize {
            assert!(!matches!(error, GgufError::OutOfBounds { .. }), "cut at {length}: {error}");
        }
    }
    // Lying length: the stream ends before the claimed size. The parser stops reading at the
    // end of the tensor index, so every cut before that point must be reported as truncation.
    let index_end =
        (0..=bytes.len()).find(|&length| Gguf::parse(&bytes[..length], bytes.len() as u64).is_ok()).unwrap();
    assert!(index_end as u64 > layout.data_offset - 32 && index_end as u64 <= layout.data_offset);
    for length in 0..index_end {
        let error = Gguf::parse(&bytes[..length], bytes.len() as u64).unwrap_err();
        assert!(matches!(error, GgufError::Truncated { .. }), "short stream at {length}: {error}");
    }
    // Cutting only the padding after the last tensor is fine.
    assert!(parse(&bytes[..last_end as usize]).is_ok());
}

#[test]
fn bad_magic() {
    let mut bytes = valid_file().0;
    bytes[0] = b'g';
    assert!(matches!(parse(&bytes), Err(GgufError::BadMagic { found }) if &found == b"gGUF"));
    assert!(matches!(parse(b"GGML\x03\x00\x00\x00"), Err(GgufError::BadMagic { .. })));
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, 99, 0xFFFF_FFFF] {
        let bytes = Raw::header(version, 0, 0).0;
        assert!(matches!(parse(&bytes), Err(GgufError::UnsupportedVersion(found)) if found == version), "{version}");
    }
    for version in [2, 3] {
        assert!(parse(&Raw::header(version, 0, 0).0).is_ok(), "{version}");
    }
}

#[test]
fn big_endian_file() {
    let bytes = Raw::default()
        .bytes(b"GGUF")
        .bytes(&3u32.to_be_bytes())
        .bytes(&0u64.to_be_bytes())
        .bytes(&0u64.to_be_bytes())
        .0;
    let error = parse(&bytes).unwrap_err();
    assert!(matches!(error, GgufError::BigEndian { version: 0x0300_0000 }), "{error}");
    assert!(error.to_string().contains("big-endian"));
}

#[test]
fn absurd_counts() {
    for (tensors, keys, what) in [
        (u64::MAX, 0, "tensors"),
        (0, u64::MAX, "metadata keys"),
        ((1 << 24) + 1, 0, "tensors"),
        (1 << 40, 1 << 40, "metadata keys"),
        (i64::MAX as u64 + 1, 0, "tensors"),
    ] {
        let bytes = Raw::header(3, tensors, keys).0;
        match parse(&bytes) {
            Err(GgufError::TooMany { what: found, count, .. }) => {
                assert_eq!(found, what);
                assert_eq!(count, if what == "tensors" { tensors } else { keys });
            }
            other => panic!("{tensors} {keys}: {other:?}"),
        }
    }
    // Under the caps, but more than the rest of the file could hold: the file was cut short.
    let bytes = Raw::header(3, 1 << 24, 0).0;
    assert!(matches!(parse(&bytes), Err(GgufError::Truncated { at: 24, needed, .. }) if needed == 32 << 24));
    // Counts that each fit, but not together.
    let bytes = Raw::header(3, 3, 4).bytes(&[0; 100]).0;
    assert!(matches!(parse(&bytes), Err(GgufError::Truncated { needed: 152, .. })));
}

#[test]
fn absurd_string_lengths() {
    let bytes = Raw::header(3, 0, 1).u64(u64::MAX).bytes(&[0; 32]).0;
    assert!(matches!(parse(&bytes), Err(GgufError::StringTooLong { length: u64::MAX, .. })));
    let bytes = Raw::header(3, 0, 1).u64((1 << 30) + 1).bytes(&[0; 32]).0;
    assert!(matches!(parse(&bytes), Err(GgufError::StringTooLong { .. })));
    // Within the cap but longer than the file.
    let bytes = Raw::header(3, 0, 1).u64(1000).bytes(&[b'k'; 32]).0;
    assert!(matches!(parse(&bytes), Err(GgufError::Truncated { needed: 1000, .. })));
    // A string value.
    let bytes = Raw::header(3, 0, 1).string(b"k").u32(ValueType::String.id()).u64(u64::MAX).0;
    assert!(matches!(parse(&bytes), Err(GgufError::StringTooLong { context, .. }) if context.contains("'k'")));
}

#[test]
fn unknown_value_types() {
    for id in [13, 100, u32::MAX] {
        let bytes = Raw::header(3, 0, 1).string(b"key").u32(id).u64(0).0;
        assert!(
            matches!(parse(&bytes), Err(GgufError::UnknownValueType { key, id: found }) if key == "key" && found == id)
        );
        let bytes = Raw::header(3, 0, 1).string(b"key").u32(ValueType::Array.id()).u32(id).u64(0).0;
        assert!(matches!(parse(&bytes), Err(GgufError::UnknownValueType { id: found, .. }) if found == id));
    }
}

#[test]
fn absurd_array_lengths() {
    let array = |element_type: ValueType, count: u64| {
        Raw::header(3, 0, 1)
            .string(b"arr")
            .u32(ValueType::Array.id())
            .u32(element_type.id())
            .u64(count)
            .bytes(&[0; 64])
            .0
    };
    assert!(matches!(parse(&array(ValueType::U8, u64::MAX)), Err(GgufError::TooMany { what: "array elements", .. })));
    assert!(matches!(parse(&array(ValueType::String, 1 << 25)), Err(GgufError::TooMany { .. })));
    assert!(matches!(parse(&array(ValueType::U8, 65)), Err(GgufError::Truncated { .. })));
    assert!(matches!(parse(&array(ValueType::U64, 9)), Err(GgufError::Truncated { .. })));
    assert!(matches!(parse(&array(ValueType::String, 9)), Err(GgufError::Truncated { .. })));
    assert!(matches!(parse(&array(ValueType::Array, 6)), Err(GgufError::Truncated { .. })));
    // 64 zero bytes are 8 empty strings or 64 zero bytes: both fit exactly.
    assert!(parse(&array(ValueType::String, 8)).is_ok());
    assert!(parse(&array(ValueType::U8, 64)).is_ok());
}

#[test]
fn total_array_elements_are_capped() {
    // Many arrays that each pass the per-array cap still hit the per-file budget.
    let count = 1u64 << 23;
    let mut raw = Raw::header(3, 0, 5);
    for index in 0..5u8 {
        raw = raw.string(&[b'k', b'0' + index]).u32(ValueType::Array.id()).u32(ValueType::U8.id()).u64(count);
        raw = raw.bytes(&vec![0; count as usize]);
    }
    assert!(matches!(parse(&raw.0), Err(GgufError::TooMany { what: "array elements in the file", .. })));
}

#[test]
fn nested_array_depth_is_limited() {
    let nested = |depth: u32| {
        let mut raw = Raw::header(3, 0, 1).string(b"deep").u32(ValueType::Array.id());
        for _ in 1..depth {
            raw = raw.u32(ValueType::Array.id()).u64(1);
        }
        raw.u32(ValueType::U8.id()).u64(1).bytes(&[7]).0
    };
    let gguf = parse(&nested(8)).unwrap();
    let mut value = gguf.get("deep").unwrap();
    for _ in 1..8 {
        value = &value.as_array().unwrap()[0];
    }
    assert_eq!(value, &Value::Array(ValueType::U8, vec![Value::U8(7)]));
    assert!(matches!(parse(&nested(9)), Err(GgufError::ArrayTooDeep { depth: 9, max: 8, .. })));
    assert!(matches!(parse(&nested(100_000)), Err(GgufError::ArrayTooDeep { .. })));
}

#[test]
fn non_utf8_text() {
    let bytes = Raw::header(3, 0, 1).key_u32(b"bad\xff", 1).0;
    assert!(matches!(parse(&bytes), Err(GgufError::InvalidUtf8 { context }) if context.contains("metadata key 0")));
    let bytes = Raw::header(3, 0, 1).string(b"k").u32(ValueType::String.id()).string(b"\xc3\x28").0;
    assert!(matches!(parse(&bytes), Err(GgufError::InvalidUtf8 { context }) if context.contains("'k'")));
    let bytes = Raw::header(3, 1, 0).tensor(b"\xfe", &[8], 0, 0).data(32, 32).0;
    assert!(matches!(parse(&bytes), Err(GgufError::InvalidUtf8 { context }) if context.contains("tensor 0")));
}

#[test]
fn empty_and_duplicate_keys() {
    let bytes = Raw::header(3, 0, 1).key_u32(b"", 1).0;
    assert!(matches!(parse(&bytes), Err(GgufError::EmptyKey { index: 0 })));
    let bytes = Raw::header(3, 0, 2).key_u32(b"a.b", 1).key_u32(b"a.b", 2).0;
    assert!(matches!(parse(&bytes), Err(GgufError::DuplicateKey { key }) if key == "a.b"));
}

#[test]
fn bad_alignment() {
    for alignment in [0, 3, 48, 0x8000_0001] {
        let bytes = Raw::header(3, 0, 1).key_u32(b"general.alignment", alignment).0;
        assert!(
            matches!(parse(&bytes), Err(GgufError::BadAlignment { alignment: found }) if found == u64::from(alignment)),
            "{alignment}"
        );
    }
    let bytes = Raw::header(3, 0, 1).string(b"general.alignment").u32(ValueType::U64.id()).u64(32).0;
    assert!(matches!(
        parse(&bytes),
        Err(GgufError::WrongKeyType { expected: ValueType::U32, found: ValueType::U64, .. })
    ));
    let bytes = Raw::header(3, 1, 1).key_u32(b"general.alignment", 64).tensor(b"t", &[8], 0, 0).data(64, 32).0;
    assert_eq!(parse(&bytes).unwrap().data_offset % 64, 0);
}

#[test]
fn unknown_ggml_types() {
    for id in [4, 5, 31, 36, 43, u32::MAX] {
        assert!(
            matches!(parse(&one_tensor(&[32], id, 0)), Err(GgufError::UnknownGgmlType { tensor, id: found }) if tensor == "t" && found == id),
            "{id}"
        );
    }
}

#[test]
fn bad_dimension_counts() {
    for dim_count in [0u32, 5, u32::MAX] {
        let bytes = Raw::header(3, 1, 0).string(b"t").u32(dim_count).bytes(&[1; 64]).0;
        assert!(matches!(parse(&bytes), Err(GgufError::BadDims { tensor, .. }) if tensor == "t"), "{dim_count}");
    }
}

#[test]
fn bad_dimensions() {
    let f32_id = GgmlType::F32.id();
    let cases: [(&[u64], u32); 7] = [
        (&[0], f32_id),
        (&[8, 0], f32_id),
        (&[1 << 32, 1 << 32], f32_id),       // elements overflow u64
        (&[1 << 62, 2], f32_id),             // elements exceed i64::MAX
        (&[1 << 61, 2], GgmlType::F64.id()), // elements fit, bytes overflow u64
        (&[100], GgmlType::Q4_K.id()),       // row not a whole number of blocks
        (&[u64::MAX], f32_id),
    ];
    for (dims, type_id) in cases {
        let result = parse(&one_tensor(dims, type_id, 0));
        assert!(
            matches!(&result, Err(GgufError::BadDims { tensor, dims: found, .. }) if tensor == "t" && found == dims),
            "{dims:?}: {result:?}"
        );
    }
}

#[test]
fn tensor_name_too_long() {
    let bytes = Raw::header(3, 1, 0).tensor(&[b'n'; 64], &[8], 0, 0).data(32, 32).0;
    assert!(matches!(parse(&bytes), Err(GgufError::TensorNameTooLong { length: 64, max: 63, .. })));
    let bytes = Raw::header(3, 1, 0).tensor(&[b'n'; 63], &[8], 0, 0).data(32, 32).0;
    assert!(parse(&bytes).is_ok());
}

#[test]
fn duplicate_tensor_names() {
    let bytes = Raw::header(3, 2, 0).tensor(b"t", &[8], 0, 0).tensor(b"t", &[8], 0, 32).data(32, 64).0;
    assert!(matches!(parse(&bytes), Err(GgufError::DuplicateTensor { name }) if name == "t"));
}

#[test]
fn misaligned_offsets() {
    for offset in [1, 16, 31, 33] {
        assert!(
            matches!(parse(&one_tensor(&[8], 0, offset)), Err(GgufError::Misaligned { offset: found, alignment: 32, .. }) if found == offset),
            "{offset}"
        );
    }
}

#[test]
fn tensors_past_the_end() {
    // 64 data bytes: a 16-float tensor at 32 ends at 96.
    let error = parse(&one_tensor(&[16], 0, 32)).unwrap_err();
    assert!(matches!(error, GgufError::OutOfBounds { ref tensor, .. } if tensor == "t"), "{error}");
    assert!(matches!(parse(&one_tensor(&[8], 0, 1 << 40)), Err(GgufError::OutOfBounds { .. })));
    assert!(matches!(parse(&one_tensor(&[8], 0, !31)), Err(GgufError::OutOfBounds { .. })));
    assert!(matches!(parse(&one_tensor(&[17], 0, 0)), Err(GgufError::OutOfBounds { .. })));
    assert!(parse(&one_tensor(&[16], 0, 0)).is_ok());
    // A data section that does not even start inside the file.
    let bytes = Raw::header(3, 1, 0).tensor(b"t", &[8], 0, 0).0;
    assert!(matches!(parse(&bytes), Err(GgufError::Truncated { .. })));
}

#[test]
fn overlapping_tensors() {
    // Listed out of offset order so the check has to sort.
    let bytes = Raw::header(3, 3, 0)
        .tensor(b"late", &[8], 0, 64)
        .tensor(b"big", &[16], 0, 0)
        .tensor(b"inside", &[8], 0, 32)
        .data(32, 128)
        .0;
    let error = parse(&bytes).unwrap_err();
    assert!(
        matches!(&error, GgufError::Overlap { a, a_end: 64, b, b_offset: 32 } if a == "big" && b == "inside"),
        "{error:?}"
    );
    let bytes = Raw::header(3, 2, 0).tensor(b"x", &[8], 0, 0).tensor(b"y", &[8], 0, 0).data(32, 64).0;
    assert!(matches!(parse(&bytes), Err(GgufError::Overlap { .. })));
    // Gaps between tensors are allowed.
    let bytes = Raw::header(3, 2, 0).tensor(b"x", &[8], 0, 0).tensor(b"y", &[8], 0, 64).data(32, 96).0;
    assert!(parse(&bytes).is_ok());
}

#[test]
fn error_messages_name_the_thing_and_the_number() {
    let message = parse(&one_tensor(&[8], 0, 33)).unwrap_err().to_string();
    assert!(message.contains("'t'") && message.contains("33") && message.contains("32"), "{message}");
    assert!(!message.contains('\n'));
    let message = parse(b"GGML\x03\0\0\0").unwrap_err().to_string();
    assert!(message.contains("\"GGML\""), "{message}");
    let message = parse(&Raw::header(99, 0, 0).0).unwrap_err().to_string();
    assert!(message.contains("99"), "{message}");
    let message = parse(&one_tensor(&[8], 77, 0)).unwrap_err().to_string();
    assert!(message.contains("'t'") && message.contains("77"), "{message}");
}

#[test]
fn open_reports_missing_files_as_io() {
    let error = Gguf::open(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(&error, GgufError::Io { path, .. } if path == Path::new("/nonexistent/model.gguf")));
    assert!(error.to_string().contains("/nonexistent/model.gguf"));
}

/// Committed inputs (e.g. fuzzer finds). `<Variant>__<description>.bin` must fail with that
/// variant; `ok__<description>.bin` must parse.
#[test]
fn committed_corpus() {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut checked = 0;
    for entry in std::fs::read_dir(&directory).unwrap() {
        let path = entry.unwrap().path();
        let Some(file_name) = path.file_name().and_then(|name| name.to_str()) else {
            continue;
        };
        let Some((expected, _)) = file_name.split_once("__") else {
            continue;
        };
        let bytes = std::fs::read(&path).unwrap();
        match (expected, parse(&bytes)) {
            ("ok", Ok(_)) => {}
            ("ok", Err(error)) => panic!("{file_name}: {error}"),
            (_, Ok(_)) => panic!("{file_name} parsed"),
            (_, Err(error)) => assert_eq!(variant(&error), expected, "{file_name}: {error}"),
        }
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} corpus files");
}
