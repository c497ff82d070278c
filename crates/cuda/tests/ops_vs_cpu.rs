//! Every CUDA operation against the CPU backend on the same inputs. Without a usable GPU
//! each test prints why and passes (CI has none; `make test-gpu` runs these on one).

mod common;
use common::gpu;

use tandem_core::{BlockId, SamplingParams};
use tandem_cuda::CudaBackend;
use tandem_engine::backend::{Linear, QkvLayout};
use tandem_engine::batch::ForwardBatch;
use tandem_engine::{
    Backend, CpuBackend, DType, HostTensor, KvCache, KvLayout, Ops, StepLimits, StepMeta,
};

use common::hybrid::noise;

fn host(shape: &[usize], data: Vec<f32>, dtype: DType) -> HostTensor {
    HostTensor::from_f32(shape, data)
        .expect("shape matches")
        .to_dtype(dtype)
        .expect("float dtype")
}

/// The same tensor on both devices.
fn both<C: Ops, G: Ops>(
    c: &C,
    g: &G,
    t: &HostTensor,
) -> (tandem_engine::Tensor<C>, tandem_engine::Tensor<G>) {
    (c.upload(t), g.upload(t))
}

fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = a.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= tol * scale,
        "{what}: max |cpu - cuda| = {worst} (scale {scale}, tolerance {tol})"
    );
}

/// The same `(n, k)` weight as a linear layer on both devices.
fn linears<C: Ops, G: Ops>(
    c: &C,
    g: &G,
    w: &HostTensor,
    n: usize,
    k: usize,
) -> (Linear<C>, Linear<G>) {
    (
        Linear {
            weight: c.upload_weight(w),
            out_features: n,
            in_features: k,
        },
        Linear {
            weight: g.upload_weight(w),
            out_features: n,
            in_features: k,
        },
    )
}

fn f32s<B: Backend>(b: &B, t: &tandem_engine::Tensor<B>, n: usize) -> Vec<f32> {
    let mut v = b.download(t).to_f32_vec();
    v.truncate(n);
    v
}

#[test]
fn elementwise_operations_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (rows, dim) = (7, 96);
    for dtype in [DType::F32, DType::BF16] {
        // Embedding lookup from a table in the weights' dtype.
        let table = host(&[50, dim], noise(1, 50 * dim), dtype);
        let (tc, tg) = both(&c, &g, &table);
        let ids = HostTensor::from_u32(vec![3, 49, 0, 7, 7, 21, 11]);
        let (ic, ig) = both(&c, &g, &ids);
        let (mut oc, mut og) = (
            c.zeros(DType::F32, &[rows, dim]),
            g.zeros(DType::F32, &[rows, dim]),
        );
        c.embed(&tc, &ic, rows, &mut oc);
        g.embed(&tg, &ig, rows, &mut og);
        close(
            &format!("embed {dtype}"),
            &f32s(&c, &oc, rows * dim),
            &f32s(&g, &og, rows * dim),
            0.0,
        );
    }
    let x = host(&[rows, dim], noise(2, rows * dim), DType::F32);
    let w = host(&[dim], noise(3, dim), DType::F32);
    let (xc, xg) = both(&c, &g, &x);
    let (wc, wg) = both(&c, &g, &w);
    let (mut oc, mut og) = (
        c.zeros(DType::F32, &[rows, dim]),
        g.zeros(DType::F32, &[rows, dim]),
    );
    c.rms_norm(&xc, &wc, rows, 1e-5, &mut oc);
    g.rms_norm(&xg, &wg, rows, 1e-5, &mut og);
    close(
        "rms_norm",
        &f32s(&c, &oc, rows * dim),
        &f32s(&g, &og, rows * dim),
        1e-5,
    );

    let width = 48;
    let gu = host(&[rows, 2 * width], noise(4, rows * 2 * width), DType::F32);
    let (gc, gg) = both(&c, &g, &gu);
    let (mut oc, mut og) = (
        c.zeros(DType::F32, &[rows, width]),
        g.zeros(DType::F32, &[rows, width]),
    );
    c.silu_mul(&gc, rows, width, &mut oc);
    g.silu_mul(&gg, rows, width, &mut og);
    close(
        "silu_mul",
        &f32s(&c, &oc, rows * width),
        &f32s(&g, &og, rows * width),
        1e-5,
    );

    let index = HostTensor::from_u32(vec![6, 0, 3]);
    let (ic, ig) = both(&c, &g, &index);
    let (mut oc, mut og) = (
        c.zeros(DType::F32, &[3, dim]),
        g.zeros(DType::F32, &[3, dim]),
    );
    c.gather_rows(&xc, dim, &ic, 3, &mut oc);
    g.gather_rows(&xg, dim, &ig, 3, &mut og);
    close(
        "gather_rows",
        &f32s(&c, &oc, 3 * dim),
        &f32s(&g, &og, 3 * dim),
        0.0,
    );

    for (nh, nkv, hd) in [(9, 3, 64), (8, 2, 128)] {
        let layout = QkvLayout {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let w = layout.row_width();
        let qkv = host(&[rows, w], noise(5, rows * w), DType::F32);
        let pos = HostTensor::from_u32(vec![0, 1, 2, 100, 4095, 7, 65_000]);
        let (mut qc, mut qg) = both(&c, &g, &qkv);
        let (pc, pg) = both(&c, &g, &pos);
        c.rope(&mut qc, rows, layout, &pc, 500_000.0);
        g.rope(&mut qg, rows, layout, &pg, 500_000.0);
        close(
            &format!("rope hd={hd}"),
            &f32s(&c, &qc, rows * w),
            &f32s(&g, &qg, rows * w),
            2e-4,
        );
    }
}

