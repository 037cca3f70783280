//! list_outcomes: the ledger's recorded outcomes, newest first, filtered (tool, engine, contract,
//! since) and paginated with a keyset cursor, so new outcomes never shift a page.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use base::error::{Error, Result};
use ledger::{Ledger, OutcomeFilter};

/// Which page of outcomes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutcomesRequest {
    /// The previous page's `next_cursor`; absent: the newest outcomes.
    #[serde(default)]
    pub cursor: Option<String>,
    /// Outcomes per page, 1..=100 (default 20); fewer when they would not fit the output bound.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Only outcomes of this tool, e.g. `run_kernel_test`.
    #[serde(default)]
    pub tool: Option<String>,
    /// Only outcomes whose engine directory contains this text, e.g. the engine's folder name.
    #[serde(default)]
    pub engine: Option<String>,
    /// Only outcomes under this contract id or id prefix, e.g. `kernel.rope` or `kernel.`.
    #[serde(default)]
    pub contract: Option<String>,
    /// Only outcomes at or after this UTC time, RFC 3339, e.g. `2026-12-01T00:00:00Z`.
    #[serde(default)]
    pub since: Option<String>,
}

/// One outcome as listed.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct OutcomeView {
    /// Outcome id.
    pub id: String,
    /// UTC time.
    pub time: String,
    /// Tool.
    pub tool: String,
    /// Whether it passed.
    pub passed: bool,
    /// `passed`, `failed` or `cancelled` (cancelled calls count in no pass rate).
    pub status: String,
    /// One-line summary.
    pub summary: String,
    /// Engine directory, "" when none.
    pub engine: String,
    /// Engine source hash (first 12 hex digits), "" when none.
    pub engine_hash: String,
    /// Contracts with versions.
    pub contracts: Vec<String>,
    /// Reference level.
    pub reference_level: String,
    /// The MCP client (`name/version`) or `cli`.
    pub client: String,
    /// Wall time, ms.
    pub duration_ms: u64,
    /// Figures as a JSON text.
    pub figures_json: String,
    /// Imported from another ledger (`ledger import`): shown, never evidence.
    pub imported: bool,
    /// Recorded by this server from its own run and unchanged since (its HMAC verifies): only such
    /// outcomes are evidence for phase order and promotion.
    pub authenticated: bool,
}

/// A page of outcomes.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct OutcomesReport {
    /// Outcomes in the ledger that match the filters.
    pub total: usize,
    /// This page, newest first.
    pub outcomes: Vec<OutcomeView>,
    /// Cursor of the next page (pass it as `cursor`), absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

impl Report for OutcomesReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        if self.total == 0 {
            return "no outcomes recorded (or none match the filters)\n".into();
        }
        let mut s = format!("{} outcomes match; showing {}\n", self.total, self.outcomes.len());
        for o in &self.outcomes {
            s += &format!(
                "{} {:<18} {:<9} {:>7} ms {:<12} {}{}\n",
                o.time,
                o.tool,
                o.status,
                o.duration_ms,
                if o.engine_hash.is_empty() { "-" } else { &o.engine_hash },
                if o.imported {
                    "[imported] "
                } else if !o.authenticated {
                    "[unauthenticated] "
                } else {
                    ""
                },
                o.summary
            );
        }
        if let Some(c) = &self.next_cursor {
            s += &format!("more: pass cursor \"{c}\"\n");
        }
        s
    }
}

/// List outcomes.
///
/// # Errors
/// An unreadable ledger, a limit outside 1..=100, or a malformed cursor or time.
pub fn list(ctx: &Ctx, req: &OutcomesRequest) -> Result<OutcomesReport> {
    let limit = req.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(Error::usage(format!("limit must be 1..=100, got {limit}")));
    }
    let before = req
        .cursor
        .as_deref()
        .map(|c| {
            c.parse::<i64>()
                .map_err(|_| Error::usage(format!("cursor `{c}` is not one this tool returned; call again without it")))
        })
        .transpose()?;
    if let Some(t) = &req.since {
        humantime::parse_rfc3339_weak(t).map_err(|e| {
            Error::usage(format!("since `{t}` is not an RFC 3339 time such as 2026-12-01T00:00:00Z: {e}"))
        })?;
    }
    let filter = OutcomeFilter {
        tool: req.tool.clone(),
        engine: req.engine.clone(),
        contract: req.contract.clone(),
        since: req.since.clone(),
        before,
    };
    let ledger = Ledger::open(&ctx.ledger)?;
    // Fetch one extra to know whether a next page exists.
    let rows = ledger.page(&filter, limit + 1)?;
    let more = rows.len() > limit;
    let views: Vec<(i64, OutcomeView)> = rows
        .into_iter()
        .take(limit)
        .map(|(rowid, o)| {
            (
                rowid,
                OutcomeView {
                    status: o.status().to_string(),
                    id: o.id,
                    time: o.time,
                    tool: o.tool,
                    passed: o.passed,
                    summary: o.summary,
                    engine: o.engine,
                    engine_hash: o.engine_hash.chars().take(12).collect(),
                    contracts: o.contracts,
                    reference_level: o.reference_level,
                    client: o.client,
                    duration_ms: o.duration_ms,
                    figures_json: o.figures.to_string(),
                    imported: o.imported,
                    authenticated: o.authenticated,
                },
            )
        })
        .collect();
    let (page, cut) = super::page::fit(views, ctx.max_output.saturating_sub(200));
    let next_cursor = (more || cut).then(|| page.last().map(|(r, _)| r.to_string())).flatten();
    Ok(OutcomesReport {
        total: ledger.count_matching(&filter)?,
        outcomes: page.into_iter().map(|(_, v)| v).collect(),
        next_cursor,
    })
}
