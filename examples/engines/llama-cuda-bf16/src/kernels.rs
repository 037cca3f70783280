//! Phase 1, the kernels: one launcher per kernel contract, with the contract's `[cuda]` signature
//! (device buffers as cudarc views, launched on `dev.stream()`, `Err` on a bad shape or a launch
//! error). The arithmetic is in `kernels.cu`; each launcher checks the contract's preconditions,
//! picks the launch shape the contract's `launch` text describes, and enqueues the kernel. Nothing
//! here waits for the device.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use crate::device::Device;

pub use crate::generate::SamplingParams;

/// Threads per block of the reductions and elementwise kernels.
pub(crate) const BLOCK: u32 = 256;
/// Warps per block of the matrix products (one output feature per warp); kernels.cu agrees.
const WARPS_PER_BLOCK: usize = 8;

pub(crate) fn grid(blocks: usize, threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: shared }
}

/// A dimension as the kernels take it (i32).
pub(crate) fn dim(v: usize, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} is too large for one launch"))
}

pub(crate) fn need(ok: bool, what: &str) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what.to_string()) }
}

pub(crate) fn launched<T>(r: Result<T, cudarc::driver::DriverError>, name: &str) -> Result<(), String> {
    r.map(|_| ()).map_err(|e| format!("launching {name}: {e}"))
}

/// Blocks of a grid-stride elementwise kernel over `len` elements.
pub(crate) fn elementwise(len: usize) -> usize {
    len.div_ceil(BLOCK as usize).clamp(1, 4096)
}

/// CUDA variant of kernel.embedding: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn embedding(
    dev: &Device,
    table: &CudaView<'_, f32>,
    dim: usize,
    ids: &CudaView<'_, u32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(dim > 0 && table.len() % dim == 0, "embedding: table must be [vocab, dim]")?;
    need(out.len() == ids.len() * dim, "embedding: out must be [ids.len(), dim]")?;
    let (vocab, d, n) = (self::dim(table.len() / dim, "vocab")?, self::dim(dim, "dim")?, self::dim(ids.len(), "ids")?);
    let mut b = dev.stream().launch_builder(dev.function("embedding"));
    b.arg(table).arg(&vocab).arg(&d).arg(ids).arg(&n).arg(&mut *out);
    // SAFETY: the argument list matches `embedding` in kernels.cu (pointers to device buffers of the
    // checked lengths, i32 sizes); the kernel reads table[ids[b] * dim .. +dim] only for ids < vocab
    // and writes out[b * dim .. +dim] for b < n.
    launched(unsafe { b.launch(grid(ids.len(), BLOCK, 0)) }, "embedding")
}

/// CUDA variant of kernel.rms_norm: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn rms_norm(
    dev: &Device,
    x: &CudaView<'_, f32>,
    weight: &CudaView<'_, f32>,
    eps: f32,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let d = weight.len();
    need(d > 0 && x.len() % d == 0 && out.len() == x.len(), "rms_norm: x and out must be [rows, weight.len()]")?;
    let dm = dim(d, "dim")?;
    if x.is_empty() {
        // No rows: nothing to launch (grid() would give one block, which would read a row).
        return Ok(());
    }
    let mut b = dev.stream().launch_builder(dev.function("rms_norm"));
    b.arg(x).arg(weight).arg(&eps).arg(&mut *out).arg(&dm);
    // SAFETY: matches `rms_norm(x, w, eps, out, dim)`; one block per row of the checked lengths.
    launched(unsafe { b.launch(grid(x.len() / d, BLOCK, 0)) }, "rms_norm")
}

/// RoPE frequencies f_j = theta^(-2j / head_dim), j < head_dim / 2, in f64 (contract kernel.rope).
pub(crate) fn rope_freqs(theta: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2).map(|j| theta.powf(-((2 * j) as f64) / head_dim as f64)).collect()
}

