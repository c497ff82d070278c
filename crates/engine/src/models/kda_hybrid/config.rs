//! `config.json` of a KDA hybrid checkpoint, parsed once into a checked [`KdaHybridConfig`].
//!
//! Two spellings exist for the same architecture. Moonshot's Kimi-Linear writes a flat config
//! with `linear_attn_config` (1-based layer numbers), `num_experts`, `first_k_dense_replace`;
//! transformers' `glm5_next` nests the text model under `text_config` and spells things
//! `n_routed_experts`, `layer_types` (0-based), `linear_lower_bound`. The raw side accepts
//! both (and ignores keys it has no use for, since Hugging Face configs carry many); the
//! checked side says once, per layer, what runs there, so model code never re-derives it.

pub use crate::backend::hybrid::{KdaGate, MoeConfig};
use crate::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// Which checkpoint family the config came from. It only decides conventions the config does
/// not spell out (the MLA latent norm's eps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// `KimiLinearForCausalLM` (`model_type` `kimi_linear`).
    KimiLinear,
    /// GLM-5.3-Flash style (`model_type` `glm5_next` / `glm5_next_text`).
    Glm5Next,
}

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Kimi Delta Attention (linear attention with a fixed-size recurrent state).
    Kda,
    /// Multi-head latent attention over a per-token latent cache.
    Mla,
}

/// The feed-forward block of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// One SwiGLU MLP of `intermediate_size`.
    Dense,
    /// Routed experts plus shared experts.
    Moe,
}

/// What runs in one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    /// Token mixer.
    pub attention: AttentionKind,
    /// Feed-forward block.
    pub ffn: FfnKind,
}

/// KDA layer sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KdaConfig {
    /// Heads H.
    pub num_heads: usize,
    /// Head width D (keys and values alike).
    pub head_dim: usize,
    /// Short-convolution width W.
    pub conv_kernel: usize,
    /// The decay gate form.
    pub gate: KdaGate,
}

impl KdaConfig {
    /// P = H·D, the width of each of q, k and v.
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
}

/// MLA layer sizes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    /// Attention heads.
    pub num_heads: usize,
    /// Rank of the query LoRA, `None` when the query is projected directly.
    pub q_lora_rank: Option<usize>,
    /// Width of the cached latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key width that comes from the latent.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key width of the "rope" slot (never rotated in these models), shared
    /// by all heads on the key side; 0 when absent.
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// eps of `q_a_layernorm` and `kv_a_layernorm`.
    pub latent_norm_eps: f32,
    /// The DSA indexer (GLM), when the config describes one.
    pub indexer: Option<IndexerConfig>,
}

/// Sizes of GLM's DSA indexer. Only its key cache is computed here: the sparse selection is not
/// implemented, which is exact while a context holds at most `topk` tokens (every visible token
/// is selected then).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IndexerConfig {
    /// Indexer heads.
    pub num_heads: usize,
    /// Indexer head width.
    pub head_dim: usize,
    /// Tokens per key pool.
    pub kpool: usize,
    /// Tokens selected per query.
    pub topk: usize,
}

impl MlaConfig {
    /// Query/key width per head.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How layers add into the residual.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ResidualKind {
    /// One residual stream, `x += sublayer(norm(x))`.
    Single,
    /// Manifold-constrained hyper-connections (GLM): `streams` parallel residual streams mixed
    /// by Sinkhorn-normalised matrices.
    HyperConnections {
        /// Streams N.
        streams: usize,
        /// Sinkhorn iterations.
        sinkhorn_iters: usize,
        /// eps added in the Sinkhorn normalisation.
        eps: f32,
    },
}

