//! The reference forward pass as an interpreter of a model family's graph (`[model.graph]`, see
//! [`ckb::Graph`]) in f64, one token a step, with a KV cache per attention node and layer.
//! Every op runs the registry's kernel (`oracle::kernels`) or an elementwise primitive; node names
//! are the trace points ([`GraphReference::step_traced`]). Model-level mutations
//! ([`super::mutants::Mutation`]) apply the kernel fault at every node of that op (and the KV-row
//! fault at every attention node), as the hand-written reference (`oracle::llama`) does.
//!
//! It gives the hand-written pass's logits bit for bit on every family that pass covers (Llama, with
//! and without Llama 3 RoPE scaling, Mistral, Qwen2, Qwen3, Gemma; test
//! `graph::graph_interpreter_gives_the_reference_logits_bit_for_bit`). The gates that need a reference,
//! `ckb conformance` and `metainfer bench` build `oracle::llama::Reference::of_family`, which
//! interprets the family's graph; the hand-written pass behind `Reference::new` stays as the yardstick
//! of that test, for a family that states no graph, and for callers holding a config without its
//! contract.

mod builder;
mod exec;

use std::collections::BTreeMap;

use super::families::rope_inv_freq;
use super::mutants::Mutations;
use base::error::{Error, Result};
use ckb::graph::{Val, eval_expr};
use ckb::{GraphRewrite, ModelFamily};
use model::{ResolvedConfig, Tensors};

use builder::Builder;
use exec::Exec;

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
    /// The weights of ops with named slots of their own (`attention_sinks`: sinks;
    /// `moe_experts_clamped`: gate_up, gate_up_bias, down, down_bias), by slot.
    slots: BTreeMap<String, Bound>,
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
        if !ckb::WEIGHT_DTYPES.contains(&weight_dtype) {
            return Err(Error::usage(format!(
                "weight dtype `{weight_dtype}` unknown; use one of {}",
                ckb::WEIGHT_DTYPES.join(", ")
            )));
        }
        let graph = family
            .graph
            .as_ref()
            .ok_or_else(|| Error::input(format!("{} has no [model.graph]: the reference cannot run it", cfg.family)))?;
        let findings = ckb::graph::lint_graph(graph, family);
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
                    && !ckb::is_attention(&block[i].op))
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
                if n.skip
                    && (n.inputs.is_empty()
                        || (matches!(n.op.as_str(), "linear" | "embedding") || ckb::is_attention(&n.op)))
                {
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

    /// Whether some node of the graph runs `op` (a [`ckb::GRAPH_OPS`] name).
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

/// Values a rewrite may derive in all (2^24: 128 MiB of f64).
const MAX_DERIVED: usize = 1 << 24;

/// Tensors derived by one rewrite: (source store index, how, one_plus) -> (store index, changed).
type Derived = BTreeMap<(usize, String, bool), (usize, bool)>;

/// Whether slot `bias` (or the weight) of `n` holds a (1 + w) gain.
fn one_plus_of(n: &Prepared, is_bias: bool) -> bool {
    n.one_plus && !is_bias
}

/// Rebind `slot` of node `n` as a mistaken engine holds it (`how`, one of
/// [`ckb::WEIGHT_REWRITES`]); derived tensors are appended to `store`. Returns whether the
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
        _ => return Err(err(format!("unknown; use one of {}", ckb::WEIGHT_REWRITES.join(", ")))),
    };
    if is_bias {
        n.bias = Some(new);
    } else {
        n.weight = Some(new);
    }
    Ok(changed)
}
