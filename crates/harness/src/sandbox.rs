//! The sandbox every process that runs agent-written code starts in: the cargo builds of an engine
//! and of its harness (build scripts and proc macros run there), `cargo metadata` on the engine's
//! snapshot, and the harness process that calls the engine.
//!
//! On Linux it is made of four layers, all applied in the child between fork and exec:
//! - `no_new_privs`, and every capability dropped (a root server's children run as a root without
//!   capabilities: no raw sockets, no device nodes, no reading past file modes);
//! - a seccomp filter that refuses `socket(2)` (so no TCP, UDP, netlink or Unix-socket connection,
//!   e.g. to a container daemon's socket) and every syscall of a foreign ABI (x32, i386); a process
//!   granted a port to listen on ([`Grants::listen`], an engine's HTTP server) may create IPv4 and
//!   IPv6 sockets only, and Landlock lets it bind that one TCP port and connect nowhere;
//! - a Landlock ruleset (ABI 6 or newer: filesystem, TCP bind/connect, signal and abstract-socket
//!   scopes): read and execute the system and Rust toolchains, read the cargo registry and what the
//!   call grants (the engine's snapshot, the harness crate, a model directory), write only what the
//!   call grants (its scratch directory, the cargo target directory); everything else, the server's
//!   ledger, HMAC key, data directory, CKB working copy, candidates and other engines' snapshots and
//!   scratch included, is denied; signals to processes outside the sandbox are denied;
//! - an environment reduced to [`ENV_KEPT`] plus `HOME` and `TMPDIR` pointing at the call's scratch.
//!
//! The ruleset and the filter are built in the parent; the code between fork and exec makes only
//! `prctl`, `capset`, `open`/`close` (of `/proc/self`, which only the child can name),
//! `landlock_add_rule` and `landlock_restrict_self` system calls on memory prepared before the fork
//! (no allocation, no lock), so it is async-signal-safe. The one thing prepared per process that
//! the child changes is its own ruleset (the `/proc/self` rule), which no other process uses.
//!
//! What cargo itself needs was found by trying (cargo 1.95): a build or `cargo metadata` with
//! `--offline` and its dependencies already fetched reads only the toolchain, the registry and the
//! crates, writes only its target directory and `TMPDIR`, and needs neither `/proc`, `/etc` nor a
//! socket; it takes the registry's package-cache lock when it may (so the two lock files are
//! writable), which keeps it from reading crates another cargo is still unpacking.
//!
//! Where the kernel offers no Landlock, or one older than ABI 6, or no seccomp filters, processes
//! run without the sandbox, [`status`] says so (logged at start) and every gate report says
//! `sandboxed: false`; a workshop with `require_sandbox` refuses to run them instead.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use base::error::{Error, Result};

/// Environment variables a sandboxed process keeps from the server's environment (when set):
/// what cargo, rustc, rustup and the engine's thread pool read. Everything else (tokens, the
/// server's own `METAINFER_*` settings, wrappers such as `RUSTC_WRAPPER`) is dropped; `HOME` and
/// `TMPDIR` are set to the call's scratch directory, `CARGO_HOME` and `RUSTUP_HOME` to the
/// directories the sandbox grants, and `RUSTC_WRAPPER` to "" (a compiler cache such as sccache
/// needs its own cache directory and server, which the sandbox does not grant).
pub const ENV_KEPT: &[&str] = &[
    "PATH",
    "LANG",
    "LC_ALL",
    "RUSTUP_TOOLCHAIN",
    "CARGO",
    "CARGO_TERM_COLOR",
    "CARGO_BUILD_JOBS",
    "CARGO_NET_OFFLINE",
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "RUST_BACKTRACE",
    "RUST_MIN_STACK",
    "RAYON_NUM_THREADS",
];