/// A checked KDA hybrid configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaHybridConfig {
    /// Checkpoint family.
    pub family: ModelFamily,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// eps of every RMSNorm except the MLA latent norms.
    pub rms_norm_eps: f32,
    /// Whether `lm_head` is the embedding table.
    pub tie_word_embeddings: bool,
    /// Per layer: token mixer and FFN.
    pub layers: Vec<LayerSpec>,
    /// KDA sizes.
    pub kda: KdaConfig,
    /// MLA sizes.
    pub mla: MlaConfig,
    /// Dense MLP intermediate width.
    pub intermediate_size: usize,
    /// MoE sizes.
    pub moe: MoeConfig,
    /// SwiGLU clamp `L`: `silu(min(gate, L)) * clamp(up, -L, L)`; `None` = no clamp.
    pub swiglu_limit: Option<f32>,
    /// Residual form.
    pub residual: ResidualKind,
}

#[derive(Debug, Default, Deserialize)]
struct RawLinearAttnConfig {
    kda_layers: Option<Vec<usize>>,
    full_attn_layers: Option<Vec<usize>>,
    head_dim: Option<usize>,
    num_heads: Option<usize>,
    short_conv_kernel_size: Option<usize>,
    gate_lower_bound: Option<f32>,
    safe_gate: Option<bool>,
}

/// config.json as written (text part), every key optional so both spellings parse.
#[derive(Debug, Default, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    rms_norm_eps: Option<f32>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    layer_types: Option<Vec<String>>,
    mlp_layer_types: Option<Vec<String>>,
    linear_attn_config: Option<RawLinearAttnConfig>,
    linear_num_heads: Option<usize>,
    linear_head_dim: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
    linear_lower_bound: Option<f32>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    mla_use_nope: Option<bool>,
    num_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    num_experts_per_token: Option<usize>,
    num_experts_per_tok: Option<usize>,
    num_shared_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    moe_intermediate_size: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    routed_scaling_factor: Option<f32>,
    moe_renormalize: Option<bool>,
    norm_topk_prob: Option<bool>,
    moe_router_activation_func: Option<String>,
    scoring_func: Option<String>,
    num_expert_group: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    swiglu_limit: Option<f32>,
    hc_mult: Option<usize>,
    hc_sinkhorn_iters: Option<usize>,
    hc_eps: Option<f32>,
    index_topk: Option<usize>,
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_kpool: Option<usize>,
}

fn unsupported(msg: impl Into<String>) -> Error {
    Error::Model(tandem_model::Error::Unsupported(msg.into()))
}

fn need<T>(v: Option<T>, key: &str) -> Result<T> {
    v.ok_or_else(|| unsupported(format!("config.json lacks {key:?}")))
}

/// The one of two spellings that is present; both present must agree.
fn either<T: PartialEq + std::fmt::Debug>(
    a: Option<T>,
    b: Option<T>,
    names: (&str, &str),
) -> Result<Option<T>> {
    match (a, b) {
        (Some(a), Some(b)) if a != b => Err(unsupported(format!(
            "{} = {a:?} contradicts {} = {b:?}",
            names.0, names.1
        ))),
        (a, b) => Ok(a.or(b)),
    }
}

impl KdaHybridConfig {
    /// Reads and checks `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| {
            Error::Model(tandem_model::Error::Io {
                path: path.clone(),
                source,
            })
        })?;
        Self::from_json(&text).map_err(|e| match e {
            Error::Model(tandem_model::Error::Json { source, .. }) => {
                Error::Model(tandem_model::Error::Json { path, source })
            }
            other => other,
        })
    }

    /// Parses and checks the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let json_err = |source| {
            Error::Model(tandem_model::Error::Json {
                path: "config.json".into(),
                source,
            })
        };
        let root: serde_json::Value = serde_json::from_str(text).map_err(json_err)?;
        let root_type = root
            .get("model_type")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        let text_value = root.get("text_config").cloned().unwrap_or(root);
        let raw: RawConfig = serde_json::from_value(text_value).map_err(json_err)?;
        raw.check(root_type.as_deref())
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Indices of the KDA layers.
    pub fn kda_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.layers.len()).filter(|&i| self.layers[i].attention == AttentionKind::Kda)
    }

    /// Indices of the MLA layers.
    pub fn mla_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.layers.len()).filter(|&i| self.layers[i].attention == AttentionKind::Mla)
    }
}

