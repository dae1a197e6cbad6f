//! A model's worker: the thread that loads the model, then owns its engine and one `Batcher`
//! (one llama.cpp context with `n_parallel` sequences) until the scheduler closes its channel.
//!
//! The scheduler (`scheduler.rs`) starts it; a request's lease sends it `Job`s (`model.rs`): a
//! generation, an embedding, or a load only.
//! The thread admits generations into free sequences and steps the batch, so concurrent
//! requests decode together; llama.cpp calls block, so they never run on the async runtime.
//! The engine adapter here hands each `GenerateRequest` to the batcher as the handler made it,
//! and turns the sequence's events into the request's channel (`Event`); the request's lease
//! ends with its sequence.
use crate::sync::Lock;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::error::AppError;
use super::model::{EmbedOutput, EngineInfo, Event, GenerateJob, Job, LoadedModel, SchedulerConfig, Status, Work};
use crate::engine::{Batcher, Control, Embedder, Engine, EngineError, Parked, Prompt, SequenceEvent};

/// The model's thread: load, then serve jobs until the channel closes.
pub(super) struct Worker {
    pub model: Weak<LoadedModel>,
    pub path: PathBuf,
    pub config: SchedulerConfig,
    /// The file's load gate, held from before the load until the engine is dropped.
    pub gate: Arc<Mutex<()>>,
    /// Prefixes a model's last batcher left for its next (`Batcher::park`), by file.
    pub parked: ParkedPrefixes,
}

/// Idle sequences' KV caches kept in host memory while their model reloads or is unloaded.
pub type ParkedPrefixes = Arc<Mutex<std::collections::HashMap<PathBuf, Parked>>>;

/// The parked prefixes take at most this fraction of the memory available when they are parked.
const PARKED_SHARE_OF_AVAILABLE: u64 = 4;

impl Worker {
    /// Run the worker on a thread of its own, named after the model.
    pub fn spawn(self, name: &str, receiver: Receiver<Job>) -> std::io::Result<()> {
        // llama.cpp's chat layer converts tool schemas to grammars on this thread, recursively:
        // a stack as large as the fence gives its own converter (address space, not memory).
        std::thread::Builder::new()
            .name(format!("model {name}"))
            .stack_size(64 << 20)
            .spawn(move || self.run(receiver))
            .map(|_| ())
    }

    fn set_status(&self, status: Status) {
        if let Some(model) = self.model.upgrade() {
            model.set_status(status);
        }
    }

