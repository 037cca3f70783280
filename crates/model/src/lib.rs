//! Reading model directories: config.json (routed to a model-family contract, typed as HF reads it),
//! generation_config.json, the weights (one model.safetensors or shards through
//! model.safetensors.index.json, F32/BF16/F16 widened exactly, checked against the family's dtype
//! policy) and tokenizer.json (routed to a tokenizer contract). Knows the CKB's types, nothing of MCP
//! or processes. Every reader takes a [`Files`]: a plain path, or a [`base::beneath::HeldDir`] (a
//! directory a gate confined, read through its handle so a swap after the check redirects nothing).
//!
//! The modules: `scaling` (the sliding window and RoPE: `rope_theta` + `rope_scaling`, or
//! transformers v5's `rope_parameters`), `generation` (generation_config.json: stop ids),
//! [`weights`], [`tokenizer`] (routing and the real vocabularies' test vectors) and [`embedded`]
//! (the demo's model and the shipped tokenizer vectors); HF `tokenizers` itself is here
//! ([`hf_tokenizer`]).

use std::collections::BTreeMap;
use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use base::beneath::Files;
use base::error::{Context, Error, Result};
use ckb::{Ckb, Contract, ModelFamily};

pub mod embedded;
mod generation;
mod scaling;
pub mod tokenizer;
pub mod weights;

pub use generation::{GenerationConfig, generation_config_in, read_generation_config};
pub use weights::{WeightLayout, read_weights, weight_layout};

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
    /// Every other numeric role the family's `[[model.config]]` declares, by role, as config.json
    /// (or the contract's default) gives it, e.g. Granite's `residual_multiplier` or Gemma 2's
    /// `attn_logit_softcapping`; the family's graph reads them. 0 when the key is null (whatever
    /// the default) or absent without a default: the graph's ops read 0 as off (no soft-cap).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, f64>,
    /// Every declared role whose value is not a number, typed as config.json gives it (booleans,
    /// strings, lists such as `layer_types`, objects such as `rope_parameters`; null when a typed
    /// role is absent): graph expressions index them by the layer.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub values: BTreeMap<String, Value>,
}

impl ResolvedConfig {
    /// The value of a config role for graph expressions (`hidden`, `n_heads`, `head_dim`,
    /// `sliding_window`, `rms_norm_eps`, `tied`, ..., then the family's other numeric roles,
    /// [`ResolvedConfig::extra`], then its typed ones, [`ResolvedConfig::values`]).
    pub fn role(&self, name: &str) -> Option<ckb::graph::Val> {
        use ckb::graph::Val;
        Some(Val::Num(match name {
            "hidden" => self.hidden as f64,
            "intermediate" => self.intermediate as f64,
            "n_layers" => self.n_layers as f64,
            "n_heads" => self.n_heads as f64,
            "n_kv_heads" => self.n_kv_heads as f64,
            "head_dim" => self.head_dim as f64,
            "vocab" => self.vocab as f64,
            "max_seq" => self.max_seq as f64,
            "rms_norm_eps" => self.rms_norm_eps,
            "rope_theta" => self.rope_theta,
            "sliding_window" => self.sliding_window as f64,
            "tied" => return Some(Val::Bool(self.tied)),
            _ => match self.extra.get(name) {
                Some(x) => *x,
                None => return self.values.get(name).map(Val::from_json),
            },
        }))
    }

    /// Whether the forward pass has this feature (one of [`ckb::FAMILY_FEATURES`], e.g.
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
/// [`base::error::ErrorKind::Input`] when the directory or file is missing or not a JSON object.
pub fn read_config(dir: &(impl Files + ?Sized)) -> Result<serde_json::Map<String, Value>> {
    dir.check_dir()?;
    let path = dir.show("config.json");
    // Listed without following a swapped-in link (a held directory is listed through its handle).
    let llama2c = || dir.listing().iter().any(|(n, _)| Path::new(n).extension().is_some_and(|x| x == "bin"));
    if !dir.has("config.json") && llama2c() {
        return Err(Error::input(format!(
            "{} holds a llama2.c checkpoint (.bin) and no config.json: the llama2.c layout is not supported; \
             pass a Hugging Face directory (config.json, model.safetensors, tokenizer.json)",
            dir.path().display()
        )));
    }
    if !dir.has("config.json") {
        return Err(Error::input(format!(
            "{}: does not exist; a Hugging Face model directory has a config.json",
            path.display()
        )));
    }
    let text = dir.read_text("config.json", &base::util::CONFIG_JSON)?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::input(format!("{}: must be a JSON object", path.display()))),
        Err(e) => Err(Error::input(format!("{}: not valid JSON: {e}", path.display()))),
    }
}

