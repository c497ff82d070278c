//! etcd: the router's watch of the worker prefix and a worker's leased registration, over
//! plain gRPC or TLS (with a client certificate for an etcd started with
//! `--client-cert-auth`). The certificate files are read at every connection, so files
//! rotated in place are used from the next reconnection on.

use crate::{
    worker_key, workers_prefix, Discovery, Error, Result, WorkerRecord, WorkerSet, WorkerState,
};
use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    WatchOptions,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

/// Where etcd is and how workers use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client URLs (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix of this deployment (several can share one etcd).
    pub prefix: String,
    /// Lease time-to-live of a worker's registration.
    pub ttl: Duration,
    /// TLS to etcd (`https://` endpoints); `None`: plain gRPC (`http://`).
    pub tls: Option<EtcdTls>,
}

/// How to reach etcd over TLS: the CA its server certificate is checked against, and the
/// certificate this client presents (required by an etcd with `--client-cert-auth`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA that signed etcd's server certificate (PEM).
    pub ca: PathBuf,
    /// This client's certificate and key.
    pub identity: Option<ClientIdentity>,
}

/// A client certificate and its private key (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The certificate (chain).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

impl EtcdTls {
    /// The client's TLS settings, the files read now.
    fn options(&self) -> Result<TlsOptions> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| Error::File {
                path: path.to_path_buf(),
                source,
            })
        };
        let mut options = TlsOptions::new().ca_certificate(Certificate::from_pem(read(&self.ca)?));
        if let Some(id) = &self.identity {
            options = options.identity(Identity::from_pem(read(&id.cert)?, read(&id.key)?));
        }
        Ok(options)
    }
}

impl EtcdConfig {
    /// Parses `etcd://host:port[,host:port…]` (or `http://…` URLs, comma-separated).
    pub fn from_url(url: &str, prefix: &str, ttl: Duration) -> Result<Self> {
        let rest = url.strip_prefix("etcd://").unwrap_or(url);
        let endpoints: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                if e.starts_with("http://") || e.starts_with("https://") {
                    e.to_string()
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        let config = Self {
            endpoints,
            prefix: prefix.to_string(),
            ttl,
            tls: None,
        };
        // The scheme is checked once the TLS setting is known (`with_tls`, then `check`).
        config.check_shape()?;
        Ok(config)
    }

    /// The same etcd reached over TLS: `http://` endpoints (and those given as `host:port`)
    /// become `https://`.
    pub fn with_tls(mut self, tls: EtcdTls) -> Self {
        for e in &mut self.endpoints {
            if let Some(rest) = e.strip_prefix("http://") {
                *e = format!("https://{rest}");
            }
        }
        self.tls = Some(tls);
        self
    }

    /// Refuses an empty endpoint list, a prefix not starting with `/`, a TTL under 1 s, or
    /// an endpoint whose scheme does not match the TLS setting.
    pub fn check(&self) -> Result<()> {
        self.check_shape()?;
        let want = if self.tls.is_some() {
            "https://"
        } else {
            "http://"
        };
        if let Some(e) = self.endpoints.iter().find(|e| !e.starts_with(want)) {
            return Err(Error::Config(if self.tls.is_some() {
                format!(
                    "etcd endpoint `{e}`: etcd is reached over TLS (a CA is given): use https://"
                )
            } else {
                format!(
                    "etcd endpoint `{e}`: an https:// endpoint needs the CA of etcd's certificate"
                )
            }));
        }
        Ok(())
    }

    /// [`EtcdConfig::check`] but for the endpoints' schemes.
    fn check_shape(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::Config("etcd: no endpoints given".into()));
        }
        if !self.prefix.starts_with('/') {
            return Err(Error::Config(format!(
                "etcd prefix `{}` must start with /",
                self.prefix
            )));
        }
        if self.ttl < Duration::from_secs(1) {
            return Err(Error::Config(format!(
                "etcd lease TTL {:?} is under the 1 s etcd grants",
                self.ttl
            )));
        }
        Ok(())
    }

    fn shown(&self) -> String {
        self.endpoints.join(",")
    }

    fn err(&self, source: etcd_client::Error) -> Error {
        Error::Etcd {
            endpoints: self.shown(),
            source,
        }
    }

    async fn connect(&self) -> Result<Client> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls.options()?);
        }
        Client::connect(&self.endpoints, Some(options))
            .await
            .map_err(|e| self.err(e))
    }
}

