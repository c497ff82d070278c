use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::*;

/// Long enough for any healthy collective on a loaded 2-core box; only a hang reaches it.
const HANG: Duration = Duration::from_secs(60);

/// Runs `f` on one thread per communicator and returns the results in rank order. Panics
/// (instead of hanging the test run) if a rank does not finish within [`HANG`].
fn run<C, T, F>(comms: Vec<C>, f: F) -> Vec<T>
where
    C: Send + 'static,
    T: Send + 'static,
    F: Fn(usize, C) -> T + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    let n = comms.len();
    for (rank, c) in comms.into_iter().enumerate() {
        let (f, tx) = (Arc::clone(&f), tx.clone());
        thread::spawn(move || {
            let out = f(rank, c);
            // The receiver only goes away when the test already failed.
            let _ = tx.send((rank, out));
        });
    }
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (rank, v) = rx
            .recv_timeout(HANG)
            .expect("a rank hung or panicked: collectives must not deadlock");
        out[rank] = Some(v);
    }
    out.into_iter()
        .map(|v| v.expect("each rank reports once"))
        .collect()
}

#[test]
fn collectives_on_eight_threads() {
    let results = run(InProcessCommunicator::group(8, None), |rank, c| {
        assert_eq!((c.rank(), c.size()), (rank, 8));
        let r = rank as f32;

        let mut buf: Vec<f32> = (0..5).map(|i| r * 10.0 + i as f32).collect();
        c.all_reduce_sum(&mut buf).expect("all_reduce");

        let gathered = c.all_gather(&[r, r + 0.5]).expect("all_gather");

        let input: Vec<f32> = (0..16).map(|i| r * 100.0 + i as f32).collect();
        let scattered = c.reduce_scatter_sum(&input).expect("reduce_scatter");

        // Variable lengths: rank r sends j+1 copies of 10r + j to rank j.
        let send = (0..8).map(|j| vec![r * 10.0 + j as f32; j + 1]).collect();
        let received = c.all_to_all(send).expect("all_to_all");
        (buf, gathered, scattered, received)
    });
    for (rank, (buf, gathered, scattered, received)) in results.into_iter().enumerate() {
        // Σ_r (10r + i) = 280 + 8i.
        let want: Vec<f32> = (0..5).map(|i| 280.0 + 8.0 * i as f32).collect();
        assert_eq!(buf, want);
        let want: Vec<f32> = (0..8).flat_map(|r| [r as f32, r as f32 + 0.5]).collect();
        assert_eq!(gathered, want);
        // Chunk `rank` of Σ_r (100r + i) = 2800 + 8i, i in 2·rank..2·rank+2.
        let want: Vec<f32> = (2 * rank..2 * rank + 2)
            .map(|i| 2800.0 + 8.0 * i as f32)
            .collect();
        assert_eq!(scattered, want);
        let want: Vec<Vec<f32>> = (0..8)
            .map(|from| vec![from as f32 * 10.0 + rank as f32; rank + 1])
            .collect();
        assert_eq!(received, want);
    }
}

/// Each rank all-reduces its own rank number over both groups.
fn reduce_rank_over_groups(groups: RankGroups<InProcessCommunicator>) -> (usize, f32, f32) {
    let r = groups.position.rank.0 as f32;
    let mut attn = [r];
    groups.attn_tp.all_reduce_sum(&mut attn).expect("attn-TP");
    let mut tp = [r];
    groups.tp.all_reduce_sum(&mut tp).expect("TP");
    (groups.attn_tp.size(), attn[0], tp[0])
}

