//! The rules: one fixture per rule (made at test time from the example engine) caught with its id;
//! the example engine has no finding; every correctness gate fails on an empty crate, the bare
//! scaffold and an engine that returns plausible constants.

use std::path::Path;

use crate::s;
use metainfer::guard::Severity;
use metainfer::harness::Budget;
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::profile::{ProfileRequest, profile};
use metainfer::ops::rules::{RulesRequest, check_rules};
use metainfer::ops::verify::{VerifyRequest, verify};

/// The findings' (rule, severity) pairs, and the report's text for failure messages.
fn rules_of(ctx: &metainfer::ops::Ctx, engine: &Path) -> (Vec<(String, Severity)>, String) {
    let r = check_rules(ctx, &RulesRequest { engine: s(engine) }, &Budget::secs(600)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    (r.findings.into_iter().map(|f| (f.rule, f.severity)).collect(), text)
}

fn append(dir: &Path, rel: &str, text: &str) {
    let p = dir.join(rel);
    let mut s = std::fs::read_to_string(&p).unwrap_or_default();
    s.push_str(text);
    std::fs::write(p, s).unwrap();
}

/// Each example engine, as it is in this repository, has no finding.
fn example_engine_has_no_finding(engine: crate::Engine) {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let r = check_rules(&ctx, &RulesRequest { engine: s(&engine.dir()) }, &Budget::secs(600)).unwrap();
    assert!(r.passed && r.findings.is_empty(), "{}", metainfer::ops::Report::text(&r));
    assert!(r.packages > 0, "the dependency graph was resolved");
}

crate::engine_tests!(example_engine_has_no_finding);

#[test]
fn each_rule_catches_its_fixture() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let fixture = |name: &str| {
        let d = t.path().join(name);
        crate::copy_example(&d);
        d
    };
    let mut caught = Vec::new();
    let mut expect = |engine: &Path, rule: &str| {
        let (found, text) = rules_of(&ctx, engine);
        assert!(found.iter().any(|(r, sev)| r == rule && *sev == Severity::Blocking), "{rule} not caught:\n{text}");
        caught.push(rule.to_string());
    };

    // dependency-denied: a crate named like an inference framework anywhere in the graph.
    let d = fixture("deny");
    std::fs::create_dir_all(d.join("vendor/candle-core/src")).unwrap();
    std::fs::write(
        d.join("vendor/candle-core/Cargo.toml"),
        "[package]\nname = \"candle-core\"\nversion = \"0.11.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::write(d.join("vendor/candle-core/src/lib.rs"), "").unwrap();
    crate::inject(
        &d,
        "Cargo.toml",
        "[dependencies]\n",
        "[dependencies]\ncandle-core = { path = \"vendor/candle-core\" }\n",
    );
    expect(&d, "dependency-denied");

    // path-outside: a path dependency on a crate beside the engine.
    let d = fixture("path");
    let outside = t.path().join("outside-crate");
    std::fs::create_dir_all(outside.join("src")).unwrap();
    std::fs::write(
        outside.join("Cargo.toml"),
        "[package]\nname = \"helper\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::write(outside.join("src/lib.rs"), "").unwrap();
    crate::inject(&d, "Cargo.toml", "[dependencies]\n", "[dependencies]\nhelper = { path = \"../outside-crate\" }\n");
    expect(&d, "path-outside");

    // path-outside via include_str!.
    let d = fixture("include");
    append(&d, "src/lib.rs", "\npub const SECRET: &str = include_str!(\"../../outside.txt\");\n");
    std::fs::write(t.path().join("outside.txt"), "x").unwrap();
    expect(&d, "path-outside");

    // git-dependency.
    let d = fixture("git");
    crate::inject(
        &d,
        "Cargo.toml",
        "[dependencies]\n",
        "[dependencies]\nhelper = { git = \"https://example.invalid/helper.git\" }\n",
    );
    expect(&d, "git-dependency");

    // symlink-outside.
    let d = fixture("symlink");
    std::os::unix::fs::symlink(t.path().join("outside.txt"), d.join("src/data.txt")).unwrap();
    expect(&d, "symlink-outside");

    // build-script that runs a program.
    let d = fixture("build");
    std::fs::write(
        d.join("build.rs"),
        "fn main() { let _ = std::process::Command::new(\"curl\").arg(\"https://example.invalid\").status(); }\n",
    )
    .unwrap();
    expect(&d, "build-script");

    // signature-changed: the gate's rope signature altered.
    let d = fixture("sig");
    crate::inject(&d, "src/kernels.rs", "theta: f32", "theta: f64");
    expect(&d, "signature-changed");

    // hardcoded-output: a token-id table.
    let d = fixture("hard");
    let ids: Vec<String> = (0..48).map(|i| (i * 7 % 105).to_string()).collect();
    append(&d, "src/generate.rs", &format!("\npub const ANSWER: [u32; 48] = [{}];\n", ids.join(", ")));
    expect(&d, "hardcoded-output");

    // provenance-match: register "another framework" whose code is the example's kernels with
    // every identifier renamed; the engine's kernels.rs matches it.
    let reference = t.path().join("other-framework");
    std::fs::create_dir_all(&reference).unwrap();
    let kernels = std::fs::read_to_string(crate::example_engine().join("src/kernels.rs")).unwrap();
    std::fs::write(
        reference.join("ops.rs"),
        kernels.replace("out", "dst").replace("head_dim", "hd").replace("theta", "base"),
    )
    .unwrap();
    let out = std::process::Command::new(crate::bin())
        .args(["--ledger"])
        .arg(&ctx.ledger)
        .args(["reference", "add", "--name", "other-framework"])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d = fixture("copied");
    expect(&d, "provenance-match");
    // At reference level `code` the same match is a warning, not a block.
    crate::inject(&d, "metainfer.toml", "reference_level = \"zero\"", "reference_level = \"code\"");
    let (found, _) = rules_of(&ctx, &d);
    assert!(found.contains(&("provenance-match".to_string(), Severity::Warning)), "{found:?}");

    println!("rules caught: {} fixtures: {}", caught.len(), caught.join(", "));

    // A blocking finding stops a gate, and the outcome is recorded.
    let d = t.path().join("sig");
    let k = kernel_test(
        &ctx,
        &KernelTestRequest { engine: s(&d), kernels: vec![], ..Default::default() },
        &Budget::secs(600),
    )
    .unwrap();
    assert!(!k.passed && k.build_error.contains("signature-changed") && k.kernels.is_empty(), "{k:?}");
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let last = &ledger.list(0, 1).unwrap()[0];
    assert_eq!((last.tool.as_str(), last.passed), ("run_kernel_test", false));
    assert_eq!(last.figures["blocked"], true);
}

#[test]
fn verify_passes_only_after_kernel_tests_passed_on_the_same_sources() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let d = t.path().join("engine");
    crate::copy_example(&d);
    let req = VerifyRequest {
        engine: s(&d),
        model: s(&crate::babyllama()),
        prompts: vec![],
        max_new_tokens: Some(4),
        ..Default::default()
    };
    let v = verify(&ctx, &req, &Budget::secs(600)).unwrap();
    assert!(!v.passed && v.error.contains("phase order"), "{}", v.error);
    assert!(v.prompts.iter().all(|p| p.error.is_empty()), "generation itself matched");
    // A kernel test limited to one kernel passes, and is no phase-order evidence: the other
    // kernels may be wrong (an agent could otherwise test only the kernels that pass).
    let one = KernelTestRequest { engine: s(&d), kernels: vec!["kernel.embedding".into()], ..Default::default() };
    let k = kernel_test(&ctx, &one, &Budget::secs(600)).unwrap();
    assert!(k.passed && k.kernels.len() == 1);
    let v = verify(&ctx, &req, &Budget::secs(600)).unwrap();
    assert!(!v.passed && v.error.contains("phase order") && v.error.contains("limited to some kernels"), "{}", v.error);
    let k = kernel_test(
        &ctx,
        &KernelTestRequest { engine: s(&d), kernels: vec![], ..Default::default() },
        &Budget::secs(600),
    )
    .unwrap();
    assert!(k.passed);
    assert!(verify(&ctx, &req, &Budget::secs(600)).unwrap().passed);
    // Any change to the sources needs the kernel tests again.
    append(&d, "src/lib.rs", "\n// a comment\n");
    let v = verify(&ctx, &req, &Budget::secs(600)).unwrap();
    assert!(!v.passed && v.error.contains("phase order"));
}

/// An engine that fills every output with plausible constants and returns constant logits.
fn constant_engine(dir: &Path, ctx: &metainfer::ops::Ctx) {
    let req = metainfer::ops::scaffold::ScaffoldRequest {
        model: s(&crate::babyllama()),
        out: s(dir),
        target: "cpu".into(),
        dtype: "f32".into(),
        name: Some("constant".into()),
        force: false,
        reference_level: Default::default(),
        ..Default::default()
    };
    metainfer::ops::scaffold::scaffold(ctx, &req).unwrap();
    let edit = |rel: &str, f: &dyn Fn(String) -> String| {
        let p = dir.join(rel);
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, f(text)).unwrap();
    };
    edit("src/kernels.rs", &|t| {
        t.replace("out: &mut [f32]) { todo!() }", "out: &mut [f32]) { out.fill(0.25) }")
            .replace("theta: f32) { todo!() }", "theta: f32) { x.fill(0.25) }")
            .replace("n: usize) { todo!() }", "n: usize) { x.fill(1.0 / n as f32) }")
            .replace("-> usize { todo!() }", "-> usize { 0 }")
    });
    edit("src/model.rs", &|t| {
        t.replace(
            "pub fn load(dir: &Path) -> Result<Model, String> { todo!() }",
            "pub fn load(dir: &Path) -> Result<Model, String> { Ok(Model {}) }",
        )
        .replace("pub fn vocab_size(&self) -> usize { todo!() }", "pub fn vocab_size(&self) -> usize { 105 }")
        .replace("pub fn max_seq_len(&self) -> usize { todo!() }", "pub fn max_seq_len(&self) -> usize { 256 }")
        .replace("pub fn reset(&mut self) { todo!() }", "pub fn reset(&mut self) {}")
        .replace("-> &[f32] { todo!() }", "-> &[f32] { &[0.5; 105] }")
    });
    edit("src/tokenizer.rs", &|t| {
        t.replace("-> Result<Tokenizer, String> { todo!() }", "-> Result<Tokenizer, String> { Ok(Tokenizer {}) }")
            .replace("-> Vec<u32> { todo!() }", "-> Vec<u32> { vec![1, 3, 5] }")
            .replace("-> String { todo!() }", "-> String { String::new() }")
    });
    edit("src/generate.rs", &|t| {
        t.replace("-> u32 { todo!() }", "-> u32 { 3 }")
            .replace("-> Result<Vec<u32>, String> { todo!() }", "-> Result<Vec<u32>, String> { Ok(vec![]) }")
    });
    for rel in ["src/kernels.rs", "src/model.rs", "src/tokenizer.rs", "src/generate.rs"] {
        assert!(!std::fs::read_to_string(dir.join(rel)).unwrap().contains("todo!()"), "{rel} still has todo!()");
    }
}

