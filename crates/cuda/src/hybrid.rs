//! The [`HybridOps`] half of the traits, for the KDA-hybrid family (Kimi-Linear, GLM-5.3-Flash):
//! KDA's gates, short convolution, delta rule and gated norm, the clamped SwiGLU, the MoE
//! scatter, the mHC residual streams and strided copies, each one kernel launch on the
//! backend's stream (kernels.cu, "KDA-hybrid family") that never waits for the device.
//!
//! The per-sequence operations — the short convolution and the delta rule — receive each
//! sequence's window or state as a tensor of its own. Rather than one launch per sequence
//! (which a decode batch of many sequences would pay for in launch overhead), each call
//! uploads a table of the step's non-empty sequences ([`SeqEntry`]: state address, first row,
//! rows) into a scratch buffer on the stream and makes one launch over it. The upload is
//! stream-ordered, so a later call reusing the buffer cannot change what an earlier launch
//! reads.
//!
//! MoE runs on the device: routing (`moe_route`) and, for steps of up to
//! `TANDEM_CUDA_MOE_GROUPED_ROWS` tokens, the experts as one grouped product (sort, gate/up,
//! down, combine: four launches whatever the number of experts); larger steps read the routing
//! back and run expert by expert through cuBLAS.
//!
//! MLA's cache ([`MlaState`]) is blocks of rows in device memory: the append writes the
//! step's rows through a table of destination addresses, and attention runs absorbed — two
//! batched cuBLAS products through `kv_b` around one kernel that scores and attends over each
//! row's blocks (a table of block addresses per sequence). No operation of the family waits
//! for the device.

use crate::device::{check, Arg as A, CudaBackend};
use crate::ops::{flat_cfg, need, ptr, rows_cfg, threads_for, T};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::LaunchConfig;
use tandem_engine::backend::hybrid::{
    At, DeltaForm, DeltaInputs, ExpertBank, ExpertRows, HcParams, HybridOps, MlaDims, Routed, Seqs,
};
use tandem_engine::backend::hybrid::{KdaGate, MoeConfig};
use tandem_engine::backend::latents::BLOCK_ROWS;
use tandem_engine::backend::latents::{MlaState, PagedRows};
use tandem_engine::backend::Linear;
use tandem_engine::{Backend, DType, HostTensor};

/// Head widths the delta-rule kernel is built for (`delta_rule_d*` in kernels.cu).
pub(crate) const DELTA_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Steps of fewer sequences than this take the delta-rule kernel with more warps per head
/// (`delta_rule_d128_q2`).
const FEW_SEQUENCES: usize = 8;
/// The widest short convolution the kernel takes (`CONV_MAX_W` in kernels.cu).
const CONV_MAX_W: usize = 8;
/// Rows one thread of the short convolution walks (`CONV_CHUNK` in kernels.cu).
const CONV_CHUNK: usize = 16;
/// Streams the mHC merge keeps in registers (`HC_MAX_STREAMS` in kernels.cu).
const HC_MAX_STREAMS: usize = 8;
/// Experts per token the MoE router takes (`MOE_MAX_K` in kernels.cu).
const MOE_MAX_K: usize = 32;
/// Expert groups the MoE router takes (`MOE_MAX_GROUPS` in kernels.cu).
const MOE_MAX_GROUPS: usize = 64;
/// Experts one rank's grouped product takes (a thread each in `moe_sort`).
const MOE_MAX_EXPERTS: usize = 1024;
/// Warps per block of the grouped expert kernels (their `__launch_bounds__`).
const MOE_WARPS: usize = 4;
/// Latent and rope values per lane of the MLA attention kernel (`MLA_LANE_R`,
/// `MLA_LANE_ROPE` in kernels.cu), and its warps per block (`MLA_WARPS`).
const MLA_LANE_R: usize = 16;
const MLA_LANE_ROPE: usize = 2;
const MLA_WARPS: usize = 4;

/// One non-empty sequence of a per-sequence launch (`SeqEntry` in kernels.cu).
#[derive(Clone, Copy, Debug)]
struct SeqEntry {
    /// Device address of its window or state.
    state: u64,
    /// Its first row in the step.
    first: usize,
    /// Its rows.
    rows: usize,
}

impl HybridOps for CudaBackend {
    /// The recurrent form: both forms run the same kernel here (the token loop of
    /// [`HybridOps::delta_rule`]), so a prompt asks for the one that names what runs.
    fn prompt_form(&self) -> DeltaForm {
        DeltaForm::Recurrent
    }

