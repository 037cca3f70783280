//! Knowledge-base evolution end to end, on two scenarios a CKB without them does not cover:
//!
//! - a new model family whose difference is its weight layout: Phi-3 stores q/k/v as one fused
//!   `qkv_proj` and gate/up as one fused `gate_up_proj` (fixture `tests/fixtures/evolution/model.phi3.toml`);
//! - a new platform: an AArch64 CPU with NEON (fixture `platform.cpu-aarch64.toml`).
//!
//! Each goes: plan reports the gap -> an agent's proposal is staged (a broken one is refused, nothing
//! staged) -> the gates run an engine under the staged contract, which routes provisionally and is
//! recorded as `id@version` -> the evidence promotes it into the CKB working copy (a temporary copy of
//! contracts/) -> plan covers the target. For the platform the evidence is the passing gate; for the
//! family it is `ckb conformance` against transformers' own numbers (../shared/conformance/phi3): an
//! engine agreeing with the contract it was written from proves nothing about the model, and a
//! family whose engine agrees with a wrong contract is not promoted. The engine is the plain example engine, which reads
//! fused layouts (`fused_qkv`, `fused_gate_up`), with a metainfer.toml naming the new family or
//! target.
//!
//! The gates run an engine where the server runs, on this host: the aarch64 engine is checked here
//! through its portable code path (the plain engine has no architecture-specific code).

use std::path::{Path, PathBuf};

use metainfer::ckb::Ckb;
use metainfer::ledger::Ledger;
use metainfer::model;
use metainfer::ops::conformance::conformance;
use metainfer::ops::evolve::{ProposeRequest, promote, propose};
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::plan::{PlanRequest, plan};
use metainfer::ops::profile::{ProfileRequest, profile};
use metainfer::ops::synth::{SynthRequest, synth_config, synth_config_for, write_checkpoint, write_checkpoint_with};
use metainfer::ops::verify::{VerifyRequest, verify};
use metainfer::ops::{Ctx, Report};
use metainfer::oracle::llama::Reference;

use crate::Engine;
use crate::{budget, s};

fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/evolution").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A context over a fresh working copy `dir/ckb` of the shipped CKB, ledger in `dir`.
fn working_copy_ctx(dir: &Path) -> (Ctx, PathBuf) {
    let wc = dir.join("ckb");
    crate::evolve::working_copy(&wc);
    // A CKB without Phi-3: the family this scenario proposes (its shipped contract, and the
    // failure contract only it lists, taken out).
    std::fs::remove_file(wc.join("models/phi3.toml")).unwrap();
    std::fs::remove_file(wc.join("failures/fused-qkv-order.toml")).unwrap();
    let mut ctx = crate::ctx(dir);
    ctx.ckb = Ckb::from_dir(&wc).unwrap();
    ctx.ckb_dir = Some(wc.clone());
    (ctx, wc)
}

fn plan_req(model: &Path, target: &str) -> PlanRequest {
    PlanRequest { model: s(model), target: target.into(), dtype: "f32".into(), ..Default::default() }
}

fn verify_req(engine: &Path, model: &Path) -> VerifyRequest {
    VerifyRequest {
        engine: s(engine),
        model: s(model),
        prompts: vec![],
        max_new_tokens: Some(8),
        seed: Some(5),
        ..Default::default()
    }
}

fn kernels_req(engine: &Path) -> KernelTestRequest {
    KernelTestRequest { engine: s(engine), kernels: vec![], seed: Some(5), ..Default::default() }
}

/// The copy of an example engine with a metainfer.toml for `family` on `target` that every test
/// running it unmodified shares ([`crate::shared_engine`]).
fn shared_engine_for(engine: Engine, family: &str, target: &str) -> std::path::PathBuf {
    let name = format!("{engine:?}-{family}-{target}").to_lowercase();
    crate::shared_engine(&name, |dir| engine_for(engine, dir, family, target))
}

/// A copy of an example engine with a metainfer.toml for `family` on `target`.
fn engine_for(engine: Engine, dir: &Path, family: &str, target: &str) {
    engine.copy_to(dir);
    std::fs::write(
        dir.join("metainfer.toml"),
        format!("family = {family:?}\ntarget = {target:?}\ndtype = \"f32\"\nreference_level = \"zero\"\n"),
    )
    .unwrap();
}

fn last_outcome(ctx: &Ctx, tool: &str) -> metainfer::ledger::Outcome {
    let l = Ledger::open(&ctx.ledger).unwrap();
    l.list(0, l.count().unwrap()).unwrap().into_iter().find(|o| o.tool == tool).unwrap()
}

