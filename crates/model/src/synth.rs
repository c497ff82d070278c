//! Random checkpoints for tests and benchmarks: Llama-family shapes ([`synth_llama`]) and the
//! `kda_hybrid` family (Kimi-Linear layout: KDA + MLA + MoE) for
//! tests and benchmarks, written exactly as a real checkpoint would be: `config.json` with
//! `linear_attn_config`, MLA and MoE fields, and `model.safetensors` in BF16 — or, with
//! `fp8`, the block-FP8 variant (128×128 tiles, `weight_scale_inv`, a `quantization_config`
//! whose `ignored_layers` names the KDA projections, which stay BF16).
//!
//! Values are a pure function of `(seed, tensor name)`, so a preset is reproducible anywhere.

use crate::{fp8, Error, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Shape of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct Preset {
    /// Name (`tiny`, `medium`, `1b`).
    pub name: &'static str,
    /// Vocabulary.
    pub vocab: usize,
    /// Model width.
    pub hidden: usize,
    /// Layers; every fourth (1-based multiple of 4) and the last are MLA, the rest KDA.
    pub layers: usize,
    /// KDA heads and head width.
    pub kda_heads: usize,
    /// KDA head width.
    pub kda_head_dim: usize,
    /// MLA heads.
    pub mla_heads: usize,
    /// MLA latent rank.
    pub kv_lora_rank: usize,
    /// MLA no-rope query/key width.
    pub qk_nope: usize,
    /// MLA rope width.
    pub qk_rope: usize,
    /// MLA value width.
    pub v_head: usize,
    /// Dense MLP width (first layers).
    pub intermediate: usize,
    /// Routed experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Expert MLP width.
    pub moe_intermediate: usize,
}

/// The presets `tandem model synth` knows.
pub fn presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "tiny",
            vocab: 512,
            hidden: 256,
            layers: 5,
            kda_heads: 8,
            kda_head_dim: 32,
            mla_heads: 8,
            kv_lora_rank: 64,
            qk_nope: 16,
            qk_rope: 16,
            v_head: 16,
            intermediate: 256,
            experts: 8,
            top_k: 2,
            moe_intermediate: 32,
        },
        Preset {
            name: "medium",
            vocab: 32_000,
            hidden: 1024,
            layers: 12,
            kda_heads: 16,
            kda_head_dim: 64,
            mla_heads: 16,
            kv_lora_rank: 256,
            qk_nope: 64,
            qk_rope: 32,
            v_head: 64,
            intermediate: 2816,
            experts: 16,
            top_k: 4,
            moe_intermediate: 256,
        },
        Preset {
            name: "1b",
            vocab: 32_000,
            hidden: 2048,
            layers: 16,
            kda_heads: 32,
            kda_head_dim: 64,
            mla_heads: 32,
            kv_lora_rank: 512,
            qk_nope: 64,
            qk_rope: 32,
            v_head: 64,
            intermediate: 5632,
            experts: 16,
            top_k: 4,
            moe_intermediate: 384,
        },
        // Kimi-Linear-48B-A3B's dimensions (its published config.json); its MLA layers sit at
        // 1-based multiples of 4 and the last, this preset's at 2, 6, 10, … and the last (the
        // same 3:1 mix). ~48B parameters at 27 layers: `--layers N` writes fewer, for per-layer
        // figures on one GPU.
        Preset {
            name: "48b",
            vocab: 163_840,
            hidden: 2304,
            layers: 27,
            kda_heads: 32,
            kda_head_dim: 128,
            mla_heads: 32,
            kv_lora_rank: 512,
            qk_nope: 128,
            qk_rope: 64,
            v_head: 128,
            intermediate: 9216,
            experts: 256,
            top_k: 8,
            moe_intermediate: 1024,
        },
    ]
}

/// Whether 0-based layer `i` of `n` is an MLA (full attention) layer.
fn is_mla(i: usize, n: usize) -> bool {
    (i + 1) % 4 == 2 || i + 1 == n
}

