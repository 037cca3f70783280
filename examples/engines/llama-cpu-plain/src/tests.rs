//! The whole engine on BabyLlama (examples/models/babyllama-105 in the metainfer repository, or the
//! directory in `$BABYLLAMA_DIR`): the tokenizer, the stop tokens and greedy decoding against the
//! golden output that four independent implementations agreed on (numpy, llama2.c, candle,
//! llama.cpp; metainfer's ../shared/golden/babyllama-105-once-upon-a-time.json). And every family
//! on the conformance checkpoints transformers wrote (metainfer's ../shared/conformance, or
//! `$CONFORMANCE_DIR`): the logits at every prompt position and 16 greedy tokens equal transformers'.

use std::path::PathBuf;

use serde_json::{Map, Value, json};

use crate::{
    config::{Config, ExpertLayout, RopeScaling},
    generate,
    model::Model,
    tokenizer::Tokenizer,
};

/// "Once upon a time" as BabyLlama's tokenizer encodes it (BOS 1 first): the golden prompt_ids.
const PROMPT_IDS: [u32; 18] = [1, 3, 34, 9, 22, 4, 3, 18, 20, 7, 9, 3, 5, 3, 6, 10, 16, 4];
/// The first 16 greedy tokens after the prompt: the golden greedy_ids[18..34].
const GREEDY_16: [u32; 16] = [25, 3, 6, 8, 4, 13, 4, 3, 17, 5, 12, 3, 5, 3, 14, 10];

fn babyllama() -> PathBuf {
    let dir = std::env::var_os("BABYLLAMA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/babyllama-105")));
    assert!(
        dir.join("model.safetensors").is_file(),
        "{}: no BabyLlama here; set BABYLLAMA_DIR to metainfer's examples/models/babyllama-105",
        dir.display()
    );
    dir
}

#[test]
fn tokenizer_encodes_and_decodes_the_golden_prompt() {
    let tok = Tokenizer::load(&babyllama()).unwrap();
    assert_eq!(tok.encode("Once upon a time"), PROMPT_IDS);
    assert_eq!(tok.decode(&PROMPT_IDS), "Once upon a time");
}

#[test]
fn greedy_decoding_gives_the_golden_tokens_and_reset_starts_over() {
    let dir = babyllama();
    let mut model = Model::load(&dir).unwrap();
    assert_eq!((model.vocab_size(), model.max_seq_len()), (105, 256), "BabyLlama's config.json");
    let run = |model: &mut Model| {
        let mut next = generate::sample_greedy(model.prefill(&PROMPT_IDS, 0));
        let mut out = vec![next];
        while out.len() < GREEDY_16.len() {
            next = generate::sample_greedy(model.forward(next, PROMPT_IDS.len() + out.len() - 1));
            out.push(next);
        }
        out
    };
    assert_eq!(run(&mut model), GREEDY_16);
    model.reset();
    assert_eq!(run(&mut model), GREEDY_16, "after reset the cache must start empty");
    let tok = Tokenizer::load(&dir).unwrap();
    let all: Vec<u32> = PROMPT_IDS.iter().chain(&GREEDY_16).copied().collect();
    assert_eq!(tok.decode(&all), "Once upon a time, there was a li");
}

