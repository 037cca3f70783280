//! Oracle mutants: known-wrong variants of the f64 reference kernels, one per failure-mode contract
//! (the `mutant` field of `contracts/failures/*.toml`). When an engine fails a gate, the server runs
//! the mutants on the same inputs; a mutant that reproduces the engine's output names the mistake.
//!
//! Each mutant is the reference kernel with exactly one deliberate error, written as plainly as the
//! reference itself. The model-level mutations of the Llama forward pass are in [`Mutation`] (used by
//! [`super::llama::Reference::set_mutations`]); `kv_position_off_by_one` exists only there.

use super::{AttnShape, rope, silu_and_mul, softmax};

/// Names of every mutant, as failure contracts spell them in their `mutant` field.
pub const MUTANTS: &[&str] = &[
    "rope_adjacent",
    "rope_theta_default",
    "rmsnorm_eps_outside",
    "rmsnorm_no_weight",
    "linear_xw",
    "silu_swapped",
    "softmax_no_max",
    "gqa_modulo",
    "attention_no_mask",
    "attention_no_scale",
    "argmax_last",
    "embedding_off_by_one",
    "kv_position_off_by_one",
    "bf16_accumulation",
    "half_format_swapped",
    "int8_scale_missing",
    "gelu_erf",
];

/// `bf16_accumulation`: [`super::linear`] over bf16 weights whose running sum is rounded to bf16
/// (nearest even) after every multiply-add, as a kernel that accumulates in the weight type does.
/// `w`: [n, k] bf16 bits. (failure.bf16-accumulation)
pub fn bf16_accumulation(x: &[f64], w: &[u16], m: usize, k: usize, n: usize) -> Vec<f64> {
    use super::dtypes::{bf16_value, round_bf16};
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for o in 0..n {
            let mut acc = 0.0f64;
            for c in 0..k {
                acc = bf16_value(round_bf16((acc + x[i * k + c] * bf16_value(w[o * k + c])) as f32));
            }
            out.push(acc);
        }
    }
    out
}

/// `half_format_swapped`: [`super::linear`] with the 16-bit weights decoded by the other format's
/// rule: bf16 bits read as IEEE binary16 when `stored_bf16`, binary16 bits read as bf16 otherwise.
/// `w`: [n, k] bits. (failure.half-format-swapped)
pub fn half_format_swapped(x: &[f64], w: &[u16], m: usize, k: usize, n: usize, stored_bf16: bool) -> Vec<f64> {
    let wrong = if stored_bf16 { super::dtypes::widen_f16(w) } else { super::dtypes::widen_bf16(w) };
    super::linear(x, &wrong, m, k, n)
}

/// `int8_scale_missing`: the int8 matrix-vector product without the per-row scale,
/// out[i, o] = sum_c x[i, c] * q[o, c]. `q`: [n, k]. (failure.int8-scale-missing)
pub fn int8_scale_missing(x: &[f64], q: &[i8], m: usize, k: usize, n: usize) -> Vec<f64> {
    let w: Vec<f64> = q.iter().map(|&v| v as f64).collect();
    super::linear(x, &w, m, k, n)
}

/// erf by Abramowitz & Stegun 1964, formula 7.1.26 (absolute error below 1.5e-7), enough to tell
/// the exact GELU from its tanh approximation (they differ by up to about 4e-4).
pub fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let poly =
        t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let y = 1.0 - poly * (-x * x).exp();
    if x < 0.0 { -y } else { y }
}

/// `gelu_erf`: GeGLU with the exact GELU 0.5 g (1 + erf(g / sqrt 2)) instead of the tanh form.
/// All: [len]. (failure.gelu-erf-vs-tanh)
pub fn gelu_erf(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter().zip(up).map(|(g, u)| 0.5 * g * (1.0 + erf(g / std::f64::consts::SQRT_2)) * u).collect()
}

