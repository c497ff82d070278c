//! A KDA hybrid model run over a `tp × dp` (+ `ep`) layout: one thread per rank, each rank a
//! [`KdaHybridModel`] holding its shard, the ranks joined by [`TensorComm`]s over their
//! tensors (in-process ones here: shared/DESIGN.md, Topology). This is how the CPU tests
//! simulate tp8×dp8 on two cores; on GPUs the same rank code runs over NCCL.
//!
//! Where things live (all from [`tandem_topology`], so loader, engine and transfer agree):
//! - attention (KDA q/k/v/b/f_b/g_b/conv/dt_bias/A_log and its state, MLA heads) by
//!   `(attn_tp_rank, A)`; f_a/g_a, o_norm and the MLA latent path replicated; o_proj partial
//!   sums reduced over the attention-TP group only — other groups hold other requests;
//! - dense MLPs and the shared expert over the full TP group; routed experts by EP, each
//!   split over its shard's `tp/ep` ranks. The tokens of every attention-DP group are gathered
//!   before the FFN, its partial sums reduced over the TP group, and each group takes its own
//!   rows back.
//!
//! Each attention-DP group serves its own request: [`ShardedKdaHybrid::extend`] takes one
//! token sequence per group and returns one logits block per group. Bad layouts fail at
//! construction with topology's errors ([`tandem_topology::Layout::validate_for`]).

use super::config::{FfnKind, KdaHybridConfig};
use super::kda::KdaForm;
use super::loading::{LoadOptions, RankShard};
use super::model::{
    open_checkpoint, KdaHybridModel, KdaHybridState, LogitRows, RankCollectives, StepLogits,
};
use crate::backend::hybrid::{At, HybridOps};
use crate::backend::{CpuBackend, TensorComm};
use crate::tensor::{DType, Tensor};
use std::path::Path;
use std::time::Duration;
use tandem_topology::shard::expert_range;
use tandem_topology::{
    InProcessCommunicator, KdaShape, Layout, MlaShape, ModelShape, MoeShape, Rank, RankPosition,
    Shard, ShardBy,
};

