//! Every gate fails on an empty crate and on the bare scaffold, and passes on each example engine.
//! Run at the library level (the MCP path is covered by the demo test).

use metainfer::error::ErrorKind;
use metainfer::ops::compile::{CompileRequest, compile};
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::profile::{ProfileRequest, profile};
use metainfer::ops::scaffold::{ScaffoldRequest, scaffold};
use metainfer::ops::verify::{VerifyRequest, verify};

use crate::Engine;
use crate::{budget, s};

fn verify_req(engine: &std::path::Path) -> VerifyRequest {
    VerifyRequest {
        engine: s(engine),
        model: s(&crate::babyllama()),
        prompts: vec![],
        max_new_tokens: Some(8),
        ..Default::default()
    }
}

#[test]
fn bare_scaffold_compiles_and_fails_every_other_gate() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("engine");
    let req = ScaffoldRequest {
        model: s(&crate::babyllama()),
        out: s(&engine),
        target: "cpu".into(),
        dtype: "f32".into(),
        name: Some("bare".into()),
        force: false,
        reference_level: Default::default(),
        ..Default::default()
    };
    let r = scaffold(&ctx, &req).unwrap();
    assert!(r.files.contains(&"src/kernels.rs".to_string()), "{:?}", r.files);
    let kernels = std::fs::read_to_string(engine.join("src/kernels.rs")).unwrap();
    assert!(
        kernels
            .contains("pub fn rope(x: &mut [f32], positions: &[usize], n_heads: usize, head_dim: usize, theta: f32)")
    );
    assert!(kernels.contains("todo!()"));
    // The forward skeleton carries the family's graph: every node of model.llama's [model.graph],
    // in the contract's order, as a comment line `name = op(inputs)`.
    let model_rs = std::fs::read_to_string(engine.join("src/model.rs")).unwrap();
    let g = ctx.ckb.get("model.llama").unwrap().model.as_ref().unwrap().graph.clone().unwrap();
    let mut at = model_rs.find("// The forward pass of model.llama").expect("the graph comment");
    for n in g.prologue.iter().chain(&g.layer).chain(&g.epilogue) {
        let line = format!("//     {} = {}({})", n.name, n.op, n.inputs.join(", "));
        let found = model_rs[at..].find(&line).unwrap_or_else(|| panic!("no `{line}` after byte {at} in\n{model_rs}"));
        at += found + line.len();
    }

    // A second scaffold into the same (now non-empty) directory is refused; nothing is changed.
    let e = scaffold(&ctx, &req).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Usage);
    assert!(e.message.contains("not empty"), "{}", e.message);

    let c = compile(&ctx, &CompileRequest { engine: s(&engine), ..Default::default() }, &budget()).unwrap();
    assert!(c.passed, "the bare scaffold must compile: {c:?}");
    crate::assert_conforms(&c);

    let k = kernel_test(
        &ctx,
        &KernelTestRequest { engine: s(&engine), kernels: vec![], seed: Some(1), ..Default::default() },
        &budget(),
    )
    .unwrap();
    assert!(!k.passed);
    assert_eq!(k.kernels.len(), 8);
    assert!(k.kernels.iter().all(|k| !k.passed && k.error.contains("not yet implemented")), "{k:?}");
    crate::assert_conforms(&k);
    // A panicked kernel reads "panicked", not the sentinel 1.80e308.
    let text = metainfer::ops::Report::text(&k);
    assert!(text.contains("max abs  panicked") && !text.contains("e308"), "{text}");

    let v = verify(&ctx, &verify_req(&engine), &budget()).unwrap();
    assert!(!v.passed && v.error.contains("not yet implemented"), "{}", v.error);
    crate::assert_conforms(&v);
    // The failure names the user's file and the unimplemented function, not the server's snapshot,
    // and the header says the engine crashed instead of "0/0 prompts passed".
    let dir = engine.canonicalize().unwrap().display().to_string();
    assert!(v.error.contains("todo!() in ") && v.error.contains(&format!("{dir}/src/")), "{}", v.error);
    assert!(!v.error.contains("/snapshots/"), "{}", v.error);
    let text = metainfer::ops::Report::text(&v);
    assert!(text.contains("crashed before the first prompt") && !text.contains("0/0"), "{text}");

    let p = profile(
        &ctx,
        &ProfileRequest { engine: s(&engine), model: s(&crate::babyllama()), runs: Some(1), ..Default::default() },
        &budget(),
    )
    .unwrap();
    assert!(!p.passed && p.error.contains("not yet implemented"), "{}", p.error);
    crate::assert_conforms(&p);

    // Every call was recorded, failures included.
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let tools: Vec<String> = ledger.list(0, 10).unwrap().into_iter().map(|o| o.tool).collect();
    assert_eq!(tools, ["profile_engine", "verify_generation", "run_kernel_test", "compile_engine", "scaffold_engine"]);
}

