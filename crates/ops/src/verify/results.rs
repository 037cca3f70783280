//! The verify report: the verdict per prompt, per real vocabulary and for the whole run, the
//! ledger's divergence summary, and the text rendering.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Report;

/// The verdict for one prompt.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PromptResult {
    /// The prompt.
    pub prompt: String,
    /// Whether the prompt was drawn at random by the server.
    pub random: bool,
    /// Engine ids equal HF tokenizers' ids (BOS included).
    pub tokenizer_ok: bool,
    /// Greedy tokens equal the reference's (up to a near-tie, see `tie_at`).
    pub tokens_ok: bool,
    /// Logits within tolerance at every compared step.
    pub logits_ok: bool,
    /// Steps compared.
    pub steps: usize,
    /// First step where the engine's token differs from the reference, -1 when none.
    pub first_mismatch: i64,
    /// Step at which the reference's top two logits were within tolerance and the engine took the
    /// other one: accepted, comparison stops there. -1 when none.
    pub tie_at: i64,
    /// Largest |engine - reference| logit over compared steps.
    pub max_abs_err: f64,
    /// The largest absolute tolerance a step was judged at when the family's rounding margin widened
    /// it (this checkpoint's own activations make f32 inexact there); 0 when no step was widened.
    #[serde(default)]
    pub widened_atol: f64,
    /// First step whose logits are beyond tolerance, -1 when none. Step 0's logits are the prompt's
    /// last position (prefill); step k > 0 is the k-th decode step.
    #[serde(default = "minus_one")]
    pub first_divergence: i64,
    /// Where `first_divergence` lies: `prefill` (step 0) or `decode`; empty when none.
    #[serde(default)]
    pub divergence_phase: String,
    /// At `first_divergence`: the token id whose logit is furthest outside tolerance, and the
    /// engine's and the reference's logit for it. None when no step diverged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence: Option<Divergence>,
    /// Text the engine generated (its own decode).
    pub text: String,
    /// The reference's own continuation: HF tokenizers' decoding of the prompt's reference ids and
    /// the reference forward pass's greedy tokens (what a correct engine writes).
    pub reference_text: String,
    /// HF tokenizers' decoding of the engine's own ids (prompt and generated); must equal `text`.
    #[serde(default)]
    pub decoded_text: String,
    /// Whether the reference's continuation ended at a stop token (generation_config.json
    /// eos_token_id) before its token budget.
    #[serde(default)]
    pub stopped_at_eos: bool,
    /// What failed, in words.
    pub error: String,
}

/// The ledger's summary of where a failed verify went wrong (`VerifyFigures::divergence`): the
/// first failing prompt's tokenizer, prefill or decode divergence, token or stop mismatch, or crash.
pub(super) fn divergence_kind(report: &VerifyReport) -> String {
    if report.passed {
        return String::new();
    }
    let Some(p) = report.prompts.iter().find(|p| !p.error.is_empty()) else {
        let vectors_fail = report
            .tokenizer_vectors
            .iter()
            .any(|v| v.encode_ok < v.texts || v.decode_ok < v.texts || !v.error.is_empty());
        return if report.prompts.is_empty() {
            "crash".into()
        } else if vectors_fail {
            "tokenizer".into()
        } else {
            "stop".into()
        };
    };
    if !p.tokenizer_ok {
        "tokenizer".into()
    } else if !p.divergence_phase.is_empty() {
        p.divergence_phase.clone()
    } else if p.steps == 0 {
        "crash".into()
    } else if !p.tokens_ok {
        "tokens".into()
    } else {
        "stop".into()
    }
}

fn minus_one() -> i64 {
    -1
}

/// Where a prompt's logits first left tolerance.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Divergence {
    /// The token id (logit index) furthest outside tolerance at that step.
    pub token: usize,
    /// The engine's logit for it.
    pub engine: f64,
    /// The reference's logit for it.
    pub reference: f64,
}

