//! The operations the KDA-hybrid family (Kimi-Linear, GLM-5.3-Flash) needs beyond
//! [`Ops`]: KDA's gates, short causal convolution, the delta rule over per-request state,
//! its gated RMSNorm; MoE routing and the weighted scatter of expert outputs; the clamped
//! SwiGLU; GLM's mHC residual streams; MLA's absorbed attention; and strided copies between
//! activations. The model (`kda_hybrid`) is written over these and [`Ops`] only; the CPU
//! backend implements them (`cpu_hybrid`), a GPU backend does the same in its crate.
//!
//! Like [`Ops`], every operation acts on the leading rows of tensors it is told about and
//! activations are f32. Per-sequence structure comes as row ranges ([`Seqs`]).

use super::Ops;
use crate::kda_hybrid::{KdaGate, MlaState, MoeConfig};
use crate::tensor::Tensor;
use std::ops::Range;

/// The rows of each sequence of a step, in order (`seqs[i]` = sequence `i`'s rows).
pub type Seqs = [Range<usize>];

/// A position in a row-major f32 activation: row `row`, column `col`, rows `stride` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct At {
    /// First row.
    pub row: usize,
    /// First column.
    pub col: usize,
    /// Row width of the tensor.
    pub stride: usize,
}

impl At {
    /// Column `col` of rows `stride` wide, from row 0.
    pub fn col(col: usize, stride: usize) -> Self {
        Self {
            row: 0,
            col,
            stride,
        }
    }
}

/// KDA's per-token inputs of the delta rule for one step, token-major `[T, H, D]` (β `[T, H]`).
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<'a, B: Ops> {
    /// Queries, l2-normalised and scaled by `D^-1/2`.
    pub q: &'a Tensor<B>,
    /// Keys, l2-normalised.
    pub k: &'a Tensor<B>,
    /// Values.
    pub v: &'a Tensor<B>,
    /// Per-channel log-decays `≤ 0`.
    pub g: &'a Tensor<B>,
    /// Write strengths in `(0, 1)`.
    pub beta: &'a Tensor<B>,
    /// Heads H.
    pub heads: usize,
    /// Head width D.
    pub head_dim: usize,
}

/// Which form of the delta rule runs for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaForm {
    /// One token at a time.
    Recurrent,
    /// 64-token chunks.
    Chunked,
}

/// The sizes of one MLA layer's absorbed attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDims {
    /// Heads (this rank's).
    pub heads: usize,
    /// Latent width (`kv_lora_rank`).
    pub rank: usize,
    /// Query/key width without position part.
    pub nope: usize,
    /// Width of the shared (unrotated) rope slot; 0 when the model has none.
    pub rope: usize,
    /// Value head width.
    pub v_head: usize,
}

/// The hyper-connection (mHC) parameters of one sub-layer.
#[derive(Clone, Copy, Debug)]
pub struct HcParams<'a, B: Ops> {
    /// `[(2+N)·N]` biases of the mixing logits.
    pub base: &'a Tensor<B>,
    /// `[3]` scales of the pre, post and combine logits.
    pub scale: &'a Tensor<B>,
    /// Streams N.
    pub streams: usize,
    /// Sinkhorn iterations.
    pub sinkhorn_iters: usize,
    /// Added to every normaliser.
    pub eps: f32,
}

/// The tokens one expert runs and the weight each of its outputs is added with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertRows {
    /// Token rows, ascending.
    pub rows: Vec<u32>,
    /// Routing weight per row.
    pub weights: Vec<f32>,
}

