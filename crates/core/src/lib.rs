//! The vocabulary every tandem crate shares: identifiers as newtypes (never bare integers or
//! URL strings), the failure classes a request can end in, and the checked generation request
//! that travels from the router inward.

/// `ErrorClass`: how a failure is classified, once, where it happens.
pub mod error_class;
/// Certificate roles of the cluster's components (`spiffe://tandem/router`).
pub mod identity;
/// Newtype identifiers: requests, workers, reservations, epochs, blocks.
pub mod ids;
/// Prefix-cache block identity: chained block hashes.
pub mod prefix;
/// Validated sampling parameters and generation requests.
pub mod request;

pub use error_class::ErrorClass;
pub use identity::PeerRole;
pub use ids::{BlockId, Epoch, RequestId, ReservationId, WorkerId};
pub use prefix::{block_hashes, CacheSalt};
pub use request::{FinishReason, OutputConstraint, SamplingParams, TokenLogprobs};
