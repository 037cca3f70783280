//! `kernel.moe_experts`: the SwiGLU experts of one token weighted by its routing weights
//! (`kernel.moe_route`'s output): `sum_e route[e] * (silu(x G_e^T) * (x U_e^T)) D_e^T` over the
//! experts with route[e] != 0, the expert weights stacked [n_experts, ...] (Mixtral, Jiang et al.
//! 2024, arXiv:2401.04088, eq. 2; SwiGLU: Shazeer 2020, arXiv:2002.05202). Mutant `moe_unweighted`
//! (failure.moe-routing-weights-ignored: each selected expert's output added with weight 1).

use rand::Rng;
use rand::seq::index::sample;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, linear, silu_and_mul, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes; `linear` and `silu` are those of the kernels the experts run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Each selected expert's output added with weight 1 instead of its routing weight.
    pub unweighted: bool,
    /// kernel.linear's faults in every expert projection.
    pub linear: linear::Faults,
    /// kernel.silu_and_mul's faults in every expert.
    pub silu: silu_and_mul::Faults,
}

/// The weighted experts with `f`'s mistakes. `x` [hidden], `route` [n_experts], `gate` and `up`
/// [n_experts, inter, hidden], `down` [n_experts, hidden, inter]; returns [hidden].
pub fn core(x: &[f64], route: &[f64], gate: &[f64], up: &[f64], down: &[f64], inter: usize, f: Faults) -> Vec<f64> {
    let hidden = x.len();
    let size = inter * hidden;
    let mut out = vec![0.0; hidden];
    for (e, &w) in route.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let at = e * size;
        let g = linear::core(x, &gate[at..at + size], 1, hidden, inter, f.linear);
        let u = linear::core(x, &up[at..at + size], 1, hidden, inter, f.linear);
        let a = silu_and_mul::core(&g, &u, f.silu);
        let y = linear::core(&a, &down[at..at + size], 1, inter, hidden, f.linear);
        let w = if f.unweighted { 1.0 } else { w };
        out.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
    }
    out
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let (x, route) = (c.f("x")?, c.f("route")?);
    let inter = c.n("inter")?;
    let size = inter * x.len();
    let (gate, up, down) = (c.f("gate")?, c.f("up")?, c.f("down")?);
    if [&gate, &up, &down].iter().any(|w| w.len() != route.len() * size) {
        return None;
    }
    Some(Expect::Values(core(&x, &route, &gate, &up, &down, inter, f)))
}

/// Draw hidden, inter, n_experts and top_k; x at the case's scale; weights uniform in
/// [-1, 1) / sqrt(fan_in); `top_k` distinct experts with positive weights summing to 1, the others 0.
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (hidden, inter) = (dim(rng, case, "hidden")?.max(1), dim(rng, case, "inter")?.max(1));
    let n = dim(rng, case, "n_experts")?.max(1);
    let top_k = dim(rng, case, "top_k")?.clamp(1, n);
    let size = n * inter * hidden;
    // Weights are bf16 values (f32 with the low 16 bits zero, rounded to nearest even), so a bf16
    // engine (the CUDA variant) stores exactly what the oracle multiplies.
    let scaled = |v: Vec<f32>, fan_in: usize| {
        v.into_iter()
            .map(|w| crate::dtypes::bf16_value(crate::dtypes::round_bf16(w / (fan_in as f32).sqrt())) as f32)
            .collect::<Vec<_>>()
    };
    let (gate, up) = (scaled(uniform(rng, size, 1.0), hidden), scaled(uniform(rng, size, 1.0), hidden));
    let down = scaled(uniform(rng, size, 1.0), inter);
    let raw: Vec<f32> = (0..top_k).map(|_| rng.random_range(0.1f32..1.0)).collect();
    let sum: f32 = raw.iter().sum();
    let mut route = vec![0.0f32; n];
    for (e, w) in sample(rng, n, top_k).into_iter().zip(raw) {
        route[e] = w / sum;
    }
    let mut c = Case::new(KERNEL.id);
    c.label = format!("hidden={hidden} inter={inter} n_experts={n} top_k={top_k} scale={}", case.scale);
    c.param("inter", inter);
    c.input("x", Tensor::F32(uniform(rng, hidden, case.scale)));
    c.input("route", Tensor::F32(route));
    c.input("gate", Tensor::F32(gate));
    c.input("up", Tensor::F32(up));
    c.input("down", Tensor::F32(down));
    Ok(c)
}