#[test]
fn matmul_matches_the_cpu_for_every_row_count_and_dtype() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    // (out, in): in a multiple of 8 (the GEMV path for bf16) and not (cuBLAS for every M).
    for (n, k) in [(72, 264), (40, 100)] {
        for dtype in [DType::F32, DType::BF16] {
            let w = host(&[n, k], noise(7, n * k), dtype);
            let wc = c.upload_weight(&w);
            let wg = g.upload_weight(&w);
            for rows in [1, 2, 5, 8, 9, 33, 200] {
                let x = host(&[rows, k], noise(rows as u64, rows * k), DType::F32);
                let (xc, xg) = both(&c, &g, &x);
                for accumulate in [false, true] {
                    let start = host(&[rows, n], noise(99, rows * n), DType::F32);
                    let (mut oc, mut og) = both(&c, &g, &start);
                    c.matmul(&xc, rows, &wc, n, k, &mut oc, accumulate);
                    g.matmul(&xg, rows, &wg, n, k, &mut og, accumulate);
                    // cuBLAS takes bf16 activations above the GEMV rows: bf16 rounding.
                    let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-4 };
                    close(
                        &format!("matmul {dtype} {n}x{k} rows={rows} acc={accumulate}"),
                        &f32s(&c, &oc, rows * n),
                        &f32s(&g, &og, rows * n),
                        tol,
                    );
                }
            }
        }
    }
}

/// Block-FP8 weights (128×128 tiles) kept as FP8 on the GPU against the CPU's product with
/// their dequantised f32 values: exact FP8 products (f32 sums of code × tile scale) on the GEMV
/// path — partial tiles in both directions, more than one batch of loads a row, more features
/// than warps — and the dequantise-to-bf16 path above the GEMV rows or for rows not of whole
/// 16-code chunks (bf16 rounding there).
#[test]
fn block_fp8_matmuls_match_the_cpu_on_their_dequantised_values() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    for (n, k) in [(300, 272), (2500, 4112), (72, 40)] {
        let (codes, scales) = tandem_model::fp8::quantize_blocks(&noise(11, n * k), n, k, 128);
        let m = tandem_engine::BlockFp8 {
            codes,
            scales,
            rows: n,
            cols: k,
            block: 128,
        };
        let wg = g
            .upload_fp8_weight(&m)
            .expect("the GPU keeps 128-tile FP8 weights");
        assert_eq!(wg.dtype(), DType::F8E4M3);
        let wc = c.upload_weight(&host(&[n, k], m.dequantize(), DType::F32));
        for rows in [1, 2, 3, 5, 8, 9, 33] {
            let x = host(&[rows, k], noise(rows as u64, rows * k), DType::F32);
            let (xc, xg) = both(&c, &g, &x);
            for accumulate in [false, true] {
                let start = host(&[rows, n], noise(98, rows * n), DType::F32);
                let (mut oc, mut og) = both(&c, &g, &start);
                c.matmul(&xc, rows, &wc, n, k, &mut oc, accumulate);
                g.matmul(&xg, rows, &wg, n, k, &mut og, accumulate);
                let exact = rows <= 8 && k.is_multiple_of(16);
                let tol = if exact { 1e-4 } else { 2e-2 };
                close(
                    &format!("block-FP8 matmul {n}x{k} rows={rows} acc={accumulate}"),
                    &f32s(&c, &oc, rows * n),
                    &f32s(&g, &og, rows * n),
                    tol,
                );
            }
        }
    }
}