#[test]
fn every_gate_fails_on_empty_bare_and_constant_engines() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let budget = Budget::secs(600);

    let empty = t.path().join("empty");
    crate::empty_crate(&empty);

    let bare = t.path().join("bare");
    let req = metainfer::ops::scaffold::ScaffoldRequest {
        model: s(&crate::babyllama()),
        out: s(&bare),
        target: "cpu".into(),
        dtype: "f32".into(),
        force: false,
        reference_level: Default::default(),
        ..Default::default()
    };
    metainfer::ops::scaffold::scaffold(&ctx, &req).unwrap();

    let constant = t.path().join("constant");
    constant_engine(&constant, &ctx);
    let c = metainfer::ops::compile::compile(
        &ctx,
        &metainfer::ops::compile::CompileRequest { engine: s(&constant), ..Default::default() },
        &budget,
    )
    .unwrap();
    assert!(c.passed, "the constant engine must build, so that the gates judge its outputs: {c:?}");

    for engine in [&empty, &bare, &constant] {
        let k =
            kernel_test(&ctx, &KernelTestRequest { engine: s(engine), kernels: vec![], ..Default::default() }, &budget)
                .unwrap();
        // Each engine fails for its own reason: the empty crate is blocked by the signature rule before
        // anything is built; the bare scaffold's kernels panic at todo!(); the constant engine's
        // kernels run and are wrong.
        let kt = metainfer::ops::Report::text(&k);
        assert!(!k.passed, "run_kernel_test passed on {}", engine.display());
        if engine == &empty {
            assert!(k.kernels.is_empty() && k.build_error.contains("signature-changed"), "{kt}");
        } else if engine == &bare {
            assert!(k.kernels.iter().all(|k| !k.passed && k.error.contains("not yet implemented")), "{kt}");
        } else {
            assert!(
                k.kernels.iter().all(|k| !k.passed && !k.error.contains("panicked") && !k.error.is_empty()),
                "every constant kernel must run and be wrong: {kt}"
            );
        }
        let v = verify(
            &ctx,
            &VerifyRequest {
                engine: s(engine),
                model: s(&crate::babyllama()),
                prompts: vec![],
                max_new_tokens: Some(4),
                ..Default::default()
            },
            &budget,
        )
        .unwrap();
        let vt = metainfer::ops::Report::text(&v);
        assert!(!v.passed, "verify_generation passed on {}", engine.display());
        // The ledger keeps where it went wrong, which evolve_knowledge clusters by.
        let recorded = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap().list(0, 1).unwrap().remove(0);
        assert_eq!(recorded.tool, "verify_generation");
        if engine == &empty {
            assert!(v.prompts.is_empty() && v.error.contains("signature-changed"), "{vt}");
        } else if engine == &bare {
            assert!(v.prompts.is_empty() && v.error.contains("not yet implemented"), "{vt}");
            assert_eq!(recorded.figures["divergence"], "crash", "{vt}");
        } else {
            // The constant engine's ids differ from HF's on the first prompt already.
            assert_eq!(recorded.figures["divergence"], "tokenizer", "{vt}");
            // It ran: every prompt is judged, and no prompt's logits match the reference.
            assert!(!v.prompts.is_empty() && v.prompts.iter().all(|p| !p.logits_ok && !p.tokenizer_ok), "{vt}");
            // reference_text is the reference's own continuation, not a decoding of the engine's
            // tokens: for the golden prompt, the golden greedy ids (agreed by four independent
            // implementations) decoded through HF tokenizers, 4 tokens past the prompt.
            let golden = crate::golden();
            let ids: Vec<u32> =
                golden["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let n_prompt = golden["prompt_ids"].as_array().unwrap().len();
            let tok = tokenizers::Tokenizer::from_file(crate::babyllama().join("tokenizer.json")).unwrap();
            let want = tok.decode(&ids[..n_prompt + 4], true).unwrap();
            assert!(golden["text"].as_str().unwrap().starts_with(&want) && want.len() > "Once upon a time".len());
            let p = v.prompts.iter().find(|p| p.prompt == "Once upon a time").expect("the golden prompt is verified");
            assert_eq!(p.reference_text, want, "{vt}");
            assert_ne!(p.text, p.reference_text, "{vt}");
            // Constant logits differ from the golden ones at the prompt's last position already:
            // the first divergence is step 0, in prefill, and the text names it.
            assert!(v.prompts.iter().all(|p| p.first_divergence == 0 && p.divergence_phase == "prefill"), "{vt}");
            assert!(vt.contains("first beyond tolerance at step 0 (prefill)"), "{vt}");
            assert!(vt.contains(&format!("reference: {want:?}")), "{vt}");
        }
        let p = profile(
            &ctx,
            &ProfileRequest { engine: s(engine), model: s(&crate::babyllama()), runs: Some(1), ..Default::default() },
            &budget,
        )
        .unwrap();
        assert!(!p.passed, "profile_engine passed on {}", engine.display());
        let why = if engine == &empty {
            "signature-changed"
        } else if engine == &bare {
            "not yet implemented"
        } else {
            "did not generate the reference's greedy tokens"
        };
        assert!(p.error.contains(why), "{}: {}", engine.display(), p.error);
    }
}

