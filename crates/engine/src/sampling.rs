//! Picking the next token from logits. Randomness is a pure function of `(seed, step)`, so a
//! request gives the same tokens whether its first token came from a prefill worker and the
//! rest from a decode worker, or all from one process.

use rand::{Rng, SeedableRng};
use tandem_core::{SamplingParams, TokenLogprobs};

/// Index of the largest logit (the first one on ties, as `argmax` does).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn step_seed(seed: u64, step: u32) -> u64 {
    // splitmix64 of the pair: neighbouring steps get unrelated streams.
    let mut z = seed ^ (u64::from(step).wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform draw in `[0, 1)` that picks generated token number `step` among the
/// candidates (device samplers take it from here, so every backend draws the same number).
pub fn uniform_draw(seed: u64, step: u32) -> f32 {
    rand::rngs::StdRng::seed_from_u64(step_seed(seed, step)).random::<f32>()
}

/// One logits row's request, as sampling sees it: its parameters, which generated token the
/// row picks (`step`, 0-based) and the tokens so far.
#[derive(Clone, Copy, Debug)]
pub struct SampleRow<'a> {
    /// The request's sampling parameters.
    pub params: &'a SamplingParams,
    /// Generated token number this row picks.
    pub step: u32,
    /// The prompt.
    pub prompt: &'a [u32],
    /// Tokens generated so far.
    pub output: &'a [u32],
    /// Tokens that end generation (EOS unless ignored, and `stop_token_ids`).
    pub stop_ids: &'a [u32],
    /// Structured outputs: the tokens the request's grammar allows next
    /// ([`crate::constraint::Constrained::mask`]); every other logit becomes −∞.
    pub allowed: Option<&'a [u32]>,
}

/// Which logit adjustments to apply (see [`adjust_row`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adjustment {
    /// Logit bias, the stop mask below `min_tokens`, repetition / frequency / presence
    /// penalties and the grammar's mask: what log-probabilities are reported over.
    Penalties,
    /// The min-p cut (relative to the most likely token at the row's temperature).
    MinP,
}

