use tandem_ucx::Config;

/// `UCX_TLS` used when the environment does not set it.
pub const DEFAULT_TLS: &str = "tcp,sm,self";
/// `UCX_NET_DEVICES` used when the environment does not set it: loopback only.
pub const DEFAULT_NET_DEVICES: &str = "lo";

/// The UCX configuration for a KV transport: environment first, then tandem's defaults for
/// what the environment leaves unset.
pub(crate) fn ucx_config() -> tandem_ucx::Result<Config> {
    let mut config = Config::read()?;
    match std::env::var("UCX_TLS") {
        Ok(tls) => {
            if !tls_can_connect(&tls) {
                tracing::warn!(
                    UCX_TLS = %tls,
                    "UCX_TLS lacks tcp; sockaddr connection establishment needs it, \
                     connections will likely fail"
                );
            }
        }
        Err(_) => config.set("TLS", DEFAULT_TLS)?,
    }
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        config.set("NET_DEVICES", DEFAULT_NET_DEVICES)?;
    }
    tracing::debug!(
        ucx = %tandem_ucx::version(),
        tls = %std::env::var("UCX_TLS").unwrap_or_else(|_| DEFAULT_TLS.to_owned()),
        net_devices = %std::env::var("UCX_NET_DEVICES")
            .unwrap_or_else(|_| DEFAULT_NET_DEVICES.to_owned()),
        "UCX KV transport configuration"
    );
    Ok(config)
}

/// Whether a `UCX_TLS` value leaves the TCP connection manager available.
fn tls_can_connect(tls: &str) -> bool {
    let tls = tls.trim();
    let names = |list: &str| list.split(',').map(str::trim).any(|t| t == "tcp");
    match tls.strip_prefix('^') {
        // "^x,y" means "everything except x and y".
        Some(excluded) => !names(excluded),
        None => tls.split(',').any(|t| t.trim() == "all") || names(tls),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_is_required_for_connection_establishment() {
        assert!(tls_can_connect("tcp"));
        assert!(tls_can_connect("sm,tcp"));
        assert!(tls_can_connect(DEFAULT_TLS));
        assert!(tls_can_connect("all"));
        assert!(tls_can_connect("^ib"));
        assert!(!tls_can_connect("sm"));
        assert!(!tls_can_connect("sm,self"));
        assert!(!tls_can_connect("^tcp"));
    }
}