#[test]
fn subgroups_reduce_only_within_the_group() {
    // (tp, dp) -> expected attention-TP sums per rank.
    let cases: [(usize, usize, [f32; 8]); 3] = [
        // tp8×dp8: eight groups of one; each rank keeps its own value.
        (8, 8, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]),
        // tp8×dp2: {0..4} sums to 6, {4..8} to 22.
        (8, 2, [6.0, 6.0, 6.0, 6.0, 22.0, 22.0, 22.0, 22.0]),
        // tp8×dp1: attention TP is the full group.
        (8, 1, [28.0; 8]),
    ];
    for (tp, dp, want) in cases {
        let layout = Layout::new(tp, dp, 1).expect("valid");
        // Built collectively with `split`, as a NCCL-backed worker would.
        let via_split = run(InProcessCommunicator::group(tp, None), move |_, world| {
            reduce_rank_over_groups(RankGroups::new(world, &layout).expect("groups"))
        });
        // Built directly, as tests of model code do.
        let direct = run(
            InProcessCommunicator::for_layout(&layout, None).expect("groups"),
            |_, groups| reduce_rank_over_groups(groups),
        );
        for results in [via_split, direct] {
            for (rank, (attn_size, attn, full)) in results.into_iter().enumerate() {
                assert_eq!(attn_size, tp / dp);
                assert_eq!(attn, want[rank], "tp{tp}×dp{dp} rank {rank}");
                assert_eq!(full, 28.0);
            }
        }
    }
}

#[test]
fn split_numbers_members_in_rank_order() {
    // Colors interleaved: {0, 2, 4} and {1, 3}.
    let out = run(InProcessCommunicator::group(5, None), |rank, c| {
        let sub = c.split(rank % 2).expect("split");
        let gathered = sub.all_gather(&[rank as f32]).expect("gather");
        (sub.rank(), sub.size(), gathered)
    });
    assert_eq!(out[0], (0, 3, vec![0.0, 2.0, 4.0]));
    assert_eq!(out[3], (1, 2, vec![1.0, 3.0]));
    assert_eq!(out[4], (2, 3, vec![0.0, 2.0, 4.0]));
}

#[test]
fn rank_groups_reject_a_world_of_the_wrong_size() {
    let layout = Layout::new(4, 2, 1).expect("valid");
    let mut world = InProcessCommunicator::group(2, None);
    let c = world.remove(0);
    assert_eq!(
        RankGroups::new(c, &layout).map(|_| ()),
        Err(Error::GroupSizeMismatch {
            what: "full TP group",
            expected: 4,
            actual: 2
        })
    );
}

#[test]
fn a_dropped_peer_fails_the_collective_instead_of_hanging() {
    let out = run(InProcessCommunicator::group(4, None), |rank, c| {
        if rank == 3 {
            drop(c);
            return None;
        }
        let mut buf = [1.0];
        Some(c.all_reduce_sum(&mut buf))
    });
    for r in out.into_iter().take(3) {
        assert_eq!(
            r,
            Some(Err(Error::PeerFailed {
                rank: 3,
                failure: PeerFailure::Dropped
            }))
        );
    }
}

#[test]
fn a_peer_leaving_after_the_last_collective_does_not_break_it() {
    // Rank 2 leaves right after the first all-reduce; that one must still succeed for every
    // rank (however the threads interleave), the second must fail for the others.
    for _ in 0..50 {
        let out = run(InProcessCommunicator::group(4, None), |rank, c| {
            let mut buf = [rank as f32];
            let first = c.all_reduce_sum(&mut buf).map(|()| buf[0]);
            if rank == 2 {
                return (first, None);
            }
            let second = c.all_reduce_sum(&mut buf);
            (first, Some(second))
        });
        for (rank, (first, second)) in out.into_iter().enumerate() {
            assert_eq!(first, Ok(6.0));
            if rank != 2 {
                assert_eq!(
                    second,
                    Some(Err(Error::PeerFailed {
                        rank: 2,
                        failure: PeerFailure::Dropped
                    }))
                );
            }
        }
    }
}

#[test]
fn a_panicking_peer_fails_the_collective() {
    let mut comms = InProcessCommunicator::group(3, None);
    let doomed = comms.pop().expect("three ranks");
    let panicker = thread::spawn(move || {
        let _held = doomed;
        panic!("rank 2 fails on purpose");
    });
    let out = run(comms, |_, c| {
        let mut buf = [1.0];
        c.all_reduce_sum(&mut buf)
    });
    assert!(panicker.join().is_err());
    for r in out {
        assert_eq!(
            r,
            Err(Error::PeerFailed {
                rank: 2,
                failure: PeerFailure::Panicked
            })
        );
    }
}

