//! Block-scaled FP8 (E4M3, "fn" variant: no infinities, max 448) as used by FP8 checkpoints:
//! a weight `(out, in)` is split into `block × block` tiles, each stored as E4M3 codes plus one
//! f32 `weight_scale_inv` per tile; the real value is `decode(code) * scale_inv[tile]`.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an E4M3FN byte.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0x0F);
    let man = f32::from(code & 0x07);
    if exp == 0x0F && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

/// The nearest E4M3FN byte to `v` (saturating at ±448, ties to the even code).
pub fn f32_to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7F;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs().min(E4M3_MAX);
    // Positive codes 0..=0x7E are monotonic in value: binary search the nearest.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code
}

/// Quantises a row-major `(rows, cols)` matrix into E4M3 codes and per-tile `scale_inv`
/// (`ceil(rows/block) × ceil(cols/block)`, row-major).
pub fn quantize_blocks(w: &[f32], rows: usize, cols: usize, block: usize) -> (Vec<u8>, Vec<f32>) {
    let (br, bc) = (rows.div_ceil(block), cols.div_ceil(block));
    let mut scales = vec![0.0f32; br * bc];
    for (i, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = ((i / bc) * block, (i % bc) * block);
        let mut amax = 0.0f32;
        for r in r0..(r0 + block).min(rows) {
            for c in c0..(c0 + block).min(cols) {
                amax = amax.max(w[r * cols + c].abs());
            }
        }
        *s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
    }
    let codes = w
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (r, c) = (i / cols, i % cols);
            f32_to_e4m3(v / scales[(r / block) * bc + c / block])
        })
        .collect();
    (codes, scales)
}

/// The inverse of [`quantize_blocks`]: f32 values of a block-scaled FP8 matrix.
pub fn dequantize_blocks(
    codes: &[u8],
    scale_inv: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
) -> Vec<f32> {
    assert_eq!(
        codes.len(),
        rows * cols,
        "codes must hold rows * cols values"
    );
    let bc = cols.div_ceil(block);
    codes
        .iter()
        .enumerate()
        .map(|(i, &q)| {
            let (r, c) = (i / cols, i % cols);
            e4m3_to_f32(q) * scale_inv[(r / block) * bc + c / block]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
    }

    #[test]
    fn every_finite_code_round_trips() {
        for code in 0u8..=0xFE {
            if code == 0x7F || code == 0x80 {
                continue; // NaN, and -0 encodes as +0's sign bit only
            }
            assert_eq!(f32_to_e4m3(e4m3_to_f32(code)), code, "code {code:#x}");
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7E, "saturates");
    }

    #[test]
    fn block_quantisation_error_is_small_and_per_tile() {
        let (rows, cols, block) = (200, 130, 128);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .enumerate()
            .map(|(i, v)| if i / cols >= 128 { v * 100.0 } else { v })
            .collect();
        let (codes, scales) = quantize_blocks(&w, rows, cols, block);
        assert_eq!(scales.len(), 2 * 2);
        let back = dequantize_blocks(&codes, &scales, rows, cols, block);
        for (i, (a, b)) in w.iter().zip(&back).enumerate() {
            let tile_max = if i / cols >= 128 { 50.0 } else { 0.5 };
            assert!((a - b).abs() <= tile_max / 16.0 + 1e-6, "{i}: {a} vs {b}");
        }
    }
}
