//! `metainfer doctor --client NAME`: checks the setup an agent client sees, in the order the client
//! meets it: its config file holds the entry `register` wrote, the binary the entry names runs, the
//! workspace and model directories exist and are readable, cargo is found with the environment
//! the client passes the server, and the server, started exactly as the client starts it, answers
//! MCP with its tools. Each failed check says what to do.
//!
//! In order: the client's entry, read back from its config file (`clients`); for Claude Code, the
//! project's approval of the server; the binary (`--version`); the workspace and model directories;
//! cargo in the environment the client passes; and the server started as the client starts it
//! (`harness::client_command`, an rmcp client listing its tools). Every finding is a check with its
//! fix, not an error.

use std::path::{Path, PathBuf};

use rmcp::ServiceExt;
use rmcp::transport::TokioChildProcess;

use crate::clients::{Client, Entry};
use crate::error::{Context, Result};
use crate::harness::Budget;

/// One check of the setup.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// What was checked: `config`, `binary`, `workspace`, `model-dir`, `cargo`, `server`.
    pub name: String,
    /// Whether it passed.
    pub passed: bool,
    /// What was found.
    pub detail: String,
    /// What to do when it failed; empty when it passed.
    pub fix: String,
}

/// The doctor's findings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DoctorReport {
    /// Client checked.
    pub client: String,
    /// Its config file.
    pub config: PathBuf,
    /// Entry name looked up.
    pub entry: String,
    /// Every check, in order; a check that could not run because an earlier one failed is left out.
    pub checks: Vec<Check>,
}

impl DoctorReport {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    /// The report as the CLI prints it: one line per check, the fix under each failure.
    pub fn text(&self) -> String {
        let mut s = format!("metainfer doctor: {}, entry `{}` in {}\n", self.client, self.entry, self.config.display());
        for c in &self.checks {
            s += &format!("{} {:<10} {}\n", if c.passed { "ok  " } else { "FAIL" }, c.name, c.detail);
            if !c.passed {
                s += &format!("     fix: {}\n", c.fix);
            }
        }
        let failed = self.checks.iter().filter(|c| !c.passed).count();
        s += &if failed == 0 {
            format!("every check passed: {} can start the server and see its tools\n", self.client)
        } else {
            format!("{failed} check(s) failed\n")
        };
        s
    }
}

fn pass(name: &str, detail: String) -> Check {
    Check { name: name.into(), passed: true, detail, fix: String::new() }
}

fn fail(name: &str, detail: String, fix: String) -> Check {
    Check { name: name.into(), passed: false, detail, fix }
}

/// The environment the client gives the server it starts: the client's own (taken to be this
/// process's: run doctor from the shell the client is started from) plus the entry's `env`, or for
/// Codex only the entry's `env_vars` taken from it, plus `env`.
pub fn client_environment(client: Client, entry: &Entry) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = if client.inherits_environment() {
        std::env::vars().collect()
    } else {
        entry.env_vars.iter().filter_map(|k| std::env::var(k).ok().map(|v| (k.clone(), v))).collect()
    };
    for (k, v) in &entry.env {
        env.retain(|(x, _)| x != k);
        env.push((k.clone(), v.clone()));
    }
    env
}

/// Find `program` as a process started with `env` would: a path as given (relative to `dir`), a
/// bare name on that environment's PATH.
pub fn find_program(program: &str, env: &[(String, String)], dir: &Path) -> Option<PathBuf> {
    if program.contains('/') {
        let p = dir.join(program);
        return p.is_file().then_some(p);
    }
    let path = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone()).unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(program)).find(|c| c.is_file())
}

/// Whether `dir` is a directory this process can list: Ok(entries) or Err(why, fix).
fn readable_dir(dir: &Path, what: &str, again: &str) -> std::result::Result<usize, (String, String)> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err((
            format!("{what} {} does not exist", dir.display()),
            format!("create it, or register the directory that exists: {again}"),
        )),
        Err(e) => {
            Err((format!("{what} {}: {e}", dir.display()), format!("make it readable: chmod u+rx {}", dir.display())))
        }
        Ok(m) if !m.is_dir() => {
            Err((format!("{what} {} is not a directory", dir.display()), format!("name a directory instead: {again}")))
        }
        Ok(_) => match std::fs::read_dir(dir) {
            Ok(entries) => Ok(entries.count()),
            Err(e) => Err((
                format!("{what} {} cannot be read: {e}", dir.display()),
                format!("make it readable by this user: chmod u+rx {}", dir.display()),
            )),
        },
    }
}

/// Claude Code starts a project's `.mcp.json` server only once it was approved in an interactive
/// session; until then `claude mcp list` shows it as "⏸ Pending approval (run `claude` to
/// approve)". The choice is kept in `~/.claude.json` under the project's path
/// (`enabledMcpjsonServers`, `disabledMcpjsonServers`).
/// The client's own command-line program and the command that installs it, for the clients that
/// are one (Claude Code, Codex, Gemini CLI; npm package names from their install guides); None for
/// the editors, which need not be on the PATH.
fn client_program(client: Client) -> Option<(&'static str, &'static str)> {
    match client {
        Client::Claude => Some(("claude", "npm install -g @anthropic-ai/claude-code")),
        Client::Codex => Some(("codex", "npm install -g @openai/codex")),
        Client::Gemini => Some(("gemini", "npm install -g @google/gemini-cli")),
        Client::Cursor | Client::Vscode => None,
    }
}

