//! Helpers of the KDA-hybrid op tests (`hybrid_vs_cpu`, `delta_rule_vs_cpu`): the step's
//! sequences, noise, the same values on both devices, and tolerance checks.
// Each test executable uses its own subset.
#![allow(dead_code)]

use std::ops::Range;
use tandem_cuda::CudaBackend;
use tandem_engine::{Backend, CpuBackend, DType, HostTensor, Tensor};
pub type C = CpuBackend;
pub type G = CudaBackend;

/// Rows of the sequences of a step: one token, a few, one chunk and a bit, an empty one, two
/// chunks and a bit.
pub const SEGMENTS: [usize; 5] = [1, 3, 70, 0, 130];

/// A decode step: nine sequences of one token each (the delta rule's decode kernels).
pub const DECODE_SEGMENTS: [usize; 9] = [1; 9];

pub fn seqs() -> Vec<Range<usize>> {
    seqs_of(&SEGMENTS)
}

pub fn seqs_of(segments: &[usize]) -> Vec<Range<usize>> {
    tandem_engine::backend::hybrid::row_ranges(segments)
}

pub fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `data` rounded to bf16 and back: what the CPU sees of a weight the GPU reads in bf16.
pub fn bf16_rounded(data: &[f32]) -> Vec<f32> {
    data.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// The same f32 values on both devices.
pub fn both(c: &C, g: &G, shape: &[usize], data: Vec<f32>) -> (Tensor<C>, Tensor<G>) {
    let t = HostTensor::from_f32(shape, data).expect("shape matches");
    (c.upload(&t), g.upload(&t))
}

/// A weight: f32 on the CPU (its bf16-rounded values for `DType::BF16`), `dtype` on the GPU.
pub fn weight(
    c: &C,
    g: &G,
    shape: &[usize],
    data: Vec<f32>,
    dtype: DType,
) -> (Tensor<C>, Tensor<G>) {
    let cpu = match dtype {
        DType::BF16 => bf16_rounded(&data),
        _ => data.clone(),
    };
    let host = HostTensor::from_f32(shape, data).expect("shape matches");
    let gpu = g.upload(&host.to_dtype(dtype).expect("float dtype"));
    let cpu = c.upload(&HostTensor::from_f32(shape, cpu).expect("shape matches"));
    (cpu, gpu)
}

pub fn values<B: Backend>(b: &B, t: &Tensor<B>) -> Vec<f32> {
    b.download(t).to_f32_vec()
}

/// Asserts `max |cpu − cuda| ≤ tol · max |cpu|` and prints it.
pub fn close(what: &str, cpu: &[f32], cuda: &[f32], tol: f32) {
    assert_eq!(cpu.len(), cuda.len(), "{what}: lengths");
    let scale = cpu.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let worst = cpu
        .iter()
        .zip(cuda)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    println!("{what}: max |diff| = {worst:.3e} (scale {scale:.3e}, tolerance {tol:.0e})");
    assert!(
        worst <= tol * scale && worst.is_finite(),
        "{what}: max |cpu - cuda| = {worst} (scale {scale}, tolerance {tol})"
    );
}

pub fn close_tensors(what: &str, c: &C, tc: &Tensor<C>, g: &G, tg: &Tensor<G>, tol: f32) {
    close(what, &values(c, tc), &values(g, tg), tol);
}

/// Rows `[n, dim]` of noise scaled to unit L2 norm, then by `scale` (the delta rule's q, k).
pub fn unit_rows(seed: u64, n: usize, dim: usize, scale: f32) -> Vec<f32> {
    let mut x = noise(seed, n * dim);
    for row in x.chunks_exact_mut(dim) {
        let r = scale / row.iter().map(|v| v * v).sum::<f32>().sqrt();
        row.iter_mut().for_each(|v| *v *= r);
    }
    x
}
