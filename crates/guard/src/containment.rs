//! Rules that keep an engine inside its own directory:
//! - `path-outside`: a path dependency, `include_bytes!`/`include_str!` or `#[path]` that resolves
//!   outside the engine directory (or cannot be resolved without building);
//! - `git-dependency`: a git dependency (its code comes from outside, unreviewed);
//! - `symlink-outside`: a symlink whose target lies outside the engine directory;
//! - `build-script`: a build script that runs programs, reaches the network, reads `/proc` or writes
//!   a file outside `OUT_DIR` (a build script is the root manifest's `package.build`, any
//!   `build.rs`, and every file one pulls in with `mod`, `include!` or `#[path]`).

use std::path::{Component, Path, PathBuf};

use super::{Finding, Tree, line_of};

/// Lexically normalise `base/rel` (no filesystem access, so nothing outside is touched).
pub(crate) fn join_normal(base: &Path, rel: &str) -> PathBuf {
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

/// Calls that write the filesystem, with the index of their destination argument.
const WRITE_CALLS: &[(&str, usize)] = &[
    ("fs::write(", 0),
    ("File::create(", 0),
    ("File::create_new(", 0),
    ("fs::create_dir(", 0),
    ("fs::create_dir_all(", 0),
    ("fs::copy(", 1),
    ("fs::rename(", 1),
    ("fs::hard_link(", 1),
    ("symlink(", 1),
    ("fs::remove_file(", 0),
    ("fs::remove_dir(", 0),
    ("fs::remove_dir_all(", 0),
    ("fs::set_permissions(", 0),
    (".open(", 0),
];

/// The `n`-th top-level argument of the call whose `(` ends at `open` in `text`.
fn argument(text: &str, open: usize, n: usize) -> Option<&str> {
    let mut depth = 0i32;
    let (mut start, mut index) = (open, 0);
    for (i, c) in text[open..].char_indices() {
        let at = open + i;
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth == 0 => return (index == n).then(|| text[start..at].trim()),
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                if index == n {
                    return Some(text[start..at].trim());
                }
                index += 1;
                start = at + 1;
            }
            _ => {}
        }
    }
    None
}

/// Identifiers in `s`.
fn idents(s: &str) -> impl Iterator<Item = &str> {
    s.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|w| !w.is_empty())
}

/// Names bound (by `let`) to a value derived from `OUT_DIR`, to a fixed point.
fn out_dir_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    loop {
        let before = names.len();
        for stmt in text.split(';') {
            // The statement's `let` (after any block opener such as `fn main() {`).
            let Some(at) = stmt
                .match_indices("let ")
                .map(|(i, _)| i)
                .find(|&i| stmt[..i].chars().next_back().is_none_or(|c| c.is_whitespace() || c == '{' || c == '}'))
            else {
                continue;
            };
            let rest = &stmt[at + 4..];
            let Some((lhs, rhs)) = rest.split_once('=') else { continue };
            if rhs.contains("OUT_DIR") || idents(rhs).any(|w| names.contains(w)) {
                names.extend(idents(lhs).filter(|w| *w != "mut").map(str::to_string));
            }
        }
        if names.len() == before {
            return names;
        }
    }
}

/// Build-script findings of one build-script file: programs, network, `/proc`, writes outside
/// `OUT_DIR`.
fn build_script_findings(f: &super::SourceFile, out: &mut Vec<Finding>) {
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
    if let Some(b) = f.text.find("\"/proc") {
        out.push(Finding::blocking(
            "build-script",
            &f.rel,
            line_of(&f.text, b),
            "build script reads /proc: build scripts may not inspect processes (their own or the server's); read what you need from cargo's environment variables".into(),
        ));
    }
    let derived = out_dir_names(&f.text);
    for (call, n) in WRITE_CALLS {
        let mut from = 0;
        while let Some(i) = f.text[from..].find(call) {
            let at = from + i;
            from = at + call.len();
            // `.open(` writes only on an OpenOptions chain (File::open reads).
            if *call == ".open(" {
                let stmt_start = f.text[..at].rfind(';').map(|s| s + 1).unwrap_or(0);
                if !f.text[stmt_start..at].contains("OpenOptions") && !f.text[stmt_start..at].contains("File::options")
                {
                    continue;
                }
            }
            let Some(arg) = argument(&f.text, from, *n) else { continue };
            if arg.contains("OUT_DIR") || idents(arg).any(|w| derived.contains(w)) {
                continue;
            }
            out.push(Finding::blocking(
                "build-script",
                &f.rel,
                line_of(&f.text, at),
                format!(
                    "build script writes with `{}` to `{}`, which is not derived from OUT_DIR; build scripts may write only under OUT_DIR (std::env::var(\"OUT_DIR\"))",
                    call.trim_end_matches('('),
                    arg.chars().take(80).collect::<String>()
                ),
            ));
        }
    }
}

/// The build scripts of the engine (relative paths): the root manifest's `package.build` (or
/// `build.rs` when the manifest names none), every `build.rs`, and what they pull in as code
/// (`mod name;` as `name.rs` or `name/mod.rs`, `include!`, `#[path]`), transitively.
fn build_scripts(dir: &Path, tree: &Tree) -> std::collections::BTreeSet<String> {
    let mut set: std::collections::BTreeSet<String> = tree
        .files
        .iter()
        .filter(|f| f.rel == "build.rs" || f.rel.ends_with("/build.rs"))
        .map(|f| f.rel.clone())
        .collect();
    if let Some(m) = tree.files.iter().find(|f| f.rel == "Cargo.toml")
        && let Ok(t) = toml::from_str::<toml::Table>(&m.text)
        && let Some(b) = t.get("package").and_then(|p| p.get("build")).and_then(|b| b.as_str())
        && let Ok(rel) = join_normal(dir, b).strip_prefix(dir)
    {
        set.insert(rel.to_string_lossy().replace('\\', "/"));
    }
    let mut queue: Vec<String> = set.iter().cloned().collect();
    while let Some(rel) = queue.pop() {
        let Some(f) = tree.files.iter().find(|f| f.rel == rel) else { continue };
        let base = f.path.parent().unwrap_or(dir);
        let mut pulled: Vec<PathBuf> = Vec::new();
        for stmt in f.text.split(';') {
            let words: Vec<&str> = stmt.split_whitespace().collect();
            if let [.., "mod", name] = words.as_slice()
                && name.chars().all(|c| c.is_alphanumeric() || c == '_')
            {
                pulled.push(base.join(format!("{name}.rs")));
                pulled.push(base.join(name).join("mod.rs"));
            }
        }
        for lit in super::code_references(&f.text) {
            pulled.push(join_normal(base, &lit));
        }
        for p in pulled {
            if let Ok(r) = p.strip_prefix(dir) {
                let r = r.to_string_lossy().replace('\\', "/");
                if tree.files.iter().any(|f| f.rel == r) && set.insert(r.clone()) {
                    queue.push(r);
                }
            }
        }
    }
    set
}

/// Run the containment rules.
pub fn check(dir: &Path, tree: &Tree) -> Vec<Finding> {
    let mut out = Vec::new();
    let scripts = build_scripts(dir, tree);
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
        if scripts.contains(&f.rel) {
            build_script_findings(f, &mut out);
        }
        if !f.rust {
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
