//! `tandem eval logits` and the model-family dispatch of `tandem generate`: single-process
//! runs whose output is compared against transformers (token ids, raw f32 logits).

use anyhow::{bail, Context, Result};
use std::path::Path;
use tandem_core::BlockId;
use tandem_engine::batch::ForwardBatch;
use tandem_engine::kda_hybrid::KdaHybridModel;
use tandem_engine::{Backend, CpuBackend, LlamaModel};

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
pub fn context_length(dir: &Path, model: &KdaHybridModel) -> Result<usize> {
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
    Ok(model
        .exact_context_limit()
        .map_or(configured, |l| l.min(configured)))
}

fn check_layout(layout: LayoutArgs) -> Result<()> {
    let l = tandem_topology::Layout::new(layout.tp, layout.dp, layout.ep)
        .map_err(|e| anyhow::anyhow!("bad layout: {e}"))?;
    if l.tp() != 1 {
        bail!(
            "layout tp={} dp={} ep={} is valid, but this command runs tp=1 only so far; \
             multi-rank layouts run through the engine's sharded KDA runtime",
            layout.tp,
            layout.dp,
            layout.ep
        );
    }
    Ok(())
}

/// Logits `[T][vocab]` of a full forward over `ids`.
pub fn logits(dir: &Path, ids: &[u32], layout: LayoutArgs) -> Result<Vec<Vec<f32>>> {
    check_layout(layout)?;
    let (flat, vocab) = match family(dir)? {
        Family::Llama => {
            let model = LlamaModel::load(dir, CpuBackend::new())?;
            let vocab = model.config().vocab_size;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                bail!("token id {bad} is outside the vocabulary ({vocab})");
            }
            let block = 16;
            let blocks = ids.len().div_ceil(block).max(1);
            let mut cache = model.backend().kv_cache(model.kv_layout(block, blocks));
            let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
            let mut batch = ForwardBatch::default();
            batch.push(ids, 0, &table, block, false);
            batch.logits_rows = (0..ids.len()).collect();
            (model.forward(&batch, &mut cache), vocab)
        }
        Family::KdaHybrid => {
            let model = KdaHybridModel::load(dir)?;
            model.validate_tokens(ids)?;
            let vocab = model.config().vocab_size;
            (model.forward_full(ids), vocab)
        }
    };
    Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
}

/// Greedy generation of up to `max_tokens` for a KDA-hybrid model (stops at EOS).
pub fn generate_kda(
    dir: &Path,
    prompt: &[u32],
    max_tokens: u32,
    layout: LayoutArgs,
) -> Result<Vec<u32>> {
    check_layout(layout)?;
    let model = KdaHybridModel::load(dir)?;
    model.validate_tokens(prompt)?;
    let eos = eos_ids(dir)?;
    let mut state = model.new_state();
    let mut logits = model.prefill(prompt, &mut state);
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let id = tandem_engine::sampling::argmax(&logits);
        out.push(id);
        if eos.contains(&id) || out.len() == max_tokens as usize {
            break;
        }
        logits = model.decode_step(id, &mut state);
    }
    Ok(out)
}
