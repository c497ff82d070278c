//! A real cluster (router, prefill worker, decode worker as separate processes, KV over UCX
//! on tcp) answering real HTTP clients. One cluster per test function keeps start-up cost
//! low; each function covers one area.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures::StreamExt;
use serde_json::{json, Value};

use tandem_e2e::{Cluster, ClusterOptions};

const FRANCE: &str = "What is the capital of France?";

use tandem_e2e::{post, rt};

/// Sends a streaming request; returns every `data:` payload before `[DONE]` and whether
/// `[DONE]` arrived.
async fn post_stream(client: &reqwest::Client, url: &str, body: Value) -> (Vec<Value>, bool) {
    let resp = client.post(url).json(&body).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut raw = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        raw.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(raw).expect("SSE body is valid UTF-8");
    let mut events = Vec::new();
    let mut done = false;
    for line in text.lines() {
        if let Some(data) = line.strip_prefix("data: ") {
            if data == "[DONE]" {
                done = true;
            } else {
                events.push(serde_json::from_str(data).unwrap());
            }
        }
    }
    (events, done)
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

/// The reference question answered non-streamed with the reference answer, and every live
/// pool whole afterwards.
async fn assert_answers_paris_and_holds_nothing(client: &reqwest::Client, url: &str) {
    let (status, body) = post(
        client,
        &format!("{url}/v1/chat/completions"),
        chat(FRANCE, 32, false),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "The capital of France is Paris."
    );
    assert_pools_full(client, url).await;
}

fn chat_deltas(events: &[Value]) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for e in events {
        if let Some(choice) = e["choices"].get(0) {
            if let Some(c) = choice["delta"]["content"].as_str() {
                assert!(
                    !c.contains('\u{FFFD}'),
                    "a chunk carries a broken character: {c:?}"
                );
                text.push_str(c);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}

/// Asserts every live worker's KV pool is full again once the workers report idle.
async fn assert_pools_full(client: &reqwest::Client, url: &str) {
    let workers = tandem_e2e::workers_when_idle(client, url).await;
    let list = workers["workers"].as_array().expect("workers list");
    assert!(list.len() >= 2, "{workers}");
    // Workers that are down (listed with an error) have no pool to check.
    let idle = list
        .iter()
        .filter(|w| w["error"].is_null())
        .all(|w| w["pending_reservations"] == 0 && w["running_requests"] == 0);
    assert!(
        idle && tandem_e2e::pools_full(&workers, None),
        "KV pools not back to full: {workers}"
    );
}

#[test]
fn answers_chat_and_completions_streamed_and_not() {
    let cluster = Cluster::start(ClusterOptions::default());
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let chat_url = format!("{url}/v1/chat/completions");
        let (status, body) = post(&c, &chat_url, chat(FRANCE, 32, false)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], "The capital of France is Paris.");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        assert_eq!(body["usage"]["prompt_tokens"], 37);
        assert_eq!(body["usage"]["completion_tokens"], 8);

        let (events, done) = post_stream(&c, &chat_url, chat(FRANCE, 32, true)).await;
        assert!(done, "stream ends with [DONE]");
        let (text, finish) = chat_deltas(&events);
        assert_eq!(text, "The capital of France is Paris.");
        assert_eq!(finish.as_deref(), Some("stop"));
        assert!(events.len() > 3, "streamed in several chunks");

        // Plain completion, no chat template: the reference continuation.
        let comp_url = format!("{url}/v1/completions");
        let req = json!({"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0});
        let (status, body) = post(&c, &comp_url, req.clone()).await;
        assert_eq!(status, 200, "{body}");
        let expected = " Paris.\n\nThe answer is: 2018-01-22 12:12:53.";
        assert_eq!(body["choices"][0]["text"], expected);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let (events, done) = post_stream(&c, &comp_url, sreq).await;
        assert!(done);
        let streamed: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
        assert_eq!(streamed, expected);

        // Length limit.
        let (_, body) = post(&c, &comp_url, json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})).await;
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], 3);
        assert_eq!(body["choices"][0]["text"], " Paris.\n");

        // max_tokens = 1: the prefill worker's token alone ends the request.
        let (_, body) = post(&c, &comp_url, json!({"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0})).await;
        assert_eq!(body["choices"][0]["text"], " Paris");
        assert_eq!(body["choices"][0]["finish_reason"], "length");

        // Stop string: cut before it, finish_reason stop.
        let (_, body) = post(&c, &comp_url, json!({"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "stop": ["answer"]})).await;
        assert_eq!(body["choices"][0]["text"], " Paris.\n\nThe ");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");

        // Seeded sampling is reproducible across the P/D split.
        let sampled = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234});
        let (_, a) = post(&c, &comp_url, sampled.clone()).await;
        let (_, b) = post(&c, &comp_url, sampled).await;
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

        let models: Value = c.get(format!("{url}/v1/models")).send().await.unwrap().json().await.unwrap();
        assert_eq!(models["data"][0]["id"], "smollm2-135m-instruct");
        let metrics = c.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("tandem_time_to_first_token_seconds_bucket"), "{metrics}");
        assert!(metrics.contains("tandem_inter_token_latency_seconds_bucket"));
        assert_pools_full(&c, &url).await;
    });
}

#[test]
fn multibyte_characters_arrive_whole() {
    let cluster = Cluster::start(ClusterOptions::default());
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let chat_url = format!("{url}/v1/chat/completions");
        let prompt = "Write the word 'thank you' in Japanese characters.";
        let (_, body) = post(&c, &chat_url, chat(prompt, 24, false)).await;
        let full = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            full.chars().any(|ch| ch.len_utf8() >= 3),
            "expected non-ASCII output, got {full:?}"
        );
        assert!(!full.contains('\u{FFFD}'), "{full:?}");
        let (events, _) = post_stream(&c, &chat_url, chat(prompt, 24, true)).await;
        let (text, _) = chat_deltas(&events);
        assert_eq!(text, full);
        assert_pools_full(&c, &url).await;
    });
}

