//! Diagnosis without an engine build: the model-level mutants against their own logits and the CKB's
//! mutant names. Engines with injected faults are in `faults.rs`.

use metainfer::ckb::{Ckb, Kind};
use metainfer::model;
use metainfer::oracle::diagnose::{self, Diagnosis};
use metainfer::oracle::kernels;
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
        if matches!(
            m,
            Mutation::RopeThetaDefault
                | Mutation::GeluErf
                | Mutation::LayerNormNoMean
                | Mutation::RotaryFreqOverHeadDim
                | Mutation::MoeNoRenorm
                | Mutation::MoeSoftmaxOverTopk
                | Mutation::MoeExpertOffByOne
                | Mutation::MoeUnweighted
                | Mutation::SinksDropped
                | Mutation::MoeGateUpHalves
                | Mutation::SwigluUnclamped
        ) {
            // BabyLlama's rope_theta is 10000, its MLP is a dense SwiGLU (no router, no experts),
            // its norms RMSNorms and its RoPE rotates whole heads: the mutant is the true forward
            // pass; it has no attention sinks. (The mixture-of-experts and sink mutants are named on
            // Qwen3-MoE, Mixtral and gpt-oss:
            // conformance::every_failure_mode_of_the_new_families_is_named_from_its_own_logits;
            // swiglu_unclamped changes nothing on those random weights either, where no gate or up
            // value passes 7, and is named by kernel.moe_experts_clamped's large-inputs case.)
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
