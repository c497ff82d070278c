//! `tandem eval logits` and the model-family dispatch of `tandem generate`: single-process
//! runs whose output is compared against transformers (token ids, raw f32 logits).

use anyhow::{bail, Context, Result};
use std::path::Path;
use tandem_core::BlockId;
use tandem_engine::backend::HybridOps;
use tandem_engine::batch::ForwardBatch;
use tandem_engine::models::kda_hybrid::served::KdaModel;
use tandem_engine::models::kda_hybrid::LoadOptions;
use tandem_engine::{DType, KvCache, LlamaModel};

pub use tandem_model::Family;

/// The parallel layout asked for on the command line.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct LayoutArgs {
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Attention data-parallel groups.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Expert-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
}

/// The checkpoint's serving facts (`config.json`, read once).
pub fn card(dir: &Path) -> Result<tandem_model::ModelCard> {
    Ok(tandem_model::ModelCard::read(dir)?)
}

/// The model family of the checkpoint in `dir`, from its `model_type`.
pub fn family(dir: &Path) -> Result<Family> {
    Ok(card(dir)?.family)
}

/// The checked layout of the command line.
pub fn checked_layout(layout: LayoutArgs) -> Result<tandem_topology::Layout> {
    tandem_topology::Layout::new(layout.tp, layout.dp, layout.ep)
        .map_err(|e| anyhow::anyhow!("bad layout: {e}"))
}

/// The tensor-parallel size of a layout for a Llama-family model (these shard by TP only).
pub fn llama_tp(layout: LayoutArgs) -> Result<usize> {
    let l = checked_layout(layout)?;
    if l.dp() != 1 || layout.ep != 1 {
        bail!("llama models shard by --tp only (--dp and --ep are for KDA-hybrid models)");
    }
    Ok(l.tp())
}

/// The `tp` tensor-parallel shards of the Llama-family checkpoint `dir`, as threads of this
/// process on `backend`'s device: rank 0 on `backend`, every other rank on a stream of its own
/// there (on a GPU the ranks meet through host memory until NCCL joins them).
pub fn llama_shards<B: HybridOps>(
    dir: &Path,
    dtype: DType,
    tp: usize,
    backend: &B,
) -> Result<Vec<LlamaModel<B>>> {
    let rank_backend = |r: usize| match r {
        0 => Ok(backend.clone()),
        _ => backend.new_stream(),
    };
    tandem_engine::models::llama::served::in_process_shards(dir, dtype, tp, rank_backend)
        .with_context(|| format!("loading {} as {tp} shards", dir.display()))
}

/// A computation over a loaded KDA-hybrid model, written once for every backend.
pub trait WithKdaModel {
    /// What it produces.
    type Out;
    /// Runs on `model`.
    fn run<B: HybridOps>(self, model: KdaModel<B>) -> Result<Self::Out>;
}

/// Loads a KDA-hybrid checkpoint for a layout on the backend it is given, then runs `body`.
struct LoadKda<'a, W> {
    dir: &'a Path,
    layout: tandem_topology::Layout,
    options: LoadOptions,
    body: W,
}

impl<W: WithKdaModel> crate::device::WithBackend for LoadKda<'_, W> {
    type Out = W::Out;
    fn run<B: HybridOps>(self, backend: B) -> Result<W::Out> {
        // Rank 0 on the device opened; every other rank on a stream of its own there.
        let rank_backend = |r: tandem_topology::Rank| match r.0 {
            0 => Ok(backend.clone()),
            _ => backend.new_stream(),
        };
        let model = KdaModel::load_on(rank_backend, self.dir, self.layout, &self.options)
            .with_context(|| format!("loading {}", self.dir.display()))?;
        tracing::info!(backend = %tandem_engine::Backend::name(&backend), layout = %self.layout, "model loaded");
        self.body.run(model)
    }
}

/// Loads the KDA-hybrid checkpoint `dir` for `layout` on `device` (`lora` merged, weights in
/// `dtype`) and runs `body` on it. A layout's ranks are threads of this process; on a GPU they
/// share the one device, a stream each, and meet through host memory (no NCCL yet).
pub fn run_kda<W: WithKdaModel>(
    dir: &Path,
    layout: LayoutArgs,
    lora: Option<&Path>,
    dtype: DType,
    device: crate::device::Device,
    body: W,
) -> Result<W::Out> {
    let layout = checked_layout(layout)?;
    let options = LoadOptions {
        lora: lora.map(Path::to_path_buf),
        dtype,
        ..LoadOptions::default()
    };
    device.run(LoadKda {
        dir,
        layout,
        options,
        body,
    })
}

