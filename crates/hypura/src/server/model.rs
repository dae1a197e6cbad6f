//! The model registry's types, shared by the scheduler (`scheduler.rs`), which keeps the
//! registry and starts the workers, and the worker (`worker.rs`), which loads and serves one
//! model: the configuration, the `Registry` of `LoadedModel`s with what a worker reports of
//! its load (`Status`, `EngineInfo`), the `Job`s a worker is sent, and the `Lease` that holds
//! a model for one request. Both name this file; neither it nor the worker names the scheduler.
//!
//! A `Lease` sends its request to the model's worker (`generate`, `embed`, `load`). Dropping
//! it ends the request: the model's last lease starts its `keep_alive` clock, and with
//! `keep_alive: 0` unloads it at once.
use crate::sync::Lock;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, oneshot};

use super::catalog::ModelEntry;
use super::error::AppError;
use super::wire::KeepAlive;
use crate::engine::{Finished, GenerateRequest};
use crate::setup::RunSpec;

#[derive(Clone)]
pub struct SchedulerConfig {
    /// Sequences decoded together per model.
    pub n_parallel: u32,
    /// Requests that may wait beyond the running ones before the server answers 503.
    pub max_queue: usize,
    pub default_keep_alive: KeepAlive,
    /// How each model is planned and loaded (`n_sequences` is set from `n_parallel`).
    pub run: RunSpec,
    /// Longest embedding input in tokens (every token of an input is decoded in one batch, and
    /// a generative model's logits for all of them are kept).
    pub embedding_context: u32,
}

impl SchedulerConfig {
    /// The spec each model is planned with: `run`, with a sequence per parallel request.
    pub(super) fn run_spec(&self) -> RunSpec {
        RunSpec { n_sequences: self.n_parallel, ..self.run.clone() }
    }
}

/// What a loaded model reports in `/api/ps`.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub size_bytes: u64,
    pub vram_bytes: u64,
    pub context_length: usize,
    /// The context the model was trained for (0: the file does not say).
    pub trained_context: u64,
    pub mode: &'static str,
    /// Streaming I/O counters (streaming modes).
    pub io: Option<Arc<crate::store::IoStats>>,
    /// The expert hierarchy's counters (expert-stream).
    pub experts: Option<Arc<crate::store::ExpertStream>>,
}

#[derive(Clone, Debug)]
pub(super) enum Status {
    Loading,
    Ready(EngineInfo),
    Failed,
}

/// A generation for a worker: the request as the handler made it, and where its events go.
pub struct GenerateJob {
    pub request: GenerateRequest,
    pub events: mpsc::UnboundedSender<Event>,
}

/// What a generation sends back.
#[derive(Debug)]
pub enum Event {
    /// The request was admitted (its prompt rendered and tokenized, within the context): the
    /// handler may answer now, before any text, and later failures end its stream.
    Started,
    /// Answer text (a conversation's content).
    Text(String),
    /// Reasoning, kept apart from the content.
    Thinking(String),
    Done(Box<Finished>),
    Failed(AppError),
}

pub struct EmbedJob {
    pub inputs: Vec<String>,
    /// Cut inputs to the embedding context instead of failing.
    pub truncate: bool,
    pub reply: oneshot::Sender<Result<EmbedOutput, AppError>>,
}

#[derive(Clone, Debug)]
pub struct EmbedOutput {
    /// One pooled vector per input, not normalised.
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: usize,
    pub load_duration: Duration,
}

pub(super) enum Work {
    Generate(Box<GenerateJob>),
    Embed(EmbedJob),
    /// Reply once the model is loaded (an empty prompt only loads).
    Load(oneshot::Sender<Result<Duration, AppError>>),
}

/// One request on its way to the worker, with the lease that holds the model for it.
pub(super) struct Job {
    pub work: Work,
    pub received: Instant,
    pub lease: Lease,
}

pub(super) struct Usage {
    pub(super) keep_alive: KeepAlive,
    /// When the last lease ended; None while a request holds the model.
    pub(super) idle_since: Option<Instant>,
}

/// A model with its worker thread.
pub struct LoadedModel {
    pub entry: ModelEntry,
    /// The context each sequence was asked to have (None: the configured default).
    pub(super) context: Option<u32>,
    pub(super) sender: Mutex<Option<Sender<Job>>>,
    pub(super) pending: AtomicUsize,
    pub(super) usage: Mutex<Usage>,
    pub(super) status: Mutex<Status>,
    /// The RPC workers its plan uses (set by its thread before the load).
    pub(super) remote: Mutex<Option<Arc<crate::remote::Workers>>>,
}

