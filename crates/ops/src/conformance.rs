//! `ckb conformance`: a family contract checked against an independent implementation's numbers.
//! Each directory holds a tiny checkpoint another implementation wrote (config.json, the weights,
//! tokenizer.json) and `vectors.json` (the format of `../shared/conformance`: per prompt the token
//! ids, that implementation's logits at every prompt position, and its greedy continuation). The
//! config is routed to a family contract as plan routes it, the reference is built from the
//! family's graph (`oracle::llama::Reference::of_family`, f32 weights as stored), run
//! teacher-forced on every prompt's ids, and its logits at every position are compared with the
//! vectors' at the family's conformance bound (`[model.conformance]`, else its f32 logits
//! tolerance, said so); then the reference's own greedy ids are compared with the vectors'. A
//! directory whose config no contract covers is reported as not covered, with the reason.
//!
//! Each covered directory's check is recorded in the ledger as an outcome of `ckb_conformance`
//! under the family's `id@version`, with the vectors' source and sha256. For a model family this is
//! the evidence that counts (`evolve::evidence_gates`): numbers from an implementation its authors
//! wrote, not an engine written to the same contract. A staged family whose check passes is
//! promoted into the CKB working copy; one that fails stays provisional.
//!
//! The shipped folders are checkpoints transformers wrote (config.json as transformers writes it,
//! the logits its f32 computation gives; the reference computes in f64, and each family's contract
//! states the reasoning of its bound). The test
//! `conformance::every_conformance_folder_is_checked_and_the_covered_families_equal_transformers`
//! runs the check on every folder.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Ctx, Report};
use base::error::{Error, Result};
use ckb::Tolerance;
use model::{self, Files};
use oracle::llama::Reference;

/// A `vectors.json` file (the format `../shared/conformance/make_vectors.py` writes).
#[derive(Debug, Clone, Deserialize)]
pub struct Vectors {
    /// The family's name there (transformers' `model_type`).
    #[serde(default)]
    pub family: String,
    /// The implementation's class, e.g. `LlamaForCausalLM`.
    #[serde(default)]
    pub class: String,
    /// The implementation's version, e.g. transformers `5.17.0`.
    #[serde(default)]
    pub transformers: String,
    /// The prompts with their numbers.
    pub prompts: Vec<VectorPrompt>,
}

/// One prompt of a [`Vectors`] file.
#[derive(Debug, Clone, Deserialize)]
pub struct VectorPrompt {
    /// The prompt text.
    #[serde(default)]
    pub text: String,
    /// Its token ids, special tokens included.
    pub ids: Vec<u32>,
    /// Logits at every position: [ids.len()][vocab], f32 values.
    pub logits: Vec<Vec<f32>>,
    /// The implementation's greedy continuation after the prompt.
    pub greedy_ids: Vec<u32>,
    /// Optional: the residual stream at every position, as transformers' `output_hidden_states`
    /// gives it: [n_layers + 1][ids.len()][hidden], entry 0 the embeddings entering layer 0, entry
    /// i (0 < i < n_layers) the output of layer i - 1, and entry n_layers the last layer's output
    /// after the final norm. With them a check that
    /// fails names the layer where the reference first departs (`scripts/conformance-vectors.py`
    /// writes them; `make_vectors.py` does not).
    #[serde(default)]
    pub hidden_states: Vec<Vec<Vec<f32>>>,
}

/// Largest vectors.json read (the shipped ones are about 200 KiB: vocabulary 105, 30 positions).
pub const VECTORS_JSON: base::util::Limit = base::util::Limit {
    what: "conformance vectors (vectors.json)",
    max: 256 << 20,
    hint: "fewer prompts or a smaller vocabulary",
};

/// Where logits first left the bound.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Beyond {
    /// Prompt index in vectors.json.
    pub prompt: usize,
    /// Position in that prompt (0 = the first token).
    pub position: usize,
    /// Vocabulary index of the element furthest outside the bound there.
    pub token: usize,
    /// |reference - vectors| there.
    pub diff: f64,
    /// The decoder layer where the reference first departs, when the vectors carry per-layer
    /// hidden states; null when they hold logits only (as `make_vectors.py` writes them), or when
    /// the departure is before the layers or after them (see `point`).
    pub layer: Option<usize>,
    /// Where the reference first departs from the vectors' hidden states, in position order then
    /// stream order: `position P: embeddings`, `position P: layer L output`, `position P: layer L
    /// output after the final norm` (the last layer, as transformers' last hidden state is); null without hidden states, or when every hidden state is within the bound (the
    /// departure is in the output projection).
    #[serde(default)]
    pub point: Option<String>,
}

