//! The one interface the engine serves every model family through. A [`ServedModel`] runs
//! a flattened step ([`ForwardBatch`]), samples its logits rows, and exports or imports a
//! request's state as a typed [`Handoff`]; what a request needs in memory — paged blocks
//! (Llama K/V), a fixed-size state slot on an attention-DP group and paged MLA latent rows
//! (KDA hybrids) — comes from the engine's [`Pools`] as one RAII [`Reservation`], whatever
//! the family. The scheduler ([`crate::scheduler`]) knows nothing else about a model.
//! Every family samples through [`sample_logits`], over logits where its step left them.

use crate::backend::latents::Claim;
use crate::backend::latents::LatentPool;
use crate::backend::Ops;
use crate::batch::ForwardBatch;
use crate::handoff::Handoff;
use crate::kv_pool::{BlockAllocation, BlockAllocator, KvLayout};
use crate::sampling::{Adjustment, SampleRow};
use crate::tensor::Tensor;
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;
use tandem_core::{BlockId, TokenLogprobs};
use tandem_topology::Layout;

/// Facts about a served model, fixed when it starts.
#[derive(Clone, Debug)]
pub struct ServedInfo {
    /// Model family, for logs and stats (`llama`, `kda_hybrid`).
    pub family: &'static str,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Tokens that end generation unless the request ignores EOS.
    pub eos_ids: Vec<u32>,
    /// Longest prompt + generation served.
    pub max_context: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Bytes of weights one batch-1 decode step reads (all ranks).
    pub weight_bytes: usize,
    /// The parallel layout of the ranks.
    pub layout: Layout,
    /// The paged K/V cache of the whole model (what a handoff carries), for models that
    /// keep one.
    pub kv: Option<KvLayout>,
    /// For models with per-request state instead: the bytes of a handoff's body as
    /// `(fixed, per prompt token)` whatever the sender's layout, and the most segments its
    /// manifest lists.
    pub state_handoff: Option<StateHandoffSize>,
    /// Logits rows a step can score beyond those it samples (prompt log-probabilities, see
    /// [`ServedModel::score`]); 0: the model does not score prompts.
    pub score_rows: usize,
}

/// The size of a state handoff's body (see [`ServedInfo::state_handoff`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateHandoffSize {
    /// Bytes independent of the prompt (recurrent state, conv windows, the layout).
    pub fixed: usize,
    /// Bytes per prompt token (latents and the like).
    pub per_token: usize,
    /// Segments in the largest manifest (the sender's ranks split the state).
    pub max_segments: usize,
}

impl StateHandoffSize {
    /// Body bytes of a handoff of `tokens` prompt tokens.
    pub fn body_bytes(&self, tokens: usize) -> usize {
        self.fixed + self.per_token * tokens
    }
}

/// A request's fixed-size state slot: slot `index` of attention-DP group `group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSlot {
    /// The attention-DP group.
    pub group: usize,
    /// The slot within the group.
    pub index: usize,
}

/// The memory a model's requests draw on. Clones share the pools.
#[derive(Clone, Debug, Default)]
pub struct Pools {
    /// Paged K/V blocks and tokens per block.
    pub kv: Option<(BlockAllocator, usize)>,
    /// State slots, one allocator per attention-DP group.
    pub slots: Vec<BlockAllocator>,
    /// Every group's slots together (one count to wait on).
    pub slots_total: Option<BlockAllocator>,
    /// MLA latent blocks ([`crate::backend::latents::BLOCK_ROWS`] rows each) and the
    /// row sets one request fills (every MLA layer's latent and rope rows on every rank of
    /// its group).
    pub latents: Option<(LatentPool, usize)>,
    /// Prefix caching of the paged K/V blocks, under this salt (the model's identity);
    /// `None`: off.
    pub prefix: Option<tandem_core::CacheSalt>,
}