/// Symlink loops, huge, binary and non-UTF-8 files, and an engine directory that is itself a
/// symlink: the checks finish and say what they skipped.
#[test]
fn odd_engine_trees_finish_and_report_what_was_skipped() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let d = t.path().join("real");
    crate::copy_example(&d);
    std::os::unix::fs::symlink(d.join("loop-b"), d.join("loop-a")).unwrap();
    std::os::unix::fs::symlink(d.join("loop-a"), d.join("loop-b")).unwrap();
    std::fs::write(d.join("src/huge.rs"), "// x\n".repeat(300_000)).unwrap();
    std::fs::write(d.join("src/latin1.rs"), b"// caf\xe9\n").unwrap();
    std::fs::write(d.join("data.bin"), [0u8, 159, 146, 150, 255]).unwrap();
    let link = t.path().join("engine-link");
    std::os::unix::fs::symlink(&d, &link).unwrap();
    let start = std::time::Instant::now();
    let r = check_rules(&ctx, &RulesRequest { engine: s(&link) }, &Budget::secs(600)).unwrap();
    assert!(start.elapsed() < std::time::Duration::from_secs(120));
    // No code file is skipped: one too large or not UTF-8 blocks, with its own rule id.
    let rules: Vec<(&str, &str)> = r.findings.iter().map(|f| (f.rule.as_str(), f.file.as_str())).collect();
    assert!(rules.contains(&("file-too-large", "src/huge.rs")), "{rules:?}");
    assert!(rules.contains(&("file-unreadable", "src/latin1.rs")), "{rules:?}");
    assert!(!r.passed);
    // The loop's links point inside the engine but resolve nowhere: reported, never followed.
    let loops: Vec<_> = r.findings.iter().filter(|f| f.rule == "symlink-outside").map(|f| f.file.clone()).collect();
    assert_eq!(loops, ["loop-a", "loop-b"], "{}", metainfer::ops::Report::text(&r));
}

