//! run_kernel_test: the server-owned harness calls the engine's kernels on inputs drawn from a fresh
//! seed, and the f64 oracle decides at the contract's tolerance.
//!
//! Defences against an engine that games the test: sizes and values are drawn anew on every run
//! (the seed is reported for replay), output buffers are pre-filled with NaN by the harness, and the
//! expected values are computed only after the engine's process has exited.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use crate::ckb::{Contract, Kind, TestCase, Tolerance};
use crate::error::{Error, Result};
use crate::harness::{self, Budget};
use crate::oracle::{self, AttnShape};

/// Which kernels to test.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct KernelTestRequest {
    /// Engine crate directory.
    pub engine: String,
    /// Kernel contract ids, e.g. `kernel.rope`; empty: every kernel the engine's plan needs (its
    /// family's kernels at its weight dtype, from metainfer.toml).
    #[serde(default)]
    pub kernels: Vec<String>,
    /// Weight dtype to build the engine for (f32, bf16, f16, int8); absent: the engine's own
    /// (metainfer.toml `dtype`). Another dtype needs a `[dtype_features]` entry in metainfer.toml.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Seed to replay a run; absent: a fresh one, reported in the result.
    #[serde(default)]
    pub seed: Option<u64>,
}

/// One kernel's verdict.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct KernelResult {
    /// Kernel contract id.
    pub kernel: String,
    /// Whether every case was within tolerance.
    pub passed: bool,
    /// Cases run.
    pub cases: usize,
    /// Largest |got - want| over all cases; [`UNWRITTEN`] (f64::MAX) when an output was NaN, infinite
    /// or missing (JSON has no infinity).
    pub max_abs_err: f64,
    /// Largest |got - want| / max(|want|, 1e-30).
    pub max_rel_err: f64,
    /// Flat index of the worst element in its case's output.
    pub worst_index: usize,
    /// Case name and concrete dims of the worst case, e.g. `gqa: n_q=3 kv_len=17 ...`.
    pub worst_case: String,
    /// Tolerance applied.
    pub atol: f64,
    /// Tolerance applied.
    pub rtol: f64,
    /// Why it failed in words (panic text, NaN, out of tolerance), "" when it passed.
    pub error: String,
    /// Known failure modes (failure contracts of this kernel) whose oracle mutant reproduces the
    /// engine's output on the same inputs; empty when it passed or nothing explains the failure.
    pub diagnosis: Vec<super::diagnose::Diagnosis>,
}

/// Kernel test result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct KernelTestReport {
    /// Whether every kernel passed.
    pub passed: bool,
    /// Seed of this run (replay with `seed`).
    pub seed: u64,
    /// Weight dtype the engine was built for.
    pub dtype: String,
    /// Per kernel.
    pub kernels: Vec<KernelResult>,
    /// Harness build failure, when the engine did not build with the harness.
    pub build_error: String,
    /// Rule findings (check_rules); a blocking one stops the test.
    pub rules: Vec<crate::guard::Finding>,
    /// Whether the engine's code (its build scripts and proc macros, the harness process) ran in
    /// the enforced sandbox; false where the kernel offers no Landlock ABI >= 6 or seccomp (the
    /// server logs why at start; `--require-sandbox` refuses to run instead).
    pub sandboxed: bool,
}

impl Report for KernelTestReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let ok = self.kernels.iter().filter(|k| k.passed).count();
        let mut s = format!(
            "kernel tests {}: {ok}/{} kernels passed (seed {}, {} weights)\n",
            if self.passed { "PASSED" } else { "FAILED" },
            self.kernels.len(),
            self.seed,
            self.dtype
        );
        if !self.build_error.is_empty() {
            s += &format!("harness build failed:\n{}\n", self.build_error);
        }
        for k in &self.kernels {
            s += &format!(
                "{} {:<20} cases {:>2}  max abs {:>9}  max rel {:>9}  worst [{}] {}{}\n",
                if k.passed { "ok  " } else { "FAIL" },
                k.kernel,
                k.cases,
                super::sci(k.max_abs_err),
                super::sci(k.max_rel_err),
                k.worst_index,
                k.worst_case,
                if k.error.is_empty() { String::new() } else { format!("\n     {}", k.error) }
            );
            for d in &k.diagnosis {
                s += &format!("     {}\n", d.line());
            }
        }
        s
    }
}