/// What config.json says the model is: its `architectures` (the strings among them) and `model_type`.
fn identity(config: &serde_json::Map<String, Value>) -> (Vec<String>, Option<&str>) {
    let architectures = config
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    (architectures, config.get("model_type").and_then(Value::as_str))
}

/// Route a config to a model family: `Ok(contract)` or the gaps that prevent it.
pub fn route<'a>(ckb: &'a Ckb, config: &serde_json::Map<String, Value>) -> std::result::Result<&'a Contract, Vec<Gap>> {
    let (architectures, model_type) = identity(config);
    ckb.family_for(&architectures, model_type).ok_or_else(|| {
        let known: Vec<String> =
            ckb.of_kind(ckb::Kind::Model).flat_map(|c| c.model.as_ref().unwrap().architectures.clone()).collect();
        vec![Gap {
            field: "architectures".into(),
            reason: format!(
                "architectures {architectures:?} (model_type {}) match no model-family contract; covered: {}. \
                 A new family needs a model contract (propose one)",
                model_type.map_or("absent".to_string(), |m| format!("{m:?}")),
                known.join(", ")
            ),
        }]
    })
}

/// Staged candidates (`id@version`) that claim this config.json's architecture but do not route it:
/// an established family does ([`Ckb::shadowed`]).
pub fn shadowed(ckb: &Ckb, config: &serde_json::Map<String, Value>) -> Vec<String> {
    let (architectures, model_type) = identity(config);
    ckb.shadowed(&architectures, model_type).into_iter().map(|c| format!("{}@{}", c.id, c.version)).collect()
}

/// A JSON number as f64. Strings are not numbers: HF reads config.json as typed JSON, so
/// `"hidden_size": "128"` is refused by [`resolve`] with the key named, never coerced.
fn number(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// The JSON type a config role must have in config.json, where the role fixes one.
fn role_type(role: &str) -> Option<&'static str> {
    match role {
        "hidden" | "intermediate" | "n_layers" | "n_heads" | "n_kv_heads" | "head_dim" | "vocab" | "max_seq"
        | "rms_norm_eps" | "rope_theta" => Some("number"),
        "sliding_window" => Some("number or null"),
        "tied" => Some("boolean"),
        "activation" => Some("string"),
        "rope_scaling" | "rope_parameters" => Some("object or null"),
        _ => None,
    }
}

/// Whether `v` has the JSON type [`role_type`] names.
fn has_type(v: &Value, ty: &str) -> bool {
    match ty {
        "number" => v.is_number(),
        "number or null" => v.is_number() || v.is_null(),
        "boolean" => v.is_boolean(),
        "string" => v.is_string(),
        "object or null" => v.is_object() || v.is_null(),
        _ => true,
    }
}

