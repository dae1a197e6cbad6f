//! The split of a pooled MoE layer (decision 33): at decode, the picks no device slot holds are
//! computed by the CPU from the host cache while the device computes the slots' picks, and the
//! CPU's sum is added to the layer's `ffn_moe_out-L` at a stop there.
//!
//! - `SplitLayer`: where a layer's experts' gate, up and down slices lie in the file (and so in
//!   the region), and their types and widths.
//! - `PlainCheck`: a layer splits only once a graph was seen computing its experts as the CPU
//!   computes them: separate gate and up matmuls, SwiGLU, down, then the router's weights, with
//!   no biases, scales or clamps between (the nodes' names say so). Until then its misses are
//!   uploaded, as an unsplit pool's are.
//! - `SplitWorker`: lanes of one thread, each with a CPU backend of its own, that compute one
//!   layer's CPU share between them while the device computes the rest of the layer.
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hypura_sys::{CpuExperts, ExpertShape, HostExpert};

use crate::store::layout::ExpertUnits;
use crate::store::residency::{Residency, ResidencyError};
use crate::sync::Lock;

/// The node that sums a layer's routed experts: the split's second stop.
pub const MOE_OUT_NODE: &str = "ffn_moe_out-";

/// One split layer's routed experts: their shape, and per tensor (gate, up, down) the file
/// offset of expert 0's slice and a slice's bytes.
#[derive(Clone, Copy, Debug)]
pub struct SplitLayer {
    pub shape: ExpertShape,
    pub slices: [(u64, u64); 3],
}

impl SplitLayer {
    /// Expert `expert`'s gate, up and down slices as file ranges.
    fn ranges(&self, expert: usize) -> [Range<u64>; 3] {
        self.slices.map(|(offset, bytes)| {
            let start = offset + expert as u64 * bytes;
            start..start + bytes
        })
    }

    /// One expert's bytes, every tensor's slice.
    pub fn expert_bytes(&self) -> u64 {
        self.slices.iter().map(|&(_, bytes)| bytes).sum()
    }
}

/// What the names of a layer's MoE nodes showed (bits of `PlainCheck`'s per-layer state).
const SAW_SWIGLU: u8 = 1;
const SAW_DOWN: u8 = 2;
const NOT_PLAIN: u8 = 4;
const PLAIN: u8 = 8;

/// Per layer, whether its graph computes routed experts as `CpuExperts` does, learnt from the
/// nodes' names as the scheduler asks about them (`PlainCheck::watch`, compute thread only).
pub struct PlainCheck {
    layers: Vec<AtomicU8>,
}

impl PlainCheck {
    pub fn new(n_layer: usize) -> PlainCheck {
        PlainCheck { layers: (0..n_layer).map(|_| AtomicU8::new(0)).collect() }
    }

    /// Whether a graph of `layer` was seen computing plain SwiGLU experts, and none otherwise.
    pub fn plain(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(|state| state.load(Ordering::Relaxed) & (PLAIN | NOT_PLAIN) == PLAIN)
    }

    /// A node named `name` (an `ffn_moe_` one) is about to be computed.
    pub fn watch(&self, name: &str) {
        let Some((base, layer)) = name.rsplit_once('-') else { return };
        let Some(state) = layer.parse::<usize>().ok().and_then(|layer| self.layers.get(layer)) else { return };
        let seen = state.load(Ordering::Relaxed);
        let add = match base {
            "ffn_moe_up" | "ffn_moe_gate" => 0,
            "ffn_moe_swiglu" => SAW_SWIGLU,
            "ffn_moe_down" => SAW_DOWN,
            // The router's weights applied before the down matmul (llama4's weights before the
            // FFN) are not what the CPU computes.
            "ffn_moe_weighted" if seen & SAW_DOWN == 0 => NOT_PLAIN,
            "ffn_moe_out" if seen & (SAW_SWIGLU | SAW_DOWN) == SAW_SWIGLU | SAW_DOWN => PLAIN,
            _ if EXPERT_PARTS.iter().any(|part| base.starts_with(part)) => NOT_PLAIN,
            _ => 0,
        };
        if add != 0 {
            state.fetch_or(add, Ordering::Relaxed);
        }
    }
}

/// Prefixes of the nodes that compute routed experts; any of them but the plain four
/// (`PlainCheck::watch`) is a bias, scale, clamp, fused gate and up, or another activation.
const EXPERT_PARTS: [&str; 9] = [
    "ffn_moe_up",
    "ffn_moe_gate",
    "ffn_moe_down",
    "ffn_moe_silu",
    "ffn_moe_swiglu",
    "ffn_moe_geglu",
    "ffn_moe_reglu",
    "ffn_moe_relu",
    "ffn_moe_gelu",
];

/// One layer's CPU share: the FFN's input rows, and per pick its token, expert and weight.
pub struct CpuJob {
    pub layer: usize,
    pub x: Vec<Vec<f32>>,
    pub picks: Vec<(usize, usize, f32)>,
}

