//! A worker group's layout, `tp × dp` plus `ep`, and where each rank sits in it.
//!
//! Numbering (DESIGN.md, Topology): with `A = tp / dp`,
//!
//! ```text
//! attn_tp_rank = rank % A        attn_dp_rank = rank / A
//! moe_tp_rank  = rank % (tp/ep)  ep_rank      = rank / (tp/ep)
//! ```
//!
//! so attention-TP groups are runs of `A` consecutive ranks. EP rule: expert-parallel ranks are
//! the TP group itself, cut into `ep` runs of `tp/ep` consecutive ranks; each run holds
//! `num_experts/ep` experts, tensor-parallel over its `tp/ep` ranks. Hence `ep` must divide
//! `tp` (`ep = tp` is pure EP, `ep = 1` pure TP MoE). This is SGLang's `moe_tp_size` rule.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::shape::ModelShape;

/// A rank's index in its worker group (`0..tp`), as opposed to its attention-TP rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Rank(pub usize);

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

fn one() -> usize {
    1
}

/// A layout as written in configuration; [`RawLayout::check`] turns it into a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLayout {
    /// Tensor-parallel size: ranks (devices) in the worker group.
    pub tp: usize,
    /// Attention data-parallel size (default 1).
    #[serde(default = "one")]
    pub dp: usize,
    /// Expert-parallel size (default 1).
    #[serde(default = "one")]
    pub ep: usize,
}

impl RawLayout {
    /// Checks the sizes against each other (not yet against a model: see
    /// [`Layout::validate_for`]).
    pub fn check(self) -> Result<Layout> {
        let RawLayout { tp, dp, ep } = self;
        for (what, n) in [("tp", tp), ("dp", dp), ("ep", ep)] {
            if n == 0 {
                return Err(Error::ZeroSize { what });
            }
        }
        if !tp.is_multiple_of(dp) {
            return Err(Error::TpNotDivisibleByDp { tp, dp });
        }
        if !tp.is_multiple_of(ep) {
            return Err(Error::EpNotDividingTp { tp, ep });
        }
        Ok(Layout { tp, dp, ep })
    }
}

/// A checked layout: `tp ≥ 1`, `dp | tp`, `ep | tp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawLayout", into = "RawLayout")]
pub struct Layout {
    tp: usize,
    dp: usize,
    ep: usize,
}

impl TryFrom<RawLayout> for Layout {
    type Error = Error;

    fn try_from(raw: RawLayout) -> Result<Self> {
        raw.check()
    }
}

impl From<Layout> for RawLayout {
    fn from(l: Layout) -> Self {
        RawLayout {
            tp: l.tp,
            dp: l.dp,
            ep: l.ep,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp{}×dp{} ep{} (attention TP {})",
            self.tp,
            self.dp,
            self.ep,
            self.attn_tp()
        )
    }
}

/// Where one rank sits in a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RankPosition {
    /// Index in the worker group, `0..tp`; also the rank in the full TP group.
    pub rank: Rank,
    /// Rank inside its attention-TP group, `0..A`: what attention shards by.
    pub attn_tp_rank: usize,
    /// Which attention-DP group (which set of requests), `0..dp`.
    pub attn_dp_rank: usize,
    /// Which expert shard, `0..ep`.
    pub ep_rank: usize,
    /// Rank inside the expert shard's TP group, `0..tp/ep`.
    pub moe_tp_rank: usize,
}

impl Layout {
    /// One rank: tp = dp = ep = 1.
    pub fn single() -> Self {
        Layout {
            tp: 1,
            dp: 1,
            ep: 1,
        }
    }

    /// Same as `RawLayout { tp, dp, ep }.check()`.
    pub fn new(tp: usize, dp: usize, ep: usize) -> Result<Self> {
        RawLayout { tp, dp, ep }.check()
    }

    /// Tensor-parallel size: ranks in the group.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Attention data-parallel size: attention-DP groups.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// Expert-parallel size.
    pub fn ep(&self) -> usize {
        self.ep
    }

    /// Attention-TP size `A = tp / dp`.
    pub fn attn_tp(&self) -> usize {
        self.tp / self.dp
    }

