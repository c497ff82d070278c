//! Small host-side building blocks of the CPU bodies of the hybrid operations
//! (`backend::cpu_hybrid`) and the delta rule: row norms, activations, vector kernels.

use rayon::prelude::*;

/// Each sequence's rows, from the rows per sequence, in order.
pub(crate) fn row_ranges(segments: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut at = 0;
    segments
        .iter()
        .map(|&n| {
            at += n;
            at - n..at
        })
        .collect()
}

/// Row-wise RMSNorm over rows of `weight.len()` (or of `dim` with `weight` `None`), in place.
pub(crate) fn rms_norm_rows(x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
    x.par_chunks_mut(dim).for_each(|row| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        match weight {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * r * w),
            None => row.iter_mut().for_each(|v| *v *= r),
        }
    });
}

/// `1 / (1 + e^-x)`.
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x · sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `ln(1 + e^x)` with torch's defaults (beta 1, linear above threshold 20).
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Scales each row of `dim` to unit L2 norm: `x / sqrt(Σx² + 1e-6)`, then by `scale`.
pub(crate) fn l2norm_rows(x: &mut [f32], dim: usize, scale: f32) {
    for row in x.chunks_exact_mut(dim) {
        let ss = row.iter().map(|v| v * v).sum::<f32>();
        let r = scale / (ss + 1e-6).sqrt();
        row.iter_mut().for_each(|v| *v *= r);
    }
}

/// Dot product (the CPU backend's vectorising one).
pub(crate) use crate::backend::host::dot;

/// `y += a · x`.
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softplus_matches_closed_form_and_threshold() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(-3.0) - (1.0f32 + (-3.0f32).exp()).ln()).abs() < 1e-7);
    }

    #[test]
    fn l2norm_gives_unit_rows() {
        let mut x = vec![3.0, 4.0, 0.0, 0.0, 1.0, 0.0];
        l2norm_rows(&mut x, 3, 1.0);
        let n: f32 = x[..3].iter().map(|v| v * v).sum();
        assert!((n - 1.0).abs() < 1e-6);
    }
}
