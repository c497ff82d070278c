//! NVRTC compilation of the project's kernels to a CUBIN for the device's exact architecture,
//! cached on disk under a key of (source hash, architecture, NVRTC version), so a worker's
//! start-up pays the 30–50 ms compile once per machine and kernel change.

use crate::{Error, Result};
use cudarc::nvrtc::{result as nvrtc, sys};
use sha2::{Digest, Sha256};
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// The kernel source every backend instance compiles.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Where compiled kernels are kept: `$TANDEM_CACHE_DIR/kernels`, else
/// `$XDG_CACHE_HOME/tandem/kernels`, else `~/.cache/tandem/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("TANDEM_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("tandem")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/tandem")))?;
    Some(base.join("kernels"))
}

/// The folder holding `cuda_bf16.h` (NVRTC has no built-in copy): `$CUDA_HOME/include`, then
/// the usual install places.
fn include_dir() -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            candidates.push(PathBuf::from(v).join("include"));
        }
    }
    candidates.push("/usr/local/cuda/include".into());
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut more: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .flat_map(|p| [p.join("include"), p.join("targets/x86_64-linux/include")])
            .collect();
        more.sort();
        more.reverse();
        candidates.extend(more);
    }
    candidates.push("/usr/include".into());
    candidates
        .into_iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
        .ok_or_else(|| {
            Error::Compile(
                "cuda_bf16.h not found: set CUDA_HOME to the CUDA toolkit (its include/ folder)"
                    .into(),
            )
        })
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the library was found present by the caller.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// A CUBIN of `source` for compute capability `arch`, from the cache or compiled now.
pub fn cubin(source: &str, arch: (i32, i32)) -> Result<Vec<u8>> {
    let version = nvrtc_version();
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(format!("sm_{}{} nvrtc {}.{}", arch.0, arch.1, version.0, version.1).as_bytes());
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let cached = cache_dir().map(|d| d.join(format!("{key}-sm_{}{}.cubin", arch.0, arch.1)));
    if let Some(bin) = cached.as_deref().and_then(|p| std::fs::read(p).ok()) {
        tracing::debug!(key, "CUDA kernels from the cache");
        return Ok(bin);
    }
    let started = std::time::Instant::now();
    let bin = compile(source, arch)?;
    tracing::info!(
        key,
        arch = format!("sm_{}{}", arch.0, arch.1),
        ms = started.elapsed().as_millis() as u64,
        "compiled CUDA kernels"
    );
    if let Some(path) = cached {
        store(&path, &bin);
    }
    Ok(bin)
}

fn store(path: &Path, bin: &[u8]) {
    // A cache that cannot be written only costs the next start-up a compile.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, bin))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        tracing::debug!(path = %path.display(), error = %e, "kernel cache not written");
    }
}

/// Why NVRTC cannot be used here, if so (it compiles without a GPU: only the library and the
/// CUDA headers are needed).
pub fn nvrtc_unavailable() -> Option<String> {
    // SAFETY: only tries to open the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Some("libnvrtc not found".into());
    }
    include_dir().err().map(|e| e.to_string())
}

/// Compiles `source` for `arch` now, bypassing the cache.
pub fn compile(source: &str, arch: (i32, i32)) -> Result<Vec<u8>> {
    let include = include_dir()?;
    let src = CString::new(source).map_err(|_| Error::Compile("NUL in kernel source".into()))?;
    let name = CString::new("tandem_kernels.cu").map_err(|_| Error::Compile("name".into()))?;
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| Error::Compile(format!("create program: {e:?}")))?;
    let options = vec![
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        format!("--include-path={}", include.display()),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `prog` was just created and is destroyed once below; the buffers handed to
    // NVRTC are sized by its own size queries.
    let result = unsafe {
        match nvrtc::compile_program(prog, &options) {
            Ok(()) => {
                let mut size = 0usize;
                let status = sys::nvrtcGetCUBINSize(prog, &mut size);
                if status != sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(Error::Compile(format!("CUBIN size: {status:?}")))
                } else {
                    let mut bin = vec![0u8; size];
                    let status = sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast());
                    if status == sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(bin)
                    } else {
                        Err(Error::Compile(format!("CUBIN: {status:?}")))
                    }
                }
            }
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|raw| {
                        let bytes: Vec<u8> = raw
                            .iter()
                            .take_while(|&&c| c != 0)
                            .map(|&c| c as u8)
                            .collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(Error::Compile(format!("{e:?} ({options:?}):\n{log}")))
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    result
}
