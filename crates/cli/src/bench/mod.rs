//! `tandem bench …`: every benchmark subcommand. This module holds the command and `bench
//! engine` (engine throughput on this machine, with the batch-1 decode floor — weight bytes /
//! memory read bandwidth — measured in the same run, so the ratios hold on a noisy shared box
//! even when absolute figures drift); the others live beside it: `kda` (fused projections,
//! KDA-hybrid decode steps, the delta rule's two forms), `step` (`bench engine --device
//! cuda:N`: forward steps against the device's ceilings), `router` (what the router adds to a
//! request), `serve` (a load generator for any OpenAI-compatible server), `structured` (what
//! constrained decoding costs a token).

pub(crate) mod kda;
pub(crate) mod router;
pub(crate) mod serve;
pub(crate) mod step;
pub(crate) mod structured;

use anyhow::Result;
use clap::Subcommand;
use rayon::prelude::*;
use std::time::{Duration, Instant};
use tandem_core::SamplingParams;
use tandem_engine::{Engine, EngineEvent, SeqKind};

#[derive(Subcommand, Debug)]
// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
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
        /// Weights and K/V dtype.
        #[arg(long, value_enum, default_value_t = crate::DtypeArg::F32)]
        dtype: crate::DtypeArg,
        /// Also prefill prompts of these lengths (comma-separated; the long-prompt figures).
        #[arg(long, value_delimiter = ',', default_value = "2048,4096,8190")]
        long_prompts: Vec<usize>,
        /// Token ids to run instead of the generated prompts (JSON: `prefill` list of prompts,
        /// `decode_b1` prompt, `decode_batch` list of prompts, `decode_tokens`, `repeat`), so
        /// another engine can be run on identical inputs.
        #[arg(long)]
        workload: Option<std::path::PathBuf>,
        /// Use at most this SIMD instruction set (avx512, avx2, portable) to compare paths.
        #[arg(long)]
        cpu_isa: Option<String>,
        /// Device: cpu (the engine benchmark above) or cuda[:N] (forward-step timings against
        /// the device's roofline; see --step-batches).
        #[arg(long, default_value = "cpu", value_parser = crate::device::parse)]
        device: crate::device::Device,
        /// Decode batch sizes of the step benchmark.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
        step_batches: Vec<usize>,
        /// Cached tokens per sequence in the step benchmark's decode steps.
        #[arg(long, default_value_t = 512)]
        step_context: usize,
        /// Prompt length of the step benchmark's prefill (0: none).
        #[arg(long, default_value_t = 8192)]
        step_prefill: usize,
        /// Memory bandwidth of the step benchmark's roofline, TB/s (an H200's back-to-back
        /// GEMV figure by default).
        #[arg(long, default_value_t = 3.7)]
        roofline_tb_s: f64,
        /// bf16 GEMM peak of the step benchmark's prefill fraction, TFLOP/s (an H200's by
        /// default).
        #[arg(long, default_value_t = 790.0)]
        gemm_peak_tflop_s: f64,
    },
    /// KDA projections fused vs unfused, KDA-hybrid decode step, chunked vs recurrent; with
    /// `--device cuda[:N]`, one KDA layer's delta rule (32 heads x 128) on that device:
    /// chunked prefill at 2k / 8k / 32k tokens and recurrent decode at 1 / 32 / 128 sequences.
    Kda {
        /// Where the delta rule runs (`cpu`: the CPU figures above).
        #[arg(long, value_parser = crate::device::parse, default_value = "cpu")]
        device: crate::device::Device,
        /// Write the device figures as JSON here too.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// Constrained decoding (structured outputs) per-token cost against the decode step,
    /// JSON mode and a nested schema, batch 1 and batched.
    Structured {
        /// Model directory or known name (needs its tokenizer.json).
        #[arg(long, default_value = crate::models::DEFAULT_MODEL)]
        model: String,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 64)]
        max_tokens: u32,
        /// Batch size of the batched figure.
        #[arg(long, default_value_t = 16)]
        batch: usize,
    },
    /// What the router adds to request latency at a fixed arrival rate, against null
    /// workers (no model), beside the same exchange made directly over gRPC; and, with
    /// etcd installed, how fast a registered worker reaches the router's pools.
    Router {
        /// Requests per second (open loop).
        #[arg(long, default_value_t = 1000.0)]
        rate: f64,
        /// Seconds per measured phase.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Tokens per request.
        #[arg(long, default_value_t = 4)]
        max_tokens: u32,
        /// Write the figures as JSON here too.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// Load against an OpenAI-compatible server (`vllm bench serve`'s figures and JSON
    /// keys); with `--arms A=URL,B=URL --order ABBA`, ordered arms on identical seeded
    /// inputs, pooled, with ratios, drift, an output identity check and a gate verdict.
    Serve(crate::bench::serve::ServeArgs),
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
            dtype,
            long_prompts,
            workload,
            cpu_isa,
            device,
            step_batches,
            step_context,
            step_prefill,
            roofline_tb_s,
            gemm_peak_tflop_s,
        } => {
            if device != crate::device::Device::Cpu {
                let dir = crate::models::resolve(&model)?;
                if crate::eval::family(&dir)? == crate::eval::Family::KdaHybrid {
                    let report = device.run(crate::bench::kda::KdaSteps {
                        dir: &dir,
                        dtype: dtype.dtype(),
                        batches: step_batches,
                        context: step_context,
                        prefill: step_prefill,
                        steps: 8,
                    })?;
                    if let Some(path) = json {
                        std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
                    }
                    return Ok(());
                }
                let report = device.run(crate::bench::step::StepBench {
                    dir: &dir,
                    dtype,
                    batches: step_batches,
                    context: step_context,
                    prefill: step_prefill,
                    steps: 20,
                    bandwidth: roofline_tb_s * 1e12,
                    gemm_peak: gemm_peak_tflop_s * 1e12,
                })?;
                if let Some(path) = json {
                    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
                }
                return Ok(());
            }
            if let Some(name) = cpu_isa {
                let isa = tandem_cpu_kernels::Isa::parse(&name).ok_or_else(|| {
                    anyhow::anyhow!("--cpu-isa {name}: expected avx512, avx2 or portable")
                })?;
                let chosen = tandem_cpu_kernels::isa::limit(isa);
                eprintln!("CPU kernels limited to {chosen}");
            }
            let workload = match workload {
                Some(path) => {
                    let text = std::fs::read_to_string(&path)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                    serde_json::from_str(&text)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
                }
                None => {
                    Workload::generated(prompt_tokens, &long_prompts, batch, decode_tokens, repeat)
                }
            };
            engine_bench(&model, &workload, dtype, json)
        }
        BenchCommand::Kda { device, json } => match device {
            crate::device::Device::Cpu => crate::bench::kda::run(),
            device => crate::bench::kda::run_device(device, json.as_deref()),
        },
        BenchCommand::Structured {
            model,
            max_tokens,
            batch,
        } => crate::bench::structured::run(&model, max_tokens, batch),
        BenchCommand::Router {
            rate,
            seconds,
            max_tokens,
            json,
        } => crate::bench::router::run(rate, seconds, max_tokens, json),
        BenchCommand::Serve(args) => crate::bench::serve::run(args),
    }
}

