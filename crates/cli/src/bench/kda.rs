//! `tandem bench kda`: the KDA projections fused vs unfused, KDA-hybrid decode step time, and
//! the chunked vs recurrent delta rule at prefill length — each figure as a ratio against a
//! baseline measured in the same run.

use crate::device::{RankDevices, WithBackend};
use anyhow::Result;
use std::time::Instant;
use tandem_engine::backend::cpu::delta_rule::{chunked, recurrent, DeltaRuleInputs};
use tandem_engine::backend::host::matmul_raw;
use tandem_engine::backend::hybrid::{DeltaForm, DeltaInputs};
use tandem_engine::backend::HybridOps;
use tandem_engine::models::kda_hybrid::{KdaForm, KdaHybridModel, LoadOptions};
use tandem_engine::{DType, HostTensor, Tensor};

/// Median seconds of `reps` runs of `f`.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn pseudo(n: usize, salt: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 2000) as f32 / 1000.0
                - 1.0
        })
        .collect()
}

/// Fused `[q|k|v|b|f_a|g_a]` GEMM + paired `[f_b|g_b]` vs the eight original projections,
/// for a layer of `hidden` width with `heads` × `head_dim`.
fn projections(m: usize, hidden: usize, heads: usize, head_dim: usize) -> (f64, f64) {
    let p = heads * head_dim;
    let x = pseudo(m * hidden, 1);
    let shapes = [
        (p, hidden),
        (p, hidden),
        (p, hidden),
        (heads, hidden),
        (head_dim, hidden),
        (head_dim, hidden),
    ];
    let ws: Vec<Vec<f32>> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(o, k))| pseudo(o * k, i as u32 + 2))
        .collect();
    let (fb, gb) = (pseudo(p * head_dim, 20), pseudo(p * head_dim, 21));
    let fused_w: Vec<f32> = ws.concat();
    let fused_rows: usize = shapes.iter().map(|s| s.0).sum();
    let reps = if m >= 1024 { 3 } else { 30 };
    let unfused = time(reps, || {
        let mut outs = Vec::new();
        for (w, &(o, k)) in ws.iter().zip(&shapes) {
            let mut y = Vec::new();
            matmul_raw(&x, m, w, o, k, &mut y, false);
            outs.push(y);
        }
        let (mut f, mut g) = (Vec::new(), Vec::new());
        matmul_raw(&outs[4], m, &fb, p, head_dim, &mut f, false);
        matmul_raw(&outs[5], m, &gb, p, head_dim, &mut g, false);
        std::hint::black_box((f, g));
    });
    let fused = time(reps, || {
        let mut y = Vec::new();
        matmul_raw(&x, m, &fused_w, fused_rows, hidden, &mut y, false);
        // The paired matmul: f_a and g_a are the last 2·D columns of each row.
        let fa_ga: Vec<f32> = y
            .chunks_exact(fused_rows)
            .flat_map(|r| r[fused_rows - 2 * head_dim..].to_vec())
            .collect();
        let (fa, ga): (Vec<f32>, Vec<f32>) = {
            let mut fa = Vec::with_capacity(m * head_dim);
            let mut ga = Vec::with_capacity(m * head_dim);
            for r in fa_ga.chunks_exact(2 * head_dim) {
                fa.extend_from_slice(&r[..head_dim]);
                ga.extend_from_slice(&r[head_dim..]);
            }
            (fa, ga)
        };
        let (mut f, mut g) = (Vec::new(), Vec::new());
        matmul_raw(&fa, m, &fb, p, head_dim, &mut f, false);
        matmul_raw(&ga, m, &gb, p, head_dim, &mut g, false);
        std::hint::black_box((f, g));
    });
    (unfused, fused)
}

/// Decode step time of `preset` with one request and with `batch` requests stepping together
/// (each after a 16-token prompt).
fn decode_step_times(preset: &str, batch: usize) -> Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    tandem_model::synth::synth_kda_hybrid(preset, dir.path(), false, 1)?;
    let model = KdaHybridModel::load(dir.path())?;
    let mut states: Vec<_> = (0..batch).map(|_| model.new_state()).collect();
    for (i, state) in states.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..16).map(|j| 3 + j * 7 + i as u32).collect();
        model.prefill(&prompt, state);
    }
    let mut ids: Vec<u32> = (0..batch as u32).map(|i| 5 + i).collect();
    let mut step = |n: usize| {
        let next: Vec<[u32; 1]> = ids[..n].iter().map(|&id| [id]).collect();
        let next: Vec<&[u32]> = next.iter().map(|a| a.as_slice()).collect();
        let mut refs: Vec<_> = states[..n].iter_mut().collect();
        let logits = model.extend_batch(&next, &mut refs, KdaForm::Recurrent);
        for (id, l) in ids.iter_mut().zip(&logits) {
            *id = tandem_engine::sampling::argmax(l);
        }
    };
    let one = time(16, || step(1));
    let all = time(16, || step(batch));
    Ok((one, all))
}

