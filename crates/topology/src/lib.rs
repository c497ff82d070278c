//! Where every piece of a model lives across the ranks of a worker group, and how ranks talk.
//!
//! A worker group runs `tp × dp` (plus `ep` for MoE) ranks. Attention is sharded over the
//! *attention-TP* group of `A = tp / dp` ranks, while dense MLPs use the full TP group and
//! experts the EP split. Confusing the two is the classic DP-attention bug: under decode
//! tp8×dp8, `A = 1`, so each rank is a whole attention replica, and sharding its heads by the
//! global TP rank loads an eighth of them and reduces o_proj across unrelated requests. This
//! crate keeps those rules in one place, as pure functions with their own tests, so the model
//! loader, the engine and the P/D transfer layer cannot each get them subtly different:
//!
//! - [`RawLayout`] → [`Layout`] checks sizes once; [`Layout::validate_for`] checks a model at
//!   start-up with errors that name the numbers and the rule broken.
//! - [`shard`] says which rows of each checkpoint tensor a rank holds; [`ShardBy`] makes the
//!   attention-TP vs global-TP choice explicit at every call site.
//! - [`TransferPlan`] says which prefill rank sends which heads / channels / latent to which
//!   decode rank when the layouts differ.
//! - [`Communicator`] is the narrow collective interface (NCCL on GPUs);
//!   [`InProcessCommunicator`] runs ranks as threads, deterministically and without hanging on a
//!   dead peer, so TP8×DP8 can be simulated on a 2-core box.
//!
//! Nothing here does I/O or touches a device.

/// The `Communicator` trait, per-rank groups, and the in-process implementation.
pub mod comm;
/// `Error` and `Result`.
pub mod error;
/// `RawLayout` → `Layout`, rank positions, validation against a model.
pub mod layout;
/// The P/D transfer plan: resharding per-request state between layouts.
pub mod reshard;
/// `ModelShape`: the sizes that decide sharding.
pub mod shape;
/// What each rank holds: head, KDA parameter, fused-weight, MLP and expert ranges.
pub mod shard;

pub use comm::{Communicator, InProcessCommunicator, RankGroups};
pub use error::{Error, PeerFailure, Result};
pub use layout::{Layout, Rank, RankPosition, RawLayout};
pub use reshard::{ConvBlock, Transfer, TransferKind, TransferPlan};
pub use shape::{GqaShape, KdaShape, MlaShape, ModelShape, MoeShape};
pub use shard::{head_range, KdaParam, KdaShard, Shard, ShardBy};
