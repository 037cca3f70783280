//! Diagnosis of a failed gate: which known failure mode explains the engine's output.
//!
//! Every failure-mode contract with a `mutant` names a known-wrong variant of the oracle (a kernel's
//! core with one fault, in the kernel registry `oracle::kernels`, or a model-level mutation,
//! `oracle::mutants`). When a kernel fails its test, the server recomputes the expected output of
//! each mutant of that kernel's failure modes on the same drawn inputs; when generation fails, it
//! reruns the reference forward pass with each model-level mutation, and each graph rewrite of a
//! failure contract of the family (`rewrite`: nodes skipped, parameters replaced, chained nodes
//! swapped, weights bound as a mistaken loader binds them), on the engine's own tokens. A
//! mutant that reproduces the engine's output while the true oracle does not is reported as a
//! [`Diagnosis`]: the failure id and the evidence. No mutant explaining it: no diagnosis.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::graph::Trace;
use crate::kernels::{self, Case};
use crate::llama::Reference;
use crate::mutants::{Mutation, Mutations};
use crate::{UNWRITTEN, Verdict, compare_prediction, judge_prediction};
use ckb::{Ckb, Contract, Kind, Tolerance};

/// A failure mode that explains a failed gate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Diagnosis {
    /// Failure-mode contract id, e.g. `failure.rope-adjacent-pairs` (see lookup_contract).
    pub failure: String,
    /// The oracle mutant that reproduces the engine's output, e.g. `rope_adjacent`.
    pub mutant: String,
    /// Largest |engine - true oracle| over the compared cases or logit rows ([`UNWRITTEN`] for
    /// NaN/inf/missing output).
    pub error_vs_oracle: f64,
    /// Largest |engine - mutant| over the same cases or rows (0 where both are the same NaN/inf).
    pub error_vs_mutant: f64,
    /// The failure in one line: what is wrong and how to fix it.
    pub summary: String,
    /// Whether the mutant reproduces the engine's output (true), or only first departs from the
    /// reference where the engine does, at the same step and point, without reproducing its values
    /// (false: a suspect, see [`where_it_departs`]).
    #[serde(default = "exact_default")]
    pub exact: bool,
}

fn exact_default() -> bool {
    true
}

impl Diagnosis {
    /// One line for text reports.
    pub fn line(&self) -> String {
        if !self.exact {
            return format!("diagnosis (suspect): {} ({}). {}", self.failure, self.mutant, self.summary);
        }
        format!(
            "diagnosis: {} (output matches mutant {}: max abs error {:.2e} vs it, {:.2e} vs the oracle). {}",
            self.failure, self.mutant, self.error_vs_mutant, self.error_vs_oracle, self.summary
        )
    }
}

fn diagnosis(c: &Contract, mutant: &str, error_vs_oracle: f64, error_vs_mutant: f64) -> Diagnosis {
    let fix = c.failure.as_ref().map(|f| f.fix.as_str()).unwrap_or_default();
    let summary = format!("{} Fix: {fix}", c.summary).split_whitespace().collect::<Vec<_>>().join(" ");
    let finite = |x: f64| if x.is_finite() { x.min(UNWRITTEN) } else { UNWRITTEN };
    Diagnosis {
        failure: c.id.clone(),
        mutant: mutant.to_string(),
        error_vs_oracle: finite(error_vs_oracle),
        error_vs_mutant: finite(error_vs_mutant),
        summary,
        exact: true,
    }
}

/// The failure contract whose `mutant` is `name`, if the CKB has one.
pub fn failure_of_mutant<'a>(ckb: &'a Ckb, name: &str) -> Option<&'a Contract> {
    ckb.of_kind(Kind::Failure).find(|c| c.failure.as_ref().and_then(|f| f.mutant.as_deref()) == Some(name))
}

/// One case of a kernel test as the diagnosis needs it: the drawn inputs, the engine's output and
/// how it fared against the true oracle.
pub struct KernelCase<'a> {
    /// The drawn case.
    pub case: &'a Case,
    /// The engine's output tensor `out` as raw words (f32 bits, or the index for argmax).
    pub out: &'a [u32],
    /// Its verdict against the true oracle.
    pub oracle: Verdict,
}

