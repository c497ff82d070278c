//! Rejected requests and generator failures: OpenAI-shaped JSON errors with the right status,
//! in-band SSE errors after the stream started, failures counted by class — and the server
//! keeps answering afterwards.

mod common;

use common::*;
use serde_json::{json, Value};
use tandem_core::ErrorClass;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn assert_error_shape(body: &Value) {
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(error["type"].as_str().is_some(), "{body}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{body}"
    );
}

#[tokio::test]
async fn bad_requests_get_json_errors_then_a_good_one_succeeds() {
    let (router, _, _) = app_answering("hello");
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let long_prompt = "a ".repeat(200);
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        (CHAT, json!({}), 400, Some("messages")),
        (CHAT, json!({"messages": []}), 400, Some("messages")),
        (CHAT, json!({"messages": "Hi"}), 400, None),
        (
            CHAT,
            json!({"messages": [{"content": "no role"}]}),
            400,
            None,
        ),
        (
            CHAT,
            json!({"model": "gpt-4", "messages": msgs}),
            404,
            Some("model"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "max_tokens": 0}),
            400,
            Some("max_tokens"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "max_tokens": -5}),
            400,
            Some("max_tokens"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "max_completion_tokens": 0}),
            400,
            Some("max_completion_tokens"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "max_tokens": 250}),
            400,
            Some("max_tokens"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "temperature": 2.5}),
            400,
            Some("temperature"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "temperature": -0.1}),
            400,
            Some("temperature"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "temperature": "hot"}),
            400,
            None,
        ),
        (
            CHAT,
            json!({"messages": msgs, "top_p": 0}),
            400,
            Some("top_p"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "top_p": 1.5}),
            400,
            Some("top_p"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "top_k": -2}),
            400,
            Some("top_k"),
        ),
        (CHAT, json!({"messages": msgs, "n": 0}), 400, Some("n")),
        (CHAT, json!({"messages": msgs, "n": 0}), 400, Some("n")),
        (
            CHAT,
            json!({"messages": msgs, "stop": vec!["x"; 17]}),
            400,
            Some("stop"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "stop": [""]}),
            400,
            Some("stop"),
        ),
        (CHAT, json!({"messages": msgs, "stop": 5}), 400, None),
        (CHAT, json!({"messages": msgs, "stream": "yes"}), 400, None),
        (
            CHAT,
            json!({"messages": msgs, "logprobs": 2}),
            400,
            Some("logprobs"),
        ),
        (
            CHAT,
            json!({"messages": msgs, "tools": [{"type": "function"}]}),
            400,
            Some("tools"),
        ),
        (
            CHAT,
            json!({"messages": [{"role": "robot", "content": "beep"}]}),
            400,
            Some("messages"),
        ),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
            400,
            Some("messages"),
        ),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": long_prompt}]}),
            400,
            Some("messages"),
        ),
        (COMPLETIONS, json!({}), 400, Some("prompt")),
        (COMPLETIONS, json!({"prompt": ""}), 400, Some("prompt")),
        (COMPLETIONS, json!({"prompt": []}), 400, Some("prompt")),
        (
            COMPLETIONS,
            json!({"prompt": [1, 99999]}),
            400,
            Some("prompt"),
        ),
        (COMPLETIONS, json!({"prompt": [1, -1]}), 400, Some("prompt")),
        (
            COMPLETIONS,
            json!({"prompt": "x", "model": "other"}),
            404,
            Some("model"),
        ),
        (
            COMPLETIONS,
            json!({"prompt": "x", "stop_token_ids": [4096]}),
            400,
            Some("stop_token_ids"),
        ),
        (
            COMPLETIONS,
            json!({"prompt": "x", "max_tokens": 1.5}),
            400,
            None,
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, answer) = post_json(&router, path, body.clone()).await;
        assert_eq!(got.as_u16(), status, "{path} {body} -> {answer}");
        assert_error_shape(&answer);
        assert_eq!(
            answer["error"]["param"].as_str(),
            param,
            "{path} {body} -> {answer}"
        );
        if status == 404 {
            assert_eq!(answer["error"]["code"], "model_not_found");
        } else {
            assert_eq!(answer["error"]["type"], "invalid_request_error");
        }
        // The server is unaffected.
        let (ok, answer) = post_json(&router, path, good_body(path)).await;
        assert_eq!(ok, 200, "{answer}");
    }
}

fn good_body(path: &str) -> Value {
    if path == CHAT {
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    } else {
        json!({"prompt": "x", "model": MODEL})
    }
}

