//! The OpenAI HTTP surface over the fixture model and a scripted generator: answers, streams,
//! usage, finish reasons, stop strings, sampling parameters, models, health, metrics.

mod common;

use common::*;
use serde_json::{json, Value};
use std::sync::Arc;
use tandem_core::FinishReason;
use tandem_router::MemoryGenerator;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const ANSWER: &str = "hello world, héllo wörld € 🦀!";

fn chat_body(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]});
    merge(&mut body, extra);
    body
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
}

#[tokio::test]
async fn chat_answers_with_templated_prompt_and_usage() {
    let (router, state, generator) = app_answering(ANSWER);
    let (status, answer) = post_json(&router, CHAT, chat_body(json!({}))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], MODEL);
    assert!(answer["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    let choice = &answer["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(
        choice["message"]["content"], ANSWER,
        "<|im_end|> must not leak"
    );
    assert_eq!(choice["finish_reason"], "stop");

    let expected_prompt = encode(
        &state,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    );
    let sent = generator.requests();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].prompt_token_ids, expected_prompt);
    let completion_tokens = encode(&state, ANSWER).len() + 1; // + <|im_end|>
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": expected_prompt.len(), "completion_tokens": completion_tokens,
               "total_tokens": expected_prompt.len() + completion_tokens})
    );
}

#[tokio::test]
async fn chat_stream_concatenates_to_the_whole_answer() {
    let (router, _, generator) = app_answering(ANSWER);
    let (_, whole) = post_json(&router, CHAT, chat_body(json!({}))).await;
    let (status, content_type, data) =
        post_sse(&router, CHAT, chat_body(json!({"stream": true}))).await;
    assert_eq!(status, 200);
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks = chunks(&data);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        assert!(
            chunk.get("usage").is_none(),
            "usage only with include_usage"
        );
    }
    assert!(chunks.len() > 3, "the text arrives in several chunks");
    assert_eq!(
        streamed_text(&chunks),
        whole["choices"][0]["message"]["content"]
            .as_str()
            .expect("text")
    );
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null);
    }
    assert_eq!(generator.live_streams(), 0);
}

#[tokio::test]
async fn stream_usage_is_sent_last_when_asked() {
    let (router, _, _) = app_answering(ANSWER);
    let (_, whole) = post_json(&router, CHAT, chat_body(json!({}))).await;
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (_, _, data) = post_sse(&router, CHAT, body).await;
    let chunks = chunks(&data);
    let (usage_chunk, rest) = chunks.split_last().expect("chunks");
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"], whole["usage"]);
    for chunk in rest {
        assert_eq!(chunk["usage"], Value::Null);
        assert!(chunk.get("usage").is_some(), "usage: null on other chunks");
    }
}

#[tokio::test]
async fn completion_accepts_text_and_token_prompts() {
    let (router, state, generator) = app_answering(ANSWER);
    let (status, answer) = post_json(&router, COMPLETIONS, json!({"prompt": "hello"})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "text_completion");
    assert_eq!(answer["choices"][0]["text"], ANSWER);
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert_eq!(answer["usage"]["prompt_tokens"], 1);

    let ids = encode(&state, "hello world");
    for prompt in [json!(ids), json!([ids])] {
        let (status, answer) = post_json(
            &router,
            COMPLETIONS,
            json!({"model": MODEL, "prompt": prompt}),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["usage"]["prompt_tokens"], ids.len());
    }
    assert_eq!(generator.requests()[1].prompt_token_ids, ids);

    let body =
        json!({"prompt": "hello", "stream": true, "stream_options": {"include_usage": true}});
    let (status, _, data) = post_sse(&router, COMPLETIONS, body).await;
    assert_eq!(status, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks = chunks(&data);
    assert_eq!(streamed_text(&chunks), ANSWER);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[chunks.len() - 1]["usage"]["prompt_tokens"], 1);
}

