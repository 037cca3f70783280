//! verify_generation as a gate spec: the harness commands, and the judgement of the engine's
//! generation against the reference (tokens, logits, stop tokens, diagnosis, localisation).

use std::path::{Path, PathBuf};

use super::results::divergence_kind;
use super::traced::{Traced, localise_step};
use super::vectors::{judge_vectors, tokenize_command};
use super::{Divergence, PromptResult, VerifyReport};
use crate::checkpoint::Checkpoint;
use crate::gate::{Commands, Gate, Harness, Promotion, Spec, Verdict as GateVerdict};
use crate::localise::Localisation;
use base::error::Result;
use ckb::Tolerance;
use harness::Called;
use harness::protocol::{self, Command, Prompt, Reply};
use ledger::figures::{Figures, VerifyFigures};
use oracle::llama::Reference;

/// verify_generation as a [`Spec`]: the checkpoint, its reference, the prompts and their budgets.
pub(super) struct VerifySpec<'c> {
    pub(super) ck: &'c Checkpoint,
    pub(super) family: &'c ckb::Contract,
    pub(super) m: &'c ckb::ModelFamily,
    pub(super) tol: Tolerance,
    pub(super) tokenizer_contract: String,
    pub(super) warnings: Vec<String>,
    pub(super) reference: Reference,
    /// Each prompt, and whether it was drawn (random).
    pub(super) prompts: Vec<(String, bool)>,
    /// Tokens to generate per prompt.
    pub(super) budgets: Vec<usize>,
    pub(super) seed: u64,
    pub(super) dtype: String,
    /// The tokenizer contract's vocabularies the engine's tokenizer is checked on.
    pub(super) sets: Vec<model::tokenizer::VectorSet>,
    pub(super) vectors_skipped: Vec<String>,
    /// Where the harness writes the generation's tensors.
    pub(super) tensors_path: PathBuf,
    /// Which logits rows come back whole ([`harness::protocol::whole_row`]; 1: all).
    pub(super) logits_every: usize,
}

impl VerifySpec<'_> {
    /// What the harness may read: the model (granted by the run loop) and the vocabularies.
    fn vocabulary_dirs(&self) -> Vec<PathBuf> {
        self.sets.iter().map(|s| s.dir.clone()).collect()
    }

    /// A failed report with `prompts` judged and `error` as its error.
    fn failed(&self, gate: &Gate, error: String, prompts: Vec<PromptResult>) -> VerifyReport {
        VerifyReport {
            passed: false,
            seed: self.seed,
            family: self.family.id.clone(),
            dtype: self.dtype.clone(),
            atol: self.tol.atol,
            rtol: self.tol.rtol,
            prompts,
            error,
            diagnosis: vec![],
            localisation: None,
            rules: gate.findings.clone(),
            promotions: vec![],
            stop_tokens: self.ck.generation.eos_token_ids.clone(),
            tokenizer: self.tokenizer_contract.clone(),
            tokenizer_vectors: vec![],
            skipped: vec![],
            warnings: self.warnings.clone(),
            sandboxed: gate.ctx.workshop.sandboxed(),
        }
    }

    /// The engine gave no judgeable output: recorded with `divergence` "crash".
    fn crashed(&self, gate: &Gate, why: String) -> GateVerdict<VerifyReport> {
        let figures = VerifyFigures { gate: gate.common(), divergence: "crash".into(), ..Default::default() };
        GateVerdict { report: self.failed(gate, why, vec![]), figures: Figures::Verify(figures) }
    }
}

