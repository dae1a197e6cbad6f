//! `GET /health` and, with `serve --metrics`, `GET /metrics`.
//!
//! `/health` answers as llama-server's does: 200 `{"status":"ok"}` when a request would be
//! taken, and 503 while a model loads or the server drains before it stops.
//!
//! `/metrics` is Prometheus' exposition in the OpenMetrics text format, written by the
//! `prometheus-client` crate. Counters that llama-server has keep its names (`llamacpp:…`),
//! labelled by endpoint and model; the rest are Hypura's (`hypura_…`). Requests are counted by
//! the route layer (`count`), a generation's tokens and times when it ends
//! (`Recorder::finished`), and what the loaded models hold now (requests running and waiting,
//! the expert tiers' picks and bytes since each load, as `/api/ps` gives them) is read at each
//! scrape (`Live`).
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::extract::{MatchedPath, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use serde_json::json;

use super::scheduler::Scheduler;
use super::AppState;
use crate::engine::GenerationStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GenerationLabels {
    endpoint: String,
    model: String,
}

type Seconds = Counter<f64, AtomicU64>;

/// The server's counters, and the registry that writes them with the live figures.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Family<GenerationLabels, Counter>,
    prompt_seconds: Family<GenerationLabels, Seconds>,
    predicted_tokens: Family<GenerationLabels, Counter>,
    predicted_seconds: Family<GenerationLabels, Seconds>,
    reused_tokens: Family<GenerationLabels, Counter>,
    prompt_cache_hits: Family<GenerationLabels, Counter>,
    prompt_cache_tokens: Family<GenerationLabels, Counter>,
    prompt_cache_bytes: Family<GenerationLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Metrics(..)")
    }
}

impl Metrics {
    pub fn new(scheduler: Scheduler) -> Metrics {
        let mut registry = Registry::default();
        let into = &mut registry;
        let prompt_tokens = family(into, "llamacpp:prompt_tokens", "Prompt tokens evaluated (a prefix reused is not).");
        let prompt_seconds = family(into, "llamacpp:prompt_seconds", "Time spent evaluating prompts.");
        let predicted_tokens = family(into, "llamacpp:tokens_predicted", "Tokens generated.");
        let predicted_seconds = family(into, "llamacpp:tokens_predicted_seconds", "Time spent generating tokens.");
        let reused_tokens =
            family(into, "hypura_prompt_tokens_reused", "Prompt tokens whose KV cache was reused, not evaluated.");
        let prompt_cache_hits =
            family(into, "hypura_prompt_cache_hits", "Generations that loaded a prefix from the prompt cache on disk.");
        let prompt_cache_tokens =
            family(into, "hypura_prompt_cache_loaded_tokens", "Tokens loaded from the prompt cache.");
        let prompt_cache_bytes = family(into, "hypura_prompt_cache_read_bytes", "Bytes read from the prompt cache.");
        let requests = family(into, "hypura_requests", "HTTP requests answered, by endpoint and status.");
        registry.register_collector(Box::new(Live { scheduler }));
        Metrics {
            registry,
            requests,
            prompt_tokens,
            prompt_seconds,
            predicted_tokens,
            predicted_seconds,
            reused_tokens,
            prompt_cache_hits,
            prompt_cache_tokens,
            prompt_cache_bytes,
        }
    }

    /// A generation's counters for `endpoint` and `model`.
    pub fn recorder(self: &Arc<Self>, endpoint: &'static str, model: &str) -> Recorder {
        Recorder { metrics: self.clone(), labels: GenerationLabels { endpoint: endpoint.into(), model: model.into() } }
    }

    /// The exposition, as OpenMetrics text.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// A labelled metric, registered under `name`.
fn family<L, M>(registry: &mut Registry, name: &str, help: &str) -> Family<L, M>
where
    L: Clone + std::fmt::Debug + std::hash::Hash + Eq + EncodeLabelSet + Send + Sync + 'static,
    M: Default + EncodeMetric + prometheus_client::metrics::TypedMetric + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, M>::default();
    registry.register(name, help, family.clone());
    family
}

/// Where one generation's figures go.
pub struct Recorder {
    metrics: Arc<Metrics>,
    labels: GenerationLabels,
}