/// Diagnose a failed kernel. `cases` are the cases where the engine produced an output (cases that
/// panicked or wrote nothing are left out: they say nothing about which formula the engine computes).
///
/// Rule: a failure mode of the kernel contract (its `failure_modes`) explains the failure when its
/// mutant exists for this kernel in the registry, the engine's output is within the contract's
/// tolerance of the mutant on every case, and on at least one of them it is outside the tolerance
/// of the true oracle. Several can be reported (best match first); none when nothing explains the
/// output.
pub fn kernel(ckb: &Ckb, contract: &Contract, cases: &[KernelCase], tol: &Tolerance) -> Vec<Diagnosis> {
    if cases.is_empty() || cases.iter().all(|c| c.oracle.ok) {
        return vec![];
    }
    let mut found = Vec::new();
    for fid in &contract.failure_modes {
        let Ok(fc) = ckb.get(fid) else { continue };
        let Some(name) = fc.failure.as_ref().and_then(|f| f.mutant.as_deref()) else { continue };
        let Some(mutant) = kernels::mutant(&contract.id, name) else { continue };
        let (mut err_m, mut err_o, mut all_ok) = (0.0f64, 0.0f64, true);
        for c in cases {
            let Some(want) = (mutant.expect)(c.case) else {
                all_ok = false;
                break;
            };
            let v = judge_prediction(c.out, &want, tol);
            all_ok &= v.ok;
            err_m = err_m.max(v.max_abs_err);
            err_o = err_o.max(c.oracle.max_abs_err);
        }
        if all_ok {
            found.push(diagnosis(fc, name, err_o, err_m));
        }
    }
    found.sort_by(|a, b| a.error_vs_mutant.total_cmp(&b.error_vs_mutant));
    found
}

/// Logit rows compared when diagnosing generation: enough to see any of the model-level mutants
/// (they all change the logits within the first few positions), few enough that a large model's f64
/// reference forward, rerun once per mutation, stays affordable.
pub const GENERATION_ROWS: usize = 8;

/// Whether a model-level mutation can change this model's logits at all (a mutation that computes
/// exactly the true forward pass for this config cannot be told apart and is not tried).
pub fn distinguishable(m: Mutation, r: &Reference) -> bool {
    let c = r.config();
    match m {
        Mutation::RopeThetaDefault => c.rope_theta != kernels::rope::DEFAULT_THETA,
        Mutation::GqaModulo => c.n_kv_heads > 1 && c.n_kv_heads < c.n_heads,
        Mutation::GeluErf => r.has_op("gelu_tanh_and_mul") || r.has_op("gelu_tanh"),
        Mutation::LayerNormNoMean => r.has_op("layer_norm"),
        Mutation::RotaryFreqOverHeadDim => r.has_partial_rotary(),
        Mutation::MoeNoRenorm => r.has_router(true),
        Mutation::MoeSoftmaxOverTopk => r.has_router(false),
        Mutation::MoeExpertOffByOne => r.has_op("moe_route"),
        Mutation::MoeUnweighted => r.has_op("moe_experts"),
        Mutation::SinksDropped => r.has_op("attention_sinks"),
        Mutation::MoeGateUpHalves | Mutation::SwigluUnclamped => r.has_op("moe_experts_clamped"),
        _ => true,
    }
}

/// Run the reference (with mutations `m`) teacher-forced over `ids` then `tokens`, comparing each
/// logit row with the engine's as it goes: (largest error, every row within tolerance, largest
/// |logit| of the reference). Stops early, with what it has, once a row is outside tolerance and
/// the error exceeds `give_up`: such a mutant can no longer explain the engine. `None` when the
/// reference refuses a token or position.
fn run_forced(
    reference: &mut Reference,
    m: Mutations,
    ids: &[u32],
    tokens: &[u32],
    logits: &[f32],
    tol: &Tolerance,
    give_up: f64,
) -> Option<(f64, bool, f64)> {
    let vocab = reference.config().vocab;
    reference.set_mutations(m);
    let mut row = Vec::new();
    for &t in ids {
        row = reference.step(t).ok()?;
    }
    let (mut max, mut ok, mut scale) = (0.0f64, true, 0.0f64);
    for (i, &t) in tokens.iter().enumerate() {
        let got = logits.get(i * vocab..(i + 1) * vocab)?;
        let v = compare_prediction(got, &row, tol);
        max = max.max(v.max_abs_err);
        ok &= v.ok;
        scale = row.iter().fold(scale, |a, v| a.max(v.abs()));
        if (!ok && max > give_up) || i + 1 == tokens.len() {
            break;
        }
        row = reference.step(t).ok()?;
    }
    Some((max, ok, scale))
}

