//! Prefix caching on the paged K/V pool (SmolLM2, CPU, f32): a prompt that starts with the
//! full blocks of an earlier request's prompt, or of an earlier conversation turn's prompt and
//! answer, computes only the rest, and every output is bit for bit what an engine without the
//! cache gives; cached blocks give way under memory pressure; choices (`n`) and the prefill
//! role's handoff work over cached blocks; the pools are whole after every request.

use tandem_core::SamplingParams;
use tandem_engine::{
    blocking_tokens, CpuBackend, DType, Engine, EngineConfig, EngineEvent, Handoff, LlamaModel,
    SeqKind,
};

fn smollm2(prefix_cache: bool, num_blocks: usize) -> Engine {
    let dir = tandem_testkit::smollm2_dir();
    let model = LlamaModel::load(&dir, CpuBackend::new(), DType::F32).expect("load model");
    Engine::start(
        model,
        EngineConfig {
            prefix_cache,
            num_blocks,
            ..EngineConfig::default()
        },
    )
}

/// Token ids of SmolLM2's vocabulary, distinct per `seed`.
fn text(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 100 + (seed * 7919 + i * 37) % 20_000)
        .collect()
}

fn greedy(engine: &Engine, prompt: &[u32], max_tokens: u32) -> Vec<u32> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    blocking_tokens(
        engine
            .submit(prompt.to_vec(), params, SeqKind::Generate)
            .expect("submit"),
    )
}

/// `greedy` on `engine`, and the prompt tokens it computed.
fn computed(engine: &Engine, prompt: &[u32], max_tokens: u32) -> (Vec<u32>, u64) {
    let before = engine.stats().prefill_tokens;
    let out = greedy(engine, prompt, max_tokens);
    (out, engine.stats().prefill_tokens - before)
}

fn assert_pools_whole(engine: &Engine, what: &str) {
    let (total, free) = engine.pools().paged_blocks();
    assert_eq!(
        free, total,
        "{what}: paged blocks held after the requests ended"
    );
}

#[test]
fn shared_prefixes_and_later_turns_compute_only_their_new_tokens() {
    let (on, off) = (smollm2(true, 256), smollm2(false, 256));
    let bs = EngineConfig::default().block_size;
    // A "system prompt" of two full blocks and half a third.
    let system = text(1, 2 * bs + bs / 2);
    let first = [system.clone(), text(2, 7)].concat();
    let (out1, n1) = computed(&on, &first, 8);
    assert_eq!(out1, greedy(&off, &first, 8), "a cold request");
    assert_eq!(
        n1,
        first.len() as u64,
        "nothing cached yet: the whole prompt computes"
    );

    // Another request with the same system prompt: the two full blocks come from the cache;
    // the shared half block does not (only full blocks are cached).
    let second = [system.clone(), text(3, 12)].concat();
    let (out2, n2) = computed(&on, &second, 8);
    assert_eq!(
        out2,
        greedy(&off, &second, 8),
        "a prefix hit ending mid-block"
    );
    assert_eq!(n2, (second.len() - 2 * bs) as u64);

    // The first conversation's next turn: its prompt and answer are cached, up to the last
    // full block whose K/V was written (the last answer token was never fed back).
    let turn = [first.clone(), out1.clone(), text(4, 5)].concat();
    let written = first.len() + out1.len() - 1;
    let (out3, n3) = computed(&on, &turn, 8);
    assert_eq!(out3, greedy(&off, &turn, 8), "a second turn");
    assert_eq!(n3, (turn.len() - written / bs * bs) as u64);

    // The same prompt again: everything but its last token is cached when it is block-aligned.
    let aligned = text(5, 3 * bs + 1);
    let (a1, _) = computed(&on, &aligned, 4);
    let (a2, n_again) = computed(&on, &aligned, 4);
    assert_eq!(a1, a2);
    assert_eq!(n_again, 1, "one token computes, for its logits");

    let stats = on.stats();
    assert!(
        stats.prefix_hit_tokens >= (2 * bs + 3 * bs) as u64
            && stats.prefix_hit_tokens < stats.prefix_queried_tokens,
        "hit counters: {stats:?}"
    );
    assert_eq!(
        off.stats().prefix_queried_tokens,
        0,
        "the cache is off there"
    );
    assert_pools_whole(&on, "cache on");
    assert_pools_whole(&off, "cache off");
}

#[test]
fn cached_blocks_give_way_to_new_requests_and_are_recomputed_after() {
    let bs = EngineConfig::default().block_size;
    // Room for one request of 11 blocks at a time.
    let on = smollm2(true, 12);
    let a = text(6, 4 * bs + 3);
    let (out_a, _) = computed(&on, &a, 4);
    let cached = on.pools().kv.as_ref().expect("paged").0.prefix_stats();
    assert!(cached.cached_blocks >= 4, "{cached:?}");
    // A long unrelated request needs every block: the idle cached ones are evicted.
    let b = text(7, 10 * bs);
    let (_, nb) = computed(&on, &b, 8);
    assert_eq!(nb, b.len() as u64);
    // `a` again: its blocks are gone (or some of them), and its output is unchanged.
    let (again, na) = computed(&on, &a, 4);
    assert_eq!(again, out_a);
    assert!(
        na > 3,
        "a's blocks should have been evicted, computed only {na}"
    );
    assert_pools_whole(&on, "after eviction");
}

