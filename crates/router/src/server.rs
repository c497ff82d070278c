//! The axum application: shared state, routes, and `serve`.

use crate::completions;
use crate::error::{ApiError, Result};
use crate::generator::Generator;
use crate::metrics::Metrics;
use crate::model::{ModelAssets, ModelInfo};
use crate::protocol::{ModelCard, ModelList};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct RouterState {
    inner: Arc<Inner>,
}

struct Inner {
    generator: Arc<dyn Generator>,
    served_name: String,
    model: Arc<ModelAssets>,
    metrics: Arc<Metrics>,
    admission: Arc<crate::admission::Admission>,
    ready: AtomicBool,
    created: u64,
}

impl std::fmt::Debug for RouterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterState")
            .field("served_name", &self.inner.served_name)
            .field("context_length", &self.inner.model.context_length())
            .field("ready", &self.is_ready())
            .finish_non_exhaustive()
    }
}

impl RouterState {
    /// Loads the model's tokenizer, template and limits from `model.dir` and serves it as
    /// `model.served_name` through `generator`.
    pub fn new(generator: Arc<dyn Generator>, model: &ModelInfo) -> Result<Self> {
        Ok(Self::with_assets(
            generator,
            model.served_name.clone(),
            model.load()?,
        ))
    }

    /// Like [`Self::new`] with assets already loaded (e.g. because building the generator
    /// needed them too).
    pub fn with_assets(
        generator: Arc<dyn Generator>,
        served_name: impl Into<String>,
        model: ModelAssets,
    ) -> Self {
        let metrics = Arc::new(Metrics::new());
        let admission = Arc::new(crate::admission::Admission::new(
            crate::config::AdmissionConfig::default(),
            metrics.registry(),
        ));
        Self {
            inner: Arc::new(Inner {
                generator,
                served_name: served_name.into(),
                model: Arc::new(model),
                metrics,
                admission,
                ready: AtomicBool::new(true),
                created: unix_now(),
            }),
        }
    }

    /// The served model's name.
    pub fn served_name(&self) -> &str {
        &self.inner.served_name
    }

    /// The served model's tokenizer, template and limits.
    pub fn model(&self) -> &Arc<ModelAssets> {
        &self.inner.model
    }

    /// The router's metrics (its registry accepts more collectors).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Admission control (rate limits, the priority queue); admits everything until
    /// configured.
    pub fn admission(&self) -> &Arc<crate::admission::Admission> {
        &self.inner.admission
    }

    /// The generator.
    pub fn generator(&self) -> &Arc<dyn Generator> {
        &self.inner.generator
    }

    /// Whether `/health` answers 200 (true from construction; set false while draining).
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Relaxed)
    }

    /// Sets what `/health` reports.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Relaxed);
    }
}

/// The HTTP application over `state`.
pub fn app(state: RouterState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(list_models))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/version", get(version))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(crate::openapi::openapi))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves [`app`]`(state)` on `listener` until the process ends or an I/O error.
pub async fn serve(listener: tokio::net::TcpListener, state: RouterState) -> std::io::Result<()> {
    axum::serve(listener, app(state)).await
}

/// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish.
pub async fn serve_with_shutdown(
    listener: tokio::net::TcpListener,
    state: RouterState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn list_models(State(state): State<RouterState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.served_name().to_owned(),
            object: "model",
            created: state.inner.created,
            owned_by: "tandem",
            max_model_len: state.model().context_length(),
        }],
    })
}

async fn health(State(state): State<RouterState>) -> Response {
    if state.is_ready() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response()
    }
}

async fn metrics(State(state): State<RouterState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics().render(),
    )
        .into_response()
}

async fn fallback(uri: Uri) -> ApiError {
    ApiError::route_not_found(uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// The server's version, `{"version": "…"}` (vLLM's shape).
async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

/// `system_fingerprint` of every answer: the server build that produced it.
pub(crate) const SYSTEM_FINGERPRINT: &str = concat!("fp_tandem_", env!("CARGO_PKG_VERSION"));

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
