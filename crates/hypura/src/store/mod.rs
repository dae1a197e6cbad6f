//! The weight store: how tensor bytes get from the GGUF file on NVMe into memory.
//!
//! `io` is its lowest layer (aligned buffers, `O_DIRECT` reads, page-cache eviction); the
//! streaming store above it is built on that safe API.

pub mod io;
