//! Time to first token of prompts that share a long prefix, with the prefix cache and
//! without, measured in one run (A/B alternating): SmolLM2 on the CPU, f32.
//!
//! `cargo run --release -p tandem-engine --example prefix_cache_ttft -- [PREFIX_TOKENS] [ROUNDS]`
//! (defaults 2048 and 3). Prints each arm's median TTFT, the ratio, and the prompt tokens each
//! arm computed.

use std::time::Instant;
use tandem_core::SamplingParams;
use tandem_engine::{CpuBackend, DType, Engine, EngineConfig, EngineEvent, LlamaModel, SeqKind};

fn engine(prefix_cache: bool, blocks: usize) -> Engine {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load SmolLM2");
    Engine::start(
        model,
        EngineConfig {
            prefix_cache,
            num_blocks: blocks,
            ..EngineConfig::default()
        },
    )
}

/// Seconds until the first token of `prompt`.
fn ttft(e: &Engine, prompt: &[u32]) -> f64 {
    let start = Instant::now();
    let mut rx = e
        .submit(
            prompt.to_vec(),
            SamplingParams::greedy(1),
            SeqKind::Generate,
        )
        .expect("submit");
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            EngineEvent::Token { .. } => return start.elapsed().as_secs_f64(),
            EngineEvent::Failed(err) => panic!("request failed: {err}"),
            _ => {}
        }
    }
    panic!("no token")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let prefix: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2048);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let blocks = (prefix / 16 + 64) * 2;
    let (on, off) = (engine(true, blocks), engine(false, blocks));
    let system: Vec<u32> = (0..prefix as u32)
        .map(|i| 100 + (i * 37) % 20_000)
        .collect();
    let question = |r: usize| -> Vec<u32> {
        let q: Vec<u32> = (0..24u32)
            .map(|i| 500 + (r as u32 * 97 + i * 13) % 9_000)
            .collect();
        [system.clone(), q].concat()
    };
    // The cache's first request computes the prefix; the rounds that follow reuse it.
    let cold = ttft(&on, &question(0));
    let (mut hot, mut plain) = (Vec::new(), Vec::new());
    let (on0, off0) = (on.stats().prefill_tokens, off.stats().prefill_tokens);
    for r in 1..=rounds {
        // A/B/B/A within each pair of rounds.
        if r % 2 == 1 {
            hot.push(ttft(&on, &question(r)));
            plain.push(ttft(&off, &question(r)));
        } else {
            plain.push(ttft(&off, &question(r)));
            hot.push(ttft(&on, &question(r)));
        }
    }
    let (h, p) = (median(hot), median(plain));
    println!(
        "prefix {prefix} tokens + 24 new, {rounds} rounds: TTFT cached {:.1} ms, uncached {:.1} ms \
         (cached / uncached = {:.3}); the cache's first request {:.1} ms",
        h * 1e3,
        p * 1e3,
        h / p,
        cold * 1e3
    );
    println!(
        "prompt tokens computed per request: cached {}, uncached {}",
        (on.stats().prefill_tokens - on0) / rounds as u64,
        (off.stats().prefill_tokens - off0) / rounds as u64
    );
}