    fn copy_block(&self, src: &T, from: At, dst: &mut T, to: At, rows: usize, width: usize) {
        if rows == 0 || width == 0 {
            return;
        }
        let end = |at: At| (at.row + rows - 1) * at.stride + at.col + width;
        need(src, DType::F32, end(from), "copy_block source");
        need(dst, DType::F32, end(to), "copy_block destination");
        let (src_at, dst_at) = (
            (from.row * from.stride + from.col) as i64,
            (to.row * to.stride + to.col) as i64,
        );
        self.launch(
            &self.inner.kernels.copy_block,
            flat_cfg(rows * width),
            &[
                A::from(ptr(src)),
                A::from(src_at),
                A::from(from.stride as i32),
                A::from(ptr(dst)),
                A::from(dst_at),
                A::from(to.stride as i32),
                A::from(rows as i32),
                A::from(width as i32),
            ],
        );
    }

    fn add_assign(&self, y: &mut T, x: &T, n: usize) {
        if n == 0 {
            return;
        }
        need(y, DType::F32, n, "add_assign output");
        need(x, DType::F32, n, "add_assign input");
        self.launch(
            &self.inner.kernels.add_assign,
            flat_cfg(n),
            &[A::from(ptr(y)), A::from(ptr(x)), A::from(n as i64)],
        );
    }

    fn rms_norm_in_place(&self, x: &mut T, rows: usize, dim: usize, weight: Option<&T>, eps: f32) {
        if rows == 0 {
            return;
        }
        need(x, DType::F32, rows * dim, "rms_norm_in_place input");
        let (f, w) = match weight {
            None => (&self.inner.kernels.rms_norm_in_place_f32, 0),
            Some(w) => {
                assert!(w.len() >= dim, "rms_norm_in_place weight: fewer than {dim}");
                (self.rms_norm_in_place_kernel(w), ptr(w))
            }
        };
        self.launch(
            f,
            rows_cfg(rows, threads_for(dim).min(1024)),
            &[
                A::from(ptr(x)),
                A::from(dim as i32),
                A::from(w),
                A::from(eps),
            ],
        );
    }

    fn layer_norm_in_place(&self, x: &mut T, rows: usize, weight: &T, bias: &T, eps: f32) {
        let dim = weight.len();
        if rows == 0 {
            return;
        }
        need(x, DType::F32, rows * dim, "layer_norm_in_place input");
        need(weight, DType::F32, dim, "layer_norm_in_place weight");
        need(bias, DType::F32, dim, "layer_norm_in_place bias");
        self.launch(
            &self.inner.kernels.layer_norm_in_place,
            rows_cfg(rows, threads_for(dim).min(1024)),
            &[
                A::from(ptr(x)),
                A::from(dim as i32),
                A::from(ptr(weight)),
                A::from(ptr(bias)),
                A::from(eps),
            ],
        );
    }

    fn l2_norm_in_place(&self, x: &mut T, rows: usize, dim: usize, scale: f32) {
        if rows == 0 {
            return;
        }
        need(x, DType::F32, rows * dim, "l2_norm_in_place input");
        self.launch(
            &self.inner.kernels.l2_norm_in_place,
            rows_cfg(rows, threads_for(dim).min(1024)),
            &[A::from(ptr(x)), A::from(dim as i32), A::from(scale)],
        );
    }

    fn sigmoid_in_place(&self, x: &mut T, n: usize) {
        if n == 0 {
            return;
        }
        need(x, DType::F32, n, "sigmoid_in_place input");
        self.launch(
            &self.inner.kernels.sigmoid_in_place,
            flat_cfg(n),
            &[A::from(ptr(x)), A::from(n as i64)],
        );
    }

    fn kda_decay(
        &self,
        f: &mut T,
        rows: usize,
        a: &T,
        dt_bias: &T,
        head_dim: usize,
        gate: KdaGate,
    ) {
        let p = dt_bias.len();
        if rows == 0 || p == 0 {
            return;
        }
        need(f, DType::F32, rows * p, "kda_decay input");
        need(dt_bias, DType::F32, p, "kda_decay dt_bias");
        need(a, DType::F32, p.div_ceil(head_dim), "kda_decay a");
        let (bounded, lower_bound) = match gate {
            KdaGate::Softplus => (0i32, 0.0f32),
            KdaGate::LowerBound(lb) => (1, lb),
        };
        self.launch(
            &self.inner.kernels.kda_decay,
            flat_cfg(rows * p),
            &[
                A::from(ptr(f)),
                A::from(rows as i64),
                A::from(p as i32),
                A::from(ptr(a)),
                A::from(ptr(dt_bias)),
                A::from(head_dim as i32),
                A::from(bounded),
                A::from(lower_bound),
            ],
        );
    }

