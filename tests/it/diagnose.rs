//! Gates that name the failure mode. Engines with one known mistake each, made at test time from the
//! example engine, must be caught by the right gate and, where the failure contract has an oracle
//! mutant, diagnosed with the right failure id; the clean engine gets no diagnosis. Plus the
//! model-level mutants against their own logits (no engine build) and the CKB's mutant names.

use metainfer::ckb::{Ckb, Kind};
use metainfer::harness::Budget;
use metainfer::model;
use metainfer::ops::Report;
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::verify::{VerifyReport, VerifyRequest, verify};
use metainfer::oracle::diagnose::{self, Diagnosis};
use metainfer::oracle::kernels;
use metainfer::oracle::llama::Reference;
use metainfer::oracle::mutants::{self, Mutation, Mutations};

const KERNELS: &str = "src/kernels.rs";
const MODEL: &str = "src/model.rs";

/// Kernel seed: fixed so that the drawn cases are the same on every run. It must draw a rope case
/// with theta != 10000 (probability 80/81 for any seed), or rope_theta_default cannot be seen.
const KERNEL_SEED: u64 = 11;
const VERIFY_SEED: u64 = 5;

/// What generation must do with a fault.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Gen {
    /// Some prompt fails (logits, tokens, tokenizer) or the generation process fails.
    Fails,
    /// Either way (the fault may not show on BabyLlama, e.g. rope_theta_default with theta 10000).
    Either,
}

struct Fault {
    name: &'static str,
    /// (file, pattern, replacement), applied in order.
    edits: &'static [(&'static str, &'static str, &'static str)],
    /// The kernel that must fail (the only one); `None`: every kernel passes.
    kernel: Option<&'static str>,
    /// What generation must do.
    generation: Gen,
    /// The failure mode; `None` when the fault has no failure contract with a mutant.
    failure: Option<&'static str>,
    /// Where the diagnosis must appear: the kernel gate, generation (when it failed on logits).
    diagnosed_by_kernel: bool,
    diagnosed_by_generation: bool,
}

