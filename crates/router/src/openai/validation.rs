//! Parsed OpenAI requests → [`Prepared`] requests: checked sampling parameters, the prompt
//! templated and tokenized, lengths checked against the context. Every rejection is an
//! `InvalidRequest` [`ApiError`] naming the offending field.

use crate::error::ApiError;
use crate::generator::ValidGenerateRequest;
use crate::openai::chat_template::TemplateMessage;
use crate::openai::model::ModelAssets;
use crate::openai::protocol::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationParams, MessageContent,
    PromptInput, StopSpec,
};
use crate::openai::sampling_fields::{chat_logprobs, check_controls, logprob_count};
use serde_json::Value;
use tandem_core::{OutputConstraint, RequestId, SamplingParams};

/// Most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;
/// Most `stop_token_ids` a request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Completion length used when the request sets none (capped by the room left in the context).
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// A request ready for the generator, plus what the HTTP layer needs to shape the answer.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// What the generator gets.
    pub request: ValidGenerateRequest,
    /// Stop strings, matched on the text by the router.
    pub stop: Vec<String>,
    /// Answer with server-sent events.
    pub stream: bool,
    /// Streaming: send a final `usage` chunk.
    pub include_usage: bool,
    /// Choices to generate for the prompt (`n`, or `best_of` when greater).
    pub choices: u32,
    /// Choices answered (`n`): with `best_of` > `n`, the `kept` of the `choices` generated
    /// with the highest mean token log-probability; otherwise all of them.
    pub kept: u32,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// End the text with the matched stop string.
    pub include_stop_str: bool,
    /// How to read calls out of the output (chat requests with tools).
    pub tools: Option<crate::openai::tools::ToolMode>,
    /// Completions with `echo`: the prompt's text, put before the generated text.
    pub echo: Option<String>,
    /// The request's `priority` (lower goes first in the admission queue), when it set one.
    pub priority: Option<i32>,
}

impl Prepared {
    /// One request per choice: the same prompt, seeds `seed`, `seed + 1`, … (ids suffixed
    /// `-0`, `-1`, … when there are several).
    pub fn expand(self) -> Vec<Prepared> {
        let n = self.choices.max(1);
        if n == 1 {
            return vec![self];
        }
        (0..n)
            .map(|j| {
                let mut p = self.clone();
                p.choices = 1;
                p.request.id = RequestId(format!("{}-{j}", self.request.id.0));
                p.request.sampling.seed = self.request.sampling.seed.wrapping_add(u64::from(j));
                p
            })
            .collect()
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> u32 {
        u32::try_from(self.request.prompt_token_ids.len()).unwrap_or(u32::MAX)
    }
}

/// Checks and tokenizes a chat request.
pub fn prepare_chat(
    model: &ModelAssets,
    served_name: &str,
    id: RequestId,
    request: ChatCompletionRequest,
) -> Result<Prepared, ApiError> {
    check_model(request.model.as_deref(), served_name)?;
    check_unknown(&request.unknown, &crate::openai::protocol::CHAT_FIELDS)?;
    let params = &request.params;
    let mut common = check_params(params, model)?;
    common.sampling.logprobs = chat_logprobs(&params.logprobs, &request.top_logprobs)?;
    let tools = crate::openai::tools::check(
        request.tools.as_ref(),
        request.tool_choice.as_ref(),
        request.parallel_tool_calls.as_ref(),
        model.tool_format(),
    )
    .map_err(|err| {
        // A template that knows nothing of tools is the first thing to say.
        match (model.tool_chat_template(), &request.tools) {
            (Some(t), Some(Value::Array(list))) if !t.supports_tools() && !list.is_empty() => {
                no_tool_support()
            }
            _ => err,
        }
    })?;
    if let Some(tools) = &tools {
        if let Some(constraint) = &tools.constraint {
            if common.sampling.constraint.is_some() {
                return Err(ApiError::invalid(
                    "`response_format` cannot be combined with `tool_choice` required or a \
                     named function (both constrain the output)",
                    Some("response_format"),
                ));
            }
            common.sampling.constraint = Some(constraint.clone());
        }
    }
    let prompt = chat_prompt(
        model,
        request.messages.as_deref(),
        tools.as_ref().map(|t| t.template_tools.as_slice()),
    )?;
    let max_tokens = match (request.max_completion_tokens, params.max_tokens) {
        (Some(n), _) => Some((n, "max_completion_tokens")),
        (None, Some(n)) => Some((n, "max_tokens")),
        (None, None) => None,
    };
    let mut prepared = finish(model, id, prompt, max_tokens, common, "messages")?;
    prepared.tools = tools.map(|t| t.mode);
    Ok(prepared)
}

/// A request body as `T`. JSON numbers with no fraction (`16.0`) count as integers, as JSON
/// Schema and Python clients see them, so `"max_tokens": 16.0` is read as 16.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|err| ApiError::invalid(format!("malformed JSON in request body: {err}"), None))?;
    integral_floats_as_integers(&mut value);
    serde_json::from_value(value)
        .map_err(|err| ApiError::invalid(format!("invalid request body: {err}"), None))
}

