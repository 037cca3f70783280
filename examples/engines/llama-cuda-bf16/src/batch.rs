//! Phase 6 (batching): several sequences per forward pass over a paged KV cache on the device
//! (component.batched_step).
//!
//! One step runs the rows of every chunk (T tokens of n sequences: prompt chunks and decode tokens
//! mixed) through the layers together: each projection is one tensor-core product over all T rows
//! (the prefill's exact three-plane bf16 split, f32 accumulation), so a weight is read once per step
//! whatever the batch; RoPE and the cache writes take each row's position and slot
//! (`rope_store_paged`), attention reads each sequence's keys through its block table
//! (kernel.paged_attention); then the last row of each chunk is gathered, normed and multiplied by
//! lm_head, and the [n, vocab] logits come back to the host, where the server samples.
//!
//! Expert models (Qwen3-MoE, Mixtral) take the same step, with two parts row by row: the per-head
//! q/k RMSNorm (qk_norm) before RoPE, and the mixture of experts (router, kernel.moe_route, the
//! selected experts: `moe::mlp`), so each row reads its own experts' rows.
//!
//! The cache holds K and V in f32, [num_blocks, block_size, n_kv_heads, head_dim] per layer, as the
//! CPU engines' does. The step needs the shapes the tensor-core product takes (hidden, the q
//! width and intermediate multiples of 8, head_dim even and at most 256); `new_cache` refuses others
//! by name.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use crate::device::Device;
use crate::fused;
use crate::kernels::{self, dim, elementwise, grid, launched, need};
use crate::model::{Mlp, Model};
use crate::moe::{self, MoeScratch};

/// Device activations of a step, grown to the largest step seen.
struct Scratch {
    /// Row capacity (tokens of a step) and sequence capacity (chunks of a step).
    rows: usize,
    seqs: usize,
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// Three bf16 planes of the widest activation a product reads.
    planes: CudaSlice<u16>,
    /// The last row of each chunk, normed, and its logits.
    last: CudaSlice<f32>,
    last_normed: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// One row's q and k after their per-head RMSNorm (qk_norm), [(n_heads + n_kv_heads) head_dim].
    qk: CudaSlice<f32>,
    /// One row's mixture-of-experts activations (expert models).
    moe: Option<MoeScratch>,
}

/// K and V of every layer in num_blocks blocks of block_size positions (component.batched_step),
/// in device memory: per layer [num_blocks, block_size, n_kv_heads, head_dim] f32.
pub struct PagedKvCache {
    pub(crate) block_size: usize,
    pub(crate) num_blocks: usize,
    pub(crate) k: Vec<CudaSlice<f32>>,
    pub(crate) v: Vec<CudaSlice<f32>>,
    scratch: Option<Scratch>,
}

/// One sequence's part of a batched step: `tokens` at positions start.., its block table.
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub block_table: &'a [u32],
}

/// Why the batched step cannot take this model's shape, or None when it can.
fn unsupported(m: &Model) -> Option<String> {
    let c = &m.cfg;
    let q_dim = c.n_heads * c.head_dim;
    // An expert model's dense intermediate is not a product of the step.
    let inter_ok = c.moe.is_some() || c.intermediate.is_multiple_of(8);
    if !(c.hidden.is_multiple_of(8) && q_dim.is_multiple_of(8) && inter_ok) {
        return Some(format!(
            "the batched step needs hidden ({}), n_heads * head_dim ({q_dim}) and intermediate ({}) multiples of 8",
            c.hidden, c.intermediate
        ));
    }
    if !c.head_dim.is_multiple_of(2) || c.head_dim > PAGED_MAX_HEAD_DIM {
        return Some(format!("the batched step needs an even head_dim of at most 256, not {}", c.head_dim));
    }
    None
}