#[test]
fn empty_crate_and_non_crate_fail() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let e = compile(&ctx, &CompileRequest { engine: s(t.path()), ..Default::default() }, &budget()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Usage);
    assert!(e.message.contains("not a Rust crate"), "{}", e.message);

    let empty = t.path().join("empty");
    crate::empty_crate(&empty);
    let k = kernel_test(
        &ctx,
        &KernelTestRequest { engine: s(&empty), kernels: vec!["kernel.rope".into()], ..Default::default() },
        &budget(),
    )
    .unwrap();
    // The empty crate lacks every signature the gates call: blocked by the rules before any build.
    assert!(
        !k.passed && k.build_error.contains("signature-changed") && k.rules.iter().any(|f| f.file == "src/kernels.rs"),
        "{k:?}"
    );
    let v = verify(&ctx, &verify_req(&empty), &budget()).unwrap();
    assert!(!v.passed && v.prompts.is_empty() && v.error.contains("signature-changed"), "{}", v.error);

    let e = kernel_test(
        &ctx,
        &KernelTestRequest { engine: s(&empty), kernels: vec!["kernel.nope".into()], ..Default::default() },
        &budget(),
    )
    .unwrap_err();
    assert!(e.message.contains("unknown contract id `kernel.nope`"), "{}", e.message);
}

