//! The whole decoder: embedding, the per-layer mix of KDA / MLA token mixers and dense / MoE
//! FFNs, the residual (single stream or mHC), final norm and LM head — plus the per-request
//! state ([`KdaHybridState`]) that makes prefill followed by decode steps equal one pass.
//!
//! A pass takes a batch of requests (their tokens flattened into one set of rows, each with its
//! own state), f32 on the CPU, GEMMs through the CPU backend. The state's parts are
//! public so they can be exported after prefill and imported on a decode worker.

use super::config::{AttentionKind, FfnKind, KdaHybridConfig};
use super::kda::{KdaForm, KdaLayer, KdaState};
use super::loading::{FusionInputs, LoadOptions, RankShard, Upload};
use super::mla::MlaLayer;
use super::moe::{Moe, SwiGlu};
use super::projection::project;
use super::residual::{HyperConnection, Residual};
use super::weights::Checkpoint;
use crate::backend::hybrid::{At, HybridOps};
use crate::backend::latents::MlaState;
use crate::backend::{Backend, CpuBackend, Linear, Ops};
use crate::tensor::{DType, HostTensor, Tensor};
use crate::{Error, Result};
use std::path::Path;
use tandem_model::fusion::QuantizationConfig;

/// A layer's token mixer.
#[derive(Debug)]
pub enum Attention<B: Ops = CpuBackend> {
    /// Linear attention.
    Kda(KdaLayer<B>),
    /// Full attention.
    Mla(MlaLayer<B>),
}

/// A layer's feed-forward block.
#[derive(Debug)]
pub enum Ffn<B: Ops = CpuBackend> {
    /// One SwiGLU MLP.
    Dense(SwiGlu<B>),
    /// Routed + shared experts.
    Moe(Box<Moe<B>>),
}

#[derive(Debug)]
struct DecoderLayer<B: Ops> {
    input_norm: Tensor<B>,
    attention: Attention<B>,
    post_norm: Tensor<B>,
    ffn: Ffn<B>,
    hc_attn: Option<HyperConnection<B>>,
    hc_ffn: Option<HyperConnection<B>>,
}

/// One layer's part of a request's state.
#[derive(Debug)]
pub enum LayerState<B: Ops = CpuBackend> {
    /// Fixed-size KDA state.
    Kda(KdaState<B>),
    /// Growing MLA latent cache.
    Mla(MlaState<B>),
}

impl Clone for LayerState {
    fn clone(&self) -> Self {
        match self {
            Self::Kda(k) => Self::Kda(k.clone()),
            Self::Mla(m) => Self::Mla(m.clone()),
        }
    }
}

impl PartialEq for LayerState {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Kda(a), Self::Kda(b)) => a == b,
            (Self::Mla(a), Self::Mla(b)) => a == b,
            _ => false,
        }
    }
}

/// Everything a request carries between forward calls: one entry per decoder layer, in order.
#[derive(Debug)]
pub struct KdaHybridState<B: Ops = CpuBackend> {
    /// Per-layer state.
    pub layers: Vec<LayerState<B>>,
    /// Tokens consumed so far.
    pub tokens: usize,
}

impl<B: Ops> Default for KdaHybridState<B> {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            tokens: 0,
        }
    }
}

impl Clone for KdaHybridState {
    fn clone(&self) -> Self {
        Self {
            layers: self.layers.clone(),
            tokens: self.tokens,
        }
    }
}

impl PartialEq for KdaHybridState {
    fn eq(&self, other: &Self) -> bool {
        self.layers == other.layers && self.tokens == other.tokens
    }
}

impl<B: Ops> KdaHybridState<B> {
    /// Layer `i`'s KDA state, if layer `i` is a KDA layer.
    pub fn kda(&self, i: usize) -> Option<&KdaState<B>> {
        match self.layers.get(i) {
            Some(LayerState::Kda(s)) => Some(s),
            _ => None,
        }
    }

    /// Layer `i`'s MLA cache, if layer `i` is an MLA layer.
    pub fn mla(&self, i: usize) -> Option<&MlaState<B>> {
        match self.layers.get(i) {
            Some(LayerState::Mla(s)) => Some(s),
            _ => None,
        }
    }
}

