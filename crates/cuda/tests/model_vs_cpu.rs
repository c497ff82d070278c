//! Whole Llama-family models on CUDA against the CPU backend on the same random checkpoint,
//! and the engine (scheduler, continuous batching) on CUDA. Skips without a usable GPU.

mod common;
use common::gpu;

use tandem_core::{BlockId, SamplingParams};
use tandem_cuda::CudaBackend;
use tandem_engine::batch::ForwardBatch;
use tandem_engine::{
    CpuBackend, DType, Engine, EngineConfig, EngineEvent, KvCache, LlamaModel, Ops, SeqKind,
};

fn synth(preset: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    tandem_model::synth::synth_llama(preset, dir.path(), 7).expect("synth");
    dir
}

fn logits<B: Ops>(model: &LlamaModel<B>, ids: &[u32]) -> Vec<f32> {
    let block = 16;
    let blocks = ids.len().div_ceil(block);
    let mut cache = KvCache::new(model.backend(), model.kv_layout(block, blocks));
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let mut batch = ForwardBatch::default();
    batch.push(ids, 0, &table, block, false);
    batch.logits_rows = (0..ids.len()).collect();
    model.forward_batch(&batch, &mut cache).expect("forward")
}

/// Logits within `tol` of the largest logit, and the same greedy token wherever the CPU's
/// top-2 margin is clear of twice that. In bf16 the CUDA path rounds activations to bf16
/// for cuBLAS above 2 rows, where the CPU keeps them f32: the gap grows with depth.
fn compare(preset: &str, dtype: DType, tol: f32) {
    let Some(g) = gpu() else { return };
    let dir = synth(preset);
    let cpu = LlamaModel::load(dir.path(), CpuBackend::new(), dtype).expect("cpu load");
    let cuda = LlamaModel::load(dir.path(), g, dtype).expect("cuda load");
    let vocab = cpu.config().vocab_size as u32;
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let (a, b) = (logits(&cpu, &ids), logits(&cuda, &ids));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    eprintln!("{preset} {dtype}: max |cpu - cuda| logit = {worst} (largest logit {scale})");
    assert!(
        worst <= tol * scale,
        "{preset} {dtype}: logits differ by {worst}, over {tol} of the largest ({scale})"
    );
    let vocab = vocab as usize;
    let (mut same, mut clear) = (0, 0);
    for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
        let mut sorted = ra.to_vec();
        sorted.sort_by(|x, y| y.total_cmp(x));
        if sorted[0] - sorted[1] > 2.0 * tol * scale {
            clear += 1;
            same += usize::from(
                tandem_engine::sampling::argmax(ra) == tandem_engine::sampling::argmax(rb),
            );
        }
    }
    assert_eq!(
        same, clear,
        "{preset} {dtype}: greedy tokens differ where margins are clear"
    );
}

#[test]
fn tiny_llama_logits_match_the_cpu_in_f32() {
    compare("tiny", DType::F32, 1e-4);
}

#[test]
fn tiny_llama_logits_match_the_cpu_in_bf16() {
    compare("tiny", DType::BF16, 2e-2);
}

#[test]
fn smollm2_shape_logits_match_the_cpu_in_bf16() {
    compare("smollm2", DType::BF16, 3e-2);
}

/// The logits of each batch in turn, over one cache of `blocks` blocks.
fn logits_of_steps<B: Ops>(
    model: &LlamaModel<B>,
    steps: &[ForwardBatch],
    blocks: usize,
) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(model.backend(), model.kv_layout(16, blocks));
    steps
        .iter()
        .map(|batch| model.forward_batch(batch, &mut cache).expect("forward"))
        .collect()
}

