//! The model a KDA-hybrid worker serves: one rank, or a `tp × dp` (+ `ep`) layout of ranks run
//! as threads, behind one step function that advances one request per attention-DP group.

use crate::kda_hybrid::{
    KdaForm, KdaHybridConfig, KdaHybridModel, KdaHybridState, LatentPool, LoadOptions,
    ShardedKdaHybrid,
};
use crate::{Error, Result};
use tandem_topology::{Layout, Rank, ShardBy};

/// The model on one rank or sharded over a layout (ranks are threads of this process).
#[derive(Debug)]
pub enum KdaModel {
    /// tp = 1.
    Single(Box<KdaHybridModel>),
    /// tp > 1.
    Sharded(ShardedKdaHybrid),
}

impl KdaModel {
    /// Loads `dir` for `layout`, merging the PEFT LoRA adapter in `lora` when given (layers
    /// whose projections it targets run unfused).
    pub fn load(
        dir: &std::path::Path,
        layout: Layout,
        lora: Option<&std::path::Path>,
    ) -> Result<Self> {
        let options = LoadOptions {
            lora: lora.map(std::path::Path::to_path_buf),
            ..LoadOptions::default()
        };
        Ok(if layout.tp() == 1 {
            KdaModel::Single(Box::new(KdaHybridModel::load_with(dir, &options)?))
        } else {
            KdaModel::Sharded(
                ShardedKdaHybrid::load_with(dir, layout, &options, ShardBy::AttentionTp)
                    .map_err(|e| Error::InvalidRequest(format!("layout {layout}: {e}")))?,
            )
        })
    }

    /// Makes new states take MLA latent blocks from `pool`.
    pub fn set_latent_pool(&mut self, pool: &LatentPool) {
        match self {
            KdaModel::Single(m) => m.set_latent_pool(pool),
            KdaModel::Sharded(s) => s.set_latent_pool(pool),
        }
    }

    /// Reloads the weights from `dir` into the existing buffers (fused ones in place, so
    /// captured graphs stay valid), on every rank.
    pub fn refresh_weights(&mut self, dir: &std::path::Path) -> Result<()> {
        match self {
            KdaModel::Single(m) => m.refresh_weights(dir),
            KdaModel::Sharded(s) => s
                .refresh_weights(dir)
                .map_err(|e| Error::InvalidRequest(format!("refresh: {e}"))),
        }
    }

    /// The layout served.
    pub fn layout(&self) -> Layout {
        match self {
            KdaModel::Single(_) => Layout::new(1, 1, 1).expect("tp1 is a valid layout"),
            KdaModel::Sharded(s) => *s.layout(),
        }
    }

    fn rank0(&self) -> &KdaHybridModel {
        match self {
            KdaModel::Single(m) => m,
            KdaModel::Sharded(s) => s.rank(Rank(0)).expect("a layout has rank 0"),
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &KdaHybridConfig {
        self.rank0().config()
    }

    /// Fresh states for one attention-DP group's ranks.
    pub(crate) fn group_states(&self) -> Vec<KdaHybridState> {
        match self {
            KdaModel::Single(m) => vec![m.new_state()],
            KdaModel::Sharded(s) => {
                let a = s.layout().attn_tp();
                s.new_states().into_iter().take(a).collect()
            }
        }
    }

    /// One step for several requests at once, at most one per attention-DP group: `work[i]` is
    /// `(group, ids, that group's rank states)`. Idle groups run a throwaway token on scratch
    /// states, because a sharded step is collective over every rank. Returns each work item's
    /// last-position logits.
    pub(crate) fn step(
        &self,
        work: &mut [(usize, Vec<u32>, Vec<KdaHybridState>)],
    ) -> Result<Vec<Vec<f32>>> {
        let form = if work.iter().any(|w| w.1.len() > 1) {
            KdaForm::Chunked
        } else {
            KdaForm::Recurrent
        };
        match self {
            KdaModel::Single(m) => work
                .iter_mut()
                .map(|(_, ids, st)| Ok(m.extend(ids, &mut st[0], form, false)))
                .collect(),
            KdaModel::Sharded(s) => {
                let (dp, a) = (s.layout().dp(), s.layout().attn_tp());
                let mut ids = vec![vec![0u32]; dp];
                let mut states = s.new_states();
                for (g, group_ids, st) in work.iter_mut() {
                    ids[*g] = std::mem::take(group_ids);
                    for (k, state) in st.iter_mut().enumerate() {
                        std::mem::swap(&mut states[*g * a + k], state);
                    }
                }
                let out = s
                    .extend(&ids, &mut states, form, false)
                    .map_err(|e| Error::InvalidRequest(format!("sharded step failed: {e}")))?;
                let mut result = Vec::with_capacity(work.len());
                for (g, _, st) in work.iter_mut() {
                    for (k, state) in st.iter_mut().enumerate() {
                        std::mem::swap(&mut states[*g * a + k], state);
                    }
                    result.push(out[*g].clone());
                }
                Ok(result)
            }
        }
    }
}