fn config_json(p: &Preset, fp8_ignored: Option<&[String]>) -> Value {
    let kda: Vec<usize> = (0..p.layers)
        .filter(|&i| !is_mla(i, p.layers))
        .map(|i| i + 1)
        .collect();
    let full: Vec<usize> = (0..p.layers)
        .filter(|&i| is_mla(i, p.layers))
        .map(|i| i + 1)
        .collect();
    // transformers' own names for the same layout (0-based), beside the original keys, so its
    // `kimi_linear` reads the layer mix as the engine does.
    let layer_types: Vec<&str> = (0..p.layers)
        .map(|i| {
            if is_mla(i, p.layers) {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mlp_layer_types: Vec<&str> = (0..p.layers)
        .map(|i| if i == 0 { "dense" } else { "sparse" })
        .collect();
    let mut c = json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": p.vocab, "hidden_size": p.hidden, "num_hidden_layers": p.layers,
        "intermediate_size": p.intermediate, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "model_max_length": 4096, "max_position_embeddings": 4096,
        "num_attention_heads": p.mla_heads, "num_key_value_heads": p.mla_heads,
        "q_lora_rank": null, "kv_lora_rank": p.kv_lora_rank,
        "qk_nope_head_dim": p.qk_nope, "qk_rope_head_dim": p.qk_rope,
        "qk_head_dim": p.qk_nope + p.qk_rope, "v_head_dim": p.v_head, "head_dim": p.qk_rope,
        "mla_use_nope": true, "attention_bias": false,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full,
            "num_heads": p.kda_heads, "head_dim": p.kda_head_dim, "short_conv_kernel_size": 4},
        "num_experts": p.experts, "num_experts_per_token": p.top_k, "num_shared_experts": 1,
        "moe_intermediate_size": p.moe_intermediate, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "moe_renormalize": true, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
        "dtype": "bfloat16",
    });
    c["layer_types"] = json!(layer_types);
    c["mlp_layer_types"] = json!(mlp_layer_types);
    c["linear_num_heads"] = json!(p.kda_heads);
    c["linear_head_dim"] = json!(p.kda_head_dim);
    c["linear_conv_kernel_dim"] = json!(4);
    if let Some(ignored) = fp8_ignored {
        c["quantization_config"] = json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "ignored_layers": ignored,
        });
    }
    c
}

