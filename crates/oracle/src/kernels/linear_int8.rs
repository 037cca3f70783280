//! `kernel.linear_int8`: `y = x W^T` with int8 weights and one f32 scale per output row
//! (w[o, c] = q[o, c] * scale[o]; scale = absmax / 127, round half away from zero), f32 accumulation.
//! Mutant `int8_scale_missing` (failure.int8-scale-missing).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::linear::{self, cost_at, draw_mkn, mkn};
use super::{Case, Expect, Kernel, Mutant, Tensor};
use crate::dtypes::{dequant_int8, quantize_int8_row};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The per-row scale never applied: `y[i, o] = sum_c x[i, c] q[o, c]`.
    pub scale_missing: bool,
}

/// The product with `f`'s mistakes. `x`: [m, k]; `q`: [n, k]; `scales`: [n]; returns [m, n].
pub fn core(x: &[f64], q: &[i8], scales: &[f32], m: usize, k: usize, n: usize, f: Faults) -> Vec<f64> {
    let w: Vec<f64> = if f.scale_missing { q.iter().map(|&v| v as f64).collect() } else { dequant_int8(q, scales) };
    linear::core(x, &w, m, k, n, linear::Faults::default())
}

fn scales(c: &Case) -> Option<Vec<f32>> {
    Some(c.f("scales")?.iter().map(|&s| s as f32).collect())
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let (m, k, n) = mkn(c)?;
    Some(Expect::Values(core(&c.f("x")?, c.i8("w")?, &scales(c)?, m, k, n, f)))
}

/// Quantised rows of uniform weights (scales near 1/127); one row is all zero, as the quantiser
/// makes of a zero row.
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (mut c, w) = draw_mkn(KERNEL.id, case, rng)?;
    let (k, n) = (c.n("k").unwrap_or(1), c.n("n").unwrap_or(1));
    let zero_row = rng.random_range(0..n);
    let mut q = Vec::with_capacity(n * k);
    let mut scales = Vec::with_capacity(n);
    for (o, row) in w.chunks_exact(k).enumerate() {
        let (qr, sc) = if o == zero_row && n > 1 { (vec![0; k], 0.0) } else { quantize_int8_row(row) };
        q.extend(qr);
        scales.push(sc);
    }
    c.input("w", Tensor::I8(q));
    c.input("scales", Tensor::F32(scales));
    Ok(c)
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.linear_int8",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let (m, k, n) = mkn(c)?;
        Some(Expect::Values(crate::linear(&c.f("x")?, &dequant_int8(c.i8("w")?, &scales(c)?), m, k, n)))
    },
    mutants: &[Mutant { name: "int8_scale_missing", expect: |c| eval(c, Faults { scale_missing: true }) }],
    cost: |dims| cost_at(dims, 1.0, 4.0),
    test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let mut out = nan(m * n);
            engine::kernels::linear_int8(&i.f("x"), &i.q("w"), &i.f("scales"), m, k, n, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = fill(k, 5);
            let ws: Vec<Vec<i8>> = (0..copies)
                .map(|c| fill(nn * k, 100 + c as u64).iter().map(|v| (v * 127.0) as i8).collect())
                .collect();
            let scales = vec![1.0f32 / 127.0; nn];
            let mut out = vec![0.0f32; nn];
            Timed {
                run: Box::new(move |i| {
                    engine::kernels::linear_int8(&x, &ws[i % ws.len()], &scales, 1, k, nn, &mut out)
                }),
            }
        }"#,
    cuda_test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let (x, w) = (device::up(&i.f("x")), device::up(&i.q("w")));
            let scales = device::up(&i.f("scales"));
            let mut out = device::nan(m * n);
            device::ok(engine::kernels::linear_int8(device::dev(), &x.as_view(), &w.as_view(), &scales.as_view(), m, k, n, &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = device::up(&fill(k, 5));
            let ws: Vec<_> = (0..copies).map(|c| device::up(&fill(nn * k, 100 + c as u64).iter().map(|v| (v * 127.0) as i8).collect::<Vec<i8>>())).collect();
            let scales = device::up(&vec![1.0f32 / 127.0; nn]);
            let mut out = device::nan(nn);
            Timed {
                run: Box::new(move |i| {
                    let w = &ws[i % ws.len()];
                    device::ok(engine::kernels::linear_int8(device::dev(), &x.as_view(), &w.as_view(), &scales.as_view(), 1, k, nn, &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_missing_drops_the_scale() {
        // x = [1, 2], q rows [3, 4] and [-1, 0], scales 0.5 and 2: 11 * 0.5 and -1 * 2.
        let (q, s) = ([3, 4, -1, 0], [0.5, 2.0]);
        assert_eq!(core(&[1.0, 2.0], &q, &s, 1, 2, 2, Faults::default()), vec![5.5, -2.0]);
        assert_eq!(core(&[1.0, 2.0], &q, &s, 1, 2, 2, Faults { scale_missing: true }), vec![11.0, -1.0]);
    }
}