/// Each example engine passes every gate on BabyLlama: kernel tests, verify_generation and
/// profile_engine. (Engines with faults are in `faults.rs`.)
fn example_engine_passes_every_gate(engine: Engine) {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());

    let good = t.path().join("good");
    engine.copy_to(&good);
    let kreq = KernelTestRequest { engine: s(&good), kernels: vec![], ..Default::default() };
    let k = kernel_test(&ctx, &kreq, &budget()).unwrap();
    assert!(k.passed, "{}", metainfer::ops::Report::text(&k));
    crate::assert_conforms(&k);
    let v = verify(&ctx, &verify_req(&good), &budget()).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    // A correct engine writes the reference's own continuation and never diverges.
    assert!(
        v.prompts.iter().all(|p| p.text == p.reference_text && p.first_divergence == -1 && p.divergence.is_none()),
        "{}",
        metainfer::ops::Report::text(&v)
    );
    // Every gate ran the engine's code in the sandbox (on a kernel that offers it).
    let enforced = metainfer::harness::sandbox::status().enforced;
    let c =
        metainfer::ops::compile::compile(&ctx, &CompileRequest { engine: s(&good), ..Default::default() }, &budget())
            .unwrap();
    assert!(c.passed);
    assert_eq!((k.sandboxed, v.sandboxed, c.sandboxed), (enforced, enforced, enforced));

    // Profile: every kernel of a decode step timed on BabyLlama's shapes. Which kernel bounds decode
    // is a measurement (on an idle machine kernel.linear, which reads all 921,600 projection weights;
    // under load another kernel can win), so the test holds the report to its own table: the bounding
    // kernel is the one with the largest summed share, and the guidance is the platform's for it.
    let preq = ProfileRequest {
        engine: s(&good),
        model: s(&crate::babyllama()),
        prompt_len: Some(8),
        new_tokens: Some(16),
        runs: Some(2),
        ..Default::default()
    };
    let p = profile(&ctx, &preq, &budget()).unwrap();
    assert!(p.passed, "{}", metainfer::ops::Report::text(&p));
    assert_eq!(p.sandboxed, enforced);
    assert!(p.adjusted.is_empty(), "{:?}", p.adjusted);
    assert!(metainfer::ops::Report::text(&p).contains("1-thread bandwidth roofline"));
    // Both example engines trace their forward: the bounding kernel is the one the real forward
    // spends most in (summed over the points running it), and the points' shares are of the traced
    // decode time, so they add up to at most all of it.
    assert!(!p.points.is_empty(), "{}", metainfer::ops::Report::text(&p));
    let mut summed = std::collections::BTreeMap::<&str, f64>::new();
    for k in p.points.iter().filter(|k| !k.kernel.is_empty()) {
        *summed.entry(k.kernel.as_str()).or_default() += k.share_of_decode;
    }
    let largest = summed.iter().max_by(|a, b| a.1.total_cmp(b.1)).map(|(k, _)| *k);
    assert_eq!(Some(p.bounding_kernel.as_str()), largest, "{}", metainfer::ops::Report::text(&p));
    let shares: f64 = p.points.iter().map(|k| k.share_of_decode).sum();
    assert!(shares <= 1.0 && shares > 0.5, "{shares}: {}", metainfer::ops::Report::text(&p));
    // Every point is a node of model.llama's graph; the required ones are reported in each of
    // BabyLlama's 5 layers (config.json num_hidden_layers).
    let graph =
        metainfer::ckb::Ckb::embedded().unwrap().get("model.llama").unwrap().model.clone().unwrap().graph.unwrap();
    let nodes: Vec<&str> =
        [&graph.prologue, &graph.layer, &graph.epilogue].into_iter().flatten().map(|n| n.name.as_str()).collect();
    assert!(p.points.iter().all(|x| nodes.contains(&x.point.as_str())), "{:?}", p.points);
    for (point, layers) in [("embed", 0), ("attn_residual", 5), ("mlp_residual", 5), ("logits", 0)] {
        assert!(p.points.iter().any(|x| x.point == point && x.layers == layers), "{point}: {:?}", p.points);
    }
    // The linear points read their weights: q's bytes are BabyLlama's q_proj, 5 layers of
    // [8 heads x 16, 128] f32 (config.json), plus k_proj and v_proj ([4 heads x 16, 128] each) when
    // the engine computes them in the same fused product (the SIMD engine): those are counted with q.
    let q = p.points.iter().find(|x| x.point == "q").expect("q is reported");
    let fused = p.points.iter().filter(|x| x.fused_into == "q").count() as f64;
    let want = 5.0 * 128.0 * 128.0 * 4.0 + fused * 5.0 * 64.0 * 128.0 * 4.0;
    assert_eq!((q.kernel.as_str(), q.bytes), ("kernel.linear", want), "{q:?}");
    assert!(p.points.iter().filter(|x| !x.fused_into.is_empty()).all(|x| x.roofline_fraction == 0.0));
    // The guidance, read from the platform contract's file itself.
    let platform: toml::Value = toml::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("contracts/platforms/cpu-x86_64.toml"),
        )
        .unwrap(),
    )
    .unwrap();
    let expected: Vec<String> = platform["platform"]["kernel_guidance"]
        .get(&p.bounding_kernel)
        .and_then(|g| g.as_array())
        .map(|g| g.iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    assert_eq!(p.guidance, expected);
    let kernels: std::collections::BTreeSet<&str> = p.kernels.iter().map(|k| k.kernel.as_str()).collect();
    // Every kernel of the plan a decode step calls on its own (softmax runs inside attention).
    assert_eq!(kernels.len(), 7, "{kernels:?}");
    assert!(!kernels.contains("kernel.softmax"), "{kernels:?}");
    let share: f64 = p.kernels.iter().map(|k| k.share_of_decode).sum();
    assert!((share - 1.0).abs() < 1e-9, "{share}");
    assert!(p.kernels.iter().all(|k| k.time_us.median > 0.0 && k.gb_s > 0.0), "{:?}", p.kernels);
    assert!(p.previous.is_none());
    // Prefill at 8 / 4, 8 / 2 and 8 prompt tokens; the harness process's peak RSS (Linux).
    let lens: Vec<usize> = p.prefill_by_len.iter().map(|x| x.prompt_len).collect();
    assert_eq!(lens, [2, 4, 8]);
    assert!(p.prefill_by_len.iter().all(|x| x.tok_s.min > 0.0), "{:?}", p.prefill_by_len);
    assert!(p.peak_rss_mb > 1.0, "{}", p.peak_rss_mb);
    // A second profile compares itself with the first.
    let again = profile(&ctx, &preq, &budget()).unwrap();
    let prev = again.previous.as_ref().expect("the first profile is in the ledger");
    assert_eq!(prev.decode_tok_s, p.decode_tok_s);
    // Identical sources are never a regression, whatever the machine did between the calls.
    assert!(prev.same_sources && !prev.regression && prev.interleaved.is_none(), "{prev:?}");
    // Requests beyond BabyLlama's context (config.json max_position_embeddings 256) or the run
    // limit are adjusted, each named with why, and the threads label follows the request.
    let clamped = profile(
        &ctx,
        &ProfileRequest {
            prompt_len: Some(1000),
            new_tokens: Some(16),
            runs: Some(0),
            threads: Some(2),
            ..preq.clone()
        },
        &budget(),
    )
    .unwrap();
    let text = metainfer::ops::Report::text(&clamped);
    assert_eq!((clamped.prompt_len, clamped.new_tokens, clamped.runs), (255, 1, 1), "{text}");
    assert_eq!(clamped.adjusted.len(), 3, "{text}");
    assert!(clamped.adjusted[0].starts_with("prompt_len 1000 -> 255") && clamped.adjusted[0].contains("256"), "{text}");
    assert!(clamped.adjusted[1].starts_with("new_tokens 16 -> 1"), "{text}");
    assert!(clamped.adjusted[2].starts_with("runs 0 -> 1"), "{text}");
    assert!(text.contains("adjusted: new_tokens 16 -> 1") && text.contains("2-thread bandwidth roofline"), "{text}");

    // An edit that makes decode slower (3 ms of sleep per token, where BabyLlama decodes a token
    // in well under 3 ms): the kept previous build and this one decode alternately in the same
    // call, and the slowdown is called a regression from those figures.
    crate::inject(
        &good,
        "src/model.rs",
        "    pub fn forward(&mut self, token: u32, pos: usize) -> &[f32] {\n",
        "    pub fn forward(&mut self, token: u32, pos: usize) -> &[f32] {\n        std::thread::sleep(std::time::Duration::from_millis(3));\n",
    );
    // Phase order: profile counts on sources whose kernels and generation passed.
    let k = kernel_test(&ctx, &kreq, &budget()).unwrap();
    assert!(k.passed, "{}", metainfer::ops::Report::text(&k));
    let v = verify(&ctx, &verify_req(&good), &budget()).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    let slow = profile(&ctx, &preq, &budget()).unwrap();
    let text = metainfer::ops::Report::text(&slow);
    let prev = slow.previous.as_ref().expect("the passing profiles are in the ledger");
    let both = prev.interleaved.as_ref().unwrap_or_else(|| panic!("{text}"));
    assert!(!prev.same_sources && both.pairs == 3, "{prev:?}");
    assert!(both.now_tok_s.max < 1000.0 / 3.0 && both.before_tok_s.min > 1000.0 / 3.0, "{both:?}");
    assert!(prev.regression && prev.change_pct < -10.0, "{text}");
    assert!(text.contains("REGRESSION beyond the noise") && text.contains("alternately"), "{text}");
}

