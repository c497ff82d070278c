//! `POST /v1/chat/completions` and `POST /v1/completions`: parse, validate, generate, answer
//! as one JSON document or as server-sent events.
//!
//! A streamed answer only commits to `200 OK` once the first text (or the end) is known, so
//! a request that fails before any token reaches the client still gets a JSON error with the
//! status of its class. After that, a failure is sent in-band as `data: {"error": …}` and the
//! stream ends without `[DONE]`.

use crate::detokenizer::Detokenizer;
use crate::error::ApiError;
use crate::metrics::Endpoint;
use crate::protocol::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
    Completion, CompletionChoice, Usage,
};
use crate::server::{unix_now, RouterState};
use crate::text_stream::{TextEvent, TextStream};
use crate::validation::{self, Prepared};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{stream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use tandem_core::{FinishReason, RequestId};

/// `POST /v1/chat/completions`
pub(crate) async fn chat_completions(
    State(state): State<RouterState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Endpoint::ChatCompletions, body).await
}

/// `POST /v1/completions`
pub(crate) async fn completions(
    State(state): State<RouterState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(state, Endpoint::Completions, body).await
}

async fn handle(
    state: RouterState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut record = state.metrics().start(endpoint);
    let prepared = match prepare(&state, endpoint, body).await {
        Ok(prepared) => prepared,
        Err(err) => {
            record.failed(&err);
            return err.into_response();
        }
    };
    record.admitted(prepared.request.prompt_token_ids.len());
    let Prepared {
        request,
        stop,
        stream,
        include_usage,
    } = prepared;
    let shape = Shape {
        endpoint,
        id: request.id.0.clone(),
        created: unix_now(),
        model: state.served_name().to_owned(),
        include_usage,
        prompt_tokens: u32::try_from(request.prompt_token_ids.len()).unwrap_or(u32::MAX),
    };
    let detokenizer =
        Detokenizer::new(state.model().tokenizer().clone(), &request.prompt_token_ids);
    let max_tokens = request.sampling.max_tokens;
    let tokens = match state.generator().generate(request).await {
        Ok(tokens) => tokens,
        Err(err) => {
            let err = ApiError::from(err);
            record.failed(&err);
            return err.into_response();
        }
    };
    let text = TextStream::new(tokens, detokenizer, stop, max_tokens, record);
    if stream {
        respond_streamed(text, shape).await
    } else {
        respond_whole(text, shape).await
    }
}

/// Parses and validates off the async runtime (templating and tokenizing a long prompt is
/// CPU work).
async fn prepare(
    state: &RouterState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Prepared, ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(rejection.body_text())
        } else {
            ApiError::invalid(rejection.body_text(), None)
        }
    })?;
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let model = state.model();
        let name = state.served_name();
        match endpoint {
            Endpoint::ChatCompletions => {
                let request = parse_json(&body)?;
                validation::prepare_chat(model, name, new_id("chatcmpl"), request)
            }
            Endpoint::Completions => {
                let request = parse_json(&body)?;
                validation::prepare_completion(model, name, new_id("cmpl"), request)
            }
        }
    })
    .await
    .map_err(|err| ApiError::internal(format!("request preparation panicked: {err}")))?
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|err| {
        let what = if err.is_data() {
            "invalid request body"
        } else {
            "malformed JSON in request body"
        };
        ApiError::invalid(format!("{what}: {err}"), None)
    })
}

fn new_id(prefix: &str) -> RequestId {
    RequestId(format!("{prefix}-{:032x}", rand::random::<u128>()))
}

async fn respond_whole(mut text: TextStream, shape: Shape) -> Response {
    let mut content = String::new();
    loop {
        match text.next().await {
            Some(Ok(TextEvent::Delta(delta))) => content.push_str(&delta),
            Some(Ok(TextEvent::Finished {
                reason,
                completion_tokens,
            })) => return shape.whole(content, reason, completion_tokens),
            Some(Err(err)) => return err.into_response(),
            None => return ApiError::internal("generation ended without a result").into_response(),
        }
    }
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
            self.started = true;
            events.extend(self.shape.role_chunk());
        }
        let next = match self.first.take() {
            Some(event) => Some(Ok(event)),
            None => self.text.next().await,
        };
        match next {
            Some(Ok(TextEvent::Delta(delta))) => events.push(self.shape.delta_chunk(delta)),
            Some(Ok(TextEvent::Finished {
                reason,
                completion_tokens,
            })) => {
                events.push(self.shape.finish_chunk(reason));
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

/// How answers of one request look: ids, object names, usage.
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: u32,
}

impl Shape {
    fn whole(&self, text: String, reason: FinishReason, completion_tokens: u32) -> Response {
        let usage = Usage::new(self.prompt_tokens, completion_tokens);
        match self.endpoint {
            Endpoint::ChatCompletions => Json(ChatCompletion {
                id: self.id.clone(),
                object: "chat.completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: "assistant",
                        content: text,
                    },
                    logprobs: None,
                    finish_reason: reason,
                }],
                usage,
            })
            .into_response(),
            Endpoint::Completions => Json(Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason: Some(reason),
                }],
                usage: Some(Some(usage)),
            })
            .into_response(),
        }
    }

    /// The opening `{"role": "assistant"}` chunk of a chat stream.
    fn role_chunk(&self) -> Option<Event> {
        (self.endpoint == Endpoint::ChatCompletions).then(|| {
            self.chunk(
                ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                None,
            )
        })
    }

    fn delta_chunk(&self, text: String) -> Event {
        self.chunk(
            ChatDelta {
                role: None,
                content: Some(text),
            },
            None,
        )
    }

    fn finish_chunk(&self, reason: FinishReason) -> Event {
        self.chunk(ChatDelta::default(), Some(reason))
    }

    /// A content chunk; `delta.content` becomes `text` for completions.
    fn chunk(&self, delta: ChatDelta, finish_reason: Option<FinishReason>) -> Event {
        let usage = self.include_usage.then_some(None);
        match self.endpoint {
            Endpoint::ChatCompletions => json_event(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta,
                    logprobs: None,
                    finish_reason,
                }],
                usage,
            }),
            Endpoint::Completions => json_event(&Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text: delta.content.unwrap_or_default(),
                    logprobs: None,
                    finish_reason,
                }],
                usage,
            }),
        }
    }

    /// The final `usage` chunk (`choices: []`).
    fn usage_chunk(&self, completion_tokens: u32) -> Event {
        let usage = Some(Some(Usage::new(self.prompt_tokens, completion_tokens)));
        match self.endpoint {
            Endpoint::ChatCompletions => json_event(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage,
            }),
            Endpoint::Completions => json_event(&Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage,
            }),
        }
    }
}

fn json_event<T: Serialize>(value: &T) -> Event {
    let data = serde_json::to_string(value).unwrap_or_else(|err| {
        serde_json::json!({"error": {"message": format!("cannot serialize chunk: {err}"),
            "type": "server_error", "param": null, "code": "internal"}})
        .to_string()
    });
    Event::default().data(data)
}
