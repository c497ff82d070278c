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
//! numbers, which the tests check. The fused buffers are plain `Vec`s owned here so a weight
//! refresh can rewrite them in place (stable addresses for captured CUDA graphs).

use super::ops::linear;
use crate::backend::host::{self, Linear};

/// The projections of a KDA layer's input.
#[derive(Debug)]
pub enum KdaInputProjection {
    /// The checkpoint's six separate matrices, one GEMM each.
    Separate {
        /// `q_proj` `[P/A, hidden]`.
        q: Linear<Vec<f32>>,
        /// `k_proj` `[P/A, hidden]`.
        k: Linear<Vec<f32>>,
        /// `v_proj` `[P/A, hidden]`.
        v: Linear<Vec<f32>>,
        /// `b_proj` `[H/A, hidden]`.
        b: Linear<Vec<f32>>,
        /// `f_a_proj` `[D, hidden]` (replicated).
        f_a: Linear<Vec<f32>>,
        /// `g_a_proj` `[D, hidden]` (replicated).
        g_a: Linear<Vec<f32>>,
    },
    /// One GEMM over `vcat(q, k, v, b, f_a, g_a)`.
    Fused {
        /// `W_in` `[3P/A + H/A + 2D, hidden]`.
        weight: Linear<Vec<f32>>,
        /// Output widths of the six parts, in fused order.
        split: [usize; 6],
    },
}

/// The input projections of `T` tokens, split, token-major.
#[derive(Clone, Debug)]
pub struct KdaProjected {
    /// Pre-conv q `[T, P/A]`.
    pub q: Vec<f32>,
    /// Pre-conv k `[T, P/A]`.
    pub k: Vec<f32>,
    /// Pre-conv v `[T, P/A]`.
    pub v: Vec<f32>,
    /// β logits `[T, H/A]`.
    pub beta_logits: Vec<f32>,
    /// Decay-gate low-rank activations `[T, D]`.
    pub f_a: Vec<f32>,
    /// Output-gate low-rank activations `[T, D]`.
    pub g_a: Vec<f32>,
}

impl KdaInputProjection {
    /// Builds the fused form from the six (already sharded) matrices, in fused order.
    pub fn fuse(parts: [Linear<Vec<f32>>; 6]) -> Self {
        let in_features = parts[0].in_features;
        debug_assert!(parts.iter().all(|p| p.in_features == in_features));
        let split = parts.each_ref().map(|p| p.out_features);
        let mut weight = Vec::with_capacity(split.iter().sum::<usize>() * in_features);
        for p in &parts {
            weight.extend_from_slice(&p.weight);
        }
        Self::Fused {
            weight: Linear {
                weight,
                out_features: split.iter().sum(),
                in_features,
            },
            split,
        }
    }

    /// Whether this is the fused form.
    pub fn is_fused(&self) -> bool {
        matches!(self, Self::Fused { .. })
    }

    /// Projects `rows` rows of `x`.
    pub fn project(&self, x: &Vec<f32>, rows: usize) -> KdaProjected {
        match self {
            Self::Separate {
                q,
                k,
                v,
                b,
                f_a,
                g_a,
            } => KdaProjected {
                q: linear(x, rows, q),
                k: linear(x, rows, k),
                v: linear(x, rows, v),
                beta_logits: linear(x, rows, b),
                f_a: linear(x, rows, f_a),
                g_a: linear(x, rows, g_a),
            },
            Self::Fused { weight, split } => {
                let all = linear(x, rows, weight);
                let mut parts: [Vec<f32>; 6] = split.map(|n| Vec::with_capacity(rows * n));
                for row in all.chunks_exact(weight.out_features) {
                    let mut at = 0;
                    for (part, &n) in parts.iter_mut().zip(split) {
                        part.extend_from_slice(&row[at..at + n]);
                        at += n;
                    }
                }
                let [q, k, v, beta_logits, f_a, g_a] = parts;
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
pub enum KdaGateProjection {
    /// Two separate Linears `[P/A, D]`.
    Separate {
        /// `f_b_proj`.
        f_b: Linear<Vec<f32>>,
        /// `g_b_proj`.
        g_b: Linear<Vec<f32>>,
    },
    /// `stack(f_b, g_b)` `[2, P/A, D]` in one buffer, applied as one batched matmul.
    Paired {
        /// The stacked weight, `2 · out · d` values.
        weight: Vec<f32>,
        /// `P/A`.
        out: usize,
        /// `D`.
        d: usize,
    },
}

impl KdaGateProjection {
    /// Stacks the two (already sharded) matrices.
    pub fn pair(f_b: Linear<Vec<f32>>, g_b: Linear<Vec<f32>>) -> Self {
        debug_assert_eq!(
            (f_b.out_features, f_b.in_features),
            (g_b.out_features, g_b.in_features)
        );
        Self::Paired {
            weight: [f_b.weight, g_b.weight].concat(),
            out: f_b.out_features,
            d: f_b.in_features,
        }
    }

    /// Whether this is the paired form.
    pub fn is_paired(&self) -> bool {
        matches!(self, Self::Paired { .. })
    }

    /// `(f_a · f_bᵀ, g_a · g_bᵀ)` for `rows` rows, each `[rows, P/A]`.
    pub fn apply(&self, f_a: &Vec<f32>, g_a: &Vec<f32>, rows: usize) -> (Vec<f32>, Vec<f32>) {
        match self {
            Self::Separate { f_b, g_b } => (linear(f_a, rows, f_b), linear(g_a, rows, g_b)),
            Self::Paired { weight, out, d } => {
                // One GEMM over the one stacked buffer: rows `[f_a; g_a]` (2T × D) against
                // `[f_b; g_b]` (2P/A × D); the two diagonal blocks are the batched product.
                // (The safe CPU GEMM takes no offset into a buffer; the off-diagonal blocks are
                // the price of keeping it one call over one allocation, as a GPU bmm is.)
                if rows == 0 {
                    return (Vec::new(), Vec::new());
                }
                let stacked = [&f_a[..], &g_a[..]].concat();
                let mut y = Vec::new();
                host::matmul_raw(&stacked, 2 * rows, weight, 2 * out, *d, &mut y, false);
                let block = |i: usize| -> Vec<f32> {
                    y.chunks_exact(2 * out)
                        .skip(i * rows)
                        .take(rows)
                        .flat_map(|r| &r[i * out..(i + 1) * out])
                        .copied()
                        .collect()
                };
                (block(0), block(1))
            }
        }
    }
}