/// Whether a mutant of this name exists (here or, for model-level ones, in [`Mutation`]).
pub fn mutant_exists(name: &str) -> bool {
    MUTANTS.contains(&name)
}

/// The RoPE base many engines hard-code (the Llama 1/2 value), used by [`rope_theta_default`].
pub const DEFAULT_THETA: f64 = 10_000.0;

/// `rope_adjacent`: rotary embedding with interleaved pairing (RoFormer paper, GPT-J, Meta's original
/// Llama layout): pairs (2j, 2j+1) rotated by pos * theta^(-2j/head_dim), instead of (j, j + head_dim/2).
pub fn rope_adjacent(x: &mut [f64], positions: &[usize], n_heads: usize, head_dim: usize, theta: f64) {
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for j in 0..head_dim / 2 {
                let freq = theta.powf(-2.0 * j as f64 / head_dim as f64);
                let (sin, cos) = (pos as f64 * freq).sin_cos();
                let a = x[base + 2 * j];
                let b = x[base + 2 * j + 1];
                x[base + 2 * j] = a * cos - b * sin;
                x[base + 2 * j + 1] = a * sin + b * cos;
            }
        }
    }
}

/// `rope_theta_default`: the reference RoPE with theta fixed at [`DEFAULT_THETA`] whatever `theta` is
/// passed. Equal to the reference when theta = 10000, so it can only be told apart on other thetas.
pub fn rope_theta_default(x: &mut [f64], positions: &[usize], n_heads: usize, head_dim: usize, _theta: f64) {
    rope(x, positions, n_heads, head_dim, DEFAULT_THETA);
}

/// `rmsnorm_eps_outside`: `y = x / (sqrt(mean(x^2)) + eps) * w`, eps added after the root.
pub fn rms_norm_eps_outside(x: &[f64], weight: &[f64], eps: f64) -> Vec<f64> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms.sqrt() + eps);
        out.extend(row.iter().zip(weight).map(|(v, w)| v * inv * w));
    }
    out
}

/// `rmsnorm_no_weight`: `y = x / sqrt(mean(x^2) + eps)`, the learned gain never applied (only the
/// length of `weight` is used, as the row width).
pub fn rms_norm_no_weight(x: &[f64], weight: &[f64], eps: f64) -> Vec<f64> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().map(|v| v * inv));
    }
    out
}

/// `linear_xw`: the [n, k] weight buffer read as [k, n] (a textbook `x W` without the transpose):
/// `out[i, j] = sum_p x[i, p] * w[p * n + j]`. Defined for every shape, since the buffer holds k * n
/// values either way; for k = n it is `x W` with W the transposed matrix.
pub fn linear_xw(x: &[f64], w: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum();
        }
    }
    out
}

/// `silu_swapped`: `silu(up) * gate`, the SiLU applied to the wrong operand.
pub fn silu_swapped(gate: &[f64], up: &[f64]) -> Vec<f64> {
    silu_and_mul(up, gate)
}

/// `softmax_no_max`: `exp(x) / sum exp(x)` without subtracting the row maximum.
///
/// In exact (or f64) arithmetic this equals the softmax for the inputs the tests draw, so the mutant
/// emulates what an f32 engine computes: each `exp` is evaluated in f32 (values above about 88.72
/// overflow to +inf, very negative ones underflow to 0), the denominator is summed in f32 left to
/// right, and each term is divided by it. A row with an overflowed term gives NaN there (inf / inf)
/// and 0 elsewhere; a row whose terms all underflow gives NaN everywhere (0 / 0). Rows without
/// overflow agree with the true softmax to f32 rounding. Compare with a rule that treats matching
/// non-finite values as equal.
pub fn softmax_no_max(x: &[f64], n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let exps: Vec<f32> = row.iter().map(|&v| (v as f32).exp()).collect();
        let sum: f32 = exps.iter().fold(0.0f32, |s, &e| s + e);
        out.extend(exps.iter().map(|&e| (e / sum) as f64));
    }
    out
}

