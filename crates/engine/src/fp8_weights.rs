//! Block-FP8 checkpoints (E4M3 codes with one `weight_scale_inv` per 128×128 tile, the
//! DeepSeek/Kimi format): read, and dequantised to f32 at load for every model family (the
//! backends then keep the weights in the dtype the model runs, f32 or bf16), except where a
//! KDA hybrid's routed experts stay FP8 on a backend with FP8 products ([`BlockFp8`]).

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::ops::Range;

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

/// Pairs each FP8 `name → (shape, codes)` with its `.weight_scale_inv`, which `take_scale`
/// hands over (and removes from the f32 tensors), checking shapes; returns `(name, shape,
/// matrix)`.
pub(crate) fn with_scales(
    fp8: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    block: usize,
    mut take_scale: impl FnMut(&str) -> Option<Vec<f32>>,
) -> Result<Vec<(String, Vec<usize>, BlockFp8)>> {
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
        let matrix = BlockFp8 {
            codes,
            scales,
            rows,
            cols,
            block,
        };
        out.push((name, shape, matrix));
    }
    Ok(out)
}

/// [`with_scales`], dequantised: `(name, shape, values)`.
pub(crate) fn dequantize(
    fp8: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    block: usize,
    take_scale: impl FnMut(&str) -> Option<Vec<f32>>,
) -> Result<Vec<Dequantised>> {
    Ok(with_scales(fp8, block, take_scale)?
        .into_iter()
        .map(|(name, shape, m)| {
            let values = m.dequantize();
            (name, shape, values)
        })
        .collect())
}

/// A block-FP8 matrix kept as FP8: E4M3 codes `[rows, cols]` row-major and one f32 scale per
/// `block`×`block` tile (`[rows/block, cols/block]` rounded up, row-major), what a backend with
/// FP8 products uploads as it is ([`crate::Backend::upload_fp8_weight`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockFp8 {
    /// E4M3 codes, `rows * cols`.
    pub codes: Vec<u8>,
    /// Tile scales (`weight_scale_inv`: value = code × scale).
    pub scales: Vec<f32>,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    /// Tile side.
    pub block: usize,
}

impl BlockFp8 {
    fn tile_cols(&self) -> usize {
        self.cols.div_ceil(self.block)
    }

    /// Whether `range` of `len` starts and ends on tile edges (or ends at `len`).
    fn aligned(&self, range: &Range<usize>, len: usize) -> bool {
        range.start.is_multiple_of(self.block)
            && (range.end.is_multiple_of(self.block) || range.end == len)
            && range.end <= len
            && range.start < range.end
    }

    /// Rows `range`, or `None` when it cuts through tiles.
    pub fn rows(&self, range: Range<usize>) -> Option<Self> {
        if !self.aligned(&range, self.rows) {
            return None;
        }
        let tc = self.tile_cols();
        let tiles = range.start / self.block..range.end.div_ceil(self.block);
        Some(Self {
            codes: self.codes[range.start * self.cols..range.end * self.cols].to_vec(),
            scales: self.scales[tiles.start * tc..tiles.end * tc].to_vec(),
            rows: range.len(),
            cols: self.cols,
            block: self.block,
        })
    }

    /// Columns `range`, or `None` when it cuts through tiles.
    pub fn cols(&self, range: Range<usize>) -> Option<Self> {
        if !self.aligned(&range, self.cols) {
            return None;
        }
        let tc = self.tile_cols();
        let tiles = range.start / self.block..range.end.div_ceil(self.block);
        Some(Self {
            codes: (0..self.rows)
                .flat_map(|r| &self.codes[r * self.cols + range.start..r * self.cols + range.end])
                .copied()
                .collect(),
            scales: (0..self.rows.div_ceil(self.block))
                .flat_map(|t| &self.scales[t * tc + tiles.start..t * tc + tiles.end])
                .copied()
                .collect(),
            rows: self.rows,
            cols: range.len(),
            block: self.block,
        })
    }

    /// `self` over `below` (the same columns and tile side), or `None` when `self`'s rows
    /// end inside a tile (the stacked tiles would mix the two matrices).
    pub fn stack(mut self, below: Self) -> Option<Self> {
        if self.cols != below.cols
            || self.block != below.block
            || !self.rows.is_multiple_of(self.block)
        {
            return None;
        }
        self.codes.extend(below.codes);
        self.scales.extend(below.scales);
        self.rows += below.rows;
        Some(self)
    }

    /// The values, f32.
    pub fn dequantize(&self) -> Vec<f32> {
        tandem_model::fp8::dequantize_blocks(
            &self.codes,
            &self.scales,
            self.rows,
            self.cols,
            self.block,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 300×260 matrix in 128-wide tiles (the last ones partial), its values and its codes.
    fn matrix() -> (BlockFp8, Vec<f32>) {
        let (rows, cols) = (300, 260);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0 + (i / cols) as f32 * 0.01)
            .collect();
        let (codes, scales) = tandem_model::fp8::quantize_blocks(&values, rows, cols, 128);
        let m = BlockFp8 {
            codes,
            scales,
            rows,
            cols,
            block: 128,
        };
        let exact = m.dequantize();
        (m, exact)
    }

    #[test]
    fn tile_aligned_slices_keep_their_values_and_others_are_refused() {
        let (m, all) = matrix();
        let rows = m.rows(128..300).expect("whole tiles down to the end");
        assert_eq!(rows.dequantize(), all[128 * 260..].to_vec());
        let cols = m.cols(128..256).expect("one tile column");
        let want: Vec<f32> = (0..300)
            .flat_map(|r| all[r * 260 + 128..r * 260 + 256].to_vec())
            .collect();
        assert_eq!(cols.dequantize(), want);
        assert_eq!(m.rows(0..100), None, "ends inside a tile");
        assert_eq!(m.cols(64..128), None, "starts inside a tile");
        assert_eq!(m.rows(256..256), None, "empty");
    }

    #[test]
    fn stacking_keeps_both_matrices_and_needs_whole_tiles_above() {
        let (m, all) = matrix();
        let (top, bottom) = (
            m.rows(0..128).expect("a tile row"),
            m.rows(128..300).expect("rest"),
        );
        let stacked = top
            .clone()
            .stack(bottom.clone())
            .expect("whole tiles above");
        assert_eq!(stacked.dequantize(), all);
        assert_eq!(stacked, m);
        assert_eq!(bottom.stack(top), None, "172 rows end inside a tile");
    }
}
