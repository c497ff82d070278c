//! Causal attention of a step's new queries over a paged K/V cache (GQA), tiled so that a
//! block of keys is read once for a block of queries and every query head that shares its
//! KV head — not once per query row. Softmax is online (running max and sum per query), so
//! no score row of the context's length is ever materialised.
//!
//! The cache is `[slot][kv_dim]` per layer (slot = block * block_size + offset), f32 or bf16.

use crate::matmul::dot_block;
use crate::matmul::WeightElem;
use crate::tasks::OutPtr;
use crate::vector::{exp_inplace, weighted_rows};
use rayon::prelude::*;

/// Query vectors (rows × heads of a KV group) per tile; their accumulators live on the stack.
const QUERY_VECTORS: usize = 64;
/// Widest head handled.
const MAX_HEAD_DIM: usize = 256;
/// Largest cache block handled (keys scored at once).
const MAX_BLOCK: usize = 64;
/// Most query heads sharing one KV head.
const MAX_GROUP: usize = 16;
/// Query vectors from which a tile takes the AVX-512 path (keys transposed once per block
/// and scored 16 at a time against every query vector): below it, decode-sized tiles keep
/// the row-by-row path, which does not pay for the transposition.
const TILE_MIN_VECTORS: usize = 16;

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub num_heads: usize,
    /// KV heads (a divisor of `num_heads`).
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Values per row of the query activation (queries start at column 0).
    pub q_stride: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Multiplier of `q·k`.
    pub scale: f32,
}

/// The step's sequences as the per-step metadata holds them: for sequence `i`,
/// `info[3i..3i+3]` is `(first query row, new tokens, tokens cached before this step)` and
/// `tables[i*stride..]` its cache blocks in order.
#[derive(Clone, Copy, Debug)]
pub struct SeqTable<'a> {
    /// `(start, len, cached)` per sequence.
    pub info: &'a [u32],
    /// Block tables, `stride` entries per sequence.
    pub tables: &'a [u32],
    /// Entries per block table.
    pub stride: usize,
}

/// One sequence of a [`SeqTable`].
#[derive(Clone, Copy, Debug)]
struct SeqBlocks<'a> {
    start: usize,
    len: usize,
    cached: usize,
    blocks: &'a [u32],
}

impl<'a> SeqTable<'a> {
    /// Sequences in the table.
    pub fn len(&self) -> usize {
        self.info.len() / 3
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, i: usize) -> SeqBlocks<'a> {
        SeqBlocks {
            start: self.info[3 * i] as usize,
            len: self.info[3 * i + 1] as usize,
            cached: self.info[3 * i + 2] as usize,
            blocks: &self.tables[i * self.stride..(i + 1) * self.stride],
        }
    }

    fn iter(&self) -> impl Iterator<Item = SeqBlocks<'a>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