#[test]
fn phi3_fused_layout_family_is_proposed_gated_and_promoted() {
    let t = tempfile::tempdir().unwrap();
    let (ctx, wc) = working_copy_ctx(t.path());
    let ledger = ctx.ledger.clone();

    // 1. A Phi-3 config.json routes to no family: plan reports the gap (routing reads config.json only).
    let raw = t.path().join("phi3-config-only");
    let mut config = synth_config(&SynthRequest { family: "llama".into(), ..Default::default() }).unwrap();
    config["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
    config["model_type"] = serde_json::json!("phi3");
    std::fs::create_dir_all(&raw).unwrap();
    std::fs::write(raw.join("config.json"), config.to_string()).unwrap();
    let r = plan(&ctx, &plan_req(&raw, "cpu")).unwrap();
    assert!(!r.covered && r.family.is_empty(), "{r:?}");
    assert!(r.gaps.iter().any(|g| g.field == "architectures" && g.reason.contains("Phi3ForCausalLM")), "{:?}", r.gaps);
    // Nor can synth write it yet.
    let synth_phi3 = |out: &Path| {
        std::process::Command::new(crate::bin())
            .arg("--ckb")
            .arg(&wc)
            .arg("--ledger")
            .arg(&ledger)
            .args(["synth", "--family", "phi3", "--seed", "11", "--out"])
            .arg(out)
            .output()
            .unwrap()
    };
    let out = synth_phi3(&t.path().join("too-early"));
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown family `phi3`"));

    // 2. Broken proposals are refused with field-level reasons, and nothing is staged.
    let proposal = fixture("model.phi3.toml");
    let dangling = proposal.replace("    \"kernel.linear\",\n", "    \"kernel.linear_fused\",\n");
    let r = propose(&ctx, &ProposeRequest { toml: dangling }).unwrap();
    assert!(!r.staged, "{r:?}");
    assert!(
        r.findings
            .iter()
            .any(|f| f.field == "/model/kernels" && f.message.contains("`kernel.linear_fused` does not resolve")),
        "{:?}",
        r.findings
    );
    let unknown = proposal.replace("features = [\"fused_qkv\",", "features = [\"fused_qkvo\",");
    let r = propose(&ctx, &ProposeRequest { toml: unknown }).unwrap();
    assert!(!r.staged, "{r:?}");
    assert!(
        r.findings.iter().any(|f| f.field == "/model/features/0" && f.message.contains("unknown feature `fused_qkvo`")),
        "{:?}",
        r.findings
    );
    assert!(!ctx.candidates_dir().exists(), "nothing may be staged for a refused proposal");

    // The valid proposal is staged in the working copy's candidates, not in the CKB.
    let r = propose(&ctx, &ProposeRequest { toml: proposal.clone() }).unwrap();
    assert!(r.staged && !r.amendment && r.findings.is_empty(), "{r:?}");
    assert!(ctx.candidates_dir().join("models/phi3.toml").is_file());
    assert!(!wc.join("models/phi3.toml").exists());
    // Staged, it routes provisionally: covered, provisional, with the evidence that would promote it.
    let r = plan(&ctx, &plan_req(&raw, "cpu")).unwrap();
    assert_eq!(
        (r.covered, r.family.as_str(), r.provisional.clone()),
        (true, "model.phi3", vec!["model.phi3@1".into()])
    );
    assert_eq!(r.missing_evidence.len(), 1);
    assert!(r.missing_evidence[0].starts_with("model.phi3@1: a passing `metainfer ckb conformance DIR`"), "{r:?}");
    assert!(metainfer::ops::Report::text(&r).starts_with("covered provisionally: model.phi3"));
    assert!(r.gaps.is_empty(), "{:?}", r.gaps);
    let cfg = r.config.unwrap();
    assert_eq!(cfg.features, ["fused_qkv", "fused_gate_up"], "a null sliding_window drops that feature");
    // lookup_contract reads the staged candidate, marked staged (the engine is written from it).
    let req = metainfer::ops::lookup::LookupRequest { id: Some("model.phi3".into()), ..Default::default() };
    let l = metainfer::ops::lookup::lookup(&ctx, &req).unwrap();
    assert!(l.contracts.len() == 1 && l.contracts[0].staged && l.contracts[0].version == 1, "{:?}", l.contracts);
    assert!(
        Report::text(&l).contains("model.phi3 (v1, model, staged: proposed, not promoted)"),
        "{}",
        Report::text(&l)
    );
    // No evidence yet: no promotion without --force.
    let e = promote(&ctx, "model.phi3", false).unwrap_err();
    assert!(e.message.contains("no evidence for model.phi3@1"), "{}", e.message);
    assert!(ctx.candidates_dir().join("models/phi3.toml").is_file());

    // 3. synth writes the family from its (staged) contract: fused tensors, no separate ones.
    let ckpt = t.path().join("phi3");
    let out = synth_phi3(&ckpt);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (written["architectures"][0].as_str(), written["model_type"].as_str()),
        (Some("Phi3ForCausalLM"), Some("phi3"))
    );
    let tensors = model::read_safetensors(&ckpt).unwrap();
    assert_eq!(tensors["model.layers.0.self_attn.qkv_proj.weight"].0, vec![(4 + 2 * 2) * 16, 64]);
    assert_eq!(tensors["model.layers.1.mlp.gate_up_proj.weight"].0, vec![2 * 160, 64]);
    assert!(tensors.keys().all(|k| !k.contains("q_proj") && !k.contains("gate_proj.")), "{:?}", tensors.keys());

    // 4. An engine that reads separate q/k/v and gate/up tensors only (the SIMD example) cannot load
    // it; the plain example engine, which splits fused tensors by rows as the contract says, passes.
    let simd = shared_engine_for(Engine::Simd, "model.phi3", "cpu");
    let v = verify(&ctx, &verify_req(&simd, &ckpt), &budget()).unwrap();
    assert!(!v.passed && v.error.contains("missing tensor model.layers.0.self_attn.q_proj.weight"), "{}", v.error);
    assert!(v.promotions.is_empty());
    let engine = shared_engine_for(Engine::Plain, "model.phi3", "cpu");
    let k = kernel_test(&ctx, &kernels_req(&engine), &budget()).unwrap();
    assert!(k.passed, "{k:?}");
    let v = verify(&ctx, &verify_req(&engine, &ckpt), &budget()).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    assert_eq!(v.family, "model.phi3");
    let o = last_outcome(&ctx, "verify_generation");
    assert!(o.passed && o.contracts.contains(&"model.phi3@1".to_string()), "{:?}", o.contracts);

    // 5. The passing verify is not evidence for a family (the engine was written to the same
    // contract): it says what is, and the candidate stays staged.
    assert_eq!(v.promotions.len(), 1, "{:?}", v.promotions);
    let p = &v.promotions[0];
    assert!(!p.promoted && p.contract == "model.phi3@1", "{p:?}");
    assert!(p.message.contains("ckb conformance") && p.message.contains("not evidence"), "{}", p.message);
    assert!(!wc.join("models/phi3.toml").exists() && ctx.candidates_dir().join("models/phi3.toml").is_file());
    let e = promote(&ctx, "model.phi3", false).unwrap_err();
    assert!(
        e.message.contains("no evidence for model.phi3@1") && e.message.contains("ckb conformance"),
        "{}",
        e.message
    );
    // transformers' own numbers are: the conformance check passes, is recorded, and promotes.
    let vectors = crate::shared().join("conformance/phi3");
    let c = conformance(&ctx, &[s(&vectors)]).unwrap();
    assert!(c.passed && c.families[0].contract.as_deref() == Some("model.phi3"), "{}", Report::text(&c));
    let o = last_outcome(&ctx, "ckb_conformance");
    assert!(o.passed && o.authenticated && o.contracts == ["model.phi3@1"], "{o:?}");
    let sha = metainfer::model::embedded::sha256_hex(&std::fs::read(vectors.join("vectors.json")).unwrap());
    assert_eq!(o.figures["vectors_sha256"].as_str(), Some(sha.as_str()));
    assert!(o.figures["source"].as_str().unwrap().starts_with("transformers 5."), "{}", o.figures);
    let p = &c.families[0].promotions;
    assert!(p.len() == 1 && p[0].promoted && p[0].contract == "model.phi3@1", "{p:?}");
    assert!(p[0].message.contains(&format!("evidence: outcome {} of ckb_conformance", o.id)), "{}", p[0].message);
    assert!(wc.join("models/phi3.toml").is_file());
    assert!(!ctx.candidates_dir().join("models/phi3.toml").exists());
    let promoted = Ckb::from_dir(&wc).unwrap();
    assert!(promoted.get("model.phi3").is_ok() && !promoted.is_provisional("model.phi3"));

    // 6. plan covers Phi-3 now, in this process (the working copy is re-read) and in a new one.
    let r = plan(&ctx, &plan_req(&ckpt, "cpu")).unwrap();
    assert!(r.covered && r.family == "model.phi3" && r.provisional.is_empty(), "{r:?}");
    let out = std::process::Command::new(crate::bin())
        .arg("--ckb")
        .arg(&wc)
        .arg("--ledger")
        .arg(&ledger)
        .args(["plan", "--model"])
        .arg(&ckpt)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.starts_with("covered: model.phi3 on platform.cpu-x86_64"), "{text}");

    // The same evidence promotes by hand (`ckb promote` without --force) in another working copy...
    let wc2 = t.path().join("other").join("ckb");
    crate::evolve::working_copy(&wc2);
    std::fs::remove_file(wc2.join("models/phi3.toml")).unwrap();
    std::fs::remove_file(wc2.join("failures/fused-qkv-order.toml")).unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(crate::bin())
            .arg("--ckb")
            .arg(&wc2)
            .arg("--ledger")
            .arg(&ledger)
            .args(args)
            .output()
            .unwrap()
    };
    let fixture_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/evolution/model.phi3.toml");
    assert!(cli(&["ckb", "propose", &s(&fixture_path)]).status.success());
    let out = cli(&["ckb", "promote", "model.phi3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("evidence: outcome") && text.contains("ckb_conformance"), "{text}");
    assert!(wc2.join("models/phi3.toml").is_file());

    // ...while the built-in CKB ships Phi-3 (model.phi3, held to transformers' own logits by
    // `ckb conformance`): the same engine verifies under it with nothing to promote.
    let builtin = crate::ctx(t.path());
    assert!(builtin.ckb_dir.is_none() && builtin.ledger == ledger);
    let v = verify(&builtin, &verify_req(&engine, &ckpt), &budget()).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    assert!(v.promotions.is_empty(), "{:?}", v.promotions);
}

#[test]
fn aarch64_platform_is_proposed_gated_and_promoted() {
    let t = tempfile::tempdir().unwrap();
    let (ctx, wc) = working_copy_ctx(t.path());
    let ckpt = t.path().join("llama");
    write_checkpoint(&ckpt, &synth_config(&SynthRequest { family: "llama".into(), ..Default::default() }).unwrap(), 3)
        .unwrap();

    // 1. No platform contract for the target.
    let r = plan(&ctx, &plan_req(&ckpt, "cpu-aarch64")).unwrap();
    assert!(!r.covered && r.platform.is_empty(), "{r:?}");
    assert!(r.gaps.iter().any(|g| g.field == "target" && g.reason.contains("cpu-aarch64")), "{:?}", r.gaps);

    // 2. The proposal: NEON, 128-bit, figures with a source each; staged, it routes provisionally.
    let proposal = fixture("platform.cpu-aarch64.toml");
    let no_sources = proposal.split("[[sources]]").next().unwrap().to_string();
    let r = propose(&ctx, &ProposeRequest { toml: no_sources }).unwrap();
    assert!(!r.staged && r.findings.iter().any(|f| f.field == "/sources"), "{r:?}");
    let r = propose(&ctx, &ProposeRequest { toml: proposal }).unwrap();
    assert!(r.staged, "{r:?}");
    let r = plan(&ctx, &plan_req(&ckpt, "cpu-aarch64")).unwrap();
    assert_eq!(
        (r.covered, r.platform.as_str(), r.provisional.clone()),
        (true, "platform.cpu-aarch64", vec!["platform.cpu-aarch64@1".into()])
    );
    assert!(r.missing_evidence[0].contains("a passing verify_generation"), "{r:?}");
    assert!(r.gaps.is_empty(), "{:?}", r.gaps);

    // 3. An engine whose metainfer.toml targets the platform passes the gates on this host.
    let engine = shared_engine_for(Engine::Plain, "model.llama", "cpu-aarch64");
    let k = kernel_test(&ctx, &kernels_req(&engine), &budget()).unwrap();
    assert!(k.passed, "{k:?}");
    let v = verify(&ctx, &verify_req(&engine, &ckpt), &budget()).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    let o = last_outcome(&ctx, "verify_generation");
    assert!(o.contracts.contains(&"platform.cpu-aarch64@1".to_string()), "{:?}", o.contracts);
    assert_eq!(o.constraints["target"], "cpu-aarch64");

    // 4. That evidence promoted the platform; plan covers the target.
    assert_eq!(v.promotions.len(), 1, "{:?}", v.promotions);
    assert!(v.promotions[0].promoted && v.promotions[0].contract == "platform.cpu-aarch64@1", "{:?}", v.promotions);
    assert!(wc.join("platforms/cpu-aarch64.toml").is_file());
    let r = plan(&ctx, &plan_req(&ckpt, "cpu-aarch64")).unwrap();
    assert!(r.covered && r.platform == "platform.cpu-aarch64" && r.provisional.is_empty(), "{r:?}");

    // profile_engine records the platform too, and says where its figures come from: on a host of
    // another architecture, from the host, with the engine's portable path timed.
    let p = profile(
        &ctx,
        &ProfileRequest {
            engine: s(&engine),
            model: s(&ckpt),
            prompt_len: Some(8),
            new_tokens: Some(8),
            runs: Some(2),
            ..Default::default()
        },
        &budget(),
    )
    .unwrap();
    assert!(p.passed, "{}", metainfer::ops::Report::text(&p));
    assert!(p.promotions.is_empty(), "already promoted: {:?}", p.promotions);
    assert!(last_outcome(&ctx, "profile_engine").contracts.contains(&"platform.cpu-aarch64@1".to_string()));
    if std::env::consts::ARCH != "aarch64" {
        assert!(
            p.figures_from.contains("portable code path") && p.figures_from.contains("aarch64"),
            "{}",
            p.figures_from
        );
    }
}

#[test]
fn fused_checkpoint_has_the_reference_logits_of_its_unfused_twin() {
    // synth draws the fused tensors as the unfused ones of the same seed, so the reference forward
    // must give the same logits on both: the split at load is exactly Phi-3's row order.
    let t = tempfile::tempdir().unwrap();
    let phi3: metainfer::ckb::Contract = toml::from_str(&fixture("model.phi3.toml")).unwrap();
    let req = SynthRequest { family: "phi3".into(), out: t.path().join("phi3"), seed: 9, ..Default::default() };
    let config = synth_config_for(&phi3, &req).unwrap();
    let features = &phi3.model.as_ref().unwrap().features;
    write_checkpoint_with(&req.out, &config, features, req.seed).unwrap();
    let mut twin = synth_config(&SynthRequest { family: "llama".into(), ..Default::default() }).unwrap();
    twin["rms_norm_eps"] = config["rms_norm_eps"].clone();
    write_checkpoint(&t.path().join("llama"), &twin, req.seed).unwrap();

    let raw = model::read_config(&req.out).unwrap();
    let cfg = model::resolve(&phi3, &raw).unwrap();
    let llama_cfg = model::load_config(&Ckb::embedded().unwrap(), &t.path().join("llama")).unwrap();
    assert_eq!((cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_norm_eps), (64, 4, 2, 16, 1e-5));
    let mut a = Reference::new(&cfg, &model::read_safetensors(&req.out).unwrap()).unwrap();
    let mut b = Reference::new(&llama_cfg, &model::read_safetensors(&t.path().join("llama")).unwrap()).unwrap();
    for i in 0..10u32 {
        let (x, y) = (a.step(i * 5 % 128).unwrap(), b.step(i * 5 % 128).unwrap());
        let d = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        assert!(d < 1e-12, "position {i}: {d}");
    }
    // Swapping the row blocks (k rows read as q rows; up as gate) changes them.
    let mut tensors = model::read_safetensors(&req.out).unwrap();
    let (shape, w) = tensors.get_mut("model.layers.0.mlp.gate_up_proj.weight").unwrap();
    let half = shape[0] / 2 * shape[1];
    w.rotate_left(half);
    let mut c = Reference::new(&cfg, &tensors).unwrap();
    a.reset();
    let d = (0..4u32).map(|i| {
        let (x, y) = (a.step(i).unwrap(), c.step(i).unwrap());
        x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max)
    });
    assert!(d.fold(0.0, f64::max) > 1e-3, "gate and up swapped must change the logits");
    // A fused tensor of the wrong height is refused, naming it.
    let mut bad = model::read_safetensors(&req.out).unwrap();
    bad.get_mut("model.layers.1.self_attn.qkv_proj.weight").unwrap().0[0] -= 16;
    let e = Reference::new(&cfg, &bad).err().unwrap();
    assert!(e.message.contains("qkv_proj"), "{}", e.message);
}

