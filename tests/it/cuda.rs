//! Target `cuda` on a machine without a GPU: plan and scaffold route a family to the CUDA kernels
//! and signatures of a named platform contract; the CUDA example engine builds (cudarc loads the
//! driver at run time), keeps its contracts' signatures, and every gate says "no CUDA device: not
//! run" and fails, directly and through a bundle. Its fused kernels are checked on a CPU model of
//! the GPU (scripts/cuda-sim-check.sh).

use std::path::PathBuf;

use metainfer::ops::batching::{BatchingRequest, verify_batching};
use metainfer::ops::compile::{CompileRequest, compile};
use metainfer::ops::kernel_test::kernel_test;
use metainfer::ops::plan::{PlanRequest, plan_only};
use metainfer::ops::scaffold::{ScaffoldRequest, scaffold};
use metainfer::ops::verify::{VerifyRequest, verify};

use crate::Engine;
use crate::bundles::{kt, run_bundle};
use crate::{budget, s};

fn plan_req(platform: Option<&str>) -> PlanRequest {
    PlanRequest {
        model: s(&crate::babyllama()),
        target: "cuda".into(),
        dtype: "bf16".into(),
        platform: platform.map(str::to_string),
        ..Default::default()
    }
}

/// plan_engine: `cuda` has two platform contracts, so one must be named; a platform of another
/// target is refused; named, the plan routes Llama to the CUDA kernels plus the platform's own
/// components. scaffold_engine writes the CUDA signatures (device views, the device handle), a
/// cudarc dependency with dynamic loading, and the platform into metainfer.toml; the scaffold
/// compiles here, keeps the rules, and its kernel test does not run without a device.
#[test]
fn plan_and_scaffold_take_target_cuda_and_a_platform() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());

    let r = plan_only(&ctx, &plan_req(None)).unwrap();
    assert!(!r.covered, "{r:?}");
    assert_eq!(r.gaps.len(), 1, "{:?}", r.gaps);
    assert_eq!(r.gaps[0].field, "platform");
    assert!(r.gaps[0].reason.contains("platform.cuda-sm80") && r.gaps[0].reason.contains("platform.cuda-sm90"));

    let r = plan_only(&ctx, &plan_req(Some("platform.cpu-x86_64"))).unwrap();
    assert!(!r.covered && r.gaps.iter().any(|g| g.reason.contains("not `cuda`")), "{:?}", r.gaps);

    let r = plan_only(&ctx, &plan_req(Some("platform.cuda-sm90"))).unwrap();
    assert!(r.covered, "{:?}", r.gaps);
    assert_eq!(r.platform, "platform.cuda-sm90");
    let ids: Vec<&str> = r.phases.iter().flat_map(|p| p.contracts.iter().map(String::as_str)).collect();
    for want in ["kernel.linear_bf16", "kernel.argmax", "component.cuda_device", "component.device_decode"] {
        assert!(ids.contains(&want), "{want} not in {ids:?}");
    }
    assert!(!ids.contains(&"kernel.linear"), "bf16 weights take the bf16 variant: {ids:?}");

    let engine = t.path().join("cuda-engine");
    let req = ScaffoldRequest {
        model: s(&crate::babyllama()),
        out: s(&engine),
        target: "cuda".into(),
        dtype: "bf16".into(),
        platform: Some("platform.cuda-sm90".into()),
        name: Some("bare-cuda".into()),
        force: false,
        reference_level: Default::default(),
        ..Default::default()
    };
    let sc = scaffold(&ctx, &req).unwrap();
    assert!(sc.files.contains(&"src/device.rs".to_string()), "{:?}", sc.files);
    assert!(sc.next.contains("write_bundle") && sc.next.contains("metainfer bundle run DIR"), "{}", sc.next);
    let cargo = std::fs::read_to_string(engine.join("Cargo.toml")).unwrap();
    assert!(cargo.contains("cudarc = ") && cargo.contains("\"dynamic-loading\""), "{cargo}");
    let manifest = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    assert!(manifest.contains("target = \"cuda\"") && manifest.contains("platform = \"platform.cuda-sm90\""));
    // The CUDA signature of contracts/kernels/rms_norm.toml ([cuda] skeleton), not the host one.
    let kernels = std::fs::read_to_string(engine.join("src/kernels.rs")).unwrap();
    assert!(
        kernels.contains(
            "pub fn rms_norm(dev: &Device, x: &CudaView<'_, f32>, weight: &CudaView<'_, f32>, eps: f32, out: &mut CudaViewMut<'_, f32>) -> Result<(), String>"
        ),
        "{kernels}"
    );

    let c = compile(&ctx, &CompileRequest { engine: s(&engine), ..Default::default() }, &budget()).unwrap();
    assert!(c.passed, "the CUDA scaffold must compile without a toolkit: {c:?}");
    let rules = metainfer::ops::rules::check_rules(
        &ctx,
        &metainfer::ops::rules::RulesRequest { engine: s(&engine) },
        &budget(),
    )
    .unwrap();
    assert!(rules.passed, "{}", metainfer::ops::Report::text(&rules));
    let k = kernel_test(&ctx, &kt(&engine, 9, None, None), &budget()).unwrap();
    assert!(!k.passed && k.build_error.starts_with("no CUDA device: not run"), "{}", k.build_error);
}