/// Space held for one request; everything in it goes back to its pool when dropped.
#[derive(Debug)]
pub struct Reservation {
    tokens: usize,
    /// Leading prompt tokens whose K/V came from the prefix cache.
    cached: usize,
    blocks: Option<BlockTable>,
    slot: Option<(usize, BlockAllocation)>,
    _slot_total: Option<BlockAllocation>,
    latents: Option<Claim>,
}

/// A request's paged blocks: leading parts it may share (cached prefix blocks, the full
/// prompt blocks of its prompt's other choices; each held until the last sharer lets go),
/// then blocks of its own.
#[derive(Debug)]
struct BlockTable {
    shared: Vec<Arc<BlockAllocation>>,
    own: BlockAllocation,
    ids: Vec<BlockId>,
}

impl BlockTable {
    fn own(own: BlockAllocation) -> Self {
        Self::sharing(Vec::new(), own)
    }

    fn sharing(shared: Vec<Arc<BlockAllocation>>, own: BlockAllocation) -> Self {
        let ids = shared
            .iter()
            .flat_map(|s| s.blocks())
            .chain(own.blocks())
            .copied()
            .collect();
        Self { shared, own, ids }
    }

    fn shared_len(&self) -> usize {
        self.shared.iter().map(|s| s.blocks().len()).sum()
    }
}

impl Reservation {
    /// Tokens (prompt + generation) the reservation holds space for.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Leading prompt tokens whose K/V came from the prefix cache (computed already).
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }

    /// The paged blocks, in order (empty for a model without a paged K/V cache).
    pub fn blocks(&self) -> &[BlockId] {
        self.blocks.as_ref().map_or(&[], |t| &t.ids)
    }

    /// Leading blocks this reservation shares with others (the full blocks of a prompt
    /// whose choices decode apart; see [`Pools::reserve_choices`]).
    pub fn shared_blocks(&self) -> usize {
        self.blocks.as_ref().map_or(0, BlockTable::shared_len)
    }

    /// The state slot, for models with per-request state.
    pub fn slot(&self) -> Option<StateSlot> {
        self.slot.as_ref().map(|(group, a)| StateSlot {
            group: *group,
            index: a.blocks()[0].0 as usize,
        })
    }

    /// The attention-DP group the request runs on.
    pub fn group(&self) -> usize {
        self.slot.as_ref().map_or(0, |(g, _)| *g)
    }

    /// The latent blocks claimed and not yet bound to the request's rows (see
    /// [`ServedModel::begin`]).
    pub(crate) fn latent_claim(&mut self) -> Option<&mut Claim> {
        self.latents.as_mut()
    }

    /// Appends `tokens` of this request (`cached` already computed) to a step.
    pub(crate) fn push_to(
        &self,
        batch: &mut ForwardBatch,
        tokens: &[u32],
        cached: usize,
        block_size: usize,
        want_logits: bool,
    ) {
        match self.slot() {
            Some(slot) => batch.push_state(tokens, cached, slot, want_logits),
            None => batch.push(tokens, cached, self.blocks(), block_size, want_logits),
        }
    }
}

impl Pools {
    /// Tokens per paged block (16 where the model has no paged K/V).
    pub fn block_size(&self) -> usize {
        self.kv.as_ref().map_or(16, |(_, bs)| *bs)
    }

    /// Attention-DP groups.
    pub fn groups(&self) -> usize {
        self.slots.len().max(1)
    }

    fn latent_blocks_for(&self, tokens: usize) -> usize {
        self.latents.as_ref().map_or(0, |(_, sets)| {
            sets * tokens.div_ceil(crate::backend::latents::BLOCK_ROWS)
        })
    }

    /// Refuses a request of `tokens` tokens that could not fit even in empty pools.
    pub fn check_fits(&self, tokens: usize) -> Result<()> {
        if let Some((a, bs)) = &self.kv {
            let needed = tokens.div_ceil(*bs);
            if needed > a.total_blocks() {
                return Err(Error::CapacityExhausted {
                    needed,
                    free: a.total_blocks(),
                });
            }
        }
        if let Some((pool, _)) = &self.latents {
            let needed = self.latent_blocks_for(tokens);
            let total = pool.capacity().unwrap_or(usize::MAX);
            if needed > total {
                return Err(Error::CapacityExhausted {
                    needed,
                    free: total,
                });
            }
        }
        Ok(())
    }

