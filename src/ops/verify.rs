//! verify_generation: load a real checkpoint through the engine, check its tokenizer against HF
//! `tokenizers` (on the prompts and on the real vocabularies' test vectors of the same tokenizer
//! contract), run greedy generation to the stop tokens of generation_config.json, and compare the
//! tokens exactly and the per-step logits within the family's tolerance for the weight dtype against
//! the server's f64 reference forward pass.
//!
//! Some prompts are drawn at random on every run (seed reported), so no hard-coded output can pass;
//! they include digits, punctuation, non-ASCII text, whitespace runs and special-token text where the
//! model's tokenizer represents them exactly.
//!
//! The tokenizer vectors are part of this gate rather than of run_kernel_test or a tool of their
//! own: the tokenizer belongs to the generation phase (component contracts, phase `generation`),
//! which this gate checks and which unlocks only after the kernels passed; loading real vocabularies
//! (up to 280k merges) would slow the kernel loop; and this gate already compares the engine's
//! tokenizer with the reference on its prompts, so the vectors extend the same check.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::checkpoint::Checkpoint;
use super::gate::{Commands, Gate, Harness, Promotion, Spec, Tool, Verdict as GateVerdict};
use super::localise::Localisation;
use super::{Ctx, Report};
use crate::ckb::Tolerance;
use crate::error::{Error, Result};
use crate::harness::protocol::{Command, Prompt, Reply, TokenizeSet};
use crate::harness::{Budget, Called};
use crate::ledger::figures::{Figures, VerifyFigures};
use crate::model;
use crate::oracle::llama::Reference;