/// What one sandboxed process may use besides the toolchain (see the module docs). Paths that do
/// not exist are left out of the ruleset (a process cannot use them either).
#[derive(Debug, Clone, Default)]
pub struct Grants {
    /// Directories or files it may read (engine snapshot, harness crate, model directory).
    pub read: Vec<PathBuf>,
    /// Files or directories it may read and execute (the harness binary).
    pub exec: Vec<PathBuf>,
    /// Directories it may read, write and execute in (scratch, cargo target directory).
    pub write: Vec<PathBuf>,
    /// Its `TMPDIR` and `HOME`: a directory it may write (one of `write`).
    pub tmp: Option<PathBuf>,
    /// Whether it may read its own `/proc/self` (e.g. its peak RSS in `/proc/self/status`); the rule
    /// is added in the child, where `/proc/self` is the child itself. Other processes' `/proc`
    /// entries stay denied.
    pub proc_self: bool,
    /// A TCP port it may bind (an engine's server under serve_engine): socket(2) is then allowed for
    /// AF_INET and AF_INET6 only, and Landlock allows binding this port and no TCP connect.
    pub listen: Option<u16>,
}

impl Grants {
    /// Grants for a harness process: execute `exe`, write `scratch` (also its TMPDIR).
    pub fn harness(exe: &Path, scratch: &Path) -> Grants {
        Grants {
            exec: vec![exe.into()],
            write: vec![scratch.into()],
            tmp: Some(scratch.into()),
            proc_self: true,
            ..Grants::default()
        }
    }

    /// Add a directory or file to read (e.g. the model directory).
    pub fn read(mut self, path: impl Into<PathBuf>) -> Grants {
        self.read.push(path.into());
        self
    }

    /// Add a directory to write.
    pub fn write(mut self, path: impl Into<PathBuf>) -> Grants {
        self.write.push(path.into());
        self
    }
}

/// Whether, and how well, this kernel can sandbox a child process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Every layer is enforced: Landlock ABI >= [`MIN_ABI`] and seccomp filters.
    pub enforced: bool,
    /// Landlock ABI version the kernel offers (0: none).
    pub landlock_abi: i32,
    /// Whether seccomp filters can be installed.
    pub seccomp: bool,
    /// One line for the start log: what is enforced, or what is missing and what it means.
    pub summary: String,
}

/// Oldest Landlock ABI the sandbox accepts: 6 adds the signal and abstract-socket scopes to
/// ABI 4's TCP rules (Linux 6.12; kernel documentation, "Landlock: unprivileged access control").
pub const MIN_ABI: i32 = 6;

/// What this kernel offers, probed once per process.
pub fn status() -> &'static Status {
    static STATUS: OnceLock<Status> = OnceLock::new();
    STATUS.get_or_init(probe)
}

#[cfg(target_os = "linux")]
fn probe() -> Status {
    // landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) returns the ABI version.
    // SAFETY: no pointer is dereferenced by the kernel for this query.
    let abi = unsafe {
        libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32 /* VERSION */)
    } as i32;
    let abi = abi.max(0);
    let seccomp = linux::seccomp_works();
    let enforced = abi >= MIN_ABI && seccomp;
    let summary = if enforced {
        format!(
            "sandbox: enforced (Landlock ABI {abi}, seccomp); agent-written code (builds, build scripts, harness) runs confined"
        )
    } else {
        let mut missing = Vec::new();
        if abi == 0 {
            missing.push("Landlock is not offered by this kernel (or is disabled at boot)".to_string());
        } else if abi < MIN_ABI {
            missing.push(format!("Landlock ABI {abi} is older than the {MIN_ABI} the sandbox needs (Linux 6.12)"));
        }
        if !seccomp {
            missing.push("seccomp filters cannot be installed".into());
        }
        format!(
            "sandbox: NOT enforced ({}); agent-written code runs with this server's rights and every gate report says sandboxed: false; --require-sandbox refuses gates",
            missing.join("; ")
        )
    };
    Status { enforced, landlock_abi: abi, seccomp, summary }
}

#[cfg(not(target_os = "linux"))]
fn probe() -> Status {
    Status {
        enforced: false,
        landlock_abi: 0,
        seccomp: false,
        summary: "sandbox: NOT enforced (Landlock and seccomp exist only on Linux); agent-written code runs with this server's rights and every gate report says sandboxed: false".into(),
    }
}

