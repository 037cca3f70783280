//! `ckb conformance` on every folder of ../shared/conformance: the families the CKB covers equal
//! transformers' own logits at every prompt position and its greedy ids; the others are listed as
//! not covered, with the reason, never skipped.

use std::path::PathBuf;

use metainfer::ops::conformance::conformance;

use super::{ctx, shared};

/// Every folder of ../shared/conformance, by name.
fn folders() -> Vec<(String, PathBuf)> {
    let root = shared().join("conformance");
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("vectors.json").is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    out.sort();
    out
}

/// The dense families whose contracts ship, each of which must pass; the others (mixture of
/// experts) are reported not covered, with the reason.
const COVERED: &[&str] = &[
    "cohere",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "llama",
    "mistral",
    "olmo",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen3",
    "stablelm",
    "starcoder2",
];

#[test]
fn every_conformance_folder_is_checked_and_the_covered_families_equal_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let c = ctx(tmp.path());
    let dirs = folders();
    assert!(dirs.len() >= 17, "../shared/conformance holds {} folders", dirs.len());
    let r = conformance(&c, &dirs.iter().map(|(_, p)| p.display().to_string()).collect::<Vec<_>>()).unwrap();
    eprintln!("{}", metainfer::ops::Report::text(&r));
    assert_eq!(r.families.len(), dirs.len(), "one entry per folder");
    for ((name, _), f) in dirs.iter().zip(&r.families) {
        assert_eq!(&f.family, name);
        if COVERED.contains(&name.as_str()) {
            assert!(f.covered, "{name}: {:?}", f.not_covered);
            assert!(
                f.passed,
                "{name}: max diff {:e}, first beyond {:?}, greedy {:?}",
                f.max_abs_diff, f.first_beyond, f.greedy_mismatch
            );
            assert!(f.positions >= 4, "{name}");
        } else if !f.covered {
            assert!(!f.not_covered.is_empty(), "{name} is not covered and says no reason");
        } else {
            assert!(
                f.passed,
                "{name} is covered and fails: {:e} {:?} {:?}",
                f.max_abs_diff, f.first_beyond, f.greedy_mismatch
            );
        }
    }
    assert!(r.passed);
}

/// The conformance checkpoint of `name`: its contract's family, resolved config and tensors.
fn checkpoint(name: &str) -> (metainfer::ckb::Contract, metainfer::model::ResolvedConfig, metainfer::model::Tensors) {
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let dir = shared().join("conformance").join(name);
    let config = metainfer::model::read_config(dir.as_path()).unwrap();
    let contract = metainfer::model::route(&ckb, &config).unwrap().clone();
    let cfg = metainfer::model::resolve(&contract, &config).unwrap_or_else(|g| panic!("{name}: {g:?}"));
    (contract, cfg, metainfer::model::read_safetensors(dir.as_path()).unwrap())
}

