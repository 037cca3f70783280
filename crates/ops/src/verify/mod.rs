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
//!
//! One call through the gate run loop (`ops::gate`, spec `VerifySpec`):
//!
//! ```text
//! open, rules, build                  as every harness gate
//! Checkpoint::open                    config, tokenizer route and ids, generation_config (stop ids),
//!                                     weight layout and dtype policy; the weights; the reference
//!                                     (`oracle::llama::Reference::of_family`) at the engine's dtype
//! Command::Generate                   the engine's ids, tokens and logits; it stops at the engine's
//!                                     stop_tokens or the server's
//! Reference::greedy_until (stop ids)  tokens exactly, logits within the family's tolerance for the
//!                                     weight dtype
//! Command::Tokenize                   the engine's tokenizer on the real vocabularies of the same
//!                                     tokenizer contract (same exchange: a bundle holds both)
//! on failing logits                   the failing step localised (`ops::localise`), and diagnosed
//!                                     (`oracle::diagnose::generation`: the reference rerun
//!                                     teacher-forced on the engine's tokens with each model-level
//!                                     mutation, then each graph rewrite of the family's failure
//!                                     contracts; the one that explains the logits names its
//!                                     failure contract)
//! ```

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Ctx;
use super::checkpoint::Checkpoint;
use super::gate::{Gate, Tool};
use base::error::{Error, Result};
use ckb::Tolerance;
use harness::Budget;
use oracle::llama::Reference;

mod prompts;
mod results;
mod spec;
mod traced;
mod vectors;

pub use prompts::{LONG_RUN, random_prompts, rich_alphabet, rich_prompts};
pub use results::{Divergence, PromptResult, VectorResult, VerifyReport};
pub use vectors::vocabulary_sets_in;

use spec::VerifySpec;
use vectors::vocabulary_sets;

/// What to verify.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    #[serde(default, deserialize_with = "base::util::de_seed")]
    pub seed: Option<u64>,
    /// Weight dtype to build the engine for (f32, bf16, f16, int8); absent: the engine's own
    /// (metainfer.toml `dtype`). The reference then runs on the weights as that dtype stores them.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Compare whole logits rows only at the first 8 steps of each prompt, every Nth step and the
    /// last, and at the other steps the engine's 16 largest logits (and any token the reference
    /// ranks above them). Absent: every row whole, unless the rows would exceed 24 MiB (a large
    /// vocabulary: a row of 128,256 tokens is 0.5 MB), then the smallest N that keeps them within;
    /// the first 8 and the last of each prompt are whole whatever N, so where those alone exceed
    /// 24 MiB the report warns with their size.
    #[serde(default)]
    pub logits_every: Option<usize>,
    /// Do not run: build the harness and draw the inputs here, and write them as a bundle to this
    /// directory (new or empty), to run with `metainfer bundle run DIR` where the device is.
    #[serde(default)]
    pub write_bundle: Option<String>,
    /// Judge and record a bundle written by this gate and run elsewhere (`metainfer bundle run`),
    /// instead of running the engine here. The engine's sources must be the ones it was written from.
    #[serde(default)]
    pub from_bundle: Option<String>,
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
    let cfg = &ck.cfg;
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
    let (tokenizer_contract, _) = ck.tokenizer_route(&ctx.ckb)?;
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

    let logits_every = match req.logits_every {
        Some(0) => return Err(Error::usage("logits_every must be at least 1 (1: every logits row whole)")),
        Some(n) => n,
        None => logits_every_within(&budgets, cfg.vocab, WHOLE_LOGITS_BYTES),
    };
    let whole_bytes = whole_rows(&budgets, logits_every) * cfg.vocab * 4;
    if req.logits_every.is_none() && whole_bytes > WHOLE_LOGITS_BYTES {
        warnings.push(format!(
            "the whole logits rows come to {:.1} MiB even at logits_every {logits_every} (each prompt's first {} steps and its last are always whole): a bundle's reply may be too large to travel; use fewer prompts or max_new_tokens",
            whole_bytes as f64 / (1 << 20) as f64,
            harness::protocol::HEAD_ROWS
        ));
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
        logits_every,
    };
    gate.run(&mut spec)
}

/// How many bytes of whole f32 logits rows a verify asks for by default: a bundle's reply travels
/// back from the device (the device machine returns at most 64 MiB), and the rows barely compress.
pub const WHOLE_LOGITS_BYTES: usize = 24 << 20;

/// The smallest `logits_every` whose whole rows ([`harness::protocol::whole_row`]) fit `bytes`
/// for prompts generating `budgets` tokens at most from a vocabulary of `vocab`: 1 when every row
/// fits; otherwise each prompt keeps its first `HEAD_ROWS`, its last and every Nth row, and N grows
/// until they fit (or no row but those is left).
pub fn logits_every_within(budgets: &[usize], vocab: usize, bytes: usize) -> usize {
    let rows_fit = bytes / (4 * vocab.max(1));
    let longest = budgets.iter().copied().max().unwrap_or(0);
    (1..=longest.max(1)).find(|&every| whole_rows(budgets, every) <= rows_fit).unwrap_or(longest.max(2))
}

/// Whole logits rows of prompts generating `budgets` tokens at most under `every`.
fn whole_rows(budgets: &[usize], every: usize) -> usize {
    budgets.iter().map(|&n| (0..n).filter(|&s| harness::protocol::whole_row(s, n, every)).count()).sum()
}

// The diagnosis reruns the first GENERATION_ROWS rows of a failing prompt: they must come back whole.
const _: () = assert!(harness::protocol::HEAD_ROWS >= oracle::diagnose::GENERATION_ROWS);
