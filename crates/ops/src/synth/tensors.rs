//! The tensors of a synthetic checkpoint: the plan of names, shapes and draws, from a built-in
//! family's features or a contract's graph, and the parameters a family's graph binds.

use rand::{Rng, SeedableRng};

use super::builtin_features;
use base::error::{Error, Result};

/// Standard normal draws (Box-Muller) scaled by `std`, around `mean`.
fn normal(rng: &mut rand_chacha::ChaCha8Rng, n: usize, mean: f32, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            let u2: f64 = rng.random::<f64>();
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            mean + std * z as f32
        })
        .collect()
}

/// The tensors of a synthetic checkpoint for `config` (as [`synth_config`] writes it) of a built-in
/// family: [`synth_tensors_with`] with the features of its model_type ([`builtin_features`]).
///
/// # Panics
/// When `config` lacks a size key (it comes from [`synth_config`]).
pub fn synth_tensors(config: &serde_json::Value, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let features = builtin_features(config["model_type"].as_str().unwrap_or("llama"));
    synth_tensors_with(config, &features, seed)
}

/// The tensors of a synthetic checkpoint for `config` and the family's `features`: name, shape, values.
/// Projections are N(0, 1/fan_in) so activations keep their scale through the layers; the embedding is
/// N(0, 0.2^2), so that logits spread over a few units; norm weights are near one (near zero with
/// `rmsnorm_one_plus_w`, Gemma's `1 + w`); biases (`qkv_bias`) are N(0, 0.25); `qk_norm` adds the
/// per-head norm weights. `fused_qkv` writes q, k and v (drawn as without it) as the row blocks of one
/// `self_attn.qkv_proj.weight` [(n_heads + 2 n_kv_heads) head_dim, hidden] (and biases as one
/// `qkv_proj.bias`); `fused_gate_up` writes gate and up as one `mlp.gate_up_proj.weight`
/// [2 intermediate, hidden]. So a fused checkpoint holds the same numbers as the unfused one of the
/// same seed. Holds every value at once: for large checkpoints [`write_checkpoint_opts`] streams the
/// same values tensor by tensor.
///
/// # Panics
/// When `config` lacks a size key (it comes from [`synth_config`] or [`synth_config_for`]).
pub fn synth_tensors_with(
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let plan = tensor_plan(config, features);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    plan.into_iter()
        .map(|t| {
            let values = t.draw(&mut rng);
            (t.name, t.shape, values)
        })
        .collect()
}

/// One tensor of a synthetic checkpoint: its name and shape, and the normal draws (count, mean, std)
/// whose values it holds, in order (a fused tensor holds several).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PlannedTensor {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) draws: Vec<(usize, f32, f32)>,
}

impl PlannedTensor {
    pub(super) fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// The values, drawn from `rng` in plan order (so a streamed checkpoint equals the in-memory one).
    pub(super) fn draw(&self, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.len());
        for &(n, mean, std) in &self.draws {
            v.extend(normal(rng, n, mean, std));
        }
        v
    }
}

