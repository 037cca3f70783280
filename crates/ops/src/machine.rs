//! probe_machine: the machine's read bandwidth at each cache level and its peak f32 FLOP/s (the
//! roofline profile_engine compares an engine with), measured once per machine and cached in the
//! ledger by CPU model and core count.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Ctx;
use base::error::{Error, Result};
use ledger::Ledger;
use probe::MachineProbe;

/// Whether to measure again.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MachineRequest {
    /// Measure again even when a cached probe exists (takes about a minute).
    #[serde(default)]
    pub refresh: bool,
    /// Runs per figure, 1..=50 (default 5); each figure reports min, median and max.
    #[serde(default)]
    pub runs: Option<usize>,
}

/// The cached probe of this machine, or a new one (then cached). `progress` is told when a
/// measurement starts.
///
/// # Errors
/// An unreadable ledger, or runs outside 1..=50.
pub fn probe(ctx: &Ctx, req: &MachineRequest, progress: impl FnOnce(&str)) -> Result<MachineProbe> {
    let runs = req.runs.unwrap_or(5);
    if !(1..=50).contains(&runs) {
        return Err(Error::usage(format!("runs must be 1..=50, got {runs}")));
    }
    let l = Ledger::open(&ctx.ledger)?;
    let fp = probe::fingerprint();
    let cached = if req.refresh { None } else { l.probe(&fp)?.and_then(|v| serde_json::from_value(v).ok()) };
    if let Some(p) = cached {
        return Ok(p);
    }
    progress(&format!("probing {fp} ({runs} runs per figure)"));
    let p = probe::run(runs, 0.05);
    l.put_probe(&fp, &serde_json::to_value(&p).expect("probes serialise"))?;
    Ok(p)
}
