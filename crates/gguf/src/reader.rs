//! Sequential, bounds-checked parsing of the GGUF header and tensor index.
//!
//! The reader treats the file as hostile: every count and length is checked against both a
//! hard cap and the bytes left in the file before anything is allocated, so a corrupt or
//! malicious header costs at most a few allocations proportional to the file itself.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use crate::error::GgufError;
use crate::types::{GgmlType, Value, ValueType};
use crate::Result;

/// `"GGUF"` as it appears at the start of the file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment used when `general.alignment` is absent (`GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The key that overrides the alignment; must be a u32 power of two.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Cap on the tensor count and on the key/value count. Real models have a few thousand
/// tensors and well under a thousand keys; 2^24 keeps bookkeeping bounded whatever the header says.
pub const MAX_TENSORS: u64 = 1 << 24;
/// See [`MAX_TENSORS`].
pub const MAX_KEYS: u64 = 1 << 24;
/// Longest string accepted (`GGUF_MAX_STRING_LENGTH` in llama.cpp).
pub const MAX_STRING_BYTES: u64 = 1 << 30;
/// Most elements in one array. The largest real arrays are tokenizer vocabularies and merge
/// lists (a few hundred thousand to a few million entries).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;
/// Most array elements in the whole file. A one-byte element becomes a 32-byte [`Value`] in
/// memory, so this bounds the in-memory blow-up of a file that is mostly tiny array elements
/// (about 1 GiB at worst).
pub const MAX_TOTAL_ARRAY_ELEMENTS: u64 = 1 << 25;
/// Deepest nesting of arrays inside arrays (1 is a plain array). llama.cpp itself rejects any
/// nesting; the GGUF spec allows it, so it is accepted up to this depth.
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Tensor names must be shorter than ggml's `GGML_MAX_NAME` (64) so llama.cpp can load them.
pub const MAX_TENSOR_NAME_BYTES: u64 = 63;
/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;

/// One entry of the tensor index.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ne0 first, as in ggml.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Relative to the data section.
    pub offset: u64,
    /// Size of the tensor's data, without alignment padding.
    pub bytes: u64,
}

/// The parsed header and tensor index of one GGUF file.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    /// In file order.
    pub metadata: Vec<(String, Value)>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub file_bytes: u64,
    // Built at parse time. `get` and `tensor` go through these, so code that edits the public
    // vectors must call `reindex`.
    key_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl Gguf {
    /// Reads the header and tensor index of the file at `path`; tensor data is never read.
    pub fn open(path: &Path) -> Result<Gguf> {
        let io_error = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io_error)?;
        let file_bytes = file.metadata().map_err(io_error)?.len();
        Parser::new(file, file_bytes, path.to_path_buf()).parse()
    }

    /// Parses a GGUF stream whose total length is `file_bytes`. The reader is buffered
    /// internally and read sequentially up to the end of the tensor index.
    pub fn parse<R: Read>(reader: R, file_bytes: u64) -> Result<Gguf> {
        Parser::new(reader, file_bytes, PathBuf::from("<stream>")).parse()
    }

    /// `parse`, with errors naming the stream `name` (a URL, say).
    pub fn parse_named<R: Read>(reader: R, file_bytes: u64, name: &Path) -> Result<Gguf> {
        Parser::new(reader, file_bytes, name.to_path_buf()).parse()
    }

    fn from_parts(
        version: u32,
        metadata: Vec<(String, Value)>,
        tensors: Vec<TensorInfo>,
        alignment: u64,
        data_offset: u64,
        file_bytes: u64,
    ) -> Gguf {
        let mut gguf = Gguf {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            file_bytes,
            key_index: HashMap::new(),
            tensor_index: HashMap::new(),
        };
        gguf.reindex();
        gguf
    }

    /// Rebuilds the lookup indexes after `metadata` or `tensors` were edited. With duplicate
    /// names (impossible in parsed files) the first occurrence wins.
    pub fn reindex(&mut self) {
        self.key_index.clear();
        for (position, (key, _)) in self.metadata.iter().enumerate() {
            self.key_index.entry(key.clone()).or_insert(position);
        }
        self.tensor_index.clear();
        for (position, tensor) in self.tensors.iter().enumerate() {
            self.tensor_index.entry(tensor.name.clone()).or_insert(position);
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        let position = *self.key_index.get(key)?;
        self.metadata.get(position).map(|(_, value)| value)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    /// `general.architecture`, the prefix of the model's hyperparameter keys.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let position = *self.tensor_index.get(name)?;
        self.tensors.get(position)
    }

    /// Sum of the tensors' data sizes, without padding.
    pub fn tensor_data_bytes(&self) -> u64 {
        // Cannot overflow for a parsed file (the tensors fit in the file without overlapping),
        // but the fields are public, so saturate rather than trust them.
        self.tensors.iter().fold(0u64, |sum, tensor| sum.saturating_add(tensor.bytes))
    }
}

