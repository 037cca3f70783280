//! Where an engine's forward pass first leaves the reference: the engine's traced forward
//! (`Model::forward_traced`, harness command `trace`) against the reference's trace
//! ([`oracle::llama::Reference::step_traced`]) on the same tokens, point by point in the
//! graph's order. verify_generation runs it on the first failing step of the first failing prompt.
//!
//! The points are the family graph's node names (`embed`, `layers.<i>.<node>`, `logits`): a family's
//! `[model.graph]` names every activation of one token's forward pass, and its `trace_required` lists
//! those every engine must report (the residual stream after each block, and the logits). The family
//! contracts' `rust.skeleton` gives the engine `Model::forward_traced(token, pos, trace)`, which calls
//! `trace(layer, node, values)` at each point it computes, in order; it is `optional` (engines
//! scaffolded before it keep building, and the gates say what they cannot do without it), and the
//! harness keeps its blocks under `// @item forward_traced`. The trace is the engine's own account of
//! its activations: it localises and attributes time (profile_engine), it never passes or fails a
//! gate.
//!
//! In verify_generation (`ops::verify`'s `traced` module): on a failing step, a second harness call
//! sends `trace` with the engine's own ids and tokens up to that step (the last one traced), the
//! reference steps over the same tokens, and [`compare_traces`] names the first point in graph order
//! beyond the logit tolerance (the report's `localisation`; the node is recorded as
//! `VerifyFigures::point`, which evolve_knowledge clusters by). A traced forward that agrees
//! everywhere says where the mismatch is instead (prefill's own path, the cache prefill left, the
//! tokenizer). A call judging a bundle does not localise (a bundle holds no `trace` request).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use ckb::{Graph, Tolerance};
use harness::protocol::TracePoint;
use oracle::graph::Trace;

/// Where the traced rerun of a failing step first leaves the reference.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Localisation {
    /// Index of the prompt (in the report's `prompts`).
    pub prompt: usize,
    /// Generation step whose logits failed (0: the logits after the prompt).
    pub step: usize,
    /// `prefill` (step 0) or `decode`.
    pub phase: String,
    /// Position of the traced token (the token run last: prompt length + step - 1).
    pub position: usize,
    /// First point beyond tolerance, as the reference names it (`embed`, `layers.3.q_rope`,
    /// `logits`); empty when every compared point agrees.
    pub point: String,
    /// Its decoder layer; absent in the prologue and epilogue or when no point diverged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<usize>,
    /// Its graph node (`q_rope`).
    pub node: String,
    /// Largest |engine - reference| at that point.
    pub max_abs_err: f64,
    /// Largest |reference| at that point (the scale the error is against).
    pub reference_max_abs: f64,
    /// Index of the element furthest outside tolerance there.
    pub worst_index: usize,
    /// The last point that agreed before it (empty when it is the first one).
    pub last_agreeing: String,
    /// Points compared (reported by the engine and known to the reference).
    pub compared: usize,
    /// Points of `trace_required` the engine did not report, by reference name.
    pub missing_required: Vec<String>,
    /// Points the engine reported that the family's graph does not have.
    pub unknown: Vec<String>,
    /// What this means, in words.
    pub note: String,
    /// Failure modes whose model-level mutant, run traced over the same tokens, gives the engine's
    /// values at the diverging point (within tolerance): `error_vs_mutant` is measured there
    /// ([`oracle::diagnose::at_point`]). Best match first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mutants: Vec<oracle::diagnose::Diagnosis>,
}

impl Localisation {
    /// One line for the report.
    pub fn line(&self) -> String {
        let at = format!("prompt {} step {} ({}, position {})", self.prompt, self.step, self.phase, self.position);
        if self.point.is_empty() {
            return format!("localised: {at}: {}", self.note);
        }
        format!(
            "localised: {at}: first diverging point {} (max abs error {} against reference values up to {}){}; {}",
            self.point,
            super::sci(self.max_abs_err),
            super::sci(self.reference_max_abs),
            if self.last_agreeing.is_empty() {
                String::new()
            } else {
                format!(", after {} agreed", self.last_agreeing)
            },
            self.note
        ) + &match self.mutants.first() {
            Some(d) => format!(
                "; there the engine matches the mutant of {} ({}; max abs error {} vs it)",
                d.failure,
                d.mutant,
                super::sci(d.error_vs_mutant)
            ),
            None => String::new(),
        }
    }
}

/// The reference's name of an engine point: `name` or `layers.<i>.name`.
pub fn point_name(p: &TracePoint) -> String {
    match p.layer {
        Some(i) => format!("layers.{i}.{}", p.name),
        None => p.name.clone(),
    }
}

