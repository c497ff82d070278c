//! Wiring for the `tandem router` process: config file → worker handles → P/D generator →
//! HTTP app, plus the operator endpoints that need the worker list (`/ready`,
//! `/admin/workers`).

use crate::config::RouterConfig;
use crate::openai::model::ModelInfo;
use crate::pd::{PdGenerator, RetryPolicy, SharedPd, WorkerHandle};
use crate::server::app;
use crate::state::RouterState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Boxed error of process start-up.
pub type LaunchError = Box<dyn std::error::Error + Send + Sync>;

/// Routes that report on the workers behind this router.
pub fn worker_routes(pd: Arc<PdGenerator>) -> Router {
    Router::new()
        .route("/ready", get(ready))
        .route("/admin/workers", get(workers))
        .route("/admin/requests", get(requests))
        .with_state(pd)
}

/// Every worker's counters, asked concurrently. With `wait_idle` > 0 each worker answers once
/// it holds no KV or state (or when the wait runs out).
async fn worker_report(pd: &PdGenerator, wait_idle: Duration) -> Vec<Value> {
    let asks = pd.workers().into_iter().map(|w| async move {
        let stats = tokio::time::timeout(wait_idle + Duration::from_secs(2), w.stats_when_idle(wait_idle)).await;
        let mut report = match stats {
            Ok(Ok(s)) => json!({
                "id": w.id.0, "address": w.address, "role": s.role,
                "kv_blocks_total": s.kv_blocks_total, "kv_blocks_free": s.kv_blocks_free,
                "running_requests": s.running_requests, "pending_reservations": s.pending_reservations,
                "kv_bytes_transferred": s.kv_bytes_transferred,
                "kv_bytes_landed": s.kv_bytes_landed,
                "layout": s.layout, "dp_size": s.dp_size, "dp_free_slots": s.dp_free_slots,
                "cancelled_requests": s.cancelled_requests,
                "in_flight": s.in_flight,
                "instance_id": s.instance_id,
            }),
            Ok(Err(e)) => json!({"id": w.id.0, "address": w.address, "error": e.message}),
            Err(_) => json!({"id": w.id.0, "address": w.address, "error": "stats timed out"}),
        };
        // What the router itself knows of the worker, whether or not it answered.
        if let Value::Object(o) = &mut report {
            for (k, v) in [
                ("state", json!(w.state())),
                ("ejected", json!(w.is_ejected())),
                ("ejected_by", json!(w.ejected_by())),
                ("ejections", json!(w.ejections())),
                ("health_failures", json!(w.health_failures())),
                ("routed", json!(w.routed())),
            ] {
                o.insert(k.into(), v);
            }
        }
        report
    });
    futures::future::join_all(asks).await
}

/// Ready when at least one prefill and one decode worker, or one aggregated worker, answer: a
/// dead worker is routed around (retries), it does not take the router out of service.
async fn ready(State(pd): State<Arc<PdGenerator>>) -> (StatusCode, Json<Value>) {
    let workers = worker_report(&pd, Duration::ZERO).await;
    let reachable = |role: &str| workers.iter().any(|w| w["role"] == role);
    let ok = (reachable("prefill") && reachable("decode")) || reachable("both");
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"ready": ok, "workers": workers})))
}

/// Query of `/admin/workers`.
#[derive(Debug, Default, serde::Deserialize)]
struct WorkersQuery {
    /// Wait up to this long (at most a minute) for every worker to be idle before answering.
    #[serde(default)]
    wait_idle_ms: u64,
}

async fn workers(
    State(pd): State<Arc<PdGenerator>>,
    q: Result<axum::extract::Query<WorkersQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, crate::error::ApiError> {
    let q = q.map_err(|e| crate::error::ApiError::invalid(e.body_text(), Some("wait_idle_ms")))?;
    let wait = Duration::from_millis(q.wait_idle_ms.min(60_000));
    Ok(Json(json!({"workers": worker_report(&pd, wait).await})))
}

/// The requests in flight, oldest first: each one's phase and how long it has been in it, and
/// its latest attempts with the phases they went through (`pd::inflight`); then the latest
/// requests that ended, newest first, with their final phases.
async fn requests(State(pd): State<Arc<PdGenerator>>) -> Json<Value> {
    let list = pd.in_flight().snapshot();
    let ended = pd.in_flight().ended();
    Json(json!({"count": list.len(), "requests": list, "ended": ended}))
}

/// What the command line sets over a router's config file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `model.dir`.
    pub model_dir: Option<PathBuf>,
    /// `model.chat_template`.
    pub chat_template: Option<PathBuf>,
    /// `listen`.
    pub listen: Option<String>,
    /// Append every generation request here (a trace for `tandem chaos replay`).
    pub record_trace: Option<PathBuf>,
}

