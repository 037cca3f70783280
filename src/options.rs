//! Server options: what `metainfer serve` (and every other subcommand) is configured with, in one
//! typed struct shared by the CLI, client registration and the demo, so that an option the CLI
//! accepts is one that `register` can write and `demo` can pass to its server.
//!
//! Builds the [`Ctx`] the operations run in: loads the knowledge base (built-in or `--ckb DIR`,
//! optionally leaving invalid files out), and resolves the ledger and build-cache locations.

use std::path::{Path, PathBuf};

use crate::ckb::{self, Ckb};
use crate::error::{Error, Result};
use crate::harness::Workshop;
use crate::ops::Ctx;

/// Default time limit of one compile/test/verify/profile call, in seconds.
pub const DEFAULT_TIME_LIMIT_S: u64 = 900;

/// A group of MCP tools that can be enabled on its own (`--toolsets`), after github-mcp-server's
/// convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Toolset {
    /// Read the knowledge base and the ledger, propose and evolve contracts: plan_engine,
    /// lookup_contract, list_outcomes, ckb_report, evolve_knowledge, propose_contract,
    /// probe_machine, list_allowed_directories.
    Knowledge,
    /// Write and build an engine crate: scaffold_engine, compile_engine, check_rules.
    Build,
    /// Run the engine against the oracles: run_kernel_test, verify_generation, profile_engine.
    Gates,
}

impl Toolset {
    /// Every toolset, in order.
    pub const ALL: [Toolset; 3] = [Toolset::Knowledge, Toolset::Build, Toolset::Gates];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Toolset::Knowledge => "knowledge",
            Toolset::Build => "build",
            Toolset::Gates => "gates",
        }
    }

    /// Parse a name.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the valid names.
    pub fn parse(s: &str) -> Result<Toolset> {
        Toolset::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| Error::usage(format!("unknown toolset `{s}`; toolsets: knowledge, build, gates")))
    }
}

/// Every option of the server, as the CLI parses it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOptions {
    /// CKB working copy (`--ckb DIR`); None: the knowledge base built into the binary.
    pub ckb: Option<PathBuf>,
    /// Ledger database (`--ledger FILE`); None: `$METAINFER_LEDGER` or the per-user data directory.
    pub ledger: Option<PathBuf>,
    /// Build cache (`--cache DIR`); None: `$METAINFER_CACHE` or the per-user cache directory.
    pub cache: Option<PathBuf>,
    /// Time limit of one long call, seconds (`--time-limit`).
    pub time_limit_s: u64,
    /// Leave invalid contract files out instead of refusing to start (`--skip-invalid`).
    pub skip_invalid: bool,
    /// Largest text and structured content of one tool result, characters (`--max-output`).
    pub max_output: usize,
    /// Refuse gates when the kernel cannot sandbox agent-written code (`--require-sandbox`).
    pub require_sandbox: bool,
    /// Directory every path argument is confined to (`serve --workspace`).
    pub workspace: Option<PathBuf>,
    /// Model directories path arguments may also point into (`serve --model-dir`, repeatable).
    pub model_dirs: Vec<PathBuf>,
    /// Offer only the read-only tools (`serve --read-only`).
    pub read_only: bool,
    /// Tool groups offered (`serve --toolsets`); empty: all of them.
    pub toolsets: Vec<Toolset>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            ckb: None,
            ledger: None,
            cache: None,
            time_limit_s: DEFAULT_TIME_LIMIT_S,
            skip_invalid: false,
            max_output: crate::ops::MAX_TEXT,
            require_sandbox: false,
            workspace: None,
            model_dirs: vec![],
            read_only: false,
            toolsets: vec![],
        }
    }
}

/// Load the knowledge base: the working copy `dir` or the built-in one. With `skip_invalid`,
/// invalid files (and the files referencing them) are left out and each is logged.
///
/// # Errors
/// An unreadable directory, or (without `skip_invalid`) any invalid contract file.
pub fn load_ckb(dir: Option<&Path>, skip_invalid: bool) -> Result<Ckb> {
    // A kernel contract without an oracle, or a failure contract naming an unknown mutant, is invalid.
    let known = crate::oracle::implemented();
    if !skip_invalid {
        return match dir {
            Some(d) => Ckb::from_sources_checked(ckb::read_dir_files(d)?, d.display().to_string(), Some(&known)),
            None => Ckb::from_sources_checked(ckb::embedded_files(), "embedded".into(), Some(&known)),
        };
    }
    let ckb = match dir {
        Some(d) => Ckb::from_sources_skip_invalid(ckb::read_dir_files(d)?, d.display().to_string(), Some(&known))?,
        None => Ckb::from_sources_skip_invalid(ckb::embedded_files(), "embedded".into(), Some(&known))?,
    };
    for f in ckb.skipped() {
        tracing::warn!("--skip-invalid: left out contract file {}: {}", f.file, f.reason);
    }
    if !ckb.skipped().is_empty() {
        tracing::warn!(
            "--skip-invalid: {} contract file(s) of {} left out; {} contracts loaded",
            ckb.skipped().len(),
            ckb.origin,
            ckb.all().count()
        );
    }
    Ok(ckb)
}

