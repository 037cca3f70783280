//! Fault injection: copies of the plain example engine with one known mistake each must be caught by
//! the right gate, for the stated reason, and, where the failure contract has an oracle mutant,
//! diagnosed with the right failure id; the clean engine gets no diagnosis.
//!
//! A fault replaces the whole body of one named function ([`crate::replace_body`]). Kernel faults
//! replace the body of a kernel whose signature the contract fixes, so they hold whatever the
//! engine's own code looks like; the model-level faults replace a short helper of the plain engine
//! (`rope_with_freqs`, `glu`, `store`, `post_process`), named in its sources.

use metainfer::ops::Report;
use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
use metainfer::ops::verify::{VerifyReport, VerifyRequest, verify};
use metainfer::oracle::diagnose::Diagnosis;

use crate::Engine;
use crate::{budget, s};

const KERNELS: &str = "src/kernels.rs";
const MODEL: &str = "src/model.rs";

/// Kernel seed: fixed so that the drawn cases are the same on every run. It must draw a rope case
/// with theta != 10000 (probability 80/81 for any seed), or rope_theta_default cannot be seen.
const KERNEL_SEED: u64 = 11;
const VERIFY_SEED: u64 = 5;

/// What generation must do with a fault.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Gen {
    /// Every prompt's logits are outside tolerance.
    Logits,
    /// Every prompt's ids differ from the HF tokenizer's.
    Tokenizer,
    /// Either way (the fault may not show on BabyLlama, e.g. rope_theta_default with theta 10000).
    Either,
}

