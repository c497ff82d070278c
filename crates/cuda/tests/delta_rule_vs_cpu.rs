//! KDA's delta rule on CUDA against the CPU backend, in both forms (chunked for prompts,
//! recurrent for decode): several sequences of different lengths, every head width, the state
//! each sequence carries after the call as well as the output, and the GPU's chunked form
//! against its own recurrent form. Without a usable GPU each test prints why and passes.

mod common;
use common::gpu;
use common::hybrid::*;

use tandem_engine::backend::hybrid::{DeltaForm, DeltaInputs, HybridOps};
use tandem_engine::{CpuBackend, DType, HostTensor, Tensor};

fn five<T>(v: Vec<T>) -> [T; 5] {
    match v.try_into() {
        Ok(a) => a,
        Err(_) => unreachable!("q, k, v, g and beta"),
    }
}

/// Inputs of the delta rule for `rows` tokens of `h` heads of width `d`, on both devices.
struct DeltaCase {
    cpu: [Tensor<C>; 5],
    gpu: [Tensor<G>; 5],
    states: Vec<Vec<f32>>,
    segments: &'static [usize],
}

impl DeltaCase {
    fn new(c: &C, g: &G, h: usize, d: usize, seed: u64) -> Self {
        Self::of(c, g, &SEGMENTS, h, d, seed)
    }

    /// Inputs for sequences of `segments` rows.
    fn of(c: &C, g: &G, segments: &'static [usize], h: usize, d: usize, seed: u64) -> Self {
        let rows: usize = segments.iter().sum();
        let n = rows * h * d;
        let q = unit_rows(seed, rows * h, d, 1.0 / (d as f32).sqrt());
        let k = unit_rows(seed + 1, rows * h, d, 1.0);
        let v = noise(seed + 2, n);
        // Decays from none to strong (e^-4 per token).
        let gates: Vec<f32> = noise(seed + 3, n)
            .iter()
            .map(|x| -2.0 * (x + 1.0))
            .collect();
        let beta: Vec<f32> = noise(seed + 4, rows * h)
            .iter()
            .map(|x| 0.5 + 0.45 * x)
            .collect();
        let parts = [
            (vec![rows, h, d], q),
            (vec![rows, h, d], k),
            (vec![rows, h, d], v),
            (vec![rows, h, d], gates),
            (vec![rows, h], beta),
        ];
        let mut cpu = Vec::new();
        let mut gpu = Vec::new();
        for (shape, data) in parts {
            let (tc, tg) = both(c, g, &shape, data);
            cpu.push(tc);
            gpu.push(tg);
        }
        let states = (0..segments.len())
            .map(|i| noise(seed + 20 + i as u64, h * d * d))
            .collect();
        Self {
            cpu: five(cpu),
            gpu: five(gpu),
            states,
            segments,
        }
    }

    /// Runs `form` for every sequence on `b` from the case's states; returns `o` and the states.
    fn run<B: HybridOps>(
        b: &B,
        inputs: &[Tensor<B>; 5],
        states: &[Vec<f32>],
        h: usize,
        d: usize,
        form: DeltaForm,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        Self::run_of(b, &SEGMENTS, inputs, states, h, d, form)
    }

    /// [`DeltaCase::run`] for sequences of `segments` rows.
    fn run_of<B: HybridOps>(
        b: &B,
        segments: &[usize],
        inputs: &[Tensor<B>; 5],
        states: &[Vec<f32>],
        h: usize,
        d: usize,
        form: DeltaForm,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let rows: usize = segments.iter().sum();
        let mut st: Vec<Tensor<B>> = states
            .iter()
            .map(|s| b.upload(&HostTensor::from_f32(&[h, d, d], s.clone()).expect("shape")))
            .collect();
        let mut refs: Vec<&mut Tensor<B>> = st.iter_mut().collect();
        let mut out = b.zeros(DType::F32, &[rows, h, d]);
        let [q, k, v, g, beta] = inputs;
        let delta = DeltaInputs {
            q,
            k,
            v,
            g,
            beta,
            heads: h,
            head_dim: d,
        };
        let forms = vec![form; segments.len()];
        b.delta_rule(delta, &seqs_of(segments), &forms, &mut refs, &mut out);
        (values(b, &out), st.iter().map(|s| values(b, s)).collect())
    }
}

