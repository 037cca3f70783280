//! lookup_contract: show one contract by id, or search by text.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use crate::error::{Error, Result};

/// Show a contract by id, or search contracts by text.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct LookupRequest {
    /// Exact contract id, e.g. `kernel.rope`. Give this or `query`.
    #[serde(default)]
    pub id: Option<String>,
    /// Words to search for in ids, summaries, math and pseudocode, e.g. `rotary half`.
    #[serde(default)]
    pub query: Option<String>,
    /// Index of the first search hit to return (pagination); the previous page's `next_cursor`.
    #[serde(default)]
    pub cursor: Option<usize>,
}

/// A contract in brief.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ContractBrief {
    /// Contract id.
    pub id: String,
    /// Kind (kernel, component, model, platform, failure).
    pub kind: String,
    /// Version.
    pub version: u32,
    /// One-line summary.
    pub summary: String,
}

/// Lookup result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct LookupReport {
    /// Matching contracts (one for an id lookup).
    pub matches: Vec<ContractBrief>,
    /// For an id lookup: the whole contract as TOML, exactly as in the knowledge base.
    pub contract_toml: String,
    /// Cursor of the next page of search hits, absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<usize>,
}

impl Report for LookupReport {
    fn passed(&self) -> bool {
        !self.matches.is_empty()
    }
    fn text(&self) -> String {
        if !self.contract_toml.is_empty() {
            return self.contract_toml.clone();
        }
        let mut s = format!("{} match(es)\n", self.matches.len());
        for m in &self.matches {
            s += &format!("{} (v{}, {}): {}\n", m.id, m.version, m.kind, m.summary);
        }
        if let Some(c) = self.next_cursor {
            s += &format!("more: pass cursor {c}\n");
        }
        s
    }
}

/// Search hits per page.
pub const PAGE: usize = 25;

fn brief(c: &crate::ckb::Contract) -> ContractBrief {
    ContractBrief { id: c.id.clone(), kind: c.kind.prefix().into(), version: c.version, summary: c.summary.clone() }
}

/// Look up a contract.
///
/// # Errors
/// Unknown id, or neither id nor query given.
pub fn lookup(ctx: &Ctx, req: &LookupRequest) -> Result<LookupReport> {
    let started = std::time::Instant::now();
    let report = lookup_only(ctx, req)?;
    let ids: Vec<&str> = report.matches.iter().map(|m| m.id.as_str()).collect();
    ctx.record(
        "lookup_contract",
        None,
        ctx.versioned(&ids),
        &report,
        crate::ledger::figures::Figures::Other(serde_json::json!({"matches": report.matches.len()})),
        started,
    );
    Ok(report)
}

fn lookup_only(ctx: &Ctx, req: &LookupRequest) -> Result<LookupReport> {
    match (&req.id, &req.query) {
        (Some(id), _) => {
            let c = ctx.ckb.get(id)?;
            let toml = toml::to_string_pretty(c).map_err(|e| Error::internal(format!("cannot render {id}: {e}")))?;
            Ok(LookupReport { matches: vec![brief(c)], contract_toml: toml, next_cursor: None })
        }
        (None, Some(q)) => {
            let hits = ctx.ckb.search(q);
            let start = req.cursor.unwrap_or(0).min(hits.len());
            let end = (start + PAGE).min(hits.len());
            Ok(LookupReport {
                matches: hits[start..end].iter().map(|c| brief(c)).collect(),
                contract_toml: String::new(),
                next_cursor: (end < hits.len()).then_some(end),
            })
        }
        (None, None) => Err(Error::usage("give `id` (e.g. kernel.rope) or `query` (e.g. \"rotary\")")),
    }
}
