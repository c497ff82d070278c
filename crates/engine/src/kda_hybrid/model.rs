//! The whole decoder: embedding, the per-layer mix of KDA / MLA token mixers and dense / MoE
//! FFNs, the residual (single stream or mHC), final norm and LM head — plus the per-request
//! state ([`KdaHybridState`]) that makes prefill followed by decode steps equal one pass.
//!
//! One request at a time, f32 on the CPU, GEMMs through the CPU backend. The state's parts are
//! public so they can be exported after prefill and imported on a decode worker.

use super::config::{AttentionKind, FfnKind, KdaHybridConfig};
use super::kda::{KdaForm, KdaLayer, KdaState};
use super::mla::{MlaLayer, MlaState};
use super::moe::{Moe, SwiGlu};
use super::ops::{linear, rms_norm};
use super::residual::{HyperConnection, Residual};
use super::weights::Checkpoint;
use crate::backend::{Backend, CpuBackend, Linear};
use crate::{Error, Result};
use std::path::Path;

/// A layer's token mixer.
#[derive(Debug)]
pub enum Attention {
    /// Linear attention.
    Kda(KdaLayer),
    /// Full attention.
    Mla(MlaLayer),
}

/// A layer's feed-forward block.
#[derive(Debug)]
pub enum Ffn {
    /// One SwiGLU MLP.
    Dense(SwiGlu),
    /// Routed + shared experts.
    Moe(Moe),
}

#[derive(Debug)]
struct DecoderLayer {
    input_norm: Vec<f32>,
    attention: Attention,
    post_norm: Vec<f32>,
    ffn: Ffn,
    hc_attn: Option<HyperConnection>,
    hc_ffn: Option<HyperConnection>,
}

/// One layer's part of a request's state.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// Fixed-size KDA state.
    Kda(KdaState),
    /// Growing MLA latent cache.
    Mla(MlaState),
}

/// Everything a request carries between forward calls: one entry per decoder layer, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaHybridState {
    /// Per-layer state.
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub tokens: usize,
}

impl KdaHybridState {
    /// Layer `i`'s KDA state, if layer `i` is a KDA layer.
    pub fn kda(&self, i: usize) -> Option<&KdaState> {
        match self.layers.get(i) {
            Some(LayerState::Kda(s)) => Some(s),
            _ => None,
        }
    }

    /// Layer `i`'s MLA cache, if layer `i` is an MLA layer.
    pub fn mla(&self, i: usize) -> Option<&MlaState> {
        match self.layers.get(i) {
            Some(LayerState::Mla(s)) => Some(s),
            _ => None,
        }
    }
}

/// A loaded Kimi-Linear / GLM-5.3-Flash style hybrid model (tp1, CPU, f32).
#[derive(Debug)]
pub struct KdaHybridModel {
    config: KdaHybridConfig,
    /// `[vocab, hidden]`.
    embed: Vec<f32>,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Option<Linear<Vec<f32>>>,
}

