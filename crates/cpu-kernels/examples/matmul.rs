//! `cargo run --release -p tandem-cpu-kernels --example matmul`: GFLOP/s and weight GB/s of
//! the dot kernels (row-major weights) and the packed-panel kernels beside the `gemm` crate,
//! per M, in one run.

use std::time::Instant;
use tandem_cpu_kernels::packed::{linear_packed, Packed};
use tandem_cpu_kernels::{bf16, isa, matmul::linear_with};

fn main() {
    let (n, k) = (1536, 576);
    let copies = 30; // distinct weights, so the M=1 figure is read from memory, not cache
    let ws: Vec<Vec<f32>> = (0..copies)
        .map(|c| (0..n * k).map(|i| ((i + c) % 97) as f32 * 1e-3).collect())
        .collect();
    let wb: Vec<Vec<bf16>> = ws
        .iter()
        .map(|w| w.iter().map(|&v| bf16::from_f32(v)).collect())
        .collect();
    let pf: Vec<Packed<f32>> = ws.iter().map(|w| Packed::pack(w, n, k)).collect();
    let pb: Vec<Packed<bf16>> = wb.iter().map(|w| Packed::pack(w, n, k)).collect();
    // `cargo run --example matmul -- avx2` measures a lower instruction set.
    let isa = std::env::args()
        .nth(1)
        .and_then(|name| tandem_cpu_kernels::Isa::parse(&name))
        .map_or_else(isa::detected, isa::limit);
    println!(
        "isa {isa} (detected {}) features {:?}, {} threads",
        isa::detected(),
        isa::features(),
        rayon::current_num_threads()
    );
    for m in [1usize, 4, 16, 24, 64, 512] {
        let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let mut out = vec![0.0f32; m * n];
        let reps = (200 / m).max(3);
        let time = |f: &mut dyn FnMut(usize)| {
            let t = Instant::now();
            for r in 0..reps * copies {
                f(r % copies);
            }
            t.elapsed().as_secs_f64() / (reps * copies) as f64
        };
        let tf = time(&mut |c| linear_with(isa, &x, m, &ws[c], n, k, &mut out, false));
        let tb = time(&mut |c| linear_with(isa, &x, m, &wb[c], n, k, &mut out, false));
        let tg = time(&mut |c| gemm_alone(&x, m, &ws[c], n, k, &mut out));
        let tpf = time(&mut |c| linear_packed(&x, m, &pf[c], &mut out, false));
        let tpb = time(&mut |c| linear_packed(&x, m, &pb[c], &mut out, false));
        let flop = 2.0 * (m * n * k) as f64;
        println!(
            "M={m:<4} dot f32 {:>6.1} GFLOP/s {:>5.1} GB/s | dot bf16 {:>6.1} GFLOP/s {:>5.1} GB/s | packed f32 {:>6.1} bf16 {:>6.1} GFLOP/s | gemm crate f32 {:>6.1} GFLOP/s",
            flop / tf / 1e9,
            (n * k * 4) as f64 / tf / 1e9,
            flop / tb / 1e9,
            (n * k * 2) as f64 / tb / 1e9,
            flop / tpf / 1e9,
            flop / tpb / 1e9,
            flop / tg / 1e9,
        );
    }
}

/// The `gemm` crate called as the engine called it before these kernels (the baseline).
fn gemm_alone(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    let par = if m * n * k >= 64 * 1024 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: x is m×k, w is n×k, out is m×n, all row-major and in bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}
