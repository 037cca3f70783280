//! The forward-pass graph of a model-family contract (`[model.graph]`, types [`Graph`] and
//! [`GraphNode`]): parameter expressions over config roles, the lint that refuses a malformed graph
//! with the node named (unknown op, undefined input, unbound weight, shape mismatch), and the
//! readable rendering that `lookup_contract` and plans show.

use std::collections::BTreeMap;

use super::types::{GRAPH_OPS, Graph, GraphNode, GraphOp, ModelFamily};

/// Evaluate a parameter or shape expression: numbers, config roles (looked up by `role`), `+ - * /`
/// and `%` (remainder, e.g. `layer % 2` for every other layer) with the usual precedence,
/// parentheses, `sqrt(e)` and `f32(e)` (round to the nearest f32, as an engine computing in f32
/// holds the value).
///
/// # Errors
/// A message naming the unknown role or the character that does not parse.
pub fn eval_expr(expr: &str, role: &dyn Fn(&str) -> Option<f64>) -> Result<f64, String> {
    if expr.len() > MAX_EXPR_BYTES {
        return Err(format!(
            "an expression of {} bytes; at most {MAX_EXPR_BYTES} (write it shorter, or add a config role)",
            expr.len()
        ));
    }
    let chars: Vec<char> = expr.chars().filter(|c| !c.is_whitespace()).collect();
    let mut p = Parser { s: &chars, at: 0, role, depth: 0 };
    let v = p.sum()?;
    if p.at != chars.len() {
        return Err(format!("`{expr}`: unexpected `{}` at {}", chars[p.at], p.at));
    }
    Ok(v)
}

/// Longest expression [`eval_expr`] reads, bytes: the longest in the shipped contracts is under 80.
pub const MAX_EXPR_BYTES: usize = 1024;

/// Deepest nesting [`eval_expr`] reads (parentheses, unary minus and function calls, each a level):
/// the parser recurses once per level, so a bound here keeps a hostile contract from overflowing
/// the server's stack. The shipped contracts nest at most 3 deep.
pub const MAX_EXPR_DEPTH: usize = 32;

struct Parser<'a> {
    s: &'a [char],
    at: usize,
    role: &'a dyn Fn(&str) -> Option<f64>,
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.at).copied()
    }
    fn sum(&mut self) -> Result<f64, String> {
        let mut v = self.product()?;
        while let Some(c @ ('+' | '-')) = self.peek() {
            self.at += 1;
            let r = self.product()?;
            v = if c == '+' { v + r } else { v - r };
        }
        Ok(v)
    }
    fn product(&mut self) -> Result<f64, String> {
        let mut v = self.atom()?;
        while let Some(c @ ('*' | '/' | '%')) = self.peek() {
            self.at += 1;
            let r = self.atom()?;
            v = match c {
                '*' => v * r,
                '/' => v / r,
                _ => v % r,
            };
        }
        Ok(v)
    }
    fn atom(&mut self) -> Result<f64, String> {
        self.depth += 1;
        if self.depth > MAX_EXPR_DEPTH {
            return Err(format!("nested more than {MAX_EXPR_DEPTH} deep at {}", self.at));
        }
        let v = self.atom_inner();
        self.depth -= 1;
        v
    }
    fn atom_inner(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some('(') => {
                self.at += 1;
                let v = self.sum()?;
                if self.peek() != Some(')') {
                    return Err("missing `)`".into());
                }
                self.at += 1;
                Ok(v)
            }
            Some('-') => {
                self.at += 1;
                Ok(-self.atom()?)
            }
            Some(c) if c.is_ascii_digit() || c == '.' => {
                let start = self.at;
                while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == '.')
                    || (self.at > start
                        && matches!(self.peek(), Some('+' | '-'))
                        && matches!(self.s[self.at - 1], 'e' | 'E'))
                {
                    self.at += 1;
                }
                let text: String = self.s[start..self.at].iter().collect();
                text.parse::<f64>().map_err(|_| format!("`{text}` is not a number"))
            }
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                let start = self.at;
                while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                    self.at += 1;
                }
                let name: String = self.s[start..self.at].iter().collect();
                if self.peek() == Some('(') {
                    let v = self.atom()?;
                    return match name.as_str() {
                        "sqrt" => Ok(v.sqrt()),
                        "f32" => Ok(v as f32 as f64),
                        _ => Err(format!("unknown function `{name}` (known: sqrt, f32)")),
                    };
                }
                (self.role)(&name).ok_or_else(|| format!("unknown config role `{name}`"))
            }
            Some(c) => Err(format!("unexpected `{c}`")),
            None => Err("expression ends early".into()),
        }
    }
}

/// Config values the lint checks shapes with: distinct sizes (n_heads * head_dim differs from
/// hidden, n_kv_heads from n_heads), so that a graph confusing two of them is caught; `layer` is 1.
/// Roles a family declares beyond these are [`family_sample_role`]'s.
pub fn sample_role(name: &str) -> Option<f64> {
    Some(match name {
        "hidden" => 40.0,
        "intermediate" => 56.0,
        "n_layers" => 2.0,
        "n_heads" => 4.0,
        "n_kv_heads" => 2.0,
        "head_dim" => 12.0,
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
/// `example`, else its `default` when that is a number, else 1.
pub fn family_sample_role(family: &ModelFamily, name: &str) -> Option<f64> {
    sample_role(name).or_else(|| {
        let f = family.config.iter().find(|f| f.role == name)?;
        let num = |t: &Option<String>| t.as_deref().and_then(|d| d.trim().parse::<f64>().ok());
        Some(num(&f.example).or_else(|| num(&f.default)).unwrap_or(1.0))
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
    let dim = |r: &str| sample_role(r).unwrap_or(0.0) as usize;
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
            Some(e) => match eval_expr(e, role) {
                Ok(v) => {
                    p.insert(name, v);
                }
                Err(m) => bad(format!("parameter `{name}`: {m}")),
            },
        }
    }
    for s in node.params.keys() {
        if !params.iter().any(|k| k.trim_end_matches('?') == s) {
            bad(format!("op `{op}` has no parameter `{s}` (parameters: {})", params.join(", ")));
        }
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
        "rope" => {
            let want = p.get("heads").map(|h| *h as usize * dim("head_dim"));
            if let (Some(x), Some(want)) = (x, want)
                && x != want
            {
                mismatch(format!("input width {x} is not heads * head_dim = {want}"));
            }
            x
        }
        "attention" => {
            let (q, kv) = (dim("n_heads") * dim("head_dim"), dim("n_kv_heads") * dim("head_dim"));
            for (name, got, want) in [("q", widths[0], q), ("k", widths[1], kv), ("v", widths[2], kv)] {
                if let Some(got) = got
                    && got != want
                {
                    mismatch(format!("{name} has width {got}, attention wants {want}"));
                }
            }
            Some(q)
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
    e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == "layer")
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
