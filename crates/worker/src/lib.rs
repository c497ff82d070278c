//! A tandem worker: one process serving one role (prefill or decode) for one model, over
//! gRPC. The prefill role computes prompts and pushes their KV to the decode worker named in
//! the request's `KvTarget`; the decode role reserves KV space, waits for the KV to arrive
//! over the transport, and streams the remaining tokens. Reservations are leases: one that is
//! not fed in time is released, and every allocation frees itself when its request ends.

/// Admission and draining: what is in flight, and when the worker may exit.
mod drain;
/// The engine a worker serves (any model family) behind the few questions the service asks.
pub mod engine;
/// The KV handoff message format (header, checksum, body).
pub mod handoff;
mod push;
/// Decode-side reservations awaiting their KV.
pub mod reservations;
/// The gRPC service.
pub mod service;
/// Mutual TLS on the gRPC port and the roles each call takes.
pub mod tls;
/// Timings and sizes of KV pushes by path, reported with the stats.
pub mod transfer_stats;

pub use engine::WorkerEngine;
pub use service::{serve, serve_registered, LandingMode, Role, WorkerOptions};
pub use tls::GrpcTls;

use tandem_core::ErrorClass;

/// Errors of a worker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] tandem_engine::Error),
    /// Moving KV failed.
    #[error(transparent)]
    Transport(#[from] tandem_kv::Error),
    /// The KV handoff was malformed or corrupt.
    #[error("KV handoff rejected: {0}")]
    Handoff(#[from] handoff::HandoffError),
    /// The request does not fit this worker's role or model.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A lease ran out.
    #[error("{0}")]
    Deadline(String),
    /// Serving gRPC failed.
    #[error(transparent)]
    Grpc(#[from] tonic::transport::Error),
    /// The KV of a reserved request never arrived (its prefill died, or the push was lost):
    /// retryable on another pair.
    #[error("{0}")]
    KvNotArrived(String),
    /// A transfer fault injected by a chaos scenario (`--chaos-scenario`).
    #[error("chaos: {0}")]
    InjectedTransferFault(String),
    /// The worker takes no new work now (draining, or not registered in discovery): the
    /// router retries elsewhere.
    #[error("{0}")]
    NotAdmitting(String),
    /// The TLS material does not load.
    #[error("gRPC TLS: {0}")]
    Tls(#[from] tandem_tls::TlsError),
}

impl Error {
    /// The class of this failure.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Engine(e) => e.class(),
            Error::Transport(e) => e.class(),
            Error::Handoff(_) => ErrorClass::TransferFailed,
            Error::InvalidRequest(_) => ErrorClass::InvalidRequest,
            Error::Deadline(_) => ErrorClass::DeadlineExceeded,
            Error::Grpc(_) | Error::NotAdmitting(_) => ErrorClass::Unavailable,
            Error::KvNotArrived(_) | Error::InjectedTransferFault(_) => ErrorClass::TransferFailed,
            Error::Tls(_) => ErrorClass::Internal,
        }
    }
}

/// gRPC metadata key carrying the [`ErrorClass`] of a failed call.
pub const ERROR_CLASS_HEADER: &str = "x-tandem-error-class";

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        let class = e.class();
        let code = match class {
            ErrorClass::InvalidRequest => tonic::Code::InvalidArgument,
            ErrorClass::Unavailable => tonic::Code::Unavailable,
            ErrorClass::CapacityExhausted => tonic::Code::ResourceExhausted,
            ErrorClass::TransferFailed => tonic::Code::Aborted,
            ErrorClass::Cancelled => tonic::Code::Cancelled,
            ErrorClass::DeadlineExceeded => tonic::Code::DeadlineExceeded,
            ErrorClass::Internal => tonic::Code::Internal,
        };
        let mut status = tonic::Status::new(code, e.to_string());
        if let Ok(v) = class.as_str().parse() {
            status.metadata_mut().insert(ERROR_CLASS_HEADER, v);
        }
        status
    }
}

/// Result of a worker.
pub type Result<T> = std::result::Result<T, Error>;
