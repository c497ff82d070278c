//! Tests of the P/D generator: routing, retries, outage rounds, migration.

use super::workers::{LoadClaim, ERROR_CLASS_HEADER};
use super::*;
use tandem_proto::v1 as pb;

fn handles(prefix: &str, n: usize) -> Vec<WorkerHandle> {
    (0..n)
        .map(|i| {
            // Lazily connected: nothing listens, nothing is dialled by these tests.
            WorkerHandle::new(WorkerId(format!("{prefix}-{i}")), "http://127.0.0.1:9")
                .expect("address")
        })
        .collect()
}

#[test]
fn statuses_no_worker_classified_are_transport_failures_and_retried() {
    // What tonic makes of a sidecar's HTTP 502 with a text body.
    let e = classify_status(tonic::Status::internal(
        "protocol error: received message with invalid compression flag: 99",
    ));
    assert_eq!(e.class, ErrorClass::Unavailable);
    assert!(e.class.is_retryable());
    assert!(
        !e.message.contains("compression"),
        "transport details leak: {}",
        e.message
    );
    // A worker's own classification wins.
    let mut s = tonic::Status::internal("engine failed");
    s.metadata_mut()
        .insert(ERROR_CLASS_HEADER, "internal".parse().expect("ascii"));
    assert_eq!(classify_status(s).class, ErrorClass::Internal);
    assert_eq!(
        classify_status(tonic::Status::invalid_argument("bad")).class,
        ErrorClass::InvalidRequest
    );
    // A stream cancelled by a reset connection, not by the worker.
    assert_eq!(
        classify_status(tonic::Status::cancelled("h2 protocol error")).class,
        ErrorClass::Unavailable
    );
    let mut s = tonic::Status::cancelled("client went away");
    s.metadata_mut()
        .insert(ERROR_CLASS_HEADER, "cancelled".parse().expect("ascii"));
    assert_eq!(classify_status(s).class, ErrorClass::Cancelled);
}

#[tokio::test]
async fn an_ejected_worker_is_skipped_until_its_cooldown_ends() {
    let policy = crate::pd::breaker::BreakerPolicy {
        threshold: 2,
        cooldown: Duration::from_secs(3600),
    };
    let pd = PdGenerator::new(handles("p", 1), handles("d", 2), RetryPolicy::default())
        .with_breaker(policy);
    let pools = pd.pools();
    let (_, d) = pd.pick(&pools, 0, 0, &[]).expect("pair");
    assert_eq!(d.id.0, "d-0");
    for _ in 0..2 {
        pools.decode[0].report(Outcome::Failed(ErrorClass::Unavailable), policy);
    }
    assert!(pools.decode[0].is_ejected());
    for start in 0..4 {
        let (_, d) = pd.pick(&pools, 0, start, &[]).expect("pair");
        assert_eq!(
            d.id.0, "d-1",
            "start {start}: the ejected worker was chosen"
        );
    }
    // A bad request is the client's fault: it never ejects a worker.
    for _ in 0..5 {
        pools.decode[1].report(Outcome::Failed(ErrorClass::InvalidRequest), policy);
    }
    assert!(!pools.decode[1].is_ejected());
    // With every worker ejected, requests still go somewhere (and fail or probe there).
    for _ in 0..2 {
        pools.decode[1].report(Outcome::Failed(ErrorClass::Unavailable), policy);
    }
    assert!(pd.pick(&pools, 0, 1, &[]).is_some());
}

