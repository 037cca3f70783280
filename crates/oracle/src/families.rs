//! Oracle pieces the families beyond plain Llama need: GeGLU with the tanh-approximated GELU, RoPE with
//! scaled frequencies (linear, Llama 3.1), per-head RMSNorm and projection biases. Plain loops in f64.

use model::RopeScaling;

/// GELU with the tanh approximation (Hendrycks & Gimpel 2016, arXiv:1606.08415, eq. after (2); PyTorch's
/// `gelu(approximate="tanh")`, HF `gelu_pytorch_tanh`): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// GeGLU (Shazeer 2020, arXiv:2002.05202): `gelu_tanh(gate) * up`, element-wise.
/// (Gemma's MLP; no kernel contract yet, see contracts/models/gemma.toml)
pub fn gelu_tanh_and_mul(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter().zip(up).map(|(g, u)| gelu_tanh(*g) * u).collect()
}

/// RoPE inverse frequencies `theta^(-2j/head_dim)`, j in 0..head_dim/2, with `scaling` applied:
/// - `linear`: every frequency divided by `factor` (equivalently, positions divided by `factor`);
/// - `llama3` (Llama 3.1; Meta llama-models `apply_scaling` in models/llama3/reference_impl/model.py, and
///   HF transformers `_compute_llama3_parameters`): with wavelength `2 pi / f`,
///   `lo = original_max / low_freq_factor` and `hi = original_max / high_freq_factor`, a frequency whose
///   wavelength is below `hi` is kept, above `lo` is divided by `factor`, and in between it is blended:
///   `s = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)`,
///   `f' = (1 - s) f / factor + s f`;
/// - `yarn` (Peng et al. 2023, arXiv:2309.00071, section 3.2 "NTK-by-parts"; HF transformers
///   `_compute_yarn_parameters`): with `d = head_dim`, the dimension at which a frequency turns
///   `r` times over the original context is `dim(r) = d ln(original_max / (2 pi r)) / (2 ln theta)`;
///   `lo = dim(beta_fast)`, `hi = dim(beta_slow)` (floored and ceiled when `truncate`), clamped
///   to `[0, d - 1]` (`hi` nudged by 0.001 when equal); pair j's ramp `s = clamp((j - lo) / (hi - lo), 0, 1)`
///   blends `f' = s f / factor + (1 - s) f`. The attention factor that multiplies cos and sin is
///   applied where the rotation is (`RopeScaling::attention_factor`).
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2).map(|j| theta.powf(-2.0 * j as f64 / head_dim as f64)).collect();
    let Some(s) = scaling else { return base };
    match s.rope_type.as_str() {
        "linear" => base.iter().map(|f| f / s.factor).collect(),
        "llama3" => {
            let old = s.original_max_position_embeddings as f64;
            let low_wavelen = old / s.low_freq_factor;
            let high_wavelen = old / s.high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                })
                .collect()
        }
        "yarn" => {
            let d = head_dim as f64;
            let orig = s.original_max_position_embeddings as f64;
            let dim = |rot: f64| d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
            let (mut lo, mut hi) = (dim(s.beta_fast), dim(s.beta_slow));
            if s.truncate {
                (lo, hi) = (lo.floor(), hi.ceil());
            }
            let (lo, mut hi) = (lo.max(0.0), hi.min(d - 1.0));
            if lo == hi {
                hi += 0.001;
            }
            base.iter()
                .enumerate()
                .map(|(j, &f)| {
                    let ramp = ((j as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    ramp * f / s.factor + (1.0 - ramp) * f
                })
                .collect()
        }
        _ => base,
    }
}

/// Rotate-half RoPE of one token at `pos` with explicit inverse frequencies (length head_dim/2), in place.
/// `x`: [n_heads, head_dim].
pub fn rope_with_freqs(x: &mut [f64], pos: usize, n_heads: usize, head_dim: usize, inv_freq: &[f64]) {
    rope_pairs_with_freqs(x, pos, n_heads, head_dim, inv_freq, false);
}

/// As [`rope_with_freqs`], rotating the pairs (2j, 2j + 1) instead of (j, j + head_dim / 2) when
/// `adjacent` (the mutant `rope_adjacent` at scaled frequencies).
pub fn rope_pairs_with_freqs(
    x: &mut [f64],
    pos: usize,
    n_heads: usize,
    head_dim: usize,
    inv_freq: &[f64],
    adjacent: bool,
) {
    let half = head_dim / 2;
    for h in 0..n_heads {
        let base = h * head_dim;
        for (j, f) in inv_freq.iter().enumerate().take(half) {
            let (sin, cos) = (pos as f64 * f).sin_cos();
            let (ia, ib) = if adjacent { (base + 2 * j, base + 2 * j + 1) } else { (base + j, base + j + half) };
            let (a, b) = (x[ia], x[ib]);
            x[ia] = a * cos - b * sin;
            x[ib] = a * sin + b * cos;
        }
    }
}

/// Add `bias` (length n) to every row of `x` ([rows, n]) in place.
pub fn add_bias(x: &mut [f64], bias: &[f64]) {
    for row in x.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
    }
}
