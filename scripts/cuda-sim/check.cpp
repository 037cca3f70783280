// Checks of the CUDA example engine's kernels on the CPU model of sim.h: each kernel is
// launched as src/kernels.rs, src/fused.rs and src/batch.rs launch it (grid, block, shared memory), on random
// inputs of small shapes, and compared with an f64 loop written here from the kernel contracts'
// math (kernel.linear_bf16, kernel.rms_norm, kernel.rope, kernel.attention, kernel.argmax,
// kernel.paged_attention, component.kv_cache). Built and run by scripts/cuda-sim-check.sh, which
// includes the kernels' source (with the two edits it names) before this file.
#include <cstdio>
#include <string>

namespace {

std::mt19937_64 rng(20261207);
int failures = 0;
const int SMS = 3;  // the SM count the grids are sized from (fused.rs mv_grid, gemm_bf16x3)

std::vector<float> randn(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

// Round to the nearest bf16 (ties to even): the weights' storage format.
unsigned short to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
double bf(unsigned short b) { return (double)sim::bf16(b); }
std::vector<unsigned short> randw(size_t n, float scale) {
    std::vector<unsigned short> w(n);
    for (auto& x : w) x = to_bf16(randn(1, scale)[0]);
    return w;
}

// Compare got with want: |got - want| <= tol * (1 + |want|) everywhere (with `relative`, tol *
// |want|), NaN exactly where want is NaN.
void expect(const char* name, const std::vector<float>& got, const std::vector<double>& want, double tol,
            bool relative = false) {
    double worst = 0.0;
    size_t at = 0, bad = 0;
    for (size_t i = 0; i < want.size(); i++) {
        const double e = std::isnan(want[i]) ? (std::isnan(got[i]) ? 0.0 : INFINITY)
                                             : std::fabs((double)got[i] - want[i]) / ((relative ? 0.0 : 1.0) + std::fabs(want[i]));
        if (!(e <= tol)) bad++;
        if (!(e <= worst)) { worst = e; at = i; }
    }
    const bool ok = bad == 0 && got.size() == want.size();
    if (!ok) failures++;
    std::printf("%s %-44s max rel err %.2e at %zu (got %.6g, want %.6g)%s\n", ok ? "PASS" : "FAIL", name, worst, at,
                want.empty() ? 0.0 : (double)got[at], want.empty() ? 0.0 : want[at],
                bad ? (" " + std::to_string(bad) + " outside " + std::to_string(tol)).c_str() : "");
}
void expect_eq(const char* name, long long got, long long want) {
    const bool ok = got == want;
    if (!ok) failures++;
    std::printf("%s %-44s %lld (want %lld)\n", ok ? "PASS" : "FAIL", name, got, want);
}

const float NaNf = __uint_as_float(0x7fc00000u);

std::vector<double> rms(const std::vector<float>& x, const std::vector<float>& g, double eps) {
    double s = 0.0;
    for (float v : x) s += (double)v * v;
    const double inv = 1.0 / std::sqrt(s / x.size() + eps);
    std::vector<double> o(x.size());
    for (size_t i = 0; i < x.size(); i++) o[i] = x[i] * inv * g[i];
    return o;
}
std::vector<double> matvec(const std::vector<double>& x, const std::vector<unsigned short>& w, int n) {
    const size_t k = x.size();
    std::vector<double> o(n, 0.0);
    for (int r = 0; r < n; r++)
        for (size_t c = 0; c < k; c++) o[r] += x[c] * bf(w[r * k + c]);
    return o;
}
std::vector<double> widen(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }

dim3 mv_grid(int groups) { return {(unsigned)std::clamp((groups + 7) / 8, 1, SMS * 2), 1, 1}; }

// Rotate-half RoPE of one head (kernel.rope): pairs (j, j + d/2), angle pos * freqs[j].
void rope_ref(double* h, int d, unsigned pos, const std::vector<double>& freqs) {
    for (int j = 0; j < d / 2; j++) {
        const double a = pos * freqs[j], c = std::cos(a), s = std::sin(a);
        const double x0 = h[j], x1 = h[j + d / 2];
        h[j] = x0 * c - x1 * s;
        h[j + d / 2] = x0 * s + x1 * c;
    }
}
std::vector<double> freqs_of(int d) {
    std::vector<double> f(d / 2);
    for (int j = 0; j < d / 2; j++) f[j] = std::pow(10000.0, -2.0 * j / d);
    return f;
}

// softmax(q.k / sqrt(d)) v over keys 0..=p of one query head (kernel.attention), keys given by
// key(t) and values by val(t), each a pointer to d floats.
template <class K, class V> std::vector<double> attend(const float* q, int d, long long p, K key, V val) {
    std::vector<double> sc(p + 1), o(d, 0.0);
    double mx = -INFINITY, sum = 0.0;
    for (long long t = 0; t <= p; t++) {
        double s = 0.0;
        for (int c = 0; c < d; c++) s += (double)q[c] * key(t)[c];
        sc[t] = s / std::sqrt((double)d);
        mx = std::max(mx, sc[t]);
    }
    for (long long t = 0; t <= p; t++) sum += (sc[t] = std::exp(sc[t] - mx));
    for (long long t = 0; t <= p; t++)
        for (int c = 0; c < d; c++) o[c] += sc[t] / sum * val(t)[c];
    return o;
}

void check_mv() {
    const int n = 100, k = 264;
    auto x = randn(k), gain = randn(k, 0.5f), gu = randn(2 * k), out0 = randn(n);
    auto w = randw((size_t)n * k, 0.05f);
    std::vector<float> out(n, NaNf);
    sim::launch(mv_bf16, mv_grid(n), {256}, k * 4, 1, x.data(), w.data(), k, n, out.data(), 0);
    expect("mv_bf16", out, matvec(widen(x), w, n), 1e-5);
    out = out0;
    sim::launch(mv_bf16, mv_grid(n), {256}, k * 4, 2, x.data(), w.data(), k, n, out.data(), 1);
    auto want = matvec(widen(x), w, n);
    for (int i = 0; i < n; i++) want[i] += out0[i];
    expect("mv_bf16 accumulate", out, want, 1e-5);
    out.assign(n, NaNf);
    sim::launch(mv_bf16_norm, mv_grid(n), {256}, k * 4, 3, x.data(), gain.data(), 1e-5f, w.data(), k, n, out.data());
    expect("mv_bf16_norm", out, matvec(rms(x, gain, 1e-5), w, n), 1e-5);
    out = out0;
    sim::launch(mv_bf16_silu, mv_grid(n), {256}, k * 4, 4, gu.data(), w.data(), k, n, out.data());
    std::vector<double> act(k);
    for (int c = 0; c < k; c++) act[c] = gu[c] / (1.0 + std::exp(-(double)gu[c])) * gu[k + c];
    want = matvec(act, w, n);
    for (int i = 0; i < n; i++) want[i] += out0[i];
    expect("mv_bf16_silu (+ residual)", out, want, 1e-5);
}

void check_qkv() {
    const int H = 4, KVH = 2, D = 16, k = 64, max_seq = 8, n = (H + 2 * KVH) * D;
    const unsigned pos = 5;
    auto x = randn(k), gain = randn(k, 0.5f);
    auto w = randw((size_t)n * k, 0.1f);
    auto freqs = freqs_of(D);
    unsigned ctl[3] = {pos, 0, 0};
    std::vector<float> q(H * D, NaNf), kc(max_seq * KVH * D, 7.0f), vc(max_seq * KVH * D, 7.0f);
    sim::launch(mv_bf16_qkv, mv_grid(n / 2), {256}, k * 4, 5, x.data(), gain.data(), 1e-6f, w.data(), k,
                (const unsigned*)ctl, (const double*)freqs.data(), H, KVH, D, q.data(), kc.data(), vc.data());
    auto y = matvec(rms(x, gain, 1e-6), w, n);
    for (int h = 0; h < H + KVH; h++) rope_ref(&y[h * D], D, pos, freqs);
    std::vector<double> wq(y.begin(), y.begin() + H * D), wkc(kc.size(), 7.0), wvc(vc.size(), 7.0);
    for (int c = 0; c < KVH * D; c++) {
        wkc[pos * KVH * D + c] = y[H * D + c];
        wvc[pos * KVH * D + c] = y[(H + KVH) * D + c];
    }
    expect("mv_bf16_qkv q (RMSNorm, RoPE)", q, wq, 1e-5);
    expect("mv_bf16_qkv key cache (row pos only)", kc, wkc, 1e-5);
    expect("mv_bf16_qkv value cache (row pos only)", vc, wvc, 1e-5);
}

void check_head() {
    const int n = 300, k = 64, blocks = mv_grid(n).x;
    auto x = randn(k), gain = randn(k, 0.5f);
    auto w = randw((size_t)n * k, 0.1f);
    std::vector<float> logits(n, NaNf), part_v(4096, NaNf);
    std::vector<unsigned> part_i(4096, 77), trail(8, 99);
    unsigned ticket = 0, ctl[3] = {3, 2, 0};
    sim::launch(mv_bf16_head, dim3{(unsigned)blocks}, {256}, k * 4, 6, x.data(), gain.data(), 1e-5f, w.data(), k, n,
                logits.data(), 1, part_v.data(), part_i.data(), &ticket, ctl, trail.data());
    auto want = matvec(rms(x, gain, 1e-5), w, n);
    expect("mv_bf16_head logits", logits, want, 1e-5);
    const long long best = std::max_element(want.begin(), want.end()) - want.begin();
    expect_eq("mv_bf16_head argmax token ctl[2]", ctl[2], best);
    expect_eq("mv_bf16_head argmax trail[step]", trail[2], best);
    expect_eq("mv_bf16_head position advanced", ctl[0], 4);
    expect_eq("mv_bf16_head step advanced", ctl[1], 3);
    expect_eq("mv_bf16_head ticket reset", ticket, 0);
    // A tie: two equal rows, the lower index wins (kernel.argmax: first maximum).
    std::copy(w.begin() + 250 * k, w.begin() + 251 * k, w.begin() + 17 * k);
    for (int c = 0; c < k; c++) w[250 * k + c] = w[17 * k + c] = to_bf16(std::fabs(bf(w[17 * k + c])) * (gain[c] > 0 ? 4 : -4) * (x[c] > 0 ? 1 : -1));
    sim::launch(mv_bf16_head, dim3{(unsigned)blocks}, {256}, k * 4, 7, x.data(), gain.data(), 1e-5f, w.data(), k, n,
                logits.data(), 1, part_v.data(), part_i.data(), &ticket, ctl, trail.data());
    want = matvec(rms(x, gain, 1e-5), w, n);
    expect_eq("mv_bf16_head first of two equal maxima", ctl[2], std::max_element(want.begin(), want.end()) - want.begin());
}

void check_attn_decode(int pos, int max_seq) {
    const int H = 8, KVH = 2, D = 40, grp = H / KVH;
    const int splits = std::clamp((max_seq + 31) / 32, 1, 32);
    auto q = randn(H * D), kc = randn((size_t)max_seq * KVH * D), vc = randn((size_t)max_seq * KVH * D);
    unsigned ctl[3] = {(unsigned)pos, 0, 0};
    std::vector<float> ml(KVH * splits * grp * 2, NaNf), acc((size_t)KVH * splits * grp * D, NaNf), out(H * D, NaNf);
    std::vector<unsigned> ticket(KVH, 0);
    sim::launch(attn_decode, dim3{(unsigned)KVH, (unsigned)splits, 1}, {256}, 0, 8 + pos, q.data(), kc.data(),
                vc.data(), (const unsigned*)ctl, H, KVH, D, splits, ml.data(), acc.data(), ticket.data(), out.data());
    std::vector<double> want;
    for (int h = 0; h < H; h++) {
        const int g = h / grp;
        auto o = attend(&q[h * D], D, pos, [&](long long t) { return &kc[(t * KVH + g) * D]; },
                        [&](long long t) { return &vc[(t * KVH + g) * D]; });
        want.insert(want.end(), o.begin(), o.end());
    }
    const std::string name = "attn_decode pos " + std::to_string(pos) + ", " + std::to_string(splits) + " splits";
    expect(name.c_str(), out, want, 1e-5);
    expect_eq((name + ": tickets reset").c_str(), ticket[0] + ticket[1], 0);
    if (pos < 37) return;
    // Every key of the first split NaN (one element each, KV head 1): that group's heads are NaN,
    // even though no warp of that split saw a finite score.
    const int per = (pos + 1 + splits - 1) / splits;
    for (int t = 0; t < per; t++) kc[(t * KVH + 1) * D + 3] = NaNf;
    sim::launch(attn_decode, dim3{(unsigned)KVH, (unsigned)splits, 1}, {256}, 0, 9 + pos, q.data(), kc.data(),
                vc.data(), (const unsigned*)ctl, H, KVH, D, splits, ml.data(), acc.data(), ticket.data(), out.data());
    for (int h = grp; h < H; h++)
        for (int c = 0; c < D; c++) want[h * D + c] = NAN;
    expect((name + ", a split of NaN keys").c_str(), out, want, 1e-5);
}

void check_gemm(int m, int k, int n, int mode_acc) {
    auto x = randn((size_t)m * k), c0 = randn((size_t)m * n);
    auto w = randw((size_t)n * k, 0.05f);
    std::vector<unsigned short> a3((size_t)3 * m * k, 0xffff);
    const long long len = (long long)m * k;
    // As fused.rs split3 launches it: elementwise(len) blocks of 256.
    sim::launch(split3_bf16, dim3{(unsigned)std::clamp((len + 255) / 256, 1LL, 4096LL)}, {256}, 0, 9, x.data(), len,
                a3.data());
    std::vector<float> back(len);
    for (long long i = 0; i < len; i++) back[i] = (float)(bf(a3[i]) + bf(a3[len + i]) + bf(a3[2 * len + i]));
    expect("split3_bf16 planes sum to x", back, widen(x), 0.0);
    // Splits as fused.rs gemm_bf16x3 chooses them.
    const int tiles = ((n + 63) / 64) * ((m + 63) / 64), want_blocks = 2 * SMS;
    int splits = tiles >= want_blocks ? 1 : std::max(1, std::min((want_blocks + tiles - 1) / tiles, k / 256));
    const int kchunk = ((k + splits - 1) / splits + 31) / 32 * 32;
    splits = (k + kchunk - 1) / kchunk;
    std::vector<float> out = mode_acc ? c0 : std::vector<float>((size_t)m * n, NaNf);
    int mode = mode_acc;
    if (splits > 1) {
        if (!mode_acc) std::fill(out.begin(), out.end(), 0.0f);
        mode = 2;
    }
    sim::launch(gemm_bf16x3, dim3{(unsigned)((n + 63) / 64), (unsigned)((m + 63) / 64), (unsigned)splits}, {128}, 0,
                10 + k, (const unsigned short*)a3.data(), (const unsigned short*)w.data(), m, k, n, out.data(), mode,
                kchunk);
    std::vector<double> want((size_t)m * n);
    for (int r = 0; r < m; r++)
        for (int o = 0; o < n; o++) {
            double s = mode_acc ? c0[(size_t)r * n + o] : 0.0;
            for (int c = 0; c < k; c++) s += (double)x[(size_t)r * k + c] * bf(w[(size_t)o * k + c]);
            want[(size_t)r * n + o] = s;
        }
    const std::string name = "gemm_bf16x3 m " + std::to_string(m) + " k " + std::to_string(k) + " n " +
                             std::to_string(n) + (mode_acc ? " +=" : " =") + " (" + std::to_string(splits) + " k-splits)";
    expect(name.c_str(), out, want, 2e-5);
}

void check_attn_prefill() {
    const int H = 4, KVH = 2, D = 32, n_q = 70, start = 5, grp = H / KVH, ldq = (H + 2 * KVH) * D;
    auto q = randn((size_t)n_q * ldq), kc = randn((size_t)(start + n_q) * KVH * D), vc = randn(kc.size());
    std::vector<float> out((size_t)n_q * H * D, NaNf);
    const int rows_per_block = 64 / grp;
    sim::launch(attn_prefill, dim3{(unsigned)((n_q + rows_per_block - 1) / rows_per_block), (unsigned)KVH, 1}, {256}, 0,
                11, q.data(), ldq, kc.data(), vc.data(), n_q, start, H, KVH, D, out.data());
    std::vector<double> want;
    for (int t = 0; t < n_q; t++)
        for (int h = 0; h < H; h++) {
            const int g = h / grp;
            auto o = attend(&q[(size_t)t * ldq + h * D], D, start + t, [&](long long s) { return &kc[(s * KVH + g) * D]; },
                            [&](long long s) { return &vc[(s * KVH + g) * D]; });
            want.insert(want.end(), o.begin(), o.end());
        }
    expect("attn_prefill (causal, start 5, 70 rows)", out, want, 1e-5);
    // The first 32 keys NaN (one element each, KV head 0): rows whose keys include them are NaN for
    // that group's heads; past the first key tile the later tiles' finite scores must not hide it.
    for (int t = 0; t < 32; t++) kc[(t * KVH + 0) * D + 3] = NaNf;
    out.assign(out.size(), 0.0f);
    sim::launch(attn_prefill, dim3{(unsigned)((n_q + rows_per_block - 1) / rows_per_block), (unsigned)KVH, 1}, {256}, 0,
                12, q.data(), ldq, kc.data(), vc.data(), n_q, start, H, KVH, D, out.data());
    for (int t = 0; t < n_q; t++)
        for (int h = 0; h < grp; h++)
            for (int c = 0; c < D; c++) want[((size_t)t * H + h) * D + c] = NAN;
    expect("attn_prefill, 32 NaN keys", out, want, 1e-5);
}

// The paged attention kernel src/batch.rs picks for head_dim (paged_attention_dN, N the lanes' chunks
// of a head), with its grid: one block per (query row, KV head, up to 16 / N (at most 8) heads).
using PagedFn = void (*)(const float*, int, const float*, const float*, const unsigned*, int, const unsigned*,
                         const unsigned*, int, int, int, int, int, int, float*);
void run_paged(const std::vector<float>& q, int ldq, const std::vector<float>& kc, const std::vector<float>& vc,
               const std::vector<unsigned>& table, int bps, const unsigned* qs, const unsigned* ctx, int n_seqs,
               int nb, int H, int KVH, int D, int bs, int total_q, std::vector<float>& out, uint64_t seed) {
    int chunks = 1;
    while (chunks * 32 < D) chunks *= 2;
    const PagedFn fns[4] = {paged_attention_d1, paged_attention_d2, paged_attention_d4, paged_attention_d8};
    const PagedFn f = fns[chunks == 1 ? 0 : chunks == 2 ? 1 : chunks == 4 ? 2 : 3];
    const int per_block = std::min(16 / chunks, 8), parts = (H / KVH + per_block - 1) / per_block;
    sim::launch(f, dim3{(unsigned)(total_q * KVH * parts)}, {128}, 0, seed, q.data(), ldq, kc.data(), vc.data(),
                table.data(), bps, qs, ctx, n_seqs, nb, H, KVH, D, bs, out.data());
}

void check_paged_shape(int H, int KVH, int D, bool broken_table) {
    const int bs = 4, bps = 5, nb = 16, grp = H / KVH, ldq = (H + 2 * KVH) * D;
    // Three sequences: 3 query rows ending a context of 7, 1 row at the end of 13, 1 row alone.
    const unsigned ctx[3] = {7, 13, 1}, qs[4] = {0, 3, 4, 5};
    std::vector<unsigned> table(3 * bps);
    std::vector<unsigned> perm(nb);
    for (int i = 0; i < nb; i++) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < 3 * bps; i++) table[i] = perm[i];
    const int total_q = 5;
    auto q = randn((size_t)total_q * ldq), kc = randn((size_t)nb * bs * KVH * D), vc = randn(kc.size());
    std::vector<float> out((size_t)total_q * H * D, NaNf);
    run_paged(q, ldq, kc, vc, table, bps, qs, ctx, 3, nb, H, KVH, D, bs, total_q, out, 12 + D);
    std::vector<double> want;
    for (int s = 0; s < 3; s++)
        for (unsigned r = qs[s]; r < qs[s + 1]; r++) {
            const long long p = (long long)ctx[s] - (qs[s + 1] - qs[s]) + (r - qs[s]);
            for (int h = 0; h < H; h++) {
                const int g = h / grp;
                auto slot = [&](long long t) { return ((size_t)table[s * bps + t / bs] * bs + t % bs) * KVH + g; };
                auto o = attend(&q[(size_t)r * ldq + h * D], D, p, [&](long long t) { return &kc[slot(t) * D]; },
                                [&](long long t) { return &vc[slot(t) * D]; });
                want.insert(want.end(), o.begin(), o.end());
            }
        }
    const std::string shape = "paged_attention " + std::to_string(H) + "/" + std::to_string(KVH) + " heads, head_dim " +
                              std::to_string(D);
    expect((shape + " (3 sequences, shuffled blocks)").c_str(), out, want, 1e-5);
    if (!broken_table) return;
    {
        // A NaN in the key at position 1 of sequence 0 (KV head 0): its rows (positions 4, 5, 6)
        // are NaN for that group's heads. At position 4, key 1 is the only key of its warp.
        auto kn = kc;
        kn[(((size_t)table[0] * bs + 1) * KVH + 0) * D + 3] = NaNf;
        std::vector<float> out3((size_t)total_q * H * D, 0.0f);
        run_paged(q, ldq, kn, vc, table, bps, qs, ctx, 3, nb, H, KVH, D, bs, total_q, out3, 14);
        auto want3 = want;
        for (int r = 0; r < 3; r++)
            for (int h = 0; h < grp; h++)
                for (int c = 0; c < D; c++) want3[((size_t)r * H + h) * D + c] = NAN;
        expect((shape + " a NaN key").c_str(), out3, want3, 1e-5);
    }
    // A block id outside the cache: that sequence's rows are NaN, the others unchanged.
    table[bps + 1] = nb + 3;
    std::vector<float> out2((size_t)total_q * H * D, 0.0f);
    run_paged(q, ldq, kc, vc, table, bps, qs, ctx, 3, nb, H, KVH, D, bs, total_q, out2, 13);
    long long nan_rows = 0, same = 0;
    for (int r = 0; r < total_q; r++) {
        bool all_nan = true, eq = true;
        for (int e = 0; e < H * D; e++) {
            all_nan &= std::isnan(out2[(size_t)r * H * D + e]);
            eq &= out2[(size_t)r * H * D + e] == out[(size_t)r * H * D + e];
        }
        nan_rows += all_nan;
        same += eq;
    }
    expect_eq((shape + " broken table: NaN rows").c_str(), nan_rows, 1);
    expect_eq((shape + " broken table: other rows unchanged").c_str(), same, 4);
}

// Every kernel variant, a group split over blocks (16 heads of a KV head at 8 a block; 6 at 2), a
// group smaller than a block's heads, and no GQA.
void check_paged() {
    check_paged_shape(4, 2, 48, true);
    check_paged_shape(32, 2, 64, false);
    check_paged_shape(8, 2, 128, false);
    check_paged_shape(6, 1, 256, true);
    check_paged_shape(3, 3, 20, false);
}

void check_rope_store_paged() {
    const int H = 4, KVH = 2, D = 16, m = 3, heads = H + 2 * KVH, slots = 12;
    auto qkv = randn((size_t)m * heads * D);
    auto freqs = freqs_of(D);
    const unsigned pos[m] = {4, 0, 9}, slot[m] = {7, 2, 11};
    std::vector<float> kc((size_t)slots * KVH * D, 5.0f), vc(kc.size(), 5.0f), x = qkv;
    const int total = m * heads * D / 2;
    sim::launch(rope_store_paged, dim3{(unsigned)((total + 255) / 256)}, {256}, 0, 14, x.data(), m, pos, slot,
                (const double*)freqs.data(), H, KVH, D, kc.data(), vc.data());
    std::vector<double> wq = widen(qkv), wk(kc.size(), 5.0), wv(vc.size(), 5.0);
    for (int t = 0; t < m; t++) {
        for (int h = 0; h < H + KVH; h++) rope_ref(&wq[((size_t)t * heads + h) * D], D, pos[t], freqs);
        for (int c = 0; c < KVH * D; c++) {
            wk[(size_t)slot[t] * KVH * D + c] = wq[((size_t)t * heads + H) * D + c];
            wv[(size_t)slot[t] * KVH * D + c] = qkv[((size_t)t * heads + H + KVH) * D + c];
        }
    }
    // q rotated in place; the k and v heads of qkv are read, not written (kernels.cu: "q rotated in
    // place; the rotated k and the v rows written into the paged caches").
    std::vector<double> wq_only = wq;
    for (int t = 0; t < m; t++)
        for (int c = H * D; c < heads * D; c++) wq_only[(size_t)t * heads * D + c] = qkv[(size_t)t * heads * D + c];
    expect("rope_store_paged q in place, k and v unchanged", x, wq_only, 1e-6);
    expect("rope_store_paged key cache at slots", kc, wk, 1e-6);
    expect("rope_store_paged value cache at slots", vc, wv, 0.0);
}

// kernel.moe_route and kernel.moe_experts as src/kernels.rs launches them: one warp with n floats of
// dynamic shared memory; then a warp per intermediate row (gate/up) and per output row (down), 256
// threads a block.
void check_moe() {
    const int n = 40, top_k = 4, hidden = 72, inter = 40;
    auto scores = randn(n);
    // Two equal scores at the edge of the kept set: the lower index is kept.
    std::vector<int> idx(n);
    for (int i = 0; i < n; i++) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](int a, int b) { return scores[a] > scores[b]; });
    scores[std::max(idx[3], idx[4])] = scores[std::min(idx[3], idx[4])];
    auto route_ref = [&](bool renorm) {
        double mx = -INFINITY, sum = 0.0;
        for (float v : scores) mx = std::max(mx, (double)v);
        std::vector<double> p(n), out(n, 0.0);
        for (int e = 0; e < n; e++) sum += (p[e] = std::exp(scores[e] - mx));
        std::vector<int> order(n);
        for (int e = 0; e < n; e++) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        double kept = 0.0;
        for (int r = 0; r < top_k; r++) kept += (out[order[r]] = p[order[r]] / sum);
        if (renorm)
            for (double& v : out) v /= kept;
        return out;
    };
    std::vector<float> route(n, NaNf);
    for (int renorm = 0; renorm < 2; renorm++) {
        sim::launch(moe_route, dim3{1}, {32}, 4 * n, 15 + renorm, (const float*)scores.data(), n, top_k, renorm,
                    route.data());
        expect(renorm ? "moe_route renormalized (a tie at the edge)" : "moe_route (a tie at the edge)", route,
               route_ref(renorm), 1e-6);
    }
    auto gate = randw((size_t)n * inter * hidden, 0.1f), up = randw(gate.size(), 0.1f);
    auto down = randw((size_t)n * hidden * inter, 0.1f);
    auto x = randn(hidden), out0 = randn(hidden);
    std::vector<float> act((size_t)n * inter, NaNf), out = out0;
    sim::launch(moe_gate_up, dim3{(unsigned)((inter + 7) / 8)}, {256}, 0, 17, (const float*)x.data(),
                (const float*)route.data(), (const unsigned short*)gate.data(), (const unsigned short*)up.data(), n,
                inter, hidden, act.data());
    sim::launch(moe_down, dim3{(unsigned)((hidden + 7) / 8)}, {256}, 0, 18, (const float*)act.data(),
                (const float*)route.data(), (const unsigned short*)down.data(), n, inter, hidden, out.data(), 1);
    auto rw = route_ref(true);
    std::vector<double> want(out0.begin(), out0.end());
    for (int e = 0; e < n; e++) {
        if (rw[e] == 0.0) continue;
        std::vector<double> a(inter);
        for (int r = 0; r < inter; r++) {
            double g = 0.0, u = 0.0;
            for (int c = 0; c < hidden; c++) {
                g += x[c] * bf(gate[((size_t)e * inter + r) * hidden + c]);
                u += x[c] * bf(up[((size_t)e * inter + r) * hidden + c]);
            }
            a[r] = rw[e] * g / (1.0 + std::exp(-g)) * u;
        }
        for (int o = 0; o < hidden; o++)
            for (int r = 0; r < inter; r++) want[o] += a[r] * bf(down[((size_t)e * hidden + o) * inter + r]);
    }
    expect("moe_gate_up + moe_down (+ residual)", out, want, 1e-5);
    // A NaN score makes every weight NaN.
    scores[7] = NaNf;
    route.assign(n, 0.0f);
    sim::launch(moe_route, dim3{1}, {32}, 4 * n, 19, (const float*)scores.data(), n, top_k, 1, route.data());
    expect_eq("moe_route NaN score: NaN weights", std::count_if(route.begin(), route.end(), [](float v) { return std::isnan(v); }), n);
}

