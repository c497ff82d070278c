//! Prompt-shaped steps: attention on tensor cores (`prefill_attention_bf16_d*` in kernels.cu)
//! when a step is mostly prompt rows over a bf16 cache (it replaces the per-token decode
//! attention kernel), and bf16 intermediates between the norms, the MLP and cuBLAS.

use crate::device::{Arg as A, CudaBackend};
use crate::gemm::Product;
use crate::ops::{flat_cfg, need, ptr, rows_cfg, threads_for, T};
use cudarc::cublas::sys::cudaDataType;
use cudarc::driver::{CudaFunction, LaunchConfig};
use tandem_engine::backend::{Linear, QkvLayout};
use tandem_engine::{DType, KvCache, StepMeta};

const BF16: cudaDataType = cudaDataType::CUDA_R_16BF;

/// Whether a step's tokens are mostly prompt rows (at least a tile of them, 8 per sequence
/// on average): such steps take the tensor-core prefill attention over a bf16 cache.
pub(crate) fn prefill_shaped(tokens: usize, seqs: usize) -> bool {
    tokens >= crate::device::PREFILL_TILE && tokens >= 8 * seqs
}

/// Rows per block of the prefill attention kernel (`PrefillShape` in kernels.cu): four warps
/// of two 16-row tiles at head width 64, of one at 128.
fn prefill_block_rows(head_dim: usize) -> usize {
    if head_dim == 64 {
        128
    } else {
        64
    }
}

