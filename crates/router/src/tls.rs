//! TLS on both of the router's sides: HTTPS on its front ([`HttpsListener`]) and mutual TLS
//! to its workers ([`WorkerTlsConfig::client_config`]).
//!
//! The front's certificate and key are read again whenever either file changes, as the API key
//! file is ([`tandem_tls::ReloadingCert`]), so a certificate rotated by cert-manager or a cron
//! job is served to the next connection without a restart; a pair that does not load leaves
//! the last good pair in service. Handshakes run on tasks of their own, so a client that stalls
//! mid-handshake holds up nobody else.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tandem_tls::{load_pair, read_certs};
pub use tandem_tls::{ReloadingCert, TlsError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

/// The router config's `tls` section: HTTPS on `listen`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HttpsConfig {
    /// PEM certificate chain, leaf first (cert-manager's `tls.crt`); read again when it
    /// changes.
    pub cert: PathBuf,
    /// PEM private key of the leaf (PKCS#8, PKCS#1 or SEC1; cert-manager's `tls.key`); read
    /// again when it changes.
    pub key: PathBuf,
    /// PEM CA certificates: when set, every client must present a certificate they issued
    /// (read once, at start-up).
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

/// The router config's `worker_tls` section: mutual TLS on the gRPC connections to workers
/// (whose addresses are then `https://`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerTlsConfig {
    /// PEM CA certificates the workers' certificates must chain to.
    pub ca: PathBuf,
    /// The router's own certificate (naming the role `spiffe://…/router`), PEM.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
    /// The name workers' certificates are checked against, when it is not the host of their
    /// address (e.g. every worker shares a certificate for `tandem-worker` and is reached by
    /// pod IP).
    #[serde(default)]
    pub server_name: Option<String>,
}

impl HttpsConfig {
    /// The rustls server configuration: the reloading certificate, client certificates
    /// required when `client_ca` is set, HTTP/2 and HTTP/1.1 offered.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, TlsError> {
        let cert = ReloadingCert::load("HTTPS", &self.cert, &self.key)?;
        tandem_tls::server_config(cert, self.client_ca.as_deref(), &[b"h2", b"http/1.1"])
    }

    /// Checks that the files load (for config validation), reporting a problem in words.
    pub(crate) fn check(&self, problems: &mut Vec<String>) {
        if let Err(e) = self.server_config() {
            problems.push(format!("tls: {e}"));
        }
    }
}

impl WorkerTlsConfig {
    /// tonic's client TLS settings: the CA to trust, the router's identity to present.
    pub fn client_config(&self) -> Result<tonic::transport::ClientTlsConfig, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Io {
                path: path.to_owned(),
                source,
            })
        };
        // Parsed here too, so a bad file is named at start-up rather than at the first call.
        read_certs(&self.ca)?;
        load_pair(&self.cert, &self.key)?;
        let identity = tonic::transport::Identity::from_pem(read(&self.cert)?, read(&self.key)?);
        let mut config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read(&self.ca)?))
            .identity(identity);
        if let Some(name) = &self.server_name {
            config = config.domain_name(name.clone());
        }
        Ok(config)
    }

    pub(crate) fn check(&self, problems: &mut Vec<String>) {
        if let Err(e) = self.client_config() {
            problems.push(format!("worker_tls: {e}"));
        }
    }
}

/// A TCP listener that hands axum TLS streams: connections are accepted and their
/// handshakes run on tasks of their own; failed handshakes are logged and dropped.
pub struct HttpsListener {
    local: std::net::SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, std::net::SocketAddr)>,
}

impl std::fmt::Debug for HttpsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl HttpsListener {
    /// Serves TLS with `config` on `listener` (its accept loop runs until the returned
    /// listener is dropped).
    pub fn new(listener: TcpListener, config: rustls::ServerConfig) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let ready = tandem_tls::accept(listener, config);
        Ok(Self { local, ready })
    }
}

impl axum::serve::Listener for HttpsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop ended (it cannot while this listener lives): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) use tandem_tls::testing::issue;

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let (ca, cert, key) = issue(dir.path(), "a");
        let (_, _, other_key) = issue(dir.path(), "b");
        let https = |cert: &Path, key: &Path, client_ca: Option<&Path>| HttpsConfig {
            cert: cert.to_owned(),
            key: key.to_owned(),
            client_ca: client_ca.map(Path::to_owned),
        };
        assert!(https(&cert, &key, Some(&ca)).server_config().is_ok());
        let missing = dir.path().join("missing.crt");
        let e = https(&missing, &key, None)
            .server_config()
            .expect_err("missing");
        assert!(e.to_string().contains("missing.crt"), "{e}");
        let e = https(&cert, &other_key, None)
            .server_config()
            .expect_err("mismatch");
        assert!(e.to_string().contains("b.key"), "{e}");
        let e = https(&cert, &key, Some(&key))
            .server_config()
            .expect_err("a key is no CA");
        assert!(e.to_string().contains("a.key"), "{e}");
        let workers = WorkerTlsConfig {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
            server_name: None,
        };
        assert!(workers.client_config().is_ok());
        let e = WorkerTlsConfig {
            key: other_key,
            ..workers
        }
        .client_config()
        .expect_err("mismatch");
        assert!(e.to_string().contains("b.key"), "{e}");
    }
}
