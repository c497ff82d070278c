//! The router's YAML configuration: a static list of prefill and decode workers, the served
//! model, the routing policy and timeouts.
//!
//! [`RawConfig`] is what the file says (unknown keys are errors); [`RawConfig::validate`]
//! turns it into a [`RouterConfig`] whose addresses are parsed, ids unique and lists
//! non-empty, reporting every problem at once. `model.dir` may be left out of the file and
//! given on the command line instead ([`RouterConfig::with_model_dir`]).

use crate::error::{Error, Result};
use axum::http::Uri;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tandem_core::WorkerId;

/// The configuration file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// `host:port` the HTTP server binds, an IP address (e.g. `127.0.0.1:8000`).
    pub listen: String,
    /// The served model.
    pub model: ModelConfig,
    /// Prefill workers.
    #[serde(default)]
    pub prefill: Vec<RawWorker>,
    /// Decode workers.
    #[serde(default)]
    pub decode: Vec<RawWorker>,
    /// Aggregated workers (`tandem worker --role both`): a whole request on one worker.
    #[serde(default)]
    pub aggregated: Vec<RawWorker>,
    /// How workers are picked; round-robin when absent.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Time limits; defaults when absent.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Where to find workers besides the static lists (which may then be empty).
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// Limits on what the router sends to each worker; none when absent.
    #[serde(default)]
    pub admission: AdmissionConfig,
    /// Retries of a request that failed before its first token.
    #[serde(default)]
    pub retry: RetryConfig,
    /// When a failing worker is taken out of rotation; defaults when absent.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// How workers are polled, and when one that does not answer leaves rotation.
    #[serde(default)]
    pub health: HealthConfig,
    /// API keys; every route open when absent.
    #[serde(default)]
    pub auth: crate::auth::AuthConfig,
    /// HTTPS on `listen`; plain HTTP when absent.
    #[serde(default)]
    pub tls: Option<crate::tls::HttpsConfig>,
    /// Mutual TLS to the workers (their addresses are then `https://`); plain-text gRPC
    /// when absent.
    #[serde(default)]
    pub worker_tls: Option<crate::tls::WorkerTlsConfig>,
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
        let d = crate::breaker::BreakerPolicy::default();
        Self {
            threshold: d.threshold,
            cooldown: d.cooldown,
        }
    }
}

impl BreakerConfig {
    /// The breaker policy this configures.
    pub fn policy(self) -> crate::breaker::BreakerPolicy {
        crate::breaker::BreakerPolicy {
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
    fn check(&self, auth: bool, problems: &mut Vec<String>) {
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

/// Worker discovery.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Workers registered in etcd (`tandem worker --discovery etcd://…`).
    pub etcd: EtcdDiscoveryConfig,
}

/// The etcd the workers register in.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdDiscoveryConfig {
    /// Client URLs, `http://host:port`.
    pub endpoints: Vec<String>,
    /// Key prefix of this deployment (the workers' `--discovery-prefix`).
    #[serde(default = "default_prefix")]
    pub prefix: String,
}

fn default_prefix() -> String {
    "/tandem".into()
}

/// The served model.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Name clients pass as `model`.
    pub served_name: String,
    /// Hugging Face model directory (tokenizer, config); may come from the command line.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// A Jinja chat template to use instead of the model's own: a file, or a template built
    /// into tandem by name (`chatml-tools`: ChatML with tool calling).
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
}

/// A worker as written in the file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWorker {
    /// Unique among all workers.
    pub id: String,
    /// gRPC endpoint, `http://host:port`.
    pub address: String,
}

/// Worker selection policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// Prefill and decode workers each in turn.
    #[default]
    RoundRobin,
    /// The less loaded (requests this router has on it) of two workers drawn at random.
    PowerOfTwo,
    /// Prefill: the worker that computed the longest prefix of the prompt recently, unless
    /// it is `balance` requests busier than the least loaded. Decode: the most free KV.
    CacheAware {
        /// Load difference above which balance wins over a cache hit.
        #[serde(default = "default_balance")]
        balance: usize,
    },
}

fn default_balance() -> usize {
    8
}

impl PolicyConfig {
    /// The policy this configures.
    pub fn policy(self) -> crate::policy::Policy {
        match self {
            PolicyConfig::RoundRobin => crate::policy::Policy::RoundRobin,
            PolicyConfig::PowerOfTwo => crate::policy::Policy::PowerOfTwo,
            PolicyConfig::CacheAware { balance } => crate::policy::Policy::CacheAware { balance },
        }
    }
}

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