#[test]
fn decode_shaped_gemvs_match_the_cpu_on_large_matrices() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    // More features than the grid has warps (each warp takes several) and rows of more than
    // one batch of loads (2,056 = 2,048 + 8), in bf16: the GEMV path at 1 and 2 rows.
    let (n, k) = (2500, 2056);
    let w = host(&[n, k], noise(31, n * k), DType::BF16);
    let (wc, wg) = (c.upload_weight(&w), g.upload_weight(&w));
    for rows in [1, 2, 3] {
        let x = host(&[rows, k], noise(32 + rows as u64, rows * k), DType::F32);
        let (xc, xg) = both(&c, &g, &x);
        for accumulate in [false, true] {
            let start = host(&[rows, n], noise(33, rows * n), DType::F32);
            let (mut oc, mut og) = both(&c, &g, &start);
            c.matmul(&xc, rows, &wc, n, k, &mut oc, accumulate);
            g.matmul(&xg, rows, &wg, n, k, &mut og, accumulate);
            close(
                &format!("matmul bf16 {n}x{k} rows={rows} acc={accumulate}"),
                &f32s(&c, &oc, rows * n),
                &f32s(&g, &og, rows * n),
                if rows <= 2 { 2e-3 } else { 2e-2 },
            );
        }
    }
}

/// Every GEMV kernel (1 to 8 activation rows; by default only 1–2 rows take them, so a
/// backend set to 8 here) on a matrix with more features than the grid has warps, an odd
/// number of gate/up pairs, and rows of more than one batch of loads: plain, RMSNorm-fused
/// and RMSNorm + SiLU-gated, against the CPU.
#[test]
fn gemvs_at_every_row_count_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let g = g.with_gemv_rows(8);
    let c = CpuBackend::new();
    let (n, k) = (2502, 2056);
    let w = host(&[n, k], noise(51, n * k), DType::BF16);
    let (lc, lg) = linears(&c, &g, &w, n, k);
    let norm = host(&[k], noise(52, k), DType::F32);
    let (nc, ng) = both(&c, &g, &norm);
    for rows in 1..=8 {
        let x = host(&[rows, k], noise(53 + rows as u64, rows * k), DType::F32);
        let (xc, xg) = both(&c, &g, &x);
        for accumulate in [false, true] {
            let start = host(&[rows, n], noise(54, rows * n), DType::F32);
            let (mut oc, mut og) = both(&c, &g, &start);
            c.linear(&xc, rows, &lc, &mut oc, accumulate);
            g.linear(&xg, rows, &lg, &mut og, accumulate);
            close(
                &format!("gemv {n}x{k} rows={rows} acc={accumulate}"),
                &f32s(&c, &oc, rows * n),
                &f32s(&g, &og, rows * n),
                2e-3,
            );
        }
        let (mut hc, mut hg) = (
            c.zeros(DType::F32, &[rows, k]),
            g.zeros(DType::F32, &[rows, k]),
        );
        let (mut oc, mut og) = (
            c.zeros(DType::F32, &[rows, n]),
            g.zeros(DType::F32, &[rows, n]),
        );
        c.rms_norm_linear(&xc, &nc, rows, 1e-5, &mut hc, &lc, &mut oc);
        g.rms_norm_linear(&xg, &ng, rows, 1e-5, &mut hg, &lg, &mut og);
        close(
            &format!("gemv_norm {n}x{k} rows={rows}"),
            &f32s(&c, &oc, rows * n),
            &f32s(&g, &og, rows * n),
            2e-3,
        );
        let width = n / 2;
        let (mut ac, mut ag) = (
            c.zeros(DType::F32, &[rows, width]),
            g.zeros(DType::F32, &[rows, width]),
        );
        c.rms_norm_gate_up(&xc, &nc, rows, 1e-5, &mut hc, &lc, &mut oc, &mut ac);
        g.rms_norm_gate_up(&xg, &ng, rows, 1e-5, &mut hg, &lg, &mut og, &mut ag);
        close(
            &format!("gemv_norm_silu {n}x{k} rows={rows}"),
            &f32s(&c, &ac, rows * width),
            &f32s(&g, &ag, rows * width),
            2e-3,
        );
    }
}

