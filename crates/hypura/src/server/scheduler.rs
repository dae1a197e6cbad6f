//! The scheduler: the registry of loaded models, each with its worker thread (`worker.rs`), a
//! bounded queue in front of it, and `keep_alive`.
//!
//! A model loads on its first request, on its own thread, which then owns the engine and one
//! `Batcher`; requests reach it through a channel as `Job`s.
//!
//! Every accepted request holds a `Lease` until its last event is sent: the lease counts the
//! request against the queue bound (503 beyond it) and, when the model's last lease ends,
//! starts the `keep_alive` clock. `keep_alive: 0` unloads at once; a reaper unloads the rest when
//! their time is up. Unloading closes the channel: the thread finishes what it holds, then drops
//! the engine.
//!
//! A request whose `num_ctx` is longer than the loaded context reloads the model with it, as
//! Ollama does: the loaded worker is retired (it finishes the requests it holds) and a new one
//! plans and loads with the longer context once the old one has dropped its engine (one load
//! gate per file, so two copies never share the budget). A shorter `num_ctx` is served by the
//! loaded context, capped per request.
//!
//! A stop (`drain`) refuses new leases with 503 while the running ones finish; `cancel_all`
//! sets the cancel flag of every generation still running (each registered by `track`), so a
//! bounded stop ends them within a token.
use crate::sync::Lock;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::oneshot;

use super::catalog::ModelEntry;
use super::error::AppError;
use super::wire::KeepAlive;
use super::worker::{EmbedJob, GenerateJob, Job, Work, Worker};
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

struct Usage {
    keep_alive: KeepAlive,
    /// When the last lease ended; None while a request holds the model.
    idle_since: Option<Instant>,
}

/// A model with its worker thread.
pub struct LoadedModel {
    pub entry: ModelEntry,
    /// The context each sequence was asked to have (None: the configured default).
    context: Option<u32>,
    sender: Mutex<Option<Sender<Job>>>,
    pending: AtomicUsize,
    usage: Mutex<Usage>,
    status: Mutex<Status>,
    /// The RPC workers its plan uses (set by its thread before the load).
    remote: Mutex<Option<Arc<crate::remote::Workers>>>,
}

