//! Weights packed once at load for the broadcast-form GEMM: the `(n, k)` row-major matrix is
//! cut into panels of 16 output columns, each stored `[k][16]` (n padded to a multiple of 16
//! with zero columns). A tile keeps up to 6 activation rows × 4 panels (64 columns) of
//! accumulators in registers; each step over `k` loads 4 panel vectors and broadcasts one
//! activation value per row, so the kernel does no horizontal reductions and stays on the
//! FMA units (the dot form spends a reduction per output). Prefill and batched decode use it;
//! a single activation row (batch-1 decode) is memory-bound either way.

use crate::isa::{self, Isa};
use crate::matmul::WeightElem;
use crate::tasks::{split, OutPtr};
use half::bf16;
use rayon::prelude::*;

/// Output columns per panel.
pub const PANEL: usize = 16;
/// Activation rows per task (a block stays cache-resident while panels stream past it).
const ROW_BLOCK: usize = 48;
/// Rows from which a bf16 product rounds its activations to bf16 and multiplies with the
/// CPU's bf16 dot products ([`isa::bf16_dot`]): prefill-sized products, where the multiply
/// is the cost; decode keeps f32 activations (it is bound by the weight reads either way).
pub const BF16_DOT_MIN_ROWS: usize = 16;
/// Widest `k` the bf16-dot path takes (its rounded activation rows live on the stack).
const BF16_DOT_MAX_K: usize = 8192;

/// A `(n, k)` weight matrix in panel layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Packed<W> {
    n: usize,
    k: usize,
    data: Vec<W>,
    /// Products keep their activations in f32 whatever their size (no bf16-dot path).
    f32_activations: bool,
}

/// A packed weight element: f32 or bf16.
pub trait PackElem: WeightElem + Default {
    /// The zero value (padding).
    fn zero() -> Self;
}

impl PackElem for f32 {
    fn zero() -> Self {
        0.0
    }
}

impl PackElem for bf16 {
    fn zero() -> Self {
        bf16::ZERO
    }
}

impl<W: PackElem> Packed<W> {
    /// Packs a row-major `(n, k)` matrix.
    pub fn pack(w: &[W], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights must hold n * k values");
        let mut p = Self {
            n,
            k,
            data: vec![W::zero(); n.div_ceil(PANEL) * PANEL * k],
            f32_activations: false,
        };
        p.repack(w);
        p
    }

    /// Overwrites the values from a row-major matrix of the same shape, in place (the buffer
    /// keeps its address).
    pub fn repack(&mut self, w: &[W]) {
        assert_eq!(w.len(), self.n * self.k, "weights must hold n * k values");
        let k = self.k;
        self.data
            .par_chunks_mut(PANEL * k)
            .enumerate()
            .for_each(|(p, panel)| {
                for c in 0..PANEL {
                    let j = p * PANEL + c;
                    if j >= self.n {
                        break;
                    }
                    for (t, &v) in w[j * k..(j + 1) * k].iter().enumerate() {
                        panel[t * PANEL + c] = v;
                    }
                }
            });
    }

    /// The row-major `(n, k)` matrix back.
    pub fn unpack(&self) -> Vec<W> {
        let k = self.k;
        let mut out = vec![W::zero(); self.n * k];
        for (j, row) in out.chunks_exact_mut(k).enumerate() {
            let panel = &self.data[(j / PANEL) * PANEL * k..];
            for (t, v) in row.iter_mut().enumerate() {
                *v = panel[t * PANEL + j % PANEL];
            }
        }
        out
    }

    /// Output features.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Makes every product with this matrix keep its activations in f32, also where a bf16
    /// matrix would round them for the CPU's bf16 dot products (models whose outputs must
    /// stay within f32 rounding of the f32 model's).
    pub fn keep_f32_activations(&mut self) {
        self.f32_activations = true;
    }

    /// Address of the packed buffer (to check that a refresh kept it in place).
    pub fn as_ptr(&self) -> *const W {
        self.data.as_ptr()
    }

    /// Values stored (padding included).
    pub fn stored_len(&self) -> usize {
        self.data.len()
    }
}

/// `out (m×n) = x (m×k) · Wᵀ` (or `+=` when `accumulate`) with packed weights.
pub fn linear_packed<W: PackElem>(
    x: &[f32],
    m: usize,
    w: &Packed<W>,
    out: &mut [f32],
    accumulate: bool,
) {
    linear_packed_with(isa::current(), x, m, w, out, accumulate);
}