/// What to verify.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct VerifyRequest {
    /// Engine crate directory.
    pub engine: String,
    /// Hugging Face model directory with real weights.
    pub model: String,
    /// Prompts of your own; three more are drawn at random on every run, the last of which is
    /// generated to the end of the model's context (at most 512 tokens).
    #[serde(default)]
    pub prompts: Vec<String>,
    /// Tokens to generate per prompt (default 32).
    #[serde(default)]
    pub max_new_tokens: Option<usize>,
    /// Seed for the random prompts, to replay a run (below 2^53; a decimal string is accepted too).
    #[serde(default, deserialize_with = "crate::util::de_seed")]
    pub seed: Option<u64>,
    /// Weight dtype to build the engine for (f32, bf16, f16, int8); absent: the engine's own
    /// (metainfer.toml `dtype`). The reference then runs on the weights as that dtype stores them.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Do not run: build the harness and draw the inputs here, and write them as a bundle to this
    /// directory (new or empty), to run with `metainfer bundle run DIR` where the device is.
    #[serde(default)]
    pub write_bundle: Option<String>,
    /// Judge and record a bundle written by this gate and run elsewhere (`metainfer bundle run`),
    /// instead of running the engine here. The engine's sources must be the ones it was written from.
    #[serde(default)]
    pub from_bundle: Option<String>,
}

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
fn divergence_kind(report: &VerifyReport) -> String {
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
    pub diagnosis: Vec<crate::oracle::diagnose::Diagnosis>,
    /// Where the first failing step's forward pass first leaves the reference: the engine's
    /// traced forward (`Model::forward_traced`) against the reference's trace on the same tokens.
    /// None when the logits passed; without a point (and with a note saying why) when the engine
    /// has no traced forward, the call read a bundle, or every point agreed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub localisation: Option<super::localise::Localisation>,
    /// Rule findings (check_rules); a blocking one stops verification.
    pub rules: Vec<crate::guard::Finding>,
    /// When it passed: each staged candidate it ran under (the model family, the engine's target
    /// platform) and whether this evidence promoted it into the CKB working copy (see
    /// `ops::evolve::promote_on_evidence`). Empty otherwise.
    pub promotions: Vec<super::gate::Promotion>,
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
    fn text(&self) -> String {
        let ok = self.prompts.iter().filter(|p| p.error.is_empty()).count();
        // A written bundle ran nothing: say so rather than count prompts.
        let progress = if self.error.starts_with("not run:") {
            "not run".to_string()
        } else {
            crate::harness::prompts_passed(ok, self.prompts.len())
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
                "{} {:?}{}: tokenizer {} tokens {} logits {} ({} steps, max abs {}{})\n   {:?}\n",
                if p.error.is_empty() { "ok  " } else { "FAIL" },
                p.prompt,
                if p.random { " (random)" } else { "" },
                mark(p.tokenizer_ok),
                mark(p.tokens_ok),
                mark(p.logits_ok),
                p.steps,
                super::sci(p.max_abs_err),
                if p.widened_atol > 0.0 {
                    format!(
                        "; atol widened to at most {} where this checkpoint's activations make f32 inexact",
                        super::sci(p.widened_atol)
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

/// Most tokens generated for the long random prompt.
pub const LONG_RUN: usize = 512;

/// Words for random prompts: common in children's stories, so tiny story models stay in distribution.
const WORDS: &[&str] = &[
    "the", "a", "little", "dog", "cat", "girl", "boy", "sun", "tree", "ball", "happy", "big", "red", "park", "mom",
    "friend", "bird", "toy", "played", "saw", "went", "day", "one", "was", "and", "with", "car", "box", "blue", "fish",
];

/// Pieces a richer random prompt draws from: digits, punctuation, apostrophes, non-ASCII text (Latin
/// accents, typographic quotes, Cyrillic, CJK, an emoji, a combining accent) and whitespace runs.
/// [`rich_alphabet`] keeps those a model's tokenizer represents exactly.
const RICH: &[&str] = &[
    "0",
    "7",
    "42",
    "2024",
    "3.14",
    "1,000",
    ".",
    ",",
    "!",
    "?",
    ";",
    ":",
    "-",
    "(",
    ")",
    "\"",
    "'",
    "'s",
    "n't",
    "’",
    "“",
    "”",
    "…",
    "—",
    "é",
    "ñ",
    "ü",
    "ß",
    "ç",
    "Ω",
    "привет",
    "日本",
    "中文",
    "😀",
    "e\u{301}",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    " \n",
];

/// The pieces of [`RICH`] that `tok` encodes and decodes back unchanged (an unknown token does not
/// decode to what it replaced), and the special tokens' contents (between two letters, so that no leading-space rule hides a
/// loss): the alphabet an engine is expected to handle for this tokenizer. BabyLlama's 105
/// characters keep digits, ASCII punctuation, the typographic quotes and double spaces, but no
/// newline, CJK or emoji.
pub fn rich_alphabet(tok: &tokenizers::Tokenizer) -> Vec<String> {
    // In id order: the decoder is a hash map, whose order differs from one call to the next, and
    // the same seed must draw the same prompts.
    let mut specials: Vec<(u32, String)> =
        tok.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, t)| (id, t.content)).collect();
    specials.sort_unstable();
    let specials: Vec<String> = specials.into_iter().map(|(_, s)| s).collect();
    let mut out = Vec::new();
    for piece in RICH.iter().map(|s| s.to_string()) {
        let probe = format!("a{piece}b");
        let Ok(enc) = tok.encode(probe.as_str(), false) else { continue };
        // An unknown token decodes to its own text (e.g. "<unk>"), so the round trip fails too.
        if tok.decode(enc.get_ids(), false).ok().as_deref() == Some(probe.as_str()) {
            out.push(piece);
        }
    }
    // Special-token text: matched as one added token; it must not decode away when it is not special.
    out.extend(specials.into_iter().filter(|s| !s.is_empty()));
    out
}

/// Draw `n` prompts of 2-6 words with 1-3 pieces of `alphabet` mixed in (joined to a word or
/// standing alone), for tokenizer bugs no plain prompt shows.
pub fn rich_prompts(seed: u64, n: usize, alphabet: &[String]) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0005_eed0_fa1f_abe7);
    let mut prompts = random_prompts(seed, n);
    if alphabet.is_empty() {
        return prompts;
    }
    for p in &mut prompts {
        let mut words: Vec<String> = p.split(' ').map(str::to_string).collect();
        for _ in 0..rng.random_range(1..=3) {
            let piece = &alphabet[rng.random_range(0..alphabet.len())];
            let at = rng.random_range(0..=words.len());
            if at > 0 && rng.random_bool(0.5) {
                words[at - 1].push_str(piece);
            } else {
                words.insert(at, piece.clone());
            }
        }
        *p = words.join(" ");
    }
    prompts
}

/// Draw `n` prompts of 2-6 words.
pub fn random_prompts(seed: u64, n: usize) -> Vec<String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(2..=6);
            let words: Vec<&str> = (0..len).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
            let mut s = words.join(" ");
            if let Some(first) = s.get(..1) {
                s = first.to_uppercase() + &s[1..];
            }
            s
        })
        .collect()
}