/// A paged KV cache for `model` with `num_blocks` blocks of `block_size` positions, zeroed on the
/// device. Panics with the reason when the device memory cannot be had or the model's shape is one
/// the batched step does not take.
pub fn new_cache(model: &crate::model::Model, num_blocks: usize, block_size: usize) -> PagedKvCache {
    assert!(block_size > 0, "block_size must be positive");
    // Cache slots (block * block_size + offset) travel to the device as u32.
    assert!(
        num_blocks.checked_mul(block_size).is_some_and(|n| n <= u32::MAX as usize),
        "new_cache: {num_blocks} blocks of {block_size} positions exceed the 2^32 slots a step addresses"
    );
    if let Some(why) = unsupported(model) {
        panic!("new_cache: {why}");
    }
    let len = num_blocks * block_size * model.cfg.n_kv_heads * model.cfg.head_dim;
    let st = model.dev.stream();
    let zeros = |what: &str| {
        st.alloc_zeros::<f32>(len.max(1))
            .unwrap_or_else(|e| panic!("new_cache: {what} ({num_blocks} blocks of {block_size} positions): {e}"))
    };
    PagedKvCache {
        block_size,
        num_blocks,
        k: (0..model.cfg.n_layers).map(|_| zeros("keys")).collect(),
        v: (0..model.cfg.n_layers).map(|_| zeros("values")).collect(),
        scratch: None,
    }
}

/// Bytes of one block of [`PagedKvCache`] holding `block_size` positions: keys and values of every
/// layer in f32, block_size × n_layers × 2 × n_kv_heads × head_dim × 4. At the Llama 3.2 1B shape
/// (16 layers, 8 KV heads of 64) a block of 16 positions is 1 MiB.
pub fn block_bytes(model: &crate::model::Model, block_size: usize) -> usize {
    block_size * model.cfg.n_layers * 2 * model.cfg.n_kv_heads * model.cfg.head_dim * std::mem::size_of::<f32>()
}

/// What the server's KV cache may take on the device unless told (`--kv-blocks`): 90% of the device
/// memory free once the weights are loaded (cuMemGetInfo), less 1 GiB for the batched step's scratch
/// and logits ([n, vocab] f32 per step); None when the driver cannot say (no cap).
pub fn kv_budget_bytes(model: &crate::model::Model) -> Option<u64> {
    let (free, _total) = model.dev.context().mem_get_info().ok()?;
    Some((free as u64 / 10 * 9).saturating_sub(1 << 30))
}

/// Run every chunk through the model in one pass, writing K/V through the block tables;
/// returns the logits of each chunk's last token, [chunks.len(), vocab] in chunk order.
/// Panics naming the chunk when a chunk is empty, reaches beyond its block table or the model's
/// context, names a block outside the cache or a token outside the vocabulary, or the device fails.
pub fn step(model: &mut crate::model::Model, cache: &mut PagedKvCache, chunks: &[SeqChunk]) -> Vec<f32> {
    run(model, cache, chunks).unwrap_or_else(|e| panic!("batch::step: {e}"))
}

/// The host-side arrays of a step: per row its token, position and cache slot; per sequence its
/// padded block-table row, first query row, context length and last row.
#[derive(Debug)]
struct Plan {
    ids: Vec<u32>,
    pos: Vec<u32>,
    slot: Vec<u32>,
    table: Vec<u32>,
    blocks_per_seq: usize,
    query_start: Vec<u32>,
    context_lens: Vec<u32>,
    last: Vec<u32>,
}

/// The step's host arrays for a cache of `num_blocks` blocks of `bs` positions and a model of
/// `vocab` tokens and `max_seq` positions; Err naming the chunk on a bad one (nothing uploaded).
fn plan(vocab: usize, max_seq: usize, bs: usize, num_blocks: usize, chunks: &[SeqChunk]) -> Result<Plan, String> {
    if chunks.is_empty() {
        return Err("no chunks".into());
    }
    let blocks_per_seq = chunks.iter().map(|c| c.block_table.len()).max().unwrap_or(0).max(1);
    let mut p = Plan {
        ids: Vec::new(),
        pos: Vec::new(),
        slot: Vec::new(),
        table: Vec::with_capacity(chunks.len() * blocks_per_seq),
        blocks_per_seq,
        query_start: vec![0],
        context_lens: Vec::new(),
        last: Vec::new(),
    };
    for (i, c) in chunks.iter().enumerate() {
        let end = c.start + c.tokens.len();
        if c.tokens.is_empty() {
            return Err(format!("chunk {i} has no tokens"));
        }
        if end > max_seq {
            return Err(format!("chunk {i} reaches position {end}, beyond the model's context of {max_seq}"));
        }
        if end > c.block_table.len() * bs {
            return Err(format!(
                "chunk {i} reaches position {end}; its block table of {} blocks holds {}",
                c.block_table.len(),
                c.block_table.len() * bs
            ));
        }
        if let Some(b) = c.block_table[..end.div_ceil(bs)].iter().find(|&&b| b as usize >= num_blocks) {
            return Err(format!("chunk {i} names block {b}; the cache has {num_blocks}"));
        }
        if let Some(t) = c.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!("chunk {i} holds token {t}, outside the vocabulary of {vocab}"));
        }
        for (j, &t) in c.tokens.iter().enumerate() {
            let at = c.start + j;
            p.ids.push(t);
            p.pos.push(at as u32);
            // block < num_blocks and num_blocks * bs <= 2^32 (new_cache): the slot fits in u32.
            p.slot.push((c.block_table[at / bs] as usize * bs + at % bs) as u32);
        }
        p.table.extend_from_slice(c.block_table);
        p.table.resize((i + 1) * blocks_per_seq, u32::MAX);
        p.last.push(p.ids.len() as u32 - 1);
        p.query_start.push(p.ids.len() as u32);
        p.context_lens.push(end as u32);
    }
    Ok(p)
}

