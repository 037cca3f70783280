//! Everything that spawns processes: cargo builds with JSON diagnostics, the generated harness crate,
//! running it with a time limit and cancellation, and bounding what comes back.
//!
//! Invariant: every child is either waited for or killed and reaped before a function returns,
//! and with it every process it started: a sandboxed child is its own reaper
//! ([`sandbox::reaper`]), which kills every process of its sandbox (in whatever session or group)
//! when the child ends, when the server asks it to, or when the server dies. Every live child is
//! in a registry, so that a signal to the server ends them all ([`shutdown`]); agent-written code
//! runs only in the sandbox ([`sandbox`]).

pub mod attest;
pub mod bundle;
pub mod diagnostics;
pub mod explain;
pub mod protocol;
pub mod sandbox;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::beneath::Dir;
use crate::error::{Error, Result};

pub use diagnostics::{Diagnostic, parse_messages};
pub use explain::{explain, figure, outside_workspace, prompts_passed};
pub use sandbox::Grants;

/// The harness source, rewritten before every build so that it cannot drift from the server's copy.
pub const HARNESS_MAIN: &str = include_str!("template/main.rs");

/// The protocol module, compiled into the harness crate verbatim (see [`protocol`]).
pub const HARNESS_PROTOCOL: &str = include_str!("protocol.rs");

/// The harness's `device` module for engines on the host (platform api `host`).
pub const HARNESS_DEVICE_HOST: &str = include_str!("template/device_host.rs");

/// The harness's `device` module for CUDA engines (platform api `cuda`): device probe, device
/// buffers, CUDA-event timers, on-device decoding.
pub const HARNESS_DEVICE_CUDA: &str = include_str!("template/device_cuda.rs");
/// Whether the call running on this thread was cancelled by its client (set by
/// [`Budget::scope`]); outcomes recorded then carry the status `cancelled`.
pub fn call_cancelled() -> bool {
    CALL_CANCEL.with(|c| c.borrow().as_ref().is_some_and(|f| f.load(Ordering::Relaxed)))
}

thread_local! {
    static CALL_CANCEL: std::cell::RefCell<Option<Arc<AtomicBool>>> = const { std::cell::RefCell::new(None) };
}

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

    /// Run `f` on this thread as the call this budget limits, so that [`call_cancelled`] reports
    /// its cancellation (e.g. to the ledger) while it runs.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        CALL_CANCEL.with(|c| *c.borrow_mut() = Some(self.cancel.clone()));
        let r = f();
        CALL_CANCEL.with(|c| *c.borrow_mut() = None);
        r
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
    /// It wrote more than [`MAX_OUTPUT_BYTES`] to stdout or stderr and was killed.
    OutputLimit,
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
    /// Whether it ran in the enforced sandbox ([`Workshop::run_sandboxed`]).
    pub sandboxed: bool,
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
            Exit::OutputLimit => format!("wrote more than {MAX_OUTPUT_BYTES} bytes of output and was killed"),
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

/// Most bytes of output a child may write to stdout or stderr before it is killed.
pub const MAX_OUTPUT_BYTES: u64 = 64 << 20;

/// Run a command to completion within `budget`. Its stdout and stderr go to files in a temporary
/// directory (so a grandchild holding them open cannot stall the wait, and memory stays bounded);
/// a child that writes more than [`MAX_OUTPUT_BYTES`] is killed. The child leads its own process
/// group, which is killed on timeout, cancellation, output overflow and after it exits (so nothing
/// it started lingers).
///
/// # Errors
/// [`crate::error::ErrorKind::Internal`] when the program cannot be started.
pub fn run(expr: duct::Expression, budget: &Budget) -> Result<Run> {
    let start = Instant::now();
    let dir = tempfile::tempdir().map_err(|e| Error::internal(format!("temporary output directory: {e}")))?;
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let expr = expr
        .before_spawn(|cmd| {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
            Ok(())
        })
        // The engine's code (build scripts included) gets no pointer to the server's own state.
        .env_remove("METAINFER_LEDGER")
        .env_remove("METAINFER_CACHE")
        .stdout_path(&out_path)
        .stderr_path(&err_path)
        .stdin_null()
        .unchecked();
    // Start and register under the registry's lock, so that a shutdown either sees this child or
    // prevents it from starting.
    let handle = {
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        if SHUTTING_DOWN.load(Ordering::SeqCst) {
            return Err(Error::internal("the server is shutting down; no process is started"));
        }
        let handle = expr.start().map_err(|e| Error::internal(format!("cannot start {expr:?}: {e}")))?;
        live.extend(handle.pids().into_iter().map(|p| p as i32));
        handle
    };
    let pids: Vec<i32> = handle.pids().into_iter().map(|p| p as i32).collect();
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let mut polls = 0u32;
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
        polls += 1;
        if polls.is_multiple_of(10) && (size(&out_path) > MAX_OUTPUT_BYTES || size(&err_path) > MAX_OUTPUT_BYTES) {
            break Some(Exit::OutputLimit);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    kill_group(&handle);
    LIVE.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| !pids.contains(p));
    let exit = match stopped {
        Some(e) => e,
        None => Exit::Code(handle.try_wait().ok().flatten().and_then(|o| o.status.code())),
    };
    Ok(Run {
        exit,
        stdout: read_bounded(&out_path, MAX_OUTPUT_BYTES),
        stderr: read_tail(&err_path, 64 << 10),
        seconds: start.elapsed().as_secs_f64(),
        sandboxed: false,
    })
}

