//! The KDA hybrid models against the public tiny references (shared/reference/kimi_tiny and
//! glm5_tiny, transformers f32 on CPU): logits at every position, greedy decoding from the
//! prefill state, the per-layer state after prefill, and (GLM) the mHC streams per layer.

use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::PathBuf;
use tandem_engine::models::kda_hybrid::{KdaHybridModel, KdaHybridState};
use tandem_testkit::max_abs_diff;

/// Logits and greedy steps must be this close to transformers (f32; the references' own
/// independent implementation agrees within 4e-5).
const LOGIT_TOL: f32 = 1e-3;
const STATE_TOL: f32 = 1e-4;

struct Reference {
    dir: PathBuf,
    json: serde_json::Value,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl Reference {
    fn load(name: &str) -> Self {
        let dir = tandem_testkit::shared_dir().join("reference").join(name);
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"),
        )
        .expect("reference.json parses");
        let bytes =
            std::fs::read(dir.join("reference_tensors.safetensors")).expect("reference tensors");
        let st = SafeTensors::deserialize(&bytes).expect("reference tensors parse");
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
                let data = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                (name, (view.shape().to_vec(), data))
            })
            .collect();
        Self { dir, json, tensors }
    }

    fn tensor(&self, name: &str) -> &[f32] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("reference tensor {name}"))
            .1
    }

    fn sequences(&self) -> Vec<Sequence> {
        self.json["sequences"]
            .as_array()
            .expect("sequences")
            .iter()
            .map(|s| Sequence {
                name: s["name"].as_str().expect("name").to_owned(),
                ids: ids(&s["input_ids"]),
                greedy: ids(&s["greedy"]["generated_ids"]),
            })
            .collect()
    }
}

struct Sequence {
    name: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
}

use tandem_testkit::ids;

fn argmax(v: &[f32]) -> u32 {
    let best = v
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .expect("non-empty logits")
        .0;
    u32::try_from(best).expect("vocab fits u32")
}

/// Full-forward logits, greedy decoding from the prefill state and its step logits.
fn check_logits_and_greedy(reference: &Reference, model: &KdaHybridModel) {
    let vocab = model.config().vocab_size;
    for seq in reference.sequences() {
        let logits = model.forward_full(&seq.ids);
        let want = reference.tensor(&format!("{}.logits", seq.name));
        let diff = max_abs_diff(&logits, want);
        eprintln!("{}: full-forward logits max |diff| {diff:.2e}", seq.name);
        assert!(diff <= LOGIT_TOL, "{}: logits differ by {diff}", seq.name);

        let mut state = model.new_state();
        let mut step = model.prefill(&seq.ids, &mut state);
        let d = max_abs_diff(&step, &logits[(seq.ids.len() - 1) * vocab..]);
        assert!(
            d <= 1e-5,
            "{}: prefill vs full forward differ by {d}",
            seq.name
        );
        let want_steps = reference.tensor(&format!("{}.greedy_step_logits", seq.name));
        let mut generated = Vec::new();
        let mut step_diff = 0.0f32;
        for (j, want_step) in want_steps.chunks_exact(vocab).enumerate() {
            step_diff = step_diff.max(max_abs_diff(&step, want_step));
            let next = argmax(&step);
            generated.push(next);
            if j + 1 < seq.greedy.len() {
                step = model.decode_step(next, &mut state);
            }
        }
        eprintln!(
            "{}: greedy step logits max |diff| {step_diff:.2e}",
            seq.name
        );
        assert!(
            step_diff <= LOGIT_TOL,
            "{}: step logits differ by {step_diff}",
            seq.name
        );
        assert_eq!(generated, seq.greedy, "{}: greedy ids", seq.name);
        assert_eq!(state.tokens, seq.ids.len() + seq.greedy.len() - 1);
    }
}

/// The state right after prefilling each reference sequence.
fn check_prefill_state(reference: &Reference, model: &KdaHybridModel) {
    for seq in reference.sequences() {
        let mut state: KdaHybridState = model.new_state();
        model.prefill(&seq.ids, &mut state);
        let mut worst = 0.0f32;
        let mut compared = 0;
        for i in 0..model.config().num_layers() {
            let key = |part: &str| format!("{}.after_prefill.layer{i}.{part}", seq.name);
            let mut check = |part: &str, got: &[f32]| {
                let d = max_abs_diff(got, reference.tensor(&key(part)));
                assert!(
                    d <= STATE_TOL,
                    "{}: layer {i} {part} differs by {d}",
                    seq.name
                );
                worst = worst.max(d);
                compared += 1;
            };
            if let Some(kda) = state.kda(i) {
                check("kda.recurrent_state_HKV", kda.recurrent.f32s());
                check("kda.conv_window_pre_conv", &kda.conv.to_stacked());
            } else {
                let mla = state.mla(i).expect("every layer is KDA or MLA");
                check("mla.kv_latent_normed", &mla.kv_latent.to_vec());
                if reference.tensors.contains_key(&key("mla.k_rope")) {
                    check("mla.k_rope", &mla.k_rope.to_vec());
                } else {
                    assert!(mla.k_rope.is_empty(), "no rope slot in this model");
                }
                if let Some(ix) = &mla.indexer {
                    check("dsa.indexer_k", &ix.keys.to_vec());
                    check("dsa.indexer_pool_gate_scores", &ix.pool_gate.to_vec());
                }
            }
        }
        eprintln!(
            "{}: {compared} prefill state tensors, max |diff| {worst:.2e}",
            seq.name
        );
        assert!(compared >= 2 * model.config().num_layers());
    }
}

