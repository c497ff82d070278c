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
    /// The first tokens of the prompt's other choices, in order (empty for one).
    pub others: Vec<tandem_engine::Sampled>,
    /// The log-probabilities of prompt tokens 2.., when asked for.
    pub prompt_logprobs: Vec<TokenLogprobs>,
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
    /// On the first token of a request whose prompt this engine computed, when asked
    /// for: the log-probabilities of prompt tokens 2..
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// Token events of a decoding or generating request.
#[derive(Debug)]
pub struct TokenEvents(UnboundedReceiver<EngineEvent>);

impl TokenEvents {
    /// The next token, or why there is none (the engine failed or dropped the request).
    pub async fn recv(&mut self) -> Result<Token> {
        let mut prompt_logprobs = Vec::new();
        loop {
            return match self.0.recv().await {
                Some(EngineEvent::PromptLogprobs(scored)) => {
                    prompt_logprobs = scored;
                    continue;
                }
                Some(EngineEvent::Token {
                    token_id,
                    finish,
                    logprobs,
                }) => Ok(Token {
                    token_id,
                    finish,
                    logprobs,
                    prompt_logprobs,
                }),
                Some(EngineEvent::Failed(e)) => Err(Error::Engine(e)),
                Some(EngineEvent::Prefilled { .. }) | None => {
                    Err(Error::Engine(tandem_engine::Error::Stopped))
                }
            };
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

    /// The most bytes a handoff of `tokens` prompt tokens and `choices` choices takes
    /// (header, manifest and body): paged K/V, or per-request state (KDA-hybrid); `None`
    /// when the model says neither.
    pub fn handoff_bound(&self, tokens: usize, choices: usize) -> Option<usize> {
        let info = self.0.info();
        // The manifest: a few dozen bytes a segment.
        let (body, segments) = match (info.kv, info.state_handoff) {
            (Some(l), _) => (l.bytes_per_token() * tokens, l.num_layers),
            (None, Some(s)) => (s.body_bytes(tokens), s.max_segments),
            (None, None) => return None,
        };
        Some(body + crate::handoff::HEADER_LEN + 4096 + 64 * segments + 4 * choices)
    }

    /// Reserves space for `choices` choices of a prompt of `prompt_len` tokens, each
    /// `tokens` tokens long (decode role), on attention-DP group `dp_rank` when given; the
    /// choices share the prompt's full blocks.
    pub fn reserve(
        &self,
        tokens: usize,
        prompt_len: usize,
        choices: usize,
        dp_rank: Option<usize>,
    ) -> Result<Vec<Reservation>> {
        Ok(self
            .0
            .pools()
            .reserve_choices(tokens, prompt_len, choices, dp_rank)?)
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

    /// Runs the prompt (prefill role), sampling each choice's first token.
    pub async fn prefill(
        &self,
        prompt: Vec<u32>,
        choices: Vec<SamplingParams>,
    ) -> Result<Prefilled> {
        let mut rx = self
            .0
            .submit_choices(prompt, choices, SeqKind::Prefill)?
            .remove(0);
        match rx.recv().await {
            Some(EngineEvent::Prefilled {
                first_token,
                finish,
                logprobs,
                handoff,
                others,
                prompt_logprobs,
            }) => Ok(Prefilled {
                first_token,
                finish,
                logprobs,
                handoff,
                others,
                prompt_logprobs,
            }),
            Some(EngineEvent::Failed(e)) => Err(Error::Engine(e)),
            _ => Err(Error::Engine(tandem_engine::Error::Stopped)),
        }
    }

    /// Runs a whole request in this process (aggregated role): no transfer. One event
    /// stream per choice.
    pub fn generate(
        &self,
        prompt: Vec<u32>,
        choices: Vec<SamplingParams>,
    ) -> Result<Vec<TokenEvents>> {
        let rxs = self.0.submit_choices(prompt, choices, SeqKind::Generate)?;
        Ok(rxs.into_iter().map(TokenEvents).collect())
    }

    /// Continues a request from a received handoff (decode role): each choice on its
    /// reservation (from [`WorkerEngine::reserve`]) from the first token the prefill worker
    /// sampled for it. A handoff that does not fit this model is refused here.
    pub fn decode(
        &self,
        prompt: Vec<u32>,
        choices: Vec<SamplingParams>,
        reservations: Vec<Reservation>,
        handoff: Handoff,
        first_tokens: Vec<u32>,
    ) -> Result<Vec<TokenEvents>> {
        if reservations.len() != choices.len() || first_tokens.len() != choices.len() {
            return Err(Error::InvalidRequest(format!(
                "{} choices, {} reservations and {} first tokens",
                choices.len(),
                reservations.len(),
                first_tokens.len()
            )));
        }
        let mut reservations = reservations.into_iter();
        let mut firsts = first_tokens.into_iter();
        let (Some(reservation), Some(first_token)) = (reservations.next(), firsts.next()) else {
            return Err(Error::InvalidRequest("no choices".into()));
        };
        let kind = SeqKind::Decode {
            reservation,
            handoff,
            first_token,
            forks: reservations.zip(firsts).collect(),
        };
        let rxs = self.0.submit_choices(prompt, choices, kind)?;
        Ok(rxs.into_iter().map(TokenEvents).collect())
    }
}
