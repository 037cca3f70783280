//! The forward-pass graph of a model-family contract (`[model.graph]`, types [`Graph`] and
//! [`GraphNode`]): parameter expressions over config roles, the lint that refuses a malformed graph
//! with the node named (unknown op, undefined input, unbound weight, shape mismatch), and the
//! readable rendering that `lookup_contract` and plans show.
//!
//! What a family computes is its contract's graph, the single source of it: named nodes in order,
//! in a prologue (once), a layer (repeated n_layers times, `{i}` in weight names bound to the layer)
//! and an epilogue whose last node is the logits. Each node is an op of `GRAPH_OPS` (a kernel of the
//! registry: embedding, rms_norm, layer_norm, linear, rope, rotary, attention, silu_and_mul,
//! gelu_tanh_and_mul, gelu_tanh, moe_route, moe_experts; or an elementwise primitive: add, scale,
//! softcap, clamp) with its inputs (earlier nodes, `token`, `stream` = the residual stream entering
//! the block), weight bindings (names of `[[model.weights]]`, a row block of a fused tensor through
//! `row_offset`/`rows`, `tied` for the tied output head, a `bias` on any linear or layer_norm, `{e}`
//! for the expert index in a `moe_experts` node's weights, whose tensors the reference stacks by
//! expert) and parameters: expressions ([`super::expr`]) over config roles typed as config.json
//! types them (the fixed ones of `ResolvedConfig`, any other numeric role the family's
//! `[[model.config]]` declares, `ResolvedConfig::extra`; typed roles, `type = "list" | "object" |
//! "string" | "boolean"`, and `per_layer` lists, `ResolvedConfig::values`) and `layer`, the layer
//! index. So `if(layer_types[layer] == 'sliding_attention', sliding_window, 0)` windows Gemma 3's
//! local layers and `rope_parameters[layer_types[layer]].rope_theta` gives each its RoPE base. A new
//! mechanism enters the same way: a registry kernel and a `GRAPH_OPS` entry, its parameters as
//! expressions.
//!
//! Plan (`model::resolve`) evaluates every parameter at every layer of the real config and checks
//! each op's conditions ([`check_params`]: an even rotary_dim within the head, a positive base, ...):
//! a list shorter than the layers, a layer type the graph does not name (a list's `supported`
//! values), a division by zero, an index past a list are gaps naming the node and layer. Lint
//! ([`lint_graph`]) refuses an unknown op (naming the kernel contract that would add it), a kernel op
//! whose kernel `[model] kernels` does not list, an undefined input, an unbound weight or a shape
//! mismatch (checked at a sample config of distinct sizes), with the node named. lookup_contract
//! renders the graph a node a line ([`render_graph`]), and scaffold writes the same rendering as a
//! comment beside the family's `model` skeleton. The `features` of the closed set `FAMILY_FEATURES`
//! (lint refuses others) remain the routing and synth summary of the graph: `model::resolve` and plan
//! read them. The reference interprets the graph (`oracle::graph`); synth writes a family's
//! checkpoint from its weight bindings (`ops::synth`).

use std::collections::BTreeMap;

use super::family::{GRAPH_OPS, Graph, GraphNode, GraphOp, ModelFamily};

/// Evaluate a parameter or shape expression to a number ([`super::expr`]: numbers, strings,
/// config roles typed as config.json types them, indexing of lists and objects, `+ - * / %`,
/// comparisons, `&& || !`, `if(c, a, b)`, `sqrt`, `f32`, `floor`, `min`, `max`, `len`); a boolean
/// result is 1 or 0.
///
/// # Errors
/// A message naming the unknown role, the character that does not parse, the division by zero,
/// the index past a list or the key an object lacks.
pub fn eval_expr(expr: &str, role: &Roles<'_>) -> Result<f64, String> {
    super::expr::eval_number(expr, role)
}