impl Spec for VerifySpec<'_> {
    type Report = VerifyReport;

    fn unjudged(&self, gate: &Gate, why: String) -> VerifyReport {
        self.failed(gate, why, vec![])
    }

    fn commands(&mut self, gate: &Gate, h: &Harness) -> Result<Commands> {
        self.tensors_path = h.output("generate.safetensors");
        let items: Vec<Prompt> = self
            .prompts
            .iter()
            .zip(&self.budgets)
            .map(|((p, _), n)| Prompt { text: p.clone(), max_new_tokens: *n })
            .collect();
        let command = Command::Generate {
            model: self.ck.path().to_path_buf(),
            prompts: items,
            tensors: self.tensors_path.clone(),
            stop_tokens: self.ck.generation.eos_token_ids.clone(),
            // 0 (not written) when every row comes back whole: the request as before the field.
            logits_every: if self.logits_every <= 1 { 0 } else { self.logits_every },
        };
        // The engine's tokenizer on the real vocabularies of its tokenizer contract, in the same
        // exchange (a bundle holds both requests).
        let mut commands = vec![(command, vec![])];
        if let Some(c) = tokenize_command(gate, h, &self.sets)? {
            commands.push((c, vec![]));
        }
        Ok(commands)
    }

    fn model(&self) -> Option<&base::beneath::HeldDir> {
        Some(&self.ck.held)
    }

    fn reads(&self) -> Vec<PathBuf> {
        self.vocabulary_dirs()
    }

    fn promotions(report: &mut VerifyReport) -> Option<&mut Vec<Promotion>> {
        Some(&mut report.promotions)
    }

    fn judge(&mut self, gate: &Gate, scratch: &Harness, mut c: Vec<Called>) -> Result<GateVerdict<VerifyReport>> {
        let ctx = gate.ctx;
        let (ck, m, tol, seed) = (self.ck, self.m, self.tol.clone(), self.seed);
        let (cfg, generation, tok) = (&ck.cfg, &ck.generation, ck.tokenizer()?);
        let family = self.family;
        let tokenized = if c.len() > 1 { c.pop() } else { None };
        let called = c.remove(0);
        let (texts, engine_stops) = match called.ok("engine's generation", 2000) {
            Ok(Reply::Generate { prompts: g, stop_tokens, .. }) if g.len() == self.prompts.len() => (g, stop_tokens),
            Ok(other) => {
                return Ok(
                    self.crashed(gate, format!("the harness answered generation with an unexpected reply: {other:?}"))
                );
            }
            Err(why) => return Ok(self.crashed(gate, harness::explain(&why, &gate.engine))),
        };
        // A reply without its tensors file (a harness killed mid-write, a bundle's output removed) is
        // a failed gate, not a fault of the server.
        let tensors_out = match scratch.output_words(&self.tensors_path) {
            Ok((_, t)) => t,
            Err(e) => {
                return Ok(
                    self.crashed(gate, format!("the engine's generation wrote no readable tensors: {}", e.message))
                );
            }
        };
        let mut warnings = std::mem::take(&mut self.warnings);
        // The engine's own stop tokens (component.sampler `stop_tokens`), when it has the function.
        let mut stop_error = String::new();
        match &engine_stops {
            Some(engine_stops) => {
                let (mut a, mut b) = (engine_stops.clone(), generation.eos_token_ids.clone());
                a.sort_unstable();
                a.dedup();
                b.sort_unstable();
                b.dedup();
                if a != b {
                    stop_error = format!(
                        "stop tokens: the engine's generate::stop_tokens gives {engine_stops:?}, {} says {:?} (component.sampler: generation_config.json eos_token_id, an int or a list, else config.json's)",
                        if generation.source.is_empty() {
                            "neither generation_config.json nor config.json names one; it"
                        } else {
                            &generation.source
                        },
                        generation.eos_token_ids
                    );
                }
            }
            None => warnings.push(format!(
                "the engine has no generate::stop_tokens (component.sampler v2); generation stopped at the server's stop tokens {:?}",
                generation.eos_token_ids
            )),
        }
        let (prompts, budgets, reference) = (&self.prompts, &self.budgets, &mut self.reference);
        let every = self.logits_every;
        let (sets, vectors_skipped) = (&self.sets, self.vectors_skipped.clone());
        let target_dtype = self.dtype.clone();
        let model_dir = ck.path().to_path_buf();
        let grant = ck.held.grant();
        let dirs: Vec<PathBuf> = sets.iter().map(|s| s.dir.clone()).collect();
        let mut reads: Vec<&Path> = grant.paths();
        reads.extend(dirs.iter().map(PathBuf::as_path));
        let mut results = Vec::new();
        // The engine's ids, tokens and logits for the first prompt whose logits failed, for the
        // diagnosis, with the prompt's index and its first step beyond tolerance.
        let mut first_fail: Option<FirstFail> = None;
        for (i, (prompt, random)) in prompts.iter().enumerate() {
            let mut r = PromptResult {
                prompt: prompt.clone(),
                random: *random,
                tokenizer_ok: false,
                tokens_ok: false,
                logits_ok: false,
                steps: 0,
                first_mismatch: -1,
                tie_at: -1,
                max_abs_err: 0.0,
                widened_atol: 0.0,
                first_divergence: -1,
                divergence_phase: String::new(),
                divergence: None,
                text: texts[i].text.clone(),
                reference_text: String::new(),
                decoded_text: String::new(),
                stopped_at_eos: false,
                error: String::new(),
            };
            let want_ids = model::hf_encode(tok, prompt)?;
            if want_ids.len() >= 2 && want_ids[0] == want_ids[1] && generation.bos_token_id == Some(want_ids[0]) {
                warnings.push(format!(
                    "prompt {prompt:?} begins with the BOS token's text, and the tokenizer adds BOS too: it encodes with BOS twice ({:?}...); HF encodes it the same way, so it is checked as given, but a model rarely saw a doubled BOS in training: drop the typed one",
                    &want_ids[..2]
                ));
            }
            let got_ids = tensors_out.get(&format!("prompt_ids.{i}")).cloned().unwrap_or_default();
            r.tokenizer_ok = got_ids == want_ids;
            let (rows, want_tokens) = reference.greedy_until(&want_ids, budgets[i], &generation.eos_token_ids)?;
            // The family's rounding margin: each step's atol grows with the f32 rounding error of this
            // checkpoint's own activations there (ckb::RoundingMargin).
            let margins: Vec<f64> = match &m.rounding_margin {
                Some(rm) if reference.set_f32_activations(true) => {
                    let mut seq = want_ids.clone();
                    seq.extend_from_slice(&want_tokens[..want_tokens.len().saturating_sub(1)]);
                    let rounded = reference.forced(&seq);
                    reference.set_f32_activations(false);
                    let rounded = rounded?;
                    rows.iter()
                        .zip(&rounded[want_ids.len() - 1..])
                        .map(|(a, b)| rm.factor * a.iter().zip(b).fold(0.0f64, |d, (x, y)| d.max((x - y).abs())))
                        .collect()
                }
                _ => vec![],
            };
            r.stopped_at_eos = want_tokens.len() < budgets[i]
                && want_tokens.last().is_some_and(|t| generation.eos_token_ids.contains(t));
            let got_tokens = tensors_out.get(&format!("tokens.{i}")).cloned().unwrap_or_default();
            let got_logits = tensors_out.get(&format!("logits.{i}")).cloned().unwrap_or_default();
            // Each step's tolerance: the family's, its atol widened by the step's rounding margin.
            let step_tol_of = |step: usize| match margins.get(step) {
                Some(&w) if w > tol.atol => Tolerance { atol: w, ..tol.clone() },
                _ => tol.clone(),
            };
            let got_logits: Vec<f32> = got_logits.iter().map(|&b| f32::from_bits(b)).collect();
            let vocab = cfg.vocab;
            // Whole rows of the steps `whole_row` names, in order; the others as their largest logits.
            let n_steps = got_tokens.len();
            let whole = |step: usize| protocol::whole_row(step, n_steps, every);
            let k = protocol::TOP_LOGITS.min(vocab);
            let top_ids = tensors_out.get(&format!("top_ids.{i}")).cloned().unwrap_or_default();
            let top_values: Vec<f32> = tensors_out
                .get(&format!("top_logits.{i}"))
                .map(|v| v.iter().map(|&b| f32::from_bits(b)).collect())
                .unwrap_or_default();
            let judged = want_tokens.len().min(n_steps).max(1);
            let whole_rows = (0..judged).filter(|&s| whole(s)).count();
            let mut logits_ok = got_logits.len() >= vocab * whole_rows
                && (every <= 1 || (top_ids.len() >= k * judged && top_values.len() == top_ids.len()));
            let mut tokens_ok = got_tokens.len() == want_tokens.len();
            // The first non-finite logit on either side (step, where): never a pass.
            let mut non_finite = None;
            let mut cursor = 0;
            for (step, want_row) in rows.iter().enumerate() {
                let step_tol = step_tol_of(step);
                // The step's verdict (worst_index a token id) and the engine's logit there.
                let (v, engine_at_worst) = if whole(step) {
                    let Some(got_row) = got_logits.get(cursor * vocab..(cursor + 1) * vocab) else {
                        break;
                    };
                    cursor += 1;
                    let v = oracle::compare(got_row, want_row, &step_tol);
                    (v, got_row.get(v.worst_index).map_or(f64::NAN, |&x| x as f64))
                } else {
                    let (Some(ids), Some(values)) =
                        (top_ids.get(step * k..(step + 1) * k), top_values.get(step * k..(step + 1) * k))
                    else {
                        break;
                    };
                    compare_top(ids, values, want_row, &step_tol)
                };
                r.steps = step + 1;
                if let Some(&w) = margins.get(step).filter(|&&w| w > tol.atol) {
                    r.widened_atol = r.widened_atol.max(w);
                }
                if non_finite.is_none() {
                    non_finite = v.non_finite.map(|nf| (step, nf));
                }
                let ok = v.ok;
                r.max_abs_err = r.max_abs_err.max(v.max_abs_err);
                if !ok && r.first_divergence < 0 {
                    r.first_divergence = step as i64;
                    r.divergence_phase = if step == 0 { "prefill" } else { "decode" }.into();
                    r.divergence = Some(Divergence {
                        token: v.worst_index,
                        engine: engine_at_worst,
                        reference: want_row.get(v.worst_index).copied().unwrap_or(f64::NAN),
                    });
                }
                logits_ok &= ok;
                let (Some(&g), Some(&w)) = (got_tokens.get(step), want_tokens.get(step)) else {
                    break;
                };
                if g != w {
                    // A near-tie in the reference: the engine's choice is within tolerance of the best.
                    let best = want_row[w as usize];
                    let theirs = want_row.get(g as usize).copied().unwrap_or(f64::NEG_INFINITY);
                    if ok && best - theirs <= step_tol.atol + step_tol.rtol * best.abs() {
                        r.tie_at = step as i64;
                    } else {
                        tokens_ok = false;
                        r.first_mismatch = step as i64;
                    }
                    break;
                }
            }
            r.logits_ok = logits_ok && r.steps > 0;
            r.tokens_ok = tokens_ok && r.steps > 0;
            if !r.logits_ok && first_fail.is_none() {
                // The diagnosis reads rows from step 0 on: with rows left out, the first HEAD_ROWS
                // (all whole) only.
                let consecutive = if every <= 1 { n_steps } else { protocol::HEAD_ROWS.min(n_steps) };
                first_fail = Some(FirstFail {
                    ids: got_ids.clone(),
                    tokens: got_tokens.clone(),
                    logits: got_logits[..(consecutive * vocab).min(got_logits.len())].to_vec(),
                    prompt: i,
                    step: r.first_divergence.max(0) as usize,
                });
            }
            let mut all = got_ids.clone();
            all.extend_from_slice(&got_tokens);
            r.decoded_text = model::hf_decode(tok, &all).unwrap_or_default();
            let text_ok = r.decoded_text == r.text;
            let mut theirs = want_ids.clone();
            theirs.extend_from_slice(&want_tokens);
            r.reference_text = model::hf_decode(tok, &theirs).unwrap_or_default();
            let mut why = Vec::new();
            if !r.tokenizer_ok {
                why.push(format!("tokenizer: engine ids {got_ids:?} != HF ids {want_ids:?}"));
            }
            if !r.logits_ok {
                let at = match &r.divergence {
                    Some(d) => format!(
                        "; first beyond tolerance at step {} ({}): token {} engine {} reference {}",
                        r.first_divergence,
                        r.divergence_phase,
                        d.token,
                        crate::sci(d.engine),
                        crate::sci(d.reference)
                    ),
                    None => String::new(),
                };
                match non_finite {
                    Some((step, nf)) => why.push(format!(
                        "logits: {} of step {step} ({}); a non-finite logit never passes",
                        nf.describe().replace("at index", "at token"),
                        if step == 0 { "prefill" } else { "decode" }
                    )),
                    None => why.push(format!(
                        "logits: max abs error {} exceeds atol {} rtol {} (or missing rows){at}",
                        crate::sci(r.max_abs_err),
                        tol.atol,
                        tol.rtol
                    )),
                }
            }
            if !r.tokens_ok {
                why.push(format!(
                    "tokens: first mismatch at step {} (engine {:?} vs reference {:?})",
                    r.first_mismatch,
                    got_tokens.get(r.first_mismatch.max(0) as usize),
                    want_tokens.get(r.first_mismatch.max(0) as usize)
                ));
            }
            if !text_ok {
                why.push(format!("decode: engine text {:?} != HF decode of its ids {:?}", r.text, r.decoded_text));
            }
            r.error = why.join("; ");
            results.push(r);
        }
        let vectors = judge_vectors(sets, tokenized)?;
        let mut passed = results.iter().all(|r| r.error.is_empty())
            && stop_error.is_empty()
            && vectors.iter().all(|v| v.error.is_empty());
        let mut error = stop_error;
        let kernels_passed = ledger::Ledger::open(&ctx.ledger)
            .and_then(|l| l.passed_on("run_kernel_test", &gate.engine.hash, &target_dtype))
            .unwrap_or(false);
        if passed && !kernels_passed {
            // Phase order: generation passes only on sources whose kernels passed.
            passed = false;
            error = "phase order: generation matches the reference, but run_kernel_test has not passed on these exact sources over every kernel of the plan (a run limited to some kernels does not count); run it, then verify again".into();
        }
        let mut localisation = match &first_fail {
            Some(f) => {
                let at = Localisation {
                    prompt: f.prompt,
                    step: f.step,
                    phase: if f.step == 0 { "prefill" } else { "decode" }.into(),
                    position: (f.ids.len() + f.step).saturating_sub(1),
                    ..Default::default()
                };
                let traced = Traced { gate, h: scratch, reads: &reads, model: &model_dir };
                let tokenizer_ok = results.get(f.prompt).is_some_and(|r| r.tokenizer_ok);
                Some(localise_step(&traced, reference, m.graph.as_ref(), &f.ids, &f.tokens, tokenizer_ok, &tol, at)?)
            }
            None => None,
        };
        let mut diagnosis = match &first_fail {
            Some(f) => oracle::diagnose::generation(&ctx.ckb, reference, &f.ids, &f.tokens, &f.logits, &tol),
            None => vec![],
        };
        if diagnosis.is_empty() {
            // No mutant explains the logits (e.g. two mistakes): the one that explains the first
            // diverging point still names the first.
            diagnosis = localisation.as_ref().map(|l| l.mutants.clone()).unwrap_or_default();
        }
        if let (true, Some(f)) = (diagnosis.is_empty(), &first_fail) {
            // Nothing reproduces the engine: the suspects are the mutants that first depart where it
            // does (never an empty list for failing logits).
            let point = localisation.as_ref().map(|l| l.point.as_str()).filter(|p| !p.is_empty());
            diagnosis = oracle::diagnose::where_it_departs(
                &ctx.ckb, reference, &f.ids, &f.tokens, &f.logits, f.step, point, &tol,
            );
        }
        if ctx.ckb.is_provisional(&family.id) {
            // A mutant of a staged contract is no evidence about the model: the contract may be what is
            // wrong. Name where engine and contract part, never a change to the engine.
            let at_point = localisation.iter_mut().flat_map(|l| l.mutants.iter_mut());
            for d in diagnosis.iter_mut().chain(at_point) {
                d.summary = staged_summary(&d.summary, &family.id);
            }
        }
        let report = VerifyReport {
            passed,
            seed,
            family: family.id.clone(),
            dtype: target_dtype.clone(),
            atol: tol.atol,
            rtol: tol.rtol,
            prompts: results,
            error,
            diagnosis,
            localisation,
            rules: gate.findings.clone(),
            promotions: vec![],
            stop_tokens: generation.eos_token_ids.clone(),
            tokenizer: self.tokenizer_contract.clone(),
            tokenizer_vectors: vectors,
            skipped: vectors_skipped,
            warnings,
            sandboxed: ctx.workshop.sandboxed(),
        };
        let figures = VerifyFigures {
            gate: gate.common(),
            max_abs_err: report.prompts.iter().map(|p| p.max_abs_err).fold(0.0, f64::max),
            prompts: report.prompts.len(),
            diagnosis: report.diagnosis.iter().map(|d| d.failure.clone()).collect(),
            divergence: divergence_kind(&report),
            point: report.localisation.as_ref().map(|l| l.node.clone()).unwrap_or_default(),
        };
        Ok(GateVerdict { report, figures: Figures::Verify(figures) })
    }
}

