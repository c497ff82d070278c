//! GGUF → Hugging Face layout.
//!
//! The output directory holds `model.safetensors` (f32), `config.json`,
//! `generation_config.json`, `tokenizer.json` and `tokenizer_config.json`. Everything is written
//! into a hidden sibling directory, synced, and renamed into place in one step, so a crashed or
//! interrupted import never leaves a directory at the target path: if the target exists, it is
//! complete.

mod hf_config;
mod meta;
mod tensors;
mod tokenizer;

pub use tensors::unpermute_rope_rows;

use crate::config::LlamaConfig;
use crate::gguf::Gguf;
use crate::{Error, Result};
use hf_config::Hparams;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use tokenizer::Vocab;

/// The files a complete import contains.
pub const FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

/// Progress of [`import_gguf`], reported after each tensor is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportProgress {
    /// Tensors written so far.
    pub done: usize,
    /// Tensors in total.
    pub total: usize,
    /// Hugging Face name of the tensor just written.
    pub tensor: String,
}

/// Converts the Llama GGUF at `gguf` into a Hugging Face checkpoint directory `out_dir`.
///
/// `out_dir` must not exist (or be an empty directory); its parent is created if needed.
/// `progress` is called once per tensor.
pub fn import_gguf(gguf: &Path, out_dir: &Path, progress: &dyn Fn(ImportProgress)) -> Result<()> {
    if is_occupied(out_dir)? {
        return Err(Error::AlreadyExists(out_dir.to_path_buf()));
    }
    let gguf = Gguf::open(gguf)?;
    let vocab = Vocab::from_gguf(&gguf)?;
    let hparams = Hparams::from_gguf(&gguf, &vocab)?;
    let tied = gguf.tensor("output.weight").is_none();

    let staging = Staging::new(out_dir)?;
    let dir = staging.path();
    write_json(
        &dir.join("config.json"),
        &hparams.config_json(&vocab, tied),
    )?;
    write_json(
        &dir.join("generation_config.json"),
        &hparams.generation_config_json(&vocab),
    )?;
    write_json(&dir.join("tokenizer.json"), &vocab.tokenizer_json())?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &vocab.tokenizer_config_json(hparams.context),
    )?;
    // The engine's own loader must accept what we wrote.
    LlamaConfig::from_dir(dir)?;

    let weights = dir.join("model.safetensors");
    tensors::write_safetensors(&gguf, hparams.heads, hparams.layers, &weights, progress)?;
    sync(&weights)?;
    staging.commit()
}

/// A hidden sibling directory of the target, removed on drop unless committed.
struct Staging {
    dir: tempfile::TempDir,
    target: PathBuf,
}

impl Staging {
    fn new(target: &Path) -> Result<Self> {
        let name = target
            .file_name()
            .ok_or_else(|| Error::Unsupported(format!("{} has no file name", target.display())))?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let io_err = |source| Error::Io {
            path: parent.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(parent).map_err(io_err)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!(".{}.importing-", name.to_string_lossy()))
            .tempdir_in(parent)
            .map_err(io_err)?;
        Ok(Self {
            dir,
            target: target.to_path_buf(),
        })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Renames the staging directory onto the target.
    fn commit(self) -> Result<()> {
        sync(self.dir.path())?;
        std::fs::rename(self.dir.path(), &self.target).map_err(|source| {
            // A racing import may have won; its result is as good as ours.
            if is_occupied(&self.target).unwrap_or(false) {
                Error::AlreadyExists(self.target.clone())
            } else {
                Error::Io {
                    path: self.target.clone(),
                    source,
                }
            }
        })?;
        // The rename succeeded: nothing is left to clean up.
        let _ = self.dir.keep();
        if let Some(parent) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            // Best effort: persist the rename itself. Not every platform can fsync a directory.
            let _ = sync(parent);
        }
        Ok(())
    }
}

/// Whether something other than an empty directory is at `path`.
fn is_occupied(path: &Path) -> Result<bool> {
    match std::fs::read_dir(path) {
        Ok(mut entries) => Ok(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(_) if path.exists() => Ok(true),
        Err(source) => Err(Error::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let io_err = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::create(path).map_err(io_err)?;
    let mut w = BufWriter::new(file);
    serde_json::to_writer_pretty(&mut w, value).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })?;
    w.write_all(b"\n").map_err(io_err)?;
    let file = w.into_inner().map_err(|e| io_err(e.into_error()))?;
    file.sync_all().map_err(io_err)
}

fn sync(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
}
