//! The reference forward pass as an interpreter of a model family's graph (`[model.graph]`, see
//! [`crate::ckb::Graph`]) in f64, one token a step, with a KV cache per attention node and layer.
//! Every op runs the registry's kernel (`oracle::kernels`) or an elementwise primitive; node names
//! are the trace points ([`GraphReference::step_traced`]). Model-level mutations
//! ([`super::mutants::Mutation`]) apply the kernel fault at every node of that op (and the KV-row
//! fault at every attention node), as the hand-written reference (`oracle::llama`) does.

use std::collections::BTreeMap;

use super::families::{rope_inv_freq, rope_pairs_with_freqs};
use super::kernels::{
    attention, embedding, gelu_tanh, gelu_tanh_and_mul, layer_norm, linear, moe_experts, moe_route, rms_norm, rope,
    rotary, silu_and_mul,
};
use super::mutants::{Mutation, Mutations};
use super::{AttnShape, widen};
use crate::ckb::graph::{Val, eval_expr};
use crate::ckb::{GraphNode, GraphRewrite, ModelFamily};
use crate::error::{Error, Result};
use crate::model::{ResolvedConfig, Tensors};

/// The value of a config role for parameter expressions (`hidden`, `n_heads`, `head_dim`,
/// `sliding_window`, `rms_norm_eps`, ..., then the family's other roles, numeric and typed), as
/// the resolved config holds it: [`ResolvedConfig::role`].
pub fn config_role(cfg: &ResolvedConfig, name: &str) -> Option<Val> {
    cfg.role(name)
}

/// Where a node input comes from.
#[derive(Clone, Copy)]
enum Src {
    Token,
    Stream,
    Node(usize),
}

/// A weight bound to a node: index into the store, its column count, and the row block used.
#[derive(Clone, Copy)]
struct Bound {
    at: usize,
    cols: usize,
    offset: usize,
    rows: usize,
}

/// A node with names resolved: inputs, weights and parameters evaluated for this config.
struct Prepared {
    /// Trace name: `name` or `layers.<i>.name`.
    trace: String,
    op: String,
    inputs: Vec<Src>,
    weight: Option<Bound>,
    bias: Option<Bound>,
    params: BTreeMap<String, f64>,
    /// Index of this node's KV cache (attention only).
    cache: usize,
    /// Node name in its block, and its layer (None in prologue and epilogue).
    name: String,
    layer: Option<usize>,
    /// The parameters as the graph gives them, kept while a rewrite replaces some.
    base: BTreeMap<String, f64>,
    /// Skipped by a rewrite: the output is the first input.
    skip: bool,
    /// Swapped by a rewrite with the node at this index of the block: this node runs that node's op.
    swap: Option<usize>,
    /// The weight bindings as the graph gives them, kept while a rewrite replaces them.
    base_weight: Option<Bound>,
    base_bias: Option<Bound>,
    /// Whether `weight` holds 1 + w (`gain = "one_plus_w"`).
    one_plus: bool,
    /// The tensor of the node's `tied` slot at this layer, if it has one.
    tied: Option<String>,
    /// A `moe_experts` node's gate, up and down weights, each every expert's tensor stacked.
    experts: Option<[Bound; 3]>,
}

/// Each node's output for one step, in order, by trace name (`embed`, `layers.<i>.<name>`, ..., `logits`).
pub type Trace = Vec<(String, Vec<f64>)>;

/// Hands out a checkpoint tensor (shape, values) by name.
type TakeTensor<'a> = dyn Fn(&str) -> Option<(Vec<usize>, Vec<f32>)> + 'a;

/// The reference model of a family's graph, with its f64 KV caches.
pub struct GraphReference {
    cfg: ResolvedConfig,
    prologue: Vec<Prepared>,
    layers: Vec<Vec<Prepared>>,
    epilogue: Vec<Prepared>,
    store: Vec<Vec<f64>>,
    k_cache: Vec<Vec<f64>>,
    v_cache: Vec<Vec<f64>>,
    len: usize,
    inv_freq: Option<Vec<f64>>,
    mutations: Mutations,
    /// (tensor name, one_plus_w) -> (store index, shape) of every bound tensor.
    keys: BTreeMap<(String, bool), (usize, Vec<usize>)>,
    /// Store entries of the graph's own bindings; a rewrite's derived tensors follow them.
    base_store: usize,
    /// Round every node's output to f32 (as an engine computing in f32 holds its activations):
    /// the scale of the rounding error this checkpoint's activations cause (see
    /// `oracle::llama::Reference::set_f32_activations`).
    f32_activations: bool,
}

