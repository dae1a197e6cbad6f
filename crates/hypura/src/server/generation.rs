//! Starting a generation for a handler, and reading its events back, for both APIs.
//!
//! The handler waits until the request is admitted before it answers, so a failure before that
//! (a model that cannot load, a prompt too long for the context) is an ordinary error status;
//! any later failure becomes the last line of the stream. A streaming answer's headers (and
//! OpenAI's role chunk) then go out at once, before the prompt is evaluated and whatever the
//! first text is. The request's cancel flag is set when the
//! handler's future or the response stream is dropped, which is how a client that disconnects
//! stops its generation within one token.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::Stream;
use tokio::sync::mpsc;

use super::catalog::ModelEntry;
use super::error::AppError;
use super::metrics::Recorder;
use super::model::{Event, GenerateJob};
use super::scheduler::Scheduler;
use super::wire::KeepAlive;
use crate::engine::{DoneReason, Finished, GenerateRequest};

/// Sets the flag when dropped.
pub struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A generation that was admitted, or already produced its first event.
pub struct Generation {
    first: Option<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Held, not read: dropping the generation cancels it.
    _cancel: CancelOnDrop,
    /// Counts the generation's tokens when it ends (`--metrics`).
    recorder: Option<Recorder>,
}

/// The outcome of a whole generation, for non-streaming answers.
pub struct Collected {
    pub text: String,
    pub thinking: String,
    pub finished: Finished,
}

/// Hand the request to its model's worker and wait until it is admitted. The request's cancel
/// flag becomes the generation's: dropping the generation sets it, and so does a stop whose
/// bound has passed (`Scheduler::cancel_all`).
pub async fn start(
    scheduler: &Scheduler,
    entry: &ModelEntry,
    keep_alive: Option<KeepAlive>,
    mut request: GenerateRequest,
    recorder: Option<Recorder>,
) -> Result<Generation, AppError> {
    // A `num_ctx` longer than the loaded context reloads the model with it.
    let lease = scheduler.acquire_with_context(entry, keep_alive, request.n_ctx_seq)?;
    let flag = Arc::new(AtomicBool::new(false));
    scheduler.track(&flag);
    let cancel = CancelOnDrop(flag.clone());
    request.cancel = Some(flag);
    let (sender, mut events) = mpsc::unbounded_channel();
    lease.generate(GenerateJob { request, events: sender })?;
    match events.recv().await {
        Some(Event::Failed(error)) => Err(error),
        Some(Event::Started) => Ok(Generation { first: None, events, _cancel: cancel, recorder }),
        Some(first) => Ok(Generation { first: Some(first), events, _cancel: cancel, recorder }),
        // A stop cancels requests still queued; they are told to come back.
        None if scheduler.draining() => Err(AppError::shutting_down()),
        None => Err(AppError::internal("the model's worker stopped before answering")),
    }
}

impl Generation {
    /// Every event, the first included. The stream holds the cancel guard: dropping it (the
    /// client went away) cancels the generation.
    pub fn into_stream(self) -> impl Stream<Item = Event> + Send + 'static {
        futures_util::stream::unfold(Some(self), |state| async move {
            let mut generation = state?;
            let event = generation.next().await?;
            let last = matches!(event, Event::Done(_) | Event::Failed(_));
            Some((event, if last { None } else { Some(generation) }))
        })
    }

    /// The next event after the admission (which `start` already waited for).
    async fn next(&mut self) -> Option<Event> {
        let event = match self.first.take() {
            Some(event) => event,
            None => loop {
                match self.events.recv().await? {
                    Event::Started => continue,
                    event => break event,
                }
            },
        };
        if let (Event::Done(finished), Some(recorder)) = (&event, &self.recorder) {
            recorder.finished(&finished.output.stats);
        }
        Some(event)
    }

    /// Wait for the end, joining the text.
    pub async fn collect(mut self) -> Result<Collected, AppError> {
        let mut text = String::new();
        let mut thinking = String::new();
        loop {
            match self.next().await {
                Some(Event::Text(piece)) => text.push_str(&piece),
                Some(Event::Thinking(piece)) => thinking.push_str(&piece),
                Some(Event::Done(finished)) => return Ok(Collected { text, thinking, finished: *finished }),
                Some(Event::Failed(error)) => return Err(error),
                // `next` passes over the admission.
                Some(Event::Started) => {}
                None => return Err(AppError::internal("the model's worker stopped before finishing")),
            }
        }
    }
}

/// Ollama's and OpenAI's word for how a generation ended. A cancelled generation has no
/// client left to tell; "stop" is the closest.
pub fn done_reason(reason: DoneReason) -> &'static str {
    match reason {
        DoneReason::Length => "length",
        DoneReason::Stop | DoneReason::Cancelled => "stop",
    }
}
