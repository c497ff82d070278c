//! Failures around a request's legs and the control plane's own load, end to end with real
//! processes: a decode worker dying while its prompt prefills, a router that can no longer
//! reach its workers, and synthetic workers (no model compute) carrying the whole path.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures::StreamExt;
use serde_json::json;
use tandem_e2e::{post, rt, Cluster, ClusterOptions};

/// A decode worker killed while its request's prompt is still prefilling: the router sees the
/// decode stream end, cancels the prefill at once (the prefill worker's engine stops
/// computing that prompt) and retries on the other decode worker, and the client gets the
/// answer. Without the cancellation the first prefill would run to its end before the
/// failure was noticed: the prefill worker would compute the prompt twice in full.
#[test]
fn a_prefill_stops_when_its_decode_worker_dies() {
    let cluster = Cluster::start(ClusterOptions {
        second_decode: true,
        prefill_args: vec!["--max-batch-tokens".to_string(), "16".to_string()],
        // The retried prefill runs 16 tokens a step on a loaded 2-core CI machine: the
        // default 60 s first-token limit is not what this test is about.
        router_config: "timeouts: {first_token: 300s}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let prefill = cluster.prefill_addr.clone();
    let prompt: Vec<u32> = (0..80 * 16).map(|i| 100 + (i * 7) % 1000).collect();
    let len = prompt.len() as u64;
    rt().block_on(async {
        let c = reqwest::Client::new();
        let mut worker = tandem_proto::v1::worker_client::WorkerClient::connect(prefill)
            .await
            .unwrap();
        let stats = |wait_busy_ms: u32| {
            let mut worker = worker.clone();
            async move {
                worker
                    .stats(tandem_proto::v1::StatsRequest {
                        wait_idle_ms: 0,
                        wait_busy_ms,
                    })
                    .await
                    .unwrap()
                    .into_inner()
            }
        };
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt,
                          "max_tokens": 4, "temperature": 0});
        let (c2, url2) = (c.clone(), url.clone());
        let request =
            tokio::spawn(async move { post(&c2, &format!("{url2}/v1/completions"), body).await });
        // The first attempt goes to the first decode worker (round-robin from the start).
        let busy = stats(60_000).await;
        assert!(
            busy.kv_blocks_total > busy.kv_blocks_free,
            "the prompt never reached the engine"
        );
        assert!(
            busy.prefill_tokens < len,
            "the first prefill ended before the kill"
        );
        cluster.signal("decode", "KILL");
        let (status, answer) = request.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["usage"]["prompt_tokens"], len);
        let after = stats(0).await;
        assert!(
            after.prefill_tokens < 2 * len,
            "the prefill of the first attempt ran on after its decode worker died: {} prompt \
             tokens computed for two attempts of {len}",
            after.prefill_tokens
        );
        let _ = &mut worker;
    });
}

/// `tandem worker --engine synthetic`: a P/D pair that computes nothing still goes through
/// every real component (router, both RPCs, the KV handoff over UCX, admission): concurrent
/// requests each get `max_tokens` tokens, the same prompt the same text, and the pools end
/// whole.
#[test]
fn synthetic_workers_serve_the_whole_path_without_a_model() {
    let synthetic = vec![
        "--engine".to_string(),
        "synthetic".to_string(),
        "--synthetic-step".to_string(),
        "1ms".to_string(),
    ];
    let cluster = Cluster::start(ClusterOptions {
        prefill_args: synthetic.clone(),
        decode_args: synthetic,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async move {
        let c = reqwest::Client::new();
        let comp_url = format!("{url}/v1/completions");
        let mut tasks = Vec::new();
        for i in 0..32 {
            let (c, comp_url) = (c.clone(), comp_url.clone());
            tasks.push(tokio::spawn(async move {
                let prompt = format!("request {}", i % 4);
                post(
                    &c,
                    &comp_url,
                    json!({"prompt": prompt, "max_tokens": 20, "temperature": 0}),
                )
                .await
            }));
        }
        let mut texts = std::collections::HashMap::new();
        for (i, t) in tasks.into_iter().enumerate() {
            let (status, body) = t.await.unwrap();
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["usage"]["completion_tokens"], 20, "{body}");
            let text = body["choices"][0]["text"].as_str().unwrap().to_string();
            let seen = texts.entry(i % 4).or_insert_with(|| text.clone());
            assert_eq!(*seen, text, "the same prompt gave another text");
        }
        let workers = tandem_e2e::workers_when_idle(&c, &url).await;
        assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
    });
}