/// A malformed or ill-typed metainfer.toml is an error naming the key, in every gate and in
/// check_rules, before anything is built (no silent defaults, no signature findings).
#[test]
fn malformed_manifest_is_an_error_naming_the_key_in_every_gate() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("engine");
    crate::copy_example(&engine);
    let good = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    let cases = [
        (good.replace("family = \"model.llama\"", "family = 7"), "family"),
        (good.replace("family = \"model.llama\"", "family = \"model.nosuch\""), "family"),
        (good.replace("dtype = \"f32\"", "dtype = \"fp8\""), "dtype"),
        (good.replace("reference_level = \"zero\"", "reference_level = \"everything\""), "reference_level"),
        (good.replace("target = \"cpu\"", "target = \"../../etc\""), "target"),
        (good.replace("bf16 = [\"bf16\"]", "bf16 = \"bf16\""), "dtype_features"),
    ];
    for (text, key) in cases {
        assert_ne!(text, good, "the case for `{key}` changed nothing");
        std::fs::write(engine.join("metainfer.toml"), &text).unwrap();
        let e = s(&engine);
        let errors = [
            metainfer::ops::rules::check_rules(
                &ctx,
                &metainfer::ops::rules::RulesRequest { engine: e.clone() },
                &budget(),
            )
            .err(),
            compile(&ctx, &CompileRequest { engine: e.clone(), ..Default::default() }, &budget()).err(),
            kernel_test(
                &ctx,
                &KernelTestRequest { engine: e.clone(), kernels: vec![], ..Default::default() },
                &budget(),
            )
            .err(),
            verify(&ctx, &verify_req(&engine), &budget()).err(),
            profile(
                &ctx,
                &ProfileRequest {
                    engine: e.clone(),
                    model: s(&crate::babyllama()),
                    runs: Some(1),
                    ..Default::default()
                },
                &budget(),
            )
            .err(),
        ];
        for (gate, err) in ["check_rules", "compile", "kernel_test", "verify", "profile"].iter().zip(errors) {
            let err = err.unwrap_or_else(|| panic!("{gate} accepted a manifest with a bad `{key}`"));
            assert_eq!(err.kind, ErrorKind::Usage, "{gate}: {}", err.message);
            assert!(
                err.message.contains("metainfer.toml") && err.message.contains(key),
                "{gate} on a bad `{key}`: {}",
                err.message
            );
        }
    }
    // Nothing was built or recorded for any of them.
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    assert_eq!(ledger.count().unwrap(), 0);
}

crate::engine_tests!(example_engine_passes_every_gate);