#[test]
fn delta_rule_matches_the_cpu_in_both_forms() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    for (h, d) in [(2, 16), (3, 32), (2, 64), (2, 128)] {
        let case = DeltaCase::new(&c, &g, h, d, 100 + d as u64);
        for form in [DeltaForm::Recurrent, DeltaForm::Chunked] {
            let (o_c, s_c) = DeltaCase::run(&c, &case.cpu, &case.states, h, d, form);
            let (o_g, s_g) = DeltaCase::run(&g, &case.gpu, &case.states, h, d, form);
            close(
                &format!("delta_rule {form:?} H{h} D{d} output"),
                &o_c,
                &o_g,
                1e-4,
            );
            for (i, (sc, sg)) in s_c.iter().zip(&s_g).enumerate() {
                close(
                    &format!(
                        "delta_rule {form:?} H{h} D{d} state of sequence {i} ({} rows)",
                        SEGMENTS[i]
                    ),
                    sc,
                    sg,
                    1e-4,
                );
            }
        }
    }
}

#[test]
fn delta_rule_decode_step_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    for (h, d) in [(2, 16), (3, 32), (2, 64), (3, 128)] {
        let case = DeltaCase::of(&c, &g, &DECODE_SEGMENTS, h, d, 300 + d as u64);
        let form = DeltaForm::Recurrent;
        let (o_c, s_c) = DeltaCase::run_of(&c, case.segments, &case.cpu, &case.states, h, d, form);
        let (o_g, s_g) = DeltaCase::run_of(&g, case.segments, &case.gpu, &case.states, h, d, form);
        close(
            &format!("delta_rule decode H{h} D{d} output"),
            &o_c,
            &o_g,
            1e-4,
        );
        for (i, (sc, sg)) in s_c.iter().zip(&s_g).enumerate() {
            close(
                &format!("delta_rule decode H{h} D{d} state of sequence {i}"),
                sc,
                sg,
                1e-4,
            );
        }
    }
}

#[test]
fn cuda_chunked_delta_rule_equals_cuda_recurrent() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    for (h, d) in [(4, 64), (2, 128)] {
        let case = DeltaCase::new(&c, &g, h, d, 7);
        let (o_r, s_r) = DeltaCase::run(&g, &case.gpu, &case.states, h, d, DeltaForm::Recurrent);
        let (o_c, s_c) = DeltaCase::run(&g, &case.gpu, &case.states, h, d, DeltaForm::Chunked);
        close(
            &format!("cuda delta_rule H{h} D{d} chunked vs recurrent output"),
            &o_r,
            &o_c,
            2e-5,
        );
        for (i, (r, k)) in s_r.iter().zip(&s_c).enumerate() {
            close(
                &format!("cuda delta_rule H{h} D{d} chunked vs recurrent state {i}"),
                r,
                k,
                2e-5,
            );
        }
    }
}

/// Sequences long enough that the chunked form runs in several rounds at 32 heads × 128 (its
/// workspace holds 27 chunks of 32 heads; three prompts share it, 9 chunks each a round, so
/// the first one's 29 chunks take four rounds).
const LONG_SEGMENTS: [usize; 3] = [1800, 3, 70];

#[test]
fn chunked_delta_rule_over_several_rounds_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let (h, d) = (32, 128);
    let case = DeltaCase::of(&c, &g, &LONG_SEGMENTS, h, d, 900);
    let form = DeltaForm::Chunked;
    let (o_c, s_c) = DeltaCase::run_of(&c, case.segments, &case.cpu, &case.states, h, d, form);
    let (o_g, s_g) = DeltaCase::run_of(&g, case.segments, &case.gpu, &case.states, h, d, form);
    close("delta_rule chunked, long prompts, output", &o_c, &o_g, 1e-4);
    for (i, (sc, sg)) in s_c.iter().zip(&s_g).enumerate() {
        close(
            &format!("delta_rule chunked, long prompts, state of sequence {i}"),
            sc,
            sg,
            1e-4,
        );
    }
}
