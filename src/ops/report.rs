//! ckb_report: what the ledger says about the knowledge base. Per contract: attempts, first-try pass
//! rate, attempts and time to green, frequent failure modes; the same per reference level (the axis
//! on which the seed paper compared source-code reference); per engine a phase timeline; and the
//! coverage matrix (family x platform x dtype: covered, verified by an engine, never exercised).

use std::collections::BTreeMap;
use std::time::SystemTime;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use crate::ckb::Kind;
use crate::error::Result;
use crate::ledger::figures::Figures;
use crate::ledger::{Ledger, Outcome};

/// What to report on.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct ReportRequest {
    /// Only contracts whose id starts with this, e.g. `kernel.`.
    #[serde(default)]
    pub prefix: Option<String>,
}

/// Statistics of a set of attempt sequences (one sequence per engine directory).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct Stats {
    /// Attempts (gate outcomes) in all.
    pub attempts: usize,
    /// Engines (directories) that attempted it.
    pub engines: usize,
    /// Share of engines whose first attempt passed, 0..=1.
    pub first_try_pass_rate: f64,
    /// Median attempts until the first pass, over engines that got there (0 when none did).
    pub median_attempts_to_green: f64,
    /// Median seconds from the first attempt to the first pass (0 when none did).
    pub median_seconds_to_green: f64,
    /// Engines that never passed.
    pub never_green: usize,
}

/// One contract's row.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ContractRow {
    /// Contract id.
    pub id: String,
    /// Statistics over every engine.
    pub stats: Stats,
    /// Most frequent diagnosed failure modes, `id (count)`, most frequent first.
    pub failure_modes: Vec<String>,
}

/// One reference level's row.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct LevelRow {
    /// `zero`, `docs` or `code`.
    pub level: String,
    /// Gate statistics over every contract attempted at that level.
    pub stats: Stats,
}

/// One step of an engine's timeline.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PhaseStep {
    /// Gate tool.
    pub tool: String,
    /// Attempts of it.
    pub attempts: usize,
    /// Time of the first pass, "" when none.
    pub first_pass: String,
}

/// One engine's timeline.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct EngineTimeline {
    /// Engine directory.
    pub engine: String,
    /// Reference level.
    pub level: String,
    /// Gates in build order.
    pub steps: Vec<PhaseStep>,
}

/// One cell of the coverage matrix.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct CoverageCell {
    /// Model-family contract.
    pub family: String,
    /// Platform target.
    pub target: String,
    /// dtype.
    pub dtype: String,
    /// `verified` (an engine passed verify_generation), `covered` (the CKB covers it, no engine yet).
    pub status: String,
}

/// The report.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct CkbReport {
    /// Outcomes read.
    pub outcomes: usize,
    /// Per contract.
    pub contracts: Vec<ContractRow>,
    /// Per reference level.
    pub levels: Vec<LevelRow>,
    /// Per engine.
    pub engines: Vec<EngineTimeline>,
    /// Coverage matrix.
    pub coverage: Vec<CoverageCell>,
}

/// Gates, in build order.
const GATES: [&str; 5] = ["check_rules", "compile_engine", "run_kernel_test", "verify_generation", "profile_engine"];

