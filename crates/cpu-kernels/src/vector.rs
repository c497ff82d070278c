//! Vector primitives for attention and element-wise work: dot products with f32 or bf16
//! right-hand sides, exp, weighted row sums, sums, and f32 ↔ bf16 conversion. Dispatch is per call, so keep the
//! vectors long enough (a head is 64–128 values) for it not to matter.

use crate::isa::{self, Isa};
use crate::matmul::WeightElem;
use half::bf16;

/// `Σ a[i]·b[i]` over the shorter length.
pub fn dot<W: WeightElem>(a: &[f32], b: &[W]) -> f32 {
    let n = a.len().min(b.len());
    match isa::current() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA is supported (checked by `isa::current`), `n` is within both slices.
        Isa::Avx512 => unsafe { x86::dot512(a.as_ptr(), b.as_ptr(), n) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::dot256(a.as_ptr(), b.as_ptr(), n) },
        _ => portable_dot(&a[..n], &b[..n]),
    }
}

/// `x[i] = e^x[i]` (vectorised: range reduction to `2^n · 2^f` and a degree-6 polynomial,
/// relative error below 1e-6 for |x| ≤ 10, growing with |x| from the rounding of
/// x·log2(e); `-inf` gives 0).
pub fn exp_inplace(x: &mut [f32]) {
    match isa::current() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA is supported; `x` is exclusively borrowed.
        Isa::Avx512 => unsafe { x86::exp512(x.as_mut_ptr(), x.len()) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::exp256(x.as_mut_ptr(), x.len()) },
        _ => x.iter_mut().for_each(|v| *v = v.exp()),
    }
}

/// `acc[d] += Σ_j p[j] · v[j*stride + d]` for `d < acc.len()`: a weighted sum of rows (the
/// probabilities × values step of attention), accumulators kept in registers across rows.
pub fn weighted_rows<W: WeightElem>(acc: &mut [f32], p: &[f32], v: &[W], stride: usize) {
    let (n, len) = (p.len(), acc.len());
    if n == 0 || len == 0 {
        return;
    }
    assert!(v.len() >= (n - 1) * stride + len, "rows too short");
    match isa::current() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the assert bounds every row; `acc` is exclusively borrowed.
        Isa::Avx512 => unsafe {
            x86::weighted_rows512(acc.as_mut_ptr(), len, p, v.as_ptr(), stride)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::weighted_rows256(acc.as_mut_ptr(), len, p, v.as_ptr(), stride) },
        _ => {
            for (j, &pj) in p.iter().enumerate() {
                for (a, x) in acc.iter_mut().zip(&v[j * stride..j * stride + len]) {
                    *a += pj * x.to_f32();
                }
            }
        }
    }
}

/// `Σ x[i]` with many independent accumulators, so a long slice is summed at memory speed
/// (the read-bandwidth probe of the engine benchmark).
pub fn sum(x: &[f32]) -> f32 {
    match isa::current() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA is supported; `x` holds `x.len()` values.
        Isa::Avx512 => unsafe { x86::sum512(x.as_ptr(), x.len()) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::sum256(x.as_ptr(), x.len()) },
        _ => {
            let mut acc = [0.0f32; 16];
            let c = x.chunks_exact(16);
            let tail: f32 = c.remainder().iter().sum();
            for b in c {
                for (a, v) in acc.iter_mut().zip(b) {
                    *a += v;
                }
            }
            acc.iter().sum::<f32>() + tail
        }
    }
}

/// Rounds f32 to bf16 (round to nearest even, as torch does).
pub fn to_bf16(src: &[f32], dst: &mut [bf16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_f32(s);
    }
}

/// Widens bf16 to f32.
pub fn from_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