fn grow(model: &Model, cache: &mut PagedKvCache, rows: usize, seqs: usize) -> Result<(), String> {
    if cache.scratch.as_ref().is_some_and(|s| s.rows >= rows && s.seqs >= seqs) {
        return Ok(());
    }
    let (rows, seqs) = match &cache.scratch {
        Some(s) => (rows.max(s.rows), seqs.max(s.seqs)),
        None => (rows, seqs),
    };
    let c = &model.cfg;
    let (h, q_dim, kv_dim, inter) = (c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate);
    let st = model.dev.stream();
    let f = |n: usize, what: &str| st.alloc_zeros::<f32>(n).map_err(|e| format!("step scratch {what}: {e}"));
    cache.scratch = Some(Scratch {
        rows,
        seqs,
        x: f(rows * h, "x")?,
        normed: f(rows * h, "normed")?,
        qkv: f(rows * (q_dim + 2 * kv_dim), "qkv")?,
        attn: f(rows * q_dim, "attn")?,
        gate_up: f(rows * 2 * inter, "gate_up")?,
        act: f(rows * inter, "act")?,
        planes: st
            .alloc_zeros::<u16>(3 * rows * h.max(q_dim).max(inter))
            .map_err(|e| format!("step scratch planes: {e}"))?,
        last: f(seqs * h, "last")?,
        last_normed: f(seqs * h, "last_normed")?,
        logits: f(seqs * c.vocab, "logits")?,
        qk: f(q_dim + kv_dim, "qk")?,
        moe: match &c.moe {
            Some(m) => Some(MoeScratch::new(st, m)?),
            None => None,
        },
    });
    Ok(())
}

