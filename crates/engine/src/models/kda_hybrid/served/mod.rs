//! Serving KDA-hybrid models through the one engine ([`crate::scheduler`]): [`KdaServed`]
//! is the [`ServedModel`] of a KDA-hybrid layout. A request's "cache" is a state slot on an
//! attention-DP group — one [`KdaHybridState`] per rank of the group, allocated at start-up
//! and reused — whose MLA layers keep their latents in blocks of the worker's bounded
//! [`LatentPool`], bound at admission from the claim the reservation made. A step runs every
//! sequence of every group at once (a group's sequences share its GEMMs; convs, the delta
//! rule and MLA attention run per sequence on its own state; decodes recurrent, prompt
//! chunks chunked).
//!
//! Layout: [`model`] (one rank or a sharded layout), [`slots`] (zeroing and latent
//! binding), [`state_io`] (the typed handoff and resharding on receipt); this file is the
//! [`ServedModel`] implementation.

/// The served model: one rank, or a layout of ranks.
pub mod model;
/// Request-state slots: zeroing, latent binding.
pub mod slots;
/// The KDA-hybrid handoff: typed segments, checking, resharding.
pub mod state_io;

pub use model::KdaModel;

use self::slots::{bind_latents, latent_sets, reset_state};
use self::state_io::{encode_group, host_copy, import_group, KdaHandoffSpec};
use crate::backend::hybrid::{At, HybridOps};
use crate::backend::latents::LatentPool;
use crate::backend::CpuBackend;
use crate::batch::ForwardBatch;
use crate::handoff::Handoff;
use crate::kv_pool::BlockAllocator;
use crate::models::kda_hybrid::{KdaHybridState, StepLogits};
use crate::sampling::SampleRow;
use crate::scheduler::{Engine, EngineConfig};
use crate::served::{
    sample_logits, HandoffSpec, Pools, Reservation, ServedInfo, ServedModel, StateSlot,
};
use crate::tensor::DType;
use crate::{Error, Result};
use std::sync::Arc;
use tandem_core::TokenLogprobs;

/// A KDA-hybrid model as the engine serves it on backend `B`: the model, every group's
/// state slots, the latent pool, and the last step's logits rows.
pub struct KdaServed<B: HybridOps = CpuBackend> {
    model: KdaModel<B>,
    /// `[group][slot]`: the slot's state on each rank of the group.
    slots: Vec<Vec<Vec<KdaHybridState<B>>>>,
    /// `[group]`: the backend of each rank of the group (the one its states live on).
    backends: Vec<Vec<B>>,
    pools: Pools,
    info: ServedInfo,
    /// The last step's logits, each group's on its attention-TP rank 0.
    logits: Vec<StepLogits<B>>,
    /// `[sample row]`: `(group, row)` of the logits it samples.
    picks: Vec<(usize, usize)>,
}

impl<B: HybridOps> KdaServed<B> {
    /// Serves `model` with `config.state_slots` slots per attention-DP group and a latent
    /// pool of `config.num_blocks` blocks; `eos` ends generation, `max_context` bounds it.
    pub fn new(
        mut model: KdaModel<B>,
        config: &EngineConfig,
        eos: Vec<u32>,
        max_context: usize,
    ) -> Self {
        let latents = LatentPool::bounded(config.num_blocks);
        model.set_latent_pool(&latents);
        let layout = model.layout();
        let dp = layout.dp();
        let backends = (0..dp).map(|g| model.group_backends(g)).collect();
        let slots: Vec<Vec<Vec<KdaHybridState<B>>>> = (0..dp)
            .map(|_| {
                (0..config.state_slots)
                    .map(|_| model.group_states())
                    .collect()
            })
            .collect();
        let sets = latent_sets(&model.group_states());
        let c = model.config();
        let info = ServedInfo {
            family: "kda_hybrid",
            vocab_size: c.vocab_size,
            eos_ids: eos,
            max_context,
            num_layers: c.num_layers(),
            weight_bytes: 0,
            layout,
            kv: None,
            state_handoff: Some(state_handoff_size(c, layout)),
            score_rows: 0,
        };
        let pools = Pools {
            kv: None,
            slots: (0..dp)
                .map(|_| BlockAllocator::new(config.state_slots))
                .collect(),
            slots_total: Some(BlockAllocator::new(config.state_slots * dp)),
            latents: (sets > 0).then_some((latents, sets)),
            prefix: None,
        };
        Self {
            model,
            slots,
            backends,
            pools,
            info,
            logits: Vec::new(),
            picks: Vec::new(),
        }
    }