/// Rewrites every float with no fractional part (and within i64) as an integer, recursively.
fn integral_floats_as_integers(value: &mut Value) {
    match value {
        Value::Number(n) if n.is_f64() => {
            if let Some(x) = n.as_f64() {
                // 2^63 = 9223372036854775808 is the first float past i64's range.
                if x.fract() == 0.0 && x.abs() < 9_223_372_036_854_775_808.0 {
                    *value = Value::from(x as i64);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

fn no_tool_support() -> ApiError {
    ApiError::invalid(
        "this model's chat template does not support tools (start the router with \
         --chat-template naming one that does: a Jinja file, or the built-in chatml-tools)",
        Some("tools"),
    )
}

/// The token ids of a chat's `messages` rendered by the model's template (its tools template
/// when `tools` are given).
pub(crate) fn chat_prompt(
    model: &ModelAssets,
    messages: Option<&[ChatMessage]>,
    tools: Option<&[Value]>,
) -> Result<Vec<u32>, ApiError> {
    let messages =
        messages.ok_or_else(|| ApiError::invalid("`messages` is required", Some("messages")))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "`messages` must not be empty",
            Some("messages"),
        ));
    }
    let messages = template_messages(messages)?;
    let template = match tools {
        None => model.chat_template(),
        Some(_) => model.tool_chat_template(),
    };
    let template = template.ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; use /v1/completions",
            Some("messages"),
        )
    })?;
    if tools.is_some() && !template.supports_tools() {
        return Err(no_tool_support());
    }
    let text = template
        .render_with_tools(&messages, tools)
        .map_err(|err| ApiError::invalid(err.message, Some("messages")))?;
    check_length_estimate(model, &text, "messages")?;
    model
        .encode_chat(&text)
        .map_err(|err| ApiError::internal(format!("tokenization failed: {err}")))
}

/// The token ids of a completion prompt given as text (the model's own post-processing,
/// BOS as its tokenizer config says).
pub(crate) fn text_prompt(model: &ModelAssets, text: &str) -> Result<Vec<u32>, ApiError> {
    encode_prompt(model, text)
}

/// Token ids given by a client, checked against the vocabulary.
pub(crate) fn client_token_ids(
    ids: &[i64],
    model: &ModelAssets,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    token_ids(ids, model, param)
}

/// Most prompts one batched `/v1/completions` request may carry.
pub const MAX_BATCH_PROMPTS: usize = 64;

/// Checks and tokenizes a completion request of one prompt.
pub fn prepare_completion(
    model: &ModelAssets,
    served_name: &str,
    id: RequestId,
    request: CompletionRequest,
) -> Result<Prepared, ApiError> {
    let mut batch = prepare_completion_batch(model, served_name, id, request)?;
    match batch.len() {
        1 => Ok(batch.remove(0)),
        n => Err(ApiError::invalid(
            format!("expected one prompt, got {n}"),
            Some("prompt"),
        )),
    }
}