#[test]
fn concurrent_requests_and_bad_inputs() {
    let cluster = Cluster::start(ClusterOptions::default());
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let chat_url = format!("{url}/v1/chat/completions");
        let comp_url = format!("{url}/v1/completions");
        let mut tasks = Vec::new();
        for i in 0..20 {
            let c = c.clone();
            let (chat_url, comp_url) = (chat_url.clone(), comp_url.clone());
            tasks.push(tokio::spawn(async move {
                if i % 2 == 0 {
                    let (events, _) = post_stream(&c, &chat_url, chat(FRANCE, 32, true)).await;
                    chat_deltas(&events).0 == "The capital of France is Paris."
                } else {
                    let (_, b) = post(&c, &comp_url, json!({"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0})).await;
                    b["choices"][0]["text"] == " Paris.\n\nThe answer is: 2018-01-22 12:12:53."
                }
            }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            assert!(t.await.unwrap(), "concurrent request {i} returned the wrong text");
        }

        let bad: Vec<(Value, u16)> = vec![
            (json!({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}), 404),
            (json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}), 400),
            (json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}), 400),
            (json!({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}), 400),
            (json!({"messages": []}), 400),
            (json!({"messages": [{"role": "user", "content": "word ".repeat(9000)}]}), 400),
            (json!({"messages": [{"role": "user", "content": "hi"}], "n": 17}), 400),
            (json!({"messages": [{"role": "user", "content": "hi"}], "temprature": 0}), 400),
        ];
        for (body, want) in bad {
            let resp = c.post(&chat_url).json(&body).send().await.unwrap();
            let status = resp.status().as_u16();
            let err: Value = resp.json().await.unwrap();
            assert_eq!(status, want, "{body} -> {err}");
            assert!(err["error"]["message"].is_string(), "OpenAI-style error body: {err}");
        }
        let resp = c.post(&chat_url).header("content-type", "application/json").body("{not json").send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 400);
        let err: Value = resp.json().await.unwrap();
        assert!(err["error"]["message"].is_string());
        // A client that disconnects mid-stream frees the KV on both workers.
        for _ in 0..3 {
            let mut body = chat("Tell me a very long story about a dragon.", 400, true);
            body["ignore_eos"] = json!(true);
            let resp = c.post(&chat_url).json(&body).send().await.unwrap();
            assert_eq!(resp.status().as_u16(), 200);
            tandem_e2e::read_then_disconnect(resp, 400).await;
        }
        assert_pools_full(&c, &url).await;
        let workers: Value = c.get(format!("{url}/admin/workers")).send().await.unwrap().json().await.unwrap();
        let decode = workers["workers"].as_array().unwrap().iter().find(|w| w["role"] == "decode").unwrap();
        assert_eq!(decode["cancelled_requests"], 3, "each disconnect cancelled its decode: {workers}");
        // The server still serves.
        let (status, body) = post(&c, &chat_url, chat(FRANCE, 32, false)).await;
        assert_eq!(status, 200);
        assert_eq!(body["choices"][0]["message"]["content"], "The capital of France is Paris.");
        assert_pools_full(&c, &url).await;
    });
}

