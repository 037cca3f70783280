//! `kernel.rotary`: rotary position embedding (Su et al. 2021, arXiv:2104.09864) over the first
//! `rotary_dim` entries of each head (partial rotary: StableLM rotates a quarter of each head,
//! the rest passes through), with the half-split pairing (j, j + rotary_dim/2) of HF's
//! `rotate_half` or the interleaved pairing (2j, 2j + 1) of the paper, GPT-J and Cohere, at
//! frequencies theta^(-2j/rotary_dim). Mutants `rotary_pairing_swapped`
//! (failure.rope-pairing-swapped), `rotary_full` (failure.partial-rotary-ignored: every entry
//! rotated) and `rotary_freq_over_head_dim` (failure.partial-rotary-ignored's frequency half:
//! exponents over head_dim instead of rotary_dim).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The other pairing: interleaved for half-split and half-split for interleaved.
    pub pairing_swapped: bool,
    /// rotary_dim ignored: the whole head rotated.
    pub full: bool,
    /// Frequencies theta^(-2j/head_dim) over the rotated entries instead of theta^(-2j/rotary_dim).
    pub freq_over_head_dim: bool,
}

/// Inverse frequencies of the rotated pairs: theta^(-2j/rotary_dim), j in 0..rotary_dim/2.
pub fn inv_freq(theta: f64, rotary_dim: usize) -> Vec<f64> {
    (0..rotary_dim / 2).map(|j| theta.powf(-2.0 * j as f64 / rotary_dim as f64)).collect()
}

/// Rotate one token's heads at `pos` in place with explicit inverse frequencies (their count is
/// half the rotated width). `x`: [n_heads, head_dim].
pub fn rotate(x: &mut [f64], pos: usize, n_heads: usize, head_dim: usize, freqs: &[f64], interleaved: bool) {
    let half = freqs.len();
    for h in 0..n_heads {
        let base = h * head_dim;
        for (j, f) in freqs.iter().enumerate() {
            let (sin, cos) = (pos as f64 * f).sin_cos();
            let (ia, ib) = if interleaved { (base + 2 * j, base + 2 * j + 1) } else { (base + j, base + j + half) };
            let (a, b) = (x[ia], x[ib]);
            x[ia] = a * cos - b * sin;
            x[ib] = a * sin + b * cos;
        }
    }
}

/// Partial rotary RoPE with `f`'s mistakes, in place. `x`: [n_tokens, n_heads, head_dim];
/// `positions`: [n_tokens]; `rotary_dim` even, at most head_dim.
#[allow(clippy::too_many_arguments)]
pub fn core(
    x: &mut [f64],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f64,
    interleaved: bool,
    f: Faults,
) {
    let rot = if f.full { head_dim } else { rotary_dim };
    let freqs: Vec<f64> = if f.freq_over_head_dim {
        (0..rot / 2).map(|j| theta.powf(-2.0 * j as f64 / head_dim as f64)).collect()
    } else {
        inv_freq(theta, rot)
    };
    let width = n_heads * head_dim;
    for (t, &pos) in positions.iter().enumerate() {
        rotate(&mut x[t * width..(t + 1) * width], pos, n_heads, head_dim, &freqs, interleaved != f.pairing_swapped);
    }
}

