//! `ckb conformance` on every folder of ../shared/conformance: the families the CKB covers equal
//! transformers' own logits at every prompt position and its greedy ids; the others are listed as
//! not covered, with the reason, never skipped.

use std::path::PathBuf;

use metainfer::ops::conformance::conformance;

use super::{ctx, s, shared};

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

/// The families whose contracts ship, each of which must pass: all 17 of ../shared/conformance.
const COVERED: &[&str] = &[
    "cohere",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "granite",
    "llama",
    "mistral",
    "mixtral",
    "olmo",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "stablelm",
    "starcoder2",
];

#[test]
fn every_conformance_folder_is_checked_and_the_covered_families_equal_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let c = ctx(tmp.path());
    let dirs = folders();
    assert!(dirs.len() >= 17, "../shared/conformance holds {} folders", dirs.len());
    // As a shell glob (`conformance/*`) names them: the folders and the plain files beside them.
    let mut given: Vec<String> = dirs.iter().map(|(_, p)| p.display().to_string()).collect();
    let readme = crate::shared().join("conformance/README.md").display().to_string();
    given.push(readme.clone());
    let r = conformance(&c, &given).unwrap();
    eprintln!("{}", metainfer::ops::Report::text(&r));
    assert_eq!(r.families.len(), dirs.len(), "one entry per folder");
    assert_eq!(r.skipped_files, [readme], "a plain file is left out, named");
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
/// StarCoder2, OLMo, Phi-3, Qwen3-MoE, Mixtral, gpt-oss) has a model-level mutant or a graph rewrite, and diagnosis names it from
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
    for name in ["gemma3_text", "cohere", "stablelm", "starcoder2", "olmo", "phi3", "qwen3_moe", "mixtral", "gpt_oss"] {
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

/// The plain example engine, declared for each covered family in turn, passes the gates on the
/// checkpoint transformers wrote for it: check_rules, compile_engine, run_kernel_test (the family's
/// kernels: kernel.layer_norm, kernel.rotary, kernel.gelu_tanh where it lists them) and
/// verify_generation on the four prompts of vectors.json with 16 new tokens, every step's logits
/// and tokens equal to the reference's (whose own logits and greedy ids equal transformers', above).
#[test]
fn plain_engine_passes_the_gates_on_every_covered_conformance_checkpoint() {
    use metainfer::ops::Report;
    use metainfer::ops::compile::{CompileRequest, compile};
    use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
    use metainfer::ops::rules::{RulesRequest, check_rules};
    use metainfer::ops::verify::{VerifyRequest, verify};
    let t = tempfile::tempdir().unwrap();
    let c = ctx(t.path());
    let budget = metainfer::harness::Budget::secs(900);
    let engine = t.path().join("engine");
    crate::Engine::Plain.copy_to(&engine);
    let manifest = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    let e = engine.display().to_string();
    let mut kernel_sets = std::collections::BTreeSet::new();
    for (name, dir) in folders().into_iter().filter(|(n, _)| COVERED.contains(&n.as_str())) {
        let (contract, _, _) = checkpoint(&name);
        let declared: String = manifest
            .lines()
            .map(|l| if l.starts_with("family = ") { format!("family = {:?}", contract.id) } else { l.to_string() })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(engine.join("metainfer.toml"), declared).unwrap();
        let r = check_rules(&c, &RulesRequest { engine: e.clone() }, &budget).unwrap();
        assert!(r.passed, "{name}: {}", r.text());
        let k = compile(&c, &CompileRequest { engine: e.clone(), ..Default::default() }, &budget).unwrap();
        assert!(k.passed, "{name}: {}", k.text());
        // Phase order: verify counts on sources (metainfer.toml's family included) whose kernels passed.
        let kernels = contract.model.as_ref().unwrap().kernels.clone();
        kernel_sets.insert(kernels.clone());
        {
            let req = KernelTestRequest { engine: e.clone(), kernels: vec![], seed: Some(5), ..Default::default() };
            let k = kernel_test(&c, &req, &budget).unwrap();
            assert!(k.passed, "{name}: {}", k.text());
            for id in &kernels {
                assert!(k.text().contains(id.as_str()), "{name}: {id} was not tested: {}", k.text());
            }
        }
        let vectors: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("vectors.json")).unwrap()).unwrap();
        let prompts: Vec<String> =
            vectors["prompts"].as_array().unwrap().iter().map(|p| p["text"].as_str().unwrap().to_string()).collect();
        let req = VerifyRequest {
            engine: e.clone(),
            model: dir.display().to_string(),
            prompts: prompts.clone(),
            max_new_tokens: Some(16),
            seed: Some(5),
            ..Default::default()
        };
        let v = verify(&c, &req, &budget).unwrap();
        assert!(v.passed && v.family == contract.id, "{name}: {}", v.text());
        for text in &prompts {
            let p = v.prompts.iter().find(|p| &p.prompt == text).unwrap_or_else(|| panic!("{name}: {text:?} not run"));
            assert!(p.tokenizer_ok && p.tokens_ok && p.logits_ok && p.steps >= 1, "{name}: {}", v.text());
            assert_eq!(p.text, p.reference_text, "{name}");
        }
        eprintln!("{name}: {}", v.text().lines().next().unwrap_or(""));
    }
    assert!(kernel_sets.len() >= 5, "the families' kernel sets: {kernel_sets:?}");
}