/// Diagnose failing logits of one prompt. `ids` are the engine's prompt ids, `tokens` its generated
/// tokens and `logits` its rows (`vocab` values per generated token). The reference is run
/// teacher-forced on the engine's own tokens (so a divergence in choices does not matter), first as
/// it is and then with each model-level mutation, over the first [`GENERATION_ROWS`] rows.
///
/// Rule: with e_ref the largest |engine - reference| logit error and e_m the one against mutation m,
/// m explains the failure when e_ref is outside the family tolerance and either every compared
/// logit is within the tolerance of the mutant, or e_m <= e_ref / 10 and e_m is within ten times
/// the tolerance (e_m <= 10 (atol + rtol max|mutant logit|)), which allows for an engine whose
/// mistake is the mutant's in substance but accumulates differently. Only mutations with a failure
/// contract in the CKB, and that can change this model's logits, are tried; then, by the same rule,
/// the graph rewrites of the failure contracts that apply to the family (its `failure_modes`, or
/// their `applies_to` naming it) and whose nodes its graph has (e.g. q/k norm skipped, embedding
/// scale missing, soft-cap missing). Best match first; empty
/// when the reference itself matches the engine on its own tokens (e.g. a tokenizer mistake) or no
/// mutation explains the logits. The reference is left as it was given (mutations and all).
pub fn generation(
    ckb: &Ckb,
    reference: &mut Reference,
    ids: &[u32],
    tokens: &[u32],
    logits: &[f32],
    tol: &Tolerance,
) -> Vec<Diagnosis> {
    let vocab = reference.config().vocab;
    let n = tokens.len().min(logits.len() / vocab.max(1)).min(GENERATION_ROWS);
    if n == 0 || ids.is_empty() || ids.iter().chain(&tokens[..n]).any(|&t| t as usize >= vocab) {
        return vec![];
    }
    let (ids, tokens, logits) = (ids, &tokens[..n], &logits[..n * vocab]);
    let before = reference.mutations();
    let mut found = Vec::new();
    if let Some((e_ref, false, _)) = run_forced(reference, Mutations::NONE, ids, tokens, logits, tol, f64::INFINITY) {
        // The rule above: every row within the mutant's tolerance, or ten times closer to it than
        // to the reference and within ten times the tolerance.
        let explains =
            |e_m: f64, ok: bool, scale: f64| ok || (e_m * 10.0 <= e_ref && e_m <= 10.0 * (tol.atol + tol.rtol * scale));
        for (fc, variant) in candidates(ckb, reference) {
            if !variant.set(reference) {
                continue;
            }
            let m = reference.mutations();
            let run = run_forced(reference, m, ids, tokens, logits, tol, e_ref / 10.0);
            variant.clear(reference);
            if let Some((e_m, ok, scale)) = run
                && explains(e_m, ok, scale)
            {
                found.push(diagnosis(fc, &variant.name(), e_ref, e_m));
            }
        }
    }
    reference.set_mutations(before);
    found.sort_by(|a, b| a.error_vs_mutant.total_cmp(&b.error_vs_mutant));
    found
}

/// A model-level mutant of the reference: a mutation, or a failure contract's graph rewrite.
enum Variant<'a> {
    Mutation(Mutation),
    Rewrite(&'a ckb::GraphRewrite),
}

impl Variant<'_> {
    /// The name a diagnosis gives it: the mutant's, or `graph rewrite: <the rewrite in words>`.
    fn name(&self) -> String {
        match self {
            Variant::Mutation(m) => m.name().to_string(),
            Variant::Rewrite(r) => format!("graph rewrite: {}", r.describe()),
        }
    }

    /// Turn the reference into this mutant; false when it does not apply (nothing changed).
    fn set(&self, reference: &mut Reference) -> bool {
        match self {
            Variant::Mutation(m) => {
                reference.set_mutations(Mutations::of(&[*m]));
                true
            }
            Variant::Rewrite(r) => matches!(reference.set_rewrite(Some(r)), Ok(true)),
        }
    }

    /// The reference as it was before [`Variant::set`].
    fn clear(&self, reference: &mut Reference) {
        reference.set_mutations(Mutations::NONE);
        let _ = reference.set_rewrite(None);
    }
}

