//! GGUF hyper-parameters → `config.json` and `generation_config.json`.

use super::meta;
use super::tensors::Heads;
use super::tokenizer::Vocab;
use crate::gguf::Gguf;
use crate::{Error, Result};
use serde_json::{json, Value};

/// The Llama hyper-parameters read from a GGUF.
#[derive(Clone, Debug)]
pub(crate) struct Hparams {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: Heads,
    pub head_dim: usize,
    pub context: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
}

impl Hparams {
    pub(crate) fn from_gguf(gguf: &Gguf, vocab: &Vocab) -> Result<Self> {
        let arch = meta::string(gguf, "general.architecture")?;
        if arch != "llama" {
            return Err(Error::Unsupported(format!(
                "GGUF architecture {arch:?} (expected \"llama\")"
            )));
        }
        let key = |k: &str| format!("llama.{k}");
        let hidden_size = meta::uint(gguf, &key("embedding_length"))?;
        let query = meta::uint(gguf, &key("attention.head_count"))?;
        let key_value = match meta::opt_u64(gguf, &key("attention.head_count_kv"))? {
            Some(n) => n as usize,
            None => query,
        };
        if query == 0 || key_value == 0 || !query.is_multiple_of(key_value) {
            return Err(Error::Unsupported(format!(
                "{query} query heads over {key_value} KV heads"
            )));
        }
        let head_dim = match meta::opt_u64(gguf, &key("attention.key_length"))? {
            Some(n) => n as usize,
            None => hidden_size / query,
        };
        let rope_dim = meta::opt_u64(gguf, &key("rope.dimension_count"))?.map(|n| n as usize);
        if rope_dim.is_some_and(|d| d != head_dim) {
            return Err(Error::Unsupported(format!(
                "partial rotary embedding ({rope_dim:?} of {head_dim} dims)"
            )));
        }
        if let Some(scaling) = gguf.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            if scaling != "none" {
                return Err(Error::Unsupported(format!("rope scaling {scaling:?}")));
            }
        }
        let vocab_size = match meta::opt_u64(gguf, &key("vocab_size"))? {
            Some(n) => n as usize,
            None => vocab.len(),
        };
        if vocab_size != vocab.len() {
            return Err(Error::Unsupported(format!(
                "vocab_size {vocab_size} but {} tokens",
                vocab.len()
            )));
        }
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: meta::uint(gguf, &key("feed_forward_length"))?,
            layers: meta::uint(gguf, &key("block_count"))?,
            heads: Heads { query, key_value },
            head_dim,
            context: meta::uint(gguf, &key("context_length"))?,
            rms_norm_eps: meta::float(gguf, &key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: match gguf.get(&key("rope.freq_base")) {
                None => 10_000.0,
                Some(_) => meta::float(gguf, &key("rope.freq_base"))?,
            },
        })
    }

    /// `config.json`, keys sorted as `transformers` writes them.
    pub(crate) fn config_json(&self, vocab: &Vocab, tied: bool) -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": vocab.bos(),
            "eos_token_id": vocab.eos(),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.context,
            "mlp_bias": false,
            "model_type": "llama",
            "num_attention_heads": self.heads.query,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.heads.key_value,
            "pad_token_id": vocab.pad(),
            "pretraining_tp": 1,
            "rms_norm_eps": shortest(self.rms_norm_eps),
            "rope_scaling": null,
            "rope_theta": shortest(self.rope_theta),
            "tie_word_embeddings": tied,
            "torch_dtype": "float32",
            "use_cache": true,
            "vocab_size": self.vocab_size,
        })
    }

    /// `generation_config.json`.
    pub(crate) fn generation_config_json(&self, vocab: &Vocab) -> Value {
        json!({
            "bos_token_id": vocab.bos(),
            "eos_token_id": vocab.eos(),
            "pad_token_id": vocab.pad(),
        })
    }
}

/// The f64 with the f32's shortest decimal form, so `1e-5f32` is written as `1e-5`, not as
/// `9.999999747378752e-6`.
fn shortest(v: f32) -> f64 {
    v.to_string().parse().unwrap_or(f64::from(v))
}

#[cfg(test)]
mod tests {
    use super::shortest;

    #[test]
    fn shortest_keeps_the_written_value() {
        assert_eq!(shortest(1e-5), 1e-5);
        assert_eq!(shortest(100_000.0), 100_000.0);
        let written = serde_json::json!(shortest(1e-5)).to_string();
        assert_eq!(written.parse::<f64>().expect("a number"), 1e-5, "{written}");
    }
}
