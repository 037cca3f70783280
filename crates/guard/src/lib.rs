//! Rule checks on engine crates: the zero-reference rule and the anti-fake rules, one file per rule,
//! each finding with a stable rule id. Reads only the engine directory (no symlink is followed) and
//! what the caller passes in (the resolved dependency graph, the CKB, registered reference
//! fingerprints). No code is skipped: every Rust source, manifest and build script is read whole,
//! and so is every file one of them pulls in as code (`include!`, `#[path]`, a build script's
//! `mod`) whatever its name; one too large to read ([`MAX_FILE_BYTES`]) is the blocking finding
//! `file-too-large`, one that cannot be read as UTF-8 `file-unreadable`.
//!
//! The rules, one module each: `dependencies` (no inference framework in the dependency graph),
//! `containment` (paths, includes, symlinks, build scripts), `signatures` (the contracts' locked
//! signatures), `hardcoded` (answers carried instead of computed), `provenance` (winnowing
//! fingerprints of registered reference trees).
//!
//! Knows nothing of MCP and starts no process (the dependency graph comes from `harness`); tidy
//! holds it to naming no module that reads anything else (ledger, models, options, operations).

pub mod containment;
pub mod dependencies;
pub mod hardcoded;
pub mod provenance;
pub mod signatures;

use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use ckb::Ckb;

pub use manifest::ReferenceLevel;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Stops the gate; recorded in the ledger.
    Blocking,
    /// Reported; the gate still runs.
    Warning,
}

/// One rule violation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Finding {
    /// Stable rule id, e.g. `dependency-denied`, `path-outside`, `signature-changed`.
    pub rule: String,
    /// Blocking or warning.
    pub severity: Severity,
    /// File relative to the engine directory ("" for the crate as a whole).
    pub file: String,
    /// 1-based line, 0 when not tied to a line.
    pub line: u32,
    /// What is wrong and what to change.
    pub message: String,
}

impl Finding {
    /// A blocking finding.
    pub fn blocking(rule: &str, file: &str, line: u32, message: String) -> Finding {
        Finding { rule: rule.into(), severity: Severity::Blocking, file: file.into(), line, message }
    }
    /// A warning.
    pub fn warning(rule: &str, file: &str, line: u32, message: String) -> Finding {
        Finding { rule: rule.into(), severity: Severity::Warning, file: file.into(), line, message }
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sev = match self.severity {
            Severity::Blocking => "blocking",
            Severity::Warning => "warning",
        };
        if self.file.is_empty() {
            write!(f, "[{}] {sev}: {}", self.rule, self.message)
        } else {
            write!(f, "[{}] {sev}: {}:{}: {}", self.rule, self.file, self.line, self.message)
        }
    }
}

/// Largest source file, manifest or build script the rules read; a larger one is the blocking
/// finding `file-too-large`.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Most files examined.
pub const MAX_FILES: usize = 5_000;
/// Deepest directory level examined.
pub const MAX_DEPTH: usize = 16;

/// A text source file of the engine.
#[derive(Debug, Clone)]
pub struct SourceFile {
    /// Path relative to the engine directory, `/`-separated.
    pub rel: String,
    /// Absolute path.
    pub path: PathBuf,
    /// Contents.
    pub text: String,
    /// Whether it is Rust code: a `*.rs` file, or any file pulled in as code by `include!`,
    /// `#[path]` or a build script's `mod`.
    pub rust: bool,
}

/// What a bounded walk of the engine directory found.
#[derive(Debug, Clone, Default)]
pub struct Tree {
    /// Rust sources, manifests and build scripts (`*.rs`, `*.toml`).
    pub files: Vec<SourceFile>,
    /// Symlinks: (relative path, target as read, resolved target if it resolves).
    pub symlinks: Vec<(String, PathBuf, Option<PathBuf>)>,
    /// What was not examined and why (files that are not code, depth, count).
    pub skipped: Vec<String>,
    /// Code files too large to read: (relative path, bytes).
    pub too_large: Vec<(String, u64)>,
    /// Code files that could not be read as UTF-8: (relative path, why).
    pub unreadable: Vec<(String, String)>,
}

/// Literal paths a Rust source pulls in as code: `include!("…")` and `#[path = "…"]`.
pub(crate) fn code_references(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (mac, after) in [("include!", "("), ("#[path", "=")] {
        let mut from = 0;
        while let Some(i) = text[from..].find(mac) {
            from += i + mac.len();
            let rest = text[from..].trim_start();
            let Some(rest) = rest.strip_prefix(after) else { continue };
            if let Some((lit, _)) = rest.trim_start().strip_prefix('"').and_then(|r| r.split_once('"')) {
                out.push(lit.to_string());
            }
        }
    }
    out
}

impl Tree {
    /// Read `path` (relative `rel`) as a code file of the tree: too large and unreadable files are
    /// recorded as such.
    fn read_code(&mut self, rel: String, path: &Path, rust: bool) {
        let size = std::fs::symlink_metadata(path).map(|m| m.len()).unwrap_or(0);
        if size > MAX_FILE_BYTES {
            self.too_large.push((rel, size));
            return;
        }
        match std::fs::read(path) {
            Ok(bytes) => match String::from_utf8(bytes) {
                Ok(text) => self.files.push(SourceFile { rel, path: path.to_path_buf(), text, rust }),
                Err(_) => self.unreadable.push((rel, "not UTF-8".into())),
            },
            Err(e) => self.unreadable.push((rel, e.to_string())),
        }
    }

