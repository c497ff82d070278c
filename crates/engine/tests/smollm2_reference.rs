//! The engine against Hugging Face transformers: greedy token ids for every case in
//! `shared/reference/smollm2/greedy.json`, and the reference's top-5 logits.

use tandem_core::SamplingParams;
use tandem_engine::{CpuBackend, Engine, EngineConfig, EngineEvent, LlamaModel, SeqKind};

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn generate(engine: &Engine, prompt: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    let mut rx = engine
        .submit(
            prompt,
            SamplingParams::greedy(max_tokens),
            SeqKind::Generate,
        )
        .expect("submit");
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        if let EngineEvent::Token { token_id, finish } = ev {
            out.push(token_id);
            if finish.is_some() {
                break;
            }
        }
    }
    out
}

#[test]
fn greedy_matches_transformers_all_cases_concurrently_and_alone() {
    let reference = tandem_testkit::smollm2_greedy_reference();
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new()).expect("load model");
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
        while let Some(EngineEvent::Token { token_id, finish }) = rx.blocking_recv() {
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
    let model = LlamaModel::load(&dir, CpuBackend::new()).expect("load model");
    let layout = model.kv_layout(16, 64);
    let mut cache = tandem_engine::Backend::kv_cache(model.backend(), layout);
    let blocks: Vec<tandem_core::BlockId> = (0..64).map(tandem_core::BlockId).collect();
    for case in reference["cases"].as_array().expect("cases") {
        let prompt = ids(&case["prompt_ids"]);
        let mut batch = tandem_engine::batch::ForwardBatch::default();
        batch.push(&prompt, 0, &blocks, 16, true);
        let logits = model.forward(&batch, &mut cache);
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
