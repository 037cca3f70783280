//! Knowledge-base evolution: unexplained recurring failures become schema-valid candidates; proposals
//! are validated and staged (or refused with field-level reasons, nothing staged); promotion needs
//! evidence in the ledger or a person's --force, and then plan covers the new target.

use std::path::Path;

use metainfer::ckb::Ckb;
use metainfer::ledger::{Ledger, Outcome};
use metainfer::ops::evolve::{EvolveRequest, ProposeRequest, evolve, promote, propose};

fn failed(i: usize, tool: &str, contracts: &[&str], summary: &str, figures: serde_json::Value) -> Outcome {
    Outcome {
        id: format!("o{i}"),
        time: "2026-11-30T10:00:00Z".into(),
        tool: tool.into(),
        engine: "/e".into(),
        engine_hash: "h".into(),
        contracts: contracts.iter().map(|c| c.to_string()).collect(),
        passed: false,
        summary: summary.into(),
        figures,
        reference_level: "zero".into(),
        duration_ms: 1,
        client: String::new(),
        constraints: serde_json::json!({}),
        status: String::new(),
        imported: false,
        authenticated: false,
    }
}

/// Each cluster's shape and its outcomes, sorted.
fn shapes(r: &metainfer::ops::evolve::EvolveReport) -> Vec<(String, Vec<String>)> {
    let mut seen: Vec<(String, Vec<String>)> =
        r.clusters.iter().map(|c| (c.shape.clone(), c.outcomes.clone())).collect();
    seen.sort();
    seen
}

#[test]
fn recurring_unexplained_failures_become_valid_candidates() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let l = Ledger::open(&ctx.ledger).unwrap();
    for (i, seed) in [11u64, 22, 33].iter().enumerate() {
        let summary =
            format!("verify FAILED: 0/4 prompts passed (seed {seed}, model.llama, logits atol 0.001 rtol 0.001)");
        l.record(&failed(i, "verify_generation", &["model.llama@1"], &summary, serde_json::json!({"diagnosis": []})))
            .unwrap();
    }
    // Explained by a known failure mode: not a candidate.
    l.record(&failed(
        10,
        "verify_generation",
        &["model.llama@1"],
        "verify FAILED: other",
        serde_json::json!({"diagnosis": ["failure.rope-adjacent-pairs"]}),
    ))
    .unwrap();
    for i in 20..22 {
        let k = serde_json::json!({"kernels": [{"id": "kernel.softmax", "passed": false, "diagnosis": []}]});
        l.record(&failed(i, "run_kernel_test", &["kernel.softmax@1"], "kernel tests FAILED", k)).unwrap();
    }
    for i in 30..32 {
        let c = serde_json::json!({"codes": ["E0308"], "hinted": ["kernel.linear"]});
        l.record(&failed(i, "compile_engine", &[], "compile FAILED", c)).unwrap();
    }
    let r = evolve(&ctx, &EvolveRequest::default()).unwrap();
    assert_eq!((r.failures, r.explained), (8, 1));
    let mut seen: Vec<(String, String, usize)> =
        r.clusters.iter().map(|c| (c.tool.clone(), c.contract.clone(), c.outcomes.len())).collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("compile_engine".to_string(), "kernel.linear".to_string(), 2),
            ("run_kernel_test".to_string(), "kernel.softmax".to_string(), 2),
            ("verify_generation".to_string(), "model.llama".to_string(), 3),
        ]
    );
    // Every candidate validates against the schema and lint together with the shipped CKB.
    let mut files = metainfer::ckb::embedded_files();
    for c in &r.clusters {
        let text = std::fs::read_to_string(ctx.candidates_dir().join(&c.file)).unwrap();
        assert!(text.contains("o0") || text.contains("o20") || text.contains("o30"), "evidence links outcomes: {text}");
        files.push((format!("candidates-check/{}", c.file), text));
    }
    let (_, findings) = Ckb::check_sources(files, "test".into(), None);
    assert_eq!(findings, vec![]);
    // Nothing entered the CKB: the built-in one has no candidate.
    assert!(ctx.ckb.all().all(|c| !c.id.starts_with("failure.candidate-")));
}