/// synth writes every config.json value with the JSON type transformers' own save_pretrained wrote
/// for it (integer, float, boolean, string, list, object) in the conformance folder of each covered
/// family: transformers 5 refuses a float where its configuration class types an integer (e.g.
/// Gemma 2's query_pre_attn_scalar = 256.0).
#[test]
fn synth_writes_config_values_with_the_types_transformers_writes() {
    use serde_json::Value;
    let kind = |v: &Value| match v {
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "integer",
        Value::Bool(_) => "boolean",
        Value::String(_) => "string",
        Value::Array(_) => "list",
        Value::Object(_) => "object",
        Value::Null => "null",
    };
    let mut compared = 0;
    for name in COVERED {
        let (contract, _, _) = checkpoint(name);
        let req = metainfer::ops::synth::SynthRequest { family: name.to_string(), ..Default::default() };
        let ours = metainfer::ops::synth::synth_config_for(&contract, &req).unwrap();
        let theirs = metainfer::model::read_config(shared().join("conformance").join(name).as_path()).unwrap();
        for (key, v) in ours.as_object().unwrap() {
            let Some(t) = theirs.get(key).filter(|t| !t.is_null() && !v.is_null()) else { continue };
            assert_eq!(kind(v), kind(t), "{name}: `{key}` is {v} here, {t} as transformers writes it");
            compared += 1;
        }
    }
    assert!(compared >= 14 * 10, "{compared} values compared");
}

/// synth writes, for every covered family at the sizes of its conformance checkpoint, exactly the
/// tensors transformers' save_pretrained wrote there (names and shapes), a config.json that plan
/// covers, and a checkpoint the family's reference runs: a family added as a contract gets test
/// checkpoints shaped as the real ones.
#[test]
fn synth_writes_the_tensors_transformers_writes_for_every_covered_family() {
    use metainfer::ops::plan::{PlanRequest, plan_only};
    use metainfer::ops::synth::{SynthRequest, synth_in};
    let t = tempfile::tempdir().unwrap();
    let c = ctx(t.path());
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    for name in COVERED {
        let dir = shared().join("conformance").join(name);
        let theirs = metainfer::model::read_config(dir.as_path()).unwrap();
        let size = |key: &str| theirs.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
        let out = t.path().join(name);
        let req = SynthRequest {
            family: name.to_string(),
            out: out.clone(),
            seed: 3,
            hidden: size("hidden_size"),
            layers: size("num_hidden_layers"),
            heads: size("num_attention_heads"),
            kv_heads: size("num_key_value_heads"),
            head_dim: size("head_dim"),
            vocab: size("vocab_size"),
            intermediate: size("intermediate_size"),
            max_seq: size("max_position_embeddings"),
            sliding_window: size("sliding_window"),
            experts: size("num_local_experts"),
            experts_per_token: size("num_experts_per_tok"),
            expert_intermediate: size("moe_intermediate_size"),
            ..Default::default()
        };
        synth_in(&ckb, &req).unwrap_or_else(|e| panic!("{name}: {e}"));
        let shapes = |d: &std::path::Path| -> Vec<(String, Vec<usize>)> {
            metainfer::model::read_safetensors(d).unwrap().into_iter().map(|(n, (s, _))| (n, s)).collect()
        };
        assert_eq!(shapes(&out), shapes(&dir), "{name}: synth's tensors against transformers'");
        let plan = PlanRequest {
            model: out.display().to_string(),
            target: "cpu".into(),
            dtype: "f32".into(),
            ..Default::default()
        };
        let r = plan_only(&c, &plan).unwrap();
        assert!(r.covered && r.family == format!("model.{name}"), "{name}: {:?}", r.gaps);
        let cfg = metainfer::model::load_config(&ckb, out.as_path()).unwrap();
        let contract = ckb.get(&cfg.family).unwrap();
        let tensors = metainfer::model::read_safetensors(out.as_path()).unwrap();
        let mut reference =
            metainfer::oracle::llama::Reference::of_family(contract.model.as_ref().unwrap(), &cfg, tensors, "f32")
                .unwrap();
        let logits = reference.step(1).unwrap();
        assert!(logits.len() == cfg.vocab && logits.iter().all(|v| v.is_finite()), "{name}");
    }
}

