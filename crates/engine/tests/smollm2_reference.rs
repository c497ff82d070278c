//! The engine against Hugging Face transformers: greedy token ids for every case in
//! `shared/reference/smollm2/greedy.json`, and the reference's top-5 logits.

use tandem_core::SamplingParams;
use tandem_engine::{
    CpuBackend, DType, Engine, EngineConfig, EngineEvent, KvCache, LlamaModel, SeqKind,
};

use tandem_testkit::ids;

fn generate(engine: &Engine, prompt: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    let rx = engine
        .submit(
            prompt,
            SamplingParams::greedy(max_tokens),
            SeqKind::Generate,
        )
        .expect("submit");
    tandem_engine::blocking_tokens(rx)
}

#[test]
fn greedy_matches_transformers_all_cases_concurrently_and_alone() {
    let reference = tandem_testkit::smollm2_greedy_reference();
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    // A small chunk budget forces chunked prefill across steps.
    let config = EngineConfig {
        max_batch_tokens: 16,
        ..EngineConfig::default()
    };
    let engine = Engine::start(model, config);
    let cases = reference["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 4);
    // All four at once: continuous batching must not change any sequence's tokens.
    let mut pending = Vec::new();
    for case in cases {
        let prompt = ids(&case["prompt_ids"]);
        let max = case["max_new_tokens"].as_u64().expect("max") as u32;
        let rx = engine
            .submit(prompt, SamplingParams::greedy(max), SeqKind::Generate)
            .expect("submit");
        pending.push((
            case["name"].as_str().expect("name").to_string(),
            ids(&case["generated_ids"]),
            rx,
        ));
    }
    for (name, expected, mut rx) in pending {
        let mut got = Vec::new();
        while let Some(EngineEvent::Token {
            token_id, finish, ..
        }) = rx.blocking_recv()
        {
            got.push(token_id);
            if finish.is_some() {
                break;
            }
        }
        assert_eq!(got, expected, "case {name} (batched)");
    }
    // And one alone.
    let case = &cases[2];
    assert_eq!(
        generate(&engine, ids(&case["prompt_ids"]), 32),
        ids(&case["generated_ids"])
    );
    assert_eq!(
        engine.allocator().free_blocks(),
        engine.allocator().total_blocks(),
        "KV blocks leaked"
    );
}

#[test]
fn first_step_logits_match_reference_top5() {
    let reference = tandem_testkit::smollm2_greedy_reference();
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    let layout = model.kv_layout(16, 64);
    let mut cache = KvCache::new(model.backend(), layout);
    let blocks: Vec<tandem_core::BlockId> = (0..64).map(tandem_core::BlockId).collect();
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        let mut batch = tandem_engine::batch::ForwardBatch::default();
        batch.push(&prompt, 0, &blocks, 16, true);
        let logits = model.forward_batch(&batch, &mut cache).expect("forward");
        for pair in case["top5_step1"].as_array().expect("top5") {
            let id = pair[0].as_u64().expect("id") as usize;
            let want = pair[1].as_f64().expect("logit") as f32;
            let got = logits[id];
            assert!(
                (got - want).abs() < 2e-3,
                "{}: logit[{id}] = {got}, reference {want}",
                case["name"]
            );
        }
    }
}

/// First-step logits of every case's prompt, `(case, logits)`.
fn first_logits(model: &LlamaModel<CpuBackend>, reference: &serde_json::Value) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(model.backend(), model.kv_layout(16, 64));
    let blocks: Vec<tandem_core::BlockId> = (0..64).map(tandem_core::BlockId).collect();
    reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| {
            let mut batch = tandem_engine::batch::ForwardBatch::default();
            batch.push(&ids(&case["prompt_ids"]), 0, &blocks, 16, true);
            model.forward_batch(&batch, &mut cache).expect("forward")
        })
        .collect()
}