pub use super::expr::{MAX_EXPR_BYTES, MAX_EXPR_DEPTH, Roles, Val};

/// Config values the lint checks shapes with: distinct sizes (n_heads * head_dim differs from
/// hidden, n_kv_heads from n_heads), so that a graph confusing two of them is caught; `layer` is 1.
/// Roles a family declares beyond these are [`family_sample_role`]'s.
pub fn sample_role(name: &str) -> Option<Val> {
    sample_number(name).map(Val::Num)
}

/// [`sample_role`]'s numbers.
fn sample_number(name: &str) -> Option<f64> {
    Some(match name {
        "hidden" => 40.0,
        "intermediate" => 56.0,
        "n_layers" => 2.0,
        "n_heads" => 4.0,
        "n_kv_heads" => 2.0,
        "head_dim" => 16.0,
        "vocab" => 70.0,
        "max_seq" => 16.0,
        "rms_norm_eps" => 1e-5,
        "rope_theta" => 10000.0,
        "sliding_window" => 8.0,
        "layer" => 1.0,
        _ => return None,
    })
}

/// [`sample_role`], then any other role the family's `[[model.config]]` declares, at its
/// `example`, else its `default`, read as JSON (a number, a boolean, a string in quotes, a list, an
/// object); a `per_layer` list is its example repeated to the sample's 2 layers; else 1.
pub fn family_sample_role(family: &ModelFamily, name: &str) -> Option<Val> {
    sample_role(name).or_else(|| {
        let f = family.config.iter().find(|f| f.role == name)?;
        let json =
            |t: &Option<String>| t.as_deref().and_then(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok());
        let v = json(&f.example).or_else(|| json(&f.default)).map(|v| Val::from_json(&v)).unwrap_or(Val::Num(1.0));
        Some(match v {
            Val::List(l) if f.per_layer && !l.is_empty() => {
                let n = sample_number("n_layers").unwrap_or(2.0) as usize;
                Val::List(l.iter().cycle().take(n).cloned().collect())
            }
            v => v,
        })
    })
}

/// Conditions an op puts on its evaluated parameters, checked at lint (sample config) and at plan
/// (every layer of the real config): a base theta above 0, an even rotary_dim from 2 to head_dim,
/// `interleaved` 0 or 1, a window a whole number from 0, an eps above 0, a limit from 0.
///
/// # Errors
/// A message naming the parameter and its value.
pub fn check_params(op: &str, p: &BTreeMap<String, f64>, head_dim: usize) -> Result<(), String> {
    let get = |k: &str| p.get(k).copied();
    if let Some(t) = get("theta").filter(|_| matches!(op, "rope" | "rotary"))
        && t <= 0.0
    {
        return Err(format!("theta = {t}: a RoPE base must be above 0"));
    }
    if let Some(r) = get("rotary_dim").filter(|_| op == "rotary")
        && (r.fract() != 0.0 || r < 2.0 || r as usize > head_dim || !(r as usize).is_multiple_of(2))
    {
        return Err(format!(
            "rotary_dim = {r}: the rotated entries of a head must be an even whole number from 2 to head_dim ({head_dim}); a partial rotary factor that leaves an odd number of dimensions cannot be paired"
        ));
    }
    if let Some(i) = get("interleaved")
        && i != 0.0
        && i != 1.0
    {
        return Err(format!("interleaved = {i}: 1 (pairs 2j, 2j + 1) or 0 (pairs j, j + rotary_dim/2)"));
    }
    if let Some(w) = get("window").filter(|_| super::is_attention(op))
        && (w < 0.0 || w.fract() != 0.0)
    {
        return Err(format!("window = {w}: a whole number of positions from 0 (0: no window)"));
    }
    if let Some(e) = get("eps")
        && e <= 0.0
    {
        return Err(format!("eps = {e}: must be above 0 (it keeps the square root from 0)"));
    }
    if let Some(g) = get("group")
        && (g < 1.0 || g.fract() != 0.0)
    {
        return Err(format!("group = {g}: a whole number of entries from 1"));
    }
    if let Some(l) = get("limit")
        && l < 0.0
    {
        return Err(format!("limit = {l}: from 0 (0: no clamp)"));
    }
    if let Some(k) = get("top_k")
        && (k < 1.0 || k.fract() != 0.0)
    {
        return Err(format!("top_k = {k}: a whole number of experts from 1"));
    }
    if let Some(e) = get("experts")
        && (e < 1.0 || e.fract() != 0.0)
    {
        return Err(format!("experts = {e}: a whole number of experts from 1"));
    }
    if let Some(r) = get("renormalize")
        && r != 0.0
        && r != 1.0
    {
        return Err(format!("renormalize = {r}: 1 (true: divide the kept weights by their sum) or 0 (false)"));
    }
    Ok(())
}

