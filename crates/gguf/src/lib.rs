//! Pure-Rust reading and writing of GGUF (versions 2 and 3) file indexes.
//!
//! This crate's job is the GGUF container only: it parses the header, the metadata key/value
//! pairs and the tensor index, validating them as strictly as llama.cpp does (and checking
//! tensor bounds and overlaps up front), and it computes the layout and header bytes of new
//! files. It does not link ggml and never reads or holds tensor data: callers get absolute
//! file offsets and sizes and do their own I/O. It sits at the bottom of Hypura's dependency
//! graph (gguf <- model <- plan), so it depends on nothing but `thiserror`.
//!
//! Input is treated as hostile: counts, lengths, type ids, dimensions and offsets are all
//! checked against hard caps and against the bytes left in the file before anything is
//! allocated, and every failure is a typed [`GgufError`]. The caps are the `MAX_*` constants.
//!
//! Where this reader differs from llama.cpp's `gguf_init_from_file`: it is stricter about
//! shapes (1 to 4 dimensions, none zero), and looser about layout (tensors may appear in any
//! order with gaps between them, as long as they are aligned, inside the file and disjoint,
//! while llama.cpp wants them packed in index order) and about nested arrays (accepted up to
//! [`MAX_ARRAY_DEPTH`]; llama.cpp rejects them). [`GgufWriter`] always produces the packed
//! layout llama.cpp expects.

// `u64::is_multiple_of` needs Rust 1.87, newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

pub mod error;
mod reader;
mod split;
mod types;
mod writer;

pub use error::GgufError;
pub use reader::{
    Gguf, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_ARRAY_ELEMENTS, MAX_DIMS,
    MAX_KEYS, MAX_STRING_BYTES, MAX_TENSORS, MAX_TENSOR_NAME_BYTES, MAX_TOTAL_ARRAY_ELEMENTS,
};
pub use split::{
    split_file_name, ModelFiles, SplitFile, TensorRef, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY,
};
pub use types::{GgmlType, Value, ValueType};
pub use writer::{GgufWriter, Layout, TensorSpec, WRITE_VERSION};

pub type Result<T> = std::result::Result<T, GgufError>;