/// One harness call: the process, and its reply or why there is none.
#[derive(Debug)]
pub struct Called {
    /// How the process ended, its output tails and wall time.
    pub run: Run,
    /// The parsed reply; Err with the reason when the process wrote none or an unreadable one.
    pub reply: std::result::Result<protocol::Reply, String>,
}

impl Called {
    /// The reply when the process exited cleanly and replied; otherwise the failure in words
    /// (`the <what> process exited with status 101; stderr (tail): ...`).
    pub fn ok(self, what: &str, max: usize) -> std::result::Result<protocol::Reply, String> {
        if !self.run.ok() {
            return Err(format!("the {what} process {}", self.run.failure_text(max)));
        }
        self.reply.map_err(|e| format!("the {what} process exited cleanly but its reply is unusable: {e}"))
    }
}

/// Run `program` with `args` (and `env` added) to completion within `budget`, as [`run`] does.
///
/// # Errors
/// As [`run`].
pub fn run_program(
    program: &Path,
    args: &[std::ffi::OsString],
    env: &[(&str, String)],
    budget: &Budget,
) -> Result<Run> {
    let mut cmd = duct::cmd(program, args);
    for (k, v) in env {
        cmd = cmd.env(k, v);
    }
    run(cmd, budget)
}

/// A command that starts `program` as an MCP server child of this process (stdin and stdout are
/// the transport): for the demo's client, which hands it to rmcp's child-process transport. The
/// child leads its own process group, and gets no pointer to the server's state.
pub fn server_command(program: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    cmd.process_group(0).env_remove("METAINFER_LEDGER").env_remove("METAINFER_CACHE").kill_on_drop(true);
    cmd
}

/// A command that starts `program` with `args` as an agent client starts an MCP server: in `dir`,
/// with exactly the environment `env` (nothing inherited), its own process group, killed when
/// dropped. For `doctor`, which checks the setup a client sees.
pub fn client_command(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    dir: &Path,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).env_clear().envs(env.iter().cloned()).current_dir(dir).process_group(0).kill_on_drop(true);
    cmd
}

/// Run `program` with `args` in `dir` with exactly the environment `env` (nothing inherited), to
/// completion within `budget`, as [`run`] does.
///
/// # Errors
/// As [`run`].
pub fn run_with_env(
    program: &Path,
    args: &[&str],
    env: &[(String, String)],
    dir: &Path,
    budget: &Budget,
) -> Result<Run> {
    let vars: std::collections::HashMap<String, String> = env.iter().cloned().collect();
    run(duct::cmd(program, args).full_env(vars).dir(dir), budget)
}

/// Read at most `max` bytes of a file (lossy UTF-8); "" when it is missing.
fn read_bounded(path: &Path, max: u64) -> String {
    use std::io::Read;
    let mut buf = Vec::new();
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.take(max).read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last `max` bytes of a file (lossy UTF-8), marked when cut.
fn read_tail(path: &Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let skip = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(skip)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    if skip > 0 { format!("[... {skip} bytes cut ...]{text}") } else { text }
}

/// Process groups (each led by a child of [`run`]) that are alive now.
static LIVE: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());
/// Set once by [`shutdown`]: no further child is started.
static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);

/// End every live child (SIGTERM to its reaper, then SIGKILL to its process group; see
/// [`kill_group`]) and stop new ones from starting, then wait up to `grace`
/// for the threads that own them to reap them. Returns the number of groups killed. Used when the
/// server receives SIGTERM, SIGINT or SIGHUP ([`exit_on_signals`]).
pub fn shutdown(grace: Duration) -> usize {
    let groups: Vec<i32> = {
        let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        SHUTTING_DOWN.store(true, Ordering::SeqCst);
        live.clone()
    };
    // First each child (a sandboxed one is its reaper: it kills every process of its sandbox,
    // wherever it moved, and exits; its owner reaps it), then whatever groups are left.
    for g in &groups {
        // SAFETY: kill(2) on a child this process started and has not reaped (it is in LIVE).
        unsafe {
            libc::kill(*g, libc::SIGTERM);
        }
    }
    let until = Instant::now() + REAPER_GRACE.min(grace);
    while Instant::now() < until && !LIVE.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
        std::thread::sleep(Duration::from_millis(10));
    }
    for g in &groups {
        // SAFETY: kill(2) with a negative pid signals a process group this process created.
        unsafe {
            libc::kill(-g, libc::SIGKILL);
        }
    }
    let until = Instant::now() + grace;
    while Instant::now() < until && !LIVE.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
        std::thread::sleep(Duration::from_millis(10));
    }
    groups.len()
}

/// Install handlers for SIGTERM, SIGINT and SIGHUP: each kills every live child process group,
/// lets their owners reap them ([`shutdown`], up to 5 s) and exits with 128 + the signal number.
/// Call once, at the start of `main`.
///
/// # Errors
/// When the handlers cannot be installed.
pub fn exit_on_signals() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(|e| Error::internal(format!("cannot install signal handlers: {e}")))?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                TERMINATING.store(sig, Ordering::SeqCst);
                let n = shutdown(Duration::from_secs(5));
                tracing::warn!("signal {sig}: killed {n} child process group(s); exiting");
                std::process::exit(128 + sig);
            }
        })
        .map_err(|e| Error::internal(format!("cannot start the signal thread: {e}")))?;
    Ok(())
}

