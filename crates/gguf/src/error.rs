//! Typed errors. Every message is a single line naming the offending key, tensor or file and the
//! number that was wrong, because these errors usually end up in front of a user who only has the
//! message to go on.

use std::path::PathBuf;

use crate::types::ValueType;

/// Everything that can go wrong while reading, writing or assembling GGUF files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("not a GGUF file: it starts with \"{}\" instead of \"GGUF\"", found.escape_ascii())]
    BadMagic { found: [u8; 4] },

    #[error("unsupported GGUF version {0} (only versions 2 and 3 are supported)")]
    UnsupportedVersion(u32),

    #[error(
        "GGUF version field reads as {version:#010x}: the file looks big-endian, only little-endian GGUF is supported"
    )]
    BigEndian { version: u32 },

    #[error("file truncated at byte {at}: {context} needs {needed} more bytes")]
    Truncated { at: u64, needed: u64, context: String },

    #[error("too many {what}: {count} exceeds the limit of {max}")]
    TooMany { what: &'static str, count: u64, max: u64 },

    #[error("string length {length} for {context} exceeds the limit of {max}")]
    StringTooLong { context: String, length: u64, max: u64 },

    #[error("{context} is not valid UTF-8")]
    InvalidUtf8 { context: String },

    #[error("metadata key {index} is empty")]
    EmptyKey { index: u64 },

    #[error("key '{key}' has unknown value type {id}")]
    UnknownValueType { key: String, id: u32 },

    #[error("key '{key}' nests arrays {depth} deep, the limit is {max}")]
    ArrayTooDeep { key: String, depth: u32, max: u32 },

    #[error("duplicate metadata key '{key}'")]
    DuplicateKey { key: String },

    #[error("key '{key}' must have type {expected:?} but has type {found:?}")]
    WrongKeyType { key: String, expected: ValueType, found: ValueType },

    #[error("key '{key}' has an invalid value: {reason}")]
    BadValue { key: String, reason: String },

    #[error("alignment {alignment} is not a nonzero power of two that fits in u32")]
    BadAlignment { alignment: u64 },

    #[error("tensor name '{name}' is {length} bytes long, the limit is {max}")]
    TensorNameTooLong { name: String, length: u64, max: u64 },

    #[error("duplicate tensor name '{name}'")]
    DuplicateTensor { name: String },

    #[error("tensor '{tensor}' has unknown ggml type id {id}")]
    UnknownGgmlType { tensor: String, id: u32 },

    #[error("tensor '{tensor}' has bad dimensions {dims:?}: {reason}")]
    BadDims { tensor: String, dims: Vec<u64>, reason: String },

    #[error("tensor '{tensor}' has offset {offset}, which is not a multiple of the alignment {alignment}")]
    Misaligned { tensor: String, offset: u64, alignment: u64 },

    #[error("tensor '{tensor}' ends at byte {end}, past the end of the file ({file_bytes} bytes)")]
    OutOfBounds { tensor: String, end: u64, file_bytes: u64 },

    #[error("tensor '{b}' starts at data offset {b_offset}, inside tensor '{a}' which ends at data offset {a_end}")]
    Overlap { a: String, a_end: u64, b: String, b_offset: u64 },

    #[error("tensor '{tensor}': data callback returned {actual} bytes, expected {expected}")]
    DataLength { tensor: String, expected: u64, actual: u64 },

    #[error("{}: file name does not follow the split pattern '<prefix>-{:05}-of-{:05}.gguf'", path.display(), index + 1, count)]
    SplitName { path: PathBuf, index: u64, count: u64 },

    #[error("{}: split {index} of {count} is missing", path.display())]
    SplitMissing { path: PathBuf, index: u64, count: u64 },

    #[error("{}: key '{key}' is missing or not an integer", path.display())]
    SplitKey { path: PathBuf, key: &'static str },

    #[error("{}: split.no is {found}, expected {expected}", path.display())]
    SplitIndex { path: PathBuf, expected: u64, found: u64 },

    #[error("{}: split.count is {found}, expected {expected}", path.display())]
    SplitCount { path: PathBuf, expected: u64, found: u64 },

    #[error("{}: split.no is {index}; open the first split (split.no 0) instead", path.display())]
    NotFirstSplit { path: PathBuf, index: u64 },

    #[error("split.tensors.count is {expected} but the splits hold {found} tensors")]
    SplitTensorCount { expected: u64, found: u64 },

    #[error("tensor '{name}' appears in split {first} and again in split {second}")]
    DuplicateTensorAcrossSplits { name: String, first: usize, second: usize },
}
