//! How the answers of one request look: ids, object names, usage, log-probabilities, echoed
//! prompts and tool calls, as whole JSON documents or as stream chunks.

use super::{Whole, SYSTEM_FINGERPRINT};
use crate::metrics::Endpoint;
use crate::openai::protocol::unix_now;
use crate::openai::protocol::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, ChoiceFinishReason, Completion,
    CompletionChoice, CompletionLogprobs, StopReason, Usage,
};
use crate::openai::tools::{CallReader, Piece, ToolMode};
use crate::state::RouterState;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use std::sync::Arc;
use tandem_core::{FinishReason, TokenLogprobs};

/// How answers of one request look: ids, object names, usage, log-probabilities.
pub(super) struct Shape {
    pub(super) endpoint: Endpoint,
    /// The choice this shape renders (batched prompts: one per prompt).
    pub(super) index: u32,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) include_usage: bool,
    pub(super) prompt_tokens: u32,
    /// Set when the request asked for log-probabilities: renders their tokens.
    pub(super) logprobs: Option<Arc<tokenizers::Tokenizer>>,
    /// Completions: characters of generated text before the next token reported.
    pub(super) text_offset: std::cell::Cell<u32>,
    /// Chat with tools: reads calls out of the text.
    pub(super) calls: std::cell::RefCell<Option<CallReader>>,
    /// Log-probabilities of tokens whose text the call reader still holds (they go out with
    /// the next chunk).
    pub(super) held_logprobs: std::cell::RefCell<Vec<(u32, TokenLogprobs)>>,
    /// Completions with `echo`: the prompt text, not sent yet.
    pub(super) echo: std::cell::RefCell<Option<String>>,
    /// Completions with `echo` and `logprobs`: the prompt's token ids.
    pub(super) echo_ids: Vec<u32>,
}

/// A reported log-probability (JSON has no infinities; vLLM's floor).
fn finite(lp: f32) -> f32 {
    lp.max(-9999.0)
}

impl Shape {
    /// The shape of choice `index` of `request` (answer id `id`).
    pub(super) fn new(
        state: &RouterState,
        endpoint: Endpoint,
        request: &crate::generator::ValidGenerateRequest,
        include_usage: bool,
        id: String,
        index: u32,
    ) -> Self {
        Self {
            index,
            prompt_tokens: u32::try_from(request.prompt_token_ids.len()).unwrap_or(u32::MAX),
            logprobs: request
                .sampling
                .logprobs
                .is_some()
                .then(|| state.model().tokenizer().clone()),
            echo_ids: match request.sampling.prompt_logprobs {
                Some(_) => request.prompt_token_ids.clone(),
                None => Vec::new(),
            },
            ..Self::new_bare(state, endpoint, include_usage, id)
        }
    }

    /// A shape with no prompt and no log-probabilities (for answer-wide chunks).
    pub(super) fn new_bare(
        state: &RouterState,
        endpoint: Endpoint,
        include_usage: bool,
        id: String,
    ) -> Self {
        Self {
            endpoint,
            index: 0,
            id,
            created: unix_now(),
            model: state.served_name().to_owned(),
            include_usage,
            prompt_tokens: 0,
            logprobs: None,
            text_offset: std::cell::Cell::new(0),
            calls: std::cell::RefCell::new(None),
            held_logprobs: std::cell::RefCell::new(Vec::new()),
            echo: std::cell::RefCell::new(None),
            echo_ids: Vec::new(),
        }
    }

    /// Puts `prompt` before the generated text (completions with `echo`).
    pub(super) fn echoing(self, prompt: Option<String>) -> Self {
        *self.echo.borrow_mut() = prompt;
        self
    }

    /// Reads tool calls out of the text in `mode` (chat with tools).
    pub(super) fn reading_calls(self, mode: Option<ToolMode>) -> Self {
        *self.calls.borrow_mut() = mode.map(CallReader::new);
        self
    }

    /// The chat finish reason: `tool_calls` when the text ended in calls the model chose to
    /// make (not a named function, which OpenAI ends with `stop`).
    pub(super) fn chat_finish(&self, reason: FinishReason) -> ChoiceFinishReason {
        let called = self
            .calls
            .borrow()
            .as_ref()
            .is_some_and(|r| r.called() && !r.named());
        match reason {
            FinishReason::Stop if called => ChoiceFinishReason::ToolCalls,
            other => other.into(),
        }
    }

    pub(super) fn chat_choice(&self, w: Whole) -> ChatChoice {
        let (content, tool_calls) = match self.calls.borrow_mut().as_mut() {
            None => (Some(w.text), None),
            Some(reader) => {
                let mut pieces = reader.push(&w.text);
                pieces.extend(reader.finish());
                let (content, calls) = crate::openai::tools::gather(pieces);
                (content, Some(calls).filter(|c| !c.is_empty()))
            }
        };
        ChatChoice {
            index: self.index,
            message: AssistantMessage {
                role: "assistant",
                content,
                tool_calls,
            },
            logprobs: self.chat_logprobs(&w.logprobs),
            finish_reason: self.chat_finish(w.reason),
            stop_reason: w.stop_reason,
        }
    }

