//! ckb_report: what the ledger says about the knowledge base. Per contract: attempts, first-try pass
//! rate, attempts and time to green, frequent failure modes; the same per reference level (the axis
//! on which the seed paper compared source-code reference); per engine a phase timeline; and the
//! coverage matrix (family x platform x dtype: covered, verified by an engine, never exercised).

use std::collections::BTreeMap;
use std::time::SystemTime;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use base::error::Result;
use ckb::Kind;
use ledger::figures::Figures;
use ledger::{Ledger, Outcome};

/// What to report on, and which page of which section.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// Only contracts whose id starts with this, e.g. `kernel.`.
    #[serde(default)]
    pub prefix: Option<String>,
    /// One section to page through: `contracts`, `engines` or `coverage`; absent: the first page
    /// of each.
    #[serde(default)]
    pub section: Option<String>,
    /// The section's previous `next_cursor` (with `section`).
    #[serde(default)]
    pub cursor: Option<String>,
    /// Rows per section page, 1..=500 (default 50); fewer when they would not fit the output bound.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Only outcomes of engines whose directory contains this text.
    #[serde(default)]
    pub engine: Option<String>,
    /// Only outcomes under this contract id or id prefix.
    #[serde(default)]
    pub contract: Option<String>,
    /// Only outcomes at or after this UTC time, RFC 3339, e.g. `2026-12-01T00:00:00Z`.
    #[serde(default)]
    pub since: Option<String>,
}

/// Rows of each section in all, before paging.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct SectionTotals {
    /// Contract rows.
    pub contracts: usize,
    /// Engine timelines.
    pub engines: usize,
    /// Coverage cells.
    pub coverage: usize,
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
    /// Outcomes of this engine imported from another ledger (counted in the steps, never evidence).
    pub imported: usize,
}

/// One cell of the coverage matrix.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct CoverageCell {
    /// Model-family contract.
    pub family: String,
    /// Platform contract (two platforms may share a target, e.g. `platform.cuda-sm80` and
    /// `platform.cuda-sm90`).
    pub platform: String,
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
    /// Of those, imported from another ledger (`ledger import`): counted here, never evidence.
    pub imported: usize,
    /// Per contract.
    pub contracts: Vec<ContractRow>,
    /// Per reference level.
    pub levels: Vec<LevelRow>,
    /// Per engine.
    pub engines: Vec<EngineTimeline>,
    /// Coverage matrix.
    pub coverage: Vec<CoverageCell>,
    /// Rows of each section in all (the lists above are one page of them).
    pub totals: SectionTotals,
    /// Cursor of the next page of `contracts` (pass with `section: "contracts"`), absent at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contracts_next: Option<String>,
    /// Cursor of the next page of `engines`, absent at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engines_next: Option<String>,
    /// Cursor of the next page of `coverage`, absent at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coverage_next: Option<String>,
    /// Whether the text rendering gives counts and the first rows only (the structure is large).
    #[serde(skip)]
    pub summary_only: bool,
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
        median_attempts_to_green: base::stats::median(&to_green),
        median_seconds_to_green: base::stats::median(&time_to_green),
        never_green: never,
    }
}

/// Per-contract verdicts of one outcome: none where nothing ran for want of a device. A kernel
/// test carries one verdict per kernel in its figures, none for a kernel not written yet. A pass
/// credits every contract the gate ran under. A failure of another gate is charged to the
/// contracts at fault only: those its diagnosed failure modes apply to; else, for
/// verify_generation and profile_engine, the model family (the kernels answer for themselves in
/// their own tests, so a diverging forward pass does not make them "never green"); else, for
/// compile_engine, the contracts its compiler errors were hinted to; else every contract.
fn verdicts(ctx: &Ctx, o: &Outcome) -> Vec<(String, bool)> {
    let figures = Figures::read(&o.tool, &o.figures);
    if figures.no_device() {
        return vec![];
    }
    if let Figures::KernelTest(f) = &figures
        && !f.kernels.is_empty()
    {
        return f.kernels.iter().filter(|k| !k.unwritten).map(|k| (k.id.clone(), k.passed)).collect();
    }
    let ids: Vec<String> = o.contracts.iter().map(|c| c.split('@').next().unwrap_or(c).to_string()).collect();
    let all = |passed: bool| ids.iter().map(|id| (id.clone(), passed)).collect::<Vec<_>>();
    if o.passed {
        return all(true);
    }
    let mut at_fault: Vec<String> = figures
        .diagnoses()
        .iter()
        .filter_map(|f| ctx.ckb.get(f).ok().and_then(|c| c.failure.clone()))
        .flat_map(|f| f.applies_to)
        .filter(|id| ids.contains(id))
        .collect();
    if at_fault.is_empty() && matches!(o.tool.as_str(), "verify_generation" | "profile_engine") {
        at_fault.extend(ids.iter().filter(|id| id.starts_with("model.")).cloned());
    }
    if let Figures::Compile(f) = &figures
        && at_fault.is_empty()
    {
        at_fault.extend(f.hinted.iter().filter(|id| ids.contains(id)).cloned());
    }
    if at_fault.is_empty() {
        return all(false);
    }
    at_fault.sort();
    at_fault.dedup();
    at_fault.into_iter().map(|id| (id, false)).collect()
}