impl LoadedModel {
    /// Its load failed, or a worker of its plan stopped answering. The second is seen here
    /// as soon as the relay records it, which is before the request that met it is told:
    /// the model's thread marks itself failed only after that batch, and a request sent at
    /// once would reach the thread that is about to fail everything it holds.
    fn failed(&self) -> bool {
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
    fn too_short_for(&self, n_ctx: u32) -> bool {
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

/// A request's hold on a model. Dropping it ends the request (see the module documentation).
pub struct Lease {
    model: Arc<LoadedModel>,
    scheduler: Weak<Inner>,
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
        if let (true, Some(scheduler)) = (unload_now, self.scheduler.upgrade()) {
            scheduler.unload_if_idle(&self.model.entry.path, Duration::ZERO);
        }
    }
}

struct Inner {
    config: SchedulerConfig,
    models: Mutex<HashMap<PathBuf, Arc<LoadedModel>>>,
    /// One per file: a worker holds its file's gate from before it loads until its engine is
    /// gone, so a reload waits for the copy it replaces.
    gates: Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>,
    parked: super::worker::ParkedPrefixes,
    /// Set when the server stops: no new lease is given.
    draining: AtomicBool,
    /// The cancel flags of generations started and not yet dropped.
    running: Mutex<Vec<Weak<AtomicBool>>>,
}

impl Inner {
    /// Unload the model at `path` if no request holds it and it has been idle for `idle`.
    fn unload_if_idle(&self, path: &Path, idle: Duration) -> bool {
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

/// Shared by every handler.
#[derive(Clone)]
pub struct Scheduler {
    inner: Arc<Inner>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        Scheduler {
            inner: Arc::new(Inner {
                config,
                models: Mutex::new(HashMap::new()),
                gates: Mutex::new(HashMap::new()),
                parked: Default::default(),
                draining: AtomicBool::new(false),
                running: Mutex::new(Vec::new()),
            }),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.inner.config
    }

    /// Take a lease on a model, starting its worker (and so its load) if it is not loaded, or
    /// if it is loaded with a context shorter than `n_ctx` (a request's `num_ctx`).
    /// 503 when the model already has `n_parallel + max_queue` requests.
    pub fn acquire(&self, entry: &ModelEntry, keep_alive: Option<KeepAlive>) -> Result<Lease, AppError> {
        self.acquire_with_context(entry, keep_alive, None)
    }

    pub fn acquire_with_context(
        &self,
        entry: &ModelEntry,
        keep_alive: Option<KeepAlive>,
        n_ctx: Option<u32>,
    ) -> Result<Lease, AppError> {
        let config = &self.inner.config;
        if self.draining() {
            return Err(AppError::shutting_down());
        }
        let mut models = self.inner.models.locked();
        if let Some(n_ctx) = n_ctx {
            if models.get(&entry.path).is_some_and(|model| model.too_short_for(n_ctx)) {
                let retired = models.remove(&entry.path).expect("looked up above");
                // Its worker finishes what it holds, then drops its engine and the gate.
                retired.sender.locked().take();
                tracing::info!("reloading {} with a context of {n_ctx} tokens (num_ctx)", entry.name);
            }
        }
        // A model whose load failed, or whose remote worker stopped answering, is forgotten, so
        // that the next request tries again (planned with the workers that answer).
        if models.get(&entry.path).is_some_and(|model| model.failed()) {
            if let Some(model) = models.remove(&entry.path) {
                model.sender.locked().take();
            }
        }
        let model = match models.get(&entry.path) {
            Some(model) => model.clone(),
            None => {
                let model = self.start_worker(entry, n_ctx)?;
                models.insert(entry.path.clone(), model.clone());
                model
            }
        };
        let limit = config.n_parallel as usize + config.max_queue;
        if model.pending.load(Ordering::Acquire) >= limit {
            return Err(AppError::busy());
        }
        model.pending.fetch_add(1, Ordering::AcqRel);
        {
            let mut usage = model.usage.locked();
            usage.idle_since = None;
            usage.keep_alive = keep_alive.unwrap_or(config.default_keep_alive);
        }
        Ok(Lease { model, scheduler: Arc::downgrade(&self.inner) })
    }

    fn start_worker(&self, entry: &ModelEntry, n_ctx: Option<u32>) -> Result<Arc<LoadedModel>, AppError> {
        let (sender, receiver) = std::sync::mpsc::channel();
        let gate = self.inner.gates.locked().entry(entry.path.clone()).or_default().clone();
        let model = Arc::new(LoadedModel {
            entry: entry.clone(),
            context: n_ctx,
            sender: Mutex::new(Some(sender)),
            pending: AtomicUsize::new(0),
            usage: Mutex::new(Usage {
                keep_alive: self.inner.config.default_keep_alive,
                idle_since: Some(Instant::now()),
            }),
            status: Mutex::new(Status::Loading),
            remote: Mutex::new(None),
        });
        let mut config = self.inner.config.clone();
        // The plan caps a longer context at the trained one.
        if n_ctx.is_some() {
            config.run.n_ctx_seq = n_ctx;
        }
        let worker = Worker {
            model: Arc::downgrade(&model),
            path: entry.path.clone(),
            config,
            gate,
            parked: self.inner.parked.clone(),
        };
        worker
            .spawn(&entry.name, receiver)
            .map_err(|error| AppError::internal(format!("starting the model thread: {error}")))?;
        Ok(model)
    }

    /// The context a model not yet loaded would get by default (chosen from the budget).
    pub fn default_context(&self, path: &Path) -> Option<u32> {
        let mut run = RunSpec { n_sequences: self.inner.config.n_parallel, ..self.inner.config.run.clone() };
        // The workers as they are now (never a relay of a set that lost a worker).
        run.remote = run.remote.and_then(|workers| workers.current().0);
        let inventory = crate::model::Inventory::open(path).ok()?;
        let facts = crate::setup::machine_facts(&run, path).ok()?;
        Some(crate::plan::context_for(&inventory, &facts, &run.ask()))
    }

    /// Models that are loaded (or loading), most recently expiring first.
    pub fn loaded(&self) -> Vec<Arc<LoadedModel>> {
        let models = self.inner.models.locked();
        let mut loaded: Vec<Arc<LoadedModel>> =
            models.values().filter(|model| model.info().is_some()).cloned().collect();
        loaded.sort_by_key(|model| {
            std::cmp::Reverse(
                model.expires_at().unwrap_or(SystemTime::UNIX_EPOCH + Duration::from_secs(u32::MAX as u64 * 4)),
            )
        });
        loaded
    }

    /// Unload a model now if no request holds it (`keep_alive: 0` with an empty prompt).
    pub fn unload(&self, path: &Path) -> bool {
        self.inner.unload_if_idle(path, Duration::ZERO)
    }

    /// Unload every model whose `keep_alive` has lapsed. Called periodically.
    pub fn reap(&self) {
        let expired: Vec<(PathBuf, Duration)> = {
            let models = self.inner.models.locked();
            models
                .values()
                .filter_map(|model| match model.usage.locked().keep_alive {
                    KeepAlive::For(duration) => Some((model.entry.path.clone(), duration)),
                    KeepAlive::Forever => None,
                })
                .collect()
        };
        for (path, keep_alive) in expired {
            self.inner.unload_if_idle(&path, keep_alive);
        }
    }

    /// Refuse new requests from now on (503): the server is stopping.
    pub fn drain(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    pub fn draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Whether a model is loading now (`/health` answers 503 meanwhile).
    pub fn loading(&self) -> bool {
        self.inner.models.locked().values().any(|model| matches!(*model.status.locked(), Status::Loading))
    }

    /// Requests holding any model: generating, embedding or queued.
    pub fn active_requests(&self) -> usize {
        self.inner.models.locked().values().map(|model| model.active_requests()).sum()
    }

    /// Keep a generation's cancel flag, for `cancel_all`.
    pub fn track(&self, cancel: &Arc<AtomicBool>) {
        let mut running = self.inner.running.locked();
        running.retain(|flag| flag.strong_count() > 0);
        running.push(Arc::downgrade(cancel));
    }

    /// Cancel every generation still running (a stop whose bound has passed); returns how many.
    pub fn cancel_all(&self) -> usize {
        let running = std::mem::take(&mut *self.inner.running.locked());
        running.iter().filter_map(Weak::upgrade).filter(|flag| !flag.swap(true, Ordering::Relaxed)).count()
    }

    /// Unload everything idle (shutdown).
    pub fn unload_all(&self) {
        let paths: Vec<PathBuf> = self.inner.models.locked().keys().cloned().collect();
        for path in paths {
            self.inner.unload_if_idle(&path, Duration::ZERO);
        }
    }

    /// Wait, at most `limit`, until every worker has dropped its engine: a worker holds its
    /// file's gate until then, and its prompt cache finishes its writes as it drops. Returns
    /// whether they all did.
    pub fn wait_unloaded(&self, limit: Duration) -> bool {
        let gates: Vec<Arc<Mutex<()>>> = self.inner.gates.locked().values().cloned().collect();
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for gate in &gates {
                drop(gate.locked());
            }
            let _ = done.send(());
        });
        finished.recv_timeout(limit).is_ok()
    }
}
