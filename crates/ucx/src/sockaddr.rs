//! `std::net::SocketAddr` ⇄ C `sockaddr`. UCX takes `struct sockaddr *` + length and hands
//! back `sockaddr_storage`; both are the glibc layouts that `libc` also describes.

use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use tandem_ucx_sys as sys;

use crate::error::{Error, Result};

/// A socket address laid out for C, kept alive for as long as UCX reads it.
pub(crate) struct CSockAddr {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl CSockAddr {
    pub(crate) fn new(addr: SocketAddr) -> CSockAddr {
        // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (unspecified) value.
        let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
        let len = match addr {
            SocketAddr::V4(v4) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(v4.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
                unsafe {
                    (&mut storage as *mut libc::sockaddr_storage)
                        .cast::<libc::sockaddr_in>()
                        .write(sin)
                };
                mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(v6) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: v6.port().to_be(),
                    sin6_flowinfo: v6.flowinfo(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: v6.ip().octets(),
                    },
                    sin6_scope_id: v6.scope_id(),
                };
                // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
                unsafe {
                    (&mut storage as *mut libc::sockaddr_storage)
                        .cast::<libc::sockaddr_in6>()
                        .write(sin6)
                };
                mem::size_of::<libc::sockaddr_in6>()
            }
        };
        CSockAddr {
            storage,
            len: len as libc::socklen_t,
        }
    }

    /// The UCX view; valid while `self` is alive and not moved.
    pub(crate) fn as_ucs(&self) -> sys::ucs_sock_addr_t {
        sys::ucs_sock_addr_t {
            addr: (&self.storage as *const libc::sockaddr_storage).cast::<sys::sockaddr>(),
            addrlen: self.len,
        }
    }
}

/// Reads a `sockaddr_storage` filled in by UCX.
pub(crate) fn from_storage(storage: &sys::sockaddr_storage) -> Result<SocketAddr> {
    let raw = (storage as *const sys::sockaddr_storage).cast::<libc::sockaddr_storage>();
    // SAFETY: sys::sockaddr_storage and libc::sockaddr_storage are the same glibc type.
    let family = i32::from(unsafe { (*raw).ss_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin = unsafe { &*raw.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe { &*raw.cast::<libc::sockaddr_in6>() };
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        other => Err(Error::AddressFamily(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(addr: SocketAddr) -> SocketAddr {
        let c = CSockAddr::new(addr);
        // SAFETY: both storage types are the same glibc layout.
        let storage = unsafe {
            &*(&c.storage as *const libc::sockaddr_storage).cast::<sys::sockaddr_storage>()
        };
        from_storage(storage).expect("family is v4 or v6")
    }

    #[test]
    fn v4_and_v6_round_trip() {
        for s in ["127.0.0.1:4242", "10.1.2.3:1", "[::1]:9000", "[fe80::1]:80"] {
            let addr: SocketAddr = s.parse().expect("literal");
            assert_eq!(round_trip(addr), addr);
        }
    }
}
