use std::ffi::CStr;
use std::time::Duration;

use tandem_ucx_sys as sys;

/// Everything that can go wrong talking to UCX.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A UCX call returned (or completed with) an error status.
    #[error("{op}: {text} (ucs_status_t {status})")]
    Status {
        /// The UCX call or operation that failed, e.g. `"ucp_tag_send_nbx"`.
        op: &'static str,
        /// The raw status code.
        status: sys::ucs_status_t,
        /// `ucs_status_string(status)`.
        text: String,
    },
    /// A "host:port" string could not be resolved.
    #[error("cannot resolve {address:?}")]
    Resolve {
        /// The address as given.
        address: String,
        /// Why resolution failed.
        #[source]
        source: std::io::Error,
    },
    /// A config name or value contained a NUL byte.
    #[error("UCX config {name}={value:?} is not a valid C string")]
    InvalidConfig {
        /// The variable name (without the `UCX_` prefix).
        name: String,
        /// The rejected value.
        value: String,
    },
    /// Waiting on the worker's event file descriptor failed.
    #[error("waiting for UCX worker events failed")]
    Wait(#[source] std::io::Error),
    /// A socket address family UCX handed back that this crate does not understand.
    #[error("unsupported socket address family {0}")]
    AddressFamily(i32),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds [`Error::Status`] for `status`, looking up its text.
    pub fn from_status(op: &'static str, status: sys::ucs_status_t) -> Error {
        Error::Status {
            op,
            status,
            text: status_text(status),
        }
    }

    /// The UCX status code, when the error came from UCX.
    pub fn status(&self) -> Option<sys::ucs_status_t> {
        match self {
            Error::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether UCX reported a timeout (an operation's or a peer's).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self.status(),
            Some(sys::UCS_ERR_TIMED_OUT | sys::UCS_ERR_ENDPOINT_TIMEOUT)
        )
    }
}

/// `ucs_status_string(status)` as an owned string.
pub fn status_text(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any value and returns a static NUL-terminated string
    // (a generic message for unknown codes).
    let ptr = unsafe { sys::ucs_status_string(status) };
    if ptr.is_null() {
        return format!("unknown status {status}");
    }
    // SAFETY: non-null, static and NUL-terminated (see above).
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// `Ok(())` for `UCS_OK`, otherwise [`Error::Status`].
pub(crate) fn check(op: &'static str, status: sys::ucs_status_t) -> Result<()> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(Error::from_status(op, status))
    }
}

/// Milliseconds for `poll(2)`, rounded up so a short timeout never becomes a busy spin.
pub(crate) fn poll_millis(timeout: Duration) -> i32 {
    let ms = timeout.as_micros().div_ceil(1000);
    i32::try_from(ms).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_errors_keep_code_and_text() {
        let err = Error::from_status("ucp_ep_create", sys::UCS_ERR_UNREACHABLE);
        assert_eq!(err.status(), Some(sys::UCS_ERR_UNREACHABLE));
        let shown = err.to_string();
        assert!(shown.contains("ucp_ep_create"), "{shown}");
        assert!(shown.to_lowercase().contains("unreachable"), "{shown}");
        assert!(check("x", sys::UCS_OK).is_ok());
    }

    #[test]
    fn poll_timeouts_round_up() {
        assert_eq!(poll_millis(Duration::from_micros(1)), 1);
        assert_eq!(poll_millis(Duration::ZERO), 0);
        assert_eq!(poll_millis(Duration::from_secs(1)), 1000);
    }
}
