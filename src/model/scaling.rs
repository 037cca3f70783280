//! The parts of a resolved config beyond the flat `config[]` roles: the sliding attention window and
//! RoPE scaling (`rope_scaling` in config.json), each checked with field and reason.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Gap, ResolvedConfig, number};
use crate::ckb::Contract;

/// RoPE frequency scaling as config.json `rope_scaling` gives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RopeScaling {
    /// `linear` (positions divided by `factor`) or `llama3` (frequency-dependent, Llama 3.1).
    pub rope_type: String,
    /// Scaling factor (> 0).
    pub factor: f64,
    /// llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by factor.
    #[serde(default)]
    pub low_freq_factor: f64,
    /// llama3: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept.
    #[serde(default)]
    pub high_freq_factor: f64,
    /// llama3: context length the model was pretrained with.
    #[serde(default)]
    pub original_max_position_embeddings: usize,
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
    if family.unsupported_keys.iter().any(|k| k == "rope_scaling") {
        return;
    }
    let Some(rs) = config.get("rope_scaling").filter(|v| !v.is_null()) else { return };
    let gap = |reason: String| Gap { field: "rope_scaling".into(), reason };
    let Some(obj) = rs.as_object() else {
        gaps.push(gap(format!("must be an object with rope_type and factor, got {rs}")));
        return;
    };
    let rope_type = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("");
    let num = |k: &str| obj.get(k).and_then(number);
    let positive = |k: &str, gaps: &mut Vec<Gap>| -> f64 {
        match num(k) {
            Some(x) if x > 0.0 && x.is_finite() => x,
            Some(x) => {
                gaps.push(gap(format!("rope_scaling.{k} must be a positive number, got {x}")));
                f64::NAN
            }
            None => {
                gaps.push(gap(format!(
                    "rope_scaling.{k} is required for rope_type {rope_type:?} and missing from config.json"
                )));
                f64::NAN
            }
        }
    };
    match rope_type {
        "default" => {}
        "linear" => {
            let factor = positive("factor", gaps);
            cfg.rope_scaling = Some(RopeScaling {
                rope_type: "linear".into(),
                factor,
                low_freq_factor: 0.0,
                high_freq_factor: 0.0,
                original_max_position_embeddings: 0,
            });
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
                        "rope_scaling.high_freq_factor ({high}) must exceed low_freq_factor ({low}): the smoothing between them divides by their difference"
                    )));
                }
                if orig.fract() != 0.0 {
                    gaps.push(gap(format!("rope_scaling.original_max_position_embeddings must be an integer, got {orig}")));
                }
            }
            cfg.rope_scaling = Some(RopeScaling {
                rope_type: "llama3".into(),
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: if orig.is_finite() { orig as usize } else { 0 },
            });
        }
        other => gaps.push(gap(format!(
            "rope_type {other:?} is not covered by {}; covered: \"default\", \"linear\", \"llama3\" (dynamic, yarn, longrope and others change RoPE in ways the oracle does not implement)",
            contract.id
        ))),
    }
}
