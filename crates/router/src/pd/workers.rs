//! The workers the router can call: one handle per worker (its connection, breaker, drain
//! state, health, this router's load on it, its DP accounting) and the pools of them by role,
//! replaced whole when discovery reports a change.
//!
//! A worker leaves rotation two ways: its breaker opens after requests fail on it, or it
//! fails `health.eject_after` health polls in a row (a stopped or wedged process fails no
//! request until one is sent to it, so the polls catch it first). A health-ejected worker is
//! readmitted by the first poll it answers. Each answer carries the worker's instance id; a
//! new one at the same address is a restarted process, and what the router knew of the old
//! one (its DP accounting, its breaker's failures, what its prefix cache held) is dropped.

use crate::generator::GenerateError;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tandem_core::{ErrorClass, WorkerId};
use tandem_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};

/// gRPC metadata key in which workers report the [`ErrorClass`] of a failed call.
pub(crate) const ERROR_CLASS_HEADER: &str = "x-tandem-error-class";

/// Maps a gRPC status to an error class: the worker's own classification when present.
pub fn classify_status(s: tonic::Status) -> GenerateError {
    let reported = s
        .metadata()
        .get(ERROR_CLASS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| match v {
            "invalid_request" => Some(ErrorClass::InvalidRequest),
            "unavailable" => Some(ErrorClass::Unavailable),
            "capacity_exhausted" => Some(ErrorClass::CapacityExhausted),
            "transfer_failed" => Some(ErrorClass::TransferFailed),
            "cancelled" => Some(ErrorClass::Cancelled),
            "deadline_exceeded" => Some(ErrorClass::DeadlineExceeded),
            "internal" => Some(ErrorClass::Internal),
            _ => None,
        });
    // Not classified by a worker (every worker error carries its class): the status came
    // from the transport or something in between — a sidecar's HTTP 502 with a non-gRPC body
    // reaches tonic as a protocol error (`Internal`), a reset HTTP/2 connection as
    // `Cancelled` or `Unknown`. Another worker may well succeed, so those are retried.
    let class = reported.unwrap_or(match s.code() {
        tonic::Code::InvalidArgument => ErrorClass::InvalidRequest,
        tonic::Code::ResourceExhausted => ErrorClass::CapacityExhausted,
        tonic::Code::Aborted => ErrorClass::TransferFailed,
        tonic::Code::DeadlineExceeded => ErrorClass::DeadlineExceeded,
        _ => ErrorClass::Unavailable,
    });
    // A status the worker did not classify came from the transport (a reset connection, an
    // HTTP/2 error, a refused connect): keep its details in the log, not in the API answer.
    let message = if reported.is_none() && class == ErrorClass::Unavailable {
        tracing::debug!(code = ?s.code(), detail = %s.message(), "worker transport error");
        format!(
            "the connection to a worker failed ({})",
            transport_reason(s.code())
        )
    } else {
        s.message().to_string()
    };
    GenerateError::new(class, message)
}

fn transport_reason(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::Unknown | tonic::Code::Cancelled => "broken stream",
        _ => "protocol error",
    }
}

/// One worker the router can call.
#[derive(Clone, Debug)]
pub struct WorkerHandle {
    /// Its id in the configuration.
    pub id: WorkerId,
    /// Its gRPC address.
    pub address: String,
    pub(crate) client: pb::worker_client::WorkerClient<Channel>,
    /// Requests in flight per attention-DP group (decode workers), learned on first use.
    pub(crate) dp_load: Arc<Mutex<Option<Vec<usize>>>>,
    /// Ejects the worker from new routing after repeated failures of its own.
    pub(crate) breaker: Arc<Mutex<crate::pd::breaker::Breaker>>,
    /// Set while the worker drains (its stats or its discovery record say so): it gets no
    /// new requests.
    pub(crate) draining: Arc<AtomicBool>,
    /// Whether the worker answered its last health check.
    reachable: Arc<AtomicBool>,
    /// Health polls failed in a row.
    health_failures: Arc<AtomicU32>,
    /// Out of rotation for failing `health.eject_after` polls; back when one is answered.
    health_ejected: Arc<AtomicBool>,
    /// The instance id of the worker's last answer (empty before one).
    instance: Arc<Mutex<String>>,
    /// Requests sent to the worker since the router started (each leg of each attempt).
    routed: Arc<AtomicU64>,
    /// Requests this router has on the worker now (a prefill call, a decode stream).
    pub(crate) load: Arc<AtomicUsize>,
    /// Free KV blocks at its last stats.
    pub(crate) kv_free: Arc<std::sync::atomic::AtomicU64>,
}

