//! A KDA layer's projections of its input, separate or fused (shared/specs/kda.md, "Fused
//! projections").
//!
//! Two groups fuse independently:
//! - the input GEMM `W_in = vcat(Wq[ra], Wk[ra], Wv[ra], Wb[ra], Wfa, Wga)`
//!   `[3P/A + H/A + 2D, hidden]`: one GEMM instead of six, its output split per row;
//! - the paired gate `W_fgb = stack(Wfb[ra], Wgb[ra])` `[2, P/A, D]`: one contiguous buffer
//!   and one batched matmul (on the CPU, two GEMMs over one allocation) instead of two Linears.
//!
//! f_a and g_a are replicated, everything else is sharded by the attention-TP rank `ra` of `A`
//! — never the global TP rank: under tp8×dp8 (`A = 1`) each rank is a whole replica. Whether a
//! group fuses is decided per layer from the ORIGINAL tensors (quantization ignore list, LoRA
//! targets, stored dtypes) by [`tandem_model::fusion::decide`]; both forms give the same
//! numbers, which the tests check. The fused buffers are single tensors owned here so a weight
//! refresh can rewrite them in place (stable addresses for captured CUDA graphs).

use crate::backend::hybrid::{At, HybridOps};
use crate::backend::{Linear, Ops};
use crate::tensor::{DType, Tensor};

/// The projections of a KDA layer's input.
#[derive(Debug)]
pub enum KdaInputProjection<B: Ops> {
    /// The checkpoint's six separate matrices, one GEMM each.
    Separate {
        /// `q_proj` `[P/A, hidden]`.
        q: Linear<B>,
        /// `k_proj` `[P/A, hidden]`.
        k: Linear<B>,
        /// `v_proj` `[P/A, hidden]`.
        v: Linear<B>,
        /// `b_proj` `[H/A, hidden]`.
        b: Linear<B>,
        /// `f_a_proj` `[D, hidden]` (replicated).
        f_a: Linear<B>,
        /// `g_a_proj` `[D, hidden]` (replicated).
        g_a: Linear<B>,
    },
    /// One GEMM over `vcat(q, k, v, b, f_a, g_a)`.
    Fused {
        /// `W_in` `[3P/A + H/A + 2D, hidden]`.
        weight: Linear<B>,
        /// Output widths of the six parts, in fused order.
        split: [usize; 6],
    },
}

/// The input projections of `T` tokens, split, token-major.
#[derive(Debug)]
pub struct KdaProjected<B: Ops> {
    /// Pre-conv q `[T, P/A]`.
    pub q: Tensor<B>,
    /// Pre-conv k `[T, P/A]`.
    pub k: Tensor<B>,
    /// Pre-conv v `[T, P/A]`.
    pub v: Tensor<B>,
    /// β logits `[T, H/A]`.
    pub beta_logits: Tensor<B>,
    /// Decay-gate low-rank activations `[T, D]`.
    pub f_a: Tensor<B>,
    /// Output-gate low-rank activations `[T, D]`.
    pub g_a: Tensor<B>,
}

/// `x · Wᵀ` for `rows` rows into a new `[rows, out]` f32 tensor.
pub(crate) fn project<B: Ops>(b: &B, x: &Tensor<B>, rows: usize, w: &Linear<B>) -> Tensor<B> {
    let mut out = b.zeros(DType::F32, &[rows, w.out_features]);
    if rows > 0 {
        b.linear(x, rows, w, &mut out, false);
    }
    out
}

/// Columns `at..at + width` of `rows` rows of `src` (rows `stride` wide), as a new tensor.
pub(crate) fn columns<B: HybridOps>(
    b: &B,
    src: &Tensor<B>,
    rows: usize,
    from: At,
    width: usize,
) -> Tensor<B> {
    let mut out = b.zeros(DType::F32, &[rows, width]);
    b.copy_block(src, from, &mut out, At::col(0, width), rows, width);
    out
}

impl<B: HybridOps> KdaInputProjection<B> {
    /// Builds the fused form from the six (already sharded) host matrices, in fused order,
    /// as one weight on `backend` in `dtype`.
    pub(crate) fn fuse(
        parts: [crate::backend::host::Linear<Vec<f32>>; 6],
        up: &super::loading::Upload<'_, B>,
    ) -> Self {
        let in_features = parts[0].in_features;
        debug_assert!(parts.iter().all(|p| p.in_features == in_features));
        let split = parts.each_ref().map(|p| p.out_features);
        let mut weight = Vec::with_capacity(split.iter().sum::<usize>() * in_features);
        for p in &parts {
            weight.extend_from_slice(&p.weight);
        }
        Self::Fused {
            weight: up.linear(crate::backend::host::Linear {
                weight,
                out_features: split.iter().sum(),
                in_features,
            }),
            split,
        }
    }

