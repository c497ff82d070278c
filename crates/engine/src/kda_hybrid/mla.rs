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
use super::latent_pool::{LatentPool, PagedRows};
use super::loading::part;
use super::ops::{axpy, dot, linear, rms_norm, rms_norm_rows};
use super::weights::Checkpoint;
use crate::backend::host::Linear;
use crate::Result;
use rayon::prelude::*;
use tandem_topology::Shard;

/// The per-token caches of the DSA indexer, `[T, index_head_dim]` each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexerCache {
    /// `LayerNorm(wk x)`.
    pub keys: Vec<f32>,
    /// `x · index_kpool_compress_gateᵀ`, the per-token pool gate scores.
    pub pool_gate: Vec<f32>,
}

/// What one MLA layer keeps per request: one latent per token so far, in blocks of the
/// worker's paged latent pool ([`LatentPool`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlaState {
    /// Latents after `kv_a_layernorm`, `[T, kv_lora_rank]`.
    pub kv_latent: PagedRows,
    /// The (unrotated) rope slot of `kv_a_proj_with_mqa`, `[T, qk_rope_head_dim]`; empty when
    /// the model has none.
    pub k_rope: PagedRows,
    /// The indexer's caches, for layers that run an indexer.
    pub indexer: Option<IndexerCache>,
}

impl MlaState {
    /// Tokens cached, given the latent width.
    pub fn tokens(&self, kv_lora_rank: usize) -> usize {
        debug_assert!(self.kv_latent.is_empty() || self.kv_latent.width() == kv_lora_rank);
        self.kv_latent.rows()
    }

    /// Reserves blocks for `tokens` tokens in total; false when the pool is short (drop the
    /// state to hand back what was taken).
    pub fn reserve(&mut self, tokens: usize) -> bool {
        self.kv_latent.reserve(tokens) && self.k_rope.reserve(tokens)
    }

    /// As [`MlaState::reserve`], with blocks out of `claim`.
    pub fn reserve_from(&mut self, tokens: usize, claim: &mut super::latent_pool::Claim) -> bool {
        self.kv_latent.reserve_from(tokens, claim) && self.k_rope.reserve_from(tokens, claim)
    }

    /// Blocks [`MlaState::reserve`] would still take for `tokens` tokens.
    pub fn blocks_short(&self, tokens: usize) -> usize {
        self.kv_latent.blocks_short(tokens) + self.k_rope.blocks_short(tokens)
    }
}

#[derive(Debug)]
enum QueryProjection {
    /// Kimi Linear: `q_proj` `[H·(dn+dr), hidden]`.
    Direct(Linear<Vec<f32>>),
    /// GLM: `q_b_proj(RMSNorm(q_a_proj x; q_a_layernorm))`.
    LowRank {
        a: Linear<Vec<f32>>,
        norm: Vec<f32>,
        b: Linear<Vec<f32>>,
    },
}

#[derive(Debug)]
struct IndexerKeys {
    wk: Linear<Vec<f32>>,
    norm_weight: Vec<f32>,
    norm_bias: Vec<f32>,
    gate: Linear<Vec<f32>>,
}

/// One loaded MLA layer.
#[derive(Debug)]
pub struct MlaLayer {
    cfg: MlaConfig,
    q: QueryProjection,
    kv_a: Linear<Vec<f32>>,
    kv_norm: Vec<f32>,
    /// `[H·(dn+dv), kv_lora_rank]`: per head `dn` key rows then `dv` value rows.
    kv_b: Vec<f32>,
    o_proj: Linear<Vec<f32>>,
    indexer: Option<IndexerKeys>,
    pool: LatentPool,
}

