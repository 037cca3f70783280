// Device code of the llama-cuda-bf16 example engine, compiled at load with NVRTC (src/device.rs).
// One __global__ function per kernel contract (the CUDA variant of its signature: f32 activations,
// bf16 weights where the contract says so, f32 accumulation), plus the model's small helpers.
// Written from the contracts' `math`, `pseudocode` and `[cuda] launch` texts.

typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

extern "C" {

// ---- reductions (platform guidance: warp shuffles, then shared memory across warps) ----

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result. `sh`: 32 floats.
__device__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? sh[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    return sh[0];
}

// Maximum over the block; every thread gets the result. `sh`: 32 floats.
__device__ float block_max(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? sh[lane] : NEG_INF;
        t = warp_max(t);
        if (lane == 0) sh[0] = t;
    }
    __syncthreads();
    return sh[0];
}

// ---- weight formats (kernel.linear_bf16, kernel.linear_f16) ----

// One bf16 (its bits) widened to f32, exact.
__device__ __forceinline__ float bf16_to_f32(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
__device__ __forceinline__ float bf16_lo(unsigned int two) { return __uint_as_float(two << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int two) { return __uint_as_float(two & 0xffff0000u); }

// IEEE binary16 to f32, exact (subnormals, infinities and NaN included).
__device__ __forceinline__ float f16_value(unsigned int h) {
    const unsigned int s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return s ? -v : v;
    }
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}

// ---- kernel.embedding: one block per token id ----

__global__ void embedding(const float* table, int vocab, int dim, const unsigned int* ids, int n_ids, float* out) {
    const int b = blockIdx.x;
    if (b >= n_ids) return;
    const unsigned int id = ids[b];
    if (id >= (unsigned int)vocab) return;  // out of range: the output stays unwritten
    const float* row = table + (u64)id * dim;
    float* o = out + (u64)b * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = row[j];
}

// ---- kernel.rms_norm: one block per row ----

__global__ void rms_norm(const float* x, const float* w, float eps, float* out, int dim) {
    __shared__ float sh[32];
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
    s = block_sum(s, sh);
    const float inv = 1.0f / sqrtf(s / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// ---- kernel.rope (rotate-half pairs), one thread per pair; frequencies given in f64 ----

__global__ void rope(float* x, const unsigned int* pos, const double* freqs, int n_tok, int n_heads, int head_dim) {
    const int half = head_dim / 2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * n_heads * half) return;
    const int j = (int)(i % half);
    const long long th = i / half;  // token * n_heads + head
    const int t = (int)(th / n_heads);
    float* h = x + th * head_dim;
    double sd, cd;
    sincos((double)pos[t] * freqs[j], &sd, &cd);
    const float s = (float)sd, c = (float)cd;
    const float a = h[j], b = h[j + half];
    h[j] = a * c - b * s;
    h[j + half] = a * s + b * c;
}

// ---- matrix products: one warp per output feature o, input rows looped inside ----
// out[i, o] = sum_c x[i, c] * widen(w[o, c]) (+ out[i, o] when accumulate), f32 accumulation.

#define WARPS_PER_BLOCK 8

__global__ void linear_f32(const float* x, const float* w, int m, int k, int n, float* out, int accumulate) {
    const int o = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= n) return;
    const float* wr = w + (u64)o * k;
    for (int i = 0; i < m; i++) {
        const float* xr = x + (u64)i * k;
        float acc = 0.0f;
        if ((k & 3) == 0 && (((u64)wr | (u64)xr) & 15) == 0) {
            const float4* w4 = (const float4*)wr;
            const float4* x4 = (const float4*)xr;
#pragma unroll 4
            for (int c = lane; c < k / 4; c += 32) {
                const float4 a = x4[c], b = w4[c];
                acc = fmaf(a.x, b.x, acc);
                acc = fmaf(a.y, b.y, acc);
                acc = fmaf(a.z, b.z, acc);
                acc = fmaf(a.w, b.w, acc);
            }
        } else {
            for (int c = lane; c < k; c += 32) acc = fmaf(xr[c], wr[c], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            const u64 at = (u64)i * n + o;
            out[at] = accumulate ? out[at] + acc : acc;
        }
    }
}

__global__ void linear_bf16(const float* x, const unsigned short* w, int m, int k, int n, float* out, int accumulate) {
    const int o = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= n) return;
    const unsigned short* wr = w + (u64)o * k;
    for (int i = 0; i < m; i++) {
        const float* xr = x + (u64)i * k;
        float acc = 0.0f;
        if ((k & 7) == 0 && (((u64)wr | (u64)xr) & 15) == 0) {
            // 16-byte loads: 8 bf16 weights and 8 activations per lane and step, coalesced along k.
            const uint4* w8 = (const uint4*)wr;
            const float4* x4 = (const float4*)xr;
#pragma unroll 4
            for (int c = lane; c < k / 8; c += 32) {
                const uint4 q = w8[c];
                const float4 a = x4[2 * c], b = x4[2 * c + 1];
                acc = fmaf(a.x, bf16_lo(q.x), acc);
                acc = fmaf(a.y, bf16_hi(q.x), acc);
                acc = fmaf(a.z, bf16_lo(q.y), acc);
                acc = fmaf(a.w, bf16_hi(q.y), acc);
                acc = fmaf(b.x, bf16_lo(q.z), acc);
                acc = fmaf(b.y, bf16_hi(q.z), acc);
                acc = fmaf(b.z, bf16_lo(q.w), acc);
                acc = fmaf(b.w, bf16_hi(q.w), acc);
            }
        } else {
            for (int c = lane; c < k; c += 32) acc = fmaf(xr[c], bf16_lo((unsigned int)wr[c]), acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            const u64 at = (u64)i * n + o;
            out[at] = accumulate ? out[at] + acc : acc;
        }
    }
}

__global__ void linear_f16(const float* x, const unsigned short* w, int m, int k, int n, float* out) {
    const int o = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= n) return;
    const unsigned short* wr = w + (u64)o * k;
    for (int i = 0; i < m; i++) {
        const float* xr = x + (u64)i * k;
        float acc = 0.0f;
        for (int c = lane; c < k; c += 32) acc = fmaf(xr[c], f16_value((unsigned int)wr[c]), acc);
        acc = warp_sum(acc);
        if (lane == 0) out[(u64)i * n + o] = acc;
    }
}

__global__ void linear_int8(const float* x, const signed char* w, const float* scales, int m, int k, int n, float* out) {
    const int o = blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (o >= n) return;
    const signed char* wr = w + (u64)o * k;
    for (int i = 0; i < m; i++) {
        const float* xr = x + (u64)i * k;
        float acc = 0.0f;
        for (int c = lane; c < k; c += 32) acc = fmaf(xr[c], (float)wr[c], acc);
        acc = warp_sum(acc);
        if (lane == 0) out[(u64)i * n + o] = scales[o] * acc;
    }
}

// ---- gated activations (kernel.silu_and_mul, kernel.gelu_tanh_and_mul), grid-stride ----

__global__ void silu_and_mul(const float* gate, const float* up, float* out, int len) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

__global__ void gelu_tanh_and_mul(const float* gate, const float* up, float* out, int len) {
    const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(k0 * (g + 0.044715f * g * g * g))) * up[i];
    }
}

// ---- kernel.softmax: one block per row, in place ----

__global__ void softmax(float* x, int n) {
    __shared__ float sh[32];
    float* r = x + (u64)blockIdx.x * n;
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, r[j]);
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(r[j] - mx);
        r[j] = e;
        s += e;
    }
    s = block_sum(s, sh);
    const float inv = 1.0f / s;
    for (int j = threadIdx.x; j < n; j += blockDim.x) r[j] *= inv;
}