/// The CUDA example engine, here, without a GPU: it builds (cudarc loads the driver at run time),
/// keeps every signature of its contracts (the serving ones included), and each gate says "no CUDA
/// device: not run" and fails;
/// `bundle run` of its bundle says the same.
#[test]
fn the_cuda_engine_builds_here_and_its_gates_do_not_run_without_a_device() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine: PathBuf = Engine::Cuda.dir();

    let rules = metainfer::ops::rules::check_rules(
        &ctx,
        &metainfer::ops::rules::RulesRequest { engine: s(&engine) },
        &budget(),
    )
    .unwrap();
    assert!(rules.passed && rules.findings.is_empty(), "{}", metainfer::ops::Report::text(&rules));

    let k = kernel_test(&ctx, &kt(&engine, 5, None, None), &budget()).unwrap();
    assert!(!k.passed, "{k:?}");
    assert!(k.build_error.starts_with("no CUDA device: not run"), "{}", k.build_error);
    // Nothing ran and nothing failed to build; the way to run it is named.
    let text = metainfer::ops::Report::text(&k);
    assert!(text.starts_with("kernel tests NOT RUN") && !text.contains("harness build failed"), "{text}");
    assert!(text.contains("--write-bundle DIR") && text.contains("metainfer bundle run DIR"), "{text}");
    // The family's 8 kernels, and the serving ones its `[serving]` constraints add: paged attention
    // and sampling (on the host, as its [cuda] section says).
    assert_eq!(k.kernels.len(), 10);
    for id in ["kernel.paged_attention", "kernel.sample"] {
        assert!(k.kernels.iter().any(|r| r.kernel == id), "{id} not tested: {k:?}");
    }
    assert!(k.kernels.iter().all(|r| !r.passed && r.error.starts_with("no CUDA device: not run")), "{k:?}");
    crate::assert_conforms(&k);

    let v = verify(
        &ctx,
        &VerifyRequest {
            engine: s(&engine),
            model: s(&crate::babyllama()),
            prompts: vec![],
            max_new_tokens: Some(4),
            ..Default::default()
        },
        &budget(),
    )
    .unwrap();
    assert!(!v.passed && v.error.starts_with("no CUDA device: not run"), "{}", v.error);

    // verify_batching: the harness with the serving commands builds against the engine's batched
    // step, block manager and scheduler, and the batched run does not happen without a device.
    let b = verify_batching(
        &ctx,
        &BatchingRequest { engine: s(&engine), model: s(&crate::babyllama()), ..Default::default() },
        &budget(),
    )
    .unwrap();
    assert!(!b.passed && b.error.starts_with("no CUDA device: not run"), "{}", b.error);

    let ledger = metainfer::ledger::Ledger::open(&ctx.ledger).unwrap();
    let recorded = ledger.list(0, 6).unwrap();
    assert!(recorded.iter().filter(|o| o.tool != "check_rules").all(|o| !o.passed && o.figures["no_device"] == true));

    // Its bundle, run on a machine without a device, replies no_device and does not pass.
    // Written from the CLI: what was asked for, so exit 0; a kernel test reads no model, so the
    // `bundle run` it names takes none.
    let dir = t.path().join("cuda-bundle");
    let written = std::process::Command::new(crate::bin())
        .args(["test-kernel", "--engine", &s(&engine), "--seed", "5", "--write-bundle", &s(&dir)])
        .env("METAINFER_LEDGER", &ctx.ledger)
        .env("METAINFER_CACHE", crate::cache())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&written.stdout);
    assert_eq!(written.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&written.stderr));
    assert!(text.starts_with("kernel tests NOT RUN") && text.contains("not run: bundle written to"), "{text}");
    assert!(text.contains(&format!("`metainfer bundle run {}` on the machine", dir.display())), "{text}");
    let out = run_bundle(&dir);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let ran: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ran["runs"][0]["reply"], "no_device");
    let read = kernel_test(&ctx, &kt(&engine, 5, None, Some(&dir)), &budget()).unwrap();
    assert!(!read.passed && read.build_error.starts_with("no CUDA device: not run"), "{}", read.build_error);
}

