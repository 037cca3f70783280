//! Integration tests: one binary, one module per area. Real data comes from ../shared (models and
//! golden output); builds share one cache under cargo's test tmp dir so dependencies compile once.
//!
//! The example engines under test: the plain and SIMD engines' own unit tests run in
//! `engine_units` (the plain one's: each kernel against hand-worked values; tokenizer, stop tokens
//! and greedy decoding against BabyLlama's golden output; every family's logits and greedy tokens
//! against transformers' on the conformance checkpoints, `$CONFORMANCE_DIR`; the SIMD one's: matrix
//! products against an f64 reference at every thread count, kernels, quantisation), which also shows
//! them failing on a broken kernel. Gates and rules run on the plain and the SIMD engine with one
//! body each (`engine_tests!`); the fault battery (`faults`) and verify on every family (`families`,
//! `contract_families`) use the plain engine, the evolution scenarios both; every weight dtype
//! (`dtypes`), the demo and serving (`serving`: verify_batching, faulted schedulers, the serving
//! kernels' diagnosis) the SIMD engine; `cuda` checks that the CUDA engine builds here, keeps its
//! contracts' signatures, and that every gate says "no CUDA device: not run".
//!
//! The helpers every module shares are here: paths (`shared`, `babyllama`), `ctx` and `budget`, engine
//! copies (`copy_example`, `Engine::copy_to` for a copy a test edits; `shared_example`,
//! `Engine::shared_copy`, `shared_engine` for one that tests run unmodified, which then compiles once
//! for all of them), `empty_crate`, fault planting (`inject`, `replace_body`).
//! Requests are written with only the fields a test sets (`VerifyRequest { seed: Some(5),
//! ..Default::default() }`): every request type derives `Default`.
//!
//! A fault is planted by replacing the whole body of a named function ([`replace_body`]): a
//! kernel's, whose signature the contract fixes, or one of the plain engine's small model helpers
//! (`rope_with_freqs`, `glu`, `store`, `post_process`), never exact source lines.

mod bundles;
mod checkpoints;
mod ckb;
mod cli;
mod client;
mod conformance;
mod contract_families;
mod corpus;
mod cuda;
mod diagnose;
mod dtypes;
mod engine_units;
mod evolution;
mod evolve;
mod families;
mod faults;
mod first_hour;
mod gates;
mod graph;
mod ledger;
mod mcp;
mod model;
mod moe;
mod oracle;
mod race;
mod readme;
mod rules;
mod sandbox;
mod serving;
mod signals;
mod tidy;
mod verdicts;

use std::path::{Path, PathBuf};

use metainfer::ckb::Ckb;
use metainfer::harness::Workshop;
use metainfer::ops::Ctx;

/// The metainfer binary cargo built for these tests.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_metainfer"))
}

/// ../shared beside the repository.
pub fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared")
}

/// The real BabyLlama checkpoint in HF layout.
pub fn babyllama() -> PathBuf {
    shared().join("models/babyllama-105")
}

/// The agreed golden output for "Once upon a time".
pub fn golden() -> serde_json::Value {
    let p = shared().join("golden/babyllama-105-once-upon-a-time.json");
    serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// Build cache shared by every test (and every test run).
pub fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("metainfer-cache")
}

/// A path as the string a request takes.
pub fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The time limit of one gate call in the tests (900 s, the server's default).
pub fn budget() -> metainfer::harness::Budget {
    metainfer::harness::Budget::secs(900)
}

/// A context over the shipped CKB with the shared cache and a ledger in `dir`.
pub fn ctx(dir: &Path) -> Ctx {
    let mut c = Ctx {
        ckb: Ckb::embedded().expect("shipped CKB is valid"),
        workshop: Workshop::new(cache()),
        ledger: dir.join("ledger.sqlite"),
        workspace: None,
        models: vec![],
        time_limit_s: 900,
        max_output: metainfer::ops::MAX_TEXT,
        client: Default::default(),
        ckb_dir: None,
    };
    c.workshop.protected = c.protected_paths();
    c
}

/// The SIMD example engine's directory in this repository (the demo's engine).
pub fn example_engine() -> PathBuf {
    Engine::Simd.dir()
}

/// Write an empty library crate named `empty` at `dir` (a manifest and an empty `src/lib.rs`): the
/// engine every gate must fail on.
pub fn empty_crate(dir: &Path) {
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let manifest = "[package]\nname = \"empty\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[workspace]\n";
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::write(dir.join("src/lib.rs"), "").unwrap();
}

/// Copy the SIMD example engine (as the demo embeds it) to `dir`.
pub fn copy_example(dir: &Path) {
    metainfer::demo::write_example_engine(dir).unwrap();
}

/// The SIMD example engine as the demo embeds it, in the copy every test running it unmodified
/// shares ([`shared_engine`]).
pub fn shared_example() -> PathBuf {
    shared_engine("example", copy_example)
}

/// An engine that `write` writes, in a directory shared by every test that runs the same sources
/// unmodified: `$CARGO_TARGET_TMPDIR/engines/<name>-<sha256 of its files, 16 hex>`. The server keys
/// its snapshots and harness builds by the engine's directory, so the tests that share a copy
/// compile the engine once per feature set and harness, where copies of their own would compile it
/// again in each test. The sources are written to a staging directory and renamed into place, so a
/// concurrent test never sees half a copy. Never write into the result: a test that plants a fault
/// or edits the manifest takes its own copy ([`Engine::copy_to`], [`copy_example`]).
pub fn shared_engine(name: &str, write: impl Fn(&Path)) -> PathBuf {
    let parent = Path::new(env!("CARGO_TARGET_TMPDIR")).join("engines");
    std::fs::create_dir_all(&parent).unwrap();
    let staging = tempfile::Builder::new().prefix(&format!(".{name}-")).tempdir_in(&parent).unwrap();
    write(staging.path());
    let hash = metainfer::harness::source_hash(staging.path()).unwrap();
    let dir = parent.join(format!("{name}-{}", &hash[..16]));
    // Another test may have placed the same sources first: the staging copy is then dropped.
    if !dir.join("Cargo.toml").is_file() && std::fs::rename(staging.path(), &dir).is_err() {
        assert!(dir.join("Cargo.toml").is_file(), "cannot place the shared engine at {}", dir.display());
    }
    dir
}

/// The example engines under examples/engines/, on which the gate tests run one test body each
/// (see [`engine_tests`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// llama-cpu-plain: portable, short, f32; every family. The shape a generated engine should have.
    Plain,
    /// llama-cpu-simd: AVX-512/AVX2 kernels, threads, memory-mapped weights, bf16/f16/int8 builds.
    Simd,
    /// llama-cuda-bf16: CUDA through cudarc (NVRTC kernels, bf16 weights); runs only on a GPU.
    Cuda,
}

