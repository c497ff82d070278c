use crate::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// The fields of a Llama-family `config.json` the engine uses.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (GQA).
    pub num_key_value_heads: usize,
    /// Per-head width; defaults to hidden / heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Context length.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    /// Whether the LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<EosTokenId>,
    /// `model_type` (must be `llama`).
    #[serde(default)]
    pub model_type: Option<String>,
}

/// `eos_token_id` is an int or a list of ints in Hugging Face configs.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum EosTokenId {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

fn default_rope_theta() -> f32 {
    10_000.0
}

impl LlamaConfig {
    /// Reads and checks `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let cfg: Self =
            serde_json::from_str(&text).map_err(|source| Error::Json { path, source })?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<()> {
        if let Some(t) = &self.model_type {
            if t != "llama" {
                return Err(Error::Unsupported(format!(
                    "model_type {t:?} (expected \"llama\")"
                )));
            }
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return Err(Error::Unsupported(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        Ok(())
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// All ids that end generation.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(EosTokenId::One(id)) => vec![*id],
            Some(EosTokenId::Many(ids)) => ids.clone(),
            None => Vec::new(),
        }
    }
}
