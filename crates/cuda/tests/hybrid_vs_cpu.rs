//! Every operation of the KDA-hybrid family ([`HybridOps`]) on CUDA against the CPU backend on
//! the same inputs: steps of several sequences of different lengths (one token, a few, more
//! than one 64-token chunk, an empty one), the state each sequence carries after the call as
//! well as the output, and weights in bf16 where the kernels read them in bf16. Without a
//! usable GPU each test prints why and passes (`make test-gpu` runs these on one).

mod common;
use common::gpu;

use common::hybrid::*;

use tandem_engine::backend::hybrid::{
    At, ExpertBank, ExpertRows, HcParams, HybridOps, KdaGate, MlaDims, MoeConfig, Routed,
};
use tandem_engine::backend::latents::{IndexerCache, LatentPool, MlaState, PagedRows};
use tandem_engine::backend::{Linear, Ops};
use tandem_engine::{Backend, CpuBackend, DType, HostTensor, Tensor};

#[test]
fn row_operations_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (rows, dim) = (37, 160);
    let n = rows * dim;

    // copy_block: a column block of one activation into another at an offset.
    let (src_c, src_g) = both(&c, &g, &[rows, dim], noise(1, n));
    let (mut dst_c, mut dst_g) = both(&c, &g, &[rows + 2, 64], noise(2, (rows + 2) * 64));
    let (from, to) = (
        At {
            row: 3,
            col: 17,
            stride: dim,
        },
        At {
            row: 1,
            col: 5,
            stride: 64,
        },
    );
    c.copy_block(&src_c, from, &mut dst_c, to, rows - 4, 40);
    g.copy_block(&src_g, from, &mut dst_g, to, rows - 4, 40);
    close_tensors("copy_block", &c, &dst_c, &g, &dst_g, 0.0);

    let (mut y_c, mut y_g) = both(&c, &g, &[n], noise(3, n));
    c.add_assign(&mut y_c, &src_c, n - 7);
    g.add_assign(&mut y_g, &src_g, n - 7);
    close_tensors("add_assign", &c, &y_c, &g, &y_g, 0.0);

    let (mut s_c, mut s_g) = both(&c, &g, &[n], noise(4, n).iter().map(|v| 8.0 * v).collect());
    c.sigmoid_in_place(&mut s_c, n - 3);
    g.sigmoid_in_place(&mut s_g, n - 3);
    close_tensors("sigmoid_in_place", &c, &s_c, &g, &s_g, 1e-6);

    for dtype in [None, Some(DType::F32), Some(DType::BF16)] {
        let (mut x_c, mut x_g) = both(&c, &g, &[rows, dim], noise(5, n));
        let w = dtype.map(|d| weight(&c, &g, &[dim], noise(6, dim), d));
        c.rms_norm_in_place(&mut x_c, rows, dim, w.as_ref().map(|w| &w.0), 1e-6);
        g.rms_norm_in_place(&mut x_g, rows, dim, w.as_ref().map(|w| &w.1), 1e-6);
        close_tensors(
            &format!("rms_norm_in_place (weight {dtype:?})"),
            &c,
            &x_c,
            &g,
            &x_g,
            1e-5,
        );
    }

    let (mut x_c, mut x_g) = both(&c, &g, &[rows, dim], noise(7, n));
    let (w_c, w_g) = both(&c, &g, &[dim], noise(8, dim));
    let (b_c, b_g) = both(&c, &g, &[dim], noise(9, dim));
    c.layer_norm_in_place(&mut x_c, rows - 1, &w_c, &b_c, 1e-6);
    g.layer_norm_in_place(&mut x_g, rows - 1, &w_g, &b_g, 1e-6);
    close_tensors("layer_norm_in_place", &c, &x_c, &g, &x_g, 1e-5);

    let (mut x_c, mut x_g) = both(&c, &g, &[rows * 5, 32], noise(10, n));
    c.l2_norm_in_place(&mut x_c, rows * 5, 32, 0.125);
    g.l2_norm_in_place(&mut x_g, rows * 5, 32, 0.125);
    close_tensors("l2_norm_in_place", &c, &x_c, &g, &x_g, 1e-6);

    // KDA's output norm: heads of 32 over rows of 160, weight f32 or bf16.
    for dtype in [DType::F32, DType::BF16] {
        let (mut o_c, mut o_g) = both(&c, &g, &[rows, dim], noise(11, n));
        let (gate_c, gate_g) = both(&c, &g, &[rows, dim], noise(12, n));
        let (w_c, w_g) = weight(&c, &g, &[32], noise(13, 32), dtype);
        c.gated_rms_norm(&mut o_c, &gate_c, &w_c, rows, dim, 32, 1e-5);
        g.gated_rms_norm(&mut o_g, &gate_g, &w_g, rows, dim, 32, 1e-5);
        close_tensors(
            &format!("gated_rms_norm (weight {dtype})"),
            &c,
            &o_c,
            &g,
            &o_g,
            1e-5,
        );
    }

    let inter = 80;
    let gu: Vec<f32> = noise(14, rows * 2 * inter)
        .iter()
        .map(|v| 12.0 * v)
        .collect();
    let (gu_c, gu_g) = both(&c, &g, &[rows, 2 * inter], gu);
    for limit in [None, Some(7.0)] {
        let (mut a_c, mut a_g) = (
            c.zeros(DType::F32, &[rows, inter]),
            g.zeros(DType::F32, &[rows, inter]),
        );
        c.swiglu(&gu_c, rows, inter, limit, &mut a_c);
        g.swiglu(&gu_g, rows, inter, limit, &mut a_g);
        close_tensors(
            &format!("swiglu (limit {limit:?})"),
            &c,
            &a_c,
            &g,
            &a_g,
            1e-6,
        );
    }
}

