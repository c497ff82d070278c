//! Reading a KDA hybrid checkpoint's safetensors into f32 host tensors by name.
//!
//! The two families store the same weights under different names (`block_sparse_moe.experts.N.w1`
//! vs `mlp.experts.N.gate_proj`, `model.` vs `model.language_model.`), so lookups here take a
//! list of candidate names and the model code stays family-agnostic. Every tensor of a decoder
//! layer must be consumed: a leftover one (an unexpected bias, say) means the loader does not
//! understand the checkpoint, which is an error rather than silently wrong numbers. Tensors
//! outside the decoder (a vision tower, MTP layers past `num_hidden_layers`) are skipped.

use crate::backend::Linear;
use crate::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

/// Host tensors of a checkpoint directory, f32, by name.
pub(crate) struct Checkpoint {
    tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// `model.` or `model.language_model.`: where the decoder lives.
    pub prefix: String,
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Names that are not part of the text decoder.
fn skipped(name: &str) -> bool {
    name.starts_with("model.visual.") || name.starts_with("visual.") || name.contains("shared_head")
}

impl Checkpoint {
    /// Reads every `*.safetensors` in `dir`.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            // Reference outputs may sit next to the weights; they are not weights.
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("model"))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::Weights(format!(
                "no model*.safetensors in {}",
                dir.display()
            )));
        }
        let mut tensors = BTreeMap::new();
        for path in files {
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
            for (name, view) in st.tensors() {
                if skipped(&name) {
                    continue;
                }
                let data = to_f32(view.dtype(), view.data()).ok_or_else(|| {
                    Error::Weights(format!("{name}: unsupported dtype {:?}", view.dtype()))
                })?;
                tensors.insert(name, (view.shape().to_vec(), data));
            }
        }
        let prefix = ["model.language_model.", "model."]
            .into_iter()
            .find(|p| tensors.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| Error::Weights("no embed_tokens.weight".into()))?
            .to_owned();
        Ok(Self { tensors, prefix })
    }

    /// Whether a tensor of this name is present.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes the first present of `names`, checking its element count against `shape`
    /// (checkpoints disagree on singleton dims, e.g. `A_log` `[H]` vs `[1,1,H,1]`, and on
    /// `[P,1,W]` vs `[P,W]` conv weights; the element count still pins the layout down).
    pub fn take_any(&mut self, names: &[&str], shape: &[usize]) -> Result<Vec<f32>> {
        let name = names
            .iter()
            .find(|n| self.tensors.contains_key(**n))
            .ok_or_else(|| Error::Weights(format!("missing tensor {}", names.join(" or "))))?;
        let (s, data) = self
            .tensors
            .remove(*name)
            .expect("presence checked just above");
        let squeeze = |v: &[usize]| v.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&s) != squeeze(shape) {
            return Err(Error::Weights(format!(
                "{name}: shape {s:?}, expected {shape:?}"
            )));
        }
        Ok(data)
    }

    /// [`Checkpoint::take_any`] of one name.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.take_any(&[name], shape)
    }

    /// A weight matrix `[out, in]` as a [`Linear`].
    pub fn linear_any(
        &mut self,
        names: &[&str],
        out: usize,
        inp: usize,
    ) -> Result<Linear<Vec<f32>>> {
        Ok(Linear {
            weight: self.take_any(names, &[out, inp])?,
            out_features: out,
            in_features: inp,
        })
    }

    /// [`Checkpoint::linear_any`] of one name.
    pub fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<Linear<Vec<f32>>> {
        self.linear_any(&[name], out, inp)
    }

    /// Fails if a tensor of decoder layers `0..num_layers` was not consumed; drops the rest.
    pub fn finish(self, num_layers: usize) -> Result<()> {
        let layers = format!("{}layers.", self.prefix);
        let leftover: Vec<&String> = self
            .tensors
            .keys()
            .filter(|name| {
                name.strip_prefix(&layers)
                    .and_then(|rest| rest.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_some_and(|i| i < num_layers)
            })
            .collect();
        if leftover.is_empty() {
            Ok(())
        } else {
            Err(Error::Weights(format!(
                "tensors not understood by the kda_hybrid loader: {leftover:?}"
            )))
        }
    }
}