/// What the worker computed: the sums per token, the time from the job's handing over to its
/// last pick computed, and within it the last lane's start (the hand-over's latency) and the
/// longest wait of a lane for its picks' reads.
pub struct CpuDone {
    pub sums: Vec<Vec<f32>>,
    pub seconds: f64,
    pub start_seconds: f64,
    pub read_wait_seconds: f64,
}

/// One lane's share of a job: some of its picks, each over a part of the FFN's width, over
/// the job's input rows.
struct Part {
    layer: usize,
    x: Arc<Vec<Vec<f32>>>,
    picks: Vec<(usize, usize, f32, Range<usize>)>,
}

/// A lane's sums for its part, when it started and finished, and how long it waited for reads.
type PartDone = Result<LaneDone, ResidencyError>;

struct LaneDone {
    sums: Vec<Vec<f32>>,
    started: Instant,
    finished: Instant,
    read_wait: Duration,
}

/// A job handed over and not yet taken: how many lanes compute it, its shape and when.
struct Pending {
    parts: usize,
    rows: usize,
    width: usize,
    handed: Instant,
}

/// The threads that compute split layers' CPU shares, one layer at a time: lanes of one thread
/// each, with a CPU backend of their own. A layer's picks are cut into parts of the FFN's width
/// (whole blocks), about one a lane, and each lane computes its parts alone, so one descheduled
/// thread delays its own parts only: a CPU backend of many threads waits at every node for all
/// of them, and beside the device's synchronisation and the reads it ran over 50 times slower
/// than its cores.
pub struct SplitWorker {
    layers: Arc<Vec<Option<SplitLayer>>>,
    lanes: Vec<mpsc::Sender<Part>>,
    done: Mutex<mpsc::Receiver<PartDone>>,
    pending: Mutex<Option<Pending>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl SplitWorker {
    /// A worker computing on `threads` lanes, reading experts from `residency`'s region (units
    /// numbered by `numbering`): each lane waits for its picks' reads; the caller has requested
    /// them and keeps them unevicted until the job's result is taken.
    pub fn start(
        residency: Arc<Residency>,
        numbering: ExpertUnits,
        layers: Arc<Vec<Option<SplitLayer>>>,
        threads: usize,
    ) -> Result<SplitWorker, ResidencyError> {
        let (outbox, done) = mpsc::channel();
        let mut worker = SplitWorker {
            layers: layers.clone(),
            lanes: Vec::new(),
            done: Mutex::new(done),
            pending: Mutex::new(None),
            threads: Vec::new(),
        };
        for lane in 0..threads.max(1) {
            let mut cpu = CpuExperts::new(1).map_err(|error| ResidencyError::Pool(error.to_string()))?;
            let (jobs, inbox) = mpsc::channel::<Part>();
            let (residency, layers, outbox) = (residency.clone(), layers.clone(), outbox.clone());
            let thread = std::thread::Builder::new()
                .name(format!("hypura-split-{lane}"))
                .spawn(move || {
                    for part in inbox {
                        let started = Instant::now();
                        let result = compute(&mut cpu, &residency, numbering, &layers, &part)
                            .map(|(sums, read_wait)| LaneDone { sums, started, finished: Instant::now(), read_wait });
                        if outbox.send(result).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|error| ResidencyError::Pool(format!("the split's CPU thread: {error}")))?;
            worker.lanes.push(jobs);
            worker.threads.push(thread);
        }
        Ok(worker)
    }

    /// Hand `job` over: its picks cut into parts of the FFN's width, about one a lane, and the
    /// parts dealt to the lanes.
    pub fn submit(&self, job: CpuJob) -> Result<(), ResidencyError> {
        let gone = || ResidencyError::Pool("the split's CPU thread has stopped".into());
        let mut pending = self.pending.locked();
        if pending.is_some() {
            return Err(ResidencyError::Pool(format!("layer {}'s CPU share: the last one was not taken", job.layer)));
        }
        let shape = self.layers.get(job.layer).copied().flatten().map(|layer| layer.shape);
        let shape = shape.ok_or_else(|| ResidencyError::Pool(format!("layer {} does not split", job.layer)))?;
        let ff = shape.parts(self.lanes.len().div_ceil(job.picks.len().max(1)));
        let items: Vec<_> = job
            .picks
            .iter()
            .flat_map(|&(token, expert, weight)| ff.iter().map(move |part| (token, expert, weight, part.clone())))
            .collect();
        let parts = items.len().min(self.lanes.len());
        let (rows, width) = (job.x.len(), job.x.first().map_or(0, Vec::len));
        let x = Arc::new(job.x);
        let mut dealt: Vec<Vec<_>> = vec![Vec::new(); parts];
        for (index, item) in items.into_iter().enumerate() {
            dealt[index % parts].push(item);
        }
        let handed = Instant::now();
        for (lane, picks) in self.lanes.iter().zip(dealt) {
            lane.send(Part { layer: job.layer, x: x.clone(), picks }).map_err(|_| gone())?;
        }
        *pending = Some(Pending { parts, rows, width, handed });
        Ok(())
    }

    /// The result of the job handed over last (waiting for every lane of it).
    pub fn take(&self) -> Result<CpuDone, ResidencyError> {
        let Pending { parts, rows, width, handed } =
            self.pending.locked().take().ok_or_else(|| {
                ResidencyError::Pool("the split's CPU share was taken before it was handed over".into())
            })?;
        let mut sums = vec![vec![0f32; width]; rows];
        let (mut finished, mut started, mut read_wait, mut failed) = (handed, handed, Duration::ZERO, None);
        let done = self.done.locked();
        for _ in 0..parts {
            match done.recv().map_err(|_| ResidencyError::Pool("the split's CPU thread has stopped".into()))? {
                Ok(lane) => {
                    finished = finished.max(lane.finished);
                    started = started.max(lane.started);
                    read_wait = read_wait.max(lane.read_wait);
                    for (sum, row) in sums.iter_mut().zip(lane.sums) {
                        for (value, add) in sum.iter_mut().zip(row) {
                            *value += add;
                        }
                    }
                }
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(CpuDone {
                sums,
                seconds: (finished - handed).as_secs_f64(),
                start_seconds: (started - handed).as_secs_f64(),
                read_wait_seconds: read_wait.as_secs_f64(),
            }),
        }
    }
}

impl Drop for SplitWorker {
    fn drop(&mut self) {
        self.lanes.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A part's sums: each pick's expert from the region, through the lane's CPU backend, once
/// it is ready there (a host cache miss is read while the device computes the slots' picks);
/// and the time waited for that.
fn compute(
    cpu: &mut CpuExperts,
    residency: &Residency,
    numbering: ExpertUnits,
    layers: &[Option<SplitLayer>],
    part: &Part,
) -> Result<(Vec<Vec<f32>>, Duration), ResidencyError> {
    let split = layers
        .get(part.layer)
        .copied()
        .flatten()
        .ok_or_else(|| ResidencyError::Pool(format!("layer {} does not split", part.layer)))?;
    let waiting = Instant::now();
    for &(_, expert, _, _) in &part.picks {
        residency.wait_ready_quietly(numbering.unit(part.layer, expert))?;
    }
    let read_wait = waiting.elapsed();
    let region = residency.region();
    let host: Vec<HostExpert<'_>> = part
        .picks
        .iter()
        .map(|(token, expert, weight, ff)| {
            let [gate, up, down] = split.ranges(*expert).map(|range| region.bytes(range));
            HostExpert { gate, up, down, token: *token, weight: *weight, ff: ff.clone() }
        })
        .collect();
    let sums = cpu
        .compute(&split.shape, &part.x, &host)
        .map_err(|error| ResidencyError::Pool(format!("layer {}'s experts on the CPU: {error}", part.layer)))?;
    Ok((sums, read_wait))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(check: &PlainCheck, names: &[&str]) {
        for name in names {
            check.watch(name);
        }
    }

    /// A layer splits once its graph showed separate gate and up matmuls, SwiGLU, down and the
    /// weights after it, up to its `ffn_moe_out`; a bias, a fused gate and up, another
    /// activation or the weights before the FFN keep it from splitting for good.
    #[test]
    fn only_plain_swiglu_experts_split() {
        let plain = ["ffn_moe_up-1", "ffn_moe_gate-1", "ffn_moe_swiglu-1", "ffn_moe_down-1", "ffn_moe_weighted-1"];
        let check = PlainCheck::new(4);
        walk(&check, &plain);
        assert!(!check.plain(1), "not before the layer's sum");
        walk(&check, &["ffn_moe_out-1"]);
        assert!(check.plain(1) && !check.plain(0) && !check.plain(9));

        let cases: [(&str, &[&str]); 4] = [
            (
                "gpt-oss: fused gate and up, biases",
                &["ffn_moe_gate_up-2", "ffn_moe_gate_up_biased-2", "ffn_moe_swiglu_oai-2"],
            ),
            ("a clamp", &["ffn_moe_up-2", "ffn_moe_up_clamped-2", "ffn_moe_silu-2", "ffn_moe_down-2"]),
            (
                "llama4: weights before the FFN",
                &["ffn_moe_weighted-2", "ffn_moe_up-2", "ffn_moe_swiglu-2", "ffn_moe_down-2"],
            ),
            ("a down bias", &["ffn_moe_up-2", "ffn_moe_swiglu-2", "ffn_moe_down-2", "ffn_moe_down_biased-2"]),
        ];
        for (case, names) in cases {
            let check = PlainCheck::new(4);
            walk(&check, names);
            walk(&check, &plain.map(|name| name.replace("-1", "-2")).iter().map(String::as_str).collect::<Vec<_>>());
            walk(&check, &["ffn_moe_out-2"]);
            assert!(!check.plain(2), "{case}");
        }
        // The router's own nodes are not the experts'.
        let check = PlainCheck::new(2);
        walk(&check, &["ffn_moe_logits-0", "ffn_moe_probs-0", "ffn_moe_weights_scaled-0", "ffn_moe_logits_biased-0"]);
        walk(&check, &plain.map(|name| name.replace("-1", "-0")).iter().map(String::as_str).collect::<Vec<_>>());
        walk(&check, &["ffn_moe_out-0"]);
        assert!(check.plain(0));
    }
}