/// Each failure mode the families added from contracts alone list (Gemma 3, Cohere, StableLM,
/// StarCoder2, OLMo, Phi-3) has a model-level mutant or a graph rewrite, and diagnosis names it from
/// that mutant's own logits on the checkpoint transformers wrote.
#[test]
fn every_failure_mode_of_the_new_families_is_named_from_its_own_logits() {
    use metainfer::oracle::compare;
    use metainfer::oracle::diagnose;
    use metainfer::oracle::llama::Reference;
    use metainfer::oracle::mutants::{Mutation, Mutations};
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    // Detected by the weight-loading gate (a checkpoint without lm_head.weight), not by a mutant.
    let no_mutant = ["failure.tied-embeddings-ignored"];
    let mut shown = Vec::new();
    for name in ["gemma3_text", "cohere", "stablelm", "starcoder2", "olmo", "phi3"] {
        let (contract, cfg, tensors) = checkpoint(name);
        let family = contract.model.clone().unwrap();
        let tol = family.logits_tolerance["f32"].clone();
        let mut r = Reference::of_family(&family, &cfg, tensors, "f32").unwrap();
        let prompt: Vec<u32> = (0..8u32).map(|i| (i * 7 + 3) % cfg.vocab as u32).collect();
        let as_engine = |r: &mut Reference| {
            let (rows, tokens) = r.greedy(&prompt, 6).unwrap();
            (tokens, rows.iter().flatten().map(|&v| v as f32).collect::<Vec<f32>>())
        };
        let (tokens, logits) = as_engine(&mut r);
        assert!(diagnose::generation(&ckb, &mut r, &prompt, &tokens, &logits, &tol).is_empty(), "{name}");
        for fid in &contract.failure_modes {
            let f = ckb.get(fid).unwrap().failure.clone().unwrap();
            if no_mutant.contains(&fid.as_str()) {
                continue;
            }
            let mutation = f.mutant.as_deref().and_then(Mutation::from_name);
            assert!(mutation.is_some() || f.rewrite.is_some(), "{name} lists {fid}, which has no model-level mutant");
            let mut variants: Vec<(String, Option<Mutation>)> = Vec::new();
            variants.extend(mutation.map(|m| (m.name().to_string(), Some(m))));
            variants.extend(f.rewrite.as_ref().map(|rw| (format!("graph rewrite: {}", rw.describe()), None)));
            for (label, m) in variants {
                let applied = match m {
                    Some(m) => {
                        r.set_mutations(Mutations::of(&[m]));
                        diagnose::distinguishable(m, &r)
                    }
                    None => r.set_rewrite(f.rewrite.as_ref()).unwrap(),
                };
                if !applied {
                    // e.g. an untied head bound to the embedding, on a checkpoint that ties them.
                    eprintln!("{name}: {fid} ({label}) does not apply to this checkpoint");
                    r.set_mutations(Mutations::NONE);
                    continue;
                }
                let (tokens, logits) = as_engine(&mut r);
                r.set_mutations(Mutations::NONE);
                r.set_rewrite(None).unwrap();
                // The true forward pass over the mutant's own tokens differs beyond the tolerance.
                r.reset();
                let fed: Vec<u32> = prompt.iter().chain(&tokens[..tokens.len() - 1]).copied().collect();
                let rows: Vec<Vec<f64>> = fed.iter().map(|&t| r.step(t).unwrap()).skip(prompt.len() - 1).collect();
                let vocab = cfg.vocab;
                let within = rows
                    .iter()
                    .enumerate()
                    .all(|(i, want)| compare(&logits[i * vocab..(i + 1) * vocab], want, &tol).ok);
                if within {
                    // GeGLU's exact erf moves each activation by at most 4e-4: the kernel test
                    // names it (kernel.gelu_tanh, kernel.gelu_tanh_and_mul), not the logits.
                    assert_eq!(
                        fid, "failure.gelu-erf-vs-tanh",
                        "{name}: {fid} ({label}) stays within the logits tolerance"
                    );
                    continue;
                }
                let d = diagnose::generation(&ckb, &mut r, &prompt, &tokens, &logits, &tol);
                let named: Vec<(&str, &str)> = d.iter().map(|d| (d.failure.as_str(), d.mutant.as_str())).collect();
                assert_eq!(named.first(), Some(&(fid.as_str(), label.as_str())), "{name}: {fid}: {d:#?}");
                shown.push(format!("{name}: {fid}"));
            }
        }
    }
    eprintln!("{}", shown.join("\n"));
    assert!(shown.len() >= 15, "{shown:?}");
}

/// A config the family's graph cannot run is refused at plan by name, never a panic or a NaN
/// reference: a per-layer list shorter than the layers, a layer type the graph does not name, a
/// partial rotary factor leaving an odd number of dimensions, a division by zero in an expression,
/// a per-layer-type RoPE base missing.
#[test]
fn configs_the_graph_cannot_run_are_gaps_naming_the_field() {
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let read = |name: &str| metainfer::model::read_config(shared().join("conformance").join(name).as_path()).unwrap();
    let gaps = |config: &serde_json::Map<String, serde_json::Value>| -> String {
        let contract = metainfer::model::route(&ckb, config).unwrap();
        match metainfer::model::resolve(contract, config) {
            Ok(_) => panic!("resolved: {config:?}"),
            Err(g) => g.iter().map(|g| format!("{}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n"),
        }
    };
    let mut c = read("gemma3_text");
    c["layer_types"].as_array_mut().unwrap().pop();
    let g = gaps(&c);
    assert!(g.contains("layer_types: has 6 entries, one per layer is needed: num_hidden_layers is 7"), "{g}");
    let mut c = read("gemma3_text");
    c["layer_types"][2] = "chunked_attention".into();
    let g = gaps(&c);
    assert!(
        g.contains("layer_types: entry 2 is \"chunked_attention\", which model.gemma3_text's graph does not name"),
        "{g}"
    );
    let mut c = read("gemma3_text");
    c["rope_parameters"].as_object_mut().unwrap().remove("sliding_attention");
    let g = gaps(&c);
    assert!(g.contains("node `layers.0.q_rope`") && g.contains("no key \"sliding_attention\""), "{g}");
    let mut c = read("gemma3_text");
    c["query_pre_attn_scalar"] = 0.into();
    let g = gaps(&c);
    assert!(g.contains("node `layers.0.attn`: parameter `scale`") && g.contains("divides by zero"), "{g}");
    let mut c = read("gemma3_text");
    c["layer_types"] = "sliding_attention".into();
    let g = gaps(&c);
    assert!(g.contains("layer_types: must be a JSON list"), "{g}");
    let mut c = read("stablelm");
    c["partial_rotary_factor"] = 0.3125.into();
    c["rope_parameters"]["partial_rotary_factor"] = 0.3125.into();
    let g = gaps(&c);
    assert!(g.contains("node `layers.0.q_rope`: rotary_dim = 5") && g.contains("odd number of dimensions"), "{g}");
    let mut c = read("stablelm");
    c["rope_parameters"]["partial_rotary_factor"] = 0.5.into();
    let g = gaps(&c);
    assert!(g.contains("partial_rotary_factor 0.5 and partial_rotary_factor 0.25 disagree"), "{g}");
}
