//! Attention of prompt-shaped steps on tensor cores (`prefill_attention_bf16_d*` in
//! kernels.cu): when a step is mostly prompt rows over a bf16 cache, this replaces the
//! per-token decode attention kernel.

use crate::device::{Arg as A, CudaBackend};
use crate::ops::{ptr, T};
use cudarc::driver::LaunchConfig;
use tandem_engine::backend::QkvLayout;
use tandem_engine::{KvCache, StepMeta};

/// Whether a step's tokens are mostly prompt rows (at least a tile of them, 8 per sequence
/// on average): such steps take the tensor-core prefill attention over a bf16 cache.
pub(crate) fn prefill_shaped(tokens: usize, seqs: usize) -> bool {
    tokens >= crate::device::PREFILL_TILE && tokens >= 8 * seqs
}

impl CudaBackend {
    /// Paged attention of a prompt-shaped step over a bf16 cache on tensor cores: one block
    /// per (tile of `PREFILL_TILE` queries of one sequence, query head).
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
        let f = match layout.head_dim {
            64 => &k.prefill_attention_bf16_d64,
            128 => &k.prefill_attention_bf16_d128,
            d => panic!("CUDA prefill attention is built for head_dim 64 and 128, not {d}"),
        };
        // Σ ceil(len / tile) over the sequences is at most tokens / tile + sequences; blocks
        // past the last tile return at once.
        let tiles = meta.num_tokens.div_ceil(crate::device::PREFILL_TILE) + meta.num_seqs;
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, layout.num_heads as u32, 1),
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
