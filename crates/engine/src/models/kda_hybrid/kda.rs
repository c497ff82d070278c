//! One KDA (Kimi Delta Attention) layer: input projections, depthwise causal short convolution
//! with SiLU, the decay gate (Kimi's softplus form or GLM's lower-bound form), l2-normalised
//! q/k, the gated delta rule ([`super::delta_rule`]), and the sigmoid-gated RMSNorm before
//! `o_proj` — shared/specs/kda.md, "Forward, per token x".
//!
//! The per-request state is fixed-size ([`KdaState`]): the `[H, K, V]` recurrent state and the
//! last `W-1` pre-conv inputs of q, k and v, each block kept on its own, because a later
//! re-shard between attention-TP layouts splits each block by heads separately.
//!
//! The six projections that read the layer input (q, k, v, b, f_a, g_a) sit behind
//! [`KdaInputProjection`], which returns them already split ([`KdaProjected`]), and the two
//! gate up-projections behind [`KdaGateProjection`]; separate or fused
//! ([`super::projection`]) is decided per layer at load, the rest of the layer is the same.
//!
//! Under attention TP a layer holds heads `(ra, A)` only: its config's `num_heads` is the
//! local `H/A`, its state covers those heads, and `forward` returns `o_proj` partial sums the
//! caller reduces over the attention-TP group.

use super::config::KdaConfig;
use super::loading::{FusionInputs, FusionPolicy, RankShard, Upload};
use super::weights::Checkpoint;
use crate::backend::hybrid::{DeltaForm, DeltaInputs, HybridOps};
use crate::backend::{CpuBackend, Linear, Ops};
use crate::tensor::{DType, Tensor};
use crate::Result;
use tandem_model::fusion::{decide, FusionDecision};
use tandem_topology::{KdaParam, KdaShape, KdaShard};

/// Which form of the delta rule a forward pass uses. Both give the same result (to f32
/// rounding); on GPUs chunked is the fast one for many tokens, recurrent for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaForm {
    /// 64-token chunks (prefill).
    Chunked,
    /// One token at a time (decode).
    Recurrent,
    /// Per sequence: recurrent for a sequence of one new token, the backend's
    /// [`HybridOps::prompt_form`] for more (a step mixing decodes and prompt chunks; the CPU
    /// runs prompts recurrent too).
    Auto,
}

pub use super::projection::{KdaGateProjection, KdaInputProjection, KdaProjected};

/// The last `W-1` pre-conv inputs of each of q, k, v: each `[P, W-1]`, channel-major, oldest
/// column first (zeros before the first token) — the layout of causal-conv1d's state.
#[derive(Debug)]
pub struct ConvWindow<B: Ops = CpuBackend> {
    /// q block `[P, W-1]`.
    pub q: Tensor<B>,
    /// k block `[P, W-1]`.
    pub k: Tensor<B>,
    /// v block `[P, W-1]`.
    pub v: Tensor<B>,
}

impl ConvWindow {
    /// The three blocks stacked as `[3P, W-1]`, rows q | k | v (transformers' cache layout).
    pub fn to_stacked(&self) -> Vec<f32> {
        [self.q.f32s(), self.k.f32s(), self.v.f32s()].concat()
    }

    /// The inverse of [`ConvWindow::to_stacked`], blocks of shape `shape` each.
    pub fn from_stacked(stacked: &[f32], shape: &[usize]) -> Self {
        let third = stacked.len() / 3;
        let block =
            |i: usize| Tensor::from_f32s(shape, stacked[i * third..(i + 1) * third].to_vec());
        Self {
            q: block(0),
            k: block(1),
            v: block(2),
        }
    }
}

/// What one KDA layer keeps per request: fixed size, independent of the sequence length.
#[derive(Debug)]
pub struct KdaState<B: Ops = CpuBackend> {
    /// Recurrent state S `[H, K, V]` fp32 (`o = Sᵀq`; row `k` of head `h` at `(h*D + k)*D`).
    pub recurrent: Tensor<B>,
    /// Short-convolution window.
    pub conv: ConvWindow<B>,
}

impl Clone for ConvWindow {
    fn clone(&self) -> Self {
        Self {
            q: self.q.clone(),
            k: self.k.clone(),
            v: self.v.clone(),
        }
    }
}