/// The tensors of a checkpoint in draw order, without their values (see [`synth_tensors_with`]).
pub(super) fn tensor_plan(config: &serde_json::Value, features: &[String]) -> Vec<PlannedTensor> {
    let has = |f: &str| features.iter().any(|x| x == f);
    let u = |k: &str| config[k].as_u64().unwrap_or_else(|| panic!("config has {k}")) as usize;
    let (h, ff, nl, nh, nkv, hd, vocab) = (
        u("hidden_size"),
        u("intermediate_size"),
        u("num_hidden_layers"),
        u("num_attention_heads"),
        config["num_key_value_heads"].as_u64().map_or(u("num_attention_heads"), |v| v as usize),
        config["head_dim"].as_u64().map_or(u("hidden_size") / u("num_attention_heads"), |v| v as usize),
        u("vocab_size"),
    );
    let tied = config["tie_word_embeddings"].as_bool().unwrap_or(false);
    let norm_mean = if has("rmsnorm_one_plus_w") { 0.0 } else { 1.0 };
    let mut out: Vec<PlannedTensor> = Vec::new();
    let push = |out: &mut Vec<PlannedTensor>, name: String, shape: Vec<usize>, mean: f32, std: f32| {
        let n = shape.iter().product();
        out.push(PlannedTensor { name, shape, draws: vec![(n, mean, std)] });
    };
    // Replace the last `n` tensors by one with their rows stacked in order.
    let fuse = |out: &mut Vec<PlannedTensor>, n: usize, name: String| {
        let parts = out.split_off(out.len() - n);
        let cols: usize = parts[0].shape[1..].iter().product();
        let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
        let shape = if parts[0].shape.len() == 1 { vec![rows] } else { vec![rows, cols] };
        out.push(PlannedTensor { name, shape, draws: parts.into_iter().flat_map(|p| p.draws).collect() });
    };
    let proj = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    push(&mut out, "model.embed_tokens.weight".into(), vec![vocab, h], 0.0, 0.2);
    for i in 0..nl {
        let p = format!("model.layers.{i}.");
        push(&mut out, format!("{p}input_layernorm.weight"), vec![h], norm_mean, 0.1);
        push(&mut out, format!("{p}self_attn.q_proj.weight"), vec![nh * hd, h], 0.0, proj(h));
        push(&mut out, format!("{p}self_attn.k_proj.weight"), vec![nkv * hd, h], 0.0, proj(h));
        push(&mut out, format!("{p}self_attn.v_proj.weight"), vec![nkv * hd, h], 0.0, proj(h));
        if has("fused_qkv") {
            fuse(&mut out, 3, format!("{p}self_attn.qkv_proj.weight"));
        }
        if has("qkv_bias") {
            push(&mut out, format!("{p}self_attn.q_proj.bias"), vec![nh * hd], 0.0, 0.5);
            push(&mut out, format!("{p}self_attn.k_proj.bias"), vec![nkv * hd], 0.0, 0.5);
            push(&mut out, format!("{p}self_attn.v_proj.bias"), vec![nkv * hd], 0.0, 0.5);
            if has("fused_qkv") {
                fuse(&mut out, 3, format!("{p}self_attn.qkv_proj.bias"));
            }
        }
        if has("qk_norm") {
            push(&mut out, format!("{p}self_attn.q_norm.weight"), vec![hd], 1.0, 0.3);
            push(&mut out, format!("{p}self_attn.k_norm.weight"), vec![hd], 1.0, 0.3);
        }
        push(&mut out, format!("{p}self_attn.o_proj.weight"), vec![h, nh * hd], 0.0, proj(nh * hd));
        push(&mut out, format!("{p}post_attention_layernorm.weight"), vec![h], norm_mean, 0.1);
        push(&mut out, format!("{p}mlp.gate_proj.weight"), vec![ff, h], 0.0, proj(h));
        push(&mut out, format!("{p}mlp.up_proj.weight"), vec![ff, h], 0.0, proj(h));
        if has("fused_gate_up") {
            fuse(&mut out, 2, format!("{p}mlp.gate_up_proj.weight"));
        }
        push(&mut out, format!("{p}mlp.down_proj.weight"), vec![h, ff], 0.0, proj(ff));
    }
    push(&mut out, "model.norm.weight".into(), vec![h], norm_mean, 0.1);
    if !tied {
        push(&mut out, "lm_head.weight".into(), vec![vocab, h], 0.0, 0.2);
    }
    out
}

