//! `tandem bench engine --device cuda:N`: forward-step timings of a Llama-family model on a
//! device, measured on the model directly (no scheduler), against the device's ceilings:
//! decode steps at several batch sizes over a fixed context against the memory roofline
//! (weights + K/V read per step ÷ read bandwidth), and a long prefill against bf16 GEMM peak.

use crate::device::WithBackend;
use anyhow::Result;
use std::path::Path;
use std::time::Instant;
use tandem_core::{BlockId, SamplingParams};
use tandem_engine::batch::ForwardBatch;
use tandem_engine::{KvCache, LlamaModel, StepLimits, StepMeta};

/// What to time.
pub struct StepBench<'a> {
    /// Model directory.
    pub dir: &'a Path,
    /// Weights and K/V dtype.
    pub dtype: crate::DtypeArg,
    /// Decode batch sizes.
    pub batches: Vec<usize>,
    /// Tokens already in each decode sequence's cache.
    pub context: usize,
    /// Prompt length of the prefill figure (0: none).
    pub prefill: usize,
    /// Timed decode steps per batch size.
    pub steps: usize,
    /// Memory read bandwidth of the roofline, bytes/s.
    pub bandwidth: f64,
    /// GEMM peak for the prefill fraction, FLOP/s.
    pub gemm_peak: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