#[test]
fn kda_decay_matches_the_cpu_for_both_gates() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (rows, heads, d) = (41, 4, 32);
    let p = heads * d;
    let a: Vec<f32> = noise(1, heads).iter().map(|v| (0.5 * v).exp()).collect();
    let (a_c, a_g) = both(&c, &g, &[heads], a);
    let (dt_c, dt_g) = both(&c, &g, &[p], noise(2, p));
    // Logits up to ±25 reach softplus's linear branch.
    let f: Vec<f32> = noise(3, rows * p).iter().map(|v| 25.0 * v).collect();
    for gate in [KdaGate::Softplus, KdaGate::LowerBound(-5.0)] {
        let (mut f_c, mut f_g) = both(&c, &g, &[rows, p], f.clone());
        c.kda_decay(&mut f_c, rows, &a_c, &dt_c, d, gate);
        g.kda_decay(&mut f_g, rows, &a_g, &dt_g, d, gate);
        close_tensors(&format!("kda_decay {gate:?}"), &c, &f_c, &g, &f_g, 1e-6);
    }
}

#[test]
fn short_conv_matches_the_cpu_over_sequences_of_different_lengths() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (p, w) = (96, 4);
    let seqs = seqs();
    let rows: usize = SEGMENTS.iter().sum();
    let (pre_c, pre_g) = both(&c, &g, &[rows, p], noise(1, rows * p));
    for dtype in [DType::F32, DType::BF16] {
        let (w_c, w_g) = weight(&c, &g, &[p, w], noise(2, p * w), dtype);
        let windows: Vec<(Tensor<C>, Tensor<G>)> = (0..seqs.len())
            .map(|i| both(&c, &g, &[p, w - 1], noise(10 + i as u64, p * (w - 1))))
            .collect();
        let (mut win_c, mut win_g): (Vec<Tensor<C>>, Vec<Tensor<G>>) = windows.into_iter().unzip();
        let (mut out_c, mut out_g) = (
            c.zeros(DType::F32, &[rows, p]),
            g.zeros(DType::F32, &[rows, p]),
        );
        let mut refs_c: Vec<&mut Tensor<C>> = win_c.iter_mut().collect();
        let mut refs_g: Vec<&mut Tensor<G>> = win_g.iter_mut().collect();
        c.short_conv(&pre_c, &seqs, &mut refs_c, &w_c, p, w, &mut out_c);
        g.short_conv(&pre_g, &seqs, &mut refs_g, &w_g, p, w, &mut out_g);
        close_tensors(
            &format!("short_conv output (weight {dtype})"),
            &c,
            &out_c,
            &g,
            &out_g,
            1e-5,
        );
        for (i, (wc, wg)) in win_c.iter().zip(&win_g).enumerate() {
            close_tensors(
                &format!("short_conv window of sequence {i} ({} rows)", SEGMENTS[i]),
                &c,
                wc,
                &g,
                wg,
                0.0,
            );
        }
    }
}

