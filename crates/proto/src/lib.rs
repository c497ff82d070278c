//! Wire types for tandem. Generated code stays in `OUT_DIR`; this crate only includes it so
//! every other crate shares one definition of the router ↔ worker contract, and converts the
//! messages that have a `tandem_core` twin in one place ([`convert`]).

/// `From`/`TryFrom` between wire messages and their `tandem_core` twins.
pub mod convert;

/// `tandem.v1`: the Worker service (Prefill / Decode / Stats) and the KV target messages.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}