/// How long a rank waits for its peers in one collective before failing the group.
const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// Failures of a sharded model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// The layout does not fit the model, or a collective failed.
    #[error(transparent)]
    Topology(#[from] tandem_topology::Error),
    /// Loading failed.
    #[error(transparent)]
    Engine(#[from] crate::Error),
    /// A call's inputs do not match the layout.
    #[error("{0}")]
    Mismatch(String),
    /// A rank's thread could not be started.
    #[error("starting a rank thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// A rank's thread panicked.
    #[error("rank {0} panicked")]
    RankPanicked(usize),
}

/// `Result` of this module.
pub type ShardResult<T> = std::result::Result<T, ShardError>;

/// The sizes of `config` that decide sharding.
pub fn model_shape(config: &KdaHybridConfig) -> ModelShape {
    let has = |kind: FfnKind| config.layers.iter().any(|l| l.ffn == kind);
    ModelShape {
        gqa: None,
        kda: config.kda_layers().next().map(|_| KdaShape {
            num_heads: config.kda.num_heads,
            head_dim: config.kda.head_dim,
            conv_kernel: config.kda.conv_kernel,
        }),
        mla: config.mla_layers().next().map(|_| MlaShape {
            num_heads: config.mla.num_heads,
            kv_lora_rank: config.mla.kv_lora_rank,
            rope_dim: config.mla.qk_rope_head_dim,
        }),
        moe: has(FfnKind::Moe).then_some(MoeShape {
            num_experts: config.moe.num_experts,
            intermediate_size: config.moe.intermediate_size,
        }),
        dense_intermediate_size: has(FfnKind::Dense).then_some(config.intermediate_size),
    }
}

/// A model sharded over a layout, one [`KdaHybridModel`] per rank, on backend `B` (each rank
/// its own handle: a stream per rank where ranks share a device).
#[derive(Debug)]
pub struct ShardedKdaHybrid<B: HybridOps = CpuBackend> {
    layout: Layout,
    ranks: Vec<KdaHybridModel<B>>,
    groups: Vec<RankComms<B>>,
}

/// One rank's communicators over its tensors (the same [`TensorComm`] the Llama ranks use;
/// a device communicator such as NCCL implements it too).
struct RankComms<B: HybridOps> {
    position: RankPosition,
    /// The full TP group: FFN gathers and reductions.
    tp: Box<dyn TensorComm<B>>,
    /// The rank's attention-TP group: o_proj reductions.
    attn_tp: Box<dyn TensorComm<B>>,
}

/// Every rank's shard of the checkpoint `dir` for `layout`, rank `r` on `backend(r)`.
fn load_ranks<B: HybridOps>(
    mut backend: impl FnMut(Rank) -> crate::Result<B>,
    dir: &Path,
    layout: &Layout,
    options: &LoadOptions,
    kda_shard_by: ShardBy,
) -> ShardResult<Vec<KdaHybridModel<B>>> {
    let (config, mut ck, fusion) = open_checkpoint(dir, options)?;
    layout.validate_for(&model_shape(&config))?;
    let mut ranks = Vec::with_capacity(layout.tp());
    for rank in layout.ranks() {
        let pos = layout.position(rank)?;
        let rs = RankShard {
            kda: kda_shard_by.shard(layout, rank)?,
            mla: ShardBy::AttentionTp.shard(layout, rank)?,
            dense: ShardBy::GlobalTp.shard(layout, rank)?,
            experts: expert_range(config.moe.num_experts, pos.ep_rank, layout.ep())?,
            expert_mlp: Shard::new(pos.moe_tp_rank, layout.moe_tp())?,
            log: rank == Rank(0),
        };
        ranks.push(KdaHybridModel::build(
            backend(rank)?,
            config.clone(),
            &mut ck,
            &rs,
            &fusion,
            options.clone(),
        )?);
    }
    ck.finish(config.num_layers())?;
    Ok(ranks)
}

/// Every rank's communicators for `layout`, rank `r` on `backends[r]`: the full TP group
/// and each attention-DP group's TP group, each made by the backend from its members
/// ([`crate::Backend::group_comms`]: NCCL where CUDA ranks have a GPU each).
fn rank_comms<B: HybridOps>(layout: &Layout, backends: &[B]) -> ShardResult<Vec<RankComms<B>>> {
    let positions = layout
        .ranks()
        .map(|r| layout.position(r))
        .collect::<Result<Vec<_>, _>>()?;
    let group = |on: &[B]| {
        B::group_comms(
            on,
            InProcessCommunicator::group(on.len(), Some(COLLECTIVE_TIMEOUT)),
        )
    };
    // Each attention-DP group's ranks, in rank order, are its attention-TP ranks 0..A.
    let mut attn: Vec<Option<Box<dyn TensorComm<B>>>> = Vec::new();
    attn.resize_with(positions.len(), || None);
    for dp in 0..layout.dp() {
        let members: Vec<usize> = (0..positions.len())
            .filter(|&r| positions[r].attn_dp_rank == dp)
            .collect();
        let on: Vec<B> = members.iter().map(|&r| backends[r].clone()).collect();
        for (&r, comm) in members.iter().zip(group(&on)) {
            attn[r] = Some(comm);
        }
    }
    Ok(positions
        .into_iter()
        .zip(group(backends))
        .zip(attn)
        .map(|((position, tp), attn_tp)| RankComms {
            position,
            tp,
            attn_tp: attn_tp.expect("every rank is in one attention-DP group"),
        })
        .collect())
}

impl<B: HybridOps> std::fmt::Debug for RankComms<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankComms")
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

/// One rank's collectives in one step.
struct RankComm<'a, B: HybridOps> {
    layout: Layout,
    comms: &'a RankComms<B>,
    /// Tokens of each attention-DP group this step (every rank knows every group's batch).
    group_rows: &'a [usize],
}

