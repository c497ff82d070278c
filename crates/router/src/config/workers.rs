//! The `prefill`, `decode`, `aggregated`, `discovery` and `policy` sections: which workers the
//! router may call (listed, or found in etcd), their checked addresses, and how one is picked.

use axum::http::Uri;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::path::PathBuf;
use tandem_core::WorkerId;

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
    pub fn policy(self) -> crate::pd::policy::Policy {
        match self {
            PolicyConfig::RoundRobin => crate::pd::policy::Policy::RoundRobin,
            PolicyConfig::PowerOfTwo => crate::pd::policy::Policy::PowerOfTwo,
            PolicyConfig::CacheAware { balance } => {
                crate::pd::policy::Policy::CacheAware { balance }
            }
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
    /// Client URLs, `http://host:port` (`https://` with `tls`).
    pub endpoints: Vec<String>,
    /// Key prefix of this deployment (the workers' `--discovery-prefix`).
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// TLS to etcd, with a client certificate when etcd requires one.
    #[serde(default)]
    pub tls: Option<EtcdTlsConfig>,
}

/// The `discovery.etcd.tls` section: etcd's CA and the router's client certificate (read at
/// every connection to etcd, so rotated files are used from the next reconnection on).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTlsConfig {
    /// PEM CA certificates etcd's server certificate must chain to.
    pub ca: PathBuf,
    /// The router's client certificate, PEM (for an etcd with `--client-cert-auth`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Its private key, PEM.
    #[serde(default)]
    pub key: Option<PathBuf>,
}

impl EtcdDiscoveryConfig {
    /// Adds what is wrong to `problems`: no endpoint, one that is not a URL or whose
    /// scheme does not match `tls`, a prefix not starting with `/`, a certificate without
    /// its key (or the reverse).
    pub(super) fn check(&self, problems: &mut Vec<String>) {
        if self.endpoints.is_empty() {
            problems.push("discovery.etcd.endpoints must list at least one URL".to_owned());
        }
        let want = if self.tls.is_some() { "https" } else { "http" };
        for e in &self.endpoints {
            match WorkerAddress::parse(e) {
                Err(p) => problems.push(format!("discovery.etcd.endpoints: {p}")),
                Ok(a) if a.uri().scheme_str() != Some(want) => problems.push(format!(
                    "discovery.etcd.endpoints: `{e}` must be {want}:// ({})",
                    if self.tls.is_some() {
                        "etcd is reached over TLS (discovery.etcd.tls)"
                    } else {
                        "an https:// etcd needs discovery.etcd.tls with its CA"
                    }
                )),
                Ok(_) => {}
            }
        }
        if !self.prefix.starts_with('/') {
            problems.push(format!(
                "discovery.etcd.prefix `{}` must start with /",
                self.prefix
            ));
        }
        if let Some(tls) = &self.tls {
            if tls.cert.is_some() != tls.key.is_some() {
                problems.push(
                    "discovery.etcd.tls: cert and key go together (the router's client certificate)"
                        .to_owned(),
                );
            }
        }
    }

    /// The discovery crate's settings, with `ttl` for leases.
    pub fn etcd_config(&self, ttl: std::time::Duration) -> tandem_discovery::EtcdConfig {
        tandem_discovery::EtcdConfig {
            endpoints: self.endpoints.clone(),
            prefix: self.prefix.clone(),
            ttl,
            tls: self.tls.as_ref().map(|t| tandem_discovery::EtcdTls {
                ca: t.ca.clone(),
                identity: t
                    .cert
                    .clone()
                    .zip(t.key.clone())
                    .map(|(cert, key)| tandem_discovery::ClientIdentity { cert, key }),
            }),
        }
    }
}

fn default_prefix() -> String {
    "/tandem".into()
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

pub(super) fn check_workers(
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