/// Which mistakes [`attention_with`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnFaults {
    /// KV head h % n_kv_heads instead of h / (n_heads / n_kv_heads).
    pub gqa_modulo: bool,
    /// Every query attends to all kv_len positions.
    pub no_mask: bool,
    /// Scores not scaled by 1/sqrt(head_dim).
    pub no_scale: bool,
}

/// The reference attention with some of its three known mistakes; with no fault set it computes the
/// same as [`super::attention`].
pub fn attention_with(q: &[f64], k: &[f64], v: &[f64], s: AttnShape, f: AttnFaults) -> Vec<f64> {
    let AttnShape { n_q, kv_len, n_heads, n_kv_heads, head_dim } = s;
    let group = n_heads / n_kv_heads;
    let scale = if f.no_scale { 1.0 } else { 1.0 / (head_dim as f64).sqrt() };
    let mut out = vec![0.0; n_q * n_heads * head_dim];
    for i in 0..n_q {
        let last = if f.no_mask { kv_len - 1 } else { kv_len - n_q + i };
        for h in 0..n_heads {
            let kvh = if f.gqa_modulo { h % n_kv_heads } else { h / group };
            let qv = &q[(i * n_heads + h) * head_dim..][..head_dim];
            let scores: Vec<f64> = (0..=last)
                .map(|t| {
                    let kv = &k[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                    qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * scale
                })
                .collect();
            let p = softmax(&scores, scores.len());
            let o = &mut out[(i * n_heads + h) * head_dim..][..head_dim];
            for (t, pt) in p.iter().enumerate() {
                let vv = &v[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                for (oj, vj) in o.iter_mut().zip(vv) {
                    *oj += pt * vj;
                }
            }
        }
    }
    out
}

/// `gqa_modulo`: query head h reads KV head h % n_kv_heads (round-robin) instead of h / group.
/// Equal to the reference when group = 1 or n_kv_heads = 1.
pub fn gqa_modulo(q: &[f64], k: &[f64], v: &[f64], s: AttnShape) -> Vec<f64> {
    attention_with(q, k, v, s, AttnFaults { gqa_modulo: true, ..AttnFaults::default() })
}

/// `attention_no_mask`: every query attends to all kv_len positions. Equal to the reference when
/// n_q = 1 (the only query sits at the last position).
pub fn attention_no_mask(q: &[f64], k: &[f64], v: &[f64], s: AttnShape) -> Vec<f64> {
    attention_with(q, k, v, s, AttnFaults { no_mask: true, ..AttnFaults::default() })
}

/// `attention_no_scale`: scores q . k without the 1/sqrt(head_dim) factor.
pub fn attention_no_scale(q: &[f64], k: &[f64], v: &[f64], s: AttnShape) -> Vec<f64> {
    attention_with(q, k, v, s, AttnFaults { no_scale: true, ..AttnFaults::default() })
}

/// `argmax_last`: index of the largest element, the last on ties.
///
/// # Panics
/// On an empty slice.
pub fn argmax_last(x: &[f64]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v >= x[best] {
            best = i;
        }
    }
    best
}

/// `embedding_off_by_one`: row ids[i] + 1 instead of ids[i]. The last id wraps to row 0 (modulo the
/// vocabulary) so that the mutant is defined everywhere; an engine making this mistake usually panics
/// or reads past the table there instead, which the caller sees as a case without output.
pub fn embedding_off_by_one(table: &[f64], dim: usize, ids: &[u32]) -> Vec<f64> {
    let vocab = table.len() / dim.max(1);
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &id in ids {
        let row = (id as usize + 1) % vocab.max(1) * dim;
        out.extend_from_slice(&table[row..row + dim]);
    }
    out
}

/// A model-level mutation of the reference forward pass (see
/// [`super::llama::Reference::set_mutations`]). Each applies one kernel mutant wherever the forward
/// pass calls that kernel, except [`Mutation::KvPositionOffByOne`], which only exists at this level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// `rope_adjacent` for q and k.
    RopeAdjacent,
    /// `rope_theta_default` for q and k (no effect on a checkpoint with rope_theta = 10000).
    RopeThetaDefault,
    /// `rmsnorm_eps_outside` in every norm.
    RmsNormEpsOutside,
    /// `rmsnorm_no_weight` in every norm.
    RmsNormNoWeight,
    /// `linear_xw` in every projection, lm_head included.
    LinearXw,
    /// `silu_swapped` in the MLP (equivalently, gate_proj and up_proj outputs swapped).
    SiluSwapped,
    /// `gqa_modulo` in attention (no effect when n_kv_heads = n_heads or 1).
    GqaModulo,
    /// `attention_no_scale` in attention.
    AttentionNoScale,
    /// `embedding_off_by_one` for the token embedding (not the tied output projection).
    EmbeddingOffByOne,
    /// `kv_position_off_by_one`: the K and V of the token at position p are written to cache row
    /// p - 1 (row 0 for p = 0, K still rotated at p), so attention at p reads the next token's K/V in
    /// row p - 1 and an unwritten (zero) row p.
    KvPositionOffByOne,
}

