//! The prefill → decode transfer plan: which prefill rank sends which part of a request's
//! per-layer state to which decode rank, when the two sides have different layouts.
//!
//! One attention-DP group of the prefill side (the one that served the request) sends to one
//! attention-DP group of the decode side (the one chosen for it). Inside them, head-sharded
//! state moves by intersecting head ranges: decode attention-TP rank `j` of `A_d` needs heads
//! `j·H/A_d ..`, prefill rank `i` of `A_p` holds `i·H/A_p ..`, and each non-empty
//! intersection is one [`Transfer`]. Because the prefill ranks of one group partition the
//! heads, every decode head arrives exactly once, from exactly one prefill rank.
//!
//! The plan is layer-agnostic: every KDA layer (and every GQA / MLA layer) of the model moves
//! the same way, so a plan is computed once per request and applied to each layer.
//!
//! Decisions:
//!
//! - **KDA conv windows move per q/k/v block.** The window is three `[P/A, W-1]` blocks; a
//!   concatenated `[3P/A, W-1]` window split by rows would hand a decode rank q channels in
//!   place of k channels whenever `A_p ≠ A_d`. Each block gets its own transfers.
//! - **MLA latent goes once to each decode rank, never once per prefill attention-TP rank.**
//!   The latent is replicated across attention TP on both sides, so the prefill group holds
//!   `A_p` identical copies and each decode rank needs one. We send exactly one copy to each
//!   decode rank of the group, directly, rather than one copy to the group that the decode side
//!   then broadcasts in-process: the transport writes straight into each rank's own paged pool,
//!   the decode ranks become ready independently, and the KV transfer stays independent of the
//!   decode side's communicators. Under decode DP attention (`A_d = 1`, the common decode
//!   layout) that is a single copy per request, as the spec asks. The copy for decode rank `d`
//!   comes from prefill attention-TP rank `d mod A_p`, spreading the sends over the prefill
//!   ranks' NICs instead of loading rank 0 with all of them.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::layout::{Layout, Rank};
use crate::shape::ModelShape;
use crate::shard::Shard;

/// One of the three blocks of a KDA conv window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ConvBlock {
    /// The pre-conv q projection inputs.
    Q,
    /// The pre-conv k projection inputs.
    K,
    /// The pre-conv v projection inputs.
    V,
}

impl ConvBlock {
    /// The three blocks in order.
    pub const ALL: [ConvBlock; 3] = [ConvBlock::Q, ConvBlock::K, ConvBlock::V];
}

/// What a [`Transfer`] carries, with the global range it covers.
///
/// The unit of `src_range`/`dst_range` depends on the kind and is given on each variant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransferKind {
    /// KDA recurrent state; unit: heads, each a `[D, D]` fp32 matrix per KDA layer.
    KdaState {
        /// Global heads carried.
        heads: Range<usize>,
    },
    /// KDA conv window of one block; unit: channels of that block, each `W - 1` values per
    /// KDA layer.
    KdaConv {
        /// Which block.
        block: ConvBlock,
        /// Global channels of the block carried (`heads × D`).
        channels: Range<usize>,
    },
    /// GQA K and V cache; unit: KV heads, per token per layer, both K and V.
    GqaKv {
        /// Global KV heads carried.
        kv_heads: Range<usize>,
    },
    /// MLA latent cache; unit: values of the per-token latent (`kv_lora_rank + rope_dim`),
    /// always the whole latent.
    MlaLatent,
}

/// One piece of a request's state moving from one prefill rank to one decode rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Transfer {
    /// Sender, a rank of the prefill worker group.
    pub from_prefill_rank: Rank,
    /// Receiver, a rank of the decode worker group.
    pub to_decode_rank: Rank,
    /// What moves.
    pub kind: TransferKind,
    /// Where it is in the sender's local state (unit: see [`TransferKind`]).
    pub src_range: Range<usize>,
    /// Where it goes in the receiver's local state; same length as `src_range`.
    pub dst_range: Range<usize>,
}

/// Every transfer for one request, grouped by decode rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPlan {
    prefill_ranks: Range<usize>,
    decode_ranks: Range<usize>,
    transfers: Vec<Transfer>,
}

