//! `ckb perplexity`: weaker evidence for a model family, from trained weights the user holds. The
//! family's reference (its graph, f64) scores a text teacher-forced on the checkpoint; so does the
//! same graph turned into each of its model-level mutants (each failure contract's mutation or graph
//! rewrite that applies: the family's distinguishing features done wrong). A family that is right
//! predicts trained text well and better than its mistakes; a wrong one (a feature the model does
//! not have, or lacks) gives a trained model near-uniform predictions, and a mutant that undoes the
//! mistake scores better than the contract. So the check passes when
//! - the perplexity is at most [`FAR_BELOW_UNIFORM`] times the vocabulary size (uniform prediction's
//!   perplexity), and
//! - no mutant's perplexity is lower by more than [`TIE`] (relative; closer mutants change the
//!   logits too little to tell on this text and are listed as ties), and
//! - some mutant's perplexity is at least [`POWER`] times the reference's (the text can tell this
//!   family from its mistakes at all).
//!
//! It catches a family that is wrong, not one that is slightly off (a rounded gain, a bound), which
//! only an independent implementation's logits (`ckb conformance`) can: the report says so. The
//! check is recorded as `ckb_perplexity` under the family's `id@version`, with the text's sha256,
//! both perplexities and the consent; a staged family that passes is promoted only with the user's
//! explicit consent (`--consent`), else it stays provisional and the report says what would promote
//! it. Perplexity: exp of the mean negative log-likelihood of each next token (Jelinek et al. 1977;
//! Jurafsky & Martin, Speech and Language Processing, 3rd ed., ch. 3).

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::checkpoint::Checkpoint;
use super::{Ctx, Report};
use base::error::{Context, Error, Result};
use oracle::llama::Reference;

/// The ledger's tool name of this check.
pub const TOOL: &str = super::evolve::PERPLEXITY;

/// The reference's perplexity must be at most this share of the vocabulary size (uniform
/// prediction). Trained BabyLlama (105 tokens) scores about 3 on a simple story.
pub const FAR_BELOW_UNIFORM: f64 = 0.25;

/// A mutant scoring lower than the reference by more than this (relative) beats it.
pub const TIE: f64 = 0.01;

/// Some mutant must score at least this many times the reference's perplexity.
pub const POWER: f64 = 1.5;

/// Fewest tokens a text must give: fewer predictions are too few to tell a family from its
/// mutants (the built-in passage gives 256 on BabyLlama's character vocabulary).
pub const MIN_TOKENS: usize = 32;

/// Largest text read.
pub const TEXT: base::util::Limit =
    base::util::Limit { what: "text to score", max: 4 << 20, hint: "a shorter text (512 tokens are scored)" };

/// Tokens scored at most (the text is cut there), and the default.
pub const MAX_TOKENS: usize = 512;

/// A short story in plain words, written for this check (public domain): what scores a
/// checkpoint when the user gives no text.
pub const PASSAGE: &str = "Once upon a time there was a little girl named Lily. She liked to play in the \
park with her dog. One day the sun was warm and the sky was blue. Lily saw a big red ball under a tree. \
She ran to the ball and gave it a kick. The dog ran after the ball and brought it back. Lily laughed and \
said, \"Good dog!\" Then they sat on the grass and ate an apple. When the sun went down, Lily and her dog \
went home. Her mom gave her a hug and a warm cup of milk. Lily was happy.";

/// What to check.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PerplexityRequest {
    /// A checkpoint directory with trained weights and tokenizer.json.
    pub model: String,
    /// A text file to score (UTF-8); default: [`PASSAGE`].
    #[serde(default)]
    pub text: Option<String>,
    /// The user consents to promoting a staged family on this weaker evidence.
    #[serde(default)]
    pub consent: bool,
    /// Tokens scored at most (default and largest: [`MAX_TOKENS`]).
    #[serde(default)]
    pub max_tokens: Option<usize>,
}