impl LoadedModel {
    /// Its load failed, or a worker of its plan stopped answering. The second is seen here
    /// as soon as the relay records it, which is before the request that met it is told:
    /// the model's thread marks itself failed only after that batch, and a request sent at
    /// once would reach the thread that is about to fail everything it holds.
    pub(super) fn failed(&self) -> bool {
        matches!(*self.status.locked(), Status::Failed)
            || self.remote.locked().as_ref().is_some_and(|workers| workers.check().is_err())
    }

    /// Set by the model's worker as its load goes.
    pub(super) fn set_status(&self, status: Status) {
        *self.status.locked() = status;
    }

    /// Set by the model's worker before it plans the load.
    pub(super) fn set_remote(&self, workers: Option<Arc<crate::remote::Workers>>) {
        *self.remote.locked() = workers;
    }

    /// Engine facts once loaded.
    pub fn info(&self) -> Option<EngineInfo> {
        match &*self.status.locked() {
            Status::Ready(info) => Some(info.clone()),
            _ => None,
        }
    }

    /// Whether a request for `n_ctx` tokens needs a reload: the model is loaded with a
    /// shorter context that could grow (below its training context), or is loading with a
    /// shorter one asked for. While it loads with the default, the request waits for it and the
    /// per-request limit applies.
    pub(super) fn too_short_for(&self, n_ctx: u32) -> bool {
        match &*self.status.locked() {
            Status::Ready(info) => {
                n_ctx as usize > info.context_length
                    && (info.trained_context == 0 || (info.context_length as u64) < info.trained_context)
            }
            _ => self.context.is_some_and(|asked| n_ctx > asked),
        }
    }

    /// Requests holding the model: generating, embedding or queued.
    pub fn active_requests(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// When `keep_alive` lapses: None for never; a busy model counts from now.
    pub fn expires_at(&self) -> Option<SystemTime> {
        let usage = self.usage.locked();
        match usage.keep_alive {
            KeepAlive::Forever => None,
            KeepAlive::For(duration) => {
                let idle_for = usage.idle_since.map(|since| since.elapsed()).unwrap_or_default();
                Some(SystemTime::now() + duration.saturating_sub(idle_for))
            }
        }
    }
}

/// The models loaded (or loading), by file.
#[derive(Default)]
pub(super) struct Registry {
    pub(super) models: Mutex<HashMap<PathBuf, Arc<LoadedModel>>>,
}

impl Registry {
    /// Unload the model at `path` if no request holds it and it has been idle for `idle`.
    pub(super) fn unload_if_idle(&self, path: &Path, idle: Duration) -> bool {
        let mut models = self.models.locked();
        let Some(model) = models.get(path) else { return false };
        let idle_enough = model.pending.load(Ordering::Acquire) == 0
            && model.usage.locked().idle_since.is_some_and(|since| since.elapsed() >= idle);
        if !idle_enough {
            return false;
        }
        let model = models.remove(path).expect("looked up above");
        // Closing the channel ends the worker, which drops the engine.
        model.sender.locked().take();
        tracing::info!("unloaded {}", model.entry.name);
        true
    }
}

/// A request's hold on a model. Dropping it ends the request (see the module documentation).
pub struct Lease {
    pub(super) model: Arc<LoadedModel>,
    pub(super) registry: Weak<Registry>,
}

impl Lease {
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    fn submit(self, work: Work) -> Result<(), AppError> {
        let sender = self.model.sender.locked().clone();
        let sender = sender.ok_or_else(|| {
            AppError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, "the model is unloading; try again")
        })?;
        sender
            .send(Job { work, received: Instant::now(), lease: self })
            .map_err(|_| AppError::internal("the model's worker has stopped"))
    }

    pub fn generate(self, job: GenerateJob) -> Result<(), AppError> {
        self.submit(Work::Generate(Box::new(job)))
    }

    pub fn embed(self, job: EmbedJob) -> Result<(), AppError> {
        self.submit(Work::Embed(job))
    }

    /// Load the model (if it is not yet) and answer how long that took.
    pub async fn load(self) -> Result<Duration, AppError> {
        let (reply, answer) = oneshot::channel();
        self.submit(Work::Load(reply))?;
        answer.await.map_err(|_| AppError::internal("the model's worker stopped while loading"))?
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.model.pending.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let unload_now = {
            let mut usage = self.model.usage.locked();
            usage.idle_since = Some(Instant::now());
            usage.keep_alive == KeepAlive::For(Duration::ZERO)
        };
        if let (true, Some(registry)) = (unload_now, self.registry.upgrade()) {
            registry.unload_if_idle(&self.model.entry.path, Duration::ZERO);
        }
    }
}