#[test]
fn moe_and_hyper_connection_operations_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (rows, experts, hidden) = (29, 16, 96);

    // Routing: the same experts, best first, and weights.
    let cfg = MoeConfig {
        num_experts: experts,
        experts_per_token: 4,
        num_shared_experts: 1,
        intermediate_size: 32,
        routed_scaling_factor: 2.5,
        renormalize: true,
        num_groups: 4,
        topk_groups: 2,
    };
    let (l_c, l_g) = both(&c, &g, &[rows, experts], noise(1, rows * experts));
    // A small bias, so that the scores, not the bias, decide most choices.
    let bias: Vec<f32> = noise(2, experts).iter().map(|v| 0.05 * v).collect();
    let (b_c, b_g) = both(&c, &g, &[experts], bias);
    let k = cfg.experts_per_token;
    let (mut ids_c, mut w_c) = (
        c.zeros(DType::U32, &[rows, k]),
        c.zeros(DType::F32, &[rows, k]),
    );
    let (mut ids_g, mut w_g) = (
        g.zeros(DType::U32, &[rows, k]),
        g.zeros(DType::F32, &[rows, k]),
    );
    c.route_topk(&l_c, rows, &b_c, &cfg, &mut ids_c, &mut w_c);
    g.route_topk(&l_g, rows, &b_g, &cfg, &mut ids_g, &mut w_g);
    assert_eq!(
        c.download(&ids_c),
        g.download(&ids_g),
        "route_topk: the same experts, best first"
    );
    close_tensors("route_topk weights", &c, &w_c, &g, &w_g, 1e-6);
    let routed_c =
        ExpertRows::from_routing(&c.download(&ids_c), &c.download(&w_c), rows, k, experts);
    let chosen: usize = routed_c.iter().map(|e| e.rows.len()).sum();
    assert_eq!(chosen, rows * k, "route_topk: k choices per token");
    // Grouping changes the choice: without it, some token picks another expert.
    let ungrouped = MoeConfig {
        num_groups: 1,
        topk_groups: 1,
        ..cfg
    };
    let grouped = g.download(&ids_g);
    g.route_topk(&l_g, rows, &b_g, &ungrouped, &mut ids_g, &mut w_g);
    c.route_topk(&l_c, rows, &b_c, &ungrouped, &mut ids_c, &mut w_c);
    assert_eq!(
        c.download(&ids_c),
        g.download(&ids_g),
        "route_topk without groups"
    );
    assert_ne!(
        grouped,
        g.download(&ids_g),
        "the group limit changes some choice"
    );

    // scatter_add_rows of one expert's outputs.
    let expert = ExpertRows {
        rows: vec![0, 3, 4, 17, 28],
        weights: vec![0.25, -1.5, 0.75, 2.0, 0.125],
    };
    let (src_c, src_g) = both(&c, &g, &[5, hidden], noise(3, 5 * hidden));
    let (mut y_c, mut y_g) = both(&c, &g, &[rows, hidden], noise(4, rows * hidden));
    c.scatter_add_rows(&mut y_c, &src_c, &expert, hidden);
    g.scatter_add_rows(&mut y_g, &src_g, &expert, hidden);
    close_tensors("scatter_add_rows", &c, &y_c, &g, &y_g, 1e-6);
    g.scatter_add_rows(&mut y_g, &src_g, &ExpertRows::default(), hidden);
    close_tensors("scatter_add_rows of no rows", &c, &y_c, &g, &y_g, 1e-6);

    // mHC: expand, collapse, merge, mean.
    let n = 4;
    let (x_c, x_g) = both(&c, &g, &[rows, hidden], noise(5, rows * hidden));
    let (mut st_c, mut st_g) = (
        c.zeros(DType::F32, &[rows, n, hidden]),
        g.zeros(DType::F32, &[rows, n, hidden]),
    );
    c.hc_expand(&x_c, rows, n, hidden, &mut st_c);
    g.hc_expand(&x_g, rows, n, hidden, &mut st_g);
    close_tensors("hc_expand", &c, &st_c, &g, &st_g, 0.0);
    // Streams that differ from each other for the rest.
    let (mut st_c, mut st_g) = both(&c, &g, &[rows, n, hidden], noise(6, rows * n * hidden));

    let width = (2 + n) * n;
    let (lg_c, lg_g) = both(&c, &g, &[rows, width], noise(7, rows * width));
    let (base_c, base_g) = both(&c, &g, &[width], noise(8, width));
    let (scale_c, scale_g) = both(&c, &g, &[3], vec![0.5, 1.5, 2.0]);
    let hc_c = HcParams {
        base: &base_c,
        scale: &scale_c,
        streams: n,
        sinkhorn_iters: 5,
        eps: 1e-6,
    };
    let hc_g = HcParams {
        base: &base_g,
        scale: &scale_g,
        streams: n,
        sinkhorn_iters: 5,
        eps: 1e-6,
    };
    let mut outs_c = [
        c.zeros(DType::F32, &[rows, hidden]),
        c.zeros(DType::F32, &[rows, n]),
        c.zeros(DType::F32, &[rows, n, n]),
    ];
    let mut outs_g = [
        g.zeros(DType::F32, &[rows, hidden]),
        g.zeros(DType::F32, &[rows, n]),
        g.zeros(DType::F32, &[rows, n, n]),
    ];
    {
        let [x, post, comb] = &mut outs_c;
        c.hc_collapse(&st_c, &lg_c, hc_c, rows, hidden, x, post, comb);
        let [x, post, comb] = &mut outs_g;
        g.hc_collapse(&st_g, &lg_g, hc_g, rows, hidden, x, post, comb);
    }
    for (name, (tc, tg)) in ["x", "post", "comb"].iter().zip(outs_c.iter().zip(&outs_g)) {
        close_tensors(&format!("hc_collapse {name}"), &c, tc, &g, tg, 1e-5);
    }

    let (y_c, y_g) = both(&c, &g, &[rows, hidden], noise(9, rows * hidden));
    let [_, post_c, comb_c] = &outs_c;
    let [_, post_g, comb_g] = &outs_g;
    c.hc_merge(&mut st_c, &y_c, post_c, comb_c, rows, n, hidden);
    g.hc_merge(&mut st_g, &y_g, post_g, comb_g, rows, n, hidden);
    close_tensors("hc_merge", &c, &st_c, &g, &st_g, 1e-5);

    let (mut m_c, mut m_g) = (
        c.zeros(DType::F32, &[rows, hidden]),
        g.zeros(DType::F32, &[rows, hidden]),
    );
    c.hc_mean(&st_c, rows, n, hidden, &mut m_c);
    g.hc_mean(&st_g, rows, n, hidden, &mut m_g);
    close_tensors("hc_mean", &c, &m_c, &g, &m_g, 1e-5);
}

