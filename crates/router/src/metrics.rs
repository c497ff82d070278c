//! Prometheus metrics of the HTTP front end, in a registry owned by the router (never the
//! process-global default), so several apps can live in one process — tests make many.
//!
//! A request is tracked by a [`RequestRecord`]: it observes TTFT and inter-token latency as
//! tokens arrive, counts the outcome exactly once, and — if it is dropped before an outcome
//! was recorded (the client went away) — counts the request as `Cancelled`.
//!
//! Dashboards built for vLLM read `vllm:*` names with a `model_name` label. Where a `tandem_*`
//! family means what a vLLM family means, [`Metrics::render`] also writes it under the vLLM
//! name (the table [`VLLM_NAMES`]), so the two cannot drift apart: one observation, two
//! names. Families vLLM has and tandem had no twin for (`vllm:request_success_total`,
//! `vllm:kv_cache_usage_perc`) live in a second registry whose every metric carries
//! `model_name`.

use crate::error::ApiError;
use prometheus::proto::{LabelPair, MetricFamily};
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tandem_core::{ErrorClass, FinishReason};

/// The `tandem_*` families also exported under vLLM's name (same meaning, same unit), with
/// vLLM's `model_name` label added. vLLM names the inter-token histogram twice (the older
/// `time_per_output_token_seconds` and `inter_token_latency_seconds`); both are written.
pub const VLLM_NAMES: &[(&str, &str)] = &[
    ("tandem_requests_running", "vllm:num_requests_running"),
    ("tandem_admission_queue_depth", "vllm:num_requests_waiting"),
    (
        "tandem_time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
    ),
    (
        "tandem_inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds",
    ),
    (
        "tandem_inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    (
        "tandem_e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ),
    (
        "tandem_admission_queue_wait_seconds",
        "vllm:request_queue_time_seconds",
    ),
    ("tandem_prompt_tokens_total", "vllm:prompt_tokens_total"),
    (
        "tandem_generation_tokens_total",
        "vllm:generation_tokens_total",
    ),
];

/// vLLM's `finished_reason` label values: a stop token or string, `max_tokens`, and a
/// request the client abandoned.
const FINISHED_REASONS: [&str; 3] = ["stop", "length", "abort"];

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
    240.0, 480.0, 960.0,
];
/// Every error class (metric label values).
pub(crate) const ALL_CLASSES: [ErrorClass; 7] = [
    ErrorClass::InvalidRequest,
    ErrorClass::Unavailable,
    ErrorClass::CapacityExhausted,
    ErrorClass::TransferFailed,
    ErrorClass::Cancelled,
    ErrorClass::DeadlineExceeded,
    ErrorClass::Internal,
];

/// The OpenAI endpoint a request came in on (a metrics label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
}

impl Endpoint {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

/// The router's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// vLLM-only families; every metric in it carries `model_name`.
    vllm: Registry,
    model_name: String,
    request_success_total: IntCounterVec,
    requests_total: IntCounterVec,
    request_failures_total: IntCounterVec,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_request_latency: Histogram,
    requests_running: IntGauge,
    prompt_tokens_total: IntCounter,
    generation_tokens_total: IntCounter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new("")
    }
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let histogram = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("static histogram options are valid");
    registry
        .register(Box::new(histogram.clone()))
        .expect("metric names are unique within this registry");
    histogram
}

