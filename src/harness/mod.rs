//! Everything that spawns processes: cargo builds with JSON diagnostics, the generated harness crate,
//! running it with a time limit and cancellation, and bounding what comes back.
//!
//! Invariant: every child is either waited for or killed and reaped before a function returns.

pub mod diagnostics;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

pub use diagnostics::{Diagnostic, parse_messages};

/// The harness source, rewritten before every build so that it cannot drift from the server's copy.
pub const HARNESS_MAIN: &str = include_str!("template/main.rs");

/// Limits of one long operation: a deadline and a cancellation flag shared with the caller.
#[derive(Debug, Clone)]
pub struct Budget {
    /// When the operation must stop.
    pub deadline: Instant,
    /// Set by the caller to cancel; children are killed within about 50 ms.
    pub cancel: Arc<AtomicBool>,
}

impl Budget {
    /// A budget of `secs` seconds from now, not cancelled.
    pub fn secs(secs: u64) -> Budget {
        Budget { deadline: Instant::now() + Duration::from_secs(secs), cancel: Arc::new(AtomicBool::new(false)) }
    }
}

/// How a child process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this status code (None: killed by a signal).
    Code(Option<i32>),
    /// It ran past the budget's deadline and was killed.
    TimedOut,
    /// The caller cancelled and it was killed.
    Cancelled,
}

/// A finished child process.
#[derive(Debug, Clone)]
pub struct Run {
    /// How it ended.
    pub exit: Exit,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
    /// Wall time in seconds.
    pub seconds: f64,
}

impl Run {
    /// Whether it exited with status 0.
    pub fn ok(&self) -> bool {
        self.exit == Exit::Code(Some(0))
    }

    /// A one-paragraph account of a failure: status and the last `max` characters of stderr.
    pub fn failure_text(&self, max: usize) -> String {
        let why = match &self.exit {
            Exit::Code(Some(c)) => format!("exited with status {c}"),
            Exit::Code(None) => "was killed by a signal".into(),
            Exit::TimedOut => "ran past its time limit and was killed".into(),
            Exit::Cancelled => "was cancelled".into(),
        };
        format!("{why}; stderr (tail):\n{}", tail(&self.stderr, max))
    }
}

/// The last `max` characters of `s`, marked when cut.
pub fn tail(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        s.to_string()
    } else {
        let cut: String = s.chars().skip(n - max).collect();
        format!("[... {} characters cut ...]{cut}", n - max)
    }
}

