//! Everything that spawns processes: cargo builds with JSON diagnostics, the generated harness crate,
//! running it with a time limit and cancellation, and bounding what comes back.
//!
//! Invariant: every child is either waited for or killed and reaped before a function returns,
//! and with it every process it started: a sandboxed child is its own reaper
//! ([`sandbox::reaper`]), which kills every process of its sandbox (in whatever session or group)
//! when the child ends, when the server asks it to, or when the server dies. Every live child is
//! in a registry, so that a signal to the server ends them all ([`shutdown`]); agent-written code
//! runs only in the sandbox ([`sandbox`]).
//!
//! The modules: `builds` (cargo as the server runs it, duct, dependencies fetched outside the
//! sandbox, the engine's dependency graph through `cargo metadata`), `diagnostics` (cargo's JSON
//! messages), `snapshot` (the engine's files read through its directory handle, hashed and copied
//! where every build reads them), `templating` (the harness crate, see there), [`protocol`],
//! `processes` (time limits, cancellation, bounded output, the registry of live process groups that
//! a signal ends, engine servers), [`sandbox`] (Landlock, seccomp, capabilities, environment, the
//! reaper), [`bundle`] and [`attest`] (a gate's harness call run on another machine, and what its
//! verdict proves), `explain` (what a child left behind, in the user's terms).

pub mod attest;
pub mod bundle;
pub mod diagnostics;
pub mod explain;
pub mod protocol;
pub mod sandbox;

mod builds;
mod processes;
mod snapshot;
mod templating;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base::error::{Context, Error, Result};

pub use builds::{Build, dependency_graph};
pub use diagnostics::{Diagnostic, parse_messages};
pub use explain::{explain, figure, outside_workspace, prompts_passed};
pub use processes::{
    Budget, Called, Exit, MAX_OUTPUT_BYTES, REAPER_GRACE, Run, ServerProcess, Watch, call_cancelled, client_command,
    exit_on_signals, free_loopback_port, run, run_program, run_with_env, server_command, shutdown, tail,
    wait_if_terminating,
};
pub use sandbox::Grants;
pub use snapshot::{Engine, MAX_ENGINE_FILE_BYTES, source_hash};
pub use templating::{
    Arm, HARNESS_DEVICE_CUDA, HARNESS_DEVICE_HOST, HARNESS_MAIN, HARNESS_PROTOCOL, HARNESS_SERVING, HarnessSpec,
    SERVING_COMMANDS, SERVING_MOD, TEST_ARMS, TIMED_ARMS, harness_source, harness_source_with,
};

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
    /// [`base::error::ErrorKind::Internal`] when the request cannot be written or the process cannot
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
        let text = serde_json::to_vec(&req).internal_ctx(|| "harness request".to_owned())?;
        std::fs::write(&request, text).internal_ctx(|| request.display().to_string())?;
        let mut cmd = duct::cmd(exe, [request.as_os_str()]);
        for (k, v) in env {
            cmd = cmd.env(k, v);
        }
        let run = self.run_sandboxed(cmd, grants, budget)?;
        let reply = match base::util::read_regular(&reply_path, &base::util::HARNESS_REPLY) {
            Ok(bytes) => {
                serde_json::from_slice::<protocol::Reply>(&bytes).map_err(|e| format!("reply does not parse: {e}"))
            }
            Err(_) if !reply_path.exists() => Err("it wrote no reply".to_string()),
            Err(e) => Err(format!("its reply is unreadable: {}", e.message)),
        };
        Ok(Called { run, reply })
    }

    /// A fresh scratch directory for one call's files, removed when dropped.
    ///
    /// # Errors
    /// When the cache is not writable.
    pub fn scratch(&self) -> Result<tempfile::TempDir> {
        let dir = self.root.join("scratch");
        std::fs::create_dir_all(&dir).internal_ctx(|| format!("cannot create {}", dir.display()))?;
        tempfile::tempdir_in(&dir).internal_ctx(|| "cannot create scratch dir".to_owned())
    }
}

/// String metadata of a safetensors file (`__metadata__`).
pub type Metadata = HashMap<String, String>;

/// Read a safetensors file written by the harness: its metadata and every tensor as raw
/// little-endian 32-bit words (f32 values via `f32::from_bits`, u32 values as they are).
///
/// # Errors
/// [`base::error::ErrorKind::Internal`] when the file is missing or malformed.
pub fn read_tensor_words(path: &Path) -> Result<(Metadata, HashMap<String, Vec<u32>>)> {
    tensor_words(&base::util::read_regular(path, &base::util::HARNESS_OUTPUT)?, path)
}

/// [`read_tensor_words`] on bytes already read (`path` names them in messages).
///
/// # Errors
/// [`base::error::ErrorKind::Internal`] when they are not a safetensors file.
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