impl KdaHybridModel {
    /// Loads `dir/config.json` and `dir/model*.safetensors` (F32 / BF16 / F16, kept as f32).
    pub fn load(dir: &Path) -> Result<Self> {
        let config = KdaHybridConfig::from_dir(dir)?;
        let mut ck = Checkpoint::load_dir(dir)?;
        let c = &config;
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps);
        let prefix = ck.prefix.clone();
        let mut layers = Vec::with_capacity(c.num_layers());
        for (i, spec) in c.layers.iter().enumerate() {
            let lp = format!("{prefix}layers.{i}");
            let attn = format!("{lp}.self_attn");
            let attention = match spec.attention {
                AttentionKind::Kda => {
                    Attention::Kda(KdaLayer::load(&mut ck, &attn, c.kda, hidden, eps)?)
                }
                AttentionKind::Mla => {
                    Attention::Mla(MlaLayer::load(&mut ck, &attn, c.mla, hidden)?)
                }
            };
            let ffn = match spec.ffn {
                FfnKind::Dense => {
                    // Original Kimi checkpoints say `mlp.*`; transformers 5.24 writes
                    // `block_sparse_moe.*` for dense layers too.
                    let names = ["mlp", "block_sparse_moe"].map(|b| {
                        ["gate_proj", "up_proj", "down_proj"]
                            .map(|p| format!("{lp}.{b}.{p}.weight"))
                    });
                    Ffn::Dense(SwiGlu::load(
                        &mut ck,
                        &names,
                        hidden,
                        c.intermediate_size,
                        c.swiglu_limit,
                    )?)
                }
                FfnKind::Moe => {
                    let block = if ck.has(&format!("{lp}.block_sparse_moe.gate.weight")) {
                        format!("{lp}.block_sparse_moe")
                    } else {
                        format!("{lp}.mlp")
                    };
                    Ffn::Moe(Moe::load(&mut ck, &block, c.moe, hidden, c.swiglu_limit)?)
                }
            };
            layers.push(DecoderLayer {
                input_norm: ck.take(&format!("{lp}.input_layernorm.weight"), &[hidden])?,
                attention,
                post_norm: ck.take(&format!("{lp}.post_attention_layernorm.weight"), &[hidden])?,
                ffn,
                hc_attn: HyperConnection::load(&mut ck, &lp, "attn", c.residual, hidden, eps)?,
                hc_ffn: HyperConnection::load(&mut ck, &lp, "ffn", c.residual, hidden, eps)?,
            });
        }
        let embed = ck.take(
            &format!("{prefix}embed_tokens.weight"),
            &[c.vocab_size, hidden],
        )?;
        let norm = ck.take(&format!("{prefix}norm.weight"), &[hidden])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(ck.linear("lm_head.weight", c.vocab_size, hidden)?)
        };
        ck.finish(c.num_layers())?;
        Ok(Self {
            config,
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The checked configuration.
    pub fn config(&self) -> &KdaHybridConfig {
        &self.config
    }

    /// Layer `i`'s token mixer.
    pub fn attention(&self, i: usize) -> Option<&Attention> {
        self.layers.get(i).map(|l| &l.attention)
    }

    /// Layer `i`'s KDA layer, if it is one.
    pub fn kda_layer(&self, i: usize) -> Option<&KdaLayer> {
        match self.attention(i) {
            Some(Attention::Kda(l)) => Some(l),
            _ => None,
        }
    }

    /// The longest context this implementation computes exactly: GLM's DSA indexer (not
    /// implemented here) selects every visible token only up to `index_topk` tokens. `None`:
    /// no limit.
    pub fn exact_context_limit(&self) -> Option<usize> {
        self.config.mla.indexer.map(|ix| ix.topk)
    }

    /// A fresh per-request state (no tokens).
    pub fn new_state(&self) -> KdaHybridState {
        KdaHybridState {
            layers: self
                .layers
                .iter()
                .map(|l| match &l.attention {
                    Attention::Kda(k) => LayerState::Kda(k.new_state()),
                    Attention::Mla(m) => LayerState::Mla(m.new_state()),
                })
                .collect(),
            tokens: 0,
        }
    }

    /// Fails for an empty sequence or an id outside the vocabulary; the forward functions
    /// assume ids that passed this check.
    pub fn validate_tokens(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::InvalidRequest("no tokens".into()));
        }
        match ids
            .iter()
            .find(|&&id| id as usize >= self.config.vocab_size)
        {
            Some(id) => Err(Error::InvalidRequest(format!(
                "token id {id} outside the vocabulary of {}",
                self.config.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Logits `[T, vocab]` at every position of one pass over `token_ids` from an empty state
    /// (chunked KDA).
    pub fn forward_full(&self, token_ids: &[u32]) -> Vec<f32> {
        let mut state = self.new_state();
        self.extend(token_ids, &mut state, KdaForm::Chunked, true)
    }

    /// Consumes `ids` into `state` (chunked KDA) and returns the logits of the last one
    /// `[vocab]`. Works on a fresh state or continues one (chunked prefill).
    pub fn prefill(&self, ids: &[u32], state: &mut KdaHybridState) -> Vec<f32> {
        self.extend(ids, state, KdaForm::Chunked, false)
    }

    /// Consumes one token (recurrent KDA) and returns its logits `[vocab]`.
    pub fn decode_step(&self, id: u32, state: &mut KdaHybridState) -> Vec<f32> {
        self.extend(&[id], state, KdaForm::Recurrent, false)
    }

    /// Consumes `ids` into `state` with the given KDA form; returns logits of every new
    /// position (`all_logits`) or of the last one.
    ///
    /// # Panics
    /// If an id is outside the vocabulary (see [`KdaHybridModel::validate_tokens`]) or `state`
    /// was not made by this model's [`KdaHybridModel::new_state`].
    pub fn extend(
        &self,
        ids: &[u32],
        state: &mut KdaHybridState,
        form: KdaForm,
        all_logits: bool,
    ) -> Vec<f32> {
        let mut trace = None;
        self.run(ids, state, form, all_logits, &mut trace)
    }

    /// The residual after every layer for a pass over `ids` from an empty state (`[T, hidden]`,
    /// or `[T, N, hidden]` under mHC), for layer-by-layer comparison with a reference.
    pub fn residual_trace(&self, ids: &[u32]) -> Vec<Vec<f32>> {
        let mut trace = Some(Vec::new());
        let mut state = self.new_state();
        self.run(ids, &mut state, KdaForm::Chunked, false, &mut trace);
        trace.unwrap_or_default()
    }

    fn run(
        &self,
        ids: &[u32],
        state: &mut KdaHybridState,
        form: KdaForm,
        all_logits: bool,
        trace: &mut Option<Vec<Vec<f32>>>,
    ) -> Vec<f32> {
        let c = &self.config;
        let (hidden, eps, rows) = (c.hidden_size, c.rms_norm_eps, ids.len());
        if rows == 0 {
            return Vec::new();
        }
        assert_eq!(
            state.layers.len(),
            self.layers.len(),
            "state was not made by this model"
        );
        let embedded: Vec<f32> = ids
            .iter()
            .flat_map(|&id| {
                let at = id as usize * hidden;
                assert!(
                    id as usize * hidden < self.embed.len(),
                    "token id {id} outside the vocabulary (check with validate_tokens)"
                );
                &self.embed[at..at + hidden]
            })
            .copied()
            .collect();
        let mut residual = Residual::new(embedded, c.residual, hidden);
        for (layer, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let (x, mix) = residual.enter(layer.hc_attn.as_ref(), rows, hidden);
            let h = rms_norm(&x, hidden, &layer.input_norm, eps);
            let a = match (&layer.attention, st) {
                (Attention::Kda(l), LayerState::Kda(s)) => l.forward(&h, rows, s, form),
                (Attention::Mla(l), LayerState::Mla(s)) => l.forward(&h, rows, s),
                _ => panic!("state was not made by this model (layer kinds differ)"),
            };
            residual.leave(&a, mix, hidden);
            let (x, mix) = residual.enter(layer.hc_ffn.as_ref(), rows, hidden);
            let h = rms_norm(&x, hidden, &layer.post_norm, eps);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&h, rows),
                Ffn::Moe(moe) => moe.forward(&h, rows),
            };
            residual.leave(&f, mix, hidden);
            if let Some(t) = trace.as_mut() {
                t.push(residual.raw().to_vec());
            }
        }
        state.tokens += rows;
        let out = residual.output(hidden);
        let (out, n) = if all_logits {
            (out, rows)
        } else {
            (out[(rows - 1) * hidden..].to_vec(), 1)
        };
        let normed = rms_norm(&out, hidden, &self.norm, eps);
        match &self.lm_head {
            Some(head) => linear(&normed, n, head),
            None => {
                let mut logits = Vec::new();
                CpuBackend.matmul_raw(
                    &normed,
                    n,
                    &self.embed,
                    c.vocab_size,
                    hidden,
                    &mut logits,
                    false,
                );
                logits
            }
        }
    }
}
