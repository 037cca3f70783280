//! `kernel.linear_bf16`: `y = x W^T` with bfloat16 weights widened exactly to f32 and f32
//! accumulation. Mutants `half_format_swapped` (failure.half-format-swapped: the bits decoded as IEEE
//! binary16) and `bf16_accumulation` (failure.bf16-accumulation: the running sum rounded to bf16
//! after every multiply-add).

use rand_chacha::ChaCha8Rng;

use super::linear::{self, cost_at, draw_mkn, mkn};
use super::{Case, Expect, Kernel, Mutant, Tensor};
use crate::dtypes::{bf16_value, round_bf16, widen_bf16, widen_f16};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// bf16 bits read as IEEE binary16.
    pub format_swapped: bool,
    /// The running sum rounded to bf16 (nearest even) after every multiply-add, as a kernel that
    /// accumulates in the weight type does.
    pub accumulate_bf16: bool,
}

/// The product with `f`'s mistakes. `x`: [m, k]; `w`: [n, k] bf16 bits; returns [m, n].
pub fn core(x: &[f64], w: &[u16], m: usize, k: usize, n: usize, f: Faults) -> Vec<f64> {
    if f.accumulate_bf16 {
        let mut out = Vec::with_capacity(m * n);
        for i in 0..m {
            for o in 0..n {
                let mut acc = 0.0f64;
                for c in 0..k {
                    acc = bf16_value(round_bf16((acc + x[i * k + c] * bf16_value(w[o * k + c])) as f32));
                }
                out.push(acc);
            }
        }
        return out;
    }
    let wide = if f.format_swapped { widen_f16(w) } else { widen_bf16(w) };
    linear::core(x, &wide, m, k, n, linear::Faults::default())
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let (m, k, n) = mkn(c)?;
    Some(Expect::Values(core(&c.f("x")?, c.half("w")?.0, m, k, n, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (mut c, w) = draw_mkn(KERNEL.id, case, rng)?;
    c.input("w", Tensor::Bf16(w.iter().map(|&v| round_bf16(v)).collect()));
    Ok(c)
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.linear_bf16",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let (m, k, n) = mkn(c)?;
        Some(Expect::Values(crate::linear(&c.f("x")?, &widen_bf16(c.half("w")?.0), m, k, n)))
    },
    mutants: &[
        Mutant {
            name: "half_format_swapped",
            expect: |c| eval(c, Faults { format_swapped: true, ..Faults::default() }),
        },
        Mutant {
            name: "bf16_accumulation",
            expect: |c| eval(c, Faults { accumulate_bf16: true, ..Faults::default() }),
        },
    ],
    cost: |dims| cost_at(dims, 2.0, 0.0),
    test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let mut out = nan(m * n);
            engine::kernels::linear_bf16(&i.f("x"), &i.h("w"), m, k, n, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = fill(k, 5);
            let ws: Vec<Vec<u16>> = (0..copies)
                .map(|c| fill(nn * k, 100 + c as u64).iter().map(|v| (v.to_bits() >> 16) as u16).collect())
                .collect();
            let mut out = vec![0.0f32; nn];
            Timed { run: Box::new(move |i| engine::kernels::linear_bf16(&x, &ws[i % ws.len()], 1, k, nn, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let (x, w) = (device::up(&i.f("x")), device::up(&i.h("w")));
            let mut out = device::nan(m * n);
            device::ok(engine::kernels::linear_bf16(device::dev(), &x.as_view(), &w.as_view(), m, k, n, &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = device::up(&fill(k, 5));
            let ws: Vec<_> = (0..copies).map(|c| device::up(&fill(nn * k, 100 + c as u64).iter().map(|v| (v.to_bits() >> 16) as u16).collect::<Vec<u16>>())).collect();
            let mut out = device::nan(nn);
            Timed {
                run: Box::new(move |i| {
                    let w = &ws[i % ws.len()];
                    device::ok(engine::kernels::linear_bf16(device::dev(), &x.as_view(), &w.as_view(), 1, k, nn, &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulation_in_bf16_loses_small_terms() {
        // 256 + 1: 257 is not a bf16 value (8 significant bits); round to nearest even gives 256.
        let w = [round_bf16(1.0), round_bf16(1.0)];
        assert_eq!(core(&[256.0, 1.0], &w, 1, 2, 1, Faults::default()), vec![257.0]);
        assert_eq!(
            core(&[256.0, 1.0], &w, 1, 2, 1, Faults { accumulate_bf16: true, ..Faults::default() }),
            vec![256.0]
        );
    }

    #[test]
    fn swapped_format_decodes_bf16_one_as_f16() {
        // bf16 1.0 is 0x3F80; read as binary16 that is 1.875.
        let w = [0x3F80u16];
        assert_eq!(core(&[1.0], &w, 1, 1, 1, Faults { format_swapped: true, ..Faults::default() }), vec![1.875]);
    }
}
