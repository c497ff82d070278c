//! The gated delta rule at the heart of KDA, in its two equivalent forms (shared/specs/kda.md):
//! the per-token recurrence, which decode uses (one token is one rank-1 update of a `[K, V]`
//! state), and the chunked form, which prefill uses (per 64-token chunk, a triangular solve and
//! a handful of small matrix products replace 64 sequential state updates).
//!
//! A pure algorithmic core: plain slices in, no I/O, no model weights, so the two forms can be
//! tested against each other and benchmarked alone. Heads are independent and run in parallel.
//!
//! Numerics: all decays are applied as `exp(Γ_r − Γ_c)` with `r` after `c`, i.e. exponents
//! `≤ 0`, so nothing overflows however strong the decay (GLM's gate reaches −5 per token, a
//! chunk sum of −320). The within-chunk cumulative sums are kept in f64 so that the pairwise
//! differences do not lose the small per-token gates against a large running sum.

use super::math::{axpy, dot};
use rayon::prelude::*;

/// Chunk length of the chunked form.
pub const CHUNK: usize = 64;

/// Inputs of the delta rule for `T` tokens of `H` heads of width `D`, token-major.
#[derive(Clone, Copy, Debug)]
pub struct DeltaRuleInputs<'a> {
    /// Queries `[T, H, D]`, already l2-normalised and scaled by `D^-1/2`.
    pub q: &'a [f32],
    /// Keys `[T, H, D]`, already l2-normalised.
    pub k: &'a [f32],
    /// Values `[T, H, D]`.
    pub v: &'a [f32],
    /// Per-channel log-decays `[T, H, D]`, `≤ 0`.
    pub g: &'a [f32],
    /// Write strengths `[T, H]`, in `(0, 1)`.
    pub beta: &'a [f32],
    /// Heads H.
    pub heads: usize,
    /// Head width D.
    pub head_dim: usize,
}

impl DeltaRuleInputs<'_> {
    /// Tokens T.
    pub fn tokens(&self) -> usize {
        self.beta.len() / self.heads.max(1)
    }

    fn check(&self, state: &[f32]) {
        let (t, h, d) = (self.tokens(), self.heads, self.head_dim);
        for (name, x) in [("q", self.q), ("k", self.k), ("v", self.v), ("g", self.g)] {
            assert_eq!(x.len(), t * h * d, "delta rule: {name} is not [T, H, D]");
        }
        assert_eq!(state.len(), h * d * d, "delta rule: state is not [H, D, D]");
    }

    /// Head `h`'s rows of `[T, H, D]` `x`, contiguous `[T, D]`.
    fn head_rows(&self, x: &[f32], h: usize) -> Vec<f32> {
        let d = self.head_dim;
        x.chunks_exact(self.heads * d)
            .flat_map(|row| &row[h * d..(h + 1) * d])
            .copied()
            .collect()
    }
}

