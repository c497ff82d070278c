//! tandem's engine. Model code is written once over typed device tensors ([`tensor`]) and the
//! backend's operation trait ([`backend::Ops`]), batched over a flattened token dimension, so
//! one step of many requests is one GEMM per projection; the CPU backend is always built, a
//! CUDA backend implements the same traits in its own crate. Weights and K/V are f32 or bf16.
//! KV lives in a paged pool whose allocations free themselves on drop, and one thread owns
//! the model and the cache and runs continuous batching with chunked prefill.

/// The backend boundary (device and operation traits) and its CPU implementation.
pub mod backend;
/// Flattened batch description handed to a forward pass.
pub mod batch;
/// Structured outputs: token masks from llguidance grammars.
pub mod constraint;
/// Block-FP8 checkpoints, dequantised at load.
mod fp8_weights;
/// A request's exported state: typed manifest and body.
pub mod handoff;
/// Paged KV pool: block allocator with RAII allocations, and the cache storage.
pub mod kv_pool;
/// One loader for every family: the checkpoint's card, its family, its ranks.
pub mod load;
/// The model families: Llama, the KDA hybrids, a synthetic model.
pub mod models;
/// Token sampling: greedy, temperature, top-k, top-p, seeded.
pub mod sampling;
/// The engine thread: continuous batching with chunked prefill, and its async handle.
pub mod scheduler;
/// The interface every model family is served through, and the pools requests draw on.
pub mod served;
/// Per-step metadata buffers on the device.
pub mod step;
/// Typed tensors: dtypes, host tensors, device tensors.
pub mod tensor;

pub use backend::{Backend, CpuBackend, Ops, StepShape};
pub use fp8_weights::BlockFp8;
pub use handoff::{Body, Handoff, Segment, SegmentKind};
pub use kv_pool::{BlockAllocation, BlockAllocator, KvCache, KvLayout};
pub use load::{load, LoadSpec, Loaded};
pub use models::llama::{LlamaModel, LlamaRanks, LlamaServed, LlamaWorkspace, TpShard};
pub use scheduler::{
    blocking_tokens, Engine, EngineConfig, EngineEvent, EngineStats, Sampled, SeqKind,
};
pub use served::{Pools, Reservation, ServedInfo, ServedModel, StateSlot};
pub use step::{StepLimits, StepMeta};
pub use tensor::{DType, HostData, HostTensor, Tensor};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The checkpoint could not be read.
    #[error(transparent)]
    Model(#[from] tandem_model::Error),
    /// A safetensors file did not parse or lacks a tensor.
    #[error("{0}")]
    Weights(String),
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Not enough free KV blocks.
    #[error("KV pool exhausted: need {needed} blocks, {free} free")]
    CapacityExhausted {
        /// Blocks asked for.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// The request cannot be served (too long, empty).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine thread is gone.
    #[error("engine stopped")]
    Stopped,
    /// A collective between tensor-parallel ranks failed (a peer died or timed out).
    #[error("collective between ranks failed: {0}")]
    Collective(String),
    /// The device could not be opened or failed.
    #[error("device: {0}")]
    Device(String),
}

impl Error {
    /// The same failure told again (to another choice of one request): same class and
    /// message.
    pub fn again(&self) -> Error {
        match self {
            Error::CapacityExhausted { needed, free } => Error::CapacityExhausted {
                needed: *needed,
                free: *free,
            },
            Error::InvalidRequest(m) => Error::InvalidRequest(m.clone()),
            Error::Stopped => Error::Stopped,
            Error::Collective(m) => Error::Collective(m.clone()),
            Error::Device(m) => Error::Device(m.clone()),
            other => Error::Weights(other.to_string()),
        }
    }

    /// The class this failure belongs to.
    pub fn class(&self) -> tandem_core::ErrorClass {
        use tandem_core::ErrorClass;
        match self {
            Error::CapacityExhausted { .. } => ErrorClass::CapacityExhausted,
            Error::InvalidRequest(_) => ErrorClass::InvalidRequest,
            Error::Stopped => ErrorClass::Unavailable,
            Error::Model(_)
            | Error::Weights(_)
            | Error::Io { .. }
            | Error::Collective(_)
            | Error::Device(_) => ErrorClass::Internal,
        }
    }
}

/// Result of the engine.
pub type Result<T> = std::result::Result<T, Error>;