/// One request's claim on a worker's load; released on drop.
#[derive(Debug)]
pub(crate) struct LoadClaim(Arc<AtomicUsize>);

impl Drop for LoadClaim {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        LOAD_RELEASED.notify_waiters();
    }
}

/// Woken whenever a claim on any worker ends: requests waiting for room look again.
pub(crate) static LOAD_RELEASED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Woken when a worker answers its health check again after failing it, or the worker set
/// changes: requests waiting out an outage try again.
pub(crate) static WORKERS_CHANGED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// What an attempt says about one worker it was routed to.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outcome {
    Ok,
    Failed(ErrorClass),
    Untested,
}

/// Holds a request's place on a decode worker's attention-DP group; released on drop.
#[derive(Debug)]
pub(crate) struct DpSlot {
    load: Arc<Mutex<Option<Vec<usize>>>>,
    rank: usize,
}

impl Drop for DpSlot {
    fn drop(&mut self) {
        if let Ok(mut l) = self.load.lock() {
            if let Some(v) = l.as_mut() {
                v[self.rank] = v[self.rank].saturating_sub(1);
            }
        }
    }
}

impl WorkerHandle {
    /// A lazily connected handle to the worker at `address` (`http://host:port`), with the
    /// default connect timeout.
    pub fn new(id: WorkerId, address: &str) -> Result<Self, GenerateError> {
        Self::with_connect_timeout(id, address, crate::config::Timeouts::default().connect)
    }

    /// A lazily connected handle whose connection attempts give up after `connect`.
    pub fn with_connect_timeout(
        id: WorkerId,
        address: &str,
        connect: Duration,
    ) -> Result<Self, GenerateError> {
        Self::with_tls(id, address, connect, None)
    }

    /// A lazily connected handle over mutual TLS when `tls` is given (the address must then
    /// be `https://`; without it, `http://`: a worker is never reached in plain text by a
    /// router configured for TLS, nor the other way round).
    pub fn with_tls(
        id: WorkerId,
        address: &str,
        connect: Duration,
        tls: Option<crate::tls::WorkerTls>,
    ) -> Result<Self, GenerateError> {
        let bad = |why: String| {
            GenerateError::new(
                ErrorClass::InvalidRequest,
                format!("bad worker address {address}: {why}"),
            )
        };
        let endpoint = Endpoint::from_shared(address.to_string())
            .map_err(|e| bad(e.to_string()))?
            .connect_timeout(connect)
            .tcp_nodelay(true);
        let https = endpoint.uri().scheme_str() == Some("https");
        let channel = match tls {
            Some(tls) if https => {
                // The TLS is the connector's own (tonic's would read the router's certificate
                // once): the channel dials `http://` so tonic adds none, and keeps the `https`
                // origin in its requests.
                let plain = Endpoint::from_shared(address.replacen("https://", "http://", 1))
                    .map_err(|e| bad(e.to_string()))?
                    .connect_timeout(connect)
                    .origin(endpoint.uri().clone());
                plain.connect_with_connector_lazy(tls)
            }
            Some(_) => return Err(bad("workers are reached over TLS: use https://".into())),
            None if https => return Err(bad("https:// needs the router's worker_tls".into())),
            None => endpoint.connect_lazy(),
        };
        Ok(Self {
            id,
            address: address.to_string(),
            client: pb::worker_client::WorkerClient::new(channel),
            dp_load: Arc::new(Mutex::new(None)),
            breaker: Arc::new(Mutex::new(crate::pd::breaker::Breaker::default())),
            draining: Arc::new(AtomicBool::new(false)),
            reachable: Arc::new(AtomicBool::new(true)),
            health_failures: Arc::new(AtomicU32::new(0)),
            health_ejected: Arc::new(AtomicBool::new(false)),
            instance: Arc::new(Mutex::new(String::new())),
            routed: Arc::new(AtomicU64::new(0)),
            load: Arc::new(AtomicUsize::new(0)),
            kv_free: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        })
    }

    pub(crate) fn claim(&self) -> LoadClaim {
        self.routed.fetch_add(1, Ordering::Relaxed);
        self.load.fetch_add(1, Ordering::Relaxed);
        LoadClaim(self.load.clone())
    }