/// Every tensor of the preset: name, shape, and how to initialise it.
fn tensor_specs(p: &Preset) -> Vec<(String, Vec<usize>, Init)> {
    let (h, kp) = (p.hidden, p.kda_heads * p.kda_head_dim);
    let mut t: Vec<(String, Vec<usize>, Init)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![p.vocab, h],
            Init::Uniform(1.0),
        ),
        ("model.norm.weight".into(), vec![h], Init::Norm),
        ("lm_head.weight".into(), vec![p.vocab, h], Init::Linear),
    ];
    for i in 0..p.layers {
        let l = format!("model.layers.{i}");
        t.push((format!("{l}.input_layernorm.weight"), vec![h], Init::Norm));
        t.push((
            format!("{l}.post_attention_layernorm.weight"),
            vec![h],
            Init::Norm,
        ));
        let a = format!("{l}.self_attn");
        if is_mla(i, p.layers) {
            let qk = p.qk_nope + p.qk_rope;
            t.push((
                format!("{a}.q_proj.weight"),
                vec![p.mla_heads * qk, h],
                Init::Linear,
            ));
            t.push((
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![p.kv_lora_rank + p.qk_rope, h],
                Init::Linear,
            ));
            t.push((
                format!("{a}.kv_a_layernorm.weight"),
                vec![p.kv_lora_rank],
                Init::Norm,
            ));
            t.push((
                format!("{a}.kv_b_proj.weight"),
                vec![p.mla_heads * (p.qk_nope + p.v_head), p.kv_lora_rank],
                Init::Linear,
            ));
            t.push((
                format!("{a}.o_proj.weight"),
                vec![h, p.mla_heads * p.v_head],
                Init::Linear,
            ));
        } else {
            for n in ["q", "k", "v"] {
                t.push((format!("{a}.{n}_proj.weight"), vec![kp, h], Init::Linear));
                t.push((
                    format!("{a}.{n}_conv1d.weight"),
                    vec![kp, 1, 4],
                    Init::Uniform(0.5),
                ));
            }
            t.push((
                format!("{a}.b_proj.weight"),
                vec![p.kda_heads, h],
                Init::Linear,
            ));
            t.push((
                format!("{a}.f_a_proj.weight"),
                vec![p.kda_head_dim, h],
                Init::Linear,
            ));
            t.push((
                format!("{a}.f_b_proj.weight"),
                vec![kp, p.kda_head_dim],
                Init::Linear,
            ));
            t.push((
                format!("{a}.g_a_proj.weight"),
                vec![p.kda_head_dim, h],
                Init::Linear,
            ));
            t.push((
                format!("{a}.g_b_proj.weight"),
                vec![kp, p.kda_head_dim],
                Init::Linear,
            ));
            t.push((format!("{a}.A_log"), vec![1, 1, p.kda_heads, 1], Init::ALog));
            t.push((format!("{a}.dt_bias"), vec![kp], Init::DtBias));
            t.push((
                format!("{a}.o_norm.weight"),
                vec![p.kda_head_dim],
                Init::Norm,
            ));
            t.push((format!("{a}.o_proj.weight"), vec![h, kp], Init::Linear));
        }
        if i == 0 {
            let m = format!("{l}.mlp");
            t.push((
                format!("{m}.gate_proj.weight"),
                vec![p.intermediate, h],
                Init::Linear,
            ));
            t.push((
                format!("{m}.up_proj.weight"),
                vec![p.intermediate, h],
                Init::Linear,
            ));
            t.push((
                format!("{m}.down_proj.weight"),
                vec![h, p.intermediate],
                Init::Linear,
            ));
        } else {
            let m = format!("{l}.block_sparse_moe");
            t.push((format!("{m}.gate.weight"), vec![p.experts, h], Init::Linear));
            t.push((
                format!("{m}.gate.e_score_correction_bias"),
                vec![p.experts],
                Init::Uniform(0.05),
            ));
            for e in 0..p.experts {
                t.push((
                    format!("{m}.experts.{e}.w1.weight"),
                    vec![p.moe_intermediate, h],
                    Init::Linear,
                ));
                t.push((
                    format!("{m}.experts.{e}.w2.weight"),
                    vec![h, p.moe_intermediate],
                    Init::Linear,
                ));
                t.push((
                    format!("{m}.experts.{e}.w3.weight"),
                    vec![p.moe_intermediate, h],
                    Init::Linear,
                ));
            }
            let s = format!("{m}.shared_experts");
            t.push((
                format!("{s}.gate_proj.weight"),
                vec![p.moe_intermediate, h],
                Init::Linear,
            ));
            t.push((
                format!("{s}.up_proj.weight"),
                vec![p.moe_intermediate, h],
                Init::Linear,
            ));
            t.push((
                format!("{s}.down_proj.weight"),
                vec![h, p.moe_intermediate],
                Init::Linear,
            ));
        }
    }
    t
}

#[derive(Clone, Copy, Debug)]
enum Init {
    /// Uniform with std 1/sqrt(fan_in).
    Linear,
    /// 1 + 0.1·u.
    Norm,
    /// Uniform in ±a.
    Uniform(f32),
    /// ln of uniform(1, 16).
    ALog,
    /// softplus⁻¹ of a log-uniform step in [1e-3, 1e-1], so decays are slow and the KDA
    /// state carries information across many tokens (as in trained models).
    DtBias,
}

