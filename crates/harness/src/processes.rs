//! Processes and signals: running a child within a budget (time limit, cancellation, bounded
//! output), the registry of live children that a signal to the server ends, and engine servers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Grants, Workshop, protocol, sandbox};
use base::error::{Context, Error, Result};

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
/// [`base::error::ErrorKind::Internal`] when the program cannot be started.
pub fn run(expr: duct::Expression, budget: &Budget) -> Result<Run> {
    let start = Instant::now();
    let dir = tempfile::tempdir().internal_ctx(|| "temporary output directory".to_owned())?;
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
        let handle = expr.start().internal_ctx(|| format!("cannot start {expr:?}"))?;
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
        .internal_ctx(|| "cannot install signal handlers".to_owned())?;
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
        .internal_ctx(|| "cannot start the signal thread".to_owned())?;
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
    let l =
        std::net::TcpListener::bind(("127.0.0.1", 0)).internal_ctx(|| "cannot find a free loopback port".to_owned())?;
    l.local_addr().map(|a| a.port()).internal_ctx(|| "cannot find a free loopback port".to_owned())
}

impl Workshop {
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
            let handle = expr.start().internal_ctx(|| format!("cannot start {}", exe.display()))?;
            live.extend(handle.pids().into_iter().map(|p| p as i32));
            handle
        };
        let pids = handle.pids().into_iter().map(|p| p as i32).collect();
        Ok(ServerProcess { handle, pids, err_path, sandboxed: prepared.enforced() })
    }
}
