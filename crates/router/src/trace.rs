//! `tandem router --record-trace FILE`: every generation request's path and JSON body,
//! appended as one line of JSON (the format `tandem chaos replay` reads), in arrival order.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::path::Path;
use std::sync::Arc;

/// Appends trace lines to a file, each written before its request is handled (a client
/// that got its answer finds its request in the file).
#[derive(Debug)]
pub struct TraceRecorder {
    file: std::sync::Mutex<std::fs::File>,
    path: String,
}

impl TraceRecorder {
    /// Opens (creating or appending to) `path`.
    pub fn open(path: &Path) -> std::io::Result<Arc<Self>> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Arc::new(Self {
            file: std::sync::Mutex::new(file),
            path: path.display().to_string(),
        }))
    }

    fn append(&self, line: &str) {
        use std::io::Write;
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = writeln!(f, "{line}") {
            tracing::warn!(file = %self.path, error = %e, "could not record a request");
        }
    }
}

/// Middleware: records the generation requests, then passes them on unchanged.
pub async fn record(State(rec): State<Arc<TraceRecorder>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if req.method() != axum::http::Method::POST
        || !matches!(path.as_str(), "/v1/completions" | "/v1/chat/completions")
    {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, crate::server::MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(_) => {
            use axum::response::IntoResponse;
            let body = serde_json::json!({"error": {
                "message": format!("request body over {} bytes or unreadable", crate::server::MAX_BODY_BYTES),
                "type": "invalid_request_error", "param": null, "code": "payload_too_large"}});
            return (axum::http::StatusCode::PAYLOAD_TOO_LARGE, axum::Json(body)).into_response();
        }
    };
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
        let line = serde_json::json!({"path": path, "body": v}).to_string();
        rec.append(&line);
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
