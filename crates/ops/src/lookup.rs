//! lookup_contract: contracts by id, by a list of ids, by build phase of a model family (with
//! their failure modes and what they require, each contract once), or search hits by text. The
//! structured content carries the contracts whole (TOML, failure modes, requirements); the text is
//! a short index of them. Pages fit the output bound and continue from a keyset cursor.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use base::error::{Context, Error, Result};
use ckb::{Contract, Phase};

/// Which contracts: give one of `id`, `ids`, `phase` or `query`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LookupRequest {
    /// Exact contract id, e.g. `kernel.rope`.
    #[serde(default)]
    pub id: Option<String>,
    /// Several contract ids, e.g. from a plan's phase; each is returned once.
    #[serde(default)]
    pub ids: Vec<String>,
    /// A build phase (kernels, weight_loading, decoder_layer, full_forward, generation,
    /// performance): the contracts of that phase for `family`, with their failure modes and the
    /// contracts they require, each once.
    #[serde(default)]
    pub phase: Option<String>,
    /// Model-family contract for `phase` (default `model.llama`).
    #[serde(default)]
    pub family: Option<String>,
    /// Weight dtype for `phase` (default f32): picks the linear kernel of that dtype.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Words to search for in ids, summaries, math and pseudocode, e.g. `rotary half`.
    #[serde(default)]
    pub query: Option<String>,
    /// The previous page's `next_cursor`.
    #[serde(default)]
    pub cursor: Option<String>,
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

/// A contract whole.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ContractFull {
    /// Contract id.
    pub id: String,
    /// Kind (kernel, component, model, platform, failure, policy).
    pub kind: String,
    /// Version.
    pub version: u32,
    /// One-line summary.
    pub summary: String,
    /// Failure-mode contract ids that apply to it.
    pub failure_modes: Vec<String>,
    /// Contract ids it builds on.
    pub requires: Vec<String>,
    /// The whole contract as TOML, exactly as in the knowledge base.
    pub toml: String,
    /// A model family's forward-pass graph, one node a line (`name = op(inputs) slot=tensor
    /// param=value`, by block); absent for other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graph: Option<String>,
    /// Characters cut from `toml` and `graph` to keep the result within the server's output bound
    /// (`--max-output`); 0 when whole. The whole contract is the resource `ckb://contract/{id}`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cut: usize,
    /// A staged candidate (proposed, not promoted): plan and scaffold route through it
    /// provisionally; what would promote it is in plan's `provisional` description.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub staged: bool,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Keep `text` to `max` characters, ending with a line that says how much was cut and where the
/// whole is; returns the characters cut.
fn cut_to(text: &mut String, max: usize, id: &str) -> usize {
    let n = text.chars().count();
    if n <= max {
        return 0;
    }
    let keep: String = text.chars().take(max).collect();
    *text = format!("{keep}\n# [... {} characters cut; the whole contract: resource ckb://contract/{id}]", n - max);
    n - max
}

/// Bound a report's structured size to about `max` characters: each contract's `toml` and `graph`
/// get an equal share of what the rest leaves (at least 200 characters each).
fn bound(report: &mut LookupReport, max: usize) {
    if super::page::json_len(&*report) <= max {
        return;
    }
    let texts = report.contracts.iter().map(|c| 1 + usize::from(c.graph.is_some())).sum::<usize>().max(1);
    let fixed = {
        let mut bare = report.clone();
        for c in &mut bare.contracts {
            c.toml.clear();
            c.graph = c.graph.as_ref().map(|_| String::new());
        }
        super::page::json_len(&bare)
    };
    // JSON escapes (quotes, newlines) make a text longer than its characters: leave a margin.
    let share = (max.saturating_sub(fixed) * 3 / 4 / texts).saturating_sub(120).max(200);
    for c in &mut report.contracts {
        let id = c.id.clone();
        c.cut = cut_to(&mut c.toml, share, &id);
        if let Some(g) = &mut c.graph {
            c.cut += cut_to(g, share, &id);
        }
    }
}

/// Lookup result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct LookupReport {
    /// Search hits in brief (a `query`); empty otherwise.
    pub matches: Vec<ContractBrief>,
    /// The contracts asked for (`id`, `ids`, `phase`), whole, each once.
    pub contracts: Vec<ContractFull>,
    /// Cursor of the next page, absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

impl Report for LookupReport {
    fn passed(&self) -> bool {
        !self.matches.is_empty() || !self.contracts.is_empty()
    }
    fn text(&self) -> String {
        let mut s = String::new();
        if !self.contracts.is_empty() {
            let ids: Vec<&str> = self.contracts.iter().map(|c| c.id.as_str()).collect();
            s += &format!(
                "{} contract(s): {}\neach whole (TOML) in the structured content `contracts[].toml`, or as resource ckb://contract/{{id}}\n",
                ids.len(),
                ids.join(", ")
            );
            for c in &self.contracts {
                let staged = if c.staged { ", staged: proposed, not promoted" } else { "" };
                s += &format!("- {} (v{}, {}{staged}): {}\n", c.id, c.version, c.kind, c.summary);
                if c.cut > 0 {
                    s += &format!(
                        "  {} characters of its TOML and graph cut to the output bound; read it whole as resource ckb://contract/{}\n",
                        c.cut, c.id
                    );
                }
                if !c.failure_modes.is_empty() {
                    s += &format!("  failure modes: {}\n", c.failure_modes.join(", "));
                }
                if !c.requires.is_empty() {
                    s += &format!("  requires: {}\n", c.requires.join(", "));
                }
            }
        } else {
            s += &format!("{} match(es)\n", self.matches.len());
            for m in &self.matches {
                s += &format!("{} (v{}, {}): {}\n", m.id, m.version, m.kind, m.summary);
            }
        }
        if let Some(c) = &self.next_cursor {
            s += &format!("more: pass cursor \"{c}\"\n");
        }
        s
    }
}

