//! Worker selection policies, as pure functions over what the router knows of each
//! candidate: whether it may take work (not draining, breaker closed), its load (requests
//! this router has on it), its free KV (from its last stats), and how much of the prompt it
//! has seen recently ([`PrefixIndex`]).

use std::collections::{HashMap, HashSet, VecDeque};

/// How workers are picked (the config's `policy.kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Each pool in turn.
    RoundRobin,
    /// The less loaded of two drawn at random.
    PowerOfTwo,
    /// Prefill: the worker that saw the longest prefix of the prompt, unless it is more
    /// than `balance` requests busier than the least loaded (then that one). Decode: the
    /// most free KV.
    CacheAware {
        /// Load difference above which balance wins over cache hits.
        balance: usize,
    },
}

/// One worker as a policy sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    /// May take new work.
    pub usable: bool,
    /// Requests this router has on it now.
    pub load: usize,
    /// Free KV blocks at its last stats (decode).
    pub kv_free: u64,
    /// Leading prompt blocks it has seen (prefill, cache-aware).
    pub cached_blocks: usize,
}

/// Which pool a pick is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// Prefill workers.
    Prefill,
    /// Decode (and aggregated) workers.
    Decode,
}

/// The index of the worker to use. `start` is the request's round-robin position (moved on
/// by retries), `draw` a random number. When no candidate is usable the one at `start` is
/// returned (the attempt fails there and is retried or reported).
pub fn pick(policy: Policy, pool: Pool, c: &[Candidate], start: usize, draw: u64) -> usize {
    assert!(!c.is_empty(), "a pick needs candidates");
    let n = c.len();
    let usable: Vec<usize> = (0..n)
        .map(|i| (start + i) % n)
        .filter(|&i| c[i].usable)
        .collect();
    let Some(&first) = usable.first() else {
        return start % n;
    };
    let least_loaded = || {
        *usable
            .iter()
            .min_by_key(|&&i| (c[i].load, i))
            .unwrap_or(&first)
    };
    match (policy, pool) {
        (Policy::RoundRobin, _) => first,
        (Policy::PowerOfTwo, _) => {
            if usable.len() == 1 {
                return first;
            }
            // Two distinct candidates from one draw.
            let m = usable.len() as u64;
            let i = draw % m;
            let mut j = (draw >> 32) % (m - 1);
            if j >= i {
                j += 1;
            }
            let (a, b) = (usable[i as usize], usable[j as usize]);
            if c[b].load < c[a].load {
                b
            } else {
                a
            }
        }
        (Policy::CacheAware { balance }, Pool::Prefill) => {
            let best = *usable
                .iter()
                .max_by_key(|&&i| (c[i].cached_blocks, std::cmp::Reverse(c[i].load)))
                .unwrap_or(&first);
            let min = c[least_loaded()].load;
            if c[best].cached_blocks == 0 || c[best].load > min + balance {
                least_loaded()
            } else {
                best
            }
        }
        (Policy::CacheAware { .. }, Pool::Decode) => *usable
            .iter()
            .max_by_key(|&&i| (c[i].kv_free, std::cmp::Reverse(c[i].load)))
            .unwrap_or(&first),
    }
}

/// Tokens per hashed prompt block (the engines' KV block size).
pub const PREFIX_BLOCK: usize = 16;

/// Hashes of a prompt's full leading blocks, each covering every token before it too.
pub fn block_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = Vec::with_capacity(tokens.len() / PREFIX_BLOCK);
    for block in tokens.chunks_exact(PREFIX_BLOCK) {
        for &t in block {
            for b in t.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out.push(h);
    }
    out
}

/// What each prefill worker has seen recently, as prompt-block hashes (at most `capacity`
/// per worker, oldest forgotten first): kept from what the router routed.
#[derive(Debug)]
pub struct PrefixIndex {
    capacity: usize,
    workers: HashMap<String, (HashSet<u64>, VecDeque<u64>)>,
}

