//! One module per skill. Plain functions over typed requests returning typed reports; the MCP server
//! and the CLI both call these. A failed gate is a report with `passed = false`, never an `Err`.
//!
//! Depends on ckb, manifest, model, oracle, guard, harness, ledger, probe, beneath, stats and util;
//! knows nothing of MCP (tidy). Here: [`Ctx`] (the context every operation runs in: the CKB, the
//! workshop, the ledger, the confinement of paths), [`Target`] and [`Report`], the shared types.
//!
//! The skills: plan (plan_engine), lookup (lookup_contract), scaffold (scaffold_engine), compile
//! (compile_engine), kernel_test (run_kernel_test), verify (verify_generation), profile
//! (profile_engine), batching (verify_batching), serve (serve_engine), rules (check_rules), outcomes
//! (list_outcomes), report (ckb_report), machine (probe_machine), evolve (evolve_knowledge,
//! propose_contract, and promotion: `ckb promote`, and after a passing gate), and for the CLI ckb_check
//! (`ckb check`), conformance (`ckb conformance`), reference (`reference add|list`), bundle
//! (`bundle run`) and synth (random-weight checkpoints). Shared by them (tidy's `SHARED`): gate (the
//! gate run loop), checkpoint (a model directory read once per gate), page (lists cut to the output
//! bound, with keyset cursors) and preconditions (what config.json may contradict in a family's graph);
//! localise serves verify. Each module's doc says the rest.

pub mod batching;
pub mod bundle;
pub mod checkpoint;
pub mod ckb_check;
pub mod compile;
pub mod conformance;
pub mod evolve;
pub mod gate;
pub mod kernel_test;
pub mod localise;
pub mod lookup;
pub mod machine;
pub mod outcomes;
pub mod page;
pub mod perplexity;
pub mod plan;
pub mod preconditions;
pub mod profile;
pub mod reference;
pub mod report;
pub mod rules;
pub mod scaffold;
pub mod serve;
pub mod synth;
pub mod verify;

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use base::beneath::{Dir, HeldDir};
use base::error::{Context, Error, Result};
use ckb::Ckb;
use harness::Workshop;
use ledger::{Ledger, Outcome};

/// Everything an operation needs from its surroundings.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// The knowledge base.
    pub ckb: Ckb,
    /// Build cache and harness location.
    pub workshop: Workshop,
    /// Ledger database file.
    pub ledger: PathBuf,
    /// When set, every path argument must resolve inside it (or inside `models`).
    pub workspace: Option<PathBuf>,
    /// Extra directories model paths may lie in.
    pub models: Vec<PathBuf>,
    /// Default time limit of a long operation, seconds.
    pub time_limit_s: u64,
    /// Largest text content of one tool result, characters.
    pub max_output: usize,
    /// Who is calling (`name/version` of the MCP client, or `cli`), recorded with every outcome.
    pub client: std::sync::Arc<std::sync::RwLock<String>>,
    /// The CKB working copy (`--ckb DIR`), where promotions are written; None for the built-in CKB.
    pub ckb_dir: Option<PathBuf>,
}

impl Ctx {
    /// What no sandboxed process may reach ([`harness::Workshop::protected`]): the ledger, its
    /// HMAC key, the ledger's directory (the data directory), the CKB working copy and the
    /// candidates directory.
    pub fn protected_paths(&self) -> Vec<PathBuf> {
        let mut out = vec![self.ledger.clone(), ledger::key_path(&self.ledger)];
        out.extend(self.ledger.parent().filter(|p| !p.as_os_str().is_empty()).map(Path::to_path_buf));
        out.extend(self.ckb_dir.clone());
        out.push(self.candidates_dir());
        out
    }

    /// Where candidate contracts are staged: `<ckb>/candidates` for a working copy, else beside the
    /// ledger (`candidates/`), else (a ledger named without a directory) in the per-user data
    /// directory beside the default ledger: never the server's working directory. Candidates are
    /// never part of the CKB until promoted.
    pub fn candidates_dir(&self) -> PathBuf {
        match (&self.ckb_dir, self.ledger.parent().filter(|p| p.is_absolute())) {
            (Some(d), _) => d.join("candidates"),
            (None, Some(p)) => p.join("candidates"),
            (None, None) => {
                let data = dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("metainfer");
                data.join("candidates")
            }
        }
    }