/// CUDA variant of kernel.rope: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn rope(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    positions: &CudaView<'_, u32>,
    n_heads: usize,
    head_dim: usize,
    theta: f32,
) -> Result<(), String> {
    need(head_dim > 0 && head_dim.is_multiple_of(2), "rope: head_dim must be even")?;
    let freqs = dev
        .stream()
        .clone_htod(&rope_freqs(theta as f64, head_dim))
        .map_err(|e| format!("rope: uploading frequencies: {e}"))?;
    rope_with_freqs(dev, x, positions, n_heads, head_dim, &freqs.as_view())
}

/// RoPE with given frequencies [head_dim / 2] (f64 on the device; scaled ones for RoPE scaling).
pub(crate) fn rope_with_freqs(
    dev: &Device,
    x: &mut CudaViewMut<'_, f32>,
    positions: &CudaView<'_, u32>,
    n_heads: usize,
    head_dim: usize,
    freqs: &CudaView<'_, f64>,
) -> Result<(), String> {
    need(freqs.len() * 2 == head_dim, "rope: one frequency per pair")?;
    need(x.len() == positions.len() * n_heads * head_dim, "rope: x must be [positions, n_heads, head_dim]")?;
    let (t, h, hd) = (dim(positions.len(), "tokens")?, dim(n_heads, "n_heads")?, dim(head_dim, "head_dim")?);
    let pairs = positions.len() * n_heads * head_dim / 2;
    let mut b = dev.stream().launch_builder(dev.function("rope"));
    b.arg(&mut *x).arg(positions).arg(freqs).arg(&t).arg(&h).arg(&hd);
    // SAFETY: matches `rope(x, pos, freqs, n_tok, n_heads, head_dim)`; one thread per pair, bounds
    // checked in the kernel against the checked lengths.
    launched(unsafe { b.launch(grid(pairs.div_ceil(BLOCK as usize), BLOCK, 0)) }, "rope")
}

fn product_shape(xl: usize, wl: usize, ol: usize, m: usize, k: usize, n: usize, name: &str) -> Result<(), String> {
    need(xl == m * k && wl == n * k && ol == m * n, &format!("{name}: x must be [m, k], w [n, k], out [m, n]"))
}

/// CUDA variant of kernel.linear: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn linear(
    dev: &Device,
    x: &CudaView<'_, f32>,
    w: &CudaView<'_, f32>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    product_shape(x.len(), w.len(), out.len(), m, k, n, "linear")?;
    let (mm, kk, nn, acc) = (dim(m, "m")?, dim(k, "k")?, dim(n, "n")?, 0i32);
    let mut b = dev.stream().launch_builder(dev.function("linear_f32"));
    b.arg(x).arg(w).arg(&mm).arg(&kk).arg(&nn).arg(&mut *out).arg(&acc);
    // SAFETY: matches `linear_f32(x, w, m, k, n, out, accumulate)`; one warp per output feature.
    launched(unsafe { b.launch(grid(n.div_ceil(WARPS_PER_BLOCK), 32 * WARPS_PER_BLOCK as u32, 0)) }, "linear")
}

/// CUDA variant of kernel.linear_bf16: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn linear_bf16(
    dev: &Device,
    x: &CudaView<'_, f32>,
    w: &CudaView<'_, u16>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    linear_bf16_into(dev, x, w, m, k, n, out, false)
}

/// kernel.linear_bf16, adding to `out` instead of overwriting it when `accumulate` (a residual
/// connection fused into the product: out += x W^T).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_bf16_into(
    dev: &Device,
    x: &CudaView<'_, f32>,
    w: &CudaView<'_, u16>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
    accumulate: bool,
) -> Result<(), String> {
    product_shape(x.len(), w.len(), out.len(), m, k, n, "linear_bf16")?;
    if m == 1 && n > 0 && crate::fused::mv_fits(dev, w, k) {
        return crate::fused::mv_bf16(dev, x, w, k, n, out, accumulate);
    }
    if m > 1 && n > 0 && k > 0 && k.is_multiple_of(8) && crate::fused::aligned16(dev, w) {
        // Several rows: the tensor-core product on the exact three-way bf16 split of x.
        let mut planes = dev
            .stream()
            .alloc_zeros::<u16>(3 * m * k)
            .map_err(|e| format!("linear_bf16: allocating the split activations: {e}"))?;
        crate::fused::split3(dev, x, &mut planes.as_view_mut())?;
        return crate::fused::gemm_bf16x3(dev, &planes.as_view(), w, m, k, n, out, accumulate);
    }
    let (mm, kk, nn, acc) = (dim(m, "m")?, dim(k, "k")?, dim(n, "n")?, accumulate as i32);
    let mut b = dev.stream().launch_builder(dev.function("linear_bf16"));
    b.arg(x).arg(w).arg(&mm).arg(&kk).arg(&nn).arg(&mut *out).arg(&acc);
    // SAFETY: matches `linear_bf16(x, w, m, k, n, out, accumulate)`; one warp per output feature;
    // 16-byte loads only where the kernel found both rows 16-byte aligned and k a multiple of 8.
    launched(unsafe { b.launch(grid(n.div_ceil(WARPS_PER_BLOCK), 32 * WARPS_PER_BLOCK as u32, 0)) }, "linear_bf16")
}

