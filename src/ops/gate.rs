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
use crate::beneath::{Dir, Files};
use crate::error::Error;
use crate::error::Result;
use crate::guard::Finding;
use crate::harness::protocol::{Command, Request, VERSION};
use crate::harness::{self, Budget, Called, Engine, bundle};
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

/// The directory a harness call's requests, inputs and outputs live in.
pub enum Scratch {
    /// A temporary directory, removed when dropped (direct calls).
    Temp(tempfile::TempDir),
    /// A bundle being staged beside its destination, removed when dropped unless moved into place.
    Staged(Staging),
    /// A bundle directory being read back (kept), by its handle.
    Bundle(Dir),
}

/// A bundle's staging directory: created through the handle of the destination's parent, written
/// through its own handle's path in this process (`/proc/self/fd/N`), and renamed into place
/// through the parent's handle, so a parent swapped for a symlink meanwhile redirects nothing.
pub struct Staging {
    parent: Dir,
    name: String,
    dir: Dir,
    done: std::cell::Cell<bool>,
    /// The destination's missing ancestors this call created (beneath `base`, outermost first),
    /// removed again when the bundle is not completed.
    created: Vec<PathBuf>,
    base: Dir,
}

impl Staging {
    /// Create the missing folders of `parent` (relative to `base`), then
    /// `.bundle-staging-<random>` in it.
    fn new(base: &Dir, parent: &Path) -> Result<Staging> {
        let mut created = Vec::new();
        let mut at = PathBuf::new();
        for c in parent.components() {
            at.push(c);
            if !base.exists(&at) {
                created.push(at.clone());
            }
        }
        let made = (|| {
            base.create_dir_all(parent)?;
            let parent = base.open_dir(parent)?;
            let name = format!(".bundle-staging-{:016x}", rand::random::<u64>());
            parent.create_dir(Path::new(&name))?;
            let dir = parent.open_dir_nofollow(Path::new(&name))?;
            Ok((parent, name, dir))
        })();
        match made {
            Ok((parent, name, dir)) => {
                Ok(Staging { parent, name, dir, done: std::cell::Cell::new(false), created, base: base.clone() })
            }
            Err(e) => {
                remove_created(base, &created);
                Err(e)
            }
        }
    }

    /// Move the staged bundle into place as `dest` (a plain name in the parent; an empty
    /// directory there is replaced).
    fn commit(&self, dest: &std::ffi::OsStr) -> Result<()> {
        self.parent.replace_empty_dir(Path::new(&self.name), Path::new(dest))?;
        self.done.set(true);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done.get() {
            self.parent.remove_dir_all(Path::new(&self.name));
            remove_created(&self.base, &self.created);
        }
    }
}

/// Remove the folders a failed bundle created, innermost first, each only while empty.
fn remove_created(base: &Dir, created: &[PathBuf]) {
    for p in created.iter().rev() {
        base.remove_empty_dir(p);
    }
}

/// `e` with the `/proc/self/fd/N` path of `dir` named by the directory's own path (whole path
/// components only: `/proc/self/fd/5` is not a prefix of `/proc/self/fd/57`).
fn unpin(dir: &Dir, e: Error) -> Error {
    let (pinned, real) = (dir.fd_path().display().to_string(), dir.path().display().to_string());
    let mut out = String::with_capacity(e.message.len());
    let mut rest = e.message.as_str();
    while let Some(at) = rest.find(&pinned) {
        let after = &rest[at + pinned.len()..];
        out.push_str(&rest[..at]);
        out.push_str(if after.starts_with(|c: char| c.is_ascii_digit()) { &pinned } else { &real });
        rest = after;
    }
    out.push_str(rest);
    Error { message: out, ..e }
}

/// A built harness and the scratch directory of this call.
pub struct Harness {
    /// The harness executable.
    pub exe: PathBuf,
    /// Scratch directory for requests, inputs and outputs.
    pub scratch: Scratch,
    /// The bundle's nonce when writing or reading one (output names carry it).
    pub nonce: Option<String>,
    /// What a trusted runner signed, when reading back an attested bundle: every file read is
    /// checked against it.
    pub attested: Option<crate::harness::attest::Attested>,
}