    /// This context with the knowledge base the gates route by: the CKB as it is now (a working copy
    /// is re-read when its files changed, so a promotion made by this process counts at once) plus
    /// the staged candidates that may route before promotion, provisionally: new model and platform
    /// contracts ([`Ckb::with_candidates`]). Plans, scaffolds, gates and synth use it, so an agent can
    /// build and test an engine under its own proposal; outcomes record the candidate as
    /// `id@version`, which is the evidence that promotes it.
    ///
    /// Borrows `self` when nothing changed and nothing is staged. A working copy that became invalid
    /// on disk, or a candidate that does not validate, is left out with a warning on stderr.
    pub fn live(&self) -> std::borrow::Cow<'_, Ctx> {
        use std::borrow::Cow;
        let dir = self.candidates_dir();
        // Only model and platform candidates route; evolution's failure-mode candidates wait.
        let routes = |text: &str| {
            toml::from_str::<toml::Table>(text)
                .ok()
                .and_then(|t| t.get("kind").and_then(|k| k.as_str()).map(|k| k == "model" || k == "platform"))
                .unwrap_or(false)
        };
        let candidates: Vec<(String, String)> = if dir.is_dir() {
            ckb::read_dir_files(&dir).unwrap_or_default().into_iter().filter(|(_, t)| routes(t)).collect()
        } else {
            vec![]
        };
        let files = match &self.ckb_dir {
            Some(d) => match ckb::read_dir_files(d) {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!("CKB working copy not re-read: {e}");
                    return Cow::Borrowed(self);
                }
            },
            None if candidates.is_empty() => return Cow::Borrowed(self),
            None => ckb::embedded_files(),
        };
        if candidates.is_empty() && ckb::fingerprint(&files) == self.ckb.fingerprint() {
            return Cow::Borrowed(self);
        }
        match Ckb::with_candidates(files, candidates, self.ckb.origin.clone(), Some(&oracle::implemented())) {
            Ok((ckb, left_out)) => {
                for f in left_out {
                    tracing::warn!("staged candidate not used for routing: {f}");
                }
                Cow::Owned(Ctx { ckb, ..self.clone() })
            }
            Err(e) => {
                tracing::warn!("CKB on disk is invalid, using the one loaded at start: {e}");
                Cow::Borrowed(self)
            }
        }
    }
}

/// What one gate call builds and checks, from the engine's `metainfer.toml` (written by scaffold)
/// and the request's `dtype`: the model family, the weight dtype, the Cargo features that build the
/// engine for that dtype (`[dtype_features]`), and the kernel contracts it implements.
#[derive(Debug, Clone)]
pub struct Target {
    /// Model-family contract id (`family`, default `model.llama`).
    pub family: String,
    /// Weight dtype (`dtype`, default `f32`; a request may pick another one the engine declares).
    pub dtype: String,
    /// Target platform name (`target`, default `cpu`).
    pub target: String,
    /// Platform contract id for `target`, when the knowledge base (or a provisional candidate) has one.
    pub platform: Option<String>,
    /// Harness arms and engine features.
    pub spec: harness::HarnessSpec,
    /// Serving constraints (`[serving]` of metainfer.toml), when the engine serves.
    pub serving: Option<manifest::Serving>,
    /// Component contracts the serving constraints add ([`SERVING_COMPONENTS`]), empty without them.
    pub components: Vec<String>,
}

/// Component contracts an engine with serving constraints implements besides its family's.
pub const SERVING_COMPONENTS: [&str; 4] =
    ["component.block_manager", "component.batched_step", "component.scheduler", "component.openai_server"];

/// Kernel contracts serving constraints add to a family's: paged attention always, the sampler
/// when requests may sample (greedy serving uses the family's argmax).
pub fn serving_kernels(s: &manifest::Serving) -> Vec<&'static str> {
    let mut k = vec!["kernel.paged_attention"];
    if s.sampling {
        k.push("kernel.sample");
    }
    k
}