/// The experts a rank holds (experts 2..6 of 8), as SwiGLU weights on both devices.
struct Bank {
    cpu: Vec<(Linear<C>, Linear<C>)>,
    gpu: Vec<(Linear<G>, Linear<G>)>,
}

impl Bank {
    const FIRST: usize = 2;

    fn new(c: &C, g: &G, count: usize, hidden: usize, inter: usize) -> Self {
        let linear = |seed: u64, out: usize, inp: usize| {
            let (wc, wg) = weight(c, g, &[out, inp], noise(seed, out * inp), DType::BF16);
            (
                Linear {
                    weight: wc,
                    out_features: out,
                    in_features: inp,
                },
                Linear {
                    weight: wg,
                    out_features: out,
                    in_features: inp,
                },
            )
        };
        let (mut cpu, mut gpu) = (Vec::new(), Vec::new());
        for e in 0..count as u64 {
            let (gu_c, gu_g) = linear(100 + e, 2 * inter, hidden);
            let (d_c, d_g) = linear(200 + e, hidden, inter);
            cpu.push((gu_c, d_c));
            gpu.push((gu_g, d_g));
        }
        Self { cpu, gpu }
    }

    /// `y += Σ weight · expert(x)` on the CPU, expert by expert (the model's path there).
    #[allow(clippy::too_many_arguments)]
    fn cpu_forward(
        &self,
        c: &C,
        x: &Tensor<C>,
        routing: (&Tensor<C>, &Tensor<C>),
        (rows, k, experts): (usize, usize, usize),
        limit: Option<f32>,
        y: &mut Tensor<C>,
    ) {
        let hidden = x.len() / rows;
        let assigned = ExpertRows::from_routing(
            &c.download(routing.0),
            &c.download(routing.1),
            rows,
            k,
            experts,
        );
        for (i, (gate_up, down)) in self.cpu.iter().enumerate() {
            let tokens = &assigned[Self::FIRST + i];
            let n = tokens.rows.len();
            if n == 0 {
                continue;
            }
            let inter = down.in_features;
            let index = c.upload(&HostTensor::from_u32(tokens.rows.clone()));
            let mut gathered = c.zeros(DType::F32, &[n, hidden]);
            c.gather_rows(x, hidden, &index, n, &mut gathered);
            let mut gu = c.zeros(DType::F32, &[n, 2 * inter]);
            c.matmul(
                &gathered,
                n,
                &gate_up.weight,
                2 * inter,
                hidden,
                &mut gu,
                false,
            );
            let mut act = c.zeros(DType::F32, &[n, inter]);
            c.swiglu(&gu, n, inter, limit, &mut act);
            let mut out = c.zeros(DType::F32, &[n, hidden]);
            c.matmul(&act, n, &down.weight, hidden, inter, &mut out, false);
            c.scatter_add_rows(y, &out, tokens, hidden);
        }
    }
}