/// Checks and tokenizes a completion request: one [`Prepared`] per prompt (a batch is a list
/// of strings or of token-id lists; each prompt is its own request, with ids `ID-0`, `ID-1`,
/// …).
pub fn prepare_completion_batch(
    model: &ModelAssets,
    served_name: &str,
    id: RequestId,
    request: CompletionRequest,
) -> Result<Vec<Prepared>, ApiError> {
    check_model(request.model.as_deref(), served_name)?;
    check_unknown(
        &request.unknown,
        &crate::openai::protocol::COMPLETION_FIELDS,
    )?;
    let params = &request.params;
    let mut common = check_params(params, model)?;
    common.sampling.logprobs = match &params.logprobs {
        None | Some(Value::Null) => None,
        Some(v) => Some(logprob_count(v, "logprobs")?),
    };
    let echo = request.echo == Some(true);
    if echo {
        // The echoed prompt's tokens come with theirs (the first token's is null).
        common.sampling.prompt_logprobs = common.sampling.logprobs;
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "`suffix` is not supported",
            Some("suffix"),
        ));
    }
    let best_of = match request.best_of {
        None => common.choices,
        Some(b) => u32::try_from(b)
            .ok()
            .filter(|b| (1..=MAX_CHOICES).contains(b))
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`best_of` must be in [1, {MAX_CHOICES}], got {b}"),
                    Some("best_of"),
                )
            })?,
    };
    if best_of < common.choices {
        return Err(ApiError::invalid(
            format!(
                "`best_of` ({best_of}) must be at least `n` ({})",
                common.choices
            ),
            Some("best_of"),
        ));
    }
    if best_of > common.choices && common.stream {
        return Err(ApiError::invalid(
            "`best_of` greater than `n` cannot be streamed (the best are known only at the end)",
            Some("best_of"),
        ));
    }
    // Each prompt's ids, and its text when the client sent text (what `echo` repeats).
    let prompts: Vec<(Vec<u32>, Option<String>)> = match request.prompt {
        None => return Err(ApiError::invalid("`prompt` is required", Some("prompt"))),
        Some(PromptInput::Text(text)) => vec![(encode_prompt(model, &text)?, Some(text))],
        Some(PromptInput::Texts(texts)) => {
            check_batch(texts.len())?;
            texts
                .into_iter()
                .map(|t| Ok((encode_prompt(model, &t)?, Some(t))))
                .collect::<Result<_, ApiError>>()?
        }
        Some(PromptInput::Tokens(ids)) => vec![(token_ids(&ids, model, "prompt")?, None)],
        Some(PromptInput::TokenBatches(batches)) => {
            check_batch(batches.len())?;
            batches
                .iter()
                .map(|ids| Ok((token_ids(ids, model, "prompt")?, None)))
                .collect::<Result<_, ApiError>>()?
        }
    };
    let max_tokens = params.max_tokens.map(|n| (n, "max_tokens"));
    let single = prompts.len() == 1;
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            let id = if single {
                id.clone()
            } else {
                RequestId(format!("{}-{i}", id.0))
            };
            let (prompt, text) = prompt;
            let echo = match (echo, text) {
                (false, _) => None,
                (true, Some(text)) => Some(text),
                (true, None) => Some(
                    model
                        .tokenizer()
                        .decode(&prompt, common.skip_special_tokens)
                        .map_err(|e| {
                            ApiError::internal(format!("cannot decode the prompt: {e}"))
                        })?,
                ),
            };
            let mut prepared = finish(model, id, prompt, max_tokens, common.clone(), "prompt")?;
            prepared.echo = echo;
            prepared.choices = best_of;
            Ok(prepared)
        })
        .collect()
}

fn check_batch(len: usize) -> Result<(), ApiError> {
    if len == 0 || len > MAX_BATCH_PROMPTS {
        return Err(ApiError::invalid(
            format!("`prompt` must hold 1 to {MAX_BATCH_PROMPTS} prompts, got {len}"),
            Some("prompt"),
        ));
    }
    Ok(())
}

/// Checked fields shared by both endpoints, before the prompt length is known.
#[derive(Clone)]
struct Common {
    sampling: SamplingParams,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    choices: u32,
    skip_special_tokens: bool,
    include_stop_str: bool,
    priority: Option<i32>,
}

/// Refuses fields this server does not know (OpenAI's "Unrecognized request argument"),
/// except those that only describe the caller.
fn check_unknown(
    unknown: &std::collections::BTreeMap<String, Value>,
    own: &[&str],
) -> Result<(), ApiError> {
    use crate::openai::protocol::{IGNORED_FIELDS, SHARED_FIELDS};
    match unknown
        .keys()
        .map(String::as_str)
        .find(|k| !(own.contains(k) || SHARED_FIELDS.contains(k) || IGNORED_FIELDS.contains(k)))
    {
        Some(k) => Err(ApiError::invalid(
            format!("Unrecognized request argument supplied: {k}"),
            Some(k),
        )),
        None => Ok(()),
    }
}

pub(crate) fn check_model(requested: Option<&str>, served_name: &str) -> Result<(), ApiError> {
    match requested {
        Some(name) if name != served_name => Err(ApiError::model_not_found(name)),
        _ => Ok(()),
    }
}

