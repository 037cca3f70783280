//! Phase 1, kernels: one public function per kernel contract (`metainfer contract show kernel.NAME`).
//! The signatures are the contracts' `[rust] skeleton`s, which the gates call; each body follows its
//! contract's pseudocode in sequential f32 Rust and asserts the contract's shape preconditions, so a
//! wrong call panics with the kernel's name instead of reading the wrong elements.

/// Contract `kernel.embedding`. Embedding lookup. `table`: [vocab, dim]; `ids`: [n]; `out`: [n, dim];
/// out[i, :] = table[ids[i], :]. An id outside the table panics.
pub fn embedding(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    assert_eq!(out.len(), ids.len() * dim, "embedding: out must be [n, dim]");
    for (i, &id) in ids.iter().enumerate() {
        let id = id as usize;
        out[i * dim..(i + 1) * dim].copy_from_slice(&table[id * dim..(id + 1) * dim]);
    }
}

/// Contract `kernel.rms_norm`. RMSNorm over the last axis. `x`: [rows, dim] with dim = weight.len();
/// `weight`: [dim]; `out`: [rows, dim].
/// out[r, i] = x[r, i] / sqrt(mean_j(x[r, j]^2) + eps) * weight[i]   (eps inside the square root).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert!(dim > 0 && x.len().is_multiple_of(dim) && out.len() == x.len(), "rms_norm: x and out must be [rows, dim]");
    for r in 0..x.len() / dim {
        let row = &x[r * dim..(r + 1) * dim];
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        for i in 0..dim {
            out[r * dim + i] = row[i] * inv * weight[i];
        }
    }
}

/// Contract `kernel.layer_norm`. LayerNorm over rows of `dim` entries. `x`: [rows, dim]; `weight`,
/// `bias`: [dim] or empty (absent: gain 1, bias 0); `out`: [rows, dim].
/// out[r, i] = (x[r, i] - mean_r) / sqrt(var_r + eps) * weight[i] + bias[i], var_r the biased
/// variance of row r (divided by dim), computed in two passes over the row.
pub fn layer_norm(x: &[f32], dim: usize, weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        dim > 0 && x.len().is_multiple_of(dim) && out.len() == x.len(),
        "layer_norm: x and out must be [rows, dim]"
    );
    assert!(
        (weight.is_empty() || weight.len() == dim) && (bias.is_empty() || bias.len() == dim),
        "layer_norm: weight and bias must each be empty or [dim]"
    );
    for r in 0..x.len() / dim {
        let row = &x[r * dim..(r + 1) * dim];
        let mean = row.iter().sum::<f32>() / dim as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for i in 0..dim {
            let mut y = (row[i] - mean) * inv;
            if !weight.is_empty() {
                y *= weight[i];
            }
            if !bias.is_empty() {
                y += bias[i];
            }
            out[r * dim + i] = y;
        }
    }
}

/// Contract `kernel.rope`. Rotary position embedding, rotate-half pairing (HF Llama), in place.
/// `x`: [n_tokens, n_heads, head_dim]; `positions`: [n_tokens]; head_dim even; half = head_dim / 2.
/// For j in 0..half: freq = theta^(-2j / head_dim); angle = positions[t] * freq;
/// (a, b) = (x[j], x[j + half]); x[j] = a cos - b sin; x[j + half] = a sin + b cos.
pub fn rope(x: &mut [f32], positions: &[usize], n_heads: usize, head_dim: usize, theta: f32) {
    assert!(head_dim.is_multiple_of(2), "rope: head_dim must be even");
    rope_with_freqs(x, positions, n_heads, &rope_freqs(theta as f64, head_dim));
}

/// RoPE frequencies f_j = theta^(-2j / head_dim) for j in 0..head_dim / 2 (contract `kernel.rope`),
/// in f64. A model with RoPE scaling rescales them (see `config::Config::rope_freqs`).
pub fn rope_freqs(theta: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2).map(|j| theta.powf(-((2 * j) as f64) / head_dim as f64)).collect()
}

/// The rotation of contract `kernel.rope` with given frequencies, in place: `x`: [n_tokens, n_heads,
/// head_dim] with head_dim = 2 * freqs.len(); `positions`: [n_tokens]. Element j of a head is paired
/// with element j + head_dim / 2. The angle is formed in f64 (exact enough at any position), then
/// cos and sin are rounded to f32.
pub fn rope_with_freqs(x: &mut [f32], positions: &[usize], n_heads: usize, freqs: &[f64]) {
    let head_dim = 2 * freqs.len();
    assert_eq!(x.len(), positions.len() * n_heads * head_dim, "rope: x must be [n_tokens, n_heads, head_dim]");
    // kernel.rotary's rotation over the whole head, half-split pairs.
    rotary_with_freqs(x, positions, n_heads, head_dim, freqs, false);
}

/// Contract `kernel.rotary`. Partial rotary RoPE, in place. `x`: [n_tokens, n_heads, head_dim];
/// `positions`: [n_tokens]. The first `rotary_dim` entries of each head are rotated, pairs
/// (j, j + rotary_dim/2) or, when `interleaved`, (2j, 2j + 1), by pos * theta^(-2j/rotary_dim);
/// the rest are unchanged.
pub fn rotary(
    x: &mut [f32],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f32,
    interleaved: bool,
) {
    assert!(
        rotary_dim.is_multiple_of(2) && (2..=head_dim).contains(&rotary_dim),
        "rotary: rotary_dim must be even and in 2..=head_dim"
    );
    rotary_with_freqs(x, positions, n_heads, head_dim, &rope_freqs(theta as f64, rotary_dim), interleaved);
}

/// The rotation of contract `kernel.rotary` with given frequencies [rotary_dim / 2], in place:
/// `x`: [n_tokens, n_heads, head_dim], the first 2 * freqs.len() entries of each head rotated,
/// rotate-half pairs (j, j + freqs.len()) or interleaved pairs (2j, 2j + 1); the angle in f64.
pub fn rotary_with_freqs(
    x: &mut [f32],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    freqs: &[f64],
    interleaved: bool,
) {
    let half = freqs.len();
    assert!(half >= 1 && 2 * half <= head_dim, "rotary: 2 * freqs.len() must be in 2..=head_dim");
    assert_eq!(x.len(), positions.len() * n_heads * head_dim, "rotary: x must be [n_tokens, n_heads, head_dim]");
    for (t, &pos) in positions.iter().enumerate() {
        for (j, &freq) in freqs.iter().enumerate() {
            let (sin, cos) = (pos as f64 * freq).sin_cos();
            let (sin, cos) = (sin as f32, cos as f32);
            for h in 0..n_heads {
                let base = (t * n_heads + h) * head_dim;
                let (ia, ib) = if interleaved { (base + 2 * j, base + 2 * j + 1) } else { (base + j, base + j + half) };
                let (a, b) = (x[ia], x[ib]);
                x[ia] = a * cos - b * sin;
                x[ib] = a * sin + b * cos;
            }
        }
    }
}