impl TransferPlan {
    /// Plans moving a request from prefill attention-DP group `prefill_dp_rank` (the one that
    /// served it; 0 when prefill has `dp = 1`) to decode attention-DP group `decode_dp_rank`.
    ///
    /// Both layouts are validated against `shape` first.
    pub fn new(
        prefill: &Layout,
        decode: &Layout,
        shape: &ModelShape,
        prefill_dp_rank: usize,
        decode_dp_rank: usize,
    ) -> Result<Self> {
        prefill.validate_for(shape)?;
        decode.validate_for(shape)?;
        let prefill_ranks = prefill.attn_tp_group(prefill_dp_rank)?;
        let decode_ranks = decode.attn_tp_group(decode_dp_rank)?;
        let (a_p, a_d) = (prefill.attn_tp(), decode.attn_tp());

        let mut transfers = Vec::new();
        for j in 0..a_d {
            let to = Rank(decode_ranks.start + j);
            let mut split = |len: usize, kind: &dyn Fn(Range<usize>) -> TransferKind| {
                split_by_heads(
                    len,
                    prefill_ranks.start,
                    a_p,
                    to,
                    j,
                    a_d,
                    kind,
                    &mut transfers,
                )
            };
            if let Some(kda) = &shape.kda {
                split(kda.num_heads, &|heads| TransferKind::KdaState { heads })?;
                for block in ConvBlock::ALL {
                    split(kda.proj_dim(), &|channels| TransferKind::KdaConv {
                        block,
                        channels,
                    })?;
                }
            }
            if let Some(gqa) = &shape.gqa {
                split(gqa.num_kv_heads, &|kv_heads| TransferKind::GqaKv {
                    kv_heads,
                })?;
            }
            if let Some(mla) = &shape.mla {
                let latent = 0..mla.latent_dim();
                transfers.push(Transfer {
                    from_prefill_rank: Rank(prefill_ranks.start + to.0 % a_p),
                    to_decode_rank: to,
                    kind: TransferKind::MlaLatent,
                    src_range: latent.clone(),
                    dst_range: latent,
                });
            }
        }
        Ok(TransferPlan {
            prefill_ranks,
            decode_ranks,
            transfers,
        })
    }

    /// Every transfer: by decode rank, then kind (KDA state, conv q/k/v, GQA, MLA), then
    /// prefill rank.
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// The sending prefill ranks (the serving attention-DP group).
    pub fn prefill_ranks(&self) -> Range<usize> {
        self.prefill_ranks.clone()
    }

    /// The receiving decode ranks (the chosen attention-DP group).
    pub fn decode_ranks(&self) -> Range<usize> {
        self.decode_ranks.clone()
    }

    /// What `rank` sends.
    pub fn sent_by(&self, rank: Rank) -> impl Iterator<Item = &Transfer> {
        self.transfers
            .iter()
            .filter(move |t| t.from_prefill_rank == rank)
    }

    /// What `rank` receives.
    pub fn received_by(&self, rank: Rank) -> impl Iterator<Item = &Transfer> {
        self.transfers
            .iter()
            .filter(move |t| t.to_decode_rank == rank)
    }
}

