//! `kernel.silu_and_mul`: SwiGLU's gate, `silu(gate) * up` element-wise (SiLU: Elfwing et al. 2017;
//! SwiGLU: Shazeer 2020, arXiv:2002.05202). Mutant `silu_swapped` (failure.silu-gate-up-swapped).

use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// `silu(up) * gate`: the SiLU applied to the wrong operand (gate_proj and up_proj swapped).
    pub swapped: bool,
}

/// `silu(gate) * up` with `f`'s mistakes. All: [len].
pub fn core(gate: &[f64], up: &[f64], f: Faults) -> Vec<f64> {
    let (g, u) = if f.swapped { (up, gate) } else { (gate, up) };
    g.iter().zip(u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect()
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("gate")?, &c.f("up")?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let len = dim(rng, case, "len")?;
    let (g, u) = (uniform(rng, len, case.scale), uniform(rng, len, case.scale));
    let mut c = Case::new(KERNEL.id);
    c.label = format!("len={len}");
    c.input("gate", Tensor::F32(g));
    c.input("up", Tensor::F32(u));
    Ok(c)
}

/// Gate and up read, output written (f32); about 8 FLOPs per element (the exponential counted as a few).
pub fn elementwise_cost(dims: &Dims) -> Cost {
    Cost { bytes: 12.0 * d(dims, "len"), flops: 8.0 * d(dims, "len") }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.silu_and_mul",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::silu_and_mul(&c.f("gate")?, &c.f("up")?))),
    mutants: &[Mutant { name: "silu_swapped", expect: |c| eval(c, Faults { swapped: true }) }],
    cost: elementwise_cost,
    test_arm: r#"{
            let gate = i.f("gate");
            let mut out = nan(gate.len());
            engine::kernels::silu_and_mul(&gate, &i.f("up"), &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let len = n("len");
            let (g, u) = (fill(len, 6), fill(len, 7));
            let mut out = vec![0.0f32; len];
            Timed { run: Box::new(move |_| engine::kernels::silu_and_mul(&g, &u, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let gate = i.f("gate");
            let (g, u) = (device::up(&gate), device::up(&i.f("up")));
            let mut out = device::nan(gate.len());
            device::ok(engine::kernels::silu_and_mul(device::dev(), &g.as_view(), &u.as_view(), &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let len = n("len");
            let (g, u) = (device::up(&fill(len, 6)), device::up(&fill(len, 7)));
            let mut out = device::nan(len);
            Timed {
                run: Box::new(move |_| {
                    device::ok(engine::kernels::silu_and_mul(device::dev(), &g.as_view(), &u.as_view(), &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapped_applies_silu_to_up() {
        let silu = |v: f64| v / (1.0 + (-v).exp());
        assert_eq!(core(&[2.0], &[-1.0], Faults::default()), vec![-silu(2.0)]);
        assert_eq!(core(&[2.0], &[-1.0], Faults { swapped: true }), vec![silu(-1.0) * 2.0]);
    }
}