// The per-contract kernels as src/kernels.rs launches them (BLOCK = 256 threads; matrix products a
// warp per output feature, 8 a block; argmax one block of 1024).
void check_contract_kernels() {
    // kernel.embedding: a row per id; an id outside the vocabulary leaves its row unwritten.
    {
        const int vocab = 50, d = 300;
        auto table = randn((size_t)vocab * d);
        const unsigned ids[3] = {7, 49, 50};
        std::vector<float> out(3 * d, 3.0f);
        sim::launch(embedding, dim3{3}, {256}, 0, 20, (const float*)table.data(), vocab, d, ids, 3, out.data());
        std::vector<double> want(3 * d, 3.0);
        for (int j = 0; j < d; j++) {
            want[j] = table[7 * d + j];
            want[d + j] = table[49 * d + j];
        }
        expect("embedding (an id past the vocabulary: row unwritten)", out, want, 0.0);
    }
    // kernel.rms_norm: a block per row.
    {
        const int rows = 3, d = 300;
        auto x = randn(rows * d), w = randn(d);
        std::vector<float> out(rows * d, NaNf);
        sim::launch(rms_norm, dim3{rows}, {256}, 0, 21, (const float*)x.data(), (const float*)w.data(), 1e-6f,
                    out.data(), d);
        std::vector<double> want;
        for (int r = 0; r < rows; r++) {
            auto o = rms(std::vector<float>(x.begin() + r * d, x.begin() + (r + 1) * d), w, 1e-6);
            want.insert(want.end(), o.begin(), o.end());
        }
        expect("rms_norm", out, want, 1e-6);
    }
    // kernel.rope: a thread per pair, positions per token.
    {
        const int n_tok = 3, H = 4, D = 16;
        auto x = randn(n_tok * H * D);
        auto freqs = freqs_of(D);
        const unsigned pos[3] = {0, 5, 1000};
        std::vector<float> y = x;
        const int pairs = n_tok * H * D / 2;
        sim::launch(rope, dim3{(unsigned)((pairs + 255) / 256)}, {256}, 0, 22, y.data(), pos, (const double*)freqs.data(),
                    n_tok, H, D);
        auto want = widen(x);
        for (int t = 0; t < n_tok; t++)
            for (int h = 0; h < H; h++) rope_ref(&want[((size_t)t * H + h) * D], D, pos[t], freqs);
        expect("rope (positions 0, 5, 1000)", y, want, 1e-6);
    }
    // kernel.linear_*: m rows, a warp per output feature.
    {
        const int m = 3, n = 20;
        for (int k : {64, 30}) {
            auto x = randn((size_t)m * k), w = randn((size_t)n * k, 0.1f), out0 = randn(m * n);
            std::vector<float> out = out0;
            sim::launch(linear_f32, dim3{(unsigned)((n + 7) / 8)}, {256}, 0, 23, (const float*)x.data(),
                        (const float*)w.data(), m, k, n, out.data(), 1);
            std::vector<double> want(m * n);
            for (int i = 0; i < m; i++)
                for (int o = 0; o < n; o++) {
                    double acc = out0[i * n + o];
                    for (int c = 0; c < k; c++) acc += (double)x[i * k + c] * w[o * k + c];
                    want[i * n + o] = acc;
                }
            expect(k == 64 ? "linear_f32 += (k % 4 == 0: float4 loads)" : "linear_f32 += (k % 4 != 0)", out, want, 1e-5);
        }
        const int k = 72;
        auto x = randn((size_t)m * k);
        auto wb = randw((size_t)n * k, 0.1f);
        std::vector<float> out(m * n, NaNf);
        sim::launch(linear_bf16, dim3{(unsigned)((n + 7) / 8)}, {256}, 0, 24, (const float*)x.data(),
                    (const unsigned short*)wb.data(), m, k, n, out.data(), 0);
        std::vector<double> want(m * n, 0.0);
        for (int i = 0; i < m; i++)
            for (int o = 0; o < n; o++)
                for (int c = 0; c < k; c++) want[i * n + o] += (double)x[i * k + c] * bf(wb[o * k + c]);
        expect("linear_bf16", out, want, 1e-5);
        // IEEE binary16 weights: normal values of both signs and a subnormal in each row.
        std::vector<unsigned short> wh((size_t)n * k);
        std::uniform_int_distribution<unsigned> bits(0, 1023), ex(10, 17), sign(0, 1);
        auto half_value = [](unsigned h) {
            const int e = (h >> 10) & 31, mant = h & 1023;
            const double v = e == 0 ? mant * std::ldexp(1.0, -24) : (1.0 + mant / 1024.0) * std::ldexp(1.0, e - 15);
            return (h & 0x8000) ? -v : v;
        };
        // linear_f16 of xs and the weights wh, against the f64 product of their exact values.
        auto check_f16 = [&](const char* name, const std::vector<float>& xs, double tol, bool relative) {
            out.assign(m * n, NaNf);
            sim::launch(linear_f16, dim3{(unsigned)((n + 7) / 8)}, {256}, 0, 25, (const float*)xs.data(),
                        (const unsigned short*)wh.data(), m, k, n, out.data());
            std::fill(want.begin(), want.end(), 0.0);
            for (int i = 0; i < m; i++)
                for (int o = 0; o < n; o++)
                    for (int c = 0; c < k; c++) want[i * n + o] += (double)xs[i * k + c] * half_value(wh[o * k + c]);
            expect(name, out, want, tol, relative);
        };
        for (size_t i = 0; i < wh.size(); i++)
            wh[i] = (unsigned short)((sign(rng) << 15) | (i % k == 5 ? 0 : ex(rng) << 10) | bits(rng));
        check_f16("linear_f16 (subnormal weights included)", x, 1e-5, false);
        // Every weight subnormal and positive, inputs positive (no cancellation, so a relative
        // tolerance holds): a kernel that flushes subnormals to zero is off by 100 %.
        for (size_t i = 0; i < wh.size(); i++) wh[i] = (unsigned short)bits(rng);
        std::vector<float> xa(x.size());
        for (size_t i = 0; i < x.size(); i++) xa[i] = std::fabs(x[i]);
        check_f16("linear_f16 (every weight subnormal, relative)", xa, 1e-5, true);
        std::vector<signed char> w8((size_t)n * k);
        std::uniform_int_distribution<int> q8(-127, 127);
        for (auto& v : w8) v = (signed char)q8(rng);
        auto scales = randn(n, 0.01f);
        out.assign(m * n, NaNf);
        sim::launch(linear_int8, dim3{(unsigned)((n + 7) / 8)}, {256}, 0, 26, (const float*)x.data(),
                    (const signed char*)w8.data(), (const float*)scales.data(), m, k, n, out.data());
        for (int i = 0; i < m; i++)
            for (int o = 0; o < n; o++) {
                double acc = 0.0;
                for (int c = 0; c < k; c++) acc += (double)x[i * k + c] * w8[o * k + c];
                want[i * n + o] = scales[o] * acc;
            }
        expect("linear_int8 (per-row scales)", out, want, 1e-5);
    }
    // kernel.silu_and_mul, kernel.gelu_tanh_and_mul: grid-stride.
    {
        const int len = 1000;
        auto g = randn(len, 2.0f), u = randn(len);
        std::vector<float> out(len, NaNf);
        sim::launch(silu_and_mul, dim3{(unsigned)((len + 255) / 256)}, {256}, 0, 27, (const float*)g.data(),
                    (const float*)u.data(), out.data(), len);
        std::vector<double> want(len);
        for (int i = 0; i < len; i++) want[i] = g[i] / (1.0 + std::exp(-(double)g[i])) * u[i];
        expect("silu_and_mul", out, want, 1e-6);
        out.assign(len, NaNf);
        sim::launch(gelu_tanh_and_mul, dim3{(unsigned)((len + 255) / 256)}, {256}, 0, 28, (const float*)g.data(),
                    (const float*)u.data(), out.data(), len);
        for (int i = 0; i < len; i++) {
            const double x = g[i];
            want[i] = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
        }
        expect("gelu_tanh_and_mul", out, want, 1e-5);
    }
    // kernel.softmax: a block per row, in place.
    {
        const int rows = 3, n = 300;
        auto x = randn(rows * n, 3.0f);
        std::vector<float> y = x;
        sim::launch(softmax, dim3{rows}, {256}, 0, 29, y.data(), n);
        std::vector<double> want(rows * n);
        for (int r = 0; r < rows; r++) {
            double mx = -INFINITY, sum = 0.0;
            for (int j = 0; j < n; j++) mx = std::max(mx, (double)x[r * n + j]);
            for (int j = 0; j < n; j++) sum += std::exp(x[r * n + j] - mx);
            for (int j = 0; j < n; j++) want[r * n + j] = std::exp(x[r * n + j] - mx) / sum;
        }
        expect("softmax", y, want, 1e-6);
    }
    // kernel.attention: a block per (query row, head), kv_len floats of dynamic shared memory; the
    // n_q rows are the last n_q positions of kv_len.
    {
        const int H = 4, KVH = 2, D = 40, n_q = 3, kv_len = 9, grp = H / KVH;
        auto q = randn(n_q * H * D), kc = randn(kv_len * KVH * D), vc = randn(kv_len * KVH * D);
        std::vector<float> out(n_q * H * D, NaNf);
        sim::launch(attention, dim3{(unsigned)(n_q * H)}, {256}, kv_len * 4, 30, (const float*)q.data(),
                    (const float*)kc.data(), (const float*)vc.data(), n_q, kv_len, H, KVH, D, out.data());
        std::vector<double> want;
        for (int i = 0; i < n_q; i++)
            for (int h = 0; h < H; h++) {
                const int g = h / grp;
                auto o = attend(&q[(i * H + h) * D], D, kv_len - n_q + i, [&](long long t) { return &kc[(t * KVH + g) * D]; },
                                [&](long long t) { return &vc[(t * KVH + g) * D]; });
                want.insert(want.end(), o.begin(), o.end());
            }
        expect("attention (3 rows at the end of 9, GQA)", out, want, 1e-5);
    }
    // kernel.argmax: one block of 1024 threads, the first maximum, and the trail.
    {
        const int n = 5000;
        auto x = randn(n);
        x[3001] = x[4321] = 9.0f;
        unsigned out = 77, trail[4] = {5, 5, 5, 5};
        sim::launch(argmax, dim3{1}, {1024}, 0, 31, (const float*)x.data(), n, &out, trail, 2);
        expect_eq("argmax (first of two equal maxima)", out, 3001);
        expect_eq("argmax trail[step]", trail[2], 3001);
    }
    // store_kv: one position's K and V rows into the caches.
    {
        const int kv_dim = 48, max_seq = 6, pos = 4;
        auto qkv = randn(4 * kv_dim);
        std::vector<float> kc(max_seq * kv_dim, 1.0f), vc(max_seq * kv_dim, 1.0f);
        sim::launch(store_kv, dim3{1}, {256}, 0, 32, (const float*)qkv.data(), kv_dim, 3 * kv_dim, kv_dim, kc.data(),
                    vc.data(), pos);
        std::vector<double> wk(kc.size(), 1.0), wv(vc.size(), 1.0);
        for (int c = 0; c < kv_dim; c++) {
            wk[pos * kv_dim + c] = qkv[kv_dim + c];
            wv[pos * kv_dim + c] = qkv[3 * kv_dim + c];
        }
        expect("store_kv key cache", kc, wk, 0.0);
        expect("store_kv value cache", vc, wv, 0.0);
    }
}

}  // namespace

int main(int argc, char** argv) {
    const std::string only = argc > 1 ? argv[1] : "";
    const std::pair<const char*, std::function<void()>> groups[] = {
        {"mv", check_mv},
        {"qkv", check_qkv},
        {"head", check_head},
        {"attn_decode", [] { check_attn_decode(37, 100); check_attn_decode(2, 100); check_attn_decode(0, 40); }},
        {"gemm", [] { check_gemm(70, 96, 72, 0); check_gemm(70, 96, 72, 1); check_gemm(20, 1024, 40, 0); check_gemm(20, 1024, 40, 1); }},
        {"attn_prefill", check_attn_prefill},
        {"paged", check_paged},
        {"rope_store_paged", check_rope_store_paged},
        {"moe", check_moe},
        {"contract", check_contract_kernels},
    };
    int ran = 0;
    for (const auto& [name, run] : groups) {
        if (std::string(name).find(only) == std::string::npos) continue;
        run();
        ran++;
    }
    if (ran == 0) {
        std::printf("FAIL: no check group matches %s\n", only.c_str());
        return 2;
    }
    std::printf("%s: %d failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