/// The check of one directory.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct FamilyConformance {
    /// The directory checked.
    pub dir: String,
    /// The family as the vectors name it (`model_type`), and the implementation that wrote them.
    pub family: String,
    /// e.g. `transformers 5.17.0 (LlamaForCausalLM)`.
    pub source: String,
    /// The contract config.json routes to; null when none does.
    pub contract: Option<String>,
    /// Whether a contract covers this config (routed and resolved without gaps, the reference built).
    pub covered: bool,
    /// Why not covered: each config field at fault with its reason (empty when covered).
    pub not_covered: Vec<model::Gap>,
    /// The bound each logit is held to: |reference - vectors| <= atol + rtol |reference|.
    pub bound: Option<Tolerance>,
    /// Where the bound comes from: `[model.conformance]` or the f32 logits tolerance.
    pub bound_from: String,
    /// Prompts and positions compared.
    pub prompts: usize,
    /// Logit rows compared (one per prompt position).
    pub positions: usize,
    /// Largest |reference - vectors| over every logit of every position.
    pub max_abs_diff: f64,
    /// The first position (prompt by prompt, in order) with a logit beyond the bound.
    pub first_beyond: Option<Beyond>,
    /// Whether the reference's greedy ids equal the vectors' on every prompt.
    pub greedy_equal: bool,
    /// The first prompt whose greedy ids differ: (prompt index, reference ids, vectors' ids).
    pub greedy_mismatch: Option<(usize, Vec<u32>, Vec<u32>)>,
    /// Covered, every logit within the bound and the greedy ids equal.
    pub passed: bool,
    /// sha256 of the directory's vectors.json, hex (recorded with the outcome).
    pub vectors_sha256: String,
    /// sha256 of the routed contract as checked (`evolve::contract_sha256`), recorded with the outcome: a
    /// pass is evidence for exactly this text, not for another proposal at the same version.
    pub contract_sha256: String,
    /// What this check did about the family when it is a staged candidate: promoted it (passed),
    /// or why not.
    pub promotions: Vec<super::evolve::Promotion>,
}

impl FamilyConformance {
    /// One line: the verdict, the largest difference, where the bound was first left.
    pub fn line(&self) -> String {
        if !self.covered {
            let why: Vec<String> = self.not_covered.iter().map(|g| format!("{}: {}", g.field, g.reason)).collect();
            return format!("{:<14} not covered: {}", self.family, why.join("; "));
        }
        let mut s = format!(
            "{:<14} {} {}: max |logit diff| {:.2e} over {} positions ({}), greedy ids {}",
            self.family,
            if self.passed { "passed" } else { "FAILED" },
            self.contract.as_deref().unwrap_or(""),
            self.max_abs_diff,
            self.positions,
            self.bound.as_ref().map_or(String::new(), |b| format!("bound atol {:e} + rtol {:e}", b.atol, b.rtol)),
            if self.greedy_equal { "equal" } else { "DIFFER" },
        );
        if let Some(b) = &self.first_beyond {
            s += &format!(
                "; first beyond the bound: prompt {} position {} token {} (diff {:.2e})",
                b.prompt, b.position, b.token, b.diff
            );
            if let Some(p) = &b.point {
                s += &format!("; hidden states first depart at {p}");
            }
        }
        if let Some((p, ours, theirs)) = &self.greedy_mismatch {
            s += &format!("; prompt {p} greedy: reference {ours:?}, vectors {theirs:?}");
        }
        s
    }
}

impl Report for FamilyConformance {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        format!("ckb conformance {}", self.line())
    }
}

/// The result of `ckb conformance`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ConformanceReport {
    /// One entry per directory, in the order given.
    pub families: Vec<FamilyConformance>,
    /// Directories covered by a contract.
    pub covered: usize,
    /// Whether at least one directory was covered and every covered one passed (a directory not
    /// covered does not fail the report; it is listed as such).
    pub passed: bool,
    /// Paths given that are plain files, not directories (a shell glob such as
    /// `conformance/*` also names the folder's README.md): left out, listed here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped_files: Vec<String>,
}

impl Report for ConformanceReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        let mut s = format!(
            "ckb conformance: {} of {} directories covered, {}\n",
            self.covered,
            self.families.len(),
            if self.passed { "every covered one passed" } else { "FAILED" }
        );
        for p in &self.skipped_files {
            s += &format!("  {p}: a file, not a conformance directory; left out\n");
        }
        for f in &self.families {
            s += &format!("  {}\n", f.line());
            for p in &f.promotions {
                s += &format!("    {}: {}\n", p.contract, p.message);
            }
        }
        s
    }
}

