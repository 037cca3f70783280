//! `kernel.moe_route`: a mixture-of-experts router's weights for one token from its router logits:
//! softmax over all experts, the top-k kept (equal scores: the lower expert index first), optionally
//! renormalised over the kept ones; a dense [n_experts] vector, 0 for the experts not kept (Mixtral,
//! Jiang et al. 2024, arXiv:2401.04088; transformers `Qwen3MoeSparseMoeBlock`, `norm_topk_prob`).
//! Mutants: `moe_no_renorm` (failure.moe-renormalisation-missing), `moe_softmax_over_topk`
//! (failure.moe-softmax-over-topk), `moe_ties_last` (failure.moe-topk-ties),
//! `moe_expert_off_by_one` (failure.moe-expert-index-off-by-one).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The kept weights are not divided by their sum where the family renormalises them.
    pub no_renorm: bool,
    /// The softmax taken over the top-k logits only (top-k first, then softmax): equal to the
    /// renormalised weights, wrong where the family does not renormalise (Qwen3-MoE with
    /// `norm_topk_prob` false).
    pub softmax_over_topk: bool,
    /// On equal scores the higher expert index is kept first.
    pub ties_last: bool,
    /// Each kept expert's weight written at index e + 1 (mod n_experts): the expert ids off by one.
    pub off_by_one: bool,
}

/// Routing weights with `f`'s mistakes. `scores` [n_experts] -> [n_experts].
pub fn core(scores: &[f64], top_k: usize, renormalize: bool, f: Faults) -> Vec<f64> {
    let n = scores.len();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|v| (v - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    let probs: Vec<f64> = exps.iter().map(|e| e / total).collect();
    let mut order: Vec<usize> = (0..n).collect();
    if f.ties_last {
        order.reverse();
    }
    // A stable sort: equal scores keep the order above.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let kept = &order[..top_k.min(n)];
    let sum: f64 = kept.iter().map(|&e| probs[e]).sum();
    let renorm = (renormalize && !f.no_renorm) || f.softmax_over_topk;
    let mut out = vec![0.0; n];
    for &e in kept {
        let at = if f.off_by_one { (e + 1) % n } else { e };
        out[at] = if renorm { probs[e] / sum } else { probs[e] };
    }
    out
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("scores")?, c.n("top_k")?, c.n("renormalize")? != 0, f)))
}

/// Draw n_experts, top_k (at most n_experts), renormalize (either, at random) and the scores: uniform at the
/// case's scale, or, with a `levels` range, each one of that many evenly spaced values in
/// [-scale, scale] (so that equal scores meet at the top-k boundary).
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let n = dim(rng, case, "n_experts")?.max(1);
    let top_k = dim(rng, case, "top_k")?.clamp(1, n);
    let renormalize = u8::from(rng.random_bool(0.5));
    let scores = match case.dims.get("levels") {
        Some(_) => {
            let levels = dim(rng, case, "levels")?.max(2);
            (0..n)
                .map(|_| {
                    let j = rng.random_range(0..levels) as f64;
                    ((2.0 * j / (levels - 1) as f64 - 1.0) * case.scale) as f32
                })
                .collect()
        }
        None => uniform(rng, n, case.scale),
    };
    let mut c = Case::new(KERNEL.id);
    c.label = format!("n_experts={n} top_k={top_k} renormalize={renormalize} scale={}", case.scale);
    c.param("top_k", top_k);
    c.param("renormalize", renormalize);
    c.input("scores", Tensor::F32(scores));
    Ok(c)
}

/// The scores read and the weights written (f32); about 6 FLOPs per expert (exp, sums, divides,
/// comparisons of the selection).
fn cost(dims: &Dims) -> Cost {
    Cost { bytes: 8.0 * d(dims, "n_experts"), flops: 6.0 * d(dims, "n_experts") }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.moe_route",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::moe::moe_route(&c.f("scores")?, c.n("top_k")?, c.n("renormalize")? != 0))),
    mutants: &[
        Mutant { name: "moe_no_renorm", expect: |c| eval(c, Faults { no_renorm: true, ..Faults::default() }) },
        Mutant {
            name: "moe_softmax_over_topk",
            expect: |c| eval(c, Faults { softmax_over_topk: true, ..Faults::default() }),
        },
        Mutant { name: "moe_ties_last", expect: |c| eval(c, Faults { ties_last: true, ..Faults::default() }) },
        Mutant { name: "moe_expert_off_by_one", expect: |c| eval(c, Faults { off_by_one: true, ..Faults::default() }) },
    ],
    cost,
    test_arm: r#"{
            let scores = i.f("scores");
            let mut out = nan(scores.len());
            engine::kernels::moe_route(&scores, i.n("top_k"), i.n("renormalize") != 0, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (e, k) = (n("n_experts"), n("top_k"));
            let scores = fill(e, 9);
            let mut out = vec![0.0f32; e];
            Timed { run: Box::new(move |_| engine::kernels::moe_route(&scores, k, true, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let scores = i.f("scores");
            let sd = device::up(&scores);
            let mut out = device::nan(scores.len());
            device::ok(engine::kernels::moe_route(device::dev(), &sd.as_view(), i.n("top_k"), i.n("renormalize") != 0, &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (e, k) = (n("n_experts"), n("top_k"));
            let scores = device::up(&fill(e, 9));
            let mut out = device::nan(e);
            Timed { run: Box::new(move |_| device::ok(engine::kernels::moe_route(device::dev(), &scores.as_view(), k, true, &mut out.as_view_mut()))) }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: scores [0, ln 2, ln 3, ln 4] give probabilities [1, 2, 3, 4] / 10.
    #[test]
    fn hand_worked_routing_and_its_mutants() {
        let s: Vec<f64> = [1.0f64, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);
        assert!(close(&core(&s, 2, false, Faults::default()), &[0.0, 0.0, 0.3, 0.4]));
        assert!(close(&core(&s, 2, true, Faults::default()), &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]));
        let f = |x: Faults| core(&s, 2, true, x);
        assert!(close(&f(Faults { no_renorm: true, ..Faults::default() }), &[0.0, 0.0, 0.3, 0.4]));
        assert!(close(&f(Faults { off_by_one: true, ..Faults::default() }), &[4.0 / 7.0, 0.0, 0.0, 3.0 / 7.0]));
        assert!(close(
            &core(&s, 2, false, Faults { softmax_over_topk: true, ..Faults::default() }),
            &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]
        ));
        // Equal scores at the boundary: experts 1 and 2 tie for the second place.
        let t = [0.0, 1.0, 1.0, 2.0];
        assert_eq!(core(&t, 2, true, Faults::default())[1..3].iter().filter(|v| **v > 0.0).count(), 1);
        assert!(core(&t, 2, true, Faults::default())[1] > 0.0);
        assert!(core(&t, 2, true, Faults { ties_last: true, ..Faults::default() })[2] > 0.0);
    }
}
