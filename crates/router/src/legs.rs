//! One attempt of a request on its workers: a P/D pair (reserve on the decode worker,
//! prefill with its KV target, stream the rest) or an aggregated worker. Each resolves with
//! the first token, so a failure before it can still be retried elsewhere.

use crate::generator::{GenerateError, GeneratedToken, TokenStream, ValidGenerateRequest};
use crate::workers::{classify_status, WorkerHandle};
use futures::StreamExt;
use tandem_core::{ErrorClass, FinishReason};
use tandem_proto::v1 as pb;

pub(crate) fn finish_from_pb(v: i32) -> Option<FinishReason> {
    match pb::FinishReason::try_from(v) {
        Ok(pb::FinishReason::Stop) => Some(FinishReason::Stop),
        Ok(pb::FinishReason::Length) => Some(FinishReason::Length),
        _ => None,
    }
}

fn logprobs_from_pb(l: pb::Logprobs) -> tandem_core::TokenLogprobs {
    tandem_core::TokenLogprobs {
        logprob: l.logprob,
        top: l.top.into_iter().map(|t| (t.token_id, t.logprob)).collect(),
    }
}

pub(crate) fn to_pb(req: &ValidGenerateRequest) -> pb::GenerateRequest {
    let s = &req.sampling;
    pb::GenerateRequest {
        request_id: req.id.0.clone(),
        prompt_token_ids: req.prompt_token_ids.clone(),
        sampling: Some(pb::SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            seed: s.seed,
            max_tokens: s.max_tokens,
            stop_token_ids: s.stop_token_ids.clone(),
            ignore_eos: s.ignore_eos,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            repetition_penalty: s.repetition_penalty,
            min_p: s.min_p,
            min_tokens: s.min_tokens,
            logprobs: s.logprobs,
            resumed: s.resumed,
            constraint: s.constraint.as_ref().map(constraint_to_wire),
            logit_bias: s
                .logit_bias
                .iter()
                .map(|&(token_id, bias)| pb::LogitBias { token_id, bias })
                .collect(),
        }),
    }
}

fn constraint_to_wire(c: &tandem_core::OutputConstraint) -> pb::OutputConstraint {
    use pb::output_constraint::Kind;
    use tandem_core::OutputConstraint as C;
    pb::OutputConstraint {
        kind: Some(match c {
            C::JsonObject => Kind::JsonObject(true),
            C::JsonSchema(schema) => Kind::JsonSchema(schema.clone()),
        }),
    }
}

/// A whole request on one aggregated worker: resolves with its first token (so a failure
/// before it can still be retried elsewhere), then streams the rest.
pub(crate) async fn try_aggregated(
    w: &WorkerHandle,
    req: &ValidGenerateRequest,
    budget: Budget,
    tracker: &crate::inflight::Tracker,
) -> Result<TokenStream, GenerateError> {
    let claim = w.claim();
    tracker.phase(crate::inflight::Phase::Prefilling);
    let mut events = w
        .client
        .clone()
        .generate(with_deadline(to_pb(req), budget.request))
        .await
        .map_err(classify_status)?
        .into_inner();
    let token = |t: pb::TokenEvent| GeneratedToken {
        token_id: t.token_id,
        finish_reason: finish_from_pb(t.finish_reason),
        logprobs: t.logprobs.map(logprobs_from_pb),
    };
    let id = w.id.clone();
    let ended = move || {
        GenerateError::new(
            ErrorClass::Unavailable,
            format!("worker {id} ended the stream before finishing"),
        )
    };
    let first = match events.message().await.map_err(classify_status)? {
        Some(t) => token(t),
        None => return Err(ended()),
    };
    tracker.phase(crate::inflight::Phase::Decoding);
    let ends = first.finish_reason.is_some();
    let head = futures::stream::once(async move { Ok(first) });
    if ends {
        return Ok(head.boxed());
    }
    // The load claim rides along with the stream.
    let rest = futures::stream::unfold(Some((events, claim)), move |state| {
        let ended = ended.clone();
        async move {
            let (mut events, claim) = state?;
            match events.message().await {
                Ok(Some(t)) => {
                    let tok = token(t);
                    let more = tok.finish_reason.is_none();
                    Some((Ok(tok), more.then_some((events, claim))))
                }
                Ok(None) => Some((Err(ended()), None)),
                Err(s) => Some((Err(classify_status(s)), None)),
            }
        }
    });
    Ok(head.chain(rest).boxed())
}

/// What is left of a request's time when an attempt starts: the workers get it as their
/// gRPC deadlines (`grpc-timeout`), so they stop the work on their own once it has passed,
/// even when the router can no longer tell them (partitioned, stopped).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Budget {
    /// Until this attempt's first token (the prefill call).
    pub first_token: std::time::Duration,
    /// Until the request's end (the decode or generate stream).
    pub request: std::time::Duration,
}