/// A drawn case: its inputs for the engine and what the oracle expects.
struct Drawn {
    kernel: String,
    label: String,
    f32s: Vec<(String, Vec<f32>)>,
    u32s: Vec<(String, Vec<u32>)>,
    /// 16-bit float bit patterns: (name, bits, whether bf16 (else IEEE binary16)).
    halves: Vec<(String, Vec<u16>, bool)>,
    i8s: Vec<(String, Vec<i8>)>,
    params: HashMap<String, String>,
    expect: Expect,
}

enum Expect {
    Values(Vec<f64>),
    Index(usize),
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.random_range(-1.0..1.0) * scale) as f32).collect()
}

fn dim(rng: &mut ChaCha8Rng, case: &TestCase, name: &str) -> Result<usize> {
    let [lo, hi] = *case
        .dims
        .get(name)
        .ok_or_else(|| Error::input(format!("test case `{}` has no range for dim `{name}`", case.name)))?;
    Ok(rng.random_range(lo..=hi) as usize)
}

/// Draw one case of a kernel contract. The oracle runs on the f32-rounded inputs widened to f64.
fn draw(c: &Contract, case: &TestCase, rng: &mut ChaCha8Rng) -> Result<Drawn> {
    let s = case.scale;
    let mut params = HashMap::new();
    let mut d = Drawn {
        kernel: c.id.clone(),
        label: String::new(),
        f32s: vec![],
        u32s: vec![],
        halves: vec![],
        i8s: vec![],
        params: HashMap::new(),
        expect: Expect::Index(0),
    };
    let w = oracle::widen;
    match c.id.as_str() {
        "kernel.embedding" => {
            let (vocab, dm, n) = (dim(rng, case, "vocab")?, dim(rng, case, "dim")?, dim(rng, case, "n")?);
            let table = uniform(rng, vocab * dm, s);
            let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
            d.label = format!("vocab={vocab} dim={dm} n={n}");
            d.expect = Expect::Values(oracle::embedding(&w(&table), dm, &ids));
            params.insert("dim".into(), dm.to_string());
            d.f32s.push(("table".into(), table));
            d.u32s.push(("ids".into(), ids));
        }
        "kernel.rms_norm" => {
            let (rows, dm) = (dim(rng, case, "rows")?, dim(rng, case, "dim")?);
            let x = uniform(rng, rows * dm, s);
            let weight: Vec<f32> = (0..dm).map(|_| rng.random_range(0.5..1.5)).collect();
            let eps: f32 = [1e-5, 1e-6, 1e-2][rng.random_range(0..3)];
            d.label = format!("rows={rows} dim={dm} eps={eps:e}");
            d.expect = Expect::Values(oracle::rms_norm(&w(&x), &w(&weight), eps as f64));
            params.insert("eps".into(), format!("{eps:e}"));
            d.f32s.push(("x".into(), x));
            d.f32s.push(("weight".into(), weight));
        }
        "kernel.rope" => {
            let (nt, nh) = (dim(rng, case, "n_tokens")?, dim(rng, case, "n_heads")?);
            let hd = dim(rng, case, "head_dim")?.div_ceil(2) * 2;
            let max_pos = dim(rng, case, "max_pos")?;
            let theta: f32 = [10_000.0, 500_000.0, 1_000_000.0][rng.random_range(0..3)];
            let x = uniform(rng, nt * nh * hd, s);
            let positions: Vec<u32> = (0..nt).map(|_| rng.random_range(0..=max_pos as u32)).collect();
            let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
            let mut want = w(&x);
            oracle::rope(&mut want, &pos, nh, hd, theta as f64);
            d.label = format!("n_tokens={nt} n_heads={nh} head_dim={hd} max_pos={max_pos} theta={theta}");
            d.expect = Expect::Values(want);
            params.insert("n_heads".into(), nh.to_string());
            params.insert("head_dim".into(), hd.to_string());
            params.insert("theta".into(), theta.to_string());
            d.f32s.push(("x".into(), x));
            d.u32s.push(("positions".into(), positions));
        }
        "kernel.linear" => {
            let (m, k, n) = (dim(rng, case, "m")?, dim(rng, case, "k")?, dim(rng, case, "n")?);
            let x = uniform(rng, m * k, s);
            let wt = uniform(rng, n * k, 1.0);
            d.label = format!("m={m} k={k} n={n}");
            d.expect = Expect::Values(oracle::linear(&w(&x), &w(&wt), m, k, n));
            for (key, v) in [("m", m), ("k", k), ("n", n)] {
                params.insert(key.into(), v.to_string());
            }
            d.f32s.push(("x".into(), x));
            d.f32s.push(("w".into(), wt));
        }
        "kernel.linear_bf16" | "kernel.linear_f16" | "kernel.linear_int8" => {
            let (m, k, n) = (dim(rng, case, "m")?, dim(rng, case, "k")?, dim(rng, case, "n")?);
            let x = uniform(rng, m * k, s);
            let wt = uniform(rng, n * k, 1.0);
            let want = match c.id.as_str() {
                "kernel.linear_bf16" => {
                    let bits: Vec<u16> = wt.iter().map(|&v| oracle::dtypes::round_bf16(v)).collect();
                    let v = oracle::dtypes::widen_bf16(&bits);
                    d.halves.push(("w".into(), bits, true));
                    v
                }
                "kernel.linear_f16" => {
                    let bits: Vec<u16> = wt.iter().map(|&v| oracle::dtypes::round_f16(v)).collect();
                    let v = oracle::dtypes::widen_f16(&bits);
                    d.halves.push(("w".into(), bits, false));
                    v
                }
                _ => {
                    // Quantised rows of uniform weights, scales near 1/127; one row is all zero, as
                    // the quantiser makes of a zero row.
                    let zero_row = rng.random_range(0..n);
                    let mut q = Vec::with_capacity(n * k);
                    let mut scales = Vec::with_capacity(n);
                    for (o, row) in wt.chunks_exact(k).enumerate() {
                        let (qr, sc) = if o == zero_row && n > 1 {
                            (vec![0; k], 0.0)
                        } else {
                            oracle::dtypes::quantize_int8_row(row)
                        };
                        q.extend(qr);
                        scales.push(sc);
                    }
                    let v = oracle::dtypes::dequant_int8(&q, &scales);
                    d.i8s.push(("w".into(), q));
                    d.f32s.push(("scales".into(), scales));
                    v
                }
            };
            d.label = format!("m={m} k={k} n={n}");
            d.expect = Expect::Values(oracle::linear(&w(&x), &want, m, k, n));
            for (key, v) in [("m", m), ("k", k), ("n", n)] {
                params.insert(key.into(), v.to_string());
            }
            d.f32s.push(("x".into(), x));
        }
        "kernel.gelu_tanh_and_mul" => {
            let len = dim(rng, case, "len")?;
            let (g, u) = (uniform(rng, len, s), uniform(rng, len, 1.0));
            d.label = format!("len={len} scale={s}");
            d.expect = Expect::Values(oracle::gelu_tanh_and_mul(&w(&g), &w(&u)));
            d.f32s.push(("gate".into(), g));
            d.f32s.push(("up".into(), u));
        }
        "kernel.silu_and_mul" => {
            let len = dim(rng, case, "len")?;
            let (g, u) = (uniform(rng, len, s), uniform(rng, len, s));
            d.label = format!("len={len}");
            d.expect = Expect::Values(oracle::silu_and_mul(&w(&g), &w(&u)));
            d.f32s.push(("gate".into(), g));
            d.f32s.push(("up".into(), u));
        }
        "kernel.softmax" => {
            let (rows, n) = (dim(rng, case, "rows")?, dim(rng, case, "n")?);
            let x = uniform(rng, rows * n, s);
            d.label = format!("rows={rows} n={n} scale={s}");
            d.expect = Expect::Values(oracle::softmax(&w(&x), n));
            params.insert("n".into(), n.to_string());
            d.f32s.push(("x".into(), x));
        }
        "kernel.attention" => {
            let kv_len = dim(rng, case, "kv_len")?;
            let n_q = dim(rng, case, "n_q")?.min(kv_len);
            let (nkv, group, hd) =
                (dim(rng, case, "n_kv_heads")?, dim(rng, case, "group")?, dim(rng, case, "head_dim")?);
            let nh = nkv * group;
            let q = uniform(rng, n_q * nh * hd, s);
            let k = uniform(rng, kv_len * nkv * hd, s);
            let v = uniform(rng, kv_len * nkv * hd, 1.0);
            let shape = AttnShape { n_q, kv_len, n_heads: nh, n_kv_heads: nkv, head_dim: hd };
            d.label = format!("n_q={n_q} kv_len={kv_len} n_heads={nh} n_kv_heads={nkv} head_dim={hd}");
            d.expect = Expect::Values(oracle::attention(&w(&q), &w(&k), &w(&v), shape));
            for (key, val) in [("n_q", n_q), ("kv_len", kv_len), ("n_heads", nh), ("n_kv_heads", nkv), ("head_dim", hd)]
            {
                params.insert(key.into(), val.to_string());
            }
            d.f32s.push(("q".into(), q));
            d.f32s.push(("k_cache".into(), k));
            d.f32s.push(("v_cache".into(), v));
        }
        "kernel.argmax" => {
            let n = dim(rng, case, "n")?;
            let mut x = uniform(rng, n, s);
            // Plant a tie for the maximum at two distinct indices: the contract says the first wins.
            if n >= 2 {
                let a = rng.random_range(0..n - 1);
                let b = rng.random_range(a + 1..n);
                let top = x.iter().cloned().fold(f32::MIN, f32::max) + 1.0;
                x[a] = top;
                x[b] = top;
            }
            d.label = format!("n={n}");
            d.expect = Expect::Index(oracle::argmax(&w(&x)));
            d.f32s.push(("x".into(), x));
        }
        other => {
            return Err(Error::usage(format!(
                "no oracle for `{other}`; kernels with an oracle: {}",
                oracle::KERNELS.join(", ")
            )));
        }
    }
    d.label = format!("{}: {}", case.name, d.label);
    d.params = params;
    Ok(d)
}

