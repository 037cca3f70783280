//! Integration tests: one binary, one module per area. Real data comes from ../shared (models and
//! golden output); builds share one cache under cargo's test tmp dir so dependencies compile once.

mod checkpoints;
mod ckb;
mod client;
mod diagnose;
mod dtypes;
mod evolution;
mod evolve;
mod families;
mod gates;
mod ledger;
mod mcp;
mod model;
mod oracle;
mod rules;

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

/// A context over the shipped CKB with the shared cache and a ledger in `dir`.
pub fn ctx(dir: &Path) -> Ctx {
    Ctx {
        ckb: Ckb::embedded().expect("shipped CKB is valid"),
        workshop: Workshop { root: cache() },
        ledger: dir.join("ledger.sqlite"),
        workspace: None,
        models: vec![],
        time_limit_s: 900,
        max_output: metainfer::ops::MAX_TEXT,
        client: Default::default(),
        ckb_dir: None,
    }
}

/// The example engine's directory in this repository.
pub fn example_engine() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/engines/llama-cpu-simd")
}

/// Copy the example engine (Cargo.toml and src/) to `dir`, for fault injection.
pub fn copy_example(dir: &Path) {
    metainfer::demo::write_example_engine(dir).unwrap();
}

/// Replace `from` by `to` in `dir/rel`, asserting the pattern exists (so a fault is really injected).
pub fn inject(dir: &Path, rel: &str, from: &str, to: &str) {
    let p = dir.join(rel);
    let s = std::fs::read_to_string(&p).unwrap();
    assert!(s.contains(from), "fault pattern {from:?} not found in {rel}");
    std::fs::write(&p, s.replacen(from, to, 1)).unwrap();
}

/// A report's JSON (its structuredContent) must validate against the tool's outputSchema; clients
/// such as the Python SDK reject the call otherwise.
pub fn assert_conforms<T: schemars::JsonSchema + serde::Serialize>(report: &T) {
    let schema = serde_json::Value::Object((*metainfer::mcp::schema::output::<T>()).clone());
    let value = serde_json::to_value(report).unwrap();
    let v = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = v.iter_errors(&value).map(|e| format!("{}: {e}", e.instance_path())).collect();
    assert!(errors.is_empty(), "structured content does not match outputSchema: {errors:?}\n{value}");
}
