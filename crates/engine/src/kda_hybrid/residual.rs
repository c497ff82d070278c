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
use super::ops::{linear, rms_norm_rows, sigmoid};
use super::weights::Checkpoint;
use crate::backend::host::Linear;
use crate::Result;

/// The mHC weights of one sub-layer (attention or FFN) of one layer.
#[derive(Debug)]
pub struct HyperConnection {
    /// `[(2+N)·N, N·hidden]`.
    mix: Linear<Vec<f32>>,
    /// `[(2+N)·N]`.
    base: Vec<f32>,
    /// `[3]`: scales of the pre, post and combine logits.
    scale: Vec<f32>,
    streams: usize,
    sinkhorn_iters: usize,
    eps: f32,
    norm_eps: f32,
}

/// Per-token weights a sub-layer's output is merged back with.
#[derive(Debug)]
pub struct StreamMix {
    /// `[T, N]`.
    post: Vec<f32>,
    /// `[T, N, N]`; `comb[m][n]` carries old stream `m` into new stream `n`.
    comb: Vec<f32>,
}

impl HyperConnection {
    /// Loads `{layer}.hc_{which}_{fn,base,scale}` (`which` = `attn` or `ffn`).
    pub(crate) fn load(
        ck: &mut Checkpoint,
        layer: &str,
        which: &str,
        kind: ResidualKind,
        hidden: usize,
        norm_eps: f32,
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
        Ok(Some(Self {
            mix: ck.linear(&format!("{layer}.hc_{which}_fn"), width, n * hidden)?,
            base: ck.take(&format!("{layer}.hc_{which}_base"), &[width])?,
            scale: ck.take(&format!("{layer}.hc_{which}_scale"), &[3])?,
            streams: n,
            sinkhorn_iters,
            eps,
            norm_eps,
        }))
    }

    /// Collapses `streams` `[T, N, hidden]` into the sub-layer input `[T, hidden]` and the
    /// weights to merge its output back with.
    fn collapse(&self, streams: &[f32], rows: usize, hidden: usize) -> (Vec<f32>, StreamMix) {
        let n = self.streams;
        let mut normed = streams.to_vec();
        rms_norm_rows(&mut normed, n * hidden, None, self.norm_eps);
        let logits = linear(&normed, rows, &self.mix);
        let width = (2 + n) * n;
        let mut x = vec![0.0f32; rows * hidden];
        let mut post = vec![0.0f32; rows * n];
        let mut comb = vec![0.0f32; rows * n * n];
        for t in 0..rows {
            let l = &logits[t * width..(t + 1) * width];
            let b = &self.base;
            let xt = &mut x[t * hidden..(t + 1) * hidden];
            for i in 0..n {
                let pre = sigmoid(l[i] * self.scale[0] + b[i]) + self.eps;
                let s = &streams[(t * n + i) * hidden..(t * n + i + 1) * hidden];
                xt.iter_mut().zip(s).for_each(|(x, &s)| *x += pre * s);
                post[t * n + i] = 2.0 * sigmoid(l[n + i] * self.scale[1] + b[n + i]);
            }
            let c = &mut comb[t * n * n..(t + 1) * n * n];
            for (m, row) in c.chunks_exact_mut(n).enumerate() {
                let at = 2 * n + m * n;
                for (j, v) in row.iter_mut().enumerate() {
                    *v = l[at + j] * self.scale[2] + b[at + j];
                }
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|v| *v = (*v - max).exp());
                let sum: f32 = row.iter().sum();
                row.iter_mut().for_each(|v| *v = *v / sum + self.eps);
            }
            self.sinkhorn(c);
        }
        (x, StreamMix { post, comb })
    }

    /// Normalises columns once, then `iters - 1` times rows and columns.
    fn sinkhorn(&self, c: &mut [f32]) {
        let n = self.streams;
        let columns = |c: &mut [f32]| {
            for j in 0..n {
                let sum: f32 = (0..n).map(|m| c[m * n + j]).sum::<f32>() + self.eps;
                (0..n).for_each(|m| c[m * n + j] /= sum);
            }
        };
        columns(c);
        for _ in 1..self.sinkhorn_iters {
            for row in c.chunks_exact_mut(n) {
                let sum: f32 = row.iter().sum::<f32>() + self.eps;
                row.iter_mut().for_each(|v| *v /= sum);
            }
            columns(c);
        }
    }
}