// ---- kernel.attention: one block per (query row, head); scores in dynamic shared memory ----

__global__ void attention(const float* q, const float* kc, const float* vc, int n_q, int kv_len, int n_heads,
                          int n_kv_heads, int head_dim, float* out) {
    extern __shared__ float scores[];  // kv_len floats
    __shared__ float sh[32];
    const int i = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    const int g = h / (n_heads / n_kv_heads);
    const int p = kv_len - n_q + i;  // absolute position of this query row: keys 0..=p
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float* qr = q + ((u64)i * n_heads + h) * head_dim;
    const u64 stride = (u64)n_kv_heads * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    for (int t = warp; t <= p; t += warps) {
        const float* kr = kc + (u64)t * stride + (u64)g * head_dim;
        float d = 0.0f;
        for (int c = lane; c < head_dim; c += 32) d = fmaf(qr[c], kr[c], d);
        d = warp_sum(d);
        if (lane == 0) scores[t] = d * scale;
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int t = threadIdx.x; t <= p; t += blockDim.x) mx = fmaxf(mx, scores[t]);
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int t = threadIdx.x; t <= p; t += blockDim.x) {
        const float e = expf(scores[t] - mx);
        scores[t] = e;
        s += e;
    }
    s = block_sum(s, sh);
    const float inv = 1.0f / s;
    float* o = out + ((u64)i * n_heads + h) * head_dim;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        const float* vcol = vc + (u64)g * head_dim + c;
        float acc = 0.0f;
        for (int t = 0; t <= p; t++) acc = fmaf(scores[t], vcol[(u64)t * stride], acc);
        o[c] = acc * inv;
    }
}

// ---- kernel.argmax: one block; the first maximum; writes the index on the device ----
// With `trail`, the index is also appended at trail[step] (the decode loop's token list).

__global__ void argmax(const float* x, int n, unsigned int* out, unsigned int* trail, int step) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float bv = NEG_INF;
    int bi = n;  // larger than every index: loses every tie
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = x[j];
        if (v > bv || (v == bv && j < bi)) { bv = v; bi = j; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < warps ? sv[lane] : NEG_INF;
        bi = lane < warps ? si[lane] : n;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            const unsigned int idx = bi < n ? (unsigned int)bi : 0u;
            out[0] = idx;
            if (trail) trail[step] = idx;
        }
    }
}

// ---- model helpers ----

// Write one position's K and V rows (kv_dim each, read from qkv at k_off and v_off) into the caches at `pos`.
__global__ void store_kv(const float* qkv, int k_off, int v_off, int kv_dim, float* kc, float* vc, int pos) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kv_dim; i += gridDim.x * blockDim.x) {
        kc[(u64)pos * kv_dim + i] = qkv[k_off + i];
        vc[(u64)pos * kv_dim + i] = qkv[v_off + i];
    }
}

}  // extern "C" (templates below have C++ linkage; the kernels that use them are extern "C" again)

// =====================================================================================================
// Decode-step kernels (the model's fused path; kernels.rs documents which contracts each one fuses).
//
// Decode at batch 1 streams every weight once per token, so each matrix-vector product must keep
// HBM busy: by Little's law, ~4.3 TB/s x ~700 ns of latency is ~3 MB in flight over 132 SMs, about
// 24 KB per SM. Here every lane issues U independent 16-byte loads (8 bf16 weights each) for R rows
// before it uses any, and prefetches the next group's loads before reducing the current one: with
// R * U = 8 a warp has 4 KB in flight, and 8 warps x 2 or more blocks per SM keep 64 KB or more in
// flight. Weights are read with __ldcs (evict-first: each byte is used once per token). The input
// vector (f32) is staged once per block in shared memory, transformed on the way (RMSNorm, or
// SiLU(gate) * up), so the norms and the gated activation cost no launch and no HBM traffic.
// =====================================================================================================

#define PRO_PLAIN 0
#define PRO_NORM 1
#define PRO_SILU 2
#define EPI_STORE 0
#define EPI_ADD 1
#define EPI_QKV 2
#define EPI_ARGMAX 3
#define MV_WARPS 8
#define MV_THREADS (32 * MV_WARPS)

// Everything the matrix-vector body needs; filled by each extern "C" kernel from its parameters.
struct MvArgs {
    const float* in;           // input vector (PRO_SILU: [gate (k), up (k)])
    const float* gain;         // PRO_NORM: norm gain [k]
    float eps;                 // PRO_NORM: epsilon inside the square root
    const unsigned short* w;   // [n, k] bf16 bit patterns, 16-byte aligned, k % 8 == 0
    int k, n;
    float* out;                // EPI_STORE / EPI_ADD / EPI_ARGMAX: [n]
    int accumulate;            // EPI_STORE with accumulate != 0 behaves as EPI_ADD
    // EPI_QKV: rows are q heads, then k heads, then v heads, each head_dim rows
    const unsigned int* ctl;   // ctl[0] = position, ctl[1] = step, ctl[2] = token
    const double* freqs;       // [head_dim / 2]
    int n_heads, n_kv_heads, head_dim;
    float* q_out;              // [n_heads * head_dim]
    float* kc;                 // key cache [max_seq, n_kv_heads * head_dim]
    float* vc;                 // value cache, same shape
    // EPI_ARGMAX
    int mode;                  // 0: logits only; 1: also argmax, token, trail and ctl advanced
    float* part_v;             // [gridDim.x] per-block best value
    unsigned int* part_i;      // [gridDim.x] per-block best index
    unsigned int* ticket;      // one counter, 0 between launches
    unsigned int* trail;       // tokens of a decode_greedy call
};

// Stage the block's input vector in shared memory: xs[c] for c < k (blockDim.x == MV_THREADS).
// PRO_NORM computes exactly what kernel rms_norm computes (same partition, same block_sum).
template <int PRO>
__device__ __forceinline__ void mv_stage(float* xs, float* red, const MvArgs& a) {
    const int k = a.k;
    if (PRO == PRO_PLAIN) {
        for (int c = threadIdx.x; c < k; c += blockDim.x) xs[c] = a.in[c];
    } else if (PRO == PRO_NORM) {
        float s = 0.0f;
        for (int c = threadIdx.x; c < k; c += blockDim.x) {
            const float v = a.in[c];
            xs[c] = v;
            s = fmaf(v, v, s);
        }
        s = block_sum(s, red);
        const float inv = 1.0f / sqrtf(s / (float)k + a.eps);
        for (int c = threadIdx.x; c < k; c += blockDim.x) xs[c] = xs[c] * inv * a.gain[c];
    } else {
        for (int c = threadIdx.x; c < k; c += blockDim.x) {
            const float g = a.in[c];
            xs[c] = g / (1.0f + expf(-g)) * a.in[k + c];
        }
    }
    __syncthreads();
}

// Row r of row group `grp` (EPI_QKV: the RoPE pair j, j + head_dim / 2 of one head), or -1.
template <int EPI, int R>
__device__ __forceinline__ int mv_row(const MvArgs& a, int grp, int r) {
    if (EPI == EPI_QKV) {
        const int half = a.head_dim >> 1;
        const int head = grp / half, j = grp - head * half;
        return head * a.head_dim + j + r * half;
    }
    const int row = grp * R + r;
    return row < a.n ? row : -1;
}