/// Run a command to completion within `budget`, capturing stdout and stderr. The child is killed
/// and reaped on timeout or cancellation.
///
/// # Errors
/// [`crate::error::ErrorKind::Internal`] when the program cannot be started.
pub fn run(expr: duct::Expression, budget: &Budget) -> Result<Run> {
    let start = Instant::now();
    // Each child leads its own process group, so that a kill reaches its descendants too (cargo's
    // rustc and build-script processes, threads or children of an engine).
    let handle = expr
        .before_spawn(|cmd| {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
            Ok(())
        })
        .stdout_capture()
        .stderr_capture()
        .stdin_null()
        .unchecked()
        .start()
        .map_err(|e| Error::internal(format!("cannot start {expr:?}: {e}")))?;
    let stopped = loop {
        match handle.try_wait() {
            Ok(Some(_)) => break None,
            Ok(None) => {}
            Err(e) => return Err(Error::internal(format!("waiting for child: {e}"))),
        }
        if budget.cancel.load(Ordering::Relaxed) {
            break Some(Exit::Cancelled);
        }
        if Instant::now() >= budget.deadline {
            break Some(Exit::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if let Some(exit) = stopped {
        kill_group(&handle);
        return Ok(Run { exit, stdout: String::new(), stderr: String::new(), seconds: start.elapsed().as_secs_f64() });
    }
    let out = handle.wait().map_err(|e| Error::internal(format!("waiting for child: {e}")))?;
    Ok(Run {
        exit: Exit::Code(out.status.code()),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// SIGKILL the child's whole process group, then reap the child.
fn kill_group(handle: &duct::Handle) {
    for pid in handle.pids() {
        // SAFETY: kill(2) with a negative pid signals the process group led by `pid`, which this
        // function's caller created with process_group(0); no memory is touched.
        unsafe {
            libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
        }
    }
    // kill() on an exited child only reaps it.
    let _ = handle.kill();
}

/// What the server knows about an engine crate.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Canonical engine directory.
    pub dir: PathBuf,
    /// Cargo package name.
    pub package: String,
    /// sha256 over Cargo.toml and every file under src/, in path order.
    pub hash: String,
}

/// Inspect an engine directory with `cargo metadata --no-deps`.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] when the directory does not exist or holds no Cargo package
/// with a library target.
pub fn engine_info(dir: &Path) -> Result<Engine> {
    let dir = dir.canonicalize().map_err(|e| {
        Error::usage(format!(
            "engine directory {} cannot be opened ({e}); pass the crate made by `scaffold`",
            dir.display()
        ))
    })?;
    let manifest = dir.join("Cargo.toml");
    if !manifest.is_file() {
        return Err(Error::usage(format!(
            "{} is not a Rust crate (no Cargo.toml); create one with `metainfer scaffold --out DIR`",
            dir.display()
        )));
    }
    let meta = cargo_metadata::MetadataCommand::new()
        .manifest_path(&manifest)
        .no_deps()
        .exec()
        .map_err(|e| Error::usage(format!("{}: cargo cannot read this crate: {e}", manifest.display())))?;
    let pkg = meta.packages.iter().find(|p| p.manifest_path.as_std_path() == manifest).ok_or_else(|| {
        Error::usage(format!("{}: no package found (is it a virtual workspace?)", manifest.display()))
    })?;
    if !pkg.targets.iter().any(|t| t.is_lib()) {
        return Err(Error::usage(format!("{}: the engine must be a library crate (src/lib.rs)", manifest.display())));
    }
    Ok(Engine { package: pkg.name.to_string(), hash: source_hash(&dir)?, dir })
}

/// sha256 over the engine's Cargo.toml and src/ tree (paths and contents, in path order).
///
/// # Errors
/// When a file cannot be read.
pub fn source_hash(dir: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut files = vec![dir.join("Cargo.toml")];
    for e in walkdir::WalkDir::new(dir.join("src")).follow_links(false).sort_by_file_name() {
        let e = e.map_err(|e| Error::input(format!("walking {}: {e}", dir.display())))?;
        if e.file_type().is_file() {
            files.push(e.into_path());
        }
    }
    for f in files {
        let rel = f.strip_prefix(dir).unwrap_or(&f).to_string_lossy().replace('\\', "/");
        let bytes = std::fs::read(&f).map_err(|e| Error::input(format!("{}: {e}", f.display())))?;
        h.update((rel.len() as u64).to_le_bytes());
        h.update(rel.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Server-owned build state: the shared cargo target directory and the harness crates.
#[derive(Debug, Clone)]
pub struct Workshop {
    /// Root of the server's cache (`$METAINFER_CACHE`, else the per-user cache directory).
    pub root: PathBuf,
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
    /// The workshop at `$METAINFER_CACHE` or the per-user cache directory.
    pub fn default_location() -> Workshop {
        let root = std::env::var_os("METAINFER_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("metainfer"));
        Workshop { root }
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
        let expr = duct::cmd(
            std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()),
            [
                "build".into(),
                "--release".into(),
                "--message-format=json-diagnostic-rendered-ansi".into(),
                "--color=never".into(),
                "--manifest-path".into(),
                manifest.as_os_str().to_owned(),
                "--target-dir".into(),
                self.target_dir().into_os_string(),
            ],
        )
        .env("CARGO_TERM_COLOR", "never");
        let run = run(expr, budget)?;
        let (diagnostics, executable) = parse_messages(&run.stdout);
        Ok(Build { ok: run.ok(), diagnostics, executable, run })
    }

    /// Write the harness crate for an engine (outside the engine's sources) and return its manifest.
    ///
    /// # Errors
    /// When the cache directory is not writable.
    pub fn write_harness(&self, engine: &Engine) -> Result<PathBuf> {
        let mut h = Sha256::new();
        h.update(engine.dir.to_string_lossy().as_bytes());
        let key = format!("{:x}", h.finalize());
        let dir = self.root.join("harness").join(&key[..16]);
        std::fs::create_dir_all(dir.join("src"))
            .map_err(|e| Error::internal(format!("cannot create {}: {e}", dir.display())))?;
        let manifest = format!(
            "[package]\nname = \"metainfer-harness\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [dependencies]\nengine = {{ path = {:?}, package = {:?} }}\nsafetensors = \"0.8\"\nserde_json = \"1\"\n\n[workspace]\n",
            engine.dir.to_string_lossy(),
            engine.package
        );
        let write = |p: PathBuf, s: &str| {
            std::fs::write(&p, s).map_err(|e| Error::internal(format!("cannot write {}: {e}", p.display())))
        };
        write(dir.join("Cargo.toml"), &manifest)?;
        write(dir.join("src/main.rs"), HARNESS_MAIN)?;
        Ok(dir.join("Cargo.toml"))
    }

    /// Build the harness for an engine; returns the build, whose `executable` is the harness binary.
    ///
    /// # Errors
    /// When cargo cannot be started or the cache is not writable.
    pub fn build_harness(&self, engine: &Engine, budget: &Budget) -> Result<Build> {
        let manifest = self.write_harness(engine)?;
        self.cargo_build(&manifest, budget)
    }

    /// A fresh scratch directory for one call's files, removed when dropped.
    ///
    /// # Errors
    /// When the cache is not writable.
    pub fn scratch(&self) -> Result<tempfile::TempDir> {
        let dir = self.root.join("scratch");
        std::fs::create_dir_all(&dir).map_err(|e| Error::internal(format!("cannot create {}: {e}", dir.display())))?;
        tempfile::tempdir_in(&dir).map_err(|e| Error::internal(format!("cannot create scratch dir: {e}")))
    }
}

/// Read a safetensors file written by the harness: its metadata and every tensor as raw
/// little-endian 32-bit words (f32 values via `f32::from_bits`, u32 values as they are).
///
/// # Errors
/// [`crate::error::ErrorKind::Internal`] when the file is missing or malformed.
pub fn read_tensor_words(path: &Path) -> Result<(HashMap<String, String>, HashMap<String, Vec<u32>>)> {
    let bytes = std::fs::read(path).map_err(|e| Error::internal(format!("{}: {e}", path.display())))?;
    let bad = |e: safetensors::SafeTensorError| Error::internal(format!("{}: {e}", path.display()));
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(bad)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(bad)?;
    let meta = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let words = view.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        out.insert(name, words);
    }
    Ok((meta, out))
}
