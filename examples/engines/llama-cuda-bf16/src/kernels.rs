//! Phase 1, the kernels: one launcher per kernel contract, with the contract's `[cuda]` signature
//! (device buffers as cudarc views, launched on `dev.stream()`, `Err` on a bad shape or a launch
//! error). The arithmetic is in `kernels.cu`; each launcher checks the contract's preconditions,
//! picks the launch shape the contract's `launch` text describes, and enqueues the kernel. Nothing
//! here waits for the device.

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};

use crate::device::Device;

pub use crate::generate::SamplingParams;

/// Threads per block of the reductions and elementwise kernels.
const BLOCK: u32 = 256;
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
    if m == 1 && n > 0 && mv_fits(dev, w, k) {
        return mv_bf16(dev, x, w, k, n, out, accumulate);
    }
    if m > 1 && n > 0 && k > 0 && k.is_multiple_of(8) && aligned16(dev, w) {
        // Several rows: the tensor-core product on the exact three-way bf16 split of x.
        let mut planes = dev
            .stream()
            .alloc_zeros::<u16>(3 * m * k)
            .map_err(|e| format!("linear_bf16: allocating the split activations: {e}"))?;
        split3(dev, x, &mut planes.as_view_mut())?;
        return gemm_bf16x3(dev, &planes.as_view(), w, m, k, n, out, accumulate);
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
    let mut b = dev.stream().launch_builder(dev.function("softmax"));
    b.arg(&mut *x).arg(&nn);
    // SAFETY: matches `softmax(x, n)`; one block per row.
    launched(unsafe { b.launch(grid(rows, BLOCK, 0)) }, "softmax")
}

/// Most positions one attention block keeps scores for (48 KiB of shared memory, the default limit).
pub const MAX_KV_LEN: usize = 12 * 1024;

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
    if prefill_attention_fits(n_heads, n_kv_heads, head_dim) {
        return attn_prefill(
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

// ---------------------------------------------------------------------------------------------
// The model's fused kernels (kernels.cu, "Decode-step kernels" and "Prefill kernels"). Each one
// computes what a chain of the contracts' kernels computes, in f32 with f32 accumulation; the
// per-contract launchers above stay the reference each is tested against (kernel tests through
// linear_bf16 and attention, which dispatch here where the shapes allow it; verify for the rest).
// ---------------------------------------------------------------------------------------------

/// Threads of a matrix-vector block (8 warps); kernels.cu's MV_THREADS agrees.
const MV_THREADS: u32 = 256;
/// Blocks per SM the matrix-vector kernels are built for (`__launch_bounds__(256, 2)`).
const MV_BLOCKS_PER_SM: usize = 2;
/// Most blocks of a matrix-vector grid: the argmax partials are sized for it.
pub(crate) const MV_MAX_BLOCKS: usize = 4096;
/// Most shared memory a block takes without opting in (the staged input vector, k floats).
const SMEM_DEFAULT: usize = 48 * 1024;

/// Whether a device buffer starts on a 16-byte boundary (the matrix-vector kernels load 8 bf16 at once).
fn aligned16<T>(dev: &Device, v: &CudaView<'_, T>) -> bool {
    let (p, _sync) = v.device_ptr(dev.stream());
    p % 16 == 0
}

/// Grid of a matrix-vector kernel over `groups` row groups (one per warp at a time): enough blocks
/// to give every SM `MV_BLOCKS_PER_SM` (about 64 KB of weight loads in flight per SM: 16 warps x
/// 4 KB), fewer when there are fewer groups; the blocks then loop over the groups.
fn mv_grid(dev: &Device, groups: usize, k: usize) -> Result<LaunchConfig, String> {
    let smem = k * 4;
    need(smem <= SMEM_DEFAULT, &format!("matrix-vector: k = {k} needs more than 48 KiB of shared memory"))?;
    let blocks = groups.div_ceil(8).clamp(1, (dev.sm_count() * MV_BLOCKS_PER_SM).min(MV_MAX_BLOCKS));
    Ok(grid(blocks, MV_THREADS, smem as u32))
}

/// Whether the fused matrix-vector kernels take a [n, k] matrix: k a multiple of 8 that fits the
/// staged vector in 48 KiB, the matrix on a 16-byte boundary.
pub(crate) fn mv_fits(dev: &Device, w: &CudaView<'_, u16>, k: usize) -> bool {
    k > 0 && k.is_multiple_of(8) && k * 4 <= SMEM_DEFAULT && aligned16(dev, w)
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
    need(mv_fits(dev, w, k), "mv_bf16: k % 8 == 0, k <= 12288, w 16-byte aligned")?;
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
