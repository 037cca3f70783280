//! Phase 1: kernels. Every tensor is a flat row-major slice: activations are `f32`; weights of the
//! linear layers are `f32`, bf16 or IEEE binary16 bit patterns (`u16`), or `i8` with one `f32` scale
//! per output row. Shapes are given in the docs; arithmetic and accumulation are `f32`.
//! The server's harness fills every output buffer with NaN before a call, so every element must be written.

use crate::matmul;

/// Embedding lookup. `table`: [vocab, dim]; `ids`: [n]; `out`: [n, dim]; out[i, :] = table[ids[i], :].
pub fn embedding(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    assert_eq!(out.len(), ids.len() * dim, "embedding: out must be [n, dim]");
    if dim == 0 {
        return;
    }
    assert_eq!(table.len() % dim, 0, "embedding: table length is not a multiple of dim");
    let vocab = table.len() / dim;
    for (row, &id) in out.chunks_exact_mut(dim).zip(ids) {
        let id = id as usize;
        assert!(id < vocab, "embedding: token id {id} out of range (vocab {vocab})");
        row.copy_from_slice(&table[id * dim..(id + 1) * dim]);
    }
}

/// RMSNorm over the last axis. `x`: [rows, dim] with dim = weight.len(); `weight`: [dim]; `out`: [rows, dim].
/// out[r, i] = x[r, i] / sqrt(mean_j(x[r, j]^2) + eps) * weight[i]   (eps inside the square root).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    if dim == 0 {
        return;
    }
    assert_eq!(x.len() % dim, 0, "rms_norm: x length is not a multiple of dim");
    matmul::vectorized(
        #[inline(always)]
        || {
            for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
                let inv = (1.0 / (sum_squares(xr) / dim as f64 + eps as f64).sqrt()) as f32;
                for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
                    *o = v * inv * w;
                }
            }
        },
    );
}

/// Sum of squares in f64 with 8 independent lanes, reduced by a halving tree.
#[inline(always)]
fn sum_squares(x: &[f32]) -> f64 {
    const L: usize = 8;
    let mut acc = [0.0f64; L];
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            acc[l] += c[l] as f64 * c[l] as f64;
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] += v as f64 * v as f64;
    }
    reduce_lanes(&mut acc)
}

/// Sum of the lanes by a halving tree (lane j + lane j + width, width = L/2, L/4, ..., 1).
#[inline(always)]
fn reduce_lanes<T: Copy + std::ops::AddAssign, const L: usize>(acc: &mut [T; L]) -> T {
    let mut width = L / 2;
    while width > 0 {
        for l in 0..width {
            let v = acc[l + width];
            acc[l] += v;
        }
        width /= 2;
    }
    acc[0]
}

/// Rotary position embedding, rotate-half pairing (HF Llama), in place.
/// `x`: [n_tokens, n_heads, head_dim]; `positions`: [n_tokens]; head_dim even; half = head_dim / 2.
/// For j in 0..half: freq = theta^(-2j / head_dim); angle = positions[t] * freq;
/// (a, b) = (x[j], x[j + half]); x[j] = a cos - b sin; x[j + half] = a sin + b cos.
pub fn rope(x: &mut [f32], positions: &[usize], n_heads: usize, head_dim: usize, theta: f32) {
    assert_eq!(head_dim % 2, 0, "rope: head_dim must be even");
    let token_len = n_heads * head_dim;
    assert_eq!(x.len(), positions.len() * token_len, "rope: x must be [n_tokens, n_heads, head_dim]");
    if token_len == 0 {
        return;
    }
    let half = head_dim / 2;
    let theta = theta as f64;
    for (tok, &pos) in x.chunks_exact_mut(token_len).zip(positions) {
        for j in 0..half {
            let (cos, sin) = rope_cos_sin(pos, rope_freq(theta, j, head_dim));
            for head in tok.chunks_exact_mut(head_dim) {
                let a = head[j];
                let b = head[j + half];
                head[j] = a * cos - b * sin;
                head[j + half] = a * sin + b * cos;
            }
        }
    }
}