/// The harness arm of a kernel contract for an engine of platform api `api` (`host` or `cuda`),
/// from the kernel registry.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when no oracle implements the kernel, or it has no CUDA arm
/// and `api` is `cuda`.
pub fn arm(kernel: &str, api: &str) -> Result<harness::Arm> {
    let k = oracle::kernels::get(kernel).ok_or_else(|| {
        Error::usage(format!(
            "no oracle implements `{kernel}`, so the harness cannot test it; kernels with an oracle: {}",
            oracle::kernels::ids().collect::<Vec<_>>().join(", ")
        ))
    })?;
    let (test, timed) = if api == ckb::API_CUDA {
        if k.cuda_test_arm.is_empty() {
            return Err(Error::usage(format!(
                "`{kernel}` has no CUDA signature (its contract has no [cuda] section), so a CUDA engine cannot be tested on it"
            )));
        }
        (k.cuda_test_arm, k.cuda_timed_arm)
    } else {
        (k.test_arm, k.timed_arm)
    };
    Ok(harness::Arm { kernel: k.id.to_string(), test: test.to_string(), timed: timed.to_string() })
}

impl Ctx {
    /// Resolve the target of a gate call on `engine` from its manifest. `dtype`: the request's, or
    /// None for the engine's own.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] when the manifest names a family the knowledge base does not
    /// have, or the engine does not declare the requested dtype; the message says what to add.
    pub fn target(&self, engine: &harness::Engine, dtype: Option<&str>) -> Result<Target> {
        let m = &engine.manifest;
        let path = engine.dir.join(manifest::FILE);
        let dtype = dtype.unwrap_or(&m.dtype).to_string();
        let features = m.features_for(&dtype).ok_or_else(|| {
            Error::usage(format!(
                "engine {} is built for dtype {} (metainfer.toml); to test it at `{dtype}`, add `{dtype} = [\"<cargo feature>\"]` under [dtype_features] in its metainfer.toml",
                engine.dir.display(),
                m.dtypes().join(", ")
            ))
        })?;
        let fam = self.ckb.get(&m.family).map_err(|e| {
            Error::usage(format!(
                "{}: key `family` = {:?} is not in the knowledge base ({e}); run plan_engine for the model's family",
                path.display(),
                m.family
            ))
        })?;
        let mut kernels = self.ckb.kernels_for(fam, &dtype).map_err(Error::usage)?;
        let platform = self
            .ckb
            .platform_of(&m.target, m.platform.as_deref())
            .map_err(|e| Error::usage(format!("{}: {e} (key `platform`)", path.display())))?;
        let api = platform
            .and_then(|p| p.platform.as_ref())
            .map(|p| p.api.clone())
            .unwrap_or_else(|| ckb::API_HOST.to_string());
        let mut components = Vec::new();
        if let Some(s) = &m.serving {
            for k in serving_kernels(s) {
                if !kernels.iter().any(|x| x == k) {
                    kernels.push(k.to_string());
                }
            }
            components.extend(SERVING_COMPONENTS.iter().filter(|c| self.ckb.get(c).is_ok()).map(|c| c.to_string()));
        }
        let arms = kernels.iter().map(|k| arm(k, &api)).collect::<Result<Vec<_>>>()?;
        let items = optional_items(&self.ckb, fam, &engine.build_dir);
        Ok(Target {
            family: m.family.clone(),
            dtype,
            target: m.target.clone(),
            platform: platform.map(|p| p.id.clone()),
            spec: harness::HarnessSpec {
                kernels,
                arms,
                features,
                items,
                api,
                serving: m.serving.is_some(),
                incremental: false,
            },
            serving: m.serving.clone(),
            components,
        })
    }
}