/// Contract `kernel.linear`. Linear layer without bias: y = x W^T. `x`: [m, k]; `w`: [n, k] (PyTorch
/// nn.Linear layout); `out`: [m, n].
pub fn linear(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: &mut [f32]) {
    assert!(x.len() == m * k && w.len() == n * k && out.len() == m * n, "linear: x [m, k], w [n, k], out [m, n]");
    // Weight rows outside, input rows inside: each row of w is read once for all m rows of x (a
    // batched step's one weight read); every output is the same dot product in either order.
    for o in 0..n {
        let wo = &w[o * k..(o + 1) * k];
        for i in 0..m {
            out[i * n + o] = dot(&x[i * k..(i + 1) * k], wo);
        }
    }
}

/// Dot product of two equally long rows with eight independent partial sums (contract
/// `kernel.linear`, pseudocode step 4), which the compiler vectorises without intrinsics.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (chunks_a, chunks_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = chunks_a.remainder().iter().zip(chunks_b.remainder()).map(|(x, y)| x * y).sum();
    for (ca, cb) in chunks_a.zip(chunks_b) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Contract `kernel.silu_and_mul`. SwiGLU activation: out[i] = silu(gate[i]) * up[i],
/// silu(g) = g / (1 + exp(-g)). All: [len].
pub fn silu_and_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "silu_and_mul: gate, up and out must have one length");
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
    }
}

/// Contract `kernel.gelu_tanh_and_mul`. GeGLU activation: out[i] = gelu_tanh(gate[i]) * up[i],
/// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))). All: [len].
pub fn gelu_tanh_and_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "gelu_tanh_and_mul: gate, up and out must have one length"
    );
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = 0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)).tanh()) * up[i];
    }
}

/// Contract `kernel.gelu_tanh`. GELU, tanh approximation: out[i] = 0.5 x (1 + tanh(sqrt(2/pi)
/// (x + 0.044715 x^3))), x = x[i]. Both: [len].
pub fn gelu_tanh(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "gelu_tanh: x and out must have one length");
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (o, &g) in out.iter_mut().zip(x) {
        *o = 0.5 * g * (1.0 + (SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)).tanh());
    }
}

/// Contract `kernel.softmax`. Numerically stable softmax over each row, in place. `x`: [rows, n].
pub fn softmax(x: &mut [f32], n: usize) {
    assert!(n > 0 && x.len().is_multiple_of(n), "softmax: x must be [rows, n]");
    for row in x.chunks_exact_mut(n) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum = 0.0;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
}

/// Contract `kernel.attention`. Causal grouped-query attention of `n_q` new query tokens over a KV
/// cache of `kv_len` positions.
/// `q`: [n_q, n_heads, head_dim]; `k_cache`, `v_cache`: [kv_len, n_kv_heads, head_dim]; `out`: [n_q, n_heads, head_dim].
/// Query token i sits at position p = kv_len - n_q + i and attends to cache positions 0..=p.
/// Query head h reads KV head h / (n_heads / n_kv_heads). Scores are scaled by 1 / sqrt(head_dim).
#[allow(clippy::too_many_arguments)] // the contract's signature
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
    let scale = 1.0 / (head_dim as f32).sqrt();
    attention_with(q, k_cache, v_cache, n_q, kv_len, n_heads, n_kv_heads, head_dim, scale, None, out);
}

/// [`attention`] with the scores scaled by `scale` instead of 1 / sqrt(head_dim) (Granite's
/// attention_multiplier, Gemma 2's query_pre_attn_scalar^(-1/2)) and, with `softcap` (Gemma 2's
/// attn_logit_softcapping), capped as cap * tanh(score / cap) before the softmax.
#[allow(clippy::too_many_arguments)] // attention's signature and the two refinements
pub fn attention_with(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_q: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) {
    attend(q, k_cache, v_cache, n_q, kv_len, n_heads, n_kv_heads, head_dim, scale, softcap, None, out);
}

/// Contract `kernel.attention_sinks`.
/// Causal attention with a learned sink logit per query head in the softmax denominator (GPT-OSS;
/// Xiao et al. 2023, attention sinks; transformers' GptOssAttention, eager_attention_forward).
/// `q`: [n_q, n_heads, head_dim], the last n_q of the kv_len cached positions; `k_cache`,
/// `v_cache`: [kv_len, n_kv_heads, head_dim]; `sinks`: [n_heads]; `out`: [n_q, n_heads, head_dim].
///
/// As [`attention`] (query token i at position p = kv_len - n_q + i sees cache rows 0..=p, query head
/// h reads KV head h / (n_heads / n_kv_heads), scores s_t = q.k_t / sqrt(head_dim)), with head h's
/// sink joining the softmax without a value: m = max(max_t s_t, sinks[h]), p_t = exp(s_t - m) /
/// (sum_u exp(s_u - m) + exp(sinks[h] - m)), out = sum_t p_t v_t. The weights sum to less than 1.
/// No window argument: a sliding-window layer passes only its window's rows.
#[allow(clippy::too_many_arguments)] // attention's signature and the sinks
pub fn attention_sinks(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    sinks: &[f32],
    n_q: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    assert_eq!(sinks.len(), n_heads, "attention_sinks: sinks must be [n_heads]");
    let scale = 1.0 / (head_dim as f32).sqrt();
    attend(q, k_cache, v_cache, n_q, kv_len, n_heads, n_kv_heads, head_dim, scale, None, Some(sinks), out);
}

/// The loop of [`attention_with`] and [`attention_sinks`]: scores scaled by `scale`, capped with
/// `softcap`, softmaxed with head h's sink `sinks[h]` in the denominator when given.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    n_q: usize,
    kv_len: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
        "attention: n_heads must be a multiple of n_kv_heads"
    );
    assert!(1 <= n_q && n_q <= kv_len, "attention: need 1 <= n_q <= kv_len");
    let kv_size = kv_len * n_kv_heads * head_dim;
    assert!(k_cache.len() >= kv_size && v_cache.len() >= kv_size, "attention: caches must hold kv_len rows");
    assert!(
        q.len() == n_q * n_heads * head_dim && out.len() == q.len(),
        "attention: q and out must be [n_q, n_heads, head_dim]"
    );
    let group = n_heads / n_kv_heads;
    let mut scores = vec![0.0f32; kv_len];
    for i in 0..n_q {
        let p = kv_len - n_q + i;
        for h in 0..n_heads {
            let g = h / group;
            let qh = &q[(i * n_heads + h) * head_dim..][..head_dim];
            let weights = &mut scores[..=p];
            for (t, s) in weights.iter_mut().enumerate() {
                *s = scale * dot(qh, &k_cache[(t * n_kv_heads + g) * head_dim..][..head_dim]);
            }
            if let Some(cap) = softcap {
                weights.iter_mut().for_each(|s| *s = (*s / cap).tanh() * cap);
            }
            match sinks {
                None => softmax(weights, p + 1),
                Some(sinks) => softmax_with_sink(weights, sinks[h]),
            }
            let oh = &mut out[(i * n_heads + h) * head_dim..][..head_dim];
            oh.fill(0.0);
            for (t, &w) in weights.iter().enumerate() {
                let vt = &v_cache[(t * n_kv_heads + g) * head_dim..][..head_dim];
                for d in 0..head_dim {
                    oh[d] += w * vt[d];
                }
            }
        }
    }
}

