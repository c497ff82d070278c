//! The axum application: the routes over a [`RouterState`], and `serve`.

use crate::error::ApiError;
use crate::openai::completions;
use crate::openai::protocol::{ModelCard, ModelList};
use crate::state::RouterState;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::future::Future;

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// The HTTP application over `state`.
pub fn app(state: RouterState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(list_models))
        .route("/tokenize", post(crate::openai::tokenize::tokenize))
        .route("/detokenize", post(crate::openai::tokenize::detokenize))
        .route("/version", get(version))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(crate::openai::openapi::openapi))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves [`app`]`(state)` on `listener` until the process ends or an I/O error.
pub async fn serve(listener: tokio::net::TcpListener, state: RouterState) -> std::io::Result<()> {
    axum::serve(no_delay(listener), app(state)).await
}

/// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests finish.
pub async fn serve_with_shutdown(
    listener: tokio::net::TcpListener,
    state: RouterState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(no_delay(listener), app(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// `listener` with `TCP_NODELAY` on every accepted connection (axum leaves it off): the
/// router's answers are small writes — a stream's events one by one — and Nagle's algorithm
/// would hold each behind the client's acknowledgement of the one before.
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY on a connection");
        }
    })
}

async fn list_models(State(state): State<RouterState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.served_name().to_owned(),
            object: "model",
            created: state.created(),
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