/// The optional skeleton items (`rust.optional` of the family's contracts and components) the engine
/// in `dir` defines, so that the harness calls them; an engine scaffolded before an item existed
/// lacks it and keeps building.
fn optional_items(ckb: &Ckb, family: &ckb::Contract, dir: &Path) -> Vec<String> {
    let m = family.model.as_ref();
    let ids = std::iter::once(&family.id).chain(m.into_iter().flat_map(|m| m.components.iter()));
    let mut items = Vec::new();
    for c in ids.filter_map(|id| ckb.get(id).ok()) {
        let Some(rust) = &c.rust else { continue };
        if rust.optional.is_empty() {
            continue;
        }
        let text = std::fs::read_to_string(dir.join("src").join(format!("{}.rs", rust.module))).unwrap_or_default();
        for name in &rust.optional {
            if guard::signatures::defines_fn(&text, name) && !items.contains(name) {
                items.push(name.clone());
            }
        }
    }
    items
}

/// A directory to be created, resolved once ([`Ctx::confine_new`]): its nearest existing ancestor
/// as a handle, and the plain names below it.
#[derive(Debug, Clone)]
pub struct NewDir {
    /// The nearest existing ancestor of the directory's parent.
    pub base: Dir,
    /// The directory relative to `base`: plain names, the last one the directory's own.
    pub rest: PathBuf,
}

impl NewDir {
    /// The directory's absolute path (for messages and reports).
    pub fn path(&self) -> PathBuf {
        self.base.show(&self.rest)
    }
}

/// What every report can say about itself.
pub trait Report: Serialize {
    /// Whether the check passed (decides exit status 0 or 1).
    fn passed(&self) -> bool;
    /// A text rendering useful on its own (MCP text content, CLI output without --json).
    fn text(&self) -> String;
    /// Whether the call wrote a bundle to run elsewhere instead of a verdict (`write_bundle`): no
    /// pass and no failure; the CLI exits 0 for it.
    fn bundle_written(&self) -> bool {
        false
    }
}

pub use manifest::ReferenceLevel;

impl Report for probe::MachineProbe {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        self.table()
    }
}

impl Ctx {
    /// The directories path arguments may lie in, opened: the workspace, then the model
    /// directories. Empty without a workspace (nothing is confined).
    fn roots(&self) -> Vec<Dir> {
        let Some(ws) = &self.workspace else { return vec![] };
        std::iter::once(ws).chain(&self.models).filter_map(|r| Dir::open(r).ok()).collect()
    }