#[test]
fn choices_and_prefill_handoffs_over_cached_blocks_equal_cold_ones() {
    let bs = EngineConfig::default().block_size;
    let (on, off) = (smollm2(true, 256), smollm2(false, 256));
    let system = text(8, 3 * bs);
    let warm = [system.clone(), text(9, 4)].concat();
    greedy(&on, &warm, 2);

    // Choices of a prompt whose prefix is cached: each as the cache-less engine samples it.
    let prompt = [system.clone(), text(10, 9)].concat();
    let choices: Vec<SamplingParams> = (0..3)
        .map(|j| SamplingParams {
            temperature: 0.8,
            seed: 100 + j,
            ignore_eos: true,
            ..SamplingParams::greedy(6)
        })
        .collect();
    let run = |e: &Engine| -> Vec<Vec<u32>> {
        e.submit_choices(prompt.clone(), choices.clone(), SeqKind::Generate)
            .expect("submit")
            .into_iter()
            .map(blocking_tokens)
            .collect()
    };
    let before = on.stats().prefix_hit_tokens;
    assert_eq!(run(&on), run(&off), "choices over a cached prefix");
    assert_eq!(on.stats().prefix_hit_tokens - before, 3 * bs as u64);

    // The prefill role: the handoff of a prompt served from the cache carries the very K/V
    // of one computed cold.
    let prefill = |e: &Engine| -> (u32, Handoff) {
        let mut rx = e
            .submit(prompt.clone(), SamplingParams::greedy(4), SeqKind::Prefill)
            .expect("prefill");
        match rx.blocking_recv() {
            Some(EngineEvent::Prefilled {
                first_token,
                handoff,
                ..
            }) => (first_token, handoff),
            other => panic!("no prefill event: {other:?}"),
        }
    };
    let (hot, cold) = (prefill(&on), prefill(&off));
    assert_eq!(hot.0, cold.0, "first token");
    assert_eq!(hot.1.segments, cold.1.segments);
    assert!(hot.1.body == cold.1.body, "the handoff's K/V bytes differ");
    assert_pools_whole(&on, "cache on");
}

fn kda(name: &str, prefix_cache: bool) -> Engine {
    let dir = tandem_testkit::shared_dir().join("reference").join(name);
    let model = tandem_engine::models::kda_hybrid::KdaHybridModel::load(&dir).expect("load");
    let config = EngineConfig {
        num_blocks: 64,
        state_slots: 8,
        prefix_cache,
        ..EngineConfig::default()
    };
    tandem_engine::models::kda_hybrid::served::KdaServed::start(
        tandem_engine::models::kda_hybrid::served::KdaModel::Single(Box::new(model)),
        config,
        vec![2],
        4096,
    )
    .expect("start")
}

/// KDA hybrids keep whole states: a conversation's next turn, generated in one process or
/// prefilled by the prefill role, starts from the state its last turn left and computes only
/// the new tokens, with the greedy output of an engine that keeps nothing.
#[test]
fn kda_turns_start_from_the_state_their_last_turn_left() {
    for name in ["kimi_tiny", "glm5_tiny"] {
        let (on, off) = (kda(name, true), kda(name, false));
        let small = |seed: u32, n: usize| -> Vec<u32> {
            (0..n as u32)
                .map(|i| 3 + (seed * 131 + i * 17) % 400)
                .collect()
        };
        let first = small(1, 21);
        let (out1, n1) = computed(&on, &first, 6);
        assert_eq!(out1, greedy(&off, &first, 6), "{name}: first turn");
        assert_eq!(n1, first.len() as u64);

        let turn = [first.clone(), out1.clone(), small(2, 9)].concat();
        let written = first.len() + out1.len() - 1;
        let (out2, n2) = computed(&on, &turn, 6);
        assert_eq!(out2, greedy(&off, &turn, 6), "{name}: second turn");
        assert_eq!(
            n2,
            (turn.len() - written) as u64,
            "{name}: only the new tokens"
        );

        // The prefill role keeps the prompt's state it exports: the next prompt that extends
        // it computes only the extension, and hands off the state a cold prefill hands off.
        let prefill = |e: &Engine, prompt: &[u32]| -> u32 {
            let mut rx = e
                .submit(prompt.to_vec(), SamplingParams::greedy(4), SeqKind::Prefill)
                .expect("prefill");
            match rx.blocking_recv() {
                Some(EngineEvent::Prefilled { first_token, .. }) => first_token,
                other => panic!("{name}: no prefill event: {other:?}"),
            }
        };
        let p1 = small(3, 30);
        prefill(&on, &p1);
        let p2 = [p1.clone(), small(4, 11)].concat();
        let before = on.stats().prefill_tokens;
        assert_eq!(prefill(&on, &p2), prefill(&off, &p2), "{name}: prefill");
        assert_eq!(
            on.stats().prefill_tokens - before,
            11,
            "{name}: the extension only"
        );
        let stats = on.stats();
        assert!(stats.prefix_snapshot_bytes > 0, "{name}: {stats:?}");
        assert_eq!(
            stats.prefix_hit_tokens,
            (written + p1.len()) as u64,
            "{name}: {stats:?}"
        );
        let slots = on.pools().slots_total.as_ref().expect("slots");
        assert_eq!(
            slots.free_blocks(),
            slots.total_blocks(),
            "{name}: slots held"
        );
    }
}
