//! [`MemoryGenerator`]: an in-memory [`Generator`] that replays a script of token ids, for
//! tests of the HTTP layer and of anything built on it.

use crate::generator::{
    GenerateError, GenerateFuture, GeneratedToken, Generator, TokenStream, ValidGenerateRequest,
};
use futures::stream;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use tandem_core::{ErrorClass, FinishReason};
use tokio::sync::watch;

/// Replays `script` for every request, like a model that always says the same thing.
///
/// Token `i` of a response is `script[i]`. It carries `Stop` if it is in the request's
/// `stop_token_ids`, in the EOS set ([`Self::with_eos`]; ignored with `ignore_eos`), or is
/// the script's last token; otherwise `Length` once `max_tokens` tokens were sent. With
/// `ignore_eos` the script repeats. Failures and stalls can be injected. It records each
/// request and counts live streams, so tests can check that a stream was dropped.
#[derive(Debug)]
pub struct MemoryGenerator {
    script: Vec<u32>,
    eos: Vec<u32>,
    admit_error: Option<ErrorClass>,
    fail_after: Option<(usize, ErrorClass)>,
    stall_after: Option<usize>,
    requests: Mutex<Vec<ValidGenerateRequest>>,
    live: Arc<watch::Sender<usize>>,
}

impl MemoryGenerator {
    /// A generator answering `script` (must not be empty for a successful response).
    pub fn new(script: Vec<u32>) -> Self {
        Self {
            script,
            eos: Vec::new(),
            admit_error: None,
            fail_after: None,
            stall_after: None,
            requests: Mutex::new(Vec::new()),
            live: Arc::new(watch::Sender::new(0)),
        }
    }

    /// Tokens that end generation with `Stop` unless the request says `ignore_eos`.
    pub fn with_eos(mut self, eos: Vec<u32>) -> Self {
        self.eos = eos;
        self
    }

    /// Refuses every request at admission with `class`.
    pub fn failing_on_admit(mut self, class: ErrorClass) -> Self {
        self.admit_error = Some(class);
        self
    }

    /// Sends `tokens` tokens, then fails the stream with `class`.
    pub fn failing_after(mut self, tokens: usize, class: ErrorClass) -> Self {
        self.fail_after = Some((tokens, class));
        self
    }

    /// Sends `tokens` tokens, then never sends anything again (until dropped).
    pub fn stalling_after(mut self, tokens: usize) -> Self {
        self.stall_after = Some(tokens);
        self
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<ValidGenerateRequest> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Token streams handed out and not dropped yet.
    pub fn live_streams(&self) -> usize {
        *self.live.borrow()
    }

    /// Waits until exactly `count` streams are live.
    pub async fn wait_for_live_streams(&self, count: usize) {
        let mut receiver = self.live.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = receiver.wait_for(|&live| live == count).await;
    }

    fn token_stream(&self, request: &ValidGenerateRequest) -> TokenStream {
        let sampling = &request.sampling;
        let mut tokens = Vec::new();
        let mut ended = false;
        if !self.script.is_empty() {
            for i in 0..sampling.max_tokens as usize {
                if i >= self.script.len() && !sampling.ignore_eos {
                    break;
                }
                let token_id = self.script[i % self.script.len()];
                let is_last = i + 1 == self.script.len() && !sampling.ignore_eos;
                let is_stop = sampling.stop_token_ids.contains(&token_id)
                    || (!sampling.ignore_eos && self.eos.contains(&token_id));
                let finish_reason = if is_stop || is_last {
                    Some(FinishReason::Stop)
                } else if i + 1 == sampling.max_tokens as usize {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                tokens.push(Ok(GeneratedToken {
                    token_id,
                    finish_reason,
                    logprobs: None,
                    prompt_logprobs: Vec::new(),
                }));
                if finish_reason.is_some() {
                    ended = true;
                    break;
                }
            }
        }
        let mut stall = false;
        if let Some((after, class)) = self.fail_after {
            tokens.truncate(after);
            tokens.push(Err(GenerateError::new(class, "injected failure")));
        } else if let Some(after) = self.stall_after {
            stall = after < tokens.len() || !ended;
            tokens.truncate(after);
        }
        let replay = Replay {
            items: tokens.into(),
            stall,
            _live: LiveGuard::new(Arc::clone(&self.live)),
        };
        Box::pin(stream::unfold(replay, |mut replay| async move {
            match replay.items.pop_front() {
                Some(item) => Some((item, replay)),
                None if replay.stall => std::future::pending().await,
                None => None,
            }
        }))
    }
}

/// State of one replayed stream.
struct Replay {
    items: VecDeque<Result<GeneratedToken, GenerateError>>,
    stall: bool,
    _live: LiveGuard,
}

impl Generator for MemoryGenerator {
    fn generate(&self, request: ValidGenerateRequest) -> GenerateFuture {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(request.clone());
        let result = match self.admit_error {
            Some(class) => Err(GenerateError::new(class, "injected admission failure")),
            None => Ok(self.token_stream(&request)),
        };
        Box::pin(async move { result })
    }
}

/// Counts a stream as live until dropped.
struct LiveGuard(Arc<watch::Sender<usize>>);

impl LiveGuard {
    fn new(live: Arc<watch::Sender<usize>>) -> Self {
        live.send_modify(|n| *n += 1);
        Self(live)
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tandem_core::{RequestId, SamplingParams};

    fn request(max_tokens: u32) -> ValidGenerateRequest {
        ValidGenerateRequest {
            id: RequestId("t".into()),
            prompt_token_ids: vec![1],
            sampling: SamplingParams::greedy(max_tokens),
        }
    }

    async fn collect(
        generator: &MemoryGenerator,
        req: ValidGenerateRequest,
    ) -> Vec<GeneratedToken> {
        let stream = generator.generate(req).await.expect("admitted");
        stream.map(|t| t.expect("no error")).collect().await
    }

    #[tokio::test]
    async fn script_end_is_stop_and_limit_is_length() {
        let generator = MemoryGenerator::new(vec![5, 6, 7]);
        let tokens = collect(&generator, request(10)).await;
        assert_eq!(tokens.len(), 3);
        assert_eq!(tokens[2].finish_reason, Some(FinishReason::Stop));
        let tokens = collect(&generator, request(2)).await;
        assert_eq!(tokens.len(), 2);
        assert_eq!(tokens[1].finish_reason, Some(FinishReason::Length));
        assert_eq!(generator.live_streams(), 0);
        assert_eq!(generator.requests().len(), 2);
    }

    #[tokio::test]
    async fn eos_stops_unless_ignored() {
        let generator = MemoryGenerator::new(vec![5, 2, 6]).with_eos(vec![2]);
        assert_eq!(collect(&generator, request(10)).await.len(), 2);
        let mut req = request(7);
        req.sampling.ignore_eos = true;
        let tokens = collect(&generator, req).await;
        assert_eq!(tokens.len(), 7);
        assert_eq!(tokens[6].finish_reason, Some(FinishReason::Length));
    }

    #[tokio::test]
    async fn stalled_stream_stays_live_until_dropped() {
        let generator = MemoryGenerator::new(vec![5, 6, 7]).stalling_after(1);
        let mut stream = generator.generate(request(10)).await.expect("admitted");
        assert!(stream.next().await.is_some());
        assert_eq!(generator.live_streams(), 1);
        drop(stream);
        generator.wait_for_live_streams(0).await;
    }
}
