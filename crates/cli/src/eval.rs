//! `tandem eval logits` and the model-family dispatch of `tandem generate`: single-process
//! runs whose output is compared against transformers (token ids, raw f32 logits).

use anyhow::{Context, Result};
use std::path::Path;
use tandem_engine::backend::HybridOps;
use tandem_engine::{DType, LoadSpec, Loaded};

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

/// A computation over a loaded checkpoint (any family), written once for every backend.
pub trait WithLoaded {
    /// What it produces.
    type Out;
    /// Runs on `model`.
    fn run<B: HybridOps>(self, model: Loaded<B>) -> Result<Self::Out>;
}

/// Loads a checkpoint with the engine's one loader on the backend it is given, then runs
/// `body`.
struct LoadOn<'a, W> {
    dir: &'a Path,
    spec: LoadSpec,
    body: W,
}

impl<W: WithLoaded> crate::device::WithBackend for LoadOn<'_, W> {
    type Out = W::Out;
    fn run<B: HybridOps>(self, devices: crate::device::RankDevices<B>) -> Result<W::Out> {
        // Ranks round-robin over the devices given, a stream each where they share one.
        let rank_backend = |r: tandem_topology::Rank| devices.rank(r.0);
        let model = tandem_engine::load(self.dir, rank_backend, &self.spec)
            .with_context(|| format!("loading {}", self.dir.display()))?;
        tracing::info!(
            backend = %model.backend_name(),
            layout = %self.spec.layout,
            family = ?model.family(),
            dtype = %self.spec.dtype,
            "model loaded"
        );
        self.body.run(model)
    }
}

/// Loads the checkpoint `dir` for `layout` on `device` (`lora` merged, weights in `dtype`)
/// and runs `body` on it. A layout's ranks are threads of this process, round-robin over the
/// devices `device` lists: ranks sharing a GPU have a stream each and meet in its memory,
/// ranks with a GPU each meet through NCCL.
pub fn with_model<W: WithLoaded>(
    dir: &Path,
    layout: LayoutArgs,
    lora: Option<&Path>,
    dtype: DType,
    device: crate::device::Device,
    body: W,
) -> Result<W::Out> {
    let spec = LoadSpec {
        layout: checked_layout(layout)?,
        dtype,
        lora: lora.map(Path::to_path_buf),
    };
    device.run(LoadOn { dir, spec, body })
}

/// Logits of a full forward, and the vocabulary size.
struct Logits<'a>(&'a [u32]);

impl WithLoaded for Logits<'_> {
    type Out = (Vec<f32>, usize);
    fn run<B: HybridOps>(self, model: Loaded<B>) -> Result<Self::Out> {
        let vocab = model.vocab_size();
        Ok((model.logits(self.0)?, vocab))
    }
}

/// Greedy generation of a KDA-hybrid model.
struct Greedy<'a> {
    prompt: &'a [u32],
    max_tokens: u32,
}

impl WithLoaded for Greedy<'_> {
    type Out = Vec<u32>;
    fn run<B: HybridOps>(self, model: Loaded<B>) -> Result<Vec<u32>> {
        Ok(model.greedy(self.prompt, self.max_tokens as usize)?)
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
    let (flat, vocab) = with_model(dir, layout, None, dtype.dtype(), device, Logits(ids))?;
    Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
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
    let body = Greedy { prompt, max_tokens };
    with_model(dir, layout, lora, dtype, device, body)
}