impl CudaBackend {
    /// Paged attention of a prompt-shaped step over a bf16 cache on tensor cores: one block
    /// per (KV head, tile of queries of one sequence), its [`prefill_block_rows`] rows the
    /// (query, head) pairs of the tile's queries and the KV head's query heads.
    pub(crate) fn prefill_attention(
        &self,
        qkv: &T,
        layout: QkvLayout,
        cache: &KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut T,
    ) {
        let k = &self.inner.kernels;
        // Built for the default block size (addresses by constant shifts) and for any other.
        let f = match (layout.head_dim, cache.layout().block_size) {
            (64, 16) => &k.prefill_attention_bf16_d64_b16,
            (128, 16) => &k.prefill_attention_bf16_d128_b16,
            (64, _) => &k.prefill_attention_bf16_d64,
            (128, _) => &k.prefill_attention_bf16_d128,
            (d, _) => panic!("CUDA prefill attention is built for head_dim 64 and 128, not {d}"),
        };
        // Σ ceil(len / tile) over the sequences is at most tokens / tile + sequences; blocks
        // past the last tile return at once.
        // A block's rows are (query, head) pairs of one KV group: this many queries a tile.
        let group = layout.num_heads / layout.num_kv_heads;
        let queries = prefill_block_rows(layout.head_dim) / group;
        assert!(queries > 0, "GQA groups larger than a prefill tile");
        let tiles = meta.num_tokens.div_ceil(queries) + meta.num_seqs;
        let cfg = LaunchConfig {
            grid_dim: (layout.num_kv_heads as u32, tiles as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (w, nh, nkv, bs, ns, ts) = (
            layout.row_width() as i32,
            layout.num_heads as i32,
            layout.num_kv_heads as i32,
            cache.layout().block_size as i32,
            meta.num_seqs as i32,
            meta.table_stride() as i32,
        );
        let scale = 1.0 / (layout.head_dim as f32).sqrt();
        self.launch(
            f,
            cfg,
            &[
                A::from(ptr(qkv)),
                A::from(w),
                A::from(nh),
                A::from(nkv),
                A::from(ptr(&cache.k[layer])),
                A::from(ptr(&cache.v[layer])),
                A::from(bs),
                A::from(ptr(&meta.seq_info)),
                A::from(ns),
                A::from(ptr(&meta.block_tables)),
                A::from(ts),
                A::from(scale),
                A::from(ptr(out)),
            ],
        );
    }
}

/// Steps of more rows than the GEMV kernels take (prompts, large decode batches) over bf16
/// weights keep the activations that only feed cuBLAS in bf16: the RMSNorm writes its rows in
/// bf16 (no f32 copy to round), and the MLP's [gate | up] product and silu(gate)·up stay in
/// bf16 between its two GEMMs (a third of the bytes an 8k-token prompt moved there in f32).
impl CudaBackend {
    /// Whether `rows` of a product with `w` take cuBLAS over bf16 inputs.
    pub(crate) fn bf16_gemm_rows(&self, rows: usize, w: &Linear<Self>) -> bool {
        w.weight.dtype() == DType::BF16 && rows > self.inner.gemv_rows
    }

    /// RMSNorm of `rows` of `x` by `norm` into `out` (a device address) with `kernel`
    /// (`rms_norm`: f32 rows, `rms_norm_to_bf16`: bf16 rows), one block a row.
    pub(crate) fn launch_rms_norm(
        &self,
        kernel: &CudaFunction,
        x: &T,
        norm: &T,
        rows: usize,
        eps: f32,
        out: u64,
    ) {
        let dim = norm.len();
        need(x, DType::F32, rows * dim, "rms_norm input");
        let (xp, wp, d) = (ptr(x), ptr(norm), dim as i32);
        self.launch(
            kernel,
            // A thread per four values (the kernels move float4s), at most 256.
            rows_cfg(rows, threads_for(dim.div_ceil(4)).min(256)),
            &[
                A::from(xp),
                A::from(wp),
                A::from(d),
                A::from(eps),
                A::from(out),
            ],
        );
    }

    /// `out = rms_norm(x) · Wᵀ` with the normalised rows in bf16.
    pub(crate) fn norm_linear_bf16(
        &self,
        x: &T,
        norm: &T,
        rows: usize,
        eps: f32,
        w: &Linear<Self>,
        out: &mut T,
    ) {
        need(out, DType::F32, rows * w.out_features, "linear output");
        let mut scratch = self.inner.scratch.lock();
        let s = &mut *scratch;
        let xb = self.ensure(&mut s.retired, &mut s.bf16, rows * w.in_features * 2);
        self.launch_rms_norm(&self.inner.kernels.rms_norm_to_bf16, x, norm, rows, eps, xb);
        let p = Product {
            x: xb,
            rows,
            w: ptr(&w.weight),
            n: w.out_features,
            k: w.in_features,
            out: ptr(out),
            accumulate: false,
        };
        self.gemm(p, BF16, BF16);
    }

    /// The whole SwiGLU MLP of [`tandem_engine::Ops::mlp`] over bf16 intermediates.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mlp_bf16(
        &self,
        x: &mut T,
        norm: &T,
        rows: usize,
        eps: f32,
        gate_up: &Linear<Self>,
        down: &Linear<Self>,
        accumulate: bool,
    ) {
        let (hidden, width) = (gate_up.in_features, gate_up.out_features / 2);
        assert_eq!(down.in_features, width, "down projection width");
        assert!(width.is_multiple_of(2), "gate/up width must be even");
        need(
            x,
            DType::F32,
            rows * hidden.max(down.out_features),
            "mlp rows",
        );
        let mut scratch = self.inner.scratch.lock();
        let s = &mut *scratch;
        let xb = self.ensure(&mut s.retired, &mut s.bf16, rows * hidden * 2);
        let gu = self.ensure(&mut s.retired, &mut s.mlp_gate_up, rows * 2 * width * 2);
        let act = self.ensure(&mut s.retired, &mut s.mlp_act, rows * width * 2);
        self.launch_rms_norm(&self.inner.kernels.rms_norm_to_bf16, x, norm, rows, eps, xb);
        let first = Product {
            x: xb,
            rows,
            w: ptr(&gate_up.weight),
            n: 2 * width,
            k: hidden,
            out: gu,
            accumulate: false,
        };
        self.gemm_to(first, BF16, BF16, BF16);
        let (r, w32) = (rows as i64, width as i32);
        self.launch(
            &self.inner.kernels.silu_mul_bf16,
            flat_cfg(rows * width / 2),
            &[A::from(gu), A::from(r), A::from(w32), A::from(act)],
        );
        let second = Product {
            x: act,
            rows,
            w: ptr(&down.weight),
            n: down.out_features,
            k: width,
            out: ptr(x),
            accumulate,
        };
        self.gemm(second, BF16, BF16);
    }
}