/// CUDA variant of kernel.linear_f16: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn linear_f16(
    dev: &Device,
    x: &CudaView<'_, f32>,
    w: &CudaView<'_, u16>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    product_shape(x.len(), w.len(), out.len(), m, k, n, "linear_f16")?;
    let (mm, kk, nn) = (dim(m, "m")?, dim(k, "k")?, dim(n, "n")?);
    let mut b = dev.stream().launch_builder(dev.function("linear_f16"));
    b.arg(x).arg(w).arg(&mm).arg(&kk).arg(&nn).arg(&mut *out);
    // SAFETY: matches `linear_f16(x, w, m, k, n, out)`.
    launched(unsafe { b.launch(grid(n.div_ceil(WARPS_PER_BLOCK), 32 * WARPS_PER_BLOCK as u32, 0)) }, "linear_f16")
}

/// CUDA variant of kernel.linear_int8: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn linear_int8(
    dev: &Device,
    x: &CudaView<'_, f32>,
    w: &CudaView<'_, i8>,
    scales: &CudaView<'_, f32>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    product_shape(x.len(), w.len(), out.len(), m, k, n, "linear_int8")?;
    need(scales.len() == n, "linear_int8: one scale per output feature")?;
    let (mm, kk, nn) = (dim(m, "m")?, dim(k, "k")?, dim(n, "n")?);
    let mut b = dev.stream().launch_builder(dev.function("linear_int8"));
    b.arg(x).arg(w).arg(scales).arg(&mm).arg(&kk).arg(&nn).arg(&mut *out);
    // SAFETY: matches `linear_int8(x, w, scales, m, k, n, out)`.
    launched(unsafe { b.launch(grid(n.div_ceil(WARPS_PER_BLOCK), 32 * WARPS_PER_BLOCK as u32, 0)) }, "linear_int8")
}

fn gated(
    dev: &Device,
    name: &str,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(up.len() == gate.len() && out.len() == gate.len(), &format!("{name}: gate, up and out must have one length"))?;
    let len = dim(gate.len(), "len")?;
    let mut b = dev.stream().launch_builder(dev.function(name));
    b.arg(gate).arg(up).arg(&mut *out).arg(&len);
    // SAFETY: matches `<name>(gate, up, out, len)`; grid-stride over len elements.
    launched(unsafe { b.launch(grid(elementwise(gate.len()), BLOCK, 0)) }, name)
}

/// CUDA variant of kernel.silu_and_mul: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn silu_and_mul(
    dev: &Device,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    gated(dev, "silu_and_mul", gate, up, out)
}

/// CUDA variant of kernel.gelu_tanh_and_mul: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn gelu_tanh_and_mul(
    dev: &Device,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    gated(dev, "gelu_tanh_and_mul", gate, up, out)
}

/// CUDA variant of kernel.softmax: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn softmax(dev: &Device, x: &mut CudaViewMut<'_, f32>, n: usize) -> Result<(), String> {
    need(n > 0 && x.len() % n == 0, "softmax: x must be [rows, n]")?;
    let nn = dim(n, "n")?;
    let rows = x.len() / n;
    if rows == 0 {
        return Ok(());
    }
    let mut b = dev.stream().launch_builder(dev.function("softmax"));
    b.arg(&mut *x).arg(&nn);
    // SAFETY: matches `softmax(x, n)`; one block per row.
    launched(unsafe { b.launch(grid(rows, BLOCK, 0)) }, "softmax")
}

