//! `out (m×n) = x (m×k) · Wᵀ`, `W` row-major `(n, k)`, f32 activations, f32 or bf16 weights,
//! f32 accumulation.
//!
//! Register-tiled dot kernels for every `m`. A tile is up to 4 activation rows × `NR` weight
//! rows; each weight vector loaded is used by every activation row of the tile, and a task
//! walks a block of up to 64 activation rows for its weight rows before moving on, so each
//! weight byte comes from memory once per row block. Work is split over rayon by row blocks ×
//! output columns. No packing and no scratch: a call allocates nothing. Measured against the
//! `gemm` crate in one run (`cargo run --release -p tandem-cpu-kernels --example matmul`):
//! faster at every M from 1 to 512 on the AVX-512 machines here.

use crate::isa::{self, Isa};
use crate::tasks::{split, OutPtr};
use half::bf16;

/// Activation rows per task: a block of rows stays cache-resident while weight tiles stream.
const ROW_BLOCK: usize = 64;

/// A weight element the kernels read: f32 as is, bf16 widened in registers.
pub trait WeightElem: Copy + Send + Sync + sealed::Sealed + 'static {
    /// The value as f32.
    fn to_f32(self) -> f32;
}

impl WeightElem for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl WeightElem for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// `out = x · Wᵀ` (or `out += x · Wᵀ` when `accumulate`) with the process's instruction set.
#[allow(clippy::too_many_arguments)]
pub fn linear<W: WeightElem>(
    x: &[f32],
    m: usize,
    w: &[W],
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    linear_with(isa::current(), x, m, w, n, k, out, accumulate);
}

/// [`linear`] with an explicit instruction set (at most what the CPU has).
#[allow(clippy::too_many_arguments)]
pub fn linear_with<W: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &[W],
    n: usize,
    k: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    assert!(isa <= isa::detected(), "{isa} is not available on this CPU");
    assert!(
        x.len() >= m * k,
        "x has {} values, needs {}",
        x.len(),
        m * k
    );
    assert!(
        w.len() >= n * k,
        "w has {} values, needs {}",
        w.len(),
        n * k
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
    if k == 0 {
        if !accumulate {
            out[..m * n].fill(0.0);
        }
        return;
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    split(
        m,
        n,
        tile_cols(isa, m),
        ROW_BLOCK,
        m * n * k,
        |i0, rows, j0, j1| {
            let o = out_ptr;
            // SAFETY: bounds were checked above; this task writes rows i0.., columns j0..j1 only.
            unsafe {
                dot_tiles(
                    isa,
                    x.as_ptr().add(i0 * k),
                    k,
                    rows,
                    w.as_ptr().add(j0 * k),
                    k,
                    j1 - j0,
                    k,
                    o.0.add(i0 * n + j0),
                    n,
                    accumulate,
                )
            };
        },
    );
}

/// Weight rows per tile: 8 for a single activation row, else what the registers allow.
fn tile_cols(isa: Isa, m: usize) -> usize {
    if m == 1 {
        return 8;
    }
    match isa {
        Isa::Avx512 => 4,
        Isa::Avx2 => 3,
        Isa::Portable => 4,
    }
}

/// `out[i*ldo + j] (+)= Σ_t x[i*xs + t] · w[j*ws + t]` for `i < m`, `j < n`, one thread.
///
/// # Safety
/// Every address the strides reach is inside its allocation; `out` is not aliased.
#[allow(clippy::too_many_arguments)]
unsafe fn dot_tiles<W: WeightElem>(
    isa: Isa,
    x: *const f32,
    xs: usize,
    m: usize,
    w: *const W,
    ws: usize,
    n: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    let nr = tile_cols(isa, m);
    let mut j = 0;
    while j < n {
        let cols = nr.min(n - j);
        let mut i = 0;
        while i < m {
            let rows = 4.min(m - i);
            let xp = x.add(i * xs);
            let wp = w.add(j * ws);
            let op = out.add(i * ldo + j);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => avx512::tile(xp, xs, wp, ws, k, op, ldo, rows, cols, accumulate),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => avx2::tile(xp, xs, wp, ws, k, op, ldo, rows, cols, accumulate),
                _ => portable_tile(xp, xs, wp, ws, k, op, ldo, rows, cols, accumulate),
            }
            i += rows;
        }
        j += cols;
    }
}

