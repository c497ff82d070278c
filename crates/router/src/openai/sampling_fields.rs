//! The sampling controls of a request (penalties, bias, `min_p`, `min_tokens`) and its
//! log-probability fields, checked as OpenAI and vLLM define them: a wrong type or range is
//! a 400 naming the field.

use crate::error::ApiError;
use crate::openai::model::ModelAssets;
use crate::openai::protocol::GenerationParams;
use serde_json::Value;
use tandem_core::SamplingParams;

/// Most tokens `logit_bias` may list.
pub const MAX_LOGIT_BIAS: usize = 300;

/// Most alternatives per token a request may ask for.
pub const MAX_LOGPROBS: u32 = 20;

/// An alternatives count, 0..=[`MAX_LOGPROBS`].
pub(crate) fn logprob_count(v: &Value, field: &'static str) -> Result<u32, ApiError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n <= MAX_LOGPROBS)
        .ok_or_else(|| {
            ApiError::invalid(
                format!("`{field}` must be an integer in [0, {MAX_LOGPROBS}], got {v}"),
                Some(field),
            )
        })
}

/// Chat's `logprobs` (a boolean) and `top_logprobs` (alternatives, only with `logprobs`).
pub(crate) fn chat_logprobs(
    logprobs: &Option<Value>,
    top: &Option<Value>,
) -> Result<Option<u32>, ApiError> {
    let on = match logprobs {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("`logprobs` must be a boolean, got {other}"),
                Some("logprobs"),
            ))
        }
    };
    let top = match top {
        None | Some(Value::Null) => None,
        Some(v) => Some(logprob_count(v, "top_logprobs")?),
    };
    match (on, top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, Some(n)) if n > 0 => Err(ApiError::invalid(
            "`top_logprobs` needs `logprobs: true`",
            Some("top_logprobs"),
        )),
        (false, _) => Ok(None),
    }
}

/// A number field in `range` (inclusive), `None` when absent or null.
fn number_in(
    v: &Option<Value>,
    field: &'static str,
    range: std::ops::RangeInclusive<f64>,
) -> Result<Option<f64>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if range.contains(&x) {
                Ok(Some(x))
            } else {
                Err(ApiError::invalid(
                    format!(
                        "`{field}` must be in [{}, {}], got {x}",
                        range.start(),
                        range.end()
                    ),
                    Some(field),
                ))
            }
        }
        Some(other) => Err(ApiError::invalid(
            format!("`{field}` must be a number, got {other}"),
            Some(field),
        )),
    }
}

/// Penalties, bias, `min_p` and `min_tokens`, checked (`min_tokens` against `max_tokens`
/// later, once that is settled), into otherwise default parameters.
pub(crate) fn check_controls(
    params: &GenerationParams,
    model: &ModelAssets,
) -> Result<SamplingParams, ApiError> {
    let presence = number_in(&params.presence_penalty, "presence_penalty", -2.0..=2.0)?;
    let frequency = number_in(&params.frequency_penalty, "frequency_penalty", -2.0..=2.0)?;
    let repetition = number_in(&params.repetition_penalty, "repetition_penalty", 0.0..=2.0)?;
    if repetition == Some(0.0) {
        return Err(ApiError::invalid(
            "`repetition_penalty` must be greater than 0 (1 is off)",
            Some("repetition_penalty"),
        ));
    }
    let min_p = number_in(&params.min_p, "min_p", 0.0..=1.0)?;
    let min_tokens = match &params.min_tokens {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`min_tokens` must be a non-negative integer, got {v}"),
                    Some("min_tokens"),
                )
            })?,
    };
    let mut logit_bias = Vec::new();
    match &params.logit_bias {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            if o.len() > MAX_LOGIT_BIAS {
                return Err(ApiError::invalid(
                    format!("`logit_bias` may list at most {MAX_LOGIT_BIAS} tokens"),
                    Some("logit_bias"),
                ));
            }
            for (k, v) in o {
                let id: u32 = k.parse().map_err(|_| {
                    ApiError::invalid(
                        format!("`logit_bias` keys must be token ids, got {k:?}"),
                        Some("logit_bias"),
                    )
                })?;
                let ids = crate::openai::validation::client_token_ids(
                    &[i64::from(id)],
                    model,
                    "logit_bias",
                )?;
                let bias =
                    number_in(&Some(v.clone()), "logit_bias", -100.0..=100.0)?.unwrap_or(0.0);
                logit_bias.push((ids[0], bias as f32));
            }
            logit_bias.sort_by_key(|&(id, _)| id);
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("`logit_bias` must be an object, got {other}"),
                Some("logit_bias"),
            ))
        }
    }
    Ok(SamplingParams {
        presence_penalty: presence.unwrap_or(0.0) as f32,
        frequency_penalty: frequency.unwrap_or(0.0) as f32,
        repetition_penalty: repetition.unwrap_or(1.0) as f32,
        min_p: min_p.unwrap_or(0.0) as f32,
        min_tokens,
        logit_bias,
        ..SamplingParams::default()
    })
}