#[test]
fn grouped_experts_match_the_cpu_expert_by_expert() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (experts, k, hidden, inter, count) = (8, 3, 96, 40, 4);
    let bank = Bank::new(&c, &g, count, hidden, inter);
    let gate_ups: Vec<_> = bank.gpu.iter().map(|(gu, _)| gu).collect();
    let downs: Vec<_> = bank.gpu.iter().map(|(_, d)| d).collect();
    let gu_table = g
        .expert_table(&gate_ups)
        .expect("bf16 experts take the grouped path");
    let down_table = g
        .expert_table(&downs)
        .expect("bf16 experts take the grouped path");
    let f32_expert = Linear {
        weight: g.zeros(DType::F32, &[hidden, inter]),
        out_features: hidden,
        in_features: inter,
    };
    assert!(
        g.expert_table(&[&f32_expert]).is_none(),
        "f32 experts run one by one"
    );
    // One token, a decode batch, and more pairs per expert than one pass of the kernels takes.
    for (rows, limit) in [(1, None), (29, Some(0.8)), (64, None)] {
        let cfg = MoeConfig {
            num_experts: experts,
            experts_per_token: k,
            num_shared_experts: 0,
            intermediate_size: inter,
            routed_scaling_factor: 1.5,
            renormalize: true,
            num_groups: 1,
            topk_groups: 1,
        };
        let (l_c, l_g) = both(&c, &g, &[rows, experts], noise(rows as u64, rows * experts));
        let (b_c, b_g) = both(&c, &g, &[experts], vec![0.0; experts]);
        let (mut ids_c, mut w_c) = (
            c.zeros(DType::U32, &[rows, k]),
            c.zeros(DType::F32, &[rows, k]),
        );
        let (mut ids_g, mut w_g) = (
            g.zeros(DType::U32, &[rows, k]),
            g.zeros(DType::F32, &[rows, k]),
        );
        c.route_topk(&l_c, rows, &b_c, &cfg, &mut ids_c, &mut w_c);
        g.route_topk(&l_g, rows, &b_g, &cfg, &mut ids_g, &mut w_g);
        let (x_c, x_g) = both(
            &c,
            &g,
            &[rows, hidden],
            noise(7 + rows as u64, rows * hidden),
        );
        let (mut y_c, mut y_g) = both(&c, &g, &[rows, hidden], noise(8, rows * hidden));
        bank.cpu_forward(
            &c,
            &x_c,
            (&ids_c, &w_c),
            (rows, k, experts),
            limit,
            &mut y_c,
        );
        let routed = Routed {
            ids: &ids_g,
            weights: &w_g,
            rows,
            k,
        };
        let held = ExpertBank {
            gate_up: &gu_table,
            down: &down_table,
            first: Bank::FIRST,
            count,
            hidden,
            inter,
            limit,
        };
        g.moe_grouped(&x_g, routed, held, &mut y_g);
        close_tensors(
            &format!("moe_grouped, {rows} rows"),
            &c,
            &y_c,
            &g,
            &y_g,
            1e-5,
        );
    }
}