    pub(super) fn completion_choice(&self, w: Whole) -> CompletionChoice {
        let (text, logprobs) = match self.echo.borrow_mut().take() {
            Some(prompt) => {
                // The prompt's entries first: their offsets come before the answer's.
                let echoed = self.echo_logprobs(&w.prompt_logprobs);
                let answer = self.completion_logprobs(&w.logprobs);
                let logprobs = match (echoed, answer) {
                    (Some(mut echoed), Some(answer)) => {
                        echoed.append(answer);
                        Some(echoed)
                    }
                    (echoed, answer) => echoed.or(answer),
                };
                (prompt + &w.text, logprobs)
            }
            None => (w.text, self.completion_logprobs(&w.logprobs)),
        };
        CompletionChoice {
            index: self.index,
            text,
            logprobs,
            finish_reason: Some(w.reason.into()),
            stop_reason: w.stop_reason,
        }
    }

    pub(super) fn token_text(tokenizer: &tokenizers::Tokenizer, id: u32) -> String {
        tokenizer.decode(&[id], false).unwrap_or_default()
    }

    pub(super) fn chat_logprobs(&self, entries: &[(u32, TokenLogprobs)]) -> Option<ChatLogprobs> {
        let tk = self.logprobs.as_ref()?;
        let content = entries
            .iter()
            .map(|(id, lp)| {
                let token = Self::token_text(tk, *id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: finite(lp.logprob),
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|&(t, l)| {
                            let token = Self::token_text(tk, t);
                            ChatTopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob: finite(l),
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        Some(ChatLogprobs { content })
    }

    pub(super) fn completion_logprobs(
        &self,
        entries: &[(u32, TokenLogprobs)],
    ) -> Option<CompletionLogprobs> {
        let tk = self.logprobs.as_ref()?;
        let mut out = CompletionLogprobs::default();
        for (id, lp) in entries {
            self.push_completion_logprob(tk, &mut out, *id, Some(lp));
        }
        Some(out)
    }

    /// The echoed prompt's entries (`echo` with `logprobs`): its first token has none
    /// (`null`), the others `scored` (prompt tokens 2..).
    pub(super) fn echo_logprobs(&self, scored: &[TokenLogprobs]) -> Option<CompletionLogprobs> {
        let tk = self.logprobs.as_ref()?;
        if self.echo_ids.is_empty() {
            return None;
        }
        let mut out = CompletionLogprobs::default();
        for (i, &id) in self.echo_ids.iter().enumerate() {
            let lp = i.checked_sub(1).and_then(|j| scored.get(j));
            self.push_completion_logprob(tk, &mut out, id, lp);
        }
        Some(out)
    }

    /// Appends token `id` (log-probabilities `lp`, `null` without) at the next text offset.
    pub(super) fn push_completion_logprob(
        &self,
        tk: &tokenizers::Tokenizer,
        out: &mut CompletionLogprobs,
        id: u32,
        lp: Option<&TokenLogprobs>,
    ) {
        let token = Self::token_text(tk, id);
        let at = self.text_offset.get();
        self.text_offset
            .set(at + u32::try_from(token.chars().count()).unwrap_or(0));
        out.text_offset.push(at);
        out.tokens.push(token);
        out.token_logprobs.push(lp.map(|lp| finite(lp.logprob)));
        out.top_logprobs.push(lp.map(|lp| {
            lp.top
                .iter()
                .map(|&(t, l)| (Self::token_text(tk, t), finite(l)))
                .collect()
        }));
    }

    pub(super) fn whole(&self, w: Whole) -> Response {
        let usage = Usage::new(self.prompt_tokens, w.completion_tokens);
        match self.endpoint {
            Endpoint::ChatCompletions => Json(ChatCompletion {
                id: self.id.clone(),
                object: "chat.completion",
                created: self.created,
                model: self.model.clone(),
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: vec![self.chat_choice(w)],
                usage,
            })
            .into_response(),
            Endpoint::Completions => Json(Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: vec![self.completion_choice(w)],
                usage: Some(Some(usage)),
            })
            .into_response(),
        }
    }

    /// What a stream opens with: chat's `{"role": "assistant"}` chunk; a completion's
    /// echoed prompt (with its tokens' log-probabilities, `scored` being prompt tokens 2..,
    /// when asked for).
    pub(super) fn opening_chunks(&self, scored: &[TokenLogprobs]) -> Vec<Event> {
        match self.endpoint {
            Endpoint::ChatCompletions => {
                let delta = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                };
                vec![self.chunk(delta, &[], None, None)]
            }
            Endpoint::Completions => match self.echo.borrow_mut().take() {
                Some(prompt) => vec![self.completion_chunk(
                    vec![CompletionChoice {
                        index: self.index,
                        text: prompt,
                        logprobs: self.echo_logprobs(scored),
                        finish_reason: None,
                        stop_reason: None,
                    }],
                    self.include_usage.then_some(None),
                )],
                None => Vec::new(),
            },
        }
    }

    /// The chunks of more generated text (with the log-probabilities of its tokens): one
    /// content chunk, or, reading tool calls, whatever content and call parts it completes
    /// (maybe none yet).
    pub(super) fn delta_chunks(
        &self,
        text: String,
        logprobs: Vec<(u32, TokenLogprobs)>,
    ) -> Vec<Event> {
        let pieces = match self.calls.borrow_mut().as_mut() {
            None => vec![Piece::Content(text)],
            Some(reader) => reader.push(&text),
        };
        self.piece_chunks(pieces, logprobs)
    }

    /// The last chunks: what the call reader still held, then the finish chunk.
    pub(super) fn finish_chunks(
        &self,
        reason: FinishReason,
        stop_reason: Option<StopReason>,
        logprobs: Vec<(u32, TokenLogprobs)>,
    ) -> Vec<Event> {
        let rest = match self.calls.borrow_mut().as_mut() {
            None => Vec::new(),
            Some(reader) => reader.finish(),
        };
        let mut events = self.piece_chunks(rest, Vec::new());
        let mut held = std::mem::take(&mut *self.held_logprobs.borrow_mut());
        held.extend(logprobs);
        let finish = match self.endpoint {
            Endpoint::ChatCompletions => self.chat_finish(reason),
            Endpoint::Completions => reason.into(),
        };
        events.push(self.chunk(ChatDelta::default(), &held, Some(finish), stop_reason));
        events
    }

    /// One chunk per piece; the log-probabilities (and any held back) go with the first.
    pub(super) fn piece_chunks(
        &self,
        pieces: Vec<Piece>,
        logprobs: Vec<(u32, TokenLogprobs)>,
    ) -> Vec<Event> {
        let mut held = self.held_logprobs.borrow_mut();
        held.extend(logprobs);
        if pieces.is_empty() {
            return Vec::new();
        }
        let logprobs = std::mem::take(&mut *held);
        pieces
            .into_iter()
            .enumerate()
            .map(|(i, piece)| {
                let delta = match piece {
                    Piece::Content(text) => ChatDelta {
                        content: Some(text),
                        ..ChatDelta::default()
                    },
                    Piece::Call(call) => ChatDelta {
                        tool_calls: Some(vec![call]),
                        ..ChatDelta::default()
                    },
                };
                let lp: &[(u32, TokenLogprobs)] = if i == 0 { &logprobs } else { &[] };
                self.chunk(delta, lp, None, None)
            })
            .collect()
    }

    /// A content chunk; `delta.content` becomes `text` for completions. Carries the
    /// log-probabilities of the tokens that arrived with it (none on the role chunk).
    pub(super) fn chunk(
        &self,
        delta: ChatDelta,
        logprobs: &[(u32, TokenLogprobs)],
        finish_reason: Option<ChoiceFinishReason>,
        stop_reason: Option<StopReason>,
    ) -> Event {
        let some = |l: &[(u32, TokenLogprobs)]| !l.is_empty();
        let usage = self.include_usage.then_some(None);
        match self.endpoint {
            Endpoint::ChatCompletions => json_event(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: vec![ChatChunkChoice {
                    index: self.index,
                    delta,
                    logprobs: self.chat_logprobs(logprobs).filter(|_| some(logprobs)),
                    finish_reason,
                    stop_reason,
                }],
                usage,
            }),
            Endpoint::Completions => self.completion_chunk(
                vec![CompletionChoice {
                    index: self.index,
                    text: delta.content.unwrap_or_default(),
                    logprobs: self
                        .completion_logprobs(logprobs)
                        .filter(|_| some(logprobs)),
                    finish_reason,
                    stop_reason,
                }],
                usage,
            ),
        }
    }

    /// A completions stream's chunk of `choices` with `usage` (`Some(None)`: `null`).
    pub(super) fn completion_chunk(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Option<Usage>>,
    ) -> Event {
        json_event(&Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        })
    }

    /// The final `usage` chunk (`choices: []`).
    pub(super) fn usage_chunk(&self, completion_tokens: u32) -> Event {
        let usage = Some(Some(Usage::new(self.prompt_tokens, completion_tokens)));
        match self.endpoint {
            Endpoint::ChatCompletions => json_event(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices: Vec::new(),
                usage,
            }),
            Endpoint::Completions => self.completion_chunk(Vec::new(), usage),
        }
    }
}

pub(super) fn json_event<T: Serialize>(value: &T) -> Event {
    let data = serde_json::to_string(value).unwrap_or_else(|err| {
        serde_json::json!({"error": {"message": format!("cannot serialize chunk: {err}"),
            "type": "server_error", "param": null, "code": "internal"}})
        .to_string()
    });
    Event::default().data(data)
}
