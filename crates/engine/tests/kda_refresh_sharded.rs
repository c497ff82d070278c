//! Weight refresh of a sharded (tp2 × dp1 and tp2 × dp2) KDA-hybrid model: every rank's fused
//! buffers keep their addresses, and the model then computes exactly what a fresh load of the
//! new checkpoint computes.

use std::path::Path;
use tandem_engine::models::kda_hybrid::{KdaHybridModel, KdaInputProjection, ShardedKdaHybrid};
use tandem_topology::{Layout, Rank};

fn fused_input_ptr(m: &KdaHybridModel, layer: usize) -> usize {
    match &m.kda_layer(layer).expect("layer 0 is KDA").input {
        KdaInputProjection::Fused { weight, .. } => weight.weight.address(),
        KdaInputProjection::Separate { .. } => panic!("kimi_tiny's KDA layers fuse"),
    }
}

/// kimi_tiny with its embeddings scaled element-wise by a varying factor.
fn perturbed_copy(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("mkdir");
    std::fs::copy(src.join("config.json"), dst.join("config.json")).expect("config");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("weights");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let offs = &header["model.embed_tokens.weight"]["data_offsets"];
    let s = offs[0].as_u64().expect("start") as usize + 8 + n;
    let e = offs[1].as_u64().expect("end") as usize + 8 + n;
    let mut out = bytes.clone();
    for (i, c) in out[s..e].chunks_exact_mut(4).enumerate() {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]])
            * (1.0 + 0.5 * ((i % 7) as f32 - 3.0) / 3.0);
        c.copy_from_slice(&v.to_le_bytes());
    }
    std::fs::write(dst.join("model.safetensors"), out).expect("write");
}

#[test]
fn sharded_refresh_rewrites_in_place_and_matches_a_fresh_load() {
    let base = tandem_testkit::shared_dir().join("reference/kimi_tiny");
    let tmp = tempfile::tempdir().expect("tmp");
    let other = tmp.path().join("perturbed");
    perturbed_copy(&base, &other);
    let ids: Vec<u32> = vec![236, 5, 25, 331, 240, 17, 99];
    for (tp, dp) in [(2, 1), (2, 2)] {
        let layout = Layout::new(tp, dp, 1).expect("layout");
        let mut model = ShardedKdaHybrid::load(&base, layout).expect("load");
        let before: Vec<usize> = (0..tp)
            .map(|r| fused_input_ptr(model.rank(Rank(r)).expect("rank"), 0))
            .collect();
        let seqs = vec![ids.clone(); dp];
        let old_logits = model.forward_full(&seqs).expect("forward");
        model.refresh_weights(&other).expect("refresh");
        let after: Vec<usize> = (0..tp)
            .map(|r| fused_input_ptr(model.rank(Rank(r)).expect("rank"), 0))
            .collect();
        assert_eq!(
            before, after,
            "tp{tp} dp{dp}: fused buffers must stay where they were"
        );
        let got = model.forward_full(&seqs).expect("forward");
        let want = ShardedKdaHybrid::load(&other, layout)
            .expect("load new")
            .forward_full(&seqs)
            .expect("forward");
        assert_eq!(
            got, want,
            "tp{tp} dp{dp}: refreshed model equals a fresh load"
        );
        assert_ne!(got, old_logits, "the new checkpoint changes the logits");
        assert!(model.refresh_weights(&tmp.path().join("missing")).is_err());
    }
}