    /// Reserves space for a request of `tokens` tokens, on attention-DP group `group` or
    /// the one with the most free slots; all or nothing.
    pub fn reserve(&self, tokens: usize, group: Option<usize>) -> Result<Reservation> {
        let groups = self.groups();
        if let Some(g) = group.filter(|&g| g >= groups) {
            return Err(Error::InvalidRequest(format!(
                "decode DP rank {g} does not exist (dp = {groups})"
            )));
        }
        let blocks = match &self.kv {
            Some((a, bs)) => Some(BlockTable::own(a.allocate(tokens.div_ceil(*bs))?)),
            None => None,
        };
        self.reserve_rest(tokens, group, blocks)
    }

    /// Reserves space for `n` choices of one prompt of `prompt_len` tokens, each of
    /// `tokens` tokens (prompt + generation), on one attention-DP group; all or nothing.
    /// The first reservation is the prompt's; the others share its full prompt blocks
    /// (which no choice writes again) and hold blocks of their own from the prompt's last,
    /// partial block on, into which each copies the prompt's part when it forks
    /// ([`ServedModel::fork`]). State slots and latent rows are each choice's own.
    pub fn reserve_choices(
        &self,
        tokens: usize,
        prompt_len: usize,
        n: usize,
        group: Option<usize>,
    ) -> Result<Vec<Reservation>> {
        self.reserve_prompt(tokens, prompt_len, n, group, &[])
    }

    /// [`Pools::reserve_choices`] for a prompt whose full blocks have the chained hashes
    /// `prefix` ([`Pools::prompt_hashes`]): the longest cached run of them comes first in
    /// every choice's table, shared ([`Reservation::cached_tokens`] says how many tokens
    /// that is; they need no computing).
    pub fn reserve_prompt(
        &self,
        tokens: usize,
        prompt_len: usize,
        n: usize,
        group: Option<usize>,
        prefix: &[u64],
    ) -> Result<Vec<Reservation>> {
        let mut first = match &self.kv {
            Some((a, bs)) => {
                let hit = a.lookup(prefix);
                let cached = hit.blocks().len() * bs;
                let own = a.allocate(tokens.div_ceil(*bs).saturating_sub(hit.blocks().len()))?;
                let shared = if hit.blocks().is_empty() {
                    Vec::new()
                } else {
                    vec![Arc::new(hit)]
                };
                let mut r =
                    self.reserve_rest(tokens, group, Some(BlockTable::sharing(shared, own)))?;
                r.cached = cached;
                r
            }
            None => self.reserve(tokens, group)?,
        };
        if n <= 1 {
            return Ok(vec![first]);
        }
        let group = Some(first.group());
        let mut out = Vec::with_capacity(n);
        let shared = match (&self.kv, first.blocks.take()) {
            (Some((_, bs)), Some(mut table)) => {
                let prompt_blocks = prompt_len.min(tokens) / bs;
                let rest = table
                    .own
                    .split_off(prompt_blocks.saturating_sub(table.shared_len()));
                table.shared.push(Arc::new(table.own));
                first.blocks = Some(BlockTable::sharing(table.shared.clone(), rest));
                Some(table.shared)
            }
            (_, table) => {
                first.blocks = table;
                None
            }
        };
        out.push(first);
        for _ in 1..n {
            let blocks = match (&self.kv, &shared) {
                (Some((a, bs)), Some(shared)) => {
                    let held: usize = shared.iter().map(|s| s.blocks().len()).sum();
                    let own = a.allocate(tokens.div_ceil(*bs) - held)?;
                    Some(BlockTable::sharing(shared.clone(), own))
                }
                _ => None,
            };
            out.push(self.reserve_rest(tokens, group, blocks)?);
        }
        Ok(out)
    }

