//! run_kernel_test: the server-owned harness calls the engine's kernels on inputs drawn from a fresh
//! seed, and the f64 oracle decides at the contract's tolerance.
//!
//! Defences against an engine that games the test: sizes and values are drawn anew on every run
//! (the seed is reported for replay), output buffers are pre-filled with NaN by the harness, and the
//! expected values are computed only after the engine's process has exited.
//!
//! One call through the gate run loop (`ops::gate`, spec `KernelSpec`):
//!
//! ```text
//! Gate::open                            engine, manifest, target (kernels + their registry arms)
//! rules (cargo metadata + guard)        a blocking finding: stop, recorded
//! build (cargo build --release)         the harness binary in the shared incremental target
//!                                       directory (`target-incremental`; profile_engine measures an
//!                                       optimised build in `target`)
//! kernels::draw per contract test case  seeded; each Case's inputs as safetensors in the scratch dir
//! Command::Kernel                       the engine's outputs as safetensors; Reply::Kernel
//! Kernel::oracle + oracle::judge        at the contract's tolerance, after the process exited
//! oracle::diagnose::kernel              the kernel's mutants: failure-mode ids, when one explains it
//! record (Figures::KernelTest)          the ledger outcome
//! ```

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::gate::{Commands, Gate, Harness, Spec, Tool, Verdict as GateVerdict};
use super::{Ctx, Report};
use base::error::{Context, Error, Result};
use ckb::{Contract, Kind, Tolerance};
use harness::protocol::{Command, KernelCase, Reply};
use harness::{Budget, Called};
use ledger::figures::{Figures, GateFigures, KernelFigure, KernelTestFigures};
use oracle::kernels::{self, Case, Tensor};
use oracle::{UNWRITTEN, Verdict};

/// Which kernels to test.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    /// Seed to replay a run (below 2^53; a decimal string is accepted too); absent: a fresh one,
    /// reported in the result.
    #[serde(default, deserialize_with = "base::util::de_seed")]
    pub seed: Option<u64>,
    /// Do not run: build the harness and draw the inputs here, and write them as a bundle to this
    /// directory (new or empty), to run with `metainfer bundle run DIR` where the device is.
    #[serde(default)]
    pub write_bundle: Option<String>,
    /// Judge and record a bundle written by this gate and run elsewhere (`metainfer bundle run`),
    /// instead of running the engine here. The engine's sources must be the ones it was written from.
    #[serde(default)]
    pub from_bundle: Option<String>,
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
    pub diagnosis: Vec<oracle::diagnose::Diagnosis>,
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
    pub rules: Vec<guard::Finding>,
    /// Whether the engine's code (its build scripts and proc macros, the harness process) ran in
    /// the enforced sandbox; false where the kernel offers no Landlock ABI >= 6 or seccomp (the
    /// server logs why at start; `--require-sandbox` refuses to run instead).
    pub sandboxed: bool,
    /// For a verdict judged from a bundle: whether a trusted runner signed the run, or why it is
    /// unattested evidence (never enough for phase order); "" for a run made here.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub attestation: String,
}