    /// Requests this router has on the worker now.
    pub fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }

    pub(crate) fn candidate(
        &self,
        cached_blocks: usize,
        limit: usize,
    ) -> crate::pd::policy::Candidate {
        crate::pd::policy::Candidate {
            usable: !self.is_draining()
                && (limit == 0 || self.load() < limit)
                && !self.is_health_ejected()
                && self.admit(),
            load: self.load(),
            kv_free: self.kv_free.load(Ordering::Relaxed),
            cached_blocks,
        }
    }

    /// Whether the worker drains (no new requests go to it).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the worker answered its last health check (true until one fails).
    pub fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Records a health check's outcome. A worker answering again after failing is let
    /// back at once (an open breaker takes its next request as the probe) and requests
    /// waiting out an outage are woken.
    pub(crate) fn set_reachable(&self, reachable: bool) {
        if self.reachable.swap(reachable, Ordering::Relaxed) == reachable {
            return;
        }
        if reachable {
            tracing::info!(worker = %self.id, "worker answers its health check again");
            if let Ok(mut b) = self.breaker.lock() {
                b.on_recovered(std::time::Instant::now());
            }
            WORKERS_CHANGED.notify_waiters();
        } else {
            tracing::warn!(worker = %self.id, "worker does not answer its health check");
        }
    }

    /// Records an answered health poll from the worker's instance `instance_id`. A worker
    /// ejected by failed polls is back in rotation; one answering with another instance id
    /// than before restarted, and its old state is dropped. Returns whether it restarted.
    pub(crate) fn health_answered(&self, instance_id: &str) -> bool {
        self.health_failures.store(0, Ordering::Relaxed);
        let restarted = {
            let mut known = self.instance.lock().unwrap_or_else(|e| e.into_inner());
            let restarted = !known.is_empty() && *known != instance_id;
            if *known != instance_id {
                instance_id.clone_into(&mut known);
            }
            restarted
        };
        if restarted {
            tracing::warn!(worker = %self.id, instance = instance_id,
                "worker restarted (a new instance at the same address): dropping what was known of the old one");
            *self.dp_load.lock().unwrap_or_else(|e| e.into_inner()) = None;
            if let Ok(mut b) = self.breaker.lock() {
                b.on_recovered(std::time::Instant::now());
            }
        }
        if self.health_ejected.swap(false, Ordering::Relaxed) {
            tracing::info!(worker = %self.id, "worker answers its health poll again: back in rotation");
        }
        self.set_reachable(true);
        restarted
    }

    /// Records a failed health poll; the `eject_after`-th in a row takes the worker out of
    /// rotation.
    pub(crate) fn health_failed(&self, eject_after: u32) {
        let failures = self.health_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= eject_after && !self.health_ejected.swap(true, Ordering::Relaxed) {
            tracing::warn!(worker = %self.id, failures,
                "worker failed its health polls: taken out of rotation until it answers");
        }
        self.set_reachable(false);
    }

    /// Whether failed health polls keep the worker out of rotation now.
    pub fn is_health_ejected(&self) -> bool {
        self.health_ejected.load(Ordering::Relaxed)
    }

    /// Health polls failed in a row now.
    pub fn health_failures(&self) -> u32 {
        self.health_failures.load(Ordering::Relaxed)
    }

    /// The instance id of the worker's last answer (empty before one).
    pub fn instance_id(&self) -> String {
        self.instance
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Requests sent to the worker since the router started (each leg of each attempt).
    pub fn routed(&self) -> u64 {
        self.routed.load(Ordering::Relaxed)
    }

    /// Why the worker is out of rotation: `health` (failed polls) or `breaker` (failed
    /// requests); `None` when it is not.
    pub fn ejected_by(&self) -> Option<&'static str> {
        if self.is_health_ejected() {
            Some("health")
        } else if self.breaker_open() {
            Some("breaker")
        } else {
            None
        }
    }

    /// Marks the worker draining or not.
    pub fn set_draining(&self, draining: bool) {
        if self.draining.swap(draining, Ordering::Relaxed) != draining {
            tracing::info!(worker = %self.id, draining, "worker state changed");
        }
    }

    /// `active`, `draining` or `ejected`.
    pub fn state(&self) -> &'static str {
        if self.is_draining() {
            "draining"
        } else if self.is_ejected() {
            "ejected"
        } else {
            "active"
        }
    }

    /// Picks the least-loaded attention-DP group of this (decode) worker and holds a place
    /// on it. `None` for the rank when the worker has a single group.
    pub(crate) async fn pick_dp_rank(
        &self,
    ) -> Result<(Option<u32>, Option<DpSlot>), GenerateError> {
        let known = self.dp_load.lock().map(|l| l.is_some()).unwrap_or(false);
        if !known {
            let dp = self.stats().await?.dp_size.max(1) as usize;
            if let Ok(mut l) = self.dp_load.lock() {
                l.get_or_insert_with(|| vec![0; dp]);
            }
        }
        let mut guard = self
            .dp_load
            .lock()
            .map_err(|_| GenerateError::new(ErrorClass::Internal, "DP load table poisoned"))?;
        let Some(loads) = guard.as_mut() else {
            return Ok((None, None));
        };
        if loads.len() <= 1 {
            return Ok((None, None));
        }
        let rank = (0..loads.len()).min_by_key(|&r| (loads[r], r)).unwrap_or(0);
        loads[rank] += 1;
        Ok((
            Some(rank as u32),
            Some(DpSlot {
                load: self.dp_load.clone(),
                rank,
            }),
        ))
    }

    /// Whether the worker is out of rotation now: its breaker is open, or it failed its
    /// health polls.
    pub fn is_ejected(&self) -> bool {
        self.is_health_ejected() || self.breaker_open()
    }

    fn breaker_open(&self) -> bool {
        self.breaker
            .lock()
            .is_ok_and(|b| b.is_open(std::time::Instant::now()))
    }

    /// Its breaker's state now (`closed`, `open` or `half_open`; see [`Breaker::state`]).
    ///
    /// [`Breaker::state`]: crate::pd::breaker::Breaker::state
    pub fn breaker_state(&self) -> &'static str {
        self.breaker
            .lock()
            .map_or("closed", |b| b.state(std::time::Instant::now()))
    }

    /// Times the worker's breaker took it out of rotation since the router started (failed
    /// health polls not counted).
    pub fn ejections(&self) -> u64 {
        self.breaker.lock().map_or(0, |b| b.ejections())
    }

    pub(crate) fn admit(&self) -> bool {
        self.breaker
            .lock()
            .is_ok_and(|mut b| b.admit(std::time::Instant::now()) != crate::pd::breaker::Admit::No)
    }

    pub(crate) fn report(&self, outcome: Outcome, policy: crate::pd::breaker::BreakerPolicy) {
        if let Ok(mut b) = self.breaker.lock() {
            match outcome {
                Outcome::Ok => b.on_success(),
                Outcome::Failed(class) => b.on_failure(class, std::time::Instant::now(), policy),
                Outcome::Untested => b.on_untested(),
            }
        }
    }

    /// The worker's counters (KV pool, running requests).
    pub async fn stats(&self) -> Result<pb::StatsResponse, GenerateError> {
        self.stats_when_idle(Duration::ZERO).await
    }

    /// The worker's counters once it is idle (no KV or state held), or after `wait`.
    pub async fn stats_when_idle(
        &self,
        wait: Duration,
    ) -> Result<pb::StatsResponse, GenerateError> {
        let mut c = self.client.clone();
        let wait_idle_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        Ok(c.stats(pb::StatsRequest {
            wait_idle_ms,
            wait_busy_ms: 0,
        })
        .await
        .map_err(classify_status)?
        .into_inner())
    }
}

