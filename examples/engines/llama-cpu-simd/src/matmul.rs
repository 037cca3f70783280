//! y = x W^T for f32, bf16, f16 and int8 weights: AVX-512F and AVX2+FMA+F16C kernels chosen at
//! run time, a portable fallback, and row-block threading on the engine's team of threads
//! ([`crate::pool`]).
//!
//! Every output element is one dot product accumulated in a single f32 vector accumulator (16
//! lanes for AVX-512, 8 for AVX2, 8 array lanes for the portable code), chunk after chunk along k,
//! then reduced by a fixed halving tree. (AVX-512 bf16 takes the columns 32 at a time, lane j
//! adding columns 2j and 2j + 1 of the chunk, so that one shift and one mask widen 32 weights.)
//! The result of an element therefore does not depend on m, on the tile that computed it or on
//! the number of threads.

use std::ops::Range;
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Instruction sets with a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F (16 f32 lanes).
    Avx512,
    /// AVX2 with FMA and F16C (8 f32 lanes).
    Avx2,
    /// Plain Rust.
    Portable,
}

/// The best instruction set of this CPU, detected once.
pub(crate) fn detected() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| available()[0])
}

/// Every instruction set this CPU can run, best first.
pub(crate) fn available() -> Vec<Isa> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            out.push(Isa::Avx512);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            out.push(Isa::Avx2);
        }
    }
    out.push(Isa::Portable);
    out
}

/// Run `f` compiled for the best instruction set of this CPU. `f` should be an
/// `#[inline(always)]` closure over `#[inline(always)]` code, so that its loops are vectorised
/// for AVX-512F or AVX2+FMA in the wrapper it is inlined into.
#[inline]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    match detected() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detected() reported AVX-512F.
        Isa::Avx512 => unsafe { run_avx512(f) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detected() reported AVX2, FMA and F16C.
        Isa::Avx2 => unsafe { run_avx2(f) },
        _ => f(),
    }
}

/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// A stored weight format: its element type, how it widens to f32, and whether each output row
/// carries a scale.
pub(crate) trait Kind: 'static {
    /// Stored element.
    type Elem: Copy + Default + Send + Sync;
    /// Whether out[i, o] is multiplied by scales[o].
    const SCALED: bool;
    /// The f32 value of one element (before the row scale).
    fn widen(e: Self::Elem) -> f32;
    /// Load 16 elements from `p` as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 elements and the CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self::Elem) -> __m512;
    /// Load 8 elements from `p` as f32.
    ///
    /// # Safety
    /// `p` must be valid for reading 8 elements and the CPU must support AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self::Elem) -> __m256;
    /// Whether [`Kind::load32_split`] is implemented.
    const PAIRED: bool = false;
    /// Load 32 elements from `p` as f32: (elements 0, 2, ..., 30; elements 1, 3, ..., 31).
    ///
    /// # Safety
    /// `p` must be valid for reading 32 elements and the CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load32_split(p: *const Self::Elem) -> (__m512, __m512) {
        let _ = p;
        unreachable!("load32_split of a format without PAIRED")
    }
}

/// f32 weights.
pub(crate) struct F32;
/// bf16 weights (u16 bit patterns).
pub(crate) struct Bf16;
/// IEEE binary16 weights (u16 bit patterns).
pub(crate) struct F16;
/// Symmetric int8 weights with one f32 scale per output row.
pub(crate) struct I8;