impl Metrics {
    /// Fresh metrics in a fresh registry, for the model served as `model_name` (vLLM's
    /// `model_name` label).
    pub fn new(model_name: &str) -> Self {
        let registry = Registry::new();
        let vllm = Registry::new_custom(
            None,
            Some(HashMap::from([(
                "model_name".to_string(),
                model_name.to_string(),
            )])),
        )
        .expect("model_name is a valid label name");
        let request_success_total = IntCounterVec::new(
            Opts::new(
                "vllm:request_success_total",
                "Finished requests by vLLM's finished_reason (stop, length; abort: the client \
                 went away).",
            ),
            &["finished_reason"],
        )
        .expect("static counter options are valid");
        vllm.register(Box::new(request_success_total.clone()))
            .expect("metric names are unique within this registry");
        for reason in FINISHED_REASONS {
            request_success_total.with_label_values(&[reason]);
        }
        let requests_total = IntCounterVec::new(
            Opts::new(
                "tandem_requests_total",
                "Completed HTTP generation requests by endpoint and final status (for a stream \
                 that failed after its headers, the status its error class maps to).",
            ),
            &["endpoint", "status"],
        )
        .expect("static counter options are valid");
        let request_failures_total = IntCounterVec::new(
            Opts::new(
                "tandem_request_failures_total",
                "Failed generation requests by error class.",
            ),
            &["class"],
        )
        .expect("static counter options are valid");
        let requests_running = IntGauge::new(
            "tandem_requests_running",
            "Requests handed to the generator and not finished yet.",
        )
        .expect("static gauge options are valid");
        let prompt_tokens_total = IntCounter::new(
            "tandem_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
        )
        .expect("static counter options are valid");
        let generation_tokens_total = IntCounter::new(
            "tandem_generation_tokens_total",
            "Tokens received from the generator.",
        )
        .expect("static counter options are valid");
        for collector in [requests_total.clone(), request_failures_total.clone()] {
            registry
                .register(Box::new(collector))
                .expect("metric names are unique within this registry");
        }
        for collector in [prompt_tokens_total.clone(), generation_tokens_total.clone()] {
            registry
                .register(Box::new(collector))
                .expect("metric names are unique within this registry");
        }
        registry
            .register(Box::new(requests_running.clone()))
            .expect("metric names are unique within this registry");
        for class in ALL_CLASSES {
            request_failures_total.with_label_values(&[class.as_str()]);
        }
        Self {
            time_to_first_token: histogram(
                &registry,
                "tandem_time_to_first_token_seconds",
                "Time from request arrival to the first generated token.",
                TTFT_BUCKETS,
            ),
            inter_token_latency: histogram(
                &registry,
                "tandem_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request.",
                ITL_BUCKETS,
            ),
            e2e_request_latency: histogram(
                &registry,
                "tandem_e2e_request_latency_seconds",
                "Time from request arrival to its last token (successful requests).",
                E2E_BUCKETS,
            ),
            registry,
            vllm,
            model_name: model_name.to_string(),
            request_success_total,
            requests_total,
            request_failures_total,
            requests_running,
            prompt_tokens_total,
            generation_tokens_total,
        }
    }

    /// The registry, for components that add their own metrics (e.g. the P/D generator).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The registry of vLLM-only families (every metric gets `model_name`), for components
    /// that add one (e.g. the pool's `vllm:kv_cache_usage_perc`).
    pub fn vllm_registry(&self) -> &Registry {
        &self.vllm
    }

    /// Prometheus text exposition of everything in the registries, the [`VLLM_NAMES`]
    /// families twice (under both names).
    pub fn render(&self) -> String {
        let mut families = self.registry.gather();
        let twins: Vec<MetricFamily> = VLLM_NAMES
            .iter()
            .filter_map(|(ours, theirs)| {
                let family = families.iter().find(|f| f.name() == *ours)?;
                Some(vllm_twin(family, theirs, &self.model_name))
            })
            .collect();
        families.extend(twins);
        families.extend(self.vllm.gather());
        TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|err| format!("# metrics encoding failed: {err}\n"))
    }

    /// Starts tracking a request that just arrived.
    pub(crate) fn start(self: &Arc<Self>, endpoint: Endpoint) -> RequestRecord {
        RequestRecord {
            metrics: Arc::clone(self),
            endpoint,
            arrived: Instant::now(),
            last_token: None,
            running: false,
            finished: false,
        }
    }
}

/// `family` under vLLM's `name`, each metric with `model_name` first among its labels.
fn vllm_twin(family: &MetricFamily, name: &str, model_name: &str) -> MetricFamily {
    let mut twin = family.clone();
    twin.set_name(name.to_string());
    for metric in twin.mut_metric() {
        let mut label = LabelPair::default();
        label.set_name("model_name".to_string());
        label.set_value(model_name.to_string());
        let mut labels = vec![label];
        labels.extend(metric.take_label());
        metric.set_label(labels);
    }
    twin
}

/// Per-request metrics; see the module docs.
#[derive(Debug)]
pub(crate) struct RequestRecord {
    metrics: Arc<Metrics>,
    endpoint: Endpoint,
    arrived: Instant,
    last_token: Option<Instant>,
    running: bool,
    finished: bool,
}

impl RequestRecord {
    /// The request was validated and is handed to the generator.
    pub(crate) fn admitted(&mut self, prompt_tokens: usize) {
        self.metrics
            .prompt_tokens_total
            .inc_by(u64::try_from(prompt_tokens).unwrap_or(u64::MAX));
        if !self.running {
            self.running = true;
            self.metrics.requests_running.inc();
        }
    }

