//! `kernel.rope`: rotary position embedding with rotate-half pairing (HF Llama; Su et al. 2021,
//! arXiv:2104.09864): pairs (j, j + head_dim/2) rotated by pos * theta^(-2j/head_dim).
//! Mutants `rope_adjacent` (failure.rope-adjacent-pairs) and `rope_theta_default`
//! (failure.rope-wrong-theta).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// The RoPE base many engines hard-code (the Llama 1/2 value), used by the `rope_theta_default` mutant.
pub const DEFAULT_THETA: f64 = 10_000.0;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Interleaved pairing (RoFormer paper, GPT-J, Meta's original Llama layout): pairs (2j, 2j+1)
    /// instead of (j, j + head_dim/2).
    pub adjacent: bool,
    /// theta fixed at [`DEFAULT_THETA`] whatever is passed (equal to the truth when theta = 10000).
    pub theta_default: bool,
}

/// RoPE with `f`'s mistakes, in place. `x`: [n_tokens, n_heads, head_dim]; `positions`: [n_tokens].
pub fn core(x: &mut [f64], positions: &[usize], n_heads: usize, head_dim: usize, theta: f64, f: Faults) {
    let theta = if f.theta_default { DEFAULT_THETA } else { theta };
    let half = head_dim / 2;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for j in 0..half {
                let freq = theta.powf(-2.0 * j as f64 / head_dim as f64);
                let (sin, cos) = (pos as f64 * freq).sin_cos();
                let (ia, ib) = if f.adjacent { (base + 2 * j, base + 2 * j + 1) } else { (base + j, base + j + half) };
                let (a, b) = (x[ia], x[ib]);
                x[ia] = a * cos - b * sin;
                x[ib] = a * sin + b * cos;
            }
        }
    }
}

fn positions(c: &Case) -> Option<Vec<usize>> {
    Some(c.u("positions")?.iter().map(|&p| p as usize).collect())
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let mut x = c.f("x")?;
    core(&mut x, &positions(c)?, c.n("n_heads")?, c.n("head_dim")?, c.x("theta")?, f);
    Some(Expect::Values(x))
}

fn plain(c: &Case) -> Option<Expect> {
    let mut x = c.f("x")?;
    crate::rope(&mut x, &positions(c)?, c.n("n_heads")?, c.n("head_dim")?, c.x("theta")?);
    Some(Expect::Values(x))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (nt, nh) = (dim(rng, case, "n_tokens")?, dim(rng, case, "n_heads")?);
    let hd = dim(rng, case, "head_dim")?.div_ceil(2) * 2;
    let max_pos = dim(rng, case, "max_pos")?;
    let theta: f32 = [10_000.0, 500_000.0, 1_000_000.0][rng.random_range(0..3)];
    let x = uniform(rng, nt * nh * hd, case.scale);
    let positions: Vec<u32> = (0..nt).map(|_| rng.random_range(0..=max_pos as u32)).collect();
    let mut c = Case::new(KERNEL.id);
    c.label = format!("n_tokens={nt} n_heads={nh} head_dim={hd} max_pos={max_pos} theta={theta}");
    c.param("n_heads", nh);
    c.param("head_dim", hd);
    c.param("theta", theta);
    c.input("x", Tensor::F32(x));
    c.input("positions", Tensor::U32(positions));
    Ok(c)
}

/// One token's heads read and written (f32); about 6 FLOPs per element.
fn cost(dims: &Dims) -> Cost {
    let n = d(dims, "n_heads") * d(dims, "head_dim");
    Cost { bytes: 8.0 * n, flops: 6.0 * n }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.rope",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain,
    mutants: &[
        Mutant { name: "rope_adjacent", expect: |c| eval(c, Faults { adjacent: true, ..Faults::default() }) },
        Mutant { name: "rope_theta_default", expect: |c| eval(c, Faults { theta_default: true, ..Faults::default() }) },
    ],
    cost,
    test_arm: r#"{
            let mut x = i.f("x");
            let positions: Vec<usize> = i.u("positions").iter().map(|&p| p as usize).collect();
            engine::kernels::rope(&mut x, &positions, i.n("n_heads"), i.n("head_dim"), i.x("theta"));
            vec![("out".into(), Out::F(x))]
        }"#,
    timed_arm: r#"{
            let (heads, hd) = (n("n_heads"), n("head_dim"));
            let mut x = fill(heads * hd, 4);
            Timed { run: Box::new(move |i| engine::kernels::rope(&mut x, &[i % 4096], heads, hd, 10000.0)) }
        }"#,
    cuda_test_arm: r#"{
            let mut x = device::up(&i.f("x"));
            let positions = device::up(&i.u("positions"));
            device::ok(engine::kernels::rope(device::dev(), &mut x.as_view_mut(), &positions.as_view(), i.n("n_heads"), i.n("head_dim"), i.x("theta")));
            vec![("out".into(), Out::F(device::down(&x)))]
        }"#,
    cuda_timed_arm: r#"{
            let (heads, hd) = (n("n_heads"), n("head_dim"));
            let mut x = device::up(&fill(heads * hd, 4));
            let positions: Vec<_> = (0..64u32).map(|p| device::up(&[p * 61 % 4096])).collect();
            Timed {
                run: Box::new(move |i| {
                    let pos = &positions[i % positions.len()];
                    device::ok(engine::kernels::rope(device::dev(), &mut x.as_view_mut(), &pos.as_view(), heads, hd, 10000.0))
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
    fn adjacent_pairs_neighbours() {
        // head_dim 4, position 1, theta 1: every pair rotates by angle 1.
        let (s, c) = 1f64.sin_cos();
        let mut x = vec![1.0, 0.0, 0.0, 1.0];
        core(&mut x, &[1], 1, 4, 1.0, Faults { adjacent: true, ..Faults::default() });
        close(&x, &[c, s, -s, c]);
        // The true pairing is (0,2) and (1,3).
        let mut y = vec![1.0, 0.0, 0.0, 1.0];
        core(&mut y, &[1], 1, 4, 1.0, Faults::default());
        close(&y, &[c, -s, s, c]);
    }

    #[test]
    fn theta_default_ignores_theta() {
        let x0: Vec<f64> = (0..8).map(|i| i as f64 * 0.1 - 0.3).collect();
        let (mut a, mut b, mut c) = (x0.clone(), x0.clone(), x0);
        core(&mut a, &[7], 1, 8, 500_000.0, Faults { theta_default: true, ..Faults::default() });
        core(&mut b, &[7], 1, 8, 10_000.0, Faults::default());
        close(&a, &b);
        core(&mut c, &[7], 1, 8, 500_000.0, Faults::default());
        assert!(a.iter().zip(&c).any(|(p, q)| (p - q).abs() > 1e-3));
    }
}