/// One mutant's score.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct MutantScore {
    /// The failure contract it reproduces.
    pub failure: String,
    /// The mutant (a mutation, or `graph rewrite: ...`).
    pub mutant: String,
    /// Its perplexity on the text.
    pub perplexity: f64,
}

/// The check's result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PerplexityReport {
    /// The family contract checked, `id@version`.
    pub family: String,
    /// The checkpoint.
    pub model: String,
    /// The text scored: a path, or `built-in passage`.
    pub text: String,
    /// sha256 of the text's bytes, hex.
    pub text_sha256: String,
    /// Tokens scored (the tokenizer's, special tokens included; predictions = tokens - 1).
    pub tokens: usize,
    /// The reference's perplexity.
    pub perplexity: f64,
    /// Uniform prediction's perplexity: the vocabulary size.
    pub uniform: f64,
    /// Every mutant tried, lowest perplexity first.
    pub mutants: Vec<MutantScore>,
    /// Mutants that score better than the reference (by more than [`TIE`]): the contract is wrong
    /// where they are right.
    pub beaten_by: Vec<String>,
    /// Whether the check passed (module doc).
    pub passed: bool,
    /// What this evidence can and cannot show.
    pub strength: String,
    /// Promotion of a staged family: done (passed, with consent) or why not.
    pub promotion: String,
}

impl Report for PerplexityReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let mut s = format!(
            "ckb perplexity: {} {} on {} ({} tokens): perplexity {:.3} (uniform {:.0})\n",
            self.family,
            if self.passed { "passed" } else { "failed" },
            self.text,
            self.tokens,
            self.perplexity,
            self.uniform
        );
        for m in &self.mutants {
            s += &format!("  {:>10.3}  {} ({})\n", m.perplexity, m.mutant, m.failure);
        }
        if !self.beaten_by.is_empty() {
            s += &format!("beaten by: {}\n", self.beaten_by.join("; "));
        }
        s += &format!("{}\n{}\n", self.strength, self.promotion);
        s
    }
}

/// Perplexity of `reference` on `ids` teacher-forced: exp of the mean of `logsumexp(logits) -
/// logits[next]` over the predictions.
fn perplexity(reference: &mut Reference, ids: &[u32]) -> Result<f64> {
    reference.reset();
    let mut nll = 0.0;
    for w in ids.windows(2) {
        let logits = reference.step(w[0])?;
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        nll += lse - logits[w[1] as usize];
    }
    Ok((nll / (ids.len() - 1) as f64).exp())
}