/// A checked configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Where the HTTP server binds.
    pub listen: SocketAddr,
    /// The served model.
    pub model: ModelConfig,
    /// Prefill workers; empty only with no decode workers and some aggregated ones.
    pub prefill: Vec<WorkerEndpoint>,
    /// Decode workers; empty exactly when `prefill` is.
    pub decode: Vec<WorkerEndpoint>,
    /// Aggregated workers; may be empty when there are P/D pairs.
    pub aggregated: Vec<WorkerEndpoint>,
    /// Worker selection policy.
    pub policy: PolicyConfig,
    /// Time limits; all non-zero.
    pub timeouts: Timeouts,
    /// Discovery, when workers are found in etcd.
    pub discovery: Option<DiscoveryConfig>,
    /// Per-worker limits.
    pub admission: AdmissionConfig,
    /// Retries before the first token.
    pub retry: RetryConfig,
    /// Circuit breaking.
    pub breaker: BreakerConfig,
    /// Health polls and ejection.
    pub health: HealthConfig,
    /// API keys.
    pub auth: crate::auth::AuthConfig,
    /// HTTPS on the front; its files loaded once already.
    pub tls: Option<crate::tls::HttpsConfig>,
    /// Mutual TLS to the workers; its files loaded once already, every static worker
    /// address `https://`.
    pub worker_tls: Option<crate::tls::WorkerTlsConfig>,
}

/// A worker the router may send requests to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEndpoint {
    /// Its id.
    pub id: WorkerId,
    /// Its gRPC endpoint.
    pub address: WorkerAddress,
}

/// A worker's gRPC endpoint: an `http`/`https` URI with a host and no path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerAddress(Uri);

impl WorkerAddress {
    /// Parses and checks `text`.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let uri: Uri = text
            .parse()
            .map_err(|err| format!("`{text}` is not a URI: {err}"))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            _ => return Err(format!("`{text}` must start with http:// or https://")),
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(format!("`{text}` has no host"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!("`{text}` must not have a path or query"));
        }
        Ok(Self(uri))
    }

    /// The URI.
    pub fn uri(&self) -> &Uri {
        &self.0
    }
}

impl fmt::Display for WorkerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `Uri` renders an empty path as "/"; show the authority form users wrote.
        match (self.0.scheme_str(), self.0.authority()) {
            (Some(scheme), Some(authority)) => write!(f, "{scheme}://{authority}"),
            _ => write!(f, "{}", self.0),
        }
    }
}

impl RawConfig {
    /// Parses YAML text.
    pub fn from_yaml(text: &str) -> Result<Self> {
        serde_yaml::from_str(text).map_err(Error::ConfigParse)
    }