fn secs(time: &str) -> f64 {
    humantime::parse_rfc3339(time)
        .ok()
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Statistics of attempt sequences: per engine, (time, passed) in order.
fn stats(seqs: &BTreeMap<String, Vec<(f64, bool)>>) -> Stats {
    let mut first_try = 0;
    let mut to_green = Vec::new();
    let mut time_to_green = Vec::new();
    let mut never = 0;
    for seq in seqs.values() {
        if seq.first().is_some_and(|a| a.1) {
            first_try += 1;
        }
        match seq.iter().position(|a| a.1) {
            Some(i) => {
                to_green.push((i + 1) as f64);
                time_to_green.push(seq[i].0 - seq[0].0);
            }
            None => never += 1,
        }
    }
    Stats {
        attempts: seqs.values().map(Vec::len).sum(),
        engines: seqs.len(),
        first_try_pass_rate: if seqs.is_empty() { 0.0 } else { first_try as f64 / seqs.len() as f64 },
        median_attempts_to_green: crate::stats::median(&to_green),
        median_seconds_to_green: crate::stats::median(&time_to_green),
        never_green: never,
    }
}

/// Per-contract verdicts of one outcome: kernel tests carry one verdict per kernel in their figures.
fn verdicts(o: &Outcome) -> Vec<(String, bool)> {
    if let Figures::KernelTest(f) = Figures::read(&o.tool, &o.figures)
        && !f.kernels.is_empty()
    {
        return f.kernels.iter().map(|k| (k.id.clone(), k.passed)).collect();
    }
    o.contracts.iter().map(|c| (c.split('@').next().unwrap_or(c).to_string(), o.passed)).collect()
}

/// Build the report from outcomes (oldest first) and the CKB.
pub fn build(ctx: &Ctx, outcomes: &[Outcome], req: &ReportRequest) -> CkbReport {
    let gates: Vec<&Outcome> =
        outcomes.iter().filter(|o| GATES.contains(&o.tool.as_str()) && !o.engine.is_empty()).collect();
    let mut per_contract: BTreeMap<String, BTreeMap<String, Vec<(f64, bool)>>> = BTreeMap::new();
    let mut modes: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut per_level: BTreeMap<String, BTreeMap<String, Vec<(f64, bool)>>> = BTreeMap::new();
    for o in &gates {
        let t = secs(&o.time);
        let found: Vec<String> =
            Figures::read(&o.tool, &o.figures).diagnoses().into_iter().map(str::to_owned).collect();
        for (id, passed) in verdicts(o) {
            if req.prefix.as_deref().is_some_and(|p| !id.starts_with(p)) {
                continue;
            }
            per_contract.entry(id.clone()).or_default().entry(o.engine.clone()).or_default().push((t, passed));
            per_level
                .entry(o.reference_level.clone())
                .or_default()
                .entry(format!("{}|{id}", o.engine))
                .or_default()
                .push((t, passed));
            for f in &found {
                let applies =
                    ctx.ckb.get(f).ok().and_then(|c| c.failure.as_ref()).is_some_and(|fm| fm.applies_to.contains(&id));
                if applies {
                    *modes.entry(id.clone()).or_default().entry(f.clone()).or_default() += 1;
                }
            }
        }
    }
    let contracts = per_contract
        .iter()
        .map(|(id, seqs)| {
            let mut m: Vec<(&String, &usize)> = modes.get(id).map(|m| m.iter().collect()).unwrap_or_default();
            m.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            ContractRow {
                id: id.clone(),
                stats: stats(seqs),
                failure_modes: m.into_iter().take(3).map(|(f, n)| format!("{f} ({n})")).collect(),
            }
        })
        .collect();
    let levels = ["zero", "docs", "code"]
        .iter()
        .map(|l| LevelRow { level: l.to_string(), stats: stats(&per_level.get(*l).cloned().unwrap_or_default()) })
        .collect();
    // engine -> (reference level, gate -> (attempts, time of first pass))
    type Steps<'a> = BTreeMap<&'a str, (usize, String)>;
    let mut per_engine: BTreeMap<String, (String, Steps)> = BTreeMap::new();
    for o in &gates {
        let e = per_engine.entry(o.engine.clone()).or_insert_with(|| (o.reference_level.clone(), BTreeMap::new()));
        let step = e.1.entry(GATES.iter().find(|g| **g == o.tool).copied().unwrap_or("")).or_default();
        step.0 += 1;
        if o.passed && step.1.is_empty() {
            step.1 = o.time.clone();
        }
    }
    let engines = per_engine
        .into_iter()
        .map(|(engine, (level, steps))| EngineTimeline {
            engine,
            level,
            steps: GATES
                .iter()
                .filter_map(|g| {
                    steps.get(g).map(|(n, t)| PhaseStep { tool: g.to_string(), attempts: *n, first_pass: t.clone() })
                })
                .collect(),
        })
        .collect();
    let mut coverage = Vec::new();
    for fam in ctx.ckb.of_kind(Kind::Model) {
        for plat in ctx.ckb.of_kind(Kind::Platform) {
            let p = plat.platform.as_ref().expect("lint: platform section");
            for dtype in &p.dtypes {
                let verified = outcomes.iter().any(|o| {
                    o.tool == "verify_generation"
                        && o.passed
                        && o.contracts.iter().any(|c| c.split('@').next() == Some(fam.id.as_str()))
                        && o.constraints.get("dtype").and_then(|d| d.as_str()).unwrap_or("f32") == dtype
                        && o.constraints.get("target").and_then(|d| d.as_str()).unwrap_or("cpu") == p.target
                });
                coverage.push(CoverageCell {
                    family: fam.id.clone(),
                    target: p.target.clone(),
                    dtype: dtype.clone(),
                    status: if verified { "verified" } else { "covered" }.into(),
                });
            }
        }
    }
    CkbReport { outcomes: outcomes.len(), contracts, levels, engines, coverage }
}

/// Report from the context's ledger.
///
/// # Errors
/// An unreadable ledger.
pub fn report(ctx: &Ctx, req: &ReportRequest) -> Result<CkbReport> {
    let ledger = Ledger::open(&ctx.ledger)?;
    let mut all = ledger.list(0, ledger.count()?)?;
    all.reverse();
    Ok(build(ctx, &all, req))
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

impl Report for CkbReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        let mut s = format!("# CKB report ({} outcomes)\n\n## Per contract\n\n", self.outcomes);
        s += "| contract | attempts | engines | first-try pass | median attempts to green | median s to green | never green | failure modes |\n|---|---|---|---|---|---|---|---|\n";
        for c in &self.contracts {
            let st = &c.stats;
            s += &format!(
                "| {} | {} | {} | {} | {:.1} | {:.0} | {} | {} |\n",
                c.id,
                st.attempts,
                st.engines,
                pct(st.first_try_pass_rate),
                st.median_attempts_to_green,
                st.median_seconds_to_green,
                st.never_green,
                c.failure_modes.join(", ")
            );
        }
        s += "\n## Per reference level\n\n| level | attempts | (engine, contract) pairs | first-try pass | median attempts to green | never green |\n|---|---|---|---|---|---|\n";
        for l in &self.levels {
            let st = &l.stats;
            s += &format!(
                "| {} | {} | {} | {} | {:.1} | {} |\n",
                l.level,
                st.attempts,
                st.engines,
                pct(st.first_try_pass_rate),
                st.median_attempts_to_green,
                st.never_green
            );
        }
        s += "\n## Engines\n\n";
        for e in &self.engines {
            s += &format!("- {} ({}): ", e.engine, e.level);
            let steps: Vec<String> = e
                .steps
                .iter()
                .map(|p| {
                    format!(
                        "{} x{} {}",
                        p.tool,
                        p.attempts,
                        if p.first_pass.is_empty() { "never passed" } else { &p.first_pass }
                    )
                })
                .collect();
            s += &(steps.join(" -> ") + "\n");
        }
        s += "\n## Coverage\n\n| family | target | dtype | status |\n|---|---|---|---|\n";
        for c in &self.coverage {
            s += &format!("| {} | {} | {} | {} |\n", c.family, c.target, c.dtype, c.status);
        }
        s
    }
}
