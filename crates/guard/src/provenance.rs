//! Rule `provenance-match`: engine sources compared with registered reference trees (other
//! frameworks' code) by token-level fingerprints, so that copied code is found even after
//! renaming. `metainfer reference add DIR` stores fingerprints only, never code.
//!
//! Method: winnowing (Schleimer, Wilkerson, Aiken, "Winnowing: Local Algorithms for Document
//! Fingerprinting", SIGMOD 2003): hash every k-gram of normalised tokens (identifiers, numbers and
//! strings replaced by class tokens, comments and whitespace dropped), then keep the minimum hash
//! of every window of w consecutive k-grams. Any shared run of at least w + k - 1 tokens shares a
//! fingerprint.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::ReferenceLevel;
use super::{Finding, Severity, Tree};

/// Tokens per k-gram.
pub const K: usize = 25;
/// k-grams per window.
pub const W: usize = 8;
/// Share of a file's fingerprints found in one reference file from which it is a finding.
pub const THRESHOLD: f64 = 0.5;
/// Fewest shared fingerprints for a finding (tiny files are not judged).
pub const MIN_SHARED: usize = 12;

/// One fingerprint: hash of a k-gram and the line it starts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Print {
    /// Hash (FNV-1a over the k-gram's tokens).
    pub hash: u64,
    /// 1-based line.
    pub line: u32,
}

/// Fingerprints of one file of a registered reference tree.
#[derive(Debug, Clone)]
pub struct Reference {
    /// Name given at registration.
    pub name: String,
    /// File path relative to the registered directory.
    pub file: String,
    /// Its fingerprints.
    pub prints: Vec<Print>,
}

const KEYWORDS: &[&str] = &[
    "as", "break", "const", "continue", "else", "enum", "fn", "for", "if", "impl", "in", "let", "loop", "match", "mod",
    "mut", "pub", "return", "self", "Self", "static", "struct", "trait", "type", "unsafe", "use", "where", "while",
    "int", "float", "double", "void", "return", "def", "class", "import", "from", "with", "auto", "template",
];

/// Normalised tokens with their lines: identifiers -> `I` (keywords kept), numbers -> `N`, string
/// and char literals -> `S`, punctuation as itself; comments and whitespace dropped.
pub fn tokens(text: &str) -> Vec<(String, u32)> {
    let b: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0usize, 1u32);
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && b.get(i + 1) == Some(&'/')
            || c == '#' && b.get(i + 1) != Some(&'[') && b.get(i + 1) != Some(&'!')
        {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                if b[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 2;
        } else if c == '"' {
            let start = line;
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                if i < b.len() && b[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(("S".into(), start));
        } else if c == '\'' && (b.get(i + 2) == Some(&'\'') || b.get(i + 1) == Some(&'\\')) {
            i += 1;
            while i < b.len() && b[i] != '\'' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(("S".into(), line));
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '.' || b[i] == '_') {
                i += 1;
            }
            out.push(("N".into(), line));
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            let word: String = b[s..i].iter().collect();
            out.push((if KEYWORDS.contains(&word.as_str()) { word } else { "I".into() }, line));
        } else {
            out.push((c.to_string(), line));
            i += 1;
        }
    }
    out
}