impl PrefixIndex {
    /// An index remembering up to `capacity` blocks per worker.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            workers: HashMap::new(),
        }
    }

    /// Records that `worker` computed a prompt with these block hashes.
    pub fn record(&mut self, worker: &str, hashes: &[u64]) {
        let (set, order) = self.workers.entry(worker.to_string()).or_default();
        for &h in hashes {
            if set.insert(h) {
                order.push_back(h);
                if order.len() > self.capacity {
                    if let Some(old) = order.pop_front() {
                        set.remove(&old);
                    }
                }
            }
        }
    }

    /// How many leading blocks of `hashes` `worker` has seen.
    pub fn cached(&self, worker: &str, hashes: &[u64]) -> usize {
        self.workers.get(worker).map_or(0, |(set, _)| {
            hashes.iter().take_while(|h| set.contains(h)).count()
        })
    }

    /// Forgets a worker (it left the pool).
    pub fn forget(&mut self, worker: &str) {
        self.workers.remove(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(load: usize) -> Candidate {
        Candidate {
            usable: true,
            load,
            ..Candidate::default()
        }
    }

    #[test]
    fn round_robin_takes_the_first_usable_from_the_start() {
        let mut c = vec![cand(0), cand(0), cand(0)];
        assert_eq!(pick(Policy::RoundRobin, Pool::Prefill, &c, 1, 0), 1);
        c[1].usable = false;
        assert_eq!(pick(Policy::RoundRobin, Pool::Prefill, &c, 1, 0), 2);
        c.iter_mut().for_each(|x| x.usable = false);
        assert_eq!(
            pick(Policy::RoundRobin, Pool::Prefill, &c, 4, 0),
            1,
            "none usable: the start"
        );
    }

    #[test]
    fn power_of_two_never_picks_the_busier_of_its_pair_and_spreads_over_draws() {
        let c = vec![cand(5), cand(1), cand(9), cand(1)];
        let mut seen = HashSet::new();
        for draw in 0..200u64 {
            let d = draw.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let i = pick(Policy::PowerOfTwo, Pool::Decode, &c, 0, d);
            assert_ne!(i, 2, "the busiest worker only loses its pairs");
            seen.insert(i);
        }
        assert!(seen.contains(&1) && seen.contains(&3), "{seen:?}");
        let one = vec![cand(3), Candidate::default()];
        assert_eq!(pick(Policy::PowerOfTwo, Pool::Decode, &one, 1, 7), 0);
    }

    #[test]
    fn cache_aware_follows_the_prefix_until_the_load_is_too_uneven() {
        let policy = Policy::CacheAware { balance: 4 };
        let mut c = vec![cand(3), cand(1), cand(2)];
        c[2].cached_blocks = 5;
        assert_eq!(pick(policy, Pool::Prefill, &c, 0, 0), 2, "the cache hit");
        c[2].load = 6;
        assert_eq!(
            pick(policy, Pool::Prefill, &c, 0, 0),
            1,
            "too busy: least loaded"
        );
        c[2].cached_blocks = 0;
        c[2].load = 0;
        assert_eq!(
            pick(policy, Pool::Prefill, &c, 0, 0),
            2,
            "no hits: least loaded"
        );
        let mut d = vec![cand(0), cand(0)];
        d[0].kv_free = 10;
        d[1].kv_free = 90;
        assert_eq!(
            pick(policy, Pool::Decode, &d, 0, 0),
            1,
            "decode: most free KV"
        );
    }

    #[test]
    fn the_index_counts_leading_blocks_and_forgets_the_oldest() {
        let prompt: Vec<u32> = (0..64).collect();
        let hashes = block_hashes(&prompt);
        assert_eq!(hashes.len(), 4);
        let mut other = prompt.clone();
        other[40] = 999;
        let other_hashes = block_hashes(&other);
        assert_eq!(other_hashes[..2], hashes[..2], "same first two blocks");
        assert_ne!(
            other_hashes[2], hashes[2],
            "a block hash covers its whole prefix"
        );
        let mut idx = PrefixIndex::new(6);
        idx.record("p0", &hashes);
        assert_eq!(idx.cached("p0", &other_hashes), 2);
        assert_eq!(idx.cached("p1", &hashes), 0);
        idx.record("p0", &block_hashes(&(1000..1048).collect::<Vec<u32>>()));
        assert_eq!(
            idx.cached("p0", &hashes),
            0,
            "the oldest blocks were forgotten first"
        );
        idx.forget("p0");
        assert_eq!(idx.cached("p0", &other_hashes), 0);
    }
}