/// The JSON type of a value in words, for messages.
pub(crate) fn json_type(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
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
        if let (Some(v), Some(ty)) = (config.get(&f.key), role_type(&f.role))
            && !has_type(v, ty)
            && !v.is_null()
        {
            gaps.push(Gap {
                field: f.key.clone(),
                reason: format!(
                    "must be a JSON {ty}, got {}; HF reads config.json as typed JSON (write numbers and booleans without quotes)",
                    json_type(v)
                ),
            });
            continue;
        }
        let v = match config.get(&f.key).filter(|v| !v.is_null()) {
            Some(v) => Some(v.clone()),
            None => f.default.as_deref().and_then(|d| eval_default(d, config)),
        };
        match v {
            Some(v) => {
                if let (false, Some(list)) = (f.supported.is_empty(), v.as_array()) {
                    // A list's entries are each one of the covered values (layer types the graph names).
                    for (i, e) in list.iter().enumerate() {
                        let s = e.as_str().map(str::to_owned).unwrap_or_else(|| e.to_string());
                        if !f.supported.contains(&s) {
                            gaps.push(Gap {
                                field: f.key.clone(),
                                reason: format!(
                                    "entry {i} is {s:?}, which {}'s graph does not name; covered: {:?}",
                                    contract.id, f.supported
                                ),
                            });
                        }
                    }
                } else if !f.supported.is_empty() {
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
        // Absent, null, false or an empty list (Qwen3-MoE's mlp_only_layers: []) leave it off.
        if let Some(v) = config.get(key)
            && !v.is_null()
            && v != &Value::Bool(false)
            && v.as_array().is_none_or(|a| !a.is_empty())
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
        extra: BTreeMap::new(),
        values: BTreeMap::new(),
    };
    let mut cfg = cfg;
    for f in &family.features {
        // Lint refuses such a contract; a CKB built without lint must not reach the oracle with it.
        if !ckb::FAMILY_FEATURES.iter().any(|(known, _)| known == f) {
            gaps.push(Gap {
                field: "features".into(),
                reason: format!(
                    "{} lists feature `{f}`, which the reference forward pass does not implement",
                    contract.id
                ),
            });
        }
    }
    for f in family.config.iter().filter(|f| role_type(&f.role).is_none()) {
        if let Some(ty) = f.value_type.as_deref().filter(|t| *t != "number") {
            typed_role(contract, f, ty, roles.get(f.role.as_str()), cfg.n_layers, &mut cfg, &mut gaps);
            continue;
        }
        // An explicit null is "off" (HF: no soft-cap), whatever the default.
        let explicit_null = config.get(&f.key).is_some_and(Value::is_null);
        match roles.get(f.role.as_str()).filter(|_| !explicit_null) {
            None | Some(Value::Null) => {
                cfg.extra.insert(f.role.clone(), 0.0);
            }
            Some(v) => match number(v) {
                Some(n) if n.is_finite() => {
                    cfg.extra.insert(f.role.clone(), n);
                }
                _ => gaps.push(Gap {
                    field: f.key.clone(),
                    reason: format!(
                        "must be a JSON number or null (role `{}`, read by {}'s forward-pass graph), got {v}",
                        f.role, contract.id
                    ),
                }),
            },
        }
    }
    for f in family.config.iter().filter(|f| role_type(&f.role).is_some()) {
        // The fixed roles that are not numbers (an activation's name, rope_parameters) are typed
        // values of the graph's expressions too, where the graph reads them (null when absent).
        if !matches!(role_type(&f.role), Some("number" | "number or null")) && scaling::graph_reads(family, &f.key) {
            cfg.values.insert(f.role.clone(), roles.get(f.role.as_str()).cloned().unwrap_or(Value::Null));
        }
    }
    scaling::resolve_extras(contract, config, &roles, &mut cfg, &mut gaps);
    if gaps.is_empty()
        && let Some(g) = &family.graph
    {
        check_graph(g, &cfg, &mut gaps);
    }
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
        let declares = |role: &str| family.config.iter().any(|f| f.role == role);
        if declares("rms_norm_eps") && (cfg.rms_norm_eps.is_nan() || cfg.rms_norm_eps <= 0.0) {
            gaps.push(Gap { field: "rms_norm_eps".into(), reason: "must be a positive number".into() });
        }
        if cfg.rope_theta.is_nan() || cfg.rope_theta <= 0.0 {
            gaps.push(Gap { field: "rope_theta".into(), reason: "must be a positive number".into() });
        }
    }
    if gaps.is_empty() { Ok(cfg) } else { Err(gaps) }
}

/// A role of a declared JSON type (`boolean`, `string`, `list`, `object`): kept as typed in
/// `cfg.values` (null when absent), or a gap when config.json gives another type, or a
/// `per_layer` list of another length than the layers.
fn typed_role(
    contract: &Contract,
    f: &ckb::ConfigField,
    ty: &str,
    v: Option<&Value>,
    n_layers: usize,
    cfg: &mut ResolvedConfig,
    gaps: &mut Vec<Gap>,
) {
    let v = v.cloned().unwrap_or(Value::Null);
    let fits = match ty {
        "boolean" => v.is_boolean(),
        "string" => v.is_string(),
        "list" => v.is_array(),
        "object" => v.is_object(),
        _ => false,
    };
    if !fits && !v.is_null() {
        gaps.push(Gap {
            field: f.key.clone(),
            reason: format!(
                "must be a JSON {ty} (role `{}`, read by {}'s forward-pass graph), got {}",
                f.role,
                contract.id,
                json_type(&v)
            ),
        });
        return;
    }
    if let (true, Some(list)) = (f.per_layer, v.as_array())
        && list.len() != n_layers
    {
        gaps.push(Gap {
            field: f.key.clone(),
            reason: format!("has {} entries, one per layer is needed: num_hidden_layers is {n_layers}", list.len()),
        });
        return;
    }
    cfg.values.insert(f.role.clone(), v);
}

/// Evaluate every parameter of the family's graph at this config, at every layer, so that a
/// contract expression that cannot be evaluated here (a division by zero, an index past a list, a
/// layer type the graph does not name, a value of the wrong type) is a gap naming the node and
/// layer at plan, never a panic or a NaN in the reference; and each op's own conditions on its
/// evaluated parameters ([`ckb::graph::check_params`]).
fn check_graph(g: &ckb::Graph, cfg: &ResolvedConfig, gaps: &mut Vec<Gap>) {
    type Block<'a> = (&'a str, &'a [ckb::GraphNode], Vec<Option<usize>>);
    let blocks: [Block<'_>; 3] = [
        ("prologue", &g.prologue, vec![None]),
        ("layer", &g.layer, (0..cfg.n_layers).map(Some).collect()),
        ("epilogue", &g.epilogue, vec![None]),
    ];
    for (block, nodes, layers) in blocks {
        for layer in layers {
            let role = |r: &str| match (r, layer) {
                ("layer", Some(i)) => Some(ckb::graph::Val::Num(i as f64)),
                _ => cfg.role(r),
            };
            // (node, top_k) of the block's routers and the experts its experts nodes hold.
            let (mut routers, mut experts) = (Vec::new(), Vec::new());
            for n in nodes {
                let at = layer.map_or(n.name.clone(), |i| format!("layers.{i}.{}", n.name));
                let mut params = BTreeMap::new();
                for (k, e) in n.params.iter().filter(|(k, _)| *k != "gain") {
                    match ckb::graph::eval_expr(e, &role) {
                        Ok(v) => {
                            params.insert(k.clone(), v);
                        }
                        Err(m) => {
                            gaps.push(Gap {
                                field: format!("model.graph.{block}.{}", n.name),
                                reason: format!("node `{at}`: parameter `{k}` = `{e}`: {m}"),
                            });
                            return;
                        }
                    }
                }
                if let Err(m) = ckb::graph::check_params(&n.op, &params, cfg.head_dim) {
                    gaps.push(Gap {
                        field: format!("model.graph.{block}.{}", n.name),
                        reason: format!("node `{at}`: {m}"),
                    });
                    return;
                }
                match (n.op.as_str(), params.get("top_k"), params.get("experts")) {
                    ("moe_route", Some(k), _) => routers.push((at, n.name.clone(), n.params["top_k"].clone(), *k)),
                    (op, _, Some(e)) if ckb::is_moe_experts(op) => experts.push(*e),
                    _ => {}
                }
            }
            if let Some(&fewest) = experts.iter().min_by(|a, b| a.total_cmp(b))
                && let Some((at, name, expr, k)) = routers.into_iter().find(|r| r.3 > fewest)
            {
                gaps.push(Gap {
                    field: format!("model.graph.{block}.{name}"),
                    reason: format!(
                        "node `{at}` keeps top_k = {k} experts per token (`{expr}`), more than the {fewest} experts the layer has: the config is inconsistent (num_experts_per_tok must be at most the expert count)"
                    ),
                });
                return;
            }
        }
    }
}

/// Read config.json, route it and resolve it in one step.
///
/// # Errors
/// Unreadable config ([`base::error::ErrorKind::Input`]) or gaps (Usage, listing field and reason).
pub fn load_config(ckb: &Ckb, dir: &(impl Files + ?Sized)) -> Result<ResolvedConfig> {
    resolve_config(ckb, dir, &read_config(dir)?)
}

/// Route `config` (config.json of `dir`, already read) and resolve it.
///
/// # Errors
/// As [`load_config`], for the gaps.
pub fn resolve_config(
    ckb: &Ckb,
    dir: &(impl Files + ?Sized),
    config: &serde_json::Map<String, Value>,
) -> Result<ResolvedConfig> {
    let contract = route(ckb, config).map_err(|g| gaps_error(dir.path(), &g))?;
    resolve(contract, config).map_err(|g| gaps_error(dir.path(), &g))
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

/// Read the weights of `dir` (one `model.safetensors`, or the shards `model.safetensors.index.json`
/// names), widening every F32, BF16 or F16 tensor exactly to f32, one tensor at a time.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the file (and tensor) when a file is missing, truncated,
/// holds an unsupported dtype, or the index and the shards disagree (see [`weight_layout`]).
pub fn read_safetensors(dir: &(impl Files + ?Sized)) -> Result<Tensors> {
    weights::read_weights(dir)
}

/// Like [`read_safetensors`] for an explicit single file.
///
/// # Errors
/// As [`read_safetensors`].
pub fn read_safetensors_file(path: &Path) -> Result<Tensors> {
    let bytes = base::util::read_regular(path, &base::util::SAFETENSORS_FILE)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::input(format!("{}: not a valid safetensors file ({e}); is it truncated or corrupt?", path.display()))
    })?;
    let mut out = Tensors::new();
    for (name, view) in st.tensors() {
        let values = weights::widen_bytes(&format!("{:?}", view.dtype()), view.data()).map_err(|other| {
            Error::input(format!("{}: tensor `{name}` has dtype {other}; supported: F32, BF16, F16", path.display()))
        })?;
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// The storage dtype config.json declares (`torch_dtype`, or transformers v5's `dtype`), as a
/// safetensors dtype name: `F32`, `BF16`, `F16`; None when absent or another value.
pub fn declared_dtype(config: &serde_json::Map<String, Value>) -> Option<&'static str> {
    match config.get("dtype").or_else(|| config.get("torch_dtype")).and_then(Value::as_str)? {
        "float32" | "fp32" => Some("F32"),
        "bfloat16" | "bf16" => Some("BF16"),
        "float16" | "fp16" | "half" => Some("F16"),
        _ => None,
    }
}

/// Notes on stored dtypes that differ from the one config.json declares without being refused: a
/// checkpoint declaring bfloat16 whose tensors are stored as F16 (or the reverse) was converted on
/// export, through a format of another range and precision (F16: 5 exponent bits, largest 65504;
/// BF16: 8 exponent bits, 7 fraction bits), so its values may not be the trained ones. Both widen
/// exactly, and the reference and the engine compute with them as stored. Empty when they agree.
pub fn dtype_notes(config: &serde_json::Map<String, Value>, layout: &WeightLayout) -> Vec<String> {
    let Some(declared) = declared_dtype(config) else { return vec![] };
    let other = match declared {
        "BF16" => "F16",
        "F16" => "BF16",
        _ => return vec![],
    };
    let n = layout.tensors.values().filter(|t| t.dtype == other).count();
    if n == 0 {
        return vec![];
    }
    vec![format!(
        "config.json declares {} but {n} of {} tensors are stored as {other}: they were converted on export through a format of another range and precision, so they may differ from the trained values (they are read exactly as stored; re-export in the declared dtype to check the model as trained)",
        if declared == "BF16" { "bfloat16" } else { "float16" },
        layout.tensors.len()
    )]
}

/// Check the stored dtypes of a checkpoint against its family's dtype policy
/// (`[model.dtype_policy]`): every tensor is F32, BF16 or F16, and when config.json declares float32,
/// the tensors the policy keeps in f32 (norm gains, biases) are stored as F32.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the weight file, the tensor, its dtype and what to change.
pub fn check_dtype_policy(
    contract: &Contract,
    cfg: &ResolvedConfig,
    config: &serde_json::Map<String, Value>,
    layout: &WeightLayout,
) -> Result<()> {
    for (name, t) in &layout.tensors {
        if !matches!(t.dtype.as_str(), "F32" | "BF16" | "F16") {
            return Err(Error::input(format!(
                "{}: tensor `{name}` is stored as {}; the reference and the engines read F32, BF16 and F16 only (convert the checkpoint)",
                t.file, t.dtype
            )));
        }
    }
    let (Some(family), Some("F32")) = (contract.model.as_ref(), declared_dtype(config)) else { return Ok(()) };
    let Some(policy) = &family.dtype_policy else { return Ok(()) };
    for w in family.weights.iter().filter(|w| policy.keep_f32.contains(&w.role)) {
        let names: Vec<String> = if w.name.contains("{i}") {
            (0..cfg.n_layers).map(|i| w.name.replace("{i}", &i.to_string())).collect()
        } else {
            vec![w.name.clone()]
        };
        for n in names {
            if let Some(t) = layout.tensors.get(&n).filter(|t| t.dtype != "F32") {
                return Err(Error::input(format!(
                    "{}: tensor `{n}` ({}) is stored as {}, but config.json declares float32 and {} keeps {} weights in f32 (dtype policy): it was rounded on export; re-export the checkpoint with this tensor in F32, or declare the dtype it was saved in (torch_dtype)",
                    t.file, w.role, t.dtype, contract.id, w.role
                )));
            }
        }
    }
    Ok(())
}

/// Largest finite IEEE binary16 value; an f32 of magnitude at or beyond 65520 (half an ulp above)
/// rounds to infinity (IEEE 754-2008, binary16: emax 15, 10 fraction bits).
pub const F16_MAX: f32 = 65504.0;

/// Check that every weight is finite, and that the weights an engine stores at `dtype` (the 2-D
/// ones, which the reference rounds as the dtype policy says) stay finite when rounded to it: an
/// f16 engine of a checkpoint holding 7e4 in a BF16 matrix would compute infinities and NaN, and
/// so would the reference, and a gate would compare NaN with NaN.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming the tensor, the element, its value and the dtype's
/// range, with what to choose instead.
pub fn check_weight_range(tensors: &Tensors, dtype: &str) -> Result<()> {
    for (name, (shape, v)) in tensors {
        if let Some(at) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::input(format!(
                "weight `{name}` holds {} at element {at}: the checkpoint is damaged (re-export it); no engine can be checked on it",
                v[at]
            )));
        }
        if dtype == "f16"
            && shape.len() >= 2
            && let Some(at) = v.iter().position(|x| half::f16::from_f32(*x).is_infinite())
        {
            let cols = shape[shape.len() - 1].max(1);
            return Err(Error::input(format!(
                "weight `{name}` holds {:e} at element {at} (row {}, column {}), beyond the f16 range (largest finite value {F16_MAX}; it rounds to infinity): an engine storing f16 weights computes infinities and NaN on this checkpoint; choose dtype bf16 or f32",
                v[at],
                at / cols,
                at % cols
            )));
        }
    }
    Ok(())
}

