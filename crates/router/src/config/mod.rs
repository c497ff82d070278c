//! The router's YAML configuration: the served model, the workers (listed or discovered) and
//! how they are picked, time limits, retries, breakers, health polls, admission, API keys and
//! TLS.
//!
//! [`RawConfig`] is what the file says (unknown keys are errors); [`RawConfig::validate`]
//! turns it into a [`RouterConfig`] whose addresses are parsed, ids unique and lists
//! non-empty, reporting every problem at once. `model.dir` may be left out of the file and
//! given on the command line instead ([`RouterConfig::with_model_dir`]).
//!
//! This module holds the top-level structs and loading; each group of sections has its own
//! file, its types re-exported here (`config::Timeouts`, `config::AdmissionConfig`, …). The
//! `auth`, `tls` and `worker_tls` sections are defined beside the code they configure
//! (`crate::auth`, `crate::tls`).

/// The `admission` section: rate limits, the running cap and its queue, per-worker caps.
mod admission;
/// The `timeouts`, `retry`, `breaker` and `health` sections.
mod faults;
/// The worker lists, `discovery` and `policy`; worker addresses.
mod workers;

pub use admission::{AdmissionConfig, KeyAdmission, RateLimits, DEFAULT_QUEUE_CAPACITY};
pub use faults::{BreakerConfig, HealthConfig, RetryConfig, Timeouts};
pub use workers::{
    DiscoveryConfig, EtcdDiscoveryConfig, EtcdTlsConfig, PolicyConfig, RawWorker, WorkerAddress,
    WorkerEndpoint,
};

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use workers::check_workers;

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
            d.etcd.check(&mut problems);
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
mod tests;
