//! A deliberately naive f32 Llama forward pass (Hugging Face `LlamaForCausalLM` semantics),
//! used only to check imported weights against reference logits. It is not the engine: it
//! exists so a wrong import (for example, rope rows left permuted) fails here, in the crate
//! that produced it.

use safetensors::SafeTensors;
use tandem_model::LlamaConfig;

/// The weights of one checkpoint, as f32 vectors.
pub struct Weights<'a> {
    st: SafeTensors<'a>,
    cfg: LlamaConfig,
}

impl<'a> Weights<'a> {
    pub fn new(bytes: &'a [u8], cfg: LlamaConfig) -> Self {
        let st = SafeTensors::deserialize(bytes).expect("parse model.safetensors");
        Self { st, cfg }
    }

    fn get(&self, name: &str) -> Vec<f32> {
        let t = self.st.tensor(name).expect("tensor present");
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Logits at the last position of `ids`.
    pub fn last_logits(&self, ids: &[u32]) -> Vec<f32> {
        let c = &self.cfg;
        let (d, n) = (c.hidden_size, ids.len());
        let hd = c.head_dim();
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let embed = self.get("model.embed_tokens.weight");
        let mut x: Vec<Vec<f32>> = ids
            .iter()
            .map(|&id| embed[id as usize * d..(id as usize + 1) * d].to_vec())
            .collect();
        let eps = c.rms_norm_eps;
        for l in 0..c.num_hidden_layers {
            let w = |part: &str| self.get(&format!("model.layers.{l}.{part}.weight"));
            let (wq, wk, wv, wo) = (
                w("self_attn.q_proj"),
                w("self_attn.k_proj"),
                w("self_attn.v_proj"),
                w("self_attn.o_proj"),
            );
            let input_norm = w("input_layernorm");
            let h: Vec<Vec<f32>> = x.iter().map(|v| rms_norm(v, &input_norm, eps)).collect();
            let mut q: Vec<Vec<f32>> = h.iter().map(|v| matvec(&wq, v)).collect();
            let mut k: Vec<Vec<f32>> = h.iter().map(|v| matvec(&wk, v)).collect();
            let vv: Vec<Vec<f32>> = h.iter().map(|v| matvec(&wv, v)).collect();
            for pos in 0..n {
                rope(&mut q[pos], nh, hd, pos, c.rope_theta);
                rope(&mut k[pos], nkv, hd, pos, c.rope_theta);
            }
            let scale = 1.0 / (hd as f32).sqrt();
            for pos in 0..n {
                let mut attn = vec![0f32; nh * hd];
                for head in 0..nh {
                    let kvh = head / (nh / nkv);
                    let qh = &q[pos][head * hd..(head + 1) * hd];
                    let scores: Vec<f32> = (0..=pos)
                        .map(|t| dot(qh, &k[t][kvh * hd..(kvh + 1) * hd]) * scale)
                        .collect();
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f32 = exps.iter().sum();
                    for (t, e) in exps.iter().enumerate() {
                        let p = e / sum;
                        for (a, v) in attn[head * hd..(head + 1) * hd]
                            .iter_mut()
                            .zip(&vv[t][kvh * hd..(kvh + 1) * hd])
                        {
                            *a += p * v;
                        }
                    }
                }
                add(&mut x[pos], &matvec(&wo, &attn));
            }
            let (wg, wu, wd) = (w("mlp.gate_proj"), w("mlp.up_proj"), w("mlp.down_proj"));
            let post = w("post_attention_layernorm");
            for v in x.iter_mut() {
                let h = rms_norm(v, &post, eps);
                let g = matvec(&wg, &h);
                let u = matvec(&wu, &h);
                let act: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                add(v, &matvec(&wd, &act));
            }
        }
        let last = rms_norm(&x[n - 1], &self.get("model.norm.weight"), eps);
        matvec(&embed, &last)
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `w` is row-major `(out, in)`.
fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// Hugging Face's "rotate half" rope: dims `i` and `i + head_dim/2` form a pair.
fn rope(x: &mut [f32], heads: usize, hd: usize, pos: usize, theta: f32) {
    let half = hd / 2;
    for h in 0..heads {
        let v = &mut x[h * hd..(h + 1) * hd];
        for i in 0..half {
            let inv_freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / hd as f64);
            let (sin, cos) = (pos as f64 * inv_freq).sin_cos();
            let (a, b) = (v[i], v[i + half]);
            v[i] = a * cos as f32 - b * sin as f32;
            v[i + half] = b * cos as f32 + a * sin as f32;
        }
    }
}
