//! Structured outputs: constrained decoding with llguidance over the model's own tokenizer.
//!
//! [`Grammars`] is built once per engine from `tokenizer.json`; each constrained request gets a
//! [`Constrained`] matcher when it is submitted. Before a step samples a constrained row the
//! engine computes the row's allowed-token mask ([`Constrained::compute_mask`]); the sampler
//! sets every other logit to −∞ ([`crate::sampling::adjust_row`]); the sampled token is then
//! consumed. The grammar's state never crosses workers: a decode worker (or a request resumed
//! elsewhere) replays the tokens generated so far into a fresh matcher, which is cheap next to
//! a forward pass and cannot disagree with the prefill worker's.

use std::path::Path;
use std::sync::Arc;

use crate::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;
use tandem_core::OutputConstraint;

/// Longest schema text accepted, in bytes: compile cost grows with it.
pub const MAX_SCHEMA_BYTES: usize = 64 << 10;

/// The grammar compiler for one tokenizer (its vocabulary padded to the model's).
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

/// The tokenizer as llguidance sees it: the token trie, and the tokenizer for the literal
/// strings a grammar names.
struct HfEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for HfEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

impl Grammars {
    /// The compiler for the tokenizer in `path` (a `tokenizer.json`) serving a model of
    /// `vocab` logits; `eos` are the ids that end generation (the first is the primary one).
    /// Errors say why this tokenizer cannot be constrained.
    pub fn from_tokenizer_file(path: &Path, vocab: usize, eos: &[u32]) -> Result<Self> {
        let unusable = |why: String| {
            Error::InvalidRequest(format!(
                "{} cannot be used for structured outputs: {why}",
                path.display()
            ))
        };
        let text = std::fs::read(path).map_err(|e| unusable(e.to_string()))?;
        let json: Value = serde_json::from_slice(&text).map_err(|e| unusable(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| unusable(e.to_string()))?;
        if words.len() > vocab {
            return Err(unusable(format!(
                "it has {} tokens, the model {vocab} logits",
                words.len()
            )));
        }
        // Rows past the tokenizer (padded embeddings) spell nothing and are never allowed.
        words.resize(vocab, Vec::new());
        let &primary = eos
            .first()
            .ok_or_else(|| unusable("the model names no EOS token".into()))?;
        let info = TokRxInfo::new(vocab as u32, primary);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&text).map_err(|e| unusable(e.to_string()))?;
        let env: TokEnv = Arc::new(HfEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| unusable(e.to_string()))?;
        factory.quiet();
        // Errors go back to API clients: they must not echo the grammar or the tokens.
        factory.limits_mut().verbose_errors = false;
        Ok(Self {
            factory: Arc::new(factory),
            vocab,
        })
    }

    /// A matcher for `c`, or an `InvalidRequest` naming what the schema asks that cannot be
    /// done (unsupported keywords, unsatisfiable, too large).
    pub fn constrain(&self, c: &OutputConstraint) -> Result<Constrained> {
        let invalid = |why: String| Error::InvalidRequest(format!("response_format: {why}"));
        let mut schema = match c {
            OutputConstraint::JsonObject => serde_json::json!({"type": "object"}),
            OutputConstraint::JsonSchema(text) => {
                if text.len() > MAX_SCHEMA_BYTES {
                    return Err(invalid(format!(
                        "the schema is {} bytes, at most {MAX_SCHEMA_BYTES} are accepted",
                        text.len()
                    )));
                }
                serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the schema is not JSON: {e}")))?
            }
        };
        match &schema {
            Value::Object(_) => {}
            // `true` accepts any value.
            Value::Bool(true) => schema = serde_json::json!({}),
            other => return Err(invalid(format!("a JSON schema is an object, got {other}"))),
        }
        // Whitespace between JSON tokens is fixed (`", "` and `": "`): with it free a small
        // model can emit newlines until `max_tokens`.
        let options = JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        options.apply_to(&mut schema);
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(schema));
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        Ok(Constrained {
            matcher,
            mask: Vec::with_capacity(self.vocab.div_ceil(32)),
        })
    }
}

/// One request's grammar state and its mask for the next token.
pub struct Constrained {
    matcher: Matcher,
    mask: Vec<u32>,
}

impl std::fmt::Debug for Constrained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constrained")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constrained {
    /// Advances the grammar over tokens the request generated. A token the grammar does not
    /// allow is an error (and leaves the matcher unusable).
    pub fn consume(&mut self, tokens: &[u32]) -> Result<()> {
        self.matcher.consume_tokens(tokens).map_err(|e| {
            Error::InvalidRequest(format!(
                "the output so far does not follow the response format: {e}"
            ))
        })
    }

    /// Computes the mask of tokens allowed next ([`Constrained::mask`]): once the grammar is
    /// complete, only EOS.
    pub fn compute_mask(&mut self) -> Result<()> {
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| {
            Error::InvalidRequest(format!("the response format cannot be continued: {e}"))
        })?;
        self.mask.clear();
        self.mask.extend_from_slice(vob.as_slice());
        Ok(())
    }

    /// The last computed mask: bit `t % 32` of word `t / 32` is set when token `t` is allowed.
    pub fn mask(&self) -> &[u32] {
        &self.mask
    }

    /// Whether the grammar is complete: nothing may follow what was generated.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Whether token `t` is allowed by `mask` (see [`Constrained::mask`]).
pub fn allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}
