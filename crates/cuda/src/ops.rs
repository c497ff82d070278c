//! The [`Ops`] half of the traits: each operation is one or two kernel launches (or a cuBLAS
//! call) on the backend's stream over the leading `rows` of its buffers.

use crate::device::{check, Arg as A, CudaBackend, CudaStorage};
use crate::gemm::Product;
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::LaunchConfig;
use tandem_core::{BlockId, SamplingParams};
use tandem_engine::backend::QkvLayout;
use tandem_engine::{DType, HostTensor, KvCache, Ops, StepMeta, Tensor};

/// Rows up to which products over block-FP8 weights take the FP8 GEMV.
const FP8_GEMV_ROWS: usize = 8;

pub(crate) type T = Tensor<CudaBackend>;

/// Keys per run of a context bucket (an attention split covers a power-of-two number of runs).
const SPLIT_KEYS: usize = 64;
/// Warps per block of the GEMV kernels (`GEMV_WARPS` in kernels.cu); their launch bounds
/// keep two blocks resident per SM.
pub(crate) const GEMV_WARPS: usize = 8;

/// The power-of-two bucket of `SPLIT_KEYS` runs covering a context (1 up to `SPLIT_KEYS`).
pub(crate) fn context_bucket(max_context: usize) -> usize {
    max_context.div_ceil(SPLIT_KEYS).max(1).next_power_of_two()
}

/// How many blocks split each context in a step's attention: the context's bucket (so a
/// recorded decode graph serves every context up to its bucket; splits past a context's end
/// write empty partials that the merge skips), or fewer and longer splits where the step's
/// (token, kv head) pairs already make `blocks` blocks (8 per SM by default).
pub(crate) fn attention_splits(
    tokens: usize,
    kv_heads: usize,
    max_context: usize,
    blocks: usize,
) -> usize {
    let room = blocks / tokens.saturating_mul(kv_heads).max(1);
    let cap = if room == 0 {
        1
    } else {
        1 << (usize::BITS - 1 - room.leading_zeros())
    };
    context_bucket(max_context).min(cap)
}

pub(crate) fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn ptr(t: &T) -> u64 {
    t.storage().ptr()
}

pub(crate) fn need(t: &T, dtype: DType, elems: usize, what: &str) {
    assert!(
        t.dtype() == dtype && t.len() >= elems,
        "{what}: needs {elems} {dtype} values, has {} {}",
        t.len(),
        t.dtype()
    );
}

/// One thread per element over `n` elements, 256 to a block.
pub(crate) fn flat_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn threads_for(width: usize) -> u32 {
    (width.next_power_of_two().clamp(32, 1024)) as u32
}

impl Ops for CudaBackend {
    fn check_attention(&self, layout: QkvLayout, kv_dtype: DType) -> tandem_engine::Result<()> {
        let group = layout.num_heads / layout.num_kv_heads.max(1);
        if layout.num_heads.is_multiple_of(layout.num_kv_heads.max(1))
            && self
                .inner
                .attention
                .get(kv_dtype, group, layout.head_dim)
                .is_some()
        {
            return Ok(());
        }
        Err(tandem_engine::Error::InvalidRequest(format!(
            "the CUDA backend has no attention kernel for {}/{} heads of width {} with {} K/V \
             (built: 1..={} query heads per KV head, head_dim {:?}, f32 or bf16)",
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            kv_dtype,
            crate::device::MAX_GROUP,
            crate::device::HEAD_DIMS
        )))
    }

    fn embed(&self, table: &T, ids: &T, rows: usize, out: &mut T) {
        let dim = table.shape()[1];
        need(out, DType::F32, rows * dim, "embed output");
        let f = match table.dtype() {
            DType::F32 => &self.inner.kernels.embed_f32,
            DType::BF16 => &self.inner.kernels.embed_bf16,
            other => panic!("CUDA embedding tables are f32 or bf16, not {other}"),
        };
        let (t, i, o, d) = (ptr(table), ptr(ids), ptr(out), dim as i32);
        self.launch(
            f,
            rows_cfg(rows, threads_for(dim).min(256)),
            &[A::from(t), A::from(i), A::from(d), A::from(o)],
        );
    }

