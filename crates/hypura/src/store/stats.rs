//! I/O statistics, counted per read and per stall, never per graph node.
use crate::sync::Lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    recycled_bytes: AtomicU64,
    observations: AtomicU64,
    /// Reads in flight, and since when at least one has been.
    in_flight: Mutex<(u32, Option<Instant>)>,
    /// Wall time with at least one read in flight (the disk busy), finished stretches only.
    busy_nanos: AtomicU64,
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
    /// Bytes of pages moved from released units into units about to be read (no page faults,
    /// no zeroing); the rest of `bytes_read` landed in freshly faulted pages.
    pub recycled_bytes: u64,
    /// Eval-hook observations (graph nodes where the scheduler stopped for us).
    pub observations: u64,
    /// Wall time with at least one read in flight: `bytes_read / busy_seconds` is the rate the
    /// disk delivered while it was asked for bytes, and the rest of the wall time it idled.
    pub busy_seconds: f64,
}

impl IoStats {
    /// A read starts (`record_read` or `read_ended` ends it).
    pub fn read_started(&self) {
        let mut in_flight = self.in_flight.locked();
        if in_flight.0 == 0 {
            in_flight.1 = Some(Instant::now());
        }
        in_flight.0 += 1;
    }

    /// A read ends (`record_read` calls it; a failed read calls it alone).
    pub fn read_ended(&self) {
        let mut in_flight = self.in_flight.locked();
        in_flight.0 = in_flight.0.saturating_sub(1);
        if in_flight.0 == 0 {
            if let Some(since) = in_flight.1.take() {
                self.busy_nanos.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }

    pub fn record_read(&self, bytes: u64, elapsed: Duration) {
        self.read_ended();
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

    pub fn record_recycled(&self, bytes: u64) {
        self.recycled_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Time compute has waited for bytes so far, in nanoseconds (a stop's own share is the
    /// difference across it).
    pub fn stall_nanos(&self) -> u64 {
        self.stall_nanos.load(Ordering::Relaxed)
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
            recycled_bytes: load(&self.recycled_bytes),
            observations: load(&self.observations),
            busy_seconds: load(&self.busy_nanos) as f64 / 1e9,
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
            recycled_bytes: self.recycled_bytes - earlier.recycled_bytes,
            observations: self.observations - earlier.observations,
            busy_seconds: self.busy_seconds - earlier.busy_seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_is_busy_while_any_read_is_in_flight_counted_once() {
        let stats = IoStats::default();
        stats.read_started();
        std::thread::sleep(Duration::from_millis(30));
        stats.read_started();
        std::thread::sleep(Duration::from_millis(30));
        stats.record_read(4096, Duration::from_millis(60));
        std::thread::sleep(Duration::from_millis(30));
        stats.read_ended();
        let busy = stats.snapshot().busy_seconds;
        // One stretch of about 90 ms, not the 150 ms the two reads took together.
        assert!((0.085..0.14).contains(&busy), "busy {busy} s");
        // Idle time is not counted.
        std::thread::sleep(Duration::from_millis(50));
        stats.read_started();
        stats.record_read(4096, Duration::ZERO);
        let after = stats.snapshot();
        assert!(after.busy_seconds - busy < 0.01, "{after:?}");
        assert_eq!((after.bytes_read, after.reads), (8192, 2));
    }
}
