//! OpenAI wire types: what clients send (parsed, not yet checked — see `validation`) and what
//! the router answers. Unknown request fields are refused, as OpenAI refuses them, except
//! the few that only describe the caller ([`IGNORED_FIELDS`]); fields whose meaning the
//! server cannot honour are rejected in validation too.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::{SystemTime, UNIX_EPOCH};
use tandem_core::FinishReason;

/// Fields shared by `/v1/chat/completions` and `/v1/completions`. Numbers are parsed wide so
/// that an out-of-range value gets a range error, not a type error.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct GenerationParams {
    /// Completion length limit.
    pub max_tokens: Option<i64>,
    /// 0..=2; 0 is greedy.
    pub temperature: Option<f64>,
    /// (0, 1].
    pub top_p: Option<f64>,
    /// Extension: -1 or 0 disables.
    pub top_k: Option<i64>,
    /// Only 1 is supported.
    pub n: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopSpec>,
    /// Sampling seed; random when absent.
    pub seed: Option<i64>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming options (an object).
    pub stream_options: Option<Value>,
    /// Extension: token ids that end generation (besides EOS).
    pub stop_token_ids: Option<Vec<i64>>,
    /// Extension: keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// Chat: `true` reports each token's log-probability; completions: an integer, the
    /// alternatives per token (0..=20).
    pub logprobs: Option<Value>,
    /// -2..=2; 0 is off.
    pub presence_penalty: Option<Value>,
    /// -2..=2; 0 is off.
    pub frequency_penalty: Option<Value>,
    /// Extension: > 0 (at most 2); 1 is off.
    pub repetition_penalty: Option<Value>,
    /// Extension: 0..=1; 0 is off.
    pub min_p: Option<Value>,
    /// Extension: stop tokens cannot end generation before this many tokens.
    pub min_tokens: Option<Value>,
    /// Token id (as a string) → bias in -100..=100.
    pub logit_bias: Option<Value>,
    /// Extension: keep special tokens (`<|im_end|>`, …) in the text (default true: skipped).
    pub skip_special_tokens: Option<bool>,
    /// Extension: end the text with the stop string that matched (default false).
    pub include_stop_str_in_output: Option<bool>,
    /// Structured outputs (`json_object`, `json_schema`); `{"type": "text"}` leaves the
    /// output free.
    pub response_format: Option<Value>,
    /// Extension (vLLM's): the place in the admission queue; lower goes first.
    pub priority: Option<i64>,
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged, expecting = "`stop` to be a string or a list of strings")]
pub enum StopSpec {
    /// `"stop": "x"`
    One(String),
    /// `"stop": ["x", "y"]`
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    pub include_usage: Option<bool>,
}

/// `POST /v1/chat/completions` body.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatCompletionRequest {
    /// The served model name; may be omitted.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Option<Vec<ChatMessage>>,
    /// Preferred over `max_tokens` when both are set.
    pub max_completion_tokens: Option<i64>,
    /// Functions the model may call (`{"type": "function", "function": {...}}`).
    pub tools: Option<Value>,
    /// `none`, `auto` (the default with tools), `required`, or `{"type": "function",
    /// "function": {"name": ...}}`.
    pub tool_choice: Option<Value>,
    /// Whether `required`/`auto` may call several functions at once (default true).
    pub parallel_tool_calls: Option<Value>,
    /// With `logprobs: true`: alternatives per token, 0..=20.
    pub top_logprobs: Option<Value>,
    /// The shared fields.
    #[serde(flatten)]
    pub params: GenerationParams,
    /// Every other field (refused unless it only describes the caller: see
    /// [`IGNORED_FIELDS`]).
    #[serde(flatten)]
    pub unknown: std::collections::BTreeMap<String, Value>,
}