/// Most positions one attention block keeps scores for: the 48 KiB of shared memory a launch may use
/// without opting in, less the kernel's static `sh[32]` (128 bytes), at 4 bytes a score.
pub const MAX_KV_LEN: usize = (48 * 1024 - 128) / 4;

/// CUDA variant of kernel.attention: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn attention(
    dev: &Device,
    q: &CudaView<'_, f32>,
    k_cache: &CudaView<'_, f32>,
    v_cache: &CudaView<'_, f32>,
    n_q: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    need(n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads), "attention: n_heads must be a multiple of n_kv_heads")?;
    need(n_q >= 1 && n_q <= kv_len, "attention: 1 <= n_q <= kv_len")?;
    need(
        q.len() == n_q * n_heads * head_dim && out.len() == q.len(),
        "attention: q and out must be [n_q, n_heads, head_dim]",
    )?;
    need(
        k_cache.len() >= kv_len * n_kv_heads * head_dim && v_cache.len() >= kv_len * n_kv_heads * head_dim,
        "attention: the caches must hold kv_len positions",
    )?;
    if crate::fused::prefill_attention_fits(n_heads, n_kv_heads, head_dim) {
        return crate::fused::attn_prefill(
            dev,
            q,
            n_heads * head_dim,
            k_cache,
            v_cache,
            n_q,
            kv_len - n_q,
            n_heads,
            n_kv_heads,
            head_dim,
            out,
        );
    }
    need(kv_len <= MAX_KV_LEN, &format!("attention: kv_len {kv_len} is beyond this engine's {MAX_KV_LEN}"))?;
    let (a, b2, c, d, e) = (
        dim(n_q, "n_q")?,
        dim(kv_len, "kv_len")?,
        dim(n_heads, "n_heads")?,
        dim(n_kv_heads, "n_kv_heads")?,
        dim(head_dim, "head_dim")?,
    );
    let mut b = dev.stream().launch_builder(dev.function("attention"));
    b.arg(q).arg(k_cache).arg(v_cache).arg(&a).arg(&b2).arg(&c).arg(&d).arg(&e).arg(&mut *out);
    // SAFETY: matches `attention(q, kc, vc, n_q, kv_len, n_heads, n_kv_heads, head_dim, out)`; one
    // block per (query row, head) with kv_len floats of dynamic shared memory for the scores.
    launched(unsafe { b.launch(grid(n_q * n_heads, BLOCK, (kv_len * 4) as u32)) }, "attention")
}

/// CUDA variant of kernel.argmax: the same math on device buffers, launched on dev.stream(); Err on a launch error.
pub fn argmax(dev: &Device, x: &CudaView<'_, f32>, out: &mut CudaViewMut<'_, u32>) -> Result<(), String> {
    argmax_into(dev, x, out, None, 0)
}

/// kernel.argmax, also appending the index at `trail[step]` when given (the decode loop's tokens).
pub(crate) fn argmax_into(
    dev: &Device,
    x: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, u32>,
    trail: Option<&mut CudaViewMut<'_, u32>>,
    step: usize,
) -> Result<(), String> {
    need(!x.is_empty() && !out.is_empty(), "argmax: x and out must not be empty")?;
    if let Some(t) = &trail {
        need(step < t.len(), "argmax: step beyond the token list")?;
    }
    let (n, s) = (dim(x.len(), "n")?, dim(step, "step")?);
    let null = 0u64;
    let mut b = dev.stream().launch_builder(dev.function("argmax"));
    b.arg(x).arg(&n).arg(&mut *out);
    match trail {
        Some(t) => b.arg(t),
        None => b.arg(&null),
    };
    b.arg(&s);
    // SAFETY: matches `argmax(x, n, out, trail, step)`; `trail` is a device pointer with more than
    // `step` elements, or null (0), which the kernel does not write.
    launched(unsafe { b.launch(grid(1, 1024, 0)) }, "argmax")
}

