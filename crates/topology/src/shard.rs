//! What each rank holds: pure functions from (shape, rank position) to index ranges of the
//! full checkpoint tensors.
//!
//! Everything head-sharded in attention is split by `(attn_tp_rank, A)`; dense MLPs by
//! `(rank, tp)`; experts by `(ep_rank, ep)` and inside an expert by `(moe_tp_rank, tp/ep)`.
//! [`ShardBy`] names the first two so the difference is visible at call sites — and so tests
//! can show what goes wrong when attention is sharded by the global TP rank.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::{Layout, Rank};
use crate::shape::{GqaShape, KdaShape, MoeShape};

/// Part `index` of `count` equal, contiguous parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shard {
    index: usize,
    count: usize,
}

impl Shard {
    /// The whole thing: part 0 of 1.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// Part `index` of `count`; fails unless `index < count`.
    pub fn new(index: usize, count: usize) -> Result<Self> {
        if count == 0 {
            return Err(Error::ZeroSize {
                what: "shard count",
            });
        }
        if index >= count {
            return Err(Error::OutOfRange {
                what: "shard",
                index,
                size: count,
            });
        }
        Ok(Shard { index, count })
    }

    /// Which part.
    pub fn index(&self) -> usize {
        self.index
    }

    /// How many parts.
    pub fn count(&self) -> usize {
        self.count
    }

    /// This part of `0..len`; fails unless `count` divides `len`.
    pub fn range(&self, len: usize) -> Result<Range<usize>> {
        if !len.is_multiple_of(self.count) {
            return Err(Error::NotDivisible {
                len,
                count: self.count,
            });
        }
        let n = len / self.count;
        Ok(self.index * n..(self.index + 1) * n)
    }
}

/// The heads attention-TP rank `attn_tp_rank` of `attn_tp` holds: a contiguous block of
/// `num_heads / attn_tp`.
pub fn head_range(num_heads: usize, attn_tp_rank: usize, attn_tp: usize) -> Result<Range<usize>> {
    Shard::new(attn_tp_rank, attn_tp)?.range(num_heads)
}

/// The experts EP rank `ep_rank` of `ep` holds.
pub fn expert_range(num_experts: usize, ep_rank: usize, ep: usize) -> Result<Range<usize>> {
    Shard::new(ep_rank, ep)?.range(num_experts)
}

/// Which group a weight is split over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardBy {
    /// `(attn_tp_rank, A)`: right for everything head-sharded in attention.
    AttentionTp,
    /// `(rank, tp)`: right for dense MLPs. **Wrong for attention whenever `A ≠ tp`**: under
    /// tp8×dp8 each rank is a whole attention replica that must hold all heads, but this picks
    /// one eighth of them. Kept so tests can demonstrate exactly that.
    GlobalTp,
}

impl ShardBy {
    /// The part `rank` holds under this rule.
    pub fn shard(self, layout: &Layout, rank: Rank) -> Result<Shard> {
        let pos = layout.position(rank)?;
        match self {
            ShardBy::AttentionTp => Shard::new(pos.attn_tp_rank, layout.attn_tp()),
            ShardBy::GlobalTp => Shard::new(rank.0, layout.tp()),
        }
    }
}

/// The heads one attention-TP rank holds in a GQA layer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GqaShard {
    /// Query heads (and the o_proj input columns `q_heads × head_dim`).
    pub q_heads: Range<usize>,
    /// Key/value heads; they serve exactly the query heads above.
    pub kv_heads: Range<usize>,
}

/// The heads `shard` holds of a GQA layer.
pub fn gqa_shard(shape: &GqaShape, shard: Shard) -> Result<GqaShard> {
    Ok(GqaShard {
        q_heads: shard.range(shape.num_attention_heads)?,
        kv_heads: shard.range(shape.num_kv_heads)?,
    })
}

/// How an MLP's intermediate dimension is split: column-parallel up, row-parallel down.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MlpShard {
    /// Rows of `gate_proj`/`up_proj` (expert `w1`/`w3`), `[intermediate, hidden]`.
    pub gate_up_rows: Range<usize>,
    /// Columns (input dim) of `down_proj` (expert `w2`), `[hidden, intermediate]`; the outputs
    /// are partial sums, reduced over the group that split them.
    pub down_cols: Range<usize>,
}

