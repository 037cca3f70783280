//! The model's fused kernels (kernels.cu, "Decode-step kernels" and "Prefill kernels"): each one
//! computes what a chain of the contracts' kernels computes, in f32 with f32 accumulation. The
//! per-contract launchers of `kernels` stay the reference each is tested against (kernel tests
//! through linear_bf16 and attention, which dispatch here where the shapes allow it; verify for
//! the rest).

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};

use crate::device::Device;
use crate::kernels::{BLOCK, dim, elementwise, grid, launched, need};

/// Threads of a matrix-vector block (8 warps); kernels.cu's MV_THREADS agrees.
const MV_THREADS: u32 = 256;
/// Blocks per SM the matrix-vector kernels are built for (`__launch_bounds__(256, 2)`).
const MV_BLOCKS_PER_SM: usize = 2;
/// Most blocks of a matrix-vector grid: the argmax partials are sized for it.
pub(crate) const MV_MAX_BLOCKS: usize = 4096;
/// Most shared memory a block takes without opting in: static arrays and the dynamic part (the
/// matrix-vector kernels' staged input vector, k floats) together.
const SMEM_DEFAULT: usize = 48 * 1024;

/// Static shared memory of the matrix-vector kernels (`mv_run`: red[32], sv[8], si[8], last: 196
/// bytes), rounded up: the staged vector gets 48 KiB less this.
const MV_STATIC_SMEM: usize = 256;

/// Whether a device buffer starts on a 16-byte boundary (the matrix-vector kernels load 8 bf16 at once).
pub(crate) fn aligned16<T>(dev: &Device, v: &CudaView<'_, T>) -> bool {
    let (p, _sync) = v.device_ptr(dev.stream());
    p % 16 == 0
}

/// Grid of a matrix-vector kernel over `groups` row groups (one per warp at a time): enough blocks
/// to give every SM `MV_BLOCKS_PER_SM` (about 64 KB of weight loads in flight per SM: 16 warps x
/// 4 KB), fewer when there are fewer groups; the blocks then loop over the groups.
fn mv_grid(dev: &Device, groups: usize, k: usize) -> Result<LaunchConfig, String> {
    let smem = k * 4;
    need(
        smem + MV_STATIC_SMEM <= SMEM_DEFAULT,
        &format!("matrix-vector: k = {k} needs more than 48 KiB of shared memory"),
    )?;
    let blocks = groups.div_ceil(8).clamp(1, (dev.sm_count() * MV_BLOCKS_PER_SM).min(MV_MAX_BLOCKS));
    Ok(grid(blocks, MV_THREADS, smem as u32))
}

/// Whether the fused matrix-vector kernels take a [n, k] matrix: k a multiple of 8 whose staged
/// vector fits in 48 KiB beside the kernels' static shared memory (k <= 12,224), the matrix on a
/// 16-byte boundary.
pub(crate) fn mv_fits(dev: &Device, w: &CudaView<'_, u16>, k: usize) -> bool {
    k > 0 && k.is_multiple_of(8) && k * 4 + MV_STATIC_SMEM <= SMEM_DEFAULT && aligned16(dev, w)
}

/// out = x W^T (+ out when `accumulate`) for one row x [k]: kernel.linear_bf16 at m = 1 (and the
/// o projection with the residual add fused). W: [n, k] bf16, k % 8 == 0, 16-byte aligned.
/// Time: n * k * 2 bytes of weights at HBM bandwidth.
pub(crate) fn mv_bf16(
    dev: &Device,
    x: &CudaView<'_, f32>,
    w: &CudaView<'_, u16>,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
    accumulate: bool,
) -> Result<(), String> {
    need(x.len() == k && w.len() == n * k && out.len() == n, "mv_bf16: x [k], w [n, k], out [n]")?;
    need(mv_fits(dev, w, k), "mv_bf16: k % 8 == 0, k <= 12224, w 16-byte aligned")?;
    let cfg = mv_grid(dev, n, k)?;
    let (kk, nn, acc) = (dim(k, "k")?, dim(n, "n")?, accumulate as i32);
    let mut b = dev.stream().launch_builder(dev.function("mv_bf16"));
    b.arg(x).arg(w).arg(&kk).arg(&nn).arg(&mut *out).arg(&acc);
    // SAFETY: matches `mv_bf16(x, w, k, n, out, accumulate)`; lengths checked above; k floats of
    // dynamic shared memory for the staged x; the kernel reads w rows < n, chunks < k / 8.
    launched(unsafe { b.launch(cfg) }, "mv_bf16")
}