/// Check each directory (see the module doc), record each covered one's outcome and promote a
/// staged family that passed.
///
/// # Errors
/// A directory outside the workspace, or one without a readable vectors.json or config.json. A
/// family not covered, or outside its bound, is a result.
pub fn conformance(ctx: &Ctx, dirs: &[String]) -> Result<ConformanceReport> {
    if dirs.is_empty() {
        return Err(Error::usage("name at least one conformance directory (config.json, weights, vectors.json)"));
    }
    let live = ctx.live();
    let ctx = &*live;
    let mut families = Vec::new();
    let mut skipped_files = Vec::new();
    for d in dirs {
        let full = ctx.workspace.as_ref().map_or_else(|| Path::new(d).to_path_buf(), |w| w.join(d));
        if std::fs::symlink_metadata(&full).is_ok_and(|m| m.is_file()) {
            skipped_files.push(d.clone());
            continue;
        }
        let started = std::time::Instant::now();
        let held = ctx.confine_model(Path::new(d))?;
        let mut f = check_dir(ctx, &held)?;
        if let (true, Some(id)) = (f.covered, f.contract.clone()) {
            let tag = ctx.versioned(&[id.as_str()]);
            let figures = ledger::figures::Figures::Conformance(ledger::figures::ConformanceFigures {
                dir: f.dir.clone(),
                source: f.source.clone(),
                vectors_sha256: f.vectors_sha256.clone(),
                contract_sha256: f.contract_sha256.clone(),
                positions: f.positions,
                max_abs_diff: f.max_abs_diff,
                bound: f.bound.as_ref().map_or((0.0, 0.0), |b| (b.atol, b.rtol)),
                first_beyond: f.first_beyond.as_ref().map(|b| (b.prompt, b.position)),
                greedy_equal: f.greedy_equal,
            });
            ctx.record(TOOL, None, tag.clone(), &f, figures, started);
            if f.passed {
                f.promotions = super::evolve::promote_on_evidence(ctx, TOOL, &tag);
            } else if ctx.ckb.is_provisional(&id) {
                f.promotions.push(super::evolve::Promotion {
                    contract: tag.join(", "),
                    promoted: false,
                    message: "not promoted: its reference disagrees with the independent implementation's vectors; \
                              compare the contract with the model at the prompt position the report names, \
                              propose it again with the version bumped, and check again"
                        .into(),
                });
            }
        }
        families.push(f);
    }
    let covered = families.iter().filter(|f| f.covered).count();
    // Nothing covered is nothing shown.
    let passed = covered > 0 && families.iter().filter(|f| f.covered).all(|f| f.passed);
    Ok(ConformanceReport { families, covered, passed, skipped_files })
}

/// Read and parse `vectors.json` of a directory.
///
/// # Errors
/// Input naming the file when it is missing, too large or malformed, or when a prompt's logits do
/// not have one row per id.
pub fn read_vectors(dir: &(impl Files + ?Sized)) -> Result<Vectors> {
    read_vectors_text(dir).map(|(v, _)| v)
}

/// As [`read_vectors`], with the sha256 (hex) of exactly the text parsed.
fn read_vectors_text(dir: &(impl Files + ?Sized)) -> Result<(Vectors, String)> {
    let path = dir.show("vectors.json");
    let text = dir.read_text("vectors.json", &VECTORS_JSON)?;
    let sha = model::embedded::sha256_hex(text.as_bytes());
    let v: Vectors = serde_json::from_str(&text)
        .map_err(|e| Error::input(format!("{}: not a conformance vectors file ({e})", path.display())))?;
    // Evidence needs numbers: an empty file would pass every comparison vacuously.
    if v.prompts.is_empty() {
        return Err(Error::input(format!("{}: holds no prompts; evidence needs at least one", path.display())));
    }
    let width = v.prompts[0].logits.first().map_or(0, Vec::len);
    for (i, p) in v.prompts.iter().enumerate() {
        if p.ids.is_empty() || p.logits.len() != p.ids.len() {
            return Err(Error::input(format!(
                "{}: prompt {i} has {} ids and {} logit rows; one row per position is needed",
                path.display(),
                p.ids.len(),
                p.logits.len()
            )));
        }
        if p.greedy_ids.is_empty() {
            return Err(Error::input(format!(
                "{}: prompt {i} has no greedy_ids; the implementation's greedy continuation is part of the evidence",
                path.display()
            )));
        }
        if let Some(j) = p.logits.iter().position(|row| row.len() != width || row.is_empty()) {
            return Err(Error::input(format!(
                "{}: prompt {i} position {j} has {} logits where the first row has {width}; every row holds the whole vocabulary",
                path.display(),
                p.logits[j].len()
            )));
        }
    }
    Ok((v, sha))
}

