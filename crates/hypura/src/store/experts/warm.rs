//! The host cache's warm fill beside a device pool (`WarmFill`).
use super::{ExpertStream, ExpertUnits, ResidencyError, UnitState};
use crate::sync::Lock;

/// The host cache's warm fill: beside a device pool, each pick the slots miss and the host
/// cache does not hold is read from disk at its stop, at a queue depth of one. So the cache's
/// free room is filled with the experts the recorded routing picks most (then expert `e` of
/// every streamed layer before expert `e + 1`), each unit once, never evicting anything: at
/// load, all of it at once by every reader thread (`warm_now`, the pool starts warm); behind a
/// decode, room the cache gets back, at most `WARM_IN_FLIGHT` reads at once, queued behind
/// every read a computation asks for (`Residency::request_background`: the reader threads stay
/// free for the misses). A cold start's misses become host hits, computed by the
/// CPU or uploaded over the bus instead of read from disk.
#[derive(Default)]
pub(super) struct WarmFill {
    /// Units to fill first, the recorded routing's most picked first (`with_warm_order`).
    pub(super) order: Vec<usize>,
    /// The next candidate: `order`'s, then every unit in fill order (`position / n_layer` is the
    /// expert, `% n_layer` the layer); the fill is done when it reaches the end of both.
    pub(super) next: usize,
    pub(super) in_flight: Vec<usize>,
    pub(super) issued: u64,
    /// The bytes of the units issued.
    pub(super) bytes: u64,
}

/// Warm-fill reads in flight at once.
pub(super) const WARM_IN_FLIGHT: usize = 2;

impl ExpertStream {
    /// Fill the host cache's free room beside the pool with these units first (the recorded
    /// routing's most picked, after those the slots took), then in the usual order.
    pub fn with_warm_order(self, order: Vec<usize>) -> ExpertStream {
        if let Some(warm) = &self.warm {
            warm.locked().order = order;
        }
        self
    }

    /// Fill the host cache's free room now, before the first decode (the pool starts warm):
    /// every candidate `warm_step` would issue, read at once by all the reader threads, and
    /// waited for. Returns the units and bytes read; a later `warm_step` finds nothing to do
    /// until the cache has room again.
    pub fn warm_now(&self) -> Result<(u64, u64), ResidencyError> {
        let Some(warm) = &self.warm else { return Ok((0, 0)) };
        let (issued, bytes) = {
            let warm = warm.locked();
            (warm.issued, warm.bytes)
        };
        // Nothing else reads at load: asked for, not in the background (waiting for a unit
        // then finds nothing to move ahead).
        self.warm_issue(usize::MAX, false)?;
        let mut warm = warm.locked();
        // No compute waits at load: the fill's wait is not a stall.
        for unit in std::mem::take(&mut warm.in_flight) {
            self.residency.wait_ready_quietly(unit)?;
        }
        Ok((warm.issued - issued, warm.bytes - bytes))
    }

    /// Top up the warm fill (`WarmFill`) behind a decode, `WARM_IN_FLIGHT` reads at most.
    pub(super) fn warm_step(&self) -> Result<(), ResidencyError> {
        self.warm_issue(WARM_IN_FLIGHT, true)
    }

    /// Forget the warm reads that finished, then issue the next candidates that no slot holds
    /// and the cache does not, while there is free room and fewer than `in_flight` are reading;
    /// `background`: behind every read a computation asks for (a decode's).
    fn warm_issue(&self, in_flight: usize, background: bool) -> Result<(), ResidencyError> {
        let Some(warm) = &self.warm else { return Ok(()) };
        let mut warm = warm.locked();
        warm.in_flight.retain(|&unit| matches!(self.residency.state(unit), Some((UnitState::Loading, _))));
        let ExpertUnits { n_layer, n_expert } = self.numbering;
        while warm.in_flight.len() < in_flight && warm.next < warm.order.len() + n_layer * n_expert {
            let (expert, layer) = match warm.order.get(warm.next) {
                Some(&unit) => (unit % n_expert, unit / n_expert),
                None => {
                    let position = warm.next - warm.order.len();
                    (position / n_layer, position % n_layer)
                }
            };
            if !self.streams(layer) {
                warm.next += 1;
                continue;
            }
            if self.pool.as_ref().is_some_and(|pool| pool.locked().holds(layer, expert)) {
                warm.next += 1;
                continue;
            }
            let unit = self.numbering.unit(layer, expert);
            let mut state = self.state.locked();
            if state.cache.is_resident(unit) {
                warm.next += 1;
                continue;
            }
            if state.cache.is_full() {
                break;
            }
            let evicted = state.cache.admit(unit, &[]);
            debug_assert!(evicted.is_empty());
            drop(state);
            warm.next += 1;
            warm.issued += 1;
            warm.bytes += self.residency.units()[unit].bytes();
            if background {
                self.residency.request_background(unit)?;
            } else {
                self.residency.request(unit)?;
            }
            warm.in_flight.push(unit);
        }
        Ok(())
    }
}