/// splitmix64 stream seeded by `(seed, name)`.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, name: &str) -> Self {
        let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        Self(h)
    }
    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn values(name: &str, shape: &[usize], init: Init, seed: u64) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let mut rng = Rng::new(seed, name);
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    (0..n)
        .map(|_| {
            let u = rng.next();
            let v = match init {
                Init::Linear => u * 3f32.sqrt() / fan_in.sqrt(),
                Init::Norm => 1.0 + 0.1 * u,
                Init::Uniform(a) => a * u,
                Init::ALog => (8.5 + 7.5 * u).ln(),
                Init::DtBias => {
                    let dt = (1e-3f32.ln() + (u + 1.0) / 2.0 * (1e-1f32.ln() - 1e-3f32.ln())).exp();
                    dt.exp_m1().ln()
                }
            };
            // Exactly representable in BF16, like the public references.
            half::bf16::from_f32(v).to_f32()
        })
        .collect()
}

/// KDA projections of a layer prefix (`model.layers.N.self_attn`): kept BF16 in FP8 files.
fn kda_projection_names(p: &Preset) -> Vec<String> {
    let mut out = Vec::new();
    for i in (0..p.layers).filter(|&i| !is_mla(i, p.layers)) {
        for n in [
            "q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
        ] {
            out.push(format!("model.layers.{i}.self_attn.{n}"));
        }
    }
    out
}

/// Writes preset `preset` into `out` (created; must be empty or absent).
pub fn synth_kda_hybrid(preset: &str, out: &Path, fp8: bool, seed: u64) -> Result<()> {
    synth_kda_hybrid_layers(preset, out, fp8, seed, None)
}

/// [`synth_kda_hybrid`] with `layers` decoder layers instead of the preset's (the same
/// per-layer dimensions; at least 2, so one dense and one MoE layer).
pub fn synth_kda_hybrid_layers(
    preset: &str,
    out: &Path,
    fp8: bool,
    seed: u64,
    layers: Option<usize>,
) -> Result<()> {
    let mut p = presets()
        .into_iter()
        .find(|p| p.name == preset)
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "unknown preset {preset:?} (known: {})",
                presets()
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    if let Some(n) = layers {
        if n < 2 {
            return Err(Error::Unsupported(format!(
                "--layers {n}: a KDA-hybrid checkpoint needs at least 2 (a dense and an MoE layer)"
            )));
        }
        p.layers = n;
    }
    let io = |path: &Path, source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let ignored = kda_projection_names(&p);
    let specs = tensor_specs(&p).into_iter().map(|(name, shape, init)| {
        let module = name.strip_suffix(".weight").unwrap_or(&name);
        let quantize = fp8
            && shape.len() == 2
            && name.ends_with(".weight")
            && !name.contains("norm")
            && !name.contains("embed_tokens")
            && !name.starts_with("lm_head")
            && !name.ends_with("gate.weight")
            && !ignored.iter().any(|i| i == module);
        (name, shape, init, quantize)
    });
    let bytes = weights(specs.collect(), seed);
    let config = config_json(&p, fp8.then_some(ignored.as_slice()));
    write_checkpoint(out, &bytes, &config)
}

/// The tensors of `specs` (name, shape, initialisation, whether block-FP8), each drawn from its
/// own seeded stream, on every core (a 48B-shaped layer is gigabytes): the same bytes
/// whatever the core count.
fn weights(specs: Vec<(String, Vec<usize>, Init, bool)>, seed: u64) -> Weights {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let specs = &specs;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.min(specs.len()).max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut part = Weights::new();
                    while let Some((name, shape, init, quantize)) =
                        specs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                    {
                        let v = values(name, shape, *init, seed);
                        insert_weight(&mut part, name.clone(), shape.clone(), &v, *quantize);
                    }
                    part
                })
            })
            .collect();
        let mut all = Weights::new();
        for w in workers {
            all.extend(w.join().expect("a synthesis thread panicked"));
        }
        all
    })
}

