//! TLS on both of the router's sides: HTTPS on its front ([`HttpsListener`]) and mutual TLS
//! to its workers ([`WorkerTlsConfig::client_config`], dialled by [`WorkerTls`]).
//!
//! The front's certificate and key, and the router's own certificate for its workers, are read
//! again whenever either file changes, as the API key file is ([`tandem_tls::ReloadingCert`]),
//! so a certificate rotated by cert-manager or a cron job is used from the next connection on
//! without a restart; a pair that does not load leaves the last good pair in service. Handshakes run on tasks of their own, so a client that stalls
//! mid-handshake holds up nobody else.

use serde::{Deserialize, Serialize};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
pub use tandem_tls::{ReloadingCert, TlsError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tonic::codegen::http::Uri;

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
    /// How to dial workers: the CA to trust (read now), the router's identity to present (read
    /// again when its files change), HTTP/2 by ALPN.
    pub fn client_config(&self) -> Result<WorkerTls, TlsError> {
        let cert = ReloadingCert::load("worker_tls client", &self.cert, &self.key)?;
        let config = tandem_tls::client_config(&self.ca, cert, &[b"h2"])?;
        Ok(WorkerTls {
            config: Arc::new(config),
            server_name: self.server_name.clone(),
        })
    }

    pub(crate) fn check(&self, problems: &mut Vec<String>) {
        if let Err(e) = self.client_config() {
            problems.push(format!("worker_tls: {e}"));
        }
    }
}

/// The router's side of mutual TLS to its workers: a connector (TCP, then the TLS handshake
/// with the router's current certificate) that a worker's gRPC channel dials through, each
/// new connection with whatever certificate the files hold then.
#[derive(Clone)]
pub struct WorkerTls {
    config: Arc<rustls::ClientConfig>,
    /// The name workers' certificates are checked against, when not their address's host.
    server_name: Option<String>,
}

impl std::fmt::Debug for WorkerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// A TLS connection to a worker, as the gRPC channel reads and writes it.
pub type WorkerTlsStream = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;

impl WorkerTls {
    /// Connects to `host:port` and handshakes, checking the worker's certificate against
    /// `server_name` (or `host`).
    pub async fn connect(&self, host: &str, port: u16) -> std::io::Result<WorkerTlsStream> {
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        // `[::1]` in a URI is `::1` to connect to and to name.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = self.server_name.clone().unwrap_or_else(|| host.to_owned());
        let name = rustls::pki_types::ServerName::try_from(name)
            .map_err(|e| invalid(format!("worker name: {e}")))?;
        let tcp = TcpStream::connect((host, port)).await?;
        tcp.set_nodelay(true)?;
        let tls = tokio_rustls::TlsConnector::from(self.config.clone())
            .connect(name, tcp)
            .await?;
        Ok(hyper_util::rt::TokioIo::new(tls))
    }
}

impl tonic::codegen::Service<Uri> for WorkerTls {
    type Response = WorkerTlsStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<WorkerTlsStream>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.clone();
        Box::pin(async move {
            let host = uri.host().unwrap_or_default().to_owned();
            tls.connect(&host, uri.port_u16().unwrap_or(443)).await
        })
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
    use std::path::Path;

    pub(crate) use tandem_tls::testing::issue;

    /// A real handshake each time: a worker-side listener that requires client certificates
    /// records the leaf the router presents; rewriting the router's files changes it for the
    /// next connection, with the same `WorkerTls`.
    #[tokio::test]
    async fn the_router_presents_its_rewritten_certificate_on_the_next_connection() {
        let dir = tempfile::tempdir().expect("tmp");
        let (worker_ca, worker_cert, worker_key) = issue(dir.path(), "worker");
        let (ca_a, cert, key) = issue(dir.path(), "router");
        let (ca_b, cert_b, key_b) = issue(dir.path(), "router-next");
        // The worker trusts both router CAs (a CA rotation's overlap).
        let both = dir.path().join("router-cas.crt");
        let pem = |p: &Path| std::fs::read_to_string(p).expect("read");
        std::fs::write(&both, pem(&ca_a) + &pem(&ca_b)).expect("write");
        let served = ReloadingCert::load("worker", &worker_cert, &worker_key).expect("pair");
        let config = tandem_tls::server_config(served, Some(&both), &[b"h2"]).expect("config");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let mut accepted = tandem_tls::accept(listener, config);
        let router = WorkerTlsConfig {
            ca: worker_ca,
            cert: cert.clone(),
            key: key.clone(),
            server_name: Some("localhost".into()),
        }
        .client_config()
        .expect("client config");
        async fn presented(
            router: &WorkerTls,
            port: u16,
            accepted: &mut mpsc::Receiver<(TlsStream<TcpStream>, std::net::SocketAddr)>,
        ) -> rustls::pki_types::CertificateDer<'static> {
            let _client = router.connect("127.0.0.1", port).await.expect("handshake");
            let (stream, _) = accepted.recv().await.expect("accepted");
            stream
                .get_ref()
                .1
                .peer_certificates()
                .expect("a client certificate")[0]
                .clone()
        }
        let first = presented(&router, port, &mut accepted).await;
        assert_eq!(first, tandem_tls::read_certs(&cert).expect("pem")[0]);
        std::fs::copy(&cert_b, &cert).expect("copy");
        std::fs::copy(&key_b, &key).expect("copy");
        let second = presented(&router, port, &mut accepted).await;
        assert_eq!(second, tandem_tls::read_certs(&cert_b).expect("pem")[0]);
    }

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