fn with_deadline<T>(msg: T, left: std::time::Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(left);
    r
}

/// Which side of a pair an attempt failed on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Leg {
    Prefill,
    Decode,
    Both,
}

pub(crate) async fn try_pair(
    p: &WorkerHandle,
    d: &WorkerHandle,
    req: &ValidGenerateRequest,
    budget: Budget,
    tracker: &crate::inflight::Tracker,
) -> Result<TokenStream, (Leg, GenerateError)> {
    let on_decode = |e: GenerateError| (Leg::Decode, e);
    let request = to_pb(req);
    let (dp_rank, dp_slot) = d.pick_dp_rank().await.map_err(on_decode)?;
    // Claims on both workers' load: the prefill's for its call, the decode's with the stream.
    let dp_slot = (dp_slot, d.claim());
    let prefill_claim = p.claim();
    let mut decode = d
        .client
        .clone()
        .decode(with_deadline(
            pb::DecodeRequest {
                request: Some(request.clone()),
                dp_rank,
            },
            budget.request,
        ))
        .await
        .map_err(|s| on_decode(classify_status(s)))?
        .into_inner();
    let target = match decode
        .message()
        .await
        .map_err(|s| on_decode(classify_status(s)))?
    {
        Some(pb::DecodeEvent {
            event: Some(pb::decode_event::Event::KvTarget(t)),
        }) => t,
        other => {
            return Err(on_decode(GenerateError::new(
                ErrorClass::Internal,
                format!(
                    "decode worker {} answered {other:?} instead of a KV target",
                    d.id
                ),
            )))
        }
    };
    tracker.phase(crate::inflight::Phase::Prefilling);
    let mut prefill_client = p.client.clone();
    let prefill_call = prefill_client.prefill(with_deadline(
        pb::PrefillRequest {
            request: Some(request),
            kv_target: Some(target),
        },
        budget.first_token,
    ));
    tokio::pin!(prefill_call);
    // Watch the decode stream while the prefill runs: a decode worker that goes away ends the
    // attempt at once, and dropping the prefill call cancels the prompt's computation on the
    // prefill worker (its engine frees the request). A token that arrives before the prefill
    // answers (the KV landed first) is kept for after the first token.
    let mut early: Option<Option<pb::DecodeEvent>> = None;
    let answered = loop {
        tokio::select! {
            r = &mut prefill_call => break r,
            m = decode.message(), if early.is_none() => match m {
                Ok(Some(ev)) => early = Some(Some(ev)),
                Ok(None) => {
                    return Err(on_decode(GenerateError::new(
                        ErrorClass::Unavailable,
                        format!("decode worker {} ended its stream during the prefill", d.id),
                    )))
                }
                Err(s) => return Err(on_decode(classify_status(s))),
            },
        }
    };
    let first = answered
        .map_err(|s| {
            let e = classify_status(s);
            // A failed transfer may be either side's fault: move both.
            let leg = if e.class == ErrorClass::TransferFailed {
                Leg::Both
            } else {
                Leg::Prefill
            };
            (leg, e)
        })?
        .into_inner();
    drop(prefill_claim);
    tracker.phase(crate::inflight::Phase::Decoding);
    let first = GeneratedToken {
        token_id: first.first_token_id,
        finish_reason: finish_from_pb(first.finish_reason),
        logprobs: first.first_logprobs.map(logprobs_from_pb),
    };
    let ends = first.finish_reason.is_some();
    let head = futures::stream::once(async move { Ok(first) });
    if ends {
        // Dropping `decode` here cancels the reservation on the decode worker.
        return Ok(head.boxed());
    }
    let decode_id = d.id.clone();
    // The DP slot rides along with the stream: released when the request ends or is dropped.
    let rest = futures::stream::unfold(Some((decode, dp_slot, early)), move |state| {
        let decode_id = decode_id.clone();
        async move {
            let (mut decode, dp_slot, early) = state?;
            let next = match early {
                Some(ev) => Ok(ev),
                None => decode.message().await,
            };
            let item = match next {
                Ok(Some(pb::DecodeEvent {
                    event: Some(pb::decode_event::Event::Token(t)),
                })) => {
                    let tok = GeneratedToken {
                        token_id: t.token_id,
                        finish_reason: finish_from_pb(t.finish_reason),
                        logprobs: t.logprobs.map(logprobs_from_pb),
                    };
                    let more = tok.finish_reason.is_none();
                    return Some((Ok(tok), more.then_some((decode, dp_slot, None))));
                }
                Ok(None) => GenerateError::new(
                    ErrorClass::Unavailable,
                    format!("decode worker {decode_id} ended the stream before finishing"),
                ),
                Ok(Some(other)) => GenerateError::new(
                    ErrorClass::Internal,
                    format!("unexpected decode event {other:?}"),
                ),
                Err(s) => classify_status(s),
            };
            Some((Err(item), None))
        }
    });
    Ok(head.chain(rest).boxed())
}
