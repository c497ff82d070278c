//! Where models live: a directory given on the command line, or a known name pulled into the
//! cache (`$TANDEM_HOME/models`, default `~/.cache/tandem/models`).

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The embedded default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// The model cache directory.
pub fn cache_dir() -> PathBuf {
    tandem_model::pull::default_cache_dir()
}

/// Pulls a known model into the cache (fast when already there).
pub fn pull(name: &str) -> Result<PathBuf> {
    tandem_model::pull::pull(name, &cache_dir()).with_context(|| format!("pulling {name}"))
}

/// A directory as given, or a known model name pulled on first use.
pub fn resolve(model: &str) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.join("config.json").exists() {
        return Ok(path.to_path_buf());
    }
    if tandem_model::pull::known_models().contains(&model) {
        return pull(model);
    }
    anyhow::bail!(
        "{model} is neither a model directory (no config.json) nor a known model ({})",
        tandem_model::pull::known_models().join(", ")
    )
}
