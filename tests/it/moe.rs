//! Mixture of experts (Qwen3-MoE, Mixtral, gpt-oss): configs the router cannot follow are refused by name,
//! a checkpoint missing an expert or holding one of another shape is refused naming the tensor, the
//! routing is what transformers computes (a flipped norm_topk_prob fails conformance), and a
//! decoded token is charged only the experts its router keeps.

use metainfer::model::{ResolvedConfig, Tensors};
use metainfer::oracle::graph::GraphReference;

use super::shared;

/// The conformance checkpoint of `name`: its family contract, config.json, resolved config and tensors.
fn checkpoint(
    name: &str,
) -> (metainfer::ckb::Contract, serde_json::Map<String, serde_json::Value>, ResolvedConfig, Tensors) {
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let dir = shared().join("conformance").join(name);
    let config = metainfer::model::read_config(dir.as_path()).unwrap();
    let contract = metainfer::model::route(&ckb, &config).unwrap().clone();
    let cfg = metainfer::model::resolve(&contract, &config).unwrap_or_else(|g| panic!("{name}: {g:?}"));
    (contract, config, cfg, metainfer::model::read_safetensors(dir.as_path()).unwrap())
}

/// The gaps resolving `config` against its family gives, one `field: reason` a line.
fn gaps(config: &serde_json::Map<String, serde_json::Value>) -> String {
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let contract = metainfer::model::route(&ckb, config).unwrap();
    match metainfer::model::resolve(contract, config) {
        Ok(_) => panic!("resolved: {config:?}"),
        Err(g) => g.iter().map(|g| format!("{}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n"),
    }
}

#[test]
fn configs_the_router_cannot_follow_are_refused_by_name() {
    let (_, config, _, _) = checkpoint("qwen3_moe");
    let mut c = config.clone();
    c["num_experts_per_tok"] = 5.into();
    let g = gaps(&c);
    assert!(
        g.contains("model.graph.layer.route") && g.contains("top_k = 5") && g.contains("more than the 4 experts"),
        "{g}"
    );
    let mut c = config.clone();
    c["mlp_only_layers"] = serde_json::json!([1]);
    let g = gaps(&c);
    assert!(g.contains("mlp_only_layers: `mlp_only_layers` = [1] is a feature model.qwen3_moe does not cover"), "{g}");
    let mut c = config.clone();
    c["decoder_sparse_step"] = 2.into();
    let g = gaps(&c);
    assert!(g.contains("decoder_sparse_step: value \"2\" is not covered"), "{g}");
    let mut c = config.clone();
    c["num_experts_per_tok"] = 0.into();
    let g = gaps(&c);
    assert!(g.contains("top_k = 0: a whole number of experts from 1"), "{g}");
    let (_, config, _, _) = checkpoint("mixtral");
    let mut c = config.clone();
    c["num_experts_per_tok"] = 9.into();
    let g = gaps(&c);
    assert!(g.contains("top_k = 9") && g.contains("more than the 4 experts"), "{g}");
    // Published Qwen3-MoE configs name the expert count num_experts (transformers 5 writes
    // num_local_experts): either resolves.
    let (contract, config, cfg, _) = checkpoint("qwen3_moe");
    let mut c = config.clone();
    let n = c.remove("num_local_experts").unwrap();
    c.insert("num_experts".into(), n);
    let r = metainfer::model::resolve(&contract, &c).unwrap();
    assert_eq!(r.role("n_experts"), cfg.role("n_experts"));
}

#[test]
fn a_missing_or_misshaped_expert_or_router_is_refused_naming_the_tensor() {
    let (contract, _, cfg, tensors) = checkpoint("mixtral");
    let family = contract.model.as_ref().unwrap();
    let refused = |edit: &dyn Fn(&mut Tensors)| -> String {
        let mut t = tensors.clone();
        edit(&mut t);
        match GraphReference::new(family, &cfg, &t, "f32") {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    };
    let missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    let e = refused(&|t| {
        t.remove(missing);
    });
    assert!(e.contains(&format!("no tensor `{missing}` (expert 3 of 4")), "{e}");
    let e = refused(&|t| {
        let w = t.get_mut("model.layers.2.block_sparse_moe.experts.0.w1.weight").unwrap();
        *w = (vec![64, 128], w.1.clone());
    });
    assert!(e.contains("experts.0.w1.weight` has shape [64, 128], config.json implies Some([128, 64])"), "{e}");
    let e = refused(&|t| {
        let w = t.get_mut("model.layers.0.block_sparse_moe.gate.weight").unwrap();
        *w = (vec![5, 64], vec![0.0; 5 * 64]);
    });
    assert!(e.contains("block_sparse_moe.gate.weight` has shape [5, 64], config.json implies [4, 64]"), "{e}");
}

/// The routing is transformers': the conformance checkpoint's vectors were computed with
/// norm_topk_prob true, so the same checkpoint declared without renormalisation fails conformance
/// at the first position, while a reference ignoring the flag would have passed both.
#[test]
fn conformance_tells_renormalised_routing_from_the_softmax_over_all_experts() {
    let t = tempfile::tempdir().unwrap();
    let c = super::ctx(t.path());
    let original = shared().join("conformance/qwen3_moe");
    let copy = t.path().join("qwen3_moe");
    std::fs::create_dir(&copy).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "vectors.json", "generation_config.json"] {
        std::fs::copy(original.join(f), copy.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(original.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["norm_topk_prob"], true);
    config["norm_topk_prob"] = false.into();
    std::fs::write(copy.join("config.json"), config.to_string()).unwrap();
    let r = metainfer::ops::conformance::conformance(&c, &[original.display().to_string(), copy.display().to_string()])
        .unwrap();
    assert!(r.families[0].covered && r.families[0].passed, "{:?}", r.families[0]);
    let flipped = &r.families[1];
    assert!(flipped.covered && !flipped.passed && !r.passed, "{flipped:?}");
    assert!(flipped.max_abs_diff > 1e-2, "{}", flipped.max_abs_diff);
}

/// A decoded token reads the router and the top_k experts it keeps, not every expert: the
/// parameters profile charges per token are the total less (experts - top_k) experts per layer,
/// worked by hand from config.json (each expert: gate and up [inter, hidden], down [hidden, inter]).
#[test]
fn a_decoded_token_streams_only_the_experts_its_router_keeps() {
    for (name, inter_key) in [("qwen3_moe", "moe_intermediate_size"), ("mixtral", "intermediate_size")] {
        let (contract, config, cfg, _) = checkpoint(name);
        let n = |k: &str| config[k].as_u64().unwrap() as usize;
        let (experts, k, inter, hidden, layers) =
            (n("num_local_experts"), n("num_experts_per_tok"), n(inter_key), n("hidden_size"), n("num_hidden_layers"));
        let p = metainfer::ops::synth::graph_parameters(&contract, &serde_json::Value::Object(config.clone())).unwrap();
        let per_expert = 3 * inter * hidden;
        assert_eq!(p.idle_experts, (experts - k) * per_expert * layers, "{name}");
        assert_eq!(p.expert_fraction, Some(k as f64 / experts as f64), "{name}");
        assert_eq!(p.streamed(false), p.total - p.idle_experts - cfg.vocab * hidden, "{name}");
        // The roofline's point costs charge the experts node top_k experts at the weight dtype.
        let graph = contract.model.as_ref().unwrap().graph.as_ref().unwrap();
        let costs =
            metainfer::ops::profile::roofline::point_costs(graph, contract.model.as_ref().unwrap(), &cfg, "bf16", 16);
        let experts_node = costs.iter().find(|c| c.node == "experts").unwrap();
        assert_eq!(experts_node.bytes, (k * per_expert * layers * 2) as f64, "{name}");
        assert_eq!(experts_node.kernel, "kernel.moe_experts");
    }
    // gpt-oss: every expert of a layer in four fused tensors (gate_up [E, hidden, 2 inter] with its
    // bias [E, 2 inter], down [E, inter, hidden] with its bias [E, hidden]): one expert is
    // 3 inter hidden + 2 inter + hidden parameters, and a token reads k of the E.
    let (contract, config, cfg, _) = checkpoint("gpt_oss");
    let n = |k: &str| config[k].as_u64().unwrap() as usize;
    let (experts, k, inter, hidden, layers) = (
        n("num_local_experts"),
        n("num_experts_per_tok"),
        n("intermediate_size"),
        n("hidden_size"),
        n("num_hidden_layers"),
    );
    assert_eq!((experts, k, inter, hidden, layers), (4, 2, 32, 64, 4));
    let p = metainfer::ops::synth::graph_parameters(&contract, &serde_json::Value::Object(config.clone())).unwrap();
    let per_expert = 3 * 32 * 64 + 2 * 32 + 64;
    assert_eq!(p.idle_experts, 2 * per_expert * 4);
    assert_eq!(p.expert_fraction, Some(0.5));
    let graph = contract.model.as_ref().unwrap().graph.as_ref().unwrap();
    let costs =
        metainfer::ops::profile::roofline::point_costs(graph, contract.model.as_ref().unwrap(), &cfg, "bf16", 16);
    let experts_node = costs.iter().find(|c| c.node == "experts").unwrap();
    // The fused matrices at 2 bytes, their biases at 4 (kept f32), for the 2 experts of 4 kept.
    let matrices = 3 * 32 * 64;
    let biases = 2 * 32 + 64;
    assert_eq!(experts_node.bytes, ((2 * matrices * 2 + 2 * biases * 4) * 4) as f64);
    assert_eq!(experts_node.kernel, "kernel.moe_experts_clamped");
    let (contract, config, _, _) = checkpoint("qwen3");
    let p = metainfer::ops::synth::graph_parameters(&contract, &serde_json::Value::Object(config)).unwrap();
    assert_eq!((p.idle_experts, p.expert_fraction), (0, None), "a dense family reads every weight");
}

/// profile_engine on a mixture of experts: the plain engine declared for Qwen3-MoE, on the
/// checkpoint transformers wrote, reports that a decoded token reads half of the expert weights
/// (top 2 of 4) and bytes per token of the weights it reads, worked by hand from config.json: every
/// tensor but the embedding table and the two idle experts of each layer, at 4 bytes (f32).
#[test]
fn profile_reports_the_bytes_of_the_active_experts() {
    use metainfer::ops::Report;
    use metainfer::ops::profile::{ProfileRequest, profile};
    let t = tempfile::tempdir().unwrap();
    let c = super::ctx(t.path());
    let engine = t.path().join("engine");
    crate::Engine::Plain.copy_to(&engine);
    let manifest = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    let declared = manifest.replace("family = \"model.llama\"", "family = \"model.qwen3_moe\"");
    assert_ne!(declared, manifest);
    std::fs::write(engine.join("metainfer.toml"), declared).unwrap();
    let model = shared().join("conformance/qwen3_moe");
    let budget = metainfer::harness::Budget::secs(900);
    // Phase order: profile figures count on sources verify passed, verify on sources whose kernels did.
    let k = metainfer::ops::kernel_test::kernel_test(
        &c,
        &metainfer::ops::kernel_test::KernelTestRequest {
            engine: engine.display().to_string(),
            kernels: vec![],
            seed: Some(3),
            ..Default::default()
        },
        &budget,
    )
    .unwrap();
    assert!(k.passed, "{}", k.text());
    let v = metainfer::ops::verify::verify(
        &c,
        &metainfer::ops::verify::VerifyRequest {
            engine: engine.display().to_string(),
            model: model.display().to_string(),
            prompts: vec!["Once upon a time".into()],
            max_new_tokens: Some(8),
            seed: Some(3),
            ..Default::default()
        },
        &budget,
    )
    .unwrap();
    assert!(v.passed, "{}", v.text());
    let req = ProfileRequest {
        engine: engine.display().to_string(),
        model: model.display().to_string(),
        prompt_len: Some(8),
        new_tokens: Some(8),
        threads: Some(1),
        runs: Some(2),
        ..Default::default()
    };
    let p = profile(&c, &req, &budget).unwrap();
    assert!(p.passed, "{}", p.text());
    assert_eq!(p.expert_fraction, Some(0.5), "{}", p.text());
    // 162,624 parameters (../shared/conformance/README.md), less the table 105 x 64 and, in each
    // of the 4 layers, 2 idle experts of 3 x 32 x 64 weights.
    let read = 162_624 - 105 * 64 - 4 * 2 * 3 * 32 * 64;
    assert_eq!(p.bytes_per_token, 4.0 * read as f64, "{}", p.text());
    assert!(p.text().contains("a decoded token reads 50.0% of the expert weights"), "{}", p.text());
}

/// Published mixtures of experts (their config.json as released; tests/fixtures/configs) plan as
/// their families, and the parameters their graphs bind equal the published counts: Qwen3-30B-A3B
/// 30.5B in all and 3.3B activated per token (Qwen3 Technical Report, arXiv:2505.09388), Mixtral
/// 8x7B 46.7B and 12.9B (arXiv:2401.04088), each to the published figures' precision (0.1B).
#[test]
fn published_moe_models_plan_and_read_their_published_active_parameters() {
    use metainfer::ops::plan::{PlanRequest, plan_only};
    let t = tempfile::tempdir().unwrap();
    let c = super::ctx(t.path());
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs");
    for (file, family, total, active) in [
        ("qwen3-30b-a3b.json", "model.qwen3_moe", 30.5e9, 3.3e9),
        ("mixtral-8x7b.json", "model.mixtral", 46.7e9, 12.9e9),
    ] {
        let dir = t.path().join(file);
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(fixtures.join(file), dir.join("config.json")).unwrap();
        let r = plan_only(
            &c,
            &PlanRequest {
                model: dir.display().to_string(),
                target: "cpu".into(),
                dtype: "bf16".into(),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(r.covered && r.family == family, "{file}: {} {:?}", r.family, r.gaps);
        let kernels: Vec<&str> = r.phases[0].contracts.iter().map(String::as_str).collect();
        assert!(kernels.contains(&"kernel.moe_route") && kernels.contains(&"kernel.moe_experts"), "{kernels:?}");
        let ckb = metainfer::ckb::Ckb::embedded().unwrap();
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let p = metainfer::ops::synth::graph_parameters(ckb.get(family).unwrap(), &config).unwrap();
        // The figures are given to 0.1B (Qwen3-30B-A3B's 3.35B activated is published as 3.3B).
        let within = |got: usize, published: f64| (got as f64 - published).abs() < 0.1e9;
        assert!(within(p.total, total), "{file}: {} parameters, published {total:e}", p.total);
        assert!(
            within(p.total - p.idle_experts, active),
            "{file}: {} active, published {active:e}",
            p.total - p.idle_experts
        );
    }
}

/// gpt-oss-20b as published: its MXFP4 experts (`quantization_config`) are refused at plan by name;
/// the same config without them (a BF16 export) plans as model.gpt_oss, and the parameters its
/// graph binds equal the model card's: 20.9B in all and 3.6B active per token, the unembedding
/// counted and the embedding table not (arXiv:2508.10925, Table 1), to the card's precision (0.1B).
#[test]
fn published_gpt_oss_plans_refuses_mxfp4_and_reads_its_published_active_parameters() {
    use metainfer::ops::plan::{PlanRequest, plan_only};
    let t = tempfile::tempdir().unwrap();
    let c = super::ctx(t.path());
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs/gpt-oss-20b.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let plan = |config: &serde_json::Value, name: &str| {
        let dir = t.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let req = PlanRequest {
            model: dir.display().to_string(),
            target: "cpu".into(),
            dtype: "bf16".into(),
            ..Default::default()
        };
        plan_only(&c, &req).unwrap()
    };
    let r = plan(&config, "mxfp4");
    assert!(!r.covered && r.gaps.iter().any(|g| g.field == "quantization_config"), "{:?}", r.gaps);
    config.as_object_mut().unwrap().remove("quantization_config");
    let r = plan(&config, "bf16");
    assert!(r.covered && r.family == "model.gpt_oss", "{} {:?}", r.family, r.gaps);
    let kernels: Vec<&str> = r.phases[0].contracts.iter().map(String::as_str).collect();
    assert!(
        kernels.contains(&"kernel.attention_sinks") && kernels.contains(&"kernel.moe_experts_clamped"),
        "{kernels:?}"
    );
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let p = metainfer::ops::synth::graph_parameters(ckb.get("model.gpt_oss").unwrap(), &config).unwrap();
    let within = |got: usize, published: f64| (got as f64 - published).abs() < 0.1e9;
    assert!(within(p.total, 20.9e9), "{} parameters", p.total);
    let active = p.total - p.idle_experts - p.table;
    assert!(within(active, 3.6e9), "{active} active");
    assert_eq!(p.expert_fraction, Some(4.0 / 32.0));
}

/// The mixture-of-experts presets write Qwen3-MoE checkpoints at their shapes, counted by hand.
/// qwen3-moe-mini (hidden 256, 4 layers, 8 query and 1 KV heads of 32, 32 experts of width 96, 2 per
/// token, vocabulary 4096, untied): per layer q and o 256 x 256, k and v 32 x 256, q/k norms 32
/// each, two norms of 256, the router 32 x 256 and the experts 32 x 3 x 96 x 256 = 2,515,520; four
/// layers, the final norm and two 4096 x 256 tables: 12,159,488. A token reads all but 30 experts
/// per layer and the embedding table: 2,263,552. qwen3-moe-1b-active (hidden 2048, 28 layers, 16 and
/// 4 heads of 128, 16 experts of width 1024, 4 per token, vocabulary 32000): 3,244,286,976 in all,
/// 1,064,821,760 read per token (checked from its config without writing its 6.5 GB).
#[test]
fn moe_presets_write_qwen3_moe_at_their_shapes() {
    use metainfer::ops::synth::{SynthRequest, contract_preset_request, graph_parameters, synth_config_for, synth_in};
    let t = tempfile::tempdir().unwrap();
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let contract = ckb.get("model.qwen3_moe").unwrap();
    let out = t.path().join("mini");
    let req = SynthRequest { preset: Some("qwen3-moe-mini".into()), out: out.clone(), seed: 2, ..Default::default() };
    let r = synth_in(&ckb, &req).unwrap();
    assert_eq!(r.family, "qwen3_moe");
    let config = serde_json::Value::Object(metainfer::model::read_config(out.as_path()).unwrap());
    assert_eq!((config["num_local_experts"].as_u64(), config["num_experts_per_tok"].as_u64()), (Some(32), Some(2)));
    let p = graph_parameters(contract, &config).unwrap();
    assert_eq!((p.total, p.streamed(false), p.expert_fraction), (12_159_488, 2_263_552, Some(2.0 / 32.0)));
    let stored: usize = metainfer::model::read_safetensors(out.as_path())
        .unwrap()
        .values()
        .map(|(s, _)| s.iter().product::<usize>())
        .sum();
    assert_eq!(stored, 12_159_488, "the checkpoint holds what the graph binds");
    let c = super::ctx(t.path());
    let plan = metainfer::ops::plan::plan_only(
        &c,
        &metainfer::ops::plan::PlanRequest {
            model: out.display().to_string(),
            target: "cpu".into(),
            dtype: "bf16".into(),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(plan.covered && plan.family == "model.qwen3_moe", "{:?}", plan.gaps);
    let big =
        contract_preset_request(&SynthRequest { preset: Some("qwen3-moe-1b-active".into()), ..Default::default() })
            .unwrap()
            .unwrap();
    let config = synth_config_for(contract, &big).unwrap();
    let p = graph_parameters(contract, &config).unwrap();
    assert_eq!((p.total, p.streamed(false)), (3_244_286_976, 1_064_821_760));
}

/// gpt-oss-mini writes gpt-oss at its shape, counted by hand (hidden 256, 4 layers, 8 query and 1
/// KV heads of 32, 32 experts of width 256, 4 per token, vocabulary 4096, untied). Per layer: q and
/// o 256 x 256 with biases of 256, k and v 32 x 256 with biases of 32, 8 sinks (148,040), two norms
/// of 256, the router 32 x 256 + 32, and the experts 32 x (256 x 512 + 512 + 256 x 256 + 256) =
/// 6,316,032; four layers, the final norm and two 4096 x 256 tables: 27,988,640. A token reads all
/// but 28 experts (197,376 each) per layer and the embedding table: 4,833,952. The window is the
/// published 128 on the sliding layers, and the RoPE YaRN.
#[test]
fn gpt_oss_preset_writes_gpt_oss_at_its_shape() {
    use metainfer::ops::synth::{SynthRequest, graph_parameters, synth_in};
    let t = tempfile::tempdir().unwrap();
    let ckb = metainfer::ckb::Ckb::embedded().unwrap();
    let contract = ckb.get("model.gpt_oss").unwrap();
    let out = t.path().join("mini");
    let req = SynthRequest { preset: Some("gpt-oss-mini".into()), out: out.clone(), seed: 2, ..Default::default() };
    let r = synth_in(&ckb, &req).unwrap();
    assert_eq!(r.family, "gpt_oss");
    let config = serde_json::Value::Object(metainfer::model::read_config(out.as_path()).unwrap());
    assert_eq!((config["num_local_experts"].as_u64(), config["num_experts_per_tok"].as_u64()), (Some(32), Some(4)));
    assert_eq!(config["sliding_window"].as_u64(), Some(128));
    assert_eq!(config["rope_parameters"]["rope_type"], "yarn");
    let p = graph_parameters(contract, &config).unwrap();
    assert_eq!((p.total, p.streamed(false), p.expert_fraction), (27_988_640, 4_833_952, Some(4.0 / 32.0)));
    let stored: usize = metainfer::model::read_safetensors(out.as_path())
        .unwrap()
        .values()
        .map(|(s, _)| s.iter().product::<usize>())
        .sum();
    assert_eq!(stored, 27_988_640, "the checkpoint holds what the graph binds");
    let cfg = metainfer::model::load_config(&ckb, out.as_path()).unwrap();
    assert_eq!((cfg.family.as_str(), cfg.sliding_window), ("model.gpt_oss", 128));
    let scaling = cfg.rope_scaling.as_ref().unwrap();
    // 0.1 ln 32 + 1 (YaRN's attention factor at factor 32).
    assert!((scaling.attention_factor - 1.346_573_590_279_972_6).abs() < 1e-12, "{scaling:?}");
}

/// The plain example engine serves the mixtures of experts: pointed at the Qwen3-MoE and GPT-OSS
/// conformance checkpoints (its metainfer.toml's family rewritten, as the conformance test does),
/// verify_batching passes: the block manager, the scheduler on its request trace, and eight
/// sequences of the batched run (prefill chunks beside decode rows over one paged cache; each
/// layer's routing computed for every row of a step, then each selected expert run once on the rows
/// routed to it) equal to their single-sequence reference. Its paged attention passes the kernel
/// contract too. That each selected expert runs once per step is the engine's own unit test
/// (`batched_step_equals_the_single_sequence_forward_and_runs_each_expert_once_per_step`).
#[test]
fn plain_engine_groups_experts_and_passes_verify_batching() {
    use metainfer::harness::Budget;
    use metainfer::ops::Report;
    use metainfer::ops::batching::{BatchingRequest, verify_batching};
    use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let engine = t.path().join("plain");
    crate::Engine::Plain.copy_to(&engine);
    let manifest = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    assert!(manifest.contains("[serving]"), "{manifest}");
    for name in ["qwen3_moe", "gpt_oss"] {
        let (contract, _, _, _) = checkpoint(name);
        let declared: String = manifest
            .lines()
            .map(|l| if l.starts_with("family = ") { format!("family = {:?}", contract.id) } else { l.to_string() })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(engine.join("metainfer.toml"), declared).unwrap();
        if name == "qwen3_moe" {
            let req = KernelTestRequest {
                engine: crate::s(&engine),
                kernels: vec!["kernel.paged_attention".into()],
                seed: Some(5),
                ..Default::default()
            };
            let k = kernel_test(&ctx, &req, &Budget::secs(900)).unwrap();
            assert!(k.passed && k.text().contains("kernel.paged_attention"), "{}", k.text());
        }
        let req = BatchingRequest {
            engine: crate::s(&engine),
            model: crate::s(&shared().join("conformance").join(name)),
            sequences: Some(8),
            ..Default::default()
        };
        let v = verify_batching(&ctx, &req, &Budget::secs(900)).unwrap();
        assert!(v.passed, "{name}: {}", v.text());
        crate::assert_conforms(&v);
        assert_eq!(v.sequences.len(), 8, "{name}");
        assert!(v.block_manager.passed && v.max_chunks_per_step >= 2, "{name}: {}", v.text());
        assert!(v.sequences.iter().all(|q| q.tokens_ok && q.logits_ok && q.steps >= 1), "{name}: {}", v.text());
        let sc = &v.scheduler;
        assert!(sc.passed && sc.requests >= 6, "{name}: {sc:?}");
        assert_eq!(sc.refused + sc.aborted + sc.finished, sc.requests, "{name}: every request ends: {sc:?}");
        eprintln!("{name}: {}", v.text());
    }
}
