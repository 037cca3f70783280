//! Building the graph reference: each block's nodes resolved against the config (inputs, parameters)
//! and bound to the checkpoint's tensors, each loaded once at the engine's weight dtype.

use std::collections::BTreeMap;

use crate::widen;
use base::error::{Error, Result};
use ckb::graph::{Val, eval_expr};
use ckb::{GraphNode, ModelFamily};
use model::ResolvedConfig;

use super::{Bound, Prepared, Src, TakeTensor, config_role};

/// Resolves a block's nodes against the config and loads their weights (each tensor once).
pub(super) struct Builder<'a> {
    pub(super) cfg: &'a ResolvedConfig,
    pub(super) family: &'a ModelFamily,
    pub(super) weight_dtype: &'a str,
    pub(super) take: &'a TakeTensor<'a>,
    pub(super) store: Vec<Vec<f64>>,
    /// (tensor name, one_plus_w) -> (store index, shape).
    pub(super) keys: BTreeMap<(String, bool), (usize, Vec<usize>)>,
    pub(super) caches: usize,
}

impl Builder<'_> {
    pub(super) fn block(&mut self, nodes: &[GraphNode], layer: Option<usize>) -> Result<Vec<Prepared>> {
        let mut out: Vec<Prepared> = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        for n in nodes {
            let trace = layer.map_or(n.name.clone(), |i| format!("layers.{i}.{}", n.name));
            let inputs = n
                .inputs
                .iter()
                .map(|i| match i.as_str() {
                    "token" => Src::Token,
                    "stream" => Src::Stream,
                    name => Src::Node(names.iter().position(|x| *x == name).expect("lint: defined before use")),
                })
                .collect();
            let mut params = BTreeMap::new();
            for (k, e) in &n.params {
                if k == "gain" {
                    continue;
                }
                let role = |r: &str| match (r, layer) {
                    ("layer", Some(i)) => Some(Val::Num(i as f64)),
                    _ => config_role(self.cfg, r),
                };
                let v =
                    eval_expr(e, &role).map_err(|m| Error::input(format!("node `{trace}`: parameter `{k}`: {m}")))?;
                params.insert(k.clone(), v);
            }
            let one_plus = n.params.get("gain").is_some_and(|g| g == "one_plus_w");
            let slot = if n.op == "embedding" {
                "table"
            } else if n.weights.contains_key("tied") && self.cfg.tied {
                "tied"
            } else {
                "weight"
            };
            let experts = if n.op == "moe_experts" {
                let count = params.get("experts").map_or(0, |e| *e as usize);
                let mut bind = |slot: &str| -> Result<Bound> {
                    let pattern = n
                        .weights
                        .get(slot)
                        .ok_or_else(|| Error::input(format!("node `{trace}`: no `{slot}` weight")))?;
                    self.bind_experts(&trace, pattern, layer, count)
                };
                Some([bind("gate")?, bind("up")?, bind("down")?])
            } else {
                None
            };
            // Ops whose weights are named slots of their own (attention sinks, fused experts).
            let mut slots = BTreeMap::new();
            if matches!(n.op.as_str(), "attention_sinks" | "moe_experts_clamped") {
                for (s, p) in &n.weights {
                    slots.insert(s.clone(), self.bind(&trace, p, layer, false, &BTreeMap::new())?);
                }
            }
            let weight = match n.weights.get(slot).filter(|_| experts.is_none() && slots.is_empty()) {
                Some(p) => Some(self.bind(&trace, p, layer, one_plus, &params)?),
                None => None,
            };
            let bias = match n.weights.get("bias").filter(|_| slots.is_empty()) {
                Some(p) => Some(self.bind(&trace, p, layer, false, &params)?),
                None => None,
            };
            let cache = if ckb::is_attention(&n.op) {
                self.caches += 1;
                self.caches - 1
            } else {
                0
            };
            let base = params.clone();
            let tied = n.weights.get("tied").map(|p| layer.map_or(p.clone(), |i| p.replace("{i}", &i.to_string())));
            out.push(Prepared {
                trace,
                op: n.op.clone(),
                inputs,
                weight,
                bias,
                params,
                cache,
                name: n.name.clone(),
                layer,
                base,
                skip: false,
                swap: None,
                base_weight: weight,
                base_bias: bias,
                one_plus,
                tied,
                experts,
                slots,
            });
            names.push(&n.name);
        }
        Ok(out)
    }

    /// The shape `[[model.weights]]` declares for the tensor `pattern` names, at this config; None
    /// when the family does not declare it or a dimension does not evaluate.
    fn declared_shape(&self, pattern: &str) -> Option<Vec<usize>> {
        let spec = self.family.weights.iter().find(|w| w.name == pattern)?;
        spec.shape.iter().map(|d| eval_expr(d, &|r| config_role(self.cfg, r)).ok().map(|v| v as usize)).collect()
    }

    /// Load every expert's tensor of `pattern` (`{e}` = 0..count) at `layer`, each of the family's
    /// shape, and bind them stacked by expert as one tensor [count * rows, cols].
    fn bind_experts(&mut self, node: &str, pattern: &str, layer: Option<usize>, count: usize) -> Result<Bound> {
        let name = layer.map_or(pattern.to_string(), |i| pattern.replace("{i}", &i.to_string()));
        let key = (name.clone(), false);
        if count == 0 {
            return Err(Error::input(format!("node `{node}`: `experts` is 0; the family needs at least one expert")));
        }
        if !self.keys.contains_key(&key) {
            let want = self.declared_shape(pattern);
            let mut stacked = Vec::new();
            let mut shape = Vec::new();
            for e in 0..count {
                let one = name.replace("{e}", &e.to_string());
                let (s, v) = (self.take)(&one).ok_or_else(|| {
                    Error::input(format!(
                        "the checkpoint has no tensor `{one}` (expert {e} of {count}, required by {}, node `{node}`)",
                        self.cfg.family
                    ))
                })?;
                if s.len() != 2 || want.as_ref().is_some_and(|w| w != &s) {
                    return Err(Error::input(format!("tensor `{one}` has shape {s:?}, config.json implies {want:?}")));
                }
                stacked.extend(crate::dtypes::as_stored(&v, s[1], self.weight_dtype));
                shape = s;
            }
            self.store.push(stacked);
            self.keys.insert(key.clone(), (self.store.len() - 1, vec![count * shape[0], shape[1]]));
        }
        let (at, shape) = &self.keys[&key];
        Ok(Bound { at: *at, cols: shape[1], offset: 0, rows: shape[0] })
    }

    /// Load (once) the tensor of `pattern` at `layer` and bind the node's row block of it.
    fn bind(
        &mut self,
        node: &str,
        pattern: &str,
        layer: Option<usize>,
        one_plus: bool,
        params: &BTreeMap<String, f64>,
    ) -> Result<Bound> {
        let name = layer.map_or(pattern.to_string(), |i| pattern.replace("{i}", &i.to_string()));
        let key = (name.clone(), one_plus);
        if !self.keys.contains_key(&key) {
            let want = self.declared_shape(pattern);
            let (s, v) = (self.take)(&name).ok_or_else(|| {
                let hint = if name == "lm_head.weight" {
                    " and config.json does not set tie_word_embeddings".to_string()
                } else {
                    format!(" (required by {}, node `{node}`)", self.cfg.family)
                };
                Error::input(format!("the checkpoint has no tensor `{name}`{hint}"))
            })?;
            if let Some(want) = &want
                && &s != want
            {
                return Err(Error::input(format!("tensor `{name}` has shape {s:?}, config.json implies {want:?}")));
            }
            // Matrices (2-D, and the fused 3-D expert tensors, row by row of their last axis) at
            // the weight dtype, unless the dtype policy keeps their role in f32 (gpt-oss's 2-D
            // expert biases); vectors as stored.
            let keep = self.family.keeps_f32(pattern);
            let mut w = if s.len() >= 2 && !keep {
                crate::dtypes::as_stored(&v, s[s.len() - 1], self.weight_dtype)
            } else {
                widen(&v)
            };
            if one_plus {
                w.iter_mut().for_each(|x| *x += 1.0);
            }
            self.store.push(w);
            self.keys.insert(key.clone(), (self.store.len() - 1, s));
        }
        let (at, shape) = &self.keys[&key];
        let cols = shape.get(1).copied().unwrap_or(1);
        let offset = params.get("row_offset").map_or(0, |v| *v as usize);
        let rows = params.get("rows").map_or(shape[0].saturating_sub(offset), |v| *v as usize);
        if offset + rows > shape[0] {
            return Err(Error::input(format!(
                "node `{node}`: rows {offset}..{} outside tensor `{name}` of {} rows",
                offset + rows,
                shape[0]
            )));
        }
        Ok(Bound { at: *at, cols, offset, rows })
    }
}
