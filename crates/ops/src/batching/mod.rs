//! verify_batching: the serving components of an engine with serving constraints, driven through
//! the harness on inputs drawn from a fresh seed and checked on the server side:
//!
//! 1. the block manager (`component.block_manager`): a random sequence of allocate, append_slot,
//!    free and can_allocate operations on a pool of random size; after every operation its answer,
//!    free count and the touched sequence's block table must equal the server's own account (no
//!    block owned twice, the free count exact, a table only grows at its end while its sequence
//!    lives, refusals change nothing);
//! 2. the batched step (`component.batched_step`): N sequences of different prompt lengths arrive
//!    at different steps and run on a continuous-batching schedule (decode entries beside chunked
//!    prefills under a token budget) over one paged KV cache whose blocks are handed out in random
//!    order; every sequence's logits at every sampled step must equal its single-sequence f64
//!    reference within the family's tolerance, and its greedy tokens exactly.
//!
//! 3. the scheduler (`component.scheduler`): a request trace (arrivals at drawn steps, requests
//!    too long for the context, aborts of live and finished ids, a block pool of one to one and a
//!    half full contexts, so that sequences usually preempt; the count is reported) through the
//!    engine's `Scheduler`, each request's scripted tokens given to `update` as the sampled ones;
//!    every answer, plan and event is checked against the contract's invariants (`check_trace`).
//!
//! Expected values exist only in the server and are computed after the engine's process exited.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::gate::{Gate, Tool};
use super::{Ctx, Report};
use base::error::{Error, Result};
use ckb::Tolerance;
use harness::Budget;

mod blocks;
mod schedule;
mod spec;
#[cfg(test)]
mod tests;
mod trace;

pub use blocks::{BLOCK_OPS, check_block_ops, draw_block_ops};
pub use schedule::{PlannedSeq, schedule};
pub use trace::{Trace, check_trace, draw_trace};

use spec::BatchingSpec;

/// What to verify.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchingRequest {
    /// Engine crate directory (its metainfer.toml must have a `[serving]` table).
    pub engine: String,
    /// Hugging Face model directory with real weights.
    pub model: String,
    /// Sequences in the batched run, 1..=32 (default 6); at most the engine's max_seqs run at once.
    #[serde(default)]
    pub sequences: Option<usize>,
    /// Seed of the drawn operations, prompts and schedule, to replay a run (below 2^53; a decimal
    /// string is accepted too); absent: a fresh one, reported.
    #[serde(default, deserialize_with = "base::util::de_seed")]
    pub seed: Option<u64>,
    /// Weight dtype to build the engine for; absent: the engine's own.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Do not run: build the harness and draw the operations, trace and schedule here, and write
    /// them as a bundle to this directory (new or empty), to run with `metainfer bundle run DIR`
    /// where the device is.
    #[serde(default)]
    pub write_bundle: Option<String>,
    /// Judge and record a bundle written by this gate and run elsewhere (`metainfer bundle run`),
    /// instead of running the engine here. The engine's sources must be the ones it was written from.
    #[serde(default)]
    pub from_bundle: Option<String>,
}

/// The block manager's verdict.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct BlockManagerResult {
    /// Whether every answer matched the server's account.
    pub passed: bool,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Operations run.
    pub ops: usize,
    /// The first violations, each with its operation's index (at most 8).
    pub violations: Vec<String>,
}

/// The scheduler's verdict.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct SchedulerResult {
    /// Whether every answer, plan and event kept the invariants.
    pub passed: bool,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Most running sequences.
    pub max_seqs: usize,
    /// Token budget per step.
    pub max_batch_tokens: usize,
    /// Most positions per sequence.
    pub max_context: usize,
    /// Requests in the trace.
    pub requests: usize,
    /// Requests `add` refused (as it should: too long for the context, or an empty prompt).
    pub refused: usize,
    /// Requests aborted while live.
    pub aborted: usize,
    /// Requests finished (stop or length).
    pub finished: usize,
    /// Steps run.
    pub steps: usize,
    /// Preemptions seen (a live sequence's prefill starting again at position 0).
    pub preemptions: usize,
    /// The first violations, each naming its step (at most 8).
    pub violations: Vec<String>,
}

/// One sequence of the batched run.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SequenceResult {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Greedy tokens asked for.
    pub new_tokens: usize,
    /// Step at which it arrived.
    pub arrival: usize,
    /// Prefill chunks its prompt was split into.
    pub chunks: usize,
    /// Greedy tokens equal the reference's (up to a near-tie, see `tie_at`).
    pub tokens_ok: bool,
    /// Logits within tolerance at every sampled step.
    pub logits_ok: bool,
    /// Steps compared.
    pub steps: usize,
    /// First step whose token differs from the reference, -1 when none.
    pub first_mismatch: i64,
    /// Step at which the reference's best two logits were within tolerance and the engine took the
    /// other one: accepted, comparison stops there. -1 when none.
    pub tie_at: i64,
    /// Largest |engine - reference| logit.
    pub max_abs_err: f64,
}

/// verify_batching's result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct BatchingReport {
    /// Whether the block manager and every sequence passed.
    pub passed: bool,
    /// Seed of this run.
    pub seed: u64,
    /// Weight dtype the engine was built for and the reference ran at.
    pub dtype: String,
    /// Logit tolerance applied.
    pub atol: f64,
    /// Logit tolerance applied.
    pub rtol: f64,
    /// The block manager test.
    pub block_manager: BlockManagerResult,
    /// The scheduler test.
    pub scheduler: SchedulerResult,
    /// Steps of the batched run.
    pub steps: usize,
    /// Most chunks in one step.
    pub max_chunks_per_step: usize,
    /// Token budget of one step in the drawn schedule.
    pub step_budget: usize,
    /// Per sequence.
    pub sequences: Vec<SequenceResult>,
    /// What failed in words (build, crash, missing output), "" when nothing did.
    pub error: String,
    /// Rule findings (check_rules); a blocking one stops the gate.
    pub rules: Vec<guard::Finding>,
}