const FAULTS: &[Fault] = &[
    Fault {
        name: "rope pairs (2j, 2j+1)",
        edits: &[
            (KERNELS, "let a = head[j];", "let a = head[2 * j];"),
            (KERNELS, "let b = head[j + half];", "let b = head[2 * j + 1];"),
            (KERNELS, "head[j] = a * cos - b * sin;", "head[2 * j] = a * cos - b * sin;"),
            (KERNELS, "head[j + half] = a * sin + b * cos;", "head[2 * j + 1] = a * sin + b * cos;"),
            // The model rotates with precomputed angles: the same pairing mistake there.
            (
                KERNELS,
                "let (lo, hi) = head.split_at_mut(half);\n        for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {\n            let (va, vb) = (*a, *b);\n            *a = va * c - vb * s;\n            *b = va * s + vb * c;\n        }",
                "let _ = half;\n        for (j, (&c, &s)) in cos.iter().zip(sin).enumerate() {\n            let (va, vb) = (head[2 * j], head[2 * j + 1]);\n            head[2 * j] = va * c - vb * s;\n            head[2 * j + 1] = va * s + vb * c;\n        }",
            ),
        ],
        kernel: Some("kernel.rope"),
        generation: Gen::Fails,
        failure: Some("failure.rope-adjacent-pairs"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: true,
    },
    Fault {
        name: "rope theta hard-coded 10000",
        edits: &[(KERNELS, "let theta = theta as f64;", "let theta = 10_000.0f64;")],
        kernel: Some("kernel.rope"),
        generation: Gen::Either,
        failure: Some("failure.rope-wrong-theta"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        name: "rmsnorm eps outside the root",
        edits: &[(
            KERNELS,
            "let inv = (1.0 / (sum_squares(xr) / dim as f64 + eps as f64).sqrt()) as f32;",
            "let inv = (1.0 / ((sum_squares(xr) / dim as f64).sqrt() + eps as f64)) as f32;",
        )],
        kernel: Some("kernel.rms_norm"),
        generation: Gen::Either,
        failure: Some("failure.rmsnorm-eps-outside-sqrt"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        name: "rmsnorm without weight",
        edits: &[(KERNELS, "*o = v * inv * w;", "*o = v * inv + 0.0 * w;")],
        kernel: Some("kernel.rms_norm"),
        generation: Gen::Fails,
        failure: Some("failure.rmsnorm-missing-weight"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: true,
    },
    Fault {
        // The model runs its projections through fused q/k/v and gate/up passes, not through
        // kernels::linear, so only the kernel gate sees this one.
        name: "linear reads W as [k, n]",
        edits: &[(
            KERNELS,
            "matmul::linear::<matmul::F32>(matmul::detected(), x, w, &[], m, k, n, out);",
            "for i in 0..m {\n        for j in 0..n {\n            out[i * n + j] = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum::<f32>();\n        }\n    }",
        )],
        kernel: Some("kernel.linear"),
        generation: Gen::Either,
        failure: Some("failure.linear-transposed"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        name: "silu on up in the kernel",
        edits: &[(KERNELS, "*o = g / (1.0 + exp(-g)) * u;", "*o = u / (1.0 + exp(-u)) * g;")],
        kernel: Some("kernel.silu_and_mul"),
        generation: Gen::Fails,
        failure: Some("failure.silu-gate-up-swapped"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: true,
    },
    Fault {
        name: "gate and up swapped at the call site",
        edits: &[(MODEL, "kernels::silu_and_mul(gate, up, act)", "kernels::silu_and_mul(up, gate, act)")],
        kernel: None,
        generation: Gen::Fails,
        failure: Some("failure.silu-gate-up-swapped"),
        diagnosed_by_kernel: false,
        diagnosed_by_generation: true,
    },
    Fault {
        name: "softmax without max subtraction",
        // The plain exponential, which overflows (the engine's own exp saturates instead).
        edits: &[(KERNELS, "*v = exp(*v - max);", "*v = v.exp();")],
        kernel: Some("kernel.softmax"),
        generation: Gen::Either,
        failure: Some("failure.softmax-no-max-subtraction"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        name: "attention without 1/sqrt(head_dim)",
        edits: &[(KERNELS, "let scale = 1.0 / (head_dim as f32).sqrt();", "let scale = 1.0f32;")],
        kernel: Some("kernel.attention"),
        generation: Gen::Fails,
        failure: Some("failure.attention-wrong-scale"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: true,
    },
    Fault {
        name: "gqa head h % n_kv_heads",
        edits: &[(KERNELS, "let kvh = h / group;", "let kvh = h % n_kv_heads;")],
        kernel: Some("kernel.attention"),
        generation: Gen::Fails,
        failure: Some("failure.gqa-modulo-mapping"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: true,
    },
    Fault {
        name: "attention without causal mask",
        edits: &[(KERNELS, "let span = kv_len - n_q + i + 1;", "let span = kv_len;")],
        kernel: Some("kernel.attention"),
        generation: Gen::Either,
        failure: Some("failure.attention-missing-causal-mask"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        name: "argmax keeps the last maximum",
        edits: &[(
            KERNELS,
            "let m = max(x);",
            "let m = max(x);\n            if let Some(i) = x.iter().rposition(|&v| v == m) {\n                return i;\n            }",
        )],
        kernel: Some("kernel.argmax"),
        generation: Gen::Either,
        failure: Some("failure.argmax-last-on-ties"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        // Reads past the table (a panic) for the last id; the other cases show the shifted rows.
        name: "embedding row id + 1",
        edits: &[(
            KERNELS,
            "row.copy_from_slice(&table[id * dim..(id + 1) * dim]);",
            "row.copy_from_slice(&table[(id + 1) * dim..(id + 2) * dim]);",
        )],
        kernel: Some("kernel.embedding"),
        generation: Gen::Either,
        failure: Some("failure.embedding-wrong-row"),
        diagnosed_by_kernel: true,
        diagnosed_by_generation: false,
    },
    Fault {
        name: "K/V written one row early",
        edits: &[
            (
                MODEL,
                "layer.k_cache[start * kvd..kv_len * kvd]",
                "layer.k_cache[start.saturating_sub(1) * kvd..(kv_len - 1).max(rows) * kvd]",
            ),
            (
                MODEL,
                "layer.v_cache[start * kvd..kv_len * kvd]",
                "layer.v_cache[start.saturating_sub(1) * kvd..(kv_len - 1).max(rows) * kvd]",
            ),
            // RoPE is applied to the key where it was written.
            (
                MODEL,
                "let k_tok = &mut layer.k_cache[(start + i) * kvd..(start + i + 1) * kvd];",
                "let k_tok = &mut layer.k_cache[(start + i).saturating_sub(1) * kvd..(start + i).max(1) * kvd];",
            ),
            // Prefill token by token, so that every token's K/V lands one row early (a batched
            // prefill would write the prompt's rows in place and shift only the decoded ones).
            (MODEL, "let take = (n - done).min(PREFILL_CHUNK);", "let take = 1;"),
        ],
        kernel: None,
        generation: Gen::Fails,
        failure: Some("failure.kv-cache-wrong-position"),
        diagnosed_by_kernel: false,
        diagnosed_by_generation: true,
    },
    Fault {
        name: "tokenizer drops BOS",
        edits: &[(
            "src/tokenizer.rs",
            "pub fn encode(&self, text: &str) -> Vec<u32> {",
            "pub fn encode(&self, text: &str) -> Vec<u32> {\n        let mut ids = self.encode_inner(text);\n        if ids.first() == Some(&1) { ids.remove(0); }\n        ids\n    }\n\n    fn encode_inner(&self, text: &str) -> Vec<u32> {",
        )],
        kernel: None,
        generation: Gen::Fails,
        failure: None,
        diagnosed_by_kernel: false,
        diagnosed_by_generation: false,
    },
];

fn s(p: &std::path::Path) -> String {
    p.display().to_string()
}

fn budget() -> Budget {
    Budget::secs(900)
}

fn verify_req(engine: &std::path::Path) -> VerifyRequest {
    VerifyRequest {
        engine: s(engine),
        model: s(&crate::babyllama()),
        prompts: vec![],
        max_new_tokens: Some(8),
        seed: Some(VERIFY_SEED),
        dtype: None,
    }
}

/// Whether generation itself failed (a prompt's tokenizer, logits, tokens or decode, or the process),
/// as opposed to the report failing only for the phase order (kernels not passed on these sources).
fn generation_failed(v: &VerifyReport) -> bool {
    v.prompts.iter().any(|p| !p.error.is_empty()) || (v.prompts.is_empty() && !v.passed)
}

fn ids(d: &[Diagnosis]) -> Vec<&str> {
    d.iter().map(|d| d.failure.as_str()).collect()
}

#[test]
fn injected_faults_are_caught_and_named() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());

    // The clean engine passes and gets no diagnosis.
    let good = t.path().join("good");
    crate::copy_example(&good);
    let k = kernel_test(
        &ctx,
        &KernelTestRequest { engine: s(&good), kernels: vec![], seed: Some(KERNEL_SEED), dtype: None },
        &budget(),
    )
    .unwrap();
    assert!(k.passed, "{}", k.text());
    assert!(k.kernels.iter().all(|k| k.diagnosis.is_empty()), "{}", k.text());
    let v = verify(&ctx, &verify_req(&good), &budget()).unwrap();
    assert!(!generation_failed(&v) && v.diagnosis.is_empty(), "{}", v.text());

    let (mut caught, mut diagnosed, mut with_mutant) = (0, 0, 0);
    let mut problems = Vec::new();
    for (i, f) in FAULTS.iter().enumerate() {
        let dir = t.path().join(format!("fault{i}"));
        crate::copy_example(&dir);
        for (file, from, to) in f.edits {
            crate::inject(&dir, file, from, to);
        }
        let k = kernel_test(
            &ctx,
            &KernelTestRequest { engine: s(&dir), kernels: vec![], seed: Some(KERNEL_SEED), dtype: None },
            &budget(),
        )
        .unwrap();
        crate::assert_conforms(&k);
        let v = verify(&ctx, &verify_req(&dir), &budget()).unwrap();
        crate::assert_conforms(&v);
        let failed: Vec<&str> = k.kernels.iter().filter(|k| !k.passed).map(|k| k.kernel.as_str()).collect();
        let kernel_diag: Vec<&Diagnosis> = k.kernels.iter().flat_map(|k| &k.diagnosis).collect();
        let gen_failed = generation_failed(&v);
        println!(
            "{:<38} kernels failed {:?} diagnosis {:?} | generation failed {} diagnosis {:?}",
            f.name,
            failed,
            kernel_diag.iter().map(|d| d.failure.as_str()).collect::<Vec<_>>(),
            gen_failed,
            ids(&v.diagnosis)
        );
        let mut why = Vec::new();
        match f.kernel {
            Some(id) if failed != [id] => why.push(format!("kernel gate: expected only {id} to fail, got {failed:?}")),
            None if !failed.is_empty() => why.push(format!("kernel gate: expected a pass, got {failed:?} failing")),
            _ => {}
        }
        if f.generation == Gen::Fails && !gen_failed {
            why.push("generation: expected a failure".into());
        }
        // No gate may name a failure mode other than the injected one.
        for d in kernel_diag.iter().copied().chain(&v.diagnosis) {
            if Some(d.failure.as_str()) != f.failure {
                why.push(format!("wrong diagnosis {} ({})", d.failure, d.mutant));
            }
            assert!(d.error_vs_oracle.is_finite() && d.error_vs_mutant.is_finite());
            assert!(d.error_vs_mutant <= d.error_vs_oracle, "{d:?}");
        }
        if let Some(want) = f.failure {
            let by_kernel = f.kernel.is_some_and(|id| {
                k.kernels
                    .iter()
                    .any(|r| r.kernel == id && r.diagnosis.first().map(|d| d.failure.as_str()) == Some(want))
            });
            let by_gen = v.diagnosis.first().map(|d| d.failure.as_str()) == Some(want);
            if f.diagnosed_by_kernel && !by_kernel {
                why.push(format!("kernel gate: expected diagnosis {want}"));
            }
            if f.diagnosed_by_generation && !by_gen {
                why.push(format!("generation: expected diagnosis {want}"));
            }
            with_mutant += 1;
            if by_kernel || by_gen {
                diagnosed += 1;
            }
            // The text rendering shows the diagnosis.
            if by_kernel {
                assert!(k.text().contains(&format!("diagnosis: {want}")), "{}", k.text());
            }
            if by_gen {
                assert!(v.text().contains(&format!("diagnosis: {want}")), "{}", v.text());
            }
        }
        if !failed.is_empty() || gen_failed {
            caught += 1;
        }
        if !why.is_empty() {
            problems.push(format!("{}: {}\n{}\n{}", f.name, why.join("; "), k.text(), v.text()));
        }
    }
    let n = FAULTS.len();
    println!(
        "fault injection: caught {caught}/{n} ({:.0}%), diagnosed {diagnosed}/{with_mutant} faults with a mutant ({:.0}%)",
        100.0 * caught as f64 / n as f64,
        100.0 * diagnosed as f64 / with_mutant as f64
    );
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    assert_eq!(caught, n);
    assert_eq!(diagnosed, with_mutant);
}

/// Each model-level mutation, run as if it were an engine (its f64 logits rounded to f32), is named
/// by the generation diagnosis, and only it; the true forward pass is named nothing.
#[test]
fn model_mutations_are_named_from_their_own_logits() {
    let ckb = Ckb::embedded().unwrap();
    let dir = crate::babyllama();
    let cfg = model::load_config(&ckb, &dir).unwrap();
    let tensors = model::read_safetensors(&dir).unwrap();
    let tol = ckb.get("model.llama").unwrap().model.as_ref().unwrap().logits_tolerance["f32"].clone();
    let tok = model::hf_tokenizer(&dir).unwrap();
    let prompt = model::hf_encode(&tok, "Once upon a time").unwrap();
    let mut r = Reference::new(&cfg, &tensors).unwrap();

    let as_engine = |r: &mut Reference, m: Mutations| {
        r.set_mutations(m);
        let (rows, tokens) = r.greedy(&prompt, 5).unwrap();
        r.set_mutations(Mutations::NONE);
        (tokens, rows.iter().flatten().map(|&v| v as f32).collect::<Vec<f32>>())
    };
    let (tokens, logits) = as_engine(&mut r, Mutations::NONE);
    assert!(diagnose::generation(&ckb, &mut r, &prompt, &tokens, &logits, &tol).is_empty());

    for m in Mutation::ALL {
        let (tokens, logits) = as_engine(&mut r, Mutations::of(&[m]));
        let d = diagnose::generation(&ckb, &mut r, &prompt, &tokens, &logits, &tol);
        assert!(r.mutations().is_empty(), "the reference is left as it was given");
        if m == Mutation::RopeThetaDefault {
            // BabyLlama's rope_theta is 10000: the mutant is the true forward pass.
            assert!(d.is_empty(), "{d:?}");
            continue;
        }
        let want = diagnose::failure_of_mutant(&ckb, m.name()).expect("a failure contract names it").id.clone();
        assert_eq!(ids(&d), [want.as_str()], "{}: {d:?}", m.name());
        assert_eq!(d[0].mutant, m.name());
        assert!(d[0].error_vs_mutant < tol.atol && d[0].error_vs_oracle > tol.atol, "{:?}", d[0]);
    }
}

/// Every failure contract's `mutant` names a mutant that exists, every mutant is named by exactly
/// one failure contract, and every failure mode of a kernel contract that has a mutant names one the
/// registry has for that kernel (so diagnosis can run it on that kernel's cases).
#[test]
fn failure_contracts_name_existing_mutants() {
    let ckb = Ckb::embedded().unwrap();
    let mut named = Vec::new();
    for c in ckb.of_kind(Kind::Failure) {
        if let Some(m) = c.failure.as_ref().and_then(|f| f.mutant.as_deref()) {
            assert!(mutants::mutant_exists(m), "{} names mutant `{m}`, which does not exist", c.id);
            named.push(m.to_string());
        }
    }
    named.sort();
    let mut all: Vec<String> = mutants::names().iter().map(|m| m.to_string()).collect();
    all.sort();
    assert_eq!(named, all, "every mutant is named by exactly one failure contract");
    for c in ckb.of_kind(Kind::Kernel) {
        for f in &c.failure_modes {
            let fm = ckb.get(f).unwrap().failure.as_ref().unwrap();
            assert!(fm.applies_to.contains(&c.id), "{f} does not apply to {}", c.id);
            if let Some(m) = &fm.mutant {
                assert!(kernels::mutant(&c.id, m).is_some(), "mutant {m} of {f} is not a mutant of {}", c.id);
            }
        }
    }
}