/// Build the report from outcomes (oldest first) and the CKB.
pub fn build(ctx: &Ctx, outcomes: &[Outcome], req: &ReportRequest) -> CkbReport {
    // A cancelled call is neither a pass nor a failure: it counts in no rate.
    let gates: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| GATES.contains(&o.tool.as_str()) && !o.engine.is_empty() && !o.cancelled())
        .collect();
    let mut per_contract: BTreeMap<String, BTreeMap<String, Vec<(f64, bool)>>> = BTreeMap::new();
    let mut modes: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut per_level: BTreeMap<String, BTreeMap<String, Vec<(f64, bool)>>> = BTreeMap::new();
    for o in &gates {
        let t = secs(&o.time);
        let found: Vec<String> =
            Figures::read(&o.tool, &o.figures).diagnoses().into_iter().map(str::to_owned).collect();
        for (id, passed) in verdicts(ctx, o) {
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
    let contracts: Vec<ContractRow> = per_contract
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
    let mut per_engine: BTreeMap<String, (String, Steps, usize)> = BTreeMap::new();
    for o in &gates {
        let e = per_engine.entry(o.engine.clone()).or_insert_with(|| (o.reference_level.clone(), BTreeMap::new(), 0));
        e.2 += o.imported as usize;
        let step = e.1.entry(GATES.iter().find(|g| **g == o.tool).copied().unwrap_or("")).or_default();
        step.0 += 1;
        if o.passed && step.1.is_empty() {
            step.1 = o.time.clone();
        }
    }
    let engines: Vec<EngineTimeline> = per_engine
        .into_iter()
        .map(|(engine, (level, steps, imported))| EngineTimeline {
            engine,
            level,
            imported,
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
                    platform: plat.id.clone(),
                    target: p.target.clone(),
                    dtype: dtype.clone(),
                    status: if verified { "verified" } else { "covered" }.into(),
                });
            }
        }
    }
    CkbReport {
        outcomes: outcomes.len(),
        totals: SectionTotals { contracts: contracts.len(), engines: engines.len(), coverage: coverage.len() },
        imported: outcomes.iter().filter(|o| o.imported).count(),
        contracts,
        levels,
        engines,
        coverage,
        contracts_next: None,
        engines_next: None,
        coverage_next: None,
        summary_only: false,
    }
}

/// One page of a section: the rows after `cursor`, at most `limit`, fitting `budget` characters of
/// JSON; and the cursor of the next page.
fn page_of<T: Serialize>(
    rows: Vec<T>,
    cursor: Option<&str>,
    limit: usize,
    budget: usize,
    key: impl Fn(&T) -> String,
) -> Result<(Vec<T>, Option<String>)> {
    let mut rest = super::page::after(rows, cursor, &key)?;
    let more = rest.len() > limit;
    rest.truncate(limit);
    let (page, cut) = super::page::fit(rest, budget);
    let next = (more || cut).then(|| page.last().map(&key)).flatten();
    Ok((page, next))
}

/// Report from the context's ledger, one page per section, bounded by the context's output bound
/// in its JSON as in its text.
///
/// # Errors
/// An unreadable ledger, an unknown section, a cursor without a section, or a bad limit or time.
pub fn report(ctx: &Ctx, req: &ReportRequest) -> Result<CkbReport> {
    let limit = req.limit.unwrap_or(50);
    if !(1..=500).contains(&limit) {
        return Err(base::error::Error::usage(format!("limit must be 1..=500, got {limit}")));
    }
    let section = req.section.as_deref();
    if let Some(s) = section
        && !matches!(s, "contracts" | "engines" | "coverage")
    {
        return Err(base::error::Error::usage(format!(
            "unknown section `{s}`; sections: contracts, engines, coverage"
        )));
    }
    if req.cursor.is_some() && section.is_none() {
        return Err(base::error::Error::usage(
            "a cursor belongs to a section: pass `section` with it (e.g. \"engines\")",
        ));
    }
    if let Some(t) = &req.since {
        humantime::parse_rfc3339_weak(t).map_err(|e| {
            base::error::Error::usage(format!("since `{t}` is not an RFC 3339 time such as 2026-12-01T00:00:00Z: {e}"))
        })?;
    }
    let ledger = Ledger::open(&ctx.ledger)?;
    let filter = ledger::OutcomeFilter {
        engine: req.engine.clone(),
        contract: req.contract.clone(),
        since: req.since.clone(),
        ..Default::default()
    };
    let mut all: Vec<Outcome> = ledger.page(&filter, i64::MAX as usize)?.into_iter().map(|(_, o)| o).collect();
    all.reverse();
    let mut r = build(ctx, &all, req);
    // The levels table is three rows; the rest of the bound is shared by the sections asked for.
    let room = ctx.max_output.saturating_sub(super::page::json_len(&r.levels) + 600);
    let share = if section.is_some() { room } else { room / 3 };
    let wants = |s: &str| section.is_none_or(|x| x == s);
    let cur = req.cursor.as_deref();
    (r.contracts, r.contracts_next) = if wants("contracts") {
        page_of(std::mem::take(&mut r.contracts), cur, limit, share, |c| c.id.clone())?
    } else {
        (vec![], None)
    };
    (r.engines, r.engines_next) = if wants("engines") {
        page_of(std::mem::take(&mut r.engines), cur, limit, share, |e| e.engine.clone())?
    } else {
        (vec![], None)
    };
    (r.coverage, r.coverage_next) = if wants("coverage") {
        page_of(std::mem::take(&mut r.coverage), cur, limit, share, |c| {
            format!("{}|{}|{}", c.family, c.platform, c.dtype)
        })?
    } else {
        (vec![], None)
    };
    r.summary_only = super::page::json_len(&r) > ctx.max_output / 2;
    Ok(r)
}