    /// Starts the engine for `model` (see [`KdaServed::new`]).
    pub fn start(
        model: KdaModel<B>,
        config: EngineConfig,
        eos: Vec<u32>,
        max_context: usize,
    ) -> Result<Engine> {
        let c = config.clone();
        Engine::start_served(move || Ok(Self::new(model, &c, eos, max_context)), config)
    }

    fn slot_states(&mut self, slot: StateSlot) -> Result<&mut Vec<KdaHybridState<B>>> {
        self.slots
            .get_mut(slot.group)
            .and_then(|g| g.get_mut(slot.index))
            .ok_or_else(|| Error::InvalidRequest(format!("no state slot {slot:?}")))
    }

    /// A slot's states and the backends they live on.
    fn slot(&mut self, slot: StateSlot) -> Result<(&mut Vec<KdaHybridState<B>>, &[B])> {
        let backends = self
            .backends
            .get(slot.group)
            .ok_or_else(|| Error::InvalidRequest(format!("no state slot {slot:?}")))?;
        let states = self
            .slots
            .get_mut(slot.group)
            .and_then(|g| g.get_mut(slot.index))
            .ok_or_else(|| Error::InvalidRequest(format!("no state slot {slot:?}")))?;
        Ok((states, backends))
    }
}

/// What a KDA-hybrid handoff's body takes: every KDA layer's whole recurrent state and conv
/// windows (the sender's ranks each hold a share), the layout segment, and per prompt token
/// the MLA latents and rope slots (sent once) and the indexer caches; f32 throughout. The
/// manifest lists up to two segments a KDA layer per rank of the largest attention-TP group.
fn state_handoff_size(
    c: &crate::models::kda_hybrid::KdaHybridConfig,
    layout: tandem_topology::Layout,
) -> crate::served::StateHandoffSize {
    let (k, m) = (c.kda, c.mla);
    let kda_layers = c.kda_layers().count();
    let mla_layers = c.mla_layers().count();
    let kda_floats = k.num_heads * k.head_dim * k.head_dim + 3 * k.proj_dim() * (k.conv_kernel - 1);
    let indexer = m.indexer.map_or(0, |ix| 2 * ix.head_dim);
    let per_token_floats = m.kv_lora_rank + m.qk_rope_head_dim + indexer;
    // The sender may run another layout: bound its ranks by this one's or 64, the larger.
    const SENDER_RANKS: usize = 64;
    let ranks = layout.tp().max(SENDER_RANKS);
    crate::served::StateHandoffSize {
        fixed: 4 * kda_floats * kda_layers + 3 * 4,
        per_token: 4 * per_token_floats * mla_layers,
        max_segments: 1 + 2 * kda_layers * ranks + 4 * mla_layers,
    }
}

fn no_slot() -> Error {
    Error::InvalidRequest("the reservation holds no state slot".into())
}

impl<B: HybridOps> ServedModel for KdaServed<B> {
    fn info(&self) -> ServedInfo {
        self.info.clone()
    }

    fn pools(&self) -> Pools {
        self.pools.clone()
    }

    fn handoff_spec(&self) -> Arc<dyn HandoffSpec> {
        let fresh = self.model.group_states().swap_remove(0);
        let template = host_copy(self.model.rank0().backend(), &fresh);
        Arc::new(KdaHandoffSpec {
            layout: self.info.layout,
            config: self.model.config().clone(),
            template,
        })
    }

    fn step(&mut self, batch: &ForwardBatch) -> Result<()> {
        self.logits.clear();
        self.picks.clear();
        let mut work = Vec::with_capacity(batch.seqs.len());
        let mut wants = Vec::with_capacity(batch.seqs.len());
        // Logits rows are the last rows of the sequences that want them, in sequence order.
        let mut rows = batch.logits_rows.iter().peekable();
        for s in &batch.seqs {
            let slot = s.state.ok_or_else(no_slot)?;
            let ids = batch.token_ids[s.start..s.start + s.len].to_vec();
            let states = std::mem::take(self.slot_states(slot)?);
            work.push((slot.group, ids, states));
            // A row listed more than once (the choices of one prompt) is sampled that often.
            let mut copies = 0;
            if let Some(l) = (s.len > 0).then(|| s.start + s.len - 1) {
                while rows.next_if(|&&r| r == l).is_some() {
                    copies += 1;
                }
            }
            wants.push(copies);
        }
        let sampled: Vec<bool> = wants.iter().map(|&copies| copies > 0).collect();
        let out = self.model.step(&mut work, &sampled);
        // The states go back to their slots whatever the outcome.
        for (s, (_, _, states)) in batch.seqs.iter().zip(work) {
            if let Some(slot) = s.state {
                *self.slot_states(slot)? = states;
            }
        }
        let out = out?;
        for (row, copies) in out.rows.iter().zip(wants) {
            if copies > 0 {
                let at = row.ok_or_else(|| {
                    Error::InvalidRequest("a sampled sequence was given no tokens".into())
                })?;
                self.picks.extend(std::iter::repeat_n(at, copies));
            }
        }
        self.logits = out.groups;
        Ok(())
    }

