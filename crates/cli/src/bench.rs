//! `tandem bench engine`: engine throughput on this machine, with the batch-1 decode floor
//! (weight bytes / memory read bandwidth) measured in the same run, so the ratios hold on
//! a noisy shared box even when absolute figures drift.

use anyhow::Result;
use clap::Subcommand;
use rayon::prelude::*;
use std::time::{Duration, Instant};
use tandem_core::SamplingParams;
use tandem_engine::{Engine, EngineEvent, SeqKind};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode throughput of the engine alone.
    Engine {
        /// Model directory or known name.
        #[arg(long, default_value = crate::models::DEFAULT_MODEL)]
        model: String,
        /// Prompt length for the prefill figure.
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        /// Tokens generated per sequence in the decode figures.
        #[arg(long, default_value_t = 64)]
        decode_tokens: u32,
        /// Batch size of the batched decode figure.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Repetitions (medians are reported).
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// Write the figures as JSON here too.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// KDA projections fused vs unfused, KDA-hybrid decode step, chunked vs recurrent.
    Kda,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Engine {
            model,
            prompt_tokens,
            decode_tokens,
            batch,
            repeat,
            json,
        } => engine_bench(&model, prompt_tokens, decode_tokens, batch, repeat, json),
        BenchCommand::Kda => crate::bench_kda::run(),
    }
}

/// Read bandwidth in bytes/s: the best of several passes in which each rayon thread sums its
/// share of a 512 MiB buffer (eight 16-lane accumulators, so the loop is load-bound).
fn read_bandwidth() -> f64 {
    let data = vec![1.0f32; 128 << 20];
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s: f32 = data.par_chunks(1 << 20).map(lane_sum).sum();
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((data.len() * 4) as f64 / dt);
    }
    best
}

fn lane_sum(c: &[f32]) -> f32 {
    let mut acc = [[0.0f32; 16]; 8];
    for block in c.chunks_exact(128) {
        for (lanes, part) in acc.iter_mut().zip(block.chunks_exact(16)) {
            for (a, v) in lanes.iter_mut().zip(part) {
                *a += v;
            }
        }
    }
    acc.iter().flatten().sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (i * 7919 + salt * 104_729) % 40_000)
        .collect()
}

/// Runs `n` sequences concurrently; returns (time to all first tokens, decode tokens/s after
/// every sequence has its first token).
fn run_batch(
    engine: &Engine,
    n: usize,
    prompt_len: usize,
    max_tokens: u32,
    salt: u32,
) -> Result<(Duration, f64)> {
    let params = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    let start = Instant::now();
    let mut rxs = Vec::new();
    for i in 0..n {
        rxs.push(engine.submit(
            prompt(prompt_len, salt + i as u32),
            params.clone(),
            SeqKind::Generate,
        )?);
    }
    // First tokens.
    for rx in &mut rxs {
        match rx.blocking_recv() {
            Some(EngineEvent::Token { .. }) => {}
            other => anyhow::bail!("unexpected engine event {other:?}"),
        }
    }
    let ttft_all = start.elapsed();
    let t = Instant::now();
    let mut tokens = 0usize;
    for rx in &mut rxs {
        while let Some(ev) = rx.blocking_recv() {
            if let EngineEvent::Token { finish, .. } = ev {
                tokens += 1;
                if finish.is_some() {
                    break;
                }
            }
        }
    }
    Ok((ttft_all, tokens as f64 / t.elapsed().as_secs_f64()))
}

fn engine_bench(
    model: &str,
    prompt_tokens: usize,
    decode_tokens: u32,
    batch: usize,
    repeat: usize,
    json: Option<std::path::PathBuf>,
) -> Result<()> {
    let args = crate::EngineArgs {
        model: model.to_string(),
        kv_blocks: 2048,
        state_slots: 64,
        max_batch_tokens: 512,
        layout: crate::eval::LayoutArgs {
            tp: 1,
            dp: 1,
            ep: 1,
        },
        lora: None,
    };
    let engine = args.start()?;
    eprintln!("warming up…");
    run_batch(&engine, 1, 32, 4, 0)?;
    let bw = read_bandwidth();
    let weight_bytes = engine.weight_bytes() as f64;
    let floor = bw / weight_bytes;
    let mut prefill = Vec::new();
    let mut d1 = Vec::new();
    let mut dn = Vec::new();
    for r in 0..repeat {
        let salt = 1000 * (r as u32 + 1);
        let (ttft, _) = run_batch(&engine, 1, prompt_tokens, 1, salt)?;
        prefill.push(prompt_tokens as f64 / ttft.as_secs_f64());
        d1.push(run_batch(&engine, 1, 16, decode_tokens, salt + 1)?.1);
        dn.push(run_batch(&engine, batch, 16, decode_tokens, salt + 2)?.1);
        eprintln!("  repeat {}/{repeat} done", r + 1);
    }
    let (prefill, d1, dn) = (median(prefill), median(d1), median(dn));
    let report = serde_json::json!({
        "threads": rayon::current_num_threads(),
        "read_bandwidth_gb_s": bw / 1e9,
        "weight_bytes": weight_bytes,
        "decode_floor_tok_s": floor,
        "prefill_tok_s": prefill,
        "prompt_tokens": prompt_tokens,
        "decode_b1_tok_s": d1,
        "decode_b1_vs_floor": d1 / floor,
        "batch": batch,
        "decode_batch_tok_s": dn,
        "batch_vs_b1": dn / d1,
    });
    println!(
        "engine benchmark ({} threads)",
        rayon::current_num_threads()
    );
    println!("  memory read bandwidth      {:>8.1} GB/s", bw / 1e9);
    println!(
        "  weights read per token     {:>8.1} MB",
        weight_bytes / 1e6
    );
    println!("  batch-1 decode floor       {:>8.1} tok/s", floor);
    println!(
        "  prefill ({prompt_tokens} tokens)       {:>8.1} tok/s",
        prefill
    );
    println!(
        "  decode batch 1             {:>8.1} tok/s  ({:.0}% of floor)",
        d1,
        100.0 * d1 / floor
    );
    println!(
        "  decode batch {batch:<2}            {:>8.1} tok/s  ({:.1}x batch 1)",
        dn,
        dn / d1
    );
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
