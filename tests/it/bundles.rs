//! Gates split at the harness (build and draw here, run where the device is, compare here), shown
//! on the CPU with the plain example engine: a bundle written by a gate, run by `metainfer bundle
//! run` in another process, and read back gives the verdict of a direct run with the same seed; a
//! bundle altered or incomplete is refused or fails for that reason.

use std::path::Path;

use metainfer::error::ErrorKind;
use metainfer::ops::kernel_test::{KernelTestReport, KernelTestRequest, kernel_test};
use metainfer::ops::profile::{ProfileRequest, profile};
use metainfer::ops::verify::{VerifyRequest, verify};

use crate::Engine;
use crate::{budget, s};

pub(crate) fn kt(engine: &Path, seed: u64, write: Option<&Path>, read: Option<&Path>) -> KernelTestRequest {
    KernelTestRequest {
        engine: s(engine),
        kernels: vec![],
        seed: Some(seed),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..Default::default()
    }
}

/// `metainfer bundle run DIR` in its own process, as on the device machine; its exit status.
pub(crate) fn run_bundle(dir: &Path) -> std::process::Output {
    run_bundle_with(dir, None)
}

/// `metainfer bundle run DIR [--key KEY]` in its own process.
pub(crate) fn run_bundle_with(dir: &Path, key: Option<&Path>) -> std::process::Output {
    let mut cmd = std::process::Command::new(crate::bin());
    cmd.args(["bundle", "run"]).arg(dir).arg("--json").env("METAINFER_LEDGER", dir.join("not-used.sqlite"));
    if let Some(k) = key {
        cmd.arg("--key").arg(k);
    }
    cmd.output().unwrap()
}

/// A runner key pair in `dir` (`metainfer bundle keygen`), trusted by `ctx`'s ledger under `name`
/// (`metainfer bundle trust`); the secret key's path.
pub(crate) fn trusted_runner(ctx: &metainfer::ops::Ctx, dir: &Path, name: &str) -> std::path::PathBuf {
    let out = std::process::Command::new(crate::bin()).args(["bundle", "keygen", "--out"]).arg(dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = std::process::Command::new(crate::bin())
        .args(["bundle", "trust"])
        .arg(dir.join("runner.pub"))
        .args(["--name", name])
        .env("METAINFER_LEDGER", &ctx.ledger)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir.join("runner.key")
}

/// The one file of `dir` whose name starts with `prefix` and ends with `suffix` (an output file,
/// whose name carries the bundle's nonce between them).
pub(crate) fn the_file(dir: &Path, prefix: &str, suffix: &str) -> std::path::PathBuf {
    let found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(prefix) && n.ends_with(suffix)
        })
        .collect();
    assert_eq!(found.len(), 1, "{prefix}*{suffix} in {}: {found:?}", dir.display());
    found[0].clone()
}

fn errors(r: &KernelTestReport) -> Vec<(String, bool, u64)> {
    r.kernels.iter().map(|k| (k.kernel.clone(), k.passed, k.max_abs_err.to_bits())).collect()
}

