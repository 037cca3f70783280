//! `kernel.moe_experts_clamped`: gpt-oss's experts of one token (OpenAI 2025, arXiv:2508.10925;
//! transformers `GptOssExperts`): fused gate/up and down tensors stored input-major with biases,
//! gate and up interleaved in the fused output, a clamped SwiGLU `(up + 1) * gate * sigmoid(alpha *
//! gate)` with gate <= limit and |up| <= limit, weighted by the routing weights. Mutants
//! `gate_up_halves` (failure.moe-gate-up-halves: gate the first half, up the second) and `unclamped`
//! (failure.swiglu-clamp-missing).

use rand::Rng;
use rand::seq::index::sample;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// gpt-oss's `alpha` (the sigmoid's slope; transformers `GptOssExperts.alpha`).
pub const ALPHA: f64 = 1.702;
/// gpt-oss's clamp (`GptOssExperts.limit`; `swiglu_limit` in OpenAI's config).
pub const LIMIT: f64 = 7.0;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Gate read from the first half of the fused output and up from the second (the layout of
    /// Phi-3's gate_up_proj) instead of even and odd entries.
    pub halves: bool,
    /// No clamping of gate and up.
    pub unclamped: bool,
}

/// The weighted experts with `f`'s mistakes. `x` [hidden], `route` [n_experts], `gate_up`
/// [n_experts, hidden, 2 inter] input-major, `gate_up_bias` [n_experts, 2 inter], `down`
/// [n_experts, inter, hidden] input-major, `down_bias` [n_experts, hidden]; returns [hidden].
#[allow(clippy::too_many_arguments)]
pub fn core(
    x: &[f64],
    route: &[f64],
    gate_up: &[f64],
    gate_up_bias: &[f64],
    down: &[f64],
    down_bias: &[f64],
    inter: usize,
    alpha: f64,
    limit: f64,
    f: Faults,
) -> Vec<f64> {
    let hidden = x.len();
    let mut out = vec![0.0; hidden];
    for (e, &w) in route.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let gu = &gate_up[e * hidden * 2 * inter..][..hidden * 2 * inter];
        let y: Vec<f64> = (0..2 * inter)
            .map(|j| (0..hidden).map(|h| x[h] * gu[h * 2 * inter + j]).sum::<f64>() + gate_up_bias[e * 2 * inter + j])
            .collect();
        let a: Vec<f64> = (0..inter)
            .map(|j| {
                let (g, u) = if f.halves { (y[j], y[inter + j]) } else { (y[2 * j], y[2 * j + 1]) };
                let (gate, up) = if f.unclamped { (g, u) } else { (g.min(limit), u.clamp(-limit, limit)) };
                (up + 1.0) * (gate / (1.0 + (-alpha * gate).exp()))
            })
            .collect();
        let dn = &down[e * inter * hidden..][..inter * hidden];
        for (c, o) in out.iter_mut().enumerate() {
            let z = (0..inter).map(|j| a[j] * dn[j * hidden + c]).sum::<f64>() + down_bias[e * hidden + c];
            *o += w * z;
        }
    }
    out
}

/// The case's tensors when their lengths agree with `x`, `route` and `inter`.
struct Args {
    x: Vec<f64>,
    route: Vec<f64>,
    gate_up: Vec<f64>,
    gate_up_bias: Vec<f64>,
    down: Vec<f64>,
    down_bias: Vec<f64>,
    inter: usize,
    alpha: f64,
    limit: f64,
}

fn args(c: &Case) -> Option<Args> {
    let (x, route, inter) = (c.f("x")?, c.f("route")?, c.n("inter")?);
    let (h, e) = (x.len(), route.len());
    let a = Args {
        gate_up: c.f("gate_up")?,
        gate_up_bias: c.f("gate_up_bias")?,
        down: c.f("down")?,
        down_bias: c.f("down_bias")?,
        alpha: c.x("alpha")?,
        limit: c.x("limit")?,
        x,
        route,
        inter,
    };
    let ok = a.gate_up.len() == e * h * 2 * inter
        && a.gate_up_bias.len() == e * 2 * inter
        && a.down.len() == e * inter * h
        && a.down_bias.len() == e * h;
    ok.then_some(a)
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let a = args(c)?;
    Some(Expect::Values(core(
        &a.x,
        &a.route,
        &a.gate_up,
        &a.gate_up_bias,
        &a.down,
        &a.down_bias,
        a.inter,
        a.alpha,
        a.limit,
        f,
    )))
}