/// Where the reference's residual stream first leaves `bound` against the prompt's hidden states,
/// over positions 0..=`upto` (module doc of [`VectorPrompt::hidden_states`]): (decoder layer, point
/// in words); (None, None) when every hidden state is within the bound.
///
/// # Errors
/// Input naming the file when the hidden states do not have the shape [n_layers + 1][positions][hidden].
fn localise(
    reference: &mut Reference,
    family: &ckb::ModelFamily,
    cfg: &model::ResolvedConfig,
    p: &VectorPrompt,
    upto: usize,
    bound: &Tolerance,
    path: &Path,
) -> Result<(Option<usize>, Option<String>)> {
    let (l, hs) = (cfg.n_layers, &p.hidden_states);
    if hs.len() != l + 1 || hs.iter().any(|e| e.len() != p.ids.len() || e.iter().any(|r| r.len() != cfg.hidden)) {
        return Err(Error::input(format!(
            "{}: hidden_states must be [n_layers + 1 = {}][positions = {}][hidden = {}] (transformers' output_hidden_states)",
            path.display(),
            l + 1,
            p.ids.len(),
            cfg.hidden
        )));
    }
    let graph = family.graph.as_ref().expect("checked above");
    let (Some(embed), Some(last), Some(norm)) = (graph.prologue.last(), graph.layer.last(), graph.epilogue.first())
    else {
        return Ok((None, None));
    };
    // The trace names of the stream entries, in order.
    let mut names = vec![(embed.name.clone(), None, "embeddings".to_string())];
    let before_last = l.saturating_sub(1);
    names.extend((0..before_last).map(|i| (format!("layers.{i}.{}", last.name), Some(i), format!("layer {i} output"))));
    names.push((norm.name.clone(), Some(before_last), format!("layer {before_last} output after the final norm")));
    reference.reset();
    for (pos, &id) in p.ids.iter().enumerate().take(upto + 1) {
        let (_, trace) = reference.step_traced(id)?;
        for (k, (name, layer, words)) in names.iter().enumerate() {
            let Some((_, ours)) = trace.iter().find(|(n, _)| n == name) else { continue };
            if !oracle::compare::compare(&hs[k][pos], ours, bound).ok {
                return Ok((*layer, Some(format!("position {pos}: {words}"))));
            }
        }
    }
    Ok((None, None))
}

/// The loosest bound a staged family is held to (atol, rtol): the one every shipped family states
/// in `[model.conformance]` (transformers' f32 against the f64 reference differ by 1e-7 to 6e-6 on
/// the conformance checkpoints; a wrong detail moves logits by 1e-2 and more).
pub const STAGED_BOUND: Tolerance = Tolerance { atol: 1e-4, rtol: 1e-4, reasoning: String::new() };

/// The ledger's name for a conformance check (an outcome's `tool`).
pub const TOOL: &str = super::evolve::CONFORMANCE;