/// The directories of the Rust toolchain and cargo's caches, resolved once from the server's
/// environment: `CARGO_HOME` (default `~/.cargo`) and `RUSTUP_HOME` (default `~/.rustup`).
#[derive(Debug, Clone)]
pub struct Toolchain {
    /// `CARGO_HOME`.
    pub cargo_home: PathBuf,
    /// `RUSTUP_HOME`.
    pub rustup_home: PathBuf,
    /// Read and execute: system directories, rustup's toolchains, cargo's `bin/`, and the directory
    /// of the `cargo` the server runs.
    pub exec: Vec<PathBuf>,
    /// Read only: cargo's registry and git checkouts, its config file.
    pub read: Vec<PathBuf>,
    /// Read and write (files only): cargo's package-cache lock files, so that a sandboxed build
    /// takes the shared lock while another cargo (a fetch outside the sandbox) writes the registry.
    pub locks: Vec<PathBuf>,
}

/// The toolchain of this process (see [`Toolchain`]).
pub fn toolchain() -> &'static Toolchain {
    static TOOLCHAIN: OnceLock<Toolchain> = OnceLock::new();
    TOOLCHAIN.get_or_init(|| {
        let home = dirs::home_dir().unwrap_or_else(|| PathBuf::from("/"));
        let cargo_home = std::env::var_os("CARGO_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".cargo"));
        let rustup_home = std::env::var_os("RUSTUP_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".rustup"));
        let mut exec: Vec<PathBuf> =
            ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"].iter().map(PathBuf::from).collect();
        exec.push(rustup_home.clone());
        exec.push(cargo_home.join("bin"));
        if let Some(dir) = cargo_program_dir() {
            exec.push(dir);
        }
        let read = vec![
            cargo_home.join("registry"),
            cargo_home.join("git"),
            cargo_home.join("config.toml"),
            cargo_home.join("config"),
        ];
        let locks = vec![cargo_home.join(".package-cache"), cargo_home.join(".package-cache-mutate")];
        Toolchain { cargo_home, rustup_home, exec, read, locks }
    })
}

/// The directory of the `cargo` this server runs (`$CARGO`, else the first `cargo` on PATH).
fn cargo_program_dir() -> Option<PathBuf> {
    let program = match std::env::var_os("CARGO") {
        Some(c) => PathBuf::from(c),
        None => std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("cargo")).find(|p| p.is_file())?,
    };
    program.canonicalize().ok()?.parent().map(Path::to_path_buf)
}

/// A sandbox ready to be applied to one process: the ruleset's file descriptor and the reduced
/// environment, prepared in the parent.
#[derive(Debug, Clone)]
pub struct Prepared {
    #[cfg(target_os = "linux")]
    ruleset: Option<Arc<std::os::fd::OwnedFd>>,
    /// The signal-scope-only ruleset of the process's reaper (see [`reaper`]).
    #[cfg(target_os = "linux")]
    scope: Option<Arc<std::os::fd::OwnedFd>>,
    proc_self: bool,
    net: bool,
    env: Arc<Vec<(OsString, OsString)>>,
}

impl Prepared {
    /// Whether the process this is applied to runs confined.
    pub fn enforced(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            self.ruleset.is_some()
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    }
}