fn write_inputs(path: &Path, d: &Drawn) -> Result<()> {
    let f: Vec<(String, Vec<u8>)> =
        d.f32s.iter().map(|(n, v)| (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let u: Vec<(String, Vec<u8>)> =
        d.u32s.iter().map(|(n, v)| (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let mut views = Vec::new();
    for (n, b) in &f {
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![b.len() / 4], b).expect("view"),
        ));
    }
    for (n, b) in &u {
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![b.len() / 4], b).expect("view"),
        ));
    }
    let h: Vec<(String, Vec<u8>, bool)> =
        d.halves.iter().map(|(n, v, bf)| (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect(), *bf)).collect();
    for (n, b, bf) in &h {
        let dtype = if *bf { safetensors::Dtype::BF16 } else { safetensors::Dtype::F16 };
        views.push((n.clone(), safetensors::tensor::TensorView::new(dtype, vec![b.len() / 2], b).expect("view")));
    }
    let q: Vec<(String, Vec<u8>)> =
        d.i8s.iter().map(|(n, v)| (n.clone(), v.iter().map(|&x| x as u8).collect())).collect();
    for (n, b) in &q {
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::I8, vec![b.len()], b).expect("view"),
        ));
    }
    let meta = if d.params.is_empty() { None } else { Some(d.params.clone()) };
    safetensors::serialize_to_file(views, meta, path).map_err(|e| Error::internal(format!("{}: {e}", path.display())))
}