/// Whether the client's program is on this shell's PATH (see [`client_program`]).
fn client_installed(client: Client, program: &str, install: &str, project: &Path) -> Check {
    let env: Vec<(String, String)> = std::env::vars().collect();
    match find_program(program, &env, project) {
        Some(p) => pass("client", format!("`{program}` at {}", p.display())),
        None => fail(
            "client",
            format!("`{program}` is not on this shell's PATH: {} is not installed for this user", client.title()),
            format!("install it (`{install}`), then run doctor again"),
        ),
    }
}

fn claude_approval(project: &Path, name: &str) -> Check {
    let file = dirs::home_dir().unwrap_or_default().join(".claude.json");
    let approve = format!(
        "start `claude` in {} once and choose to use the MCP server `{name}` when asked; `claude mcp list` then shows it \"✔ Connected\"",
        project.display()
    );
    if !file.exists() {
        let never = format!(
            "{} does not exist: Claude Code has not run as this user, so it has approved nothing",
            file.display()
        );
        return fail("approval", never, approve);
    }
    let state: serde_json::Value =
        std::fs::read(&file).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or(serde_json::Value::Null);
    let p = &state["projects"][project.display().to_string()];
    let listed = |key: &str| p[key].as_array().is_some_and(|a| a.iter().any(|x| x.as_str() == Some(name)));
    if listed("disabledMcpjsonServers") {
        fail(
            "approval",
            format!("Claude Code was told not to use `{name}` in this project ({})", file.display()),
            format!("run `claude mcp reset-project-choices` in {}, then {approve}", project.display()),
        )
    } else if listed("enabledMcpjsonServers") || p["enableAllProjectMcpServers"] == true {
        pass("approval", format!("approved for this project in {}", file.display()))
    } else {
        fail(
            "approval",
            format!(
                "not yet approved: `claude mcp list` shows `{name}` as \"⏸ Pending approval (run `claude` to approve)\""
            ),
            approve,
        )
    }
}

