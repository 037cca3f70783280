//! Weight dtypes other than f32, written from the contracts `kernel.linear_bf16`,
//! `kernel.linear_f16` and `kernel.linear_int8`: exact widening of stored weights to f64, and the
//! load-time conversions an engine applies to an f32 checkpoint (so the reference forward pass can
//! run on exactly the weights the engine holds).

/// bf16 bit pattern to its exact value: the upper half of an IEEE binary32 (contract kernel.linear_bf16).
pub fn bf16_value(bits: u16) -> f64 {
    f32::from_bits((bits as u32) << 16) as f64
}

/// IEEE binary16 bit pattern to its exact value, subnormals included (contract kernel.linear_f16).
pub fn f16_value(bits: u16) -> f64 {
    half::f16::from_bits(bits).to_f64()
}

/// Widen bf16 bit patterns. `w`: [len] -> [len].
pub fn widen_bf16(w: &[u16]) -> Vec<f64> {
    w.iter().map(|&b| bf16_value(b)).collect()
}

/// Widen IEEE binary16 bit patterns. `w`: [len] -> [len].
pub fn widen_f16(w: &[u16]) -> Vec<f64> {
    w.iter().map(|&b| f16_value(b)).collect()
}

/// Dequantise int8 rows: `q`: [n, k], `scales`: [n] -> [n, k] with value q[o, c] * scales[o]
/// (contract kernel.linear_int8). `k` = q.len() / scales.len().
pub fn dequant_int8(q: &[i8], scales: &[f32]) -> Vec<f64> {
    if scales.is_empty() {
        return Vec::new();
    }
    let k = q.len() / scales.len();
    q.chunks_exact(k.max(1)).zip(scales).flat_map(|(row, &s)| row.iter().map(move |&v| v as f64 * s as f64)).collect()
}

/// f32 to bf16 with round to nearest, ties to even; a NaN stays a NaN (quiet bit set).
/// Rule from contract kernel.linear_bf16: `(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`.
pub fn round_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// f32 to IEEE binary16 with round to nearest, ties to even (overflow to infinity).
pub fn round_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Quantise one weight row to int8 with its scale, as contract kernel.linear_int8 states:
/// scale = absmax / 127 (f32), q = clamp(round(v / scale), -127, 127) with f32 division and round
/// half away from zero; an all-zero row gets scale 0 and q = 0. `row`: [k] -> ([k], scale).
pub fn quantize_int8_row(row: &[f32]) -> (Vec<i8>, f32) {
    let absmax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = absmax / 127.0;
    if scale == 0.0 {
        return (vec![0; row.len()], 0.0);
    }
    (row.iter().map(|&v| (v / scale).round().clamp(-127.0, 127.0) as i8).collect(), scale)
}

/// The value an engine storing weights in `dtype` computes with, for one f32 weight matrix `w`
/// ([rows, k] row-major): bf16/f16 rounding, or int8 quantisation per row then dequantisation.
/// `f32` returns the values unchanged.
///
/// # Panics
/// On a dtype outside [`ckb::WEIGHT_DTYPES`] (callers check the constraint first).
pub fn as_stored(w: &[f32], k: usize, dtype: &str) -> Vec<f64> {
    match dtype {
        "f32" => super::widen(w),
        "bf16" => w.iter().map(|&v| bf16_value(round_bf16(v))).collect(),
        "f16" => w.iter().map(|&v| f16_value(round_f16(v))).collect(),
        "int8" => w
            .chunks(k.max(1))
            .flat_map(|row| {
                let (q, s) = quantize_int8_row(row);
                q.into_iter().map(move |v| v as f64 * s as f64)
            })
            .collect(),
        other => panic!("no storage rule for weight dtype {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1.0 is 0x3F80_0000; one bf16 ulp at 1.0 is 2^-7.
        assert_eq!(round_bf16(1.0), 0x3F80);
        // Exactly half an ulp above 1.0 (0x3F80_8000): tie, stays at the even 0x3F80.
        assert_eq!(round_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        // Half an ulp above 0x3F81 (odd): tie goes up to the even 0x3F82.
        assert_eq!(round_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        // Just above half: up.
        assert_eq!(round_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(bf16_value(0xC040), -3.0);
        assert!(bf16_value(round_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn f16_values_from_the_standard() {
        // IEEE 754 binary16 examples: 0x3C00 = 1, 0xC000 = -2, 0x7BFF = 65504, 0x0001 = 2^-24.
        assert_eq!(f16_value(0x3C00), 1.0);
        assert_eq!(f16_value(0xC000), -2.0);
        assert_eq!(f16_value(0x7BFF), 65504.0);
        assert_eq!(f16_value(0x0001), 2f64.powi(-24));
        assert_eq!(round_f16(1.0), 0x3C00);
    }

    #[test]
    fn int8_row_quantisation_by_hand() {
        // absmax 1.27 -> scale 0.01; 0.5 / 0.01 = 50; -1.27 -> -127.
        let (q, s) = quantize_int8_row(&[0.5, -1.27, 0.0, 1.27]);
        assert_eq!(q, vec![50, -127, 0, 127]);
        assert!((s - 0.01).abs() < 1e-9);
        assert_eq!(quantize_int8_row(&[0.0, 0.0]), (vec![0, 0], 0.0));
        assert_eq!(dequant_int8(&[2, -3, 1, 0], &[0.5, 2.0]), vec![1.0, -1.5, 2.0, 0.0]);
    }
}