/// Appends the transfers that give decode rank `to` (attention-TP rank `j` of `a_d`) its part
/// of `0..len`, from the prefill group starting at `p_base` with `a_p` ranks.
#[allow(clippy::too_many_arguments)]
fn split_by_heads(
    len: usize,
    p_base: usize,
    a_p: usize,
    to: Rank,
    j: usize,
    a_d: usize,
    kind: &dyn Fn(Range<usize>) -> TransferKind,
    out: &mut Vec<Transfer>,
) -> Result<()> {
    let dst = Shard::new(j, a_d)?.range(len)?;
    for i in 0..a_p {
        let src = Shard::new(i, a_p)?.range(len)?;
        let overlap = src.start.max(dst.start)..src.end.min(dst.end);
        if overlap.is_empty() {
            continue;
        }
        out.push(Transfer {
            from_prefill_rank: Rank(p_base + i),
            to_decode_rank: to,
            kind: kind(overlap.clone()),
            src_range: overlap.start - src.start..overlap.end - src.start,
            dst_range: overlap.start - dst.start..overlap.end - dst.start,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::shape::{GqaShape, KdaShape, MlaShape};

    fn shape() -> ModelShape {
        ModelShape {
            gqa: Some(GqaShape {
                num_attention_heads: 16,
                num_kv_heads: 8,
            }),
            kda: Some(KdaShape {
                num_heads: 8,
                head_dim: 4,
                conv_kernel: 4,
            }),
            mla: Some(MlaShape {
                num_heads: 8,
                kv_lora_rank: 6,
                rope_dim: 2,
            }),
            moe: None,
            dense_intermediate_size: Some(64),
        }
    }

    fn layout(tp: usize, dp: usize) -> Layout {
        Layout::new(tp, dp, 1).expect("valid test layout")
    }

    /// The kind with its global range removed, so transfers of one "stream" group together.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    enum Stream {
        State,
        Conv(ConvBlock),
        Gqa,
        Mla,
    }

    fn stream(kind: &TransferKind) -> (Stream, Option<Range<usize>>) {
        match kind {
            TransferKind::KdaState { heads } => (Stream::State, Some(heads.clone())),
            TransferKind::KdaConv { block, channels } => {
                (Stream::Conv(*block), Some(channels.clone()))
            }
            TransferKind::GqaKv { kv_heads } => (Stream::Gqa, Some(kv_heads.clone())),
            TransferKind::MlaLatent => (Stream::Mla, None),
        }
    }

    /// Checks every property a plan must have; returns the number of transfers checked.
    fn check(p: &Layout, d: &Layout, shape: &ModelShape, pdp: usize, ddp: usize) -> usize {
        let plan = TransferPlan::new(p, d, shape, pdp, ddp).expect("valid plan");
        let (a_p, a_d) = (p.attn_tp(), d.attn_tp());
        let ctx = format!("P {p} group {pdp} -> D {d} group {ddp}");
        assert_eq!(plan.prefill_ranks(), pdp * a_p..(pdp + 1) * a_p, "{ctx}");
        assert_eq!(plan.decode_ranks(), ddp * a_d..(ddp + 1) * a_d, "{ctx}");

        // (stream, full length) of every head-sharded stream the model has.
        let mut streams = Vec::new();
        if let Some(k) = &shape.kda {
            streams.push((Stream::State, k.num_heads));
            for b in ConvBlock::ALL {
                streams.push((Stream::Conv(b), k.proj_dim()));
            }
        }
        if let Some(g) = &shape.gqa {
            streams.push((Stream::Gqa, g.num_kv_heads));
        }

        for t in plan.transfers() {
            assert!(
                plan.prefill_ranks().contains(&t.from_prefill_rank.0),
                "{ctx}: {t:?}"
            );
            assert!(
                plan.decode_ranks().contains(&t.to_decode_rank.0),
                "{ctx}: {t:?}"
            );
            assert_eq!(t.src_range.len(), t.dst_range.len(), "{ctx}: {t:?}");
            assert!(!t.src_range.is_empty(), "{ctx}: {t:?}");
        }

        for to in plan.decode_ranks().map(Rank) {
            let j = d.position(to).expect("in range").attn_tp_rank;
            let received: Vec<_> = plan.received_by(to).collect();
            for &(s, len) in &streams {
                let local = len / a_d;
                let mut dsts: Vec<_> = received
                    .iter()
                    .filter(|t| stream(&t.kind).0 == s)
                    .map(|t| {
                        let global = stream(&t.kind).1.expect("head-sharded");
                        let i = p
                            .position(t.from_prefill_rank)
                            .expect("in range")
                            .attn_tp_rank;
                        // Source in bounds of what the sender holds, and consistent with it.
                        assert!(t.src_range.end <= len / a_p, "{ctx}: {t:?}");
                        assert_eq!(global.start, i * (len / a_p) + t.src_range.start);
                        assert_eq!(global.start, j * local + t.dst_range.start);
                        assert_eq!(global.len(), t.dst_range.len());
                        t.dst_range.clone()
                    })
                    .collect();
                dsts.sort_by_key(|r| r.start);
                // Exactly once: the destination ranges tile 0..local with no gap or overlap.
                let mut at = 0;
                for r in &dsts {
                    assert_eq!(r.start, at, "{ctx}: {s:?} to {to}: gap or overlap");
                    at = r.end;
                }
                assert_eq!(at, local, "{ctx}: {s:?} to {to} incomplete");
                // One sender per piece, and no sender twice for the same stream.
                let mut senders: Vec<_> = received
                    .iter()
                    .filter(|t| stream(&t.kind).0 == s)
                    .map(|t| t.from_prefill_rank)
                    .collect();
                let n = senders.len();
                senders.sort();
                senders.dedup();
                assert_eq!(senders.len(), n, "{ctx}");
            }
            let mla: Vec<_> = received
                .iter()
                .filter(|t| t.kind == TransferKind::MlaLatent)
                .collect();
            match &shape.mla {
                Some(m) => {
                    assert_eq!(mla.len(), 1, "{ctx}: MLA latent exactly once to {to}");
                    assert_eq!(mla[0].src_range, 0..m.latent_dim());
                    assert_eq!(mla[0].dst_range, 0..m.latent_dim());
                }
                None => assert!(mla.is_empty()),
            }
            // Nothing of a kind the model lacks.
            for t in &received {
                let s = stream(&t.kind).0;
                assert!(
                    s == Stream::Mla || streams.iter().any(|&(x, _)| x == s),
                    "{ctx}: unexpected {t:?}"
                );
            }
        }
        if shape.mla.is_some() {
            let mla = plan
                .transfers()
                .iter()
                .filter(|t| t.kind == TransferKind::MlaLatent)
                .count();
            assert_eq!(mla, a_d, "{ctx}: one latent copy per decode rank");
        }
        plan.transfers().len()
    }

    const LAYOUTS: [(usize, usize); 11] = [
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        (2, 2),
        (4, 4),
        (8, 8),
        (8, 2),
        (4, 2),
        (8, 4),
        (16, 2),
    ];

    #[test]
    fn every_head_arrives_exactly_once_for_all_layouts() {
        let shapes = [
            shape(),
            ModelShape {
                gqa: None,
                ..shape()
            },
            ModelShape {
                kda: None,
                mla: None,
                ..shape()
            },
            ModelShape {
                gqa: Some(GqaShape {
                    num_attention_heads: 48,
                    num_kv_heads: 16,
                }),
                kda: Some(KdaShape {
                    num_heads: 16,
                    head_dim: 3,
                    conv_kernel: 4,
                }),
                ..shape()
            },
        ];
        let mut plans = 0;
        let mut transfers = 0;
        for s in &shapes {
            for &(ptp, pdp) in &LAYOUTS {
                for &(dtp, ddp) in &LAYOUTS {
                    let (p, d) = (layout(ptp, pdp), layout(dtp, ddp));
                    if p.validate_for(s).is_err() || d.validate_for(s).is_err() {
                        continue;
                    }
                    for pg in 0..pdp {
                        for dg in 0..ddp {
                            transfers += check(&p, &d, s, pg, dg);
                            plans += 1;
                        }
                    }
                }
            }
        }
        assert!(plans > 1000, "checked {plans} plans");
        assert!(transfers > plans);
    }

    #[test]
    fn p_tp2_to_d_tp2_dp2() {
        let s = ModelShape {
            gqa: None,
            ..shape()
        };
        let plan = TransferPlan::new(&layout(2, 1), &layout(2, 2), &s, 0, 1).expect("valid");
        assert_eq!(plan.decode_ranks(), 1..2);
        let t = |from, kind, src: Range<usize>, dst: Range<usize>| Transfer {
            from_prefill_rank: Rank(from),
            to_decode_rank: Rank(1),
            kind,
            src_range: src,
            dst_range: dst,
        };
        let conv = |block, from: usize| {
            let c = from * 16..from * 16 + 16;
            t(
                from,
                TransferKind::KdaConv {
                    block,
                    channels: c.clone(),
                },
                0..16,
                c,
            )
        };
        let expected = vec![
            t(0, TransferKind::KdaState { heads: 0..4 }, 0..4, 0..4),
            t(1, TransferKind::KdaState { heads: 4..8 }, 0..4, 4..8),
            conv(ConvBlock::Q, 0),
            conv(ConvBlock::Q, 1),
            conv(ConvBlock::K, 0),
            conv(ConvBlock::K, 1),
            conv(ConvBlock::V, 0),
            conv(ConvBlock::V, 1),
            // Decode rank 1 takes its single latent copy from prefill rank 1 mod 2 = 1.
            t(1, TransferKind::MlaLatent, 0..8, 0..8),
        ];
        assert_eq!(plan.transfers(), expected.as_slice());
        assert_eq!(plan.sent_by(Rank(0)).count(), 4);
        assert_eq!(plan.sent_by(Rank(1)).count(), 5);
    }

    #[test]
    fn p_tp4_to_d_tp4_dp4() {
        let s = shape();
        for ddp in 0..4 {
            let plan = TransferPlan::new(&layout(4, 1), &layout(4, 4), &s, 0, ddp).expect("valid");
            let to = Rank(ddp);
            assert_eq!(plan.decode_ranks(), ddp..ddp + 1);
            // A_d = 1: the decode rank holds everything, assembled from all four prefill ranks.
            let state: Vec<_> = plan
                .received_by(to)
                .filter(|t| matches!(t.kind, TransferKind::KdaState { .. }))
                .map(|t| {
                    (
                        t.from_prefill_rank.0,
                        t.src_range.clone(),
                        t.dst_range.clone(),
                    )
                })
                .collect();
            assert_eq!(
                state,
                vec![
                    (0, 0..2, 0..2),
                    (1, 0..2, 2..4),
                    (2, 0..2, 4..6),
                    (3, 0..2, 6..8)
                ]
            );
            for block in ConvBlock::ALL {
                let conv: Vec<_> = plan
                    .received_by(to)
                    .filter(
                        |t| matches!(t.kind, TransferKind::KdaConv { block: b, .. } if b == block),
                    )
                    .map(|t| (t.src_range.clone(), t.dst_range.clone()))
                    .collect();
                assert_eq!(
                    conv,
                    vec![(0..8, 0..8), (0..8, 8..16), (0..8, 16..24), (0..8, 24..32)]
                );
            }
            let gqa = plan
                .received_by(to)
                .filter(|t| matches!(t.kind, TransferKind::GqaKv { .. }))
                .count();
            assert_eq!(gqa, 4);
            let mla: Vec<_> = plan
                .received_by(to)
                .filter(|t| t.kind == TransferKind::MlaLatent)
                .collect();
            assert_eq!(mla.len(), 1, "sent once, not once per prefill rank");
            assert_eq!(mla[0].from_prefill_rank, Rank(ddp % 4));
        }
    }

    #[test]
    fn conv_blocks_never_cross() {
        // P A=1 -> D A=2: a concatenated [q|k|v] window split in half would give decode rank 1
        // the tail of k and all of v. Per-block plans give it the second half of each block.
        let s = ModelShape {
            gqa: None,
            mla: None,
            ..shape()
        };
        let plan = TransferPlan::new(&layout(1, 1), &layout(2, 1), &s, 0, 0).expect("valid");
        let conv: Vec<_> = plan
            .received_by(Rank(1))
            .filter_map(|t| match &t.kind {
                TransferKind::KdaConv { block, channels } => {
                    Some((*block, channels.clone(), t.src_range.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            conv,
            vec![
                (ConvBlock::Q, 16..32, 16..32),
                (ConvBlock::K, 16..32, 16..32),
                (ConvBlock::V, 16..32, 16..32),
            ]
        );
    }

    #[test]
    fn invalid_requests_are_rejected() {
        let s = shape();
        assert!(matches!(
            TransferPlan::new(&layout(2, 1), &layout(2, 2), &s, 0, 2),
            Err(Error::OutOfRange {
                what: "attn_dp_rank",
                ..
            })
        ));
        assert!(matches!(
            TransferPlan::new(&layout(2, 1), &layout(2, 2), &s, 1, 0),
            Err(Error::OutOfRange { .. })
        ));
        let odd = ModelShape {
            kda: Some(KdaShape {
                num_heads: 6,
                head_dim: 4,
                conv_kernel: 4,
            }),
            gqa: None,
            mla: None,
            ..shape()
        };
        assert!(matches!(
            TransferPlan::new(&layout(2, 1), &layout(4, 1), &odd, 0, 0),
            Err(Error::HeadsNotDivisible { count: 6, .. })
        ));
    }
}
