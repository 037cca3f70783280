//! The parts of a resolved config beyond the flat `config[]` roles: the sliding attention window and
//! RoPE (`rope_theta` + `rope_scaling`, or transformers v5's `rope_parameters`), each checked with
//! field and reason.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Gap, ResolvedConfig, number};
use ckb::Contract;

/// RoPE frequency scaling as config.json `rope_scaling` gives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RopeScaling {
    /// `linear` (positions divided by `factor`), `llama3` (frequency-dependent, Llama 3.1) or
    /// `yarn` (frequency-dependent with an attention factor, Peng et al. 2023, arXiv:2309.00071).
    pub rope_type: String,
    /// Scaling factor (> 0).
    pub factor: f64,
    /// llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by factor.
    #[serde(default)]
    pub low_freq_factor: f64,
    /// llama3: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept.
    #[serde(default)]
    pub high_freq_factor: f64,
    /// llama3 and yarn: context length the model was pretrained with.
    #[serde(default)]
    pub original_max_position_embeddings: usize,
    /// yarn: the number of rotations over the original context above which a frequency is kept
    /// (transformers' default 32).
    #[serde(default)]
    pub beta_fast: f64,
    /// yarn: the number of rotations below which a frequency is divided by `factor` (default 1).
    #[serde(default)]
    pub beta_slow: f64,
    /// yarn: whether the ramp's ends are rounded to whole dimensions (floor, ceil); transformers'
    /// default true, gpt-oss writes false.
    #[serde(default)]
    pub truncate: bool,
    /// The factor multiplying cos and sin, so that q.k is scaled by its square (yarn's "mscale",
    /// `0.1 ln(factor) + 1` unless config.json gives `attention_factor` or `mscale` and
    /// `mscale_all_dim`); 1 for linear and llama3.
    #[serde(default = "unit")]
    pub attention_factor: f64,
}

fn unit() -> f64 {
    1.0
}

impl RopeScaling {
    /// A scaling of `rope_type` with `factor` and every other field neutral (attention factor 1).
    pub fn new(rope_type: &str, factor: f64) -> RopeScaling {
        RopeScaling {
            rope_type: rope_type.into(),
            factor,
            low_freq_factor: 0.0,
            high_freq_factor: 0.0,
            original_max_position_embeddings: 0,
            beta_fast: 0.0,
            beta_slow: 0.0,
            truncate: false,
            attention_factor: 1.0,
        }
    }
}

/// YaRN's attention factor for a context scaled by `scale` (Peng et al. 2023, arXiv:2309.00071,
/// eq. 22 with the 0.1 of transformers' `get_mscale`): `0.1 * mscale * ln(scale) + 1`, and 1 when
/// `scale <= 1`.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 }
}

/// Fill `cfg.sliding_window` and `cfg.rope_scaling`, pushing gaps for values the family cannot run.
pub(super) fn resolve_extras(
    contract: &Contract,
    config: &serde_json::Map<String, Value>,
    roles: &BTreeMap<&str, Value>,
    cfg: &mut ResolvedConfig,
    gaps: &mut Vec<Gap>,
) {
    let family = contract.model.as_ref().expect("model contracts have a model section");
    if cfg.has("sliding_window") {
        let key = family.config.iter().find(|f| f.role == "sliding_window").map(|f| f.key.as_str());
        let explicit_null = key.is_some_and(|k| config.get(k).is_some_and(Value::is_null));
        cfg.sliding_window = match roles.get("sliding_window") {
            _ if explicit_null => 0,
            None | Some(Value::Null) => 0,
            Some(v) => match number(v) {
                Some(n) if n >= 1.0 && n.fract() == 0.0 && n < 1e9 => n as usize,
                _ => {
                    gaps.push(Gap {
                        field: key.unwrap_or("sliding_window").into(),
                        reason: format!(
                            "must be a positive integer (window in positions) or null (full attention), got {v}"
                        ),
                    });
                    0
                }
            },
        };
        if cfg.sliding_window == 0 {
            cfg.features.retain(|f| f != "sliding_window");
        }
    }
    resolve_rope(contract, config, cfg, gaps);
}

