//! The traced rerun of a failing step: the engine's `forward_traced` against the reference's
//! trace, point by point, to localise where the forward first differs.

use std::path::Path;

use crate::gate::Gate;
use crate::localise::Localisation;
use base::error::Result;
use harness::protocol::{Command, Reply};
use oracle::llama::Reference;

/// What the traced rerun of a failing step needs of the gate: its harness and what it may read.
pub(super) struct Traced<'g, 'a> {
    pub(super) gate: &'g Gate<'a>,
    pub(super) h: &'g crate::gate::Harness,
    pub(super) reads: &'g [&'g Path],
    pub(super) model: &'g Path,
}

/// Rerun the failing step traced: the engine's `forward_traced` (harness command `trace`) and the
/// reference's `step_traced` on the engine's own ids and tokens up to `at.step`, compared point by
/// point ([`crate::localise::compare_traces`]). Always returns a localisation, with a note that
/// says what was found or why nothing could be localised.
///
/// # Errors
/// The reference's own errors (a token outside the vocabulary).
#[allow(clippy::too_many_arguments)]
pub(super) fn localise_step(
    t: &Traced<'_, '_>,
    reference: &mut Reference,
    graph: Option<&ckb::Graph>,
    ids: &[u32],
    tokens: &[u32],
    tokenizer_ok: bool,
    tol: &ckb::Tolerance,
    mut at: Localisation,
) -> Result<Localisation> {
    let run: Vec<u32> = ids.iter().chain(tokens.iter().take(at.step)).copied().collect();
    let not = |mut at: Localisation, why: String| {
        at.note = why;
        Ok(at)
    };
    if !matches!(t.gate.mode, crate::gate::Mode::Direct) {
        return not(at, "not localised: this call judged a bundle run elsewhere; verify the engine directly to localise the mismatch".into());
    }
    if !t.gate.target.spec.items.iter().any(|i| i == "forward_traced") {
        return not(at, "not localised: the engine has no Model::forward_traced (its family contract's rust skeleton; scaffold shows it): add it to learn the layer and point where the forward first differs".into());
    }
    let (Some(graph), true) = (graph, reference.is_graph()) else {
        return not(at, "not localised: the family contract has no [model.graph] to trace the reference by".into());
    };
    if run.is_empty() || run.len() > reference.config().max_seq {
        return not(at, format!("not localised: {} tokens to rerun", run.len()));
    }
    let path = t.h.output("trace.safetensors");
    let command = Command::Trace { model: t.model.to_path_buf(), tokens: run.clone(), tensors: path.clone() };
    let called = t.gate.call(t.h, command, &[], t.reads)?;
    let points = match called.ok("engine's traced forward", 1500) {
        Ok(Reply::Trace { missing: Some(why), .. }) => return not(at, format!("not localised: {why}")),
        Ok(Reply::Trace { points, missing: None }) => points,
        Ok(other) => return not(at, format!("not localised: the harness answered the trace with {other:?}")),
        Err(why) => return not(at, format!("not localised: {why}")),
    };
    let words = match t.h.output_words(&path) {
        Ok((_, w)) => w,
        Err(e) => {
            return not(at, format!("not localised: the traced forward wrote no readable tensors: {}", e.message));
        }
    };
    let engine: Vec<(harness::protocol::TracePoint, Vec<f32>)> = points
        .into_iter()
        .enumerate()
        .map(|(k, p)| {
            let v = words.get(&format!("point.{k}")).map(|w| w.iter().map(|&b| f32::from_bits(b)).collect());
            (p, v.unwrap_or_default())
        })
        .collect();
    reference.reset();
    let (last, before) = run.split_last().expect("run is not empty");
    for &tok in before {
        reference.step(tok)?;
    }
    let (_, trace) = reference.step_traced(*last)?;
    let required = crate::localise::required_points(graph, reference.config().n_layers);
    let diverged = crate::localise::compare_traces(&engine, &trace, &required, tol, &mut at);
    let missing = if at.missing_required.is_empty() {
        String::new()
    } else {
        format!(
            " (the engine did not report {} required point(s), e.g. {}: report every trace_required point)",
            at.missing_required.len(),
            at.missing_required[0]
        )
    };
    at.note = if diverged {
        let node = [&graph.prologue, &graph.layer, &graph.epilogue].into_iter().flatten().find(|n| n.name == at.node);
        let what = node.map_or(String::new(), |n| {
            let kernel = ckb::GRAPH_OPS.iter().find(|o| o.name == n.op).and_then(|o| o.kernel);
            format!(
                "`{}` is op {}{} of inputs {}",
                n.name,
                n.op,
                kernel.map_or(String::new(), |k| format!(" ({k})")),
                if n.inputs.is_empty() { "-".into() } else { n.inputs.join(", ") }
            )
        });
        let prior = if at.note.is_empty() { String::new() } else { format!("{}; ", at.note) };
        // Attention also reads the rows earlier positions left in the KV cache: with its own
        // inputs agreeing, those rows are the first suspects.
        let cache = if node.is_some_and(|n| ckb::is_attention(&n.op)) {
            "; attention also reads the K/V rows of earlier positions, so check what the cache holds (component.kv_cache: row p written at position p, rows 0..=pos read)"
        } else {
            ""
        };
        // The mutants compared where the engine first differs: the one whose own value there is
        // the engine's names the first mistake, whatever a later one does to the logits.
        let got = engine.iter().find(|(p, _)| crate::localise::point_name(p) == at.point).map(|(_, v)| v.as_slice());
        if let Some(got) = got {
            at.mutants =
                oracle::diagnose::at_point(&t.gate.ctx.ckb, reference, &run, &at.point, got, at.max_abs_err, tol);
        }
        format!(
            "{prior}{what}: every earlier point the engine reported agrees, so the step into this point is where the engine differs{cache}{missing}"
        )
    } else if at.compared == 0 {
        format!("not localised: the engine's traced forward reported no point the reference knows{missing}")
    } else if !tokenizer_ok {
        format!(
            "the traced forward agrees with the reference at all {} points on the engine's own ids: the mismatch comes from the tokenizer (the engine's prompt ids differ from HF's){missing}",
            at.compared
        )
    } else if at.step == 0 {
        format!(
            "forward_traced, run token by token, agrees with the reference at all {} points, but prefill's logits did not: the mismatch is in Model::prefill's own path, not in forward{missing}",
            at.compared
        )
    } else {
        format!(
            "forward_traced, run token by token, agrees with the reference at all {} points on these tokens, but the engine's decode step did not: the difference comes from the KV cache prefill left, or forward_traced does not run what forward runs{missing}",
            at.compared
        )
    };
    Ok(at)
}
