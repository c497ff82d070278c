//! GGUF tokenizer metadata → `tokenizer.json` and `tokenizer_config.json`.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported, with the pre-tokenizers
//! whose Hugging Face equivalent is known: `smollm` (each digit split off, then the GPT-2
//! regex) and `gpt2` (the GPT-2 regex alone). The structs below mirror the field order the
//! `tokenizers` library itself serialises, so the files read like ones Hugging Face wrote.

use super::meta;
use crate::gguf::Gguf;
use crate::{Error, Result};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The vocabulary as read from the GGUF.
pub(crate) struct Vocab {
    tokens: Vec<String>,
    merges: Vec<(String, String)>,
    /// Added tokens: `(id, special)`.
    added: Vec<(usize, bool)>,
    digits: bool,
    bos: Option<usize>,
    eos: Option<usize>,
    unk: Option<usize>,
    pad: Option<usize>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
}

impl Vocab {
    pub(crate) fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let model = meta::string(gguf, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Unsupported(format!(
                "tokenizer model {model:?} (only byte-level BPE, \"gpt2\", is supported)"
            )));
        }
        let digits = match gguf.get("tokenizer.ggml.pre").and_then(|v| v.as_str()) {
            Some("smollm") => true,
            Some("gpt2") | Some("default") | None => false,
            Some(other) => {
                return Err(Error::Unsupported(format!("GGUF pre-tokenizer {other:?}")));
            }
        };
        let tokens = meta::strings(gguf, "tokenizer.ggml.tokens")?;
        let mut seen = HashSet::with_capacity(tokens.len());
        if let Some(dup) = tokens.iter().find(|t| !seen.insert(t.as_str())) {
            return Err(Error::Unsupported(format!(
                "duplicate vocabulary entry {dup:?}"
            )));
        }
        let merges = meta::strings(gguf, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    Ok((a.to_string(), b.to_string()))
                }
                _ => Err(Error::Unsupported(format!(
                    "BPE merge {m:?} is not \"a b\""
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        let types = meta::ints(gguf, "tokenizer.ggml.token_type")?;
        if types.len() != tokens.len() {
            return Err(Error::Unsupported(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let added = types
            .iter()
            .enumerate()
            .filter_map(|(id, &t)| match t {
                TOKEN_TYPE_CONTROL => Some((id, true)),
                TOKEN_TYPE_USER_DEFINED => Some((id, false)),
                _ => None,
            })
            .collect();
        let id = |key: &str| -> Result<Option<usize>> {
            match meta::opt_u64(gguf, key)? {
                None => Ok(None),
                Some(i) if (i as usize) < tokens.len() => Ok(Some(i as usize)),
                Some(i) => Err(Error::Unsupported(format!(
                    "{key} {i} is out of the vocabulary"
                ))),
            }
        };
        Ok(Self {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: meta::opt_bool(gguf, "tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            add_eos: meta::opt_bool(gguf, "tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            chat_template: gguf
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            tokens,
            merges,
            added,
            digits,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn bos(&self) -> Option<usize> {
        self.bos
    }

    pub(crate) fn eos(&self) -> Option<usize> {
        self.eos
    }

    pub(crate) fn pad(&self) -> Option<usize> {
        self.pad
    }

    /// The `tokenizer.json` document.
    pub(crate) fn tokenizer_json(&self) -> TokenizerJson<'_> {
        let byte_level = |add_prefix_space: bool, trim_offsets: bool| ByteLevel {
            kind: "ByteLevel",
            add_prefix_space,
            trim_offsets,
            use_regex: true,
        };
        let pre_byte_level = byte_level(false, true);
        let pre_tokenizer = if self.digits {
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    pre_byte_level,
                ],
            })
        } else {
            json!(pre_byte_level)
        };
        TokenizerJson {
            version: "1.0",
            truncation: None,
            padding: None,
            added_tokens: self
                .added
                .iter()
                .map(|&(id, special)| AddedToken {
                    id,
                    content: &self.tokens[id],
                    single_word: false,
                    lstrip: false,
                    rstrip: false,
                    normalized: !special,
                    special,
                })
                .collect(),
            normalizer: None,
            pre_tokenizer,
            post_processor: byte_level(true, false),
            decoder: byte_level(true, true),
            model: Bpe {
                kind: "BPE",
                dropout: None,
                unk_token: None,
                continuing_subword_prefix: None,
                end_of_word_suffix: None,
                fuse_unk: false,
                byte_fallback: false,
                ignore_merges: false,
                vocab: VocabById(&self.tokens),
                merges: self
                    .merges
                    .iter()
                    .map(|(a, b)| [a.as_str(), b.as_str()])
                    .collect(),
            },
        }
    }

    /// The `tokenizer_config.json` document.
    pub(crate) fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let token = |id: Option<usize>| id.map(|i| self.tokens[i].clone());
        let added_tokens_decoder: BTreeMap<String, Value> = self
            .added
            .iter()
            .map(|&(id, special)| {
                (
                    id.to_string(),
                    json!({
                        "content": self.tokens[id],
                        "lstrip": false,
                        "normalized": !special,
                        "rstrip": false,
                        "single_word": false,
                        "special": special,
                    }),
                )
            })
            .collect();
        json!({
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "add_prefix_space": false,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": token(self.bos),
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": false,
            "eos_token": token(self.eos),
            "model_max_length": model_max_length,
            "pad_token": token(self.pad),
            "tokenizer_class": "GPT2Tokenizer",
            "unk_token": token(self.unk),
        })
    }
}

#[derive(Serialize)]
pub(crate) struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<()>,
    padding: Option<()>,
    added_tokens: Vec<AddedToken<'a>>,
    normalizer: Option<()>,
    pre_tokenizer: Value,
    post_processor: ByteLevel,
    decoder: ByteLevel,
    model: Bpe<'a>,
}

#[derive(Serialize)]
struct AddedToken<'a> {
    id: usize,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

#[derive(Serialize)]
struct ByteLevel {
    #[serde(rename = "type")]
    kind: &'static str,
    add_prefix_space: bool,
    trim_offsets: bool,
    use_regex: bool,
}

#[derive(Serialize)]
struct Bpe<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f32>,
    unk_token: Option<&'a str>,
    continuing_subword_prefix: Option<&'a str>,
    end_of_word_suffix: Option<&'a str>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: VocabById<'a>,
    merges: Vec<[&'a str; 2]>,
}

/// Serialises `token → id` in id order, as `tokenizers` does.
struct VocabById<'a>(&'a [String]);

impl Serialize for VocabById<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (id, token) in self.0.iter().enumerate() {
            map.serialize_entry(token, &id)?;
        }
        map.end()
    }
}