/// The signal being handled by [`exit_on_signals`], 0 when none.
static TERMINATING: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// When a termination signal arrived, wait here for the signal thread to finish killing the
/// children and exit the process with 128 + the signal: a caller whose child was just killed must
/// not exit first with the failed child's status. Returns at once when no signal arrived.
pub fn wait_if_terminating() {
    if TERMINATING.load(Ordering::SeqCst) != 0 {
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// How long a child's reaper ([`sandbox::reaper`]) gets, after SIGTERM, to kill and reap every
/// process of its sandbox before the server kills the process group itself.
pub const REAPER_GRACE: Duration = Duration::from_secs(2);

/// End a child and everything it started: SIGTERM to the child while it runs (a sandboxed child is
/// its reaper, which then kills every process of its sandbox, in whatever session or group, and
/// exits; waited for up to [`REAPER_GRACE`]), then SIGKILL to its whole process group (all there
/// is to kill where no sandbox is enforced), then reap the child.
fn kill_group(handle: &duct::Handle) {
    if matches!(handle.try_wait(), Ok(None)) {
        for pid in handle.pids() {
            // SAFETY: kill(2) on our own child, which try_wait has not reaped.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
        }
        let until = Instant::now() + REAPER_GRACE;
        while Instant::now() < until && matches!(handle.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    for pid in handle.pids() {
        // SAFETY: kill(2) with a negative pid signals the process group led by `pid`, which this
        // function's caller created with process_group(0); no memory is touched.
        unsafe {
            libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
        }
    }
    // kill() on an exited child only reaps it; an error here means it was already reaped.
    let _ = handle.kill();
}

/// A running engine server started by [`Workshop::start_server`]; dropping it kills its process
/// group and reaps it.
pub struct ServerProcess {
    handle: duct::Handle,
    pids: Vec<i32>,
    err_path: PathBuf,
    /// Whether it runs in the enforced sandbox.
    pub sandboxed: bool,
}

impl ServerProcess {
    /// How it ended, when it has exited (None while it runs).
    pub fn exited(&self) -> Option<Exit> {
        match self.handle.try_wait() {
            Ok(Some(o)) => Some(Exit::Code(o.status.code())),
            Ok(None) => None,
            Err(_) => Some(Exit::Code(None)),
        }
    }

    /// The last `max` bytes of its stderr.
    pub fn stderr_tail(&self, max: u64) -> String {
        read_tail(&self.err_path, max)
    }
}

impl ServerProcess {
    /// End it now (as dropping it does), from any thread: SIGTERM to its reaper, then its group.
    pub fn stop(&self) {
        kill_group(&self.handle);
    }
}

/// Watches a call's budget on behalf of a running server ([`ServerProcess`]): when the deadline
/// passes or the call is cancelled, it stops the server within about 20 ms, so every request to
/// it fails at once instead of waiting out its own timeout. Dropping the watch ends it.
pub struct Watch {
    done: Arc<AtomicBool>,
    fired: Arc<std::sync::Mutex<Option<&'static str>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    /// Start watching `budget` for `server`.
    pub fn start(server: Arc<ServerProcess>, budget: &Budget) -> Watch {
        let done = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(std::sync::Mutex::new(None));
        let (d, f, b) = (done.clone(), fired.clone(), budget.clone());
        let thread = std::thread::Builder::new()
            .name("server-watch".into())
            .spawn(move || {
                while !d.load(Ordering::Relaxed) {
                    let why = if b.cancel.load(Ordering::Relaxed) {
                        Some("the call was cancelled")
                    } else if Instant::now() >= b.deadline {
                        Some("the call's time limit ran out")
                    } else {
                        None
                    };
                    if let Some(why) = why {
                        *f.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                        server.stop();
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
            .ok();
        Watch { done, fired, thread }
    }

    /// Why the server was stopped (cancellation or the time limit), if it was.
    pub fn fired(&self) -> Option<&'static str> {
        *self.fired.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        kill_group(&self.handle);
        LIVE.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| !self.pids.contains(p));
    }
}

/// A TCP port on the loopback interface that was free a moment ago (bound to port 0, then
/// released), for an engine server to listen on.
///
/// # Errors
/// When no socket can be bound.
pub fn free_loopback_port() -> Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| Error::internal(format!("cannot find a free loopback port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| Error::internal(format!("cannot find a free loopback port: {e}")))
}

/// What the server knows about an engine crate.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Canonical engine directory (the agent's), as it was when it was opened: for messages,
    /// outcomes and locks; nothing is read by this path.
    pub dir: PathBuf,
    /// The engine directory's handle: the rules read the engine through it.
    pub root: Dir,
    /// The server's snapshot of it, which is what gets built: content-compared on every call, so
    /// that a file whose modification time was set back still triggers a rebuild, and the sources
    /// cannot change between hashing and building.
    pub build_dir: PathBuf,
    /// Cargo package name.
    pub package: String,
    /// sha256 over every file of the engine (paths and contents, in path order; `target/` and
    /// `.git/` excluded).
    pub hash: String,
    /// Its `metainfer.toml`, parsed and checked.
    pub manifest: crate::manifest::EngineManifest,
}

/// What the harness of one engine calls and how it builds the engine.
#[derive(Debug, Clone, Default)]
pub struct HarnessSpec {
    /// Kernel contract ids whose harness arms are compiled in (the engine must export each one).
    pub kernels: Vec<String>,
    /// Their arms, in the same order.
    pub arms: Vec<Arm>,
    /// Cargo features of the engine crate to enable (its weight-dtype variant).
    pub features: Vec<String>,
    /// Optional engine items the harness calls (a contract's `rust.optional` names the engine
    /// defines, e.g. `stop_tokens`); the others' harness blocks are left out.
    pub items: Vec<String>,
    /// The engine's platform api (`ckb::API_HOST` or `ckb::API_CUDA`): which `device` module the
    /// harness gets, and whether it depends on cudarc. Empty: host.
    pub api: String,
    /// Whether the engine has serving constraints: the harness then compiles its serving commands
    /// (template/serving.rs), which call the engine's block manager and batched step.
    pub serving: bool,
    /// Build incrementally ([`Workshop::incremental_target_dir`]): for the correctness gates, where
    /// a one-line edit should cost a second, not a full optimised rebuild. Timing gates build
    /// without it.
    pub incremental: bool,
}

impl HarnessSpec {
    /// Whether the engine runs on a CUDA device.
    pub fn cuda(&self) -> bool {
        self.api == crate::ckb::API_CUDA
    }
}

/// One kernel's harness code (from the kernel registry, `oracle::kernels`): the block run for a test
/// case and the block that prepares a timed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arm {
    /// Kernel contract id, the arm's match pattern.
    pub kernel: String,
    /// Block evaluating to the case's outputs (see the template's `run_kernel`).
    pub test: String,
    /// Block evaluating to a `Timed` (see the template's `timed_kernel`).
    pub timed: String,
}

/// The serving commands of the harness (a module compiled in only for serving engines).
pub const HARNESS_SERVING: &str = include_str!("template/serving.rs");

/// Marker line of the template where the serving module is declared.
pub const SERVING_MOD: &str = "// @serving mod";
/// Marker line of the template where the serving commands are dispatched.
pub const SERVING_COMMANDS: &str = "// @serving commands";

/// Marker lines of the template where the arms go.
pub const TEST_ARMS: &str = "// @arms test";
/// See [`TEST_ARMS`].
pub const TIMED_ARMS: &str = "// @arms timed";

/// The harness source with exactly the given kernel arms, so an engine need not export kernels its
/// plan does not use: each arm is inserted at the template's [`TEST_ARMS`] / [`TIMED_ARMS`] line.
pub fn harness_source(arms: &[Arm]) -> String {
    harness_source_with(arms, &[], false)
}

/// As [`harness_source`], also keeping the template's blocks `// @item <name>` ... `// @end` of the
/// optional engine items in `items` (a contract's `rust.optional` the engine defines) and leaving
/// out the others.
///
/// With `serving`, the template's [`SERVING_MOD`] line declares the serving module
/// ([`HARNESS_SERVING`], written beside it) and its [`SERVING_COMMANDS`] line dispatches the
/// serving commands to it; without, both lines are dropped and a serving command is refused.
pub fn harness_source_with(arms: &[Arm], items: &[String], serving: bool) -> String {
    let mut out = String::with_capacity(HARNESS_MAIN.len() + arms.len() * 1024);
    let mut keep = true;
    for line in HARNESS_MAIN.lines() {
        let t = line.trim();
        let indent = &line[..line.len() - line.trim_start().len()];
        if t == SERVING_MOD || t == SERVING_COMMANDS {
            if serving && t == SERVING_MOD {
                out.push_str(&format!("{indent}mod serving;\n"));
            } else if serving {
                out.push_str(&format!(
                    "{indent}Command::BlockManager {{ num_blocks, block_size, ops }} => serving::block_manager(*num_blocks, *block_size, ops),\n\
                     {indent}Command::Batch {{ model, num_blocks, block_size, seqs, steps, tensors }} => serving::batch(model, *num_blocks, *block_size, seqs, steps, tensors),\n\
                     {indent}Command::Scheduler {{ num_blocks, block_size, max_seqs, max_batch_tokens, max_context, requests, aborts, max_steps }} => serving::scheduler(*num_blocks, *block_size, *max_seqs, *max_batch_tokens, *max_context, requests, aborts, *max_steps),\n"
                ));
            }
            continue;
        }
        if t == TEST_ARMS || t == TIMED_ARMS {
            for a in arms {
                let body = if t == TEST_ARMS { &a.test } else { &a.timed };
                out.push_str(&format!("{indent}{:?} => {},\n", a.kernel, body.trim()));
            }
            continue;
        }
        if let Some(name) = t.strip_prefix("// @item ") {
            keep = items.iter().any(|k| k == name.trim());
            continue;
        }
        if t == "// @end" {
            keep = true;
            continue;
        }
        if keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Most bytes of one engine file the snapshot copies.
pub const MAX_ENGINE_FILE_BYTES: u64 = 16 << 20;

/// `cargo` as the server runs it: `$CARGO` or `cargo` on PATH, started in `cwd` (a server-owned
/// directory, so that no `.cargo/config.toml` an agent wrote above the engine or in the server's
/// working directory is read: such a file can name a `rustc-wrapper` that cargo would run) with
/// compiler wrappers turned off.
fn cargo(cwd: &Path, args: Vec<std::ffi::OsString>) -> duct::Expression {
    duct::cmd(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()), args)
        .dir(cwd)
        .env("CARGO_TERM_COLOR", "never")
        .env("RUSTC_WRAPPER", "")
        .env("RUSTC_WORKSPACE_WRAPPER", "")
}

/// The engine's files: (relative path, contents), in path order, read through its directory
/// handle: a symlink to a file inside is read through, one leading out of the directory (or
/// dangling) is left out (the containment rule reports it), and a FIFO, device or socket is refused
/// by name. `target/` and `.git/` at the top are skipped.
/// Also returns the links left out because they lead outside (or nowhere).
#[allow(clippy::type_complexity)]
fn engine_files(root: &Dir) -> Result<(Vec<(String, Vec<u8>)>, Vec<String>)> {
    const LIMIT: crate::util::Limit = crate::util::Limit {
        what: "engine file",
        max: MAX_ENGINE_FILE_BYTES,
        hint: "keep weights in the model directory",
    };
    type Files = Vec<(String, Vec<u8>)>;
    fn walk(root: &Dir, rel: &Path, depth: usize, files: &mut Files, left_out: &mut Vec<String>) -> Result<()> {
        for (name, t) in root.entries(rel)? {
            let child = rel.join(&name);
            let shown = child.to_string_lossy().replace('\\', "/");
            if t.is_dir() {
                if (depth == 0 && (name == "target" || name == ".git")) || depth + 1 >= 16 {
                    continue;
                }
                walk(root, &child, depth + 1, files, left_out)?;
                continue;
            }
            if t.is_symlink() {
                let inside = root.link_target(&child).leads == crate::beneath::Leads::Inside;
                if !inside {
                    left_out.push(shown);
                    continue;
                }
                if !root.cap().metadata(&child).is_ok_and(|m| m.is_file()) {
                    continue;
                }
            }
            if files.len() >= 5_000 {
                return Err(Error::usage(format!(
                    "{} holds more than 5000 files; is it the engine crate?",
                    root.path().display()
                )));
            }
            files.push((shown, root.read(&child, &LIMIT)?));
        }
        Ok(())
    }
    let (mut files, mut left_out) = (Vec::new(), Vec::new());
    walk(root, Path::new(""), 0, &mut files, &mut left_out)?;
    Ok((files, left_out))
}

/// sha256 over (path, contents) pairs in order.
fn hash_files(files: &[(String, Vec<u8>)]) -> String {
    let mut h = Sha256::new();
    for (rel, bytes) in files {
        h.update((rel.len() as u64).to_le_bytes());
        h.update(rel.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    format!("{:x}", h.finalize())
}

/// sha256 of an engine directory's files, as [`Engine::hash`].
///
/// # Errors
/// When a file cannot be read or is too large.
pub fn source_hash(dir: &Path) -> Result<String> {
    Ok(hash_files(&engine_files(&Dir::open(dir)?)?.0))
}

/// Server-owned build state: the shared cargo target directory and the harness crates, and how the
/// processes that run agent-written code are sandboxed.
#[derive(Debug, Clone)]
pub struct Workshop {
    /// Root of the server's cache (`$METAINFER_CACHE`, else the per-user cache directory).
    pub root: PathBuf,
    /// Paths no sandboxed process may reach (the ledger, its HMAC key, the CKB working copy): a
    /// grant that contains one is refused ([`sandbox::prepare`]).
    pub protected: Vec<PathBuf>,
    /// Refuse to run agent-written code when the kernel cannot sandbox it (`--require-sandbox`).
    pub require_sandbox: bool,
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
    /// A workshop at `root` with nothing protected and the sandbox not required.
    pub fn new(root: PathBuf) -> Workshop {
        Workshop { root, protected: Vec::new(), require_sandbox: false }
    }

    /// The workshop at `$METAINFER_CACHE` or the per-user cache directory.
    pub fn default_location() -> Workshop {
        let root = std::env::var_os("METAINFER_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("metainfer"));
        Workshop::new(root)
    }

    /// Whether the processes this workshop starts for agent-written code run sandboxed (the kernel
    /// enforces every layer of [`sandbox`]); what every gate report states as `sandboxed`.
    pub fn sandboxed(&self) -> bool {
        sandbox::status().enforced
    }

    /// Run agent-written code: `expr` in the sandbox with `grants` (plus the toolchain), within
    /// `budget`, like [`run`]. `Run::sandboxed` says whether the sandbox was enforced.
    ///
    /// # Errors
    /// A grant that would expose a protected path; `require_sandbox` on a kernel that cannot
    /// sandbox; a process that cannot be started.
    pub fn run_sandboxed(&self, expr: duct::Expression, grants: &Grants, budget: &Budget) -> Result<Run> {
        let prepared = sandbox::prepare(grants, &self.protected, self.require_sandbox)?;
        let mut r = run(sandbox::apply(expr, &prepared), budget)?;
        r.sandboxed = prepared.enforced();
        Ok(r)
    }

    /// Run the agent-written executable `exe` with `args` to completion, sandboxed with `grants`,
    /// within `budget` (e.g. an engine binary's `--help`).
    ///
    /// # Errors
    /// As [`Workshop::run_sandboxed`].
    pub fn run_program_sandboxed(&self, exe: &Path, args: &[&str], grants: &Grants, budget: &Budget) -> Result<Run> {
        self.run_sandboxed(duct::cmd(exe, args), grants, budget)
    }

    /// Run a harness executable on one command (see [`protocol`]), sandboxed with `grants` (the
    /// harness's own exec and scratch, plus what the command reads, e.g. the model directory): the
    /// request is written as `request.json` in `dir`, the harness runs with `env` added to its
    /// (reduced) environment within `budget`, and its reply (`reply.json` in `dir`) is read back,
    /// bounded, and parsed.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Internal`] when the request cannot be written or the process cannot
    /// be started; the sandbox's errors (see [`Workshop::run_sandboxed`]). A process that fails or
    /// replies badly is a [`Called`], not an error.
    pub fn call(
        &self,
        exe: &Path,
        dir: &Path,
        command: protocol::Command,
        env: &[(&str, String)],
        grants: &Grants,
        budget: &Budget,
    ) -> Result<Called> {
        let request = dir.join("request.json");
        let reply_path = dir.join("reply.json");
        let _ = std::fs::remove_file(&reply_path);
        let req = protocol::Request { version: protocol::VERSION, reply: reply_path.clone(), command };
        let text = serde_json::to_vec(&req).map_err(|e| Error::internal(format!("harness request: {e}")))?;
        std::fs::write(&request, text).map_err(|e| Error::internal(format!("{}: {e}", request.display())))?;
        let mut cmd = duct::cmd(exe, [request.as_os_str()]);
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        let run = self.run_sandboxed(cmd, grants, budget)?;
        let reply = match crate::util::read_regular(&reply_path, &crate::util::HARNESS_REPLY) {
            Ok(bytes) => {
                serde_json::from_slice::<protocol::Reply>(&bytes).map_err(|e| format!("reply does not parse: {e}"))
            }
            Err(_) if !reply_path.exists() => Err("it wrote no reply".to_string()),
            Err(e) => Err(format!("its reply is unreadable: {}", e.message)),
        };
        Ok(Called { run, reply })
    }

    /// The directory cargo runs in: the cache root, created if needed (see [`cargo`]).
    fn cargo_cwd(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.root)
            .map_err(|e| Error::internal(format!("cannot create {}: {e}", self.root.display())))?;
        Ok(self.root.clone())
    }

    /// `grants` plus read access to the cargo configuration files cargo itself looks for in the
    /// ancestors of its working directory (`<dir>/.cargo/config.toml` and `<dir>/.cargo/config`, from
    /// the cache root up; cargo's "hierarchical structure" of configuration). They are the server's
    /// user's own files (the engine's own `.cargo/` is never among them: cargo runs from the cache
    /// root, not from the engine); without them a cache placed below such a file fails every build
    /// with "Permission denied".
    fn with_cargo_config(&self, mut grants: Grants) -> Grants {
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
    fn fetch(&self, manifest: &Path, budget: &Budget) -> Result<Run> {
        // Skipped when the manifest and its lock file are byte for byte those of this manifest's
        // last successful fetch: nothing new to download (an edit to the engine's sources is the
        // common case, and a fetch costs a cargo start and a resolve).
        let dir = manifest.parent().unwrap_or(Path::new("."));
        let state = || {
            let mut h = Sha256::new();
            h.update(std::fs::read(dir.join("Cargo.toml")).unwrap_or_default());
            h.update(b"\0");
            h.update(std::fs::read(dir.join("Cargo.lock")).unwrap_or_default());
            format!("{:x}", h.finalize())
        };
        let before = state();
        let marker =
            self.root.join("fetched").join(format!("{:016x}", crate::util::fnv1a(&manifest.display().to_string())));
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
    fn cargo_build_reading(
        &self,
        manifest: &Path,
        also_read: &[&Path],
        extra: &[std::ffi::OsString],
        incremental: bool,
        budget: &Budget,
    ) -> Result<Build> {
        let fetched = self.fetch(manifest, budget)?;
        if !fetched.ok() {
            return Ok(Build { ok: false, diagnostics: vec![], executable: None, run: fetched });
        }
        let scratch = self.scratch()?;
        let target = if incremental { self.incremental_target_dir() } else { self.target_dir() };
        std::fs::create_dir_all(&target)
            .map_err(|e| Error::internal(format!("cannot create {}: {e}", target.display())))?;
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

    /// Inspect an engine directory and refresh the server's snapshot of it ([`Workshop::engine_at`]
    /// on the directory opened as it is).
    ///
    /// # Errors
    /// As [`Workshop::engine_at`]; Usage when the directory cannot be opened.
    pub fn engine(&self, dir: &Path) -> Result<Engine> {
        let root = Dir::open(dir)
            .map_err(|e| Error::usage(format!("engine directory {}; pass the crate made by `scaffold`", e.message)))?;
        self.engine_at(&root)
    }

    /// Inspect the engine directory `root` (a handle: every file is read through it, never by its
    /// path) and refresh the server's snapshot of it, from which everything else is built: the
    /// package name comes from `cargo metadata` run on the snapshot, in the sandbox.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] when the directory holds no Cargo package with a library
    /// target, or a file that is not a regular file or is too large; Internal when the snapshot
    /// cannot be written.
    pub fn engine_at(&self, root: &Dir) -> Result<Engine> {
        let dir = root.path().to_path_buf();
        let (files, left_out) = engine_files(root)?;
        if !files.iter().any(|(rel, _)| rel == "Cargo.toml") {
            return Err(Error::usage(format!(
                "{} is not a Rust crate (no Cargo.toml); create one with `metainfer scaffold --out DIR`",
                dir.display()
            )));
        }
        let manifest = match files.iter().find(|(rel, _)| rel == crate::manifest::FILE) {
            None => crate::manifest::EngineManifest::default(),
            Some((rel, bytes)) => {
                let path = dir.join(rel);
                let limit = crate::util::METAINFER_TOML;
                if bytes.len() as u64 > limit.max {
                    return Err(Error::input(format!(
                        "{} is {} bytes; a {} may be at most {} bytes: {}",
                        path.display(),
                        bytes.len(),
                        limit.what,
                        limit.max,
                        limit.hint
                    )));
                }
                let text = std::str::from_utf8(bytes)
                    .map_err(|_| Error::input(format!("{} is not UTF-8 text", path.display())))?;
                crate::manifest::EngineManifest::parse(text)
                    .map_err(|e| Error::usage(format!("{}: {}", path.display(), e.message)))?
            }
        };
        let hash = hash_files(&files);
        let mut h = Sha256::new();
        h.update(dir.to_string_lossy().as_bytes());
        let build_dir = self.root.join("snapshots").join(&format!("{:x}", h.finalize())[..16]);
        let fail = |p: &Path, e: std::io::Error| Error::internal(format!("snapshot {}: {e}", p.display()));
        let mut keep = std::collections::HashSet::new();
        for (rel, bytes) in &files {
            let to = build_dir.join(rel);
            keep.insert(to.clone());
            if std::fs::read(&to).ok().as_deref() == Some(bytes.as_slice()) {
                continue;
            }
            std::fs::create_dir_all(to.parent().expect("a file has a parent")).map_err(|e| fail(&to, e))?;
            std::fs::write(&to, bytes).map_err(|e| fail(&to, e))?;
        }
        // Drop files the engine no longer has (cargo's own Cargo.lock stays when the engine has none).
        for e in walkdir::WalkDir::new(&build_dir).into_iter().filter_map(|e| e.ok()) {
            let p = e.path();
            if e.file_type().is_file() && !keep.contains(p) && p != build_dir.join("Cargo.lock") {
                let _ = std::fs::remove_file(p);
            }
        }
        let package = self.package_of(&dir, &build_dir).map_err(|e| {
            if left_out.is_empty() {
                return e;
            }
            Error::usage(format!(
                "{} (not read: {}, symlinks that lead outside the engine directory or nowhere; rule symlink-outside: copy what they point to into the crate, or remove them)",
                e.message,
                left_out.join(", ")
            ))
        })?;
        Ok(Engine { dir, root: root.clone(), build_dir, package, hash, manifest })
    }

    /// The package name of the snapshot `build_dir` of the engine `dir`: `cargo metadata --no-deps`
    /// on the snapshot, in the sandbox (a manifest is agent-written input to cargo).
    fn package_of(&self, dir: &Path, build_dir: &Path) -> Result<String> {
        let manifest = build_dir.join("Cargo.toml");
        let shown = dir.join("Cargo.toml");
        // cargo's messages name the snapshot; the agent knows the engine directory.
        let own = |s: &str| s.replace(&build_dir.display().to_string(), &dir.display().to_string());
        let scratch = self.scratch()?;
        let grants = self.with_cargo_config(
            Grants { tmp: Some(scratch.path().into()), ..Grants::default() }.read(build_dir).write(scratch.path()),
        );
        let args = vec![
            "metadata".into(),
            "--no-deps".into(),
            "--offline".into(),
            "--format-version".into(),
            "1".into(),
            "--manifest-path".into(),
            manifest.clone().into_os_string(),
        ];
        let r = self.run_sandboxed(cargo(&self.cargo_cwd()?, args), &grants, &Budget::secs(120))?;
        if !r.ok() {
            // cargo also loads path dependencies' manifests, which the snapshot does not hold (a
            // path dependency outside the engine is the rules' `path-outside`): a manifest that
            // names a package with a library is still this engine, so that the rules can report it.
            let text = std::fs::read_to_string(&manifest).unwrap_or_default();
            let table = toml::from_str::<toml::Table>(&text).ok();
            let name = table.as_ref().and_then(|t| t.get("package")?.get("name")?.as_str().map(str::to_string));
            let lib = table.as_ref().is_some_and(|t| t.contains_key("lib")) || build_dir.join("src/lib.rs").is_file();
            if let Some(name) = name.filter(|_| lib && text.contains("path")) {
                return Ok(name);
            }
            return Err(Error::usage(format!(
                "{}: cargo cannot read this crate: {}",
                shown.display(),
                own(&r.failure_text(2000))
            )));
        }
        let meta: cargo_metadata::Metadata =
            serde_json::from_str(&r.stdout).map_err(|e| Error::internal(format!("cargo metadata output: {e}")))?;
        let pkg = meta.packages.iter().find(|p| p.manifest_path.as_std_path() == manifest).ok_or_else(|| {
            Error::usage(format!("{}: no package found (is it a virtual workspace?)", shown.display()))
        })?;
        if !pkg.targets.iter().any(|t| t.is_lib()) {
            return Err(Error::usage(format!("{}: the engine must be a library crate (src/lib.rs)", shown.display())));
        }
        Ok(pkg.name.to_string())
    }

    /// Write the harness crate for an engine (outside the engine's sources) and return its manifest.
    /// The harness calls only the kernels in `spec` and builds the engine with `spec`'s features;
    /// each feature set gets its own harness package, so variants of one engine never clash.
    ///
    /// # Errors
    /// When the cache directory is not writable.
    pub fn write_harness(&self, engine: &Engine, spec: &HarnessSpec) -> Result<PathBuf> {
        let mut h = Sha256::new();
        h.update(engine.dir.to_string_lossy().as_bytes());
        for f in &spec.features {
            h.update(b"\0");
            h.update(f.as_bytes());
        }
        let key = format!("{:x}", h.finalize());
        let dir = self.root.join("harness").join(&key[..16]);
        std::fs::create_dir_all(dir.join("src"))
            .map_err(|e| Error::internal(format!("cannot create {}: {e}", dir.display())))?;
        // A CUDA harness names cudarc's types and probes the driver itself; Cargo unifies this
        // requirement with the engine's cudarc (its version feature and dynamic loading).
        let cudarc = if spec.cuda() {
            "cudarc = { version = \"0.19\", default-features = false, features = [\"std\", \"driver\"] }\n"
        } else {
            ""
        };
        let manifest = format!(
            // A name per engine and feature set: builds share one target directory, and the
            // uplifted binary `target/release/<name>` of one engine must never be run for another.
            "[package]\nname = \"metainfer-harness-{}\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [dependencies]\nengine = {{ path = {:?}, package = {:?}, features = {:?} }}\nsafetensors = \"0.8\"\nserde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n{cudarc}\n[workspace]\n",
            &key[..16],
            engine.build_dir.to_string_lossy(),
            engine.package,
            spec.features,
        );
        // Written only when the text differs: cargo decides by modification time, so rewriting the
        // same sources would recompile the harness crate after every engine edit.
        let write = |p: PathBuf, s: &str| {
            if std::fs::read(&p).is_ok_and(|old| old == s.as_bytes()) {
                return Ok(());
            }
            std::fs::write(&p, s).map_err(|e| Error::internal(format!("cannot write {}: {e}", p.display())))
        };
        write(dir.join("Cargo.toml"), &manifest)?;
        write(dir.join("src/main.rs"), &harness_source_with(&spec.arms, &spec.items, spec.serving))?;
        write(dir.join("src/protocol.rs"), HARNESS_PROTOCOL)?;
        write(dir.join("src/device.rs"), if spec.cuda() { HARNESS_DEVICE_CUDA } else { HARNESS_DEVICE_HOST })?;
        let serving = dir.join("src/serving.rs");
        if spec.serving {
            write(serving, HARNESS_SERVING)?;
        } else {
            let _ = std::fs::remove_file(serving);
        }
        Ok(dir.join("Cargo.toml"))
    }

    /// Build the harness for an engine; returns the build, whose `executable` is the harness binary.
    ///
    /// # Errors
    /// When cargo cannot be started or the cache is not writable.
    pub fn build_harness(&self, engine: &Engine, spec: &HarnessSpec, budget: &Budget) -> Result<Build> {
        let manifest = self.write_harness(engine, spec)?;
        self.cargo_build_reading(&manifest, &[&engine.build_dir], &[], spec.incremental, budget)
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
        let _ = crate::util::write_atomic(&marker, this.as_bytes());
        if let Some(exe) = build.executable.take().filter(|_| build.ok) {
            let copy = dest.join(exe.file_name().unwrap_or(std::ffi::OsStr::new("engine")));
            std::fs::copy(&exe, &copy)
                .map_err(|e| Error::internal(format!("cannot copy {} to {}: {e}", exe.display(), copy.display())))?;
            build.executable = Some(copy);
        }
        Ok(build)
    }

    /// Start a long-running engine server: `exe` with `args`, sandboxed with `grants` (which should
    /// name the port it listens on, [`Grants::listen`]), its own process group registered for the
    /// signal handlers, stdout and stderr to files in `dir`. The returned guard kills the group and
    /// reaps the child when dropped, so no server outlives its gate.
    ///
    /// # Errors
    /// The sandbox's errors (see [`Workshop::run_sandboxed`]); a process that cannot be started.
    pub fn start_server(
        &self,
        exe: &Path,
        args: &[std::ffi::OsString],
        grants: &Grants,
        dir: &Path,
    ) -> Result<ServerProcess> {
        let prepared = sandbox::prepare(grants, &self.protected, self.require_sandbox)?;
        let err_path = dir.join("server.stderr");
        let out_path = dir.join("server.stdout");
        let expr = duct::cmd(exe, args)
            .before_spawn(|cmd| {
                use std::os::unix::process::CommandExt;
                cmd.process_group(0);
                Ok(())
            })
            .env_remove("METAINFER_LEDGER")
            .env_remove("METAINFER_CACHE")
            .stdout_path(&out_path)
            .stderr_path(&err_path)
            .stdin_null()
            .unchecked();
        let expr = sandbox::apply(expr, &prepared);
        let handle = {
            let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
            if SHUTTING_DOWN.load(Ordering::SeqCst) {
                return Err(Error::internal("the server is shutting down; no process is started"));
            }
            let handle = expr.start().map_err(|e| Error::internal(format!("cannot start {}: {e}", exe.display())))?;
            live.extend(handle.pids().into_iter().map(|p| p as i32));
            handle
        };
        let pids = handle.pids().into_iter().map(|p| p as i32).collect();
        Ok(ServerProcess { handle, pids, err_path, sandboxed: prepared.enforced() })
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

/// String metadata of a safetensors file (`__metadata__`).
pub type Metadata = HashMap<String, String>;

/// Read a safetensors file written by the harness: its metadata and every tensor as raw
/// little-endian 32-bit words (f32 values via `f32::from_bits`, u32 values as they are).
///
/// # Errors
/// [`crate::error::ErrorKind::Internal`] when the file is missing or malformed.
pub fn read_tensor_words(path: &Path) -> Result<(Metadata, HashMap<String, Vec<u32>>)> {
    tensor_words(&crate::util::read_regular(path, &crate::util::HARNESS_OUTPUT)?, path)
}

/// [`read_tensor_words`] on bytes already read (`path` names them in messages).
///
/// # Errors
/// [`crate::error::ErrorKind::Internal`] when they are not a safetensors file.
pub fn tensor_words(bytes: &[u8], path: &Path) -> Result<(Metadata, HashMap<String, Vec<u32>>)> {
    let bad = |e: safetensors::SafeTensorError| Error::internal(format!("{}: {e}", path.display()));
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(bad)?;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(bad)?;
    let meta = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let words = view.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        out.insert(name, words);
    }
    Ok((meta, out))
}

/// The engine's fully resolved dependency graph (all targets, transitive), from `cargo metadata`
/// run on its snapshot: (name, version) of every package except the engine itself.
///
/// # Errors
/// When cargo cannot resolve the graph (the message carries cargo's).
pub fn dependency_graph(workshop: &Workshop, engine: &Engine, budget: &Budget) -> Result<Vec<(String, String)>> {
    let manifest = engine.build_dir.join("Cargo.toml");
    let fetched = workshop.fetch(&manifest, budget)?;
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
        serde_json::from_str(&r.stdout).map_err(|e| Error::internal(format!("cargo metadata output: {e}")))?;
    let root = meta.root_package().map(|p| p.id.clone());
    Ok(meta
        .packages
        .iter()
        .filter(|p| Some(&p.id) != root.as_ref())
        .map(|p| (p.name.to_string(), p.version.to_string()))
        .collect())
}