/// A loaded Kimi-Linear / GLM-5.3-Flash style hybrid model (one rank: tp1, or one shard of a
/// layout) on backend `B` (the CPU by default).
#[derive(Debug)]
pub struct KdaHybridModel<B: HybridOps = CpuBackend> {
    backend: B,
    config: KdaHybridConfig,
    /// `[vocab, hidden]`, in the weights' dtype.
    embed: Tensor<B>,
    layers: Vec<DecoderLayer<B>>,
    norm: Tensor<B>,
    lm_head: Option<Linear<B>>,
    /// How it was loaded (reused by [`KdaHybridModel::refresh_weights`]).
    options: LoadOptions,
    /// The checkpoint's block-FP8 matrices: held as FP8, dequantised at load.
    block_fp8: [usize; 2],
}

/// Opens `dir` for loading: the checked config, the tensors (FP8 dequantised, the LoRA of
/// `options` merged) and the inputs of the per-layer fusion decision.
pub(crate) fn open_checkpoint(
    dir: &Path,
    options: &LoadOptions,
) -> Result<(KdaHybridConfig, Checkpoint, FusionInputs)> {
    let config = KdaHybridConfig::from_dir(dir)?;
    let path = dir.join("config.json");
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?)
        .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
    let mut ck = Checkpoint::load_dir(dir)?;
    let lora = match &options.lora {
        Some(l) => Some(ck.merge_lora(l)?),
        None => None,
    };
    let fusion = FusionInputs {
        quant: QuantizationConfig::from_config(&raw),
        lora,
        policy: options.fusion,
    };
    Ok((config, ck, fusion))
}

/// The collectives one rank of a sharded layout runs inside a forward pass (none at tp1).
pub(crate) trait RankCollectives<B: Ops> {
    /// Sums the first `n` values of attention partial outputs over the attention-TP group.
    fn attn_all_reduce(&self, backend: &B, buf: &mut Tensor<B>, n: usize) -> Result<()>;
    /// Runs the (sharded) FFN `f` on the tokens of every attention-DP group and returns the
    /// summed result for this rank's own `rows` tokens.
    fn ffn(
        &self,
        backend: &B,
        x: &Tensor<B>,
        rows: usize,
        hidden: usize,
        f: &dyn Fn(&Tensor<B>, usize) -> Tensor<B>,
    ) -> Result<Tensor<B>>;
}

impl KdaHybridModel {
    /// Loads `dir/config.json` and `dir/model*.safetensors` (F32 / BF16 / F16 / block-FP8,
    /// run in f32) onto the CPU, fusing eligible KDA projections.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &LoadOptions::default())
    }

    /// [`KdaHybridModel::load`] with a PEFT LoRA adapter merged in (`None`: none). Projection
    /// groups the adapter targets stay unfused.
    pub fn load_with_lora(dir: &Path, lora: Option<&Path>) -> Result<Self> {
        Self::load_with(
            dir,
            &LoadOptions {
                lora: lora.map(Path::to_path_buf),
                ..LoadOptions::default()
            },
        )
    }

    /// Loads onto the CPU with explicit [`LoadOptions`].
    pub fn load_with(dir: &Path, options: &LoadOptions) -> Result<Self> {
        Self::load_on(CpuBackend::new(), dir, options)
    }
}

impl<B: HybridOps> KdaHybridModel<B> {
    /// Loads `dir` onto `backend` with `options`.
    pub fn load_on(backend: B, dir: &Path, options: &LoadOptions) -> Result<Self> {
        let (config, mut ck, fusion) = open_checkpoint(dir, options)?;
        let rs = RankShard::whole(config.moe.num_experts);
        let model = Self::build(backend, config, &mut ck, &rs, &fusion, options.clone())?;
        ck.finish(model.config.num_layers())?;
        Ok(model)
    }

    /// Re-reads the weights from `dir` (same options). Fused KDA buffers are rewritten in place
    /// when their size is unchanged, so their addresses stay valid (captured CUDA graphs); a
    /// size or form change allocates new ones, logged, and callers must recapture.
    pub fn refresh_weights(&mut self, dir: &Path) -> Result<()> {
        let fresh = Self::load_on(self.backend.clone(), dir, &self.options)?;
        self.adopt(fresh);
        Ok(())
    }

