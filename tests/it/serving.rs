//! Serving: plan and scaffold with serving constraints, the serving kernels' diagnosis on a faulted
//! engine, and verify_batching failing on the bare serving scaffold, an empty crate, a constant
//! batched step and a leaking block manager, each for its stated reason, and passing on the SIMD
//! example engine; serve_engine failing on an engine without a binary, a server that dies at start
//! and a constant sampler, each for its stated reason, and passing on the SIMD example engine.

use metainfer::error::ErrorKind;
use metainfer::harness::Budget;
use metainfer::manifest::Serving;
use metainfer::ops::batching::{BatchingRequest, verify_batching};
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::plan::{PlanRequest, plan};
use metainfer::ops::scaffold::{ScaffoldRequest, scaffold};
use metainfer::ops::serve::{ServeRequest, serve_engine};

use crate::Engine;
use crate::s;

fn serving(max_seqs: usize, max_context: usize) -> Serving {
    Serving { max_seqs, max_context, block_size: 16, kv_blocks: None, max_batch_tokens: None, sampling: true }
}

fn batching(engine: &std::path::Path) -> BatchingRequest {
    BatchingRequest { engine: s(engine), model: s(&crate::babyllama()), ..Default::default() }
}

#[test]
fn plan_adds_serving_phases_only_when_asked_and_checks_the_kv_cache() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let req = |serving| PlanRequest {
        model: s(&crate::babyllama()),
        target: "cpu".into(),
        dtype: "f32".into(),
        serving,
        ..Default::default()
    };
    let phases = |r: &metainfer::ops::plan::PlanReport| r.phases.iter().map(|p| p.phase.clone()).collect::<Vec<_>>();

    let plain = plan(&ctx, &req(None)).unwrap();
    assert!(plain.covered && plain.kv_cache.is_none());
    assert!(!phases(&plain).iter().any(|p| p == "batching" || p == "serving"), "{:?}", phases(&plain));
    assert!(!plain.phases[0].contracts.contains(&"kernel.sample".to_string()));

    let served = plan(&ctx, &req(Some(serving(16, 256)))).unwrap();
    assert!(served.covered, "{}", metainfer::ops::Report::text(&served));
    let names = phases(&served);
    assert_eq!(&names[5..], ["batching", "serving", "performance"], "{names:?}");
    let kernels = &served.phases[0].contracts;
    assert!(kernels.contains(&"kernel.paged_attention".to_string()) && kernels.contains(&"kernel.sample".to_string()));
    let batching = &served.phases[5];
    assert!(batching.contracts.contains(&"component.block_manager".to_string()), "{batching:?}");
    assert!(batching.gates.contains(&"verify_batching".to_string()));
    // BabyLlama: 5 layers, 4 KV heads of 32. One block: 2 (K, V) * 5 * 16 positions * 4 * 32 * 4 bytes
    // = 40,960 bytes; 16 sequences of ceil(256 / 16) = 16 blocks = 256 blocks = 10 MiB.
    let kv = served.kv_cache.as_ref().unwrap();
    assert_eq!((kv.blocks, kv.bytes_per_block, kv.full_sequences), (256, 40_960, 16));
    assert!((kv.total_mib - 10.0).abs() < 1e-9, "{}", kv.total_mib);

    // More context than the model has, and more sequences than the pool holds: said before any code.
    let long = plan(&ctx, &req(Some(serving(4, 512)))).unwrap();
    assert!(!long.covered && long.gaps.iter().any(|g| g.field == "serving.max_context" && g.reason.contains("256")));
    let small = Serving { kv_blocks: Some(10), ..serving(4, 64) };
    let r = plan(&ctx, &req(Some(small))).unwrap();
    // ceil(64 / 16) = 4 blocks per sequence: 10 blocks hold 2 of them, not 4; 16 blocks would.
    let gap = r.gaps.iter().find(|g| g.field == "serving.kv_blocks").expect("a KV gap");
    assert!(gap.reason.contains("hold 2 sequences") && gap.reason.contains("kv_blocks to 16"), "{}", gap.reason);
    let bad = Serving { max_batch_tokens: Some(2), ..serving(4, 64) };
    assert!(plan(&ctx, &req(Some(bad))).unwrap().gaps.iter().any(|g| g.reason.contains("max_batch_tokens")));
}