/// The CUDA example engine declared for `model.qwen3_moe` (as an agent adding Qwen3-MoE to it
/// would), here, without a GPU: its sources keep every signature of that family's plan for target
/// cuda (kernel.moe_route and kernel.moe_experts included, with their CUDA signatures), the kernel
/// test's harness builds with the MoE kernels' CUDA arms, and the kernel test, verify and
/// verify_batching (its batched step takes expert models) on transformers' Qwen3-MoE checkpoint say
/// "no CUDA device: not run" and fail.
#[test]
fn the_cuda_engine_declared_for_qwen3_moe_keeps_its_signatures_and_does_not_run_without_a_device() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let model = crate::shared().join("conformance/qwen3_moe");
    let engine = crate::shared_engine("llama-cuda-bf16-qwen3-moe", |dir| {
        Engine::Cuda.copy_to(dir);
        let manifest = std::fs::read_to_string(dir.join("metainfer.toml")).unwrap();
        let declared = manifest.replace("family = \"model.llama\"", "family = \"model.qwen3_moe\"");
        assert_ne!(declared, manifest);
        std::fs::write(dir.join("metainfer.toml"), declared).unwrap();
    });

    let rules = metainfer::ops::rules::check_rules(
        &ctx,
        &metainfer::ops::rules::RulesRequest { engine: s(&engine) },
        &budget(),
    )
    .unwrap();
    assert!(rules.passed && rules.findings.is_empty(), "{}", metainfer::ops::Report::text(&rules));

    let k = kernel_test(&ctx, &kt(&engine, 5, None, None), &budget()).unwrap();
    assert!(!k.passed && k.build_error.starts_with("no CUDA device: not run"), "{}", k.build_error);
    for id in ["kernel.moe_route", "kernel.moe_experts", "kernel.paged_attention"] {
        assert!(k.kernels.iter().any(|r| r.kernel == id), "{id} not in the kernel test: {k:?}");
    }

    let v = verify(
        &ctx,
        &VerifyRequest { engine: s(&engine), model: s(&model), max_new_tokens: Some(4), ..Default::default() },
        &budget(),
    )
    .unwrap();
    assert!(!v.passed && v.error.starts_with("no CUDA device: not run"), "{}", v.error);

    let b = verify_batching(
        &ctx,
        &BatchingRequest { engine: s(&engine), model: s(&model), ..Default::default() },
        &budget(),
    )
    .unwrap();
    assert!(!b.passed && b.error.starts_with("no CUDA device: not run"), "{}", b.error);
}

