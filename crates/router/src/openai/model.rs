//! What the router needs from a Hugging Face model directory: the tokenizer, the chat template,
//! special tokens, the context length and the EOS ids (`config.json` fields read as
//! `tandem_model::card` reads them). Weights are never read here.

use crate::error::{Error, Result};
use crate::openai::chat_template::ChatTemplate;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem_model::card::{field, token_ids};
use tokenizers::Tokenizer;

/// Which model the router serves and where its files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// The name clients pass as `model` and `/v1/models` lists.
    pub served_name: String,
    /// Directory holding `tokenizer.json`, `tokenizer_config.json`, `config.json`.
    pub dir: PathBuf,
    /// A Jinja chat template file to use instead of the model's own.
    pub chat_template: Option<PathBuf>,
}

impl ModelInfo {
    /// A model named `served_name` whose files are in `dir`.
    pub fn new(served_name: impl Into<String>, dir: impl Into<PathBuf>) -> Self {
        Self {
            served_name: served_name.into(),
            dir: dir.into(),
            chat_template: None,
        }
    }

    /// The same model with its chat template replaced by the one in `file` (when `Some`).
    pub fn with_chat_template(mut self, file: Option<PathBuf>) -> Self {
        self.chat_template = file;
        self
    }

    /// Loads the router-side assets from [`Self::dir`] (and the template override).
    pub fn load(&self) -> Result<ModelAssets> {
        ModelAssets::load_with_template(&self.dir, self.chat_template.as_deref())
    }
}

/// Loaded tokenizer, template and limits of one model.
#[derive(Debug)]
pub struct ModelAssets {
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    /// The template for requests with tools when the model ships one apart (`tool_use`).
    tool_template: Option<ChatTemplate>,
    /// How the tools template has the model write calls, when tandem can read it.
    tool_format: Option<crate::openai::tools::ToolFormat>,
    bos_token_id: Option<u32>,
    add_bos_token: bool,
    context_length: u32,
    eos_token_ids: Vec<u32>,
    vocab_size: u32,
    /// The longest vocabulary entry in UTF-8 bytes: no token covers more text than this.
    max_token_bytes: usize,
}

/// Values above this in `model_max_length` are transformers' "no limit" sentinel.
const MODEL_MAX_LENGTH_SENTINEL: f64 = 1e12;