/// Read bandwidth in bytes/s: the best of several passes in which each rayon thread sums its
/// share of a 512 MiB buffer with the CPU kernels' vectorised sum (so the loop is load-bound
/// on every instruction set the kernels use).
fn read_bandwidth() -> f64 {
    let data = vec![1.0f32; 128 << 20];
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s: f32 = data
            .par_chunks(1 << 20)
            .map(tandem_cpu_kernels::vector::sum)
            .sum();
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((data.len() * 4) as f64 / dt);
    }
    best
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

/// What the engine benchmark runs: prompts as token ids, so another engine can be given the
/// very same inputs (`--workload`).
#[derive(serde::Deserialize, serde::Serialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Prompts whose prefill throughput is measured (time to the first token).
    prefill: Vec<Vec<u32>>,
    /// The prompt of the batch-1 decode figure.
    decode_b1: Vec<u32>,
    /// The prompts of the batched decode figure.
    decode_batch: Vec<Vec<u32>>,
    /// Tokens generated per sequence in the decode figures.
    decode_tokens: u32,
    /// Repetitions (medians are reported).
    repeat: usize,
}

impl Workload {
    fn generated(
        prompt_tokens: usize,
        long: &[usize],
        batch: usize,
        decode_tokens: u32,
        repeat: usize,
    ) -> Self {
        let mut prefill = vec![prompt(prompt_tokens, 1)];
        prefill.extend(
            long.iter()
                .enumerate()
                .map(|(i, &n)| prompt(n, 2 + i as u32)),
        );
        Workload {
            prefill,
            decode_b1: prompt(32, 100),
            decode_batch: (0..batch).map(|i| prompt(32, 200 + i as u32)).collect(),
            decode_tokens,
            repeat: repeat.max(1),
        }
    }
}

