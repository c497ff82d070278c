//! The model families, each written once over the backend traits: its config, weights,
//! forward pass and the [`crate::ServedModel`] that serves it.

/// KDA hybrid models (Kimi-Linear, GLM-5.3-Flash style): KDA + MLA layers, MoE FFN.
pub mod kda_hybrid;
/// The Llama family (GQA, RoPE, RMSNorm, SwiGLU, tied embeddings).
pub mod llama;
/// A model that computes nothing (control-plane load tests).
pub mod synthetic;