/// Softmax of `x` with one more logit `sink` in the denominator, in place (GPT-OSS's attention
/// sinks): m = max(max x, sink); x[t] = exp(x[t] - m) / (sum_u exp(x[u] - m) + exp(sink - m)).
fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().fold(sink, |m, &v| m.max(v));
    let mut sum = (sink - max).exp();
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Contract `kernel.paged_attention`. Causal GQA attention of several sequences over a paged KV cache.
/// `q`, `out`: [query_start[n_seqs], n_heads, head_dim]; `k_cache`, `v_cache`: [num_blocks, block_size,
/// n_kv_heads, head_dim]; `block_table`: [n_seqs, blocks_per_seq] physical block ids; `query_start`:
/// [n_seqs + 1] row offsets into q; `context_lens`: [n_seqs] cached positions per sequence, new tokens
/// included. Query i of sequence s sits at position context_lens[s] - n_q(s) + i.
///
/// Position t of sequence s lives in block block_table[s * blocks_per_seq + t / block_size], slot
/// t % block_size; per sequence this is [`attention`] on its gathered rows. Only the first
/// ceil(context_lens[s] / block_size) entries of a table row are read.
#[allow(clippy::too_many_arguments)] // the contract's signature
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
    let scores = Scores { scale: 1.0 / (head_dim as f32).sqrt(), softcap: None, sinks: None, window: 0 };
    let shape = PagedShape { n_heads, n_kv_heads, head_dim, block_size, blocks_per_seq };
    paged_attention_with(q, k_cache, v_cache, block_table, query_start, context_lens, &shape, &scores, out);
}

/// The dimensions of a paged attention call (the scalar arguments of [`paged_attention`]).
pub struct PagedShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub blocks_per_seq: usize,
}

/// How a family's attention refines the scores of kernel.attention: the refinements of
/// [`attention_with`] and [`attention_sinks`], and a sliding-window layer's window.
pub struct Scores<'a> {
    /// Scale of q.k (1 / sqrt(head_dim) in the contract).
    pub scale: f32,
    /// Gemma 2's soft-cap: cap * tanh(score / cap) before the softmax.
    pub softcap: Option<f32>,
    /// GPT-OSS: each query head's sink logit in the softmax denominator, [n_heads].
    pub sinks: Option<&'a [f32]>,
    /// Positions a query sees, its own included (sliding-window layers); 0: every earlier one.
    pub window: usize,
}

/// [`paged_attention`] with a family's [`Scores`]: query i of sequence s at position p sees positions
/// max(0, p + 1 - window)..=p (all of 0..=p when window is 0), read through the block table a block
/// at a time. Per query this is exactly what [`attention_with`] or [`attention_sinks`] compute on the
/// window's rows gathered (the same products, softmax and sums in the same order), so a batched step
/// gives the single-token forward's values to the bit.
#[allow(clippy::too_many_arguments)] // paged_attention's arrays and the two descriptions
pub fn paged_attention_with(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_table: &[u32],
    query_start: &[u32],
    context_lens: &[u32],
    shape: &PagedShape,
    scores: &Scores,
    out: &mut [f32],
) {
    let PagedShape { n_heads, n_kv_heads, head_dim, block_size, blocks_per_seq } = *shape;
    assert!(
        n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && block_size > 0,
        "paged_attention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}), block_size positive"
    );
    let n_seqs = context_lens.len();
    assert_eq!(query_start.len(), n_seqs + 1, "paged_attention: query_start must have n_seqs + 1 entries");
    assert!(
        block_table.len() >= n_seqs * blocks_per_seq,
        "paged_attention: block_table must be [n_seqs, blocks_per_seq]"
    );
    let (q_stride, kv_stride) = (n_heads * head_dim, n_kv_heads * head_dim);
    assert!(
        q.len() == query_start[n_seqs] as usize * q_stride && out.len() == q.len(),
        "paged_attention: q and out must be [query_start[n_seqs], n_heads, head_dim]"
    );
    assert!(
        k_cache.len().is_multiple_of(block_size * kv_stride) && v_cache.len() == k_cache.len(),
        "paged_attention: caches must be [num_blocks, block_size, n_kv_heads, head_dim]"
    );
    if let Some(sinks) = scores.sinks {
        assert_eq!(sinks.len(), n_heads, "paged_attention: sinks must be [n_heads]");
    }
    let group = n_heads / n_kv_heads;
    let longest = context_lens.iter().map(|&l| l as usize).max().unwrap_or(0);
    let mut weights = vec![0.0f32; longest];
    for s in 0..n_seqs {
        let (q0, q1, len) = (query_start[s] as usize, query_start[s + 1] as usize, context_lens[s] as usize);
        assert!(
            q0 < q1 && q1 - q0 <= len,
            "paged_attention: sequence {s} has {} queries over {len} positions",
            q1 - q0
        );
        assert!(len.div_ceil(block_size) <= blocks_per_seq, "paged_attention: block table row {s} is too short");
        let table = &block_table[s * blocks_per_seq..(s + 1) * blocks_per_seq];
        for i in 0..q1 - q0 {
            let p = len - (q1 - q0) + i;
            let first = if scores.window > 0 { (p + 1).saturating_sub(scores.window) } else { 0 };
            for h in 0..n_heads {
                let g = h / group;
                let qh = &q[(q0 + i) * q_stride + h * head_dim..][..head_dim];
                let w = &mut weights[..p + 1 - first];
                walk_blocks(table, block_size, first..p + 1, |t, slot| {
                    w[t - first] = scores.scale * dot(qh, &k_cache[slot * kv_stride + g * head_dim..][..head_dim]);
                });
                if let Some(cap) = scores.softcap {
                    w.iter_mut().for_each(|s| *s = (*s / cap).tanh() * cap);
                }
                match scores.sinks {
                    None => softmax(w, p + 1 - first),
                    Some(sinks) => softmax_with_sink(w, sinks[h]),
                }
                let oh = &mut out[(q0 + i) * q_stride + h * head_dim..][..head_dim];
                oh.fill(0.0);
                walk_blocks(table, block_size, first..p + 1, |t, slot| {
                    let vt = &v_cache[slot * kv_stride + g * head_dim..][..head_dim];
                    for d in 0..head_dim {
                        oh[d] += w[t - first] * vt[d];
                    }
                });
            }
        }
    }
}