    /// The chained hashes of the full blocks of `prompt` that a cached prefix may cover: all
    /// but the last token (which must be computed for its logits); empty when prefix caching
    /// is off or the model keeps no paged K/V.
    pub fn prompt_hashes(&self, prompt: &[u32]) -> Vec<u64> {
        match (&self.kv, self.prefix) {
            (Some((_, bs)), Some(salt)) if !prompt.is_empty() => {
                tandem_core::block_hashes(&prompt[..prompt.len() - 1], *bs, salt)
            }
            _ => Vec::new(),
        }
    }

    /// Registers the full blocks of `tokens` (whose K/V `r` holds, written) in the prefix
    /// cache; nothing when it is off.
    pub fn remember(&self, r: &Reservation, tokens: &[u32]) {
        if let (Some((a, bs)), Some(salt)) = (&self.kv, self.prefix) {
            let hashes = tandem_core::block_hashes(tokens, *bs, salt);
            let n = hashes.len().min(r.blocks().len());
            a.register(&r.blocks()[..n], &hashes[..n]);
        }
    }

    /// The rest of a reservation whose paged blocks are `blocks`: a state slot, latent rows.
    fn reserve_rest(
        &self,
        tokens: usize,
        group: Option<usize>,
        blocks: Option<BlockTable>,
    ) -> Result<Reservation> {
        let slot = if self.slots.is_empty() {
            None
        } else {
            let g = group.unwrap_or_else(|| {
                (0..self.slots.len())
                    .max_by_key(|&g| (self.slots[g].free_blocks(), usize::MAX - g))
                    .unwrap_or(0)
            });
            Some((g, self.slots[g].allocate(1)?))
        };
        let slot_total = match &self.slots_total {
            Some(a) => Some(a.allocate(1)?),
            None => None,
        };
        let latents = match &self.latents {
            Some((pool, _)) => {
                let needed = self.latent_blocks_for(tokens);
                Some(pool.claim(needed).ok_or_else(|| Error::CapacityExhausted {
                    needed,
                    free: pool.free().unwrap_or(0),
                })?)
            }
            None => None,
        };
        Ok(Reservation {
            tokens,
            cached: 0,
            blocks,
            slot,
            _slot_total: slot_total,
            latents,
        })
    }

    /// `(blocks in all, blocks free)` of the paged pool: K/V blocks, or MLA latent blocks.
    pub fn paged_blocks(&self) -> (usize, usize) {
        if let Some((a, _)) = &self.kv {
            return (a.total_blocks(), a.free_blocks());
        }
        match &self.latents {
            Some((pool, _)) => (pool.capacity().unwrap_or(0), pool.free().unwrap_or(0)),
            None => (0, 0),
        }
    }

    /// Free state slots of each attention-DP group (empty without state slots).
    pub fn free_slots(&self) -> Vec<usize> {
        self.slots.iter().map(BlockAllocator::free_blocks).collect()
    }

    /// Resolves once nothing is reserved.
    pub async fn wait_idle(&self) {
        if let Some((a, _)) = &self.kv {
            a.wait_all_free().await;
        }
        if let Some(a) = &self.slots_total {
            a.wait_all_free().await;
        }
        if let Some((pool, _)) = &self.latents {
            pool.wait_all_free().await;
        }
    }

