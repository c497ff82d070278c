//! Who a peer is on the cluster's mutually authenticated gRPC: the role its certificate
//! names, as a SPIFFE-style URI SAN `spiffe://TRUST_DOMAIN/ROLE` (`spiffe://tandem/router`).
//! The CA vouches for the certificate; the role says which calls it may make, so a worker
//! certificate that leaks cannot run prefills, and an admin certificate cannot serve traffic.

use std::fmt;

/// The trust domain of the certificates tandem generates (`tandem tls generate`).
pub const TRUST_DOMAIN: &str = "tandem";

/// A component's role, as its certificate names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerRole {
    /// The HTTP router: sends prefill, decode and generate calls, polls stats.
    Router,
    /// An operator's tools (`tandem admin`): drains, reloads weights, reads stats.
    Admin,
    /// A prefill worker.
    Prefill,
    /// A decode worker.
    Decode,
    /// An aggregated worker (prefill and decode in one process).
    Worker,
}

impl PeerRole {
    /// Every role.
    pub const ALL: [PeerRole; 5] = [
        PeerRole::Router,
        PeerRole::Admin,
        PeerRole::Prefill,
        PeerRole::Decode,
        PeerRole::Worker,
    ];

    /// `router`, `admin`, `prefill`, `decode` or `worker`.
    pub fn as_str(self) -> &'static str {
        match self {
            PeerRole::Router => "router",
            PeerRole::Admin => "admin",
            PeerRole::Prefill => "prefill",
            PeerRole::Decode => "decode",
            PeerRole::Worker => "worker",
        }
    }

    /// The role named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The URI SAN naming this role in `trust_domain`.
    pub fn spiffe_uri(self, trust_domain: &str) -> String {
        format!("spiffe://{trust_domain}/{}", self.as_str())
    }

    /// The role a URI SAN names: `spiffe://ANY_TRUST_DOMAIN/ROLE` (the CA, not the trust
    /// domain, decides whom the cluster trusts). `None` for any other URI.
    pub fn from_spiffe_uri(uri: &str) -> Option<Self> {
        let rest = uri.strip_prefix("spiffe://")?;
        let (domain, path) = rest.split_once('/')?;
        if domain.is_empty() {
            return None;
        }
        Self::parse(path)
    }
}

impl fmt::Display for PeerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_through_their_uri_and_nothing_else_parses() {
        for role in PeerRole::ALL {
            assert_eq!(
                PeerRole::from_spiffe_uri(&role.spiffe_uri(TRUST_DOMAIN)),
                Some(role)
            );
            assert_eq!(
                PeerRole::from_spiffe_uri(&role.spiffe_uri("prod.example.com")),
                Some(role)
            );
        }
        for bad in [
            "spiffe://tandem/root",
            "spiffe://tandem/router/extra",
            "spiffe:///router",
            "https://tandem/router",
            "router",
            "spiffe://tandem",
        ] {
            assert_eq!(PeerRole::from_spiffe_uri(bad), None, "{bad}");
        }
    }
}