fn run(model: &mut Model, cache: &mut PagedKvCache, chunks: &[SeqChunk]) -> Result<Vec<f32>, String> {
    let p = plan(model.cfg.vocab, model.cfg.max_seq, cache.block_size, cache.num_blocks, chunks)?;
    let (t, n) = (p.ids.len(), chunks.len());
    grow(model, cache, t, n)?;
    let Model { dev, cfg: c, layers, embed, lm_head, final_norm, freqs, .. } = model;
    let PagedKvCache { block_size, k: kc, v: vc, scratch, .. } = cache;
    let s = scratch.as_mut().ok_or("no step scratch")?;
    let (h, hd, eps, inter) = (c.hidden, c.head_dim, c.rms_norm_eps, c.intermediate);
    let (q_dim, kv_dim) = (c.n_heads * hd, c.n_kv_heads * hd);
    let width = q_dim + 2 * kv_dim;
    let up = |v: &[u32], what: &str| dev.stream().clone_htod(v).map_err(|e| format!("uploading {what}: {e}"));
    let (ids, pos, slot) = (up(&p.ids, "token ids")?, up(&p.pos, "positions")?, up(&p.slot, "cache slots")?);
    let (table, qs, lens, last) = (
        up(&p.table, "block tables")?,
        up(&p.query_start, "query starts")?,
        up(&p.context_lens, "context lengths")?,
        up(&p.last, "last rows")?,
    );
    kernels::embedding(dev, &embed.as_view(), h, &ids.as_view(), &mut s.x.slice_mut(0..t * h))?;
    for (li, l) in layers.iter().enumerate() {
        kernels::rms_norm(dev, &s.x.slice(0..t * h), &l.attn_norm.as_view(), eps, &mut s.normed.slice_mut(0..t * h))?;
        fused::split3(dev, &s.normed.slice(0..t * h), &mut s.planes.slice_mut(0..3 * t * h))?;
        let planes = &s.planes.slice(0..3 * t * h);
        fused::gemm_bf16x3(dev, planes, &l.wqkv.as_view(), t, h, width, &mut s.qkv.slice_mut(0..t * width), false)?;
        // Qwen3-MoE: every q and k head RMSNormed with its gain before RoPE, row by row (a row's q
        // and k heads are contiguous, its v after them).
        if let Some(norms) = &l.qk_norm {
            for r in 0..t {
                crate::model::qk_norm_row(dev, norms, eps, &mut s.qkv, r * width, (q_dim, kv_dim), &mut s.qk)?;
            }
        }
        let qkv = &mut s.qkv.slice_mut(0..t * width);
        rope_store_paged(
            dev,
            qkv,
            t,
            &pos.as_view(),
            &slot.as_view(),
            &freqs.as_view(),
            (c.n_heads, c.n_kv_heads, hd),
            &mut kc[li].as_view_mut(),
            &mut vc[li].as_view_mut(),
        )?;
        paged_attention_rows(
            dev,
            &s.qkv.slice(0..t * width),
            width,
            &kc[li].as_view(),
            &vc[li].as_view(),
            &table.as_view(),
            p.blocks_per_seq,
            &qs.as_view(),
            &lens.as_view(),
            c.n_heads,
            c.n_kv_heads,
            hd,
            *block_size,
            &mut s.attn.slice_mut(0..t * q_dim),
        )?;
        // x += attn Wo^T
        fused::split3(dev, &s.attn.slice(0..t * q_dim), &mut s.planes.slice_mut(0..3 * t * q_dim))?;
        let x = &mut s.x.slice_mut(0..t * h);
        fused::gemm_bf16x3(dev, &s.planes.slice(0..3 * t * q_dim), &l.wo.as_view(), t, q_dim, h, x, true)?;
        // x += (silu(norm(x) Wgate^T) * norm(x) Wup^T) Wdown^T, or the mixture of experts row by row
        // (router, kernel.moe_route, the selected experts' rows: each row reads its own experts).
        kernels::rms_norm(dev, &s.x.slice(0..t * h), &l.ffn_norm.as_view(), eps, &mut s.normed.slice_mut(0..t * h))?;
        let (w_gate_up, w_down) = match &l.mlp {
            Mlp::Dense { w_gate_up, w_down } => (w_gate_up, w_down),
            Mlp::Moe(experts) => {
                let (m, ms) = (c.moe.as_ref().ok_or("no moe config")?, s.moe.as_mut().ok_or("no moe scratch")?);
                for r in 0..t {
                    let x = &mut s.x.slice_mut(r * h..(r + 1) * h);
                    moe::mlp(dev, m, experts, &s.normed.slice(r * h..(r + 1) * h), ms, x)?;
                }
                continue;
            }
        };
        fused::split3(dev, &s.normed.slice(0..t * h), &mut s.planes.slice_mut(0..3 * t * h))?;
        let gu = &mut s.gate_up.slice_mut(0..t * 2 * inter);
        fused::gemm_bf16x3(dev, &s.planes.slice(0..3 * t * h), &w_gate_up.as_view(), t, h, 2 * inter, gu, false)?;
        fused::silu_mul_rows(dev, &s.gate_up.slice(0..t * 2 * inter), t, inter, &mut s.act.slice_mut(0..t * inter))?;
        fused::split3(dev, &s.act.slice(0..t * inter), &mut s.planes.slice_mut(0..3 * t * inter))?;
        let x = &mut s.x.slice_mut(0..t * h);
        fused::gemm_bf16x3(dev, &s.planes.slice(0..3 * t * inter), &w_down.as_view(), t, inter, h, x, true)?;
    }
    // The last row of each chunk (the embedding gather over the rows of x), normed, times lm_head.
    kernels::embedding(dev, &s.x.slice(0..t * h), h, &last.as_view(), &mut s.last.slice_mut(0..n * h))?;
    kernels::rms_norm(
        dev,
        &s.last.slice(0..n * h),
        &final_norm.as_view(),
        eps,
        &mut s.last_normed.slice_mut(0..n * h),
    )?;
    fused::split3(dev, &s.last_normed.slice(0..n * h), &mut s.planes.slice_mut(0..3 * n * h))?;
    let logits = &mut s.logits.slice_mut(0..n * c.vocab);
    fused::gemm_bf16x3(dev, &s.planes.slice(0..3 * n * h), &lm_head.as_view(), n, h, c.vocab, logits, false)?;
    dev.stream().clone_dtoh(&s.logits.slice(0..n * c.vocab)).map_err(|e| format!("reading the logits: {e}"))
}