/// Splits an MLP of `intermediate` channels.
pub fn mlp_shard(intermediate: usize, shard: Shard) -> Result<MlpShard> {
    let r = shard.range(intermediate)?;
    Ok(MlpShard {
        gate_up_rows: r.clone(),
        down_cols: r,
    })
}

/// What `rank` holds of a dense MLP: split over the full TP group.
pub fn dense_mlp_shard(layout: &Layout, rank: Rank, intermediate: usize) -> Result<MlpShard> {
    mlp_shard(intermediate, ShardBy::GlobalTp.shard(layout, rank)?)
}

/// What `rank` holds of a MoE layer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ExpertShard {
    /// Routed experts held (by EP rank).
    pub experts: Range<usize>,
    /// The split of each held expert over its `tp/ep` ranks.
    pub mlp: MlpShard,
}

/// What `rank` holds of a MoE layer (see the EP rule in [`crate::layout`]).
pub fn expert_shard(layout: &Layout, rank: Rank, moe: &MoeShape) -> Result<ExpertShard> {
    let pos = layout.position(rank)?;
    Ok(ExpertShard {
        experts: expert_range(moe.num_experts, pos.ep_rank, layout.ep())?,
        mlp: mlp_shard(
            moe.intermediate_size,
            Shard::new(pos.moe_tp_rank, layout.moe_tp())?,
        )?,
    })
}

/// The parameters of one KDA layer (names as in the checkpoints, see [`KdaParam::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KdaParam {
    /// `q_proj`, `[P, hidden]`.
    QProj,
    /// `k_proj`, `[P, hidden]`.
    KProj,
    /// `v_proj`, `[P, hidden]`.
    VProj,
    /// `q_conv1d.weight`, `[P, 1, W]`.
    QConv,
    /// `k_conv1d.weight`, `[P, 1, W]`.
    KConv,
    /// `v_conv1d.weight`, `[P, 1, W]`.
    VConv,
    /// `b_proj`, `[H, hidden]`.
    BProj,
    /// `f_a_proj`, `[D, hidden]`, replicated.
    FAProj,
    /// `f_b_proj`, `[P, D]`.
    FBProj,
    /// `g_a_proj`, `[D, hidden]`, replicated.
    GAProj,
    /// `g_b_proj`, `[P, D]`.
    GBProj,
    /// `A_log`, `[H]` (Kimi stores `[1, 1, H, 1]`; the range applies to the H axis).
    ALog,
    /// `dt_bias`, `[P]`.
    DtBias,
    /// `o_norm.weight`, `[D]`, replicated.
    ONorm,
    /// `o_proj`, `[hidden, P]`, split along its input (second) axis.
    OProj,
}

impl KdaParam {
    /// Every parameter, in the spec's order.
    pub const ALL: [KdaParam; 15] = [
        KdaParam::QProj,
        KdaParam::KProj,
        KdaParam::VProj,
        KdaParam::QConv,
        KdaParam::KConv,
        KdaParam::VConv,
        KdaParam::BProj,
        KdaParam::FAProj,
        KdaParam::FBProj,
        KdaParam::GAProj,
        KdaParam::GBProj,
        KdaParam::ALog,
        KdaParam::DtBias,
        KdaParam::ONorm,
        KdaParam::OProj,
    ];

    /// The checkpoint name inside the layer's attention module.
    pub fn name(self) -> &'static str {
        match self {
            KdaParam::QProj => "q_proj",
            KdaParam::KProj => "k_proj",
            KdaParam::VProj => "v_proj",
            KdaParam::QConv => "q_conv1d",
            KdaParam::KConv => "k_conv1d",
            KdaParam::VConv => "v_conv1d",
            KdaParam::BProj => "b_proj",
            KdaParam::FAProj => "f_a_proj",
            KdaParam::FBProj => "f_b_proj",
            KdaParam::GAProj => "g_a_proj",
            KdaParam::GBProj => "g_b_proj",
            KdaParam::ALog => "A_log",
            KdaParam::DtBias => "dt_bias",
            KdaParam::ONorm => "o_norm",
            KdaParam::OProj => "o_proj",
        }
    }
}