/// The graph language as data, for `ckb schema` and lookup: every op of [`GRAPH_OPS`] with its
/// inputs, weight slots, parameters (`?`: optional), what it computes and its kernel contract; the
/// expression grammar with its functions and an example each; the fixed config roles.
pub fn language() -> serde_json::Value {
    use serde_json::json;
    let ops: Vec<serde_json::Value> = GRAPH_OPS
        .iter()
        .map(|o| {
            json!({"op": o.name, "inputs": o.inputs, "weights": o.weights, "params": o.params, "doc": o.doc,
                   "kernel": o.kernel})
        })
        .collect();
    let functions: Vec<serde_json::Value> =
        super::expr::FUNCTIONS.iter().map(|(n, a, d)| json!({"name": n, "arity": a, "doc": d})).collect();
    json!({
        "blocks": "prologue (once; inputs `token`), layer (n_layers times; `stream` is the residual stream in, `{i}` in weight names and `layer` in expressions the layer index), epilogue (once; its last node is the logits [vocab])",
        "ops": ops,
        "expressions": {
            "grammar": "expr := and ('||' and)*; and := cmp ('&&' cmp)*; cmp := sum [('=='|'!='|'<'|'<='|'>'|'>=') sum]; sum := product (('+'|'-') product)*; product := unary (('*'|'/'|'%') unary)*; unary := ('-'|'!') unary | postfix; postfix := atom ('[' expr ']' | '.' name)*; atom := number | string ('...' or \"...\") | name | name '(' args ')' | '(' expr ')'",
            "values": "config values typed as config.json types them: numbers, booleans, strings, lists, objects, null; a parameter's value is a number (a boolean counts 1 or 0)",
            "names": "config roles of the family's [[model.config]] (fixed: hidden, intermediate, n_layers, n_heads, n_kv_heads, head_dim, vocab, max_seq, rms_norm_eps, rope_theta, sliding_window, tied; any other declared role, numeric or typed with `type`), `layer` (layer nodes), true, false, null",
            "functions": functions,
            "errors": "an unknown role, arithmetic on a non-number, a division or remainder by zero, an index past a list, a key an object lacks, a comparison of different types (any value may be compared with null), a non-finite result: each refused by name at lint (sample config) or plan (every layer of the real config)",
            "bounds": format!("at most {MAX_EXPR_BYTES} bytes and {MAX_EXPR_DEPTH} levels of nesting"),
            "examples": [
                "1 / sqrt(query_pre_attn_scalar)",
                "sliding_window * (1 - layer % 2)",
                "if(layer_types[layer] == 'sliding_attention', sliding_window, 0)",
                "rope_parameters[layer_types[layer]].rope_theta",
                "floor(head_dim * partial_rotary_factor)"
            ]
        }
    })
}

/// The spec of an op of [`GRAPH_OPS`].
pub fn op_spec(op: &str) -> Option<&'static GraphOp> {
    GRAPH_OPS.iter().find(|o| o.name == op)
}