struct Fault {
    name: &'static str,
    /// (file, declaration, faulty body): the body replaces that function's.
    edits: Vec<(&'static str, &'static str, String)>,
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

/// An RMSNorm body (contract signature) whose output element is `expr`, over `row[i]`, the row's
/// mean square `ms`, `eps` and `weight[i]`.
fn rms_norm(expr: &str) -> String {
    format!(
        "let dim = weight.len();
        for (row, o) in x.chunks(dim).zip(out.chunks_mut(dim)) {{
            let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            for i in 0..dim {{ o[i] = {expr}; }}
        }}"
    )
}

/// An attention body (contract signature) with the score scale, the KV head of query head `h` and
/// the last position query `i` sees as given.
fn attention(scale: &str, kv_head: &str, last: &str) -> String {
    format!(
        "let mut scores = vec![0.0f32; kv_len];
        for i in 0..n_q {{
            for h in 0..n_heads {{
                let (g, last) = ({kv_head}, {last});
                let qh = &q[(i * n_heads + h) * head_dim..][..head_dim];
                for t in 0..=last {{
                    let kt = &k_cache[(t * n_kv_heads + g) * head_dim..][..head_dim];
                    scores[t] = {scale} * qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>();
                }}
                softmax(&mut scores[..=last], last + 1);
                for d in 0..head_dim {{
                    let v = |t: usize| v_cache[(t * n_kv_heads + g) * head_dim + d];
                    out[(i * n_heads + h) * head_dim + d] = (0..=last).map(|t| scores[t] * v(t)).sum();
                }}
            }}
        }}"
    )
}

const SCALE: &str = "1.0 / (head_dim as f32).sqrt()";
const KV_HEAD: &str = "h / (n_heads / n_kv_heads)";
const CAUSAL: &str = "kv_len - n_q + i";

fn faults() -> Vec<Fault> {
    let fault = |name, edits: &[(&'static str, &'static str, &str)], kernel, generation, failure, by_kernel, by_gen| {
        let edits = edits.iter().map(|(f, d, b)| (*f, *d, b.to_string())).collect();
        Fault {
            name,
            edits,
            kernel,
            generation,
            failure,
            diagnosed_by_kernel: by_kernel,
            diagnosed_by_generation: by_gen,
        }
    };
    vec![
        fault(
            // The kernel and the model share the rotation, so both see the pairing.
            "rope pairs (2j, 2j+1)",
            &[(
                KERNELS,
                "pub fn rope_with_freqs(",
                "let head_dim = 2 * freqs.len();
                for (t, &pos) in positions.iter().enumerate() {
                    for h in 0..n_heads {
                        let base = (t * n_heads + h) * head_dim;
                        for (j, &freq) in freqs.iter().enumerate() {
                            let (sin, cos) = (pos as f64 * freq).sin_cos();
                            let (a, b) = (x[base + 2 * j], x[base + 2 * j + 1]);
                            x[base + 2 * j] = a * cos as f32 - b * sin as f32;
                            x[base + 2 * j + 1] = a * sin as f32 + b * cos as f32;
                        }
                    }
                }",
            )],
            Some("kernel.rope"),
            Gen::Logits,
            Some("failure.rope-adjacent-pairs"),
            true,
            true,
        ),
        fault(
            "rope theta hard-coded 10000",
            &[(KERNELS, "pub fn rope(", "rope_with_freqs(x, positions, n_heads, &rope_freqs(10_000.0, head_dim))")],
            Some("kernel.rope"),
            Gen::Either,
            Some("failure.rope-wrong-theta"),
            true,
            false,
        ),
        fault(
            "rmsnorm eps outside the root",
            &[(KERNELS, "pub fn rms_norm(", &rms_norm("row[i] / (ms.sqrt() + eps) * weight[i]"))],
            Some("kernel.rms_norm"),
            Gen::Either,
            Some("failure.rmsnorm-eps-outside-sqrt"),
            true,
            false,
        ),
        fault(
            "rmsnorm without weight",
            &[(KERNELS, "pub fn rms_norm(", &rms_norm("row[i] / (ms + eps).sqrt()"))],
            Some("kernel.rms_norm"),
            Gen::Logits,
            Some("failure.rmsnorm-missing-weight"),
            true,
            true,
        ),
        fault(
            "linear reads W as [k, n]",
            &[(
                KERNELS,
                "pub fn linear(",
                "for i in 0..m { for j in 0..n { out[i * n + j] = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum(); } }",
            )],
            Some("kernel.linear"),
            Gen::Either,
            Some("failure.linear-transposed"),
            true,
            false,
        ),
        fault(
            "silu on up in the kernel",
            &[(
                KERNELS,
                "pub fn silu_and_mul(",
                "for i in 0..out.len() { out[i] = up[i] / (1.0 + (-up[i]).exp()) * gate[i]; }",
            )],
            Some("kernel.silu_and_mul"),
            Gen::Logits,
            Some("failure.silu-gate-up-swapped"),
            true,
            true,
        ),
        fault(
            "gate and up swapped at the call site",
            &[(
                MODEL,
                "fn glu(",
                "if gelu { kernels::gelu_tanh_and_mul(up, gate, act) } else { kernels::silu_and_mul(up, gate, act) }",
            )],
            None,
            Gen::Logits,
            Some("failure.silu-gate-up-swapped"),
            false,
            true,
        ),
        fault(
            // The plain exponential, which overflows.
            "softmax without max subtraction",
            &[(
                KERNELS,
                "pub fn softmax(",
                "for row in x.chunks_mut(n) { let sum: f32 = row.iter().map(|v| v.exp()).sum(); for v in row.iter_mut() { *v = v.exp() / sum; } }",
            )],
            Some("kernel.softmax"),
            Gen::Either,
            Some("failure.softmax-no-max-subtraction"),
            true,
            false,
        ),
        fault(
            "attention without 1/sqrt(head_dim)",
            &[(KERNELS, "pub fn attention(", &attention("1.0", KV_HEAD, CAUSAL))],
            Some("kernel.attention"),
            Gen::Logits,
            Some("failure.attention-wrong-scale"),
            true,
            true,
        ),
        fault(
            "gqa head h % n_kv_heads",
            &[(KERNELS, "pub fn attention(", &attention(SCALE, "h % n_kv_heads", CAUSAL))],
            Some("kernel.attention"),
            Gen::Logits,
            Some("failure.gqa-modulo-mapping"),
            true,
            true,
        ),
        fault(
            // Decode runs one query at a time (kv_len - 1 is then its own position): only a batched
            // prompt could show it, and this engine's prefill is a loop over forward.
            "attention without causal mask",
            &[(KERNELS, "pub fn attention(", &attention(SCALE, KV_HEAD, "kv_len - 1"))],
            Some("kernel.attention"),
            Gen::Either,
            Some("failure.attention-missing-causal-mask"),
            true,
            false,
        ),
        fault(
            "argmax keeps the last maximum",
            &[(
                KERNELS,
                "pub fn argmax(",
                "let mut best = 0; for i in 1..x.len() { if x[i] >= x[best] { best = i; } } best",
            )],
            Some("kernel.argmax"),
            Gen::Either,
            Some("failure.argmax-last-on-ties"),
            true,
            false,
        ),
        fault(
            // Reads past the table (a panic) for the last id; the other cases show the shifted rows.
            "embedding row id + 1",
            &[(
                KERNELS,
                "pub fn embedding(",
                "for (i, &id) in ids.iter().enumerate() { let r = id as usize + 1; out[i * dim..(i + 1) * dim].copy_from_slice(&table[r * dim..(r + 1) * dim]); }",
            )],
            Some("kernel.embedding"),
            Gen::Either,
            Some("failure.embedding-wrong-row"),
            true,
            false,
        ),
        fault(
            "K/V written one row early",
            &[(
                MODEL,
                "fn store(",
                "// Row pos - 1 (row 0 at pos 0) gets this position's row; row pos stays zero.
                cache.resize((pos + 1) * row.len(), 0.0);
                let at = pos.saturating_sub(1) * row.len();
                cache[at..at + row.len()].copy_from_slice(row);",
            )],
            None,
            Gen::Logits,
            Some("failure.kv-cache-wrong-position"),
            false,
            true,
        ),
        fault(
            "tokenizer drops BOS",
            &[("src/tokenizer.rs", "fn post_process(", "let _ = &self.template; ids")],
            None,
            Gen::Tokenizer,
            None,
            false,
            false,
        ),
    ]
}

fn verify_req(engine: &std::path::Path) -> VerifyRequest {
    VerifyRequest {
        engine: s(engine),
        model: s(&crate::babyllama()),
        prompts: vec![],
        max_new_tokens: Some(8),
        seed: Some(VERIFY_SEED),
        ..Default::default()
    }
}

/// Whether generation itself failed (a prompt's tokenizer, logits, tokens or decode, or the process),
/// as opposed to the report failing only for the phase order (kernels not passed on these sources).
fn generation_failed(v: &VerifyReport) -> bool {
    v.prompts.iter().any(|p| !p.error.is_empty()) || (v.prompts.is_empty() && !v.passed)
}

/// Whether generation failed for the reason `want` states.
fn failed_as(v: &VerifyReport, want: Gen) -> bool {
    let every =
        |ok: fn(&metainfer::ops::verify::PromptResult) -> bool| !v.prompts.is_empty() && v.prompts.iter().all(ok);
    match want {
        Gen::Logits => every(|p| p.tokenizer_ok && !p.logits_ok),
        Gen::Tokenizer => every(|p| !p.tokenizer_ok),
        Gen::Either => true,
    }
}

/// The kernel contract model.llama's graph node `node` runs (its op's `GraphOp::kernel`).
fn kernel_of(node: &str) -> Option<&'static str> {
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let graph = ckb.get("model.llama").unwrap().model.clone().unwrap().graph.unwrap();
    let n = [&graph.prologue, &graph.layer, &graph.epilogue].into_iter().flatten().find(|n| n.name == node)?;
    metainfer::ckb::GRAPH_OPS.iter().find(|o| o.name == n.op).and_then(|o| o.kernel)
}

