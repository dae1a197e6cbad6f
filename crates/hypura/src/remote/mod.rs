//! Other machines as a tier: ggml RPC workers (`hypura rpc-server`, or llama.cpp's
//! `rpc-server`) whose devices hold whole layers. `Workers::connect` checks each worker
//! directly (protocol version, devices, the link's round trip), then starts a relay for it
//! (`relay`) and registers the relay's endpoint with ggml's RPC backend, so ggml never talks
//! to a worker that can vanish under it. The engine asks `Workers::check` after every decode:
//! a worker that stopped answering fails the request with its name.
pub mod front;
pub mod protocol;
mod relay;
pub mod secure;

use crate::sync::Lock;
use std::sync::Arc;
use std::time::Duration;

use crate::plan::RemoteDeviceFacts;
use relay::{Relay, RelayState};

/// Round trips timed when a worker is checked; the median is the link's.
const PINGS: usize = 9;
/// Bytes uploaded to time a link's rate.
const LINK_PROBE_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum RemoteError {
    #[error("RPC worker {worker} is not answering: {reason} (start it with `hypura rpc-server --host HOST --port PORT` on that machine)")]
    Down { worker: String, reason: String },
    #[error("RPC worker {worker} speaks protocol {major}, this build speaks {ours}: run the same Hypura (or llama.cpp) version on both sides")]
    Version { worker: String, major: u8, ours: u8 },
    #[error("RPC worker {worker} offers no device")]
    NoDevices { worker: String },
    #[error("{0:?} is not HOST:PORT")]
    BadEndpoint(String),
    #[error("RPC worker {worker} stopped answering: {reason}; the request failed, and the model will be planned again without it")]
    Failed { worker: String, reason: String },
    #[error("{0}")]
    Sys(String),
}

/// One device of a worker.
#[derive(Clone, Debug)]
pub struct RemoteDevice {
    pub device: hypura_sys::DeviceHandle,
    /// ggml's name for it (`RPC0`).
    pub name: String,
    /// The worker's `host:port`, as the user gave it.
    pub worker: String,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// A worker's link, as measured when it was checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    pub worker: String,
    /// The median round trip of a small request (with any emulated delay).
    pub round_trip: Duration,
    /// The slower of uploading and downloading a tensor's bytes; None where not measured.
    pub bytes_per_sec: Option<f64>,
}

/// Bytes and round trips over every link since the workers were connected.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    pub sent_bytes: u64,
    pub received_bytes: u64,
    pub round_trips: u64,
}

impl std::ops::Add for Traffic {
    type Output = Traffic;
    fn add(self, other: Traffic) -> Traffic {
        Traffic {
            sent_bytes: self.sent_bytes + other.sent_bytes,
            received_bytes: self.received_bytes + other.received_bytes,
            round_trips: self.round_trips + other.round_trips,
        }
    }
}

impl Traffic {
    pub fn since(self, earlier: Traffic) -> Traffic {
        Traffic {
            sent_bytes: self.sent_bytes - earlier.sent_bytes,
            received_bytes: self.received_bytes - earlier.received_bytes,
            round_trips: self.round_trips - earlier.round_trips,
        }
    }

    pub fn bytes(&self) -> u64 {
        self.sent_bytes + self.received_bytes
    }
}

/// Connected workers: their devices (through relays), links and health.
pub struct Workers {
    relays: Vec<Arc<RelayState>>,
    pub devices: Vec<RemoteDevice>,
    pub links: Vec<Link>,
    /// What they were connected with, to connect again (`reconnect`).
    endpoints: Vec<String>,
    delay: Duration,
    measure_rate: bool,
    /// The workers connected again after one of these failed (`current`).
    successor: std::sync::Mutex<Option<Arc<Workers>>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Workers").field("devices", &self.devices).field("links", &self.links).finish()
    }
}