impl PartialEq for ConvWindow {
    fn eq(&self, other: &Self) -> bool {
        self.q == other.q && self.k == other.k && self.v == other.v
    }
}

impl Clone for KdaState {
    fn clone(&self) -> Self {
        Self {
            recurrent: self.recurrent.clone(),
            conv: self.conv.clone(),
        }
    }
}

impl PartialEq for KdaState {
    fn eq(&self, other: &Self) -> bool {
        self.recurrent == other.recurrent && self.conv == other.conv
    }
}

/// One loaded KDA layer (the heads of one attention-TP rank; all of them at tp1).
#[derive(Debug)]
pub struct KdaLayer<B: Ops = CpuBackend> {
    cfg: KdaConfig,
    norm_eps: f32,
    /// The input projections.
    pub input: KdaInputProjection<B>,
    /// The gate up-projections `f_b`, `g_b`.
    pub gate: KdaGateProjection<B>,
    /// Depthwise conv weights `[P/A, W]` of q, k, v.
    conv: [Tensor<B>; 3],
    /// `exp(A_log)` per head.
    a: Tensor<B>,
    dt_bias: Tensor<B>,
    o_norm: Tensor<B>,
    o_proj: Linear<B>,
    fusion: FusionDecision,
}

impl<B: HybridOps> KdaLayer<B> {
    /// Loads `{attn}.{q,k,v}_proj`, `…_conv1d`, `f_a/f_b/b/g_a/g_b_proj`, `A_log`, `dt_bias`,
    /// `o_norm`, `o_proj` where `attn` is the layer's `self_attn` prefix; heads `rs.kda` only
    /// (f_a, g_a, o_norm replicated). Fusion per [`tandem_model::fusion::decide`] on the
    /// original tensors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        ck: &mut Checkpoint,
        attn: &str,
        cfg: KdaConfig,
        hidden: usize,
        norm_eps: f32,
        rs: &RankShard,
        fusion: &FusionInputs,
        up: &Upload<'_, B>,
    ) -> Result<Self> {
        let (shard, log) = (rs.kda, rs.log);
        let shape = KdaShape {
            num_heads: cfg.num_heads,
            head_dim: cfg.head_dim,
            conv_kernel: cfg.conv_kernel,
        };
        let ks = KdaShard::new(shape, shard)
            .map_err(|e| crate::Error::Weights(format!("{attn}: {e}")))?;
        let (h, d, w, p) = (cfg.num_heads, cfg.head_dim, cfg.conv_kernel, cfg.proj_dim());
        let name = |n: &str| format!("{attn}.{n}");
        let rows = |param: KdaParam| ks.param(param).range;
        let decision = {
            let dtype_of = |t: &str| ck.dtype_of(t);
            let mut d = decide(attn, fusion.quant.as_ref(), fusion.lora.as_ref(), &dtype_of);
            if fusion.policy == FusionPolicy::Never {
                for g in [&mut d.input, &mut d.fg_b] {
                    g.fused = false;
                    g.reason = "fusion disabled by the load options".into();
                }
            }
            d
        };
        if log {
            tracing::info!(
                layer = attn,
                input_fused = decision.input.fused,
                input_reason = %decision.input.reason,
                fg_b_fused = decision.fg_b.fused,
                fg_b_reason = %decision.fg_b.reason,
                "KDA projection fusion"
            );
        }
        let q = ck.linear_rows(&name("q_proj.weight"), p, hidden, rows(KdaParam::QProj))?;
        let k = ck.linear_rows(&name("k_proj.weight"), p, hidden, rows(KdaParam::KProj))?;
        let v = ck.linear_rows(&name("v_proj.weight"), p, hidden, rows(KdaParam::VProj))?;
        let b = ck.linear_rows(&name("b_proj.weight"), h, hidden, rows(KdaParam::BProj))?;
        let f_a = ck.linear_rows(&name("f_a_proj.weight"), d, hidden, rows(KdaParam::FAProj))?;
        let g_a = ck.linear_rows(&name("g_a_proj.weight"), d, hidden, rows(KdaParam::GAProj))?;
        let input = if decision.input.fused {
            KdaInputProjection::fuse([q, k, v, b, f_a, g_a], up)
        } else {
            KdaInputProjection::Separate {
                q: up.linear(q),
                k: up.linear(k),
                v: up.linear(v),
                b: up.linear(b),
                f_a: up.linear(f_a),
                g_a: up.linear(g_a),
            }
        };
        let f_b = ck.linear_rows(&name("f_b_proj.weight"), p, d, rows(KdaParam::FBProj))?;
        let g_b = ck.linear_rows(&name("g_b_proj.weight"), p, d, rows(KdaParam::GBProj))?;
        let gate = if decision.fg_b.fused {
            KdaGateProjection::pair(f_b, g_b, up)
        } else {
            KdaGateProjection::Separate {
                f_b: up.linear(f_b),
                g_b: up.linear(g_b),
            }
        };
        let mut conv_w =
            |n: &str, param: KdaParam| ck.slice(&[&name(n)], &[p, 1, w], 0, rows(param));
        let conv = [
            up.f32(conv_w("q_conv1d.weight", KdaParam::QConv)?),
            up.f32(conv_w("k_conv1d.weight", KdaParam::KConv)?),
            up.f32(conv_w("v_conv1d.weight", KdaParam::VConv)?),
        ];
        let a_log = ck.slice(&[&name("A_log")], &[h], 0, rows(KdaParam::ALog))?;
        let heads = ks.heads().len();
        Ok(Self {
            cfg: KdaConfig {
                num_heads: heads,
                ..cfg
            },
            norm_eps,
            input,
            gate,
            conv,
            a: up.f32(a_log.iter().map(|x| x.exp()).collect()),
            dt_bias: up.f32(ck.slice(&[&name("dt_bias")], &[p], 0, rows(KdaParam::DtBias))?),
            o_norm: up.f32(ck.take(&name("o_norm.weight"), &[d])?),
            o_proj: up.linear(ck.linear_cols(
                &[&name("o_proj.weight")],
                hidden,
                p,
                rows(KdaParam::OProj),
            )?),
            fusion: decision,
        })
    }

    /// Takes over `old`'s fused buffers, overwriting them with this layer's values, where the
    /// form and size match (their addresses survive a weight refresh); otherwise keeps its own
    /// new buffers and logs the reallocation.
    pub(crate) fn adopt_buffers(&mut self, backend: &B, old: &mut KdaLayer<B>, layer: usize) {
        let keep = |new: &mut Linear<B>, old: &mut Linear<B>, what: &str| {
            let same =
                new.weight.dtype() == old.weight.dtype() && new.weight.len() == old.weight.len();
            let kept = same
                && backend
                    .overwrite(&mut old.weight, &backend.download(&new.weight))
                    .is_ok();
            if kept {
                std::mem::swap(&mut new.weight, &mut old.weight);
            } else {
                tracing::info!(
                    layer,
                    "{what} reallocated on refresh (shape or form changed): recapture graphs"
                );
            }
        };
        match (&mut self.input, &mut old.input) {
            (
                KdaInputProjection::Fused { weight: new, .. },
                KdaInputProjection::Fused { weight: old, .. },
            ) => keep(new, old, "fused KDA input weight"),
            (new, _) if new.is_fused() => tracing::info!(
                layer,
                "fused KDA input weight reallocated on refresh (form changed): recapture graphs"
            ),
            _ => {}
        }
        match (&mut self.gate, &mut old.gate) {
            (
                KdaGateProjection::Paired { weight: new, .. },
                KdaGateProjection::Paired { weight: old, .. },
            ) => keep(new, old, "paired KDA f_b/g_b weight"),
            (new, _) if new.is_paired() => tracing::info!(
                layer,
                "paired KDA f_b/g_b weight reallocated on refresh (form changed): recapture graphs"
            ),
            _ => {}
        }
    }

    /// The fusion decision taken at load (from the original tensors and options).
    pub fn fusion(&self) -> &FusionDecision {
        &self.fusion
    }

    /// The layer's sizes.
    pub fn config(&self) -> &KdaConfig {
        &self.cfg
    }

    /// A zero state (no tokens seen).
    pub fn new_state(&self, backend: &B) -> KdaState<B> {
        let (h, d, p) = (self.cfg.num_heads, self.cfg.head_dim, self.cfg.proj_dim());
        let window = [p, self.cfg.conv_kernel - 1];
        KdaState {
            recurrent: backend.zeros(DType::F32, &[h, d, d]),
            conv: ConvWindow {
                q: backend.zeros(DType::F32, &window),
                k: backend.zeros(DType::F32, &window),
                v: backend.zeros(DType::F32, &window),
            },
        }
    }

    /// Runs `rows` tokens (the normed layer input, `[rows, hidden]`) through the layer,
    /// advancing `state`; returns the `o_proj` output `[rows, hidden]`.
    pub fn forward(
        &self,
        backend: &B,
        x: &Tensor<B>,
        rows: usize,
        state: &mut KdaState<B>,
        form: KdaForm,
    ) -> Tensor<B> {
        self.forward_batch(backend, x, &[rows], &mut [state], form)
    }

    /// Runs several sequences' tokens through the layer at once: `x` holds `segments[i]` rows
    /// of sequence `i` after those of sequences `0..i`, and `states[i]` is sequence `i`'s
    /// state. Projections, gates and `o_proj` are one GEMM over every row; the short convs
    /// and the delta rule run per sequence on its own state. Returns `[Σ rows, hidden]`.
    pub fn forward_batch(
        &self,
        b: &B,
        x: &Tensor<B>,
        segments: &[usize],
        states: &mut [&mut KdaState<B>],
        form: KdaForm,
    ) -> Tensor<B> {
        let (h, d, p, w) = (
            self.cfg.num_heads,
            self.cfg.head_dim,
            self.cfg.proj_dim(),
            self.cfg.conv_kernel,
        );
        assert_eq!(segments.len(), states.len(), "one state per sequence");
        let rows: usize = segments.iter().sum();
        let seqs = crate::backend::hybrid::row_ranges(segments);
        let proj = self.input.project(b, x, rows);
        let (mut g, gate) = self.gate.apply(b, &proj.f_a, &proj.g_a, rows);
        b.kda_decay(&mut g, rows, &self.a, &self.dt_bias, d, self.cfg.gate);
        let mut beta = proj.beta_logits;
        b.sigmoid_in_place(&mut beta, rows * h);
        let conv = |pre: &Tensor<B>, i: usize, states: &mut [&mut KdaState<B>]| {
            let mut windows: Vec<&mut Tensor<B>> = states
                .iter_mut()
                .map(|s| match i {
                    0 => &mut s.conv.q,
                    1 => &mut s.conv.k,
                    _ => &mut s.conv.v,
                })
                .collect();
            let mut out = b.zeros(DType::F32, &[rows, p]);
            b.short_conv(pre, &seqs, &mut windows, &self.conv[i], p, w, &mut out);
            out
        };
        let mut q = conv(&proj.q, 0, states);
        let mut k = conv(&proj.k, 1, states);
        let v = conv(&proj.v, 2, states);
        b.l2_norm_in_place(&mut q, rows * h, d, 1.0 / (d as f32).sqrt());
        b.l2_norm_in_place(&mut k, rows * h, d, 1.0);
        let forms: Vec<DeltaForm> = segments
            .iter()
            .map(|&n| match form {
                KdaForm::Chunked => DeltaForm::Chunked,
                KdaForm::Recurrent => DeltaForm::Recurrent,
                KdaForm::Auto if n == 1 => DeltaForm::Recurrent,
                KdaForm::Auto => b.prompt_form(),
            })
            .collect();
        let mut recurrent: Vec<&mut Tensor<B>> =
            states.iter_mut().map(|s| &mut s.recurrent).collect();
        let mut o = b.zeros(DType::F32, &[rows, p]);
        let inputs = DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            heads: h,
            head_dim: d,
        };
        b.delta_rule(inputs, &seqs, &forms, &mut recurrent, &mut o);
        // Gated RMSNorm per head: RMSNorm_D(o; o_norm) * sigmoid(g_b(g_a x)).
        b.gated_rms_norm(&mut o, &gate, &self.o_norm, rows, p, d, self.norm_eps);
        super::projection::project(b, &o, rows, &self.o_proj)
    }
}
