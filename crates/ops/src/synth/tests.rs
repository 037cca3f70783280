//! Unit tests of synth: the graph plan against the feature plan.

use super::tensors::tensor_plan;
use super::*;

/// The plan written from a family's graph bindings is, tensor for tensor (name, shape, draws),
/// the plan written from its features, for every built-in family tied and untied: so a family
/// added as a contract gets its checkpoint the way the built-in ones always did.
#[test]
fn the_graph_plan_is_the_feature_plan_of_every_builtin_family() {
    let ckb = ckb::Ckb::embedded().unwrap();
    for family in FAMILIES {
        for tied in [false, true] {
            let req = SynthRequest { family: family.to_string(), seed: 7, ..Default::default() };
            let mut config = synth_config(&req).unwrap();
            config["tie_word_embeddings"] = json!(tied);
            let contract = ckb.get(&format!("model.{family}")).unwrap();
            let want = tensor_plan(&config, &builtin_features(family));
            let got = graph_plan(contract, &config).unwrap();
            assert_eq!(got, want, "{family} tied={tied}");
            assert_eq!(got.iter().any(|t| t.name == "lm_head.weight"), !tied, "{family}");
        }
    }
    // Phi-3's fused tensors: one qkv_proj and one gate_up_proj, each drawn as its row blocks.
    let phi3: ckb::Contract =
        toml::from_str(include_str!("../../../../tests/fixtures/evolution/model.phi3.toml")).unwrap();
    let config = synth_config_for(&phi3, &SynthRequest { family: "phi3".into(), ..Default::default() }).unwrap();
    let features = phi3.model.as_ref().unwrap().features.clone();
    assert!(features.contains(&"fused_qkv".to_string()));
    let got = graph_plan(&phi3, &config).unwrap();
    assert_eq!(got, tensor_plan(&config, &features));
    let qkv = got.iter().find(|t| t.name == "model.layers.0.self_attn.qkv_proj.weight").unwrap();
    assert_eq!(qkv.draws.len(), 3);
}