#[tokio::test]
async fn a_full_pool_holds_requests_until_a_claim_ends_or_the_queue_timeout() {
    let admission = |queue_ms| crate::config::AdmissionConfig {
        max_in_flight_per_worker: 1,
        queue_timeout: Duration::from_millis(queue_ms),
        ..crate::config::AdmissionConfig::default()
    };
    let pd = Arc::new(
        PdGenerator::new(handles("p", 1), handles("d", 2), RetryPolicy::default())
            .with_admission(admission(0)),
    );
    let pools = pd.pools();
    assert!(pd.admit().await.is_ok(), "empty pools have room");
    let a = pools.decode[0].claim();
    assert!(pd.admit().await.is_ok(), "d-1 still has room");
    let (_, d) = pd.pick(&pools, 0, 0, &[]).expect("pair");
    assert_eq!(d.id.0, "d-1", "a worker at its limit is not picked");
    let b = pools.decode[1].claim();
    let e = pd.admit().await.expect_err("both decode workers are full");
    assert_eq!(e.class, ErrorClass::Unavailable);
    assert!(
        e.message.contains("max_in_flight_per_worker"),
        "{}",
        e.message
    );
    drop((a, b));
    // With a queue, the request waits for the next release.
    let pd = Arc::new(
        PdGenerator::new(handles("p", 1), handles("d", 1), RetryPolicy::default())
            .with_admission(admission(60_000)),
    );
    let full = pd.pools().decode[0].claim();
    let queued = {
        let pd = pd.clone();
        tokio::spawn(async move { pd.admit().await })
    };
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!queued.is_finished(), "admitted although the pool is full");
    drop(full);
    assert!(queued.await.expect("task").is_ok());
}

#[tokio::test]
async fn power_of_two_and_cache_aware_route_by_load_and_prefix() {
    let pd = PdGenerator::new(handles("p", 2), handles("d", 2), RetryPolicy::default())
        .with_policy(crate::pd::policy::Policy::PowerOfTwo);
    let pools = pd.pools();
    // d-0 carries three streams of this router's: with two workers both are always
    // drawn, and the idle one wins every time.
    let busy: Vec<LoadClaim> = (0..3).map(|_| pools.decode[0].claim()).collect();
    for start in 0..8 {
        let (_, d) = pd.pick(&pools, start, start, &[]).expect("pair");
        assert_eq!(d.id.0, "d-1", "start {start}");
    }
    drop(busy);
    assert_eq!(pools.decode[0].load(), 0, "claims are released");

    let pd = PdGenerator::new(handles("p", 3), handles("d", 1), RetryPolicy::default())
        .with_policy(crate::pd::policy::Policy::CacheAware { balance: 2 });
    let pools = pd.pools();
    let prompt: Vec<u32> = (0..80).collect();
    let (first, _) = pd.pick(&pools, 0, 0, &prompt).expect("pair");
    // The same prompt (or one sharing its prefix) goes back to the same worker from
    // any round-robin position...
    let mut longer = prompt.clone();
    longer.extend(500..540);
    for start in 0..6 {
        let (p, _) = pd.pick(&pools, start, 0, &longer).expect("pair");
        assert_eq!(p.id, first.id, "start {start}");
    }
    // ...until that worker is too much busier than the others.
    let owner = pools
        .prefill
        .iter()
        .find(|w| w.id == first.id)
        .expect("known");
    let busy: Vec<LoadClaim> = (0..3).map(|_| owner.claim()).collect();
    let (p, _) = pd.pick(&pools, 0, 0, &prompt).expect("pair");
    assert_ne!(p.id, first.id, "balance wins over the cache hit");
    drop(busy);
}

fn record(
    id: &str,
    role: tandem_discovery::WorkerRole,
    draining: bool,
) -> tandem_discovery::WorkerRecord {
    tandem_discovery::WorkerRecord {
        id: id.into(),
        role,
        address: format!("http://127.0.0.{}:9", id.len()),
        layout: String::new(),
        model_id: String::new(),
        capacity: 0,
        state: if draining {
            tandem_discovery::WorkerState::Draining
        } else {
            tandem_discovery::WorkerState::Active
        },
    }
}

