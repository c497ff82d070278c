//! The model a KDA-hybrid worker serves: one rank, or a `tp × dp` (+ `ep`) layout of ranks run
//! as threads, behind one step function that advances a batch of requests on every
//! attention-DP group.

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
        Self::load_with(dir, layout, &options)
    }

    /// Loads `dir` for `layout` with explicit [`LoadOptions`] (LoRA, weight dtype).
    pub fn load_with(dir: &std::path::Path, layout: Layout, options: &LoadOptions) -> Result<Self> {
        let options = options.clone();
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

    /// One step for several requests at once, any number per attention-DP group: `work[i]`
    /// is `(group, ids, that request's states on the group's ranks)`. A group's requests share
    /// its GEMMs; a group with no request still joins the step's collectives. Returns each
    /// work item's last-position logits.
    pub(crate) fn step(
        &self,
        work: &mut [(usize, Vec<u32>, Vec<KdaHybridState>)],
    ) -> Result<Vec<Vec<f32>>> {
        // Decodes run the recurrent form, prompt chunks the chunked one, in the same step.
        let form = KdaForm::Auto;
        match self {
            KdaModel::Single(m) => {
                let (ids, mut states): (Vec<&[u32]>, Vec<&mut KdaHybridState>) = work
                    .iter_mut()
                    .map(|(_, ids, st)| (ids.as_slice(), &mut st[0]))
                    .unzip();
                Ok(m.extend_batch(&ids, &mut states, form))
            }
            KdaModel::Sharded(s) => {
                let (dp, a) = (s.layout().dp(), s.layout().attn_tp());
                let mut ids: Vec<Vec<Vec<u32>>> = vec![Vec::new(); dp];
                let mut states: Vec<Vec<KdaHybridState>> =
                    (0..s.layout().tp()).map(|_| Vec::new()).collect();
                // Where each work item sits: (group, index within the group's batch).
                let mut place = Vec::with_capacity(work.len());
                for (g, group_ids, st) in work.iter_mut() {
                    place.push((*g, ids[*g].len()));
                    ids[*g].push(std::mem::take(group_ids));
                    for (k, state) in st.iter_mut().enumerate() {
                        states[*g * a + k].push(std::mem::take(state));
                    }
                }
                let out = s.extend_batch(&ids, &mut states, form, false);
                // The states go back to their requests whatever the outcome.
                for (&(g, i), (_, _, st)) in place.iter().zip(work.iter_mut()) {
                    for (k, state) in st.iter_mut().enumerate() {
                        *state = std::mem::take(&mut states[g * a + k][i]);
                    }
                }
                let mut out =
                    out.map_err(|e| Error::InvalidRequest(format!("sharded step failed: {e}")))?;
                Ok(place
                    .iter()
                    .map(|&(g, i)| std::mem::take(&mut out[g][i]))
                    .collect())
            }
        }
    }
}