/// Two prompts prefilled together, then a decode step of both (2 rows) and one of the first
/// alone (1 row): the decode paths (fused GEMVs, split attention with the merge in-kernel)
/// against the CPU. The caches already differ by the prefill's bf16 rounding, so the bound is
/// the bf16 one of `compare`.
fn compare_decode(preset: &str, tol: f32) {
    let Some(g) = gpu() else { return };
    let dir = synth(preset);
    let cpu = LlamaModel::load(dir.path(), CpuBackend::new(), DType::BF16).expect("cpu load");
    let cuda = LlamaModel::load(dir.path(), g, DType::BF16).expect("cuda load");
    let vocab = cpu.config().vocab_size as u32;
    let block = 16;
    let a: Vec<u32> = (0..70u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let b: Vec<u32> = (0..23u32).map(|i| (i * 104_729 + 5) % vocab).collect();
    let table_a: Vec<BlockId> = (0..6).map(BlockId).collect();
    let table_b: Vec<BlockId> = (6..9).map(BlockId).collect();
    let mut prefill = ForwardBatch::default();
    prefill.push(&a, 0, &table_a, block, true);
    prefill.push(&b, 0, &table_b, block, true);
    let mut two = ForwardBatch::default();
    two.push(&[a[3]], a.len(), &table_a, block, true);
    two.push(&[b[3]], b.len(), &table_b, block, true);
    let mut one = ForwardBatch::default();
    one.push(&[a[5]], a.len() + 1, &table_a, block, true);
    let steps = [prefill, two, one];
    let (want, got) = (
        logits_of_steps(&cpu, &steps, 9),
        logits_of_steps(&cuda, &steps, 9),
    );
    for (i, (x, y)) in want.iter().zip(&got).enumerate() {
        let worst = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max);
        let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        eprintln!("{preset} step {i}: max |cpu - cuda| logit = {worst} (largest logit {scale})");
        assert!(
            worst <= tol * scale,
            "{preset} step {i}: logits differ by {worst}, over {tol} of the largest ({scale})"
        );
        for (ra, rb) in x
            .chunks_exact(vocab as usize)
            .zip(y.chunks_exact(vocab as usize))
        {
            let mut sorted = ra.to_vec();
            sorted.sort_by(|p, q| q.total_cmp(p));
            if sorted[0] - sorted[1] > 2.0 * tol * scale {
                assert_eq!(
                    tandem_engine::sampling::argmax(ra),
                    tandem_engine::sampling::argmax(rb),
                    "{preset} step {i}: greedy tokens differ where the margin is clear"
                );
            }
        }
    }
}

#[test]
fn tiny_llama_decode_steps_match_the_cpu_in_bf16() {
    compare_decode("tiny", 2e-2);
}

#[test]
fn smollm2_shape_decode_steps_match_the_cpu_in_bf16() {
    compare_decode("smollm2", 3e-2);
}

fn run(
    engine: &Engine,
    prompt: Vec<u32>,
    n: u32,
) -> tokio::sync::mpsc::UnboundedReceiver<EngineEvent> {
    engine
        .submit(prompt, SamplingParams::greedy(n), SeqKind::Generate)
        .expect("submitted")
}

#[test]
fn the_engine_on_cuda_gives_each_request_the_tokens_it_gets_alone() {
    let Some(g) = gpu() else { return };
    let dir = synth("tiny");
    let model = LlamaModel::load(dir.path(), g, DType::F32).expect("load");
    let engine = Engine::start(model, EngineConfig::default());
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|s| {
            (0..(5 + 9 * s))
                .map(|i| (i * 31 + s * 101) % 500 + 3)
                .collect()
        })
        .collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tandem_engine::blocking_tokens(run(&engine, p.clone(), 12)))
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| run(&engine, p.clone(), 12))
        .collect();
    let together: Vec<Vec<u32>> = streams
        .into_iter()
        .map(tandem_engine::blocking_tokens)
        .collect();
    assert_eq!(
        alone, together,
        "batch composition changed a request's greedy tokens"
    );
    assert!(alone.iter().all(|t| t.len() == 12));
}

/// Several choices of one prompt on the device (the prompt's K/V blocks shared, the
/// partial one copied at the fork): each choice equals the same seed alone, and the pool
/// ends whole. In f32: in bf16 a step of 4 rows and one of 1 round differently (cuBLAS vs
/// the GEMV kernels), which moves samples of this flat random model's distribution.
#[test]
fn choices_of_one_prompt_on_cuda_equal_each_seed_alone() {
    let Some(g) = gpu() else { return };
    let dir = synth("tiny");
    let model = LlamaModel::load(dir.path(), g, DType::F32).expect("load");
    let engine = Engine::start(model, EngineConfig::default());
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 53) % 500 + 3).collect();
    let params = |seed: u64| SamplingParams {
        temperature: 1.0,
        seed,
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    let alone: Vec<Vec<u32>> = (0..4)
        .map(|j| {
            tandem_engine::blocking_tokens(
                engine
                    .submit(prompt.clone(), params(5 + j), SeqKind::Generate)
                    .expect("submitted"),
            )
        })
        .collect();
    let together: Vec<Vec<u32>> = engine
        .submit_choices(
            prompt.clone(),
            (0..4).map(|j| params(5 + j)).collect(),
            SeqKind::Generate,
        )
        .expect("submitted")
        .into_iter()
        .map(tandem_engine::blocking_tokens)
        .collect();
    assert_eq!(together, alone, "a choice differs from its seed alone");
    assert!(
        alone.iter().skip(1).any(|t| t != &alone[0]),
        "four seeds sampled alike: no check"
    );
    let (total, free) = engine.pools().paged_blocks();
    assert_eq!(free, total, "blocks leaked");
}