fn check_params(params: &GenerationParams, model: &ModelAssets) -> Result<Common, ApiError> {
    let choices = match params.n {
        None => 1,
        Some(n) => u32::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_CHOICES).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`n` must be in [1, {MAX_CHOICES}], got {n}"),
                    Some("n"),
                )
            })?,
    };
    let temperature = params.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("`temperature` must be in [0, 2], got {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = params.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("`top_p` must be in (0, 1], got {top_p}"),
            Some("top_p"),
        ));
    }
    let top_k = match params.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) => u32::try_from(k).map_err(|_| {
            ApiError::invalid(
                format!("`top_k` must be -1 (disabled) or a positive integer, got {k}"),
                Some("top_k"),
            )
        })?,
    };
    let stop = match &params.stop {
        None => Vec::new(),
        Some(StopSpec::One(stop)) => vec![stop.clone()],
        Some(StopSpec::Many(stops)) => stops.clone(),
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                stop.len()
            ),
            Some("stop"),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop strings must not be empty",
            Some("stop"),
        ));
    }
    let stop_token_ids = params.stop_token_ids.as_deref().unwrap_or_default();
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            format!("at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed"),
            Some("stop_token_ids"),
        ));
    }
    let stop_token_ids = token_ids(stop_token_ids, model, "stop_token_ids")?;
    let stream = params.stream.unwrap_or(false);
    let include_usage = match &params.stream_options {
        None | Some(Value::Null) => false,
        Some(v @ Value::Object(_)) => serde_json::from_value::<
            crate::openai::protocol::StreamOptions,
        >(v.clone())
        .map_err(|e| ApiError::invalid(format!("`stream_options`: {e}"), Some("stream_options")))?
        .include_usage
        .unwrap_or(false),
        Some(other) => {
            return Err(ApiError::invalid(
                format!("`stream_options` must be an object, got {other}"),
                Some("stream_options"),
            ))
        }
    };
    let constraint = response_format(&params.response_format)?;
    let controls = check_controls(params, model)?;
    let priority = params
        .priority
        .map(|p| {
            i32::try_from(p).map_err(|_| {
                ApiError::invalid(
                    format!("`priority` must be a 32-bit integer, got {p}"),
                    Some("priority"),
                )
            })
        })
        .transpose()?;
    let seed = params
        .seed
        .map_or_else(rand::random::<u64>, |seed| seed as u64);
    Ok(Common {
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            seed,
            max_tokens: 0, // set once the prompt length is known
            stop_token_ids,
            ignore_eos: params.ignore_eos.unwrap_or(false),
            constraint,
            ..controls
        },
        stop,
        stream,
        include_usage,
        choices,
        skip_special_tokens: params.skip_special_tokens.unwrap_or(true),
        include_stop_str: params.include_stop_str_in_output.unwrap_or(false),
        priority,
    })
}

/// `response_format` as a constraint on the output: `text` (or nothing) leaves it free,
/// `json_object` asks for any JSON object, `json_schema` for a value valid against
/// `json_schema.schema` (whether the schema can be enforced is settled by the worker that
/// compiles it, which answers 400 with the reason).
fn response_format(v: &Option<Value>) -> Result<Option<OutputConstraint>, ApiError> {
    let invalid = |message: String| ApiError::invalid(message, Some("response_format"));
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(other) => {
            return Err(invalid(format!(
                "`response_format` must be an object, got {other}"
            )))
        }
    };
    match o.get("type").and_then(Value::as_str).unwrap_or("") {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputConstraint::JsonObject)),
        "json_schema" => {
            let spec = match o.get("json_schema") {
                Some(Value::Object(spec)) => spec,
                _ => {
                    return Err(invalid(
                        "`response_format` json_schema needs a `json_schema` object".into(),
                    ))
                }
            };
            let schema = match spec.get("schema") {
                // No schema: any JSON value.
                None | Some(Value::Null) => Value::Object(Default::default()),
                Some(schema @ (Value::Object(_) | Value::Bool(true))) => schema.clone(),
                Some(other) => {
                    return Err(invalid(format!(
                        "`response_format.json_schema.schema` must be a JSON schema object, got {other}"
                    )))
                }
            };
            Ok(Some(OutputConstraint::JsonSchema(schema.to_string())))
        }
        "" => Err(invalid("`response_format` needs a `type`".to_string())),
        other => Err(invalid(format!(
            "`response_format.type` must be text, json_object or json_schema, got {other:?}"
        ))),
    }
}

