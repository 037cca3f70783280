//! Weight dtypes: kernel variants in the CKB (lint, plan selection), their oracles against values
//! computed by hand from the formats' definitions, and the reference forward pass on weights as a
//! bf16 or int8 engine stores them.

use crate::s;
use metainfer::ckb::{self, Ckb};
use metainfer::model;
use metainfer::oracle::{self, dtypes, llama::Reference};

fn lint_after(file: &str, edit: impl Fn(&str) -> String) -> Vec<ckb::Finding> {
    super::ckb::findings_after(file, edit)
}

#[test]
fn variant_of_a_missing_kernel_is_refused_with_file_and_field() {
    let f = lint_after("kernels/linear_int8.toml", |s| s.replace("of = \"kernel.linear\"", "of = \"kernel.matmul\""));
    assert!(
        f.iter().any(|f| f.file == "kernels/linear_int8.toml"
            && f.field == "/variant/of"
            && f.message.contains("kernel.matmul")),
        "{f:?}"
    );
}

#[test]
fn variant_with_an_unknown_weight_dtype_is_refused() {
    let f = lint_after("kernels/linear_bf16.toml", |s| s.replace("weight_dtype = \"bf16\"", "weight_dtype = \"fp8\""));
    assert!(
        f.iter().any(|f| f.field == "/variant/weight_dtype" && f.message.contains("fp8") && f.message.contains("int8")),
        "{f:?}"
    );
}

#[test]
fn two_variants_for_one_kernel_and_dtype_are_a_contradiction() {
    let f = lint_after("kernels/linear_f16.toml", |s| s.replace("weight_dtype = \"f16\"", "weight_dtype = \"bf16\""));
    assert!(f.iter().any(|f| f.field == "/variant" && f.message.contains("already the bf16 variant")), "{f:?}");
}

#[test]
fn plan_picks_the_kernel_variant_of_the_dtype() {
    let ckb = Ckb::embedded().unwrap();
    let llama = ckb.get("model.llama").unwrap();
    let f32s = ckb.kernels_for(llama, "f32").unwrap();
    assert!(f32s.contains(&"kernel.linear".to_string()) && !f32s.iter().any(|k| k.starts_with("kernel.linear_")));
    for (dtype, kernel) in
        [("bf16", "kernel.linear_bf16"), ("f16", "kernel.linear_f16"), ("int8", "kernel.linear_int8")]
    {
        let ks = ckb.kernels_for(llama, dtype).unwrap();
        assert!(ks.contains(&kernel.to_string()), "{dtype}: {ks:?}");
        assert!(!ks.contains(&"kernel.linear".to_string()), "{dtype}: {ks:?}");
        assert_eq!(ks.len(), f32s.len(), "{dtype}: one kernel replaced, none added");
    }
    let err = ckb.kernels_for(llama, "fp8").unwrap_err();
    assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
    // Gemma's GeGLU has its own kernel contract; Llama uses SwiGLU.
    let gemma = ckb.kernels_for(ckb.get("model.gemma").unwrap(), "f32").unwrap();
    assert!(gemma.contains(&"kernel.gelu_tanh_and_mul".to_string()), "{gemma:?}");
    assert!(!f32s.contains(&"kernel.gelu_tanh_and_mul".to_string()));
}