/// Prompt log-probabilities (`echo` with `logprobs`) on the device, scored on logits rows
/// beside the sampled ones over several chunks (`max_running` 4: four rows a step), equal the
/// CPU engine's.
#[test]
fn prompt_logprobs_on_cuda_match_the_cpu_engine() {
    let Some(g) = gpu() else { return };
    let dir = synth("tiny");
    let config = EngineConfig {
        max_running: 4,
        ..EngineConfig::default()
    };
    let cuda = Engine::start(
        LlamaModel::load(dir.path(), g, DType::F32).expect("load"),
        config.clone(),
    );
    let cpu = Engine::start(
        LlamaModel::load(dir.path(), tandem_engine::CpuBackend::new(), DType::F32).expect("load"),
        config,
    );
    let prompt: Vec<u32> = (0..30u32).map(|i| (i * 29) % 400 + 3).collect();
    let params = SamplingParams {
        prompt_logprobs: Some(3),
        ..SamplingParams::greedy(4)
    };
    let scored = |e: &Engine| {
        let mut rx = e
            .submit(prompt.clone(), params.clone(), SeqKind::Generate)
            .expect("submitted");
        match rx.blocking_recv() {
            Some(EngineEvent::PromptLogprobs(lps)) => lps,
            other => panic!("expected the prompt's log-probabilities, got {other:?}"),
        }
    };
    let (a, b) = (scored(&cuda), scored(&cpu));
    assert_eq!(a.len(), prompt.len() - 1);
    for (x, y) in a.iter().zip(&b) {
        assert!((x.logprob - y.logprob).abs() < 1e-3, "{x:?} vs {y:?}");
        assert_eq!(x.top.len(), 3);
        assert_eq!(x.top[0].0, y.top[0].0);
    }
}

/// SmolLM2's tokenizer: `TANDEM_TEST_TOKENIZER` (the GPU bundle sets it), else the pulled
/// model's.
fn smollm2_tokenizer() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("TANDEM_TEST_TOKENIZER")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| {
                std::path::Path::new(&h)
                    .join(".cache/tandem/models/smollm2-135m-instruct/tokenizer.json")
            })
        })?;
    path.exists().then_some(path)
}