/// Rotary frequency of pair j: theta^(-2j / head_dim), in f64.
#[inline]
pub(crate) fn rope_freq(theta: f64, j: usize, head_dim: usize) -> f64 {
    theta.powf(-((2 * j) as f64) / head_dim as f64)
}

/// (cos, sin) of the rotary angle pos * freq, formed in f64 so that large positions keep their
/// precision, rounded to f32.
#[inline]
pub(crate) fn rope_cos_sin(pos: usize, freq: f64) -> (f32, f32) {
    let (sin, cos) = (pos as f64 * freq).sin_cos();
    (cos as f32, sin as f32)
}

/// Rotate one token in place with precomputed angles, exactly as [`rope`] does.
/// `tok`: [n_heads, head_dim]; `cos`, `sin`: [head_dim / 2].
pub(crate) fn rope_apply(tok: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in tok.chunks_exact_mut(head_dim) {
        let (lo, hi) = head.split_at_mut(half);
        for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {
            let (va, vb) = (*a, *b);
            *a = va * c - vb * s;
            *b = va * s + vb * c;
        }
    }
}

/// Linear layer without bias: y = x W^T. `x`: [m, k]; `w`: [n, k] (PyTorch nn.Linear layout); `out`: [m, n].
/// f32 accumulation; AVX-512F or AVX2+FMA kernels when the CPU has them, rows of W split across the
/// engine's team of threads for large matrices.
pub fn linear(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: &mut [f32]) {
    matmul::linear::<matmul::F32>(matmul::detected(), x, w, &[], m, k, n, out);
}

/// y = x W^T with W given as bf16 bit patterns. `x`: [m, k]; `w`: [n, k] (u16 bf16 bits);
/// `out`: [m, n]. Each weight widens exactly to f32; f32 accumulation.
pub fn linear_bf16(x: &[f32], w: &[u16], m: usize, k: usize, n: usize, out: &mut [f32]) {
    matmul::linear::<matmul::Bf16>(matmul::detected(), x, w, &[], m, k, n, out);
}

/// y = x W^T with W given as IEEE binary16 bit patterns. `x`: [m, k]; `w`: [n, k] (u16 f16 bits);
/// `out`: [m, n]. Each weight widens exactly to f32; f32 accumulation.
pub fn linear_f16(x: &[f32], w: &[u16], m: usize, k: usize, n: usize, out: &mut [f32]) {
    matmul::linear::<matmul::F16>(matmul::detected(), x, w, &[], m, k, n, out);
}

/// Weight-only int8 linear layer: out[i, o] = scales[o] * sum_c x[i, c] * (w[o, c] as f32).
/// `x`: [m, k]; `w`: [n, k] i8; `scales`: [n] f32 (one per output row); `out`: [m, n]. f32 accumulation.
pub fn linear_int8(x: &[f32], w: &[i8], scales: &[f32], m: usize, k: usize, n: usize, out: &mut [f32]) {
    matmul::linear::<matmul::I8>(matmul::detected(), x, w, scales, m, k, n, out);
}

/// SwiGLU activation: out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). All: [len].
pub fn silu_and_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), out.len(), "silu_and_mul: gate and out differ in length");
    assert_eq!(up.len(), out.len(), "silu_and_mul: up and out differ in length");
    matmul::vectorized(
        #[inline(always)]
        || {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + exp(-g)) * u;
            }
        },
    );
}

/// e^x in f32 within about 2 ulp, written to vectorise: x = n ln2 + r with |r| <= ln2 / 2,
/// e^r by a degree-7 polynomial (Cephes expf), times 2^n built from its bits. Inputs are clamped to
/// [-87.33, 88] so that 2^n stays a normal number: below, the result is about 1.2e-38 instead of
/// smaller; above, about 1.65e38 instead of larger. NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.33, 88.0);
    // t = ROUND + n with n = round(x / ln2) in [-126, 127]; its bits are 0x4B40_0000 + n.
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r
        + 0.5;
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23)
}

/// Numerically stable softmax over each row, in place. `x`: [rows, n].
pub fn softmax(x: &mut [f32], n: usize) {
    if n == 0 {
        assert!(x.is_empty(), "softmax: n = 0 with a non-empty x");
        return;
    }
    assert_eq!(x.len() % n, 0, "softmax: x length is not a multiple of n");
    matmul::vectorized(
        #[inline(always)]
        || {
            for row in x.chunks_exact_mut(n) {
                softmax_row(row);
            }
        },
    );
}

