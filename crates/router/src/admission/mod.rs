//! Admission: what the router lets in, and in what order, before a request reaches a worker.
//!
//! A request passes two checks. First the rate limits: token buckets of requests and prompt
//! tokens a second, one set over all traffic and one per API key ([`Caller`]); a request
//! over any of them is answered 429 at once, with `Retry-After` saying when the tightest
//! bucket would let it through (tokens are taken only when every bucket has them, so a
//! refused request costs nothing). Then the running cap: with `max_running` set, a request
//! beyond it waits in a bounded queue ordered by priority (lower first, then arrival), so an
//! interactive tenant's requests pass a batch tenant's that arrived before them; a full
//! queue answers 429, a wait longer than `queue_timeout` 503. The place under the cap is a
//! [`Ticket`], held by the request's token stream and given to the next waiter on drop, so a
//! finished, failed or abandoned request frees it however it ends.
//!
//! One lock guards the buckets and the queue: each check is a few arithmetic operations,
//! far below the cost of the request it admits. With the defaults (no limits, no cap) the
//! lock is never taken and every request is admitted at once.

/// Token buckets with the clock passed in.
pub mod token_bucket;

use crate::auth::Caller;
use crate::config::{AdmissionConfig, RateLimits};
use crate::error::ApiError;
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use token_bucket::TokenBucket;
use tokio::sync::oneshot;

/// Why a request was not admitted (the `reason` label of
/// `tandem_admission_rejections_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// `admission.global.requests_per_second`.
    GlobalRequests,
    /// `admission.global.tokens_per_second`.
    GlobalTokens,
    /// The key's requests a second.
    KeyRequests,
    /// The key's prompt tokens a second.
    KeyTokens,
    /// The queue held `queue_capacity` requests.
    QueueFull,
    /// The wait ran past `queue_timeout`.
    QueueTimeout,
}

impl Rejection {
    const ALL: [Rejection; 6] = [
        Rejection::GlobalRequests,
        Rejection::GlobalTokens,
        Rejection::KeyRequests,
        Rejection::KeyTokens,
        Rejection::QueueFull,
        Rejection::QueueTimeout,
    ];

    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::GlobalRequests => "global_requests",
            Rejection::GlobalTokens => "global_tokens",
            Rejection::KeyRequests => "key_requests",
            Rejection::KeyTokens => "key_tokens",
            Rejection::QueueFull => "queue_full",
            Rejection::QueueTimeout => "queue_timeout",
        }
    }
}

/// A set of limits' buckets (requests, prompt tokens); `None` where unlimited.
#[derive(Debug)]
struct Buckets {
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
}

impl Buckets {
    fn new(limits: &RateLimits, now: Instant) -> Self {
        let bucket = |rate: Option<f64>, burst: Option<f64>| {
            rate.map(|r| TokenBucket::new(r, burst.unwrap_or(r.max(1.0)), now))
        };
        Self {
            requests: bucket(limits.requests_per_second, limits.requests_burst),
            tokens: bucket(limits.tokens_per_second, limits.tokens_burst),
        }
    }

    /// The longest wait among these buckets for one request of `tokens`, with its reason.
    fn wait(&mut self, tokens: f64, now: Instant, global: bool) -> Option<(Duration, Rejection)> {
        let (r, t) = if global {
            (Rejection::GlobalRequests, Rejection::GlobalTokens)
        } else {
            (Rejection::KeyRequests, Rejection::KeyTokens)
        };
        let requests = self.requests.as_mut().map(|b| (b.wait(1.0, now), r));
        let tokens = self.tokens.as_mut().map(|b| (b.wait(tokens, now), t));
        requests
            .into_iter()
            .chain(tokens)
            .filter(|(w, _)| !w.is_zero())
            .max_by_key(|(w, _)| *w)
    }

    fn take(&mut self, tokens: f64, now: Instant) {
        if let Some(b) = &mut self.requests {
            b.take(1.0, now);
        }
        if let Some(b) = &mut self.tokens {
            b.take(tokens, now);
        }
    }
}

/// What the lock guards.
#[derive(Debug)]
struct State {
    config: AdmissionConfig,
    global: Buckets,
    /// Each caller's buckets, made on its first request.
    callers: HashMap<Caller, Buckets>,
    /// Requests holding a ticket.
    running: usize,
    /// Waiters by (priority, arrival): the first is served next.
    waiting: BTreeMap<(i32, u64), oneshot::Sender<()>>,
    arrivals: u64,
}

/// The admission metrics, in the router's registry.
#[derive(Clone, Debug)]
struct AdmissionMetrics {
    rejections: IntCounterVec,
    queue_depth: IntGauge,
    running: IntGauge,
    queue_wait: Histogram,
}

