//! `kernel.attention`: causal grouped-query attention (Vaswani et al. 2017; Ainslie et al. 2023,
//! arXiv:2305.13245) of n_q new queries over a KV cache of kv_len positions. Query i sits at
//! position kv_len - n_q + i and sees positions 0..=that; head h reads KV head h / (n_heads /
//! n_kv_heads); scores scaled by 1/sqrt(head_dim). Mutants `gqa_modulo` (failure.gqa-modulo-mapping),
//! `attention_no_mask` (failure.attention-missing-causal-mask), `attention_no_scale`
//! (failure.attention-wrong-scale).

use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use crate::AttnShape;
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// KV head h % n_kv_heads instead of h / (n_heads / n_kv_heads) (equal when group = 1 or n_kv = 1).
    pub gqa_modulo: bool,
    /// Every query attends to all kv_len positions (equal when n_q = 1).
    pub no_mask: bool,
    /// Scores not scaled by 1/sqrt(head_dim) (equal when head_dim = 1).
    pub no_scale: bool,
    /// The softmax over scores without the row maximum subtracted, in f32 (see
    /// [`super::softmax::Faults::no_max`]): scores above about 88.7 overflow to NaN.
    pub softmax_no_max: bool,
}

/// Attention with `f`'s mistakes. `q`: [n_q, n_heads, head_dim]; `k`, `v`: [kv_len, n_kv_heads,
/// head_dim]; returns [n_q, n_heads, head_dim].
pub fn core(q: &[f64], k: &[f64], v: &[f64], s: AttnShape, f: Faults) -> Vec<f64> {
    let scale = if f.no_scale { 1.0 } else { 1.0 / (s.head_dim as f64).sqrt() };
    core_with(q, k, v, s, f, scale, 0.0)
}

/// [`core`] with the score scale given (`f.no_scale` is the caller's to apply) and, when
/// `softcap` > 0, scores soft-capped as softcap * tanh(score / softcap) before the softmax (Gemma 2's
/// `attn_logit_softcapping`, Gemma Team 2024, arXiv:2408.00118). Same shapes as [`core`].
pub fn core_with(q: &[f64], k: &[f64], v: &[f64], s: AttnShape, f: Faults, scale: f64, softcap: f64) -> Vec<f64> {
    core_with_sinks(q, k, v, s, f, scale, softcap, None)
}

/// [`core_with`] with, when `sinks` [n_heads] is given, head h's learned sink logit appended to
/// every softmax of that head and its probability dropped after (kernel.attention_sinks: the real
/// positions' weights then sum to less than 1).
#[allow(clippy::too_many_arguments)]
pub fn core_with_sinks(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    s: AttnShape,
    f: Faults,
    scale: f64,
    softcap: f64,
    sinks: Option<&[f64]>,
) -> Vec<f64> {
    let AttnShape { n_q, kv_len, n_heads, n_kv_heads, head_dim } = s;
    let group = n_heads / n_kv_heads;
    let mut out = vec![0.0; n_q * n_heads * head_dim];
    for i in 0..n_q {
        let last = if f.no_mask { kv_len - 1 } else { kv_len - n_q + i };
        for h in 0..n_heads {
            let kvh = if f.gqa_modulo { h % n_kv_heads } else { h / group };
            let qv = &q[(i * n_heads + h) * head_dim..][..head_dim];
            let mut scores: Vec<f64> = (0..=last)
                .map(|t| {
                    let kv = &k[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                    let score = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * scale;
                    if softcap > 0.0 { softcap * (score / softcap).tanh() } else { score }
                })
                .collect();
            scores.extend(sinks.map(|s| s[h]));
            let p = super::softmax::core(&scores, scores.len(), super::softmax::Faults { no_max: f.softmax_no_max });
            let o = &mut out[(i * n_heads + h) * head_dim..][..head_dim];
            for (t, pt) in p[..=last].iter().enumerate() {
                let vv = &v[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                for (oj, vj) in o.iter_mut().zip(vv) {
                    *oj += pt * vj;
                }
            }
        }
    }
    out
}

/// The shape of a case.
pub fn shape(c: &Case) -> Option<AttnShape> {
    let s = AttnShape {
        n_q: c.n("n_q")?,
        kv_len: c.n("kv_len")?,
        n_heads: c.n("n_heads")?,
        n_kv_heads: c.n("n_kv_heads")?,
        head_dim: c.n("head_dim")?,
    };
    (s.n_kv_heads > 0 && s.n_heads.is_multiple_of(s.n_kv_heads) && s.n_q <= s.kv_len && s.n_q > 0).then_some(s)
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, shape(c)?, f)))
}

