//! One loader for every model family: `config.json` read once (the checkpoint's
//! [`ModelCard`]), the family picked from its `model_type`, the weights loaded on the ranks of
//! a layout. What the worker, the CLI and the benches start from: serving it
//! ([`Loaded::serve`]), scoring a sequence ([`Loaded::logits`]) or continuing one greedily
//! ([`Loaded::greedy`]).

use crate::backend::hybrid::HybridOps;
use crate::batch::ForwardBatch;
use crate::models::kda_hybrid::served::{KdaModel, KdaServed};
use crate::models::kda_hybrid::LoadOptions;
use crate::models::llama::served::in_process_shards;
use crate::{DType, Engine, EngineConfig, Error, KvCache, LlamaModel, LlamaRanks, Result};
use std::path::{Path, PathBuf};
use tandem_core::BlockId;
use tandem_model::ModelCard;
use tandem_topology::{Layout, Rank};

/// How to load a checkpoint.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// The ranks' layout (Llama-family models shard by TP only).
    pub layout: Layout,
    /// The dtype the weights run in.
    pub dtype: DType,
    /// A PEFT LoRA adapter to merge (KDA-hybrid models only).
    pub lora: Option<PathBuf>,
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self {
            layout: Layout::single(),
            dtype: DType::F32,
            lora: None,
        }
    }
}

/// A family's loaded model on backend `B`.
pub enum Model<B: HybridOps> {
    /// A Llama-family model: one shard per tensor-parallel rank, in rank order.
    Llama(Vec<LlamaModel<B>>),
    /// A KDA-hybrid model over its layout.
    KdaHybrid(KdaModel<B>),
}

/// A checkpoint loaded by [`load`]: its card and its model.
pub struct Loaded<B: HybridOps> {
    /// The serving facts of `config.json`.
    pub card: ModelCard,
    /// The model.
    pub model: Model<B>,
}

/// Loads the checkpoint in `dir` as `spec` asks, each rank on the backend `backend(rank)`
/// opens (rank 0 first; ranks may share a device).
pub fn load<B: HybridOps>(
    dir: &Path,
    mut backend: impl FnMut(Rank) -> Result<B>,
    spec: &LoadSpec,
) -> Result<Loaded<B>> {
    let card = ModelCard::read(dir)?;
    let model = match card.family {
        tandem_model::Family::Llama => {
            let l = spec.layout;
            if l.dp() != 1 || l.ep() != 1 {
                return Err(Error::InvalidRequest(format!(
                    "layout {l}: Llama-family models shard by tensor parallelism only (dp and \
                     ep are for KDA-hybrid models)"
                )));
            }
            if spec.lora.is_some() {
                return Err(Error::InvalidRequest(
                    "LoRA adapters are supported for KDA-hybrid models only".into(),
                ));
            }
            Model::Llama(in_process_shards(dir, spec.dtype, l.tp(), |r| {
                backend(Rank(r))
            })?)
        }
        tandem_model::Family::KdaHybrid => {
            let options = LoadOptions {
                lora: spec.lora.clone(),
                dtype: spec.dtype,
                ..LoadOptions::default()
            };
            Model::KdaHybrid(KdaModel::load_on(backend, dir, spec.layout, &options)?)
        }
    };
    Ok(Loaded { card, model })
}

impl<B: HybridOps> Loaded<B> {
    /// Which family it is.
    pub fn family(&self) -> tandem_model::Family {
        self.card.family
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match &self.model {
            Model::Llama(shards) => shards.first().map_or(0, |m| m.config().vocab_size),
            Model::KdaHybrid(m) => m.config().vocab_size,
        }
    }

    /// The backend of rank 0, named for logs.
    pub fn backend_name(&self) -> String {
        match &self.model {
            Model::Llama(shards) => shards.first().map(|m| m.backend().name()),
            Model::KdaHybrid(KdaModel::Single(m)) => Some(m.backend().name()),
            Model::KdaHybrid(KdaModel::Sharded(s)) => s.rank(Rank(0)).map(|m| m.backend().name()),
        }
        .unwrap_or_default()
    }

    /// Starts the engine thread serving it with `config` (EOS ids and the context served from
    /// the card; a KDA-hybrid model with a sparse indexer is served up to its exact limit).
    pub fn serve(self, config: EngineConfig) -> Result<Engine> {
        match self.model {
            Model::Llama(shards) => Engine::start_sharded(shards, config),
            Model::KdaHybrid(model) => {
                let exact = model.config().mla.indexer.map(|ix| ix.topk);
                let context = self.card.context_length(4096, exact);
                KdaServed::start(model, config, self.card.eos_token_ids, context)
            }
        }
    }

    /// Logits `[ids.len() × vocab]` of one pass over `ids` from an empty cache.
    pub fn logits(self, ids: &[u32]) -> Result<Vec<f32>> {
        let vocab = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        match self.model {
            Model::Llama(mut shards) => {
                let block = 16;
                let blocks = ids.len().div_ceil(block).max(1);
                let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
                let mut batch = ForwardBatch::default();
                batch.push(ids, 0, &table, block, false);
                batch.logits_rows = (0..ids.len()).collect();
                if shards.len() == 1 {
                    let model = shards.remove(0);
                    let mut cache = KvCache::new(model.backend(), model.kv_layout(block, blocks));
                    return model.forward_batch(&batch, &mut cache);
                }
                let limits = crate::StepLimits {
                    max_tokens: ids.len(),
                    max_seqs: ids.len(),
                    max_blocks_per_seq: blocks,
                };
                let mut ranks = LlamaRanks::new(shards, limits, block, blocks)?;
                ranks.step(&batch)?;
                let mut logits =
                    crate::Backend::download(ranks.backend(), ranks.logits()).to_f32_vec();
                logits.truncate(ids.len() * vocab);
                Ok(logits)
            }
            Model::KdaHybrid(model) => model.forward_full(ids),
        }
    }

    /// Greedy continuation of `prompt`: up to `max_tokens` ids, ending at one of the card's EOS
    /// ids (included). Llama-family models generate through the engine ([`Loaded::serve`]).
    pub fn greedy(&self, prompt: &[u32], max_tokens: usize) -> Result<Vec<u32>> {
        match &self.model {
            Model::KdaHybrid(m) => m.greedy(prompt, max_tokens, &self.card.eos_token_ids),
            Model::Llama(_) => Err(Error::InvalidRequest(
                "greedy runs without the engine for KDA-hybrid models; serve a Llama-family \
                 model instead"
                    .into(),
            )),
        }
    }
}

impl<B: HybridOps> std::fmt::Debug for Loaded<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("card", &self.card)
            .field("backend", &self.backend_name())
            .finish_non_exhaustive()
    }
}