    /// The load options this model was built with.
    pub fn options(&self) -> &LoadOptions {
        &self.options
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Becomes `fresh` (a reload of the same model, same shard), keeping this model's fused
    /// KDA buffers (rewritten in place) and its latent pool.
    pub(crate) fn adopt(&mut self, mut fresh: Self) {
        for (i, (old, new)) in self.layers.iter_mut().zip(&mut fresh.layers).enumerate() {
            if let (Attention::Kda(old), Attention::Kda(new)) =
                (&mut old.attention, &mut new.attention)
            {
                new.adopt_buffers(&self.backend, old, i);
            }
        }
        // Requests in flight keep their latent blocks; new ones keep drawing from the same pool.
        let pool = self.layers.iter().find_map(|l| match &l.attention {
            Attention::Mla(m) => Some(m.latent_pool()),
            Attention::Kda(_) => None,
        });
        if let Some(pool) = pool {
            fresh.set_latent_pool(&pool);
        }
        *self = fresh;
    }

    /// Builds one rank's model (`rs`) from an opened checkpoint; does not run the leftover
    /// check (the caller does, after its last rank).
    pub(crate) fn build(
        backend: B,
        config: KdaHybridConfig,
        ck: &mut Checkpoint,
        rs: &RankShard,
        fusion: &FusionInputs,
        options: LoadOptions,
    ) -> Result<Self> {
        let c = &config;
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps);
        let up = Upload::new(&backend, options.dtype);
        if !matches!(options.dtype, DType::F32 | DType::BF16) {
            return Err(Error::InvalidRequest(format!(
                "KDA-hybrid weights run in f32 or bf16, not {}",
                options.dtype
            )));
        }
        let prefix = ck.prefix.clone();
        let mut layers = Vec::with_capacity(c.num_layers());
        for (i, spec) in c.layers.iter().enumerate() {
            let lp = format!("{prefix}layers.{i}");
            let attn = format!("{lp}.self_attn");
            let attention = match spec.attention {
                AttentionKind::Kda => Attention::Kda(KdaLayer::load(
                    ck, &attn, c.kda, hidden, eps, rs, fusion, &up,
                )?),
                AttentionKind::Mla => {
                    Attention::Mla(MlaLayer::load(ck, &attn, c.mla, (hidden, rs.mla), &up)?)
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
                        ck,
                        &names,
                        (hidden, c.intermediate_size),
                        c.swiglu_limit,
                        rs.dense,
                        &up,
                    )?)
                }
                FfnKind::Moe => {
                    let block = if ck.has(&format!("{lp}.block_sparse_moe.gate.weight")) {
                        format!("{lp}.block_sparse_moe")
                    } else {
                        format!("{lp}.mlp")
                    };
                    Ffn::Moe(Box::new(Moe::load(
                        ck,
                        &block,
                        c.moe,
                        hidden,
                        c.swiglu_limit,
                        rs,
                        &up,
                    )?))
                }
            };
            layers.push(DecoderLayer {
                input_norm: up.f32(ck.take(&format!("{lp}.input_layernorm.weight"), &[hidden])?),
                attention,
                post_norm: up
                    .f32(ck.take(&format!("{lp}.post_attention_layernorm.weight"), &[hidden])?),
                ffn,
                hc_attn: HyperConnection::load(ck, (&lp, "attn"), c.residual, hidden, eps, &up)?,
                hc_ffn: HyperConnection::load(ck, (&lp, "ffn"), c.residual, hidden, eps, &up)?,
            });
        }
        let embed = up.table(
            ck.take(
                &format!("{prefix}embed_tokens.weight"),
                &[c.vocab_size, hidden],
            )?,
            c.vocab_size,
            hidden,
        );
        let norm = up.f32(ck.take(&format!("{prefix}norm.weight"), &[hidden])?);
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            let shape = [c.vocab_size, hidden];
            Some(up.matrix(ck, &["lm_head.weight"], shape, 0, 0..c.vocab_size)?)
        };
        if rs.log {
            up.log_fp8();
        }
        let block_fp8 = up.fp8_counts();
        Ok(Self {
            backend,
            config,
            embed,
            layers,
            norm,
            lm_head,
            options,
            block_fp8,
        })
    }

    /// How many of the checkpoint's block-FP8 weight matrices this model (rank) holds as FP8
    /// and how many it dequantised at load: `[fp8, dequantised]`.
    pub fn block_fp8_matrices(&self) -> [usize; 2] {
        self.block_fp8
    }

    /// The checked configuration.
    pub fn config(&self) -> &KdaHybridConfig {
        &self.config
    }

    /// Layer `i`'s token mixer.
    pub fn attention(&self, i: usize) -> Option<&Attention<B>> {
        self.layers.get(i).map(|l| &l.attention)
    }

    /// Layer `i`'s KDA layer, if it is one.
    pub fn kda_layer(&self, i: usize) -> Option<&KdaLayer<B>> {
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

    /// Makes new states take their MLA latent blocks from `pool` (the worker's paged pool).
    pub fn set_latent_pool(&mut self, pool: &crate::backend::latents::LatentPool) {
        for layer in &mut self.layers {
            if let Attention::Mla(m) = &mut layer.attention {
                m.set_latent_pool(pool.clone());
            }
        }
    }

    /// A fresh per-request state (MLA latents draw blocks from the latent pool).
    pub fn new_state(&self) -> KdaHybridState<B> {
        KdaHybridState {
            layers: self
                .layers
                .iter()
                .map(|l| match &l.attention {
                    Attention::Kda(k) => LayerState::Kda(k.new_state(&self.backend)),
                    Attention::Mla(m) => LayerState::Mla(m.new_state(&self.backend)),
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
    pub fn prefill(&self, ids: &[u32], state: &mut KdaHybridState<B>) -> Vec<f32> {
        self.extend(ids, state, KdaForm::Chunked, false)
    }

    /// Consumes one token (recurrent KDA) and returns its logits `[vocab]`.
    pub fn decode_step(&self, id: u32, state: &mut KdaHybridState<B>) -> Vec<f32> {
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
        state: &mut KdaHybridState<B>,
        form: KdaForm,
        all_logits: bool,
    ) -> Vec<f32> {
        let mut trace = None;
        self.run(
            &[ids],
            &mut [state],
            form,
            LogitRows::every_or_last(all_logits),
            &mut trace,
            None,
        )
        .expect("a single rank runs no collectives, so nothing can fail")
        .to_host(&self.backend, self.config.vocab_size)
        .pop()
        .unwrap_or_default()
    }

    /// Consumes `ids[i]` into `states[i]` for several sequences in one pass (their tokens
    /// share every GEMM); returns each sequence's last-position logits (empty for a sequence
    /// given no tokens).
    ///
    /// # Panics
    /// As [`KdaHybridModel::extend`], and if `ids` and `states` differ in length.
    pub fn extend_batch(
        &self,
        ids: &[&[u32]],
        states: &mut [&mut KdaHybridState<B>],
        form: KdaForm,
    ) -> Vec<Vec<f32>> {
        self.extend_batch_logits(ids, states, form, None)
            .to_host(&self.backend, self.config.vocab_size)
    }

    /// [`KdaHybridModel::extend_batch`] with the logits left on the model's backend: a row
    /// per sequence given tokens (with `wants`, only for those whose `wants[i]`).
    ///
    /// # Panics
    /// As [`KdaHybridModel::extend_batch`], and if `wants` is shorter than `ids`.
    pub fn extend_batch_logits(
        &self,
        ids: &[&[u32]],
        states: &mut [&mut KdaHybridState<B>],
        form: KdaForm,
        wants: Option<&[bool]>,
    ) -> StepLogits<B> {
        let mut trace = None;
        let rows = wants.map_or(LogitRows::Last, LogitRows::LastOf);
        self.run(ids, states, form, rows, &mut trace, None)
            .expect("a single rank runs no collectives, so nothing can fail")
    }

    /// The residual after every layer for a pass over `ids` from an empty state (`[T, hidden]`,
    /// or `[T, N, hidden]` under mHC), for layer-by-layer comparison with a reference.
    pub fn residual_trace(&self, ids: &[u32]) -> Vec<Vec<f32>> {
        let mut trace = Some(Vec::new());
        let mut state = self.new_state();
        self.run(
            &[ids],
            &mut [&mut state],
            KdaForm::Chunked,
            LogitRows::Last,
            &mut trace,
            None,
        )
        .expect("a single rank runs no collectives, so nothing can fail");
        trace.unwrap_or_default()
    }

    /// The forward pass over a batch of sequences (`ids[i]` continues `states[i]`), their
    /// tokens flattened into one set of rows; `comm` is `Some` on a rank of a sharded layout.
    /// With `comm`, the batch may be empty (an attention-DP group with nothing to do still
    /// joins the FFN collectives). Returns the logits of the positions `logit_rows` asks for, on the
    /// model's backend.
    pub(crate) fn run(
        &self,
        ids: &[&[u32]],
        states: &mut [&mut KdaHybridState<B>],
        form: KdaForm,
        logit_rows: LogitRows<'_>,
        trace: &mut Option<Vec<Vec<f32>>>,
        comm: Option<&dyn RankCollectives<B>>,
    ) -> Result<StepLogits<B>> {
        // A decode step of one rank: its device work repeats from step to step (the tables of
        // state and latent addresses change, the launches do not), which a backend may replay.
        let decode = ids.iter().all(|s| s.len() <= 1) && ids.iter().any(|s| s.len() == 1);
        if decode && comm.is_none() && trace.is_none() {
            let mut out = None;
            self.backend.run_traced(&mut || {
                out = Some(self.forward_pass(ids, states, form, logit_rows, &mut None, None));
            });
            return out.unwrap_or_else(|| {
                Err(crate::Error::Device(
                    "the backend did not run the traced step".into(),
                ))
            });
        }
        self.forward_pass(ids, states, form, logit_rows, trace, comm)
    }

    /// [`KdaHybridModel::run`]'s pass.
    fn forward_pass(
        &self,
        ids: &[&[u32]],
        states: &mut [&mut KdaHybridState<B>],
        form: KdaForm,
        logit_rows: LogitRows<'_>,
        trace: &mut Option<Vec<Vec<f32>>>,
        comm: Option<&dyn RankCollectives<B>>,
    ) -> Result<StepLogits<B>> {
        let b = &self.backend;
        let c = &self.config;
        let segments: Vec<usize> = ids.iter().map(|s| s.len()).collect();
        let (hidden, eps, rows) = (c.hidden_size, c.rms_norm_eps, segments.iter().sum());
        assert_eq!(ids.len(), states.len(), "one state per sequence");
        if rows == 0 && comm.is_none() {
            return Ok(StepLogits::none(ids.len()));
        }
        for state in states.iter() {
            assert_eq!(
                state.layers.len(),
                self.layers.len(),
                "state was not made by this model"
            );
        }
        let flat: Vec<u32> = ids.iter().flat_map(|s| s.iter().copied()).collect();
        if let Some(id) = flat.iter().find(|&&id| id as usize >= c.vocab_size) {
            panic!("token id {id} outside the vocabulary (check with validate_tokens)");
        }
        let mut embedded = b.zeros(DType::F32, &[rows, hidden]);
        if rows > 0 {
            b.embed(
                &self.embed,
                &b.upload(&HostTensor::from_u32(flat)),
                rows,
                &mut embedded,
            );
        }
        let normed = |x: &Tensor<B>, w: &Tensor<B>| {
            let mut h = b.zeros(DType::F32, &[rows, hidden]);
            if rows > 0 {
                b.rms_norm(x, w, rows, eps, &mut h);
            }
            h
        };
        let mut residual = Residual::new(b, embedded, rows, c.residual, hidden);
        for (li, layer) in self.layers.iter().enumerate() {
            let (x, mix) = residual.enter(b, layer.hc_attn.as_ref(), rows, hidden);
            let h = normed(&x, &layer.input_norm);
            let kinds_differ =
                || -> ! { panic!("state was not made by this model (layer kinds differ)") };
            let mut a = match &layer.attention {
                Attention::Kda(l) => {
                    let mut st: Vec<&mut KdaState<B>> = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Kda(k) => k,
                            LayerState::Mla(_) => kinds_differ(),
                        })
                        .collect();
                    l.forward_batch(b, &h, &segments, &mut st, form)
                }
                Attention::Mla(l) => {
                    let mut st: Vec<&mut MlaState<B>> = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Mla(m) => m,
                            LayerState::Kda(_) => kinds_differ(),
                        })
                        .collect();
                    l.forward_batch(b, &h, &segments, &mut st)
                }
            };
            if let Some(comm) = comm {
                comm.attn_all_reduce(b, &mut a, rows * hidden)?;
            }
            residual.leave(b, &a, mix, rows, hidden);
            let (x, mix) = residual.enter(b, layer.hc_ffn.as_ref(), rows, hidden);
            let h = normed(&x, &layer.post_norm);
            let ffn = |x: &Tensor<B>, n: usize| match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(b, x, n),
                Ffn::Moe(moe) => moe.forward(b, x, n),
            };
            let f = match comm {
                None => ffn(&h, rows),
                Some(comm) => comm.ffn(b, &h, rows, hidden, &ffn)?,
            };
            residual.leave(b, &f, mix, rows, hidden);
            if let Some(t) = trace.as_mut() {
                t.push(b.download(residual.raw()).to_f32_vec());
            }
        }
        for (state, &n) in states.iter_mut().zip(&segments) {
            state.tokens += n;
        }
        if rows == 0 {
            return Ok(StepLogits::none(ids.len()));
        }
        // The rows whose logits are wanted, and how many belong to each sequence.
        let out = residual.output(b, rows, hidden);
        let mut picks = Vec::new();
        let mut counts = Vec::with_capacity(segments.len());
        let mut end = 0;
        for (i, &n) in segments.iter().enumerate() {
            end += n;
            let take = match logit_rows {
                LogitRows::Every => n,
                LogitRows::Last => n.min(1),
                LogitRows::LastOf(wants) => usize::from(wants[i] && n > 0),
            };
            picks.push((end - take, take));
            counts.push(take);
        }
        let n: usize = counts.iter().sum();
        if n == 0 {
            // Nothing samples this step (prompt chunks before their last).
            return Ok(StepLogits {
                tensor: None,
                counts,
            });
        }
        let mut picked = b.zeros(DType::F32, &[n, hidden]);
        let mut at = 0;
        for (from, take) in picks {
            let src = At {
                row: from,
                col: 0,
                stride: hidden,
            };
            let dst = At {
                row: at,
                col: 0,
                stride: hidden,
            };
            b.copy_block(&out, src, &mut picked, dst, take, hidden);
            at += take;
        }
        let mut normed = b.zeros(DType::F32, &[n, hidden]);
        b.rms_norm(&picked, &self.norm, n, eps, &mut normed);
        let vocab = c.vocab_size;
        let logits = match &self.lm_head {
            Some(head) => project(b, &normed, n, head),
            None => {
                let mut logits = b.zeros(DType::F32, &[n, vocab]);
                b.matmul(&normed, n, &self.embed, vocab, hidden, &mut logits, false);
                logits
            }
        };
        Ok(StepLogits {
            tensor: Some(logits),
            counts,
        })
    }
}