    /// Add the files that code already read pulls in as code (`include!`, `#[path]`), whatever
    /// their names, transitively; files outside `dir` are left to the containment rule.
    fn follow_code_references(&mut self, dir: &Path) {
        let mut i = 0;
        while i < self.files.len() {
            if self.files[i].rust {
                let base = self.files[i].path.parent().unwrap_or(dir).to_path_buf();
                for lit in code_references(&self.files[i].text) {
                    let p = containment::join_normal(&base, &lit);
                    let Ok(rel) = p.strip_prefix(dir) else { continue };
                    let rel = rel.to_string_lossy().replace('\\', "/");
                    let known = self.files.iter().any(|f| f.path == p)
                        || self.too_large.iter().any(|(r, _)| *r == rel)
                        || self.unreadable.iter().any(|(r, _)| *r == rel);
                    let regular = std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_file());
                    if !known && regular && self.files.len() < MAX_FILES {
                        self.read_code(rel, &p, true);
                    }
                }
            }
            i += 1;
        }
    }
}

/// Walk `dir` (canonical, or a directory handle's `/proc/self/fd/N`) without following links,
/// skipping `target/` and `.git/`.
pub fn walk(dir: &Path) -> Tree {
    let mut tree = Tree::default();
    let mut seen = 0usize;
    let real = dir.canonicalize().ok();
    let walker = walkdir::WalkDir::new(dir).follow_links(false).max_depth(MAX_DEPTH).sort_by_file_name();
    let mut it = walker.into_iter();
    while let Some(entry) = it.next() {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                tree.skipped.push(format!("{}: {e}", e.path().map(|p| p.display().to_string()).unwrap_or_default()));
                continue;
            }
        };
        let rel = entry.path().strip_prefix(dir).unwrap_or(entry.path()).to_string_lossy().replace('\\', "/");
        if entry.file_type().is_dir() {
            if entry.depth() == 1 && (rel == "target" || rel == ".git") {
                it.skip_current_dir();
            } else if entry.depth() == MAX_DEPTH {
                tree.skipped.push(format!("{rel}/: deeper than {MAX_DEPTH} levels"));
            }
            continue;
        }
        seen += 1;
        if seen > MAX_FILES {
            tree.skipped.push(format!("more than {MAX_FILES} files; the rest were not examined"));
            break;
        }
        if entry.path_is_symlink() {
            let target = std::fs::read_link(entry.path()).unwrap_or_default();
            // Resolved, and named under `dir` when it lands beneath `dir`'s own resolved path
            // (`dir` may be a handle's `/proc/self/fd/N`, which resolves to the directory's path).
            let resolved = entry.path().canonicalize().ok().map(|r| match real.as_ref().map(|d| r.strip_prefix(d)) {
                Some(Ok(rel)) => dir.join(rel),
                _ => r,
            });
            tree.symlinks.push((rel, target, resolved));
            continue;
        }
        let is_text = rel.ends_with(".rs") || rel.ends_with(".toml");
        if !is_text || !entry.file_type().is_file() {
            continue;
        }
        let rust = rel.ends_with(".rs");
        tree.read_code(rel, entry.path(), rust);
    }
    tree.follow_code_references(dir);
    tree
}

/// Everything the rules need besides the engine directory.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    /// The knowledge base (deny list, signatures).
    pub ckb: &'a Ckb,
    /// Target platform name, for the allow list.
    pub target: &'a str,
    /// Resolved packages (name, version) of the engine's full dependency graph, the engine excluded.
    pub packages: &'a [(String, String)],
    /// Registered reference fingerprints.
    pub references: &'a [provenance::Reference],
    /// Reference level of the engine: at `code`, provenance matches are warnings.
    pub level: ReferenceLevel,
    /// Contract ids whose signatures the engine must keep: the ones it implements (its family, the
    /// family's components and its kernels at the dtypes it is built for). None: every contract with
    /// a Rust skeleton.
    pub implements: Option<&'a std::collections::BTreeSet<String>>,
    /// The engine platform's api (`host` or `cuda`): which skeleton of a kernel contract its
    /// signatures must keep (`rust` or `cuda`).
    pub api: &'a str,
}

/// Run every rule on an engine directory.
pub fn check(dir: &Path, inputs: &Inputs) -> (Vec<Finding>, Vec<String>) {
    let tree = walk(dir);
    let mut findings = Vec::new();
    for (rel, size) in &tree.too_large {
        findings.push(Finding::blocking(
            "file-too-large",
            rel,
            0,
            format!(
                "{size} bytes: code (sources, manifests, build scripts and files they include as code) may be at most {MAX_FILE_BYTES} bytes, so that every rule reads it whole; split it, or keep data in a file the code reads with include_bytes!"
            ),
        ));
    }
    for (rel, why) in &tree.unreadable {
        findings.push(Finding::blocking(
            "file-unreadable",
            rel,
            0,
            format!(
                "cannot be read as UTF-8 text ({why}), so the rules cannot check it; rustc needs UTF-8 sources too"
            ),
        ));
    }
    findings.extend(dependencies::check(inputs.ckb, inputs.target, inputs.packages));
    findings.extend(containment::check(dir, &tree));
    findings.extend(signatures::check(inputs.ckb, &tree, inputs.implements, inputs.api));
    findings.extend(hardcoded::check(&tree));
    findings.extend(provenance::check(&tree, inputs.references, inputs.level));
    (findings, tree.skipped)
}

/// 1-based line of a byte offset in `text` (offsets past the end count as the last line).
pub fn line_of(text: &str, byte: usize) -> u32 {
    text[..byte.min(text.len())].matches('\n').count() as u32 + 1
}

/// Whether any finding blocks.
pub fn blocks(findings: &[Finding]) -> bool {
    findings.iter().any(|f| f.severity == Severity::Blocking)
}
