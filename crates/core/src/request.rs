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
    /// Subtracted once from the logit of every token already generated (-2..=2; 0 off).
    pub presence_penalty: f32,
    /// Subtracted from each token's logit per time it was generated (-2..=2; 0 off).
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of every token in the prompt or the
    /// output (> 0; 1 off).
    pub repetition_penalty: f32,
    /// Drops tokens whose probability is below this fraction of the most likely one's
    /// (0..=1; 0 off).
    pub min_p: f32,
    /// Stop tokens (EOS and `stop_token_ids`) cannot end generation before this many tokens.
    pub min_tokens: u32,
    /// Added to the logit of each listed token (-100..=100 each).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each generated token's log-probability and this many most likely
    /// alternatives (`None`: none).
    pub logprobs: Option<u32>,
    /// Report the log-probability of every prompt token after the first (given the tokens
    /// before it, over the model's logits as they are) and this many most likely
    /// alternatives (`None`: none); the worker that computes the prompt computes them.
    pub prompt_logprobs: Option<u32>,
    /// Trailing prompt tokens an earlier attempt of this request generated (a request moved
    /// to another pair after its stream broke is prefilled again with what it had streamed):
    /// they count as output for the penalties and `min_tokens` and in the sampling step, so
    /// the continuation is what the first attempt would have sampled. 0 for a new request.
    pub resumed: u32,
    /// A grammar every generated token must keep the output inside (structured outputs);
    /// `None`: free text.
    pub constraint: Option<OutputConstraint>,
}

/// What constrained decoding holds the output to. The grammar's state is not carried
/// between workers: each worker that samples rebuilds it from the tokens generated so far.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputConstraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against this JSON schema (its text).
    JsonSchema(String),
}

/// A generated token's log-probability (over the logits after bias and penalties, before
/// temperature and the top-k / top-p / min-p cuts) and the most likely tokens at its step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
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
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            min_tokens: 0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            resumed: 0,
            constraint: None,
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

    /// Whether the logits need bias, penalties or a stop mask (while fewer than
    /// `min_tokens` are out) before sampling.
    pub fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.min_tokens > 0
            || !self.logit_bias.is_empty()
    }

    /// Whether sampling cuts tokens below `min_p` of the best one's probability.
    pub fn cuts_min_p(&self) -> bool {
        self.min_p > 0.0 && self.temperature > 0.0
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