/// FNV-1a 64-bit over bytes.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[test]
fn synth_output_of_the_builtin_families_is_unchanged() {
    // FNV-1a of model.safetensors and config.json as `metainfer synth --family F --seed 7` wrote them
    // before synth learned to write families from their contracts.
    let t = tempfile::tempdir().unwrap();
    let want: [(&str, u64, u64); 5] = [
        ("llama", 0x045c_38c0_1c0d_5f99, 0x28b6_6b1a_4b8e_acc4),
        ("mistral", 0x045c_38c0_1c0d_5f99, 0x7004_1ea9_ecfb_65d5),
        ("qwen2", 0xc446_4a09_5b8d_d558, 0xdbc9_fa2c_b8e1_7e7c),
        ("qwen3", 0xe7bb_1abe_ded7_5b7f, 0x1b48_c1b5_b3fb_6fec),
        ("gemma", 0x3a94_0fd7_9ec6_4d2e, 0x1cac_2b11_8662_77e8),
    ];
    let ckb = Ckb::embedded().unwrap();
    for (family, tensors, config) in want {
        let out = t.path().join(family);
        let req = SynthRequest { family: family.into(), out: out.clone(), seed: 7, ..Default::default() };
        metainfer::ops::synth::synth_in(&ckb, &req).unwrap();
        let got = (
            fnv(&std::fs::read(out.join("model.safetensors")).unwrap()),
            fnv(&std::fs::read(out.join("config.json")).unwrap()),
        );
        assert_eq!(got, (tensors, config), "{family}");
    }
}