/// The fused RMSNorm + product ops (the GEMV kernels at 1–2 rows of bf16 weights, the unfused
/// ops elsewhere) and RoPE + K/V write, against the CPU's unfused defaults.
#[test]
fn fused_operations_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    // (features, in): small, and large enough for several features per warp and several
    // batches of loads per row.
    for (n, k) in [(72, 264), (2200, 2056)] {
        for dtype in [DType::F32, DType::BF16] {
            let w = host(&[n, k], noise(41, n * k), dtype);
            let (lc, lg) = linears(&c, &g, &w, n, k);
            let norm = host(&[k], noise(42, k), DType::F32);
            let down = host(&[k, n / 2], noise(44, k * n / 2), dtype);
            let (nc, ng) = both(&c, &g, &norm);
            for rows in [1, 2, 5] {
                // The GEMV path keeps activations in f32; above it cuBLAS rounds them to bf16.
                let tol = match dtype {
                    DType::F32 => 1e-4,
                    _ if rows <= 2 => 2e-3,
                    _ => 2e-2,
                };
                let x = host(&[rows, k], noise(43 + rows as u64, rows * k), DType::F32);
                let (xc, xg) = both(&c, &g, &x);
                let (mut hc, mut hg) = (
                    c.zeros(DType::F32, &[rows, k]),
                    g.zeros(DType::F32, &[rows, k]),
                );
                let (mut oc, mut og) = (
                    c.zeros(DType::F32, &[rows, n]),
                    g.zeros(DType::F32, &[rows, n]),
                );
                c.rms_norm_linear(&xc, &nc, rows, 1e-5, &mut hc, &lc, &mut oc);
                g.rms_norm_linear(&xg, &ng, rows, 1e-5, &mut hg, &lg, &mut og);
                close(
                    &format!("rms_norm_linear {dtype} {n}x{k} rows={rows}"),
                    &f32s(&c, &oc, rows * n),
                    &f32s(&g, &og, rows * n),
                    tol,
                );
                // The same matrix as a fused gate/up of width n / 2.
                let width = n / 2;
                let (mut gc, mut gg) = (
                    c.zeros(DType::F32, &[rows, n]),
                    g.zeros(DType::F32, &[rows, n]),
                );
                let (mut ac, mut ag) = (
                    c.zeros(DType::F32, &[rows, width]),
                    g.zeros(DType::F32, &[rows, width]),
                );
                c.rms_norm_gate_up(&xc, &nc, rows, 1e-5, &mut hc, &lc, &mut gc, &mut ac);
                g.rms_norm_gate_up(&xg, &ng, rows, 1e-5, &mut hg, &lg, &mut gg, &mut ag);
                close(
                    &format!("rms_norm_gate_up {dtype} {n}x{k} rows={rows}"),
                    &f32s(&c, &ac, rows * width),
                    &f32s(&g, &ag, rows * width),
                    tol,
                );
                // The whole MLP on the residual stream (above the GEMV rows over bf16
                // weights the CUDA backend keeps its intermediates in bf16).
                let (dc, dg) = linears(&c, &g, &down, k, width);
                for accumulate in [true, false] {
                    let (mut rc, mut rg) = both(&c, &g, &x);
                    c.mlp(
                        &mut rc, &nc, rows, 1e-5, &mut hc, &lc, &mut gc, &mut ac, &dc, accumulate,
                    );
                    g.mlp(
                        &mut rg, &ng, rows, 1e-5, &mut hg, &lg, &mut gg, &mut ag, &dg, accumulate,
                    );
                    close(
                        &format!("mlp {dtype} {n}x{k} rows={rows} accumulate={accumulate}"),
                        &f32s(&c, &rc, rows * k),
                        &f32s(&g, &rg, rows * k),
                        // Two bf16 products in a row (the CPU rounds the activation to bf16
                        // for the second, the GEMV keeps it f32).
                        if dtype == DType::F32 { 1e-4 } else { 2e-2 },
                    );
                }
            }
        }
    }
}