    /// The root `path` (absolute) lies in and `path` relative to it: lexically (as given, or under
    /// the root's resolved path), else after resolving `path`'s symlinks. The relative path is only
    /// a name: the caller opens it beneath the root, which refuses whatever leads out of it.
    fn under_root<'r>(roots: &'r [Dir], path: &Path, given: &[PathBuf]) -> Option<(&'r Dir, PathBuf)> {
        for (i, r) in roots.iter().enumerate() {
            for base in [r.path(), given.get(i).map(PathBuf::as_path).unwrap_or(r.path())] {
                if let Ok(rel) = path.strip_prefix(base) {
                    return Some((r, rel.to_path_buf()));
                }
            }
        }
        let real = path.canonicalize().ok()?;
        roots.iter().find_map(|r| real.strip_prefix(r.path()).ok().map(|rel| (r, rel.to_path_buf())))
    }

    /// Resolve the directory a path argument names (a leading `~` is `$HOME`, as a shell would
    /// expand it), once, to a handle ([`Dir`]): every later
    /// access goes through the handle, so a directory swapped for a symlink after this call cannot
    /// redirect it. With a workspace the directory is opened beneath the workspace or a model
    /// directory (a relative path is taken relative to the workspace), and a symlink or `..` that
    /// leads out of that root is refused; without one, `path` is opened as it is (relative to the
    /// current directory).
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Usage`] naming the path and the allowed roots: missing, not a
    /// directory, outside them, or leading out of them through a symlink.
    pub fn confine(&self, path: &Path) -> Result<Dir> {
        Ok(self.confine_in(path)?.0)
    }

    /// [`Ctx::confine`], and the root it was opened beneath with its path relative to that root
    /// (None without a workspace).
    fn confine_in(&self, path: &Path) -> Result<(Dir, Option<(Dir, PathBuf)>)> {
        let path = base::util::expand_home(path);
        let Some(ws) = &self.workspace else { return Ok((Dir::open(&path)?, None)) };
        let path = ws.join(path);
        let roots = self.roots();
        let given: Vec<PathBuf> = std::iter::once(ws).chain(&self.models).cloned().collect();
        match Self::under_root(&roots, &path, &given) {
            Some((root, rel)) => Ok((root.open_dir(&rel)?, Some((root.clone(), rel)))),
            None => Err(self.outside(&path, &roots)),
        }
    }

    /// [`Ctx::confine`] for a model directory, with the engine's symlink check: with a workspace,
    /// every symlink in the model directory (two levels deep) must resolve beneath the root the
    /// directory lies in (the workspace or its `--models` directory, so a Hugging Face cache's
    /// links into its `blobs/` work when the cache is that directory). Without a workspace
    /// nothing is confined and links are followed.
    ///
    /// Every later read of the model's files goes through the returned [`HeldDir`] (the model
    /// readers take any [`base::beneath::Files`]), never through the path again.
    ///
    /// # Errors
    /// As [`Ctx::confine`]; Usage naming a link that leads outside (not its target's contents).
    pub fn confine_model(&self, path: &Path) -> Result<HeldDir> {
        let path = &base::util::expand_home(path);
        let (dir, root) = self.confine_in(path).map_err(|e| {
            // A file or a missing path inside the roots gets the model reader's own message (a
            // llama2.c file, a config.json given for its directory, ...) from its type alone:
            // nothing is opened, so a directory swapped in meanwhile is not read.
            let full = self.workspace.as_ref().map(|w| w.join(path)).unwrap_or_else(|| path.to_path_buf());
            if e.message.contains("outside") || full.is_dir() {
                return e;
            }
            base::beneath::Files::check_dir(full.as_path()).err().unwrap_or(e)
        })?;
        let Some((root, rel)) = root else { return Ok(HeldDir::unconfined(dir)) };
        let mut stack = vec![(PathBuf::new(), 0)];
        while let Some((sub, depth)) = stack.pop() {
            for (name, t) in dir.entries(&sub)? {
                let child = sub.join(&name);
                if t.is_dir() && depth < 1 {
                    stack.push((child, depth + 1));
                } else if t.is_symlink() && root.link_target(&rel.join(&child)).leads != base::beneath::Leads::Inside {
                    return Err(Error::usage(format!(
                        "{} is a symlink that leads outside {} (or does not resolve); copy the file into the model directory",
                        dir.show(&child).display(),
                        root.path().display()
                    )));
                }
            }
        }
        Ok(HeldDir::beneath(dir, root, rel))
    }

    /// Resolve a path argument that names a directory to be created (it may exist; then it must be
    /// a directory): the handle of its nearest existing ancestor, opened as [`Ctx::confine`] opens
    /// a directory, and the rest of the path beneath it (plain names only, at least one: the new
    /// directory's own). Nothing is created here.
    ///
    /// # Errors
    /// As [`Ctx::confine`]; also `..` or `.` after a missing directory, or an ancestor that is not
    /// a directory, or the workspace itself (`.`).
    pub fn confine_new(&self, path: &Path) -> Result<NewDir> {
        let path = &base::util::expand_home(path);
        let full = match &self.workspace {
            Some(ws) => ws.join(path),
            None => std::path::absolute(path).usage_ctx(|| path.display().to_string())?,
        };
        if self.workspace.as_ref().is_some_and(|ws| full.components().eq(ws.components())) {
            return Err(Error::usage(format!(
                "{} is the workspace itself; name a new directory beneath it, e.g. `engine`",
                path.display()
            )));
        }
        let name = match full.components().next_back() {
            Some(std::path::Component::Normal(n)) => n.to_owned(),
            _ => return Err(Error::usage(format!("{}: not a usable directory name", path.display()))),
        };
        // The nearest existing ancestor of the parent (symlinks in it resolved by the open below).
        let mut missing = vec![name];
        let mut cur = full.parent().unwrap_or(Path::new("/")).to_path_buf();
        while std::fs::symlink_metadata(&cur).is_err() {
            match (cur.file_name(), cur.parent()) {
                (Some(n), Some(p)) => {
                    missing.push(n.to_owned());
                    cur = p.to_path_buf();
                }
                _ => return Err(Error::usage(format!("{}: not a usable path", path.display()))),
            }
        }
        missing.reverse();
        let rest: PathBuf = missing.iter().collect();
        if rest.components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
            return Err(Error::usage(format!("{}: `..` or `.` after a missing directory", path.display())));
        }
        let base = match &self.workspace {
            None => Dir::open(&cur),
            Some(_) => self.confine(&cur),
        }
        .map_err(|e| Error::usage(format!("{} cannot be created: {}", path.display(), e.message)))?;
        Ok(NewDir { base, rest })
    }

    /// The error for a path outside every root.
    fn outside(&self, path: &Path, roots: &[Dir]) -> Error {
        let mut roots: Vec<PathBuf> = roots.iter().map(|r| r.path().to_path_buf()).collect();
        // A --model-dir that cannot be opened admits nothing: named as such, so the advice to add
        // one is not taken for the one already given.
        roots.extend(self.models.iter().filter(|m| Dir::open(m).is_err()).map(|m| {
            let mut p = m.clone().into_os_string();
            p.push(" (cannot be opened: it admits nothing)");
            PathBuf::from(p)
        }));
        Error::usage(harness::outside_workspace(&path.canonicalize().unwrap_or(path.to_path_buf()), &roots))
    }

    /// Record an outcome in the ledger. A ledger failure is logged, not fatal: the caller's report
    /// still reaches the agent. The engine's manifest is recorded as the constraints, with the dtype
    /// the gate ran at when it ran at another one.
    pub fn record(
        &self,
        tool: &str,
        engine: Option<&harness::Engine>,
        contracts: Vec<String>,
        report: &impl Report,
        figures: ledger::figures::Figures,
        started: Instant,
    ) {
        let summary = report.text().lines().next().unwrap_or_default().to_string();
        let constraints = match engine {
            Some(e) => {
                let mut m = e.manifest.clone();
                if let Some(d) = figures.dtype() {
                    m.dtype = d.to_string();
                }
                m.to_json()
            }
            None => serde_json::json!({}),
        };
        let outcome = Outcome {
            id: ledger::new_id(),
            time: ledger::now_rfc3339(),
            tool: tool.into(),
            engine: engine.map(|e| e.dir.display().to_string()).unwrap_or_default(),
            engine_hash: engine.map(|e| e.hash.clone()).unwrap_or_default(),
            contracts,
            passed: report.passed(),
            summary,
            figures: figures.to_json(),
            reference_level: engine.map(|e| e.manifest.reference_level).unwrap_or_default().name().into(),
            duration_ms: started.elapsed().as_millis() as u64,
            client: self.client.read().map(|c| c.clone()).unwrap_or_default(),
            status: if harness::call_cancelled() { ledger::CANCELLED.into() } else { String::new() },
            constraints,
            imported: false,
            authenticated: false,
        };
        match Ledger::open(&self.ledger).and_then(|l| l.record(&outcome)) {
            Ok(()) => {}
            Err(e) => tracing::warn!("outcome not recorded: {e}"),
        }
    }

    /// Contract ids with versions, as outcomes record them (`kernel.rope@1`).
    pub fn versioned(&self, ids: &[&str]) -> Vec<String> {
        ids.iter().filter_map(|id| self.ckb.get(id).ok()).map(|c| format!("{}@{}", c.id, c.version)).collect()
    }
}

/// Format a float for tables: 3 significant digits in scientific notation.
pub fn sci(x: f64) -> String {
    format!("{x:.2e}")
}

/// Default largest text content of one tool result, in characters (clients cut at about 25k tokens).
pub const MAX_TEXT: usize = 20_000;

/// Bound a text to `max` characters, marking the cut.
pub fn bound_text(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let head: String = s.chars().take(max).collect();
    format!(
        "{head}\n[... truncated: {} more characters; use the structured content or narrower arguments]",
        s.chars().count() - max
    )
}
