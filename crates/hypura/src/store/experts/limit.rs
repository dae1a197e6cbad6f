//! The pool's arithmetic over a decode, beside its counters (`PoolSnapshot`): where a stop's time
//! goes (`StopSplit`), and the device's and the bus's terms of a pooled decode's physical limit
//! (`PoolLimit`). One copy, for benchmarks, the CLI and the examples alike.
use serde::Serialize;

use super::pool::PoolSnapshot;
use crate::plan::CPU_BYTES_PER_SEC_UNMEASURED;

/// A pool's stop in a decode, on average (`PoolSnapshot`'s stop times per stop): what the
/// device waits for at each, beside its compute.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StopSplit {
    pub stops_per_token: f64,
    /// The host's work, and of it the router's ids read and the slots' written back, and the
    /// experts moved between the tiers.
    pub host_seconds: f64,
    pub ids_seconds: f64,
    pub transfer_seconds: f64,
    /// The eval callback's questions about the nodes since the stop before (the device idle),
    /// and how many nodes that was.
    pub asks_seconds: f64,
    pub asked_nodes: f64,
    /// The segment before the stop: launched, computed and synchronised.
    pub segment_seconds: f64,
}

impl StopSplit {
    /// The pool's stops in `graphs` decode graphs (tokens), each part per stop.
    pub fn of(pool: &PoolSnapshot, graphs: f64) -> StopSplit {
        let per = |total: f64, count: u64| total / count.max(1) as f64;
        StopSplit {
            stops_per_token: pool.stops as f64 / graphs,
            host_seconds: per(pool.host_seconds, pool.stops),
            ids_seconds: per(pool.ids_seconds, pool.stops),
            transfer_seconds: per(pool.transfer_seconds, pool.stops),
            asks_seconds: per(pool.asks_seconds, pool.asked_stops),
            asked_nodes: per(pool.asked_nodes as f64, pool.asked_stops),
            segment_seconds: per(pool.segment_seconds, pool.stops),
        }
    }
}

/// What a pooled decode's limit comes from, summed over its requests: the pool's counters, the
/// decode graphs evaluated (the start tokens' and each generated token's), the decodes that
/// generated and their compute time (waits for reads left out), and the expert stream's layer
/// visits (where it has a pool, the pool's stops).
#[derive(Clone, Copy, Debug, Default)]
pub struct PooledDecode {
    pub pool: PoolSnapshot,
    pub graphs: u64,
    pub generated: u64,
    pub compute_seconds: f64,
    pub layer_visits: u64,
}

/// The pool's work over a decode, as the model's record keeps it for the next plan: bytes moved
/// both ways and the time it took, the pool's stops and the host's time at them beside the
/// transfers (the plan counts those as the misses' bus time), and, where the model's resident
/// time on the device was known, the stops again with what the device's side took beyond that
/// time (the gaps the stops leave there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PoolWorkTotals {
    pub moved_bytes: u64,
    pub transfer_seconds: f64,
    pub stops: u64,
    pub host_seconds: f64,
    pub gap_stops: u64,
    pub device_gap_seconds: f64,
    /// A split pool's misses computed by the CPU, and the device's wait for their sums.
    pub cpu_bytes: u64,
    pub cpu_wait_seconds: f64,
}

/// The device's and the bus's terms of a pooled decode's limit. `Work` is the form its totals
/// take: `PoolWorkTotals` as computed here, or the model record's own (`with_work`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolLimit<Work = PoolWorkTotals> {
    /// tg's compute per token less the host's work at the pool's stops (the gaps the stops
    /// leave on the device still in it).
    pub device_seconds_per_token: f64,
    /// The same model resident on the device, as an earlier run recorded it: the GPU's compute
    /// without the stops, where known.
    pub resident_seconds_per_token: Option<f64>,
    pub host_seconds_per_token: f64,
    /// The pool's transfers per pass, and the rate they ran at.
    pub bus_seconds_per_token: f64,
    pub bus_bytes_per_sec: f64,
    /// The bytes of the decode's picks that no slot held, per pass (uploaded or computed by
    /// the CPU), and the CPU's rate beside the bus's: the least time those misses take is
    /// their bytes over both (`miss_seconds_per_token`). Copies back and staging are this
    /// run's own way of moving them, not part of it.
    pub miss_bytes_per_token: f64,
    pub cpu_bytes_per_sec: Option<f64>,
    /// Where the CPU's rate came from (`CpuRateFrom`).
    pub cpu_rate_from: CpuRateFrom,
    /// The totals they come from, as the model's record keeps them for the next plan
    /// (`PoolWorkTotals`).
    pub work: Work,
    /// Where a stop's time goes, per stop.
    pub stop: StopSplit,
}