impl CkbReport {
    /// Where each section stands and how to get its next page.
    fn paging(&self) -> String {
        let mut s = format!(
            "This page: {} of {} contracts, {} of {} engines, {} of {} coverage cells.\n",
            self.contracts.len(),
            self.totals.contracts,
            self.engines.len(),
            self.totals.engines,
            self.coverage.len(),
            self.totals.coverage
        );
        for (name, next) in
            [("contracts", &self.contracts_next), ("engines", &self.engines_next), ("coverage", &self.coverage_next)]
        {
            if let Some(c) = next {
                s += &format!("More {name}: pass section \"{name}\" and cursor \"{c}\".\n");
            }
        }
        s + "\n"
    }

    /// A short text for a large report: counts, the reference levels, the contracts with the
    /// lowest first-try pass rates, and how to page (the rows are in the structured content).
    fn summary(&self) -> String {
        let mut s =
            format!("# CKB report ({} outcomes), summary; every row is in the structured content\n\n", self.outcomes);
        s += &self.paging();
        for l in &self.levels {
            s += &format!(
                "level {}: {} attempts, first-try pass {}, never green {}\n",
                l.level,
                l.stats.attempts,
                pct(l.stats.first_try_pass_rate),
                l.stats.never_green
            );
        }
        let mut hardest: Vec<&ContractRow> = self.contracts.iter().collect();
        hardest.sort_by(|a, b| a.stats.first_try_pass_rate.total_cmp(&b.stats.first_try_pass_rate));
        s += "\nLowest first-try pass rates on this page:\n";
        for c in hardest.into_iter().take(10) {
            s += &format!(
                "- {}: {} over {} engines, modes {}\n",
                c.id,
                pct(c.stats.first_try_pass_rate),
                c.stats.engines,
                c.failure_modes.join(", ")
            );
        }
        s
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

impl Report for CkbReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        if self.summary_only {
            return self.summary();
        }
        let mut s = format!(
            "# CKB report ({} outcomes{})\n\n{}",
            self.outcomes,
            if self.imported > 0 { format!(", {} imported", self.imported) } else { String::new() },
            self.paging()
        );
        // A section with no row on this page but rows in the report was left out of this page
        // (another section asked for): no empty table for it.
        let shown = |rows: usize, total: usize| rows > 0 || total == 0;
        // A median over no engine that reached green is no figure.
        let to_green = |st: &Stats, x: String| if st.never_green == st.engines { "-".to_string() } else { x };
        if shown(self.contracts.len(), self.totals.contracts) {
            s += "## Per contract\n\n";
            s += "| contract | attempts | engines | first-try pass | median attempts to green | median s to green | never green | failure modes |\n|---|---|---|---|---|---|---|---|\n";
            for c in &self.contracts {
                let st = &c.stats;
                s += &format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    c.id,
                    st.attempts,
                    st.engines,
                    pct(st.first_try_pass_rate),
                    to_green(st, format!("{:.1}", st.median_attempts_to_green)),
                    to_green(st, format!("{:.0}", st.median_seconds_to_green)),
                    st.never_green,
                    c.failure_modes.join(", ")
                );
            }
            s += "\n";
        }
        s += "## Per reference level\n\n| level | attempts | (engine, contract) pairs | first-try pass | median attempts to green | never green |\n|---|---|---|---|---|---|\n";
        for l in &self.levels {
            let st = &l.stats;
            s += &format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                l.level,
                st.attempts,
                st.engines,
                pct(st.first_try_pass_rate),
                to_green(st, format!("{:.1}", st.median_attempts_to_green)),
                st.never_green
            );
        }
        if shown(self.engines.len(), self.totals.engines) {
            s += "\n## Engines\n\n";
        }
        for e in &self.engines {
            s += &format!(
                "- {} ({}{}): ",
                e.engine,
                e.level,
                if e.imported > 0 { format!("; {} imported", e.imported) } else { String::new() }
            );
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
        if shown(self.coverage.len(), self.totals.coverage) {
            s += "\n## Coverage\n\n| family | platform | target | dtype | status |\n|---|---|---|---|---|\n";
        }
        for c in &self.coverage {
            s += &format!("| {} | {} | {} | {} | {} |\n", c.family, c.platform, c.target, c.dtype, c.status);
        }
        s
    }
}
