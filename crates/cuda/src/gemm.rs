//! Products on the device: cuBLAS GEMMs (f32 or bf16 inputs, f32 or bf16 output) and the
//! GEMV kernels that serve one or two rows over bf16 weights, alone or with the RMSNorm (and
//! SiLU·mul) before them fused in.

use crate::device::{check, Arg as A, CudaBackend};
use crate::ops::{need, ptr, GEMV_WARPS, T};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::LaunchConfig;
use tandem_engine::DType;

/// One `out (rows, n) (+)= x (rows, k) · W (n, k)ᵀ` on device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Product {
    pub(crate) x: u64,
    pub(crate) rows: usize,
    pub(crate) w: u64,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) out: u64,
    pub(crate) accumulate: bool,
}

/// A cuBLAS product with its operand types, as a traced step records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GemmOp {
    p: Product,
    x_type: blas_sys::cudaDataType,
    w_type: blas_sys::cudaDataType,
    out_type: blas_sys::cudaDataType,
}

impl CudaBackend {
    /// cuBLAS, with `x` and `W` of the given types and f32 output and accumulation.
    pub(crate) fn gemm(
        &self,
        p: Product,
        x_type: blas_sys::cudaDataType,
        w_type: blas_sys::cudaDataType,
    ) {
        self.gemm_to(p, x_type, w_type, blas_sys::cudaDataType::CUDA_R_32F);
    }

    /// [`CudaBackend::gemm`] with an output of `out_type` (f32 accumulation either way).
    pub(crate) fn gemm_to(
        &self,
        p: Product,
        x_type: blas_sys::cudaDataType,
        w_type: blas_sys::cudaDataType,
        out_type: blas_sys::cudaDataType,
    ) {
        self.submit(crate::trace::Op::Gemm(GemmOp {
            p,
            x_type,
            w_type,
            out_type,
        }));
    }