/// Where a pooled limit's CPU rate came from: a resident run here recorded it; without one, a
/// split's own share of misses computed at this rate in this run, or the rate assumed where no
/// model ran on this CPU (`plan::predict::CPU_BYTES_PER_SEC_UNMEASURED`), whichever is faster
/// (a limit takes the faster); no split and no record: none (the bus alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum CpuRateFrom {
    Recorded,
    ThisRun,
    Assumed,
    Unknown,
}

impl CpuRateFrom {
    pub fn describe(self) -> &'static str {
        match self {
            CpuRateFrom::Recorded => "a run here recorded",
            CpuRateFrom::ThisRun => "this run's CPU share: no CPU rate recorded here yet",
            CpuRateFrom::Assumed => "assumed: no CPU rate recorded here yet",
            CpuRateFrom::Unknown => "no CPU rate recorded here yet",
        }
    }
}

impl PoolLimit {
    /// From a decode's totals, the model's recorded time resident on the device, if any, and
    /// the CPU's recorded rate; None without a pool's stops or a decode. The host's and the
    /// bus's times are the decode requests' (their start tokens' passes too) per pass. A split
    /// pool's device side leaves out its waits for the CPU's share at the layers' sums: those
    /// misses are the misses' term, at the CPU's rate (without a recorded one, the faster of
    /// this run's own and the assumed rate), so the device's idle time is not counted twice.
    pub fn from_decode(
        decode: &PooledDecode,
        resident: Option<f64>,
        cpu_bytes_per_sec: Option<f64>,
    ) -> Option<PoolLimit> {
        let pool = &decode.pool;
        if pool.host_seconds <= 0.0 || decode.generated == 0 || decode.graphs == 0 {
            return None;
        }
        let graphs = decode.graphs as f64;
        let host_seconds_per_token = pool.host_seconds / graphs;
        let moved = pool.bus_bytes();
        let device_seconds_per_token = (decode.compute_seconds / decode.generated as f64
            - host_seconds_per_token
            - pool.cpu_wait_seconds / graphs)
            .max(0.0);
        let this_run = (pool.cpu_bytes > 0 && pool.cpu_seconds > 0.0).then(|| pool.cpu_bytes as f64 / pool.cpu_seconds);
        let (cpu_bytes_per_sec, cpu_rate_from) = match (cpu_bytes_per_sec.filter(|rate| *rate > 0.0), this_run) {
            (Some(rate), _) => (Some(rate), CpuRateFrom::Recorded),
            (None, Some(rate)) if rate > CPU_BYTES_PER_SEC_UNMEASURED => (Some(rate), CpuRateFrom::ThisRun),
            (None, Some(_)) => (Some(CPU_BYTES_PER_SEC_UNMEASURED), CpuRateFrom::Assumed),
            (None, None) => (None, CpuRateFrom::Unknown),
        };
        let resident = resident.filter(|seconds| seconds.is_finite() && *seconds > 0.0);
        // Beside the resident time, what the stops cost the device: its side beyond it.
        let gap = resident.map(|resident| (device_seconds_per_token - resident).max(0.0) * graphs);
        Some(PoolLimit {
            device_seconds_per_token,
            host_seconds_per_token,
            resident_seconds_per_token: resident,
            bus_seconds_per_token: pool.transfer_seconds / graphs,
            bus_bytes_per_sec: if pool.transfer_seconds > 0.0 { moved as f64 / pool.transfer_seconds } else { 0.0 },
            miss_bytes_per_token: pool.miss_bytes() as f64 / graphs,
            cpu_bytes_per_sec,
            cpu_rate_from,
            work: PoolWorkTotals {
                moved_bytes: moved,
                transfer_seconds: pool.transfer_seconds,
                stops: decode.layer_visits,
                host_seconds: (pool.host_seconds - pool.transfer_seconds).max(0.0),
                gap_stops: if gap.is_some() { decode.layer_visits } else { 0 },
                device_gap_seconds: gap.unwrap_or(0.0),
                cpu_bytes: pool.cpu_bytes,
                cpu_wait_seconds: pool.cpu_wait_seconds,
            },
            stop: StopSplit::of(pool, graphs),
        })
    }
}

impl<Work> PoolLimit<Work> {
    /// The same limit with its totals in another form (the model record's).
    pub fn with_work<Other>(self, form: impl FnOnce(Work) -> Other) -> PoolLimit<Other> {
        PoolLimit {
            device_seconds_per_token: self.device_seconds_per_token,
            resident_seconds_per_token: self.resident_seconds_per_token,
            host_seconds_per_token: self.host_seconds_per_token,
            bus_seconds_per_token: self.bus_seconds_per_token,
            bus_bytes_per_sec: self.bus_bytes_per_sec,
            miss_bytes_per_token: self.miss_bytes_per_token,
            cpu_bytes_per_sec: self.cpu_bytes_per_sec,
            cpu_rate_from: self.cpu_rate_from,
            work: form(self.work),
            stop: self.stop,
        }
    }

