//! Cargo builds: cargo as the server runs it, dependencies fetched outside the sandbox, release
//! builds in it with JSON diagnostics, engine binaries, and the engine's dependency graph.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{Budget, Diagnostic, Engine, Exit, Grants, Run, Workshop, parse_messages, run};
use base::error::{Context, Error, Result};

/// `cargo` as the server runs it: `$CARGO` or `cargo` on PATH, started in `cwd` (a server-owned
/// directory, so that no `.cargo/config.toml` an agent wrote above the engine or in the server's
/// working directory is read: such a file can name a `rustc-wrapper` that cargo would run) with
/// compiler wrappers turned off.
pub(super) fn cargo(cwd: &Path, args: Vec<std::ffi::OsString>) -> duct::Expression {
    duct::cmd(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()), args)
        .dir(cwd)
        .env("CARGO_TERM_COLOR", "never")
        .env("RUSTC_WRAPPER", "")
        .env("RUSTC_WORKSPACE_WRAPPER", "")
}

/// Result of a cargo build.
#[derive(Debug, Clone)]
pub struct Build {
    /// Whether cargo succeeded.
    pub ok: bool,
    /// Compiler errors and warnings.
    pub diagnostics: Vec<Diagnostic>,
    /// Executable produced, for binary builds.
    pub executable: Option<PathBuf>,
    /// The process run.
    pub run: Run,
}

