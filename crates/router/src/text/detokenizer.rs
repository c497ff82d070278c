//! Incremental detokenization: token ids in, UTF-8-safe text deltas out.
//!
//! A byte-level token can end in the middle of a multi-byte character, and tokenizers such as
//! SentencePiece decode a token differently depending on what precedes it (the leading-space
//! rule). So each step decodes a short window of recent tokens twice — up to the last emitted
//! token (`prefix_offset..read_offset`) and up to the new one (`prefix_offset..`) — and emits
//! the difference. A trailing U+FFFD may be an incomplete character: it is held back until a
//! later token completes it, or until it has lasted more tokens than a character has
//! continuation bytes (3; every token carries at least one byte), when it cannot be one and
//! goes out as U+FFFD — as does at once every U+FFFD followed by more text, so bytes that
//! can never form a character never hold the stream up. Special tokens (`<|im_end|>`, …) are
//! skipped.

use std::sync::Arc;
use tokenizers::Tokenizer;

/// How many prompt tokens seed the window, so the first generated token decodes in context.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Most tokens an incomplete character can be spread over before its last byte arrives.
const MAX_HELD_TOKENS: usize = 3;

/// Turns generated token ids into text deltas.
#[derive(Debug)]
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    /// Window of ids: `ids[prefix_offset..read_offset]` was emitted, `ids[read_offset..]` not yet.
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Bytes of the decoded `ids[read_offset..]` already emitted (text before a held-back
    /// trailing U+FFFD).
    partial: usize,
    /// The token where the held-back trailing bytes began (at most).
    hold_from: usize,
    /// Leave special tokens out of the text.
    skip_special: bool,
}

