//! Several choices of one prompt (OpenAI's `n`): the prompt is computed once and every
//! choice decodes over its cache (Llama: full K/V blocks shared, the partial one copied;
//! KDA hybrids: state copied). Each choice must equal the same request run alone with its
//! seed, in one process and across a prefill and a decode engine, and leave the pools whole;
//! a cancelled choice stops without disturbing the others.

use tandem_core::SamplingParams;
use tandem_engine::models::kda_hybrid::served::{KdaModel, KdaServed};
use tandem_engine::models::kda_hybrid::KdaHybridModel;
use tandem_engine::{
    blocking_tokens, CpuBackend, DType, Engine, EngineConfig, EngineEvent, LlamaModel, SeqKind,
};

/// Without the prefix cache: the choices' own sharing is what is counted here (the prefix
/// cache's sharing across requests is prefix_cache.rs's).
fn smollm2() -> Engine {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    let config = EngineConfig {
        prefix_cache: false,
        ..EngineConfig::default()
    };
    Engine::start(model, config)
}

fn kimi_tiny() -> Engine {
    let dir = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    let model = KdaHybridModel::load(&dir).expect("load");
    let config = EngineConfig {
        num_blocks: 64,
        state_slots: 8,
        ..EngineConfig::default()
    };
    KdaServed::start(KdaModel::Single(Box::new(model)), config, vec![2], 4096).expect("start")
}