/// bf16 weights and K/V: the reference's greedy token at every step where its top-2 margin is
/// above 0.5 (teacher-forced on the reference's own sequence, so a near-tie earlier cannot
/// hide later steps), the same tokens through the engine up to the first near-tie, and the
/// reference's top-5 first-step logits within 0.1 of the f32 path's.
#[test]
fn bf16_keeps_the_greedy_tokens_with_clear_margins_and_logits_near_f32() {
    let reference = tandem_testkit::smollm2_greedy_reference();
    let dir = tandem_testkit::smollm2_dir();
    let f32_model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load f32");
    let want_logits = first_logits(&f32_model, &reference);
    drop(f32_model);
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::BF16).expect("load bf16");
    assert_eq!(model.kv_layout(16, 1).dtype, DType::BF16, "bf16 K/V");
    for ((case, got), want) in reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .zip(first_logits(&model, &reference))
        .zip(&want_logits)
    {
        let worst = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let mean = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
            / got.len() as f32;
        let top5: Vec<usize> = case["top5_step1"]
            .as_array()
            .expect("top5")
            .iter()
            .map(|p| p[0].as_u64().expect("id") as usize)
            .collect();
        let worst_top = top5
            .iter()
            .map(|&i| (got[i] - want[i]).abs())
            .fold(0.0f32, f32::max);
        eprintln!(
            "{}: |bf16 - f32| max {worst} mean {mean} top-5 max {worst_top}",
            case["name"]
        );
        assert!(
            worst_top < 0.1,
            "{}: bf16 first-step logits differ from f32 by up to {worst}",
            case["name"]
        );
    }
    let mut forced = 0;
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        let generated = ids(&case["generated_ids"]);
        let margins: Vec<f64> = case["greedy_margins"]
            .as_array()
            .expect("margins")
            .iter()
            .map(|m| m.as_f64().expect("margin"))
            .collect();
        let mut seq = prompt.clone();
        seq.extend_from_slice(&generated[..generated.len() - 1]);
        let blocks: Vec<tandem_core::BlockId> = (0..seq.len().div_ceil(16) as u32)
            .map(tandem_core::BlockId)
            .collect();
        let mut cache = KvCache::new(model.backend(), model.kv_layout(16, blocks.len()));
        let mut batch = tandem_engine::batch::ForwardBatch::default();
        batch.push(&seq, 0, &blocks, 16, false);
        batch.logits_rows = (prompt.len() - 1..seq.len()).collect();
        let logits = model.forward_batch(&batch, &mut cache).expect("forward");
        let vocab = model.config().vocab_size;
        for (step, row) in logits.chunks_exact(vocab).enumerate() {
            if margins[step] > 0.5 {
                let got = tandem_engine::sampling::argmax(row);
                assert_eq!(
                    got, generated[step],
                    "{} step {step}: bf16 greedy token (reference margin {})",
                    case["name"], margins[step]
                );
                forced += 1;
            }
        }
    }
    assert!(
        forced >= 40,
        "the reference should have clear-margin steps to compare ({forced})"
    );
    let engine = Engine::start(
        model,
        EngineConfig {
            max_batch_tokens: 16,
            ..EngineConfig::default()
        },
    );
    for case in reference["cases"].as_array().expect("cases") {
        let expected = ids(&case["generated_ids"]);
        let margins: Vec<f64> = case["greedy_margins"]
            .as_array()
            .expect("margins")
            .iter()
            .map(|m| m.as_f64().expect("margin"))
            .collect();
        let clear = margins.iter().take_while(|&&m| m > 0.5).count();
        let got = generate(&engine, ids(&case["prompt_ids"]), expected.len() as u32);
        assert_eq!(
            got[..clear.min(got.len())],
            expected[..clear.min(got.len())],
            "case {} (bf16, first {clear} clear-margin steps)",
            case["name"]
        );
    }
    assert_eq!(
        engine.allocator().free_blocks(),
        engine.allocator().total_blocks(),
        "KV blocks leaked"
    );
}