#[test]
fn signatures_are_required_only_of_the_kernels_an_engine_implements() {
    // The example engine stores f32 weights: the bf16/f16/int8 linear variants and Gemma's GeGLU are
    // not its kernels, so their signatures are not required of it...
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let d = t.path().join("f32");
    crate::copy_example(&d);
    let (found, _) = rules_of(&ctx, &d);
    assert!(found.iter().all(|(r, _)| r != "signature-changed"), "{found:?}");
    // ...until it declares that it builds for bf16 too: then kernel.linear_bf16 is one of them.
    if std::fs::read_to_string(d.join("metainfer.toml")).unwrap().contains("[dtype_features]") {
        return; // the engine declares its dtypes itself
    }
    append(&d, "metainfer.toml", "\n[dtype_features]\nbf16 = [\"bf16\"]\n");
    let r = check_rules(&ctx, &RulesRequest { engine: s(&d) }, &Budget::secs(600)).unwrap();
    let sigs: Vec<&str> =
        r.findings.iter().filter(|f| f.rule == "signature-changed").map(|f| f.message.as_str()).collect();
    if !std::fs::read_to_string(d.join("src/kernels.rs")).unwrap().contains("pub fn linear_bf16(") {
        assert!(sigs.iter().any(|m| m.contains("kernel.linear_bf16")), "{sigs:?}");
    }
    assert!(sigs.iter().all(|m| !m.contains("kernel.linear_int8") && !m.contains("gelu")), "{sigs:?}");
}

