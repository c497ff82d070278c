//! Pools that change under load: workers found through a real etcd, a worker added while
//! requests run, and workers drained (`tandem admin drain`, SIGTERM) mid-stream with nothing
//! lost and each drained process exiting 0.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_e2e::{tandem_bin, Cluster, ClusterOptions};
use tandem_proto::v1 as pb;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true, "stream": stream})
}

/// The text of a completion, streamed (SSE) or not; `None` if a stream did not end with
/// `[DONE]`.
async fn text_of(resp: reqwest::Response, stream: bool) -> Option<String> {
    if !stream {
        let v: Value = resp.json().await.ok()?;
        return v["choices"][0]["text"].as_str().map(str::to_owned);
    }
    let mut raw = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        raw.push_str(&String::from_utf8_lossy(&chunk.ok()?));
    }
    raw.contains("data: [DONE]").then(|| {
        raw.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
            .collect()
    })
}

/// Requests sent in a loop by `workers` tasks until `stop`; every answer is checked against
/// the fault-free `expected` text.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(url: &str, workers: usize, prompt: &'static str, expected: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let tasks = (0..workers)
            .map(|i| {
                let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
                let (url, expected) = (url.to_string(), expected.clone());
                tokio::spawn(async move {
                    let c = reqwest::Client::new();
                    while !stop.load(Ordering::Relaxed) {
                        let stream = i % 2 == 0;
                        sent.fetch_add(1, Ordering::Relaxed);
                        let resp = c
                            .post(format!("{url}/v1/completions"))
                            .json(&completion(prompt, 8, stream))
                            .send()
                            .await;
                        let outcome = match resp {
                            Ok(r) if r.status().is_success() => match text_of(r, stream).await {
                                Some(t) if t == expected => None,
                                Some(t) => Some(format!("different text: {t:?}")),
                                None => Some("a stream without [DONE]".into()),
                            },
                            Ok(r) => Some(format!(
                                "HTTP {}: {}",
                                r.status(),
                                r.text().await.unwrap_or_default()
                            )),
                            Err(e) => Some(format!("request error: {e}")),
                        };
                        if let Some(why) = outcome {
                            failed.lock().unwrap().push(why);
                        }
                    }
                })
            })
            .collect();
        Self {
            stop,
            sent,
            failed,
            tasks,
        }
    }

    /// Stops the load; (requests sent, failures).
    async fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let failed = self.failed.lock().unwrap().clone();
        (self.sent.load(Ordering::Relaxed), failed)
    }
}

async fn worker_client(addr: &str) -> pb::worker_client::WorkerClient<tonic::transport::Channel> {
    pb::worker_client::WorkerClient::connect(addr.to_string())
        .await
        .unwrap()
}

/// Resolves once the worker at `addr` holds KV for some request (it answers the stats call
/// at that moment), or after 60 s; whether it was busy.
async fn until_busy(addr: &str) -> bool {
    let s = worker_client(addr)
        .await
        .stats(pb::StatsRequest {
            wait_idle_ms: 0,
            wait_busy_ms: 60_000,
        })
        .await
        .unwrap()
        .into_inner();
    s.kv_blocks_free < s.kv_blocks_total
}

