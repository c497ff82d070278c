//! [`InProcessCommunicator`]: ranks that are threads of one process.
//!
//! Every collective is one *round* of a single exchange primitive: each rank deposits a
//! payload in its slot; the last to arrive publishes all slots as one shared snapshot; each
//! rank computes its own result from the snapshot outside the lock and leaves; the round
//! closes when all have left, and only then may the next one start.
//!
//! - **Deterministic.** Sums are taken in rank order (`((x0 + x1) + x2) + …`) by every rank,
//!   so results are bitwise identical across ranks, runs and thread timings.
//! - **Never hangs on a dead peer.** Dropping a communicator (a finished or panicking thread)
//!   or timing out marks the group failed; a rank that would need that peer to make progress
//!   returns [`Error::PeerFailed`] instead of waiting. A round that every rank already joined
//!   still completes, so a peer exiting right after the last collective is harmless.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::comm::{Communicator, RankGroups};
use crate::error::{Error, PeerFailure, Result};
use crate::layout::{Layout, Rank};

/// One rank's handle on a group of threads. Create a group with
/// [`InProcessCommunicator::group`] and move one handle into each rank's thread.
#[derive(Debug)]
pub struct InProcessCommunicator {
    group: Arc<Group>,
    rank: usize,
}

#[derive(Debug)]
struct Group {
    size: usize,
    timeout: Option<Duration>,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    /// Deposits of the round being collected.
    slots: Vec<Option<Payload>>,
    arrived: usize,
    /// All deposits of the round being distributed; `None` while collecting.
    published: Option<Arc<Vec<Payload>>>,
    departed: usize,
    /// The first rank that left the group, and how.
    failed: Option<(usize, PeerFailure)>,
}

/// What a rank deposits; the variant names the collective, so mismatched calls are detected.
#[derive(Debug)]
enum Payload {
    AllReduce(Vec<f32>),
    AllGather(Vec<f32>),
    ReduceScatter(Vec<f32>),
    AllToAll(Vec<Vec<f32>>),
    SplitColor(usize),
    SplitGroup(Option<Arc<Group>>),
}

impl Payload {
    fn op(&self) -> &'static str {
        match self {
            Payload::AllReduce(_) => "all_reduce_sum",
            Payload::AllGather(_) => "all_gather",
            Payload::ReduceScatter(_) => "reduce_scatter_sum",
            Payload::AllToAll(_) => "all_to_all",
            Payload::SplitColor(_) | Payload::SplitGroup(_) => "split",
        }
    }
}

impl Group {
    fn new(size: usize, timeout: Option<Duration>) -> Arc<Self> {
        Arc::new(Group {
            size,
            timeout,
            state: Mutex::new(State {
                slots: (0..size).map(|_| None).collect(),
                arrived: 0,
                published: None,
                departed: 0,
                failed: None,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl InProcessCommunicator {
    /// A group of `size` ranks; element `r` is rank `r`'s handle. With a `timeout`, a rank that
    /// waits longer than that for its peers in one collective gives up with
    /// [`Error::Timeout`] and fails the group.
    pub fn group(size: usize, timeout: Option<Duration>) -> Vec<Self> {
        let group = Group::new(size, timeout);
        (0..size)
            .map(|rank| InProcessCommunicator {
                group: Arc::clone(&group),
                rank,
            })
            .collect()
    }

    /// The full TP group and the attention-TP groups for every rank of `layout`, built
    /// directly (no collective `split`); element `r` belongs to rank `r`.
    pub fn for_layout(layout: &Layout, timeout: Option<Duration>) -> Result<Vec<RankGroups<Self>>> {
        let mut attn: Vec<_> = (0..layout.dp())
            .map(|_| InProcessCommunicator::group(layout.attn_tp(), timeout).into_iter())
            .collect();
        InProcessCommunicator::group(layout.tp(), timeout)
            .into_iter()
            .map(|tp| {
                let position = layout.position(Rank(tp.rank))?;
                let attn_tp = attn[position.attn_dp_rank]
                    .next()
                    .expect("each attention-DP group has exactly A = tp/dp ranks");
                Ok(RankGroups {
                    position,
                    tp,
                    attn_tp,
                })
            })
            .collect()
    }

    /// One round: deposit `payload`, wait for every rank's, return them all.
    fn exchange(&self, op: &'static str, payload: Payload) -> Result<Arc<Vec<Payload>>> {
        let g = &*self.group;
        let deadline = g.timeout.map(|t| Instant::now() + t);
        let mut st = g.lock();
        // The previous round must be fully distributed before this one collects.
        while st.published.is_some() {
            st = self.wait(st, op, deadline)?;
        }
        if let Some((rank, failure)) = st.failed {
            return Err(Error::PeerFailed { rank, failure });
        }
        st.slots[self.rank] = Some(payload);
        st.arrived += 1;
        if st.arrived == g.size {
            let all = st
                .slots
                .iter_mut()
                .map(|s| {
                    s.take()
                        .expect("every rank deposited before the last arrival")
                })
                .collect();
            st.published = Some(Arc::new(all));
            st.arrived = 0;
            g.changed.notify_all();
        }
        let round = loop {
            // A published round is ours (it cannot close without us), even if a peer has
            // failed since it was published.
            if let Some(round) = &st.published {
                break Arc::clone(round);
            }
            st = self.wait(st, op, deadline)?;
        };
        st.departed += 1;
        if st.departed == g.size {
            st.published = None;
            st.departed = 0;
            g.changed.notify_all();
        }
        Ok(round)
    }

    /// Waits for a change; fails if the group has failed or the deadline passed.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        op: &'static str,
        deadline: Option<Instant>,
    ) -> Result<MutexGuard<'a, State>> {
        if let Some((rank, failure)) = st.failed {
            return Err(Error::PeerFailed { rank, failure });
        }
        let g = &*self.group;
        match deadline {
            None => Ok(g.changed.wait(st).unwrap_or_else(PoisonError::into_inner)),
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    st.failed.get_or_insert((self.rank, PeerFailure::TimedOut));
                    g.changed.notify_all();
                    return Err(Error::Timeout {
                        op,
                        after: g.timeout.unwrap_or_default(),
                    });
                }
                let (st, _) = g
                    .changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner);
                Ok(st)
            }
        }
    }
}

/// Every rank's payload of the expected kind, or a mismatch error.
fn unpack<'a, T>(
    round: &'a [Payload],
    op: &'static str,
    get: impl Fn(&'a Payload) -> Option<&'a T>,
) -> Result<Vec<&'a T>> {
    round
        .iter()
        .enumerate()
        .map(|(rank, p)| {
            get(p).ok_or_else(|| Error::CollectiveMismatch {
                op,
                detail: format!("rank {rank} called {}", p.op()),
            })
        })
        .collect()
}

