//! KDA-hybrid models (Kimi-Linear, GLM-5.3-Flash style) on CUDA: the public tiny checkpoints
//! against their transformers references (logits at every position, greedy steps), the CPU
//! backend on the same weights in bf16, and the engine's P/D handoff between devices (CPU →
//! GPU, GPU → CPU, GPU → GPU) equal to one process. Skips without a usable GPU.

mod common;
use common::gpu;

use tandem_core::SamplingParams;
use tandem_cuda::CudaBackend;
use tandem_engine::backend::HybridOps;
use tandem_engine::models::kda_hybrid::served::{KdaModel, KdaServed};
use tandem_engine::models::kda_hybrid::{KdaHybridModel, LoadOptions};
use tandem_engine::{blocking_tokens, CpuBackend, DType, Engine, EngineConfig, EngineEvent};
use tandem_engine::{Backend, Handoff, SeqKind};
use tandem_testkit::max_abs_diff;
use tandem_topology::{Layout, Rank};

const MODELS: [&str; 2] = ["kimi_tiny", "glm5_tiny"];

fn reference_dir(name: &str) -> std::path::PathBuf {
    tandem_testkit::shared_dir().join("reference").join(name)
}

fn reference(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(reference_dir(name).join("reference.json"))
        .expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

fn load<B: HybridOps>(backend: B, name: &str, dtype: DType) -> KdaHybridModel<B> {
    let options = LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    KdaHybridModel::load_on(backend, &reference_dir(name), &options).expect("load")
}

fn rows(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| r.as_array().expect("a row").iter())
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// f32 weights on the GPU against transformers' f32 run: every position's logits and the
/// greedy continuation (prefill chunked, then one recurrent step per token).
#[test]
fn tiny_checkpoints_match_transformers_on_the_gpu() {
    let Some(g) = gpu() else { return };
    for name in MODELS {
        let model = load(g.clone(), name, DType::F32);
        let r = reference(name);
        for seq in r["sequences"].as_array().expect("sequences") {
            let ids = tandem_testkit::ids(&seq["input_ids"]);
            let want = rows(&seq["logits"]);
            let got = model.forward_full(&ids);
            let diff = max_abs_diff(&got, &want);
            eprintln!(
                "{name} {}: max |logit - transformers| = {diff}",
                seq["name"]
            );
            assert!(
                diff < 2e-3,
                "{name} {}: logits differ by {diff}",
                seq["name"]
            );
            let greedy = &seq["greedy"];
            let want_ids = tandem_testkit::ids(&greedy["generated_ids"]);
            let want_steps = rows(&greedy["step_logits"]);
            let vocab = want_steps.len() / want_ids.len();
            let mut state = model.new_state();
            let mut logits = model.prefill(&ids, &mut state);
            let mut got_ids = Vec::new();
            let mut worst = 0.0f32;
            for (step, want_row) in want_steps.chunks_exact(vocab).enumerate() {
                worst = worst.max(max_abs_diff(&logits, want_row));
                let id = tandem_engine::sampling::argmax(&logits);
                got_ids.push(id);
                if step + 1 < want_ids.len() {
                    logits = model.decode_step(id, &mut state);
                }
            }
            eprintln!(
                "{name} {}: greedy step logits max |diff| = {worst}",
                seq["name"]
            );
            assert_eq!(got_ids, want_ids, "{name} {}: greedy ids", seq["name"]);
            assert!(
                worst < 2e-3,
                "{name} {}: step logits differ by {worst}",
                seq["name"]
            );
        }
    }
}

/// transformers' own bf16 run of a tiny reference on the bf16 test's ids
/// (`scripts/gpu/tiny_bf16_reference.py`, kept in `tests/data/tiny_bf16_transformers.json`;
/// `TANDEM_BF16_REFERENCE` names another copy): at how many of its clear f32 positions its
/// bf16 argmax equals its f32 one; `None` where transformers could not run the model (the
/// file says why).
fn transformers_bf16_agreement(name: &str, ids: &[u32]) -> Option<(usize, usize)> {
    let path = std::env::var_os("TANDEM_BF16_REFERENCE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/data/tiny_bf16_transformers.json")
        });
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (made on the GPU machine by scripts/gpu/tiny_bf16_reference.py)",
            path.display()
        )
    });
    let v: serde_json::Value = serde_json::from_str(&text).expect("it parses");
    assert_eq!(
        tandem_testkit::ids(&v["ids"]),
        ids,
        "the reference was made on other ids"
    );
    if let Some(why) = v[name]["unavailable"].as_str() {
        eprintln!("{name}: no transformers bf16 reference ({why})");
        return None;
    }
    let count = |k: &str| v[name][k].as_u64().expect(k) as usize;
    Some((count("bf16_equal_f32_on_clear"), count("clear")))
}

