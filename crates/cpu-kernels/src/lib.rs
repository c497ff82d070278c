//! The CPU backend's hot loops, written with SIMD intrinsics and picked at run time for the
//! machine the process runs on (these machines differ: an AMD Zen 4 one day, an Intel Xeon with
//! AVX-512 BF16 and AMX the next), never at build time: the same binary runs everywhere.
//!
//! Why its own crate: intrinsics need `unsafe`, which the rest of the workspace denies. Every
//! public function here is safe: it checks its slices' lengths, then calls the kernel for
//! the best instruction set [`isa::current`] reports.
//!
//! Weights are row-major `(out, in)` — the layout a checkpoint stores — and the matrix
//! kernels work in "dot" form: each output is the dot product of an activation row with a
//! weight row, both contiguous, so weights stream from memory once per call with no packing
//! (the `gemm` crate's per-call packing was 44% of a batch-16 decode step). bf16 weights are
//! widened to f32 in registers; activations and accumulation stay f32.

/// Causal GQA attention over a paged K/V cache, tiled with an online softmax.
pub mod attention;
/// Instruction-set detection and the process-wide choice.
pub mod isa;
/// `out = x · Wᵀ` for f32 and bf16 weights: register-tiled dot kernels for every M.
pub mod matmul;
/// Weights packed in 16-column panels at load, and the broadcast-form GEMM over them.
pub mod packed;
/// How the matrix kernels split a call over rayon's threads.
mod tasks;
/// Vector primitives (dot, exp, weighted row sums, conversions) for attention and more.
pub mod vector;

pub use half::bf16;
pub use isa::Isa;
pub use matmul::{linear, WeightElem};