impl<B: HybridOps> RankCollectives<B> for RankComm<'_, B> {
    fn attn_all_reduce(&self, backend: &B, buf: &mut Tensor<B>, n: usize) -> crate::Result<()> {
        if self.layout.attn_tp() > 1 {
            self.comms.attn_tp.all_reduce_sum(backend, buf, n)?;
        }
        Ok(())
    }

    fn ffn(
        &self,
        backend: &B,
        x: &Tensor<B>,
        rows: usize,
        hidden: usize,
        f: &dyn Fn(&Tensor<B>, usize) -> Tensor<B>,
    ) -> crate::Result<Tensor<B>> {
        let (tp, dp, a) = (self.layout.tp(), self.layout.dp(), self.layout.attn_tp());
        if tp == 1 {
            return Ok(f(x, rows));
        }
        if dp == 1 {
            let mut y = f(x, rows);
            self.comms
                .tp
                .all_reduce_sum(backend, &mut y, rows * hidden)?;
            return Ok(y);
        }
        // Every rank of a group holds the group's tokens: gather every rank's rows (padded to
        // the largest group's), keep one copy per group (its attention-TP rank 0's), in group
        // order, run the FFN's shard over all of them and sum the shards.
        let me = self.comms.position.attn_dp_rank;
        debug_assert_eq!(self.group_rows[me], rows, "a rank holds its group's tokens");
        let widest = self.group_rows.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = backend.zeros(DType::F32, &[widest, hidden]);
        copy_rows(backend, x, 0, &mut padded, 0, rows, hidden);
        let mut gathered = backend.zeros(DType::F32, &[tp * widest, hidden]);
        self.comms
            .tp
            .all_gather(backend, &padded, widest * hidden, &mut gathered)?;
        let total: usize = self.group_rows.iter().sum();
        let mut all = backend.zeros(DType::F32, &[total.max(1), hidden]);
        let mut own = 0;
        let mut at = 0;
        for (g, &n) in self.group_rows.iter().enumerate() {
            if g == me {
                own = at;
            }
            copy_rows(backend, &gathered, g * a * widest, &mut all, at, n, hidden);
            at += n;
        }
        let mut y = f(&all, total);
        self.comms
            .tp
            .all_reduce_sum(backend, &mut y, total * hidden)?;
        let mut out = backend.zeros(DType::F32, &[rows.max(1), hidden]);
        copy_rows(backend, &y, own, &mut out, 0, rows, hidden);
        Ok(out)
    }
}

/// Copies `n` rows `width` wide from row `from` of `src` to row `to` of `dst`.
fn copy_rows<B: HybridOps>(
    b: &B,
    src: &Tensor<B>,
    from: usize,
    dst: &mut Tensor<B>,
    to: usize,
    n: usize,
    width: usize,
) {
    if n > 0 {
        b.copy_block(src, At::row(from, width), dst, At::row(to, width), n, width);
    }
}

impl ShardedKdaHybrid {
    /// Loads `dir` sharded over `layout` (attention by attention TP, as it must be).
    pub fn load(dir: &Path, layout: Layout) -> ShardResult<Self> {
        Self::load_with(dir, layout, &LoadOptions::default(), ShardBy::AttentionTp)
    }

    /// Loads with options; `kda_shard_by` picks how KDA layers (their fused projections
    /// included) are split. Only [`ShardBy::AttentionTp`] is right: [`ShardBy::GlobalTp`]
    /// exists to show, in tests, the wrong heads and wrong reductions it gives when `A ≠ tp`.
    pub fn load_with(
        dir: &Path,
        layout: Layout,
        options: &LoadOptions,
        kda_shard_by: ShardBy,
    ) -> ShardResult<Self> {
        Self::load_on(
            |_| Ok(CpuBackend::new()),
            dir,
            layout,
            options,
            kda_shard_by,
        )
    }
}