/// [`linear_packed`] with an explicit instruction set (at most what the CPU has).
pub fn linear_packed_with<W: PackElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &Packed<W>,
    out: &mut [f32],
    accumulate: bool,
) {
    assert!(isa <= isa::detected(), "{isa} is not available on this CPU");
    let (n, k) = (w.n, w.k);
    assert!(
        x.len() >= m * k,
        "x has {} values, needs {}",
        x.len(),
        m * k
    );
    assert!(
        out.len() >= m * n,
        "out has {} values, needs {}",
        out.len(),
        m * n
    );
    if m == 0 || n == 0 {
        return;
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<W>() == std::any::TypeId::of::<bf16>()
        && isa == Isa::Avx512
        && m >= BF16_DOT_MIN_ROWS
        && k.is_multiple_of(2)
        && k <= BF16_DOT_MAX_K
        && !w.f32_activations
        && isa::bf16_dot()
    {
        // SAFETY: W is bf16 (checked above), so the packed data are bf16 values.
        let wb = unsafe { &*(w as *const Packed<W> as *const Packed<bf16>) };
        split(
            m,
            n.div_ceil(PANEL),
            4,
            ROW_BLOCK,
            m * n * k,
            |i0, rows, p0, p1| {
                let o = out_ptr;
                // SAFETY: AVX-512 BF16 is present (bf16_dot); bounds checked above; this task
                // writes rows i0..i0+rows, columns of panels p0..p1 only.
                unsafe {
                    avx512::bf16_block(
                        x.as_ptr().add(i0 * k),
                        rows,
                        k,
                        wb,
                        p0,
                        p1,
                        o.0.add(i0 * n),
                        n,
                        accumulate,
                    )
                };
            },
        );
        return;
    }
    // Column units are panels, in whole groups of 4 (one tile's width).
    split(
        m,
        n.div_ceil(PANEL),
        4,
        ROW_BLOCK,
        m * n * k,
        |i0, rows, p0, p1| {
            let o = out_ptr;
            // SAFETY: bounds checked above; this task writes rows i0..i0+rows, columns of panels
            // p0..p1 only.
            unsafe {
                panels_block(
                    isa,
                    x.as_ptr().add(i0 * k),
                    rows,
                    k,
                    w,
                    p0,
                    p1,
                    o.0.add(i0 * n),
                    n,
                    accumulate,
                )
            };
        },
    );
}

/// # Safety
/// `x` holds `m*k` values; `out` `m` rows of stride `ldo` covering the panels' columns (the
/// last panel's columns beyond `n` are not written).
#[allow(clippy::too_many_arguments)]
unsafe fn panels_block<W: PackElem>(
    isa: Isa,
    x: *const f32,
    m: usize,
    k: usize,
    w: &Packed<W>,
    p0: usize,
    p1: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    let mut p = p0;
    while p < p1 {
        let np = 4.min(p1 - p);
        let cols = (w.n - p * PANEL).min(np * PANEL);
        let wp = w.data.as_ptr().add(p * PANEL * k);
        let mut i = 0;
        while i < m {
            let rows = 6.min(m - i);
            let xp = x.add(i * k);
            let op = out.add(i * ldo + p * PANEL);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => avx512::tile(xp, k, wp, op, ldo, rows, np, cols, accumulate),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => avx2::tile(xp, k, wp, op, ldo, rows, np, cols, accumulate),
                _ => portable_tile(xp, k, wp, op, ldo, rows, np, cols, accumulate),
            }
            i += rows;
        }
        p += np;
    }
}

/// # Safety
/// As [`panels_block`] for `rows` rows and `np` panels, `cols` valid output columns.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_tile<W: PackElem>(
    x: *const f32,
    k: usize,
    w: *const W,
    out: *mut f32,
    ldo: usize,
    rows: usize,
    np: usize,
    cols: usize,
    accumulate: bool,
) {
    for i in 0..rows {
        let mut acc = [0.0f32; 4 * PANEL];
        for t in 0..k {
            let xv = *x.add(i * k + t);
            for q in 0..np {
                let panel = w.add(q * PANEL * k + t * PANEL);
                for c in 0..PANEL {
                    acc[q * PANEL + c] += xv * (*panel.add(c)).to_f32();
                }
            }
        }
        for (c, &a) in acc.iter().enumerate().take(cols) {
            let o = out.add(i * ldo + c);
            *o = if accumulate { *o + a } else { a };
        }
    }
}

