//! list_outcomes: the ledger's recorded outcomes, newest first, paginated with a cursor.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use crate::error::{Error, Result};
use crate::ledger::Ledger;

/// Which page of outcomes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct OutcomesRequest {
    /// Number of newer outcomes to skip (the previous page's `next_cursor`).
    #[serde(default)]
    pub cursor: Option<usize>,
    /// Outcomes per page, 1..=100 (default 20).
    #[serde(default)]
    pub limit: Option<usize>,
    /// Only outcomes of this tool, e.g. `run_kernel_test`.
    #[serde(default)]
    pub tool: Option<String>,
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
    /// One-line summary.
    pub summary: String,
    /// Engine source hash (first 12 hex digits), "" when none.
    pub engine_hash: String,
    /// Contracts with versions.
    pub contracts: Vec<String>,
    /// Reference level.
    pub reference_level: String,
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
    /// Outcomes in the ledger (all tools).
    pub total: usize,
    /// This page, newest first.
    pub outcomes: Vec<OutcomeView>,
    /// Cursor of the next page, absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<usize>,
}

impl Report for OutcomesReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        let mut s = format!("{} outcomes in the ledger; showing {}\n", self.total, self.outcomes.len());
        for o in &self.outcomes {
            s += &format!(
                "{} {:<18} {:<4} {:>7} ms {:<12} {}{}\n",
                o.time,
                o.tool,
                if o.passed { "pass" } else { "FAIL" },
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
        if let Some(c) = self.next_cursor {
            s += &format!("more: pass cursor {c}\n");
        }
        s
    }
}

/// List outcomes.
///
/// # Errors
/// An unreadable ledger or a limit outside 1..=100.
pub fn list(ctx: &Ctx, req: &OutcomesRequest) -> Result<OutcomesReport> {
    let limit = req.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(Error::usage(format!("limit must be 1..=100, got {limit}")));
    }
    let ledger = Ledger::open(&ctx.ledger)?;
    let start = req.cursor.unwrap_or(0);
    // Fetch one extra to know whether a next page exists.
    let rows = ledger.list_filtered(start, limit + 1, req.tool.as_deref())?;
    let more = rows.len() > limit;
    Ok(OutcomesReport {
        total: ledger.count()?,
        outcomes: rows
            .into_iter()
            .take(limit)
            .map(|o| OutcomeView {
                id: o.id,
                time: o.time,
                tool: o.tool,
                passed: o.passed,
                summary: o.summary,
                engine_hash: o.engine_hash.chars().take(12).collect(),
                contracts: o.contracts,
                reference_level: o.reference_level,
                duration_ms: o.duration_ms,
                figures_json: o.figures.to_string(),
                imported: o.imported,
                authenticated: o.authenticated,
            })
            .collect(),
        next_cursor: more.then_some(start + limit),
    })
}