impl Report for KernelTestReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn bundle_written(&self) -> bool {
        super::gate::wrote_bundle(&self.build_error)
    }
    fn text(&self) -> String {
        let ok = self.kernels.iter().filter(|k| k.passed).count();
        // Nothing ran (a bundle written, no device): no verdict, and no build failed.
        let not_run = self.bundle_written() || self.build_error.starts_with(super::gate::NO_DEVICE);
        let mut s = format!(
            "kernel tests {}: {ok}/{} kernels passed (seed {}, {} weights)\n",
            if self.passed {
                "PASSED"
            } else if not_run {
                "NOT RUN"
            } else {
                "FAILED"
            },
            self.kernels.len(),
            self.seed,
            self.dtype
        );
        if not_run {
            s += &format!("{}\n", self.build_error);
        } else if !self.build_error.is_empty() {
            s += &format!("harness build failed:\n{}\n", self.build_error);
        }
        if !self.attestation.is_empty() {
            s += &format!("{}\n", self.attestation);
        }
        for k in &self.kernels {
            s += &format!(
                "{} {:<20} cases {:>2}  max abs {:>9}  max rel {:>9}  worst [{}] {}{}\n",
                if k.passed { "ok  " } else { "FAIL" },
                k.kernel,
                k.cases,
                harness::figure(k.max_abs_err, &k.error),
                harness::figure(k.max_rel_err, &k.error),
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

/// A drawn case's inputs as a safetensors file (tensors by name, parameters as metadata).
fn input_bytes(c: &Case) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<u8>, safetensors::Dtype, usize)> = c
        .inputs
        .iter()
        .map(|(n, t)| match t {
            Tensor::F32(v) => {
                (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect(), safetensors::Dtype::F32, v.len())
            }
            Tensor::U32(v) => {
                (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect(), safetensors::Dtype::U32, v.len())
            }
            Tensor::Bf16(v) => {
                (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect(), safetensors::Dtype::BF16, v.len())
            }
            Tensor::F16(v) => {
                (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect(), safetensors::Dtype::F16, v.len())
            }
            Tensor::I8(v) => (n.clone(), v.iter().map(|&x| x as u8).collect(), safetensors::Dtype::I8, v.len()),
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, b, d, len)| {
            safetensors::tensor::TensorView::new(*d, vec![*len], b)
                .map(|v| (n.clone(), v))
                .internal_ctx(|| format!("input {n}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = if c.params.is_empty() { None } else { Some(c.params.clone().into_iter().collect()) };
    safetensors::serialize(views, meta).internal_ctx(|| format!("inputs of {}", c.label))
}

/// One case as run: the drawn inputs, and the engine's output words or why there are none.
struct Ran {
    case: Case,
    out: std::result::Result<Vec<u32>, String>,
}

/// The verdict on one kernel from its cases (in draw order).
fn judge_kernel(ckb: &ckb::Ckb, c: &Contract, ran: &[&Ran], process_error: &str) -> KernelResult {
    let tol = c.tolerance.get("f32").cloned().unwrap_or(Tolerance { atol: 0.0, rtol: 0.0, reasoning: String::new() });
    let k = kernels::get(&c.id).expect("the harness only runs kernels with an oracle");
    let mut kr = KernelResult {
        kernel: c.id.clone(),
        passed: true,
        cases: ran.len(),
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
    // Cases with an output and their verdict against the oracle, kept for the diagnosis.
    let mut judged: Vec<oracle::diagnose::KernelCase> = Vec::new();
    for r in ran {
        let words = match &r.out {
            Ok(w) => w,
            Err(why) => {
                kr.passed = false;
                kr.max_abs_err = UNWRITTEN;
                kr.max_rel_err = UNWRITTEN;
                if kr.error.is_empty() {
                    kr.error = why.clone();
                    kr.worst_case = r.case.label.clone();
                }
                continue;
            }
        };
        let want = (k.oracle)(&r.case);
        let v = match &want {
            Some(w) => oracle::judge(words, w, &tol),
            None => {
                Verdict { max_abs_err: UNWRITTEN, max_rel_err: UNWRITTEN, worst_index: 0, ok: false, non_finite: None }
            }
        };
        if !v.ok {
            kr.passed = false;
        }
        if v.max_abs_err > worst_abs || (!v.ok && kr.error.is_empty()) {
            worst_abs = v.max_abs_err;
            kr.worst_index = v.worst_index;
            kr.worst_case = r.case.label.clone();
        }
        kr.max_abs_err = kr.max_abs_err.max(v.max_abs_err);
        kr.max_rel_err = kr.max_rel_err.max(v.max_rel_err);
        if !v.ok && kr.error.is_empty() {
            kr.error = match &want {
                Some(kernels::Expect::Index(w)) => {
                    format!("returned index {}, expected {w} (first maximum) on {}", v.worst_index, r.case.label)
                }
                _ if v.non_finite.is_some() => format!(
                    "{} on {} (outputs start as NaN, so an unwritten element shows as NaN; a non-finite value never passes)",
                    v.non_finite.map(|nf| nf.describe()).unwrap_or_default(),
                    r.case.label
                ),
                _ if v.max_abs_err == UNWRITTEN => {
                    format!("output has missing elements (a wrong length) on {}", r.case.label)
                }
                _ => format!("outside tolerance atol {} rtol {} on {}", tol.atol, tol.rtol, r.case.label),
            };
        }
        judged.push(oracle::diagnose::KernelCase { case: &r.case, out: words, oracle: v });
    }
    if !process_error.is_empty() && kr.passed {
        // The outputs may exist, but the process did not finish cleanly (time limit, output
        // limit, a crash after writing): nothing it produced counts.
        kr.passed = false;
        kr.error = process_error.to_string();
    }
    if !kr.passed {
        kr.diagnosis = oracle::diagnose::kernel(ckb, c, &judged, &tol);
    }
    kr
}

/// Run kernel tests.
///
/// # Errors
/// Not a crate, unknown kernel id, outside the workspace, or the harness cannot be started.
pub fn kernel_test(ctx: &Ctx, req: &KernelTestRequest, budget: &Budget) -> Result<KernelTestReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::KernelTest, &req.engine, req.dtype.as_deref(), budget)?;
    // Each kernel once, in the order asked.
    let mut wanted: Vec<String> = Vec::new();
    for k in &req.kernels {
        if !wanted.contains(k) {
            wanted.push(k.clone());
        }
    }
    let contracts: Vec<&Contract> = if wanted.is_empty() {
        gate.target.spec.kernels.iter().map(|id| ctx.ckb.get(id)).collect::<Result<_>>()?
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
    gate.split(req.write_bundle.as_deref(), req.from_bundle.as_deref())?;
    let seed = gate.draw_seed(req.seed)?;
    gate.contracts(&contracts.iter().map(|c| c.id.as_str()).collect::<Vec<_>>());
    let dtype = gate.target.dtype.clone();
    // Limited to some kernels: evidence for those, not for phase order (verify needs them all).
    let partial = gate.target.spec.kernels.iter().any(|id| contracts.iter().all(|c| &c.id != id));
    let mut spec = KernelSpec { contracts, seed, dtype, drawn: vec![], cases: vec![], partial };
    gate.run(&mut spec)
}

/// run_kernel_test as a [`Spec`]: the kernels asked for, their drawn cases.
struct KernelSpec<'c> {
    contracts: Vec<&'c Contract>,
    seed: u64,
    dtype: String,
    /// The drawn cases, in the order of `cases`; their expected values are computed only after the
    /// engine's process has exited.
    drawn: Vec<Case>,
    cases: Vec<KernelCase>,
    /// Whether the kernels asked for leave out some of the engine's plan.
    partial: bool,
}

impl Spec for KernelSpec<'_> {
    type Report = KernelTestReport;

    fn extra_kernels(&self) -> Vec<String> {
        self.contracts.iter().map(|c| c.id.clone()).collect()
    }

    fn unjudged(&self, gate: &Gate, why: String) -> KernelTestReport {
        KernelTestReport {
            passed: false,
            seed: self.seed,
            dtype: self.dtype.clone(),
            kernels: vec![],
            build_error: why,
            rules: gate.findings.clone(),
            sandboxed: gate.ctx.workshop.sandboxed(),
            attestation: String::new(),
        }
    }

    fn no_device(&self, gate: &Gate, why: String) -> KernelTestReport {
        // An engine for a device, and no device here: nothing ran, nothing passes.
        let mut report = self.unjudged(gate, why.clone());
        report.kernels = self
            .contracts
            .iter()
            .map(|c| KernelResult {
                kernel: c.id.clone(),
                passed: false,
                cases: 0,
                max_abs_err: UNWRITTEN,
                max_rel_err: UNWRITTEN,
                worst_index: 0,
                worst_case: String::new(),
                atol: 0.0,
                rtol: 0.0,
                error: why.clone(),
                diagnosis: vec![],
            })
            .collect();
        report
    }

    fn commands(&mut self, gate: &Gate, h: &Harness) -> Result<Commands> {
        // Draw every case and write its inputs.
        for c in &self.contracts {
            for (ci, tc) in c.test_cases.iter().enumerate() {
                let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ base::util::fnv1a(&c.id) ^ (ci as u64) << 48);
                let case = kernels::draw(&c.id, tc, &mut rng)?;
                let n = self.drawn.len();
                let input = gate.input(h, &format!("case{n}.in.safetensors"), &input_bytes(&case)?)?;
                let output = h.output(&format!("case{n}.out.safetensors"));
                self.cases.push(KernelCase { kernel: c.id.clone(), input, output });
                self.drawn.push(case);
            }
        }
        Ok(vec![(Command::Kernel { cases: self.cases.clone() }, vec![])])
    }

    fn judge(&mut self, gate: &Gate, h: &Harness, mut called: Vec<Called>) -> Result<GateVerdict<KernelTestReport>> {
        let called = called.remove(0);
        let process_error = if called.run.ok() {
            String::new()
        } else {
            harness::explain(&format!("the harness process {}", called.run.failure_text(1500)), &gate.engine)
        };
        let results = match called.reply {
            Ok(Reply::Kernel { results }) if results.len() == self.cases.len() => {
                results.into_iter().map(Some).collect()
            }
            _ => vec![None; self.cases.len()],
        };
        let ran: Vec<Ran> = std::mem::take(&mut self.drawn)
            .into_iter()
            .zip(&self.cases)
            .zip(results)
            .map(|((case, io), result)| {
                let out = match result.as_ref().and_then(|r| r.panic.clone()) {
                    Some(p) => Err(format!("panicked on {}: {p}", case.label)),
                    None => h.output_words(&io.output).ok().and_then(|(_, mut t)| t.remove("out")).ok_or_else(|| {
                        if process_error.is_empty() {
                            format!("no output for {}", case.label)
                        } else {
                            process_error.clone()
                        }
                    }),
                };
                Ran { case, out }
            })
            .collect();
        let kernels: Vec<KernelResult> = self
            .contracts
            .iter()
            .map(|c| {
                let mine: Vec<&Ran> = ran.iter().filter(|r| r.case.kernel == c.id).collect();
                judge_kernel(&gate.ctx.ckb, c, &mine, &process_error)
            })
            .collect();
        let passed = !kernels.is_empty() && kernels.iter().all(|k| k.passed);
        let report = KernelTestReport {
            passed,
            kernels,
            build_error: String::new(),
            attestation: gate.attestation_note(),
            ..self.unjudged(gate, String::new())
        };
        let figures = KernelTestFigures {
            gate: GateFigures { partial: self.partial, ..gate.common() },
            kernels: report
                .kernels
                .iter()
                .map(|k| KernelFigure {
                    id: k.kernel.clone(),
                    passed: k.passed,
                    max_abs_err: k.max_abs_err,
                    diagnosis: k.diagnosis.iter().map(|d| d.failure.clone()).collect(),
                    unwritten: !k.passed && KernelFigure::is_unwritten(&k.error),
                    error: k.error.chars().take(ledger::figures::KERNEL_ERROR_CHARS).collect(),
                })
                .collect(),
        };
        Ok(GateVerdict { report, figures: Figures::KernelTest(figures) })
    }
}