/// Softmax of one row in place: max, exponentials, a 16-lane sum, one scale.
#[inline(always)]
fn softmax_row(row: &mut [f32]) {
    let max = max(row);
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / sum(row);
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// out[c] = sum_t weights[t] * rows[t * stride + c] for c < out.len(), with even and odd t
/// accumulated separately and added at the end.
#[inline(always)]
fn weighted_rows<O: AsMut<[f32]> + ?Sized>(weights: &[f32], rows: &[f32], stride: usize, out: &mut O) {
    let out = out.as_mut();
    let w = out.len();
    let mut even = [0.0f32; 16];
    let mut odd = [0.0f32; 16];
    let (even, odd) = (&mut even[..w], &mut odd[..w]);
    let pairs = weights.chunks_exact(2);
    let last = pairs.remainder();
    for (p, pair) in pairs.enumerate() {
        let r0 = &rows[2 * p * stride..][..w];
        let r1 = &rows[(2 * p + 1) * stride..][..w];
        for c in 0..w {
            even[c] += pair[0] * r0[c];
            odd[c] += pair[1] * r1[c];
        }
    }
    if let [wl] = last {
        let r = &rows[(weights.len() - 1) * stride..][..w];
        for c in 0..w {
            even[c] += wl * r[c];
        }
    }
    for c in 0..w {
        out[c] = even[c] + odd[c];
    }
}

/// Largest element (NaN is skipped; -inf for an empty or all-NaN row), with 64 independent lanes.
#[inline(always)]
fn max(x: &[f32]) -> f32 {
    const L: usize = 64;
    let mut acc = [f32::NEG_INFINITY; L];
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] = if v > acc[l] { v } else { acc[l] };
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// Sum with 16 independent lanes, reduced by a halving tree.
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            acc[l] += c[l];
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] += v;
    }
    reduce_lanes(&mut acc)
}

/// Causal grouped-query attention of `n_q` new query tokens over a KV cache of `kv_len` positions.
/// `q`: [n_q, n_heads, head_dim]; `k_cache`, `v_cache`: [kv_len, n_kv_heads, head_dim]; `out`: [n_q, n_heads, head_dim].
/// Query token i sits at position p = kv_len - n_q + i and attends to cache positions 0..=p.
/// Query head h reads KV head h / (n_heads / n_kv_heads). Scores are scaled by 1 / sqrt(head_dim).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_q: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let mut scores = vec![0.0f32; kv_len];
    attention_with_scratch(q, k_cache, v_cache, n_q, kv_len, n_heads, n_kv_heads, head_dim, out, &mut scores);
}

/// [`attention`] with a caller-provided score buffer of at least `kv_len` elements, so the model's
/// forward pass does not allocate.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_with_scratch(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_q: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
    scores: &mut [f32],
) {
    assert!(n_q <= kv_len, "attention: n_q ({n_q}) exceeds kv_len ({kv_len})");
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "attention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
    );
    let q_stride = n_heads * head_dim;
    let kv_stride = n_kv_heads * head_dim;
    assert_eq!(q.len(), n_q * q_stride, "attention: q must be [n_q, n_heads, head_dim]");
    assert_eq!(out.len(), n_q * q_stride, "attention: out must be [n_q, n_heads, head_dim]");
    assert!(k_cache.len() >= kv_len * kv_stride, "attention: k_cache shorter than kv_len");
    assert!(v_cache.len() >= kv_len * kv_stride, "attention: v_cache shorter than kv_len");
    assert!(scores.len() >= kv_len, "attention: score scratch shorter than kv_len");
    if head_dim == 0 {
        return;
    }
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    matmul::vectorized(
        #[inline(always)]
        || {
            for i in 0..n_q {
                let span = kv_len - n_q + i + 1;
                for h in 0..n_heads {
                    let kvh = h / group;
                    let q_off = i * q_stride + h * head_dim;
                    let qh = &q[q_off..q_off + head_dim];
                    let sc = &mut scores[..span];
                    matmul::dots(qh, &k_cache[kvh * head_dim..], kv_stride, sc);
                    for s in sc.iter_mut() {
                        *s *= scale;
                    }
                    softmax_row(sc);
                    let v_head = &v_cache[kvh * head_dim..];
                    let oh = &mut out[q_off..q_off + head_dim];
                    for (b, ob) in oh.chunks_mut(16).enumerate() {
                        let rows = &v_head[b * 16..];
                        if ob.len() == 16 {
                            let ob: &mut [f32; 16] = ob.try_into().expect("16 elements");
                            weighted_rows(sc, rows, kv_stride, ob);
                        } else {
                            weighted_rows(sc, rows, kv_stride, ob);
                        }
                    }
                }
            }
        },
    );
}