fn portable_dot<W: WeightElem>(a: &[f32], b: &[W]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y.to_f32())
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].to_f32();
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::matmul::avx2::{hsum, load8};
    use crate::matmul::WeightElem;
    use std::any::TypeId;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load<W: WeightElem>(p: *const W, mask: __mmask16) -> __m512 {
        if TypeId::of::<W>() == TypeId::of::<f32>() {
            _mm512_maskz_loadu_ps(mask, p as *const f32)
        } else {
            let h = _mm256_maskz_loadu_epi16(mask, p as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    /// # Safety
    /// `a` and `b` hold `n` values; AVX-512 F/BW/VL present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot512<W: WeightElem>(a: *const f32, b: *const W, n: usize) -> f32 {
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        while i + 32 <= n {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), load(b.add(i), 0xffff), acc0);
            acc1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.add(i + 16)),
                load(b.add(i + 16), 0xffff),
                acc1,
            );
            i += 32;
        }
        while i < n {
            let left = (n - i).min(16);
            let mask: __mmask16 = ((1u32 << left) - 1) as u16;
            acc0 = _mm512_fmadd_ps(
                _mm512_maskz_loadu_ps(mask, a.add(i)),
                load(b.add(i), mask),
                acc0,
            );
            i += left;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
    }

    /// # Safety
    /// `x` holds `n` values; AVX-512 F present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn sum512(x: *const f32, n: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 8];
        let mut i = 0;
        while i + 128 <= n {
            for (q, a) in acc.iter_mut().enumerate() {
                *a = _mm512_add_ps(*a, _mm512_loadu_ps(x.add(i + 16 * q)));
            }
            i += 128;
        }
        let mut total = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
        while i < n {
            let left = (n - i).min(16);
            let mask: __mmask16 = ((1u32 << left) - 1) as u16;
            total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(mask, x.add(i)));
            i += left;
        }
        _mm512_reduce_add_ps(total)
    }

    /// `e^v` lane by lane (see [`super::exp_inplace`]); `-inf` gives 0.
    ///
    /// 2^f on [-0.5, 0.5]: minimax-style coefficients of ln(2)^k / k!, lowest first.
    const EXP2_POLY: [f32; 7] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
    ];

    /// # Safety
    /// AVX-512 F present.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn exp_ps(v: __m512) -> __m512 {
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let lo = _mm512_set1_ps(-126.0);
        let hi = _mm512_set1_ps(127.0);
        let c = EXP2_POLY;
        let t = _mm512_mul_ps(v, log2e);
        // -inf (masked-out scores) and tiny values clamp to 2^-126 · 2^f, then flush to 0.
        let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(t, lo);
        let t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
        let nf = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, nf);
        let mut p = _mm512_set1_ps(c[6]);
        for &ck in c[..6].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ck));
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(nf),
            _mm512_set1_epi32(127),
        ));
        let r = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
        _mm512_mask_blend_ps(underflow, r, _mm512_setzero_ps())
    }

    /// # Safety
    /// `x` holds `n` writable values; AVX-512 F present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn exp512(x: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let left = (n - i).min(16);
            let mask: __mmask16 = ((1u32 << left) - 1) as u16;
            let v = _mm512_maskz_loadu_ps(mask, x.add(i));
            _mm512_mask_storeu_ps(x.add(i), mask, exp_ps(v));
            i += left;
        }
    }

    /// # Safety
    /// `acc` holds `len` writable values, row `j < p.len()` of `v` starts at `j*stride` and
    /// holds `len` values; AVX-512 F/BW/VL present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn weighted_rows512<W: WeightElem>(
        acc: *mut f32,
        len: usize,
        p: &[f32],
        v: *const W,
        stride: usize,
    ) {
        let mut d = 0;
        while d < len {
            let left = (len - d).min(64);
            // Up to four vectors of accumulators live in registers across all rows.
            let masks: [__mmask16; 4] = std::array::from_fn(|q| {
                let l = left.saturating_sub(16 * q).min(16);
                ((1u32 << l) - 1) as u16
            });
            let mut a = [_mm512_setzero_ps(); 4];
            for q in 0..4 {
                a[q] = _mm512_maskz_loadu_ps(masks[q], acc.add(d + 16 * q));
            }
            for (j, &pj) in p.iter().enumerate() {
                let b = _mm512_set1_ps(pj);
                let row = v.add(j * stride + d);
                for q in 0..4 {
                    if masks[q] != 0 {
                        a[q] = _mm512_fmadd_ps(b, load(row.add(16 * q), masks[q]), a[q]);
                    }
                }
            }
            for q in 0..4 {
                _mm512_mask_storeu_ps(acc.add(d + 16 * q), masks[q], a[q]);
            }
            d += left;
        }
    }

    /// # Safety
    /// `a` and `b` hold `n` values; AVX2 and FMA present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot256<W: WeightElem>(a: *const f32, b: *const W, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (q, s) in acc.iter_mut().enumerate() {
                let at = i + 8 * q;
                *s = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(at)), load8(b.add(at)), *s);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), load8(b.add(i)), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += *a.add(i) * (*b.add(i)).to_f32();
            i += 1;
        }
        s
    }

    /// [`exp_ps`] on eight lanes.
    ///
    /// # Safety
    /// AVX2 and FMA present.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_ps256(v: __m256) -> __m256 {
        let c = EXP2_POLY;
        let lo = _mm256_set1_ps(-126.0);
        let t = _mm256_mul_ps(v, _mm256_set1_ps(std::f32::consts::LOG2_E));
        let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(t, lo);
        let t = _mm256_min_ps(_mm256_max_ps(t, lo), _mm256_set1_ps(127.0));
        let nf = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm256_sub_ps(t, nf);
        let mut p = _mm256_set1_ps(c[6]);
        for &ck in c[..6].iter().rev() {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(ck));
        }
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(nf),
            _mm256_set1_epi32(127),
        ));
        let r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_blendv_ps(r, _mm256_setzero_ps(), underflow)
    }

    /// # Safety
    /// `x` holds `n` writable values; AVX2 and FMA present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp256(x: *mut f32, n: usize) {
        let mut i = 0;
        while i < n {
            let left = (n - i).min(8);
            if left == 8 {
                _mm256_storeu_ps(x.add(i), exp_ps256(_mm256_loadu_ps(x.add(i))));
            } else {
                let mut tail = [0.0f32; 8];
                std::ptr::copy_nonoverlapping(x.add(i), tail.as_mut_ptr(), left);
                let e = exp_ps256(_mm256_loadu_ps(tail.as_ptr()));
                _mm256_storeu_ps(tail.as_mut_ptr(), e);
                std::ptr::copy_nonoverlapping(tail.as_ptr(), x.add(i), left);
            }
            i += left;
        }
    }

    /// # Safety
    /// As [`weighted_rows512`], with AVX2 and FMA present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_rows256<W: WeightElem>(
        acc: *mut f32,
        len: usize,
        p: &[f32],
        v: *const W,
        stride: usize,
    ) {
        let mut d = 0;
        // Up to four vectors of accumulators live in registers across all rows.
        while d + 8 <= len {
            let vectors = ((len - d) / 8).min(4);
            let mut a = [_mm256_setzero_ps(); 4];
            for (q, r) in a.iter_mut().enumerate().take(vectors) {
                *r = _mm256_loadu_ps(acc.add(d + 8 * q));
            }
            for (j, &pj) in p.iter().enumerate() {
                let b = _mm256_set1_ps(pj);
                let row = v.add(j * stride + d);
                for (q, r) in a.iter_mut().enumerate().take(vectors) {
                    *r = _mm256_fmadd_ps(b, load8(row.add(8 * q)), *r);
                }
            }
            for (q, r) in a.iter().enumerate().take(vectors) {
                _mm256_storeu_ps(acc.add(d + 8 * q), *r);
            }
            d += 8 * vectors;
        }
        for c in d..len {
            let mut s = *acc.add(c);
            for (j, &pj) in p.iter().enumerate() {
                s += pj * (*v.add(j * stride + c)).to_f32();
            }
            *acc.add(c) = s;
        }
    }

    /// # Safety
    /// `x` holds `n` values; AVX2 present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sum256(x: *const f32, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (q, s) in acc.iter_mut().enumerate() {
                *s = _mm256_add_ps(*s, _mm256_loadu_ps(x.add(i + 8 * q)));
            }
            i += 32;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += *x.add(i);
            i += 1;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` with the kernels limited to each instruction set the CPU has, in turn (each
    /// test is its own process under nextest; elsewhere the others see the same kernels
    /// lowered for a while, which are right too).
    fn each_isa(mut f: impl FnMut(Isa)) {
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            if isa <= isa::detected() {
                isa::limit(isa);
                f(isa);
            }
        }
        isa::limit(isa::detected());
    }

    #[test]
    fn exp_is_accurate_and_flushes_minus_infinity() {
        each_isa(exp_case);
    }

    fn exp_case(isa: Isa) {
        let mut x: Vec<f32> = (-2000..=800).map(|i| i as f32 * 0.05).collect();
        x.push(f32::NEG_INFINITY);
        let input = x.clone();
        let want: Vec<f32> = x.iter().map(|v| v.exp()).collect();
        exp_inplace(&mut x);
        for ((a, b), v) in x.iter().zip(&want).zip(&input) {
            // Rounding of x·log2(e) grows with |x|: softmax arguments near 0 are what matter.
            let tol = if v.abs() <= 10.0 { 1e-6 } else { 1e-5 };
            assert!(
                (a - b).abs() <= tol * b.abs() + 1e-37,
                "{isa} exp({v}): {a} vs {b}"
            );
        }
    }

    #[test]
    fn sum_adds_every_value() {
        each_isa(sum_case);
    }

    fn sum_case(isa: Isa) {
        for n in [0usize, 1, 127, 128, 129, 1000] {
            let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            let want: f32 = x.iter().sum();
            assert_eq!(sum(&x), want, "{isa} n={n}");
        }
    }

    #[test]
    fn weighted_rows_equals_the_loop() {
        each_isa(weighted_case);
    }

    fn weighted_case(isa: Isa) {
        for len in [1usize, 7, 8, 16, 33, 64, 70, 128] {
            let n = 5;
            let stride = len + 3;
            let v: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.3).sin()).collect();
            let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            let p = [0.1f32, 0.5, -0.25, 2.0, 0.0];
            let mut acc = vec![1.0f32; len];
            weighted_rows(&mut acc, &p, &vb, stride);
            for d in 0..len {
                let want: f32 = 1.0
                    + (0..n)
                        .map(|j| p[j] * vb[j * stride + d].to_f32())
                        .sum::<f32>();
                assert!((acc[d] - want).abs() < 1e-5, "{isa} len {len} d {d}");
            }
        }
    }

    #[test]
    fn dot_agrees_with_scalar_for_every_length() {
        each_isa(dot_case);
    }

    fn dot_case(isa: Isa) {
        for n in [0usize, 1, 15, 16, 17, 31, 32, 33, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let bb: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let want_b: f32 = a.iter().zip(&bb).map(|(x, y)| x * y.to_f32()).sum();
            assert!((dot(&a, &b) - want).abs() < 1e-4, "{isa} dot f32 n={n}");
            assert!((dot(&a, &bb) - want_b).abs() < 1e-4, "{isa} dot bf16 n={n}");
        }
    }
}
