//! tandem's CUDA backend: [`CudaBackend`] implements the engine's [`Backend`] and [`Ops`]
//! traits (and [`HybridOps`] for the KDA-hybrid family), so the model code the CPU runs is the
//! code the GPU runs. It owns one context and
//! one non-default stream per device; every operation is queued on that stream and only
//! downloads, sampling and [`Backend::synchronize`] wait for it.
//!
//! - Kernels are the project's own CUDA C (`kernels.cu`), compiled by NVRTC at start-up for the
//!   device's architecture and cached on disk by source hash and architecture ([`compile`]).
//! - Matrix products: a bf16 GEMV kernel for decode-sized row counts (weights read once, with
//!   16-byte loads), cuBLAS `GemmEx` (bf16 in, f32 out and accumulation) above it, cuBLAS
//!   f32 GEMMs for f32 weights.
//! - Decode steps are captured as CUDA graphs per shape and replayed ([`graph`]).
//! - Libraries load at run time (cudarc's dynamic loading), so the binary builds and runs
//!   everywhere; [`CudaBackend::new`] says in one line what is missing on a machine without
//!   a GPU instead of failing later.
//!
//! Why its own crate: driver calls are `unsafe`, which the rest of the workspace denies.
//!
//! [`Backend`]: tandem_engine::Backend
//! [`Ops`]: tandem_engine::Ops
//! [`HybridOps`]: tandem_engine::backend::HybridOps
//! [`Backend::synchronize`]: tandem_engine::Backend::synchronize

/// NVRTC compilation of the kernels with an on-disk cache.
pub mod compile;
/// KDA's delta rule: the recurrent kernel (decode) and the chunked kernels (prompts).
mod delta_rule;
mod device;
/// Collectives between ranks sharing one GPU, in device memory.
pub mod device_comm;
/// The environment variables the backend reads.
mod env;
mod gemm;
/// Decode steps captured as CUDA graphs and replayed.
pub mod graph;
/// The KDA-hybrid family's operations (`HybridOps`): KDA, MLA over paged latents, MoE.
mod hybrid;
/// MLA over paged latents (`HybridOps` bodies).
mod mla;
/// MoE routing and grouped experts (`HybridOps` bodies).
mod moe;
/// NCCL communicators for tensor-parallel ranks on distinct GPUs.
pub mod nccl;
mod ops;
/// Tensor-core attention for prompt-shaped steps.
mod prefill;
/// Traced steps: device work recorded while the host code runs, replayed as CUDA graphs.
mod trace;

pub use device::{kernel_names, CudaBackend, CudaStorage};
pub use trace::TraceStats;

/// Why the CUDA backend could not start or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA library is missing (no driver, no toolkit on this machine).
    #[error("{0}")]
    Unavailable(String),
    /// The device index does not exist.
    #[error("no CUDA device {ordinal}: this machine has {count}")]
    NoSuchDevice {
        /// The index asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// The kernels did not compile.
    #[error("NVRTC: {0}")]
    Compile(String),
}

/// Result of the CUDA backend.
pub type Result<T> = std::result::Result<T, Error>;

/// Parses a device name: `cuda`, `cuda:N`.
pub fn parse_device(name: &str) -> Option<usize> {
    match name {
        "cuda" => Some(0),
        _ => name.strip_prefix("cuda:")?.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!(parse_device("cuda"), Some(0));
        assert_eq!(parse_device("cuda:3"), Some(3));
        assert_eq!(parse_device("cuda:x"), None);
        assert_eq!(parse_device("cpu"), None);
    }
}
