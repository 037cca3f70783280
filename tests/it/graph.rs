//! The forward-pass graph of the family contracts: the interpreter (`oracle::graph`) gives the same
//! logits, bit for bit, as the hand-written reference (`oracle::llama`) on every synthetic family
//! checkpoint, Phi-3's fused layout and BabyLlama, under every model-level mutation too; its trace
//! names every node; malformed graphs are refused with the node named; lookup renders the graph.

use std::path::Path;

use metainfer::ckb::graph::lint_graph;
use metainfer::ckb::{Ckb, Contract, Graph, ModelFamily};
use metainfer::model::{self, ResolvedConfig, Tensors};
use metainfer::ops::synth::{SynthRequest, synth_config, synth_tensors_with, write_checkpoint};
use metainfer::oracle::graph::GraphReference;
use metainfer::oracle::llama::Reference;
use metainfer::oracle::mutants::{Mutation, Mutations};
use serde_json::{Value, json};

fn family(id: &str) -> ModelFamily {
    Ckb::embedded().unwrap().get(id).unwrap().model.clone().unwrap()
}

fn phi3() -> ModelFamily {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/evolution/model.phi3.toml"))
            .unwrap();
    toml::from_str::<Contract>(&text).unwrap().model.unwrap()
}

fn synth(root: &Path, name: &str, fam: &str, edit: impl FnOnce(&mut Value)) -> (ResolvedConfig, Tensors) {
    let req = SynthRequest { family: fam.into(), out: root.join(name), seed: 7, ..Default::default() };
    let mut config = synth_config(&req).unwrap();
    edit(&mut config);
    write_checkpoint(&req.out, &config, req.seed).unwrap();
    (model::load_config(&Ckb::embedded().unwrap(), &req.out).unwrap(), model::read_safetensors(&req.out).unwrap())
}

/// 12 steps (longer than mistral's window of 8) of the old and the graph reference, compared bit for bit.
fn same_bits(name: &str, fam: &ModelFamily, cfg: &ResolvedConfig, tensors: &Tensors, dtype: &str, m: Mutations) {
    let mut old = Reference::with_weight_dtype(cfg, tensors, dtype).unwrap();
    let mut new = GraphReference::new(fam, cfg, tensors, dtype).unwrap();
    old.set_mutations(m);
    new.set_mutations(m);
    for i in 0..12u32 {
        let t = (i * 7 + 3) % cfg.vocab as u32;
        let (a, b) = (old.step(t).unwrap(), new.step(t).unwrap());
        assert_eq!(a.len(), cfg.vocab);
        let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differ, 0, "{name} {dtype} {m:?}: step {i}: {differ} logits differ in their bits");
    }
}

/// (checkpoint name, synth family, config.json edit).
type Case<'a> = (&'a str, &'a str, &'a dyn Fn(&mut Value));

#[test]
fn graph_interpreter_gives_the_reference_logits_bit_for_bit() {
    let t = tempfile::tempdir().unwrap();
    let llama3 = |c: &mut Value| {
        c["rope_scaling"] = json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16
        })
    };
    let cases: [Case<'_>; 6] = [
        ("llama", "llama", &|_| {}),
        ("llama3", "llama", &llama3),
        ("mistral", "mistral", &|_| {}),
        ("qwen2", "qwen2", &|_| {}),
        ("qwen3", "qwen3", &|_| {}),
        ("gemma", "gemma", &|_| {}),
    ];
    for (name, fam, edit) in cases {
        let (cfg, tensors) = synth(t.path(), name, fam, edit);
        let f = family(&cfg.family);
        for dtype in ["f32", "bf16", "int8"] {
            same_bits(name, &f, &cfg, &tensors, dtype, Mutations::NONE);
        }
        for m in Mutation::ALL {
            same_bits(name, &f, &cfg, &tensors, "f32", Mutations::of(&[m]));
        }
    }
    // Phi-3's fused q/k/v and gate/up tensors with a sliding window, on the fused layout of the
    // synthetic Llama checkpoint.
    let req = SynthRequest { family: "llama".into(), out: t.path().join("x"), seed: 7, ..Default::default() };
    let config = synth_config(&req).unwrap();
    let features: Vec<String> = ["fused_qkv", "fused_gate_up", "sliding_window"].map(String::from).to_vec();
    let tensors: Tensors = synth_tensors_with(&config, &features, 7).into_iter().map(|(n, s, v)| (n, (s, v))).collect();
    let (mut cfg, _) = synth(t.path(), "phi3-base", "llama", |_| {});
    cfg.family = "model.phi3".into();
    cfg.features = features;
    cfg.sliding_window = 8;
    assert!(tensors.contains_key("model.layers.0.self_attn.qkv_proj.weight"));
    for dtype in ["f32", "bf16", "int8"] {
        same_bits("phi3", &phi3(), &cfg, &tensors, dtype, Mutations::NONE);
    }
    // BabyLlama, the real checkpoint.
    let dir = crate::babyllama();
    let (cfg, tensors) =
        (model::load_config(&Ckb::embedded().unwrap(), &dir).unwrap(), model::read_safetensors(&dir).unwrap());
    same_bits("babyllama", &family("model.llama"), &cfg, &tensors, "f32", Mutations::NONE);
    same_bits("babyllama", &family("model.llama"), &cfg, &tensors, "f32", Mutations::of(&[Mutation::RopeAdjacent]));
}

