//! The engines a worker can serve, behind one small surface: the Llama engine (paged KV,
//! continuous batching) and the KDA-hybrid engine (per-request state slots). The service code
//! sees reservations, an opaque handoff body and a token stream, whichever model it runs.

use crate::handoff::{Segment, SegmentDtype, SegmentKind};
use crate::{Error, Result};
use tandem_core::{FinishReason, SamplingParams};
use tandem_engine::kda_runner::{GroupSlot, KdaEngine, KdaEvent};
use tandem_engine::{BlockAllocation, Engine, EngineEvent, SeqKind};
use tandem_proto::v1 as pb;
use tokio::sync::mpsc::UnboundedReceiver;

/// The model engine behind a worker.
#[derive(Clone, Debug)]
pub enum WorkerEngine {
    /// Llama family.
    Llama(Engine),
    /// KDA hybrid family.
    Kda(KdaEngine),
}

/// Space reserved for one request on a decode worker; freed when dropped.
#[derive(Debug)]
pub enum Reservation {
    /// Paged KV blocks (Llama).
    Blocks(BlockAllocation),
    /// A state slot on one attention-DP group (KDA hybrid).
    Slot(GroupSlot),
}

/// What a prefill produced.
#[derive(Debug)]
pub struct Prefilled {
    /// The sampled first token.
    pub first_token: u32,
    /// Set when the first token ends the request.
    pub finish: Option<FinishReason>,
    /// The handoff body: KV floats (Llama) or the encoded state (KDA), as bytes.
    pub body: Vec<u8>,
}

/// Token events of a decoding or generating request.
#[derive(Debug)]
pub struct TokenEvents {
    /// A token already known (the first one of an aggregated KDA request), yielded first.
    first: Option<(u32, Option<FinishReason>)>,
    source: EventSource,
}

#[derive(Debug)]
enum EventSource {
    Llama(UnboundedReceiver<EngineEvent>),
    Kda(UnboundedReceiver<KdaEvent>),
    Done,
}

impl TokenEvents {
    fn llama(rx: UnboundedReceiver<EngineEvent>) -> Self {
        Self {
            first: None,
            source: EventSource::Llama(rx),
        }
    }

    fn kda(rx: UnboundedReceiver<KdaEvent>) -> Self {
        Self {
            first: None,
            source: EventSource::Kda(rx),
        }
    }

    /// The next token; `None` when the engine dropped the request.
    pub async fn recv(&mut self) -> Option<(u32, Option<FinishReason>)> {
        if let Some(t) = self.first.take() {
            return Some(t);
        }
        match &mut self.source {
            EventSource::Llama(rx) => match rx.recv().await? {
                EngineEvent::Token { token_id, finish } => Some((token_id, finish)),
                EngineEvent::Prefilled { .. } => None,
            },
            EventSource::Kda(rx) => match rx.recv().await? {
                KdaEvent::Token { token_id, finish } => Some((token_id, finish)),
                KdaEvent::Prefilled { .. } => None,
            },
            EventSource::Done => None,
        }
    }
}

impl WorkerEngine {
    /// Context length.
    pub fn max_context(&self) -> usize {
        match self {
            WorkerEngine::Llama(e) => e.max_context(),
            WorkerEngine::Kda(e) => e.max_context(),
        }
    }

    /// The paged KV pool: `(blocks in all, blocks free)` — Llama K/V blocks, or the MLA
    /// latent blocks of a KDA-hybrid model.
    pub fn kv_blocks(&self) -> (usize, usize) {
        match self {
            WorkerEngine::Llama(e) => (e.allocator().total_blocks(), e.allocator().free_blocks()),
            WorkerEngine::Kda(e) => e.latent_blocks(),
        }
    }

    /// Requests admitted or waiting (Llama); KDA reports slots in use.
    pub fn running(&self) -> usize {
        match self {
            WorkerEngine::Llama(e) => {
                let s = e.stats();
                s.running + s.waiting
            }
            WorkerEngine::Kda(e) => e.slots().total_blocks() - e.slots().free_blocks(),
        }
    }