impl Workers {
    /// Check and connect every worker in `endpoints` (`host:port`), in order; `delay` is added
    /// to every round trip (an emulated link, for benchmarks). With `measure_rate`, each link's
    /// upload rate is timed too (it allocates 8 MiB on the worker for a moment).
    pub fn connect(endpoints: &[String], delay: Duration, measure_rate: bool) -> Result<Arc<Workers>, RemoteError> {
        let backend = hypura_sys::Backend::get();
        let mut workers = Workers {
            relays: Vec::new(),
            devices: Vec::new(),
            links: Vec::new(),
            endpoints: endpoints.to_vec(),
            delay,
            measure_rate,
            successor: std::sync::Mutex::new(None),
        };
        for worker in endpoints {
            let worker = worker.trim();
            let pings = check_worker(worker, PINGS)?;
            let relay = Relay::start(worker, delay)
                .map_err(|error| RemoteError::Sys(format!("a relay for {worker}: {error}")))?;
            let devices = hypura_sys::rpc_connect(backend, &relay.endpoint)
                .map_err(|error| RemoteError::Sys(error.to_string()))?;
            if let Some(reason) = relay.state.failure() {
                return Err(RemoteError::Down { worker: worker.to_string(), reason });
            }
            let mut bytes_per_sec = None;
            for device in devices {
                let (free_bytes, total_bytes) = device.memory();
                if measure_rate && bytes_per_sec.is_none() {
                    bytes_per_sec = device
                        .transfer_bytes_per_sec(LINK_PROBE_BYTES, 2)
                        .map(|(upload, download)| upload.min(download));
                }
                workers.devices.push(RemoteDevice {
                    device,
                    name: device.name(),
                    worker: worker.to_string(),
                    free_bytes,
                    total_bytes,
                });
            }
            workers.links.push(Link {
                worker: worker.to_string(),
                round_trip: pings[pings.len() / 2] + delay,
                bytes_per_sec,
            });
            workers.relays.push(relay.state);
            workers.check()?;
        }
        Ok(Arc::new(workers))
    }

    /// The workers to plan with now: these while every one answers; once one has failed, the
    /// ones that answered when that was first noticed (connected afresh once, then kept, so
    /// later loads and queries neither reconnect again nor reach a worker through a relay of
    /// the old set). None where none answers; the errors of those that do not.
    pub fn current(self: &Arc<Self>) -> (Option<Arc<Workers>>, Vec<RemoteError>) {
        let Err(failed) = self.check() else { return (Some(self.clone()), Vec::new()) };
        let mut successor = self.successor.locked();
        if let Some(next) = successor.clone() {
            drop(successor);
            return next.current();
        }
        let (answering, mut down) = self.reconnect();
        down.push(failed);
        if let Some(next) = &answering {
            *successor = Some(next.clone());
        }
        (answering, down)
    }

    /// Connect again, afresh (new relays), to every worker that answers now: None where none
    /// does; the errors of those that do not.
    pub fn reconnect(&self) -> (Option<Arc<Workers>>, Vec<RemoteError>) {
        let mut down = Vec::new();
        let answering: Vec<String> = self
            .endpoints
            .iter()
            .filter(|worker| match relay::probe(worker, 1) {
                Ok(_) => true,
                Err(error) => {
                    down.push(RemoteError::Down { worker: worker.to_string(), reason: error.to_string() });
                    false
                }
            })
            .cloned()
            .collect();
        if answering.is_empty() {
            return (None, down);
        }
        match Workers::connect(&answering, self.delay, self.measure_rate) {
            Ok(workers) => (Some(workers), down),
            Err(error) => {
                down.push(error);
                (None, down)
            }
        }
    }

    /// Fails with the first worker that stopped answering.
    pub fn check(&self) -> Result<(), RemoteError> {
        match self.relays.iter().find_map(|relay| relay.failure().map(|reason| (relay.worker.clone(), reason))) {
            Some((worker, reason)) => Err(RemoteError::Failed { worker, reason }),
            None => Ok(()),
        }
    }

    pub fn traffic(&self) -> Traffic {
        use std::sync::atomic::Ordering::Relaxed;
        self.relays.iter().fold(Traffic::default(), |total, relay| {
            total
                + Traffic {
                    sent_bytes: relay.sent_bytes.load(Relaxed),
                    received_bytes: relay.received_bytes.load(Relaxed),
                    round_trips: relay.round_trips.load(Relaxed),
                }
        })
    }