/// Which positions of a step get logits.
#[derive(Clone, Copy, Debug)]
pub enum LogitRows<'a> {
    /// Every new position (scoring a whole prompt).
    Every,
    /// Each sequence's last one.
    Last,
    /// The last one of each sequence `i` whose `wants[i]` (the rest sample nothing: a prompt
    /// chunk before the last).
    LastOf(&'a [bool]),
}

impl LogitRows<'_> {
    /// `Every` when `all`, else `Last`.
    pub fn every_or_last(all: bool) -> Self {
        if all {
            Self::Every
        } else {
            Self::Last
        }
    }
}

/// A step's logits where the step left them: `counts[i]` rows for sequence `i`, in sequence
/// order, in `tensor` (`[Σ counts, vocab]`; `None` when no row was wanted).
#[derive(Debug)]
pub struct StepLogits<B: Backend> {
    /// The rows, on the model's backend.
    pub tensor: Option<Tensor<B>>,
    /// Rows per sequence.
    pub counts: Vec<usize>,
}

impl<B: Backend> StepLogits<B> {
    /// No rows for `sequences` sequences.
    pub fn none(sequences: usize) -> Self {
        Self {
            tensor: None,
            counts: vec![0; sequences],
        }
    }

    /// The rows read back to the host, split by sequence.
    pub fn to_host(&self, b: &B, vocab: usize) -> Vec<Vec<f32>> {
        let all = self
            .tensor
            .as_ref()
            .map(|t| b.download(t).to_f32_vec())
            .unwrap_or_default();
        let mut at = 0;
        self.counts
            .iter()
            .map(|&k| {
                let rows = all[at * vocab..(at + k) * vocab].to_vec();
                at += k;
                rows
            })
            .collect()
    }
}