template <int EPI, int R, int U>
__device__ __forceinline__ void mv_load(const MvArgs& a, int grp, int cb, uint4 (&w)[R][U]) {
    const int lane = threadIdx.x & 31, k8 = a.k >> 3;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int row = mv_row<EPI, R>(a, grp, r);
        const uint4* wr = (const uint4*)(a.w + (u64)(row < 0 ? 0 : row) * a.k);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = cb * 32 * U + u * 32 + lane;
            w[r][u] = (row >= 0 && c < k8) ? __ldcs(wr + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// The rows j and j + head_dim / 2 of one head of the qkv product: RoPE on q and k heads at position
// ctl[0], then q to q_out, k and v into the caches at row ctl[0].
__device__ __forceinline__ void mv_qkv_store(const MvArgs& a, int grp, float x0, float x1) {
        const int half = a.head_dim >> 1;
        const int head = grp / half, j = grp - head * half;
        const unsigned int pos = a.ctl[0];
        if (head < a.n_heads + a.n_kv_heads) {
            // kernel.rope, rotate-half pairing, the angle in f64 as kernel rope computes it.
            double sd, cd;
            sincos((double)pos * a.freqs[j], &sd, &cd);
            const float s = (float)sd, c = (float)cd;
            const float r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
            x0 = r0;
            x1 = r1;
        }
        const int kv_dim = a.n_kv_heads * a.head_dim;
        if (head < a.n_heads) {
            float* o = a.q_out + head * a.head_dim + j;
            o[0] = x0;
            o[half] = x1;
        } else if (head < a.n_heads + a.n_kv_heads) {
            float* o = a.kc + (u64)pos * kv_dim + (head - a.n_heads) * a.head_dim + j;
            o[0] = x0;
            o[half] = x1;
        } else {
            float* o = a.vc + (u64)pos * kv_dim + (head - a.n_heads - a.n_kv_heads) * a.head_dim + j;
            o[0] = x0;
            o[half] = x1;
        }
}

template <int EPI, int R>
__device__ __forceinline__ void mv_epilogue(const MvArgs& a, int grp, const float (&acc)[R], float& bv, int& bi) {
    const int lane = threadIdx.x & 31;
    if (EPI == EPI_QKV) {
        if (lane == 0) mv_qkv_store(a, grp, acc[0], acc[R - 1]);
    } else {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int row = mv_row<EPI, R>(a, grp, r);
            if (row < 0) continue;
            if (EPI == EPI_ARGMAX) {
                // Rows come in increasing order per warp; the first maximum wins (kernel.argmax).
                if (acc[r] > bv || (acc[r] == bv && row < bi)) {
                    bv = acc[r];
                    bi = row;
                }
            }
            if (lane == r) {
                if ((EPI == EPI_ADD) || (EPI == EPI_STORE && a.accumulate)) a.out[row] += acc[r];
                else a.out[row] = acc[r];
            }
        }
    }
}

// Better of two (value, index) pairs under kernel.argmax's rule: larger value, then smaller index.
__device__ __forceinline__ void argmax_pick(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
    }
}

// The matrix-vector product out = f(in) W^T for one token, f the staging transform (PRO_*), the
// epilogue EPI_*. Grid-stride over row groups: warp gw of W takes groups gw, gw + W, ...; inside a
// group, chunk blocks of 32 * U chunks of 8 weights; the next (group, chunk block)'s loads are issued
// before the current one's multiply-adds.
template <int PRO, int EPI, int R, int U>
__device__ __forceinline__ void mv_run(const MvArgs& a) {
    extern __shared__ float4 mv_smem4[];
    float* xs = (float*)mv_smem4;  // k floats
    __shared__ float red[32];
    __shared__ float sv[MV_WARPS];
    __shared__ int si[MV_WARPS];
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k8 = a.k >> 3;
    const int n_cb = (k8 + 32 * U - 1) / (32 * U);
    const int groups = EPI == EPI_QKV ? a.n / 2 : (a.n + R - 1) / R;
    const int stride = gridDim.x * MV_WARPS;
    int grp = blockIdx.x * MV_WARPS + warp, cb = 0;
    uint4 wn[R][U];
    if (grp < groups) mv_load<EPI, R, U>(a, grp, 0, wn);  // in flight while the input is staged
    mv_stage<PRO>(xs, red, a);
    const float4* xs4 = (const float4*)xs;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    while (grp < groups) {
        uint4 w[R][U];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++) w[r][u] = wn[r][u];
        int ngrp = grp, ncb = cb + 1;
        if (ncb == n_cb) {
            ncb = 0;
            ngrp = grp + stride;
        }
        if (ngrp < groups) mv_load<EPI, R, U>(a, ngrp, ncb, wn);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = cb * 32 * U + u * 32 + lane;
            if (c < k8) {
                const float4 xa = xs4[2 * c], xb = xs4[2 * c + 1];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const uint4 q = w[r][u];
                    float t = acc[r];
                    t = fmaf(xa.x, bf16_lo(q.x), t);
                    t = fmaf(xa.y, bf16_hi(q.x), t);
                    t = fmaf(xa.z, bf16_lo(q.y), t);
                    t = fmaf(xa.w, bf16_hi(q.y), t);
                    t = fmaf(xb.x, bf16_lo(q.z), t);
                    t = fmaf(xb.y, bf16_hi(q.z), t);
                    t = fmaf(xb.z, bf16_lo(q.w), t);
                    t = fmaf(xb.w, bf16_hi(q.w), t);
                    acc[r] = t;
                }
            }
        }
        if (ncb == 0) {  // the group's rows are complete
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
            mv_epilogue<EPI, R>(a, grp, acc, bv, bi);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = 0.0f;
        }
        grp = ngrp;
        cb = ncb;
    }
    if (EPI == EPI_ARGMAX && a.mode == 1) {
        // Every lane holds the warp's best; the block's best, then the grid's in the last block.
        if (lane == 0) {
            sv[warp] = bv;
            si[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = sv[0];
            int i = si[0];
            for (int t = 1; t < MV_WARPS; t++) argmax_pick(v, i, sv[t], si[t]);
            a.part_v[blockIdx.x] = v;
            a.part_i[blockIdx.x] = (unsigned int)i;
            __threadfence();
            last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
        }
        __syncthreads();
        if (last) {
            __threadfence();
            float v = NEG_INF;
            int i = 0x7fffffff;
            for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x)
                argmax_pick(v, i, __ldcg(a.part_v + b), (int)__ldcg(a.part_i + b));
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, v, o);
                const int oi = __shfl_xor_sync(0xffffffffu, i, o);
                argmax_pick(v, i, ov, oi);
            }
            if (lane == 0) {
                sv[warp] = v;
                si[warp] = i;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                v = sv[0];
                i = si[0];
                for (int t = 1; t < MV_WARPS; t++) argmax_pick(v, i, sv[t], si[t]);
                const unsigned int idx = (i >= 0 && i < a.n) ? (unsigned int)i : 0u;
                unsigned int* ctl = (unsigned int*)a.ctl;
                a.trail[ctl[1]] = idx;
                ctl[2] = idx;
                ctl[0] += 1u;
                ctl[1] += 1u;
                *a.ticket = 0u;
            }
        }
    }
}