/// An empty MLA cache on `b` (with the indexer's caches when `indexer` gives their widths).
fn mla_state<B: Backend>(b: &B, dims: MlaDims, indexer: Option<(usize, usize)>) -> MlaState<B> {
    let rows = |w: usize| PagedRows::new(w, LatentPool::default(), b.clone());
    MlaState {
        kv_latent: rows(dims.rank),
        k_rope: rows(dims.rope),
        indexer: indexer.map(|(kw, gw)| IndexerCache {
            keys: rows(kw),
            pool_gate: rows(gw),
        }),
    }
}

/// One MLA step on both devices: the rows of `segments` appended to each sequence's cache
/// (with indexer rows when the caches keep them), then attention of those rows; compares the
/// caches and the outputs.
fn mla_step(
    (c, g): (&C, &G),
    (states_c, states_g): (&mut [MlaState<C>], &mut [MlaState<G>]),
    segments: &[usize],
    dims: MlaDims,
    seed: u64,
) {
    let MlaDims {
        heads: h,
        rank: r,
        nope: dn,
        rope: dr,
        v_head: dv,
    } = dims;
    let seqs = seqs_of(segments);
    let rows: usize = segments.iter().sum();
    let (kw, gw) = (8, 4);
    let (ckv_c, ckv_g) = both(c, g, &[rows, r + dr], noise(seed, rows * (r + dr)));
    let (norm_c, norm_g) = both(c, g, &[r], noise(seed + 1, r));
    let (keys_c, keys_g) = both(c, g, &[rows, kw], noise(seed + 2, rows * kw));
    let (gate_c, gate_g) = both(c, g, &[rows, gw], noise(seed + 3, rows * gw));
    let indexed = states_c[0].indexer.is_some();
    {
        let ix_c = indexed.then_some((&keys_c, &gate_c, kw, gw));
        let ix_g = indexed.then_some((&keys_g, &gate_g, kw, gw));
        let mut refs: Vec<&mut MlaState<C>> = states_c.iter_mut().collect();
        c.mla_append(&ckv_c, &seqs, &mut refs, &norm_c, dims, 1e-6, ix_c);
        let mut refs: Vec<&mut MlaState<G>> = states_g.iter_mut().collect();
        g.mla_append(&ckv_g, &seqs, &mut refs, &norm_g, dims, 1e-6, ix_g);
    }
    for (i, (sc, sg)) in states_c.iter().zip(states_g.iter()).enumerate() {
        assert_eq!(sc.tokens(r), sg.tokens(r), "tokens cached in sequence {i}");
        close(
            &format!("mla_append latents of sequence {i}"),
            &sc.kv_latent.to_vec(),
            &sg.kv_latent.to_vec(),
            1e-5,
        );
        assert_eq!(sc.k_rope.to_vec(), sg.k_rope.to_vec(), "rope slots of {i}");
        if let (Some(a), Some(b)) = (&sc.indexer, &sg.indexer) {
            assert_eq!(a.keys.to_vec(), b.keys.to_vec(), "indexer keys of {i}");
            assert_eq!(
                a.pool_gate.to_vec(),
                b.pool_gate.to_vec(),
                "indexer gate of {i}"
            );
        }
        // What a handoff carries: the device cache copied to the host equals the CPU's.
        let host = sg.copy_into(&LatentPool::default(), c);
        assert_eq!(host.k_rope, sc.k_rope, "host copy of sequence {i}");
    }
    let (q_c, q_g) = both(
        c,
        g,
        &[rows, h, dn + dr],
        noise(seed + 4, rows * h * (dn + dr)),
    );
    let kv_b = noise(seed + 5, h * (dn + dv) * r);
    let (kvb_c, kvb_g) = both(c, g, &[h * (dn + dv), r], kv_b);
    let (mut o_c, mut o_g) = (
        c.zeros(DType::F32, &[rows, h * dv]),
        g.zeros(DType::F32, &[rows, h * dv]),
    );
    let refs_c: Vec<&MlaState<C>> = states_c.iter().collect();
    let refs_g: Vec<&MlaState<G>> = states_g.iter().collect();
    c.mla_attention(&q_c, &seqs, &refs_c, &kvb_c, dims, &mut o_c);
    g.mla_attention(&q_g, &seqs, &refs_g, &kvb_g, dims, &mut o_g);
    close_tensors(
        &format!("mla_attention over {segments:?}"),
        c,
        &o_c,
        g,
        &o_g,
        1e-4,
    );
}