#[test]
fn serving_scaffold_fails_verify_batching_on_its_todos() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("served");
    let r = scaffold(
        &ctx,
        &ScaffoldRequest {
            model: s(&crate::babyllama()),
            out: s(&engine),
            target: "cpu".into(),
            dtype: "f32".into(),
            name: Some("served".into()),
            force: false,
            reference_level: Default::default(),
            serving: Some(serving(8, 128)),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.next.contains("(verify_batching)") && r.next.contains("(serve_engine)"), "{}", r.next);
    for f in ["src/paged.rs", "src/batch.rs", "src/scheduler.rs"] {
        assert!(r.files.contains(&f.to_string()), "{:?}", r.files);
    }
    let kernels = std::fs::read_to_string(engine.join("src/kernels.rs")).unwrap();
    assert!(kernels.contains("pub fn sample(") && kernels.contains("pub fn paged_attention("));
    let manifest = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    assert!(manifest.contains("[serving]") && manifest.contains("max_seqs = 8"), "{manifest}");

    let v = verify_batching(&ctx, &batching(&engine), &Budget::secs(900)).unwrap();
    crate::assert_conforms(&v);
    assert!(!v.passed);
    let bm = &v.block_manager;
    assert!(
        !bm.passed && bm.violations[0].contains("panicked") && bm.violations[0].contains("not yet implemented"),
        "{bm:?}"
    );
    let sc = &v.scheduler;
    assert!(
        !sc.passed && sc.violations[0].contains("panicked") && sc.violations[0].contains("not yet implemented"),
        "{sc:?}"
    );
    assert!(v.error.contains("not yet implemented"), "{}", v.error);

    // The serving kernels are in the scaffold's plan, and fail as unimplemented.
    let k = kernel_test(
        &ctx,
        &KernelTestRequest {
            engine: s(&engine),
            kernels: vec!["kernel.sample".into(), "kernel.paged_attention".into()],
            seed: Some(1),
            ..Default::default()
        },
        &Budget::secs(900),
    )
    .unwrap();
    assert!(k.kernels.iter().all(|k| !k.passed && k.error.contains("not yet implemented")), "{k:?}");
}

/// The plain engine as a batch-1 library: its metainfer.toml without the `[serving]` table.
fn batch_one(dir: &std::path::Path) {
    Engine::Plain.copy_to(dir);
    let toml = std::fs::read_to_string(dir.join("metainfer.toml")).unwrap();
    let cut = toml.find("[serving]").expect("the plain engine declares serving");
    std::fs::write(dir.join("metainfer.toml"), &toml[..cut]).unwrap();
}

/// verify_batching and serve_engine need serving constraints (a batch-1 library is a bad request)
/// and the serving signatures (an empty crate that claims serving is blocked by the signature rule).
#[test]
fn verify_batching_needs_serving_constraints_and_the_serving_signatures() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    // A batch-1 library (no [serving]) is a bad request for this gate.
    let plain = t.path().join("plain");
    batch_one(&plain);
    let e = verify_batching(&ctx, &batching(&plain), &Budget::secs(900)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Usage);
    assert!(e.message.contains("no [serving] table"), "{}", e.message);

    // An empty crate that claims serving lacks every signature: blocked before anything is built.
    let empty = t.path().join("empty");
    crate::empty_crate(&empty);
    std::fs::write(empty.join("metainfer.toml"), "[serving]\nmax_seqs = 4\nmax_context = 64\n").unwrap();
    let v = verify_batching(&ctx, &batching(&empty), &Budget::secs(900)).unwrap();
    assert!(!v.passed && v.error.contains("signature-changed"), "{}", v.error);
    assert!(v.rules.iter().any(|f| f.file == "src/paged.rs") && v.rules.iter().any(|f| f.file == "src/batch.rs"));
    assert_eq!(v.block_manager.ops, 0);
    // serve_engine on the same crate: blocked by the same rule, no server started.
    let r = serve_engine(&ctx, &serve_req(&empty), &Budget::secs(900)).unwrap();
    assert!(!r.passed && r.error.contains("signature-changed") && r.checks.is_empty(), "{}", r.error);
}

#[test]
fn constant_batched_step_and_leaking_block_manager_fail_for_their_reasons() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let constant = t.path().join("constant");
    Engine::Simd.copy_to(&constant);
    crate::replace_body(
        &constant,
        "src/batch.rs",
        "pub fn step(",
        "let _ = cache;\n    vec![0.5; chunks.len() * model.vocab_size()]",
    );
    let v = verify_batching(&ctx, &batching(&constant), &Budget::secs(900)).unwrap();
    assert!(!v.passed && v.block_manager.passed, "{}", metainfer::ops::Report::text(&v));
    assert!(v.sequences.iter().all(|s| !s.logits_ok), "{}", metainfer::ops::Report::text(&v));
    assert!(v.error.contains("differ from its single-sequence reference"), "{}", v.error);

    // A batched step that returns NaN fails and says where the first one is.
    let nan = t.path().join("nan");
    Engine::Simd.copy_to(&nan);
    crate::replace_body(
        &nan,
        "src/batch.rs",
        "pub fn step(",
        "let _ = cache;\n    vec![f32::NAN; chunks.len() * model.vocab_size()]",
    );
    let v = verify_batching(&ctx, &batching(&nan), &Budget::secs(900)).unwrap();
    assert!(!v.passed && v.sequences.iter().all(|s| !s.logits_ok), "{}", metainfer::ops::Report::text(&v));
    assert!(
        v.error
            .contains("sequence 0: NaN in the engine's output at token 0 of step 0; a non-finite logit never passes"),
        "{}",
        v.error
    );

    let leaky = t.path().join("leaky");
    Engine::Simd.copy_to(&leaky);
    crate::replace_body(&leaky, "src/paged.rs", "pub fn free(", "self.seqs.remove(&seq);");
    let v = verify_batching(&ctx, &batching(&leaky), &Budget::secs(900)).unwrap();
    assert!(!v.passed && !v.block_manager.passed, "{}", metainfer::ops::Report::text(&v));
    assert!(v.block_manager.violations.iter().any(|m| m.contains("num_free_blocks says")), "{:?}", v.block_manager);
    // The batched step itself is untouched and still equals the reference.
    assert!(v.sequences.iter().all(|s| s.tokens_ok && s.logits_ok), "{}", metainfer::ops::Report::text(&v));
}