/// Waits between reconnection attempts: 100 ms doubling to 5 s.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Self(Duration::from_millis(100))
    }
    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Duration::from_secs(5));
    }
    fn reset(&mut self) {
        self.0 = Duration::from_millis(100);
    }
}

/// The worker set under an etcd prefix, kept current by a background task: list, watch from
/// the listed revision, list again when the watch ends or errs. While etcd is unreachable the
/// last set stays (workers keep serving what they serve).
#[derive(Debug)]
pub struct EtcdDiscovery {
    tx: watch::Sender<WorkerSet>,
    task: tokio::task::JoinHandle<()>,
}

impl EtcdDiscovery {
    /// Starts watching (on the current tokio runtime). Never fails on an unreachable etcd: it
    /// logs and retries, so a router may start before its etcd.
    pub fn start(config: EtcdConfig) -> Result<Self> {
        config.check()?;
        let tx = watch::Sender::new(WorkerSet::default());
        let task = tokio::spawn(watch_loop(config, tx.clone()));
        Ok(Self { tx, task })
    }
}

impl Drop for EtcdDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Discovery for EtcdDiscovery {
    fn subscribe(&self) -> watch::Receiver<WorkerSet> {
        self.tx.subscribe()
    }
}

async fn watch_loop(config: EtcdConfig, tx: watch::Sender<WorkerSet>) {
    let mut backoff = Backoff::new();
    loop {
        match list_and_watch(&config, &tx, &mut backoff).await {
            Ok(why) => tracing::info!(reason = why, "etcd watch ended; listing again"),
            Err(e) => {
                tracing::warn!(error = %e, "etcd watch failed; retrying");
                backoff.wait().await;
            }
        }
    }
}

/// The id of a worker key (`PREFIX/workers/ID` → `ID`).
fn id_of(key: &[u8], prefix: &str) -> Option<String> {
    std::str::from_utf8(key)
        .ok()?
        .strip_prefix(prefix)
        .filter(|id| !id.is_empty())
        .map(str::to_string)
}

fn parse(value: &[u8], id: &str) -> Option<WorkerRecord> {
    match serde_json::from_slice::<WorkerRecord>(value) {
        Ok(r) if r.id == id => Some(r),
        Ok(r) => {
            tracing::warn!(key_id = id, record_id = %r.id, "worker record under another id's key ignored");
            None
        }
        Err(e) => {
            tracing::warn!(id, error = %e, "unreadable worker record ignored");
            None
        }
    }
}

/// One list + watch; `Ok` with the reason when the watch ended in a way that calls for a
/// fresh list (cancelled, compacted, closed).
async fn list_and_watch(
    config: &EtcdConfig,
    tx: &watch::Sender<WorkerSet>,
    backoff: &mut Backoff,
) -> Result<&'static str> {
    let mut client = config.connect().await?;
    let prefix = workers_prefix(&config.prefix);
    let listed = client
        .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| config.err(e))?;
    let mut set = WorkerSet {
        workers: listed
            .kvs()
            .iter()
            .filter_map(|kv| {
                let id = id_of(kv.key(), &prefix)?;
                Some((id.clone(), parse(kv.value(), &id)?))
            })
            .collect(),
        revision: listed.header().map_or(0, |h| h.revision()),
    };
    tracing::info!(
        workers = set.workers.len(),
        revision = set.revision,
        "etcd worker set listed"
    );
    tx.send_replace(set.clone());
    backoff.reset();
    let mut stream = client
        .watch(
            prefix.clone(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(set.revision + 1),
            ),
        )
        .await
        .map_err(|e| config.err(e))?;
    while let Some(msg) = stream.message().await.map_err(|e| config.err(e))? {
        if msg.compact_revision() > 0 {
            return Ok("revision compacted");
        }
        if msg.canceled() {
            return Ok("watch cancelled");
        }
        let mut changed = false;
        for ev in msg.events() {
            let Some(kv) = ev.kv() else { continue };
            let Some(id) = id_of(kv.key(), &prefix) else {
                continue;
            };
            match ev.event_type() {
                EventType::Put => {
                    if let Some(r) = parse(kv.value(), &id) {
                        tracing::info!(id, role = r.role.as_str(), address = %r.address,
                            state = ?r.state, "worker registered");
                        set.workers.insert(id, r);
                        changed = true;
                    }
                }
                EventType::Delete => {
                    if set.workers.remove(&id).is_some() {
                        tracing::info!(id, "worker deregistered");
                        changed = true;
                    }
                }
            }
        }
        if let Some(h) = msg.header() {
            set.revision = h.revision();
        }
        if changed {
            tx.send_replace(set.clone());
        }
    }
    Ok("watch stream closed")
}