/// The whole split on the plain engine: kernel tests, verify and profile each written as a bundle,
/// run in another process by a trusted runner (its key signs each run), read back and recorded as
/// evidence; the kernel verdicts equal a direct run's with the same seed, error for error (the CPU
/// kernels are deterministic).
#[test]
fn a_bundle_run_elsewhere_gives_the_direct_verdict() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("engine");
    Engine::Plain.copy_to(&engine);
    let seed = 4242;
    let key = trusted_runner(&ctx, &t.path().join("runner"), "test-runner");
    let run_bundle = |dir: &Path| run_bundle_with(dir, Some(&key));

    let direct = kernel_test(&ctx, &kt(&engine, seed, None, None), &budget()).unwrap();
    assert!(direct.passed, "{direct:?}");

    let dir = t.path().join("kt-bundle");
    let written = kernel_test(&ctx, &kt(&engine, seed, Some(&dir), None), &budget()).unwrap();
    assert!(
        !written.passed && written.build_error.starts_with("not run: bundle written to"),
        "{}",
        written.build_error
    );
    assert!(dir.join("bundle.json").is_file() && dir.join("harness").is_file());
    // Reading it back before it ran is a usage error that says how to run it.
    let e = kernel_test(&ctx, &kt(&engine, seed, None, Some(&dir)), &budget()).unwrap_err();
    assert!(e.kind == ErrorKind::Usage && e.message.contains("has not been run"), "{}", e.message);
    // Expected values never enter a bundle: its files are the harness, requests and inputs.
    for f in std::fs::read_dir(&dir).unwrap() {
        let name = f.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            name == "bundle.json"
                || name == "harness"
                || name.starts_with("request.")
                || name.ends_with(".in.safetensors"),
            "unexpected file {name} in a written bundle"
        );
    }

    let out = run_bundle(&dir);
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let ran: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ran["tool"], "run_kernel_test");
    assert_eq!(ran["runs"][0]["reply"], "kernel");

    assert!(dir.join("attestation.json").is_file());
    let read = kernel_test(&ctx, &kt(&engine, seed, None, Some(&dir)), &budget()).unwrap();
    assert!(read.passed, "{read:?}");
    assert_eq!(read.attestation, "bundle run attested by trusted runner test-runner");
    assert_eq!(read.seed, seed);
    assert_eq!(errors(&read), errors(&direct));
    crate::assert_conforms(&read);
    // A seed other than the bundle's is refused.
    let e = kernel_test(&ctx, &kt(&engine, seed + 1, None, Some(&dir)), &budget()).unwrap_err();
    assert!(e.message.contains("seed"), "{}", e.message);

    // verify_generation and profile_engine through bundles (BabyLlama is small: copied in).
    let vdir = t.path().join("verify-bundle");
    let vreq = |write: Option<&Path>, read: Option<&Path>| VerifyRequest {
        engine: s(&engine),
        model: s(&crate::babyllama()),
        prompts: vec![],
        max_new_tokens: Some(8),
        seed: Some(7),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..Default::default()
    };
    let v = verify(&ctx, &vreq(Some(&vdir), None), &budget()).unwrap();
    assert!(!v.passed && v.error.contains("model included"), "{}", v.error);
    let text = metainfer::ops::Report::text(&v);
    assert!(text.starts_with("verify FAILED: not run"), "{text}");
    assert!(vdir.join("model/model.safetensors").is_file());
    let out = run_bundle(&vdir);
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v = verify(&ctx, &vreq(None, Some(&vdir)), &budget()).unwrap();
    assert!(v.passed, "{}", metainfer::ops::Report::text(&v));
    assert_eq!(v.prompts.len(), 4);
    // The real vocabularies of BabyLlama's tokenizer contract ran from the bundle's own copies.
    assert!(vdir.join("vocab.0/tokenizer.json").is_file());
    assert!(
        !v.tokenizer_vectors.is_empty()
            && v.tokenizer_vectors.iter().all(|r| r.error.is_empty() && r.encode_ok == r.texts)
    );

    let pdir = t.path().join("profile-bundle");
    let preq = |write: Option<&Path>, read: Option<&Path>| ProfileRequest {
        engine: s(&engine),
        model: s(&crate::babyllama()),
        prompt_len: Some(8),
        new_tokens: Some(8),
        runs: Some(2),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..Default::default()
    };
    let p = profile(&ctx, &preq(Some(&pdir), None), &budget()).unwrap();
    assert!(!p.passed && p.error.starts_with("not run: bundle written"), "{}", p.error);
    let ran = run_bundle(&pdir);
    assert!(ran.status.success(), "{}", String::from_utf8_lossy(&ran.stdout));
    let p = profile(&ctx, &preq(None, Some(&pdir)), &budget()).unwrap();
    assert!(p.passed && p.verified && p.outputs_ok && p.runs_checked == 2, "{}", metainfer::ops::Report::text(&p));
    assert!(p.decode_tok_s.median > 0.0 && !p.kernels.is_empty());
    crate::assert_conforms(&p);

    // Each read-back outcome is recorded with its bundle and its runner; writing one records nothing.
    assert!(
        metainfer::ledger::Ledger::open(&ctx.ledger)
            .unwrap()
            .list(0, 20)
            .unwrap()
            .iter()
            .filter(|o| o.figures.get("bundle").is_some())
            .all(|o| o.figures["attestation"] == "runner test-runner")
    );
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let outcomes = ledger.list(0, 20).unwrap();
    let with_bundle: Vec<(String, String)> = outcomes
        .iter()
        .filter_map(|o| o.figures.get("bundle").and_then(|b| b.as_str()).map(|b| (o.tool.clone(), b.to_string())))
        .collect();
    assert_eq!(
        with_bundle,
        vec![
            ("profile_engine".to_string(), s(&pdir.canonicalize().unwrap())),
            ("verify_generation".to_string(), s(&vdir.canonicalize().unwrap())),
            ("run_kernel_test".to_string(), s(&dir.canonicalize().unwrap())),
        ]
    );
    assert_eq!(outcomes.iter().filter(|o| o.tool == "run_kernel_test").count(), 2, "the direct run and the read-back");

    // Changed sources: the bundle no longer speaks for them.
    std::fs::write(engine.join("src/extra.rs"), "// a change\n").unwrap();
    let e = kernel_test(&ctx, &kt(&engine, seed, None, Some(&dir)), &budget()).unwrap_err();
    assert!(e.message.contains("sources changed since the bundle was written"), "{}", e.message);
}

