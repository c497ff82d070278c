//! MLA's per-request cache ([`MlaState`]): per-token latent rows in fixed-size blocks counted against a pool shared by a
//! worker's requests (the paged pool of the MLA layers). A request's rows are a list of blocks
//! of [`BLOCK_ROWS`] rows, each a tensor on the model's backend (device memory on a GPU), so
//! the attention kernels read them where they are; blocks go back to the pool when the
//! request's state is dropped, and the serving engine reserves a request's blocks before
//! running it, so a full pool refuses new work instead of failing mid-step.

use crate::backend::{Backend, CpuBackend};
use crate::tensor::{DType, HostTensor, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;

/// Rows (tokens) per block.
pub const BLOCK_ROWS: usize = 16;

#[derive(Debug, Default)]
struct PoolInner {
    /// Blocks the pool may hand out; `None` = unbounded (tests, single-process runs).
    capacity: Option<usize>,
    in_use: usize,
}

/// Counts latent blocks. Clones share one pool.
#[derive(Clone, Debug)]
pub struct LatentPool {
    inner: Arc<Mutex<PoolInner>>,
    /// Blocks in use, published on every change (admin calls wait for an idle pool).
    used: Arc<tokio::sync::watch::Sender<usize>>,
}

impl Default for LatentPool {
    fn default() -> Self {
        Self::with_capacity(None)
    }
}

impl LatentPool {
    /// A pool of at most `blocks` blocks.
    pub fn bounded(blocks: usize) -> Self {
        Self::with_capacity(Some(blocks))
    }

    fn with_capacity(capacity: Option<usize>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(PoolInner {
                capacity,
                ..PoolInner::default()
            })),
            used: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Resolves once no block is in use (at once if none is).
    pub async fn wait_all_free(&self) {
        let mut rx = self.used.subscribe();
        let _ = rx.wait_for(|&used| used == 0).await;
    }

    /// Blocks in use.
    pub fn in_use(&self) -> usize {
        self.inner.lock().in_use
    }

    /// Blocks the pool holds in all (`None`: unbounded).
    pub fn capacity(&self) -> Option<usize> {
        self.inner.lock().capacity
    }

    /// Blocks free now (`None`: unbounded).
    pub fn free(&self) -> Option<usize> {
        let p = self.inner.lock();
        p.capacity.map(|c| c.saturating_sub(p.in_use))
    }

    /// Counts `n` blocks as in use; false (counting nothing) when a bounded pool has fewer
    /// free and `enforce` is set.
    fn take(&self, n: usize, enforce: bool) -> bool {
        let mut p = self.inner.lock();
        if enforce && p.capacity.is_some_and(|c| p.in_use + n > c) {
            return false;
        }
        p.in_use += n;
        self.used.send_replace(p.in_use);
        true
    }

    /// Counts `n` blocks as in use at once, or none when a bounded pool has fewer free; the
    /// blocks are then handed out of the claim ([`PagedRows::reserve_from`]), and whatever is
    /// left of it is released when it drops. Several caches reserve together this way, all or
    /// nothing.
    pub fn claim(&self, n: usize) -> Option<Claim> {
        self.take(n, true).then(|| Claim {
            pool: self.clone(),
            left: n,
        })
    }

    fn same_pool(&self, other: &LatentPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn give_back(&self, n: usize) {
        let mut p = self.inner.lock();
        p.in_use = p.in_use.saturating_sub(n);
        self.used.send_replace(p.in_use);
    }
}

/// Blocks counted as in use but not handed out yet ([`LatentPool::claim`]).
#[derive(Debug)]
pub struct Claim {
    pool: LatentPool,
    left: usize,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.left > 0 {
            self.pool.give_back(self.left);
        }
    }
}

/// Rows of one width (f32) in blocks of [`BLOCK_ROWS`] rows on backend `B`, counted against a
/// [`LatentPool`].
pub struct PagedRows<B: Backend = CpuBackend> {
    width: usize,
    len: usize,
    /// `[BLOCK_ROWS, width]` f32 each.
    blocks: Vec<Tensor<B>>,
    pool: LatentPool,
    backend: B,
}

impl<B: Backend> std::fmt::Debug for PagedRows<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedRows")
            .field("width", &self.width)
            .field("rows", &self.len)
            .field("blocks", &self.blocks.len())
            .finish()
    }
}

