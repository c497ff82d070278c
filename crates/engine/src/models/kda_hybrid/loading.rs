//! What a load is asked to do: options a caller chooses ([`LoadOptions`]: a LoRA adapter,
//! whether fusion may happen) and what one rank of a layout holds ([`RankShard`]).
//!
//! A single-rank model is the layout `tp1`, so every loader takes a [`RankShard`] and there is
//! one code path: [`RankShard::whole`] is the tp1 shard.

use crate::backend::{host, Linear, Ops};
use crate::tensor::{DType, HostTensor, Tensor};
use std::ops::Range;
use std::path::PathBuf;
use tandem_model::fusion::{LoraTargets, QuantizationConfig};
use tandem_topology::Shard;

/// Whether eligible KDA projection groups are fused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FusionPolicy {
    /// Fuse every group [`tandem_model::fusion::decide`] finds eligible.
    #[default]
    Auto,
    /// Keep the checkpoint's separate projections everywhere (for comparisons).
    Never,
}

/// Options of [`super::KdaHybridModel::load_with`].
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// A PEFT LoRA adapter directory, merged into the base weights at load.
    pub lora: Option<PathBuf>,
    /// Fusion policy.
    pub fusion: FusionPolicy,
    /// The dtype of the weight matrices (f32 or bf16; norms, gates' small vectors and MLA's
    /// absorbed `kv_b` stay f32). Default f32.
    pub dtype: DType,
}

/// What one rank holds of every layer kind.
#[derive(Clone, Debug)]
pub(crate) struct RankShard {
    /// KDA heads: `(attn_tp_rank, A)` (or, for the deliberately wrong variant, global TP).
    pub kda: Shard,
    /// MLA heads: `(attn_tp_rank, A)`.
    pub mla: Shard,
    /// Dense MLPs and the shared expert: `(rank, tp)`.
    pub dense: Shard,
    /// Routed experts held: by `(ep_rank, ep)`.
    pub experts: Range<usize>,
    /// Each held expert's intermediate split: `(moe_tp_rank, tp/ep)`.
    pub expert_mlp: Shard,
    /// Log fusion decisions (one rank per layout does).
    pub log: bool,
}

impl RankShard {
    /// Everything: the single-rank model.
    pub fn whole(num_experts: usize) -> Self {
        Self {
            kda: Shard::WHOLE,
            mla: Shard::WHOLE,
            dense: Shard::WHOLE,
            experts: 0..num_experts,
            expert_mlp: Shard::WHOLE,
            log: true,
        }
    }
}

/// Inputs of the per-layer fusion decision, shared by all layers of a load.
#[derive(Clone, Debug, Default)]
pub(crate) struct FusionInputs {
    pub quant: Option<QuantizationConfig>,
    pub lora: Option<LoraTargets>,
    pub policy: FusionPolicy,
}

/// `shard`'s part of `0..len` as a topology error mapped into the engine's.
pub(crate) fn part(shard: Shard, len: usize, what: &str) -> crate::Result<Range<usize>> {
    shard
        .range(len)
        .map_err(|e| crate::Error::Weights(format!("{what}: {e}")))
}

/// Where a rank's weights go: its backend, and the dtype of its matrices.
pub(crate) struct Upload<'a, B> {
    pub backend: &'a B,
    pub dtype: DType,
}

impl<B: Ops> Upload<'_, B> {
    /// A weight matrix in the model's dtype, in the backend's matmul layout; its products
    /// keep f32 activations (bf16 rounding of activations flips MoE routing choices, so
    /// bf16 would no longer stay within rounding of the f32 model).
    pub fn linear(&self, l: host::Linear<Vec<f32>>) -> Linear<B> {
        let (out_features, in_features) = (l.out_features, l.in_features);
        let host = HostTensor::from_f32(&[out_features, in_features], l.weight)
            .and_then(|t| t.to_dtype(self.dtype))
            .expect("a checked weight converts to a float dtype");
        Linear {
            weight: self.backend.upload_exact_weight(&host),
            out_features,
            in_features,
        }
    }

    /// Small f32 values (norm weights, biases, gates' parameters, MLA's `kv_b`).
    pub fn f32(&self, values: Vec<f32>) -> Tensor<B> {
        let n = values.len();
        self.backend
            .upload(&HostTensor::from_f32(&[n], values).expect("a vector's shape is its length"))
    }

    /// A table read by rows (the embedding), in the model's dtype.
    pub fn table(&self, values: Vec<f32>, rows: usize, width: usize) -> Tensor<B> {
        let host = HostTensor::from_f32(&[rows, width], values)
            .and_then(|t| t.to_dtype(self.dtype))
            .expect("a checked table converts to a float dtype");
        self.backend.upload(&host)
    }
}