async fn fault_free(c: &reqwest::Client, url: &str, prompt: &str, max_tokens: u32) -> String {
    let resp = c
        .post(format!("{url}/v1/completions"))
        .json(&completion(prompt, max_tokens, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    text_of(resp, false).await.expect("a completion")
}

#[test]
fn workers_found_through_etcd_serve_and_a_new_decode_worker_takes_traffic_under_load() {
    let mut cluster = Cluster::start(ClusterOptions {
        discovery: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let runtime = rt();
    let c = reqwest::Client::new();
    let expected = runtime.block_on(fault_free(&c, &url, "The weather today", 8));
    let load = runtime.block_on(async { Load::start(&url, 3, "The weather today", expected) });
    // Scale up while the load runs: the new worker registers and the router sends it work.
    let late = cluster.add_worker("decode-late", "decode");
    let busy = runtime.block_on(until_busy(&late));
    let (sent, failed) = runtime.block_on(load.finish());
    assert!(busy, "the new decode worker never received a request");
    assert!(
        failed.is_empty(),
        "{} of {sent} failed: {failed:?}",
        failed.len()
    );
    let workers = runtime.block_on(tandem_e2e::workers_when_idle(&c, &url));
    let ids: Vec<&str> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["prefill", "decode", "decode-late"], "{workers}");
    assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
}

#[test]
fn draining_a_decode_and_a_prefill_worker_under_load_loses_nothing_and_both_exit_0() {
    let mut cluster = Cluster::start(ClusterOptions {
        discovery: true,
        second_decode: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let decode = cluster.decode_addr.clone();
    cluster.add_worker("prefill-2", "prefill");
    let runtime = rt();
    let c = reqwest::Client::new();
    let prompt = "Once upon a time";
    let long = runtime.block_on(fault_free(&c, &url, prompt, 40));
    let short = runtime.block_on(fault_free(&c, &url, "The weather today", 8));
    // Long streams in flight on both decode workers when the drains start.
    let streams: Vec<_> = (0..4)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            runtime.spawn(async move {
                let resp = c
                    .post(format!("{url}/v1/completions"))
                    .json(&completion(prompt, 40, true))
                    .send()
                    .await
                    .unwrap();
                text_of(resp, true).await
            })
        })
        .collect();
    let load = runtime.block_on(async { Load::start(&url, 2, "The weather today", short) });
    assert!(
        runtime.block_on(until_busy(&decode)),
        "no stream reached the first decode worker"
    );
    // Scale-down: the operator's command for the decode worker, SIGTERM for a prefill worker.
    let out = std::process::Command::new(tandem_bin())
        .args(["admin", "drain", "--worker", &decode])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("draining"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    cluster.signal("prefill", "TERM");
    let decode_exit = cluster.wait_exit("decode", Duration::from_secs(60));
    let prefill_exit = cluster.wait_exit("prefill", Duration::from_secs(60));
    let texts: Vec<Option<String>> = runtime.block_on(async {
        let mut out = Vec::new();
        for s in streams {
            out.push(s.await.unwrap());
        }
        out
    });
    let (sent, failed) = runtime.block_on(load.finish());
    assert!(
        decode_exit.success(),
        "the drained decode worker exited with {decode_exit}"
    );
    assert!(
        prefill_exit.success(),
        "the drained prefill worker exited with {prefill_exit}"
    );
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(t.as_deref(), Some(long.as_str()), "stream {i}");
    }
    // The drained workers finished their requests themselves: nothing had to migrate.
    let router = cluster.log("router");
    assert!(
        !router.contains("continuing on another pair"),
        "a stream was migrated instead of drained:\n{router}"
    );
    assert!(cluster
        .log("decode")
        .contains("drained: every request finished"));
    assert!(
        failed.is_empty(),
        "{} of {sent} failed: {failed:?}",
        failed.len()
    );
    // What is left serves, and holds nothing.
    assert_eq!(runtime.block_on(fault_free(&c, &url, prompt, 40)), long);
    let workers = runtime.block_on(tandem_e2e::workers_when_idle(&c, &url));
    let ids: Vec<&str> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["prefill-2", "decode2"],
        "the drained workers deregistered: {workers}"
    );
    assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
}

#[test]
fn a_full_pool_answers_503_with_retry_after_instead_of_piling_on() {
    let cluster = Cluster::start(ClusterOptions {
        router_config: "admission: {max_in_flight_per_worker: 1}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let decode = cluster.decode_addr.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let expected = fault_free(&c, &url, "Once upon a time", 48).await;
        // One long stream fills the only decode worker's single place.
        let long = {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let resp = c
                    .post(format!("{url}/v1/completions"))
                    .json(&completion("Once upon a time", 48, true))
                    .send()
                    .await
                    .unwrap();
                text_of(resp, true).await
            })
        };
        assert!(
            until_busy(&decode).await,
            "the stream never reached the decode worker"
        );
        let resp = c
            .post(format!("{url}/v1/completions"))
            .json(&completion("The weather today", 8, false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 503);
        assert_eq!(
            resp.headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap()),
            Some("1")
        );
        let body: Value = resp.json().await.unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("max_in_flight_per_worker"),
            "{body}"
        );
        assert_eq!(long.await.unwrap().as_deref(), Some(expected.as_str()));
        // Room again once the stream ended.
        assert_eq!(fault_free(&c, &url, "Once upon a time", 48).await, expected);
    });
}