impl ModelAssets {
    /// Loads `tokenizer.json` (required), `tokenizer_config.json` and `config.json` (optional,
    /// but one of them must give a context length) from `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with_template(dir, None)
    }

    /// [`Self::load`], with the chat template read from `template_file` when given (instead
    /// of `chat_template.jinja` or `tokenizer_config.json`'s).
    pub fn load_with_template(dir: &Path, template_file: Option<&Path>) -> Result<Self> {
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer =
            Tokenizer::from_file(&tokenizer_path).map_err(|source| Error::Tokenizer {
                path: tokenizer_path,
                source,
            })?;
        let tokenizer_config = read_json_if_exists(&dir.join("tokenizer_config.json"))?;
        let config = read_json_if_exists(&dir.join("config.json"))?;
        let model_error = |message: String| Error::Model {
            dir: dir.to_owned(),
            message,
        };

        let bos_token = tokenizer_config
            .as_ref()
            .and_then(|c| token_text(&c["bos_token"]));
        let eos_token = tokenizer_config
            .as_ref()
            .and_then(|c| token_text(&c["eos_token"]));
        let add_bos_token = tokenizer_config
            .as_ref()
            .and_then(|c| c["add_bos_token"].as_bool())
            .unwrap_or(false);
        let read_template = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| Error::Io {
                path: path.to_owned(),
                source,
            })
        };
        let own_file = dir.join("chat_template.jinja");
        let source = match template_file {
            Some(path) if !path.exists() => {
                let name = path.to_string_lossy();
                match crate::openai::chat_template::built_in(&name) {
                    Some(source) => Some(source.to_owned()),
                    None => {
                        let names: Vec<&str> = crate::openai::chat_template::BUILT_IN
                            .iter()
                            .map(|(n, _)| *n)
                            .collect();
                        return Err(model_error(format!(
                            "chat template {name:?} is neither a file nor a built-in template ({})",
                            names.join(", ")
                        )));
                    }
                }
            }
            Some(path) => Some(read_template(path)?),
            None if own_file.exists() => Some(read_template(&own_file)?),
            None => tokenizer_config
                .as_ref()
                .and_then(|c| template_source(c, "default"))
                .map(str::to_owned),
        };
        // A `tool_use` entry beside the default serves requests with tools.
        let tool_source = match template_file {
            Some(_) => None,
            None => tokenizer_config
                .as_ref()
                .and_then(|c| named_template(c, "tool_use"))
                .map(str::to_owned),
        };
        let compile =
            |source: &str| ChatTemplate::new(source, bos_token.as_deref(), eos_token.as_deref());
        let chat_template = source.as_deref().map(compile).transpose()?;
        let tool_template = tool_source.as_deref().map(compile).transpose()?;
        let tool_format = tool_source
            .as_deref()
            .or(source.as_deref())
            .and_then(crate::openai::tools::ToolFormat::detect);

        let max_position_embeddings = config
            .as_ref()
            .and_then(|c| field(c, "max_position_embeddings"))
            .and_then(Value::as_u64);
        let model_max_length = tokenizer_config
            .as_ref()
            .and_then(|c| c["model_max_length"].as_f64())
            .filter(|len| (1.0..MODEL_MAX_LENGTH_SENTINEL).contains(len))
            .map(|len| len as u64);
        let context_length = match (max_position_embeddings, model_max_length) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => {
                return Err(model_error(
                    "no context length: config.json has no max_position_embeddings and \
                     tokenizer_config.json no model_max_length"
                        .to_owned(),
                ))
            }
        };
        let context_length = u32::try_from(context_length)
            .map_err(|_| model_error(format!("context length {context_length} is too large")))?;

        let mut eos_token_ids = Vec::new();
        if let Some(value) = config.as_ref().and_then(|c| field(c, "eos_token_id")) {
            eos_token_ids = token_ids(value).ok_or_else(|| {
                model_error(format!(
                    "config.json eos_token_id {value} is not an id or a list of ids"
                ))
            })?;
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let bos_token_id = bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let vocab_size = u32::try_from(tokenizer.get_vocab_size(true))
            .map_err(|_| model_error("vocabulary too large".to_owned()))?;
        // Byte-level pieces spell each byte as one (1–2 byte) character and SentencePiece
        // pieces spell the text itself (▁ for a space), so a piece's UTF-8 length bounds the
        // text one token covers from above.
        let max_token_bytes = tokenizer
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);

        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            chat_template,
            tool_template,
            tool_format,
            bos_token_id,
            add_bos_token,
            context_length,
            eos_token_ids,
            vocab_size,
            max_token_bytes,
        })
    }

    /// A lower bound on the tokens `text` takes (no token covers more than the longest
    /// vocabulary entry), known without tokenizing it.
    pub fn min_tokens(&self, text: &str) -> u64 {
        text.len().div_ceil(self.max_token_bytes) as u64
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The chat template for a request with tools (the model's `tool_use` one where it has
    /// one apart).
    pub fn tool_chat_template(&self) -> Option<&ChatTemplate> {
        self.tool_template.as_ref().or(self.chat_template.as_ref())
    }

    /// How the tools template has the model write calls, when tandem can read that format.
    pub fn tool_format(&self) -> Option<crate::openai::tools::ToolFormat> {
        self.tool_format
    }

    /// Maximum prompt + completion length in tokens.
    pub fn context_length(&self) -> u32 {
        self.context_length
    }

    /// Token ids that end generation (from `config.json` and the tokenizer's `eos_token`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Vocabulary size, added tokens included; every valid token id is below it.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// Tokenizes a rendered chat prompt: special tokens in the text are matched as added
    /// tokens, and nothing is added around it (the template already placed BOS if it wants one).
    pub fn encode_chat(&self, text: &str) -> std::result::Result<Vec<u32>, tokenizers::Error> {
        // `encode_fast`: the same ids without the offsets nothing here reads.
        Ok(self.tokenizer.encode_fast(text, false)?.get_ids().to_vec())
    }

    /// Tokenizes a raw completion prompt with the tokenizer's own post-processing, then
    /// prepends BOS when `tokenizer_config.json` says `add_bos_token` and it is not there yet.
    pub fn encode_prompt(&self, text: &str) -> std::result::Result<Vec<u32>, tokenizers::Error> {
        let mut ids = self.tokenizer.encode_fast(text, true)?.get_ids().to_vec();
        if let (true, Some(bos)) = (self.add_bos_token, self.bos_token_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }
}

fn read_json_if_exists(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| Error::Json {
            path: path.to_owned(),
            source,
        })
}

/// `"<s>"` or `{"content": "<s>", ...}` (a serialized `AddedToken`).
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which `name` (else the
/// first) is used.
fn template_source<'a>(config: &'a Value, name: &str) -> Option<&'a str> {
    match &config["chat_template"] {
        Value::String(source) => Some(source),
        Value::Array(templates) => {
            named_template(config, name).or_else(|| templates.first()?["template"].as_str())
        }
        _ => None,
    }
}

