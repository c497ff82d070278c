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
    write_json(&dir.join("config.json"), &hparams.config_json(&vocab, tied))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::{gguf, Tensor};
    use crate::gguf::MetadataValue as V;
    use std::cell::RefCell;

    const HIDDEN: usize = 32;
    const HEADS: usize = 2;
    const KV_HEADS: usize = 1;
    const HEAD_DIM: usize = HIDDEN / HEADS;
    const TOKENS: [&str; 8] = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "a",
        "b",
        "ab",
        "Ġ",
        "1",
    ];

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// A `(rows, HIDDEN)` matrix with distinct entries.
    fn matrix(rows: usize, seed: f32) -> Vec<f32> {
        (0..rows * HIDDEN)
            .map(|i| seed + i as f32 * 0.001)
            .collect()
    }

    /// llama.cpp's forward rope permutation (what its converter applies to HF weights).
    fn permute(w: &[f32], rows: usize, heads: usize) -> Vec<f32> {
        let (hd, half) = (rows / heads, rows / heads / 2);
        let mut out = vec![0f32; w.len()];
        for h in 0..heads {
            for j in 0..2 {
                for k in 0..half {
                    let src = (h * hd + j * half + k) * HIDDEN;
                    let dst = (h * hd + 2 * k + j) * HIDDEN;
                    out[dst..dst + HIDDEN].copy_from_slice(&w[src..src + HIDDEN]);
                }
            }
        }
        out
    }

    fn tensor(name: &str, rows: usize, type_id: u32, data: Vec<u8>) -> Tensor<'_> {
        let dims = if rows == 0 {
            vec![HIDDEN as u64]
        } else {
            vec![HIDDEN as u64, rows as u64]
        };
        Tensor {
            name,
            dims,
            type_id,
            data,
        }
    }

    /// A one-layer Llama GGUF; `broken` gives `ffn_down` an encoding the import cannot read.
    fn tiny_llama(hf_q: &[f32], hf_k: &[f32], broken: bool) -> Vec<u8> {
        let strings = |v: &[&str]| V::Array(v.iter().map(|s| V::String(s.to_string())).collect());
        let metadata = [
            ("general.architecture", V::String("llama".into())),
            ("llama.block_count", V::U32(1)),
            ("llama.context_length", V::U32(64)),
            ("llama.embedding_length", V::U32(HIDDEN as u32)),
            ("llama.feed_forward_length", V::U32(HIDDEN as u32)),
            ("llama.attention.head_count", V::U32(HEADS as u32)),
            ("llama.attention.head_count_kv", V::U32(KV_HEADS as u32)),
            ("llama.rope.freq_base", V::F32(100_000.0)),
            ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("llama.rope.dimension_count", V::U32(HEAD_DIM as u32)),
            ("tokenizer.ggml.model", V::String("gpt2".into())),
            ("tokenizer.ggml.pre", V::String("smollm".into())),
            ("tokenizer.ggml.tokens", strings(&TOKENS)),
            (
                "tokenizer.ggml.token_type",
                V::Array([3, 3, 3, 1, 1, 1, 1, 1].map(V::I32).to_vec()),
            ),
            ("tokenizer.ggml.merges", strings(&["a b"])),
            ("tokenizer.ggml.bos_token_id", V::U32(1)),
            ("tokenizer.ggml.eos_token_id", V::U32(2)),
            ("tokenizer.ggml.unknown_token_id", V::U32(0)),
            ("tokenizer.ggml.padding_token_id", V::U32(2)),
            ("tokenizer.ggml.add_bos_token", V::Bool(false)),
            (
                "tokenizer.chat_template",
                V::String("{{ messages }}".into()),
            ),
        ];
        // Q8_0 embeddings: per row d = 0.5, q = row index.
        let embd: Vec<u8> = (0..TOKENS.len())
            .flat_map(|row| {
                let mut block = half::f16::from_f32(0.5).to_le_bytes().to_vec();
                block.extend([row as u8; 32]);
                block
            })
            .collect();
        // Q4_1 up projection: d = 1, m = 0.5, every nibble 3 → 3.5.
        let up: Vec<u8> = (0..HIDDEN)
            .flat_map(|_| {
                let mut block = half::f16::from_f32(1.0).to_le_bytes().to_vec();
                block.extend(half::f16::from_f32(0.5).to_le_bytes());
                block.extend([0x33u8; 16]);
                block
            })
            .collect();
        let ones = f32_bytes(&[1.0; HIDDEN]);
        let tensors = [
            tensor("token_embd.weight", TOKENS.len(), 8, embd),
            tensor("blk.0.attn_norm.weight", 0, 0, ones.clone()),
            tensor(
                "blk.0.ffn_down.weight",
                HIDDEN,
                if broken { 12 } else { 0 },
                f32_bytes(&matrix(HIDDEN, 5.0)),
            ),
            tensor(
                "blk.0.ffn_gate.weight",
                HIDDEN,
                0,
                f32_bytes(&matrix(HIDDEN, 4.0)),
            ),
            tensor("blk.0.ffn_up.weight", HIDDEN, 3, up),
            tensor("blk.0.ffn_norm.weight", 0, 0, ones.clone()),
            tensor(
                "blk.0.attn_k.weight",
                KV_HEADS * HEAD_DIM,
                0,
                f32_bytes(&permute(hf_k, KV_HEADS * HEAD_DIM, KV_HEADS)),
            ),
            tensor(
                "blk.0.attn_output.weight",
                HIDDEN,
                0,
                f32_bytes(&matrix(HIDDEN, 3.0)),
            ),
            tensor(
                "blk.0.attn_q.weight",
                HIDDEN,
                0,
                f32_bytes(&permute(hf_q, HIDDEN, HEADS)),
            ),
            tensor(
                "blk.0.attn_v.weight",
                KV_HEADS * HEAD_DIM,
                0,
                f32_bytes(&matrix(KV_HEADS * HEAD_DIM, 2.0)),
            ),
            tensor("output_norm.weight", 0, 0, ones),
        ];
        gguf(&metadata, &tensors, 32)
    }

    fn read_f32(st: &safetensors::SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
        let t = st.tensor(name).expect("tensor present");
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        let values = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (t.shape().to_vec(), values)
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn imports_a_tiny_llama() {
        let work = tempfile::tempdir().expect("temp dir");
        let hf_q = matrix(HIDDEN, 0.0);
        let hf_k = matrix(KV_HEADS * HEAD_DIM, 1.0);
        let src = work.path().join("tiny.gguf");
        std::fs::write(&src, tiny_llama(&hf_q, &hf_k, false)).expect("write gguf");
        let out = work.path().join("models").join("tiny");
        let seen = RefCell::new(Vec::new());
        import_gguf(&src, &out, &|p| seen.borrow_mut().push((p.done, p.total))).expect("import");

        assert_eq!(entries(&out), FILES);
        assert_eq!(entries(&work.path().join("models")), ["tiny"]);
        let seen = seen.into_inner();
        assert_eq!(seen.len(), 11);
        assert_eq!(seen.last(), Some(&(11, 11)));

        let bytes = std::fs::read(out.join("model.safetensors")).expect("read weights");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse weights");
        assert_eq!(st.len(), 11);
        assert!(st.tensor("lm_head.weight").is_err());
        let (shape, q) = read_f32(&st, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(shape, [HIDDEN, HIDDEN]);
        assert_eq!(q, hf_q, "q_proj rope rows restored");
        let (shape, k) = read_f32(&st, "model.layers.0.self_attn.k_proj.weight");
        assert_eq!(shape, [KV_HEADS * HEAD_DIM, HIDDEN]);
        assert_eq!(k, hf_k, "k_proj rope rows restored");
        let (_, v) = read_f32(&st, "model.layers.0.self_attn.v_proj.weight");
        assert_eq!(v, matrix(KV_HEADS * HEAD_DIM, 2.0), "v_proj untouched");
        let (shape, embed) = read_f32(&st, "model.embed_tokens.weight");
        assert_eq!(shape, [TOKENS.len(), HIDDEN]);
        assert_eq!(embed[3 * HIDDEN], 1.5);
        let (_, up) = read_f32(&st, "model.layers.0.mlp.up_proj.weight");
        assert!(up.iter().all(|&x| x == 3.5));
        let (shape, norm) = read_f32(&st, "model.norm.weight");
        assert_eq!((shape, norm), (vec![HIDDEN], vec![1.0; HIDDEN]));

        let cfg = LlamaConfig::from_dir(&out).expect("config.json");
        assert_eq!(cfg.num_attention_heads, HEADS);
        assert_eq!(cfg.num_key_value_heads, KV_HEADS);
        assert_eq!(cfg.head_dim(), HEAD_DIM);
        assert_eq!(cfg.vocab_size, TOKENS.len());
        assert!(cfg.tie_word_embeddings);

        let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).expect("tokenizer");
        let ids = tok.encode("ab<|im_end|>", false).expect("encode");
        assert_eq!(ids.get_ids(), [5, 2]);
    }

    #[test]
    fn refuses_to_overwrite() {
        let work = tempfile::tempdir().expect("temp dir");
        let src = work.path().join("tiny.gguf");
        let (q, k) = (matrix(HIDDEN, 0.0), matrix(HEAD_DIM, 1.0));
        std::fs::write(&src, tiny_llama(&q, &k, false)).expect("write gguf");
        let out = work.path().join("tiny");
        std::fs::create_dir(&out).expect("mkdir");
        std::fs::write(out.join("keep.txt"), b"mine").expect("write");
        assert!(matches!(
            import_gguf(&src, &out, &|_| {}),
            Err(Error::AlreadyExists(_))
        ));
        assert_eq!(entries(&out), ["keep.txt"]);
    }

    #[test]
    fn failed_import_leaves_nothing_behind() {
        let work = tempfile::tempdir().expect("temp dir");
        let src = work.path().join("tiny.gguf");
        let (q, k) = (matrix(HIDDEN, 0.0), matrix(HEAD_DIM, 1.0));
        std::fs::write(&src, tiny_llama(&q, &k, true)).expect("write gguf");
        let models = work.path().join("models");
        let err = import_gguf(&src, &models.join("tiny"), &|_| {}).expect_err("Q4_K unsupported");
        assert!(
            err.to_string().contains("blk.0.ffn_down.weight"),
            "error names the tensor: {err}"
        );
        // Neither the target nor the staging directory survives.
        assert_eq!(entries(&models), Vec::<String>::new());
    }
}