/// bf16 weights: the GPU's products round activations to bf16 above the GEMV row counts (as
/// transformers' bf16 run does), where the CPU keeps them f32 for the model's matrices, and a
/// rounding can flip an MoE routing choice; so the GPU in bf16 is held to the CPU's f32 model
/// by its greedy choice at every position whose f32 top-2 margin is clear, not by logits, and
/// must agree about as often as transformers' own bf16 run agrees with its f32 one (these
/// random tiny weights leave many near-ties, and bf16 drifts through the KDA state).
#[test]
fn bf16_weights_pick_the_f32_models_tokens() {
    let Some(g) = gpu() else { return };
    let ids: Vec<u32> = (0..70u32).map(|i| 3 + (i * 37) % 400).collect();
    for name in MODELS {
        let cpu = load(CpuBackend::new(), name, DType::F32);
        let cuda = load(g.clone(), name, DType::BF16);
        let vocab = cpu.config().vocab_size;
        let (a, b) = (cpu.forward_full(&ids), cuda.forward_full(&ids));
        let diff = max_abs_diff(&a, &b);
        let (mut clear, mut same) = (0, 0);
        for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
            let mut sorted = ra.to_vec();
            sorted.sort_by(|x, y| y.total_cmp(x));
            if sorted[0] - sorted[1] > 0.5 {
                clear += 1;
                same += usize::from(
                    tandem_engine::sampling::argmax(ra) == tandem_engine::sampling::argmax(rb),
                );
            }
        }
        let reference = transformers_bf16_agreement(name, &ids);
        let (hf_same, hf_clear) = reference.unwrap_or((0, 0));
        eprintln!(
            "{name} bf16 vs f32: greedy equal at {same}/{clear} clear positions (transformers' \
             bf16: {hf_same}/{hf_clear}), max |logit diff| {diff}"
        );
        assert!(
            clear >= 20,
            "{name}: too few clear positions ({clear}) to judge"
        );
        // Within 5% of transformers' own agreement, and never below 80%.
        let ours = same as f64 / clear as f64;
        let theirs = reference.map_or(0.0, |_| hf_same as f64 / hf_clear.max(1) as f64);
        assert!(
            ours >= theirs - 0.05 && ours >= 0.8,
            "{name} bf16: greedy equal at only {same}/{clear} clear positions (transformers' \
             bf16: {hf_same}/{hf_clear})"
        );
    }
}

