//! I/O statistics, counted per read and per stall, never per graph node.
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Counters shared by the store's workers and the eval hook.
#[derive(Debug, Default)]
pub struct IoStats {
    bytes_read: AtomicU64,
    reads: AtomicU64,
    read_nanos: AtomicU64,
    stall_nanos: AtomicU64,
    stalls: AtomicU64,
    units_loaded: AtomicU64,
    unit_bytes_loaded: AtomicU64,
    units_released: AtomicU64,
    observations: AtomicU64,
}

/// A point-in-time copy of the counters; subtract two to get one request's share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct IoSnapshot {
    pub bytes_read: u64,
    pub reads: u64,
    /// Summed over worker threads (so it can exceed wall time at queue depth > 1).
    pub read_seconds: f64,
    /// Time compute spent waiting for bytes.
    pub stall_seconds: f64,
    pub stalls: u64,
    pub units_loaded: u64,
    /// The exact bytes of the units loaded (reads cover whole pages, so `bytes_read` is a
    /// little more).
    pub unit_bytes_loaded: u64,
    pub units_released: u64,
    /// Eval-hook observations (graph nodes where the scheduler stopped for us).
    pub observations: u64,
}

impl IoStats {
    pub fn record_read(&self, bytes: u64, elapsed: Duration) {
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_nanos.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn record_stall(&self, elapsed: Duration) {
        self.stall_nanos.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        self.stalls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_unit_loaded(&self, bytes: u64) {
        self.units_loaded.fetch_add(1, Ordering::Relaxed);
        self.unit_bytes_loaded.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn record_unit_released(&self) {
        self.units_released.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_observation(&self) {
        self.observations.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> IoSnapshot {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        IoSnapshot {
            bytes_read: load(&self.bytes_read),
            reads: load(&self.reads),
            read_seconds: load(&self.read_nanos) as f64 / 1e9,
            stall_seconds: load(&self.stall_nanos) as f64 / 1e9,
            stalls: load(&self.stalls),
            units_loaded: load(&self.units_loaded),
            unit_bytes_loaded: load(&self.unit_bytes_loaded),
            units_released: load(&self.units_released),
            observations: load(&self.observations),
        }
    }
}

impl std::ops::Sub for IoSnapshot {
    type Output = IoSnapshot;

    fn sub(self, earlier: IoSnapshot) -> IoSnapshot {
        IoSnapshot {
            bytes_read: self.bytes_read - earlier.bytes_read,
            reads: self.reads - earlier.reads,
            read_seconds: self.read_seconds - earlier.read_seconds,
            stall_seconds: self.stall_seconds - earlier.stall_seconds,
            stalls: self.stalls - earlier.stalls,
            units_loaded: self.units_loaded - earlier.units_loaded,
            unit_bytes_loaded: self.unit_bytes_loaded - earlier.unit_bytes_loaded,
            units_released: self.units_released - earlier.units_released,
            observations: self.observations - earlier.observations,
        }
    }
}