#[test]
fn official_openai_python_client_streams_a_chat() {
    let cluster = Cluster::start(ClusterOptions::default());
    let script = format!(
        r#"
import openai
client = openai.OpenAI(base_url="{url}/v1", api_key="unused")
stream = client.chat.completions.create(model="smollm2-135m-instruct",
    messages=[{{"role": "user", "content": "What is the capital of France?"}}],
    max_tokens=32, temperature=0, stream=True)
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
print(text)
assert text == "The capital of France is Paris.", text
"#,
        url = cluster.url
    );
    tandem_e2e::python(&script, &cluster);
}

/// A prefill and a decode worker in the router's list are down: every request still completes
/// correctly (retried on the live pair before its first token), the router stays ready, and
/// /admin/workers names the dead ones.
#[test]
fn dead_workers_are_routed_around_and_nothing_is_lost() {
    // Dead workers are listed first: the even-numbered requests' first attempts hit both.
    let cluster = Cluster::start(ClusterOptions {
        kv_blocks: 256,
        dead_workers: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let chat_url = format!("{url}/v1/chat/completions");
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (c, chat_url) = (c.clone(), chat_url.clone());
            tasks.push(tokio::spawn(async move {
                post(&c, &chat_url, chat(FRANCE, 32, false)).await
            }));
        }
        for t in tasks {
            let (status, body) = t.await.unwrap();
            assert_eq!(status, 200, "{body}");
            assert_eq!(
                body["choices"][0]["message"]["content"],
                "The capital of France is Paris."
            );
        }
        let workers: Value = c
            .get(format!("{url}/admin/workers"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let dead: Vec<&Value> = workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["error"].is_string())
            .collect();
        assert_eq!(dead.len(), 2, "{workers}");
        // Each dead worker is out of rotation: its breaker took it out after failed attempts
        // (it may be back on probation by now if the requests took longer than the cooldown,
        // so the count of ejections is what is asserted, not the state at this instant), or
        // its failed health polls did before any request reached it.
        assert!(
            dead.iter()
                .all(|w| w["ejections"].as_u64() >= Some(1) || w["ejected_by"] == "health"),
            "dead workers should have been ejected: {workers}"
        );
        let live_ejected = workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| !w["error"].is_string() && w["ejections"] != 0)
            .count();
        assert_eq!(live_ejected, 0, "{workers}");
        assert_eq!(
            c.get(format!("{url}/ready"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
            200
        );
        // Live workers' pools are full again.
        assert_pools_full(&c, &url).await;
    });
}

/// A decode worker serving another checkpoint (same architecture, a different config) is
/// never handed KV computed by this one: the request fails as an invalid request naming the
/// mismatch, and both pools are whole.
#[test]
fn a_handoff_between_different_checkpoints_is_refused() {
    let smollm2 = tandem_testkit::smollm2_dir();
    let other = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&smollm2).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_owned();
        if name == "config.json" {
            let mut config: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            config["rms_norm_eps"] = json!(2e-5);
            std::fs::write(other.path().join(name), config.to_string()).unwrap();
        } else {
            std::os::unix::fs::symlink(&path, other.path().join(name)).unwrap();
        }
    }
    let cluster = Cluster::start(ClusterOptions {
        decode_model: Some(other.path().to_path_buf()),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let (status, body) = post(
            &c,
            &format!("{url}/v1/chat/completions"),
            chat(FRANCE, 8, false),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("different checkpoint"), "{body}");
        assert_pools_full(&c, &url).await;
    });
}

