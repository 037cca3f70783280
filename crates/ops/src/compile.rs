//! compile_engine: build the engine crate with cargo's JSON diagnostics; structured errors with a
//! contract hint where a fixed signature is involved.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::gate::{Gate, Runs, Spec, Tool, Verdict as GateVerdict};
use super::{Ctx, Report};
use base::error::Result;
use harness::{self, Budget, Diagnostic, Exit};
use ledger::figures::{CompileFigures, Figures};

/// Which engine to build.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompileRequest {
    /// Engine crate directory.
    pub engine: String,
    /// Index of the first diagnostic to return (the previous page's `next_cursor`); the build is
    /// cached, so asking for the next page is cheap.
    #[serde(default)]
    pub cursor: Option<usize>,
}

/// Most diagnostics returned per page; the rest are counted.
pub const MAX_DIAGNOSTICS: usize = 40;

/// Build result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct CompileReport {
    /// Whether the crate built.
    pub passed: bool,
    /// sha256 of the engine's sources.
    pub engine_hash: String,
    /// Number of errors.
    pub errors: usize,
    /// Number of warnings.
    pub warnings: usize,
    /// Errors first, then warnings, at most MAX_DIAGNOSTICS.
    pub diagnostics: Vec<Diagnostic>,
    /// Diagnostics left out of this page.
    pub truncated: usize,
    /// Cursor of the next page of diagnostics, absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<usize>,
    /// Build time in seconds.
    pub seconds: f64,
    /// Cargo's own failure text when it failed without diagnostics (bounded).
    pub cargo_output: String,
    /// Rule findings (check_rules); a blocking one stops the build.
    pub rules: Vec<guard::Finding>,
    /// Whether the engine's code (its build scripts and proc macros, the harness process) ran in
    /// the enforced sandbox; false where the kernel offers no Landlock ABI >= 6 or seccomp (the
    /// server logs why at start; `--require-sandbox` refuses to run instead).
    pub sandboxed: bool,
}

impl Report for CompileReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let mut s = format!(
            "compile {}: {} error(s), {} warning(s) in {:.1} s\n",
            if self.passed { "PASSED" } else { "FAILED" },
            self.errors,
            self.warnings,
            self.seconds
        );
        for d in &self.diagnostics {
            s += &format!(
                "{}{}: {}:{}:{}: {}{}{}\n",
                d.level,
                if d.code.is_empty() { String::new() } else { format!("[{}]", d.code) },
                d.file,
                d.line,
                d.column,
                d.message,
                if d.label.is_empty() { String::new() } else { format!(" ({})", d.label) },
                if d.contract.is_empty() { String::new() } else { format!(" -- see contract {}", d.contract) }
            );
        }
        if self.truncated > 0 {
            s += &format!("[{} more diagnostics not shown]\n", self.truncated);
        }
        if !self.cargo_output.is_empty() {
            s += &self.cargo_output;
        }
        s
    }
}

/// Name the contract whose skeleton defines the item a diagnostic points at: the file is
/// `src/<module>.rs` and the message or label names a function of that contract's skeleton.
fn hint(ctx: &Ctx, d: &mut Diagnostic) {
    let Some(module) = d.file.strip_prefix("src/").and_then(|f| f.strip_suffix(".rs")) else {
        return;
    };
    for c in ctx.ckb.all() {
        let Some(rust) = c.rust.as_ref().filter(|r| r.module == module) else {
            continue;
        };
        let names = rust.skeleton.split("fn ").skip(1).filter_map(|s| s.split(['(', '<']).next());
        let text = format!("{} {}", d.message, d.label);
        if names.clone().any(|n| text.contains(&format!("`{n}`")) || text.contains(&format!("{n}("))) {
            d.contract = c.id.clone();
            return;
        }
    }
}

/// Build an engine.
///
/// # Errors
/// Not a crate, outside the workspace, a malformed manifest, or cargo cannot be started.
pub fn compile(ctx: &Ctx, req: &CompileRequest, budget: &Budget) -> Result<CompileReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::Compile, &req.engine, None, budget)?;
    gate.run(&mut CompileSpec { cursor: req.cursor.unwrap_or(0) })
}

/// compile_engine as a [`Spec`] that runs here: the engine's own incremental cargo build, whose
/// failure is the verdict (with its diagnostics), not a stop.
struct CompileSpec {
    /// Where the diagnostics page starts.
    cursor: usize,
}

impl Spec for CompileSpec {
    type Report = CompileReport;

    fn runs(&self) -> Runs {
        Runs::Here
    }

    fn unjudged(&self, gate: &Gate, why: String) -> CompileReport {
        CompileReport {
            passed: false,
            engine_hash: gate.engine.hash.clone(),
            errors: 0,
            warnings: 0,
            diagnostics: vec![],
            truncated: 0,
            next_cursor: None,
            seconds: 0.0,
            cargo_output: why,
            rules: gate.findings.clone(),
            sandboxed: gate.ctx.workshop.sandboxed(),
        }
    }

    fn judge_here(
        &mut self,
        gate: &Gate,
        _exe: Option<&std::path::Path>,
        _scratch: &std::path::Path,
    ) -> Result<GateVerdict<CompileReport>> {
        let build =
            gate.ctx.workshop.cargo_build_incremental(&gate.engine.build_dir.join("Cargo.toml"), gate.budget)?;
        let mut report = report_of(gate.ctx, &gate.engine, build, self.cursor);
        report.rules = gate.findings.clone();
        let figures = CompileFigures {
            gate: gate.common(),
            errors: report.errors,
            warnings: report.warnings,
            seconds: report.seconds,
            codes: report.diagnostics.iter().filter(|d| d.level == "error").map(|d| d.code.clone()).collect(),
            hinted: report.diagnostics.iter().filter(|d| !d.contract.is_empty()).map(|d| d.contract.clone()).collect(),
        };
        Ok(GateVerdict { report, figures: Figures::Compile(figures) })
    }
}

/// Turn a cargo build into a report (also used for the harness build inside the other gates).
pub fn report_of(ctx: &Ctx, engine: &harness::Engine, build: harness::Build, cursor: usize) -> CompileReport {
    let mut diags = build.diagnostics;
    diags.iter_mut().for_each(|d| hint(ctx, d));
    diags.sort_by_key(|d| d.level != "error");
    let errors = diags.iter().filter(|d| d.level == "error").count();
    let warnings = diags.len() - errors;
    let total = diags.len();
    let start = cursor.min(total);
    let end = (start + MAX_DIAGNOSTICS).min(total);
    let truncated = total - (end - start);
    let next_cursor = (end < total).then_some(end);
    let diags: Vec<Diagnostic> = diags.drain(start..end).collect();
    let cargo_output = if build.ok || errors > 0 {
        String::new()
    } else if build.run.exit == Exit::TimedOut || build.run.exit == Exit::Cancelled {
        build.run.failure_text(0)
    } else {
        build.run.failure_text(4000)
    };
    CompileReport {
        passed: build.ok,
        engine_hash: engine.hash.clone(),
        errors,
        warnings,
        diagnostics: diags,
        truncated,
        next_cursor,
        seconds: build.run.seconds,
        cargo_output,
        rules: vec![],
        sandboxed: ctx.workshop.sandboxed(),
    }
}
