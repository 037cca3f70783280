//! Preconditions a family's graph states about a checkpoint and config.json can contradict, checked
//! before anything runs (plan names them as gaps; the gates refuse): a reference that computed the
//! graph while the checkpoint says otherwise would fail a correct engine with no diagnosis.
//!
//! `layer_types` (transformers 5 writes one entry per layer, e.g. `sliding_attention` or
//! `full_attention`): where the family's graph gives attention a window by an expression of the
//! layer (Gemma 2: `sliding_window * (1 - layer % 2)`), each layer's window must agree with the list.

use ckb::ModelFamily;
use model::{Gap, ResolvedConfig};
use oracle::graph::config_role;

/// The attention kinds `layer_types` may name, and whether each has a window.
const LAYER_TYPES: [(&str, bool); 2] = [("full_attention", false), ("sliding_attention", true)];

/// Gaps where `config` (config.json) contradicts what `family`'s graph computes at `cfg`.
pub fn gaps(
    family_id: &str,
    family: &ModelFamily,
    cfg: &ResolvedConfig,
    config: &serde_json::Map<String, serde_json::Value>,
) -> Vec<Gap> {
    let mut out = Vec::new();
    let Some(list) = config.get("layer_types").filter(|v| !v.is_null()) else { return out };
    let gap = |reason: String| Gap { field: "layer_types".into(), reason };
    let Some(list) = list.as_array() else {
        out.push(gap(format!("must be a JSON list of strings, one per layer, got {list}")));
        return out;
    };
    if list.len() != cfg.n_layers {
        out.push(gap(format!(
            "has {} entries, but num_hidden_layers is {}: one entry per layer",
            list.len(),
            cfg.n_layers
        )));
        return out;
    }
    let Some(window) = family
        .graph
        .as_ref()
        .and_then(|g| g.layer.iter().find(|n| ckb::is_attention(&n.op)))
        .and_then(|n| n.params.get("window"))
    else {
        return out;
    };
    for (i, t) in list.iter().enumerate() {
        let Some(name) = t.as_str() else {
            out.push(gap(format!("entry {i} is {t}, not a layer type name")));
            continue;
        };
        let Some(&(_, windowed)) = LAYER_TYPES.iter().find(|(n, _)| *n == name) else {
            out.push(gap(format!(
                "entry {i} is {name:?}, a layer type {family_id}'s graph does not name (it knows {})",
                LAYER_TYPES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            )));
            continue;
        };
        let role = |r: &str| if r == "layer" { Some(ckb::graph::Val::Num(i as f64)) } else { config_role(cfg, r) };
        let Ok(w) = ckb::graph::eval_expr(window, &role) else { continue };
        if (w > 0.0) != windowed {
            out.push(gap(format!(
                "layer {i} is {name:?}, but {family_id}'s graph gives it {} (attention window `{window}` = {w} at layer {i}); the reference computes the graph, so a checkpoint whose layers differ from its family's rule is not covered: correct layer_types, or propose a family whose graph reads the list",
                if w > 0.0 { "a sliding window" } else { "full attention" }
            )));
        }
    }
    out
}

/// As [`gaps`] for a gate: Ok, or a usage error listing them.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] naming each contradiction.
pub fn check(
    ckb: &ckb::Ckb,
    dir: &std::path::Path,
    cfg: &ResolvedConfig,
    config: &serde_json::Map<String, serde_json::Value>,
) -> base::error::Result<()> {
    let Ok(contract) = ckb.get(&cfg.family) else { return Ok(()) };
    let Some(family) = contract.model.as_ref() else { return Ok(()) };
    let g = gaps(&contract.id, family, cfg, config);
    if g.is_empty() {
        return Ok(());
    }
    Err(base::error::Error::usage(format!(
        "{}/config.json contradicts {}'s graph:\n{}",
        dir.display(),
        contract.id,
        g.iter().map(|g| format!("  {}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n")
    )))
}