/// Rounds `value` up to a multiple of the power of two `alignment`.
pub(crate) fn align_up(value: u64, alignment: u64) -> Option<u64> {
    Some(value.checked_add(alignment - 1)? & !(alignment - 1))
}

struct Parser<R> {
    reader: BufReader<R>,
    position: u64,
    file_bytes: u64,
    path: PathBuf,
    array_elements_read: u64,
}

impl<R: Read> Parser<R> {
    fn new(reader: R, file_bytes: u64, path: PathBuf) -> Self {
        Parser {
            reader: BufReader::with_capacity(64 * 1024, reader),
            position: 0,
            file_bytes,
            path,
            array_elements_read: 0,
        }
    }

    fn remaining(&self) -> u64 {
        self.file_bytes.saturating_sub(self.position)
    }

    fn truncated(&self, needed: u64, context: &dyn Fn() -> String) -> GgufError {
        GgufError::Truncated { at: self.position, needed, context: context() }
    }

    fn need(&self, needed: u64, context: &dyn Fn() -> String) -> Result<()> {
        if needed > self.remaining() {
            return Err(self.truncated(needed, context));
        }
        Ok(())
    }

    fn fill(&mut self, buffer: &mut [u8], context: &dyn Fn() -> String) -> Result<()> {
        let needed = buffer.len() as u64;
        self.need(needed, context)?;
        match self.reader.read_exact(buffer) {
            Ok(()) => {
                self.position += needed;
                Ok(())
            }
            // The stream was shorter than `file_bytes` claimed.
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => Err(self.truncated(needed, context)),
            Err(source) => Err(GgufError::Io { path: self.path.clone(), source }),
        }
    }

    fn array<const N: usize>(&mut self, context: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut buffer = [0u8; N];
        self.fill(&mut buffer, context)?;
        Ok(buffer)
    }