impl<B: Backend> PagedRows<B> {
    /// No rows yet, of `width` floats each, in blocks on `backend` counted against `pool`.
    pub fn new(width: usize, pool: LatentPool, backend: B) -> Self {
        Self {
            width,
            len: 0,
            blocks: Vec::new(),
            pool,
            backend,
        }
    }

    /// Rows stored.
    pub fn rows(&self) -> usize {
        self.len
    }

    /// Floats stored (`rows × width`).
    pub fn len(&self) -> usize {
        self.len * self.width
    }

    /// Whether no row is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Row width.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Blocks held (reserved ones included).
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Block `i` (`[BLOCK_ROWS, width]`; row `r` of the rows is row `r % BLOCK_ROWS` of block
    /// `r / BLOCK_ROWS`).
    pub fn block(&self, i: usize) -> &Tensor<B> {
        &self.blocks[i]
    }

    /// Makes room for `rows` rows in total, taking the blocks now; fails (taking nothing)
    /// when a bounded pool cannot supply them.
    pub fn reserve(&mut self, rows: usize) -> bool {
        let need = self.blocks_short(rows);
        if need == 0 {
            return true;
        }
        if !self.pool.take(need, true) {
            return false;
        }
        self.allocate(need);
        true
    }

    /// As [`PagedRows::reserve`], with blocks out of `claim` (made on this rows' pool); false
    /// (taking nothing) when the claim holds too few.
    pub fn reserve_from(&mut self, rows: usize, claim: &mut Claim) -> bool {
        let need = self.blocks_short(rows);
        if need == 0 {
            return true;
        }
        if need > claim.left || !claim.pool.same_pool(&self.pool) {
            return false;
        }
        claim.left -= need;
        self.allocate(need);
        true
    }

    /// Makes room for `rows` rows in total; past the reserved blocks it takes more from the
    /// pool without enforcing its bound (single-process runs). What a backend calls before
    /// writing rows into the blocks.
    pub fn grow(&mut self, rows: usize) {
        let need = self.blocks_short(rows);
        if need > 0 {
            self.pool.take(need, false);
            self.allocate(need);
        }
    }

    /// Counts `n` more rows as stored: a backend wrote them into the blocks (after
    /// [`PagedRows::grow`]).
    pub fn advance(&mut self, n: usize) {
        assert!(
            self.width == 0 || (self.len + n).div_ceil(BLOCK_ROWS) <= self.blocks.len(),
            "rows advanced past the blocks held"
        );
        self.len += n;
    }

    fn allocate(&mut self, n: usize) {
        for _ in 0..n {
            let block = self
                .backend
                .zeros_lasting(DType::F32, &[BLOCK_ROWS, self.width]);
            self.blocks.push(block);
        }
    }

    /// Appends whole rows (`data.len()` a multiple of the width) from the host, taking blocks
    /// as [`PagedRows::grow`] does.
    pub fn extend_from_slice(&mut self, data: &[f32]) {
        if self.width == 0 || data.is_empty() {
            return;
        }
        let (w, n) = (self.width, data.len() / self.width);
        self.grow(self.len + n);
        let mut at = 0;
        while at < n {
            let row = self.len + at;
            let (b, first) = (row / BLOCK_ROWS, row % BLOCK_ROWS);
            let take = (BLOCK_ROWS - first).min(n - at);
            let mut host = if first == 0 {
                vec![0.0; BLOCK_ROWS * w]
            } else {
                self.backend.download(&self.blocks[b]).to_f32_vec()
            };
            host[first * w..(first + take) * w].copy_from_slice(&data[at * w..(at + take) * w]);
            let values = HostTensor::from_f32(&[BLOCK_ROWS, w], host)
                .unwrap_or_else(|e| panic!("latent block: {e}"));
            if let Err(e) = self.backend.overwrite(&mut self.blocks[b], &values) {
                panic!("latent block write: {e}");
            }
            at += take;
        }
        self.len += n;
    }

    /// All rows, contiguous, on the host.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        for (b, block) in self.blocks.iter().enumerate() {
            let rows = self.len.saturating_sub(b * BLOCK_ROWS).min(BLOCK_ROWS);
            if rows == 0 {
                break;
            }
            out.extend_from_slice(&self.backend.download(block).to_f32_vec()[..rows * self.width]);
        }
        out
    }

    /// Drops every row and block.
    pub fn clear(&mut self) {
        self.pool.give_back(self.blocks.len());
        self.blocks.clear();
        self.len = 0;
    }

    /// Drops every row but keeps the blocks (a reservation stays reserved).
    pub fn rewind(&mut self) {
        self.len = 0;
    }

    /// Blocks still to take for `rows` rows in total.
    pub fn blocks_short(&self, rows: usize) -> usize {
        if self.width == 0 {
            return 0;
        }
        rows.div_ceil(BLOCK_ROWS).saturating_sub(self.blocks.len())
    }

    /// The same rows, in new blocks on `backend` counted against `pool`.
    pub fn copy_into<C: Backend>(&self, pool: &LatentPool, backend: &C) -> PagedRows<C> {
        let mut out = PagedRows::new(self.width, pool.clone(), backend.clone());
        out.extend_from_slice(&self.to_vec());
        out
    }
}