impl Detokenizer {
    /// A detokenizer for a generation that follows `prompt` (only its last few ids are kept).
    pub fn new(tokenizer: Arc<Tokenizer>, prompt: &[u32]) -> Self {
        let ids = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..].to_vec();
        let read_offset = ids.len();
        Self {
            tokenizer,
            ids,
            prefix_offset: 0,
            read_offset,
            partial: 0,
            hold_from: read_offset,
            skip_special: true,
        }
    }

    /// Keeps special tokens in the text (`false`) or leaves them out (`true`, the default).
    pub fn skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Adds one token; returns the text that became final (often empty).
    pub fn push(&mut self, token_id: u32) -> Result<String, tokenizers::Error> {
        self.ids.push(token_id);
        let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode(self.prefix_offset, self.ids.len())?;
        let held = self.ids.len() - self.hold_from;
        // A trailing U+FFFD that may still become a character stays back.
        let ready = match new_text.strip_suffix('\u{FFFD}') {
            Some(before) if held <= MAX_HELD_TOKENS => before,
            _ => &new_text,
        };
        let from = prefix_text.len() + self.partial;
        let delta = match ready.get(from..) {
            Some(d) if ready.len() > from => d.to_owned(),
            _ => return Ok(String::new()),
        };
        if ready.len() < new_text.len() {
            // The trailing bytes that stay back began in this token at the earliest.
            self.partial = ready.len() - prefix_text.len();
            self.hold_from = self.ids.len() - 1;
            return Ok(delta);
        }
        // Everything up to here is emitted: slide the window and forget older ids.
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        self.partial = 0;
        self.hold_from = self.read_offset;
        Ok(delta)
    }

    /// Ends the generation: returns whatever was held back, incomplete characters rendered as
    /// U+FFFD.
    pub fn finish(&mut self) -> Result<String, tokenizers::Error> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode(self.prefix_offset, self.ids.len())?;
        let delta = new_text
            .get(prefix_text.len() + self.partial..)
            .unwrap_or_default()
            .to_owned();
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        self.partial = 0;
        self.hold_from = self.read_offset;
        Ok(delta)
    }

    fn decode(&self, start: usize, end: usize) -> Result<String, tokenizers::Error> {
        self.tokenizer
            .decode(&self.ids[start..end], self.skip_special)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture() -> Arc<Tokenizer> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml/tokenizer.json");
        Arc::new(Tokenizer::from_file(path).expect("fixture tokenizer loads"))
    }

    fn encode(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
        tokenizer
            .encode(text, false)
            .expect("encodes")
            .get_ids()
            .to_vec()
    }

    #[test]
    fn split_character_arrives_whole_in_one_delta() {
        let tokenizer = fixture();
        // The fixture has no merges for non-ASCII bytes: "é" is two byte tokens.
        let ids = encode(&tokenizer, "é");
        assert_eq!(ids.len(), 2);
        let mut detok = Detokenizer::new(tokenizer, &[]);
        assert_eq!(detok.push(ids[0]).expect("decodes"), "");
        assert_eq!(detok.push(ids[1]).expect("decodes"), "é");
        assert_eq!(detok.finish().expect("decodes"), "");
    }

    #[test]
    fn deltas_concatenate_to_full_decode() {
        let tokenizer = fixture();
        let text = "hello world, stop € 中文 🦀 ok";
        let ids = encode(&tokenizer, text);
        let prompt = encode(&tokenizer, "<|im_start|>assistant\n");
        let mut detok = Detokenizer::new(tokenizer.clone(), &prompt);
        let mut out = String::new();
        for &id in &ids {
            let delta = detok.push(id).expect("decodes");
            assert!(!delta.contains('\u{FFFD}'), "broken character in {delta:?}");
            out.push_str(&delta);
        }
        out.push_str(&detok.finish().expect("decodes"));
        assert_eq!(out, tokenizer.decode(&ids, true).expect("decodes"));
        assert_eq!(out, text);
    }

    #[test]
    fn special_tokens_stay_when_asked() {
        let tokenizer = fixture();
        let ids = encode(&tokenizer, "hello<|im_end|>");
        let mut detok = Detokenizer::new(tokenizer, &[]).skip_special_tokens(false);
        let mut out: String = ids
            .iter()
            .map(|&id| detok.push(id).expect("decodes"))
            .collect();
        out.push_str(&detok.finish().expect("decodes"));
        assert_eq!(out, "hello<|im_end|>");
    }

    #[test]
    fn special_tokens_are_skipped() {
        let tokenizer = fixture();
        let ids = encode(&tokenizer, "hello<|im_end|>");
        let mut detok = Detokenizer::new(tokenizer, &[]);
        let out: String = ids
            .iter()
            .map(|&id| detok.push(id).expect("decodes"))
            .collect();
        assert_eq!(out, "hello");
    }

    #[test]
    fn bytes_that_can_never_form_a_character_are_not_held_back() {
        let tokenizer = fixture();
        // "é" is C3 A9: A9 alone is a continuation byte, never a character's start.
        let lone = encode(&tokenizer, "é")[1];
        let mut detok = Detokenizer::new(tokenizer.clone(), &[]);
        let mut out = String::new();
        let mut first_at = None;
        for i in 0..8 {
            let d = detok.push(lone).expect("decodes");
            if !d.is_empty() && first_at.is_none() {
                first_at = Some(i);
            }
            out.push_str(&d);
        }
        assert_eq!(first_at, Some(1), "text starts flowing at the second token");
        out.push_str(&detok.finish().expect("decodes"));
        assert_eq!(out, "\u{FFFD}".repeat(8));
        // A 4-byte character over 4 byte tokens still arrives whole, after invalid bytes.
        let crab = encode(&tokenizer, "🦀");
        assert_eq!(crab.len(), 4);
        let mut detok = Detokenizer::new(tokenizer, &[]);
        let mut out = detok.push(lone).expect("decodes");
        for &id in &crab {
            let d = detok.push(id).expect("decodes");
            assert!(!d.ends_with('\u{FFFD}') || d == "\u{FFFD}", "{d:?}");
            out.push_str(&d);
        }
        out.push_str(&detok.finish().expect("decodes"));
        assert_eq!(out, "\u{FFFD}🦀");
    }

    #[test]
    fn finish_flushes_an_incomplete_character() {
        let tokenizer = fixture();
        let ids = encode(&tokenizer, "a€");
        assert_eq!(ids.len(), 4);
        let mut detok = Detokenizer::new(tokenizer, &[]);
        let mut out = String::new();
        for &id in &ids[..3] {
            out.push_str(&detok.push(id).expect("decodes"));
        }
        assert_eq!(out, "a");
        let tail = detok.finish().expect("decodes");
        assert!(tail.starts_with('\u{FFFD}'), "{tail:?}");
    }
}