/// A scheduler that plans more tokens than the step budget, and one that goes on past an EOS id,
/// fail verify_batching's scheduler test for that reason, while their block manager and batched
/// step still pass.
#[test]
fn faulted_schedulers_fail_verify_batching_for_their_reasons() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let faults = [
        (
            "over-budget",
            "let mut budget = self.max_batch_tokens;",
            "let mut budget = self.max_batch_tokens + 3;",
            "over the budget of",
        ),
        (
            "no-eos",
            "if s.req.eos.contains(&token) {",
            "if false && s.req.eos.contains(&token) {",
            "the reason is \"stop\"",
        ),
    ];
    for (name, from, to, why) in faults {
        let dir = t.path().join(name);
        Engine::Simd.copy_to(&dir);
        crate::inject(&dir, "src/scheduler.rs", from, to);
        // Seed 3 draws a trace with a budget of 7 tokens, EOS ids and 8 preemptions.
        let v =
            verify_batching(&ctx, &BatchingRequest { seed: Some(3), ..batching(&dir) }, &Budget::secs(900)).unwrap();
        let text = metainfer::ops::Report::text(&v);
        assert!(!v.passed && !v.scheduler.passed && v.block_manager.passed, "{name}: {text}");
        assert!(v.scheduler.violations.iter().any(|m| m.contains(why)), "{name}: {text}");
        assert!(v.sequences.iter().all(|s| s.tokens_ok && s.logits_ok), "{name}: {text}");
    }
}

#[test]
fn faulted_serving_kernels_are_diagnosed() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("faulted");
    Engine::Simd.copy_to(&engine);
    // Top-p drops the crossing token; paged attention reads logical blocks as physical ones.
    crate::inject(&engine, "src/kernels.rs", "keep = j + 1;", "keep = j.max(1);");
    crate::inject(
        &engine,
        "src/kernels.rs",
        "let base = table[b] as usize * block_size * kv_stride + kvh * head_dim;",
        "let base = b * block_size * kv_stride + kvh * head_dim;",
    );
    crate::inject(
        &engine,
        "src/kernels.rs",
        "let base = table[b] as usize * block_size * kv_stride + col;",
        "let base = b * block_size * kv_stride + col;",
    );
    let k = kernel_test(
        &ctx,
        &KernelTestRequest {
            engine: s(&engine),
            kernels: vec!["kernel.sample".into(), "kernel.paged_attention".into()],
            ..Default::default()
        },
        &Budget::secs(900),
    )
    .unwrap();
    let text = metainfer::ops::Report::text(&k);
    let named = |id: &str, failure: &str| {
        k.kernels.iter().any(|r| r.kernel == id && !r.passed && r.diagnosis.iter().any(|d| d.failure == failure))
    };
    assert!(named("kernel.sample", "failure.top-p-boundary-dropped"), "{text}");
    assert!(named("kernel.paged_attention", "failure.paged-block-table-ignored"), "{text}");
}

/// The SIMD example engine passes verify_batching on BabyLlama, and the outcome is recorded.
#[test]
fn simd_engine_passes_verify_batching() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = Engine::Simd.shared_copy();
    let v = verify_batching(&ctx, &BatchingRequest { sequences: Some(8), ..batching(&engine) }, &Budget::secs(900))
        .unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    crate::assert_conforms(&v);
    assert_eq!(v.sequences.len(), 8);
    assert!(v.block_manager.ops == metainfer::ops::batching::BLOCK_OPS && v.max_chunks_per_step >= 2);
    let sc = &v.scheduler;
    assert!(sc.passed && sc.requests >= 6, "{sc:?}");
    assert_eq!(sc.refused + sc.aborted + sc.finished, sc.requests, "every request ends: {sc:?}");
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let o = ledger.list(0, 1).unwrap().remove(0);
    assert_eq!((o.tool.as_str(), o.passed), ("verify_batching", true));

    // Split through a bundle (built and drawn here, run by `metainfer bundle run` in another
    // process, judged here): the same seed gives the direct run's verdict, figure for figure.
    let dir = t.path().join("batching-bundle");
    let req = |write: Option<&std::path::Path>, read: Option<&std::path::Path>| BatchingRequest {
        sequences: Some(8),
        seed: Some(v.seed),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..batching(&engine)
    };
    let w = verify_batching(&ctx, &req(Some(&dir), None), &Budget::secs(900)).unwrap();
    assert!(!w.passed && w.error.starts_with("not run: bundle written to"), "{}", w.error);
    assert_eq!(ledger.list(0, 10).unwrap().len(), 1, "writing a bundle records nothing");
    let out = crate::bundles::run_bundle(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let ran: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let replies: Vec<&str> = ran["runs"].as_array().unwrap().iter().map(|r| r["reply"].as_str().unwrap()).collect();
    assert_eq!(replies, ["block_manager", "scheduler", "batch"]);
    let r = verify_batching(&ctx, &req(None, Some(&dir)), &Budget::secs(900)).unwrap();
    assert!(r.passed, "{}", metainfer::ops::Report::text(&r));
    let figures = |b: &metainfer::ops::batching::BatchingReport| {
        let seqs: Vec<(usize, usize, u64)> =
            b.sequences.iter().map(|q| (q.prompt_len, q.steps, q.max_abs_err.to_bits())).collect();
        (b.block_manager.ops, b.scheduler.requests, b.scheduler.preemptions, b.steps, seqs)
    };
    assert_eq!(figures(&r), figures(&v));
    let o = ledger.list(0, 1).unwrap().remove(0);
    assert_eq!((o.tool.as_str(), o.passed), ("verify_batching", true));
    assert_eq!(o.figures["bundle"], s(&dir.canonicalize().unwrap()));
}

