//! Mutual TLS on the worker's gRPC port, and which caller may make which call.
//!
//! With TLS on, the handshake itself refuses a peer without a certificate from the configured
//! CA, before any request is read. The worker's own certificate and key are read again when
//! their files change ([`tandem_tls::ReloadingCert`]): a rotated certificate is served to the
//! next connection without a restart (the client CA is read once, at start-up). A valid certificate is not enough, though: it must also
//! name a role (a URI SAN `spiffe://…/ROLE`, see [`tandem_core::identity`]) that the call
//! allows. Serving calls (prefill, decode, generate) take the router only; draining and
//! reloading weights take an operator's admin certificate only; stats take both. So a worker's
//! own certificate, or an admin's, cannot be used to run prompts or write into a worker's KV
//! pool.

use std::path::PathBuf;
use tandem_core::PeerRole;

/// Where a worker's TLS material lives (PEM files; cert-manager's `tls.crt`, `tls.key`,
/// `ca.crt`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcTls {
    /// The worker's certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// CA certificates a caller's certificate must chain to.
    pub client_ca: PathBuf,
}

impl GrpcTls {
    /// The server's TLS settings: this worker's identity (reloaded when its files change),
    /// client certificates from `client_ca` required, HTTP/2 offered.
    pub fn server_config(&self) -> crate::Result<rustls::ServerConfig> {
        let cert = tandem_tls::ReloadingCert::load("gRPC", &self.cert, &self.key)?;
        Ok(tandem_tls::server_config(
            cert,
            Some(&self.client_ca),
            &[b"h2"],
        )?)
    }
}

/// The worker's RPCs, as far as who may call them goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rpc {
    /// `Prefill`.
    Prefill,
    /// `Decode`.
    Decode,
    /// `Generate`.
    Generate,
    /// `Stats`.
    Stats,
    /// `RefreshWeights`.
    RefreshWeights,
    /// `Drain`.
    Drain,
}

impl Rpc {
    /// The roles whose certificates may make this call.
    pub fn allowed(self) -> &'static [PeerRole] {
        match self {
            Rpc::Prefill | Rpc::Decode | Rpc::Generate => &[PeerRole::Router],
            Rpc::Stats => &[PeerRole::Router, PeerRole::Admin],
            Rpc::RefreshWeights | Rpc::Drain => &[PeerRole::Admin],
        }
    }
}

/// The role named by the leaf certificate (DER) a peer presented: its first
/// `spiffe://…/ROLE` URI SAN. `None` when it names none (or does not parse).
pub fn peer_role(leaf: &[u8]) -> Option<PeerRole> {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|name| match name {
        x509_parser::extensions::GeneralName::URI(uri) => PeerRole::from_spiffe_uri(uri),
        _ => None,
    })
}

/// Whether the peer whose certificate chain is `certs` (leaf first; `None` when it presented
/// none) may make `rpc`; the refusal says why, for the caller's log.
pub fn authorize(rpc: Rpc, certs: Option<&[impl AsRef<[u8]>]>) -> Result<PeerRole, tonic::Status> {
    let leaf = certs
        .and_then(|c| c.first())
        .ok_or_else(|| tonic::Status::unauthenticated("no client certificate"))?;
    let role = peer_role(leaf.as_ref()).ok_or_else(|| {
        tonic::Status::permission_denied(
            "the client certificate names no role (a URI SAN spiffe://TRUST_DOMAIN/ROLE)",
        )
    })?;
    if rpc.allowed().contains(&role) {
        Ok(role)
    } else {
        let allowed: Vec<&str> = rpc.allowed().iter().map(|r| r.as_str()).collect();
        Err(tonic::Status::permission_denied(format!(
            "a {role} certificate may not call {rpc:?} (allowed: {})",
            allowed.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;

    /// A self-signed certificate whose URI SANs are `uris` (DER).
    fn cert_with(uris: &[&str]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        for uri in uris {
            params.subject_alt_names.push(rcgen::SanType::URI(
                (*uri).try_into().expect("an IA5 string"),
            ));
        }
        params.self_signed(&key).expect("cert").der().to_vec()
    }

    #[test]
    fn the_role_comes_from_the_spiffe_uri() {
        assert_eq!(
            peer_role(&cert_with(&["spiffe://tandem/router"])),
            Some(PeerRole::Router)
        );
        assert_eq!(
            peer_role(&cert_with(&["https://example.com", "spiffe://prod/admin"])),
            Some(PeerRole::Admin)
        );
        assert_eq!(peer_role(&cert_with(&[])), None);
        assert_eq!(peer_role(&cert_with(&["spiffe://tandem/root"])), None);
        assert_eq!(peer_role(b"not DER"), None);
    }

    #[test]
    fn each_call_takes_only_its_roles() {
        let router = [cert_with(&["spiffe://tandem/router"])];
        let admin = [cert_with(&["spiffe://tandem/admin"])];
        let decode = [cert_with(&["spiffe://tandem/decode"])];
        let nobody = [cert_with(&[])];
        for rpc in [Rpc::Prefill, Rpc::Decode, Rpc::Generate] {
            assert_eq!(
                authorize(rpc, Some(&router[..])).ok(),
                Some(PeerRole::Router)
            );
            for other in [&admin, &decode, &nobody] {
                let e = authorize(rpc, Some(&other[..])).expect_err("refused");
                assert_eq!(e.code(), tonic::Code::PermissionDenied, "{rpc:?}");
            }
        }
        assert!(authorize(Rpc::Stats, Some(&router[..])).is_ok());
        assert!(authorize(Rpc::Stats, Some(&admin[..])).is_ok());
        assert!(authorize(Rpc::Stats, Some(&decode[..])).is_err());
        for rpc in [Rpc::Drain, Rpc::RefreshWeights] {
            assert!(authorize(rpc, Some(&admin[..])).is_ok());
            let e = authorize(rpc, Some(&router[..])).expect_err("refused");
            assert!(
                e.message().contains("a router certificate may not call"),
                "{e:?}"
            );
        }
        let none: Option<&[Vec<u8>]> = None;
        assert_eq!(
            authorize(Rpc::Prefill, none).expect_err("refused").code(),
            tonic::Code::Unauthenticated
        );
    }
}
