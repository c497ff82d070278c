//! The hybrid's feed-forward blocks: a SwiGLU MLP (dense layers, every expert and the shared
//! expert) and the MoE around it — sigmoid router, expert choice on `score +
//! e_score_correction_bias` (the bias steers the choice only), optional DeepSeek-V3 group limit,
//! renormalised top-k weights × `routed_scaling_factor`, plus the shared expert unweighted.
//!
//! GLM clamps the SwiGLU (`silu(min(gate, L)) · clamp(up, −L, L)`); the limit comes from the
//! config and is off for Kimi. Experts run batched: the tokens routed to one expert are gathered
//! into one GEMM, so a prefill costs one GEMM per active expert, not one per token.
//!
//! Sharded, a rank runs the router on every token, its EP shard's experts (each split over
//! the shard's `tp/ep` ranks) and its full-TP part of the shared expert; its output is a
//! partial sum the caller reduces over the TP group.

use super::config::MoeConfig;
use super::loading::{part, RankShard, Upload};
use super::projection::project;
use super::weights::Checkpoint;
use crate::backend::hybrid::{ExpertBank, ExpertRows, HybridOps, Routed};
use crate::backend::{CpuBackend, Linear, Ops};
use crate::tensor::{DType, HostTensor, Tensor};
use crate::Result;
use tandem_topology::Shard;

/// `down(act(gate x) · up x)`, gate and up fused into one `[2I, hidden]` matrix.
#[derive(Debug)]
pub struct SwiGlu<B: Ops = CpuBackend> {
    gate_up: Linear<B>,
    down: Linear<B>,
    limit: Option<f32>,
}

impl<B: HybridOps> SwiGlu<B> {
    /// Loads the first present of each (gate, up, down) name triple; intermediate channels
    /// `shard` only (column-parallel gate/up, row-parallel down: outputs are partial sums).
    /// Block-FP8 weights stay FP8 where [`Upload::keeps_fp8`], the backend has FP8 products
    /// and the shard keeps whole tiles ([`SwiGlu::is_fp8`]); otherwise they are dequantised.
    pub(crate) fn load(
        ck: &mut Checkpoint,
        names: &[[String; 3]],
        (hidden, inter): (usize, usize),
        limit: Option<f32>,
        shard: Shard,
        up: &Upload<'_, B>,
    ) -> Result<Self> {
        let pick = |i: usize| names.iter().map(|n| n[i].as_str()).collect::<Vec<_>>();
        let range = part(shard, inter, &names[0][0])?;
        let local = range.len();
        let stored_fp8 = ck.is_stored_fp8(&pick(0));
        if stored_fp8 && up.keeps_fp8() {
            let tiles = |ck: &mut Checkpoint, i: usize, shape, axis| {
                ck.fp8_slice(&pick(i), shape, axis, range.clone())
            };
            let gate_up = tiles(ck, 0, [inter, hidden], 0)
                .zip(tiles(ck, 1, [inter, hidden], 0))
                .and_then(|(g, u)| g.stack(u))
                .and_then(|m| up.backend.upload_fp8_weight(&m));
            let down =
                tiles(ck, 2, [hidden, inter], 1).and_then(|m| up.backend.upload_fp8_weight(&m));
            if let (Some(gate_up), Some(down)) = (gate_up, down) {
                up.note_fp8(true, 2);
                return Ok(Self {
                    gate_up: Linear {
                        weight: gate_up,
                        out_features: 2 * local,
                        in_features: hidden,
                    },
                    down: Linear {
                        weight: down,
                        out_features: hidden,
                        in_features: local,
                    },
                    limit,
                });
            }
        }
        if stored_fp8 {
            up.note_fp8(false, 2);
        }
        let gate = ck.slice(&pick(0), &[inter, hidden], 0, range.clone())?;
        let upw = ck.slice(&pick(1), &[inter, hidden], 0, range.clone())?;
        Ok(Self {
            gate_up: up.linear(crate::backend::host::Linear {
                weight: [gate, upw].concat(),
                out_features: 2 * local,
                in_features: hidden,
            }),
            down: up.linear(ck.linear_cols(&pick(2), hidden, inter, range)?),
            limit,
        })
    }

    /// Runs `rows` rows of `x` `[rows, hidden]`.
    /// Whether the weights stayed block-FP8.
    pub fn is_fp8(&self) -> bool {
        self.gate_up.weight.dtype() == DType::F8E4M3
    }

    pub fn forward(&self, b: &B, x: &Tensor<B>, rows: usize) -> Tensor<B> {
        let inter = self.down.in_features;
        let gu = project(b, x, rows, &self.gate_up);
        let mut act = b.zeros(DType::F32, &[rows, inter]);
        b.swiglu(&gu, rows, inter, self.limit, &mut act);
        project(b, &act, rows, &self.down)
    }
}

/// Routed experts plus shared experts (on one rank: the experts of its EP shard, each split
/// over the shard's `tp/ep` ranks, and its full-TP part of the shared expert).
#[derive(Debug)]
pub struct Moe<B: Ops = CpuBackend> {
    cfg: MoeConfig,
    router: Linear<B>,
    correction_bias: Tensor<B>,
    /// Index of `experts[0]` among all experts.
    first_expert: usize,
    experts: Vec<SwiGlu<B>>,
    shared: Option<SwiGlu<B>>,
    /// The experts' gate/up and down tables, when the backend runs them as one grouped
    /// product ([`HybridOps::expert_table`]).
    tables: Option<(Tensor<B>, Tensor<B>)>,
}