/// A family proposed with a wrong detail (Phi-3 with the k and v row blocks of qkv_proj exchanged)
/// and an engine written to it (the plain engine, splitting k and v the same wrong way) agree: every
/// gate passes, on transformers' own Phi-3 checkpoint too. That agreement is not evidence, so nothing
/// is promoted; a right engine fails verify under it and is told where, not to change; transformers' vectors disagree (the report names the first prompt position beyond
/// the bound) and the family stays provisional. The same family with the detail right passes the
/// same check and is promoted, its vectors' source and hash recorded as the evidence.
#[test]
fn an_engine_agreeing_with_a_wrong_family_is_no_evidence_the_vectors_decide() {
    let t = tempfile::tempdir().unwrap();
    let (ctx, wc) = working_copy_ctx(t.path());
    let right = fixture("model.phi3.toml");
    let k = r#"row_offset = "n_heads*head_dim", rows = "n_kv_heads*head_dim""#;
    let v = r#"row_offset = "n_heads*head_dim+n_kv_heads*head_dim", rows = "n_kv_heads*head_dim""#;
    assert!(right.contains(k) && right.contains(v));
    // The wrong proposal also states a bound that would pass anything.
    let wrong = right.replace(k, "K_ROWS").replace(v, k).replace("K_ROWS", v)
        + "\n[model.conformance]\natol = 1e30\nrtol = 1e30\nreasoning = \"anything goes\"\n";
    let vectors = crate::shared().join("conformance/phi3");

    // Another working copy sharing the ledger holds a passing check of the right Phi-3 at version 1:
    // that is evidence for the right text only, never for another proposal at the same version.
    let (mut other, other_wc) = working_copy_ctx(&t.path().join("other"));
    other.ledger = ctx.ledger.clone();
    assert!(propose(&other, &ProposeRequest { toml: right.clone() }).unwrap().staged);
    let c = conformance(&other, &[s(&vectors)]).unwrap();
    assert!(c.passed && c.families[0].promotions[0].promoted, "{}", Report::text(&c));
    assert!(other_wc.join("models/phi3.toml").is_file());

    let r = propose(&ctx, &ProposeRequest { toml: wrong }).unwrap();
    assert!(r.staged, "{r:?}");
    let e = promote(&ctx, "model.phi3", false).unwrap_err();
    assert!(e.message.contains("no evidence for model.phi3@1"), "{}", e.message);

    // An engine written to the wrong contract: k and v taken from each other's rows.
    let engine = t.path().join("engine");
    engine_for(Engine::Plain, &engine, "model.phi3", "cpu");
    crate::inject(
        &engine,
        "src/model.rs",
        "(split_rows(&qkv, [q_dim, kv_dim, kv_dim], h), split_rows(&gate_up, [inter, inter], h))",
        "({ let [q, k, v] = split_rows(&qkv, [q_dim, kv_dim, kv_dim], h); [q, v, k] }, split_rows(&gate_up, [inter, inter], h))",
    );
    let kt = kernel_test(&ctx, &kernels_req(&engine), &budget()).unwrap();
    assert!(kt.passed, "{}", Report::text(&kt));
    let ver = verify(&ctx, &verify_req(&engine, &vectors), &budget()).unwrap();
    assert!(ver.passed && ver.family == "model.phi3", "engine and contract agree: {}", Report::text(&ver));
    assert!(ver.promotions.len() == 1 && !ver.promotions[0].promoted, "{:?}", ver.promotions);

    // An engine that is right fails verify under the wrong staged contract: its diagnosis names
    // where the two part but advises no change to the engine (the contract may be what is wrong).
    let honest = shared_engine_for(Engine::Plain, "model.phi3", "cpu");
    assert!(kernel_test(&ctx, &kernels_req(&honest), &budget()).unwrap().passed);
    let hv = verify(&ctx, &verify_req(&honest, &vectors), &budget()).unwrap();
    assert!(!hv.passed && !hv.diagnosis.is_empty(), "{}", Report::text(&hv));
    let at_point = hv.localisation.iter().flat_map(|l| l.mutants.iter());
    for d in hv.diagnosis.iter().chain(at_point) {
        assert!(d.summary.contains("Not a fix: model.phi3 is staged without conformance evidence"), "{d:?}");
        assert!(!d.summary.contains(" Fix: "), "{d:?}");
    }

    // The vectors decide: the reference disagrees with transformers' logits (the first prompt
    // position beyond the bound is named), and nothing is promoted.
    let c = conformance(&ctx, &[s(&vectors)]).unwrap();
    let f = &c.families[0];
    assert!(f.covered && !f.passed && !c.passed, "{}", Report::text(&c));
    // Held at most as loosely as the shipped families, whatever it states.
    assert_eq!(f.bound.as_ref().map(|b| (b.atol, b.rtol)), Some((1e-4, 1e-4)));
    assert!(f.bound_from.contains("capped"), "{}", f.bound_from);
    let b = f.first_beyond.as_ref().unwrap_or_else(|| panic!("{}", Report::text(&c)));
    assert!(b.prompt == 0 && b.diff > 1e-2, "{b:?}");
    assert!(Report::text(&c).contains(&format!("first beyond the bound: prompt 0 position {}", b.position)));
    assert!(f.promotions.len() == 1 && !f.promotions[0].promoted, "{:?}", f.promotions);
    let o = last_outcome(&ctx, "ckb_conformance");
    assert!(!o.passed && o.contracts == ["model.phi3@1"], "{o:?}");
    assert_eq!(o.figures["first_beyond"], serde_json::json!([b.prompt, b.position]));
    assert!(promote(&ctx, "model.phi3", false).is_err());
    assert!(!wc.join("models/phi3.toml").exists() && ctx.candidates_dir().join("models/phi3.toml").is_file());

    // The detail right, as version 2: the same check passes and promotes it.
    let r = propose(&ctx, &ProposeRequest { toml: right.replacen("version = 1", "version = 2", 1) }).unwrap();
    assert!(r.staged, "{r:?}");
    let c = conformance(&ctx, &[s(&vectors)]).unwrap();
    assert!(c.passed, "{}", Report::text(&c));
    let p = &c.families[0].promotions;
    assert!(p.len() == 1 && p[0].promoted && p[0].contract == "model.phi3@2", "{p:?}");
    assert!(wc.join("models/phi3.toml").is_file() && !ctx.candidates_dir().join("models/phi3.toml").exists());
    let promoted = Ckb::from_dir(&wc).unwrap();
    assert_eq!(promoted.get("model.phi3").unwrap().version, 2);
}