/// `out[i*ldo + j] = Σ_t x[i*xs + t] · w[j*ws + t]` over strided rows, on this thread: the
/// score block of attention (queries × a block of cached keys).
#[allow(clippy::too_many_arguments)]
pub fn dot_block<W: WeightElem>(
    x: &[f32],
    xs: usize,
    m: usize,
    w: &[W],
    ws: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    ldo: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(x.len() >= (m - 1) * xs + k, "x too short");
    assert!(w.len() >= (n - 1) * ws + k, "w too short");
    assert!(out.len() >= (m - 1) * ldo + n, "out too short");
    // SAFETY: the asserts bound every row the strides reach; `out` is exclusively borrowed.
    unsafe {
        dot_tiles(
            isa::current(),
            x.as_ptr(),
            xs,
            m,
            w.as_ptr(),
            ws,
            n,
            k,
            out.as_mut_ptr(),
            ldo,
            false,
        )
    };
}

/// Scalar tile (any CPU), eight partial sums per dot so it still vectorises somewhat.
///
/// # Safety
/// As [`dot_columns`], for `rows` activation rows and `cols` weight rows.
#[allow(clippy::too_many_arguments)]
unsafe fn portable_tile<W: WeightElem>(
    x: *const f32,
    xs: usize,
    w: *const W,
    ws: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    for i in 0..rows {
        let xr = std::slice::from_raw_parts(x.add(i * xs), k);
        for j in 0..cols {
            let wr = std::slice::from_raw_parts(w.add(j * ws), k);
            let mut acc = [0.0f32; 8];
            let (xc, wc) = (xr.chunks_exact(8), wr.chunks_exact(8));
            let tail: f32 = xc
                .remainder()
                .iter()
                .zip(wc.remainder())
                .map(|(a, b)| a * b.to_f32())
                .sum();
            for (a, b) in xc.zip(wc) {
                for l in 0..8 {
                    acc[l] += a[l] * b[l].to_f32();
                }
            }
            let s = acc.iter().sum::<f32>() + tail;
            let o = out.add(i * ldo + j);
            *o = if accumulate { *o + s } else { s };
        }
    }
}

