//! The scheduler: the registry of loaded models (its types in `model.rs`), each with its worker
//! thread (`worker.rs`), a bounded queue in front of it, and `keep_alive`.
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
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use super::catalog::ModelEntry;
use super::error::AppError;
use super::model::{Lease, LoadedModel, Registry, SchedulerConfig, Status, Usage};
use super::wire::KeepAlive;
use super::worker::{ParkedPrefixes, Worker};

struct Inner {
    config: SchedulerConfig,
    /// The models loaded (or loading); a lease reaches it weakly, to unload with `keep_alive: 0`.
    registry: Arc<Registry>,
    /// One per file: a worker holds its file's gate from before it loads until its engine is
    /// gone, so a reload waits for the copy it replaces.
    gates: Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>,
    parked: ParkedPrefixes,
    /// Set when the server stops: no new lease is given.
    draining: AtomicBool,
    /// The cancel flags of generations started and not yet dropped.
    running: Mutex<Vec<Weak<AtomicBool>>>,
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
                registry: Default::default(),
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
        let mut models = self.inner.registry.models.locked();
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
        Ok(Lease { model, registry: Arc::downgrade(&self.inner.registry) })
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

    /// The context a model not yet loaded would get by default (`setup::context`: chosen from
    /// the budget).
    pub fn default_context(&self, path: &Path) -> Option<u32> {
        let mut run = self.inner.config.run_spec();
        // The workers as they are now (never a relay of a set that lost a worker).
        run.remote = run.remote.and_then(|workers| workers.current().0);
        crate::setup::context(path, &run).ok()
    }

    /// Models that are loaded (or loading), most recently expiring first.
    pub fn loaded(&self) -> Vec<Arc<LoadedModel>> {
        let models = self.inner.registry.models.locked();
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
        self.inner.registry.unload_if_idle(path, Duration::ZERO)
    }

    /// Unload every model whose `keep_alive` has lapsed. Called periodically.
    pub fn reap(&self) {
        let expired: Vec<(PathBuf, Duration)> = {
            let models = self.inner.registry.models.locked();
            models
                .values()
                .filter_map(|model| match model.usage.locked().keep_alive {
                    KeepAlive::For(duration) => Some((model.entry.path.clone(), duration)),
                    KeepAlive::Forever => None,
                })
                .collect()
        };
        for (path, keep_alive) in expired {
            self.inner.registry.unload_if_idle(&path, keep_alive);
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
        self.inner.registry.models.locked().values().any(|model| matches!(*model.status.locked(), Status::Loading))
    }

    /// Requests holding any model: generating, embedding or queued.
    pub fn active_requests(&self) -> usize {
        self.inner.registry.models.locked().values().map(|model| model.active_requests()).sum()
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
        let paths: Vec<PathBuf> = self.inner.registry.models.locked().keys().cloned().collect();
        for path in paths {
            self.inner.registry.unload_if_idle(&path, Duration::ZERO);
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
