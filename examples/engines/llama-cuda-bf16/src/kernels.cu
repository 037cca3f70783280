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

}  // extern "C"
