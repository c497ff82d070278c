//! The CPU bodies of [`HybridOps`]: host slices of the CPU tensors, the formulas of
//! shared/specs/kda.md (the delta rule's two forms are in `backend::cpu::delta_rule`, the
//! short convolution in `kda_hybrid::kda`), rows split over rayon's pool where they are
//! independent.

use super::delta_rule::{self, DeltaRuleInputs};
use super::math::{axpy, dot, l2norm_rows, rms_norm_rows, short_conv, sigmoid, silu, softplus};
use super::routing::route;
use super::{f32s, f32s_mut, u32s_mut, CpuBackend};
use crate::backend::hybrid::{
    At, DeltaForm, DeltaInputs, ExpertRows, HcParams, HybridOps, KdaGate, MlaDims, MoeConfig, Seqs,
};
use crate::backend::latents::MlaState;
use crate::tensor::Tensor;
use rayon::prelude::*;

type T = Tensor<CpuBackend>;

impl HybridOps for CpuBackend {
    /// The recurrent form: its rank-1 updates vectorise, while the chunked form's
    /// within-chunk matrices are small scalar loops here (3.3× slower at 2,048 tokens of
    /// 16 heads × 64 in `tandem bench kda`).
    fn prompt_form(&self) -> DeltaForm {
        DeltaForm::Recurrent
    }

    fn copy_block(&self, src: &T, from: At, dst: &mut T, to: At, rows: usize, width: usize) {
        let src = f32s(src);
        let dst = f32s_mut(dst);
        for r in 0..rows {
            let s = (from.row + r) * from.stride + from.col;
            let d = (to.row + r) * to.stride + to.col;
            dst[d..d + width].copy_from_slice(&src[s..s + width]);
        }
    }

    fn add_assign(&self, y: &mut T, x: &T, n: usize) {
        let x = &f32s(x)[..n];
        f32s_mut(y)[..n]
            .iter_mut()
            .zip(x)
            .for_each(|(y, &x)| *y += x);
    }

    fn rms_norm_in_place(&self, x: &mut T, rows: usize, dim: usize, weight: Option<&T>, eps: f32) {
        rms_norm_rows(&mut f32s_mut(x)[..rows * dim], dim, weight.map(f32s), eps);
    }

    fn layer_norm_in_place(&self, x: &mut T, rows: usize, weight: &T, bias: &T, eps: f32) {
        let (weight, bias) = (f32s(weight), f32s(bias));
        let dim = weight.len();
        for row in f32s_mut(x)[..rows * dim].chunks_exact_mut(dim) {
            let mean = row.iter().sum::<f32>() / dim as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
            let rs = 1.0 / (var + eps).sqrt();
            for ((v, &w), &b) in row.iter_mut().zip(weight).zip(bias) {
                *v = (*v - mean) * rs * w + b;
            }
        }
    }

    fn l2_norm_in_place(&self, x: &mut T, rows: usize, dim: usize, scale: f32) {
        l2norm_rows(&mut f32s_mut(x)[..rows * dim], dim, scale);
    }

    fn sigmoid_in_place(&self, x: &mut T, n: usize) {
        f32s_mut(x)[..n].iter_mut().for_each(|v| *v = sigmoid(*v));
    }

    fn kda_decay(
        &self,
        f: &mut T,
        rows: usize,
        a: &T,
        dt_bias: &T,
        head_dim: usize,
        gate: KdaGate,
    ) {
        let (a, dt_bias) = (f32s(a), f32s(dt_bias));
        let p = dt_bias.len();
        for row in f32s_mut(f)[..rows * p].chunks_exact_mut(p) {
            for (c, x) in row.iter_mut().enumerate() {
                let a = a[c / head_dim];
                let f = *x + dt_bias[c];
                *x = match gate {
                    KdaGate::Softplus => -a * softplus(f),
                    KdaGate::LowerBound(lb) => lb * sigmoid(a * f),
                };
            }
        }
    }

    fn short_conv(
        &self,
        pre: &T,
        seqs: &Seqs,
        windows: &mut [&mut T],
        weight: &T,
        p: usize,
        w: usize,
        out: &mut T,
    ) {
        let (pre, weight) = (f32s(pre), f32s(weight));
        let out = f32s_mut(out);
        for (rows, window) in seqs.iter().zip(windows.iter_mut()) {
            if rows.is_empty() {
                continue;
            }
            let span = rows.start * p..rows.end * p;
            let y = short_conv(&pre[span.clone()], f32s_mut(window), weight, p, w);
            out[span].copy_from_slice(&y);
        }
    }