/// Kernel failures cluster by what went wrong: numbers outside tolerance apart from a panic, and
/// neither a kernel still `todo!()` nor a run with no device (nothing ran) makes a candidate.
#[test]
fn kernel_failures_cluster_by_kind_and_unwritten_ones_make_no_candidate() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let l = Ledger::open(&ctx.ledger).unwrap();
    let kernel = |extra: serde_json::Value| {
        let mut k = serde_json::json!({"id": "kernel.argmax", "passed": false, "diagnosis": []});
        k.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::json!({"kernels": [k]})
    };
    for i in 0..2 {
        let todo = kernel(serde_json::json!({"unwritten": true, "error": "panicked: not yet implemented"}));
        l.record(&failed(i, "run_kernel_test", &["kernel.argmax@1"], "kernel tests FAILED", todo)).unwrap();
        let mut none = kernel(serde_json::json!({}));
        none["no_device"] = true.into();
        l.record(&failed(10 + i, "run_kernel_test", &["kernel.argmax@1"], "kernel tests FAILED", none)).unwrap();
        let panic =
            kernel(serde_json::json!({"error": format!("panicked at src/lib.rs:{}:9: index out of bounds", 40 + i)}));
        l.record(&failed(20 + i, "run_kernel_test", &["kernel.argmax@1"], "kernel tests FAILED", panic)).unwrap();
        let off = kernel(serde_json::json!({"max_abs_err": 0.5}));
        l.record(&failed(30 + i, "run_kernel_test", &["kernel.argmax@1"], "kernel tests FAILED", off)).unwrap();
    }
    let r = evolve(&ctx, &EvolveRequest::default()).unwrap();
    let seen = shapes(&r);
    assert_eq!(
        seen,
        [
            (
                "kernel failed: panicked at src/lib.rs:N:N: index out of bounds".to_string(),
                vec!["o20".to_string(), "o21".to_string()]
            ),
            ("kernel outside tolerance".to_string(), vec!["o30".to_string(), "o31".to_string()]),
        ]
    );
}

/// Failed verifies cluster by where the checker saw them go wrong, not by their message's wording:
/// four failures with one message shape, two diverging in prefill and two in the tokenizer, are two
/// candidates of two outcomes each (grouped by the summary text, they were one of four); failures
/// localised to a graph node cluster by that node.
#[test]
fn failed_verifies_cluster_by_where_they_diverge() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let l = Ledger::open(&ctx.ledger).unwrap();
    for (i, divergence) in ["prefill", "tokenizer", "prefill", "tokenizer"].iter().enumerate() {
        let summary =
            format!("verify FAILED: 0/4 prompts passed (seed {i}, model.qwen3, logits atol 0.001 rtol 0.001)");
        let figures = serde_json::json!({"diagnosis": [], "divergence": divergence});
        l.record(&failed(i, "verify_generation", &["model.qwen3@1"], &summary, figures)).unwrap();
    }
    // Localised failures cluster by the graph node too: two at q_norm are one candidate, one at
    // attn stays below the cluster size.
    for (i, point) in [(4, "q_norm"), (5, "attn"), (6, "q_norm")] {
        let summary =
            format!("verify FAILED: 0/4 prompts passed (seed {i}, model.qwen3, logits atol 0.001 rtol 0.001)");
        let figures = serde_json::json!({"diagnosis": [], "divergence": "prefill", "point": point});
        l.record(&failed(i, "verify_generation", &["model.qwen3@1"], &summary, figures)).unwrap();
    }
    let r = evolve(&ctx, &EvolveRequest::default()).unwrap();
    let seen = shapes(&r);
    assert_eq!(
        seen,
        [
            ("verify_generation diverges first in prefill".to_string(), vec!["o0".to_string(), "o2".to_string()]),
            (
                "verify_generation diverges first in prefill at graph node q_norm".to_string(),
                vec!["o4".to_string(), "o6".to_string()]
            ),
            ("verify_generation diverges first in tokenizer".to_string(), vec!["o1".to_string(), "o3".to_string()]),
        ]
    );
}