#[tokio::test]
async fn discovered_workers_join_leave_and_drain_keeping_the_handles_of_known_ones() {
    use tandem_discovery::{WorkerRole, WorkerSet};
    let pd = PdGenerator::new(Vec::new(), Vec::new(), RetryPolicy::default());
    assert_eq!(pd.pools().routes(), 0, "nothing to route to yet");
    let set = |records: Vec<tandem_discovery::WorkerRecord>| WorkerSet {
        workers: records.into_iter().map(|r| (r.id.clone(), r)).collect(),
        revision: 1,
    };
    pd.set_workers(&set(vec![
        record("p", WorkerRole::Prefill, false),
        record("d0", WorkerRole::Decode, false),
    ]));
    let first = pd.pools();
    assert_eq!(first.routes(), 1);
    first.decode[0].report(
        Outcome::Failed(ErrorClass::Unavailable),
        crate::pd::breaker::BreakerPolicy::default(),
    );
    // A scale-up: d1 joins; d0 keeps its handle (the failure it had is still counted).
    pd.set_workers(&set(vec![
        record("p", WorkerRole::Prefill, false),
        record("d0", WorkerRole::Decode, false),
        record("d1", WorkerRole::Decode, false),
        record("both", WorkerRole::Both, false),
    ]));
    let second = pd.pools();
    assert_eq!(second.decode.len(), 2);
    assert_eq!(second.routes(), 2, "the pairs and one aggregated worker");
    assert!(Arc::ptr_eq(
        &second.decode[0].breaker,
        &first.decode[0].breaker
    ));
    // d0 drains: it stays listed but is never picked.
    pd.set_workers(&set(vec![
        record("p", WorkerRole::Prefill, false),
        record("d0", WorkerRole::Decode, true),
        record("d1", WorkerRole::Decode, false),
    ]));
    let third = pd.pools();
    assert_eq!(third.decode[0].state(), "draining");
    for start in 0..4 {
        let (_, d) = pd.pick(&third, 0, start, &[]).expect("pair");
        assert_eq!(d.id.0, "d1", "start {start}: a draining worker was chosen");
    }
    // d0 leaves.
    pd.set_workers(&set(vec![
        record("p", WorkerRole::Prefill, false),
        record("d1", WorkerRole::Decode, false),
    ]));
    let ids: Vec<String> = pd.workers().into_iter().map(|w| w.id.0).collect();
    assert_eq!(ids, ["p", "d1"]);
    // Running requests keep the pools they started with.
    assert_eq!(third.decode.len(), 2);
}

#[tokio::test]
async fn failed_health_polls_eject_a_worker_until_it_answers_and_a_restart_drops_its_state() {
    let pd = PdGenerator::new(handles("p", 1), handles("d", 2), RetryPolicy::default())
        .with_health(crate::config::HealthConfig {
            interval: Duration::from_secs(1),
            eject_after: 3,
        });
    let pools = pd.pools();
    let d0 = &pools.decode[0];
    let answer = |instance: &str| tandem_proto::v1::StatsResponse {
        instance_id: instance.into(),
        ..Default::default()
    };
    pd.observe_poll(d0, Some(&answer("run-1")));
    for failed in 1..=2 {
        pd.observe_poll(d0, None);
        assert_eq!(d0.health_failures(), failed);
        assert!(!d0.is_ejected(), "ejected after {failed} failed polls");
    }
    pd.observe_poll(d0, None);
    assert_eq!((d0.state(), d0.ejected_by()), ("ejected", Some("health")));
    for start in 0..4 {
        let (_, d) = pd.pick(&pools, 0, start, &[]).expect("pair");
        assert_eq!(
            d.id.0, "d-1",
            "start {start}: the ejected worker was chosen"
        );
    }
    // The same instance answers again: back in rotation, its state kept.
    *d0.dp_load.lock().expect("lock") = Some(vec![0, 0]);
    pd.observe_poll(d0, Some(&answer("run-1")));
    assert_eq!((d0.state(), d0.health_failures()), ("active", 0));
    assert!(d0.dp_load.lock().expect("lock").is_some());
    assert_eq!(pd.pick(&pools, 0, 0, &[]).expect("pair").1.id.0, "d-0");
    // A new instance at the same address: what the old one held is forgotten.
    pd.observe_poll(d0, Some(&answer("run-2")));
    assert!(
        d0.dp_load.lock().expect("lock").is_none(),
        "DP accounting dropped"
    );
    assert_eq!(d0.instance_id(), "run-2");
    let p0 = &pools.prefill[0];
    let hashes = crate::pd::policy::block_hashes(&(0..256).collect::<Vec<u32>>());
    pd.observe_poll(p0, Some(&answer("p-run-1")));
    pd.prefixes.lock().expect("lock").record(&p0.id.0, &hashes);
    assert!(pd.prefixes.lock().expect("lock").cached(&p0.id.0, &hashes) > 0);
    pd.observe_poll(p0, Some(&answer("p-run-1")));
    assert!(pd.prefixes.lock().expect("lock").cached(&p0.id.0, &hashes) > 0);
    pd.observe_poll(p0, Some(&answer("p-run-2")));
    assert_eq!(
        pd.prefixes.lock().expect("lock").cached(&p0.id.0, &hashes),
        0,
        "the restarted prefill worker's cache index entries are dropped"
    );
}

