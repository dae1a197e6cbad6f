//! The model inventory: what every tensor of a GGUF file is for, where its bytes are, and the
//! hparams Hypura plans with.
//!
//! It is the first step of the data flow (`gguf::ModelFiles` -> `Inventory` -> `plan`). It reads
//! only the GGUF index, never tensor data, and touches no ggml, so it tests in milliseconds.
mod architectures;
mod inventory;
mod role;
pub mod url;

pub use architectures::{ffn_entry_node, KNOWN_ARCHITECTURES};
pub use inventory::{ExpertSlices, Hparams, Inventory, ModelError, TensorEntry};
pub use role::Role;