impl Mutation {
    /// Every model-level mutation.
    pub const ALL: [Mutation; 10] = [
        Mutation::RopeAdjacent,
        Mutation::RopeThetaDefault,
        Mutation::RmsNormEpsOutside,
        Mutation::RmsNormNoWeight,
        Mutation::LinearXw,
        Mutation::SiluSwapped,
        Mutation::GqaModulo,
        Mutation::AttentionNoScale,
        Mutation::EmbeddingOffByOne,
        Mutation::KvPositionOffByOne,
    ];

    /// The mutant's name, as in [`MUTANTS`] and the failure contracts.
    pub fn name(self) -> &'static str {
        match self {
            Mutation::RopeAdjacent => "rope_adjacent",
            Mutation::RopeThetaDefault => "rope_theta_default",
            Mutation::RmsNormEpsOutside => "rmsnorm_eps_outside",
            Mutation::RmsNormNoWeight => "rmsnorm_no_weight",
            Mutation::LinearXw => "linear_xw",
            Mutation::SiluSwapped => "silu_swapped",
            Mutation::GqaModulo => "gqa_modulo",
            Mutation::AttentionNoScale => "attention_no_scale",
            Mutation::EmbeddingOffByOne => "embedding_off_by_one",
            Mutation::KvPositionOffByOne => "kv_position_off_by_one",
        }
    }

    /// The model-level mutation of this name, if there is one.
    pub fn from_name(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == name)
    }

    fn bit(self) -> u32 {
        1 << Mutation::ALL.iter().position(|m| *m == self).expect("listed in ALL")
    }
}

/// A set of [`Mutation`]s; empty for the true forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mutations(u32);

impl Mutations {
    /// No mutation: the true forward pass.
    pub const NONE: Mutations = Mutations(0);

    /// The set of the given mutations.
    pub fn of(ms: &[Mutation]) -> Mutations {
        Mutations(ms.iter().fold(0, |b, m| b | m.bit()))
    }

