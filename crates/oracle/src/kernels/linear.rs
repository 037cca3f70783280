//! `kernel.linear`: `y = x W^T` with f32 weights. `x`: [m, k]; `w`: [n, k] (PyTorch's nn.Linear
//! layout, as safetensors checkpoints store it); `y`: [m, n]. Mutant `linear_xw`
//! (failure.linear-transposed). The weight-dtype variants (`linear_bf16`, `linear_f16`,
//! `linear_int8`) reuse this module's core, draw and cost.

use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The [n, k] weight buffer read as [k, n] (a textbook `x W` without the transpose):
    /// `y[i, j] = sum_p x[i, p] w[p n + j]`; defined for every shape since the buffer holds k n values.
    pub xw: bool,
}

/// `x W^T` with `f`'s mistakes. `x`: [m, k]; `w`: [n, k]; returns [m, n].
///
/// Each output is one dot product summed in order over `k`, so the result does not depend on how
/// the work is split: a row of at least [`PARALLEL_MACS`] multiply-adds (`n k`) splits its `n`
/// outputs over the machine's cores (`std::thread::available_parallelism`), the same sums in the
/// same order (the 1B-shape replays of profile and verify are dominated by such rows).
pub fn core(x: &[f64], w: &[f64], m: usize, k: usize, n: usize, f: Faults) -> Vec<f64> {
    let threads = if n * k >= PARALLEL_MACS { std::thread::available_parallelism().map_or(1, |t| t.get()) } else { 1 };
    core_split(x, w, m, k, n, f, threads)
}

/// [`core`] with each row's outputs split over `threads` threads (1: serially).
fn core_split(x: &[f64], w: &[f64], m: usize, k: usize, n: usize, f: Faults, threads: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    let dot = |i: usize, j: usize| -> f64 {
        if f.xw {
            (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum()
        } else {
            (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum()
        }
    };
    let threads = threads.min(n);
    if threads < 2 {
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = dot(i, j);
            }
        }
        return out;
    }
    let per = n.div_ceil(threads);
    for (i, row) in out.chunks_mut(n).enumerate() {
        std::thread::scope(|s| {
            for (c, part) in row.chunks_mut(per).enumerate() {
                s.spawn(move || {
                    for (o, v) in part.iter_mut().enumerate() {
                        *v = dot(i, c * per + o);
                    }
                });
            }
        });
    }
    out
}

/// Multiply-adds of one row from which [`core`] splits its outputs over threads: about a
/// millisecond of work in f64, against tens of microseconds to start a thread.
pub const PARALLEL_MACS: usize = 1 << 20;

/// The dims `m`, `k`, `n` of a case.
pub fn mkn(c: &Case) -> Option<(usize, usize, usize)> {
    Some((c.n("m")?, c.n("k")?, c.n("n")?))
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let (m, k, n) = mkn(c)?;
    Some(Expect::Values(core(&c.f("x")?, &c.f("w")?, m, k, n, f)))
}

/// Draw m, k, n, the activations `x` (at the case's scale) and f32 weights in [-1, 1); the case
/// gets `x` and the dims, the caller adds the weights in its own storage.
pub fn draw_mkn(kernel: &'static str, case: &TestCase, rng: &mut ChaCha8Rng) -> Result<(Case, Vec<f32>)> {
    let (m, k, n) = (dim(rng, case, "m")?, dim(rng, case, "k")?, dim(rng, case, "n")?);
    let x = uniform(rng, m * k, case.scale);
    let w = uniform(rng, n * k, 1.0);
    let mut c = Case::new(kernel);
    c.label = format!("m={m} k={k} n={n}");
    for (key, v) in [("m", m), ("k", k), ("n", n)] {
        c.param(key, v);
    }
    c.input("x", Tensor::F32(x));
    Ok((c, w))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (mut c, w) = draw_mkn(KERNEL.id, case, rng)?;
    c.input("w", Tensor::F32(w));
    Ok(c)
}

/// One matrix-vector product at `bytes_per_weight` per stored weight plus `scale_bytes` per row:
/// weights read once, x read and y written as f32; one multiply-add per weight.
pub fn cost_at(dims: &Dims, bytes_per_weight: f64, scale_bytes: f64) -> Cost {
    let (k, n) = (d(dims, "k"), d(dims, "n"));
    Cost { bytes: n * k * bytes_per_weight + n * scale_bytes + 4.0 * (k + n), flops: 2.0 * n * k }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.linear",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let (m, k, n) = mkn(c)?;
        Some(Expect::Values(crate::linear(&c.f("x")?, &c.f("w")?, m, k, n)))
    },
    mutants: &[Mutant { name: "linear_xw", expect: |c| eval(c, Faults { xw: true }) }],
    cost: |dims| cost_at(dims, 4.0, 0.0),
    test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let mut out = nan(m * n);
            engine::kernels::linear(&i.f("x"), &i.f("w"), m, k, n, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = fill(k, 5);
            let ws: Vec<Vec<f32>> = (0..copies).map(|c| fill(nn * k, 100 + c as u64)).collect();
            let mut out = vec![0.0f32; nn];
            Timed { run: Box::new(move |i| engine::kernels::linear(&x, &ws[i % ws.len()], 1, k, nn, &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let (m, k, n) = (i.n("m"), i.n("k"), i.n("n"));
            let (x, w) = (device::up(&i.f("x")), device::up(&i.f("w")));
            let mut out = device::nan(m * n);
            device::ok(engine::kernels::linear(device::dev(), &x.as_view(), &w.as_view(), m, k, n, &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (k, nn) = (n("k"), n("n"));
            let x = device::up(&fill(k, 5));
            let ws: Vec<_> = (0..copies).map(|c| device::up(&fill(nn * k, 100 + c as u64))).collect();
            let mut out = device::nan(nn);
            Timed {
                run: Box::new(move |i| {
                    let w = &ws[i % ws.len()];
                    device::ok(engine::kernels::linear(device::dev(), &x.as_view(), &w.as_view(), 1, k, nn, &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// A product split over 3 threads (whatever this machine has) gives the serial sums bit for
    /// bit (each output one dot product in order over k), both ways of reading the weights.
    #[test]
    fn a_split_product_is_the_serial_one_bit_for_bit() {
        let (m, k, n) = (2, 64, 70);
        let x: Vec<f64> = (0..m * k).map(|i| ((i * 7919) % 1009) as f64 / 1009.0 - 0.5).collect();
        let w: Vec<f64> = (0..n * k).map(|i| ((i * 104_729) % 2003) as f64 / 2003.0 - 0.5).collect();
        for xw in [false, true] {
            let got = core_split(&x, &w, m, k, n, Faults { xw }, 3);
            for i in 0..m {
                for j in 0..n {
                    let mut want = 0.0;
                    for p in 0..k {
                        want += x[i * k + p] * if xw { w[p * n + j] } else { w[j * k + p] };
                    }
                    assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "row {i} column {j}, xw {xw}");
                }
            }
        }
    }

    #[test]
    fn xw_reads_k_major() {
        // x [1, 2] = [1, 2]; w buffer [1..6] with k = 2, n = 3.
        // True (w as [n=3, k=2]): [1+4, 3+8, 5+12]; mutant (w as [k=2, n=3]): [1+8, 2+10, 3+12].
        let (x, w) = ([1.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(core(&x, &w, 1, 2, 3, Faults::default()), vec![5.0, 11.0, 17.0]);
        assert_eq!(core(&x, &w, 1, 2, 3, Faults { xw: true }), vec![9.0, 12.0, 15.0]);
    }
}
