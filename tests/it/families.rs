//! Dense decoder families beyond Llama: routing of synthetic checkpoints, the generalised f64 reference
//! forward, the effect of every feature on the logits, and config edge cases refused with the field.

use std::path::{Path, PathBuf};

use metainfer::ckb::Ckb;
use metainfer::model::{self, ResolvedConfig};
use metainfer::ops::plan::{PlanRequest, plan_only};
use metainfer::ops::synth::{SynthRequest, synth_config, write_checkpoint};
use metainfer::oracle::families::{gelu_tanh, rope_inv_freq};
use metainfer::oracle::llama::Reference;
use serde_json::{Value, json};

/// Write a synthetic checkpoint of `family` into `root/name`, with `edit` applied to its config.json.
fn synth(root: &Path, name: &str, family: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let req = SynthRequest { family: family.into(), out: root.join(name), seed: 7, ..Default::default() };
    let mut config = synth_config(&req).unwrap();
    edit(&mut config);
    write_checkpoint(&req.out, &config, req.seed).unwrap();
    req.out
}

fn llama3(c: &mut Value) {
    c["rope_scaling"] = json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16
    });
}

/// The six configurations of the issue: (name, family, config edit, family id, features).
type Case = (&'static str, &'static str, fn(&mut Value), &'static str, &'static [&'static str]);
const CASES: &[Case] = &[
    ("llama", "llama", |_| {}, "model.llama", &[]),
    ("llama3", "llama", llama3, "model.llama", &[]),
    ("mistral", "mistral", |_| {}, "model.mistral", &["sliding_window"]),
    ("qwen2", "qwen2", |_| {}, "model.qwen2", &["qkv_bias"]),
    ("qwen3", "qwen3", |_| {}, "model.qwen3", &["qk_norm"]),
    ("gemma", "gemma", |_| {}, "model.gemma", &["gelu_tanh_mlp", "rmsnorm_one_plus_w", "embed_scale_sqrt_hidden"]),
];

#[test]
fn plan_engine_routes_all_six_families() {
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    for (name, family, edit, id, features) in CASES {
        let dir = synth(t.path(), name, family, edit);
        let r = plan_only(
            &ctx,
            &PlanRequest {
                model: dir.display().to_string(),
                target: "cpu".into(),
                dtype: "f32".into(),
                ..Default::default()
            },
        )
        .unwrap();
        assert!(r.covered, "{name}: {:?}", r.gaps);
        assert_eq!(&r.family, id, "{name}");
        // The text an agent reads carries what the JSON does: RoPE scaling, and which matrix
        // makes the logits (never "tied" for an untied model).
        let text = metainfer::ops::Report::text(&r);
        let cfg = r.config.clone().unwrap();
        let head = if cfg.tied { "(output matrix: the embedding matrix" } else { "(output matrix: lm_head.weight)" };
        assert!(text.contains(head), "{name}: {text}");
        assert_eq!(text.contains("rope_scaling llama3 factor 8"), *name == "llama3", "{name}: {text}");
        assert_eq!(cfg.features, features.iter().map(|s| s.to_string()).collect::<Vec<_>>(), "{name}");
        assert!(r.phases.iter().any(|p| p.contracts.contains(&id.to_string())), "{name}");
        match *name {
            "llama3" => {
                let s = cfg.rope_scaling.expect("llama3 scaling resolved");
                assert_eq!((s.rope_type.as_str(), s.factor, s.original_max_position_embeddings), ("llama3", 8.0, 16));
            }
            "mistral" => assert_eq!(cfg.sliding_window, 8),
            "qwen2" | "gemma" | "qwen3" => assert!(cfg.tied, "{name} is tied in synth"),
            _ => assert!(!cfg.tied && cfg.rope_scaling.is_none()),
        }
    }
}

fn load(dir: &Path) -> (ResolvedConfig, model::Tensors) {
    (model::load_config(&Ckb::embedded().unwrap(), dir).unwrap(), model::read_safetensors(dir).unwrap())
}

/// Logits of every position of a 12-token sequence (longer than mistral's window of 8).
fn run(cfg: &ResolvedConfig, tensors: &model::Tensors) -> Vec<Vec<f64>> {
    let mut r = Reference::new(cfg, tensors).unwrap();
    (0..12u32).map(|i| r.step((i * 7 + 3) % cfg.vocab as u32).unwrap()).collect()
}

/// Largest |a - b| over two runs' logit rows.
pub(crate) fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn reference_forward_gives_finite_spread_logits_for_every_family() {
    let t = tempfile::tempdir().unwrap();
    for (name, family, edit, _, _) in CASES {
        let dir = synth(t.path(), name, family, edit);
        let (cfg, tensors) = load(&dir);
        let rows = run(&cfg, &tensors);
        for row in &rows {
            assert_eq!(row.len(), cfg.vocab);
            assert!(row.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
            let mean = row.iter().sum::<f64>() / row.len() as f64;
            let sd = (row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / row.len() as f64).sqrt();
            assert!(sd > 0.1 && sd < 100.0, "{name}: logits degenerate (sd {sd})");
        }
        // Greedy decoding and the tokenizer work on the synthetic checkpoint.
        let tok = model::hf_tokenizer(&dir).unwrap();
        let ids = model::hf_encode(&tok, "hello world").unwrap();
        assert_eq!(ids[0], 1, "BOS first");
        assert!(ids.iter().all(|&i| (i as usize) < cfg.vocab));
        let (logits, tokens) = Reference::new(&cfg, &tensors).unwrap().greedy(&ids, 4).unwrap();
        assert_eq!((logits.len(), tokens.len()), (4, 4));
    }
}

#[test]
fn every_feature_changes_the_logits_when_toggled() {
    let t = tempfile::tempdir().unwrap();
    for (name, family, edit, _, features) in CASES {
        let dir = synth(t.path(), name, family, edit);
        let (cfg, tensors) = load(&dir);
        let base = run(&cfg, &tensors);
        for f in features.iter() {
            let mut off = cfg.clone();
            off.features.retain(|x| x != f);
            if *f == "sliding_window" {
                off.sliding_window = 0;
            }
            let d = max_diff(&base, &run(&off, &tensors));
            assert!(d > 1e-3, "{name}: feature {f} has no effect on the logits ({d})");
        }
        if *name == "llama3" {
            let mut off = cfg.clone();
            off.rope_scaling = None;
            let d = max_diff(&base, &run(&off, &tensors));
            assert!(d > 1e-3, "llama3 rope scaling has no effect ({d})");
            // Position 0 has angle 0 whatever the frequencies: scaling cannot change its logits.
            assert!(max_diff(&base[..1], &run(&off, &tensors)[..1]) < 1e-12);
        }
    }
}

#[test]
fn qwen2_biases_are_the_only_effect_of_qkv_bias() {
    let t = tempfile::tempdir().unwrap();
    let dir = synth(t.path(), "qwen2", "qwen2", |_| {});
    let (cfg, mut tensors) = load(&dir);
    let with = run(&cfg, &tensors);
    for (name, (_, v)) in tensors.iter_mut() {
        if name.ends_with("_proj.bias") {
            v.iter_mut().for_each(|x| *x = 0.0);
        }
    }
    let zeroed = run(&cfg, &tensors);
    assert!(max_diff(&with, &zeroed) > 1e-3, "biases must change the logits");
    let mut off = cfg.clone();
    off.features.clear();
    assert!(max_diff(&zeroed, &run(&off, &tensors)) < 1e-12, "zero biases must equal no biases");
}

#[test]
fn mistral_window_masks_exactly_positions_older_than_the_window() {
    let t = tempfile::tempdir().unwrap();
    let dir = synth(t.path(), "mistral", "mistral", |_| {});
    let (cfg, tensors) = load(&dir);
    assert_eq!(cfg.sliding_window, 8);
    let windowed = run(&cfg, &tensors);
    let mut full = cfg.clone();
    full.sliding_window = 0;
    let full = run(&full, &tensors);
    // Positions 0..=7 see at most 8 positions: identical. Position 8 loses position 0: different.
    assert!(max_diff(&windowed[..8], &full[..8]) < 1e-12);
    for p in 8..12 {
        assert!(max_diff(&windowed[p..=p], &full[p..=p]) > 1e-6, "position {p} must not see position {}", p - 8);
    }
    // A window as long as the sequence is full attention.
    let mut long = cfg.clone();
    long.sliding_window = 12;
    assert!(max_diff(&run(&long, &tensors), &full) < 1e-12);
    // sliding_window: null means full attention.
    let dir = synth(t.path(), "mistral-null", "mistral", |c| c["sliding_window"] = Value::Null);
    let (cfg, _) = load(&dir);
    assert_eq!(cfg.sliding_window, 0);
    assert!(cfg.features.is_empty());
}

#[test]
fn gelu_tanh_and_llama3_frequencies_match_published_values() {
    // Tanh-approximated GELU at 1 and -1 (PyTorch gelu(approximate="tanh")).
    assert!((gelu_tanh(1.0) - 0.841_191_990_607_477_2).abs() < 1e-12, "{}", gelu_tanh(1.0));
    assert!((gelu_tanh(-1.0) + 0.158_808_009_392_522_8).abs() < 1e-12, "{}", gelu_tanh(-1.0));
    // Llama 3.1: factor 8, low 1, high 4, original 8192, theta 500000, head_dim 128.
    let s = model::RopeScaling {
        rope_type: "llama3".into(),
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
        ..model::RopeScaling::new("llama3", 8.0)
    };
    let plain = rope_inv_freq(128, 500_000.0, None);
    let scaled = rope_inv_freq(128, 500_000.0, Some(&s));
    let wavelen = |f: f64| 2.0 * std::f64::consts::PI / f;
    let (mut kept, mut divided, mut blended) = (0, 0, 0);
    for (p, q) in plain.iter().zip(&scaled) {
        let w = wavelen(*p);
        if w < 8192.0 / 4.0 {
            assert_eq!(p, q);
            kept += 1;
        } else if w > 8192.0 {
            assert!((q - p / 8.0).abs() <= 1e-15 * p);
            divided += 1;
        } else {
            let sm = (8192.0 / w - 1.0) / 3.0;
            assert!((q - ((1.0 - sm) * p / 8.0 + sm * p)).abs() <= 1e-15 * p);
            assert!(*q < *p && *q > p / 8.0);
            blended += 1;
        }
    }
    assert!(kept > 0 && divided > 0 && blended > 0, "{kept} {divided} {blended}");
    let lin = model::RopeScaling { rope_type: "linear".into(), factor: 4.0, ..s };
    let l = rope_inv_freq(128, 500_000.0, Some(&lin));
    assert!(l.iter().zip(&plain).all(|(a, b)| (a - b / 4.0).abs() <= 1e-18));
}

/// (name, family, config edit, words the refusal must contain).
type EdgeCase = (&'static str, &'static str, Box<dyn FnOnce(&mut Value)>, &'static [&'static str]);

fn refused(dir: &Path) -> String {
    model::load_config(&Ckb::embedded().unwrap(), dir).unwrap_err().message
}

#[test]
fn config_edge_cases_are_refused_with_the_field() {
    let t = tempfile::tempdir().unwrap();
    let cases: Vec<EdgeCase> = vec![
        (
            "longrope",
            "llama",
            Box::new(|c| c["rope_scaling"] = json!({"rope_type": "longrope", "factor": 4.0})),
            &["rope_scaling", "longrope"],
        ),
        (
            "llama3-missing",
            "llama",
            Box::new(|c| c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0})),
            &["rope_scaling", "low_freq_factor", "missing"],
        ),
        (
            "llama3-inverted",
            "llama",
            Box::new(|c| {
                llama3(c);
                c["rope_scaling"]["high_freq_factor"] = json!(0.5);
            }),
            &["rope_scaling", "high_freq_factor"],
        ),
        (
            "linear-zero",
            "llama",
            Box::new(|c| c["rope_scaling"] = json!({"type": "linear", "factor": 0})),
            &["rope_scaling", "factor"],
        ),
        ("window-zero", "mistral", Box::new(|c| c["sliding_window"] = json!(0)), &["sliding_window", "positive"]),
        ("qwen2-window", "qwen2", Box::new(|c| c["use_sliding_window"] = json!(true)), &["use_sliding_window"]),
        ("qwen3-bias", "qwen3", Box::new(|c| c["attention_bias"] = json!(true)), &["attention_bias"]),
        (
            "gemma-gelu",
            "gemma",
            Box::new(|c| c["hidden_activation"] = json!("gelu")),
            &["hidden_activation", "gelu_pytorch_tanh"],
        ),
        (
            "qwen2-scaling",
            "qwen2",
            Box::new(|c| c["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0})),
            &["rope_scaling"],
        ),
        ("gqa", "qwen3", Box::new(|c| c["num_key_value_heads"] = json!(3)), &["num_key_value_heads", "multiple"]),
    ];
    for (name, family, edit, words) in cases {
        let dir = synth(t.path(), name, family, edit);
        let m = refused(&dir);
        for w in words {
            assert!(m.contains(w), "{name}: {w:?} not in {m}");
        }
    }
    // HF class defaults: Qwen2 without num_key_value_heads uses num_attention_heads; rope_type "default"
    // and a null rope_scaling are plain RoPE.
    let dir = synth(t.path(), "qwen2-kv", "qwen2", |c| {
        c.as_object_mut().unwrap().remove("num_key_value_heads");
        c["rope_scaling"] = Value::Null;
    });
    let cfg = model::load_config(&Ckb::embedded().unwrap(), &dir).unwrap();
    assert_eq!((cfg.n_heads, cfg.n_kv_heads, cfg.rope_scaling), (4, 4, None));
    let dir = synth(t.path(), "llama-default", "llama", |c| c["rope_scaling"] = json!({"rope_type": "default"}));
    assert_eq!(model::load_config(&Ckb::embedded().unwrap(), &dir).unwrap().rope_scaling, None);
}

#[test]
fn synth_refuses_absurd_sizes_and_occupied_directories() {
    let t = tempfile::tempdir().unwrap();
    let req = |f: &str| SynthRequest { family: f.into(), out: t.path().join("x"), ..Default::default() };
    let e = synth_config(&SynthRequest { hidden: Some(100_000), ..req("llama") }).unwrap_err();
    assert!(e.message.contains("--hidden"), "{}", e.message);
    let e = synth_config(&SynthRequest { heads: Some(4), kv_heads: Some(3), ..req("qwen2") }).unwrap_err();
    assert!(e.message.contains("--kv-heads"), "{}", e.message);
    let e = synth_config(&SynthRequest { hidden: Some(4096), heads: Some(32), layers: Some(64), ..req("llama") })
        .unwrap_err();
    assert!(e.message.contains("parameters"), "{}", e.message);
    let e = synth_config(&req("mamba")).unwrap_err();
    assert!(e.message.contains("mamba") && e.message.contains("gemma"), "{}", e.message);
    std::fs::create_dir_all(t.path().join("x")).unwrap();
    std::fs::write(t.path().join("x/keep"), "").unwrap();
    let e = metainfer::ops::synth::synth(&req("llama")).unwrap_err();
    assert!(e.message.contains("not an empty directory"), "{}", e.message);
    assert!(t.path().join("x/keep").exists());
    // No temporary directory is left behind.
    let left: Vec<_> = std::fs::read_dir(t.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

#[test]
fn synth_cli_writes_a_checkpoint_that_plans() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("qwen3");
    let s = std::process::Command::new(crate::bin())
        .args(["synth", "--family", "qwen3", "--out"])
        .arg(&out)
        .args(["--seed", "3", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "24"])
        .args(["--vocab", "40", "--intermediate", "48", "--max-seq", "16"])
        .output()
        .unwrap();
    assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
    let cfg = model::load_config(&Ckb::embedded().unwrap(), &out).unwrap();
    assert_eq!((cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab), (32, 24, 2, 1, 40));
    let tensors = model::read_safetensors(&out).unwrap();
    assert_eq!(tensors["model.layers.0.self_attn.q_norm.weight"].0, vec![24]);
    assert_eq!(tensors["model.layers.0.self_attn.q_proj.weight"].0, vec![48, 32]);
    let s = std::process::Command::new(crate::bin())
        .args(["synth", "--family", "qwen3", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(s.status.code(), Some(2), "an occupied --out is a usage error");
}

/// `metainfer synth` with these arguments into `out`.
fn synth_cli(out: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(crate::bin()).args(["synth", "--out"]).arg(out).args(args).output().unwrap()
}

#[test]
fn synth_presets_write_the_llama2c_tinystories_shapes() {
    // (preset, hidden, layers, heads, kv_heads, intermediate, vocab, max_seq, parameters): the llama2.c
    // README's model table; parameters with the embedding shared by the output projection.
    let shapes = [
        ("stories15m", 288, 6, 6, 6, 768, 32000, 256, 15_191_712),
        ("stories42m", 512, 8, 8, 8, 1376, 32000, 1024, 41_689_600),
        ("stories110m", 768, 12, 12, 12, 2048, 32000, 1024, 109_529_856),
    ];
    let keys = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    ];
    let t = tempfile::tempdir().unwrap();
    for (name, h, l, nh, kv, i, v, s, params) in shapes {
        let req = SynthRequest { preset: Some(name.into()), out: t.path().join(name), ..Default::default() };
        let c = synth_config(&req).unwrap();
        let got: Vec<u64> = keys.iter().map(|k| c[k].as_u64().unwrap()).collect();
        assert_eq!(got, [h, l, nh, kv, i, v, s], "{name}");
        assert_eq!((c["model_type"].as_str(), c["tie_word_embeddings"].as_bool()), (Some("llama"), Some(true)));
        let hd = (h / nh) as usize;
        let count = metainfer::ops::synth::parameter_count(
            h as usize,
            l as usize,
            nh as usize,
            kv as usize,
            hd,
            i as usize,
            v as usize,
            true,
            "llama",
        );
        assert_eq!(count, params, "{name}");
    }

    // The smallest is written: config.json with exactly those numbers, tensors of the right shapes.
    let out = t.path().join("stories15m");
    let r = synth_cli(&out, &["--preset", "stories15m", "--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let report: Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(report["parameters"], 15_191_712);
    let c: Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let got: Vec<u64> = keys.iter().map(|k| c[k].as_u64().unwrap()).collect();
    assert_eq!(got, [288, 6, 6, 6, 768, 32000, 256]);
    assert_eq!(c["architectures"], json!(["LlamaForCausalLM"]));
    let tensors = model::read_safetensors(&out).unwrap();
    let shape = |n: &str| tensors.get(n).unwrap_or_else(|| panic!("{n} missing")).0.clone();
    assert_eq!(shape("model.embed_tokens.weight"), [32000, 288]);
    for l in 0..6 {
        let p = format!("model.layers.{l}.");
        for (n, want) in [
            ("input_layernorm.weight", vec![288]),
            ("self_attn.q_proj.weight", vec![288, 288]),
            ("self_attn.k_proj.weight", vec![288, 288]),
            ("self_attn.v_proj.weight", vec![288, 288]),
            ("self_attn.o_proj.weight", vec![288, 288]),
            ("post_attention_layernorm.weight", vec![288]),
            ("mlp.gate_proj.weight", vec![768, 288]),
            ("mlp.up_proj.weight", vec![768, 288]),
            ("mlp.down_proj.weight", vec![288, 768]),
        ] {
            assert_eq!(shape(&format!("{p}{n}")), want, "{p}{n}");
        }
    }
    assert_eq!(shape("model.norm.weight"), [288]);
    assert_eq!(tensors.len(), 1 + 6 * 9 + 1, "tied: no lm_head.weight");
    let cfg = model::load_config(&Ckb::embedded().unwrap(), &out).unwrap();
    assert_eq!((cfg.hidden, cfg.head_dim, cfg.vocab, cfg.max_seq, cfg.tied), (288, 48, 32000, 256, true));

    // The tokenizer covers all 32000 ids for HF tokenizers: text round-trips, every id decodes.
    let tok = model::hf_tokenizer(&out).unwrap();
    assert_eq!(tok.get_vocab_size(true), 32000);
    let text = "Once upon a time, there was a little girl named Lily.";
    let ids = model::hf_encode(&tok, text).unwrap();
    assert_eq!(ids[0], 1, "BOS first");
    assert!(ids.len() < text.len(), "merges apply: {ids:?}");
    assert!(ids.iter().all(|&i| i < 32000));
    assert_eq!(model::hf_decode(&tok, &ids).unwrap(), text);
    let all: Vec<u32> = (3..32000).collect();
    assert!(all.chunks(1000).all(|c| model::hf_decode(&tok, c).unwrap().chars().count() >= c.len()));

    // Explicit sizes override the preset's.
    let out = t.path().join("short");
    let r = synth_cli(&out, &["--preset", "stories42m", "--family", "llama", "--layers", "1", "--max-seq", "64"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let c: Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let got: Vec<u64> = keys.iter().map(|k| c[k].as_u64().unwrap()).collect();
    assert_eq!(got, [512, 1, 8, 8, 1376, 32000, 64]);
}

#[test]
fn synth_refuses_unknown_presets_conflicting_families_and_absurd_shapes_and_creates_nothing() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("x");
    for (args, want) in [
        (
            &["--preset", "stories1b"][..],
            "unknown preset `stories1b`; synth knows: stories15m, stories42m, stories110m, llama3.2-1b, qwen3-0.6b, qwen3-moe-mini, qwen3-moe-1b-active, gpt-oss-mini",
        ),
        (
            &["--preset", "stories15m", "--family", "qwen2"],
            "--preset stories15m is a llama shape and conflicts with --family qwen2; drop --family or pass --family llama",
        ),
        (&["--preset", "stories15m", "--heads", "7", "--kv-heads", "7"], "--hidden 288 is not a multiple of --heads 7"),
        (&["--preset", "stories15m", "--layers", "0"], "--layers 0 must be in 1..=64"),
        (&["--preset", "stories15m", "--vocab", "0"], "--vocab 0 must be in 8..=262144"),
        (
            &["--preset", "stories110m", "--hidden", "6144", "--layers", "64"],
            "the checkpoint would hold 12276996096 parameters, 49.11 GB of weights at 4 bytes each, more than synth writes (8 GB); choose smaller --hidden, --layers, --intermediate or --vocab (or --dtype bf16)",
        ),
        (
            &[],
            "pass --family (llama, mistral, qwen2, qwen3, gemma) or --preset (stories15m, stories42m, stories110m, llama3.2-1b, qwen3-0.6b, qwen3-moe-mini, qwen3-moe-1b-active, gpt-oss-mini)",
        ),
        // Mixtures of experts: expert counts and widths are bounded, and the experts count in the
        // checkpoint's size (1024 experts of 3 x 14336 x 4096 weights in each of 8 layers: 1.4e12).
        (
            &["--preset", "qwen3-moe-mini", "--family", "llama"],
            "--preset qwen3-moe-mini is a qwen3_moe shape and conflicts with --family llama; drop --family or pass --family qwen3_moe",
        ),
        (&["--family", "qwen3_moe", "--experts", "0"], "--experts 0 must be in 1..=1024"),
        (
            &["--family", "qwen3_moe", "--experts", "4", "--experts-per-token", "5"],
            "--experts-per-token 5 must be in 1..=--experts (4)",
        ),
        (
            &["--family", "qwen3_moe", "--expert-intermediate", "70000"],
            "--expert-intermediate 70000 must be in 1..=65536",
        ),
        (
            &[
                "--family",
                "mixtral",
                "--experts",
                "1024",
                "--hidden",
                "4096",
                "--intermediate",
                "14336",
                "--layers",
                "8",
            ],
            "more than synth writes (8 GB); choose smaller sizes (--hidden, --layers, --intermediate, --vocab, and for a mixture of experts --experts or --expert-intermediate)",
        ),
    ] {
        let r = synth_cli(&out, args);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        let left: Vec<_> = std::fs::read_dir(t.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
}

/// The plain example engine passes the kernel tests of each family's plan and verify_generation on a
/// synthetic checkpoint of every case above, and of Llama with linear RoPE scaling. (The SIMD engine
/// covers plain Llama; its gates run on BabyLlama.) The engine's metainfer.toml names the family, as
/// a scaffold for that family would.
#[test]
fn plain_engine_passes_the_gates_on_every_family() {
    use metainfer::ops::Report;
    use metainfer::ops::kernel_test::{KernelTestRequest, kernel_test};
    use metainfer::ops::verify::{VerifyRequest, verify};
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let budget = metainfer::harness::Budget::secs(900);
    let engine = t.path().join("engine");
    crate::Engine::Plain.copy_to(&engine);
    let manifest = std::fs::read_to_string(engine.join("metainfer.toml")).unwrap();
    let linear: Case =
        ("llama-linear", "llama", |c| c["rope_scaling"] = json!({"type": "linear", "factor": 4.0}), "model.llama", &[]);
    let mut tested = "";
    // Gemma, the one family with another kernel (GeGLU), comes last: its harness is written once.
    for (name, family, edit, id, _) in std::iter::once(&linear).chain(CASES) {
        let model = synth(t.path(), name, family, edit);
        if tested != *id {
            std::fs::write(
                engine.join("metainfer.toml"),
                manifest.replace("family = \"model.llama\"", &format!("family = {id:?}")),
            )
            .unwrap();
            let req = KernelTestRequest {
                engine: engine.display().to_string(),
                kernels: vec![],
                seed: Some(5),
                ..Default::default()
            };
            let k = kernel_test(&ctx, &req, &budget).unwrap();
            assert!(k.passed, "{name}: {}", k.text());
            tested = id;
        }
        let req = VerifyRequest {
            engine: engine.display().to_string(),
            model: model.display().to_string(),
            prompts: vec![],
            max_new_tokens: Some(8),
            seed: Some(5),
            ..Default::default()
        };
        let v = verify(&ctx, &req, &budget).unwrap();
        assert!(v.passed && v.family == *id, "{name}: {}", v.text());
    }
}

/// An engine is checked on checkpoints of its own family: the plain engine declared as Llama (whose
/// kernel tests leave out GeGLU) is refused, before anything is built, on a Gemma checkpoint by
/// verify and profile alike, naming both families.
#[test]
fn an_engine_is_verified_only_on_its_own_family() {
    use metainfer::ops::profile::{ProfileRequest, profile};
    use metainfer::ops::verify::{VerifyRequest, verify};
    let t = tempfile::tempdir().unwrap();
    let ctx = crate::ctx(t.path());
    let budget = metainfer::harness::Budget::secs(600);
    let engine = crate::Engine::Plain.shared_copy();
    let gemma = synth(t.path(), "gemma", "gemma", |_| {});
    let (e, m) = (engine.display().to_string(), gemma.display().to_string());
    let v = verify(
        &ctx,
        &VerifyRequest {
            engine: e.clone(),
            model: m.clone(),
            prompts: vec![],
            max_new_tokens: Some(4),
            ..Default::default()
        },
        &budget,
    )
    .unwrap_err();
    let p = profile(&ctx, &ProfileRequest { engine: e, model: m, runs: Some(1), ..Default::default() }, &budget)
        .unwrap_err();
    for err in [v, p] {
        assert!(err.message.contains("model.gemma") && err.message.contains("model.llama"), "{}", err.message);
    }
    assert_eq!(metainfer::ledger::Ledger::open(&ctx.ledger).unwrap().count().unwrap(), 0);
}