/// A short prompt submitted behind a long one gets its first token while the long one is still
/// prefilling (the step budget is shared), and the long one still finishes correctly.
#[test]
fn a_short_prompt_behind_a_long_one_is_not_held_up() {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    let engine = Engine::start(
        model,
        EngineConfig {
            max_batch_tokens: 48,
            ..EngineConfig::default()
        },
    );
    // 25 steps of prefill for the long prompt; the short one fits in one step's share.
    let long: Vec<u32> = (0..1200u32).map(|i| 100 + (i * 7919) % 40_000).collect();
    let mut long_rx = engine
        .submit(long, SamplingParams::greedy(2), SeqKind::Generate)
        .expect("submit long");
    let mut short_rx = engine
        .submit(
            vec![504, 3575, 282, 4649, 314],
            SamplingParams::greedy(1),
            SeqKind::Generate,
        )
        .expect("submit short");
    match short_rx.blocking_recv() {
        Some(EngineEvent::Token { token_id, .. }) => {
            assert_eq!(token_id, 7042, "the short prompt's greedy token")
        }
        other => panic!("short prompt: {other:?}"),
    }
    assert!(
        long_rx.try_recv().is_err(),
        "the long prompt produced a token before the short one's first: the short one waited for it"
    );
    let mut n = 0;
    while let Some(EngineEvent::Token { finish, .. }) = long_rx.blocking_recv() {
        n += 1;
        if finish.is_some() {
            break;
        }
    }
    assert_eq!(n, 2, "the long prompt finishes");
    assert_eq!(
        engine.allocator().free_blocks(),
        engine.allocator().total_blocks(),
        "KV blocks leaked"
    );
}

/// A request resumed after `k` of its tokens (prompt + those tokens, `resumed = k`, what is
/// left of `max_tokens`: how the router moves a broken stream to another pair) samples the
/// same continuation as the uninterrupted request, under seeded sampling with every penalty
/// (which count the resumed tokens as output) and the seed's per-step stream.
#[test]
fn a_resumed_request_continues_exactly_where_it_broke_off() {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    let engine = Engine::start(model, EngineConfig::default());
    let prompt = vec![504u32, 3575, 282, 4649, 314, 253, 1345];
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 77,
        max_tokens: 14,
        ignore_eos: true,
        presence_penalty: 0.4,
        frequency_penalty: 0.6,
        repetition_penalty: 1.2,
        ..SamplingParams::default()
    };
    let run = |prompt: Vec<u32>, params: SamplingParams| {
        tandem_engine::blocking_tokens(
            engine
                .submit(prompt, params, SeqKind::Generate)
                .expect("submit"),
        )
    };
    let whole = run(prompt.clone(), params.clone());
    assert_eq!(whole.len(), 14);
    for k in [1usize, 5, 13] {
        let mut resumed_prompt = prompt.clone();
        resumed_prompt.extend_from_slice(&whole[..k]);
        let rest = run(
            resumed_prompt.clone(),
            SamplingParams {
                resumed: k as u32,
                max_tokens: 14 - k as u32,
                ..params.clone()
            },
        );
        assert_eq!(rest, whole[k..], "resumed after {k} tokens");
        // Without the resumed mark the penalties and the seed's steps start over: the
        // continuation differs (what a migration without it would send).
        if k == 5 {
            let naive = run(
                resumed_prompt,
                SamplingParams {
                    max_tokens: 14 - k as u32,
                    ..params.clone()
                },
            );
            assert_ne!(naive, whole[k..], "the resumed mark changes nothing?");
        }
    }
    assert!(
        engine
            .submit(
                prompt.clone(),
                SamplingParams {
                    resumed: 7,
                    ..params
                },
                SeqKind::Generate
            )
            .is_err(),
        "a resumed count covering the whole prompt is refused"
    );
}