    fn rms_norm(&self, x: &T, weight: &T, rows: usize, eps: f32, out: &mut T) {
        need(out, DType::F32, rows * weight.len(), "rms_norm output");
        let f = &self.inner.kernels.rms_norm;
        self.launch_rms_norm(f, x, weight, rows, eps, ptr(out));
    }

    fn matmul(
        &self,
        x: &T,
        rows: usize,
        w: &T,
        out_features: usize,
        in_features: usize,
        out: &mut T,
        accumulate: bool,
    ) {
        if rows == 0 {
            return;
        }
        need(x, DType::F32, rows * in_features, "matmul input");
        need(out, DType::F32, rows * out_features, "matmul output");
        assert_eq!(w.len(), out_features * in_features, "matmul weight shape");
        let p = Product {
            x: ptr(x),
            rows,
            w: ptr(w),
            n: out_features,
            k: in_features,
            out: ptr(out),
            accumulate,
        };
        let (f32_t, bf16_t) = (
            blas_sys::cudaDataType::CUDA_R_32F,
            blas_sys::cudaDataType::CUDA_R_16BF,
        );
        match w.dtype() {
            DType::F32 => self.gemm(p, f32_t, f32_t),
            DType::BF16 if rows <= self.inner.gemv_rows && in_features.is_multiple_of(8) => {
                self.gemv_bf16(p)
            }
            DType::BF16 => {
                // cuBLAS has no f32 × bf16 product: round the activations to bf16 first.
                let n = rows * in_features;
                let mut scratch = self.inner.scratch.lock();
                let s = &mut *scratch;
                let xb = self.ensure(&mut s.retired, &mut s.bf16, n * 2);
                let (xp, n64) = (p.x, n as i64);
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launch(
                    &self.inner.kernels.f32_to_bf16,
                    cfg,
                    &[A::from(xp), A::from(n64), A::from(xb)],
                );
                self.gemm(Product { x: xb, ..p }, bf16_t, bf16_t);
            }
            // One byte a weight: the GEMV stays ahead of dequantising for cuBLAS up to the
            // 8 rows it takes, whatever the bf16 crossover (`gemv_rows`).
            DType::F8E4M3 if rows <= FP8_GEMV_ROWS && in_features.is_multiple_of(16) => {
                self.gemv_fp8(p)
            }
            DType::F8E4M3 => {
                // Dequantise to bf16 (what the loader would have kept) and take the bf16 path.
                let wb =
                    tandem_engine::Backend::zeros(self, DType::BF16, &[out_features, in_features]);
                self.fp8_to_bf16(w, out_features, in_features, ptr(&wb));
                self.matmul(x, rows, &wb, out_features, in_features, out, accumulate);
            }
            other => panic!("CUDA matmul takes f32, bf16 or block-FP8 weights, not {other}"),
        }
    }

    fn rms_norm_linear(
        &self,
        x: &T,
        norm: &T,
        rows: usize,
        eps: f32,
        normed: &mut T,
        w: &tandem_engine::backend::Linear<Self>,
        out: &mut T,
    ) {
        if rows == 0 {
            return;
        }
        if self.fused_gemv(rows, w) {
            self.gemv_norm(x, norm, rows, eps, w, out, false);
        } else if self.bf16_gemm_rows(rows, w) {
            self.norm_linear_bf16(x, norm, rows, eps, w, out);
        } else {
            self.rms_norm(x, norm, rows, eps, normed);
            self.linear(normed, rows, w, out, false);
        }
    }

    fn rms_norm_gate_up(
        &self,
        x: &T,
        norm: &T,
        rows: usize,
        eps: f32,
        normed: &mut T,
        w: &tandem_engine::backend::Linear<Self>,
        gate_up: &mut T,
        act: &mut T,
    ) {
        if rows == 0 {
            return;
        }
        if self.fused_gemv(rows, w) && w.out_features.is_multiple_of(2) {
            self.gemv_norm(x, norm, rows, eps, w, act, true);
        } else {
            self.rms_norm(x, norm, rows, eps, normed);
            self.linear(normed, rows, w, gate_up, false);
            self.silu_mul(gate_up, rows, w.out_features / 2, act);
        }
    }

