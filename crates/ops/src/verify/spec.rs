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
use harness::protocol::{Command, Prompt, Reply};
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
            let got_logits: Vec<f32> = got_logits.iter().map(|&b| f32::from_bits(b)).collect();
            let vocab = cfg.vocab;
            let mut logits_ok = got_logits.len() >= vocab * want_tokens.len().min(got_tokens.len()).max(1);
            let mut tokens_ok = got_tokens.len() == want_tokens.len();
            // The first non-finite logit on either side (step, where): never a pass.
            let mut non_finite = None;
            for (step, want_row) in rows.iter().enumerate() {
                let Some(got_row) = got_logits.get(step * vocab..(step + 1) * vocab) else {
                    break;
                };
                r.steps = step + 1;
                let step_tol = match margins.get(step) {
                    Some(&w) if w > tol.atol => {
                        r.widened_atol = r.widened_atol.max(w);
                        Tolerance { atol: w, ..tol.clone() }
                    }
                    _ => tol.clone(),
                };
                let v = oracle::compare(got_row, want_row, &step_tol);
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
                        engine: got_row.get(v.worst_index).map_or(f64::NAN, |&x| x as f64),
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
                first_fail = Some(FirstFail {
                    ids: got_ids.clone(),
                    tokens: got_tokens.clone(),
                    logits: got_logits.clone(),
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
            error = "phase order: generation matches the reference, but run_kernel_test has not passed on these exact sources; run it, then verify again".into();
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
