//! `ckb check`: every contract file validated (schema and lint), plus the checks that need the
//! oracle: every kernel contract has an f64 oracle, every failure mode's named mutant exists.
//! One call ([`check`]), so that the oracle checks can move into the CKB load as one piece.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Report;
use crate::ckb::{self, Ckb};
use crate::error::Result;

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
    let (loaded, mut findings) = Ckb::check_sources(files, origin.clone());
    if let Some(ckb) = &loaded {
        for c in ckb.of_kind(ckb::Kind::Kernel) {
            if !crate::oracle::kernel_oracle_exists(&c.id) {
                findings.push(ckb::Finding {
                    file: ckb.file_of(&c.id).unwrap_or_default().into(),
                    field: "/id".into(),
                    message: format!("no oracle implements `{}`; a kernel contract needs one in src/oracle", c.id),
                });
            }
        }
        for c in ckb.of_kind(ckb::Kind::Failure) {
            if let Some(m) = c.failure.as_ref().and_then(|f| f.mutant.as_deref())
                && !crate::oracle::mutants::mutant_exists(m)
            {
                findings.push(ckb::Finding {
                    file: ckb.file_of(&c.id).unwrap_or_default().into(),
                    field: "/failure/mutant".into(),
                    message: format!(
                        "no oracle mutant named `{m}`; add it in src/oracle/mutants.rs or remove the field"
                    ),
                });
            }
        }
    }
    Ok(CkbCheck {
        origin,
        contracts: loaded.as_ref().map(|c| c.all().count()).unwrap_or(0),
        passed: findings.is_empty(),
        findings,
    })
}