    fn mlp(
        &self,
        x: &mut T,
        norm: &T,
        rows: usize,
        eps: f32,
        normed: &mut T,
        gate_up_w: &tandem_engine::backend::Linear<Self>,
        gate_up: &mut T,
        act: &mut T,
        down: &tandem_engine::backend::Linear<Self>,
        accumulate: bool,
    ) {
        if self.bf16_gemm_rows(rows, gate_up_w) && self.bf16_gemm_rows(rows, down) {
            self.mlp_bf16(x, norm, rows, eps, gate_up_w, down, accumulate);
        } else {
            self.rms_norm_gate_up(x, norm, rows, eps, normed, gate_up_w, gate_up, act);
            self.linear(act, rows, down, x, accumulate);
        }
    }

    fn rope(&self, qkv: &mut T, rows: usize, layout: QkvLayout, positions: &T, theta: f32) {
        let width = layout.row_width();
        need(qkv, DType::F32, rows * width, "rope input");
        let rot = (layout.num_heads + layout.num_kv_heads) as i32;
        let (q, p, w, hd) = (
            ptr(qkv),
            ptr(positions),
            width as i32,
            layout.head_dim as i32,
        );
        let r32 = rows as i32;
        self.launch(
            &self.inner.kernels.rope,
            flat_cfg(rows * rot as usize * layout.head_dim / 2),
            &[
                A::from(q),
                A::from(p),
                A::from(r32),
                A::from(w),
                A::from(rot),
                A::from(hd),
                A::from(theta),
            ],
        );
    }

    fn write_kv(
        &self,
        qkv: &T,
        rows: usize,
        layout: QkvLayout,
        cache: &mut KvCache<Self>,
        layer: usize,
        slot_mapping: &T,
    ) {
        let width = layout.row_width();
        need(qkv, DType::F32, rows * width, "write_kv input");
        let kv_dim = layout.num_kv_heads * layout.head_dim;
        let f = match cache.layout().dtype {
            DType::F32 => &self.inner.kernels.write_kv_f32,
            DType::BF16 => &self.inner.kernels.write_kv_bf16,
            other => panic!("K/V caches are f32 or bf16, not {other}"),
        };
        let (q, s, k, v) = (
            ptr(qkv),
            ptr(slot_mapping),
            ptr(&cache.k[layer]),
            ptr(&cache.v[layer]),
        );
        let (w, ko, vo, kd) = (
            width as i32,
            layout.k_offset() as i32,
            layout.v_offset() as i32,
            kv_dim as i32,
        );
        let r32 = rows as i32;
        self.launch(
            f,
            flat_cfg(rows * kv_dim),
            &[
                A::from(q),
                A::from(r32),
                A::from(w),
                A::from(ko),
                A::from(vo),
                A::from(kd),
                A::from(s),
                A::from(k),
                A::from(v),
            ],
        );
    }

    fn paged_attention(
        &self,
        qkv: &T,
        layout: QkvLayout,
        cache: &KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut T,
    ) {
        self.attention(qkv, layout, cache, layer, meta, out, None);
    }

    fn rope_write_kv_attention(
        &self,
        qkv: &mut T,
        layout: QkvLayout,
        theta: f32,
        cache: &mut KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut T,
    ) {
        // A decode step (one new token per sequence) rotates and writes its K/V inside the
        // attention kernel; other steps take the RoPE + K/V kernel first.
        let decode = meta.num_tokens == meta.num_seqs && self.inner.decode_rope;
        if decode && theta > 0.0 {
            self.attention(qkv, layout, cache, layer, meta, out, Some(theta));
        } else {
            let rows = meta.num_tokens;
            self.rope_write_kv(
                qkv,
                rows,
                layout,
                &meta.positions,
                theta,
                cache,
                layer,
                &meta.slot_mapping,
            );
            self.attention(qkv, layout, cache, layer, meta, out, None);
        }
    }

