//! Rule `dependency-denied` / `dependency-not-allowed`: the engine's fully resolved dependency graph
//! (transitive, from `cargo metadata`) holds no inference framework or its bindings. The deny list
//! and the per-target allow lists live in the CKB's policy contracts, with a reason per entry.

use super::Finding;
use ckb::{Ckb, Kind};

/// Check resolved packages (name, version) against every policy contract.
pub fn check(ckb: &Ckb, target: &str, packages: &[(String, String)]) -> Vec<Finding> {
    let mut out = Vec::new();
    for c in ckb.of_kind(Kind::Policy) {
        let Some(p) = &c.policy else { continue };
        for (name, version) in packages {
            if let Some(d) = p.deny.iter().find(|d| d.matches(name)) {
                out.push(Finding::blocking(
                    "dependency-denied",
                    "Cargo.toml",
                    0,
                    format!(
                        "the dependency graph contains `{name} {version}` (denied by {} pattern `{}`: {}); remove the dependency that pulls it in (`cargo tree -i {name}` shows which) and implement the part from the contracts",
                        c.id, d.pattern, d.reason
                    ),
                ));
            }
            if let Some(allow) = p.allow.get(target)
                && !allow.iter().any(|a| a == name)
            {
                out.push(Finding::blocking(
                    "dependency-not-allowed",
                    "Cargo.toml",
                    0,
                    format!("`{name}` is not on {}'s allow list for target `{target}` ({})", c.id, allow.join(", ")),
                ));
            }
        }
    }
    out
}