extern "C" {

// out = x W^T (+ out when accumulate) for one token; x: [k] f32, W: [n, k] bf16, k % 8 == 0, W
// 16-byte aligned. kernel.linear_bf16 at m = 1, and the attention block's o projection with the
// residual add fused (accumulate = 1).
__global__ void __launch_bounds__(MV_THREADS, 2) mv_bf16(const float* x, const unsigned short* w, int k, int n, float* out,
                                                      int accumulate) {
    MvArgs a = {};
    a.in = x;
    a.w = w;
    a.k = k;
    a.n = n;
    a.out = out;
    a.accumulate = accumulate;
    mv_run<PRO_PLAIN, EPI_STORE, 1, 8>(a);
}

// out = rms_norm(x, gain, eps) W^T: kernel.rms_norm fused into kernel.linear_bf16 (the MLP's gate
// and up projections, one [2 intermediate, hidden] matrix).
__global__ void __launch_bounds__(MV_THREADS, 2) mv_bf16_norm(const float* x, const float* gain, float eps,
                                                           const unsigned short* w, int k, int n, float* out) {
    MvArgs a = {};
    a.in = x;
    a.gain = gain;
    a.eps = eps;
    a.w = w;
    a.k = k;
    a.n = n;
    a.out = out;
    mv_run<PRO_NORM, EPI_STORE, 1, 8>(a);
}

// out += (silu(gate) * up) W^T with gate_up = [gate (k), up (k)]: kernel.silu_and_mul fused into
// the down projection (kernel.linear_bf16) and the residual add.
__global__ void __launch_bounds__(MV_THREADS, 2) mv_bf16_silu(const float* gate_up, const unsigned short* w, int k, int n,
                                                           float* out) {
    MvArgs a = {};
    a.in = gate_up;
    a.w = w;
    a.k = k;
    a.n = n;
    a.out = out;
    mv_run<PRO_SILU, EPI_ADD, 1, 8>(a);
}

// The attention block's input: rms_norm(x) [wq; wk; wv]^T, then RoPE (rotate-half, angle in f64)
// on the q and k heads at position ctl[0], q to q_out, k and v into the caches at row ctl[0].
// Fuses kernel.rms_norm, kernel.linear_bf16, kernel.rope and the KV-cache write (component.kv_cache).
// W: [(n_heads + 2 n_kv_heads) head_dim, k]; each warp computes the rows j and j + head_dim / 2 of
// one head together, so the rotation needs no exchange.
__global__ void __launch_bounds__(MV_THREADS, 2) mv_bf16_qkv(const float* x, const float* gain, float eps,
                                                          const unsigned short* w, int k, const unsigned int* ctl,
                                                          const double* freqs, int n_heads, int n_kv_heads,
                                                          int head_dim, float* q_out, float* kc, float* vc) {
    MvArgs a = {};
    a.in = x;
    a.gain = gain;
    a.eps = eps;
    a.w = w;
    a.k = k;
    a.n = (n_heads + 2 * n_kv_heads) * head_dim;
    a.ctl = ctl;
    a.freqs = freqs;
    a.n_heads = n_heads;
    a.n_kv_heads = n_kv_heads;
    a.head_dim = head_dim;
    a.q_out = q_out;
    a.kc = kc;
    a.vc = vc;
    mv_run<PRO_NORM, EPI_QKV, 2, 4>(a);
}

// logits = rms_norm(x) W^T (the final norm fused into lm_head); with mode = 1 also the argmax over
// the logits (kernel.argmax: first maximum; per-block bests, the last block to finish reduces them),
// written to ctl[2] and trail[ctl[1]], and the position ctl[0] and step ctl[1] advanced: the end of
// one decode step, so that a captured step replays without host arguments.
__global__ void __launch_bounds__(MV_THREADS, 2) mv_bf16_head(const float* x, const float* gain, float eps,
                                                           const unsigned short* w, int k, int n, float* logits,
                                                           int mode, float* part_v, unsigned int* part_i,
                                                           unsigned int* ticket, unsigned int* ctl,
                                                           unsigned int* trail) {
    MvArgs a = {};
    a.in = x;
    a.gain = gain;
    a.eps = eps;
    a.w = w;
    a.k = k;
    a.n = n;
    a.out = logits;
    a.mode = mode;
    a.part_v = part_v;
    a.part_i = part_i;
    a.ticket = ticket;
    a.ctl = ctl;
    a.trail = trail;
    mv_run<PRO_NORM, EPI_ARGMAX, 1, 8>(a);
}

// ---- decode attention, split over the sequence (flash-decoding) ----
// Grid (n_kv_heads, splits), 256 threads. Block (g, s) takes the query heads of KV head g (GQA
// group, up to 8) and positions [s * per, min(kv_len, (s + 1) * per)), per = ceil(kv_len / splits),
// kv_len = ctl[0] + 1 read on the device. Each warp keeps a running max, sum and weighted V sum
// (online softmax) over its positions; the block merges its warps, writes its partial, and the last
// block of the KV head (a ticket) merges the splits: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// Scores are q.k / sqrt(head_dim) with f32 sums, as kernel attention computes them. head_dim <= 128.
#define AD_WARPS 8
#define AD_MAXG 8
#define AD_MAXD 4

__global__ void __launch_bounds__(32 * AD_WARPS) attn_decode(const float* q, const float* kc, const float* vc,
                                                             const unsigned int* ctl, int n_heads, int n_kv_heads,
                                                             int head_dim, int splits, float* part_ml,
                                                             float* part_acc, unsigned int* ticket, float* out) {
    __shared__ float sm_m[AD_WARPS][AD_MAXG], sm_l[AD_WARPS][AD_MAXG];
    __shared__ float sm_acc[AD_WARPS][AD_MAXG * AD_MAXD * 32];
    __shared__ int last;
    const int g = blockIdx.x, s = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = n_heads / n_kv_heads;
    const int kv_len = (int)ctl[0] + 1;
    const int per = (kv_len + splits - 1) / splits;
    const int t0 = s * per, t1 = min(kv_len, t0 + per);
    const u64 stride = (u64)n_kv_heads * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    float qr[AD_MAXG][AD_MAXD], acc[AD_MAXG][AD_MAXD], m[AD_MAXG], l[AD_MAXG];
#pragma unroll
    for (int h = 0; h < AD_MAXG; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < AD_MAXD; i++) {
            const int d = lane + 32 * i;
            qr[h][i] = (h < grp && d < head_dim) ? q[(u64)(g * grp + h) * head_dim + d] : 0.0f;
            acc[h][i] = 0.0f;
        }
    }
    float kn[AD_MAXD], vn[AD_MAXD];
    int t = t0 + warp;
#pragma unroll
    for (int i = 0; i < AD_MAXD; i++) {
        const int d = lane + 32 * i;
        const bool ok = t < t1 && d < head_dim;
        kn[i] = ok ? kc[(u64)t * stride + (u64)g * head_dim + d] : 0.0f;
        vn[i] = ok ? vc[(u64)t * stride + (u64)g * head_dim + d] : 0.0f;
    }
    for (; t < t1; t += AD_WARPS) {
        float kd[AD_MAXD], vd[AD_MAXD];
#pragma unroll
        for (int i = 0; i < AD_MAXD; i++) {
            kd[i] = kn[i];
            vd[i] = vn[i];
        }
        const int tn = t + AD_WARPS;  // the next position's loads go out before this one's math
#pragma unroll
        for (int i = 0; i < AD_MAXD; i++) {
            const int d = lane + 32 * i;
            const bool ok = tn < t1 && d < head_dim;
            kn[i] = ok ? kc[(u64)tn * stride + (u64)g * head_dim + d] : 0.0f;
            vn[i] = ok ? vc[(u64)tn * stride + (u64)g * head_dim + d] : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < AD_MAXG; h++) {
            if (h < grp) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < AD_MAXD; i++) dot = fmaf(qr[h][i], kd[i], dot);
                const float sc = warp_sum(dot) * scale;
                const float mn = fmaxf(m[h], sc);
                const float corr = expf(m[h] - mn);
                const float p = expf(sc - mn);
                l[h] = l[h] * corr + p;
#pragma unroll
                for (int i = 0; i < AD_MAXD; i++) acc[h][i] = fmaf(p, vd[i], acc[h][i] * corr);
                m[h] = mn;
            }
        }
    }
    // Merge the block's warps.