impl Harness {
    /// The scratch directory.
    pub fn dir(&self) -> &Path {
        match &self.scratch {
            Scratch::Temp(t) => t.path(),
            Scratch::Staged(s) => s.dir.pinned(),
            Scratch::Bundle(d) => d.pinned(),
        }
    }

    /// `e` with the scratch directory named by its own path where [`Harness::dir`] is a handle's
    /// `/proc/self/fd/N` (a bundle being staged or read back).
    pub fn unpin(&self, e: Error) -> Error {
        match &self.scratch {
            Scratch::Temp(_) => e,
            Scratch::Staged(s) => unpin(&s.dir, e),
            Scratch::Bundle(d) => unpin(d, e),
        }
    }

    /// Read the file `name` of the scratch directory, at most
    /// [`crate::util::HARNESS_OUTPUT`] bytes: beneath the bundle directory's handle when reading
    /// one back (a link out of it refused), by path otherwise.
    ///
    /// # Errors
    /// Input naming the file: missing, not a regular file, too large, or leading outside.
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        match &self.scratch {
            Scratch::Bundle(d) => {
                let bytes = d.read(Path::new(name), &crate::util::HARNESS_OUTPUT)?;
                if let Some(a) = &self.attested {
                    a.check(name, &bytes)?;
                }
                Ok(bytes)
            }
            _ => crate::util::read_regular(&self.path(name), &crate::util::HARNESS_OUTPUT).map_err(|e| self.unpin(e)),
        }
    }

    /// The tensors of the harness output file `path` (in the scratch directory, as
    /// [`Harness::path`] gives it), read as [`Harness::read`] reads.
    ///
    /// # Errors
    /// As [`Harness::read`]; Internal when it is not a safetensors file.
    pub fn output_words(
        &self,
        path: &Path,
    ) -> Result<(harness::Metadata, std::collections::HashMap<String, Vec<u32>>)> {
        let name = path.strip_prefix(self.dir()).unwrap_or(path).to_string_lossy().into_owned();
        let shown = match &self.scratch {
            Scratch::Bundle(d) => d.path().join(&name),
            _ => path.to_path_buf(),
        };
        harness::tensor_words(&self.read(&name)?, &shown)
    }

    /// Write the new file `name` into the scratch directory and return its path: created with
    /// `O_EXCL`, so a name already there (a symlink planted in a bundle's staging directory
    /// included) is an error, never written through.
    ///
    /// # Errors
    /// Usage or Internal naming the file; Internal for a bundle being read back.
    pub fn write_new(&self, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        match &self.scratch {
            Scratch::Temp(_) => {
                use std::io::Write;
                let path = self.path(name);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .and_then(|mut f| f.write_all(bytes))
                    .map_err(|e| Error::internal(format!("{}: {e}", path.display())))?;
            }
            Scratch::Staged(s) => s.dir.write_new(Path::new(name), bytes).map_err(|e| unpin(&s.dir, e))?,
            Scratch::Bundle(_) => return Err(Error::internal("nothing is written into a bundle being read back")),
        }
        Ok(self.path(name))
    }

    /// Create the new directory `name` in the scratch directory (a name already there, a
    /// symlink included, is an error).
    ///
    /// # Errors
    /// Usage or Internal naming the directory.
    pub fn create_dir(&self, name: &str) -> Result<PathBuf> {
        match &self.scratch {
            Scratch::Temp(_) => std::fs::create_dir(self.path(name))
                .map_err(|e| Error::internal(format!("{}: {e}", self.path(name).display())))?,
            Scratch::Staged(s) => s.dir.create_dir(Path::new(name)).map_err(|e| unpin(&s.dir, e))?,
            Scratch::Bundle(_) => return Err(Error::internal("nothing is written into a bundle being read back")),
        }
        Ok(self.path(name))
    }

    /// A path in the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir().join(name)
    }

    /// The path of the output file `name` the harness is to write: in a bundle, its name carries
    /// the bundle's nonce ([`bundle::output_name`]), so outputs copied from another bundle are not
    /// found.
    pub fn output(&self, name: &str) -> PathBuf {
        match &self.nonce {
            Some(n) => self.path(&bundle::output_name(name, n)),
            None => self.path(name),
        }
    }
}