/// The top_k selected experts' three matrices read (f32; the others are not touched) plus x and the
/// output; 2 FLOPs (a multiply-add) per weight read.
fn cost(dims: &Dims) -> Cost {
    let weights = d(dims, "top_k") * 3.0 * d(dims, "inter") * d(dims, "hidden");
    Cost { bytes: 4.0 * weights + 8.0 * d(dims, "hidden"), flops: 2.0 * weights }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.moe_experts",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        Some(Expect::Values(crate::moe::moe_experts(
            &c.f("x")?,
            &c.f("route")?,
            &c.f("gate")?,
            &c.f("up")?,
            &c.f("down")?,
            c.n("inter")?,
        )))
    },
    mutants: &[Mutant {
        name: "moe_unweighted",
        expect: |c| eval(c, Faults { unweighted: true, ..Faults::default() }),
    }],
    cost,
    test_arm: r#"{
            let x = i.f("x");
            let mut out = nan(x.len());
            engine::kernels::moe_experts(&x, &i.f("route"), &i.f("gate"), &i.f("up"), &i.f("down"), i.n("inter"), &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (h, m, e, k) = (n("hidden"), n("inter"), n("n_experts"), n("top_k"));
            let x = fill(h, 10);
            let mut route = vec![0.0f32; e];
            for r in route.iter_mut().take(k) { *r = 1.0 / k as f32; }
            let (g, u, dw) = (fill(e * m * h, 11), fill(e * m * h, 12), fill(e * m * h, 13));
            let mut out = vec![0.0f32; h];
            Timed { run: Box::new(move |_| engine::kernels::moe_experts(&x, &route, &g, &u, &dw, m, &mut out)) }
        }"#,
    // The drawn weights are bf16 values (draw), so rounding them for the device is exact.
    cuda_test_arm: r#"{
            let x = i.f("x");
            let b16 = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|w| (w.to_bits() >> 16) as u16).collect() };
            let (xd, route) = (device::up(&x), device::up(&i.f("route")));
            let (g, u, dw) = (device::up(&b16(i.f("gate"))), device::up(&b16(i.f("up"))), device::up(&b16(i.f("down"))));
            let mut out = device::nan(x.len());
            device::ok(engine::kernels::moe_experts(
                device::dev(),
                &xd.as_view(),
                &route.as_view(),
                &g.as_view(),
                &u.as_view(),
                &dw.as_view(),
                i.n("inter"),
                &mut out.as_view_mut(),
            ));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (h, m, e, k) = (n("hidden"), n("inter"), n("n_experts"), n("top_k"));
            let x = device::up(&fill(h, 10));
            let mut route = vec![0.0f32; e];
            for r in route.iter_mut().take(k) { *r = 1.0 / k as f32; }
            let route = device::up(&route);
            let b16 = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|w| (w.to_bits() >> 16) as u16).collect() };
            let (g, u, dw) = (device::up(&b16(fill(e * m * h, 11))), device::up(&b16(fill(e * m * h, 12))), device::up(&b16(fill(e * m * h, 13))));
            let mut out = device::nan(h);
            Timed {
                run: Box::new(move |_| {
                    device::ok(engine::kernels::moe_experts(device::dev(), &x.as_view(), &route.as_view(), &g.as_view(), &u.as_view(), &dw.as_view(), m, &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked on hidden 1, inter 1: expert e computes silu(g_e x) (u_e x) d_e.
    #[test]
    fn hand_worked_experts_and_unweighted() {
        let silu = |v: f64| v / (1.0 + (-v).exp());
        let (gate, up, down) = ([1.0, 2.0, 3.0], [1.0, 1.0, 2.0], [1.0, 10.0, 100.0]);
        let route = [0.25, 0.0, 0.75];
        let x = [0.5];
        let want = 0.25 * silu(0.5) * 0.5 * 1.0 + 0.75 * silu(1.5) * 1.0 * 100.0;
        let got = core(&x, &route, &gate, &up, &down, 1, Faults::default());
        assert!((got[0] - want).abs() < 1e-12, "{got:?} vs {want}");
        let unweighted = silu(0.5) * 0.5 + silu(1.5) * 100.0;
        let got = core(&x, &route, &gate, &up, &down, 1, Faults { unweighted: true, ..Faults::default() });
        assert!((got[0] - unweighted).abs() < 1e-12);
    }
}