/// Keys a RoPE description may hold besides its scaling keys: the type (`rope_type`, or legacy `type`)
/// and, in transformers v5's `rope_parameters`, the base `rope_theta`.
const ROPE_COMMON_KEYS: &[&str] = &["rope_type", "type", "rope_theta"];

/// The scaling keys of each covered rope_type (transformers' modeling_rope_utils: linear reads
/// `factor`; llama3 reads `factor`, `low_freq_factor`, `high_freq_factor` and
/// `original_max_position_embeddings`; yarn (`_compute_yarn_parameters`) reads `factor`,
/// `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `truncate`, `attention_factor`,
/// `mscale` and `mscale_all_dim`). Any other key changes RoPE in a way the oracle does not
/// implement, so it is refused by name rather than ignored.
fn rope_keys(rope_type: &str) -> Option<&'static [&'static str]> {
    match rope_type {
        "default" => Some(&[]),
        "linear" => Some(&["factor"]),
        "llama3" => Some(&["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]),
        "yarn" => Some(&[
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "truncate",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
        ]),
        _ => None,
    }
}

/// RoPE as HF reads it. transformers v5 writes `rope_parameters` (`{rope_type, rope_theta, ...scaling
/// keys}`) in place of `rope_theta` + `rope_scaling`, and reads `rope_parameters` first: its
/// `rope_theta` wins over a top-level one (which only fills it when absent), and `rope_scaling` is an
/// alias of the same dictionary. Both forms resolve to the same `rope_theta` and `rope_scaling` here.
/// Refused by name: a rope_type the oracle does not implement, a key the rope_type does not have,
/// per-layer-type parameters (`{"full_attention": {...}, "sliding_attention": {...}}`), and
/// `rope_parameters` and `rope_scaling` that disagree.
fn resolve_rope(
    contract: &Contract,
    config: &serde_json::Map<String, Value>,
    cfg: &mut ResolvedConfig,
    gaps: &mut Vec<Gap>,
) {
    let family = contract.model.as_ref().expect("model contracts have a model section");
    let params = config.get("rope_parameters").filter(|v| !v.is_null());
    let legacy = config.get("rope_scaling").filter(|v| !v.is_null());
    // Legacy `type` means `rope_type`; v5's dictionary also carries the base.
    let normalised = |v: &Value| -> Value {
        let mut v = v.clone();
        if let Some(o) = v.as_object_mut() {
            if let Some(t) = o.remove("type") {
                o.entry("rope_type").or_insert(t);
            }
            o.remove("rope_theta");
        }
        v
    };
    let (field, rs) = match (params, legacy) {
        (None, None) => return,
        (Some(p), Some(l)) if normalised(p) != normalised(l) => {
            gaps.push(Gap {
                field: "rope_parameters".into(),
                reason: format!(
                    "rope_parameters {p} and rope_scaling {l} disagree; transformers v5 reads rope_parameters (rope_scaling is its alias): remove rope_scaling or make the two equal"
                ),
            });
            return;
        }
        (Some(p), _) => ("rope_parameters", p),
        // A family that refuses rope_scaling has already named it (model::resolve, unsupported_keys).
        (None, Some(_)) if family.unsupported_keys.iter().any(|k| k == "rope_scaling") => return,
        (None, Some(l)) => ("rope_scaling", l),
    };
    let gap = |reason: String| Gap { field: field.into(), reason };
    let Some(obj) = rs.as_object() else {
        gaps.push(gap(format!(
            "must be an object with rope_type (and its scaling keys), got {}",
            super::json_type(rs)
        )));
        return;
    };
    if obj.values().any(Value::is_object) && graph_reads(family, field) {
        // Per-layer-type parameters the family's graph reads itself (a RoPE base per layer type):
        // each must be plain RoPE with a positive base; the full-attention one is the config's.
        for (kind, sub) in obj {
            let Some(o) = sub.as_object() else {
                gaps.push(gap(format!("{field}.{kind} must be an object (the RoPE of layers of type {kind})")));
                continue;
            };
            let t = o.get("rope_type").or_else(|| o.get("type")).and_then(Value::as_str).unwrap_or("default");
            if t != "default" {
                gaps.push(gap(format!(
                    "{field}.{kind}.rope_type {t:?}: per-layer-type RoPE scaling is not covered by {}; only \"default\" is",
                    contract.id
                )));
            }
            if let Some(k) = o.keys().find(|k| !ROPE_COMMON_KEYS.contains(&k.as_str())) {
                gaps.push(gap(format!(
                    "{field}.{kind}.{k} is not a key of rope_type \"default\"; the reference would ignore it"
                )));
            }
            match o.get("rope_theta").and_then(number) {
                Some(x) if x > 0.0 && x.is_finite() => {
                    if kind == "full_attention" {
                        cfg.rope_theta = x;
                    }
                }
                _ => gaps.push(gap(format!("{field}.{kind}.rope_theta must be a positive number"))),
            }
        }
        return;
    }
    if obj.values().any(Value::is_object) {
        let layer_types: Vec<&String> = obj.iter().filter(|(_, v)| v.is_object()).map(|(k, _)| k).collect();
        gaps.push(gap(format!(
            "per-layer-type RoPE parameters ({}) are not covered by {}: its layers all rotate with one RoPE",
            layer_types.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", "),
            contract.id
        )));
        return;
    }
    let rope_type = match obj.get("rope_type").or_else(|| obj.get("type")) {
        None => "default",
        Some(Value::String(t)) => t.as_str(),
        Some(other) => {
            gaps.push(gap(format!("{field}.rope_type must be a string, got {}", super::json_type(other))));
            return;
        }
    };
    if field == "rope_parameters"
        && let Some(t) = obj.get("rope_theta")
    {
        match number(t) {
            Some(x) if x > 0.0 && x.is_finite() => cfg.rope_theta = x,
            _ => {
                gaps.push(gap(format!(
                    "rope_parameters.rope_theta must be a positive number, got {}",
                    super::json_type(t)
                )));
                return;
            }
        }
    }
    let Some(allowed) = rope_keys(rope_type) else {
        gaps.push(gap(format!(
            "rope_type {rope_type:?} is not covered by {}; covered: \"default\", \"linear\", \"llama3\", \"yarn\" (dynamic, longrope and others change RoPE in ways the oracle does not implement)",
            contract.id
        )));
        return;
    };
    if rope_type != "default" && family.unsupported_keys.iter().any(|k| k == "rope_scaling") {
        gaps.push(gap(format!(
            "rope_type {rope_type:?} scales RoPE, which {} does not cover (it lists rope_scaling as unsupported); only \"default\" is",
            contract.id
        )));
        return;
    }
    let mut unknown = false;
    for (k, v) in obj {
        let known = ROPE_COMMON_KEYS.contains(&k.as_str()) || allowed.contains(&k.as_str());
        // v5 moves partial_rotary_factor into rope_parameters; 1.0 rotates every pair, as the
        // oracle's `rope` does; another factor is the family graph's to read (its `rotary` nodes),
        // from the top-level key, which must then agree.
        let full_rotary = k == "partial_rotary_factor" && number(v) == Some(1.0);
        let partial_read = k == "partial_rotary_factor" && graph_reads(family, "partial_rotary_factor");
        if partial_read
            && let Some(top) = config.get("partial_rotary_factor").filter(|t| !t.is_null())
            && number(top) != number(v)
        {
            gaps.push(gap(format!(
                "{field}.partial_rotary_factor {v} and partial_rotary_factor {top} disagree; transformers v5 reads rope_parameters: make them equal"
            )));
        }
        if partial_read
            && config.get("partial_rotary_factor").is_none_or(Value::is_null)
            && let (Some(x), Some(f)) = (number(v), family.config.iter().find(|f| f.key == "partial_rotary_factor"))
        {
            cfg.extra.insert(f.role.clone(), x);
        }
        if !known && !full_rotary && !partial_read {
            unknown = true;
            gaps.push(gap(format!(
                "{field}.{k} is not a key of rope_type {rope_type:?} (its keys: {}); the oracle would ignore it, so it is refused: remove it or use a covered rope_type",
                if allowed.is_empty() { "none besides rope_type and rope_theta".to_string() } else { allowed.join(", ") }
            )));
        }
    }
    if unknown {
        return;
    }
    let num = |k: &str| obj.get(k).and_then(number);
    let positive = |k: &str, gaps: &mut Vec<Gap>| -> f64 {
        match (obj.get(k), num(k)) {
            (_, Some(x)) if x > 0.0 && x.is_finite() => x,
            (Some(v), _) => {
                gaps.push(gap(format!("{field}.{k} must be a positive number, got {}", super::json_type(v))));
                f64::NAN
            }
            (None, _) => {
                gaps.push(gap(format!(
                    "{field}.{k} is required for rope_type {rope_type:?} and missing from config.json"
                )));
                f64::NAN
            }
        }
    };
    match rope_type {
        "linear" => {
            let factor = positive("factor", gaps);
            cfg.rope_scaling = Some(RopeScaling::new("linear", factor));
        }
        "llama3" => {
            let before = gaps.len();
            let factor = positive("factor", gaps);
            let low = positive("low_freq_factor", gaps);
            let high = positive("high_freq_factor", gaps);
            let orig = positive("original_max_position_embeddings", gaps);
            if gaps.len() == before {
                if high <= low {
                    gaps.push(gap(format!(
                        "{field}.high_freq_factor ({high}) must exceed low_freq_factor ({low}): the smoothing between them divides by their difference"
                    )));
                }
                if orig.fract() != 0.0 {
                    gaps.push(gap(format!("{field}.original_max_position_embeddings must be an integer, got {orig}")));
                }
            }
            cfg.rope_scaling = Some(RopeScaling {
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: if orig.is_finite() { orig as usize } else { 0 },
                ..RopeScaling::new("llama3", factor)
            });
        }
        "yarn" => {
            let factor = positive("factor", gaps);
            let optional = |k: &str, default: f64, gaps: &mut Vec<Gap>| {
                if obj.get(k).is_none_or(Value::is_null) { default } else { positive(k, gaps) }
            };
            let orig = optional("original_max_position_embeddings", cfg.max_seq as f64, gaps);
            if orig.is_finite() && orig.fract() != 0.0 {
                gaps.push(gap(format!("{field}.original_max_position_embeddings must be an integer, got {orig}")));
            }
            let (beta_fast, beta_slow) = (optional("beta_fast", 32.0, gaps), optional("beta_slow", 1.0, gaps));
            let truncate = match obj.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    gaps.push(gap(format!("{field}.truncate must be true or false, got {}", super::json_type(v))));
                    true
                }
            };
            // transformers' order: an explicit attention_factor, else the ratio of the mscales
            // when both are given, else the mscale of the factor.
            let (mscale, all_dim) = (optional("mscale", 0.0, gaps), optional("mscale_all_dim", 0.0, gaps));
            let attention_factor = if obj.get("attention_factor").is_some_and(|v| !v.is_null()) {
                positive("attention_factor", gaps)
            } else if mscale > 0.0 && all_dim > 0.0 {
                yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
            } else {
                yarn_mscale(factor, 1.0)
            };
            cfg.rope_scaling = Some(RopeScaling {
                original_max_position_embeddings: if orig.is_finite() { orig as usize } else { 0 },
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
                ..RopeScaling::new("yarn", factor)
            });
        }
        _ => {}
    }
}

/// Whether some parameter of the family's graph reads config role `key` (as the role of the
/// `[[model.config]]` entry with that key).
pub(super) fn graph_reads(family: &ckb::ModelFamily, key: &str) -> bool {
    let Some(role) = family.config.iter().find(|f| f.key == key).map(|f| f.role.as_str()) else { return false };
    let Some(g) = &family.graph else { return false };
    g.prologue
        .iter()
        .chain(&g.layer)
        .chain(&g.epilogue)
        .flat_map(|n| n.params.values())
        .any(|e| ckb::expr::parse(e).is_ok_and(|x| ckb::expr::names(&x).iter().any(|n| n == role)))
}
