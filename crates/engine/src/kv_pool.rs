//! The paged KV pool's bookkeeping: a free list of fixed-size blocks shared by the engine
//! thread and the decode worker's reservation path, and [`BlockAllocation`], which hands its
//! blocks back when dropped — so a cancelled, failed or finished request can never leak KV.
//!
//! The pool is also the prefix cache: a full block whose contents are known is registered
//! under its chained hash ([`tandem_core::block_hashes`]); blocks are reference-counted, and
//! one whose last holder lets go stays cached, idle, until an allocation needs it (least
//! recently released first). [`BlockAllocator::lookup`] takes the longest cached prefix of a
//! hash chain as blocks of its own; an idle cached block counts as free everywhere.
//! The storage ([`KvCache`]) is a pair of backend tensors per layer in the cache's dtype (it
//! lives in device memory on GPUs).

use crate::backend::Backend;
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tandem_core::BlockId;

/// Shape of a paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Full-attention layers.
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Element type of the stored K/V.
    pub dtype: DType,
}

impl KvLayout {
    /// Floats of K (or V) for one token in one layer.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Values one token's K and V take over all layers.
    pub fn values_per_token(&self) -> usize {
        self.num_layers * 2 * self.kv_dim()
    }

    /// Bytes one token's K and V take over all layers.
    pub fn bytes_per_token(&self) -> usize {
        self.values_per_token() * self.dtype.size()
    }

    /// Cache slots (tokens) in the pool.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// The shape of `tokens` tokens' K/V in the transfer layout `[layer][k, v][token][kv_dim]`.
    pub fn transfer_shape(&self, tokens: usize) -> [usize; 4] {
        [self.num_layers, 2, tokens, self.kv_dim()]
    }

    /// Refuses K/V `data` for `tokens` tokens into `blocks` blocks unless it is in this
    /// cache's dtype and transfer shape and the blocks can hold it.
    pub fn check_transfer(
        &self,
        data: &crate::tensor::HostTensor,
        tokens: usize,
        blocks: usize,
    ) -> crate::Result<()> {
        let shape = self.transfer_shape(tokens);
        if data.dtype() != self.dtype || data.shape() != shape {
            return Err(crate::Error::InvalidRequest(format!(
                "K/V of {} {:?} does not fit a {} cache needing {shape:?}",
                data.dtype(),
                data.shape(),
                self.dtype
            )));
        }
        if blocks < self.blocks_for(tokens) {
            return Err(crate::Error::InvalidRequest(format!(
                "{tokens} tokens need {} blocks, {blocks} given",
                self.blocks_for(tokens)
            )));
        }
        Ok(())
    }

    /// The cache slot of each of the first `tokens` positions of a block table.
    pub fn token_slots<'a>(
        &self,
        blocks: &'a [BlockId],
        tokens: usize,
    ) -> impl Iterator<Item = usize> + 'a {
        let bs = self.block_size;
        (0..tokens).map(move |t| blocks[t / bs].0 as usize * bs + t % bs)
    }
}

/// Paged K/V for every layer on a device: per layer one K and one V tensor of shape
/// `[slot][kv_dim]`, slot = block * block_size + offset.
pub struct KvCache<B: Backend> {
    layout: KvLayout,
    /// K per layer.
    pub k: Vec<Tensor<B>>,
    /// V per layer.
    pub v: Vec<Tensor<B>>,
}

impl<B: Backend> KvCache<B> {
    /// A zeroed cache of `layout` on `backend`.
    pub fn new(backend: &B, layout: KvLayout) -> Self {
        let shape = [layout.num_slots(), layout.kv_dim()];
        let tensors = || {
            (0..layout.num_layers)
                .map(|_| backend.zeros(layout.dtype, &shape))
                .collect()
        };
        Self {
            layout,
            k: tensors(),
            v: tensors(),
        }
    }

    /// The cache's shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }
}