    fn silu_mul(&self, gate_up: &T, rows: usize, width: usize, out: &mut T) {
        need(gate_up, DType::F32, rows * 2 * width, "silu_mul input");
        need(out, DType::F32, rows * width, "silu_mul output");
        let (g, o, w, r) = (ptr(gate_up), ptr(out), width as i32, rows as i64);
        let f = &self.inner.kernels.silu_mul;
        self.launch(
            f,
            flat_cfg(rows * width),
            &[A::from(g), A::from(r), A::from(w), A::from(o)],
        );
    }

    fn gather_rows(&self, x: &T, dim: usize, index: &T, rows: usize, out: &mut T) {
        need(out, DType::F32, rows * dim, "gather output");
        let (xp, i, o, d) = (ptr(x), ptr(index), ptr(out), dim as i32);
        let f = &self.inner.kernels.gather_rows;
        self.launch(
            f,
            rows_cfg(rows, threads_for(dim).min(1024)),
            &[A::from(xp), A::from(d), A::from(i), A::from(o)],
        );
    }

    fn sample(
        &self,
        logits: &T,
        vocab: usize,
        rows: &[(&SamplingParams, u32)],
        out: &mut Vec<u32>,
    ) {
        out.clear();
        if rows.is_empty() {
            return;
        }
        need(logits, DType::F32, rows.len() * vocab, "sampling logits");
        let mut scratch = self.inner.scratch.lock();
        let s = &mut *scratch;
        s.host_params.clear();
        for &(p, step) in rows {
            s.host_params.extend([
                p.temperature,
                f32::from_bits(p.top_k),
                p.top_p,
                tandem_engine::sampling::uniform_draw(p.seed, step),
            ]);
        }
        let bytes = s.host_params.len() * 4;
        let params = self.ensure(&mut s.retired, &mut s.params, bytes);
        let ids = self.ensure(&mut s.retired, &mut s.ids, rows.len() * 4);
        if let Some(buf) = s.params.as_mut() {
            self.htod(buf, bytemuck::cast_slice(&s.host_params));
        }
        let (l, v) = (ptr(logits), vocab as i32);
        // Greedy rows: a max over vocabulary slices, many blocks per row.
        let best = self.ensure(&mut s.retired, &mut s.best, rows.len() * 8);
        self.submit(crate::trace::Op::Memset {
            at: best,
            bytes: rows.len() * 8,
        });
        let slices = vocab.div_ceil(4096).clamp(1, 64) as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, slices, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            &self.inner.kernels.argmax_partial,
            cfg,
            &[A::from(l), A::from(v), A::from(best)],
        );
        self.launch(
            &self.inner.kernels.sample_rows,
            rows_cfg(rows.len(), 1024),
            &[
                A::from(l),
                A::from(v),
                A::from(params),
                A::from(best),
                A::from(ids),
            ],
        );
        let host = s
            .ids
            .as_ref()
            .map(|buf| self.dtoh(buf, rows.len() * 4))
            .unwrap_or_default();
        out.extend(
            host.chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
    }

    fn read_kv(&self, cache: &KvCache<Self>, blocks: &[BlockId], tokens: usize) -> HostTensor {
        let l = cache.layout();
        let row = l.kv_dim() * l.dtype.size();
        let mut bytes = Vec::with_capacity(l.num_layers * 2 * tokens * row);
        let mut dense = self.alloc(tokens * row);
        let slots = self.slot_list(l.token_slots(blocks, tokens));
        for layer in 0..l.num_layers {
            for part in [&cache.k[layer], &cache.v[layer]] {
                self.copy_slots(part.storage(), &slots, tokens, row, &mut dense, true);
                bytes.extend(self.dtoh(&dense, tokens * row));
            }
        }
        let shape = l.transfer_shape(tokens);
        match HostTensor::from_le_bytes(l.dtype, &shape, &bytes) {
            Ok(t) => t,
            Err(e) => panic!("K/V read of {shape:?}: {e}"),
        }
    }

