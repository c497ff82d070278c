//! Reading a KDA hybrid checkpoint's safetensors into f32 host tensors by name.
//!
//! The two families store the same weights under different names (`block_sparse_moe.experts.N.w1`
//! vs `mlp.experts.N.gate_proj`, `model.` vs `model.language_model.`), so lookups here take a
//! list of candidate names and the model code stays family-agnostic. Every tensor of a decoder
//! layer must be used: a leftover one (an unexpected bias, say) means the loader does not
//! understand the checkpoint, which is an error rather than silently wrong numbers. Tensors
//! outside the decoder (a vision tower, MTP layers past `num_hidden_layers`) are skipped.
//!
//! Reads do not consume: one [`Checkpoint`] feeds every rank of a tensor-parallel layout, each
//! taking its own rows or columns ([`Checkpoint::slice`]); "used" is tracked by name, so the
//! leftover check runs once after the last rank. Block-FP8 weights (`F8_E4M3` plus
//! `weight_scale_inv`) are kept as FP8 until a read asks for f32 (then dequantised, once,
//! before any sharding); a backend with FP8 products takes routed experts' tiles as they are
//! ([`Checkpoint::fp8_slice`]). A PEFT LoRA adapter is merged here (`W + (alpha/r)·B·A`,
//! dequantising its targets). The stored dtype of every tensor stays queryable
//! ([`Checkpoint::dtype_of`]) because fusion is decided from the ORIGINAL tensors.

use crate::backend::host::Linear;
use crate::{BlockFp8, Error, Result};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::Path;
use tandem_model::fusion::LoraTargets;

/// Host tensors of a checkpoint directory, f32, by name.
pub(crate) struct Checkpoint {
    tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Block-FP8 weights not yet dequantised (a read as f32 moves one into `tensors`).
    fp8: BTreeMap<String, (Vec<usize>, BlockFp8)>,
    /// Stored dtype (`BF16`, `F8_E4M3`, …) of every tensor, as written in the file.
    dtypes: BTreeMap<String, String>,
    used: BTreeSet<String>,
    /// `model.` or `model.language_model.`: where the decoder lives.
    pub prefix: String,
}

/// Names that are not part of the text decoder.
fn skipped(name: &str) -> bool {
    name.starts_with("model.visual.") || name.starts_with("visual.") || name.contains("shared_head")
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io { path, source }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    serde_json::from_str(&text).map_err(|e| Error::Weights(format!("{}: {e}", path.display())))
}