impl RawConfig {
    fn family(&self, root_type: Option<&str>) -> Result<ModelFamily> {
        let t = root_type.or(self.model_type.as_deref());
        match t {
            Some("kimi_linear") => Ok(ModelFamily::KimiLinear),
            Some("glm5_next" | "glm5_next_text") => Ok(ModelFamily::Glm5Next),
            other => Err(unsupported(format!(
                "model_type {other:?} is not a KDA hybrid (kimi_linear, glm5_next)"
            ))),
        }
    }

    fn attention_kinds(&self, n: usize) -> Result<Vec<AttentionKind>> {
        let from_types = self
            .layer_types
            .as_ref()
            .map(|types| {
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "linear_attention" | "kda" => Ok(AttentionKind::Kda),
                        "full_attention" | "indexed_attention" | "mla" => Ok(AttentionKind::Mla),
                        other => Err(unsupported(format!("layer type {other:?}"))),
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        let lac = self.linear_attn_config.as_ref();
        let from_lists = match lac.and_then(|c| c.kda_layers.as_ref()) {
            None => None,
            Some(kda) => {
                let full = lac
                    .and_then(|c| c.full_attn_layers.clone())
                    .unwrap_or_default();
                let mut kinds = Vec::with_capacity(n);
                for layer in 1..=n {
                    kinds.push(match (kda.contains(&layer), full.contains(&layer)) {
                        (true, false) => AttentionKind::Kda,
                        (false, true) => AttentionKind::Mla,
                        (false, false)
                            if lac.and_then(|c| c.full_attn_layers.as_ref()).is_none() =>
                        {
                            AttentionKind::Mla
                        }
                        _ => {
                            return Err(unsupported(format!(
                                "layer {layer} (1-based) must be in exactly one of \
                                 linear_attn_config.kda_layers / full_attn_layers"
                            )))
                        }
                    });
                }
                if let Some(&bad) = kda.iter().chain(&full).find(|&&l| l == 0 || l > n) {
                    return Err(unsupported(format!(
                        "linear_attn_config names layer {bad}, outside 1..={n}"
                    )));
                }
                Some(kinds)
            }
        };
        match (from_types, from_lists) {
            (Some(a), Some(b)) if a != b => Err(unsupported(
                "layer_types contradicts linear_attn_config.kda_layers",
            )),
            (Some(k), _) | (None, Some(k)) if k.len() == n => Ok(k),
            (Some(k), _) | (None, Some(k)) => Err(unsupported(format!(
                "{} layer types for {n} layers",
                k.len()
            ))),
            (None, None) => Err(unsupported(
                "neither linear_attn_config.kda_layers nor layer_types says which layers are KDA",
            )),
        }
    }

    fn ffn_kinds(&self, n: usize) -> Result<Vec<FfnKind>> {
        let from_types = self
            .mlp_layer_types
            .as_ref()
            .map(|types| {
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "dense" => Ok(FfnKind::Dense),
                        "sparse" | "moe" => Ok(FfnKind::Moe),
                        other => Err(unsupported(format!("mlp layer type {other:?}"))),
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        let from_k = self.first_k_dense_replace.map(|k| {
            let freq = self.moe_layer_freq.unwrap_or(1).max(1);
            (0..n)
                .map(|i| {
                    if i >= k && i % freq == 0 {
                        FfnKind::Moe
                    } else {
                        FfnKind::Dense
                    }
                })
                .collect::<Vec<_>>()
        });
        match (from_types, from_k) {
            (Some(a), Some(b)) if a != b => Err(unsupported(
                "mlp_layer_types contradicts first_k_dense_replace / moe_layer_freq",
            )),
            (Some(k), _) | (None, Some(k)) if k.len() == n => Ok(k),
            (Some(k), _) | (None, Some(k)) => Err(unsupported(format!(
                "{} mlp layer types for {n} layers",
                k.len()
            ))),
            (None, None) => Err(unsupported(
                "neither mlp_layer_types nor first_k_dense_replace says which layers are MoE",
            )),
        }
    }

    fn kda(&self) -> Result<KdaConfig> {
        let lac = self.linear_attn_config.as_ref();
        let num_heads = either(
            lac.and_then(|c| c.num_heads),
            self.linear_num_heads,
            ("linear_attn_config.num_heads", "linear_num_heads"),
        )?;
        let head_dim = either(
            lac.and_then(|c| c.head_dim),
            self.linear_head_dim,
            ("linear_attn_config.head_dim", "linear_head_dim"),
        )?;
        let conv_kernel = either(
            lac.and_then(|c| c.short_conv_kernel_size),
            self.linear_conv_kernel_dim,
            (
                "linear_attn_config.short_conv_kernel_size",
                "linear_conv_kernel_dim",
            ),
        )?;
        let lower_bound = either(
            lac.and_then(|c| c.gate_lower_bound),
            self.linear_lower_bound,
            ("linear_attn_config.gate_lower_bound", "linear_lower_bound"),
        )?;
        let gate = match (lower_bound, lac.and_then(|c| c.safe_gate)) {
            (Some(lb), _) if lb < 0.0 => KdaGate::LowerBound(lb),
            (Some(lb), _) => {
                return Err(unsupported(format!(
                    "KDA gate lower bound {lb} must be negative"
                )))
            }
            (None, Some(true)) => {
                return Err(unsupported("safe_gate without gate_lower_bound"));
            }
            (None, _) => KdaGate::Softplus,
        };
        let cfg = KdaConfig {
            num_heads: need(num_heads, "linear_attn_config.num_heads")?,
            head_dim: need(head_dim, "linear_attn_config.head_dim")?,
            conv_kernel: need(conv_kernel, "linear_attn_config.short_conv_kernel_size")?,
            gate,
        };
        if cfg.num_heads == 0 || cfg.head_dim == 0 || cfg.conv_kernel < 2 {
            return Err(unsupported(format!("KDA sizes {cfg:?}")));
        }
        Ok(cfg)
    }

    fn check(self, root_type: Option<&str>) -> Result<KdaHybridConfig> {
        let family = self.family(root_type)?;
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(unsupported(format!("hidden_act {act:?} (expected silu)")));
            }
        }
        let n = need(self.num_hidden_layers, "num_hidden_layers")?;
        let attention = self.attention_kinds(n)?;
        let ffn = self.ffn_kinds(n)?;
        let layers = attention
            .into_iter()
            .zip(ffn)
            .map(|(attention, ffn)| LayerSpec { attention, ffn })
            .collect();
        let rms_norm_eps = need(self.rms_norm_eps, "rms_norm_eps")?;
        if family == ModelFamily::KimiLinear && self.mla_use_nope == Some(false) {
            return Err(unsupported(
                "mla_use_nope = false (rotary MLA) is not implemented for Kimi Linear",
            ));
        }
        let mla = MlaConfig {
            num_heads: need(self.num_attention_heads, "num_attention_heads")?,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: need(self.kv_lora_rank, "kv_lora_rank")?,
            qk_nope_head_dim: need(self.qk_nope_head_dim, "qk_nope_head_dim")?,
            qk_rope_head_dim: self.qk_rope_head_dim.unwrap_or(0),
            v_head_dim: need(self.v_head_dim, "v_head_dim")?,
            // Kimi's KimiLinearRMSNorm class default; GLM passes rms_norm_eps.
            latent_norm_eps: match family {
                ModelFamily::KimiLinear => 1e-6,
                ModelFamily::Glm5Next => rms_norm_eps,
            },
            indexer: match self.index_topk {
                None => None,
                Some(topk) => Some(IndexerConfig {
                    num_heads: need(self.index_n_heads, "index_n_heads")?,
                    head_dim: need(self.index_head_dim, "index_head_dim")?,
                    kpool: need(self.index_kpool, "index_kpool")?,
                    topk,
                }),
            },
        };
        let activation = either(
            self.moe_router_activation_func.clone(),
            self.scoring_func.clone(),
            ("moe_router_activation_func", "scoring_func"),
        )?;
        if let Some(a) = activation.filter(|a| a != "sigmoid") {
            return Err(unsupported(format!("MoE router activation {a:?}")));
        }
        let groups = either(
            self.num_expert_group,
            self.n_group,
            ("num_expert_group", "n_group"),
        )?
        .unwrap_or(1);
        let moe = MoeConfig {
            num_experts: need(
                either(
                    self.num_experts,
                    self.n_routed_experts,
                    ("num_experts", "n_routed_experts"),
                )?,
                "num_experts",
            )?,
            experts_per_token: need(
                either(
                    self.num_experts_per_token,
                    self.num_experts_per_tok,
                    ("num_experts_per_token", "num_experts_per_tok"),
                )?,
                "num_experts_per_token",
            )?,
            num_shared_experts: either(
                self.num_shared_experts,
                self.n_shared_experts,
                ("num_shared_experts", "n_shared_experts"),
            )?
            .unwrap_or(0),
            intermediate_size: need(self.moe_intermediate_size, "moe_intermediate_size")?,
            routed_scaling_factor: self.routed_scaling_factor.unwrap_or(1.0),
            renormalize: either(
                self.moe_renormalize,
                self.norm_topk_prob,
                ("moe_renormalize", "norm_topk_prob"),
            )?
            .unwrap_or(true),
            num_groups: groups.max(1),
            topk_groups: self.topk_group.unwrap_or(groups).max(1),
        };
        if moe.experts_per_token == 0
            || moe.experts_per_token > moe.num_experts
            || !moe.num_experts.is_multiple_of(moe.num_groups)
            || moe.topk_groups > moe.num_groups
        {
            return Err(unsupported(format!("MoE routing {moe:?}")));
        }
        let residual = match self.hc_mult {
            Some(streams) if streams > 1 => ResidualKind::HyperConnections {
                streams,
                sinkhorn_iters: need(self.hc_sinkhorn_iters, "hc_sinkhorn_iters")?.max(1),
                eps: need(self.hc_eps, "hc_eps")?,
            },
            _ => ResidualKind::Single,
        };
        Ok(KdaHybridConfig {
            family,
            vocab_size: need(self.vocab_size, "vocab_size")?,
            hidden_size: need(self.hidden_size, "hidden_size")?,
            rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            layers,
            kda: self.kda()?,
            mla,
            intermediate_size: need(self.intermediate_size, "intermediate_size")?,
            moe,
            swiglu_limit: self.swiglu_limit,
            residual,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_based_lists_and_zero_based_types_agree() {
        let text = r#"{"model_type": "kimi_linear", "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2],
                                   "head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4},
            "first_k_dense_replace": 1, "vocab_size": 10, "hidden_size": 16,
            "intermediate_size": 32, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
            "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
            "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 8}"#;
        let cfg = KdaHybridConfig::from_json(text).expect("valid config");
        assert_eq!(cfg.kda_layers().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(cfg.mla_layers().collect::<Vec<_>>(), vec![1]);
        assert_eq!(cfg.layers[0].ffn, FfnKind::Dense);
        assert_eq!(cfg.layers[2].ffn, FfnKind::Moe);
        assert_eq!(cfg.kda.gate, KdaGate::Softplus);
        assert_eq!(cfg.mla.latent_norm_eps, 1e-6);
        let contradicting = text.replace("\"kda_layers\": [1, 3]", "\"kda_layers\": [1, 2]");
        assert!(KdaHybridConfig::from_json(&contradicting).is_err());
    }
}