    /// What the receiving side expects, so a prefill worker of another model is refused.
    pub fn kv_layout(&self, num_tokens: usize) -> pb::KvLayout {
        match self {
            WorkerEngine::Llama(e) => {
                let l = e.layout();
                pb::KvLayout {
                    num_layers: l.num_layers as u32,
                    num_kv_heads: l.num_kv_heads as u32,
                    head_dim: l.head_dim as u32,
                    block_size: l.block_size as u32,
                    num_tokens: num_tokens as u32,
                    dtype: l.dtype.name().into(),
                    model_id: 0,
                }
            }
            WorkerEngine::Kda(e) => pb::KvLayout {
                num_layers: e.num_layers() as u32,
                num_kv_heads: 0,
                head_dim: 0,
                block_size: 0,
                num_tokens: num_tokens as u32,
                dtype: "kda_state".into(),
                model_id: 0,
            },
        }
    }

    /// The manifest of a handoff body of `body_len` bytes for `num_tokens` prompt tokens.
    pub fn body_segments(&self, num_tokens: usize, body_len: usize) -> Vec<Segment> {
        match self {
            WorkerEngine::Llama(e) => {
                let l = e.layout();
                (0..l.num_layers as u32)
                    .map(|layer| Segment {
                        kind: SegmentKind::KvLayer,
                        layer,
                        shard: 0,
                        dtype: SegmentDtype::Tensor(l.dtype),
                        shape: vec![2, num_tokens as u32, l.kv_dim() as u32],
                    })
                    .collect()
            }
            WorkerEngine::Kda(_) => vec![Segment {
                kind: SegmentKind::KdaState,
                layer: 0,
                shard: 0,
                dtype: SegmentDtype::Bytes,
                shape: vec![body_len as u32],
            }],
        }
    }

    /// Checks a received manifest against what this engine would have sent.
    pub fn check_segments(
        &self,
        got: &[Segment],
        num_tokens: usize,
        body_len: usize,
    ) -> Result<()> {
        let want = self.body_segments(num_tokens, body_len);
        if got != want.as_slice() {
            let describe = |s: &[Segment]| match s.first() {
                Some(f) => format!(
                    "{} segments, the first {:?} {:?} {:?}",
                    s.len(),
                    f.kind,
                    f.dtype,
                    f.shape
                ),
                None => "no segments".to_string(),
            };
            return Err(Error::InvalidRequest(format!(
                "KV manifest does not match this worker's cache: got {}, expected {}",
                describe(got),
                describe(&want)
            )));
        }
        Ok(())
    }

    /// Reserves space for a request of `tokens` tokens (decode role), on attention-DP group
    /// `dp_rank` when given.
    pub fn reserve(&self, tokens: usize, dp_rank: Option<usize>) -> Result<Reservation> {
        Ok(match self {
            WorkerEngine::Llama(e) => {
                if dp_rank.is_some_and(|r| r > 0) {
                    return Err(Error::InvalidRequest(
                        "this worker has one attention-DP group".into(),
                    ));
                }
                Reservation::Blocks(e.reserve(tokens)?)
            }
            WorkerEngine::Kda(e) => Reservation::Slot(e.reserve_for(dp_rank, tokens)?),
        })
    }

    /// Reloads weights from `dir` in place (a checkpoint of the same configuration).
    pub fn refresh_weights(&self, dir: &std::path::Path) -> Result<()> {
        match self {
            WorkerEngine::Llama(e) => Ok(e.refresh_weights(dir)?),
            WorkerEngine::Kda(e) => Ok(e.refresh_weights(dir)?),
        }
    }

    /// Resolves once no request holds KV blocks, state slots or latent blocks.
    pub async fn wait_idle(&self) {
        match self {
            WorkerEngine::Llama(e) => e.allocator().wait_all_free().await,
            WorkerEngine::Kda(e) => e.wait_idle().await,
        }
    }

