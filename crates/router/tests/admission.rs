//! Admission over a socket: a router on loopback with API keys and an `admission` section
//! parsed from YAML, in front of a generator that serves one request at a time. The official
//! `openai` client sees a limited key's 429s (with `Retry-After`) while another key passes;
//! requests of a higher priority queued later are served before lower ones queued earlier.

mod common;

use common::*;
use futures::stream;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tandem_core::FinishReason;
use tandem_router::auth::{require, ApiKeys};
use tandem_router::{
    app, GenerateFuture, GeneratedToken, Generator, ModelAssets, RouterConfig, RouterState,
    ValidGenerateRequest,
};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

/// Answers one token at once, except the first request, whose token waits until the test
/// releases it. Records each request's `max_tokens` (the tests' label for it) in the order
/// the requests reach it.
struct OneAtATime {
    served: Mutex<Vec<u32>>,
    started: watch::Sender<usize>,
    hold: Mutex<Option<oneshot::Receiver<()>>>,
}

impl Generator for OneAtATime {
    fn generate(&self, request: ValidGenerateRequest) -> GenerateFuture {
        self.served
            .lock()
            .expect("not poisoned")
            .push(request.sampling.max_tokens);
        self.started.send_modify(|n| *n += 1);
        let hold = self.hold.lock().expect("not poisoned").take();
        let token = GeneratedToken {
            token_id: IM_END,
            finish_reason: Some(FinishReason::Stop),
            logprobs: None,
            prompt_logprobs: Vec::new(),
        };
        let tokens = stream::once(async move {
            if let Some(hold) = hold {
                let _ = hold.await;
            }
            Ok(token)
        });
        Box::pin(async move { Ok(Box::pin(tokens) as tandem_router::TokenStream) })
    }
}

/// A router on loopback over `generator`, configured by `yaml` (its `auth` and `admission`).
async fn serve(yaml: &str, generator: Arc<dyn Generator>) -> (String, RouterState) {
    let config = RouterConfig::from_yaml(&format!(
        "listen: 127.0.0.1:0\nmodel: {{served_name: {MODEL}}}\n\
         aggregated: [{{id: a0, address: 'http://127.0.0.1:9'}}]\n{yaml}"
    ))
    .expect("valid config");
    let model = ModelAssets::load(&fixture_dir()).expect("fixture model loads");
    let state = RouterState::with_assets(generator, MODEL, model);
    state.admission().configure(config.admission.clone());
    let keys = ApiKeys::from_config(&config.auth)
        .expect("keys")
        .expect("keys configured");
    let router = app(state.clone()).layer(axum::middleware::from_fn_with_state(keys, require));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    (base, state)
}

/// The value of the unlabelled metric `name` in the router's exposition.
async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in {text}"))
}

/// Waits (up to 20 s) until the router's admission queue holds `depth` requests.
async fn queue_reaches(client: &reqwest::Client, base: &str, depth: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while metric(client, base, "tandem_admission_queue_depth").await != depth {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queue never held {depth} requests"
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_key_gets_429s_with_retry_after_while_another_key_passes() {
    let model = ModelAssets::load(&fixture_dir()).expect("fixture model loads");
    let mut script = model.encode_chat("fine").expect("encodes");
    script.push(IM_END);
    let generator = Arc::new(tandem_router::MemoryGenerator::new(script).with_eos(vec![IM_END]));
    // One request every five seconds, two at once: a burst of five gets two through.
    let (base, _state) = serve(
        "auth: {api_keys: ['sk-batch batch', 'sk-interactive interactive']}\n\
         admission:\n  keys:\n    batch: {limits: {requests_per_second: 0.2, requests_burst: 2}}\n",
        generator,
    )
    .await;
    let script = format!(
        r#"
import openai
def burst(key):
    c = openai.OpenAI(base_url="{base}/v1", api_key=key, max_retries=0)
    got = []
    for _ in range(5):
        try:
            c.completions.create(model="{MODEL}", prompt="Hi", max_tokens=2)
            got.append("ok")
        except openai.RateLimitError as e:
            assert e.status_code == 429, e
            assert e.body["code"] == "rate_limit_exceeded" and e.body["type"] == "requests", e.body
            assert "this API key" in e.body["message"], e.body
            wait = int(e.response.headers["retry-after"])
            assert 1 <= wait <= 5, wait
            got.append("429")
    return got
batch = burst("sk-batch")
assert batch == ["ok", "ok", "429", "429", "429"], batch
interactive = burst("sk-interactive")
assert interactive == ["ok"] * 5, interactive
print("ok")
"#
    );
    let out = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(&script)
        .output()
        .await
        .expect("python3");
    assert!(
        out.status.success(),
        "python failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let client = reqwest::Client::new();
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    assert!(
        text.contains("tandem_admission_rejections_total{reason=\"key_requests\"} 3"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn higher_priority_requests_queued_later_are_served_first() {
    let (release, hold) = oneshot::channel();
    let generator = Arc::new(OneAtATime {
        served: Mutex::new(Vec::new()),
        started: watch::Sender::new(0),
        hold: Mutex::new(Some(hold)),
    });
    // The batch key's requests default to priority 10; the interactive key's to 0.
    let (base, _state) = serve(
        "auth: {api_keys: ['sk-batch batch', 'sk-interactive interactive']}\n\
         admission:\n  max_running: 1\n  queue_timeout: 60s\n  keys:\n    batch: {priority: 10}\n",
        generator.clone(),
    )
    .await;
    let client = reqwest::Client::new();
    let send = |key: &'static str, label: u32, priority: Option<i64>| {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let mut body = serde_json::json!({"model": MODEL, "prompt": "Hi", "max_tokens": label});
            if let Some(p) = priority {
                body["priority"] = p.into();
            }
            let resp = client
                .post(format!("{base}/v1/completions"))
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .expect("sent");
            assert_eq!(resp.status(), 200, "request {label}");
        })
    };
    // Request 1 holds the one place until released.
    let mut requests = vec![send("sk-interactive", 1, None)];
    let mut started = generator.started.subscribe();
    started
        .wait_for(|&n| n == 1)
        .await
        .expect("generator lives");
    // Three batch requests queue, then two interactive ones and a batch request asking for
    // priority -1 itself.
    for label in [11, 12, 13] {
        requests.push(send("sk-batch", label, None));
        queue_reaches(&client, &base, f64::from(label - 10)).await;
    }
    for (label, key, priority) in [
        (21, "sk-interactive", None),
        (22, "sk-interactive", None),
        (23, "sk-batch", Some(-1)),
    ] {
        requests.push(send(key, label, priority));
        queue_reaches(&client, &base, f64::from(label - 17)).await;
    }
    release.send(()).expect("request 1 waits");
    for r in requests {
        r.await.expect("request task");
    }
    assert_eq!(
        *generator.served.lock().expect("not poisoned"),
        [1, 23, 21, 22, 11, 12, 13],
        "served by priority, then arrival"
    );
    assert_eq!(
        metric(&client, &base, "tandem_admission_queue_wait_seconds_count").await,
        7.0
    );
    assert_eq!(
        metric(&client, &base, "tandem_admission_queue_depth").await,
        0.0
    );
}
