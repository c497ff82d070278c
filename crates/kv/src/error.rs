use std::time::Duration;

use tandem_core::ErrorClass;

/// A KV transport failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Creating the UCX context, worker or listener failed.
    #[error("starting the UCX KV transport failed")]
    Setup(#[source] tandem_ucx::Error),
    /// The background thread could not be started.
    #[error("spawning the KV transport thread failed")]
    Spawn(#[source] std::io::Error),
    /// The address is not a resolvable "host:port".
    #[error("invalid KV transfer address {address:?}")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// Why it could not be resolved.
        #[source]
        source: std::io::Error,
    },
    /// The receiver could not be reached (connection refused, unreachable, rejected).
    #[error("cannot reach the KV receiver at {address}")]
    Unreachable {
        /// The receiver's address.
        address: String,
        /// What UCX reported.
        #[source]
        source: tandem_ucx::Error,
    },
    /// The connection broke during a transfer (peer died, reset, cancelled).
    #[error("KV transfer to {address} failed")]
    Transfer {
        /// The receiver's address.
        address: String,
        /// What UCX reported.
        #[source]
        source: tandem_ucx::Error,
    },
    /// UCX did not report the send complete within the caller's timeout.
    #[error("KV transfer to {address} did not complete within {timeout:?}")]
    Timeout {
        /// The receiver's address.
        address: String,
        /// The timeout that ran out.
        timeout: Duration,
    },
    /// The transport's thread has stopped (it is shutting down or crashed).
    #[error("the KV transport thread has stopped")]
    Stopped,
    /// A one-sided write found its landing slot no longer held by its reservation (or
    /// already claimed by another writer): nothing was written.
    #[error("the landing slot at {address} is no longer its reservation's")]
    SlotReleased {
        /// The receiver's address.
        address: String,
    },
    /// A landing descriptor without what a one-sided write needs (no remote key).
    #[error("the landing slot at {address} is not registered for one-sided writes")]
    NotRemote {
        /// The receiver's address.
        address: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// How the failure is classified for retries and protocol status codes.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Transfer { .. } | Error::Timeout { .. } | Error::SlotReleased { .. } => {
                ErrorClass::TransferFailed
            }
            Error::NotRemote { .. } => ErrorClass::InvalidRequest,
            Error::Setup(_)
            | Error::Spawn(_)
            | Error::InvalidAddress { .. }
            | Error::Unreachable { .. }
            | Error::Stopped => ErrorClass::Unavailable,
        }
    }
}

/// Waits for a transport thread to report its UCX set-up; on failure (or if the thread died
/// without a word) joins it and says why.
pub(crate) fn await_setup<T>(
    ready: std::sync::mpsc::Receiver<tandem_ucx::Result<T>>,
    thread: std::thread::JoinHandle<()>,
) -> Result<(T, std::thread::JoinHandle<()>)> {
    let error = match ready.recv() {
        Ok(Ok(value)) => return Ok((value, thread)),
        Ok(Err(err)) => Error::Setup(err),
        Err(_) => Error::Stopped,
    };
    let _ = thread.join();
    Err(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_retryable_transfer_or_unavailable() {
        let timeout = Error::Timeout {
            address: "127.0.0.1:1".into(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(timeout.class(), ErrorClass::TransferFailed);
        assert_eq!(Error::Stopped.class(), ErrorClass::Unavailable);
        let refused = Error::Unreachable {
            address: "127.0.0.1:1".into(),
            source: tandem_ucx::Error::from_status(
                "endpoint",
                tandem_ucx::sys::UCS_ERR_NOT_CONNECTED,
            ),
        };
        assert_eq!(refused.class(), ErrorClass::Unavailable);
        assert!(refused.class().is_retryable() && timeout.class().is_retryable());
    }
}