impl<B: HybridOps> ShardedKdaHybrid<B> {
    /// [`ShardedKdaHybrid::load_with`] with each rank on the backend `backend(rank)` opens
    /// (ranks may share a device, each with a stream of its own).
    pub fn load_on(
        backend: impl FnMut(Rank) -> crate::Result<B>,
        dir: &Path,
        layout: Layout,
        options: &LoadOptions,
        kda_shard_by: ShardBy,
    ) -> ShardResult<Self> {
        let ranks = load_ranks(backend, dir, &layout, options, kda_shard_by)?;
        let backends: Vec<B> = ranks.iter().map(|r| r.backend().clone()).collect();
        let groups = rank_comms(&layout, &backends)?;
        Ok(Self {
            layout,
            ranks,
            groups,
        })
    }

    /// Re-reads the weights from `dir` for every rank (same layout and options): fused KDA
    /// buffers are rewritten in place, as on one rank; the ranks keep their communicators.
    pub fn refresh_weights(&mut self, dir: &Path) -> ShardResult<()> {
        let options = self
            .ranks
            .first()
            .map(|r| r.options().clone())
            .unwrap_or_default();
        let backends: Vec<B> = self.ranks.iter().map(|r| r.backend().clone()).collect();
        let fresh = load_ranks(
            |r| Ok(backends[r.0].clone()),
            dir,
            &self.layout,
            &options,
            ShardBy::AttentionTp,
        )?;
        for (old, new) in self.ranks.iter_mut().zip(fresh) {
            old.adopt(new);
        }
        Ok(())
    }