/// Sampled (so that the choices differ), never stopping early.
fn sampled(seed: u64, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed,
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

fn choices(seed: u64, n: u64, max_tokens: u32) -> Vec<SamplingParams> {
    (0..n).map(|j| sampled(seed + j, max_tokens)).collect()
}

fn alone(engine: &Engine, prompt: &[u32], params: SamplingParams) -> Vec<u32> {
    blocking_tokens(
        engine
            .submit(prompt.to_vec(), params, SeqKind::Generate)
            .expect("submit"),
    )
}

fn assert_pools_whole(engine: &Engine, what: &str) {
    let (total, free) = engine.pools().paged_blocks();
    assert_eq!(free, total, "{what}: paged blocks leaked");
    if let Some(slots) = &engine.pools().slots_total {
        assert_eq!(
            slots.free_blocks(),
            slots.total_blocks(),
            "{what}: state slots leaked"
        );
    }
}

/// Every choice of `prompt` generated in one engine and across a prefill and a decode
/// engine equals that choice alone; the prompt is computed once per request.
fn choices_equal_each_alone(p: &Engine, d: &Engine, prompt: &[u32], what: &str) {
    let (seed, n, max_tokens) = (41, 3, 10);
    let want: Vec<Vec<u32>> = choices(seed, n, max_tokens)
        .into_iter()
        .map(|c| alone(p, prompt, c))
        .collect();
    assert!(
        want.windows(2).any(|w| w[0] != w[1]),
        "{what}: the seeds should give different samples: {want:?}"
    );

    let before = p.stats().prefill_tokens;
    let rxs = p
        .submit_choices(
            prompt.to_vec(),
            choices(seed, n, max_tokens),
            SeqKind::Generate,
        )
        .expect("submit choices");
    let got: Vec<Vec<u32>> = rxs.into_iter().map(blocking_tokens).collect();
    assert_eq!(got, want, "{what}: one process");
    assert_eq!(
        p.stats().prefill_tokens - before,
        prompt.len() as u64,
        "{what}: the prompt is computed once for all choices"
    );
    assert_pools_whole(p, what);

    // P/D: one prefill samples every choice's first token; the decode engine forks.
    let mut rx = p
        .submit_choices(
            prompt.to_vec(),
            choices(seed, n, max_tokens),
            SeqKind::Prefill,
        )
        .expect("prefill")
        .remove(0);
    let Some(EngineEvent::Prefilled {
        first_token,
        finish: None,
        handoff,
        others,
        ..
    }) = rx.blocking_recv()
    else {
        panic!("{what}: no prefill event");
    };
    assert_eq!(others.len(), n as usize - 1);
    assert_pools_whole(p, what);
    let total = prompt.len() + max_tokens as usize;
    let mut reservations = d
        .pools()
        .reserve_choices(total, prompt.len(), n as usize, None)
        .expect("reserve")
        .into_iter();
    let reservation = reservations.next().expect("the first choice's");
    let firsts: Vec<u32> = std::iter::once(first_token)
        .chain(others.iter().map(|o| o.token))
        .collect();
    let forks = reservations.zip(firsts[1..].iter().copied()).collect();
    let rxs = d
        .submit_choices(
            prompt.to_vec(),
            choices(seed, n, max_tokens),
            SeqKind::Decode {
                reservation,
                handoff,
                first_token,
                forks,
            },
        )
        .expect("decode");
    let got: Vec<Vec<u32>> = rxs
        .into_iter()
        .zip(&firsts)
        .map(|(rx, &first)| {
            let mut all = vec![first];
            all.extend(blocking_tokens(rx));
            all
        })
        .collect();
    assert_eq!(got, want, "{what}: P/D");
    assert_pools_whole(d, what);
}

#[test]
fn smollm2_choices_share_one_prefill_and_equal_each_alone() {
    let (p, d) = (smollm2(), smollm2());
    // 37 tokens: two full blocks shared, the third copied at the fork.
    let prompt: Vec<u32> = (0..37).map(|i| 100 + (i * 37) % 900).collect();
    choices_equal_each_alone(&p, &d, &prompt, "smollm2, 37 tokens");
    // A prompt of whole blocks: nothing to copy.
    choices_equal_each_alone(&p, &d, &prompt[..32], "smollm2, 32 tokens");
}

#[test]
fn kda_hybrid_choices_copy_the_state_and_equal_each_alone() {
    let (p, d) = (kimi_tiny(), kimi_tiny());
    let prompt = vec![9u32, 40, 7, 300, 12, 5, 77, 8];
    choices_equal_each_alone(&p, &d, &prompt, "kimi_tiny");
}

#[test]
fn a_cancelled_choice_stops_and_the_others_finish_as_alone() {
    let engine = smollm2();
    let prompt: Vec<u32> = (0..20).map(|i| 200 + i * 13).collect();
    let max_tokens = 32;
    let want: Vec<Vec<u32>> = choices(7, 3, max_tokens)
        .into_iter()
        .map(|c| alone(&engine, &prompt, c))
        .collect();
    let before = engine.stats().generated_tokens;
    let mut rxs = engine
        .submit_choices(prompt.clone(), choices(7, 3, max_tokens), SeqKind::Generate)
        .expect("submit");
    // Choice 1 goes away after its first token.
    let mut cancelled = rxs.remove(1);
    assert!(matches!(
        cancelled.blocking_recv(),
        Some(EngineEvent::Token { finish: None, .. })
    ));
    drop(cancelled);
    let got: Vec<Vec<u32>> = rxs.into_iter().map(blocking_tokens).collect();
    assert_eq!(got, vec![want[0].clone(), want[2].clone()]);
    let generated = engine.stats().generated_tokens - before;
    assert!(
        generated < 3 * u64::from(max_tokens),
        "the cancelled choice kept decoding ({generated} tokens)"
    );
    assert_pools_whole(&engine, "after a cancelled choice");
}

#[test]
fn choices_are_checked_before_anything_runs() {
    let engine = smollm2();
    let mut mixed = choices(1, 2, 8);
    mixed[1].max_tokens = 9;
    let err = engine
        .submit_choices(vec![5, 6, 7], mixed, SeqKind::Generate)
        .expect_err("choices of different lengths");
    assert!(err.to_string().contains("max_tokens"), "{err}");
    let err = engine
        .submit_choices(vec![5, 6, 7], choices(1, 65, 8), SeqKind::Generate)
        .expect_err("more choices than the engine runs at once");
    assert!(err.to_string().contains("65 choices"), "{err}");
    assert_pools_whole(&engine, "after refusals");
}

/// A prompt whose choices have not forked yet still counts every choice against
/// `max_running`: prompts admitted behind it never make the engine run (and a step sample)
/// more than it holds, which would fail every request in flight.
#[test]
fn a_prompts_choices_count_against_max_running_before_they_fork() {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    let engine = Engine::start(
        model,
        EngineConfig {
            max_running: 8,
            ..EngineConfig::default()
        },
    );
    let prompt: Vec<u32> = (0..9).map(|i| 300 + i * 7).collect();
    let want: Vec<Vec<u32>> = choices(3, 4, 6)
        .into_iter()
        .map(|c| alone(&engine, &prompt, c))
        .collect();
    // Five prompts of four choices each, at once: 20 sequences for an engine of 8.
    let groups: Vec<_> = (0..5)
        .map(|_| {
            engine
                .submit_choices(prompt.clone(), choices(3, 4, 6), SeqKind::Generate)
                .expect("submit")
        })
        .collect();
    for (g, rxs) in groups.into_iter().enumerate() {
        let got: Vec<Vec<u32>> = rxs.into_iter().map(blocking_tokens).collect();
        assert_eq!(got, want, "group {g} failed or differs");
    }
    assert_pools_whole(&engine, "after the choices");
}
