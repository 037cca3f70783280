//! `kernel.rms_norm`: RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) over rows,
//! `y = x / sqrt(mean(x^2) + eps) * w`. Mutants `rmsnorm_eps_outside`
//! (failure.rmsnorm-eps-outside-sqrt) and `rmsnorm_no_weight` (failure.rmsnorm-missing-weight).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// `x / (sqrt(mean(x^2)) + eps)`: eps added after the root.
    pub eps_outside: bool,
    /// The learned gain never applied (only the length of `weight` is used, as the row width).
    pub no_weight: bool,
}

/// RMSNorm with `f`'s mistakes over rows of width `weight.len()`. `x`: [rows, dim] -> [rows, dim].
pub fn core(x: &[f64], weight: &[f64], eps: f64, f: Faults) -> Vec<f64> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let inv = if f.eps_outside { 1.0 / (ms.sqrt() + eps) } else { 1.0 / (ms + eps).sqrt() };
        if f.no_weight {
            out.extend(row.iter().map(|v| v * inv));
        } else {
            out.extend(row.iter().zip(weight).map(|(v, w)| v * inv * w));
        }
    }
    out
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("x")?, &c.f("weight")?, c.x("eps")?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (rows, dm) = (dim(rng, case, "rows")?, dim(rng, case, "dim")?);
    let x = uniform(rng, rows * dm, case.scale);
    let weight: Vec<f32> = (0..dm).map(|_| rng.random_range(0.5..1.5)).collect();
    let eps: f32 = [1e-5, 1e-6, 1e-2][rng.random_range(0..3)];
    let mut c = Case::new(KERNEL.id);
    c.label = format!("rows={rows} dim={dm} eps={eps:e}");
    c.param("eps", format!("{eps:e}"));
    c.input("x", Tensor::F32(x));
    c.input("weight", Tensor::F32(weight));
    Ok(c)
}

/// One row: x and w read, y written (f32), about 4 FLOPs per element.
fn cost(dims: &Dims) -> Cost {
    Cost { bytes: 12.0 * d(dims, "dim"), flops: 4.0 * d(dims, "dim") }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.rms_norm",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::rms_norm(&c.f("x")?, &c.f("weight")?, c.x("eps")?))),
    mutants: &[
        Mutant { name: "rmsnorm_eps_outside", expect: |c| eval(c, Faults { eps_outside: true, ..Faults::default() }) },
        Mutant { name: "rmsnorm_no_weight", expect: |c| eval(c, Faults { no_weight: true, ..Faults::default() }) },
    ],
    cost,
    test_arm: r#"{
            let x = i.f("x");
            let mut out = nan(x.len());
            engine::kernels::rms_norm(&x, &i.f("weight"), i.x("eps"), &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let dim = n("dim");
            let (x, w) = (fill(dim, 2), fill(dim, 3));
            let mut out = vec![0.0f32; dim];
            Timed { run: Box::new(move |_| engine::kernels::rms_norm(&x, &w, 1e-5, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let x = i.f("x");
            let (xd, w) = (device::up(&x), device::up(&i.f("weight")));
            let mut out = device::nan(x.len());
            device::ok(engine::kernels::rms_norm(device::dev(), &xd.as_view(), &w.as_view(), i.x("eps"), &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let dim = n("dim");
            let (x, w) = (device::up(&fill(dim, 2)), device::up(&fill(dim, 3)));
            let mut out = device::nan(dim);
            Timed {
                run: Box::new(move |_| {
                    device::ok(engine::kernels::rms_norm(device::dev(), &x.as_view(), &w.as_view(), 1e-5, &mut out.as_view_mut()))
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
        // Row [3, 4]: mean square 12.5.
        let (x, w) = ([3.0, 4.0], [2.0, 0.5]);
        let rms = 12.5f64.sqrt();
        let outside = Faults { eps_outside: true, ..Faults::default() };
        close(&core(&x, &w, 1.0, outside), &[3.0 / (rms + 1.0) * 2.0, 4.0 / (rms + 1.0) * 0.5]);
        let no_weight = Faults { no_weight: true, ..Faults::default() };
        close(&core(&x, &w, 1.0, no_weight), &[3.0 / 13.5f64.sqrt(), 4.0 / 13.5f64.sqrt()]);
        close(&core(&x, &w, 1.0, Faults::default()), &[3.0 / 13.5f64.sqrt() * 2.0, 4.0 / 13.5f64.sqrt() * 0.5]);
    }
}
