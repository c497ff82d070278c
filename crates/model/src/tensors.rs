//! Reading a checkpoint's safetensors files: every float tensor decoded to f32 values, block-FP8
//! tensors kept as their bytes (their scales are float tensors beside them), and each tensor's
//! stored dtype as the file names it. Both model families' loaders read checkpoints through
//! this.

use crate::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor's shape and f32 values.
pub type Values = (Vec<usize>, Vec<f32>);

/// The tensors of some safetensors files, by name.
#[derive(Debug, Default)]
pub struct StoredTensors {
    /// Float tensors (F32, BF16, F16), as f32.
    pub floats: BTreeMap<String, Values>,
    /// `F8_E4M3` tensors: shape and codes, as stored.
    pub fp8: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    /// Every tensor's stored dtype as the file writes it (`BF16`, `F8_E4M3`, …).
    pub dtypes: BTreeMap<String, String>,
}

/// The `*.safetensors` files of `dir` whose names start with `prefix` (`""` for all), in
/// name order; fails when there is none.
pub fn safetensors_files(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    let io = |source| Error::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Unsupported(format!(
            "no {prefix}*.safetensors in {}",
            dir.display()
        )));
    }
    Ok(files)
}

/// Reads `files`, leaving out the tensors `skip` names.
pub fn read_safetensors(files: &[PathBuf], skip: impl Fn(&str) -> bool) -> Result<StoredTensors> {
    let mut out = StoredTensors::default();
    for path in files {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::Unsupported(format!("{}: {e}", path.display())))?;
        for (name, view) in st.tensors() {
            if skip(&name) {
                continue;
            }
            out.dtypes
                .insert(name.clone(), format!("{:?}", view.dtype()));
            if view.dtype() == Dtype::F8_E4M3 {
                out.fp8
                    .insert(name, (view.shape().to_vec(), view.data().to_vec()));
                continue;
            }
            let data = to_f32(view.dtype(), view.data()).ok_or_else(|| {
                Error::Unsupported(format!("{name}: unsupported dtype {:?}", view.dtype()))
            })?;
            out.floats.insert(name, (view.shape().to_vec(), data));
        }
    }
    Ok(out)
}

/// Little-endian F32, BF16 or F16 values as f32; `None` for other dtypes.
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;

    #[test]
    fn floats_decode_fp8_stays_bytes_and_skipped_names_are_left_out() {
        let dir = tempfile::tempdir().expect("tmp");
        let f32s: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf16s: Vec<u8> = [0.25f32, 3.0]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let codes = vec![0x38u8, 0xb8];
        let views = [
            ("a", Dtype::F32, &f32s[..]),
            ("b", Dtype::BF16, &bf16s[..]),
            ("c", Dtype::F8_E4M3, &codes[..]),
            ("visual.x", Dtype::F32, &f32s[..]),
        ];
        let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = views
            .iter()
            .map(|(n, d, b)| {
                let shape = vec![b.len() * 8 / d.bitsize()];
                let view = safetensors::tensor::TensorView::new(*d, shape, b).expect("view");
                ((*n).to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(tensors, None, &dir.path().join("model.safetensors"))
            .expect("write");
        std::fs::write(dir.path().join("notes.txt"), "not weights").expect("write");
        let files = safetensors_files(dir.path(), "model").expect("files");
        assert_eq!(files.len(), 1);
        assert!(safetensors_files(dir.path(), "reference").is_err());
        let t = read_safetensors(&files, |n| n.starts_with("visual.")).expect("read");
        assert_eq!(t.floats["a"], (vec![2], vec![1.5, -2.0]));
        assert_eq!(t.floats["b"], (vec![2], vec![0.25, 3.0]));
        assert_eq!(t.fp8["c"], (vec![2], codes.clone()));
        assert_eq!(t.dtypes["c"], "F8_E4M3");
        assert!(!t.floats.contains_key("visual.x") && !t.dtypes.contains_key("visual.x"));
    }
}