/// One message of a chat.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Text, or a list of parts of which only `text` parts are supported.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Optional participant name.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's calls (`[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`, `arguments` a JSON text).
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// A message's `content`.
#[derive(Clone, Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "message `content` to be a string or a list of {\"type\": \"text\", \"text\": ...} parts"
)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// `[{"type": "text", "text": "..."}, ...]`
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part `content`.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// `text` is the only supported type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// `POST /v1/completions` body.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    /// The served model name; may be omitted.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Option<PromptInput>,
    /// Put the prompt's text before each choice's text (with `logprobs`, the prompt's
    /// tokens' log-probabilities before the generated ones').
    pub echo: Option<bool>,
    /// Insertion suffixes are not supported.
    pub suffix: Option<String>,
    /// Generate this many choices (at least `n`, at most 16) and answer the `n` with the
    /// highest log-probability per token; not with `stream` when greater than `n`.
    pub best_of: Option<i64>,
    /// The shared fields.
    #[serde(flatten)]
    pub params: GenerationParams,
    /// Every other field (refused unless it only describes the caller: see
    /// [`IGNORED_FIELDS`]).
    #[serde(flatten)]
    pub unknown: std::collections::BTreeMap<String, Value>,
}

/// Fields of [`GenerationParams`] (flattened structs do not take
/// their fields out of the catch-all map, so the check subtracts them by name).
pub const SHARED_FIELDS: [&str; 22] = [
    "skip_special_tokens",
    "include_stop_str_in_output",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "response_format",
    "priority",
];
/// Fields of [`ChatCompletionRequest`] besides the shared ones.
pub const CHAT_FIELDS: [&str; 7] = [
    "model",
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
];
/// Fields of [`CompletionRequest`] besides the shared ones.
pub const COMPLETION_FIELDS: [&str; 5] = ["model", "prompt", "echo", "suffix", "best_of"];

/// Request fields accepted and not acted on: they describe the caller or ask for storage
/// and tiers, never change what is generated.
pub const IGNORED_FIELDS: [&str; 6] = [
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// A completion `prompt`: text or token ids, alone or as a batch of one.
#[derive(Clone, Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "`prompt` to be a string, a list of token ids, or a one-element list of either"
)]
pub enum PromptInput {
    /// `"prompt": "text"`
    Text(String),
    /// `"prompt": ["text"]`
    Texts(Vec<String>),
    /// `"prompt": [1, 2, 3]`
    Tokens(Vec<i64>),
    /// `"prompt": [[1, 2, 3]]`
    TokenBatches(Vec<Vec<i64>>),
}

/// Token accounting of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Generated tokens, the one that ended generation included.
    pub completion_tokens: u32,
    /// Sum of both.
    pub total_tokens: u32,
}

impl Usage {
    /// Usage of `prompt_tokens` in, `completion_tokens` out.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
        }
    }
}

/// Non-streamed chat answer.
#[derive(Clone, Debug, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-…`
    pub id: String,
    /// `chat.completion`
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// The server build that produced the answer.
    pub system_fingerprint: &'static str,
    /// Exactly one.
    pub choices: Vec<ChatChoice>,
    /// Token accounting.
    pub usage: Usage,
}

/// The choice of a [`ChatCompletion`].
#[derive(Clone, Debug, Serialize)]
pub struct ChatChoice {
    /// 0.
    pub index: u32,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// Per-token log-probabilities when asked for, else `null`.
    pub logprobs: Option<ChatLogprobs>,
    /// Why generation ended.
    pub finish_reason: ChoiceFinishReason,
    /// The stop string or stop token id that ended it (else `null`).
    pub stop_reason: Option<StopReason>,
}

/// A choice's `finish_reason`: the generation's, or (chat) `tool_calls` when it ended in calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChoiceFinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The model called tools (`tool_choice` `auto` or `required`).
    ToolCalls,
}

impl From<FinishReason> for ChoiceFinishReason {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => Self::Stop,
            FinishReason::Length => Self::Length,
        }
    }
}

/// `{"role": "assistant", "content": ..., "tool_calls": [...]}`
#[derive(Clone, Debug, Serialize)]
pub struct AssistantMessage {
    /// `assistant`
    pub role: &'static str,
    /// The generated text; `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The functions called, when any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One function call of an answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    /// `call_…` (or the id the model wrote, where its format has one).
    pub id: String,
    /// `function`
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What is called.
    pub function: FunctionCall,
}

