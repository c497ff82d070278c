//! The operations the KDA-hybrid family (Kimi-Linear, GLM-5.3-Flash) needs beyond
//! [`Ops`]: KDA's gates, short causal convolution, the delta rule over per-request state,
//! its gated RMSNorm; MoE routing and the weighted scatter of expert outputs; the clamped
//! SwiGLU; GLM's mHC residual streams; MLA's absorbed attention; and strided copies between
//! activations. The model (`kda_hybrid`) is written over these and [`Ops`] only; the CPU
//! backend implements them (`cpu_hybrid`), a GPU backend does the same in its crate.
//!
//! Like [`Ops`], every operation acts on the leading rows of tensors it is told about and
//! activations are f32. Per-sequence structure comes as row ranges ([`Seqs`]).

use super::latents::MlaState;
use super::{Linear, Ops};
use crate::tensor::{HostData, HostTensor, Tensor};
use std::ops::Range;

/// How KDA turns the decay projection `f = f_b(f_a x) + dt_bias` into the log-decay `g <= 0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KdaGate {
    /// Kimi Linear: `g = -exp(A_log) * softplus(f)`.
    Softplus,
    /// GLM-5.3-Flash: `g = lower_bound * sigmoid(exp(A_log) * f)`, in `(lower_bound, 0)`.
    LowerBound(f32),
}

/// MoE sizes and routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub experts_per_token: usize,
    /// Shared experts (fused into one MLP of `num_shared_experts * intermediate_size`).
    pub num_shared_experts: usize,
    /// Intermediate width of one expert.
    pub intermediate_size: usize,
    /// Multiplier on the routed experts' weights.
    pub routed_scaling_factor: f32,
    /// Whether the chosen experts' weights are divided by their sum.
    pub renormalize: bool,
    /// Expert groups (DeepSeek-V3 group-limited routing); 1 = no groups.
    pub num_groups: usize,
    /// Groups kept per token.
    pub topk_groups: usize,
}

/// The row ranges of consecutive segments of `segments[i]` rows each.
pub fn row_ranges(segments: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    segments
        .iter()
        .map(|&n| {
            at += n;
            at - n..at
        })
        .collect()
}

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
    /// The start of row `row` of rows `stride` wide.
    pub fn row(row: usize, stride: usize) -> Self {
        Self {
            row,
            col: 0,
            stride,
        }
    }

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

impl ExpertRows {
    /// Per expert (of `experts`), the rows routed to it and their weights, from a routing's
    /// `ids` (u32) and `weights` (f32), `[rows, k]` each on the host ([`HybridOps::route_topk`]).
    pub fn from_routing(
        ids: &HostTensor,
        weights: &HostTensor,
        rows: usize,
        k: usize,
        experts: usize,
    ) -> Vec<ExpertRows> {
        let (HostData::U32(ids), HostData::F32(weights)) = (ids.data(), weights.data()) else {
            panic!("a routing's ids are u32 and its weights f32");
        };
        let mut out = vec![ExpertRows::default(); experts];
        for (i, (&e, &w)) in ids[..rows * k].iter().zip(&weights[..rows * k]).enumerate() {
            let held = &mut out[e as usize];
            held.rows.push((i / k) as u32);
            held.weights.push(w);
        }
        out
    }
}

/// A MoE routing on the backend: for each of `rows` tokens, the `k` chosen experts (best first)
/// and their weights ([`HybridOps::route_topk`]).
#[derive(Clone, Copy, Debug)]
pub struct Routed<'a, B: Ops> {
    /// `[rows, k]` u32: global expert indices.
    pub ids: &'a Tensor<B>,
    /// `[rows, k]` f32: the weight each chosen expert's output is added with.
    pub weights: &'a Tensor<B>,
    /// Tokens.
    pub rows: usize,
    /// Experts per token.
    pub k: usize,
}

/// The SwiGLU experts one rank holds, as the grouped expert product reads them: tables of
/// each expert's fused gate/up (`[2I, hidden]`) and down (`[hidden, I]`) weights
/// ([`HybridOps::expert_table`]).
#[derive(Clone, Copy, Debug)]
pub struct ExpertBank<'a, B: Ops> {
    /// The gate/up table.
    pub gate_up: &'a Tensor<B>,
    /// The down table.
    pub down: &'a Tensor<B>,
    /// Global index of the first expert held.
    pub first: usize,
    /// Experts held.
    pub count: usize,
    /// Model width.
    pub hidden: usize,
    /// Intermediate width of one expert (this rank's part).
    pub inter: usize,
    /// The SwiGLU's clamp ([`HybridOps::swiglu`]).
    pub limit: Option<f32>,
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
    /// the scaling factor. Writes each token's chosen experts, best first, into `ids`
    /// (`[rows, k]` u32) and their weights into `weights` (`[rows, k]` f32).
    #[allow(clippy::too_many_arguments)]
    fn route_topk(
        &self,
        logits: &Tensor<Self>,
        rows: usize,
        bias: &Tensor<Self>,
        cfg: &MoeConfig,
        ids: &mut Tensor<Self>,
        weights: &mut Tensor<Self>,
    );
    /// The table a grouped expert product ([`HybridOps::moe_grouped`]) reads the experts'
    /// weights through, one entry per linear of `weights` (in order), or `None` when this
    /// backend (or these weights' dtype or shapes) runs the experts one at a time. The table
    /// refers to the weights: it is valid while they are.
    fn expert_table(&self, weights: &[&Linear<Self>]) -> Option<Tensor<Self>> {
        let _ = weights;
        None
    }
    /// Whether a step of `rows` tokens runs its experts as one grouped product (given tables
    /// from [`HybridOps::expert_table`]) rather than a gather, a GEMM pair and a scatter per
    /// expert.
    fn groups_experts(&self, rows: usize) -> bool {
        let _ = rows;
        false
    }
    /// `y[t] += Σ_j weights[t][j] · expert_{ids[t][j]}(x[t])` over the chosen experts that
    /// `bank` holds (others are another rank's), each expert a SwiGLU MLP. Only called when
    /// [`HybridOps::expert_table`] gave tables.
    fn moe_grouped(
        &self,
        x: &Tensor<Self>,
        routed: Routed<'_, Self>,
        bank: ExpertBank<'_, Self>,
        y: &mut Tensor<Self>,
    ) {
        let _ = (x, routed, bank, y);
        unreachable!("moe_grouped without expert tables")
    }
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
        states: &mut [&mut MlaState<Self>],
        norm: &Tensor<Self>,
        dims: MlaDims,
        eps: f32,
        indexer: Option<(&Tensor<Self>, &Tensor<Self>, usize, usize)>,
    );
    /// Absorbed MLA attention of each new row (`q` `[T, H, nope + rope]`) over its
    /// sequence's cache (already holding the step's rows: [`HybridOps::mla_append`]),
    /// causally, through `kv_b` (`[H·(nope+v_head), rank]`); writes `[T, H·v_head]`.
    ///
    /// The caches are blocks of rows on this backend ([`MlaState`]).
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        q: &Tensor<Self>,
        seqs: &Seqs,
        states: &[&MlaState<Self>],
        kv_b: &Tensor<Self>,
        dims: MlaDims,
        out: &mut Tensor<Self>,
    );
}