impl Kind for F32 {
    type Elem = f32;
    const SCALED: bool = false;
    #[inline]
    fn widen(e: f32) -> f32 {
        e
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Kind for Bf16 {
    type Elem = u16;
    const SCALED: bool = false;
    const PAIRED: bool = true;
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load32_split(p: *const u16) -> (__m512, __m512) {
        // Element 2j is the low half of 32-bit lane j, element 2j + 1 the high half.
        let v = unsafe { _mm512_loadu_si512(p.cast()) };
        let even = _mm512_slli_epi32::<16>(v);
        let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
        (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
    }
    #[inline]
    fn widen(e: u16) -> f32 {
        crate::quant::bf16_to_f32(e)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const u16) -> __m512 {
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> __m256 {
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

impl Kind for F16 {
    type Elem = u16;
    const SCALED: bool = false;
    #[inline]
    fn widen(e: u16) -> f32 {
        crate::quant::f16_to_f32(e)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const u16) -> __m512 {
        let h = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_cvtph_ps(h)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> __m256 {
        let h = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_cvtph_ps(h)
    }
}

impl Kind for I8 {
    type Elem = i8;
    const SCALED: bool = true;
    #[inline]
    fn widen(e: i8) -> f32 {
        e as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const i8) -> __m512 {
        let b = unsafe { _mm_loadu_si128(p.cast()) };
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const i8) -> __m256 {
        let b = unsafe { _mm_loadl_epi64(p.cast()) };
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
    }
}

/// Smallest group of weight matrices (in bytes) whose rows are split across threads.
const PAR_MIN_BYTES: usize = 64 * 1024;
/// Output rows per tile of the SIMD kernels; thread blocks are multiples of it.
const ROW_TILE: usize = 8;

/// Raw output pointer shared by threads that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every thread writes a disjoint set of output elements, and the call that hands the
// pointer out does not return before all of them have finished.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// y = x W^T with W in format `K`, computed with `isa`. `x`: [m, k]; `w`: [n, k]; `scales`: [n]
/// when `K::SCALED` (otherwise ignored); `out`: [m, n]. Rows of W are split across the team of
/// threads when the matrix is large enough.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear<K: Kind>(
    isa: Isa,
    x: &[f32],
    w: &[K::Elem],
    scales: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    assert_eq!(w.len(), n * k, "linear: w must be [n, k]");
    assert_eq!(out.len(), m * n, "linear: out must be [m, n]");
    linear_group::<K>(isa, x, m, k, &mut [Part { w, scales, out }]);
}

/// One product of a [`linear_group`]: W [n, k] in format K, its scales [n] when `K::SCALED`, and
/// its output [m, n].
pub(crate) struct Part<'a, K: Kind> {
    pub w: &'a [K::Elem],
    pub scales: &'a [f32],
    pub out: &'a mut [f32],
}

/// Most parts in one [`linear_group`].
const MAX_PARTS: usize = 4;

/// out_j = x W_j^T for every part j, with the best kernels of `isa`. `x`: [m, k]; part j has
/// W_j [n_j, k] and out_j [m, n_j]. The rows of all parts together are split into one contiguous
/// block per thread of the process's team ([`crate::pool::global`]) when they hold enough
/// weights, so that products reading the same input share one parallel pass.
pub(crate) fn linear_group<K: Kind>(isa: Isa, x: &[f32], m: usize, k: usize, parts: &mut [Part<K>]) {
    linear_group_on(crate::pool::global(), isa, x, m, k, parts);
}

/// [`linear_group`] on the given team.
pub(crate) fn linear_group_on<K: Kind>(
    team: &crate::pool::Team,
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    parts: &mut [Part<K>],
) {
    assert_eq!(x.len(), m * k, "linear: x must be [m, k]");
    assert!(parts.len() <= MAX_PARTS, "linear_group: at most {MAX_PARTS} parts");
    if m == 0 {
        return;
    }
    // (w, scales, n, out) of every part, and the total number of weight rows.
    type Raw<'a, E> = (&'a [E], &'a [f32], usize, OutPtr);
    let mut raw: [Raw<K::Elem>; MAX_PARTS] = [(&[], &[], 0, OutPtr(std::ptr::null_mut())); MAX_PARTS];
    let mut total = 0;
    for (r, p) in raw.iter_mut().zip(parts.iter_mut()) {
        assert_eq!(p.out.len() % m, 0, "linear: out must be [m, n]");
        let n = p.out.len() / m;
        assert_eq!(p.w.len(), n * k, "linear: w must be [n, k]");
        if K::SCALED {
            assert_eq!(p.scales.len(), n, "linear: scales must be [n]");
        }
        if k == 0 {
            p.out.fill(0.0);
        }
        *r = (p.w, p.scales, n, OutPtr(p.out.as_mut_ptr()));
        total += n;
    }
    if k == 0 || total == 0 {
        return;
    }
    let raw = &raw[..parts.len()];
    // SAFETY (both calls): the row ranges handed out are disjoint, so every output element is
    // written by exactly one thread, into buffers exclusively borrowed for the whole call.
    let run = |rows: Range<usize>| {
        let mut start = 0;
        for &(w, scales, n, out) in raw {
            let (lo, hi) = (rows.start.max(start), rows.end.min(start + n));
            if lo < hi {
                unsafe { run_rows::<K>(isa, x, w, scales, m, k, n, out.get(), lo - start..hi - start) };
            }
            start += n;
        }
    };
    let threads = team.size();
    let bytes = total * k * std::mem::size_of::<K::Elem>();
    if threads > 1 && bytes >= PAR_MIN_BYTES && total >= 2 * ROW_TILE {
        // Prefill products are long enough for a few blocks per thread, which evens out the
        // threads' finishing times; a matrix-vector product gets one block per thread.
        let blocks_per_thread = if m > 1 { 4 } else { 1 };
        let per = total.div_ceil(threads * blocks_per_thread).next_multiple_of(ROW_TILE);
        let blocks = total.div_ceil(per);
        team.for_each(blocks, &|b| run(b * per..((b + 1) * per).min(total)));
    } else {
        run(0..total);
    }
}

/// Compute out[i, o] for every i < m and o in `rows`.
///
/// # Safety
/// `out` must point to an [m, n] buffer whose columns `rows` nobody else accesses during the call;
/// slice lengths must match the shapes (checked by [`linear`]); `isa` must be supported.
#[allow(clippy::too_many_arguments)]
unsafe fn run_rows<K: Kind>(
    isa: Isa,
    x: &[f32],
    w: &[K::Elem],
    scales: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: *mut f32,
    rows: Range<usize>,
) {
    let sp = if K::SCALED { scales.as_ptr() } else { std::ptr::null() };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::rows::<K>(x.as_ptr(), w.as_ptr(), sp, m, k, n, out, rows) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::rows::<K>(x.as_ptr(), w.as_ptr(), sp, m, k, n, out, rows) },
        _ => {
            for i in 0..m {
                let xr = &x[i * k..(i + 1) * k];
                for o in rows.clone() {
                    let mut s = dot_portable::<K>(xr, &w[o * k..(o + 1) * k]);
                    if K::SCALED {
                        s *= scales[o];
                    }
                    // SAFETY: i < m, o < n, and column o belongs to this call.
                    unsafe { *out.add(i * n + o) = s };
                }
            }
        }
    }
}

/// Dot product of `x` with a weight row in plain Rust: 8 accumulator lanes, chunk after chunk,
/// reduced by a halving tree.
fn dot_portable<K: Kind>(x: &[f32], w: &[K::Elem]) -> f32 {
    const L: usize = 8;
    let mut acc = [0.0f32; L];
    let xc = x.chunks_exact(L);
    let wc = w.chunks_exact(L);
    let (xt, wt) = (xc.remainder(), wc.remainder());
    for (a, b) in xc.zip(wc) {
        for l in 0..L {
            acc[l] += a[l] * K::widen(b[l]);
        }
    }
    for (l, (&a, &b)) in xt.iter().zip(wt).enumerate() {
        acc[l] += a * K::widen(b);
    }
    let mut width = L / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// out[t] = x · rows[t * stride .. t * stride + x.len()] for t < out.len(), each dot product
/// accumulated like an element of [`linear`].
pub(crate) fn dots(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let (k, count) = (x.len(), out.len());
    if count == 0 {
        return;
    }
    assert!(rows.len() >= (count - 1) * stride + k, "dots: rows shorter than count rows at stride");
    match detected() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detected() reported AVX-512F; the lengths were checked above.
        Isa::Avx512 => unsafe { avx512::dots(x.as_ptr(), rows.as_ptr(), k, stride, count, out.as_mut_ptr()) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: detected() reported AVX2, FMA and F16C; the lengths were checked above.
        Isa::Avx2 => unsafe { avx2::dots(x.as_ptr(), rows.as_ptr(), k, stride, count, out.as_mut_ptr()) },
        _ => {
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot_portable::<F32>(x, &rows[t * stride..t * stride + k]);
            }
        }
    }
}

/// The walk over R x C tiles that every instruction set's kernel shares, written once and expanded
/// in each instruction-set module with that module's target features: `block` (the tiles of a row
/// range, with weights prefetched `PREFETCH_TILES` blocks ahead) and `dots` (strided dot products).
/// The module supplies `tile::<K, R, C>` and imports `Kind`, `Range` and the intrinsics.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_walk {
    ($features:literal) => {
        /// How many blocks of C weight rows ahead of the current one the weights are prefetched.
        const PREFETCH_TILES: usize = 2;

        /// Outputs o in `rows` for all m rows of x, in R x C tiles with 1-row and 1-column edges.
        ///
        /// # Safety
        /// As [`super::run_rows`].
        #[inline]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn block<K: Kind, const R: usize, const C: usize>(
            x: *const f32,
            w: *const K::Elem,
            scales: *const f32,
            m: usize,
            k: usize,
            n: usize,
            out: *mut f32,
            rows: Range<usize>,
        ) {
            let sc = |o: usize| scales.wrapping_add(o);
            let null = std::ptr::null();
            // The weights PREFETCH_TILES blocks of C rows ahead are requested while this block
            // computes. One tile per block (a matrix-vector product) requests them chunk by chunk as
            // it goes; with several tiles (a batch), each tile first requests its share of the lines,
            // so that the batch reads its weights from memory while it computes instead of all at
            // the first tile, where the requests would pile up in the core's miss buffers.
            let tiles = m / R + m % R;
            let lines = (C * k * std::mem::size_of::<K::Elem>()).div_ceil(64);
            let per_tile = lines.div_ceil(tiles);
            let line_elems = 64 / std::mem::size_of::<K::Elem>();
            let request = |pf: *const K::Elem, t: usize| {
                if tiles > 1 && !pf.is_null() {
                    for l in (t * per_tile).min(lines)..((t + 1) * per_tile).min(lines) {
                        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(l * line_elems).cast());
                    }
                }
            };
            let mut o = rows.start;
            while o + C <= rows.end {
                let wo = unsafe { w.add(o * k) };
                let ahead = o + PREFETCH_TILES * C;
                let pf = if ahead < n { w.wrapping_add(ahead * k) } else { null };
                let p = if tiles == 1 { pf } else { null };
                let (mut i, mut t) = (0, 0);
                while i + R <= m {
                    request(pf, t);
                    unsafe { tile::<K, R, C>(x.add(i * k), wo, sc(o), k, k, out.add(i * n + o), n, p) };
                    (i, t) = (i + R, t + 1);
                }
                while i < m {
                    request(pf, t);
                    unsafe { tile::<K, 1, C>(x.add(i * k), wo, sc(o), k, k, out.add(i * n + o), n, p) };
                    (i, t) = (i + 1, t + 1);
                }
                o += C;
            }
            while o < rows.end {
                let wo = unsafe { w.add(o * k) };
                let mut i = 0;
                while i + R <= m {
                    unsafe { tile::<K, R, 1>(x.add(i * k), wo, sc(o), k, k, out.add(i * n + o), n, null) };
                    i += R;
                }
                while i < m {
                    unsafe { tile::<K, 1, 1>(x.add(i * k), wo, sc(o), k, k, out.add(i * n + o), n, null) };
                    i += 1;
                }
                o += 1;
            }
        }

        /// out[t] = dot(x, w row t) for t < count; x has k elements, w rows stride ws.
        ///
        /// # Safety
        /// x must hold k elements, w rows t < count k elements each at stride ws, out count elements;
        /// the CPU must support the module's instruction set.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn dots(x: *const f32, w: *const f32, k: usize, ws: usize, count: usize, out: *mut f32) {
            let null = std::ptr::null();
            let mut t = 0;
            unsafe {
                while t + 8 <= count {
                    tile::<super::F32, 1, 8>(x, w.add(t * ws), null, k, ws, out.add(t), 8, null);
                    t += 8;
                }
                while t < count {
                    tile::<super::F32, 1, 1>(x, w.add(t * ws), null, k, ws, out.add(t), 1, null);
                    t += 1;
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::Kind;

    /// Horizontal sum by the halving tree: lanes j + j+8, then j + j+4, j + j+2, j + j+1.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// The sums of eight accumulators, each by the same halving tree as [`reduce`], as lanes 0..8.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce8(a: &[__m512]) -> __m256 {
        // Lanes j + j+8: pairs of accumulators share one vector, 8 lanes each.
        let half = |p: __m512, q: __m512| {
            let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(p, q);
            let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(p, q);
            _mm512_add_ps(lo, hi)
        };
        let v01 = half(a[0], a[1]);
        let v23 = half(a[2], a[3]);
        let v45 = half(a[4], a[5]);
        let v67 = half(a[6], a[7]);
        // Lanes j + j+4: four accumulators per vector, one per 128-bit quarter.
        let quarter = |p: __m512, q: __m512| {
            let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(p, q);
            let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q);
            _mm512_add_ps(lo, hi)
        };
        let w0 = quarter(v01, v23);
        let w1 = quarter(v45, v67);
        // Lanes j + j+2: in quarter q, lanes 0-1 hold accumulator q and lanes 2-3 accumulator q + 4.
        let lo = _mm512_shuffle_ps::<0b01_00_01_00>(w0, w1);
        let hi = _mm512_shuffle_ps::<0b11_10_11_10>(w0, w1);
        let s = _mm512_add_ps(lo, hi);
        // Lanes 0 + 1.
        let r = _mm512_add_ps(s, _mm512_shuffle_ps::<0b10_11_00_01>(s, s));
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, r))
    }

    /// out[r * n + c] = dot(x row r, w row c) (times scale[c] when scaled) for r < R, c < C.
    /// x rows have stride k, w rows stride ws; `prefetch` (or null) is the start of C * k
    /// contiguous weights to request while computing.
    ///
    /// # Safety
    /// R rows of x and C rows of w of k elements, C scales when scaled, and R x C outputs with row
    /// stride n must be valid.
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn tile<K: Kind, const R: usize, const C: usize>(
        x: *const f32,
        w: *const K::Elem,
        scales: *const f32,
        k: usize,
        ws: usize,
        out: *mut f32,
        n: usize,
        prefetch: *const K::Elem,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let line_elems = 64 / std::mem::size_of::<K::Elem>();
        // Request the C * 16 weights of the prefetch region that match chunk `ch` of 16 columns.
        let fetch = |ch: usize| {
            if !prefetch.is_null() {
                let base = prefetch.wrapping_add(ch * C * 16);
                for l in 0..(C * 16).div_ceil(line_elems) {
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(l * line_elems).cast());
                }
            }
        };
        // Formats that widen 32 elements at once as separate even and odd lanes take the columns
        // in chunks of 32, with x split the same way; the rest go 16 at a time.
        let paired = if K::PAIRED { k / 32 } else { 0 };
        if paired > 0 {
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            for ch in 0..paired {
                let off = ch * 32;
                fetch(2 * ch);
                fetch(2 * ch + 1);
                let mut xe = [_mm512_setzero_ps(); R];
                let mut xo = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    let lo = unsafe { _mm512_loadu_ps(x.add(r * k + off)) };
                    let hi = unsafe { _mm512_loadu_ps(x.add(r * k + off + 16)) };
                    xe[r] = _mm512_permutex2var_ps(lo, even, hi);
                    xo[r] = _mm512_permutex2var_ps(lo, odd, hi);
                }
                for c in 0..C {
                    let (we, wo) = unsafe { K::load32_split(w.add(c * ws + off)) };
                    for r in 0..R {
                        acc[r][c] = _mm512_fmadd_ps(xe[r], we, acc[r][c]);
                        acc[r][c] = _mm512_fmadd_ps(xo[r], wo, acc[r][c]);
                    }
                }
            }
        }
        let full = k / 16;
        for ch in 2 * paired..full {
            let off = ch * 16;
            fetch(ch);
            let mut xv = [_mm512_setzero_ps(); R];
            for (r, v) in xv.iter_mut().enumerate() {
                *v = unsafe { _mm512_loadu_ps(x.add(r * k + off)) };
            }
            for c in 0..C {
                let wv = unsafe { K::load16(w.add(c * ws + off)) };
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
        }
        let rem = k % 16;
        if rem != 0 {
            let off = full * 16;
            let mask = ((1u32 << rem) - 1) as __mmask16;
            let mut xv = [_mm512_setzero_ps(); R];
            for (r, v) in xv.iter_mut().enumerate() {
                *v = unsafe { _mm512_maskz_loadu_ps(mask, x.add(r * k + off)) };
            }
            for c in 0..C {
                let mut buf = [K::Elem::default(); 16];
                unsafe { std::ptr::copy_nonoverlapping(w.add(c * ws + off), buf.as_mut_ptr(), rem) };
                let wv = unsafe { K::load16(buf.as_ptr()) };
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let o = unsafe { out.add(r * n) };
            if C == 8 {
                let mut v = reduce8(a);
                if K::SCALED {
                    v = _mm256_mul_ps(v, unsafe { _mm256_loadu_ps(scales) });
                }
                unsafe { _mm256_storeu_ps(o, v) };
            } else {
                for (c, &v) in a.iter().enumerate() {
                    let mut s = reduce(v);
                    if K::SCALED {
                        s *= unsafe { *scales.add(c) };
                    }
                    unsafe { *o.add(c) = s };
                }
            }
        }
    }

    tile_walk!("avx512f");

    /// # Safety
    /// As [`super::run_rows`], with raw pointers to x [m, k], w [n, k] and scales [n] (or null
    /// when not scaled); the CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows<K: Kind>(
        x: *const f32,
        w: *const K::Elem,
        scales: *const f32,
        m: usize,
        k: usize,
        n: usize,
        out: *mut f32,
        rows: Range<usize>,
    ) {
        // Batch tiles chosen by timing on Zen 4 (m = 16, k = 288 and 768, n = 768 and 32,000):
        // 2 x 8 for the formats widened 32 at a time (their split loads hold more registers),
        // 4 x 4 for the others; 3 x 8 spilled accumulators to the stack.
        unsafe {
            if m == 1 {
                block::<K, 1, 8>(x, w, scales, m, k, n, out, rows);
            } else if K::PAIRED {
                block::<K, 2, 8>(x, w, scales, m, k, n, out, rows);
            } else {
                block::<K, 4, 4>(x, w, scales, m, k, n, out, rows);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::Kind;

    /// Horizontal sum by the halving tree: lanes j + j+4, then j + j+2, j + j+1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// out[r * n + c] = dot(x row r, w row c) (times scale[c] when scaled) for r < R, c < C.
    /// x rows have stride k, w rows stride ws; `prefetch` (or null) is the start of C * k
    /// contiguous weights to request while computing.
    ///
    /// # Safety
    /// As the AVX-512 tile; the CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn tile<K: Kind, const R: usize, const C: usize>(
        x: *const f32,
        w: *const K::Elem,
        scales: *const f32,
        k: usize,
        ws: usize,
        out: *mut f32,
        n: usize,
        prefetch: *const K::Elem,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let line_elems = 64 / std::mem::size_of::<K::Elem>();
        let full = k / 8;
        for ch in 0..full {
            let off = ch * 8;
            // Request the C * 8 weights of the prefetch region that match this chunk of 8 columns.
            if !prefetch.is_null() {
                let base = prefetch.wrapping_add(ch * C * 8);
                for l in 0..(C * 8).div_ceil(line_elems) {
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(l * line_elems).cast());
                }
            }
            let mut xv = [_mm256_setzero_ps(); R];
            for (r, v) in xv.iter_mut().enumerate() {
                *v = unsafe { _mm256_loadu_ps(x.add(r * k + off)) };
            }
            for c in 0..C {
                let wv = unsafe { K::load8(w.add(c * ws + off)) };
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
        }
        let rem = k % 8;
        if rem != 0 {
            let off = full * 8;
            let mut xv = [_mm256_setzero_ps(); R];
            for (r, v) in xv.iter_mut().enumerate() {
                let mut buf = [0.0f32; 8];
                unsafe { std::ptr::copy_nonoverlapping(x.add(r * k + off), buf.as_mut_ptr(), rem) };
                *v = unsafe { _mm256_loadu_ps(buf.as_ptr()) };
            }
            for c in 0..C {
                let mut buf = [K::Elem::default(); 8];
                unsafe { std::ptr::copy_nonoverlapping(w.add(c * ws + off), buf.as_mut_ptr(), rem) };
                let wv = unsafe { K::load8(buf.as_ptr()) };
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let o = unsafe { out.add(r * n) };
            for (c, &v) in a.iter().enumerate() {
                let mut s = reduce(v);
                if K::SCALED {
                    s *= unsafe { *scales.add(c) };
                }
                unsafe { *o.add(c) = s };
            }
        }
    }

    tile_walk!("avx2,fma,f16c");

    /// # Safety
    /// As [`super::run_rows`], with raw pointers; the CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows<K: Kind>(
        x: *const f32,
        w: *const K::Elem,
        scales: *const f32,
        m: usize,
        k: usize,
        n: usize,
        out: *mut f32,
        rows: Range<usize>,
    ) {
        unsafe {
            if m == 1 {
                block::<K, 1, 8>(x, w, scales, m, k, n, out, rows);
            } else {
                block::<K, 2, 4>(x, w, scales, m, k, n, out, rows);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    /// xorshift64* stream of uniform values in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            (v as f32 / (1u64 << 23) as f32) - 1.0
        }
        fn vec(&mut self, len: usize) -> Vec<f32> {
            (0..len).map(|_| self.next()).collect()
        }
    }

    /// out[i, o] in f64 from weights already widened to f32 (scaled when `scales` is not empty).
    fn reference(x: &[f32], w: &[f32], scales: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for o in 0..n {
                let s: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[o * k + c] as f64).sum();
                out[i * n + o] = if scales.is_empty() { s } else { s * scales[o] as f64 };
            }
        }
        out
    }

    fn close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len());
        for (idx, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g as f64 - w).abs();
            assert!(err <= 1e-4 + 1e-4 * w.abs(), "{what}: element {idx}: got {g}, want {w} (error {err:e})");
        }
    }

    const SHAPES_K: [usize; 6] = [1, 15, 17, 47, 64, 2048];
    const SHAPES_M: [usize; 2] = [1, 7];
    const SHAPES_N: [usize; 2] = [1, 300];

    /// Run `K` on every instruction set at every awkward shape against the f64 reference, and check
    /// that each row of an m = 7 product equals the m = 1 product of that row bit for bit.
    fn check_kind<K: Kind>(make: impl Fn(&mut Rng, usize, usize) -> (Vec<K::Elem>, Vec<f32>)) {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for isa in available() {
            for k in SHAPES_K {
                for n in SHAPES_N {
                    let (w, scales) = make(&mut rng, n, k);
                    let wf: Vec<f32> = w.iter().map(|&e| K::widen(e)).collect();
                    for m in SHAPES_M {
                        let x = rng.vec(m * k);
                        let mut out = vec![f32::NAN; m * n];
                        linear::<K>(isa, &x, &w, &scales, m, k, n, &mut out);
                        let what = format!("{isa:?} m={m} k={k} n={n}");
                        close(&out, &reference(&x, &wf, &scales, m, k, n), &what);
                        for i in 0..m {
                            let mut row = vec![f32::NAN; n];
                            linear::<K>(isa, &x[i * k..(i + 1) * k], &w, &scales, 1, k, n, &mut row);
                            let same =
                                row.iter().zip(&out[i * n..(i + 1) * n]).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{what}: row {i} differs from its m = 1 product");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn linear_f32_matches_reference() {
        check_kind::<F32>(|rng, n, k| (rng.vec(n * k), Vec::new()));
    }

    #[test]
    fn linear_bf16_matches_reference() {
        check_kind::<Bf16>(|rng, n, k| {
            let w = rng.vec(n * k).into_iter().map(quant::f32_to_bf16).collect();
            (w, Vec::new())
        });
    }

    #[test]
    fn linear_f16_matches_reference() {
        check_kind::<F16>(|rng, n, k| {
            let w = rng.vec(n * k).into_iter().map(quant::f32_to_f16).collect();
            (w, Vec::new())
        });
    }

    #[test]
    fn linear_int8_matches_reference() {
        check_kind::<I8>(|rng, n, k| quant::quantize_int8(&rng.vec(n * k), k));
    }

    #[test]
    fn thread_count_does_not_change_results() {
        let (m, k, n) = (5, 512, 300);
        let mut rng = Rng(7);
        let (x, w) = (rng.vec(m * k), rng.vec(n * k));
        let run = |threads: usize| {
            let team = crate::pool::Team::new(threads);
            let mut out = vec![f32::NAN; m * n];
            let mut parts = [Part::<F32> { w: &w, scales: &[], out: &mut out }];
            linear_group_on(&team, detected(), &x, m, k, &mut parts);
            out
        };
        let one = run(1);
        for threads in [2, 3] {
            let many = run(threads);
            assert!(one.iter().zip(&many).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn strided_dots_match_reference() {
        let mut rng = Rng(3);
        for (k, stride, count) in [(16, 48, 9), (48, 96, 17), (7, 7, 3), (1, 5, 1)] {
            let x = rng.vec(k);
            let rows = rng.vec((count - 1) * stride + k);
            let mut out = vec![f32::NAN; count];
            dots(&x, &rows, stride, &mut out);
            let want: Vec<f64> =
                (0..count).map(|t| (0..k).map(|c| x[c] as f64 * rows[t * stride + c] as f64).sum()).collect();
            close(&out, &want, &format!("dots k={k} stride={stride}"));
        }
    }

    #[test]
    fn zero_k_and_empty_shapes() {
        for isa in available() {
            let mut out = vec![f32::NAN; 6];
            linear::<F32>(isa, &[], &[], &[], 2, 0, 3, &mut out);
            assert!(out.iter().all(|&v| v == 0.0));
            let mut none: Vec<f32> = Vec::new();
            linear::<I8>(isa, &[1.0, 2.0], &[], &[], 1, 2, 0, &mut none);
        }
    }
}