/// plan's phase goals say what the family's graph computes, not a Llama layer with its features
/// listed: Cohere's layer is a LayerNorm feeding attention and the MLP (parallel) with interleaved
/// RoPE and its logits scaled (transformers' CohereForCausalLM), Gemma 3's RoPE base is chosen by
/// the layer's type.
#[test]
fn plan_goals_are_rendered_from_the_family_graph() {
    use metainfer::ops::plan::{PlanRequest, plan_only};
    let t = tempfile::tempdir().unwrap();
    let c = ctx(t.path());
    let goal = |name: &str, phase: &str| -> String {
        let req = PlanRequest {
            model: shared().join("conformance").join(name).display().to_string(),
            target: "cpu".into(),
            dtype: "f32".into(),
            ..Default::default()
        };
        let r = plan_only(&c, &req).unwrap();
        assert!(r.covered, "{name}: {:?}", r.gaps);
        r.phases.iter().find(|p| p.phase == phase).unwrap_or_else(|| panic!("{name}: no {phase}")).goal.clone()
    };
    let layer = goal("cohere", "decoder_layer");
    assert!(layer.contains("attn_norm = layer_norm(stream) eps=layer_norm_eps"), "{layer}");
    assert!(layer.contains("gate = linear(attn_norm)") && layer.contains("interleaved=1"), "{layer}");
    assert!(!layer.contains("RMSNorm") && !layer.contains("rms_norm"), "{layer}");
    let forward = goal("cohere", "full_forward");
    assert!(forward.contains("logits = scale(lm_head) factor=logit_scale"), "{forward}");
    let layer = goal("gemma3_text", "decoder_layer");
    assert!(layer.contains("theta=rope_parameters[layer_types[layer]].rope_theta"), "{layer}");
}

/// The parameters a family's graph binds (what profile_engine's roofline streams per token) equal
/// transformers' own count for every covered family: the `parameters` column of
/// ../shared/conformance/README.md (transformers' num_parameters, a tied head counted once).
#[test]
fn graph_parameters_equal_transformers_parameter_counts() {
    let readme = std::fs::read_to_string(shared().join("conformance/README.md")).unwrap();
    let published: std::collections::BTreeMap<String, usize> = readme
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let n = cells.get(3)?.replace(',', "").parse::<usize>().ok()?;
            Some((cells.get(1)?.to_string(), n))
        })
        .collect();
    for name in COVERED {
        let (contract, cfg, _) = checkpoint(name);
        let config = serde_json::Value::Object(
            metainfer::model::read_config(shared().join("conformance").join(name).as_path()).unwrap(),
        );
        let p = metainfer::ops::synth::graph_parameters(&contract, &config).unwrap();
        assert_eq!(Some(&p.total), published.get(*name), "{name}: parameters the graph binds");
        assert_eq!(p.table, cfg.vocab * cfg.hidden, "{name}: the embedding table");
    }
}