    fn delta_rule(
        &self,
        inputs: DeltaInputs<'_, Self>,
        seqs: &Seqs,
        forms: &[DeltaForm],
        states: &mut [&mut T],
        out: &mut T,
    ) {
        let (h, d) = (inputs.heads, inputs.head_dim);
        let (q, k, v, g, beta) = (
            f32s(inputs.q),
            f32s(inputs.k),
            f32s(inputs.v),
            f32s(inputs.g),
            f32s(inputs.beta),
        );
        let out = f32s_mut(out);
        for ((rows, &form), state) in seqs.iter().zip(forms).zip(states.iter_mut()) {
            if rows.is_empty() {
                continue;
            }
            let (pr, hr) = (
                rows.start * h * d..rows.end * h * d,
                rows.start * h..rows.end * h,
            );
            let inp = DeltaRuleInputs {
                q: &q[pr.clone()],
                k: &k[pr.clone()],
                v: &v[pr.clone()],
                g: &g[pr.clone()],
                beta: &beta[hr],
                heads: h,
                head_dim: d,
            };
            let state = f32s_mut(state);
            let o = match form {
                DeltaForm::Recurrent => delta_rule::recurrent(&inp, state),
                DeltaForm::Chunked => delta_rule::chunked(&inp, state),
            };
            out[pr].copy_from_slice(&o);
        }
    }

    fn gated_rms_norm(
        &self,
        o: &mut T,
        gate: &T,
        weight: &T,
        rows: usize,
        width: usize,
        dim: usize,
        eps: f32,
    ) {
        let o = &mut f32s_mut(o)[..rows * width];
        rms_norm_rows(o, dim, Some(f32s(weight)), eps);
        o.iter_mut()
            .zip(f32s(gate))
            .for_each(|(o, &g)| *o *= sigmoid(g));
    }