/// Call `f(t, slot)` for each position t of `positions` in order, slot = its physical slot
/// (block * block_size + t % block_size) through the block table `table`: one lookup per block.
fn walk_blocks(table: &[u32], block_size: usize, positions: std::ops::Range<usize>, mut f: impl FnMut(usize, usize)) {
    let mut t = positions.start;
    while t < positions.end {
        let (base, offset) = (table[t / block_size] as usize * block_size, t % block_size);
        let count = (block_size - offset).min(positions.end - t);
        for j in 0..count {
            f(t + j, base + offset + j);
        }
        t += count;
    }
}

/// Contract `kernel.moe_route`.
/// Router weights of one token: softmax over `scores` [n_experts], the `top_k` largest kept (ties: lower index first), renormalised to sum 1 when `renormalize`; `out` [n_experts]: the kept weights at their expert index, 0 elsewhere.
///
/// p[e] = exp(s[e] - max s) / sum_j exp(s[j] - max s) over all experts (kernel.softmax); K = the
/// top_k experts of largest score, by a stable sort (equal scores: the lower index first);
/// out[e] = p[e] / sum_{j in K} p[j] when `renormalize` (Mixtral; Qwen3-MoE with norm_topk_prob),
/// else p[e], for e in K; out[e] = 0 for the others (Jiang et al. 2024, Mixtral of Experts, eq. 1-2;
/// transformers' Qwen3MoeSparseMoeBlock: softmax, topk, division by the sum). Scores must be finite.
pub fn moe_route(scores: &[f32], top_k: usize, renormalize: bool, out: &mut [f32]) {
    let n = scores.len();
    assert!(n >= 1 && out.len() == n, "moe_route: scores and out must be [n_experts], n_experts >= 1");
    assert!((1..=n).contains(&top_k), "moe_route: top_k {top_k} must be in 1..=n_experts ({n})");
    assert!(scores.iter().all(|s| s.is_finite()), "moe_route: router scores must be finite, got {scores:?}");
    let mut p = scores.to_vec();
    softmax(&mut p, n);
    // Experts by score, largest first; the sort is stable, so equal scores keep index order.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).expect("finite scores are ordered"));
    let kept = &order[..top_k];
    let total: f32 = kept.iter().map(|&e| p[e]).sum();
    out.fill(0.0);
    for &e in kept {
        out[e] = if renormalize { p[e] / total } else { p[e] };
    }
}

/// Contract `kernel.moe_experts`.
/// SwiGLU experts of one token weighted by `route` [n_experts] (only experts with route[e] != 0 are computed): out = sum_e route[e] * (silu(x G_e^T) * (x U_e^T)) D_e^T. x, out: [hidden]; gate, up: [n_experts, inter, hidden]; down: [n_experts, hidden, inter].
///
/// Expert e's matrices are the e-th blocks: G_e = gate[e * inter * hidden..][..inter * hidden]
/// ([inter, hidden], nn.Linear layout), likewise U_e, and D_e = down[e * hidden * inter..] ([hidden,
/// inter]). For each e with route[e] != 0, in index order: g = x G_e^T, u = x U_e^T (kernel.linear),
/// a = silu(g) * u (kernel.silu_and_mul), y = a D_e^T, out += route[e] * y (Jiang et al. 2024,
/// eq. 2; Shazeer 2020, SwiGLU). An expert of weight 0 is never read.
pub fn moe_experts(x: &[f32], route: &[f32], gate: &[f32], up: &[f32], down: &[f32], inter: usize, out: &mut [f32]) {
    let (hidden, n_experts) = (x.len(), route.len());
    let size = inter * hidden;
    assert_eq!(out.len(), hidden, "moe_experts: x and out must be [hidden]");
    assert!(
        gate.len() == n_experts * size && up.len() == gate.len() && down.len() == gate.len(),
        "moe_experts: gate, up, down must hold n_experts * inter * hidden"
    );
    let mut y = vec![0.0; hidden];
    out.fill(0.0);
    for (e, &weight) in route.iter().enumerate() {
        if weight == 0.0 {
            continue;
        }
        let block = e * size..(e + 1) * size;
        expert_swiglu(x, 1, &gate[block.clone()], &up[block.clone()], &down[block], inter, &mut y);
        for (o, v) in out.iter_mut().zip(&y) {
            *o += weight * v;
        }
    }
}

/// One expert of kernel.moe_experts on `m` rows: y = (silu(x G^T) * (x U^T)) D^T. `x`, `y`: [m,
/// hidden]; `gate`, `up`: [inter, hidden]; `down`: [hidden, inter] (one expert's blocks). Each
/// weight row is read once for all m rows (kernel.linear), so a batched step runs an expert once
/// for every row routed to it; each row's values are those of m = 1.
pub fn expert_swiglu(x: &[f32], m: usize, gate: &[f32], up: &[f32], down: &[f32], inter: usize, y: &mut [f32]) {
    let hidden = y.len() / m.max(1);
    assert!(x.len() == m * hidden && y.len() == m * hidden, "expert_swiglu: x and y must be [m, hidden]");
    let (mut g, mut u, mut a) = (vec![0.0; m * inter], vec![0.0; m * inter], vec![0.0; m * inter]);
    linear(x, gate, m, hidden, inter, &mut g);
    linear(x, up, m, hidden, inter, &mut u);
    silu_and_mul(&g, &u, &mut a);
    linear(&a, down, m, inter, hidden, y);
}