    /// Whether `m` is in the set.
    pub fn has(self, m: Mutation) -> bool {
        self.0 & m.bit() != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-12, "{a:?} != {b:?}");
        }
    }

    #[test]
    fn every_model_mutation_is_a_listed_mutant() {
        for m in Mutation::ALL {
            assert!(mutant_exists(m.name()), "{}", m.name());
            assert_eq!(Mutation::from_name(m.name()), Some(m));
        }
        let set = Mutations::of(&[Mutation::SiluSwapped, Mutation::GqaModulo]);
        assert!(set.has(Mutation::SiluSwapped) && set.has(Mutation::GqaModulo) && !set.has(Mutation::LinearXw));
        assert!(Mutations::NONE.is_empty() && !set.is_empty());
    }

    #[test]
    fn rope_adjacent_pairs_neighbours() {
        // head_dim 4, position 1, theta 1: pair (0,1) at angle 1, pair (2,3) at angle 1^(-1/2) * 1 = 1.
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        rope_adjacent(&mut x, &[1], 1, 4, 1.0);
        let (s, c) = 1f64.sin_cos();
        close(&x, &[c, s, -s, c]);
        // The reference pairs (0,2) and (1,3) instead.
        let mut y = vec![1.0, 0.0, 0.0, 1.0];
        rope(&mut y, &[1], 1, 4, 1.0);
        close(&y, &[c, -s, s, c]);
    }

    #[test]
    fn rope_theta_default_ignores_theta() {
        let x0: Vec<f64> = (0..8).map(|i| i as f64 * 0.1 - 0.3).collect();
        let (mut a, mut b) = (x0.clone(), x0.clone());
        rope_theta_default(&mut a, &[7], 1, 8, 500_000.0);
        rope(&mut b, &[7], 1, 8, 10_000.0);
        close(&a, &b);
        let mut c = x0;
        rope(&mut c, &[7], 1, 8, 500_000.0);
        assert!(a.iter().zip(&c).any(|(p, q)| (p - q).abs() > 1e-3));
    }

    #[test]
    fn rmsnorm_mutants_by_hand() {
        // Row [3, 4]: mean square 12.5.
        let x = [3.0, 4.0];
        let w = [2.0, 0.5];
        let rms = 12.5f64.sqrt();
        close(&rms_norm_eps_outside(&x, &w, 1.0), &[3.0 / (rms + 1.0) * 2.0, 4.0 / (rms + 1.0) * 0.5]);
        close(&rms_norm_no_weight(&x, &w, 1.0), &[3.0 / 13.5f64.sqrt(), 4.0 / 13.5f64.sqrt()]);
    }

    #[test]
    fn linear_xw_reads_k_major() {
        // x [1, 2] = [1, 2]; w buffer [1, 2, 3, 4, 5, 6] with k = 2, n = 3.
        // Reference (w as [n=3, k=2]): [1+4, 3+8, 5+12]; mutant (w as [k=2, n=3]): [1+8, 2+10, 3+12].
        let x = [1.0, 2.0];
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        close(&super::super::linear(&x, &w, 1, 2, 3), &[5.0, 11.0, 17.0]);
        close(&linear_xw(&x, &w, 1, 2, 3), &[9.0, 12.0, 15.0]);
    }

    #[test]
    fn silu_swapped_by_hand() {
        let silu = |v: f64| v / (1.0 + (-v).exp());
        close(&silu_swapped(&[2.0], &[-1.0]), &[silu(-1.0) * 2.0]);
    }

    #[test]
    fn softmax_no_max_overflows_like_f32() {
        let out = softmax_no_max(&[1.0, 2.0, 100.0, 0.0, 0.0, 0.0], 3);
        assert_eq!(out[0], 0.0);
        assert_eq!(out[1], 0.0);
        assert!(out[2].is_nan());
        for v in &out[3..] {
            assert!((v - 1.0 / 3.0).abs() < 1e-7);
        }
        let want = softmax(&[1.0, 2.0, 3.0], 3);
        for (a, b) in softmax_no_max(&[1.0, 2.0, 3.0], 3).iter().zip(&want) {
            assert!((a - b).abs() < 1e-7);
        }
    }

    #[test]
    fn attention_mutants_by_hand() {
        // 2 query heads, 2 KV heads, head_dim 1, kv_len 2, one query at position 1.
        let s = AttnShape { n_q: 1, kv_len: 2, n_heads: 2, n_kv_heads: 2, head_dim: 1 };
        let q = [1.0, 1.0];
        let k = [0.0, 0.0, 2.0, 0.0];
        let v = [1.0, 10.0, 3.0, 20.0];
        let p = |a: f64, b: f64| (a.exp() / (a.exp() + b.exp()), b.exp() / (a.exp() + b.exp()));
        // Head 0 scores [0, 2] (scale 1/sqrt(1) = 1); head 1 scores [0, 0].
        let (a, b) = p(0.0, 2.0);
        let want = [a * 1.0 + b * 3.0, 15.0];
        close(&super::super::attention(&q, &k, &v, s), &want);
        // head_dim 1: the scale is 1, so no_scale changes nothing; group 1: modulo = division.
        close(&attention_no_scale(&q, &k, &v, s), &want);
        close(&gqa_modulo(&q, &k, &v, s), &want);

        // GQA: 4 query heads on 2 KV heads, where the two mappings differ.
        let s = AttnShape { n_q: 1, kv_len: 1, n_heads: 4, n_kv_heads: 2, head_dim: 1 };
        let (q, k, v) = ([1.0; 4], [0.0, 0.0], [1.0, 2.0]);
        close(&super::super::attention(&q, &k, &v, s), &[1.0, 1.0, 2.0, 2.0]);
        close(&gqa_modulo(&q, &k, &v, s), &[1.0, 2.0, 1.0, 2.0]);

        // Scale: head_dim 4, scores q.k = 2 at t = 1, 0 at t = 0; scaled by 1/2 in the reference.
        let s = AttnShape { n_q: 1, kv_len: 2, n_heads: 1, n_kv_heads: 1, head_dim: 4 };
        let q = [1.0, 1.0, 0.0, 0.0];
        let k = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0];
        let v = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let (_, b1) = p(0.0, 1.0);
        let (_, b2) = p(0.0, 2.0);
        close(&super::super::attention(&q, &k, &v, s), &[b1; 4]);
        close(&attention_no_scale(&q, &k, &v, s), &[b2; 4]);

        // Mask: two queries over two positions; the first sees only position 0 unless unmasked.
        let s = AttnShape { n_q: 2, kv_len: 2, n_heads: 1, n_kv_heads: 1, head_dim: 1 };
        let (q, k, v) = ([0.0, 0.0], [0.0, 0.0], [2.0, 4.0]);
        close(&super::super::attention(&q, &k, &v, s), &[2.0, 3.0]);
        close(&attention_no_mask(&q, &k, &v, s), &[3.0, 3.0]);
    }

    #[test]
    fn argmax_and_embedding_mutants_by_hand() {
        assert_eq!(argmax_last(&[1.0, 3.0, 2.0, 3.0, 0.0]), 3);
        assert_eq!(super::super::argmax(&[1.0, 3.0, 2.0, 3.0, 0.0]), 1);
        let table = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5];
        close(&embedding_off_by_one(&table, 2, &[0, 2, 1]), &[1.0, 1.5, 0.0, 0.5, 2.0, 2.5]);
    }

    #[test]
    fn erf_matches_published_values() {
        // Abramowitz & Stegun table 7.1: erf(0.5) = 0.5204998778, erf(1) = 0.8427007929, erf(2) = 0.9953222650.
        for (x, want) in
            [(0.5, 0.520_499_877_8), (1.0, 0.842_700_792_9), (2.0, 0.995_322_265_0), (-1.0, -0.842_700_792_9)]
        {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {}", erf(x));
        }
    }

    #[test]
    fn gelu_erf_and_tanh_differ_by_a_few_1e4() {
        let g: Vec<f64> = (0..=600).map(|i| -3.0 + i as f64 * 0.01).collect();
        let one = vec![1.0; g.len()];
        let a = gelu_erf(&g, &one);
        let b = super::super::gelu_tanh_and_mul(&g, &one);
        let max = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(max > 1e-4 && max < 1e-3, "max difference {max}");
    }

    #[test]
    fn int8_scale_missing_drops_the_scale() {
        // x = [1, 2], q rows [3, 4] and [-1, 0]: sums 11 and -1.
        assert_eq!(int8_scale_missing(&[1.0, 2.0], &[3, 4, -1, 0], 1, 2, 2), vec![11.0, -1.0]);
    }
}
