//! GGUF tensors → `model.safetensors` (f32, Hugging Face names, rope permutation undone).
//!
//! The file is written through the `safetensors` crate's own serialiser, so its header and
//! tensor order are exactly what Python's `safetensors` writes. Tensors are converted lazily,
//! one at a time as the serialiser asks for their bytes, so peak memory is one f32 tensor.

use super::ImportProgress;
use crate::dequant::dequantize;
use crate::gguf::{Gguf, TensorInfo};
use crate::{Error, Result};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::path::Path;

/// Head counts the Q/K rope permutation needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub query: usize,
    pub key_value: usize,
}

/// Undoes llama.cpp's rope row permutation of a Q or K projection.
///
/// `w` is row-major `(rows, cols)` with `rows = heads · head_dim`. llama.cpp's converter
/// reorders each head's rows from the "rotate halves" layout Hugging Face uses into
/// interleaved pairs; this restores it:
/// `w.reshape(heads, rows / heads / 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)`, i.e.
/// output row `h·head_dim + j·head_dim/2 + k` is input row `h·head_dim + 2k + j`.
pub fn unpermute_rope_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Result<Vec<f32>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) || w.len() != rows * cols {
        return Err(Error::Unsupported(format!(
            "rope permutation of a {rows}x{cols} matrix ({} values) over {heads} heads",
            w.len()
        )));
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..2 {
            for k in 0..half {
                let dst = (h * head_dim + j * half + k) * cols;
                let src = (h * head_dim + 2 * k + j) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    Ok(out)
}

/// Which Hugging Face tensor a GGUF tensor becomes, and whether its rows need un-permuting.
fn hf_name(gguf_name: &str, heads: Heads) -> Option<(String, Option<usize>)> {
    let (stem, suffix) = gguf_name.rsplit_once('.')?;
    if suffix != "weight" {
        return None;
    }
    let global = match stem {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(name) = global {
        return Some((format!("{name}.weight"), None));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (hf, rope) = match part {
        "attn_norm" => ("input_layernorm", None),
        "ffn_norm" => ("post_attention_layernorm", None),
        "attn_q" => ("self_attn.q_proj", Some(heads.query)),
        "attn_k" => ("self_attn.k_proj", Some(heads.key_value)),
        "attn_v" => ("self_attn.v_proj", None),
        "attn_output" => ("self_attn.o_proj", None),
        "ffn_gate" => ("mlp.gate_proj", None),
        "ffn_up" => ("mlp.up_proj", None),
        "ffn_down" => ("mlp.down_proj", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}.weight"), rope))
}

/// The Hugging Face tensor names a Llama checkpoint with `layers` layers must contain.
fn expected_names(layers: usize, tied: bool) -> Vec<String> {
    let mut names = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    if !tied {
        names.push("lm_head.weight".to_string());
    }
    for l in 0..layers {
        for part in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            names.push(format!("model.layers.{l}.{part}.weight"));
        }
    }
    names
}

/// Conversion state shared by the lazy tensors: progress, and the first error (a `View` cannot
/// return one, so it is parked here and checked after the serialiser finishes).
struct Conversion<'a> {
    gguf: &'a Gguf,
    done: Cell<usize>,
    total: usize,
    error: RefCell<Option<Error>>,
    progress: &'a dyn Fn(ImportProgress),
}

struct LazyTensor<'a> {
    info: &'a TensorInfo,
    hf_name: String,
    shape: Vec<usize>,
    rope_heads: Option<usize>,
    conversion: &'a Conversion<'a>,
}

impl LazyTensor<'_> {
    fn convert(&self) -> Result<Vec<u8>> {
        let raw = self.conversion.gguf.read_tensor_data(self.info)?;
        let mut values = dequantize(self.info.ggml_type, &raw, self.info.elements())?;
        drop(raw);
        if let Some(heads) = self.rope_heads {
            let rows = self.shape[0];
            values = unpermute_rope_rows(&values, rows, values.len() / rows, heads)?;
        }
        let mut bytes = vec![0u8; values.len() * 4];
        for (b, v) in bytes.chunks_exact_mut(4).zip(&values) {
            b.copy_from_slice(&v.to_le_bytes());
        }
        Ok(bytes)
    }
}

impl View for &LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let c = self.conversion;
        if c.error.borrow().is_some() {
            return Cow::Owned(Vec::new());
        }
        match self.convert() {
            Ok(bytes) => {
                c.done.set(c.done.get() + 1);
                (c.progress)(ImportProgress {
                    done: c.done.get(),
                    total: c.total,
                    tensor: self.hf_name.clone(),
                });
                Cow::Owned(bytes)
            }
            Err(e) => {
                *c.error.borrow_mut() = Some(Error::Tensor {
                    name: self.info.name.clone(),
                    source: Box::new(e),
                });
                Cow::Owned(Vec::new())
            }
        }
    }

    fn data_len(&self) -> usize {
        self.info.elements() * 4
    }
}

