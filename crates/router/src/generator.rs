//! The boundary between the HTTP front end and whatever produces tokens.
//!
//! The HTTP layer validates, templates and tokenizes, then hands a [`ValidGenerateRequest`]
//! to a [`Generator`]; it gets back a stream of token ids. The P/D implementation
//! ([`crate::pd::PdGenerator`]) talks gRPC to a prefill and a decode worker; tests can use an
//! in-memory generator. Dropping the stream cancels the request on every leg.

use futures::stream::BoxStream;
use std::future::Future;
use std::pin::Pin;
use tandem_core::{ErrorClass, FinishReason, RequestId, SamplingParams, TokenLogprobs};

/// A request that passed validation: token ids, checked sampling parameters.
#[derive(Clone, Debug)]
pub struct ValidGenerateRequest {
    /// Router-assigned id.
    pub id: RequestId,
    /// Prompt token ids (already templated and tokenized); never empty.
    pub prompt_token_ids: Vec<u32>,
    /// Checked sampling parameters; `max_tokens >= 1`.
    pub sampling: SamplingParams,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct GeneratedToken {
    /// The token.
    pub token_id: u32,
    /// Set on the last token of the stream.
    pub finish_reason: Option<FinishReason>,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// On the first token, with `prompt_logprobs`: those of prompt tokens 2.. (else empty).
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// A classified generation failure.
#[derive(Debug, thiserror::Error)]
#[error("{class:?}: {message}")]
pub struct GenerateError {
    /// Where it belongs.
    pub class: ErrorClass,
    /// Human-readable detail (safe to show a client).
    pub message: String,
}

impl GenerateError {
    /// A new error of `class`.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
        }
    }
}

/// Stream of generated tokens. Ends after the token carrying a finish reason, or with an error.
pub type TokenStream = BoxStream<'static, Result<GeneratedToken, GenerateError>>;

/// Boxed future returned by [`Generator::generate`].
pub type GenerateFuture = Pin<Box<dyn Future<Output = Result<TokenStream, GenerateError>> + Send>>;

/// Boxed future returned by [`Generator::generate_choices`]: one stream per choice.
pub type ChoicesFuture =
    Pin<Box<dyn Future<Output = Result<Vec<TokenStream>, GenerateError>> + Send>>;

/// Produces tokens for validated requests.
pub trait Generator: Send + Sync + 'static {
    /// Starts generating. Resolves once the request is admitted (may already carry the first
    /// token); the stream yields every generated token, the first included.
    fn generate(&self, request: ValidGenerateRequest) -> GenerateFuture;

    /// Starts `n` choices of one prompt (OpenAI's `n`): choice `j` samples with seed
    /// `seed + j` (request id suffixed `-j` when `n` > 1). Resolves once every choice has
    /// started; one stream per choice, in order. This default runs each choice as a request
    /// of its own; the P/D generator computes the prompt once for them all.
    fn generate_choices(&self, request: ValidGenerateRequest, n: u32) -> ChoicesFuture {
        if n <= 1 {
            let one = self.generate(request);
            return Box::pin(async move { Ok(vec![one.await?]) });
        }
        let starts: Vec<GenerateFuture> = (0..n)
            .map(|j| {
                let mut c = request.clone();
                c.id = RequestId(format!("{}-{j}", request.id.0));
                c.sampling.seed = request.sampling.seed.wrapping_add(u64::from(j));
                self.generate(c)
            })
            .collect();
        Box::pin(async move { futures::future::try_join_all(starts).await })
    }
}