/// Structured outputs on CUDA: the grammar's mask reaches the device's logits (through
/// `Ops::adjust_logits`) and the sampled output parses and keeps to its schema.
#[test]
fn constrained_decoding_on_cuda_keeps_to_the_schema() {
    let Some(g) = gpu() else { return };
    let Some(tokenizer) = smollm2_tokenizer() else {
        eprintln!("skipping: no SmolLM2 tokenizer.json (set TANDEM_TEST_TOKENIZER)");
        return;
    };
    let dir = synth("smollm2");
    let model = LlamaModel::load(dir.path(), g, DType::BF16).expect("load");
    let engine = Engine::start(
        model,
        EngineConfig {
            tokenizer: Some(tokenizer.clone()),
            ..EngineConfig::default()
        },
    );
    let tk = tokenizers::Tokenizer::from_file(&tokenizer).expect("tokenizer");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog"]}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    });
    let streams: Vec<_> = (0..4u64)
        .map(|seed| {
            let params = SamplingParams {
                temperature: if seed == 0 { 0.0 } else { 1.0 },
                seed,
                constraint: Some(tandem_core::OutputConstraint::JsonSchema(
                    schema.to_string(),
                )),
                ..SamplingParams::greedy(64)
            };
            let prompt: Vec<u32> = (0..20u32)
                .map(|i| (i * 7919 + seed as u32) % 40_000 + 100)
                .collect();
            engine
                .submit(prompt, params, SeqKind::Generate)
                .expect("submitted")
        })
        .collect();
    for (seed, rx) in streams.into_iter().enumerate() {
        let ids = tandem_engine::blocking_tokens(rx);
        let text = tk.decode(&ids, true).expect("decode");
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        let o = v.as_object().expect("an object");
        assert_eq!(o.len(), 3, "{text}");
        assert!(
            o["name"].as_str().is_some_and(|n| n.chars().count() <= 8),
            "{text}"
        );
        assert!(o["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert!(
            ["cat", "dog"].contains(&o["pet"].as_str().expect("pet")),
            "{text}"
        );
        eprintln!("seed {seed}: {text}");
    }
}

/// Step buffers that live as long as the recordings made over them (as in the engine).
struct Steps {
    meta: tandem_engine::StepMeta<CudaBackend>,
    ws: tandem_engine::LlamaWorkspace<CudaBackend>,
    graphs: tandem_cuda::graph::StepGraphs,
}

/// One decode step of `batch` sequences over `context` cached tokens, eagerly or as the
/// engine runs it (through `run_step` with its graph cache); the logits' bits.
fn decode_logits(
    model: &LlamaModel<CudaBackend>,
    steps: &mut Steps,
    cache: &mut KvCache<CudaBackend>,
    batch: usize,
    context: usize,
    recorded: bool,
) -> Vec<u32> {
    use tandem_engine::Backend;
    let block = 16;
    let per_seq = steps.meta.table_stride();
    let mut fb = ForwardBatch::default();
    for s in 0..batch {
        let table: Vec<BlockId> = (0..per_seq)
            .map(|i| BlockId((s * per_seq + i) as u32))
            .collect();
        fb.push(&[(s * 13 + 5) as u32], context, &table, block, true);
    }
    let b = model.backend();
    steps.meta.upload(b, &fb).expect("fits");
    let Steps { meta, ws, graphs } = steps;
    let mut result = Ok(());
    if recorded {
        b.run_step(graphs, Some(meta.shape()), &mut || {
            result = model.forward(meta, cache, ws)
        });
    } else {
        result = model.forward(meta, cache, ws);
    }
    result.expect("forward");
    let vocab = model.config().vocab_size;
    let mut v = b.download(&ws.logits).to_f32_vec();
    v.truncate(batch * vocab);
    v.into_iter().map(f32::to_bits).collect()
}

#[test]
fn graph_replays_equal_eager_steps_bit_for_bit() {
    use tandem_engine::{StepLimits, StepMeta};
    let Some(g) = gpu() else { return };
    let dir = synth("tiny");
    let model = LlamaModel::load(dir.path(), g, DType::BF16).expect("load");
    let per_seq = 1024 / 16;
    let mut cache = KvCache::new(model.backend(), model.kv_layout(16, 32 * per_seq));
    let limits = StepLimits {
        max_tokens: 32,
        max_seqs: 32,
        max_blocks_per_seq: per_seq,
    };
    for batch in [1usize, 3, 8, 9, 32] {
        let mut steps = Steps {
            meta: StepMeta::new(model.backend(), limits),
            ws: model.workspace(limits),
            graphs: tandem_cuda::graph::StepGraphs::default(),
        };
        for context in [100, 120, 500] {
            let eager = decode_logits(&model, &mut steps, &mut cache, batch, context, false);
            // First sight runs eagerly, the second captures and launches, then replays.
            for round in 0..3 {
                let replay = decode_logits(&model, &mut steps, &mut cache, batch, context, true);
                assert!(
                    replay == eager,
                    "batch {batch} context {context}: round {round} differs from the eager step"
                );
            }
        }
        // 100 and 120 share a bucket (one recording), 500 has its own.
        assert_eq!(steps.graphs.len(), 2, "batch {batch}: recordings");
    }
}

#[test]
fn a_recorded_step_replays_with_refreshed_weights_without_a_new_capture() {
    use tandem_engine::{StepLimits, StepMeta};
    let Some(g) = gpu() else { return };
    let (a, b) = (synth("tiny"), tempfile::tempdir().expect("temp dir"));
    tandem_model::synth::synth_llama("tiny", b.path(), 8).expect("synth");
    let mut model = LlamaModel::load(a.path(), g.clone(), DType::BF16).expect("load a");
    let fresh_b = LlamaModel::load(b.path(), g, DType::BF16).expect("load b");
    let per_seq = 1024 / 16;
    let limits = StepLimits {
        max_tokens: 8,
        max_seqs: 8,
        max_blocks_per_seq: per_seq,
    };
    let layout = model.kv_layout(16, 8 * per_seq);
    let (mut cache, mut cache_b) = (
        KvCache::new(model.backend(), layout),
        KvCache::new(fresh_b.backend(), layout),
    );
    let mut steps = Steps {
        meta: StepMeta::new(model.backend(), limits),
        ws: model.workspace(limits),
        graphs: tandem_cuda::graph::StepGraphs::default(),
    };
    let mut steps_b = Steps {
        meta: StepMeta::new(fresh_b.backend(), limits),
        ws: fresh_b.workspace(limits),
        graphs: tandem_cuda::graph::StepGraphs::default(),
    };
    // Record the step on checkpoint a (eager, capture, replay).
    let mut on_a = Vec::new();
    for _ in 0..3 {
        on_a = decode_logits(&model, &mut steps, &mut cache, 4, 100, true);
    }
    assert_eq!(steps.graphs.len(), 1);
    model.refresh(b.path()).expect("refresh");
    let replayed = decode_logits(&model, &mut steps, &mut cache, 4, 100, true);
    assert_eq!(steps.graphs.len(), 1, "the refresh needed no new capture");
    let want = decode_logits(&fresh_b, &mut steps_b, &mut cache_b, 4, 100, false);
    assert_ne!(on_a, want, "the checkpoints differ");
    assert!(
        replayed == want,
        "the replay after the refresh did not use the new weights"
    );
}

/// Penalties, bias, `min_tokens` and log-probabilities go through the backend's default
/// (host-copy) logit adjustment and row download on CUDA: the same tokens and
/// log-probabilities as the CPU engine on the same f32 checkpoint.
#[test]
fn sampling_controls_and_logprobs_on_cuda_match_the_cpu_engine() {
    let Some(g) = gpu() else { return };
    let dir = synth("tiny");
    let cuda = Engine::start(
        LlamaModel::load(dir.path(), g, DType::F32).expect("load"),
        EngineConfig::default(),
    );
    let cpu = Engine::start(
        LlamaModel::load(dir.path(), tandem_engine::CpuBackend::new(), DType::F32).expect("load"),
        EngineConfig::default(),
    );
    let params = SamplingParams {
        frequency_penalty: 1.5,
        repetition_penalty: 1.3,
        logit_bias: vec![(7, 3.0)],
        min_tokens: 6,
        logprobs: Some(3),
        ignore_eos: false,
        ..SamplingParams::greedy(10)
    };
    let prompt: Vec<u32> = (0..21u32).map(|i| (i * 17) % 300 + 3).collect();
    let collect = |e: &Engine| {
        common::generated(e, &prompt, &params)
            .into_iter()
            .map(|(t, lp)| (t, lp.expect("asked for")))
            .collect::<Vec<_>>()
    };
    let (a, b) = (collect(&cuda), collect(&cpu));
    let ids = |v: &[(u32, tandem_core::TokenLogprobs)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(ids(&a), ids(&b), "tokens differ from the CPU's");
    for ((_, x), (_, y)) in a.iter().zip(&b) {
        assert!((x.logprob - y.logprob).abs() < 1e-3, "{x:?} vs {y:?}");
        assert_eq!(x.top.len(), 3);
        assert_eq!(x.top[0].0, y.top[0].0);
    }
    let plain = tandem_engine::blocking_tokens(
        cuda.submit(
            prompt.clone(),
            SamplingParams::greedy(10),
            SeqKind::Generate,
        )
        .expect("submitted"),
    );
    assert_ne!(plain, ids(&a), "the controls changed nothing on CUDA");
}

/// Tensor-parallel ranks sharing the one GPU (a thread and a stream each, collectives through
/// host memory): tp2 gives the greedy tokens tp1 gives, through the engine.
#[test]
fn tensor_parallel_ranks_on_one_gpu_equal_one_rank() {
    let Some(g) = gpu() else { return };
    let dir = synth("tiny");
    let prompt: Vec<u32> = (0..21u32).map(|i| (i * 37 + 5) % 500 + 3).collect();
    let one = Engine::start(
        LlamaModel::load(dir.path(), g.clone(), DType::F32).expect("load"),
        EngineConfig::default(),
    );
    let want = tandem_engine::blocking_tokens(run(&one, prompt.clone(), 10));
    drop(one);
    let ranks = |r: usize| {
        if r == 0 {
            Ok(g.clone())
        } else {
            tandem_engine::Backend::new_stream(&g)
        }
    };
    let shards =
        tandem_engine::models::llama::served::in_process_shards(dir.path(), DType::F32, 2, ranks)
            .expect("tp2 shards");
    let two = Engine::start_sharded(shards, EngineConfig::default()).expect("start");
    let got = tandem_engine::blocking_tokens(run(&two, prompt, 10));
    assert_eq!(got, want, "tp2 on one GPU vs one rank");
}