/// Perplexity on trained weights is evidence only with consent, and only for a family that is not
/// wrong. BabyLlama (trained, LlamaForCausalLM) relabelled as an architecture no contract routes
/// (`BabyForCausalLM`), and a family for it proposed from Llama's contract:
/// - wrong (the MLP's gate and up swapped in its graph): its reference predicts the trained text
///   worse than its own mutant silu_swapped, which undoes the mistake; the check fails and nothing
///   is promoted, even with consent;
/// - right: the check passes (perplexity far below uniform, no mutant better, rope_adjacent and
///   others far worse), but without consent the family stays provisional; with it, it is promoted,
///   the outcome recorded with the consent and both figures.
#[test]
fn perplexity_on_trained_weights_promotes_only_a_family_that_is_not_wrong_and_only_with_consent() {
    use metainfer::ops::perplexity::{PerplexityRequest, check};
    let t = tempfile::tempdir().unwrap();
    let (ctx, wc) = working_copy_ctx(t.path());
    let baby = t.path().join("baby");
    std::fs::create_dir(&baby).unwrap();
    let trained = crate::shared().join("models/babyllama-105");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(trained.join(f), baby.join(f)).unwrap();
    }
    let mut config = model::read_config(trained.as_path()).unwrap();
    config.insert("architectures".into(), serde_json::json!(["BabyForCausalLM"]));
    config.insert("model_type".into(), serde_json::json!("baby"));
    std::fs::write(baby.join("config.json"), serde_json::Value::Object(config).to_string()).unwrap();
    let llama =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("contracts/models/llama.toml")).unwrap();
    let right = llama
        .replacen("id = \"model.llama\"", "id = \"model.baby\"", 1)
        .replacen("version = 3", "version = 1", 1)
        .replace("architectures = [\"LlamaForCausalLM\"]", "architectures = [\"BabyForCausalLM\"]")
        .replace("model_types = [\"llama\"]", "model_types = [\"baby\"]");
    assert!(right.contains("id = \"model.baby\"") && right.contains("[\"BabyForCausalLM\"]"), "llama.toml changed");
    let act = "op = \"silu_and_mul\"\ninputs = [\"gate\", \"up\"]";
    assert!(right.contains(act));
    let wrong = right.replace(act, "op = \"silu_and_mul\"\ninputs = [\"up\", \"gate\"]");
    let req = |consent: bool| PerplexityRequest { model: s(&baby), consent, ..Default::default() };
    // A text too short to tell a family from its mutants is refused by name.
    std::fs::write(t.path().join("short.txt"), "Lily ran.").unwrap();
    let short = PerplexityRequest { text: Some(s(&t.path().join("short.txt"))), ..req(true) };

    let r = propose(&ctx, &ProposeRequest { toml: wrong }).unwrap();
    assert!(r.staged, "{r:?}");
    let e = check(&ctx, &short).unwrap_err();
    assert!(e.message.contains("the check needs at least 32"), "{}", e.message);
    let p = check(&ctx, &req(true)).unwrap();
    assert_eq!(p.family, "model.baby@1");
    assert!(!p.passed, "{}", Report::text(&p));
    assert!(p.beaten_by.iter().any(|b| b.starts_with("silu_swapped")), "{:?}", p.beaten_by);
    assert!(p.promotion.starts_with("not promoted"), "{}", p.promotion);
    assert!(!wc.join("models/baby.toml").exists());
    assert!(promote(&ctx, "model.baby", false).is_err(), "a failed check is no evidence");

    // The right proposal (version 2: a staged contract is amended by a higher version).
    let right = right.replacen("version = 1", "version = 2", 1);
    let r = propose(&ctx, &ProposeRequest { toml: right }).unwrap();
    assert!(r.staged, "{r:?}");
    let p = check(&ctx, &req(false)).unwrap();
    assert!(p.passed && p.beaten_by.is_empty(), "{}", Report::text(&p));
    assert!(p.perplexity < 0.25 * 105.0 && p.uniform == 105.0, "{}", Report::text(&p));
    let worst = p.mutants.last().unwrap();
    assert!(worst.perplexity > 10.0 * p.perplexity, "{}", Report::text(&p));
    assert!(p.mutants.iter().any(|m| m.mutant == "rope_adjacent" && m.perplexity > 5.0 * p.perplexity));
    assert!(p.promotion.contains("--consent"), "{}", p.promotion);
    assert!(!wc.join("models/baby.toml").exists(), "not promoted without consent");
    assert!(promote(&ctx, "model.baby", false).is_err(), "a check without consent is no evidence");
    let p = check(&ctx, &req(true)).unwrap();
    assert!(p.passed, "{}", Report::text(&p));
    assert!(wc.join("models/baby.toml").is_file(), "{}", p.promotion);
    let o = last_outcome(&ctx, "ckb_perplexity");
    assert!(o.passed && o.contracts == ["model.baby@2"], "{o:?}");
    assert_eq!(o.figures["consent"], serde_json::json!(true));
    assert_eq!(o.figures["tokens"].as_u64(), Some(p.tokens as u64));
    assert!((o.figures["perplexity"].as_f64().unwrap() - p.perplexity).abs() < 1e-12);
}