#pragma unroll
    for (int h = 0; h < AD_MAXG; h++) {
        if (lane == 0) {
            sm_m[warp][h] = m[h];
            sm_l[warp][h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < AD_MAXD; i++) sm_acc[warp][h * AD_MAXD * 32 + i * 32 + lane] = acc[h][i];
    }
    __syncthreads();
    const int base = (g * splits + s) * grp;  // this block's partials: (base + h)
    for (int e = threadIdx.x; e < grp * head_dim; e += blockDim.x) {
        const int h = e / head_dim, d = e - h * head_dim;
        float mx = NEG_INF;
        for (int w = 0; w < AD_WARPS; w++) mx = fmaxf(mx, sm_m[w][h]);
        float sl = 0.0f, sa = 0.0f;
        for (int w = 0; w < AD_WARPS; w++) {
            // A warp with no position has l = 0; one whose scores were all NaN has m = -inf (fmaxf
            // drops a NaN) and l = NaN, and must stay in the sums so that the NaN reaches out.
            if (sm_l[w][h] == 0.0f) continue;
            const float f = expf(sm_m[w][h] - mx);
            sl = fmaf(sm_l[w][h], f, sl);
            sa = fmaf(sm_acc[w][h * AD_MAXD * 32 + d], f, sa);
        }
        part_acc[(u64)(base + h) * head_dim + d] = sa;
        if (d == 0) {
            part_ml[2 * (base + h)] = mx;
            part_ml[2 * (base + h) + 1] = sl;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket + g, 1u) == (unsigned int)splits - 1u;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < grp * head_dim; e += blockDim.x) {
        const int h = e / head_dim, d = e - h * head_dim;
        float mx = NEG_INF;
        for (int sp = 0; sp < splits; sp++) mx = fmaxf(mx, __ldcg(part_ml + 2 * ((g * splits + sp) * grp + h)));
        float sl = 0.0f, sa = 0.0f;
        for (int sp = 0; sp < splits; sp++) {
            const int pi = (g * splits + sp) * grp + h;
            const float lp = __ldcg(part_ml + 2 * pi + 1);
            if (lp == 0.0f) continue;  // an empty split (a NaN one has l = NaN and stays)
            const float f = expf(__ldcg(part_ml + 2 * pi) - mx);
            sl = fmaf(lp, f, sl);
            sa = fmaf(__ldcg(part_acc + (u64)pi * head_dim + d), f, sa);
        }
        out[(u64)(g * grp + h) * head_dim + d] = sa / sl;
    }
    if (threadIdx.x == 0) ticket[g] = 0u;
}

// =====================================================================================================
// Prefill kernels: a prompt of m tokens as matrix products on the tensor cores, batched RoPE and KV
// writes, batched causal attention.
// =====================================================================================================

// f32 to bf16 bits, round to nearest even (the same rule as the engine's host conversion). A NaN
// stays a quiet NaN: the device's own NaN is 0x7fffffff, which the rounding add would wrap to -0.
__device__ __forceinline__ unsigned int bf16_rne(float v) {
    const unsigned int b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (b >> 16) | 0x40u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// Split f32 activations into three bf16 planes, x = hi + mid + lo exactly (for finite x above the
// f32 normal range's lower end / 2^16): hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid);
// each difference is exact in f32 and leaves at most 16, then 8, significant bits, so lo is exact.
// out: [3, len] (hi plane, mid plane, lo plane).
__global__ void split3_bf16(const float* x, long long len, unsigned short* out) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (long long)gridDim.x * blockDim.x) {
        const float v = x[i];
        unsigned int hi = bf16_rne(v);
        // A finite x that rounds past bf16's largest value is truncated instead (then exact in three
        // planes); an infinite x is its hi plane alone (inf - inf would make the others NaN).
        if (!isinf(v) && isinf(__uint_as_float(hi << 16))) hi = __float_as_uint(v) >> 16;
        const float h = __uint_as_float(hi << 16);
        const float r1 = isinf(v) ? 0.0f : v - h;
        const unsigned int mid = bf16_rne(r1);
        const float r2 = r1 - __uint_as_float(mid << 16);
        const unsigned int lo = bf16_rne(r2);
        out[i] = (unsigned short)hi;
        out[len + i] = (unsigned short)mid;
        out[2 * len + i] = (unsigned short)lo;
    }
}

// One m16n8k16 tensor-core product with f32 accumulation: d += a b (PTX ISA, warp-level matrix
// multiply-accumulate; fragment layouts of .bf16 m16n8k16: a0..a3 rows g / g + 8, columns 2t, 2t + 1
// and + 8; b0, b1 rows 2t, 2t + 1 and + 8 of column g; d0, d1 row g, d2, d3 row g + 8, columns 2t,
// 2t + 1; g = lane / 4, t = lane % 4; the lower 16 bits hold the lower index).
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// C[m, n] (=, += or atomically +=) A[m, k] W[n, k]^T with A given as its three bf16 planes
// (split3_bf16: the f32 activations exactly) and W bf16: three tensor-core products per tile, each
// tile's sum (32 of k) added to the f32 accumulators by ordinary round-to-nearest adds, so the result
// is the f32 product summed in f32 in chunks of 32 (kernel.linear_bf16's contract).
// Block tile 64 x 64, k step 32, 4 warps of 32 x 32; grid (ceil(n / 64), ceil(m / 64), k splits);
// blockIdx.z takes k in [z * kchunk, min(k, (z + 1) * kchunk)), kchunk % 32 == 0. k % 8 == 0, A
// planes and W 16-byte aligned. mode 0: store, 1: add, 2: atomicAdd (k split over blocks).
#define GB_M 64
#define GB_N 64
#define GB_K 32
#define GB_LD (GB_K + 8)  // row stride in u16 of the shared tiles: 80 bytes, conflict-free fragments