/// bf16 weights and K/V on both workers: the KV crosses in bf16 and the answer is the same.
#[test]
fn bf16_prefill_and_decode_answer_through_the_router() {
    let bf16 = vec!["--dtype".to_string(), "bf16".to_string()];
    let cluster = Cluster::start(ClusterOptions {
        prefill_args: bf16.clone(),
        decode_args: bf16,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let (status, body) = post(
            &c,
            &format!("{url}/v1/chat/completions"),
            chat(FRANCE, 32, false),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["choices"][0]["message"]["content"],
            "The capital of France is Paris."
        );
        let (events, done) = post_stream(
            &c,
            &format!("{url}/v1/chat/completions"),
            chat(FRANCE, 32, true),
        )
        .await;
        assert!(done);
        assert_eq!(chat_deltas(&events).0, "The capital of France is Paris.");
        assert_pools_full(&c, &url).await;
    });
}

/// Fairness through the router: a short prompt sent while a long one is prefilling on the
/// same prefill worker (16 tokens a step, so the long one needs 64 steps) gets its first
/// token while the long one is still prefilling. Under an oldest-first budget the long prompt
/// would hold every step and the short one's first token could only follow the end of the
/// long prefill. (The order is observed on the prefill worker itself: the long prompt still
/// holds its KV blocks there — a prompt frees them when its prefill ends — when the short
/// one's first token reaches the client.)
#[test]
fn a_short_prompt_behind_a_long_one_gets_its_first_token_during_the_long_prefill() {
    let cluster = Cluster::start(ClusterOptions {
        prefill_args: vec!["--max-batch-tokens".to_string(), "16".to_string()],
        // 16 tokens a step on a loaded 2-core CI machine: the default 60 s first-token limit
        // is not what this test is about.
        router_config: "timeouts: {first_token: 300s}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let prefill = cluster.prefill_addr.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        // KV blocks held on the prefill worker; with `wait_busy_ms`, once some are.
        let in_engine = |worker: &mut tandem_proto::v1::worker_client::WorkerClient<
            tonic::transport::Channel,
        >,
                         wait_busy_ms: u32| {
            let mut worker = worker.clone();
            async move {
                let stats = worker
                    .stats(tandem_proto::v1::StatsRequest {
                        wait_idle_ms: 0,
                        wait_busy_ms,
                    })
                    .await
                    .unwrap()
                    .into_inner();
                // KV blocks held: a prompt holds its blocks until its prefill is done.
                stats.kv_blocks_total - stats.kv_blocks_free
            }
        };
        let first_token = |prompt: Vec<u32>| {
            let (c, url) = (c.clone(), url.clone());
            let (first_tx, first_rx) = tokio::sync::oneshot::channel();
            let task = tokio::spawn(async move {
                let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt,
                                  "max_tokens": 1, "temperature": 0, "stream": true});
                let resp = c
                    .post(format!("{url}/v1/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status().as_u16(), 200);
                let mut stream = resp.bytes_stream();
                let mut seen = String::new();
                let mut first_tx = Some(first_tx);
                while let Some(chunk) = stream.next().await {
                    seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
                    if seen.contains("\"text\"") {
                        if let Some(tx) = first_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                }
                assert!(seen.contains("[DONE]"), "{seen}");
            });
            (task, first_rx)
        };
        let mut worker = tandem_proto::v1::worker_client::WorkerClient::connect(prefill)
            .await
            .unwrap();
        let (long, _) = first_token((0..64 * 16).map(|i| 100 + (i * 7) % 1000).collect());
        // The short prompt goes in once the long one is in the prefill worker's engine.
        assert!(
            in_engine(&mut worker, 60_000).await > 0,
            "the long prompt never reached the engine"
        );
        let (short, short_first) = first_token(vec![504, 3575, 282, 4649, 314]);
        short_first.await.unwrap();
        assert!(
            in_engine(&mut worker, 0).await >= 1,
            "the long prompt had finished prefilling before the short one's first token"
        );
        short.await.unwrap();
        long.await.unwrap();
        assert_pools_full(&c, &url).await;
    });
}

/// The config's timeouts are enforced: a decode worker stopped (SIGSTOP, not killed) in the
/// middle of a stream ends that stream with an in-band `deadline_exceeded` error after
/// `inter_token` instead of holding it; while it stays stopped, a new request gets no first
/// token, is retried (`first_token` each attempt) and fails with a 503 naming the stall; once
/// the worker resumes, requests are answered again and nothing is held.
#[test]
fn a_stalled_decode_worker_hits_the_configured_timeouts() {
    let cluster = Cluster::start(ClusterOptions {
        router_config: "timeouts: {first_token: 2s, inter_token: 1s, request: 60s}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let body = json!({"model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                          "max_tokens": 400, "temperature": 0, "stream": true, "ignore_eos": true});
        let resp = c
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let mut stream = resp.bytes_stream();
        let mut seen = String::new();
        let mut stopped = false;
        while let Some(chunk) = stream.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if !stopped && seen.contains("\"text\"") {
                cluster.signal("decode", "STOP");
                stopped = true;
            }
        }
        assert!(stopped, "no token arrived: {seen}");
        assert!(
            !seen.contains("[DONE]"),
            "the stalled stream claimed to finish"
        );
        assert!(
            seen.contains("deadline_exceeded") && seen.contains("inter_token"),
            "the stream should end with an inter-token timeout: {seen}"
        );
        // Still stopped: no first token on any attempt.
        let (status, body) = post(
            &c,
            &format!("{url}/v1/chat/completions"),
            chat(FRANCE, 8, false),
        )
        .await;
        assert_eq!(status, 503, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("no first token"),
            "{body}"
        );
        cluster.signal("decode", "CONT");
        assert_answers_paris_and_holds_nothing(&c, &url).await;
    });
}