/// RoPE at position pos[r] on the q and k heads of row r of qkv [m, (n_heads + 2 n_kv_heads)
/// head_dim] (q rotated in place); the rotated k and v written into the paged caches at slot[r]
/// (block * block_size + offset). `heads`: (n_heads, n_kv_heads, head_dim).
fn rope_store_paged(
    dev: &Device,
    qkv: &mut CudaViewMut<'_, f32>,
    m: usize,
    pos: &CudaView<'_, u32>,
    slot: &CudaView<'_, u32>,
    freqs: &CudaView<'_, f64>,
    heads: (usize, usize, usize),
    k_cache: &mut CudaViewMut<'_, f32>,
    v_cache: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let (n_heads, n_kv_heads, head_dim) = heads;
    let width = (n_heads + 2 * n_kv_heads) * head_dim;
    need(qkv.len() == m * width && pos.len() == m && slot.len() == m, "rope_store_paged: shapes")?;
    need(freqs.len() * 2 == head_dim && k_cache.len() == v_cache.len(), "rope_store_paged: freqs, caches")?;
    let (mm, h, kvh, hd) =
        (dim(m, "m")?, dim(n_heads, "n_heads")?, dim(n_kv_heads, "n_kv_heads")?, dim(head_dim, "head_dim")?);
    let mut b = dev.stream().launch_builder(dev.function("rope_store_paged"));
    b.arg(&mut *qkv).arg(&mm).arg(pos).arg(slot).arg(freqs).arg(&h).arg(&kvh).arg(&hd);
    b.arg(&mut *k_cache).arg(&mut *v_cache);
    // SAFETY: matches `rope_store_paged(qkv, m, pos, slot, freqs, n_heads, n_kv_heads, head_dim, kc,
    // vc)`; every slot was checked on the host to lie in a block < num_blocks (batch::plan), so each
    // write is inside the caches.
    launched(unsafe { b.launch(grid(elementwise(m * width / 2), 256, 0)) }, "rope_store_paged")
}
/// Longest head the paged attention kernel takes (its PA_MAX_HD).
pub(crate) const PAGED_MAX_HEAD_DIM: usize = 256;

/// kernel.paged_attention with query row r at q[r * ldq..] (ldq >= n_heads * head_dim: a row of
/// the fused qkv product). One block of 4 warps per (query row, KV head, up to 8 query heads of its
/// group: 4 at head_dim 128, 2 at 256), so a group's keys and values are read once: the kernel
/// `paged_attention_d{N}` for head_dim <= 32 N.
pub(crate) fn paged_attention_rows(
    dev: &Device,
    q: &CudaView<'_, f32>,
    ldq: usize,
    k_cache: &CudaView<'_, f32>,
    v_cache: &CudaView<'_, f32>,
    block_table: &CudaView<'_, u32>,
    blocks_per_seq: usize,
    query_start: &CudaView<'_, u32>,
    context_lens: &CudaView<'_, u32>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && block_size > 0,
        "paged_attention: n_heads a multiple of n_kv_heads, block_size >= 1",
    )?;
    need(head_dim > 0 && head_dim <= PAGED_MAX_HEAD_DIM, "paged_attention: head_dim in 1..=256")?;
    let n_seqs = context_lens.len();
    need(n_seqs >= 1 && query_start.len() == n_seqs + 1, "paged_attention: query_start must have n_seqs + 1 entries")?;
    need(
        block_table.len() == n_seqs * blocks_per_seq,
        "paged_attention: block_table must be [n_seqs, blocks_per_seq]",
    )?;
    let row = n_heads * head_dim;
    need(
        out.len().is_multiple_of(row) && !out.is_empty(),
        "paged_attention: out must be [total_q, n_heads, head_dim]",
    )?;
    let total_q = out.len() / row;
    need(ldq >= row && q.len() >= (total_q - 1) * ldq + row, "paged_attention: q must hold total_q rows")?;
    let slot = n_kv_heads * head_dim * block_size;
    need(
        k_cache.len() == v_cache.len() && k_cache.len().is_multiple_of(slot),
        "paged_attention: caches must be [num_blocks, block_size, n_kv_heads, head_dim]",
    )?;
    let num_blocks = k_cache.len() / slot;
    let (l, bps, ns, nb, h, kvh, hd, bs) = (
        dim(ldq, "ldq")?,
        dim(blocks_per_seq, "blocks_per_seq")?,
        dim(n_seqs, "n_seqs")?,
        dim(num_blocks, "num_blocks")?,
        dim(n_heads, "n_heads")?,
        dim(n_kv_heads, "n_kv_heads")?,
        dim(head_dim, "head_dim")?,
        dim(block_size, "block_size")?,
    );
    // Lanes' chunks of a head (a power of two) and the query heads a block takes (kernels.cu's HB).
    let chunks = head_dim.div_ceil(32).next_power_of_two();
    let per_block = (16 / chunks).min(8);
    let blocks = total_q * n_kv_heads * (n_heads / n_kv_heads).div_ceil(per_block);
    dim(blocks, "paged attention blocks")?;
    let name = match chunks {
        1 => "paged_attention_d1",
        2 => "paged_attention_d2",
        4 => "paged_attention_d4",
        _ => "paged_attention_d8",
    };
    let mut b = dev.stream().launch_builder(dev.function(name));
    b.arg(q).arg(&l).arg(k_cache).arg(v_cache).arg(block_table).arg(&bps).arg(query_start).arg(context_lens);
    b.arg(&ns).arg(&nb).arg(&h).arg(&kvh).arg(&hd).arg(&bs).arg(&mut *out);
    // SAFETY: matches `paged_attention_dN(q, ldq, kc, vc, table, blocks_per_seq, query_start,
    // context_lens, n_seqs, num_blocks, n_heads, n_kv_heads, head_dim, block_size, out)`; lengths
    // checked above; the kernel reads table rows < n_seqs, cache blocks < num_blocks and positions
    // < blocks_per_seq * block_size only, and writes out rows < total_q; head_dim <= 32 * chunks.
    launched(unsafe { b.launch(grid(blocks, 128, 0)) }, name)
}

