//! Fused KDA projections on synthetic tiny checkpoints: fused and unfused give the same
//! logits; eligibility per layer follows the checkpoint's quantization config and a LoRA
//! adapter; block-FP8 weights load; LoRA merges; a weight refresh keeps fused buffers in place.

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use tandem_engine::models::kda_hybrid::{
    FusionPolicy, KdaGateProjection, KdaHybridModel, KdaInputProjection, LoadOptions,
};
use tandem_model::synth::synth_kda_hybrid;
use tandem_testkit::max_abs_diff;

/// Fusion only regroups GEMM rows: f32 rounding differences at most.
const FUSE_TOL: f32 = 1e-5;
/// KDA layers of the tiny preset (0-based).
const KDA_LAYERS: [usize; 3] = [0, 2, 3];

fn synth(fp8: bool, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), fp8, seed).expect("synth");
    dir
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 977) >> 7) % 509 + 3)
        .collect()
}

/// `(input fused, f_b/g_b paired)` for every KDA layer, from the decision and the built form.
fn fusion_of(m: &KdaHybridModel) -> Vec<(bool, bool)> {
    KDA_LAYERS
        .iter()
        .map(|&i| {
            let l = m.kda_layer(i).expect("KDA layer");
            assert_eq!(l.fusion().input.fused, l.input.is_fused(), "layer {i}");
            assert_eq!(l.fusion().fg_b.fused, l.gate.is_paired(), "layer {i}");
            (l.input.is_fused(), l.gate.is_paired())
        })
        .collect()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json")
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut c = read_json(&path);
    f(&mut c);
    std::fs::write(&path, serde_json::to_string_pretty(&c).expect("json")).expect("write");
}