/// Streams `body` and kills the first decode worker after four text chunks; the raw SSE.
async fn stream_killing_the_decode_worker(
    cluster: &Cluster,
    c: &reqwest::Client,
    body: &Value,
) -> String {
    // The first request goes to the first decode worker (round-robin from the start).
    let resp = c
        .post(format!("{}/v1/completions", cluster.url))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut stream = resp.bytes_stream();
    let mut raw = String::new();
    let mut killed = false;
    while let Some(chunk) = stream.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if !killed && raw.matches("\"text\"").count() >= 4 {
            cluster.signal("decode", "KILL");
            killed = true;
        }
    }
    assert!(killed, "the stream ended before the kill: {raw}");
    raw
}

/// Migration: the decode worker serving a stream is killed (-9) after a few tokens; the
/// router prefills the request again on the other pair with the tokens already sent
/// appended (as resumed output) and continues the same SSE stream from the new pair's
/// tokens — the client gets the whole answer once, ending in `[DONE]`, equal to an
/// uninterrupted run. Seeded sampling with penalties: the continuation draws what the
/// first pair would have drawn (the sampling step and the penalties count the resumed
/// tokens).
#[test]
fn a_stream_survives_the_death_of_its_decode_worker() {
    let cluster = Cluster::start(ClusterOptions {
        second_decode: true,
        ..ClusterOptions::default()
    });
    rt().block_on(async {
        let c = reqwest::Client::new();
        let mut body = json!({"model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                              "max_tokens": 48, "temperature": 0.8, "seed": 11,
                              "frequency_penalty": 0.5, "ignore_eos": true});
        body["stream"] = json!(true);
        let raw = stream_killing_the_decode_worker(&cluster, &c, &body).await;
        assert!(raw.contains("[DONE]"), "the stream did not finish: {raw}");
        let text = |raw: &str| -> String {
            raw.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
                .collect()
        };
        // The same request, uninterrupted (the surviving decode worker serves it).
        body["stream"] = json!(false);
        let (status, whole) = post(&c, &format!("{}/v1/completions", cluster.url), body).await;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(text(&raw), whole["choices"][0]["text"].as_str().unwrap());
        let metrics = tandem_e2e::metrics_text(&c, &cluster.url).await;
        assert!(
            metrics.lines().any(|l| l == "tandem_migrations_total 1"),
            "one migration counted: {metrics}"
        );
    });
}