#[tokio::test]
async fn max_tokens_ends_with_length() {
    let (router, state, _) = app_answering(ANSWER);
    for (path, mut body) in [
        (CHAT, chat_body(json!({"max_tokens": 3}))),
        (
            CHAT,
            chat_body(json!({"max_completion_tokens": 3, "max_tokens": 50})),
        ),
        (COMPLETIONS, json!({"prompt": "hello", "max_tokens": 3})),
    ] {
        let (status, answer) = post_json(&router, path, body.clone()).await;
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(answer["usage"]["completion_tokens"], 3);
        let ids = encode(&state, ANSWER);
        let text = state
            .model()
            .tokenizer()
            .decode(&ids[..3], true)
            .expect("decodes");
        let got = choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str());
        assert_eq!(got, Some(text.as_str()));

        merge(&mut body, json!({"stream": true}));
        let (_, _, data) = post_sse(&router, path, body).await;
        let chunks = chunks(&data);
        assert_eq!(streamed_text(&chunks), text);
        let last = chunks.last().expect("chunks");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
    }
}

#[tokio::test]
async fn stop_strings_truncate_and_cancel_generation() {
    // The generator stalls right after the stop string's tokens: the request only finishes
    // because the router drops the stream when it sees the stop string.
    let (_, state, _) = app_answering("");
    let stop_at = encode(&state, "hello world, h").len();
    let (router, _, generator) = app_with(ANSWER, |g| g.stalling_after(stop_at));
    for (path, body) in [
        (CHAT, chat_body(json!({"stop": ["nothing", "d, h"]}))),
        (COMPLETIONS, json!({"prompt": "x", "stop": "d, h"})),
    ] {
        // Were the stream not dropped, the stalled generator would never finish the request.
        let (status, answer) = within_10s(post_json(&router, path, body.clone())).await;
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str());
        assert_eq!(text, Some("hello worl"));
        assert_eq!(choice["finish_reason"], "stop");
        assert_eq!(
            choice["stop_reason"], "d, h",
            "the matched stop string: {answer}"
        );
        assert_eq!(answer["usage"]["completion_tokens"], stop_at);

        let mut body = body;
        merge(&mut body, json!({"stream": true}));
        let (_, _, data) = within_10s(post_sse(&router, path, body)).await;
        let chunks = chunks(&data);
        assert_eq!(streamed_text(&chunks), "hello worl");
        assert_eq!(
            chunks.last().expect("chunks")["choices"][0]["finish_reason"],
            "stop"
        );
        assert_eq!(
            chunks.last().expect("chunks")["choices"][0]["stop_reason"],
            "d, h"
        );
        generator.wait_for_live_streams(0).await;
    }
    // Stop strings stay in the router: the generator never sees them.
    assert!(generator
        .requests()
        .iter()
        .all(|r| r.sampling.stop_token_ids.is_empty()));
}

async fn within_10s<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(10), future)
        .await
        .expect("finished in time")
}

#[tokio::test]
async fn stop_string_split_across_multibyte_tokens() {
    let (router, _, _) = app_answering(ANSWER);
    let (status, answer) = post_json(&router, CHAT, chat_body(json!({"stop": "€ 🦀"}))).await;
    assert_eq!(status, 200);
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "hello world, héllo wörld "
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn sampling_parameters_reach_the_generator() {
    let (router, state, generator) = app_answering(ANSWER);
    let body = chat_body(json!({
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 42, "max_tokens": 10,
        "stop_token_ids": [7], "ignore_eos": true, "user": "ignored", "n": 1}));
    let (status, _) = post_json(&router, CHAT, body).await;
    assert_eq!(status, 200);
    let body = json!({"prompt": "hi", "temperature": 0, "top_k": -1, "max_tokens": 4});
    let (status, _) = post_json(&router, COMPLETIONS, body).await;
    assert_eq!(status, 200);
    let (status, _) = post_json(&router, COMPLETIONS, json!({"prompt": "hi"})).await;
    assert_eq!(status, 200);

    let sent = generator.requests();
    let s = &sent[0].sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.seed),
        (0.5, 0.9, 40, 42)
    );
    assert_eq!((s.max_tokens, s.ignore_eos), (10, true));
    assert_eq!(s.stop_token_ids, vec![7]);
    let s = &sent[1].sampling;
    assert_eq!((s.temperature, s.top_k, s.max_tokens), (0.0, 0, 4));
    let s = &sent[2].sampling;
    let context = state.model().context_length() as usize;
    let prompt = sent[2].prompt_token_ids.len();
    assert_eq!(s.max_tokens as usize, (context - prompt).min(256));
    assert_eq!((s.temperature, s.top_p, s.top_k), (1.0, 1.0, 0));
    assert!(!s.ignore_eos && s.stop_token_ids.is_empty());
    assert_ne!(sent[0].id, sent[1].id);
}