/// Run `f` on the reference turned into each model-level mutant diagnosis tries (the order of
/// [`generation`]'s candidates), returning (failure contract id, mutant name, `f`'s result) for
/// each that applies; the reference is left as the true forward pass.
pub fn for_each_mutant<T>(
    ckb: &Ckb,
    reference: &mut Reference,
    mut f: impl FnMut(&mut Reference) -> T,
) -> Vec<(String, String, T)> {
    let mut out = Vec::new();
    for (fc, variant) in candidates(ckb, reference) {
        if !variant.set(reference) {
            continue;
        }
        reference.reset();
        let v = f(reference);
        variant.clear(reference);
        out.push((fc.id.clone(), variant.name(), v));
    }
    reference.reset();
    out
}

/// The model-level mutants tried, in order: each mutation with a failure contract that can change
/// this model's logits, then the graph rewrites of the failure contracts that apply to the family
/// (its `failure_modes`, or their `applies_to` naming it).
fn candidates<'a>(ckb: &'a Ckb, reference: &Reference) -> Vec<(&'a Contract, Variant<'a>)> {
    let mut out = Vec::new();
    for m in Mutation::ALL {
        if let Some(fc) = failure_of_mutant(ckb, m.name())
            && distinguishable(m, reference)
        {
            out.push((fc, Variant::Mutation(m)));
        }
    }
    let family = &reference.config().family;
    let listed = |id: &str| ckb.get(family).is_ok_and(|c| c.failure_modes.iter().any(|f| f == id));
    for fc in ckb.of_kind(Kind::Failure) {
        let Some(f) = fc.failure.as_ref() else { continue };
        let Some(rewrite) = f.rewrite.as_ref() else { continue };
        if listed(&fc.id) || f.applies_to.contains(family) {
            out.push((fc, Variant::Rewrite(rewrite)));
        }
    }
    out
}

/// Diagnose at the first diverging point of a traced step (see `ops::localise`): `run` is every
/// token the engine consumed up to and including the traced one, `point` the trace name where the
/// engine first left the reference (`layers.0.q_norm`), `got` the engine's values there and
/// `error_vs_oracle` their largest error against the reference.
///
/// Rule: a mutant explains the point when its own traced run over the same tokens gives values at
/// that point within the tolerance of the engine's. This names the first mistake even when a later
/// one (a second bug) keeps every mutant from matching the logits. Best match first; the reference
/// is left as the true forward pass.
pub fn at_point(
    ckb: &Ckb,
    reference: &mut Reference,
    run: &[u32],
    point: &str,
    got: &[f32],
    error_vs_oracle: f64,
    tol: &Tolerance,
) -> Vec<Diagnosis> {
    let Some((last, before)) = run.split_last() else { return vec![] };
    let mut found = Vec::new();
    for (fc, variant) in candidates(ckb, reference) {
        if !variant.set(reference) {
            continue;
        }
        let mut traced = || -> base::error::Result<Option<Vec<f64>>> {
            for &t in before {
                reference.step(t)?;
            }
            let (_, trace) = reference.step_traced(*last)?;
            Ok(trace.into_iter().find(|(name, _)| name == point).map(|(_, v)| v))
        };
        let want = traced();
        variant.clear(reference);
        let Ok(Some(want)) = want else { continue };
        if want.len() != got.len() {
            continue;
        }
        let v = compare_prediction(got, &want, tol);
        if v.ok {
            found.push(diagnosis(fc, &format!("{} (at {point})", variant.name()), error_vs_oracle, v.max_abs_err));
        }
    }
    found.sort_by(|a, b| a.error_vs_mutant.total_cmp(&b.error_vs_mutant));
    found
}

/// The reference's logit rows of steps 0..=`step` and its trace at the last token, teacher-forced on
/// `ids` then `tokens[..step]` (step k's row is the logits after the prompt's last token and k
/// generated ones). None when the reference refuses a token.
fn forced_rows(reference: &mut Reference, ids: &[u32], tokens: &[u32], step: usize) -> Option<(Vec<Vec<f64>>, Trace)> {
    let run: Vec<u32> = ids.iter().chain(&tokens[..step.min(tokens.len())]).copied().collect();
    let (last, before) = run.split_last()?;
    reference.reset();
    let mut rows = Vec::new();
    for (i, &t) in before.iter().enumerate() {
        let row = reference.step(t).ok()?;
        if i + 1 >= ids.len() {
            rows.push(row);
        }
    }
    let (row, trace) = reference.step_traced(*last).ok()?;
    rows.push(row);
    reference.reset();
    Some((rows, trace))
}