impl ServerOptions {
    /// The context operations run in. `client` is recorded with every outcome (`cli` for the CLI;
    /// the MCP server replaces it with the client's name). The workspace is canonicalised.
    ///
    /// # Errors
    /// A workspace that does not exist, or a knowledge base that does not load.
    pub fn ctx(&self, client: &str) -> Result<Ctx> {
        let workspace = self
            .workspace
            .as_ref()
            .map(|w| {
                base::util::expand_home(w).canonicalize().map_err(|e| {
                    Error::usage(format!("--workspace {}: {e}; pass an existing project directory", w.display()))
                })
            })
            .transpose()?;
        let mut ctx = Ctx {
            ckb: load_ckb(self.ckb.as_deref(), self.skip_invalid)?,
            // Absolute: the harness manifest refers to the engine snapshot inside the cache by path.
            workshop: self
                .cache
                .clone()
                .map(|root| Workshop::new(std::path::absolute(&root).unwrap_or(root)))
                .unwrap_or_else(Workshop::default_location),
            // Absolute: the candidates staged beside it must not follow the server's working directory.
            ledger: {
                let l = self.ledger.clone().unwrap_or_else(crate::ledger::default_path);
                std::path::absolute(&l).unwrap_or(l)
            },
            workspace,
            models: self.model_dirs(),
            time_limit_s: self.time_limit_s,
            max_output: self.max_output,
            client: std::sync::Arc::new(std::sync::RwLock::new(client.into())),
            ckb_dir: self.ckb.clone(),
        };
        // Nothing a sandboxed process runs may reach the server's own state.
        ctx.workshop.protected = ctx.protected_paths();
        ctx.workshop.require_sandbox = self.require_sandbox;
        Ok(ctx)
    }

    /// The `--model-dir` directories as the server confines paths to them: a leading `~` expanded
    /// (a client's config passes arguments without a shell), absolute. One that cannot be listed
    /// admits nothing: it is kept, and a warning on stderr names it.
    pub fn model_dirs(&self) -> Vec<PathBuf> {
        self.model_dirs
            .iter()
            .map(|m| {
                let m = base::util::expand_home(m);
                let m = std::path::absolute(&m).unwrap_or(m);
                if let Err(e) = std::fs::read_dir(&m) {
                    tracing::warn!("--model-dir {}: {e}; it admits no path until it exists", m.display());
                }
                m
            })
            .collect()
    }

    /// The arguments of `metainfer serve` that reproduce these options (what `register` writes and
    /// `demo` starts): only options that differ from their defaults, in a fixed order. Paths are
    /// written as given; callers that write a config file pass them absolute or relative as the
    /// client resolves them.
    pub fn serve_args(&self) -> Vec<String> {
        let mut a = vec!["serve".to_string()];
        let mut path = |flag: &str, p: &Path| {
            a.push(flag.into());
            a.push(p.display().to_string());
        };
        if let Some(w) = &self.workspace {
            path("--workspace", w);
        }
        for m in &self.model_dirs {
            path("--model-dir", m);
        }
        if let Some(c) = &self.ckb {
            path("--ckb", c);
        }
        if let Some(l) = &self.ledger {
            path("--ledger", l);
        }
        if let Some(c) = &self.cache {
            path("--cache", c);
        }
        if self.time_limit_s != DEFAULT_TIME_LIMIT_S {
            a.extend(["--time-limit".into(), self.time_limit_s.to_string()]);
        }
        if self.max_output != crate::ops::MAX_TEXT {
            a.extend(["--max-output".into(), self.max_output.to_string()]);
        }
        if self.skip_invalid {
            a.push("--skip-invalid".into());
        }
        if self.require_sandbox {
            a.push("--require-sandbox".into());
        }
        if self.read_only {
            a.push("--read-only".into());
        }
        if !self.toolsets.is_empty() {
            a.push("--toolsets".into());
            a.push(self.toolsets.iter().map(|t| t.name()).collect::<Vec<_>>().join(","));
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ledger named by a relative path is made absolute at start, so the evolution candidates
    /// staged beside it never land in (or move with) the server's working directory.
    #[test]
    fn a_relative_ledger_stages_candidates_at_an_absolute_path() {
        let o = ServerOptions { ledger: Some("rel/ledger.sqlite".into()), ..Default::default() };
        let ctx = o.ctx("test").unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(ctx.ledger, cwd.join("rel/ledger.sqlite"));
        assert_eq!(ctx.candidates_dir(), cwd.join("rel/candidates"));
    }

    #[test]
    fn serve_args_carry_every_option_that_differs_from_its_default() {
        assert_eq!(ServerOptions::default().serve_args(), ["serve"]);
        let o = ServerOptions {
            ckb: Some("/c".into()),
            ledger: Some("/l.sqlite".into()),
            cache: Some("/cache".into()),
            time_limit_s: 1200,
            skip_invalid: true,
            max_output: 5000,
            require_sandbox: true,
            workspace: Some("/p".into()),
            model_dirs: vec!["/m1".into(), "/m2".into()],
            read_only: true,
            toolsets: vec![Toolset::Knowledge, Toolset::Gates],
        };
        assert_eq!(
            o.serve_args(),
            [
                "serve",
                "--workspace",
                "/p",
                "--model-dir",
                "/m1",
                "--model-dir",
                "/m2",
                "--ckb",
                "/c",
                "--ledger",
                "/l.sqlite",
                "--cache",
                "/cache",
                "--time-limit",
                "1200",
                "--max-output",
                "5000",
                "--skip-invalid",
                "--require-sandbox",
                "--read-only",
                "--toolsets",
                "knowledge,gates"
            ]
        );
    }

    #[test]
    fn toolsets_parse_by_name_and_name_the_valid_ones() {
        assert_eq!(Toolset::parse("gates").unwrap(), Toolset::Gates);
        let e = Toolset::parse("gate").unwrap_err();
        assert!(e.message.contains("knowledge, build, gates"), "{e}");
    }
}