/// Prepare the sandbox for one process with `grants`.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] when a granted path would expose a `protected` path (e.g. a
/// model directory that holds the ledger: the message names both); when `require` is set and the
/// kernel cannot sandbox; Internal when the kernel refuses the ruleset.
pub fn prepare(grants: &Grants, protected: &[PathBuf], require: bool) -> Result<Prepared> {
    let tc = toolchain();
    let granted: Vec<&PathBuf> =
        grants.read.iter().chain(&grants.exec).chain(&grants.write).chain(&tc.exec).chain(&tc.read).collect();
    // Held directories and files are granted by /proc/self/fd/N (beneath::HeldDir::grant).
    if let Some(g) = granted.iter().find(|g| g.starts_with("/proc/self/fd") && !g.exists()) {
        return Err(Error::internal(format!(
            "{} does not resolve: the server names the model directory it holds to the sandbox through /proc/self/fd, so /proc must be mounted",
            g.display()
        )));
    }
    for p in protected {
        let p = p.canonicalize().unwrap_or_else(|_| std::path::absolute(p).unwrap_or_else(|_| p.clone()));
        for g in &granted {
            let Ok(g) = g.canonicalize() else { continue };
            if p.starts_with(&g) {
                return Err(Error::usage(format!(
                    "{} lies inside {}, which the engine's processes may read or write; keep the ledger, its key and the CKB working copy outside model, engine and cache directories (--ledger, --ckb)",
                    p.display(),
                    g.display()
                )));
            }
        }
    }
    let st = status();
    if !st.enforced && require {
        return Err(Error::usage(format!(
            "--require-sandbox: this kernel cannot sandbox the engine's code ({}); run on a Linux kernel with Landlock ABI >= {MIN_ABI} and seccomp, or drop --require-sandbox",
            st.summary
        )));
    }
    let tmp = grants.tmp.clone().or_else(|| grants.write.first().cloned());
    let mut env: Vec<(OsString, OsString)> = Vec::new();
    for k in ENV_KEPT {
        if let Some(v) = std::env::var_os(k) {
            env.push((k.into(), v));
        }
    }
    env.push(("CARGO_HOME".into(), tc.cargo_home.clone().into()));
    env.push(("RUSTUP_HOME".into(), tc.rustup_home.clone().into()));
    env.push(("RUSTC_WRAPPER".into(), OsString::new()));
    env.push(("RUSTC_WORKSPACE_WRAPPER".into(), OsString::new()));
    if let Some(t) = &tmp {
        env.push(("TMPDIR".into(), t.clone().into()));
        env.push(("HOME".into(), t.clone().into()));
    }
    #[cfg(target_os = "linux")]
    {
        let ruleset = if st.enforced { Some(Arc::new(linux::ruleset(grants, tc)?)) } else { None };
        let scope = if st.enforced { Some(Arc::new(linux::scope_ruleset()?)) } else { None };
        Ok(Prepared { ruleset, scope, proc_self: grants.proc_self, net: grants.listen.is_some(), env: Arc::new(env) })
    }
    #[cfg(not(target_os = "linux"))]
    {
        Ok(Prepared { proc_self: grants.proc_self, net: grants.listen.is_some(), env: Arc::new(env) })
    }
}

/// `expr` with the sandbox applied to the process it starts: the reduced environment (variables the
/// caller set on `expr` survive only when listed in [`ENV_KEPT`]) and, where enforced, the
/// restrictions of the module docs, installed between fork and exec.
pub fn apply(expr: duct::Expression, prepared: &Prepared) -> duct::Expression {
    let p = prepared.clone();
    expr.before_spawn(move |cmd| {
        let from_caller: Vec<(OsString, OsString)> = cmd
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .filter(|(k, _)| ENV_KEPT.iter().any(|kept| OsStr::new(kept) == k))
            .collect();
        cmd.env_clear();
        cmd.envs(p.env.iter().cloned());
        cmd.envs(from_caller);
        #[cfg(target_os = "linux")]
        if let (Some(fd), Some(scope)) = (&p.ruleset, &p.scope) {
            linux::install(cmd, fd, scope, p.proc_self, p.net);
        }
        Ok(())
    })
}