const QUEUE_WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl AdmissionMetrics {
    fn register(registry: &Registry) -> Self {
        let rejections = IntCounterVec::new(
            Opts::new(
                "tandem_admission_rejections_total",
                "Requests refused at admission, by reason (global_requests, global_tokens, \
                 key_requests, key_tokens: 429 rate limits; queue_full: 429; queue_timeout: 503).",
            ),
            &["reason"],
        )
        .expect("static counter options are valid");
        for r in Rejection::ALL {
            rejections.with_label_values(&[r.as_str()]);
        }
        let queue_depth = IntGauge::new(
            "tandem_admission_queue_depth",
            "Requests waiting in the admission queue for a place under admission.max_running.",
        )
        .expect("static gauge options are valid");
        let running = IntGauge::new(
            "tandem_admission_running",
            "Requests holding a place under admission.max_running (0 when it is not set).",
        )
        .expect("static gauge options are valid");
        let queue_wait = Histogram::with_opts(
            HistogramOpts::new(
                "tandem_admission_queue_wait_seconds",
                "Time admitted requests waited for a place under admission.max_running.",
            )
            .buckets(QUEUE_WAIT_BUCKETS.to_vec()),
        )
        .expect("static histogram options are valid");
        for c in [
            Box::new(rejections.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(queue_depth.clone()),
            Box::new(running.clone()),
            Box::new(queue_wait.clone()),
        ] {
            registry
                .register(c)
                .expect("metric names are unique within this registry");
        }
        Self {
            rejections,
            queue_depth,
            running,
            queue_wait,
        }
    }
}

/// The router's admission control; see the module docs. Shared by every request.
#[derive(Debug)]
pub struct Admission {
    /// Whether any check applies (false: [`Admission::admit`] returns at once).
    active: AtomicBool,
    state: Mutex<State>,
    metrics: AdmissionMetrics,
}

/// A request's place under `max_running` (or nothing, without the cap); given to the next
/// waiter when dropped.
#[derive(Debug)]
pub struct Ticket(Option<Arc<Admission>>);

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            let mut s = a.lock();
            a.hand_on(&mut s);
        }
    }
}

/// A queued request's claim; leaves the queue when dropped (the client went away).
struct Waiter<'a> {
    admission: &'a Admission,
    key: (i32, u64),
    slot: oneshot::Receiver<()>,
    /// Set once the place handed over became the request's ticket.
    admitted: bool,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if self.admitted {
            return;
        }
        let a = self.admission;
        let mut s = a.lock();
        if s.waiting.remove(&self.key).is_some() {
            a.metrics.queue_depth.set(s.waiting.len() as i64);
        } else if self.slot.try_recv().is_ok() {
            // Handed a place and not taken: pass it on.
            a.hand_on(&mut s);
        }
    }
}

impl Admission {
    /// Admission by `config`, its metrics registered in `registry`.
    pub fn new(config: AdmissionConfig, registry: &Registry) -> Self {
        let a = Self {
            state: Mutex::new(State {
                config: AdmissionConfig::default(),
                global: Buckets::new(&RateLimits::default(), Instant::now()),
                callers: HashMap::new(),
                running: 0,
                waiting: BTreeMap::new(),
                arrivals: 0,
            }),
            metrics: AdmissionMetrics::register(registry),
            active: AtomicBool::new(false),
        };
        a.configure(config);
        a
    }