#[test]
fn trace_names_every_node_of_the_graph_in_order() {
    let t = tempfile::tempdir().unwrap();
    let (cfg, tensors) = synth(t.path(), "qwen3", "qwen3", |_| {});
    let f = family("model.qwen3");
    let mut r = GraphReference::new(&f, &cfg, &tensors, "f32").unwrap();
    let mut plain = GraphReference::new(&f, &cfg, &tensors, "f32").unwrap();
    plain.step(5).unwrap();
    r.step(5).unwrap();
    let (logits, trace) = r.step_traced(9).unwrap();
    assert_eq!(logits, plain.step(9).unwrap(), "tracing changes nothing");
    let g = f.graph.as_ref().unwrap();
    let names: Vec<&str> = trace.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), g.prologue.len() + cfg.n_layers * g.layer.len() + g.epilogue.len());
    assert_eq!(names[0], "embed");
    assert_eq!(names[1], "layers.0.attn_norm");
    assert!(names.contains(&"layers.1.q_norm") && names.contains(&"layers.1.k_rope"));
    assert_eq!(*names.last().unwrap(), "logits");
    assert_eq!(trace.last().unwrap().1, logits);
    let width = |n: &str| trace.iter().find(|(x, _)| x == n).unwrap().1.len();
    assert_eq!(width("layers.0.q"), cfg.n_heads * cfg.head_dim);
    assert_eq!(width("layers.0.k"), cfg.n_kv_heads * cfg.head_dim);
    assert_eq!(width("layers.0.mlp_residual"), cfg.hidden);
    assert_eq!(width("layers.0.act"), cfg.intermediate);
}

/// Lint the llama graph after `edit`; the single finding's (field, message).
fn refused(edit: impl FnOnce(&mut Graph)) -> Vec<(String, String)> {
    let f = family("model.llama");
    let mut g = f.graph.clone().unwrap();
    edit(&mut g);
    lint_graph(&g, &f)
}

#[test]
fn malformed_graphs_are_refused_with_the_node_named() {
    for fam in ["model.llama", "model.mistral", "model.qwen2", "model.qwen3", "model.gemma"] {
        let f = family(fam);
        assert_eq!(lint_graph(f.graph.as_ref().unwrap(), &f), vec![], "{fam}");
    }
    let p = phi3();
    assert_eq!(lint_graph(p.graph.as_ref().unwrap(), &p), vec![]);
    let at = |g: &Graph, name: &str| g.layer.iter().position(|n| n.name == name).unwrap();
    // The node's finding comes first; a weight no node reads any more adds one for the graph.
    let one = |f: Vec<(String, String)>, field: String, words: &[&str]| {
        let unread = f.iter().filter(|x| x.0 == "/model/graph" && x.1.contains("no node reads it")).count();
        assert_eq!(f.len() - unread, 1, "{f:?}");
        assert_eq!(f[0].0, field);
        for w in words {
            assert!(f[0].1.contains(w), "`{w}` not in: {}", f[0].1);
        }
    };
    let g = family("model.llama").graph.unwrap();
    let (o, k, down) = (at(&g, "o"), at(&g, "k_rope"), at(&g, "down"));
    one(
        refused(|g| g.layer[o].inputs = vec!["attn_out".into()]),
        format!("/model/graph/layer/{o}"),
        &["node `o`", "undefined input `attn_out`"],
    );
    one(
        refused(|g| g.layer[k].op = "yarn_rope".into()),
        format!("/model/graph/layer/{k}"),
        &["node `k_rope`", "unknown op `yarn_rope`"],
    );
    one(
        refused(|g| {
            g.layer[down].weights.insert("weight".into(), "model.layers.{i}.mlp.w2.weight".into());
        }),
        format!("/model/graph/layer/{down}"),
        &["node `down`", "unbound weight", "mlp.w2.weight"],
    );
    one(
        refused(|g| {
            g.layer[down].weights.remove("weight");
        }),
        format!("/model/graph/layer/{down}"),
        &["node `down`", "unbound weight", "slot `weight`"],
    );
    let q = at(&g, "q");
    let f = family("model.qwen2");
    let mut g2 = f.graph.clone().unwrap();
    g2.layer[q].weights.remove("bias");
    let found = lint_graph(&g2, &f);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, "/model/graph");
    assert!(found[0].1.contains("unbound weight: `model.layers.{i}.self_attn.q_proj.bias`"), "{}", found[0].1);
    // down_proj [hidden, intermediate] applied to the attention output (n_heads * head_dim wide).
    one(
        refused(|g| g.layer[down].inputs = vec!["attn".into()]),
        format!("/model/graph/layer/{down}"),
        &["node `down`", "shape mismatch", "columns"],
    );
    one(
        refused(|g| {
            g.layer[k].params.insert("heads".into(), "n_heads".into());
        }),
        format!("/model/graph/layer/{k}"),
        &["node `k_rope`", "shape mismatch", "heads * head_dim"],
    );
}

#[test]
fn lookup_renders_the_graph_node_by_node() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let req = metainfer::ops::lookup::LookupRequest { id: Some("model.gemma".into()), ..Default::default() };
    let r = metainfer::ops::lookup::lookup(&ctx, &req).unwrap();
    let g = r.contracts[0].graph.as_deref().expect("a model family renders its graph");
    for line in [
        "  embed = embedding(token) table=model.embed_tokens.weight",
        "  embed_scale = scale(embed) factor=f32(sqrt(hidden))",
        "  attn_norm = rms_norm(stream) weight=model.layers.{i}.input_layernorm.weight gain=one_plus_w",
        "  act = gelu_tanh_and_mul(gate, up)",
        "  logits = linear(final_norm) tied=model.embed_tokens.weight weight=lm_head.weight",
    ] {
        assert!(g.lines().any(|l| l == line), "missing `{line}` in\n{g}");
    }
}
