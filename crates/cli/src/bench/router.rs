//! `tandem bench router`: what the router adds to a request's latency, at a fixed arrival
//! rate, against in-process null workers that answer at once (no model): a prefill worker
//! returning a first token, a decode worker streaming the rest without delay. The baseline, measured in
//! the same run, is the same P/D exchange made directly over gRPC (Decode, Prefill, read the
//! stream) with no router; the difference of the two latencies is the router's share (HTTP,
//! validation, tokenization, routing, detokenization, SSE/JSON). The router's own clock (its
//! service's time per request, which leaves out the load generator's HTTP client and the
//! loopback hop to the router) is reported beside it. With etcd installed it also measures how
//! long a newly registered worker takes to appear in the router's pools.

use anyhow::{Context, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_proto::v1 as pb;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// A worker that computes nothing: `Decode` names a target and streams `max_tokens - 1`
/// tokens at once, `Prefill` returns token 42.
#[derive(Clone, Default)]
struct NullWorker {
    reservations: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl pb::worker_server::Worker for NullWorker {
    type DecodeStream = ReceiverStream<Result<pb::DecodeEvent, Status>>;
    type GenerateStream = ReceiverStream<Result<pb::TokenEvent, Status>>;

    async fn decode(
        &self,
        req: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let r = req.into_inner().request.unwrap_or_default();
        let n = r.sampling.map_or(1, |s| s.max_tokens.max(1));
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let id = self.reservations.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let target = pb::KvTarget {
                transfer_address: String::new(),
                reservation_id: id,
                epoch: 1,
                layout: Some(pb::KvLayout::default()),
                landing: None,
                lease_ms: 0,
            };
            let _ = tx
                .send(Ok(pb::DecodeEvent {
                    event: Some(pb::decode_event::Event::KvTarget(target)),
                }))
                .await;
            for i in 1..n {
                let finish = if i + 1 == n {
                    pb::FinishReason::Length as i32
                } else {
                    pb::FinishReason::Unspecified as i32
                };
                let t = pb::TokenEvent {
                    token_id: 42 + i,
                    finish_reason: finish,
                    logprobs: None,
                    choice: 0,
                    prompt_logprobs: Vec::new(),
                };
                if tx
                    .send(Ok(pb::DecodeEvent {
                        event: Some(pb::decode_event::Event::Token(t)),
                    }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let r = req.into_inner().request.unwrap_or_default();
        let one = r.sampling.is_some_and(|s| s.max_tokens <= 1);
        Ok(Response::new(pb::PrefillResponse {
            first_token_id: 42,
            prompt_tokens: r.prompt_token_ids.len() as u32,
            kv_bytes_sent: 0,
            finish_reason: if one {
                pb::FinishReason::Length as i32
            } else {
                pb::FinishReason::Unspecified as i32
            },
            first_logprobs: None,
            other_choices: Vec::new(),
            prompt_logprobs: Vec::new(),
        }))
    }

    async fn generate(
        &self,
        _: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::invalid_argument(
            "the benchmark worker serves P/D (Decode, Prefill) only",
        ))
    }

    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(pb::StatsResponse {
            role: "null".into(),
            kv_blocks_total: 1 << 20,
            kv_blocks_free: 1 << 20,
            ..pb::StatsResponse::default()
        }))
    }

    async fn refresh_weights(
        &self,
        _: Request<pb::RefreshWeightsRequest>,
    ) -> Result<Response<pb::RefreshWeightsResponse>, Status> {
        Err(Status::invalid_argument(
            "the benchmark worker has no weights to refresh",
        ))
    }

    async fn drain(
        &self,
        _: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        Err(Status::invalid_argument(
            "the benchmark worker does not drain",
        ))
    }
}

async fn serve_null_worker() -> Result<String> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = format!("http://{}", l.local_addr()?);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::worker_server::WorkerServer::new(NullWorker::default()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    Ok(addr)
}

/// The P/D exchange without a router: what the router's own work is measured against.
async fn direct(
    prefill: &mut pb::worker_client::WorkerClient<tonic::transport::Channel>,
    decode: &mut pb::worker_client::WorkerClient<tonic::transport::Channel>,
    prompt: &[u32],
    max_tokens: u32,
) -> Result<()> {
    let request = pb::GenerateRequest {
        request_id: "bench".into(),
        prompt_token_ids: prompt.to_vec(),
        choices: 1,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            ..pb::SamplingParams::default()
        }),
    };
    let mut stream = decode
        .decode(pb::DecodeRequest {
            request: Some(request.clone()),
            dp_rank: None,
        })
        .await?
        .into_inner();
    let target = match stream.message().await? {
        Some(pb::DecodeEvent {
            event: Some(pb::decode_event::Event::KvTarget(t)),
        }) => t,
        other => anyhow::bail!("the benchmark worker answered {other:?}"),
    };
    prefill
        .prefill(pb::PrefillRequest {
            request: Some(request),
            kv_target: Some(target),
        })
        .await?;
    while stream.message().await?.is_some() {}
    Ok(())
}