/// Time of one prefill of `tokens` tokens of `preset` with the chunked delta rule and with
/// the form the backend picks for prompts ([`KdaForm::Auto`], what the serving engine runs).
fn prefill_times(preset: &str, tokens: usize) -> Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    tandem_model::synth::synth_kda_hybrid(preset, dir.path(), false, 1)?;
    let model = KdaHybridModel::load(dir.path())?;
    let ids: Vec<u32> = (0..tokens as u32).map(|i| 3 + (i * 37) % 900).collect();
    let run = |form: KdaForm| {
        let mut state = model.new_state();
        std::hint::black_box(model.extend(&ids, &mut state, form, false));
    };
    Ok((
        time(3, || run(KdaForm::Chunked)),
        time(3, || run(KdaForm::Auto)),
    ))
}

/// The delta rule's inputs for `tokens` tokens of `heads` × `d`, shaped as the model feeds
/// them: l2-normalised q (scaled by `D^-1/2`) and k, log-decays in `(-0.1, 0)`, β in
/// `(0, 0.5)`; `[q, k, v, g, beta]`.
fn delta_inputs(tokens: usize, heads: usize, d: usize) -> [Vec<f32>; 5] {
    let n = tokens * heads * d;
    let unit = |v: Vec<f32>, scale: f32| -> Vec<f32> {
        v.chunks_exact(d)
            .flat_map(|c| {
                let s = c.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                c.iter().map(move |x| x / s * scale).collect::<Vec<_>>()
            })
            .collect()
    };
    let g = pseudo(n, 4)
        .iter()
        .map(|x| -0.05 * (x + 1.0) - 1e-3)
        .collect();
    let beta = pseudo(tokens * heads, 5)
        .iter()
        .map(|x| 0.25 + 0.25 * x)
        .collect();
    [
        unit(pseudo(n, 1), 1.0 / (d as f32).sqrt()),
        unit(pseudo(n, 2), 1.0),
        pseudo(n, 3),
        g,
        beta,
    ]
}

fn delta_rule(tokens: usize, heads: usize, d: usize) -> (f64, f64) {
    let [q, k, v, g, beta] = delta_inputs(tokens, heads, d);
    let inp = DeltaRuleInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
        heads,
        head_dim: d,
    };
    let c = time(3, || {
        let mut s = vec![0.0; heads * d * d];
        std::hint::black_box(chunked(&inp, &mut s));
    });
    let r = time(3, || {
        let mut s = vec![0.0; heads * d * d];
        std::hint::black_box(recurrent(&inp, &mut s));
    });
    (c, r)
}

/// Runs the KDA benchmark and prints its figures.
pub fn run() -> Result<()> {
    println!("KDA benchmark ({} threads)", rayon::current_num_threads());
    println!("fused vs unfused KDA projections (hidden 1024, 16 heads x 64):");
    for m in [1usize, 32, 2048] {
        let (u, f) = projections(m, 1024, 16, 64);
        println!(
            "  M = {m:<5} unfused {:>9.1} us   fused {:>9.1} us   unfused/fused {:.2}x",
            u * 1e6,
            f * 1e6,
            u / f
        );
    }
    let batch = 16;
    println!("KDA-hybrid decode step (16-token contexts), 1 request vs {batch} stepping together:");
    for preset in ["tiny", "medium"] {
        eprintln!("  synthesising and loading preset {preset}…");
        let (one, all) = decode_step_times(preset, batch)?;
        println!(
            "  preset {preset:<7} batch 1 {:>8.2} ms/step ({:>7.1} tok/s)   batch {batch} {:>8.2} ms/step ({:>7.1} tok/s)   {:.1}x tok/s",
            one * 1e3,
            1.0 / one,
            all * 1e3,
            batch as f64 / all,
            batch as f64 * one / all
        );
    }
    let tokens = 512;
    eprintln!("  synthesising and loading preset medium…");
    let (chunked, auto) = prefill_times("medium", tokens)?;
    println!("KDA-hybrid prefill of {tokens} tokens, preset medium, delta rule chunked vs the backend's prompt form ({:?}):",
        tandem_engine::backend::HybridOps::prompt_form(&tandem_engine::CpuBackend::new()));
    println!(
        "  chunked {:>8.1} ms ({:>7.1} tok/s)   backend's {:>8.1} ms ({:>7.1} tok/s)   {:.2}x",
        chunked * 1e3,
        tokens as f64 / chunked,
        auto * 1e3,
        tokens as f64 / auto,
        chunked / auto
    );
    let (tokens, heads, d) = (2048, 16, 64);
    let (c, r) = delta_rule(tokens, heads, d);
    println!("delta rule at {tokens} tokens ({heads} heads x {d}):");
    println!("  chunked   {:>9.1} tok/s", tokens as f64 / c);
    println!(
        "  recurrent {:>9.1} tok/s   chunked/recurrent {:.2}x",
        tokens as f64 / r,
        r / c
    );
    Ok(())
}