/// The error reported for an output element that is NaN, infinite or missing (JSON has no
/// infinity, so the largest finite f64 stands for it).
pub const UNWRITTEN: f64 = f64::MAX;

/// Compare engine output with expected values at a tolerance: (max abs, max rel, worst index, all within).
pub fn compare(got: &[f32], want: &[f64], tol: &Tolerance) -> (f64, f64, usize, bool) {
    let (mut max_abs, mut max_rel, mut worst, mut worst_excess) = (0.0f64, 0.0f64, 0usize, f64::NEG_INFINITY);
    let mut ok = got.len() == want.len();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = *g as f64;
        let err = if g.is_finite() { (g - w).abs().min(UNWRITTEN) } else { UNWRITTEN };
        let rel = err / w.abs().max(1e-30);
        let excess = err - (tol.atol + tol.rtol * w.abs());
        if excess > 0.0 || !g.is_finite() {
            ok = false;
        }
        if excess > worst_excess {
            worst_excess = excess;
            worst = i;
        }
        max_abs = max_abs.max(err);
        max_rel = max_rel.max(if err == UNWRITTEN { UNWRITTEN } else { rel.min(UNWRITTEN) });
    }
    (max_abs, max_rel, worst, ok)
}

/// Run kernel tests.
///
/// # Errors
/// Not a crate, unknown kernel id, outside the workspace, or the harness cannot be started.
pub fn kernel_test(ctx: &Ctx, req: &KernelTestRequest, budget: &Budget) -> Result<KernelTestReport> {
    let live = ctx.live();
    let ctx = &*live;
    let started = Instant::now();
    let dir = ctx.confine(Path::new(&req.engine), true)?;
    let engine = ctx.workshop.engine(&dir)?;
    // Each kernel once, in the order asked.
    let wanted: Vec<String> = req.kernels.iter().fold(Vec::new(), |mut v, k| {
        if !v.contains(k) {
            v.push(k.clone());
        }
        v
    });
    let target = ctx.target(&engine, req.dtype.as_deref())?;
    let contracts: Vec<&Contract> = if wanted.is_empty() {
        target.spec.kernels.iter().map(|id| ctx.ckb.get(id)).collect::<Result<_>>()?
    } else {
        wanted
            .iter()
            .map(|id| {
                let c = ctx.ckb.get(id)?;
                if c.kind != Kind::Kernel {
                    return Err(Error::usage(format!("`{id}` is a {} contract, not a kernel", c.kind.prefix())));
                }
                Ok(c)
            })
            .collect::<Result<_>>()?
    };
    let seed = req.seed.unwrap_or_else(|| rand::rng().random());
    let ids: Vec<&str> = contracts.iter().map(|c| c.id.as_str()).collect();
    let versioned = ctx.versioned(&ids);

    let rules = super::rules::precheck(ctx, &engine, budget)?;
    if !rules.passed {
        let report = KernelTestReport {
            passed: false,
            seed,
            dtype: target.dtype.clone(),
            kernels: vec![],
            build_error: super::rules::blocked_text(&rules),
            rules: rules.findings,
            sandboxed: ctx.workshop.sandboxed(),
        };
        ctx.record("run_kernel_test", Some(&engine), versioned, &report, serde_json::json!({"blocked": true}), started);
        return Ok(report);
    }
    let mut spec = target.spec.clone();
    for c in &contracts {
        if !spec.kernels.contains(&c.id) {
            spec.kernels.push(c.id.clone());
        }
    }
    let build = ctx.workshop.build_harness(&engine, &spec, budget)?;
    if !build.ok || build.executable.is_none() {
        let compile = super::compile::report_of(ctx, &engine, build, 0);
        let report = KernelTestReport {
            passed: false,
            seed,
            dtype: target.dtype.clone(),
            kernels: vec![],
            build_error: super::Report::text(&compile),
            rules: vec![],
            sandboxed: ctx.workshop.sandboxed(),
        };
        ctx.record(
            "run_kernel_test",
            Some(&engine),
            versioned,
            &report,
            serde_json::json!({"seed": seed, "build": "failed", "dtype": target.dtype}),
            started,
        );
        return Ok(report);
    }
    let exe = build.executable.expect("checked above");

    let scratch = ctx.workshop.scratch()?;
    let mut cases = Vec::new();
    let mut drawn = Vec::new();
    for c in &contracts {
        for (ci, case) in c.test_cases.iter().enumerate() {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ crate::util::fnv1a(&c.id) ^ (ci as u64) << 48);
            let d = draw(c, case, &mut rng)?;
            let n = drawn.len();
            let input = scratch.path().join(format!("case{n}.in.safetensors"));
            let output = scratch.path().join(format!("case{n}.out.safetensors"));
            write_inputs(&input, &d)?;
            cases.push(serde_json::json!({"kernel": d.kernel, "input": input, "output": output}));
            drawn.push((d, output));
        }
    }
    let request = scratch.path().join("request.json");
    let result = scratch.path().join("result.json");
    std::fs::write(&request, serde_json::json!({ "cases": cases }).to_string())
        .map_err(|e| Error::internal(format!("{}: {e}", request.display())))?;
    let run = ctx.workshop.run_sandboxed(
        duct::cmd(&exe, [std::ffi::OsStr::new("kernel"), request.as_os_str(), result.as_os_str()]),
        &harness::Grants::harness(&exe, scratch.path()),
        budget,
    )?;
    let results: serde_json::Value =
        std::fs::read(&result).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or(serde_json::Value::Null);
    let process_error = if run.ok() { String::new() } else { run.failure_text(1500) };

    let mut kernels: Vec<KernelResult> = Vec::new();
    for c in &contracts {
        let tol =
            c.tolerance.get("f32").cloned().unwrap_or(Tolerance { atol: 0.0, rtol: 0.0, reasoning: String::new() });
        let mut kr = KernelResult {
            kernel: c.id.clone(),
            passed: true,
            cases: 0,
            max_abs_err: 0.0,
            max_rel_err: 0.0,
            worst_index: 0,
            worst_case: String::new(),
            atol: tol.atol,
            rtol: tol.rtol,
            error: String::new(),
            diagnosis: vec![],
        };
        let mut worst_abs = -1.0;
        // Cases with an output, kept for the diagnosis: (drawn case, output words, within, abs error).
        let mut io: Vec<(&Drawn, Vec<u32>, bool, f64)> = Vec::new();
        for (i, (d, output)) in drawn.iter().enumerate().filter(|(_, (d, _))| d.kernel == c.id) {
            kr.cases += 1;
            let entry = &results["results"][i];
            if let Some(p) = entry["panic"].as_str() {
                kr.passed = false;
                kr.max_abs_err = UNWRITTEN;
                kr.max_rel_err = UNWRITTEN;
                if kr.error.is_empty() {
                    kr.error = format!("panicked on {}: {p}", d.label);
                    kr.worst_case = d.label.clone();
                }
                continue;
            }
            let out = match harness::read_tensor_words(output) {
                Ok((_, t)) => t,
                Err(_) => {
                    kr.passed = false;
                    kr.max_abs_err = UNWRITTEN;
                    kr.max_rel_err = UNWRITTEN;
                    if kr.error.is_empty() {
                        kr.error = if process_error.is_empty() {
                            format!("no output for {}", d.label)
                        } else {
                            format!("the harness process {process_error}")
                        };
                        kr.worst_case = d.label.clone();
                    }
                    continue;
                }
            };
            let (abs, rel, idx, ok) = match (&d.expect, out.get("out")) {
                (Expect::Values(want), Some(words)) => {
                    let got: Vec<f32> = words.iter().map(|&b| f32::from_bits(b)).collect();
                    compare(&got, want, &tol)
                }
                (Expect::Index(want), Some(words)) => {
                    let g = words.first().map(|&v| v as usize).unwrap_or(usize::MAX);
                    let e = if g == *want { 0.0 } else { 1.0 };
                    (e, e, g, g == *want)
                }
                _ => (UNWRITTEN, UNWRITTEN, 0, false),
            };
            if let Some(words) = out.get("out") {
                io.push((d, words.clone(), ok, abs));
            }
            if !ok {
                kr.passed = false;
            }
            if abs > worst_abs || (!ok && kr.error.is_empty()) {
                worst_abs = abs;
                kr.worst_index = idx;
                kr.worst_case = d.label.clone();
            }
            kr.max_abs_err = kr.max_abs_err.max(abs);
            kr.max_rel_err = kr.max_rel_err.max(rel);
            if !ok && kr.error.is_empty() {
                kr.error = match &d.expect {
                    Expect::Index(want) => {
                        format!("returned index {idx}, expected {want} (first maximum) on {}", d.label)
                    }
                    Expect::Values(_) if abs == UNWRITTEN => {
                        format!("output has NaN/inf or unwritten elements (NaN sentinel) on {}", d.label)
                    }
                    Expect::Values(_) => {
                        format!("outside tolerance atol {} rtol {} on {}", tol.atol, tol.rtol, d.label)
                    }
                };
            }
        }
        if !process_error.is_empty() && kr.passed {
            // The outputs may exist, but the process did not finish cleanly (time limit, output
            // limit, a crash after writing): nothing it produced counts.
            kr.passed = false;
            kr.error = format!("the harness process {process_error}");
        }
        if !kr.passed {
            let cases: Vec<super::diagnose::KernelCase> = io
                .iter()
                .map(|(d, out, ok, err)| super::diagnose::KernelCase {
                    f32s: &d.f32s,
                    u32s: &d.u32s,
                    halves: &d.halves,
                    i8s: &d.i8s,
                    params: &d.params,
                    out,
                    oracle_ok: *ok,
                    oracle_err: *err,
                })
                .collect();
            kr.diagnosis = super::diagnose::kernel(&ctx.ckb, c, &cases, &tol);
        }
        kernels.push(kr);
    }
    let passed = !kernels.is_empty() && kernels.iter().all(|k| k.passed);
    let report = KernelTestReport {
        passed,
        seed,
        dtype: target.dtype.clone(),
        kernels,
        build_error: String::new(),
        rules: rules.findings,
        sandboxed: ctx.workshop.sandboxed(),
    };
    let figures = serde_json::json!({
        "seed": seed,
        "dtype": target.dtype,
        "kernels": report.kernels.iter().map(|k| serde_json::json!({"id": k.kernel, "passed": k.passed, "max_abs_err": k.max_abs_err, "diagnosis": k.diagnosis.iter().map(|d| d.failure.as_str()).collect::<Vec<_>>()})).collect::<Vec<_>>(),
    });
    ctx.record("run_kernel_test", Some(&engine), versioned, &report, figures, started);
    Ok(report)
}
