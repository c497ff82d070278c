//! One attempt of a request on its workers: a P/D pair (reserve on the decode worker,
//! prefill with its KV target, stream the rest) or an aggregated worker. Each resolves with
//! the first token, so a failure before it can still be retried elsewhere, and enters each
//! phase of the in-flight table's handoff where the workers' answers show it (the failure
//! itself is recorded by the caller, which classifies it).

use crate::generator::{GenerateError, GeneratedToken, TokenStream, ValidGenerateRequest};
use crate::pd::inflight::{AttemptTracker, Phase};
use crate::pd::workers::{classify_status, WorkerHandle};
use futures::StreamExt;
use tandem_core::{ErrorClass, TokenLogprobs};
use tandem_proto::convert::finish_from_wire;
use tandem_proto::v1 as pb;

/// `req` on the wire, asking for `choices` choices of its prompt (seeds `seed`, `seed + 1`, …).
pub(crate) fn to_pb(req: &ValidGenerateRequest, choices: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: req.id.0.clone(),
        prompt_token_ids: req.prompt_token_ids.clone(),
        choices,
        sampling: Some(pb::SamplingParams::from(&req.sampling)),
    }
}

fn token_from_pb(t: pb::TokenEvent) -> GeneratedToken {
    GeneratedToken {
        token_id: t.token_id,
        finish_reason: finish_from_wire(t.finish_reason),
        logprobs: t.logprobs.map(TokenLogprobs::from),
        prompt_logprobs: t
            .prompt_logprobs
            .into_iter()
            .map(TokenLogprobs::from)
            .collect(),
    }
}

/// Tokens of a worker's stream with the choice each belongs to.
type ChoiceEvents = futures::stream::BoxStream<'static, Result<pb::TokenEvent, GenerateError>>;

/// Splits a worker's stream of `open.len()` choices' tokens into one stream per choice (in
/// order), on a task of its own that holds `hold` (the stream's load claims) until every
/// choice has ended or been dropped. Choices not `open` (they ended with their first
/// token) get nothing; a stream that fails or ends early fails every choice still open.
/// A single choice needs no task: its stream reads the worker's directly.
fn split_choices(
    mut events: ChoiceEvents,
    mut open: Vec<bool>,
    ended: impl Fn() -> GenerateError + Send + 'static,
    hold: impl Send + 'static,
) -> Vec<TokenStream> {
    if open == [true] {
        return vec![one_choice(events, ended, hold)];
    }
    let (txs, rxs): (Vec<_>, Vec<_>) = open
        .iter()
        .map(|_| tokio::sync::mpsc::unbounded_channel())
        .unzip();
    tokio::spawn(async move {
        let _hold = hold;
        let fail_open = |open: &[bool], e: &GenerateError| {
            for (tx, _) in txs.iter().zip(open).filter(|(_, &o)| o) {
                let _ = tx.send(Err(GenerateError::new(e.class, e.message.clone())));
            }
        };
        loop {
            for (o, tx) in open.iter_mut().zip(&txs) {
                *o &= !tx.is_closed();
            }
            if !open.contains(&true) {
                return;
            }
            let gone = futures::future::join_all(
                txs.iter()
                    .zip(&open)
                    .filter(|(_, &o)| o)
                    .map(|(tx, _)| tx.closed()),
            );
            let next = tokio::select! {
                n = events.next() => n,
                _ = gone => return,
            };
            match next {
                Some(Ok(t)) => {
                    let c = t.choice as usize;
                    let tok = token_from_pb(t);
                    match open.get_mut(c) {
                        Some(o) if *o => {
                            *o = tok.finish_reason.is_none();
                            let _ = txs[c].send(Ok(tok));
                        }
                        Some(_) => {} // a choice that ended with its first token
                        None => {
                            let e = GenerateError::new(
                                ErrorClass::Internal,
                                format!("a token of choice {c} of {}", open.len()),
                            );
                            return fail_open(&open, &e);
                        }
                    }
                }
                Some(Err(e)) => return fail_open(&open, &e),
                None => return fail_open(&open, &ended()),
            }
        }
    });
    rxs.into_iter()
        .map(|rx| tokio_stream::wrappers::UnboundedReceiverStream::new(rx).boxed())
        .collect()
}

/// [`split_choices`] of a stream of one choice: its tokens until the last, then the end;
/// `hold` and the worker's stream are dropped with it (or when it ends).
fn one_choice(
    events: ChoiceEvents,
    ended: impl Fn() -> GenerateError + Send + 'static,
    hold: impl Send + 'static,
) -> TokenStream {
    futures::stream::unfold(Some((events, ended, hold)), |state| async move {
        let (mut events, ended, hold) = state?;
        let item = match events.next().await {
            Some(Ok(t)) if t.choice == 0 => {
                let tok = token_from_pb(t);
                if tok.finish_reason.is_none() {
                    return Some((Ok(tok), Some((events, ended, hold))));
                }
                Ok(tok)
            }
            Some(Ok(t)) => Err(GenerateError::new(
                ErrorClass::Internal,
                format!("a token of choice {} of 1", t.choice),
            )),
            Some(Err(e)) => Err(e),
            None => Err(ended()),
        };
        Some((item, None))
    })
    .boxed()
}

