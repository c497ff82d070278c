//! The CPU backend: `Vec<f32>` tensors, GEMMs on the `gemm` crate (packed, SIMD, threaded
//! through rayon), element-wise work split over rayon's pool.

use super::{Backend, QkvLayout};
use crate::batch::ForwardBatch;
use crate::kv_pool::KvLayout;
use rayon::prelude::*;
use tandem_core::BlockId;

/// Paged K/V for every layer: `[slot][kv_dim]` per layer, slot = block * block_size + offset.
#[derive(Debug)]
pub struct CpuKvCache {
    layout: KvLayout,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// Runs the engine on the host CPU.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// A CPU backend using rayon's global pool.
    pub fn new() -> Self {
        Self
    }
}

#[allow(unsafe_code)]
mod gemm_call {
    /// `out (m×n) = x (m×k) · wᵀ` where `w` is `(n, k)` row-major; adds into `out` when
    /// `accumulate`.
    pub fn x_wt(
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) {
        assert!(x.len() >= m * k, "x too short");
        assert!(w.len() >= n * k, "w too short");
        assert!(out.len() >= m * n, "out too short");
        let parallelism = if m * n * k >= 64 * 1024 {
            gemm::Parallelism::Rayon(0)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the asserts above guarantee every index the strides below can reach
        // (row-major out/x, column view of row-major w) lies inside its slice; `out` is
        // borrowed mutably, so it aliases neither input.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                accumulate,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
}

/// Dot product with eight independent partial sums, so it vectorises (a plain `sum()` must
/// keep the sequential order and does not).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn rope_tables(head_dim: usize, theta: f32, pos: u32) -> impl Iterator<Item = (f32, f32)> {
    let half = head_dim / 2;
    (0..half).map(move |i| {
        // Same arithmetic as the reference implementation: inv_freq in f32, then pos * inv_freq.
        let inv_freq = 1.0f32 / theta.powf((2 * i) as f32 / head_dim as f32);
        let f = pos as f32 * inv_freq;
        (f.cos(), f.sin())
    })
}

fn rotate_half(x: &mut [f32], cs: &[(f32, f32)]) {
    let half = x.len() / 2;
    for (i, &(c, s)) in cs.iter().enumerate().take(half) {
        let a = x[i];
        let b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

impl Backend for CpuBackend {
    type Tensor = Vec<f32>;
    type KvCache = CpuKvCache;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload(&self, data: Vec<f32>) -> Vec<f32> {
        data
    }

    fn zeros(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn download(&self, t: &Vec<f32>) -> Vec<f32> {
        t.clone()
    }

    fn kv_cache(&self, layout: KvLayout) -> CpuKvCache {
        let len = layout.num_blocks * layout.block_size * layout.kv_dim();
        CpuKvCache {
            layout,
            k: (0..layout.num_layers).map(|_| vec![0.0; len]).collect(),
            v: (0..layout.num_layers).map(|_| vec![0.0; len]).collect(),
        }
    }

    fn embed(&self, table: &Vec<f32>, dim: usize, ids: &[u32], out: &mut Vec<f32>) {
        out.resize(ids.len() * dim, 0.0);
        for (row, &id) in out.chunks_exact_mut(dim).zip(ids) {
            let at = id as usize * dim;
            row.copy_from_slice(&table[at..at + dim]);
        }
    }

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, rows: usize, eps: f32, out: &mut Vec<f32>) {
        let dim = weight.len();
        out.resize(rows * dim, 0.0);
        out.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .for_each(|(o, xi)| {
                let ms = xi.iter().map(|v| v * v).sum::<f32>() / dim as f32;
                let r = 1.0 / (ms + eps).sqrt();
                for ((o, &v), &w) in o.iter_mut().zip(xi).zip(weight) {
                    *o = v * r * w;
                }
            });
    }

    fn matmul_raw(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &Vec<f32>,
        out_features: usize,
        in_features: usize,
        out: &mut Vec<f32>,
        accumulate: bool,
    ) {
        out.resize(rows * out_features, 0.0);
        gemm_call::x_wt(out, x, w, rows, out_features, in_features, accumulate);
    }

    fn rope(&self, qkv: &mut Vec<f32>, layout: QkvLayout, positions: &[u32], theta: f32) {
        let width = layout.row_width();
        let hd = layout.head_dim;
        let rotated = (layout.num_heads + layout.num_kv_heads) * hd;
        qkv.par_chunks_mut(width)
            .zip(positions.par_iter())
            .for_each(|(row, &pos)| {
                let cs: Vec<(f32, f32)> = rope_tables(hd, theta, pos).collect();
                for head in row[..rotated].chunks_exact_mut(hd) {
                    rotate_half(head, &cs);
                }
            });
    }

    fn write_kv(
        &self,
        qkv: &Vec<f32>,
        layout: QkvLayout,
        cache: &mut CpuKvCache,
        layer: usize,
        slot_mapping: &[u32],
    ) {
        let width = layout.row_width();
        let kv_dim = layout.num_kv_heads * layout.head_dim;
        let (ko, vo) = (layout.k_offset(), layout.v_offset());
        for (row, &slot) in qkv.chunks_exact(width).zip(slot_mapping) {
            let at = slot as usize * kv_dim;
            cache.k[layer][at..at + kv_dim].copy_from_slice(&row[ko..ko + kv_dim]);
            cache.v[layer][at..at + kv_dim].copy_from_slice(&row[vo..vo + kv_dim]);
        }
    }

    fn attention(
        &self,
        qkv: &Vec<f32>,
        layout: QkvLayout,
        cache: &CpuKvCache,
        layer: usize,
        batch: &ForwardBatch,
        out: &mut Vec<f32>,
    ) {
        let hd = layout.head_dim;
        let heads = layout.num_heads;
        let group = heads / layout.num_kv_heads;
        let kv_dim = layout.num_kv_heads * hd;
        let width = layout.row_width();
        let bs = cache.layout.block_size;
        let scale = 1.0 / (hd as f32).sqrt();
        let (kc, vc) = (&cache.k[layer], &cache.v[layer]);
        out.resize(batch.num_tokens() * heads * hd, 0.0);
        // Each token row of `out` depends only on its own query and its sequence's cache.
        let mut row_seq = vec![0usize; batch.num_tokens()];
        for (s, seq) in batch.seqs.iter().enumerate() {
            row_seq[seq.start..seq.start + seq.len].fill(s);
        }
        out.par_chunks_mut(heads * hd)
            .enumerate()
            .for_each(|(t, out_row)| {
                let seq = &batch.seqs[row_seq[t]];
                let ctx = seq.cached + (t - seq.start) + 1; // causal: positions 0..=pos
                let slot = |j: usize| seq.block_table[j / bs].0 as usize * bs + j % bs;
                let q_row = &qkv[t * width..t * width + heads * hd];
                let mut scores = vec![0.0f32; ctx];
                for h in 0..heads {
                    let kvh = h / group;
                    let q = &q_row[h * hd..(h + 1) * hd];
                    let mut max = f32::NEG_INFINITY;
                    for (j, s) in scores.iter_mut().enumerate() {
                        let at = slot(j) * kv_dim + kvh * hd;
                        let k = &kc[at..at + hd];
                        *s = dot(q, k) * scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0.0;
                    for s in scores.iter_mut() {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let o = &mut out_row[h * hd..(h + 1) * hd];
                    o.fill(0.0);
                    for (j, &p) in scores.iter().enumerate() {
                        let at = slot(j) * kv_dim + kvh * hd;
                        let w = p / sum;
                        for (o, &v) in o.iter_mut().zip(&vc[at..at + hd]) {
                            *o += w * v;
                        }
                    }
                }
            });
    }

    fn silu_mul(&self, gate_up: &Vec<f32>, rows: usize, out: &mut Vec<f32>) {
        let inter = gate_up.len() / rows.max(1) / 2;
        out.resize(rows * inter, 0.0);
        out.par_chunks_mut(inter)
            .zip(gate_up.par_chunks(2 * inter))
            .for_each(|(o, gu)| {
                let (g, u) = gu.split_at(inter);
                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                    *o = g / (1.0 + (-g).exp()) * u;
                }
            });
    }

    fn gather_rows(&self, x: &Vec<f32>, dim: usize, rows: &[usize], out: &mut Vec<f32>) {
        out.resize(rows.len() * dim, 0.0);
        for (o, &r) in out.chunks_exact_mut(dim).zip(rows) {
            o.copy_from_slice(&x[r * dim..(r + 1) * dim]);
        }
    }

    fn export_kv(&self, cache: &CpuKvCache, blocks: &[BlockId], tokens: usize) -> Vec<f32> {
        let l = cache.layout;
        let kv_dim = l.kv_dim();
        let mut data = Vec::with_capacity(l.num_layers * 2 * tokens * kv_dim);
        for layer in 0..l.num_layers {
            for part in [&cache.k[layer], &cache.v[layer]] {
                for t in 0..tokens {
                    let at = (blocks[t / l.block_size].0 as usize * l.block_size
                        + t % l.block_size)
                        * kv_dim;
                    data.extend_from_slice(&part[at..at + kv_dim]);
                }
            }
        }
        data
    }

    fn import_kv(&self, cache: &mut CpuKvCache, blocks: &[BlockId], tokens: usize, data: &[f32]) {
        let l = cache.layout;
        let kv_dim = l.kv_dim();
        let mut src = data.chunks_exact(kv_dim);
        for layer in 0..l.num_layers {
            for part in [&mut cache.k[layer], &mut cache.v[layer]] {
                for t in 0..tokens {
                    let at = (blocks[t / l.block_size].0 as usize * l.block_size
                        + t % l.block_size)
                        * kv_dim;
                    if let Some(row) = src.next() {
                        part[at..at + kv_dim].copy_from_slice(row);
                    }
                }
            }
        }
    }
}