impl GraphReference {
    /// Build from the family's graph and weights, a resolved config and the checkpoint's tensors,
    /// with 2-D weights as an engine storing them in `weight_dtype` holds them (see
    /// `oracle::llama::Reference::with_weight_dtype`).
    ///
    /// # Errors
    /// Input naming the node and tensor when a tensor is missing or its shape disagrees with the
    /// family's `[[model.weights]]` shape at this config, or when the family has no graph or the
    /// graph does not lint; Usage for an unknown weight dtype.
    pub fn new(family: &ModelFamily, cfg: &ResolvedConfig, tensors: &Tensors, weight_dtype: &str) -> Result<Self> {
        Self::build(family, cfg, weight_dtype, &|name| tensors.get(name).cloned())
    }

    /// As [`GraphReference::new`], consuming the tensors (each freed once widened).
    ///
    /// # Errors
    /// As [`GraphReference::new`].
    pub fn from_tensors(
        family: &ModelFamily,
        cfg: &ResolvedConfig,
        tensors: Tensors,
        weight_dtype: &str,
    ) -> Result<Self> {
        let cell = std::cell::RefCell::new(tensors);
        Self::build(family, cfg, weight_dtype, &|name| cell.borrow_mut().remove(name))
    }

    fn build(family: &ModelFamily, cfg: &ResolvedConfig, weight_dtype: &str, take: &TakeTensor<'_>) -> Result<Self> {
        if !crate::ckb::WEIGHT_DTYPES.contains(&weight_dtype) {
            return Err(Error::usage(format!(
                "weight dtype `{weight_dtype}` unknown; use one of {}",
                crate::ckb::WEIGHT_DTYPES.join(", ")
            )));
        }
        let graph = family
            .graph
            .as_ref()
            .ok_or_else(|| Error::input(format!("{} has no [model.graph]: the reference cannot run it", cfg.family)))?;
        let findings = crate::ckb::graph::lint_graph(graph, family);
        if let Some((field, m)) = findings.first() {
            return Err(Error::input(format!("{} graph refused at {field}: {m}", cfg.family)));
        }
        let mut b = Builder { cfg, family, weight_dtype, take, store: Vec::new(), keys: BTreeMap::new(), caches: 0 };
        let prologue = b.block(&graph.prologue, None)?;
        let mut layers = Vec::new();
        for i in 0..cfg.n_layers {
            layers.push(b.block(&graph.layer, Some(i))?);
        }
        let epilogue = b.block(&graph.epilogue, None)?;
        let caches = b.caches;
        Ok(GraphReference {
            inv_freq: cfg.rope_scaling.as_ref().map(|s| rope_inv_freq(cfg.head_dim, cfg.rope_theta, Some(s))),
            base_store: b.store.len(),
            keys: b.keys,
            store: b.store,
            prologue,
            layers,
            epilogue,
            k_cache: vec![Vec::new(); caches],
            v_cache: vec![Vec::new(); caches],
            len: 0,
            mutations: Mutations::NONE,
            cfg: cfg.clone(),
            f32_activations: false,
        })
    }

    /// Round every node's output to the nearest f32 (true) or keep f64 (false, the reference);
    /// forget the cache.
    pub fn set_f32_activations(&mut self, on: bool) {
        self.f32_activations = on;
        self.reset();
    }

    /// Turn this reference into a mutant (or back with [`Mutations::NONE`]) and forget the cache.
    pub fn set_mutations(&mut self, mutations: Mutations) {
        self.mutations = mutations;
        self.reset();
    }