#[test]
fn concurrent_streams_survive_a_kill_9_of_their_decode_worker_with_the_same_text() {
    let cluster = Cluster::start(ClusterOptions {
        second_decode: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let decode = cluster.decode_addr.clone();
    let runtime = rt();
    let c = reqwest::Client::new();
    let prompts = [
        "Once upon a time",
        "The weather today",
        "My favourite food",
        "In 1969",
    ];
    let expected: Vec<String> = prompts
        .iter()
        .map(|p| runtime.block_on(fault_free(&c, &url, p, 40)))
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (c, url, p) = (c.clone(), url.clone(), p.to_string());
            runtime.spawn(async move {
                let resp = c
                    .post(format!("{url}/v1/completions"))
                    .json(&completion(&p, 40, true))
                    .send()
                    .await
                    .unwrap();
                text_of(resp, true).await
            })
        })
        .collect();
    assert!(
        runtime.block_on(until_busy(&decode)),
        "no stream reached the first decode worker"
    );
    cluster.signal("decode", "KILL");
    for (i, s) in streams.into_iter().enumerate() {
        let text = runtime.block_on(s).unwrap();
        assert_eq!(
            text.as_deref(),
            Some(expected[i].as_str()),
            "stream {i} ({})",
            prompts[i]
        );
    }
    // The kill hit requests: mid-stream ones moved, ones still before their first token
    // were retried.
    let hit = cluster.wait_log_for("router", Duration::from_secs(10), |log| {
        log.contains("continuing on another pair") || log.contains("P/D attempt failed")
    });
    assert!(hit, "the kill hit nothing:\n{}", cluster.log("router"));
}