/// out = rms_norm(x, gain, eps) W^T: kernel.rms_norm fused into kernel.linear_bf16 (gate and up
/// projections). x, gain: [k]; W: [n, k]; out: [n].
pub(crate) fn mv_bf16_norm(
    dev: &Device,
    x: &CudaView<'_, f32>,
    gain: &CudaView<'_, f32>,
    eps: f32,
    w: &CudaView<'_, u16>,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(x.len() == k && gain.len() == k && w.len() == n * k && out.len() == n, "mv_bf16_norm: shapes")?;
    need(mv_fits(dev, w, k), "mv_bf16_norm: k % 8 == 0, w 16-byte aligned")?;
    let cfg = mv_grid(dev, n, k)?;
    let (kk, nn) = (dim(k, "k")?, dim(n, "n")?);
    let mut b = dev.stream().launch_builder(dev.function("mv_bf16_norm"));
    b.arg(x).arg(gain).arg(&eps).arg(w).arg(&kk).arg(&nn).arg(&mut *out);
    // SAFETY: matches `mv_bf16_norm(x, gain, eps, w, k, n, out)`; lengths checked above.
    launched(unsafe { b.launch(cfg) }, "mv_bf16_norm")
}

/// out += (silu(gate) * up) W^T with gate_up = [gate (k), up (k)]: kernel.silu_and_mul fused into
/// the down projection (kernel.linear_bf16) and the residual add. W: [n, k]; out: [n].
pub(crate) fn mv_bf16_silu(
    dev: &Device,
    gate_up: &CudaView<'_, f32>,
    w: &CudaView<'_, u16>,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(gate_up.len() == 2 * k && w.len() == n * k && out.len() == n, "mv_bf16_silu: shapes")?;
    need(mv_fits(dev, w, k), "mv_bf16_silu: k % 8 == 0, w 16-byte aligned")?;
    let cfg = mv_grid(dev, n, k)?;
    let (kk, nn) = (dim(k, "k")?, dim(n, "n")?);
    let mut b = dev.stream().launch_builder(dev.function("mv_bf16_silu"));
    b.arg(gate_up).arg(w).arg(&kk).arg(&nn).arg(&mut *out);
    // SAFETY: matches `mv_bf16_silu(gate_up, w, k, n, out)`; lengths checked above.
    launched(unsafe { b.launch(cfg) }, "mv_bf16_silu")
}