    fn u32(&mut self, context: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(context)?))
    }

    fn u64(&mut self, context: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(context)?))
    }

    fn string(&mut self, context: &dyn Fn() -> String) -> Result<String> {
        let length = self.u64(context)?;
        if length > MAX_STRING_BYTES {
            return Err(GgufError::StringTooLong { context: context(), length, max: MAX_STRING_BYTES });
        }
        // Checked before allocating: `length` is bounded by what the file can still hold.
        self.need(length, context)?;
        let mut bytes = vec![0u8; length as usize];
        self.fill(&mut bytes, context)?;
        String::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 { context: context() })
    }

    fn parse(mut self) -> Result<Gguf> {
        let magic: [u8; 4] = self.array(&|| "magic".to_string())?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = self.u32(&|| "version".to_string())?;
        if version == 0 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // A big-endian v2/v3 file reads as 0x02000000/0x03000000 here (llama.cpp's heuristic).
        if version & 0xFFFF == 0 {
            return Err(GgufError::BigEndian { version });
        }
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = self.u64(&|| "tensor count".to_string())?;
        let key_count = self.u64(&|| "metadata key count".to_string())?;
        // A key takes at least 8 (length) + 1 (non-empty) + 4 (type) + 1 (value) bytes and a
        // tensor entry at least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8
        // (offset), so neither count can exceed what the remaining bytes could hold.
        // Counts over the hard caps are absurd; counts under them that the file cannot hold
        // mean the file was cut short.
        check_count("metadata keys", key_count, MAX_KEYS)?;
        check_count("tensors", tensor_count, MAX_TENSORS)?;
        let both = key_count * 14 + tensor_count * 32;
        if both > self.remaining() {
            return Err(self.truncated(both, &|| {
                format!("{key_count} metadata keys and {tensor_count} tensor entries (at least 14 and 32 bytes each)")
            }));
        }

        let metadata = self.metadata(key_count)?;
        let alignment = match metadata.iter().find(|(key, _)| key == ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(alignment))) => {
                let alignment = u64::from(*alignment);
                if !alignment.is_power_of_two() {
                    return Err(GgufError::BadAlignment { alignment });
                }
                alignment
            }
            Some((key, value)) => {
                return Err(GgufError::WrongKeyType {
                    key: key.clone(),
                    expected: ValueType::U32,
                    found: value.value_type(),
                })
            }
        };

        let tensors = self.tensor_index(tensor_count)?;

        let header_end = self.position;
        let padded_end = align_up(header_end, alignment).filter(|&end| end <= self.file_bytes);
        let data_offset = if tensors.is_empty() {
            // Without tensors llama.cpp does not require the padding to be present.
            padded_end.unwrap_or(header_end)
        } else {
            let data_offset = padded_end.ok_or_else(|| GgufError::Truncated {
                at: header_end,
                needed: alignment - header_end % alignment,
                context: "padding before the data section".to_string(),
            })?;
            check_layout(&tensors, alignment, data_offset, self.file_bytes)?;
            data_offset
        };

        Ok(Gguf::from_parts(version, metadata, tensors, alignment, data_offset, self.file_bytes))
    }

    fn metadata(&mut self, key_count: u64) -> Result<Vec<(String, Value)>> {
        // Capacity is capped: the count was only checked against the file size, and a vector
        // sized by it up front could still be far larger than the keys actually present.
        let mut metadata = Vec::with_capacity(key_count.min(1024) as usize);
        let mut seen = std::collections::HashSet::new();
        for index in 0..key_count {
            let key = self.string(&|| format!("metadata key {index}"))?;
            if key.is_empty() {
                return Err(GgufError::EmptyKey { index });
            }
            if !seen.insert(key.clone()) {
                return Err(GgufError::DuplicateKey { key });
            }
            let type_id = self.u32(&|| format!("type of key '{key}'"))?;
            let value_type =
                ValueType::from_id(type_id).ok_or(GgufError::UnknownValueType { key: key.clone(), id: type_id })?;
            let value = self.value(&key, value_type, 0)?;
            metadata.push((key, value));
        }
        Ok(metadata)
    }

    fn value(&mut self, key: &str, value_type: ValueType, depth: u32) -> Result<Value> {
        let context = || format!("value of key '{key}'");
        Ok(match value_type {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(&context)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(&context)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&context)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&context)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&context)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&context)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&context)?)),
            // Any nonzero byte is true, as in llama.cpp.
            ValueType::Bool => Value::Bool(self.array::<1>(&context)?[0] != 0),
            ValueType::String => Value::String(self.string(&context)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&context)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&context)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&context)?)),
            ValueType::Array => self.array_value(key, depth + 1)?,
        })
    }

    fn array_value(&mut self, key: &str, depth: u32) -> Result<Value> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::ArrayTooDeep { key: key.to_string(), depth, max: MAX_ARRAY_DEPTH });
        }
        let type_id = self.u32(&|| format!("array element type of key '{key}'"))?;
        let element_type =
            ValueType::from_id(type_id).ok_or(GgufError::UnknownValueType { key: key.to_string(), id: type_id })?;
        let count = self.u64(&|| format!("array length of key '{key}'"))?;
        if count > MAX_ARRAY_ELEMENTS {
            return Err(GgufError::TooMany { what: "array elements", count, max: MAX_ARRAY_ELEMENTS });
        }
        let total = self.array_elements_read.saturating_add(count);
        if total > MAX_TOTAL_ARRAY_ELEMENTS {
            return Err(GgufError::TooMany {
                what: "array elements in the file",
                count: total,
                max: MAX_TOTAL_ARRAY_ELEMENTS,
            });
        }
        self.array_elements_read = total;
        let minimum_bytes = count * element_type.min_encoded_size();
        self.need(minimum_bytes, &|| format!("{count} array elements of key '{key}'"))?;

        let mut values = Vec::with_capacity(count as usize);
        if let Some(element_bytes) = element_type.fixed_size() {
            // Fixed-size elements are read in one go; `minimum_bytes` is exact here and was
            // checked against the remaining file bytes above.
            let mut bytes = vec![0u8; minimum_bytes as usize];
            self.fill(&mut bytes, &|| format!("array of key '{key}'"))?;
            for chunk in bytes.chunks_exact(element_bytes as usize) {
                values.push(decode_fixed(element_type, chunk));
            }
        } else {
            for _ in 0..count {
                values.push(self.value(key, element_type, depth)?);
            }
        }
        Ok(Value::Array(element_type, values))
    }

    fn tensor_index(&mut self, tensor_count: u64) -> Result<Vec<TensorInfo>> {
        let mut tensors = Vec::with_capacity(tensor_count.min(1024) as usize);
        let mut seen = std::collections::HashSet::new();
        for index in 0..tensor_count {
            let name = self.string(&|| format!("name of tensor {index}"))?;
            if name.len() as u64 > MAX_TENSOR_NAME_BYTES {
                return Err(GgufError::TensorNameTooLong {
                    length: name.len() as u64,
                    name,
                    max: MAX_TENSOR_NAME_BYTES,
                });
            }
            if !seen.insert(name.clone()) {
                return Err(GgufError::DuplicateTensor { name });
            }
            let dim_count = self.u32(&|| format!("dimension count of tensor '{name}'"))?;
            if dim_count == 0 || dim_count > MAX_DIMS {
                return Err(GgufError::BadDims {
                    tensor: name,
                    dims: Vec::new(),
                    reason: format!("{dim_count} dimensions, expected 1 to {MAX_DIMS}"),
                });
            }
            let mut dims = Vec::with_capacity(dim_count as usize);
            for axis in 0..dim_count {
                dims.push(self.u64(&|| format!("dimension {axis} of tensor '{name}'"))?);
            }
            let type_id = self.u32(&|| format!("type of tensor '{name}'"))?;
            let ggml_type =
                GgmlType::from_id(type_id).ok_or(GgufError::UnknownGgmlType { tensor: name.clone(), id: type_id })?;
            let bytes = checked_tensor_bytes(&name, &dims, ggml_type)?;
            let offset = self.u64(&|| format!("offset of tensor '{name}'"))?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset, bytes });
        }
        Ok(tensors)
    }
}

