//! Prompt log-probabilities (completions' `echo` with `logprobs`): every prompt token after
//! the first is scored given the tokens before it, on logits rows beside the ones a step
//! samples. Checked against Hugging Face transformers' greedy run of SmolLM2
//! (`shared/reference/smollm2/greedy.json`): fed back as a prompt, each generated token is
//! the most likely one at its place, and the reference's top 5 at step 8 come out in order
//! with its logit gaps.

use tandem_core::{SamplingParams, TokenLogprobs};
use tandem_engine::models::kda_hybrid::served::{KdaModel, KdaServed};
use tandem_engine::models::kda_hybrid::KdaHybridModel;
use tandem_engine::{CpuBackend, DType, Engine, EngineConfig, EngineEvent, LlamaModel, SeqKind};

use tandem_testkit::ids;

fn smollm2(max_running: usize) -> Engine {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    Engine::start(
        model,
        EngineConfig {
            max_running,
            ..EngineConfig::default()
        },
    )
}

fn scored(top: u32, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        prompt_logprobs: Some(top),
        ..SamplingParams::greedy(max_tokens)
    }
}

/// A generation's prompt log-probabilities and its tokens.
fn generate(
    engine: &Engine,
    prompt: &[u32],
    params: SamplingParams,
) -> (Vec<TokenLogprobs>, Vec<u32>) {
    let mut rx = engine
        .submit(prompt.to_vec(), params, SeqKind::Generate)
        .expect("submit");
    let (mut prompt_logprobs, mut tokens) = (Vec::new(), Vec::new());
    while let Some(event) = rx.blocking_recv() {
        match event {
            EngineEvent::PromptLogprobs(lps) => {
                assert!(tokens.is_empty(), "prompt log-probabilities after a token");
                prompt_logprobs = lps;
            }
            EngineEvent::Token {
                token_id, finish, ..
            } => {
                tokens.push(token_id);
                if finish.is_some() {
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    (prompt_logprobs, tokens)
}

#[test]
fn prompt_tokens_are_scored_as_transformers_predicts_them() {
    let reference = tandem_testkit::smollm2_greedy_reference();
    let case = &reference["cases"][0];
    let (prompt, generated) = (ids(&case["prompt_ids"]), ids(&case["generated_ids"]));
    // The prompt and 16 of the tokens transformers generated from it, fed back as a prompt.
    let fed: Vec<u32> = prompt.iter().chain(&generated[..16]).copied().collect();
    // Four sequences at most: four rows to score a step, so the prompt is scored in chunks.
    let engine = smollm2(4);
    let (lps, tokens) = generate(&engine, &fed, scored(5, 4));
    assert_eq!(
        lps.len(),
        fed.len() - 1,
        "one entry per prompt token after the first"
    );
    assert_eq!(
        tokens,
        generated[16..20],
        "scoring changed the continuation"
    );
    for (j, lp) in lps.iter().enumerate() {
        assert_eq!(lp.top.len(), 5);
        assert!(
            lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
            "top not sorted: {lp:?}"
        );
        let target = fed[j + 1];
        if let Some(&(_, l)) = lp.top.iter().find(|(t, _)| *t == target) {
            assert!((l - lp.logprob).abs() < 1e-5, "entry {j}: {lp:?}");
        }
        if j + 1 >= prompt.len() {
            // A token transformers generated greedily is the most likely at its place.
            assert_eq!(
                lp.top[0].0, target,
                "entry {j} does not follow the greedy path"
            );
        }
    }
    // Step 8's top 5 (transformers' logits): the same tokens, the same gaps.
    let want: Vec<(u32, f32)> = case["top5_step8"]
        .as_array()
        .expect("top5")
        .iter()
        .map(|p| {
            (
                p[0].as_u64().expect("id") as u32,
                p[1].as_f64().expect("logit") as f32,
            )
        })
        .collect();
    let got = &lps[prompt.len() + 7 - 1].top;
    for (k, (&(tw, lw), &(tg, lg))) in want.iter().zip(got).enumerate() {
        assert_eq!(tg, tw, "step 8's top {k}");
        let (gap_want, gap_got) = (want[0].1 - lw, got[0].1 - lg);
        assert!(
            (gap_want - gap_got).abs() < 1e-3,
            "step 8's gap {k}: {gap_got} vs {gap_want}"
        );
    }
    // In one chunk (room for every row) the values are the same.
    let (whole, same) = generate(&smollm2(32), &fed, scored(5, 4));
    assert_eq!(same, tokens);
    for (a, b) in lps.iter().zip(&whole) {
        assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} vs {b:?}");
        let (ta, tb): (Vec<u32>, Vec<u32>) = (
            a.top.iter().map(|t| t.0).collect(),
            b.top.iter().map(|t| t.0).collect(),
        );
        assert_eq!(ta, tb);
    }
    let (total, free) = engine.pools().paged_blocks();
    assert_eq!(free, total, "blocks leaked");
}

#[test]
fn a_prefill_answers_the_prompt_logprobs_and_each_choice_gets_them() {
    let engine = smollm2(8);
    let prompt: Vec<u32> = (0..23).map(|i| 300 + i * 11).collect();
    let (want, _) = generate(&engine, &prompt, scored(2, 3));
    assert_eq!(want.len(), prompt.len() - 1);
    let mut rx = engine
        .submit(prompt.clone(), scored(2, 3), SeqKind::Prefill)
        .expect("submit");
    match rx.blocking_recv() {
        Some(EngineEvent::Prefilled {
            prompt_logprobs, ..
        }) => assert_eq!(prompt_logprobs, want, "prefill role"),
        other => panic!("expected the prefill, got {other:?}"),
    }
    // Several choices of the prompt: each hears the prompt's log-probabilities.
    let sampled = |seed| SamplingParams {
        temperature: 0.8,
        seed,
        ..scored(2, 3)
    };
    let rxs = engine
        .submit_choices(
            prompt.clone(),
            vec![sampled(1), sampled(2)],
            SeqKind::Generate,
        )
        .expect("submit");
    for mut rx in rxs {
        match rx.blocking_recv() {
            Some(EngineEvent::PromptLogprobs(lps)) => assert_eq!(lps, want, "a choice"),
            other => panic!("expected the prompt's log-probabilities, got {other:?}"),
        }
    }
    // Without them asked for, none come.
    let (none, _) = generate(&engine, &prompt, SamplingParams::greedy(3));
    assert!(none.is_empty());
}

#[test]
fn a_model_that_cannot_score_prompts_says_so() {
    let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    let model = KdaHybridModel::load(&dir).expect("load");
    let config = EngineConfig {
        num_blocks: 64,
        state_slots: 4,
        ..EngineConfig::default()
    };
    let engine =
        KdaServed::start(KdaModel::Single(Box::new(model)), config, vec![1], 4096).expect("start");
    let err = engine
        .submit(vec![5, 6, 7], scored(1, 2), SeqKind::Generate)
        .expect_err("a KDA hybrid does not score prompts");
    assert!(
        err.to_string().contains("prompt log-probabilities"),
        "{err}"
    );
}