impl<B: HybridOps> Moe<B> {
    /// Loads the MoE block under `block` (`…block_sparse_moe` or `…mlp`); experts are named
    /// `w1/w3/w2` (Kimi) or `gate_proj/up_proj/down_proj` (GLM). The router is replicated
    /// (and kept in f32: its scores pick the experts).
    pub(crate) fn load(
        ck: &mut Checkpoint,
        block: &str,
        cfg: MoeConfig,
        hidden: usize,
        limit: Option<f32>,
        rs: &RankShard,
        up: &Upload<'_, B>,
    ) -> Result<Self> {
        let e = cfg.num_experts;
        let experts = rs
            .experts
            .clone()
            .map(|i| {
                let p = format!("{block}.experts.{i}");
                let names = [
                    [
                        format!("{p}.w1.weight"),
                        format!("{p}.w3.weight"),
                        format!("{p}.w2.weight"),
                    ],
                    [
                        format!("{p}.gate_proj.weight"),
                        format!("{p}.up_proj.weight"),
                        format!("{p}.down_proj.weight"),
                    ],
                ];
                SwiGlu::load(
                    ck,
                    &names,
                    (hidden, cfg.intermediate_size),
                    limit,
                    rs.expert_mlp,
                    up,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let stored_fp8 = rs.experts.clone().next().is_some_and(|i| {
            let names =
                [".w1.weight", ".gate_proj.weight"].map(|n| format!("{block}.experts.{i}{n}"));
            ck.is_stored_fp8(&names.each_ref().map(String::as_str))
        });
        if rs.log && stored_fp8 {
            let kept = experts.iter().filter(|x| x.is_fp8()).count();
            if kept == experts.len() {
                tracing::info!(block, experts = kept, "routed experts run as block-FP8");
            } else {
                tracing::info!(
                    block,
                    fp8 = kept,
                    dequantised = experts.len() - kept,
                    dtype = %up.dtype,
                    "routed experts dequantised at load (FP8 products need bf16 weights, a \
                     backend with them, and shards of whole 128-wide tiles)"
                );
            }
        }
        let shared = if cfg.num_shared_experts == 0 {
            None
        } else {
            let p = format!("{block}.shared_experts");
            let names = [[
                format!("{p}.gate_proj.weight"),
                format!("{p}.up_proj.weight"),
                format!("{p}.down_proj.weight"),
            ]];
            let inter = cfg.intermediate_size * cfg.num_shared_experts;
            Some(SwiGlu::load(
                ck,
                &names,
                (hidden, inter),
                limit,
                rs.dense,
                up,
            )?)
        };
        let f32_up = Upload::new(up.backend, DType::F32);
        let gate_up: Vec<_> = experts.iter().map(|x| &x.gate_up).collect();
        let down: Vec<_> = experts.iter().map(|x| &x.down).collect();
        let tables = up
            .backend
            .expert_table(&gate_up)
            .zip(up.backend.expert_table(&down));
        Ok(Self {
            router: f32_up.linear(ck.linear(&format!("{block}.gate.weight"), e, hidden)?),
            correction_bias: up
                .f32(ck.take(&format!("{block}.gate.e_score_correction_bias"), &[e])?),
            first_expert: rs.experts.start,
            experts,
            shared,
            tables,
            cfg,
        })
    }

    /// Runs `rows` rows of `x` `[rows, hidden]`.
    pub fn forward(&self, b: &B, x: &Tensor<B>, rows: usize) -> Tensor<B> {
        let hidden = self.router.in_features;
        let k = self.cfg.experts_per_token;
        let logits = project(b, x, rows, &self.router);
        let mut ids = b.zeros(DType::U32, &[rows, k]);
        let mut weights = b.zeros(DType::F32, &[rows, k]);
        b.route_topk(
            &logits,
            rows,
            &self.correction_bias,
            &self.cfg,
            &mut ids,
            &mut weights,
        );
        let mut y = match &self.shared {
            Some(shared) => shared.forward(b, x, rows),
            None => b.zeros(DType::F32, &[rows, hidden]),
        };
        let routed = Routed {
            ids: &ids,
            weights: &weights,
            rows,
            k,
        };
        match (&self.tables, self.experts.first()) {
            (Some((gate_up, down)), Some(first)) if b.groups_experts(rows) => {
                let bank = ExpertBank {
                    gate_up,
                    down,
                    first: self.first_expert,
                    count: self.experts.len(),
                    hidden,
                    inter: first.down.in_features,
                    limit: first.limit,
                };
                b.moe_grouped(x, routed, bank, &mut y);
            }
            _ => self.one_by_one(b, x, routed, &mut y),
        }
        y
    }

    /// The routed experts one at a time: each gathers its tokens, runs them as one batch and
    /// adds its weighted outputs into `y`.
    fn one_by_one(&self, b: &B, x: &Tensor<B>, routed: Routed<'_, B>, y: &mut Tensor<B>) {
        let hidden = self.router.in_features;
        let assigned = ExpertRows::from_routing(
            &b.download(routed.ids),
            &b.download(routed.weights),
            routed.rows,
            routed.k,
            self.cfg.num_experts,
        );
        for (expert, tokens) in assigned.iter().enumerate() {
            let Some(held) = expert
                .checked_sub(self.first_expert)
                .and_then(|i| self.experts.get(i))
            else {
                continue;
            };
            let n = tokens.rows.len();
            if n == 0 {
                continue;
            }
            let index = b.upload(&HostTensor::from_u32(tokens.rows.clone()));
            let mut gathered = b.zeros(DType::F32, &[n, hidden]);
            b.gather_rows(x, hidden, &index, n, &mut gathered);
            let out = held.forward(b, &gathered, n);
            b.scatter_add_rows(y, &out, tokens, hidden);
        }
    }
}
