//! Small host-side building blocks of the CPU bodies of the hybrid operations
//! (`backend::cpu::hybrid`) and the delta rule: row norms, activations, vector kernels, KDA's
//! short causal convolution.

use rayon::prelude::*;

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

/// Depthwise causal convolution of width `w` over `pre` `[T, P]` continuing from `window`
/// (`[P, w-1]`, oldest first), followed by SiLU; `window` is advanced to the last `w-1` inputs.
///
/// `y[t][c] = Σ_j weight[c][j] · ext[t+j][c]`, where `ext` is the window followed by `pre`.
pub(crate) fn short_conv(
    pre: &[f32],
    window: &mut [f32],
    weight: &[f32],
    p: usize,
    w: usize,
) -> Vec<f32> {
    let rows = pre.len() / p;
    let hist = w - 1;
    debug_assert_eq!(window.len(), p * hist);
    debug_assert_eq!(weight.len(), p * w);
    let ext = |i: usize, c: usize| -> f32 {
        if i < hist {
            window[c * hist + i]
        } else {
            pre[(i - hist) * p + c]
        }
    };
    let mut out = vec![0.0f32; rows * p];
    for (t, out_row) in out.chunks_exact_mut(p).enumerate() {
        for (c, y) in out_row.iter_mut().enumerate() {
            let wc = &weight[c * w..(c + 1) * w];
            let acc: f32 = wc
                .iter()
                .enumerate()
                .map(|(j, &wj)| wj * ext(t + j, c))
                .sum();
            *y = silu(acc);
        }
    }
    let next: Vec<f32> = (0..p)
        .flat_map(|c| (0..hist).map(move |j| (c, rows + j)))
        .map(|(c, i)| ext(i, c))
        .collect();
    window.copy_from_slice(&next);
    out
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

    #[test]
    fn short_conv_in_pieces_equals_one_pass() {
        let (p, w, t) = (3, 4, 7);
        let pre: Vec<f32> = (0..t * p).map(|i| (i as f32 * 0.37).sin()).collect();
        let weight: Vec<f32> = (0..p * w).map(|i| (i as f32 * 0.91).cos()).collect();
        let mut win_all = vec![0.0; p * (w - 1)];
        let all = short_conv(&pre, &mut win_all, &weight, p, w);
        let mut win = vec![0.0; p * (w - 1)];
        let mut pieces = short_conv(&pre[..2 * p], &mut win, &weight, p, w);
        for i in 2..t {
            pieces.extend(short_conv(
                &pre[i * p..(i + 1) * p],
                &mut win,
                &weight,
                p,
                w,
            ));
        }
        assert_eq!(win, win_all);
        for (a, b) in all.iter().zip(&pieces) {
            assert!((a - b).abs() < 1e-6);
        }
        // The window holds the last three inputs, oldest first, channel-major.
        assert_eq!(win_all[0], pre[4 * p]);
        assert_eq!(win_all[2], pre[6 * p]);
        assert_eq!(win_all[3], pre[4 * p + 1]);
    }
}
