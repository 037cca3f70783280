//! The gate run loop: every gate is a [`Spec`] that [`Gate::run`] drives through one order, so each
//! gate module keeps only what is its own (its inputs, its commands, its judge). [`Spec::runs`] says
//! what is built and where the engine runs: the harness crate, exchanged with here or through a
//! bundle ([`Runs::Harness`]: run_kernel_test, verify_generation, profile_engine, verify_batching);
//! the engine's own binary, run here or through a bundle that carries it with the plan of what is
//! sent to it ([`Runs::Binary`]: serve_engine); or nothing the loop builds ([`Runs::Here`]:
//! compile_engine, whose own cargo build is its verdict).
//!
//! ```text
//! Gate::open      confine the engine path; resolve the engine (snapshot, source hash, manifest) and
//!                 its target (family, dtype, Cargo features, kernel arms)
//! Gate::split     direct, or a bundle written here / read back (transport)
//! Gate::run(spec)
//!   rules         a blocking finding stops the gate (recorded, Spec::unjudged)
//!   build         Runs::Harness: the harness crate with Spec::extra_kernels; Runs::Binary: the
//!                 engine's binary (Gate::build_binary); a build failure stops the gate
//!   draw          Spec::commands: inputs written into the scratch directory, harness commands
//!   exchange      run here in order / written to a bundle (not a verdict, not recorded) /
//!                 read back from a bundle run on the device machine
//!   no device     a harness that found no device: not run, recorded as such
//!   judge         Spec::judge (harness replies) or Spec::judge_here (Binary, Here): the report
//!                 and its typed figures (a crash is the spec's verdict)
//!   record        the outcome in the ledger (typed figures, versioned contracts)
//!   promote       a passing outcome promotes the staged candidates it ran under
//! ```
//!
//! A stopped gate is a report like any other (`passed: false`, recorded); `Err` is for a bad request
//! or the server's own fault.
//!
//! The specs are `CompileSpec`, `KernelSpec`, `VerifySpec`, `ProfileSpec`, `BatchingSpec` and
//! `ServeSpec`; every gate that runs the engine can run split through a bundle (`harness::bundle`):
//! the four harness gates with their protocol commands, serve_engine with its binary and plan
//! ([`Spec::plan`], judged from the recorded observations by [`Spec::judge_observed`]);
//! compile_engine, which runs nothing, refuses one. A gate reads its model directory once, through `ops::checkpoint`.
//! Recording (`Ctx::record`) writes the engine's manifest as the outcome's constraints and the tool's
//! typed figures (`ledger::figures`: one struct per tool, read back with `Figures::read`, tolerant of
//! older rows). serve_engine's binary is copied into the call's scratch (or the bundle) and started
//! through `Workshop::start_server` where it runs, so its load test runs where the server is.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{Ctx, Report, Target};
use base::beneath::{Dir, Files};
use base::error::Error;
use base::error::Result;
use guard::Finding;
use harness::protocol::Command;
use harness::{self, Budget, Called, Engine, bundle};
use ledger::figures::{
    BatchingFigures, CompileFigures, Figures, GateFigures, KernelTestFigures, ProfileFigures, ServeFigures,
    VerifyFigures,
};

pub use super::evolve::Promotion;
pub use transport::{BundleWritten, Harness, Scratch, Staging, wrote_bundle};

mod transport;

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

/// Where the engine's harness process runs for this gate call.
#[derive(Debug, Clone, Default)]
pub enum Mode {
    /// Here, now (the default).
    #[default]
    Direct,
    /// Nowhere yet: build and draw here, write a bundle to this directory (`harness::bundle`),
    /// resolved once: staged and moved into place through its parent's handle.
    Write(super::NewDir),
    /// Elsewhere, already: read this run bundle's replies back and judge them here, through the
    /// handle of the bundle directory.
    Read(Dir),
}

/// What [`Gate::exchange`] got.
pub enum Exchange {
    /// The commands ran (here, or on the device machine for a bundle read back), in order; a
    /// command after a failed one did not run and is absent.
    Ran(Vec<Called>),
    /// The commands were written to a bundle; nothing ran.
    Written(BundleWritten),
}

