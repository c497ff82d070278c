//! The engine behind a worker, with the few questions the service asks it. One engine type
//! serves every model family (Llama K/V blocks, KDA-hybrid state slots and latents): the
//! service sees reservations, a typed handoff and a token stream.

use crate::{Error, Result};
use tandem_core::{FinishReason, SamplingParams, TokenLogprobs};
use tandem_engine::{Engine, EngineEvent, Handoff, SeqKind};
use tandem_proto::v1 as pb;
use tokio::sync::mpsc::UnboundedReceiver;

pub use tandem_engine::Reservation;

/// The model engine behind a worker.
#[derive(Clone, Debug)]
pub struct WorkerEngine(pub Engine);

/// What a prefill produced.
#[derive(Debug)]
pub struct Prefilled {
    /// The sampled first token.
    pub first_token: u32,
    /// Set when the first token ends the request.
    pub finish: Option<FinishReason>,
    /// The first token's log-probabilities, when asked for.
    pub logprobs: Option<TokenLogprobs>,
    /// The prompt's state, typed.
    pub handoff: Handoff,
}

/// One generated token as the service forwards it.
#[derive(Debug)]
pub struct Token {
    /// The token.
    pub token_id: u32,
    /// Set on the last one.
    pub finish: Option<FinishReason>,
    /// Its log-probabilities, when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

/// Token events of a decoding or generating request.
#[derive(Debug)]
pub struct TokenEvents(UnboundedReceiver<EngineEvent>);

impl TokenEvents {
    /// The next token, or why there is none (the engine failed or dropped the request).
    pub async fn recv(&mut self) -> Result<Token> {
        match self.0.recv().await {
            Some(EngineEvent::Token {
                token_id,
                finish,
                logprobs,
            }) => Ok(Token {
                token_id,
                finish,
                logprobs,
            }),
            Some(EngineEvent::Failed(e)) => Err(Error::Engine(e)),
            Some(EngineEvent::Prefilled { .. }) | None => {
                Err(Error::Engine(tandem_engine::Error::Stopped))
            }
        }
    }
}

impl From<Engine> for WorkerEngine {
    fn from(e: Engine) -> Self {
        Self(e)
    }
}

impl WorkerEngine {
    /// Context length.
    pub fn max_context(&self) -> usize {
        self.0.max_context()
    }

    /// The paged pool: `(blocks in all, blocks free)` — K/V blocks, or the MLA latent
    /// blocks of a KDA-hybrid model.
    pub fn kv_blocks(&self) -> (usize, usize) {
        self.0.pools().paged_blocks()
    }

    /// Requests admitted or waiting.
    pub fn running(&self) -> usize {
        let s = self.0.stats();
        s.running + s.waiting
    }

    /// What the receiving side expects, so a prefill worker of another model is refused.
    pub fn kv_layout(&self, num_tokens: usize) -> pb::KvLayout {
        let info = self.0.info();
        match info.kv {
            Some(l) => pb::KvLayout {
                num_layers: l.num_layers as u32,
                num_kv_heads: l.num_kv_heads as u32,
                head_dim: l.head_dim as u32,
                block_size: l.block_size as u32,
                num_tokens: num_tokens as u32,
                dtype: l.dtype.name().into(),
                model_id: 0,
            },
            // State slots: what travels is per-layer state, checked segment by segment.
            None => pb::KvLayout {
                num_layers: info.num_layers as u32,
                num_kv_heads: 0,
                head_dim: 0,
                block_size: 0,
                num_tokens: num_tokens as u32,
                dtype: "kda_state".into(),
                model_id: 0,
            },
        }
    }

    /// The most bytes a handoff of `tokens` prompt tokens takes (header, manifest and body):
    /// paged K/V, or per-request state (KDA-hybrid); `None` when the model says neither.
    pub fn handoff_bound(&self, tokens: usize) -> Option<usize> {
        let info = self.0.info();
        // The manifest: a few dozen bytes a segment.
        let (body, segments) = match (info.kv, info.state_handoff) {
            (Some(l), _) => (l.bytes_per_token() * tokens, l.num_layers),
            (None, Some(s)) => (s.body_bytes(tokens), s.max_segments),
            (None, None) => return None,
        };
        Some(body + crate::handoff::HEADER_LEN + 4096 + 64 * segments)
    }

    /// Reserves space for a request of `tokens` tokens (decode role), on attention-DP group
    /// `dp_rank` when given.
    pub fn reserve(&self, tokens: usize, dp_rank: Option<usize>) -> Result<Reservation> {
        Ok(self.0.reserve_on(tokens, dp_rank)?)
    }

    /// Reloads weights from `dir` in place (a checkpoint of the same configuration).
    pub fn refresh_weights(&self, dir: &std::path::Path) -> Result<()> {
        Ok(self.0.refresh_weights(dir)?)
    }

    /// Resolves once no request holds KV blocks, state slots or latent blocks.
    pub async fn wait_idle(&self) {
        self.0.pools().wait_idle().await;
    }

    /// Resolves once some request holds KV blocks or state slots.
    pub async fn wait_busy(&self) {
        self.0.pools().wait_busy().await;
    }

    /// `(layout, dp size, free slots per DP group)` for the stats endpoint.
    pub fn layout_info(&self) -> (String, usize, Vec<usize>) {
        let l = self.0.info().layout;
        (
            format!("tp{} dp{} ep{}", l.tp(), l.dp(), l.ep()),
            l.dp(),
            self.0.pools().free_slots(),
        )
    }

    /// Runs the prompt (prefill role).
    pub async fn prefill(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Prefilled> {
        let mut rx = self.0.submit(prompt, params, SeqKind::Prefill)?;
        match rx.recv().await {
            Some(EngineEvent::Prefilled {
                first_token,
                finish,
                logprobs,
                handoff,
            }) => Ok(Prefilled {
                first_token,
                finish,
                logprobs,
                handoff,
            }),
            Some(EngineEvent::Failed(e)) => Err(Error::Engine(e)),
            _ => Err(Error::Engine(tandem_engine::Error::Stopped)),
        }
    }

    /// Runs a whole request in this process (aggregated role): no transfer.
    pub fn generate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<TokenEvents> {
        Ok(TokenEvents(self.0.submit(
            prompt,
            params,
            SeqKind::Generate,
        )?))
    }

    /// Continues a request from a received handoff (decode role); a handoff that does not
    /// fit this model is refused here.
    pub fn decode(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        reservation: Reservation,
        handoff: Handoff,
        first_token: u32,
    ) -> Result<TokenEvents> {
        let kind = SeqKind::Decode {
            reservation,
            handoff,
            first_token,
        };
        Ok(TokenEvents(self.0.submit(prompt, params, kind)?))
    }
}