/// Applies `which` adjustments of `r`'s request to its logits row, in vLLM's order: bias,
/// then the min-tokens stop mask, then penalties, then the grammar's mask; the min-p cut
/// separately, last.
pub fn adjust_row(logits: &mut [f32], r: &SampleRow<'_>, which: Adjustment) {
    let p = r.params;
    match which {
        Adjustment::Penalties => {
            for &(t, b) in &p.logit_bias {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l += b;
                }
            }
            if (r.output.len() as u32) < p.min_tokens {
                for &t in r.stop_ids {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            if p.repetition_penalty != 1.0 {
                let mut seen: Vec<u32> = r.prompt.iter().chain(r.output).copied().collect();
                seen.sort_unstable();
                seen.dedup();
                for t in seen {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
            if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
                let mut out = r.output.to_vec();
                out.sort_unstable();
                for run in out.chunk_by(|a, b| a == b) {
                    if let Some(l) = logits.get_mut(run[0] as usize) {
                        *l -= p.frequency_penalty * run.len() as f32 + p.presence_penalty;
                    }
                }
            }
            if let Some(mask) = r.allowed {
                for (t, l) in logits.iter_mut().enumerate() {
                    if !crate::constraint::allows(mask, t) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Adjustment::MinP => {
            if p.cuts_min_p() {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let cut = max + p.temperature * p.min_p.ln();
                logits
                    .iter_mut()
                    .filter(|l| **l < cut)
                    .for_each(|l| *l = f32::NEG_INFINITY);
            }
        }
    }
}

/// Whether any row needs `which`.
pub fn any_adjusts(rows: &[SampleRow<'_>], which: Adjustment) -> bool {
    rows.iter().any(|r| match which {
        Adjustment::Penalties => r.params.penalizes() || r.allowed.is_some(),
        Adjustment::MinP => r.params.cuts_min_p(),
    })
}

/// The log-probability of `chosen` in `row` (log-softmax, no temperature) and the `top`
/// most likely tokens, most likely first (ties by id).
pub fn logprobs_of(row: &[f32], chosen: u32, top: u32) -> TokenLogprobs {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |l: f32| l - lse;
    let k = (top as usize).min(row.len());
    let mut best: Vec<u32> = (0..row.len() as u32).collect();
    let order = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k > 0 && k < best.len() {
        best.select_nth_unstable_by(k - 1, order);
    }
    best.truncate(k);
    best.sort_unstable_by(order);
    TokenLogprobs {
        logprob: row
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|t| (t, lp(row[t as usize]))).collect(),
    }
}

/// Samples generated token number `step` (0-based) of a request.
pub fn sample(logits: &[f32], params: &SamplingParams, step: u32) -> u32 {
    if params.temperature <= 0.0 || params.top_k == 1 {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l / params.temperature))
        .collect();
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 {
        cand.truncate(params.top_k as usize);
    }
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let mass: f32 = probs.iter().sum();
    let mut r = uniform_draw(params.seed, step) * mass;
    for (i, p) in probs.iter().enumerate() {
        if r < *p {
            return cand[i].0;
        }
        r -= p;
    }
    cand[probs.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingParams::default()
        }
    }

    fn row<'a>(p: &'a SamplingParams, prompt: &'a [u32], output: &'a [u32]) -> SampleRow<'a> {
        SampleRow {
            params: p,
            step: output.len() as u32,
            prompt,
            output,
            stop_ids: &[0],
            allowed: None,
        }
    }

    #[test]
    fn penalties_bias_and_min_tokens_follow_their_definitions() {
        let base = [2.0f32, -1.0, 4.0, 0.5];
        let apply = |p: &SamplingParams, prompt: &[u32], output: &[u32]| {
            let mut l = base;
            adjust_row(&mut l, &row(p, prompt, output), Adjustment::Penalties);
            l
        };
        let rep = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        // Token 1 (prompt, negative) doubles, token 2 (output, positive) halves.
        assert_eq!(apply(&rep, &[1], &[2, 2]), [2.0, -2.0, 2.0, 0.5]);
        let freq = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 1.0,
            ..SamplingParams::default()
        };
        // Only output tokens count: token 2 twice (2 × 0.5 + 1), token 3 once (0.5 + 1).
        assert_eq!(apply(&freq, &[0], &[2, 3, 2]), [2.0, -1.0, 2.0, -1.0]);
        let bias = SamplingParams {
            logit_bias: vec![(1, 100.0), (9, 5.0)],
            ..SamplingParams::default()
        };
        assert_eq!(
            apply(&bias, &[], &[]),
            [2.0, 99.0, 4.0, 0.5],
            "ids past the vocabulary are skipped"
        );
        let min = SamplingParams {
            min_tokens: 2,
            ..SamplingParams::default()
        };
        assert_eq!(
            apply(&min, &[], &[3])[0],
            f32::NEG_INFINITY,
            "stop masked before min_tokens"
        );
        assert_eq!(
            apply(&min, &[], &[3, 3])[0],
            2.0,
            "and allowed from then on"
        );
    }

    #[test]
    fn the_grammar_mask_leaves_only_allowed_tokens() {
        let p = SamplingParams {
            logit_bias: vec![(0, 100.0)],
            ..SamplingParams::default()
        };
        // Tokens 1 and 34 allowed (word 0 bit 1, word 1 bit 2); 35 is past the logits.
        let mask = [0b10u32, 0b100];
        let mut l = vec![1.0f32; 35];
        let mut r = row(&p, &[], &[]);
        r.allowed = Some(&mask);
        assert!(any_adjusts(&[r], Adjustment::Penalties));
        adjust_row(&mut l, &r, Adjustment::Penalties);
        let kept: Vec<usize> = (0..l.len()).filter(|&t| l[t].is_finite()).collect();
        assert_eq!(
            kept,
            vec![1, 34],
            "a bias does not bring back a masked token"
        );
        assert_eq!(sample(&l, &params(1.0, 0, 1.0, 3), 0) % 33, 1);
    }

    #[test]
    fn min_p_cuts_relative_to_the_best_token_at_the_temperature() {
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.1,
            ..SamplingParams::default()
        };
        // e^(l - 4) ≥ 0.1 ⇔ l ≥ 4 - 2.30: keeps 4.0 and 2.0, cuts 0.5 and -1.
        let mut l = [2.0f32, -1.0, 4.0, 0.5];
        adjust_row(&mut l, &row(&p, &[], &[]), Adjustment::MinP);
        assert_eq!(l, [2.0, f32::NEG_INFINITY, 4.0, f32::NEG_INFINITY]);
        for s in 0..100 {
            let t = sample(&l, &params(1.0, 0, 1.0, s), 0);
            assert!(t == 0 || t == 2);
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_best_first() {
        let row = [1.0f32, 3.0, 2.0, 3.0];
        let lp = logprobs_of(&row, 2, 3);
        let lse = (1f32.exp() + 2.0 * 3f32.exp() + 2f32.exp()).ln();
        assert!((lp.logprob - (2.0 - lse)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "most likely first, ties by id");
        let total: f32 = row.iter().map(|&l| (l - lse).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(logprobs_of(&row, 0, 0).top.is_empty());
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(sample(&[0.1, 3.0, 2.0], &params(0.0, 0, 1.0, 7), 0), 1);
    }

    #[test]
    fn same_seed_and_step_give_the_same_token() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = params(1.0, 0, 1.0, 42);
        let a: Vec<u32> = (0..20).map(|s| sample(&logits, &p, s)).collect();
        let b: Vec<u32> = (0..20).map(|s| sample(&logits, &p, s)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..20)
            .map(|s| sample(&logits, &params(1.0, 0, 1.0, 43), s))
            .collect();
        assert_ne!(a, c, "a different seed should change some token");
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        for s in 0..200 {
            let t = sample(&logits, &params(1.0, 2, 1.0, s as u64), 0);
            assert!(t == 0 || t == 1, "top_k=2 sampled {t}");
        }
        // top-p small enough that only the best token survives.
        for s in 0..50 {
            assert_eq!(sample(&logits, &params(1.0, 0, 0.01, s), 3), 0);
        }
    }
}