/// The plain oracle: each pair's angle computed where it is rotated (the property test holds
/// [`core`] to it bit for bit).
#[allow(clippy::too_many_arguments)]
pub fn plain(
    x: &mut [f64],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f64,
    interleaved: bool,
) {
    let half = rotary_dim / 2;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for j in 0..half {
                let angle = pos as f64 * theta.powf(-2.0 * j as f64 / rotary_dim as f64);
                let (sin, cos) = angle.sin_cos();
                let (ia, ib) = if interleaved { (base + 2 * j, base + 2 * j + 1) } else { (base + j, base + j + half) };
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
    let (nh, hd, rot) = (c.n("n_heads")?, c.n("head_dim")?, c.n("rotary_dim")?);
    core(&mut x, &positions(c)?, nh, hd, rot, c.x("theta")?, c.n("interleaved")? != 0, f);
    Some(Expect::Values(x))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (nt, nh) = (dim(rng, case, "n_tokens")?, dim(rng, case, "n_heads")?);
    let hd = (dim(rng, case, "head_dim")?.div_ceil(2) * 2).max(4);
    // An even share of the head, at least one pair, below the whole head unless the head is 4 wide.
    let rot = (rng.random_range(1..=hd / 2 - 1).max(1) * 2).min(hd);
    let interleaved = rng.random_bool(0.5);
    let max_pos = dim(rng, case, "max_pos")?;
    let theta: f32 = [10_000.0, 500_000.0, 1_000_000.0][rng.random_range(0..3)];
    let x = uniform(rng, nt * nh * hd, case.scale);
    let positions: Vec<u32> = (0..nt).map(|_| rng.random_range(1..=max_pos.max(1) as u32)).collect();
    let mut c = Case::new(KERNEL.id);
    c.label = format!(
        "n_tokens={nt} n_heads={nh} head_dim={hd} rotary_dim={rot} interleaved={interleaved} max_pos={max_pos} theta={theta}"
    );
    c.param("n_heads", nh);
    c.param("head_dim", hd);
    c.param("rotary_dim", rot);
    c.param("interleaved", u8::from(interleaved));
    c.param("theta", theta);
    c.input("x", Tensor::F32(x));
    c.input("positions", Tensor::U32(positions));
    Ok(c)
}

/// One token's heads read and written (f32); about 6 FLOPs per rotated element.
fn cost(dims: &Dims) -> Cost {
    let n = d(dims, "n_heads") * d(dims, "head_dim");
    Cost { bytes: 8.0 * n, flops: 6.0 * n }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.rotary",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| {
        let mut x = c.f("x")?;
        let (nh, hd, rot) = (c.n("n_heads")?, c.n("head_dim")?, c.n("rotary_dim")?);
        plain(&mut x, &positions(c)?, nh, hd, rot, c.x("theta")?, c.n("interleaved")? != 0);
        Some(Expect::Values(x))
    },
    mutants: &[
        Mutant {
            name: "rotary_pairing_swapped",
            expect: |c| eval(c, Faults { pairing_swapped: true, ..Faults::default() }),
        },
        Mutant { name: "rotary_full", expect: |c| eval(c, Faults { full: true, ..Faults::default() }) },
        Mutant {
            name: "rotary_freq_over_head_dim",
            expect: |c| eval(c, Faults { freq_over_head_dim: true, ..Faults::default() }),
        },
    ],
    cost,
    test_arm: r#"{
            let mut x = i.f("x");
            let positions: Vec<usize> = i.u("positions").iter().map(|&p| p as usize).collect();
            engine::kernels::rotary(&mut x, &positions, i.n("n_heads"), i.n("head_dim"), i.n("rotary_dim"), i.x("theta"), i.n("interleaved") != 0);
            vec![("out".into(), Out::F(x))]
        }"#,
    timed_arm: r#"{
            let (heads, hd) = (n("n_heads"), n("head_dim"));
            let mut x = fill(heads * hd, 4);
            Timed { run: Box::new(move |i| engine::kernels::rotary(&mut x, &[i % 4096], heads, hd, hd / 2, 10000.0, false)) }
        }"#,
    cuda_test_arm: "",
    cuda_timed_arm: "",
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rotary_leaves_the_rest_and_pairs_as_told() {
        // head_dim 8, rotary_dim 4, position 1, theta 1: each rotated pair turns by angle 1.
        let (s, c) = 1f64.sin_cos();
        let x0 = vec![1.0, 0.0, 0.0, 1.0, 5.0, 6.0, 7.0, 8.0];
        let mut half = x0.clone();
        core(&mut half, &[1], 1, 8, 4, 1.0, false, Faults::default());
        // Pairs (0, 2) and (1, 3).
        let want = [c, -s, s, c, 5.0, 6.0, 7.0, 8.0];
        half.iter().zip(want).for_each(|(a, b)| assert!((a - b).abs() < 1e-12, "{half:?}"));
        let mut inter = x0.clone();
        core(&mut inter, &[1], 1, 8, 4, 1.0, true, Faults::default());
        // Pairs (0, 1) and (2, 3).
        let want = [c, s, -s, c, 5.0, 6.0, 7.0, 8.0];
        inter.iter().zip(want).for_each(|(a, b)| assert!((a - b).abs() < 1e-12, "{inter:?}"));
        let mut full = x0;
        core(&mut full, &[1], 1, 8, 4, 1.0, false, Faults { full: true, ..Faults::default() });
        assert!(full[4] != 5.0, "the whole head rotated");
    }
}