/// The reference names of the graph's required points for `n_layers` layers.
pub fn required_points(graph: &Graph, n_layers: usize) -> Vec<String> {
    let mut out = Vec::new();
    for r in &graph.trace_required {
        if graph.prologue.iter().any(|n| &n.name == r) {
            out.push(r.clone());
        }
    }
    for i in 0..n_layers {
        for r in &graph.trace_required {
            if graph.layer.iter().any(|n| &n.name == r) {
                out.push(format!("layers.{i}.{r}"));
            }
        }
    }
    for r in &graph.trace_required {
        if graph.epilogue.iter().any(|n| &n.name == r) {
            out.push(r.clone());
        }
    }
    out
}

/// Compare the engine's points with the reference's trace of the same token, in the reference's
/// order, at `tol` (the gate's logit tolerance, `atol + rtol * |reference|` per element). Fills
/// the point fields of `out` (the caller sets prompt, step, phase, position) and returns whether
/// a point diverged. `engine` holds (point, values) in the engine's order; a point the engine
/// reports twice is judged by its first report.
pub fn compare_traces(
    engine: &[(TracePoint, Vec<f32>)],
    reference: &Trace,
    required: &[String],
    tol: &Tolerance,
    out: &mut Localisation,
) -> bool {
    let named: Vec<(String, &Vec<f32>)> = engine.iter().map(|(p, v)| (point_name(p), v)).collect();
    let find = |name: &str| named.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    out.unknown =
        named.iter().filter(|(n, _)| !reference.iter().any(|(r, _)| r == n)).map(|(n, _)| n.clone()).collect();
    out.unknown.dedup();
    out.missing_required = required.iter().filter(|r| find(r).is_none()).cloned().collect();
    out.compared = 0;
    for (name, want) in reference {
        let Some(got) = find(name) else { continue };
        out.compared += 1;
        let v = oracle::compare(got, want, tol);
        if !v.ok {
            out.point = name.clone();
            let (layer, node) = match name.strip_prefix("layers.").and_then(|r| r.split_once('.')) {
                Some((i, n)) => (i.parse().ok(), n.to_string()),
                None => (None, name.clone()),
            };
            out.layer = layer;
            out.node = node;
            out.max_abs_err = v.max_abs_err;
            out.reference_max_abs = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            out.worst_index = v.worst_index;
            if got.len() != want.len() {
                out.note = format!(
                    "the engine's `{name}` has {} values, the reference's {}: check the shape the graph gives this node",
                    got.len(),
                    want.len()
                );
            }
            return true;
        }
        out.last_agreeing = name.clone();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tol() -> Tolerance {
        Tolerance { atol: 1e-4, rtol: 1e-4, reasoning: String::new() }
    }

    fn p(layer: Option<usize>, name: &str) -> TracePoint {
        TracePoint { layer, name: name.into() }
    }

    #[test]
    fn first_point_in_graph_order_beyond_tolerance_is_named() {
        let reference: Trace = vec![
            ("embed".into(), vec![1.0, 2.0]),
            ("layers.0.q".into(), vec![0.5, 0.5]),
            ("layers.0.attn_residual".into(), vec![3.0, 4.0]),
            ("logits".into(), vec![9.0, 1.0]),
        ];
        // Reported out of order, with q off by 0.01 and the residual off by more.
        let engine = vec![
            (p(Some(0), "attn_residual"), vec![3.5, 4.0]),
            (p(None, "embed"), vec![1.0, 2.0]),
            (p(Some(0), "q"), vec![0.5, 0.51]),
            (p(Some(0), "extra"), vec![0.0]),
        ];
        let required = vec!["embed".to_string(), "layers.0.attn_residual".into(), "logits".into()];
        let mut out = Localisation::default();
        assert!(compare_traces(&engine, &reference, &required, &tol(), &mut out));
        assert_eq!(out.point, "layers.0.q");
        assert_eq!((out.layer, out.node.as_str()), (Some(0), "q"));
        assert!((out.max_abs_err - 0.01).abs() < 1e-6, "{}", out.max_abs_err);
        assert_eq!(out.reference_max_abs, 0.5);
        assert_eq!(out.worst_index, 1);
        assert_eq!(out.last_agreeing, "embed");
        assert_eq!(out.missing_required, vec!["logits".to_string()]);
        assert_eq!(out.unknown, vec!["layers.0.extra".to_string()]);
    }

    #[test]
    fn agreeing_points_localise_nothing_and_a_wrong_length_is_said() {
        let reference: Trace = vec![("embed".into(), vec![1.0, 2.0]), ("logits".into(), vec![9.0, 1.0])];
        let engine = vec![(p(None, "embed"), vec![1.0, 2.0]), (p(None, "logits"), vec![9.0, 1.00001])];
        let mut out = Localisation::default();
        assert!(!compare_traces(&engine, &reference, &[], &tol(), &mut out));
        assert_eq!((out.point.as_str(), out.compared), ("", 2));
        let engine = vec![(p(None, "embed"), vec![1.0])];
        let mut out = Localisation::default();
        assert!(compare_traces(&engine, &reference, &[], &tol(), &mut out));
        assert!(out.note.contains("1 values, the reference's 2"), "{}", out.note);
    }
}
