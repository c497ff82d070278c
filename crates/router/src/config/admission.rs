//! The `admission` section: rate limits (global, per API key, per named key), the cap on
//! requests generating at once with its priority queue, and the cap on what each worker is
//! sent. Everything is off by default.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// What the router lets in, and in what order: rate limits (global and per API key, answered
/// 429 with `Retry-After`), a cap on requests generating at once with a priority queue in
/// front of it, and a cap on what each worker is sent. Everything is off by default: the
/// router then admits every request at once, as it always did.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Requests this router keeps on one worker at most (0: no limit). When every worker
    /// that could serve a request is at it, the request waits up to `queue_timeout`, then is
    /// answered 503 with `Retry-After`.
    pub max_in_flight_per_worker: usize,
    /// How long a request may wait in the router: for a place under `max_running`, and
    /// again for room under `max_in_flight_per_worker` (0: answer at once).
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// Requests generating at once, router-wide (absent: no limit). Beyond it, requests
    /// wait in priority order (lower `priority` first, then arrival).
    pub max_running: Option<usize>,
    /// Requests that may wait for a place under `max_running`; one more is answered 429.
    pub queue_capacity: usize,
    /// Limits over every request together.
    pub global: RateLimits,
    /// Limits each API key has on its own (keys with the same name share them).
    pub per_key: RateLimits,
    /// Named keys' own limits and default priority, by the name given to the key in the key
    /// list (`KEY NAME`).
    pub keys: std::collections::BTreeMap<String, KeyAdmission>,
}

/// The default [`AdmissionConfig::queue_capacity`].
pub const DEFAULT_QUEUE_CAPACITY: usize = 1024;

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_in_flight_per_worker: 0,
            queue_timeout: Duration::ZERO,
            max_running: None,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            global: RateLimits::default(),
            per_key: RateLimits::default(),
            keys: std::collections::BTreeMap::new(),
        }
    }
}

/// Rates in units a second, each with a burst (the most let through at once after a quiet
/// spell; the rate's one second when absent). Absent: no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimits {
    /// Requests a second.
    pub requests_per_second: Option<f64>,
    /// Requests at once.
    pub requests_burst: Option<f64>,
    /// Prompt tokens a second (counted when the request is admitted).
    pub tokens_per_second: Option<f64>,
    /// Prompt tokens at once.
    pub tokens_burst: Option<f64>,
}

impl RateLimits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.requests_per_second.is_some() || self.tokens_per_second.is_some()
    }

    /// These limits, each unset one taken from `fallback`.
    pub fn or(self, fallback: RateLimits) -> RateLimits {
        let (requests_per_second, requests_burst) = match self.requests_per_second {
            Some(r) => (Some(r), self.requests_burst),
            None => (fallback.requests_per_second, fallback.requests_burst),
        };
        let (tokens_per_second, tokens_burst) = match self.tokens_per_second {
            Some(r) => (Some(r), self.tokens_burst),
            None => (fallback.tokens_per_second, fallback.tokens_burst),
        };
        RateLimits {
            requests_per_second,
            requests_burst,
            tokens_per_second,
            tokens_burst,
        }
    }

    fn check(&self, at: &str, problems: &mut Vec<String>) {
        for (name, value) in [
            ("requests_per_second", self.requests_per_second),
            ("requests_burst", self.requests_burst),
            ("tokens_per_second", self.tokens_per_second),
            ("tokens_burst", self.tokens_burst),
        ] {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    problems.push(format!("{at}.{name} must be greater than zero, got {v}"));
                }
            }
        }
        if self.requests_burst.is_some() && self.requests_per_second.is_none() {
            problems.push(format!("{at}.requests_burst needs requests_per_second"));
        }
        if self.tokens_burst.is_some() && self.tokens_per_second.is_none() {
            problems.push(format!("{at}.tokens_burst needs tokens_per_second"));
        }
    }
}

/// One named API key's admission.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeyAdmission {
    /// Its limits; each unset one is `per_key`'s.
    pub limits: RateLimits,
    /// The priority of its requests that do not set one (default 0; lower goes first).
    pub priority: Option<i32>,
}

impl AdmissionConfig {
    pub(super) fn check(&self, auth: bool, problems: &mut Vec<String>) {
        self.global.check("admission.global", problems);
        self.per_key.check("admission.per_key", problems);
        for (name, key) in &self.keys {
            key.limits
                .check(&format!("admission.keys.{name}.limits"), problems);
        }
        if self.max_running == Some(0) {
            problems.push(
                "admission.max_running must be at least 1 (leave it out for no limit)".into(),
            );
        }
        if !auth && (self.per_key.any() || !self.keys.is_empty()) {
            problems.push(
                "admission.per_key and admission.keys need API keys (an `auth` section)".into(),
            );
        }
    }
}