/// Draw hidden, inter, n_experts and top_k; x at the case's scale (a large scale drives the fused
/// outputs past the limit); weights uniform in [-1, 1) / sqrt(fan_in), biases uniform in
/// [-0.5, 0.5); `top_k` distinct experts with positive weights summing to 1; alpha and limit
/// gpt-oss's.
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (hidden, inter) = (dim(rng, case, "hidden")?.max(1), dim(rng, case, "inter")?.max(1));
    let n = dim(rng, case, "n_experts")?.max(1);
    let top_k = dim(rng, case, "top_k")?.clamp(1, n);
    let scaled = |v: Vec<f32>, fan_in: usize| v.into_iter().map(|w| w / (fan_in as f32).sqrt()).collect::<Vec<_>>();
    let gate_up = scaled(uniform(rng, n * hidden * 2 * inter, 1.0), hidden);
    let gate_up_bias = uniform(rng, n * 2 * inter, 0.5);
    let down = scaled(uniform(rng, n * inter * hidden, 1.0), inter);
    let down_bias = uniform(rng, n * hidden, 0.5);
    let raw: Vec<f32> = (0..top_k).map(|_| rng.random_range(0.1f32..1.0)).collect();
    let sum: f32 = raw.iter().sum();
    let mut route = vec![0.0f32; n];
    for (e, w) in sample(rng, n, top_k).into_iter().zip(raw) {
        route[e] = w / sum;
    }
    let mut c = Case::new(KERNEL.id);
    c.label = format!("hidden={hidden} inter={inter} n_experts={n} top_k={top_k} scale={}", case.scale);
    c.param("inter", inter);
    c.param("alpha", ALPHA as f32);
    c.param("limit", LIMIT as f32);
    c.input("x", Tensor::F32(uniform(rng, hidden, case.scale)));
    c.input("route", Tensor::F32(route));
    c.input("gate_up", Tensor::F32(gate_up));
    c.input("gate_up_bias", Tensor::F32(gate_up_bias));
    c.input("down", Tensor::F32(down));
    c.input("down_bias", Tensor::F32(down_bias));
    Ok(c)
}

/// The top_k selected experts' fused gate/up and down matrices and biases read (f32; the others
/// are not touched) plus x and the output; 2 FLOPs per weight read.
fn cost(dims: &Dims) -> Cost {
    let (k, h, m) = (d(dims, "top_k"), d(dims, "hidden"), d(dims, "inter"));
    let weights = k * 3.0 * m * h;
    Cost { bytes: 4.0 * (weights + k * (2.0 * m + h)) + 8.0 * h, flops: 2.0 * weights }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.moe_experts_clamped",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let a = args(c)?;
        Some(Expect::Values(crate::moe::moe_experts_clamped(
            &a.x,
            &a.route,
            &a.gate_up,
            &a.gate_up_bias,
            &a.down,
            &a.down_bias,
            a.inter,
            a.alpha,
            a.limit,
        )))
    },
    mutants: &[
        Mutant { name: "gate_up_halves", expect: |c| eval(c, Faults { halves: true, ..Faults::default() }) },
        Mutant { name: "swiglu_unclamped", expect: |c| eval(c, Faults { unclamped: true, ..Faults::default() }) },
    ],
    cost,
    test_arm: r#"{
            let x = i.f("x");
            let mut out = nan(x.len());
            engine::kernels::moe_experts_clamped(
                &x,
                &i.f("route"),
                &i.f("gate_up"),
                &i.f("gate_up_bias"),
                &i.f("down"),
                &i.f("down_bias"),
                i.n("inter"),
                i.x("alpha"),
                i.x("limit"),
                &mut out,
            );
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (h, m, e, k) = (n("hidden"), n("inter"), n("n_experts"), n("top_k"));
            let x = fill(h, 10);
            let mut route = vec![0.0f32; e];
            for r in route.iter_mut().take(k) { *r = 1.0 / k as f32; }
            let (gu, gub, dw, db) = (fill(e * h * 2 * m, 11), fill(e * 2 * m, 12), fill(e * m * h, 13), fill(e * h, 14));
            let mut out = vec![0.0f32; h];
            Timed { run: Box::new(move |_| engine::kernels::moe_experts_clamped(&x, &route, &gu, &gub, &dw, &db, m, 1.702, 7.0, &mut out)) }
        }"#,
    cuda_test_arm: "",
    cuda_timed_arm: "",
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Hidden 1, inter 1, one expert of weight 0.5: gate_up [[2, 3]] (gate weight 2, up weight 3),
    /// biases [0.5, -1], down [[4]] + 0.25. At x = 1: gate 2.5, up 2, a = 3 * 2.5 sigmoid(1.702 * 2.5),
    /// out = 0.5 (4 a + 0.25). At x = 4: gate 8.5 -> 7, up 11 -> 7 (clamped).
    #[test]
    fn hand_worked_clamped_swiglu() {
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        let (gu, gub, dn, db) = ([2.0, 3.0], [0.5, -1.0], [4.0], [0.25]);
        let run = |x: f64, f: Faults| core(&[x], &[0.5], &gu, &gub, &dn, &db, 1, ALPHA, LIMIT, f)[0];
        let a = 3.0 * 2.5 * sig(ALPHA * 2.5);
        assert!((run(1.0, Faults::default()) - 0.5 * (4.0 * a + 0.25)).abs() < 1e-12);
        let clamped = 8.0 * 7.0 * sig(ALPHA * 7.0);
        assert!((run(4.0, Faults::default()) - 0.5 * (4.0 * clamped + 0.25)).abs() < 1e-12);
        let unclamped = 12.0 * 8.5 * sig(ALPHA * 8.5);
        let f = Faults { unclamped: true, ..Faults::default() };
        assert!((run(4.0, f) - 0.5 * (4.0 * unclamped + 0.25)).abs() < 1e-12);
        // Inter 1 has one pair: halves and interleaved read the same entries.
        assert_eq!(run(1.0, Faults { halves: true, ..Faults::default() }), run(1.0, Faults::default()));
    }
}