/// Verify generation.
///
/// # Errors
/// Not a crate, unreadable model, uncovered config, outside the workspace, or the harness cannot be
/// started. An engine that fails to build or produces wrong output is a report, not an error.
pub fn verify(ctx: &Ctx, req: &VerifyRequest, budget: &Budget) -> Result<VerifyReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::Verify, &req.engine, req.dtype.as_deref(), budget)?;
    let ck = Checkpoint::open(ctx, &req.model)?;
    let (held, cfg) = (&ck.held, &ck.cfg);
    let model_dir = ck.path().to_path_buf();
    let target = gate.target.clone();
    gate.same_family(&model_dir, &cfg.family)?;
    let (family, m) = ck.family(&ctx.ckb)?;
    let tol: Tolerance = m.logits_tolerance.get(&target.dtype).cloned().ok_or_else(|| {
        Error::usage(format!(
            "{} states no logits tolerance for weight dtype {}; add [model.logits_tolerance.{}] with its reasoning",
            family.id, target.dtype, target.dtype
        ))
    })?;
    let (tokenizer_contract, _) = model::tokenizer::check_model_tokenizer(&ctx.ckb, held, cfg.vocab)?;
    let tensors = ck.tensors(&ctx.ckb, &target.dtype)?;
    let mut warnings: Vec<String> = model::tied_head_warning(cfg, &tensors).into_iter().collect();
    warnings.extend(model::dtype_notes(&ck.config, &ck.layout));
    let reference = Reference::of_family(m, cfg, tensors, &target.dtype)?;
    let tok = ck.tokenizer()?;
    let max_new = req.max_new_tokens.unwrap_or(32);
    if max_new == 0 || max_new > 4096 {
        return Err(Error::usage(format!("max_new_tokens must be 1..=4096, got {max_new}")));
    }
    gate.split(req.write_bundle.as_deref(), req.from_bundle.as_deref())?;
    let seed = gate.draw_seed(req.seed)?;
    let note = gate.attestation_note();
    if !note.is_empty() {
        warnings.push(note);
    }
    let mut prompts: Vec<(String, bool)> = req.prompts.iter().map(|p| (p.clone(), false)).collect();
    if prompts.is_empty() {
        prompts.push(("Once upon a time".into(), false));
    }
    // Two random prompts with the richer alphabet the model's tokenizer represents; the long one plain.
    let mut random = rich_prompts(seed, 2, &rich_alphabet(tok));
    random.extend(random_prompts(seed.wrapping_add(1), 1));
    prompts.extend(random.into_iter().map(|p| (p, true)));
    // Tokens to generate per prompt: the last random prompt runs to the end of the context (at most
    // LONG_RUN tokens), so a KV cache that is wrong only at long positions is caught too.
    let mut budgets = Vec::new();
    for (i, (p, _)) in prompts.iter().enumerate() {
        let n = model::hf_encode(tok, p)?.len();
        if n >= cfg.max_seq {
            return Err(Error::usage(format!(
                "prompt {p:?} encodes to {n} tokens; the model's context (max_position_embeddings) is {}: shorten it",
                cfg.max_seq
            )));
        }
        let room = cfg.max_seq - n;
        budgets.push(if i + 1 == prompts.len() {
            room.min(LONG_RUN).max(max_new.min(room))
        } else {
            max_new.min(room)
        });
    }

    let mut contract_ids: Vec<&str> = vec![family.id.as_str()];
    // The tokenizer component is the one tokenizer.json routes to.
    let components = m.components.iter().map(|c| {
        if ctx.ckb.get(c).is_ok_and(|c| c.tokenizer.is_some()) { tokenizer_contract.as_str() } else { c.as_str() }
    });
    contract_ids.extend(target.spec.kernels.iter().map(String::as_str).chain(components));
    contract_ids.extend(target.platform.as_deref());
    gate.contracts(&contract_ids);

    let (sets, vectors_skipped) = vocabulary_sets(ctx, &tokenizer_contract);
    let mut spec = VerifySpec {
        ck: &ck,
        family,
        m,
        tol,
        tokenizer_contract,
        warnings,
        reference,
        prompts,
        budgets,
        seed,
        dtype: target.dtype.clone(),
        sets,
        vectors_skipped,
        tensors_path: PathBuf::new(),
    };
    gate.run(&mut spec)
}