/// Index of the largest element; the first one on ties. `x`: [n], n >= 1.
/// NaN never wins unless every element is NaN (then 0).
pub fn argmax(x: &[f32]) -> usize {
    assert!(!x.is_empty(), "argmax: empty input");
    matmul::vectorized(
        #[inline(always)]
        || {
            let m = max(x);
            const L: usize = 16;
            let chunks = x.chunks_exact(L);
            let tail = chunks.remainder();
            for (b, c) in chunks.enumerate() {
                if c.iter().fold(false, |hit, &v| hit | (v == m)) {
                    return b * L + c.iter().position(|&v| v == m).unwrap_or(0);
                }
            }
            let base = x.len() - tail.len();
            tail.iter().position(|&v| v == m).map_or(0, |i| base + i)
        },
    )
}

/// Sampling parameters of one request (kernel.sample). Neutral values switch a step off:
/// temperature 1, top_k 0, top_p 1, min_p 0, repetition_penalty 1, frequency and presence penalties 0;
/// temperature 0 is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

/// One token drawn from `logits` ([n]) after penalties for `prev`, temperature, top-k, top-p and min-p,
/// by the inverse CDF in rank order at the uniform number `u` in [0, 1) (see kernel.sample for the order).
pub fn sample(logits: &[f32], prev: &[u32], params: &SamplingParams, u: f32) -> u32 {
    let n = logits.len();
    assert!(n > 0, "sample: empty logits");
    let p = params;
    let mut z = logits.to_vec();
    // Occurrences of each previous token, counted once per distinct id.
    let mut seen: Vec<u32> = prev.iter().copied().filter(|&t| (t as usize) < n).collect();
    seen.sort_unstable();
    let mut i = 0;
    while i < seen.len() {
        let t = seen[i];
        let mut c = 0usize;
        while i < seen.len() && seen[i] == t {
            c += 1;
            i += 1;
        }
        let v = &mut z[t as usize];
        *v = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
        *v -= c as f32 * p.frequency_penalty + p.presence_penalty;
    }
    if p.temperature == 0.0 {
        return argmax(&z) as u32;
    }
    for v in &mut z {
        *v /= p.temperature;
    }
    let rank = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
    let mut order: Vec<u32> = (0..n as u32).collect();
    if p.top_k > 0 && p.top_k < n {
        order.select_nth_unstable_by(p.top_k - 1, rank);
        order.truncate(p.top_k);
    }
    order.sort_unstable_by(rank);
    let top = z[order[0] as usize];
    let mut probs: Vec<f32> = order.iter().map(|&t| (z[t as usize] - top).exp()).collect();
    let total: f32 = probs.iter().sum();
    for q in &mut probs {
        *q /= total;
    }
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut mass = 0.0f32;
        for (j, q) in probs.iter().enumerate() {
            mass += q;
            if mass >= p.top_p {
                keep = j + 1;
                break;
            }
        }
    }
    let floor = p.min_p * probs[0];
    let kept: Vec<(u32, f32)> = order
        .iter()
        .zip(&probs)
        .take(keep)
        .filter(|(_, q)| p.min_p <= 0.0 || **q >= floor)
        .map(|(&t, &q)| (t, q))
        .collect();
    let mass: f32 = kept.iter().map(|(_, q)| q).sum();
    let mut cdf = 0.0f32;
    for &(t, q) in &kept {
        cdf += q / mass;
        if u < cdf {
            return t;
        }
    }
    kept.last().map_or(order[0], |k| k.0)
}