/// Decode steps traced and replayed as CUDA graphs give the eager steps' logits bit for bit,
/// while sequences join and leave the batch (new state and latent addresses in the step's
/// tables, the launches unchanged), and with bf16 weights replays do happen.
#[test]
fn traced_decode_steps_replay_the_eager_steps_bit_for_bit() {
    let Some(g) = gpu() else { return };
    g.set_traced_steps(true);
    let eager_backend = g.new_stream().expect("a second stream");
    eager_backend.set_traced_steps(false);
    for name in MODELS {
        for dtype in [DType::F32, DType::BF16] {
            let traced = load(g.clone(), name, dtype);
            let eager = load(eager_backend.clone(), name, dtype);
            let before = g.trace_stats();
            let prompts: Vec<Vec<u32>> = (0..4u32)
                .map(|s| {
                    (0..5 + 7 * s)
                        .map(|i| 3 + (i * 31 + s * 11) % 300)
                        .collect()
                })
                .collect();
            let (mut st_t, mut st_e) = (Vec::new(), Vec::new());
            let mut next = Vec::new();
            // Three sequences at first; the fourth joins at step 8, the first leaves at 16.
            let join = |k: usize, st_t: &mut Vec<_>, st_e: &mut Vec<_>, next: &mut Vec<u32>| {
                let (mut a, mut b) = (traced.new_state(), eager.new_state());
                let la = traced.prefill(&prompts[k], &mut a);
                let lb = eager.prefill(&prompts[k], &mut b);
                assert_eq!(la, lb, "{name} {dtype:?}: prompt {k} logits differ");
                st_t.push(a);
                st_e.push(b);
                next.push(tandem_engine::sampling::argmax(&la));
            };
            for k in 0..3 {
                join(k, &mut st_t, &mut st_e, &mut next);
            }
            for step in 0..24 {
                if step == 8 {
                    join(3, &mut st_t, &mut st_e, &mut next);
                }
                if step == 16 {
                    st_t.remove(0);
                    st_e.remove(0);
                    next.remove(0);
                }
                let ids: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let ids: Vec<&[u32]> = ids.iter().map(|a| a.as_slice()).collect();
                let mut refs_t: Vec<_> = st_t.iter_mut().collect();
                let mut refs_e: Vec<_> = st_e.iter_mut().collect();
                let form = tandem_engine::models::kda_hybrid::KdaForm::Recurrent;
                let lt = traced.extend_batch(&ids, &mut refs_t, form);
                let le = eager.extend_batch(&ids, &mut refs_e, form);
                for (i, (a, b)) in lt.iter().zip(&le).enumerate() {
                    let same = a.len() == b.len()
                        && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{name} {dtype:?} step {step} sequence {i}: traced logits differ from \
                         eager by up to {}",
                        max_abs_diff(a, b)
                    );
                }
                next = lt
                    .iter()
                    .map(|l| tandem_engine::sampling::argmax(l))
                    .collect();
            }
            let after = g.trace_stats();
            eprintln!("{name} {dtype:?}: traced steps {before:?} -> {after:?}");
            // f32 experts run one by one, reading the routing back: such steps break off
            // their recordings (and must still equal eager). bf16 ones replay.
            if dtype == DType::BF16 {
                assert!(
                    after.captured > before.captured && after.replayed >= before.replayed + 12,
                    "{name} {dtype:?}: decode steps were not replayed ({before:?} -> {after:?})"
                );
            }
            assert_eq!(
                eager_backend.trace_stats(),
                tandem_cuda::TraceStats::default(),
                "a backend with tracing off traced"
            );
        }
    }
}

/// Largest `|a - b|` relative to the largest `|a|`.
fn relative_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    max_abs_diff(a, b) / scale
}

/// Seeds 000 and 002 on the GPU: the fused input projection and the paired f_b/g_b give the
/// separate projections' logits for prompts of 1, 32, 2048 and 8192 rows, and in decode steps
/// of three sequences, eager and traced (replayed as graphs). A projection split at the wrong
/// column would be off by the logits' own size.
#[test]
fn fused_and_paired_projections_equal_separate_ones_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let dir = tempfile::tempdir().expect("tmp");
    tandem_model::synth::synth_kda_hybrid("tiny", dir.path(), false, 7).expect("synth");
    let tokens = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 977) >> 7) % 509 + 3)
            .collect()
    };
    for (dtype, tol) in [(DType::F32, 1e-4f32), (DType::BF16, 3e-2)] {
        let options = |fusion| LoadOptions {
            dtype,
            fusion,
            ..LoadOptions::default()
        };
        let fused = KdaHybridModel::load_on(
            g.clone(),
            dir.path(),
            &options(tandem_engine::models::kda_hybrid::FusionPolicy::Auto),
        )
        .expect("load fused");
        let separate = KdaHybridModel::load_on(
            g.clone(),
            dir.path(),
            &options(tandem_engine::models::kda_hybrid::FusionPolicy::Never),
        )
        .expect("load separate");
        let layer = |m: &KdaHybridModel<CudaBackend>| {
            let l = m.kda_layer(0).expect("a KDA layer");
            (l.input.is_fused(), l.gate.is_paired())
        };
        assert_eq!(
            layer(&fused),
            (true, true),
            "the synthetic checkpoint fuses"
        );
        assert_eq!(layer(&separate), (false, false));
        let form = tandem_engine::models::kda_hybrid::KdaForm::Auto;
        for rows in [1usize, 32, 2048, 8192] {
            let ids = tokens(rows, rows as u32);
            let a = fused.extend(&ids, &mut fused.new_state(), form, false);
            let b = separate.extend(&ids, &mut separate.new_state(), form, false);
            let d = relative_diff(&b, &a);
            eprintln!("{dtype:?} prompt of {rows}: fused vs separate, relative {d:.2e}");
            assert!(
                d <= tol,
                "{dtype:?} prompt of {rows}: fused and separate differ by {d}"
            );
        }
        for traced in [false, true] {
            g.set_traced_steps(traced);
            let mut st_f: Vec<_> = (0..3).map(|_| fused.new_state()).collect();
            let mut st_s: Vec<_> = (0..3).map(|_| separate.new_state()).collect();
            let mut next = Vec::new();
            for (k, (a, b)) in st_f.iter_mut().zip(st_s.iter_mut()).enumerate() {
                let ids = tokens(9 + 20 * k, k as u32);
                let la = fused.prefill(&ids, a);
                separate.prefill(&ids, b);
                next.push(tandem_engine::sampling::argmax(&la));
            }
            let mut worst = 0.0f32;
            for _ in 0..12 {
                let ids: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let ids: Vec<&[u32]> = ids.iter().map(|a| a.as_slice()).collect();
                let mut rf: Vec<_> = st_f.iter_mut().collect();
                let mut rs: Vec<_> = st_s.iter_mut().collect();
                let lf = fused.extend_batch(&ids, &mut rf, form);
                let ls = separate.extend_batch(&ids, &mut rs, form);
                for (a, b) in lf.iter().zip(&ls) {
                    worst = worst.max(relative_diff(b, a));
                }
                // Both continue with the fused model's choice: the comparison stays on one path.
                next = lf
                    .iter()
                    .map(|l| tandem_engine::sampling::argmax(l))
                    .collect();
            }
            eprintln!(
                "{dtype:?} decode (traced {traced}): fused vs separate, relative {worst:.2e}"
            );
            assert!(
                worst <= tol,
                "{dtype:?} decode (traced {traced}): fused and separate differ by {worst}"
            );
        }
        g.set_traced_steps(false);
    }
}

