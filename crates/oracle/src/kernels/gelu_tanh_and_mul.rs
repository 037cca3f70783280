//! `kernel.gelu_tanh_and_mul`: GeGLU's gate (Shazeer 2020, arXiv:2002.05202) with the tanh-approximated
//! GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415; PyTorch `gelu(approximate="tanh")`, HF
//! `gelu_pytorch_tanh`): `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up`. Mutant `gelu_erf`
//! (failure.gelu-erf-vs-tanh: the exact GELU `0.5 g (1 + erf(g / sqrt 2))`).

use rand_chacha::ChaCha8Rng;

use super::silu_and_mul::elementwise_cost;
use super::{Case, Expect, Kernel, Mutant, Tensor, dim, uniform};
use crate::families::gelu_tanh;
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The exact (erf) GELU in place of the tanh approximation.
    pub erf: bool,
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

/// GeGLU with `f`'s mistakes. All: [len].
pub fn core(gate: &[f64], up: &[f64], f: Faults) -> Vec<f64> {
    if f.erf {
        gate.iter().zip(up).map(|(g, u)| 0.5 * g * (1.0 + erf(g / std::f64::consts::SQRT_2)) * u).collect()
    } else {
        gate.iter().zip(up).map(|(g, u)| gelu_tanh(*g) * u).collect()
    }
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("gate")?, &c.f("up")?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let len = dim(rng, case, "len")?;
    let (g, u) = (uniform(rng, len, case.scale), uniform(rng, len, 1.0));
    let mut c = Case::new(KERNEL.id);
    c.label = format!("len={len} scale={}", case.scale);
    c.input("gate", Tensor::F32(g));
    c.input("up", Tensor::F32(u));
    Ok(c)
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.gelu_tanh_and_mul",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::gelu_tanh_and_mul(&c.f("gate")?, &c.f("up")?))),
    mutants: &[Mutant { name: "gelu_erf", expect: |c| eval(c, Faults { erf: true }) }],
    cost: elementwise_cost,
    test_arm: r#"{
            let gate = i.f("gate");
            let mut out = nan(gate.len());
            engine::kernels::gelu_tanh_and_mul(&gate, &i.f("up"), &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let len = n("len");
            let (g, u) = (fill(len, 6), fill(len, 7));
            let mut out = vec![0.0f32; len];
            Timed { run: Box::new(move |_| engine::kernels::gelu_tanh_and_mul(&g, &u, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let gate = i.f("gate");
            let (g, u) = (device::up(&gate), device::up(&i.f("up")));
            let mut out = device::nan(gate.len());
            device::ok(engine::kernels::gelu_tanh_and_mul(device::dev(), &g.as_view(), &u.as_view(), &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let len = n("len");
            let (g, u) = (device::up(&fill(len, 6)), device::up(&fill(len, 7)));
            let mut out = device::nan(len);
            Timed {
                run: Box::new(move |_| {
                    device::ok(engine::kernels::gelu_tanh_and_mul(device::dev(), &g.as_view(), &u.as_view(), &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

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
    fn erf_and_tanh_forms_differ_by_a_few_1e4() {
        let g: Vec<f64> = (0..=600).map(|i| -3.0 + i as f64 * 0.01).collect();
        let one = vec![1.0; g.len()];
        let (a, b) = (core(&g, &one, Faults { erf: true }), core(&g, &one, Faults::default()));
        let max = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(max > 1e-4 && max < 1e-3, "max difference {max}");
    }
}
