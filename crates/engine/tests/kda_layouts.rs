//! The tiny KDA hybrid over tensor/data/expert-parallel layouts, ranks as threads: every
//! attention-DP group, given its own sequence, gets tp1's logits for that sequence. Sharding
//! the KDA layers by the global TP rank under DP attention gives wrong logits, and layouts
//! the model cannot take fail at construction. A request prefilled on one layout and moved to
//! another with a `TransferPlan` decodes to tp1's logits.

use tandem_engine::models::kda_hybrid::sharded::model_shape;
use tandem_engine::models::kda_hybrid::{
    apply_transfer_plan, KdaForm, KdaHybridModel, LoadOptions, ShardError, ShardedKdaHybrid,
};
use tandem_model::synth::synth_kda_hybrid;
use tandem_testkit::max_abs_diff;
use tandem_topology::{Layout, ShardBy, TransferPlan};

/// Sharding changes summation order (partial o_proj / MLP sums) and nothing else.
const LAYOUT_TOL: f32 = 1e-4;

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 7919) >> 9) % 509 + 3)
        .collect()
}

/// One sequence per attention-DP group, of different lengths.
fn sequences(dp: usize) -> Vec<Vec<u32>> {
    (0..dp).map(|g| tokens(9 + 3 * g, g as u32 + 1)).collect()
}

#[test]
fn every_layout_matches_tp1() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 13).expect("synth");
    let tp1 = KdaHybridModel::load(dir.path()).expect("load tp1");
    let seqs = sequences(8);
    let want: Vec<Vec<f32>> = seqs.iter().map(|s| tp1.forward_full(s)).collect();
    for (tp, dp, ep) in [
        (1, 1, 1),
        (2, 1, 1),
        (4, 1, 1),
        (8, 1, 1),
        (4, 2, 1),
        (8, 8, 1),
        (4, 1, 4),
    ] {
        let layout = Layout::new(tp, dp, ep).expect("valid layout");
        let m = ShardedKdaHybrid::load(dir.path(), layout).expect("load sharded");
        let got = m.forward_full(&seqs[..dp]).expect("forward");
        for (g, logits) in got.iter().enumerate() {
            let d = max_abs_diff(logits, &want[g]);
            eprintln!("{layout} group {g}: max |Δlogits| {d:.2e}");
            assert!(
                d <= LAYOUT_TOL,
                "{layout} group {g} differs from tp1 by {d}"
            );
        }
    }
}

#[test]
fn prefill_then_decode_on_a_dp_layout_matches_tp1() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 17).expect("synth");
    let tp1 = KdaHybridModel::load(dir.path()).expect("load tp1");
    let layout = Layout::new(4, 2, 2).expect("valid layout");
    let m = ShardedKdaHybrid::load(dir.path(), layout).expect("load sharded");
    let seqs = sequences(2);
    let mut states = m.new_states();
    let prompts: Vec<Vec<u32>> = seqs.iter().map(|s| s[..s.len() - 3].to_vec()).collect();
    m.extend(&prompts, &mut states, KdaForm::Chunked, false)
        .expect("prefill");
    let mut last = Vec::new();
    for back in [3, 2, 1] {
        let next: Vec<Vec<u32>> = seqs.iter().map(|s| vec![s[s.len() - back]]).collect();
        last = m
            .extend(&next, &mut states, KdaForm::Recurrent, false)
            .expect("decode");
    }
    let vocab = tp1.config().vocab_size;
    for (g, s) in seqs.iter().enumerate() {
        let full = tp1.forward_full(s);
        let d = max_abs_diff(&last[g], &full[full.len() - vocab..]);
        assert!(d <= LAYOUT_TOL, "group {g}: decode differs from tp1 by {d}");
    }
}

#[test]
fn global_tp_sharding_under_dp_attention_is_wrong() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 13).expect("synth");
    let tp1 = KdaHybridModel::load(dir.path()).expect("load tp1");
    let layout = Layout::new(8, 8, 1).expect("valid layout");
    let seqs = sequences(8);
    let wrong = ShardedKdaHybrid::load_with(
        dir.path(),
        layout,
        &LoadOptions::default(),
        ShardBy::GlobalTp,
    )
    .expect("global TP loads: shapes stay self-consistent, heads are wrong");
    let got = wrong.forward_full(&seqs).expect("forward");
    for (g, logits) in got.iter().enumerate() {
        let d = max_abs_diff(logits, &tp1.forward_full(&seqs[g]));
        eprintln!("global-TP KDA sharding, group {g}: max |Δlogits| {d:.2e}");
        assert!(
            d > 0.1,
            "group {g}: wrong sharding should be far off, got {d}"
        );
    }
}