/// Runs `n` sequences concurrently; returns (time to all first tokens, decode tokens/s after
/// every sequence has its first token).
fn run_batch(engine: &Engine, prompts: &[Vec<u32>], max_tokens: u32) -> Result<(Duration, f64)> {
    let params = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    let start = Instant::now();
    let mut rxs = Vec::new();
    for p in prompts {
        rxs.push(engine.submit(p.clone(), params.clone(), SeqKind::Generate)?);
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

/// A one-rank CPU engine of `model` for the benchmarks, with `kv_blocks` blocks of K/V.
pub fn cpu_engine_args(model: &str, kv_blocks: usize, dtype: crate::DtypeArg) -> crate::EngineArgs {
    crate::EngineArgs {
        model: model.to_string(),
        kv_blocks,
        state_slots: 64,
        max_batch_tokens: 512,
        // Benchmarks repeat prompts to time their compute: nothing is reused.
        no_prefix_cache: true,
        prefix_state_mib: 0,
        layout: crate::eval::LayoutArgs {
            tp: 1,
            dp: 1,
            ep: 1,
        },
        lora: None,
        dtype,
        device: crate::device::Device::Cpu,
        engine: crate::EngineKind::Model,
        synthetic_step: std::time::Duration::ZERO,
    }
}

fn engine_bench(
    model: &str,
    w: &Workload,
    dtype: crate::DtypeArg,
    json: Option<std::path::PathBuf>,
) -> Result<()> {
    let longest = w.prefill.iter().map(Vec::len).max().unwrap_or(0);
    // Room for the longest prompt plus a batch of decodes.
    let args = cpu_engine_args(model, (longest / 16 + 64).max(2048), dtype);
    let engine = args.start()?;
    eprintln!("warming up…");
    run_batch(&engine, &[prompt(32, 0)], 4)?;
    let bw = read_bandwidth();
    let weight_bytes = engine.weight_bytes() as f64;
    let floor = bw / weight_bytes;
    let mut prefill: Vec<Vec<f64>> = vec![Vec::new(); w.prefill.len()];
    let mut d1 = Vec::new();
    let mut dn = Vec::new();
    for r in 0..w.repeat {
        for (p, times) in w.prefill.iter().zip(&mut prefill) {
            let (ttft, _) = run_batch(&engine, std::slice::from_ref(p), 1)?;
            times.push(p.len() as f64 / ttft.as_secs_f64());
        }
        d1.push(run_batch(&engine, std::slice::from_ref(&w.decode_b1), w.decode_tokens)?.1);
        dn.push(run_batch(&engine, &w.decode_batch, w.decode_tokens)?.1);
        eprintln!("  repeat {}/{} done", r + 1, w.repeat);
    }
    let prefill: Vec<(usize, f64)> = w
        .prefill
        .iter()
        .zip(prefill)
        .map(|(p, t)| (p.len(), median(t)))
        .collect();
    let (d1, dn) = (median(d1), median(dn));
    let batch = w.decode_batch.len();
    let report = serde_json::json!({
        "engine": "tandem",
        "dtype": dtype.dtype().name(),
        "backend": tandem_engine::Backend::name(&tandem_engine::CpuBackend::new()),
        "threads": rayon::current_num_threads(),
        "read_bandwidth_gb_s": bw / 1e9,
        "weight_bytes": weight_bytes,
        "decode_floor_tok_s": floor,
        "prefill": prefill.iter().map(|&(tokens, tok_s)| serde_json::json!({"tokens": tokens, "tok_s": tok_s})).collect::<Vec<_>>(),
        "decode_b1_tok_s": d1,
        "decode_b1_vs_floor": d1 / floor,
        "decode_batch": batch,
        "decode_batch_tok_s": dn,
        "batch_vs_b1": dn / d1,
    });
    println!(
        "engine benchmark: {} weights, {}",
        dtype.dtype(),
        tandem_engine::Backend::name(&tandem_engine::CpuBackend::new())
    );
    println!("  memory read bandwidth      {:>8.1} GB/s", bw / 1e9);
    println!(
        "  weights read per token     {:>8.1} MB",
        weight_bytes / 1e6
    );
    println!("  batch-1 decode floor       {:>8.1} tok/s", floor);
    let base = prefill.first().map(|p| p.1).unwrap_or(f64::NAN);
    for &(tokens, tok_s) in &prefill {
        println!(
            "  prefill ({tokens:>5} tokens)    {:>8.1} tok/s  ({:.0}% of the first)",
            tok_s,
            100.0 * tok_s / base
        );
    }
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
