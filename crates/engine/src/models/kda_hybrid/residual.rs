//! The residual path: a plain single stream (Kimi Linear), or GLM's manifold-constrained
//! hyper-connections (mHC), where the hidden state between layers is `N` parallel streams
//! `[T, N, hidden]`. Each sub-layer reads a learned mix of the streams and writes its output
//! back into all of them through a per-token, Sinkhorn-normalised (doubly stochastic) `N×N`
//! mixing matrix (glm5_tiny/NOTES.md, "mHC residual streams").
//!
//! [`Residual`] hides the difference from the model loop: `enter` gives the sub-layer its
//! input, `leave` adds its output back, `output` gives what the final norm sees. mHC needs no
//! per-request state: every weight it uses is per token.

use super::config::ResidualKind;
use super::loading::Upload;
use super::projection::project;
use super::weights::Checkpoint;
use crate::backend::hybrid::{At, HcParams, HybridOps};
use crate::backend::{CpuBackend, Linear, Ops};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// The mHC weights of one sub-layer (attention or FFN) of one layer.
#[derive(Debug)]
pub struct HyperConnection<B: Ops = CpuBackend> {
    /// `[(2+N)·N, N·hidden]` (f32).
    mix: Linear<B>,
    /// `[(2+N)·N]`.
    base: Tensor<B>,
    /// `[3]`: scales of the pre, post and combine logits.
    scale: Tensor<B>,
    streams: usize,
    sinkhorn_iters: usize,
    eps: f32,
    norm_eps: f32,
}

/// Per-token weights a sub-layer's output is merged back with.
#[derive(Debug)]
pub struct StreamMix<B: Ops> {
    /// `[T, N]`.
    post: Tensor<B>,
    /// `[T, N, N]`; `comb[m][n]` carries old stream `m` into new stream `n`.
    comb: Tensor<B>,
}

impl<B: HybridOps> HyperConnection<B> {
    /// Loads `{layer}.hc_{which}_{fn,base,scale}` (`which` = `attn` or `ffn`).
    pub(crate) fn load(
        ck: &mut Checkpoint,
        (layer, which): (&str, &str),
        kind: ResidualKind,
        hidden: usize,
        norm_eps: f32,
        up: &Upload<'_, B>,
    ) -> Result<Option<Self>> {
        let ResidualKind::HyperConnections {
            streams: n,
            sinkhorn_iters,
            eps,
        } = kind
        else {
            return Ok(None);
        };
        let width = (2 + n) * n;
        let f32_up = Upload::new(up.backend, DType::F32);
        Ok(Some(Self {
            mix: f32_up.linear(ck.linear(&format!("{layer}.hc_{which}_fn"), width, n * hidden)?),
            base: up.f32(ck.take(&format!("{layer}.hc_{which}_base"), &[width])?),
            scale: up.f32(ck.take(&format!("{layer}.hc_{which}_scale"), &[3])?),
            streams: n,
            sinkhorn_iters,
            eps,
            norm_eps,
        }))
    }

    /// Collapses `streams` `[T, N, hidden]` into the sub-layer input `[T, hidden]` and the
    /// weights to merge its output back with.
    fn collapse(
        &self,
        b: &B,
        streams: &Tensor<B>,
        rows: usize,
        hidden: usize,
    ) -> (Tensor<B>, StreamMix<B>) {
        let n = self.streams;
        let mut normed = b.zeros(DType::F32, &[rows, n * hidden]);
        b.copy_block(
            streams,
            At::col(0, n * hidden),
            &mut normed,
            At::col(0, n * hidden),
            rows,
            n * hidden,
        );
        b.rms_norm_in_place(&mut normed, rows, n * hidden, None, self.norm_eps);
        let logits = project(b, &normed, rows, &self.mix);
        let mut x = b.zeros(DType::F32, &[rows, hidden]);
        let mut post = b.zeros(DType::F32, &[rows, n]);
        let mut comb = b.zeros(DType::F32, &[rows, n, n]);
        let hc = HcParams {
            base: &self.base,
            scale: &self.scale,
            streams: n,
            sinkhorn_iters: self.sinkhorn_iters,
            eps: self.eps,
        };
        b.hc_collapse(
            streams, &logits, hc, rows, hidden, &mut x, &mut post, &mut comb,
        );
        (x, StreamMix { post, comb })
    }
}

/// The residual state of `T` tokens between sub-layers.
#[derive(Debug)]
pub enum Residual<B: Ops> {
    /// `[T, hidden]`.
    Single(Tensor<B>),
    /// `[T, N, hidden]`.
    Streams {
        /// The streams.
        streams: Tensor<B>,
        /// N.
        n: usize,
    },
}

impl<B: HybridOps> Residual<B> {
    /// The residual right after the embedding (copied into every stream under mHC).
    pub fn new(b: &B, embedded: Tensor<B>, rows: usize, kind: ResidualKind, hidden: usize) -> Self {
        match kind {
            ResidualKind::Single => Self::Single(embedded),
            ResidualKind::HyperConnections { streams: n, .. } => {
                let mut streams = b.zeros(DType::F32, &[rows, n, hidden]);
                b.hc_expand(&embedded, rows, n, hidden, &mut streams);
                Self::Streams { streams, n }
            }
        }
    }

    /// The input of the next sub-layer (before its norm), and the mix to merge its output with.
    pub fn enter(
        &self,
        b: &B,
        hc: Option<&HyperConnection<B>>,
        rows: usize,
        hidden: usize,
    ) -> (Tensor<B>, Option<StreamMix<B>>) {
        match (self, hc) {
            (Self::Single(x), _) => {
                let mut copy = b.zeros(DType::F32, &[rows, hidden]);
                b.copy_block(
                    x,
                    At::col(0, hidden),
                    &mut copy,
                    At::col(0, hidden),
                    rows,
                    hidden,
                );
                (copy, None)
            }
            (Self::Streams { streams, .. }, Some(hc)) => {
                let (x, mix) = hc.collapse(b, streams, rows, hidden);
                (x, Some(mix))
            }
            (Self::Streams { .. }, None) => {
                unreachable!("hyper-connection weights are loaded for every layer under mHC")
            }
        }
    }

    /// Adds the sub-layer output `y` `[T, hidden]` back.
    pub fn leave(
        &mut self,
        b: &B,
        y: &Tensor<B>,
        mix: Option<StreamMix<B>>,
        rows: usize,
        hidden: usize,
    ) {
        match (self, mix) {
            (Self::Single(x), _) => b.add_assign(x, y, rows * hidden),
            (Self::Streams { streams, n }, Some(mix)) => {
                b.hc_merge(streams, y, &mix.post, &mix.comb, rows, *n, hidden)
            }
            (Self::Streams { .. }, None) => unreachable!("enter returns a mix under mHC"),
        }
    }

    /// What the final norm sees: the residual, or the plain mean of the streams.
    pub fn output(&self, b: &B, rows: usize, hidden: usize) -> Tensor<B> {
        let mut out = b.zeros(DType::F32, &[rows, hidden]);
        match self {
            Self::Single(x) => b.copy_block(
                x,
                At::col(0, hidden),
                &mut out,
                At::col(0, hidden),
                rows,
                hidden,
            ),
            Self::Streams { streams, n } => b.hc_mean(streams, rows, *n, hidden, &mut out),
        }
        out
    }

    /// The raw residual (`[T, hidden]` or `[T, N, hidden]`), for layer-by-layer debugging.
    pub fn raw(&self) -> &Tensor<B> {
        match self {
            Self::Single(x) => x,
            Self::Streams { streams, .. } => streams,
        }
    }
}