/// The KDA-hybrid engine on CUDA, started through the one loader, with the sampling controls
/// the API offers (penalties, bias, `min_tokens`, log-probabilities): the CPU engine's tokens
/// and log-probabilities on the same f32 checkpoint; and `n` seeded choices of one prompt on
/// CUDA each equal to its seed alone. Decode steps are traced.
#[test]
fn kda_sampling_controls_and_choices_on_cuda_match() {
    let Some(g) = gpu() else { return };
    g.set_traced_steps(true);
    let config = || EngineConfig {
        num_blocks: 64,
        state_slots: 8,
        ..EngineConfig::default()
    };
    for name in MODELS {
        let dir = reference_dir(name);
        let spec = tandem_engine::LoadSpec::default();
        let cuda = tandem_engine::load(&dir, |_| Ok(g.clone()), &spec)
            .expect("load on the GPU")
            .serve(config())
            .expect("serve");
        let cpu = tandem_engine::load(&dir, |_| Ok(CpuBackend::new()), &spec)
            .expect("load on the CPU")
            .serve(config())
            .expect("serve");
        let prompt: Vec<u32> = (0..21u32).map(|i| (i * 17) % 300 + 3).collect();
        let collect = |e: &Engine, p: &SamplingParams| common::generated(e, &prompt, p);
        let ids = |v: &[(u32, Option<tandem_core::TokenLogprobs>)]| {
            v.iter().map(|t| t.0).collect::<Vec<_>>()
        };
        let plain = ids(&collect(&cuda, &SamplingParams::greedy(10)));
        // The penalties alone may leave a short greedy run as it was (nothing in it repeats);
        // banning the plain run's second token cannot.
        let params = SamplingParams {
            frequency_penalty: 1.5,
            repetition_penalty: 1.3,
            logit_bias: vec![(7, 3.0), (plain[1], -100.0)],
            min_tokens: 6,
            logprobs: Some(3),
            ignore_eos: false,
            ..SamplingParams::greedy(10)
        };
        let (a, b) = (collect(&cuda, &params), collect(&cpu, &params));
        assert_eq!(ids(&a), ids(&b), "{name}: tokens differ from the CPU's");
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            let (x, y) = (
                x.as_ref().expect("asked for"),
                y.as_ref().expect("asked for"),
            );
            assert!(
                (x.logprob - y.logprob).abs() < 1e-3,
                "{name}: {x:?} vs {y:?}"
            );
            assert_eq!(x.top.len(), 3);
            assert_eq!(x.top[0].0, y.top[0].0);
        }
        assert_ne!(
            plain,
            ids(&a),
            "{name}: the controls changed nothing on CUDA"
        );
        // Three seeded choices of one prompt, each what its seed gives alone.
        let sampled = |seed: u64| SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.9,
            seed,
            ignore_eos: true,
            ..SamplingParams::greedy(8)
        };
        let together: Vec<Vec<u32>> = cuda
            .submit_choices(
                prompt.clone(),
                (0..3).map(|j| sampled(11 + j)).collect(),
                SeqKind::Generate,
            )
            .expect("submitted")
            .into_iter()
            .map(blocking_tokens)
            .collect();
        for (j, got) in together.iter().enumerate() {
            let alone = ids(&collect(&cuda, &sampled(11 + j as u64)));
            assert_eq!(
                got, &alone,
                "{name}: choice {j} differs from its seed alone"
            );
        }
        assert!(
            together.iter().any(|t| t != &together[0]),
            "{name}: three seeds gave one continuation"
        );
    }
}