/// Converts every tensor of `gguf` into `path`.
pub(crate) fn write_safetensors(
    gguf: &Gguf,
    heads: Heads,
    layers: usize,
    path: &Path,
    progress: &dyn Fn(ImportProgress),
) -> Result<()> {
    let conversion = Conversion {
        gguf,
        done: Cell::new(0),
        total: gguf.tensors().len(),
        error: RefCell::new(None),
        progress,
    };
    let mut lazy = Vec::with_capacity(gguf.tensors().len());
    for info in gguf.tensors() {
        let (hf_name, rope_heads) = hf_name(&info.name, heads).ok_or_else(|| {
            Error::Unsupported(format!(
                "GGUF tensor {} has no Llama counterpart",
                info.name
            ))
        })?;
        let shape = info.shape();
        let matrix = hf_name != "model.norm.weight" && !hf_name.ends_with("layernorm.weight");
        if shape.len() != if matrix { 2 } else { 1 } {
            return Err(Error::Unsupported(format!(
                "tensor {} has shape {shape:?}",
                info.name
            )));
        }
        if let Some(h) = rope_heads {
            if !shape[0].is_multiple_of(2 * h) {
                return Err(Error::Unsupported(format!(
                    "tensor {} has {} rows, not a multiple of 2 x {h} heads",
                    info.name, shape[0]
                )));
            }
        }
        lazy.push(LazyTensor {
            info,
            hf_name,
            shape,
            rope_heads,
            conversion: &conversion,
        });
    }
    let tied = !lazy.iter().any(|t| t.hf_name == "lm_head.weight");
    let mut expected = expected_names(layers, tied);
    let mut present: Vec<&str> = lazy.iter().map(|t| t.hf_name.as_str()).collect();
    expected.sort_unstable();
    present.sort_unstable();
    if present != expected {
        let missing: Vec<&String> = expected
            .iter()
            .filter(|n| present.binary_search(&n.as_str()).is_err())
            .collect();
        return Err(Error::Unsupported(format!(
            "tensor set does not match a {layers}-layer Llama (missing: {missing:?}, {} tensors \
             present)",
            present.len()
        )));
    }

    let written =
        safetensors::serialize_to_file(lazy.iter().map(|t| (t.hf_name.clone(), t)), None, path);
    if let Some(e) = conversion.error.into_inner() {
        return Err(e);
    }
    written.map_err(|source| Error::Safetensors {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_matches_hand_computed_rows() {
        // 2 heads of head_dim 4 → 8 rows; row r holds [10r, 10r + 1].
        let rows = 8;
        let cols = 2;
        let w: Vec<f32> = (0..rows)
            .flat_map(|r| [10.0 * r as f32, 10.0 * r as f32 + 1.0])
            .collect();
        let out = unpermute_rope_rows(&w, rows, cols, 2).expect("permute");
        // Per head the interleaved rows (0,1,2,3) become evens then odds: (0,2,1,3).
        let order: Vec<f32> = out.chunks(cols).map(|r| r[0] / 10.0).collect();
        assert_eq!(order, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(&out[2..4], &[20.0, 21.0]);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp's forward permutation: reshape(H, 2, rows/H/2, cols).swapaxes(1, 2).
        let (rows, cols, heads) = (12, 3, 3);
        let head_dim = rows / heads;
        let half = head_dim / 2;
        let hf: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for k in 0..half {
                for j in 0..2 {
                    let dst = (h * head_dim + 2 * k + j) * cols;
                    let src = (h * head_dim + j * half + k) * cols;
                    gguf[dst..dst + cols].copy_from_slice(&hf[src..src + cols]);
                }
            }
        }
        assert_ne!(gguf, hf);
        assert_eq!(
            unpermute_rope_rows(&gguf, rows, cols, heads).expect("permute"),
            hf
        );
    }

    #[test]
    fn unpermute_rejects_bad_shapes() {
        assert!(unpermute_rope_rows(&[0.0; 6], 6, 1, 2).is_err());
        assert!(unpermute_rope_rows(&[0.0; 8], 8, 2, 2).is_err());
        assert!(unpermute_rope_rows(&[0.0; 8], 8, 1, 0).is_err());
    }

    #[test]
    fn maps_gguf_names() {
        let heads = Heads {
            query: 9,
            key_value: 3,
        };
        assert_eq!(
            hf_name("blk.12.attn_k.weight", heads),
            Some(("model.layers.12.self_attn.k_proj.weight".into(), Some(3)))
        );
        assert_eq!(
            hf_name("blk.0.attn_q.weight", heads),
            Some(("model.layers.0.self_attn.q_proj.weight".into(), Some(9)))
        );
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight", heads),
            Some((
                "model.layers.3.post_attention_layernorm.weight".into(),
                None
            ))
        );
        assert_eq!(
            hf_name("token_embd.weight", heads),
            Some(("model.embed_tokens.weight".into(), None))
        );
        assert_eq!(hf_name("rope_freqs.weight", heads), None);
        assert_eq!(hf_name("blk.x.attn_q.weight", heads), None);
    }
}