/// A worker that stalls: its decode stream names a KV target (unless `reserve` is false) and
/// sends `tokens` tokens, then sends nothing more until the router drops it; its prefill
/// answers a first token at once.
#[derive(Clone)]
struct StallingWorker {
    reserve: bool,
    tokens: u32,
}

#[tonic::async_trait]
impl pb::worker_server::Worker for StallingWorker {
    type DecodeStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::DecodeEvent, tonic::Status>>;
    type GenerateStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::TokenEvent, tonic::Status>>;

    async fn decode(
        &self,
        _: tonic::Request<pb::DecodeRequest>,
    ) -> Result<tonic::Response<Self::DecodeStream>, tonic::Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let StallingWorker { reserve, tokens } = self.clone();
        tokio::spawn(async move {
            if reserve {
                let target = pb::KvTarget {
                    layout: Some(pb::KvLayout::default()),
                    epoch: 1,
                    ..pb::KvTarget::default()
                };
                let event = pb::decode_event::Event::KvTarget(target);
                let _ = tx.send(Ok(pb::DecodeEvent { event: Some(event) })).await;
                for i in 0..tokens {
                    let t = pb::TokenEvent {
                        token_id: 100 + i,
                        ..pb::TokenEvent::default()
                    };
                    let event = pb::decode_event::Event::Token(t);
                    let _ = tx.send(Ok(pb::DecodeEvent { event: Some(event) })).await;
                }
            }
            // The stall: the stream stays open, silent, until the router drops it.
            tx.closed().await;
        });
        Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
    }

    async fn prefill(
        &self,
        _: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::PrefillResponse {
            first_token_id: 42,
            ..pb::PrefillResponse::default()
        }))
    }

    async fn generate(
        &self,
        _: tonic::Request<pb::GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("P/D only"))
    }

    async fn stats(
        &self,
        _: tonic::Request<pb::StatsRequest>,
    ) -> Result<tonic::Response<pb::StatsResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::StatsResponse::default()))
    }

    async fn refresh_weights(
        &self,
        _: tonic::Request<pb::RefreshWeightsRequest>,
    ) -> Result<tonic::Response<pb::RefreshWeightsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("no weights"))
    }

    async fn drain(
        &self,
        _: tonic::Request<pb::DrainRequest>,
    ) -> Result<tonic::Response<pb::DrainResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("no drain"))
    }
}

/// A P/D pair of one [`StallingWorker`] serving both roles, with a 300 ms request limit (the
/// first-token and inter-token limits stay at their minute-long defaults).
async fn stalling_pair(worker: StallingWorker) -> Arc<PdGenerator> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = format!("http://{}", listener.local_addr().expect("bound"));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::worker_server::WorkerServer::new(worker))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let handle = |id: &str| WorkerHandle::new(WorkerId(id.into()), &address).expect("address");
    let timeouts = crate::config::Timeouts {
        request: Duration::from_millis(300),
        ..crate::config::Timeouts::default()
    };
    Arc::new(
        PdGenerator::new(vec![handle("p")], vec![handle("d")], RetryPolicy::default())
            .with_timeouts(timeouts),
    )
}

fn greedy(id: &str, max_tokens: u32) -> ValidGenerateRequest {
    ValidGenerateRequest {
        id: tandem_core::RequestId(id.into()),
        prompt_token_ids: vec![1, 2, 3],
        sampling: tandem_core::SamplingParams::greedy(max_tokens),
    }
}