/// Checkpoint `name` in f32 over `layout`, every rank on the one GPU (rank 0 on `g`, the
/// others each on a stream of its own).
fn on_one_gpu(g: &CudaBackend, name: &str, layout: Layout) -> KdaModel<CudaBackend> {
    let ranks = |r: Rank| match r.0 {
        0 => Ok(g.clone()),
        _ => g.new_stream(),
    };
    KdaModel::load_on(ranks, &reference_dir(name), layout, &LoadOptions::default())
        .expect("load the layout")
}

/// Greedy tokens of one process: prefill, then `n - 1` recurrent steps.
fn steps<B: HybridOps>(model: &KdaHybridModel<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut st = model.new_state();
    let mut logits = model.prefill(prompt, &mut st);
    (0..n)
        .map(|_| {
            let t = tandem_engine::sampling::argmax(&logits);
            logits = model.decode_step(t, &mut st);
            t
        })
        .collect()
}

fn engine<B: HybridOps>(backend: B, name: &str) -> Engine {
    let model = KdaModel::Single(Box::new(load(backend, name, DType::F32)));
    let config = EngineConfig {
        num_blocks: 64,
        state_slots: 4,
        ..EngineConfig::default()
    };
    KdaServed::start(model, config, vec![2], 4096).expect("start")
}

fn greedy(n: u32) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    }
}

fn prefill(p: &Engine, prompt: &[u32], n: u32) -> (u32, Handoff) {
    let rx = p
        .submit(prompt.to_vec(), greedy(n), SeqKind::Prefill)
        .expect("prefill");
    match blocking_first(rx) {
        Some(EngineEvent::Prefilled {
            first_token,
            finish: None,
            handoff,
            ..
        }) => (first_token, handoff),
        other => panic!("no prefill event: {other:?}"),
    }
}

fn blocking_first(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
) -> Option<EngineEvent> {
    rx.blocking_recv()
}

fn decode(d: &Engine, prompt: &[u32], n: u32, first_token: u32, handoff: Handoff) -> Vec<u32> {
    let reservation = d.reserve(prompt.len() + n as usize).expect("reserve");
    let rx = d
        .submit(
            prompt.to_vec(),
            greedy(n),
            SeqKind::Decode {
                reservation,
                handoff,
                first_token,
                forks: Vec::new(),
            },
        )
        .expect("decode");
    let mut got = vec![first_token];
    got.extend(blocking_tokens(rx));
    got
}

/// The KDA state and MLA latents a prefill engine hands off continue on a decode engine on
/// another device (CPU → GPU, GPU → CPU) or the same one (GPU → GPU) to the tokens of one
/// CPU process; aggregated on the GPU too; slots and latent blocks come back.
#[test]
fn pd_handoffs_between_devices_equal_one_process() {
    let Some(g) = gpu() else { return };
    let name = "kimi_tiny";
    let prompt: Vec<u32> = vec![9, 40, 7, 300, 12, 5, 77, 1, 250, 64, 3];
    let n = 8;
    let want = steps(
        &load(CpuBackend::new(), name, DType::F32),
        &prompt,
        n as usize,
    );
    let cpu = engine(CpuBackend::new(), name);
    let gpu_p = engine(g.clone(), name);
    let gpu_d = engine(CudaBackend::clone(&g), name);
    for (label, p, d) in [
        ("cpu -> gpu", &cpu, &gpu_d),
        ("gpu -> cpu", &gpu_p, &cpu),
        ("gpu -> gpu", &gpu_p, &gpu_d),
    ] {
        let (first, handoff) = prefill(p, &prompt, n);
        assert_eq!(decode(d, &prompt, n, first, handoff), want, "{label}");
    }
    let all = blocking_tokens(
        gpu_d
            .submit(prompt.clone(), greedy(n), SeqKind::Generate)
            .expect("generate"),
    );
    assert_eq!(all, want, "aggregated on the GPU");
    for e in [&cpu, &gpu_p, &gpu_d] {
        assert_eq!(e.pools().free_slots(), vec![4], "slots back");
        assert_eq!(e.pools().paged_blocks(), (64, 64), "latent blocks back");
    }
}