/// `retry.migration_limit: 0`: a stream whose decode worker dies mid-generation is not
/// moved; it ends with an in-band error event and no `[DONE]`.
#[test]
fn with_migration_off_a_broken_stream_ends_with_an_error() {
    let cluster = Cluster::start(ClusterOptions {
        second_decode: true,
        router_config: "retry: {migration_limit: 0}\n".into(),
        ..ClusterOptions::default()
    });
    rt().block_on(async {
        let c = reqwest::Client::new();
        let body = json!({"model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                          "max_tokens": 48, "temperature": 0, "stream": true,
                          "ignore_eos": true});
        let raw = stream_killing_the_decode_worker(&cluster, &c, &body).await;
        assert!(
            !raw.contains("[DONE]"),
            "the stream finished although nothing moved it: {raw}"
        );
        assert!(raw.contains("\"error\""), "no error event: {raw}");
    });
}

/// P/D across Llama layouts: a prefill worker on 3 tensor-parallel CPU ranks (SmolLM2's 9
/// query and 3 KV heads split three ways) hands its K/V — gathered into the whole model's
/// layout — to a single-rank decode worker; the answer is the single-rank one.
#[test]
fn a_tp3_prefill_worker_hands_off_to_a_tp1_decode_worker() {
    let cluster = Cluster::start(ClusterOptions {
        prefill_args: vec!["--tp".to_string(), "3".to_string()],
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        assert_answers_paris_and_holds_nothing(&c, &url).await;
    });
}

/// Aggregated serving: one worker runs prefill and decode with no transfer; the router sends
/// it whole requests. Same greedy answers as P/D, streamed and not; nothing held afterwards.
#[test]
fn an_aggregated_worker_alone_answers_like_a_pd_pair() {
    let cluster = Cluster::start(ClusterOptions {
        pd_pair: false,
        aggregated: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let chat_url = format!("{url}/v1/chat/completions");
        let (status, body) = post(&c, &chat_url, chat(FRANCE, 32, false)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["choices"][0]["message"]["content"],
            "The capital of France is Paris."
        );
        let (events, done) = post_stream(&c, &chat_url, chat(FRANCE, 32, true)).await;
        assert!(done);
        assert_eq!(
            chat_deltas(&events),
            (
                "The capital of France is Paris.".to_string(),
                Some("stop".to_string())
            )
        );
        // One token only: the first token ends the request.
        let (status, body) = post(&c, &chat_url, chat(FRANCE, 1, false)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        let workers = tandem_e2e::workers_when_idle(&c, &url).await;
        let list = workers["workers"].as_array().expect("workers");
        assert_eq!(list.len(), 1, "{workers}");
        assert_eq!(list[0]["role"], "both");
        assert_eq!(list[0]["running_requests"], 0, "{workers}");
        assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        assert_eq!(
            list[0]["kv_bytes_transferred"], 0,
            "aggregated serving moves no KV"
        );
    });
}

/// An aggregated worker beside a P/D pair: requests go to both routes and all answer the same.
#[test]
fn aggregated_workers_serve_beside_pd_pairs() {
    let cluster = Cluster::start(ClusterOptions {
        aggregated: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let chat_url = format!("{url}/v1/chat/completions");
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let (c, chat_url) = (c.clone(), chat_url.clone());
            tasks.push(tokio::spawn(async move {
                post(&c, &chat_url, chat(FRANCE, 32, false)).await
            }));
        }
        for t in tasks {
            let (status, body) = t.await.unwrap();
            assert_eq!(status, 200, "{body}");
            assert_eq!(
                body["choices"][0]["message"]["content"],
                "The capital of France is Paris."
            );
        }
        let workers = tandem_e2e::workers_when_idle(&c, &url).await;
        let list = workers["workers"].as_array().expect("workers");
        let moved = |role: &str| {
            list.iter()
                .filter(|w| w["role"] == role)
                .map(|w| w["kv_bytes_transferred"].as_u64().unwrap_or(0))
                .sum::<u64>()
        };
        assert!(
            moved("prefill") > 0,
            "the P/D pair served some requests: {workers}"
        );
        assert_eq!(list.len(), 3, "{workers}");
        assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
    });
}