/// The router's `/admin/requests`.
async fn in_flight(c: &reqwest::Client, url: &str) -> Value {
    c.get(format!("{url}/admin/requests"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The names of an attempt's phases in `/admin/requests`, in order.
fn phase_names(attempt: &Value) -> Vec<&str> {
    attempt["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["phase"].as_str().unwrap())
        .collect()
}

#[test]
fn the_in_flight_table_shows_each_attempts_phases_while_a_stream_runs_and_forgets_it_after() {
    // The first prefill worker listed is dead (connections refused) and stays routable (no
    // ejection by health polls during the test): the first request's first attempt reserves
    // KV on the decode worker, fails on the prefill, and the second attempt streams.
    let cluster = Cluster::start(ClusterOptions {
        dead_workers: true,
        router_config: "health: {eject_after: 100}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let resp = c
            .post(format!("{url}/v1/completions"))
            .json(&completion("Once upon a time", 400, true))
            .send()
            .await
            .unwrap();
        let mut body = resp.bytes_stream();
        let mut seen = String::new();
        while seen.matches("\"text\"").count() < 2 {
            seen.push_str(&String::from_utf8_lossy(
                &body.next().await.unwrap().unwrap(),
            ));
        }
        // Hundreds of tokens still to come: the request is in the table, decoding.
        let table = in_flight(&c, &url).await;
        assert_eq!(table["count"], 1, "{table}");
        let r = &table["requests"][0];
        assert_eq!(r["phase"], "decoding", "{table}");
        assert_eq!(
            (r["prefill"].as_str(), r["decode"].as_str()),
            (Some("prefill-0"), Some("decode-0"))
        );
        assert!(r["tokens"].as_u64().unwrap() >= 2, "{table}");
        assert_eq!(r["attempts"], 2, "{table}");
        let history = r["history"].as_array().unwrap();
        assert_eq!(history.len(), 2, "{table}");
        let (failed, streaming) = (&history[0], &history[1]);
        assert_eq!(
            (failed["prefill"].as_str(), failed["decode"].as_str()),
            (Some("prefill-dead"), Some("decode-0")),
            "{table}"
        );
        assert_eq!(
            phase_names(failed),
            ["admitted", "decode_reserved", "prefilling", "failed"],
            "{table}"
        );
        assert_eq!(failed["phases"][3]["class"], "unavailable", "{table}");
        assert_eq!(
            phase_names(streaming),
            [
                "admitted",
                "decode_reserved",
                "prefilling",
                "kv_ready",
                "decoding"
            ],
            "{table}"
        );
        assert_eq!(streaming["resumed_after"], 0, "a retry, not a migration");
        let times: Vec<u64> = history
            .iter()
            .flat_map(|a| a["phases"].as_array().unwrap())
            .map(|t| t["at_ms"].as_u64().unwrap())
            .collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "{table}");
        assert!(
            r["phase_ms"].as_u64().unwrap() <= r["age_ms"].as_u64().unwrap(),
            "{table}"
        );
        let metrics = tandem_e2e::metrics_text(&c, &url).await;
        assert!(
            metrics.contains(r#"tandem_requests_in_phase{phase="decoding"} 1"#),
            "{metrics}"
        );
        // The client goes away: the request leaves the table (and its KV the worker).
        drop(body);
        let workers = tandem_e2e::workers_when_idle(&c, &url).await;
        assert!(tandem_e2e::pools_full(&workers, None), "{workers}");
        let table = in_flight(&c, &url).await;
        assert_eq!(table["count"], 0, "{table}");
        // Listed among the ended requests, its stream's attempt cancelled with its client.
        let ended = &table["ended"][0];
        assert_eq!(
            (&ended["phase"], &ended["class"]),
            (&json!("failed"), &json!("cancelled")),
            "{table}"
        );
        assert_eq!(ended["attempts"], 2, "{table}");
        let metrics = tandem_e2e::metrics_text(&c, &url).await;
        assert!(
            metrics.contains(r#"tandem_requests_in_phase{phase="decoding"} 0"#),
            "{metrics}"
        );
    });
}

/// The only decode worker dies and a new one registers a few seconds later (a restart, a
/// rescheduled pod): requests that arrive in between wait for it (`retry.outage_wait`, on by
/// default) and are answered with the fault-free text, streamed and whole, instead of failing
/// with "no workers".
#[test]
fn requests_sent_while_the_only_decode_worker_is_down_are_served_when_one_is_back() {
    let mut cluster = Cluster::start(ClusterOptions {
        discovery: true,
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    let runtime = rt();
    let c = reqwest::Client::new();
    let expected = runtime.block_on(fault_free(&c, &url, "The weather today", 8));
    cluster.signal("decode", "KILL");
    cluster.wait_exit("decode", Duration::from_secs(30));
    let waiting: Vec<_> = [false, true]
        .into_iter()
        .map(|stream| {
            let (c, url) = (c.clone(), url.clone());
            runtime.spawn(async move {
                let resp = c
                    .post(format!("{url}/v1/completions"))
                    .json(&completion("The weather today", 8, stream))
                    .send()
                    .await
                    .unwrap();
                let status = resp.status().as_u16();
                (status, text_of(resp, stream).await)
            })
        })
        .collect();
    // Both requests are in flight (waiting: nothing can serve them) before the replacement
    // starts, so they cannot have been served by it without waiting.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    runtime.block_on(async {
        while in_flight(&c, &url).await["count"] != 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the requests did not wait for a worker:\n{}",
                cluster.log("router")
            );
        }
    });
    cluster.add_worker("decode-back", "decode");
    for (i, w) in waiting.into_iter().enumerate() {
        let (status, text) = runtime.block_on(w).unwrap();
        assert_eq!(status, 200, "request {i}:\n{}", cluster.log("router"));
        assert_eq!(text.as_deref(), Some(expected.as_str()), "request {i}");
    }
    assert!(
        cluster
            .log("router")
            .contains("a worker is back: the request goes on"),
        "{}",
        cluster.log("router")
    );
}
