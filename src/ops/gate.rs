//! The gate skeleton: the one path every gate (compile_engine, run_kernel_test, verify_generation,
//! profile_engine, verify_batching, serve_engine) goes through, so that each gate module keeps only what is its own.
//!
//! ```text
//! Gate::open      confine the engine path; resolve the engine (snapshot, source hash, manifest) and
//!                 its target (family, dtype, Cargo features, kernel arms)
//! Gate::rules     run the rules: a blocking finding stops the gate (a Stop)
//! Gate::build     build the harness crate: a build failure stops the gate (a Stop)
//! Gate::call      run one harness command (protocol::Command) under the call's time limit and read
//!                 its typed reply
//! Gate::record    record the outcome in the ledger (typed figures, versioned contracts)
//! Gate::promote   a passing outcome promotes the staged candidates it ran under
//! ```
//!
//! A stopped gate is a report like any other (`passed: false`, recorded); `Err` is for a bad request
//! or the server's own fault.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{Ctx, Report, Target};
use crate::error::Result;
use crate::guard::Finding;
use crate::harness::protocol::Command;
use crate::harness::{self, Budget, Called, Engine};
use crate::ledger::figures::{
    BatchingFigures, CompileFigures, Figures, GateFigures, KernelTestFigures, ProfileFigures, ServeFigures,
    VerifyFigures,
};

pub use super::evolve::Promotion;

/// Which gate is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// compile_engine
    Compile,
    /// run_kernel_test
    KernelTest,
    /// verify_generation
    Verify,
    /// profile_engine
    Profile,
    /// verify_batching
    Batching,
    /// serve_engine
    Serve,
}

impl Tool {
    /// The MCP tool name, as outcomes record it.
    pub fn name(self) -> &'static str {
        match self {
            Tool::Compile => "compile_engine",
            Tool::KernelTest => "run_kernel_test",
            Tool::Verify => "verify_generation",
            Tool::Profile => "profile_engine",
            Tool::Batching => "verify_batching",
            Tool::Serve => "serve_engine",
        }
    }

    /// This tool's figures with only the common part filled (a stopped gate records these).
    pub fn figures(self, gate: GateFigures) -> Figures {
        match self {
            Tool::Compile => Figures::Compile(CompileFigures { gate, ..Default::default() }),
            Tool::KernelTest => Figures::KernelTest(KernelTestFigures { gate, ..Default::default() }),
            Tool::Verify => Figures::Verify(VerifyFigures { gate, ..Default::default() }),
            Tool::Profile => Figures::Profile(ProfileFigures { gate, ..Default::default() }),
            Tool::Batching => Figures::Batching(BatchingFigures { gate, ..Default::default() }),
            Tool::Serve => Figures::Serve(ServeFigures { gate, ..Default::default() }),
        }
    }
}

/// Why a gate stopped before the engine ran.
#[derive(Debug, Clone)]
pub struct Stop {
    /// A blocking rule finding (else: the build failed).
    pub blocked: bool,
    /// What to fix, for the report.
    pub text: String,
    /// The rule findings (empty for a build failure).
    pub findings: Vec<Finding>,
}

/// A built harness and the scratch directory of this call (removed when dropped).
pub struct Harness {
    /// The harness executable.
    pub exe: PathBuf,
    /// Scratch directory for requests, inputs and outputs.
    pub scratch: tempfile::TempDir,
}

impl Harness {
    /// A path in the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.scratch.path().join(name)
    }
}

/// One gate call in progress.
pub struct Gate<'a> {
    /// The context (the live CKB).
    pub ctx: &'a Ctx,
    /// Which gate.
    pub tool: Tool,
    /// The engine under test.
    pub engine: Engine,
    /// What it is built and checked as.
    pub target: Target,
    /// Time limit and cancellation.
    pub budget: &'a Budget,
    /// Seed of the drawn inputs, recorded with the outcome.
    pub seed: Option<u64>,
    /// Contracts the outcome is recorded under (`id@version`).
    pub contracts: Vec<String>,
    /// The rule findings once [`Gate::rules`] ran.
    pub findings: Vec<Finding>,
    started: Instant,
}