/// Tensors by name: dtype, shape and little-endian bytes.
type Weights = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// Adds tensor `name` of `values`: as block-FP8 codes plus its `weight_scale_inv` (128×128
/// tiles) when `quantize`, else as BF16.
fn insert_weight(
    bytes: &mut Weights,
    name: String,
    shape: Vec<usize>,
    values: &[f32],
    quantize: bool,
) {
    if quantize {
        let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        let (codes, scales) = fp8::quantize_blocks(values, shape[0], shape[1], 128);
        let sshape = vec![shape[0].div_ceil(128), shape[1].div_ceil(128)];
        bytes.insert(
            format!("{module}.weight_scale_inv"),
            (
                Dtype::F32,
                sshape,
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
        );
        bytes.insert(name, (Dtype::F8_E4M3, shape, codes));
    } else {
        let data = values
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        bytes.insert(name, (Dtype::BF16, shape, data));
    }
}

/// Writes `model.safetensors`, `config.json` and a `generation_config.json` into `out`.
fn write_checkpoint(out: &Path, bytes: &Weights, config: &Value) -> Result<()> {
    let io = |path: &Path, source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, (d, s, b))| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Unsupported(format!("{n}: {e}")))
        })
        .collect::<Result<_>>()?;
    let st = out.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st)
        .map_err(|e| Error::Unsupported(format!("writing {}: {e}", st.display())))?;
    let cfg_path = out.join("config.json");
    let text = serde_json::to_string_pretty(config).map_err(|source| Error::Json {
        path: cfg_path.clone(),
        source,
    })?;
    std::fs::write(&cfg_path, text).map_err(|e| io(&cfg_path, e))?;
    let gen = out.join("generation_config.json");
    std::fs::write(
        &gen,
        r#"{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}"#,
    )
    .map_err(|e| io(&gen, e))?;
    Ok(())
}

/// Shape of a synthetic Llama-family checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaPreset {
    /// Name (`tiny`, `smollm2`, `1b`, `8b`).
    pub name: &'static str,
    /// Vocabulary.
    pub vocab: usize,
    /// Model width.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Whether the LM head is the embedding table.
    pub tied: bool,
    /// RoPE base.
    pub rope_theta: f64,
    /// Longest context.
    pub max_positions: usize,
}

/// The Llama presets: a test size and the shapes of SmolLM2-135M, Llama-3.2-1B and
/// Llama-3.1-8B (plain RoPE: the real 1B/8B checkpoints' long-context RoPE scaling is left out).
pub fn llama_presets() -> Vec<LlamaPreset> {
    vec![
        LlamaPreset {
            name: "tiny",
            vocab: 512,
            hidden: 256,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 512,
            tied: false,
            rope_theta: 10_000.0,
            max_positions: 2048,
        },
        LlamaPreset {
            name: "smollm2",
            vocab: 49_152,
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            intermediate: 1536,
            tied: true,
            rope_theta: 100_000.0,
            max_positions: 8192,
        },
        LlamaPreset {
            name: "1b",
            vocab: 128_256,
            hidden: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            intermediate: 8192,
            tied: true,
            rope_theta: 500_000.0,
            max_positions: 131_072,
        },
        LlamaPreset {
            name: "8b",
            vocab: 128_256,
            hidden: 4096,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            intermediate: 14_336,
            tied: false,
            rope_theta: 500_000.0,
            max_positions: 131_072,
        },
    ]
}

/// Writes Llama preset `preset` into `out` in BF16 (a `LlamaForCausalLM` checkpoint that
/// transformers loads as it is); with `fp8`, the projections are block-FP8 (128×128 tiles
/// with `weight_scale_inv`, a `quantization_config`), embeddings, norms and LM head BF16.
pub fn synth_llama(preset: &str, out: &Path, seed: u64) -> Result<()> {
    synth_llama_with(preset, out, seed, false)
}

