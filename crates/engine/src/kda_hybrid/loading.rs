//! What a load is asked to do: options a caller chooses ([`LoadOptions`]: a LoRA adapter,
//! whether fusion may happen) and what one rank of a layout holds ([`RankShard`]).
//!
//! A single-rank model is the layout `tp1`, so every loader takes a [`RankShard`] and there is
//! one code path: [`RankShard::whole`] is the tp1 shard.

use std::ops::Range;
use std::path::PathBuf;
use tandem_model::fusion::{LoraTargets, QuantizationConfig};
use tandem_topology::Shard;

/// Whether eligible KDA projection groups are fused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FusionPolicy {
    /// Fuse every group [`tandem_model::fusion::decide`] finds eligible.
    #[default]
    Auto,
    /// Keep the checkpoint's separate projections everywhere (for comparisons).
    Never,
}

/// Options of [`super::KdaHybridModel::load_with`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// A PEFT LoRA adapter directory, merged into the base weights at load.
    pub lora: Option<PathBuf>,
    /// Fusion policy.
    pub fusion: FusionPolicy,
}

/// What one rank holds of every layer kind.
#[derive(Clone, Debug)]
pub(crate) struct RankShard {
    /// KDA heads: `(attn_tp_rank, A)` (or, for the deliberately wrong variant, global TP).
    pub kda: Shard,
    /// MLA heads: `(attn_tp_rank, A)`.
    pub mla: Shard,
    /// Dense MLPs and the shared expert: `(rank, tp)`.
    pub dense: Shard,
    /// Routed experts held: by `(ep_rank, ep)`.
    pub experts: Range<usize>,
    /// Each held expert's intermediate split: `(moe_tp_rank, tp/ep)`.
    pub expert_mlp: Shard,
    /// Log fusion decisions (one rank per layout does).
    pub log: bool,
}

impl RankShard {
    /// Everything: the single-rank model.
    pub fn whole(num_experts: usize) -> Self {
        Self {
            kda: Shard::WHOLE,
            mla: Shard::WHOLE,
            dense: Shard::WHOLE,
            experts: 0..num_experts,
            expert_mlp: Shard::WHOLE,
            log: true,
        }
    }
}

/// Inputs of the per-layer fusion decision, shared by all layers of a load.
#[derive(Clone, Debug, Default)]
pub(crate) struct FusionInputs {
    pub quant: Option<QuantizationConfig>,
    pub lora: Option<LoraTargets>,
    pub policy: FusionPolicy,
}

/// `shard`'s part of `0..len` as a topology error mapped into the engine's.
pub(crate) fn part(shard: Shard, len: usize, what: &str) -> crate::Result<Range<usize>> {
    shard
        .range(len)
        .map_err(|e| crate::Error::Weights(format!("{what}: {e}")))
}
