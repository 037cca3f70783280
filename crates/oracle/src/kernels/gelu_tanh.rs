//! `kernel.gelu_tanh`: the tanh-approximated GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415;
//! PyTorch `gelu(approximate="tanh")`, HF `gelu_pytorch_tanh`) of every element, the activation of
//! a non-gated MLP (StarCoder2: `c_proj(gelu(c_fc(x)))`). Mutant `gelu_erf` (failure.gelu-erf-vs-tanh:
//! the exact GELU `0.5 x (1 + erf(x / sqrt 2))`).

use rand_chacha::ChaCha8Rng;

use super::gelu_tanh_and_mul::erf;
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

/// GELU with `f`'s mistakes. [len] -> [len].
pub fn core(x: &[f64], f: Faults) -> Vec<f64> {
    if f.erf {
        x.iter().map(|g| 0.5 * g * (1.0 + erf(g / std::f64::consts::SQRT_2))).collect()
    } else {
        x.iter().map(|g| gelu_tanh(*g)).collect()
    }
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("x")?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let len = dim(rng, case, "len")?;
    let mut c = Case::new(KERNEL.id);
    c.label = format!("len={len} scale={}", case.scale);
    c.input("x", Tensor::F32(uniform(rng, len, case.scale)));
    Ok(c)
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.gelu_tanh",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(c.f("x")?.iter().map(|g| gelu_tanh(*g)).collect())),
    mutants: &[Mutant { name: "gelu_erf", expect: |c| eval(c, Faults { erf: true }) }],
    cost: elementwise_cost,
    test_arm: r#"{
            let x = i.f("x");
            let mut out = nan(x.len());
            engine::kernels::gelu_tanh(&x, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let len = n("len");
            let x = fill(len, 6);
            let mut out = vec![0.0f32; len];
            Timed { run: Box::new(move |_| engine::kernels::gelu_tanh(&x, &mut out)) }
        }"#,
    cuda_test_arm: "",
    cuda_timed_arm: "",
};