    /// Whether this is the fused form.
    pub fn is_fused(&self) -> bool {
        matches!(self, Self::Fused { .. })
    }

    /// Projects `rows` rows of `x`.
    pub fn project(&self, b: &B, x: &Tensor<B>, rows: usize) -> KdaProjected<B> {
        match self {
            Self::Separate {
                q,
                k,
                v,
                b: beta,
                f_a,
                g_a,
            } => KdaProjected {
                q: project(b, x, rows, q),
                k: project(b, x, rows, k),
                v: project(b, x, rows, v),
                beta_logits: project(b, x, rows, beta),
                f_a: project(b, x, rows, f_a),
                g_a: project(b, x, rows, g_a),
            },
            Self::Fused { weight, split } => {
                let all = project(b, x, rows, weight);
                let stride = weight.out_features;
                let mut at = 0;
                let [q, k, v, beta_logits, f_a, g_a] = split.map(|n| {
                    let part = columns(b, &all, rows, At::col(at, stride), n);
                    at += n;
                    part
                });
                KdaProjected {
                    q,
                    k,
                    v,
                    beta_logits,
                    f_a,
                    g_a,
                }
            }
        }
    }
}

/// The up-projections of the two low-rank gates: `f_b` (decay) and `g_b` (output gate).
#[derive(Debug)]
pub enum KdaGateProjection<B: Ops> {
    /// Two separate Linears `[P/A, D]`.
    Separate {
        /// `f_b_proj`.
        f_b: Linear<B>,
        /// `g_b_proj`.
        g_b: Linear<B>,
    },
    /// `stack(f_b, g_b)` `[2, P/A, D]` in one buffer, applied as one batched matmul.
    Paired {
        /// The stacked weight `[2·P/A, D]`.
        weight: Linear<B>,
        /// `P/A`.
        out: usize,
        /// `D`.
        d: usize,
    },
}

impl<B: HybridOps> KdaGateProjection<B> {
    /// Stacks the two (already sharded) host matrices into one weight on `backend`.
    pub(crate) fn pair(
        f_b: crate::backend::host::Linear<Vec<f32>>,
        g_b: crate::backend::host::Linear<Vec<f32>>,
        up: &super::loading::Upload<'_, B>,
    ) -> Self {
        debug_assert_eq!(
            (f_b.out_features, f_b.in_features),
            (g_b.out_features, g_b.in_features)
        );
        let (out, d) = (f_b.out_features, f_b.in_features);
        Self::Paired {
            weight: up.linear(crate::backend::host::Linear {
                weight: [f_b.weight, g_b.weight].concat(),
                out_features: 2 * out,
                in_features: d,
            }),
            out,
            d,
        }
    }

    /// Whether this is the paired form.
    pub fn is_paired(&self) -> bool {
        matches!(self, Self::Paired { .. })
    }

    /// `(f_a · f_bᵀ, g_a · g_bᵀ)` for `rows` rows, each `[rows, P/A]`.
    pub fn apply(
        &self,
        b: &B,
        f_a: &Tensor<B>,
        g_a: &Tensor<B>,
        rows: usize,
    ) -> (Tensor<B>, Tensor<B>) {
        match self {
            Self::Separate { f_b, g_b } => (project(b, f_a, rows, f_b), project(b, g_a, rows, g_b)),
            Self::Paired { weight, out, d } => {
                // One GEMM over the one stacked buffer: rows `[f_a; g_a]` (2T × D) against
                // `[f_b; g_b]` (2P/A × D); the two diagonal blocks are the batched product.
                // (The CPU GEMM takes no offset into a weight; the off-diagonal blocks are
                // the price of keeping it one call over one allocation, as a GPU bmm is.)
                let (out, d) = (*out, *d);
                let mut stacked = b.zeros(DType::F32, &[2 * rows, d]);
                b.copy_block(f_a, At::col(0, d), &mut stacked, At::col(0, d), rows, d);
                let below = At {
                    row: rows,
                    col: 0,
                    stride: d,
                };
                b.copy_block(g_a, At::col(0, d), &mut stacked, below, rows, d);
                let y = project(b, &stacked, 2 * rows, weight);
                let f = columns(b, &y, rows, At::col(0, 2 * out), out);
                let g_at = At {
                    row: rows,
                    col: out,
                    stride: 2 * out,
                };
                let g = columns(b, &y, rows, g_at, out);
                (f, g)
            }
        }
    }
}