/// The request's remaining time travels as the gRPC deadline: with the router stopped
/// (SIGSTOP: its connections stay open, it can tell the workers nothing), the decode worker
/// still ends a long generation at the request's 4 s limit and frees its KV, instead of
/// generating all 1,500 tokens for nobody.
#[test]
fn workers_end_a_request_at_its_deadline_when_the_router_cannot_tell_them() {
    let cluster = Cluster::start(ClusterOptions {
        router_config: "timeouts: {first_token: 30s, inter_token: 30s, request: 4s}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let decode = cluster.decode_addr.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let body = json!({"model": "smollm2-135m-instruct", "prompt": "Once upon a time",
                          "max_tokens": 1500, "temperature": 0, "stream": true,
                          "ignore_eos": true});
        let resp = c
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let mut stream = resp.bytes_stream();
        let mut seen = String::new();
        while let Some(chunk) = stream.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            if seen.matches("\"text\"").count() >= 2 {
                break;
            }
        }
        cluster.signal("router", "STOP");
        let mut worker = tandem_proto::v1::worker_client::WorkerClient::connect(decode)
            .await
            .unwrap();
        // 1,500 tokens take well over a minute here; the deadline ends them at 4 s.
        let stats = worker
            .stats(tandem_proto::v1::StatsRequest {
                wait_idle_ms: 30_000,
                wait_busy_ms: 0,
            })
            .await
            .unwrap()
            .into_inner();
        cluster.signal("router", "CONT");
        assert_eq!(
            stats.kv_blocks_free, stats.kv_blocks_total,
            "the decode worker still holds the request past its deadline: {stats:?}"
        );
        assert_eq!(stats.in_flight, 0, "{stats:?}");
        drop(stream);
    });
}

/// The stale-writer race at the workers themselves (no router to cancel the late prefill): a
/// decode reservation whose KV does not arrive within its 1 s lease is released; a prefill
/// that only then pushes to that stale target touches nobody's memory — its writer finds the
/// landing slot's fence cleared (nothing lands: `kv_bytes_landed` stays 0) and the message it
/// sends over the transport instead is dropped for its stale reservation — and the request
/// made next, on the blocks the first one held, answers as an undisturbed pair does, its KV
/// landing in shared memory as usual.
#[test]
fn a_push_to_an_expired_reservation_touches_nobody_elses_memory() {
    stale_push_case("auto");
}

/// As above, for a prefill worker that writes the slot with one-sided UCX operations (as one
/// on another host does): its remote claim of the released slot fails, so nothing is put.
#[test]
fn a_one_sided_write_to_an_expired_reservation_touches_nobody_elses_memory() {
    stale_push_case("put");
}

