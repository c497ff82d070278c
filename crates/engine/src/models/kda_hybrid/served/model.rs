//! The model a KDA-hybrid worker serves: one rank, or a `tp × dp` (+ `ep`) layout of ranks run
//! as threads, behind one step function that advances a batch of requests on every
//! attention-DP group.

use crate::backend::hybrid::HybridOps;
use crate::backend::latents::LatentPool;
use crate::backend::CpuBackend;
use crate::models::kda_hybrid::{
    KdaForm, KdaHybridConfig, KdaHybridModel, KdaHybridState, LoadOptions, ShardedKdaHybrid,
    StepLogits,
};
use crate::{Error, Result};
use tandem_topology::{Layout, Rank, ShardBy};

/// One step's work item: `(attention-DP group, token ids, the request's state on each rank
/// of the group)`.
pub(crate) type WorkItem<B> = (usize, Vec<u32>, Vec<KdaHybridState<B>>);

/// The model on one rank or sharded over a layout (ranks are threads of this process), on
/// backend `B`.
#[derive(Debug)]
pub enum KdaModel<B: HybridOps = CpuBackend> {
    /// tp = 1.
    Single(Box<KdaHybridModel<B>>),
    /// tp > 1.
    Sharded(ShardedKdaHybrid<B>),
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
        Self::load_on(|_| Ok(CpuBackend::new()), dir, layout, options)
    }
}