    /// One launch over every sequence: a thread per (channel, sequence, chunk of rows); the
    /// windows' addresses travel in the sequence table.
    fn short_conv(
        &self,
        pre: &T,
        seqs: &Seqs,
        windows: &mut [&mut T],
        weight: &T,
        p: usize,
        w: usize,
        out: &mut T,
    ) {
        assert_eq!(
            seqs.len(),
            windows.len(),
            "short_conv: one window per sequence"
        );
        assert!(
            (1..=CONV_MAX_W).contains(&w),
            "the CUDA short convolution takes widths 1..={CONV_MAX_W}, not {w}"
        );
        let rows = seqs.iter().map(|s| s.end).max().unwrap_or(0);
        need(pre, DType::F32, rows * p, "short_conv input");
        need(out, DType::F32, rows * p, "short_conv output");
        assert!(
            weight.len() >= p * w,
            "short_conv weight: fewer than {p} × {w}"
        );
        let entries: Vec<SeqEntry> = seqs
            .iter()
            .zip(windows.iter())
            .filter(|(s, _)| !s.is_empty())
            .map(|(s, window)| {
                need(window, DType::F32, p * (w - 1), "short_conv window");
                SeqEntry {
                    state: ptr(window),
                    first: s.start,
                    rows: s.len(),
                }
            })
            .collect();
        let Some(longest) = entries.iter().map(|e| e.rows).max() else {
            return;
        };
        let f = match weight.dtype() {
            DType::F32 => &self.inner.kernels.short_conv_f32,
            DType::BF16 => &self.inner.kernels.short_conv_bf16,
            other => panic!("CUDA short_conv weights are f32 or bf16, not {other}"),
        };
        let chunks = longest.div_ceil(CONV_CHUNK);
        assert!(
            entries.len() <= 65_535 && chunks <= 65_535,
            "short_conv: {} sequences of up to {longest} rows exceed the grid",
            entries.len()
        );
        let table = self.seq_table(&entries);
        let cfg = LaunchConfig {
            grid_dim: (p.div_ceil(256) as u32, entries.len() as u32, chunks as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            f,
            cfg,
            &[
                A::from(ptr(pre)),
                A::from(table),
                A::from(ptr(weight)),
                A::from(p as i32),
                A::from(w as i32),
                A::from(ptr(out)),
            ],
        );
    }

    /// One launch over every sequence, whatever its form: a block per (sequence, head, slice
    /// of V columns) walks the sequence's tokens with the state in registers, each warp
    /// owning a few columns across all of K (the recurrent form; kernels.cu). The chunked
    /// form runs the same kernel for now — its result is the same to f32 rounding, and a
    /// tensor-core chunked kernel is what would make long prompts faster — so `forms` does
    /// not change what runs.
    fn delta_rule(
        &self,
        inputs: DeltaInputs<'_, Self>,
        seqs: &Seqs,
        forms: &[DeltaForm],
        states: &mut [&mut T],
        out: &mut T,
    ) {
        let (h, d) = (inputs.heads, inputs.head_dim);
        assert_eq!(
            seqs.len(),
            states.len(),
            "delta_rule: one state per sequence"
        );
        assert_eq!(seqs.len(), forms.len(), "delta_rule: one form per sequence");
        let rows = seqs.iter().map(|s| s.end).max().unwrap_or(0);
        for (x, name) in [
            (inputs.q, "delta_rule q"),
            (inputs.k, "delta_rule k"),
            (inputs.v, "delta_rule v"),
            (inputs.g, "delta_rule g"),
        ] {
            need(x, DType::F32, rows * h * d, name);
        }
        need(inputs.beta, DType::F32, rows * h, "delta_rule beta");
        need(out, DType::F32, rows * h * d, "delta_rule output");
        let entries: Vec<SeqEntry> = seqs
            .iter()
            .zip(states.iter())
            .filter(|(s, _)| !s.is_empty())
            .map(|(s, state)| {
                need(state, DType::F32, h * d * d, "delta_rule state");
                SeqEntry {
                    state: ptr(state),
                    first: s.start,
                    rows: s.len(),
                }
            })
            .collect();
        let (f, quads) = self.delta_rule_kernel(d, entries.len());
        if entries.is_empty() {
            return;
        }
        let (warps, slices) = delta_rule_shape(d, quads);
        let table = self.seq_table(&entries);
        let cfg = LaunchConfig {
            grid_dim: (entries.len() as u32, h as u32, slices as u32),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            f,
            cfg,
            &[
                A::from(ptr(inputs.q)),
                A::from(ptr(inputs.k)),
                A::from(ptr(inputs.v)),
                A::from(ptr(inputs.g)),
                A::from(ptr(inputs.beta)),
                A::from(h as i32),
                A::from(table),
                A::from(ptr(out)),
            ],
        );
    }

    fn gated_rms_norm(
        &self,
        o: &mut T,
        gate: &T,
        weight: &T,
        rows: usize,
        width: usize,
        dim: usize,
        eps: f32,
    ) {
        if rows == 0 {
            return;
        }
        assert!(
            width.is_multiple_of(dim),
            "gated_rms_norm: width {width} is not a multiple of {dim}"
        );
        need(o, DType::F32, rows * width, "gated_rms_norm input");
        need(gate, DType::F32, rows * width, "gated_rms_norm gate");
        assert!(
            weight.len() >= dim,
            "gated_rms_norm weight: fewer than {dim}"
        );
        let f = match weight.dtype() {
            DType::F32 => &self.inner.kernels.gated_rms_norm_f32,
            DType::BF16 => &self.inner.kernels.gated_rms_norm_bf16,
            other => panic!("CUDA gated_rms_norm weights are f32 or bf16, not {other}"),
        };
        self.launch(
            f,
            rows_cfg(rows * width / dim, threads_for(dim).min(1024)),
            &[
                A::from(ptr(o)),
                A::from(ptr(gate)),
                A::from(ptr(weight)),
                A::from(dim as i32),
                A::from(eps),
            ],
        );
    }

    fn swiglu(&self, gate_up: &T, rows: usize, inter: usize, limit: Option<f32>, out: &mut T) {
        if rows == 0 {
            return;
        }
        need(gate_up, DType::F32, rows * 2 * inter, "swiglu input");
        need(out, DType::F32, rows * inter, "swiglu output");
        let (clamp, l) = match limit {
            None => (0i32, 0.0f32),
            Some(l) => (1, l),
        };
        self.launch(
            &self.inner.kernels.swiglu,
            flat_cfg(rows * inter),
            &[
                A::from(ptr(gate_up)),
                A::from(rows as i64),
                A::from(inter as i32),
                A::from(clamp),
                A::from(l),
                A::from(ptr(out)),
            ],
        );
    }

    fn route_topk(
        &self,
        logits: &T,
        rows: usize,
        bias: &T,
        cfg: &MoeConfig,
        ids: &mut T,
        weights: &mut T,
    ) {
        if rows == 0 {
            return;
        }
        let (e, k) = (cfg.num_experts, cfg.experts_per_token);
        assert!(
            k <= MOE_MAX_K && cfg.num_groups <= MOE_MAX_GROUPS && cfg.num_groups > 0,
            "the CUDA MoE router takes at most {MOE_MAX_K} experts per token and \
             {MOE_MAX_GROUPS} groups, not {k} and {}",
            cfg.num_groups
        );
        assert!(
            k <= e && e.is_multiple_of(cfg.num_groups) && cfg.topk_groups <= cfg.num_groups,
            "MoE routing of {k} of {e} experts in {} groups (top {}) is not a valid configuration",
            cfg.num_groups,
            cfg.topk_groups
        );
        need(logits, DType::F32, rows * e, "route_topk logits");
        need(bias, DType::F32, e, "route_topk bias");
        need(ids, DType::U32, rows * k, "route_topk ids");
        need(weights, DType::F32, rows * k, "route_topk weights");
        self.launch(
            &self.inner.kernels.moe_route,
            LaunchConfig {
                grid_dim: (rows.div_ceil(128) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                A::from(ptr(logits)),
                A::from(rows as i32),
                A::from(e as i32),
                A::from(ptr(bias)),
                A::from(k as i32),
                A::from(cfg.num_groups as i32),
                A::from(cfg.topk_groups as i32),
                A::from(i32::from(cfg.renormalize)),
                A::from(cfg.routed_scaling_factor),
                A::from(ptr(ids)),
                A::from(ptr(weights)),
            ],
        );
    }

    /// The weights' device addresses, when all are bf16 with rows of whole 16-byte chunks
    /// (what the grouped kernels load) and there are at most [`MOE_MAX_EXPERTS`].
    fn expert_table(&self, weights: &[&Linear<Self>]) -> Option<T> {
        let fits =
            |w: &&Linear<Self>| w.weight.dtype() == DType::BF16 && w.in_features.is_multiple_of(8);
        if weights.is_empty() || weights.len() > MOE_MAX_EXPERTS || !weights.iter().all(fits) {
            return None;
        }
        let words = weights
            .iter()
            .flat_map(|w| {
                let at = ptr(&w.weight);
                [at as u32, (at >> 32) as u32]
            })
            .collect();
        Some(self.upload(&HostTensor::from_u32(words)))
    }

    fn groups_experts(&self, rows: usize) -> bool {
        rows <= self.inner.moe_grouped_rows
    }

    fn moe_grouped(&self, x: &T, routed: Routed<'_, Self>, bank: ExpertBank<'_, Self>, y: &mut T) {
        let Routed { rows, k, .. } = routed;
        if rows == 0 {
            return;
        }
        let (hidden, inter, experts) = (bank.hidden, bank.inter, bank.count);
        assert!(
            experts <= MOE_MAX_EXPERTS,
            "the grouped CUDA experts take at most {MOE_MAX_EXPERTS} experts per bank, not {experts}"
        );
        let pairs = rows * k;
        need(x, DType::F32, rows * hidden, "moe_grouped input");
        need(y, DType::F32, rows * hidden, "moe_grouped output");
        need(routed.ids, DType::U32, pairs, "moe_grouped ids");
        need(routed.weights, DType::F32, pairs, "moe_grouped weights");
        need(
            bank.gate_up,
            DType::U32,
            2 * experts,
            "moe_grouped gate/up table",
        );
        need(bank.down, DType::U32, 2 * experts, "moe_grouped down table");
        let offsets = self.zeros(DType::U32, &[experts + 1]);
        let order = self.zeros(DType::U32, &[pairs]);
        let act = self.zeros(DType::F32, &[pairs, inter]);
        let out = self.zeros(DType::F32, &[pairs, hidden]);
        let (first, count) = (bank.first as i32, experts as i32);
        self.launch(
            &self.inner.kernels.moe_sort,
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (experts.next_multiple_of(32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                A::from(ptr(routed.ids)),
                A::from(pairs as i32),
                A::from(first),
                A::from(count),
                A::from(ptr(&offsets)),
                A::from(ptr(&order)),
            ],
        );
        let (clamp, limit) = bank.limit.map_or((0i32, 0.0f32), |l| (1, l));
        let per_expert = |features: usize| LaunchConfig {
            grid_dim: (features.div_ceil(MOE_WARPS) as u32, experts as u32, 1),
            block_dim: ((MOE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            &self.inner.kernels.moe_gate_up,
            per_expert(inter),
            &[
                A::from(ptr(x)),
                A::from(hidden as i32),
                A::from(ptr(bank.gate_up)),
                A::from(ptr(&offsets)),
                A::from(ptr(&order)),
                A::from(k as i32),
                A::from(inter as i32),
                A::from(clamp),
                A::from(limit),
                A::from(ptr(&act)),
            ],
        );
        self.launch(
            &self.inner.kernels.moe_down,
            per_expert(hidden),
            &[
                A::from(ptr(&act)),
                A::from(inter as i32),
                A::from(ptr(bank.down)),
                A::from(ptr(&offsets)),
                A::from(ptr(&order)),
                A::from(ptr(routed.weights)),
                A::from(hidden as i32),
                A::from(ptr(&out)),
            ],
        );
        self.launch(
            &self.inner.kernels.moe_combine,
            flat_cfg(rows * hidden),
            &[
                A::from(ptr(y)),
                A::from(ptr(&out)),
                A::from(ptr(routed.ids)),
                A::from(rows as i64),
                A::from(k as i32),
                A::from(first),
                A::from(count),
                A::from(hidden as i32),
            ],
        );
    }

    /// The expert's rows and weights travel in the scratch table; a block per row (the rows
    /// of one expert are distinct, so no two blocks add into the same row).
    fn scatter_add_rows(&self, y: &mut T, src: &T, expert: &ExpertRows, dim: usize) {
        let n = expert.rows.len();
        assert_eq!(
            n,
            expert.weights.len(),
            "scatter_add_rows: a weight per row"
        );
        let Some(&last) = expert.rows.iter().max() else {
            return;
        };
        need(src, DType::F32, n * dim, "scatter_add_rows source");
        need(
            y,
            DType::F32,
            (last as usize + 1) * dim,
            "scatter_add_rows output",
        );
        let mut bytes = Vec::with_capacity(8 * n);
        bytes.extend(expert.rows.iter().flat_map(|r| r.to_le_bytes()));
        bytes.extend(expert.weights.iter().flat_map(|w| w.to_le_bytes()));
        let table = self.upload_table(&bytes);
        self.launch(
            &self.inner.kernels.scatter_add_rows,
            rows_cfg(n, threads_for(dim).min(256)),
            &[
                A::from(ptr(y)),
                A::from(ptr(src)),
                A::from(table),
                A::from(table + 4 * n as u64),
                A::from(dim as i32),
            ],
        );
    }

    fn hc_expand(&self, x: &T, rows: usize, n: usize, hidden: usize, out: &mut T) {
        if rows == 0 {
            return;
        }
        need(x, DType::F32, rows * hidden, "hc_expand input");
        need(out, DType::F32, rows * n * hidden, "hc_expand output");
        self.launch(
            &self.inner.kernels.hc_expand,
            flat_cfg(rows * n * hidden),
            &[
                A::from(ptr(x)),
                A::from(rows as i64),
                A::from(n as i32),
                A::from(hidden as i32),
                A::from(ptr(out)),
            ],
        );
    }

    /// One kernel: a block per row (thread 0 computes the weights and the Sinkhorn passes,
    /// every thread the weighted sum of the streams).
    fn hc_collapse(
        &self,
        streams: &T,
        logits: &T,
        hc: HcParams<'_, Self>,
        rows: usize,
        hidden: usize,
        x: &mut T,
        post: &mut T,
        comb: &mut T,
    ) {
        if rows == 0 {
            return;
        }
        let n = hc.streams;
        assert!(
            n <= HC_MAX_STREAMS,
            "the CUDA mHC collapse takes up to {HC_MAX_STREAMS} streams, not {n}"
        );
        let width = (2 + n) * n;
        need(
            streams,
            DType::F32,
            rows * n * hidden,
            "hc_collapse streams",
        );
        need(logits, DType::F32, rows * width, "hc_collapse logits");
        need(hc.base, DType::F32, width, "hc_collapse base");
        need(hc.scale, DType::F32, 3, "hc_collapse scale");
        need(x, DType::F32, rows * hidden, "hc_collapse input");
        need(post, DType::F32, rows * n, "hc_collapse post weights");
        need(
            comb,
            DType::F32,
            rows * n * n,
            "hc_collapse combine matrices",
        );
        self.launch(
            &self.inner.kernels.hc_collapse,
            rows_cfg(rows, threads_for(hidden).min(256)),
            &[
                A::from(ptr(streams)),
                A::from(ptr(logits)),
                A::from(ptr(hc.base)),
                A::from(ptr(hc.scale)),
                A::from(n as i32),
                A::from(hc.sinkhorn_iters as i32),
                A::from(hc.eps),
                A::from(hidden as i32),
                A::from(ptr(x)),
                A::from(ptr(post)),
                A::from(ptr(comb)),
            ],
        );
    }

    fn hc_merge(
        &self,
        streams: &mut T,
        y: &T,
        post: &T,
        comb: &T,
        rows: usize,
        n: usize,
        hidden: usize,
    ) {
        if rows == 0 {
            return;
        }
        assert!(
            n <= HC_MAX_STREAMS,
            "the CUDA mHC merge takes up to {HC_MAX_STREAMS} streams, not {n}"
        );
        need(streams, DType::F32, rows * n * hidden, "hc_merge streams");
        need(y, DType::F32, rows * hidden, "hc_merge input");
        need(post, DType::F32, rows * n, "hc_merge post");
        need(comb, DType::F32, rows * n * n, "hc_merge comb");
        self.launch(
            &self.inner.kernels.hc_merge,
            flat_cfg(rows * hidden),
            &[
                A::from(ptr(streams)),
                A::from(ptr(y)),
                A::from(ptr(post)),
                A::from(ptr(comb)),
                A::from(rows as i64),
                A::from(n as i32),
                A::from(hidden as i32),
            ],
        );
    }

    fn hc_mean(&self, streams: &T, rows: usize, n: usize, hidden: usize, out: &mut T) {
        if rows == 0 {
            return;
        }
        need(streams, DType::F32, rows * n * hidden, "hc_mean streams");
        need(out, DType::F32, rows * hidden, "hc_mean output");
        self.launch(
            &self.inner.kernels.hc_mean,
            flat_cfg(rows * hidden),
            &[
                A::from(ptr(streams)),
                A::from(rows as i64),
                A::from(n as i32),
                A::from(hidden as i32),
                A::from(ptr(out)),
            ],
        );
    }

    /// One launch over the step's new rows, each writing into its sequence's blocks (grown
    /// first) through a table of destination addresses.
    fn mla_append(
        &self,
        ckv: &T,
        seqs: &Seqs,
        states: &mut [&mut MlaState<Self>],
        norm: &T,
        dims: MlaDims,
        eps: f32,
        indexer: Option<(&T, &T, usize, usize)>,
    ) {
        let rows = seqs.iter().map(|s| s.end).max().unwrap_or(0);
        if rows == 0 {
            return;
        }
        let (r, dr) = (dims.rank, dims.rope);
        need(ckv, DType::F32, rows * (r + dr), "mla_append input");
        need(norm, DType::F32, r, "mla_append norm");
        let (kw, gw) = indexer.map_or((0, 0), |(_, _, kw, gw)| (kw, gw));
        if let Some((keys, gate, _, _)) = indexer {
            need(keys, DType::F32, rows * kw, "mla_append indexer keys");
            need(gate, DType::F32, rows * gw, "mla_append indexer gate");
        }
        // Per row: latent, rope, key and gate destinations (0: none).
        let mut dst = vec![0u64; 4 * rows];
        for (range, state) in seqs.iter().zip(states.iter_mut()) {
            let n = range.len();
            let mut caches = vec![&mut state.kv_latent, &mut state.k_rope];
            if let (Some(ix), Some(_)) = (state.indexer.as_mut(), indexer) {
                caches.push(&mut ix.keys);
                caches.push(&mut ix.pool_gate);
            }
            for (slot, cache) in caches.into_iter().enumerate() {
                if cache.width() == 0 {
                    continue;
                }
                let start = cache.rows();
                cache.grow(start + n);
                for (j, row) in range.clone().enumerate() {
                    dst[4 * row + slot] = row_address(cache, start + j);
                }
                cache.advance(n);
            }
        }
        let bytes: Vec<u8> = dst.iter().flat_map(|a| a.to_le_bytes()).collect();
        let table = self.upload_table(&bytes);
        let (keys, gate) = indexer.map_or((0, 0), |(k, g, _, _)| (ptr(k), ptr(g)));
        self.launch(
            &self.inner.kernels.mla_append,
            rows_cfg(rows, threads_for(r).min(256)),
            &[
                A::from(ptr(ckv)),
                A::from(r as i32),
                A::from(dr as i32),
                A::from(ptr(norm)),
                A::from(eps),
                A::from(keys),
                A::from(kw as i32),
                A::from(gate),
                A::from(gw as i32),
                A::from(table),
            ],
        );
    }

    /// The query is mapped into latent space and the attended latent back through `kv_b` by
    /// two batched GEMMs (a batch per head); between them one kernel scores and attends over
    /// each row's blocks (a block of warps per row and head).
    fn mla_attention(
        &self,
        q: &T,
        seqs: &Seqs,
        states: &[&MlaState<Self>],
        kv_b: &T,
        dims: MlaDims,
        out: &mut T,
    ) {
        let MlaDims {
            heads: h,
            rank: r,
            nope: dn,
            rope: dr,
            v_head: dv,
        } = dims;
        let rows = seqs.iter().map(|s| s.end).max().unwrap_or(0);
        if rows == 0 {
            return;
        }
        assert!(
            r <= 32 * MLA_LANE_R && dr <= 32 * MLA_LANE_ROPE,
            "the CUDA MLA attention takes latents up to {} and rope slots up to {} wide, not {r} \
             and {dr}",
            32 * MLA_LANE_R,
            32 * MLA_LANE_ROPE
        );
        need(q, DType::F32, rows * h * (dn + dr), "mla_attention query");
        need(kv_b, DType::F32, h * (dn + dv) * r, "mla_attention kv_b");
        need(out, DType::F32, rows * h * dv, "mla_attention output");
        // Per row: its first block entry and visible tokens; per sequence, its blocks.
        let mut meta = vec![0u32; 2 * rows];
        let mut blocks: Vec<u64> = Vec::new();
        for (range, state) in seqs.iter().zip(states) {
            let cached = state.tokens(r);
            let first = cached - range.len();
            let at = (blocks.len() / 2) as u32;
            for b in 0..cached.div_ceil(BLOCK_ROWS) {
                blocks.push(ptr(state.kv_latent.block(b)));
                blocks.push(if dr > 0 {
                    ptr(state.k_rope.block(b))
                } else {
                    0
                });
            }
            for (j, row) in range.clone().enumerate() {
                meta[2 * row] = at;
                meta[2 * row + 1] = (first + j + 1) as u32;
            }
        }
        let mut bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.resize(bytes.len().next_multiple_of(8), 0);
        let blocks_at = bytes.len() as u64;
        bytes.extend(blocks.iter().flat_map(|a| a.to_le_bytes()));
        let table = self.upload_table(&bytes);

        let q_lat = self.zeros(DType::F32, &[rows, h, r]);
        let o_lat = self.zeros(DType::F32, &[rows, h, r]);
        let f32_t = blas_sys::cudaDataType::CUDA_R_32F;
        let (q_row, w_head) = ((h * (dn + dr)) as i32, ((dn + dv) * r) as i64);
        // q_lat[t][h] = Wk_h (dn × r)ᵀ · q_nope[t][h]: column-major, (r × T) = (r × dn)·(dn × T).
        self.batched_gemm(BatchedGemm {
            trans_a: false,
            m: r,
            n: rows,
            k: dn,
            a: (ptr(kv_b), r as i32, w_head),
            b: (ptr(q), q_row, (dn + dr) as i64),
            c: (ptr(&q_lat), (h * r) as i32, r as i64),
            batch: h,
            f32_t,
        });
        self.launch(
            &self.inner.kernels.mla_attention,
            LaunchConfig {
                grid_dim: (rows as u32, h as u32, 1),
                block_dim: ((MLA_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                A::from(ptr(&q_lat)),
                A::from(ptr(q)),
                A::from(h as i32),
                A::from(dn as i32),
                A::from(dr as i32),
                A::from(r as i32),
                A::from(1.0 / ((dn + dr) as f32).sqrt()),
                A::from(table),
                A::from(table + blocks_at),
                A::from(ptr(&o_lat)),
            ],
        );
        // out[t][h] = Wv_h (dv × r) · o_lat[t][h]: column-major, (dv × T) = (r × dv)ᵀ·(r × T).
        self.batched_gemm(BatchedGemm {
            trans_a: true,
            m: dv,
            n: rows,
            k: r,
            a: (ptr(kv_b) + (dn * r * 4) as u64, r as i32, w_head),
            b: (ptr(&o_lat), (h * r) as i32, r as i64),
            c: (ptr(out), (h * dv) as i32, dv as i64),
            batch: h,
            f32_t,
        });
    }
}

/// The device address of row `row` of `rows` (its block must be held).
fn row_address(rows: &PagedRows<CudaBackend>, row: usize) -> u64 {
    ptr(rows.block(row / BLOCK_ROWS)) + ((row % BLOCK_ROWS) * rows.width() * 4) as u64
}

/// One cuBLAS strided batched f32 product, column-major: `C_i (m × n) = op(A_i) · B_i`, each
/// operand given as (address, leading dimension, stride between batch entries).
struct BatchedGemm {
    trans_a: bool,
    m: usize,
    n: usize,
    k: usize,
    a: (u64, i32, i64),
    b: (u64, i32, i64),
    c: (u64, i32, i64),
    batch: usize,
    f32_t: blas_sys::cudaDataType,
}

impl CudaBackend {
    fn batched_gemm(&self, g: BatchedGemm) {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the operands are live device buffers whose sizes the caller checked.
        let r = unsafe {
            blas::gemm_strided_batched_ex(
                *self.inner.blas.handle(),
                op(g.trans_a),
                op(false),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                (&alpha as *const f32).cast(),
                g.a.0 as *const _,
                g.f32_t,
                g.a.1,
                g.a.2,
                g.b.0 as *const _,
                g.f32_t,
                g.b.1,
                g.b.2,
                (&beta as *const f32).cast(),
                g.c.0 as *mut _,
                g.f32_t,
                g.c.1,
                g.c.2,
                g.batch as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(r, "batched GEMM");
    }
}

/// A delta-rule kernel's warps per block and blocks per head for `quads` column quads per row
/// group (`DeltaShape` in kernels.cu): a warp owns `4 · quads` columns, a block up to 4 warps.
fn delta_rule_shape(d: usize, quads: usize) -> (usize, usize) {
    let columns = 4 * quads;
    let warps = (d / columns).min(4);
    (warps, d / (columns * warps))
}

impl CudaBackend {
    /// The delta-rule kernel for heads of width `d` over `sequences` sequences, and its column
    /// quads per row group (`VQ` in kernels.cu). Measured on an H200 (32 heads x 128): with
    /// 4 quads, 32 and 128 decoding sequences take 54 and 171 us against 62 and 207 us with 2;
    /// one prefilling sequence (32768 tokens) takes 22.2 ms with 2 quads against 26.2 ms with
    /// 4, its 128 blocks of 4 warps filling more of the device than 64.
    fn delta_rule_kernel(
        &self,
        d: usize,
        sequences: usize,
    ) -> (&cudarc::driver::CudaFunction, usize) {
        let k = &self.inner.kernels;
        match d {
            16 => (&k.delta_rule_d16, 4),
            32 => (&k.delta_rule_d32, 4),
            64 => (&k.delta_rule_d64, 4),
            128 if sequences < FEW_SEQUENCES => (&k.delta_rule_d128_q2, 2),
            128 => (&k.delta_rule_d128, 4),
            _ => {
                panic!("the CUDA delta rule is built for head widths {DELTA_HEAD_DIMS:?}, not {d}")
            }
        }
    }

    /// The in-place RMSNorm kernel for a weight's dtype.
    fn rms_norm_in_place_kernel(&self, w: &T) -> &cudarc::driver::CudaFunction {
        match w.dtype() {
            DType::F32 => &self.inner.kernels.rms_norm_in_place_f32,
            DType::BF16 => &self.inner.kernels.rms_norm_in_place_bf16,
            other => panic!("CUDA rms_norm_in_place weights are f32 or bf16, not {other}"),
        }
    }

    /// `entries` as the kernels' `SeqEntry` table, uploaded; returns its device address.
    fn seq_table(&self, entries: &[SeqEntry]) -> u64 {
        let bytes: Vec<u8> = entries
            .iter()
            .flat_map(|e| [e.state, e.first as u64, e.rows as u64])
            .flat_map(u64::to_le_bytes)
            .collect();
        self.upload_table(&bytes)
    }

    /// Copies `bytes` into the hybrid operations' scratch table on the stream and returns its
    /// address. Launches queued earlier read the previous contents: the copy runs after them.
    fn upload_table(&self, bytes: &[u8]) -> u64 {
        let mut scratch = self.inner.scratch.lock();
        let s = &mut *scratch;
        let at = self.ensure(&mut s.retired, &mut s.hybrid_table, bytes.len());
        if let Some(buf) = s.hybrid_table.as_mut() {
            self.htod(buf, bytes);
        }
        at
    }
}
