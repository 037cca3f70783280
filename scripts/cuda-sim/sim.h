// A CPU model of the CUDA execution the example engine's kernels (kernels.cu) rely on, so that
// their results can be checked on a machine without a GPU (scripts/cuda-sim-check.sh).
//
// Every CUDA thread of a block is an OS thread (the same threads take each block of a launch in
// turn); the blocks of a grid run one after another in a shuffled order (no kernel may depend on the order of blocks). __syncthreads is a barrier of the
// block's threads, warp shuffles and __syncwarp are barriers of the warp's 32 threads with a
// register exchange, and a thread that returns leaves both barriers (what the hardware does with an
// exited thread). Shared memory is the kernels' static arrays (one block at a time) and a dynamic
// buffer of the launch's size, both filled with NaN bits before each block so that reading an
// element the block did not write shows.
// mma.sync m16n8k16 (bf16 in, f32 accumulate) is computed from the fragment layout of the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type", PTX ISA 8.x, section 9.7.14.5.8):
// groupID g = lane / 4, t = lane % 4; A regs a0: row g, cols 2t, 2t+1; a1: row g+8, same cols;
// a2: row g, cols 2t+8, 2t+9; a3: row g+8, cols 2t+8, 2t+9; B regs b0: rows 2t, 2t+1 of col g;
// b1: rows 2t+8, 2t+9 of col g; C/D c0, c1: row g, cols 2t, 2t+1; c2, c3: row g+8; the lower 16
// bits of a register hold the lower index. The sum is taken in f64 and rounded once (the hardware
// truncates its alignment; the checks' tolerances cover either).
//
// What it does not model: timing; blocks running at once (one block runs at a time, so a race
// between blocks, such as a non-atomic update of a counter or output other blocks also update,
// passes here); races within a block that the barriers happen to order (threads run freely between
// barriers, so such a race passes unless the scheduling shows it); resource limits (registers, the
// 48 KiB shared-memory default: scripts/nvrtc-check.py checks those). Reads outside a buffer show
// with SANITIZE=1 (scripts/cuda-sim-check.sh), reads of shared memory a block did not write as NaN.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
struct uint4 {
    unsigned int x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }

namespace sim {
struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    uint64_t slot[32];
    unsigned int frag[32][6];  // mma_bf16: each lane's six fragment registers
};
struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<Warp> warps;
};
inline thread_local Block* block = nullptr;
inline thread_local int lane_id = 0;
inline std::vector<unsigned char> dyn_smem;
}  // namespace sim

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
// Static shared arrays go to one linker section, poisoned (NaN bits) before each block as the
// dynamic buffer is, so a kernel that reads shared memory it has not written in this block shows.
#define __shared__ static __attribute__((section("sim_shared")))
extern "C" unsigned char __start_sim_shared[], __stop_sim_shared[];

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return std::atomic_ref<unsigned int>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }

inline void __syncthreads() { sim::block->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { sim::block->warps[threadIdx.x / 32].bar->arrive_and_wait(); }

namespace sim {
// Every lane of the warp posts `v` and reads lane `src(lane)`'s.
template <class T, class F> inline T exchange(T v, F src) {
    Warp& w = block->warps[threadIdx.x / 32];
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane_id] = bits;
    w.bar->arrive_and_wait();
    const uint64_t got = w.slot[src(lane_id) & 31];
    w.bar->arrive_and_wait();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}
}  // namespace sim

template <class T> inline T __shfl_xor_sync(unsigned int, T v, int m) { return sim::exchange(v, [m](int l) { return l ^ m; }); }
template <class T> inline T __shfl_sync(unsigned int, T v, int src) { return sim::exchange(v, [src](int) { return src; }); }
inline int __any_sync(unsigned int, int p) {
    int any = 0;
    for (int o = 0; o < 32; o++) any |= sim::exchange(p ? 1 : 0, [o](int) { return o; });
    return any;
}

namespace sim {
inline float bf16(unsigned int bits16) { return __uint_as_float(bits16 << 16); }
// d += a b for one m16n8k16 tile held by the warp's 32 lanes (layout: see the top of this file).
inline void mma_bf16(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                     unsigned int b0, unsigned int b1) {
    double A[16][16], B[16][8];
    Warp& w = block->warps[threadIdx.x / 32];
    const unsigned int regs[6] = {a0, a1, a2, a3, b0, b1};
    std::memcpy(w.frag[lane_id], regs, sizeof regs);
    w.bar->arrive_and_wait();
    for (int src = 0; src < 32; src++) {
        const unsigned int* r = w.frag[src];
        const int g = src / 4, t = src % 4;
        for (int h = 0; h < 2; h++) {
            A[g][2 * t + h] = bf16((r[0] >> (16 * h)) & 0xffff);
            A[g + 8][2 * t + h] = bf16((r[1] >> (16 * h)) & 0xffff);
            A[g][2 * t + 8 + h] = bf16((r[2] >> (16 * h)) & 0xffff);
            A[g + 8][2 * t + 8 + h] = bf16((r[3] >> (16 * h)) & 0xffff);
            B[2 * t + h][g] = bf16((r[4] >> (16 * h)) & 0xffff);
            B[2 * t + 8 + h][g] = bf16((r[5] >> (16 * h)) & 0xffff);
        }
    }
    w.bar->arrive_and_wait();
    const int g = lane_id / 4, t = lane_id % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; i++) {
        double s = d[i];
        for (int kk = 0; kk < 16; kk++) s += A[rows[i]][kk] * B[kk][cols[i]];
        d[i] = (float)s;
    }
}

// Run kernel `k` over `grid` x `block` threads with `smem` bytes of dynamic shared memory; blocks
// in an order shuffled by `seed`.
template <class... P, class... A>
void launch(void (*k)(P...), dim3 grid, dim3 blk, size_t smem, uint64_t seed, A... args) {
    const int n = (int)(blk.x * blk.y * blk.z);
    std::vector<dim3> order;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) order.push_back({x, y, z});
    std::mt19937_64 rng(seed);
    std::shuffle(order.begin(), order.end(), rng);
    dyn_smem.assign(smem + 16, 0xff);
    // Each block's barriers, made before the threads start; the threads (made once per launch)
    // take the blocks in turn and meet between blocks, so one block runs at a time.
    std::vector<Block> blocks(order.size());
    for (auto& bl : blocks) {
        bl.bar = std::make_unique<std::barrier<>>(n);
        for (int w = 0; w * 32 < n; w++) {
            Warp wp;
            wp.bar = std::make_unique<std::barrier<>>(std::min(32, n - w * 32));
            bl.warps.push_back(std::move(wp));
        }
    }
    auto refill = []() noexcept {
        std::fill(dyn_smem.begin(), dyn_smem.end(), 0xff);
        std::fill(__start_sim_shared, __stop_sim_shared, 0xff);
    };
    refill();
    std::barrier between(n, refill);
    std::vector<std::thread> threads;
    for (int t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            lane_id = t % 32;
            threadIdx = {(unsigned)t, 0, 0};
            blockDim = blk;
            gridDim = grid;
            for (size_t i = 0; i < order.size(); i++) {
                block = &blocks[i];
                blockIdx = order[i];
                k(args...);
                blocks[i].warps[t / 32].bar->arrive_and_drop();
                blocks[i].bar->arrive_and_drop();
                between.arrive_and_wait();
            }
        });
    }
    for (auto& th : threads) th.join();
}
}  // namespace sim