#[tokio::test]
async fn models_health_and_metrics() {
    let (router, state, _) = app_answering(ANSWER);
    let (status, text) = get_text(&router, "/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 256);

    let (status, text) = get_text(&router, "/health").await;
    assert_eq!((status.as_u16(), text.as_str()), (200, "ok"));
    state.set_ready(false);
    assert_eq!(get_text(&router, "/health").await.0, 503);
    state.set_ready(true);

    let (status, _) = post_json(&router, CHAT, chat_body(json!({}))).await;
    assert_eq!(status, 200);
    let (status, _) = post_json(&router, CHAT, chat_body(json!({"n": 30}))).await;
    assert_eq!(status, 400);
    let (status, text) = get_text(&router, "/metrics").await;
    assert_eq!(status, 200);
    let tokens = (encode(&state, ANSWER).len() + 1) as f64;
    for (series, expected) in [
        (
            r#"tandem_requests_total{endpoint="chat_completions",status="200"}"#,
            1.0,
        ),
        (
            r#"tandem_requests_total{endpoint="chat_completions",status="400"}"#,
            1.0,
        ),
        (
            r#"tandem_request_failures_total{class="invalid_request"}"#,
            1.0,
        ),
        ("tandem_time_to_first_token_seconds_count", 1.0),
        ("tandem_inter_token_latency_seconds_count", tokens - 1.0),
        ("tandem_e2e_request_latency_seconds_count", 1.0),
        ("tandem_requests_running", 0.0),
        ("tandem_generation_tokens_total", tokens),
    ] {
        assert_eq!(metric(&text, series), Some(expected), "{series} in\n{text}");
    }
    assert!(text.contains(r#"tandem_time_to_first_token_seconds_bucket{le="+Inf"} 1"#));
}

#[tokio::test]
async fn unknown_path_is_a_json_404() {
    let (router, _, _) = app_answering(ANSWER);
    let (status, text) = get_text(&router, "/v2/nothing").await;
    assert_eq!(status, 404);
    let body: Value = serde_json::from_str(&text).expect("json");
    assert!(body["error"]["message"].as_str().is_some());
}

#[tokio::test]
async fn finish_reason_comes_from_the_generator() {
    let generator = Arc::new(MemoryGenerator::new(vec![5, 6, 7]));
    let (router, _) = fixture_app(&generator);
    let (_, answer) = post_json(&router, COMPLETIONS, json!({"prompt": "x"})).await;
    // The script's last token carries Stop (as EOS would).
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        serde_json::to_value(FinishReason::Length).expect("serializes"),
        "length"
    );
}

#[tokio::test]
async fn the_stop_string_can_end_the_text() {
    let (router, _, _) = app_answering(ANSWER);
    let (_, answer) = post_json(
        &router,
        COMPLETIONS,
        json!({"prompt": "x", "stop": "wor", "include_stop_str_in_output": true}),
    )
    .await;
    assert_eq!(answer["choices"][0]["text"], "hello wor", "{answer}");
    let (_, answer) = post_json(&router, COMPLETIONS, json!({"prompt": "x", "stop": "wor"})).await;
    assert_eq!(answer["choices"][0]["text"], "hello ", "{answer}");
}

#[tokio::test]
async fn stop_reason_names_the_stop_token_and_is_null_at_eos() {
    let (router, state, _) = app_answering(ANSWER);
    let ids = encode(&state, ANSWER);
    // The memory generator stops at a listed stop token (finish "stop").
    let (_, answer) = post_json(
        &router,
        COMPLETIONS,
        json!({"prompt": "x", "stop_token_ids": [ids[1]]}),
    )
    .await;
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
    assert_eq!(answer["choices"][0]["stop_reason"], ids[1], "{answer}");
    let (_, answer) = post_json(&router, COMPLETIONS, json!({"prompt": "x"})).await;
    assert_eq!(answer["choices"][0]["stop_reason"], Value::Null, "{answer}");
}

#[tokio::test]
async fn a_wrong_method_is_a_json_405_naming_it() {
    let (router, _, _) = app_answering(ANSWER);
    let (status, text) = get_text(&router, "/v1/chat/completions").await;
    assert_eq!(status, 405);
    let body: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("GET")),
        "{body}"
    );
    let (status, body) = post_json(&router, "/v1/models", json!({})).await;
    assert_eq!(status, 405);
    assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
}