/// vectors.json is evidence only with numbers in it: no prompts, a prompt without greedy ids, a
/// logit row shorter than the vocabulary, or a token id outside it is refused by name (an empty
/// file would otherwise pass every comparison vacuously and promote a staged family).
#[test]
fn vectors_without_numbers_are_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let c = ctx(t.path());
    let original = shared().join("conformance/llama");
    let vectors: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(original.join("vectors.json")).unwrap()).unwrap();
    type Case = (&'static str, fn(&mut serde_json::Value), &'static str);
    let cases: [Case; 4] = [
        ("empty", |v| v["prompts"] = serde_json::json!([]), "holds no prompts"),
        ("no-greedy", |v| v["prompts"][1]["greedy_ids"] = serde_json::json!([]), "prompt 1 has no greedy_ids"),
        (
            "short-row",
            |v| {
                v["prompts"][0]["logits"][2].as_array_mut().unwrap().pop();
            },
            "prompt 0 position 2 has 104 logits where the first row has 105",
        ),
        (
            "id",
            |v| v["prompts"][3]["ids"][0] = serde_json::json!(105),
            "prompt 3 (\"Tom and Sue went to the park\") holds a token id outside the vocabulary of 105",
        ),
    ];
    for (name, edit, want) in cases {
        let dir = t.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::fs::copy(original.join(f), dir.join(f)).unwrap();
        }
        let mut v = vectors.clone();
        edit(&mut v);
        std::fs::write(dir.join("vectors.json"), v.to_string()).unwrap();
        let e = conformance(&c, &[dir.display().to_string()]).unwrap_err();
        assert!(e.message.contains(want), "{name}: {}", e.message);
    }
    // Folders no contract covers show nothing: the report does not pass (the Llama checkpoint
    // relabelled as an architecture no contract routes).
    let dir = t.path().join("unrouted");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "vectors.json"] {
        std::fs::copy(original.join(f), dir.join(f)).unwrap();
    }
    let mut config = metainfer::model::read_config(original.as_path()).unwrap();
    config.insert("architectures".into(), serde_json::json!(["DeepseekV3ForCausalLM"]));
    config.insert("model_type".into(), serde_json::json!("deepseek_v3"));
    std::fs::write(dir.join("config.json"), serde_json::Value::Object(config).to_string()).unwrap();
    let r = conformance(&c, &[dir.display().to_string()]).unwrap();
    assert!(r.covered == 0 && !r.passed, "{}", metainfer::ops::Report::text(&r));
}

