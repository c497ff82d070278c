//! What serving needs to know of a checkpoint before its weights: its family, vocabulary,
//! EOS ids and configured context, read from `config.json` once (multimodal spellings nest the
//! text model's fields under `text_config`). The CLI, the worker and the router ask this
//! instead of each parsing the file.

use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// The model families tandem serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `model_type` `llama` (or none given).
    Llama,
    /// `kimi_linear`, `glm5_next`: KDA linear attention + MLA + MoE.
    KdaHybrid,
}

/// A checkpoint's serving facts (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCard {
    /// The family `model_type` names.
    pub family: Family,
    /// `model_type` as written (`None` when absent).
    pub model_type: Option<String>,
    /// `vocab_size`, where given.
    pub vocab_size: Option<usize>,
    /// `eos_token_id` (an id or a list), empty where absent.
    pub eos_token_ids: Vec<u32>,
    /// `max_position_embeddings` (else `model_max_length`), where given.
    pub max_position_embeddings: Option<u64>,
}

impl ModelCard {
    /// Reads `dir/config.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let config: Value =
            serde_json::from_str(&text).map_err(|source| Error::Json { path, source })?;
        Self::from_config(&config)
    }

    /// The card of a parsed `config.json`.
    pub fn from_config(config: &Value) -> Result<Self> {
        let model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let family = match model_type.as_deref() {
            Some("llama") | None => Family::Llama,
            Some("kimi_linear" | "glm5_next" | "glm5_next_text") => Family::KdaHybrid,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "model_type {other:?} is not supported (llama, kimi_linear, glm5_next)"
                )))
            }
        };
        let eos_token_ids = match field(config, "eos_token_id") {
            None => Vec::new(),
            Some(v) => token_ids(v).ok_or_else(|| {
                Error::Unsupported(format!(
                    "config.json eos_token_id {v} is not an id or a list of ids"
                ))
            })?,
        };
        Ok(Self {
            family,
            model_type,
            vocab_size: field(config, "vocab_size")
                .and_then(Value::as_u64)
                .map(|v| v as usize),
            eos_token_ids,
            max_position_embeddings: ["max_position_embeddings", "model_max_length"]
                .iter()
                .find_map(|k| field(config, k).and_then(Value::as_u64)),
        })
    }

    /// The vocabulary size, which a checkpoint must give.
    pub fn vocab_size(&self) -> Result<usize> {
        self.vocab_size
            .ok_or_else(|| Error::Unsupported("config.json has no vocab_size".into()))
    }

    /// The context served: the configured length (`default` where none is), capped at
    /// `exact_limit` where the model is exact only up to a limit (GLM's sparse indexer).
    pub fn context_length(&self, default: usize, exact_limit: Option<usize>) -> usize {
        let configured = self
            .max_position_embeddings
            .map_or(default, |v| usize::try_from(v).unwrap_or(usize::MAX));
        exact_limit.map_or(configured, |l| l.min(configured))
    }
}

/// `key` of `config`, else of its `text_config`; `null` counts as absent.
pub fn field<'a>(config: &'a Value, key: &str) -> Option<&'a Value> {
    config
        .get(key)
        .filter(|v| !v.is_null())
        .or_else(|| config.get("text_config")?.get(key).filter(|v| !v.is_null()))
}

/// An id or a list of ids.
pub fn token_ids(value: &Value) -> Option<Vec<u32>> {
    let one = |v: &Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    match value {
        Value::Array(items) => items.iter().map(one).collect(),
        other => one(other).map(|id| vec![id]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn llama_and_nested_glm_configs_read_the_same_facts() {
        let llama = ModelCard::from_config(&json!({"model_type": "llama", "vocab_size": 49152,
            "eos_token_id": 2, "max_position_embeddings": 8192}))
        .expect("reads");
        assert_eq!(llama.family, Family::Llama);
        assert_eq!(
            (llama.vocab_size, llama.eos_token_ids.clone()),
            (Some(49152), vec![2])
        );
        assert_eq!(llama.context_length(4096, None), 8192);
        assert_eq!(llama.context_length(4096, Some(2048)), 2048);

        let glm = ModelCard::from_config(&json!({"model_type": "glm5_next", "eos_token_id": null,
            "text_config": {"vocab_size": 1000, "eos_token_id": [5, 7], "model_max_length": 300}}))
        .expect("reads");
        assert_eq!(glm.family, Family::KdaHybrid);
        assert_eq!(glm.vocab_size().expect("reads"), 1000);
        assert_eq!(glm.eos_token_ids, vec![5, 7]);
        assert_eq!(glm.context_length(4096, None), 300);

        let bare = ModelCard::from_config(&json!({})).expect("reads");
        assert_eq!(bare.family, Family::Llama);
        assert_eq!(bare.context_length(4096, None), 4096);
        assert!(bare.vocab_size().is_err());
    }

    #[test]
    fn unknown_families_and_bad_eos_ids_are_refused() {
        let err = ModelCard::from_config(&json!({"model_type": "mamba"})).expect_err("refused");
        assert!(
            err.to_string().contains("\"mamba\" is not supported"),
            "{err}"
        );
        let err = ModelCard::from_config(&json!({"eos_token_id": "</s>"})).expect_err("refused");
        assert!(err.to_string().contains("not an id"), "{err}");
        assert_eq!(token_ids(&json!([1, 2])), Some(vec![1, 2]));
        assert_eq!(token_ids(&json!([1, -2])), None);
    }

    #[test]
    fn a_missing_config_names_the_file() {
        let dir = tempfile::tempdir().expect("reads");
        let err = ModelCard::read(dir.path()).expect_err("refused");
        assert!(err.to_string().contains("config.json"), "{err}");
    }
}