    fn write_kv_host(
        &self,
        cache: &mut KvCache<Self>,
        blocks: &[BlockId],
        tokens: usize,
        data: &HostTensor,
    ) -> tandem_engine::Result<()> {
        let l = cache.layout();
        l.check_transfer(data, tokens, blocks.len())?;
        let row = l.kv_dim() * l.dtype.size();
        let all = data.to_le_bytes();
        let mut dense = self.alloc(tokens * row);
        let slots = self.slot_list(l.token_slots(blocks, tokens));
        for layer in 0..l.num_layers {
            for (p, part) in [&cache.k[layer], &cache.v[layer]].into_iter().enumerate() {
                let at = (layer * 2 + p) * tokens * row;
                self.htod(&mut dense, &all[at..at + tokens * row]);
                self.copy_slots(part.storage(), &slots, tokens, row, &mut dense, false);
            }
        }
        self.synchronize_checked();
        Ok(())
    }
}

impl CudaBackend {
    /// Paged attention of a step: the tensor-core kernel for prompt-shaped steps over a bf16
    /// cache, else the split kernel; with `decode_rope` (a decode step's RoPE theta) the split
    /// kernel rotates Q and K and writes the step's K/V itself.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        qkv: &T,
        layout: QkvLayout,
        cache: &KvCache<Self>,
        layer: usize,
        meta: &StepMeta<Self>,
        out: &mut T,
        decode_rope: Option<f32>,
    ) {
        let rows = meta.num_tokens;
        if rows == 0 {
            return;
        }
        let group = layout.num_heads / layout.num_kv_heads;
        let dtype = cache.layout().dtype;
        let f = match self.inner.attention.get(dtype, group, layout.head_dim) {
            Some(f) if layout.num_heads.is_multiple_of(layout.num_kv_heads) => f,
            _ => panic!(
                "CUDA attention is built for {} K/V with 1..={} query heads per KV head and \
                 head_dim in {:?}, not {}/{} heads of {}",
                dtype,
                crate::device::MAX_GROUP,
                crate::device::HEAD_DIMS,
                layout.num_heads,
                layout.num_kv_heads,
                layout.head_dim
            ),
        };
        need(
            out,
            DType::F32,
            rows * layout.num_heads * layout.head_dim,
            "attention output",
        );
        if dtype == DType::BF16
            && crate::prefill::prefill_shaped(rows, meta.num_seqs)
            && decode_rope.is_none()
        {
            return self.prefill_attention(qkv, layout, cache, layer, meta, out);
        }
        // Few (token, kv head) blocks over long contexts leave the GPU idle: split each
        // context, one block per split; the last block of each (token, kv head) merges them.
        let bucket = context_bucket(meta.max_context);
        let splits = attention_splits(
            rows,
            layout.num_kv_heads,
            meta.max_context,
            self.inner.attention_blocks_per_sm * self.inner.sms,
        );
        let mut scratch = self.inner.scratch.lock();
        let s = &mut *scratch;
        let (partial, counters) = if splits > 1 {
            let floats = rows * layout.num_heads * splits * (layout.head_dim + 2);
            (
                self.ensure(&mut s.retired, &mut s.attention, floats * 4),
                self.ensure(
                    &mut s.retired,
                    &mut s.split_counters,
                    rows * layout.num_kv_heads * 4,
                ),
            )
        } else {
            (0, 0)
        };
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, layout.num_kv_heads as u32, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (q, k, v, info, tables, o) = (
            ptr(qkv),
            ptr(&cache.k[layer]),
            ptr(&cache.v[layer]),
            ptr(&meta.seq_info),
            ptr(&meta.block_tables),
            ptr(out),
        );
        let (w, nh, nkv, bs, ns, ts) = (
            layout.row_width() as i32,
            layout.num_heads as i32,
            layout.num_kv_heads as i32,
            cache.layout().block_size as i32,
            meta.num_seqs as i32,
            meta.table_stride() as i32,
        );
        let scale = 1.0 / (layout.head_dim as f32).sqrt();
        // Splits tile the bucket, which covers every context of the step.
        let split_keys = (bucket * SPLIT_KEYS / splits) as i32;
        self.launch(
            f,
            cfg,
            &[
                A::from(q),
                A::from(w),
                A::from(nh),
                A::from(nkv),
                A::from(k),
                A::from(v),
                A::from(bs),
                A::from(info),
                A::from(ns),
                A::from(tables),
                A::from(ts),
                A::from(scale),
                A::from(split_keys),
                A::from(partial),
                A::from(counters),
                A::from(o),
                A::from(ptr(&meta.positions)),
                A::from(ptr(&meta.slot_mapping)),
                A::from(decode_rope.unwrap_or(0.0)),
            ],
        );
    }

    /// RoPE and the K/V write of a step in one kernel.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        qkv: &mut T,
        rows: usize,
        layout: QkvLayout,
        positions: &T,
        theta: f32,
        cache: &mut KvCache<Self>,
        layer: usize,
        slot_mapping: &T,
    ) {
        if rows == 0 {
            return;
        }
        need(
            qkv,
            DType::F32,
            rows * layout.row_width(),
            "rope_write_kv input",
        );
        let f = match cache.layout().dtype {
            DType::F32 => &self.inner.kernels.rope_write_kv_f32,
            DType::BF16 => &self.inner.kernels.rope_write_kv_bf16,
            other => panic!("K/V caches are f32 or bf16, not {other}"),
        };
        let heads = layout.num_heads + 2 * layout.num_kv_heads;
        let (r32, nh, nkv, hd) = (
            rows as i32,
            layout.num_heads as i32,
            layout.num_kv_heads as i32,
            layout.head_dim as i32,
        );
        assert!(layout.head_dim <= 256, "RoPE takes heads of up to 256");
        // A thread per (head, pair) of a row; rows on the grid's y.
        let pairs = heads * layout.head_dim / 2;
        let cfg = LaunchConfig {
            grid_dim: (pairs.div_ceil(256) as u32, rows.min(65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            f,
            cfg,
            &[
                A::from(ptr(qkv)),
                A::from(ptr(positions)),
                A::from(r32),
                A::from(nh),
                A::from(nkv),
                A::from(hd),
                A::from(theta),
                A::from(ptr(slot_mapping)),
                A::from(ptr(&cache.k[layer])),
                A::from(ptr(&cache.v[layer])),
            ],
        );
    }

    /// `slots` uploaded as a u32 buffer (the gather/scatter index of a K/V transfer).
    fn slot_list(&self, slots: impl Iterator<Item = usize>) -> CudaStorage {
        let slots: Vec<u32> = slots.map(|s| s as u32).collect();
        let mut s = self.alloc(slots.len() * 4);
        self.htod(&mut s, bytemuck::cast_slice(&slots));
        s
    }

    fn copy_slots(
        &self,
        cache: &CudaStorage,
        slots: &CudaStorage,
        n: usize,
        row_bytes: usize,
        dense: &mut CudaStorage,
        to_dense: bool,
    ) {
        if n == 0 {
            return;
        }
        assert!(
            row_bytes.is_multiple_of(4),
            "K/V rows are whole 32-bit words"
        );
        let (c, s, d) = (cache.ptr(), slots.ptr(), dense.ptr());
        let (n32, words, dir) = (n as i32, (row_bytes / 4) as i32, i32::from(to_dense));
        self.launch(
            &self.inner.kernels.copy_slots,
            rows_cfg(n, threads_for(row_bytes / 4).min(256)),
            &[
                A::from(c),
                A::from(s),
                A::from(n32),
                A::from(words),
                A::from(d),
                A::from(dir),
            ],
        );
    }

    fn synchronize_checked(&self) {
        check(self.inner.stream.synchronize(), "synchronize");
    }
}