/// The broadcast form on AVX2 (16 registers of 8 lanes): a panel's 16 columns are two
/// vectors, so a tile is up to 6 rows × one panel (12 accumulators, 2 weight vectors, one
/// broadcast), panel after panel.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{PackElem, PANEL};
    use crate::matmul::avx2::load8;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and FMA present; `x`: `R` rows of `k`; `w`: one panel of `k × 16`; `out`: `R`
    /// rows of stride `ldo` with `cols ≤ 16` writable columns.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn panel_rows<W: PackElem, const R: usize>(
        x: *const f32,
        k: usize,
        w: *const W,
        out: *mut f32,
        ldo: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let mut lo = [_mm256_setzero_ps(); R];
        let mut hi = [_mm256_setzero_ps(); R];
        for t in 0..k {
            let wl = load8(w.add(t * PANEL));
            let wh = load8(w.add(t * PANEL + 8));
            for i in 0..R {
                let xv = _mm256_set1_ps(*x.add(i * k + t));
                lo[i] = _mm256_fmadd_ps(xv, wl, lo[i]);
                hi[i] = _mm256_fmadd_ps(xv, wh, hi[i]);
            }
        }
        for i in 0..R {
            let o = out.add(i * ldo);
            if cols >= PANEL {
                let (l, h) = if accumulate {
                    (
                        _mm256_add_ps(lo[i], _mm256_loadu_ps(o)),
                        _mm256_add_ps(hi[i], _mm256_loadu_ps(o.add(8))),
                    )
                } else {
                    (lo[i], hi[i])
                };
                _mm256_storeu_ps(o, l);
                _mm256_storeu_ps(o.add(8), h);
            } else {
                let mut row = [0.0f32; PANEL];
                _mm256_storeu_ps(row.as_mut_ptr(), lo[i]);
                _mm256_storeu_ps(row.as_mut_ptr().add(8), hi[i]);
                for (c, &v) in row.iter().enumerate().take(cols) {
                    let p = o.add(c);
                    *p = if accumulate { *p + v } else { v };
                }
            }
        }
    }

    /// One activation row against `P` panels at once: 2·`P` independent accumulators keep
    /// the FMA units busy where one panel's two would wait on each other (batch-1 decode).
    ///
    /// # Safety
    /// AVX2 and FMA present; `x`: `k` values; `w`: `P` panels of `k × 16`; `out`: `P` full
    /// panels' columns writable.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_panels<W: PackElem, const P: usize>(
        x: *const f32,
        k: usize,
        w: *const W,
        out: *mut f32,
        accumulate: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; P];
        for t in 0..k {
            let xv = _mm256_set1_ps(*x.add(t));
            for (q, a) in acc.iter_mut().enumerate() {
                let p = w.add(q * PANEL * k + t * PANEL);
                a[0] = _mm256_fmadd_ps(xv, load8(p), a[0]);
                a[1] = _mm256_fmadd_ps(xv, load8(p.add(8)), a[1]);
            }
        }
        for (q, a) in acc.iter().enumerate() {
            for (h, &v) in a.iter().enumerate() {
                let o = out.add(q * PANEL + h * 8);
                let v = if accumulate {
                    _mm256_add_ps(v, _mm256_loadu_ps(o))
                } else {
                    v
                };
                _mm256_storeu_ps(o, v);
            }
        }
    }

    /// # Safety
    /// As `super::panels_block` for `rows ≤ 6` rows and `np` panels, `cols` valid columns.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<W: PackElem>(
        x: *const f32,
        k: usize,
        w: *const W,
        out: *mut f32,
        ldo: usize,
        rows: usize,
        np: usize,
        cols: usize,
        accumulate: bool,
    ) {
        // One row: the full panels together.
        let full = (cols / PANEL).min(np);
        let first = if rows == 1 && full > 1 {
            match full {
                2 => row_panels::<W, 2>(x, k, w, out, accumulate),
                3 => row_panels::<W, 3>(x, k, w, out, accumulate),
                _ => row_panels::<W, 4>(x, k, w, out, accumulate),
            }
            full.min(4)
        } else {
            0
        };
        for q in first..np {
            let c0 = q * PANEL;
            if c0 >= cols {
                break;
            }
            let (wq, oq, left) = (w.add(c0 * k), out.add(c0), (cols - c0).min(PANEL));
            match rows {
                1 => panel_rows::<W, 1>(x, k, wq, oq, ldo, left, accumulate),
                2 => panel_rows::<W, 2>(x, k, wq, oq, ldo, left, accumulate),
                3 => panel_rows::<W, 3>(x, k, wq, oq, ldo, left, accumulate),
                4 => panel_rows::<W, 4>(x, k, wq, oq, ldo, left, accumulate),
                5 => panel_rows::<W, 5>(x, k, wq, oq, ldo, left, accumulate),
                _ => panel_rows::<W, 6>(x, k, wq, oq, ldo, left, accumulate),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PackElem, PANEL};
    use std::any::TypeId;
    use std::arch::x86_64::*;

    /// Writes (or, with `accumulate`, adds) a tile's `R × P` accumulators to `out` (rows of
    /// stride `ldo`, `cols` valid columns).
    ///
    /// # Safety
    /// AVX-512 F present; `out` holds `R` rows of `cols` writable values at stride `ldo`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn store<const R: usize, const P: usize>(
        acc: &[[__m512; P]; R],
        out: *mut f32,
        ldo: usize,
        cols: usize,
        accumulate: bool,
    ) {
        for (i, row) in acc.iter().enumerate() {
            for (q, &a) in row.iter().enumerate() {
                let c0 = q * PANEL;
                if c0 >= cols {
                    break;
                }
                let left = (cols - c0).min(PANEL);
                let mask: __mmask16 = ((1u32 << left) - 1) as u16;
                let o = out.add(i * ldo + c0);
                let v = if accumulate {
                    _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, o))
                } else {
                    a
                };
                _mm512_mask_storeu_ps(o, mask, v);
            }
        }
    }

    /// Calls `$go!(R, P)` with the constant tile shape of `rows ≤ 6` rows and `np ≤ 4`
    /// panels.
    macro_rules! by_shape {
        ($rows:expr, $np:expr, $go:ident) => {
            match ($rows, $np) {
                (1, 1) => $go!(1, 1),
                (1, 2) => $go!(1, 2),
                (1, 3) => $go!(1, 3),
                (1, _) => $go!(1, 4),
                (2, 1) => $go!(2, 1),
                (2, 2) => $go!(2, 2),
                (2, 3) => $go!(2, 3),
                (2, _) => $go!(2, 4),
                (3, 1) => $go!(3, 1),
                (3, 2) => $go!(3, 2),
                (3, 3) => $go!(3, 3),
                (3, _) => $go!(3, 4),
                (4, 1) => $go!(4, 1),
                (4, 2) => $go!(4, 2),
                (4, 3) => $go!(4, 3),
                (4, _) => $go!(4, 4),
                (5, 1) => $go!(5, 1),
                (5, 2) => $go!(5, 2),
                (5, 3) => $go!(5, 3),
                (5, _) => $go!(5, 4),
                (_, 1) => $go!(6, 1),
                (_, 2) => $go!(6, 2),
                (_, 3) => $go!(6, 3),
                _ => $go!(6, 4),
            }
        };
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_panel<W: PackElem>(p: *const W) -> __m512 {
        if TypeId::of::<W>() == TypeId::of::<f32>() {
            _mm512_loadu_ps(p as *const f32)
        } else {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    /// # Safety
    /// `x`: `R` rows of `k`; `w`: `P` panels of `k × 16`; `out`: `R` rows of stride `ldo`
    /// with `cols` writable columns.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn tile_rp<W: PackElem, const R: usize, const P: usize>(
        x: *const f32,
        k: usize,
        w: *const W,
        out: *mut f32,
        ldo: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for t in 0..k {
            let mut wv = [_mm512_setzero_ps(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                *v = load_panel(w.add(q * PANEL * k + t * PANEL));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(i * k + t));
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, v, *a);
                }
            }
        }
        store(&acc, out, ldo, cols, accumulate);
    }

    /// # Safety
    /// As `tile_rp` for `rows ≤ 6`, `np ≤ 4`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile<W: PackElem>(
        x: *const f32,
        k: usize,
        w: *const W,
        out: *mut f32,
        ldo: usize,
        rows: usize,
        np: usize,
        cols: usize,
        accumulate: bool,
    ) {
        macro_rules! go {
            ($r:literal, $p:literal) => {
                tile_rp::<W, $r, $p>(x, k, w, out, ldo, cols, accumulate)
            };
        }
        by_shape!(rows, np, go);
    }
    /// What the bf16-dot path reads of a packed bf16 matrix.
    pub(super) trait Bf16Panels {
        fn n(&self) -> usize;
        fn data(&self) -> *const half::bf16;
    }

    /// Rows `x` (`rows × k` f32) times a packed bf16 matrix's panels `p0..p1`, six rows at a
    /// time: each six rows are rounded to bf16 pairs once (`(x[2t], x[2t+1])` as one 32-bit
    /// value), then every panel group multiplies them with `vdpbf16ps` (two k steps an
    /// instruction, f32 sums).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and BF16 present; `k` even and at most `BF16_DOT_MAX_K`; `x` holds
    /// `rows * k` values; `out` `rows` rows of stride `ldo` covering the panels' columns.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn bf16_block<P: Bf16Panels>(
        x: *const f32,
        rows: usize,
        k: usize,
        w: &P,
        p0: usize,
        p1: usize,
        out: *mut f32,
        ldo: usize,
        accumulate: bool,
    ) {
        let half = k / 2;
        let mut xb = [0u32; 6 * super::BF16_DOT_MAX_K / 2];
        let mut i = 0;
        while i < rows {
            let r = 6.min(rows - i);
            for row in 0..r {
                let src = x.add((i + row) * k);
                let dst = xb.as_mut_ptr().add(row * half);
                let mut t = 0;
                while t + 32 <= k {
                    let lo = _mm512_loadu_ps(src.add(t));
                    let hi = _mm512_loadu_ps(src.add(t + 16));
                    let b: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                    _mm512_storeu_si512(dst.add(t / 2) as *mut __m512i, b);
                    t += 32;
                }
                while t < k {
                    let a = half::bf16::from_f32(*src.add(t)).to_bits() as u32;
                    let b = half::bf16::from_f32(*src.add(t + 1)).to_bits() as u32;
                    *dst.add(t / 2) = a | (b << 16);
                    t += 2;
                }
            }
            let mut p = p0;
            while p < p1 {
                let np = 4.min(p1 - p);
                let cols = (w.n() - p * PANEL).min(np * PANEL);
                let wp = w.data().add(p * PANEL * k);
                let op = out.add(i * ldo + p * PANEL);
                macro_rules! go {
                    ($r:literal, $p:literal) => {
                        bf16_tile::<$r, $p>(xb.as_ptr(), half, wp, op, ldo, cols, accumulate)
                    };
                }
                by_shape!(r, np, go);
                p += np;
            }
            i += r;
        }
    }

    /// `R` rows of bf16 pairs (`xb`, `half` pairs a row) times `P` panels (`[k][16]` bf16):
    /// per pair of k steps, each panel's two rows are interleaved into (k, k+1) pairs per
    /// column with one permute, then one `vdpbf16ps` per row and panel.
    ///
    /// # Safety
    /// As [`bf16_block`] for `R` rows and `P` panels, `cols` writable columns.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn bf16_tile<const R: usize, const P: usize>(
        xb: *const u32,
        half: usize,
        w: *const half::bf16,
        out: *mut f32,
        ldo: usize,
        cols: usize,
        accumulate: bool,
    ) {
        // Lane 2c takes column c of the first row (element c), lane 2c + 1 of the second
        // (element 16 + c).
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let k = 2 * half;
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for t in 0..half {
            let mut wv = [_mm512_setzero_si512(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                let base = w.add(q * PANEL * k + 2 * t * PANEL);
                let lo = _mm256_loadu_si256(base as *const __m256i);
                let hi = _mm256_loadu_si256(base.add(PANEL) as *const __m256i);
                let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                *v = _mm512_permutexvar_epi16(idx, both);
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*xb.add(i * half + t) as i32));
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_dpbf16_ps(*a, std::mem::transmute::<__m512i, __m512bh>(v), xv);
                }
            }
        }
        store(&acc, out, ldo, cols, accumulate);
    }
}

