//! `kernel.sample`: one token drawn from logits with temperature, top-k, top-p, min-p and
//! repetition / frequency / presence penalties, given the previous tokens and a uniform number u
//! that the gate supplies, so the oracle's token is exact and sampling is tested exactly, not
//! statistically. Mutants: `penalty_after_temperature` (failure.sampling-penalty-after-temperature),
//! `top_p_drops_boundary` (failure.top-p-boundary-dropped), `min_p_absolute`
//! (failure.min-p-absolute-threshold), `repetition_penalty_sign` (failure.repetition-penalty-sign),
//! `sampling_no_renormalization` (failure.sampling-no-renormalization).
//!
//! The drawn cases keep every decision away from its boundary: a case is used only when the
//! oracle's token stays the same under small perturbations of u, top_p, min_p, the temperature and
//! the logits (equal logits perturbed equally, so planted ties stay ties). An f32 engine that follows
//! the contract's order of operations then returns exactly the oracle's token.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim};
use crate::SamplingParams;
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Penalties applied to the logits after dividing by the temperature (the additive ones are
    /// then scaled by 1/T too).
    pub penalty_after_temperature: bool,
    /// Top-p keeps only the tokens whose mass stays below top_p, dropping the crossing token.
    pub top_p_drops_boundary: bool,
    /// Min-p compares probabilities with min_p itself instead of min_p times the top probability.
    pub min_p_absolute: bool,
    /// The repetition penalty divides every previous token's logit by r, negative ones too (which
    /// makes them more likely).
    pub repetition_sign: bool,
    /// The inverse CDF walks the kept probabilities without dividing by their sum.
    pub no_renormalization: bool,
}