/// Copy the K and V rows of `qkv` (at `k_off` and `v_off`, `kv_dim` each) into the caches at `pos`
/// (component.kv_cache).
#[allow(clippy::too_many_arguments)]
pub(crate) fn store_kv(
    dev: &Device,
    qkv: &CudaView<'_, f32>,
    k_off: usize,
    v_off: usize,
    kv_dim: usize,
    k_cache: &mut CudaViewMut<'_, f32>,
    v_cache: &mut CudaViewMut<'_, f32>,
    pos: usize,
) -> Result<(), String> {
    need(k_off + kv_dim <= qkv.len() && v_off + kv_dim <= qkv.len(), "store_kv: rows outside qkv")?;
    need(
        (pos + 1) * kv_dim <= k_cache.len() && (pos + 1) * kv_dim <= v_cache.len(),
        "store_kv: position beyond the cache",
    )?;
    let (ko, vo, kd, p) = (dim(k_off, "k_off")?, dim(v_off, "v_off")?, dim(kv_dim, "kv_dim")?, dim(pos, "pos")?);
    let mut b = dev.stream().launch_builder(dev.function("store_kv"));
    b.arg(qkv).arg(&ko).arg(&vo).arg(&kd).arg(&mut *k_cache).arg(&mut *v_cache).arg(&p);
    // SAFETY: matches `store_kv(qkv, k_off, v_off, kv_dim, kc, vc, pos)`; bounds checked above.
    launched(unsafe { b.launch(grid(elementwise(kv_dim), BLOCK, 0)) }, "store_kv")
}

/// CUDA variant of kernel.paged_attention: the same math on device buffers, launched on
/// dev.stream(); Err on a bad shape or a launch error. `q`, `out`: [total_q, n_heads, head_dim];
/// caches [num_blocks, block_size, n_kv_heads, head_dim]; `block_table` [n_seqs, blocks_per_seq];
/// `query_start` [n_seqs + 1]; `context_lens` [n_seqs]. A table entry outside the cache or a
/// position outside the table (their values live on the device) gives NaN rows, never a read there.
pub fn paged_attention(
    dev: &Device,
    q: &CudaView<'_, f32>,
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
    need(q.len() == out.len(), "paged_attention: q and out must both be [total_q, n_heads, head_dim]")?;
    crate::batch::paged_attention_rows(
        dev,
        q,
        n_heads * head_dim,
        k_cache,
        v_cache,
        block_table,
        blocks_per_seq,
        query_start,
        context_lens,
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
        out,
    )
}

/// kernel.sample, on the host in this engine (its [cuda] section): one token drawn from a logits
/// row ([n]) the batched step copied back, after penalties for `prev`, temperature, top-k, top-p
/// and min-p, at the uniform number `u` in [0, 1) (`generate::sample`).
pub fn sample(logits: &[f32], prev: &[u32], params: &SamplingParams, u: f32) -> u32 {
    crate::generate::sample(logits, prev, params, u)
}

/// CUDA variant of kernel.moe_route: the router weights of one token on the device. `scores`
/// [n_experts]; `out` [n_experts]: softmax over every score, the `top_k` largest kept (equal
/// weights: the lower index), divided by their sum when `renormalize`, 0 elsewhere; a NaN score
/// makes every weight NaN, so the token's output is NaN rather than quietly expert-free. One warp;
/// n_experts <= 8192 (its softmax in shared memory). Err on a bad shape or a launch error.
pub fn moe_route(
    dev: &Device,
    scores: &CudaView<'_, f32>,
    top_k: usize,
    renormalize: bool,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let n = scores.len();
    need(out.len() == n && (1..=8192).contains(&n), "moe_route: scores and out must be [n_experts], 1..=8192")?;
    need((1..=n).contains(&top_k), "moe_route: top_k must be in 1..=n_experts")?;
    let (nn, k, r) = (dim(n, "n_experts")?, dim(top_k, "top_k")?, renormalize as i32);
    let mut b = dev.stream().launch_builder(dev.function("moe_route"));
    b.arg(scores).arg(&nn).arg(&k).arg(&r).arg(&mut *out);
    // SAFETY: matches `moe_route(scores, n, top_k, renormalize, out)`; one warp reads scores[0..n]
    // and writes out[0..n], with n floats of dynamic shared memory.
    launched(unsafe { b.launch(grid(1, 32, (4 * n) as u32)) }, "moe_route")
}

