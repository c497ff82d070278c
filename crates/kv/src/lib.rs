//! The KV-cache transport between prefill and decode workers.
//!
//! A prefill worker pushes each layer's KV (and the completion record) to the decode worker
//! that reserved memory for the request. This crate carries those bytes over UCX tagged
//! messages, so one code path runs over TCP or shared memory on a laptop and over RDMA in
//! production.
//!
//! Between workers on one host the handoff itself skips the transport: the decode worker's
//! [`landing`] arena (shared memory) takes it, and only a completion record is sent.
//!
//! Why it looks the way it does:
//!
//! - **One background thread per side.** A UCX worker is single-threaded and must be
//!   progressed; [`UcxReceiver`] and [`UcxSender`] each own a thread that owns the UCX context,
//!   worker, listener and endpoints, and sleeps on the worker's event fd when idle. Async
//!   callers talk to it through channels, so nothing UCX-shaped leaks into Tokio code.
//! - **Receive without knowing sizes.** The receiver probes for any tag and receives each
//!   message into a buffer of its exact size, then hands complete [`KvMessage`]s out in the
//!   order they completed.
//! - **Nothing waits forever.** Endpoints use UCX's peer-failure mode, so a dead or refusing
//!   peer fails the send; every send also has a deadline enforced by the thread. A failed or
//!   timed-out endpoint is evicted (force-closed) and the next send reconnects.
//! - **Errors are classified once, here**: [`Error::class`] says `Unavailable` (could not
//!   reach the peer, transport stopped) or `TransferFailed` (the peer went away mid-stream, or
//!   the transfer stalled past its deadline).
//!
//! # UCX transport defaults
//!
//! `UCX_*` environment variables always win. When they are not set, this crate sets:
//!
//! - `UCX_TLS=tcp,sm,self`: TCP plus shared memory (sysv/posix/cma) on one host. Connection
//!   establishment goes through UCX's sockaddr connection manager, which needs `tcp`, so a
//!   `UCX_TLS` without `tcp` (e.g. `sm`) cannot connect; a warning is logged. `UCX_TLS=tcp`
//!   and `UCX_TLS=sm,tcp` both work. Note that UCX 1.13 only puts the transports it can reach
//!   through the connection manager on a client-server endpoint: on one host that is
//!   `tcp/lo`, so shared memory is not used for the payload even when listed.
//! - `UCX_NET_DEVICES=lo`: keeps TCP traffic on loopback. **Set `UCX_NET_DEVICES` (and
//!   `UCX_TLS`) explicitly for multi-host deployments**, e.g. `UCX_NET_DEVICES=eth0` or an
//!   RDMA device such as `mlx5_0:1`.
//!
//! A receiver restarted on the same fixed port fails to bind ("Address already in use") while
//! the old connections sit in `TIME_WAIT`, unless `UCX_TCP_CM_REUSEADDR=y` is in the
//! environment. UCX 1.13 does not apply `ucp_config_modify` overrides to the connection
//! manager, so this crate cannot set it for you: deployments that pin the KV port should set
//! it.

/// `Error` and its classification into `tandem_core::ErrorClass`.
mod error;
/// Shared-memory landing slots for prefill workers on the decode worker's host.
pub mod landing;
/// `KvMessage`: one complete tagged message.
mod message;
/// "host:port" parsing and resolution.
mod peer_address;
/// `UcxReceiver`: the decode side's listener thread.
mod receiver;
/// `UcxSender`: the prefill side's sending thread and endpoint cache.
mod sender;
/// UCX configuration with tandem's defaults (see the crate docs).
mod transport_config;

pub use error::{Error, Result};
pub use message::KvMessage;
pub use receiver::UcxReceiver;
pub use sender::UcxSender;
pub use transport_config::{DEFAULT_NET_DEVICES, DEFAULT_TLS};