/// Score the text with the family's reference and its mutants (module doc), record the check and
/// promote a staged family that passed when the user consented.
///
/// # Errors
/// Usage: a checkpoint outside the roots or not covered; Input: an unreadable text or tokenizer, a
/// text of fewer than [`MIN_TOKENS`] tokens (or `max_tokens`, when smaller), weights that do not load.
pub fn check(ctx: &Ctx, req: &PerplexityRequest) -> Result<PerplexityReport> {
    let started = std::time::Instant::now();
    let live = ctx.live();
    let ctx = &*live;
    let ck = Checkpoint::open(ctx, &req.model)?;
    let (contract, family) = ck.family(&ctx.ckb)?;
    let (label, text) = match &req.text {
        None => ("built-in passage".to_string(), PASSAGE.to_string()),
        Some(p) => {
            let path = Path::new(p);
            let (parent, name) = match (path.parent(), path.file_name()) {
                (Some(d), Some(n)) => (if d.as_os_str().is_empty() { Path::new(".") } else { d }, Path::new(n)),
                _ => return Err(Error::usage(format!("--text {p}: name a text file"))),
            };
            let dir = ctx.confine(parent)?;
            (dir.show(name).display().to_string(), dir.read_text(name, &TEXT)?)
        }
    };
    let limit = req.max_tokens.unwrap_or(MAX_TOKENS).clamp(2, MAX_TOKENS).min(ck.cfg.max_seq);
    let encoding = ck
        .tokenizer()?
        .encode(text.as_str(), true)
        .ctx(|| format!("the tokenizer of {} cannot encode the text", ck.path().display()))?;
    let ids: Vec<u32> = encoding.get_ids().iter().copied().take(limit).collect();
    if ids.len() < MIN_TOKENS.min(limit) {
        return Err(Error::input(format!(
            "the text gives {} token(s); the check needs at least {} to be evidence: give a longer text",
            ids.len(),
            MIN_TOKENS.min(limit)
        )));
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= ck.cfg.vocab) {
        return Err(Error::input(format!(
            "the tokenizer gives id {t}, outside the model's vocabulary of {}: tokenizer.json does not belong to this checkpoint",
            ck.cfg.vocab
        )));
    }
    let tensors = ck.tensors(&ctx.ckb, "f32")?;
    let mut reference = Reference::of_family(family, &ck.cfg, tensors, "f32")?;
    let ppl = perplexity(&mut reference, &ids)?;
    let scored = oracle::diagnose::for_each_mutant(&ctx.ckb, &mut reference, |r| perplexity(r, &ids));
    let mut mutants = Vec::new();
    for (failure, mutant, p) in scored {
        mutants.push(MutantScore { failure, mutant, perplexity: p? });
    }
    mutants.sort_by(|a, b| a.perplexity.total_cmp(&b.perplexity));
    let uniform = ck.cfg.vocab as f64;
    let beaten_by: Vec<String> = mutants
        .iter()
        .filter(|m| m.perplexity < ppl * (1.0 - TIE))
        .map(|m| format!("{} ({}, perplexity {:.3})", m.mutant, m.failure, m.perplexity))
        .collect();
    let powered = mutants.iter().any(|m| m.perplexity >= POWER * ppl);
    let passed = ppl.is_finite() && ppl <= FAR_BELOW_UNIFORM * uniform && beaten_by.is_empty() && powered;
    let tag = ctx.versioned(&[contract.id.as_str()]);
    let text_sha256 = model::embedded::sha256_hex(text.as_bytes());
    let mut report = PerplexityReport {
        family: tag.join(", "),
        model: ck.path().display().to_string(),
        text: label,
        text_sha256: text_sha256.clone(),
        tokens: ids.len(),
        perplexity: ppl,
        uniform,
        mutants,
        beaten_by,
        passed,
        strength: format!(
            "weaker evidence than `ckb conformance`: it shows the family is not wrong on these weights (perplexity at most {FAR_BELOW_UNIFORM} of uniform, no mutant better by more than {:.0}%, some mutant {POWER} times worse), not that every detail equals the model's",
            TIE * 100.0
        ),
        promotion: String::new(),
    };
    let figures = ledger::figures::Figures::Perplexity(ledger::figures::PerplexityFigures {
        model: report.model.clone(),
        text_sha256,
        tokens: report.tokens,
        perplexity: ppl,
        uniform,
        mutants: report.mutants.iter().map(|m| (m.mutant.clone(), m.perplexity)).collect(),
        consent: req.consent,
        contract_sha256: super::evolve::contract_sha256(contract),
    });
    ctx.record(TOOL, None, tag.clone(), &report, figures, started);
    report.promotion = if !ctx.ckb.is_provisional(&contract.id) {
        format!("{} is not a staged candidate: nothing to promote", contract.id)
    } else if !passed {
        format!("not promoted: {} stays provisional", contract.id)
    } else if !req.consent {
        format!(
            "not promoted: {} passed, but this is weaker evidence; promote on it only with the user's explicit consent (run again with --consent), or run `metainfer ckb conformance DIR` on vectors the model's own implementation wrote",
            contract.id
        )
    } else {
        super::evolve::promote_on_evidence(ctx, TOOL, &tag)
            .into_iter()
            .map(|p| p.message)
            .collect::<Vec<_>>()
            .join("; ")
    };
    Ok(report)
}
