//! The hardware profile: what this machine can hold and how fast it can read.
//!
//! `hw` measures capacities (RAM, the cgroup limit, device memory reported by ggml) and bandwidths
//! (direct and buffered reads from the disk the model lives on) and hands them to the pure
//! planner, which decides from these numbers alone which tensors stay resident and which are
//! streamed. Measuring the disk takes tens of seconds, so the profile is cached as JSON keyed to
//! the machine ([`ProfileCache`]); `hypura profile [--refresh] [--json]` prints or re-measures it.
//! The disk is read through `crate::io`, the same path the streaming store uses, so the figures
//! are the ones streaming will see.

mod cache;
mod cpu;
mod disk;
mod measured;
mod memory;
mod mountinfo;
mod render;
#[cfg(test)]
mod test_support;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use cache::{default_cache_dir, machine_key, ProfileCache};
pub use cpu::{cpu_info, CpuInfo};
pub use disk::{measure_disk, volume_of, DiskOptions, DiskProfile, ReadPoint, Volume, STORE_READERS};
pub use measured::{BusyReads, ComputeMeasurement, CpuRate, ModelRecord, ModelRecords, PoolWork};
pub use memory::{memory_info, peak_rss_bytes, CgroupLimit, MemoryInfo};

use crate::io::IoError;

/// Bumped whenever a field changes meaning, so an old cached profile is measured again rather
/// than misread.
pub const PROFILE_SCHEMA_VERSION: u32 = 1;

/// Everything the planner needs to know about the machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub schema_version: u32,
    /// Stable id of the machine (hash of host name, CPU model and total RAM); the cache key.
    pub machine_key: String,
    pub measured_at_unix_secs: u64,
    pub cpu: CpuInfo,
    /// Memory at measurement time; call [`Profile::refresh_memory`] on a cached profile.
    pub memory: MemoryInfo,
    /// ggml devices as the caller listed them; `hw` only stores them.
    pub devices: Vec<DeviceInfo>,
    /// `None` when no disk was measured.
    pub disk: Option<DiskProfile>,
}

/// One ggml compute device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub name: String,
    pub description: String,
    /// "cpu" | "gpu" | "igpu" | "accel".
    pub kind: String,
    pub free_bytes: u64,
    pub total_bytes: u64,
    /// Whether the device shares the host's RAM (so its memory and RAM are one budget).
    pub unified_memory: bool,
    /// Copy rate from pageable host memory into the device's memory (dedicated devices only).
    #[serde(default)]
    pub host_to_device_bytes_per_sec: Option<f64>,
}

/// Errors while profiling; each names the path and what was being done to it.
#[derive(Debug, thiserror::Error)]
pub enum HwError {
    #[error(transparent)]
    Io(#[from] IoError),

    #[error("cannot {action} {path}: {source}")]
    File { action: &'static str, path: PathBuf, source: std::io::Error },

    #[error("disk probe {path}: {reason}")]
    Probe { path: PathBuf, reason: String },

    #[error("cannot parse cached profile {path}: {source}")]
    CacheFormat { path: PathBuf, source: serde_json::Error },
}

impl HwError {
    pub(crate) fn file(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> HwError {
        HwError::File { action, path: path.into(), source }
    }
}

impl Profile {
    /// Measure CPU and memory, store `devices`, and measure the disk at `disk_probe` if given
    /// (see [`measure_disk`] for what a probe path may be).
    pub fn measure(
        devices: Vec<DeviceInfo>,
        disk_probe: Option<&std::path::Path>,
        disk_options: &DiskOptions,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Profile, HwError> {
        let disk = match disk_probe {
            Some(probe) => Some(measure_disk(probe, disk_options, progress)?),
            None => None,
        };
        Ok(Profile {
            schema_version: PROFILE_SCHEMA_VERSION,
            machine_key: machine_key(),
            measured_at_unix_secs: unix_now_secs(),
            cpu: cpu_info(),
            memory: memory_info(),
            devices,
            disk,
        })
    }

    /// Re-read memory figures, which change from minute to minute, keeping the cached disk
    /// figures, which do not.
    pub fn refresh_memory(&mut self) {
        self.memory = memory_info();
    }

    /// A readable multi-line report; see `render.rs`.
    pub fn render_human(&self) -> String {
        render::render_profile(self)
    }
}

pub(crate) fn unix_now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|elapsed| elapsed.as_secs()).unwrap_or(0)
}
