//! The one loader (`tandem_engine::load`): it reads the card, picks the family from
//! `model_type`, loads the ranks of a layout, and what it returns scores, generates and serves
//! as the family's own types do.

use tandem_core::SamplingParams;
use tandem_engine::load::Model;
use tandem_engine::models::kda_hybrid::KdaHybridModel;
use tandem_engine::{CpuBackend, EngineConfig, LoadSpec, Loaded, SeqKind};
use tandem_model::Family;
use tandem_topology::{Layout, Rank};

fn cpu(_: Rank) -> tandem_engine::Result<CpuBackend> {
    Ok(CpuBackend::new())
}

fn spec(tp: usize, dp: usize) -> LoadSpec {
    LoadSpec {
        layout: Layout::new(tp, dp, 1).expect("layout"),
        ..LoadSpec::default()
    }
}

fn prompt(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| 3 + (i * 37 + seed * 11) % 200).collect()
}

fn served_greedy(model: Loaded<CpuBackend>, ids: &[u32], n: u32) -> Vec<u32> {
    let engine = model
        .serve(EngineConfig {
            num_blocks: 64,
            state_slots: 4,
            ..EngineConfig::default()
        })
        .expect("serve");
    let rx = engine
        .submit(ids.to_vec(), SamplingParams::greedy(n), SeqKind::Generate)
        .expect("submit");
    tandem_engine::blocking_tokens(rx)
}

#[test]
fn a_llama_checkpoint_loads_as_its_family_at_every_tp() {
    let dir = tempfile::tempdir().expect("tmp");
    tandem_model::synth::synth_llama("tiny", dir.path(), 3).expect("synth");
    let one = tandem_engine::load(dir.path(), cpu, &LoadSpec::default()).expect("load");
    assert_eq!(one.family(), Family::Llama);
    assert!(matches!(&one.model, Model::Llama(s) if s.len() == 1));
    let vocab = one.vocab_size();
    assert_eq!(Some(vocab), one.card.vocab_size);
    let ids = prompt(21, 1);
    let direct = {
        let two = tandem_engine::load(dir.path(), cpu, &spec(2, 1)).expect("load tp2");
        assert!(matches!(&two.model, Model::Llama(s) if s.len() == 2));
        two.logits(&ids).expect("tp2 logits")
    };
    let logits = one.logits(&ids).expect("logits");
    assert_eq!(logits.len(), ids.len() * vocab);
    let diff = tandem_testkit::max_abs_diff(&logits, &direct);
    assert!(diff < 1e-4, "tp1 and tp2 logits differ by {diff}");
    // Served: greedy tokens of the engine, the same at tp1 and tp2.
    let a = served_greedy(
        tandem_engine::load(dir.path(), cpu, &LoadSpec::default()).expect("load"),
        &ids,
        6,
    );
    let b = served_greedy(
        tandem_engine::load(dir.path(), cpu, &spec(2, 1)).expect("load"),
        &ids,
        6,
    );
    assert_eq!(a.len(), 6);
    assert_eq!(a, b, "served greedy tokens at tp1 and tp2");
}

#[test]
fn what_a_family_cannot_do_is_refused_before_loading() {
    let dir = tempfile::tempdir().expect("tmp");
    tandem_model::synth::synth_llama("tiny", dir.path(), 3).expect("synth");
    let err = tandem_engine::load(dir.path(), cpu, &spec(2, 2))
        .expect_err("dp on a Llama model")
        .to_string();
    assert!(err.contains("tensor parallelism only"), "{err}");
    let lora = LoadSpec {
        lora: Some(dir.path().to_path_buf()),
        ..LoadSpec::default()
    };
    let err = tandem_engine::load(dir.path(), cpu, &lora)
        .expect_err("LoRA on a Llama model")
        .to_string();
    assert!(err.contains("KDA-hybrid models only"), "{err}");
    let llama = tandem_engine::load(dir.path(), cpu, &LoadSpec::default()).expect("load");
    let err = llama
        .greedy(&[3, 4], 2)
        .expect_err("greedy without the engine");
    assert!(err.to_string().contains("serve"), "{err}");
    // An id past the vocabulary is an error, not a panic.
    let vocab = llama.vocab_size() as u32;
    let err = llama
        .logits(&[3, vocab])
        .expect_err("id outside the vocabulary");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    // A family tandem does not know: the card says which.
    let unknown = tempfile::tempdir().expect("tmp");
    std::fs::write(
        unknown.path().join("config.json"),
        r#"{"model_type": "gpt2", "vocab_size": 10}"#,
    )
    .expect("write");
    let err = tandem_engine::load(unknown.path(), cpu, &LoadSpec::default())
        .expect_err("gpt2")
        .to_string();
    assert!(err.contains("gpt2"), "{err}");
}

#[test]
fn a_kda_hybrid_checkpoint_loads_as_its_family_in_a_layout() {
    let dir = tempfile::tempdir().expect("tmp");
    tandem_model::synth::synth_kda_hybrid("tiny", dir.path(), false, 5).expect("synth");
    let ids = prompt(12, 2);
    let direct = KdaHybridModel::load(dir.path()).expect("direct load");
    let want = direct.forward_full(&ids);
    let one = tandem_engine::load(dir.path(), cpu, &LoadSpec::default()).expect("load");
    assert_eq!(one.family(), Family::KdaHybrid);
    let greedy = one.greedy(&ids, 5).expect("greedy");
    assert_eq!(
        one.logits(&ids).expect("logits"),
        want,
        "the loader's model is the model"
    );
    let sharded = tandem_engine::load(dir.path(), cpu, &spec(2, 2)).expect("load tp2 dp2");
    assert!(matches!(&sharded.model, Model::KdaHybrid(m) if m.layout().tp() == 2));
    let diff = tandem_testkit::max_abs_diff(&sharded.logits(&ids).expect("logits"), &want);
    assert!(diff < 1e-4, "tp2×dp2 logits differ by {diff}");
    let served = served_greedy(
        tandem_engine::load(dir.path(), cpu, &LoadSpec::default()).expect("load"),
        &ids,
        5,
    );
    // The card's EOS may end the greedy run early; the engine ignores nothing either.
    assert!(!greedy.is_empty());
    assert_eq!(
        served[..greedy.len().min(served.len())],
        greedy[..greedy.len().min(served.len())]
    );
}
