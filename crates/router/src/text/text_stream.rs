//! From the generator's token stream to text events: detokenize, match stop strings, enforce
//! `max_tokens`, record metrics. Both the streamed and the non-streamed answers are built from
//! these events, so they carry the same text by construction.
//!
//! When a stop string matches (or the generation otherwise ends), the token stream is dropped
//! at once, which cancels the generation on every leg. The [`TextStream`] is the only owner of
//! the token stream: dropping it (the client went away) cancels too.

use crate::error::ApiError;
use crate::generator::TokenStream;
use crate::metrics::RequestRecord;
use crate::openai::protocol::StopReason;
use crate::text::detokenizer::Detokenizer;
use crate::text::stop_strings::StopMatcher;
use futures::StreamExt;
use std::collections::VecDeque;
use tandem_core::{FinishReason, TokenLogprobs};

/// What a client sees of a generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextEvent {
    /// New text (never empty, never a broken character, never part of a stop string).
    Delta(String),
    /// The end; no event follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// The stop string or stop token that ended it.
        stop_reason: Option<StopReason>,
        /// Tokens generated, the last one included.
        completion_tokens: u32,
    },
}

/// A generation in progress, as text. See the module docs.
pub(crate) struct TextStream {
    tokens: Option<TokenStream>,
    detokenizer: Detokenizer,
    stop: StopMatcher,
    max_tokens: u32,
    completion_tokens: u32,
    queued: VecDeque<TextEvent>,
    record: RequestRecord,
    /// Log-probabilities of the tokens since the last [`TextStream::take_logprobs`].
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// Those of prompt tokens 2.., when the request asked for them (with the first token).
    prompt_logprobs: Vec<TokenLogprobs>,
    /// The request's stop token ids (EOS aside), and the last token generated.
    stop_token_ids: Vec<u32>,
    last_token: Option<u32>,
    /// End the text with the stop string that matched.
    include_stop_str: bool,
}

impl TextStream {
    /// Wraps the generator's `tokens`, decoded by `detokenizer` (set up with the prompt);
    /// `record` receives per-token timings and the outcome.
    pub(crate) fn new(
        tokens: TokenStream,
        detokenizer: Detokenizer,
        stop: Vec<String>,
        stop_token_ids: Vec<u32>,
        max_tokens: u32,
        record: RequestRecord,
    ) -> Self {
        Self {
            tokens: Some(tokens),
            detokenizer,
            stop: StopMatcher::new(stop),
            max_tokens,
            completion_tokens: 0,
            queued: VecDeque::new(),
            record,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            stop_token_ids,
            last_token: None,
            include_stop_str: false,
        }
    }

    /// Ends the text with the stop string that matched (vLLM's `include_stop_str_in_output`).
    pub(crate) fn include_stop_str(mut self, include: bool) -> Self {
        self.include_stop_str = include;
        self
    }

    /// The next event; `None` after `Finished` or an error.
    pub(crate) async fn next(&mut self) -> Option<Result<TextEvent, ApiError>> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(Ok(event));
            }
            let tokens = self.tokens.as_mut()?;
            let token = match tokens.next().await {
                Some(Ok(token)) => token,
                Some(Err(err)) => return Some(Err(self.fail(err.into()))),
                None if self.completion_tokens >= self.max_tokens => {
                    // Tolerate a generator that ends at the limit without saying so.
                    match self.end(FinishReason::Length, String::new()) {
                        Ok(()) => continue,
                        Err(err) => return Some(Err(err)),
                    }
                }
                None => {
                    return Some(Err(self.fail(ApiError::internal(
                        "the generator's stream ended without a finish reason",
                    ))))
                }
            };
            self.completion_tokens += 1;
            self.last_token = Some(token.token_id);
            self.record.token();
            if let Some(lp) = token.logprobs {
                self.logprobs.push((token.token_id, lp));
            }
            if !token.prompt_logprobs.is_empty() {
                self.prompt_logprobs = token.prompt_logprobs;
            }
            let delta = match self.detokenizer.push(token.token_id) {
                Ok(delta) => delta,
                Err(err) => {
                    return Some(Err(self.fail(ApiError::internal(format!(
                        "cannot decode token {}: {err}",
                        token.token_id
                    )))))
                }
            };
            let pushed = self.stop.push(&delta);
            let reason = if pushed.stopped {
                Some(FinishReason::Stop)
            } else if token.finish_reason.is_some() {
                token.finish_reason
            } else if self.completion_tokens >= self.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    if let Err(err) = self.end(reason, pushed.text) {
                        return Some(Err(err));
                    }
                }
                None if pushed.text.is_empty() => {}
                None => return Some(Ok(TextEvent::Delta(pushed.text))),
            }
        }
    }

    /// Ends the generation: drops the token stream (cancelling it), flushes held-back text,
    /// queues the final events and records success.
    fn end(&mut self, mut reason: FinishReason, mut text: String) -> Result<(), ApiError> {
        self.tokens = None;
        if !self.stop.is_stopped() {
            let tail = self.detokenizer.finish().map_err(|err| {
                self.fail(ApiError::internal(format!("cannot decode the tail: {err}")))
            })?;
            let pushed = self.stop.push(&tail);
            text.push_str(&pushed.text);
            if pushed.stopped {
                reason = FinishReason::Stop;
            } else {
                text.push_str(&self.stop.finish());
            }
        }
        if self.include_stop_str {
            if let Some(s) = self.stop.matched() {
                text.push_str(s);
            }
        }
        if !text.is_empty() {
            self.queued.push_back(TextEvent::Delta(text));
        }
        let stop_reason = match (self.stop.matched(), self.last_token) {
            (Some(s), _) => Some(StopReason::Text(s.to_owned())),
            (None, Some(t)) if reason == FinishReason::Stop && self.stop_token_ids.contains(&t) => {
                Some(StopReason::Token(t))
            }
            _ => None,
        };
        self.queued.push_back(TextEvent::Finished {
            reason,
            stop_reason,
            completion_tokens: self.completion_tokens,
        });
        self.record.succeeded(reason);
        Ok(())
    }

    /// The tokens (with their log-probabilities) that arrived since the last call: those
    /// behind the text returned so far, and at the end every remaining one.
    pub(crate) fn take_logprobs(&mut self) -> Vec<(u32, TokenLogprobs)> {
        std::mem::take(&mut self.logprobs)
    }

    /// The log-probabilities of prompt tokens 2.. (`prompt_logprobs`), once the first token
    /// came; empty before, after the first take, or when not asked for.
    pub(crate) fn take_prompt_logprobs(&mut self) -> Vec<TokenLogprobs> {
        std::mem::take(&mut self.prompt_logprobs)
    }

    /// Records `err` as the outcome and stops.
    fn fail(&mut self, err: ApiError) -> ApiError {
        self.tokens = None;
        self.queued.clear();
        self.record.failed(&err);
        err
    }
}