/// Checks lengths, settles `max_tokens`, builds the [`Prepared`] request.
fn finish(
    model: &ModelAssets,
    id: RequestId,
    prompt: Vec<u32>,
    max_tokens: Option<(i64, &'static str)>,
    mut common: Common,
    prompt_param: &str,
) -> Result<Prepared, ApiError> {
    let context = u64::from(model.context_length());
    let prompt_len = prompt.len() as u64;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "the prompt is empty after tokenization",
            Some(prompt_param),
        ));
    }
    if let Some((n, param)) = max_tokens {
        if n < 1 {
            return Err(ApiError::invalid(
                format!("`{param}` must be at least 1, got {n}"),
                Some(param),
            ));
        }
    }
    if prompt_len >= context {
        return Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {context} tokens, and the prompt is \
                 {prompt_len} tokens, which leaves no room for a completion."
            ),
            Some(prompt_param),
        ));
    }
    let room = context - prompt_len;
    let max_tokens = match max_tokens {
        None => room.min(u64::from(DEFAULT_MAX_TOKENS)),
        Some((n, param)) => {
            let n = n as u64; // n >= 1 checked above
            if n > room {
                return Err(ApiError::invalid(
                    format!(
                        "This model's maximum context length is {context} tokens. However, you \
                         requested {} tokens ({prompt_len} in the prompt, {n} for the \
                         completion). Reduce the prompt or `{param}`.",
                        prompt_len + n
                    ),
                    Some(param),
                ));
            }
            n
        }
    };
    // room < context <= u32::MAX
    common.sampling.max_tokens = u32::try_from(max_tokens).unwrap_or(u32::MAX);
    if common.sampling.min_tokens > common.sampling.max_tokens {
        return Err(ApiError::invalid(
            format!(
                "`min_tokens` ({}) must not exceed the completion length ({})",
                common.sampling.min_tokens, common.sampling.max_tokens
            ),
            Some("min_tokens"),
        ));
    }
    Ok(Prepared {
        request: ValidGenerateRequest {
            id,
            prompt_token_ids: prompt,
            sampling: common.sampling,
        },
        stop: common.stop,
        stream: common.stream,
        include_usage: common.include_usage,
        choices: common.choices,
        kept: common.choices,
        skip_special_tokens: common.skip_special_tokens,
        include_stop_str: common.include_stop_str,
        tools: None,
        echo: None,
        priority: common.priority,
    })
}

fn template_messages(messages: &[ChatMessage]) -> Result<Vec<TemplateMessage>, ApiError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let content = match &message.content {
                None => String::new(),
                Some(MessageContent::Text(text)) => text.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.kind.as_str(), &part.text) {
                            ("text", Some(part_text)) => text.push_str(part_text),
                            ("text", None) => {
                                return Err(ApiError::invalid(
                                    format!("messages[{i}]: a text part needs `text`"),
                                    Some("messages"),
                                ))
                            }
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    format!(
                                        "messages[{i}]: content parts of type `{kind}` are not \
                                         supported (only `text`)"
                                    ),
                                    Some("messages"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            let tool_calls = match &message.tool_calls {
                None | Some(Value::Null) => None,
                Some(calls) if message.role == "assistant" => Some(
                    crate::openai::tools::template_calls(calls, &format!("messages[{i}]"))?,
                ),
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}]: only assistant messages carry `tool_calls`"),
                        Some("messages"),
                    ))
                }
            };
            if message.role == "tool" && message.tool_call_id.is_none() {
                return Err(ApiError::invalid(
                    format!("messages[{i}]: a `tool` message needs the `tool_call_id` it answers"),
                    Some("messages"),
                ));
            }
            Ok(TemplateMessage {
                role: message.role.clone(),
                content,
                name: message.name.clone(),
                tool_calls,
                tool_call_id: message.tool_call_id.clone(),
            })
        })
        .collect()
}

/// Refuses, before tokenizing, a text that cannot fit the context whatever its tokens (a
/// 10 MB prompt is not worth seconds of tokenizer time to reject).
fn check_length_estimate(model: &ModelAssets, text: &str, param: &str) -> Result<(), ApiError> {
    let at_least = model.min_tokens(text);
    let context = u64::from(model.context_length());
    if at_least >= context {
        return Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {context} tokens, and the prompt \
                 ({} bytes) takes at least {at_least}.",
                text.len()
            ),
            Some(param),
        ));
    }
    Ok(())
}

fn encode_prompt(model: &ModelAssets, text: &str) -> Result<Vec<u32>, ApiError> {
    check_length_estimate(model, text, "prompt")?;
    model
        .encode_prompt(text)
        .map_err(|err| ApiError::internal(format!("tokenization failed: {err}")))
}

fn token_ids(ids: &[i64], model: &ModelAssets, param: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = model.vocab_size();
    ids.iter()
        .map(|&id| {
            u32::try_from(id)
                .ok()
                .filter(|&id| id < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!("token id {id} is outside the vocabulary (0..{vocab})"),
                        Some(param),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "validation_tests.rs"]
mod tests;