/// The slice of one full parameter that a rank loads.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSlice {
    /// The axis that is split (0 for everything but `o_proj`, whose input axis is 1).
    pub axis: usize,
    /// The indices along `axis` this rank holds.
    pub range: Range<usize>,
    /// The full length of `axis`.
    pub full: usize,
}

impl ParamSlice {
    /// Whether every rank holds the whole axis.
    pub fn is_replicated(&self) -> bool {
        self.range == (0..self.full)
    }
}

/// One block of a fused weight: rows `src_rows` of a checkpoint tensor land at `dst_rows`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FusedSegment {
    /// The checkpoint tensor.
    pub param: KdaParam,
    /// Rows of the full checkpoint tensor.
    pub src_rows: Range<usize>,
    /// Rows of the fused local weight.
    pub dst_rows: Range<usize>,
}

/// The rows of the fused input projection `W_in = vcat(Wq, Wk, Wv, Wb, Wfa, Wga)` on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FusedInputRows {
    /// `q, k, v, b, f_a, g_a`, back to back.
    pub segments: [FusedSegment; 6],
}

impl FusedInputRows {
    /// Sizes to split `x W_in^T` into `qkv, beta_raw, fg_a`: `[3P/A, H/A, 2D]`.
    pub fn split_sizes(&self) -> [usize; 3] {
        let len = |i: usize| self.segments[i].dst_rows.len();
        [len(0) + len(1) + len(2), len(3), len(4) + len(5)]
    }

    /// Rows of `W_in`: `3P/A + H/A + 2D`.
    pub fn rows(&self) -> usize {
        self.segments[5].dst_rows.end
    }
}

/// The paired gate weight `W_fgb = stack(Wfb, Wgb)`, `[2, P/A, D]`, on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FusedGateRows {
    /// Rows of `f_b_proj` stacked at index 0.
    pub f_b_rows: Range<usize>,
    /// Rows of `g_b_proj` stacked at index 1.
    pub g_b_rows: Range<usize>,
}

/// What one rank holds of a KDA layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KdaShard {
    shape: KdaShape,
    shard: Shard,
}

impl KdaShard {
    /// Part `shard` of a KDA layer of `shape`; use `ShardBy::AttentionTp` to get the shard.
    pub fn new(shape: KdaShape, shard: Shard) -> Result<Self> {
        shard.range(shape.num_heads)?;
        Ok(KdaShard { shape, shard })
    }

    /// The layer's shape.
    pub fn shape(&self) -> &KdaShape {
        &self.shape
    }

    /// The heads held, `H/A` of them.
    pub fn heads(&self) -> Range<usize> {
        let n = self.shape.num_heads / self.shard.count;
        self.shard.index * n..(self.shard.index + 1) * n
    }

    /// The channels held within each of the q, k and v blocks (heads × D).
    pub fn channels(&self) -> Range<usize> {
        let h = self.heads();
        h.start * self.shape.head_dim..h.end * self.shape.head_dim
    }

    /// The slice of `param` this rank loads (the spec's TP table).
    pub fn param(&self, param: KdaParam) -> ParamSlice {
        let p = self.shape.proj_dim();
        let d = self.shape.head_dim;
        let (axis, range, full) = match param {
            KdaParam::QProj
            | KdaParam::KProj
            | KdaParam::VProj
            | KdaParam::QConv
            | KdaParam::KConv
            | KdaParam::VConv
            | KdaParam::FBProj
            | KdaParam::GBProj
            | KdaParam::DtBias => (0, self.channels(), p),
            KdaParam::BProj | KdaParam::ALog => (0, self.heads(), self.shape.num_heads),
            KdaParam::FAProj | KdaParam::GAProj | KdaParam::ONorm => (0, 0..d, d),
            KdaParam::OProj => (1, self.channels(), p),
        };
        ParamSlice { axis, range, full }
    }