/// # The reaper
///
/// A process group is no boundary: a process of the engine's (a build script, the harness, an
/// engine's server) that calls `setsid` or makes its own group outlives a kill of the group, and
/// one whose parent exits is adopted by init. So every sandboxed process is started as two: its
/// *reaper* and the process proper. Between fork and exec the child the server forked restricts
/// itself to a Landlock domain that scopes signals only, makes itself a child subreaper
/// (`PR_SET_CHILD_SUBREAPER`: every orphan below it is adopted by it, not by init), and forks
/// again: the new child goes on to the sandbox's restrictions and the exec (a Landlock domain
/// nested in the reaper's), the parent stays behind as the reaper and never execs. The reaper
/// waits; when the process proper exits, or the server sends it SIGTERM (a time limit, a
/// cancellation, the server's own shutdown), or the thread that started it dies
/// (`PR_SET_PDEATHSIG`: the server exited, e.g. at the end of its input), it sends SIGKILL to
/// every process it may signal, `kill(-1)`, which Landlock's signal scope (ABI 6) limits to the
/// processes of its own domain and the domains nested in it: exactly the processes that descend
/// from it, wherever they moved (sessions, groups), and nothing else; processes of the engine
/// cannot signal the reaper (its domain is outside theirs). It reaps them all and exits with the
/// status of the process proper (or dies by its signal), so the server sees that status.
///
/// Without Landlock's signal scope there is no reaper (`kill(-1)` would reach every process of
/// the user): the server kills the process group only, and [`status`] says the sandbox is not
/// enforced.
#[cfg(target_os = "linux")]
pub mod reaper {
    /// Split the calling child (forked by the server, before exec) into the reaper and the
    /// process proper (see the module section above). Returns in the process proper only; the
    /// reaper never returns. `scope`: the signal-scope ruleset; `server`: the server's pid.
    /// Only system calls, no allocation: it runs between fork and exec.
    pub(super) fn split(scope: i32, server: libc::pid_t) -> std::io::Result<()> {
        // SAFETY: plain system calls on integers and stack memory.
        unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::syscall(libc::SYS_landlock_restrict_self, scope, 0u32) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let reaper = libc::getpid();
            let child = libc::fork();
            if child < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if child == 0 {
                // The process proper dies with its reaper.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                if libc::getppid() != reaper {
                    libc::_exit(127);
                }
                return Ok(());
            }
            reap(child, server)
        }
    }

    /// The reaper's life: wait for the process proper or a termination request, then kill and reap
    /// everything of its domain and exit with the process proper's status. Never returns.
    unsafe fn reap(child: libc::pid_t, server: libc::pid_t) -> ! {
        // SAFETY: plain system calls on integers and stack memory.
        unsafe {
            // The spawning side waits for the exec's status pipe to close; the reaper never execs,
            // so it closes every descriptor it inherited beyond stdio (the pipe among them).
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for sig in [libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                libc::sigaddset(&mut set, sig);
            }
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            let mut status: Option<i32> = None;
            // The server may have gone between the fork and the death signal's setting.
            let mut stop = libc::getppid() != server;
            while !stop {
                loop {
                    let mut st = 0;
                    let r = libc::waitpid(-1, &mut st, libc::WNOHANG);
                    if r <= 0 {
                        break;
                    }
                    if r == child {
                        status = Some(st);
                    }
                }
                if status.is_some() {
                    break;
                }
                let sig = libc::sigwaitinfo(&set, std::ptr::null_mut());
                stop = sig == libc::SIGTERM || sig == libc::SIGINT || sig == libc::SIGHUP;
            }
            // Everything of this domain (Landlock's signal scope), then reap until no child is left.
            loop {
                libc::kill(-1, libc::SIGKILL);
                let mut st = 0;
                let r = libc::waitpid(-1, &mut st, 0);
                if r == child {
                    status = Some(st);
                }
                if r < 0 && *libc::__errno_location() == libc::ECHILD {
                    break;
                }
            }
            match status {
                Some(st) if libc::WIFEXITED(st) => libc::_exit(libc::WEXITSTATUS(st)),
                Some(st) if libc::WIFSIGNALED(st) => {
                    let sig = libc::WTERMSIG(st);
                    libc::signal(sig, libc::SIG_DFL);
                    let mut one: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut one);
                    libc::sigaddset(&mut one, sig);
                    libc::sigprocmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
                    libc::kill(libc::getpid(), sig);
                    libc::_exit(128 + sig)
                }
                _ => libc::_exit(128 + libc::SIGTERM),
            }
        }
    }
}

#[cfg(target_os = "linux")]
mod linux {
    //! The Linux layers: Landlock ruleset, seccomp filter, capabilities.

    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    use std::sync::Arc;

    use landlock::{
        ABI, Access, AccessFs, AccessNet, BitFlags, NetPort, PathBeneath, PathFd, Ruleset, RulesetAttr,
        RulesetCreatedAttr, Scope,
    };

    use super::{Grants, Toolchain};
    use base::error::{Context, Error, Result};