/// The weight reader (the CUDA engine's too): BabyLlama split into two shards with an index reads
/// tensor for tensor what the safetensors crate reads from the single file, bit for bit, and the
/// model on the shards gives the golden greedy tokens. A tensor taken twice, or with another shape,
/// is refused by name; a shard named outside the directory is refused before anything is read.
#[test]
fn sharded_checkpoint_reads_like_the_single_file() {
    let dir = babyllama();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let single = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = single.names().into_iter().map(str::to_string).collect();
    names.sort();
    let out = std::env::temp_dir().join(format!("llama-cpu-plain-shards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(dir.join(f), out.join(f)).unwrap();
    }
    let half = names.len() / 2;
    let mut weight_map = Map::new();
    for (i, part) in [&names[..half], &names[half..]].into_iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            part.iter().map(|n| (n.clone(), single.tensor(n).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &out.join(&file)).unwrap();
        for n in part {
            weight_map.insert(n.clone(), Value::String(file.clone()));
        }
    }
    let index = json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let mut w = crate::weights::read(&out).unwrap();
    for n in &names {
        let view = single.tensor(n).unwrap();
        let want: Vec<u32> =
            view.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let got: Vec<u32> = w.take(n, view.shape()).unwrap().iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{n}");
    }
    let e = w.take(&names[0], &[1]).unwrap_err();
    assert!(e.contains(&format!("missing tensor {}", names[0])), "{e}");
    let mut w = crate::weights::read(&out).unwrap();
    let e = w.take("model.norm.weight", &[7]).unwrap_err();
    assert!(e.contains("tensor model.norm.weight has shape [128]"), "{e}");

    let mut model = Model::load(&out).unwrap();
    let mut next = generate::sample_greedy(model.prefill(&PROMPT_IDS, 0));
    let mut got = vec![next];
    while got.len() < GREEDY_16.len() {
        next = generate::sample_greedy(model.forward(next, PROMPT_IDS.len() + got.len() - 1));
        got.push(next);
    }
    assert_eq!(got, GREEDY_16);

    let escaping = json!({"weight_map": {"model.norm.weight": "../model.safetensors"}});
    std::fs::write(out.join("model.safetensors.index.json"), escaping.to_string()).unwrap();
    let e = crate::weights::read(&out).err().unwrap();
    assert!(e.contains("not a file beside the index"), "{e}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn stop_tokens_read_generation_config_first_then_config() {
    let t = std::env::temp_dir().join(format!("llama-cpu-plain-stop-{}", std::process::id()));
    let write = |files: &[(&str, &str)]| {
        let _ = std::fs::remove_dir_all(&t);
        std::fs::create_dir_all(&t).unwrap();
        for (name, text) in files {
            std::fs::write(t.join(name), text).unwrap();
        }
    };
    assert_eq!(generate::stop_tokens(&babyllama()).unwrap(), [2], "BabyLlama's config.json eos_token_id");
    write(&[("config.json", r#"{"eos_token_id": 2}"#), ("generation_config.json", r#"{"eos_token_id": [7, 9]}"#)]);
    assert_eq!(generate::stop_tokens(&t).unwrap(), [7, 9]);
    write(&[("config.json", r#"{"eos_token_id": null}"#)]);
    assert_eq!(generate::stop_tokens(&t).unwrap(), [] as [u32; 0]);
    write(&[("config.json", r#"{"eos_token_id": -1}"#)]);
    let e = generate::stop_tokens(&t).unwrap_err();
    assert!(e.contains("config.json") && e.contains("eos_token_id"), "{e}");
    let _ = std::fs::remove_dir_all(&t);
}

/// The conformance folders the engine covers, one per family it reads (config.json's model_type).
const CONFORMANCE_FAMILIES: [&str; 17] = [
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

fn conformance() -> PathBuf {
    let dir = std::env::var_os("CONFORMANCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../../shared/conformance")));
    assert!(
        dir.join("llama/vectors.json").is_file(),
        "{}: no conformance checkpoints here; set CONFORMANCE_DIR to metainfer's ../shared/conformance",
        dir.display()
    );
    dir
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Every family on the checkpoint transformers 5 wrote for it (random weights, config.json as
/// transformers writes it): teacher-forced on each prompt of vectors.json, every logit within
/// 1e-4 + 1e-4 |x| of transformers' float32 logits (both compute in f32; the measured difference is
/// below 1e-5), and 16 greedy tokens after the prompt equal to transformers'. The mixture-of-experts
/// families (Qwen3-MoE, Mixtral, GPT-OSS with its attention sinks, YaRN and clamped experts)
/// included. A folder whose family the engine does not read must be refused by name, never skipped.
#[test]
fn every_family_equals_transformers_on_its_conformance_checkpoint() {
    let root = conformance();
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let Ok(text) = std::fs::read_to_string(dir.join("vectors.json")) else { continue };
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let model = Model::load(&dir);
        if !CONFORMANCE_FAMILIES.contains(&name.as_str()) {
            let e = model.err().unwrap_or_else(|| panic!("{name}: loaded, but is not listed as covered"));
            assert!(e.contains("not a covered family"), "{name}: {e}");
            continue;
        }
        let mut model = model.unwrap_or_else(|e| panic!("{name}: {e}"));
        let vectors: Value = serde_json::from_str(&text).unwrap();
        let mut worst = 0.0f64;
        for p in vectors["prompts"].as_array().unwrap() {
            let prompt = ids(&p["ids"]);
            model.reset();
            for (pos, (&token, want)) in prompt.iter().zip(p["logits"].as_array().unwrap()).enumerate() {
                let got = model.forward(token, pos);
                let want = want.as_array().unwrap();
                assert_eq!(got.len(), want.len(), "{name}: vocabulary");
                for (j, (&g, w)) in got.iter().zip(want).enumerate() {
                    let (g, w) = (g as f64, w.as_f64().unwrap());
                    assert!(
                        (g - w).abs() <= 1e-4 + 1e-4 * w.abs(),
                        "{name} {:?} position {pos} logit {j}: {g} against transformers' {w}",
                        p["text"]
                    );
                    worst = worst.max((g - w).abs());
                }
            }
            let want = ids(&p["greedy_ids"]);
            model.reset();
            let mut next = generate::sample_greedy(model.prefill(&prompt, 0));
            let mut got = vec![next];
            while got.len() < want.len() {
                next = generate::sample_greedy(model.forward(next, prompt.len() + got.len() - 1));
                got.push(next);
            }
            assert_eq!(got, want, "{name} {:?}: greedy tokens against transformers'", p["text"]);
        }
        eprintln!("{name}: max |logit - transformers'| {worst:.1e}");
        seen.push(name);
    }
    seen.sort();
    assert_eq!(seen, CONFORMANCE_FAMILIES, "{}: every covered family has its folder", root.display());
}

/// config.json of a conformance checkpoint as an object.
fn conformance_config(family: &str) -> Map<String, Value> {
    let text = std::fs::read_to_string(conformance().join(family).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The mixture-of-experts settings as transformers' configuration classes read them: Qwen3-MoE's
/// expert count from num_local_experts or its alias num_experts, norm_topk_prob default false,
/// moe_intermediate_size as the expert width; Mixtral always renormalised, experts as wide as
/// intermediate_size, rope_theta 1e6 and no sliding window by default. What they do not cover is
/// refused by the key's name: dense layers (decoder_sparse_step, mlp_only_layers), top_k outside
/// 1..=experts, the two expert-count keys disagreeing.
#[test]
fn moe_configs_read_as_transformers_does_and_refuse_what_they_do_not_cover() {
    let qwen = conformance_config("qwen3_moe");
    let m = Config::from_json(&qwen).unwrap().moe.unwrap();
    assert_eq!((m.n_experts, m.top_k, m.renormalize, m.inter), (4, 2, true, 32));
    let mut published = qwen.clone();
    published.remove("num_local_experts");
    published.remove("norm_topk_prob");
    published.insert("num_experts".into(), json!(4));
    let m = Config::from_json(&published).unwrap().moe.unwrap();
    assert_eq!((m.n_experts, m.renormalize), (4, false));
    for (key, value) in [
        ("decoder_sparse_step", json!(2)),
        ("mlp_only_layers", json!([1])),
        ("num_experts_per_tok", json!(5)),
        ("num_experts_per_tok", json!(0)),
        ("num_experts", json!(8)),
    ] {
        let mut c = qwen.clone();
        c.insert(key.into(), value.clone());
        let e = Config::from_json(&c).err().unwrap_or_else(|| panic!("{key} = {value} accepted"));
        assert!(e.contains(key), "{key} = {value}: {e}");
    }
    let mut mixtral = conformance_config("mixtral");
    mixtral.remove("rope_parameters");
    mixtral.remove("sliding_window");
    let c = Config::from_json(&mixtral).unwrap();
    let m = c.moe.unwrap();
    assert_eq!((m.n_experts, m.top_k, m.renormalize, m.inter), (4, 2, true, 128));
    assert_eq!((c.rope_theta, c.sliding_window), (1e6, 0));
}

/// A Qwen3-MoE checkpoint without one expert's tensor, or with one of the wrong shape, is refused
/// by the tensor's name.
#[test]
fn moe_checkpoints_missing_or_misshaping_an_expert_are_refused_by_name() {
    let src = conformance().join("qwen3_moe");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = std::env::temp_dir().join(format!("llama-cpu-plain-moe-{}", std::process::id()));
    std::fs::create_dir_all(&t).unwrap();
    std::fs::copy(src.join("config.json"), t.join("config.json")).unwrap();
    let missing = "model.layers.2.mlp.experts.3.up_proj.weight";
    let kept = st.tensors().into_iter().filter(|(name, _)| name != missing);
    safetensors::serialize_to_file(kept, None, &t.join("model.safetensors")).unwrap();
    let e = Model::load(&t).err().expect("a checkpoint without an expert tensor loaded");
    assert!(e.contains(missing), "{e}");
    // Expert 1's down_proj [hidden, inter] replaced by its up_proj [inter, hidden].
    let wrong = "model.layers.0.mlp.experts.1.down_proj.weight";
    let up = st.tensor("model.layers.0.mlp.experts.1.up_proj.weight").unwrap();
    let all = st.tensors().into_iter().map(|(name, v)| if name == wrong { (name, up.clone()) } else { (name, v) });
    safetensors::serialize_to_file(all, None, &t.join("model.safetensors")).unwrap();
    let e = Model::load(&t).err().expect("a checkpoint with a mis-shaped expert tensor loaded");
    assert!(e.contains(wrong) && e.contains("shape"), "{e}");
    let _ = std::fs::remove_dir_all(&t);
}

/// forward_traced on a mixture-of-experts layer reports, in order, mlp_norm, router (the router
/// logits [n_experts]), route (top_k nonzero weights, renormalised: sum 1), experts (their weighted
/// sum [hidden]) and mlp_residual = attn_residual + experts. GPT-OSS reports exactly its graph's
/// nodes: embed, each layer's attention and MoE nodes, final_norm and logits.
#[test]
fn moe_layers_trace_router_route_and_experts() {
    for family in ["qwen3_moe", "mixtral", "gpt_oss"] {
        let mut model = Model::load(&conformance().join(family)).unwrap();
        let mut points: Vec<(Option<usize>, String, Vec<f32>)> = Vec::new();
        model.forward_traced(5, 0, &mut |layer, name, v| points.push((layer, name.to_string(), v.to_vec())));
        let layer1: Vec<&(Option<usize>, String, Vec<f32>)> = points.iter().filter(|p| p.0 == Some(1)).collect();
        let names: Vec<&str> = layer1.iter().map(|p| p.1.as_str()).collect();
        if family == "gpt_oss" {
            let layer = [
                "attn_norm",
                "q",
                "k",
                "v",
                "q_rope",
                "k_rope",
                "attn",
                "o",
                "attn_residual",
                "mlp_norm",
                "router",
                "route",
                "experts",
                "mlp_residual",
            ];
            assert_eq!(names, layer, "{family}");
            let outside: Vec<&str> = points.iter().filter(|p| p.0.is_none()).map(|p| p.1.as_str()).collect();
            assert_eq!(outside, ["embed", "final_norm", "logits"], "{family}");
            assert_eq!(points.len(), 3 + 4 * layer.len(), "{family}: four layers");
        }
        let at = |name: &str| names.iter().position(|n| *n == name).unwrap_or_else(|| panic!("{family}: no {name}"));
        let order = ["attn_residual", "mlp_norm", "router", "route", "experts", "mlp_residual"].map(at);
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{family}: {names:?}");
        let [residual, _, router, route, experts, out] = order.map(|i| &layer1[i].2);
        assert_eq!((router.len(), route.len(), experts.len()), (4, 4, 64), "{family}");
        assert_eq!(route.iter().filter(|&&w| w != 0.0).count(), 2, "{family}: {route:?}");
        assert!((route.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{family}: {route:?}");
        for j in 0..64 {
            assert_eq!(out[j], residual[j] + experts[j], "{family}: mlp_residual entry {j}");
        }
    }
}

/// GPT-OSS's config.json as GptOssConfig reads it: YaRN from rope_parameters (its frequencies and
/// attention factor as transformers' _compute_yarn_parameters gives them), GptOssConfig's YaRN
/// when there is none, the window on the layer_types' sliding layers, fused clamped experts with
/// swiglu_limit read when given; hidden_act not read. Refused by the key's name: another rope_type,
/// a YaRN key it does not read (mscale), attention_bias false, an MXFP4 quantization_config. Llama
/// does not read YaRN.
#[test]
fn gpt_oss_config_reads_yarn_and_refuses_what_it_does_not_cover() {
    let gpt = conformance_config("gpt_oss");
    let c = Config::from_json(&gpt).unwrap();
    let yarn = RopeScaling::Yarn {
        factor: 32.0,
        attention_factor: 0.1 * 32f64.ln() + 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_max_position_embeddings: 4096.0,
        truncate: false,
    };
    assert_eq!((c.rope_theta, c.rope_scaling, c.head_dim, c.tied), (150000.0, Some(yarn), 16, false));
    assert_eq!((0..4).map(|i| c.window(i)).collect::<Vec<_>>(), [4, 0, 4, 0], "layer_types");
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.n_experts, m.top_k, m.renormalize, m.inter), (4, 2, true, 32));
    assert_eq!(m.layout, ExpertLayout::Fused { alpha: 1.702, limit: 7.0 });
    // head_dim 16, theta 150000, 4096 original positions: corr(32) = 2.023..., corr(1) = 4.349...
    // (not truncated), so dimensions 0..=2 keep theta^(-2j/16), 5..=7 are divided by 32, and 3 and
    // 4 blend the two by the ramp (j - 2.023) / 2.326 (f64 by hand).
    let want = [
        1.0,
        0.225_418_000_202_870_84,
        0.050_813_274_815_461_475,
        0.006_794_959_489_732_219,
        0.000_456_483_919_223_240_86,
        1.818_833_668_168_956e-5,
        4.099_978_481_802_98e-6,
        9.242_089_502_428_302e-7,
    ];
    for (j, (got, want)) in c.rope_freqs().iter().zip(want).enumerate() {
        assert!((got - want).abs() <= 1e-12 * want, "YaRN frequency {j}: {got} against {want}");
    }
    assert_eq!(c.rope_attention_factor(), 1.346_573_6);
    // No rope_parameters: GptOssConfig's default, the same YaRN at rope_theta 150000.
    let mut bare = gpt.clone();
    bare.remove("rope_parameters");
    bare.insert("hidden_act".into(), json!("gelu"));
    bare.insert("swiglu_limit".into(), json!(5.0));
    let c = Config::from_json(&bare).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (150000.0, Some(yarn)));
    assert_eq!(c.moe.unwrap().layout, ExpertLayout::Fused { alpha: 1.702, limit: 5.0 });
    let with_rope = |params: Value| {
        let mut c = gpt.clone();
        c.insert("rope_parameters".into(), params);
        c
    };
    for (key, c) in [
        ("linear", with_rope(json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 150000.0}))),
        ("mscale", with_rope(json!({"rope_type": "yarn", "factor": 32.0, "mscale": 1.0}))),
        ("factor", with_rope(json!({"rope_type": "yarn"}))),
        ("attention_bias", {
            let mut c = gpt.clone();
            c.insert("attention_bias".into(), json!(false));
            c
        }),
        ("quantization_config", {
            let mut c = gpt.clone();
            c.insert("quantization_config".into(), json!({"quant_method": "mxfp4"}));
            c
        }),
    ] {
        let e = Config::from_json(&c).err().unwrap_or_else(|| panic!("{key} accepted"));
        assert!(e.contains(key), "{key}: {e}");
    }
    let mut llama = conformance_config("llama");
    llama.insert("rope_parameters".into(), json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}));
    let e = Config::from_json(&llama).expect_err("llama read YaRN");
    assert!(e.contains("yarn"), "{e}");
}

/// The batched step (component.batched_step) on every family's conformance checkpoint: three
/// sequences interleaved over four steps of a paged cache in blocks of 4 handed out out of order,
/// prefill chunks beside decode rows (a prompt split in two chunks, one prefilled whole, one
/// arriving late), up to 12 positions (past GPT-OSS's and Gemma 3's windows of 4). The logits of
/// each chunk's last token equal the single-sequence forward's at that position to the bit. On the
/// mixtures of experts (Qwen3-MoE, Mixtral, GPT-OSS) every layer of every step runs each selected
/// expert once, in expert order, for all the rows routed to it: the groups' rows add up to
/// top_k per row, and with more rows than experts / top_k some expert serves several rows at once.
#[test]
fn batched_step_equals_the_single_sequence_forward_and_runs_each_expert_once_per_step() {
    use crate::batch::{SeqChunk, new_cache, step};
    // Each sequence's tokens (prompt, then the tokens its decode rows bring) and block table.
    let seqs: [(usize, Vec<u32>); 3] = [(7, vec![5, 0, 9]), (3, vec![2, 7]), (5, vec![11, 4, 1])];
    // Per step: (sequence, tokens) chunks, each continuing where its sequence stopped.
    let steps: [&[(usize, usize)]; 4] =
        [&[(0, 4), (1, 3)], &[(0, 3), (1, 1), (2, 2)], &[(0, 1), (1, 1), (2, 3)], &[(2, 1), (0, 1), (1, 1)]];
    for family in CONFORMANCE_FAMILIES {
        let dir = conformance().join(family);
        let mut model = Model::load(&dir).unwrap_or_else(|e| panic!("{family}: {e}"));
        let vocab = model.vocab_size();
        let tokens: Vec<Vec<u32>> =
            (0..3).map(|s| (0..12).map(|i| ((s * 31 + i * 17 + 3) % vocab) as u32).collect()).collect();
        // The single-sequence forward's logits at every position of each sequence.
        let want: Vec<Vec<Vec<f32>>> = tokens
            .iter()
            .map(|t| {
                model.reset();
                t.iter().enumerate().map(|(pos, &x)| model.forward(x, pos).to_vec()).collect()
            })
            .collect();
        let top_k = Config::load(&dir).unwrap().moe.map(|m| m.top_k);
        let mut cache = new_cache(&model, 12, 4);
        let mut done = [0usize; 3];
        for (n, plan) in steps.iter().enumerate() {
            let chunks: Vec<SeqChunk> = plan
                .iter()
                .map(|&(s, len)| SeqChunk {
                    tokens: &tokens[s][done[s]..done[s] + len],
                    start: done[s],
                    block_table: &seqs[s].1,
                })
                .collect();
            let logits = step(&mut model, &mut cache, &chunks);
            assert_eq!(logits.len(), plan.len() * vocab, "{family} step {n}");
            for (c, &(s, len)) in plan.iter().enumerate() {
                done[s] += len;
                let got = &logits[c * vocab..(c + 1) * vocab];
                assert!(got == want[s][done[s] - 1], "{family} step {n}: sequence {s} at position {}", done[s] - 1);
            }
            let rows: usize = plan.iter().map(|&(_, len)| len).sum();
            let groups = model.expert_groups();
            let Some(top_k) = top_k else {
                assert!(groups.is_empty(), "{family}: no experts");
                continue;
            };
            assert_eq!(groups.len(), 4, "{family} step {n}: one entry per layer");
            for (l, g) in groups.iter().enumerate() {
                assert!(g.windows(2).all(|w| w[0].0 < w[1].0), "{family} step {n} layer {l}: each expert once: {g:?}");
                assert_eq!(g.iter().map(|e| e.1).sum::<usize>(), rows * top_k, "{family} step {n} layer {l}: {g:?}");
                if rows * top_k > 4 {
                    assert!(g.iter().any(|e| e.1 > 1), "{family} step {n} layer {l}: {g:?}");
                }
            }
        }
        assert_eq!(done, [9, 6, 6], "{family}: the schedule ran");
    }
}

/// The block manager (component.block_manager): blocks handed out first to last, a table grows
/// by one block when its last one is full, refusals (a live id, too few blocks, an unknown id, an
/// empty pool) change nothing, free returns every block and an id may be reused.
#[test]
fn block_manager_hands_out_appends_refuses_and_frees_blocks() {
    use crate::paged::BlockManager;
    let mut bm = BlockManager::new(5, 4);
    assert!(bm.can_allocate(20) && !bm.can_allocate(21));
    bm.allocate(1, 5).unwrap();
    assert_eq!((bm.block_table(1), bm.num_free_blocks()), (vec![0, 1], 3));
    assert!(bm.allocate(1, 1).is_err() && bm.allocate(2, 13).is_err(), "a live id; 4 blocks of 3 free");
    assert_eq!((bm.block_table(1), bm.block_table(2), bm.num_free_blocks()), (vec![0, 1], vec![], 3));
    for _ in 5..8 {
        bm.append_slot(1).unwrap();
    }
    assert_eq!(bm.block_table(1), [0, 1], "positions 5..8 fill block 1");
    bm.append_slot(1).unwrap();
    assert_eq!((bm.block_table(1), bm.num_free_blocks()), (vec![0, 1, 2], 2));
    bm.allocate(2, 8).unwrap();
    assert_eq!((bm.block_table(2), bm.num_free_blocks()), (vec![3, 4], 0));
    assert!(bm.append_slot(2).is_err() && bm.append_slot(9).is_err(), "no free block; an unknown id");
    assert_eq!((bm.block_table(2), bm.num_free_blocks()), (vec![3, 4], 0));
    bm.free(1);
    bm.free(1);
    assert_eq!((bm.block_table(1), bm.num_free_blocks()), (vec![], 3));
    bm.append_slot(2).unwrap();
    assert_eq!(bm.block_table(2).len(), 3);
    bm.free(2);
    assert_eq!(bm.num_free_blocks(), 5);
    bm.allocate(1, 1).unwrap();
    assert_eq!(bm.block_table(1).len(), 1, "an id is reused after free");
}
