//! Statistics of one generation: Ollama's timings, and for streaming modes the bytes read,
//! the stall, and the expert cache's hits. `run --stats`, `bench` and the server's timings
//! all read these numbers.
use std::time::Duration;

use crate::store::{ExpertSnapshot, IoSnapshot};

use super::Engine;

/// Ollama's statistics, as durations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationStats {
    pub load_duration: Duration,
    /// Tokens actually evaluated for the prompt (a reused prefix is not counted).
    pub prompt_eval_count: u32,
    pub prompt_eval_duration: Duration,
    pub eval_count: u32,
    /// Generated tokens decoded (passes over the weights after the prompt): an answer that
    /// ends on its last sampled token (max tokens, a stop string, a full context) never
    /// decodes that token; one that ends on end-of-generation decoded every counted token.
    pub eval_decodes: u32,
    pub eval_duration: Duration,
    pub total_duration: Duration,
    /// Prompt tokens whose KV entries were reused from an earlier request.
    pub reused_prompt_tokens: u32,
    /// Streaming I/O during this request (streaming modes only). Sequences decoded together
    /// share their reads, so each one counts every read made while it was active.
    pub io: Option<IoSnapshot>,
    /// Expert cache hits and misses during this request (expert-stream only), shared as `io`.
    pub experts: Option<ExpertSnapshot>,
    /// Time the generation phase (after the prompt) waited on streamed reads.
    pub eval_stall: Duration,
    /// Speculative decoding: tokens drafted, and how many of them the target accepted.
    pub draft_tokens: u32,
    pub draft_accepted: u32,
}

impl GenerationStats {
    pub fn prompt_tokens_per_sec(&self) -> f64 {
        rate(self.prompt_eval_count, self.prompt_eval_duration)
    }

    /// Ollama's rate: generated tokens over the generation time.
    pub fn eval_tokens_per_sec(&self) -> f64 {
        rate(self.eval_count, self.eval_duration)
    }

    /// Decoded tokens over the generation time: what llama.cpp's `tg` measures.
    pub fn decode_tokens_per_sec(&self) -> f64 {
        rate(self.eval_decodes, self.eval_duration)
    }

    /// Passes over the weights this request made: the prompt's (counted once) and each decode.
    pub fn weight_passes(&self) -> u32 {
        u32::from(self.prompt_eval_count > 0) + self.eval_decodes
    }

    /// Share of the drafted tokens the target accepted; None without a draft.
    pub fn draft_acceptance(&self) -> Option<f64> {
        (self.draft_tokens > 0).then(|| f64::from(self.draft_accepted) / f64::from(self.draft_tokens))
    }

    /// Generated tokens per decode (pass over the weights) after the prompt: 1 without
    /// speculation, more where drafts were accepted. None without a decode.
    pub fn tokens_per_pass(&self) -> Option<f64> {
        (self.eval_decodes > 0).then(|| f64::from(self.eval_count) / f64::from(self.eval_decodes))
    }

    /// Generation time per decoded token that was not spent waiting on reads: the compute term
    /// of the physical limit. None without a decode.
    pub fn eval_compute_seconds_per_token(&self) -> Option<f64> {
        (self.eval_decodes > 0).then(|| self.eval_duration.saturating_sub(self.eval_stall).as_secs_f64() / f64::from(self.eval_decodes))
    }
}

fn rate(count: u32, duration: Duration) -> f64 {
    if duration.is_zero() {
        0.0
    } else {
        f64::from(count) / duration.as_secs_f64()
    }
}

/// The engine's streaming counters at one moment, to subtract from a later reading.
#[derive(Clone, Debug, Default)]
pub(super) struct Counters {
    io: Option<IoSnapshot>,
    experts: Option<ExpertSnapshot>,
}

impl Counters {
    pub(super) fn read(engine: &Engine) -> Counters {
        let Some(streaming) = engine.streaming() else { return Counters::default() };
        Counters { io: Some(streaming.stats.snapshot()), experts: streaming.driver.experts().map(|experts| experts.snapshot()) }
    }

    /// Seconds spent waiting on reads so far (0 without streaming).
    pub(super) fn stall_seconds(&self) -> f64 {
        self.io.map_or(0.0, |io| io.stall_seconds)
    }

    /// What happened since `self`: fills `stats.io` and `stats.experts`.
    pub(super) fn fill_since(&self, engine: &Engine, stats: &mut GenerationStats) {
        let now = Counters::read(engine);
        if let (Some(before), Some(after)) = (self.io, now.io) {
            stats.io = Some(after - before);
        }
        if let (Some(before), Some(after)) = (self.experts.clone(), now.experts) {
            stats.experts = Some(after - before);
        }
    }
}
