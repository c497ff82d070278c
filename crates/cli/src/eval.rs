//! `tandem eval logits` and the model-family dispatch of `tandem generate`: single-process
//! runs whose output is compared against transformers (token ids, raw f32 logits).

use anyhow::{bail, Context, Result};
use std::path::Path;
use tandem_core::BlockId;
use tandem_engine::batch::ForwardBatch;
use tandem_engine::kda_hybrid::{KdaForm, KdaHybridModel, LoadOptions, ShardedKdaHybrid};
use tandem_engine::{DType, KvCache, LlamaModel, Ops};

/// The families the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `model_type` `llama`.
    Llama,
    /// `kimi_linear`, `glm5_next`.
    KdaHybrid,
}

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

fn config_json(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Which family a checkpoint belongs to.
pub fn family(dir: &Path) -> Result<Family> {
    let cfg = config_json(dir)?;
    match cfg.get("model_type").and_then(|v| v.as_str()) {
        Some("llama") | None => Ok(Family::Llama),
        Some("kimi_linear" | "glm5_next" | "glm5_next_text") => Ok(Family::KdaHybrid),
        Some(other) => {
            bail!("model_type {other:?} is not supported (llama, kimi_linear, glm5_next)")
        }
    }
}

/// EOS ids from `config.json` (int or list; GLM nests them under `text_config`).
/// `vocab_size` of `config.json` (its `text_config` for multimodal spellings).
pub fn vocab_size(dir: &Path) -> Result<usize> {
    let cfg = config_json(dir)?;
    let text = cfg.get("text_config").unwrap_or(&cfg);
    text.get("vocab_size")
        .and_then(serde_json::Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| anyhow::anyhow!("{}: config.json has no vocab_size", dir.display()))
}

pub fn eos_ids(dir: &Path) -> Result<Vec<u32>> {
    let cfg = config_json(dir)?;
    let eos = cfg
        .get("eos_token_id")
        .or_else(|| cfg.get("text_config").and_then(|t| t.get("eos_token_id")));
    Ok(match eos {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => Vec::new(),
    })
}

/// Context a KDA-hybrid checkpoint is served at: its configured length, capped where the
/// model is exact only up to a limit (GLM's sparse indexer).
pub fn context_length(dir: &Path, exact_limit: Option<usize>) -> Result<usize> {
    let cfg = config_json(dir)?;
    let text = cfg.get("text_config").unwrap_or(&cfg);
    let configured = ["max_position_embeddings", "model_max_length"]
        .iter()
        .find_map(|k| {
            text.get(*k)
                .or_else(|| cfg.get(*k))
                .and_then(serde_json::Value::as_u64)
        })
        .unwrap_or(4096) as usize;
    Ok(exact_limit.map_or(configured, |l| l.min(configured)))
}

/// The checked layout of the command line.
pub fn checked_layout(layout: LayoutArgs) -> Result<tandem_topology::Layout> {
    tandem_topology::Layout::new(layout.tp, layout.dp, layout.ep)
        .map_err(|e| anyhow::anyhow!("bad layout: {e}"))
}

/// The tensor-parallel size of a layout for a Llama-family model (these shard by TP only),
/// and whether `device` can run it.
pub fn llama_tp(layout: LayoutArgs, device: crate::device::Device) -> Result<usize> {
    let l = checked_layout(layout)?;
    if l.dp() != 1 || layout.ep != 1 {
        bail!("llama models shard by --tp only (--dp and --ep are for KDA-hybrid models)");
    }
    if l.tp() > 1 && device != crate::device::Device::Cpu {
        bail!(
            "--tp {} on {device}: GPU tensor parallelism needs the NCCL communicator, which is \
             not built yet (CPU ranks: --device cpu)",
            l.tp()
        );
    }
    Ok(l.tp())
}

/// A KDA-hybrid model on one rank or sharded over a layout (ranks are threads here). Every
/// attention-DP group runs the same sequence; group 0's result is reported and the others
/// must agree with it.
enum KdaRunner {
    Single(Box<KdaHybridModel>),
    Sharded(ShardedKdaHybrid),
}

impl KdaRunner {
    fn load(dir: &Path, layout: LayoutArgs, lora: Option<&Path>, dtype: DType) -> Result<Self> {
        let l = checked_layout(layout)?;
        let options = LoadOptions {
            lora: lora.map(Path::to_path_buf),
            dtype,
            ..LoadOptions::default()
        };
        Ok(if l.tp() == 1 {
            KdaRunner::Single(Box::new(KdaHybridModel::load_with(dir, &options)?))
        } else {
            KdaRunner::Sharded(
                ShardedKdaHybrid::load_with(
                    dir,
                    l,
                    &options,
                    tandem_topology::ShardBy::AttentionTp,
                )
                .map_err(|e| anyhow::anyhow!("{e}"))?,
            )
        })
    }

    fn vocab(&self) -> usize {
        match self {
            KdaRunner::Single(m) => m.config().vocab_size,
            KdaRunner::Sharded(s) => s
                .rank(tandem_topology::Rank(0))
                .map_or(0, |m| m.config().vocab_size),
        }
    }

    fn validate(&self, ids: &[u32]) -> Result<()> {
        match self {
            KdaRunner::Single(m) => Ok(m.validate_tokens(ids)?),
            KdaRunner::Sharded(s) => match s.rank(tandem_topology::Rank(0)) {
                Some(m) => Ok(m.validate_tokens(ids)?),
                None => bail!("layout has no ranks"),
            },
        }
    }

    fn groups_agree(out: Vec<Vec<f32>>) -> Result<Vec<f32>> {
        let first = out.first().cloned().unwrap_or_default();
        for (g, o) in out.iter().enumerate().skip(1) {
            let diff = o
                .iter()
                .zip(&first)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            if diff > 1e-3 {
                bail!("attention-DP group {g} disagrees with group 0 by {diff}");
            }
        }
        Ok(first)
    }

    fn full(&self, ids: &[u32]) -> Result<Vec<f32>> {
        match self {
            KdaRunner::Single(m) => Ok(m.forward_full(ids)),
            KdaRunner::Sharded(s) => {
                let seqs = vec![ids.to_vec(); s.layout().dp()];
                Self::groups_agree(s.forward_full(&seqs).map_err(|e| anyhow::anyhow!("{e}"))?)
            }
        }
    }

    fn greedy(&self, prompt: &[u32], max_tokens: u32, eos: &[u32]) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        match self {
            KdaRunner::Single(m) => {
                let mut state = m.new_state();
                let mut logits = m.prefill(prompt, &mut state);
                while out.len() < max_tokens as usize {
                    let id = tandem_engine::sampling::argmax(&logits);
                    out.push(id);
                    if eos.contains(&id) {
                        break;
                    }
                    logits = m.decode_step(id, &mut state);
                }
            }
            KdaRunner::Sharded(s) => {
                let dp = s.layout().dp();
                let mut states = s.new_states();
                let step = |ids: Vec<u32>, states: &mut Vec<_>, form| -> Result<Vec<f32>> {
                    let out = s
                        .extend(&vec![ids; dp], states, form, false)
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                    Self::groups_agree(out)
                };
                let mut logits = step(prompt.to_vec(), &mut states, KdaForm::Chunked)?;
                while out.len() < max_tokens as usize {
                    let id = tandem_engine::sampling::argmax(&logits);
                    out.push(id);
                    if eos.contains(&id) {
                        break;
                    }
                    logits = step(vec![id], &mut states, KdaForm::Recurrent)?;
                }
            }
        }
        Ok(out)
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
        Family::Llama => match llama_tp(layout, device)? {
            1 => device.run(LlamaLogits { dir, ids, dtype })?,
            tp => llama_logits_tp(dir, ids, dtype, tp)?,
        },
        Family::KdaHybrid => {
            device.check_kda()?;
            let runner = KdaRunner::load(dir, layout, None, dtype.dtype())?;
            runner.validate(ids)?;
            (runner.full(ids)?, runner.vocab())
        }
    };
    Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
}

/// Logits of a full forward on `tp` CPU ranks.
fn llama_logits_tp(
    dir: &Path,
    ids: &[u32],
    dtype: crate::DtypeArg,
    tp: usize,
) -> Result<(Vec<f32>, usize)> {
    let shards = tandem_engine::llama_ranks::cpu_shards(dir, dtype.dtype(), tp)?;
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
}

impl crate::device::WithBackend for LlamaLogits<'_> {
    type Out = (Vec<f32>, usize);
    fn run<B: Ops>(self, backend: B) -> Result<(Vec<f32>, usize)> {
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
) -> Result<Vec<u32>> {
    let runner = KdaRunner::load(dir, layout, lora, dtype)?;
    runner.validate(prompt)?;
    runner.greedy(prompt, max_tokens, &eos_ids(dir)?)
}
