//! The paged KV pool's bookkeeping: a free list of fixed-size blocks shared by the engine
//! thread and the decode worker's reservation path, and [`BlockAllocation`], which hands its
//! blocks back when dropped — so a cancelled, failed or finished request can never leak KV.
//! The storage ([`KvCache`]) is a pair of backend tensors per layer in the cache's dtype (it
//! lives in device memory on GPUs).

use crate::backend::Backend;
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
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
    free: Vec<BlockId>,
    total: usize,
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
        Self {
            inner: Arc::new(Mutex::new(FreeList { free, total })),
            used: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Takes `n` blocks, or none if fewer than `n` are free.
    pub fn allocate(&self, n: usize) -> crate::Result<BlockAllocation> {
        let mut list = self.inner.lock();
        if list.free.len() < n {
            return Err(crate::Error::CapacityExhausted {
                needed: n,
                free: list.free.len(),
            });
        }
        let at = list.free.len() - n;
        let blocks = list.free.split_off(at);
        self.used.send_replace(list.total - list.free.len());
        Ok(BlockAllocation {
            blocks,
            pool: self.clone(),
        })
    }

    /// Blocks free now.
    pub fn free_blocks(&self) -> usize {
        self.inner.lock().free.len()
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.inner.lock().total
    }

    fn release(&self, blocks: &mut Vec<BlockId>) {
        let mut list = self.inner.lock();
        list.free.append(blocks);
        debug_assert!(list.free.len() <= list.total, "block returned twice");
        self.used.send_replace(list.total - list.free.len());
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
