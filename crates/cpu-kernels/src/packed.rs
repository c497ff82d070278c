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

/// A `(n, k)` weight matrix in panel layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Packed<W> {
    n: usize,
    k: usize,
    data: Vec<W>,
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PackElem, PANEL};
    use std::any::TypeId;
    use std::arch::x86_64::*;

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
        match (rows, np) {
            (1, 1) => go!(1, 1),
            (1, 2) => go!(1, 2),
            (1, 3) => go!(1, 3),
            (1, _) => go!(1, 4),
            (2, 1) => go!(2, 1),
            (2, 2) => go!(2, 2),
            (2, 3) => go!(2, 3),
            (2, _) => go!(2, 4),
            (3, 1) => go!(3, 1),
            (3, 2) => go!(3, 2),
            (3, 3) => go!(3, 3),
            (3, _) => go!(3, 4),
            (4, 1) => go!(4, 1),
            (4, 2) => go!(4, 2),
            (4, 3) => go!(4, 3),
            (4, _) => go!(4, 4),
            (5, 1) => go!(5, 1),
            (5, 2) => go!(5, 2),
            (5, 3) => go!(5, 3),
            (5, _) => go!(5, 4),
            (_, 1) => go!(6, 1),
            (_, 2) => go!(6, 2),
            (_, 3) => go!(6, 3),
            _ => go!(6, 4),
        }
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
                for (a, b) in out.iter().zip(&want_b) {
                    assert!(
                        (a - b).abs() < 1e-3 * (1.0 + b.abs()),
                        "{isa} bf16 {m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
