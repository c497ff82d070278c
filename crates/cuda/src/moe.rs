//! MoE on the device, the [`HybridOps`](tandem_engine::backend::HybridOps) bodies hybrid.rs
//! delegates to: routing (`moe_route`: sigmoid scores with the correction bias, grouped top-k,
//! renormalisation and routed scaling), and for steps of up to `TANDEM_CUDA_MOE_GROUPED_ROWS`
//! tokens the experts as one grouped product (sort, gate/up, down, combine: four launches
//! whatever the number of experts); larger steps read the routing back and run expert by
//! expert through cuBLAS, their rows scattered back with `scatter_add_rows`.
//!
//! Experts whose weights stayed block-FP8 (`Backend::upload_fp8_weight`) run the grouped
//! product on their FP8 tiles (`moe_gate_up_fp8`, `moe_down_fp8`: half the bytes of bf16 read
//! per step); larger steps dequantise each expert to bf16 for cuBLAS (`fp8_to_bf16`).

use crate::device::{Arg as A, CudaBackend};
use crate::ops::{flat_cfg, need, ptr, rows_cfg, threads_for, T};
use cudarc::driver::LaunchConfig;
use tandem_engine::backend::hybrid::{ExpertBank, ExpertRows, MoeConfig, Routed};
use tandem_engine::backend::Linear;
use tandem_engine::{Backend, DType, HostTensor};

/// Experts per token the MoE router takes (`MOE_MAX_K` in kernels.cu).
const MOE_MAX_K: usize = 32;
/// Expert groups the MoE router takes (`MOE_MAX_GROUPS` in kernels.cu).
const MOE_MAX_GROUPS: usize = 64;
/// Threads of a token's routing block (`MOE_ROUTE_THREADS` in kernels.cu).
const MOE_ROUTE_THREADS: usize = 256;
/// Experts the MoE router takes (`MOE_ROUTE_MAX` in kernels.cu).
const MOE_ROUTE_MAX: usize = 1024;
/// Experts one rank's grouped product takes (a thread each in `moe_sort`).
const MOE_MAX_EXPERTS: usize = 1024;
/// Warps per block of the grouped expert kernels (their `__launch_bounds__`).
const MOE_WARPS: usize = 4;
/// The block-FP8 tile side the kernels take (`FP8_TILE` in kernels.cu).
pub(crate) const FP8_TILE: usize = 128;

/// The format word that ends an expert table of block-FP8 weights (bf16 tables have none).
const FP8_TABLE: u32 = 8;

