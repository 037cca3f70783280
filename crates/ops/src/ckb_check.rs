//! `ckb check`: every contract file validated (schema and lint) and checked against what the server
//! implements (every kernel contract has an f64 oracle, every failure mode's named mutant exists),
//! exactly as the server's own load and propose_contract check it.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Report;
use base::error::Result;
use ckb::{self, Ckb};

/// The result of checking a knowledge base.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct CkbCheck {
    /// Where the contracts came from (`embedded` or the working copy's directory).
    pub origin: String,
    /// Contracts loaded.
    pub contracts: usize,
    /// Whether there is no finding.
    pub passed: bool,
    /// Every finding: file, field, message.
    pub findings: Vec<ckb::Finding>,
}

impl Report for CkbCheck {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        if self.findings.is_empty() {
            return format!(
                "ckb check passed: {} contracts in {}, schema-valid and lint-clean\n",
                self.contracts, self.origin
            );
        }
        let mut s = format!("ckb check FAILED: {} finding(s) in {}\n", self.findings.len(), self.origin);
        for f in &self.findings {
            s += &format!("  {f}\n");
        }
        s
    }
}

/// Check the knowledge base in `dir` (a working copy) or the built-in one.
///
/// # Errors
/// An unreadable directory.
pub fn check(dir: Option<&Path>) -> Result<CkbCheck> {
    let (files, origin) = match dir {
        Some(d) => (ckb::read_dir_files(d)?, d.display().to_string()),
        None => (ckb::embedded_files(), "embedded".to_string()),
    };
    let (loaded, findings) = Ckb::check_sources(files, origin.clone(), Some(&oracle::implemented()));
    Ok(CkbCheck {
        origin,
        contracts: loaded.as_ref().map(|c| c.all().count()).unwrap_or(0),
        passed: findings.is_empty(),
        findings,
    })
}