__global__ void __launch_bounds__(128) gemm_bf16x3(const unsigned short* a3, const unsigned short* w, int m, int k,
                                                   int n, float* c, int mode, int kchunk) {
    __shared__ __align__(16) unsigned short As[3][GB_M][GB_LD];
    __shared__ __align__(16) unsigned short Bs[GB_N][GB_LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int gq = lane >> 2, tq = lane & 3;
    const int m0 = blockIdx.y * GB_M, n0 = blockIdx.x * GB_N;
    const int kb = blockIdx.z * kchunk, ke = min(k, kb + kchunk);
    const u64 plane = (u64)m * k;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    // Global -> registers: A 3 x 64 rows x 4 chunks of 8 = 768 uint4 (6 per thread), W 64 x 4 = 256 (2).
    uint4 ra[6], rb[2];
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < 6; i++) {
            const int e = tid + i * 128;  // 0..767
            const int p = e >> 8, row = (e >> 2) & 63, ch = e & 3;
            const int gr = m0 + row, gc = k0 + ch * 8;
            ra[i] = (gr < m && gc < ke) ? *(const uint4*)(a3 + p * plane + (u64)gr * k + gc) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + i * 128;  // 0..255
            const int row = e >> 2, ch = e & 3;
            const int gr = n0 + row, gc = k0 + ch * 8;
            rb[i] = (gr < n && gc < ke) ? __ldg((const uint4*)(w + (u64)gr * k + gc)) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    if (kb < ke) load(kb);
    for (int k0 = kb; k0 < ke; k0 += GB_K) {
        __syncthreads();  // the previous tile's fragments have been read
#pragma unroll
        for (int i = 0; i < 6; i++) {
            const int e = tid + i * 128;
            const int p = e >> 8, row = (e >> 2) & 63, ch = e & 3;
            *(uint4*)&As[p][row][ch * 8] = ra[i];
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int e = tid + i * 128;
            const int row = e >> 2, ch = e & 3;
            *(uint4*)&Bs[row][ch * 8] = rb[i];
        }
        __syncthreads();
        if (k0 + GB_K < ke) load(k0 + GB_K);  // next tile in flight during the products
        // This tile's products go into `part`, then into `acc` by ordinary (round-to-nearest) f32
        // adds: mma's own f32 accumulation aligns its terms to the largest and truncates, so
        // accumulating all of k inside the tensor cores would lose up to an ulp of the running sum
        // per step, always toward zero (3 k / 16 steps: 1,536 at k = 8192).
        float part[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) part[i][j][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < GB_K; ks += 16) {
            unsigned int bf[4][2];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const unsigned short* br = &Bs[wn * 32 + j * 8 + gq][ks + 2 * tq];
                bf[j][0] = *(const unsigned int*)br;
                bf[j][1] = *(const unsigned int*)(br + 8);
            }
#pragma unroll
            for (int p = 2; p >= 0; p--) {  // smallest plane first
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const unsigned short* ar = &As[p][wm * 32 + i * 16 + gq][ks + 2 * tq];
                    const unsigned int a0 = *(const unsigned int*)ar;
                    const unsigned int a1 = *(const unsigned int*)(ar + 8 * GB_LD);
                    const unsigned int a2 = *(const unsigned int*)(ar + 8);
                    const unsigned int a3v = *(const unsigned int*)(ar + 8 * GB_LD + 8);
#pragma unroll
                    for (int j = 0; j < 4; j++) mma_bf16(part[i][j], a0, a1, a2, a3v, bf[j][0], bf[j][1]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][j][e] += part[i][j][e];
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = m0 + wm * 32 + i * 16 + gq + (e >> 1) * 8;
                const int col = n0 + wn * 32 + j * 8 + 2 * tq + (e & 1);
                if (row < m && col < n) {
                    float* o = c + (u64)row * n + col;
                    if (mode == 0) *o = acc[i][j][e];
                    else if (mode == 1) *o += acc[i][j][e];
                    else atomicAdd(o, acc[i][j][e]);
                }
            }
}

// One (row t, head h, pair j) of the fused RoPE and KV-cache write below: kernel.rope (rotate-half
// pairing, angle in f64 as kernel rope) on q and k heads at position pos; q rotated in place in row
// r of qkv, the rotated k and the v pair written at cache slot `slot` ([slots, n_kv_heads, head_dim]).
__device__ __forceinline__ void rope_store_pair(float* r, int h, int j, unsigned int pos, u64 slot,
                                                const double* freqs, int n_heads, int n_kv_heads, int head_dim,
                                                float* kc, float* vc) {
    const int half = head_dim / 2, kv_dim = n_kv_heads * head_dim;
    float x0 = r[h * head_dim + j], x1 = r[h * head_dim + j + half];
    if (h < n_heads + n_kv_heads) {
        double sd, cd;
        sincos((double)pos * freqs[j], &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        const float r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
        x0 = r0;
        x1 = r1;
    }
    float* o;
    if (h < n_heads) {
        o = r + h * head_dim + j;
    } else if (h < n_heads + n_kv_heads) {
        o = kc + slot * kv_dim + (h - n_heads) * head_dim + j;
    } else {
        o = vc + slot * kv_dim + (h - n_heads - n_kv_heads) * head_dim + j;
    }
    o[0] = x0;
    o[half] = x1;
}

// RoPE on the q and k heads of m rows of qkv ([m, (n_heads + 2 n_kv_heads) head_dim]) at positions
// start + t, in place for q; the rotated k and the v rows written into the caches at start + t.
// kernel.rope fused with the KV-cache write (rope_store_pair). One thread per (row, head, pair j).
__global__ void rope_store_rows(float* qkv, int m, int start, const double* freqs, int n_heads, int n_kv_heads,
                                int head_dim, float* kc, float* vc) {
    const int half = head_dim / 2, heads = n_heads + 2 * n_kv_heads;
    const long long total = (long long)m * heads * half;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(e % half);
        const long long th = e / half;
        const int h = (int)(th % heads), t = (int)(th / heads);
        const unsigned int pos = (unsigned int)(start + t);
        rope_store_pair(qkv + (u64)t * heads * head_dim, h, j, pos, pos, freqs, n_heads, n_kv_heads, head_dim, kc, vc);
    }
}

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i] for m rows of gu = [m, 2 inter] (kernel.silu_and_mul
// on the rows of a prompt); out: [m, inter].
__global__ void silu_mul_rows(const float* gu, int m, int inter, float* out) {
    const long long total = (long long)m * inter;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long t = e / inter, i = e - t * inter;
        const float g = gu[t * 2 * inter + i];
        out[e] = g / (1.0f + expf(-g)) * gu[t * 2 * inter + inter + i];
    }
}

// Causal attention of n_q query rows at positions start .. start + n_q - 1 over the cache (keys 0..=p
// for the row at p). q rows: q + t * ldq, heads of head_dim; out: [n_q, n_heads, head_dim].
// Grid (ceil(n_q / (64 / grp)), n_kv_heads), 256 threads: a block takes 64 / grp queries and the grp
// query heads of one KV head (64 rows, 8 per warp), key tiles of 32 positions in shared memory; scores
// one key per lane (q.k / sqrt(head_dim), f32), online softmax per row, V weighted with lanes along
// head_dim. grp divides 64, head_dim <= 64.
#define AP_KT 32
#define AP_ROWS 64
#define AP_HD 64

__global__ void __launch_bounds__(256) attn_prefill(const float* q, int ldq, const float* kc, const float* vc,
                                                    int n_q, int start, int n_heads, int n_kv_heads, int head_dim,
                                                    float* out) {
    __shared__ float Qs[AP_ROWS][AP_HD];
    __shared__ float Ks[AP_KT][AP_HD + 1];
    __shared__ float Vs[AP_KT][AP_HD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = n_heads / n_kv_heads, qt = AP_ROWS / grp;
    const int g = blockIdx.y, q0 = blockIdx.x * qt;
    const u64 stride = (u64)n_kv_heads * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    for (int e = threadIdx.x; e < AP_ROWS * AP_HD; e += blockDim.x) {
        const int r = e / AP_HD, d = e - r * AP_HD;
        const int qi = q0 + r / grp, h = g * grp + r % grp;
        Qs[r][d] = (qi < n_q && d < head_dim) ? q[(u64)qi * ldq + h * head_dim + d] : 0.0f;
    }
    float m[8], l[8], acc[8][2];
    int prow[8];
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int qi = q0 + (warp * 8 + r) / grp;
        prow[r] = qi < n_q ? start + qi : -1;  // the row's position; -1: no such query
        m[r] = NEG_INF;
        l[r] = 0.0f;
        acc[r][0] = acc[r][1] = 0.0f;
    }
    const int qlast = min(n_q, q0 + qt) - 1;
    const int kv_end = start + qlast + 1;  // keys this block needs: 0 .. kv_end - 1
    for (int t0 = 0; t0 < kv_end; t0 += AP_KT) {
        __syncthreads();
        for (int e = threadIdx.x; e < AP_KT * AP_HD; e += blockDim.x) {
            const int j = e / AP_HD, d = e - j * AP_HD;
            const int t = t0 + j;
            const bool ok = t < kv_end && d < head_dim;
            Ks[j][d] = ok ? kc[(u64)t * stride + (u64)g * head_dim + d] : 0.0f;
            Vs[j][d] = ok ? vc[(u64)t * stride + (u64)g * head_dim + d] : 0.0f;
        }
        __syncthreads();
        float s[8];
#pragma unroll
        for (int r = 0; r < 8; r++) s[r] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const float kd = Ks[lane][d];
#pragma unroll
            for (int r = 0; r < 8; r++) s[r] = fmaf(Qs[warp * 8 + r][d], kd, s[r]);
        }
        const int t = t0 + lane;
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const float sc = t <= prow[r] ? s[r] * scale : NEG_INF;
            const float mx = warp_max(sc);
            const float mn = fmaxf(m[r], mx);
            float p = 0.0f, corr = 1.0f;
            if (mn != NEG_INF) {
                p = expf(sc - mn);
                corr = expf(m[r] - mn);
            } else if (sc != sc) {
                p = sc;  // every score so far NaN (fmaxf dropped them): the NaN stays in the sums
            }
            l[r] = l[r] * corr + warp_sum(p);
            acc[r][0] *= corr;
            acc[r][1] *= corr;
            m[r] = mn;
            s[r] = p;
        }
        for (int j = 0; j < AP_KT; j++) {
            const float v0 = Vs[j][lane], v1 = Vs[j][lane + 32];
#pragma unroll
            for (int r = 0; r < 8; r++) {
                const float pj = __shfl_sync(0xffffffffu, s[r], j);
                acc[r][0] = fmaf(pj, v0, acc[r][0]);
                acc[r][1] = fmaf(pj, v1, acc[r][1]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int row = warp * 8 + r;
        const int qi = q0 + row / grp, h = g * grp + row % grp;
        if (qi >= n_q) continue;
        const float inv = 1.0f / l[r];
        float* o = out + ((u64)qi * n_heads + h) * head_dim;
        if (lane < head_dim) o[lane] = acc[r][0] * inv;
        if (lane + 32 < head_dim) o[lane + 32] = acc[r][1] * inv;
    }
}

// =====================================================================================================
// Serving kernels (phase 6: several sequences per step over a paged KV cache, src/batch.rs).
// =====================================================================================================

}  // extern "C" (the paged attention body is a template; its kernels are extern "C" again below)

// ---- kernel.paged_attention: one block per (query row, KV head, part of its GQA group), PA_WARPS
// warps, so that the keys and values a group shares are read once for all its query heads ----
// The row's sequence s is found in query_start (binary search), its position p = context_lens[s] -
// n_q(s) + (row - query_start[s]). The block takes the query heads h0 .. h0 + nh - 1 of KV head g (nh
// at most HB = min(8, PA_SLOTS / ND): its lanes hold HB x ND values of q and of the weighted V sum).
// The warps take the keys t = warp, warp + PA_WARPS, ... <= p, each found through the block table
// (block table[s][t / block_size], slot t % block_size); per key a warp loads the key and value rows
// once, computes q.k for each of its heads with lanes along head_dim (warp_sum), and updates each
// head's online softmax (running max m, sum l and weighted V in registers). The warps' partials are
// merged in shared memory at the end, so no context-sized buffer is needed. Each head's sums are
// taken in the same order as with a block per head. q rows at q + row * ldq (ldq >= n_heads *
// head_dim: a row of the fused qkv product); out: [total_q, n_heads, head_dim]; head_dim <= ND * 32.
// A block id outside the cache or a position outside the table (a broken table) writes NaN for the
// row's heads, never reads there.
#define PA_WARPS 4
#define PA_MAX_HD 256
#define PA_SLOTS 16

template <int ND>
__device__ __forceinline__ void paged_attention_group(const float* q, int ldq, const float* kc, const float* vc,
                                                      const unsigned int* table, int blocks_per_seq,
                                                      const unsigned int* query_start,
                                                      const unsigned int* context_lens, int n_seqs, int num_blocks,
                                                      int n_heads, int n_kv_heads, int head_dim, int block_size,
                                                      float* out) {
    constexpr int HB = PA_SLOTS / ND < 8 ? PA_SLOTS / ND : 8;
    __shared__ float wm[PA_WARPS][HB], wl[PA_WARPS][HB];
    __shared__ float wacc[PA_WARPS][HB * ND * 32];
    __shared__ int bad;
    const int grp = n_heads / n_kv_heads, parts = (grp + HB - 1) / HB;
    const int row = blockIdx.x / (n_kv_heads * parts), rest = blockIdx.x % (n_kv_heads * parts);
    const int g = rest / parts, part = rest % parts;
    const int h0 = g * grp + part * HB, nh = min(HB, grp - part * HB);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) bad = 0;
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if ((int)query_start[mid] <= row) lo = mid;
        else hi = mid - 1;
    }
    const int s = lo;
    const int q0 = (int)query_start[s], n_q = (int)query_start[s + 1] - q0;
    const long long p = (long long)context_lens[s] - n_q + (row - q0);
    const unsigned int* tr = table + (u64)s * blocks_per_seq;
    const u64 kv_stride = (u64)n_kv_heads * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    float qv[HB][ND], acc[HB][ND], m[HB], l[HB];