/// `scripts/device-check.sh run` keeps to its time budget (`BUDGET_S`), so one device call returns
/// what it measured: a bundle step that would run past the budget is stopped with the process it
/// started (the harness stand-in's child here), the steps after it are skipped and their logs say
/// so, the outputs are still packed back (`BACK`) without the binaries and keys that went there, and
/// the run exits 2 (steps that could not run). A stand-in `metainfer` replaces the real one: what is
/// under test is the script.
#[test]
fn device_check_run_keeps_to_its_budget_and_still_packs_what_it_has() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    let dir = root.join("dir");
    let w = |p: &str, text: &str| {
        let p = root.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    };
    // `bundle run kt` starts a child that would outlive the budget; `synth` must not be needed.
    w(
        "dir/bin/metainfer",
        "#!/usr/bin/env bash\n\
         if [[ \"$1 $2 $3\" == 'bundle run kt' ]]; then sleep 600 & echo $! >\"$CHILD_PID\"; wait; fi\n\
         [[ \"$1\" == synth ]] && exit 5\n\
         echo '{}'\n",
    );
    std::fs::set_permissions(dir.join("bin/metainfer"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    w("dir/runner/runner.key", "secret");
    w("dir/prepare-id", "0123abcd");
    w("dir/kt/bundle.json", "{}");
    w("dir/verify-baby/bundle.json", "{}");
    for b in ["verify-1b", "profile-1b", "profile-1b-512", "serve-1b", "batching-baby"] {
        w(&format!("dir/{b}/bundle.json"), "{}");
    }
    w("dir/synth-1b-long.args", "--preset\nllama3.2-1b\n--max-seq\n640\n");
    for f in ["model.safetensors", "tokenizer.json", "generation_config.json", "config.json"] {
        w(&format!("long/{f}"), &format!("{f} of the 640-position checkpoint"));
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/device-check.sh");
    // BACK inside DIR (tar would read the archive it writes) is refused before anything runs.
    let inside = std::process::Command::new("bash")
        .arg(&script)
        .arg("run")
        .arg(&dir)
        .env("BACK", dir.join("back.tar.xz"))
        .output()
        .unwrap();
    assert_eq!(inside.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&inside.stderr).contains("lies inside"), "{inside:?}");
    assert!(!dir.join("logs").exists());
    let out = std::process::Command::new("timeout")
        .args(["120", "bash"])
        .arg(&script)
        .arg("run")
        .arg(&dir)
        .env("BUDGET_S", "22")
        .env("BACK", root.join("back.tar.xz"))
        .env("MODEL_1B_LONG", root.join("long"))
        .env("CHILD_PID", root.join("child.pid"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");

    let steps = std::fs::read_to_string(dir.join("logs/steps.txt")).unwrap();
    assert!(steps.contains("run-kt: exit 124"), "kt stopped by its time limit:\n{steps}");
    let skipped = [
        "run-verify-baby",
        "run-verify-1b",
        "run-profile-1b",
        "run-profile-1b-512",
        "run-serve-1b",
        "hf-1b-eager",
        "run-batching-baby",
        "run-profile-1b-nograph",
        "hf-babyllama",
    ];
    for skipped in skipped {
        assert!(steps.contains(&format!("{skipped}: skipped (out of time")), "{skipped}:\n{steps}");
        let log = std::fs::read_to_string(dir.join(format!("logs/{skipped}.json"))).unwrap();
        assert!(log.contains("\"skipped\": \"out of time"), "{log}");
    }
    assert!(stderr.contains("steps that could not run") && stderr.contains("run-kt"), "{stderr}");
    let pid = std::fs::read_to_string(root.join("child.pid")).unwrap();
    // Gone, or a zombie (dead, waiting for a parent that may never reap it in a container).
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    let alive = stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'));
    assert!(!alive, "the harness stand-in's child {pid} outlived its step");

    let listing = std::process::Command::new("tar").arg("-tJf").arg(root.join("back.tar.xz")).output().unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(
        listing.lines().any(|l| l == "./logs/steps.txt") && listing.lines().any(|l| l == "./logs/prepare-id"),
        "{listing}"
    );
    for gone in ["./bin/", "./runner/", "./kt/bundle.json", "./synth-1b-long.args"] {
        assert!(!listing.lines().any(|l| l.starts_with(gone)), "{gone} travelled back:\n{listing}");
    }
}

/// Runs `scripts/cuda-sim-check.sh` on `kernels` (None: the engine's own, built with the address and
/// undefined-behaviour sanitizers) with `filter`, under a time limit (a kernel whose threads miss a
/// barrier would hang): its exit status and output.
fn cuda_sim(kernels: Option<&std::path::Path>, filter: &str) -> (Option<i32>, String) {
    let t = tempfile::tempdir().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cuda-sim-check.sh");
    let mut cmd = std::process::Command::new("timeout");
    cmd.args(["600", "bash"]).arg(&script).arg(filter).env("OUT", t.path().join("build"));
    cmd.env("SANITIZE", if kernels.is_none() { "1" } else { "0" });
    if let Some(k) = kernels {
        cmd.env("KERNELS", k);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

/// The CUDA engine's fused kernels compute what their contracts say when run on a CPU model of the
/// GPU (scripts/cuda-sim/sim.h: a thread per CUDA thread, barriers for __syncthreads and the warp
/// shuffles, mma.sync from the PTX ISA's fragment layout), launched as the engine launches them and
/// compared with f64 loops: the matrix-vector kernels with their fused RMSNorm, SiLU, RoPE, cache
/// write and argmax, the split decode attention, the tensor-core product with and without k-splits,
/// the prefill attention, the paged attention and its RoPE and cache write, the mixture-of-experts
/// routing and experts, and the per-contract kernels (embedding, RMSNorm, RoPE, the four weight
/// formats' products, the gated activations, softmax, attention, argmax); a NaN key reaches the
/// output of each attention kernel; no read or write leaves its buffer. The same checks fail
/// the kernels with two fragment registers of the tensor-core product swapped, and with paged
/// attention reading KV head 0 for every query head (GQA maps h to h / group), and with paged
/// attention reading its shared broken-table flag without setting it first.
#[test]
fn the_cuda_kernels_compute_their_contracts_on_a_cpu_model_of_the_gpu() {
    let (code, out) = cuda_sim(None, "");
    assert_eq!(code, Some(0), "{out}");
    let passed = out.lines().filter(|l| l.starts_with("PASS ")).count();
    assert!(passed >= 60 && !out.contains("FAIL"), "{out}");
    for kernel in [
        "mv_bf16_qkv",
        "mv_bf16_head",
        "attn_decode",
        "gemm_bf16x3",
        "attn_prefill",
        "paged_attention",
        "moe_route",
        "moe_gate_up",
        "rms_norm",
        "linear_f16",
        "attention (",
        "argmax",
    ] {
        assert!(out.lines().any(|l| l.starts_with(&format!("PASS {kernel}"))), "{kernel} not checked:\n{out}");
    }

    let t = tempfile::tempdir().unwrap();
    let source = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/engines/llama-cuda-bf16/src/kernels.cu"),
    )
    .unwrap();
    let mutant = |name: &str, from: &str, to: &str| {
        assert_eq!(source.matches(from).count(), 1, "kernels.cu no longer holds {from:?} once");
        let p = t.path().join(name);
        std::fs::write(&p, source.replace(from, to)).unwrap();
        p
    };
    // Each broken kernel, the check group run on it, and the check that must fail.
    let broken = [
        // Two fragment registers of the tensor-core product swapped.
        (
            mutant("swapped.cu", "mma_bf16(part[i][j], a0, a1, a2, a3v,", "mma_bf16(part[i][j], a0, a2, a1, a3v,"),
            "gemm",
            "FAIL gemm_bf16x3",
        ),
        // Paged attention reading KV head 0 for every query head.
        (
            mutant(
                "paged.cu",
                "(u64)(t % block_size)) * kv_stride + (u64)g * head_dim;",
                "(u64)(t % block_size)) * kv_stride;",
            ),
            "paged",
            "FAIL paged_attention 4/2 heads",
        ),
        // Shared memory a block reads before writing it: its flag for a broken table left unset.
        (
            mutant("unset.cu", "    if (threadIdx.x == 0) bad = 0;\n    int lo = 0", "    int lo = 0"),
            "paged",
            "FAIL paged_attention",
        ),
    ];
    for (path, group, failing) in &broken {
        let (code, out) = cuda_sim(Some(path), group);
        assert_eq!(code, Some(1), "{}: {out}", path.display());
        assert!(out.lines().any(|l| l.starts_with(failing)), "{}: {out}", path.display());
    }
}