#[test]
fn low_precision_oracles_match_hand_computed_values() {
    // bf16 bits 0x3F80 = 1.0, 0xC000 = -2.0, 0x3F00 = 0.5; x = [3, 1]: rows [1, -2] and [0.5, 1].
    let w = dtypes::widen_bf16(&[0x3F80, 0xC000, 0x3F00, 0x3F80]);
    assert_eq!(oracle::linear(&[3.0, 1.0], &w, 1, 2, 2), vec![1.0, 2.5]);
    // IEEE binary16 0x3C00 = 1.0, 0x4200 = 3.0, 0xB800 = -0.5, 0x0000 = 0.
    let w = dtypes::widen_f16(&[0x3C00, 0x4200, 0xB800, 0x0000]);
    assert_eq!(oracle::linear(&[3.0, 1.0], &w, 1, 2, 2), vec![6.0, -1.5]);
    // int8 rows [2, -4] (scale 0.5) and [127, 0] (scale 0.01, an f32: 0.0099999998).
    let w = dtypes::dequant_int8(&[2, -4, 127, 0], &[0.5, 0.01]);
    let out = oracle::linear(&[3.0, 1.0], &w, 1, 2, 2);
    assert!((out[0] - 1.0).abs() < 1e-12 && (out[1] - 3.81).abs() < 1e-6, "{out:?}");
    // GELU, tanh form, at g = 1: PyTorch gelu(1.0, approximate="tanh") = 0.8411920070648193 (f32).
    let g = oracle::gelu_tanh_and_mul(&[1.0, 0.0, -1.0], &[1.0, 5.0, 2.0]);
    assert!((g[0] - 0.841_192_007).abs() < 1e-7, "{g:?}");
    assert_eq!(g[1], 0.0);
    // gelu(-1) = -1 + gelu(1) for the tanh form too (gelu(x) - gelu(-x) = x); times up = 2.
    assert!((g[2] - 2.0 * (0.841_192_007 - 1.0)).abs() < 1e-6, "{g:?}");
}

/// The reference on "as stored" weights really holds what the contracts say an engine stores:
/// bf16 values have zero low mantissa bits; int8 rows take at most 255 values, multiples of their
/// scale, with the row's largest magnitude kept exactly (q = +-127).
#[test]
fn stored_weights_follow_the_dtype_contracts() {
    let t = model::read_safetensors(&super::babyllama()).unwrap();
    let (shape, w) = &t["model.layers.0.mlp.down_proj.weight"];
    let k = shape[1];
    for v in dtypes::as_stored(w, k, "bf16") {
        assert_eq!((v as f32).to_bits() & 0xFFFF, 0, "{v} is not a bf16 value");
    }
    let stored = dtypes::as_stored(w, k, "int8");
    for (row, orig) in stored.chunks(k).zip(w.chunks(k)) {
        let absmax = orig.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = (absmax / 127.0) as f64;
        let top = row.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!((top - 127.0 * scale).abs() <= 1e-12 * top.max(1.0), "row max {top} vs {}", 127.0 * scale);
        for v in row {
            let q = v / scale;
            assert!((q - q.round()).abs() < 1e-6 && q.abs() <= 127.0 + 1e-9, "{v} is not a multiple of {scale}");
        }
    }
}