/// All tensors of `dir/model.safetensors` as (dtype, shape, bytes).
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(dir: &Path) -> Tensors {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write_tensors(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write");
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

fn copy_config(from: &Path, to: &Path) {
    std::fs::copy(from.join("config.json"), to.join("config.json")).expect("copy");
}

#[test]
fn fused_equals_unfused_on_the_same_weights() {
    let dir = synth(false, 7);
    let fused = KdaHybridModel::load(dir.path()).expect("load");
    let never = LoadOptions {
        fusion: FusionPolicy::Never,
        ..LoadOptions::default()
    };
    let separate = KdaHybridModel::load_with(dir.path(), &never).expect("load");
    assert_eq!(fusion_of(&fused), vec![(true, true); 3]);
    assert_eq!(fusion_of(&separate), vec![(false, false); 3]);
    let ids = tokens(70, 1); // crosses a 64-token chunk boundary
    let d = max_abs_diff(&fused.forward_full(&ids), &separate.forward_full(&ids));
    eprintln!("fused vs unfused logits: {d:.2e}");
    assert!(d <= FUSE_TOL, "fused and unfused differ by {d}");
    // The fused input weight is vcat(q, k, v, b, f_a, g_a): 3P + H + 2D rows at tp1.
    match &fused.kda_layer(0).expect("KDA").input {
        KdaInputProjection::Fused { weight, split } => {
            assert_eq!(*split, [256, 256, 256, 8, 32, 32]);
            assert_eq!(weight.out_features, 3 * 256 + 8 + 64);
        }
        other => panic!("expected fused, got {other:?}"),
    }
}

#[test]
fn eligibility_follows_the_quantization_config() {
    // BF16, no quantization config: everything fused.
    let bf16 = synth(false, 3);
    let m = KdaHybridModel::load(bf16.path()).expect("load");
    assert_eq!(fusion_of(&m), vec![(true, true); 3]);

    // Native FP8 listing every KDA projection as ignored: fused.
    let fp8 = synth(true, 3);
    let m = KdaHybridModel::load(fp8.path()).expect("load");
    assert_eq!(fusion_of(&m), vec![(true, true); 3]);
    let reference = m.forward_full(&tokens(20, 2));

    // One projection of layer 2 no longer ignored (so, per the config, quantized): that
    // layer's input group falls back, nothing else changes — and the numbers do not.
    edit_config(fp8.path(), |c| {
        let list = c["quantization_config"]["ignored_layers"]
            .as_array_mut()
            .expect("list");
        list.retain(|n| n != "model.layers.2.self_attn.g_a_proj");
    });
    let m = KdaHybridModel::load(fp8.path()).expect("load");
    assert_eq!(
        fusion_of(&m),
        vec![(true, true), (false, true), (true, true)]
    );
    let why = &m.kda_layer(2).expect("KDA").fusion().input.reason;
    assert!(why.contains("g_a_proj is quantized"), "{why}");
    let d = max_abs_diff(&reference, &m.forward_full(&tokens(20, 2)));
    assert!(d <= FUSE_TOL, "partial fusion changed logits by {d}");

    // Another quantization method: keep the original projections everywhere.
    edit_config(fp8.path(), |c| {
        c["quantization_config"]["quant_method"] = json!("awq")
    });
    let m = KdaHybridModel::load(fp8.path()).expect("load");
    assert_eq!(fusion_of(&m), vec![(false, false); 3]);
    let why = &m.kda_layer(0).expect("KDA").fusion().fg_b.reason;
    assert!(why.contains("awq"), "{why}");
}

#[test]
fn fp8_checkpoint_loads_and_equals_its_dequantised_copy() {
    let fp8 = synth(true, 11);
    let bf16 = synth(false, 11);
    let ids = tokens(24, 5);
    let m8 = KdaHybridModel::load(fp8.path()).expect("load fp8");
    let l8 = m8.forward_full(&ids);
    assert!(l8.iter().all(|x| x.is_finite()), "non-finite FP8 logits");
    // The CPU has no FP8 products: every stored FP8 matrix (MLA, dense MLP, experts) is
    // dequantised at load, and counted so.
    let [kept, dequantised] = m8.block_fp8_matrices();
    assert_eq!(kept, 0, "the CPU kept FP8 matrices");
    assert!(dequantised >= 4, "only {dequantised} FP8 matrices counted");

    // Loose: FP8 weights are BF16 ones rounded to 3 mantissa bits (≤ 1/16 relative per
    // weight, checked on one expert below), amplified through five random layers.
    let m16 = KdaHybridModel::load(bf16.path()).expect("load bf16");
    assert_eq!(m16.block_fp8_matrices(), [0, 0]);
    let l16 = m16.forward_full(&ids);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let cos = dot(&l8, &l16) / (dot(&l8, &l8) * dot(&l16, &l16)).sqrt();
    eprintln!("FP8 vs BF16 logits cosine similarity: {cos:.3}");
    assert!(cos > 0.7, "FP8 logits unrelated to BF16: cosine {cos}");

    // Exact: an F32 checkpoint holding the dequantised FP8 weights (no quantization config).
    let tensors = read_tensors(fp8.path());
    let mut plain = Tensors::new();
    for (name, (dtype, shape, bytes)) in &tensors {
        if name.ends_with("weight_scale_inv") {
            continue;
        }
        if *dtype == Dtype::F8_E4M3 {
            let module = name.strip_suffix(".weight").expect("weight");
            let (_, _, sb) = &tensors[&format!("{module}.weight_scale_inv")];
            let scales: Vec<f32> = sb
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let w = tandem_model::fp8::dequantize_blocks(bytes, &scales, shape[0], shape[1], 128);
            plain.insert(name.clone(), (Dtype::F32, shape.clone(), f32_bytes(&w)));
        } else {
            plain.insert(name.clone(), (*dtype, shape.clone(), bytes.clone()));
        }
    }
    let name = "model.layers.1.block_sparse_moe.experts.0.w1.weight";
    let (_, _, dq) = &plain[name];
    let (_, _, orig) = &read_tensors(bf16.path())[name];
    let dq: Vec<f32> = dq
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let orig = bf16_values(orig);
    let amax = orig.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (q, o) in dq.iter().zip(&orig) {
        // Relative 2^-4 for normal codes, absolute amax/448·2^-3 near zero (subnormals).
        assert!(
            (q - o).abs() <= o.abs() / 16.0 + amax / 448.0 / 8.0,
            "{q} vs {o}"
        );
    }
    let round_trip = tempfile::tempdir().expect("tmp");
    write_tensors(&round_trip.path().join("model.safetensors"), &plain);
    copy_config(fp8.path(), round_trip.path());
    edit_config(round_trip.path(), |c| {
        c.as_object_mut()
            .expect("object")
            .remove("quantization_config");
    });
    let lrt = KdaHybridModel::load(round_trip.path())
        .expect("load round trip")
        .forward_full(&ids);
    assert_eq!(l8, lrt, "FP8 load must equal its dequantised copy exactly");

    // Greedy is stable: prefill + decode steps pick the tokens a full pass scores highest.
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .expect("non-empty")
    };
    let mut state = m8.new_state();
    let mut next = argmax(&m8.prefill(&ids, &mut state));
    let mut seq = ids.clone();
    for _ in 0..6 {
        seq.push(next);
        next = argmax(&m8.decode_step(next, &mut state));
    }
    let full = m8.forward_full(&seq);
    let vocab = m8.config().vocab_size;
    assert_eq!(argmax(&full[(seq.len() - 1) * vocab..]), next);
}

/// A PEFT adapter on `module` of every KDA layer (`[out, inp]`), and the same weights merged
/// into a copy of `base` (F32 tensors).
fn lora_and_merged(base: &Path, module: &str, out: usize, inp: usize) -> [tempfile::TempDir; 2] {
    let (r, alpha) = (4usize, 8.0f32);
    let lora = tempfile::tempdir().expect("tmp");
    std::fs::write(
        lora.path().join("adapter_config.json"),
        json!({"r": r, "lora_alpha": alpha, "target_modules": [module], "peft_type": "LORA"})
            .to_string(),
    )
    .expect("write");
    let mut adapter = Tensors::new();
    let mut merged = read_tensors(base);
    for (li, &layer) in KDA_LAYERS.iter().enumerate() {
        let m = format!("model.layers.{layer}.self_attn.{module}");
        let val =
            |i: usize, salt: usize| (((i * 37 + salt * 11 + li * 5) % 17) as f32 - 8.0) * 0.01;
        let a: Vec<f32> = (0..r * inp).map(|i| val(i, 1)).collect();
        let b: Vec<f32> = (0..out * r).map(|i| val(i, 2)).collect();
        let key = |ab: &str| format!("base_model.model.{m}.lora_{ab}.weight");
        adapter.insert(key("A"), (Dtype::F32, vec![r, inp], f32_bytes(&a)));
        adapter.insert(key("B"), (Dtype::F32, vec![out, r], f32_bytes(&b)));
        let entry = merged.get_mut(&format!("{m}.weight")).expect("base weight");
        let mut w = bf16_values(&entry.2);
        for o in 0..out {
            for k in 0..r {
                let bk = alpha / r as f32 * b[o * r + k];
                for i in 0..inp {
                    w[o * inp + i] += bk * a[k * inp + i];
                }
            }
        }
        *entry = (Dtype::F32, vec![out, inp], f32_bytes(&w));
    }
    write_tensors(&lora.path().join("adapter_model.safetensors"), &adapter);
    let merged_dir = tempfile::tempdir().expect("tmp");
    write_tensors(&merged_dir.path().join("model.safetensors"), &merged);
    copy_config(base, merged_dir.path());
    [lora, merged_dir]
}

#[test]
fn lora_keeps_its_group_unfused_and_equals_merged_weights() {
    let base = synth(false, 5);
    let ids = tokens(20, 3);
    let plain = KdaHybridModel::load(base.path())
        .expect("load")
        .forward_full(&ids);

    // LoRA on f_b: the paired gate falls back, the input GEMM stays fused.
    let [lora, merged] = lora_and_merged(base.path(), "f_b_proj", 256, 32);
    let m = KdaHybridModel::load_with_lora(base.path(), Some(lora.path())).expect("load");
    assert_eq!(fusion_of(&m), vec![(true, false); 3]);
    let why = &m.kda_layer(0).expect("KDA").fusion().fg_b.reason;
    assert!(why.contains("LoRA"), "{why}");
    let with_lora = m.forward_full(&ids);
    let reference = KdaHybridModel::load(merged.path())
        .expect("load merged")
        .forward_full(&ids);
    let d = max_abs_diff(&with_lora, &reference);
    eprintln!("LoRA f_b vs merged checkpoint: {d:.2e}");
    assert!(
        d <= FUSE_TOL,
        "LoRA differs from the merged checkpoint by {d}"
    );
    assert!(
        max_abs_diff(&with_lora, &plain) > 1e-3,
        "the adapter had no effect"
    );

    // LoRA elsewhere (o_proj): both groups stay fused.
    let [lora, merged] = lora_and_merged(base.path(), "o_proj", 256, 256);
    let m = KdaHybridModel::load_with_lora(base.path(), Some(lora.path())).expect("load");
    assert_eq!(fusion_of(&m), vec![(true, true); 3]);
    let d = max_abs_diff(
        &m.forward_full(&ids),
        &KdaHybridModel::load(merged.path())
            .expect("load merged")
            .forward_full(&ids),
    );
    assert!(d <= FUSE_TOL, "LoRA o_proj differs from merged by {d}");
}

fn fused_ptrs(m: &KdaHybridModel, layer: usize) -> (Option<usize>, Option<usize>) {
    let l = m.kda_layer(layer).expect("KDA");
    let input = match &l.input {
        KdaInputProjection::Fused { weight, .. } => Some(weight.weight.address()),
        KdaInputProjection::Separate { .. } => None,
    };
    let gate = match &l.gate {
        KdaGateProjection::Paired { weight, .. } => Some(weight.weight.address()),
        KdaGateProjection::Separate { .. } => None,
    };
    (input, gate)
}

#[test]
fn refresh_rewrites_fused_buffers_in_place() {
    let (a, b) = (synth(false, 21), synth(false, 22));
    let ids = tokens(16, 9);
    let mut m = KdaHybridModel::load(a.path()).expect("load");
    let before: Vec<_> = KDA_LAYERS.iter().map(|&i| fused_ptrs(&m, i)).collect();
    assert!(before.iter().all(|(i, g)| i.is_some() && g.is_some()));
    let old_logits = m.forward_full(&ids);

    m.refresh_weights(b.path()).expect("refresh");
    let after: Vec<_> = KDA_LAYERS.iter().map(|&i| fused_ptrs(&m, i)).collect();
    assert_eq!(
        before, after,
        "same shapes: fused buffers must keep their addresses"
    );
    let expected = KdaHybridModel::load(b.path())
        .expect("load")
        .forward_full(&ids);
    assert_eq!(
        m.forward_full(&ids),
        expected,
        "refreshed weights are the new ones"
    );
    assert_ne!(old_logits, expected);

    // A form change (layer 2's input group no longer eligible) reallocates, logged.
    let fp8 = synth(true, 22);
    edit_config(fp8.path(), |c| {
        let list = c["quantization_config"]["ignored_layers"]
            .as_array_mut()
            .expect("list");
        list.retain(|n| n != "model.layers.2.self_attn.q_proj");
    });
    m.refresh_weights(fp8.path()).expect("refresh");
    assert_eq!(fused_ptrs(&m, 2).0, None, "layer 2 input is now unfused");
    assert_eq!(
        fused_ptrs(&m, 0),
        after[0],
        "layer 0 still rewritten in place"
    );
    let expected = KdaHybridModel::load(fp8.path())
        .expect("load")
        .forward_full(&ids);
    assert_eq!(m.forward_full(&ids), expected);
}