fn fnv(parts: &[(String, u32)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (t, _) in parts {
        for byte in t.bytes().chain(std::iter::once(0)) {
            h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Winnowed fingerprints of a source text.
pub fn fingerprints(text: &str) -> Vec<Print> {
    let toks = tokens(text);
    if toks.len() < K {
        return Vec::new();
    }
    let grams: Vec<Print> = toks.windows(K).map(|g| Print { hash: fnv(g), line: g[0].1 }).collect();
    let mut out: Vec<Print> = Vec::new();
    let mut last: Option<usize> = None;
    for start in 0..grams.len().saturating_sub(W - 1).max(1) {
        let window = &grams[start..(start + W).min(grams.len())];
        // Rightmost minimum, as the paper prescribes, so that runs of equal hashes pick once.
        let (off, _) = window.iter().enumerate().rev().min_by_key(|(_, p)| p.hash).expect("non-empty window");
        let at = start + off;
        if last != Some(at) {
            out.push(grams[at]);
            last = Some(at);
        }
    }
    out
}

/// Source files a reference tree contributes (any C-like or Rust or Python source).
pub const REFERENCE_EXTS: &[&str] = &["rs", "c", "cc", "cpp", "h", "hpp", "cu", "cuh", "py", "metal", "go"];

/// Fingerprint every source file under `dir` (bounded like the engine walk; links not followed).
pub fn fingerprint_tree(name: &str, dir: &Path) -> Vec<Reference> {
    let mut out = Vec::new();
    for e in
        walkdir::WalkDir::new(dir).follow_links(false).max_depth(super::MAX_DEPTH).into_iter().filter_map(|e| e.ok())
    {
        if !e.file_type().is_file() || out.len() >= 50_000 {
            continue;
        }
        let ext = e.path().extension().and_then(|x| x.to_str()).unwrap_or("");
        if !REFERENCE_EXTS.contains(&ext) || e.metadata().map(|m| m.len()).unwrap_or(0) > super::MAX_FILE_BYTES {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(e.path()) else { continue };
        let prints = fingerprints(&text);
        if !prints.is_empty() {
            let file = e.path().strip_prefix(dir).unwrap_or(e.path()).to_string_lossy().replace('\\', "/");
            out.push(Reference { name: name.into(), file, prints });
        }
    }
    out
}

/// Compare every engine source file with every reference file.
pub fn check(tree: &Tree, references: &[Reference], level: ReferenceLevel) -> Vec<Finding> {
    if references.is_empty() {
        return Vec::new();
    }
    let mut index: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, r) in references.iter().enumerate() {
        for p in &r.prints {
            index.entry(p.hash).or_default().push(i);
        }
    }
    let mut out = Vec::new();
    for f in tree.files.iter().filter(|f| f.rust) {
        let prints = fingerprints(&f.text);
        if prints.is_empty() {
            continue;
        }
        let mut shared: HashMap<usize, HashSet<u64>> = HashMap::new();
        for p in &prints {
            for &r in index.get(&p.hash).map(Vec::as_slice).unwrap_or_default() {
                shared.entry(r).or_default().insert(p.hash);
            }
        }
        let Some((&best, hashes)) = shared.iter().max_by_key(|(_, h)| h.len()) else { continue };
        let score = hashes.len() as f64 / prints.len() as f64;
        if hashes.len() < MIN_SHARED || score < THRESHOLD {
            continue;
        }
        let r = &references[best];
        let mine: Vec<u32> = prints.iter().filter(|p| hashes.contains(&p.hash)).map(|p| p.line).collect();
        let theirs: Vec<u32> = r.prints.iter().filter(|p| hashes.contains(&p.hash)).map(|p| p.line).collect();
        let span = |v: &[u32]| format!("{}-{}", v.iter().min().unwrap_or(&0), v.iter().max().unwrap_or(&0));
        let severity = if level == ReferenceLevel::Code { Severity::Warning } else { Severity::Blocking };
        out.push(Finding {
            rule: "provenance-match".into(),
            severity,
            file: f.rel.clone(),
            line: mine.iter().min().copied().unwrap_or(0),
            message: format!(
                "{:.0}% of this file's fingerprints (lines {}) match reference `{}` file {} lines {}; at reference level `{}` the engine must be written from the contracts, not copied",
                score * 100.0,
                span(&mine),
                r.name,
                r.file,
                span(&theirs),
                level.name()
            ),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "fn dot(a: &[f32], b: &[f32]) -> f32 {\n    let mut s = 0.0;\n    for i in 0..a.len() {\n        s += a[i] * b[i];\n    }\n    s\n}\n\nfn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {\n    for i in 0..x.len() {\n        y[i] += alpha * x[i];\n    }\n}\n";

    #[test]
    fn renaming_keeps_fingerprints_and_comments_do_not_count() {
        let renamed = A.replace("dot", "inner").replace("axpy", "scale_add").replace('s', "acc").replace("alpha", "k");
        let commented = format!("// header\n/* block\ncomment */\n{A}");
        let fa: HashSet<u64> = fingerprints(A).iter().map(|p| p.hash).collect();
        assert!(!fa.is_empty());
        let fr: HashSet<u64> = fingerprints(&renamed).iter().map(|p| p.hash).collect();
        assert_eq!(fa, fr, "identifier renaming must not change fingerprints");
        let fc: HashSet<u64> = fingerprints(&commented).iter().map(|p| p.hash).collect();
        assert_eq!(fa, fc);
        let other: HashSet<u64> = fingerprints("struct P { x: u8 }\nimpl P { pub fn new() -> Self { P { x: 0 } } }\nfn main() { let p = P::new(); println!(\"{}\", p.x); let q = [p.x; 4]; }").iter().map(|p| p.hash).collect();
        assert!(fa.is_disjoint(&other));
    }
}