/// One KDA layer's delta rule on a device: chunked prefill of one sequence at several lengths
/// and recurrent decode of several sequences, one token each.
struct DeviceDeltaRule {
    heads: usize,
    head_dim: usize,
    prefill: Vec<usize>,
    decode: Vec<usize>,
    /// KDA-hybrid presets whose whole decode step is timed too.
    step_presets: Vec<&'static str>,
    step_batches: Vec<usize>,
}

/// Median seconds of one decode step of `batch` requests stepping together (each after a
/// `context`-token prompt), over `reps` steps (after one warm-up).
fn batch_step_time<B: HybridOps>(
    model: &KdaHybridModel<B>,
    batch: usize,
    context: u32,
    reps: usize,
) -> f64 {
    let mut states: Vec<_> = (0..batch).map(|_| model.new_state()).collect();
    for (i, state) in states.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..context).map(|j| 3 + j * 7 + i as u32).collect();
        model.prefill(&prompt, state);
    }
    let mut ids: Vec<u32> = (0..batch as u32).map(|i| 5 + i).collect();
    let greedy = tandem_core::SamplingParams::greedy(1);
    let rows: Vec<(&tandem_core::SamplingParams, u32)> = (0..batch).map(|_| (&greedy, 0)).collect();
    let mut sampled = Vec::with_capacity(batch);
    time(reps, || {
        let next: Vec<[u32; 1]> = ids.iter().map(|&id| [id]).collect();
        let next: Vec<&[u32]> = next.iter().map(|a| a.as_slice()).collect();
        let mut refs: Vec<_> = states.iter_mut().collect();
        // Greedy tokens drawn where the logits are, as the engine samples (only the ids come
        // back to the host): the step is complete when this returns.
        let logits = model.extend_batch_logits(&next, &mut refs, KdaForm::Recurrent, None);
        let tensor = logits
            .tensor
            .as_ref()
            .expect("a decode step has a row per sequence");
        model
            .backend()
            .sample(tensor, model.config().vocab_size, &rows, &mut sampled);
        ids.clone_from(&sampled);
    })
}

/// [`delta_inputs`] on the device.
fn device_inputs<B: HybridOps>(
    b: &B,
    tokens: usize,
    heads: usize,
    d: usize,
) -> Result<[Tensor<B>; 5]> {
    let [q, k, v, g, beta] = delta_inputs(tokens, heads, d);
    let up = |shape: &[usize], v: Vec<f32>| -> Result<Tensor<B>> {
        Ok(b.upload(&HostTensor::from_f32(shape, v)?))
    };
    Ok([
        up(&[tokens, heads, d], q)?,
        up(&[tokens, heads, d], k)?,
        up(&[tokens, heads, d], v)?,
        up(&[tokens, heads, d], g)?,
        up(&[tokens, heads], beta)?,
    ])
}

/// Median seconds of `reps` device runs of `f` (each waited for), after one warm-up.
fn device_time<B: HybridOps>(b: &B, reps: usize, mut f: impl FnMut()) -> f64 {
    time(reps, || {
        f();
        b.synchronize();
    })
}