/// scripts/conformance-vectors.py, the way to evidence for a proposed family where transformers
/// runs: shrinking each conformance family's config.json (as transformers wrote it) keeps the
/// architecture (model_type, layer_types with one layer of each kind, the grouping of key/value
/// heads, expert counts) at the tiny sizes it documents; run where torch is missing, it exits 2
/// saying what to install and where to run it, and writes nothing.
#[test]
fn the_vectors_script_keeps_the_architecture_and_says_what_it_needs() {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/conformance-vectors.py");
    let probe = format!(
        r#"
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cv", {script:?})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
out = {{}}
for name in sys.argv[1:]:
    c = json.load(open({conformance:?} + "/" + name + "/config.json"))
    out[name] = m.shrink(c, 105, 4)
print(json.dumps(out))
"#,
        script = script.display().to_string(),
        conformance = shared().join("conformance").display().to_string(),
    );
    let names = ["llama", "gemma3_text", "gpt_oss", "qwen3_moe", "mixtral", "mistral"];
    let run = std::process::Command::new("python3")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg("-c")
        .arg(&probe)
        .args(names)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let got: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    for name in names {
        let theirs = metainfer::model::read_config(shared().join("conformance").join(name).as_path()).unwrap();
        let c = &got[name];
        assert_eq!(c["model_type"], theirs["model_type"], "{name}");
        assert_eq!((c["hidden_size"].as_u64(), c["num_attention_heads"].as_u64()), (Some(64), Some(4)), "{name}");
        assert_eq!(c["vocab_size"].as_u64(), Some(105), "{name}");
        assert!(c.get("quantization_config").is_none(), "{name}");
    }
    // Gemma 3's five local layers to one global need six layers to hold a global one.
    let kinds: Vec<&str> =
        got["gemma3_text"]["layer_types"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(kinds.len(), 6);
    assert_eq!(kinds.iter().filter(|k| **k == "full_attention").count(), 1);
    assert_eq!(got["gemma3_text"]["num_key_value_heads"].as_u64(), Some(1), "one KV head stays one");
    assert_eq!(got["llama"]["num_key_value_heads"].as_u64(), Some(2), "grouped heads stay grouped");
    assert_eq!(
        got["gpt_oss"]["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    );
    assert_eq!(
        (got["gpt_oss"]["num_local_experts"].as_u64(), got["gpt_oss"]["intermediate_size"].as_u64()),
        (Some(4), Some(32))
    );
    assert_eq!(got["mistral"]["sliding_window"].as_u64(), Some(4));

    // Without torch: exit 2, the reason and the remedy, nothing written.
    let have_torch =
        std::process::Command::new("python3").args(["-c", "import torch, transformers"]).status().unwrap().success();
    if !have_torch {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("vectors");
        let dir = shared().join("conformance/llama");
        let run = std::process::Command::new("python3")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .arg(&script)
            .arg(&dir)
            .arg(&dir)
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{err}");
        assert!(err.contains("pip install torch transformers") && err.contains("metainfer ckb conformance"), "{err}");
        assert!(!out.exists());
    }
}

/// scripts/conformance-vectors.py run with transformers: for every conformance family, vectors it
/// writes from the family's config.json (its own weights, prompts and hidden states) are reproduced
/// by the family's contract; and the Gemma 3 contract with one RoPE base on every layer (the
/// global one, the mistake the contract's failure mode rope-local-base-ignored names), proposed as
/// a new family, fails on them at prompt 0, position 1 (where RoPE first rotates), the hidden
/// states naming layer 0 (a sliding-window layer, whose base it got wrong). Needs torch and
/// transformers: the Python that has them in METAINFER_TRANSFORMERS_PYTHON (default `python3`).
#[test]
#[ignore = "needs torch and transformers: METAINFER_TRANSFORMERS_PYTHON=PYTHON cargo test --test it -- --ignored the_vectors_script_with_transformers"]
fn the_vectors_script_with_transformers_writes_evidence_every_family_reproduces() {
    let python = std::env::var("METAINFER_TRANSFORMERS_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/conformance-vectors.py");
    let t = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    for (name, dir) in folders() {
        let out = t.path().join(&name);
        let run = std::process::Command::new(&python)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .arg(&script)
            .arg(dir.join("config.json"))
            .arg(&dir)
            .arg(&out)
            .output()
            .unwrap();
        assert!(run.status.success(), "{name}: {}", String::from_utf8_lossy(&run.stderr));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("vectors.json")).unwrap()).unwrap();
        let layers = metainfer::model::read_config(out.as_path()).unwrap()["num_hidden_layers"].as_u64().unwrap();
        assert_eq!(v["prompts"][0]["hidden_states"].as_array().map(Vec::len), Some(layers as usize + 1), "{name}");
        dirs.push(s(&out));
    }
    let t2 = tempfile::tempdir().unwrap();
    let ctx = ctx(t2.path());
    let r = conformance(&ctx, &dirs).unwrap();
    assert!(r.passed && r.covered == dirs.len(), "{}", metainfer::ops::Report::text(&r));

    // One RoPE base on every layer: a wrong Gemma 3, proposed as a family of its own.
    let wc = t2.path().join("ckb");
    crate::evolve::working_copy(&wc);
    let mut ctx = ctx;
    ctx.ckb = metainfer::ckb::Ckb::from_dir(&wc).unwrap();
    ctx.ckb_dir = Some(wc);
    let g = t.path().join("gemma3_text");
    let mut config = metainfer::model::read_config(g.as_path()).unwrap();
    config.insert("architectures".into(), serde_json::json!(["Gemma3XForCausalLM"]));
    config.insert("model_type".into(), serde_json::json!("gemma3x"));
    std::fs::write(g.join("config.json"), serde_json::Value::Object(config).to_string()).unwrap();
    let local = "theta = \"rope_parameters[layer_types[layer]].rope_theta\"";
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("contracts/models/gemma3_text.toml"),
    )
    .unwrap();
    assert_eq!(text.matches(local).count(), 2, "q_rope and k_rope");
    let wrong = text
        .replacen("id = \"model.gemma3_text\"", "id = \"model.gemma3x\"", 1)
        .replace("architectures = [\"Gemma3ForCausalLM\"]", "architectures = [\"Gemma3XForCausalLM\"]")
        .replace("model_types = [\"gemma3_text\"]", "model_types = [\"gemma3x\"]")
        .replace(local, "theta = \"rope_parameters.full_attention.rope_theta\"");
    let staged =
        metainfer::ops::evolve::propose(&ctx, &metainfer::ops::evolve::ProposeRequest { toml: wrong }).unwrap();
    assert!(staged.staged, "{staged:?}");
    let r = conformance(&ctx, &[s(&g)]).unwrap();
    let f = &r.families[0];
    assert!(f.covered && !f.passed, "{}", metainfer::ops::Report::text(&r));
    let b = f.first_beyond.as_ref().unwrap();
    assert_eq!(
        (b.prompt, b.position, b.layer, b.point.as_deref()),
        (0, 1, Some(0), Some("position 1: layer 0 output"))
    );
    assert!(!f.promotions[0].promoted, "{:?}", f.promotions);
}
