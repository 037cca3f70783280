//! `reference add|list`: register the token fingerprints of another framework's source tree, so
//! the provenance rule can flag engine code copied from it. Only fingerprints are stored, never code.

use std::path::Path;

use super::Ctx;
use base::error::{Context, Error, Result};
use ledger::Ledger;

/// A registered reference tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferenceSummary {
    /// Name it is registered under.
    pub name: String,
    /// Source files fingerprinted.
    pub files: usize,
    /// Fingerprints stored.
    pub prints: usize,
}

/// Fingerprint `dir` and register it under `name` (default: the directory's name), replacing an
/// earlier registration of that name.
///
/// # Errors
/// A directory that does not exist or holds no source files, or a ledger failure.
pub fn add(ctx: &Ctx, dir: &Path, name: Option<&str>) -> Result<ReferenceSummary> {
    let dir = dir.canonicalize().usage_ctx(|| dir.display().to_string())?;
    let name = name
        .map(str::to_owned)
        .unwrap_or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
    let refs = guard::provenance::fingerprint_tree(&name, &dir);
    if refs.is_empty() {
        return Err(Error::usage(format!("{} holds no source files to fingerprint", dir.display())));
    }
    let files: Vec<(String, Vec<(u64, u32)>)> =
        refs.iter().map(|r| (r.file.clone(), r.prints.iter().map(|p| (p.hash, p.line)).collect())).collect();
    let prints = files.iter().map(|f| f.1.len()).sum();
    Ledger::open(&ctx.ledger)?.add_reference(&name, &files)?;
    Ok(ReferenceSummary { name, files: files.len(), prints })
}

/// Every registered reference, by name.
///
/// # Errors
/// A ledger failure.
pub fn list(ctx: &Ctx) -> Result<Vec<ReferenceSummary>> {
    let mut by_name: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    for (n, _, p) in Ledger::open(&ctx.ledger)?.references()? {
        let e = by_name.entry(n).or_default();
        e.0 += 1;
        e.1 += p.len();
    }
    Ok(by_name.into_iter().map(|(name, (files, prints))| ReferenceSummary { name, files, prints }).collect())
}
