//! Picking the next token from logits. Randomness is a pure function of `(seed, step)`, so a
//! request gives the same tokens whether its first token came from a prefill worker and the
//! rest from a decode worker, or all from one process.

use rand::{Rng, SeedableRng};
use tandem_core::SamplingParams;

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