/// A lint finding: the JSON pointer of the node (`/model/graph/layer/3`) and the message, which
/// names the node.
pub type GraphFinding = (String, String);

/// Check a graph against the family's weights, its config roles, its kernels and the op vocabulary,
/// with shapes evaluated at [`family_sample_role`]: every op known (an unknown one is named with the
/// kernel contract that would add it), every kernel op's kernel listed in `[model] kernels`, every input defined before use, every weight slot bound to a
/// declared `[[model.weights]]` name (`{i}` only in `layer`) and every required weight read by a
/// node, every parameter evaluable, and every
/// width consistent (a linear's input is its weight's column count, a residual add joins equal
/// widths, attention sees n_heads and n_kv_heads heads of head_dim, the logits are [vocab]).
pub fn lint_graph(g: &Graph, family: &ModelFamily) -> Vec<GraphFinding> {
    let weights = &family.weights;
    let role = |r: &str| family_sample_role(family, r);
    let mut out = Vec::new();
    let shape_of = |name: &str| -> Option<Vec<usize>> {
        let w = weights.iter().find(|w| w.name == name)?;
        w.shape.iter().map(|d| eval_expr(d, &role).ok().map(|v| v as usize)).collect()
    };
    let dim = |r: &str| sample_number(r).unwrap_or(0.0) as usize;
    let mut stream = None;
    for (block, nodes) in [("prologue", &g.prologue), ("layer", &g.layer), ("epilogue", &g.epilogue)] {
        let mut env: BTreeMap<String, Option<usize>> = BTreeMap::new();
        match block {
            "prologue" => {
                env.insert("token".into(), None);
            }
            _ => {
                env.insert("stream".into(), stream);
            }
        }
        let entering = stream;
        let mut last = None;
        for (n, node) in nodes.iter().enumerate() {
            let field = format!("/model/graph/{block}/{n}");
            let mut bad = |m: String| out.push((field.clone(), format!("node `{}` ({block}): {m}", node.name)));
            let width = lint_node(node, block, &env, &shape_of, &dim, family, &mut bad);
            if env.contains_key(&node.name) {
                bad(format!("the name `{}` is already defined in this block", node.name));
            }
            env.insert(node.name.clone(), width);
            last = width;
        }
        if nodes.is_empty() && block != "layer" {
            out.push((format!("/model/graph/{block}"), format!("the {block} has no node")));
        }
        if block == "layer" {
            if let (Some(a), Some(b)) = (entering, last)
                && a != b
            {
                out.push((
                    "/model/graph/layer".into(),
                    format!(
                        "node `{}` (layer): the layer's output has width {b} but its input (stream) has {a}: the last node of a layer must be the residual stream",
                        nodes.last().map_or("", |n| n.name.as_str())
                    ),
                ));
            }
            stream = last.or(entering);
        } else {
            stream = last;
        }
    }
    if let (Some(w), Some(node)) = (stream, g.epilogue.last())
        && w != dim("vocab")
    {
        out.push((
            format!("/model/graph/epilogue/{}", g.epilogue.len() - 1),
            format!("node `{}` (epilogue): the last node yields the logits and must have width vocab, got {w} at the sample config", node.name),
        ));
    }
    let bound: Vec<&str> = [&g.prologue, &g.layer, &g.epilogue]
        .into_iter()
        .flatten()
        .flat_map(|n| n.weights.values().map(String::as_str))
        .collect();
    for w in weights.iter().filter(|w| !w.optional && !bound.contains(&w.name.as_str())) {
        out.push((
            "/model/graph".into(),
            format!("unbound weight: `{}` ({}) is declared in [[model.weights]] but no node reads it", w.name, w.role),
        ));
    }
    for (k, name) in g.trace_required.iter().enumerate() {
        if ![&g.prologue, &g.layer, &g.epilogue].into_iter().flatten().any(|n| &n.name == name) {
            out.push((
                format!("/model/graph/trace_required/{k}"),
                format!("trace point `{name}` is required but no node of the graph has that name"),
            ));
        }
    }
    out
}

