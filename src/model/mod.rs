//! Reading model directories: config.json (routed to a model-family contract), model.safetensors and
//! tokenizer.json. Knows the CKB's types, nothing of MCP or processes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ckb::{Ckb, Contract, ModelFamily};
use crate::error::{Error, Result};

mod scaling;

/// A model configuration resolved against a family contract: every field the engine needs, with the
/// HF configuration class defaults applied (the contract's `config[].default`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ResolvedConfig {
    /// Model-family contract id, e.g. `model.llama`.
    pub family: String,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate: usize,
    /// Number of decoder layers.
    pub n_layers: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads (GQA when < n_heads).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (length of the logits).
    pub vocab: usize,
    /// Maximum positions.
    pub max_seq: usize,
    /// RMSNorm epsilon, inside the square root.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Whether lm_head shares the embedding matrix.
    pub tied: bool,
    /// Sliding attention window in positions (a query at p sees max(0, p - window + 1)..=p); 0: full attention.
    #[serde(default)]
    pub sliding_window: usize,
    /// RoPE frequency scaling from config.json `rope_scaling`; absent: plain RoPE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Forward-pass features beyond plain Llama (the family contract's `features`, e.g. `qkv_bias`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

impl ResolvedConfig {
    /// Whether the forward pass has this feature (one of [`crate::ckb::FAMILY_FEATURES`], e.g.
    /// `qkv_bias`, `qk_norm`, `gelu_tanh_mlp`, `fused_qkv`).
    pub fn has(&self, feature: &str) -> bool {
        self.features.iter().any(|f| f == feature)
    }
}

pub use scaling::RopeScaling;

/// Why a config.json is not covered: the fields at fault.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub struct Gap {
    /// config.json key (or `architectures`).
    pub field: String,
    /// What is not covered and what would cover it.
    pub reason: String,
}

/// Read and parse `dir/config.json`.
///
/// # Errors
/// [`crate::error::ErrorKind::Input`] when the directory or file is missing or not a JSON object.
pub fn read_config(dir: &Path) -> Result<serde_json::Map<String, Value>> {
    let path = dir.join("config.json");
    if dir.is_file() {
        return Err(Error::input(format!(
            "{} is a file; pass the Hugging Face model directory that holds config.json, model.safetensors and tokenizer.json",
            dir.display()
        )));
    }
    if !dir.is_dir() {
        return Err(Error::input(format!(
            "model directory {} does not exist; pass a Hugging Face model directory (config.json, model.safetensors, tokenizer.json)",
            dir.display()
        )));
    }
    let llama2c = || {
        std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| e.path().extension().is_some_and(|x| x == "bin"))
    };
    if !path.exists() && llama2c() {
        return Err(Error::input(format!(
            "{} holds a llama2.c checkpoint (.bin) and no config.json: the llama2.c layout is not supported; \
             pass a Hugging Face directory (config.json, model.safetensors, tokenizer.json)",
            dir.display()
        )));
    }
    if !path.exists() {
        return Err(Error::input(format!(
            "{}: does not exist; a Hugging Face model directory has a config.json",
            path.display()
        )));
    }
    let text = crate::util::read_regular_text(&path, &crate::util::CONFIG_JSON)?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::input(format!("{}: must be a JSON object", path.display()))),
        Err(e) => Err(Error::input(format!("{}: not valid JSON: {e}", path.display()))),
    }
}

/// Route a config to a model family: `Ok(contract)` or the gaps that prevent it.
pub fn route<'a>(ckb: &'a Ckb, config: &serde_json::Map<String, Value>) -> std::result::Result<&'a Contract, Vec<Gap>> {
    let architectures: Vec<String> = config
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let model_type = config.get("model_type").and_then(Value::as_str);
    ckb.family_for(&architectures, model_type).ok_or_else(|| {
        let known: Vec<String> =
            ckb.of_kind(crate::ckb::Kind::Model).flat_map(|c| c.model.as_ref().unwrap().architectures.clone()).collect();
        vec![Gap {
            field: "architectures".into(),
            reason: format!(
                "architectures {architectures:?} (model_type {model_type:?}) match no model-family contract; covered: {}. \
                 A new family needs a model contract (propose one)",
                known.join(", ")
            ),
        }]
    })
}