/// A broken engine fails through a bundle for the stated reason: RMSNorm with eps outside the
/// square root, diagnosed by its mutant after the bundle ran in another process.
#[test]
fn a_broken_engine_fails_through_a_bundle_with_its_diagnosis() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("engine");
    Engine::Plain.copy_to(&engine);
    crate::replace_body(
        &engine,
        "src/kernels.rs",
        "pub fn rms_norm(",
        "let dim = weight.len();
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let inv = 1.0 / (ms.sqrt() + eps);
            for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
                *o = v * inv * w;
            }
        }",
    );
    let dir = t.path().join("bundle");
    let req = |write: Option<&Path>, read: Option<&Path>| KernelTestRequest {
        engine: s(&engine),
        kernels: vec!["kernel.rms_norm".into()],
        seed: Some(11),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..Default::default()
    };
    kernel_test(&ctx, &req(Some(&dir), None), &budget()).unwrap();
    assert!(run_bundle(&dir).status.success());
    let r = kernel_test(&ctx, &req(None, Some(&dir)), &budget()).unwrap();
    let k = &r.kernels[0];
    assert!(!r.passed && !k.passed && k.error.contains("outside tolerance"), "{r:?}");
    assert!(k.diagnosis.iter().any(|d| d.failure == "failure.rmsnorm-eps-outside-sqrt"), "{:?}", k.diagnosis);
}

