//! Self-consistency of the KDA hybrid models on the tiny checkpoints: the chunked and recurrent
//! delta rule agree on a real layer across chunk boundaries, and every way of splitting a
//! sequence into prefill / decode calls gives the logits of one full pass.

use tandem_engine::models::kda_hybrid::{KdaForm, KdaHybridModel, KdaHybridState};
use tandem_engine::Tensor;
use tandem_testkit::{max_abs_diff, noise};

/// f32 rounding only: the forms differ in summation order, nothing else.
const FORM_TOL: f32 = 1e-5;
/// Whole-model logits through different call splits (chunk boundaries move, MLA rows differ).
const SPLIT_TOL: f32 = 1e-4;

fn model(name: &str) -> KdaHybridModel {
    let dir = tandem_testkit::shared_dir().join("reference").join(name);
    KdaHybridModel::load(&dir).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

fn tokens(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    noise(seed, len)
        .iter()
        .map(|x| (((x + 1.0) * 0.5 * (vocab - 3) as f32) as u32 + 3).min(vocab as u32 - 1))
        .collect()
}

/// Chunked vs recurrent on the first KDA layer of `name`, from a non-trivial carried state.
fn chunked_equals_recurrent_on_a_layer(name: &str) {
    let m = model(name);
    let hidden = m.config().hidden_size;
    let layer_index = m.config().kda_layers().next().expect("a KDA layer");
    let layer = m.kda_layer(layer_index).expect("KDA layer");
    // Carry in a state that has seen 10 tokens (non-zero S and conv window).
    let b = m.backend();
    let input =
        |seed: u64, rows: usize| Tensor::from_f32s(&[rows, hidden], noise(seed, rows * hidden));
    let mut warm = layer.new_state(b);
    layer.forward(b, &input(7, 10), 10, &mut warm, KdaForm::Recurrent);
    for len in [67, 130] {
        let x = input(len as u64, len);
        let (mut s_chunk, mut s_rec) = (warm.clone(), warm.clone());
        let y_chunk = layer.forward(b, &x, len, &mut s_chunk, KdaForm::Chunked);
        let y_rec = layer.forward(b, &x, len, &mut s_rec, KdaForm::Recurrent);
        let (dy, ds) = (
            max_abs_diff(y_chunk.f32s(), y_rec.f32s()),
            max_abs_diff(s_chunk.recurrent.f32s(), s_rec.recurrent.f32s()),
        );
        eprintln!("{name} layer {layer_index}, {len} tokens: output {dy:.2e}, state {ds:.2e}");
        assert!(dy <= FORM_TOL, "{name} T={len}: outputs differ by {dy}");
        assert!(ds <= FORM_TOL, "{name} T={len}: states differ by {ds}");
        assert_eq!(s_chunk.conv, s_rec.conv, "conv windows");
    }
}

#[test]
fn kimi_chunked_equals_recurrent_on_a_layer() {
    chunked_equals_recurrent_on_a_layer("kimi_tiny");
}

#[test]
fn glm5_chunked_equals_recurrent_on_a_layer() {
    // The lower-bound gate decays up to e^-5 per token: the chunked form must not overflow.
    chunked_equals_recurrent_on_a_layer("glm5_tiny");
}

/// Logits of every position when `ids` is fed as chunked calls of the lengths in `prefills`
/// (each returning all its rows), then one decode step per remaining token.
fn logits_through(
    m: &KdaHybridModel,
    ids: &[u32],
    prefills: &[usize],
) -> (Vec<f32>, KdaHybridState) {
    let vocab = m.config().vocab_size;
    let mut state = m.new_state();
    let mut out = Vec::new();
    let mut at = 0;
    for &n in prefills {
        out.extend(m.extend(&ids[at..at + n], &mut state, KdaForm::Chunked, true));
        at += n;
    }
    for &id in &ids[at..] {
        let step = m.decode_step(id, &mut state);
        assert_eq!(step.len(), vocab);
        out.extend(step);
    }
    (out, state)
}

fn splits_equal_one_pass(name: &str, len: usize) {
    let m = model(name);
    let ids = tokens(len as u64 + 1, len, m.config().vocab_size);
    let full = m.forward_full(&ids);
    let (_, full_state) = logits_through(&m, &ids, &[len]);
    // Prefill then decode across the 64-token chunk boundary; chunked prefill in pieces whose
    // chunks are misaligned with one pass; decode from the very first token.
    for prefills in [vec![40], vec![30, 37], vec![1], vec![]] {
        let (got, state) = logits_through(&m, &ids, &prefills);
        let d = max_abs_diff(&got, &full);
        eprintln!("{name}: prefill {prefills:?} then decode: logits max |diff| {d:.2e}");
        assert!(d <= SPLIT_TOL, "{name} {prefills:?}: logits differ by {d}");
        assert_eq!(state.tokens, len);
        for (a, b) in state.layers.iter().zip(&full_state.layers) {
            use tandem_engine::models::kda_hybrid::LayerState;
            match (a, b) {
                (LayerState::Kda(a), LayerState::Kda(b)) => {
                    assert!(max_abs_diff(a.recurrent.f32s(), b.recurrent.f32s()) <= SPLIT_TOL);
                    assert!(max_abs_diff(&a.conv.to_stacked(), &b.conv.to_stacked()) <= SPLIT_TOL);
                }
                (LayerState::Mla(a), LayerState::Mla(b)) => {
                    assert!(
                        max_abs_diff(&a.kv_latent.to_vec(), &b.kv_latent.to_vec()) <= SPLIT_TOL
                    );
                    assert_eq!(a.k_rope.len(), b.k_rope.len());
                }
                _ => panic!("layer kinds differ"),
            }
        }
    }
    // The public prefill returns the last row of the same pass.
    let mut state = m.new_state();
    let last = m.prefill(&ids[..40], &mut state);
    let vocab = m.config().vocab_size;
    let d = max_abs_diff(&last, &full[39 * vocab..40 * vocab]);
    assert!(
        d <= SPLIT_TOL,
        "{name}: prefill(40) last row differs by {d}"
    );
}

#[test]
fn kimi_prefill_then_decode_equals_one_pass() {
    splits_equal_one_pass("kimi_tiny", 70);
}

#[test]
fn glm5_prefill_then_decode_equals_one_pass() {
    splits_equal_one_pass("glm5_tiny", 70);
}
