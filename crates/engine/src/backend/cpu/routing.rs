//! MoE routing on the host (the CPU body of [`HybridOps::route_topk`]).
//!
//! [`HybridOps::route_topk`]: crate::backend::HybridOps::route_topk

use crate::backend::hybrid::MoeConfig;

/// Indices of the `k` largest of `values` (ties: lower index first), largest first.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// One token's routing: `(expert, weight)` for the chosen experts.
///
/// Choice by `scores + bias` (within the best `topk_groups` groups when grouped, groups ranked
/// by the sum of their two best choice scores); weights are the plain sigmoid scores of the
/// chosen experts, divided by their sum (+1e-20) when renormalising, times the scaling factor.
pub(crate) fn route(scores: &[f32], bias: &[f32], cfg: &MoeConfig) -> Vec<(usize, f32)> {
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if cfg.num_groups > 1 && cfg.topk_groups < cfg.num_groups {
        let per = choice.len() / cfg.num_groups;
        let group_scores: Vec<f32> = choice
            .chunks_exact(per)
            .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let keep = top_k(&group_scores, cfg.topk_groups);
        for (gi, g) in choice.chunks_exact_mut(per).enumerate() {
            if !keep.contains(&gi) {
                g.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_k(&choice, cfg.experts_per_token);
    let sum: f32 = chosen.iter().map(|&i| scores[i]).sum();
    let norm = if cfg.renormalize { sum + 1e-20 } else { 1.0 };
    chosen
        .into_iter()
        .map(|i| (i, scores[i] / norm * cfg.routed_scaling_factor))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(groups: usize, topk_groups: usize) -> MoeConfig {
        MoeConfig {
            num_experts: 4,
            experts_per_token: 2,
            num_shared_experts: 1,
            intermediate_size: 8,
            routed_scaling_factor: 2.0,
            renormalize: true,
            num_groups: groups,
            topk_groups,
        }
    }

    #[test]
    fn bias_steers_choice_but_not_weights() {
        let scores = [0.9, 0.8, 0.1, 0.2];
        let bias = [0.0, -1.0, 0.0, 0.0];
        let r = route(&scores, &bias, &cfg(1, 1));
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 3]);
        assert!((r[0].1 - 0.9 / 1.1 * 2.0).abs() < 1e-6);
        assert!((r[1].1 - 0.2 / 1.1 * 2.0).abs() < 1e-6);
    }

    #[test]
    fn group_limit_keeps_the_best_group() {
        let scores = [0.9, 0.1, 0.6, 0.7];
        let r = route(&scores, &[0.0; 4], &cfg(2, 1));
        assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 2]);
    }
}