#[test]
fn mla_over_device_blocks_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    // Kimi's shape (a rope slot) and GLM's (none, an indexer, three heads: one partial
    // group of the kernel's four).
    let kimi = MlaDims {
        heads: 4,
        rank: 64,
        nope: 32,
        rope: 16,
        v_head: 32,
    };
    let glm = MlaDims {
        heads: 3,
        rank: 512,
        nope: 48,
        rope: 0,
        v_head: 40,
    };
    // Six heads: a whole group of four and a partial one (the kernel takes four a block).
    let six = MlaDims { heads: 6, ..kimi };
    for (dims, indexer) in [(kimi, None), (glm, Some((8, 4))), (six, None)] {
        let mut states_c: Vec<_> = SEGMENTS
            .iter()
            .map(|_| mla_state(&c, dims, indexer))
            .collect();
        let mut states_g: Vec<_> = SEGMENTS
            .iter()
            .map(|_| mla_state(&g, dims, indexer))
            .collect();
        // A prompt step (sequences spanning several blocks, one empty), then two decode steps
        // that write into partly filled blocks.
        mla_step((&c, &g), (&mut states_c, &mut states_g), &SEGMENTS, dims, 1);
        mla_step((&c, &g), (&mut states_c, &mut states_g), &[1; 5], dims, 11);
        mla_step(
            (&c, &g),
            (&mut states_c, &mut states_g),
            &[1, 0, 1, 1, 1],
            dims,
            21,
        );
    }
}

/// Routing over as many experts as Kimi-Linear-48B (256, in 8 groups of which 4 are kept, 8
/// chosen) and over more experts than a routing block has threads (300, ungrouped), with
/// logits of few distinct values so that ties decide choices: the CPU's experts, in its order,
/// and its weights.
#[test]
fn routing_over_hundreds_of_experts_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    for (experts, groups, kept) in [(256, 8, 4), (300, 1, 1), (1024, 16, 3)] {
        let rows = 37;
        let cfg = MoeConfig {
            num_experts: experts,
            experts_per_token: 8,
            num_shared_experts: 1,
            intermediate_size: 32,
            routed_scaling_factor: 2.827,
            renormalize: true,
            num_groups: groups,
            topk_groups: kept,
        };
        // Logits rounded to tenths: many tie with another expert's.
        let logits: Vec<f32> = noise(experts as u64, rows * experts)
            .iter()
            .map(|v| (v * 20.0).round() / 10.0)
            .collect();
        let (l_c, l_g) = both(&c, &g, &[rows, experts], logits);
        let bias: Vec<f32> = noise(3, experts).iter().map(|v| 0.01 * v).collect();
        let (b_c, b_g) = both(&c, &g, &[experts], bias);
        let k = cfg.experts_per_token;
        let (mut ids_c, mut w_c) = (
            c.zeros(DType::U32, &[rows, k]),
            c.zeros(DType::F32, &[rows, k]),
        );
        let (mut ids_g, mut w_g) = (
            g.zeros(DType::U32, &[rows, k]),
            g.zeros(DType::F32, &[rows, k]),
        );
        c.route_topk(&l_c, rows, &b_c, &cfg, &mut ids_c, &mut w_c);
        g.route_topk(&l_g, rows, &b_g, &cfg, &mut ids_g, &mut w_g);
        assert_eq!(
            c.download(&ids_c),
            g.download(&ids_g),
            "{experts} experts in {groups} groups: the same experts, best first"
        );
        close_tensors("route_topk weights", &c, &w_c, &g, &w_g, 1e-6);
    }
}