/// verify_generation as a [`Spec`]: the checkpoint, its reference, the prompts and their budgets.
struct VerifySpec<'c> {
    ck: &'c Checkpoint,
    family: &'c crate::ckb::Contract,
    m: &'c crate::ckb::ModelFamily,
    tol: Tolerance,
    tokenizer_contract: String,
    warnings: Vec<String>,
    reference: Reference,
    /// Each prompt, and whether it was drawn (random).
    prompts: Vec<(String, bool)>,
    /// Tokens to generate per prompt.
    budgets: Vec<usize>,
    seed: u64,
    dtype: String,
    /// The tokenizer contract's vocabularies the engine's tokenizer is checked on.
    sets: Vec<model::tokenizer::VectorSet>,
    vectors_skipped: Vec<String>,
    /// Where the harness writes the generation's tensors.
    tensors_path: PathBuf,
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

    fn model(&self) -> Option<&crate::beneath::HeldDir> {
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
            Err(why) => return Ok(self.crashed(gate, crate::harness::explain(&why, &gate.engine))),
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
                let v = crate::oracle::compare(got_row, want_row, &step_tol);
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
                        super::sci(d.engine),
                        super::sci(d.reference)
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
                        super::sci(r.max_abs_err),
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
        let kernels_passed = crate::ledger::Ledger::open(&ctx.ledger)
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
            Some(f) => crate::oracle::diagnose::generation(&ctx.ckb, reference, &f.ids, &f.tokens, &f.logits, &tol),
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
            diagnosis = crate::oracle::diagnose::where_it_departs(
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

/// What the traced rerun of a failing step needs of the gate: its harness and what it may read.
struct Traced<'g, 'a> {
    gate: &'g Gate<'a>,
    h: &'g super::gate::Harness,
    reads: &'g [&'g Path],
    model: &'g Path,
}

/// Rerun the failing step traced: the engine's `forward_traced` (harness command `trace`) and the
/// reference's `step_traced` on the engine's own ids and tokens up to `at.step`, compared point by
/// point ([`super::localise::compare_traces`]). Always returns a localisation, with a note that
/// says what was found or why nothing could be localised.
///
/// # Errors
/// The reference's own errors (a token outside the vocabulary).
#[allow(clippy::too_many_arguments)]
fn localise_step(
    t: &Traced<'_, '_>,
    reference: &mut Reference,
    graph: Option<&crate::ckb::Graph>,
    ids: &[u32],
    tokens: &[u32],
    tokenizer_ok: bool,
    tol: &crate::ckb::Tolerance,
    mut at: Localisation,
) -> Result<Localisation> {
    let run: Vec<u32> = ids.iter().chain(tokens.iter().take(at.step)).copied().collect();
    let not = |mut at: Localisation, why: String| {
        at.note = why;
        Ok(at)
    };
    if !matches!(t.gate.mode, super::gate::Mode::Direct) {
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
    let engine: Vec<(crate::harness::protocol::TracePoint, Vec<f32>)> = points
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
    let required = super::localise::required_points(graph, reference.config().n_layers);
    let diverged = super::localise::compare_traces(&engine, &trace, &required, tol, &mut at);
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
            let kernel = crate::ckb::GRAPH_OPS.iter().find(|o| o.name == n.op).and_then(|o| o.kernel);
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
        let cache = if node.is_some_and(|n| n.op == "attention") {
            "; attention also reads the K/V rows of earlier positions, so check what the cache holds (component.kv_cache: row p written at position p, rows 0..=pos read)"
        } else {
            ""
        };
        // The mutants compared where the engine first differs: the one whose own value there is
        // the engine's names the first mistake, whatever a later one does to the logits.
        let got = engine.iter().find(|(p, _)| super::localise::point_name(p) == at.point).map(|(_, v)| v.as_slice());
        if let Some(got) = got {
            at.mutants = crate::oracle::diagnose::at_point(
                &t.gate.ctx.ckb,
                reference,
                &run,
                &at.point,
                got,
                at.max_abs_err,
                tol,
            );
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

/// The real vocabularies that route to tokenizer `contract`: those of
/// `model::tokenizer::vectors_dir` (`$METAINFER_TOKENIZERS` or `../shared/tokenizers`), then the
/// ones shipped with the binary that were not found there (written into the cache); and each known
/// vocabulary of that contract found in neither, with why it was not checked.
fn vocabulary_sets(ctx: &Ctx, contract: &str) -> (Vec<model::tokenizer::VectorSet>, Vec<String>) {
    vocabulary_sets_in(ctx, contract, &model::tokenizer::vectors_dir())
}

/// As [`vocabulary_sets`], with the vectors directory `dir`.
pub fn vocabulary_sets_in(ctx: &Ctx, contract: &str, dir: &Path) -> (Vec<model::tokenizer::VectorSet>, Vec<String>) {
    let mut sets = model::tokenizer::vector_sets(&ctx.ckb, dir);
    match model::embedded::write_shipped_vectors(&ctx.workshop.root) {
        Ok(shipped) => {
            for d in shipped {
                let name = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                if !sets.iter().any(|s| s.name == name)
                    && let Ok(s) = model::tokenizer::read_vector_set(&ctx.ckb, &d)
                {
                    sets.push(s);
                }
            }
        }
        Err(e) => tracing::warn!("the shipped tokenizer vectors could not be written: {e}"),
    }
    sets.retain(|s| s.contract == contract);
    sets.sort_by(|a, b| a.name.cmp(&b.name));
    let skipped = model::embedded::VOCABULARIES
        .iter()
        .filter(|v| v.contract == contract && !sets.iter().any(|s| s.name == v.name))
        .map(|v| {
            format!(
                "tokenizer vectors {} ({}): not found in {} ($METAINFER_TOKENIZERS) and not shipped with the binary ({}{})",
                v.name,
                v.contract,
                dir.display(),
                v.licence,
                if v.shipped { "; writing the shipped copy failed" } else { "" }
            )
        })
        .collect();
    (sets, skipped)
}

/// The harness command `tokenize` over `sets`, None when there are none. Run here, it names the
/// vocabularies' own folders; in a bundle, each vocabulary's tokenizer.json is copied into the
/// bundle as `vocab.<i>/tokenizer.json` (an altered copy can only fail: the replies are judged
/// against the server's own files), so the bundle runs on a machine without them.
///
/// # Errors
/// Internal when a copy cannot be written.
fn tokenize_command(
    gate: &Gate<'_>,
    h: &super::gate::Harness,
    sets: &[model::tokenizer::VectorSet],
) -> Result<Option<Command>> {
    if sets.is_empty() {
        return Ok(None);
    }
    let mut request = Vec::new();
    for (i, s) in sets.iter().enumerate() {
        let dir = match &gate.mode {
            super::gate::Mode::Direct => s.dir.clone(),
            super::gate::Mode::Write(_) => {
                let to = h.create_dir(&format!("vocab.{i}"))?;
                let bytes = crate::util::read_regular(&s.dir.join("tokenizer.json"), &crate::util::TOKENIZER_JSON)?;
                h.write_new(&format!("vocab.{i}/tokenizer.json"), &bytes)?;
                to
            }
            super::gate::Mode::Read(_) => h.path(&format!("vocab.{i}")),
        };
        request.push(TokenizeSet {
            dir,
            texts: s.cases.iter().map(|c| c.0.clone()).collect(),
            decode: s.cases.iter().map(|c| c.1.clone()).collect(),
        });
    }
    Ok(Some(Command::Tokenize { sets: request }))
}

/// Judge the engine's tokenizer (harness command `tokenize`) on every real vocabulary in `sets`:
/// encode each test text and compare with HF's ids with add_special_tokens = true, which are the
/// vector's ids wrapped in the template's special tokens (checked here, so the reference itself is
/// held to the vectors); decode each vector's ids and compare with HF's decoding with
/// skip_special_tokens = true. `called` is the harness's answer, None when it never ran.
///
/// # Errors
/// When a vocabulary's tokenizer.json cannot be loaded by HF.
fn judge_vectors(
    sets: &[model::tokenizer::VectorSet],
    called: Option<crate::harness::Called>,
) -> Result<Vec<VectorResult>> {
    if sets.is_empty() {
        return Ok(vec![]);
    }
    let failed = |why: String| -> Vec<VectorResult> {
        sets.iter()
            .map(|s| VectorResult {
                vocabulary: s.name.clone(),
                texts: s.cases.len(),
                encode_ok: 0,
                decode_ok: 0,
                error: why.clone(),
            })
            .collect()
    };
    let Some(called) = called else { return Ok(failed("the engine's tokenizer did not run".into())) };
    let replies = match called.ok("engine's tokenizer", 1000) {
        Ok(Reply::Tokenize { sets: r }) if r.len() == sets.len() => r,
        Ok(other) => return Ok(failed(format!("the harness answered tokenize with an unexpected reply: {other:?}"))),
        Err(why) => return Ok(failed(why)),
    };
    let mut results = Vec::new();
    for (set, reply) in sets.iter().zip(replies) {
        let tok = model::hf_tokenizer(&set.dir)?;
        let mut r = VectorResult {
            vocabulary: set.name.clone(),
            texts: set.cases.len(),
            encode_ok: 0,
            decode_ok: 0,
            error: String::new(),
        };
        if let Some(e) = reply.error {
            r.error = format!("Tokenizer::load on {}: {e}", set.dir.display());
            results.push(r);
            continue;
        }
        let mut first = Vec::new();
        for (i, (text, vector)) in set.cases.iter().enumerate() {
            let plain = model::hf_encode_plain(&tok, text)?;
            if &plain != vector {
                first.push(format!("the reference gives {plain:?} for {text:?}, the vector {vector:?} (server fault)"));
                continue;
            }
            let want = model::hf_encode(&tok, text)?;
            match reply.encoded.get(i) {
                Some(e) if e.panic.is_none() && e.ids == want => r.encode_ok += 1,
                Some(e) if e.panic.is_none() => {
                    first.push(format!("encode {text:?}: engine {:?}, reference {want:?}", e.ids))
                }
                Some(e) => first.push(format!("encode {text:?} panicked: {}", e.panic.clone().unwrap_or_default())),
                None => first.push(format!("encode {text:?}: no output")),
            }
            let want_text = model::hf_decode(&tok, vector)?;
            match reply.decoded.get(i) {
                Some(d) if d.panic.is_none() && d.text == want_text => r.decode_ok += 1,
                Some(d) if d.panic.is_none() => {
                    first.push(format!("decode {vector:?}: engine {:?}, reference {want_text:?}", d.text))
                }
                Some(d) => first.push(format!("decode {vector:?} panicked: {}", d.panic.clone().unwrap_or_default())),
                None => first.push(format!("decode {vector:?}: no output")),
            }
        }
        if let Some(f) = first.first() {
            r.error = format!(
                "{f}{}",
                if first.len() > 1 { format!(" (and {} more)", first.len() - 1) } else { String::new() }
            );
        }
        results.push(r);
    }
    Ok(results)
}