fn check_dir(ctx: &Ctx, dir: &(impl Files + ?Sized)) -> Result<FamilyConformance> {
    let (vectors, vectors_sha256) = read_vectors_text(dir)?;
    let config = model::read_config(dir)?;
    let name = config.get("model_type").and_then(Value::as_str).unwrap_or(&vectors.family).to_string();
    let mut out = FamilyConformance {
        dir: dir.path().display().to_string(),
        family: name,
        source: format!("transformers {} ({})", vectors.transformers, vectors.class),
        contract: None,
        covered: false,
        not_covered: Vec::new(),
        bound: None,
        bound_from: String::new(),
        prompts: vectors.prompts.len(),
        positions: 0,
        max_abs_diff: 0.0,
        first_beyond: None,
        greedy_equal: false,
        greedy_mismatch: None,
        passed: false,
        vectors_sha256,
        contract_sha256: String::new(),
        promotions: Vec::new(),
    };
    let contract = match model::route(&ctx.ckb, &config) {
        Ok(c) => c,
        Err(gaps) => {
            out.not_covered = gaps;
            return Ok(out);
        }
    };
    out.contract = Some(contract.id.clone());
    out.contract_sha256 = super::evolve::contract_sha256(contract);
    let cfg = match model::resolve(contract, &config) {
        Ok(c) => c,
        Err(gaps) => {
            out.not_covered = gaps;
            return Ok(out);
        }
    };
    let family = contract.model.as_ref().expect("model contract");
    if family.graph.is_none() {
        out.not_covered.push(model::Gap {
            field: "model.graph".into(),
            reason: format!(
                "{} states no [model.graph]: conformance holds a family's graph to the vectors, and without one the \
                 reference would be the built-in Llama pass, not this contract",
                contract.id
            ),
        });
        return Ok(out);
    }
    let (bound, from) = match (&family.conformance, family.logits_tolerance.get("f32")) {
        (Some(b), _) => (b.clone(), "[model.conformance]".to_string()),
        (None, Some(t)) => (
            t.clone(),
            format!("{}'s f32 logits tolerance (the family states no [model.conformance] bound)", contract.id),
        ),
        (None, None) => {
            out.not_covered.push(model::Gap {
                field: "model.conformance".into(),
                reason: format!("{} states no conformance bound and no f32 logits tolerance", contract.id),
            });
            return Ok(out);
        }
    };
    // A staged family does not choose how loosely it is held: at most the bound every shipped
    // family states.
    let (bound, from) = if ctx.ckb.is_provisional(&contract.id)
        && (bound.atol > STAGED_BOUND.atol || bound.rtol > STAGED_BOUND.rtol)
    {
        (
            Tolerance { atol: bound.atol.min(STAGED_BOUND.atol), rtol: bound.rtol.min(STAGED_BOUND.rtol), ..bound },
            format!(
                "{from}, capped at atol {:e} + rtol {:e}: a staged family is held at most as loosely as the shipped ones",
                STAGED_BOUND.atol, STAGED_BOUND.rtol
            ),
        )
    } else {
        (bound, from)
    };
    out.bound = Some(bound.clone());
    out.bound_from = from;
    let tensors = model::read_safetensors(dir)?;
    let mut reference = match Reference::of_family(family, &cfg, tensors, "f32") {
        Ok(r) => r,
        Err(e) => {
            out.not_covered.push(model::Gap { field: "model.graph".into(), reason: e.message });
            return Ok(out);
        }
    };
    let width = vectors.prompts[0].logits[0].len();
    if width != cfg.vocab {
        return Err(Error::input(format!(
            "{}: the vectors' logit rows hold {width} values and config.json's vocab_size is {}; they were not written for this checkpoint",
            dir.show("vectors.json").display(),
            cfg.vocab
        )));
    }
    if let Some((i, p)) =
        vectors.prompts.iter().enumerate().find(|(_, p)| p.ids.iter().any(|&t| t as usize >= cfg.vocab))
    {
        return Err(Error::input(format!(
            "{}: prompt {i} ({:?}) holds a token id outside the vocabulary of {}",
            dir.show("vectors.json").display(),
            p.text,
            cfg.vocab
        )));
    }
    out.covered = true;
    let mut all_within = true;
    out.greedy_equal = true;
    for (pi, p) in vectors.prompts.iter().enumerate() {
        reference.reset();
        for (pos, (&id, want)) in p.ids.iter().zip(&p.logits).enumerate() {
            let ours = reference.step(id)?;
            out.positions += 1;
            let v = oracle::compare::compare(want, &ours, &bound);
            out.max_abs_diff = out.max_abs_diff.max(v.max_abs_err);
            if !v.ok {
                all_within = false;
                if out.first_beyond.is_none() {
                    let t = v.worst_index;
                    let diff = match (want.get(t), ours.get(t)) {
                        (Some(a), Some(b)) => (*a as f64 - b).abs(),
                        _ => oracle::compare::UNWRITTEN,
                    };
                    out.first_beyond =
                        Some(Beyond { prompt: pi, position: pos, token: t, diff, layer: None, point: None });
                }
            }
        }
        if let Some(b) = out.first_beyond.as_mut().filter(|b| b.prompt == pi && b.point.is_none())
            && !p.hidden_states.is_empty()
        {
            (b.layer, b.point) =
                localise(&mut reference, family, &cfg, p, b.position, &bound, &dir.show("vectors.json"))?;
        }
        let (_, ids) = reference.greedy(&p.ids, p.greedy_ids.len())?;
        if ids != p.greedy_ids && out.greedy_mismatch.is_none() {
            out.greedy_equal = false;
            out.greedy_mismatch = Some((pi, ids, p.greedy_ids.clone()));
        }
    }
    out.passed = all_within && out.greedy_equal;
    Ok(out)
}