fn stale_push_case(landing: &str) {
    use tandem_proto::v1 as pb;
    if tandem_e2e::shm_free_bytes() < 32 << 20 {
        eprintln!("skipping: /dev/shm has less than 32 MiB free for landing arenas");
        return;
    }
    let cluster = Cluster::start(ClusterOptions {
        decode_args: vec!["--kv-lease".to_string(), "1s".to_string()],
        prefill_args: vec!["--kv-landing".to_string(), landing.to_string()],
        ..ClusterOptions::default()
    });
    let (url, prefill, decode) = (
        cluster.url.clone(),
        cluster.prefill_addr.clone(),
        cluster.decode_addr.clone(),
    );
    rt().block_on(async move {
        let request = pb::GenerateRequest {
            request_id: "stale".into(),
            prompt_token_ids: (0..40).map(|i| 200 + i * 3).collect(),
            choices: 1,
            sampling: Some(pb::SamplingParams {
                max_tokens: 4,
                ..Default::default()
            }),
        };
        let mut decoder = pb::worker_client::WorkerClient::connect(decode).await.unwrap();
        let mut stream = decoder
            .decode(pb::DecodeRequest {
                request: Some(request.clone()),
                dp_rank: None,
            })
            .await
            .unwrap()
            .into_inner();
        let target = match stream.next().await {
            Some(Ok(pb::DecodeEvent {
                event: Some(pb::decode_event::Event::KvTarget(t)),
            })) => t,
            other => panic!("expected the KV target first, got {other:?}"),
        };
        assert!(target.landing.is_some(), "a landing slot was offered: {target:?}");
        // The lease runs out: the decode side gives up and releases the reservation.
        let ended = stream.next().await;
        assert!(
            matches!(ended, Some(Err(_))),
            "the decode stream ends with an error when no KV arrives: {ended:?}"
        );
        let mut prefiller = pb::worker_client::WorkerClient::connect(prefill).await.unwrap();
        let landed = |mut w: pb::worker_client::WorkerClient<tonic::transport::Channel>| async move {
            w.stats(pb::StatsRequest::default())
                .await
                .unwrap()
                .into_inner()
                .kv_bytes_landed
        };
        let late = prefiller
            .prefill(pb::PrefillRequest {
                request: Some(request),
                kv_target: Some(target),
            })
            .await;
        assert!(late.is_ok(), "the late push itself goes out: {late:?}");
        assert_eq!(
            landed(prefiller.clone()).await,
            0,
            "the expired slot was not written"
        );
        let c = reqwest::Client::new();
        let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0,
                          "messages": [{"role": "user", "content": "What is the capital of France?"}]});
        let (status, answer) = post(&c, &format!("{url}/v1/chat/completions"), body).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            "The capital of France is Paris."
        );
        assert!(
            landed(prefiller).await > 0,
            "the next request's KV landed in shared memory"
        );
        let workers = tandem_e2e::workers_when_idle(&c, &url).await;
        assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
    });
}

/// A prompt that takes longer to prefill than the decode worker's KV lease (1 s here; the
/// prefill runs 16 tokens a step): the prefill worker extends the reservation's lease while
/// it computes, so the decode worker keeps waiting and the request succeeds on its first
/// pair. Without extensions every attempt's reservation would expire first.
#[test]
fn a_prefill_longer_than_the_kv_lease_keeps_its_reservation() {
    let cluster = Cluster::start(ClusterOptions {
        prefill_args: vec!["--max-batch-tokens".to_string(), "16".to_string()],
        decode_args: vec!["--kv-lease".to_string(), "1s".to_string()],
        // As above: a slow machine's prefill must not meet the first-token limit.
        router_config: "timeouts: {first_token: 300s}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let decode = cluster.decode_addr.clone();
    let prompt: Vec<u32> = (0..100 * 16).map(|i| 100 + (i * 7) % 1000).collect();
    let len = prompt.len() as u64;
    rt().block_on(async {
        let c = reqwest::Client::new();
        let body = json!({"model": "smollm2-135m-instruct", "prompt": prompt,
                          "max_tokens": 4, "temperature": 0});
        let (status, answer) = post(&c, &format!("{url}/v1/completions"), body).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["usage"]["prompt_tokens"], len);
        let mut worker = tandem_proto::v1::worker_client::WorkerClient::connect(decode)
            .await
            .unwrap();
        let stats = worker
            .stats(tandem_proto::v1::StatsRequest {
                wait_idle_ms: 10_000,
                wait_busy_ms: 0,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            stats.kv_lease_extensions >= 3,
            "the prefill ({len} tokens, 16 a step) outlasted the 1 s lease only {} extension \
             periods: the test needs a longer prefill",
            stats.kv_lease_extensions
        );
        assert_eq!(stats.pending_reservations, 0, "nothing left waiting");
    });
}