impl CudaBackend {
    /// Whether block-FP8 weights are taken as FP8 (the default, unless
    /// `TANDEM_CUDA_FP8_WEIGHTS=0`); off, the loader dequantises them. Set before loading.
    pub fn set_fp8_weights(&self, on: bool) {
        self.inner
            .fp8_weights
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn fp8_weights(&self) -> bool {
        self.inner
            .fp8_weights
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `out` `[rows, cols]` bf16 = the values of block-FP8 weight `w`.
    pub(crate) fn fp8_to_bf16(&self, w: &T, rows: usize, cols: usize, out: u64) {
        self.launch(
            &self.inner.kernels.fp8_to_bf16,
            flat_cfg(rows * cols / 8),
            &[
                A::from(ptr(w)),
                A::from(rows as i64),
                A::from(cols as i32),
                A::from(out),
            ],
        );
    }

    pub(crate) fn run_route_topk(
        &self,
        logits: &T,
        rows: usize,
        bias: &T,
        cfg: &MoeConfig,
        ids: &mut T,
        weights: &mut T,
    ) {
        if rows == 0 {
            return;
        }
        let (e, k) = (cfg.num_experts, cfg.experts_per_token);
        assert!(
            k <= MOE_MAX_K && cfg.num_groups <= MOE_MAX_GROUPS && cfg.num_groups > 0,
            "the CUDA MoE router takes at most {MOE_MAX_K} experts per token and \
             {MOE_MAX_GROUPS} groups, not {k} and {}",
            cfg.num_groups
        );
        assert!(
            e <= MOE_ROUTE_MAX,
            "the CUDA MoE router takes at most {MOE_ROUTE_MAX} experts, not {e}"
        );
        assert!(
            k <= e && e.is_multiple_of(cfg.num_groups) && cfg.topk_groups <= cfg.num_groups,
            "MoE routing of {k} of {e} experts in {} groups (top {}) is not a valid configuration",
            cfg.num_groups,
            cfg.topk_groups
        );
        need(logits, DType::F32, rows * e, "route_topk logits");
        need(bias, DType::F32, e, "route_topk bias");
        need(ids, DType::U32, rows * k, "route_topk ids");
        need(weights, DType::F32, rows * k, "route_topk weights");
        self.launch(
            &self.inner.kernels.moe_route,
            LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (MOE_ROUTE_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                A::from(ptr(logits)),
                A::from(rows as i32),
                A::from(e as i32),
                A::from(ptr(bias)),
                A::from(k as i32),
                A::from(cfg.num_groups as i32),
                A::from(cfg.topk_groups as i32),
                A::from(i32::from(cfg.renormalize)),
                A::from(cfg.routed_scaling_factor),
                A::from(ptr(ids)),
                A::from(ptr(weights)),
            ],
        );
    }

    /// The weights' device addresses, when all are bf16 or all block-FP8 with rows of whole
    /// 8-value chunks (what the grouped kernels load) and there are at most
    /// [`MOE_MAX_EXPERTS`]; an FP8 table ends with the word [`FP8_TABLE`].
    pub(crate) fn run_expert_table(&self, weights: &[&Linear<Self>]) -> Option<T> {
        let dtype = weights.first()?.weight.dtype();
        let fits = |w: &&Linear<Self>| w.weight.dtype() == dtype && w.in_features.is_multiple_of(8);
        if weights.len() > MOE_MAX_EXPERTS
            || !matches!(dtype, DType::BF16 | DType::F8E4M3)
            || !weights.iter().all(fits)
        {
            return None;
        }
        let mut words: Vec<u32> = weights
            .iter()
            .flat_map(|w| {
                let at = ptr(&w.weight);
                [at as u32, (at >> 32) as u32]
            })
            .collect();
        if dtype == DType::F8E4M3 {
            words.push(FP8_TABLE);
        }
        Some(self.upload(&HostTensor::from_u32(words)))
    }

    pub(crate) fn run_moe_grouped(
        &self,
        x: &T,
        routed: Routed<'_, Self>,
        bank: ExpertBank<'_, Self>,
        y: &mut T,
    ) {
        let Routed { rows, k, .. } = routed;
        if rows == 0 {
            return;
        }
        let (hidden, inter, experts) = (bank.hidden, bank.inter, bank.count);
        assert!(
            experts <= MOE_MAX_EXPERTS,
            "the grouped CUDA experts take at most {MOE_MAX_EXPERTS} experts per bank, not {experts}"
        );
        let pairs = rows * k;
        need(x, DType::F32, rows * hidden, "moe_grouped input");
        need(y, DType::F32, rows * hidden, "moe_grouped output");
        need(routed.ids, DType::U32, pairs, "moe_grouped ids");
        need(routed.weights, DType::F32, pairs, "moe_grouped weights");
        need(
            bank.gate_up,
            DType::U32,
            2 * experts,
            "moe_grouped gate/up table",
        );
        need(bank.down, DType::U32, 2 * experts, "moe_grouped down table");
        let fp8 = bank.gate_up.len() > 2 * experts;
        let (gate_up_kernel, down_kernel) = if fp8 {
            (
                &self.inner.kernels.moe_gate_up_fp8,
                &self.inner.kernels.moe_down_fp8,
            )
        } else {
            (
                &self.inner.kernels.moe_gate_up,
                &self.inner.kernels.moe_down,
            )
        };
        let offsets = self.zeros(DType::U32, &[experts + 1]);
        let order = self.zeros(DType::U32, &[pairs]);
        // The count of experts with pairs, then their indices (written by `moe_sort`).
        let active = self.zeros(DType::U32, &[experts + 1]);
        let act = self.zeros(DType::F32, &[pairs, inter]);
        let out = self.zeros(DType::F32, &[pairs, hidden]);
        let (first, count) = (bank.first as i32, experts as i32);
        self.launch(
            &self.inner.kernels.moe_sort,
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (experts.next_multiple_of(32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                A::from(ptr(routed.ids)),
                A::from(pairs as i32),
                A::from(first),
                A::from(count),
                A::from(ptr(&offsets)),
                A::from(ptr(&order)),
                A::from(ptr(&active)),
            ],
        );
        let (clamp, limit) = bank.limit.map_or((0i32, 0.0f32), |l| (1, l));
        // A block row per expert that can have pairs: no more than the step's pairs (8 of 256
        // experts at batch 1 with top-8 launch 8 rows, not 256 that would exit at once).
        let chosen = experts.min(pairs);
        let per_expert = |features: usize| LaunchConfig {
            grid_dim: (features.div_ceil(MOE_WARPS) as u32, chosen as u32, 1),
            block_dim: ((MOE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            gate_up_kernel,
            per_expert(inter),
            &[
                A::from(ptr(x)),
                A::from(hidden as i32),
                A::from(ptr(bank.gate_up)),
                A::from(ptr(&offsets)),
                A::from(ptr(&order)),
                A::from(ptr(&active)),
                A::from(k as i32),
                A::from(inter as i32),
                A::from(clamp),
                A::from(limit),
                A::from(ptr(&act)),
            ],
        );
        self.launch(
            down_kernel,
            per_expert(hidden),
            &[
                A::from(ptr(&act)),
                A::from(inter as i32),
                A::from(ptr(bank.down)),
                A::from(ptr(&offsets)),
                A::from(ptr(&order)),
                A::from(ptr(&active)),
                A::from(ptr(routed.weights)),
                A::from(hidden as i32),
                A::from(ptr(&out)),
            ],
        );
        self.launch(
            &self.inner.kernels.moe_combine,
            flat_cfg(rows * hidden),
            &[
                A::from(ptr(y)),
                A::from(ptr(&out)),
                A::from(ptr(routed.ids)),
                A::from(rows as i64),
                A::from(k as i32),
                A::from(first),
                A::from(count),
                A::from(hidden as i32),
            ],
        );
    }

    /// The expert's rows and weights travel in the scratch table; a block per row (the rows
    /// of one expert are distinct, so no two blocks add into the same row).
    pub(crate) fn run_scatter_add_rows(&self, y: &mut T, src: &T, expert: &ExpertRows, dim: usize) {
        let n = expert.rows.len();
        assert_eq!(
            n,
            expert.weights.len(),
            "scatter_add_rows: a weight per row"
        );
        let Some(&last) = expert.rows.iter().max() else {
            return;
        };
        need(src, DType::F32, n * dim, "scatter_add_rows source");
        need(
            y,
            DType::F32,
            (last as usize + 1) * dim,
            "scatter_add_rows output",
        );
        let mut bytes = Vec::with_capacity(8 * n);
        bytes.extend(expert.rows.iter().flat_map(|r| r.to_le_bytes()));
        bytes.extend(expert.weights.iter().flat_map(|w| w.to_le_bytes()));
        let table = self.upload_table(&bytes);
        self.launch(
            &self.inner.kernels.scatter_add_rows,
            rows_cfg(n, threads_for(dim).min(256)),
            &[
                A::from(ptr(y)),
                A::from(ptr(src)),
                A::from(table),
                A::from(table + 4 * n as u64),
                A::from(dim as i32),
            ],
        );
    }
}