#[tokio::test]
async fn malformed_bodies_get_json_400() {
    let (router, _, _) = app_answering("hello");
    for body in ["{\"messages\": [", "", "not json", "[1, 2]"] {
        for path in [CHAT, COMPLETIONS] {
            let (status, text) = post_raw(&router, path, body).await;
            assert_eq!(status, 400, "{path} {body:?} -> {text}");
            let answer: Value = serde_json::from_str(&text).expect("JSON error body");
            assert_error_shape(&answer);
            assert_eq!(answer["error"]["type"], "invalid_request_error");
        }
    }
    let raise = json!({"messages": [{"role": "robot", "content": "beep"}]});
    let (_, answer) = post_json(&router, CHAT, raise).await;
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("roles must be"),
        "raise_exception text: {message}"
    );
}

#[tokio::test]
async fn admission_failures_map_to_statuses() {
    for (class, status, code) in [
        (ErrorClass::Unavailable, 503, "unavailable"),
        (ErrorClass::CapacityExhausted, 429, "capacity_exhausted"),
        (ErrorClass::TransferFailed, 502, "transfer_failed"),
        (ErrorClass::DeadlineExceeded, 504, "deadline_exceeded"),
        (ErrorClass::Internal, 500, "internal"),
    ] {
        let (router, _, _) = app_with("hello", |g| g.failing_on_admit(class));
        for stream in [false, true] {
            let body = json!({"prompt": "x", "stream": stream});
            let (got, answer) = post_json(&router, COMPLETIONS, body).await;
            assert_eq!(got.as_u16(), status, "{class:?} -> {answer}");
            assert_error_shape(&answer);
            assert_eq!(answer["error"]["code"], code);
            assert_eq!(answer["error"]["type"], "server_error");
        }
        let (_, metrics) = get_text(&router, "/metrics").await;
        let series = format!(r#"tandem_request_failures_total{{class="{code}"}}"#);
        assert_eq!(metric(&metrics, &series), Some(2.0), "{metrics}");
    }
}

#[tokio::test]
async fn failure_before_the_first_token_is_a_json_error_even_when_streaming() {
    let (router, _, generator) = app_with("hello world", |g| {
        g.failing_after(0, ErrorClass::TransferFailed)
    });
    let body = chat_body_stream(true);
    let (status, answer) = post_json(&router, CHAT, body).await;
    assert_eq!(status, 502);
    assert_eq!(answer["error"]["code"], "transfer_failed");
    assert_eq!(generator.live_streams(), 0);
}

fn chat_body_stream(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "Hi"}], "stream": stream})
}

#[tokio::test]
async fn failure_mid_stream_is_an_sse_error_without_done() {
    let (router, _, generator) = app_with("hello world", |g| {
        g.failing_after(2, ErrorClass::TransferFailed)
    });
    let (status, _, data) = post_sse(&router, CHAT, chat_body_stream(true)).await;
    assert_eq!(status, 200);
    assert!(!data.iter().any(|d| d == "[DONE]"), "{data:?}");
    let last: Value = serde_json::from_str(data.last().expect("events")).expect("json");
    assert_eq!(last["error"]["code"], "transfer_failed");
    assert_eq!(last["error"]["type"], "server_error");
    let chunks = chunks(&data[..data.len() - 1]);
    assert_eq!(streamed_text(&chunks), "hello world");
    assert!(chunks
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // Not streaming, the same failure is a plain JSON error: no partial text with a 200.
    let (status, answer) = post_json(&router, CHAT, chat_body_stream(false)).await;
    assert_eq!(status, 502, "{answer}");
    assert_eq!(generator.live_streams(), 0);

    let (_, metrics) = get_text(&router, "/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            r#"tandem_request_failures_total{class="transfer_failed"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &metrics,
            r#"tandem_requests_total{endpoint="chat_completions",status="502"}"#
        ),
        Some(2.0)
    );
    assert_eq!(metric(&metrics, "tandem_requests_running"), Some(0.0));
}

#[tokio::test]
async fn oversized_bodies_get_json_413() {
    let (router, _, _) = app_answering("hello");
    let body = format!(
        "{{\"prompt\": \"{}\"}}",
        "a".repeat(tandem_router::server::MAX_BODY_BYTES)
    );
    let (status, text) = post_raw(&router, COMPLETIONS, body).await;
    assert_eq!(status, 413);
    let answer: Value = serde_json::from_str(&text).expect("JSON error body");
    assert_error_shape(&answer);
}

/// A prompt that cannot fit whatever its tokens is refused from its size, before the
/// tokenizer runs over it (a body of megabytes would otherwise cost seconds of CPU).
#[tokio::test]
async fn a_huge_prompt_is_refused_before_tokenizing() {
    let (router, _, generator) = app_answering("hello");
    let huge = "word ".repeat(400_000);
    for (path, body, param) in [
        (COMPLETIONS, json!({"prompt": huge}), "prompt"),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": huge}]}),
            "messages",
        ),
    ] {
        let (status, answer) = post_json(&router, path, body).await;
        assert_eq!(status.as_u16(), 400, "{answer}");
        assert_eq!(answer["error"]["param"], param);
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("takes at least")),
            "refused by the size bound, not after tokenizing: {answer}"
        );
    }
    assert!(generator.requests().is_empty());
}