/// out[c] = sum over positions t of weights[t] * v[slot(t), col + c] for c < out.len() (at most
/// 16), where slot(t) is row t % block_size of physical block table[t / block_size]. Even and odd
/// t are accumulated separately and added at the end, in the order of [`weighted_rows`], so a
/// sequence gets the same sums from the paged cache as from a contiguous one.
#[inline(always)]
fn paged_weighted<O: AsMut<[f32]> + ?Sized>(
    weights: &[f32],
    table: &[u32],
    v_cache: &[f32],
    block_size: usize,
    kv_stride: usize,
    col: usize,
    out: &mut O,
) {
    let out = out.as_mut();
    let w = out.len();
    let mut even = [0.0f32; 16];
    let mut odd = [0.0f32; 16];
    let (even, odd) = (&mut even[..w], &mut odd[..w]);
    for (b, wb) in weights.chunks(block_size).enumerate() {
        let base = table[b] as usize * block_size * kv_stride + col;
        let row = |j: usize| &v_cache[base + j * kv_stride..][..w];
        if block_size.is_multiple_of(2) {
            // Every block starts at an even position: pairs (even, odd) within the block.
            let pairs = wb.chunks_exact(2);
            let last = pairs.remainder();
            for (p, pair) in pairs.enumerate() {
                let (r0, r1) = (row(2 * p), row(2 * p + 1));
                for c in 0..w {
                    even[c] += pair[0] * r0[c];
                    odd[c] += pair[1] * r1[c];
                }
            }
            if let [wl] = last {
                let r = row(wb.len() - 1);
                for c in 0..w {
                    even[c] += wl * r[c];
                }
            }
        } else {
            for (j, &wt) in wb.iter().enumerate() {
                let (r, acc) = (row(j), if (b * block_size + j).is_multiple_of(2) { &mut *even } else { &mut *odd });
                for c in 0..w {
                    acc[c] += wt * r[c];
                }
            }
        }
    }
    for c in 0..w {
        out[c] = even[c] + odd[c];
    }
}