fn serve_req(engine: &std::path::Path) -> ServeRequest {
    ServeRequest {
        engine: s(engine),
        model: s(&crate::babyllama()),
        concurrency: Some(vec![1, 4]),
        max_tokens: Some(8),
        ..Default::default()
    }
}

/// serve_engine on engines that cannot serve: a batch-1 library is a bad request; the bare serving
/// scaffold has no binary; a binary whose `serve` fails at once never answers /health; a constant
/// sampler answers, but not the reference's greedy text, at the battery and under load.
#[test]
fn serve_engine_fails_without_a_binary_on_a_dying_server_and_on_a_constant_sampler() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let plain = t.path().join("plain");
    batch_one(&plain);
    let e = serve_engine(&ctx, &serve_req(&plain), &Budget::secs(900)).unwrap_err();
    assert!(e.kind == ErrorKind::Usage && e.message.contains("no [serving] table"), "{}", e.message);

    let bare = t.path().join("bare");
    let req = ScaffoldRequest {
        model: s(&crate::babyllama()),
        out: s(&bare),
        target: "cpu".into(),
        dtype: "f32".into(),
        name: Some("bare".into()),
        force: false,
        reference_level: Default::default(),
        serving: Some(serving(4, 128)),
        ..Default::default()
    };
    let scaffolded = scaffold(&ctx, &req).unwrap();
    assert!(scaffolded.files.contains(&"src/main.rs".to_string()), "{:?}", scaffolded.files);
    // The scaffold's binary explains itself, then its serve stops at the todo!() left to the agent.
    let r = serve_engine(&ctx, &serve_req(&bare), &Budget::secs(900)).unwrap();
    crate::assert_conforms(&r);
    let text = metainfer::ops::Report::text(&r);
    assert!(!r.passed && r.checks[0].name == "help" && r.checks[0].passed, "{text}");
    assert!(r.error.contains("exited before answering /health") && r.error.contains("not yet implemented"), "{text}");
    assert!(r.error.contains("serving model babyllama-105 from "), "serve prints its model and address: {text}");
    assert!(r.levels.is_empty());

    // An engine without a binary at all.
    std::fs::remove_file(bare.join("src/main.rs")).unwrap();
    let r = serve_engine(&ctx, &serve_req(&bare), &Budget::secs(900)).unwrap();
    assert!(!r.passed && r.error.contains("the engine has no binary"), "{}", r.error);
    assert!(r.checks.is_empty() && r.levels.is_empty());

    // A binary whose --help is a usage error (exit 2): serve_engine stops before serving.
    let mute = t.path().join("mute");
    Engine::Simd.copy_to(&mute);
    crate::replace_body(
        &mute,
        "src/main.rs",
        "fn usage() -> String",
        "eprintln!(\"error: usage: llama-cpu-simd generate | serve\");\n    std::process::exit(2)",
    );
    let r = serve_engine(&ctx, &serve_req(&mute), &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(!r.passed && r.checks.len() == 1 && !r.checks[0].passed, "{text}");
    assert!(r.checks[0].detail.contains("`llama-cpu-simd --help` exited with status 2"), "{text}");
    assert!(r.error.contains("does not explain itself"), "{text}");

    let dying = t.path().join("dying");
    Engine::Simd.copy_to(&dying);
    crate::replace_body(&dying, "src/main.rs", "fn serve(", "let _ = args;\n    Err(\"refusing to serve\".into())");
    let r = serve_engine(&ctx, &serve_req(&dying), &Budget::secs(900)).unwrap();
    assert!(!r.passed, "{}", metainfer::ops::Report::text(&r));
    assert!(
        r.error.contains("exited before answering /health") && r.error.contains("refusing to serve"),
        "{}",
        r.error
    );
    assert_eq!(
        r.checks.iter().map(|c| (c.name.as_str(), c.passed)).collect::<Vec<_>>(),
        [("help", true), ("health", false)]
    );

    let constant = t.path().join("constant");
    Engine::Simd.copy_to(&constant);
    crate::replace_body(&constant, "src/kernels.rs", "pub fn sample(", "let _ = (logits, prev, params, u);\n    3");
    let r = serve_engine(&ctx, &serve_req(&constant), &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(!r.passed, "{text}");
    let greedy = r.checks.iter().find(|c| c.name == "greedy").unwrap();
    assert!(!greedy.passed && greedy.detail.contains("differs from the reference"), "{text}");
    // It still answers in OpenAI's shape: health, models and the bad requests pass.
    for name in ["health", "models", "bad_requests"] {
        assert!(r.checks.iter().any(|c| c.name == name && c.passed), "{name}: {text}");
    }
    assert!(r.levels.iter().all(|l| l.greedy_mismatches == l.requests), "{text}");
}

/// A server that answers one request at a time but exits when many arrive at once fails the
/// burst check (component.openai_server: 1,000 requests at once are answered or refused with a
/// 4xx, and the server keeps serving), and then the alive check.
#[test]
fn a_server_that_dies_under_a_burst_fails_serve_engine() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("fragile");
    Engine::Simd.copy_to(&engine);
    crate::inject(
        &engine,
        "src/main.rs",
        "    if app.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {",
        "    if app.in_flight.load(Ordering::SeqCst) >= 8 {\n        std::process::exit(3);\n    }\n    if app.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {",
    );
    let req = ServeRequest { concurrency: Some(vec![1]), ..serve_req(&engine) };
    let r = serve_engine(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(!r.passed, "{text}");
    let by = |name: &str| r.checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name}: {text}"));
    for name in ["greedy", "streaming", "bad_requests"] {
        assert!(by(name).passed, "{name}: {text}");
    }
    let burst = by("burst");
    assert!(!burst.passed && burst.detail.contains("neither"), "{text}");
    let alive = by("alive");
    assert!(!alive.passed && alive.detail.contains("exited with status 3"), "{text}");
    assert!(r.levels.is_empty(), "{text}");
}