#[tokio::test]
async fn tokenize_detokenize_and_version() {
    let (router, state, _) = app_answering(ANSWER);
    let (status, body) = post_json(&router, "/tokenize", json!({"prompt": "hello world"})).await;
    assert_eq!(status, 200, "{body}");
    let ids: Vec<u32> = serde_json::from_value(body["tokens"].clone()).expect("ids");
    assert_eq!(
        ids,
        encode(&state, "hello world"),
        "the completion prompt's own tokens"
    );
    assert_eq!(body["count"], ids.len());
    assert_eq!(body["max_model_len"], state.model().context_length());
    let (status, chat) = post_json(
        &router,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{chat}");
    // The chat answer's usage counts exactly these prompt tokens.
    let (_, answer) = post_json(&router, "/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(answer["usage"]["prompt_tokens"], chat["count"], "{answer}");
    assert!(answer["system_fingerprint"]
        .as_str()
        .is_some_and(|f| f.starts_with("fp_tandem_")));
    let (status, back) = post_json(&router, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["prompt"], "hello world");
    for (path, body, param) in [
        ("/tokenize", json!({}), Value::Null),
        (
            "/tokenize",
            json!({"prompt": "x", "model": "other"}),
            json!("model"),
        ),
        (
            "/detokenize",
            json!({"tokens": [1, 999999]}),
            json!("tokens"),
        ),
        ("/detokenize", json!({}), json!("tokens")),
    ] {
        let (status, err) = post_json(&router, path, body.clone()).await;
        assert!(status == 400 || status == 404, "{path} {body}: {status}");
        assert_eq!(err["error"]["param"], param, "{path} {body}: {err}");
    }
    let (status, text) = get_text(&router, "/version").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
}

#[tokio::test]
async fn batched_prompts_answer_one_choice_each() {
    let (router, state, generator) = app_answering(ANSWER);
    let a = encode(&state, "hello");
    let b = encode(&state, "hello world");
    for prompt in [
        json!(["hello", "hello world"]),
        json!([a.clone(), b.clone()]),
    ] {
        let (status, answer) = post_json(&router, COMPLETIONS, json!({"prompt": prompt})).await;
        assert_eq!(status, 200, "{answer}");
        let choices = answer["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 2, "{answer}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i, "{answer}");
            assert_eq!(c["text"], ANSWER);
        }
        assert_eq!(
            answer["usage"]["prompt_tokens"],
            a.len() + b.len(),
            "{answer}"
        );
        assert!(answer["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmpl-")));
    }
    let prompts: Vec<Vec<u32>> = generator
        .requests()
        .iter()
        .map(|r| r.prompt_token_ids.clone())
        .collect();
    assert!(
        prompts.contains(&a) && prompts.contains(&b),
        "each prompt is its own request"
    );
    // Streamed: every choice's chunks, by index; one usage chunk over both; [DONE].
    let body = json!({"prompt": ["hello", "hello world"], "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, _, data) = post_sse(&router, COMPLETIONS, body).await;
    assert_eq!(status, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks = chunks(&data);
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        a.len() + b.len(),
        "{usage}"
    );
    for i in 0..2 {
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array()?.first().cloned())
            .filter(|c| c["index"] == i)
            .map(|c| c["text"].as_str().unwrap_or_default().to_string())
            .collect();
        assert_eq!(text, ANSWER, "choice {i}");
    }
    for (prompt, says) in [(json!([]), "1 to 64"), (json!(vec!["x"; 65]), "1 to 64")] {
        let (status, err) = post_json(&router, COMPLETIONS, json!({"prompt": prompt})).await;
        assert_eq!(status, 400, "{err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(says)),
            "{err}"
        );
    }
}

#[tokio::test]
async fn n_choices_are_separate_seeded_requests_and_count_the_prompt_once() {
    let (router, _, generator) = app_answering(ANSWER);
    let (status, answer) = post_json(
        &router,
        "/v1/chat/completions",
        chat_body(json!({"n": 3, "seed": 40, "temperature": 0.8})),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], ANSWER);
    }
    let seeds: Vec<u64> = generator
        .requests()
        .iter()
        .map(|r| r.sampling.seed)
        .collect();
    assert_eq!(
        seeds,
        vec![40, 41, 42],
        "one request per choice, seeds apart"
    );
    let prompt = generator.requests()[0].prompt_token_ids.len();
    assert_eq!(
        answer["usage"]["prompt_tokens"], prompt,
        "the prompt counts once"
    );
    // Streamed: each choice opens with its role chunk and ends with its finish chunk.
    let (status, _, data) = post_sse(
        &router,
        "/v1/chat/completions",
        chat_body(json!({"n": 2, "stream": true})),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks = chunks(&data);
    for i in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .collect();
        assert_eq!(
            mine[0]["choices"][0]["delta"]["role"], "assistant",
            "choice {i}"
        );
        let text: String = mine
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, ANSWER);
        assert!(mine
            .last()
            .is_some_and(|c| c["choices"][0]["finish_reason"] == "stop"));
    }
    for n in [0, 17] {
        let (status, err) =
            post_json(&router, "/v1/chat/completions", chat_body(json!({"n": n}))).await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], "n");
    }
}