    /// Apply a graph rewrite (a model-level mutant, [`GraphRewrite`]) or, with None, restore the
    /// graph as the contract gives it; forgets the cache either way. Returns whether the rewrite
    /// applies: every node it names is in this graph, some node has each op of its `op_weights`,
    /// and, when it rewrites only weights, some weight changes (otherwise nothing changes).
    ///
    /// # Errors
    /// Input when a replaced parameter's expression does not evaluate at this config, a skipped
    /// node's output width differs from its first input's (it cannot be bypassed), a swapped pair
    /// is not two one-input nodes of a block where only the second reads the first, or a weight
    /// rewrite is unknown, drops a required slot, or ties a node to a tensor of another shape.
    pub fn set_rewrite(&mut self, rewrite: Option<&GraphRewrite>) -> Result<bool> {
        self.reset();
        self.restore();
        let Some(r) = rewrite else { return Ok(true) };
        let cfg = self.cfg.clone();
        let nodes = || self.prologue.iter().chain(self.layers.iter().flatten()).chain(&self.epilogue);
        let has_op = |op: &str| nodes().any(|n| n.op == op);
        if !r.nodes().iter().all(|name| nodes().any(|n| n.name == *name))
            || !r.op_weights.keys().all(|k| has_op(k.split_once('.').map_or(k.as_str(), |(op, _)| op)))
        {
            return Ok(false);
        }
        let outcome = self.apply(r, &cfg);
        if !matches!(outcome, Ok(true)) {
            self.restore();
        }
        outcome
    }

    /// The graph's own parameters, bindings and order again, and no derived tensors.
    fn restore(&mut self) {
        self.store.truncate(self.base_store);
        for n in self.prologue.iter_mut().chain(self.layers.iter_mut().flatten()).chain(self.epilogue.iter_mut()) {
            n.params = n.base.clone();
            n.skip = false;
            n.swap = None;
            n.weight = n.base_weight;
            n.bias = n.base_bias;
        }
    }

    /// [`GraphReference::set_rewrite`] on the restored graph: Ok(false) when only weights are
    /// rewritten and none changes.
    fn apply(&mut self, r: &GraphRewrite, cfg: &ResolvedConfig) -> Result<bool> {
        let GraphReference { prologue, layers, epilogue, store, keys, base_store, .. } = self;
        let mut weights_changed = false;
        let mut derived = Derived::new();
        for block in std::iter::once(prologue).chain(layers.iter_mut()).chain(std::iter::once(epilogue)) {
            for [a, b] in &r.swap {
                let (Some(i), Some(j)) =
                    (block.iter().position(|n| n.name == *a), block.iter().position(|n| n.name == *b))
                else {
                    continue;
                };
                let only_b_reads_a = block
                    .iter()
                    .enumerate()
                    .all(|(k, n)| k == j || !n.inputs.iter().any(|s| matches!(s, Src::Node(x) if *x == i)));
                if !(block[i].inputs.len() == 1
                    && matches!(block[j].inputs[..], [Src::Node(x)] if x == i)
                    && only_b_reads_a
                    && block[i].op != "attention")
                {
                    return Err(Error::input(format!(
                        "rewrite swaps `{a}` and `{b}` at `{}`: only two one-input nodes of a block, the second reading the first and nothing else reading it, can be swapped",
                        block[i].trace
                    )));
                }
                block[i].swap = Some(j);
                block[j].swap = Some(i);
            }
            for n in block.iter_mut() {
                n.skip = r.skip.contains(&n.name);
                if n.skip && (n.inputs.is_empty() || matches!(n.op.as_str(), "linear" | "embedding" | "attention")) {
                    return Err(Error::input(format!(
                        "rewrite skips node `{}` ({}): only a node whose output has its first input's width can be skipped",
                        n.trace, n.op
                    )));
                }
                for (key, expr) in &r.set {
                    let Some((node, param)) = key.split_once('.') else {
                        return Err(Error::input(format!("rewrite sets `{key}`: write node.param")));
                    };
                    if node != n.name {
                        continue;
                    }
                    let layer = n.layer;
                    let role = |x: &str| match (x, layer) {
                        ("layer", Some(i)) => Some(Val::Num(i as f64)),
                        _ => config_role(cfg, x),
                    };
                    let v = eval_expr(expr, &role)
                        .map_err(|m| Error::input(format!("rewrite sets `{key}` = `{expr}` at `{}`: {m}", n.trace)))?;
                    n.params.insert(param.to_string(), v);
                    // A row block set anew binds the weight's other rows (a fused tensor split
                    // wrong).
                    if matches!(param, "row_offset" | "rows")
                        && let Some(w) = n.weight.as_mut()
                    {
                        let total = store[w.at].len() / w.cols.max(1);
                        let off = n.params.get("row_offset").map_or(0, |v| *v as usize);
                        let rows = n.params.get("rows").map_or(total.saturating_sub(off), |v| *v as usize);
                        if off + rows > total {
                            return Err(Error::input(format!(
                                "rewrite sets `{key}` at `{}`: rows {off}..{} outside the tensor's {total} rows",
                                n.trace,
                                off + rows
                            )));
                        }
                        w.offset = off;
                        w.rows = rows;
                    }
                }
                let of_node = r.weights.iter().filter_map(|(k, how)| {
                    let (node, slot) = k.split_once('.')?;
                    (node == n.name).then_some((slot, how.as_str()))
                });
                let of_op = r.op_weights.iter().filter_map(|(k, how)| {
                    let (op, slot) = k.split_once('.')?;
                    (op == n.op).then_some((slot, how.as_str()))
                });
                for (slot, how) in of_node.chain(of_op).collect::<Vec<_>>() {
                    weights_changed |= rebind(n, slot, how, store, *base_store, keys, &mut derived)?;
                }
            }
        }
        let structural = !(r.skip.is_empty() && r.set.is_empty() && r.swap.is_empty());
        Ok(structural || weights_changed)
    }
    /// Whether some rotary node rotates fewer entries than the head has (partial rotary).
    pub fn has_partial_rotary(&self) -> bool {
        let hd = self.cfg.head_dim as f64;
        self.prologue
            .iter()
            .chain(self.layers.iter().flatten())
            .chain(&self.epilogue)
            .any(|n| n.op == "rotary" && n.params.get("rotary_dim").is_some_and(|r| *r < hd))
    }