/// Search hits per page at most.
pub const PAGE: usize = 25;

fn brief(c: &Contract) -> ContractBrief {
    ContractBrief { id: c.id.clone(), kind: c.kind.prefix().into(), version: c.version, summary: c.summary.clone() }
}

fn full(c: &Contract, staged: bool) -> Result<ContractFull> {
    Ok(ContractFull {
        id: c.id.clone(),
        kind: c.kind.prefix().into(),
        version: c.version,
        summary: c.summary.clone(),
        failure_modes: c.failure_modes.clone(),
        requires: c.requires.clone(),
        toml: toml::to_string_pretty(c).internal_ctx(|| format!("cannot render {}", c.id))?,
        graph: c.model.as_ref().and_then(|m| m.graph.as_ref()).map(ckb::graph::render_graph),
        cut: 0,
        staged,
    })
}

/// Look up contracts and record the lookup.
///
/// # Errors
/// Unknown id, family or phase, none of id/ids/phase/query given, or a stale cursor.
pub fn lookup(ctx: &Ctx, req: &LookupRequest) -> Result<LookupReport> {
    let started = std::time::Instant::now();
    // Staged candidates too: the contract a new family's engine is written from.
    let live = ctx.live();
    let ctx = &*live;
    let mut report = lookup_only(ctx, req)?;
    bound(&mut report, ctx.max_output);
    let ids: Vec<&str> =
        report.matches.iter().map(|m| m.id.as_str()).chain(report.contracts.iter().map(|c| c.id.as_str())).collect();
    ctx.record(
        "lookup_contract",
        None,
        ctx.versioned(&ids),
        &report,
        ledger::figures::Figures::Other(serde_json::json!({"matches": ids.len()})),
        started,
    );
    Ok(report)
}

/// The contracts of `phase` for a family at a dtype, then their failure modes and requirements
/// (transitively), each once, in that order.
fn phase_ids(ctx: &Ctx, phase: &str, family: &str, dtype: &str) -> Result<Vec<String>> {
    let p = Phase::ALL.into_iter().find(|p| p.name() == phase).ok_or_else(|| {
        Error::usage(format!(
            "unknown phase `{phase}`; phases: {}",
            Phase::ALL.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
        ))
    })?;
    let fam = ctx.ckb.get(family)?;
    let m = fam.model.as_ref().ok_or_else(|| Error::usage(format!("`{family}` is not a model-family contract")))?;
    let kernels = ctx.ckb.kernels_for(fam, dtype).map_err(Error::usage)?;
    let mut ids: Vec<String> = kernels
        .iter()
        .chain(&m.components)
        .filter(|id| ctx.ckb.get(id).is_ok_and(|c| c.phase == Some(p)))
        .cloned()
        .collect();
    if matches!(p, Phase::DecoderLayer | Phase::FullForward) || fam.phase == Some(p) {
        ids.push(fam.id.clone());
    }
    Ok(ids)
}

/// `ids`, then every failure mode and requirement reachable from them, each once.
fn closure(ctx: &Ctx, ids: Vec<String>) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    let mut queue = ids;
    let mut i = 0;
    while i < queue.len() {
        let id = queue[i].clone();
        i += 1;
        if out.contains(&id) {
            continue;
        }
        let c = ctx.ckb.get(&id)?;
        out.push(id);
        queue.extend(c.failure_modes.iter().chain(&c.requires).filter(|x| ctx.ckb.get(x).is_ok()).cloned());
    }
    Ok(out)
}

fn lookup_only(ctx: &Ctx, req: &LookupRequest) -> Result<LookupReport> {
    let given = [req.id.is_some(), !req.ids.is_empty(), req.phase.is_some(), req.query.is_some()];
    if given.iter().filter(|g| **g).count() != 1 {
        return Err(Error::usage(
            "give exactly one of `id` (e.g. kernel.rope), `ids` (a list), `phase` (e.g. kernels) or `query` (e.g. \"rotary\")",
        ));
    }
    let budget = ctx.max_output.saturating_sub(200);
    if let Some(q) = &req.query {
        let hits: Vec<ContractBrief> = ctx.ckb.search(q).into_iter().map(brief).collect();
        let mut rest = super::page::after(hits, req.cursor.as_deref(), |b| b.id.clone())?;
        let more = rest.len() > PAGE;
        rest.truncate(PAGE);
        let (page, cut) = super::page::fit(rest, budget);
        let next_cursor = (more || cut).then(|| page.last().map(|b| b.id.clone())).flatten();
        return Ok(LookupReport { matches: page, contracts: vec![], next_cursor });
    }
    let ids = if let Some(id) = &req.id {
        vec![id.clone()]
    } else if let Some(phase) = &req.phase {
        let family = req.family.as_deref().unwrap_or("model.llama");
        closure(ctx, phase_ids(ctx, phase, family, req.dtype.as_deref().unwrap_or("f32"))?)?
    } else {
        let mut seen = Vec::new();
        for id in &req.ids {
            if !seen.contains(id) {
                seen.push(id.clone());
            }
        }
        seen
    };
    let contracts = ids
        .iter()
        .map(|id| ctx.ckb.get(id).and_then(|c| full(c, ctx.ckb.is_provisional(id))))
        .collect::<Result<Vec<_>>>()?;
    let rest = super::page::after(contracts, req.cursor.as_deref(), |c| c.id.clone())?;
    let (page, cut) = super::page::fit(rest, budget);
    let next_cursor = cut.then(|| page.last().map(|c| c.id.clone())).flatten();
    Ok(LookupReport { matches: vec![], contracts: page, next_cursor })
}