/// The template called `name` in a list of `{name, template}`.
fn named_template<'a>(config: &'a Value, name: &str) -> Option<&'a str> {
    config["chat_template"]
        .as_array()?
        .iter()
        .find(|t| t["name"].as_str() == Some(name))
        .and_then(|t| t["template"].as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_encode_to_the_ids_of_the_tokenizers_offset_tracking_encode() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml");
        let model = ModelAssets::load(&dir).expect("fixture model loads");
        for text in [
            "The capital of France is",
            "<|im_start|>user\nhé, 東京 ☃ 1234  tabs\tand\nlines<|im_end|>",
            "",
        ] {
            for special in [false, true] {
                let slow = model.tokenizer.encode(text, special).expect("encodes");
                let fast = model.tokenizer.encode_fast(text, special).expect("encodes");
                assert_eq!(fast.get_ids(), slow.get_ids(), "{text:?} special {special}");
            }
            let chat = model.encode_chat(text).expect("encodes");
            let with_offsets = model.tokenizer.encode(text, false).expect("encodes");
            assert_eq!(chat, with_offsets.get_ids(), "{text:?}");
        }
    }

    #[test]
    fn eos_ids_accept_int_or_list() {
        assert_eq!(token_ids(&json!(2)), Some(vec![2]));
        assert_eq!(token_ids(&json!([2, 0])), Some(vec![2, 0]));
        assert_eq!(token_ids(&json!("x")), None);
        assert_eq!(token_ids(&json!([1, -1])), None);
    }

    #[test]
    fn special_tokens_accept_string_or_added_token() {
        assert_eq!(token_text(&json!("<s>")).as_deref(), Some("<s>"));
        assert_eq!(
            token_text(&json!({"content": "</s>", "special": true})).as_deref(),
            Some("</s>")
        );
        assert_eq!(token_text(&Value::Null), None);
    }

    #[test]
    fn template_lists_prefer_default() {
        let config = json!({"chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(template_source(&config, "default"), Some("D"));
        assert_eq!(named_template(&config, "tool_use"), Some("T"));
        assert_eq!(
            named_template(&json!({"chat_template": "x"}), "tool_use"),
            None
        );
    }

    #[test]
    fn loads_fixture() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml");
        let assets = ModelAssets::load(&dir).expect("fixture loads");
        assert_eq!(assets.context_length(), 256);
        assert_eq!(assets.eos_token_ids(), &[2, 0]);
        assert!(assets.chat_template().is_some());
        assert_eq!(
            assets
                .encode_chat("<|im_start|>hello")
                .expect("encodes")
                .len(),
            2
        );
    }
}
