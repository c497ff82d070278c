//! The Llama family: the model over the backend traits ([`LlamaModel`], one tensor-parallel
//! rank) and its ranks served as one engine ([`served`]).

mod model;
/// The ranks of one Llama engine (tensor parallelism: one thread per rank).
pub mod served;

pub use model::{check_dtype, LlamaModel, LlamaWorkspace, TpShard};
pub use served::{LlamaRanks, LlamaServed};
