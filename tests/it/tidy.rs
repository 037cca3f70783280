//! Tidy: the architecture's mechanical rules (ARCHITECTURE.md), checked on the sources. Each rule is
//! a function over (path, text) pairs, so a test can plant a violation of each and see it caught.
//!
//! The layers are the root package's top-level modules (`src/<m>`) and the workspace's crates
//! (`crates/<c>`, one layer each). Between crates the compiler holds the layering (a crate names only
//! what its manifest depends on), so their edges are read from the manifests; between the root's
//! modules they are read from the sources (`crate::<m>`).
//!
//! Rules: every source file opens with a `//!` module doc; only `harness` starts processes; `ops`
//! modules import each other only through the shared ones ([`SHARED`]), the shared types of
//! the ops crate's `lib.rs`, and the edges listed in [`OPS_EDGES`]; the layers form no cycle, and none
//! names a layer it must know nothing of ([`KNOWS_NOTHING_OF`]); every layer is named in
//! ARCHITECTURE.md; every dependency of every manifest is used by its package; every kernel contract has a registry
//! entry and the harness template takes its kernel arms from the registry only; the fast tier's skip
//! list (`.ci/engine-tests`) names existing tests; code one example engine copies from another is
//! identical to it ([`COPIES`]), and a module derived from another but deliberately different is
//! declared with its reason ([`DERIVED`]); every invariant of ARCHITECTURE.md is (tidy) or names
//! tests that exist; clap stays in the binary; the oracle and the example engines share no code; a
//! foreign error gets its context through `error::Context`; no source file passes [`MAX_SOURCE_LINES`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use metainfer::ckb::{Ckb, Kind};
use metainfer::oracle::kernels;

type Files = Vec<(String, String)>;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir` (relative to the workspace root), with its text.
fn rust_files(dir: &str) -> Files {
    let mut out = Vec::new();
    for e in walkdir::WalkDir::new(root().join(dir)).sort_by_file_name().into_iter().filter_map(Result::ok) {
        if e.file_type().is_file() && e.path().extension().is_some_and(|x| x == "rs") {
            let rel = e.path().strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/");
            out.push((rel, std::fs::read_to_string(e.path()).unwrap()));
        }
    }
    out
}

/// The code of a line without its `//` comment and string literals (crudely: quotes toggle).
fn code(line: &str) -> String {
    let line = line.split("//").next().unwrap_or("");
    let (mut out, mut quoted) = (String::new(), false);
    for ch in line.chars() {
        if ch == '"' {
            quoted = !quoted;
        } else if !quoted {
            out.push(ch);
        }
    }
    out
}

/// Files other than the generated harness crate's (which is not part of this workspace).
fn own(files: &Files) -> impl Iterator<Item = &(String, String)> {
    files.iter().filter(|(p, _)| !p.starts_with("crates/harness/src/template/"))
}

/// Rule: every source file opens with a `//!` module doc.
fn module_docs(files: &Files) -> Vec<String> {
    own(files)
        .filter(|(_, t)| !t.trim_start().starts_with("//!"))
        .map(|(p, _)| format!("{p}: does not open with a //! module doc"))
        .collect()
}

/// Rule: only `harness` starts processes.
fn processes(files: &Files) -> Vec<String> {
    const SPAWNERS: &[&str] = &["Command::new", "duct::", "MetadataCommand", "process::Command", "fork("];
    let mut out = Vec::new();
    for (p, t) in own(files).filter(|(p, _)| !p.starts_with("crates/harness/")) {
        for (i, line) in t.lines().enumerate() {
            let c = code(line);
            if let Some(s) = SPAWNERS.iter().find(|s| c.contains(**s)) {
                out.push(format!("{p}:{}: `{s}` outside harness: start processes through harness", i + 1));
            }
        }
    }
    out
}

/// ops modules every ops module may use: the gate skeleton, the checkpoint reader (one model
/// directory read once per gate), pagination (the shared shape of every list a tool returns), and
/// preconditions (what config.json may contradict in a graph, which plan and every gate check
/// alike); `lib.rs` holds the shared types.
const SHARED: &[&str] = &["gate", "checkpoint", "page", "preconditions"];

/// The ops modules one ops module may name besides [`SHARED`] and `lib.rs`, with why.
const OPS_EDGES: &[(&str, &str, &str)] = &[
    ("scaffold", "plan", "a scaffold is a plan written out"),
    ("gate", "rules", "the skeleton runs the rules before every gate"),
    ("gate", "compile", "a harness build failure is reported as compile_engine reports it"),
    ("gate", "evolve", "a passing gate promotes the candidates it ran under"),
    ("evolve", "synth", "a proposed family's graph is dry-run on a checkpoint synth writes from the proposal"),
    (
        "profile",
        "synth",
        "the roofline's bytes per token are the tensors the family's graph binds, as synth plans them",
    ),
    ("conformance", "evolve", "a passing conformance check is a model family's evidence and promotes it"),
    ("bundle", "serve", "`bundle run` of a serve_engine bundle starts its server and sends its plan"),
    (
        "perplexity",
        "evolve",
        "a passing perplexity check with consent is a model family's weaker evidence and promotes it",
    ),
    ("verify", "localise", "verify_generation localises a failing step by comparing traces"),
];

/// The ops module of a file of the ops crate (`crates/ops/src/profile/roofline.rs` -> `profile`), None
/// for lib.rs.
fn ops_module(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("crates/ops/src/")?;
    let first = rest.split('/').next()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then_some(name)
}