#[test]
fn layouts_the_model_cannot_take_fail_at_construction() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 13).expect("synth");
    // 8 KDA heads over attention TP 16.
    let err = ShardedKdaHybrid::load(dir.path(), Layout::new(16, 1, 1).expect("sizes fit"))
        .expect_err("16 does not divide 8 heads");
    assert!(matches!(err, ShardError::Topology(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("16") && msg.contains("heads"), "{msg}");
    // 8 experts over ep 3 (and 8 heads over attention TP 1 are fine): 3 ∤ 8.
    let err = ShardedKdaHybrid::load(dir.path(), Layout::new(3, 3, 3).expect("sizes fit"))
        .expect_err("3 does not divide 8 experts");
    assert!(err.to_string().contains('8'), "{err}");
    // Wrong number of sequences for the layout.
    let m = ShardedKdaHybrid::load(dir.path(), Layout::new(2, 2, 1).expect("valid")).expect("load");
    assert!(matches!(
        m.forward_full(&sequences(1)),
        Err(ShardError::Mismatch(_))
    ));
}

/// Prefill on layout `p`, move the request into every attention-DP group of layout `d` with a
/// `TransferPlan`, decode there: every group equals tp1's full pass.
fn prefill_move_decode(p: Layout, d: Layout) {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 23).expect("synth");
    let tp1 = KdaHybridModel::load(dir.path()).expect("load tp1");
    let (pm, dm) = (
        ShardedKdaHybrid::load(dir.path(), p).expect("load P"),
        ShardedKdaHybrid::load(dir.path(), d).expect("load D"),
    );
    let seq = tokens(70, 4); // prefill crosses a chunk boundary
    let n = seq.len() - 3;
    let mut p_states = pm.new_states();
    pm.extend(
        &vec![seq[..n].to_vec(); p.dp()],
        &mut p_states,
        KdaForm::Chunked,
        false,
    )
    .expect("prefill");
    let mut d_states = dm.new_states();
    let shape = model_shape(tp1.config());
    let kda = tp1.config().kda;
    for g in 0..d.dp() {
        let plan = TransferPlan::new(&p, &d, &shape, 0, g).expect("plan");
        apply_transfer_plan(
            &plan,
            &p_states,
            &mut d_states,
            kda.head_dim,
            kda.conv_kernel,
        );
    }
    let mut last = Vec::new();
    for &id in &seq[n..] {
        last = dm
            .extend(
                &vec![vec![id]; d.dp()],
                &mut d_states,
                KdaForm::Recurrent,
                false,
            )
            .expect("decode");
    }
    let full = tp1.forward_full(&seq);
    let want = &full[full.len() - tp1.config().vocab_size..];
    for (g, logits) in last.iter().enumerate() {
        let diff = max_abs_diff(logits, want);
        eprintln!("P {p} → D {d} group {g}: max |Δlogits| {diff:.2e}");
        assert!(diff <= LAYOUT_TOL, "P {p} → D {d} group {g}: {diff}");
    }
}

#[test]
fn prefill_on_one_layout_decode_on_another() {
    prefill_move_decode(
        Layout::new(2, 1, 1).expect("valid"),
        Layout::new(2, 2, 1).expect("valid"),
    );
    prefill_move_decode(
        Layout::new(4, 1, 4).expect("valid"),
        Layout::new(4, 4, 4).expect("valid"),
    );
}

