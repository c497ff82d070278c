//! MLA's per-token latent cache in fixed-size blocks from a pool shared by a worker's requests
//! (the paged pool of the MLA layers). A request's latents are a list of blocks of
//! [`BLOCK_ROWS`] rows; blocks go back to the pool when the request's state is dropped, and
//! the serving engine reserves a request's blocks before running it, so a full pool refuses
//! new work instead of failing mid-step.

use parking_lot::Mutex;
use std::sync::Arc;

/// Rows (tokens) per block.
pub const BLOCK_ROWS: usize = 16;

#[derive(Debug, Default)]
struct PoolInner {
    /// Blocks the pool may hand out; `None` = unbounded (tests, single-process runs).
    capacity: Option<usize>,
    in_use: usize,
    /// Recycled buffers, by length in floats.
    spare: Vec<Vec<f32>>,
}

/// Hands out latent blocks. Clones share one pool.
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

    /// Takes `n` blocks of `floats` floats each, or none when a bounded pool has fewer free
    /// (`enforce`).
    fn take(&self, n: usize, floats: usize, enforce: bool) -> Option<Vec<Vec<f32>>> {
        let mut p = self.inner.lock();
        if enforce && p.capacity.is_some_and(|c| p.in_use + n > c) {
            return None;
        }
        p.in_use += n;
        self.used.send_replace(p.in_use);
        Some(Self::buffers(&mut p, n, floats))
    }

    /// Counts `n` blocks as in use at once, or none when a bounded pool has fewer free; the
    /// blocks are then handed out of the claim ([`PagedRows::reserve_from`]), and whatever is
    /// left of it is released when it drops. Several caches reserve together this way, all or
    /// nothing.
    pub fn claim(&self, n: usize) -> Option<Claim> {
        let mut p = self.inner.lock();
        if p.capacity.is_some_and(|c| p.in_use + n > c) {
            return None;
        }
        p.in_use += n;
        self.used.send_replace(p.in_use);
        Some(Claim {
            pool: self.clone(),
            left: n,
        })
    }

    /// `n` empty buffers of capacity `floats` (spares first); no accounting.
    fn buffers(p: &mut PoolInner, n: usize, floats: usize) -> Vec<Vec<f32>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let mut b = match p.spare.iter().position(|b| b.capacity() >= floats) {
                Some(i) => p.spare.swap_remove(i),
                None => Vec::with_capacity(floats),
            };
            b.clear();
            out.push(b);
        }
        out
    }

    fn same_pool(&self, other: &LatentPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn give_back(&self, blocks: &mut Vec<Vec<f32>>) {
        let mut p = self.inner.lock();
        p.in_use = p.in_use.saturating_sub(blocks.len());
        self.used.send_replace(p.in_use);
        // Keep a bounded number of spares around for reuse.
        while let Some(b) = blocks.pop() {
            if p.spare.len() < 4096 {
                p.spare.push(b);
            }
        }
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
            let mut p = self.pool.inner.lock();
            p.in_use = p.in_use.saturating_sub(self.left);
            self.pool.used.send_replace(p.in_use);
        }
    }
}

/// Rows of one width stored in pool blocks.
#[derive(Debug, Default)]
pub struct PagedRows {
    width: usize,
    len: usize,
    blocks: Vec<Vec<f32>>,
    pool: LatentPool,
}