    /// The least time a pass's misses take: their bytes moved over the bus and computed by the
    /// CPU at once, each at its rate (the bus's as this run measured it).
    pub fn miss_seconds_per_token(&self) -> f64 {
        let rate = self.bus_bytes_per_sec + self.cpu_bytes_per_sec.unwrap_or(0.0);
        if rate > 0.0 {
            self.miss_bytes_per_token / rate
        } else {
            self.bus_seconds_per_token
        }
    }

    /// The CPU's rate in the misses' term and where it came from, for a report line.
    pub fn cpu_rate_text(&self) -> String {
        let from = self.cpu_rate_from.describe();
        self.cpu_bytes_per_sec
            .map_or_else(|| from.to_string(), |rate| format!("the CPU at {:.1} GB/s ({from})", rate / 1e9))
    }

    /// The limit's compute term: the device's, or the misses' where they take longer (their
    /// transfers and the CPU's share overlap the device's compute at best).
    pub fn compute_seconds_per_token(&self) -> f64 {
        self.device_compute_seconds_per_token().max(self.miss_seconds_per_token())
    }

    /// The GPU's compute term of the limit: the model resident on the device where a run
    /// recorded it (never more than this run's own GPU side), else this run's GPU side.
    pub fn device_compute_seconds_per_token(&self) -> f64 {
        self.resident_seconds_per_token
            .map_or(self.device_seconds_per_token, |resident| resident.min(self.device_seconds_per_token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooled decode's limit: the device's compute is tg's less the host's work at the stops,
    /// the bus is the transfers' time at the rate they ran; no pool, no such terms.
    #[test]
    fn a_pooled_decodes_limit_leaves_the_hosts_work_at_the_stops_out() {
        let pool = PoolSnapshot {
            upload_bytes: 4_000_000,
            copied_back_bytes: 1_000_000,
            transfer_seconds: 0.005,
            host_seconds: 0.022,
            ..Default::default()
        };
        let decode = PooledDecode { graphs: 11, generated: 10, compute_seconds: 0.1, layer_visits: 44, pool };
        let limit = PoolLimit::from_decode(&decode, None, None).expect("a pooled run");
        assert!((limit.host_seconds_per_token - 0.002).abs() < 1e-12, "{limit:?}");
        assert!((limit.device_seconds_per_token - 0.008).abs() < 1e-12, "{limit:?}");
        assert!((limit.bus_seconds_per_token - 0.005 / 11.0).abs() < 1e-12, "{limit:?}");
        assert!((limit.bus_bytes_per_sec - 1e9).abs() < 1.0, "{limit:?}");
        assert_eq!((limit.work.moved_bytes, limit.work.stops), (5_000_000, 44), "{limit:?}");
        assert!((limit.work.host_seconds - 0.017).abs() < 1e-12, "{limit:?}");
        let unpooled = PooledDecode { graphs: 11, generated: 10, compute_seconds: 0.1, ..Default::default() };
        assert_eq!(PoolLimit::from_decode(&unpooled, Some(0.005), None), None);
        assert!((limit.device_compute_seconds_per_token() - 0.008).abs() < 1e-12, "{limit:?}");
        // The model resident on the device, recorded: the GPU's compute without the stops' gaps;
        // never more than this run's own GPU side (the limit stays a limit).
        let resident = PoolLimit::from_decode(&decode, Some(0.005), None).expect("a pooled run");
        assert!((resident.device_compute_seconds_per_token() - 0.005).abs() < 1e-12, "{resident:?}");
        let slower = PoolLimit::from_decode(&decode, Some(0.02), None).expect("a pooled run");
        assert!((slower.device_compute_seconds_per_token() - 0.008).abs() < 1e-12, "{slower:?}");
        // What the stops cost the device, for the next plan: its side beyond the resident time
        // (3 ms a pass over 11 passes, at 44 stops), none without that time, none below it.
        assert_eq!((limit.work.gap_stops, limit.work.device_gap_seconds), (0, 0.0), "{limit:?}");
        assert_eq!(resident.work.gap_stops, 44, "{resident:?}");
        assert!((resident.work.device_gap_seconds - 0.033).abs() < 1e-12, "{resident:?}");
        assert_eq!((slower.work.gap_stops, slower.work.device_gap_seconds), (44, 0.0), "{slower:?}");
        // Another form of the totals keeps every term.
        let recorded = resident.with_work(|work| (work.moved_bytes, work.gap_stops));
        assert_eq!(recorded.work, (5_000_000, 44));
        assert_eq!(recorded.with_work(|_| resident.work), resident);
    }

    /// A split decode with no rate recorded here (S6a's first run on the H100 machine: 51.6 ms
    /// a token, the host's 10.8 ms at the stops, the GPU waiting 29.5 ms at the layers' sums
    /// for the CPU's 277 MB computed in 31.4 ms): the device's side leaves the wait out, and
    /// the misses go at the faster of the assumed rate and this run's own, so the limit's
    /// compute stays below what the run took. That run's limit had charged the misses to the
    /// bus alone and read 1.60.
    #[test]
    fn a_split_without_records_is_limited_by_the_cpus_rate_not_by_its_own_waits() {
        let graphs = 129.0;
        let pool = PoolSnapshot {
            host_seconds: 0.0108 * graphs,
            cpu_bytes: (277e6 * graphs) as u64,
            cpu_seconds: 0.0314 * graphs,
            cpu_wait_seconds: 0.0295 * graphs,
            upload_bytes: (11.7e6 * graphs) as u64,
            transfer_seconds: 0.0036 * graphs,
            ..Default::default()
        };
        let decode =
            PooledDecode { graphs: 129, generated: 128, compute_seconds: 0.0516 * 128.0, layer_visits: 40 * 129, pool };
        let limit = PoolLimit::from_decode(&decode, None, None).expect("a pooled run");
        assert!((limit.device_seconds_per_token - 0.0113).abs() < 1e-9, "{limit:?}");
        assert_eq!(
            (limit.cpu_bytes_per_sec, limit.cpu_rate_from),
            (Some(CPU_BYTES_PER_SEC_UNMEASURED), CpuRateFrom::Assumed)
        );
        let misses = (277e6 + 11.7e6) / (CPU_BYTES_PER_SEC_UNMEASURED + 11.7e6 / 0.0036);
        assert!((limit.miss_seconds_per_token() - misses).abs() < 1e-9, "{limit:?}");
        assert!(limit.compute_seconds_per_token() < 0.0516 / 2.0, "{limit:?}");
        // The record's gaps are the stops' alone, not the waits for the CPU's share.
        let resident = PoolLimit::from_decode(&decode, Some(0.0052), None).expect("a pooled run");
        assert!((resident.work.device_gap_seconds - (0.0113 - 0.0052) * graphs).abs() < 1e-6, "{resident:?}");
        // A CPU share faster than the assumed rate is taken at its own; a recorded rate first.
        let fast = PooledDecode { pool: PoolSnapshot { cpu_seconds: 0.0055 * graphs, ..pool }, ..decode };
        let own = PoolLimit::from_decode(&fast, None, None).expect("a pooled run");
        assert_eq!(own.cpu_rate_from, CpuRateFrom::ThisRun);
        assert!(own.cpu_rate_text().contains("(this run's CPU share"), "{}", own.cpu_rate_text());
        assert!((own.cpu_bytes_per_sec.unwrap() - 277e6 / 0.0055).abs() < 1.0, "{own:?}");
        let recorded = PoolLimit::from_decode(&fast, None, Some(38e9)).expect("a pooled run");
        assert_eq!((recorded.cpu_bytes_per_sec, recorded.cpu_rate_from), (Some(38e9), CpuRateFrom::Recorded));
        // Unsplit, no CPU computed a miss: no rate but a recorded one.
        let unsplit = PooledDecode {
            pool: PoolSnapshot { cpu_bytes: 0, cpu_seconds: 0.0, cpu_wait_seconds: 0.0, ..pool },
            ..decode
        };
        let bus = PoolLimit::from_decode(&unsplit, None, None).expect("a pooled run");
        assert_eq!((bus.cpu_bytes_per_sec, bus.cpu_rate_from), (None, CpuRateFrom::Unknown));
    }

    /// A stop's split is each total over the stops it belongs to: the callback's questions
    /// over the stops that had a stop before them in their graph; no stops, all zero.
    #[test]
    fn a_stops_split_divides_each_part_by_its_own_stops() {
        let pool = PoolSnapshot {
            stops: 40,
            host_seconds: 0.004,
            ids_seconds: 0.002,
            transfer_seconds: 0.001,
            asked_stops: 30,
            asks_seconds: 0.0003,
            asked_nodes: 2_880,
            segment_seconds: 0.008,
            ..Default::default()
        };
        let split = StopSplit::of(&pool, 10.0);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(split.stops_per_token, 4.0) && close(split.host_seconds, 1e-4), "{split:?}");
        assert!(close(split.ids_seconds, 5e-5) && close(split.transfer_seconds, 2.5e-5), "{split:?}");
        assert!(close(split.asks_seconds, 1e-5) && close(split.asked_nodes, 96.0), "{split:?}");
        assert!(close(split.segment_seconds, 2e-4), "{split:?}");
        let none = StopSplit::of(&PoolSnapshot::default(), 10.0);
        assert_eq!(
            (none.stops_per_token, none.host_seconds, none.asks_seconds, none.asked_nodes),
            (0.0, 0.0, 0.0, 0.0)
        );
    }
}