fn number(v: &Value) -> Option<f64> {
    v.as_f64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// Evaluate a contract default: a number, a boolean, another key, or `a / b` of keys.
fn eval_default(expr: &str, config: &serde_json::Map<String, Value>) -> Option<Value> {
    let expr = expr.trim();
    if let Ok(n) = expr.parse::<f64>() {
        return Some(serde_json::json!(n));
    }
    if let Ok(b) = expr.parse::<bool>() {
        return Some(Value::Bool(b));
    }
    if let Some((a, b)) = expr.split_once('/') {
        let a = number(config.get(a.trim())?)?;
        let b = number(config.get(b.trim())?)?;
        return (b != 0.0).then(|| serde_json::json!((a / b).floor()));
    }
    config.get(expr).cloned()
}

/// Resolve a config.json against its family contract: defaults applied, unsupported features and
/// impossible shapes reported as gaps (field + reason).
pub fn resolve(
    contract: &Contract,
    config: &serde_json::Map<String, Value>,
) -> std::result::Result<ResolvedConfig, Vec<Gap>> {
    let family: &ModelFamily = contract.model.as_ref().expect("model contracts have a model section");
    let mut gaps = Vec::new();
    let mut roles: BTreeMap<&str, Value> = BTreeMap::new();
    for f in &family.config {
        let v = match config.get(&f.key).filter(|v| !v.is_null()) {
            Some(v) => Some(v.clone()),
            None => f.default.as_deref().and_then(|d| eval_default(d, config)),
        };
        match v {
            Some(v) => {
                if !f.supported.is_empty() {
                    let s = v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string());
                    if !f.supported.contains(&s) {
                        gaps.push(Gap {
                            field: f.key.clone(),
                            reason: format!(
                                "value {s:?} is not covered by {}; covered: {:?}",
                                contract.id, f.supported
                            ),
                        });
                    }
                }
                roles.insert(&f.role, v);
            }
            None if f.required => gaps.push(Gap {
                field: f.key.clone(),
                reason: format!("required by {} and missing from config.json", contract.id),
            }),
            None => {}
        }
    }
    for key in &family.unsupported_keys {
        if let Some(v) = config.get(key)
            && !v.is_null()
            && v != &Value::Bool(false)
        {
            gaps.push(Gap {
                field: key.clone(),
                reason: format!("`{key}` = {v} is a feature {} does not cover yet", contract.id),
            });
        }
    }
    let int = |role: &str, gaps: &mut Vec<Gap>| -> usize {
        match roles.get(role).and_then(number) {
            Some(n) if n >= 1.0 && n.fract() == 0.0 && n < 1e9 => n as usize,
            Some(n) => {
                gaps.push(Gap { field: role.into(), reason: format!("must be a positive integer, got {n}") });
                0
            }
            None => 0,
        }
    };
    let float = |role: &str| roles.get(role).and_then(number).unwrap_or(f64::NAN);
    let cfg = ResolvedConfig {
        family: contract.id.clone(),
        hidden: int("hidden", &mut gaps),
        intermediate: int("intermediate", &mut gaps),
        n_layers: int("n_layers", &mut gaps),
        n_heads: int("n_heads", &mut gaps),
        n_kv_heads: int("n_kv_heads", &mut gaps),
        head_dim: int("head_dim", &mut gaps),
        vocab: int("vocab", &mut gaps),
        max_seq: int("max_seq", &mut gaps),
        rms_norm_eps: float("rms_norm_eps"),
        rope_theta: float("rope_theta"),
        tied: roles.get("tied").and_then(Value::as_bool).unwrap_or(false),
        sliding_window: 0,
        rope_scaling: None,
        features: family.features.clone(),
    };
    let mut cfg = cfg;
    for f in &family.features {
        // Lint refuses such a contract; a CKB built without lint must not reach the oracle with it.
        if !crate::ckb::FAMILY_FEATURES.iter().any(|(known, _)| known == f) {
            gaps.push(Gap {
                field: "features".into(),
                reason: format!(
                    "{} lists feature `{f}`, which the reference forward pass does not implement",
                    contract.id
                ),
            });
        }
    }
    scaling::resolve_extras(contract, config, &roles, &mut cfg, &mut gaps);
    if gaps.is_empty() {
        if !cfg.n_heads.is_multiple_of(cfg.n_kv_heads) {
            gaps.push(Gap {
                field: "num_key_value_heads".into(),
                reason: format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    cfg.n_heads, cfg.n_kv_heads
                ),
            });
        }
        if !cfg.head_dim.is_multiple_of(2) {
            gaps.push(Gap {
                field: "head_dim".into(),
                reason: format!("head_dim {} must be even for RoPE", cfg.head_dim),
            });
        }
        if cfg.rms_norm_eps.is_nan() || cfg.rms_norm_eps <= 0.0 {
            gaps.push(Gap { field: "rms_norm_eps".into(), reason: "must be a positive number".into() });
        }
        if cfg.rope_theta.is_nan() || cfg.rope_theta <= 0.0 {
            gaps.push(Gap { field: "rope_theta".into(), reason: "must be a positive number".into() });
        }
    }
    if gaps.is_empty() { Ok(cfg) } else { Err(gaps) }
}