fn aarch64_platform(version: u32) -> String {
    format!(
        r#"id = "platform.cpu-aarch64"
kind = "platform"
version = {version}
summary = "64-bit Arm CPUs with NEON (128-bit SIMD), f32."
sources = [{{ title = "Arm Architecture Reference Manual, Advanced SIMD (NEON)" }}]

[platform]
target = "cpu-aarch64"
dtypes = ["f32"]
simd_bits = 128
bandwidth_gbs = {{ "1" = 20.0 }}
peak_gflops_f32 = {{ "1" = 32.0 }}
guidance = ["stream each weight once per token with four independent NEON accumulators"]
"#
    )
}

/// Write the shipped CKB's files into `dir`: a working copy for `--ckb DIR`.
pub fn working_copy(dir: &Path) {
    for (p, s) in metainfer::ckb::embedded_files() {
        let path = dir.join(&p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, s).unwrap();
    }
}

#[test]
fn proposals_are_validated_staged_and_promoted_on_evidence() {
    let t = tempfile::tempdir().unwrap();
    let mut ctx = crate::ctx(t.path());

    // Refused with field-level reasons; nothing staged.
    let bad = aarch64_platform(1).replace("simd_bits = 128", "simd_bits = \"wide\"");
    let r = propose(&ctx, &ProposeRequest { toml: bad }).unwrap();
    assert!(!r.staged && r.findings.iter().any(|f| f.field.contains("simd_bits")), "{r:?}");
    assert!(!ctx.candidates_dir().exists(), "nothing may be staged for a refused proposal");
    let amend_same =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("contracts/kernels/argmax.toml")).unwrap();
    let r = propose(&ctx, &ProposeRequest { toml: amend_same.clone() }).unwrap();
    assert!(!r.staged && r.findings.iter().any(|f| f.field == "/version"), "{r:?}");
    let r = propose(&ctx, &ProposeRequest { toml: amend_same.replacen("version = 1", "version = 2", 1) }).unwrap();
    assert!(r.staged && r.amendment, "{r:?}");

    let r = propose(&ctx, &ProposeRequest { toml: aarch64_platform(1) }).unwrap();
    assert!(r.staged && !r.amendment, "{r:?}");

    // Promotion writes into a working copy only, and needs evidence or --force.
    let e = promote(&ctx, "platform.cpu-aarch64", false).unwrap_err();
    assert!(e.message.contains("--ckb"), "{}", e.message);
    let wc = t.path().join("ckb");
    working_copy(&wc);
    let staged = std::fs::read_to_string(ctx.candidates_dir().join("platforms/cpu-aarch64.toml")).unwrap();
    ctx.ckb_dir = Some(wc.clone());
    std::fs::create_dir_all(ctx.candidates_dir().join("platforms")).unwrap();
    std::fs::write(ctx.candidates_dir().join("platforms/cpu-aarch64.toml"), staged).unwrap();
    let e = promote(&ctx, "platform.cpu-aarch64", false).unwrap_err();
    assert!(e.message.contains("no evidence"), "{}", e.message);
    // An imported passing outcome (another ledger's) is shown but is not evidence.
    let mut imported = failed(98, "profile_engine", &["platform.cpu-aarch64@1"], "profile", serde_json::json!({}));
    imported.passed = true;
    Ledger::open(&ctx.ledger).unwrap().import_jsonl(&serde_json::to_string(&imported).unwrap()).unwrap();
    let e = promote(&ctx, "platform.cpu-aarch64", false).unwrap_err();
    assert!(e.message.contains("no evidence"), "{}", e.message);
    // A verified profile, as profile_engine records it (an unverified one is no evidence).
    let mut ok =
        failed(99, "profile_engine", &["platform.cpu-aarch64@1"], "profile", serde_json::json!({"verified": true}));
    ok.passed = true;
    Ledger::open(&ctx.ledger).unwrap().record(&ok).unwrap();
    let msg = promote(&ctx, "platform.cpu-aarch64", false).unwrap();
    assert!(msg.contains("evidence: outcome o99"), "{msg}");
    assert!(wc.join("platforms/cpu-aarch64.toml").is_file());

    // The working copy is valid and plan now covers the new target.
    let out = std::process::Command::new(crate::bin())
        .arg("--ckb")
        .arg(&wc)
        .args(["plan", "--target", "cpu-aarch64", "--model"])
        .arg(crate::babyllama())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("platform.cpu-aarch64"), "{text}");
}