    /// Queues the cuBLAS call of `g` on the stream now.
    pub(crate) fn gemm_now(&self, g: &GemmOp) {
        let GemmOp {
            p,
            x_type,
            w_type,
            out_type,
        } = *g;
        let (alpha, beta) = (1.0f32, if p.accumulate { 1.0f32 } else { 0.0f32 });
        // Row-major out (rows, n) = x (rows, k) · Wᵀ is, column-major, out (n, rows) =
        // W(k, n)ᵀ · x(k, rows).
        // SAFETY: the pointers are live device buffers whose sizes the caller checked.
        let r = unsafe {
            blas::gemm_ex(
                *self.inner.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                p.n as i32,
                p.rows as i32,
                p.k as i32,
                (&alpha as *const f32).cast(),
                p.w as *const _,
                w_type,
                p.k as i32,
                p.x as *const _,
                x_type,
                p.k as i32,
                (&beta as *const f32).cast(),
                p.out as *mut _,
                out_type,
                p.n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check(r, "GEMM");
    }

    /// The GEMV kernel: f32 activations (up to 8 rows), bf16 weights.
    pub(crate) fn gemv_bf16(&self, p: Product) {
        let kn = &self.inner.kernels;
        let by_rows = [
            &kn.gemv_bf16_1,
            &kn.gemv_bf16_2,
            &kn.gemv_bf16_3,
            &kn.gemv_bf16_4,
            &kn.gemv_bf16_5,
            &kn.gemv_bf16_6,
            &kn.gemv_bf16_7,
            &kn.gemv_bf16_8,
        ];
        self.launch_gemv(by_rows, p);
    }

    /// [`CudaBackend::gemv_bf16`] over a block-FP8 weight (`p.k` a multiple of 16): one byte
    /// read a weight, each scaled by its tile's factor in the sum.
    pub(crate) fn gemv_fp8(&self, p: Product) {
        let kn = &self.inner.kernels;
        let by_rows = [
            &kn.gemv_fp8_1,
            &kn.gemv_fp8_2,
            &kn.gemv_fp8_3,
            &kn.gemv_fp8_4,
            &kn.gemv_fp8_5,
            &kn.gemv_fp8_6,
            &kn.gemv_fp8_7,
            &kn.gemv_fp8_8,
        ];
        self.launch_gemv(by_rows, p);
    }

    /// The kernel of `by_rows` for `p.rows` (1..=8; more take the 8-row one), over `p`.
    fn launch_gemv(&self, by_rows: [&cudarc::driver::CudaFunction; 8], p: Product) {
        let f = by_rows[p.rows.clamp(1, 8) - 1];
        let cfg = self.gemv_cfg(p.n, 0);
        let (k32, n32, acc32) = (p.k as i32, p.n as i32, i32::from(p.accumulate));
        self.launch(
            f,
            cfg,
            &[
                A::from(p.x),
                A::from(k32),
                A::from(p.w),
                A::from(n32),
                A::from(p.out),
                A::from(acc32),
            ],
        );
    }
}

impl CudaBackend {
    /// About two blocks per SM (by default), each warp taking every so many of `items`.
    pub(crate) fn gemv_cfg(&self, items: usize, shared_mem_bytes: usize) -> LaunchConfig {
        let per_warp = match self.inner.gemv_blocks_per_sm {
            0 => 1,
            b => gemv_items_per_warp(items, b, self.inner.sms),
        };
        LaunchConfig {
            grid_dim: (items.div_ceil(per_warp * GEMV_WARPS).max(1) as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: shared_mem_bytes as u32,
        }
    }

    /// Whether `rows` rows through `w` take an RMSNorm-fused GEMV (bf16 weights, few rows,
    /// the normalised rows fit in shared memory).
    pub(crate) fn fused_gemv(&self, rows: usize, w: &tandem_engine::backend::Linear<Self>) -> bool {
        w.weight.dtype() == DType::BF16
            && rows <= self.inner.gemv_rows
            && w.in_features.is_multiple_of(8)
            && rows * w.in_features * 4 <= self.inner.gemv_smem
    }

    /// `out = rms_norm(x) · Wᵀ` (`silu`: `out = silu(g) * u` of the gate/up halves) for up to
    /// 8 rows in one kernel.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_norm(
        &self,
        x: &T,
        norm: &T,
        rows: usize,
        eps: f32,
        w: &tandem_engine::backend::Linear<Self>,
        out: &mut T,
        silu: bool,
    ) {
        let k = w.in_features;
        let items = if silu {
            w.out_features / 2
        } else {
            w.out_features
        };
        need(x, DType::F32, rows * k, "fused GEMV input");
        need(out, DType::F32, rows * items, "fused GEMV output");
        need(norm, DType::F32, k, "RMSNorm weight");
        assert_eq!(w.weight.len(), w.out_features * k, "GEMV weight shape");
        let kn = &self.inner.kernels;
        let plain = [
            &kn.gemv_norm_bf16_1,
            &kn.gemv_norm_bf16_2,
            &kn.gemv_norm_bf16_3,
            &kn.gemv_norm_bf16_4,
            &kn.gemv_norm_bf16_5,
            &kn.gemv_norm_bf16_6,
            &kn.gemv_norm_bf16_7,
            &kn.gemv_norm_bf16_8,
        ];
        let gated = [
            &kn.gemv_norm_silu_bf16_1,
            &kn.gemv_norm_silu_bf16_2,
            &kn.gemv_norm_silu_bf16_3,
            &kn.gemv_norm_silu_bf16_4,
            &kn.gemv_norm_silu_bf16_5,
            &kn.gemv_norm_silu_bf16_6,
            &kn.gemv_norm_silu_bf16_7,
            &kn.gemv_norm_silu_bf16_8,
        ];
        let f = if silu { gated } else { plain }[rows.clamp(1, 8) - 1];
        let (k32, n32) = (k as i32, items as i32);
        self.launch(
            f,
            self.gemv_cfg(items, rows * k * 4),
            &[
                A::from(ptr(x)),
                A::from(ptr(norm)),
                A::from(eps),
                A::from(k32),
                A::from(ptr(&w.weight)),
                A::from(n32),
                A::from(ptr(out)),
            ],
        );
    }
}

/// Items per warp for a GEMV grid of about `blocks_per_sm` blocks per SM: what the largest such
/// grid needs (rounded up), unless rounding down (a few more blocks, which SMs that finish
/// early pick up) leaves less on the busiest SM. E.g. 3,072 QKV features on 132 SMs: two per
/// warp is 192 blocks, so 60 SMs stream two blocks' features while 72 stream one (32 vs 23.3
/// features a warp slot on average); one per warp is 384 blocks, at most 3 × 8 = 24 on any SM.
fn gemv_items_per_warp(items: usize, blocks_per_sm: usize, sms: usize) -> usize {
    let slots = blocks_per_sm * sms * GEMV_WARPS;
    let up = items.div_ceil(slots).max(1);
    let down = (items / slots).max(1);
    // The features the busiest SM streams with `per` features a warp.
    let busiest = |per: usize| items.div_ceil(per * GEMV_WARPS).div_ceil(sms) * per * GEMV_WARPS;
    if busiest(down) < busiest(up) {
        down
    } else {
        up
    }
}

#[cfg(test)]
mod tests {
    use super::gemv_items_per_warp;

    #[test]
    fn gemv_grid_balances_the_busiest_sm() {
        // H200 (132 SMs), two blocks per SM: QKV rounds down, the rest up.
        assert_eq!(gemv_items_per_warp(3072, 2, 132), 1);
        assert_eq!(gemv_items_per_warp(8192, 2, 132), 4);
        assert_eq!(gemv_items_per_warp(2048, 2, 132), 1);
        assert_eq!(gemv_items_per_warp(128_256, 2, 132), 61);
        assert_eq!(gemv_items_per_warp(5, 2, 132), 1);
    }
}