/// Vectors that carry transformers' hidden states (`output_hidden_states`, as
/// scripts/conformance-vectors.py writes them) let a failed check name the layer where the family
/// first departs. The Llama conformance checkpoint relabelled `BabyForCausalLM`, its vectors given
/// hidden states from model.llama's own reference (which equals transformers' logits there within
/// 6e-6: the stand-in for transformers' hidden states), and a proposal for it that is Llama but for
/// a 2-position window on layer 2 only: the report names position 2 (the first position a window of
/// 2 hides) and layer 2's output, and the layers before it agree.
#[test]
fn hidden_states_in_the_vectors_name_the_layer_where_a_wrong_family_departs() {
    let t = tempfile::tempdir().unwrap();
    let (ctx, _wc) = working_copy_ctx(t.path());
    let original = crate::shared().join("conformance/llama");
    let dir = t.path().join("baby");
    std::fs::create_dir(&dir).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(original.join(f), dir.join(f)).unwrap();
    }
    let theirs = model::read_config(original.as_path()).unwrap();
    let mut config = theirs.clone();
    config.insert("architectures".into(), serde_json::json!(["BabyForCausalLM"]));
    config.insert("model_type".into(), serde_json::json!("baby"));
    std::fs::write(dir.join("config.json"), serde_json::Value::Object(config).to_string()).unwrap();
    // Hidden states [layers + 1][positions][hidden]: the embedding, each layer's output but the
    // last's, and the last's after the final norm (transformers' output_hidden_states).
    let ckb = Ckb::embedded().unwrap();
    let llama = ckb.get("model.llama").unwrap().model.clone().unwrap();
    let cfg = model::resolve(ckb.get("model.llama").unwrap(), &theirs).unwrap();
    let tensors = model::read_safetensors(original.as_path()).unwrap();
    let mut r = Reference::of_family(&llama, &cfg, tensors, "f32").unwrap();
    let mut vectors: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(original.join("vectors.json")).unwrap()).unwrap();
    let last = &llama.graph.as_ref().unwrap().layer.last().unwrap().name;
    for p in vectors["prompts"].as_array_mut().unwrap() {
        let ids: Vec<u32> = p["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let mut hs = vec![Vec::new(); cfg.n_layers + 1];
        r.reset();
        for &id in &ids {
            let (_, trace) = r.step_traced(id).unwrap();
            let at = |name: &str| trace.iter().find(|(n, _)| n == name).unwrap().1.clone();
            hs[0].push(at("embed"));
            for (i, h) in hs.iter_mut().enumerate().skip(1).take(cfg.n_layers - 1) {
                h.push(at(&format!("layers.{}.{last}", i - 1)));
            }
            hs[cfg.n_layers].push(at("final_norm"));
        }
        p["hidden_states"] = serde_json::json!(hs);
    }
    std::fs::write(dir.join("vectors.json"), vectors.to_string()).unwrap();

    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("contracts/models/llama.toml"))
        .unwrap()
        .replacen("id = \"model.llama\"", "id = \"model.baby\"", 1)
        .replacen("version = 3", "version = 1", 1)
        .replace("architectures = [\"LlamaForCausalLM\"]", "architectures = [\"BabyForCausalLM\"]")
        .replace("model_types = [\"llama\"]", "model_types = [\"baby\"]");
    let attn = "op = \"attention\"\ninputs = [\"q_rope\", \"k_rope\", \"v\"]\n";
    assert!(text.contains(attn));
    let wrong = text.replace(attn, &format!("{attn}params = {{ window = \"if(layer == 2, 2, 0)\" }}\n"));
    assert!(propose(&ctx, &ProposeRequest { toml: wrong }).unwrap().staged);
    let c = conformance(&ctx, &[s(&dir)]).unwrap();
    let f = &c.families[0];
    assert!(f.covered && !f.passed, "{}", Report::text(&c));
    let b = f.first_beyond.as_ref().unwrap();
    assert_eq!((b.prompt, b.layer, b.point.as_deref()), (0, Some(2), Some("position 2: layer 2 output")), "{b:?}");
    assert!(Report::text(&c).contains("hidden states first depart at position 2: layer 2 output"));

    // Hidden states of another shape are refused by name.
    vectors["prompts"][0]["hidden_states"].as_array_mut().unwrap().pop();
    std::fs::write(dir.join("vectors.json"), vectors.to_string()).unwrap();
    let e = conformance(&ctx, &[s(&dir)]).unwrap_err();
    assert!(e.message.contains("hidden_states must be [n_layers + 1 = 5]"), "{}", e.message);
}
