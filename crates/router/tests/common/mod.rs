//! Shared helpers of the router's HTTP tests: the fixture model, an app over a
//! `MemoryGenerator`, and request/SSE helpers on top of `tower::ServiceExt::oneshot`.

#![allow(dead_code)] // each test binary uses a different subset

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use tandem_router::{app, MemoryGenerator, ModelAssets, ModelInfo, RouterState};
use tower::ServiceExt;

/// Served name of the fixture model.
pub const MODEL: &str = "tiny-chatml";
/// `<|im_end|>` in the fixture tokenizer.
pub const IM_END: u32 = 2;

/// The always-present fixture: byte-level BPE, ChatML template, context 256.
pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml")
}

/// A router over the fixture model whose generator is `generator`.
pub fn fixture_app(generator: &Arc<MemoryGenerator>) -> (Router, RouterState) {
    let state = RouterState::new(generator.clone(), &ModelInfo::new(MODEL, fixture_dir()))
        .expect("fixture model loads");
    (app(state.clone()), state)
}

/// Token ids of `text` (special tokens matched, nothing added).
pub fn encode(state: &RouterState, text: &str) -> Vec<u32> {
    state.model().encode_chat(text).expect("encodes")
}

/// Builds an app over the fixture whose generator answers `text` + EOS.
pub fn app_answering(text: &str) -> (Router, RouterState, Arc<MemoryGenerator>) {
    app_with(text, |g| g)
}

/// Like [`app_answering`], with the generator adjusted by `adjust`.
pub fn app_with(
    text: &str,
    adjust: impl FnOnce(MemoryGenerator) -> MemoryGenerator,
) -> (Router, RouterState, Arc<MemoryGenerator>) {
    let model = ModelAssets::load(&fixture_dir()).expect("fixture model loads");
    let mut script = model.encode_chat(text).expect("encodes");
    script.push(IM_END);
    let generator = Arc::new(adjust(MemoryGenerator::new(script).with_eos(vec![IM_END])));
    let (router, state) = fixture_app(&generator);
    (router, state, generator)
}

/// POSTs `body` as JSON; returns the status and the raw response body.
pub async fn post_raw(router: &Router, path: &str, body: impl Into<Body>) -> (StatusCode, String) {
    let request = Request::post(path)
        .header("content-type", "application/json")
        .body(body.into())
        .expect("valid request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body readable");
    (
        status,
        String::from_utf8(bytes.to_vec()).expect("utf-8 body"),
    )
}

/// POSTs `body`; returns the status and the parsed JSON answer.
pub async fn post_json(router: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, text) = post_raw(router, path, body.to_string()).await;
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("answer is not JSON ({err}): {text:?}"));
    (status, value)
}

/// POSTs a streaming request; returns the status, the content type and each `data:` payload.
pub async fn post_sse(
    router: &Router,
    path: &str,
    body: Value,
) -> (StatusCode, String, Vec<String>) {
    let request = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("valid request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body readable");
    let text = String::from_utf8(bytes.to_vec()).expect("utf-8 body");
    (status, content_type, sse_data(&text))
}

/// The `data:` payloads of an SSE body, in order (comments and other fields skipped).
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// Parses every payload but a trailing `[DONE]` as JSON.
pub fn chunks(data: &[String]) -> Vec<Value> {
    data.iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|err| panic!("bad chunk {d:?}: {err}")))
        .collect()
}

/// GETs `path`; returns status and body text.
pub async fn get_text(router: &Router, path: &str) -> (StatusCode, String) {
    let request = Request::get(path)
        .body(Body::empty())
        .expect("valid request");
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body readable");
    (
        status,
        String::from_utf8(bytes.to_vec()).expect("utf-8 body"),
    )
}

/// Concatenated streamed text of a chat (`delta.content`) or completion (`text`) stream.
pub fn streamed_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|choice| {
            choice["delta"]["content"]
                .as_str()
                .or_else(|| choice["text"].as_str())
        })
        .collect()
}

/// The value of a metric line `name{labels} value` in Prometheus text, if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}