/// Read config.json, route it and resolve it in one step.
///
/// # Errors
/// Unreadable config ([`crate::error::ErrorKind::Input`]) or gaps (Usage, listing field and reason).
pub fn load_config(ckb: &Ckb, dir: &Path) -> Result<ResolvedConfig> {
    let config = read_config(dir)?;
    let contract = route(ckb, &config).map_err(|g| gaps_error(dir, &g))?;
    resolve(contract, &config).map_err(|g| gaps_error(dir, &g))
}

fn gaps_error(dir: &Path, gaps: &[Gap]) -> Error {
    Error::usage(format!(
        "{}/config.json is not covered by the knowledge base:\n{}",
        dir.display(),
        gaps.iter().map(|g| format!("  {}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n")
    ))
}

/// All tensors of a safetensors file, widened to f32: name -> (shape, values).
pub type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Read `dir/model.safetensors` (F32, BF16 or F16), widening every tensor to f32.
///
/// # Errors
/// [`crate::error::ErrorKind::Input`] naming the file when it is missing, truncated, or holds an
/// unsupported dtype.
pub fn read_safetensors(dir: &Path) -> Result<Tensors> {
    let path = dir.join("model.safetensors");
    read_safetensors_file(&path)
}

/// Like [`read_safetensors`] for an explicit file path.
///
/// # Errors
/// As [`read_safetensors`].
pub fn read_safetensors_file(path: &Path) -> Result<Tensors> {
    let bytes = crate::util::read_regular(path, &crate::util::SAFETENSORS_FILE)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::input(format!("{}: not a valid safetensors file ({e}); is it truncated or corrupt?", path.display()))
    })?;
    let mut out = Tensors::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => {
                data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            safetensors::Dtype::BF16 => {
                data.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
            }
            safetensors::Dtype::F16 => {
                data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            other => {
                return Err(Error::input(format!(
                    "{}: tensor `{name}` has dtype {other:?}; supported: F32, BF16, F16",
                    path.display()
                )));
            }
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// The HF tokenizer of a model directory (`tokenizer.json`), the reference for the engine's.
///
/// # Errors
/// [`crate::error::ErrorKind::Input`] when the file is missing or malformed.
pub fn hf_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    let bytes = crate::util::read_regular(&path, &crate::util::TOKENIZER_JSON)?;
    tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| Error::input(format!("{}: cannot load tokenizer ({e})", path.display())))
}

/// Encode like `tokenizer(text)` in HF transformers: special tokens added (BOS for Llama).
///
/// # Errors
/// When the tokenizer fails on the text.
pub fn hf_encode(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    tok.encode(text, true)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| Error::input(format!("tokenizer failed on {text:?}: {e}")))
}

/// Decode with special tokens skipped.
///
/// # Errors
/// When an id is outside the vocabulary.
pub fn hf_decode(tok: &tokenizers::Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, true).map_err(|e| Error::input(format!("tokenizer cannot decode {ids:?}: {e}")))
}

/// The model directory used by the demo and tests: `../shared/models/babyllama-105` relative to the
/// repository, or `$METAINFER_MODEL` when set.
pub fn default_model_dir() -> PathBuf {
    if let Ok(p) = std::env::var("METAINFER_MODEL") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/models/babyllama-105")
}