/// The workers requests can go to, by role; replaced whole when discovery reports a change.
#[derive(Debug, Default)]
pub struct Pools {
    /// Prefill workers.
    pub prefill: Vec<WorkerHandle>,
    /// Decode workers.
    pub decode: Vec<WorkerHandle>,
    /// Aggregated workers.
    pub aggregated: Vec<WorkerHandle>,
}

impl Pools {
    /// Routes: each aggregated worker is one, the P/D pairs together another.
    pub(crate) fn routes(&self) -> usize {
        self.aggregated.len() + usize::from(!self.prefill.is_empty() && !self.decode.is_empty())
    }

    /// Whether some route has room: a usable prefill and a usable decode worker below
    /// `limit` requests, or a usable aggregated one. Routes whose workers are all
    /// unusable for other reasons (draining, ejected) do not count as full.
    pub(crate) fn has_room(&self, limit: usize) -> bool {
        let free = |w: &WorkerHandle| w.load() < limit;
        let usable = |w: &&WorkerHandle| !w.is_draining() && !w.is_ejected();
        let pool_full = |list: &[WorkerHandle]| {
            let live: Vec<&WorkerHandle> = list.iter().filter(usable).collect();
            !live.is_empty() && live.iter().all(|w| !free(w))
        };
        let pairs = !self.prefill.is_empty()
            && !self.decode.is_empty()
            && !pool_full(&self.prefill)
            && !pool_full(&self.decode);
        let aggregated = !self.aggregated.is_empty() && !pool_full(&self.aggregated);
        // No route at all is not "full": the attempt reports that.
        pairs || aggregated || self.routes() == 0
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = &WorkerHandle> {
        self.prefill
            .iter()
            .chain(&self.decode)
            .chain(&self.aggregated)
    }
}
