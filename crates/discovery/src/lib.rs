//! How the router finds workers. The trait is narrow: a [`Discovery`] hands out a
//! [`tokio::sync::watch`] receiver of the current [`WorkerSet`] (the list; `changed()` is the
//! watch). Two implementations: [`StaticDiscovery`], a fixed list (the embedded default: `make
//! run` needs no etcd), and [`EtcdDiscovery`], which lists a key prefix of etcd, watches it
//! from the revision it listed at, and lists again when the watch breaks or its revision was
//! compacted (an etcd restart included).
//!
//! Workers announce themselves with a [`Registration`]: their [`WorkerRecord`] as JSON under
//! `PREFIX/workers/ID`, attached to a lease they keep alive. A worker killed without
//! deregistering disappears when its lease expires; a worker whose lease is lost (etcd away
//! for longer than the TTL) is told through [`Registration::registered`] so it stops taking
//! work until it has registered again.

mod etcd;
/// A throwaway single-node etcd for tests and benchmarks.
pub mod local;

pub use etcd::{ClientIdentity, EtcdConfig, EtcdDiscovery, EtcdTls, Registration};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tokio::sync::watch;

/// Errors of discovery and registration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The etcd client failed (connect, lease, put, watch).
    #[error("etcd at {endpoints}: {source}")]
    Etcd {
        /// The endpoints asked.
        endpoints: String,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// A configuration value is unusable.
    #[error("{0}")]
    Config(String),
    /// A file named in the configuration (a certificate, a key) could not be read.
    #[error("reading {}: {source}", path.display())]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What a worker serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Computes prompts and pushes their KV.
    Prefill,
    /// Receives KV and generates.
    Decode,
    /// Both in one process (aggregated serving).
    Both,
}

impl WorkerRole {
    /// `prefill`, `decode` or `both`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Both => "both",
        }
    }
}

/// Whether a worker takes new work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Takes new requests.
    #[default]
    Active,
    /// Finishes what it has and takes nothing new (scale-down, SIGTERM).
    Draining,
}

/// What a worker announces about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Unique in the deployment (the key under the prefix).
    pub id: String,
    /// What it serves.
    pub role: WorkerRole,
    /// Its gRPC endpoint, `http://host:port`.
    pub address: String,
    /// Its layout as printed by the worker (`tp2 dp1 ep1`).
    #[serde(default)]
    pub layout: String,
    /// Identity of the served checkpoint (hex): P/D pairs of different identities refuse KV.
    #[serde(default)]
    pub model_id: String,
    /// KV blocks (or state slots) it has in all.
    #[serde(default)]
    pub capacity: u64,
    /// Whether it takes new work.
    #[serde(default)]
    pub state: WorkerState,
}

/// Every worker known, by id, and the etcd revision it was read at (0 for a static list).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerSet {
    /// The workers by id.
    pub workers: BTreeMap<String, WorkerRecord>,
    /// The store revision the set reflects.
    pub revision: i64,
}

impl WorkerSet {
    /// The workers of `role`, in id order.
    pub fn of_role(&self, role: WorkerRole) -> impl Iterator<Item = &WorkerRecord> {
        self.workers.values().filter(move |w| w.role == role)
    }
}

/// A source of the worker set: the current set, and a notification on every change.
pub trait Discovery: Send + Sync {
    /// A receiver whose value is the current set; `changed()` resolves on the next change.
    fn subscribe(&self) -> watch::Receiver<WorkerSet>;
}

/// A fixed list: the set never changes.
#[derive(Debug)]
pub struct StaticDiscovery {
    tx: watch::Sender<WorkerSet>,
}

impl StaticDiscovery {
    /// A source that always answers `workers`.
    pub fn new(workers: impl IntoIterator<Item = WorkerRecord>) -> Self {
        let set = WorkerSet {
            workers: workers.into_iter().map(|w| (w.id.clone(), w)).collect(),
            revision: 0,
        };
        Self {
            tx: watch::Sender::new(set),
        }
    }
}

impl Discovery for StaticDiscovery {
    fn subscribe(&self) -> watch::Receiver<WorkerSet> {
        self.tx.subscribe()
    }
}

/// The key of worker `id` under `prefix` (`/tandem` → `/tandem/workers/ID`).
pub fn worker_key(prefix: &str, id: &str) -> String {
    format!("{}/workers/{id}", prefix.trim_end_matches('/'))
}

/// The key prefix under which every worker's record lives.
pub fn workers_prefix(prefix: &str) -> String {
    format!("{}/workers/", prefix.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, role: WorkerRole) -> WorkerRecord {
        WorkerRecord {
            id: id.into(),
            role,
            address: format!("http://127.0.0.1:1/{id}"),
            layout: String::new(),
            model_id: String::new(),
            capacity: 0,
            state: WorkerState::Active,
        }
    }

    #[test]
    fn a_static_list_is_its_set_by_role() {
        let d = StaticDiscovery::new([
            record("d1", WorkerRole::Decode),
            record("p1", WorkerRole::Prefill),
            record("d0", WorkerRole::Decode),
        ]);
        let set = d.subscribe().borrow().clone();
        let decode: Vec<&str> = set
            .of_role(WorkerRole::Decode)
            .map(|w| w.id.as_str())
            .collect();
        assert_eq!(decode, ["d0", "d1"]);
        assert_eq!(set.of_role(WorkerRole::Prefill).count(), 1);
        assert_eq!(set.of_role(WorkerRole::Both).count(), 0);
    }

    #[test]
    fn records_read_back_with_defaults_for_what_older_workers_leave_out() {
        let r: WorkerRecord =
            serde_json::from_str(r#"{"id":"a","role":"both","address":"http://h:1"}"#)
                .expect("minimal record");
        assert_eq!(r.state, WorkerState::Active);
        assert_eq!(r.role, WorkerRole::Both);
        let back: WorkerRecord =
            serde_json::from_str(&serde_json::to_string(&r).expect("json")).expect("round trip");
        assert_eq!(back, r);
        assert!(
            serde_json::from_str::<WorkerRecord>(r#"{"id":"a","role":"x","address":""}"#).is_err()
        );
    }

    #[test]
    fn keys_live_under_the_prefix_with_or_without_a_trailing_slash() {
        assert_eq!(worker_key("/tandem", "p0"), "/tandem/workers/p0");
        assert_eq!(worker_key("/tandem/", "p0"), "/tandem/workers/p0");
        assert_eq!(workers_prefix("/x"), "/x/workers/");
    }
}