impl Engine {
    /// The engine's directory in this repository.
    pub fn dir(self) -> PathBuf {
        let name = match self {
            Engine::Plain => "llama-cpu-plain",
            Engine::Simd => "llama-cpu-simd",
            Engine::Cuda => "llama-cuda-bf16",
        };
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/engines").join(name)
    }

    /// A copy of the engine's sources that every test running it unmodified shares
    /// ([`shared_engine`]).
    pub fn shared_copy(self) -> PathBuf {
        let name = self.dir().file_name().unwrap().to_string_lossy().into_owned();
        shared_engine(&name, |to| self.copy_to(to))
    }

    /// Copy the engine's sources (Cargo.toml, metainfer.toml, src/; no build output) to `to`.
    pub fn copy_to(self, to: &Path) {
        let from = self.dir();
        for e in walkdir::WalkDir::new(&from).into_iter().filter_entry(|e| e.file_name() != "target") {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(&from).unwrap();
            if e.file_type().is_file() && rel != Path::new("Cargo.lock") {
                std::fs::create_dir_all(to.join(rel).parent().unwrap()).unwrap();
                std::fs::copy(e.path(), to.join(rel)).unwrap();
            }
        }
    }
}

/// One test body run on every example engine, as `name::plain` and `name::simd`: `engine_tests!(f)`
/// for a `fn f(engine: Engine)` in scope.
#[macro_export]
macro_rules! engine_tests {
    ($body:ident) => {
        mod $body {
            #[test]
            fn plain() {
                super::$body($crate::Engine::Plain)
            }
            #[test]
            fn simd() {
                super::$body($crate::Engine::Simd)
            }
        }
    };
}

/// Replace `from` by `to` in `dir/rel`, asserting the pattern exists (so a fault is really injected).
pub fn inject(dir: &Path, rel: &str, from: &str, to: &str) {
    let p = dir.join(rel);
    let s = std::fs::read_to_string(&p).unwrap();
    assert!(s.contains(from), "fault pattern {from:?} not found in {rel}");
    std::fs::write(&p, s.replacen(from, to, 1)).unwrap();
}

/// Replace the body of the one function in `dir/rel` whose declaration starts with `signature`
/// (e.g. `pub fn rms_norm(`) by `body`, the code between its braces: a fault injected by structure,
/// whatever the function's code was. The body's end is found by matching braces, skipping string
/// and char literals and line comments (not raw strings or block comments).
pub fn replace_body(dir: &Path, rel: &str, signature: &str, body: &str) {
    let p = dir.join(rel);
    let s = std::fs::read_to_string(&p).unwrap();
    assert_eq!(s.matches(signature).count(), 1, "{signature:?} must occur once in {rel}");
    let start = s.find(signature).unwrap();
    let open = start + s[start..].find('{').unwrap_or_else(|| panic!("{signature:?} has no body in {rel}"));
    let close = matching_brace(&s, open).unwrap_or_else(|| panic!("unbalanced braces after {signature:?} in {rel}"));
    std::fs::write(&p, format!("{}{{\n{body}\n}}{}", &s[..open], &s[close + 1..])).unwrap();
}

/// The index of the `}` that closes the `{` at `open`.
pub(crate) fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let (b, mut depth, mut i) = (s.as_bytes(), 0usize, open);
    while i < b.len() {
        match b[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
            }
            // A char literal ('{', '\'', '▁'), not a lifetime ('a).
            b'\'' if b.get(i + 1) == Some(&b'\\') => i += 3 + s[i + 3..].find('\'')?,
            b'\'' => {
                let len = s[i + 1..].chars().next().map_or(1, char::len_utf8);
                if b.get(i + 1 + len) == Some(&b'\'') {
                    i += 1 + len;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'/') => i += s[i..].find('\n').unwrap_or(s.len() - i),
            _ => {}
        }
        i += 1;
    }
    None
}

/// A report's JSON (its structuredContent) must validate against the tool's outputSchema; clients
/// such as the Python SDK reject the call otherwise.
pub fn assert_conforms<T: schemars::JsonSchema + serde::Serialize>(report: &T) {
    let schema = serde_json::Value::Object((*metainfer::mcp::schema::output::<T>()).clone());
    let value = serde_json::to_value(report).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = v.iter_errors(&value).map(|e| format!("{}: {e}", e.instance_path())).collect();
    assert!(errors.is_empty(), "structured content does not match outputSchema: {errors:?}\n{value}");
    // Every number (seeds, counts, ids) must survive a JavaScript client's number conversion.
    assert_eq!(metainfer::util::js_unsafe_numbers(&value), Vec::<String>::new(), "{value}");
}