enum Command {
    SetState(WorkerState),
    Deregister(oneshot::Sender<()>),
}

/// A worker's record in etcd under a lease kept alive by a background task. When the lease
/// is lost (no successful keep-alive for a TTL), [`Registration::registered`] turns false and
/// the task registers again under a new lease as soon as etcd answers.
#[derive(Debug)]
pub struct Registration {
    commands: mpsc::UnboundedSender<Command>,
    registered: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Registers `record` (the first attempt waits, so a wrong endpoint fails the worker's
    /// start with the reason) and keeps it registered.
    pub async fn start(config: EtcdConfig, record: WorkerRecord) -> Result<Self> {
        config.check()?;
        let mut client = config.connect().await?;
        let lease = register(&mut client, &config, &record).await?;
        tracing::info!(id = %record.id, key = %worker_key(&config.prefix, &record.id),
            ttl = ?config.ttl, "registered in etcd");
        let (commands, rx) = mpsc::unbounded_channel();
        let (up, registered) = watch::channel(true);
        let task = tokio::spawn(keep_registered(config, record, client, lease, rx, up));
        Ok(Self {
            commands,
            registered,
            task,
        })
    }

    /// True while the record is in etcd under a live lease.
    pub fn registered(&self) -> watch::Receiver<bool> {
        self.registered.clone()
    }

    /// Re-announces the record with `state` (e.g. draining).
    pub fn set_state(&self, state: WorkerState) {
        let _ = self.commands.send(Command::SetState(state));
    }

    /// Revokes the lease (the record disappears at once) and stops the keep-alive.
    pub async fn deregister(self) {
        let (done, wait) = oneshot::channel();
        if self.commands.send(Command::Deregister(done)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), wait).await;
        }
        self.task.abort();
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn register(client: &mut Client, config: &EtcdConfig, record: &WorkerRecord) -> Result<i64> {
    let ttl = config.ttl.as_secs().max(1) as i64;
    let lease = client
        .lease_grant(ttl, None)
        .await
        .map_err(|e| config.err(e))?
        .id();
    put(client, config, record, lease).await?;
    Ok(lease)
}

async fn put(
    client: &mut Client,
    config: &EtcdConfig,
    record: &WorkerRecord,
    lease: i64,
) -> Result<()> {
    let value = serde_json::to_vec(record).map_err(|e| Error::Config(format!("record: {e}")))?;
    client
        .put(
            worker_key(&config.prefix, &record.id),
            value,
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .map_err(|e| config.err(e))?;
    Ok(())
}

/// One keep-alive round trip; `Ok(false)` when etcd says the lease is gone.
async fn keep_alive(client: &mut Client, config: &EtcdConfig, lease: i64) -> Result<bool> {
    let (mut keeper, mut stream) = client
        .lease_keep_alive(lease)
        .await
        .map_err(|e| config.err(e))?;
    keeper.keep_alive().await.map_err(|e| config.err(e))?;
    match stream.message().await.map_err(|e| config.err(e))? {
        Some(r) => Ok(r.ttl() > 0),
        None => Ok(false),
    }
}

async fn keep_registered(
    config: EtcdConfig,
    mut record: WorkerRecord,
    mut client: Client,
    lease: i64,
    mut commands: mpsc::UnboundedReceiver<Command>,
    up: watch::Sender<bool>,
) {
    let mut lease = Some(lease);
    let mut last_ok = Instant::now();
    let mut tick = tokio::time::interval((config.ttl / 3).max(Duration::from_millis(300)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            cmd = commands.recv() => match cmd {
                Some(Command::SetState(state)) => {
                    record.state = state;
                    if let Some(l) = lease {
                        if let Err(e) = put(&mut client, &config, &record, l).await {
                            tracing::warn!(error = %e, "could not update the worker record; retrying with the keep-alive");
                        }
                    }
                    continue;
                }
                Some(Command::Deregister(done)) => {
                    if let Some(l) = lease {
                        if let Err(e) = client.lease_revoke(l).await {
                            tracing::warn!(error = %e, "lease revoke failed; the record expires with its TTL");
                        }
                    }
                    up.send_replace(false);
                    let _ = done.send(());
                    return;
                }
                None => return,
            },
        }
        match lease {
            Some(l) => match keep_alive(&mut client, &config, l).await {
                Ok(true) => last_ok = Instant::now(),
                Ok(false) => {
                    tracing::warn!(id = %record.id, "etcd lease expired: not taking work until registered again");
                    lease = None;
                    up.send_replace(false);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd keep-alive failed");
                    if last_ok.elapsed() >= config.ttl {
                        tracing::warn!(id = %record.id, "no keep-alive for a whole TTL: the lease is gone; not taking work until registered again");
                        lease = None;
                        up.send_replace(false);
                    }
                    if let Ok(c) = config.connect().await {
                        client = c;
                    }
                }
            },
            None => match register(&mut client, &config, &record).await {
                Ok(l) => {
                    tracing::info!(id = %record.id, "registered in etcd again");
                    lease = Some(l);
                    last_ok = Instant::now();
                    up.send_replace(true);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd registration failed; retrying");
                    if let Ok(c) = config.connect().await {
                        client = c;
                    }
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_endpoints() {
        let c =
            EtcdConfig::from_url("etcd://a:1, b:2", "/t", Duration::from_secs(10)).expect("valid");
        assert_eq!(c.endpoints, ["http://a:1", "http://b:2"]);
        let c = EtcdConfig::from_url("http://a:1", "/t", Duration::from_secs(10)).expect("valid");
        assert_eq!(c.endpoints, ["http://a:1"]);
        let tls = EtcdTls {
            ca: "ca.crt".into(),
            identity: None,
        };
        let c = EtcdConfig::from_url("etcd://a:1,http://b:2", "/t", Duration::from_secs(10))
            .expect("valid")
            .with_tls(tls);
        assert_eq!(c.endpoints, ["https://a:1", "https://b:2"]);
        c.check().expect("https with a CA");
        let https = EtcdConfig::from_url("https://a:1", "/t", Duration::from_secs(10))
            .expect("TLS may follow")
            .check()
            .expect_err("https without a CA");
        assert!(https.to_string().contains("needs the CA"), "{https}");
        for (url, prefix, ttl) in [
            ("etcd://", "/t", 10),
            ("etcd://a:1", "t", 10),
            ("etcd://a:1", "/t", 0),
        ] {
            let e =
                EtcdConfig::from_url(url, prefix, Duration::from_secs(ttl)).expect_err("invalid");
            assert!(matches!(e, Error::Config(_)), "{e}");
        }
    }

    #[test]
    fn ids_come_from_keys_under_the_prefix_only() {
        assert_eq!(
            id_of(b"/t/workers/p0", "/t/workers/").as_deref(),
            Some("p0")
        );
        assert_eq!(id_of(b"/t/workers/", "/t/workers/"), None);
        assert_eq!(id_of(b"/other/p0", "/t/workers/"), None);
    }
}