#[test]
fn a_silent_peer_times_out() {
    let timeout = Duration::from_millis(100);
    let mut comms = InProcessCommunicator::group(3, Some(timeout));
    // Rank 2 stays alive but never joins.
    let silent = comms.pop().expect("three ranks");
    let out = run(comms, |_, c| c.all_gather(&[1.0]));
    for r in out {
        match r {
            Err(Error::Timeout { op, after }) => assert_eq!((op, after), ("all_gather", timeout)),
            Err(Error::PeerFailed {
                failure: PeerFailure::TimedOut,
                ..
            }) => {}
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    drop(silent);
}

#[test]
fn mismatched_calls_are_errors_on_every_rank() {
    let out = run(InProcessCommunicator::group(2, None), |rank, c| {
        if rank == 0 {
            let mut buf = [1.0];
            c.all_reduce_sum(&mut buf)
        } else {
            c.all_gather(&[1.0]).map(|_| ())
        }
    });
    for r in out {
        assert!(
            matches!(r, Err(Error::CollectiveMismatch { .. })),
            "got {r:?}"
        );
    }

    let out = run(InProcessCommunicator::group(2, None), |rank, c| {
        let mut buf = vec![1.0; rank + 1];
        c.all_reduce_sum(&mut buf)
    });
    for r in out {
        assert!(matches!(
            r,
            Err(Error::CollectiveMismatch {
                op: "all_reduce_sum",
                ..
            })
        ));
    }

    let out = run(InProcessCommunicator::group(2, None), |rank, c| {
        let send = vec![vec![1.0]; if rank == 0 { 2 } else { 3 }];
        c.all_to_all(send)
    });
    for r in out {
        assert!(matches!(
            r,
            Err(Error::CollectiveMismatch {
                op: "all_to_all",
                ..
            })
        ));
    }

    let out = run(InProcessCommunicator::group(2, None), |_, c| {
        c.reduce_scatter_sum(&[1.0, 2.0, 3.0])
    });
    for r in out {
        assert!(matches!(r, Err(Error::CollectiveMismatch { .. })));
    }
}

/// Values of wildly different magnitudes, so that the order of summation shows in the bits.
fn awkward(rank: usize, len: usize) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ (rank as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mantissa = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exponent = ((x >> 8) % 24) as i32 - 12;
            mantissa * 2f32.powi(exponent)
        })
        .collect()
}

#[test]
fn reductions_are_bitwise_deterministic() {
    const N: usize = 8;
    const LEN: usize = 256;
    let inputs: Vec<Vec<f32>> = (0..N).map(|r| awkward(r, LEN)).collect();
    let in_order: Vec<u32> = (0..LEN)
        .map(|i| {
            let mut acc = inputs[0][i];
            for input in &inputs[1..] {
                acc += input[i];
            }
            acc.to_bits()
        })
        .collect();
    // The data is chosen so that order matters: another order changes some bits.
    let reversed: Vec<u32> = (0..LEN)
        .map(|i| {
            let mut acc = inputs[N - 1][i];
            for input in inputs[..N - 1].iter().rev() {
                acc += input[i];
            }
            acc.to_bits()
        })
        .collect();
    assert_ne!(in_order, reversed);

    let inputs = Arc::new(inputs);
    for run_index in 0..20 {
        let inputs = Arc::clone(&inputs);
        let out = run(InProcessCommunicator::group(N, None), move |rank, c| {
            // Stagger arrival differently on each run.
            for _ in 0..(rank * 7 + run_index) % N {
                thread::yield_now();
            }
            let mut buf = inputs[rank].clone();
            c.all_reduce_sum(&mut buf).expect("all_reduce");
            let chunk = c.reduce_scatter_sum(&inputs[rank]).expect("reduce_scatter");
            (buf, chunk)
        });
        for (rank, (buf, chunk)) in out.into_iter().enumerate() {
            let bits: Vec<u32> = buf.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, in_order, "run {run_index} rank {rank}");
            let c = LEN / N;
            let bits: Vec<u32> = chunk.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, in_order[rank * c..(rank + 1) * c]);
        }
    }
}