impl WithBackend for StepBench<'_> {
    type Out = serde_json::Value;

    fn run<B: tandem_engine::backend::HybridOps>(
        self,
        devices: crate::device::RankDevices<B>,
    ) -> Result<serde_json::Value> {
        let backend = devices.single("bench engine")?;
        let name = backend.name();
        eprintln!("loading {} on {name}…", self.dir.display());
        let model = LlamaModel::load(self.dir, backend, self.dtype.dtype())?;
        let b = model.backend();
        let c = model.config().clone();
        let block = 16;
        let max_batch = self.batches.iter().copied().max().unwrap_or(1);
        let per_seq = (self.context + 1).div_ceil(block);
        let blocks = (max_batch * per_seq)
            .max(self.prefill.div_ceil(block))
            .max(1);
        let layout = model.kv_layout(block, blocks);
        let mut cache = KvCache::new(b, layout);
        let limits = StepLimits {
            max_tokens: max_batch.max(self.prefill).max(1),
            max_seqs: max_batch,
            max_blocks_per_seq: per_seq.max(self.prefill.div_ceil(block)),
        };
        let mut meta = StepMeta::new(b, limits);
        let mut ws = model.workspace(limits);
        let mut graphs = B::Graphs::default();
        let greedy = SamplingParams::greedy(1);
        let mut sampled = Vec::with_capacity(max_batch);
        let kv_token_bytes = layout.bytes_per_token() as f64;
        let weight_bytes = model.weight_bytes() as f64;
        println!(
            "step benchmark: {} {} on {name}",
            self.dir.display(),
            self.dtype.dtype()
        );
        println!(
            "  weights read per step {:.1} MB; roofline bandwidth {:.2} TB/s",
            weight_bytes / 1e6,
            self.bandwidth / 1e12
        );
        let mut decode = Vec::new();
        for &batch in &self.batches {
            let mut fb = ForwardBatch::default();
            for s in 0..batch {
                let table: Vec<BlockId> = (0..per_seq)
                    .map(|i| BlockId((s * per_seq + i) as u32))
                    .collect();
                fb.push(
                    &[(s % c.vocab_size) as u32],
                    self.context,
                    &table,
                    block,
                    true,
                );
            }
            meta.upload(b, &fb)?;
            let rows: Vec<(&SamplingParams, u32)> = (0..batch).map(|_| (&greedy, 0)).collect();
            // Eager launches, then as the engine runs decode steps (recorded where the
            // backend records: CUDA graphs).
            let mut timed = |recorded: bool| -> Result<f64> {
                let mut times = Vec::with_capacity(self.steps);
                for i in 0..self.steps + 3 {
                    let t = Instant::now();
                    let shape = recorded.then(|| meta.shape());
                    let mut result = Ok(());
                    b.run_step(&mut graphs, shape, &mut || {
                        result = model.forward(&meta, &mut cache, &mut ws)
                    });
                    result?;
                    b.sample(&ws.logits, c.vocab_size, &rows, &mut sampled);
                    if i >= 3 {
                        times.push(t.elapsed().as_secs_f64());
                    }
                }
                Ok(median(times))
            };
            let eager = timed(false)?;
            let step = timed(true)?;
            let bytes = weight_bytes + batch as f64 * self.context as f64 * kv_token_bytes;
            let floor = bytes / self.bandwidth;
            println!(
                "  decode batch {batch:>4} (context {}): {:>8.3} ms/step  {:>9.0} tok/s  roofline {:.3} ms ({:.0}%)  [eager {:.3} ms]",
                self.context,
                step * 1e3,
                batch as f64 / step,
                floor * 1e3,
                100.0 * floor / step,
                eager * 1e3
            );
            decode.push(serde_json::json!({
                "batch": batch, "context": self.context, "step_ms": step * 1e3,
                "eager_step_ms": eager * 1e3,
                "tok_s": batch as f64 / step, "roofline_ms": floor * 1e3,
                "roofline_fraction": floor / step,
            }));
        }
        let mut prefill = serde_json::Value::Null;
        if self.prefill > 0 {
            let n = self.prefill;
            let table: Vec<BlockId> = (0..n.div_ceil(block) as u32).map(BlockId).collect();
            let ids: Vec<u32> = (0..n).map(|i| (i * 7919 % c.vocab_size) as u32).collect();
            let mut fb = ForwardBatch::default();
            fb.push(&ids, 0, &table, block, true);
            meta.upload(b, &fb)?;
            let rows = [(&greedy, 0u32)];
            let mut times = Vec::new();
            for i in 0..4 {
                let t = Instant::now();
                let mut result = Ok(());
                b.run_step(&mut graphs, None, &mut || {
                    result = model.forward(&meta, &mut cache, &mut ws)
                });
                result?;
                b.sample(&ws.logits, c.vocab_size, &rows, &mut sampled);
                if i >= 1 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            let secs = median(times);
            let hd = c.head_dim();
            let matrix_params = (weight_bytes / self.dtype.dtype().size() as f64)
                - (c.vocab_size * c.hidden_size) as f64;
            let linear_flops = 2.0 * matrix_params * n as f64;
            let head_flops = 2.0 * (c.vocab_size * c.hidden_size) as f64;
            // QKᵀ and PV over the causal half, per layer and head.
            let attn_flops = 4.0
                * (c.num_hidden_layers * c.num_attention_heads * hd) as f64
                * (n as f64 * (n as f64 + 1.0) / 2.0);
            let flops = linear_flops + head_flops + attn_flops;
            println!(
                "  prefill {n} tokens: {:.1} ms  {:.0} tok/s  {:.1} TFLOP/s ({:.0}% of {:.0} TFLOP/s; attention {:.0}% of the FLOPs)",
                secs * 1e3,
                n as f64 / secs,
                flops / secs / 1e12,
                100.0 * flops / secs / self.gemm_peak,
                self.gemm_peak / 1e12,
                100.0 * attn_flops / flops
            );
            prefill = serde_json::json!({
                "tokens": n, "ms": secs * 1e3, "tok_s": n as f64 / secs,
                "tflop_s": flops / secs / 1e12, "peak_fraction": flops / secs / self.gemm_peak,
            });
        }
        Ok(serde_json::json!({
            "backend": name, "model": self.dir.display().to_string(),
            "dtype": self.dtype.dtype().name(), "weight_bytes": weight_bytes,
            "decode": decode, "prefill": prefill,
        }))
    }
}
