use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{Error, Result};

/// Resolves "host:port" to one socket address, preferring IPv4 (so "localhost" reaches a
/// receiver bound on 127.0.0.1).
pub(crate) fn resolve(address: &str) -> Result<SocketAddr> {
    let invalid = |source| Error::InvalidAddress {
        address: address.to_owned(),
        source,
    };
    if let Ok(addr) = address.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let all: Vec<SocketAddr> = address.to_socket_addrs().map_err(invalid)?.collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| {
            invalid(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "resolved to no addresses",
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_localhost_resolve() {
        assert_eq!(
            resolve("127.0.0.1:5000").expect("literal"),
            "127.0.0.1:5000".parse().expect("literal")
        );
        assert_eq!(resolve("[::1]:7").expect("v6").port(), 7);
        let local = resolve("localhost:9").expect("localhost");
        assert!(local.ip().is_loopback() && local.port() == 9);
    }

    #[test]
    fn garbage_is_an_invalid_address() {
        for bad in ["", "nohost", "127.0.0.1", "1.2.3.4:notaport"] {
            assert!(
                matches!(resolve(bad), Err(Error::InvalidAddress { .. })),
                "{bad}"
            );
        }
    }
}
