//! The one interface the engine serves every model family through. A [`ServedModel`] runs
//! a flattened step ([`ForwardBatch`]), samples its logits rows, and exports or imports a
//! request's state as a typed [`Handoff`]; what a request needs in memory — paged blocks
//! (Llama K/V), a fixed-size state slot on an attention-DP group and paged MLA latent rows
//! (KDA hybrids) — comes from the engine's [`Pools`] as one RAII [`Reservation`], whatever
//! the family. The scheduler ([`crate::scheduler`]) knows nothing else about a model.

use crate::batch::ForwardBatch;
use crate::handoff::Handoff;
use crate::kda_hybrid::latent_pool::Claim;
use crate::kda_hybrid::LatentPool;
use crate::kv_pool::{BlockAllocation, BlockAllocator, KvLayout};
use crate::sampling::SampleRow;
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
    /// MLA latent blocks ([`crate::kda_hybrid::latent_pool::BLOCK_ROWS`] rows each) and the
    /// row sets one request fills (every MLA layer's latent and rope rows on every rank of
    /// its group).
    pub latents: Option<(LatentPool, usize)>,
}

/// Space held for one request; everything in it goes back to its pool when dropped.
#[derive(Debug)]
pub struct Reservation {
    tokens: usize,
    blocks: Option<BlockAllocation>,
    slot: Option<(usize, BlockAllocation)>,
    _slot_total: Option<BlockAllocation>,
    latents: Option<Claim>,
}

impl Reservation {
    /// Tokens (prompt + generation) the reservation holds space for.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The paged blocks, in order (empty for a model without a paged K/V cache).
    pub fn blocks(&self) -> &[BlockId] {
        self.blocks.as_ref().map_or(&[], BlockAllocation::blocks)
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
            sets * tokens.div_ceil(crate::kda_hybrid::latent_pool::BLOCK_ROWS)
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
            Some((a, bs)) => Some(a.allocate(tokens.div_ceil(*bs))?),
            None => None,
        };
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
    /// Overwrites the weights in place with those of `dir` (same configuration).
    fn refresh(&mut self, dir: &Path) -> Result<()>;
}
