//! Llama-family decoder (SmolLM2 and friends): GQA attention with RoPE, RMSNorm, SwiGLU MLP,
//! optionally tied embeddings. Q/K/V and gate/up are fused at load time so each layer is three
//! GEMMs plus the output projections. Written once over [`Ops`]: the weights and K/V are in the
//! dtype asked for at load (f32 or bf16), activations in f32, and a forward pass runs in a
//! [`LlamaWorkspace`] allocated for the largest step, so it allocates nothing.

use crate::backend::{Linear, Ops, QkvLayout, TensorComm};
use crate::batch::ForwardBatch;
use crate::kv_pool::{KvCache, KvLayout};
use crate::step::{StepLimits, StepMeta};
use crate::tensor::{DType, HostTensor, Tensor};
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
use tandem_model::LlamaConfig;

struct Layer<B: Ops> {
    input_norm: Tensor<B>,
    qkv: Linear<B>,
    o_proj: Linear<B>,
    post_norm: Tensor<B>,
    gate_up: Linear<B>,
    down: Linear<B>,
}

/// Which tensor-parallel shard a model holds: `rank` of `size`. Query heads, MLP columns
/// and the rows of o_proj/down_proj are split evenly; KV heads are split when there are at
/// least as many as ranks, else each rank holds the one its query heads use (replicated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpShard {
    /// This rank.
    pub rank: usize,
    /// Ranks in the tensor-parallel group.
    pub size: usize,
}

impl TpShard {
    /// The whole model on one rank.
    pub const WHOLE: TpShard = TpShard { rank: 0, size: 1 };

    /// The KV heads this rank holds (`first..first + count`) for `num_kv_heads` heads, after
    /// checking the split works for `num_heads` query heads and an MLP of `intermediate`.
    pub fn kv_heads(
        self,
        num_heads: usize,
        num_kv_heads: usize,
        intermediate: usize,
    ) -> Result<std::ops::Range<usize>> {
        let t = self.size;
        let bad = |what: String| {
            Err(Error::InvalidRequest(format!(
                "tensor parallelism {t} does not fit this model: {what}"
            )))
        };
        if t == 0 || self.rank >= t {
            return bad(format!("rank {} of {t}", self.rank));
        }
        if !num_heads.is_multiple_of(t) {
            return bad(format!("{num_heads} query heads"));
        }
        if !intermediate.is_multiple_of(t) {
            return bad(format!("MLP width {intermediate}"));
        }
        if num_kv_heads.is_multiple_of(t) {
            let per = num_kv_heads / t;
            Ok(self.rank * per..(self.rank + 1) * per)
        } else if t.is_multiple_of(num_kv_heads) {
            let head = self.rank / (t / num_kv_heads);
            Ok(head..head + 1)
        } else {
            bad(format!("{num_kv_heads} KV heads"))
        }
    }
}

/// A loaded Llama-family model (or one tensor-parallel shard of it) on backend `B`.
pub struct LlamaModel<B: Ops> {
    backend: B,
    config: LlamaConfig,
    shard: TpShard,
    comm: Option<Box<dyn TensorComm<B>>>,
    dtype: DType,
    embed: Tensor<B>,
    lm_head: Linear<B>,
    layers: Vec<Layer<B>>,
    norm: Tensor<B>,
    qkv_layout: QkvLayout,
}

/// Activations of one forward pass, sized for the largest step.
pub struct LlamaWorkspace<B: Ops> {
    limits: StepLimits,
    x: Tensor<B>,
    h: Tensor<B>,
    qkv: Tensor<B>,
    attn: Tensor<B>,
    gate_up: Tensor<B>,
    act: Tensor<B>,
    last: Tensor<B>,
    /// Logits of the step's sampled rows, `[max_seqs, vocab]` f32; the first
    /// `meta.num_logits` rows are valid after [`LlamaModel::forward`].
    pub logits: Tensor<B>,
}

