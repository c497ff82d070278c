//! GGML encodings to f32.
//!
//! Block formats (32 elements per block, little-endian):
//! - `Q8_0`: f16 scale `d`, then 32 `i8` `q`; value `d·q`.
//! - `Q4_1`: f16 scale `d`, f16 min `m`, then 16 bytes; byte `j` holds element `j` in its low
//!   nibble and element `j + 16` in its high nibble; value `d·q + m`.
//! - `Q4_0`: f16 scale `d`, then 16 bytes laid out as in `Q4_1`; value `d·(q − 8)`.
//!
//! The arithmetic is done in f32 exactly as written (multiply, then add; no fused
//! multiply-add), so results are bit-identical to a NumPy reference dequantiser.

use crate::gguf::GgmlType;
use crate::{Error, Result};
use half::{bf16, f16};

const BLOCK: usize = 32;

/// Decodes `elements` values of type `ggml_type` from `data`.
pub fn dequantize(ggml_type: GgmlType, data: &[u8], elements: usize) -> Result<Vec<f32>> {
    let expected = ggml_type
        .byte_len(elements)
        .ok_or_else(|| match ggml_type.block_layout() {
            Some((block, _)) => Error::Unsupported(format!(
                "{elements} elements of {ggml_type} (not a multiple of the block size {block})"
            )),
            None => Error::Unsupported(format!("tensor encoding {ggml_type}")),
        })?;
    if data.len() != expected {
        return Err(Error::TensorSize {
            ggml_type,
            elements,
            expected,
            actual: data.len(),
        });
    }
    let mut out = vec![0f32; elements];
    match ggml_type {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(BLOCK).zip(data.chunks_exact(34)) {
                q8_0_block(b, o);
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(BLOCK).zip(data.chunks_exact(20)) {
                q4_1_block(b, o);
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(BLOCK).zip(data.chunks_exact(18)) {
                q4_0_block(b, o);
            }
        }
        GgmlType::Other(_) => {
            return Err(Error::Unsupported(format!("tensor encoding {ggml_type}")));
        }
    }
    Ok(out)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn q8_0_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
        *o = d * f32::from(q as i8);
    }
}

fn q4_1_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let m = f16_at(block, 2);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &byte) in block[4..20].iter().enumerate() {
        lo[j] = d * f32::from(byte & 0x0f) + m;
        hi[j] = d * f32::from(byte >> 4) + m;
    }
}

fn q4_0_block(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let (lo, hi) = out.split_at_mut(16);
    for (j, &byte) in block[2..18].iter().enumerate() {
        lo[j] = d * (f32::from(byte & 0x0f) - 8.0);
        hi[j] = d * (f32::from(byte >> 4) - 8.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn f32_and_f16_pass_through() {
        let data: Vec<u8> = [1.5f32, -0.25, 3e-8]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(
            dequantize(GgmlType::F32, &data, 3).expect("f32"),
            [1.5, -0.25, 3e-8]
        );
        let data: Vec<u8> = [1.5f32, -0.25, 65504.0]
            .iter()
            .flat_map(|&v| f16_bytes(v))
            .collect();
        assert_eq!(
            dequantize(GgmlType::F16, &data, 3).expect("f16"),
            [1.5, -0.25, 65504.0]
        );
    }

    #[test]
    fn q8_0_block_by_hand() {
        // d = 0.5; q = 0, 1, -1, 2, -2, ..., then 127 and -128 at the end.
        let mut block = f16_bytes(0.5).to_vec();
        let mut q: Vec<i8> = (0..30)
            .map(|i| if i % 2 == 0 { i / 2 } else { -(i / 2) - 1 })
            .collect();
        q.push(127);
        q.push(-128);
        block.extend(q.iter().map(|&v| v as u8));
        let out = dequantize(GgmlType::Q8_0, &block, 32).expect("q8_0");
        assert_eq!(&out[..5], &[0.0, -0.5, 0.5, -1.0, 1.0]);
        assert_eq!(out[30], 63.5);
        assert_eq!(out[31], -64.0);
    }

    #[test]
    fn q4_1_block_by_hand() {
        // d = 2, m = -1. Byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
        let mut block = f16_bytes(2.0).to_vec();
        block.extend(f16_bytes(-1.0));
        block.extend((0u8..16).map(|j| ((15 - j) << 4) | j));
        let out = dequantize(GgmlType::Q4_1, &block, 32).expect("q4_1");
        // Elements 0-15 come from low nibbles: 2*j - 1.
        assert_eq!(out[0], -1.0);
        assert_eq!(out[1], 1.0);
        assert_eq!(out[15], 29.0);
        // Elements 16-31 come from high nibbles: 2*(15-j) - 1.
        assert_eq!(out[16], 29.0);
        assert_eq!(out[17], 27.0);
        assert_eq!(out[31], -1.0);
    }

    #[test]
    fn q4_1_two_blocks_are_independent() {
        let mut data = Vec::new();
        for (d, m) in [(1.0f32, 0.0f32), (0.5, 10.0)] {
            data.extend(f16_bytes(d));
            data.extend(f16_bytes(m));
            data.extend([0x21u8; 16]); // low nibble 1, high nibble 2
        }
        let out = dequantize(GgmlType::Q4_1, &data, 64).expect("q4_1");
        assert_eq!(&out[..16], &[1.0; 16]);
        assert_eq!(&out[16..32], &[2.0; 16]);
        assert_eq!(&out[32..48], &[10.5; 16]);
        assert_eq!(&out[48..], &[11.0; 16]);
    }

    #[test]
    fn q4_0_block_by_hand() {
        let mut block = f16_bytes(0.25).to_vec();
        block.extend([0xf0u8; 16]); // low nibble 0 → -8, high nibble 15 → 7
        let out = dequantize(GgmlType::Q4_0, &block, 32).expect("q4_0");
        assert_eq!(&out[..16], &[-2.0; 16]);
        assert_eq!(&out[16..], &[1.75; 16]);
    }

    #[test]
    fn rejects_wrong_sizes_and_unknown_types() {
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 19], 32),
            Err(Error::TensorSize {
                expected: 20,
                actual: 19,
                ..
            })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0; 34], 31),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            dequantize(GgmlType::Other(14), &[0; 210], 256),
            Err(Error::Unsupported(_))
        ));
    }
}
