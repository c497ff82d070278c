//! Multi-head latent attention (the hybrid's full-attention layers), without RoPE: Kimi Linear
//! runs MLA as NoPE (`mla_use_nope`; the "rope" slot of the key is used unrotated and shared by
//! all heads) and GLM-5.3-Flash has no rope slot at all (`qk_rope_head_dim` 0).
//!
//! The cache is the latent, not expanded K/V: per token the `kv_lora_rank` values after
//! `kv_a_layernorm` plus the rope slot, shared by every head. Attention runs in the absorbed
//! form — the query is mapped into latent space by the key half of `kv_b_proj`, scored against
//! the cached latents directly, and the value half maps the attended latent back — so a step
//! reads only the cache, never re-expands it, and the cost per cached token is
//! `heads × kv_lora_rank`.
//!
//! Under attention TP a rank holds heads `(ra, A)` (query rows, `kv_b` rows, `o_proj`
//! columns; `forward` then returns partial sums) and the whole latent path.
//!
//! GLM's DSA indexer: only its per-token key cache is computed (so a prefill → decode hand-off
//! carries everything a sparse implementation would need). Token selection is not implemented;
//! attention is dense, which is what the indexer selects while the context holds at most
//! `index_topk` tokens.

use super::config::{IndexerConfig, MlaConfig};
use super::loading::{part, Upload};
use super::projection::project;
use super::weights::Checkpoint;
use crate::backend::hybrid::{HybridOps, MlaDims};
use crate::backend::latents::{IndexerCache, LatentPool, MlaState, PagedRows};
use crate::backend::{CpuBackend, Linear, Ops};
use crate::tensor::{DType, Tensor};
use crate::Result;
use tandem_topology::Shard;

#[derive(Debug)]
enum QueryProjection<B: Ops> {
    /// Kimi Linear: `q_proj` `[H·(dn+dr), hidden]`.
    Direct(Linear<B>),
    /// GLM: `q_b_proj(RMSNorm(q_a_proj x; q_a_layernorm))`.
    LowRank {
        a: Linear<B>,
        norm: Tensor<B>,
        b: Linear<B>,
    },
}

#[derive(Debug)]
struct IndexerKeys<B: Ops> {
    wk: Linear<B>,
    norm_weight: Tensor<B>,
    norm_bias: Tensor<B>,
    gate: Linear<B>,
}

/// One loaded MLA layer.
#[derive(Debug)]
pub struct MlaLayer<B: Ops = CpuBackend> {
    cfg: MlaConfig,
    q: QueryProjection<B>,
    kv_a: Linear<B>,
    kv_norm: Tensor<B>,
    /// `[H·(dn+dv), kv_lora_rank]` f32: per head `dn` key rows then `dv` value rows.
    kv_b: Tensor<B>,
    o_proj: Linear<B>,
    indexer: Option<IndexerKeys<B>>,
    pool: LatentPool,
}

impl<B: HybridOps> MlaLayer<B> {
    /// Loads the layer under its `self_attn` prefix `attn`: the heads of `shard` (query and
    /// `kv_b` rows, `o_proj` columns); the latent path (`kv_a`, its norm, the indexer) is
    /// replicated, so every attention-TP rank keeps the whole latent cache.
    pub(crate) fn load(
        ck: &mut Checkpoint,
        attn: &str,
        cfg: MlaConfig,
        (hidden, shard): (usize, Shard),
        up: &Upload<'_, B>,
    ) -> Result<Self> {
        let name = |n: &str| format!("{attn}.{n}");
        let (h, r, dr) = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let heads = part(shard, h, attn)?;
        let per = |width: usize| heads.start * width..heads.end * width;
        let q_out = h * cfg.qk_head_dim();
        let q_rows = per(cfg.qk_head_dim());
        let q = match cfg.q_lora_rank {
            None => QueryProjection::Direct(up.matrix(
                ck,
                &[&name("q_proj.weight")],
                [q_out, hidden],
                0,
                q_rows,
            )?),
            Some(rank) => QueryProjection::LowRank {
                a: up.matrix(ck, &[&name("q_a_proj.weight")], [rank, hidden], 0, 0..rank)?,
                norm: up.f32(ck.take(&name("q_a_layernorm.weight"), &[rank])?),
                b: up.matrix(ck, &[&name("q_b_proj.weight")], [q_out, rank], 0, q_rows)?,
            },
        };
        let indexer = if ck.has(&name("indexer.wk.weight")) {
            let ic = cfg.indexer.ok_or_else(|| {
                crate::Error::Weights(format!(
                    "{attn} has indexer weights but config has no index_topk"
                ))
            })?;
            Some(load_indexer(
                ck,
                &name("indexer"),
                ic,
                cfg.q_lora_rank,
                hidden,
                up,
            )?)
        } else {
            None
        };
        let kv_b_width = cfg.qk_nope_head_dim + cfg.v_head_dim;
        Ok(Self {
            q,
            kv_a: up.matrix(
                ck,
                &[&name("kv_a_proj_with_mqa.weight")],
                [r + dr, hidden],
                0,
                0..r + dr,
            )?,
            kv_norm: up.f32(ck.take(&name("kv_a_layernorm.weight"), &[r])?),
            kv_b: up.f32(ck.slice(
                &[&name("kv_b_proj.weight")],
                &[h * kv_b_width, r],
                0,
                per(kv_b_width),
            )?),
            o_proj: up.matrix(
                ck,
                &[&name("o_proj.weight")],
                [hidden, h * cfg.v_head_dim],
                1,
                per(cfg.v_head_dim),
            )?,
            indexer,
            pool: LatentPool::default(),
            cfg: MlaConfig {
                num_heads: heads.len(),
                ..cfg
            },
        })
    }