/// Rule: ops modules import each other only through the gate skeleton and shared types.
fn ops_imports(files: &Files) -> Vec<String> {
    let names: BTreeSet<&str> = files.iter().filter_map(|(p, _)| ops_module(p)).collect();
    let mut out = Vec::new();
    for (p, t) in files {
        let Some(me) = ops_module(p) else { continue };
        for (i, line) in t.lines().enumerate() {
            let c = code(line);
            for other in &names {
                if *other == me || SHARED.contains(other) {
                    continue;
                }
                let named = ["super", "crate"].iter().any(|root| {
                    [format!("{root}::{other}::"), format!("{root}::{other}}}"), format!("{root}::{other},")]
                        .iter()
                        .any(|pat| c.contains(pat.as_str()))
                        || c.contains(&format!("{root}::{{{other}"))
                        || c.trim_start().starts_with(&format!("use {root}::{other}"))
                });
                if named && !OPS_EDGES.iter().any(|(a, b, _)| *a == me && b == other) {
                    out.push(format!(
                        "{p}:{}: ops::{me} uses ops::{other}; go through ops::gate or the shared types",
                        i + 1
                    ));
                }
            }
        }
    }
    out
}

/// The layer of a source file: the top-level module of a root file (`src/ops/gate.rs` -> `ops`; None
/// for lib.rs and main.rs), the crate of a workspace crate's file (`crates/oracle/src/llama.rs` ->
/// `oracle`).
fn top_module(path: &str) -> Option<&str> {
    if let Some(rest) = path.strip_prefix("crates/") {
        return rest.split('/').next();
    }
    let rest = path.strip_prefix("src/")?;
    let first = rest.split('/').next()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then_some(name)
}

/// The modules of crate `base` that the root package re-exports under their own names
/// (`crate::util` in a root file names the `base` layer).
const BASE_MODULES: &[&str] = &["beneath", "error", "stats", "util"];

/// Each workspace crate's manifest (`crates/<c>/Cargo.toml`) as (crate directory name, text).
fn crate_manifests() -> Files {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root().join("crates")).unwrap().filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(e.path().join("Cargo.toml")).unwrap();
        out.push((name, text));
    }
    out.sort();
    out
}

/// The dependencies a manifest lists under `[dependencies]` (the names the code uses: a renamed
/// workspace crate under its key, e.g. `ckb` for `metainfer-ckb`).
fn manifest_dependencies(manifest: &str) -> BTreeSet<String> {
    let doc: toml::Table = toml::from_str(manifest).unwrap();
    doc.get("dependencies").and_then(|d| d.as_table()).map(|t| t.keys().cloned().collect()).unwrap_or_default()
}

/// Edges between layers. A root file of `a` naming `crate::b` (or a module of `base` that the root
/// re-exports); a crate's edges are the workspace crates its manifest depends on (`crates`: (crate,
/// manifest text)), since the compiler lets a crate name nothing else.
fn module_graph(files: &Files, crates: &Files) -> BTreeMap<String, BTreeSet<String>> {
    let mods: BTreeSet<&str> = own(files).filter_map(|(p, _)| top_module(p)).collect();
    let names: Vec<(&str, &str)> =
        mods.iter().map(|m| (*m, *m)).chain(BASE_MODULES.iter().map(|m| (*m, "base"))).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (p, t) in own(files) {
        let Some(me) = top_module(p) else { continue };
        let entry = g.entry(me.to_string()).or_default();
        if p.starts_with("crates/") {
            continue;
        }
        for line in t.lines() {
            let c = code(line);
            for (name, layer) in &names {
                if *layer != me
                    && (c.contains(&format!("crate::{name}::"))
                        || c.contains(&format!("crate::{name};"))
                        || c.contains(&format!("crate::{name}}}"))
                        || c.contains(&format!("crate::{name},"))
                        || c.contains(&format!("crate::{{{name}")))
                {
                    entry.insert(layer.to_string());
                }
            }
        }
    }
    for (c, manifest) in crates {
        let deps = manifest_dependencies(manifest);
        g.entry(c.clone()).or_default().extend(deps.into_iter().filter(|d| crates.iter().any(|(o, _)| o == d)));
    }
    g
}