/// Operations of the KDA-hybrid family.
pub trait HybridOps: Ops {
    /// The delta rule's form for a sequence of several new tokens when the model leaves
    /// the choice to the backend (both give the same result to f32 rounding): chunked,
    /// which turns the recurrence into matrix products (GPUs), unless the backend says the
    /// recurrent form is faster on it.
    fn prompt_form(&self) -> DeltaForm {
        DeltaForm::Chunked
    }
    /// Copies a block of `rows × width` values from `src` at `from` into `dst` at `to`.
    fn copy_block(
        &self,
        src: &Tensor<Self>,
        from: At,
        dst: &mut Tensor<Self>,
        to: At,
        rows: usize,
        width: usize,
    );
    /// `y[..n] += x[..n]`.
    fn add_assign(&self, y: &mut Tensor<Self>, x: &Tensor<Self>, n: usize);
    /// RMSNorm in place over `rows` rows of `dim`, times `weight` (`[dim]`) when given.
    fn rms_norm_in_place(
        &self,
        x: &mut Tensor<Self>,
        rows: usize,
        dim: usize,
        weight: Option<&Tensor<Self>>,
        eps: f32,
    );
    /// LayerNorm with bias in place over `rows` rows of `weight.len()`.
    fn layer_norm_in_place(
        &self,
        x: &mut Tensor<Self>,
        rows: usize,
        weight: &Tensor<Self>,
        bias: &Tensor<Self>,
        eps: f32,
    );
    /// Scales each of `rows` rows of `dim` to unit L2 norm (`x / sqrt(Σx² + 1e-6)`), then by
    /// `scale`.
    fn l2_norm_in_place(&self, x: &mut Tensor<Self>, rows: usize, dim: usize, scale: f32);
    /// `x = sigmoid(x)` for the first `n` values.
    fn sigmoid_in_place(&self, x: &mut Tensor<Self>, n: usize);
    /// KDA's decay gate in place over `rows` rows of `P = a.len() · head_dim`: `f + dt_bias`
    /// becomes the log-decay `g ≤ 0` (`-a_h softplus(f)` or `lb · sigmoid(a_h f)`), where
    /// `a_h = exp(A_log)` of the channel's head.
    #[allow(clippy::too_many_arguments)]
    fn kda_decay(
        &self,
        f: &mut Tensor<Self>,
        rows: usize,
        a: &Tensor<Self>,
        dt_bias: &Tensor<Self>,
        head_dim: usize,
        gate: KdaGate,
    );
    /// Depthwise causal convolution (width `w`) of each sequence's rows of `pre` `[T, P]`,
    /// continuing from its window (`windows[i]`, `[P, w-1]`, oldest first) and advancing it,
    /// followed by SiLU, into `out` `[T, P]`.
    #[allow(clippy::too_many_arguments)]
    fn short_conv(
        &self,
        pre: &Tensor<Self>,
        seqs: &Seqs,
        windows: &mut [&mut Tensor<Self>],
        weight: &Tensor<Self>,
        p: usize,
        w: usize,
        out: &mut Tensor<Self>,
    );
    /// The gated delta rule for each sequence's rows over its state (`states[i]`, `[H, K, V]`,
    /// advanced past them) in the form `forms[i]`; writes `o` `[T, H, D]` into `out`.
    fn delta_rule(
        &self,
        inputs: DeltaInputs<'_, Self>,
        seqs: &Seqs,
        forms: &[DeltaForm],
        states: &mut [&mut Tensor<Self>],
        out: &mut Tensor<Self>,
    );
    /// KDA's output norm in place: per head row of `dim`, `RMSNorm(o; weight) · sigmoid(gate)`
    /// over `rows` rows of `width` (a multiple of `dim`).
    #[allow(clippy::too_many_arguments)]
    fn gated_rms_norm(
        &self,
        o: &mut Tensor<Self>,
        gate: &Tensor<Self>,
        weight: &Tensor<Self>,
        rows: usize,
        width: usize,
        dim: usize,
        eps: f32,
    );
    /// `out = act(gate) · up` over `rows` rows of `[gate | up]` (each half `inter` wide):
    /// `silu(gate) · up`, or with a `limit` `silu(min(gate, L)) · clamp(up, −L, L)`.
    fn swiglu(
        &self,
        gate_up: &Tensor<Self>,
        rows: usize,
        inter: usize,
        limit: Option<f32>,
        out: &mut Tensor<Self>,
    );
    /// MoE routing of `rows` tokens from the router's logits `[rows, E]`: sigmoid scores,
    /// choice on `score + bias` (group-limited when configured), renormalised top-k weights ×
    /// the scaling factor. Returns, per expert, the rows it runs and their weights.
    fn route_experts(
        &self,
        logits: &Tensor<Self>,
        rows: usize,
        bias: &Tensor<Self>,
        cfg: &MoeConfig,
    ) -> Vec<ExpertRows>;
    /// `y[rows[i]] += weights[i] · src[i]` for rows `dim` wide.
    fn scatter_add_rows(
        &self,
        y: &mut Tensor<Self>,
        src: &Tensor<Self>,
        expert: &ExpertRows,
        dim: usize,
    );
    /// Copies each of `rows` rows of `x` `[rows, hidden]` into every one of `n` streams
    /// (`out` `[rows, n, hidden]`).
    fn hc_expand(
        &self,
        x: &Tensor<Self>,
        rows: usize,
        n: usize,
        hidden: usize,
        out: &mut Tensor<Self>,
    );
    /// mHC: from the streams `[rows, N, hidden]` and the mixing logits `[rows, (2+N)·N]`,
    /// the sub-layer input `x` `[rows, hidden]`, the post weights `[rows, N]` and the
    /// Sinkhorn-normalised combine matrices `[rows, N, N]`.
    #[allow(clippy::too_many_arguments)]
    fn hc_collapse(
        &self,
        streams: &Tensor<Self>,
        logits: &Tensor<Self>,
        hc: HcParams<'_, Self>,
        rows: usize,
        hidden: usize,
        x: &mut Tensor<Self>,
        post: &mut Tensor<Self>,
        comb: &mut Tensor<Self>,
    );
    /// mHC: new stream `j` = `post_j · y + Σ_m comb[m][j] · old stream m`, in place.
    #[allow(clippy::too_many_arguments)]
    fn hc_merge(
        &self,
        streams: &mut Tensor<Self>,
        y: &Tensor<Self>,
        post: &Tensor<Self>,
        comb: &Tensor<Self>,
        rows: usize,
        n: usize,
        hidden: usize,
    );
    /// The mean of the `n` streams of each of `rows` rows, `[rows, hidden]`.
    fn hc_mean(
        &self,
        streams: &Tensor<Self>,
        rows: usize,
        n: usize,
        hidden: usize,
        out: &mut Tensor<Self>,
    );
    /// Appends each sequence's new rows to its MLA cache: the latent (`ckv` row's first
    /// `rank` values after RMSNorm with `norm`) and the rope slot (the rest); with
    /// `indexer = Some((keys, gate))`, the indexer's per-token rows too.
    #[allow(clippy::too_many_arguments)]
    fn mla_append(
        &self,
        ckv: &Tensor<Self>,
        seqs: &Seqs,
        states: &mut [&mut MlaState],
        norm: &Tensor<Self>,
        dims: MlaDims,
        eps: f32,
        indexer: Option<(&Tensor<Self>, &Tensor<Self>, usize, usize)>,
    );
    /// Absorbed MLA attention of each new row (`q` `[T, H, nope + rope]`) over its
    /// sequence's cache (already holding the step's rows: [`HybridOps::mla_append`]),
    /// causally, through `kv_b` (`[H·(nope+v_head), rank]`); writes `[T, H·v_head]`.
    ///
    /// The caches are host-side paged rows today ([`MlaState`]); moving them into the
    /// backend's paged block pool is what a device implementation needs first.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        q: &Tensor<Self>,
        seqs: &Seqs,
        states: &[&MlaState],
        kv_b: &Tensor<Self>,
        dims: MlaDims,
        out: &mut Tensor<Self>,
    );
}
