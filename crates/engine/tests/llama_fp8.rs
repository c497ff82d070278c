//! Block-FP8 Llama checkpoints: the loader dequantises each projection with its tile scales,
//! giving exactly the model written out in f32 from the same codes and scales.

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tandem_core::BlockId;
use tandem_engine::batch::ForwardBatch;
use tandem_engine::{CpuBackend, DType, KvCache, LlamaModel};

fn logits(dir: &std::path::Path, ids: &[u32]) -> Vec<f32> {
    let model = LlamaModel::load(dir, CpuBackend::new(), DType::F32).expect("load");
    let blocks = ids.len().div_ceil(16);
    let mut cache = KvCache::new(model.backend(), model.kv_layout(16, blocks));
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let mut batch = ForwardBatch::default();
    batch.push(ids, 0, &table, 16, false);
    batch.logits_rows = (0..ids.len()).collect();
    model.forward_batch(&batch, &mut cache).expect("forward")
}

#[test]
fn fp8_projections_load_as_their_dequantised_values() {
    let fp8 = tempfile::tempdir().expect("temp dir");
    tandem_model::synth::synth_llama_with("tiny", fp8.path(), 4, true).expect("synth fp8");
    // The same checkpoint in f32, dequantised here from the file's own codes and scales.
    let bytes = std::fs::read(fp8.path().join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    let scales: std::collections::HashMap<String, Vec<f32>> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n.ends_with(".weight_scale_inv"))
        .map(|(n, v)| {
            let s = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            (n, s.collect())
        })
        .collect();
    let mut f32_tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut quantized = 0;
    for (name, view) in st.tensors() {
        if name.ends_with(".weight_scale_inv") {
            continue;
        }
        let shape = view.shape().to_vec();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F8_E4M3 => {
                quantized += 1;
                let module = name.strip_suffix(".weight").expect("a weight");
                tandem_model::fp8::dequantize_blocks(
                    view.data(),
                    &scales[&format!("{module}.weight_scale_inv")],
                    shape[0],
                    shape[1],
                    128,
                )
            }
            Dtype::BF16 => view
                .data()
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => panic!("{name}: {other:?}"),
        };
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        f32_tensors.push((name, shape, raw));
    }
    assert_eq!(quantized, 2 * 7, "every projection of both layers is FP8");
    let plain = tempfile::tempdir().expect("temp dir");
    let views: Vec<(String, TensorView<'_>)> = f32_tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &plain.path().join("model.safetensors"))
        .expect("write");
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fp8.path().join("config.json")).expect("config"),
    )
    .expect("json");
    assert!(config.get("quantization_config").is_some());
    config
        .as_object_mut()
        .expect("object")
        .remove("quantization_config");
    std::fs::write(plain.path().join("config.json"), config.to_string()).expect("write config");
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 500).collect();
    assert_eq!(
        logits(fp8.path(), &ids),
        logits(plain.path(), &ids),
        "the FP8 checkpoint must load as its dequantised values"
    );
}