impl<B: Ops> LlamaWorkspace<B> {
    /// The step size this workspace was allocated for.
    pub fn limits(&self) -> StepLimits {
        self.limits
    }
}

/// Host-side tensors read from a checkpoint, by name.
struct HostTensors(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl HostTensors {
    fn load_dir(dir: &Path) -> Result<Self> {
        let files = tandem_model::tensors::safetensors_files(dir, "")?;
        let stored = tandem_model::tensors::read_safetensors(&files, |_| false)?;
        let (mut map, fp8): (HashMap<_, _>, _) = (stored.floats.into_iter().collect(), stored.fp8);
        if !fp8.is_empty() {
            let config_path = dir.join("config.json");
            let config: serde_json::Value = std::fs::read_to_string(&config_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .ok_or_else(|| Error::Weights(format!("{}: unreadable", config_path.display())))?;
            let block = crate::fp8_weights::block_size(&config)?;
            let count = fp8.len();
            for (name, shape, data) in
                crate::fp8_weights::dequantize(fp8, block, |scale| map.remove(scale).map(|t| t.1))?
            {
                map.insert(name, (shape, data));
            }
            tracing::info!(
                tensors = count,
                block,
                "block-FP8 weights dequantised at load (they run in the model's dtype)"
            );
        }
        Ok(Self(map))
    }

    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (s, data) = self
            .0
            .remove(name)
            .ok_or_else(|| Error::Weights(format!("missing tensor {name}")))?;
        if s != shape {
            return Err(Error::Weights(format!(
                "{name}: shape {s:?}, expected {shape:?}"
            )));
        }
        Ok(data)
    }
}

/// Rows `range` of a row-major matrix `cols` wide.
fn rows(m: &[f32], cols: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    m[range.start * cols..range.end * cols].to_vec()
}

/// Columns `range` of every row of a row-major matrix `cols` wide.
fn columns(m: &[f32], cols: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    m.chunks_exact(cols)
        .flat_map(|row| row[range.clone()].iter().copied())
        .collect()
}

/// The dtypes the CPU and GPU paths run weights and K/V in.
pub fn check_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 => Ok(()),
        other => Err(Error::InvalidRequest(format!(
            "models run in f32 or bf16, not {other}"
        ))),
    }
}

impl<B: Ops> LlamaModel<B> {
    /// Loads a Hugging Face layout checkpoint directory with weights and K/V in `dtype`.
    pub fn load(dir: &Path, backend: B, dtype: DType) -> Result<Self> {
        Self::load_shard(dir, backend, dtype, TpShard::WHOLE, None)
    }

    /// Whether a step of this rank may be recorded and replayed (see
    /// [`TensorComm::replayable`]): always alone, with a communicator only if it allows.
    pub fn replayable(&self) -> bool {
        self.comm.as_ref().is_none_or(|c| c.replayable())
    }

    /// Loads tensor-parallel shard `shard` of a checkpoint; `comm` joins it to the other
    /// ranks (required when `shard.size > 1`): each layer's o_proj and down_proj partial sums
    /// are all-reduced, so every rank ends a layer with the full hidden state.
    pub fn load_shard(
        dir: &Path,
        backend: B,
        dtype: DType,
        shard: TpShard,
        comm: Option<Box<dyn TensorComm<B>>>,
    ) -> Result<Self> {
        match &comm {
            Some(c) if c.size() != shard.size || c.rank() != shard.rank => {
                return Err(Error::InvalidRequest(format!(
                    "communicator is rank {} of {}, the shard {} of {}",
                    c.rank(),
                    c.size(),
                    shard.rank,
                    shard.size
                )))
            }
            None if shard.size > 1 => {
                return Err(Error::InvalidRequest(
                    "a tensor-parallel shard needs a communicator".into(),
                ))
            }
            _ => {}
        }
        let mut model = Self::load_weights(dir, backend, dtype, shard)?;
        model.comm = comm;
        Ok(model)
    }