impl PagedRows<CpuBackend> {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        let block = crate::backend::cpu_f32s(&self.blocks[i / BLOCK_ROWS]);
        let at = (i % BLOCK_ROWS) * self.width;
        &block[at..at + self.width]
    }

    /// Appends one row (`width` values), writing it in place.
    pub fn push_row(&mut self, row: &[f32]) {
        debug_assert_eq!(row.len(), self.width);
        if self.width == 0 {
            return;
        }
        self.grow(self.len + 1);
        let at = (self.len % BLOCK_ROWS) * self.width;
        let block = crate::backend::cpu_f32s_mut(&mut self.blocks[self.len / BLOCK_ROWS]);
        block[at..at + self.width].copy_from_slice(row);
        self.len += 1;
    }
}

impl<B: Backend> Clone for PagedRows<B> {
    fn clone(&self) -> Self {
        self.copy_into(&self.pool, &self.backend)
    }
}

impl<B: Backend> PartialEq for PagedRows<B> {
    fn eq(&self, other: &Self) -> bool {
        self.width == other.width && self.len == other.len && self.to_vec() == other.to_vec()
    }
}

impl<B: Backend> Drop for PagedRows<B> {
    fn drop(&mut self) {
        self.pool.give_back(self.blocks.len());
    }
}

/// The per-token caches of the DSA indexer, `[T, index_head_dim]` each.
#[derive(Clone, Debug)]
pub struct IndexerCache<B: Backend = CpuBackend> {
    /// `LayerNorm(wk x)`.
    pub keys: PagedRows<B>,
    /// `x · index_kpool_compress_gateᵀ`, the per-token pool gate scores.
    pub pool_gate: PagedRows<B>,
}

/// What one MLA layer keeps per request: one latent per token so far, in blocks counted
/// against the worker's paged latent pool ([`LatentPool`]) and held on the model's backend.
#[derive(Clone, Debug)]
pub struct MlaState<B: Backend = CpuBackend> {
    /// Latents after `kv_a_layernorm`, `[T, kv_lora_rank]`.
    pub kv_latent: PagedRows<B>,
    /// The (unrotated) rope slot of `kv_a_proj_with_mqa`, `[T, qk_rope_head_dim]`; empty when
    /// the model has none.
    pub k_rope: PagedRows<B>,
    /// The indexer's caches, for layers that run an indexer (blocks of an unbounded pool of
    /// their own: the serving pool counts latents and rope slots).
    pub indexer: Option<IndexerCache<B>>,
}

impl<B: Backend> PartialEq for IndexerCache<B> {
    fn eq(&self, other: &Self) -> bool {
        self.keys == other.keys && self.pool_gate == other.pool_gate
    }
}

impl<B: Backend> PartialEq for MlaState<B> {
    fn eq(&self, other: &Self) -> bool {
        self.kv_latent == other.kv_latent
            && self.k_rope == other.k_rope
            && self.indexer == other.indexer
    }
}

impl<B: Backend> MlaState<B> {
    /// Tokens cached, given the latent width.
    pub fn tokens(&self, kv_lora_rank: usize) -> usize {
        debug_assert!(self.kv_latent.is_empty() || self.kv_latent.width() == kv_lora_rank);
        self.kv_latent.rows()
    }

    /// Reserves blocks for `tokens` tokens in total; false when the pool is short (drop the
    /// state to hand back what was taken).
    pub fn reserve(&mut self, tokens: usize) -> bool {
        self.kv_latent.reserve(tokens) && self.k_rope.reserve(tokens)
    }