#[test]
fn a_passing_kernel_test_row_inserted_with_sql_does_not_unlock_verify() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let d = t.path().join("engine");
    crate::copy_example(&d);
    let hash = ctx.workshop.engine(&d).unwrap().hash;
    metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    // What a build script that read the ledger's path could insert: a passing run_kernel_test on
    // exactly this engine's sources.
    rusqlite::Connection::open(&ctx.ledger)
        .unwrap()
        .execute(
            "INSERT INTO outcomes (id, time, tool, engine, engine_hash, contracts, passed, summary, figures, reference_level, duration_ms, client, constraints)
             VALUES ('forged', '2026-12-01T00:00:00Z', 'run_kernel_test', ?1, ?2, '[]', 1, 'kernels PASSED', '{}', 'zero', 1, '', '{\"dtype\":\"f32\"}')",
            rusqlite::params![d.display().to_string(), hash],
        )
        .unwrap();
    let req = VerifyRequest {
        engine: s(&d),
        model: s(&crate::babyllama()),
        prompts: vec![],
        max_new_tokens: Some(4),
        ..Default::default()
    };
    let v = verify(&ctx, &req, &Budget::secs(600)).unwrap();
    assert!(v.prompts.iter().all(|p| p.error.is_empty()), "generation itself matched");
    assert!(!v.passed && v.error.contains("phase order"), "{}", v.error);
}