impl<B: Backend> std::fmt::Debug for KvCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct FreeList {
    /// Blocks holding nothing anyone may reuse.
    free: Vec<BlockId>,
    total: usize,
    /// Holders of each block.
    refs: Vec<u32>,
    /// The hash each cached block is registered under.
    hash_of: Vec<Option<u64>>,
    /// Cached blocks by hash.
    cached: HashMap<u64, BlockId>,
    /// Cached blocks nobody holds, by when they were released (oldest evicted first), and
    /// each one's key there.
    idle: BTreeMap<u64, BlockId>,
    idle_at: Vec<Option<u64>>,
    clock: u64,
}

impl FreeList {
    /// Blocks an allocation may take: free ones and idle cached ones.
    fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// The oldest idle cached block, forgotten by the cache.
    fn evict(&mut self) -> Option<BlockId> {
        let (_, b) = self.idle.pop_first()?;
        let i = b.0 as usize;
        self.idle_at[i] = None;
        if let Some(h) = self.hash_of[i].take() {
            self.cached.remove(&h);
        }
        Some(b)
    }

    /// One more holder of `b` (taking it off the idle list).
    fn hold(&mut self, b: BlockId) {
        let i = b.0 as usize;
        if let Some(at) = self.idle_at[i].take() {
            self.idle.remove(&at);
        }
        self.refs[i] += 1;
    }

    /// One holder fewer; the last one's block goes idle (cached) or free.
    fn drop_ref(&mut self, b: BlockId) {
        let i = b.0 as usize;
        debug_assert!(self.refs[i] > 0, "block returned twice");
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] > 0 {
            return;
        }
        if self.hash_of[i].is_some() {
            self.clock += 1;
            self.idle.insert(self.clock, b);
            self.idle_at[i] = Some(self.clock);
        } else {
            self.free.push(b);
        }
    }

    fn used(&self) -> usize {
        self.total - self.available()
    }
}

/// What the prefix cache holds and has done (see [`BlockAllocator::prefix_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Blocks registered under a hash (held or idle).
    pub cached_blocks: usize,
    /// Of those, blocks nobody holds (evictable).
    pub idle_blocks: usize,
}

/// Hands out KV blocks. Cheap to clone; all clones share one free list.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    inner: Arc<Mutex<FreeList>>,
    /// Blocks in use, published on every change so admin calls can wait for an idle pool.
    used: Arc<tokio::sync::watch::Sender<usize>>,
}