/// Prefill and decode on one host: each handoff is written straight into the decode
/// worker's shared-memory landing slot and only a completion record crosses UCX; with
/// `--kv-landing put` on the prefill worker (what a prefill worker on another host does) the
/// same slot is claimed and written with one-sided UCX operations over tcp instead; the
/// answers equal those of a pair whose decode worker offers no slot (every handoff over the
/// transport), and a prompt too long for its slot falls back to the transport.
#[test]
fn handoffs_land_in_the_decode_workers_memory_by_shm_or_one_sided_puts_and_answer_the_same() {
    if tandem_e2e::shm_free_bytes() < 32 << 20 {
        eprintln!("skipping: /dev/shm has less than 32 MiB free for landing arenas");
        return;
    }
    // SmolLM2 f32 K/V is ~46 KB a token: a 3 MiB arena takes the short prompt (~40 tokens
    // with the chat template), not the long one (~160).
    let long = format!(
        "Repeat after me: {}",
        "the quick brown fox jumps. ".repeat(20)
    );
    let mut answers = Vec::new();
    for (mib, landing) in [("3", "auto"), ("3", "put"), ("0", "auto")] {
        let cluster = Cluster::start(ClusterOptions {
            worker_env: vec![
                ("UCX_TLS".into(), "tcp".into()),
                ("TANDEM_KV_LANDING_MIB".into(), mib.into()),
            ],
            prefill_args: vec!["--kv-landing".into(), landing.into()],
            ..ClusterOptions::default()
        });
        let (url, long) = (cluster.url.clone(), long.clone());
        let got = rt().block_on(async move {
            let c = reqwest::Client::new();
            let chat_url = format!("{url}/v1/chat/completions");
            let (status, short) = post(&c, &chat_url, chat(FRANCE, 16, false)).await;
            assert_eq!(status, 200, "{short}");
            let landed_after_short = landed(&c, &url).await;
            let (status, long) = post(&c, &chat_url, chat(&long, 8, false)).await;
            assert_eq!(status, 200, "{long}");
            let landed_after_long = landed(&c, &url).await;
            assert_eq!(
                landed_after_long, landed_after_short,
                "the long prompt's handoff does not fit a 3 MiB arena: it went over the transport"
            );
            assert_pools_full(&c, &url).await;
            (
                short["choices"][0]["message"]["content"].clone(),
                long["choices"][0]["message"]["content"].clone(),
                landed_after_short,
            )
        });
        answers.push(got);
    }
    let without = &answers[2];
    for (with_slots, how) in [
        (&answers[0], "shared memory"),
        (&answers[1], "one-sided puts"),
    ] {
        assert_eq!(with_slots.0, "The capital of France is Paris.", "{how}");
        assert_eq!(
            (&with_slots.0, &with_slots.1),
            (&without.0, &without.1),
            "{how}"
        );
        let (prefill_wrote, decode_landed) = with_slots.2;
        assert!(
            prefill_wrote > 0,
            "the short prompt's handoff landed by {how}"
        );
        assert_eq!(
            prefill_wrote, decode_landed,
            "{how}: what the prefill wrote is what the decode took"
        );
    }
    assert_eq!(without.2, (0, 0), "no arena, no landing");
}

/// (prefill's, decode's) `kv_bytes_landed`, once the cluster is idle.
async fn landed(c: &reqwest::Client, url: &str) -> (u64, u64) {
    let workers = tandem_e2e::workers_when_idle(c, url).await;
    let list = workers["workers"].as_array().expect("workers");
    let of = |role: &str| {
        list.iter()
            .filter(|w| w["role"] == role)
            .map(|w| w["kv_bytes_landed"].as_u64().expect("kv_bytes_landed"))
            .sum::<u64>()
    };
    (of("prefill"), of("decode"))
}