/// A diagnosis's summary under a staged family `id` (no conformance evidence yet): what the failure
/// contract describes, without its fix, and why not.
fn staged_summary(summary: &str, id: &str) -> String {
    let what = summary.split(" Fix: ").next().unwrap_or(summary);
    format!(
        "{what} Not a fix: {id} is staged without conformance evidence, so the engine may be right and the \
         contract wrong (this mutant only departs from the contract as the engine does). Compare this point \
         with the model's own implementation (`ckb conformance` on its vectors) before changing either."
    )
}

/// One step's logits where only the engine's largest came back (`ids`, `values`, largest first):
/// each against the reference's logit at that token; and each token of the reference's own top
/// `ids.len()` that the list lacks and the reference puts above the list's smallest value, whose
/// engine logit is then at most that smallest value, so its error is at least the difference (taken
/// as the engine's value). A non-finite reference logit anywhere in the row fails, as it would in a
/// whole row (the engine's own non-finite logits are always among its largest:
/// `protocol::top_logits`). Returns the verdict, its `worst_index` a token id, and the engine's value
/// there. A token id outside the vocabulary fails as a missing reference value. A list that is not
/// distinct tokens, largest first (non-finite values first, as `protocol::top_logits` orders them),
/// fails at its first repeated or misplaced token ([`oracle::UNWRITTEN`] errors): a list repeating
/// the engine's largest would otherwise leave the reference's other top tokens unchecked.
fn compare_top(ids: &[u32], values: &[f32], want: &[f64], tol: &Tolerance) -> (oracle::Verdict, f64) {
    let finite = |v: f32| if v.is_finite() { v } else { f32::INFINITY };
    let repeated = ids.iter().enumerate().position(|(i, t)| ids[..i].contains(t));
    let misplaced = values.windows(2).position(|w| finite(w[0]) < finite(w[1])).map(|i| i + 1);
    if let Some(at) = [repeated, misplaced].into_iter().flatten().min().filter(|&at| at < values.len()) {
        let v = oracle::Verdict {
            max_abs_err: oracle::UNWRITTEN,
            max_rel_err: oracle::UNWRITTEN,
            worst_index: ids[at] as usize,
            ok: false,
            non_finite: None,
        };
        return (v, values[at] as f64);
    }
    let (mut tokens, mut got): (Vec<usize>, Vec<f32>) = (ids.iter().map(|&t| t as usize).collect(), values.to_vec());
    let floor = values.iter().copied().fold(f32::INFINITY, f32::min);
    let mut theirs: Vec<usize> = (0..want.len()).collect();
    let top = ids.len().min(want.len());
    if top > 0 && top < theirs.len() {
        theirs.select_nth_unstable_by(top - 1, |&a, &b| want[b].total_cmp(&want[a]));
    }
    for &t in &theirs[..top] {
        if !tokens.contains(&t) && floor.is_finite() && want[t] > floor as f64 {
            tokens.push(t);
            got.push(floor);
        }
    }
    if let Some(t) = want.iter().position(|w| !w.is_finite()).filter(|t| !tokens.contains(t)) {
        tokens.push(t);
        got.push(floor);
    }
    let expected: Vec<f64> = tokens.iter().map(|&t| want.get(t).copied().unwrap_or(f64::NAN)).collect();
    let mut v = oracle::compare(&got, &expected, tol);
    let at = v.worst_index.min(tokens.len().saturating_sub(1));
    let engine = got.get(at).map_or(f64::NAN, |&x| x as f64);
    v.worst_index = tokens.get(at).copied().unwrap_or(0);
    if let Some(nf) = v.non_finite.as_mut() {
        nf.index = tokens.get(nf.index).copied().unwrap_or(nf.index);
    }
    (v, engine)
}

