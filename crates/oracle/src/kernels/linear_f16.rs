//! `kernel.linear_f16`: `y = x W^T` with IEEE binary16 weights widened exactly to f32 and f32
//! accumulation. Mutant `half_format_swapped` (failure.half-format-swapped: the bits decoded as bf16).

use rand_chacha::ChaCha8Rng;

use super::linear::{self, cost_at, draw_mkn, mkn};
use super::{Case, Expect, Kernel, Mutant, Tensor};
use crate::dtypes::{round_f16, widen_bf16, widen_f16};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// binary16 bits read as bf16.
    pub format_swapped: bool,
}

/// The product with `f`'s mistakes. `x`: [m, k]; `w`: [n, k] binary16 bits; returns [m, n].
pub fn core(x: &[f64], w: &[u16], m: usize, k: usize, n: usize, f: Faults) -> Vec<f64> {
    let wide = if f.format_swapped { widen_bf16(w) } else { widen_f16(w) };
    linear::core(x, &wide, m, k, n, linear::Faults::default())
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let (m, k, n) = mkn(c)?;
    Some(Expect::Values(core(&c.f("x")?, c.half("w")?.0, m, k, n, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (mut c, w) = draw_mkn(KERNEL.id, case, rng)?;
    c.input("w", Tensor::F16(w.iter().map(|&v| round_f16(v)).collect()));
    Ok(c)
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.linear_f16",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let (m, k, n) = mkn(c)?;
        Some(Expect::Values(crate::linear(&c.f("x")?, &widen_f16(c.half("w")?.0), m, k, n)))
    },
    mutants: &[Mutant { name: "half_format_swapped", expect: |c| eval(c, Faults { format_swapped: true }) }],
    cost: |dims| cost_at(dims, 2.0, 0.0),
    test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let mut out = nan(m * n);
            engine::kernels::linear_f16(&i.f("x"), &i.h("w"), m, k, n, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = fill(k, 5);
            // Values in +-[0.5, 1): sign bit, exponent 14, random mantissa.
            let ws: Vec<Vec<u16>> = (0..copies)
                .map(|c| {
                    fill(nn * k, 100 + c as u64)
                        .iter()
                        .map(|v| ((v.to_bits() >> 16) as u16 & 0x83FF) | 0x3800)
                        .collect()
                })
                .collect();
            let mut out = vec![0.0f32; nn];
            Timed { run: Box::new(move |i| engine::kernels::linear_f16(&x, &ws[i % ws.len()], 1, k, nn, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let (x, w) = (device::up(&i.f("x")), device::up(&i.h("w")));
            let mut out = device::nan(m * n);
            device::ok(engine::kernels::linear_f16(device::dev(), &x.as_view(), &w.as_view(), m, k, n, &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = device::up(&fill(k, 5));
            let ws: Vec<_> = (0..copies).map(|c| device::up(&fill(nn * k, 100 + c as u64).iter().map(|v| 0x3C00u16 ^ ((v.to_bits() >> 22) as u16 & 0x03FF)).collect::<Vec<u16>>())).collect();
            let mut out = device::nan(nn);
            Timed {
                run: Box::new(move |i| {
                    let w = &ws[i % ws.len()];
                    device::ok(engine::kernels::linear_f16(device::dev(), &x.as_view(), &w.as_view(), 1, k, nn, &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapped_format_decodes_f16_one_as_bf16() {
        // binary16 1.0 is 0x3C00; read as bf16 that is 2^-7 * 1 = 0.0078125.
        assert_eq!(core(&[1.0], &[0x3C00], 1, 1, 1, Faults::default()), vec![1.0]);
        assert_eq!(core(&[1.0], &[0x3C00], 1, 1, 1, Faults { format_swapped: true }), vec![0.0078125]);
    }
}