/// [`synth_llama`] with the choice of block-FP8 projections.
pub fn synth_llama_with(preset: &str, out: &Path, seed: u64, fp8: bool) -> Result<()> {
    let p = llama_presets()
        .into_iter()
        .find(|p| p.name == preset)
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "unknown llama preset {preset:?} (known: {})",
                llama_presets()
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    let (h, hd) = (p.hidden, p.hidden / p.heads);
    let mut specs: Vec<(String, Vec<usize>, Init)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![p.vocab, h],
            Init::Uniform(1.0),
        ),
        ("model.norm.weight".into(), vec![h], Init::Norm),
    ];
    if !p.tied {
        specs.push(("lm_head.weight".into(), vec![p.vocab, h], Init::Linear));
    }
    for i in 0..p.layers {
        let l = format!("model.layers.{i}");
        let a = format!("{l}.self_attn");
        specs.extend([
            (format!("{l}.input_layernorm.weight"), vec![h], Init::Norm),
            (
                format!("{l}.post_attention_layernorm.weight"),
                vec![h],
                Init::Norm,
            ),
            (
                format!("{a}.q_proj.weight"),
                vec![p.heads * hd, h],
                Init::Linear,
            ),
            (
                format!("{a}.k_proj.weight"),
                vec![p.kv_heads * hd, h],
                Init::Linear,
            ),
            (
                format!("{a}.v_proj.weight"),
                vec![p.kv_heads * hd, h],
                Init::Linear,
            ),
            (
                format!("{a}.o_proj.weight"),
                vec![h, p.heads * hd],
                Init::Linear,
            ),
            (
                format!("{l}.mlp.gate_proj.weight"),
                vec![p.intermediate, h],
                Init::Linear,
            ),
            (
                format!("{l}.mlp.up_proj.weight"),
                vec![p.intermediate, h],
                Init::Linear,
            ),
            (
                format!("{l}.mlp.down_proj.weight"),
                vec![h, p.intermediate],
                Init::Linear,
            ),
        ]);
    }
    std::fs::create_dir_all(out).map_err(|source| Error::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let specs = specs.into_iter().map(|(name, shape, init)| {
        let projection = name.contains("_proj.");
        (name, shape, init, fp8 && projection)
    });
    let bytes = weights(specs.collect(), seed);
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": p.vocab, "hidden_size": h, "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads, "num_key_value_heads": p.kv_heads, "head_dim": hd,
        "intermediate_size": p.intermediate, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": p.rope_theta, "max_position_embeddings": p.max_positions,
        "tie_word_embeddings": p.tied, "attention_bias": false, "mlp_bias": false,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    });
    if fp8 {
        config["quantization_config"] = json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"],
        });
    }
    write_checkpoint(out, &bytes, &config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(path: &Path) -> serde_json::Map<String, Value> {
        let bytes = std::fs::read(path).expect("read safetensors");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        serde_json::from_slice(&bytes[8..8 + n]).expect("header json")
    }

    #[test]
    fn the_48b_preset_has_kimi_linears_dimensions_and_layers_can_be_fewer() {
        let p = presets()
            .into_iter()
            .find(|p| p.name == "48b")
            .expect("48b preset");
        let c = config_json(&p, None);
        assert_eq!(c["hidden_size"], 2304);
        assert_eq!(c["num_hidden_layers"], 27);
        assert_eq!(c["num_experts"], 256);
        assert_eq!(c["num_experts_per_token"], 8);
        assert_eq!(c["moe_intermediate_size"], 1024);
        assert_eq!(c["linear_attn_config"]["num_heads"], 32);
        assert_eq!(c["linear_attn_config"]["head_dim"], 128);
        let kda = c["linear_attn_config"]["kda_layers"]
            .as_array()
            .map_or(0, Vec::len);
        let full = c["linear_attn_config"]["full_attn_layers"]
            .as_array()
            .map_or(0, Vec::len);
        assert_eq!((kda, full), (19, 8), "a 3:1 mix over 27 layers");
        // transformers' 0-based names say the same as the 1-based original lists.
        let types = c["layer_types"].as_array().expect("layer_types");
        for (i, t) in types.iter().enumerate() {
            let full_listed = c["linear_attn_config"]["full_attn_layers"]
                .as_array()
                .is_some_and(|l| l.contains(&json!(i + 1)));
            assert_eq!(t == "full_attention", full_listed, "layer {i}: {t}");
        }
        assert_eq!(c["mlp_layer_types"][0], "dense");
        assert_eq!(c["mlp_layer_types"][1], "sparse");
        assert_eq!(c["linear_num_heads"], 32);
        // Every parameter: ~48B, as the name says.
        let params: usize = tensor_specs(&p)
            .iter()
            .map(|(_, shape, _)| shape.iter().product::<usize>())
            .sum();
        assert!(
            (45e9..51e9).contains(&(params as f64)),
            "{params} parameters"
        );
        // Fewer layers: the tiny preset with 3, and a refusal below 2 (before writing).
        let dir = tempfile::tempdir().expect("tmp");
        synth_kda_hybrid_layers("tiny", dir.path(), false, 1, Some(3)).expect("synth");
        let h = header(&dir.path().join("model.safetensors"));
        assert!(h.contains_key("model.layers.2.input_layernorm.weight"));
        assert!(!h.contains_key("model.layers.3.input_layernorm.weight"));
        let empty = tempfile::tempdir().expect("tmp");
        let err = synth_kda_hybrid_layers("48b", &empty.path().join("x"), false, 1, Some(1))
            .expect_err("one layer");
        assert!(err.to_string().contains("at least 2"), "{err}");
        assert!(!empty.path().join("x").exists(), "nothing written");
    }

    #[test]
    fn tiny_preset_is_reproducible_and_complete() {
        let (a, b) = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        synth_kda_hybrid("tiny", a.path(), false, 7).expect("synth");
        synth_kda_hybrid("tiny", b.path(), false, 7).expect("synth");
        let fa = std::fs::read(a.path().join("model.safetensors")).expect("read");
        let fb = std::fs::read(b.path().join("model.safetensors")).expect("read");
        assert_eq!(fa, fb, "same seed, same bytes");
        let h = header(&a.path().join("model.safetensors"));
        assert!(h.contains_key("model.layers.0.self_attn.f_b_proj.weight"));
        assert!(
            h.contains_key("model.layers.1.self_attn.kv_b_proj.weight"),
            "layer 1 is MLA"
        );
        assert!(h.contains_key("model.layers.4.block_sparse_moe.experts.7.w2.weight"));
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(a.path().join("config.json")).expect("cfg"),
        )
        .expect("json");
        assert_eq!(cfg["linear_attn_config"]["kda_layers"], json!([1, 3, 4]));
        assert_eq!(cfg["linear_attn_config"]["full_attn_layers"], json!([2, 5]));
        assert!(synth_kda_hybrid("huge", a.path(), false, 7).is_err());
    }

    #[test]
    fn fp8_variant_keeps_kda_projections_bf16_and_lists_them() {
        let dir = tempfile::tempdir().expect("tmp");
        synth_kda_hybrid("tiny", dir.path(), true, 7).expect("synth");
        let h = header(&dir.path().join("model.safetensors"));
        let dtype = |n: &str| h[n]["dtype"].as_str().expect("dtype").to_string();
        assert_eq!(dtype("model.layers.0.self_attn.q_proj.weight"), "BF16");
        assert_eq!(dtype("model.layers.0.self_attn.g_b_proj.weight"), "BF16");
        assert_eq!(
            dtype("model.layers.1.self_attn.kv_b_proj.weight"),
            "F8_E4M3"
        );
        assert_eq!(
            dtype("model.layers.1.block_sparse_moe.experts.0.w1.weight"),
            "F8_E4M3"
        );
        assert_eq!(
            h["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale_inv"]["shape"],
            json!([1, 2])
        );
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("config.json")).expect("cfg"),
        )
        .expect("json");
        let q = &cfg["quantization_config"];
        assert_eq!(q["quant_method"], "fp8");
        assert_eq!(q["weight_block_size"], json!([128, 128]));
        let ignored: Vec<&str> = q["ignored_layers"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(ignored.contains(&"model.layers.0.self_attn.f_a_proj"));
        assert!(
            !ignored.iter().any(|n| n.contains("layers.1.")),
            "MLA layer 1 is quantised"
        );
    }
}