    /// TP size inside one expert shard, `tp / ep`.
    pub fn moe_tp(&self) -> usize {
        self.tp / self.ep
    }

    /// All ranks of the group.
    pub fn ranks(&self) -> impl Iterator<Item = Rank> {
        (0..self.tp).map(Rank)
    }

    /// Where `rank` sits.
    pub fn position(&self, rank: Rank) -> Result<RankPosition> {
        if rank.0 >= self.tp {
            return Err(Error::OutOfRange {
                what: "rank",
                index: rank.0,
                size: self.tp,
            });
        }
        let a = self.attn_tp();
        let m = self.moe_tp();
        Ok(RankPosition {
            rank,
            attn_tp_rank: rank.0 % a,
            attn_dp_rank: rank.0 / a,
            ep_rank: rank.0 / m,
            moe_tp_rank: rank.0 % m,
        })
    }

    /// The ranks of attention-DP group `attn_dp_rank`, in attention-TP order.
    pub fn attn_tp_group(&self, attn_dp_rank: usize) -> Result<Range<usize>> {
        if attn_dp_rank >= self.dp {
            return Err(Error::OutOfRange {
                what: "attn_dp_rank",
                index: attn_dp_rank,
                size: self.dp,
            });
        }
        let a = self.attn_tp();
        Ok(attn_dp_rank * a..(attn_dp_rank + 1) * a)
    }