/// Logits of a full forward of a KDA-hybrid model, and its vocabulary size.
struct KdaLogits<'a>(&'a [u32]);

impl WithKdaModel for KdaLogits<'_> {
    type Out = (Vec<f32>, usize);
    fn run<B: HybridOps>(self, model: KdaModel<B>) -> Result<Self::Out> {
        model.validate_tokens(self.0)?;
        Ok((model.forward_full(self.0)?, model.config().vocab_size))
    }
}

/// Greedy generation of a KDA-hybrid model.
struct KdaGreedy<'a> {
    prompt: &'a [u32],
    max_tokens: u32,
    eos: Vec<u32>,
}

impl WithKdaModel for KdaGreedy<'_> {
    type Out = Vec<u32>;
    fn run<B: HybridOps>(self, model: KdaModel<B>) -> Result<Vec<u32>> {
        Ok(model.greedy(self.prompt, self.max_tokens as usize, &self.eos)?)
    }
}

/// Logits `[T][vocab]` of a full forward over `ids`.
pub fn logits(
    dir: &Path,
    ids: &[u32],
    layout: LayoutArgs,
    dtype: crate::DtypeArg,
    device: crate::device::Device,
) -> Result<Vec<Vec<f32>>> {
    let (flat, vocab) = match family(dir)? {
        Family::Llama => {
            let tp = llama_tp(layout)?;
            device.run(LlamaLogits {
                dir,
                ids,
                dtype,
                tp,
            })?
        }
        Family::KdaHybrid => run_kda(dir, layout, None, dtype.dtype(), device, KdaLogits(ids))?,
    };
    Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
}

/// Logits of a full forward on `tp` ranks.
fn llama_logits_tp<B: HybridOps>(
    dir: &Path,
    ids: &[u32],
    dtype: crate::DtypeArg,
    tp: usize,
    backend: &B,
) -> Result<(Vec<f32>, usize)> {
    let shards = llama_shards(dir, dtype.dtype(), tp, backend)?;
    let vocab = shards[0].config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary ({vocab})");
    }
    let block = 16;
    let blocks = ids.len().div_ceil(block).max(1);
    let limits = tandem_engine::StepLimits {
        max_tokens: ids.len(),
        max_seqs: ids.len(),
        max_blocks_per_seq: blocks,
    };
    let mut ranks = tandem_engine::LlamaRanks::new(shards, limits, block, blocks)?;
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let mut batch = ForwardBatch::default();
    batch.push(ids, 0, &table, block, false);
    batch.logits_rows = (0..ids.len()).collect();
    ranks.step(&batch)?;
    let mut logits = tandem_engine::Backend::download(ranks.backend(), ranks.logits()).to_f32_vec();
    logits.truncate(ids.len() * vocab);
    Ok((logits, vocab))
}

struct LlamaLogits<'a> {
    dir: &'a Path,
    ids: &'a [u32],
    dtype: crate::DtypeArg,
    tp: usize,
}

impl crate::device::WithBackend for LlamaLogits<'_> {
    type Out = (Vec<f32>, usize);
    fn run<B: tandem_engine::backend::HybridOps>(self, backend: B) -> Result<(Vec<f32>, usize)> {
        if self.tp > 1 {
            return llama_logits_tp(self.dir, self.ids, self.dtype, self.tp, &backend);
        }
        let ids = self.ids;
        let model = LlamaModel::load(self.dir, backend, self.dtype.dtype())?;
        let vocab = model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary ({vocab})");
        }
        let block = 16;
        let blocks = ids.len().div_ceil(block).max(1);
        let mut cache = KvCache::new(model.backend(), model.kv_layout(block, blocks));
        let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
        let mut batch = ForwardBatch::default();
        batch.push(ids, 0, &table, block, false);
        batch.logits_rows = (0..ids.len()).collect();
        Ok((model.forward_batch(&batch, &mut cache)?, vocab))
    }
}

/// Greedy generation of up to `max_tokens` for a KDA-hybrid model (stops at EOS).
pub fn generate_kda(
    dir: &Path,
    prompt: &[u32],
    max_tokens: u32,
    layout: LayoutArgs,
    lora: Option<&Path>,
    dtype: DType,
    device: crate::device::Device,
) -> Result<Vec<u32>> {
    let body = KdaGreedy {
        prompt,
        max_tokens,
        eos: card(dir)?.eos_token_ids,
    };
    run_kda(dir, layout, lora, dtype, device, body)
}
