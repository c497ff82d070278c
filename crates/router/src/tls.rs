//! TLS on both of the router's sides: HTTPS on its front ([`HttpsListener`]) and mutual TLS
//! to its workers ([`WorkerTlsConfig::client_config`]).
//!
//! The front's certificate and key are read again whenever either file changes, as the API key
//! file is: each handshake looks at the files' metadata (two `stat` calls) and reloads when it
//! differs from the last look, so a certificate rotated by cert-manager or a cron job is served
//! to the next connection without a restart. A pair that does not load (a half-written file,
//! a key that does not match the certificate) leaves the last good pair in service, and the
//! next change is tried again. Handshakes run on tasks of their own, so a client that stalls
//! mid-handshake holds up nobody else.
//!
//! Everything uses rustls with the ring provider, named explicitly rather than taken from a
//! process-wide default.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// The longest a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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

/// What failed setting TLS up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM.
    #[error("{path}: {source}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A certificate file holds no certificate.
    #[error("{0}: no certificate in the file")]
    NoCertificate(PathBuf),
    /// rustls refused the material (a key that does not match the certificate, a bad CA).
    #[error("{what}: {source}")]
    Rustls {
        /// What was being set up.
        what: String,
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// The client CA list could not make a verifier.
    #[error("tls.client_ca: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// ring, as tonic's `tls-ring` uses for the gRPC side. rustls 0.23.48 deprecates ring's
/// provider for lacking post-quantum key exchange; moving both sides to aws-lc-rs (a large C
/// build) is a separate decision.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|source| TlsError::Pem {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_owned()));
    }
    Ok(certs)
}

/// The certificate chain of `cert` with the key of `key`, checked to belong together.
fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = read_certs(cert)?;
    let der = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Pem {
        path: key.to_owned(),
        source,
    })?;
    let pair =
        CertifiedKey::from_der(chain, der, &provider()).map_err(|source| TlsError::Rustls {
            what: format!("{} with {}", cert.display(), key.display()),
            source,
        })?;
    Ok(Arc::new(pair))
}

/// What identifies a file's version: its modification time, length and inode (a Secret
/// volume swaps files by renaming a directory).
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let ino = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let ino = 0;
    Some((m.modified().ok()?, m.len(), ino))
}

#[derive(Debug)]
struct Loaded {
    /// (certificate, key) stamps when last looked at.
    seen: (Stamp, Stamp),
    pair: Arc<CertifiedKey>,
}

/// The front's certificate, read again from its files whenever they change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    loaded: Mutex<Loaded>,
}

impl ReloadingCert {
    /// Loads `cert` and `key`; fails when they do not load (a router configured for HTTPS
    /// must not start without a certificate).
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let seen = (stamp(cert), stamp(key));
        let pair = load_pair(cert, key)?;
        Ok(Self {
            cert: cert.to_owned(),
            key: key.to_owned(),
            loaded: Mutex::new(Loaded { seen, pair }),
        })
    }

    /// The pair to serve now, reloaded first if either file changed since the last look.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let mut l = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let now = (stamp(&self.cert), stamp(&self.key));
        if now != l.seen {
            // Looked at once per change: a broken pair warns once, not at every handshake.
            l.seen = now;
            match load_pair(&self.cert, &self.key) {
                Ok(pair) => {
                    l.pair = pair;
                    tracing::info!(cert = %self.cert.display(), "HTTPS certificate reloaded");
                }
                Err(e) => tracing::warn!(error = %e,
                    "HTTPS certificate files changed but do not load: serving the previous pair"),
            }
        }
        l.pair.clone()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl HttpsConfig {
    /// The rustls server configuration: the reloading certificate, client certificates
    /// required when `client_ca` is set, HTTP/2 and HTTP/1.1 offered.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, TlsError> {
        let cert = Arc::new(ReloadingCert::load(&self.cert, &self.key)?);
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                what: "TLS versions".into(),
                source,
            })?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in read_certs(path)? {
                    roots.add(c).map_err(|source| TlsError::Rustls {
                        what: format!("{}", path.display()),
                        source,
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(cert);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
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
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let (tx, ready) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = tokio::select! {
                    () = tx.closed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of file descriptors and the like: back off a moment.
                            tracing::warn!(error = %e, "accepting a connection");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
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

    /// A CA and a leaf it signed for `localhost`, written as PEM files in `dir`: (ca, cert,
    /// key) paths.
    pub(crate) fn issue(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).expect("CA");
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().expect("key");
        let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("leaf");
        let paths = (
            dir.join(format!("{name}-ca.crt")),
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&paths.0, ca_cert.pem()).expect("write");
        std::fs::write(&paths.1, leaf.pem()).expect("write");
        std::fs::write(&paths.2, key.serialize_pem()).expect("write");
        paths
    }

    #[test]
    fn the_pair_is_reloaded_when_its_files_change_and_a_broken_one_keeps_the_last() {
        let dir = tempfile::tempdir().expect("tmp");
        let (_, cert, key) = issue(dir.path(), "a");
        let (_, cert_b, key_b) = issue(dir.path(), "b");
        let served = ReloadingCert::load(&cert, &key).expect("loads");
        let first = served.current().cert[0].clone();
        assert_eq!(
            served.current().cert[0],
            first,
            "unchanged files: same pair"
        );

        // Half a rotation: the new certificate beside the old key does not load.
        std::fs::copy(&cert_b, &cert).expect("copy");
        assert_eq!(served.current().cert[0], first, "the last good pair stays");
        std::fs::copy(&key_b, &key).expect("copy");
        let second = served.current().cert[0].clone();
        assert_ne!(
            second, first,
            "the new pair is served once both files are in"
        );
        assert_eq!(second, read_certs(&cert_b).expect("pem")[0]);

        std::fs::write(&cert, "not a certificate").expect("write");
        assert_eq!(served.current().cert[0], second);
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