#[test]
fn kimi_tiny_matches_transformers() {
    let reference = Reference::load("kimi_tiny");
    let model = KdaHybridModel::load(&reference.dir).expect("load kimi_tiny");
    check_logits_and_greedy(&reference, &model);
    check_prefill_state(&reference, &model);
}

#[test]
fn glm5_tiny_matches_transformers() {
    let reference = Reference::load("glm5_tiny");
    let model = KdaHybridModel::load(&reference.dir).expect("load glm5_tiny");
    assert_eq!(model.exact_context_limit(), Some(256));
    check_logits_and_greedy(&reference, &model);
    check_prefill_state(&reference, &model);
}

#[test]
fn glm5_tiny_hidden_streams_match_per_layer() {
    let reference = Reference::load("glm5_tiny");
    let model = KdaHybridModel::load(&reference.dir).expect("load glm5_tiny");
    let seq = reference
        .sequences()
        .into_iter()
        .find(|s| s.name == "seq9")
        .expect("seq9");
    let trace = model.residual_trace(&seq.ids);
    assert_eq!(trace.len(), model.config().num_layers());
    for (i, streams) in trace.iter().enumerate() {
        let d = max_abs_diff(
            streams,
            reference.tensor(&format!("seq9.hidden_streams_after_layer{i}")),
        );
        assert!(d <= STATE_TOL, "layer {i}: streams differ by {d}");
    }
}

/// The gap between the best and second-best logit.
fn top2_margin(v: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// bf16 weight matrices (activations, state and MLA latents f32): every full-forward logit
/// within 0.1 of the f32 model's, and, teacher-forced along the reference's greedy sequence,
/// the reference's token at every step whose reference top-2 margin exceeds 0.5.
fn check_bf16(name: &str) {
    let reference = Reference::load(name);
    let f32_model = KdaHybridModel::load(&reference.dir).expect("load f32");
    let options = tandem_engine::models::kda_hybrid::LoadOptions {
        dtype: tandem_engine::DType::BF16,
        ..Default::default()
    };
    let model = KdaHybridModel::load_with(&reference.dir, &options).expect("load bf16");
    let first_kda = model.config().kda_layers().next().expect("a KDA layer");
    let stored = match &model.kda_layer(first_kda).expect("KDA").input {
        tandem_engine::models::kda_hybrid::KdaInputProjection::Fused { weight, .. } => {
            weight.weight.dtype()
        }
        tandem_engine::models::kda_hybrid::KdaInputProjection::Separate { q, .. } => {
            q.weight.dtype()
        }
    };
    // (The tiny references' weights are bf16 values stored as f32, so rounding them changes
    // nothing: what this checks is the bf16 kernels, not bf16 rounding.)
    assert_eq!(
        stored,
        tandem_engine::DType::BF16,
        "{name}: weights held in bf16"
    );
    let vocab = model.config().vocab_size;
    let mut checked = 0;
    for seq in reference.sequences() {
        let d = max_abs_diff(
            &model.forward_full(&seq.ids),
            &f32_model.forward_full(&seq.ids),
        );
        eprintln!("{name} {}: bf16 vs f32 logits max |diff| {d:.3}", seq.name);
        assert!(
            d < 0.1,
            "{name} {}: bf16 logits differ from f32 by {d}",
            seq.name
        );
        let want_steps = reference.tensor(&format!("{}.greedy_step_logits", seq.name));
        let mut state = model.new_state();
        let mut step = model.prefill(&seq.ids, &mut state);
        for (j, want) in want_steps.chunks_exact(vocab).enumerate() {
            if top2_margin(want) > 0.5 {
                assert_eq!(argmax(&step), seq.greedy[j], "{name} {} step {j}", seq.name);
                checked += 1;
            }
            if j + 1 < seq.greedy.len() {
                step = model.decode_step(seq.greedy[j], &mut state);
            }
        }
    }
    eprintln!("{name}: {checked} clear-margin greedy steps equal in bf16");
    assert!(checked > 0, "{name}: no step had a clear margin to check");
}

#[test]
fn kimi_tiny_in_bf16_keeps_clear_greedy_tokens_and_logits_near_f32() {
    check_bf16("kimi_tiny");
}

#[test]
fn glm5_tiny_in_bf16_keeps_clear_greedy_tokens_and_logits_near_f32() {
    check_bf16("glm5_tiny");
}