    /// Resolves once some request holds KV blocks or state slots.
    pub async fn wait_busy(&self) {
        match self {
            WorkerEngine::Llama(e) => e.allocator().wait_any_used().await,
            WorkerEngine::Kda(e) => e.slots().wait_any_used().await,
        }
    }

    /// `(layout, dp size, free slots per DP group)` for the stats endpoint.
    pub fn layout_info(&self) -> (String, usize, Vec<usize>) {
        match self {
            WorkerEngine::Llama(e) => (format!("tp{} dp1 ep1", e.tp()), 1, Vec::new()),
            WorkerEngine::Kda(e) => {
                let l = e.layout();
                (
                    format!("tp{} dp{} ep{}", l.tp(), l.dp(), l.ep()),
                    l.dp(),
                    e.group_free(),
                )
            }
        }
    }

    /// Runs the prompt (prefill role).
    pub async fn prefill(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<Prefilled> {
        let stopped = || Error::Engine(tandem_engine::Error::Stopped);
        match self {
            WorkerEngine::Llama(e) => {
                let mut rx = e.submit(prompt, params, SeqKind::Prefill)?;
                match rx.recv().await {
                    Some(EngineEvent::Prefilled {
                        first_token,
                        finish,
                        kv,
                    }) => Ok(Prefilled {
                        first_token,
                        finish,
                        body: kv.to_le_bytes(),
                    }),
                    _ => Err(stopped()),
                }
            }
            WorkerEngine::Kda(e) => {
                let mut rx = e.submit_prefill(prompt, params)?;
                match rx.recv().await {
                    Some(KdaEvent::Prefilled {
                        first_token,
                        finish,
                        state,
                    }) => Ok(Prefilled {
                        first_token,
                        finish,
                        body: state,
                    }),
                    _ => Err(stopped()),
                }
            }
        }
    }

    /// Runs a whole request in this process (aggregated role): no transfer. The Llama engine
    /// generates every token itself; the KDA engine prefills, then continues the state it
    /// produced on a slot reserved up front.
    pub async fn generate(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<TokenEvents> {
        match self {
            WorkerEngine::Llama(e) => Ok(TokenEvents::llama(e.submit(
                prompt,
                params,
                SeqKind::Generate,
            )?)),
            WorkerEngine::Kda(e) => {
                let slot = e.reserve_for(None, prompt.len() + params.max_tokens as usize)?;
                let Prefilled {
                    first_token,
                    finish,
                    body,
                } = self.prefill(prompt.clone(), params.clone()).await?;
                let first = Some((first_token, finish));
                if finish.is_some() {
                    return Ok(TokenEvents {
                        first,
                        source: EventSource::Done,
                    });
                }
                let rx = e.submit_decode(&prompt, params, slot, &body, first_token)?;
                Ok(TokenEvents {
                    first,
                    source: EventSource::Kda(rx),
                })
            }
        }
    }

    /// Continues a request from a handoff body (decode role).
    pub fn decode(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        reservation: Reservation,
        body: &[u8],
        first_token: u32,
    ) -> Result<TokenEvents> {
        match (self, reservation) {
            (WorkerEngine::Llama(e), Reservation::Blocks(allocation)) => {
                let l = e.layout();
                let shape = [l.num_layers, 2, prompt.len(), l.kv_dim()];
                let kv = tandem_engine::HostTensor::from_le_bytes(l.dtype, &shape, body)
                    .map_err(Error::Engine)?;
                let kind = SeqKind::Decode {
                    allocation,
                    kv,
                    first_token,
                };
                Ok(TokenEvents::llama(e.submit(prompt, params, kind)?))
            }
            (WorkerEngine::Kda(e), Reservation::Slot(slot)) => Ok(TokenEvents::kda(
                e.submit_decode(&prompt, params, slot, body, first_token)?,
            )),
            _ => Err(Error::InvalidRequest(
                "reservation of another engine".into(),
            )),
        }
    }
}