impl Workshop {
    /// The directory cargo runs in: the cache root, created if needed (see [`cargo`]).
    pub(super) fn cargo_cwd(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.root).internal_ctx(|| format!("cannot create {}", self.root.display()))?;
        Ok(self.root.clone())
    }

    /// `grants` plus read access to the cargo configuration files cargo itself looks for in the
    /// ancestors of its working directory (`<dir>/.cargo/config.toml` and `<dir>/.cargo/config`, from
    /// the cache root up; cargo's "hierarchical structure" of configuration). They are the server's
    /// user's own files (the engine's own `.cargo/` is never among them: cargo runs from the cache
    /// root, not from the engine); without them a cache placed below such a file fails every build
    /// with "Permission denied".
    pub(super) fn with_cargo_config(&self, mut grants: Grants) -> Grants {
        for dir in self.root.ancestors() {
            for name in ["config.toml", "config"] {
                let p = dir.join(".cargo").join(name);
                if p.is_file() {
                    grants.read.push(p);
                }
            }
        }
        grants
    }

    /// `cargo fetch` of a manifest, outside the sandbox: resolves the dependency graph (writing
    /// Cargo.lock beside the manifest) and downloads crates into the registry. It builds nothing
    /// and runs no code of the engine (no build script, no proc macro), so the builds that follow
    /// can run `--offline` in the sandbox with the registry read-only.
    pub(super) fn fetch(&self, manifest: &Path, path_deps: &[&Path], budget: &Budget) -> Result<Run> {
        // Skipped when the manifest and its lock file, and those of every crate it depends on by
        // path (`path_deps`: a harness's engine), are byte for byte those of this manifest's last
        // successful fetch: nothing new to download (an edit to the engine's sources is the common
        // case, and a fetch costs a cargo start and a resolve). A dependency added to the engine
        // changes its manifest, so the lock file is resolved again here, outside the sandbox, where
        // the sandboxed `--offline` build could not write it.
        let dir = manifest.parent().unwrap_or(Path::new("."));
        let state = || {
            let mut h = Sha256::new();
            for d in std::iter::once(dir).chain(path_deps.iter().copied()) {
                for file in ["Cargo.toml", "Cargo.lock"] {
                    h.update(std::fs::read(d.join(file)).unwrap_or_default());
                    h.update(b"\0");
                }
            }
            format!("{:x}", h.finalize())
        };
        let before = state();
        let marker =
            self.root.join("fetched").join(format!("{:016x}", base::util::fnv1a(&manifest.display().to_string())));
        if std::fs::read_to_string(&marker).is_ok_and(|k| k.lines().any(|l| l == before)) {
            let exit = Exit::Code(Some(0));
            return Ok(Run { exit, stdout: String::new(), stderr: String::new(), seconds: 0.0, sandboxed: false });
        }
        let args = vec!["fetch".into(), "--manifest-path".into(), manifest.as_os_str().to_owned()];
        let fetched = run(cargo(&self.cargo_cwd()?, args), budget)?;
        if fetched.ok() {
            // The state before the fetch and as it left it (it may have written a lock file).
            let _ = std::fs::create_dir_all(self.root.join("fetched"));
            let _ = std::fs::write(&marker, format!("{before}\n{}\n", state()));
        }
        Ok(fetched)
    }

    /// The cargo target directory shared by every build of this server, so dependencies compile once.
    pub fn target_dir(&self) -> PathBuf {
        self.root.join("target")
    }

    /// `cargo build --release --message-format=json` of a manifest into the shared target directory.
    ///
    /// # Errors
    /// When cargo cannot be started.
    pub fn cargo_build(&self, manifest: &Path, budget: &Budget) -> Result<Build> {
        self.cargo_build_reading(manifest, &[], &[], false, budget)
    }

    /// As [`Workshop::cargo_build`], built incrementally into [`Workshop::incremental_target_dir`]
    /// (compile_engine: the same build kind as the correctness gates' harness builds, so the
    /// engine's query cache is warm for both).
    ///
    /// # Errors
    /// As [`Workshop::cargo_build`].
    pub fn cargo_build_incremental(&self, manifest: &Path, budget: &Budget) -> Result<Build> {
        self.cargo_build_reading(manifest, &[], &[], true, budget)
    }

    /// The target directory of incremental release builds (`profile.release.incremental`):
    /// apart from [`Workshop::target_dir`], so the optimised builds timing gates measure are never
    /// incremental ones and the two kinds do not evict each other's artifacts. Measured on the SIMD
    /// example engine (2 cores): a one-line edit rebuilds in 1.5 s incrementally, 6.0 s without.
    pub fn incremental_target_dir(&self) -> PathBuf {
        self.root.join("target-incremental")
    }

    /// [`Workshop::cargo_build`] in the sandbox, which may read the manifest's directory and
    /// `also_read` (the engine snapshot a harness depends on) and write the target directory and a
    /// scratch directory. Dependencies are fetched first, outside the sandbox ([`Workshop::fetch`]);
    /// a fetch that fails is the build's failure.
    pub(super) fn cargo_build_reading(
        &self,
        manifest: &Path,
        also_read: &[&Path],
        extra: &[std::ffi::OsString],
        incremental: bool,
        budget: &Budget,
    ) -> Result<Build> {
        let fetched = self.fetch(manifest, also_read, budget)?;
        if !fetched.ok() {
            return Ok(Build { ok: false, diagnostics: vec![], executable: None, run: fetched });
        }
        let scratch = self.scratch()?;
        let target = if incremental { self.incremental_target_dir() } else { self.target_dir() };
        std::fs::create_dir_all(&target).internal_ctx(|| format!("cannot create {}", target.display()))?;
        let mut grants = Grants::default().write(&target).write(scratch.path());
        grants.tmp = Some(scratch.path().to_path_buf());
        grants.read.push(manifest.parent().unwrap_or(Path::new("/")).to_path_buf());
        grants.read.extend(also_read.iter().map(|p| p.to_path_buf()));
        let mut args = vec![
            "build".into(),
            "--release".into(),
            "--offline".into(),
            "--message-format=json-diagnostic-rendered-ansi".into(),
            "--color=never".into(),
            "--manifest-path".into(),
            manifest.as_os_str().to_owned(),
            "--target-dir".into(),
            target.into_os_string(),
            // Given on the command line, so an engine's own [profile.release] cannot turn it on
            // for the builds profile_engine times.
            "--config".into(),
            format!("profile.release.incremental={incremental}").into(),
        ];
        args.extend(extra.iter().cloned());
        let grants = self.with_cargo_config(grants);
        let run = self.run_sandboxed(cargo(&self.cargo_cwd()?, args), &grants, budget)?;
        let (diagnostics, executable) = parse_messages(&run.stdout);
        Ok(Build { ok: run.ok(), diagnostics, executable, run })
    }

    /// Build the binaries of an engine's snapshot (`cargo build --release --bins`, with `features`),
    /// sandboxed like every build, and copy its last binary into `dest` (the call's scratch): the
    /// build's `executable` is that copy. Binaries of engines with the same package name land on
    /// the same path of the shared target directory, so builds and copies are serialised in this
    /// process and a gate never runs another engine's binary.
    ///
    /// # Errors
    /// When cargo cannot be started, the cache is not writable, or the copy fails.
    pub fn build_engine_binary(
        &self,
        engine: &Engine,
        features: &[String],
        dest: &Path,
        budget: &Budget,
    ) -> Result<Build> {
        static BINARY_BUILDS: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let mut extra: Vec<std::ffi::OsString> = vec!["--bins".into()];
        if !features.is_empty() {
            extra.push("--features".into());
            extra.push(features.join(",").into());
        }
        let _one = BINARY_BUILDS.lock().unwrap_or_else(|p| p.into_inner());
        // Engines with the same package name share one output slot in the target directory, and
        // cargo judges a snapshot fresh by its files' mtimes against that slot's last build: a
        // snapshot written before another engine's build finished would get that engine's binary.
        // When the slot last held another snapshot, this one's files are touched first.
        let marker = self.root.join("last-binary-build");
        let this = engine.build_dir.display().to_string();
        if std::fs::read_to_string(&marker).ok().as_deref() != Some(this.as_str()) {
            let now = std::time::SystemTime::now();
            for e in walkdir::WalkDir::new(&engine.build_dir).into_iter().filter_map(|e| e.ok()) {
                if e.file_type().is_file() {
                    let _ = std::fs::File::options().write(true).open(e.path()).and_then(|f| f.set_modified(now));
                }
            }
        }
        let mut build = self.cargo_build_reading(&engine.build_dir.join("Cargo.toml"), &[], &extra, false, budget)?;
        let _ = base::util::write_atomic(&marker, this.as_bytes());
        if let Some(exe) = build.executable.take().filter(|_| build.ok) {
            let copy = dest.join(exe.file_name().unwrap_or(std::ffi::OsStr::new("engine")));
            std::fs::copy(&exe, &copy)
                .internal_ctx(|| format!("cannot copy {} to {}", exe.display(), copy.display()))?;
            build.executable = Some(copy);
        }
        Ok(build)
    }
}