/// `out` (one row of `num_heads * head_dim` per query row) = softmax(q·kᵀ·scale) · v over each
/// query's causal context. Keys and values of the step's own tokens must already be in the cache.
pub fn paged_attention<W: WeightElem>(
    q: &[f32],
    k_cache: &[W],
    v_cache: &[W],
    seqs: SeqTable<'_>,
    shape: AttentionShape,
    out: &mut [f32],
) {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim: hd,
        q_stride,
        block_size: bs,
        scale,
    } = shape;
    assert!(
        num_kv_heads > 0 && num_heads % num_kv_heads == 0,
        "heads {num_heads} over kv heads {num_kv_heads}"
    );
    let group = num_heads / num_kv_heads;
    assert!(
        group <= MAX_GROUP,
        "{group} query heads per KV head, at most {MAX_GROUP}"
    );
    assert!(hd <= MAX_HEAD_DIM, "head_dim {hd} above {MAX_HEAD_DIM}");
    // Query rows per tile: as many as keep every head of the group in one tile.
    let query_block = (QUERY_VECTORS / group).max(1);
    let kv_dim = num_kv_heads * hd;
    let out_width = num_heads * hd;
    assert!(
        bs > 0 && bs <= MAX_BLOCK,
        "block size {bs} outside 1..={MAX_BLOCK}"
    );
    assert!(
        seqs.tables.len() >= seqs.len() * seqs.stride,
        "block tables too short"
    );
    for s in seqs.iter() {
        let ctx = s.cached + s.len;
        assert!(
            s.blocks.len() * bs >= ctx,
            "block table too short for {ctx} tokens"
        );
        assert!(q.len() >= (s.start + s.len) * q_stride, "queries too short");
        assert!(out.len() >= (s.start + s.len) * out_width, "out too short");
        for &b in s.blocks.iter().take(ctx.div_ceil(bs)) {
            assert!(
                (b as usize + 1) * bs * kv_dim <= k_cache.len().min(v_cache.len()),
                "block {b} outside the cache"
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    let tiled =
        bs == 16 && hd.is_multiple_of(16) && crate::isa::current() == crate::isa::Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    let tiled = false;
    // Sequences whose tiles take the AVX-512 path get their keys transposed into panels (and
    // values widened to f32) once per call, for every tile of theirs to read.
    let uses_tiles =
        |s: &SeqBlocks<'_>| tiled && s.len.min(query_block) * group >= TILE_MIN_VECTORS;
    let region = |s: &SeqBlocks<'_>| 2 * (s.cached + s.len).div_ceil(64) * 64 * hd;
    let panels_len: usize = seqs
        .iter()
        .filter(|s| uses_tiles(s))
        .map(|s| region(&s) * num_kv_heads)
        .sum();
    PANELS.with_borrow_mut(|panels| {
        if panels.len() < panels_len {
            panels.resize(panels_len, 0.0);
        }
        let panels = &mut panels[..panels_len];
        #[cfg(target_arch = "x86_64")]
        if panels_len > 0 {
            let mut rest = &mut panels[..];
            for s in seqs.iter().filter(|s| uses_tiles(s)) {
                for kvh in 0..num_kv_heads {
                    let (mine, tail) = std::mem::take(&mut rest).split_at_mut(region(&s));
                    rest = tail;
                    x86::transpose_context(
                        mine,
                        k_cache,
                        v_cache,
                        s.blocks,
                        s.cached + s.len,
                        kv_dim,
                        kvh,
                        hd,
                    );
                }
            }
        }
        let panels = &panels[..];
        // Tasks: (sequence, kv head, query block).
        let mut tasks = 0usize;
        for s in seqs.iter() {
            tasks += s.len.div_ceil(query_block) * num_kv_heads;
        }
        let out_ptr = OutPtr(out.as_mut_ptr());
        (0..tasks).into_par_iter().for_each(|mut t| {
            // Find this task's sequence (and where its panels start) without allocating a list.
            let mut seq = seqs.get(0);
            let mut at = 0;
            for s in seqs.iter() {
                let n = s.len.div_ceil(query_block) * num_kv_heads;
                if t < n {
                    seq = s;
                    break;
                }
                t -= n;
                if uses_tiles(&s) {
                    at += region(&s) * num_kv_heads;
                }
            }
            let kvh = t % num_kv_heads;
            let qb = t / num_kv_heads;
            let r0 = qb * query_block;
            let r1 = (r0 + query_block).min(seq.len);
            let nq = (r1 - r0) * group;
            #[cfg(target_arch = "x86_64")]
            if nq >= TILE_MIN_VECTORS && uses_tiles(&seq) {
                let tile = x86::Tile {
                    q,
                    q_stride,
                    kvh,
                    hd,
                    group,
                    start: seq.start,
                    cached: seq.cached,
                    r0,
                    r1,
                    scale,
                    out_width,
                };
                let mine = &panels[at + kvh * region(&seq)..][..region(&seq)];
                // SAFETY: AVX-512 is present (checked above); the panels cover the sequence's
                // context padded to whole chunks, every query row and output row the tile
                // touches was bounds-checked before the tasks started, and the tile's output rows
                // and heads belong to this task alone.
                unsafe { x86::tile512(&tile, mine, out_ptr.0) };
                return;
            }
            {
                let mut acc_buf = [0.0f32; QUERY_VECTORS * MAX_HEAD_DIM];
                let mut max_buf = [0.0f32; QUERY_VECTORS];
                let mut sum_buf = [0.0f32; QUERY_VECTORS];
                let (acc, mx, sm) = (
                    &mut acc_buf[..nq * hd],
                    &mut max_buf[..nq],
                    &mut sum_buf[..nq],
                );
                acc.fill(0.0);
                mx.fill(f32::NEG_INFINITY);
                sm.fill(0.0);
                // Keys this block can see: up to the last query row's position.
                let ctx_last = seq.cached + r1;
                let mut scores = [0.0f32; MAX_GROUP * MAX_BLOCK];
                let mut key = 0;
                while key < ctx_last {
                    let block = seq.blocks[key / bs] as usize;
                    let in_block = (bs - key % bs).min(ctx_last - key);
                    let base = (block * bs + key % bs) * kv_dim + kvh * hd;
                    for r in r0..r1 {
                        // Causal: query row r (position cached + r) sees keys 0..=cached + r.
                        let visible = (seq.cached + r + 1).saturating_sub(key).min(in_block);
                        if visible == 0 {
                            continue;
                        }
                        let row = seq.start + r;
                        // Scores of this row's `group` heads against the visible keys: one small
                        // strided GEMM (heads are adjacent in the row, keys kv_dim apart).
                        let qoff = row * q_stride + kvh * group * hd;
                        dot_block(
                            &q[qoff..],
                            hd,
                            group,
                            &k_cache[base..],
                            kv_dim,
                            visible,
                            hd,
                            &mut scores,
                            MAX_BLOCK,
                        );
                        for g in 0..group {
                            let qi = (r - r0) * group + g;
                            let sc = &mut scores[g * MAX_BLOCK..g * MAX_BLOCK + visible];
                            let mut block_max = f32::NEG_INFINITY;
                            for s in sc.iter_mut() {
                                *s *= scale;
                                block_max = block_max.max(*s);
                            }
                            let a = &mut acc[qi * hd..(qi + 1) * hd];
                            if block_max > mx[qi] {
                                let c = (mx[qi] - block_max).exp();
                                sm[qi] *= c;
                                a.iter_mut().for_each(|x| *x *= c);
                                mx[qi] = block_max;
                            }
                            let m = mx[qi];
                            sc.iter_mut().for_each(|s| *s -= m);
                            exp_inplace(sc);
                            sm[qi] += sc.iter().sum::<f32>();
                            weighted_rows(a, sc, &v_cache[base..], kv_dim);
                        }
                    }
                    key += in_block;
                }
                for r in r0..r1 {
                    let row = seq.start + r;
                    for g in 0..group {
                        let h = kvh * group + g;
                        let qi = (r - r0) * group + g;
                        let inv = 1.0 / sm[qi];
                        let o = out_ptr;
                        // SAFETY: each task is one (sequence, KV head, query block): row `row`, head `h`
                        // belong to this task alone, and the output is borrowed for the whole call;
                        // bounds were checked above.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(o.0.add(row * out_width + h * hd), hd)
                        };
                        for (d, &a) in dst.iter_mut().zip(&acc[qi * hd..(qi + 1) * hd]) {
                            *d = a * inv;
                        }
                    }
                }
            }
        });
    });
}

thread_local! {
    /// Transposed key panels and widened values of the calling thread's last call, kept to be
    /// reused (a forward pass allocates only when the context outgrows the largest before).
    static PANELS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MAX_HEAD_DIM, QUERY_VECTORS};
    use crate::matmul::WeightElem;
    use crate::vector::x86::exp_ps;
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    /// Fills `region` for KV head `kvh` of a sequence of `ctx` tokens in cache blocks
    /// `blocks` (16 tokens each): first its keys as panels of 16 (`[panel][d][16]`, key
    /// `16p + j`'s value `d` at `(p * hd + d) * 16 + j`), then its values widened to f32
    /// (`[key][d]`), both padded with zeros to a whole number of 64-key chunks.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn transpose_context<W: WeightElem>(
        region: &mut [f32],
        k: &[W],
        v: &[W],
        blocks: &[u32],
        ctx: usize,
        kv_dim: usize,
        kvh: usize,
        hd: usize,
    ) {
        let (kt, vb) = region.split_at_mut(region.len() / 2);
        kt.par_chunks_mut(16 * hd)
            .zip(vb.par_chunks_mut(16 * hd))
            .enumerate()
            .for_each(|(p, (panel, values))| {
                let keys = ctx.saturating_sub(16 * p).min(16);
                if keys < 16 {
                    panel.fill(0.0);
                    values.fill(0.0);
                }
                if keys == 0 {
                    return;
                }
                let base = blocks[p] as usize * 16 * kv_dim + kvh * hd;
                for j in 0..keys {
                    let kr = &k[base + j * kv_dim..][..hd];
                    for (d, x) in kr.iter().enumerate() {
                        panel[d * 16 + j] = x.to_f32();
                    }
                    let vr = &v[base + j * kv_dim..][..hd];
                    for (dst, x) in values[j * hd..(j + 1) * hd].iter_mut().zip(vr) {
                        *dst = x.to_f32();
                    }
                }
            });
    }

    /// One task's tile: query rows `r0..r1` of a sequence, every head of KV head `kvh`.
    pub(super) struct Tile<'a> {
        pub q: &'a [f32],
        pub q_stride: usize,
        pub kvh: usize,
        pub hd: usize,
        pub group: usize,
        pub start: usize,
        pub cached: usize,
        pub r0: usize,
        pub r1: usize,
        pub scale: f32,
        pub out_width: usize,
    }

    /// Keys per chunk of the tile kernel: four cache blocks of 16, one panel of 16 keys each.
    const CHUNK: usize = 64;
    const PANELS: usize = CHUNK / 16;
    /// Query vectors scored together (6 × 4 panels = 24 accumulators in registers).
    const SCORE_ROWS: usize = 6;
    /// Query vectors whose weighted values accumulate together (4 × 4 = 16 accumulators).
    const VALUE_ROWS: usize = 4;

    /// Scores of `R` consecutive query vectors (rows of `q`, `hd` apart) against a chunk's
    /// four transposed key panels (`kt[(p * hd + d) * 16 + j]`): per dimension, four panel
    /// loads serve `R` broadcasts and `4R` FMAs, no horizontal sums.
    ///
    /// # Safety
    /// AVX-512 F present; `R` query vectors of `hd` and four panels of `hd × 16` are in bounds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn scores<const R: usize>(
        q: *const f32,
        hd: usize,
        kt: *const f32,
        out: &mut [[__m512; PANELS]; SCORE_ROWS],
    ) {
        let mut acc = [[_mm512_setzero_ps(); PANELS]; R];
        for d in 0..hd {
            let k = [
                _mm512_loadu_ps(kt.add(d * 16)),
                _mm512_loadu_ps(kt.add((hd + d) * 16)),
                _mm512_loadu_ps(kt.add((2 * hd + d) * 16)),
                _mm512_loadu_ps(kt.add((3 * hd + d) * 16)),
            ];
            for (r, a) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*q.add(r * hd + d));
                for (x, &kp) in a.iter_mut().zip(&k) {
                    *x = _mm512_fmadd_ps(b, kp, *x);
                }
            }
        }
        out[..R].copy_from_slice(&acc);
    }

    /// `acc[r][0..16C] += Σ_j probs[r * CHUNK + j] · vb[j * hd ..][0..16C]` for `R` query
    /// vectors over `keys` keys: each value row's `C` vectors are loaded once for all `R`.
    ///
    /// # Safety
    /// AVX-512 F present; `R` accumulator rows (`hd` apart) and probability rows, and `keys`
    /// value rows of at least `16C` values, are in bounds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weighted<const R: usize, const C: usize>(
        acc: *mut f32,
        hd: usize,
        probs: *const f32,
        vb: *const f32,
        keys: usize,
    ) {
        let mut a = [[_mm512_setzero_ps(); C]; R];
        for (r, row) in a.iter_mut().enumerate() {
            for (c, x) in row.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(acc.add(r * hd + 16 * c));
            }
        }
        for j in 0..keys {
            let mut v = [_mm512_setzero_ps(); C];
            for (c, x) in v.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(vb.add(j * hd + 16 * c));
            }
            for (r, row) in a.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*probs.add(r * CHUNK + j));
                for (x, &vc) in row.iter_mut().zip(&v) {
                    *x = _mm512_fmadd_ps(b, vc, *x);
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            for (c, x) in row.iter().enumerate() {
                _mm512_storeu_ps(acc.add(r * hd + 16 * c), *x);
            }
        }
    }

    /// [`weighted`] over every column of `R` query vectors: slices of four vectors, then one
    /// at a time.
    ///
    /// # Safety
    /// As [`weighted`], with `hd` a multiple of 16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weighted_rows<const R: usize>(
        acc: *mut f32,
        hd: usize,
        probs: *const f32,
        vb: *const f32,
        keys: usize,
    ) {
        let mut col = 0;
        while col + 64 <= hd {
            weighted::<R, 4>(acc.add(col), hd, probs, vb.add(col), keys);
            col += 64;
        }
        while col < hd {
            weighted::<R, 1>(acc.add(col), hd, probs, vb.add(col), keys);
            col += 16;
        }
    }

    /// Attention of a tile over its causal context in chunks of 64 keys (four cache blocks of
    /// 16), reading the keys as panels and the values as f32 rows from `panels` (the
    /// sequence's [`transpose_context`] for this KV head): query vectors score a chunk six at
    /// a time in registers; each updates its online softmax once per chunk; the weighted
    /// values accumulate four query vectors at a time, every value row loaded once for the
    /// four.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL present; `t.hd` is a multiple of 16 and at most `MAX_HEAD_DIM`; the
    /// tile has at most `QUERY_VECTORS` query vectors; `panels` covers the context up to the
    /// tile's last row padded to whole chunks; `out` is valid for the tile's rows and heads
    /// and written by no one else.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile512(t: &Tile<'_>, panels: &[f32], out: *mut f32) {
        let (hd, group) = (t.hd, t.group);
        let nvec = hd / 16;
        let nq = (t.r1 - t.r0) * group;
        debug_assert!(nq <= QUERY_VECTORS && hd <= MAX_HEAD_DIM && hd.is_multiple_of(16));
        let mut qbuf = [0.0f32; QUERY_VECTORS * MAX_HEAD_DIM];
        let mut acc = [0.0f32; QUERY_VECTORS * MAX_HEAD_DIM];
        let mut m = [f32::NEG_INFINITY; QUERY_VECTORS];
        let mut l = [0.0f32; QUERY_VECTORS];
        for r in t.r0..t.r1 {
            let row = t.start + r;
            for g in 0..group {
                let qi = (r - t.r0) * group + g;
                let src = &t.q[row * t.q_stride + (t.kvh * group + g) * hd..][..hd];
                for (d, &x) in qbuf[qi * hd..(qi + 1) * hd].iter_mut().zip(src) {
                    *d = x * t.scale;
                }
            }
        }
        let (kt_all, vb_all) = panels.split_at(panels.len() / 2);
        let mut probs = [0.0f32; QUERY_VECTORS * CHUNK];
        // Keys of the chunk each query vector sees.
        let mut visible = [0usize; QUERY_VECTORS];
        let ctx_last = t.cached + t.r1;
        debug_assert!(kt_all.len() >= ctx_last.div_ceil(CHUNK) * CHUNK * hd);
        let mut key0 = 0;
        while key0 < ctx_last {
            let kc = (ctx_last - key0).min(CHUNK);
            let kt = &kt_all[key0 * hd..][..CHUNK * hd];
            let vb = &vb_all[key0 * hd..][..CHUNK * hd];
            let mut first = 0;
            while first < nq {
                let n = (nq - first).min(SCORE_ROWS);
                let mut s = [[_mm512_setzero_ps(); PANELS]; SCORE_ROWS];
                let q = qbuf.as_ptr().add(first * hd);
                match n {
                    1 => scores::<1>(q, hd, kt.as_ptr(), &mut s),
                    2 => scores::<2>(q, hd, kt.as_ptr(), &mut s),
                    3 => scores::<3>(q, hd, kt.as_ptr(), &mut s),
                    4 => scores::<4>(q, hd, kt.as_ptr(), &mut s),
                    5 => scores::<5>(q, hd, kt.as_ptr(), &mut s),
                    _ => scores::<6>(q, hd, kt.as_ptr(), &mut s),
                }
                for (u, sc) in s.iter().enumerate().take(n) {
                    let qi = first + u;
                    // Causal: query vector qi (row r0 + qi / group, position cached + that)
                    // sees keys up to its position.
                    let seen = (t.cached + t.r0 + qi / group + 1)
                        .saturating_sub(key0)
                        .min(kc);
                    visible[qi] = seen;
                    if seen == 0 {
                        continue;
                    }
                    let neg = _mm512_set1_ps(f32::NEG_INFINITY);
                    let mut masked = [neg; PANELS];
                    let mut top = neg;
                    for (p, x) in masked.iter_mut().enumerate() {
                        let lanes = seen.saturating_sub(16 * p).min(16);
                        let mask: __mmask16 = ((1u32 << lanes) - 1) as u16;
                        *x = _mm512_mask_blend_ps(mask, neg, sc[p]);
                        top = _mm512_max_ps(top, *x);
                    }
                    let chunk_max = _mm512_reduce_max_ps(top);
                    if chunk_max > m[qi] {
                        let c = (m[qi] - chunk_max).exp();
                        l[qi] *= c;
                        let cv = _mm512_set1_ps(c);
                        let a = acc.as_mut_ptr().add(qi * hd);
                        for q in 0..nvec {
                            let x = _mm512_loadu_ps(a.add(16 * q));
                            _mm512_storeu_ps(a.add(16 * q), _mm512_mul_ps(x, cv));
                        }
                        m[qi] = chunk_max;
                    }
                    let mv = _mm512_set1_ps(m[qi]);
                    let mut total = _mm512_setzero_ps();
                    for (p, &x) in masked.iter().enumerate() {
                        let e = exp_ps(_mm512_sub_ps(x, mv));
                        total = _mm512_add_ps(total, e);
                        _mm512_storeu_ps(probs.as_mut_ptr().add(qi * CHUNK + 16 * p), e);
                    }
                    l[qi] += _mm512_reduce_add_ps(total);
                }
                first += n;
            }
            // acc += P · V, four query vectors at a time over the keys the last of them sees
            // (the others' probabilities past their own are zero).
            let mut first = 0;
            while first < nq {
                let n = (nq - first).min(VALUE_ROWS);
                let keys = visible[first..first + n].iter().copied().max().unwrap_or(0);
                if keys > 0 {
                    for (qi, &seen) in visible.iter().enumerate().skip(first).take(n) {
                        if seen == 0 {
                            // Not yet in the context: zero weights for this chunk.
                            probs[qi * CHUNK..(qi + 1) * CHUNK].fill(0.0);
                        }
                    }
                    let a = acc.as_mut_ptr().add(first * hd);
                    let pr = probs.as_ptr().add(first * CHUNK);
                    match n {
                        1 => weighted_rows::<1>(a, hd, pr, vb.as_ptr(), keys),
                        2 => weighted_rows::<2>(a, hd, pr, vb.as_ptr(), keys),
                        3 => weighted_rows::<3>(a, hd, pr, vb.as_ptr(), keys),
                        _ => weighted_rows::<4>(a, hd, pr, vb.as_ptr(), keys),
                    }
                }
                first += n;
            }
            key0 += kc;
        }
        for r in t.r0..t.r1 {
            let row = t.start + r;
            for g in 0..group {
                let qi = (r - t.r0) * group + g;
                let h = t.kvh * group + g;
                let inv = _mm512_set1_ps(1.0 / l[qi]);
                let dst = out.add(row * t.out_width + h * hd);
                for q in 0..nvec {
                    let x = _mm512_loadu_ps(acc.as_ptr().add(qi * hd + 16 * q));
                    _mm512_storeu_ps(dst.add(16 * q), _mm512_mul_ps(x, inv));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Straightforward attention: full softmax per query.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        seq: &SeqBlocks<'_>,
        sh: AttentionShape,
    ) -> Vec<f32> {
        let hd = sh.head_dim;
        let kv_dim = sh.num_kv_heads * hd;
        let group = sh.num_heads / sh.num_kv_heads;
        let mut out = vec![0.0; seq.len * sh.num_heads * hd];
        for r in 0..seq.len {
            let ctx = seq.cached + r + 1;
            for h in 0..sh.num_heads {
                let kvh = h / group;
                let qv = &q[(seq.start + r) * sh.q_stride + h * hd..][..hd];
                let slot = |j: usize| {
                    (seq.blocks[j / sh.block_size] as usize * sh.block_size + j % sh.block_size)
                        * kv_dim
                        + kvh * hd
                };
                let s: Vec<f32> = (0..ctx)
                    .map(|j| {
                        qv.iter()
                            .zip(&k[slot(j)..][..hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            * sh.scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for d in 0..hd {
                        out[(r * sh.num_heads + h) * hd + d] += p / z * v[slot(j) + d];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn tiled_attention_equals_the_full_softmax() {
        let sh = AttentionShape {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim: 8,
            q_stride: 6 * 8 + 7,
            block_size: 4,
            scale: 0.3,
        };
        let kv_dim = sh.num_kv_heads * sh.head_dim;
        let slots = 64;
        let k: Vec<f32> = (0..slots * kv_dim)
            .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let v: Vec<f32> = (0..slots * kv_dim)
            .map(|i| ((i * 7) % 23) as f32 / 23.0 - 0.5)
            .collect();
        // Two sequences: one continuing after 5 cached tokens (a chunk), one fresh prompt of 37
        // rows (three query blocks), on scattered blocks.
        let info = [0u32, 3, 5, 3, 37, 0];
        let tables = [
            9u32, 2, 5, 0, 0, 0, 0, 0, 0, 0, 0, 15, 3, 7, 11, 1, 4, 6, 8, 10,
        ];
        let table = SeqTable {
            info: &info,
            tables: &tables,
            stride: 10,
        };
        let seqs: Vec<SeqBlocks<'_>> = table.iter().collect();
        let rows = 40;
        let q: Vec<f32> = (0..rows * sh.q_stride)
            .map(|i| ((i * 13) % 29) as f32 / 29.0 - 0.5)
            .collect();
        let mut out = vec![f32::NAN; rows * sh.num_heads * sh.head_dim];
        paged_attention(&q, &k, &v, table, sh, &mut out);
        let w = sh.num_heads * sh.head_dim;
        for s in &seqs {
            let want = reference(&q, &k, &v, s, sh);
            for (i, (a, b)) in out[s.start * w..(s.start + s.len) * w]
                .iter()
                .zip(&want)
                .enumerate()
            {
                assert!(
                    (a - b).abs() < 1e-5,
                    "seq at {} value {i}: {a} vs {b}",
                    s.start
                );
            }
        }
        // bf16 cache: same as the reference over the rounded cache.
        let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
        let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let (kr, vr): (Vec<f32>, Vec<f32>) = (
            kb.iter().map(|x| x.to_f32()).collect(),
            vb.iter().map(|x| x.to_f32()).collect(),
        );
        paged_attention(&q, &kb, &vb, table, sh, &mut out);
        for s in &seqs {
            let want = reference(&q, &kr, &vr, s, sh);
            for (a, b) in out[s.start * w..(s.start + s.len) * w].iter().zip(&want) {
                assert!((a - b).abs() < 1e-5);
            }
        }
    }

    /// The engine's shapes (block size 16, heads of 64 and 128): prompt and chunk tiles take
    /// the AVX-512 tile path where the CPU has it, decodes the row path; all equal the full
    /// softmax, for f32 and bf16 caches.
    #[test]
    fn engine_shaped_attention_equals_the_full_softmax() {
        for (num_heads, num_kv_heads, head_dim) in [(9, 3, 64), (8, 2, 128), (4, 4, 64)] {
            let sh = AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim,
                q_stride: (num_heads + 2 * num_kv_heads) * head_dim,
                block_size: 16,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let kv_dim = num_kv_heads * head_dim;
            let blocks = 24;
            let slots = blocks * 16;
            let k: Vec<f32> = (0..slots * kv_dim)
                .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
                .collect();
            let v: Vec<f32> = (0..slots * kv_dim)
                .map(|i| ((i * 7) % 23) as f32 / 23.0 - 0.5)
                .collect();
            // A fresh prompt of 70 rows, a 40-row chunk after 33 cached tokens, one decode row
            // after 50, on scattered blocks.
            let info = [0u32, 70, 0, 70, 40, 33, 110, 1, 50];
            let stride = 8;
            let mut tables = vec![0u32; 3 * stride];
            for (i, b) in [23u32, 1, 17, 5, 9, 2].iter().enumerate() {
                tables[i] = *b;
            }
            for (i, b) in [4u32, 20, 11, 7, 0].iter().enumerate() {
                tables[stride + i] = *b;
            }
            for (i, b) in [12u32, 3, 18, 6].iter().enumerate() {
                tables[2 * stride + i] = *b;
            }
            let table = SeqTable {
                info: &info,
                tables: &tables,
                stride,
            };
            let seqs: Vec<SeqBlocks<'_>> = table.iter().collect();
            let rows = 111;
            let q: Vec<f32> = (0..rows * sh.q_stride)
                .map(|i| ((i * 13) % 29) as f32 / 29.0 - 0.5)
                .collect();
            let w = sh.num_heads * sh.head_dim;
            let mut out = vec![f32::NAN; rows * w];
            let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
            let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            let (kr, vr): (Vec<f32>, Vec<f32>) = (
                kb.iter().map(|x| x.to_f32()).collect(),
                vb.iter().map(|x| x.to_f32()).collect(),
            );
            for bf in [false, true] {
                if bf {
                    paged_attention(&q, &kb, &vb, table, sh, &mut out);
                } else {
                    paged_attention(&q, &k, &v, table, sh, &mut out);
                }
                let (kk, vv) = if bf { (&kr, &vr) } else { (&k, &v) };
                for s in &seqs {
                    let want = reference(&q, kk, vv, s, sh);
                    for (i, (a, b)) in out[s.start * w..(s.start + s.len) * w]
                        .iter()
                        .zip(&want)
                        .enumerate()
                    {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "{num_heads}/{num_kv_heads}x{head_dim} bf16={bf} seq at {} value {i}: {a} vs {b}",
                            s.start
                        );
                    }
                }
            }
        }
    }
}
