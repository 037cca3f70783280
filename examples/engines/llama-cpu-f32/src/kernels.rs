//! Phase 1: kernels. Every tensor is a flat row-major `f32` slice; shapes are given in the docs.
//! The server's harness fills every output buffer with NaN before a call, so every element must be written.

/// Embedding lookup. `table`: [vocab, dim]; `ids`: [n]; `out`: [n, dim]; out[i, :] = table[ids[i], :].
pub fn embedding(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        ids.len() * dim,
        "embedding: out must be [n, dim]"
    );
    if dim == 0 {
        return;
    }
    assert_eq!(
        table.len() % dim,
        0,
        "embedding: table length is not a multiple of dim"
    );
    let vocab = table.len() / dim;
    for (row, &id) in out.chunks_exact_mut(dim).zip(ids) {
        let id = id as usize;
        assert!(
            id < vocab,
            "embedding: token id {id} out of range (vocab {vocab})"
        );
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
    assert_eq!(
        x.len() % dim,
        0,
        "rms_norm: x length is not a multiple of dim"
    );
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let sum_sq: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = 1.0 / (sum_sq / dim as f64 + eps as f64).sqrt();
        let inv = inv as f32;
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// Rotary position embedding, rotate-half pairing (HF Llama), in place.
/// `x`: [n_tokens, n_heads, head_dim]; `positions`: [n_tokens]; head_dim even; half = head_dim / 2.
/// For j in 0..half: freq = theta^(-2j / head_dim); angle = positions[t] * freq;
/// (a, b) = (x[j], x[j + half]); x[j] = a cos - b sin; x[j + half] = a sin + b cos.
pub fn rope(x: &mut [f32], positions: &[usize], n_heads: usize, head_dim: usize, theta: f32) {
    assert_eq!(head_dim % 2, 0, "rope: head_dim must be even");
    let token_len = n_heads * head_dim;
    assert_eq!(
        x.len(),
        positions.len() * token_len,
        "rope: x must be [n_tokens, n_heads, head_dim]"
    );
    if token_len == 0 {
        return;
    }
    let half = head_dim / 2;
    let theta = theta as f64;
    for (tok, &pos) in x.chunks_exact_mut(token_len).zip(positions) {
        for j in 0..half {
            // Angles are formed in f64 so that large positions keep their precision.
            let freq = theta.powf(-((2 * j) as f64) / head_dim as f64);
            let (sin, cos) = (pos as f64 * freq).sin_cos();
            let (sin, cos) = (sin as f32, cos as f32);
            for head in tok.chunks_exact_mut(head_dim) {
                let a = head[j];
                let b = head[j + half];
                head[j] = a * cos - b * sin;
                head[j + half] = a * sin + b * cos;
            }
        }
    }
}

/// Number of independent partial sums in [`dot`]; enough to let the compiler keep several SIMD
/// registers busy without reassociating floating-point additions itself.
const LANES: usize = 16;

/// Dot product of two equally long slices with `LANES` independent accumulators.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let a_chunks = a.chunks_exact(LANES);
    let b_chunks = b.chunks_exact(LANES);
    let a_tail = a_chunks.remainder();
    let b_tail = b_chunks.remainder();
    for (ca, cb) in a_chunks.zip(b_chunks) {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut tail = 0.0f32;
    for (&x, &y) in a_tail.iter().zip(b_tail) {
        tail += x * y;
    }
    // Pairwise reduction of the partial sums.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// Linear layer without bias: y = x W^T. `x`: [m, k]; `w`: [n, k] (PyTorch nn.Linear layout); `out`: [m, n].
pub fn linear(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: &mut [f32]) {
    assert_eq!(x.len(), m * k, "linear: x must be [m, k]");
    assert_eq!(w.len(), n * k, "linear: w must be [n, k]");
    assert_eq!(out.len(), m * n, "linear: out must be [m, n]");
    if k == 0 {
        out.fill(0.0);
        return;
    }
    if n == 0 {
        return;
    }
    for (xr, yr) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for (y, wr) in yr.iter_mut().zip(w.chunks_exact(k)) {
            *y = dot(xr, wr);
        }
    }
}

/// SwiGLU activation: out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). All: [len].
pub fn silu_and_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(
        gate.len(),
        out.len(),
        "silu_and_mul: gate and out differ in length"
    );
    assert_eq!(
        up.len(),
        out.len(),
        "silu_and_mul: up and out differ in length"
    );
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// Numerically stable softmax over each row, in place. `x`: [rows, n].
pub fn softmax(x: &mut [f32], n: usize) {
    if n == 0 {
        assert!(x.is_empty(), "softmax: n = 0 with a non-empty x");
        return;
    }
    assert_eq!(x.len() % n, 0, "softmax: x length is not a multiple of n");
    for row in x.chunks_exact_mut(n) {
        softmax_row(row);
    }
}

fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
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
    attention_with_scratch(
        q,
        k_cache,
        v_cache,
        n_q,
        kv_len,
        n_heads,
        n_kv_heads,
        head_dim,
        out,
        &mut scores,
    );
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
    assert!(
        n_q <= kv_len,
        "attention: n_q ({n_q}) exceeds kv_len ({kv_len})"
    );
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "attention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
    );
    let q_stride = n_heads * head_dim;
    let kv_stride = n_kv_heads * head_dim;
    assert_eq!(
        q.len(),
        n_q * q_stride,
        "attention: q must be [n_q, n_heads, head_dim]"
    );
    assert_eq!(
        out.len(),
        n_q * q_stride,
        "attention: out must be [n_q, n_heads, head_dim]"
    );
    assert!(
        k_cache.len() >= kv_len * kv_stride,
        "attention: k_cache shorter than kv_len"
    );
    assert!(
        v_cache.len() >= kv_len * kv_stride,
        "attention: v_cache shorter than kv_len"
    );
    assert!(
        scores.len() >= kv_len,
        "attention: score scratch shorter than kv_len"
    );
    if head_dim == 0 {
        return;
    }
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    for i in 0..n_q {
        let p = kv_len - n_q + i;
        let span = p + 1;
        for h in 0..n_heads {
            let kvh = h / group;
            let q_off = i * q_stride + h * head_dim;
            let qh = &q[q_off..q_off + head_dim];
            let sc = &mut scores[..span];
            for (t, s) in sc.iter_mut().enumerate() {
                let k_off = t * kv_stride + kvh * head_dim;
                *s = dot(qh, &k_cache[k_off..k_off + head_dim]) * scale;
            }
            softmax_row(sc);
            let oh = &mut out[q_off..q_off + head_dim];
            oh.fill(0.0);
            for (t, &wgt) in sc.iter().enumerate() {
                let v_off = t * kv_stride + kvh * head_dim;
                for (o, &v) in oh.iter_mut().zip(&v_cache[v_off..v_off + head_dim]) {
                    *o += wgt * v;
                }
            }
        }
    }
}

/// Index of the largest element; the first one on ties. `x`: [n], n >= 1.
pub fn argmax(x: &[f32]) -> usize {
    assert!(!x.is_empty(), "argmax: empty input");
    let mut best = 0;
    let mut best_v = x[0];
    for (i, &v) in x.iter().enumerate().skip(1) {
        // NaN never wins unless everything before it was NaN.
        if v > best_v || (best_v.is_nan() && !v.is_nan()) {
            best = i;
            best_v = v;
        }
    }
    best
}