fn penalise(l: &mut [f64], count: &[usize], p: &SamplingParams, f: Faults) {
    for (i, v) in l.iter_mut().enumerate() {
        if count[i] > 0 {
            *v = if *v > 0.0 || f.repetition_sign { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
            *v -= count[i] as f64 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// kernel.sample with `f`'s mistakes; see [`crate::sample`] for the order of operations.
/// `logits`: [n], n >= 1; `u` in [0, 1). Returns the token id.
///
/// # Panics
/// On empty logits.
pub fn core(logits: &[f64], prev: &[u32], p: &SamplingParams, u: f64, f: Faults) -> usize {
    let n = logits.len();
    let mut count = vec![0usize; n];
    for &t in prev {
        if let Some(c) = count.get_mut(t as usize) {
            *c += 1;
        }
    }
    let mut l = logits.to_vec();
    if !f.penalty_after_temperature {
        penalise(&mut l, &count, p, f);
    }
    if p.temperature == 0.0 {
        return super::argmax::core(&l, super::argmax::Faults::default());
    }
    let mut z: Vec<f64> = l.iter().map(|v| v / p.temperature).collect();
    if f.penalty_after_temperature {
        penalise(&mut z, &count, p, f);
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
    if p.top_k > 0 && p.top_k < n {
        order.truncate(p.top_k);
    }
    let top = z[order[0]];
    let e: Vec<f64> = order.iter().map(|&i| (z[i] - top).exp()).collect();
    let total: f64 = e.iter().sum();
    let probs: Vec<f64> = e.iter().map(|x| x / total).collect();
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut mass = 0.0;
        for (j, q) in probs.iter().enumerate() {
            mass += q;
            if mass >= p.top_p {
                keep = if f.top_p_drops_boundary { j.max(1) } else { j + 1 };
                break;
            }
        }
    }
    let floor = if f.min_p_absolute { p.min_p } else { p.min_p * probs[0] };
    let kept: Vec<(usize, f64)> = order
        .iter()
        .zip(&probs)
        .take(keep)
        .filter(|(_, q)| p.min_p <= 0.0 || **q >= floor)
        .map(|(&i, &q)| (i, q))
        .collect();
    // Min-p with an absolute floor can drop every token; the top one is then kept.
    let kept = if kept.is_empty() { vec![(order[0], probs[0])] } else { kept };
    let mass: f64 = if f.no_renormalization { 1.0 } else { kept.iter().map(|(_, q)| q).sum() };
    let mut cdf = 0.0;
    for &(i, q) in &kept {
        cdf += q / mass;
        if u < cdf {
            return i;
        }
    }
    kept.last().expect("at least one token is kept").0
}

/// The parameters of a case, as the engine receives them (f32 text, widened).
pub fn params(c: &Case) -> Option<SamplingParams> {
    Some(SamplingParams {
        temperature: c.x("temperature")?,
        top_k: c.n("top_k")?,
        top_p: c.x("top_p")?,
        min_p: c.x("min_p")?,
        repetition_penalty: c.x("repetition_penalty")?,
        frequency_penalty: c.x("frequency_penalty")?,
        presence_penalty: c.x("presence_penalty")?,
    })
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let logits = c.f("logits").filter(|l| !l.is_empty())?;
    Some(Expect::Index(core(&logits, c.u("prev")?, &params(c)?, c.x("u")?, f)))
}

/// A value in thousandths drawn from the test case's range `name`, or `default` when it has none.
fn milli(rng: &mut ChaCha8Rng, case: &TestCase, name: &str, default: f32) -> f32 {
    match case.dims.get(name) {
        Some(&[lo, hi]) => rng.random_range(lo..=hi) as f32 / 1000.0,
        None => default,
    }
}

/// The smallest u at which the oracle returns its lowest-ranked kept token (the inverse CDF is
/// monotone in u: later tokens in rank order for larger u), by bisection to 2^-40.
fn last_kept_from(logits: &[f64], prev: &[u32], p: &SamplingParams) -> f64 {
    let at = |u: f64| core(logits, prev, p, u, Faults::default());
    let last = at(1.0 - 1e-12);
    let (mut lo, mut hi) = (0.0, 1.0 - 1e-12);
    if at(lo) == last {
        return 0.0;
    }
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if at(mid) == last {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// A deterministic sign from the bits of a value: equal values are perturbed equally.
fn sign_of(v: f64, salt: u64) -> f64 {
    let h = base::util::fnv1a(&format!("{}:{salt}", v.to_bits()));
    if h & 1 == 0 { 1.0 } else { -1.0 }
}

/// Relative size of the perturbations a drawn case must withstand (see the contract's tolerance).
pub const MARGIN: f64 = 1e-4;

/// Whether the oracle's token on these inputs survives perturbations of every decision's input:
/// u and top_p by +-MARGIN, min_p and the temperature by a factor 1 +- MARGIN, and every logit by
/// MARGIN / 10 of its size (at least 1) with a sign fixed by its value.
pub fn robust(logits: &[f64], prev: &[u32], p: &SamplingParams, u: f64) -> bool {
    let want = core(logits, prev, p, u, Faults::default());
    let same = |l: &[f64], q: &SamplingParams, u: f64| core(l, prev, q, u, Faults::default()) == want;
    let up = |x: f64| x * (1.0 + MARGIN);
    let down = |x: f64| x * (1.0 - MARGIN);
    let mut ok = same(logits, p, (u + MARGIN).min(1.0 - f64::EPSILON)) && same(logits, p, (u - MARGIN).max(0.0));
    if p.top_p < 1.0 {
        ok &= same(logits, &SamplingParams { top_p: p.top_p + MARGIN, ..*p }, u);
        ok &= same(logits, &SamplingParams { top_p: p.top_p - MARGIN, ..*p }, u);
    }
    if p.min_p > 0.0 {
        ok &= same(logits, &SamplingParams { min_p: up(p.min_p), ..*p }, u);
        ok &= same(logits, &SamplingParams { min_p: down(p.min_p), ..*p }, u);
    }
    if p.temperature > 0.0 {
        ok &= same(logits, &SamplingParams { temperature: up(p.temperature), ..*p }, u);
        ok &= same(logits, &SamplingParams { temperature: down(p.temperature), ..*p }, u);
    }
    for salt in 0..2 {
        let l: Vec<f64> = logits.iter().map(|&v| v + MARGIN / 10.0 * v.abs().max(1.0) * sign_of(v, salt)).collect();
        ok &= same(&l, p, u);
    }
    ok
}

/// Logits uniform in [-scale, scale) with `ties` values copied onto other ids (one of them the
/// maximum), previous tokens from a small set of ids (so some repeat), parameters from the test
/// case's ranges in thousandths (`temperature_milli`, or temperature 0 with `greedy`, `top_p_milli`, `min_p_milli`,
/// `repetition_milli`, `frequency_milli`, `presence_milli`) and `top_k`, and u uniform in [0, 1)
/// (with top-p or min-p on, within the lowest-ranked kept token's share: always with a `tail` dim,
/// else half the time); u and the
/// parameters are redrawn until the case is [`robust`].
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let n = dim(rng, case, "n")?.max(1);
    let n_prev = if case.dims.contains_key("prev") { dim(rng, case, "prev")? } else { 0 };
    let ties = if case.dims.contains_key("ties") { dim(rng, case, "ties")? } else { 0 };
    let top_k = if case.dims.contains_key("top_k") { dim(rng, case, "top_k")? } else { 0 };
    let mut logits = Vec::new();
    let mut prev = Vec::new();
    let mut chosen = None;
    for attempt in 0..4000 {
        if attempt % 200 == 0 {
            logits = super::uniform(rng, n, case.scale);
            if n >= 2 {
                for t in 0..ties {
                    let a = if t == 0 {
                        (0..n).max_by(|&i, &j| logits[i].total_cmp(&logits[j]).then(j.cmp(&i))).unwrap_or(0)
                    } else {
                        rng.random_range(0..n)
                    };
                    let b = rng.random_range(0..n);
                    logits[b] = logits[a];
                }
            }
            // Previous tokens from a few distinct ids, several of them repeated.
            let pool: Vec<u32> = (0..n_prev.min(n).max(1)).map(|_| rng.random_range(0..n) as u32).collect();
            prev = (0..n_prev).map(|_| pool[rng.random_range(0..pool.len())]).collect();
        }
        let p = SamplingParams {
            temperature: if case.dims.contains_key("greedy") {
                0.0
            } else {
                milli(rng, case, "temperature_milli", 1.0) as f64
            },
            top_k,
            top_p: milli(rng, case, "top_p_milli", 1.0) as f64,
            min_p: milli(rng, case, "min_p_milli", 0.0) as f64,
            repetition_penalty: milli(rng, case, "repetition_milli", 1.0) as f64,
            frequency_penalty: milli(rng, case, "frequency_milli", 0.0) as f64,
            presence_penalty: milli(rng, case, "presence_milli", 0.0) as f64,
        };
        let wide = super::super::widen(&logits);
        let mut u = rng.random_range(0.0f32..1.0);
        // With a filter on, u lies on the lowest-ranked kept token (always with the test case's
        // `tail` dim, else half the time): that is where a dropped boundary token changes the draw.
        let filtered = p.temperature > 0.0 && (p.top_p < 1.0 || p.min_p > 0.0);
        if filtered && (case.dims.contains_key("tail") || rng.random_bool(0.5)) {
            let lo = last_kept_from(&wide, &prev, &p);
            u = (lo + (1.0 - lo) * rng.random_range(0.1..0.9)) as f32;
        }
        if robust(&wide, &prev, &p, u as f64) {
            chosen = Some((p, u));
            break;
        }
    }
    let (p, u) = chosen.ok_or_else(|| {
        base::error::Error::input(format!(
            "test case `{}`: no case with every sampling decision at least {MARGIN} from its boundary in 4000 draws; widen its ranges",
            case.name
        ))
    })?;
    let mut c = Case::new(KERNEL.id);
    c.label = format!(
        "n={n} prev={n_prev} T={} top_k={} top_p={} min_p={} rep={} freq={} pres={} u={u}",
        p.temperature as f32,
        p.top_k,
        p.top_p as f32,
        p.min_p as f32,
        p.repetition_penalty as f32,
        p.frequency_penalty as f32,
        p.presence_penalty as f32
    );
    c.input("logits", Tensor::F32(logits));
    c.input("prev", Tensor::U32(prev));
    c.param("temperature", p.temperature as f32);
    c.param("top_k", p.top_k);
    c.param("top_p", p.top_p as f32);
    c.param("min_p", p.min_p as f32);
    c.param("repetition_penalty", p.repetition_penalty as f32);
    c.param("frequency_penalty", p.frequency_penalty as f32);
    c.param("presence_penalty", p.presence_penalty as f32);
    c.param("u", u);
    Ok(c)
}

/// The logits read once and a few passes over them (penalties, scaling, ranking, softmax): about
/// 8 bytes and 10 operations per vocabulary entry, plus n log2 n comparisons for a full sort.
fn cost(dims: &Dims) -> Cost {
    let n = d(dims, "n").max(1.0);
    Cost { bytes: 8.0 * n, flops: 10.0 * n + n * n.log2() }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.sample",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let logits = c.f("logits").filter(|l| !l.is_empty())?;
        Some(Expect::Index(crate::sample(&logits, c.u("prev")?, &params(c)?, c.x("u")?)))
    },
    mutants: &[
        Mutant {
            name: "penalty_after_temperature",
            expect: |c| eval(c, Faults { penalty_after_temperature: true, ..Faults::default() }),
        },
        Mutant {
            name: "top_p_drops_boundary",
            expect: |c| eval(c, Faults { top_p_drops_boundary: true, ..Faults::default() }),
        },
        Mutant { name: "min_p_absolute", expect: |c| eval(c, Faults { min_p_absolute: true, ..Faults::default() }) },
        Mutant {
            name: "repetition_penalty_sign",
            expect: |c| eval(c, Faults { repetition_sign: true, ..Faults::default() }),
        },
        Mutant {
            name: "sampling_no_renormalization",
            expect: |c| eval(c, Faults { no_renormalization: true, ..Faults::default() }),
        },
    ],
    cost,
    test_arm: r#"{
            let params = engine::kernels::SamplingParams {
                temperature: i.x("temperature"),
                top_k: i.n("top_k"),
                top_p: i.x("top_p"),
                min_p: i.x("min_p"),
                repetition_penalty: i.x("repetition_penalty"),
                frequency_penalty: i.x("frequency_penalty"),
                presence_penalty: i.x("presence_penalty"),
            };
            let token = engine::kernels::sample(&i.f("logits"), &i.u("prev"), &params, i.x("u"));
            vec![("out".into(), Out::U(vec![token]))]
        }"#,
    timed_arm: r#"{
            let len = n("n");
            let logits: Vec<Vec<f32>> = (0..copies).map(|c| fill(len, 40 + c as u64)).collect();
            let prev: Vec<u32> = (0..64u32).map(|t| (t * 31) % len.max(1) as u32).collect();
            let params = engine::kernels::SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                repetition_penalty: 1.1,
                frequency_penalty: 0.2,
                presence_penalty: 0.2,
            };
            Timed {
                run: Box::new(move |i| {
                    let u = (i % 97) as f32 / 97.0;
                    std::hint::black_box(engine::kernels::sample(&logits[i % logits.len()], &prev, &params, u));
                }),
            }
        }"#,
    // kernel.sample runs on the host in a CUDA engine too (its [cuda] section): the same arms.
    cuda_test_arm: r#"{
            let params = engine::kernels::SamplingParams {
                temperature: i.x("temperature"),
                top_k: i.n("top_k"),
                top_p: i.x("top_p"),
                min_p: i.x("min_p"),
                repetition_penalty: i.x("repetition_penalty"),
                frequency_penalty: i.x("frequency_penalty"),
                presence_penalty: i.x("presence_penalty"),
            };
            let token = engine::kernels::sample(&i.f("logits"), &i.u("prev"), &params, i.x("u"));
            vec![("out".into(), Out::U(vec![token]))]
        }"#,
    cuda_timed_arm: r#"{
            let len = n("n");
            let logits: Vec<Vec<f32>> = (0..copies).map(|c| fill(len, 40 + c as u64)).collect();
            let prev: Vec<u32> = (0..64u32).map(|t| (t * 31) % len.max(1) as u32).collect();
            let params = engine::kernels::SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                repetition_penalty: 1.1,
                frequency_penalty: 0.2,
                presence_penalty: 0.2,
            };
            Timed {
                run: Box::new(move |i| {
                    let u = (i % 97) as f32 / 97.0;
                    std::hint::black_box(engine::kernels::sample(&logits[i % logits.len()], &prev, &params, u));
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn greedy_penalties_and_ties() {
        // Temperature 0: argmax, first on ties.
        let l = [1.0, 3.0, 3.0, 0.5];
        assert_eq!(core(&l, &[], &SamplingParams { temperature: 0.0, ..p() }, 0.9, Faults::default()), 1);
        // Repetition penalty 2 on token 1: 3 / 2 = 1.5 < 3, so token 2 wins.
        let rep = SamplingParams { temperature: 0.0, repetition_penalty: 2.0, ..p() };
        assert_eq!(core(&l, &[1], &rep, 0.0, Faults::default()), 2);
        // A negative logit is multiplied by r (less likely); the sign mutant divides it (more likely).
        let l = [-1.0, -0.6];
        let rep = SamplingParams { temperature: 0.0, repetition_penalty: 2.0, ..p() };
        assert_eq!(core(&l, &[0], &rep, 0.0, Faults::default()), 1);
        assert_eq!(core(&l, &[0], &rep, 0.0, Faults { repetition_sign: true, ..Faults::default() }), 0);
        // Frequency 0.3 per occurrence plus presence 0.5: token 0 occurs twice, 2 - 0.6 - 0.5 = 0.9 < 1.
        let l = [2.0, 1.0];
        let pen = SamplingParams { temperature: 0.0, frequency_penalty: 0.3, presence_penalty: 0.5, ..p() };
        assert_eq!(core(&l, &[0, 0], &pen, 0.0, Faults::default()), 1);
    }

    #[test]
    fn inverse_cdf_in_rank_order_with_each_filter() {
        // z = [0, ln 3, ln 2, ln 4] -> probabilities [0.1, 0.3, 0.2, 0.4]; rank order 3, 1, 2, 0.
        let l = [0.0, 3f64.ln(), 2f64.ln(), 4f64.ln()];
        let at = |q: SamplingParams, u: f64, f: Faults| core(&l, &[], &q, u, f);
        let none = Faults::default();
        // Cumulative in rank order: 0.4, 0.7, 0.9, 1.0.
        assert_eq!([0.0, 0.39, 0.41, 0.69, 0.71, 0.95].map(|u| at(p(), u, none)), [3, 3, 1, 1, 2, 0]);
        // Top-k 2 keeps 3 and 1: renormalised 4/7 and 3/7.
        assert_eq!(at(SamplingParams { top_k: 2, ..p() }, 0.58, none), 1);
        assert_eq!(at(SamplingParams { top_k: 2, ..p() }, 0.56, none), 3);
        // Top-p 0.6: 0.4 < 0.6 <= 0.7, so 3 and 1 are kept (the crossing token 1 included).
        assert_eq!(at(SamplingParams { top_p: 0.6, ..p() }, 0.9, none), 1);
        // Dropping the crossing token leaves only 3.
        assert_eq!(at(SamplingParams { top_p: 0.6, ..p() }, 0.9, Faults { top_p_drops_boundary: true, ..none }), 3);
        // Min-p 0.6: floor 0.6 * 0.4 = 0.24 keeps 3 (0.4) and 1 (0.3); an absolute floor 0.6 keeps none
        // of them, so only the top token remains.
        assert_eq!(at(SamplingParams { min_p: 0.6, ..p() }, 0.9, none), 1);
        assert_eq!(at(SamplingParams { min_p: 0.6, ..p() }, 0.9, Faults { min_p_absolute: true, ..none }), 3);
        // Top-p 0.6 keeps 3 and 1 (mass 0.7): renormalised, u = 0.5 < 0.4 / 0.7 picks 3; without
        // renormalisation the CDF reads 0.4, 0.7 and u = 0.5 falls on 1.
        assert_eq!(at(SamplingParams { top_p: 0.6, ..p() }, 0.5, none), 3);
        assert_eq!(at(SamplingParams { top_p: 0.6, ..p() }, 0.5, Faults { no_renormalization: true, ..none }), 1);
        // Temperature 2 halves z; an additive penalty after it is not halved.
        let t = SamplingParams { temperature: 2.0, presence_penalty: 1.0, ..p() };
        let l = [1.0, 0.6];
        // Truth: z = [(1 - 1) / 2, 0.3] = [0, 0.3]: token 1 ranks first. With presence 0.3 the truth
        // is z0 = 0.35 > 0.3 (token 0), the mutant 0.5 - 0.3 = 0.2 < 0.3 (token 1).
        assert_eq!(core(&l, &[0], &t, 0.0, none), 1);
        let t = SamplingParams { presence_penalty: 0.3, ..t };
        assert_eq!(core(&l, &[0], &t, 0.0, none), 0);
        assert_eq!(core(&l, &[0], &t, 0.0, Faults { penalty_after_temperature: true, ..none }), 1);
    }

    #[test]
    fn fragile_cases_are_recognised() {
        let l = [0.0, 3f64.ln(), 2f64.ln(), 4f64.ln()];
        // u right at a CDF step (0.4) is fragile; in the middle of a step it is not.
        assert!(!robust(&l, &[], &p(), 0.4));
        assert!(robust(&l, &[], &p(), 0.55));
        // u from 0.7 on picks the lowest-ranked token (rank order 3, 1, 2, 0; CDF 0.4, 0.7, 0.9, 1.0
        // with top-k 3 renormalised: 4/9, 7/9, 1).
        assert!((last_kept_from(&l, &[], &SamplingParams { top_k: 3, ..p() }) - 7.0 / 9.0).abs() < 1e-9);
        // Planted exact ties are not fragile: the tie rule decides them.
        assert!(robust(&[2.0, 2.0, 1.0], &[], &SamplingParams { temperature: 0.0, ..p() }, 0.3));
    }
}