/// The function of a [`ToolCall`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

/// One call's part of a streamed delta: the first carries `id`, `type` and `name`, later ones
/// more `arguments` text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the choice (0, 1, …).
    pub index: u32,
    /// On a call's first delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, on a call's first delta.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Name and/or arguments text.
    pub function: FunctionCallDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FunctionCallDelta {
    /// On a call's first delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// More of the arguments text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// One SSE chunk of a streamed chat answer.
#[derive(Clone, Debug, Serialize)]
pub struct ChatCompletionChunk {
    /// Same id on every chunk.
    pub id: String,
    /// `chat.completion.chunk`
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// The server build that produced the answer.
    pub system_fingerprint: &'static str,
    /// One choice, or none on the usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Absent unless `include_usage`; then `null` except on the last chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// The choice of a [`ChatCompletionChunk`].
#[derive(Clone, Debug, Serialize)]
pub struct ChatChunkChoice {
    /// 0.
    pub index: u32,
    /// What this chunk adds.
    pub delta: ChatDelta,
    /// The log-probabilities of this chunk's tokens when asked for, else `null`.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last content chunk.
    pub finish_reason: Option<ChoiceFinishReason>,
    /// The stop string or stop token id that ended it (else `null`).
    pub stop_reason: Option<StopReason>,
}

/// Incremental message.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatDelta {
    /// `assistant` on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New or continued function calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A text completion: the non-streamed answer, or one SSE chunk (same shape in OpenAI's API).
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    /// `cmpl-…`
    pub id: String,
    /// `text_completion`
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// The server build that produced the answer.
    pub system_fingerprint: &'static str,
    /// One choice, or none on the usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// Always present when not streaming; when streaming, as [`ChatCompletionChunk::usage`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// The choice of a [`Completion`].
#[derive(Clone, Debug, Serialize)]
pub struct CompletionChoice {
    /// 0.
    pub index: u32,
    /// Generated text (or this chunk's part of it).
    pub text: String,
    /// Per-token log-probabilities when asked for, else `null`.
    pub logprobs: Option<CompletionLogprobs>,
    /// Why generation ended; `null` on intermediate chunks.
    pub finish_reason: Option<ChoiceFinishReason>,
    /// The stop string or stop token id that ended it (else `null`).
    pub stop_reason: Option<StopReason>,
}

/// What stopped a choice (vLLM's `stop_reason`): the stop string matched, or the stop token
/// id (from `stop_token_ids`); `null` for EOS and length.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    /// A stop string.
    Text(String),
    /// A stop token id.
    Token(u32),
}

/// A chat choice's `logprobs`: one entry per generated token.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatLogprobs {
    /// The tokens, in order.
    pub content: Vec<ChatTokenLogprob>,
}

/// One token of [`ChatLogprobs`].
#[derive(Clone, Debug, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its text's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position, most likely first.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative of [`ChatTokenLogprob`].
#[derive(Clone, Debug, Serialize)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its text's UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// A completion choice's `logprobs` (the legacy completions shape).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability (`null` for an echoed prompt's first token).
    pub token_logprobs: Vec<Option<f32>>,
    /// Per token, the most likely tokens' texts and log-probabilities (`null` for an
    /// echoed prompt's first token).
    pub top_logprobs: Vec<Option<std::collections::BTreeMap<String, f32>>>,
    /// Each token's character offset in the generated text.
    pub text_offset: Vec<u32>,
}

impl CompletionLogprobs {
    /// Appends `other`'s entries after these.
    pub fn append(&mut self, other: CompletionLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}

/// `GET /v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelList {
    /// `list`
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// One model of [`ModelList`].
#[derive(Clone, Debug, Serialize)]
pub struct ModelCard {
    /// Served name.
    pub id: String,
    /// `model`
    pub object: &'static str,
    /// Unix seconds (router start).
    pub created: u64,
    /// `tandem`
    pub owned_by: &'static str,
    /// Context length (vLLM's extension).
    pub max_model_len: u32,
}

/// Seconds since the Unix epoch: the `created` of answers and model cards.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