    fn swiglu(&self, gate_up: &T, rows: usize, inter: usize, limit: Option<f32>, out: &mut T) {
        let gu = f32s(gate_up);
        let act = &mut f32s_mut(out)[..rows * inter];
        for (a, gu) in act.chunks_exact_mut(inter).zip(gu.chunks_exact(2 * inter)) {
            let (g, u) = gu.split_at(inter);
            for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
                *a = match limit {
                    None => silu(g) * u,
                    Some(l) => silu(g.min(l)) * u.clamp(-l, l),
                };
            }
        }
    }

    fn route_topk(
        &self,
        logits: &T,
        rows: usize,
        bias: &T,
        cfg: &MoeConfig,
        ids: &mut T,
        weights: &mut T,
    ) {
        let (e, k) = (cfg.num_experts, cfg.experts_per_token);
        let bias = f32s(bias);
        let logits = &f32s(logits)[..rows * e];
        let mut chosen = Vec::with_capacity(rows * k);
        for l in logits.chunks_exact(e) {
            let scores: Vec<f32> = l.iter().map(|&x| sigmoid(x)).collect();
            chosen.extend(route(&scores, bias, cfg));
        }
        assert_eq!(chosen.len(), rows * k, "route_topk: k choices per token");
        for (slot, (expert, _)) in u32s_mut(ids).iter_mut().zip(&chosen) {
            *slot = *expert as u32;
        }
        for (slot, (_, w)) in f32s_mut(weights).iter_mut().zip(&chosen) {
            *slot = *w;
        }
    }

    fn scatter_add_rows(&self, y: &mut T, src: &T, expert: &ExpertRows, dim: usize) {
        let (y, src) = (f32s_mut(y), f32s(src));
        for ((&t, &w), row) in expert
            .rows
            .iter()
            .zip(&expert.weights)
            .zip(src.chunks_exact(dim))
        {
            let t = t as usize;
            y[t * dim..(t + 1) * dim]
                .iter_mut()
                .zip(row)
                .for_each(|(y, &o)| *y += w * o);
        }
    }

    fn hc_expand(&self, x: &T, rows: usize, n: usize, hidden: usize, out: &mut T) {
        let x = f32s(x);
        let out = f32s_mut(out);
        for (row, tok) in x[..rows * hidden]
            .chunks_exact(hidden)
            .zip(out.chunks_exact_mut(n * hidden))
        {
            tok.chunks_exact_mut(hidden)
                .for_each(|s| s.copy_from_slice(row));
        }
    }

    fn hc_collapse(
        &self,
        streams: &T,
        logits: &T,
        hc: HcParams<'_, Self>,
        rows: usize,
        hidden: usize,
        x: &mut T,
        post: &mut T,
        comb: &mut T,
    ) {
        let n = hc.streams;
        let width = (2 + n) * n;
        let (streams, logits) = (f32s(streams), f32s(logits));
        let (base, scale) = (f32s(hc.base), f32s(hc.scale));
        let (x, post, comb) = (f32s_mut(x), f32s_mut(post), f32s_mut(comb));
        x[..rows * hidden].fill(0.0);
        for t in 0..rows {
            let l = &logits[t * width..(t + 1) * width];
            let xt = &mut x[t * hidden..(t + 1) * hidden];
            for i in 0..n {
                let pre = sigmoid(l[i] * scale[0] + base[i]) + hc.eps;
                let s = &streams[(t * n + i) * hidden..(t * n + i + 1) * hidden];
                xt.iter_mut().zip(s).for_each(|(x, &s)| *x += pre * s);
                post[t * n + i] = 2.0 * sigmoid(l[n + i] * scale[1] + base[n + i]);
            }
            let c = &mut comb[t * n * n..(t + 1) * n * n];
            for (m, row) in c.chunks_exact_mut(n).enumerate() {
                let at = 2 * n + m * n;
                for (j, v) in row.iter_mut().enumerate() {
                    *v = l[at + j] * scale[2] + base[at + j];
                }
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|v| *v = (*v - max).exp());
                let sum: f32 = row.iter().sum();
                row.iter_mut().for_each(|v| *v = *v / sum + hc.eps);
            }
            sinkhorn(c, n, hc.sinkhorn_iters, hc.eps);
        }
    }

    fn hc_merge(
        &self,
        streams: &mut T,
        y: &T,
        post: &T,
        comb: &T,
        rows: usize,
        n: usize,
        hidden: usize,
    ) {
        let (y, post, comb) = (f32s(y), f32s(post), f32s(comb));
        let mut old = vec![0.0f32; n * hidden];
        for (t, (tok, y)) in f32s_mut(streams)[..rows * n * hidden]
            .chunks_exact_mut(n * hidden)
            .zip(y.chunks_exact(hidden))
            .enumerate()
        {
            old.copy_from_slice(tok);
            let comb = &comb[t * n * n..(t + 1) * n * n];
            for (j, new) in tok.chunks_exact_mut(hidden).enumerate() {
                let post = post[t * n + j];
                new.iter_mut().zip(y).for_each(|(v, &y)| *v = post * y);
                for (m, src) in old.chunks_exact(hidden).enumerate() {
                    let w = comb[m * n + j];
                    new.iter_mut().zip(src).for_each(|(v, &s)| *v += w * s);
                }
            }
        }
    }

    fn hc_mean(&self, streams: &T, rows: usize, n: usize, hidden: usize, out: &mut T) {
        let streams = f32s(streams);
        for (tok, o) in streams[..rows * n * hidden]
            .chunks_exact(n * hidden)
            .zip(f32s_mut(out).chunks_exact_mut(hidden))
        {
            for (i, o) in o.iter_mut().enumerate() {
                *o = (0..n).map(|m| tok[m * hidden + i]).sum::<f32>() / n as f32;
            }
        }
    }

    fn mla_append(
        &self,
        ckv: &T,
        seqs: &Seqs,
        states: &mut [&mut MlaState],
        norm: &T,
        dims: MlaDims,
        eps: f32,
        indexer: Option<(&T, &T, usize, usize)>,
    ) {
        let (r, dr) = (dims.rank, dims.rope);
        let (ckv, norm) = (f32s(ckv), f32s(norm));
        let mut latent = vec![0.0f32; r];
        for (rows, state) in seqs.iter().zip(states.iter_mut()) {
            for row in ckv[rows.start * (r + dr)..rows.end * (r + dr)].chunks_exact(r + dr) {
                latent.copy_from_slice(&row[..r]);
                rms_norm_rows(&mut latent, r, Some(norm), eps);
                state.kv_latent.push_row(&latent);
                state.k_rope.push_row(&row[r..]);
            }
            if let (Some((keys, gate, kw, gw)), Some(cache)) = (indexer, state.indexer.as_mut()) {
                let (keys, gate) = (f32s(keys), f32s(gate));
                for row in keys[rows.start * kw..rows.end * kw].chunks_exact(kw) {
                    cache.keys.push_row(row);
                }
                for row in gate[rows.start * gw..rows.end * gw].chunks_exact(gw) {
                    cache.pool_gate.push_row(row);
                }
            }
        }
    }

    fn mla_attention(
        &self,
        q: &T,
        seqs: &Seqs,
        states: &[&MlaState],
        kv_b: &T,
        dims: MlaDims,
        out: &mut T,
    ) {
        let MlaDims {
            heads: h,
            nope: dn,
            rope: dr,
            v_head: dv,
            ..
        } = dims;
        let rows = seqs.last().map_or(0, |s| s.end);
        // For every new row: its sequence and how many cached tokens it sees.
        let mut view = Vec::with_capacity(rows);
        for (i, (s, state)) in seqs.iter().zip(states).enumerate() {
            let first = state.tokens(dims.rank) - s.len();
            view.extend((0..s.len()).map(|t| (i, first + t + 1)));
        }
        let (q, kv_b) = (f32s(q), f32s(kv_b));
        f32s_mut(out)[..rows * h * dv]
            .par_chunks_mut(h * dv)
            .zip(q[..rows * h * (dn + dr)].par_chunks(h * (dn + dr)))
            .zip(view.par_iter())
            .for_each(|((out_row, q_row), &(seq, visible))| {
                attend(q_row, states[seq], visible, kv_b, dims, out_row);
            });
    }
}

