//! The P/D generator and its parts: how a request finds workers and gets its tokens from them.
//!
//! [`PdGenerator`] (here) runs each request on workers: it opens `Decode` on a decode worker
//! (which reserves KV and answers with a `KvTarget`), then sends `Prefill` with that target to
//! a prefill worker (which computes the prompt, pushes the KV over the transport and returns
//! the first token), then streams the decode worker's tokens; or it sends the whole request to
//! one aggregated worker. Failures before the first token reaches the caller are retried on
//! another pair, with backoff, within a budget; dropping the returned stream cancels the
//! decode leg, which frees its KV.
//!
//! The parts are plain modules: worker handles and pools ([`workers`]), the choice of a worker
//! ([`policy`], pure and benchmarked alone), per-worker circuit breakers ([`breaker`]), one
//! attempt on its workers (`attempt`), the table of requests in flight ([`inflight`]) and the
//! per-pool gauges ([`pool_metrics`]).
//!
//! [`PdGenerator`]: crate::pd::PdGenerator
//! [`workers`]: crate::pd::workers
//! [`policy`]: crate::pd::policy
//! [`breaker`]: crate::pd::breaker
//! [`inflight`]: crate::pd::inflight
//! [`pool_metrics`]: crate::pd::pool_metrics

/// One attempt of a request on its workers (the gRPC calls and their token streams).
mod attempt;
/// Per-worker circuit breakers.
pub mod breaker;
/// The table of requests in flight and their attempts' phases (`/admin/requests`).
pub mod inflight;
/// Worker selection policies.
pub mod policy;
/// Per-pool gauges for autoscalers.
pub mod pool_metrics;
/// Worker handles and pools.
pub mod workers;

use crate::generator::{
    ChoicesFuture, GenerateError, GenerateFuture, GeneratedToken, Generator, TokenStream,
    ValidGenerateRequest,
};
use attempt::{try_aggregated, try_pair, Budget, Leg};
use futures::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tandem_core::{ErrorClass, WorkerId};
pub use workers::{classify_status, Pools, WorkerHandle};
use workers::{Outcome, LOAD_RELEASED, WORKERS_CHANGED};

/// Retry policy for failures before the first token.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Attempts in total (1 = no retry).
    pub attempts: u32,
    /// Backoff before the second attempt; doubles each time.
    pub backoff: Duration,
    /// Moves after tokens were streamed (see `resuming`).
    pub migration_limit: u32,
    /// How long a request whose attempts all found no worker to serve it (unreachable,
    /// ejected, or none listed) waits for one to come back before it fails (zero: it
    /// fails at once); within the request's deadline.
    pub outage_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 3,
            backoff: Duration::from_millis(50),
            migration_limit: 3,
            outage_wait: DEFAULT_OUTAGE_WAIT,
        }
    }
}

/// The default [`RetryPolicy::outage_wait`]: long enough for a restarted worker to load a
/// small model, below the default inter-token limit (a migrating stream waits too).
pub const DEFAULT_OUTAGE_WAIT: Duration = Duration::from_secs(20);

/// Generator that runs each request on a prefill worker and a decode worker.
#[derive(Debug)]
pub struct PdGenerator {
    pools: RwLock<Arc<Pools>>,
    next: AtomicUsize,
    retry: RetryPolicy,
    timeouts: crate::config::Timeouts,
    breaker: breaker::BreakerPolicy,
    health: crate::config::HealthConfig,
    policy: policy::Policy,
    admission: crate::config::AdmissionConfig,
    /// What each prefill worker was sent recently (cache-aware routing).
    prefixes: Mutex<policy::PrefixIndex>,
    /// Requests in flight, by phase.
    in_flight: Arc<inflight::InFlightTable>,
    /// Mutual TLS for connections to workers found later (discovery).
    worker_tls: Option<crate::tls::WorkerTls>,
}

/// Prompt blocks remembered per prefill worker for cache-aware routing.
const PREFIX_INDEX_BLOCKS: usize = 1 << 16;