/// RoPE, the K/V write and attention in one op: a mixed step (RoPE + K/V kernel, then the
/// attention kernel) and decode steps (folded into attention, split contexts included).
#[test]
fn rope_kv_and_attention_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let block = 16;
    let mut one = ForwardBatch::default();
    let table: Vec<BlockId> = (0..6).map(BlockId).collect();
    one.push(&[4], 70, &table, block, true);
    for batch in [mixed_batch(block), long_decodes(block), one] {
        rope_attention_case(&g, &batch, block);
    }
}

fn rope_attention_case(g: &CudaBackend, batch: &ForwardBatch, block: usize) {
    let c = CpuBackend::new();
    let rows = batch.num_tokens();
    let limits = StepLimits {
        max_tokens: rows,
        max_seqs: batch.seqs.len(),
        max_blocks_per_seq: batch
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1),
    };
    let num_blocks = 40;
    for dtype in [DType::F32, DType::BF16] {
        for (nh, nkv, hd) in [(9, 3, 64), (32, 8, 64), (8, 2, 128)] {
            let layout = QkvLayout {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
            };
            let kv = KvLayout {
                num_layers: 1,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: block,
                num_blocks,
                dtype,
            };
            let (mut cc, mut cg) = (KvCache::new(&c, kv), KvCache::new(g, kv));
            let slots = kv.num_slots();
            let prior = host(
                &[1, 2, slots, kv.kv_dim()],
                noise(61, 2 * slots * kv.kv_dim()),
                dtype,
            );
            let all: Vec<BlockId> = (0..num_blocks as u32).map(BlockId).collect();
            c.write_kv_host(&mut cc, &all, slots, &prior).expect("fits");
            g.write_kv_host(&mut cg, &all, slots, &prior).expect("fits");
            let (mut mc, mut mg) = (StepMeta::new(&c, limits), StepMeta::new(g, limits));
            mc.upload(&c, batch).expect("fits");
            mg.upload(g, batch).expect("fits");
            let w = layout.row_width();
            let qkv = host(&[rows, w], noise(62, rows * w), DType::F32);
            let (mut qc, mut qg) = both(&c, g, &qkv);
            let out = nh * hd;
            let (mut oc, mut og) = (
                c.zeros(DType::F32, &[rows, out]),
                g.zeros(DType::F32, &[rows, out]),
            );
            c.rope_write_kv_attention(&mut qc, layout, 500_000.0, &mut cc, 0, &mc, &mut oc);
            g.rope_write_kv_attention(&mut qg, layout, 500_000.0, &mut cg, 0, &mg, &mut og);
            // RoPE's sin/cos differ by an ulp or so; over a bf16 cache that can move a key
            // by one bf16 step.
            let tol = if dtype == DType::BF16 { 1e-2 } else { 2e-4 };
            let what = format!(
                "rope + K/V + attention {dtype} {nh}/{nkv}x{hd} ({} tokens, {} seqs)",
                rows,
                batch.seqs.len()
            );
            close(
                &what,
                &f32s(&c, &oc, rows * out),
                &f32s(g, &og, rows * out),
                tol,
            );
            close(
                &format!("{what}: cache"),
                &c.read_kv(&cc, &all, slots).to_f32_vec(),
                &g.read_kv(&cg, &all, slots).to_f32_vec(),
                tol,
            );
        }
    }
}

/// A step mixing a fresh prefill, a decode and a chunk continuing a cached prompt.
fn mixed_batch(block: usize) -> ForwardBatch {
    let mut b = ForwardBatch::default();
    let table = |first: u32, n: u32| -> Vec<BlockId> { (first..first + n).map(BlockId).collect() };
    b.push(&[1; 37], 0, &table(0, 3), block, true);
    b.push(&[2], 50, &table(3, 4), block, true);
    b.push(&[3; 20], 16, &table(7, 3), block, true);
    b
}

/// Decodes over long contexts (the split-context path): 300, 129 and 65 cached tokens.
fn long_decodes(block: usize) -> ForwardBatch {
    let mut b = ForwardBatch::default();
    let table = |first: u32, n: u32| -> Vec<BlockId> { (first..first + n).map(BlockId).collect() };
    b.push(&[4], 300, &table(0, 19), block, true);
    b.push(&[5], 129, &table(19, 9), block, true);
    b.push(&[6], 65, &table(28, 5), block, true);
    b
}