/// (rule, file, message) of every blocking finding of a check_rules run.
fn blocking_of(ctx: &metainfer::ops::Ctx, engine: &Path) -> Vec<(String, String, String)> {
    let r = check_rules(ctx, &RulesRequest { engine: s(engine) }, &Budget::secs(600)).unwrap();
    assert_eq!(r.passed, !r.findings.iter().any(|f| f.severity == Severity::Blocking));
    r.findings.into_iter().filter(|f| f.severity == Severity::Blocking).map(|f| (f.rule, f.file, f.message)).collect()
}

fn has(findings: &[(String, String, String)], rule: &str, file: &str, text: &str) -> bool {
    findings.iter().any(|(r, f, m)| r == rule && f == file && m.contains(text))
}

#[test]
fn rules_read_every_code_file_whatever_its_size_or_name() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let pad = "// padding\n".repeat(100_000); // 1.1 MB, over the 1 MiB rules read whole

    // A padded source that includes a file outside the engine: it used to be skipped for size.
    let d = t.path().join("padded-source");
    crate::copy_example(&d);
    std::fs::write(d.join("src/table.rs"), format!("{pad}pub static T: &[u8] = include_bytes!(\"/etc/hostname\");\n"))
        .unwrap();
    append(&d, "src/lib.rs", "\nmod table;\n");
    let f = blocking_of(&ctx, &d);
    assert!(has(&f, "file-too-large", "src/table.rs", "at most 1048576 bytes"), "{f:?}");

    // A padded build script.
    let d = t.path().join("padded-build");
    crate::copy_example(&d);
    std::fs::write(d.join("build.rs"), format!("{pad}fn main() {{}}\n")).unwrap();
    let f = blocking_of(&ctx, &d);
    assert!(has(&f, "file-too-large", "build.rs", "bytes"), "{f:?}");

    // Build scripts: a write outside OUT_DIR and a read of /proc are findings; a write under
    // OUT_DIR is not.
    let d = t.path().join("build-writes");
    crate::copy_example(&d);
    std::fs::write(
        d.join("build.rs"),
        "fn main() {\n    let out = std::path::PathBuf::from(std::env::var(\"OUT_DIR\").unwrap());\n    let gen = out.join(\"gen.rs\");\n    std::fs::write(&gen, \"\").unwrap();\n    let env = std::fs::read(\"/proc/1/environ\");\n    std::fs::write(\"/tmp/ledger-copy\", format!(\"{env:?}\")).unwrap();\n}\n",
    )
    .unwrap();
    let f = blocking_of(&ctx, &d);
    assert!(has(&f, "build-script", "build.rs", "reads /proc"), "{f:?}");
    assert!(has(&f, "build-script", "build.rs", "\"/tmp/ledger-copy\"`, which is not derived from OUT_DIR"), "{f:?}");
    assert_eq!(f.iter().filter(|(r, ..)| r == "build-script").count(), 2, "the write under OUT_DIR is fine: {f:?}");

    // A build script under another name (package.build), and a module it pulls in, are build
    // scripts too; a file pulled in as code by #[path] is read whatever its extension.
    let d = t.path().join("renamed-build");
    crate::copy_example(&d);
    let manifest = std::fs::read_to_string(d.join("Cargo.toml")).unwrap();
    std::fs::write(
        d.join("Cargo.toml"),
        manifest.replacen("publish = false", "publish = false\nbuild = \"tools/gen.rs\"", 1),
    )
    .unwrap();
    std::fs::create_dir_all(d.join("tools")).unwrap();
    std::fs::write(d.join("tools/gen.rs"), "mod helper;\nfn main() { helper::run() }\n").unwrap();
    std::fs::write(
        d.join("tools/helper.rs"),
        "pub fn run() { let _ = std::process::Command::new(\"sh\").status(); }\n",
    )
    .unwrap();
    std::fs::write(d.join("src/extra.txt"), "pub static E: &str = include_str!(\"/etc/hostname\");\n").unwrap();
    append(&d, "src/lib.rs", "\n#[path = \"extra.txt\"]\nmod extra;\n");
    let f = blocking_of(&ctx, &d);
    assert!(has(&f, "build-script", "tools/helper.rs", "std::process"), "{f:?}");
    assert!(has(&f, "path-outside", "src/extra.txt", "include_str!"), "{f:?}");
}