impl BlockAllocator {
    /// A pool of `total` blocks, all free.
    pub fn new(total: usize) -> Self {
        // Pop from the end: hand out low block ids first (nicer to read in logs).
        let free = (0..total as u32).rev().map(BlockId).collect();
        let list = FreeList {
            free,
            total,
            refs: vec![0; total],
            hash_of: vec![None; total],
            cached: HashMap::new(),
            idle: BTreeMap::new(),
            idle_at: vec![None; total],
            clock: 0,
        };
        Self {
            inner: Arc::new(Mutex::new(list)),
            used: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Takes `n` blocks (free ones first, then the least recently released cached ones),
    /// or none if fewer than `n` are available.
    pub fn allocate(&self, n: usize) -> crate::Result<BlockAllocation> {
        let mut list = self.inner.lock();
        if list.available() < n {
            return Err(crate::Error::CapacityExhausted {
                needed: n,
                free: list.available(),
            });
        }
        let at = list.free.len().saturating_sub(n);
        let mut blocks = list.free.split_off(at);
        while blocks.len() < n {
            let b = list.evict().expect("counted as available");
            blocks.push(b);
        }
        for &b in &blocks {
            list.refs[b.0 as usize] = 1;
        }
        self.used.send_replace(list.used());
        Ok(BlockAllocation {
            blocks,
            pool: self.clone(),
        })
    }

    /// The cached blocks of the longest prefix of `hashes` (a chain from
    /// [`tandem_core::block_hashes`]) the pool holds, as blocks of a new allocation: they stay
    /// cached (and unevictable) while it lives. Empty when the first is not cached.
    pub fn lookup(&self, hashes: &[u64]) -> BlockAllocation {
        let mut list = self.inner.lock();
        let mut blocks = Vec::new();
        for h in hashes {
            let Some(&b) = list.cached.get(h) else { break };
            list.hold(b);
            blocks.push(b);
        }
        self.used.send_replace(list.used());
        BlockAllocation {
            blocks,
            pool: self.clone(),
        }
    }

    /// Registers block `blocks[i]` (held, its tokens' K/V written) under `hashes[i]`, for
    /// later lookups. A block already registered, or a hash already naming another block,
    /// is left as it is.
    pub fn register(&self, blocks: &[BlockId], hashes: &[u64]) {
        let mut list = self.inner.lock();
        for (&b, &h) in blocks.iter().zip(hashes) {
            let i = b.0 as usize;
            if list.refs[i] == 0 || list.hash_of[i].is_some() || list.cached.contains_key(&h) {
                continue;
            }
            list.hash_of[i] = Some(h);
            list.cached.insert(h, b);
        }
    }

    /// Forgets every cached block (after the weights changed): idle ones become free, held
    /// ones free when their holders let go.
    pub fn forget_cached(&self) {
        let mut list = self.inner.lock();
        while let Some(b) = list.evict() {
            list.free.push(b);
        }
        list.cached.clear();
        list.hash_of.iter_mut().for_each(|h| *h = None);
        self.used.send_replace(list.used());
    }

    /// What the prefix cache holds now.
    pub fn prefix_stats(&self) -> PrefixStats {
        let list = self.inner.lock();
        PrefixStats {
            cached_blocks: list.cached.len(),
            idle_blocks: list.idle.len(),
        }
    }

    /// Blocks free now (idle cached blocks included: an allocation may take them).
    pub fn free_blocks(&self) -> usize {
        self.inner.lock().available()
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.inner.lock().total
    }

    fn release(&self, blocks: &mut Vec<BlockId>) {
        let mut list = self.inner.lock();
        for b in blocks.drain(..) {
            list.drop_ref(b);
        }
        self.used.send_replace(list.used());
    }

    /// Resolves once some block is in use (at once if one is).
    pub async fn wait_any_used(&self) {
        let mut rx = self.used.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail.
        let _ = rx.wait_for(|&used| used > 0).await;
    }

    /// Resolves once every block is free (at once if they are).
    pub async fn wait_all_free(&self) {
        let mut rx = self.used.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail.
        let _ = rx.wait_for(|&used| used == 0).await;
    }
}

/// Blocks owned by one request; returned to the pool on drop.
#[derive(Debug)]
pub struct BlockAllocation {
    blocks: Vec<BlockId>,
    pool: BlockAllocator,
}

impl BlockAllocation {
    /// The blocks, in sequence order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Splits off the blocks from `at` on into an allocation of their own (this one keeps
    /// the first `at`).
    pub fn split_off(&mut self, at: usize) -> BlockAllocation {
        BlockAllocation {
            blocks: self.blocks.split_off(at.min(self.blocks.len())),
            pool: self.pool.clone(),
        }
    }
}

impl Drop for BlockAllocation {
    fn drop(&mut self) {
        self.pool.release(&mut self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_return_their_blocks_on_drop() {
        let pool = BlockAllocator::new(8);
        let a = pool.allocate(3).expect("3 of 8 free");
        let b = pool.allocate(5).expect("5 of 5 free");
        assert_eq!(pool.free_blocks(), 0);
        let mut all: Vec<u32> = a.blocks().iter().chain(b.blocks()).map(|b| b.0).collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>(), "no block handed out twice");
        assert!(matches!(
            pool.allocate(1),
            Err(crate::Error::CapacityExhausted { needed: 1, free: 0 })
        ));
        drop(a);
        assert_eq!(pool.free_blocks(), 3);
        drop(b);
        assert_eq!(pool.free_blocks(), 8);
    }

    #[test]
    fn a_split_allocation_returns_each_part_when_it_drops() {
        let pool = BlockAllocator::new(6);
        let mut head = pool.allocate(5).expect("5 of 6 free");
        let all = head.blocks().to_vec();
        let tail = head.split_off(2);
        assert_eq!([head.blocks(), tail.blocks()].concat(), all);
        drop(tail);
        assert_eq!(pool.free_blocks(), 4);
        drop(head);
        assert_eq!(pool.free_blocks(), 6);
    }

    #[test]
    fn failed_allocation_takes_nothing() {
        let pool = BlockAllocator::new(4);
        let _a = pool.allocate(3).expect("fits");
        assert!(pool.allocate(2).is_err());
        assert_eq!(pool.free_blocks(), 1);
    }

    #[test]
    fn released_blocks_stay_cached_until_an_allocation_needs_them() {
        let pool = BlockAllocator::new(4);
        let a = pool.allocate(3).expect("3 of 4");
        let ids = a.blocks().to_vec();
        pool.register(&ids[..2], &[10, 11]);
        drop(a);
        assert_eq!(pool.free_blocks(), 4, "idle cached blocks count as free");
        assert_eq!(
            pool.prefix_stats(),
            PrefixStats {
                cached_blocks: 2,
                idle_blocks: 2
            }
        );
        // The longest cached run of a chain: 10, 11, then a miss.
        let hit = pool.lookup(&[10, 11, 12]);
        assert_eq!(hit.blocks(), &ids[..2]);
        assert_eq!(
            pool.lookup(&[11]).blocks(),
            &ids[1..2],
            "a chain is looked up as given"
        );
        assert!(
            pool.lookup(&[12, 10]).blocks().is_empty(),
            "a miss first: nothing"
        );
        // Held by the lookup, they cannot be evicted: only 2 blocks are left to take.
        assert!(pool.allocate(3).is_err());
        let two = pool.allocate(2).expect("the uncached blocks");
        assert!(two.blocks().iter().all(|b| !ids[..2].contains(b)));
        drop(two);
        drop(hit);
        // Now idle: an allocation of all 4 evicts them, oldest first, and forgets their hashes.
        let all = pool.allocate(4).expect("all four");
        assert_eq!(pool.prefix_stats().cached_blocks, 0);
        drop(all);
        assert!(pool.lookup(&[10]).blocks().is_empty());
        assert_eq!(pool.free_blocks(), 4);
    }

    #[test]
    fn eviction_takes_the_least_recently_released_and_shared_blocks_live_on() {
        let pool = BlockAllocator::new(3);
        let (a, b) = (pool.allocate(1).expect("a"), pool.allocate(1).expect("b"));
        pool.register(a.blocks(), &[1]);
        pool.register(b.blocks(), &[2]);
        pool.register(b.blocks(), &[3]);
        assert_eq!(
            pool.lookup(&[3]).blocks().len(),
            0,
            "a block keeps its first hash"
        );
        let (ida, idb) = (a.blocks()[0], b.blocks()[0]);
        let again = pool.lookup(&[2]);
        drop(b);
        drop(a);
        // b is still held by `again`; a went idle first; one free block is left.
        let x = pool.allocate(2).expect("the free block and the idle one");
        assert!(x.blocks().contains(&ida) && !x.blocks().contains(&idb));
        assert_eq!(pool.lookup(&[2]).blocks(), &[idb]);
        drop(again);
        drop(x);
        pool.forget_cached();
        assert!(pool.lookup(&[2]).blocks().is_empty(), "forgotten");
        assert_eq!(pool.free_blocks(), 3);
        assert_eq!(pool.prefix_stats(), PrefixStats::default());
    }

    #[test]
    fn layout_arithmetic() {
        let l = KvLayout {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            num_blocks: 10,
            dtype: DType::F32,
        };
        assert_eq!(l.blocks_for(0), 0);
        assert_eq!(l.blocks_for(16), 1);
        assert_eq!(l.blocks_for(17), 2);
        assert_eq!(l.bytes_per_token(), 30 * 2 * 192 * 4);
        let b = KvLayout {
            dtype: DType::BF16,
            ..l
        };
        assert_eq!(b.bytes_per_token(), 30 * 2 * 192 * 2);
    }
}
