//! Scalar conversions between f32 and the stored weight formats: bf16 and IEEE binary16 bit
//! patterns, and symmetric per-row int8 with one f32 scale per row.

/// Round an f32 to the nearest bf16 (ties to even) and return its bit pattern. NaN stays NaN
/// (quiet, sign kept); values beyond the largest bf16 round to infinity.
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

/// Widen a bf16 bit pattern to f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round an f32 to the nearest IEEE binary16 (ties to even) and return its bit pattern.
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Widen an IEEE binary16 bit pattern to f32 (exact).
#[inline]
pub fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// Quantise one weight row symmetrically to int8 and return its scale.
/// `row`: [k] f32; `q`: [k] receives round(row[c] / scale) clamped to [-127, 127] (round half away
/// from zero), with scale = max_c |row[c]| / 127. A row whose largest magnitude is 0 gets scale 0
/// and all-zero q. The dequantised value of q[c] is q[c] as f32 * scale.
pub fn quantize_int8_row(row: &[f32], q: &mut [i8]) -> f32 {
    assert_eq!(row.len(), q.len(), "quantize_int8_row: row and q differ in length");
    let absmax = row.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    if absmax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let scale = absmax / 127.0;
    crate::matmul::vectorized(
        #[inline(always)]
        || {
            for (d, &v) in q.iter_mut().zip(row) {
                *d = (v / scale).round().clamp(-127.0, 127.0) as i32 as i8;
            }
        },
    );
    scale
}

/// Quantise a row-major matrix `w`: [rows, k] row by row with [`quantize_int8_row`].
/// Returns (q [rows, k], scales [rows]).
pub fn quantize_int8(w: &[f32], k: usize) -> (Vec<i8>, Vec<f32>) {
    if k == 0 {
        return (Vec::new(), Vec::new());
    }
    assert_eq!(w.len() % k, 0, "quantize_int8: length is not a multiple of k");
    let mut q = vec![0i8; w.len()];
    let scales = w.chunks_exact(k).zip(q.chunks_exact_mut(k)).map(|(row, qr)| quantize_int8_row(row, qr)).collect();
    (q, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_hand_computed_row() {
        let row = [0.5f32, -1.27, 0.0, 1.27];
        let mut q = [0i8; 4];
        let scale = quantize_int8_row(&row, &mut q);
        assert_eq!(scale, 1.27f32 / 127.0);
        assert!((scale - 0.01).abs() < 1e-9);
        assert_eq!(q, [50, -127, 0, 127]);
    }

    #[test]
    fn int8_zero_row_and_rounding() {
        let mut q = [5i8; 3];
        assert_eq!(quantize_int8_row(&[0.0, -0.0, 0.0], &mut q), 0.0);
        assert_eq!(q, [0, 0, 0]);
        // scale = 1.0: halves round away from zero.
        let mut q = [0i8; 5];
        assert_eq!(quantize_int8_row(&[127.0, 2.5, -2.5, 0.49, -127.0], &mut q), 1.0);
        assert_eq!(q, [127, 3, -3, 0, -127]);
        let (q, scales) = quantize_int8(&[0.0, 0.0, 1.0, -0.5], 2);
        assert_eq!(scales, vec![0.0, 1.0 / 127.0]);
        assert_eq!(q, vec![0, 0, 127, -64]);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        let cases: [(u32, u16); 12] = [
            (0x3F80_0000, 0x3F80),
            (0x3F80_7FFF, 0x3F80),
            (0x3F80_8000, 0x3F80),
            (0x3F80_8001, 0x3F81),
            (0x3F81_8000, 0x3F82),
            (0x3F81_7FFF, 0x3F81),
            (0xBF80_8000, 0xBF80),
            (0xBF81_8000, 0xBF82),
            (0x7F7F_FFFF, 0x7F80),
            (0x7F80_0000, 0x7F80),
            (0x8000_0000, 0x8000),
            (0x0000_8001, 0x0001),
        ];
        for (bits, want) in cases {
            assert_eq!(f32_to_bf16(f32::from_bits(bits)), want, "{bits:#010x}");
        }
        for nan in [0x7FC0_0000u32, 0x7F80_0001, 0xFFFF_FFFF, 0x7F80_FFFF] {
            assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(nan))).is_nan(), "{nan:#010x}");
        }
        assert_eq!(bf16_to_f32(0x3FC0), 1.5);
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        let cases: [(f32, u16); 6] = [
            (1.0, 0x3C00),
            (1.0 + 1.0 / 2048.0, 0x3C00),
            (1.0 + 3.0 / 2048.0, 0x3C02),
            (65504.0, 0x7BFF),
            (65520.0, 0x7C00),
            (-2.0, 0xC000),
        ];
        for (v, want) in cases {
            assert_eq!(f32_to_f16(v), want, "{v}");
        }
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    }
}