    /// Build the Landlock ruleset of one process in the parent.
    pub(super) fn ruleset(grants: &Grants, tc: &Toolchain) -> Result<OwnedFd> {
        let abi = ABI::V6;
        let fail = |e: landlock::RulesetError| Error::internal(format!("Landlock ruleset: {e}"));
        let read: BitFlags<AccessFs> = AccessFs::ReadFile | AccessFs::ReadDir;
        let exec: BitFlags<AccessFs> = read | AccessFs::Execute;
        // Everything but device nodes (a root process could make one for a disk) and device ioctls.
        let write: BitFlags<AccessFs> =
            AccessFs::from_all(abi) & !(AccessFs::MakeChar | AccessFs::MakeBlock | AccessFs::IoctlDev);
        let mut rules: Vec<(&std::path::Path, BitFlags<AccessFs>)> = Vec::new();
        rules.extend(tc.exec.iter().map(|p| (p.as_path(), exec)));
        rules.extend(tc.read.iter().map(|p| (p.as_path(), read)));
        rules.extend(tc.locks.iter().map(|p| (p.as_path(), AccessFs::ReadFile | AccessFs::WriteFile)));
        rules.extend(grants.read.iter().map(|p| (p.as_path(), read)));
        rules.extend(grants.exec.iter().map(|p| (p.as_path(), exec)));
        rules.extend(grants.write.iter().map(|p| (p.as_path(), write)));
        for dev in ["/dev/urandom", "/dev/random", "/dev/zero"] {
            rules.push((std::path::Path::new(dev), AccessFs::ReadFile.into()));
        }
        rules.push((std::path::Path::new("/dev/null"), AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate));
        let mut created = Ruleset::default()
            .handle_access(AccessFs::from_all(abi))
            .map_err(fail)?
            .handle_access(AccessNet::from_all(abi))
            .map_err(fail)?
            .scope(Scope::from_all(abi))
            .map_err(fail)?
            .create()
            .map_err(fail)?;
        for (path, access) in rules {
            let Ok(meta) = std::fs::metadata(path) else { continue };
            let Ok(fd) = PathFd::new(path) else { continue };
            let access = if meta.is_dir() { access } else { access & AccessFs::from_file(abi) };
            created = created.add_rule(PathBeneath::new(fd, access)).map_err(fail)?;
        }
        if let Some(port) = grants.listen {
            created = created.add_rule(NetPort::new(port, AccessNet::BindTcp)).map_err(fail)?;
        }
        let fd: Option<OwnedFd> = created.into();
        fd.ok_or_else(|| Error::internal("Landlock ruleset: the kernel returned no ruleset"))
    }

    /// The seccomp filter (classic BPF): refuse `socket(2)` with EACCES and every syscall of another
    /// ABI (x32 numbers, i386 on x86-64) with ENOSYS or EACCES; allow the rest. Offsets are those of
    /// `struct seccomp_data` (nr at 0, arch at 4; linux/seccomp.h); jumps count instructions skipped.
    static FILTER: [libc::sock_filter; 8] = {
        const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
        const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
        const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
        const RET_K: u16 = 0x06; // BPF_RET | BPF_K
        const ALLOW: u32 = 0x7fff_0000; // SECCOMP_RET_ALLOW
        const ERRNO: u32 = 0x0005_0000; // SECCOMP_RET_ERRNO | errno
        #[cfg(target_arch = "x86_64")]
        const ARCH: u32 = 0xc000_003e; // AUDIT_ARCH_X86_64
        #[cfg(target_arch = "aarch64")]
        const ARCH: u32 = 0xc000_00b7; // AUDIT_ARCH_AARCH64
        const fn ins(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
            libc::sock_filter { code, jt, jf, k }
        }
        [
            ins(LD_W_ABS, 0, 0, 4),                        // 0: A = arch
            ins(JEQ_K, 1, 0, ARCH),                        // 1: native -> 3
            ins(RET_K, 0, 0, ERRNO | libc::ENOSYS as u32), // 2: foreign ABI
            ins(LD_W_ABS, 0, 0, 0),                        // 3: A = nr
            ins(JGE_K, 2, 0, 0x4000_0000),                 // 4: x32 numbers (__X32_SYSCALL_BIT) -> 7
            ins(JEQ_K, 1, 0, libc::SYS_socket as u32),     // 5: socket -> 7
            ins(RET_K, 0, 0, ALLOW),                       // 6
            ins(RET_K, 0, 0, ERRNO | libc::EACCES as u32), // 7
        ]
    };