impl Report for BatchingReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn bundle_written(&self) -> bool {
        crate::gate::wrote_bundle(&self.error)
    }
    fn text(&self) -> String {
        let ok = self.sequences.iter().filter(|s| s.tokens_ok && s.logits_ok).count();
        let verdict = |passed: bool, ran: bool| {
            if passed {
                "ok"
            } else if !ran {
                "not run"
            } else {
                "FAILED"
            }
        };
        let mut s = format!(
            "verify_batching {}: block manager {}, scheduler {}, {ok}/{} sequences equal their single-sequence reference (seed {}, {} weights, logits atol {} rtol {})\n",
            if self.passed { "PASSED" } else { "FAILED" },
            verdict(self.block_manager.passed, self.block_manager.ops > 0),
            verdict(self.scheduler.passed, self.scheduler.requests > 0),
            self.sequences.len(),
            self.seed,
            self.dtype,
            self.atol,
            self.rtol
        );
        if !self.error.is_empty() {
            s += &format!("{}\n", self.error);
        }
        let b = &self.block_manager;
        s += &format!("block manager: {} ops on {} blocks of {}\n", b.ops, b.num_blocks, b.block_size);
        for v in &b.violations {
            s += &format!("   {v}\n");
        }
        let c = &self.scheduler;
        if c.requests > 0 {
            s += &format!(
                "scheduler: {} requests ({} refused, {} aborted, {} finished) in {} steps, {} preemptions; {} blocks of {}, max_seqs {}, {} tokens per step, context {}\n",
                c.requests,
                c.refused,
                c.aborted,
                c.finished,
                c.steps,
                c.preemptions,
                c.num_blocks,
                c.block_size,
                c.max_seqs,
                c.max_batch_tokens,
                c.max_context
            );
        }
        for v in &c.violations {
            s += &format!("   {v}\n");
        }
        if !self.sequences.is_empty() {
            s += &format!(
                "batched run: {} steps, up to {} chunks and {} tokens per step\n",
                self.steps, self.max_chunks_per_step, self.step_budget
            );
        }
        for (i, q) in self.sequences.iter().enumerate() {
            s += &format!(
                "{} seq {i}: prompt {} in {} chunk(s) from step {}, {} tokens: tokens {} logits {} (max abs {}){}\n",
                if q.tokens_ok && q.logits_ok { "ok  " } else { "FAIL" },
                q.prompt_len,
                q.chunks,
                q.arrival,
                q.new_tokens,
                if q.tokens_ok { "ok" } else { "FAIL" },
                if q.logits_ok { "ok" } else { "FAIL" },
                super::sci(q.max_abs_err),
                if q.first_mismatch >= 0 {
                    format!(", first token mismatch at step {}", q.first_mismatch)
                } else {
                    String::new()
                }
            );
        }
        s
    }
}

/// Run verify_batching.
///
/// # Errors
/// Not a crate, no `[serving]` table, unreadable model, outside the workspace, or the harness
/// cannot be started. An engine that fails to build or produces wrong output is a report.
pub fn verify_batching(ctx: &Ctx, req: &BatchingRequest, budget: &Budget) -> Result<BatchingReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::Batching, &req.engine, req.dtype.as_deref(), budget)?;
    let serving = gate.target.serving.clone().ok_or_else(|| {
        Error::usage(format!(
            "{}: metainfer.toml has no [serving] table; verify_batching checks engines built with serving constraints (scaffold with --max-seqs and --max-context)",
            gate.engine.dir.display()
        ))
    })?;
    let ck = super::checkpoint::Checkpoint::open(ctx, &req.model)?;
    let cfg = &ck.cfg;
    let model_dir = ck.path().to_path_buf();
    gate.same_family(&model_dir, &cfg.family)?;
    let (family, fam) = ck.family(&ctx.ckb)?;
    let logits_tol = &fam.logits_tolerance;
    let tol = logits_tol.get(&gate.target.dtype).or_else(|| logits_tol.get("f32")).cloned().unwrap_or(Tolerance {
        atol: 1e-3,
        rtol: 1e-3,
        reasoning: String::new(),
    });
    let n_seqs = req.sequences.unwrap_or(6);
    if n_seqs == 0 || n_seqs > 32 {
        return Err(Error::usage(format!("sequences must be 1..=32, got {n_seqs}")));
    }
    gate.split(req.write_bundle.as_deref(), req.from_bundle.as_deref())?;
    let seed = gate.draw_seed(req.seed)?;
    gate.contracts(&[
        family.id.as_str(),
        "component.block_manager",
        "component.batched_step",
        "component.scheduler",
        "kernel.paged_attention",
    ]);
    let report = BatchingReport {
        passed: false,
        seed,
        dtype: gate.target.dtype.clone(),
        atol: tol.atol,
        rtol: tol.rtol,
        block_manager: BlockManagerResult::default(),
        scheduler: SchedulerResult::default(),
        steps: 0,
        max_chunks_per_step: 0,
        step_budget: 0,
        sequences: vec![],
        error: String::new(),
        rules: vec![],
    };
    let mut spec = BatchingSpec {
        ck: &ck,
        fam,
        tol,
        serving,
        n_seqs,
        seed,
        report,
        ops: vec![],
        trace: None,
        seqs: vec![],
        chunks: vec![],
        tensors_path: std::path::PathBuf::new(),
    };
    gate.run(&mut spec)
}
