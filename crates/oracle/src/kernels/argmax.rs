//! `kernel.argmax`: index of the largest logit, the first on ties (greedy sampling). Mutant
//! `argmax_last` (failure.argmax-last-on-ties).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The last maximum on ties instead of the first.
    pub last_on_ties: bool,
}

/// Argmax with `f`'s mistakes. `x`: [n], n >= 1.
///
/// # Panics
/// On an empty slice.
pub fn core(x: &[f64], f: Faults) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] || (f.last_on_ties && *v == x[best]) {
            best = i;
        }
    }
    best
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let x = c.f("x").filter(|x| !x.is_empty())?;
    Some(Expect::Index(core(&x, f)))
}

/// Uniform logits with a tie for the maximum planted at two distinct indices (the contract says the
/// first wins).
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let n = dim(rng, case, "n")?;
    let mut x = uniform(rng, n, case.scale);
    if n >= 2 {
        let a = rng.random_range(0..n - 1);
        let b = rng.random_range(a + 1..n);
        let top = x.iter().cloned().fold(f32::MIN, f32::max) + 1.0;
        x[a] = top;
        x[b] = top;
    }
    let mut c = Case::new(KERNEL.id);
    c.label = format!("n={n}");
    c.input("x", Tensor::F32(x));
    Ok(c)
}

/// The logits read once (f32); one comparison per element.
fn cost(dims: &Dims) -> Cost {
    Cost { bytes: 4.0 * d(dims, "n"), flops: d(dims, "n") }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.argmax",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Index(crate::argmax(&c.f("x").filter(|x| !x.is_empty())?))),
    mutants: &[Mutant { name: "argmax_last", expect: |c| eval(c, Faults { last_on_ties: true }) }],
    cost,
    test_arm: r#"{
            let idx = engine::kernels::argmax(&i.f("x"));
            vec![("out".into(), Out::U(vec![idx as u32]))]
        }"#,
    timed_arm: r#"{
            let len = n("n");
            let x = fill(len, 10);
            Timed {
                run: Box::new(move |_| {
                    std::hint::black_box(engine::kernels::argmax(&x));
                }),
            }
        }"#,
    cuda_test_arm: r#"{
            let x = device::up(&i.f("x"));
            // An index the kernel does not write stays u32::MAX and fails.
            let mut out = device::up(&[u32::MAX]);
            device::ok(engine::kernels::argmax(device::dev(), &x.as_view(), &mut out.as_view_mut()));
            vec![("out".into(), Out::U(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let len = n("n");
            let x = device::up(&fill(len, 10));
            let mut out = device::up(&[0u32]);
            Timed { run: Box::new(move |_| device::ok(engine::kernels::argmax(device::dev(), &x.as_view(), &mut out.as_view_mut()))) }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_first_or_last() {
        let x = [1.0, 3.0, 2.0, 3.0, 0.0];
        assert_eq!(core(&x, Faults::default()), 1);
        assert_eq!(core(&x, Faults { last_on_ties: true }), 3);
    }
}