/// Layouts whose ranks share the one GPU (a thread and a stream each, collectives through host
/// memory) equal one rank: tp2, tp2 × dp2, tp4 × dp2 with ep2 and tp4 × dp4 with ep2 — every
/// attention-DP group's logits (the groups must agree) and the greedy continuation.
#[test]
fn layouts_sharing_one_gpu_equal_one_rank() {
    let Some(g) = gpu() else { return };
    let ids: Vec<u32> = vec![5, 9, 33, 7, 120, 64, 3, 11, 2, 40];
    for name in MODELS {
        let one = load(g.clone(), name, DType::F32);
        let want = one.forward_full(&ids);
        let want_greedy = steps(&one, &ids, 8);
        for (tp, dp, ep) in [(2, 1, 1), (2, 2, 1), (4, 2, 2), (4, 4, 2)] {
            let layout = Layout::new(tp, dp, ep).expect("layout");
            let model = on_one_gpu(&g, name, layout);
            let got = model.forward_full(&ids).expect("forward");
            let diff = max_abs_diff(&got, &want);
            eprintln!("{name} {layout} on one GPU: max |logit - tp1| = {diff}");
            assert!(
                diff < 1e-3,
                "{name} {layout}: logits differ from tp1 by {diff}"
            );
            let greedy = model.greedy(&ids, 8, &[]).expect("greedy");
            assert_eq!(greedy, want_greedy, "{name} {layout}: greedy");
        }
    }
}

/// P/D between layouts on the one GPU: a tp4 × dp2 prefill engine hands off to a tp2 × dp2
/// decode engine's second group (the state resharded from 2 to 1 attention-TP ranks), and the
/// tokens are one process's.
#[test]
fn pd_between_layouts_on_one_gpu_equals_one_process() {
    let Some(g) = gpu() else { return };
    let name = "kimi_tiny";
    let prompt: Vec<u32> = vec![9, 40, 7, 18, 250, 6, 91];
    let n = 6;
    let want = steps(
        &load(CpuBackend::new(), name, DType::F32),
        &prompt,
        n as usize,
    );
    let start = |tp, dp| {
        let model = on_one_gpu(&g, name, Layout::new(tp, dp, 1).expect("layout"));
        let config = EngineConfig {
            num_blocks: 128,
            state_slots: 2,
            ..EngineConfig::default()
        };
        KdaServed::start(model, config, vec![2], 4096).expect("start")
    };
    let (p, d) = (start(4, 2), start(2, 2));
    let (first_token, handoff) = prefill(&p, &prompt, n);
    let reservation = d
        .reserve_on(prompt.len() + n as usize, Some(1))
        .expect("a slot on group 1");
    let rx = d
        .submit(
            prompt.clone(),
            greedy(n),
            SeqKind::Decode {
                reservation,
                handoff,
                first_token,
                forks: Vec::new(),
            },
        )
        .expect("decode");
    let mut got = vec![first_token];
    got.extend(blocking_tokens(rx));
    assert_eq!(got, want, "tp4 x dp2 -> tp2 x dp2 on one GPU");
    assert_eq!(d.pools().free_slots(), vec![2, 2], "decode slots back");
    assert_eq!(p.pools().free_slots(), vec![2, 2], "prefill slots back");
}