    /// [`FILTER`] for a process that may listen ([`Grants::listen`]): `socket(2)` is allowed when its
    /// domain (args[0], offset 16, low word) is AF_INET or AF_INET6, refused with EACCES otherwise.
    static FILTER_NET: [libc::sock_filter; 12] = {
        const LD_W_ABS: u16 = 0x20;
        const JEQ_K: u16 = 0x15;
        const JGE_K: u16 = 0x35;
        const RET_K: u16 = 0x06;
        const ALLOW: u32 = 0x7fff_0000;
        const ERRNO: u32 = 0x0005_0000;
        #[cfg(target_arch = "x86_64")]
        const ARCH: u32 = 0xc000_003e;
        #[cfg(target_arch = "aarch64")]
        const ARCH: u32 = 0xc000_00b7;
        const fn ins(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
            libc::sock_filter { code, jt, jf, k }
        }
        [
            ins(LD_W_ABS, 0, 0, 4),                        // 0: A = arch
            ins(JEQ_K, 1, 0, ARCH),                        // 1: native -> 3
            ins(RET_K, 0, 0, ERRNO | libc::ENOSYS as u32), // 2: foreign ABI
            ins(LD_W_ABS, 0, 0, 0),                        // 3: A = nr
            ins(JGE_K, 5, 0, 0x4000_0000),                 // 4: x32 numbers -> 10
            ins(JEQ_K, 1, 0, libc::SYS_socket as u32),     // 5: socket -> 7
            ins(RET_K, 0, 0, ALLOW),                       // 6
            ins(LD_W_ABS, 0, 0, 16),                       // 7: A = args[0] (domain)
            ins(JEQ_K, 2, 0, libc::AF_INET as u32),        // 8: -> 11
            ins(JEQ_K, 1, 0, libc::AF_INET6 as u32),       // 9: -> 11
            ins(RET_K, 0, 0, ERRNO | libc::EACCES as u32), // 10
            ins(RET_K, 0, 0, ALLOW),                       // 11
        ]
    };

    /// A `sock_fprog` over [`FILTER`]: a pointer to immutable static memory, so it may be shared
    /// between threads and copied into a forked child.
    #[derive(Clone, Copy)]
    struct Program(libc::sock_fprog);
    // SAFETY: the pointer refers to the immutable static FILTER.
    unsafe impl Send for Program {}
    // SAFETY: as above.
    unsafe impl Sync for Program {}

    fn program() -> Program {
        Program(libc::sock_fprog { len: FILTER.len() as u16, filter: FILTER.as_ptr() as *mut libc::sock_filter })
    }

    /// A `sock_fprog` over [`FILTER_NET`].
    fn program_net() -> Program {
        Program(libc::sock_fprog {
            len: FILTER_NET.len() as u16,
            filter: FILTER_NET.as_ptr() as *mut libc::sock_filter,
        })
    }

