//! KDA hybrid models: Kimi-Linear (`KimiLinearForCausalLM`) and the GLM-5.3-Flash style
//! `glm5_next` text model. Both interleave KDA linear-attention layers (fixed-size recurrent
//! state) with MLA full-attention layers (a per-token latent cache) and use a MoE FFN with a
//! shared expert; GLM adds a lower-bound KDA gate, q-LoRA MLA with a DSA indexer, clamped
//! SwiGLU and multi-stream (mHC) residuals. Formulas: shared/specs/kda.md.
//!
//! Written over [`crate::backend::Ops`] and [`crate::backend::hybrid::HybridOps`] (weights in
//! f32 or bf16, activations and state in f32); a pass takes a batch of requests per
//! attention-DP group, each with its own state. [`KdaHybridModel`] is one
//! rank (tp1); [`ShardedKdaHybrid`] runs a `tp × dp` (+ `ep`) layout as threads, each a
//! [`KdaHybridModel`] built from its shard of the same checkpoint, joined by collectives.
//! Eligible KDA projection groups are fused at load ([`projection`]); block-FP8 weights are
//! dequantised and a PEFT LoRA merged at load. The per-request state is plain public data
//! ([`KdaHybridState`]) so a prefill worker can hand it to a decode worker.
//!
//! Layout: [`config`] parses both config spellings into one checked type; [`delta_rule`] is
//! the pure recurrent / chunked kernel; [`kda`], [`mla`], [`moe`] and [`residual`] are the
//! layer parts; [`model`] assembles them and owns the prefill / decode entry points;
//! [`loading`] holds load options and rank shards; [`sharded`] runs layouts; [`transfer`]
//! moves a request's state between layouts.

pub mod config;
pub mod kda;
pub mod loading;
pub mod mla;
pub mod model;
pub mod moe;
pub mod projection;
pub mod residual;
pub mod served;
pub mod sharded;
pub mod transfer;
mod weights;

pub use config::{
    AttentionKind, FfnKind, IndexerConfig, KdaConfig, KdaGate, KdaHybridConfig, LayerSpec,
    MlaConfig, ModelFamily, MoeConfig, ResidualKind,
};
pub use kda::{ConvWindow, KdaForm, KdaLayer, KdaState};
pub use loading::{FusionPolicy, LoadOptions};
pub use model::{KdaHybridModel, KdaHybridState, LayerState, StepLogits};
pub use projection::{KdaGateProjection, KdaInputProjection, KdaProjected};
pub use sharded::{ShardError, ShardedKdaHybrid};
pub use transfer::apply_transfer_plan;