    /// Checks everything, reporting all problems in one [`Error::InvalidConfig`].
    pub fn validate(self) -> Result<RouterConfig> {
        let mut problems = Vec::new();
        let listen = self
            .listen
            .parse::<SocketAddr>()
            .map_err(|err| {
                problems.push(format!(
                    "listen: `{}` is not an ip:port address ({err})",
                    self.listen
                ))
            })
            .ok();
        if self.model.served_name.trim().is_empty() {
            problems.push("model.served_name must not be empty".to_owned());
        }
        let mut ids = HashSet::new();
        // Either P/D pairs (both lists non-empty), aggregated workers, or both kinds.
        let pd_needed = self.discovery.is_none()
            && (self.aggregated.is_empty() || !self.prefill.is_empty() || !self.decode.is_empty());
        if let Some(d) = &self.discovery {
            if d.etcd.endpoints.is_empty() {
                problems.push("discovery.etcd.endpoints must list at least one URL".to_owned());
            }
            for e in &d.etcd.endpoints {
                if let Err(p) = WorkerAddress::parse(e) {
                    problems.push(format!("discovery.etcd.endpoints: {p}"));
                }
            }
            if !d.etcd.prefix.starts_with('/') {
                problems.push(format!(
                    "discovery.etcd.prefix `{}` must start with /",
                    d.etcd.prefix
                ));
            }
        }
        let prefill = check_workers("prefill", self.prefill, pd_needed, &mut ids, &mut problems);
        let decode = check_workers("decode", self.decode, pd_needed, &mut ids, &mut problems);
        let aggregated = check_workers(
            "aggregated",
            self.aggregated,
            false,
            &mut ids,
            &mut problems,
        );
        for (name, value) in [
            ("connect", self.timeouts.connect),
            ("first_token", self.timeouts.first_token),
            ("inter_token", self.timeouts.inter_token),
            ("request", self.timeouts.request),
        ] {
            if value.is_zero() {
                problems.push(format!("timeouts.{name} must be greater than zero"));
            }
        }
        if !(1..=20).contains(&self.retry.attempts) {
            problems.push(format!(
                "retry.attempts must be 1..=20, got {}",
                self.retry.attempts
            ));
        }
        if !(1..=100).contains(&self.breaker.threshold) {
            problems.push(format!(
                "breaker.threshold must be 1..=100, got {}",
                self.breaker.threshold
            ));
        }
        if !(1..=100).contains(&self.health.eject_after) {
            problems.push(format!(
                "health.eject_after must be 1..=100, got {}",
                self.health.eject_after
            ));
        }
        if self.health.interval.is_zero() {
            problems.push("health.interval must be greater than zero".into());
        }
        if self.breaker.cooldown.is_zero() {
            problems.push("breaker.cooldown must be greater than zero".into());
        }
        self.admission.check(self.auth.enabled(), &mut problems);
        if self.auth.enabled() {
            if let Err(p) = crate::auth::ApiKeys::from_config(&self.auth) {
                problems.push(p);
            }
        }
        if let Some(tls) = &self.tls {
            tls.check(&mut problems);
        }
        if let Some(tls) = &self.worker_tls {
            tls.check(&mut problems);
        }
        let want = if self.worker_tls.is_some() {
            "https"
        } else {
            "http"
        };
        for (role, list) in [
            ("prefill", &prefill),
            ("decode", &decode),
            ("aggregated", &aggregated),
        ] {
            for (i, w) in list.iter().enumerate() {
                if w.address.uri().scheme_str() != Some(want) {
                    problems.push(format!(
                        "{role}[{i}].address {}: {}",
                        w.address,
                        if want == "https" {
                            "workers are reached over mutual TLS (worker_tls): use https://"
                        } else {
                            "an https:// worker needs a worker_tls section"
                        }
                    ));
                }
            }
        }
        match listen {
            Some(listen) if problems.is_empty() => Ok(RouterConfig {
                listen,
                model: self.model,
                prefill,
                decode,
                aggregated,
                policy: self.policy,
                timeouts: self.timeouts,
                discovery: self.discovery,
                admission: self.admission,
                retry: self.retry,
                breaker: self.breaker,
                health: self.health,
                auth: self.auth,
                tls: self.tls,
                worker_tls: self.worker_tls,
            }),
            _ => Err(Error::InvalidConfig(problems.join("; "))),
        }
    }
}

fn check_workers(
    role: &str,
    workers: Vec<RawWorker>,
    required: bool,
    ids: &mut HashSet<String>,
    problems: &mut Vec<String>,
) -> Vec<WorkerEndpoint> {
    if required && workers.is_empty() {
        problems.push(format!(
            "{role}: at least one worker is required (or list only `aggregated` workers)"
        ));
    }
    let mut addresses = HashSet::new();
    let mut checked = Vec::new();
    for (i, worker) in workers.into_iter().enumerate() {
        if worker.id.trim().is_empty() {
            problems.push(format!("{role}[{i}].id must not be empty"));
        } else if !ids.insert(worker.id.clone()) {
            problems.push(format!(
                "{role}[{i}].id `{}` is used by another worker",
                worker.id
            ));
        }
        match WorkerAddress::parse(&worker.address) {
            Ok(address) => {
                if !addresses.insert(address.to_string()) {
                    problems.push(format!("{role}[{i}].address {address} is listed twice"));
                }
                checked.push(WorkerEndpoint {
                    id: WorkerId(worker.id),
                    address,
                });
            }
            Err(problem) => problems.push(format!("{role}[{i}].address: {problem}")),
        }
    }
    checked
}

impl RouterConfig {
    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self> {
        RawConfig::from_yaml(text)?.validate()
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_yaml(&text)
    }

