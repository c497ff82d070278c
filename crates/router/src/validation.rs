//! Parsed OpenAI requests → [`Prepared`] requests: checked sampling parameters, the prompt
//! templated and tokenized, lengths checked against the context. Every rejection is an
//! `InvalidRequest` [`ApiError`] naming the offending field.

use crate::chat_template::TemplateMessage;
use crate::error::ApiError;
use crate::generator::ValidGenerateRequest;
use crate::model::ModelAssets;
use crate::protocol::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationParams, MessageContent,
    PromptInput, StopSpec,
};
use crate::sampling_fields::{chat_logprobs, check_controls, logprob_count};
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
    /// Choices to generate for the prompt (`n`).
    pub choices: u32,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// End the text with the matched stop string.
    pub include_stop_str: bool,
    /// How to read calls out of the output (chat requests with tools).
    pub tools: Option<crate::tools::ToolMode>,
    /// Completions with `echo`: the prompt's text, put before the generated text.
    pub echo: Option<String>,
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
    check_unknown(&request.unknown, &crate::protocol::CHAT_FIELDS)?;
    let params = &request.params;
    let mut common = check_params(params, model)?;
    common.sampling.logprobs = chat_logprobs(&params.logprobs, &request.top_logprobs)?;
    let tools = crate::tools::check(
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
    check_unknown(&request.unknown, &crate::protocol::COMPLETION_FIELDS)?;
    let params = &request.params;
    let mut common = check_params(params, model)?;
    common.sampling.logprobs = match &params.logprobs {
        None | Some(Value::Null) => None,
        Some(v) => Some(logprob_count(v, "logprobs")?),
    };
    let echo = request.echo == Some(true);
    if echo && common.sampling.logprobs.is_some() {
        return Err(ApiError::invalid(
            "`echo` with `logprobs` (the prompt's log-probabilities) is not supported yet; \
             `echo` alone is",
            Some("echo"),
        ));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "`suffix` is not supported",
            Some("suffix"),
        ));
    }
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "only `best_of` = 1 is supported",
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
}

/// Refuses fields this server does not know (OpenAI's "Unrecognized request argument"),
/// except those that only describe the caller.
fn check_unknown(
    unknown: &std::collections::BTreeMap<String, Value>,
    own: &[&str],
) -> Result<(), ApiError> {
    use crate::protocol::{IGNORED_FIELDS, SHARED_FIELDS};
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
        Some(v @ Value::Object(_)) => {
            serde_json::from_value::<crate::protocol::StreamOptions>(v.clone())
                .map_err(|e| {
                    ApiError::invalid(format!("`stream_options`: {e}"), Some("stream_options"))
                })?
                .include_usage
                .unwrap_or(false)
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("`stream_options` must be an object, got {other}"),
                Some("stream_options"),
            ))
        }
    };
    let constraint = response_format(&params.response_format)?;
    let controls = check_controls(params, model)?;
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
        skip_special_tokens: common.skip_special_tokens,
        include_stop_str: common.include_stop_str,
        tools: None,
        echo: None,
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
                Some(calls) if message.role == "assistant" => Some(crate::tools::template_calls(
                    calls,
                    &format!("messages[{i}]"),
                )?),
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
mod tests {
    use super::*;
    use std::path::Path;

    fn model() -> ModelAssets {
        ModelAssets::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml"))
            .expect("fixture loads")
    }

    fn chat_with(model: &ModelAssets, body: serde_json::Value) -> Result<Prepared, ApiError> {
        let request = serde_json::from_value(body).expect("parses");
        prepare_chat(model, "tiny", RequestId("chatcmpl-1".into()), request)
    }