/// Contract `kernel.moe_experts_clamped`.
/// gpt-oss experts: clamped SwiGLU over fused, input-major expert tensors with biases, weighted by
/// `route` [n_experts] (only experts with route[e] != 0 are computed, the others never read).
/// x, out: [hidden]; gate_up: [n_experts, hidden, 2 * inter]; gate_up_bias: [n_experts, 2 * inter];
/// down: [n_experts, inter, hidden]; down_bias: [n_experts, hidden].
///
/// transformers' GptOssExperts: for each e with route[e] != 0, in index order:
/// y = x gate_up[e] + gate_up_bias[e] ([2 * inter]; y[j] = sum_h x[h] gate_up[e, h, j], the stored
/// matrix is input-major, not nn.Linear's layout); gate_j = min(y[2j], limit), up_j = clamp(y[2j + 1],
/// -limit, limit) (gate and up interleaved, not halves); act_j = (up_j + 1) * gate_j *
/// sigmoid(alpha * gate_j); z = act down[e] + down_bias[e] ([hidden]; z[c] = sum_j act_j down[e, j,
/// c]); out += route[e] * z. GPT-OSS: alpha 1.702, limit 7. `out` is overwritten.
#[allow(clippy::too_many_arguments)] // the kernel's signature
pub fn moe_experts_clamped(
    x: &[f32],
    route: &[f32],
    gate_up: &[f32],
    gate_up_bias: &[f32],
    down: &[f32],
    down_bias: &[f32],
    inter: usize,
    alpha: f32,
    limit: f32,
    out: &mut [f32],
) {
    let (hidden, n_experts) = (x.len(), route.len());
    assert_eq!(out.len(), hidden, "moe_experts_clamped: x and out must be [hidden]");
    assert!(
        gate_up.len() == n_experts * hidden * 2 * inter && down.len() == n_experts * inter * hidden,
        "moe_experts_clamped: want gate_up [E, hidden, 2 inter], down [E, inter, hidden]"
    );
    assert!(
        gate_up_bias.len() == n_experts * 2 * inter && down_bias.len() == n_experts * hidden,
        "moe_experts_clamped: gate_up_bias must be [n_experts, 2 * inter], down_bias [n_experts, hidden]"
    );
    let mut z = vec![0.0f32; hidden];
    out.fill(0.0);
    for (e, &weight) in route.iter().enumerate() {
        if weight == 0.0 {
            continue;
        }
        let gu = &gate_up[e * hidden * 2 * inter..][..hidden * 2 * inter];
        let dn = &down[e * inter * hidden..][..inter * hidden];
        let (gu_bias, dn_bias) = (&gate_up_bias[e * 2 * inter..][..2 * inter], &down_bias[e * hidden..][..hidden]);
        expert_clamped(x, 1, gu, gu_bias, dn, dn_bias, inter, alpha, limit, &mut z);
        for (o, &zc) in out.iter_mut().zip(&z) {
            *o += weight * zc;
        }
    }
}

/// One expert of kernel.moe_experts_clamped on `m` rows: z = act down + down_bias with act the
/// clamped SwiGLU of y = x gate_up + gate_up_bias (see [`moe_experts_clamped`]). `x`, `z`: [m,
/// hidden]; `gate_up`: [hidden, 2 * inter] and `down`: [inter, hidden] (input-major, one expert's
/// blocks); `gate_up_bias`: [2 * inter]; `down_bias`: [hidden]. Each weight row is read once for all
/// m rows; each row's values are those of m = 1 (the same sums in the same order).
#[allow(clippy::too_many_arguments)] // moe_experts_clamped's arguments for one expert, and m
pub fn expert_clamped(
    x: &[f32],
    m: usize,
    gate_up: &[f32],
    gate_up_bias: &[f32],
    down: &[f32],
    down_bias: &[f32],
    inter: usize,
    alpha: f32,
    limit: f32,
    z: &mut [f32],
) {
    let hidden = down_bias.len();
    assert!(x.len() == m * hidden && z.len() == m * hidden, "expert_clamped: x and z must be [m, hidden]");
    assert!(
        gate_up.len() == hidden * 2 * inter && gate_up_bias.len() == 2 * inter && down.len() == inter * hidden,
        "expert_clamped: want gate_up [hidden, 2 inter] + bias, down [inter, hidden]"
    );
    let (mut y, mut act) = (vec![0.0f32; m * 2 * inter], vec![0.0f32; m * inter]);
    for h in 0..hidden {
        let w = &gate_up[h * 2 * inter..][..2 * inter];
        for r in 0..m {
            let xh = x[r * hidden + h];
            for (yj, &wj) in y[r * 2 * inter..][..2 * inter].iter_mut().zip(w) {
                *yj += xh * wj;
            }
        }
    }
    for (yr, ar) in y.chunks_exact_mut(2 * inter).zip(act.chunks_exact_mut(inter)) {
        for (yj, &b) in yr.iter_mut().zip(gate_up_bias) {
            *yj += b;
        }
        for j in 0..inter {
            let gate = yr[2 * j].min(limit);
            let up = yr[2 * j + 1].clamp(-limit, limit);
            ar[j] = (up + 1.0) * (gate / (1.0 + (-alpha * gate).exp()));
        }
    }
    z.fill(0.0);
    for j in 0..inter {
        let w = &down[j * hidden..][..hidden];
        for r in 0..m {
            let a = act[r * inter + j];
            for (zc, &wc) in z[r * hidden..][..hidden].iter_mut().zip(w) {
                *zc += a * wc;
            }
        }
    }
    for zr in z.chunks_exact_mut(hidden) {
        for (zc, &b) in zr.iter_mut().zip(down_bias) {
            *zc += b;
        }
    }
}