    /// Resolves once something is reserved.
    pub async fn wait_busy(&self) {
        let kv = async {
            match &self.kv {
                Some((a, _)) => a.wait_any_used().await,
                None => std::future::pending().await,
            }
        };
        let slots = async {
            match &self.slots_total {
                Some(a) => a.wait_any_used().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = kv => {}
            () = slots => {}
        }
    }
}

/// What every family's [`ServedModel::sample`] does, once: one token per row of `logits`
/// (`[rows.len().., vocab]` on `b`; extra rows are left alone) after each row's bias,
/// penalties and min-p cut, sampled where the logits are; for rows that ask for them, the
/// token's log-probabilities over the penalised logits (the only rows read back).
pub fn sample_logits<B: Ops>(
    b: &B,
    logits: &mut Tensor<B>,
    vocab: usize,
    rows: &[SampleRow<'_>],
    out: &mut Vec<u32>,
    logprobs: &mut Vec<Option<TokenLogprobs>>,
) {
    b.adjust_logits(logits, vocab, rows, Adjustment::Penalties);
    // Log-probabilities are over the penalised logits, before the min-p cut.
    let wanted: Vec<usize> = (0..rows.len())
        .filter(|&i| rows[i].params.logprobs.is_some())
        .collect();
    let kept = if wanted.is_empty() {
        Vec::new()
    } else {
        b.download_rows(logits, vocab, &wanted)
    };
    b.adjust_logits(logits, vocab, rows, Adjustment::MinP);
    let plain: Vec<_> = rows.iter().map(|r| (r.params, r.step)).collect();
    b.sample(logits, vocab, &plain, out);
    logprobs.clear();
    logprobs.resize(rows.len(), None);
    for (k, &i) in wanted.iter().enumerate() {
        let top = rows[i].params.logprobs.unwrap_or(0);
        let row = &kept[k * vocab..(k + 1) * vocab];
        logprobs[i] = Some(crate::sampling::logprobs_of(row, out[i], top));
    }
}

/// What every family's [`ServedModel::score`] does: rows `first + i` of `logits` score
/// `targets[i]` (token, alternatives), read back to the host.
pub fn score_logits<B: Ops>(
    b: &B,
    logits: &Tensor<B>,
    vocab: usize,
    first: usize,
    targets: &[(u32, u32)],
) -> Vec<TokenLogprobs> {
    let rows: Vec<usize> = (first..first + targets.len()).collect();
    let logits = b.download_rows(logits, vocab, &rows);
    targets
        .iter()
        .zip(logits.chunks_exact(vocab))
        .map(|(&(token, top), row)| crate::sampling::logprobs_of(row, token, top))
        .collect()
}

/// Checks a received handoff against the receiving model and brings it into that model's
/// own layout (resharding state from the sender's), on the caller's thread: a handoff that
/// does not fit is refused before the request reaches the engine.
pub trait HandoffSpec: Send + Sync {
    /// `h` for `tokens` prompt tokens landing on `reservation`, ready to import.
    fn prepare(&self, h: Handoff, tokens: usize, reservation: &Reservation) -> Result<Handoff>;
}

/// A model as the engine thread serves it. Implemented by the Llama ranks and by the
/// KDA-hybrid layouts; the engine owns it on its thread.
pub trait ServedModel: 'static {
    /// Facts fixed at start.
    fn info(&self) -> ServedInfo;
    /// The pools its requests draw on (made by the model, which knows the sizes).
    fn pools(&self) -> Pools;
    /// The check run on received handoffs.
    fn handoff_spec(&self) -> Arc<dyn HandoffSpec>;
    /// One forward pass over `batch`; the logits of its `logits_rows` are kept for
    /// [`ServedModel::sample`].
    fn step(&mut self, batch: &ForwardBatch) -> Result<()>;
    /// One token per logits row of the last step (after each row's bias, penalties and
    /// min-p cut), and for rows that ask for them the token's log-probabilities.
    fn sample(
        &mut self,
        rows: &[SampleRow<'_>],
        out: &mut Vec<u32>,
        logprobs: &mut Vec<Option<TokenLogprobs>>,
    );
    /// Log-probabilities of the last step's logits rows `first..first + targets.len()`
    /// (after those [`ServedModel::sample`] took; untouched by bias and penalties): row
    /// `first + i` scores token `targets[i].0` with `targets[i].1` alternatives. Only asked
    /// of a model whose [`ServedInfo::score_rows`] is not 0.
    fn score(&mut self, first: usize, targets: &[(u32, u32)]) -> Result<Vec<TokenLogprobs>> {
        let _ = (first, targets);
        Err(Error::InvalidRequest(
            "this model does not score prompts".into(),
        ))
    }
    /// Makes a reservation's space ready before the request's first step (state zeroed,
    /// latent rows bound to its claim).
    fn begin(&mut self, r: &mut Reservation) -> Result<()> {
        let _ = r;
        Ok(())
    }
    /// Gives back what [`ServedModel::begin`] bound, before the reservation drops.
    fn end(&mut self, r: &Reservation) {
        let _ = r;
    }
    /// The state of a request's first `prompt_len` tokens.
    fn export(&mut self, r: &Reservation, prompt_len: usize) -> Result<Handoff>;
    /// Writes a handoff ([`HandoffSpec::prepare`]d) into a begun reservation.
    fn import(&mut self, r: &Reservation, prompt_len: usize, h: &Handoff) -> Result<()>;
    /// Gives begun reservation `to` (another choice of the same prompt, from
    /// [`Pools::reserve_choices`]) the state of `from`'s first `prompt_len` tokens. The
    /// default copies it all (export, then import); a paged model copies only what the two
    /// do not share.
    fn fork(&mut self, from: &Reservation, to: &Reservation, prompt_len: usize) -> Result<()> {
        let h = self.export(from, prompt_len)?;
        self.import(to, prompt_len, &h)
    }
    /// Overwrites the weights in place with those of `dir` (same configuration).
    fn refresh(&mut self, dir: &Path) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paged(blocks: usize, bs: usize) -> Pools {
        Pools {
            kv: Some((BlockAllocator::new(blocks), bs)),
            ..Pools::default()
        }
    }

    #[test]
    fn choices_share_the_full_prompt_blocks_and_hold_the_rest_each() {
        let pools = paged(32, 16);
        // 37 prompt tokens + 20 generated = 57 tokens, 4 blocks each; the prompt fills 2.
        let rs = pools.reserve_choices(57, 37, 3, None).expect("fits");
        assert_eq!(rs.len(), 3);
        for r in &rs {
            assert_eq!(r.blocks().len(), 4);
            assert_eq!(r.shared_blocks(), 2);
            assert_eq!(
                r.blocks()[..2],
                rs[0].blocks()[..2],
                "one copy of the prompt"
            );
        }
        let mut tails: Vec<BlockId> = rs.iter().flat_map(|r| r.blocks()[2..].to_vec()).collect();
        tails.sort_unstable_by_key(|b| b.0);
        tails.dedup();
        assert_eq!(tails.len(), 6, "each choice writes blocks of its own");
        assert_eq!(pools.paged_blocks(), (32, 32 - 2 - 3 * 2));
        // The shared blocks outlive the first choice while another holds them.
        let mut rs = rs.into_iter();
        drop(rs.next());
        assert_eq!(pools.paged_blocks().1, 32 - 2 - 2 * 2);
        drop(rs);
        assert_eq!(pools.paged_blocks().1, 32, "the pool is whole");
    }

    #[test]
    fn choices_that_do_not_all_fit_take_nothing() {
        let pools = paged(9, 16);
        // 4 blocks for the first, 2 more for each other choice: 3 choices need 8, 4 need 10.
        assert!(pools.reserve_choices(57, 37, 4, None).is_err());
        assert_eq!(pools.paged_blocks().1, 9);
        let rs = pools.reserve_choices(57, 37, 3, None).expect("8 of 9");
        assert_eq!(pools.paged_blocks().1, 1);
        drop(rs);
        assert_eq!(pools.paged_blocks().1, 9);
    }

    #[test]
    fn one_choice_is_a_plain_reservation() {
        let pools = paged(8, 16);
        let rs = pools.reserve_choices(40, 37, 1, None).expect("fits");
        assert_eq!((rs[0].blocks().len(), rs[0].shared_blocks()), (3, 0));
    }
}