    /// Whether some `moe_route` node renormalises its kept weights (`renormalize` true) or keeps
    /// them as the softmax gives them (false).
    pub fn has_router(&self, renormalize: bool) -> bool {
        self.prologue
            .iter()
            .chain(self.layers.iter().flatten())
            .chain(&self.epilogue)
            .any(|n| n.op == "moe_route" && (n.params.get("renormalize").is_some_and(|v| *v != 0.0) == renormalize))
    }

    /// Whether some node of the graph runs `op` (a [`crate::ckb::GRAPH_OPS`] name).
    pub fn has_op(&self, op: &str) -> bool {
        self.prologue.iter().chain(self.layers.iter().flatten()).chain(&self.epilogue).any(|n| n.op == op)
    }

    /// The mutations in force; empty for the true forward pass.
    pub fn mutations(&self) -> Mutations {
        self.mutations
    }

    /// Positions in the cache.
    pub fn position(&self) -> usize {
        self.len
    }

    /// The resolved config.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    /// Forget the cache.
    pub fn reset(&mut self) {
        self.k_cache.iter_mut().chain(self.v_cache.iter_mut()).for_each(Vec::clear);
        self.len = 0;
    }

    /// Run one token at the next position; return its logits [vocab].
    ///
    /// # Errors
    /// When the token is outside the vocabulary or the cache is full.
    pub fn step(&mut self, token: u32) -> Result<Vec<f64>> {
        self.run(token, None)
    }

    /// As [`GraphReference::step`], also returning every node's output for this step in order, by
    /// trace name (`embed`, `layers.0.attn_norm`, ..., `logits`): the trace points of the family.
    ///
    /// # Errors
    /// As [`GraphReference::step`].
    pub fn step_traced(&mut self, token: u32) -> Result<(Vec<f64>, Trace)> {
        let mut trace = Vec::new();
        let logits = self.run(token, Some(&mut trace))?;
        Ok((logits, trace))
    }

    fn run(&mut self, token: u32, mut trace: Option<&mut Trace>) -> Result<Vec<f64>> {
        let c = &self.cfg;
        if token as usize >= c.vocab {
            return Err(Error::usage(format!("token id {token} is outside the vocabulary ({})", c.vocab)));
        }
        if self.len >= c.max_seq {
            return Err(Error::usage(format!("sequence longer than max_position_embeddings {}", c.max_seq)));
        }
        let mut ctx = Exec {
            cfg: &self.cfg,
            store: &self.store,
            k_cache: &mut self.k_cache,
            v_cache: &mut self.v_cache,
            pos: self.len,
            token,
            inv_freq: self.inv_freq.as_deref(),
            m: self.mutations,
            f32_activations: self.f32_activations,
        };
        let mut stream = ctx.block(&self.prologue, Vec::new(), &mut trace);
        for layer in &self.layers {
            stream = ctx.block(layer, stream, &mut trace);
        }
        let logits = ctx.block(&self.epilogue, stream, &mut trace);
        self.len += 1;
        Ok(logits)
    }
}