    /// Makes every rank's new states take MLA latent blocks from `pool`.
    pub fn set_latent_pool(&mut self, pool: &crate::backend::latents::LatentPool) {
        for r in &mut self.ranks {
            r.set_latent_pool(pool);
        }
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Rank `r`'s model (its shard).
    pub fn rank(&self, r: Rank) -> Option<&KdaHybridModel<B>> {
        self.ranks.get(r.0)
    }

    /// Fresh per-request states, one per rank (each covers that rank's heads; rank `r`
    /// serves attention-DP group `r / A`).
    pub fn new_states(&self) -> Vec<KdaHybridState<B>> {
        self.ranks.iter().map(KdaHybridModel::new_state).collect()
    }

    /// Logits `[T_g, vocab]` of one pass over `seqs[g]` for every attention-DP group `g`.
    pub fn forward_full(&self, seqs: &[Vec<u32>]) -> ShardResult<Vec<Vec<f32>>> {
        let mut states = self.new_states();
        self.extend(seqs, &mut states, KdaForm::Chunked, true)
    }

    /// Consumes `ids[g]` into the states of group `g`'s ranks, for every group at once; returns
    /// each group's logits (every new position with `all_logits`, else the last one).
    pub fn extend(
        &self,
        ids: &[Vec<u32>],
        states: &mut [KdaHybridState<B>],
        form: KdaForm,
        all_logits: bool,
    ) -> ShardResult<Vec<Vec<f32>>> {
        self.check_counts(ids.len(), states.len())?;
        let batches: Vec<Vec<Vec<u32>>> = ids.iter().map(|s| vec![s.clone()]).collect();
        let mut per_rank: Vec<Vec<KdaHybridState<B>>> =
            states.iter_mut().map(|s| vec![std::mem::take(s)]).collect();
        let out = self.extend_batch(&batches, &mut per_rank, form, all_logits);
        for (state, mut back) in states.iter_mut().zip(per_rank) {
            if let Some(b) = back.pop() {
                *state = b;
            }
        }
        Ok(out?
            .into_iter()
            .map(|mut group| group.pop().unwrap_or_default())
            .collect())
    }

    fn check_counts(&self, groups: usize, ranks: usize) -> ShardResult<()> {
        let dp = self.layout.dp();
        if groups != dp || ranks != self.ranks.len() {
            return Err(ShardError::Mismatch(format!(
                "{groups} groups of sequences and {ranks} ranks' states for layout {} ({dp} \
                 groups, {} ranks)",
                self.layout,
                self.ranks.len()
            )));
        }
        Ok(())
    }

    /// A batch of sequences per attention-DP group, every group at once: `ids[g][i]` continues
    /// `states[r][i]` on every rank `r` of group `g` (a rank holds one state per sequence of
    /// its group). A group may have no sequences (its ranks still join the FFN collectives).
    /// Returns `[group][sequence]` logits (every new position with `all_logits`, else the last
    /// one).
    pub fn extend_batch(
        &self,
        ids: &[Vec<Vec<u32>>],
        states: &mut [Vec<KdaHybridState<B>>],
        form: KdaForm,
        all_logits: bool,
    ) -> ShardResult<Vec<Vec<Vec<f32>>>> {
        let a = self.layout.attn_tp();
        let vocab = self.ranks[0].config().vocab_size;
        Ok(self
            .extend_batch_logits(ids, states, form, all_logits, None)?
            .iter()
            .enumerate()
            .map(|(g, l)| l.to_host(self.ranks[g * a].backend(), vocab))
            .collect())
    }

    /// [`ShardedKdaHybrid::extend_batch`] with each group's logits left where its
    /// attention-TP rank 0 computed them (that rank's backend); with `wants`, only the last
    /// position of each sequence `i` of group `g` whose `wants[g][i]`.
    pub fn extend_batch_logits(
        &self,
        ids: &[Vec<Vec<u32>>],
        states: &mut [Vec<KdaHybridState<B>>],
        form: KdaForm,
        all_logits: bool,
        wants: Option<&[Vec<bool>]>,
    ) -> ShardResult<Vec<StepLogits<B>>> {
        let (dp, a) = (self.layout.dp(), self.layout.attn_tp());
        self.check_counts(ids.len(), states.len())?;
        for (groups, st) in self.groups.iter().zip(states.iter()) {
            let g = groups.position.attn_dp_rank;
            if st.len() != ids[g].len() {
                return Err(ShardError::Mismatch(format!(
                    "rank {} holds {} states for the {} sequences of group {g}",
                    groups.position.rank,
                    st.len(),
                    ids[g].len()
                )));
            }
        }
        if let Some(w) = wants {
            if w.len() != ids.len() || w.iter().zip(ids).any(|(w, s)| w.len() != s.len()) {
                return Err(ShardError::Mismatch(
                    "logits wishes do not match the groups' sequences".into(),
                ));
            }
        }
        // Every rank has the same vocabulary; check each sequence once.
        if let Some(bad) = ids
            .iter()
            .flatten()
            .find_map(|s| self.ranks[0].validate_tokens(s).err())
        {
            return Err(bad.into());
        }
        let group_rows: Vec<usize> = ids
            .iter()
            .map(|seqs| seqs.iter().map(Vec::len).sum())
            .collect();
        let results: Vec<ShardResult<StepLogits<B>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter()
                .zip(states.iter_mut())
                .zip(&self.groups)
                .map(|((model, state), groups)| {
                    let g = groups.position.attn_dp_rank;
                    let group_ids: Vec<&[u32]> = ids[g].iter().map(Vec::as_slice).collect();
                    let rows = match wants {
                        Some(w) => LogitRows::LastOf(&w[g]),
                        None => LogitRows::every_or_last(all_logits),
                    };
                    let comm = RankComm {
                        layout: self.layout,
                        comms: groups,
                        group_rows: &group_rows,
                    };
                    std::thread::Builder::new()
                        .name(format!("rank{}", groups.position.rank))
                        .stack_size(16 << 20)
                        .spawn_scoped(scope, move || {
                            let mut trace = None;
                            let mut refs: Vec<&mut KdaHybridState<B>> = state.iter_mut().collect();
                            model.run(&group_ids, &mut refs, form, rows, &mut trace, Some(&comm))
                        })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| match h {
                    Ok(h) => match h.join() {
                        Ok(res) => res.map_err(ShardError::from),
                        Err(_) => Err(ShardError::RankPanicked(r)),
                    },
                    Err(e) => Err(ShardError::Spawn(e)),
                })
                .collect()
        });
        let per_rank = results.into_iter().collect::<ShardResult<Vec<_>>>()?;
        // Every rank of a group computes the same logits; report attention-TP rank 0's.
        Ok(per_rank
            .into_iter()
            .enumerate()
            .filter(|(r, _)| r % a == 0)
            .map(|(_, l)| l)
            .take(dp)
            .collect())
    }
}
