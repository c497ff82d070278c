//! MLA over paged latents on the device, the [`HybridOps`](tandem_engine::backend::HybridOps)
//! bodies hybrid.rs delegates to. The cache ([`MlaState`]) is blocks of rows in device memory:
//! the append writes the step's rows through a table of destination addresses, and attention
//! runs absorbed — two batched cuBLAS products through `kv_b` around one kernel that scores and
//! attends over each row's blocks (a table of block addresses per sequence).

use crate::device::{check, Arg as A, CudaBackend};
use crate::ops::{need, ptr, rows_cfg, threads_for, T};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::LaunchConfig;
use tandem_engine::backend::hybrid::{MlaDims, Seqs};
use tandem_engine::backend::latents::BLOCK_ROWS;
use tandem_engine::backend::latents::{MlaState, PagedRows};
use tandem_engine::{Backend, DType};

/// Latent and rope values per lane of the MLA attention kernel (`MLA_LANE_R`,
/// `MLA_LANE_ROPE` in kernels.cu), and its warps per block (`MLA_WARPS`).
const MLA_LANE_R: usize = 16;
const MLA_LANE_ROPE: usize = 2;
const MLA_WARPS: usize = 4;

impl CudaBackend {
    /// One launch over the step's new rows, each writing into its sequence's blocks (grown
    /// first) through a table of destination addresses.
    #[allow(clippy::too_many_arguments)] // the trait method's arguments, passed on
    pub(crate) fn run_mla_append(
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
    /// each row's blocks (a block of warps per row and group of heads, which read each latent
    /// once for the group).
    pub(crate) fn run_mla_attention(
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
        let group = crate::env::mla_heads_per_block();
        let kernel = match group {
            1 => &self.inner.kernels.mla_attention,
            _ => &self.inner.kernels.mla_attention_h4,
        };
        self.launch(
            kernel,
            LaunchConfig {
                grid_dim: (rows as u32, h.div_ceil(group) as u32, 1),
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BatchedGemm {
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
        self.submit(crate::trace::Op::Batched(g));
    }

    /// Queues the cuBLAS call of `g` on the stream now.
    pub(crate) fn batched_gemm_now(&self, g: &BatchedGemm) {
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
