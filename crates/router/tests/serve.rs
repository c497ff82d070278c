//! The router on a real loopback socket with a real HTTP client: streaming end to end, and a
//! client that disconnects mid-stream cancels its generation.

mod common;

use axum::body::Body;
use axum::http::Request;
use common::*;
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tandem_router::{serve_with_shutdown, MemoryGenerator, RouterState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tower::ServiceExt;

struct Server {
    base: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(state: RouterState) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let base = format!("http://{}", listener.local_addr().expect("bound"));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_with_shutdown(listener, state, async move {
            let _ = stopped.await;
        }));
        Self {
            base,
            stop: Some(stop),
            task,
        }
    }

    async fn shut_down(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await.expect("server task").expect("server ran");
    }
}

#[tokio::test]
async fn streams_over_a_socket() {
    let (_, state, _) = app_answering("hello world, héllo €");
    let server = Server::start(state).await;
    let client = reqwest::Client::new();

    let response = client
        .post(format!("{}/v1/chat/completions", server.base))
        .json(&json!({"messages": [{"role": "user", "content": "Hi"}], "stream": true}))
        .send()
        .await
        .expect("request sent");
    assert_eq!(response.status(), 200);
    let mut body = String::new();
    let mut stream = response.bytes_stream();
    while let Some(bytes) = stream.next().await {
        body.push_str(std::str::from_utf8(&bytes.expect("body chunk")).expect("utf-8"));
    }
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(streamed_text(&chunks(&data)), "hello world, héllo €");

    let models: Value = client
        .get(format!("{}/v1/models", server.base))
        .send()
        .await
        .expect("request sent")
        .json()
        .await
        .expect("json");
    assert_eq!(models["data"][0]["id"], MODEL);
    server.shut_down().await;
}

#[tokio::test]
async fn disconnect_over_a_socket_cancels_generation() {
    let (_, state, generator) = app_with("hello world stop", |g| g.stalling_after(2));
    let server = Server::start(state.clone()).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(&json!({"prompt": "x", "stream": true}))
        .send()
        .await
        .expect("request sent");
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let first = stream
        .next()
        .await
        .expect("a first chunk")
        .expect("readable");
    assert!(!first.is_empty());
    assert_eq!(generator.live_streams(), 1);
    drop(stream);
    // The server learns of the disconnect asynchronously; the stream's drop then records the
    // outcome synchronously, before this (current-thread) test task runs again.
    tokio::time::timeout(Duration::from_secs(10), generator.wait_for_live_streams(0))
        .await
        .expect("the server drops the generation when the client goes away");
    let text = state.metrics().render();
    assert_eq!(
        metric(
            &text,
            r#"tandem_requests_total{endpoint="completions",status="499"}"#
        ),
        Some(1.0)
    );
    server.shut_down().await;
}

#[tokio::test]
async fn dropping_the_response_body_cancels_generation() {
    let generator = Arc::new(
        MemoryGenerator::new(vec![5, 6, 7, 8])
            .with_eos(vec![IM_END])
            .stalling_after(1),
    );
    let (router, state) = fixture_app(&generator);
    let request = Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"prompt": "x", "stream": true}).to_string(),
        ))
        .expect("valid request");
    let response = router.oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body().into_data_stream();
    let first = body.next().await.expect("a frame").expect("readable");
    assert!(std::str::from_utf8(&first)
        .expect("utf-8")
        .starts_with("data: "));
    assert_eq!(generator.live_streams(), 1);
    assert_eq!(
        metric(&state.metrics().render(), "tandem_requests_running"),
        Some(1.0)
    );
    drop(body);
    assert_eq!(
        generator.live_streams(),
        0,
        "dropping the body drops the stream at once"
    );
    let text = state.metrics().render();
    assert_eq!(metric(&text, "tandem_requests_running"), Some(0.0));
    assert_eq!(
        metric(&text, r#"tandem_request_failures_total{class="cancelled"}"#),
        Some(1.0)
    );
}