    /// Replaces the weights with those of `dir`, which must be a checkpoint of the same
    /// configuration: every tensor is overwritten in place, so its device address stays (a
    /// recorded decode step replays with the new weights). The K/V already cached stays too;
    /// the engine refreshes between steps.
    pub fn refresh(&mut self, dir: &Path) -> Result<()> {
        let fresh = Self::load_weights(dir, self.backend.clone(), self.dtype, self.shard)?;
        if fresh.config != self.config {
            return Err(Error::InvalidRequest(format!(
                "{} has another configuration than the loaded model: a refresh keeps every \
                 shape (restart the worker to change models)",
                dir.display()
            )));
        }
        let b = &self.backend;
        let mut pairs: Vec<(&mut Tensor<B>, &Tensor<B>)> = vec![
            (&mut self.embed, &fresh.embed),
            (&mut self.lm_head.weight, &fresh.lm_head.weight),
            (&mut self.norm, &fresh.norm),
        ];
        for (old, new) in self.layers.iter_mut().zip(&fresh.layers) {
            pairs.extend([
                (&mut old.input_norm, &new.input_norm),
                (&mut old.qkv.weight, &new.qkv.weight),
                (&mut old.o_proj.weight, &new.o_proj.weight),
                (&mut old.post_norm, &new.post_norm),
                (&mut old.gate_up.weight, &new.gate_up.weight),
                (&mut old.down.weight, &new.down.weight),
            ]);
        }
        for (old, new) in pairs {
            b.overwrite(old, &b.download(new))?;
        }
        Ok(())
    }

