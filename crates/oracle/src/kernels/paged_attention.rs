//! `kernel.paged_attention`: causal grouped-query attention of several sequences at once, each
//! with its own number of new queries, over a paged KV cache addressed through a block table
//! (Kwon et al. 2023, PagedAttention, arXiv:2309.06180). Position t of sequence s lives in physical
//! block `block_table[s][t / block_size]`, slot `t % block_size`; query i of s sits at position
//! `context_len[s] - n_q[s] + i`. Per sequence it is exactly `kernel.attention` on the gathered
//! cache rows. Mutants `paged_block_table_ignored` (failure.paged-block-table-ignored),
//! `paged_reads_past_context` (failure.paged-reads-past-context), `paged_query_offset_zero`
//! (failure.paged-query-offset).

use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::{Case, Cost, Dims, Expect, Kernel, Mutant, Tensor, d, dim, uniform};
use crate::AttnShape;
use base::error::Result;
use ckb::TestCase;

/// Which mistakes [`core`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Logical block b is read as physical block b (the block table is not consulted).
    pub block_table_ignored: bool,
    /// The context is taken as every slot of the sequence's blocks (rounded up to a whole block),
    /// so unwritten slots of the last block are attended to and the queries sit at the wrong end.
    pub reads_past_context: bool,
    /// Query i sits at position i, as if the new tokens began the sequence (chunked prefill and
    /// decode then see only the first positions).
    pub query_offset_zero: bool,
}

/// Sizes of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Length of one head.
    pub head_dim: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Entries per row of the block table.
    pub blocks_per_seq: usize,
    /// Offsets of each sequence's queries in `q` (length n_seqs + 1).
    pub query_start: Vec<usize>,
    /// Cached positions of each sequence, its new tokens included.
    pub context_lens: Vec<usize>,
}

/// The rows 0..len of sequence `s` gathered from the paged cache `cache` ([num_blocks, block_size,
/// n_kv_heads, head_dim]) through `table` (its block-table row), or through logical = physical
/// blocks when `ignore_table`. None when an index falls outside the cache or the table.
fn gather(cache: &[f64], table: &[u32], b: &Batch, len: usize, ignore_table: bool) -> Option<Vec<f64>> {
    let row = b.n_kv_heads * b.head_dim;
    let mut out = Vec::with_capacity(len * row);
    for t in 0..len {
        let logical = t / b.block_size;
        let block = if ignore_table { logical } else { *table.get(logical)? as usize };
        let start = (block * b.block_size + t % b.block_size) * row;
        out.extend_from_slice(cache.get(start..start + row)?);
    }
    Some(out)
}

/// Paged attention with `f`'s mistakes. `q`: [total_q, n_heads, head_dim]; `k_cache`, `v_cache`:
/// [num_blocks, block_size, n_kv_heads, head_dim]; `block_table`: [n_seqs, blocks_per_seq]; returns
/// [total_q, n_heads, head_dim]. None when the batch addresses outside its buffers.
pub fn core(
    q: &[f64],
    k_cache: &[f64],
    v_cache: &[f64],
    block_table: &[u32],
    b: &Batch,
    f: Faults,
) -> Option<Vec<f64>> {
    let width = b.n_heads * b.head_dim;
    let mut out = Vec::with_capacity(q.len());
    for (s, &ctx) in b.context_lens.iter().enumerate() {
        let (q0, q1) = (*b.query_start.get(s)?, *b.query_start.get(s + 1)?);
        let n_q = q1.checked_sub(q0)?;
        if n_q == 0 || n_q > ctx {
            return None;
        }
        let table = block_table.get(s * b.blocks_per_seq..(s + 1) * b.blocks_per_seq)?;
        let len = if f.reads_past_context {
            ctx.div_ceil(b.block_size) * b.block_size
        } else if f.query_offset_zero {
            n_q
        } else {
            ctx
        };
        let k = gather(k_cache, table, b, len, f.block_table_ignored)?;
        let v = gather(v_cache, table, b, len, f.block_table_ignored)?;
        let shape = AttnShape { n_q, kv_len: len, n_heads: b.n_heads, n_kv_heads: b.n_kv_heads, head_dim: b.head_dim };
        let qs = q.get(q0 * width..q1 * width)?;
        out.extend(super::attention::core(qs, &k, &v, shape, super::attention::Faults::default()));
    }
    Some(out)
}

