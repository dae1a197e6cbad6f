//! The scheduler: one worker thread per loaded model, a bounded queue in front of it, and
//! `keep_alive`.
//!
//! A model loads on its first request, on its own thread, which then owns the engine and one
//! `Batcher` (one llama.cpp context with `n_parallel` sequences). Requests reach it through a
//! channel; the thread admits them into free sequences and steps the batch, so concurrent
//! requests decode together. llama.cpp calls block, so they never run on the async runtime.
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
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, oneshot};

use super::catalog::ModelEntry;
use super::error::AppError;
use super::wire::KeepAlive;
use crate::engine::{prompt, Batcher, Control, Embedder, Engine, EngineError, Finished, GenerateRequest, Prompt, SamplerParams, SequenceEvent, Token};
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
}

#[derive(Clone, Debug)]
enum Status {
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
        matches!(*self.status.lock().unwrap_or_else(|poison| poison.into_inner()), Status::Failed)
            || self.remote.lock().unwrap_or_else(|poison| poison.into_inner()).as_ref().is_some_and(|workers| workers.check().is_err())
    }

    /// Engine facts once loaded.
    pub fn info(&self) -> Option<EngineInfo> {
        match &*self.status.lock().unwrap_or_else(|poison| poison.into_inner()) {
            Status::Ready(info) => Some(info.clone()),
            _ => None,
        }
    }

    /// Whether a request for `n_ctx` tokens needs a reload: the model is loaded with a
    /// shorter context that could grow (below its training context), or is loading with a
    /// shorter one asked for. While it loads with the default, the request waits for it and the
    /// per-request limit applies.
    fn too_short_for(&self, n_ctx: u32) -> bool {
        match &*self.status.lock().unwrap_or_else(|poison| poison.into_inner()) {
            Status::Ready(info) => n_ctx as usize > info.context_length && (info.trained_context == 0 || (info.context_length as u64) < info.trained_context),
            _ => self.context.is_some_and(|asked| n_ctx > asked),
        }
    }

    /// Requests holding the model: generating, embedding or queued.
    pub fn active_requests(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// When `keep_alive` lapses: None for never; a busy model counts from now.
    pub fn expires_at(&self) -> Option<SystemTime> {
        let usage = self.usage.lock().unwrap_or_else(|poison| poison.into_inner());
        match usage.keep_alive {
            KeepAlive::Forever => None,
            KeepAlive::For(duration) => {
                let idle_for = usage.idle_since.map(|since| since.elapsed()).unwrap_or_default();
                Some(SystemTime::now() + duration.saturating_sub(idle_for))
            }
        }
    }
}

/// A generation for a worker.
pub struct GenerateJob {
    /// Token ids to put before the prompt (Ollama's `context`).
    pub context: Vec<Token>,
    /// Text or a conversation; tokenizing needs the vocabulary, so it happens on the worker.
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    pub grammar: Option<String>,
    pub n_ctx: Option<u32>,
    pub ignore_eos: bool,
    pub cancel: Arc<AtomicBool>,
    pub events: mpsc::UnboundedSender<Event>,
}

/// What a generation sends back.
#[derive(Debug)]
pub enum Event {
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

enum Work {
    Generate(GenerateJob),
    Embed(EmbedJob),
    /// Reply once the model is loaded (an empty prompt only loads).
    Load(oneshot::Sender<Result<Duration, AppError>>),
}

struct Job {
    work: Work,
    received: Instant,
    lease: Lease,
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
        let sender = self.model.sender.lock().unwrap_or_else(|poison| poison.into_inner()).clone();
        let sender = sender.ok_or_else(|| AppError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, "the model is unloading; try again"))?;
        sender.send(Job { work, received: Instant::now(), lease: self }).map_err(|_| AppError::internal("the model's worker has stopped"))
    }

    pub fn generate(self, job: GenerateJob) -> Result<(), AppError> {
        self.submit(Work::Generate(job))
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
            let mut usage = self.model.usage.lock().unwrap_or_else(|poison| poison.into_inner());
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
}

