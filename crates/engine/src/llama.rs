//! Llama-family decoder (SmolLM2 and friends): GQA attention with RoPE, RMSNorm, SwiGLU MLP,
//! optionally tied embeddings. Q/K/V and gate/up are fused at load time so each layer is three
//! GEMMs plus the output projections.

use crate::backend::{Backend, Linear, QkvLayout};
use crate::batch::ForwardBatch;
use crate::kv_pool::KvLayout;
use crate::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;
use tandem_model::LlamaConfig;

struct Layer<T> {
    input_norm: T,
    qkv: Linear<T>,
    o_proj: Linear<T>,
    post_norm: T,
    gate_up: Linear<T>,
    down: Linear<T>,
}

/// A loaded Llama-family model on backend `B`.
pub struct LlamaModel<B: Backend> {
    backend: B,
    config: LlamaConfig,
    embed: B::Tensor,
    lm_head: Option<Linear<B::Tensor>>,
    layers: Vec<Layer<B::Tensor>>,
    norm: B::Tensor,
    qkv_layout: QkvLayout,
}

/// Host-side tensors read from a checkpoint, by name.
struct HostTensors(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl HostTensors {
    fn load_dir(dir: &Path) -> Result<Self> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|source| Error::Io {
                path: dir.to_path_buf(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::Weights(format!(
                "no *.safetensors in {}",
                dir.display()
            )));
        }
        let mut map = HashMap::new();
        for path in files {
            let bytes = std::fs::read(&path).map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
            for (name, view) in st.tensors() {
                let data = to_f32(view.dtype(), view.data()).ok_or_else(|| {
                    Error::Weights(format!("{name}: unsupported dtype {:?}", view.dtype()))
                })?;
                map.insert(name, (view.shape().to_vec(), data));
            }
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

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let words = |n: usize| bytes.chunks_exact(n);
    Some(match dtype {
        Dtype::F32 => words(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => words(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => words(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

impl<B: Backend> LlamaModel<B> {
    /// Loads a Hugging Face layout checkpoint directory.
    pub fn load(dir: &Path, backend: B) -> Result<Self> {
        let config = LlamaConfig::from_dir(dir)?;
        let mut host = HostTensors::load_dir(dir)?;
        let (d, i, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let hd = config.head_dim();
        let (nh, nkv) = (config.num_attention_heads, config.num_key_value_heads);
        let linear = |backend: &B, parts: Vec<Vec<f32>>, out: usize, inp: usize| Linear {
            weight: backend.upload(parts.concat()),
            out_features: out,
            in_features: inp,
        };
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
                input_norm: backend
                    .upload(host.take(&format!("{p}.input_layernorm.weight"), &[d])?),
                qkv: linear(&backend, vec![q, k, vv], (nh + 2 * nkv) * hd, d),
                o_proj: linear(&backend, vec![o], d, nh * hd),
                post_norm: backend
                    .upload(host.take(&format!("{p}.post_attention_layernorm.weight"), &[d])?),
                gate_up: linear(&backend, vec![g, u], 2 * i, d),
                down: linear(&backend, vec![dn], d, i),
            });
        }
        let embed_host = host.take("model.embed_tokens.weight", &[v, d])?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(linear(
                &backend,
                vec![host.take("lm_head.weight", &[v, d])?],
                v,
                d,
            ))
        };
        let norm = backend.upload(host.take("model.norm.weight", &[d])?);
        let embed = backend.upload(embed_host);
        let qkv_layout = QkvLayout {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        Ok(Self {
            backend,
            config,
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

    /// Bytes of weights one decode step reads (every matrix once; the embedding table once
    /// as the LM head).
    pub fn weight_bytes(&self) -> usize {
        let c = &self.config;
        let per_layer = self.qkv_layout.row_width() * c.hidden_size
            + c.hidden_size * c.num_attention_heads * c.head_dim()
            + 3 * c.intermediate_size * c.hidden_size
            + 2 * c.hidden_size;
        4 * (per_layer * c.num_hidden_layers + c.vocab_size * c.hidden_size + c.hidden_size)
    }

    /// The KV layout this model needs for a pool of `num_blocks` blocks of `block_size`.
    pub fn kv_layout(&self, block_size: usize, num_blocks: usize) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim(),
            block_size,
            num_blocks,
        }
    }

    /// Runs one step: writes every new token's K/V into `cache` and returns the logits of
    /// `batch.logits_rows`, row-major `(rows, vocab)`, on the host.
    pub fn forward(&self, batch: &ForwardBatch, cache: &mut B::KvCache) -> Vec<f32> {
        let b = &self.backend;
        let c = &self.config;
        let n = batch.num_tokens();
        let d = c.hidden_size;
        let eps = c.rms_norm_eps;
        let mut x = b.zeros(n * d);
        b.embed(&self.embed, d, &batch.token_ids, &mut x);
        let mut h = b.zeros(n * d);
        let mut qkv = b.zeros(n * self.qkv_layout.row_width());
        let mut attn = b.zeros(n * self.qkv_layout.num_heads * self.qkv_layout.head_dim);
        let mut gate_up = b.zeros(n * 2 * c.intermediate_size);
        let mut act = b.zeros(n * c.intermediate_size);
        for (l, layer) in self.layers.iter().enumerate() {
            b.rms_norm(&x, &layer.input_norm, n, eps, &mut h);
            b.matmul(&h, n, &layer.qkv, &mut qkv, false);
            b.rope(&mut qkv, self.qkv_layout, &batch.positions, c.rope_theta);
            b.write_kv(&qkv, self.qkv_layout, cache, l, &batch.slot_mapping);
            b.attention(&qkv, self.qkv_layout, cache, l, batch, &mut attn);
            b.matmul(&attn, n, &layer.o_proj, &mut x, true);
            b.rms_norm(&x, &layer.post_norm, n, eps, &mut h);
            b.matmul(&h, n, &layer.gate_up, &mut gate_up, false);
            b.silu_mul(&gate_up, n, &mut act);
            b.matmul(&act, n, &layer.down, &mut x, true);
        }
        let rows = batch.logits_rows.len();
        if rows == 0 {
            return Vec::new();
        }
        let mut last = b.zeros(rows * d);
        b.gather_rows(&x, d, &batch.logits_rows, &mut last);
        b.rms_norm(&last, &self.norm, rows, eps, &mut h);
        let mut logits = b.zeros(rows * c.vocab_size);
        match &self.lm_head {
            Some(head) => b.matmul(&h, rows, head, &mut logits, false),
            None => b.matmul_raw(&h, rows, &self.embed, c.vocab_size, d, &mut logits, false),
        }
        b.download(&logits)
    }
}