/// The first prompt whose logits failed, as the engine ran it: for the diagnosis and the traced rerun.
struct FirstFail {
    /// The engine's prompt ids.
    ids: Vec<u32>,
    /// Its generated tokens.
    tokens: Vec<u32>,
    /// Its logits rows [tokens, vocab].
    logits: Vec<f32>,
    /// The prompt's index.
    prompt: usize,
    /// Its first step beyond tolerance.
    step: usize,
}

#[cfg(test)]
mod tests {
    use super::compare_top;
    use ckb::Tolerance;

    /// The reference's logits over five tokens; tolerance 1e-3 absolute.
    const WANT: [f64; 5] = [0.0, 5.0, 3.0, 4.0, 1.0];

    fn tol() -> Tolerance {
        Tolerance { atol: 1e-3, rtol: 0.0, reasoning: String::new() }
    }

    /// The engine's two largest against the reference, worked by hand.
    #[test]
    fn top_logits_are_judged_at_their_tokens_and_a_missing_top_token_is_caught() {
        // Right: tokens 1 and 3, values 5 and 4.
        let (v, _) = compare_top(&[1, 3], &[5.0, 4.0], &WANT, &tol());
        assert!(v.ok && v.max_abs_err == 0.0, "{v:?}");
        // Token 3 off by 0.5: named, with the engine's value there.
        let (v, engine) = compare_top(&[1, 3], &[5.0, 4.5], &WANT, &tol());
        assert!(!v.ok && v.worst_index == 3 && engine == 4.5 && (v.max_abs_err - 0.5).abs() < 1e-12, "{v:?}");
        // The engine's list lacks token 1, the reference's largest (5): its engine logit is at most
        // the list's smallest (3), an error of at least 2, named at token 1.
        let (v, engine) = compare_top(&[3, 2], &[4.0, 3.0], &WANT, &tol());
        assert!(!v.ok && v.worst_index == 1 && engine == 3.0 && (v.max_abs_err - 2.0).abs() < 1e-12, "{v:?}");
        // A NaN among the engine's largest: non-finite, at its token.
        let (v, _) = compare_top(&[1, 3], &[f32::NAN, 4.0], &WANT, &tol());
        assert!(!v.ok && v.non_finite.is_some_and(|nf| nf.index == 1), "{v:?}");
        // A token id outside the vocabulary fails.
        let (v, _) = compare_top(&[1, 9], &[5.0, 4.0], &WANT, &tol());
        assert!(!v.ok && v.worst_index == 9, "{v:?}");
        // A non-finite reference logit outside both lists still fails, named on the reference's side.
        let mut want = WANT;
        want[0] = f64::NEG_INFINITY;
        let (v, _) = compare_top(&[1, 3], &[5.0, 4.0], &want, &tol());
        assert!(!v.ok && v.non_finite.is_some_and(|nf| nf.index == 0 && nf.side == oracle::Side::Expected), "{v:?}");
        // The engine's largest repeated in place of its second: the reference's token 3 (4.0) would
        // go unchecked; the list fails at the repeat.
        let (v, engine) = compare_top(&[1, 1], &[5.0, 5.0], &WANT, &tol());
        assert!(!v.ok && v.worst_index == 1 && engine == 5.0 && v.max_abs_err == oracle::UNWRITTEN, "{v:?}");
        // Not largest first: fails at the misplaced token.
        let (v, _) = compare_top(&[3, 1], &[4.0, 5.0], &WANT, &tol());
        assert!(!v.ok && v.worst_index == 1, "{v:?}");
        // Non-finite values first are in order (and fail as non-finite).
        let (v, _) = compare_top(&[1, 3], &[f32::NEG_INFINITY, 4.0], &WANT, &tol());
        assert!(!v.ok && v.non_finite.is_some_and(|nf| nf.index == 1), "{v:?}");
    }

    /// The default for a large vocabulary: the 1B verify (prompts of 32, 32, 32 and 512 tokens,
    /// 128,256 logits a row: 513,024 bytes, so 24 MiB holds 49 rows). Each prompt keeps its first 8
    /// rows and its last (36 rows); every 37th step adds 13 rows of the long prompt (37, 74, ...,
    /// 481) and none of the short ones: 49. Every 36th adds 14 (36, ..., 504): 50, too many.
    #[test]
    fn the_default_logits_every_fits_the_rows_in_24_mib() {
        use super::super::logits_every_within;
        assert_eq!(logits_every_within(&[32, 32, 32, 512], 128_256, 24 << 20), 37);
        // BabyLlama's 105 tokens: every row fits.
        assert_eq!(logits_every_within(&[32, 32, 32, 238], 105, 24 << 20), 1);
    }
}
