//! Fault injection for SREs (`tandem chaos`): a seeded [`scenario`] of faults, a
//! fault-injecting HTTP/2 [`proxy`] to put between the router and a worker, transfer faults
//! for a prefill worker's KV pushes ([`scenario::TransferChaos`]), and a trace [`replay`]
//! that judges a run against a fault-free one, optionally [`kill`]ing named processes
//! during it.

pub mod kill;
pub mod proxy;
pub mod replay;
pub mod scenario;

pub use proxy::{serve_admin, Proxy};
pub use replay::{leaks, read_trace, replay, synth_trace, Outcome, TraceEntry, Verdict};
pub use scenario::{Scenario, TransferChaos, TransferFault};