    /// The layer's sizes.
    pub fn config(&self) -> &MlaConfig {
        &self.cfg
    }

    /// An empty cache on `b`.
    pub fn new_state(&self, b: &B) -> MlaState<B> {
        let rows = |width: usize, pool: &LatentPool| PagedRows::new(width, pool.clone(), b.clone());
        let own = LatentPool::default();
        MlaState {
            kv_latent: rows(self.cfg.kv_lora_rank, &self.pool),
            k_rope: rows(self.cfg.qk_rope_head_dim, &self.pool),
            indexer: self.indexer.as_ref().map(|ix| IndexerCache {
                keys: rows(ix.wk.out_features, &own),
                pool_gate: rows(ix.gate.out_features, &own),
            }),
        }
    }

    /// Where new states take their latent blocks from.
    pub fn set_latent_pool(&mut self, pool: LatentPool) {
        self.pool = pool;
    }

    /// The pool new states take their latent blocks from.
    pub fn latent_pool(&self) -> LatentPool {
        self.pool.clone()
    }

    /// Appends `rows` tokens (normed layer input `[rows, hidden]`) to `state` and returns their
    /// attention output after `o_proj`, `[rows, hidden]`. Token `i` sees every cached token and
    /// the new ones up to itself.
    pub fn forward(&self, b: &B, x: &Tensor<B>, rows: usize, state: &mut MlaState<B>) -> Tensor<B> {
        self.forward_batch(b, x, &[rows], &mut [state])
    }

    /// Several sequences at once: `x` holds `segments[i]` rows of sequence `i` after those of
    /// sequences `0..i`, appended to `states[i]`. The projections and `o_proj` are one GEMM
    /// over every row; each sequence attends over its own cache. Returns `[Σ rows, hidden]`.
    pub fn forward_batch(
        &self,
        b: &B,
        x: &Tensor<B>,
        segments: &[usize],
        states: &mut [&mut MlaState<B>],
    ) -> Tensor<B> {
        let c = &self.cfg;
        let dims = self.dims();
        assert_eq!(segments.len(), states.len(), "one state per sequence");
        let rows: usize = segments.iter().sum();
        let seqs = crate::backend::hybrid::row_ranges(segments);
        let q = match &self.q {
            QueryProjection::Direct(w) => project(b, x, rows, w),
            QueryProjection::LowRank { a, norm, b: qb } => {
                let mut qa = project(b, x, rows, a);
                b.rms_norm_in_place(&mut qa, rows, a.out_features, Some(norm), c.latent_norm_eps);
                project(b, &qa, rows, qb)
            }
        };
        let ckv = project(b, x, rows, &self.kv_a);
        // The indexer caches only exist on models that run an indexer.
        let indexed = self
            .indexer
            .as_ref()
            .filter(|_| states.iter().any(|s| s.indexer.is_some()))
            .map(|ix| {
                let mut keys = project(b, x, rows, &ix.wk);
                b.layer_norm_in_place(&mut keys, rows, &ix.norm_weight, &ix.norm_bias, 1e-6);
                (
                    keys,
                    project(b, x, rows, &ix.gate),
                    ix.wk.out_features,
                    ix.gate.out_features,
                )
            });
        let indexer = indexed.as_ref().map(|(k, g, kw, gw)| (k, g, *kw, *gw));
        b.mla_append(
            &ckv,
            &seqs,
            states,
            &self.kv_norm,
            dims,
            c.latent_norm_eps,
            indexer,
        );
        let caches: Vec<&MlaState<B>> = states.iter().map(|s| &**s).collect();
        let mut out = b.zeros(DType::F32, &[rows, dims.heads * dims.v_head]);
        b.mla_attention(&q, &seqs, &caches, &self.kv_b, dims, &mut out);
        project(b, &out, rows, &self.o_proj)
    }

    fn dims(&self) -> MlaDims {
        let c = &self.cfg;
        MlaDims {
            heads: c.num_heads,
            rank: c.kv_lora_rank,
            nope: c.qk_nope_head_dim,
            rope: c.qk_rope_head_dim,
            v_head: c.v_head_dim,
        }
    }
}

/// Loads the indexer's key-side weights (used for the cache) and checks and drops its
/// query-side weights (used only by the selection, which is not implemented).
fn load_indexer<B: Ops>(
    ck: &mut Checkpoint,
    prefix: &str,
    ic: IndexerConfig,
    q_lora_rank: Option<usize>,
    hidden: usize,
    up: &Upload<'_, B>,
) -> Result<IndexerKeys<B>> {
    let name = |n: &str| format!("{prefix}.{n}");
    let q_rank = q_lora_rank
        .ok_or_else(|| crate::Error::Weights(format!("{prefix}: indexer needs q_lora_rank")))?;
    ck.take(&name("wq_b.weight"), &[ic.num_heads * ic.head_dim, q_rank])?;
    ck.take(&name("weights_proj.weight"), &[ic.num_heads, hidden])?;
    ck.take(&name("index_kpool_compress_ape"), &[ic.kpool, ic.head_dim])?;
    Ok(IndexerKeys {
        wk: up.linear(ck.linear(&name("wk.weight"), ic.head_dim, hidden)?),
        norm_weight: up.f32(ck.take(&name("k_norm.weight"), &[ic.head_dim])?),
        norm_bias: up.f32(ck.take(&name("k_norm.bias"), &[ic.head_dim])?),
        gate: up.linear(ck.linear(&name("index_kpool_compress_gate"), ic.head_dim, hidden)?),
    })
}
