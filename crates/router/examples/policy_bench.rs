//! What a pick costs: every policy over pools of 2 to 256 workers, and the cache-aware
//! policy's prompt hashing and prefix lookups, per call, best of 5 runs of 100,000 calls.
//! `cargo run --release -p tandem-router --example policy_bench`.

use std::hint::black_box;
use std::time::Instant;
use tandem_router::pd::policy::{block_hashes, pick, Candidate, Policy, Pool, PrefixIndex};

fn per_call(calls: u32, mut f: impl FnMut(u32)) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for i in 0..calls {
                f(i);
            }
            t.elapsed().as_secs_f64() * 1e9 / f64::from(calls)
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    const CALLS: u32 = 100_000;
    println!("ns per pick (best of 5 x {CALLS} calls, one thread):");
    println!(
        "{:>8} {:>12} {:>12} {:>14} {:>14}",
        "workers", "round_robin", "power_of_2", "cache_aware P", "cache_aware D"
    );
    for n in [2usize, 8, 32, 256] {
        let c: Vec<Candidate> = (0..n)
            .map(|i| Candidate {
                usable: i % 7 != 3,
                load: (i * 13) % 17,
                kv_free: ((i * 101) % 997) as u64,
                cached_blocks: (i * 5) % 9,
            })
            .collect();
        let row: Vec<f64> = [
            (Policy::RoundRobin, Pool::Prefill),
            (Policy::PowerOfTwo, Pool::Prefill),
            (Policy::CacheAware { balance: 4 }, Pool::Prefill),
            (Policy::CacheAware { balance: 4 }, Pool::Decode),
        ]
        .into_iter()
        .map(|(p, pool)| {
            per_call(CALLS, |i| {
                black_box(pick(
                    p,
                    pool,
                    black_box(&c),
                    i as usize,
                    u64::from(i) * 0x9E37,
                ));
            })
        })
        .collect();
        println!(
            "{n:>8} {:>12.0} {:>12.0} {:>14.0} {:>14.0}",
            row[0], row[1], row[2], row[3]
        );
    }
    // Cache-aware prefill also hashes the prompt and looks each worker up.
    let prompt: Vec<u32> = (0..2048).map(|i| (i * 31) % 49_152).collect();
    let t_hash = per_call(10_000, |_| {
        black_box(block_hashes(black_box(&prompt)));
    });
    let hashes = block_hashes(&prompt);
    let mut index = PrefixIndex::new(65_536);
    let workers: Vec<String> = (0..32).map(|w| format!("prefill-{w}")).collect();
    for (w, name) in workers.iter().enumerate() {
        index.record(name, &hashes[..(w * 4).min(hashes.len())]);
    }
    let t_lookup = per_call(10_000, |_| {
        for name in &workers {
            black_box(index.cached(name, &hashes));
        }
    });
    println!(
        "block hashes of a 2,048-token prompt: {:.1} µs; prefix lookups on 32 workers: {:.1} µs",
        t_hash / 1e3,
        t_lookup / 1e3
    );
}