    /// The devices as the planner sees them, with the free memory each reports now (a worker
    /// that already holds another model's layers has less).
    pub fn facts(&self) -> Vec<RemoteDeviceFacts> {
        self.devices
            .iter()
            .map(|device| {
                let link =
                    self.links.iter().find(|link| link.worker == device.worker).expect("a device's worker has a link");
                RemoteDeviceFacts {
                    name: device.name.clone(),
                    worker: device.worker.clone(),
                    free_bytes: device.device.memory().0,
                    round_trip_secs: link.round_trip.as_secs_f64(),
                    link_bytes_per_sec: link.bytes_per_sec,
                }
            })
            .collect()
    }

    /// The device handles for the devices named (in that order), for llama.cpp's device list.
    pub fn handles(&self, names: &[&str]) -> Vec<hypura_sys::DeviceHandle> {
        names
            .iter()
            .filter_map(|name| self.devices.iter().find(|device| device.name == *name))
            .map(|device| device.device)
            .collect()
    }
}

/// Ask `worker` (`host:port`) directly for its protocol and devices, timing `pings` round trips:
/// their times, shortest first, or why it cannot be used.
fn check_worker(worker: &str, pings: usize) -> Result<Vec<Duration>, RemoteError> {
    match worker.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
        _ => return Err(RemoteError::BadEndpoint(worker.to_string())),
    }
    let (major, count, mut times) = relay::probe(worker, pings).map_err(|error| {
        let mut reason = error.to_string();
        // A keyed worker closes a connection that does not prove its key, and answers nothing.
        if secure::client_key().is_none() && error.kind() == std::io::ErrorKind::UnexpectedEof {
            reason.push_str(" (a worker started with a key closes connections without it: pass --rpc-key-file)");
        }
        RemoteError::Down { worker: worker.to_string(), reason }
    })?;
    if major != hypura_sys::RPC_PROTOCOL_MAJOR {
        return Err(RemoteError::Version { worker: worker.to_string(), major, ours: hypura_sys::RPC_PROTOCOL_MAJOR });
    }
    if count == 0 {
        return Err(RemoteError::NoDevices { worker: worker.to_string() });
    }
    times.sort();
    Ok(times)
}

/// One link as `hypura profile --rpc` measures it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LinkProfile {
    pub worker: String,
    pub round_trip_median_secs: f64,
    pub round_trip_p90_secs: f64,
    /// Bytes per second of a tensor's bytes sent to the worker and fetched back.
    pub upload_bytes_per_sec: Option<f64>,
    pub download_bytes_per_sec: Option<f64>,
    /// The worker's devices: name, free and total memory as it reports them.
    pub devices: Vec<(String, u64, u64)>,
}

/// Measure the link to `worker`: `pings` round trips of a small request (directly), then
/// `bytes` to one of its devices and back (through ggml, as a model's weights and activations
/// go), the best of three each way.
pub fn profile_link(worker: &str, pings: usize, bytes: usize) -> Result<LinkProfile, RemoteError> {
    let times = check_worker(worker, pings)?;
    let workers = Workers::connect(&[worker.to_string()], Duration::ZERO, false)?;
    let rates = workers.devices.first().and_then(|device| device.device.transfer_bytes_per_sec(bytes, 3));
    workers.check()?;
    Ok(LinkProfile {
        worker: worker.to_string(),
        round_trip_median_secs: times[times.len() / 2].as_secs_f64(),
        round_trip_p90_secs: times[(times.len() * 9 / 10).min(times.len() - 1)].as_secs_f64(),
        upload_bytes_per_sec: rates.map(|(upload, _)| upload),
        download_bytes_per_sec: rates.map(|(_, download)| download),
        devices: workers
            .devices
            .iter()
            .map(|device| (device.name.clone(), device.free_bytes, device.total_bytes))
            .collect(),
    })
}