/// What [`Gate::exchange`] got.
pub enum Exchange {
    /// The commands ran (here, or on the device machine for a bundle read back), in order; a
    /// command after a failed one did not run and is absent.
    Ran(Vec<Called>),
    /// The commands were written to a bundle; nothing ran.
    Written(BundleWritten),
}

/// A bundle written by a gate: not a verdict.
#[derive(Debug, Clone)]
pub struct BundleWritten {
    /// The bundle directory.
    pub dir: PathBuf,
    /// Requests in it.
    pub requests: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Whether the model was copied in (else `bundle run --model DIR` must name it).
    pub model_copied: bool,
}

impl BundleWritten {
    /// What a gate reports for it: not run, and how to run and compare it.
    pub fn text(&self, tool: &str) -> String {
        format!(
            "not run: bundle written to {} ({} request(s), {} bytes{}); run `metainfer bundle run {}{}` on the machine with the device, then call {tool} again with from_bundle = {}",
            self.dir.display(),
            self.requests,
            self.bytes,
            if self.model_copied { ", model included" } else { "" },
            self.dir.display(),
            if self.model_copied { "" } else { " --model DIR" },
            self.dir.display()
        )
    }
}

/// The gate's text for a harness that found no device (`Reply::NoDevice`), None otherwise.
pub fn no_device(called: &Called) -> Option<String> {
    match &called.reply {
        Ok(crate::harness::protocol::Reply::NoDevice { reason }) => Some(format!("no CUDA device: not run ({reason})")),
        _ => None,
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
    /// Where the harness runs (direct, or a bundle written or read back).
    pub mode: Mode,
    /// The manifest of the bundle read back ([`Mode::Read`]).
    pub bundle: Option<bundle::BundleManifest>,
    /// The bundle's nonce (written or read back).
    pub nonce: Option<String>,
    /// A bundle read back: the trusted runner's signature, or why there is none (the verdict is
    /// then unattested evidence).
    pub attestation: Option<std::result::Result<crate::harness::attest::Attested, String>>,
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
    /// [`crate::error::ErrorKind::Usage`]: both given; a path outside the workspace; a non-empty
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
                let trusted = crate::ledger::Ledger::open(&self.ctx.ledger)?.runners()?;
                let attestation = crate::harness::attest::verify(&held, &m.nonce, &trusted);
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
    /// [`crate::error::ErrorKind::Usage`] when `requested` differs from the bundle's.
    pub fn draw_seed(&mut self, requested: Option<u64>) -> Result<u64> {
        let seed = match (&self.bundle, requested) {
            (Some(b), Some(r)) if b.seed != Some(r) => {
                return Err(Error::usage(format!("the bundle was drawn with seed {:?}, not {r}; omit seed", b.seed)));
            }
            (Some(b), _) => b.seed.unwrap_or_else(crate::util::fresh_seed),
            (None, r) => r.unwrap_or_else(crate::util::fresh_seed),
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
        let bundle = match &self.mode {
            Mode::Read(d) => d.path().display().to_string(),
            _ => String::new(),
        };
        let attestation = match &self.attestation {
            Some(Ok(a)) => format!("{}{}", crate::ledger::figures::ATTESTED_PREFIX, a.runner),
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
                let written = self.write_bundle(&h, commands, model, dest)?;
                Ok((h, Exchange::Written(written)))
            }
        }
    }

    /// A bundle read back must hold exactly what this call would send: the same requests (with
    /// the same environment) and the same model, by hash.
    fn check_bundle(
        &self,
        dir: &Dir,
        commands: &[(Command, Vec<(&str, String)>)],
        model: Option<&dyn Files>,
    ) -> Result<()> {
        let m = self.bundle.as_ref().ok_or_else(|| Error::internal("reading a bundle without its manifest"))?;
        if m.requests.len() != commands.len() {
            return Err(Error::usage(format!(
                "{} holds {} request(s), this call sends {}: the bundle was altered or written by another metainfer",
                dir.path().display(),
                m.requests.len(),
                commands.len()
            )));
        }
        for (i, ((c, env), r)) in commands.iter().zip(&m.requests).enumerate() {
            let held = bundle::read_request(dir, i)?;
            let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
            let sends = bundle::relative(c.clone(), dir.pinned());
            let differs = if held.command != sends {
                let as_json = |c: &Command| serde_json::to_value(c).unwrap_or_default();
                Some(first_difference(&as_json(&held.command), &as_json(&sends), "command"))
            } else if r.env != env {
                Some(format!("environment (bundle {:?}, this call {env:?})", r.env))
            } else {
                None
            };
            if let Some(what) = differs {
                return Err(Error::usage(format!(
                    "{} is not what this call sends ({what}): call {} with the arguments the bundle was written with (prompts, max_new_tokens, prompt_len, new_tokens, runs, threads, kernels), or write a new bundle",
                    dir.show(Path::new(&bundle::request_file(i))).display(),
                    self.tool.name()
                )));
            }
        }
        match (&m.model, model) {
            (Some(held), Some(here)) => {
                let h = bundle::model_hash(here)?;
                if h != held.sha256 {
                    return Err(Error::usage(format!(
                        "model {} differs from the one the bundle was written with ({}): judge it against that model",
                        here.path().display(),
                        held.source
                    )));
                }
            }
            (None, None) => {}
            _ => {
                return Err(Error::usage(format!(
                    "{}: the bundle's model entry does not fit this call",
                    dir.path().display()
                )));
            }
        }
        Ok(())
    }

    fn write_bundle(
        &self,
        h: &Harness,
        commands: Vec<(Command, Vec<(&str, String)>)>,
        model: Option<&dyn Files>,
        dest: &super::NewDir,
    ) -> Result<BundleWritten> {
        let Scratch::Staged(staging) = &h.scratch else {
            return Err(Error::internal("a bundle is written from its staging directory"));
        };
        let (root, dir) = (h.dir().to_path_buf(), &staging.dir);
        let unpinned = |e: Error| unpin(dir, e);
        let hash = |name: &str, limit: &crate::util::Limit| -> Result<String> {
            use sha2::Digest;
            let mut f = dir.open(name, limit)?;
            let mut h = sha2::Sha256::new();
            std::io::copy(&mut f, &mut h)
                .map_err(|e| Error::internal(format!("{}: {e}", dir.show(Path::new(name)).display())))?;
            Ok(format!("{:x}", h.finalize()))
        };
        // Inputs first (everything the gate drew into the scratch directory), by file name.
        let mut inputs = std::collections::BTreeMap::new();
        for (name, e) in dir.listing() {
            if e == crate::beneath::Entry::File {
                let sha = hash(&name, &crate::util::HARNESS_OUTPUT)?;
                inputs.insert(name, sha);
            }
        }
        // The harness executable: a new file (nothing planted in its place is written through),
        // executable.
        {
            use std::os::unix::fs::PermissionsExt;
            let mut from =
                std::fs::File::open(&h.exe).map_err(|e| Error::internal(format!("{}: {e}", h.exe.display())))?;
            let mut to = dir.create_new_file(Path::new(bundle::HARNESS)).map_err(unpinned)?;
            std::io::copy(&mut from, &mut to)
                .and_then(|_| to.set_permissions(std::fs::Permissions::from_mode(0o755)))
                .map_err(|e| Error::internal(format!("{}: {e}", dir.show(Path::new(bundle::HARNESS)).display())))?;
        }
        let model_entry = match model {
            Some(m) => {
                let copied = bundle::model_bytes(m)? <= bundle::MAX_COPIED_MODEL;
                if copied {
                    bundle::copy_model(m, dir, bundle::MODEL).map_err(unpinned)?;
                }
                Some(bundle::BundleModel {
                    copied,
                    sha256: bundle::model_hash(m)?,
                    source: m.path().display().to_string(),
                })
            }
            None => None,
        };
        let mut requests = Vec::new();
        for (i, (c, env)) in commands.into_iter().enumerate() {
            let command = bundle::relative(c, &root);
            let req = Request { version: VERSION, reply: bundle::reply_file(i).into(), command };
            let text = serde_json::to_vec_pretty(&req).map_err(|e| Error::internal(format!("bundle request: {e}")))?;
            dir.write_new(Path::new(&bundle::request_file(i)), &text).map_err(unpinned)?;
            requests.push(bundle::BundleRequest {
                request: bundle::request_file(i),
                env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            });
        }
        let manifest = bundle::BundleManifest {
            format: bundle::FORMAT,
            tool: self.tool.name().into(),
            engine: self.engine.dir.display().to_string(),
            engine_hash: self.engine.hash.clone(),
            dtype: self.target.dtype.clone(),
            target: self.target.target.clone(),
            platform: self.target.platform.clone(),
            seed: self.seed,
            protocol: VERSION,
            nonce: self.nonce.clone().ok_or_else(|| Error::internal("a bundle written without its nonce"))?,
            harness_sha256: hash(bundle::HARNESS, &crate::util::MODEL_FILE)?,
            requests,
            inputs,
            model: model_entry.clone(),
            written: crate::ledger::now_rfc3339(),
        };
        let text =
            serde_json::to_vec_pretty(&manifest).map_err(|e| Error::internal(format!("bundle manifest: {e}")))?;
        dir.write_new(Path::new(bundle::MANIFEST), &text).map_err(unpinned)?;
        let bytes: u64 = walkdir::WalkDir::new(&root)
            .into_iter()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_file())
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .sum();
        // Complete: move the staged directory into place (an empty destination is replaced).
        let name = dest.rest.file_name().ok_or_else(|| Error::internal("a bundle destination without a name"))?;
        staging.commit(name)?;
        Ok(BundleWritten {
            dir: dest.path(),
            requests: manifest.requests.len(),
            bytes,
            model_copied: model_entry.is_some_and(|m| m.copied),
        })
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
    pub fn attested(&self) -> Option<&crate::harness::attest::Attested> {
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

/// Where two JSON values first differ, as `path: held X, sent Y` (values cut to 120 characters),
/// for a bundle request that does not match the call reading it back.
fn first_difference(held: &serde_json::Value, sent: &serde_json::Value, path: &str) -> String {
    use serde_json::Value;
    match (held, sent) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let (x, y) = (a.get(k).unwrap_or(&Value::Null), b.get(k).unwrap_or(&Value::Null));
                if x != y {
                    return first_difference(x, y, &format!("{path}.{k}"));
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                if x != y {
                    return first_difference(x, y, &format!("{path}[{i}]"));
                }
            }
        }
        _ => {}
    }
    let cut = |v: &Value| v.to_string().chars().take(120).collect::<String>();
    format!("{path}: bundle {}, this call {}", cut(held), cut(sent))
}

#[cfg(test)]
mod tests {
    use super::first_difference;
    use serde_json::json;

    #[test]
    fn first_difference_names_the_innermost_differing_field() {
        let held = json!({"command": "generate", "prompts": [{"text": "a", "max_new_tokens": 8}], "model": "model"});
        let sent = json!({"command": "generate", "prompts": [{"text": "a", "max_new_tokens": 9}], "model": "model"});
        assert_eq!(
            first_difference(&held, &sent, "command"),
            "command.prompts[0].max_new_tokens: bundle 8, this call 9"
        );
        // Lists of different lengths are shown whole; a key only one side has is compared with null.
        assert_eq!(first_difference(&json!([1]), &json!([1, 2]), "c"), "c: bundle [1], this call [1,2]");
        assert_eq!(first_difference(&json!({"a": 1}), &json!({}), "c"), "c.a: bundle 1, this call null");
    }

    #[test]
    fn an_unfinished_bundle_leaves_no_folder_it_created() {
        use super::{Dir, Path, Staging};
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("kept")).unwrap();
        let base = Dir::open(t.path()).unwrap();
        // Dropped before its commit: the staging directory and the folders made for it go; a folder
        // that was there stays.
        let s = Staging::new(&base, Path::new("kept/new/deeper")).unwrap();
        assert!(t.path().join("kept/new/deeper").join(&s.name).is_dir());
        drop(s);
        assert!(t.path().join("kept").is_dir() && !t.path().join("kept/new").exists());
        // Committed: everything stays, under the destination's name.
        let s = Staging::new(&base, Path::new("a/b")).unwrap();
        s.dir.write_new(Path::new("f"), b"F").unwrap();
        s.commit(std::ffi::OsStr::new("bundle")).unwrap();
        drop(s);
        assert_eq!(std::fs::read(t.path().join("a/b/bundle/f")).unwrap(), b"F");
    }
}