/// Latencies of the requests the router answered, in microseconds, by its own clock.
#[derive(Clone, Default)]
struct RouterClock(Arc<std::sync::Mutex<Vec<f64>>>);

impl RouterClock {
    /// The latencies since the last call, sorted.
    fn take(&self) -> Vec<f64> {
        let mut v = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        v.sort_by(f64::total_cmp);
        v
    }
}

/// Middleware: times a request from its arrival at the router's service to its answer (a
/// whole JSON answer: the handler returns once the last token is in).
async fn time_request(
    axum::extract::State(clock): axum::extract::State<RouterClock>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let t = Instant::now();
    let response = next.run(req).await;
    let us = t.elapsed().as_secs_f64() * 1e6;
    clock.0.lock().unwrap_or_else(|e| e.into_inner()).push(us);
    response
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Sends `total` requests at `rate` per second (open loop: each at its time, whatever the
/// others do) through `send`; the sorted latencies in microseconds and the errors.
async fn open_loop<F, Fut>(rate: f64, total: usize, send: F) -> (Vec<f64>, usize)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let start = tokio::time::Instant::now();
    let gap = Duration::from_secs_f64(1.0 / rate);
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        tokio::time::sleep_until(start + gap * i as u32).await;
        let fut = send();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let ok = fut.await;
            (t.elapsed().as_secs_f64() * 1e6, ok)
        }));
    }
    let mut lat = Vec::with_capacity(total);
    let mut errors = 0;
    for t in tasks {
        match t.await {
            Ok((us, true)) => lat.push(us),
            _ => errors += 1,
        }
    }
    lat.sort_by(f64::total_cmp);
    (lat, errors)
}

