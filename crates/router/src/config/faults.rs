//! The `timeouts`, `retry`, `breaker` and `health` sections: how long the router waits, how
//! it tries a failed request again, and when it takes a failing worker out of rotation.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Time limits, written as humantime strings (`500ms`, `2s`, `10m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// Establishing a gRPC connection to a worker.
    #[serde(with = "humantime_serde")]
    pub connect: Duration,
    /// From admission to the first generated token.
    #[serde(with = "humantime_serde")]
    pub first_token: Duration,
    /// Between two generated tokens.
    #[serde(with = "humantime_serde")]
    pub inter_token: Duration,
    /// Whole request, end to end.
    #[serde(with = "humantime_serde")]
    pub request: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(2),
            first_token: Duration::from_secs(60),
            inter_token: Duration::from_secs(30),
            request: Duration::from_secs(600),
        }
    }
}

/// Each worker's circuit breaker: after `threshold` consecutive failures that are the
/// worker's fault (unreachable, transfer failed, stalled; never a client's bad request) the
/// worker gets no new requests for `cooldown`, then one request probes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failures that take a worker out of rotation (1..=100).
    pub threshold: u32,
    /// How long it stays out before a probe.
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        let d = crate::pd::breaker::BreakerPolicy::default();
        Self {
            threshold: d.threshold,
            cooldown: d.cooldown,
        }
    }
}

impl BreakerConfig {
    /// The breaker policy this configures.
    pub fn policy(self) -> crate::pd::breaker::BreakerPolicy {
        crate::pd::breaker::BreakerPolicy {
            threshold: self.threshold,
            cooldown: self.cooldown,
        }
    }
}

/// The router asks every worker for its stats each `interval` (waiting at most `interval`
/// for the answer). A worker that fails `eject_after` polls in a row is taken out of
/// rotation (state `ejected`, `ejected_by: health` in `/admin/workers`) until it answers one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Between two polls of a worker, and the longest a poll waits for its answer.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Failed polls in a row that take a worker out of rotation (1..=100).
    pub eject_after: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            eject_after: 3,
        }
    }
}

/// How a request that failed before its first token (on a retryable class: unavailable,
/// full, transfer failed) is tried again, each time on another pair. With a per-attempt
/// failure probability `p`, `p^attempts` of requests are lost: size `attempts` for the
/// fault rate the deployment must absorb.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts in all (1: no retry).
    pub attempts: u32,
    /// Backoff before the second attempt; doubles each time, with jitter.
    #[serde(with = "humantime_serde")]
    pub backoff: Duration,
    /// Moves to another pair a request may make after its stream broke mid-generation
    /// (0: none; the stream then ends with the error).
    pub migration_limit: u32,
    /// How long a request whose attempts found no worker to serve it (every one
    /// unreachable, ejected or its transfer broken, or none listed) keeps trying, a round of
    /// `attempts` at least every second or as soon as a worker comes back (e.g. the only
    /// decode worker restarting), before it fails (0: it fails after one round). Bounded by
    /// `timeouts.request`; keep it below `timeouts.inter_token` so a stream that migrates
    /// during an outage keeps its pace limit.
    #[serde(with = "humantime_serde")]
    pub outage_wait: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            attempts: 3,
            backoff: Duration::from_millis(50),
            migration_limit: 3,
            outage_wait: crate::pd::DEFAULT_OUTAGE_WAIT,
        }
    }
}