/// Check the setup of `client` for the project directory `project` (entry `name`, default the
/// name `register` uses).
///
/// # Errors
/// Only for the doctor's own faults (a runtime that cannot start); every finding is a [`Check`].
pub async fn run(client: Client, project: &Path, name: Option<String>) -> Result<DoctorReport> {
    let name = name.unwrap_or_else(|| client.default_name(project));
    let config = client.config_path(project);
    let mut report =
        DoctorReport { client: client.title().into(), config: config.clone(), entry: name.clone(), checks: vec![] };
    let register = format!("metainfer register --client {} --dir {}", client.name(), project.display());

    // 1. The entry.
    let text = match std::fs::read_to_string(&config) {
        Ok(t) => t,
        Err(e) => {
            report.checks.push(fail(
                "config",
                format!("{}: {e}", config.display()),
                format!("register the server: `{register} --model-dir DIR`"),
            ));
            return Ok(report);
        }
    };
    let entry = match client.read_entry(&text, &name) {
        Ok(Some(e)) => e,
        Ok(None) => {
            report.checks.push(fail(
                "config",
                format!("{} has no entry `{name}`", config.display()),
                format!("register the server: `{register} --model-dir DIR` (or pass --name if it is registered under another name)"),
            ));
            return Ok(report);
        }
        Err(e) => {
            report.checks.push(fail(
                "config",
                format!("{}: {}", config.display(), e.message),
                format!("fix the file, or remove it and run `{register}`"),
            ));
            return Ok(report);
        }
    };
    report.checks.push(pass("config", format!("entry `{name}`: {} {}", entry.command, entry.args.join(" "))));
    if let Some((program, install)) = client_program(client) {
        report.checks.push(client_installed(client, program, install, project));
    }
    if client == Client::Claude {
        report.checks.push(claude_approval(project, &name));
    }
    let again = format!("`{register} --replace ...` with the options you want");

    // 2. The binary it names, in the client's environment.
    let env = client_environment(client, &entry);
    let budget = Budget::secs(60);
    let exe = match find_program(&entry.command, &env, project) {
        Some(p) => p,
        None => {
            report.checks.push(fail(
                "binary",
                format!(
                    "the entry's command `{}` {}",
                    entry.command,
                    if entry.command.contains('/') { "does not exist" } else { "is not on the PATH the client passes" }
                ),
                format!(
                    "run `{register} --replace` with the metainfer you want the client to start: register writes that binary's absolute path"
                ),
            ));
            return Ok(report);
        }
    };
    let version = crate::harness::run_with_env(&exe, &["--version"], &env, project, &budget)?;
    if !version.ok() || !version.stdout.starts_with("metainfer ") {
        report.checks.push(fail(
            "binary",
            format!("`{} --version` {}", exe.display(), if version.ok() { format!("printed {:?}", version.stdout.trim()) } else { version.failure_text(400) }),
            format!("{} is not a working metainfer; reinstall it (`cargo install --locked --path .` in the clone) and run `{register} --replace`", exe.display()),
        ));
        return Ok(report);
    }
    let own = std::env::current_exe().ok().and_then(|e| e.canonicalize().ok());
    let same = exe.canonicalize().ok() == own;
    report.checks.push(pass(
        "binary",
        format!(
            "{} runs: {}{}",
            exe.display(),
            version.stdout.trim(),
            if same { "" } else { " (not the binary running this doctor)" }
        ),
    ));

    // 3. The directories it may read.
    let mut dirs_ok = true;
    let mut args = entry.args.iter();
    while let Some(a) = args.next() {
        let what = match a.as_str() {
            "--workspace" => "workspace",
            "--model-dir" => "model-dir",
            _ => continue,
        };
        let Some(v) = args.next() else { continue };
        let dir = client.resolve_arg(project, v);
        let shown = if Path::new(v) == dir { v.clone() } else { format!("{v} = {}", dir.display()) };
        match readable_dir(&dir, &format!("{what} `{v}` ="), &again) {
            Ok(n) => report.checks.push(pass(
                what,
                format!("{shown}: a readable directory ({n} {})", if n == 1 { "entry" } else { "entries" }),
            )),
            Err((detail, fix)) => {
                dirs_ok = false;
                report.checks.push(fail(what, detail, fix));
            }
        }
    }

    // 4. cargo, as the server's gates will run it.
    let cargo = find_program("cargo", &env, project);
    let how = if client.inherits_environment() {
        format!("the environment {} passes (this shell's, plus the entry's env)", client.title())
    } else {
        "the environment Codex passes (the entry's env_vars and env only)".to_string()
    };
    let path = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str()).unwrap_or("");
    match cargo {
        None => report.checks.push(fail(
            "cargo",
            format!("cargo is not on the PATH of {how}: PATH={path}"),
            format!(
                "install Rust (rustup) or put cargo's directory (usually ~/.cargo/bin) on the PATH the client is started with; or add it to the entry's env: \"env\": {{\"PATH\": \"{}:{path}\"}}",
                dirs::home_dir().unwrap_or_default().join(".cargo/bin").display()
            ),
        )),
        Some(cargo) => {
            let run = crate::harness::run_with_env(&cargo, &["--version"], &env, project, &budget)?;
            if run.ok() {
                report.checks.push(pass("cargo", format!("{} ({}) with {how}", run.stdout.trim(), cargo.display())));
            } else {
                report.checks.push(fail(
                    "cargo",
                    format!("`{} --version` with {how} {}", cargo.display(), run.failure_text(400)),
                    "rustup cannot choose a toolchain in that environment: set RUSTUP_HOME and CARGO_HOME in the entry's env (register does this for Codex), or run `rustup default stable`".into(),
                ));
            }
        }
    }

    // 5. The server, started exactly as the client starts it.
    if !dirs_ok {
        return Ok(report);
    }
    let cmd = crate::harness::client_command(&exe, &entry.args, &env, project);
    let started = std::time::Instant::now();
    let answer = async {
        let transport = TokioChildProcess::new(cmd).map_err(|e| format!("cannot start it: {e}"))?;
        let client = ().serve(transport).await.map_err(|e| format!("MCP initialisation failed: {e}"))?;
        let info = client.peer_info().and_then(|i| i.server_info.clone()).map(|s| format!("{} {}", s.name, s.version));
        let tools = client.list_all_tools().await.map_err(|e| format!("tools/list failed: {e}"))?;
        let _ = client.cancel().await;
        Ok::<_, String>((info.unwrap_or_default(), tools.iter().map(|t| t.name.to_string()).collect::<Vec<_>>()))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(60), answer).await {
        Ok(Ok((info, tools))) => report.checks.push(pass(
            "server",
            format!(
                "started as the client starts it, in {}: {info} answered in {:.1} s with {} tools ({})",
                project.display(),
                started.elapsed().as_secs_f64(),
                tools.len(),
                tools.join(", ")
            ),
        )),
        Ok(Err(why)) => report.checks.push(fail(
            "server",
            format!("`{} {}` {why}", exe.display(), entry.args.join(" ")),
            "run that command by hand in the project directory to see its error (it logs to stderr), fix what it names, then register again with --replace".into(),
        )),
        Err(_) => report.checks.push(fail(
            "server",
            format!("`{} {}` did not answer MCP within 60 s", exe.display(), entry.args.join(" ")),
            "run that command by hand in the project directory to see what it waits for".into(),
        )),
    }
    Ok(report)
}

/// The doctor for the CLI: runs [`run`] on a runtime of its own.
///
/// # Errors
/// As [`run`]; a runtime that cannot start.
pub fn check(client: Client, project: &Path, name: Option<String>) -> Result<DoctorReport> {
    let rt = tokio::runtime::Runtime::new().internal_ctx(|| "tokio runtime".to_owned())?;
    rt.block_on(run(client, project, name))
}