/// The sizes of a case, checked for consistency.
pub fn batch(c: &Case) -> Option<Batch> {
    let b = Batch {
        n_heads: c.n("n_heads")?,
        n_kv_heads: c.n("n_kv_heads")?,
        head_dim: c.n("head_dim")?,
        block_size: c.n("block_size")?,
        blocks_per_seq: c.n("blocks_per_seq")?,
        query_start: c.u("query_start")?.iter().map(|&x| x as usize).collect(),
        context_lens: c.u("context_lens")?.iter().map(|&x| x as usize).collect(),
    };
    (b.n_kv_heads > 0
        && b.n_heads.is_multiple_of(b.n_kv_heads)
        && b.block_size > 0
        && b.query_start.len() == b.context_lens.len() + 1)
        .then_some(b)
}

fn eval(c: &Case, f: Faults) -> Option<Expect> {
    let b = batch(c)?;
    core(&c.f("q")?, &c.f("k_cache")?, &c.f("v_cache")?, c.u("block_table")?, &b, f).map(Expect::Values)
}

/// Per sequence: the plain attention oracle on the rows gathered through the block table.
fn plain(c: &Case) -> Option<Expect> {
    let b = batch(c)?;
    let (q, kc, vc, table) = (c.f("q")?, c.f("k_cache")?, c.f("v_cache")?, c.u("block_table")?);
    let width = b.n_heads * b.head_dim;
    let mut out = Vec::new();
    for (s, &ctx) in b.context_lens.iter().enumerate() {
        let (q0, q1) = (b.query_start[s], b.query_start[s + 1]);
        let row = table.get(s * b.blocks_per_seq..(s + 1) * b.blocks_per_seq)?;
        let (k, v) = (gather(&kc, row, &b, ctx, false)?, gather(&vc, row, &b, ctx, false)?);
        let shape =
            AttnShape { n_q: q1 - q0, kv_len: ctx, n_heads: b.n_heads, n_kv_heads: b.n_kv_heads, head_dim: b.head_dim };
        out.extend(crate::attention(q.get(q0 * width..q1 * width)?, &k, &v, shape));
    }
    Some(Expect::Values(out))
}