impl<B: HybridOps> KdaModel<B> {
    /// [`KdaModel::load_with`] with each rank on the backend `backend(rank)` opens (ranks
    /// may share a device).
    pub fn load_on(
        mut backend: impl FnMut(Rank) -> Result<B>,
        dir: &std::path::Path,
        layout: Layout,
        options: &LoadOptions,
    ) -> Result<Self> {
        Ok(if layout.tp() == 1 {
            KdaModel::Single(Box::new(KdaHybridModel::load_on(
                backend(Rank(0))?,
                dir,
                options,
            )?))
        } else {
            KdaModel::Sharded(
                ShardedKdaHybrid::load_on(backend, dir, layout, options, ShardBy::AttentionTp)
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

    /// Rank 0's model (its backend, config and handoff shapes stand for every rank's).
    pub(crate) fn rank0(&self) -> &KdaHybridModel<B> {
        match self {
            KdaModel::Single(m) => m,
            KdaModel::Sharded(s) => s.rank(Rank(0)).expect("a layout has rank 0"),
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &KdaHybridConfig {
        self.rank0().config()
    }

    /// The backends of attention-DP group `group`'s ranks, in attention-TP order (where its
    /// states live).
    pub(crate) fn group_backends(&self, group: usize) -> Vec<B> {
        match self {
            KdaModel::Single(m) => vec![m.backend().clone()],
            KdaModel::Sharded(s) => {
                let a = s.layout().attn_tp();
                (group * a..(group + 1) * a)
                    .filter_map(|r| s.rank(Rank(r)))
                    .map(|m| m.backend().clone())
                    .collect()
            }
        }
    }

    /// Fresh states for one attention-DP group's ranks.
    pub(crate) fn group_states(&self) -> Vec<KdaHybridState<B>> {
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
    /// group's logits where its attention-TP rank 0 left them (a row per work item given
    /// tokens whose `wants[i]`: the others sample nothing) and where each work item's row is:
    /// `(group, row)`, `None` for an item without one.
    pub(crate) fn step(&self, work: &mut [WorkItem<B>], wants: &[bool]) -> Result<GroupLogits<B>> {
        if wants.len() != work.len() {
            return Err(Error::InvalidRequest(format!(
                "{} logits wishes for {} work items",
                wants.len(),
                work.len()
            )));
        }
        // Decodes run the recurrent form, prompt chunks the chunked one, in the same step.
        let form = KdaForm::Auto;
        match self {
            KdaModel::Single(m) => {
                let (ids, mut states): (Vec<&[u32]>, Vec<&mut KdaHybridState<B>>) = work
                    .iter_mut()
                    .map(|(_, ids, st)| (ids.as_slice(), &mut st[0]))
                    .unzip();
                let logits = m.extend_batch_logits(&ids, &mut states, form, Some(wants));
                let rows = rows_of(&logits.counts).map(|r| r.map(|r| (0, r))).collect();
                Ok(GroupLogits {
                    groups: vec![logits],
                    rows,
                })
            }
            KdaModel::Sharded(s) => {
                let (dp, a) = (s.layout().dp(), s.layout().attn_tp());
                let mut ids: Vec<Vec<Vec<u32>>> = vec![Vec::new(); dp];
                let mut states: Vec<Vec<KdaHybridState<B>>> =
                    (0..s.layout().tp()).map(|_| Vec::new()).collect();
                // Where each work item sits: (group, index within the group's batch).
                let mut place = Vec::with_capacity(work.len());
                let mut group_wants: Vec<Vec<bool>> = vec![Vec::new(); dp];
                for ((g, group_ids, st), &want) in work.iter_mut().zip(wants) {
                    place.push((*g, ids[*g].len()));
                    group_wants[*g].push(want);
                    ids[*g].push(std::mem::take(group_ids));
                    for (k, state) in st.iter_mut().enumerate() {
                        states[*g * a + k].push(std::mem::take(state));
                    }
                }
                let out = s.extend_batch_logits(&ids, &mut states, form, false, Some(&group_wants));
                // The states go back to their requests whatever the outcome.
                for (&(g, i), (_, _, st)) in place.iter().zip(work.iter_mut()) {
                    for (k, state) in st.iter_mut().enumerate() {
                        *state = std::mem::take(&mut states[g * a + k][i]);
                    }
                }
                let groups =
                    out.map_err(|e| Error::InvalidRequest(format!("sharded step failed: {e}")))?;
                let group_rows: Vec<Vec<Option<usize>>> = groups
                    .iter()
                    .map(|l| rows_of(&l.counts).collect())
                    .collect();
                let rows = place
                    .iter()
                    .map(|&(g, i)| group_rows[g][i].map(|r| (g, r)))
                    .collect();
                Ok(GroupLogits { groups, rows })
            }
        }
    }
}

/// One step's logits of every attention-DP group (see [`KdaModel::step`]).
#[derive(Debug)]
pub(crate) struct GroupLogits<B: HybridOps> {
    /// `[group]`: the group's rows, on its attention-TP rank 0's backend.
    pub groups: Vec<StepLogits<B>>,
    /// `[work item]`: `(group, row)` of the item's last-position logits.
    pub rows: Vec<Option<(usize, usize)>>,
}

/// The row each sequence's last logits sit in, given one or no row per sequence.
fn rows_of(counts: &[usize]) -> impl Iterator<Item = Option<usize>> + '_ {
    let mut at = 0;
    counts.iter().map(move |&k| {
        let row = (k > 0).then_some(at);
        at += k;
        row
    })
}

/// Single-request runs over every attention-DP group at once (`tandem eval logits`,
/// `tandem generate`): each group runs the same sequence, group 0's result is returned and
/// the others must agree with it.
impl<B: HybridOps> KdaModel<B> {
    /// Checks that every id is inside the vocabulary.
    pub fn validate_tokens(&self, ids: &[u32]) -> Result<()> {
        self.rank0().validate_tokens(ids)
    }

    /// Logits `[T, vocab]` of one pass over `ids` (chunked delta rule).
    pub fn forward_full(&self, ids: &[u32]) -> Result<Vec<f32>> {
        match self {
            KdaModel::Single(m) => Ok(m.forward_full(ids)),
            KdaModel::Sharded(s) => {
                let seqs = vec![ids.to_vec(); s.layout().dp()];
                groups_agree(s.forward_full(&seqs).map_err(sharded)?)
            }
        }
    }

    /// Greedy continuation of `prompt`: up to `max_tokens` ids, ending at one of `eos`
    /// (included). The prompt runs chunked, each new token recurrent.
    pub fn greedy(&self, prompt: &[u32], max_tokens: usize, eos: &[u32]) -> Result<Vec<u32>> {
        self.validate_tokens(prompt)?;
        let dp = self.layout().dp();
        let mut states = match self {
            KdaModel::Single(m) => vec![m.new_state()],
            KdaModel::Sharded(s) => s.new_states(),
        };
        let step = |ids: &[u32], states: &mut Vec<KdaHybridState<B>>, form| -> Result<Vec<f32>> {
            match self {
                KdaModel::Single(m) => Ok(m.extend(ids, &mut states[0], form, false)),
                KdaModel::Sharded(s) => groups_agree(
                    s.extend(&vec![ids.to_vec(); dp], states, form, false)
                        .map_err(sharded)?,
                ),
            }
        };
        let mut out = Vec::new();
        let mut logits = step(prompt, &mut states, KdaForm::Chunked)?;
        while out.len() < max_tokens {
            let id = crate::sampling::argmax(&logits);
            out.push(id);
            if eos.contains(&id) {
                break;
            }
            logits = step(&[id], &mut states, KdaForm::Recurrent)?;
        }
        Ok(out)
    }
}

fn sharded(e: crate::models::kda_hybrid::ShardError) -> Error {
    Error::InvalidRequest(format!("sharded run failed: {e}"))
}

/// Group 0's output, once every group's agrees with it (within f32 rounding).
fn groups_agree(out: Vec<Vec<f32>>) -> Result<Vec<f32>> {
    let first = out.first().cloned().unwrap_or_default();
    for (g, o) in out.iter().enumerate().skip(1) {
        let diff = o
            .iter()
            .zip(&first)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        if diff > 1e-3 {
            return Err(Error::InvalidRequest(format!(
                "attention-DP group {g} disagrees with group 0 by {diff}"
            )));
        }
    }
    Ok(first)
}