/// Median seconds of the delta rule over the rows `seqs` (each its own sequence and state) in
/// `form`, `reps` timed calls; `heads` × `d` per token.
fn delta_time<B: HybridOps>(
    b: &B,
    seqs: &[std::ops::Range<usize>],
    form: DeltaForm,
    reps: usize,
    heads: usize,
    d: usize,
) -> Result<f64> {
    let tokens = seqs.last().map_or(0, |r| r.end);
    let [q, k, v, g, beta] = device_inputs(b, tokens, heads, d)?;
    let inputs = DeltaInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
        heads,
        head_dim: d,
    };
    let forms = vec![form; seqs.len()];
    let mut states: Vec<_> = seqs
        .iter()
        .map(|_| b.zeros(DType::F32, &[heads, d, d]))
        .collect();
    let mut out = b.zeros(DType::F32, &[tokens, heads, d]);
    Ok(device_time(b, reps, || {
        let mut refs: Vec<_> = states.iter_mut().collect();
        b.delta_rule(DeltaInputs { ..inputs }, seqs, &forms, &mut refs, &mut out);
    }))
}

impl WithBackend for DeviceDeltaRule {
    type Out = serde_json::Value;

    fn run<B: HybridOps>(self, devices: RankDevices<B>) -> Result<serde_json::Value> {
        let b = devices.single("bench kda")?;
        let (h, d) = (self.heads, self.head_dim);
        println!(
            "KDA delta rule on {}: one layer of {h} heads x {d} (f32 activations and state)",
            b.name()
        );
        let mut prefill = Vec::new();
        for &t in &self.prefill {
            // One sequence of all `t` rows.
            let secs = delta_time(
                &b,
                std::slice::from_ref(&(0..t)),
                DeltaForm::Chunked,
                5,
                h,
                d,
            )?;
            // The token loop on the same prompt, for the ratio in the same run.
            let loop_secs = delta_time(
                &b,
                std::slice::from_ref(&(0..t)),
                DeltaForm::Recurrent,
                5,
                h,
                d,
            )?;
            println!(
                "  chunked prefill {t:>6} tokens {:>9.3} ms ({:>10.0} tok/s); token loop {:>9.3} ms, chunked {:.2}x faster",
                secs * 1e3,
                t as f64 / secs,
                loop_secs * 1e3,
                loop_secs / secs
            );
            prefill.push(
                serde_json::json!({"tokens": t, "ms": secs * 1e3, "token_loop_ms": loop_secs * 1e3}),
            );
        }
        let mut decode = Vec::new();
        for &n in &self.decode {
            // `n` sequences of one token each.
            let seqs: Vec<_> = (0..n).map(|i| i..i + 1).collect();
            let secs = delta_time(&b, &seqs, DeltaForm::Recurrent, 50, h, d)?;
            // Each step reads and writes every sequence's whole state once.
            let bytes = (2 * n * h * d * d * 4) as f64;
            println!(
                "  recurrent decode {n:>4} sequences {:>9.1} us   state traffic {:>6.2} TB/s",
                secs * 1e6,
                bytes / secs / 1e12
            );
            decode.push(
                serde_json::json!({"sequences": n, "us": secs * 1e6, "tb_s": bytes / secs / 1e12}),
            );
        }
        let mut steps = Vec::new();
        for preset in &self.step_presets {
            eprintln!("  synthesising and loading KDA-hybrid preset {preset} (bf16)…");
            let dir = tempfile::tempdir()?;
            tandem_model::synth::synth_kda_hybrid(preset, dir.path(), false, 1)?;
            let options = LoadOptions {
                dtype: DType::BF16,
                ..LoadOptions::default()
            };
            let model = KdaHybridModel::load_on(b.clone(), dir.path(), &options)?;
            for &batch in &self.step_batches {
                let secs = batch_step_time(&model, batch, 16, 8);
                println!(
                    "  preset {preset:<6} decode step, batch {batch:>3} (16-token contexts) {:>8.2} ms ({:>8.1} tok/s)",
                    secs * 1e3,
                    batch as f64 / secs
                );
                steps.push(serde_json::json!({"preset": preset, "batch": batch, "ms": secs * 1e3}));
            }
        }
        Ok(serde_json::json!({
            "device": b.name(), "heads": h, "head_dim": d,
            "chunked_prefill": prefill, "recurrent_decode": decode, "decode_steps": steps,
        }))
    }
}

