//! A small, safe, single-threaded wrapper over UCX's UCP API.
//!
//! tandem moves KV caches between processes with UCX so that the same code runs over TCP or
//! shared memory on a laptop and over RDMA in production. This crate owns every `unsafe` call
//! into UCX and exposes only what the KV transport needs: a [`Context`], a [`Worker`] driven
//! by one thread, sockaddr-based connection establishment ([`Listener`] → [`ConnRequest`] →
//! [`Endpoint`]), tagged sends, probe-then-receive so messages of unknown size can be
//! received, and one-sided puts into a peer's registered memory ([`MemoryRegion`],
//! [`RemoteKey`], [`Endpoint::put`], [`Endpoint::flush`]).
//!
//! Design choices, and why:
//!
//! - **One thread per worker.** Workers are created in `UCS_THREAD_MODE_SINGLE` (no locks in
//!   UCX) and every handle holds an `Rc`, so the compiler keeps them on the thread that made
//!   them. The only cross-thread handle is [`Waker`], built on `ucp_worker_signal`, which UCX
//!   documents as callable from any thread.
//! - **Callbacks only touch heap state.** Completion and error callbacks write into small
//!   reference-counted cells that UCX holds one reference to; buffers live in the same cell, so
//!   dropping an operation handle early never frees memory UCX is still using.
//! - **Resources free themselves.** Dropping an [`Endpoint`] closes it (`ucp_ep_close_nbx`,
//!   bounded wait); listener, worker and context are destroyed in dependency order because each
//!   holds a reference to what it was made from. Where UCX never answers a close, the few
//!   bytes of callback state are deliberately leaked rather than freed under UCX's feet.
//! - **Blocking waits use the worker's event fd** (`UCP_FEATURE_WAKEUP`), so idle threads
//!   sleep instead of spinning; this matters on small machines that run several workers.

// This crate is the safe boundary around the UCX C library: it needs `unsafe` to call it.
// Every block carries a `// SAFETY:` comment; nothing unsafe leaks through the public API.
#![allow(unsafe_code)]

/// `Config`: UCX configuration read from `UCX_*` variables, with programmatic overrides.
mod config;
/// `Context`: the UCP application context.
mod context;
/// `Endpoint`: a connection to a peer; connect, accept, tagged send, close.
mod endpoint;
/// `Error`, `Result` and status-code helpers.
mod error;
/// `Listener` and `ConnRequest`: accepting sockaddr connections.
mod listener;
/// Non-blocking operations (`SendOp`, `RecvOp`, `Closing`) and their completion callbacks.
mod request;
/// One-sided puts: `MemoryRegion`, `RemoteKey`, `Endpoint::put` and `Endpoint::flush`.
mod rma;
/// Conversions between `std::net::SocketAddr` and C `sockaddr`.
mod sockaddr;
/// `Worker`: progress, event-fd waits, probe-and-receive; `Waker` to wake it from elsewhere.
mod worker;

pub use config::Config;
pub use context::Context;
pub use endpoint::{CloseMode, Endpoint};
pub use error::{status_text, Error, Result};
pub use listener::{ConnRequest, Listener};
pub use request::{Closing, RecvOp, SendOp};
pub use rma::{AtomicOp, MemoryRegion, RemoteKey};
pub use worker::{Waker, Worker};

/// The raw bindings, for status constants (`sys::UCS_ERR_UNREACHABLE`, …) and types.
pub use tandem_ucx_sys as sys;

/// UCX's version as "major.minor.release", from the library actually loaded.
pub fn version() -> String {
    // SAFETY: ucp_get_version_string takes no arguments and returns a static C string.
    let ptr = unsafe { sys::ucp_get_version_string() };
    if ptr.is_null() {
        return String::from("unknown");
    }
    // SAFETY: non-null, NUL-terminated and static per the UCP docs.
    unsafe { std::ffi::CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}
