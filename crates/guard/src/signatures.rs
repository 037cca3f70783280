//! Rule `signature-changed`: the public signatures the gates call are locked by the contracts
//! (`rust.skeleton`); each must appear, token for token, in its module file. Whitespace, line
//! breaks and trailing commas are ignored (rustfmt may reflow a signature). Items a contract marks
//! `optional` (added after an engine may have been scaffolded) are checked only where defined.

use super::{Finding, Tree};
use ckb::Ckb;

/// A signature in canonical form: whitespace-separated tokens, no trailing comma before `)`.
pub fn canonical(sig: &str) -> String {
    let mut s = sig.split_whitespace().collect::<Vec<_>>().join(" ");
    for (from, to) in [(", )", ")"), (",)", ")"), ("( ", "("), (" )", ")"), (" ,", ",")] {
        s = s.replace(from, to);
    }
    s
}

/// The `pub fn ...` signatures of a skeleton, up to (not including) the body's `{`, canonical.
pub fn signatures(skeleton: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = skeleton;
    while let Some(i) = rest.find("pub fn ") {
        let tail = &rest[i..];
        let end = tail.find('{').unwrap_or(tail.len());
        let sig = canonical(&tail[..end]);
        let name = sig.trim_start_matches("pub fn ").split(['(', '<']).next().unwrap_or("").to_string();
        out.push((name, sig));
        rest = &tail[end.min(tail.len())..];
        if rest.is_empty() {
            break;
        }
        rest = &rest[1..];
    }
    out
}

/// Whether a module's source defines a function `name` (`fn name(` or `fn name<`).
pub fn defines_fn(text: &str, name: &str) -> bool {
    let canon = canonical(text);
    canon.contains(&format!("fn {name}(")) || canon.contains(&format!("fn {name}<"))
}

/// Check the skeleton signatures of the contracts in `implements` (None: of every contract) against
/// the engine's module files. An f32 engine does not implement `kernel.linear_bf16`, so its
/// signature is not required of it. `api` (`host` or `cuda`) picks the skeleton of each contract
/// (`Contract::api_for`): a CUDA engine keeps the kernels' `cuda` signatures.
pub fn check(
    ckb: &Ckb,
    tree: &Tree,
    implements: Option<&std::collections::BTreeSet<String>>,
    api: &str,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut missing: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for c in ckb.all().filter(|c| implements.is_none_or(|ids| ids.contains(&c.id))) {
        let Some(rust) = c.api_for(api) else { continue };
        let rust = &rust;
        let rel = format!("src/{}.rs", rust.module);
        let file = tree.files.iter().find(|f| f.rel == rel);
        let Some(file) = file else {
            missing.entry(rel).or_default().push(c.id.clone());
            continue;
        };
        let body = canonical(&file.text);
        for (name, sig) in signatures(&rust.skeleton) {
            // An item added after the engine was scaffolded is checked only once the engine has it.
            if rust.optional.contains(&name) && !defines_fn(&file.text, &name) {
                continue;
            }
            if !body.contains(&sig) {
                let line = file
                    .text
                    .find(&format!("fn {name}"))
                    .map(|b| file.text[..b].matches('\n').count() as u32 + 1)
                    .unwrap_or(0);
                out.push(Finding::blocking(
                    "signature-changed",
                    &rel,
                    line,
                    format!("`{name}` must keep the signature fixed by {}: `{sig}`; the gates call exactly this", c.id),
                ));
            }
        }
    }
    for (rel, ids) in missing {
        out.push(Finding::blocking(
            "signature-changed",
            &rel,
            0,
            format!("module file is missing; {} fix their public items there (scaffold shows them)", ids.join(", ")),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reflowed_signature_is_the_same() {
        let one = "pub fn linear(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: &mut [f32]) { todo!() }";
        let reflowed = "pub fn linear(\n    x: &[f32],\n    w: &[f32],\n    m: usize,\n    k: usize,\n    n: usize,\n    out: &mut [f32],\n) {";
        let s = signatures(one);
        assert_eq!(s[0].0, "linear");
        assert!(canonical(reflowed).contains(&s[0].1), "{} vs {}", canonical(reflowed), s[0].1);
        assert!(
            !canonical("pub fn linear(x: &[f32], w: &[f32], m: usize, k: usize, out: &mut [f32]) {").contains(&s[0].1)
        );
    }
}