impl MlaLayer {
    /// Loads the layer under its `self_attn` prefix `attn`: the heads of `shard` (query and
    /// `kv_b` rows, `o_proj` columns); the latent path (`kv_a`, its norm, the indexer) is
    /// replicated, so every attention-TP rank keeps the whole latent cache.
    pub(crate) fn load(
        ck: &mut Checkpoint,
        attn: &str,
        cfg: MlaConfig,
        hidden: usize,
        shard: Shard,
    ) -> Result<Self> {
        let name = |n: &str| format!("{attn}.{n}");
        let (h, r, dr) = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let heads = part(shard, h, attn)?;
        let per = |width: usize| heads.start * width..heads.end * width;
        let q_out = h * cfg.qk_head_dim();
        let q_rows = per(cfg.qk_head_dim());
        let q = match cfg.q_lora_rank {
            None => QueryProjection::Direct(ck.linear_rows(
                &name("q_proj.weight"),
                q_out,
                hidden,
                q_rows,
            )?),
            Some(rank) => QueryProjection::LowRank {
                a: ck.linear(&name("q_a_proj.weight"), rank, hidden)?,
                norm: ck.take(&name("q_a_layernorm.weight"), &[rank])?,
                b: ck.linear_rows(&name("q_b_proj.weight"), q_out, rank, q_rows)?,
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
            )?)
        } else {
            None
        };
        let kv_b_width = cfg.qk_nope_head_dim + cfg.v_head_dim;
        Ok(Self {
            q,
            kv_a: ck.linear(&name("kv_a_proj_with_mqa.weight"), r + dr, hidden)?,
            kv_norm: ck.take(&name("kv_a_layernorm.weight"), &[r])?,
            kv_b: ck.slice(
                &[&name("kv_b_proj.weight")],
                &[h * kv_b_width, r],
                0,
                per(kv_b_width),
            )?,
            o_proj: ck.linear_cols(
                &[&name("o_proj.weight")],
                hidden,
                h * cfg.v_head_dim,
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

    /// An empty cache.
    pub fn new_state(&self) -> MlaState {
        MlaState {
            kv_latent: PagedRows::new(self.cfg.kv_lora_rank, self.pool.clone()),
            k_rope: PagedRows::new(self.cfg.qk_rope_head_dim, self.pool.clone()),
            indexer: self.indexer.as_ref().map(|_| IndexerCache::default()),
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
    pub fn forward(&self, x: &Vec<f32>, rows: usize, state: &mut MlaState) -> Vec<f32> {
        self.forward_batch(x, &[rows], &mut [state])
    }

    /// Several sequences at once: `x` holds `segments[i]` rows of sequence `i` after those of
    /// sequences `0..i`, appended to `states[i]`. The projections and `o_proj` are one GEMM
    /// over every row; each sequence attends over its own cache. Returns `[Σ rows, hidden]`.
    pub fn forward_batch(
        &self,
        x: &Vec<f32>,
        segments: &[usize],
        states: &mut [&mut MlaState],
    ) -> Vec<f32> {
        let c = &self.cfg;
        let (h, r, dn, dr, dv) = self.dims();
        assert_eq!(segments.len(), states.len(), "one state per sequence");
        let rows: usize = segments.iter().sum();
        if rows == 0 {
            return Vec::new();
        }
        let q = match &self.q {
            QueryProjection::Direct(w) => linear(x, rows, w),
            QueryProjection::LowRank { a, norm, b } => {
                let mut qa = linear(x, rows, a);
                rms_norm_rows(&mut qa, a.out_features, Some(norm), c.latent_norm_eps);
                linear(&qa, rows, b)
            }
        };
        let ckv = linear(x, rows, &self.kv_a);
        // The indexer caches only exist on models that run an indexer.
        let indexed = self
            .indexer
            .as_ref()
            .filter(|_| states.iter().any(|s| s.indexer.is_some()))
            .map(|ix| {
                let mut keys = linear(x, rows, &ix.wk);
                layer_norm_rows(&mut keys, &ix.norm_weight, &ix.norm_bias, 1e-6);
                (
                    keys,
                    linear(x, rows, &ix.gate),
                    ix.wk.out_features,
                    ix.gate.out_features,
                )
            });
        // Append every sequence's new latents to its own cache, and note for every new row
        // which sequence it belongs to and how many cached tokens it sees.
        let mut row_view = Vec::with_capacity(rows);
        let mut start = 0;
        for (i, (&n, state)) in segments.iter().zip(states.iter_mut()).enumerate() {
            let seg = start..start + n;
            start += n;
            for row in ckv[seg.start * (r + dr)..seg.end * (r + dr)].chunks_exact(r + dr) {
                state.kv_latent.extend_from_slice(&rms_norm(
                    &row[..r],
                    r,
                    &self.kv_norm,
                    c.latent_norm_eps,
                ));
                state.k_rope.extend_from_slice(&row[r..]);
            }
            if let (Some((keys, gate, kw, gw)), Some(cache)) = (&indexed, state.indexer.as_mut()) {
                cache
                    .keys
                    .extend_from_slice(&keys[seg.start * kw..seg.end * kw]);
                cache
                    .pool_gate
                    .extend_from_slice(&gate[seg.start * gw..seg.end * gw]);
            }
            let first = state.tokens(r) - n;
            row_view.extend((0..n).map(|t| (i, first + t + 1)));
        }
        // Attention for every new row of every sequence in parallel, each over its own cache.
        let caches: Vec<&MlaState> = states.iter().map(|s| &**s).collect();
        let mut out = vec![0.0f32; rows * h * dv];
        out.par_chunks_mut(h * dv)
            .zip(q.par_chunks(h * (dn + dr)))
            .zip(row_view.par_iter())
            .for_each(|((out_row, q_row), &(seq, visible))| {
                self.attend(q_row, caches[seq], visible, out_row);
            });
        linear(&out, rows, &self.o_proj)
    }

    /// `(heads, kv_lora_rank, qk_nope, qk_rope, v_head)`.
    fn dims(&self) -> (usize, usize, usize, usize, usize) {
        let c = &self.cfg;
        (
            c.num_heads,
            c.kv_lora_rank,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
    }

    /// One new row's attention (`q_row` `[H, dn + dr]`) over the first `visible` tokens of
    /// `cache`, through the absorbed `kv_b` (scores and values in latent space); writes
    /// `[H, dv]` into `out_row`.
    fn attend(&self, q_row: &[f32], cache: &MlaState, visible: usize, out_row: &mut [f32]) {
        let c = &self.cfg;
        let (h, r, dn, dr, dv) = self.dims();
        let scale = 1.0 / (c.qk_head_dim() as f32).sqrt();
        let (latent, rope) = (&cache.kv_latent, &cache.k_rope);
        let mut q_lat = vec![0.0f32; r];
        let mut scores = vec![0.0f32; visible];
        let mut o_lat = vec![0.0f32; r];
        for head in 0..h {
            let qh = &q_row[head * (dn + dr)..(head + 1) * (dn + dr)];
            let (q_nope, q_rope) = qh.split_at(dn);
            let w_head = &self.kv_b[head * (dn + dv) * r..(head + 1) * (dn + dv) * r];
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
}

/// Loads the indexer's key-side weights (used for the cache) and checks and drops its
/// query-side weights (used only by the selection, which is not implemented).
fn load_indexer(
    ck: &mut Checkpoint,
    prefix: &str,
    ic: IndexerConfig,
    q_lora_rank: Option<usize>,
    hidden: usize,
) -> Result<IndexerKeys> {
    let name = |n: &str| format!("{prefix}.{n}");
    let q_rank = q_lora_rank
        .ok_or_else(|| crate::Error::Weights(format!("{prefix}: indexer needs q_lora_rank")))?;
    ck.take(&name("wq_b.weight"), &[ic.num_heads * ic.head_dim, q_rank])?;
    ck.take(&name("weights_proj.weight"), &[ic.num_heads, hidden])?;
    ck.take(&name("index_kpool_compress_ape"), &[ic.kpool, ic.head_dim])?;
    Ok(IndexerKeys {
        wk: ck.linear(&name("wk.weight"), ic.head_dim, hidden)?,
        norm_weight: ck.take(&name("k_norm.weight"), &[ic.head_dim])?,
        norm_bias: ck.take(&name("k_norm.bias"), &[ic.head_dim])?,
        gate: ck.linear(&name("index_kpool_compress_gate"), ic.head_dim, hidden)?,
    })
}

/// LayerNorm with bias over rows of `weight.len()`, in place.
fn layer_norm_rows(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let mean = row.iter().sum::<f32>() / dim as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
        let rs = 1.0 / (var + eps).sqrt();
        for ((v, &w), &b) in row.iter_mut().zip(weight).zip(bias) {
            *v = (*v - mean) * rs * w + b;
        }
    }
}