/// Quantised weights change the logits (the reference really runs on them), by much less than the
/// logits' own spread, and the golden prompt still greedily continues with the same first token.
#[test]
fn reference_runs_on_the_weights_of_each_dtype() {
    let dir = super::babyllama();
    let ckb = Ckb::embedded().unwrap();
    let cfg = model::load_config(&ckb, &dir).unwrap();
    let t = model::read_safetensors(&dir).unwrap();
    let golden = super::golden();
    let prompt: Vec<u32> =
        golden["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let (base_rows, base_tokens) = Reference::new(&cfg, &t).unwrap().greedy(&prompt, 1).unwrap();
    let spread = |r: &[f64]| r.iter().cloned().fold(f64::MIN, f64::max) - r.iter().cloned().fold(f64::MAX, f64::min);
    for dtype in ["bf16", "f16", "int8"] {
        let (rows, tokens) = Reference::with_weight_dtype(&cfg, &t, dtype).unwrap().greedy(&prompt, 1).unwrap();
        let diff = rows[0].iter().zip(&base_rows[0]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(diff > 0.0 && diff < 0.05 * spread(&base_rows[0]), "{dtype}: max logit change {diff}");
        assert_eq!(tokens, base_tokens, "{dtype}");
    }
    assert!(Reference::with_weight_dtype(&cfg, &t, "fp8").is_err());
}

#[test]
fn kernel_guidance_for_a_missing_kernel_is_refused() {
    let f = lint_after("platforms/cpu-x86_64.toml", |s| s.replace("\"kernel.argmax\" = [", "\"kernel.argmin\" = ["));
    assert!(f.iter().any(|f| f.field == "/platform/kernel_guidance" && f.message.contains("kernel.argmin")), "{f:?}");
}

/// The example engine declares bf16, f16 and int8 builds (`[dtype_features]`): at each, the kernel
/// gate tests that dtype's linear kernel in place of the f32 one, and generation on BabyLlama
/// matches the reference run on the weights as that dtype stores them.
#[test]
fn example_engine_passes_the_gates_at_every_weight_dtype() {
    use metainfer::ops::Report;
    use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
    use metainfer::ops::verify::{VerifyRequest, verify};
    let t = tempfile::tempdir().unwrap();
    let ctx = super::ctx(t.path());
    let dir = super::shared_example();
    let budget = metainfer::harness::Budget::secs(1200);
    for dtype in ["bf16", "f16", "int8"] {
        let req =
            KernelTestRequest { engine: s(&dir), kernels: vec![], dtype: Some(dtype.into()), ..Default::default() };
        let k = kernel_test(&ctx, &req, &budget).unwrap();
        assert!(k.passed, "{dtype}: {}", k.text());
        assert_eq!(k.dtype, dtype);
        let ids: Vec<&str> = k.kernels.iter().map(|k| k.kernel.as_str()).collect();
        assert!(ids.contains(&format!("kernel.linear_{dtype}").as_str()) && !ids.contains(&"kernel.linear"), "{ids:?}");
        let v = verify(
            &ctx,
            &VerifyRequest {
                engine: s(&dir),
                model: s(&super::babyllama()),
                prompts: vec![],
                max_new_tokens: Some(24),
                dtype: Some(dtype.into()),
                ..Default::default()
            },
            &budget,
        )
        .unwrap();
        assert!(v.passed, "{dtype}: {}", v.text());
        assert_eq!(v.dtype, dtype);
    }
    // A dtype the engine does not declare is refused with what to add.
    let req = KernelTestRequest { engine: s(&dir), kernels: vec![], dtype: Some("fp8".into()), ..Default::default() };
    let e = kernel_test(&ctx, &req, &budget).unwrap_err();
    assert!(e.message.contains("[dtype_features]") && e.message.contains("fp8"), "{}", e.message);
}

/// Faults in the low-precision kernels of the SIMD engine are caught at their dtype and named by
/// their failure mode: the per-row scale dropped (int8), and bf16 bits decoded as IEEE binary16.
/// Each replaces the whole body of the kernel, whose signature the contract fixes.
#[test]
fn low_precision_kernel_faults_are_caught_and_named() {
    use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
    let t = tempfile::tempdir().unwrap();
    let ctx = super::ctx(t.path());
    let budget = metainfer::harness::Budget::secs(1200);
    for (name, dtype, declaration, body, failure) in [
        (
            "noscale",
            "int8",
            "pub fn linear_int8(",
            // Accumulated in f64: a sequential f32 sum of k products up to 127 in size drifts past
            // the contract's tolerance, and the fault would be the rounding, not the scale.
            "for i in 0..m { for j in 0..n { out[i * n + j] = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum::<f64>() as f32; } }",
            "failure.int8-scale-missing",
        ),
        ("swapped", "bf16", "pub fn linear_bf16(", "linear_f16(x, w, m, k, n, out)", "failure.half-format-swapped"),
    ] {
        let dir = t.path().join(name);
        super::copy_example(&dir);
        super::replace_body(&dir, "src/kernels.rs", declaration, body);
        let req = KernelTestRequest {
            engine: s(&dir),
            kernels: vec![],
            seed: Some(7),
            dtype: Some(dtype.into()),
            ..Default::default()
        };
        let k = kernel_test(&ctx, &req, &budget).unwrap();
        let failed: Vec<&str> = k.kernels.iter().filter(|k| !k.passed).map(|k| k.kernel.as_str()).collect();
        let want = format!("kernel.linear_{dtype}");
        assert_eq!(failed, [want.as_str()], "{}", metainfer::ops::Report::text(&k));
        let bad = k.kernels.iter().find(|k| !k.passed).unwrap();
        let named: Vec<&str> = bad.diagnosis.iter().map(|d| d.failure.as_str()).collect();
        assert_eq!(named, [failure], "{}", metainfer::ops::Report::text(&k));
    }
}