/// The tensors of a checkpoint of `contract`'s family for `config`, from its graph's weight
/// bindings (`[model.graph]`), in draw order, without their values: every `[[model.weights]]`
/// tensor a node reads (the `tied` alternative's own tensor only when config.json does not tie),
/// non-layer tensors declared before the first `{i}` one, then each layer's in declaration order,
/// then the rest; shapes from the declared shapes at the resolved config. Draws follow what each
/// tensor is to its node, with the figures of [`synth_tensors_with`]: an embedding table or the
/// logits' projection N(0, 0.2^2); a linear weight N(0, 1/columns), a row block of a fused tensor
/// drawn as its own tensor; a bias N(0, 0.25); an RMSNorm gain near one (std 0.1 over hidden, 0.3
/// over a head or projection), near zero with `gain = one_plus_w`. For the built-in families this
/// is the plan [`synth_tensors_with`] writes from their features (unit test).
///
/// # Errors
/// Usage when the contract is not a model family with a graph, or `config` does not resolve.
pub(super) fn graph_plan(contract: &ckb::Contract, config: &serde_json::Value) -> Result<Vec<PlannedTensor>> {
    let family =
        contract.model.as_ref().ok_or_else(|| Error::usage(format!("{} is not a model family", contract.id)))?;
    let graph = family
        .graph
        .as_ref()
        .ok_or_else(|| Error::usage(format!("{} has no [model.graph] to write a checkpoint from", contract.id)))?;
    let map = config.as_object().ok_or_else(|| Error::usage("config.json is not an object"))?;
    let cfg = model::resolve(contract, map).map_err(|gaps| {
        Error::usage(format!(
            "the config does not resolve against {}: {}",
            contract.id,
            gaps.iter().map(|g| format!("{}: {}", g.field, g.reason)).collect::<Vec<_>>().join("; ")
        ))
    })?;
    let role = |r: &str| oracle::graph::config_role(&cfg, r);
    // tensor pattern -> the draws of its row blocks, in node order (row offset, rows or all, mean, std).
    type RowBlocks = Vec<(usize, Option<usize>, f32, f32)>;
    let mut uses: std::collections::BTreeMap<&str, RowBlocks> = Default::default();
    // Expert weight pattern (`{e}`) -> the expert count of the moe_experts node binding it.
    let mut experts: std::collections::BTreeMap<&str, usize> = Default::default();
    let last = graph.epilogue.last().map(|n| n.name.as_str());
    for (block, nodes) in [("prologue", &graph.prologue), ("layer", &graph.layer), ("epilogue", &graph.epilogue)] {
        for n in nodes.iter() {
            let param = |k: &str| -> Result<Option<usize>> {
                n.params
                    .get(k)
                    .map(|e| ckb::graph::eval_expr(e, &role).map(|v| v as usize))
                    .transpose()
                    .map_err(|m| Error::usage(format!("node `{}`: parameter `{k}`: {m}", n.name)))
            };
            for (slot, pattern) in &n.weights {
                if slot == "weight" && n.weights.contains_key("tied") && cfg.tied {
                    continue;
                }
                let shape = family.weights.iter().find(|w| &w.name == pattern).map(|w| w.shape.as_slice());
                let cols = shape.and_then(|s| s.get(1)).and_then(|d| ckb::graph::eval_expr(d, &role).ok());
                let (mean, std) = match (n.op.as_str(), slot.as_str()) {
                    ("embedding", _) => (0.0, 0.2),
                    (_, "tied") => continue,
                    (_, "bias") => (0.0, 0.5),
                    ("rms_norm", _) => {
                        let mean = if n.params.get("gain").is_some_and(|g| g == "one_plus_w") { 0.0 } else { 1.0 };
                        let over_hidden = shape.is_some_and(|s| s.len() == 1 && s[0].trim() == "hidden");
                        (mean, if over_hidden { 0.1 } else { 0.3 })
                    }
                    _ if block == "epilogue" && Some(n.name.as_str()) == last => (0.0, 0.2),
                    _ => (0.0, 1.0 / (cols.unwrap_or(1.0) as f32).sqrt()),
                };
                if n.op == "moe_experts" {
                    experts.insert(pattern.as_str(), param("experts")?.unwrap_or(0));
                }
                let rows = param("rows")?;
                let offset = param("row_offset")?.unwrap_or(0);
                let entry = uses.entry(pattern.as_str()).or_default();
                if !entry.iter().any(|u| u.0 == offset) {
                    entry.push((offset, rows, mean, std));
                }
            }
        }
    }
    let first_layer = family.weights.iter().position(|w| w.name.contains("{i}")).unwrap_or(family.weights.len());
    let order: Vec<(&ckb::WeightSpec, Option<usize>)> = family.weights[..first_layer]
        .iter()
        .filter(|w| !w.name.contains("{i}"))
        .map(|w| (w, None))
        .chain(
            (0..cfg.n_layers)
                .flat_map(|i| family.weights.iter().filter(|w| w.name.contains("{i}")).map(move |w| (w, Some(i)))),
        )
        .chain(family.weights[first_layer..].iter().filter(|w| !w.name.contains("{i}")).map(|w| (w, None)))
        .collect();
    let mut out = Vec::new();
    for (w, layer) in order {
        let Some(blocks) = uses.get(w.name.as_str()) else { continue };
        let shape: Vec<usize> = w
            .shape
            .iter()
            .map(|d| ckb::graph::eval_expr(d, &role).map(|v| v as usize))
            .collect::<std::result::Result<_, _>>()
            .map_err(|m| Error::usage(format!("{}: shape of `{}`: {m}", contract.id, w.name)))?;
        let total = shape.first().copied().unwrap_or(1);
        let per_row: usize = shape[1..].iter().product();
        let mut blocks = blocks.clone();
        blocks.sort_by_key(|b| b.0);
        let draws_of = |blocks: &[(usize, Option<usize>, f32, f32)]| -> Vec<(usize, f32, f32)> {
            blocks
                .iter()
                .map(|&(offset, rows, mean, std)| (rows.unwrap_or(total - offset.min(total)) * per_row, mean, std))
                .collect()
        };
        let name = layer.map_or(w.name.clone(), |i| w.name.replace("{i}", &i.to_string()));
        match experts.get(w.name.as_str()) {
            // One tensor per expert, in expert order.
            Some(&count) => out.extend((0..count).map(|e| PlannedTensor {
                name: name.replace("{e}", &e.to_string()),
                shape: shape.clone(),
                draws: draws_of(&blocks),
            })),
            None => out.push(PlannedTensor { name, shape, draws: draws_of(&blocks) }),
        }
    }
    Ok(out)
}