impl PdGenerator {
    /// A generator over static worker lists.
    pub fn new(prefill: Vec<WorkerHandle>, decode: Vec<WorkerHandle>, retry: RetryPolicy) -> Self {
        Self::with_aggregated(prefill, decode, Vec::new(), retry)
    }

    /// A generator over P/D pairs and aggregated workers (either may be empty). Requests go
    /// round-robin over the routes: each aggregated worker is one, the P/D pairs together
    /// another.
    pub fn with_aggregated(
        prefill: Vec<WorkerHandle>,
        decode: Vec<WorkerHandle>,
        aggregated: Vec<WorkerHandle>,
        retry: RetryPolicy,
    ) -> Self {
        Self {
            pools: RwLock::new(Arc::new(Pools {
                prefill,
                decode,
                aggregated,
            })),
            next: AtomicUsize::new(0),
            retry,
            timeouts: crate::config::Timeouts::default(),
            breaker: breaker::BreakerPolicy::default(),
            health: crate::config::HealthConfig::default(),
            policy: policy::Policy::RoundRobin,
            admission: crate::config::AdmissionConfig::default(),
            prefixes: Mutex::new(policy::PrefixIndex::new(PREFIX_INDEX_BLOCKS)),
            in_flight: Arc::default(),
            worker_tls: None,
        }
    }

    /// The same generator reaching the workers discovery reports over mutual TLS.
    pub fn with_worker_tls(mut self, tls: Option<crate::tls::WorkerTls>) -> Self {
        self.worker_tls = tls;
        self
    }

    /// Requests in flight, by phase (`/admin/requests`).
    pub fn in_flight(&self) -> &inflight::InFlightTable {
        &self.in_flight
    }