/// Expands a runtime `(rows, cols)` into const-generic tile instantiations: one activation
/// row takes up to 8 weight rows (more independent accumulators for the memory-bound
/// batch-1 case), several rows up to `$max_cols`.
macro_rules! dispatch_tile {
    ($kernel:ident, $rows:expr, $cols:expr, $max_cols:literal, ($($arg:expr),*)) => {
        match ($rows, $cols) {
            (1, 1) => $kernel::<W, 1, 1>($($arg),*),
            (1, 2) => $kernel::<W, 1, 2>($($arg),*),
            (1, 3) => $kernel::<W, 1, 3>($($arg),*),
            (1, 4) => $kernel::<W, 1, 4>($($arg),*),
            (1, 5) => $kernel::<W, 1, 5>($($arg),*),
            (1, 6) => $kernel::<W, 1, 6>($($arg),*),
            (1, 7) => $kernel::<W, 1, 7>($($arg),*),
            (1, _) => $kernel::<W, 1, 8>($($arg),*),
            (2, 1) => $kernel::<W, 2, 1>($($arg),*),
            (2, 2) => $kernel::<W, 2, 2>($($arg),*),
            (2, 3) => $kernel::<W, 2, 3>($($arg),*),
            (3, 1) => $kernel::<W, 3, 1>($($arg),*),
            (3, 2) => $kernel::<W, 3, 2>($($arg),*),
            (3, 3) => $kernel::<W, 3, 3>($($arg),*),
            (4, 1) => $kernel::<W, 4, 1>($($arg),*),
            (4, 2) => $kernel::<W, 4, 2>($($arg),*),
            (4, 3) => $kernel::<W, 4, 3>($($arg),*),
            (2, _) => $kernel::<W, 2, $max_cols>($($arg),*),
            (3, _) => $kernel::<W, 3, $max_cols>($($arg),*),
            _ => $kernel::<W, 4, $max_cols>($($arg),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::WeightElem;
    use std::any::TypeId;
    use std::arch::x86_64::*;

    /// 16 weights as f32 lanes: f32 loaded, bf16 widened (bf16 is the top half of an f32).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16<W: WeightElem>(p: *const W, mask: __mmask16) -> __m512 {
        if TypeId::of::<W>() == TypeId::of::<f32>() {
            _mm512_maskz_loadu_ps(mask, p as *const f32)
        } else {
            let h = _mm256_maskz_loadu_epi16(mask, p as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16_full<W: WeightElem>(p: *const W) -> __m512 {
        if TypeId::of::<W>() == TypeId::of::<f32>() {
            _mm512_loadu_ps(p as *const f32)
        } else {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    /// # Safety
    /// `x`: `R` rows of `k`; `w`: `C` rows of `k`; `out`: `R` rows of stride `ldo`, `C` wide.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_rc<W: WeightElem, const R: usize, const C: usize>(
        x: *const f32,
        xs: usize,
        w: *const W,
        ws: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let full = k / 16 * 16;
        let mut kk = 0;
        while kk < full {
            let mut wv = [_mm512_setzero_ps(); C];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = load16_full(w.add(j * ws + kk));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add(i * xs + kk));
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, v, *a);
                }
            }
            kk += 16;
        }
        if kk < k {
            let mask: __mmask16 = (1u32 << (k - kk)) as u16 - 1;
            let mut wv = [_mm512_setzero_ps(); C];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = load16(w.add(j * ws + kk), mask);
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(i * xs + kk));
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, v, *a);
                }
            }
        }
        if R * C <= 16 {
            // All of the tile's sums at once (a transpose-and-add tree), not one horizontal
            // reduction per output: with short rows (attention heads) reductions dominate.
            let mut flat = [_mm512_setzero_ps(); 16];
            for (i, row) in acc.iter().enumerate() {
                for (j, &a) in row.iter().enumerate() {
                    flat[i * C + j] = a;
                }
            }
            let mut sums = [0.0f32; 16];
            _mm512_storeu_ps(sums.as_mut_ptr(), hsum16(&flat));
            for i in 0..R {
                for j in 0..C {
                    let o = out.add(i * ldo + j);
                    let s = sums[i * C + j];
                    *o = if accumulate { *o + s } else { s };
                }
            }
            return;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &a) in row.iter().enumerate() {
                let s = _mm512_reduce_add_ps(a);
                let o = out.add(i * ldo + j);
                *o = if accumulate { *o + s } else { s };
            }
        }
    }

    /// Lane `i` of the result is the sum of the 16 lanes of `v[i]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn hsum16(v: &[__m512; 16]) -> __m512 {
        // Pairs: per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
        let mut p = [_mm512_setzero_ps(); 8];
        for (i, p) in p.iter_mut().enumerate() {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            *p = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // Quads: per 128-bit lane, the lane's partial sum of four inputs, in order.
        let mut q = [_mm512_setzero_ps(); 4];
        for (i, q) in q.iter_mut().enumerate() {
            let (a, b) = (_mm512_castps_pd(p[2 * i]), _mm512_castps_pd(p[2 * i + 1]));
            *q = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            );
        }
        // Across the four 128-bit lanes.
        let h = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        };
        h(h(q[0], q[1]), h(q[2], q[3]))
    }

    /// # Safety
    /// As `tile_rc` for `rows ≤ 4`, `cols ≤ 4` (≤ 8 for one row).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile<W: WeightElem>(
        x: *const f32,
        xs: usize,
        w: *const W,
        ws: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        dispatch_tile!(
            tile_rc,
            rows,
            cols,
            4,
            (x, xs, w, ws, k, out, ldo, accumulate)
        )
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::WeightElem;
    use std::any::TypeId;
    use std::arch::x86_64::*;

    /// Eight values of `p` (f32, or bf16 widened) as f32.
    ///
    /// # Safety
    /// `p` holds 8 readable values; AVX2 present.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn load8<W: WeightElem>(p: *const W) -> __m256 {
        if TypeId::of::<W>() == TypeId::of::<f32>() {
            _mm256_loadu_ps(p as *const f32)
        } else {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// The sum of the eight lanes.
    ///
    /// # Safety
    /// AVX2 present.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// `x`: `R` rows of `k`; `w`: `C` rows of `k`; `out`: `R` rows of stride `ldo`, `C` wide.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_rc<W: WeightElem, const R: usize, const C: usize>(
        x: *const f32,
        xs: usize,
        w: *const W,
        ws: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let full = k / 8 * 8;
        let mut kk = 0;
        while kk < full {
            let mut wv = [_mm256_setzero_ps(); C];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = load8(w.add(j * ws + kk));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(i * xs + kk));
                for (a, &v) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, v, *a);
                }
            }
            kk += 8;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, &a) in row.iter().enumerate() {
                let mut s = hsum(a);
                for t in kk..k {
                    s += *x.add(i * xs + t) * (*w.add(j * ws + t)).to_f32();
                }
                let o = out.add(i * ldo + j);
                *o = if accumulate { *o + s } else { s };
            }
        }
    }

    /// # Safety
    /// As `tile_rc` for `rows ≤ 4`, `cols ≤ 3` (≤ 8 for one row).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<W: WeightElem>(
        x: *const f32,
        xs: usize,
        w: *const W,
        ws: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        dispatch_tile!(
            tile_rc,
            rows,
            cols,
            3,
            (x, xs, w, ws, k, out, ldo, accumulate)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn isas() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= isa::detected())
            .collect()
    }

    #[test]
    fn every_isa_matches_the_reference_for_odd_shapes() {
        // Odd sizes exercise every tile remainder and the masked / scalar k tails.
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 7, 19),
            (3, 5, 33),
            (4, 9, 64),
            (5, 13, 577),
            (17, 31, 100),
            (24, 40, 48),
            (30, 70, 129),
            (64, 300, 96),
        ] {
            let x = noise(m * k, 1 + m as u32);
            let w = noise(n * k, 7 + n as u32);
            let want = reference(&x, m, &w, n, k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let want_b = reference(&x, m, &wb32, n, k);
            for isa in isas() {
                let mut out = vec![0.0; m * n];
                linear_with(isa, &x, m, &w, n, k, &mut out, false);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-3 * (1.0 + b.abs()),
                        "{isa} f32 {m}x{n}x{k}: {a} vs {b}"
                    );
                }
                let mut out = vec![1.0; m * n];
                linear_with(isa, &x, m, &wb, n, k, &mut out, true);
                for (a, b) in out.iter().zip(&want_b) {
                    assert!(
                        (a - (b + 1.0)).abs() < 1e-3 * (1.0 + b.abs()),
                        "{isa} bf16 accumulate {m}x{n}x{k}: {a} vs {b}+1"
                    );
                }
            }
        }
    }

    #[test]
    fn big_calls_split_over_threads_give_the_same_answer() {
        let (m, n, k) = (2, 2048, 256);
        let x = noise(m * k, 3);
        let w = noise(n * k, 4);
        let want = reference(&x, m, &w, n, k);
        for isa in isas() {
            let mut out = vec![0.0; m * n];
            linear_with(isa, &x, m, &w, n, k, &mut out, false);
            let worst = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(worst < 1e-3, "{isa}: worst {worst}");
        }
    }
}
