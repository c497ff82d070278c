//! Host-side f32 matrices as a checkpoint reader hands them out (the KDA-hybrid loader
//! slices, fuses and merges LoRA adapters into them before uploading them to a backend), and
//! the host products of the CPU kernels.

/// A weight matrix `(out, in)` in host memory, row-major: `y = x · Wᵀ`.
#[derive(Debug)]
pub struct Linear<T> {
    /// The weights, `out * in` elements.
    pub weight: T,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
}

/// `out = x · Wᵀ` (or `+=` when `accumulate`) for `rows` rows; `out` is resized to fit.
#[allow(clippy::ptr_arg)]
pub fn matmul_raw(
    x: &Vec<f32>,
    rows: usize,
    w: &Vec<f32>,
    out_features: usize,
    in_features: usize,
    out: &mut Vec<f32>,
    accumulate: bool,
) {
    out.resize(rows * out_features, 0.0);
    tandem_cpu_kernels::linear(x, rows, w, out_features, in_features, out, accumulate);
}

/// [`matmul_raw`] with a [`Linear`].
#[allow(clippy::ptr_arg)]
pub fn matmul(
    x: &Vec<f32>,
    rows: usize,
    w: &Linear<Vec<f32>>,
    out: &mut Vec<f32>,
    accumulate: bool,
) {
    matmul_raw(
        x,
        rows,
        &w.weight,
        w.out_features,
        w.in_features,
        out,
        accumulate,
    );
}

/// Dot product (the CPU kernels' vectorised one).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    tandem_cpu_kernels::vector::dot(a, b)
}