fn ids(d: &[Diagnosis]) -> Vec<&str> {
    d.iter().map(|d| d.failure.as_str()).collect()
}

#[test]
fn injected_faults_are_caught_and_named() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let kernel_req = |dir: &std::path::Path| KernelTestRequest {
        engine: s(dir),
        kernels: vec![],
        seed: Some(KERNEL_SEED),
        ..Default::default()
    };

    // The clean engine passes and gets no diagnosis.
    let good = Engine::Plain.shared_copy();
    let k = kernel_test(&ctx, &kernel_req(&good), &budget()).unwrap();
    assert!(k.passed, "{}", k.text());
    assert!(k.kernels.iter().all(|k| k.diagnosis.is_empty()), "{}", k.text());
    let v = verify(&ctx, &verify_req(&good), &budget()).unwrap();
    assert!(!generation_failed(&v) && v.diagnosis.is_empty(), "{}", v.text());

    let faults = faults();
    let (mut caught, mut diagnosed, mut with_mutant) = (0, 0, 0);
    let mut problems = Vec::new();
    for (i, f) in faults.iter().enumerate() {
        let dir = t.path().join(format!("fault{i}"));
        Engine::Plain.copy_to(&dir);
        for (file, declaration, body) in &f.edits {
            crate::replace_body(&dir, file, declaration, body);
        }
        let k = kernel_test(&ctx, &kernel_req(&dir), &budget()).unwrap();
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
        if !k.build_error.is_empty() {
            why.push(format!("the faulty engine does not build: {}", k.build_error));
        }
        match f.kernel {
            // The faulty kernel fails, and so may a kernel whose contract lists the same failure mode
            // and which the engine builds on it (attention calls the engine's softmax).
            Some(id)
                if !failed.contains(&id)
                    || failed.iter().any(|k| {
                        *k != id
                            && !f
                                .failure
                                .is_some_and(|fm| ctx.ckb.get(k).is_ok_and(|c| c.failure_modes.iter().any(|m| m == fm)))
                    }) =>
            {
                why.push(format!(
                    "kernel gate: expected only {id} (and kernels listing its failure mode) to fail, got {failed:?}"
                ))
            }
            None if !failed.is_empty() => why.push(format!("kernel gate: expected a pass, got {failed:?} failing")),
            _ => {}
        }
        if !failed_as(&v, f.generation) {
            why.push(format!("generation: expected every prompt to fail on {:?}", f.generation));
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
        // Logits that failed on the HF ids are localised: the traced rerun names a point whose op
        // runs the faulted kernel (softmax runs inside attention); for the model-level faults, the
        // attention that reads the misplaced cache rows, and the activation fed swapped inputs.
        if v.prompts.iter().all(|p| p.tokenizer_ok) && v.prompts.iter().any(|p| !p.logits_ok) {
            let want = match (f.kernel, f.name) {
                (Some("kernel.softmax"), _) | (None, "K/V written one row early") => Some("kernel.attention"),
                (None, "gate and up swapped at the call site") => Some("kernel.silu_and_mul"),
                (k, _) => k,
            };
            match &v.localisation {
                Some(l) if kernel_of(&l.node) == want => {
                    assert!(v.text().contains(&format!("first diverging point {}", l.point)), "{}", v.text())
                }
                other => why.push(format!("localisation: expected a point running {want:?}, got {other:?}")),
            }
        }
        if !failed.is_empty() || gen_failed {
            caught += 1;
        }
        if !why.is_empty() {
            problems.push(format!("{}: {}\n{}\n{}", f.name, why.join("; "), k.text(), v.text()));
        }
    }
    let n = faults.len();
    println!(
        "fault injection: caught {caught}/{n} ({:.0}%), diagnosed {diagnosed}/{with_mutant} faults with a mutant ({:.0}%)",
        100.0 * caught as f64 / n as f64,
        100.0 * diagnosed as f64 / with_mutant as f64
    );
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    assert_eq!(caught, n);
    assert_eq!(diagnosed, with_mutant);
}

/// The structural injection itself: a body is replaced whole, braces in strings, char literals and
/// comments do not end it early, and the rest of the file is kept.
#[test]
fn replace_body_swaps_exactly_one_function_body() {
    let t = tempfile::tempdir().unwrap();
    let src = "fn a() -> u8 {\n    // a } in a comment\n    let _ = (\"}\", '}', '\\'', \"\\\"}\");\n    if true { 1 } else { 2 }\n}\n\nfn b<'x>(s: &'x str) -> &'x str { s }\n";
    std::fs::write(t.path().join("lib.rs"), src).unwrap();
    crate::replace_body(t.path(), "lib.rs", "fn a(", "3");
    let got = std::fs::read_to_string(t.path().join("lib.rs")).unwrap();
    assert_eq!(got, "fn a() -> u8 {\n3\n}\n\nfn b<'x>(s: &'x str) -> &'x str { s }\n");
    crate::replace_body(t.path(), "lib.rs", "fn b<", "&s[1..]");
    let got = std::fs::read_to_string(t.path().join("lib.rs")).unwrap();
    assert!(got.ends_with("fn b<'x>(s: &'x str) -> &'x str {\n&s[1..]\n}\n"), "{got}");
}