/// A prompt-shaped step (the tensor-core prefill path over a bf16 cache): a fresh prompt of
/// 150 tokens, a 90-token chunk continuing a prompt with 40 cached, one decode, and a
/// 200-token chunk after 60 cached (query tiles and key tiles that straddle each other).
fn prompts(block: usize) -> ForwardBatch {
    let mut b = ForwardBatch::default();
    let table = |first: u32, n: u32| -> Vec<BlockId> { (first..first + n).map(BlockId).collect() };
    b.push(&[7; 150], 0, &table(0, 10), block, true);
    b.push(&[8; 90], 40, &table(10, 9), block, true);
    b.push(&[9], 50, &table(19, 4), block, true);
    b.push(&[5; 200], 60, &table(23, 17), block, true);
    b
}

#[test]
fn paged_attention_and_kv_writes_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let block = 16;
    attention_case(&g, &mixed_batch(block), block, 1e-4);
    attention_case(&g, &long_decodes(block), block, 1e-4);
    // Tensor cores take bf16 queries and probabilities: bf16 rounding of those.
    attention_case(&g, &prompts(block), block, 2e-2);
    // Block size 16 takes kernels built for it; any other the run-time block size.
    attention_case(&g, &prompts(32), 32, 2e-2);
}

/// Attention on both backends; `bf16_tol` bounds the difference over a bf16 cache.
fn attention_case(g: &CudaBackend, batch: &ForwardBatch, block: usize, bf16_tol: f32) {
    let c = CpuBackend::new();
    let rows = batch.num_tokens();
    let limits = StepLimits {
        max_tokens: rows,
        max_seqs: batch.seqs.len(),
        max_blocks_per_seq: batch
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1),
    };
    let num_blocks = 40;
    for dtype in [DType::F32, DType::BF16] {
        for (nh, nkv, hd) in [(9, 3, 64), (32, 8, 64), (8, 2, 128)] {
            let layout = QkvLayout {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
            };
            let kv = KvLayout {
                num_layers: 1,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: block,
                num_blocks,
                dtype,
            };
            let (mut cc, mut cg) = (KvCache::new(&c, kv), KvCache::new(g, kv));
            // Earlier tokens of the cached sequences: random K/V already in the cache.
            let slots = kv.num_slots();
            let prior = host(
                &[1, 2, slots, kv.kv_dim()],
                noise(11, 2 * slots * kv.kv_dim()),
                dtype,
            );
            let all: Vec<BlockId> = (0..num_blocks as u32).map(BlockId).collect();
            c.write_kv_host(&mut cc, &all, slots, &prior).expect("fits");
            g.write_kv_host(&mut cg, &all, slots, &prior).expect("fits");
            let (mut mc, mut mg) = (StepMeta::new(&c, limits), StepMeta::new(g, limits));
            mc.upload(&c, batch).expect("fits");
            mg.upload(g, batch).expect("fits");
            let w = layout.row_width();
            let qkv = host(&[rows, w], noise(12, rows * w), DType::F32);
            let (qc, qg) = both(&c, g, &qkv);
            c.write_kv(&qc, rows, layout, &mut cc, 0, &mc.slot_mapping);
            g.write_kv(&qg, rows, layout, &mut cg, 0, &mg.slot_mapping);
            let out = nh * hd;
            let (mut oc, mut og) = (
                c.zeros(DType::F32, &[rows, out]),
                g.zeros(DType::F32, &[rows, out]),
            );
            c.paged_attention(&qc, layout, &cc, 0, &mc, &mut oc);
            g.paged_attention(&qg, layout, &cg, 0, &mg, &mut og);
            close(
                &format!(
                    "attention {dtype} {nh}/{nkv}x{hd} ({} seqs)",
                    batch.seqs.len()
                ),
                &f32s(&c, &oc, rows * out),
                &f32s(g, &og, rows * out),
                if dtype == DType::BF16 { bf16_tol } else { 1e-4 },
            );
            // The transfer layout reads back the same bytes on both.
            let read_c = c.read_kv(&cc, &all, slots);
            let read_g = g.read_kv(&cg, &all, slots);
            assert_eq!(read_c.dtype(), read_g.dtype());
            assert_eq!(
                read_c.to_le_bytes(),
                read_g.to_le_bytes(),
                "read_kv {dtype}: the caches differ after write_kv"
            );
        }
    }
}