/// What is read back must be what was written and run: a bundle not yet run, a changed input, an
/// altered request or a linked-in file are refused (usage errors saying what to do); an output
/// removed or altered after the run fails the gate for that reason.
#[test]
fn a_tampered_or_incomplete_bundle_is_refused_or_fails() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = Engine::Plain.shared_copy();
    let dir = t.path().join("bundle");
    let req = |write: Option<&Path>, read: Option<&Path>| KernelTestRequest {
        engine: s(&engine),
        kernels: vec!["kernel.rms_norm".into()],
        seed: Some(3),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..Default::default()
    };
    // Read back through the bundle directory's handle, and named by its path in every message.
    let read = || {
        let r = kernel_test(&ctx, &req(None, Some(&dir)), &budget());
        let said = match &r {
            Ok(report) => format!("{report:?}"),
            Err(e) => e.message.clone(),
        };
        assert!(!said.contains("/proc/self/fd"), "{said}");
        r
    };
    kernel_test(&ctx, &req(Some(&dir), None), &budget()).unwrap();
    // Writing into a directory that is not empty is refused; nothing in it is touched.
    let e = kernel_test(&ctx, &req(Some(&dir), None), &budget()).unwrap_err();
    assert!(e.kind == ErrorKind::Usage && e.message.contains("not empty"), "{}", e.message);

    // Not run yet.
    let e = read().unwrap_err();
    assert!(e.kind == ErrorKind::Usage && e.message.contains("has not been run"), "{}", e.message);
    assert!(e.message.contains(&format!("bundle {} has not been run", dir.display())), "{}", e.message);

    // An input changed after writing: `bundle run` refuses it, and so does the read-back.
    let input = dir.join("case0.in.safetensors");
    let original = std::fs::read(&input).unwrap();
    let mut changed = original.clone();
    let n = changed.len();
    changed[n - 1] ^= 0x40;
    std::fs::write(&input, &changed).unwrap();
    let out = run_bundle(&dir);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("differs from the one the bundle was written with"));
    std::fs::write(&input, &original).unwrap();

    let out = run_bundle(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let clean = read().unwrap();
    assert!(clean.passed, "{clean:?}");

    // The input changed after the run: the engine did not see what the seed draws.
    std::fs::write(&input, &changed).unwrap();
    let e = read().unwrap_err();
    assert!(e.kind == ErrorKind::Usage && e.message.contains("case0.in.safetensors"), "{}", e.message);
    std::fs::write(&input, &original).unwrap();

    // A request that is not what the gate sends (another kernel's case in its place).
    let request = dir.join("request.0.json");
    let text = std::fs::read_to_string(&request).unwrap();
    std::fs::write(&request, text.replace("kernel.rms_norm", "kernel.softmax")).unwrap();
    let e = read().unwrap_err();
    assert!(
        e.kind == ErrorKind::Usage && e.message.contains("request.0.json is not what this call sends"),
        "{}",
        e.message
    );
    std::fs::write(&request, text).unwrap();

    // A reply or output replaced by a link to a file elsewhere.
    let output = the_file(&dir, "case0.", ".out.safetensors");
    let kept = std::fs::read(&output).unwrap();
    std::fs::remove_file(&output).unwrap();
    std::os::unix::fs::symlink(t.path().join("elsewhere"), &output).unwrap();
    let e = read().unwrap_err();
    assert!(e.kind == ErrorKind::Usage && e.message.contains("symbolic link"), "{}", e.message);
    std::fs::remove_file(&output).unwrap();
    // The manifest itself a link to a file elsewhere: refused before it is read.
    let manifest = dir.join("bundle.json");
    let kept_manifest = std::fs::read(&manifest).unwrap();
    let elsewhere = t.path().join("elsewhere.json");
    std::fs::write(&elsewhere, &kept_manifest).unwrap();
    std::fs::remove_file(&manifest).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &manifest).unwrap();
    let e = read().unwrap_err();
    assert!(e.message.contains("bundle.json is a symbolic link"), "{}", e.message);
    std::fs::remove_file(&manifest).unwrap();
    std::fs::write(&manifest, &kept_manifest).unwrap();

    // An output removed: that case has no output, and the kernel fails for it.
    let r = read().unwrap();
    let k = &r.kernels[0];
    assert!(!r.passed && !k.passed && k.error.contains("no output for"), "{r:?}");

    // An output altered (its last f32 word, the end of the tensor data, set to 1e6): the values are
    // judged, and fail.
    let mut altered = kept.clone();
    let n = altered.len();
    altered[n - 4..].copy_from_slice(&1.0e6f32.to_le_bytes());
    std::fs::write(&output, &altered).unwrap();
    let r = read().unwrap();
    let k = &r.kernels[0];
    assert!(!r.passed && !k.passed && k.error.contains("outside tolerance"), "{r:?}");

    // Restored, it passes again: the refusals above were for the tampering.
    std::fs::write(&output, &kept).unwrap();
    assert!(read().unwrap().passed);
}