/// The first point, in the trace's (graph) order, where `a` departs from `b` beyond `tol`.
fn first_departure(a: &Trace, b: &Trace, tol: &Tolerance) -> Option<String> {
    a.iter()
        .zip(b)
        .find(|((_, x), (_, y))| !compare_prediction(&x.iter().map(|&v| v as f32).collect::<Vec<_>>(), y, tol).ok)
        .map(|((n, _), _)| n.clone())
}

/// When no mutant reproduces the engine (two mistakes, or one the mutants make only in a simpler
/// form, such as a KV row written at a wrong position into a cache that is not empty), name the
/// suspects: the failure contracts whose mutants first depart from the reference where the engine
/// does: at generation step `step`, at the same trace point `point` when the engine's traced forward
/// located it (whatever the mutant did at earlier steps: a mistake made only in decode, say, and the
/// mutant's made everywhere, still first show at the same node), else first at that step (earlier
/// steps agreeing with the reference, as the engine's did).
/// Each is a [`Diagnosis`] with `exact: false`. When no mutant departs there first, one entry says
/// where the engine departs and that the knowledge base has no name for that mistake yet: the list is
/// never empty, unless the engine's logits at `step`, teacher-forced on its own tokens, agree with
/// the reference's (the mismatch is then not in the forward pass: its prompt ids). `ids`, `tokens`,
/// `logits` as in [`generation`]; the reference is left as it was given.
#[allow(clippy::too_many_arguments)]
pub fn where_it_departs(
    ckb: &Ckb,
    reference: &mut Reference,
    ids: &[u32],
    tokens: &[u32],
    logits: &[f32],
    step: usize,
    point: Option<&str>,
    tol: &Tolerance,
) -> Vec<Diagnosis> {
    let vocab = reference.config().vocab;
    let phase = if step == 0 { "prefill".to_string() } else { format!("decode step {step}") };
    let at = match point {
        Some(p) => format!("{phase}, at {p}"),
        None => phase.clone(),
    };
    let unnamed = || Diagnosis {
        failure: String::new(),
        mutant: String::new(),
        error_vs_oracle: 0.0,
        error_vs_mutant: 0.0,
        summary: format!(
            "the engine first departs from the reference at {at}, and no failure contract's mutant departs there first: a mistake the knowledge base has no name for yet (look at what this step computes there; evolve_knowledge clusters such outcomes by point)"
        ),
        exact: false,
    };
    let before = reference.mutations();
    reference.set_mutations(Mutations::NONE);
    let Some((truth, true_trace)) = forced_rows(reference, ids, tokens, step) else { return vec![unnamed()] };
    let engine_row = logits.get(step * vocab..(step + 1) * vocab);
    // On its own tokens the engine may agree with the reference (the prompt's ids differ: the
    // tokenizer): then nothing in the forward pass is suspect.
    if engine_row.is_some_and(|g| compare_prediction(g, &truth[step], tol).ok) {
        reference.set_mutations(before);
        return vec![];
    }
    let mut found = Vec::new();
    for (fc, variant) in candidates(ckb, reference) {
        if !variant.set(reference) {
            continue;
        }
        let rows = forced_rows(reference, ids, tokens, step);
        variant.clear(reference);
        let Some((rows, trace)) = rows else { continue };
        let departs = |k: usize| {
            let got: Vec<f32> = rows[k].iter().map(|&v| v as f32).collect();
            !compare_prediction(&got, &truth[k], tol).ok
        };
        match point {
            // Located: at this step the mutant's forward first departs at the engine's point.
            Some(p) => {
                if first_departure(&trace, &true_trace, tol).as_deref() != Some(p) {
                    continue;
                }
            }
            // Not located: earlier steps agree (the engine's did) and this one departs.
            None => {
                if (0..step).any(departs) || !departs(step) {
                    continue;
                }
            }
        }
        let err = |want: &[f64]| {
            engine_row.map_or(UNWRITTEN, |g| g.iter().zip(want).fold(0.0f64, |m, (a, b)| m.max((*a as f64 - b).abs())))
        };
        let mut d = diagnosis(fc, &variant.name(), err(&truth[step]), err(&rows[step]));
        d.exact = false;
        d.summary = format!(
            "first departs from the reference where the engine does ({at}) without reproducing its values: a suspect, not a match. {}",
            d.summary
        );
        found.push(d);
    }
    reference.set_mutations(before);
    found.sort_by(|a, b| a.error_vs_mutant.total_cmp(&b.error_vs_mutant));
    if found.is_empty() {
        found.push(unnamed());
    }
    found
}