#[test]
fn sampling_on_the_device_is_greedy_exact_seeded_and_restricted() {
    let Some(g) = gpu() else { return };
    let vocab = 50_000;
    let rows = 4;
    let mut logits = noise(21, rows * vocab);
    // Row 1 has a tie for the maximum: the first index wins.
    logits[vocab + 777] = 5.0;
    logits[vocab + 9_000] = 5.0;
    let t = g.upload(&host(&[rows, vocab], logits.clone(), DType::F32));
    let greedy = SamplingParams::greedy(1);
    let mut out = Vec::new();
    let all: Vec<(&SamplingParams, u32)> = (0..rows).map(|_| (&greedy, 0)).collect();
    g.sample(&t, vocab, &all, &mut out);
    let expect: Vec<u32> = logits
        .chunks_exact(vocab)
        .map(tandem_engine::sampling::argmax)
        .collect();
    assert_eq!(out, expect, "greedy is the first argmax of each row");
    assert_eq!(out[1], 777);

    let hot = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 5,
        ..SamplingParams::greedy(1)
    };
    let draws = |p: &SamplingParams| -> Vec<u32> {
        let mut out = Vec::new();
        let mut picks = Vec::new();
        for step in 0..8 {
            let rows: Vec<(&SamplingParams, u32)> = (0..rows).map(|_| (p, step)).collect();
            g.sample(&t, vocab, &rows, &mut out);
            picks.extend_from_slice(&out);
        }
        picks
    };
    let a = draws(&hot);
    assert_eq!(a, draws(&hot), "same seed and steps, same tokens");
    assert_ne!(
        a,
        draws(&SamplingParams {
            seed: 6,
            ..hot.clone()
        }),
        "another seed changes some token"
    );
    // Top-k = 3: only the three largest logits of each row can come out.
    let k3 = SamplingParams {
        top_k: 3,
        ..hot.clone()
    };
    for (i, tok) in draws(&k3).into_iter().enumerate() {
        let row = &logits[(i % rows) * vocab..(i % rows + 1) * vocab];
        let mut sorted: Vec<f32> = row.to_vec();
        sorted.sort_by(|x, y| y.total_cmp(x));
        assert!(
            row[tok as usize] >= sorted[2],
            "top_k=3 sampled a logit below the third largest"
        );
    }
    // A tiny top-p keeps only the maximum.
    let p0 = SamplingParams {
        top_p: 1e-6,
        ..hot.clone()
    };
    let picks = draws(&p0);
    for (i, tok) in picks.into_iter().enumerate() {
        // Row 1's two equal maxima both survive a top-p cut (the device keeps ties at the
        // threshold; the host's sort keeps the first): either is right there.
        if i % rows != 1 {
            assert_eq!(tok, expect[i % rows], "top_p≈0 is greedy");
        } else {
            assert!(
                tok == 777 || tok == 9_000,
                "top_p≈0 picked {tok} in the tie row"
            );
        }
    }
}

#[test]
fn weights_overwritten_in_place_keep_their_address() {
    let Some(g) = gpu() else { return };
    let a = host(&[4, 8], noise(1, 32), DType::BF16);
    let b = host(&[4, 8], noise(2, 32), DType::BF16);
    let mut t = g.upload_weight(&a);
    let before = t.storage().ptr();
    g.overwrite(&mut t, &b).expect("same shape and dtype");
    assert_eq!(t.storage().ptr(), before);
    assert_eq!(g.download(&t).to_le_bytes(), b.to_le_bytes());
    let wrong = host(&[4, 8], noise(3, 32), DType::F32);
    assert!(
        g.overwrite(&mut t, &wrong).is_err(),
        "a dtype change is refused"
    );
}

#[test]
fn attention_shapes_without_a_kernel_are_refused_up_front() {
    let Some(g) = gpu() else { return };
    let ok = QkvLayout {
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
    };
    assert!(g.check_attention(ok, DType::BF16).is_ok());
    for bad in [
        QkvLayout { head_dim: 32, ..ok },
        QkvLayout {
            num_heads: 72,
            ..ok
        },
        QkvLayout {
            num_heads: 30,
            ..ok
        },
    ] {
        let e = g.check_attention(bad, DType::BF16).expect_err("no kernel");
        assert!(e.to_string().contains("no attention kernel"), "{e}");
    }
}