/// CUDA variant of kernel.moe_experts: out = sum over the experts e with route[e] != 0 of route[e] *
/// (silu(x G_e^T) * (x U_e^T)) D_e^T for one token, weights bf16 (kernel.linear_bf16's rounding),
/// f32 accumulation. x, out: [hidden]; route: [n_experts]; gate, up: [n_experts, inter, hidden];
/// down: [n_experts, hidden, inter]. Only the selected experts' rows are read. Err on a bad shape,
/// an allocation or a launch error.
pub fn moe_experts(
    dev: &Device,
    x: &CudaView<'_, f32>,
    route: &CudaView<'_, f32>,
    gate: &CudaView<'_, u16>,
    up: &CudaView<'_, u16>,
    down: &CudaView<'_, u16>,
    inter: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), String> {
    let mut act =
        dev.stream().alloc_zeros::<f32>((route.len() * inter).max(1)).map_err(|e| format!("moe_experts: {e}"))?;
    moe_experts_into(dev, x, route, gate, up, down, inter, &mut act.as_view_mut(), out, false)
}

/// kernel.moe_experts with the caller's scratch `act` [n_experts, inter] (rows of the selected
/// experts written, route-weighted) and, with `accumulate`, out += the sum (the residual add).
/// Two launches: one warp per intermediate row for gate and up, one warp per output row for down.
pub(crate) fn moe_experts_into(
    dev: &Device,
    x: &CudaView<'_, f32>,
    route: &CudaView<'_, f32>,
    gate: &CudaView<'_, u16>,
    up: &CudaView<'_, u16>,
    down: &CudaView<'_, u16>,
    inter: usize,
    act: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    accumulate: bool,
) -> Result<(), String> {
    let (h, n) = (x.len(), route.len());
    need(h > 0 && n > 0 && inter > 0 && out.len() == h, "moe_experts: x and out must be [hidden], route [n_experts]")?;
    need(
        gate.len() == n * inter * h && up.len() == gate.len(),
        "moe_experts: gate and up must be [n_experts, inter, hidden]",
    )?;
    need(down.len() == n * h * inter, "moe_experts: down must be [n_experts, hidden, inter]")?;
    need(act.len() >= n * inter, "moe_experts: the scratch must hold [n_experts, inter]")?;
    let (nn, ii, hh, acc) = (dim(n, "n_experts")?, dim(inter, "inter")?, dim(h, "hidden")?, accumulate as i32);
    let mut b = dev.stream().launch_builder(dev.function("moe_gate_up"));
    b.arg(x).arg(route).arg(gate).arg(up).arg(&nn).arg(&ii).arg(&hh).arg(&mut *act);
    // SAFETY: matches `moe_gate_up(x, route, gate, up, n, inter, hidden, act)`; lengths checked
    // above; warp r < inter reads rows (e, r) of gate and up and writes act[e * inter + r].
    launched(unsafe { b.launch(grid(inter.div_ceil(WARPS_PER_BLOCK), BLOCK, 0)) }, "moe_gate_up")?;
    let act = act.as_view();
    let mut b = dev.stream().launch_builder(dev.function("moe_down"));
    b.arg(&act).arg(route).arg(down).arg(&nn).arg(&ii).arg(&hh).arg(&mut *out).arg(&acc);
    // SAFETY: matches `moe_down(act, route, down, n, inter, hidden, out, accumulate)`; warp o <
    // hidden reads rows (e, o) of down and act rows of the selected experts, writes out[o].
    launched(unsafe { b.launch(grid(h.div_ceil(WARPS_PER_BLOCK), BLOCK, 0)) }, "moe_down")
}