/// HF's tie rule: with `tie_word_embeddings` true the embedding matrix is the output matrix and any
/// `lm_head.weight` in the checkpoint is ignored. A warning when such an ignored lm_head differs from
/// the embedding (an engine that reads it computes other logits than HF).
pub fn tied_head_warning(cfg: &ResolvedConfig, tensors: &Tensors) -> Option<String> {
    let (Some((_, head)), Some((_, embed))) = (tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight"))
    else {
        return None;
    };
    if !cfg.tied {
        return None;
    }
    let diff = if head.len() == embed.len() {
        head.iter().zip(embed).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
    } else {
        f32::INFINITY
    };
    (diff > 0.0).then(|| {
        format!(
            "config.json sets tie_word_embeddings, so HF uses model.embed_tokens.weight as the output matrix and ignores lm_head.weight, which differs from it (max |difference| {diff:.3e}); the reference does the same, and so must the engine"
        )
    })
}

/// The HF tokenizer of a model directory (`tokenizer.json`), the reference for the engine's.
///
/// # Errors
/// [`base::error::ErrorKind::Input`] when the file is missing or malformed.
pub fn hf_tokenizer(dir: &(impl Files + ?Sized)) -> Result<tokenizers::Tokenizer> {
    let bytes = dir.read("tokenizer.json", &base::util::TOKENIZER_JSON)?;
    hf_tokenizer_from(&dir.show("tokenizer.json"), &bytes)
}

/// The Hugging Face tokenizer from tokenizer.json's `bytes` (read from `path`, named in errors).
///
/// # Errors
/// [`base::error::ErrorKind::Input`] naming `path` when the tokenizer cannot be built.
pub fn hf_tokenizer_from(path: &Path, bytes: &[u8]) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| Error::input(format!("{}: cannot load tokenizer ({e})", path.display())))
}

/// Encode like `tokenizer(text)` in HF transformers: special tokens added (BOS for Llama).
///
/// # Errors
/// When the tokenizer fails on the text.
pub fn hf_encode(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    tok.encode(text, true).map(|e| e.get_ids().to_vec()).ctx(|| format!("tokenizer failed on {text:?}"))
}

/// Encode like `tokenizer(text, add_special_tokens=False)`: no template tokens (how the real
/// vocabularies' test vectors were made).
///
/// # Errors
/// When the tokenizer fails on the text.
pub fn hf_encode_plain(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    tok.encode(text, false).map(|e| e.get_ids().to_vec()).ctx(|| format!("tokenizer failed on {text:?}"))
}

/// Decode with special tokens skipped.
///
/// # Errors
/// When an id is outside the vocabulary.
pub fn hf_decode(tok: &tokenizers::Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, true).ctx(|| format!("tokenizer cannot decode {ids:?}"))
}