/// Sequences with drawn context lengths and new-query counts; physical blocks handed out in a
/// random order from a pool with spare blocks, so the block table is never the identity; every
/// slot, written or not, holds finite random values (reading an unwritten slot changes the result).
/// Unused block-table entries are `u32::MAX`.
fn draw(case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Case> {
    let n_seqs = dim(rng, case, "n_seqs")?.max(1);
    let bs = dim(rng, case, "block_size")?.max(1);
    let (nkv, group, hd) = (dim(rng, case, "n_kv_heads")?, dim(rng, case, "group")?, dim(rng, case, "head_dim")?);
    let nh = nkv * group;
    let mut ctx = Vec::new();
    let mut n_q = Vec::new();
    for _ in 0..n_seqs {
        let c = dim(rng, case, "context")?.max(1);
        ctx.push(c);
        n_q.push(dim(rng, case, "n_q")?.clamp(1, c));
    }
    let need: Vec<usize> = ctx.iter().map(|c| c.div_ceil(bs)).collect();
    let bps = *need.iter().max().expect("at least one sequence");
    let spare = dim(rng, case, "spare_blocks")?;
    let num_blocks = need.iter().sum::<usize>().max(bps) + spare;
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    pool.shuffle(rng);
    let mut table = vec![u32::MAX; n_seqs * bps];
    let mut next = 0;
    for (s, &n) in need.iter().enumerate() {
        table[s * bps..s * bps + n].copy_from_slice(&pool[next..next + n]);
        next += n;
    }
    let mut query_start = vec![0u32];
    for &n in &n_q {
        query_start.push(query_start.last().copied().unwrap_or(0) + n as u32);
    }
    let total_q = *query_start.last().expect("non-empty") as usize;
    let slots = num_blocks * bs * nkv * hd;
    let mut c = Case::new(KERNEL.id);
    c.label = format!(
        "n_seqs={n_seqs} context={ctx:?} n_q={n_q:?} block_size={bs} num_blocks={num_blocks} n_heads={nh} n_kv_heads={nkv} head_dim={hd}"
    );
    for (key, val) in
        [("n_heads", nh), ("n_kv_heads", nkv), ("head_dim", hd), ("block_size", bs), ("blocks_per_seq", bps)]
    {
        c.param(key, val);
    }
    c.input("q", Tensor::F32(uniform(rng, total_q * nh * hd, case.scale)));
    c.input("k_cache", Tensor::F32(uniform(rng, slots, case.scale)));
    c.input("v_cache", Tensor::F32(uniform(rng, slots, 1.0)));
    c.input("block_table", Tensor::U32(table));
    c.input("query_start", Tensor::U32(query_start));
    c.input("context_lens", Tensor::U32(ctx.iter().map(|&x| x as u32).collect()));
    Ok(c)
}

/// A decode step of n_seqs sequences of kv_len positions each: K and V rows read once per
/// sequence, q read and out written; 4 n_heads kv_len head_dim FLOPs per sequence.
fn cost(dims: &Dims) -> Cost {
    let (n, kv_len, nh, nkv, hd) =
        (d(dims, "n_seqs").max(1.0), d(dims, "kv_len"), d(dims, "n_heads"), d(dims, "n_kv_heads"), d(dims, "head_dim"));
    Cost { bytes: n * (8.0 * kv_len * nkv * hd + 8.0 * nh * hd), flops: n * 4.0 * nh * kv_len * hd }
}

/// The registry entry.
pub static KERNEL: Kernel = Kernel {
    id: "kernel.paged_attention",
    draw,
    oracle: |c| eval(c, Faults::default()),
    plain,
    mutants: &[
        Mutant {
            name: "paged_block_table_ignored",
            expect: |c| eval(c, Faults { block_table_ignored: true, ..Faults::default() }),
        },
        Mutant {
            name: "paged_reads_past_context",
            expect: |c| eval(c, Faults { reads_past_context: true, ..Faults::default() }),
        },
        Mutant {
            name: "paged_query_offset_zero",
            expect: |c| eval(c, Faults { query_offset_zero: true, ..Faults::default() }),
        },
    ],
    cost,
    test_arm: r#"{
            let q = i.f("q");
            let mut out = nan(q.len());
            engine::kernels::paged_attention(
                &q,
                &i.f("k_cache"),
                &i.f("v_cache"),
                &i.u("block_table"),
                i.n("blocks_per_seq"),
                &i.u("query_start"),
                &i.u("context_lens"),
                i.n("n_heads"),
                i.n("n_kv_heads"),
                i.n("head_dim"),
                i.n("block_size"),
                &mut out,
            );
            vec![("out".into(), Out::F(out))]
        }"#,
    timed_arm: r#"{
            let (seqs, kv_len, heads, kvh, hd) = (n("n_seqs").max(1), n("kv_len"), n("n_heads"), n("n_kv_heads"), n("head_dim"));
            let bs = n("block_size").max(1);
            let bps = kv_len.div_ceil(bs).max(1);
            let blocks = seqs * bps;
            // Sequence s owns blocks s, s + seqs, s + 2 seqs, ...: interleaved, as a pool hands them out.
            let table: Vec<u32> = (0..seqs).flat_map(|s| (0..bps).map(move |b| (b * seqs + s) as u32)).collect();
            let starts: Vec<u32> = (0..=seqs as u32).collect();
            let lens = vec![kv_len as u32; seqs];
            let q = fill(seqs * heads * hd, 9);
            let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..copies)
                .map(|c| (fill(blocks * bs * kvh * hd, 200 + c as u64), fill(blocks * bs * kvh * hd, 300 + c as u64)))
                .collect();
            let mut out = vec![0.0f32; seqs * heads * hd];
            Timed {
                run: Box::new(move |i| {
                    let (k, v) = &caches[i % caches.len()];
                    engine::kernels::paged_attention(&q, k, v, &table, bps, &starts, &lens, heads, kvh, hd, bs, &mut out)
                }),
            }
        }"#,
    cuda_test_arm: r#"{
            let q = i.f("q");
            let (qd, k, v) = (device::up(&q), device::up(&i.f("k_cache")), device::up(&i.f("v_cache")));
            let (table, starts, lens) = (device::up(&i.u("block_table")), device::up(&i.u("query_start")), device::up(&i.u("context_lens")));
            let mut out = device::nan(q.len());
            device::ok(engine::kernels::paged_attention(
                device::dev(),
                &qd.as_view(),
                &k.as_view(),
                &v.as_view(),
                &table.as_view(),
                i.n("blocks_per_seq"),
                &starts.as_view(),
                &lens.as_view(),
                i.n("n_heads"),
                i.n("n_kv_heads"),
                i.n("head_dim"),
                i.n("block_size"),
                &mut out.as_view_mut(),
            ));
            vec![("out".into(), Out::F(device::down(&out)))]
        }"#,
    cuda_timed_arm: r#"{
            let (seqs, kv_len, heads, kvh, hd) = (n("n_seqs").max(1), n("kv_len"), n("n_heads"), n("n_kv_heads"), n("head_dim"));
            let bs = n("block_size").max(1);
            let bps = kv_len.div_ceil(bs).max(1);
            let blocks = seqs * bps;
            // Sequence s owns blocks s, s + seqs, s + 2 seqs, ...: interleaved, as a pool hands them out.
            let table: Vec<u32> = (0..seqs).flat_map(|s| (0..bps).map(move |b| (b * seqs + s) as u32)).collect();
            let starts: Vec<u32> = (0..=seqs as u32).collect();
            let lens = vec![kv_len as u32; seqs];
            let (table, starts, lens) = (device::up(&table), device::up(&starts), device::up(&lens));
            let q = device::up(&fill(seqs * heads * hd, 9));
            let caches: Vec<_> = (0..copies)
                .map(|c| (device::up(&fill(blocks * bs * kvh * hd, 200 + c as u64)), device::up(&fill(blocks * bs * kvh * hd, 300 + c as u64))))
                .collect();
            let mut out = device::nan(seqs * heads * hd);
            Timed {
                run: Box::new(move |i| {
                    let (k, v) = &caches[i % caches.len()];
                    device::ok(engine::kernels::paged_attention(
                        device::dev(),
                        &q.as_view(),
                        &k.as_view(),
                        &v.as_view(),
                        &table.as_view(),
                        bps,
                        &starts.as_view(),
                        &lens.as_view(),
                        heads,
                        kvh,
                        hd,
                        bs,
                        &mut out.as_view_mut(),
                    ))
                }),
            }
        }"#,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutants_by_hand() {
        // One sequence, one head of dim 1, block size 2, context 3 in physical blocks [1, 0]:
        // positions 0, 1 in block 1 (slots 2, 3), position 2 in block 0 slot 0; slot 1 unwritten.
        let b = Batch {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 1,
            block_size: 2,
            blocks_per_seq: 2,
            query_start: vec![0, 1],
            context_lens: vec![3],
        };
        let k = [0.0; 4];
        let v = [30.0, 99.0, 10.0, 20.0];
        let none = Faults::default();
        let got = |f: Faults| core(&[1.0], &k, &v, &[1, 0], &b, f).unwrap()[0];
        // Zero keys: uniform weights over the visible positions.
        assert!((got(none) - 20.0).abs() < 1e-12); // (10 + 20 + 30) / 3
        assert!((got(Faults { block_table_ignored: true, ..none }) - (30.0 + 99.0 + 10.0) / 3.0).abs() < 1e-12);
        assert!((got(Faults { reads_past_context: true, ..none }) - (10.0 + 20.0 + 30.0 + 99.0) / 4.0).abs() < 1e-12);
        assert!((got(Faults { query_offset_zero: true, ..none }) - 10.0).abs() < 1e-12);
    }
}
