//! Serving KDA-hybrid models: an engine thread over [`KdaHybridModel`] with the same shape as
//! the Llama engine's — submit a sequence, get events — and a state-slot pool whose RAII
//! slots free themselves when a request ends.
//!
//! A KDA-hybrid request's "cache" is its [`KdaHybridState`]: fixed-size KDA state per KDA layer
//! and a latent per token per MLA layer. The prefill role hands the state over as bytes
//! ([`encode_state`]); the decode role checks them against a fresh state of its own model
//! ([`decode_state`]) before using them. Steps run one request at a time (prefills whole,
//! decodes round-robin): correct and simple; batching across requests comes with the batched
//! KDA kernels.

use crate::kda_hybrid::{KdaHybridModel, KdaHybridState, LayerState};
use crate::kv_pool::{BlockAllocation, BlockAllocator};
use crate::sampling::sample;
use crate::{Error, Result};
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use tandem_core::{FinishReason, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What the KDA engine reports for a sequence.
#[derive(Debug)]
pub enum KdaEvent {
    /// Prefill done: the first token and the request's state as bytes.
    Prefilled {
        /// Sampled first token.
        first_token: u32,
        /// Set when the first token already ends the request.
        finish: Option<FinishReason>,
        /// [`encode_state`] of the state after the prompt.
        state: Vec<u8>,
    },
    /// A generated token.
    Token {
        /// The token.
        token_id: u32,
        /// Set on the last one.
        finish: Option<FinishReason>,
    },
}

fn put(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    out.extend_from_slice(bytemuck::cast_slice(v));
}

/// Serialises a request state (a whole number of 4-byte words): per layer a kind word, then length-prefixed f32 arrays
/// (KDA: recurrent, conv q, conv k, conv v; MLA: latent, rope key, indexer keys, pool gate).
pub fn encode_state(state: &KdaHybridState) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(state.tokens as u64).to_le_bytes());
    out.extend_from_slice(&(state.layers.len() as u64).to_le_bytes());
    for layer in &state.layers {
        match layer {
            LayerState::Kda(k) => {
                out.extend_from_slice(&0u32.to_le_bytes());
                for v in [&k.recurrent, &k.conv.q, &k.conv.k, &k.conv.v] {
                    put(&mut out, v);
                }
            }
            LayerState::Mla(m) => {
                out.extend_from_slice(&1u32.to_le_bytes());
                let (keys, gate) = m
                    .indexer
                    .as_ref()
                    .map_or((&[][..], &[][..]), |i| (&i.keys[..], &i.pool_gate[..]));
                for v in [&m.kv_latent[..], &m.k_rope[..], keys, gate] {
                    put(&mut out, v);
                }
                out.extend_from_slice(&u32::from(m.indexer.is_some()).to_le_bytes());
            }
        }
    }
    out
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn bytes(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(Error::InvalidRequest("KDA state truncated".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.bytes(8)?;
        Ok(u64::from_le_bytes(
            b.try_into()
                .map_err(|_| Error::InvalidRequest("bad length".into()))?,
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.bytes(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn floats(&mut self, expected: Option<usize>) -> Result<Vec<f32>> {
        let n =
            usize::try_from(self.u64()?).map_err(|_| Error::InvalidRequest("bad length".into()))?;
        if expected.is_some_and(|e| e != n) {
            return Err(Error::InvalidRequest(format!(
                "KDA state block has {n} values, expected {expected:?}"
            )));
        }
        let b = self.bytes(
            n.checked_mul(4)
                .ok_or_else(|| Error::InvalidRequest("bad length".into()))?,
        )?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Rebuilds a state from [`encode_state`] bytes, checking every block against `template`
/// (a fresh state of the receiving model): layer kinds, KDA sizes, and per-token MLA widths.
pub fn decode_state(
    bytes: &[u8],
    template: &KdaHybridState,
    prompt_len: usize,
) -> Result<KdaHybridState> {
    let mut r = Reader(bytes);
    let tokens =
        usize::try_from(r.u64()?).map_err(|_| Error::InvalidRequest("bad token count".into()))?;
    if tokens != prompt_len {
        return Err(Error::InvalidRequest(format!(
            "state covers {tokens} tokens, the prompt has {prompt_len}"
        )));
    }
    let n = r.u64()? as usize;
    if n != template.layers.len() {
        return Err(Error::InvalidRequest(format!(
            "state has {n} layers, the model {}",
            template.layers.len()
        )));
    }
    let mut state = template.clone();
    state.tokens = tokens;
    for layer in &mut state.layers {
        let kind = r.u32()?;
        match (kind, layer) {
            (0, LayerState::Kda(k)) => {
                k.recurrent = r.floats(Some(k.recurrent.len()))?;
                k.conv.q = r.floats(Some(k.conv.q.len()))?;
                k.conv.k = r.floats(Some(k.conv.k.len()))?;
                k.conv.v = r.floats(Some(k.conv.v.len()))?;
            }
            (1, LayerState::Mla(m)) => {
                m.kv_latent = r.floats(None)?;
                m.k_rope = r.floats(None)?;
                let keys = r.floats(None)?;
                let pool_gate = r.floats(None)?;
                let has_indexer = r.u32()? == 1;
                if has_indexer != m.indexer.is_some() {
                    return Err(Error::InvalidRequest(
                        "MLA indexer presence differs from the model".into(),
                    ));
                }
                if let Some(ix) = m.indexer.as_mut() {
                    ix.keys = keys;
                    ix.pool_gate = pool_gate;
                }
                let per_token = |v: &[f32]| tokens == 0 || v.len().is_multiple_of(tokens);
                if !per_token(&m.kv_latent) || !per_token(&m.k_rope) {
                    return Err(Error::InvalidRequest(
                        "MLA latent is not whole tokens".into(),
                    ));
                }
            }
            _ => {
                return Err(Error::InvalidRequest(
                    "state layer kinds differ from the model's".into(),
                ))
            }
        }
    }
    if !r.0.is_empty() {
        return Err(Error::InvalidRequest(
            "trailing bytes after the KDA state".into(),
        ));
    }
    Ok(state)
}

enum Work {
    Prefill {
        prompt: Vec<u32>,
        params: SamplingParams,
        slot: BlockAllocation,
        tx: UnboundedSender<KdaEvent>,
    },
    Decode {
        seq: Box<DecodeSeq>,
    },
}

struct DecodeSeq {
    state: KdaHybridState,
    last: u32,
    generated: usize,
    params: SamplingParams,
    stop: Vec<u32>,
    _slot: BlockAllocation,
    tx: UnboundedSender<KdaEvent>,
}

/// Handle to a KDA-hybrid engine thread.
#[derive(Clone)]
pub struct KdaEngine {
    tx: mpsc::Sender<Work>,
    slots: BlockAllocator,
    template: Arc<KdaHybridState>,
    eos: Vec<u32>,
    vocab: usize,
    max_context: usize,
    num_layers: usize,
}

impl std::fmt::Debug for KdaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KdaEngine")
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

fn stop_ids(params: &SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut s = params.stop_token_ids.clone();
    if !params.ignore_eos {
        s.extend_from_slice(eos);
    }
    s
}

fn finish(
    token: u32,
    generated: usize,
    params: &SamplingParams,
    stop: &[u32],
) -> Option<FinishReason> {
    if stop.contains(&token) {
        Some(FinishReason::Stop)
    } else if generated >= params.max_tokens as usize {
        Some(FinishReason::Length)
    } else {
        None
    }
}

impl KdaEngine {
    /// Starts the engine thread with `slots` request-state slots.
    pub fn start(model: KdaHybridModel, slots: usize, eos: Vec<u32>, max_context: usize) -> Self {
        let (tx, rx) = mpsc::channel();
        let template = Arc::new(model.new_state());
        let vocab = model.config().vocab_size;
        let num_layers = model.config().num_layers();
        let eos_thread = eos.clone();
        std::thread::Builder::new()
            .name("tandem-kda-engine".into())
            .spawn(move || run(model, rx, eos_thread))
            .expect("spawning the KDA engine thread");
        Self {
            tx,
            slots: BlockAllocator::new(slots),
            template,
            eos,
            vocab,
            max_context,
            num_layers,
        }
    }

    /// The state-slot pool (for accounting).
    pub fn slots(&self) -> &BlockAllocator {
        &self.slots
    }

    /// Layers of the model.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Context length served.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Takes one state slot (decode role reserves before the state arrives).
    pub fn reserve(&self) -> Result<BlockAllocation> {
        self.slots.allocate(1)
    }

    fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        if prompt.is_empty() || params.max_tokens == 0 {
            return Err(Error::InvalidRequest(
                "empty prompt or max_tokens = 0".into(),
            ));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        if prompt.len() + params.max_tokens as usize > self.max_context {
            return Err(Error::InvalidRequest(format!(
                "request exceeds the context length {}",
                self.max_context
            )));
        }
        Ok(())
    }

    /// Prefill role: computes the prompt; one `Prefilled` event.
    pub fn submit_prefill(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<UnboundedReceiver<KdaEvent>> {
        self.check(&prompt, &params)?;
        let slot = self.reserve()?;
        let (tx, rx) = unbounded_channel();
        self.tx
            .send(Work::Prefill {
                prompt,
                params,
                slot,
                tx,
            })
            .map_err(|_| Error::Stopped)?;
        Ok(rx)
    }

    /// Decode role: continues from a received state with `first_token`; `Token` events.
    pub fn submit_decode(
        &self,
        prompt: &[u32],
        params: SamplingParams,
        slot: BlockAllocation,
        state: &[u8],
        first_token: u32,
    ) -> Result<UnboundedReceiver<KdaEvent>> {
        self.check(prompt, &params)?;
        let state = decode_state(state, &self.template, prompt.len())?;
        let (tx, rx) = unbounded_channel();
        let stop = stop_ids(&params, &self.eos);
        let seq = DecodeSeq {
            state,
            last: first_token,
            generated: 1,
            params,
            stop,
            _slot: slot,
            tx,
        };
        self.tx
            .send(Work::Decode { seq: Box::new(seq) })
            .map_err(|_| Error::Stopped)?;
        Ok(rx)
    }
}

fn run(model: KdaHybridModel, rx: mpsc::Receiver<Work>, eos: Vec<u32>) {
    let mut running: VecDeque<Box<DecodeSeq>> = VecDeque::new();
    loop {
        let next = if running.is_empty() {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        match next {
            Some(Work::Prefill {
                prompt,
                params,
                slot,
                tx,
            }) => {
                if tx.is_closed() {
                    continue;
                }
                let mut state = model.new_state();
                let logits = model.prefill(&prompt, &mut state);
                let token = sample(&logits, &params, 0);
                let f = finish(token, 1, &params, &stop_ids(&params, &eos));
                let bytes = encode_state(&state);
                drop(slot); // freed before the caller hears of it
                let _ = tx.send(KdaEvent::Prefilled {
                    first_token: token,
                    finish: f,
                    state: bytes,
                });
                continue;
            }
            Some(Work::Decode { seq }) => running.push_back(seq),
            None if running.is_empty() => return,
            None => {}
        }
        // One decode step for the request at the front, then it goes to the back.
        if let Some(mut seq) = running.pop_front() {
            if seq.tx.is_closed() {
                continue;
            }
            let logits = model.decode_step(seq.last, &mut seq.state);
            let token = sample(&logits, &seq.params, seq.generated as u32);
            seq.generated += 1;
            seq.last = token;
            let f = finish(token, seq.generated, &seq.params, &seq.stop);
            let tx = seq.tx.clone();
            if f.is_none() {
                running.push_back(seq);
            } else {
                drop(seq); // slot freed before the last token is reported
            }
            let _ = tx.send(KdaEvent::Token {
                token_id: token,
                finish: f,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The public tiny Kimi-Linear checkpoint: its KDA state visibly changes the output.
    fn tiny() -> (std::path::PathBuf, KdaHybridModel) {
        let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
        let model = KdaHybridModel::load(&dir).expect("load");
        (dir, model)
    }

    #[test]
    fn state_round_trips_and_is_checked() {
        let (_d, model) = tiny();
        let mut state = model.new_state();
        model.prefill(&[5, 6, 7, 8], &mut state);
        let bytes = encode_state(&state);
        let back = decode_state(&bytes, &model.new_state(), 4).expect("decode");
        assert_eq!(back, state);
        assert!(
            decode_state(&bytes, &model.new_state(), 5).is_err(),
            "wrong prompt length"
        );
        assert!(
            decode_state(&bytes[..bytes.len() - 3], &model.new_state(), 4).is_err(),
            "truncated"
        );
    }

    #[test]
    fn prefill_then_decode_through_the_engines_equals_one_process() {
        let (dir, model) = tiny();
        let prompt = vec![9u32, 40, 7, 300, 12, 5];
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(6)
        };
        // Reference: one process.
        let mut st = model.new_state();
        let mut logits = model.prefill(&prompt, &mut st);
        let mut want = Vec::new();
        for _ in 0..6 {
            let t = crate::sampling::argmax(&logits);
            want.push(t);
            logits = model.decode_step(t, &mut st);
        }
        let p = KdaEngine::start(model, 4, vec![2], 4096);
        let d = KdaEngine::start(KdaHybridModel::load(&dir).expect("load"), 4, vec![2], 4096);
        let mut rx = p
            .submit_prefill(prompt.clone(), params.clone())
            .expect("prefill");
        let Some(KdaEvent::Prefilled {
            first_token,
            finish: None,
            state,
        }) = rx.blocking_recv()
        else {
            panic!("no prefill event");
        };
        let slot = d.reserve().expect("slot");
        let mut rx = d
            .submit_decode(&prompt, params, slot, &state, first_token)
            .expect("decode");
        let mut got = vec![first_token];
        while let Some(KdaEvent::Token { token_id, finish }) = rx.blocking_recv() {
            got.push(token_id);
            if finish.is_some() {
                break;
            }
        }
        assert_eq!(got, want);
        assert_eq!(p.slots().free_blocks(), 4);
        assert_eq!(d.slots().free_blocks(), 4);
    }
}