#[cfg(target_arch = "x86_64")]
impl avx512::Bf16Panels for Packed<bf16> {
    fn n(&self) -> usize {
        self.n
    }
    fn data(&self) -> *const bf16 {
        self.data.as_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_products_equal_the_dot_kernels_and_unpack_round_trips() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 17, 33),
            (3, 64, 40),
            (7, 100, 64),
            (13, 65, 129),
            (50, 200, 48),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 13) % 97) as f32 / 48.0 - 1.0)
                .collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let (pf, pb) = (Packed::pack(&w, n, k), Packed::pack(&wb, n, k));
            assert_eq!(pf.unpack(), w);
            assert_eq!(pb.unpack(), wb);
            let mut want = vec![0.0; m * n];
            crate::matmul::linear_with(Isa::Portable, &x, m, &w, n, k, &mut want, false);
            let mut want_b = vec![0.0; m * n];
            crate::matmul::linear_with(Isa::Portable, &x, m, &wb, n, k, &mut want_b, false);
            for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512]
                .into_iter()
                .filter(|&i| i <= isa::detected())
            {
                let mut out = vec![0.5; m * n];
                linear_packed_with(isa, &x, m, &pf, &mut out, true);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - (b + 0.5)).abs() < 1e-3 * (1.0 + b.abs()),
                        "{isa} f32 {m}x{n}x{k}: {a} vs {b}+0.5"
                    );
                }
                linear_packed_with(isa, &x, m, &pb, &mut out, false);
                // Prefill-sized bf16 products with bf16 dot products round the activations
                // (checked against that in the next test); the rest keep them in f32.
                let dot = isa == Isa::Avx512
                    && m >= BF16_DOT_MIN_ROWS
                    && k.is_multiple_of(2)
                    && isa::bf16_dot();
                let want_b = if dot {
                    let xr: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
                    let mut w2 = vec![0.0; m * n];
                    crate::matmul::linear_with(Isa::Portable, &xr, m, &wb, n, k, &mut w2, false);
                    w2
                } else {
                    want_b.clone()
                };
                for (a, b) in out.iter().zip(&want_b) {
                    assert!(
                        (a - b).abs() < 1e-3 * (1.0 + b.abs()),
                        "{isa} bf16 {m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Prefill-sized bf16 products on a CPU with AVX-512 BF16 round their activations to
    /// bf16: they equal the product of the rounded activations (f32 sums), for row counts
    /// around the threshold, odd tails of pairs, partial panels and accumulation.
    #[test]
    fn bf16_dot_products_equal_the_rounded_activations_product() {
        if !isa::bf16_dot() {
            eprintln!("skipping: no AVX-512 BF16 on this CPU");
            return;
        }
        for &(m, n, k) in &[(16, 17, 2), (16, 64, 40), (23, 100, 70), (50, 200, 576)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0 + 1e-3)
                .collect();
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 13) % 97) as f32 / 48.0 - 1.0))
                .collect();
            let packed = Packed::pack(&w, n, k);
            let rounded: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let mut want = vec![0.0; m * n];
            crate::matmul::linear_with(Isa::Portable, &rounded, m, &w, n, k, &mut want, false);
            let mut unrounded = vec![0.0; m * n];
            crate::matmul::linear_with(Isa::Portable, &x, m, &w, n, k, &mut unrounded, false);
            let mut out = vec![0.25; m * n];
            linear_packed(&x, m, &packed, &mut out, true);
            for (a, b) in out.iter().zip(&want) {
                assert!(
                    (a - (b + 0.25)).abs() < 1e-4 * (1.0 + b.abs()),
                    "bf16 dot {m}x{n}x{k}: {a} vs {b}+0.25"
                );
            }
            // The rounding shows (the path really took bf16 activations)...
            assert!(out
                .iter()
                .zip(&unrounded)
                .any(|(a, b)| (a - 0.25 - b).abs() > 1e-4));
            // ...and a matrix told to keep f32 activations does not round them.
            let mut exact = packed.clone();
            exact.keep_f32_activations();
            linear_packed(&x, m, &exact, &mut out, false);
            for (a, b) in out.iter().zip(&unrounded) {
                assert!(
                    (a - b).abs() < 1e-3 * (1.0 + b.abs()),
                    "f32 activations {m}x{n}x{k}"
                );
            }
        }
    }
}