    /// Sets `model.dir` (the command line overrides the file).
    pub fn with_model_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.model.dir = Some(dir.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
listen: 127.0.0.1:8000
model: {served_name: smol}
prefill: [{id: p0, address: 'http://127.0.0.1:50061'}]
decode: [{id: d0, address: 'http://127.0.0.1:50062'}]
policy: {kind: round_robin}
timeouts: {connect: 500ms, request: 2m}
";

    fn invalid(yaml: &str) -> String {
        match RouterConfig::from_yaml(yaml) {
            Err(Error::InvalidConfig(message)) => message,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn parses_a_good_file() {
        let config = RouterConfig::from_yaml(GOOD).expect("valid");
        assert_eq!(config.listen, "127.0.0.1:8000".parse().expect("addr"));
        assert_eq!(config.prefill[0].id, WorkerId("p0".into()));
        assert_eq!(
            config.decode[0].address.to_string(),
            "http://127.0.0.1:50062"
        );
        assert_eq!(config.timeouts.connect, Duration::from_millis(500));
        assert_eq!(config.timeouts.request, Duration::from_secs(120));
        assert_eq!(config.timeouts.first_token, Duration::from_secs(60));
        assert_eq!(config.model.dir, None);
        let config = config.with_model_dir("/models/smol");
        assert_eq!(config.model.dir, Some(PathBuf::from("/models/smol")));
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let yaml = format!("{GOOD}extra: 1\n");
        assert!(matches!(
            RouterConfig::from_yaml(&yaml),
            Err(Error::ConfigParse(_))
        ));
        let yaml = GOOD.replace("round_robin", "random");
        assert!(matches!(
            RouterConfig::from_yaml(&yaml),
            Err(Error::ConfigParse(_))
        ));
        let yaml = GOOD.replace("500ms", "soon");
        assert!(matches!(
            RouterConfig::from_yaml(&yaml),
            Err(Error::ConfigParse(_))
        ));
    }

    #[test]
    fn every_problem_is_reported() {
        let message = invalid(
            "
listen: localhost
model: {served_name: ''}
prefill: []
decode:
  - {id: d0, address: '127.0.0.1:50062'}
  - {id: d0, address: 'http://127.0.0.1:50063/x'}
  - {id: d2, address: 'http://127.0.0.1:50064'}
  - {id: d3, address: 'http://127.0.0.1:50064'}
timeouts: {connect: 0s}
",
        );
        for expected in [
            "listen",
            "served_name",
            "prefill: at least one worker",
            "must start with http://",
            "`d0` is used by another worker",
            "must not have a path",
            "listed twice",
            "timeouts.connect",
        ] {
            assert!(
                message.contains(expected),
                "{expected:?} not in {message:?}"
            );
        }
    }

    #[test]
    fn aggregated_workers_alone_or_beside_pairs() {
        let agg = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\naggregated: [{id: a0, address: 'http://127.0.0.1:50070'}]\n";
        let c = RouterConfig::from_yaml(agg).expect("aggregated workers alone");
        assert!(c.prefill.is_empty() && c.decode.is_empty() && c.aggregated.len() == 1);
        let half = format!("{agg}prefill: [{{id: p0, address: 'http://127.0.0.1:50061'}}]\n");
        assert!(invalid(&half).contains("decode: at least one worker"));
        let both = format!("{half}decode: [{{id: d0, address: 'http://127.0.0.1:50062'}}]\n");
        assert_eq!(
            RouterConfig::from_yaml(&both)
                .expect("pairs beside aggregated")
                .aggregated
                .len(),
            1
        );
        let none = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\n";
        assert!(invalid(none).contains("prefill: at least one worker"));
        assert!(invalid(&both.replace("id: a0", "id: p0")).contains("aggregated[0].id `p0`"));
    }

    #[test]
    fn discovery_alone_needs_no_static_workers_and_checks_its_endpoints() {
        let base = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\n";
        let c = RouterConfig::from_yaml(&format!(
            "{base}discovery: {{etcd: {{endpoints: ['http://127.0.0.1:2379']}}}}\n"
        ))
        .expect("etcd discovery alone");
        let d = c.discovery.expect("discovery kept");
        assert_eq!(d.etcd.prefix, "/tandem", "default prefix");
        assert!(c.prefill.is_empty() && c.decode.is_empty());
        let message = invalid(&format!(
            "{base}discovery: {{etcd: {{endpoints: ['127.0.0.1:2379', 'http://h:1'], prefix: x}}}}\n"
        ));
        assert!(
            message.contains("discovery.etcd.endpoints: `127.0.0.1:2379`"),
            "{message}"
        );
        assert!(
            message.contains("prefix `x` must start with /"),
            "{message}"
        );
        let message = invalid(&format!("{base}discovery: {{etcd: {{endpoints: []}}}}\n"));
        assert!(message.contains("at least one URL"), "{message}");
    }

    #[test]
    fn the_retry_budget_defaults_to_three_and_is_bounded() {
        let c = RouterConfig::from_yaml(GOOD).expect("valid");
        assert_eq!(c.retry, RetryConfig::default());
        assert_eq!(c.retry.attempts, 3);
        let c = RouterConfig::from_yaml(&format!("{GOOD}retry: {{attempts: 8, backoff: 10ms}}\n"))
            .expect("valid");
        assert_eq!(
            (c.retry.attempts, c.retry.backoff),
            (8, Duration::from_millis(10))
        );
        let message = invalid(&format!("{GOOD}retry: {{attempts: 0}}\n"));
        assert!(
            message.contains("retry.attempts must be 1..=20, got 0"),
            "{message}"
        );
    }

    #[test]
    fn the_breaker_defaults_to_three_failures_and_five_seconds_and_is_checked() {
        let c = RouterConfig::from_yaml(GOOD).expect("valid");
        assert_eq!(
            c.breaker.policy(),
            crate::breaker::BreakerPolicy {
                threshold: 3,
                cooldown: Duration::from_secs(5)
            }
        );
        let c =
            RouterConfig::from_yaml(&format!("{GOOD}breaker: {{threshold: 5, cooldown: 1m}}\n"))
                .expect("valid");
        assert_eq!(
            (c.breaker.threshold, c.breaker.cooldown),
            (5, Duration::from_secs(60))
        );
        let message = invalid(&format!("{GOOD}breaker: {{threshold: 0, cooldown: 0s}}\n"));
        assert!(
            message.contains("breaker.threshold must be 1..=100, got 0")
                && message.contains("breaker.cooldown must be greater than zero"),
            "{message}"
        );
        let err = RouterConfig::from_yaml(&format!("{GOOD}breaker: {{treshold: 2}}\n"))
            .expect_err("a misspelt key is refused");
        assert!(format!("{err:?}").contains("treshold"), "{err:?}");
    }

    #[test]
    fn every_policy_parses_and_unknown_ones_are_refused() {
        for (text, want) in [
            ("{kind: round_robin}", crate::policy::Policy::RoundRobin),
            ("{kind: power_of_two}", crate::policy::Policy::PowerOfTwo),
            (
                "{kind: cache_aware}",
                crate::policy::Policy::CacheAware { balance: 8 },
            ),
            (
                "{kind: cache_aware, balance: 2}",
                crate::policy::Policy::CacheAware { balance: 2 },
            ),
        ] {
            let yaml = GOOD.replace("policy: {kind: round_robin}", &format!("policy: {text}"));
            let c = RouterConfig::from_yaml(&yaml).expect(text);
            assert_eq!(c.policy.policy(), want, "{text}");
        }
        let bad = GOOD.replace("policy: {kind: round_robin}", "policy: {kind: random}");
        assert!(RouterConfig::from_yaml(&bad).is_err());
    }

    #[test]
    fn admission_defaults_limit_nothing_and_its_limits_are_checked() {
        let c = RouterConfig::from_yaml(GOOD).expect("valid");
        assert_eq!(c.admission, AdmissionConfig::default());
        assert!(c.admission.max_running.is_none() && !c.admission.global.any());
        let keyed = format!(
            "{GOOD}auth: {{api_keys: ['sk-1 batch']}}\nadmission:\n  max_running: 8\n  \
             queue_timeout: 30s\n  global: {{tokens_per_second: 5000}}\n  \
             per_key: {{requests_per_second: 2, requests_burst: 4}}\n  \
             keys: {{batch: {{priority: 10, limits: {{requests_per_second: 0.5}}}}}}\n"
        );
        let c = RouterConfig::from_yaml(&keyed).expect("valid");
        let a = &c.admission;
        assert_eq!(
            (a.max_running, a.queue_timeout, a.queue_capacity),
            (Some(8), Duration::from_secs(30), DEFAULT_QUEUE_CAPACITY)
        );
        assert_eq!(a.global.tokens_per_second, Some(5000.0));
        let batch = a.keys["batch"];
        assert_eq!(batch.priority, Some(10));
        let effective = batch.limits.or(a.per_key);
        assert_eq!(
            (effective.requests_per_second, effective.requests_burst),
            (Some(0.5), None),
            "the key's own rate comes with its own burst"
        );
        let message = invalid(&format!(
            "{GOOD}admission:\n  max_running: 0\n  global: {{requests_per_second: 0, tokens_burst: 9}}\n  \
             per_key: {{requests_per_second: 1}}\n"
        ));
        for expected in [
            "admission.max_running must be at least 1",
            "admission.global.requests_per_second must be greater than zero",
            "admission.global.tokens_burst needs tokens_per_second",
            "need API keys",
        ] {
            assert!(
                message.contains(expected),
                "{expected:?} not in {message:?}"
            );
        }
        let err = RouterConfig::from_yaml(&format!("{GOOD}admission: {{max_runing: 2}}\n"))
            .expect_err("a misspelt key is refused");
        assert!(format!("{err:?}").contains("max_runing"), "{err:?}");
    }

    #[test]
    fn health_ejects_after_three_failed_polls_by_default_and_is_checked() {
        let c = RouterConfig::from_yaml(GOOD).expect("valid");
        assert_eq!(
            (c.health.interval, c.health.eject_after),
            (Duration::from_secs(1), 3)
        );
        let c = RouterConfig::from_yaml(&format!(
            "{GOOD}health: {{interval: 250ms, eject_after: 5}}\n"
        ))
        .expect("valid");
        assert_eq!(
            (c.health.interval, c.health.eject_after),
            (Duration::from_millis(250), 5)
        );
        let message = invalid(&format!("{GOOD}health: {{interval: 0s, eject_after: 0}}\n"));
        assert!(
            message.contains("health.eject_after must be 1..=100, got 0")
                && message.contains("health.interval must be greater than zero"),
            "{message}"
        );
    }

    #[test]
    fn tls_sections_load_their_files_and_worker_addresses_follow_worker_tls() {
        let dir = tempfile::tempdir().expect("tmp");
        let (ca, cert, key) = crate::tls::tests::issue(dir.path(), "router");
        let (ca, cert, key) = (ca.display(), cert.display(), key.display());
        let tls = format!(
            "tls: {{cert: '{cert}', key: '{key}', client_ca: '{ca}'}}\n\
             worker_tls: {{ca: '{ca}', cert: '{cert}', key: '{key}', server_name: tandem-worker}}\n"
        );
        let https = GOOD.replace("http://", "https://");
        let c = RouterConfig::from_yaml(&format!("{https}{tls}")).expect("valid");
        let front = c.tls.expect("tls kept");
        assert_eq!(front.cert.display().to_string(), cert.to_string());
        assert_eq!(
            front.client_ca.map(|p| p.display().to_string()),
            Some(ca.to_string())
        );
        let workers = c.worker_tls.expect("worker_tls kept");
        assert_eq!(workers.server_name.as_deref(), Some("tandem-worker"));
        let plain = RouterConfig::from_yaml(GOOD).expect("valid");
        assert!(
            plain.tls.is_none() && plain.worker_tls.is_none(),
            "plain HTTP by default"
        );

        let message = invalid(&format!("{GOOD}{tls}"));
        assert!(
            message.contains(
                "prefill[0].address http://127.0.0.1:50061: workers are reached over mutual TLS"
            ) && message.contains("decode[0].address"),
            "{message}"
        );
        let message = invalid(&https);
        assert!(message.contains("needs a worker_tls section"), "{message}");
        let missing = dir.path().join("gone.crt");
        let message = invalid(&format!(
            "{GOOD}tls: {{cert: '{}', key: '{key}'}}\n",
            missing.display()
        ));
        assert!(
            message.contains("tls: ") && message.contains("gone.crt"),
            "{message}"
        );
        let message = invalid(&format!(
            "{https}worker_tls: {{ca: '{key}', cert: '{cert}', key: '{key}'}}\n"
        ));
        assert!(
            message.contains("worker_tls: ") && message.contains("router.key"),
            "{message}"
        );
        let err = RouterConfig::from_yaml(&format!("{GOOD}tls: {{cert: a, key: b, ca: c}}\n"))
            .expect_err("a misspelt key is refused");
        assert!(format!("{err:?}").contains("unknown field `ca`"), "{err:?}");
    }

    #[test]
    fn ids_are_unique_across_roles() {
        let message = invalid(&GOOD.replace("id: d0", "id: p0"));
        assert!(message.contains("decode[0].id `p0`"), "{message}");
    }
}