    /// Layout of the fused `[q|k|v|b|f_a|g_a]` input projection.
    pub fn fused_input_rows(&self) -> FusedInputRows {
        let mut at = 0;
        let mut seg = |param: KdaParam| {
            let src_rows = self.param(param).range;
            let dst_rows = at..at + src_rows.len();
            at = dst_rows.end;
            FusedSegment {
                param,
                src_rows,
                dst_rows,
            }
        };
        FusedInputRows {
            segments: [
                seg(KdaParam::QProj),
                seg(KdaParam::KProj),
                seg(KdaParam::VProj),
                seg(KdaParam::BProj),
                seg(KdaParam::FAProj),
                seg(KdaParam::GAProj),
            ],
        }
    }

    /// Layout of the paired `[f_b; g_b]` gate weight.
    pub fn fused_gate_rows(&self) -> FusedGateRows {
        FusedGateRows {
            f_b_rows: self.param(KdaParam::FBProj).range,
            g_b_rows: self.param(KdaParam::GBProj).range,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::ModelShape;

    const KDA: KdaShape = KdaShape {
        num_heads: 32,
        head_dim: 128,
        conv_kernel: 4,
    };

    #[test]
    fn shard_ranges_tile_the_length() {
        for count in [1, 2, 3, 4, 8] {
            let mut next = 0;
            for index in 0..count {
                let r = Shard::new(index, count)
                    .expect("index < count")
                    .range(24)
                    .expect("divisible");
                assert_eq!(r.start, next);
                assert_eq!(r.len(), 24 / count);
                next = r.end;
            }
            assert_eq!(next, 24);
        }
        assert_eq!(
            Shard::new(0, 5).expect("valid").range(24),
            Err(Error::NotDivisible { len: 24, count: 5 })
        );
        assert!(Shard::new(4, 4).is_err());
        assert!(Shard::new(0, 0).is_err());
        assert_eq!(head_range(32, 3, 4), Ok(24..32));
        assert_eq!(expert_range(256, 7, 8), Ok(224..256));
    }

    #[test]
    fn kda_params_follow_the_tp_table() {
        let s = KdaShard::new(KDA, Shard::new(1, 4).expect("valid")).expect("32 % 4 == 0");
        assert_eq!(s.heads(), 8..16);
        let p = 32 * 128;
        for q in [KdaParam::QProj, KdaParam::KProj, KdaParam::VProj] {
            assert_eq!(
                s.param(q),
                ParamSlice {
                    axis: 0,
                    range: 1024..2048,
                    full: p
                }
            );
        }
        for c in [KdaParam::QConv, KdaParam::KConv, KdaParam::VConv] {
            assert_eq!(s.param(c).range, 1024..2048);
        }
        assert_eq!(s.param(KdaParam::BProj).range, 8..16);
        assert_eq!(s.param(KdaParam::ALog).range, 8..16);
        assert_eq!(s.param(KdaParam::DtBias).range, 1024..2048);
        assert_eq!(s.param(KdaParam::FBProj).range, 1024..2048);
        assert_eq!(s.param(KdaParam::GBProj).range, 1024..2048);
        for r in [KdaParam::FAProj, KdaParam::GAProj, KdaParam::ONorm] {
            assert!(s.param(r).is_replicated(), "{} is replicated", r.name());
            assert_eq!(s.param(r).range, 0..128);
        }
        let o = s.param(KdaParam::OProj);
        assert!(!o.is_replicated());
        assert_eq!((o.axis, o.range), (1, 1024..2048));
        assert!(KdaShard::new(KDA, Shard::new(0, 3).expect("valid")).is_err());
    }

    #[test]
    fn fused_input_is_q_k_v_b_fa_ga() {
        let a = 4;
        let s = KdaShard::new(KDA, Shard::new(2, a).expect("valid")).expect("valid");
        let f = s.fused_input_rows();
        let (p, h, d) = (32 * 128, 32, 128);
        assert_eq!(f.split_sizes(), [3 * p / a, h / a, 2 * d]);
        assert_eq!(f.rows(), 3 * p / a + h / a + 2 * d);
        let names: Vec<_> = f.segments.iter().map(|s| s.param.name()).collect();
        assert_eq!(
            names,
            ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj"]
        );
        // Back to back, no gaps.
        let mut at = 0;
        for seg in &f.segments {
            assert_eq!(seg.dst_rows.start, at);
            assert_eq!(seg.dst_rows.len(), seg.src_rows.len());
            at = seg.dst_rows.end;
        }
        assert_eq!(f.segments[0].src_rows, 2048..3072);
        assert_eq!(f.segments[3].src_rows, 16..24);
        assert_eq!(f.segments[4].src_rows, 0..128);
        let g = s.fused_gate_rows();
        assert_eq!((g.f_b_rows, g.g_b_rows), (2048..3072, 2048..3072));
    }

    /// Under tp8×dp8 (A = 1) every rank is a whole attention replica. Sharding attention by the
    /// global TP rank gives each one an eighth of the heads: the shapes of the fused weight,
    /// conv and state no longer match, and the replica silently lacks 7/8 of its heads.
    #[test]
    fn global_tp_sharding_picks_wrong_heads_under_dp_attention() {
        let layout = Layout::new(8, 8, 1).expect("valid");
        layout
            .validate_for(&ModelShape {
                kda: Some(KDA),
                ..ModelShape::default()
            })
            .expect("valid");
        for rank in layout.ranks() {
            let right = ShardBy::AttentionTp.shard(&layout, rank).expect("in range");
            let wrong = ShardBy::GlobalTp.shard(&layout, rank).expect("in range");
            let right = KdaShard::new(KDA, right).expect("valid");
            let wrong = KdaShard::new(KDA, wrong).expect("valid");
            assert_eq!(right.heads(), 0..32, "rank {rank} must hold every head");
            assert_eq!(wrong.heads(), rank.0 * 4..rank.0 * 4 + 4);
            assert_ne!(right.heads(), wrong.heads());
            assert_ne!(
                right.fused_input_rows().split_sizes(),
                wrong.fused_input_rows().split_sizes()
            );
        }

        // tp8×dp2 (A = 4): rank 5 is attention-TP rank 1 of group 1.
        let layout = Layout::new(8, 2, 1).expect("valid");
        let right = ShardBy::AttentionTp
            .shard(&layout, Rank(5))
            .expect("in range");
        let wrong = ShardBy::GlobalTp.shard(&layout, Rank(5)).expect("in range");
        assert_eq!(head_range(32, right.index(), right.count()), Ok(8..16));
        assert_eq!(head_range(32, wrong.index(), wrong.count()), Ok(20..24));
        // Each attention-DP group must cover every head; global TP leaves both groups short.
        for dp_rank in 0..2 {
            let group = layout.attn_tp_group(dp_rank).expect("in range");
            let mut right_heads = 0;
            let mut wrong_heads = 0;
            for r in group {
                let count = |by: ShardBy| {
                    by.shard(&layout, Rank(r))
                        .and_then(|s| s.range(32))
                        .expect("valid")
                        .len()
                };
                right_heads += count(ShardBy::AttentionTp);
                wrong_heads += count(ShardBy::GlobalTp);
            }
            assert_eq!(right_heads, 32);
            assert_eq!(wrong_heads, 16);
        }
    }

    #[test]
    fn gqa_and_mlp_shards() {
        let g = GqaShape {
            num_attention_heads: 32,
            num_kv_heads: 8,
        };
        let s = gqa_shard(&g, Shard::new(3, 4).expect("valid")).expect("divisible");
        assert_eq!((s.q_heads, s.kv_heads), (24..32, 6..8));

        let layout = Layout::new(8, 8, 4).expect("valid");
        // Dense MLP ignores dp: split over all 8 ranks.
        let m = dense_mlp_shard(&layout, Rank(5), 9216).expect("divisible");
        assert_eq!(m.gate_up_rows, 5760..6912);
        assert_eq!(m.down_cols, 5760..6912);
        // ep4 over tp8: ranks 4 and 5 form EP rank 2 and hold experts 64..96, each split in two.
        let moe = MoeShape {
            num_experts: 128,
            intermediate_size: 1024,
        };
        let e = expert_shard(&layout, Rank(5), &moe).expect("valid");
        assert_eq!(e.experts, 64..96);
        assert_eq!(e.mlp.gate_up_rows, 512..1024);
        let e = expert_shard(&layout, Rank(4), &moe).expect("valid");
        assert_eq!((e.experts, e.mlp.gate_up_rows), (64..96, 0..512));
    }
}
