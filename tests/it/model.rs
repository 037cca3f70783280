//! Reading model directories: routing, defaults and bad input.

use metainfer::ckb::Ckb;
use metainfer::error::ErrorKind;
use metainfer::model;

fn write_config(dir: &std::path::Path, json: serde_json::Value) {
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
}

fn llama_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 50, "rms_norm_eps": 1e-6
    })
}

#[test]
fn missing_kv_heads_defaults_to_attention_heads_like_hf() {
    let t = tempfile::tempdir().unwrap();
    write_config(t.path(), llama_config());
    let cfg = model::load_config(&Ckb::embedded().unwrap(), t.path()).unwrap();
    assert_eq!((cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), (4, 4, 16));
    // LlamaConfig defaults: rope_theta 10000, max_position_embeddings 2048, tie_word_embeddings false.
    assert_eq!((cfg.rope_theta, cfg.max_seq, cfg.tied), (10_000.0, 2048, false));
}

#[test]
fn babyllama_config_resolves_to_its_card() {
    let cfg = model::load_config(&Ckb::embedded().unwrap(), &crate::babyllama()).unwrap();
    assert_eq!((cfg.hidden, cfg.intermediate, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads), (128, 352, 5, 8, 4));
    assert_eq!((cfg.head_dim, cfg.vocab, cfg.max_seq, cfg.tied), (16, 105, 256, true));
    assert_eq!((cfg.rms_norm_eps, cfg.rope_theta), (1e-5, 10_000.0));
}

#[test]
fn missing_config_names_the_file() {
    let t = tempfile::tempdir().unwrap();
    let e = model::load_config(&Ckb::embedded().unwrap(), t.path()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Input);
    assert!(e.message.contains("config.json"), "{}", e.message);
}

#[test]
fn unknown_architecture_is_a_gap_naming_the_field() {
    let t = tempfile::tempdir().unwrap();
    let mut c = llama_config();
    c["architectures"] = serde_json::json!(["MambaForCausalLM"]);
    c["model_type"] = serde_json::json!("mamba");
    write_config(t.path(), c);
    let e = model::load_config(&Ckb::embedded().unwrap(), t.path()).unwrap_err();
    assert!(e.message.contains("architectures") && e.message.contains("MambaForCausalLM"), "{}", e.message);
}

#[test]
fn impossible_or_uncovered_config_is_refused_with_field_and_reason() {
    let ckb = Ckb::embedded().unwrap();
    let t = tempfile::tempdir().unwrap();
    let mut c = llama_config();
    c["num_key_value_heads"] = serde_json::json!(3);
    write_config(t.path(), c);
    let e = model::load_config(&ckb, t.path()).unwrap_err();
    assert!(e.message.contains("num_key_value_heads") && e.message.contains("multiple"), "{}", e.message);

    let mut c = llama_config();
    c["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
    write_config(t.path(), c);
    let e = model::load_config(&ckb, t.path()).unwrap_err();
    assert!(e.message.contains("rope_scaling"), "{}", e.message);

    let mut c = llama_config();
    c.as_object_mut().unwrap().remove("hidden_size");
    write_config(t.path(), c);
    let e = model::load_config(&ckb, t.path()).unwrap_err();
    assert!(e.message.contains("hidden_size") && e.message.contains("missing"), "{}", e.message);
}

#[test]
fn truncated_safetensors_is_a_clear_error() {
    let t = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(crate::babyllama().join("model.safetensors")).unwrap();
    std::fs::write(t.path().join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = model::read_safetensors(t.path()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Input);
    assert!(e.message.contains("model.safetensors") && e.message.contains("truncated or corrupt"), "{}", e.message);
}

#[test]
fn real_checkpoint_is_the_pinned_one() {
    use sha2::Digest;
    let bytes = std::fs::read(crate::babyllama().join("model.safetensors")).unwrap();
    let hash = format!("{:x}", sha2::Sha256::digest(&bytes));
    assert_eq!(hash, crate::golden()["model_safetensors_sha256"].as_str().unwrap());
}