/// Every file under `root` with its contents, in path order.
fn tree(root: &Path) -> Vec<(String, Vec<u8>)> {
    walkdir::WalkDir::new(root)
        .sort_by_file_name()
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| !e.file_type().is_dir())
        .map(|e| (e.path().display().to_string(), std::fs::read(e.path()).unwrap_or_default()))
        .collect()
}

#[test]
fn contract_ids_are_names_not_paths() {
    let t = tempfile::tempdir().unwrap();
    let mut ctx = crate::ctx(t.path());
    let wc = t.path().join("ckb");
    working_copy(&wc);
    ctx.ckb_dir = Some(wc.clone());
    metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let argmax_path = wc.join("kernels/argmax.toml");
    let argmax = std::fs::read_to_string(&argmax_path).unwrap();
    let before = tree(t.path());
    let long = format!("kernel.{}", "a".repeat(65));
    let ids = [
        "kernel.../../../../x",
        "kernel./../../kernels/argmax",
        "kernel./../argmax",
        "kernel.a/b",
        "kernel.ArgMax",
        "kernel.",
        "kernel.-x",
        "kernel.x.y",
        "kernel.arg max",
        "kernel.argmax\u{0}",
        "kernel.é",
        "kernels.argmax",
        "../kernel.x",
        "",
        long.as_str(),
    ];
    for id in ids {
        let toml = argmax
            .replacen("id = \"kernel.argmax\"", &format!("id = {}", toml::Value::String(id.into())), 1)
            .replacen("version = 1", "version = 2", 1);
        let r = propose(&ctx, &ProposeRequest { toml }).unwrap();
        assert!(!r.staged, "{id:?}: {r:?}");
        assert!(
            r.findings.iter().any(|f| f.field == "/id" && f.message.contains("contract ids are `<kind>.<name>`")),
            "{id:?}: the grammar must be named: {r:?}"
        );
        let e = promote(&ctx, id, true).unwrap_err();
        assert!(e.message.contains("contract ids are `<kind>.<name>`"), "{id:?}: {}", e.message);
    }
    assert_eq!(tree(t.path()), before, "nothing may be written for a refused id");
    assert!(!t.path().join("x.toml").exists());

    // A working copy holding a contract whose id is not a name is refused at load, naming the grammar.
    let bad = t.path().join("bad");
    working_copy(&bad);
    std::fs::write(bad.join("kernels/argmax.toml"), argmax.replacen("\"kernel.argmax\"", "\"kernel.Arg/max\"", 1))
        .unwrap();
    let e = Ckb::from_dir(&bad).unwrap_err();
    assert!(e.message.contains("contract ids are `<kind>.<name>`"), "{}", e.message);

    // A candidates folder linked into the working copy cannot turn a proposal into a replacement.
    std::fs::create_dir_all(ctx.candidates_dir()).unwrap();
    std::os::unix::fs::symlink(wc.join("kernels"), ctx.candidates_dir().join("kernels")).unwrap();
    let e = propose(&ctx, &ProposeRequest { toml: argmax.replacen("version = 1", "version = 2", 1) }).unwrap_err();
    assert!(e.message.contains("symlink"), "{}", e.message);
    assert_eq!(std::fs::read_to_string(&argmax_path).unwrap(), argmax, "the working copy is unchanged");
}