    /// Restrict the calling process: no new privileges, no capabilities, the seccomp filter, the
    /// Landlock ruleset `fd`. Only system calls on memory prepared before the fork; returns the
    /// raw errno on failure. Called between fork and exec.
    fn restrict(fd: i32, prog: &libc::sock_fprog, proc_self: bool) -> std::io::Result<()> {
        // SAFETY: prctl, capset and syscall take plain integers or pointers to memory that lives
        // in the parent's static or captured data (copied into the child by fork); none allocates.
        unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Drop the bounding set (fails without CAP_SETPCAP: nothing to drop then), then every
            // capability this process holds.
            for cap in 0..64 {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            #[repr(C)]
            struct CapHeader {
                version: u32,
                pid: i32,
            }
            #[repr(C)]
            struct CapData {
                effective: u32,
                permitted: u32,
                inheritable: u32,
            }
            let header = CapHeader { version: 0x2008_0522 /* _LINUX_CAPABILITY_VERSION_3 */, pid: 0 };
            let data = [
                CapData { effective: 0, permitted: 0, inheritable: 0 },
                CapData { effective: 0, permitted: 0, inheritable: 0 },
            ];
            if libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, prog as *const libc::sock_fprog) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if proc_self {
                // struct landlock_path_beneath_attr (linux/landlock.h), packed.
                #[repr(C, packed)]
                struct PathBeneathAttr {
                    allowed_access: u64,
                    parent_fd: i32,
                }
                const READ_FILE: u64 = 1 << 2; // LANDLOCK_ACCESS_FS_READ_FILE
                const READ_DIR: u64 = 1 << 3; // LANDLOCK_ACCESS_FS_READ_DIR
                const RULE_PATH_BENEATH: u32 = 1; // LANDLOCK_RULE_PATH_BENEATH
                let dir = libc::open(c"/proc/self".as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
                if dir >= 0 {
                    let attr = PathBeneathAttr { allowed_access: READ_FILE | READ_DIR, parent_fd: dir };
                    libc::syscall(
                        libc::SYS_landlock_add_rule,
                        fd,
                        RULE_PATH_BENEATH,
                        &attr as *const PathBeneathAttr,
                        0u32,
                    );
                    libc::close(dir);
                }
            }
            if fd >= 0 && libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// The ruleset of a reaper: signals scoped to its domain, and nothing else restricted (see
    /// [`super::reaper`]). Landlock denies linking or renaming a file into another directory
    /// (`REFER`) in every domain unless a rule grants it, even where the ruleset handles no other
    /// filesystem access (kernel documentation, "Landlock: unprivileged access control",
    /// LANDLOCK_ACCESS_FS_REFER), so the ruleset grants it beneath `/`: rustc's and cargo's renames
    /// into their output directories stay possible (the sandbox's own ruleset decides them).
    /// Built in the parent.
    pub(super) fn scope_ruleset() -> Result<OwnedFd> {
        let fail = |e: landlock::RulesetError| Error::internal(format!("Landlock scope ruleset: {e}"));
        let root = PathFd::new("/").internal_ctx(|| "Landlock scope ruleset: /".to_owned())?;
        let created = Ruleset::default()
            .handle_access(AccessFs::Refer)
            .map_err(fail)?
            .scope(Scope::Signal)
            .map_err(fail)?
            .create()
            .map_err(fail)?
            .add_rule(PathBeneath::new(root, AccessFs::Refer))
            .map_err(fail)?;
        let fd: Option<OwnedFd> = created.into();
        fd.ok_or_else(|| Error::internal("Landlock scope ruleset: the kernel returned no ruleset"))
    }

    /// Install the restrictions on `cmd`, to run in the child before exec: first the split into
    /// the reaper and the process proper ([`super::reaper::split`]), then, in the process proper,
    /// the restrictions of [`restrict`].
    pub(super) fn install(
        cmd: &mut std::process::Command,
        fd: &Arc<OwnedFd>,
        scope: &Arc<OwnedFd>,
        proc_self: bool,
        net: bool,
    ) {
        let raw = fd.as_raw_fd();
        let scope = scope.as_raw_fd();
        let prog = if net { program_net() } else { program() };
        // SAFETY: `getpid` is a plain system call; it runs in the parent.
        let server = unsafe { libc::getpid() };
        // SAFETY: the closure only makes system calls (see `restrict` and `reaper::split`); the
        // file descriptors stay open in the parent until the process has started (the caller
        // keeps the Prepared alive).
        unsafe {
            cmd.pre_exec(move || {
                let p = prog;
                super::reaper::split(scope, server)?;
                restrict(raw, &p.0, proc_self)
            });
        }
    }

    /// Whether a seccomp filter can be installed here: tried in a forked child, which exits at once.
    pub(super) fn seccomp_works() -> bool {
        let prog = program();
        // SAFETY: the child makes only prctl and _exit calls (async-signal-safe), then exits.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                let ok = libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
                    && libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog.0 as *const libc::sock_fprog)
                        == 0;
                libc::_exit(if ok { 0 } else { 1 });
            }
            if pid < 0 {
                return false;
            }
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0) == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_granted_directory_holding_a_protected_path_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let ledger = d.path().join("ledger.sqlite");
        std::fs::write(&ledger, b"").unwrap();
        let e = prepare(&Grants::default().read(d.path()), std::slice::from_ref(&ledger), false).unwrap_err();
        assert!(e.message.contains("ledger.sqlite") && e.message.contains("lies inside"), "{}", e.message);
        assert!(prepare(&Grants::default().read(d.path().join("models")), &[ledger], false).is_ok());
    }
}