    #[test]
    fn tools_need_a_template_that_reads_them_and_set_the_mode() {
        use crate::tools::{ToolFormat, ToolMode};
        use serde_json::json;
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let msgs = json!([{"role": "user", "content": "Weather in Oslo?"}]);
        let err =
            chat_with(&model(), json!({"messages": msgs, "tools": tools})).expect_err("no tools");
        assert!(err.to_string().contains("does not support tools"), "{err}");
        assert_eq!(err.body().error.param.as_deref(), Some("tools"));
        // tool_choice none needs no tool support (the tools are not shown).
        let none = chat_with(
            &model(),
            json!({"messages": msgs, "tools": tools, "tool_choice": "none"}),
        )
        .expect("none is fine");
        assert_eq!(none.tools, None);

        // The fixture with room for the tools' system prompt (its tokenizer spends a token
        // on nearly every character).
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-chatml");
        let tmp = tempfile::tempdir().unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixture.join(f), tmp.path().join(f)).unwrap();
        }
        let config = std::fs::read_to_string(fixture.join("config.json")).unwrap();
        std::fs::write(
            tmp.path().join("config.json"),
            config.replace(
                "\"max_position_embeddings\": 256",
                "\"max_position_embeddings\": 8192",
            ),
        )
        .unwrap();
        let dir = tmp.path().to_owned();
        let with_tools = ModelAssets::load_with_template(&dir, Some(Path::new("chatml-tools")))
            .expect("built-in");
        assert_eq!(with_tools.tool_format(), Some(ToolFormat::Hermes));
        let auto = chat_with(&with_tools, json!({"messages": msgs, "tools": tools})).expect("auto");
        assert_eq!(auto.tools, Some(ToolMode::Auto(ToolFormat::Hermes)));
        assert_eq!(auto.request.sampling.constraint, None);
        let plain = chat_with(&with_tools, json!({"messages": msgs})).expect("no tools");
        assert!(
            auto.request.prompt_token_ids.len() > plain.request.prompt_token_ids.len(),
            "the tools are in the prompt"
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let p = chat_with(
            &with_tools,
            json!({"messages": msgs, "tools": tools, "tool_choice": named}),
        )
        .expect("named");
        assert_eq!(p.tools, Some(ToolMode::Named("get_weather".into())));
        assert!(matches!(
            p.request.sampling.constraint,
            Some(OutputConstraint::JsonSchema(_))
        ));
        let err = chat_with(
            &with_tools,
            json!({"messages": msgs, "tools": tools, "tool_choice": named,
                   "response_format": {"type": "json_object"}}),
        )
        .expect_err("two constraints");
        assert_eq!(err.body().error.param.as_deref(), Some("response_format"));

        // A tool-result round trip: the assistant's call and the tool's answer.
        let round = json!([
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]);
        chat_with(&with_tools, json!({"messages": round, "tools": tools})).expect("round trip");
        let mut no_id = round.clone();
        no_id[2].as_object_mut().unwrap().remove("tool_call_id");
        let err =
            chat_with(&with_tools, json!({"messages": no_id, "tools": tools})).expect_err("id");
        assert!(err.to_string().contains("tool_call_id"), "{err}");
        let err = ModelAssets::load_with_template(&dir, Some(Path::new("no-such-template")))
            .expect_err("unknown");
        assert!(err.to_string().contains("chatml-tools"), "{err}");
    }

    fn completion(body: serde_json::Value) -> Result<Prepared, ApiError> {
        let request = serde_json::from_value(body).expect("parses");
        prepare_completion(&model(), "tiny", RequestId("cmpl-1".into()), request)
    }

    #[test]
    fn defaults_fill_in() {
        let prepared =
            completion(serde_json::json!({"prompt": "hello", "seed": 7})).expect("valid");
        let sampling = &prepared.request.sampling;
        assert_eq!(prepared.request.prompt_token_ids.len(), 1);
        assert_eq!(sampling.max_tokens, 255, "min(256, context - prompt)");
        assert_eq!(
            (sampling.temperature, sampling.top_p, sampling.top_k),
            (1.0, 1.0, 0)
        );
        assert_eq!(sampling.seed, 7);
        assert!(sampling.stop_token_ids.is_empty());
        assert!(!prepared.stream);
    }

    #[test]
    fn ranges_are_checked() {
        for (body, param) in [
            (
                serde_json::json!({"prompt": "x", "temperature": 2.5}),
                "temperature",
            ),
            (serde_json::json!({"prompt": "x", "top_p": 0}), "top_p"),
            (serde_json::json!({"prompt": "x", "top_k": -2}), "top_k"),
            (
                serde_json::json!({"prompt": "x", "max_tokens": 0}),
                "max_tokens",
            ),
            (
                serde_json::json!({"prompt": "x", "max_tokens": 256}),
                "max_tokens",
            ),
            (serde_json::json!({"prompt": "x", "n": 17}), "n"),
            (
                serde_json::json!({"prompt": "x", "stop_token_ids": [999]}),
                "stop_token_ids",
            ),
            (serde_json::json!({"prompt": [1, 100000]}), "prompt"),
            (serde_json::json!({"prompt": ["a", "b"]}), "prompt"),
            (serde_json::json!({}), "prompt"),
        ] {
            let err = completion(body.clone()).expect_err("invalid");
            assert_eq!(err.body().error.param.as_deref(), Some(param), "{body}");
            assert_eq!(err.status().as_u16(), 400);
        }
    }

    #[test]
    fn fields_the_server_cannot_honour_are_refused_not_ignored() {
        use serde_json::json;
        let base = json!({"prompt": "hi", "max_tokens": 4});
        let with = |k: &str, v: serde_json::Value| {
            let mut b = base.clone();
            b[k] = v;
            completion(b)
        };
        for (field, value, says) in [
            (
                "response_format",
                json!({"type": "json_schema"}),
                "needs a `json_schema` object",
            ),
            (
                "response_format",
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                "must be a JSON schema object",
            ),
            ("response_format", json!("bogus"), "must be an object"),
            (
                "response_format",
                json!({"type": "xml"}),
                "must be text, json_object",
            ),
            ("logit_bias", json!({"x": 5}), "must be token ids"),
            ("logit_bias", json!({"42": 101}), "must be in [-100, 100]"),
            (
                "logit_bias",
                json!({"99999999": 1}),
                "outside the vocabulary",
            ),
            ("logit_bias", json!([1]), "must be an object"),
            ("presence_penalty", json!(2.5), "must be in [-2, 2]"),
            ("frequency_penalty", json!("x"), "must be a number"),
            ("repetition_penalty", json!(0), "greater than 0"),
            ("repetition_penalty", json!(-1), "must be in [0, 2]"),
            ("min_p", json!(1.5), "must be in [0, 1]"),
            ("min_tokens", json!(-3), "non-negative integer"),
            ("min_tokens", json!(9), "must not exceed"),
            ("stream_options", json!([]), "must be an object"),
        ] {
            let err = with(field, value.clone()).expect_err(field);
            let body = err.body();
            assert_eq!(body.error.param.as_deref(), Some(field), "{field} {value}");
            assert!(
                body.error.message.contains(says),
                "{field} {value}: {}",
                body.error.message
            );
        }
        // Neutral values are what SDKs send by default: accepted.
        for (field, value) in [
            ("response_format", json!({"type": "text"})),
            ("logit_bias", json!({})),
            ("presence_penalty", json!(0)),
            ("frequency_penalty", json!(0.0)),
            ("repetition_penalty", json!(1)),
            ("min_p", json!(0)),
            ("min_tokens", json!(0)),
            ("stream_options", json!({"include_usage": true})),
        ] {
            assert!(with(field, value.clone()).is_ok(), "{field} {value}");
        }
    }

    #[test]
    fn unknown_fields_are_refused_by_name_and_caller_fields_accepted() {
        use serde_json::json;
        let err = completion(json!({"prompt": "x", "temprature": 0.5})).expect_err("typo");
        assert_eq!(err.body().error.param.as_deref(), Some("temprature"));
        assert!(err
            .body()
            .error
            .message
            .contains("Unrecognized request argument"));
        let ok = completion(json!({"prompt": "x", "user": "u1", "metadata": {"a": "b"},
                                    "max_tokens": 3, "presence_penalty": 0.1}));
        assert!(ok.is_ok(), "{:?}", ok.err());
        let chat = |body: serde_json::Value| {
            let request = serde_json::from_value(body).expect("parses");
            prepare_chat(&model(), "tiny", RequestId("chatcmpl-1".into()), request)
        };
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let err = chat(json!({"messages": msgs, "prompt": "x"})).expect_err("a completion field");
        assert_eq!(err.body().error.param.as_deref(), Some("prompt"));
        assert!(
            chat(json!({"messages": msgs, "max_completion_tokens": 3, "store": false})).is_ok()
        );
    }

    #[test]
    fn logprobs_are_checked_per_endpoint() {
        use serde_json::json;
        let chat = |extra: serde_json::Value| {
            let mut body =
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
            for (k, v) in extra.as_object().expect("object") {
                body[k] = v.clone();
            }
            let request = serde_json::from_value(body).expect("parses");
            prepare_chat(&model(), "tiny", RequestId("chatcmpl-1".into()), request)
        };
        let lp = |r: Result<Prepared, ApiError>| r.expect("valid").request.sampling.logprobs;
        assert_eq!(lp(chat(json!({}))), None);
        assert_eq!(lp(chat(json!({"logprobs": true}))), Some(0));
        assert_eq!(
            lp(chat(json!({"logprobs": true, "top_logprobs": 5}))),
            Some(5)
        );
        assert_eq!(
            lp(chat(json!({"logprobs": false, "top_logprobs": 0}))),
            None
        );
        for (body, says) in [
            (json!({"logprobs": 2}), "must be a boolean"),
            (json!({"top_logprobs": 3}), "needs `logprobs: true`"),
            (json!({"logprobs": true, "top_logprobs": 21}), "[0, 20]"),
        ] {
            let err = chat(body.clone()).expect_err("refused");
            assert!(
                err.body().error.message.contains(says),
                "{body}: {}",
                err.body().error.message
            );
        }
        let c = |v: serde_json::Value| {
            completion(json!({"prompt": "hi", "max_tokens": 4, "logprobs": v}))
        };
        assert_eq!(lp(c(json!(3))), Some(3));
        assert_eq!(lp(c(json!(null))), None);
        assert!(c(json!(true)).is_err(), "completions take a count");
        assert!(c(json!(-1)).is_err());
    }

    #[test]
    fn sampling_controls_reach_the_parameters() {
        let prepared = completion(serde_json::json!({
            "prompt": [5, 6], "max_tokens": 8, "presence_penalty": 0.5,
            "frequency_penalty": -1, "repetition_penalty": 1.3, "min_p": 0.05,
            "min_tokens": 4, "logit_bias": {"7": 100, "3": -100}
        }))
        .expect("valid");
        let s = &prepared.request.sampling;
        assert_eq!(
            (
                s.presence_penalty,
                s.frequency_penalty,
                s.repetition_penalty
            ),
            (0.5, -1.0, 1.3)
        );
        assert_eq!((s.min_p, s.min_tokens), (0.05, 4));
        assert_eq!(s.logit_bias, vec![(3, -100.0), (7, 100.0)]);
    }

    #[test]
    fn response_formats_become_constraints() {
        use serde_json::json;
        let constraint = |format: serde_json::Value| {
            completion(json!({"prompt": "hi", "max_tokens": 4, "response_format": format}))
                .expect("valid")
                .request
                .sampling
                .constraint
        };
        assert_eq!(constraint(json!({"type": "text"})), None);
        assert_eq!(
            constraint(json!({"type": "json_object"})),
            Some(OutputConstraint::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let Some(OutputConstraint::JsonSchema(text)) = constraint(
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
        ) else {
            panic!("a schema constraint")
        };
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).expect("JSON"),
            schema
        );
        assert_eq!(
            constraint(json!({"type": "json_schema", "json_schema": {"name": "any"}})),
            Some(OutputConstraint::JsonSchema("{}".into())),
            "no schema: any JSON value"
        );
    }

    #[test]
    fn top_k_minus_one_disables() {
        let prepared =
            completion(serde_json::json!({"prompt": [5, 6], "top_k": -1, "max_tokens": 254}))
                .expect("valid");
        assert_eq!(prepared.request.sampling.top_k, 0);
        assert_eq!(prepared.request.sampling.max_tokens, 254);
    }
}
