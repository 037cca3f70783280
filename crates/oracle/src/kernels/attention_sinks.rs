//! `kernel.attention_sinks`: causal grouped-query attention whose softmax has one more logit per
//! query head, a learned "sink" with no value (gpt-oss, OpenAI 2025 model card; the sink idea:
//! Xiao et al. 2023, arXiv:2309.17453): the real positions' weights sum to
//! `1 - exp(sink) / (sum_t exp(s_t) + exp(sink))`. Shapes, mask and GQA mapping as
//! `kernel.attention`. Mutant `sinks_dropped` (failure.attention-sinks-dropped: the plain softmax).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::attention::{self, shape};
use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d};
use crate::AttnShape;
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The sinks left out of the softmax (kernel.attention's result).
    pub dropped: bool,
    /// kernel.attention's faults (GQA mapping, scale), as that kernel's core has them.
    pub attention: attention::Faults,
}

/// Attention with sinks and `f`'s mistakes. `q` [n_q, n_heads, head_dim]; `k`, `v` [kv_len,
/// n_kv_heads, head_dim]; `sinks` [n_heads]; `scale` multiplies q.k (1/sqrt(head_dim) in the
/// kernel; the caller applies `f.attention.no_scale`); returns [n_q, n_heads, head_dim].
pub fn core(q: &[f64], k: &[f64], v: &[f64], sinks: &[f64], s: AttnShape, scale: f64, f: Faults) -> Vec<f64> {
    let sinks = if f.dropped { None } else { Some(sinks) };
    attention::core_with_sinks(q, k, v, s, f.attention, scale, 0.0, sinks)
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let s = shape(c)?;
    let sinks = c.f("sinks")?;
    if sinks.len() != s.n_heads {
        return None;
    }
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    Some(Expect::Values(core(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, &sinks, s, scale, f)))
}

/// kernel.attention's cases, plus one sink per query head drawn around the scores' range
/// (uniform in [-2, 2) plus ln(kv_len)), so that the sink takes a share between a few percent and
/// most of the weight.
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let mut c = attention::draw(case, rng)?;
    c.kernel = KERNEL.id;
    let (nh, kv_len) = (c.n("n_heads").unwrap_or(1), c.n("kv_len").unwrap_or(1));
    let sinks: Vec<f32> = (0..nh).map(|_| rng.random_range(-2.0f32..2.0) + (kv_len as f32).ln()).collect();
    c.input("sinks", Tensor::F32(sinks));
    Ok(c)
}

/// As kernel.attention's (the sinks, n_heads values, add nothing measurable).
fn cost(dims: &Dims) -> Cost {
    let (kv_len, nh, nkv, hd) = (d(dims, "kv_len"), d(dims, "n_heads"), d(dims, "n_kv_heads"), d(dims, "head_dim"));
    Cost { bytes: 8.0 * kv_len * nkv * hd + 8.0 * nh * hd + 4.0 * nh, flops: 4.0 * nh * kv_len * hd }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.attention_sinks",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let (s, sinks) = (shape(c)?, c.f("sinks")?);
        (sinks.len() == s.n_heads).then_some(())?;
        Some(Expect::Values(crate::attention_sinks(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, &sinks, s)))
    },
    mutants: &[Mutant { name: "sinks_dropped", expect: |c| eval(c, Faults { dropped: true, ..Faults::default() }) }],
    cost,
    test_arm: r#"{
            let q = i.f("q");
            let mut out = nan(q.len());
            engine::kernels::attention_sinks(
                &q,
                &i.f("k_cache"),
                &i.f("v_cache"),
                &i.f("sinks"),
                i.n("n_q"),
                i.n("kv_len"),
                i.n("n_heads"),
                i.n("n_kv_heads"),
                i.n("head_dim"),
                &mut out,
            );
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (kv_len, heads, kvh, hd) = (n("kv_len"), n("n_heads"), n("n_kv_heads"), n("head_dim"));
            let q = fill(heads * hd, 9);
            let sinks = fill(heads, 8);
            let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..copies)
                .map(|c| (fill(kv_len * kvh * hd, 200 + c as u64), fill(kv_len * kvh * hd, 300 + c as u64)))
                .collect();
            let mut out = vec![0.0f32; heads * hd];
            Timed {
                run: Box::new(move |i| {
                    let (k, v) = &caches[i % caches.len()];
                    engine::kernels::attention_sinks(&q, k, v, &sinks, 1, kv_len, heads, kvh, hd, &mut out)
                }),
            }
        }"#,
    cuda_test_arm: "",
    cuda_timed_arm: "",
};

#[cfg(test)]
mod tests {
    use super::*;

    /// One query, two positions, head_dim 1 (scale 1): scores [0, ln 2], sink ln 3. The softmax over
    /// [0, ln 2, ln 3] is [1/6, 2/6, 3/6]; the output is v0/6 + 2 v1/6; without the sink, v0/3 + 2 v1/3.
    #[test]
    fn hand_worked_sink_share() {
        let s = AttnShape { n_q: 1, kv_len: 2, n_heads: 1, n_kv_heads: 1, head_dim: 1 };
        let (q, k, v) = ([1.0], [0.0, 2f64.ln()], [6.0, 12.0]);
        let sinks = [3f64.ln()];
        let got = core(&q, &k, &v, &sinks, s, 1.0, Faults::default());
        assert!((got[0] - (1.0 + 4.0)).abs() < 1e-12, "{got:?}");
        let dropped = core(&q, &k, &v, &sinks, s, 1.0, Faults { dropped: true, ..Faults::default() });
        assert!((dropped[0] - (2.0 + 8.0)).abs() < 1e-12, "{dropped:?}");
    }
}
