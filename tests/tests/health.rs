//! Health ejection end to end: real router and (synthetic) worker processes on loopback. A
//! decode worker that stops answering (SIGSTOP: its sockets stay open, nothing is answered)
//! leaves rotation after `health.eject_after` failed polls, gets no request while out, and
//! comes back when it answers again (SIGCONT).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use std::time::Duration;
use tandem_e2e::{metrics_text, post, rt, Cluster, ClusterOptions};

/// `/admin/workers`' entry for worker `id`.
async fn worker(c: &reqwest::Client, url: &str, id: &str) -> Value {
    let all: Value = c
        .get(format!("{url}/admin/workers"))
        .send()
        .await
        .expect("GET /admin/workers")
        .json()
        .await
        .expect("JSON from /admin/workers");
    all["workers"]
        .as_array()
        .expect("workers list")
        .iter()
        .find(|w| w["id"] == id)
        .unwrap_or_else(|| panic!("no worker {id} in {all}"))
        .clone()
}

/// Polls `/admin/workers` (every 50 ms, up to 30 s) until worker `id`'s `state` is `state`;
/// its entry then.
async fn wait_state(c: &reqwest::Client, url: &str, id: &str, state: &str) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let w = worker(c, url, id).await;
        if w["state"] == state {
            return w;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} never became {state}: {w}"
        );
    }
}

/// Sends `n` completions one after another; each must succeed.
async fn serve_all(c: &reqwest::Client, url: &str, n: usize) {
    for i in 0..n {
        let (status, body) = post(
            c,
            &format!("{url}/v1/completions"),
            json!({"prompt": format!("request {i}"), "max_tokens": 4, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
}

#[test]
fn a_stopped_decode_worker_leaves_rotation_and_comes_back_when_it_answers() {
    let synthetic = vec![
        "--engine".to_string(),
        "synthetic".to_string(),
        "--synthetic-step".to_string(),
        "1ms".to_string(),
    ];
    let cluster = Cluster::start(ClusterOptions {
        second_decode: true,
        prefill_args: synthetic.clone(),
        decode_args: synthetic,
        router_config: "health: {interval: 200ms, eject_after: 3}\n".into(),
        ..ClusterOptions::default()
    });
    let url = cluster.url.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        // Round-robin: both decode workers take requests while healthy.
        serve_all(&c, &url, 4).await;
        let before = worker(&c, &url, "decode-1").await;
        assert!(before["routed"].as_u64().unwrap() > 0, "{before}");
        let instance = before["instance_id"].as_str().unwrap().to_owned();
        assert!(
            !instance.is_empty(),
            "the worker reports its instance: {before}"
        );

        cluster.signal("decode2", "STOP");
        let out = wait_state(&c, &url, "decode-1", "ejected").await;
        assert_eq!(out["ejected_by"], "health", "{out}");
        assert!(out["health_failures"].as_u64().unwrap() >= 3, "{out}");
        let routed = out["routed"].as_u64().unwrap();
        let metrics = metrics_text(&c, &url).await;
        assert!(
            metrics.contains("tandem_pool_workers{role=\"decode\",state=\"ejected\"} 1"),
            "{metrics}"
        );
        // Out of rotation: every request goes to decode-0 (one sent to the stopped worker
        // would stall until the first-token limit, a minute).
        serve_all(&c, &url, 8).await;
        assert_eq!(worker(&c, &url, "decode-0").await["state"], "active");

        cluster.signal("decode2", "CONT");
        let back = wait_state(&c, &url, "decode-1", "active").await;
        assert_eq!(
            back["routed"].as_u64().unwrap(),
            routed,
            "a request was routed to the ejected worker: {back}"
        );
        assert_eq!(back["ejected_by"], Value::Null, "{back}");
        assert_eq!(
            back["instance_id"],
            instance.as_str(),
            "a stop is no restart"
        );
        // Back in rotation: it takes requests again.
        serve_all(&c, &url, 4).await;
        let after = worker(&c, &url, "decode-1").await;
        assert!(after["routed"].as_u64().unwrap() > routed, "{after}");
    });
}
