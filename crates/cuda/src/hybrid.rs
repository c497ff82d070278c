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
//! The delta rule's bodies are in delta_rule.rs, MoE's in moe.rs and MLA's in mla.rs; the
//! trait methods here delegate to them. No operation of the family waits for the device.

use crate::device::{Arg as A, CudaBackend};
use crate::ops::{flat_cfg, need, ptr, rows_cfg, threads_for, T};
use cudarc::driver::LaunchConfig;
use tandem_engine::backend::hybrid::{
    At, DeltaForm, DeltaInputs, ExpertBank, ExpertRows, HcParams, HybridOps, MlaDims, Routed, Seqs,
};
use tandem_engine::backend::hybrid::{KdaGate, MoeConfig};
use tandem_engine::backend::latents::MlaState;
use tandem_engine::backend::Linear;
use tandem_engine::DType;

/// The widest short convolution the kernel takes (`CONV_MAX_W` in kernels.cu).
const CONV_MAX_W: usize = 8;
/// Rows one thread of the short convolution walks (`CONV_CHUNK` in kernels.cu).
const CONV_CHUNK: usize = 16;
/// Streams the mHC merge keeps in registers (`HC_MAX_STREAMS` in kernels.cu).
const HC_MAX_STREAMS: usize = 8;

/// One non-empty sequence of a per-sequence launch (`SeqEntry` in kernels.cu).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqEntry {
    /// Device address of its window or state.
    pub(crate) state: u64,
    /// Its first row in the step.
    pub(crate) first: usize,
    /// Its rows.
    pub(crate) rows: usize,
}

impl HybridOps for CudaBackend {
    /// The recurrent form unless `TANDEM_CUDA_DELTA_CHUNKS=1` (and the chunked kernels could
    /// be set up): so far the token loop measured faster (docs/benchmarks.md, session 30).
    fn prompt_form(&self) -> DeltaForm {
        if self.inner.chunked_prompts {
            DeltaForm::Chunked
        } else {
            DeltaForm::Recurrent
        }
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

    /// The recurrent kernel for decoding sequences, the chunked kernels for prompts
    /// (delta_rule.rs).
    fn delta_rule(
        &self,
        inputs: DeltaInputs<'_, Self>,
        seqs: &Seqs,
        forms: &[DeltaForm],
        states: &mut [&mut T],
        out: &mut T,
    ) {
        self.run_delta_rule(inputs, seqs, forms, states, out);
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

    /// MoE on the device (moe.rs).
    fn route_topk(
        &self,
        logits: &T,
        rows: usize,
        bias: &T,
        cfg: &MoeConfig,
        ids: &mut T,
        weights: &mut T,
    ) {
        self.run_route_topk(logits, rows, bias, cfg, ids, weights)
    }

    /// MoE on the device (moe.rs).
    fn expert_table(&self, weights: &[&Linear<Self>]) -> Option<T> {
        self.run_expert_table(weights)
    }

    fn groups_experts(&self, rows: usize) -> bool {
        rows <= self.inner.moe_grouped_rows
    }

    /// MoE on the device (moe.rs).
    fn moe_grouped(&self, x: &T, routed: Routed<'_, Self>, bank: ExpertBank<'_, Self>, y: &mut T) {
        self.run_moe_grouped(x, routed, bank, y)
    }

    /// MoE on the device (moe.rs).
    fn scatter_add_rows(&self, y: &mut T, src: &T, expert: &ExpertRows, dim: usize) {
        self.run_scatter_add_rows(y, src, expert, dim)
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

    /// MLA over paged latents (mla.rs).
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
        self.run_mla_append(ckv, seqs, states, norm, dims, eps, indexer)
    }

    /// MLA over paged latents (mla.rs).
    fn mla_attention(
        &self,
        q: &T,
        seqs: &Seqs,
        states: &[&MlaState<Self>],
        kv_b: &T,
        dims: MlaDims,
        out: &mut T,
    ) {
        self.run_mla_attention(q, seqs, states, kv_b, dims, out)
    }
}

impl CudaBackend {
    /// The in-place RMSNorm kernel for a weight's dtype.
    fn rms_norm_in_place_kernel(&self, w: &T) -> &cudarc::driver::CudaFunction {
        match w.dtype() {
            DType::F32 => &self.inner.kernels.rms_norm_in_place_f32,
            DType::BF16 => &self.inner.kernels.rms_norm_in_place_bf16,
            other => panic!("CUDA rms_norm_in_place weights are f32 or bf16, not {other}"),
        }
    }

    /// `entries` as the kernels' `SeqEntry` table, uploaded; returns its device address.
    pub(crate) fn seq_table(&self, entries: &[SeqEntry]) -> u64 {
        let bytes: Vec<u8> = entries
            .iter()
            .flat_map(|e| [e.state, e.first as u64, e.rows as u64])
            .flat_map(u64::to_le_bytes)
            .collect();
        self.upload_table(&bytes)
    }

    /// Copies `bytes` into the hybrid operations' scratch table on the stream and returns its
    /// address. Launches queued earlier read the previous contents: the copy runs after them.
    /// Inside a traced step each table gets its own place in the step's staging instead.
    pub(crate) fn upload_table(&self, bytes: &[u8]) -> u64 {
        if self.traced() {
            return self.stage(bytes);
        }
        let mut scratch = self.inner.scratch.lock();
        let s = &mut *scratch;
        let at = self.ensure(&mut s.retired, &mut s.hybrid_table, bytes.len());
        if let Some(buf) = s.hybrid_table.as_mut() {
            self.htod(buf, bytes);
        }
        at
    }
}