/// `tandem bench kda --device cuda[:N]`: the delta rule of one 32 x 128 KDA layer on the device.
pub fn run_device(device: crate::device::Device, json: Option<&std::path::Path>) -> Result<()> {
    let report = device.run(DeviceDeltaRule {
        heads: 32,
        head_dim: 128,
        prefill: vec![2048, 8192, 32768],
        decode: vec![1, 32, 128],
        step_presets: vec!["medium", "1b"],
        step_batches: vec![1, 32, 128],
    })?;
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// `tandem bench engine --device cuda[:N]` on a KDA-hybrid checkpoint: decode steps of
/// several batch sizes (each request after a `context`-token prompt) and one prefill.
pub struct KdaSteps<'a> {
    /// Model directory.
    pub dir: &'a std::path::Path,
    /// Weights dtype.
    pub dtype: DType,
    /// Decode batch sizes.
    pub batches: Vec<usize>,
    /// Prompt tokens of each decoding request.
    pub context: usize,
    /// Prompt length of the prefill figure (0: none).
    pub prefill: usize,
    /// Timed decode steps per batch size.
    pub steps: usize,
}

impl WithBackend for KdaSteps<'_> {
    type Out = serde_json::Value;

    fn run<B: HybridOps>(self, devices: RankDevices<B>) -> Result<serde_json::Value> {
        let b = devices.single("bench engine")?;
        let name = b.name();
        eprintln!("loading {} on {name}…", self.dir.display());
        let options = LoadOptions {
            dtype: self.dtype,
            ..LoadOptions::default()
        };
        let model = KdaHybridModel::load_on(b, self.dir, &options)?;
        println!(
            "step benchmark: {} {} on {name} (KDA hybrid; greedy tokens sampled on the device)",
            self.dir.display(),
            self.dtype
        );
        let mut decode = Vec::new();
        for &batch in &self.batches {
            let secs = batch_step_time(&model, batch, self.context as u32, self.steps);
            println!(
                "  decode batch {batch:>4} (context {}): {:>8.3} ms/step {:>10.0} tok/s",
                self.context,
                secs * 1e3,
                batch as f64 / secs
            );
            decode.push(
                serde_json::json!({"batch": batch, "ms": secs * 1e3, "tok_s": batch as f64 / secs}),
            );
        }
        let mut prefill = serde_json::Value::Null;
        if self.prefill > 0 {
            let ids: Vec<u32> = (0..self.prefill as u32)
                .map(|i| 3 + (i * 37) % 900)
                .collect();
            model.validate_tokens(&ids)?;
            let secs = time(3, || {
                let mut state = model.new_state();
                std::hint::black_box(model.extend(&ids, &mut state, KdaForm::Auto, false));
            });
            println!(
                "  prefill {} tokens: {:>8.1} ms {:>10.0} tok/s",
                self.prefill,
                secs * 1e3,
                self.prefill as f64 / secs
            );
            prefill = serde_json::json!({"tokens": self.prefill, "ms": secs * 1e3});
        }
        Ok(
            serde_json::json!({"device": name, "family": "kda_hybrid", "decode": decode, "prefill": prefill}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device benchmarks' bodies are written once for every backend: on the CPU, at toy
    /// sizes, they time what they say (one prefill sequence, several decode sequences, whole
    /// decode steps of a tiny checkpoint) and report every figure.
    #[test]
    fn device_benchmarks_run_on_any_backend() {
        let cpu = tandem_engine::CpuBackend::new();
        let report = DeviceDeltaRule {
            heads: 2,
            head_dim: 16,
            prefill: vec![70],
            decode: vec![3],
            step_presets: vec!["tiny"],
            step_batches: vec![2],
        }
        .run(RankDevices::new(vec![cpu.clone()]))
        .expect("delta rule figures");
        assert_eq!(report["chunked_prefill"][0]["tokens"], 70);
        assert_eq!(report["recurrent_decode"][0]["sequences"], 3);
        assert!(report["recurrent_decode"][0]["us"]
            .as_f64()
            .is_some_and(|us| us > 0.0));
        assert_eq!(report["decode_steps"][0]["batch"], 2);
        let dir = tempfile::tempdir().expect("temp dir");
        tandem_model::synth::synth_kda_hybrid("tiny", dir.path(), false, 3).expect("synth");
        let steps = KdaSteps {
            dir: dir.path(),
            dtype: DType::F32,
            batches: vec![1, 2],
            context: 4,
            prefill: 9,
            steps: 2,
        }
        .run(RankDevices::new(vec![cpu]))
        .expect("step figures");
        assert_eq!(steps["decode"].as_array().map(Vec::len), Some(2));
        assert_eq!(steps["prefill"]["tokens"], 9);
    }
}
