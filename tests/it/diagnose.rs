//! Diagnosis without an engine build: the model-level mutants against their own logits and the CKB's
//! mutant names. Engines with injected faults are in `faults.rs`.

use std::collections::HashMap;

use metainfer::ckb::{Ckb, Kind};
use metainfer::model;
use metainfer::ops::diagnose::{self, Diagnosis};
use metainfer::oracle::llama::Reference;
use metainfer::oracle::mutants::{self, Mutation, Mutations};

fn ids(d: &[Diagnosis]) -> Vec<&str> {
    d.iter().map(|d| d.failure.as_str()).collect()
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

/// Named f32 inputs, named u32 inputs and parameters of a kernel case.
type Inputs = (Vec<(String, Vec<f32>)>, Vec<(String, Vec<u32>)>, HashMap<String, String>);

/// A tiny case of each kernel, to check which mutants are wired to which kernel.
fn tiny_case(kernel: &str) -> Inputs {
    let f = |pairs: &[(&str, &[f32])]| pairs.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect::<Vec<_>>();
    let p = |pairs: &[(&str, &str)]| pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    match kernel {
        "kernel.embedding" => (f(&[("table", &[1.0, 2.0])]), vec![("ids".into(), vec![0])], p(&[("dim", "1")])),
        "kernel.rms_norm" => (f(&[("x", &[1.0, 2.0]), ("weight", &[1.0, 1.0])]), vec![], p(&[("eps", "1e-5")])),
        "kernel.rope" => (
            f(&[("x", &[1.0, 2.0])]),
            vec![("positions".into(), vec![1])],
            p(&[("n_heads", "1"), ("head_dim", "2"), ("theta", "500000")]),
        ),
        "kernel.linear" => {
            (f(&[("x", &[1.0, 2.0]), ("w", &[1.0, 2.0, 3.0, 4.0])]), vec![], p(&[("m", "1"), ("k", "2"), ("n", "2")]))
        }
        "kernel.linear_bf16" | "kernel.linear_f16" | "kernel.linear_int8" => {
            (f(&[("x", &[1.0, 2.0]), ("scales", &[0.5, 0.25])]), vec![], p(&[("m", "1"), ("k", "2"), ("n", "2")]))
        }
        "kernel.silu_and_mul" | "kernel.gelu_tanh_and_mul" => (f(&[("gate", &[1.0]), ("up", &[2.0])]), vec![], p(&[])),
        "kernel.softmax" => (f(&[("x", &[1.0, 2.0])]), vec![], p(&[("n", "2")])),
        "kernel.attention" => (
            f(&[("q", &[1.0, 2.0]), ("k_cache", &[1.0, 2.0]), ("v_cache", &[1.0, 2.0])]),
            vec![],
            p(&[("n_q", "1"), ("kv_len", "1"), ("n_heads", "1"), ("n_kv_heads", "1"), ("head_dim", "2")]),
        ),
        "kernel.argmax" => (f(&[("x", &[1.0, 2.0])]), vec![], p(&[])),
        other => panic!("no tiny case for {other}"),
    }
}

/// Every failure contract's `mutant` names a mutant that exists, every mutant is named by one, and
/// every failure mode of a kernel contract that has a mutant is wired to that kernel's inputs.
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
    let mut all: Vec<String> = mutants::MUTANTS.iter().map(|m| m.to_string()).collect();
    all.sort();
    assert_eq!(named, all, "every mutant is named by exactly one failure contract");
    for c in ckb.of_kind(Kind::Kernel) {
        let (f32s, u32s, params) = tiny_case(&c.id);
        // 16-bit weights [1, 2, 3, 4] in the kernel's own format, int8 weights [1, 2, 3, 4].
        let halves = [("w".to_string(), vec![0x3F80, 0x4000, 0x4040, 0x4080], c.id == "kernel.linear_bf16")];
        let i8s = [("w".to_string(), vec![1i8, 2, 3, 4])];
        let case = diagnose::KernelCase {
            f32s: &f32s,
            u32s: &u32s,
            halves: &halves,
            i8s: &i8s,
            params: &params,
            out: &[],
            oracle_ok: false,
            oracle_err: 0.0,
        };
        for f in &c.failure_modes {
            let fm = ckb.get(f).unwrap().failure.as_ref().unwrap();
            assert!(fm.applies_to.contains(&c.id), "{f} does not apply to {}", c.id);
            if let Some(m) = &fm.mutant {
                assert!(
                    diagnose::kernel_mutant(&c.id, m, &case).is_some(),
                    "mutant {m} of {f} is not wired to {}",
                    c.id
                );
            }
        }
    }
}