/// Verification result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct VerifyReport {
    /// Whether every prompt passed every check.
    pub passed: bool,
    /// Seed of the random prompts.
    pub seed: u64,
    /// Model-family contract used for the reference.
    pub family: String,
    /// Weight dtype the engine was built for and the reference ran at.
    pub dtype: String,
    /// Logit tolerance applied.
    pub atol: f64,
    /// Logit tolerance applied.
    pub rtol: f64,
    /// Per prompt.
    pub prompts: Vec<PromptResult>,
    /// Harness build or run failure, when there was one.
    pub error: String,
    /// Known failure modes whose mutated reference forward pass reproduces the engine's logits on the
    /// first prompt whose logits failed (see `oracle::diagnose::generation` for the rule); empty when the
    /// logits passed or nothing explains them.
    pub diagnosis: Vec<oracle::diagnose::Diagnosis>,
    /// Where the first failing step's forward pass first leaves the reference: the engine's
    /// traced forward (`Model::forward_traced`) against the reference's trace on the same tokens.
    /// None when the logits passed; without a point (and with a note saying why) when the engine
    /// has no traced forward, the call read a bundle, or every point agreed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub localisation: Option<crate::localise::Localisation>,
    /// Rule findings (check_rules); a blocking one stops verification.
    pub rules: Vec<guard::Finding>,
    /// When it passed: each staged candidate it ran under (the model family, the engine's target
    /// platform) and whether this evidence promoted it into the CKB working copy (see
    /// `ops::evolve::promote_on_evidence`). Empty otherwise.
    pub promotions: Vec<crate::gate::Promotion>,
    /// Token ids that end generation (generation_config.json eos_token_id, else config.json's).
    #[serde(default)]
    pub stop_tokens: Vec<u32>,
    /// Tokenizer contract the model's tokenizer.json routes to.
    #[serde(default)]
    pub tokenizer: String,
    /// The engine's tokenizer on the real vocabularies of the same tokenizer contract (their
    /// tests.json texts and ids): those of `$METAINFER_TOKENIZERS` (default `../shared/tokenizers`)
    /// and those shipped with the binary (`model::embedded::VOCABULARIES`).
    #[serde(default)]
    pub tokenizer_vectors: Vec<VectorResult>,
    /// Every check this run skipped, each with why and what would run it: the real vocabularies of
    /// the model's tokenizer contract that were neither found nor shipped; empty when nothing was
    /// skipped.
    #[serde(default)]
    pub skipped: Vec<String>,
    /// Things the engine author should know that did not fail the gate (e.g. an ignored lm_head).
    #[serde(default)]
    pub warnings: Vec<String>,
    /// Whether the engine's code (its build scripts and proc macros, the harness process) ran in
    /// the enforced sandbox; false where the kernel offers no Landlock ABI >= 6 or seccomp (the
    /// server logs why at start; `--require-sandbox` refuses to run instead).
    pub sandboxed: bool,
}

/// The engine's tokenizer on one real vocabulary's test vectors.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct VectorResult {
    /// Vocabulary (folder name, e.g. `llama-bpe`).
    pub vocabulary: String,
    /// Texts checked.
    pub texts: usize,
    /// Texts whose engine ids equal HF's with add_special_tokens = true (the test vector wrapped in
    /// the template's special tokens).
    pub encode_ok: usize,
    /// Id lists whose engine decoding equals HF's with skip_special_tokens = true.
    pub decode_ok: usize,
    /// The first failure, in words; empty when all passed.
    pub error: String,
}

impl Report for VerifyReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn bundle_written(&self) -> bool {
        crate::gate::wrote_bundle(&self.error)
    }
    fn text(&self) -> String {
        let ok = self.prompts.iter().filter(|p| p.error.is_empty()).count();
        // A written bundle ran nothing: say so rather than count prompts.
        let progress = if self.error.starts_with("not run:") {
            "not run".to_string()
        } else {
            harness::prompts_passed(ok, self.prompts.len())
        };
        let mut s = format!(
            "verify {}: {} (seed {}, {} with {} weights, logits atol {} rtol {})\n",
            if self.passed { "PASSED" } else { "FAILED" },
            progress,
            self.seed,
            self.family,
            self.dtype,
            self.atol,
            self.rtol
        );
        if !self.error.is_empty() {
            s += &format!("{}\n", self.error);
        }
        for w in &self.warnings {
            s += &format!("warning: {w}\n");
        }
        for k in &self.skipped {
            s += &format!("skipped: {k}\n");
        }
        for v in &self.tokenizer_vectors {
            s += &format!(
                "{} tokenizer vectors {}: encode {}/{} decode {}/{}{}\n",
                if v.error.is_empty() { "ok  " } else { "FAIL" },
                v.vocabulary,
                v.encode_ok,
                v.texts,
                v.decode_ok,
                v.texts,
                if v.error.is_empty() { String::new() } else { format!(": {}", v.error) }
            );
        }
        for p in &self.prompts {
            s += &format!(
                "{} {:?}{}: tokenizer {} tokens {} logits {} ({} steps{}, max abs {}{})\n   {:?}\n",
                if p.error.is_empty() { "ok  " } else { "FAIL" },
                p.prompt,
                if p.random { " (random)" } else { "" },
                mark(p.tokenizer_ok),
                mark(p.tokens_ok),
                mark(p.logits_ok),
                p.steps,
                if p.stopped_at_eos { ", stopped at EOS" } else { "" },
                crate::sci(p.max_abs_err),
                if p.widened_atol > 0.0 {
                    format!(
                        "; atol widened to at most {} where this checkpoint's activations make f32 inexact",
                        crate::sci(p.widened_atol)
                    )
                } else {
                    String::new()
                },
                p.text
            );
            if !p.error.is_empty() {
                if p.reference_text != p.text {
                    s += &format!("   reference: {:?}\n", p.reference_text);
                }
                s += &format!("   {}\n", p.error);
            }
        }
        if let Some(l) = &self.localisation {
            s += &format!("{}\n", l.line());
        }
        for d in &self.diagnosis {
            s += &format!("{}\n", d.line());
        }
        for p in &self.promotions {
            s += &format!("{} {}: {}\n", if p.promoted { "promoted" } else { "not promoted" }, p.contract, p.message);
        }
        s
    }
}

fn mark(b: bool) -> &'static str {
    if b { "ok" } else { "FAIL" }
}
