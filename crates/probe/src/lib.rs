//! Machine probe: read bandwidth at working sets that fit L1, L2, L3 and DRAM, and peak f32 FLOP/s,
//! on 1..N threads, each as min/median/max of several runs. The figures a profiler compares an engine
//! with (its roofline). Cached in the ledger per machine fingerprint (CPU model and core count).
//!
//! Read bandwidth: sum a buffer of the working-set size with 16 independent accumulators (the
//! compiler vectorises it), bytes read / seconds. Peak FLOP/s: independent fused multiply-adds on the
//! widest vector unit the CPU reports at run time (AVX-512F, else AVX2+FMA, else portable code),
//! 2 FLOP per lane per FMA.

use std::time::Instant;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use base::stats::Spread;

/// One measured figure.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct Figure {
    /// What was measured, e.g. `read L2 (256 KiB)` or `peak f32 (avx512f)`.
    pub what: String,
    /// Threads used.
    pub threads: usize,
    /// Unit: `GB/s` or `GFLOP/s`.
    pub unit: String,
    /// Over the runs.
    pub spread: Spread,
}

/// A probe of this machine.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct MachineProbe {
    /// CPU model and logical core count, e.g. `Intel(R) Xeon(R) ... x2`.
    pub fingerprint: String,
    /// Vector unit used for the FLOP/s figure.
    pub simd: String,
    /// Every figure.
    pub figures: Vec<Figure>,
}

impl MachineProbe {
    /// Median of the figure whose `what` starts with `prefix` at `threads`.
    pub fn median(&self, prefix: &str, threads: usize) -> Option<f64> {
        self.figures.iter().find(|f| f.what.starts_with(prefix) && f.threads == threads).map(|f| f.spread.median)
    }
}

/// `model name` from /proc/cpuinfo (or the architecture) and the logical core count.
pub fn fingerprint() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model} x{}", cores())
}

/// Logical cores available to this process.
pub fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

fn sum_portable(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for c in x.chunks_exact(16) {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum()
}

// Eight accumulators as separate locals (not an array), so that even an unoptimised or lightly
// optimised build keeps them in registers and the loop is bound by loads, not by add latency.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let z = _mm512_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7) = (z, z, z, z, z, z, z, z);
    for c in x.chunks_exact(128) {
        let p = c.as_ptr();
        // SAFETY: `c` holds 128 f32; every load reads 16 of them at an offset below 128.
        unsafe {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p.add(16)));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p.add(32)));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p.add(48)));
            a4 = _mm512_add_ps(a4, _mm512_loadu_ps(p.add(64)));
            a5 = _mm512_add_ps(a5, _mm512_loadu_ps(p.add(80)));
            a6 = _mm512_add_ps(a6, _mm512_loadu_ps(p.add(96)));
            a7 = _mm512_add_ps(a7, _mm512_loadu_ps(p.add(112)));
        }
    }
    let s = _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
        _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
    );
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7) = (z, z, z, z, z, z, z, z);
    for c in x.chunks_exact(64) {
        let p = c.as_ptr();
        // SAFETY: `c` holds 64 f32; every load reads 8 of them at an offset below 64.
        unsafe {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p.add(8)));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p.add(16)));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p.add(24)));
            a4 = _mm256_add_ps(a4, _mm256_loadu_ps(p.add(32)));
            a5 = _mm256_add_ps(a5, _mm256_loadu_ps(p.add(40)));
            a6 = _mm256_add_ps(a6, _mm256_loadu_ps(p.add(48)));
            a7 = _mm256_add_ps(a7, _mm256_loadu_ps(p.add(56)));
        }
    }
    let s = _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
        _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
    );
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 f32, the width of one store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

/// The widest summing kernel this CPU runs.
fn sum_kernel() -> fn(&[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU reports AVX-512F, the only feature the function enables.
            return |x| unsafe { sum_avx512(x) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU reports AVX2, the only feature the function enables.
            return |x| unsafe { sum_avx2(x) };
        }
    }
    sum_portable
}

/// Read bandwidth in GB/s of `threads` threads each summing its share of `bytes`, repeated until at
/// least `min_secs` passed. Used by the probe at its working sets, and by `bench` at a model's own
/// bytes per token (the working set a decode step streams).
pub fn read_bandwidth(bytes: usize, threads: usize, min_secs: f64) -> f64 {
    let per = (bytes / 4 / threads).max(128) / 128 * 128;
    let sum = sum_kernel();
    let bufs: Vec<Vec<f32>> = (0..threads).map(|t| (0..per).map(|i| ((i + t) % 7) as f32).collect()).collect();
    let mut reps = 1usize;
    loop {
        let start = Instant::now();
        std::thread::scope(|s| {
            for b in &bufs {
                s.spawn(move || {
                    let mut total = 0f32;
                    for _ in 0..reps {
                        total += sum(std::hint::black_box(b));
                    }
                    std::hint::black_box(total);
                });
            }
        });
        let secs = start.elapsed().as_secs_f64();
        if secs >= min_secs {
            return (per * 4 * threads * reps) as f64 / secs / 1e9;
        }
        reps = (reps * 2).max((reps as f64 * min_secs / secs.max(1e-6)) as usize);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(0.999_99), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(0.999_99), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut s = 0.0;
    for v in acc {
        // SAFETY: `out` holds 8 f32, the width of one store.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        s += out.iter().sum::<f32>();
    }
    s
}

fn fma_portable(iters: usize) -> f32 {
    let mut acc = [[1f32; 8]; 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            for x in v.iter_mut() {
                *x = *x * 0.999_99 + 1e-7;
            }
        }
    }
    acc.iter().flatten().sum()
}