/// One head's inputs, contiguous `[T, D]` (`beta` `[T]`).
struct Head {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// Runs `per_head(head inputs, head state, head output [T, D])` for every head in parallel and
/// interleaves the outputs back into `[T, H, D]`.
fn each_head(
    inp: &DeltaRuleInputs<'_>,
    state: &mut [f32],
    per_head: impl Fn(&Head, &mut [f32], &mut [f32]) + Sync,
) -> Vec<f32> {
    inp.check(state);
    let (t, h, d) = (inp.tokens(), inp.heads, inp.head_dim);
    let outs: Vec<Vec<f32>> = state
        .par_chunks_mut(d * d)
        .enumerate()
        .map(|(head, s)| {
            let x = Head {
                q: inp.head_rows(inp.q, head),
                k: inp.head_rows(inp.k, head),
                v: inp.head_rows(inp.v, head),
                g: inp.head_rows(inp.g, head),
                beta: inp.beta.iter().skip(head).step_by(h).copied().collect(),
            };
            let mut o = vec![0.0; t * d];
            per_head(&x, s, &mut o);
            o
        })
        .collect();
    let mut o = vec![0.0; t * h * d];
    for (head, oh) in outs.iter().enumerate() {
        for (row, src) in o.chunks_exact_mut(h * d).zip(oh.chunks_exact(d)) {
            row[head * d..(head + 1) * d].copy_from_slice(src);
        }
    }
    o
}

/// The recurrent form: for each token, `S ← diag(e^g) S`, `u = v − Sᵀk`, `S ← S + β k uᵀ`,
/// `o = Sᵀq`. `state` is `[H, K, V]` and is advanced past all T tokens. Returns `o` `[T, H, D]`.
pub fn recurrent(inp: &DeltaRuleInputs<'_>, state: &mut [f32]) -> Vec<f32> {
    let d = inp.head_dim;
    each_head(inp, state, |x, s, o| {
        let mut u = vec![0.0f32; d];
        for (t, o_t) in o.chunks_exact_mut(d).enumerate() {
            let row = t * d..(t + 1) * d;
            let (q, k, g) = (&x.q[row.clone()], &x.k[row.clone()], &x.g[row.clone()]);
            u.copy_from_slice(&x.v[row]);
            for (kk, s_row) in s.chunks_exact_mut(d).enumerate() {
                let decay = g[kk].exp();
                s_row.iter_mut().for_each(|v| *v *= decay);
                axpy(&mut u, -k[kk], s_row);
            }
            u.iter_mut().for_each(|v| *v *= x.beta[t]);
            for (kk, s_row) in s.chunks_exact_mut(d).enumerate() {
                axpy(s_row, k[kk], &u);
                axpy(o_t, q[kk], s_row);
            }
        }
    })
}

/// The chunked form (chunk [`CHUNK`]); same contract and result as [`recurrent`].
pub fn chunked(inp: &DeltaRuleInputs<'_>, state: &mut [f32]) -> Vec<f32> {
    chunked_with(inp, state, CHUNK)
}

/// [`chunked`] with an explicit chunk length (tests use small ones).
pub fn chunked_with(inp: &DeltaRuleInputs<'_>, state: &mut [f32], chunk: usize) -> Vec<f32> {
    assert!(chunk > 0, "chunk length must be positive");
    let (t, d) = (inp.tokens(), inp.head_dim);
    each_head(inp, state, |x, s, o| {
        let mut start = 0;
        while start < t {
            let n = chunk.min(t - start);
            chunk_step(x, start, n, d, s, &mut o[start * d..(start + n) * d]);
            start += n;
        }
    })
}

/// One chunk of `n` tokens starting at `start`, for one head (shared/specs/kda.md):
///
/// ```text
/// M[r,c]  = β_r Σ_d k_r k_c e^{Γ_r−Γ_c}  (c < r)      Pm[r,c] = Σ_d q_r k_c e^{Γ_r−Γ_c}  (c ≤ r)
/// Wm = (I+M)⁻¹ diag(β) (e^Γ ⊙ K),  U = (I+M)⁻¹ diag(β) V   (forward substitution)
/// V' = U − Wm S,  O = (Q ⊙ e^Γ) S + Pm V',  S ← diag(e^{Γ_n}) S + (K ⊙ e^{Γ_n−Γ})ᵀ V'
/// ```
fn chunk_step(x: &Head, start: usize, n: usize, d: usize, s: &mut [f32], o: &mut [f32]) {
    let rows = |buf: &[f32]| buf[start * d..(start + n) * d].to_vec();
    let (q, k, v, g) = (rows(&x.q), rows(&x.k), rows(&x.v), rows(&x.g));
    let beta = &x.beta[start..start + n];
    // Γ: within-chunk cumulative log-decay per channel, in f64.
    let mut gam = vec![0.0f64; n * d];
    for r in 0..n {
        for c in 0..d {
            let prev = if r == 0 { 0.0 } else { gam[(r - 1) * d + c] };
            gam[r * d + c] = prev + f64::from(g[r * d + c]);
        }
    }
    // M (strictly lower) and Pm (lower with diagonal) share the decayed key k_c e^{Γ_r−Γ_c}.
    let mut m = vec![0.0f32; n * n];
    let mut pm = vec![0.0f32; n * n];
    let mut kd = vec![0.0f32; d];
    for r in 0..n {
        let gr = &gam[r * d..(r + 1) * d];
        for c in 0..=r {
            let gc = &gam[c * d..(c + 1) * d];
            for ((kd, &kc), (&a, &b)) in kd
                .iter_mut()
                .zip(&k[c * d..(c + 1) * d])
                .zip(gr.iter().zip(gc))
            {
                *kd = kc * ((a - b) as f32).exp();
            }
            pm[r * n + c] = dot(&q[r * d..(r + 1) * d], &kd);
            if c < r {
                m[r * n + c] = beta[r] * dot(&k[r * d..(r + 1) * d], &kd);
            }
        }
    }
    // Forward substitution for Wm and U.
    let mut wm = vec![0.0f32; n * d];
    let mut u = vec![0.0f32; n * d];
    for r in 0..n {
        let (done_w, rest_w) = wm.split_at_mut(r * d);
        let (done_u, rest_u) = u.split_at_mut(r * d);
        let (w_r, u_r) = (&mut rest_w[..d], &mut rest_u[..d]);
        for c in 0..d {
            w_r[c] = beta[r] * (gam[r * d + c].exp() as f32) * k[r * d + c];
            u_r[c] = beta[r] * v[r * d + c];
        }
        for c in 0..r {
            let a = m[r * n + c];
            if a != 0.0 {
                axpy(w_r, -a, &done_w[c * d..(c + 1) * d]);
                axpy(u_r, -a, &done_u[c * d..(c + 1) * d]);
            }
        }
    }
    // V' = U − Wm S (rows of S are keys).
    let mut vp = u;
    for r in 0..n {
        let vp_r = &mut vp[r * d..(r + 1) * d];
        for (kk, s_row) in s.chunks_exact(d).enumerate() {
            axpy(vp_r, -wm[r * d + kk], s_row);
        }
    }
    // O = (Q ⊙ e^Γ) S + Pm V'.
    for r in 0..n {
        let o_r = &mut o[r * d..(r + 1) * d];
        o_r.fill(0.0);
        for (kk, s_row) in s.chunks_exact(d).enumerate() {
            axpy(o_r, q[r * d + kk] * (gam[r * d + kk].exp() as f32), s_row);
        }
        for c in 0..=r {
            axpy(o_r, pm[r * n + c], &vp[c * d..(c + 1) * d]);
        }
    }
    // S ← diag(e^{Γ_n}) S + Σ_r (k_r ⊙ e^{Γ_n − Γ_r}) v'_rᵀ.
    let last = &gam[(n - 1) * d..n * d];
    for (kk, s_row) in s.chunks_exact_mut(d).enumerate() {
        let decay = last[kk].exp() as f32;
        s_row.iter_mut().for_each(|v| *v *= decay);
        for r in 0..n {
            let w = k[r * d + kk] * ((last[kk] - gam[r * d + kk]) as f32).exp();
            if w != 0.0 {
                axpy(s_row, w, &vp[r * d..(r + 1) * d]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_testkit::noise;

    #[test]
    fn chunked_equals_recurrent_with_small_chunks_and_a_carried_state() {
        let (t, h, d) = (23, 2, 8);
        let mut q = noise(1, t * h * d);
        let mut k = noise(2, t * h * d);
        super::super::math::l2norm_rows(&mut q, d, 1.0 / (d as f32).sqrt());
        super::super::math::l2norm_rows(&mut k, d, 1.0);
        let v = noise(3, t * h * d);
        let g: Vec<f32> = noise(4, t * h * d).iter().map(|x| -2.0 * x.abs()).collect();
        let beta: Vec<f32> = noise(5, t * h).iter().map(|x| 0.5 + 0.4 * x).collect();
        let inp = DeltaRuleInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
            heads: h,
            head_dim: d,
        };
        let s0 = noise(6, h * d * d);
        let (mut s_rec, mut s_chk) = (s0.clone(), s0);
        let o_rec = recurrent(&inp, &mut s_rec);
        let o_chk = chunked_with(&inp, &mut s_chk, 5);
        let max = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max)
        };
        assert!(max(&o_rec, &o_chk) < 1e-5, "{}", max(&o_rec, &o_chk));
        assert!(max(&s_rec, &s_chk) < 1e-5, "{}", max(&s_rec, &s_chk));
    }
}