    fn sample(
        &mut self,
        rows: &[SampleRow<'_>],
        out: &mut Vec<u32>,
        logprobs: &mut Vec<Option<TokenLogprobs>>,
    ) {
        let vocab = self.info.vocab_size;
        out.clear();
        out.resize(rows.len(), 0);
        logprobs.clear();
        logprobs.resize(rows.len(), None);
        let (mut tokens, mut lps) = (Vec::new(), Vec::new());
        for (g, logits) in self.logits.iter_mut().enumerate() {
            let mine: Vec<usize> = (0..rows.len().min(self.picks.len()))
                .filter(|&i| self.picks[i].0 == g)
                .collect();
            let Some(tensor) = logits.tensor.as_mut().filter(|_| !mine.is_empty()) else {
                continue;
            };
            let b = &self.backends[g][0];
            let sources: Vec<usize> = mine.iter().map(|&i| self.picks[i].1).collect();
            // Rows in order, each once (every choice its own prompt): sample in place; else
            // gather the rows (a prompt's choices share its row) first.
            let mut gathered;
            let target = if sources.iter().enumerate().all(|(k, &r)| k == r) {
                tensor
            } else {
                gathered = b.zeros(DType::F32, &[sources.len(), vocab]);
                for (k, &r) in sources.iter().enumerate() {
                    let (src, dst) = (At::row(r, vocab), At::row(k, vocab));
                    b.copy_block(tensor, src, &mut gathered, dst, 1, vocab);
                }
                &mut gathered
            };
            let group_rows: Vec<SampleRow<'_>> = mine.iter().map(|&i| rows[i]).collect();
            sample_logits(b, target, vocab, &group_rows, &mut tokens, &mut lps);
            for ((&i, token), lp) in mine.iter().zip(tokens.drain(..)).zip(lps.drain(..)) {
                out[i] = token;
                logprobs[i] = lp;
            }
        }
    }

    fn begin(&mut self, r: &mut Reservation) -> Result<()> {
        let slot = r.slot().ok_or_else(no_slot)?;
        let tokens = r.tokens();
        let (states, backends) = self.slot(slot)?;
        for (st, b) in states.iter_mut().zip(backends) {
            reset_state(b, st)?;
        }
        match r.latent_claim() {
            Some(claim) => bind_latents(states, tokens, claim),
            None => Ok(()),
        }
    }

    fn end(&mut self, r: &Reservation) {
        if let Some((states, backends)) = r.slot().and_then(|s| self.slot(s).ok()) {
            for (st, b) in states.iter_mut().zip(backends) {
                if let Err(e) = reset_state(b, st) {
                    tracing::error!(error = %e, "zeroing a released state slot failed");
                }
            }
        }
    }

    fn export(&mut self, r: &Reservation, _prompt_len: usize) -> Result<Handoff> {
        let head_dim = self.model.config().kda.head_dim;
        let layout = self.info.layout;
        let slot = r.slot().ok_or_else(no_slot)?;
        let (states, backends) = self.slot(slot)?;
        Ok(encode_group(backends, layout, states, head_dim))
    }

    fn import(&mut self, r: &Reservation, prompt_len: usize, h: &Handoff) -> Result<()> {
        let slot = r.slot().ok_or_else(no_slot)?;
        let (states, backends) = self.slot(slot)?;
        import_group(backends, h, states, prompt_len)
    }

    fn refresh(&mut self, dir: &std::path::Path) -> Result<()> {
        self.model.refresh_weights(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::kda_hybrid::KdaHybridModel;
    use crate::scheduler::{EngineEvent, SeqKind};
    use tandem_core::SamplingParams;
    use tandem_topology::Layout;
    use tokio::sync::mpsc::UnboundedReceiver;

    /// The public tiny Kimi-Linear checkpoint: its KDA state visibly changes the output.
    fn tiny() -> (std::path::PathBuf, KdaHybridModel) {
        let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
        let model = KdaHybridModel::load(&dir).expect("load");
        (dir, model)
    }

    fn config(slots: usize, blocks: usize) -> EngineConfig {
        EngineConfig {
            num_blocks: blocks,
            state_slots: slots,
            ..EngineConfig::default()
        }
    }

    fn start(model: KdaModel, slots: usize, blocks: usize) -> Engine {
        KdaServed::start(model, config(slots, blocks), vec![2], 4096).expect("start")
    }

    fn prefilled(mut rx: UnboundedReceiver<EngineEvent>) -> (u32, Handoff) {
        match rx.blocking_recv() {
            Some(EngineEvent::Prefilled {
                first_token,
                finish: None,
                handoff,
                ..
            }) => (first_token, handoff),
            other => panic!("no prefill event: {other:?}"),
        }
    }

    /// Greedy tokens of one process: prefill, then `n - 1` recurrent steps.
    fn alone(model: &KdaHybridModel, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut st = model.new_state();
        let mut logits = model.prefill(prompt, &mut st);
        (0..n)
            .map(|_| {
                let t = crate::sampling::argmax(&logits);
                logits = model.decode_step(t, &mut st);
                t
            })
            .collect()
    }

    fn greedy(n: u32) -> SamplingParams {
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(n)
        }
    }

    #[test]
    fn mla_latents_travel_once_and_every_segment_is_typed() {
        let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
        let layout = Layout::new(2, 1, 1).expect("tp2");
        let model = KdaModel::load(&dir, layout, None).expect("load tp2");
        let mut work = vec![(0, vec![5u32, 9, 33, 7, 120, 64, 3], model.group_states())];
        model.step(&mut work, &[true]).expect("prefill");
        let states = &work[0].2;
        let h = encode_group(
            &model.group_backends(0),
            layout,
            states,
            model.config().kda.head_dim,
        );
        h.check_sizes().expect("the manifest describes the body");
        let latents: Vec<_> = h
            .segments
            .iter()
            .filter(|s| matches!(s.kind, crate::SegmentKind::MlaLatent))
            .collect();
        assert!(!latents.is_empty());
        assert!(
            latents.iter().all(|s| s.shard == 0 && s.shape[0] == 7),
            "latents once, from rank 0, one row per prompt token"
        );
        assert!(h
            .segments
            .iter()
            .any(|s| matches!(s.kind, crate::SegmentKind::KdaRecurrent) && s.shard == 1));
        let served = KdaServed::new(model, &config(2, 64), vec![2], 4096);
        let spec = served.handoff_spec();
        let r = served.pools.reserve(7, None).expect("reserve");
        let back = spec.prepare(h.clone(), 7, &r).expect("same layout");
        assert_eq!(
            back, h,
            "a handoff of the receiving layout comes back as it was"
        );
        // Wrong prompt length, a truncated body, a missing segment: refused.
        assert!(spec.prepare(h.clone(), 8, &r).is_err());
        let mut short = h.clone();
        let n = short.body.len() - 4;
        short.body.to_mut().truncate(n);
        assert!(spec.prepare(short, 7, &r).is_err());
        let mut missing = h.clone();
        let last = missing.segments.pop().expect("a segment");
        let n = missing.body.len() - last.len_bytes() as usize;
        missing.body.to_mut().truncate(n);
        let err = spec.prepare(missing, 7, &r).expect_err("missing segment");
        assert!(err.to_string().contains("ends before"), "{err}");
        assert_eq!(
            served.pools.paged_blocks(),
            (64, 64 - 2 * 2 * 2),
            "only the reservation holds latent blocks (2 MLA layers × latent and rope rows × \
             2 ranks of the group, one block each); received handoffs take none"
        );
    }

    /// A step computes logits only for the sequences that sample (a prompt chunk before the
    /// last samples nothing), on one rank and on a tp2 × dp2 layout, and the rows it does
    /// compute equal those of a step that wants every row.
    #[test]
    fn logits_are_computed_only_where_a_sequence_samples() {
        let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
        for (tp, dp) in [(1, 1), (2, 2)] {
            let model =
                KdaModel::load(&dir, Layout::new(tp, dp, 1).expect("layout"), None).expect("load");
            let vocab = model.config().vocab_size;
            let work = |g: usize| {
                vec![
                    (0, vec![5u32, 9, 33], model.group_states()),
                    (g, vec![7u32, 120, 64, 3], model.group_states()),
                ]
            };
            let g = dp - 1;
            let mut every = work(g);
            let all = model.step(&mut every, &[true, true]).expect("step");
            let mut some = work(g);
            let out = model.step(&mut some, &[false, true]).expect("step");
            assert_eq!(out.rows, vec![None, Some((g, 0))], "tp{tp} dp{dp}");
            let rows: usize = out
                .groups
                .iter()
                .map(|l| l.counts.iter().sum::<usize>())
                .sum();
            assert_eq!(rows, 1, "one row computed");
            let (ag, ar) = all.rows[1].expect("row");
            let want = all.groups[ag].to_host(&model.group_backends(ag)[0], vocab);
            let got = out.groups[g].to_host(&model.group_backends(g)[0], vocab);
            let want_row =
                &want.iter().flatten().copied().collect::<Vec<f32>>()[ar * vocab..(ar + 1) * vocab];
            assert_eq!(got.concat(), want_row, "tp{tp} dp{dp}: the same logits");
            assert!(
                model.step(&mut work(g), &[true]).is_err(),
                "a wish per item"
            );
        }
    }

    /// The handoff size the model states (what a decode worker sizes its landing slot by)
    /// is exactly the body an actual handoff carries, for both tiny models on one rank and
    /// on two, and its manifest fits the stated segment count.
    #[test]
    fn the_stated_handoff_size_is_the_handoffs_body() {
        for name in ["kimi_tiny", "glm5_tiny"] {
            let dir = tandem_testkit::shared_dir().join("reference").join(name);
            for tp in [1, 2] {
                let layout = Layout::new(tp, 1, 1).expect("layout");
                let model = KdaModel::load(&dir, layout, None).expect("load");
                let prompt = vec![5u32, 9, 33, 7, 120, 64, 3, 11, 2];
                let mut work = vec![(0, prompt.clone(), model.group_states())];
                model.step(&mut work, &[true]).expect("prefill");
                let h = encode_group(
                    &model.group_backends(0),
                    layout,
                    &work[0].2,
                    model.config().kda.head_dim,
                );
                let served = KdaServed::new(model, &config(2, 64), vec![2], 4096);
                let size = served.info().state_handoff.expect("a state handoff");
                assert_eq!(h.body.len(), size.body_bytes(prompt.len()), "{name} tp{tp}");
                assert!(h.segments.len() <= size.max_segments, "{name} tp{tp}");
            }
        }
    }

    #[test]
    fn prefill_then_decode_through_the_engines_equals_one_process() {
        let (dir, model) = tiny();
        let prompt = vec![9u32, 40, 7, 300, 12, 5];
        let want = alone(&model, &prompt, 6);
        let p = start(KdaModel::Single(Box::new(model)), 4, 64);
        let d = start(
            KdaModel::Single(Box::new(KdaHybridModel::load(&dir).expect("load"))),
            4,
            64,
        );
        let (first_token, handoff) = prefilled(
            p.submit(prompt.clone(), greedy(6), SeqKind::Prefill)
                .expect("prefill"),
        );
        let reservation = d.reserve(prompt.len() + 6).expect("reserve");
        let rx = d
            .submit(
                prompt.clone(),
                greedy(6),
                SeqKind::Decode {
                    reservation,
                    handoff,
                    first_token,
                    forks: Vec::new(),
                },
            )
            .expect("decode");
        let mut got = vec![first_token];
        got.extend(crate::blocking_tokens(rx));
        assert_eq!(got, want);
        // Aggregated: the same engine prefills and decodes on one slot.
        let all = crate::blocking_tokens(
            p.submit(prompt.clone(), greedy(6), SeqKind::Generate)
                .expect("generate"),
        );
        assert_eq!(all, want, "aggregated = P/D = one process");
        for e in [&p, &d] {
            assert_eq!(e.pools().free_slots(), vec![4], "slots back");
            assert_eq!(e.pools().paged_blocks(), (64, 64), "latent blocks back");
        }
        // A request whose latents cannot fit the pool is refused at submission.
        let small = start(
            KdaModel::Single(Box::new(KdaHybridModel::load(&dir).expect("load"))),
            4,
            1,
        );
        let long: Vec<u32> = (0..40).map(|i| 3 + i).collect();
        assert!(matches!(
            small.submit(long.clone(), SamplingParams::greedy(1), SeqKind::Prefill),
            Err(Error::CapacityExhausted { .. })
        ));
        assert_eq!(
            small.pools().paged_blocks(),
            (1, 1),
            "a refused request takes nothing"
        );
        // A weight refresh keeps the model on the same bounded pool.
        small.refresh_weights(&dir).expect("refresh");
        assert!(matches!(
            small.submit(long, SamplingParams::greedy(1), SeqKind::Prefill),
            Err(Error::CapacityExhausted { .. })
        ));
    }

    /// Prompts prefilled at once on a two-group layout (sharing steps of four prompt tokens,
    /// the longer ones continuing over several), then decoding at once on another layout (two
    /// on one group, one on the other) while another prompt prefills in the same steps, each
    /// gets the tokens it gets alone; a decode reservation larger than the latent pool is
    /// refused and takes nothing.
    #[test]
    fn mixed_steps_over_groups_match_one_process() {
        let (dir, model) = tiny();
        let prompts: Vec<Vec<u32>> = vec![
            vec![9, 40, 7, 18, 250, 6, 91],
            vec![300, 12, 5, 77, 1],
            vec![64, 3],
        ];
        let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p, 5)).collect();
        let late: Vec<u32> = (0..37).map(|i| 5 + 3 * i).collect();
        let want_late = alone(&model, &late, 5);
        drop(model);
        // Prefill on tp4 × dp2 with four prompt tokens per step; decode on tp2 × dp2.
        let p = KdaServed::start(
            KdaModel::load(&dir, Layout::new(4, 2, 1).expect("tp4 dp2"), None).expect("load"),
            EngineConfig {
                max_batch_tokens: 4,
                ..config(4, 256)
            },
            vec![2],
            4096,
        )
        .expect("start");
        let layout = Layout::new(2, 2, 1).expect("tp2 dp2");
        let d = start(
            KdaModel::load(&dir, layout, None).expect("load tp2 dp2"),
            4,
            256,
        );
        let pending: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                p.submit(prompt.clone(), greedy(5), SeqKind::Prefill)
                    .expect("prefill")
            })
            .collect();
        let mut streams = Vec::new();
        for ((prompt, group), rx) in prompts.iter().zip([0, 0, 1]).zip(pending) {
            let (first_token, handoff) = prefilled(rx);
            let reservation = d.reserve_on(prompt.len() + 5, Some(group)).expect("slot");
            let rx = d
                .submit(
                    prompt.clone(),
                    greedy(5),
                    SeqKind::Decode {
                        reservation,
                        handoff,
                        first_token,
                        forks: Vec::new(),
                    },
                )
                .expect("decode");
            streams.push((first_token, rx));
        }
        // A long prompt generated on the decode engine while the others decode: its chunks
        // and their single tokens share steps.
        let mixed = d
            .submit(late, greedy(5), SeqKind::Generate)
            .expect("generate");
        for ((first, rx), want) in streams.into_iter().zip(want) {
            let mut got = vec![first];
            got.extend(crate::blocking_tokens(rx));
            assert_eq!(got, want);
        }
        assert_eq!(crate::blocking_tokens(mixed), want_late);
        assert_eq!(
            d.pools().paged_blocks(),
            (256, 256),
            "decode latent blocks back"
        );
        assert_eq!(
            p.pools().paged_blocks(),
            (256, 256),
            "prefill latent blocks back"
        );
        assert_eq!(p.pools().free_slots(), vec![4, 4], "prefill slots back");
        // tp2 × dp2 gives each group one rank: 2 MLA layers × latent and rope rows × 16
        // blocks (256 tokens) = 64 blocks fit; 4 × 69 (1,100 tokens) = 276 do not.
        let fits = d.reserve_on(256, Some(1)).expect("fits");
        assert_eq!(d.pools().paged_blocks().1, 256 - 64);
        drop(fits);
        assert!(matches!(
            d.reserve_on(1100, Some(1)),
            Err(Error::CapacityExhausted {
                needed: 276,
                free: 256
            })
        ));
        assert_eq!(
            d.pools().paged_blocks(),
            (256, 256),
            "a refused reservation takes nothing"
        );
        assert_eq!(d.pools().free_slots(), vec![4, 4]);
    }
}