/// A whole request's `n` choices on one aggregated worker: resolves with every choice's
/// first token (so a failure before them can still be retried elsewhere), then streams the
/// rest, one stream per choice.
pub(crate) async fn try_aggregated(
    w: &WorkerHandle,
    req: &ValidGenerateRequest,
    n: u32,
    budget: Budget,
    attempt: &AttemptTracker,
) -> Result<Vec<TokenStream>, GenerateError> {
    let claim = w.claim();
    attempt.enter(Phase::Prefilling);
    let events = w
        .client
        .clone()
        .generate(with_deadline(to_pb(req, n), budget.request))
        .await
        .map_err(classify_status)?
        .into_inner();
    let id = w.id.clone();
    let ended = move || {
        GenerateError::new(
            ErrorClass::Unavailable,
            format!("worker {id} ended the stream before finishing"),
        )
    };
    let events = events.map(|m| m.map_err(classify_status)).boxed();
    let mut streams = split_choices(events, vec![true; n.max(1) as usize], ended, claim);
    // Every choice's first token, before the attempt counts as started.
    let mut firsts = Vec::with_capacity(streams.len());
    for s in &mut streams {
        match s.next().await {
            Some(Ok(t)) => firsts.push(t),
            Some(Err(e)) => return Err(e),
            None => {
                return Err(GenerateError::new(
                    ErrorClass::Unavailable,
                    format!("worker {} ended the stream before a first token", w.id),
                ))
            }
        }
    }
    attempt.enter(Phase::Decoding);
    Ok(streams
        .into_iter()
        .zip(firsts)
        .map(|(rest, first)| {
            let ends = first.finish_reason.is_some();
            let head = futures::stream::once(async move { Ok(first) });
            if ends {
                head.boxed()
            } else {
                head.chain(rest).boxed()
            }
        })
        .collect())
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

impl Leg {
    /// Every leg's name (metric label values).
    pub(crate) const NAMES: [&'static str; 3] = ["prefill", "decode", "both"];

    /// The leg's name, as the `tandem_handoff_failures_total` label shows it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
            Leg::Both => "both",
        }
    }
}

/// A request's `n` choices on a P/D pair: resolves with every choice's first token (the
/// prefill's answer), then streams the rest from the decode worker, one stream per choice.
pub(crate) async fn try_pair(
    p: &WorkerHandle,
    d: &WorkerHandle,
    req: &ValidGenerateRequest,
    n: u32,
    budget: Budget,
    attempt: &AttemptTracker,
) -> Result<Vec<TokenStream>, (Leg, GenerateError)> {
    let on_decode = |e: GenerateError| (Leg::Decode, e);
    let request = to_pb(req, n);
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
    attempt.enter(Phase::DecodeReserved);
    let mut prefill_client = p.client.clone();
    let prefill_call = prefill_client.prefill(with_deadline(
        pb::PrefillRequest {
            request: Some(request),
            kv_target: Some(target),
        },
        budget.first_token,
    ));
    attempt.enter(Phase::Prefilling);
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
    // The prompt's log-probabilities (when asked for) are every choice's.
    let prompt_logprobs: Vec<_> = first
        .prompt_logprobs
        .into_iter()
        .map(TokenLogprobs::from)
        .collect();
    let firsts: Vec<GeneratedToken> = std::iter::once(GeneratedToken {
        token_id: first.first_token_id,
        finish_reason: finish_from_wire(first.finish_reason),
        logprobs: first.first_logprobs.map(TokenLogprobs::from),
        prompt_logprobs: Vec::new(),
    })
    .chain(first.other_choices.into_iter().map(token_from_pb))
    .map(|t| GeneratedToken {
        prompt_logprobs: prompt_logprobs.clone(),
        ..t
    })
    .collect();
    if firsts.len() != n.max(1) as usize {
        return Err((
            Leg::Prefill,
            GenerateError::new(
                ErrorClass::Internal,
                format!(
                    "prefill worker {} answered {} first tokens for {n} choices",
                    p.id,
                    firsts.len()
                ),
            ),
        ));
    }
    let open: Vec<bool> = firsts.iter().map(|t| t.finish_reason.is_none()).collect();
    let heads = firsts
        .into_iter()
        .map(|first| futures::stream::once(async move { Ok(first) }).boxed());
    if !open.contains(&true) {
        // Every choice ended with its first token: no KV was sent, and dropping `decode`
        // here cancels the reservation on the decode worker.
        return Ok(heads.collect());
    }
    // The prefill worker pushed the KV before answering.
    attempt.enter(Phase::KvReady);
    // A token that arrived during the prefill, then the rest of the stream; the first of
    // them starts the decoding phase.
    let early = futures::stream::iter(early.flatten().map(Ok::<_, tonic::Status>));
    let mut decoding = Some(attempt.clone());
    let rest = early
        .chain(decode)
        .map(move |m| match m {
            Ok(pb::DecodeEvent {
                event: Some(pb::decode_event::Event::Token(t)),
            }) => {
                if let Some(a) = decoding.take() {
                    a.enter(Phase::Decoding);
                }
                Ok(t)
            }
            Ok(other) => Err(GenerateError::new(
                ErrorClass::Internal,
                format!("unexpected decode event {other:?}"),
            )),
            Err(s) => Err(classify_status(s)),
        })
        .boxed();
    let decode_id = d.id.clone();
    let ended = move || {
        GenerateError::new(
            ErrorClass::Unavailable,
            format!("decode worker {decode_id} ended the stream before finishing"),
        )
    };
    // The DP slot rides along with the streams: released when every choice has ended.
    let rests = split_choices(rest, open.clone(), ended, dp_slot);
    Ok(heads
        .zip(rests)
        .zip(open)
        .map(|((head, rest), open)| if open { head.chain(rest).boxed() } else { head })
        .collect())
}