/// Causal GQA attention of several sequences over a paged KV cache (kernel.paged_attention).
/// `q`, `out`: [query_start[n_seqs], n_heads, head_dim]; `k_cache`, `v_cache`: [num_blocks, block_size, n_kv_heads, head_dim];
/// `block_table`: [n_seqs, blocks_per_seq] physical block ids; `query_start`: [n_seqs + 1] row offsets into q;
/// `context_lens`: [n_seqs] cached positions per sequence, new tokens included. Query i of sequence s sits at
/// position context_lens[s] - n_q(s) + i.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_table: &[u32],
    blocks_per_seq: usize,
    query_start: &[u32],
    context_lens: &[u32],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    out: &mut [f32],
) {
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && block_size > 0,
        "paged_attention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}), block_size positive"
    );
    let n_seqs = context_lens.len();
    assert_eq!(query_start.len(), n_seqs + 1, "paged_attention: query_start must have n_seqs + 1 entries");
    assert!(block_table.len() >= n_seqs * blocks_per_seq, "paged_attention: block_table shorter than n_seqs rows");
    let (q_stride, kv_stride) = (n_heads * head_dim, n_kv_heads * head_dim);
    assert_eq!(out.len(), q.len(), "paged_attention: out must have q's shape");
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut work = 0;
    for s in 0..n_seqs {
        let (q0, q1) = (query_start[s] as usize, query_start[s + 1] as usize);
        let ctx = context_lens[s] as usize;
        assert!(
            q1 > q0 && q1 - q0 <= ctx,
            "paged_attention: sequence {s} has {} queries over {ctx} positions",
            q1.saturating_sub(q0)
        );
        assert!(ctx.div_ceil(block_size) <= blocks_per_seq, "paged_attention: block table row {s} too short");
        assert!(q1 * q_stride <= q.len(), "paged_attention: query_start[{}] is beyond q", s + 1);
        work += (q1 - q0) * ctx * n_heads * head_dim;
    }
    let out_ptr = matmul::OutPtr(out.as_mut_ptr());
    // All queries of sequence s for head h, with `scores` as scratch (grown to the context).
    // Compiled for the CPU's vector width; keys and values go block by block, each block's rows
    // contiguous at stride kv_stride, positions in order.
    let head = |s: usize, h: usize, scores: &mut Vec<f32>| {
        let (q0, q1) = (query_start[s] as usize, query_start[s + 1] as usize);
        let ctx = context_lens[s] as usize;
        if scores.len() < ctx {
            scores.resize(ctx, 0.0);
        }
        let table = &block_table[s * blocks_per_seq..(s + 1) * blocks_per_seq];
        let kvh = h / group;
        matmul::vectorized(
            #[inline(always)]
            || {
                for i in 0..q1 - q0 {
                    let span = ctx - (q1 - q0) + i + 1;
                    let q_off = (q0 + i) * q_stride + h * head_dim;
                    let qh = &q[q_off..q_off + head_dim];
                    let sc = &mut scores[..span];
                    for (b, sb) in sc.chunks_mut(block_size).enumerate() {
                        let base = table[b] as usize * block_size * kv_stride + kvh * head_dim;
                        matmul::dots(qh, &k_cache[base..], kv_stride, sb);
                    }
                    for x in sc.iter_mut() {
                        *x *= scale;
                    }
                    softmax_row(sc);
                    // SAFETY: out has q's length (asserted) and q_off + head_dim <= q1 * q_stride
                    // <= q.len(); the elements of (row q0 + i, head h) belong to this task alone.
                    let oh = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(q_off), head_dim) };
                    // 16 output columns at a time, summed over the positions in a register.
                    for (cb, ob) in oh.chunks_mut(16).enumerate() {
                        let col = kvh * head_dim + cb * 16;
                        if ob.len() == 16 {
                            let ob: &mut [f32; 16] = ob.try_into().expect("16 elements");
                            paged_weighted(sc, table, v_cache, block_size, kv_stride, col, ob);
                        } else {
                            paged_weighted(sc, table, v_cache, block_size, kv_stride, col, ob);
                        }
                    }
                }
            },
        );
    };
    let team = crate::pool::global();
    let tasks = n_seqs * n_heads;
    if team.size() > 1 && work >= PAR_MIN_ATTENTION && tasks <= crate::pool::MAX_TASKS {
        thread_local! {
            static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        team.for_each(tasks, &|t| SCORES.with_borrow_mut(|sc| head(t / n_heads, t % n_heads, sc)));
    } else {
        let mut scores = Vec::new();
        for s in 0..n_seqs {
            for h in 0..n_heads {
                head(s, h, &mut scores);
            }
        }
    }
}