/// A SIMD server whose batched step panics once a sequence passes position 100 (as a device error
/// or an out-of-memory would on the GPU) answers the request in flight with a 500 in OpenAI's shape
/// and exits with status 70 once the requests in flight are answered, its reason on stderr, rather
/// than going on answering `/health` while every request fails. A short request before it is
/// answered.
#[test]
fn a_server_whose_engine_thread_fails_exits() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let dir = t.path().join("failing");
    Engine::Simd.copy_to(&dir);
    crate::inject(
        &dir,
        "src/main.rs",
        "        let logits = batch::step(model, cache, &chunks);",
        "        assert!(chunks.iter().all(|c| c.start <= 100), \"a device error in the batched step\");\n        let logits = batch::step(model, cache, &chunks);",
    );
    let engine = ctx.workshop.engine_at(&metainfer::beneath::Dir::open(&dir).unwrap()).unwrap();
    let bin = t.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let build = ctx.workshop.build_engine_binary(&engine, &["server".into()], &bin, &Budget::secs(900)).unwrap();
    assert!(build.ok, "{:?}", build.diagnostics);
    let model = crate::babyllama();
    let mut server = std::process::Command::new(build.executable.unwrap())
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
    let port: u16 = line.trim().rsplit(':').next().unwrap().parse().unwrap();
    // One plain HTTP/1.1 request on its own connection: (status, body).
    let complete = |max_tokens: usize| -> (u16, String) {
        use std::io::{Read, Write};
        let body = format!(r#"{{"prompt": "Once upon a time", "max_tokens": {max_tokens}, "temperature": 0}}"#);
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        c.read_to_string(&mut answer).unwrap();
        let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    };
    let (status, body) = complete(8);
    assert_eq!(status, 200, "{body}");
    let (status, body) = complete(200);
    assert_eq!(status, 500, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "server_error", "{body}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let exit = loop {
        if let Some(status) = server.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            server.kill().unwrap();
            panic!("the server is still running 30 s after its engine thread failed");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(exit.code(), Some(70));
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    assert!(rest.contains("a device error in the batched step"), "{rest}");
    assert!(rest.contains("the engine thread failed"), "{rest}");
    // It stopped by the graceful path, not by the engine thread's last resort 5 s later.
    assert!(rest.contains("the server answered the requests in flight and stopped"), "{rest}");
}

/// The SIMD engine's server with Nagle's algorithm left on (TCP_NODELAY not set on accepted
/// connections) answers every request right but waits for the client's delayed ACK on reused
/// keep-alive connections: it fails the keep_alive check (component.openai_server), and only it.
#[test]
fn a_server_that_leaves_nagle_on_fails_serve_engine() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("nagle");
    Engine::Simd.copy_to(&engine);
    crate::inject(&engine, "src/main.rs", "tcp.set_nodelay(true)", "tcp.set_nodelay(false)");
    let req = ServeRequest { concurrency: Some(vec![1]), requests: Some(2), ..serve_req(&engine) };
    let r = serve_engine(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(!r.passed, "{text}");
    for c in &r.checks {
        assert_eq!(c.passed, c.name != "keep_alive", "{}: {text}", c.name);
    }
    let k = r.checks.iter().find(|c| c.name == "keep_alive").expect("a keep_alive check");
    assert!(k.detail.contains("set TCP_NODELAY on every accepted connection"), "{text}");
}

/// The SIMD example engine's server passes serve_engine on BabyLlama at concurrency 1, 4 and 16,
/// and the outcome is recorded with its figures.
#[test]
fn simd_engine_passes_serve_engine() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = Engine::Simd.shared_copy();
    let req = ServeRequest { concurrency: Some(vec![1, 4, 16]), ..serve_req(&engine) };
    let r = serve_engine(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(r.passed, "{text}");
    crate::assert_conforms(&r);
    let names: Vec<&str> = r.checks.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "help",
            "health",
            "models",
            "greedy",
            "streaming",
            "stop",
            "chat",
            "bad_requests",
            "burst",
            "alive",
            "disconnect",
            "keep_alive"
        ],
        "{text}"
    );
    // component.openai_server: 1,000 requests at once are each answered or refused with a 4xx.
    let burst = &r.checks[8];
    assert!(burst.detail.starts_with("1000 requests at once: "), "{text}");
    assert_eq!(r.levels.iter().map(|l| l.concurrency).collect::<Vec<_>>(), [1, 4, 16]);
    for l in &r.levels {
        assert_eq!((l.completed, l.greedy_mismatches), (l.requests, 0), "{text}");
        assert!(l.output_tokens > 0 && l.ttft_ms_p50 > 0.0 && l.ttft_ms_p99 >= l.ttft_ms_p50, "{text}");
    }
    assert_eq!(r.sandboxed, ctx.workshop.sandboxed());
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let o = ledger.list(0, 1).unwrap().remove(0);
    assert_eq!((o.tool.as_str(), o.passed), ("serve_engine", true));
    eprintln!("{text}");
}