impl Checkpoint {
    /// Reads every `model*.safetensors` in `dir` (block-FP8 weights stay FP8 until read as f32).
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let config = read_json(&dir.join("config.json"))?;
        let block = crate::fp8_weights::block_size(&config)?;
        // Reference outputs may sit next to the weights; they are not weights.
        let files = tandem_model::tensors::safetensors_files(dir, "model")?;
        let stored = tandem_model::tensors::read_safetensors(&files, skipped)?;
        let (mut tensors, dtypes, fp8) = (stored.floats, stored.dtypes, stored.fp8);
        let fp8 = crate::fp8_weights::with_scales(fp8, block, |scale| {
            tensors.remove(scale).map(|t| t.1)
        })?
        .into_iter()
        .map(|(name, shape, m)| (name, (shape, m)))
        .collect();
        let prefix = ["model.language_model.", "model."]
            .into_iter()
            .find(|p| tensors.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| Error::Weights("no embed_tokens.weight".into()))?
            .to_owned();
        Ok(Self {
            tensors,
            fp8,
            dtypes,
            used: BTreeSet::new(),
            prefix,
        })
    }

    /// Merges the PEFT adapter in `lora_dir` (`adapter_config.json`: `r`, `lora_alpha`,
    /// `target_modules`; `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight`
    /// `[r, in]` and `.lora_B.weight` `[out, r]`) into the base weights: `W += (alpha/r)·B·A`.
    /// Returns the adapter's targets, which keep the touched projections unfused.
    pub fn merge_lora(&mut self, lora_dir: &Path) -> Result<LoraTargets> {
        let cfg = read_json(&lora_dir.join("adapter_config.json"))?;
        let targets = LoraTargets::from_adapter_config(&cfg).ok_or_else(|| {
            Error::Weights(format!(
                "{}: adapter_config.json has no target_modules",
                lora_dir.display()
            ))
        })?;
        let r = cfg.get("r").and_then(|v| v.as_f64()).unwrap_or(8.0);
        let alpha = cfg.get("lora_alpha").and_then(|v| v.as_f64()).unwrap_or(r);
        let scale = (alpha / r) as f32;
        let path = lora_dir.join("adapter_model.safetensors");
        let bytes = std::fs::read(&path).map_err(io_err(&path))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
        let read = |name: &str| -> Result<(Vec<usize>, Vec<f32>)> {
            let v = st
                .tensor(name)
                .map_err(|e| Error::Weights(format!("{}: {name}: {e}", path.display())))?;
            let data = tandem_model::tensors::to_f32(v.dtype(), v.data())
                .ok_or_else(|| Error::Weights(format!("{name}: unsupported dtype")))?;
            Ok((v.shape().to_vec(), data))
        };
        for name in st.names() {
            let Some(module) = name
                .strip_suffix(".lora_A.weight")
                .map(|m| m.strip_prefix("base_model.model.").unwrap_or(m))
            else {
                continue;
            };
            let (sa, a) = read(name)?;
            let (sb, b) = read(&name.replace(".lora_A.", ".lora_B."))?;
            let target = format!("{module}.weight");
            self.dequantize(&target);
            let (sw, w) = self
                .tensors
                .get_mut(&target)
                .ok_or_else(|| Error::Weights(format!("LoRA for missing weight {target}")))?;
            let (rank, inp, out) = (sa[0], sa[1], sb[0]);
            if sa.len() != 2 || sb != [out, rank] || sw[..] != [out, inp] {
                return Err(Error::Weights(format!(
                    "LoRA {module}: A {sa:?}, B {sb:?} do not fit the weight {sw:?}"
                )));
            }
            for o in 0..out {
                let row = &mut w[o * inp..(o + 1) * inp];
                for k in 0..rank {
                    let bk = scale * b[o * rank + k];
                    row.iter_mut()
                        .zip(&a[k * inp..(k + 1) * inp])
                        .for_each(|(w, &a)| *w += bk * a);
                }
            }
        }
        Ok(targets)
    }

    /// The stored dtype name of `name` (`BF16`, `F8_E4M3`, …), `None` when absent.
    pub fn dtype_of(&self, name: &str) -> Option<String> {
        self.dtypes.get(name).cloned()
    }

    /// Whether the first present of `names` is stored block-FP8 (`F8_E4M3`).
    pub fn is_stored_fp8(&self, names: &[&str]) -> bool {
        names
            .iter()
            .find(|n| self.has(n))
            .and_then(|n| self.dtypes.get(*n))
            .is_some_and(|d| d == "F8_E4M3")
    }

    /// Whether a tensor of this name is present.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.fp8.contains_key(name)
    }

    /// Moves FP8 `name`, dequantised, into the f32 tensors (nothing when it is not FP8 or
    /// already there).
    fn dequantize(&mut self, name: &str) {
        if let Some((shape, m)) = self.fp8.remove(name) {
            self.tensors
                .insert(name.to_owned(), (shape, m.dequantize()));
        }
    }

    /// Rows (`axis` 0) or columns (1) `range` of the first present of `names`, a `[rows, cols]`
    /// matrix, as block-FP8 tiles: `None` when it is not stored FP8 (or was already read as
    /// f32) or `range` cuts through tiles, and then nothing is marked read.
    pub fn fp8_slice(
        &mut self,
        names: &[&str],
        shape: [usize; 2],
        axis: usize,
        range: Range<usize>,
    ) -> Option<BlockFp8> {
        let name = names.iter().find(|n| self.has(n))?;
        let (stored, m) = self.fp8.get(*name)?;
        if stored[..] != shape {
            return None;
        }
        let part = match axis {
            0 => m.rows(range)?,
            1 => m.cols(range)?,
            _ => return None,
        };
        self.used.insert((*name).to_owned());
        Some(part)
    }

    /// Rows `range` along `axis` (0 or 1) of the first present of `names`, viewed as
    /// `shape` (whose element count must match the stored one: checkpoints disagree on
    /// singleton dims, e.g. `A_log` `[H]` vs `[1,1,H,1]`, and `[P,1,W]` vs `[P,W]` conv
    /// weights). Axis 0 keeps whole trailing blocks; axis 1 needs a 2-D `shape`.
    pub fn slice(
        &mut self,
        names: &[&str],
        shape: &[usize],
        axis: usize,
        range: Range<usize>,
    ) -> Result<Vec<f32>> {
        let name = names
            .iter()
            .find(|n| self.has(n))
            .ok_or_else(|| Error::Weights(format!("missing tensor {}", names.join(" or "))))?;
        self.dequantize(name);
        let (s, data) = &self.tensors[*name];
        let squeeze = |v: &[usize]| v.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(s) != squeeze(shape) {
            return Err(Error::Weights(format!(
                "{name}: shape {s:?}, expected {shape:?}"
            )));
        }
        let bad = || {
            Error::Weights(format!(
                "{name}: slice {range:?} on axis {axis} of {shape:?}"
            ))
        };
        let out = match (axis, shape) {
            (0, [rows, ..]) if range.end <= *rows => {
                let inner = data.len() / rows.max(&1);
                data[range.start * inner..range.end * inner].to_vec()
            }
            (1, [rows, cols]) if range.end <= *cols => (0..*rows)
                .flat_map(|r| &data[r * cols + range.start..r * cols + range.end])
                .copied()
                .collect(),
            _ => return Err(bad()),
        };
        self.used.insert((*name).to_owned());
        Ok(out)
    }

    /// The whole first present of `names`, checked against `shape` (see [`Checkpoint::slice`]).
    pub fn take_any(&mut self, names: &[&str], shape: &[usize]) -> Result<Vec<f32>> {
        let n = shape.first().copied().unwrap_or(1);
        let shape = if shape.is_empty() { &[1][..] } else { shape };
        self.slice(names, shape, 0, 0..n)
    }

    /// [`Checkpoint::take_any`] of one name.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.take_any(&[name], shape)
    }

    /// Rows `rows` (output features) of a weight matrix `[out, in]` as a [`Linear`].
    pub fn linear_rows(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
        rows: Range<usize>,
    ) -> Result<Linear<Vec<f32>>> {
        let n = rows.len();
        Ok(Linear {
            weight: self.slice(&[name], &[out, inp], 0, rows)?,
            out_features: n,
            in_features: inp,
        })
    }

    /// Columns `cols` (input features) of a weight matrix `[out, in]` as a [`Linear`]: the
    /// row-parallel half of a TP pair, whose outputs are partial sums.
    pub fn linear_cols(
        &mut self,
        names: &[&str],
        out: usize,
        inp: usize,
        cols: Range<usize>,
    ) -> Result<Linear<Vec<f32>>> {
        let n = cols.len();
        Ok(Linear {
            weight: self.slice(names, &[out, inp], 1, cols)?,
            out_features: out,
            in_features: n,
        })
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

    /// Fails if a tensor of decoder layers `0..num_layers` was never read.
    pub fn finish(&self, num_layers: usize) -> Result<()> {
        let layers = format!("{}layers.", self.prefix);
        let leftover: Vec<&String> = self
            .tensors
            .keys()
            .chain(self.fp8.keys())
            .filter(|name| !self.used.contains(*name))
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