    /// As [`MlaState::reserve`], with blocks out of `claim`.
    pub fn reserve_from(&mut self, tokens: usize, claim: &mut Claim) -> bool {
        self.kv_latent.reserve_from(tokens, claim) && self.k_rope.reserve_from(tokens, claim)
    }

    /// Blocks [`MlaState::reserve`] would still take for `tokens` tokens.
    pub fn blocks_short(&self, tokens: usize) -> usize {
        self.kv_latent.blocks_short(tokens) + self.k_rope.blocks_short(tokens)
    }

    /// The same cache on `backend`, its latent and rope rows counted against `pool`.
    pub fn copy_into<C: Backend>(&self, pool: &LatentPool, backend: &C) -> MlaState<C> {
        MlaState {
            kv_latent: self.kv_latent.copy_into(pool, backend),
            k_rope: self.k_rope.copy_into(pool, backend),
            indexer: self.indexer.as_ref().map(|ix| IndexerCache {
                keys: ix.keys.copy_into(&LatentPool::default(), backend),
                pool_gate: ix.pool_gate.copy_into(&LatentPool::default(), backend),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_span_blocks_and_return_to_the_pool() {
        let pool = LatentPool::bounded(4);
        let mut a = PagedRows::new(3, pool.clone(), CpuBackend::new());
        assert!(a.reserve(40), "40 rows = 3 blocks");
        assert_eq!(pool.free(), Some(1));
        let data: Vec<f32> = (0..40 * 3).map(|i| i as f32).collect();
        a.extend_from_slice(&data);
        assert_eq!(a.rows(), 40);
        assert_eq!(a.row(17), &[51.0, 52.0, 53.0]);
        assert_eq!(a.to_vec(), data);
        let mut b = PagedRows::new(3, pool.clone(), CpuBackend::new());
        assert!(!b.reserve(40), "only one block left");
        assert_eq!(pool.free(), Some(1), "a refused reservation takes nothing");
        drop(a);
        assert_eq!(pool.free(), Some(4));
        assert!(b.reserve(40));
        drop(b);
        assert_eq!(pool.in_use(), 0);
    }

    /// A claim counts its blocks at once, hands them to several caches, and releases what
    /// it did not hand out; rewinding a cache keeps its blocks for the next rows.
    #[test]
    fn claims_are_all_or_nothing_and_release_their_rest() {
        let pool = LatentPool::bounded(10);
        assert!(pool.claim(11).is_none());
        assert_eq!(pool.in_use(), 0, "a refused claim counts nothing");
        let mut claim = pool.claim(8).expect("8 of 10");
        assert_eq!(pool.free(), Some(2), "claimed blocks count at once");
        let (mut a, mut b) = (
            PagedRows::new(2, pool.clone(), CpuBackend::new()),
            PagedRows::new(5, pool.clone(), CpuBackend::new()),
        );
        assert!(a.reserve_from(40, &mut claim), "3 blocks");
        assert!(b.reserve_from(33, &mut claim), "3 more");
        assert!(!b.reserve_from(90, &mut claim), "3 more needed, 2 left");
        assert_eq!(b.blocks(), 3, "a refused reservation takes nothing");
        let elsewhere = LatentPool::default();
        let mut c = PagedRows::new(2, elsewhere, CpuBackend::new());
        assert!(
            !c.reserve_from(1, &mut claim),
            "blocks stay on the claim's pool"
        );
        drop(claim);
        assert_eq!(pool.in_use(), 6, "the unused 2 went back");
        a.extend_from_slice(&[1.0; 2 * 40]);
        a.rewind();
        a.extend_from_slice(&[2.0; 2 * 40]);
        assert_eq!(
            (a.rows(), a.blocks(), pool.in_use()),
            (40, 3, 6),
            "rewind reuses blocks"
        );
        drop((a, b));
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn clones_compare_by_content() {
        let pool = LatentPool::default();
        let mut a = PagedRows::new(2, pool.clone(), CpuBackend::new());
        a.extend_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        let b = a.clone();
        assert_eq!(a, b);
        assert_eq!(pool.in_use(), 2);
        let mut c = PagedRows::new(2, pool, CpuBackend::new());
        c.extend_from_slice(&[1.0, 2.0]);
        assert_ne!(a, c);
    }
}
