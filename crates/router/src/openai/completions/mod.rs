//! `POST /v1/chat/completions` and `POST /v1/completions`: parse, validate, generate, answer
//! as one JSON document or as server-sent events.
//!
//! A streamed answer only commits to `200 OK` once the first text (or the end) is known, so
//! a request that fails before any token reaches the client still gets a JSON error with the
//! status of its class. After that, a failure is sent in-band as `data: {"error": …}` and the
//! stream ends without `[DONE]`.

use crate::admission::Ticket;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::generator::TokenStream;
use crate::metrics::Endpoint;
use crate::openai::protocol::{ChatCompletion, Completion, StopReason, Usage};
use crate::openai::validation::{self, Prepared};
use crate::state::RouterState;
use crate::text::detokenizer::Detokenizer;
use crate::text::text_stream::{TextEvent, TextStream};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::{stream, StreamExt};
use std::convert::Infallible;
use std::sync::Arc;
use tandem_core::{FinishReason, RequestId, TokenLogprobs};

mod response;
use response::{json_event, Shape};

/// `system_fingerprint` of every answer: the server build that produced it.
const SYSTEM_FINGERPRINT: &str = concat!("fp_tandem_", env!("CARGO_PKG_VERSION"));

/// `POST /v1/chat/completions`
pub(crate) async fn chat_completions(
    State(state): State<RouterState>,
    caller: Option<Extension<Caller>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Endpoint::ChatCompletions, caller.map(|c| c.0), body).await
}

/// `POST /v1/completions`
pub(crate) async fn completions(
    State(state): State<RouterState>,
    caller: Option<Extension<Caller>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Endpoint::Completions, caller.map(|c| c.0), body).await
}

async fn handle(
    state: RouterState,
    endpoint: Endpoint,
    caller: Option<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut record = state.metrics().start(endpoint);
    let (base_id, mut batch) = match prepare(&state, endpoint, body).await {
        Ok(prepared) => prepared,
        Err(err) => {
            record.failed(&err);
            return err.into_response();
        }
    };
    // Every prompt of a batch counts; the choices of one prompt share its tokens.
    let prompt_tokens = batch.iter().map(|p| p.request.prompt_token_ids.len()).sum();
    let admission = state.admission();
    let priority = admission.priority(caller.as_ref(), batch[0].priority);
    let ticket = match admission
        .admit(caller.as_ref(), priority, prompt_tokens)
        .await
    {
        Ok(ticket) => Arc::new(ticket),
        Err(err) => {
            record.failed(&err);
            return err.into_response();
        }
    };
    let n = batch[0].choices.max(1);
    if batch.len() > 1 || n > 1 {
        return respond_batch(state, endpoint, record, base_id, batch, ticket).await;
    }
    let prepared = batch.remove(0);
    record.admitted(prepared.request.prompt_token_ids.len());
    let Prepared {
        request,
        stop,
        stream,
        include_usage,
        skip_special_tokens: prepared_skip,
        include_stop_str: prepared_include,
        tools,
        echo,
        ..
    } = prepared;
    let shape = Shape::new(&state, endpoint, &request, include_usage, base_id, 0)
        .reading_calls(tools)
        .echoing(echo);
    let detokenizer =
        Detokenizer::new(state.model().tokenizer().clone(), &request.prompt_token_ids)
            .skip_special_tokens(prepared_skip);
    let max_tokens = request.sampling.max_tokens;
    let request_stop_ids = request.sampling.stop_token_ids.clone();
    let tokens = match state.generator().generate(request).await {
        Ok(tokens) => holding(tokens, ticket),
        Err(err) => {
            let err = ApiError::from(err);
            record.failed(&err);
            return err.into_response();
        }
    };
    let stop_ids = request_stop_ids.clone();
    let text = TextStream::new(tokens, detokenizer, stop, stop_ids, max_tokens, record)
        .include_stop_str(prepared_include);
    if stream {
        respond_streamed(text, shape).await
    } else {
        respond_whole(text, shape).await
    }
}

/// `tokens` keeping the request's admission ticket until the stream ends or is dropped.
fn holding(tokens: TokenStream, ticket: Arc<Ticket>) -> TokenStream {
    tokens
        .map(move |token| {
            let _held = &ticket;
            token
        })
        .boxed()
}

