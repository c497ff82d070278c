//! TLS as the router's HTTPS front and the workers' gRPC port serve it, and as the router
//! dials its workers: a certificate and key read again whenever either file changes
//! ([`ReloadingCert`], served by a server or presented by a client), a server configuration
//! over it with or without client certificates ([`server_config`]), a client configuration
//! presenting it ([`client_config`]), and an accept loop that runs every handshake on a task
//! of its own ([`accept`]).
//!
//! A reloading pair looks at its files' metadata (two `stat` calls) at each handshake and
//! reloads when it differs from the last look, so a certificate rotated by cert-manager or a
//! cron job is served to the next connection without a restart. A pair that does not load (a
//! half-written file, a key that does not match the certificate) leaves the last good pair in
//! service, and the next change is tried again.
//!
//! Everything uses rustls with the ring provider, named explicitly rather than taken from a
//! process-wide default.

use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// The longest a client may take over its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
    #[error("client CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// ring, as tonic's `tls-ring` uses for the gRPC side. rustls 0.23.48 deprecates ring's
/// provider for lacking post-quantum key exchange; moving both sides to aws-lc-rs (a large C
/// build) is a separate decision.
#[allow(deprecated)]
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate of a PEM file, in order; fails when there is none.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
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
pub fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
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

/// A server's certificate, read again from its files whenever they change.
#[derive(Debug)]
pub struct ReloadingCert {
    /// What it serves, for the logs ("HTTPS", "gRPC").
    what: &'static str,
    cert: PathBuf,
    key: PathBuf,
    loaded: Mutex<Loaded>,
}

impl ReloadingCert {
    /// Loads `cert` and `key` for `what` (named in the logs); fails when they do not load (a
    /// server configured for TLS must not start without a certificate).
    pub fn load(what: &'static str, cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let seen = (stamp(cert), stamp(key));
        let pair = load_pair(cert, key)?;
        Ok(Self {
            what,
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
                    tracing::info!(cert = %self.cert.display(), "{} certificate reloaded", self.what);
                }
                Err(e) => tracing::warn!(error = %e,
                    "{} certificate files changed but do not load: serving the previous pair",
                    self.what),
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

impl ResolvesClientCert for ReloadingCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The CA certificates of the PEM file `path`, as trust roots.
fn roots(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(path)? {
        roots.add(c).map_err(|source| TlsError::Rustls {
            what: format!("{}", path.display()),
            source,
        })?;
    }
    Ok(roots)
}

/// A rustls client configuration trusting the CAs of `ca` (read once, here) and presenting
/// `cert` (reloaded when its files change) to servers that ask for a client certificate.
/// `alpn`: the protocols offered.
pub fn client_config(
    ca: &Path,
    cert: ReloadingCert,
    alpn: &[&[u8]],
) -> Result<rustls::ClientConfig, TlsError> {
    let roots = roots(ca)?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "TLS versions".into(),
            source,
        })?
        .with_root_certificates(roots)
        .with_client_cert_resolver(Arc::new(cert));
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A rustls server configuration serving `cert`; with `client_ca`, every client must present
/// a certificate it issued (the CA file is read once, here). `alpn`: the protocols offered.
pub fn server_config(
    cert: ReloadingCert,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<rustls::ServerConfig, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "TLS versions".into(),
            source,
        })?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(path)?), provider())
                    .build()?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(cert));
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// Accepts connections on `listener` and runs each one's handshake (under `config`) on a task
/// of its own, so a client that stalls mid-handshake holds up nobody else: finished
/// handshakes come out of the returned channel; failed ones are logged and dropped. The loop
/// ends when the receiver is dropped.
pub fn accept(
    listener: TcpListener,
    config: rustls::ServerConfig,
) -> mpsc::Receiver<(TlsStream<TcpStream>, std::net::SocketAddr)> {
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
    ready
}

/// Test certificates (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use std::path::{Path, PathBuf};

    /// A CA and a leaf it signed for `localhost`, written as PEM files in `dir`: (ca, cert,
    /// key) paths.
    #[allow(clippy::expect_used)]
    pub fn issue(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
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
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;
    use testing::issue;

    #[test]
    fn the_pair_is_reloaded_when_its_files_change_and_a_broken_one_keeps_the_last() {
        let dir = tempfile::tempdir().expect("tmp");
        let (_, cert, key) = issue(dir.path(), "a");
        let (_, cert_b, key_b) = issue(dir.path(), "b");
        let served = ReloadingCert::load("test", &cert, &key).expect("loads");
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
        let config = |cert: &Path, key: &Path, client_ca: Option<&Path>| {
            server_config(ReloadingCert::load("test", cert, key)?, client_ca, &[])
        };
        assert!(config(&cert, &key, Some(&ca)).is_ok());
        let missing = dir.path().join("missing.crt");
        let e = config(&missing, &key, None).expect_err("missing");
        assert!(e.to_string().contains("missing.crt"), "{e}");
        let e = config(&cert, &other_key, None).expect_err("mismatch");
        assert!(e.to_string().contains("b.key"), "{e}");
        let e = config(&cert, &key, Some(&key)).expect_err("a key is no CA");
        assert!(e.to_string().contains("a.key"), "{e}");
    }
}