/// Contract `kernel.argmax`. Index of the largest element; the first one on ties. `x`: [n], n >= 1.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for i in 1..x.len() {
        if x[i] > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    //! Each kernel against values worked out by hand from its contract's formula (the expected
    //! numbers were computed independently in f64, e.g. with Python's math module).
    use super::*;

    fn close(got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "lengths differ: {got:?} against {want:?}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= tol, "element {i}: {g} against {w}");
        }
    }

    #[test]
    fn embedding_copies_the_rows_of_the_ids() {
        let table = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let mut out = [0.0; 6];
        embedding(&table, 2, &[2, 0, 2], &mut out);
        assert_eq!(out, [20.0, 21.0, 0.0, 1.0, 20.0, 21.0]);
    }

    #[test]
    fn rms_norm_divides_by_the_root_mean_square_and_scales() {
        // mean(1, 4, 9, 16) = 7.5; out = x / sqrt(7.5) * w.
        let mut out = [0.0; 4];
        rms_norm(&[1.0, 2.0, 3.0, 4.0], &[1.0, 1.0, 2.0, 0.5], 0.0, &mut out);
        close(
            &out,
            &[0.365_148_371_670_110_7, 0.730_296_743_340_221_4, 2.190_890_230_020_664, 0.730_296_743_340_221_4],
            1e-6,
        );
        // eps sits inside the root: a zero row stays zero (0 / sqrt(eps)).
        rms_norm(&[0.0; 4], &[1.0; 4], 1e-6, &mut out);
        assert_eq!(out, [0.0; 4]);
    }

    #[test]
    fn rope_rotates_element_j_with_element_j_plus_half() {
        // head_dim 4, theta 10000: frequencies 1 and 10000^(-1/2) = 0.01. At position 1 the pair
        // (x0, x2) = (1, 3) turns by 1 rad and (x1, x3) = (2, 4) by 0.01 rad.
        let mut x = [1.0, 2.0, 3.0, 4.0];
        rope(&mut x, &[1], 1, 4, 10000.0);
        close(
            &x,
            &[-1.984_110_648_555_549_5, 1.959_900_667_496_664, 2.462_377_902_412_315_6, 4.019_799_668_334_994],
            1e-6,
        );
        // Position 0 is the identity.
        let mut y = [1.0, 2.0, 3.0, 4.0];
        rope(&mut y, &[0], 1, 4, 10000.0);
        assert_eq!(y, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn layer_norm_subtracts_the_mean_divides_by_the_deviation_then_scales_and_shifts() {
        // mean(1, 2, 3, 4) = 2.5, biased variance 1.25: (x - 2.5) / sqrt(1.25) * w + b.
        let mut out = [0.0; 4];
        layer_norm(&[1.0, 2.0, 3.0, 4.0], 4, &[1.0, 1.0, 2.0, 0.5], &[0.0, 1.0, 0.0, -1.0], 0.0, &mut out);
        close(
            &out,
            &[-1.341_640_786_499_873_8, 0.552_786_404_500_042_1, 0.894_427_190_999_915_9, -0.329_179_606_750_063_1],
            1e-6,
        );
        // No gain and no bias (OLMo's non-parametric LayerNorm).
        layer_norm(&[1.0, 2.0, 3.0, 4.0], 4, &[], &[], 0.0, &mut out);
        close(
            &out,
            &[-1.341_640_786_499_873_8, -0.447_213_595_499_957_9, 0.447_213_595_499_957_9, 1.341_640_786_499_873_8],
            1e-6,
        );
        // A constant row is all mean: zero (an RMSNorm would give ones).
        layer_norm(&[5.0; 4], 4, &[], &[], 1e-5, &mut out);
        assert_eq!(out, [0.0; 4]);
    }

    #[test]
    fn rotary_turns_the_first_rotary_dim_entries_in_half_split_or_interleaved_pairs() {
        // head_dim 6, rotary_dim 4, theta 10000: frequencies 1 and 10000^(-2/4) = 0.01, over the
        // rotated width. Half-split pairs (x0, x2), (x1, x3); entries 4 and 5 stay as they are.
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        rotary(&mut x, &[1], 1, 6, 4, 10000.0, false);
        close(
            &x,
            &[
                -1.984_110_648_555_549_5,
                1.959_900_667_496_664,
                2.462_377_902_412_315_6,
                4.019_799_668_334_994,
                5.0,
                6.0,
            ],
            1e-6,
        );
        // Interleaved pairs (x0, x1) by 1 rad and (x2, x3) by 0.01 rad.
        let mut y = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        rotary(&mut y, &[1], 1, 6, 4, 10000.0, true);
        close(
            &y,
            &[
                -1.142_639_663_747_653_2,
                1.922_075_596_544_176,
                2.959_850_667_913_329_4,
                4.029_799_501_669_161,
                5.0,
                6.0,
            ],
            1e-6,
        );
    }

    #[test]
    fn linear_is_x_times_w_transposed() {
        // x [2, 2], w [3, 2] (nn.Linear layout): out [2, 3].
        let mut out = [0.0; 6];
        linear(&[1.0, 2.0, 3.0, -1.0], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 2, 2, 3, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 3.0, -1.0, 2.0]);
        // Longer than the 8 partial sums, with a tail: sum of 1..=11 = 66.
        let x: Vec<f32> = (1..=11).map(|v| v as f32).collect();
        let mut one = [0.0];
        linear(&x, &[1.0; 11], 1, 11, 1, &mut one);
        assert_eq!(one, [66.0]);
    }

    #[test]
    fn activations_follow_their_formulas() {
        // silu(1) * 2, silu(-1) * 3, silu(0) * 5 with silu(g) = g / (1 + e^-g).
        let mut out = [0.0; 3];
        silu_and_mul(&[1.0, -1.0, 0.0], &[2.0, 3.0, 5.0], &mut out);
        close(&out, &[1.462_117_157_260_009_8, -0.806_824_264_109_985_3, 0.0], 1e-6);
        // gelu_tanh(1) * 1 and gelu_tanh(-2) * 0.5.
        let mut out = [0.0; 2];
        gelu_tanh_and_mul(&[1.0, -2.0], &[1.0, 0.5], &mut out);
        close(&out, &[0.841_191_990_608_276_8, -0.022_701_152_956_112_47], 1e-6);
        // gelu_tanh alone (not gated) at 1, -2 and 0.5.
        let mut out = [0.0; 3];
        gelu_tanh(&[1.0, -2.0, 0.5], &mut out);
        close(&out, &[0.841_191_990_608_276_8, -0.045_402_305_912_224_94, 0.345_714_009_825_143_94], 1e-6);
    }

    #[test]
    fn softmax_is_exp_over_the_sum_and_stable_for_large_inputs() {
        let want = [0.090_030_573_170_380_46, 0.244_728_471_054_797_67, 0.665_240_955_774_821_9];
        let mut x = [1.0, 2.0, 3.0, 1001.0, 1002.0, 1003.0];
        softmax(&mut x, 3);
        close(&x[..3], &want, 1e-6);
        // Without subtracting the maximum, e^1001 overflows f32 and the row would be NaN.
        close(&x[3..], &want, 1e-6);
    }

    #[test]
    fn attention_is_causal_scaled_and_grouped() {
        // head_dim 2, scale 1/sqrt(2): with k1 = (sqrt(2) ln 3, 0) and q = (1, 0) the scores are
        // (0, ln 3), so the weights are (1/4, 3/4) and out = v0 / 4 + 3 v1 / 4.
        let k = [0.0, 0.0, std::f32::consts::SQRT_2 * 3f32.ln(), 0.0];
        let v = [4.0, 0.0, 0.0, 8.0];
        let mut out = [0.0; 2];
        attention(&[1.0, 0.0], &k, &v, 1, 2, 1, 1, 2, &mut out);
        close(&out, &[1.0, 6.0], 1e-5);
        // Two new queries over two positions: the first sees position 0 only (causal).
        let mut out = [0.0; 4];
        attention(&[1.0, 0.0, 1.0, 0.0], &k, &v, 2, 2, 1, 1, 2, &mut out);
        close(&out, &[4.0, 0.0, 1.0, 6.0], 1e-5);
        // GQA: two query heads share the one KV head.
        let mut out = [0.0; 4];
        attention(&[1.0, 0.0, 0.0, 0.0], &k, &v, 1, 2, 2, 1, 2, &mut out);
        close(&out, &[1.0, 6.0, 2.0, 4.0], 1e-5);
        // A softcap of 1 bounds the scores to (-1, 1): tanh(ln 3) = 0.8, weights e^0 : e^0.8.
        let mut out = [0.0; 2];
        attention_with(&[1.0, 0.0], &k, &v, 1, 2, 1, 1, 2, std::f32::consts::FRAC_1_SQRT_2, Some(1.0), &mut out);
        let w1 = 0.8f64.exp() / (1.0 + 0.8f64.exp());
        close(&out, &[4.0 * (1.0 - w1), 8.0 * w1], 1e-5);
    }

    #[test]
    fn attention_sinks_add_one_valueless_logit_per_head_to_the_denominator() {
        // One position, head_dim 2, scale 1/sqrt(2): q = (1, 0), k0 = (sqrt(2) ln 3, 0) gives the
        // score ln 3. With sink 0 its weight is e^ln3 / (e^ln3 + e^0) = 3/4, so out = 3/4 v0; with
        // sink ln 3, 1/2.
        let k0 = [std::f32::consts::SQRT_2 * 3f32.ln(), 0.0];
        let v0 = [4.0, 8.0];
        let mut out = [0.0; 2];
        attention_sinks(&[1.0, 0.0], &k0, &v0, &[0.0], 1, 1, 1, 1, 2, &mut out);
        close(&out, &[3.0, 6.0], 1e-5);
        attention_sinks(&[1.0, 0.0], &k0, &v0, &[3f32.ln()], 1, 1, 1, 1, 2, &mut out);
        close(&out, &[2.0, 4.0], 1e-5);
        // Two positions, scores (0, ln 3), sink ln 2: exponentials 1, 3 and 2, weights 1/6 and 1/2:
        // out = v0 / 6 + v1 / 2.
        let k = [0.0, 0.0, std::f32::consts::SQRT_2 * 3f32.ln(), 0.0];
        let v = [4.0, 0.0, 0.0, 8.0];
        attention_sinks(&[1.0, 0.0], &k, &v, &[2f32.ln()], 1, 2, 1, 1, 2, &mut out);
        close(&out, &[2.0 / 3.0, 4.0], 1e-5);
        // Two new queries: the first sees position 0 only (causal), weight 1 / (1 + 2).
        let mut two = [0.0; 4];
        attention_sinks(&[1.0, 0.0, 1.0, 0.0], &k, &v, &[2f32.ln()], 2, 2, 1, 1, 2, &mut two);
        close(&two, &[4.0 / 3.0, 0.0, 2.0 / 3.0, 4.0], 1e-5);
        // GQA with a sink per query head: head 1 (q = 0, sink 0) weighs 1/3, 1/3 (and 1/3 on its sink).
        attention_sinks(&[1.0, 0.0, 0.0, 0.0], &k, &v, &[2f32.ln(), 0.0], 1, 2, 2, 1, 2, &mut two);
        close(&two, &[2.0 / 3.0, 4.0, 4.0 / 3.0, 8.0 / 3.0], 1e-5);
        // A sink far below the scores is plain attention; one far above takes all the weight without
        // overflowing (the maximum includes the sink).
        attention_sinks(&[1.0, 0.0], &k, &v, &[-1000.0], 1, 2, 1, 1, 2, &mut out);
        close(&out, &[1.0, 6.0], 1e-5);
        attention_sinks(&[1.0, 0.0], &k, &v, &[1000.0], 1, 2, 1, 1, 2, &mut out);
        assert_eq!(out, [0.0, 0.0]);
    }

    #[test]
    fn moe_experts_clamped_interleaves_gate_and_up_clamps_and_adds_the_biases() {
        // hidden 1, inter 1, one expert of weight 1/2, x = 2: y = 2 (0.5, 1) + (0.25, -0.5) =
        // (1.25, 1.5), gate 1.25, up 1.5 (under the limit 7); act = (1.5 + 1) 1.25 sigmoid(1.702 *
        // 1.25); z = 2 act + 0.5; out = z / 2 = 3.0423357536... (f64 by hand).
        let mut out = [f32::NAN];
        moe_experts_clamped(&[2.0], &[0.5], &[0.5, 1.0], &[0.25, -0.5], &[2.0], &[0.5], 1, 1.702, 7.0, &mut out);
        close(&out, &[3.042_335_753_607_923], 1e-5);
        // hidden 1, inter 2, expert 0 unselected and full of NaN (never read); expert 1 of weight
        // 1/4, x = 1: y = (10, -10, -1, 0.5) interleaved as (gate0, up0, gate1, up1); gate0 = min(10, 7)
        // = 7, up0 = clamp(-10) = -7: act0 = (-7 + 1) 7 sigmoid(1.702 * 7) = -41.99971877...;
        // act1 = (0.5 + 1) (-1) sigmoid(-1.702) = -0.23130635...; z = act0 + 2 act1 + 1;
        // out = z / 4 = -10.365582868... (f64 by hand).
        let gate_up = [f32::NAN, f32::NAN, f32::NAN, f32::NAN, 10.0, -10.0, -1.0, 0.5];
        let gate_up_bias = [f32::NAN, f32::NAN, f32::NAN, f32::NAN, 0.0, 0.0, 0.0, 0.0];
        let (down, down_bias) = ([f32::NAN, f32::NAN, 1.0, 2.0], [f32::NAN, 1.0]);
        let mut out = [f32::NAN];
        moe_experts_clamped(&[1.0], &[0.0, 0.25], &gate_up, &gate_up_bias, &down, &down_bias, 2, 1.702, 7.0, &mut out);
        close(&out, &[-10.365_582_868_005_362], 1e-5);
        // No expert selected: zero, whatever out held.
        let mut out = [f32::NAN];
        moe_experts_clamped(&[1.0], &[0.0, 0.0], &gate_up, &gate_up_bias, &down, &down_bias, 2, 1.702, 7.0, &mut out);
        assert_eq!(out, [0.0]);
    }

    #[test]
    fn moe_route_softmaxes_all_scores_keeps_the_top_k_and_renormalises_on_request() {
        // Scores ln 1..ln 4: the softmax over all four is (1, 2, 3, 4) / 10. The two largest are
        // experts 3 and 2, kept at their own index with p = 0.4 and 0.3, or 4/7 and 3/7 renormalised.
        let scores = [1f32.ln(), 2f32.ln(), 3f32.ln(), 4f32.ln()];
        let mut out = [9.0; 4];
        moe_route(&scores, 2, false, &mut out);
        close(&out, &[0.0, 0.0, 0.3, 0.4], 1e-6);
        moe_route(&scores, 2, true, &mut out);
        close(&out, &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0], 1e-6);
        // Every expert kept and renormalised is the plain softmax.
        moe_route(&scores, 4, true, &mut out);
        close(&out, &[0.1, 0.2, 0.3, 0.4], 1e-6);
    }

    #[test]
    fn moe_route_keeps_the_lower_index_among_equal_scores() {
        // Scores (1, 2, 2, 0), top_k 1: experts 1 and 2 tie; expert 1 is kept with
        // p = e^2 / (e + 2 e^2 + 1), or 1 renormalised.
        let mut out = [0.0; 4];
        moe_route(&[1.0, 2.0, 2.0, 0.0], 1, false, &mut out);
        close(&out, &[0.0, 0.399_486_304_650_302_77, 0.0, 0.0], 1e-6);
        moe_route(&[1.0, 2.0, 2.0, 0.0], 1, true, &mut out);
        assert_eq!(out, [0.0, 1.0, 0.0, 0.0]);
        // Scores (2, 1, 2, 2), top_k 2: three experts tie for two places; 0 and 2 are kept, 1/2 each.
        moe_route(&[2.0, 1.0, 2.0, 2.0], 2, true, &mut out);
        close(&out, &[0.5, 0.0, 0.5, 0.0], 1e-6);
    }

    #[test]
    fn moe_experts_sums_the_selected_swiglu_experts_with_their_weights() {
        // hidden 1, inter 1, two experts, x = 2, weights (1/4, 3/4):
        // expert 0: g = 1 * 2, u = 3 * 2, y = 0.5 silu(2) 6; expert 1: g = 0.5 * 2, u = -1 * 2,
        // y = 2 silu(1) (-2); out = y0 / 4 + 3 y1 / 4 = 1.3211956... - 2.1931757... with silu(g) = g / (1 + e^-g).
        let mut out = [0.0];
        moe_experts(&[2.0], &[0.25, 0.75], &[1.0, 0.5], &[3.0, -1.0], &[0.5, 2.0], 1, &mut out);
        close(&out, &[-0.871_980_118_923_191_3], 1e-6);
        // hidden 2, inter 2, three experts, expert 1 unselected and full of NaN: it is never read.
        // Expert 0: g = (1, -2), u = (-1, 2), a = silu(g) u, y = (a0, a0 + a1); expert 2:
        // g = (-0.5, 3), u = (-1, -1), y = (2 a1, a0); out = y_0 / 2 + y_2 / 4 (f64 by hand).
        let gate = [1.0, 0.0, 0.0, 1.0, f32::NAN, f32::NAN, f32::NAN, f32::NAN, 0.5, 0.5, 1.0, -1.0];
        let up = [1.0, 1.0, 2.0, 0.0, f32::NAN, f32::NAN, f32::NAN, f32::NAN, -1.0, 0.0, 0.0, 0.5];
        let down = [1.0, 0.0, 1.0, 1.0, f32::NAN, f32::NAN, f32::NAN, f32::NAN, 0.0, 2.0, 1.0, 0.0];
        let mut out = [7.0; 2];
        moe_experts(&[1.0, -2.0], &[0.5, 0.0, 0.25], &gate, &up, &down, 2, &mut out);
        close(&out, &[-1.794_390_479_548_652_3, -0.556_742_549_759_469_4], 1e-6);
        // No expert selected: zero.
        moe_experts(&[1.0, -2.0], &[0.0; 3], &gate, &up, &down, 2, &mut out);
        assert_eq!(out, [0.0, 0.0]);
    }

    /// Paged attention of three sequences (a decode row, a prefill chunk beside its cached prefix, a
    /// whole prompt in a partly filled last block) in blocks of 3 handed out out of order, against
    /// kernel.attention on each sequence's rows gathered: the same values to the bit; the blocks the
    /// tables do not name (and the slots past a context) hold NaN and are never read. With a window
    /// of 2 and a sink, against attention_sinks on the window's rows.
    #[test]
    fn paged_attention_equals_attention_on_the_gathered_rows() {
        let (n_heads, n_kv_heads, hd, bs) = (4, 2, 4, 3);
        let kv = n_kv_heads * hd;
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        // (context, new queries, block table) per sequence; blocks 2 and 7 are nobody's.
        let seqs: [(usize, usize, Vec<u32>); 3] = [(7, 1, vec![5, 0, 8]), (5, 3, vec![3, 6]), (2, 2, vec![1])];
        let mut k_cache = vec![f32::NAN; 9 * bs * kv];
        let mut v_cache = k_cache.clone();
        let mut gathered: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        for (s, (len, _, table)) in seqs.iter().enumerate() {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for t in 0..*len {
                let slot = table[t / bs] as usize * bs + t % bs;
                for j in 0..kv {
                    k_cache[slot * kv + j] = value(s * 1000 + t * kv + j);
                    v_cache[slot * kv + j] = value(s * 1000 + t * kv + j + 500);
                }
                k.extend_from_slice(&k_cache[slot * kv..][..kv]);
                v.extend_from_slice(&v_cache[slot * kv..][..kv]);
            }
            gathered.push((k, v));
        }
        let bps = 3;
        let mut block_table = vec![u32::MAX; seqs.len() * bps];
        let (mut query_start, mut context_lens) = (vec![0u32], Vec::new());
        for (s, (len, n_q, table)) in seqs.iter().enumerate() {
            block_table[s * bps..][..table.len()].copy_from_slice(table);
            query_start.push(query_start[s] + *n_q as u32);
            context_lens.push(*len as u32);
        }
        let rows = query_start[seqs.len()] as usize;
        let q: Vec<f32> = (0..rows * n_heads * hd).map(|i| value(i + 77)).collect();
        let mut out = vec![0.0; q.len()];
        let shape = PagedShape { n_heads, n_kv_heads, head_dim: hd, block_size: bs, blocks_per_seq: bps };
        paged_attention(
            &q,
            &k_cache,
            &v_cache,
            &block_table,
            bps,
            &query_start,
            &context_lens,
            n_heads,
            n_kv_heads,
            hd,
            bs,
            &mut out,
        );
        let sinks = [0.5, -1.0, 0.0, 2.0];
        let scores = Scores { scale: 1.0 / (hd as f32).sqrt(), softcap: None, sinks: Some(&sinks), window: 2 };
        let mut windowed = vec![0.0; q.len()];
        paged_attention_with(
            &q,
            &k_cache,
            &v_cache,
            &block_table,
            &query_start,
            &context_lens,
            &shape,
            &scores,
            &mut windowed,
        );
        let row = n_heads * hd;
        for (s, (len, n_q, _)) in seqs.iter().enumerate() {
            let (k, v) = &gathered[s];
            let rows = query_start[s] as usize * row..query_start[s + 1] as usize * row;
            let mut want = vec![0.0; n_q * row];
            attention(&q[rows.clone()], k, v, *n_q, *len, n_heads, n_kv_heads, hd, &mut want);
            assert_eq!(out[rows.clone()], want[..], "sequence {s}");
            for i in 0..*n_q {
                let (p, qi) = (len - n_q + i, query_start[s] as usize + i);
                let first = (p + 1).saturating_sub(2);
                let mut want = vec![0.0; row];
                let (kw, vw) = (&k[first * kv..(p + 1) * kv], &v[first * kv..(p + 1) * kv]);
                attention_sinks(
                    &q[qi * row..][..row],
                    kw,
                    vw,
                    &sinks,
                    1,
                    p + 1 - first,
                    n_heads,
                    n_kv_heads,
                    hd,
                    &mut want,
                );
                assert_eq!(windowed[qi * row..][..row], want[..], "sequence {s}, query {i}, window 2");
            }
        }
    }

    #[test]
    fn argmax_takes_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[-5.0]), 0);
    }
}