/// The phase names of one ended request's attempts, and its final phase.
fn ended_phases(pd: &PdGenerator, id: &str) -> (Vec<Vec<&'static str>>, inflight::Phase) {
    let ended = pd.in_flight().ended();
    let e = ended
        .iter()
        .find(|e| e.id == id)
        .unwrap_or_else(|| panic!("{id} not among the ended requests: {ended:?}"));
    let names = e
        .history
        .iter()
        .map(|a| a.phases.iter().map(|t| t.phase.name()).collect())
        .collect();
    (names, e.phase)
}

fn assert_no_request_counted(pd: &PdGenerator) {
    assert!(pd.in_flight().is_empty());
    let gauges = pd.in_flight().phase_gauges();
    for name in inflight::Phase::NAMES {
        assert_eq!(gauges.with_label_values(&[name]).get(), 0, "{name}");
    }
}

#[tokio::test]
async fn a_stream_past_its_deadline_ends_failed_with_deadline_exceeded_in_the_table() {
    let pd = stalling_pair(StallingWorker {
        reserve: true,
        tokens: 2,
    })
    .await;
    let mut stream = SharedPd(pd.clone())
        .generate(greedy("late", 64))
        .await
        .expect("the first token comes at once");
    let mut tokens = 0;
    let error = loop {
        match stream.next().await.expect("the stream ends with an error") {
            Ok(_) => tokens += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(tokens, 3, "the prefill's first token and the decode's two");
    assert_eq!(
        error.class,
        ErrorClass::DeadlineExceeded,
        "{}",
        error.message
    );
    assert!(stream.next().await.is_none(), "nothing after the error");
    drop(stream);
    let (attempts, phase) = ended_phases(&pd, "late");
    assert_eq!(
        attempts,
        [[
            "admitted",
            "decode_reserved",
            "prefilling",
            "kv_ready",
            "decoding",
            "failed"
        ]]
    );
    assert_eq!(
        phase,
        inflight::Phase::Failed {
            class: ErrorClass::DeadlineExceeded
        }
    );
    assert_no_request_counted(&pd);
}

#[tokio::test]
async fn a_first_token_cut_short_by_the_request_deadline_is_not_retried_as_unavailable() {
    // The decode worker never answers with a KV target: the attempt stalls until the
    // request's 300 ms are up, well inside the first-token limit.
    let pd = stalling_pair(StallingWorker {
        reserve: false,
        tokens: 0,
    })
    .await;
    let error = SharedPd(pd.clone())
        .generate(greedy("stuck", 8))
        .await
        .err()
        .expect("no first token");
    assert_eq!(
        error.class,
        ErrorClass::DeadlineExceeded,
        "{}",
        error.message
    );
    let (attempts, phase) = ended_phases(&pd, "stuck");
    assert_eq!(
        attempts,
        [["admitted", "failed"]],
        "one attempt, not retried"
    );
    let failures = pd.in_flight().handoff_failures_counter();
    let counted: u64 = crate::pd::attempt::Leg::NAMES
        .iter()
        .map(|side| {
            failures
                .with_label_values(&[side, "deadline_exceeded"])
                .get()
        })
        .sum();
    assert_eq!(
        counted, 1,
        "the failed attempt is counted once, by its class"
    );
    assert_eq!(
        phase,
        inflight::Phase::Failed {
            class: ErrorClass::DeadlineExceeded
        }
    );
    assert_no_request_counted(&pd);
}

#[tokio::test]
async fn a_request_dropped_by_its_client_ends_cancelled_in_the_table() {
    let pd = stalling_pair(StallingWorker {
        reserve: true,
        tokens: 1,
    })
    .await;
    let mut stream = SharedPd(pd.clone())
        .generate(greedy("gone", 64))
        .await
        .expect("the first token comes at once");
    for _ in 0..2 {
        assert!(matches!(stream.next().await, Some(Ok(_))));
    }
    assert_eq!(
        pd.in_flight().snapshot()[0].phase,
        inflight::Phase::Decoding
    );
    drop(stream);
    let (_, phase) = ended_phases(&pd, "gone");
    assert_eq!(
        phase,
        inflight::Phase::Failed {
            class: ErrorClass::Cancelled
        }
    );
    assert_no_request_counted(&pd);
}