/// The widest FMA kernel this CPU runs: (name, lanes, function).
fn fma_kernel() -> (&'static str, usize, fn(usize) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU reports AVX-512F, the only feature the function enables.
            return ("avx512f", 16, |n| unsafe { fma_avx512(n) });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU reports AVX2 and FMA, the features the function enables.
            return ("avx2+fma", 8, |n| unsafe { fma_avx2(n) });
        }
    }
    ("portable (mul+add)", 8, fma_portable)
}

/// Peak f32 GFLOP/s of `threads` threads.
fn peak_gflops(threads: usize, min_secs: f64) -> f64 {
    let (_, lanes, f) = fma_kernel();
    let mut iters = 1 << 16;
    loop {
        let start = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(move || std::hint::black_box(f(std::hint::black_box(iters))));
            }
        });
        let secs = start.elapsed().as_secs_f64();
        if secs >= min_secs {
            // 12 accumulators x lanes x 2 FLOP per FMA per iteration.
            return (threads * iters * 12 * lanes * 2) as f64 / secs / 1e9;
        }
        iters = (iters * 2).max((iters as f64 * min_secs / secs.max(1e-6)) as usize);
    }
}

/// Working sets: (label, bytes). L1 and L2 sizes typical of current x86-64 and Arm cores; L3 a few
/// MiB; DRAM at least 256 MiB and at least twice the last-level cache the OS reports (some servers
/// and VMs report a cache of hundreds of MiB), at most 2 GiB.
pub fn working_sets() -> Vec<(String, usize)> {
    let llc = last_level_cache_bytes().unwrap_or(0);
    let dram = (256usize << 20).max(2 * llc).min(2 << 30);
    vec![
        ("L1 (16 KiB)".into(), 16 << 10),
        ("L2 (256 KiB)".into(), 256 << 10),
        ("L3 (4 MiB)".into(), 4 << 20),
        (format!("DRAM ({} MiB)", dram >> 20), dram),
    ]
}

/// The largest cache size in /sys/devices/system/cpu/cpu0/cache/index*/size (Linux), in bytes.
fn last_level_cache_bytes() -> Option<usize> {
    let mut best = None;
    for i in 0..8 {
        let Ok(t) = std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")) else {
            continue;
        };
        let t = t.trim();
        let (num, mul) = match t.strip_suffix('K') {
            Some(n) => (n, 1usize << 10),
            None => match t.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (t, 1),
            },
        };
        if let Ok(n) = num.parse::<usize>() {
            best = best.max(Some(n * mul));
        }
    }
    best
}

/// Run the probe: `runs` repetitions of each figure on 1..=cores threads.
pub fn run(runs: usize, min_secs: f64) -> MachineProbe {
    let runs = runs.max(1);
    let mut figures = Vec::new();
    for threads in 1..=cores() {
        for (label, bytes) in working_sets() {
            let v: Vec<f64> = (0..runs).map(|_| read_bandwidth(bytes, threads, min_secs)).collect();
            figures.push(Figure {
                what: format!("read {label}"),
                threads,
                unit: "GB/s".into(),
                spread: Spread::of(&v),
            });
        }
        let v: Vec<f64> = (0..runs).map(|_| peak_gflops(threads, min_secs)).collect();
        figures.push(Figure {
            what: format!("peak f32 ({})", fma_kernel().0),
            threads,
            unit: "GFLOP/s".into(),
            spread: Spread::of(&v),
        });
    }
    MachineProbe { fingerprint: fingerprint(), simd: fma_kernel().0.into(), figures }
}

impl MachineProbe {
    /// The figures as a Markdown table, one row per figure.
    pub fn table(&self) -> String {
        let mut s = format!(
            "machine {} (vector unit {})\n| figure | threads | median | min | max | unit |\n|---|---|---|---|---|---|\n",
            self.fingerprint, self.simd
        );
        for f in &self.figures {
            s += &format!(
                "| {} | {} | {:.1} | {:.1} | {:.1} | {} |\n",
                f.what, f.threads, f.spread.median, f.spread.min, f.spread.max, f.unit
            );
        }
        s
    }
}
