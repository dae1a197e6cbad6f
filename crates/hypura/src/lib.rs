//! Hypura: an LLM inference scheduler that knows the storage hierarchy.
//!
//! llama.cpp computes; Hypura decides where every weight lives (GPU memory, RAM or NVMe) and
//! streams the rest from disk just in time. Data flow: `model` (the inventory read from the
//! GGUF index), `hw` (the measured machine) and `remote` (other machines' devices, through
//! ggml's RPC backend) feed the pure planner; `store` moves bytes, through the raw-memory I/O of
//! `io` at the bottom (which `hw` measures the disk with too); `engine` runs llama.cpp through
//! `hypura-sys`; `setup` reads the machine and assembles a run; `cli`, `bench` and `server` sit
//! on top.
pub mod bench;
pub mod cli;
pub mod engine;
pub mod format;
pub mod hub;
pub mod hw;
pub mod io;
pub mod model;
pub mod plan;
pub mod remote;
pub mod server;
pub mod setup;
pub mod store;
pub mod sync;