/// Normalises columns once, then `iters - 1` times rows and columns (`c` is `n × n`).
fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    let columns = |c: &mut [f32]| {
        for j in 0..n {
            let sum: f32 = (0..n).map(|m| c[m * n + j]).sum::<f32>() + eps;
            (0..n).for_each(|m| c[m * n + j] /= sum);
        }
    };
    columns(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(n) {
            let sum: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
        columns(c);
    }
}

/// One new row's attention (`q_row` `[H, dn + dr]`) over the first `visible` tokens of
/// `cache`, through the absorbed `kv_b` (scores and values in latent space); writes
/// `[H, dv]` into `out_row`.
fn attend(
    q_row: &[f32],
    cache: &MlaState,
    visible: usize,
    kv_b: &[f32],
    dims: MlaDims,
    out_row: &mut [f32],
) {
    let MlaDims {
        heads: h,
        rank: r,
        nope: dn,
        rope: dr,
        v_head: dv,
    } = dims;
    let scale = 1.0 / ((dn + dr) as f32).sqrt();
    let (latent, rope) = (&cache.kv_latent, &cache.k_rope);
    let mut q_lat = vec![0.0f32; r];
    let mut scores = vec![0.0f32; visible];
    let mut o_lat = vec![0.0f32; r];
    for head in 0..h {
        let qh = &q_row[head * (dn + dr)..(head + 1) * (dn + dr)];
        let (q_nope, q_rope) = qh.split_at(dn);
        let w_head = &kv_b[head * (dn + dv) * r..(head + 1) * (dn + dv) * r];
        let (w_k, w_v) = w_head.split_at(dn * r);
        q_lat.fill(0.0);
        for (j, &qj) in q_nope.iter().enumerate() {
            axpy(&mut q_lat, qj, &w_k[j * r..(j + 1) * r]);
        }
        let mut max = f32::NEG_INFINITY;
        for (l, s) in scores.iter_mut().enumerate() {
            let mut v = dot(&q_lat, latent.row(l));
            if dr > 0 {
                v += dot(q_rope, rope.row(l));
            }
            *s = v * scale;
            max = max.max(*s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        o_lat.fill(0.0);
        for (l, &p) in scores.iter().enumerate() {
            axpy(&mut o_lat, p / sum, latent.row(l));
        }
        for (vi, o) in out_row[head * dv..(head + 1) * dv].iter_mut().enumerate() {
            *o = dot(&w_v[vi * r..(vi + 1) * r], &o_lat);
        }
    }
}
