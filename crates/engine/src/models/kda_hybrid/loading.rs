//! What a load is asked to do: options a caller chooses ([`LoadOptions`]: a LoRA adapter,
//! whether fusion may happen) and what one rank of a layout holds ([`RankShard`]).
//!
//! A single-rank model is the layout `tp1`, so every loader takes a [`RankShard`] and there is
//! one code path: [`RankShard::whole`] is the tp1 shard.

use super::weights::Checkpoint;
use crate::backend::{host, Linear, Ops};
use crate::tensor::{DType, HostTensor, Tensor};
use std::cell::Cell;
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
    /// Matrices stored block-FP8 so far: kept as FP8, dequantised.
    fp8: Cell<[usize; 2]>,
}

impl<'a, B: Ops> Upload<'a, B> {
    pub fn new(backend: &'a B, dtype: DType) -> Self {
        Self {
            backend,
            dtype,
            fp8: Cell::new([0, 0]),
        }
    }

    /// Counts `n` matrices stored block-FP8, `kept` as FP8 or dequantised.
    pub fn note_fp8(&self, kept: bool, n: usize) {
        let mut c = self.fp8.get();
        c[usize::from(!kept)] += n;
        self.fp8.set(c);
    }

    /// Block-FP8 matrices loaded so far: `[kept as FP8, dequantised]`.
    pub fn fp8_counts(&self) -> [usize; 2] {
        self.fp8.get()
    }

    /// Whether block-FP8 matrices may stay FP8: the model runs bf16 (an f32 model computes
    /// from the f32 values of every weight).
    pub fn keeps_fp8(&self) -> bool {
        self.dtype == DType::BF16
    }

    /// Rows (`axis` 0) or columns (1) `range` of the first present of `names`, an `[out, in]`
    /// matrix: block-FP8 as it is stored where [`Upload::keeps_fp8`], the backend has FP8
    /// products for it and `range` keeps whole tiles; otherwise its values (dequantised)
    /// in the model's dtype.
    pub fn matrix(
        &self,
        ck: &mut Checkpoint,
        names: &[&str],
        [out, inp]: [usize; 2],
        axis: usize,
        range: Range<usize>,
    ) -> crate::Result<Linear<B>> {
        let (out_features, in_features) = match axis {
            0 => (range.len(), inp),
            _ => (out, range.len()),
        };
        if ck.is_stored_fp8(names) {
            let kept = if self.keeps_fp8() {
                ck.fp8_slice(names, [out, inp], axis, range.clone())
                    .and_then(|m| self.backend.upload_fp8_weight(&m))
            } else {
                None
            };
            self.note_fp8(kept.is_some(), 1);
            if let Some(weight) = kept {
                return Ok(Linear {
                    weight,
                    out_features,
                    in_features,
                });
            }
        }
        Ok(self.linear(host::Linear {
            weight: ck.slice(names, &[out, inp], axis, range)?,
            out_features,
            in_features,
        }))
    }

    /// Logs how the load took its block-FP8 matrices (nothing when none was stored so).
    pub fn log_fp8(&self) {
        let [kept, dequantised] = self.fp8_counts();
        if kept + dequantised == 0 {
            return;
        }
        if dequantised == 0 {
            tracing::info!(matrices = kept, "block-FP8 weights run as FP8");
        } else {
            tracing::info!(
                fp8 = kept,
                dequantised,
                dtype = %self.dtype,
                "block-FP8 weights dequantised at load where the model runs f32, the backend \
                 has no FP8 products, or a shard cuts through 128-wide tiles"
            );
        }
    }

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
