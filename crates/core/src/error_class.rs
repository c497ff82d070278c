use serde::Serialize;

/// How a failed request is classified. Each failure is classified once, where it happens, and
/// mapped to a protocol status in exactly one place per protocol (HTTP in the router,
/// gRPC in `tandem-worker`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The client's input is wrong; retrying it cannot help. Never trips a breaker.
    InvalidRequest,
    /// A worker could not be reached or refused to serve.
    Unavailable,
    /// No KV blocks / slots free for the request.
    CapacityExhausted,
    /// Moving KV between prefill and decode failed.
    TransferFailed,
    /// The client went away.
    Cancelled,
    /// A deadline or lease ran out.
    DeadlineExceeded,
    /// A bug or an unexpected state.
    Internal,
}

impl ErrorClass {
    /// Whether a request failing with this class may be retried on another worker pair.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorClass::Unavailable | ErrorClass::CapacityExhausted | ErrorClass::TransferFailed
        )
    }

    /// Stable lower-case name used in metrics labels and error bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::InvalidRequest => "invalid_request",
            ErrorClass::Unavailable => "unavailable",
            ErrorClass::CapacityExhausted => "capacity_exhausted",
            ErrorClass::TransferFailed => "transfer_failed",
            ErrorClass::Cancelled => "cancelled",
            ErrorClass::DeadlineExceeded => "deadline_exceeded",
            ErrorClass::Internal => "internal",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_requests_are_never_retried() {
        assert!(!ErrorClass::InvalidRequest.is_retryable());
        assert!(!ErrorClass::Cancelled.is_retryable());
        assert!(ErrorClass::TransferFailed.is_retryable());
    }
}