/// The parameters a family's graph binds on a config, counted in elements, from the same plan synth
/// writes checkpoints by (each weight's declared shape evaluated on the config; a tied head is the
/// table itself, counted once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraphParameters {
    /// Every bound tensor's elements (transformers' `num_parameters`).
    pub total: usize,
    /// The embedding table the prologue's `embedding` node reads.
    pub table: usize,
    /// Expert weights a decoded token does not read: per `moe_experts` node and layer, the
    /// (experts - top_k) experts its router (`moe_route`, `top_k`) leaves out. 0 for a dense family.
    pub idle_experts: usize,
    /// The share of the expert weights one token reads (top_k / experts; Qwen3-30B-A3B: 8 / 128);
    /// None for a dense family.
    pub expert_fraction: Option<f64>,
}

impl GraphParameters {
    /// The weights one decoded token reads: the total less the idle experts, less the table when
    /// the head is untied (one embedding row is read; tied, the table is the head).
    pub fn streamed(&self, tied: bool) -> usize {
        self.total - self.idle_experts - if tied { 0 } else { self.table }
    }
}

/// The parameters a family's graph binds on `config` ([`GraphParameters`]).
///
/// # Errors
/// As [`synth_config_for`]'s resolution: not a model family with a graph, or a config that does not
/// resolve against it.
pub fn graph_parameters(contract: &ckb::Contract, config: &serde_json::Value) -> Result<GraphParameters> {
    let plan = graph_plan(contract, config)?;
    let family = contract.model.as_ref();
    let graph = family.and_then(|m| m.graph.as_ref());
    let tables: Vec<&String> = graph
        .into_iter()
        .flat_map(|g| g.prologue.iter())
        .filter(|n| n.op == "embedding")
        .flat_map(|n| n.weights.values())
        .collect();
    let total = plan.iter().map(PlannedTensor::len).sum();
    let table = plan.iter().filter(|t| tables.contains(&&t.name)).map(PlannedTensor::len).sum();
    let (mut idle_experts, mut expert_fraction) = (0, None);
    if let (Some(family), Some(graph)) = (family, graph) {
        let map = config.as_object().ok_or_else(|| Error::usage("config.json is not an object"))?;
        let cfg = model::resolve(contract, map)
            .map_err(|_| Error::usage(format!("the config does not resolve against {}", contract.id)))?;
        let role = |r: &str| oracle::graph::config_role(&cfg, r);
        let eval = |n: &ckb::GraphNode, k: &str| {
            n.params.get(k).and_then(|e| ckb::graph::eval_expr(e, &role).ok()).map(|v| v as usize)
        };
        for n in graph.layer.iter().filter(|n| ckb::is_moe_experts(&n.op)) {
            let router = n.inputs.get(1).and_then(|r| graph.layer.iter().find(|x| &x.name == r));
            let (Some(count), Some(k)) = (eval(n, "experts"), router.and_then(|r| eval(r, "top_k"))) else {
                continue;
            };
            let per_expert: usize = n
                .weights
                .values()
                .filter_map(|p| family.weights.iter().find(|w| &w.name == p))
                .map(|w| -> usize {
                    w.shape.iter().map(|d| ckb::graph::eval_expr(d, &role).unwrap_or(0.0) as usize).product()
                })
                .sum();
            // `moe_experts` binds one expert's tensors (`{e}`), `moe_experts_clamped` every
            // expert's, fused along their first axis.
            let per_expert = if n.op == "moe_experts" { per_expert } else { per_expert / count.max(1) };
            idle_experts += count.saturating_sub(k) * per_expert * cfg.n_layers;
            expert_fraction = Some(k.min(count) as f64 / count.max(1) as f64);
        }
    }
    Ok(GraphParameters { total, table, idle_experts, expert_fraction })
}