#pragma unroll
    for (int j = 0; j < HB; j++) {
        const float* qr = q + (u64)row * ldq + (u64)(h0 + j) * head_dim;
        m[j] = NEG_INF;
        l[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < ND; i++) {
            const int c = lane + 32 * i;
            qv[j][i] = (j < nh && c < head_dim) ? qr[c] : 0.0f;
            acc[j][i] = 0.0f;
        }
    }
    __syncthreads();
    if (n_q < 1 || p < 0 || p >= (long long)blocks_per_seq * block_size) {
        if (threadIdx.x == 0) bad = 1;
    }
    for (long long t = warp; t <= p && t < (long long)blocks_per_seq * block_size; t += PA_WARPS) {
        const unsigned int b = tr[t / block_size];
        if (b >= (unsigned int)num_blocks) {
            if (lane == 0) bad = 1;
            break;
        }
        const u64 base = ((u64)b * block_size + (u64)(t % block_size)) * kv_stride + (u64)g * head_dim;
        float kv[ND], vv[ND];
#pragma unroll
        for (int i = 0; i < ND; i++) {
            const int c = lane + 32 * i;
            kv[i] = c < head_dim ? kc[base + c] : 0.0f;
            vv[i] = c < head_dim ? vc[base + c] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < HB; j++) {
            if (j < nh) {  // nh is the same for every lane: the shuffles stay converged
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < ND; i++) d = fmaf(qv[j][i], kv[i], d);
                d = warp_sum(d) * scale;
                const float mn = fmaxf(m[j], d);
                const float corr = expf(m[j] - mn);  // 0 for the first key (m = -inf)
                const float e = expf(d - mn);
                l[j] = l[j] * corr + e;
#pragma unroll
                for (int i = 0; i < ND; i++) acc[j][i] = fmaf(e, vv[i], acc[j][i] * corr);
                m[j] = mn;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < HB; j++) {
        if (lane == 0) {
            wm[warp][j] = m[j];
            wl[warp][j] = l[j];
        }
#pragma unroll
        for (int i = 0; i < ND; i++) wacc[warp][j * ND * 32 + lane + 32 * i] = acc[j][i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nh * head_dim; e += blockDim.x) {
        const int j = e / head_dim, c = e - j * head_dim;
        float mx = NEG_INF;
        for (int w = 0; w < PA_WARPS; w++) mx = fmaxf(mx, wm[w][j]);
        float sum = 0.0f, a = 0.0f;
        for (int w = 0; w < PA_WARPS; w++) {
            // A warp with no key has l = 0; one whose scores were all NaN has m = -inf (fmaxf drops
            // a NaN) and l = NaN, and must stay in the sums so that the NaN reaches out.
            if (wl[w][j] == 0.0f) continue;
            const float f = expf(wm[w][j] - mx);
            sum += wl[w][j] * f;
            a += wacc[w][j * ND * 32 + c] * f;
        }
        out[((u64)row * n_heads + h0 + j) * head_dim + c] = bad ? __int_as_float(0x7fc00000) : a / sum;
    }
}

extern "C" {

// paged_attention_dN: the paged attention for head_dim <= 32 N (N = 1, 2, 4, 8: the lanes' chunks of a
// head), 8 query heads a block (4 at head_dim 128, 2 at 256). Grid: total_q x n_kv_heads x
// ceil(group / heads a block); PA_WARPS x 32 threads.
#define PAGED_ATTENTION(N)                                                                                      \
    __global__ void __launch_bounds__(PA_WARPS * 32) paged_attention_d##N(                                   \
        const float* q, int ldq, const float* kc, const float* vc, const unsigned int* table, int blocks_per_seq, \
        const unsigned int* query_start, const unsigned int* context_lens, int n_seqs, int num_blocks,        \
        int n_heads, int n_kv_heads, int head_dim, int block_size, float* out) {                              \
        paged_attention_group<N>(q, ldq, kc, vc, table, blocks_per_seq, query_start, context_lens, n_seqs,    \
                                 num_blocks, n_heads, n_kv_heads, head_dim, block_size, out);                 \
    }
PAGED_ATTENTION(1)
PAGED_ATTENTION(2)
PAGED_ATTENTION(4)
PAGED_ATTENTION(8)

// RoPE on the q and k heads of m rows of qkv ([m, (n_heads + 2 n_kv_heads) head_dim]), row t at
// position pos[t], q rotated in place; the rotated k and the v rows written into the paged caches
// ([num_blocks * block_size, n_kv_heads, head_dim]) at slot[t] = block * block_size + offset.
// rope_store_rows with a position and a cache slot per row (the rows of a batched step belong to
// several sequences). One thread per (row, head, pair j).
__global__ void rope_store_paged(float* qkv, int m, const unsigned int* pos, const unsigned int* slot,
                                 const double* freqs, int n_heads, int n_kv_heads, int head_dim, float* kc,
                                 float* vc) {
    const int half = head_dim / 2, heads = n_heads + 2 * n_kv_heads;
    const long long total = (long long)m * heads * half;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(e % half);
        const long long th = e / half;
        const int h = (int)(th % heads), t = (int)(th / heads);
        rope_store_pair(qkv + (u64)t * heads * head_dim, h, j, pos[t], slot[t], freqs, n_heads, n_kv_heads,
                        head_dim, kc, vc);
    }
}