    /// The weights of `shard`, with no communicator.
    fn load_weights(dir: &Path, backend: B, dtype: DType, shard: TpShard) -> Result<Self> {
        check_dtype(dtype)?;
        let config = LlamaConfig::from_dir(dir)?;
        let (d, i, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let hd = config.head_dim();
        let (nh, nkv) = (config.num_attention_heads, config.num_key_value_heads);
        let kv_heads = shard.kv_heads(nh, nkv, i)?;
        // This rank's slice: query heads, KV heads, MLP columns.
        let (nh_r, i_r) = (nh / shard.size, i / shard.size);
        let q_rows = shard.rank * nh_r * hd..(shard.rank + 1) * nh_r * hd;
        let kv_rows = kv_heads.start * hd..kv_heads.end * hd;
        let mlp_rows = shard.rank * i_r..(shard.rank + 1) * i_r;
        let nkv_r = kv_heads.len();
        backend.check_attention(
            QkvLayout {
                num_heads: nh_r,
                num_kv_heads: nkv_r,
                head_dim: hd,
            },
            dtype,
        )?;
        let mut host = HostTensors::load_dir(dir)?;
        let upload =
            |backend: &B, shape: &[usize], data: Vec<f32>, dtype: DType| -> Result<Tensor<B>> {
                Ok(backend.upload(&HostTensor::from_f32(shape, data)?.to_dtype(dtype)?))
            };
        let linear =
            |backend: &B, parts: Vec<Vec<f32>>, out: usize, inp: usize| -> Result<Linear<B>> {
                let host = HostTensor::from_f32(&[out, inp], parts.concat())?.to_dtype(dtype)?;
                Ok(Linear {
                    weight: backend.upload_weight(&host),
                    out_features: out,
                    in_features: inp,
                })
            };
        let norm = |backend: &B, data: Vec<f32>| upload(backend, &[data.len()], data, DType::F32);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let q = host.take(&format!("{p}.self_attn.q_proj.weight"), &[nh * hd, d])?;
            let k = host.take(&format!("{p}.self_attn.k_proj.weight"), &[nkv * hd, d])?;
            let vv = host.take(&format!("{p}.self_attn.v_proj.weight"), &[nkv * hd, d])?;
            let o = host.take(&format!("{p}.self_attn.o_proj.weight"), &[d, nh * hd])?;
            let g = host.take(&format!("{p}.mlp.gate_proj.weight"), &[i, d])?;
            let u = host.take(&format!("{p}.mlp.up_proj.weight"), &[i, d])?;
            let dn = host.take(&format!("{p}.mlp.down_proj.weight"), &[d, i])?;
            layers.push(Layer {
                input_norm: norm(
                    &backend,
                    host.take(&format!("{p}.input_layernorm.weight"), &[d])?,
                )?,
                qkv: linear(
                    &backend,
                    vec![
                        rows(&q, d, q_rows.clone()),
                        rows(&k, d, kv_rows.clone()),
                        rows(&vv, d, kv_rows.clone()),
                    ],
                    (nh_r + 2 * nkv_r) * hd,
                    d,
                )?,
                o_proj: linear(
                    &backend,
                    vec![columns(&o, nh * hd, q_rows.clone())],
                    d,
                    nh_r * hd,
                )?,
                post_norm: norm(
                    &backend,
                    host.take(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                )?,
                gate_up: linear(
                    &backend,
                    vec![rows(&g, d, mlp_rows.clone()), rows(&u, d, mlp_rows.clone())],
                    2 * i_r,
                    d,
                )?,
                down: linear(&backend, vec![columns(&dn, i, mlp_rows.clone())], d, i_r)?,
            });
        }
        let embed_host = host.take("model.embed_tokens.weight", &[v, d])?;
        // A tied LM head gets its own copy in the backend's weight layout (the embedding table
        // stays row-major for lookups): more memory, the fast GEMM path for the logits.
        let lm_head = if config.tie_word_embeddings {
            linear(&backend, vec![embed_host.clone()], v, d)?
        } else {
            linear(&backend, vec![host.take("lm_head.weight", &[v, d])?], v, d)?
        };
        let norm = norm(&backend, host.take("model.norm.weight", &[d])?)?;
        let embed = upload(&backend, &[v, d], embed_host, dtype)?;
        let qkv_layout = QkvLayout {
            num_heads: nh_r,
            num_kv_heads: nkv_r,
            head_dim: hd,
        };
        Ok(Self {
            backend,
            config,
            shard,
            comm: None,
            dtype,
            embed,
            lm_head,
            layers,
            norm,
            qkv_layout,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The dtype of the weights and K/V.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The tensor-parallel shard this model holds.
    pub fn shard(&self) -> TpShard {
        self.shard
    }

    /// MLP width on this rank.
    fn local_intermediate(&self) -> usize {
        self.config.intermediate_size / self.shard.size
    }

    /// Bytes of weights one decode step reads on this rank (every matrix once; the embedding
    /// table once as the LM head; norms in f32).
    pub fn weight_bytes(&self) -> usize {
        let c = &self.config;
        let ql = self.qkv_layout;
        let matrices = ql.row_width() * c.hidden_size
            + c.hidden_size * ql.num_heads * ql.head_dim
            + 3 * self.local_intermediate() * c.hidden_size;
        let norms = 2 * c.hidden_size;
        (matrices * c.num_hidden_layers + c.vocab_size * c.hidden_size) * self.dtype.size()
            + (norms * c.num_hidden_layers + c.hidden_size) * 4
    }

    /// The KV layout of this rank's cache (its KV heads) for a pool of `num_blocks` blocks of
    /// `block_size`.
    pub fn kv_layout(&self, block_size: usize, num_blocks: usize) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.qkv_layout.num_kv_heads,
            head_dim: self.config.head_dim(),
            block_size,
            num_blocks,
            dtype: self.dtype,
        }
    }

    /// Activations for steps up to `limits`.
    pub fn workspace(&self, limits: StepLimits) -> LlamaWorkspace<B> {
        let b = &self.backend;
        let c = &self.config;
        let (n, r) = (limits.max_tokens.max(1), limits.max_seqs.max(1));
        let f = |rows: usize, cols: usize| b.zeros(DType::F32, &[rows, cols]);
        LlamaWorkspace {
            limits,
            x: f(n, c.hidden_size),
            h: f(n, c.hidden_size),
            qkv: f(n, self.qkv_layout.row_width()),
            attn: f(n, self.qkv_layout.num_heads * self.qkv_layout.head_dim),
            gate_up: f(n, 2 * self.local_intermediate()),
            act: f(n, self.local_intermediate()),
            last: f(r, c.hidden_size),
            logits: f(r, c.vocab_size),
        }
    }

    /// Runs one step described by `meta`: writes every new token's K/V into `cache` and
    /// leaves the logits of `meta.logits_rows` in `ws.logits`. Allocates nothing. A
    /// tensor-parallel shard all-reduces its partial sums with its peers, which must run the
    /// same step; a failed peer fails the step.
    pub fn forward(
        &self,
        meta: &StepMeta<B>,
        cache: &mut KvCache<B>,
        ws: &mut LlamaWorkspace<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let c = &self.config;
        let n = meta.num_tokens;
        assert!(
            n <= ws.limits.max_tokens && meta.num_logits <= ws.limits.max_seqs,
            "step larger than the workspace"
        );
        let d = c.hidden_size;
        let eps = c.rms_norm_eps;
        let ql = self.qkv_layout;
        // The residual add rides on the output projections (`accumulate`); under tensor
        // parallelism only rank 0 adds it, the others contribute their partial product, and
        // the all-reduce leaves residual + the full product on every rank.
        let residual = self.shard.rank == 0;
        let reduce = |x: &mut Tensor<B>| match &self.comm {
            Some(comm) => comm.all_reduce_sum(b, x, n * d),
            None => Ok(()),
        };
        b.embed(&self.embed, &meta.token_ids, n, &mut ws.x);
        // Each norm rides on the product after it, RoPE and the K/V write on attention (fused
        // where the backend can: see the `Ops` methods).
        for (l, layer) in self.layers.iter().enumerate() {
            b.rms_norm_linear(
                &ws.x,
                &layer.input_norm,
                n,
                eps,
                &mut ws.h,
                &layer.qkv,
                &mut ws.qkv,
            );
            b.rope_write_kv_attention(&mut ws.qkv, ql, c.rope_theta, cache, l, meta, &mut ws.attn);
            b.linear(&ws.attn, n, &layer.o_proj, &mut ws.x, residual);
            reduce(&mut ws.x)?;
            b.mlp(
                &mut ws.x,
                &layer.post_norm,
                n,
                eps,
                &mut ws.h,
                &layer.gate_up,
                &mut ws.gate_up,
                &mut ws.act,
                &layer.down,
                residual,
            );
            reduce(&mut ws.x)?;
        }
        let rows = meta.num_logits;
        if rows == 0 {
            return Ok(());
        }
        b.gather_rows(&ws.x, d, &meta.logits_rows, rows, &mut ws.last);
        b.rms_norm_linear(
            &ws.last,
            &self.norm,
            rows,
            eps,
            &mut ws.h,
            &self.lm_head,
            &mut ws.logits,
        );
        Ok(())
    }

    /// [`LlamaModel::forward`] of one batch with buffers made for it, returning the logits
    /// of `batch.logits_rows` on the host, row-major `(rows, vocab)` (evaluation and tests).
    pub fn forward_batch(&self, batch: &ForwardBatch, cache: &mut KvCache<B>) -> Result<Vec<f32>> {
        let limits = StepLimits {
            max_tokens: batch.num_tokens(),
            max_seqs: batch.seqs.len().max(batch.logits_rows.len()),
            max_blocks_per_seq: batch
                .seqs
                .iter()
                .map(|s| s.block_table.len())
                .max()
                .unwrap_or(0),
        };
        let mut meta = StepMeta::new(&self.backend, limits);
        meta.upload(&self.backend, batch)?;
        let mut ws = self.workspace(limits);
        self.forward(&meta, cache, &mut ws)?;
        let mut logits = self.backend.download(&ws.logits).to_f32_vec();
        logits.truncate(batch.logits_rows.len() * self.config.vocab_size);
        Ok(logits)
    }
}