/// Resolves a block's nodes against the config and loads their weights (each tensor once).
struct Builder<'a> {
    cfg: &'a ResolvedConfig,
    family: &'a ModelFamily,
    weight_dtype: &'a str,
    take: &'a TakeTensor<'a>,
    store: Vec<Vec<f64>>,
    /// (tensor name, one_plus_w) -> (store index, shape).
    keys: BTreeMap<(String, bool), (usize, Vec<usize>)>,
    caches: usize,
}

impl Builder<'_> {
    fn block(&mut self, nodes: &[GraphNode], layer: Option<usize>) -> Result<Vec<Prepared>> {
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
            let weight = match n.weights.get(slot).filter(|_| experts.is_none()) {
                Some(p) => Some(self.bind(&trace, p, layer, one_plus, &params)?),
                None => None,
            };
            let bias = match n.weights.get("bias") {
                Some(p) => Some(self.bind(&trace, p, layer, false, &params)?),
                None => None,
            };
            let cache = if n.op == "attention" {
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
                stacked.extend(super::dtypes::as_stored(&v, s[1], self.weight_dtype));
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
            let mut w = if s.len() == 2 { super::dtypes::as_stored(&v, s[1], self.weight_dtype) } else { widen(&v) };
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

/// One step's execution state.
struct Exec<'a> {
    cfg: &'a ResolvedConfig,
    store: &'a [Vec<f64>],
    k_cache: &'a mut [Vec<f64>],
    v_cache: &'a mut [Vec<f64>],
    pos: usize,
    token: u32,
    inv_freq: Option<&'a [f64]>,
    m: Mutations,
    f32_activations: bool,
}

impl Exec<'_> {
    /// Run a block on the incoming stream; return its last node's output.
    fn block(&mut self, nodes: &[Prepared], stream: Vec<f64>, trace: &mut Option<&mut Trace>) -> Vec<f64> {
        let mut vals: Vec<Vec<f64>> = Vec::with_capacity(nodes.len());
        for n in nodes {
            let ins: Vec<&[f64]> = n
                .inputs
                .iter()
                .map(|s| match *s {
                    Src::Stream => stream.as_slice(),
                    Src::Node(j) => vals[j].as_slice(),
                    Src::Token => &[],
                })
                .collect();
            // A swapped pair: the first runs the second's op on its own input, the second the
            // first's op on that; each output is traced under the name of the op that made it (as
            // an engine computing in that order reports it).
            let by = n.swap.map_or(n, |j| &nodes[j]);
            let mut out = self.node(by, &ins);
            if self.f32_activations {
                out.iter_mut().for_each(|v| *v = *v as f32 as f64);
            }
            if let Some(t) = trace.as_deref_mut() {
                t.push((by.trace.clone(), out.clone()));
            }
            vals.push(out);
        }
        vals.pop().unwrap_or(stream)
    }

    fn node(&mut self, n: &Prepared, ins: &[&[f64]]) -> Vec<f64> {
        let input = |i: usize| ins[i];
        if n.skip {
            return input(0).to_vec();
        }
        let (c, m) = (self.cfg, self.m);
        let slice = |b: &Bound| &self.store[b.at][b.offset * b.cols..(b.offset + b.rows) * b.cols];
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        match n.op.as_str() {
            "embedding" => {
                let w = n.weight.expect("table bound");
                let f = embedding::Faults { off_by_one: m.has(Mutation::EmbeddingOffByOne) };
                embedding::core(&self.store[w.at], w.cols, &[self.token], f)
            }
            "scale" => {
                let f = n.params["factor"];
                input(0).iter().map(|v| v * f).collect()
            }
            "softcap" => {
                let cap = n.params["cap"];
                if cap > 0.0 { input(0).iter().map(|v| cap * (v / cap).tanh()).collect() } else { input(0).to_vec() }
            }
            "add" => input(0).iter().zip(input(1)).map(|(a, b)| a + b).collect(),
            "rms_norm" => {
                let w = n.weight.expect("weight bound");
                let eps = n.params.get("eps").copied().unwrap_or(c.rms_norm_eps);
                let f = rms_norm::Faults {
                    eps_outside: m.has(Mutation::RmsNormEpsOutside),
                    no_weight: m.has(Mutation::RmsNormNoWeight),
                };
                let gain = slice(&w);
                match n.params.get("group").map(|g| *g as usize) {
                    // Rows of `group` entries, each with its own slice of a wider gain.
                    Some(g) if g > 0 && g < gain.len() && gain.len().is_multiple_of(g) => input(0)
                        .chunks(g)
                        .enumerate()
                        .flat_map(|(i, row)| {
                            let at = (i * g) % gain.len();
                            rms_norm::core(row, &gain[at..at + g], eps, f)
                        })
                        .collect(),
                    _ => rms_norm::core(input(0), gain, eps, f),
                }
            }
            "linear" => {
                let w = n.weight.expect("weight bound");
                let f = linear::Faults { xw: m.has(Mutation::LinearXw) };
                let mut y = linear::core(input(0), slice(&w), 1, w.cols, w.rows, f);
                if let Some(b) = &n.bias {
                    let bias = &self.store[b.at][w.offset..w.offset + w.rows];
                    y.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
                y
            }
            "rope" => {
                let heads = n.params["heads"] as usize;
                let theta = n.params.get("theta").copied().unwrap_or(c.rope_theta);
                let mut x = input(0).to_vec();
                // `scaling = 0` (a failure rewrite): config.json's rope_scaling ignored.
                let scaled = self.inv_freq.filter(|_| n.params.get("scaling") != Some(&0.0));
                let f = rope::Faults {
                    adjacent: m.has(Mutation::RopeAdjacent),
                    theta_default: m.has(Mutation::RopeThetaDefault),
                };
                match scaled {
                    // Scaled frequencies, with the kernel's faults as the kernel core has them.
                    Some(_) if f.theta_default || theta != c.rope_theta => {
                        let base = if f.theta_default { rope::DEFAULT_THETA } else { theta };
                        let freqs = rope_inv_freq(hd, base, c.rope_scaling.as_ref());
                        rope_pairs_with_freqs(&mut x, self.pos, heads, hd, &freqs, f.adjacent);
                    }
                    Some(freqs) => rope_pairs_with_freqs(&mut x, self.pos, heads, hd, freqs, f.adjacent),
                    None => rope::core(&mut x, &[self.pos], heads, hd, theta, f),
                }
                x
            }
            "rotary" => {
                let heads = n.params["heads"] as usize;
                let theta = n.params.get("theta").copied().unwrap_or(c.rope_theta);
                let rot = n.params.get("rotary_dim").map_or(hd, |r| *r as usize);
                let interleaved = n.params.get("interleaved").is_some_and(|v| *v != 0.0);
                let mut x = input(0).to_vec();
                let scaling = c.rope_scaling.as_ref().filter(|_| n.params.get("scaling") != Some(&0.0));
                let base = if m.has(Mutation::RopeThetaDefault) { rope::DEFAULT_THETA } else { theta };
                // kernel.rope's adjacent-pairs mutation is not this kernel's: a wrong pairing
                // here is failure.rope-pairing-swapped's rewrite (`interleaved` set).
                let f = rotary::Faults {
                    freq_over_head_dim: m.has(Mutation::RotaryFreqOverHeadDim),
                    ..rotary::Faults::default()
                };
                match scaling {
                    Some(s) => {
                        let freqs = rope_inv_freq(rot, base, Some(s));
                        rotary::rotate(&mut x, self.pos, heads, hd, &freqs, interleaved != f.pairing_swapped);
                    }
                    None => rotary::core(&mut x, &[self.pos], heads, hd, rot, base, interleaved, f),
                }
                x
            }
            "layer_norm" => {
                let eps = n.params["eps"];
                let f =
                    layer_norm::Faults { no_mean: m.has(Mutation::LayerNormNoMean), ..layer_norm::Faults::default() };
                let gain = n.weight.map(|w| slice(&w));
                let bias = n.bias.map(|b| &self.store[b.at][b.offset..b.offset + b.rows]);
                let width = gain
                    .map(<[f64]>::len)
                    .or(bias.map(<[f64]>::len))
                    .or(n.params.get("group").map(|g| *g as usize))
                    .unwrap_or(input(0).len());
                layer_norm::core(input(0), width, gain.unwrap_or(&[]), bias.unwrap_or(&[]), eps, f)
            }
            "gelu_tanh" => gelu_tanh::core(input(0), gelu_tanh::Faults { erf: m.has(Mutation::GeluErf) }),
            "clamp" => {
                let l = n.params["limit"];
                if l > 0.0 { input(0).iter().map(|v| v.clamp(-l, l)).collect() } else { input(0).to_vec() }
            }
            "attention" => {
                let (q, k, v) = (input(0), input(1), input(2));
                let pos = self.pos;
                let l = n.cache;
                // `kv_row` (a failure rewrite): every step's K/V written at that row.
                let fixed = n.params.get("kv_row").map(|r| (*r as usize).min(pos));
                if m.has(Mutation::KvPositionOffByOne) || fixed.is_some() {
                    let (width, row) = (nkv * hd, fixed.unwrap_or(pos.saturating_sub(1)) * nkv * hd);
                    for (cache, new) in [(&mut self.k_cache[l], k), (&mut self.v_cache[l], v)] {
                        cache.resize((pos + 1) * width, 0.0);
                        cache[row..row + width].copy_from_slice(new);
                    }
                } else {
                    self.k_cache[l].extend_from_slice(k);
                    self.v_cache[l].extend_from_slice(v);
                }
                let window = n.params.get("window").map_or(0, |w| *w as usize);
                let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
                let shape = AttnShape { n_q: 1, kv_len: pos + 1 - start, n_heads: nh, n_kv_heads: nkv, head_dim: hd };
                let from = start * nkv * hd;
                let f = attention::Faults {
                    gqa_modulo: m.has(Mutation::GqaModulo),
                    no_mask: false,
                    no_scale: m.has(Mutation::AttentionNoScale),
                    softmax_no_max: false,
                };
                let (keys, values) = (&self.k_cache[l][from..], &self.v_cache[l][from..]);
                match (n.params.get("scale"), n.params.get("softcap")) {
                    (None, None) => attention::core(q, keys, values, shape, f),
                    (scale, cap) => {
                        let scale = if f.no_scale { 1.0 } else { scale.copied().unwrap_or(1.0 / (hd as f64).sqrt()) };
                        attention::core_with(q, keys, values, shape, f, scale, cap.copied().unwrap_or(0.0))
                    }
                }
            }
            "moe_route" => {
                let f = moe_route::Faults {
                    no_renorm: m.has(Mutation::MoeNoRenorm),
                    softmax_over_topk: m.has(Mutation::MoeSoftmaxOverTopk),
                    ties_last: false,
                    off_by_one: m.has(Mutation::MoeExpertOffByOne),
                };
                let renormalize = n.params.get("renormalize").is_some_and(|r| *r != 0.0);
                moe_route::core(input(0), n.params["top_k"] as usize, renormalize, f)
            }
            "moe_experts" => {
                let [g, u, d] = n.experts.expect("experts bound");
                let count = n.params["experts"] as usize;
                let inter = g.rows / count.max(1);
                let f = moe_experts::Faults {
                    unweighted: m.has(Mutation::MoeUnweighted),
                    linear: linear::Faults { xw: m.has(Mutation::LinearXw) },
                    silu: silu_and_mul::Faults { swapped: m.has(Mutation::SiluSwapped) },
                };
                moe_experts::core(input(0), input(1), &self.store[g.at], &self.store[u.at], &self.store[d.at], inter, f)
            }
            "silu_and_mul" => {
                silu_and_mul::core(input(0), input(1), silu_and_mul::Faults { swapped: m.has(Mutation::SiluSwapped) })
            }
            "gelu_tanh_and_mul" => {
                gelu_tanh_and_mul::core(input(0), input(1), gelu_tanh_and_mul::Faults { erf: m.has(Mutation::GeluErf) })
            }
            other => unreachable!("lint refuses op `{other}`"),
        }
    }
}

/// Values a rewrite may derive in all (2^24: 128 MiB of f64).
const MAX_DERIVED: usize = 1 << 24;

/// Tensors derived by one rewrite: (source store index, how, one_plus) -> (store index, changed).
type Derived = BTreeMap<(usize, String, bool), (usize, bool)>;

/// Whether slot `bias` (or the weight) of `n` holds a (1 + w) gain.
fn one_plus_of(n: &Prepared, is_bias: bool) -> bool {
    n.one_plus && !is_bias
}

/// Rebind `slot` of node `n` as a mistaken engine holds it (`how`, one of
/// [`crate::ckb::WEIGHT_REWRITES`]); derived tensors are appended to `store`. Returns whether the
/// values the node computes with change.
fn rebind(
    n: &mut Prepared,
    slot: &str,
    how: &str,
    store: &mut Vec<Vec<f64>>,
    base: usize,
    keys: &BTreeMap<(String, bool), (usize, Vec<usize>)>,
    derived: &mut Derived,
) -> Result<bool> {
    let err = |m: String| Error::input(format!("rewrite binds `{}.{slot}` `{how}` at `{}`: {m}", n.name, n.trace));
    let is_bias = slot == "bias";
    let Some(bound) = (if is_bias { n.bias } else { n.weight }) else {
        // The node has no such binding (a family without biases): nothing to change.
        return Ok(false);
    };
    // Each tensor is derived once per rewrite (nodes sharing it share the copy), and the copies
    // together stay under MAX_DERIVED values: weight rewrites are for gains and biases, and a
    // rewrite of every matrix would double a large model's reference in memory.
    let mut derive = |store: &mut Vec<Vec<f64>>, f: &dyn Fn(f64) -> f64| -> Result<(Bound, bool)> {
        let key = (bound.at, how.to_string(), one_plus_of(n, is_bias));
        if let Some(&(at, changed)) = derived.get(&key) {
            return Ok((Bound { at, ..bound }, changed));
        }
        let total: usize = store[base..].iter().map(Vec::len).sum::<usize>() + store[bound.at].len();
        if total > MAX_DERIVED {
            return Err(err(format!(
                "the rewritten tensors would hold {total} values, more than {MAX_DERIVED}: rewrite small tensors (gains, biases) only"
            )));
        }
        let copy: Vec<f64> = store[bound.at].iter().map(|&x| f(x)).collect();
        let changed = copy != store[bound.at];
        store.push(copy);
        derived.insert(key, (store.len() - 1, changed));
        Ok((Bound { at: store.len() - 1, ..bound }, changed))
    };
    let one_plus = one_plus_of(n, is_bias);
    let (new, changed) = match how {
        "drop" if is_bias => {
            n.bias = None;
            return Ok(true);
        }
        "drop" => return Err(err("only the optional `bias` slot can be dropped".into())),
        "bf16" | "f16" => {
            // The checkpoint's value is rounded (for a (1 + w) gain, w, as an engine loading the
            // tensor in that format and adding 1 computes).
            let round = |x: f64| super::dtypes::as_stored(&[x as f32], 1, how)[0];
            let off = if one_plus { 1.0 } else { 0.0 };
            derive(store, &|x| round(x - off) + off)?
        }
        "raw" if one_plus => derive(store, &|x| x - 1.0)?,
        "raw" => return Ok(false),
        "tied" if is_bias => return Err(err("a bias has no tied tensor".into())),
        "tied" => {
            // A node without a `tied` slot (every projection but the output one) has nothing to tie.
            let Some(name) = &n.tied else { return Ok(false) };
            let Some((at, shape)) = keys.get(&(name.clone(), false)) else { return Ok(false) };
            if *at == bound.at {
                return Ok(false);
            }
            if shape.get(1).copied().unwrap_or(1) != bound.cols || shape[0] < bound.offset + bound.rows {
                return Err(err(format!("tensor `{name}` has shape {shape:?}, not the bound one's")));
            }
            (Bound { at: *at, ..bound }, true)
        }
        _ => return Err(err(format!("unknown; use one of {}", crate::ckb::WEIGHT_REWRITES.join(", ")))),
    };
    if is_bias {
        n.bias = Some(new);
    } else {
        n.weight = Some(new);
    }
    Ok(changed)
}