/// Draw a case (also kernel.attention_sinks', which adds its sinks to it).
pub(super) fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let kv_len = dim(rng, case, "kv_len")?;
    let n_q = dim(rng, case, "n_q")?.min(kv_len);
    let (nkv, group, hd) = (dim(rng, case, "n_kv_heads")?, dim(rng, case, "group")?, dim(rng, case, "head_dim")?);
    let nh = nkv * group;
    let q = uniform(rng, n_q * nh * hd, case.scale);
    let k = uniform(rng, kv_len * nkv * hd, case.scale);
    let v = uniform(rng, kv_len * nkv * hd, 1.0);
    let mut c = Case::new(KERNEL.id);
    c.label = format!("n_q={n_q} kv_len={kv_len} n_heads={nh} n_kv_heads={nkv} head_dim={hd}");
    for (key, val) in [("n_q", n_q), ("kv_len", kv_len), ("n_heads", nh), ("n_kv_heads", nkv), ("head_dim", hd)] {
        c.param(key, val);
    }
    c.input("q", Tensor::F32(q));
    c.input("k_cache", Tensor::F32(k));
    c.input("v_cache", Tensor::F32(v));
    Ok(c)
}

/// One query token: K and V rows read (f32), q read and out written; scores and weighted sum take
/// 4 n_heads kv_len head_dim FLOPs.
fn cost(dims: &Dims) -> Cost {
    let (kv_len, nh, nkv, hd) = (d(dims, "kv_len"), d(dims, "n_heads"), d(dims, "n_kv_heads"), d(dims, "head_dim"));
    Cost { bytes: 8.0 * kv_len * nkv * hd + 8.0 * nh * hd, flops: 4.0 * nh * kv_len * hd }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.attention",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::attention(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, shape(c)?))),
    mutants: &[
        Mutant { name: "gqa_modulo", expect: |c| eval(c, Faults { gqa_modulo: true, ..Faults::default() }) },
        Mutant { name: "attention_no_mask", expect: |c| eval(c, Faults { no_mask: true, ..Faults::default() }) },
        Mutant { name: "attention_no_scale", expect: |c| eval(c, Faults { no_scale: true, ..Faults::default() }) },
        Mutant { name: "softmax_no_max", expect: |c| eval(c, Faults { softmax_no_max: true, ..Faults::default() }) },
    ],
    cost,
    test_arm: r#"{
            let q = i.f("q");
            let mut out = nan(q.len());
            engine::kernels::attention(
                &q,
                &i.f("k_cache"),
                &i.f("v_cache"),
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
            let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..copies)
                .map(|c| (fill(kv_len * kvh * hd, 200 + c as u64), fill(kv_len * kvh * hd, 300 + c as u64)))
                .collect();
            let mut out = vec![0.0f32; heads * hd];
            Timed {
                run: Box::new(move |i| {
                    let (k, v) = &caches[i % caches.len()];
                    engine::kernels::attention(&q, k, v, 1, kv_len, heads, kvh, hd, &mut out)
                }),
            }
        }"#,
    cuda_test_arm: r#"{
            let q = i.f("q");
            let (qd, k, v) = (device::up(&q), device::up(&i.f("k_cache")), device::up(&i.f("v_cache")));
            let mut out = device::nan(q.len());
            device::ok(engine::kernels::attention(
                device::dev(),
                &qd.as_view(),
                &k.as_view(),
                &v.as_view(),
                i.n("n_q"),
                i.n("kv_len"),
                i.n("n_heads"),
                i.n("n_kv_heads"),
                i.n("head_dim"),
                &mut out.as_view_mut(),
            ));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (kv_len, heads, kvh, hd) = (n("kv_len"), n("n_heads"), n("n_kv_heads"), n("head_dim"));
            let q = device::up(&fill(heads * hd, 9));
            let caches: Vec<_> = (0..copies)
                .map(|c| (device::up(&fill(kv_len * kvh * hd, 200 + c as u64)), device::up(&fill(kv_len * kvh * hd, 300 + c as u64))))
                .collect();
            let mut out = device::nan(heads * hd);
            Timed {
                run: Box::new(move |i| {
                    let (k, v) = &caches[i % caches.len()];
                    device::ok(engine::kernels::attention(device::dev(), &q.as_view(), &k.as_view(), &v.as_view(), 1, kv_len, heads, kvh, hd, &mut out.as_view_mut()))
                }),
            }
        }"#,
};

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
    fn mutants_by_hand() {
        let none = Faults::default();
        let modulo = Faults { gqa_modulo: true, ..none };
        let no_mask = Faults { no_mask: true, ..none };
        let no_scale = Faults { no_scale: true, ..none };
        let p = |a: f64, b: f64| (a.exp() / (a.exp() + b.exp()), b.exp() / (a.exp() + b.exp()));
        // 2 query heads, 2 KV heads, head_dim 1, kv_len 2, one query at position 1.
        let s = AttnShape { n_q: 1, kv_len: 2, n_heads: 2, n_kv_heads: 2, head_dim: 1 };
        let (q, k, v) = ([1.0, 1.0], [0.0, 0.0, 2.0, 0.0], [1.0, 10.0, 3.0, 20.0]);
        // Head 0 scores [0, 2] (scale 1/sqrt(1) = 1); head 1 scores [0, 0].
        let (a, b) = p(0.0, 2.0);
        let want = [a * 1.0 + b * 3.0, 15.0];
        close(&core(&q, &k, &v, s, none), &want);
        // head_dim 1: the scale is 1, so no_scale changes nothing; group 1: modulo = division.
        close(&core(&q, &k, &v, s, no_scale), &want);
        close(&core(&q, &k, &v, s, modulo), &want);

        // GQA: 4 query heads on 2 KV heads, where the two mappings differ.
        let s = AttnShape { n_q: 1, kv_len: 1, n_heads: 4, n_kv_heads: 2, head_dim: 1 };
        let (q, k, v) = ([1.0; 4], [0.0, 0.0], [1.0, 2.0]);
        close(&core(&q, &k, &v, s, none), &[1.0, 1.0, 2.0, 2.0]);
        close(&core(&q, &k, &v, s, modulo), &[1.0, 2.0, 1.0, 2.0]);

        // Scale: head_dim 4, scores q.k = 2 at t = 1, 0 at t = 0; scaled by 1/2 in the truth.
        let s = AttnShape { n_q: 1, kv_len: 2, n_heads: 1, n_kv_heads: 1, head_dim: 4 };
        let q = [1.0, 1.0, 0.0, 0.0];
        let k = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0];
        let v = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let ((_, b1), (_, b2)) = (p(0.0, 1.0), p(0.0, 2.0));
        close(&core(&q, &k, &v, s, none), &[b1; 4]);
        close(&core(&q, &k, &v, s, no_scale), &[b2; 4]);

        // Mask: two queries over two positions; the first sees only position 0 unless unmasked.
        let s = AttnShape { n_q: 2, kv_len: 2, n_heads: 1, n_kv_heads: 1, head_dim: 1 };
        let (q, k, v) = ([0.0, 0.0], [0.0, 0.0], [2.0, 4.0]);
        close(&core(&q, &k, &v, s, none), &[2.0, 3.0]);
        close(&core(&q, &k, &v, s, no_mask), &[3.0, 3.0]);
    }
}
