//! Helpers shared by tandem's tests: where the reference model and the `shared/` reference
//! data are. Tests use the same model cache as `make run`, so the model is imported once per
//! machine.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::OnceLock;

/// The model cache (`$TANDEM_HOME/models`, default `~/.cache/tandem/models`).
pub fn cache_dir() -> PathBuf {
    tandem_model::pull::default_cache_dir()
}

/// SmolLM2-135M-Instruct in Hugging Face layout, pulled and imported on first use.
pub fn smollm2_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("TANDEM_TEST_MODEL_DIR") {
            return PathBuf::from(dir);
        }
        tandem_model::pull::pull("smollm2-135m-instruct", &cache_dir())
            .expect("pulling smollm2-135m-instruct for tests")
    })
    .clone()
}

/// The `shared/` folder next to the repository (reference outputs, specs).
pub fn shared_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TANDEM_SHARED_DIR") {
        return PathBuf::from(dir);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Next to the checkout (the usual layout), inside it, or where the team keeps it.
    for candidate in [
        root.join("../shared"),
        root.join("shared"),
        PathBuf::from("/work/shared"),
    ] {
        if candidate.join("reference").exists() {
            return candidate;
        }
    }
    panic!("shared/ reference folder not found next to the repository; set TANDEM_SHARED_DIR")
}

/// A JSON list of token ids (as the reference files write them).
///
/// # Panics
/// If `v` is not a list of non-negative integers.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
        .collect()
}

/// `shared/reference/smollm2/greedy.json`, parsed.
pub fn smollm2_greedy_reference() -> serde_json::Value {
    let path = shared_dir().join("reference/smollm2/greedy.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The largest absolute elementwise difference of two equally long slices.
///
/// # Panics
/// If the lengths differ.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Deterministic pseudo-random numbers in `[-1, 1)` (xorshift64 from `seed`).
pub fn noise(seed: u64, len: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A real etcd on loopback for tests.
pub use tandem_discovery::local::LocalEtcd as Etcd;
/// The files of an etcd serving TLS to clients with certificates ([`Etcd::start_tls`]).
pub use tandem_discovery::local::ServerTls as EtcdServerTls;
