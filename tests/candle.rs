//! Independent cross-check of the f64 reference forward (crates/oracle/src/llama.rs) against candle-transformers'
//! own model implementations, in f32: BabyLlama and synthetic Llama (plain and with Llama 3.1 RoPE
//! scaling), Mistral, Qwen2, Qwen3 and Gemma checkpoints. Candle is a test-only oracle: this file is compiled
//! only with `--features candle-oracle` and nothing in the library uses candle.
//!
//! Tokens are fed one at a time (sequence length 1 at each position), so candle applies no attention
//! mask; the Mistral sequence stays within its sliding window (candle's prefill mask keeps one position
//! more than Hugging Face's, so the window itself is checked by tests/it/families.rs instead).
#![cfg(feature = "candle-oracle")]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{gemma, llama, mistral, qwen2, qwen3};
use metainfer::ckb::Ckb;
use metainfer::model;
use metainfer::ops::synth::{SynthRequest, synth_config, write_checkpoint};
use metainfer::oracle::llama::Reference;
use serde_json::{Value, json};

const TOL: f64 = 1e-4;
const STEPS: usize = 8;

fn tokens(vocab: usize) -> Vec<u32> {
    (0..STEPS as u32).map(|i| (i * 11 + 1) % vocab as u32).collect()
}

/// The reference's logits at every position of `tokens`.
fn reference(dir: &Path, tokens: &[u32]) -> Vec<Vec<f64>> {
    let cfg = model::load_config(&Ckb::embedded().unwrap(), dir).unwrap();
    let mut r = Reference::new(&cfg, &model::read_safetensors(dir).unwrap()).unwrap();
    tokens.iter().map(|&t| r.step(t).unwrap()).collect()
}

fn weights(dir: &Path) -> VarBuilder<'static> {
    // SAFETY: the file is written by this test (or is the pinned shared checkpoint) and not modified
    // while mapped.
    unsafe { VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &Device::Cpu).unwrap() }
}

fn config(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
}

fn input(t: u32) -> Tensor {
    Tensor::new(&[[t]], &Device::Cpu).unwrap()
}

fn row(logits: Tensor) -> Vec<f32> {
    logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Candle's logits at every position, one token at a time.
fn candle_logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut c = config(dir);
    let kind = c["model_type"].as_str().unwrap().to_string();
    match kind.as_str() {
        "llama" => {
            let cfg: llama::LlamaConfig = serde_json::from_value(c).unwrap();
            let cfg = cfg.into_config(false);
            let m = llama::Llama::load(weights(dir), &cfg).unwrap();
            let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
            tokens.iter().enumerate().map(|(p, &t)| row(m.forward(&input(t), p, &mut cache).unwrap())).collect()
        }
        "mistral" => {
            let cfg: mistral::Config = serde_json::from_value(c).unwrap();
            let mut m = mistral::Model::new(&cfg, weights(dir)).unwrap();
            tokens.iter().enumerate().map(|(p, &t)| row(m.forward(&input(t), p).unwrap())).collect()
        }
        "qwen2" => {
            let cfg: qwen2::Config = serde_json::from_value(c).unwrap();
            let mut m = qwen2::ModelForCausalLM::new(&cfg, weights(dir)).unwrap();
            tokens.iter().enumerate().map(|(p, &t)| row(m.forward(&input(t), p).unwrap())).collect()
        }
        "qwen3" => {
            c["max_window_layers"] = c["num_hidden_layers"].clone();
            let cfg: qwen3::Config = serde_json::from_value(c).unwrap();
            let mut m = qwen3::ModelForCausalLM::new(&cfg, weights(dir)).unwrap();
            tokens.iter().enumerate().map(|(p, &t)| row(m.forward(&input(t), p).unwrap())).collect()
        }
        "gemma" => {
            // candle's Gemma config wants exactly one of hidden_act / hidden_activation, and
            // attention_bias and head_dim stated.
            let o = c.as_object_mut().unwrap();
            o.remove("hidden_activation");
            o.entry("attention_bias").or_insert(json!(false));
            let hd = o["hidden_size"].as_u64().unwrap() / o["num_attention_heads"].as_u64().unwrap();
            o.entry("head_dim").or_insert(json!(hd));
            let cfg: gemma::Config = serde_json::from_value(c).unwrap();
            let mut m = gemma::Model::new(false, &cfg, weights(dir)).unwrap();
            tokens.iter().enumerate().map(|(p, &t)| row(m.forward(&input(t), p).unwrap())).collect()
        }
        other => panic!("no candle model for {other}"),
    }
}

fn agree(name: &str, dir: &Path) {
    let vocab = config(dir)["vocab_size"].as_u64().unwrap() as usize;
    let toks = tokens(vocab);
    let want = reference(dir, &toks);
    let got = candle_logits(dir, &toks);
    assert_eq!(want.len(), got.len());
    let mut worst = 0.0f64;
    for (p, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.len(), g.len(), "{name}: vocab");
        for (i, (a, b)) in w.iter().zip(g).enumerate() {
            let d = (a - *b as f64).abs();
            worst = worst.max(d);
            assert!(d <= TOL, "{name}: position {p} logit {i}: reference {a}, candle {b} (|diff| {d:e})");
        }
    }
    eprintln!("{name}: reference and candle agree, max |diff| {worst:e}");
}

fn synth(root: &Path, name: &str, family: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let req = SynthRequest { family: family.into(), out: root.join(name), seed: 11, ..Default::default() };
    let mut c = synth_config(&req).unwrap();
    edit(&mut c);
    write_checkpoint(&req.out, &c, req.seed).unwrap();
    req.out
}

#[test]
fn babyllama_agrees_with_candle() {
    agree("babyllama", &Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/models/babyllama-105"));
}

#[test]
fn synthetic_llama_agrees_with_candle() {
    let t = tempfile::tempdir().unwrap();
    agree("llama", &synth(t.path(), "llama", "llama", |_| {}));
}

#[test]
fn synthetic_llama3_rope_scaling_agrees_with_candle() {
    let t = tempfile::tempdir().unwrap();
    let dir = synth(t.path(), "llama3", "llama", |c| {
        c["rope_scaling"] = json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16
        })
    });
    agree("llama3", &dir);
}

#[test]
fn synthetic_mistral_agrees_with_candle() {
    let t = tempfile::tempdir().unwrap();
    agree("mistral", &synth(t.path(), "mistral", "mistral", |_| {}));
}

#[test]
fn synthetic_qwen2_agrees_with_candle() {
    let t = tempfile::tempdir().unwrap();
    agree("qwen2", &synth(t.path(), "qwen2", "qwen2", |_| {}));
}

#[test]
fn synthetic_qwen3_agrees_with_candle() {
    let t = tempfile::tempdir().unwrap();
    agree("qwen3", &synth(t.path(), "qwen3", "qwen3", |c| c["head_dim"] = json!(24)));
}

#[test]
fn synthetic_gemma_agrees_with_candle() {
    let t = tempfile::tempdir().unwrap();
    agree("gemma", &synth(t.path(), "gemma", "gemma", |_| {}));
}