impl Inner {
    /// Unload the model at `path` if no request holds it and it has been idle for `idle`.
    fn unload_if_idle(&self, path: &Path, idle: Duration) -> bool {
        let mut models = self.models.lock().unwrap_or_else(|poison| poison.into_inner());
        let Some(model) = models.get(path) else { return false };
        let idle_enough = model.pending.load(Ordering::Acquire) == 0 && model.usage.lock().unwrap_or_else(|poison| poison.into_inner()).idle_since.is_some_and(|since| since.elapsed() >= idle);
        if !idle_enough {
            return false;
        }
        let model = models.remove(path).expect("looked up above");
        // Closing the channel ends the worker, which drops the engine.
        model.sender.lock().unwrap_or_else(|poison| poison.into_inner()).take();
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
        Scheduler { inner: Arc::new(Inner { config, models: Mutex::new(HashMap::new()), gates: Mutex::new(HashMap::new()) }) }
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

    pub fn acquire_with_context(&self, entry: &ModelEntry, keep_alive: Option<KeepAlive>, n_ctx: Option<u32>) -> Result<Lease, AppError> {
        let config = &self.inner.config;
        let mut models = self.inner.models.lock().unwrap_or_else(|poison| poison.into_inner());
        if let Some(n_ctx) = n_ctx {
            if models.get(&entry.path).is_some_and(|model| model.too_short_for(n_ctx)) {
                let retired = models.remove(&entry.path).expect("looked up above");
                // Its worker finishes what it holds, then drops its engine and the gate.
                retired.sender.lock().unwrap_or_else(|poison| poison.into_inner()).take();
                tracing::info!("reloading {} with a context of {n_ctx} tokens (num_ctx)", entry.name);
            }
        }
        // A model whose load failed, or whose remote worker stopped answering, is forgotten, so
        // that the next request tries again (planned with the workers that answer).
        if models.get(&entry.path).is_some_and(|model| model.failed()) {
            if let Some(model) = models.remove(&entry.path) {
                model.sender.lock().unwrap_or_else(|poison| poison.into_inner()).take();
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
            let mut usage = model.usage.lock().unwrap_or_else(|poison| poison.into_inner());
            usage.idle_since = None;
            usage.keep_alive = keep_alive.unwrap_or(config.default_keep_alive);
        }
        Ok(Lease { model, scheduler: Arc::downgrade(&self.inner) })
    }

    fn start_worker(&self, entry: &ModelEntry, n_ctx: Option<u32>) -> Result<Arc<LoadedModel>, AppError> {
        let (sender, receiver) = std::sync::mpsc::channel();
        let gate = self.inner.gates.lock().unwrap_or_else(|poison| poison.into_inner()).entry(entry.path.clone()).or_default().clone();
        let model = Arc::new(LoadedModel {
            entry: entry.clone(),
            context: n_ctx,
            sender: Mutex::new(Some(sender)),
            pending: AtomicUsize::new(0),
            usage: Mutex::new(Usage { keep_alive: self.inner.config.default_keep_alive, idle_since: Some(Instant::now()) }),
            status: Mutex::new(Status::Loading),
            remote: Mutex::new(None),
        });
        let mut config = self.inner.config.clone();
        // The plan caps a longer context at the trained one.
        if n_ctx.is_some() {
            config.run.n_ctx_seq = n_ctx;
        }
        let worker = Worker { model: Arc::downgrade(&model), path: entry.path.clone(), config, gate };
        std::thread::Builder::new().name(format!("model {}", entry.name)).spawn(move || worker.run(receiver)).map_err(|error| AppError::internal(format!("starting the model thread: {error}")))?;
        Ok(model)
    }

    /// The context a model not yet loaded would get by default (chosen from the budget).
    pub fn default_context(&self, path: &Path) -> Option<u32> {
        let mut run = RunSpec { n_sequences: self.inner.config.n_parallel, ..self.inner.config.run.clone() };
        // The workers as they are now (never a relay of a set that lost a worker).
        run.remote = run.remote.and_then(|workers| workers.current().0);
        let inventory = crate::model::Inventory::open(path).ok()?;
        let facts = crate::setup::machine_facts(&run, path).ok()?;
        Some(crate::plan::context_for(&inventory, &run.ask().ok()?, &facts))
    }

    /// Models that are loaded (or loading), most recently expiring first.
    pub fn loaded(&self) -> Vec<Arc<LoadedModel>> {
        let models = self.inner.models.lock().unwrap_or_else(|poison| poison.into_inner());
        let mut loaded: Vec<Arc<LoadedModel>> = models.values().filter(|model| model.info().is_some()).cloned().collect();
        loaded.sort_by_key(|model| std::cmp::Reverse(model.expires_at().unwrap_or(SystemTime::UNIX_EPOCH + Duration::from_secs(u32::MAX as u64 * 4))));
        loaded
    }

    /// Unload a model now if no request holds it (`keep_alive: 0` with an empty prompt).
    pub fn unload(&self, path: &Path) -> bool {
        self.inner.unload_if_idle(path, Duration::ZERO)
    }

    /// Unload every model whose `keep_alive` has lapsed. Called periodically.
    pub fn reap(&self) {
        let expired: Vec<(PathBuf, Duration)> = {
            let models = self.inner.models.lock().unwrap_or_else(|poison| poison.into_inner());
            models
                .values()
                .filter_map(|model| match model.usage.lock().unwrap_or_else(|poison| poison.into_inner()).keep_alive {
                    KeepAlive::For(duration) => Some((model.entry.path.clone(), duration)),
                    KeepAlive::Forever => None,
                })
                .collect()
        };
        for (path, keep_alive) in expired {
            self.inner.unload_if_idle(&path, keep_alive);
        }
    }

    /// Unload everything idle (shutdown).
    pub fn unload_all(&self) {
        let paths: Vec<PathBuf> = self.inner.models.lock().unwrap_or_else(|poison| poison.into_inner()).keys().cloned().collect();
        for path in paths {
            self.inner.unload_if_idle(&path, Duration::ZERO);
        }
    }
}

/// The model's thread: load, then serve jobs until the channel closes.
struct Worker {
    model: Weak<LoadedModel>,
    path: PathBuf,
    config: SchedulerConfig,
    gate: Arc<Mutex<()>>,
}

impl Worker {
    fn set_status(&self, status: Status) {
        if let Some(model) = self.model.upgrade() {
            *model.status.lock().unwrap_or_else(|poison| poison.into_inner()) = status;
        }
    }

    fn run(self, receiver: Receiver<Job>) {
        // Held until this function returns, after the engine below is dropped.
        let gate = self.gate.clone();
        let _loading = gate.lock().unwrap_or_else(|poison| poison.into_inner());
        let started = Instant::now();
        let mut run = RunSpec { n_sequences: self.config.n_parallel, ..self.config.run.clone() };
        // Workers connected when the server started, unless one has failed since: then the
        // ones that answer now (the model is planned again without the others).
        if let Some(workers) = run.remote.take() {
            let (current, down) = workers.current();
            for error in &down {
                tracing::warn!("planning {} without a worker: {error}", self.path.display());
            }
            run.remote = current;
            if let Some(model) = self.model.upgrade() {
                model.remote.lock().unwrap_or_else(|poison| poison.into_inner()).clone_from(&run.remote);
            }
        }
        let loaded = crate::setup::prepare(&self.path, &run)
            .map_err(|error| AppError::internal(format!("planning {}: {error}", self.path.display())))
            .and_then(|setup| Engine::load(setup.inventory, setup.options).map_err(|error| AppError::internal(format!("loading {}: {error}", self.path.display()))))
            .and_then(|engine| {
                let engine = Arc::new(engine);
                Batcher::new(engine, self.config.n_parallel).map_err(|error| AppError::internal(format!("creating the context: {error}")))
            });
        let mut batcher = match loaded {
            Ok(batcher) => batcher,
            Err(error) => {
                tracing::error!("{error}");
                self.set_status(Status::Failed);
                // Every request that came for this load gets the error; the scheduler forgets
                // the model so that a later request tries again.
                for job in receiver {
                    fail_job(job, &error);
                }
                return;
            }
        };
        let ready_at = Instant::now();
        let engine = batcher.engine().clone();
        self.set_status(Status::Ready(engine_info(&engine, &batcher)));
        tracing::info!("loaded {} in {:.2} s ({} mode)", self.path.display(), (ready_at - started).as_secs_f64(), engine.mode().name());
        let mut embedder: Option<Embedder> = None;
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut open = true;
        loop {
            if batcher.is_idle() && waiting.is_empty() {
                if !open {
                    break;
                }
                match receiver.recv() {
                    Ok(job) => self.accept(job, ready_at, &mut waiting, &mut embedder, &engine),
                    Err(_) => break,
                }
            }
            loop {
                match receiver.try_recv() {
                    Ok(job) => self.accept(job, ready_at, &mut waiting, &mut embedder, &engine),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            // Requests whose client left before they started are dropped unanswered.
            waiting.retain(|job| !matches!(&job.work, Work::Generate(generate) if generate.cancel.load(Ordering::Relaxed)));
            while batcher.free_slots() > 0 {
                let Some(job) = waiting.pop_front() else { break };
                admit(&mut batcher, job, ready_at);
            }
            if !batcher.step() && !batcher.is_idle() {
                std::thread::sleep(Duration::from_millis(1));
            }
            // A remote worker that stopped answering failed the batch it was in; the model is
            // retired, so the next request loads it again with the workers that still answer.
            if let Err(error) = engine.check_remote() {
                tracing::error!("{}: {error}", self.path.display());
                self.set_status(Status::Failed);
                let error = AppError::internal(format!("{}: {error}", self.path.display()));
                batcher.cancel_all();
                for job in waiting.drain(..).chain(receiver.try_iter()) {
                    fail_job(job, &error);
                }
                return;
            }
        }
        batcher.cancel_all();
    }

    fn accept(&self, job: Job, ready_at: Instant, waiting: &mut VecDeque<Job>, embedder: &mut Option<Embedder>, engine: &Arc<Engine>) {
        let load_duration = ready_at.saturating_duration_since(job.received);
        match job.work {
            Work::Generate(_) => waiting.push_back(job),
            Work::Load(reply) => {
                let _ = reply.send(Ok(load_duration));
            }
            Work::Embed(embed) => {
                let result = self.embed(engine, embedder, &embed.inputs, embed.truncate).map(|(vectors, prompt_tokens)| EmbedOutput { vectors, prompt_tokens, load_duration });
                let _ = embed.reply.send(result);
            }
        }
    }

    fn embed(&self, engine: &Arc<Engine>, embedder: &mut Option<Embedder>, inputs: &[String], truncate: bool) -> Result<(Vec<Vec<f32>>, usize), AppError> {
        if embedder.is_none() {
            *embedder = Some(Embedder::new(engine.clone(), self.config.embedding_context).map_err(|error| AppError::internal(error.to_string()))?);
        }
        let embedder = embedder.as_mut().expect("created above");
        let mut vectors = Vec::with_capacity(inputs.len());
        let mut prompt_tokens = 0;
        for input in inputs {
            let mut tokens = embedder.tokenize(input).map_err(|error| AppError::bad_request(error.to_string()))?;
            if tokens.len() > embedder.n_ctx() as usize {
                if !truncate {
                    return Err(AppError::bad_request("the input length exceeds the context length"));
                }
                tokens.truncate(embedder.n_ctx() as usize);
            }
            if tokens.is_empty() {
                return Err(AppError::bad_request("an input has no tokens to embed"));
            }
            let embedding = embedder.embed(&tokens).map_err(|error| AppError::from_engine(&error))?;
            prompt_tokens += embedding.tokens;
            vectors.push(embedding.vector);
        }
        Ok((vectors, prompt_tokens))
    }
}

fn fail_job(job: Job, error: &AppError) {
    match job.work {
        Work::Generate(generate) => {
            let _ = generate.events.send(Event::Failed(error.clone()));
        }
        Work::Embed(embed) => {
            let _ = embed.reply.send(Err(error.clone()));
        }
        Work::Load(reply) => {
            let _ = reply.send(Err(error.clone()));
        }
    }
}

/// Tokenize a generation and hand it to the batcher; its events go to the request's channel,
/// and the lease ends when the sequence does.
fn admit(batcher: &mut Batcher, job: Job, ready_at: Instant) {
    let Job { work, received, lease } = job;
    let Work::Generate(generate) = work else { return };
    let engine = batcher.engine().clone();
    // A conversation is rendered by the batcher (its answer is parsed there too); text, token
    // prompts and a generate prompt after Ollama's `context` are tokenized here.
    let name = engine.inventory().path.file_stem().map(|stem| stem.to_string_lossy().into_owned()).unwrap_or_default();
    let prompt = match generate.prompt {
        Prompt::Chat(chat) if generate.context.is_empty() => {
            super::tools::log_results(&name, &chat);
            Prompt::Chat(chat)
        }
        other => match prompt_tokens(&engine, &generate.context, &other) {
            Ok(tokens) => Prompt::Tokens(tokens),
            Err(error) => {
                let _ = generate.events.send(Event::Failed(AppError::from_engine(&error)));
                return;
            }
        },
    };
    let load_duration = ready_at.saturating_duration_since(received);
    let events = generate.events.clone();
    let model_name = name.clone();
    let mut lease = Some(lease);
    let sink = Box::new(move |event: SequenceEvent<'_>| -> Control {
        let sent = match event {
            SequenceEvent::Text(text) => events.send(Event::Text(text.to_string())),
            SequenceEvent::Thinking(text) => events.send(Event::Thinking(text.to_string())),
            // The lease ends before the last event leaves, so that a client that has its
            // answer sees the model already released (or unloaded, with keep_alive 0).
            SequenceEvent::Done(mut finished) => {
                if let Some(message) = &finished.output.message {
                    super::tools::log_calls(&model_name, &message.tool_calls);
                }
                finished.output.stats.load_duration = load_duration;
                finished.output.stats.total_duration = received.elapsed();
                lease.take();
                events.send(Event::Done(finished))
            }
            SequenceEvent::Failed(error) => {
                lease.take();
                events.send(Event::Failed(AppError::from_engine(&error)))
            }
        };
        // A closed channel means the client is gone: stop generating for it.
        if sent.is_err() {
            Control::Stop
        } else {
            Control::Continue
        }
    });
    let request = GenerateRequest {
        max_tokens: generate.max_tokens,
        sampling: generate.sampling,
        stop: generate.stop,
        grammar: generate.grammar,
        n_ctx: generate.n_ctx,
        ignore_eos: generate.ignore_eos,
        cancel: Some(generate.cancel),
        ..GenerateRequest::new(prompt)
    };
    if let Err((error, _sink)) = batcher.admit(request, sink) {
        // A capability the model lacks is named with the model, as Ollama words it.
        let error = match &error {
            EngineError::Unsupported(reason) => AppError::bad_request(format!("\"{name}\" {reason}")),
            _ => AppError::from_engine(&error),
        };
        let _ = generate.events.send(Event::Failed(error));
    }
}

/// Ollama's `context` (tokens of an earlier answer) followed by the prompt; BOS only when
/// there is no context.
fn prompt_tokens(engine: &Engine, context: &[Token], text: &Prompt) -> Result<Vec<Token>, EngineError> {
    let text = match text {
        Prompt::Tokens(tokens) => return Ok(context.iter().chain(tokens).copied().collect()),
        Prompt::Raw(text) => text.clone(),
        Prompt::Chat(request) => prompt::render_chat(engine, request)?.prompt,
    };
    let mut tokens = context.to_vec();
    tokens.extend(prompt::tokenize_text(engine, &text, context.is_empty())?);
    Ok(tokens)
}

fn engine_info(engine: &Engine, batcher: &Batcher) -> EngineInfo {
    let n_ctx_total = (batcher.n_ctx_per_sequence() * batcher.n_sequences()) as u32;
    let kv = crate::plan::kv_cache_bytes(engine.inventory(), n_ctx_total);
    let (size_bytes, vram_bytes) = match &engine.options().plan {
        Some(plan) => plan.memory_use(kv),
        None => (engine.model().size_bytes() + kv, 0),
    };
    let io = engine.streaming().map(|streaming| streaming.stats.clone());
    EngineInfo { size_bytes, vram_bytes, context_length: batcher.n_ctx_per_sequence(), trained_context: engine.inventory().hparams.n_ctx_train, mode: engine.mode().name(), io }
}
