//! The weight store: how tensor bytes get from the GGUF file on NVMe into memory.
//!
//! It stands on the raw layer `crate::io` (aligned buffers, `O_DIRECT` reads, page-cache
//! eviction, and the `Region` that mirrors the model file in address space). `residency` runs
//! one state machine per stream unit with a pool of reader threads, and `parked` recycles the
//! pages of released units under the next reads; `dense` drives the dense-FFN window from the
//! eval hook; `expert` makes the router's chosen experts resident through an expert cache;
//! `layout` says which file ranges make up each stream unit; `load` serves llama.cpp's own
//! load-time reads so that streamed bytes are skipped; `pool` is the device's expert pool above
//! the expert cache (slots in GPU memory, ids remapped by the expert driver); `stats` counts bytes, reads and stalls.
//! `streams` is the door the engine loads through: it prepares the region, the tensors' offsets
//! and the load reader before llama.cpp's load, and builds the drivers after it.
pub mod dense;
pub mod experts;
pub mod layout;
pub mod load;
mod parked;
pub mod residency;
pub mod stats;
pub mod streams;

pub use dense::DenseWindow;
pub use experts::limit::{PoolLimit, PoolWorkTotals, PooledDecode, StopSplit};
pub use experts::pool::{ExpertPool, PoolSnapshot, PooledTensor, StopTimes};
pub use experts::split::SplitLayer;
pub use experts::{CacheModel, CachePolicy, ExpertSnapshot, ExpertStream, RouteRecord, RouterWeights};
pub use layout::{ExpertUnits, StreamedTensor};
pub use residency::{FailureLatch, Residency, ResidencyError, StreamUnit, UnitReader, UnitState, CHUNK_BYTES};
pub use stats::{IoSnapshot, IoStats};
pub use streams::{StoreError, StreamLoad, Streams};
