//! The few numbers of a model that decide how it can be sharded.
//!
//! Each layer kind is an `Option`: a model has the kinds it has (SmolLM2: GQA and a dense MLP;
//! Kimi Linear: KDA, MLA and MoE plus a few dense layers), and validation and reshard plans
//! only consider the kinds that are present.

use serde::{Deserialize, Serialize};

/// Shape of a model as far as sharding is concerned.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Softmax attention with grouped KV heads (MHA when the counts are equal).
    #[serde(default)]
    pub gqa: Option<GqaShape>,
    /// Kimi Delta Attention layers.
    #[serde(default)]
    pub kda: Option<KdaShape>,
    /// Multi-head latent attention layers.
    #[serde(default)]
    pub mla: Option<MlaShape>,
    /// Mixture-of-experts feed-forward layers.
    #[serde(default)]
    pub moe: Option<MoeShape>,
    /// Intermediate size of the dense MLP layers, when the model has any.
    #[serde(default)]
    pub dense_intermediate_size: Option<usize>,
}

/// Softmax attention with `num_kv_heads` key/value heads shared by groups of query heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GqaShape {
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); equal to `num_attention_heads` for MHA.
    pub num_kv_heads: usize,
}

/// One KDA layer's sizes (all KDA layers of a model share them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KdaShape {
    /// Heads `H`.
    pub num_heads: usize,
    /// Head dimension `D` (K = V = D).
    pub head_dim: usize,
    /// Causal conv width `W`; the per-request conv window keeps `W - 1` inputs.
    pub conv_kernel: usize,
}

impl KdaShape {
    /// Projection width `P = H · D` (rows of q/k/v_proj, channels of each conv block).
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

/// One MLA layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaShape {
    /// Query heads.
    pub num_heads: usize,
    /// Width of the compressed KV latent (512 in Kimi Linear).
    pub kv_lora_rank: usize,
    /// Width of the cached rope slot (64 in Kimi Linear, cached even when unused).
    pub rope_dim: usize,
}

impl MlaShape {
    /// Values cached per token per MLA layer: `kv_lora_rank + rope_dim`, shared by all heads.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
}

/// One MoE layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeShape {
    /// Routed experts per layer; shared experts are not counted.
    pub num_experts: usize,
    /// Intermediate size of one routed expert.
    pub intermediate_size: usize,
}
