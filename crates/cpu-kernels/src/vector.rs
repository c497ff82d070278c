//! Vector primitives for attention and element-wise work: dot products and `y += a·x` with
//! f32 or bf16 right-hand sides, and f32 → bf16 rounding. Dispatch is per call, so keep the
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
        _ => portable_dot(&a[..n], &b[..n]),
    }
}

/// `y[i] += a · x[i]` over the shorter length.
pub fn axpy<W: WeightElem>(y: &mut [f32], a: f32, x: &[W]) {
    let n = y.len().min(x.len());
    match isa::current() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`; `y` is exclusively borrowed.
        Isa::Avx512 => unsafe { x86::axpy512(y.as_mut_ptr(), a, x.as_ptr(), n) },
        _ => {
            for (y, x) in y[..n].iter_mut().zip(&x[..n]) {
                *y += a * x.to_f32();
            }
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
mod x86 {
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
    /// `y` and `x` hold `n` values, `y` writable and not aliased; AVX-512 F/BW/VL present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn axpy512<W: WeightElem>(y: *mut f32, a: f32, x: *const W, n: usize) {
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        while i < n {
            let left = (n - i).min(16);
            let mask: __mmask16 = ((1u32 << left) - 1) as u16;
            let yv = _mm512_maskz_loadu_ps(mask, y.add(i));
            let r = _mm512_fmadd_ps(av, load(x.add(i), mask), yv);
            _mm512_mask_storeu_ps(y.add(i), mask, r);
            i += left;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_axpy_agree_with_scalar_for_every_length() {
        for n in [0usize, 1, 15, 16, 17, 31, 32, 33, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let bb: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let want_b: f32 = a.iter().zip(&bb).map(|(x, y)| x * y.to_f32()).sum();
            assert!((dot(&a, &b) - want).abs() < 1e-4, "dot f32 n={n}");
            assert!((dot(&a, &bb) - want_b).abs() < 1e-4, "dot bf16 n={n}");
            let mut y = vec![1.0f32; n];
            axpy(&mut y, 2.0, &bb);
            for (i, v) in y.iter().enumerate() {
                assert!(
                    (v - (1.0 + 2.0 * bb[i].to_f32())).abs() < 1e-6,
                    "axpy n={n} i={i}"
                );
            }
        }
    }
}
