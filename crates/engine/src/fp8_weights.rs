//! Block-FP8 checkpoints (E4M3 codes with one `weight_scale_inv` per 128×128 tile, the
//! DeepSeek/Kimi format): read and dequantised to f32 at load, for every model family. The
//! backends then keep the weights in the dtype the model runs (f32 or bf16).

use crate::{Error, Result};
use std::collections::BTreeMap;

/// The FP8 tile size from `quantization_config.weight_block_size` (128 when absent).
pub(crate) fn block_size(config: &serde_json::Value) -> Result<usize> {
    let Some(bs) = config
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
        .and_then(|b| b.as_array())
    else {
        return Ok(128);
    };
    let sizes: Vec<u64> = bs.iter().filter_map(|v| v.as_u64()).collect();
    match sizes.as_slice() {
        [r, c] if r == c && *r > 0 => Ok(*r as usize),
        _ => Err(Error::Weights(format!(
            "weight_block_size {bs:?}: only square tiles are supported"
        ))),
    }
}

/// A dequantised tensor: name, shape, values.
pub(crate) type Dequantised = (String, Vec<usize>, Vec<f32>);

/// Dequantises each FP8 `name → (shape, codes)` with its `.weight_scale_inv`, which
/// `take_scale` hands over (and removes from the f32 tensors); returns `(name, shape, values)`.
pub(crate) fn dequantize(
    fp8: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    block: usize,
    mut take_scale: impl FnMut(&str) -> Option<Vec<f32>>,
) -> Result<Vec<Dequantised>> {
    let mut out = Vec::with_capacity(fp8.len());
    for (name, (shape, codes)) in fp8 {
        let module = name
            .strip_suffix(".weight")
            .ok_or_else(|| Error::Weights(format!("{name}: FP8 tensor that is not a .weight")))?;
        let scale_name = format!("{module}.weight_scale_inv");
        let scales = take_scale(&scale_name)
            .ok_or_else(|| Error::Weights(format!("{name} is FP8 but has no {scale_name}")))?;
        let [rows, cols] = shape[..] else {
            return Err(Error::Weights(format!(
                "{name}: FP8 weight of shape {shape:?}"
            )));
        };
        let tiles = rows.div_ceil(block) * cols.div_ceil(block);
        if scales.len() != tiles {
            return Err(Error::Weights(format!(
                "{scale_name}: {} scales, expected {tiles} for {block}×{block} tiles",
                scales.len()
            )));
        }
        let data = tandem_model::fp8::dequantize_blocks(&codes, &scales, rows, cols, block);
        out.push((name, shape, data));
    }
    Ok(out)
}