impl Recorder {
    /// Count a generation that ended.
    pub fn finished(&self, stats: &GenerationStats) {
        let metrics = &self.metrics;
        let labels = &self.labels;
        metrics.prompt_tokens.get_or_create(labels).inc_by(stats.prompt_eval_count.into());
        metrics.prompt_seconds.get_or_create(labels).inc_by(stats.prompt_eval_duration.as_secs_f64());
        metrics.predicted_tokens.get_or_create(labels).inc_by(stats.eval_count.into());
        metrics.predicted_seconds.get_or_create(labels).inc_by(stats.eval_duration.as_secs_f64());
        metrics.reused_tokens.get_or_create(labels).inc_by(stats.reused_prompt_tokens.into());
        if stats.prompt_cache_tokens > 0 {
            metrics.prompt_cache_hits.get_or_create(labels).inc();
            metrics.prompt_cache_tokens.get_or_create(labels).inc_by(stats.prompt_cache_tokens.into());
            metrics.prompt_cache_bytes.get_or_create(labels).inc_by(stats.prompt_cache_bytes_read);
        }
    }
}

/// What the loaded models hold at the scrape.
struct Live {
    scheduler: Scheduler,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Live(..)")
    }
}

/// One metric of several labelled samples, written at a scrape.
fn encode_samples<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let samples: Vec<(L, M)> = samples.into_iter().collect();
    let Some((_, first)) = samples.first() else { return Ok(()) };
    let mut family = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (labels, metric) in &samples {
        metric.encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for Live {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let n_parallel = self.scheduler.config().n_parallel as usize;
        let loaded = self.scheduler.loaded();
        let model = |name: &str| vec![("model".to_string(), name.to_string())];
        let active: Vec<(String, usize)> =
            loaded.iter().map(|loaded| (loaded.entry.name.clone(), loaded.active_requests())).collect();
        encode_samples(
            &mut encoder,
            "llamacpp:requests_processing",
            "Requests being generated (at most --parallel a model).",
            active.iter().map(|(name, active)| (model(name), ConstGauge::new((*active).min(n_parallel) as i64))),
        )?;
        encode_samples(
            &mut encoder,
            "llamacpp:requests_deferred",
            "Requests queued behind the running ones.",
            active
                .iter()
                .map(|(name, active)| (model(name), ConstGauge::new(active.saturating_sub(n_parallel) as i64))),
        )?;
        let mut picks = Vec::new();
        let mut bytes = Vec::new();
        for loaded in &loaded {
            let Some(info) = loaded.info() else { continue };
            let Some(io) = info.io.as_ref().map(|io| io.snapshot()) else { continue };
            let experts = info.experts.as_ref().map(|experts| experts.snapshot()).unwrap_or_default();
            let name = &loaded.entry.name;
            let labelled = |key: &str, value: &str| {
                vec![("model".to_string(), name.clone()), (key.to_string(), value.to_string())]
            };
            if info.experts.is_some() {
                for (tier, count) in [("gpu", experts.device.hits), ("host", experts.hits), ("disk", experts.misses)] {
                    picks.push((labelled("tier", tier), ConstCounter::new(count)));
                }
            }
            for (source, count) in
                [("disk", io.bytes_read), ("warm_fill", experts.warm_bytes), ("bus", experts.device.bus_bytes())]
            {
                bytes.push((labelled("source", source), ConstCounter::new(count)));
            }
        }
        encode_samples(
            &mut encoder,
            "hypura_expert_picks",
            "Routed expert picks since the model's load, by the tier that served them.",
            picks,
        )?;
        encode_samples(
            &mut encoder,
            "hypura_streamed_bytes",
            "Bytes a streaming model moved since its load: read from disk (the warm fill among them) and over the GPU's bus.",
            bytes,
        )?;
        Ok(())
    }
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let Some(metrics) = &state.metrics else {
        return (StatusCode::NOT_FOUND, "metrics are off: start the server with --metrics").into_response();
    };
    match metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
            .into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "the metrics could not be written").into_response(),
    }
}

/// `GET /health`, as llama-server answers it.
pub async fn health(State(state): State<AppState>) -> Response {
    let scheduler = &state.scheduler;
    let unavailable = |message: &str| {
        let body = json!({"error": {"code": 503, "message": message, "type": "unavailable_error"}});
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
    };
    if scheduler.draining() {
        return unavailable("Shutting down");
    }
    if scheduler.loading() {
        return unavailable("Loading model");
    }
    axum::Json(json!({"status": "ok"})).into_response()
}

/// The route layer that counts each answered request by its route and status.
pub async fn count(
    State(metrics): State<Option<Arc<Metrics>>>,
    path: Option<MatchedPath>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let response = next.run(request).await;
    if let (Some(metrics), Some(path)) = (metrics, path) {
        let labels =
            RequestLabels { endpoint: path.as_str().to_string(), status: response.status().as_u16().to_string() };
        metrics.requests.get_or_create(&labels).inc();
    }
    response
}