/// Runs the benchmark: `rate` requests per second for `seconds`, `max_tokens` each.
pub fn run(
    rate: f64,
    seconds: f64,
    max_tokens: u32,
    json: Option<std::path::PathBuf>,
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let dir = crate::models::resolve(crate::models::DEFAULT_MODEL)?;
        let (p_addr, d_addr) = (serve_null_worker().await?, serve_null_worker().await?);
        let handle = |id: &str, a: &str| {
            tandem_router::pd::WorkerHandle::new(tandem_core::WorkerId(id.into()), a)
                .map_err(|e| anyhow::anyhow!(e.message))
        };
        let pd = Arc::new(tandem_router::pd::PdGenerator::new(
            vec![handle("p", &p_addr)?],
            vec![handle("d", &d_addr)?],
            tandem_router::pd::RetryPolicy::default(),
        ));
        let state = tandem_router::RouterState::new(
            Arc::new(tandem_router::pd::SharedPd(pd.clone())),
            &tandem_router::ModelInfo::new("bench", dir),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        // The router's own clock: each request from its arrival at the HTTP service to its
        // answer, without the load generator's HTTP client.
        let clock = RouterClock::default();
        let app = tandem_router::server::app(state).layer(axum::middleware::from_fn_with_state(
            clock.clone(),
            time_request,
        ));
        tokio::spawn(async move {
            let _ = axum::serve(tandem_router::server::no_delay(listener), app).await;
        });
        let total = (rate * seconds).round().max(1.0) as usize;
        let client = reqwest::Client::builder().pool_max_idle_per_host(512).build()?;
        let body = serde_json::json!({"model": "bench", "prompt": "The capital of France is",
                                      "max_tokens": max_tokens, "ignore_eos": true});
        let prompt = tandem_router::ModelInfo::new("bench", crate::models::resolve(crate::models::DEFAULT_MODEL)?)
            .load()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .encode_prompt("The capital of France is")
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut pc = pb::worker_client::WorkerClient::connect(p_addr.clone()).await?;
        let mut dc = pb::worker_client::WorkerClient::connect(d_addr.clone()).await?;
        // Warm both paths (connections, allocator) before measuring.
        for _ in 0..50 {
            direct(&mut pc, &mut dc, &prompt, max_tokens).await?;
            client.post(format!("{url}/v1/completions")).json(&body).send().await?.error_for_status()?;
        }
        println!("router benchmark: {total} requests at {rate:.0}/s, {max_tokens} tokens each, null workers (no model)");
        let mut rows = Vec::new();
        // A/B/A/B: direct gRPC (the baseline) and through the router, alternated.
        for round in 0..2 {
            let (pc2, dc2, prompt2) = (pc.clone(), dc.clone(), prompt.clone());
            let (d_lat, d_err) = open_loop(rate, total, move || {
                let (mut p, mut d, prompt) = (pc2.clone(), dc2.clone(), prompt2.clone());
                async move { direct(&mut p, &mut d, &prompt, max_tokens).await.is_ok() }
            })
            .await;
            clock.take();
            let (c2, u2, b2) = (client.clone(), url.clone(), body.clone());
            let (r_lat, r_err) = open_loop(rate, total, move || {
                let (c, u, b) = (c2.clone(), u2.clone(), b2.clone());
                async move {
                    match c.post(format!("{u}/v1/completions")).json(&b).send().await {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    }
                }
            })
            .await;
            let own = clock.take();
            let (d50, d99) = (percentile(&d_lat, 0.5), percentile(&d_lat, 0.99));
            let (r50, r99) = (percentile(&r_lat, 0.5), percentile(&r_lat, 0.99));
            let (o50, o99) = (percentile(&own, 0.5), percentile(&own, 0.99));
            println!(
                "  round {round}: direct gRPC p50 {d50:.0} µs p99 {d99:.0} µs ({d_err} errors) | through the router p50 {r50:.0} µs p99 {r99:.0} µs ({r_err} errors) | router adds p50 {:.0} µs, p99 {:.0} µs | router's own clock p50 {o50:.0} µs p99 {o99:.0} µs: adds p50 {:.0} µs",
                r50 - d50,
                r99 - d99,
                o50 - d50
            );
            rows.push(serde_json::json!({"direct_p50_us": d50, "direct_p99_us": d99, "router_p50_us": r50,
                "router_p99_us": r99, "added_p50_us": r50 - d50, "added_p99_us": r99 - d99,
                "router_own_p50_us": o50, "router_own_p99_us": o99, "added_own_p50_us": o50 - d50,
                "direct_errors": d_err, "router_errors": r_err}));
        }
        let scale_up = scale_up_delay(&pd).await;
        match &scale_up {
            Some(ms) => println!("  etcd: a registered worker reached the router's pools in {ms:.1} ms"),
            None => println!("  etcd: not measured (no `etcd` binary here)"),
        }
        if let Some(p) = json {
            let v = serde_json::json!({"rate": rate, "requests": total, "max_tokens": max_tokens,
                                       "rounds": rows, "scale_up_ms": scale_up});
            std::fs::write(&p, serde_json::to_string_pretty(&v)?).with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    })
}

/// Starts a throwaway etcd (when installed), registers a worker, and times until the router's
/// generator lists it.
async fn scale_up_delay(pd: &Arc<tandem_router::pd::PdGenerator>) -> Option<f64> {
    let etcd = tokio::task::spawn_blocking(tandem_discovery::local::LocalEtcd::try_start)
        .await
        .ok()?
        .ok()?;
    let client = etcd.url();
    let config =
        tandem_discovery::EtcdConfig::from_url(&client, "/bench", Duration::from_secs(10)).ok()?;
    let record = tandem_discovery::WorkerRecord {
        id: "late".into(),
        role: tandem_discovery::WorkerRole::Decode,
        address: "http://127.0.0.1:9".into(),
        layout: String::new(),
        model_id: String::new(),
        capacity: 0,
        state: tandem_discovery::WorkerState::Active,
    };
    let discovery: Arc<dyn tandem_discovery::Discovery> =
        Arc::new(tandem_discovery::EtcdDiscovery::start(config.clone()).ok()?);
    let mut rx = discovery.subscribe();
    let _ = tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|s| s.revision > 0)).await;
    tokio::spawn(pd.clone().follow(discovery));
    let started = Instant::now();
    let _reg = tandem_discovery::Registration::start(config, record)
        .await
        .ok()?;
    let seen = tokio::time::timeout(Duration::from_secs(10), async {
        while !pd.workers().iter().any(|w| w.id.0 == "late") {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    drop(etcd);
    seen.ok().map(|_| ms)
}
