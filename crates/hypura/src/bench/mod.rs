//! Benchmarks: Hypura against plain llama.cpp in the same process, alternating, with
//! llama-bench-like tables and JSON. A benchmark reports; it never asserts timings.
pub mod peer;
