//! `kernel.embedding`: rows of the embedding table for a list of token ids.
//! Mutant `embedding_off_by_one` (failure.embedding-wrong-row).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Row ids[i] + 1 instead of ids[i] (the last id wraps to row 0, so the mutant is defined
    /// everywhere; an engine making this mistake usually panics or reads past the table there).
    pub off_by_one: bool,
}

/// Embedding lookup with `f`'s mistakes. `table`: [vocab, dim]; `ids`: [n]; returns [n, dim].
///
/// # Panics
/// When an id is outside the table (callers draw ids within the vocabulary).
pub fn core(table: &[f64], dim: usize, ids: &[u32], f: Faults) -> Vec<f64> {
    let vocab = table.len() / dim.max(1);
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &id in ids {
        let id = if f.off_by_one { (id as usize + 1) % vocab.max(1) } else { id as usize };
        out.extend_from_slice(&table[id * dim..(id + 1) * dim]);
    }
    out
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let dim = c.n("dim").filter(|&d| d > 0)?;
    Some(Expect::Values(core(&c.f("table")?, dim, c.u("ids")?, f)))
}

fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let (vocab, dm, n) = (dim(rng, case, "vocab")?, dim(rng, case, "dim")?, dim(rng, case, "n")?);
    let table = uniform(rng, vocab * dm, case.scale);
    let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let mut c = Case::new(KERNEL.id);
    c.label = format!("vocab={vocab} dim={dm} n={n}");
    c.param("dim", dm);
    c.input("table", Tensor::F32(table));
    c.input("ids", Tensor::U32(ids));
    Ok(c)
}

/// One row of `dim` read (at `weight_bytes` per element, 4 when absent) and written as f32.
fn cost(dims: &Dims) -> Cost {
    let wb = dims.get("weight_bytes").map(|&b| b as f64).unwrap_or(4.0);
    Cost { bytes: d(dims, "dim") * (wb + 4.0), flops: 0.0 }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.embedding",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain: |c| Some(Expect::Values(crate::embedding(&c.f("table")?, c.n("dim")?, c.u("ids")?))),
    mutants: &[Mutant { name: "embedding_off_by_one", expect: |c| eval(c, Faults { off_by_one: true }) }],
    cost,
    test_arm: r#"{
            let (dim, ids) = (i.n("dim"), i.u("ids"));
            let mut out = nan(ids.len() * dim);
            engine::kernels::embedding(&i.f("table"), dim, &ids, &mut out);
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (vocab, dim) = (n("vocab"), n("dim"));
            let table = fill(vocab * dim, 1);
            let mut out = vec![0.0f32; dim];
            Timed { run: Box::new(move |i| engine::kernels::embedding(&table, dim, &[(i % vocab) as u32], &mut out)) }
        }"#,
    cuda_test_arm: r#"{
            let (dim, ids) = (i.n("dim"), i.u("ids"));
            let (table, ids_d) = (device::up(&i.f("table")), device::up(&ids));
            let mut out = device::nan(ids.len() * dim);
            device::ok(engine::kernels::embedding(device::dev(), &table.as_view(), dim, &ids_d.as_view(), &mut out.as_view_mut()));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (vocab, dim) = (n("vocab"), n("dim"));
            let table = device::up(&fill(vocab * dim, 1));
            let ids: Vec<_> = (0..64u32).map(|t| device::up(&[t % vocab as u32])).collect();
            let mut out = device::nan(dim);
            Timed {
                run: Box::new(move |i| {
                    let id = &ids[i % ids.len()];
                    device::ok(engine::kernels::embedding(device::dev(), &table.as_view(), dim, &id.as_view(), &mut out.as_view_mut()))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_one_reads_the_next_row() {
        let table = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5];
        let ids = [0, 2, 1];
        assert_eq!(core(&table, 2, &ids, Faults::default()), vec![0.0, 0.5, 2.0, 2.5, 1.0, 1.5]);
        assert_eq!(core(&table, 2, &ids, Faults { off_by_one: true }), vec![1.0, 1.5, 0.0, 0.5, 2.0, 2.5]);
    }
}