/// Several requests of different lengths in one pass share the GEMMs but keep their own
/// states: prefilling three prompts together and then decoding them together (one token each
/// per step) gives every request the logits it gets alone.
#[test]
fn a_batch_of_requests_equals_each_request_alone() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 19).expect("synth");
    let tp1 = KdaHybridModel::load(dir.path()).expect("load tp1");
    let vocab = tp1.config().vocab_size;
    let seqs: Vec<Vec<u32>> = (0..3).map(|i| tokens(7 + 5 * i, 40 + i as u32)).collect();
    let mut states: Vec<_> = seqs.iter().map(|_| tp1.new_state()).collect();
    let prompts: Vec<&[u32]> = seqs.iter().map(|s| &s[..s.len() - 3]).collect();
    let mut refs: Vec<_> = states.iter_mut().collect();
    tp1.extend_batch(&prompts, &mut refs, KdaForm::Chunked);
    let mut last = Vec::new();
    for back in [3, 2, 1] {
        let next: Vec<&[u32]> = seqs
            .iter()
            .map(|s| &s[s.len() - back..s.len() - back + 1])
            .collect();
        let mut refs: Vec<_> = states.iter_mut().collect();
        last = tp1.extend_batch(&next, &mut refs, KdaForm::Recurrent);
    }
    for (i, s) in seqs.iter().enumerate() {
        let full = tp1.forward_full(s);
        let d = max_abs_diff(&last[i], &full[full.len() - vocab..]);
        assert!(
            d <= LAYOUT_TOL,
            "request {i}: batched differs from alone by {d}"
        );
        assert_eq!(states[i].tokens, s.len());
    }
}

/// The same on a DP-attention layout: group 0 runs two requests, group 1 none for the first
/// steps (its ranks still join the FFN collectives) and one afterwards.
#[test]
fn batches_per_attention_dp_group_match_tp1() {
    let dir = tempfile::tempdir().expect("tmp");
    synth_kda_hybrid("tiny", dir.path(), false, 23).expect("synth");
    let tp1 = KdaHybridModel::load(dir.path()).expect("load tp1");
    let vocab = tp1.config().vocab_size;
    let layout = Layout::new(4, 2, 2).expect("valid layout");
    let m = ShardedKdaHybrid::load(dir.path(), layout).expect("load sharded");
    let a = layout.attn_tp();
    let group0: Vec<Vec<u32>> = vec![tokens(8, 51), tokens(13, 52)];
    let late = tokens(6, 53);
    // states[r][i]: rank r's state of the i-th request of its group.
    let fresh = |r: usize| m.rank(tandem_topology::Rank(r)).expect("rank").new_state();
    let mut states: Vec<Vec<_>> = (0..layout.tp())
        .map(|r| {
            if r < a {
                vec![fresh(r), fresh(r)]
            } else {
                Vec::new()
            }
        })
        .collect();
    let prompts: Vec<Vec<Vec<u32>>> = vec![
        group0.iter().map(|s| s[..s.len() - 2].to_vec()).collect(),
        Vec::new(),
    ];
    m.extend_batch(&prompts, &mut states, KdaForm::Chunked, false)
        .expect("prefill group 0");
    let step: Vec<Vec<Vec<u32>>> = vec![
        group0.iter().map(|s| vec![s[s.len() - 2]]).collect(),
        Vec::new(),
    ];
    m.extend_batch(&step, &mut states, KdaForm::Recurrent, false)
        .expect("decode group 0");
    // Group 1's request arrives: its prompt and group 0's last tokens in one pass.
    for (r, st) in states.iter_mut().enumerate().skip(a) {
        st.push(fresh(r));
    }
    let mixed: Vec<Vec<Vec<u32>>> = vec![
        group0.iter().map(|s| vec![s[s.len() - 1]]).collect(),
        vec![late.clone()],
    ];
    let out = m
        .extend_batch(&mixed, &mut states, KdaForm::Chunked, false)
        .expect("mixed step");
    for (i, s) in group0.iter().enumerate() {
        let full = tp1.forward_full(s);
        let d = max_abs_diff(&out[0][i], &full[full.len() - vocab..]);
        assert!(
            d <= LAYOUT_TOL,
            "group 0 request {i} differs from tp1 by {d}"
        );
    }
    let full = tp1.forward_full(&late);
    let d = max_abs_diff(&out[1][0], &full[full.len() - vocab..]);
    assert!(d <= LAYOUT_TOL, "group 1's request differs from tp1 by {d}");
    // A batch whose states do not match its requests is refused, not run.
    let mut short: Vec<Vec<_>> = (0..layout.tp()).map(|_| Vec::new()).collect();
    assert!(m
        .extend_batch(&mixed, &mut short, KdaForm::Recurrent, false)
        .is_err());
}