impl<'a> Gate<'a> {
    /// Confine and resolve the engine and its target at `dtype` (None: the engine's own).
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`]: a path outside the workspace, not a crate, a malformed
    /// manifest, an unknown family, or a dtype the engine does not declare.
    pub fn open(ctx: &'a Ctx, tool: Tool, engine: &str, dtype: Option<&str>, budget: &'a Budget) -> Result<Gate<'a>> {
        let started = Instant::now();
        let dir = ctx.confine(Path::new(engine), true)?;
        let engine = ctx.workshop.engine(&dir)?;
        let target = ctx.target(&engine, dtype)?;
        Ok(Gate { ctx, tool, engine, target, budget, seed: None, contracts: vec![], findings: vec![], started })
    }

    /// Check that a model routes to the family the engine declares: an engine is checked on
    /// checkpoints of its own family only (its kernel tests cover that family's kernels).
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming both families and what to change.
    pub fn same_family(&self, model_dir: &Path, model_family: &str) -> Result<()> {
        if model_family == self.target.family {
            return Ok(());
        }
        Err(crate::error::Error::usage(format!(
            "{} routes to {model_family}, but the engine declares family = {:?} in {}; an engine is checked on checkpoints of its own family: use a {} checkpoint, or scaffold an engine for {model_family}",
            model_dir.display(),
            self.target.family,
            self.engine.dir.join(crate::manifest::FILE).display(),
            self.target.family
        )))
    }

    /// Record the outcome under these contract ids (at their CKB versions).
    pub fn contracts(&mut self, ids: &[&str]) {
        self.contracts = self.ctx.versioned(ids);
    }

    /// The common figures of this gate.
    pub fn common(&self) -> GateFigures {
        GateFigures { dtype: self.target.dtype.clone(), seed: self.seed, ..Default::default() }
    }

    /// Run the rules on the engine (check_rules); a blocking finding stops the gate.
    ///
    /// # Errors
    /// When the ledger's references cannot be read.
    pub fn rules(&mut self) -> Result<std::result::Result<(), Stop>> {
        let rules = super::rules::precheck(self.ctx, &self.engine, self.budget)?;
        self.findings = rules.findings.clone();
        if rules.passed {
            return Ok(Ok(()));
        }
        Ok(Err(Stop { blocked: true, text: super::rules::blocked_text(&rules), findings: rules.findings }))
    }

    /// Build the harness for the target's kernels plus `extra` kernel ids (asked for by name); a
    /// build failure stops the gate with the compile report's text.
    ///
    /// # Errors
    /// When cargo cannot be started, the cache is not writable, or an extra kernel has no oracle.
    pub fn build(&self, extra: &[String]) -> Result<std::result::Result<Harness, Stop>> {
        let mut spec = self.target.spec.clone();
        for id in extra {
            if !spec.kernels.contains(id) {
                spec.kernels.push(id.clone());
                spec.arms.push(super::arm(id)?);
            }
        }
        let build = self.ctx.workshop.build_harness(&self.engine, &spec, self.budget)?;
        match build.executable.clone().filter(|_| build.ok) {
            Some(exe) => Ok(Ok(Harness { exe, scratch: self.ctx.workshop.scratch()? })),
            None => {
                let compile = super::compile::report_of(self.ctx, &self.engine, build, 0);
                Ok(Err(Stop {
                    blocked: false,
                    text: format!("the engine does not build with the harness:\n{}", compile.text()),
                    findings: vec![],
                }))
            }
        }
    }

    /// Build the engine's binaries (not the harness) with `features`, its binary copied into `dest`;
    /// a build failure, or a build without a binary, stops the gate saying so.
    ///
    /// # Errors
    /// When cargo cannot be started, the cache is not writable or the copy fails.
    pub fn build_binary(&self, features: &[String], dest: &Path) -> Result<std::result::Result<PathBuf, Stop>> {
        let build = self.ctx.workshop.build_engine_binary(&self.engine, features, dest, self.budget)?;
        if !build.ok {
            let compile = super::compile::report_of(self.ctx, &self.engine, build, 0);
            return Ok(Err(Stop {
                blocked: false,
                text: format!("the engine's binary does not build:\n{}", compile.text()),
                findings: vec![],
            }));
        }
        match build.executable {
            Some(exe) => Ok(Ok(exe)),
            None => Ok(Err(Stop {
                blocked: false,
                text: "the engine has no binary: component.openai_server asks for one (src/main.rs or a [[bin]] target) that takes `serve --model DIR --host H --port P`".into(),
                findings: vec![],
            })),
        }
    }

    /// [`Gate::rules`] then [`Gate::build`] without extra kernels.
    ///
    /// # Errors
    /// As those two.
    pub fn prepare(&mut self) -> Result<std::result::Result<Harness, Stop>> {
        if let Err(stop) = self.rules()? {
            return Ok(Err(stop));
        }
        self.build(&[])
    }

    /// Run one harness command with `env` added to the child's (reduced) environment, within the
    /// budget, sandboxed: it may run the harness, write its scratch, and read `reads` (e.g. the
    /// model directory).
    ///
    /// # Errors
    /// When the request cannot be written, the process cannot be started, or the sandbox refuses.
    pub fn call(&self, h: &Harness, command: Command, env: &[(&str, String)], reads: &[&Path]) -> Result<Called> {
        let mut grants = harness::Grants::harness(&h.exe, h.scratch.path());
        for r in reads {
            grants = grants.read(*r);
        }
        self.ctx.workshop.call(&h.exe, h.scratch.path(), command, env, &grants, self.budget)
    }

    /// Record `report` and return it, for a gate stopped before the engine ran.
    pub fn stopped<R: Report>(&self, stop: &Stop, report: R) -> R {
        let gate = GateFigures { blocked: stop.blocked, build_failed: !stop.blocked, ..self.common() };
        self.record(&report, self.tool.figures(gate));
        report
    }

    /// After a passing, recorded outcome: promote each staged candidate it ran under (its family,
    /// its target platform) when this is the evidence promotion needs (`evolve::promote_on_evidence`).
    pub fn promote(&self) -> Vec<super::evolve::Promotion> {
        super::evolve::promote_on_evidence(self.ctx, self.tool.name(), &self.contracts)
    }

    /// Record the outcome of this gate in the ledger.
    pub fn record(&self, report: &impl Report, figures: Figures) {
        self.ctx.record(self.tool.name(), Some(&self.engine), self.contracts.clone(), report, figures, self.started);
    }
}