    /// The same generator picking workers by `policy`.
    pub fn with_policy(mut self, policy: policy::Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The same generator limiting what each worker gets.
    pub fn with_admission(mut self, admission: crate::config::AdmissionConfig) -> Self {
        self.admission = admission;
        self
    }

    /// Waits (up to the queue timeout) until some route has a worker below the per-worker
    /// limit; a 503-class error naming the limit when none frees in time.
    async fn admit(&self) -> Result<(), GenerateError> {
        let a = &self.admission;
        if a.max_in_flight_per_worker == 0 {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + a.queue_timeout;
        loop {
            // Registered before looking, so a release in between is not missed.
            let released = LOAD_RELEASED.notified();
            if self.pools().has_room(a.max_in_flight_per_worker) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(GenerateError::new(
                    ErrorClass::Unavailable,
                    format!(
                        "every worker that could serve this request has {} requests in flight \
                         (admission.max_in_flight_per_worker); retry later",
                        a.max_in_flight_per_worker
                    ),
                ));
            }
            let _ = tokio::time::timeout_at(deadline, released).await;
        }
    }

    /// The same generator ejecting workers after `health.eject_after` failed polls.
    pub fn with_health(mut self, health: crate::config::HealthConfig) -> Self {
        self.health = health;
        self
    }

    /// The same generator with breaker settings `policy`.
    pub fn with_breaker(mut self, policy: breaker::BreakerPolicy) -> Self {
        self.breaker = policy;
        self
    }

    /// The same generator enforcing `timeouts`: a first token (per attempt; a stalled pair is
    /// retried elsewhere), every later token, and the whole request.
    pub fn with_timeouts(mut self, timeouts: crate::config::Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// The pools now (new requests see later changes; running ones keep their workers).
    pub fn pools(&self) -> Arc<Pools> {
        self.pools
            .read()
            .map(|p| p.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Every worker, prefill first, then decode, then aggregated.
    pub fn workers(&self) -> Vec<WorkerHandle> {
        self.pools().all().cloned().collect()
    }

    /// Replaces the pools with the workers of `set`. A worker already known (same id and
    /// address) keeps its handle: its connection, breaker and DP accounting. Records marked
    /// draining stay listed but get no new requests.
    pub fn set_workers(&self, set: &tandem_discovery::WorkerSet) {
        use tandem_discovery::{WorkerRole, WorkerState};
        let old = self.pools();
        let known = |id: &str, address: &str| {
            old.all()
                .find(|w| w.id.0 == id && w.address == address)
                .cloned()
        };
        let mut pools = Pools::default();
        for r in set.workers.values() {
            let handle = match known(&r.id, &r.address) {
                Some(h) => h,
                None => match WorkerHandle::with_tls(
                    WorkerId(r.id.clone()),
                    &r.address,
                    self.timeouts.connect,
                    self.worker_tls.clone(),
                ) {
                    Ok(h) => {
                        tracing::info!(worker = %r.id, role = r.role.as_str(), address = %r.address,
                            "worker added");
                        h
                    }
                    Err(e) => {
                        tracing::warn!(worker = %r.id, error = %e.message, "worker record ignored");
                        continue;
                    }
                },
            };
            handle.set_draining(r.state == WorkerState::Draining);
            match r.role {
                WorkerRole::Prefill => pools.prefill.push(handle),
                WorkerRole::Decode => pools.decode.push(handle),
                WorkerRole::Both => pools.aggregated.push(handle),
            }
        }
        for w in old.all() {
            if !pools.all().any(|n| n.id == w.id && n.address == w.address) {
                tracing::info!(worker = %w.id, address = %w.address, "worker removed");
                self.prefixes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .forget(&w.id.0);
            }
        }
        let pools = Arc::new(pools);
        match self.pools.write() {
            Ok(mut p) => *p = pools,
            Err(e) => *e.into_inner() = pools,
        }
        WORKERS_CHANGED.notify_waiters();
    }

    /// Keeps the pools equal to what `discovery` reports, until the source goes away.
    pub async fn follow(self: Arc<Self>, discovery: Arc<dyn tandem_discovery::Discovery>) {
        let mut rx = discovery.subscribe();
        loop {
            let set = rx.borrow_and_update().clone();
            self.set_workers(&set);
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Asks every worker for its stats every `interval`, marks those that report draining
    /// (how a drain is seen with static worker lists), takes out of rotation those that fail
    /// `health.eject_after` polls in a row and readmits them when they answer, forgets what a
    /// restarted worker's previous instance had cached and, with `metrics`, sets the pool
    /// gauges. Runs forever.
    pub async fn poll_health(
        self: Arc<Self>,
        interval: Duration,
        metrics: Option<pool_metrics::PoolMetrics>,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let pools = self.pools();
            let roles = [
                ("prefill", &pools.prefill),
                ("decode", &pools.decode),
                ("both", &pools.aggregated),
            ];
            let this = &self;
            let asks = roles.iter().flat_map(|(role, list)| {
                list.iter().map(move |w| async move {
                    let stats = tokio::time::timeout(interval, w.stats())
                        .await
                        .ok()
                        .and_then(Result::ok);
                    this.observe_poll(w, stats.as_ref());
                    pool_metrics::WorkerSample {
                        worker: w.id.0.clone(),
                        breaker: w.breaker_state(),
                        role,
                        state: w.state(),
                        stats,
                    }
                })
            });
            let samples = futures::future::join_all(asks).await;
            if let Some(m) = &metrics {
                m.observe(&samples);
            }
        }
    }

    /// Records what one health poll of `w` found: its stats, or none (no answer in time).
    fn observe_poll(&self, w: &WorkerHandle, stats: Option<&tandem_proto::v1::StatsResponse>) {
        let Some(s) = stats else {
            w.health_failed(self.health.eject_after);
            return;
        };
        if w.health_answered(&s.instance_id) {
            // A restarted worker's prefix cache is empty.
            self.prefixes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .forget(&w.id.0);
        }
        w.set_draining(s.draining);
        w.kv_free
            .store(u64::from(s.kv_blocks_free), Ordering::Relaxed);
    }

    /// The pair for an attempt: by the policy, from the round-robin positions `(p, d)`. A
    /// retry advances only the leg that failed (both when the transfer between them
    /// failed), so a dead worker on one side does not take its healthy partner out of the
    /// rotation.
    fn pick(
        &self,
        pools: &Pools,
        p: usize,
        d: usize,
        prompt: &[u32],
    ) -> Option<(WorkerHandle, WorkerHandle)> {
        use self::policy::{pick, Pool};
        if pools.prefill.is_empty() || pools.decode.is_empty() {
            return None;
        }
        let limit = self.admission.max_in_flight_per_worker;
        let cache_aware = matches!(self.policy, policy::Policy::CacheAware { .. });
        let hashes = if cache_aware {
            policy::block_hashes(prompt)
        } else {
            Vec::new()
        };
        let prefill: Vec<_> = {
            let index = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
            pools
                .prefill
                .iter()
                .map(|w| w.candidate(index.cached(&w.id.0, &hashes), limit))
                .collect()
        };
        let decode: Vec<_> = pools.decode.iter().map(|w| w.candidate(0, limit)).collect();
        let draw = rand::random::<u64>();
        let pw = pools.prefill[pick(self.policy, Pool::Prefill, &prefill, p, draw)].clone();
        let dw =
            pools.decode[pick(self.policy, Pool::Decode, &decode, d, draw.rotate_left(17))].clone();
        if cache_aware {
            self.prefixes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(&pw.id.0, &hashes);
        }
        Some((pw, dw))
    }

    /// `n` choices of `req`'s prompt (seeds `seed`, `seed + 1`, …): one prefill and one
    /// decode stream for them all; a choice whose stream breaks later continues on its own.
    async fn run(
        self: Arc<Self>,
        req: ValidGenerateRequest,
        n: u32,
    ) -> Result<Vec<TokenStream>, GenerateError> {
        let base = self.next.fetch_add(1, Ordering::Relaxed);
        // No route now may still become one while the request waits out an outage.
        let routes = self.pools().routes().max(1);
        let mut cursor = Cursor {
            pi: base,
            di: base,
            route: base % routes,
            routes,
        };
        let t = self.timeouts;
        let deadline = tokio::time::Instant::now() + t.request;
        let n = n.max(1);
        let choices: Vec<ValidGenerateRequest> = if n == 1 {
            vec![req]
        } else {
            (0..n)
                .map(|j| {
                    let mut c = req.clone();
                    c.id = tandem_core::RequestId(format!("{}-{j}", req.id.0));
                    c.sampling.seed = req.sampling.seed.wrapping_add(u64::from(j));
                    c
                })
                .collect()
        };
        let trackers: Vec<_> = choices
            .iter()
            .map(|c| self.in_flight.open(&c.id.0, c.prompt_token_ids.len()))
            .collect();
        self.admit().await?;
        // Choice 0's request (the base seed) asks for them all.
        let streams = self
            .first_streams(&choices[0], n, &mut cursor, deadline, &trackers)
            .await?;
        Ok(streams
            .into_iter()
            .zip(choices)
            .zip(trackers)
            .map(|((stream, req), tracker)| {
                resuming(self.clone(), req, cursor, deadline, stream, tracker)
            })
            .collect())
    }

    /// Rounds of [`PdGenerator::attempts`] until one yields the first token of each of `n`
    /// choices. A round that found no worker able to serve (every attempt unavailable or its
    /// transfer broken, or no route listed) is followed by a wait for the worker set to change
    /// (at most a second), then another round, for up to [`RetryPolicy::outage_wait`] in all:
    /// a request arriving while the only worker of a pool restarts is served when it is back,
    /// and one whose attempts all met injected faults tries again instead of being lost.
    async fn first_streams(
        &self,
        req: &ValidGenerateRequest,
        n: u32,
        cursor: &mut Cursor,
        deadline: tokio::time::Instant,
        trackers: &[inflight::Tracker],
    ) -> Result<Vec<TokenStream>, GenerateError> {
        let started = tokio::time::Instant::now();
        let give_up = (started + self.retry.outage_wait).min(deadline);
        let mut waited = false;
        loop {
            // Registered before the round, so a change during it is not missed.
            let changed = WORKERS_CHANGED.notified();
            // The pools as they are now: a migration after a scale change sees the new ones.
            let pools = self.pools();
            let result = self
                .attempts(&pools, req, n, cursor, deadline, trackers)
                .await;
            let e = match result {
                Ok(streams) => {
                    if waited {
                        tracing::info!(request = %req.id, waited = ?started.elapsed(),
                            "a worker is back: the request goes on");
                    }
                    return Ok(streams);
                }
                Err(e) => e,
            };
            let now = tokio::time::Instant::now();
            if !waits_out(e.class) || now >= give_up {
                return Err(if waited {
                    GenerateError::new(
                        e.class,
                        format!(
                            "{} (no worker came back within {:?})",
                            e.message,
                            started.elapsed()
                        ),
                    )
                } else {
                    e
                });
            }
            if !waited {
                tracing::warn!(request = %req.id, error = %e.message,
                    wait = ?give_up.saturating_duration_since(now),
                    "no worker could serve the request; waiting for one to come back");
                waited = true;
            }
            // A worker answering its health check again (or the set changing) wakes the
            // wait; a round at least every second covers workers back without a check.
            let _ = tokio::time::timeout_at(give_up.min(now + OUTAGE_RECHECK), changed).await;
        }
    }

    /// Attempts until one yields the first token of each of `n` choices (or the retry
    /// budget, a non-retryable error or the request deadline ends it), moving `cursor`
    /// past the routes that failed. Each attempt is recorded in the in-flight table for
    /// the requests of `trackers` (one per choice), a failed one with its class.
    async fn attempts(
        &self,
        pools: &Pools,
        req: &ValidGenerateRequest,
        n: u32,
        cursor: &mut Cursor,
        deadline: tokio::time::Instant,
        trackers: &[inflight::Tracker],
    ) -> Result<Vec<TokenStream>, GenerateError> {
        let mut last = no_workers();
        let t = self.timeouts;
        let routes = pools.routes();
        if routes == 0 {
            return Err(last);
        }
        cursor.routes = routes;
        cursor.route %= routes;
        for attempt in 0..self.retry.attempts.max(1) {
            // Each attempt has until its first token: the first-token limit, or what is left
            // of the request's.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(request_deadline(t.request));
            }
            let budget = t.first_token.min(left);
            // A stall cut short by the request's deadline is the deadline's (not retried);
            // one that used the whole first-token limit is the worker's (tried elsewhere).
            let stalled = |who: String| {
                if budget < t.first_token {
                    let e = request_deadline(t.request);
                    GenerateError::new(e.class, format!("{}: no first token from {who}", e.message))
                } else {
                    GenerateError::new(
                        ErrorClass::Unavailable,
                        format!("no first token from {who} within {budget:?}"),
                    )
                }
            };
            let result = if let Some(w) = pools.aggregated.get(cursor.route) {
                let _ = w.admit();
                let phases = inflight::Tracker::attempt(trackers, &w.id.0, None);
                let legs = Budget {
                    first_token: budget,
                    request: left,
                };
                let attempt_result =
                    tokio::time::timeout(budget, try_aggregated(w, req, n, legs, &phases))
                        .await
                        .unwrap_or_else(|_| Err(stalled(format!("worker {}", w.id))));
                w.report(
                    attempt_result
                        .as_ref()
                        .map_or_else(|e| Outcome::Failed(e.class), |_| Outcome::Ok),
                    self.breaker,
                );
                attempt_result.inspect_err(|e| {
                    phases.enter(inflight::Phase::Failed { class: e.class });
                    tracing::warn!(request = %req.id, worker = %w.id, attempt,
                        class = e.class.as_str(), error = %e.message, "aggregated attempt failed");
                })
            } else {
                let Some((p, d)) = self.pick(pools, cursor.pi, cursor.di, &req.prompt_token_ids)
                else {
                    break;
                };
                let phases = inflight::Tracker::attempt(trackers, &p.id.0, Some(&d.id.0));
                let legs = Budget {
                    first_token: budget,
                    request: left,
                };
                let attempt_result =
                    tokio::time::timeout(budget, try_pair(&p, &d, req, n, legs, &phases))
                        .await
                        .unwrap_or_else(|_| {
                            // Which side stalled is not known: move both.
                            Err((
                                Leg::Both,
                                stalled(format!("prefill {} and decode {}", p.id, d.id)),
                            ))
                        });
                let (p_out, d_out) = match &attempt_result {
                    Ok(_) => (Outcome::Ok, Outcome::Ok),
                    Err((Leg::Prefill, e)) => (Outcome::Failed(e.class), Outcome::Ok),
                    Err((Leg::Decode, e)) => (Outcome::Untested, Outcome::Failed(e.class)),
                    Err((Leg::Both, e)) => (Outcome::Failed(e.class), Outcome::Failed(e.class)),
                };
                p.report(p_out, self.breaker);
                d.report(d_out, self.breaker);
                attempt_result.map_err(|(leg, e)| {
                    phases.enter(inflight::Phase::Failed { class: e.class });
                    self.in_flight.handoff_failed(leg, e.class);
                    match leg {
                        Leg::Prefill => cursor.pi += 1,
                        Leg::Decode => cursor.di += 1,
                        Leg::Both => {
                            cursor.pi += 1;
                            cursor.di += 1;
                        }
                    }
                    tracing::warn!(request = %req.id, prefill = %p.id, decode = %d.id, attempt,
                        class = e.class.as_str(), error = %e.message, "P/D attempt failed");
                    e
                })
            };
            match result {
                Ok(stream) => return Ok(stream),
                Err(e) => {
                    if !e.class.is_retryable() {
                        return Err(e);
                    }
                    last = e;
                    cursor.route = (cursor.route + 1) % routes;
                    // Exponential, with jitter (50–150%) so retries of many requests that
                    // failed together do not arrive together.
                    let base = self.retry.backoff * 2u32.pow(attempt.min(16));
                    let jitter = 0.5 + rand::random::<f64>();
                    tokio::time::sleep(base.mul_f64(jitter)).await;
                }
            }
        }
        Err(last)
    }
}

/// The longest a request waiting out an outage goes without trying again.
const OUTAGE_RECHECK: Duration = Duration::from_secs(1);

/// Whether a round of attempts that ended with `class` is followed by another (within
/// [`RetryPolicy::outage_wait`]): no worker reachable, or every transfer broke — faults of the
/// network or of workers that pass. A full pool answers at once (503 with Retry-After), and
/// the client's own errors are never retried.
fn waits_out(class: ErrorClass) -> bool {
    matches!(class, ErrorClass::Unavailable | ErrorClass::TransferFailed)
}

/// Where a request's next attempt goes: round-robin positions per pool and route.
#[derive(Clone, Copy, Debug)]
struct Cursor {
    pi: usize,
    di: usize,
    route: usize,
    routes: usize,
}

/// `tokens` continued on another pair when its stream breaks with a retryable error after
/// some tokens were sent: the request is prefilled again on the next route with the tokens
/// already sent appended to its prompt and marked as resumed output
/// ([`SamplingParams::resumed`]: they count for penalties, `min_tokens` and the sampling
/// step), for what is left of `max_tokens`; the new pair's tokens continue the stream. A
/// migration costs one prefill of prompt + sent tokens, not a replay of the decode steps.
///
/// Paced by the limits between two tokens (`timeouts.inter_token`, a migration included) and
/// on the whole request (`deadline`): a stream that stalls ends with a `DeadlineExceeded`
/// error instead of holding its client, its latest attempt entered as failed with that class
/// before the request leaves the in-flight table.
fn resuming(
    generator: Arc<PdGenerator>,
    req: ValidGenerateRequest,
    cursor: Cursor,
    deadline: tokio::time::Instant,
    tokens: TokenStream,
    tracker: inflight::Tracker,
) -> TokenStream {
    let timeouts = generator.timeouts;
    let state = Resuming {
        generator,
        req,
        cursor,
        deadline,
        tokens,
        sent: Vec::new(),
        migrations: 0,
        tracker,
    };
    futures::stream::unfold(Some(state), move |state| async move {
        let mut s = state?;
        let left = s
            .deadline
            .saturating_duration_since(tokio::time::Instant::now());
        let wait = timeouts.inter_token.min(left);
        let (item, more) = match tokio::time::timeout(wait, s.next()).await {
            Ok(Some(step)) => step,
            Ok(None) => return None,
            Err(_) => {
                let e = if wait < timeouts.inter_token {
                    request_deadline(timeouts.request)
                } else {
                    GenerateError::new(
                        ErrorClass::DeadlineExceeded,
                        format!(
                            "no token for {:?} (timeouts.inter_token)",
                            timeouts.inter_token
                        ),
                    )
                };
                (Err(e), false)
            }
        };
        match &item {
            Ok(_) if !more => s.tracker.enter(inflight::Phase::Done),
            Err(e) => s.tracker.enter(inflight::Phase::Failed { class: e.class }),
            Ok(_) => {}
        }
        Some((item, more.then_some(s)))
    })
    .boxed()
}

/// One choice's stream as [`resuming`] drives it.
struct Resuming {
    generator: Arc<PdGenerator>,
    req: ValidGenerateRequest,
    cursor: Cursor,
    deadline: tokio::time::Instant,
    tokens: TokenStream,
    sent: Vec<u32>,
    migrations: u32,
    tracker: inflight::Tracker,
}

impl Resuming {
    /// The next token or error, and whether more may follow; `None` once the stream ended.
    /// The caller enters the request's final phase.
    async fn next(&mut self) -> Option<(Result<GeneratedToken, GenerateError>, bool)> {
        loop {
            match self.tokens.next().await {
                Some(Ok(tok)) => {
                    self.sent.push(tok.token_id);
                    self.tracker.token();
                    let more = tok.finish_reason.is_none();
                    return Some((Ok(tok), more));
                }
                None => return None,
                Some(Err(e))
                    if e.class.is_retryable()
                        && !self.sent.is_empty()
                        && self.migrations < self.generator.retry.migration_limit
                        && (self.sent.len() as u32) < self.req.sampling.max_tokens =>
                {
                    self.migrations += 1;
                    self.tracker
                        .enter(inflight::Phase::Failed { class: e.class });
                    self.tracker.migration();
                    tracing::warn!(request = %self.req.id, tokens = self.sent.len(),
                        migration = self.migrations, class = e.class.as_str(), error = %e.message,
                        "stream broke after tokens were sent: continuing on another pair");
                    // The decode leg broke: move it (and the route) on.
                    self.cursor.di += 1;
                    self.cursor.route = (self.cursor.route + 1) % self.cursor.routes;
                    let resumed = resumed_request(&self.req, &self.sent);
                    self.tokens = match self
                        .generator
                        .first_streams(
                            &resumed,
                            1,
                            &mut self.cursor,
                            self.deadline,
                            std::slice::from_ref(&self.tracker),
                        )
                        .await
                    {
                        Ok(mut t) => t.remove(0),
                        Err(e) => return Some((Err(e), false)),
                    };
                }
                Some(Err(e)) => return Some((Err(e), false)),
            }
        }
    }
}

/// `req` continued after `sent` of its tokens: those appended to the prompt as resumed
/// output, `max_tokens` less them.
fn resumed_request(req: &ValidGenerateRequest, sent: &[u32]) -> ValidGenerateRequest {
    let mut next = req.clone();
    next.prompt_token_ids.extend_from_slice(sent);
    next.sampling.resumed += sent.len() as u32;
    // The client has them from the first attempt.
    next.sampling.prompt_logprobs = None;
    next.sampling.max_tokens -= sent.len() as u32;
    next
}

fn no_workers() -> GenerateError {
    GenerateError::new(
        ErrorClass::Unavailable,
        "no workers available (none configured, or discovery lists none)",
    )
}

fn request_deadline(limit: Duration) -> GenerateError {
    GenerateError::new(
        ErrorClass::DeadlineExceeded,
        format!("the request did not finish within {limit:?} (timeouts.request)"),
    )
}

/// Shared handle implementing [`Generator`].
#[derive(Clone, Debug)]
pub struct SharedPd(pub Arc<PdGenerator>);

impl Generator for SharedPd {
    fn generate(&self, request: ValidGenerateRequest) -> GenerateFuture {
        let run = self.0.clone().run(request, 1);
        Box::pin(async move { run.await.map(|mut streams| streams.remove(0)) })
    }

    fn generate_choices(&self, request: ValidGenerateRequest, n: u32) -> ChoicesFuture {
        Box::pin(self.0.clone().run(request, n))
    }
}

#[cfg(test)]
mod tests;