/// Parses and validates off the async runtime (templating and tokenizing a long prompt is
/// CPU work).
async fn prepare(
    state: &RouterState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<(String, Vec<Prepared>), ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(rejection.body_text())
        } else {
            ApiError::invalid(rejection.body_text(), None)
        }
    })?;
    if body.len() <= INLINE_PREPARE_BYTES {
        return prepare_body(state, endpoint, &body);
    }
    let state = state.clone();
    tokio::task::spawn_blocking(move || prepare_body(&state, endpoint, &body))
        .await
        .map_err(|err| ApiError::internal(format!("request preparation panicked: {err}")))?
}

/// Bodies up to this size are parsed, templated and tokenized on the request's own task:
/// that takes tens of microseconds, less than handing the work to the blocking pool (a
/// thread wake-up and two context switches, which dominated the router's own latency at
/// 1,000 req/s). Longer ones go to the blocking pool, off the async workers.
const INLINE_PREPARE_BYTES: usize = 2048;

fn prepare_body(
    state: &RouterState,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(String, Vec<Prepared>), ApiError> {
    let model = state.model();
    let name = state.served_name();
    match endpoint {
        Endpoint::ChatCompletions => {
            let request = validation::parse_body(body)?;
            let id = new_id("chatcmpl");
            let prepared = validation::prepare_chat(model, name, id.clone(), request)?;
            Ok((id.0, vec![prepared]))
        }
        Endpoint::Completions => {
            let request = validation::parse_body(body)?;
            let id = new_id("cmpl");
            let batch = validation::prepare_completion_batch(model, name, id.clone(), request)?;
            Ok((id.0, batch))
        }
    }
}

fn new_id(prefix: &str) -> RequestId {
    RequestId(format!("{prefix}-{:032x}", rand::random::<u128>()))
}

/// A whole generation: its text, token log-probabilities, finish reason and token count.
struct Whole {
    text: String,
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// Prompt tokens 2.. (completions with `echo` and `logprobs`).
    prompt_logprobs: Vec<TokenLogprobs>,
    reason: FinishReason,
    stop_reason: Option<StopReason>,
    completion_tokens: u32,
}

async fn collect(mut text: TextStream) -> Result<Whole, ApiError> {
    let mut content = String::new();
    loop {
        match text.next().await {
            Some(Ok(TextEvent::Delta(delta))) => content.push_str(&delta),
            Some(Ok(TextEvent::Finished {
                reason,
                stop_reason,
                completion_tokens,
            })) => {
                return Ok(Whole {
                    text: content,
                    logprobs: text.take_logprobs(),
                    prompt_logprobs: text.take_prompt_logprobs(),
                    reason,
                    stop_reason,
                    completion_tokens,
                })
            }
            Some(Err(err)) => return Err(err),
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

async fn respond_whole(text: TextStream, shape: Shape) -> Response {
    match collect(text).await {
        Ok(w) => shape.whole(w),
        Err(err) => err.into_response(),
    }
}

/// Several choices: `n` (or `best_of`) > 1 and/or a batch of prompts (`n` choices per prompt,
/// prompt-major). Each prompt's choices start together
/// ([`crate::generator::Generator::generate_choices`]), every prompt at once; one answer with
/// every choice (streamed: chunks of every choice as they come, by `index`, then one usage
/// chunk over all and `[DONE]`); usage counts each prompt once and every generated token
/// (with `best_of`, also those of the choices left out). A choice that cannot start fails the
/// whole request (the others are cancelled).
async fn respond_batch(
    state: RouterState,
    endpoint: Endpoint,
    first_record: crate::metrics::RequestRecord,
    base_id: String,
    batch: Vec<Prepared>,
    ticket: Arc<Ticket>,
) -> Response {
    let (stream, include_usage) = (batch[0].stream, batch[0].include_usage);
    let n = batch[0].choices.max(1);
    let per_prompt = n as usize;
    // `best_of`: the choices are ranked by their tokens' log-probabilities, so the workers
    // report the chosen tokens' (the answer shows them only where the client asked).
    let kept = (batch[0].kept.max(1) as usize).min(per_prompt);
    let ranked = kept < per_prompt;
    let mut records = vec![first_record];
    records.extend((1..batch.len() * per_prompt).map(|_| state.metrics().start(endpoint)));
    let mut records = records.into_iter();
    let starts = batch.into_iter().enumerate().map(|(i, p)| {
        let mut records: Vec<_> = records.by_ref().take(per_prompt).collect();
        let state = state.clone();
        let base_id = base_id.clone();
        let ticket = ticket.clone();
        async move {
            for record in &mut records {
                record.admitted(p.request.prompt_token_ids.len());
            }
            // The prompt's choices start together (on P/D: one prefill for them all).
            let mut request = p.request.clone();
            if ranked {
                request.sampling.logprobs.get_or_insert(0);
            }
            let streams = match state.generator().generate_choices(request, n).await {
                Ok(streams) => streams,
                Err(err) => {
                    let err = ApiError::from(err);
                    for record in &mut records {
                        record.failed(&err);
                    }
                    return Err(err);
                }
            };
            let streams = streams.into_iter().map(|s| holding(s, ticket.clone()));
            let choices = streams.zip(p.expand()).zip(records);
            Ok(choices
                .enumerate()
                .map(|(j, ((tokens, c), record))| {
                    let index = (i * per_prompt + j) as u32;
                    let shape = Shape::new(
                        &state,
                        endpoint,
                        &c.request,
                        include_usage,
                        base_id.clone(),
                        index,
                    )
                    .reading_calls(c.tools.clone())
                    .echoing(c.echo.clone());
                    let detok = Detokenizer::new(
                        state.model().tokenizer().clone(),
                        &c.request.prompt_token_ids,
                    )
                    .skip_special_tokens(c.skip_special_tokens);
                    let max_tokens = c.request.sampling.max_tokens;
                    let stop_ids = c.request.sampling.stop_token_ids.clone();
                    let text = TextStream::new(tokens, detok, c.stop, stop_ids, max_tokens, record)
                        .include_stop_str(c.include_stop_str);
                    (text, shape)
                })
                .collect::<Vec<_>>())
        }
    });
    let mut started = Vec::new();
    for r in futures::future::join_all(starts).await {
        match r {
            Ok(t) => started.extend(t),
            Err(err) => return err.into_response(),
        }
    }
    let prompt_tokens: u32 = started.iter().map(|(_, s)| s.prompt_tokens).sum::<u32>() / n;
    let total = Shape {
        prompt_tokens,
        ..Shape::new_bare(&state, endpoint, include_usage, base_id)
    };
    if !stream {
        let wholes = futures::future::join_all(
            started
                .into_iter()
                .map(|(text, shape)| async move { collect(text).await.map(|w| (shape, w)) }),
        )
        .await;
        let mut done = Vec::new();
        let mut completion_tokens = 0;
        for r in wholes {
            match r {
                Ok((shape, w)) => {
                    completion_tokens += w.completion_tokens;
                    done.push((shape, w));
                }
                Err(err) => return err.into_response(),
            }
        }
        if ranked {
            done = best_of(done, per_prompt, kept);
        }
        let usage = Usage::new(prompt_tokens, completion_tokens);
        return match endpoint {
            Endpoint::ChatCompletions => Json(ChatCompletion {
                id: total.id.clone(),
                object: "chat.completion",
                created: total.created,
                model: total.model.clone(),
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: done
                    .into_iter()
                    .map(|(shape, w)| shape.chat_choice(w))
                    .collect(),
                usage,
            })
            .into_response(),
            Endpoint::Completions => Json(Completion {
                id: total.id.clone(),
                object: "text_completion",
                created: total.created,
                model: total.model.clone(),
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: done
                    .into_iter()
                    .map(|(shape, w)| shape.completion_choice(w))
                    .collect(),
                usage: Some(Some(usage)),
            })
            .into_response(),
        };
    }
    let tokens = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let choices = started.into_iter().map(|(text, shape)| {
        let (tokens, failed) = (tokens.clone(), failed.clone());
        stream::unfold(Some((text, shape, false)), move |st| {
            let (tokens, failed) = (tokens.clone(), failed.clone());
            async move {
                let (mut text, shape, started) = st?;
                let next = text.next().await;
                // A chat choice opens with its own role chunk (an echo, with the prompt's
                // log-probabilities, which come with the first token).
                let mut events: Vec<Event> = if started {
                    Vec::new()
                } else {
                    shape.opening_chunks(&text.take_prompt_logprobs())
                };
                let logprobs = text.take_logprobs();
                let more = match next {
                    Some(Ok(TextEvent::Delta(delta))) => {
                        events.extend(shape.delta_chunks(delta, logprobs));
                        true
                    }
                    Some(Ok(TextEvent::Finished {
                        reason,
                        stop_reason,
                        completion_tokens,
                    })) => {
                        tokens.fetch_add(completion_tokens, std::sync::atomic::Ordering::Relaxed);
                        events.extend(shape.finish_chunks(reason, stop_reason, logprobs));
                        false
                    }
                    Some(Err(err)) => {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                        events.push(json_event(&err.body()));
                        false
                    }
                    None => return None,
                };
                Some((events, more.then_some((text, shape, true))))
            }
        })
        .flat_map(stream::iter)
        .boxed()
    });
    let choices: Vec<_> = choices.collect();
    let tail = stream::once(async move {
        if failed.load(std::sync::atomic::Ordering::Relaxed) {
            return Vec::new();
        }
        let mut events = Vec::new();
        if total.include_usage {
            events.push(total.usage_chunk(tokens.load(std::sync::atomic::Ordering::Relaxed)));
        }
        events.push(Event::default().data("[DONE]"));
        events
    })
    .flat_map(stream::iter);
    let events = stream::select_all(choices)
        .chain(tail)
        .map(Ok::<_, Infallible>);
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `best_of`: of each prompt's `generated` choices (prompt-major, in `done`), the `kept` with
/// the highest mean log-probability of their tokens (ties: the lower index), most likely
/// first, numbered again from 0 across the answer (their log-probabilities shown only where
/// the client asked for them: see [`Shape::new`]).
fn best_of(done: Vec<(Shape, Whole)>, generated: usize, kept: usize) -> Vec<(Shape, Whole)> {
    let mean = |w: &Whole| {
        let sum: f64 = w.logprobs.iter().map(|(_, lp)| f64::from(lp.logprob)).sum();
        sum / w.logprobs.len().max(1) as f64
    };
    let mut out = Vec::with_capacity(done.len() / generated * kept);
    let mut done = done.into_iter().peekable();
    while done.peek().is_some() {
        let mut prompt: Vec<_> = done.by_ref().take(generated).collect();
        prompt.sort_by(|(_, a), (_, b)| mean(b).total_cmp(&mean(a)));
        out.extend(prompt.into_iter().take(kept));
    }
    for (i, (shape, _)) in out.iter_mut().enumerate() {
        shape.index = i as u32;
    }
    out
}

async fn respond_streamed(mut text: TextStream, shape: Shape) -> Response {
    let first = match text.next().await {
        Some(Ok(event)) => event,
        Some(Err(err)) => return err.into_response(),
        None => return ApiError::internal("generation ended without a result").into_response(),
    };
    let driver = SseDriver {
        text,
        shape,
        first: Some(first),
        started: false,
        done: false,
    };
    let events = stream::unfold(driver, SseDriver::step)
        .flat_map(stream::iter)
        .map(Ok::<_, Infallible>);
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Turns text events into SSE events; owns the [`TextStream`], so dropping the response body
/// (client disconnect) drops the generation.
struct SseDriver {
    text: TextStream,
    shape: Shape,
    first: Option<TextEvent>,
    started: bool,
    done: bool,
}

impl SseDriver {
    async fn step(mut self) -> Option<(Vec<Event>, Self)> {
        if self.done {
            return None;
        }
        let mut events = Vec::new();
        if !self.started {
            // The first event is in: the prompt's log-probabilities came with it.
            self.started = true;
            events.extend(self.shape.opening_chunks(&self.text.take_prompt_logprobs()));
        }
        let next = match self.first.take() {
            Some(event) => Some(Ok(event)),
            None => self.text.next().await,
        };
        let logprobs = self.text.take_logprobs();
        match next {
            Some(Ok(TextEvent::Delta(delta))) => {
                events.extend(self.shape.delta_chunks(delta, logprobs));
            }
            Some(Ok(TextEvent::Finished {
                reason,
                stop_reason,
                completion_tokens,
            })) => {
                events.extend(self.shape.finish_chunks(reason, stop_reason, logprobs));
                if self.shape.include_usage {
                    events.push(self.shape.usage_chunk(completion_tokens));
                }
                events.push(Event::default().data("[DONE]"));
                self.done = true;
            }
            Some(Err(err)) => {
                events.push(json_event(&err.body()));
                self.done = true;
            }
            None => self.done = true,
        }
        Some((events, self))
    }
}