/// The attention block's input for one token at position ctl[0] (read on the device): q, k, v =
/// rms_norm(x) [wq; wk; wv]^T, RoPE on q and k (angle in f64 from `freqs` [head_dim / 2]), q to
/// `q_out` [n_heads * head_dim], k and v into row ctl[0] of the caches [max_seq, n_kv_heads *
/// head_dim]. Fuses kernel.rms_norm, kernel.linear_bf16, kernel.rope and the KV-cache write.
pub(crate) fn mv_bf16_qkv(
    dev: &Device,
    x: &CudaView<'_, f32>,
    gain: &CudaView<'_, f32>,
    eps: f32,
    w: &CudaView<'_, u16>,
    ctl: &CudaView<'_, u32>,
    freqs: &CudaView<'_, f64>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    q_out: &mut CudaViewMut<'_, f32>,
    k_cache: &mut CudaViewMut<'_, f32>,
    v_cache: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let k = x.len();
    let n = (n_heads + 2 * n_kv_heads) * head_dim;
    need(head_dim >= 2 && head_dim.is_multiple_of(2) && freqs.len() * 2 == head_dim, "mv_bf16_qkv: head_dim")?;
    need(gain.len() == k && w.len() == n * k && q_out.len() == n_heads * head_dim, "mv_bf16_qkv: shapes")?;
    need(ctl.len() >= 3, "mv_bf16_qkv: ctl holds position, step and token")?;
    need(k_cache.len() == v_cache.len() && k_cache.len().is_multiple_of(n_kv_heads * head_dim), "mv_bf16_qkv: caches")?;
    need(mv_fits(dev, w, k), "mv_bf16_qkv: k % 8 == 0, w 16-byte aligned")?;
    let cfg = mv_grid(dev, n / 2, k)?;
    let (kk, h, kvh, hd) =
        (dim(k, "k")?, dim(n_heads, "n_heads")?, dim(n_kv_heads, "n_kv_heads")?, dim(head_dim, "head_dim")?);
    let mut b = dev.stream().launch_builder(dev.function("mv_bf16_qkv"));
    b.arg(x).arg(gain).arg(&eps).arg(w).arg(&kk).arg(ctl).arg(freqs).arg(&h).arg(&kvh).arg(&hd);
    b.arg(&mut *q_out).arg(&mut *k_cache).arg(&mut *v_cache);
    // SAFETY: matches `mv_bf16_qkv(x, gain, eps, w, k, ctl, freqs, n_heads, n_kv_heads, head_dim,
    // q_out, kc, vc)`; the caller keeps ctl[0] below the caches' rows (the model checks positions
    // against max_seq before every step).
    launched(unsafe { b.launch(cfg) }, "mv_bf16_qkv")
}

/// logits = rms_norm(x) W^T (final norm fused into lm_head), W: [n, k]; with `argmax`, also the
/// first maximum of the logits (kernel.argmax) written to ctl[2] and trail[ctl[1]], and ctl[0]
/// (position) and ctl[1] (step) advanced by one: the end of a decode step that replays unchanged.
/// `part_v`, `part_i`: [MV_MAX_BLOCKS] scratch; `ticket`: [1], zero between launches.
pub(crate) fn mv_bf16_head(
    dev: &Device,
    x: &CudaView<'_, f32>,
    gain: &CudaView<'_, f32>,
    eps: f32,
    w: &CudaView<'_, u16>,
    n: usize,
    logits: &mut CudaViewMut<'_, f32>,
    argmax: bool,
    part_v: &mut CudaViewMut<'_, f32>,
    part_i: &mut CudaViewMut<'_, u32>,
    ticket: &mut CudaViewMut<'_, u32>,
    ctl: &mut CudaViewMut<'_, u32>,
    trail: &mut CudaViewMut<'_, u32>,
) -> Result<(), String> {
    let k = x.len();
    need(gain.len() == k && w.len() == n * k && logits.len() == n, "mv_bf16_head: shapes")?;
    need(
        part_v.len() >= MV_MAX_BLOCKS && part_i.len() >= MV_MAX_BLOCKS && !ticket.is_empty(),
        "mv_bf16_head: scratch",
    )?;
    need(ctl.len() >= 3 && !trail.is_empty(), "mv_bf16_head: ctl and trail")?;
    need(mv_fits(dev, w, k), "mv_bf16_head: k % 8 == 0, w 16-byte aligned")?;
    let cfg = mv_grid(dev, n, k)?;
    let (kk, nn, mode) = (dim(k, "k")?, dim(n, "n")?, argmax as i32);
    let mut b = dev.stream().launch_builder(dev.function("mv_bf16_head"));
    b.arg(x).arg(gain).arg(&eps).arg(w).arg(&kk).arg(&nn).arg(&mut *logits).arg(&mode);
    b.arg(&mut *part_v).arg(&mut *part_i).arg(&mut *ticket).arg(&mut *ctl).arg(&mut *trail);
    // SAFETY: matches `mv_bf16_head(x, gain, eps, w, k, n, logits, mode, part_v, part_i, ticket,
    // ctl, trail)`; the grid has at most MV_MAX_BLOCKS blocks (one partial each); the caller keeps
    // ctl[1] below trail.len() (decode_greedy checks n against max_seq).
    launched(unsafe { b.launch(cfg) }, "mv_bf16_head")
}