/// How the text of a gate that found no device begins ([`no_device`]).
pub const NO_DEVICE: &str = "no CUDA device: not run ";

/// The gate's text for a harness that found no device (`Reply::NoDevice`), None otherwise.
pub fn no_device(called: &Called) -> Option<String> {
    match &called.reply {
        Ok(harness::protocol::Reply::NoDevice { reason }) => Some(format!(
            "{NO_DEVICE}({reason}); write a bundle (write_bundle, `--write-bundle DIR`) and run it with \
             `metainfer bundle run DIR` where the device is"
        )),
        _ => None,
    }
}

/// Harness commands, each with the environment variables it runs under.
pub type Commands = Vec<(Command, Vec<(&'static str, String)>)>;

/// What a gate builds, and where the engine runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Runs {
    /// The harness crate around the engine; the engine runs through protocol commands, here or
    /// through a bundle ([`Spec::commands`], [`Spec::judge`]).
    Harness,
    /// The engine's own binary, built with these Cargo features and run by the spec here
    /// ([`Spec::judge_here`]: serve_engine's server on a loopback port), or written to a bundle
    /// with [`Spec::plan`] and judged from what its run recorded ([`Spec::judge_observed`]).
    Binary(Vec<String>),
    /// Nothing built by the loop: the spec builds and judges here ([`Spec::judge_here`]:
    /// compile_engine's own cargo build, whose failure is its verdict). No bundle.
    Here,
}

/// What one gate does that is its own; [`Gate::run`] does the rest, in one order.
pub trait Spec {
    /// The gate's report.
    type Report: Report;

    /// What the gate builds and how the engine runs: the harness (the default) or the engine's own
    /// binary.
    fn runs(&self) -> Runs {
        Runs::Harness
    }

    /// Judge a gate that runs here ([`Runs::Binary`]: `exe` is the engine's binary, built into the
    /// call's `scratch` directory; [`Runs::Here`]: `exe` is None). Gates that run the harness never
    /// get here.
    ///
    /// # Errors
    /// The server's own fault (the reference cannot be computed, a process cannot be started).
    fn judge_here(&mut self, gate: &Gate, _exe: Option<&Path>, _scratch: &Path) -> Result<Verdict<Self::Report>> {
        Err(Error::internal(format!("{} does not run the engine's binary", gate.tool.name())))
    }

    /// The plan a gate that runs the engine's binary ([`Runs::Binary`]) sends it, as the bytes a
    /// bundle carries (`harness::bundle::PLAN`): drawn here, holding no expected value.
    ///
    /// # Errors
    /// When the plan cannot be serialised; gates that run the harness have none.
    fn plan(&mut self, gate: &Gate) -> Result<Vec<u8>> {
        Err(Error::internal(format!("{} sends no plan", gate.tool.name())))
    }

    /// Judge what a bundle run of the engine's binary recorded (`harness::bundle::OBSERVED`),
    /// as [`Spec::judge_here`] judges a run here.
    ///
    /// # Errors
    /// Usage when the observations do not parse; the server's own fault.
    fn judge_observed(&mut self, gate: &Gate, _observed: &[u8]) -> Result<Verdict<Self::Report>> {
        Err(Error::internal(format!("{} records no observations", gate.tool.name())))
    }

    /// Kernel ids the harness is built with beyond the target's own (run_kernel_test's asked-for
    /// kernels); none by default.
    fn extra_kernels(&self) -> Vec<String> {
        vec![]
    }

    /// The report of a call that judged nothing: `passed: false`, `why` as its error, the gate's
    /// rule findings. Used when the gate stopped before the engine ran, when a bundle was written,
    /// and when the harness found no device.
    fn unjudged(&self, gate: &Gate, why: String) -> Self::Report;

    /// The report when the harness found no device (`why` says so): [`Spec::unjudged`] unless the
    /// gate lists what did not run.
    fn no_device(&self, gate: &Gate, why: String) -> Self::Report {
        self.unjudged(gate, why)
    }

    /// Draw this call's inputs into `h`'s scratch directory ([`Gate::input`]) and return the harness
    /// commands, each with the environment it runs under.
    ///
    /// # Errors
    /// When an input cannot be drawn or written.
    fn commands(&mut self, gate: &Gate, _h: &Harness) -> Result<Commands> {
        Err(Error::internal(format!("{} sends no harness commands", gate.tool.name())))
    }

    /// The model directory the commands read (granted to the harness, carried or hashed in a
    /// bundle); none by default.
    fn model(&self) -> Option<&base::beneath::HeldDir> {
        None
    }

    /// Further directories the harness may read (besides the model); none by default.
    fn reads(&self) -> Vec<PathBuf> {
        vec![]
    }

    /// Judge the replies: `called` holds one entry per command that ran, in order (a command after
    /// a crashed one did not run and is absent). A crash is a verdict like any other here.
    ///
    /// # Errors
    /// The server's own fault (the reference cannot be computed).
    fn judge(&mut self, gate: &Gate, _h: &Harness, _called: Vec<Called>) -> Result<Verdict<Self::Report>> {
        Err(Error::internal(format!("{} judges no harness replies", gate.tool.name())))
    }

    /// Where a passing report shows the promotions its outcome made; None (the default) for a gate
    /// whose report has no such field, and then nothing is promoted.
    fn promotions(_report: &mut Self::Report) -> Option<&mut Vec<Promotion>> {
        None
    }
}

/// A judged gate call: its report and the figures recorded with it.
pub struct Verdict<R> {
    /// The report returned to the caller.
    pub report: R,
    /// The typed figures recorded in the ledger.
    pub figures: Figures,
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
    /// Where the harness runs (direct, or a bundle written or read back).
    pub mode: Mode,
    /// The manifest of the bundle read back ([`Mode::Read`]).
    pub bundle: Option<bundle::BundleManifest>,
    /// The bundle's nonce (written or read back).
    pub nonce: Option<String>,
    /// A bundle read back: the trusted runner's signature, or why there is none (the verdict is
    /// then unattested evidence).
    pub attestation: Option<std::result::Result<harness::attest::Attested, String>>,
    started: Instant,
}

impl<'a> Gate<'a> {
    /// Confine and resolve the engine and its target at `dtype` (None: the engine's own).
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`]: a path outside the workspace, not a crate, a malformed
    /// manifest, an unknown family, or a dtype the engine does not declare.
    pub fn open(ctx: &'a Ctx, tool: Tool, engine: &str, dtype: Option<&str>, budget: &'a Budget) -> Result<Gate<'a>> {
        let started = Instant::now();
        let dir = ctx.confine(Path::new(engine))?;
        let engine = ctx.workshop.engine_at(&dir)?;
        let target = ctx.target(&engine, dtype)?;
        Ok(Gate {
            ctx,
            tool,
            engine,
            target,
            budget,
            seed: None,
            contracts: vec![],
            findings: vec![],
            mode: Mode::Direct,
            bundle: None,
            nonce: None,
            attestation: None,
            started,
        })
    }

    /// Split this call at the harness: with `write`, build and draw here and write a bundle to that
    /// directory (absent or empty); with `read`, judge a bundle already run on the device machine.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`]: both given; a path outside the workspace; a non-empty
    /// destination; a bundle of another gate, other engine sources or another dtype.
    pub fn split(&mut self, write: Option<&str>, read: Option<&str>) -> Result<()> {
        match (write, read) {
            (Some(_), Some(_)) => Err(Error::usage(
                "write_bundle and from_bundle exclude each other: write a bundle, run it, then read it",
            )),
            (Some(w), None) => {
                let dest = self.ctx.confine_new(Path::new(w))?;
                let full = dest.path();
                let taken = match dest.base.kind(&dest.rest) {
                    None => false,
                    Some(t) if t.is_dir() => dest.base.entries(&dest.rest).map(|e| !e.is_empty()).unwrap_or(true),
                    Some(_) => true,
                };
                if taken {
                    return Err(Error::usage(format!(
                        "{} exists and is not empty; choose a new bundle directory",
                        full.display()
                    )));
                }
                self.mode = Mode::Write(dest);
                self.nonce = Some(bundle::fresh_nonce());
                Ok(())
            }
            (None, Some(r)) => {
                let held = self.ctx.confine(Path::new(r))?;
                bundle::check_no_links(&held)?;
                let m = bundle::read_manifest(&held)?;
                if m.tool != self.tool.name() {
                    return Err(Error::usage(format!(
                        "{} is a bundle of {}, not of {}; read it back with {}",
                        held.path().display(),
                        m.tool,
                        self.tool.name(),
                        m.tool
                    )));
                }
                if m.engine_hash != self.engine.hash {
                    return Err(Error::usage(format!(
                        "the engine's sources changed since the bundle was written (bundle {}, now {}): write and run a new bundle",
                        &m.engine_hash[..12.min(m.engine_hash.len())],
                        &self.engine.hash[..12]
                    )));
                }
                if m.dtype != self.target.dtype {
                    return Err(Error::usage(format!(
                        "the bundle was built for {} weights, this call asks for {}",
                        m.dtype, self.target.dtype
                    )));
                }
                self.seed = m.seed;
                let ledger = ledger::Ledger::open(&self.ctx.ledger)?;
                let trusted = ledger.runners()?;
                let mut attestation = harness::attest::verify(&held, &m.nonce, &trusted);
                // The manifest as this server wrote it (it pins the executable's, the inputs' and
                // the model's hashes); one this ledger never wrote is no evidence.
                let bytes = held.read(Path::new(bundle::MANIFEST), &base::util::HARNESS_REPLY)?;
                let sha = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(&bytes));
                match ledger.written_bundle(&m.nonce)? {
                    Some((_, written)) if written != sha => {
                        return Err(Error::usage(format!(
                            "{}: the manifest changed since this server wrote the bundle (its executable, inputs or model hashes may name other files): write and run a new bundle",
                            held.show(Path::new(bundle::MANIFEST)).display()
                        )));
                    }
                    Some(_) => {}
                    None => {
                        attestation = Err(format!(
                            "this server's ledger has no record of writing bundle {} (written elsewhere, or by another ledger)",
                            m.nonce
                        ));
                    }
                }
                if let Ok(a) = &attestation {
                    // A signed run whose files changed since is refused outright; each file is
                    // checked again as it is read.
                    for name in a.files.keys() {
                        a.check_file(&held, name)?;
                    }
                }
                self.attestation = Some(attestation);
                self.nonce = Some(m.nonce.clone());
                self.bundle = Some(m);
                self.mode = Mode::Read(held);
                Ok(())
            }
            (None, None) => Ok(()),
        }
    }

    /// The seed of this call: the bundle's when reading one back (a different `requested` seed is
    /// an error), else `requested` or a fresh one.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] when `requested` differs from the bundle's.
    pub fn draw_seed(&mut self, requested: Option<u64>) -> Result<u64> {
        let seed = match (&self.bundle, requested) {
            (Some(b), Some(r)) if b.seed != Some(r) => {
                return Err(Error::usage(format!("the bundle was drawn with seed {:?}, not {r}; omit seed", b.seed)));
            }
            (Some(b), _) => b.seed.unwrap_or_else(base::util::fresh_seed),
            (None, r) => r.unwrap_or_else(base::util::fresh_seed),
        };
        self.seed = Some(seed);
        Ok(seed)
    }

    /// Write one drawn input file (safetensors) into the call's scratch directory; reading a bundle
    /// back, check instead that the bundle's file is the one it was written with (its manifest's
    /// sha256) and holds this fresh draw from its seed ([`bundle::same_tensors`]).
    ///
    /// # Errors
    /// Usage when a bundle's input differs; Internal when the file cannot be written.
    pub fn input(&self, h: &Harness, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        let path = h.path(name);
        match &self.bundle {
            Some(m) => {
                let held = h.read(name).ok().filter(|b| {
                    m.inputs.get(name) == Some(&format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(b)))
                });
                if !held.is_some_and(|b| bundle::same_tensors(&b, bytes)) {
                    return Err(Error::usage(format!(
                        "bundle input {name} is missing or not what its seed draws here: the bundle was altered or written by another metainfer"
                    )));
                }
            }
            None => {
                h.write_new(name, bytes)?;
            }
        }
        Ok(path)
    }

    /// Check that a model routes to the family the engine declares: an engine is checked on
    /// checkpoints of its own family only (its kernel tests cover that family's kernels).
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] naming both families and what to change.
    pub fn same_family(&self, model_dir: &Path, model_family: &str) -> Result<()> {
        if model_family == self.target.family {
            return Ok(());
        }
        Err(base::error::Error::usage(format!(
            "{} routes to {model_family}, but the engine declares family = {:?} in {}; an engine is checked on checkpoints of its own family: use a {} checkpoint, or scaffold an engine for {model_family}",
            model_dir.display(),
            self.target.family,
            self.engine.dir.join(manifest::FILE).display(),
            self.target.family
        )))
    }

    /// Record the outcome under these contract ids (at their CKB versions).
    pub fn contracts(&mut self, ids: &[&str]) {
        self.contracts = self.ctx.versioned(ids);
    }

    /// The common figures of this gate.
    pub fn common(&self) -> GateFigures {
        let bundle = match &self.mode {
            Mode::Read(d) => d.path().display().to_string(),
            _ => String::new(),
        };
        let attestation = match &self.attestation {
            Some(Ok(a)) => format!("{}{}", ledger::figures::ATTESTED_PREFIX, a.runner),
            Some(Err(why)) => format!("unattested: {why}"),
            None => String::new(),
        };
        GateFigures { dtype: self.target.dtype.clone(), seed: self.seed, bundle, attestation, ..Default::default() }
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
        if let Mode::Read(dir) = &self.mode {
            // The bundle's harness already ran; nothing is built.
            return Ok(Ok(Harness {
                exe: dir.pinned().join(bundle::HARNESS),
                scratch: Scratch::Bundle(dir.clone()),
                nonce: self.nonce.clone(),
                attested: self.attested().cloned(),
            }));
        }
        let mut spec = self.target.spec.clone();
        // Correctness gates build incrementally; profile_engine measures an optimised build.
        spec.incremental = !matches!(self.tool, Tool::Profile);
        for id in extra {
            if !spec.kernels.contains(id) {
                spec.kernels.push(id.clone());
                spec.arms.push(super::arm(id, &spec.api)?);
            }
        }
        let build = self.ctx.workshop.build_harness(&self.engine, &spec, self.budget)?;
        match build.executable.clone().filter(|_| build.ok) {
            Some(exe) => {
                let scratch = match &self.mode {
                    // A bundle is staged beside its destination and renamed into place when
                    // complete, all through the handle of the directory it was resolved beneath.
                    Mode::Write(dest) => {
                        Scratch::Staged(Staging::new(&dest.base, dest.rest.parent().unwrap_or(Path::new("")))?)
                    }
                    _ => Scratch::Temp(self.ctx.workshop.scratch()?),
                };
                Ok(Ok(Harness { exe, scratch, nonce: self.nonce.clone(), attested: None }))
            }
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
        self.call_exe(h, &h.exe, command, env, reads)
    }

    /// As [`Gate::call`], running the harness executable `exe` (a kept build of the same engine
    /// directory, for an interleaved comparison) in `h`'s scratch directory.
    ///
    /// # Errors
    /// As [`Gate::call`].
    pub fn call_exe(
        &self,
        h: &Harness,
        exe: &Path,
        command: Command,
        env: &[(&str, String)],
        reads: &[&Path],
    ) -> Result<Called> {
        let mut grants = harness::Grants::harness(exe, h.dir());
        for r in reads {
            grants = grants.read(*r);
        }
        self.ctx.workshop.call(exe, h.dir(), command, env, &grants, self.budget)
    }

    /// Hand the harness its commands as this call's mode says: run them here, in order, until one
    /// fails ([`Mode::Direct`]); write them with the harness, the inputs in the scratch directory
    /// and `model` (the model directory the commands name) into a bundle ([`Mode::Write`]); or read
    /// the replies of a bundle run elsewhere ([`Mode::Read`]).
    ///
    /// # Errors
    /// When a process cannot be started, the bundle cannot be written, or a bundle read back has
    /// not been run.
    pub fn exchange(
        &self,
        h: Harness,
        commands: Vec<(Command, Vec<(&str, String)>)>,
        model: Option<&dyn Files>,
        reads: &[&Path],
    ) -> Result<(Harness, Exchange)> {
        match &self.mode {
            Mode::Direct => {
                let mut out = Vec::new();
                for (c, env) in commands {
                    let called = self.call(&h, c, &env, reads)?;
                    let failed = !called.run.ok();
                    out.push(called);
                    if failed {
                        break;
                    }
                }
                Ok((h, Exchange::Ran(out)))
            }
            Mode::Read(held) => {
                self.check_bundle(held, &commands, model)?;
                let mut out = vec![bundle::called(held, 0, self.attested())?];
                for i in 1..commands.len() {
                    match bundle::called(held, i, self.attested()) {
                        Ok(c) => out.push(c),
                        Err(_) => break,
                    }
                }
                Ok((h, Exchange::Ran(out)))
            }
            Mode::Write(dest) => {
                let written = self.write_bundle(&h, transport::Payload::Commands(commands), model, dest)?;
                Ok((h, Exchange::Written(written)))
            }
        }
    }

    /// Drive `spec` through the one order of every harness gate: rules -> build -> draw ->
    /// exchange (direct, or a bundle written or read back) -> no device -> judge -> record ->
    /// promote. Each early end is a report: stopped (recorded), bundle written (not a verdict, not
    /// recorded), no device (recorded as such).
    ///
    /// # Errors
    /// As [`Gate::rules`], [`Gate::build`], [`Gate::exchange`] and the spec's own steps.
    pub fn run<S: Spec>(&mut self, spec: &mut S) -> Result<S::Report> {
        if let Err(stop) = self.rules()? {
            let report = spec.unjudged(self, stop.text.clone());
            return Ok(self.stopped(&stop, report));
        }
        match spec.runs() {
            Runs::Harness => {}
            Runs::Binary(features) => return self.run_here(spec, Some(&features)),
            Runs::Here => return self.run_here(spec, None),
        }
        let h = match self.build(&spec.extra_kernels())? {
            Ok(h) => h,
            Err(stop) => {
                let report = spec.unjudged(self, stop.text.clone());
                return Ok(self.stopped(&stop, report));
            }
        };
        let commands = spec.commands(self, &h)?;
        let model = spec.model();
        let grant = model.map(|m| m.grant());
        let extra = spec.reads();
        let mut reads: Vec<&Path> = grant.as_ref().map(|g| g.paths()).unwrap_or_default();
        reads.extend(extra.iter().map(PathBuf::as_path));
        let (h, exchanged) = self.exchange(h, commands, model.map(|m| m as &dyn Files), &reads)?;
        let called = match exchanged {
            Exchange::Written(w) => return Ok(spec.unjudged(self, w.text(self.tool.name()))),
            Exchange::Ran(c) => c,
        };
        if let Some(why) = called.iter().find_map(no_device) {
            let report = spec.no_device(self, why);
            let common = GateFigures { no_device: true, ..self.common() };
            self.record(&report, self.tool.figures(common));
            return Ok(report);
        }
        let verdict = spec.judge(self, &h, called)?;
        self.finish(spec, verdict)
    }

    /// [`Gate::run`] for a gate that runs the engine's binary or nothing the loop builds: build
    /// the binary with `features` when given (a failure stops the gate), then judge, record,
    /// promote. With a bundle ([`Runs::Binary`] only): the binary and [`Spec::plan`] are written
    /// to one; read back, its recorded observations are judged ([`Spec::judge_observed`]).
    fn run_here<S: Spec>(&mut self, spec: &mut S, features: Option<&[String]>) -> Result<S::Report> {
        match (&self.mode, features) {
            (Mode::Direct, _) => {}
            (_, None) => {
                return Err(Error::usage(format!("{} runs here only: it takes no bundle", self.tool.name())));
            }
            (Mode::Write(dest), Some(features)) => {
                let plan = spec.plan(self)?;
                let built = self.ctx.workshop.scratch()?;
                let exe = match self.build_binary(features, built.path())? {
                    Ok(exe) => exe,
                    Err(stop) => {
                        let report = spec.unjudged(self, stop.text.clone());
                        return Ok(self.stopped(&stop, report));
                    }
                };
                let staging = Staging::new(&dest.base, dest.rest.parent().unwrap_or(Path::new("")))?;
                let h = Harness {
                    exe,
                    scratch: transport::Scratch::Staged(staging),
                    nonce: self.nonce.clone(),
                    attested: None,
                };
                let model = spec.model().map(|m| m as &dyn Files);
                let written = self.write_bundle(&h, transport::Payload::Plan(plan), model, dest)?;
                return Ok(spec.unjudged(self, written.text(self.tool.name())));
            }
            (Mode::Read(dir), Some(_)) => {
                let plan = spec.plan(self)?;
                let model = spec.model().map(|m| m as &dyn Files);
                let observed = self.read_observed(dir, &plan, model)?;
                let verdict = spec.judge_observed(self, &observed)?;
                return self.finish(spec, verdict);
            }
        }
        let scratch = self.ctx.workshop.scratch()?;
        let exe = match features {
            None => None,
            Some(features) => match self.build_binary(features, scratch.path())? {
                Ok(exe) => Some(exe),
                Err(stop) => {
                    let report = spec.unjudged(self, stop.text.clone());
                    return Ok(self.stopped(&stop, report));
                }
            },
        };
        let verdict = spec.judge_here(self, exe.as_deref(), scratch.path())?;
        self.finish(spec, verdict)
    }

    /// Record a judged call and promote on a pass.
    fn finish<S: Spec>(&self, _spec: &S, verdict: Verdict<S::Report>) -> Result<S::Report> {
        let Verdict { mut report, figures } = verdict;
        self.record(&report, figures);
        if report.passed() && S::promotions(&mut report).is_some() {
            let p = self.promote();
            if let Some(slot) = S::promotions(&mut report) {
                *slot = p;
            }
        }
        Ok(report)
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
        if let Some(Err(why)) = &self.attestation {
            // An unattested bundle verdict is never evidence (harness::attest).
            return self
                .contracts
                .iter()
                .filter(|tag| self.ctx.ckb.is_provisional(tag.split('@').next().unwrap_or(tag)))
                .map(|tag| super::evolve::Promotion {
                    contract: tag.clone(),
                    promoted: false,
                    message: format!("not promoted: the verdict judges a bundle run that is unattested ({why})"),
                })
                .collect();
        }
        super::evolve::promote_on_evidence(self.ctx, self.tool.name(), &self.contracts)
    }

    /// The trusted runner's attestation of the bundle read back, when there is one.
    pub fn attested(&self) -> Option<&harness::attest::Attested> {
        self.attestation.as_ref().and_then(|a| a.as_ref().ok())
    }

    /// A line for a report about what the verdict of a bundle read back proves; "" for a direct
    /// run.
    pub fn attestation_note(&self) -> String {
        match &self.attestation {
            Some(Ok(a)) => format!("bundle run attested by trusted runner {}", a.runner),
            Some(Err(why)) => format!(
                "unattested: {why}; this verdict is recorded and shown but is not evidence for phase order or promotion (README, Security: bundles)"
            ),
            None => String::new(),
        }
    }

    /// Record the outcome of this gate in the ledger.
    pub fn record(&self, report: &impl Report, figures: Figures) {
        self.ctx.record(self.tool.name(), Some(&self.engine), self.contracts.clone(), report, figures, self.started);
    }
}