fn same_len(op: &'static str, bufs: &[&Vec<f32>]) -> Result<usize> {
    let len = bufs.first().map_or(0, |b| b.len());
    match bufs.iter().position(|b| b.len() != len) {
        None => Ok(len),
        Some(rank) => Err(Error::CollectiveMismatch {
            op,
            detail: format!(
                "rank 0 passed {len} elements, rank {rank} passed {}",
                bufs[rank].len()
            ),
        }),
    }
}

/// `out = bufs[0][range] + bufs[1][range] + …`, in rank order.
fn sum_in_rank_order(out: &mut [f32], bufs: &[&Vec<f32>], start: usize) {
    let end = start + out.len();
    out.copy_from_slice(&bufs[0][start..end]);
    for b in &bufs[1..] {
        for (o, x) in out.iter_mut().zip(&b[start..end]) {
            *o += x;
        }
    }
}

impl Communicator for InProcessCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        let round = self.exchange(OP, Payload::AllReduce(buf.to_vec()))?;
        let bufs = unpack(&round, OP, |p| match p {
            Payload::AllReduce(v) => Some(v),
            _ => None,
        })?;
        same_len(OP, &bufs)?;
        sum_in_rank_order(buf, &bufs, 0);
        Ok(())
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        const OP: &str = "all_gather";
        let round = self.exchange(OP, Payload::AllGather(local.to_vec()))?;
        let bufs = unpack(&round, OP, |p| match p {
            Payload::AllGather(v) => Some(v),
            _ => None,
        })?;
        same_len(OP, &bufs)?;
        Ok(bufs.iter().flat_map(|b| b.iter().copied()).collect())
    }

    fn reduce_scatter_sum(&self, input: &[f32]) -> Result<Vec<f32>> {
        const OP: &str = "reduce_scatter_sum";
        let round = self.exchange(OP, Payload::ReduceScatter(input.to_vec()))?;
        let bufs = unpack(&round, OP, |p| match p {
            Payload::ReduceScatter(v) => Some(v),
            _ => None,
        })?;
        let len = same_len(OP, &bufs)?;
        if !len.is_multiple_of(self.group.size) {
            return Err(Error::CollectiveMismatch {
                op: OP,
                detail: format!(
                    "{len} elements do not split into {} equal chunks",
                    self.group.size
                ),
            });
        }
        let chunk = len / self.group.size;
        let mut out = vec![0.0; chunk];
        sum_in_rank_order(&mut out, &bufs, self.rank * chunk);
        Ok(out)
    }

    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        const OP: &str = "all_to_all";
        // Deposit even a malformed `send`, so every rank sees the mismatch instead of a hang.
        let round = self.exchange(OP, Payload::AllToAll(send))?;
        let sends = unpack(&round, OP, |p| match p {
            Payload::AllToAll(v) => Some(v),
            _ => None,
        })?;
        if let Some((from, s)) = sends
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() != self.group.size)
        {
            return Err(Error::CollectiveMismatch {
                op: OP,
                detail: format!(
                    "rank {from} passed {} send buffers for a group of {}",
                    s.len(),
                    self.group.size
                ),
            });
        }
        Ok(sends.iter().map(|s| s[self.rank].clone()).collect())
    }

    fn split(&self, color: usize) -> Result<Self> {
        const OP: &str = "split";
        let round = self.exchange(OP, Payload::SplitColor(color))?;
        let colors = unpack(&round, OP, |p| match p {
            Payload::SplitColor(c) => Some(c),
            _ => None,
        })?;
        let members: Vec<usize> = (0..self.group.size)
            .filter(|&r| *colors[r] == color)
            .collect();
        let leader = members[0];
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("this rank has its own color");
        // The lowest rank of each color creates the new group; everyone picks up its leader's.
        let created = (self.rank == leader).then(|| Group::new(members.len(), self.group.timeout));
        let round = self.exchange(OP, Payload::SplitGroup(created))?;
        match &round[leader] {
            Payload::SplitGroup(Some(group)) => Ok(InProcessCommunicator {
                group: Arc::clone(group),
                rank,
            }),
            other => Err(Error::CollectiveMismatch {
                op: OP,
                detail: format!("rank {leader} called {} instead of split", other.op()),
            }),
        }
    }
}

impl Drop for InProcessCommunicator {
    fn drop(&mut self) {
        let failure = if std::thread::panicking() {
            PeerFailure::Panicked
        } else {
            PeerFailure::Dropped
        };
        let mut st = self.group.lock();
        st.failed.get_or_insert((self.rank, failure));
        self.group.changed.notify_all();
    }
}

#[cfg(test)]
mod tests;
