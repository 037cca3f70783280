//! check_rules: the zero-reference and anti-fake rules on an engine (see `guard`). Also run before
//! every gate (`ops::gate`; [`precheck`]: `cargo metadata` for the dependency graph, then the
//! rules): a blocking finding stops the gate, and the outcome is recorded.

use std::path::Path;
use std::time::Instant;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, ReferenceLevel, Report};
use base::error::Result;
use guard::{self, Finding, Severity, provenance};
use harness::{self, Budget, Engine};

/// Which engine to check.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RulesRequest {
    /// Engine crate directory.
    pub engine: String,
}

/// Rule findings.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct RulesReport {
    /// Whether no finding blocks.
    pub passed: bool,
    /// sha256 of the engine's files.
    pub engine_hash: String,
    /// Reference level from the engine's metainfer.toml (zero, docs, code).
    pub reference_level: ReferenceLevel,
    /// Packages in the resolved dependency graph.
    pub packages: usize,
    /// Findings, blocking first.
    pub findings: Vec<Finding>,
    /// What was not examined and why (large, binary or unreadable files, depth).
    pub skipped: Vec<String>,
}

impl Report for RulesReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let blocking = self.findings.iter().filter(|f| f.severity == Severity::Blocking).count();
        let mut s = format!(
            "rules {}: {blocking} blocking, {} warning(s); {} packages resolved; reference level {}\n",
            if self.passed { "PASSED" } else { "FAILED" },
            self.findings.len() - blocking,
            self.packages,
            self.reference_level.name()
        );
        for f in &self.findings {
            s += &format!("{f}\n");
        }
        for k in &self.skipped {
            s += &format!("skipped: {k}\n");
        }
        s
    }
}

/// The contract ids an engine implements, from its manifest: its family, the family's components,
/// and the family's kernels at its own dtype and at every dtype of `[dtype_features]`; with
/// `[serving]`, the serving kernels and components too. None when the
/// manifest names no family of the knowledge base (every signature is then checked).
fn implemented(ctx: &Ctx, engine: &Engine) -> Option<(std::collections::BTreeSet<String>, String)> {
    let mut ids = std::collections::BTreeSet::new();
    let mut api = ckb::API_HOST.to_string();
    for d in engine.manifest.dtypes() {
        let target = ctx.target(engine, Some(&d)).ok()?;
        let family = ctx.ckb.get(&target.family).ok()?;
        ids.insert(family.id.clone());
        ids.extend(family.model.iter().flat_map(|m| m.components.iter().cloned()));
        // The platform's own components (e.g. the CUDA device handle).
        let platform = target.platform.as_deref().and_then(|p| ctx.ckb.get(p).ok()).and_then(|p| p.platform.as_ref());
        ids.extend(platform.iter().flat_map(|p| p.components.iter().cloned()));
        ids.extend(target.spec.kernels);
        api = target.spec.api;
        ids.extend(target.components);
    }
    Some((ids, api))
}

/// Run the rules on an engine already inspected (no ledger record).
///
/// # Errors
/// When cargo cannot resolve the dependency graph or the ledger's references cannot be read.
pub fn precheck(ctx: &Ctx, engine: &Engine, budget: &Budget) -> Result<RulesReport> {
    let (packages, unresolved) = match harness::dependency_graph(&ctx.workshop, engine, budget) {
        Ok(p) => (p, None),
        Err(e) => (Vec::new(), Some(e.message)),
    };
    let references: Vec<provenance::Reference> = ledger::Ledger::open(&ctx.ledger)?
        .references()?
        .into_iter()
        .map(|(name, file, prints)| provenance::Reference {
            name,
            file,
            prints: prints.into_iter().map(|(hash, line)| provenance::Print { hash, line }).collect(),
        })
        .collect();
    let level = engine.manifest.reference_level;
    let target = engine.manifest.target.clone();
    let implements = implemented(ctx, engine);
    let api = implements.as_ref().map(|(_, a)| a.clone()).unwrap_or_else(|| ckb::API_HOST.to_string());
    let inputs = guard::Inputs {
        ckb: &ctx.ckb,
        target: &target,
        packages: &packages,
        references: &references,
        level,
        implements: implements.as_ref().map(|(ids, _)| ids),
        api: &api,
    };
    // Read through the engine's directory handle, never by its path: the directory checked is the
    // one read, whatever was renamed or linked in its place since.
    let (mut findings, skipped) = guard::check(&engine.root.fd_path(), &inputs);
    if let Some(why) = unresolved {
        findings.push(Finding::blocking(
            "dependency-unresolved",
            "Cargo.toml",
            0,
            format!("the dependency graph cannot be resolved, so the dependency rules cannot be checked: {why}"),
        ));
    }
    findings.sort_by_key(|f| f.severity != Severity::Blocking);
    Ok(RulesReport {
        passed: !guard::blocks(&findings),
        engine_hash: engine.hash.clone(),
        reference_level: level,
        packages: packages.len(),
        findings,
        skipped,
    })
}

/// Check the rules on an engine and record the outcome.
///
/// # Errors
/// Not a crate, outside the workspace, or cargo cannot resolve the dependency graph.
pub fn check_rules(ctx: &Ctx, req: &RulesRequest, budget: &Budget) -> Result<RulesReport> {
    let live = ctx.live();
    let ctx = &*live;
    let started = Instant::now();
    let dir = ctx.confine(Path::new(&req.engine))?;
    let engine = ctx.workshop.engine_at(&dir)?;
    // The manifest names a family of the knowledge base (a gate checks the same in Gate::open).
    ctx.target(&engine, None)?;
    let report = precheck(ctx, &engine, budget)?;
    let figures = ledger::figures::Figures::Rules(ledger::figures::RulesFigures {
        findings: report.findings.iter().map(|f| f.rule.clone()).collect(),
        skipped: report.skipped.len(),
    });
    ctx.record("check_rules", Some(&engine), ctx.versioned(&["policy.zero-reference"]), &report, figures, started);
    Ok(report)
}

/// The text a gate reports when rules block it.
pub fn blocked_text(r: &RulesReport) -> String {
    format!("blocked by rule findings (fix them, then run the gate again):\n{}", r.text())
}