    /// Checks that this layout can serve `shape`: every head count divisible by `A`, experts by
    /// `ep`, intermediate sizes by the ranks they are split over. Call at start-up.
    pub fn validate_for(&self, shape: &ModelShape) -> Result<()> {
        let heads = |what: &'static str, count: usize| -> Result<()> {
            if count == 0 {
                return Err(Error::ZeroSize { what });
            }
            if !count.is_multiple_of(self.attn_tp()) {
                return Err(Error::HeadsNotDivisible {
                    what,
                    count,
                    tp: self.tp,
                    dp: self.dp,
                    attn_tp: self.attn_tp(),
                });
            }
            Ok(())
        };
        let nonzero = |what: &'static str, n: usize| -> Result<()> {
            if n == 0 {
                Err(Error::ZeroSize { what })
            } else {
                Ok(())
            }
        };
        let split = |what: &'static str, size: usize, parts: usize, rule: &'static str| {
            nonzero(what, size)?;
            if !size.is_multiple_of(parts) {
                return Err(Error::IntermediateNotDivisible {
                    what,
                    size,
                    parts,
                    rule,
                });
            }
            Ok(())
        };

        if let Some(g) = &shape.gqa {
            heads("num_attention_heads", g.num_attention_heads)?;
            heads("num_kv_heads", g.num_kv_heads)?;
            if !g.num_attention_heads.is_multiple_of(g.num_kv_heads) {
                return Err(Error::GqaGroupNotWhole {
                    num_attention_heads: g.num_attention_heads,
                    num_kv_heads: g.num_kv_heads,
                });
            }
        }
        if let Some(k) = &shape.kda {
            heads("kda.num_heads", k.num_heads)?;
            nonzero("kda.head_dim", k.head_dim)?;
            nonzero("kda.conv_kernel", k.conv_kernel)?;
        }
        if let Some(m) = &shape.mla {
            heads("mla.num_heads", m.num_heads)?;
            nonzero("mla.kv_lora_rank", m.kv_lora_rank)?;
        }
        match &shape.moe {
            Some(moe) => {
                nonzero("moe.num_experts", moe.num_experts)?;
                if !moe.num_experts.is_multiple_of(self.ep) {
                    return Err(Error::ExpertsNotDivisible {
                        num_experts: moe.num_experts,
                        ep: self.ep,
                    });
                }
                split(
                    "moe.intermediate_size",
                    moe.intermediate_size,
                    self.moe_tp(),
                    "each expert is split over its expert shard's tp/ep ranks",
                )?;
            }
            None if self.ep > 1 => return Err(Error::EpWithoutExperts { ep: self.ep }),
            None => {}
        }
        if let Some(size) = shape.dense_intermediate_size {
            split(
                "dense_intermediate_size",
                size,
                self.tp,
                "dense MLP layers are split over the full TP group, tp",
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{GqaShape, KdaShape, MlaShape, MoeShape};

    fn kimi_like() -> ModelShape {
        ModelShape {
            gqa: None,
            kda: Some(KdaShape {
                num_heads: 32,
                head_dim: 128,
                conv_kernel: 4,
            }),
            mla: Some(MlaShape {
                num_heads: 32,
                kv_lora_rank: 512,
                rope_dim: 64,
            }),
            moe: Some(MoeShape {
                num_experts: 256,
                intermediate_size: 1024,
            }),
            dense_intermediate_size: Some(9216),
        }
    }

    #[test]
    fn numbering_follows_the_design() {
        let l = Layout::new(8, 2, 8).expect("valid");
        assert_eq!(l.attn_tp(), 4);
        let p = l.position(Rank(6)).expect("in range");
        assert_eq!((p.attn_tp_rank, p.attn_dp_rank), (2, 1));
        assert_eq!((p.ep_rank, p.moe_tp_rank), (6, 0));
        assert_eq!(l.attn_tp_group(1).expect("in range"), 4..8);

        let l = Layout::new(8, 8, 2).expect("valid");
        assert_eq!(l.attn_tp(), 1);
        let p = l.position(Rank(5)).expect("in range");
        assert_eq!((p.attn_tp_rank, p.attn_dp_rank), (0, 5));
        assert_eq!((p.ep_rank, p.moe_tp_rank), (1, 1));
        assert!(matches!(
            l.position(Rank(8)),
            Err(Error::OutOfRange {
                index: 8,
                size: 8,
                ..
            })
        ));
    }

    #[test]
    fn bad_sizes_are_rejected_with_the_numbers() {
        let e = Layout::new(8, 3, 1).expect_err("3 does not divide 8");
        assert_eq!(e, Error::TpNotDivisibleByDp { tp: 8, dp: 3 });
        assert!(e.to_string().contains("tp=8") && e.to_string().contains("dp=3"));

        let e = Layout::new(8, 1, 3).expect_err("3 does not divide 8");
        assert_eq!(e, Error::EpNotDividingTp { tp: 8, ep: 3 });
        assert!(e.to_string().contains("multiple of ep"));

        assert_eq!(
            Layout::new(4, 1, 8),
            Err(Error::EpNotDividingTp { tp: 4, ep: 8 })
        );
        assert_eq!(Layout::new(0, 1, 1), Err(Error::ZeroSize { what: "tp" }));
        assert_eq!(Layout::new(8, 0, 1), Err(Error::ZeroSize { what: "dp" }));
        assert_eq!(Layout::new(8, 1, 0), Err(Error::ZeroSize { what: "ep" }));
    }

    #[test]
    fn validate_for_checks_every_head_kind() {
        let shape = kimi_like();
        Layout::new(8, 1, 8)
            .expect("valid")
            .validate_for(&shape)
            .expect("tp8 ep8 serves kimi");
        Layout::new(8, 8, 8)
            .expect("valid")
            .validate_for(&shape)
            .expect("tp8 dp8 ep8 serves kimi");

        let mut odd_kda = shape.clone();
        odd_kda.kda = Some(KdaShape {
            num_heads: 12,
            head_dim: 128,
            conv_kernel: 4,
        });
        let e = Layout::new(8, 1, 8)
            .expect("valid")
            .validate_for(&odd_kda)
            .expect_err("12 heads over A=8");
        assert_eq!(
            e,
            Error::HeadsNotDivisible {
                what: "kda.num_heads",
                count: 12,
                tp: 8,
                dp: 1,
                attn_tp: 8
            }
        );
        assert!(e.to_string().contains("A = tp/dp = 8/1 = 8"));
        // The same heads fit once dp shrinks A to 2.
        Layout::new(8, 4, 8)
            .expect("valid")
            .validate_for(&odd_kda)
            .expect("12 heads over A=2");

        let mut odd_mla = shape.clone();
        odd_mla.mla = Some(MlaShape {
            num_heads: 6,
            kv_lora_rank: 512,
            rope_dim: 64,
        });
        assert!(matches!(
            Layout::new(4, 1, 4).expect("valid").validate_for(&odd_mla),
            Err(Error::HeadsNotDivisible {
                what: "mla.num_heads",
                ..
            })
        ));
    }

    #[test]
    fn validate_for_checks_gqa_experts_and_mlp() {
        let gqa = ModelShape {
            gqa: Some(GqaShape {
                num_attention_heads: 9,
                num_kv_heads: 3,
            }),
            dense_intermediate_size: Some(1536),
            ..ModelShape::default()
        };
        let l1 = Layout::new(1, 1, 1).expect("valid");
        assert_eq!(l1, Layout::single());
        l1.validate_for(&gqa).expect("tp1 serves anything");
        let l3 = Layout::new(3, 1, 1).expect("valid");
        l3.validate_for(&gqa)
            .expect("9 and 3 heads, 1536 channels over 3");
        let e = l3
            .validate_for(&ModelShape {
                dense_intermediate_size: Some(1000),
                ..gqa.clone()
            })
            .expect_err("1000 channels over tp3");
        assert!(matches!(
            e,
            Error::IntermediateNotDivisible {
                size: 1000,
                parts: 3,
                ..
            }
        ));
        assert!(e.to_string().contains("full TP group"));

        let e = Layout::new(2, 1, 1)
            .expect("valid")
            .validate_for(&gqa)
            .expect_err("9 heads over 2");
        assert!(matches!(
            e,
            Error::HeadsNotDivisible {
                what: "num_attention_heads",
                count: 9,
                ..
            }
        ));

        let bad_group = ModelShape {
            gqa: Some(GqaShape {
                num_attention_heads: 8,
                num_kv_heads: 3,
            }),
            ..ModelShape::default()
        };
        assert!(matches!(
            l1.validate_for(&bad_group),
            Err(Error::GqaGroupNotWhole { .. })
        ));

        let e = Layout::new(8, 1, 8)
            .expect("valid")
            .validate_for(&ModelShape {
                moe: Some(MoeShape {
                    num_experts: 60,
                    intermediate_size: 1024,
                }),
                ..ModelShape::default()
            })
            .expect_err("60 experts over ep8");
        assert_eq!(
            e,
            Error::ExpertsNotDivisible {
                num_experts: 60,
                ep: 8
            }
        );
        assert!(e.to_string().contains("num_experts=60") && e.to_string().contains("ep=8"));

        let e = Layout::new(8, 1, 2)
            .expect("valid")
            .validate_for(&ModelShape {
                moe: Some(MoeShape {
                    num_experts: 64,
                    intermediate_size: 1030,
                }),
                ..ModelShape::default()
            })
            .expect_err("1030 over tp/ep = 4");
        assert!(matches!(
            e,
            Error::IntermediateNotDivisible {
                size: 1030,
                parts: 4,
                ..
            }
        ));

        assert_eq!(
            Layout::new(3, 1, 3).expect("valid").validate_for(&gqa),
            Err(Error::EpWithoutExperts { ep: 3 })
        );
        assert!(matches!(
            Layout::new(1, 1, 1)
                .expect("valid")
                .validate_for(&ModelShape {
                    kda: Some(KdaShape {
                        num_heads: 4,
                        head_dim: 0,
                        conv_kernel: 4
                    }),
                    ..ModelShape::default()
                }),
            Err(Error::ZeroSize {
                what: "kda.head_dim"
            })
        ));
    }

    #[test]
    fn serde_checks_on_the_way_in() {
        let l: Layout = serde_json::from_str(r#"{"tp": 8, "dp": 2}"#).expect("valid");
        assert_eq!((l.tp(), l.dp(), l.ep(), l.attn_tp()), (8, 2, 1, 4));
        let e = serde_json::from_str::<Layout>(r#"{"tp": 8, "dp": 3}"#).expect_err("invalid");
        assert!(e.to_string().contains("tp=8 is not divisible by dp=3"));
        let e = serde_json::from_str::<RawLayout>(r#"{"tp": 8, "pp": 2}"#).expect_err("unknown");
        assert!(e.to_string().contains("pp"));
        let back = serde_json::to_string(&l).expect("serializes");
        assert_eq!(back, r#"{"tp":8,"dp":2,"ep":1}"#);
    }
}
