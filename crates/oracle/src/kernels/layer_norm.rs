//! `kernel.layer_norm`: LayerNorm (Ba, Kiros & Hinton 2016, arXiv:1607.06450) over rows,
//! `y = (x - mean) / sqrt(var + eps) * w + b` with the biased variance, the gain and the bias each
//! optional (StableLM and StarCoder2: both; Cohere: gain only; OLMo: neither, non-parametric).
//! Mutants `layernorm_no_mean` (failure.layernorm-mean-not-subtracted: the mean left in, an RMSNorm
//! in place of a LayerNorm) and `layernorm_bias_dropped` (failure.layernorm-bias-dropped).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// The row mean not subtracted: x / sqrt(mean(x^2) + eps) (an RMSNorm).
    pub no_mean: bool,
    /// The bias never added.
    pub no_bias: bool,
}

/// LayerNorm with `f`'s mistakes over rows of `dim` entries; `weight` and `bias` are [dim] or
/// empty (absent). `x`: [rows, dim] -> [rows, dim].
pub fn core(x: &[f64], dim: usize, weight: &[f64], bias: &[f64], eps: f64, f: Faults) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim.max(1)) {
        let mean = if f.no_mean { 0.0 } else { row.iter().sum::<f64>() / dim as f64 };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for (i, v) in row.iter().enumerate() {
            let mut y = (v - mean) * inv;
            if let Some(w) = weight.get(i) {
                y *= w;
            }
            if let (false, Some(b)) = (f.no_bias, bias.get(i)) {
                y += b;
            }
            out.push(y);
        }
    }
    out
}

/// The plain oracle: mean, biased variance, normalise, gain, bias, written out once more without
/// faults (the property test holds [`core`] to it bit for bit).
pub fn plain(x: &[f64], dim: usize, weight: &[f64], bias: &[f64], eps: f64) -> Vec<f64> {
    x.chunks_exact(dim.max(1))
        .flat_map(|row| {
            let mean = row.iter().sum::<f64>() / dim as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (var + eps).sqrt();
            row.iter().enumerate().map(move |(i, v)| {
                let y = (v - mean) * inv;
                let y = if weight.is_empty() { y } else { y * weight[i] };
                if bias.is_empty() { y } else { y + bias[i] }
            })
        })
        .collect()
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    Some(Expect::Values(core(&c.f("x")?, c.n("dim")?, &c.f("weight")?, &c.f("bias")?, c.x("eps")?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (rows, dm) = (dim(rng, case, "rows")?, dim(rng, case, "dim")?.max(2));
    // Rows with a mean far from zero, so that leaving the mean in is seen.
    let shift = case.scale * rng.random_range(-2.0..2.0);
    let x: Vec<f32> = uniform(rng, rows * dm, case.scale).iter().map(|v| (*v as f64 + shift) as f32).collect();
    // Gain and bias each present or absent (an empty tensor), as the families differ.
    let (with_w, with_b) = (rng.random_bool(0.75), rng.random_bool(0.5));
    let weight: Vec<f32> = if with_w { (0..dm).map(|_| rng.random_range(0.5..1.5)).collect() } else { vec![] };
    let bias: Vec<f32> = if with_b { uniform(rng, dm, 0.5) } else { vec![] };
    let eps: f32 = [1e-5, 1e-6, 1e-2][rng.random_range(0..3)];
    let mut c = Case::new(KERNEL.id);
    c.label = format!("rows={rows} dim={dm} eps={eps:e} gain={with_w} bias={with_b}");
    c.param("dim", dm);
    c.param("eps", format!("{eps:e}"));
    c.input("x", Tensor::F32(x));
    c.input("weight", Tensor::F32(weight));
    c.input("bias", Tensor::F32(bias));
    Ok(c)
}

/// One row: x, gain and bias read, y written (f32); about 8 FLOPs per element.
fn cost(dims: &Dims) -> Cost {
    Cost { bytes: 16.0 * d(dims, "dim"), flops: 8.0 * d(dims, "dim") }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.layer_norm",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(plain(&c.f("x")?, c.n("dim")?, &c.f("weight")?, &c.f("bias")?, c.x("eps")?))),
    mutants: &[
        Mutant { name: "layernorm_no_mean", expect: |c| eval(c, Faults { no_mean: true, ..Faults::default() }) },
        Mutant { name: "layernorm_no_bias", expect: |c| eval(c, Faults { no_bias: true, ..Faults::default() }) },
    ],
    cost,
    test_arm: r#"{
            let x = i.f("x");
            let mut out = nan(x.len());
            engine::kernels::layer_norm(&x, i.n("dim"), &i.f("weight"), &i.f("bias"), i.x("eps"), &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let dim = n("dim");
            let (x, w, b) = (fill(dim, 2), fill(dim, 3), fill(dim, 4));
            let mut out = vec![0.0f32; dim];
            Timed { run: Box::new(move |_| engine::kernels::layer_norm(&x, dim, &w, &b, 1e-5, &mut out)) }
        }"#,
    cuda_test_arm: "",
    cuda_timed_arm: "",
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_hand() {
        // Row [1, 3]: mean 2, variance 1; eps 0.
        let none = Faults::default();
        assert_eq!(core(&[1.0, 3.0], 2, &[], &[], 0.0, none), vec![-1.0, 1.0]);
        assert_eq!(core(&[1.0, 3.0], 2, &[2.0, 3.0], &[0.5, -0.5], 0.0, none), vec![-1.5, 2.5]);
        // Without the mean: x / rms, rms = sqrt(5).
        let r = 5f64.sqrt();
        assert_eq!(core(&[1.0, 3.0], 2, &[], &[], 0.0, Faults { no_mean: true, ..none }), vec![1.0 / r, 3.0 / r]);
        assert_eq!(
            core(&[1.0, 3.0], 2, &[2.0, 3.0], &[0.5, -0.5], 0.0, Faults { no_bias: true, ..none }),
            vec![-2.0, 3.0]
        );
    }
}