/// The engine's fully resolved dependency graph (all targets, transitive), from `cargo metadata`
/// run on its snapshot: (name, version) of every package except the engine itself.
///
/// # Errors
/// When cargo cannot resolve the graph (the message carries cargo's).
pub fn dependency_graph(workshop: &Workshop, engine: &Engine, budget: &Budget) -> Result<Vec<(String, String)>> {
    let manifest = engine.build_dir.join("Cargo.toml");
    let fetched = workshop.fetch(&manifest, &[], budget)?;
    if !fetched.ok() {
        return Err(Error::usage(format!(
            "cargo cannot resolve the engine's dependencies: {}",
            fetched.failure_text(2000)
        )));
    }
    let scratch = workshop.scratch()?;
    let grants = workshop.with_cargo_config(
        Grants { tmp: Some(scratch.path().into()), ..Grants::default() }.read(&engine.build_dir).write(scratch.path()),
    );
    let args = vec![
        "metadata".into(),
        "--offline".into(),
        "--format-version".into(),
        "1".into(),
        "--manifest-path".into(),
        manifest.into_os_string(),
    ];
    let r = workshop.run_sandboxed(cargo(&workshop.cargo_cwd()?, args), &grants, budget)?;
    if !r.ok() {
        return Err(Error::usage(format!("cargo cannot resolve the engine's dependencies: {}", r.failure_text(2000))));
    }
    let meta: cargo_metadata::Metadata =
        serde_json::from_str(&r.stdout).internal_ctx(|| "cargo metadata output".to_owned())?;
    let root = meta.root_package().map(|p| p.id.clone());
    Ok(meta
        .packages
        .iter()
        .filter(|p| Some(&p.id) != root.as_ref())
        .map(|p| (p.name.to_string(), p.version.to_string()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// A fetch is skipped only while nothing it resolves changed: a new dependency in a crate the
    /// manifest depends on by path (a harness's engine) makes it run again. Crates with path
    /// dependencies only: cargo resolves them offline. A skipped fetch takes 0 s and no cargo.
    #[test]
    fn a_path_dependency_whose_manifest_changed_is_fetched_again() {
        let tmp = tempfile::tempdir().unwrap();
        let (outer, engine, extra) = (tmp.path().join("harness"), tmp.path().join("engine"), tmp.path().join("extra"));
        let package = |name: &str, deps: &str| {
            format!(
                "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\n{deps}\n[workspace]\n"
            )
        };
        write(&outer.join("Cargo.toml"), &package("outer", &format!("engine = {{ path = {:?} }}", engine)));
        write(&outer.join("src/lib.rs"), "");
        write(&engine.join("Cargo.toml"), &package("engine", ""));
        write(&engine.join("src/lib.rs"), "");
        write(&extra.join("Cargo.toml"), &package("extra", ""));
        write(&extra.join("src/lib.rs"), "");
        let workshop = Workshop::new(tmp.path().join("cache"));
        let budget = Budget::secs(120);
        let fetch = || workshop.fetch(&outer.join("Cargo.toml"), &[engine.as_path()], &budget).unwrap();
        let first = fetch();
        assert!(first.ok() && first.seconds > 0.0, "the first fetch runs cargo: {}", first.stderr);
        assert!(outer.join("Cargo.lock").exists());
        let again = fetch();
        assert!(again.ok() && again.seconds == 0.0, "nothing changed: skipped");
        // The engine gains a dependency: the harness's lock file must be resolved again.
        write(&engine.join("Cargo.toml"), &package("engine", &format!("extra = {{ path = {:?} }}", extra)));
        let after = fetch();
        assert!(after.ok() && after.seconds > 0.0, "the engine's new dependency is fetched");
        let lock = std::fs::read_to_string(outer.join("Cargo.lock")).unwrap();
        assert!(lock.contains("name = \"extra\""), "the lock file names the new dependency:\n{lock}");
        assert_eq!(fetch().seconds, 0.0, "and then skipped again");
    }
}