// =====================================================================================================
// Mixture of experts (model.qwen3_moe, model.mixtral): routing and the selected experts on the device,
// so a token reads only its top_k experts' weights and the host never sees the selection.
// =====================================================================================================

// ---- kernel.moe_route: one warp. softmax over the n router scores, the top_k largest kept (equal
// weights: the lower index first), divided by their sum when renormalize; out [n]: the kept weights
// at their expert index, 0 elsewhere (all NaN when a score is NaN). p: n floats of dynamic shared
// memory. ----
__global__ void moe_route(const float* scores, int n, int top_k, int renormalize, float* out) {
    extern __shared__ float p[];
    const int lane = threadIdx.x;
    // A NaN score (a broken router) makes every weight NaN: the token's output shows it.
    bool nan = false;
    for (int e = lane; e < n; e += 32) nan |= isnan(scores[e]);
    if (__any_sync(0xffffffffu, nan)) {
        for (int e = lane; e < n; e += 32) out[e] = __int_as_float(0x7fc00000);
        return;
    }
    float mx = NEG_INF;
    for (int e = lane; e < n; e += 32) mx = fmaxf(mx, scores[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < n; e += 32) {
        const float v = expf(scores[e] - mx);
        p[e] = v;
        sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < n; e += 32) {
        p[e] = p[e] / sum;
        out[e] = 0.0f;
    }
    __syncwarp();
    // k rounds of the first maximum over the experts not yet kept (kept ones marked -1).
    float kept_sum = 0.0f;
    for (int r = 0; r < top_k; r++) {
        float bv = -2.0f;
        int bi = n;
        for (int e = lane; e < n; e += 32) {
            const float v = p[e];
            if (v > bv || (v == bv && e < bi)) {
                bv = v;
                bi = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (bi >= n) break;
        if (lane == 0) {
            out[bi] = bv;
            p[bi] = -1.0f;
        }
        kept_sum += bv;
        __syncwarp();
    }
    if (renormalize) {
        __syncwarp();
        for (int e = lane; e < n; e += 32) {
            if (p[e] < 0.0f) out[e] = out[e] / kept_sum;
        }
    }
}

// ---- kernel.moe_experts, first half: act[e, r] = route[e] * silu(x . gate[e, r]) * (x . up[e, r])
// for every expert e with route[e] != 0 and row r < inter. One warp per row r, looping over the
// selected experts; lanes along hidden, bf16 weights widened, f32 accumulation. gate, up: [n, inter,
// hidden] bf16. Rows of unselected experts are neither read nor written. ----
__global__ void moe_gate_up(const float* x, const float* route, const unsigned short* gate,
                            const unsigned short* up, int n, int inter, int hidden, float* act) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= inter) return;
    for (int e = 0; e < n; e++) {
        const float w = route[e];
        if (w == 0.0f) continue;
        const u64 row = ((u64)e * inter + r) * hidden;
        float g = 0.0f, u = 0.0f;
        for (int c = lane; c < hidden; c += 32) {
            const float xc = x[c];
            g = fmaf(xc, bf16_to_f32(gate[row + c]), g);
            u = fmaf(xc, bf16_to_f32(up[row + c]), u);
        }
        g = warp_sum(g);
        u = warp_sum(u);
        if (lane == 0) act[(u64)e * inter + r] = w * (g / (1.0f + expf(-g))) * u;
    }
}

// ---- kernel.moe_experts, second half: out[o] (= or += when accumulate) sum over the selected
// experts e of act[e, :] . down[e, o, :]. One warp per output row o; down: [n, hidden, inter] bf16. ----
__global__ void moe_down(const float* act, const float* route, const unsigned short* down, int n, int inter,
                         int hidden, float* out, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= hidden) return;
    float acc = 0.0f;
    for (int e = 0; e < n; e++) {
        if (route[e] == 0.0f) continue;
        const u64 row = ((u64)e * hidden + o) * inter;
        const float* a = act + (u64)e * inter;
        for (int c = lane; c < inter; c += 32) acc = fmaf(a[c], bf16_to_f32(down[row + c]), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[o] = accumulate ? out[o] + acc : acc;
}

}  // extern "C"