fn check_count(what: &'static str, count: u64, max: u64) -> Result<()> {
    if count > max {
        return Err(GgufError::TooMany { what, count, max });
    }
    Ok(())
}

fn decode_fixed(value_type: ValueType, bytes: &[u8]) -> Value {
    let mut buffer = [0u8; 8];
    buffer[..bytes.len()].copy_from_slice(bytes);
    let [b0, b1, b2, b3, ..] = buffer;
    match value_type {
        ValueType::U8 => Value::U8(b0),
        ValueType::I8 => Value::I8(b0 as i8),
        ValueType::Bool => Value::Bool(b0 != 0),
        ValueType::U16 => Value::U16(u16::from_le_bytes([b0, b1])),
        ValueType::I16 => Value::I16(i16::from_le_bytes([b0, b1])),
        ValueType::U32 => Value::U32(u32::from_le_bytes([b0, b1, b2, b3])),
        ValueType::I32 => Value::I32(i32::from_le_bytes([b0, b1, b2, b3])),
        ValueType::F32 => Value::F32(f32::from_le_bytes([b0, b1, b2, b3])),
        ValueType::U64 => Value::U64(u64::from_le_bytes(buffer)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(buffer)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(buffer)),
        // Only called for fixed-size types.
        ValueType::String | ValueType::Array => Value::Array(value_type, Vec::new()),
    }
}

/// Validates a tensor's shape the way llama.cpp does (plus: no zero dims) and returns its size.
pub(crate) fn checked_tensor_bytes(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64> {
    let bad = |reason: String| GgufError::BadDims { tensor: name.to_string(), dims: dims.to_vec(), reason };
    if dims.is_empty() || dims.len() > MAX_DIMS as usize {
        return Err(bad(format!("{} dimensions, expected 1 to {MAX_DIMS}", dims.len())));
    }
    // ggml counts elements in int64_t.
    let mut elements: u64 = 1;
    for (axis, &dim) in dims.iter().enumerate() {
        if dim == 0 {
            return Err(bad(format!("dimension {axis} is zero")));
        }
        elements = elements
            .checked_mul(dim)
            .filter(|&elements| elements <= i64::MAX as u64)
            .ok_or_else(|| bad("element count overflows i64".to_string()))?;
    }
    if dims[0] % ggml_type.block_size() != 0 {
        return Err(bad(format!(
            "row of {} elements is not a multiple of the {} block size {}",
            dims[0],
            ggml_type.name(),
            ggml_type.block_size()
        )));
    }
    ggml_type.tensor_bytes(dims).ok_or_else(|| bad("size in bytes overflows u64".to_string()))
}

/// Checks that every tensor is aligned, inside the file, and disjoint from the others.
pub(crate) fn check_layout(tensors: &[TensorInfo], alignment: u64, data_offset: u64, file_bytes: u64) -> Result<()> {
    let data_bytes = file_bytes.saturating_sub(data_offset);
    for tensor in tensors {
        if tensor.offset % alignment != 0 {
            return Err(GgufError::Misaligned { tensor: tensor.name.clone(), offset: tensor.offset, alignment });
        }
        let end = tensor.offset.checked_add(tensor.bytes);
        if end.is_none_or(|end| end > data_bytes) {
            return Err(GgufError::OutOfBounds {
                tensor: tensor.name.clone(),
                end: data_offset.saturating_add(tensor.offset).saturating_add(tensor.bytes),
                file_bytes,
            });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|tensor| tensor.offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Both ends were checked above, so this cannot overflow.
        let a_end = a.offset + a.bytes;
        if b.offset < a_end {
            return Err(GgufError::Overlap { a: a.name.clone(), a_end, b: b.name.clone(), b_offset: b.offset });
        }
    }
    Ok(())
}