/// Sequence splits of the decode attention for a cache of `max_seq` positions: about 32 positions
/// per split at full length, at most 32 splits (8 KV heads x 32 = 256 blocks on 132 SMs).
pub(crate) fn attn_splits(max_seq: usize) -> usize {
    max_seq.div_ceil(32).clamp(1, 32)
}

/// Whether `attn_decode` takes the shape: a GQA group of at most 8 query heads, head_dim <= 128.
pub(crate) fn decode_attention_fits(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> bool {
    n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && n_heads / n_kv_heads <= 8 && head_dim <= 128
}

/// Attention of one query q [n_heads * head_dim] at position ctl[0] over cache rows 0..=ctl[0]
/// (kernel.attention at n_q = 1, kv_len read on the device), split over the sequence in `splits`
/// parts (flash-decoding) and merged by the last block of each KV head. `part_ml`: [n_kv_heads *
/// splits * group * 2], `part_acc`: [n_kv_heads * splits * group * head_dim], `ticket`:
/// [n_kv_heads] zero between launches; out: [n_heads * head_dim].
pub(crate) fn attn_decode(
    dev: &Device,
    q: &CudaView<'_, f32>,
    k_cache: &CudaView<'_, f32>,
    v_cache: &CudaView<'_, f32>,
    ctl: &CudaView<'_, u32>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    splits: usize,
    part_ml: &mut CudaViewMut<'_, f32>,
    part_acc: &mut CudaViewMut<'_, f32>,
    ticket: &mut CudaViewMut<'_, u32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(decode_attention_fits(n_heads, n_kv_heads, head_dim), "attn_decode: group <= 8, head_dim <= 128")?;
    let group = n_heads / n_kv_heads;
    need(q.len() == n_heads * head_dim && out.len() == q.len(), "attn_decode: q and out [n_heads, head_dim]")?;
    need(splits >= 1 && part_ml.len() >= n_kv_heads * splits * group * 2, "attn_decode: part_ml")?;
    need(
        part_acc.len() >= n_kv_heads * splits * group * head_dim && ticket.len() >= n_kv_heads,
        "attn_decode: scratch",
    )?;
    need(!ctl.is_empty() && k_cache.len() == v_cache.len(), "attn_decode: ctl and caches")?;
    let (h, kvh, hd, sp) =
        (dim(n_heads, "n_heads")?, dim(n_kv_heads, "n_kv_heads")?, dim(head_dim, "head_dim")?, dim(splits, "splits")?);
    let mut b = dev.stream().launch_builder(dev.function("attn_decode"));
    b.arg(q).arg(k_cache).arg(v_cache).arg(ctl).arg(&h).arg(&kvh).arg(&hd).arg(&sp);
    b.arg(&mut *part_ml).arg(&mut *part_acc).arg(&mut *ticket).arg(&mut *out);
    let cfg =
        LaunchConfig { grid_dim: (n_kv_heads as u32, splits as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: matches `attn_decode(q, kc, vc, ctl, n_heads, n_kv_heads, head_dim, splits, part_ml,
    // part_acc, ticket, out)`; scratch lengths checked above; the caller keeps ctl[0] below the
    // caches' rows.
    launched(unsafe { b.launch(cfg) }, "attn_decode")
}

/// Split f32 activations x [len] into three bf16 planes [3, len] with x = hi + mid + lo exactly.
pub(crate) fn split3(dev: &Device, x: &CudaView<'_, f32>, out: &mut CudaViewMut<'_, u16>) -> Result<(), String> {
    need(out.len() == 3 * x.len(), "split3: out must be [3, x.len()]")?;
    let len = x.len() as i64;
    let mut b = dev.stream().launch_builder(dev.function("split3_bf16"));
    b.arg(x).arg(&len).arg(&mut *out);
    // SAFETY: matches `split3_bf16(x, len, out)`; grid-stride over len, out of 3 * len.
    launched(unsafe { b.launch(grid(elementwise(x.len()), BLOCK, 0)) }, "split3_bf16")
}

/// out[m, n] (= or +=) A[m, k] W[n, k]^T on the tensor cores, A given as its exact three-plane bf16
/// split (split3), f32 accumulation: kernel.linear_bf16's f32 product for prompts. k % 8 == 0, A
/// planes and W 16-byte aligned. When the 64 x 64 tiles would not fill the GPU, k is split over
/// blocks that add atomically (the output zeroed first unless accumulating).
/// Work: 3 * 2 * m * n * k flops on the bf16 tensor cores (989 TFLOP/s dense on an H200).
pub(crate) fn gemm_bf16x3(
    dev: &Device,
    a3: &CudaView<'_, u16>,
    w: &CudaView<'_, u16>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
    accumulate: bool,
) -> Result<(), String> {
    need(a3.len() == 3 * m * k && w.len() == n * k && out.len() == m * n, "gemm_bf16x3: shapes")?;
    need(k > 0 && k.is_multiple_of(8) && aligned16(dev, a3) && aligned16(dev, w), "gemm_bf16x3: k % 8, alignment")?;
    let tiles = n.div_ceil(64) * m.div_ceil(64);
    let want = 2 * dev.sm_count();
    let mut splits = if tiles >= want { 1 } else { want.div_ceil(tiles).min(k / 256).max(1) };
    let kchunk = k.div_ceil(splits).div_ceil(32) * 32;
    splits = k.div_ceil(kchunk);
    let mode: i32 = if splits > 1 {
        if !accumulate {
            dev.stream().memset_zeros(out).map_err(|e| format!("gemm_bf16x3: zeroing: {e}"))?;
        }
        2
    } else {
        accumulate as i32
    };
    let (mm, kk, nn, kc) = (dim(m, "m")?, dim(k, "k")?, dim(n, "n")?, dim(kchunk, "kchunk")?);
    let mut b = dev.stream().launch_builder(dev.function("gemm_bf16x3"));
    b.arg(a3).arg(w).arg(&mm).arg(&kk).arg(&nn).arg(&mut *out).arg(&mode).arg(&kc);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, splits as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: matches `gemm_bf16x3(a3, w, m, k, n, c, mode, kchunk)`; lengths checked above; each
    // block reads A rows < m, W rows < n, columns < k, and writes out[row < m, col < n].
    launched(unsafe { b.launch(cfg) }, "gemm_bf16x3")
}

/// RoPE at positions start..start + m on the q and k heads of qkv [m, (n_heads + 2 n_kv_heads)
/// head_dim] (q rotated in place), rotated k and v written into cache rows start..start + m.
pub(crate) fn rope_store_rows(
    dev: &Device,
    qkv: &mut CudaViewMut<'_, f32>,
    m: usize,
    start: usize,
    freqs: &CudaView<'_, f64>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    k_cache: &mut CudaViewMut<'_, f32>,
    v_cache: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let width = (n_heads + 2 * n_kv_heads) * head_dim;
    need(qkv.len() == m * width && freqs.len() * 2 == head_dim, "rope_store_rows: shapes")?;
    need((start + m) * n_kv_heads * head_dim <= k_cache.len().min(v_cache.len()), "rope_store_rows: beyond the cache")?;
    let (mm, st, h, kvh, hd) = (
        dim(m, "m")?,
        dim(start, "start")?,
        dim(n_heads, "n_heads")?,
        dim(n_kv_heads, "n_kv_heads")?,
        dim(head_dim, "head_dim")?,
    );
    let mut b = dev.stream().launch_builder(dev.function("rope_store_rows"));
    b.arg(&mut *qkv).arg(&mm).arg(&st).arg(freqs).arg(&h).arg(&kvh).arg(&hd).arg(&mut *k_cache).arg(&mut *v_cache);
    // SAFETY: matches `rope_store_rows(qkv, m, start, freqs, n_heads, n_kv_heads, head_dim, kc, vc)`.
    launched(unsafe { b.launch(grid(elementwise(m * width / 2), BLOCK, 0)) }, "rope_store_rows")
}

/// out[t, i] = silu(gu[t, i]) * gu[t, inter + i] for m rows: gu [m, 2 inter], out [m, inter].
pub(crate) fn silu_mul_rows(
    dev: &Device,
    gate_up: &CudaView<'_, f32>,
    m: usize,
    inter: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(gate_up.len() == 2 * m * inter && out.len() == m * inter, "silu_mul_rows: shapes")?;
    let (mm, ii) = (dim(m, "m")?, dim(inter, "inter")?);
    let mut b = dev.stream().launch_builder(dev.function("silu_mul_rows"));
    b.arg(gate_up).arg(&mm).arg(&ii).arg(&mut *out);
    // SAFETY: matches `silu_mul_rows(gu, m, inter, out)`.
    launched(unsafe { b.launch(grid(elementwise(m * inter), BLOCK, 0)) }, "silu_mul_rows")
}

/// Whether `attn_prefill` takes the shape: the GQA group divides 64 and head_dim <= 64.
pub(crate) fn prefill_attention_fits(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> bool {
    n_kv_heads > 0
        && n_heads.is_multiple_of(n_kv_heads)
        && 64 % (n_heads / n_kv_heads) == 0
        && head_dim <= 64
        && head_dim > 0
}

/// Causal attention of n_q query rows (row t at q[t * ldq..], positions start + t) over cache rows
/// 0..=start + t: kernel.attention with key tiles in shared memory shared by 64 / group queries.
/// out: [n_q, n_heads, head_dim].
pub(crate) fn attn_prefill(
    dev: &Device,
    q: &CudaView<'_, f32>,
    ldq: usize,
    k_cache: &CudaView<'_, f32>,
    v_cache: &CudaView<'_, f32>,
    n_q: usize,
    start: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(prefill_attention_fits(n_heads, n_kv_heads, head_dim), "attn_prefill: group divides 64, head_dim <= 64")?;
    need(n_q >= 1 && ldq >= n_heads * head_dim && q.len() >= (n_q - 1) * ldq + n_heads * head_dim, "attn_prefill: q")?;
    need(out.len() == n_q * n_heads * head_dim, "attn_prefill: out [n_q, n_heads, head_dim]")?;
    let kv = (start + n_q) * n_kv_heads * head_dim;
    need(k_cache.len() >= kv && v_cache.len() >= kv, "attn_prefill: the caches must hold start + n_q positions")?;
    let rows_per_block = 64 / (n_heads / n_kv_heads);
    let (a, l, s, h, kvh, hd) = (
        dim(n_q, "n_q")?,
        dim(ldq, "ldq")?,
        dim(start, "start")?,
        dim(n_heads, "n_heads")?,
        dim(n_kv_heads, "n_kv_heads")?,
        dim(head_dim, "head_dim")?,
    );
    let mut b = dev.stream().launch_builder(dev.function("attn_prefill"));
    b.arg(q).arg(&l).arg(k_cache).arg(v_cache).arg(&a).arg(&s).arg(&h).arg(&kvh).arg(&hd).arg(&mut *out);
    let cfg = LaunchConfig {
        grid_dim: (n_q.div_ceil(rows_per_block) as u32, n_kv_heads as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: matches `attn_prefill(q, ldq, kc, vc, n_q, start, n_heads, n_kv_heads, head_dim, out)`;
    // lengths checked above.
    launched(unsafe { b.launch(cfg) }, "attn_prefill")
}
