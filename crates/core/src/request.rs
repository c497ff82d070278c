use serde::{Deserialize, Serialize};

/// Checked sampling parameters. Built by the router's validation; the engine trusts them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// Seed of the request's random stream; the same seed gives the same tokens.
    pub seed: u64,
    /// Tokens to generate in total (the prefill's first token included).
    pub max_tokens: u32,
    /// Token ids that end generation (EOS is added unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            max_tokens,
            ..Self::default()
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}