#[tokio::test]
async fn echo_puts_the_prompt_before_the_answer_whole_streamed_and_batched() {
    let (router, state, _) = app_answering(ANSWER);
    let (status, answer) = post_json(
        &router,
        COMPLETIONS,
        json!({"prompt": "hello", "echo": true}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["text"], format!("hello{ANSWER}"));
    assert_eq!(
        answer["usage"]["prompt_tokens"], 1,
        "the echo is not generated"
    );

    let (_, _, data) = post_sse(
        &router,
        COMPLETIONS,
        json!({"prompt": "hello", "echo": true, "stream": true}),
    )
    .await;
    let chunks = chunks(&data);
    assert_eq!(
        chunks[0]["choices"][0]["text"], "hello",
        "the echo comes first"
    );
    assert_eq!(streamed_text(&chunks), format!("hello{ANSWER}"));

    // Token prompts echo their text; a batch echoes each prompt in its own choice.
    let ids = encode(&state, "hello world");
    let (_, answer) = post_json(
        &router,
        COMPLETIONS,
        json!({"prompt": [ids.clone(), encode(&state, "hello")], "echo": true}),
    )
    .await;
    assert_eq!(answer["choices"][0]["text"], format!("hello world{ANSWER}"));
    assert_eq!(answer["choices"][1]["text"], format!("hello{ANSWER}"));
    // Without echo, nothing is added.
    let (_, answer) = post_json(&router, COMPLETIONS, json!({"prompt": ids, "echo": false})).await;
    assert_eq!(answer["choices"][0]["text"], ANSWER);
}
