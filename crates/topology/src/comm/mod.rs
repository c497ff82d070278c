//! How the ranks of one worker group talk: a narrow [`Communicator`] trait (NCCL on GPUs,
//! [`InProcessCommunicator`] for CPU ranks that are threads of one process) and the two groups
//! every rank needs, built from a [`Layout`].
//!
//! Collectives are blocking and every rank of a group must call the same ones in the same
//! order, as with NCCL. A rank issues them from one thread at a time.

mod in_process;

pub use in_process::InProcessCommunicator;

use crate::error::{Error, Result};
use crate::layout::{Layout, Rank, RankPosition};

/// A group of ranks that run collectives together.
pub trait Communicator: Send {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Replaces `buf` on every rank with the element-wise sum over ranks. Lengths must match.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Every rank's `local` concatenated in rank order. Lengths must match.
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;

    /// Sums `input` over ranks and returns this rank's `1/size` chunk of the sum. Lengths must
    /// match and be divisible by `size()`.
    fn reduce_scatter_sum(&self, input: &[f32]) -> Result<Vec<f32>>;

    /// `send[j]` goes to rank `j`; returns `recv` with `recv[i]` from rank `i`. `send` must
    /// have `size()` entries; their lengths may differ (token counts per expert shard do).
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>>;

    /// Collective: ranks calling with the same `color` form a new group, numbered in the
    /// order of their ranks here (`ncclCommSplit` with key = rank).
    fn split(&self, color: usize) -> Result<Self>
    where
        Self: Sized;
}

/// The communicators one rank uses.
#[derive(Debug)]
pub struct RankGroups<C> {
    /// Where the rank sits in the layout.
    pub position: RankPosition,
    /// The full TP group (`tp` ranks): dense MLP reductions, MoE dispatch and combine.
    pub tp: C,
    /// The rank's attention-TP group (`A` ranks): o_proj reduction. Never the full TP group:
    /// under DP attention other groups hold other requests.
    pub attn_tp: C,
}

impl<C: Communicator> RankGroups<C> {
    /// Builds the groups from `world`, the worker group's communicator. Collective: every rank
    /// of `world` must call it.
    pub fn new(world: C, layout: &Layout) -> Result<Self> {
        if world.size() != layout.tp() {
            return Err(Error::GroupSizeMismatch {
                what: "full TP group",
                expected: layout.tp(),
                actual: world.size(),
            });
        }
        let position = layout.position(Rank(world.rank()))?;
        let attn_tp = world.split(position.attn_dp_rank)?;
        if attn_tp.size() != layout.attn_tp() || attn_tp.rank() != position.attn_tp_rank {
            return Err(Error::GroupSizeMismatch {
                what: "attention-TP group",
                expected: layout.attn_tp(),
                actual: attn_tp.size(),
            });
        }
        Ok(RankGroups {
            position,
            tp: world,
            attn_tp,
        })
    }
}
