//! Llama under tensor parallelism (CPU ranks as threads): tp2 and tp4 give tp1's logits
//! and greedy tokens, and K/V handed between engines of different tp sizes continues the
//! same generation (the handoff layout is the whole model's, whatever either side's tp).

use tandem_core::{BlockId, SamplingParams};
use tandem_engine::batch::ForwardBatch;
use tandem_engine::models::llama::served::cpu_shards;
use tandem_engine::{DType, Engine, EngineConfig, EngineEvent, LlamaRanks, SeqKind, StepLimits};

fn synth() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    // 4 query heads, 2 KV heads: tp2 splits the KV heads, tp4 replicates each over 2 ranks.
    tandem_model::synth::synth_llama("tiny", dir.path(), 3).expect("synth");
    dir
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101) % 500 + 3)
        .collect()
}

/// Logits of every position of a prefill of `ids`, and the prompt's K/V, on `tp` ranks.
fn prefill(dir: &std::path::Path, tp: usize, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let shards = cpu_shards(dir, DType::F32, tp).expect("shards");
    let block = 16;
    let blocks = ids.len().div_ceil(block);
    let limits = StepLimits {
        max_tokens: ids.len(),
        max_seqs: ids.len(),
        max_blocks_per_seq: blocks,
    };
    let mut ranks = LlamaRanks::new(shards, limits, block, blocks).expect("ranks");
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let mut batch = ForwardBatch::default();
    batch.push(ids, 0, &table, block, false);
    batch.logits_rows = (0..ids.len()).collect();
    ranks.step(&batch).expect("step");
    let vocab = ranks.model().config().vocab_size;
    let b = ranks.backend();
    let mut logits = tandem_engine::Backend::download(b, ranks.logits()).to_f32_vec();
    logits.truncate(ids.len() * vocab);
    let kv = ranks
        .read_kv(&table, ids.len())
        .expect("read kv")
        .to_f32_vec();
    (logits, kv)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tp2_and_tp4_logits_and_kv_equal_tp1() {
    let dir = synth();
    let ids = prompt(37, 1);
    let (logits1, kv1) = prefill(dir.path(), 1, &ids);
    for tp in [2, 4] {
        let (logits, kv) = prefill(dir.path(), tp, &ids);
        let d = max_diff(&logits1, &logits);
        assert!(d < 1e-4, "tp{tp}: logits differ from tp1 by {d}");
        let d = max_diff(&kv1, &kv);
        assert!(
            d < 1e-4,
            "tp{tp}: the gathered K/V differs from tp1's by {d}"
        );
    }
}

fn engine(dir: &std::path::Path, tp: usize) -> Engine {
    Engine::start_sharded(
        cpu_shards(dir, DType::F32, tp).expect("shards"),
        EngineConfig {
            num_blocks: 256,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

#[test]
fn greedy_generation_is_the_same_at_every_tp() {
    let dir = synth();
    let prompts: Vec<Vec<u32>> = (0..4).map(|s| prompt(5 + 11 * s as usize, s)).collect();
    let run = |tp: usize| -> Vec<Vec<u32>> {
        let e = engine(dir.path(), tp);
        // All at once: the steps mix prefills and decodes.
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| {
                e.submit(p.clone(), SamplingParams::greedy(10), SeqKind::Generate)
                    .expect("submit")
            })
            .collect();
        rxs.into_iter()
            .map(tandem_engine::blocking_tokens)
            .collect()
    };
    let tp1 = run(1);
    assert!(tp1.iter().all(|t| t.len() == 10));
    assert_eq!(run(2), tp1, "tp2 greedy tokens");
    assert_eq!(run(4), tp1, "tp4 greedy tokens");
}

#[test]
fn kv_handed_from_tp1_prefill_to_a_tp2_decoder_continues_the_generation() {
    let dir = synth();
    let p = prompt(29, 7);
    let whole = engine(dir.path(), 1);
    let want = tandem_engine::blocking_tokens(
        whole
            .submit(p.clone(), SamplingParams::greedy(8), SeqKind::Generate)
            .expect("submit"),
    );
    let mut rx = whole
        .submit(p.clone(), SamplingParams::greedy(8), SeqKind::Prefill)
        .expect("prefill");
    let (first_token, handoff) = loop {
        match rx.blocking_recv().expect("prefilled") {
            EngineEvent::Prefilled {
                first_token,
                handoff,
                ..
            } => break (first_token, handoff),
            _ => continue,
        }
    };
    let decoder = engine(dir.path(), 2);
    let reservation = decoder.reserve(p.len() + 8).expect("reserve");
    let rest = tandem_engine::blocking_tokens(
        decoder
            .submit(
                p,
                SamplingParams::greedy(8),
                SeqKind::Decode {
                    reservation,
                    handoff,
                    first_token,
                    forks: Vec::new(),
                },
            )
            .expect("decode"),
    );
    let mut got = vec![first_token];
    got.extend(rest);
    assert_eq!(got, want, "prefill tp1 + decode tp2 = generate tp1");
}

fn synth_seed(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    tandem_model::synth::synth_llama("tiny", dir.path(), seed).expect("synth");
    dir
}

fn generate(e: &Engine, p: &[u32]) -> Vec<u32> {
    tandem_engine::blocking_tokens(
        e.submit(p.to_vec(), SamplingParams::greedy(8), SeqKind::Generate)
            .expect("submit"),
    )
}

#[test]
fn refreshed_weights_answer_like_a_fresh_load_at_tp1_and_tp2() {
    let (a, b) = (synth_seed(1), synth_seed(2));
    let p = prompt(21, 5);
    let fresh_b = generate(&engine(b.path(), 1), &p);
    for tp in [1, 2] {
        let e = engine(a.path(), tp);
        let before = generate(&e, &p);
        assert_ne!(
            before, fresh_b,
            "the two checkpoints should answer differently"
        );
        e.refresh_weights(b.path()).expect("refresh");
        assert_eq!(generate(&e, &p), fresh_b, "tp{tp}: after the refresh");
        // A checkpoint of another shape is refused, and the engine keeps serving.
        let other = tempfile::tempdir().expect("temp dir");
        tandem_model::synth::synth_llama("smollm2", other.path(), 1).expect("synth");
        let err = e.refresh_weights(other.path()).expect_err("other shapes");
        assert!(
            matches!(err, tandem_engine::Error::InvalidRequest(_)),
            "a refused refresh is the caller's error: {err}"
        );
        assert_eq!(generate(&e, &p), fresh_b, "tp{tp}: after a refused refresh");
    }
}