/// Runs a router from a config file, with `overrides` over it, until `shutdown` resolves.
pub async fn run_from_config(
    path: &Path,
    overrides: Overrides,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), LaunchError> {
    let mut config = RouterConfig::load(path)?;
    if let Some(dir) = overrides.model_dir {
        config = config.with_model_dir(dir);
    }
    if let Some(file) = overrides.chat_template {
        config.model.chat_template = Some(file);
    }
    let (listen, record_trace) = (overrides.listen, overrides.record_trace);
    let dir = config
        .model
        .dir
        .clone()
        .ok_or("no model directory: set model.dir in the config or pass --model")?;
    let connect = config.timeouts.connect;
    let worker_tls = match &config.worker_tls {
        Some(t) => Some(t.client_config()?),
        None => None,
    };
    let handle = |e: &crate::config::WorkerEndpoint| {
        WorkerHandle::with_tls(
            e.id.clone(),
            &e.address.to_string(),
            connect,
            worker_tls.clone(),
        )
    };
    let prefill = config
        .prefill
        .iter()
        .map(handle)
        .collect::<Result<Vec<_>, _>>()?;
    let decode = config
        .decode
        .iter()
        .map(handle)
        .collect::<Result<Vec<_>, _>>()?;
    let aggregated = config
        .aggregated
        .iter()
        .map(handle)
        .collect::<Result<Vec<_>, _>>()?;
    let pd = Arc::new(
        PdGenerator::with_aggregated(
            prefill,
            decode,
            aggregated,
            RetryPolicy {
                attempts: config.retry.attempts,
                backoff: config.retry.backoff,
                migration_limit: config.retry.migration_limit,
                outage_wait: config.retry.outage_wait,
            },
        )
        .with_timeouts(config.timeouts)
        .with_policy(config.policy.policy())
        .with_breaker(config.breaker.policy())
        .with_health(config.health)
        .with_admission(config.admission.clone())
        .with_worker_tls(worker_tls),
    );
    if let Some(d) = &config.discovery {
        let etcd = d.etcd.etcd_config(Duration::from_secs(10));
        tracing::info!(endpoints = %etcd.endpoints.join(","), prefix = %etcd.prefix,
            tls = etcd.tls.is_some(), "finding workers through etcd");
        let source: Arc<dyn tandem_discovery::Discovery> =
            Arc::new(tandem_discovery::EtcdDiscovery::start(etcd)?);
        // Ready means knowing the workers: wait (a while) for the first list.
        let mut first = source.subscribe();
        let listed = tokio::time::timeout(
            Duration::from_secs(10),
            first.wait_for(|set| set.revision > 0),
        )
        .await;
        match listed {
            Ok(Ok(set)) => pd.set_workers(&set),
            _ => tracing::warn!(
                "etcd did not answer within 10 s: starting with no workers (they appear once it does)"
            ),
        }
        tokio::spawn(pd.clone().follow(source));
    }

    let state = RouterState::new(
        Arc::new(SharedPd(pd.clone())),
        &ModelInfo::new(config.model.served_name.clone(), dir)
            .with_chat_template(config.model.chat_template.clone()),
    )?;
    state.admission().configure(config.admission.clone());
    let pool_metrics = crate::pd::pool_metrics::PoolMetrics::register(
        state.metrics().registry(),
        state.metrics().vllm_registry(),
    );
    let registry = state.metrics().registry();
    registry
        .register(Box::new(pd.in_flight().migrations_counter()))
        .expect("metric names are unique within this registry");
    registry
        .register(Box::new(pd.in_flight().phase_gauges()))
        .expect("metric names are unique within this registry");
    registry
        .register(Box::new(pd.in_flight().handoff_failures_counter()))
        .expect("metric names are unique within this registry");
    tokio::spawn(
        pd.clone()
            .poll_health(config.health.interval, Some(pool_metrics)),
    );
    let addr = match listen {
        Some(l) => l.parse()?,
        None => config.listen,
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let https = match &config.tls {
        Some(tls) => Some(tls.server_config()?),
        None => None,
    };
    tracing::info!(listen = %listener.local_addr()?, https = https.is_some(),
        mutual_tls_to_workers = config.worker_tls.is_some(),
        model = %config.model.served_name, "router ready");
    let mut app = app(state).merge(worker_routes(pd));
    if let Some(p) = record_trace {
        let recorder = crate::trace::TraceRecorder::open(&p)
            .map_err(|e| format!("opening {}: {e}", p.display()))?;
        tracing::info!(file = %p.display(), "recording requests");
        app = app.layer(axum::middleware::from_fn_with_state(
            recorder,
            crate::trace::record,
        ));
    }
    if let Some(keys) = crate::auth::ApiKeys::from_config(&config.auth)? {
        tracing::info!(keys = keys.count(), "API keys required");
        app = app.layer(axum::middleware::from_fn_with_state(
            keys,
            crate::auth::require,
        ));
    }
    match https {
        Some(tls) => {
            axum::serve(crate::tls::HttpsListener::new(listener, tls)?, app)
                .with_graceful_shutdown(shutdown)
                .await?
        }
        None => {
            axum::serve(crate::server::no_delay(listener), app)
                .with_graceful_shutdown(shutdown)
                .await?
        }
    }
    Ok(())
}