/// Multiply-adds of query-key products below which [`paged_attention`] stays on one thread: about
/// 5 us of work on one core, a few times the cost of handing tasks to the team.
const PAR_MIN_ATTENTION: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_first_of_ties_and_nan() {
        let nan = f32::NAN;
        assert_eq!(argmax(&[1.0]), 0);
        assert_eq!(argmax(&[nan, 1.0, 1.0]), 1);
        assert_eq!(argmax(&[2.0, nan, 3.0]), 2);
        assert_eq!(argmax(&[nan, nan]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, nan, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[nan, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        let mut long: Vec<f32> = (0..100).map(|i| (i % 37) as f32).collect();
        assert_eq!(argmax(&long), 36);
        long[99] = 50.0;
        assert_eq!(argmax(&long), 99);
        long[20] = 50.0;
        assert_eq!(argmax(&long), 20);
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let rel = ((exp(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
            x += 0.001_7;
        }
        assert!(worst < 2.5e-7, "largest relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1.3e-38 && exp(-1000.0) >= 0.0);
        assert!(exp(f32::NEG_INFINITY) < 1.3e-38);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn silu_and_mul_is_within_contract_tolerance_with_margin() {
        let gate: Vec<f32> = (0..48_000).map(|i| (i as f32 - 24_000.0) * 0.005).collect();
        let up: Vec<f32> = gate.iter().enumerate().map(|(i, _)| [1.0, -3.7, 40.0][i % 3]).collect();
        let mut out = vec![f32::NAN; gate.len()];
        silu_and_mul(&gate, &up, &mut out);
        let mut worst = 0.0f64;
        for ((&o, &g), &u) in out.iter().zip(&gate).zip(&up) {
            let (g, u) = (g as f64, u as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            worst = worst.max((o as f64 - want).abs() / (1e-6 + 1e-5 * want.abs()));
        }
        assert!(worst < 0.1, "largest error is {worst} of the tolerance");
    }

    /// Paged attention over scattered blocks gives, bit for bit, what contiguous attention gives
    /// each sequence alone (same products, same order of sums), on one thread and split over the
    /// team (the first case is above the size where the heads are shared out), at an even and an
    /// odd block size.
    #[test]
    fn paged_attention_equals_contiguous_attention_per_sequence() {
        let (heads, kv_heads, hd) = (4, 2, 40);
        let (qs, kvs) = (heads * hd, kv_heads * hd);
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
                })
                .collect()
        };
        for (seqs, block) in [(vec![(40, 70), (1, 33), (3, 3)], 16), (vec![(5, 12), (1, 9)], 5), (vec![(1, 2)], 16)] {
            // seqs: (queries, context) per sequence.
            let blocks_per: Vec<usize> = seqs.iter().map(|&(_, c): &(usize, usize)| c.div_ceil(block)).collect();
            let bps = *blocks_per.iter().max().unwrap();
            let total: usize = blocks_per.iter().sum();
            // Physical blocks handed out in a scrambled order.
            let mut ids: Vec<u32> = (0..total as u32).collect();
            ids.reverse();
            ids.rotate_left(total / 3);
            let (mut k_cache, mut v_cache) = (vec![0.0f32; total * block * kvs], vec![0.0f32; total * block * kvs]);
            let (mut table, mut query_start, mut ctx_lens) = (vec![u32::MAX; seqs.len() * bps], vec![0u32], vec![]);
            let (mut q, mut want) = (Vec::new(), Vec::new());
            let mut next = 0;
            for (s, &(n_q, ctx)) in seqs.iter().enumerate() {
                let (k, v, qs_) = (rand(ctx * kvs), rand(ctx * kvs), rand(n_q * qs));
                for b in 0..blocks_per[s] {
                    table[s * bps + b] = ids[next];
                    next += 1;
                }
                for t in 0..ctx {
                    let slot = table[s * bps + t / block] as usize * block + t % block;
                    k_cache[slot * kvs..(slot + 1) * kvs].copy_from_slice(&k[t * kvs..(t + 1) * kvs]);
                    v_cache[slot * kvs..(slot + 1) * kvs].copy_from_slice(&v[t * kvs..(t + 1) * kvs]);
                }
                let mut out = vec![f32::NAN; n_q * qs];
                attention(&qs_, &k, &v, n_q, ctx, heads, kv_heads, hd, &mut out);
                want.extend(out);
                q.extend(qs_);
                query_start.push((q.len() / qs) as u32);
                ctx_lens.push(ctx as u32);
            }
            let mut got = vec![f32::NAN; q.len()];
            paged_attention(
                &q,
                &k_cache,
                &v_cache,
                &table,
                bps,
                &query_start,
                &ctx_lens,
                heads,
                kv_heads,
                hd,
                block,
                &mut got,
            );
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "block size {block}: paged attention differs from contiguous attention");
        }
    }

    #[test]
    fn softmax_and_attention_rows_agree_with_f64() {
        let row: Vec<f32> = (0..37).map(|i| ((i * 17 % 11) as f32 - 5.0) * 0.7).collect();
        let mut got = row.clone();
        softmax(&mut got, row.len());
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let total: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        for (&g, &v) in got.iter().zip(&row) {
            let want = (v as f64 - max).exp() / total;
            assert!((g as f64 - want).abs() <= 1e-6 + 1e-5 * want);
        }
        let mut out = [f32::NAN; 3];
        silu_and_mul(&[-100.0, 0.0, 2.0], &[1.0, 5.0, 3.0], &mut out);
        assert!(out[0].abs() < 1e-30 && out[1] == 0.0);
        assert!((out[2] as f64 - 2.0 / (1.0 + (-2.0f64).exp()) * 3.0).abs() < 1e-6);
    }
}