/// Rule: no cycle among the layers. Returns one cycle per strongly connected group found.
fn cycles(files: &Files, crates: &Files) -> Vec<String> {
    let g = module_graph(files, crates);
    let mut out = Vec::new();
    // A module is on a cycle when it reaches itself.
    for start in g.keys() {
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((m, path)) = stack.pop() {
            for next in g.get(&m).into_iter().flatten() {
                if next == start {
                    let mut cyc = path.clone();
                    cyc.push(start.clone());
                    out.push(format!("module cycle: {}", cyc.join(" -> ")));
                    break;
                }
                if seen.insert(next.clone()) {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    out.sort();
    out.dedup_by(|a, b| {
        let key = |s: &str| {
            let mut v: Vec<String> = s.trim_start_matches("module cycle: ").split(" -> ").map(str::to_owned).collect();
            v.sort();
            v.dedup();
            v
        };
        key(a) == key(b)
    });
    out
}

/// Top-level modules and the ones each must know nothing of: it names none of them (`crate::x`).
/// "MCP" is `mcp` and the `rmcp` crate; "processes" is `harness`, the one module that starts them;
/// guard reads only the engine directory and what its caller passes in, so it names no module that
/// reads anything else (the ledger, models, the options, the operations).
const KNOWS_NOTHING_OF: &[(&str, &[&str])] = &[
    ("ckb", &["mcp", "rmcp", "harness", "model", "oracle", "ledger"]),
    ("model", &["mcp", "rmcp", "harness"]),
    ("oracle", &["mcp", "rmcp", "harness"]),
    ("guard", &["mcp", "rmcp", "harness", "ledger", "model", "oracle", "options", "ops"]),
    ("ledger", &["mcp", "rmcp", "harness"]),
    ("probe", &["ops"]),
    ("ops", &["mcp", "rmcp"]),
];

/// Rule: no layer names a layer it must know nothing of ([`KNOWS_NOTHING_OF`]), and a crate's
/// manifest does not depend on rmcp where its layer knows nothing of MCP.
fn knows_nothing_of(files: &Files, crates: &Files) -> Vec<String> {
    let graph = module_graph(files, crates);
    let mut out = Vec::new();
    for (me, banned) in KNOWS_NOTHING_OF {
        for other in graph.get(*me).into_iter().flatten().filter(|m| banned.contains(&m.as_str())) {
            out.push(format!("{me}: names {other}; {me} knows nothing of {other}"));
        }
        if let Some((_, manifest)) = crates.iter().find(|(c, _)| c == me) {
            // Workspace crates are edges of the graph above; this names the outside ones (rmcp).
            let outside = manifest_dependencies(manifest).into_iter().filter(|d| !crates.iter().any(|(c, _)| c == d));
            for dep in outside.filter(|d| banned.contains(&d.as_str())) {
                out.push(format!("crates/{me}/Cargo.toml: depends on {dep}; {me} knows nothing of {dep}"));
            }
        }
        if !banned.contains(&"rmcp") {
            continue;
        }
        for (p, t) in own(files).filter(|(p, _)| top_module(p) == Some(*me)) {
            if let Some(i) =
                t.lines().position(|l| code(l).contains("rmcp::") || code(l).trim_start().starts_with("use rmcp"))
            {
                out.push(format!("{p}:{}: names rmcp; {me} knows nothing of MCP", i + 1));
            }
        }
    }
    out
}

/// Whether `name` occurs in `text` as a word (not inside a longer identifier).
fn names_word(text: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(name).any(|(at, _)| {
        !text[..at].chars().next_back().is_some_and(ident) && !text[at + name.len()..].chars().next().is_some_and(ident)
    })
}

/// Rule: every top-level module of src/ (a layer: a file or folder beside lib.rs) is named in
/// ARCHITECTURE.md; its submodules are described by their own `//!` docs ([`module_docs`]).
fn architecture_names(files: &Files, architecture: &str) -> Vec<String> {
    let tops: BTreeSet<&str> = own(files).filter_map(|(p, _)| top_module(p)).collect();
    tops.into_iter()
        .filter(|m| !names_word(architecture, m))
        .map(|m| format!("src/{m}: top-level module `{m}` is not named in ARCHITECTURE.md"))
        .collect()
}

/// Rule: every dependency a manifest lists is used by its package's files (the root's: src/ and
/// tests/; a crate's: its src/ and build.rs). `manifest` is (path, text).
fn unused_dependencies((path, manifest): (&str, &str), files: &Files) -> Vec<String> {
    let doc: toml::Table = toml::from_str(manifest).unwrap();
    let mut names: Vec<String> = Vec::new();
    for section in ["dependencies", "build-dependencies", "dev-dependencies"] {
        if let Some(t) = doc.get(section).and_then(|v| v.as_table()) {
            names.extend(t.keys().cloned());
        }
    }
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|n| {
            let ident = n.replace('-', "_");
            !files.iter().any(|(_, t)| {
                t.lines().any(|l| {
                    let c = code(l);
                    c.contains(&format!("{ident}::"))
                        || c.contains(&format!("use {ident}"))
                        || c.contains(&format!("{ident}!"))
                })
            })
        })
        .map(|n| format!("{path}: dependency `{n}` is not used"))
        .collect()
}

/// Rule: every kernel contract with a CUDA signature (`[cuda]`) has CUDA harness arms in its
/// registry entry, and no entry has CUDA arms without one.
fn cuda_agreement(cuda_contracts: &BTreeSet<String>, cuda_arms: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for k in cuda_contracts.difference(cuda_arms) {
        out.push(format!("kernel contract {k} has a [cuda] signature but its registry entry has no CUDA arms"));
    }
    for k in cuda_arms.difference(cuda_contracts) {
        out.push(format!("registry entry {k} has CUDA arms but its contract has no [cuda] signature"));
    }
    out
}

/// Rule: every kernel contract has a registry entry (and no entry lacks a contract), and the
/// template takes its kernel arms from the registry only (one marker per match, no own arm).
fn registry_agreement(kernel_contracts: &BTreeSet<String>, registry: &BTreeSet<String>, template: &str) -> Vec<String> {
    let mut out = Vec::new();
    for k in kernel_contracts.difference(registry) {
        out.push(format!("kernel contract {k} has no registry entry (crates/oracle/src/kernels/)"));
    }
    for k in registry.difference(kernel_contracts) {
        out.push(format!("registry entry {k} has no kernel contract"));
    }
    for marker in [metainfer::harness::TEST_ARMS, metainfer::harness::TIMED_ARMS] {
        let n = template.lines().filter(|l| l.trim() == marker).count();
        if n != 1 {
            out.push(format!("the harness template has {n} `{marker}` lines (want 1)"));
        }
    }
    for (i, line) in template.lines().enumerate() {
        if line.trim_start().starts_with("\"kernel.") {
            out.push(format!("harness template line {}: a kernel arm of its own; arms come from the registry", i + 1));
        }
    }
    out
}

/// Rule: every test-name prefix in `.ci/engine-tests` (the fast tier's skip list, `module::fn_prefix`)
/// names a function of that `tests/it` module, so a renamed test cannot silently drop out of the list.
fn fast_tier_skips(list: &str, tests: &Files) -> Vec<String> {
    let mut out = Vec::new();
    for name in list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let Some((module, prefix)) = name.split_once("::") else {
            out.push(format!(".ci/engine-tests: `{name}` is not `module::test_name_prefix`"));
            continue;
        };
        let file = format!("tests/it/{module}.rs");
        let found = tests.iter().filter(|(p, _)| *p == file).any(|(_, text)| {
            text.lines().any(|l| {
                let l = l.trim_start();
                let l = l.strip_prefix("async ").unwrap_or(l);
                l.strip_prefix("fn ").is_some_and(|f| f.starts_with(prefix))
            })
        });
        if !found {
            out.push(format!(".ci/engine-tests: `{name}` matches no function in {file}"));
        }
    }
    out
}

/// What of a file a copy holds: the whole file, the one item (function, struct, impl) whose
/// declaration starts so, or the whole file with names replaced (original, copy) in the original.
#[derive(Clone, Copy)]
enum Part {
    Whole,
    Function(&'static str),
    Renamed(&'static [(&'static str, &'static str)]),
}

/// The CUDA engine's server binary is the SIMD engine's, with its own crate and binary name, its
/// sampler module (`generate`: sampling on the host) in place of the SIMD kernels module, and its
/// own default of running sequences (its metainfer.toml [serving] max_seqs, as
/// component.openai_server says).
const CUDA_SERVER_RENAMES: &[(&str, &str)] = &[
    ("[--max-seqs 16]", "[--max-seqs 64]"),
    ("sequences running at once (default 16)", "sequences running at once (default 64)"),
    ("parsed(args, \"--max-seqs\", 16)?", "parsed(args, \"--max-seqs\", 64)?"),
    ("llama_cpu_simd::kernels::{self, SamplingParams}", "llama_cuda_bf16::generate::{self as kernels, SamplingParams}"),
    ("llama_cpu_simd", "llama_cuda_bf16"),
    ("llama-cpu-simd", "llama-cuda-bf16"),
];

/// Code an example engine copies from another (copy, original, part), each held identical so the
/// copies cannot drift apart.
const COPIES: &[(&str, &str, Part)] = &[
    (
        "examples/engines/llama-cuda-bf16/src/tokenizer.rs",
        "examples/engines/llama-cpu-plain/src/tokenizer.rs",
        Part::Whole,
    ),
    (
        "examples/engines/llama-cuda-bf16/src/generate.rs",
        "examples/engines/llama-cpu-plain/src/generate.rs",
        Part::Function("pub fn stop_tokens("),
    ),
    (
        "examples/engines/llama-cpu-simd/src/generate.rs",
        "examples/engines/llama-cpu-plain/src/generate.rs",
        Part::Function("pub fn stop_tokens("),
    ),
    ("examples/engines/llama-cpu-plain/src/paged.rs", "examples/engines/llama-cpu-simd/src/paged.rs", Part::Whole),
    ("examples/engines/llama-cuda-bf16/src/paged.rs", "examples/engines/llama-cpu-simd/src/paged.rs", Part::Whole),
    ("examples/engines/llama-cuda-bf16/src/weights.rs", "examples/engines/llama-cpu-plain/src/weights.rs", Part::Whole),
    ("examples/engines/llama-cuda-bf16/src/config.rs", "examples/engines/llama-cpu-plain/src/config.rs", Part::Whole),
    (
        "examples/engines/llama-cuda-bf16/src/scheduler.rs",
        "examples/engines/llama-cpu-simd/src/scheduler.rs",
        Part::Whole,
    ),
    (
        "examples/engines/llama-cuda-bf16/src/generate.rs",
        "examples/engines/llama-cpu-simd/src/kernels.rs",
        Part::Function("pub fn sample("),
    ),
    (
        "examples/engines/llama-cuda-bf16/src/generate.rs",
        "examples/engines/llama-cpu-simd/src/kernels.rs",
        Part::Function("pub struct SamplingParams"),
    ),
    (
        "examples/engines/llama-cuda-bf16/src/generate.rs",
        "examples/engines/llama-cpu-simd/src/kernels.rs",
        Part::Function("impl Default for SamplingParams"),
    ),
    (
        "examples/engines/llama-cuda-bf16/src/generate.rs",
        "examples/engines/llama-cpu-plain/src/kernels.rs",
        Part::Function("pub fn argmax("),
    ),
    (
        "examples/engines/llama-cuda-bf16/src/main.rs",
        "examples/engines/llama-cpu-simd/src/main.rs",
        Part::Renamed(CUDA_SERVER_RENAMES),
    ),
];

/// Modules derived from another engine's and deliberately different (module, origin, reason): checked
/// to still differ, so a declaration whose reason is gone becomes an entry of [`COPIES`].
const DERIVED: &[(&str, &str, &str)] = &[(
    "examples/engines/llama-cpu-plain/src/scheduler.rs",
    "examples/engines/llama-cpu-simd/src/scheduler.rs",
    "the plain engine has no server: the simd scheduler's counts() and tokens(), which its server and sampler read, are left out",
)];

/// The text of `part` of `text`, or None when the function is not there exactly once.
fn part_of(text: &str, part: Part) -> Option<&str> {
    match part {
        Part::Whole | Part::Renamed(_) => Some(text),
        Part::Function(signature) => {
            if text.matches(signature).count() != 1 {
                return None;
            }
            let start = text.find(signature)?;
            let open = start + text[start..].find('{')?;
            Some(&text[start..=crate::matching_brace(text, open)?])
        }
    }
}

/// Rule: every entry of `copies` is identical to its original, and every entry of `derived` differs.
/// `read` gives a file's text (None when missing).
fn copies_agree(
    copies: &[(&str, &str, Part)],
    derived: &[(&str, &str, &str)],
    read: &dyn Fn(&str) -> Option<String>,
) -> Vec<String> {
    let mut out = Vec::new();
    for &(copy, original, part) in copies {
        let (Some(c), Some(o)) = (read(copy), read(original)) else {
            out.push(format!("{copy} or {original} is missing; update COPIES in tests/it/tidy.rs"));
            continue;
        };
        let what = match part {
            Part::Whole => "the file".to_string(),
            Part::Function(f) => format!("`{f}`"),
            Part::Renamed(_) => "the file (names replaced)".to_string(),
        };
        let o = match part {
            Part::Renamed(names) => names.iter().fold(o, |t, (from, to)| t.replace(from, to)),
            _ => o,
        };
        match (part_of(&c, part), part_of(&o, part)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(_), Some(_)) => out.push(format!(
                "{copy}: {what} differs from {original}, of which it is a copy; make them equal again, or declare the difference in DERIVED with its reason"
            )),
            _ => out.push(format!("{copy} or {original}: {what} is not there exactly once")),
        }
    }
    for &(module, origin, reason) in derived {
        match (read(module), read(origin)) {
            (Some(a), Some(b)) if a == b => out.push(format!(
                "{module} is now identical to {origin} (declared different: {reason}); move it to COPIES"
            )),
            (Some(_), Some(_)) => {}
            _ => out.push(format!("{module} or {origin} is missing; update DERIVED in tests/it/tidy.rs")),
        }
    }
    out
}

/// Rule: every bullet of ARCHITECTURE.md's `## Invariants` is marked (tidy) or names at least one
/// test, `(test: `module::function`, ...)`, and every test named is a function of `tests/it/<module>.rs`.
fn invariants_name_tests(architecture: &str, tests: &Files) -> Vec<String> {
    let Some(start) = architecture.find("## Invariants") else {
        return vec!["ARCHITECTURE.md has no `## Invariants` section".into()];
    };
    let section = &architecture[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut bullets: Vec<String> = Vec::new();
    for line in section.lines() {
        if let Some(b) = line.strip_prefix("- ") {
            bullets.push(b.to_string());
        } else if line.starts_with("  ")
            && let Some(b) = bullets.last_mut()
        {
            b.push(' ');
            b.push_str(line.trim());
        }
    }
    let mut out = Vec::new();
    for b in &bullets {
        let head: String = b.chars().take(60).collect();
        let named: Vec<&str> = b
            .split("(test: ")
            .skip(1)
            .flat_map(|t| t.split(')').next().unwrap_or("").split(','))
            .map(|t| t.trim().trim_matches('`'))
            .filter(|t| !t.is_empty())
            .collect();
        if named.is_empty() && !b.starts_with("(tidy)") {
            out.push(format!("ARCHITECTURE.md invariant \"{head}...\" names no test: add (test: `module::function`)"));
        }
        for t in named {
            let Some((module, function)) = t.split_once("::") else {
                out.push(format!("ARCHITECTURE.md invariant \"{head}...\": `{t}` is not module::function"));
                continue;
            };
            let file = format!("tests/it/{module}.rs");
            let found = tests.iter().any(|(p, text)| {
                *p == file
                    && text.lines().any(|l| {
                        let l = l.trim_start();
                        let l = l.strip_prefix("async ").unwrap_or(l);
                        l.strip_prefix("fn ")
                            .is_some_and(|f| f.strip_prefix(function).is_some_and(|r| r.starts_with('(')))
                    })
            });
            if !found {
                out.push(format!("ARCHITECTURE.md invariant \"{head}...\": test `{t}` is not a function of {file}"));
            }
        }
    }
    out
}

/// Rule: a foreign error becomes an [`metainfer::error::Error`] with a "what: error" message through
/// the one helper (`error::Context`: `.ctx`, `.usage_ctx`, `.internal_ctx`), not a hand-written
/// `map_err(|e| Error::...(format!("...: {e}")))`; messages that put the error elsewhere are free.
fn context_through_the_helper(files: &Files) -> Vec<String> {
    let mut out = Vec::new();
    for (p, t) in own(files).filter(|(p, _)| p != "crates/base/src/error.rs") {
        for (i, line) in t.lines().enumerate() {
            let l = line.split("//").next().unwrap_or("");
            if l.contains("map_err(|e| Error::") && l.contains(": {e}\"") {
                out.push(format!(
                    "{p}:{}: a \"what: error\" message by hand; use error::Context (.ctx, .usage_ctx, .internal_ctx)",
                    i + 1
                ));
            }
        }
    }
    out
}

/// The most lines a source file of src/ or crates/ may have: a room one reads whole.
const MAX_SOURCE_LINES: usize = 850;

/// Rule: no source file is longer than [`MAX_SOURCE_LINES`]; split it by what its parts do.
fn rooms_of_a_readable_size(files: &Files) -> Vec<String> {
    own(files)
        .filter(|(_, t)| t.lines().count() > MAX_SOURCE_LINES)
        .map(|(p, t)| {
            format!("{p}: {} lines (at most {MAX_SOURCE_LINES}); split it by what its parts do", t.lines().count())
        })
        .collect()
}

/// Rule: every request type a tool deserialises (`pub struct ...Request` deriving Deserialize)
/// refuses unknown fields, so a misspelt or foreign argument is an error naming the fields, never
/// silently dropped.
fn requests_refuse_unknown_fields(files: &Files) -> Vec<String> {
    let mut out = Vec::new();
    for (p, text) in own(files) {
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let Some(rest) = l.trim_start().strip_prefix("pub struct ") else { continue };
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !name.ends_with("Request") {
                continue;
            }
            let attrs: Vec<&str> =
                lines[..i].iter().rev().take_while(|a| a.trim_start().starts_with("#[")).copied().collect();
            let derives = attrs.iter().any(|a| a.contains("derive(") && a.contains("Deserialize"));
            if derives && !attrs.iter().any(|a| a.contains("deny_unknown_fields")) {
                out.push(format!("{p}: {name} derives Deserialize without #[serde(deny_unknown_fields)]"));
            }
        }
    }
    out
}

/// Rule: clap is the binary's (src/main.rs and src/cli/): no library module or crate names it.
fn clap_only_in_the_binary(files: &Files) -> Vec<String> {
    own(files)
        .filter(|(p, _)| {
            (p.starts_with("src/") || p.starts_with("crates/")) && p != "src/main.rs" && !p.starts_with("src/cli/")
        })
        .filter(|(_, text)| text.lines().any(|l| code(l).contains("clap::") || code(l).contains("clap ::")))
        .map(|(p, _)| format!("{p}: names clap; argument types live in the binary's cli module"))
        .collect()
}

/// Rule: the oracle and the example engines share no code: no oracle file names an engine's sources,
/// and no example engine depends on this crate.
fn oracle_apart_from_engines(oracle: &Files, engine_manifests: &Files) -> Vec<String> {
    let mut out: Vec<String> = oracle
        .iter()
        // String literals included (a path to an engine's file is one); comments left out.
        .filter(|(_, text)| text.lines().any(|l| l.split("//").next().unwrap_or("").contains("examples/engines")))
        .map(|(p, _)| format!("{p}: reads an example engine's sources; the oracle is written from the contracts"))
        .collect();
    for (p, text) in engine_manifests {
        let manifest: toml::Table = toml::from_str(text).unwrap_or_default();
        if manifest.get("dependencies").and_then(|d| d.as_table()).is_some_and(|d| d.contains_key("metainfer")) {
            out.push(format!("{p}: depends on metainfer; an example engine is written from the contracts"));
        }
    }
    out
}

/// The sources of every layer: the root package's src/ and every workspace crate (src/ and build.rs).
fn sources() -> Files {
    let mut f = rust_files("src");
    f.extend(rust_files("crates"));
    f
}

/// Rule: every manifest's dependencies are used: the root package's by src/ and tests/, each crate's
/// by its own files.
fn unused_dependencies_everywhere(src: &Files, crates: &Files) -> Vec<String> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let mut root_files: Files = src.iter().filter(|(p, _)| p.starts_with("src/")).cloned().collect();
    root_files.extend(rust_files("tests"));
    let mut out = unused_dependencies(("Cargo.toml", &manifest), &root_files);
    for (c, text) in crates {
        let prefix = format!("crates/{c}/");
        let files: Files = src.iter().filter(|(p, _)| p.starts_with(&prefix)).cloned().collect();
        out.extend(unused_dependencies((&format!("{prefix}Cargo.toml"), text), &files));
    }
    out
}

#[test]
fn the_sources_keep_the_architecture() {
    let src = sources();
    let crates = crate_manifests();
    let architecture = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let ckb = Ckb::embedded().unwrap();
    let contracts: BTreeSet<String> = ckb.of_kind(Kind::Kernel).map(|c| c.id.clone()).collect();
    let registry: BTreeSet<String> = kernels::ids().map(str::to_owned).collect();
    let mut problems = Vec::new();
    problems.extend(module_docs(&src));
    problems.extend(processes(&src));
    problems.extend(ops_imports(&src));
    problems.extend(cycles(&src, &crates));
    problems.extend(knows_nothing_of(&src, &crates));
    problems.extend(architecture_names(&src, &architecture));
    problems.extend(unused_dependencies_everywhere(&src, &crates));
    problems.extend(registry_agreement(&contracts, &registry, metainfer::harness::HARNESS_MAIN));
    let skips = std::fs::read_to_string(root().join(".ci/engine-tests")).unwrap();
    problems.extend(fast_tier_skips(&skips, &rust_files("tests")));
    let cuda_contracts: BTreeSet<String> =
        ckb.of_kind(Kind::Kernel).filter(|c| c.cuda.is_some()).map(|c| c.id.clone()).collect();
    let cuda_arms: BTreeSet<String> = kernels::REGISTRY
        .iter()
        .filter(|k| !k.cuda_test_arm.trim().is_empty() && !k.cuda_timed_arm.trim().is_empty())
        .map(|k| k.id.to_string())
        .collect();
    problems.extend(cuda_agreement(&cuda_contracts, &cuda_arms));
    problems.extend(copies_agree(COPIES, DERIVED, &|p| std::fs::read_to_string(root().join(p)).ok()));
    problems.extend(invariants_name_tests(&architecture, &rust_files("tests")));
    problems.extend(clap_only_in_the_binary(&src));
    problems.extend(requests_refuse_unknown_fields(&src));
    problems.extend(context_through_the_helper(&src));
    problems.extend(rooms_of_a_readable_size(&src));
    let manifests: Files = ["llama-cpu-plain", "llama-cpu-simd", "llama-cuda-bf16"]
        .iter()
        .map(|e| {
            let p = format!("examples/engines/{e}/Cargo.toml");
            let text = std::fs::read_to_string(root().join(&p)).unwrap();
            (p, text)
        })
        .collect();
    let oracle: Files = src.iter().filter(|(p, _)| p.starts_with("crates/oracle/")).cloned().collect();
    problems.extend(oracle_apart_from_engines(&oracle, &manifests));
    assert!(problems.is_empty(), "tidy:\n{}", problems.join("\n"));
}

/// Each rule catches a planted violation (and the assembled harness has one arm per kernel).
#[test]
fn each_rule_catches_a_planted_violation() {
    let f = |p: &str, t: &str| vec![(p.to_string(), t.to_string())];
    assert_eq!(module_docs(&f("src/x.rs", "//! doc\nfn a() {}")).len(), 0);
    assert_eq!(module_docs(&f("src/x.rs", "// not a module doc\nfn a() {}")).len(), 1);
    let request = |attrs: &str| f("crates/ops/src/x.rs", &format!("//! d\n{attrs}\npub struct XRequest {{}}"));
    assert_eq!(requests_refuse_unknown_fields(&request("#[derive(Debug, Deserialize)]")).len(), 1);
    assert!(
        requests_refuse_unknown_fields(&request("#[derive(Deserialize)]\n#[serde(deny_unknown_fields)]")).is_empty()
    );
    assert!(requests_refuse_unknown_fields(&request("#[derive(Debug, Serialize)]")).is_empty());

    assert_eq!(processes(&f("src/ops/x.rs", "//! d\nlet c = std::process::Command::new(\"sh\");")).len(), 1);
    assert_eq!(processes(&f("src/ops/x.rs", "//! d\nlet p = duct::cmd(\"sh\", [\"-c\"]);")).len(), 1);
    assert_eq!(processes(&f("crates/harness/src/x.rs", "//! d\nlet p = duct::cmd(\"sh\", [\"-c\"]);")).len(), 0);
    assert_eq!(processes(&f("src/guard/x.rs", "//! d\nconst P: &str = \"Command::new\"; // Command::new")).len(), 0);

    for import in ["use super::kernel_test::KernelResult;", "fn f() { crate::kernel_test::run(); }"] {
        let mut two = f("crates/ops/src/verify.rs", &format!("//! d\n{import}"));
        two.push(("crates/ops/src/kernel_test.rs".into(), "//! d\n".into()));
        assert_eq!(ops_imports(&two).len(), 1, "{import}");
    }
    let mut ok = f("crates/ops/src/scaffold.rs", "//! d\nuse super::plan::plan_only;\nuse crate::gate::Gate;");
    ok.push(("crates/ops/src/plan.rs".into(), "//! d\n".into()));
    ok.push(("crates/ops/src/gate.rs".into(), "//! d\n".into()));
    assert_eq!(ops_imports(&ok), Vec::<String>::new());

    let mut cyc = f("src/a.rs", "//! d\nuse crate::b::X;");
    cyc.push(("src/b/mod.rs".into(), "//! d\nfn f() { crate::a::y(); }".into()));
    assert_eq!(cycles(&cyc, &Files::new()).len(), 1, "{:?}", cycles(&cyc, &Files::new()));
    let mut dag = f("src/a.rs", "//! d\nuse crate::b::X;");
    dag.push(("src/b/mod.rs".into(), "//! d\n".into()));
    assert!(cycles(&dag, &Files::new()).is_empty());
    // Crates: edges from the manifests (a cycle of path dependencies is one cargo refuses too).
    let crate_pair = |b_deps: &str| {
        vec![
            ("a".to_string(), "[dependencies]\nb.workspace = true\n".to_string()),
            ("b".to_string(), format!("[dependencies]\n{b_deps}")),
        ]
    };
    let two_crates = vec![
        ("crates/a/src/lib.rs".to_string(), "//! d".to_string()),
        ("crates/b/src/lib.rs".to_string(), "//! d".to_string()),
    ];
    assert_eq!(cycles(&two_crates, &crate_pair("a.workspace = true\n")).len(), 1);
    assert!(cycles(&two_crates, &crate_pair("serde = \"1\"\n")).is_empty());
    // A root module reaching a crate through a module of base that the root re-exports.
    let mut via_base = f("src/a.rs", "//! d\nuse crate::util::read_regular;");
    via_base.push(("crates/base/src/lib.rs".into(), "//! d".into()));
    assert_eq!(module_graph(&via_base, &Files::new())["a"], BTreeSet::from(["base".to_string()]));

    // The planted file beside the modules it names (an edge needs both ends).
    let tree = |p: &str, t: &str| {
        let mut v = f(p, t);
        for m in ["src/ledger/mod.rs", "src/harness/mod.rs", "src/ops/mod.rs", "src/mcp/mod.rs"] {
            v.push((m.to_string(), "//! d\n".to_string()));
        }
        v
    };
    let none = Files::new();
    assert_eq!(knows_nothing_of(&tree("src/guard/x.rs", "//! d\nfn f() { crate::harness::run(); }"), &none).len(), 1);
    assert_eq!(knows_nothing_of(&tree("src/ops/x.rs", "//! d\nuse rmcp::model::Tool;"), &none).len(), 1);
    assert_eq!(knows_nothing_of(&tree("src/probe.rs", "//! d\nuse crate::ops::Ctx;"), &none).len(), 1);
    assert!(
        knows_nothing_of(&tree("src/ops/x.rs", "//! d\nuse crate::ledger::Ledger; // not rmcp::"), &none).is_empty()
    );
    assert!(
        knows_nothing_of(&tree("src/mcp/x.rs", "//! d\nuse rmcp::model::Tool;\nuse crate::ops::Ctx;"), &none)
            .is_empty()
    );
    // A crate that knows nothing of the oracle or MCP, by its manifest.
    let ckb = |deps: &str| {
        vec![("ckb".to_string(), format!("[dependencies]\n{deps}")), ("oracle".to_string(), String::new())]
    };
    let ckb_file = tree("crates/ckb/src/lib.rs", "//! d");
    assert_eq!(knows_nothing_of(&ckb_file, &ckb("oracle.workspace = true\n")).len(), 1);
    assert_eq!(knows_nothing_of(&ckb_file, &ckb("rmcp.workspace = true\n")).len(), 1);
    assert!(knows_nothing_of(&ckb_file, &ckb("serde.workspace = true\n")).is_empty());

    let nested = |arch: &str| {
        let mut v = f("src/widget/mod.rs", "//! d");
        v.push(("src/widget/inner.rs".into(), "//! d".into()));
        architecture_names(&v, arch)
    };
    assert_eq!(nested("- `gadget/`: ...").len(), 1);
    assert_eq!(nested("- `widgets/`: ...").len(), 1, "a longer word does not name the module");
    assert_eq!(nested("- `widget/`: ...").len(), 0, "submodules need not be named");
    assert_eq!(architecture_names(&f("src/widget.rs", "//! d"), "    widget.rs  ...").len(), 0);

    let manifest = "[dependencies]\nserde = \"1\"\nleft-pad = \"1\"\n";
    let used = f("src/x.rs", "//! d\nuse serde::Serialize;");
    assert_eq!(
        unused_dependencies(("Cargo.toml", manifest), &used),
        vec!["Cargo.toml: dependency `left-pad` is not used"]
    );

    let it = f("tests/it/gates.rs", "#[test]\nfn example_engine_passes() {}");
    assert!(fast_tier_skips("# c\ngates::example_engine\n", &it).is_empty());
    assert_eq!(fast_tier_skips("gates::renamed_test\n", &it).len(), 1);
    assert_eq!(fast_tier_skips("example_engine\n", &it).len(), 1);

    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    let t = "match k {\n    // @arms test\n}\nmatch k {\n    // @arms timed\n}\n";
    assert!(registry_agreement(&set(&["kernel.a"]), &set(&["kernel.a"]), t).is_empty());
    assert_eq!(registry_agreement(&set(&["kernel.a", "kernel.b"]), &set(&["kernel.a"]), t).len(), 1);
    let own_arm = format!("{t}match k {{\n    \"kernel.a\" => {{}}\n}}\n");
    assert_eq!(registry_agreement(&set(&["kernel.a"]), &set(&["kernel.a"]), &own_arm).len(), 1);
    assert_eq!(registry_agreement(&set(&["kernel.a"]), &set(&["kernel.a"]), "// @arms test\n").len(), 1);

    assert!(cuda_agreement(&set(&["kernel.a"]), &set(&["kernel.a"])).is_empty());
    assert_eq!(cuda_agreement(&set(&["kernel.a", "kernel.b"]), &set(&["kernel.a"])).len(), 1);
    assert_eq!(cuda_agreement(&set(&[]), &set(&["kernel.a"])).len(), 1);

    let files = |v: &[(&str, &str)]| -> BTreeMap<String, String> {
        v.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect()
    };
    let stop = "pub fn stop_tokens(d: &Path) -> R { read(d) }";
    let tree = files(&[
        ("a.rs", "x"),
        ("b.rs", "x"),
        ("c.rs", &format!("// c\n{stop}\n")),
        ("d.rs", &format!("{stop}\nfn other() {{}}")),
    ]);
    let read = |p: &str| tree.get(p).cloned();
    let copies = [("b.rs", "a.rs", Part::Whole), ("c.rs", "d.rs", Part::Function("pub fn stop_tokens("))];
    assert!(copies_agree(&copies, &[], &read).is_empty(), "{:?}", copies_agree(&copies, &[], &read));
    // A copy that drifted, a function that is gone, a declared difference that is gone.
    let drifted = files(&[("a.rs", "x"), ("b.rs", "y"), ("c.rs", "fn f() {}"), ("d.rs", stop)]);
    let read = |p: &str| drifted.get(p).cloned();
    assert_eq!(copies_agree(&copies, &[("a.rs", "a.rs", "why")], &read).len(), 3);
    // A renamed copy: equal once the names are replaced, drifted otherwise.
    let renamed = files(&[("o.rs", "use old_crate::x; // old_crate"), ("n.rs", "use new_crate::x; // new_crate")]);
    let read = |p: &str| renamed.get(p).cloned();
    let names: &'static [(&'static str, &'static str)] = &[("old_crate", "new_crate")];
    assert!(copies_agree(&[("n.rs", "o.rs", Part::Renamed(names))], &[], &read).is_empty());
    assert_eq!(copies_agree(&[("n.rs", "o.rs", Part::Renamed(&[("old", "other")]))], &[], &read).len(), 1);

    let it = f("tests/it/gates.rs", "#[test]\nfn example_engine_passes() {}");
    let doc =
        |bullet: &str| format!("# A\n## Invariants\n\n- (tidy) held by tidy.\n{bullet}\n## Next\n- not an invariant\n");
    assert!(invariants_name_tests(&doc("- Held. (test: `gates::example_engine_passes`)"), &it).is_empty());
    assert_eq!(invariants_name_tests(&doc("- Held by nothing."), &it).len(), 1);
    assert_eq!(invariants_name_tests(&doc("- Held,\n  wrapped. (test: `gates::example_engine`)"), &it).len(), 1);
    assert_eq!(invariants_name_tests(&doc("- Held. (test: `nowhere::x`, `gates`)"), &it).len(), 2);

    assert_eq!(clap_only_in_the_binary(&f("src/ops/x.rs", "//! d\nuse clap::Parser;")).len(), 1);
    assert!(clap_only_in_the_binary(&f("src/cli/args.rs", "//! d\nuse clap::Parser;")).is_empty());
    assert!(clap_only_in_the_binary(&f("src/ops/x.rs", "//! d\n// clap::Parser is the binary's")).is_empty());
    assert_eq!(clap_only_in_the_binary(&f("crates/ckb/src/lib.rs", "//! d\nuse clap::Parser;")).len(), 1);
    let by_hand = "//! d\nlet t = read(p).map_err(|e| Error::input(format!(\"{}: {e}\", p.display())))?;";
    assert_eq!(context_through_the_helper(&f("crates/ops/src/x.rs", by_hand)).len(), 1);
    assert_eq!(rooms_of_a_readable_size(&f("src/x.rs", &"//! d\n".repeat(MAX_SOURCE_LINES + 1))).len(), 1);
    assert!(rooms_of_a_readable_size(&f("src/x.rs", &"//! d\n".repeat(MAX_SOURCE_LINES))).is_empty());
    let elsewhere = "//! d\nlet t = parse(p).map_err(|e| Error::input(format!(\"{}: not JSON ({e})\", p.display())))?;";
    assert!(context_through_the_helper(&f("crates/ops/src/x.rs", elsewhere)).is_empty());

    let manifest = f("examples/engines/e/Cargo.toml", "[dependencies]\nmetainfer = { path = \"../../..\" }\n");
    assert_eq!(oracle_apart_from_engines(&Files::new(), &manifest).len(), 1);
    let oracle = f(
        "crates/oracle/src/x.rs",
        "//! d\nconst K: &str = include_str!(\"../../examples/engines/e/src/kernels.rs\");",
    );
    assert_eq!(oracle_apart_from_engines(&oracle, &Files::new()).len(), 1);
    assert!(
        oracle_apart_from_engines(
            &f("crates/oracle/src/x.rs", "//! d"),
            &f("e/Cargo.toml", "[dependencies]\nserde = \"1\"")
        )
        .is_empty()
    );

    // The assembled harness of every registry kernel has exactly one arm per kernel in each match,
    // for the host and for CUDA engines (whose arms call the `device` module).
    for api in ["host", "cuda"] {
        // CUDA engines: the kernels whose contract has a CUDA signature (the serving kernels have none).
        let ids: Vec<&str> = kernels::REGISTRY
            .iter()
            .filter(|k| api == "host" || !k.cuda_test_arm.trim().is_empty())
            .map(|k| k.id)
            .collect();
        let arms: Vec<metainfer::harness::Arm> = ids.iter().map(|k| metainfer::ops::arm(k, api).unwrap()).collect();
        let src = metainfer::harness::harness_source(&arms);
        for k in &ids {
            assert_eq!(src.matches(&format!("{k:?} =>")).count(), 2, "{api} {k}");
        }
        assert_eq!(src.contains("device::dev()"), api == "cuda", "{api}");
        // The serving commands are compiled in only for serving engines.
        assert!(!src.contains("mod serving;") && !src.contains("serving::batch"));
        let serving = metainfer::harness::harness_source_with(&arms, &[], true);
        assert!(
            serving.contains("mod serving;")
                && serving.contains("serving::batch(")
                && serving.contains("serving::block_manager(")
        );
    }
}