    fn run(self, receiver: Receiver<Job>) {
        // Held until this function returns, after the engine below is dropped.
        let gate = self.gate.clone();
        let _loading = gate.locked();
        let started = Instant::now();
        let mut run = self.config.run_spec();
        // Workers connected when the server started, unless one has failed since: then the
        // ones that answer now (the model is planned again without the others).
        if let Some(workers) = run.remote.take() {
            let (current, down) = workers.current();
            for error in &down {
                tracing::warn!("planning {} without a worker: {error}", self.path.display());
            }
            run.remote = current;
            if let Some(model) = self.model.upgrade() {
                model.set_remote(run.remote.clone());
            }
        }
        let loaded = crate::setup::prepare(&self.path, &run)
            .map_err(|error| AppError::internal(format!("planning {}: {error}", self.path.display())))
            .and_then(|setup| {
                Engine::load(setup.inventory, setup.options)
                    .map_err(|error| AppError::internal(format!("loading {}: {error}", self.path.display())))
            })
            .and_then(|engine| {
                let engine = Arc::new(engine);
                Batcher::new(engine, self.config.n_parallel)
                    .map_err(|error| AppError::internal(format!("creating the context: {error}")))
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
        let parked = self.parked.locked().remove(&self.path);
        if let Some(parked) = parked {
            let restored = batcher.unpark(parked);
            if restored > 0 {
                tracing::info!("{}: {restored} tokens of cached prefixes kept from the last load", self.path.display());
            }
        }
        let ready_at = Instant::now();
        let engine = batcher.engine().clone();
        self.set_status(Status::Ready(engine_info(&engine, &batcher)));
        tracing::info!(
            "loaded {} in {:.2} s ({} mode)",
            self.path.display(),
            (ready_at - started).as_secs_f64(),
            engine.mode().name()
        );
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
            waiting.retain(|job| !matches!(&job.work, Work::Generate(generate) if generate.request.cancel.as_ref().is_some_and(|cancel| cancel.load(Ordering::Relaxed))));
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
        // The next load of this file (a longer num_ctx, the next request after the keep-alive)
        // starts from these prefixes; the memory they take is no longer available to its plan.
        let parked = batcher.park(crate::hw::memory_info().effective_available_bytes() / PARKED_SHARE_OF_AVAILABLE);
        if parked.bytes() > 0 {
            tracing::debug!("{}: {} bytes of cached prefixes parked", self.path.display(), parked.bytes());
            self.parked.locked().insert(self.path.clone(), parked);
        }
    }

    fn accept(
        &self,
        job: Job,
        ready_at: Instant,
        waiting: &mut VecDeque<Job>,
        embedder: &mut Option<Embedder>,
        engine: &Arc<Engine>,
    ) {
        let load_duration = ready_at.saturating_duration_since(job.received);
        match job.work {
            Work::Generate(_) => waiting.push_back(job),
            Work::Load(reply) => {
                let _ = reply.send(Ok(load_duration));
            }
            Work::Embed(embed) => {
                let result = self
                    .embed(engine, embedder, &embed.inputs, embed.truncate)
                    .map(|(vectors, prompt_tokens)| EmbedOutput { vectors, prompt_tokens, load_duration });
                let _ = embed.reply.send(result);
            }
        }
    }

    fn embed(
        &self,
        engine: &Arc<Engine>,
        embedder: &mut Option<Embedder>,
        inputs: &[String],
        truncate: bool,
    ) -> Result<(Vec<Vec<f32>>, usize), AppError> {
        if embedder.is_none() {
            *embedder = Some(
                Embedder::new(engine.clone(), self.config.embedding_context)
                    .map_err(|error| AppError::internal(error.to_string()))?,
            );
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

/// Hand a generation to the batcher as it came (the batcher renders and tokenizes its prompt);
/// its events go to the request's channel, and the lease ends when the sequence does.
fn admit(batcher: &mut Batcher, job: Job, ready_at: Instant) {
    let Job { work, received, lease } = job;
    let Work::Generate(generate) = work else { return };
    let GenerateJob { request, events } = *generate;
    let name = batcher
        .engine()
        .inventory()
        .path
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Prompt::Chat(chat) = &request.prompt {
        super::tools::log_results(&name, chat);
    }
    let load_duration = ready_at.saturating_duration_since(received);
    let sink_events = events.clone();
    let model_name = name.clone();
    let mut lease = Some(lease);
    let sink = Box::new(move |event: SequenceEvent<'_>| -> Control {
        let sent = match event {
            SequenceEvent::Text(text) => sink_events.send(Event::Text(text.to_string())),
            SequenceEvent::Thinking(text) => sink_events.send(Event::Thinking(text.to_string())),
            // The lease ends before the last event leaves, so that a client that has its
            // answer sees the model already released (or unloaded, with keep_alive 0).
            SequenceEvent::Done(mut finished) => {
                if let Some(message) = &finished.output.message {
                    super::tools::log_calls(&model_name, &message.tool_calls);
                }
                finished.output.stats.load_duration = load_duration;
                finished.output.stats.total_duration = received.elapsed();
                lease.take();
                sink_events.send(Event::Done(finished))
            }
            SequenceEvent::Failed(error) => {
                lease.take();
                sink_events.send(Event::Failed(AppError::from_engine(&error)))
            }
        };
        // A closed channel means the client is gone: stop generating for it.
        if sent.is_err() {
            Control::Stop
        } else {
            Control::Continue
        }
    });
    match batcher.admit(request, sink) {
        Ok(()) => {
            let _ = events.send(Event::Started);
        }
        Err((error, _sink)) => {
            // A capability the model lacks is named with the model, as Ollama words it.
            let error = match &error {
                EngineError::Unsupported(reason) => AppError::bad_request(format!("\"{name}\" {reason}")),
                _ => AppError::from_engine(&error),
            };
            let _ = events.send(Event::Failed(error));
        }
    }
}

fn engine_info(engine: &Engine, batcher: &Batcher) -> EngineInfo {
    let n_ctx_total = (batcher.n_ctx_seq() * batcher.n_sequences()) as u32;
    let kv = crate::plan::kv_cache_bytes(engine.inventory(), n_ctx_total, engine.options().kv);
    let (size_bytes, vram_bytes) = match &engine.options().plan {
        Some(plan) => plan.memory_use(kv),
        None => (engine.model().size_bytes() + kv, 0),
    };
    let io = engine.streaming().map(|streaming| streaming.stats.clone());
    let experts = engine.streaming().and_then(|streaming| streaming.driver.experts.clone());
    EngineInfo {
        size_bytes,
        vram_bytes,
        context_length: batcher.n_ctx_seq(),
        trained_context: engine.inventory().hparams.n_ctx_train,
        mode: engine.mode().name(),
        io,
        experts,
    }
}