/// The scaffold's template of a serving engine's binary (src/main.rs), compiled on its own (it needs
/// only std): `--help` and each command's `--help` exit 0 with the flags, an unknown flag exits 2
/// naming it, and `serve` prints the model and the bound address before the agent's todo!().
#[test]
fn the_scaffolds_engine_binary_explains_itself() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("main.rs");
    std::fs::write(&src, metainfer::ops::scaffold::ENGINE_MAIN).unwrap();
    let exe = t.path().join("engine");
    let out = std::process::Command::new("rustc")
        .args(["--edition", "2024", "-o"])
        .arg(&exe)
        .arg(&src)
        .env("CARGO_PKG_NAME", "engine")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cmd = |args: &[&str]| std::process::Command::new(&exe).args(args).output().unwrap();
    let top = cmd(&["--help"]);
    assert_eq!(top.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&top.stdout).contains("usage: engine <command>"));
    for (sub, flags) in [
        ("generate", &["--model", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--seed"][..]),
        ("serve", &["--model", "--host", "--port"][..]),
    ] {
        let h = cmd(&[sub, "--help"]);
        assert_eq!(h.status.code(), Some(0), "{sub} --help");
        let h = String::from_utf8_lossy(&h.stdout);
        assert!(flags.iter().all(|f| h.contains(f)), "{sub} --help:\n{h}");
        let unknown = cmd(&[sub, "--bogus", "1"]);
        assert_eq!(unknown.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown flag `--bogus` for `"), "{sub}");
    }
    let missing = cmd(&["serve"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("serve needs --model"));
    let model = crate::babyllama();
    let served = cmd(&["serve", "--model", model.to_str().unwrap(), "--port", "0"]);
    let err = String::from_utf8_lossy(&served.stderr);
    let want = format!("serving model babyllama-105 from {} on http://127.0.0.1:", model.display());
    assert!(err.starts_with(&want) && err.contains("not yet implemented"), "{err}");
}

/// The SIMD engine's binary, `generate`: greedy on BabyLlama prints the golden continuation of the
/// golden prompt (agreed by four independent implementations, ../shared/golden), a seeded sampled
/// run prints the same text twice, and a bad flag exits 2 naming it; `--help` on the binary and its
/// commands lists every flag, an unknown flag or command exits 2, `serve` prints model and address.
#[test]
fn simd_binary_explains_itself_and_generate_prints_the_golden_continuation() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let dir = Engine::Simd.shared_copy();
    let engine = ctx.workshop.engine_at(&metainfer::beneath::Dir::open(&dir).unwrap()).unwrap();
    let bin = t.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let build = ctx.workshop.build_engine_binary(&engine, &["server".into()], &bin, &Budget::secs(900)).unwrap();
    assert!(build.ok, "{:?}", build.diagnostics);
    let exe = build.executable.expect("the SIMD engine has a binary");
    let model = crate::babyllama();
    let golden = crate::golden();
    let prompt = golden["prompt"].as_str().unwrap();
    let new_tokens = golden["greedy_ids"].as_array().unwrap().len() - golden["prompt_ids"].as_array().unwrap().len();
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", model.to_str().unwrap(), "--prompt", prompt];
        args.extend_from_slice(extra);
        std::process::Command::new(&exe).args(&args).output().unwrap()
    };
    let n = new_tokens.to_string();
    let out = run(&["--max-tokens", &n]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = format!("{}\n", &golden["text"].as_str().unwrap()[prompt.len()..]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);

    let sampled = ["--max-tokens", "24", "--temperature", "0.9", "--top-p", "0.9", "--seed", "7"];
    let (a, b) = (run(&sampled), run(&sampled));
    assert!(a.status.success() && !a.stdout.is_empty(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout, "the same seed samples the same text");

    let bad = run(&["--temperature", "warm"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--temperature"), "{}", String::from_utf8_lossy(&bad.stderr));

    // It explains itself (component.openai_server): help on the binary and on each command exits 0
    // with the flags; an unknown flag or command exits 2 naming it.
    let cmd = |args: &[&str]| std::process::Command::new(&exe).args(args).output().unwrap();
    let top = cmd(&["--help"]);
    assert_eq!(top.status.code(), Some(0));
    let top_text = String::from_utf8_lossy(&top.stdout);
    assert!(top_text.contains("generate") && top_text.contains("serve"), "{top_text}");
    for (sub, flags) in [
        (
            "generate",
            &["--model", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed"][..],
        ),
        (
            "serve",
            &["--model", "--host", "--port", "--max-seqs", "--block-size", "--kv-blocks", "--max-batch-tokens"][..],
        ),
    ] {
        let h = cmd(&[sub, "--help"]);
        assert_eq!(h.status.code(), Some(0), "{sub} --help");
        let h = String::from_utf8_lossy(&h.stdout);
        for f in flags {
            assert!(h.contains(f), "{sub} --help lacks {f}:\n{h}");
        }
        let unknown = cmd(&[sub, "--bogus", "1"]);
        assert_eq!(unknown.status.code(), Some(2), "{sub} --bogus");
        assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown flag `--bogus`"), "{sub}");
    }
    let unknown = cmd(&["train"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown command `train`"));

    // serve says which model it serves on which address once it listens (port 0: a free one).
    let mut server = std::process::Command::new(&exe)
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let (mut line, mut pool) = (String::new(), String::new());
    std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
    std::io::BufRead::read_line(&mut stderr, &mut pool).unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    let want = format!("serving model babyllama-105 from {} on http://127.0.0.1:", model.display());
    assert!(line.starts_with(&want), "{line:?}");
    let port: u16 = line.trim().rsplit(':').next().unwrap().parse().unwrap();
    assert_ne!(port, 0, "{line:?}");
    // Then the KV-cache pool it made: by default 16 sequences (`--max-seqs`) of BabyLlama's 256
    // positions (config.json), 256 blocks of 16, each 16 positions × 5 layers × K and V × 4 KV
    // heads × 16 × 4 bytes = 40,960 bytes: 10 MiB, 0.01 GiB.
    assert_eq!(pool.trim(), "KV cache: 256 blocks of 16 positions (0.01 GiB), 16 full contexts of 256 positions");
}

/// The SIMD engine's server passes serve_engine at the stories15M shape too (a synthetic checkpoint
/// of its published dimensions: hidden 288, 6 layers, 6 heads, vocab 32,000, 256 positions), every
/// output against the reference; the figures per concurrency are printed.
#[test]
fn simd_engine_serves_the_stories15m_shape() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let model = stories15m(t.path());
    let engine = Engine::Simd.shared_copy();
    let req = ServeRequest { model: s(&model), concurrency: Some(vec![1, 4, 16]), ..serve_req(&engine) };
    let r = serve_engine(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(r.passed, "{text}");
    for l in &r.levels {
        assert_eq!((l.completed, l.greedy_mismatches), (l.requests, 0), "{text}");
    }
    // At this size a long request takes hundreds of milliseconds: cancellation is observed.
    let d = r.checks.iter().find(|c| c.name == "disconnect").expect("a disconnect check");
    assert!(d.passed && d.detail.ends_with("the dropped requests were cancelled"), "{text}");
    eprintln!("{text}");
}

/// A synthetic checkpoint of the stories15M shape (`synth --preset stories15m --seed 5`) in `dir`.
fn stories15m(dir: &std::path::Path) -> std::path::PathBuf {
    let model = dir.join("stories15m");
    let out = std::process::Command::new(crate::bin())
        .args(["synth", "--preset", "stories15m", "--seed", "5", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    model
}

/// A server that goes on generating for clients that went away (it never aborts a request whose
/// token channel is closed) fails the disconnect check (component.openai_server: a client
/// disconnect cancels its request), on the stories15M shape where a long request takes hundreds of
/// milliseconds; every other check still passes. It also holds every answer of over 100 tokens
/// for 3 s before its end (the plain answer's body, the stream's last chunk), as a server would to
/// make the full-length request alone, or the stream kept open, look longer than the probe's wait:
/// the check counts the kept stream's events, nearly all of which came before the probe's answer.
#[test]
fn a_server_that_ignores_dropped_clients_fails_serve_engine() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let model = stories15m(t.path());
    let engine = t.path().join("deaf");
    Engine::Simd.copy_to(&engine);
    crate::inject(
        &engine,
        "src/main.rs",
        ".filter(|(_, l)| l.out.is_closed())",
        ".filter(|(_, l)| false && l.out.is_closed())",
    );
    crate::inject(
        &engine,
        "src/main.rs",
        "                drop(slot);\n                let usage",
        "                if completion_tokens > 100 { std::thread::sleep(std::time::Duration::from_secs(3)); }\n                drop(slot);\n                let usage",
    );
    crate::inject(
        &engine,
        "src/main.rs",
        "                        let mut last = chunk(\"\", Some(finish), first);",
        "                        if completion_tokens > 100 { std::thread::sleep(std::time::Duration::from_secs(3)); }\n                        let mut last = chunk(\"\", Some(finish), first);",
    );
    let req = ServeRequest { model: s(&model), concurrency: Some(vec![1]), ..serve_req(&engine) };
    let r = serve_engine(&ctx, &req, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(!r.passed, "{text}");
    for c in r.checks.iter().filter(|c| c.name != "disconnect") {
        assert!(c.passed, "{}: {text}", c.name);
    }
    let d = r.checks.iter().find(|c| c.name == "disconnect").expect("a disconnect check");
    assert!(!d.passed && d.detail.contains("it waited behind the dropped requests"), "{text}");
}

/// serve_engine split through a bundle: written here (the engine's binary and the plan of every
/// request, no expected answer in it), run by `bundle run` (the server starts where the bundle is;
/// the client sends the plan and records what came back), judged here against the reference. A
/// run whose recorded answers were altered fails on exactly the altered request; a call with
/// other load arguments is refused naming the plan's difference; nothing is recorded until the
/// bundle is judged.
#[test]
fn simd_engine_serves_through_a_bundle_judged_here() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = Engine::Simd.shared_copy();
    let dir = t.path().join("serve-bundle");
    let base = ServeRequest { seed: Some(11), ..serve_req(&engine) };
    let w =
        serve_engine(&ctx, &ServeRequest { write_bundle: Some(s(&dir)), ..base.clone() }, &Budget::secs(900)).unwrap();
    assert!(!w.passed && w.error.starts_with("not run: bundle written to"), "{}", w.error);
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    assert_eq!(ledger.list(0, 10).unwrap().len(), 0, "a written bundle is not a verdict");
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("bundle.json")).unwrap()).unwrap();
    assert_eq!(manifest["tool"], "serve_engine");
    assert_eq!(manifest["requests"][0]["request"], "plan.json");
    let plan: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["greedy"].as_array().unwrap().len(), 3);
    assert_eq!(plan["levels"].as_array().unwrap().len(), 2);
    assert!(dir.join("model/config.json").is_file(), "BabyLlama is small enough to travel");

    // Read back before it ran: refused, saying what to do.
    let from = ServeRequest { from_bundle: Some(s(&dir)), ..base.clone() };
    let e = serve_engine(&ctx, &from, &Budget::secs(900)).unwrap_err();
    assert!(e.message.contains("has not been run") && e.message.contains("metainfer bundle run"), "{}", e.message);

    let run = metainfer::ops::bundle::BundleRunRequest { dir: s(&dir), model: None, key: None };
    let ran = metainfer::ops::bundle::run(&run, &Budget::secs(900)).unwrap();
    assert!(ran.passed, "{}", metainfer::ops::Report::text(&ran));
    assert_eq!((ran.tool.as_str(), ran.runs[0].reply.as_str()), ("serve_engine", "serve"));

    let r = serve_engine(&ctx, &from, &Budget::secs(900)).unwrap();
    let text = metainfer::ops::Report::text(&r);
    assert!(r.passed, "{text}");
    assert_eq!(r.checks.len(), 12, "{text}");
    // Run without a runner key: shown, and recorded, as no evidence.
    assert!(r.attestation.starts_with("unattested: "), "{text}");
    assert_eq!(
        r.levels.iter().map(|l| (l.concurrency, l.completed, l.greedy_mismatches)).collect::<Vec<_>>(),
        [(1, 2, 0), (4, 8, 0)]
    );
    let o = ledger.list(0, 1).unwrap().remove(0);
    assert_eq!((o.tool.as_str(), o.passed), ("serve_engine", true));

    // Other load arguments: not what the bundle's plan holds.
    let other = ServeRequest { concurrency: Some(vec![1, 2]), ..from.clone() };
    let e = serve_engine(&ctx, &other, &Budget::secs(900)).unwrap_err();
    assert!(e.message.contains("plan.json is not what this call sends (plan.levels"), "{}", e.message);

    // The manifest rewritten (a swapped executable would need its hash rewritten there): refused,
    // since this server's ledger holds the manifest it wrote.
    let manifest_path = dir.join("bundle.json");
    let kept = std::fs::read(&manifest_path).unwrap();
    let mut m: serde_json::Value = serde_json::from_slice(&kept).unwrap();
    m["harness_sha256"] = serde_json::json!("0".repeat(64));
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let e = serve_engine(&ctx, &from, &Budget::secs(900)).unwrap_err();
    assert!(e.message.contains("the manifest changed since this server wrote the bundle"), "{}", e.message);
    std::fs::write(&manifest_path, &kept).unwrap();
    // Read back by a server whose ledger did not write it: judged, but no evidence.
    let elsewhere = tempfile::tempdir().unwrap();
    let r = serve_engine(&crate::ctx(elsewhere.path()), &from, &Budget::secs(900)).unwrap();
    assert!(r.passed && r.attestation.contains("has no record of writing bundle"), "{}", r.attestation);

    // One recorded answer altered: judged here, that request differs from the reference.
    let observed = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("observed."))
        .unwrap();
    let mut seen: serde_json::Value = serde_json::from_slice(&std::fs::read(&observed).unwrap()).unwrap();
    seen["levels"][1]["answers"][3][1] = serde_json::json!("Once upon a forged time");
    std::fs::write(&observed, serde_json::to_vec(&seen).unwrap()).unwrap();
    let r = serve_engine(&ctx, &from, &Budget::secs(900)).unwrap();
    assert!(!r.passed);
    assert_eq!(r.levels.iter().map(|l| l.greedy_mismatches).collect::<Vec<_>>(), [0, 1]);
}