#[cfg(test)]
mod tests {
    use super::{SeqChunk, plan};

    /// Rows, positions and cache slots of a mixed step (a prompt chunk that crosses a block boundary
    /// and a decode token), worked out by hand for block_size 4: position t of a sequence lives in
    /// slot table[t / 4] * 4 + t % 4.
    #[test]
    fn plan_places_every_row_through_its_block_table() {
        let a = [5u32, 6, 7];
        let b = [9u32];
        let chunks = [
            // Positions 2, 3, 4 of a sequence on blocks [7, 2]: slots 30, 31 (block 7) and 8 (block 2).
            SeqChunk { tokens: &a, start: 2, block_table: &[7, 2] },
            // Position 9 of a sequence on blocks [0, 1, 3]: block 3, offset 1, slot 13.
            SeqChunk { tokens: &b, start: 9, block_table: &[0, 1, 3] },
        ];
        let p = plan(10, 64, 4, 8, &chunks).unwrap();
        assert_eq!(p.ids, [5, 6, 7, 9]);
        assert_eq!(p.pos, [2, 3, 4, 9]);
        assert_eq!(p.slot, [30, 31, 8, 13]);
        assert_eq!(p.blocks_per_seq, 3);
        assert_eq!(p.table, [7, 2, u32::MAX, 0, 1, 3]);
        assert_eq!(p.query_start, [0, 3, 4]);
        assert_eq!(p.context_lens, [5, 10]);
        assert_eq!(p.last, [2, 3]);
    }

    /// Chunks the step cannot run are refused by name before anything reaches the device.
    #[test]
    fn plan_refuses_bad_chunks_by_name() {
        let t = [1u32, 2];
        let err = |c: SeqChunk| plan(10, 16, 4, 4, &[c]).unwrap_err();
        assert!(err(SeqChunk { tokens: &[], start: 0, block_table: &[0] }).contains("no tokens"));
        // Positions 3 and 4 need two blocks; the table has one.
        assert!(err(SeqChunk { tokens: &t, start: 3, block_table: &[0] }).contains("block table of 1 blocks holds 4"));
        assert!(err(SeqChunk { tokens: &t, start: 0, block_table: &[4] }).contains("names block 4; the cache has 4"));
        assert!(
            err(SeqChunk { tokens: &[10], start: 0, block_table: &[0] }).contains("token 10, outside the vocabulary")
        );
        assert!(
            err(SeqChunk { tokens: &t, start: 15, block_table: &[0, 1, 2, 3, 0] })
                .contains("beyond the model's context of 16")
        );
        assert!(plan(10, 16, 4, 4, &[]).unwrap_err().contains("no chunks"));
    }
}