    /// A token arrived from the generator.
    pub(crate) fn token(&mut self) {
        let now = Instant::now();
        match self.last_token {
            None => self
                .metrics
                .time_to_first_token
                .observe((now - self.arrived).as_secs_f64()),
            Some(last) => self
                .metrics
                .inter_token_latency
                .observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.metrics.generation_tokens_total.inc();
    }

    /// The request completed successfully, ending for `reason`.
    pub(crate) fn succeeded(&mut self, reason: FinishReason) {
        if self.finish() {
            self.count("200");
            let reason = match reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            };
            self.metrics
                .request_success_total
                .with_label_values(&[reason])
                .inc();
            self.metrics
                .e2e_request_latency
                .observe(self.arrived.elapsed().as_secs_f64());
        }
    }

    /// The request failed with `error`.
    pub(crate) fn failed(&mut self, error: &ApiError) {
        if self.finish() {
            self.count(error.status().as_str());
            self.metrics
                .request_failures_total
                .with_label_values(&[error.class().as_str()])
                .inc();
            if error.class() == ErrorClass::Cancelled {
                self.metrics
                    .request_success_total
                    .with_label_values(&["abort"])
                    .inc();
            }
        }
    }

    /// Marks the outcome recorded; false if it already was.
    fn finish(&mut self) -> bool {
        if self.finished {
            return false;
        }
        self.finished = true;
        if self.running {
            self.running = false;
            self.metrics.requests_running.dec();
        }
        true
    }

    fn count(&self, status: &str) {
        self.metrics
            .requests_total
            .with_label_values(&[self.endpoint.as_str(), status])
            .inc();
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.failed(&ApiError::from_class(
                ErrorClass::Cancelled,
                "client disconnected",
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_record_counts_as_cancelled_and_releases_gauge() {
        let metrics = Arc::new(Metrics::new("m"));
        let mut record = metrics.start(Endpoint::Completions);
        record.admitted(3);
        assert_eq!(metrics.requests_running.get(), 1);
        record.token();
        drop(record);
        assert_eq!(metrics.requests_running.get(), 0);
        let text = metrics.render();
        assert!(text.contains(r#"tandem_requests_total{endpoint="completions",status="499"} 1"#));
        assert!(text.contains(r#"tandem_request_failures_total{class="cancelled"} 1"#));
        assert!(text.contains("tandem_time_to_first_token_seconds_count 1"));
    }

    #[test]
    fn outcome_is_counted_once() {
        let metrics = Arc::new(Metrics::new("m"));
        let mut record = metrics.start(Endpoint::ChatCompletions);
        record.succeeded(FinishReason::Length);
        record.failed(&ApiError::internal("late"));
        drop(record);
        let text = metrics.render();
        assert!(text.contains(r#"status="200"} 1"#));
        assert!(!text.contains(r#"status="500""#));
        assert!(text.contains("tandem_e2e_request_latency_seconds_count 1"));
    }

    #[test]
    fn vllm_names_carry_the_same_observations_and_model_name() {
        let metrics = Arc::new(Metrics::new("tiny"));
        let mut record = metrics.start(Endpoint::Completions);
        record.admitted(5);
        record.token();
        record.token();
        let text = metrics.render();
        assert!(
            text.contains(r#"vllm:num_requests_running{model_name="tiny"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"vllm:prompt_tokens_total{model_name="tiny"} 5"#));
        assert!(text.contains(r#"vllm:generation_tokens_total{model_name="tiny"} 2"#));
        assert!(text.contains(r#"vllm:time_to_first_token_seconds_count{model_name="tiny"} 1"#));
        assert!(text.contains(r#"vllm:inter_token_latency_seconds_count{model_name="tiny"} 1"#));
        assert!(text.contains(r#"vllm:time_per_output_token_seconds_count{model_name="tiny"} 1"#));
        record.succeeded(FinishReason::Stop);
        let mut abandoned = metrics.start(Endpoint::ChatCompletions);
        abandoned.admitted(1);
        drop(abandoned);
        let text = metrics.render();
        assert!(text.contains(r#"vllm:num_requests_running{model_name="tiny"} 0"#));
        assert!(text
            .contains(r#"vllm:request_success_total{finished_reason="stop",model_name="tiny"} 1"#));
        assert!(text.contains(
            r#"vllm:request_success_total{finished_reason="abort",model_name="tiny"} 1"#
        ));
        assert!(text.contains(
            r#"vllm:request_success_total{finished_reason="length",model_name="tiny"} 0"#
        ));
        assert!(text.contains(r#"vllm:e2e_request_latency_seconds_count{model_name="tiny"} 1"#));
        // The tandem names are unchanged: no model_name on them.
        assert!(text.contains("tandem_prompt_tokens_total 6"));
    }
}