    /// Applies `config` from now on: the buckets start full again; requests running or
    /// queued keep their places.
    pub fn configure(&self, config: AdmissionConfig) {
        let now = Instant::now();
        let active = config.max_running.is_some()
            || config.global.any()
            || config.per_key.any()
            || config.keys.values().any(|k| k.limits.any());
        let mut s = self.lock();
        s.global = Buckets::new(&config.global, now);
        s.callers.clear();
        s.config = config;
        self.active.store(active, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The priority of a request: its own, or its key's default, or 0.
    pub fn priority(&self, caller: Option<&Caller>, requested: Option<i32>) -> i32 {
        requested
            .or_else(|| {
                let c = caller?;
                self.lock().config.keys.get(&*c.0)?.priority
            })
            .unwrap_or(0)
    }

    /// Admits a request of `prompt_tokens` from `caller` at `priority`: checks the rate
    /// limits, then waits (up to `queue_timeout`) for a place under `max_running`. The
    /// ticket must live as long as the request generates.
    pub async fn admit(
        self: &Arc<Self>,
        caller: Option<&Caller>,
        priority: i32,
        prompt_tokens: usize,
    ) -> Result<Ticket, ApiError> {
        if !self.active.load(Ordering::Relaxed) {
            return Ok(Ticket(None));
        }
        self.check_rates(caller, prompt_tokens as f64, Instant::now())?;
        let started = tokio::time::Instant::now();
        let (mut waiter, limit, timeout) = {
            let mut s = self.lock();
            let Some(limit) = s.config.max_running else {
                return Ok(Ticket(None));
            };
            let (capacity, timeout) = (s.config.queue_capacity, s.config.queue_timeout);
            if s.running < limit && s.waiting.is_empty() {
                s.running += 1;
                self.metrics.running.set(s.running as i64);
                self.metrics.queue_wait.observe(0.0);
                return Ok(Ticket(Some(self.clone())));
            }
            if s.waiting.len() >= capacity || timeout.is_zero() {
                drop(s);
                return Err(self.refuse(
                    Rejection::QueueFull,
                    queue_full_message(limit, capacity, timeout),
                ));
            }
            let key = (priority, s.arrivals);
            s.arrivals += 1;
            let (tx, rx) = oneshot::channel();
            s.waiting.insert(key, tx);
            self.metrics.queue_depth.set(s.waiting.len() as i64);
            let waiter = Waiter {
                admission: self,
                key,
                slot: rx,
                admitted: false,
            };
            (waiter, limit, timeout)
        };
        let admitted = match tokio::time::timeout(timeout, &mut waiter.slot).await {
            Ok(result) => result.is_ok(),
            // Handed a place just as the wait ran out: take it.
            Err(_) => waiter.slot.try_recv().is_ok(),
        };
        if admitted {
            // The place is ours: the waiter must not pass it on.
            waiter.admitted = true;
            drop(waiter);
            self.metrics
                .queue_wait
                .observe(started.elapsed().as_secs_f64());
            return Ok(Ticket(Some(self.clone())));
        }
        drop(waiter);
        Err(self.refuse(
            Rejection::QueueTimeout,
            format!(
                "the request waited {:?} in the admission queue (admission.queue_timeout) \
                 without a place among the {limit} requests the router runs at once; \
                 the queue wait expired, retry later",
                timeout
            ),
        ))
    }

    /// Takes one request and `tokens` from every bucket that applies, or from none.
    fn check_rates(
        &self,
        caller: Option<&Caller>,
        tokens: f64,
        now: Instant,
    ) -> Result<(), ApiError> {
        let mut guard = self.lock();
        let s = &mut *guard;
        let limits = caller.map(|c| {
            let own = s.config.keys.get(&*c.0).map(|k| k.limits);
            own.unwrap_or_default().or(s.config.per_key)
        });
        let mut key_buckets = match (caller, limits) {
            (Some(c), Some(l)) if l.any() => Some(
                s.callers
                    .entry(c.clone())
                    .or_insert_with(|| Buckets::new(&l, now)),
            ),
            _ => None,
        };
        let global = s.global.wait(tokens, now, true);
        let key = key_buckets
            .as_mut()
            .and_then(|b| b.wait(tokens, now, false));
        let worst = global.into_iter().chain(key).max_by_key(|(w, _)| *w);
        if let Some((wait, reason)) = worst {
            drop(guard);
            let (limit, what) = match reason {
                Rejection::GlobalRequests => (
                    "requests",
                    "the router's requests a second (admission.global)",
                ),
                Rejection::GlobalTokens => (
                    "tokens",
                    "the router's prompt tokens a second (admission.global)",
                ),
                Rejection::KeyRequests => ("requests", "this API key's requests a second"),
                _ => ("tokens", "this API key's prompt tokens a second"),
            };
            self.metrics
                .rejections
                .with_label_values(&[reason.as_str()])
                .inc();
            return Err(ApiError::rate_limited(
                limit,
                format!(
                    "Rate limit reached: {what}. Please try again in {:.1}s.",
                    wait.as_secs_f64()
                ),
                wait,
            ));
        }
        s.global.take(tokens, now);
        if let Some(b) = key_buckets {
            b.take(tokens, now);
        }
        Ok(())
    }

    fn refuse(&self, reason: Rejection, message: String) -> ApiError {
        self.metrics
            .rejections
            .with_label_values(&[reason.as_str()])
            .inc();
        match reason {
            Rejection::QueueTimeout => ApiError::queue_timeout(message),
            _ => ApiError::queue_full(message),
        }
    }

    /// A place was freed: the first waiter still there gets it, or it is returned.
    fn hand_on(&self, s: &mut State) {
        while let Some((_, tx)) = s.waiting.pop_first() {
            if tx.send(()).is_ok() {
                self.metrics.queue_depth.set(s.waiting.len() as i64);
                return;
            }
        }
        self.metrics.queue_depth.set(0);
        s.running = s.running.saturating_sub(1);
        self.metrics.running.set(s.running as i64);
    }

    /// Requests waiting in the queue now.
    pub fn queue_depth(&self) -> usize {
        self.lock().waiting.len()
    }
}

fn queue_full_message(limit: usize, capacity: usize, timeout: Duration) -> String {
    if timeout.is_zero() {
        format!(
            "the router runs {limit} requests at once (admission.max_running) and does not \
             queue more (admission.queue_timeout is 0); retry later"
        )
    } else {
        format!(
            "the router runs {limit} requests at once (admission.max_running) and {capacity} \
             more wait (admission.queue_capacity); retry later"
        )
    }
}

#[cfg(test)]
mod tests;
