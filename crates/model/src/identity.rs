//! A checkpoint's identity: a hash of its `config.json` and of every safetensors header (tensor
//! names, dtypes, shapes and offsets), plus the dtype it is served in. Two workers agree on it
//! only when they serve the same architecture with the same weight layout, so a decode worker
//! can refuse KV computed by a different checkpoint instead of producing garbage. Headers,
//! not weight bytes, are hashed: it costs a few kilobytes of reading, not gigabytes (a
//! retrained checkpoint with an identical layout is not told apart; its config usually is).

use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// The identity of the checkpoint in `dir` served in `dtype` (e.g. `"f32"`).
pub fn model_identity(dir: &Path, dtype: &str) -> Result<u64> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let mut h = Sha256::new();
    let config = dir.join("config.json");
    h.update(std::fs::read(&config).map_err(io(&config))?);
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    for path in files {
        let mut f = std::fs::File::open(&path).map_err(io(&path))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(io(&path))?;
        let len = u64::from_le_bytes(len);
        if len > 100 << 20 {
            return Err(Error::Unsupported(format!(
                "{}: safetensors header of {len} bytes",
                path.display()
            )));
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).map_err(io(&path))?;
        if let Some(name) = path.file_name() {
            h.update(name.as_encoded_bytes());
        }
        h.update(&header);
    }
    h.update(dtype.as_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    Ok(u64::from_le_bytes(first))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_checkpoint(dir: &Path, config: &str, header: &str) {
        std::fs::write(dir.join("config.json"), config).expect("config");
        let mut st = (header.len() as u64).to_le_bytes().to_vec();
        st.extend_from_slice(header.as_bytes());
        std::fs::write(dir.join("model.safetensors"), st).expect("weights");
    }

    #[test]
    fn identity_follows_config_weights_layout_and_dtype() {
        let a = tempfile::tempdir().expect("tmp");
        let b = tempfile::tempdir().expect("tmp");
        let header = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        write_checkpoint(a.path(), r#"{"hidden_size": 8}"#, header);
        write_checkpoint(b.path(), r#"{"hidden_size": 8}"#, header);
        let id = |d: &Path, t: &str| model_identity(d, t).expect("identity");
        assert_eq!(
            id(a.path(), "f32"),
            id(b.path(), "f32"),
            "same checkpoint, same identity"
        );
        assert_ne!(
            id(a.path(), "f32"),
            id(a.path(), "bf16"),
            "dtype is part of it"
        );
        write_checkpoint(b.path(), r#"{"hidden_size": 9}"#, header);
        assert_ne!(
            id(a.path(), "f32"),
            id(b.path(), "f32"),
            "config is part of it"
        );
        write_checkpoint(
            b.path(),
            r#"{"hidden_size": 8}"#,
            r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}"#,
        );
        assert_ne!(
            id(a.path(), "f32"),
            id(b.path(), "f32"),
            "weight layout is part of it"
        );
        assert!(model_identity(&a.path().join("missing"), "f32").is_err());
    }
}