/// The residual state of `T` tokens between sub-layers.
#[derive(Debug)]
pub enum Residual {
    /// `[T, hidden]`.
    Single(Vec<f32>),
    /// `[T, N, hidden]`.
    Streams {
        /// The streams.
        streams: Vec<f32>,
        /// N.
        n: usize,
    },
}

impl Residual {
    /// The residual right after the embedding (copied into every stream under mHC).
    pub fn new(embedded: Vec<f32>, kind: ResidualKind, hidden: usize) -> Self {
        match kind {
            ResidualKind::Single => Self::Single(embedded),
            ResidualKind::HyperConnections { streams: n, .. } => Self::Streams {
                streams: embedded
                    .chunks_exact(hidden)
                    .flat_map(|row| std::iter::repeat_n(row, n).flatten())
                    .copied()
                    .collect(),
                n,
            },
        }
    }

    /// The input of the next sub-layer (before its norm), and the mix to merge its output with.
    pub fn enter(
        &self,
        hc: Option<&HyperConnection>,
        rows: usize,
        hidden: usize,
    ) -> (Vec<f32>, Option<StreamMix>) {
        match (self, hc) {
            (Self::Single(x), _) => (x.clone(), None),
            (Self::Streams { streams, .. }, Some(hc)) => {
                let (x, mix) = hc.collapse(streams, rows, hidden);
                (x, Some(mix))
            }
            (Self::Streams { .. }, None) => {
                unreachable!("hyper-connection weights are loaded for every layer under mHC")
            }
        }
    }

    /// Adds the sub-layer output `y` `[T, hidden]` back.
    pub fn leave(&mut self, y: &[f32], mix: Option<StreamMix>, hidden: usize) {
        match (self, mix) {
            (Self::Single(x), _) => x.iter_mut().zip(y).for_each(|(x, &y)| *x += y),
            (Self::Streams { streams, n }, Some(mix)) => {
                let n = *n;
                let mut old = vec![0.0f32; n * hidden];
                for (t, (tok, y)) in streams
                    .chunks_exact_mut(n * hidden)
                    .zip(y.chunks_exact(hidden))
                    .enumerate()
                {
                    old.copy_from_slice(tok);
                    let comb = &mix.comb[t * n * n..(t + 1) * n * n];
                    for (j, new) in tok.chunks_exact_mut(hidden).enumerate() {
                        let post = mix.post[t * n + j];
                        new.iter_mut().zip(y).for_each(|(v, &y)| *v = post * y);
                        for (m, src) in old.chunks_exact(hidden).enumerate() {
                            let w = comb[m * n + j];
                            new.iter_mut().zip(src).for_each(|(v, &s)| *v += w * s);
                        }
                    }
                }
            }
            (Self::Streams { .. }, None) => unreachable!("enter returns a mix under mHC"),
        }
    }

    /// What the final norm sees: the residual, or the plain mean of the streams.
    pub fn output(&self, hidden: usize) -> Vec<f32> {
        match self {
            Self::Single(x) => x.clone(),
            Self::Streams { streams, n } => streams
                .chunks_exact(n * hidden)
                .flat_map(|tok| {
                    (0..hidden)
                        .map(move |i| (0..*n).map(|m| tok[m * hidden + i]).sum::<f32>() / *n as f32)
                })
                .collect(),
        }
    }

    /// The raw residual (`[T, hidden]` or `[T, N, hidden]`), for layer-by-layer debugging.
    pub fn raw(&self) -> &[f32] {
        match self {
            Self::Single(x) => x,
            Self::Streams { streams, .. } => streams,
        }
    }
}
