//! Rules that keep an engine inside its own directory:
//! - `path-outside`: a path dependency, `include_bytes!`/`include_str!` or `#[path]` that resolves
//!   outside the engine directory (or cannot be resolved without building);
//! - `git-dependency`: a git dependency (its code comes from outside, unreviewed);
//! - `symlink-outside`: a symlink whose target lies outside the engine directory;
//! - `build-script`: a build script that runs programs or reaches the network.

use std::path::{Component, Path, PathBuf};

use super::{Finding, Tree, line_of};

/// Lexically normalise `base/rel` (no filesystem access, so nothing outside is touched).
fn join_normal(base: &Path, rel: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Dependency tables of a manifest: (section name, table).
fn dependency_tables(manifest: &toml::Table) -> Vec<(String, &toml::Table)> {
    let mut out = Vec::new();
    for key in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if let Some(t) = manifest.get(key).and_then(|v| v.as_table()) {
            out.push((key.to_string(), t));
        }
    }
    if let Some(targets) = manifest.get("target").and_then(|v| v.as_table()) {
        for (cfg, t) in targets {
            for key in ["dependencies", "dev-dependencies", "build-dependencies"] {
                if let Some(d) = t.get(key).and_then(|v| v.as_table()) {
                    out.push((format!("target.{cfg}.{key}"), d));
                }
            }
        }
    }
    if let Some(ws) = manifest.get("workspace").and_then(|v| v.get("dependencies")).and_then(|v| v.as_table()) {
        out.push(("workspace.dependencies".into(), ws));
    }
    if let Some(patch) = manifest.get("patch").and_then(|v| v.as_table()) {
        for (src, t) in patch {
            if let Some(t) = t.as_table() {
                out.push((format!("patch.{src}"), t));
            }
        }
    }
    out
}

/// Network or process crates a build script has no business using.
const BUILD_NETWORK_CRATES: &[&str] = &["reqwest", "ureq", "curl", "hyper", "attohttpc", "isahc", "surf", "git2"];
/// Source patterns of a build script that runs programs or opens connections.
const BUILD_PATTERNS: &[&str] = &[
    "std::process",
    "process::Command",
    "Command::new",
    "std::net",
    "TcpStream",
    "UdpSocket",
    "http://",
    "https://",
    "reqwest",
    "ureq",
];

/// Run the containment rules.
pub fn check(dir: &Path, tree: &Tree) -> Vec<Finding> {
    let mut out = Vec::new();
    for (rel, target, resolved) in &tree.symlinks {
        let inside = resolved.as_ref().is_some_and(|r| r.starts_with(dir));
        if !inside {
            out.push(Finding::blocking(
                "symlink-outside",
                rel,
                0,
                format!(
                    "symlink to {} {}; copy what you need into the crate or remove the link",
                    target.display(),
                    if resolved.is_some() {
                        "points outside the engine directory"
                    } else {
                        "does not resolve (dangling or a loop)"
                    }
                ),
            ));
        }
    }
    for f in &tree.files {
        let file_dir = f.path.parent().unwrap_or(dir);
        if f.rel.ends_with("Cargo.toml") {
            let Ok(manifest) = toml::from_str::<toml::Table>(&f.text) else {
                out.push(Finding::blocking(
                    "path-outside",
                    &f.rel,
                    0,
                    "manifest is not valid TOML; cargo cannot build it either".into(),
                ));
                continue;
            };
            for (section, table) in dependency_tables(&manifest) {
                for (name, spec) in table {
                    let line = f.text.find(&format!("\n{name}")).map(|b| line_of(&f.text, b + 1)).unwrap_or(0);
                    if let Some(p) = spec.get("path").and_then(|v| v.as_str()) {
                        let resolved = join_normal(file_dir, p);
                        if !resolved.starts_with(dir) {
                            out.push(Finding::blocking(
                                "path-outside",
                                &f.rel,
                                line,
                                format!("[{section}] `{name}` has path = {p:?}, outside the engine directory; depend on a published crate or move the code into the engine"),
                            ));
                        }
                    }
                    if spec.get("git").is_some() {
                        out.push(Finding::blocking(
                            "git-dependency",
                            &f.rel,
                            line,
                            format!("[{section}] `{name}` is a git dependency; use a published crates.io version"),
                        ));
                    }
                    if section.ends_with("build-dependencies") && BUILD_NETWORK_CRATES.contains(&name.as_str()) {
                        out.push(Finding::blocking(
                            "build-script",
                            &f.rel,
                            line,
                            format!("[{section}] `{name}` lets the build script reach the network; build scripts may only configure the compiler"),
                        ));
                    }
                }
            }
            continue;
        }
        if f.rel == "build.rs" || f.rel.ends_with("/build.rs") {
            for pat in BUILD_PATTERNS {
                if let Some(b) = f.text.find(pat) {
                    out.push(Finding::blocking(
                        "build-script",
                        &f.rel,
                        line_of(&f.text, b),
                        format!("build script uses `{pat}`: build scripts may not run programs or reach the network; do the work in the engine's own code"),
                    ));
                }
            }
        }
        if !f.rel.ends_with(".rs") {
            continue;
        }
        for mac in ["include_bytes!", "include_str!", "include!"] {
            let mut from = 0;
            while let Some(i) = f.text[from..].find(mac) {
                let at = from + i;
                from = at + mac.len();
                let rest = f.text[from..].trim_start().trim_start_matches('(').trim_start();
                let line = line_of(&f.text, at);
                match rest.strip_prefix('"').and_then(|r| r.split_once('"')) {
                    Some((lit, _)) => {
                        if !join_normal(file_dir, lit).starts_with(dir) {
                            out.push(Finding::blocking(
                                "path-outside",
                                &f.rel,
                                line,
                                format!("{mac}({lit:?}) reads a file outside the engine directory; keep data inside the crate"),
                            ));
                        }
                    }
                    None => out.push(Finding::blocking(
                        "path-outside",
                        &f.rel,
                        line,
                        format!(
                            "{mac} with a computed path cannot be checked; use a string literal path inside the crate"
                        ),
                    )),
                }
            }
        }
        let mut from = 0;
        while let Some(i) = f.text[from..].find("#[path") {
            let at = from + i;
            from = at + 6;
            let rest = &f.text[from..];
            let lit = rest.split_once('"').and_then(|(_, r)| r.split_once('"')).map(|(l, _)| l);
            let outside = lit.is_none_or(|l| !join_normal(file_dir, l).starts_with(dir));
            if outside {
                out.push(Finding::blocking(
                    "path-outside",
                    &f.rel,
                    line_of(&f.text, at),
                    format!(
                        "#[path] {} points outside the engine directory; move the module into src/",
                        lit.unwrap_or("(unreadable)")
                    ),
                ));
            }
        }
    }
    out
}
