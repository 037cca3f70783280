//! `kernel.softmax`: softmax over each row of width n, the row maximum subtracted first (in place).
//! Mutant `softmax_no_max` (failure.softmax-no-max-subtraction).

use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// `exp(x) / sum exp(x)` without subtracting the row maximum. In exact arithmetic that equals the
    /// softmax, so the fault emulates what an f32 engine computes: each `exp` in f32 (values above
    /// about 88.72 overflow to +inf, very negative ones underflow to 0), the denominator summed in
    /// f32 left to right, each term divided by it. A row with an overflowed term gives NaN there
    /// (inf / inf) and 0 elsewhere; a row whose terms all underflow gives NaN everywhere (0 / 0).
    pub no_max: bool,
}

/// Softmax with `f`'s mistakes over rows of width `n`. `x`: [rows, n] -> [rows, n].
pub fn core(x: &[f64], n: usize, f: Faults) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        if f.no_max {
            let exps: Vec<f32> = row.iter().map(|&v| (v as f32).exp()).collect();
            let sum: f32 = exps.iter().fold(0.0f32, |s, &e| s + e);
            out.extend(exps.iter().map(|&e| (e / sum) as f64));
        } else {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = row.iter().map(|v| (v - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            out.extend(exps.iter().map(|e| e / sum));
        }
    }
    out
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("x")?, c.n("n").filter(|&n| n > 0)?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (rows, n) = (dim(rng, case, "rows")?, dim(rng, case, "n")?);
    let x = uniform(rng, rows * n, case.scale);
    let mut c = Case::new(KERNEL.id);
    c.label = format!("rows={rows} n={n} scale={}", case.scale);
    c.param("n", n);
    c.input("x", Tensor::F32(x));
    Ok(c)
}

/// One row read and written (f32); about 4 FLOPs per element (max, exp, sum, divide).
fn cost(dims: &Dims) -> Cost {
    Cost { bytes: 8.0 * d(dims, "n"), flops: 4.0 * d(dims, "n") }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.softmax",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::softmax(&c.f("x")?, c.n("n")?))),
    mutants: &[Mutant { name: "softmax_no_max", expect: |c| eval(c, Faults { no_max: true }) }],
    cost,
    test_arm: r#"{
            let mut x = i.f("x");
            engine::kernels::softmax(&mut x, i.n("n"));
            vec![("out".into(), Out::F(x))]
        }"#,
    timed_arm: r#"{
            let len = n("n");
            let mut x = fill(len, 8);
            Timed { run: Box::new(move |_| engine::kernels::softmax(&mut x, len)) }
        }"#,
    cuda_test_arm: r#"{
            let mut x = device::up(&i.f("x"));
            device::ok(engine::kernels::softmax(device::dev(), &mut x.as_view_mut(), i.n("n")));
            vec![("out".into(), Out::F(device::down(&x)))]
        }"#,
    cuda_timed_arm: r#"{
            let len = n("n");
            let mut x = device::up(&fill(len, 8));
            Timed { run: Box::new(move |_| device::ok(engine::kernels::softmax(device::dev(), &mut x.as_view_mut(), len))) }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_max_overflows_like_f32() {
        let out = core(&[1.0, 2.0, 100.0, 0.0, 0.0, 0.0], 3, Faults { no_max: true });
        assert_eq!(out[0], 0.0);
        assert_eq!(out[1], 0.0);
        assert!(out[2].is_nan());
        for v in &out[3..] {
            assert!((v - 1.0 / 3.0).abs() < 1e-7);
        }
        let want = core(&[1.0, 2.0, 3.0], 3, Faults::default());
        for (a, b) in core(&[1.0, 2.0, 3.0], 3, Faults { no_max: true }).iter().zip(&want) {
            assert!((a - b).abs() < 1e-7);
        }
    }
}