impl PagedRows {
    /// No rows yet, of `width` floats each, drawing blocks from `pool`.
    pub fn new(width: usize, pool: LatentPool) -> Self {
        Self {
            width,
            len: 0,
            blocks: Vec::new(),
            pool,
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

    /// Makes room for `rows` rows in total, taking the blocks now; fails (taking nothing)
    /// when a bounded pool cannot supply them.
    pub fn reserve(&mut self, rows: usize) -> bool {
        let need = rows.div_ceil(BLOCK_ROWS).saturating_sub(self.blocks.len());
        if need == 0 || self.width == 0 {
            return true;
        }
        match self.pool.take(need, BLOCK_ROWS * self.width, true) {
            Some(mut b) => {
                self.blocks.append(&mut b);
                true
            }
            None => false,
        }
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
        let mut p = self.pool.inner.lock();
        let mut b = LatentPool::buffers(&mut p, need, BLOCK_ROWS * self.width);
        self.blocks.append(&mut b);
        true
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        let b = &self.blocks[i / BLOCK_ROWS];
        let at = (i % BLOCK_ROWS) * self.width;
        &b[at..at + self.width]
    }

    /// Appends whole rows (`data.len()` a multiple of the width). Past the reserved blocks it
    /// takes more from the pool without enforcing its bound (single-process runs).
    pub fn extend_from_slice(&mut self, data: &[f32]) {
        if self.width == 0 {
            return;
        }
        for row in data.chunks_exact(self.width) {
            let block = self.len / BLOCK_ROWS;
            if block == self.blocks.len() {
                if let Some(mut b) = self.pool.take(1, BLOCK_ROWS * self.width, false) {
                    self.blocks.append(&mut b);
                }
            }
            self.blocks[block].extend_from_slice(row);
            self.len += 1;
        }
    }

    /// All rows, contiguous.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        for i in 0..self.len {
            out.extend_from_slice(self.row(i));
        }
        out
    }

    /// Drops every row and block.
    pub fn clear(&mut self) {
        self.pool.give_back(&mut self.blocks);
        self.len = 0;
    }

    /// Drops every row but keeps the blocks (a reservation stays reserved).
    pub fn rewind(&mut self) {
        self.blocks.iter_mut().for_each(Vec::clear);
        self.len = 0;
    }

    /// Blocks still to take for `rows` rows in total.
    pub fn blocks_short(&self, rows: usize) -> usize {
        if self.width == 0 {
            return 0;
        }
        rows.div_ceil(BLOCK_ROWS).saturating_sub(self.blocks.len())
    }

    /// The same rows, in new blocks of `pool`.
    pub fn copy_into(&self, pool: &LatentPool) -> Self {
        let mut out = Self::new(self.width, pool.clone());
        out.extend_from_slice(&self.to_vec());
        out
    }
}

impl Clone for PagedRows {
    fn clone(&self) -> Self {
        self.copy_into(&self.pool)
    }
}

impl PartialEq for PagedRows {
    fn eq(&self, other: &Self) -> bool {
        self.width == other.width
            && self.len == other.len
            && (0..self.len).all(|i| self.row(i) == other.row(i))
    }
}

impl Drop for PagedRows {
    fn drop(&mut self) {
        self.pool.give_back(&mut self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_span_blocks_and_return_to_the_pool() {
        let pool = LatentPool::bounded(4);
        let mut a = PagedRows::new(3, pool.clone());
        assert!(a.reserve(40), "40 rows = 3 blocks");
        assert_eq!(pool.free(), Some(1));
        let data: Vec<f32> = (0..40 * 3).map(|i| i as f32).collect();
        a.extend_from_slice(&data);
        assert_eq!(a.rows(), 40);
        assert_eq!(a.row(17), &[51.0, 52.0, 53.0]);
        assert_eq!(a.to_vec(), data);
        let mut b = PagedRows::new(3, pool.clone());
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
            PagedRows::new(2, pool.clone()),
            PagedRows::new(5, pool.clone()),
        );
        assert!(a.reserve_from(40, &mut claim), "3 blocks");
        assert!(b.reserve_from(33, &mut claim), "3 more");
        assert!(!b.reserve_from(90, &mut claim), "3 more needed, 2 left");
        assert_eq!(b.blocks(), 3, "a refused reservation takes nothing");
        let elsewhere = LatentPool::default();
        let mut c = PagedRows::new(2, elsewhere);
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
        let mut a = PagedRows::new(2, pool.clone());
        a.extend_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        let b = a.clone();
        assert_eq!(a, b);
        assert_eq!(pool.in_use(), 2);
        let mut c = PagedRows::new(2, pool);
        c.extend_from_slice(&[1.0, 2.0]);
        assert_ne!(a, c);
    }
}