/// A block-FP8 checkpoint (128 × 128 scales; KDA projections kept BF16, as GLM-5.3-Flash
/// ships them) serves on the GPU in bf16 (dequantised at load) and picks the CPU's f32 tokens
/// at the positions whose margin is clear.
#[test]
fn a_block_fp8_checkpoint_runs_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    tandem_model::synth::synth_kda_hybrid("tiny", dir.path(), true, 7).expect("synth fp8");
    let options = |dtype| LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    let cpu = KdaHybridModel::load_on(CpuBackend::new(), dir.path(), &options(DType::F32))
        .expect("cpu load");
    let cuda = KdaHybridModel::load_on(g, dir.path(), &options(DType::BF16)).expect("cuda load");
    let vocab = cpu.config().vocab_size;
    let ids: Vec<u32> = (0..48u32).map(|i| 3 + (i * 53) % 500).collect();
    let (a, b) = (cpu.forward_full(&ids), cuda.forward_full(&ids));
    let (mut clear, mut same) = (0, 0);
    for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
        let mut sorted = ra.to_vec();
        sorted.sort_by(|x, y| y.total_cmp(x));
        if sorted[0] - sorted[1] > 0.1 * sorted[0].abs().max(1.0) {
            clear += 1;
            same += usize::from(
                tandem_engine::sampling::argmax(ra) == tandem_engine::sampling::argmax(rb),
            );
        }
    }
    eprintln!(
        "fp8 tiny on the GPU (bf16) vs the CPU (f32): greedy equal at {same}/{clear} clear positions, max |logit diff| {}",
        max_abs_diff(&a, &b)
    );
    assert!(clear >= 10, "too few clear positions ({clear}) to judge");
    assert!(
        same * 10 >= clear * 9,
        "greedy equal at only {same}/{clear}"
    );
}

/// A block-FP8 checkpoint (the medium preset's dimensions, 3 layers) with its routed experts
/// kept as FP8 on the GPU, against the same checkpoint dequantised to bf16 at load: a prompt
/// longer than the grouped expert product takes dequantises each expert per step to the very
/// bf16 the loader keeps (logits bit for bit); a short one runs the FP8 grouped kernels, whose
/// exact tile values move the logits a little from the bf16 run's, and stay as close to the
/// CPU's f32 run of the same checkpoint.
#[test]
fn fp8_experts_on_the_gpu_match_dequantised_experts() {
    let Some(g) = gpu() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    tandem_model::synth::synth_kda_hybrid_layers("medium", dir.path(), true, 7, Some(3))
        .expect("synth");
    let options = LoadOptions {
        dtype: DType::BF16,
        ..LoadOptions::default()
    };
    let load_cuda = |fp8: bool| {
        g.set_fp8_weights(fp8);
        let m = KdaHybridModel::load_on(g.clone(), dir.path(), &options).expect("load");
        g.set_fp8_weights(true);
        m
    };
    let (fp8, bf16) = (load_cuda(true), load_cuda(false));
    let cpu = KdaHybridModel::load_on(CpuBackend::new(), dir.path(), &LoadOptions::default())
        .expect("load on the CPU");
    // Every stored FP8 matrix (MLA projections, dense MLP, shared and routed experts) stays
    // FP8 on the GPU in bf16; with FP8 products off, or an f32 model, each is dequantised.
    let [kept, dequantised] = fp8.block_fp8_matrices();
    eprintln!("block-FP8 matrices: {kept} kept, {dequantised} dequantised");
    assert!(
        kept > 0 && dequantised == 0,
        "FP8 matrices dequantised on the GPU: {kept} kept, {dequantised} not"
    );
    assert_eq!(bf16.block_fp8_matrices(), [0, kept]);
    assert_eq!(cpu.block_fp8_matrices(), [0, kept]);
    let long: Vec<u32> = (0..160u32).map(|i| (i * 37) % 31_000 + 5).collect();
    assert_eq!(
        fp8.forward_full(&long),
        bf16.forward_full(&long),
        "experts dequantised per step differ from experts dequantised at load"
    );
    let short = &long[..6];
    let (a, b, want) = (
        fp8.forward_full(short),
        bf16.forward_full(short),
        cpu.forward_full(short),
    );
    let spread = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (fp8_err, bf16_err) = (max_abs_diff(&a, &want), max_abs_diff(&b, &want));
    eprintln!(
        "short prompt: |fp8 - f32| {fp8_err}, |bf16 - f32| {bf16_err}, |fp8 - bf16| {}, max |logit| {spread}",
        max_abs_diff(&a, &b)
    );
    assert_ne!(a, b, "the short prompt did not run the FP8 experts");
    assert!(
        fp8_err <= 0.05 * spread && bf16_err <= 0.05 * spread,
        "bf16-model logits drift from the f32 model's: fp8 {fp8_err}, bf16 {bf16_err} of {spread}"
    );
}