/// Regression (a forged verdict): outputs, reply and run record of a correct engine's bundle copied
/// into a broken engine's bundle of the same seed read back as an authenticated "PASSED" for the
/// broken engine, and phase order accepted the row. Now a plain copy is not found (every output's
/// name carries its bundle's nonce); a copy renamed to the other nonce passes the comparison but is
/// recorded `unattested`, and neither phase order nor promotion counts it; and a run a trusted runner
/// signed refuses any file changed after the signature.
#[test]
fn outputs_copied_from_another_bundle_are_not_evidence() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let bad = t.path().join("bad");
    let good = Engine::Plain.shared_copy();
    Engine::Plain.copy_to(&bad);
    // The broken engine: eps outside the square root (failure.rmsnorm-eps-outside-sqrt).
    crate::replace_body(
        &bad,
        "src/kernels.rs",
        "pub fn rms_norm(",
        "let dim = weight.len();
        for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let inv = 1.0 / (ms.sqrt() + eps);
            for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
                *o = v * inv * w;
            }
        }",
    );
    let req = |engine: &Path, write: Option<&Path>, read: Option<&Path>| KernelTestRequest {
        engine: s(engine),
        kernels: vec!["kernel.rms_norm".into()],
        seed: Some(5),
        write_bundle: write.map(s),
        from_bundle: read.map(s),
        ..Default::default()
    };
    let (gdir, bdir) = (t.path().join("good-bundle"), t.path().join("bad-bundle"));
    kernel_test(&ctx, &req(&good, Some(&gdir), None), &budget()).unwrap();
    kernel_test(&ctx, &req(&bad, Some(&bdir), None), &budget()).unwrap();
    assert!(run_bundle(&gdir).status.success());
    // The honest verdict of the broken engine, for comparison: it fails.
    let honest = t.path().join("bad-honest");
    copy_dir(&bdir, &honest);
    assert!(run_bundle(&honest).status.success());
    assert!(!kernel_test(&ctx, &req(&bad, None, Some(&honest)), &budget()).unwrap().passed);

    // 1. The good run's outputs, reply and run record copied as they are: not this bundle's files.
    for f in ["reply.0.json", "run.0.json"] {
        std::fs::copy(gdir.join(f), bdir.join(f)).unwrap();
    }
    let outputs: Vec<std::path::PathBuf> = std::fs::read_dir(&gdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".out.safetensors"))
        .collect();
    assert!(!outputs.is_empty());
    for o in &outputs {
        std::fs::copy(o, bdir.join(o.file_name().unwrap())).unwrap();
    }
    let r = kernel_test(&ctx, &req(&bad, None, Some(&bdir)), &budget()).unwrap();
    assert!(!r.passed && r.kernels[0].error.contains("no output for"), "{r:?}");

    // 2. Renamed to this bundle's nonce: the comparison passes, but the verdict is unattested.
    let nonce = |dir: &Path| -> String {
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("bundle.json")).unwrap()).unwrap();
        m["nonce"].as_str().unwrap().to_string()
    };
    for o in &outputs {
        let name = o.file_name().unwrap().to_string_lossy().into_owned();
        std::fs::rename(bdir.join(&name), bdir.join(name.replace(&nonce(&gdir), &nonce(&bdir)))).unwrap();
    }
    let good_out = the_file(&gdir, "case0.", ".out.safetensors");
    let r = kernel_test(&ctx, &req(&bad, None, Some(&bdir)), &budget()).unwrap();
    assert!(r.passed, "the forged outputs are the good engine's: {r:?}");
    assert!(r.attestation.starts_with("unattested: no attestation.json"), "{}", r.attestation);
    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let bad_hash = metainfer::harness::source_hash(&bad).unwrap();
    assert!(
        !ledger.passed_on("run_kernel_test", &bad_hash, "f32").unwrap(),
        "phase order must not accept an unattested row"
    );
    // verify_generation then refuses for phase order, not for the logits.
    let v = verify(
        &ctx,
        &VerifyRequest {
            engine: s(&bad),
            model: s(&crate::babyllama()),
            prompts: vec![],
            max_new_tokens: Some(2),
            seed: Some(1),
            ..Default::default()
        },
        &budget(),
    )
    .unwrap();
    assert!(!v.passed, "{}", metainfer::ops::Report::text(&v));

    // 3. A run a trusted runner signed: the honest bundle's files, then the forgery over them.
    let key = trusted_runner(&ctx, &t.path().join("runner"), "device");
    let signed = t.path().join("bad-signed");
    kernel_test(&ctx, &req(&bad, Some(&signed), None), &budget()).unwrap();
    assert!(run_bundle_with(&signed, Some(&key)).status.success());
    let r = kernel_test(&ctx, &req(&bad, None, Some(&signed)), &budget()).unwrap();
    assert!(!r.passed && r.attestation == "bundle run attested by trusted runner device", "{r:?}");
    let out = the_file(&signed, "case0.", ".out.safetensors");
    std::fs::write(&out, std::fs::read(&good_out).unwrap()).unwrap();
    let e = kernel_test(&ctx, &req(&bad, None, Some(&signed)), &budget()).unwrap_err();
    assert!(e.message.contains("changed after runner device signed the run"), "{}", e.message);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(to.join("harness"), std::fs::Permissions::from_mode(0o755)).unwrap();
}
