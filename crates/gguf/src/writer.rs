//! Layout computation and header serialization for new GGUF files.
//!
//! The writer never holds tensor data: converters produce tensors of many gigabytes, often in
//! parallel, so it only decides where each tensor goes and produces the header bytes. The
//! caller writes each tensor at its absolute offset (e.g. with `pwrite` from several threads).

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::GgufError;
use crate::reader::{
    align_up, checked_tensor_bytes, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_ARRAY_ELEMENTS,
    MAX_STRING_BYTES, MAX_TENSOR_NAME_BYTES,
};
use crate::types::{GgmlType, Value, ValueType};
use crate::Result;

/// Version written by [`GgufWriter`].
pub const WRITE_VERSION: u32 = 3;

/// A GGUF file to be written: metadata and tensor shapes, no data.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    /// 0 means the default of 32.
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorSpec>,
}

/// Name, shape and type of a tensor to be written.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    /// ne0 first, as in ggml.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
}

/// Where everything goes in the file described by a [`GgufWriter`].
#[derive(Clone, Debug)]
pub struct Layout {
    /// Header, metadata, tensor index and zero padding up to `data_offset`.
    pub header: Vec<u8>,
    pub data_offset: u64,
    /// Absolute file offset of each tensor, in `tensors` order.
    pub tensor_offsets: Vec<u64>,
    /// Data size of each tensor, without padding.
    pub tensor_bytes: Vec<u64>,
    /// Total file size; the last tensor is padded to the alignment, as llama.cpp writes it.
    pub file_bytes: u64,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn add_metadata(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    pub fn add_tensor(&mut self, name: impl Into<String>, dims: &[u64], ggml_type: GgmlType) -> &mut Self {
        self.tensors.push(TensorSpec { name: name.into(), dims: dims.to_vec(), ggml_type });
        self
    }

    fn effective_alignment(&self) -> Result<u64> {
        let alignment = if self.alignment == 0 { DEFAULT_ALIGNMENT } else { self.alignment };
        if !alignment.is_power_of_two() || alignment > u64::from(u32::MAX) {
            return Err(GgufError::BadAlignment { alignment });
        }
        Ok(alignment)
    }

    /// Validates everything a reader would check and computes the layout of a version 3 file.
    /// Tensors are placed in order, each at the next multiple of the alignment, which is the
    /// layout llama.cpp requires. `general.alignment` is written when the alignment is not 32;
    /// if the metadata already holds it, it must be a u32 equal to the alignment.
    pub fn layout(&self) -> Result<Layout> {
        let alignment = self.effective_alignment()?;

        let mut keys = HashSet::new();
        let mut has_alignment_key = false;
        for (key, value) in &self.metadata {
            if key.is_empty() {
                return Err(GgufError::EmptyKey { index: keys.len() as u64 });
            }
            if !keys.insert(key.as_str()) {
                return Err(GgufError::DuplicateKey { key: key.clone() });
            }
            if key == ALIGNMENT_KEY {
                match value {
                    Value::U32(written) if u64::from(*written) == alignment => has_alignment_key = true,
                    Value::U32(written) => {
                        return Err(GgufError::BadValue {
                            key: key.clone(),
                            reason: format!("{written} differs from the writer's alignment {alignment}"),
                        })
                    }
                    other => {
                        return Err(GgufError::WrongKeyType {
                            key: key.clone(),
                            expected: ValueType::U32,
                            found: other.value_type(),
                        })
                    }
                }
            }
            check_value(key, value, 0)?;
        }
        let extra_alignment_key = alignment != DEFAULT_ALIGNMENT && !has_alignment_key;

        let mut names = HashSet::new();
        let mut tensor_bytes = Vec::with_capacity(self.tensors.len());
        for tensor in &self.tensors {
            if tensor.name.len() as u64 > MAX_TENSOR_NAME_BYTES {
                return Err(GgufError::TensorNameTooLong {
                    name: tensor.name.clone(),
                    length: tensor.name.len() as u64,
                    max: MAX_TENSOR_NAME_BYTES,
                });
            }
            if !names.insert(tensor.name.as_str()) {
                return Err(GgufError::DuplicateTensor { name: tensor.name.clone() });
            }
            tensor_bytes.push(checked_tensor_bytes(&tensor.name, &tensor.dims, tensor.ggml_type)?);
        }

        let mut relative_offsets = Vec::with_capacity(self.tensors.len());
        let mut data_bytes: u64 = 0;
        for (tensor, &bytes) in self.tensors.iter().zip(&tensor_bytes) {
            relative_offsets.push(data_bytes);
            data_bytes = data_bytes.checked_add(bytes).and_then(|end| align_up(end, alignment)).ok_or_else(|| {
                GgufError::BadDims {
                    tensor: tensor.name.clone(),
                    dims: tensor.dims.clone(),
                    reason: "data section size overflows u64".to_string(),
                }
            })?;
        }

        let mut header = Vec::new();
        header.extend_from_slice(&GGUF_MAGIC);
        header.extend_from_slice(&WRITE_VERSION.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        let key_count = self.metadata.len() + usize::from(extra_alignment_key);
        header.extend_from_slice(&(key_count as u64).to_le_bytes());
        if extra_alignment_key {
            encode_string(&mut header, ALIGNMENT_KEY);
            encode_value_with_type(&mut header, &Value::U32(alignment as u32));
        }
        for (key, value) in &self.metadata {
            encode_string(&mut header, key);
            encode_value_with_type(&mut header, value);
        }
        for (tensor, &offset) in self.tensors.iter().zip(&relative_offsets) {
            encode_string(&mut header, &tensor.name);
            header.extend_from_slice(&(tensor.dims.len() as u32).to_le_bytes());
            for dim in &tensor.dims {
                header.extend_from_slice(&dim.to_le_bytes());
            }
            header.extend_from_slice(&tensor.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
        }
        // Padding is written even without tensors, as llama.cpp's writer does.
        let data_offset = align_up(header.len() as u64, alignment).expect("header length is far below u64::MAX");
        header.resize(data_offset as usize, 0);

        let overflow = || GgufError::BadDims {
            tensor: String::new(),
            dims: Vec::new(),
            reason: "file size overflows u64".to_string(),
        };
        let file_bytes = data_offset.checked_add(data_bytes).ok_or_else(overflow)?;
        let tensor_offsets = relative_offsets
            .iter()
            .map(|&offset| data_offset.checked_add(offset).ok_or_else(overflow))
            .collect::<Result<Vec<u64>>>()?;
        Ok(Layout { header, data_offset, tensor_offsets, tensor_bytes, file_bytes })
    }

    /// Writes the whole file; `data(i)` returns tensor `i`'s bytes, which must be exactly
    /// `tensor_bytes[i]` long. Meant for tests and small files: it holds one tensor at a time.
    pub fn write_file(&self, path: &Path, mut data: impl FnMut(usize) -> Vec<u8>) -> Result<Layout> {
        let layout = self.layout()?;
        let io_error = |source| GgufError::Io { path: path.to_path_buf(), source };
        let mut file = BufWriter::new(File::create(path).map_err(io_error)?);
        file.write_all(&layout.header).map_err(io_error)?;
        let mut position = layout.data_offset;
        let zeros = [0u8; 4096];
        for (index, tensor) in self.tensors.iter().enumerate() {
            let bytes = data(index);
            if bytes.len() as u64 != layout.tensor_bytes[index] {
                return Err(GgufError::DataLength {
                    tensor: tensor.name.clone(),
                    expected: layout.tensor_bytes[index],
                    actual: bytes.len() as u64,
                });
            }
            let mut padding = layout.tensor_offsets[index] - position;
            while padding > 0 {
                let chunk = padding.min(zeros.len() as u64);
                file.write_all(&zeros[..chunk as usize]).map_err(io_error)?;
                padding -= chunk;
            }
            file.write_all(&bytes).map_err(io_error)?;
            position = layout.tensor_offsets[index] + layout.tensor_bytes[index];
        }
        let mut padding = layout.file_bytes - position;
        while padding > 0 {
            let chunk = padding.min(zeros.len() as u64);
            file.write_all(&zeros[..chunk as usize]).map_err(io_error)?;
            padding -= chunk;
        }
        file.flush().map_err(io_error)?;
        Ok(layout)
    }
}

/// Rejects values a reader would reject or could not represent.
fn check_value(key: &str, value: &Value, depth: u32) -> Result<()> {
    if let Value::String(text) = value {
        if text.len() as u64 > MAX_STRING_BYTES {
            return Err(GgufError::StringTooLong {
                context: format!("value of key '{key}'"),
                length: text.len() as u64,
                max: MAX_STRING_BYTES,
            });
        }
    }
    if let Value::Array(element_type, elements) = value {
        if elements.len() as u64 > MAX_ARRAY_ELEMENTS {
            return Err(GgufError::TooMany {
                what: "array elements",
                count: elements.len() as u64,
                max: MAX_ARRAY_ELEMENTS,
            });
        }
        let depth = depth + 1;
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::ArrayTooDeep { key: key.to_string(), depth, max: MAX_ARRAY_DEPTH });
        }
        for element in elements {
            if element.value_type() != *element_type {
                return Err(GgufError::BadValue {
                    key: key.to_string(),
                    reason: format!(
                        "array declared with element type {element_type:?} holds a {:?}",
                        element.value_type()
                    ),
                });
            }
            check_value(key, element, depth)?;
        }
    }
    Ok(())
}

fn encode_string(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

fn encode_value_with_type(out: &mut Vec<u8>, value: &Value) {
    out.extend_from_slice(&value.value_type().id().to_le_bytes());
    encode_value(out, value);
}

fn encode_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(value) => out.push(*value),
        Value::I8(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::U16(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::I16(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::U32(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::I32(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::F32(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::Bool(value) => out.push(u8::from(*value)),
        Value::String(value) => encode_string(out, value),
        Value::Array(element_type, elements) => {
            out.extend_from_slice(&element_type.id().to_le_bytes());
            out.extend_from_slice(&(elements.len() as u64).to_le_bytes());
            for element in elements {
                // Each inner array carries its own element type and length.
                encode_value(out, element);
            }
        }
        Value::U64(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::I64(value) => out.extend_from_slice(&value.to_le_bytes()),
        Value::F64(value) => out.extend_from_slice(&value.to_le_bytes()),
    }
}