/// Check one node; returns its output width at the sample config (None when unknown).
fn lint_node(
    node: &GraphNode,
    block: &str,
    env: &BTreeMap<String, Option<usize>>,
    shape_of: &dyn Fn(&str) -> Option<Vec<usize>>,
    dim: &dyn Fn(&str) -> usize,
    family: &ModelFamily,
    bad: &mut dyn FnMut(String),
) -> Option<usize> {
    let role = &|r: &str| family_sample_role(family, r);
    let kernels = &family.kernels;
    let Some(GraphOp { name: op, inputs: ins, weights: slots, params, kernel, .. }) = op_spec(&node.op) else {
        bad(format!(
            "unknown op `{}`: no registry kernel computes it. Add kernel.{} (a module in oracle::kernels with its f64 oracle, plus contracts/kernels/{}.toml) to the server, or express the node with the known ops: {}",
            node.op,
            node.op,
            node.op,
            GRAPH_OPS.iter().map(|o| o.name).collect::<Vec<_>>().join(", ")
        ));
        return None;
    };
    if let Some(k) = kernel
        && !kernels.iter().any(|x| x == k)
    {
        bad(format!(
            "op `{op}` runs {k}, which [model] kernels does not list: add it, so that run_kernel_test checks the engine's {k}"
        ));
    }
    if node.inputs.len() != ins.len() {
        bad(format!("op `{op}` takes {} input(s) ({}), got {}", ins.len(), ins.join(", "), node.inputs.len()));
        return None;
    }
    let mut widths = Vec::new();
    for i in &node.inputs {
        match env.get(i) {
            None => {
                bad(format!(
                    "undefined input `{i}`: name an earlier node of this block{}",
                    if block == "prologue" { " or `token`" } else { " or `stream`" }
                ));
                return None;
            }
            Some(w) => widths.push(*w),
        }
        if (i == "token") != (*op == "embedding") {
            bad(format!("input `{i}`: only `embedding` reads the token id, and it reads nothing else"));
            return None;
        }
    }
    let mut w = BTreeMap::new();
    for s in *slots {
        let (name, optional) = s.strip_suffix('?').map_or((*s, false), |n| (n, true));
        match node.weights.get(name) {
            None if !optional => bad(format!("unbound weight: op `{op}` needs weight slot `{name}`")),
            None => {}
            Some(pattern) => {
                if pattern.contains("{i}") && block != "layer" {
                    bad(format!("weight `{pattern}` uses {{i}} outside the layer block"));
                }
                if pattern.contains("{e}") != (*op == "moe_experts") {
                    bad(format!(
                        "weight `{pattern}`: the expert index {{e}} belongs in the weights of a `moe_experts` node, and each of them names it"
                    ));
                }
                match shape_of(pattern) {
                    None => bad(format!(
                        "unbound weight: `{pattern}` (slot `{name}`) is not a [[model.weights]] name of this family"
                    )),
                    Some(sh) => {
                        w.insert(name, sh);
                    }
                }
            }
        }
    }
    for s in node.weights.keys() {
        if !slots.iter().any(|k| k.trim_end_matches('?') == s) {
            bad(format!("op `{op}` has no weight slot `{s}` (slots: {})", slots.join(", ")));
        }
    }
    let mut p = BTreeMap::new();
    for s in *params {
        let (name, optional) = s.strip_suffix('?').map_or((*s, false), |n| (n, true));
        match node.params.get(name) {
            None if !optional => bad(format!("op `{op}` needs parameter `{name}`")),
            None => {}
            Some(e) if name == "gain" && e != "w" && e != "one_plus_w" => {
                bad(format!("parameter gain = `{e}`: use `w` or `one_plus_w`"))
            }
            Some(_) if name == "gain" => {}
            Some(e) if block != "layer" && mentions_layer(e) => {
                bad(format!("parameter `{name}` = `{e}` uses `layer` outside the layer block"))
            }
            Some(e) => {
                // Every sample layer (a list read at the layer index is read at each).
                let layer0 = |r: &str| if r == "layer" { Some(Val::Num(0.0)) } else { role(r) };
                if block == "layer"
                    && let Err(m) = eval_expr(e, &layer0)
                {
                    bad(format!("parameter `{name}` at layer 0: {m}"));
                }
                match eval_expr(e, role) {
                    Ok(v) => {
                        p.insert(name, v);
                    }
                    Err(m) => bad(format!("parameter `{name}`: {m}")),
                }
            }
        }
    }
    for s in node.params.keys() {
        if !params.iter().any(|k| k.trim_end_matches('?') == s) {
            bad(format!("op `{op}` has no parameter `{s}` (parameters: {})", params.join(", ")));
        }
    }
    let owned: BTreeMap<String, f64> = p.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    if let Err(m) = check_params(op, &owned, dim("head_dim")) {
        bad(m);
    }
    let x = widths.first().copied().flatten();
    let mut mismatch = |m: String| bad(format!("shape mismatch: {m}"));
    match *op {
        "embedding" => w.get("table").and_then(|s| s.get(1).copied()),
        "rms_norm" => {
            let g = w.get("weight").and_then(|s| s.first().copied())?;
            if let Some(x) = x
                && (g == 0 || x % g != 0)
            {
                mismatch(format!("input width {x} is not a multiple of the norm weight's {g}"));
            }
            if let Some(&r) = p.get("group")
                && (r < 1.0 || g % (r as usize).max(1) != 0)
            {
                mismatch(format!("group {r} does not divide the norm weight's {g} entries"));
            }
            x
        }
        "linear" => {
            let sh = w.get("weight")?;
            let (r, c) = (sh[0], *sh.get(1)?);
            if let Some(x) = x
                && x != c
            {
                mismatch(format!("input width {x} but the weight has {c} columns"));
            }
            if let Some(t) = w.get("tied")
                && t != sh
            {
                mismatch(format!("tied weight shape {t:?} differs from weight shape {sh:?}"));
            }
            if let Some(b) = w.get("bias")
                && b != &[r]
            {
                mismatch(format!("bias shape {b:?}, the weight has {r} rows"));
            }
            let off = p.get("row_offset").map_or(0, |v| *v as usize);
            let rows = p.get("rows").map_or(r - off.min(r), |v| *v as usize);
            if off + rows > r {
                mismatch(format!("rows {off}..{} outside the weight's {r} rows", off + rows));
            }
            Some(rows)
        }
        "layer_norm" => {
            let g = w.get("weight").or(w.get("bias")).and_then(|s| s.first().copied());
            if let (Some(a), Some(b)) = (w.get("weight"), w.get("bias"))
                && a != b
            {
                mismatch(format!("gain shape {a:?} and bias shape {b:?} differ"));
            }
            if let (Some(x), Some(g)) = (x, g.or(p.get("group").map(|v| *v as usize)))
                && (g == 0 || x % g != 0)
            {
                mismatch(format!("input width {x} is not a multiple of the normalised group's {g}"));
            }
            x
        }
        "rope" | "rotary" => {
            let want = p.get("heads").map(|h| *h as usize * dim("head_dim"));
            if let (Some(x), Some(want)) = (x, want)
                && x != want
            {
                mismatch(format!("input width {x} is not heads * head_dim = {want}"));
            }
            x
        }
        "attention" | "attention_sinks" => {
            let (q, kv) = (dim("n_heads") * dim("head_dim"), dim("n_kv_heads") * dim("head_dim"));
            for (name, got, want) in [("q", widths[0], q), ("k", widths[1], kv), ("v", widths[2], kv)] {
                if let Some(got) = got
                    && got != want
                {
                    mismatch(format!("{name} has width {got}, attention wants {want}"));
                }
            }
            if let Some(sinks) = w.get("sinks")
                && sinks[..] != [dim("n_heads")]
            {
                mismatch(format!("sinks shape {sinks:?}, want [n_heads] = [{}]", dim("n_heads")));
            }
            Some(q)
        }
        "moe_route" => {
            if let (Some(x), Some(&k)) = (x, p.get("top_k"))
                && k as usize > x
            {
                mismatch(format!("top_k {k} is more than the {x} experts the router scores"));
            }
            x
        }
        "moe_experts" => {
            let (g, u, d) = (w.get("gate")?, w.get("up")?, w.get("down")?);
            if g != u || d.len() != 2 || g.len() != 2 || d[0] != g[1] || d[1] != g[0] {
                mismatch(format!(
                    "expert gate {g:?}, up {u:?} and down {d:?}: want [inter, hidden] twice and [hidden, inter]"
                ));
            }
            if let Some(x) = x
                && x != g[1]
            {
                mismatch(format!("input width {x} but the experts take {}", g[1]));
            }
            if let (Some(r), Some(&e)) = (widths[1], p.get("experts"))
                && r != e as usize
            {
                mismatch(format!("route has width {r}, experts = {e}"));
            }
            x
        }
        "moe_experts_clamped" => {
            let (gu, gb, d, db) = (w.get("gate_up")?, w.get("gate_up_bias")?, w.get("down")?, w.get("down_bias")?);
            let fits = gu.len() == 3
                && d.len() == 3
                && gu[0] == d[0]
                && gu[1] == d[2]
                && gu[2] == 2 * d[1]
                && gb[..] == [gu[0], gu[2]]
                && db[..] == [d[0], d[2]];
            if !fits {
                mismatch(format!(
                    "gate_up {gu:?}, gate_up_bias {gb:?}, down {d:?} and down_bias {db:?}: want [experts, hidden, 2 inter], [experts, 2 inter], [experts, inter, hidden], [experts, hidden]"
                ));
                return x;
            }
            if let Some(x) = x
                && x != gu[1]
            {
                mismatch(format!("input width {x} but the experts take {}", gu[1]));
            }
            if let Some(&e) = p.get("experts")
                && e as usize != gu[0]
            {
                mismatch(format!("experts = {e} but the fused tensors hold {}", gu[0]));
            }
            if let (Some(r), Some(&e)) = (widths[1], p.get("experts"))
                && r != e as usize
            {
                mismatch(format!("route has width {r}, experts = {e}"));
            }
            x
        }
        "silu_and_mul" | "gelu_tanh_and_mul" | "add" => {
            if let (Some(a), Some(b)) = (widths[0], widths[1])
                && a != b
            {
                mismatch(format!("inputs have widths {a} and {b}"));
            }
            x
        }
        _ => x,
    }
}

/// Whether an expression names the `layer` role.
fn mentions_layer(e: &str) -> bool {
    super::expr::parse(e).is_ok_and(|x| super::expr::names(&x).iter().any(|n| n == "layer"))
}

/// The graph as text, one node a line: `name = op(inputs) slot=tensor param=value`, by block.
pub fn render_graph(g: &Graph) -> String {
    let mut s = String::new();
    for (title, nodes) in [
        ("prologue (once)", &g.prologue),
        ("layer (n_layers times; {i} = layer index; `stream` = residual stream in)", &g.layer),
        ("epilogue (once; the last node is the logits)", &g.epilogue),
    ] {
        s.push_str(title);
        s.push_str(":\n");
        for n in nodes {
            s.push_str(&format!("  {} = {}({})", n.name, n.op, n.inputs.join(", ")));
            for (k, v) in &n.weights {
                s.push_str(&format!(" {k}={v}"));
            }
            for (k, v) in &n.params {
                s.push_str(&format!(" {k}={v}"));
            }
            s.push('\n');
        }
    }
    s
}
