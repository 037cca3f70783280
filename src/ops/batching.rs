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
//!    too long for the context, aborts of live and finished ids, a block pool small enough to force
//!    preemption) through the engine's `Scheduler`, each request's scripted tokens given to
//!    `update` as the sampled ones; every answer, plan and event is checked against the
//!    contract's invariants (`check_trace`).
//!
//! Expected values exist only in the server and are computed after the engine's process exited.

use std::collections::BTreeMap;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::gate::{Commands, Gate, Harness, Spec, Tool, Verdict as GateVerdict};
use super::{Ctx, Report};
use crate::ckb::Tolerance;
use crate::error::{Error, Result};
use crate::harness::protocol::{
    BatchSeq, BlockOp, BlockOpResult, Command, Reply, SchedulerStep, StepEntry, TraceRequest,
};
use crate::harness::{Budget, Called};
use crate::ledger::figures::{BatchingFigures, Figures};
use crate::oracle::llama::Reference;

/// What to verify.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
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
    #[serde(default, deserialize_with = "crate::util::de_seed")]
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
    pub rules: Vec<crate::guard::Finding>,
}

impl Report for BatchingReport {
    fn passed(&self) -> bool {
        self.passed
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

/// Operations of the block-manager test.
pub const BLOCK_OPS: usize = 400;

/// Draw the block-manager test: pool size, block size and operations (on a few sequence ids, some
/// never allocated, some allocated twice, sizes up to a third of the pool).
pub fn draw_block_ops(rng: &mut ChaCha8Rng) -> (usize, usize, Vec<BlockOp>) {
    let num_blocks = rng.random_range(4..=48);
    let block_size = rng.random_range(1..=16);
    let ids: Vec<u64> = (0..8).map(|_| rng.random_range(0..(1u64 << 53))).collect();
    let most = (num_blocks * block_size / 3).max(1);
    let ops = (0..BLOCK_OPS)
        .map(|_| {
            let seq = ids[rng.random_range(0..ids.len())];
            match rng.random_range(0..20) {
                0..=5 => BlockOp::Allocate { seq, n_tokens: rng.random_range(0..=most) },
                6..=13 => BlockOp::Append { seq },
                14..=16 => BlockOp::Free { seq },
                _ => BlockOp::CanAllocate { n_tokens: rng.random_range(0..=num_blocks * block_size + 2) },
            }
        })
        .collect();
    (num_blocks, block_size, ops)
}

/// Check the block manager's answers against the server's own account of the pool (see the
/// module doc). Returns the violations, each naming its operation.
pub fn check_block_ops(
    num_blocks: usize,
    block_size: usize,
    ops: &[BlockOp],
    results: &[BlockOpResult],
    tables: &[(u64, Vec<u32>)],
) -> Vec<String> {
    let mut bad = Vec::new();
    // Live sequences: (length, block table as the engine reported it when it grew).
    let mut live: BTreeMap<u64, (usize, Vec<u32>)> = BTreeMap::new();
    let mut owner: BTreeMap<u32, u64> = BTreeMap::new();
    if results.len() != ops.len() {
        bad.push(format!("{} answers for {} operations", results.len(), ops.len()));
    }
    for (i, (op, r)) in ops.iter().zip(results).enumerate() {
        let free = num_blocks - owner.len();
        let mut note = |m: String| bad.push(format!("op {i} {op:?}: {m}"));
        match op {
            BlockOp::CanAllocate { n_tokens } => {
                let want = n_tokens.div_ceil(block_size) <= free;
                if r.ok != want {
                    note(format!("can_allocate answered {}, but {free} of {num_blocks} blocks are free", r.ok));
                }
            }
            BlockOp::Allocate { seq, n_tokens } => {
                let need = n_tokens.div_ceil(block_size);
                let want = !live.contains_key(seq) && need <= free;
                if r.ok != want {
                    note(format!(
                        "allocate returned {}, expected {} ({need} blocks needed, {free} free, sequence {})",
                        if r.ok { "Ok" } else { "Err" },
                        if want { "Ok" } else { "Err" },
                        if live.contains_key(seq) { "already live" } else { "new" }
                    ));
                } else if r.ok {
                    if r.table.len() != need {
                        note(format!("block table has {} blocks, {need} expected", r.table.len()));
                    }
                    for &b in &r.table {
                        if b as usize >= num_blocks {
                            note(format!("block {b} is outside the pool of {num_blocks}"));
                        } else if let Some(o) = owner.insert(b, *seq) {
                            note(format!("block {b} handed out again while sequence {o} owns it"));
                        }
                    }
                    live.insert(*seq, (*n_tokens, r.table.clone()));
                }
            }
            BlockOp::Append { seq } => {
                let want = live.get(seq).is_some_and(|(len, _)| !len.is_multiple_of(block_size) || free > 0);
                if r.ok != want {
                    note(format!(
                        "append_slot returned {}, expected {}",
                        if r.ok { "Ok" } else { "Err" },
                        if want { "Ok" } else { "Err" }
                    ));
                } else if r.ok {
                    let (len, table) = live.get_mut(seq).expect("live");
                    let grows = len.is_multiple_of(block_size);
                    *len += 1;
                    let keep = r.table.len() == table.len() + usize::from(grows) && r.table.starts_with(table);
                    if !keep {
                        note(format!(
                            "block table {:?} -> {:?}: it must keep its blocks and grow by {} at its end",
                            table,
                            r.table,
                            usize::from(grows)
                        ));
                    } else if grows {
                        let b = *r.table.last().expect("grew");
                        if b as usize >= num_blocks {
                            note(format!("block {b} is outside the pool of {num_blocks}"));
                        } else if let Some(o) = owner.insert(b, *seq) {
                            note(format!("block {b} handed out again while sequence {o} owns it"));
                        }
                    }
                    *table = r.table.clone();
                }
            }
            BlockOp::Free { seq } => {
                if let Some((_, table)) = live.remove(seq) {
                    for b in table {
                        owner.remove(&b);
                    }
                }
                if !r.table.is_empty() {
                    note(format!("a freed sequence still has blocks {:?}", r.table));
                }
            }
        }
        let want_free = num_blocks - owner.len();
        if r.free != want_free {
            bad.push(format!("op {i} {op:?}: num_free_blocks says {}, {want_free} are free", r.free));
        }
        if bad.len() >= 8 {
            return bad;
        }
    }
    let reported: BTreeMap<u64, &Vec<u32>> = tables.iter().map(|(s, t)| (*s, t)).collect();
    for (seq, (_, table)) in &live {
        if reported.get(seq).is_some_and(|t| *t != table) {
            bad.push(format!("at the end, sequence {seq} reads blocks {:?}, it was given {table:?}", reported[seq]));
        }
    }
    bad.truncate(8);
    bad
}

/// The scheduler test's trace, as the server draws it.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Blocks in the pool (enough for one full context, at most two: running sequences compete).
    pub num_blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Most running sequences.
    pub max_seqs: usize,
    /// Token budget per step (>= max_seqs).
    pub max_batch_tokens: usize,
    /// Most positions per sequence.
    pub max_context: usize,
    /// The requests.
    pub requests: Vec<TraceRequest>,
    /// (step, id) aborts.
    pub aborts: Vec<(usize, u64)>,
    /// Most steps the harness runs.
    pub max_steps: usize,
}

/// Token ids of the scheduler trace are below this: few, so scripted tokens hit EOS ids often.
const TRACE_VOCAB: usize = 32;

/// Draw a scheduler trace (see the module doc): 6 to 14 requests arriving in the first 9 steps,
/// about one in ten too long for the context and one in twenty with an empty prompt, half with
/// one or two EOS ids, up to two aborts of drawn ids in the first 13 steps.
pub fn draw_trace(rng: &mut ChaCha8Rng) -> Trace {
    let block_size: usize = rng.random_range(1..=8);
    let max_context: usize = rng.random_range(8..=48);
    let per_seq = max_context.div_ceil(block_size);
    let num_blocks = rng.random_range(per_seq..=per_seq * 2);
    let max_seqs = rng.random_range(2..=6);
    let max_batch_tokens = rng.random_range(max_seqs..=max_seqs + 32);
    let n = rng.random_range(6..=14);
    let mut requests: Vec<TraceRequest> = Vec::new();
    while requests.len() < n {
        let id = rng.random_range(0..(1u64 << 53));
        if requests.iter().any(|r| r.id == id) {
            continue;
        }
        let (prompt_len, max_tokens) = match rng.random_range(0..20) {
            0 => (0, rng.random_range(1..=4)),
            1 | 2 => {
                let p = rng.random_range(1..=max_context);
                (p, max_context - p + rng.random_range(1..=4))
            }
            _ => {
                let p = rng.random_range(1..=(max_context - 1).min(30));
                (p, rng.random_range(1..=(max_context - p).min(12)))
            }
        };
        let eos: Vec<u32> = match rng.random_range(0..4) {
            0 => vec![rng.random_range(0..TRACE_VOCAB as u32)],
            1 => (0..2).map(|_| rng.random_range(0..TRACE_VOCAB as u32)).collect(),
            _ => vec![],
        };
        requests.push(TraceRequest {
            id,
            arrival: rng.random_range(0..=8),
            prompt: (0..prompt_len).map(|_| rng.random_range(0..TRACE_VOCAB as u32)).collect(),
            max_tokens,
            eos,
            script: (0..max_tokens).map(|_| rng.random_range(0..TRACE_VOCAB as u32)).collect(),
        });
    }
    let aborts =
        (0..rng.random_range(0..=2)).map(|_| (rng.random_range(0..=12), requests[rng.random_range(0..n)].id)).collect();
    Trace { num_blocks, block_size, max_seqs, max_batch_tokens, max_context, requests, aborts, max_steps: 4000 }
}

/// A request as `check_trace` follows it.
#[derive(Default)]
struct Followed {
    admitted: bool,
    done: bool,
    generated: Vec<u32>,
    cached: usize,
    table: Vec<u32>,
}

/// Check the scheduler's recorded steps against the trace and the contract's invariants: `add`
/// refuses exactly the requests that cannot fit the context or the pool (or have an empty prompt,
/// or max_tokens 0); `abort` answers true exactly for a live request, which is never seen again; per
/// step at most max_batch_tokens tokens and max_seqs sequences, one chunk each; each chunk starts
/// where its sequence's cache ends (or at 0 after a preemption), holds the sequence's own tokens,
/// ends within it, `samples` exactly when it ends at its last token, and has a block table long
/// enough, in the pool and shared with no other chunk of the step; each sampling chunk yields one
/// token, the scripted one, and a sequence finishes in that step exactly when that token is an EOS
/// id (stop) or it reaches max_tokens or max_context (length); every admitted request ends; and the
/// pool is whole again at the end. Returns the violations (at most 8) and fills the counts of `out`.
pub fn check_trace(trace: &Trace, steps: &[SchedulerStep], out: &mut SchedulerResult) -> Vec<String> {
    let mut bad: Vec<String> = Vec::new();
    let by_id: BTreeMap<u64, &TraceRequest> = trace.requests.iter().map(|r| (r.id, r)).collect();
    let mut st: BTreeMap<u64, Followed> = BTreeMap::new();
    let bs = trace.block_size;
    out.steps = steps.len();
    for (si, step) in steps.iter().enumerate() {
        let mut note = |m: String| bad.push(format!("step {si}: {m}"));
        for (id, err) in &step.added {
            let Some(r) = by_id.get(id) else {
                note(format!("add of unknown request {id}"));
                continue;
            };
            let total = r.prompt.len() + r.max_tokens;
            let refuse = r.prompt.is_empty()
                || r.max_tokens == 0
                || total > trace.max_context
                || total.div_ceil(bs) > trace.num_blocks;
            match (err, refuse) {
                (Some(e), false) => note(format!(
                    "add refused request {id} ({} prompt tokens + {} new within the context of {}): {e}",
                    r.prompt.len(),
                    r.max_tokens,
                    trace.max_context
                )),
                (None, true) => note(format!(
                    "add accepted request {id} ({} prompt tokens + {} new, context {}): it can never run and must be refused",
                    r.prompt.len(),
                    r.max_tokens,
                    trace.max_context
                )),
                (Some(_), true) => out.refused += 1,
                (None, false) => st.entry(*id).or_default().admitted = true,
            }
        }
        for (id, answer) in &step.aborted {
            let live = st.get(id).is_some_and(|f| f.admitted && !f.done);
            if *answer != live {
                note(format!(
                    "abort({id}) answered {answer}, but the request is {}",
                    if live { "live" } else { "not live (finished, aborted, refused or never added)" }
                ));
            }
            if live {
                st.get_mut(id).expect("live").done = true;
                out.aborted += 1;
            }
        }
        // The plan.
        let tokens: usize = step.plan.iter().map(|p| p.tokens.len()).sum();
        if tokens > trace.max_batch_tokens {
            note(format!("{tokens} tokens planned, over the budget of {} per step", trace.max_batch_tokens));
        }
        if step.plan.len() > trace.max_seqs {
            note(format!("{} sequences planned, over max_seqs {}", step.plan.len(), trace.max_seqs));
        }
        let mut owner: BTreeMap<u32, u64> = BTreeMap::new();
        let mut seen: Vec<u64> = Vec::new();
        let mut sampling: Vec<u64> = Vec::new();
        for p in &step.plan {
            if seen.contains(&p.id) {
                note(format!("request {} has two chunks in one step", p.id));
                continue;
            }
            seen.push(p.id);
            let (Some(r), Some(f)) = (by_id.get(&p.id), st.get_mut(&p.id)) else {
                note(format!("plans request {}, which was never admitted", p.id));
                continue;
            };
            if f.done {
                note(format!("plans request {}, which has finished or was aborted", p.id));
                continue;
            }
            let own: Vec<u32> = r.prompt.iter().chain(&f.generated).copied().collect();
            if p.start == 0 && f.cached > 0 {
                out.preemptions += 1;
                f.cached = 0;
                f.table.clear();
            }
            let end = p.start + p.tokens.len();
            if p.tokens.is_empty() {
                note(format!("request {}: an empty chunk", p.id));
            } else if p.start != f.cached {
                note(format!(
                    "request {}: chunk at positions {}..{end}, but {} positions are cached (a gap or an overlap)",
                    p.id, p.start, f.cached
                ));
            } else if end > own.len() {
                note(format!("request {}: chunk runs to position {end}, the sequence has {}", p.id, own.len()));
            } else if p.tokens != own[p.start..end] {
                note(format!(
                    "request {}: chunk at {} holds {:?}, the sequence's tokens are {:?}",
                    p.id,
                    p.start,
                    p.tokens,
                    &own[p.start..end]
                ));
            } else if p.samples != (end == own.len()) {
                note(format!("request {}: chunk ending at {end} of {} has samples = {}", p.id, own.len(), p.samples));
            }
            if p.block_table.len() < end.div_ceil(bs) {
                note(format!(
                    "request {}: block table {:?} holds {} positions, the chunk reaches {end}",
                    p.id,
                    p.block_table,
                    p.block_table.len() * bs
                ));
            }
            if !f.table.is_empty() && !p.block_table.starts_with(&f.table) {
                note(format!(
                    "request {}: block table {:?} changed to {:?} while it lived",
                    p.id, f.table, p.block_table
                ));
            }
            for &b in &p.block_table {
                if b as usize >= trace.num_blocks {
                    note(format!("request {}: block {b} is outside the pool of {}", p.id, trace.num_blocks));
                } else if let Some(o) = owner.insert(b, p.id).filter(|o| *o != p.id) {
                    note(format!("block {b} is in the tables of requests {o} and {} in one step", p.id));
                }
            }
            f.cached = end.max(f.cached);
            f.table = p.block_table.clone();
            if p.samples {
                sampling.push(p.id);
            }
        }
        // The events.
        let mut due: BTreeMap<u64, &str> = BTreeMap::new();
        let mut got_token: Vec<u64> = Vec::new();
        for e in &step.events {
            let Some(f) = st.get_mut(&e.id) else {
                note(format!("an event for request {}, which was never admitted", e.id));
                continue;
            };
            let r = by_id[&e.id];
            match (&e.token, &e.finish) {
                (Some(t), None) => {
                    if !sampling.contains(&e.id) || got_token.contains(&e.id) {
                        note(format!("request {}: token {t} without a sampling chunk for it in this step", e.id));
                        continue;
                    }
                    got_token.push(e.id);
                    let want = r.script.get(f.generated.len()).copied();
                    if Some(*t) != want {
                        note(format!(
                            "request {}: token {t} as its token {}, it was given {want:?}",
                            e.id,
                            f.generated.len()
                        ));
                    }
                    f.generated.push(*t);
                    if r.eos.contains(t) {
                        due.insert(e.id, "stop");
                    } else if f.generated.len() >= r.max_tokens
                        || r.prompt.len() + f.generated.len() >= trace.max_context
                    {
                        due.insert(e.id, "length");
                    }
                }
                (None, Some(why)) => {
                    match due.remove(&e.id) {
                        Some(want) if want == why => {}
                        Some(want) => note(format!("request {} finished with {why:?}, the reason is {want:?}", e.id)),
                        None => note(format!(
                            "request {} finished ({why}) after {} tokens, with no EOS id and below max_tokens {}",
                            e.id,
                            f.generated.len(),
                            r.max_tokens
                        )),
                    }
                    if f.done {
                        note(format!("request {} finished twice, or after its abort", e.id));
                    }
                    f.done = true;
                    out.finished += 1;
                }
                _ => note(format!("request {}: an event with neither a token nor a finish", e.id)),
            }
        }
        for id in sampling.iter().filter(|id| !got_token.contains(id)) {
            note(format!("request {id}: its chunk ended the sequence, but no token was sampled"));
        }
        for (id, why) in &due {
            note(format!("request {id} must finish ({why}) after token {}, it went on", st[id].generated.len()));
            st.get_mut(id).expect("followed").done = true;
        }
        // Blocks the step's live sequences hold cannot be free.
        let held: usize =
            step.plan.iter().filter(|p| st.get(&p.id).is_some_and(|f| !f.done)).map(|p| p.block_table.len()).sum();
        if step.free_blocks + held > trace.num_blocks {
            note(format!(
                "free_blocks says {}, but the live sequences of this step hold {held} of the {} blocks",
                step.free_blocks, trace.num_blocks
            ));
        }
        if bad.len() >= 8 {
            bad.truncate(8);
            return bad;
        }
    }
    let open: Vec<u64> = st.iter().filter(|(_, f)| f.admitted && !f.done).map(|(id, _)| *id).collect();
    if !open.is_empty() {
        bad.push(format!("after {} steps, admitted requests never finished: {open:?}", steps.len()));
    }
    if let Some(last) = steps.last()
        && open.is_empty()
        && last.free_blocks != trace.num_blocks
    {
        bad.push(format!(
            "after every request ended, free_blocks says {} of {}: blocks leaked",
            last.free_blocks, trace.num_blocks
        ));
    }
    bad.truncate(8);
    bad
}

/// One sequence of the batched run as the server draws it.
#[derive(Debug, Clone)]
pub struct PlannedSeq {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Greedy tokens.
    pub new_tokens: usize,
    /// Step it arrives at.
    pub arrival: usize,
}

/// A continuous-batching schedule: per step, decode entries of every sequence whose prompt is done
/// (one token each), then prefill chunks of arrived sequences in arrival order, each at most `cap`
/// tokens, within `budget` tokens per step and `max_seqs` running sequences. Returns the steps
/// and each sequence's number of prefill chunks.
pub fn schedule(seqs: &[PlannedSeq], budget: usize, max_seqs: usize, cap: usize) -> (Vec<Vec<StepEntry>>, Vec<usize>) {
    let mut done = vec![0usize; seqs.len()];
    let mut generated = vec![0usize; seqs.len()];
    let mut chunks = vec![0usize; seqs.len()];
    let mut steps = Vec::new();
    let finished = |s: usize, g: &[usize]| g[s] >= seqs[s].new_tokens;
    for t in 0..100_000 {
        if (0..seqs.len()).all(|s| finished(s, &generated)) {
            break;
        }
        let mut left = budget;
        let mut entries = Vec::new();
        // Running: arrived, not finished, at most max_seqs in arrival order.
        let mut order: Vec<usize> =
            (0..seqs.len()).filter(|&s| seqs[s].arrival <= t && !finished(s, &generated)).collect();
        order.sort_by_key(|&s| (seqs[s].arrival, s));
        order.truncate(max_seqs);
        for &s in &order {
            if done[s] >= seqs[s].prompt.len() && left > 0 {
                entries.push(StepEntry { seq: s, tokens: 1 });
                left -= 1;
            }
        }
        for &s in &order {
            let rest = seqs[s].prompt.len().saturating_sub(done[s]);
            if rest > 0 && left > 0 {
                let n = rest.min(left).min(cap);
                entries.push(StepEntry { seq: s, tokens: n });
                left -= n;
            }
        }
        for e in &entries {
            let s = e.seq;
            if done[s] < seqs[s].prompt.len() {
                chunks[s] += 1;
                done[s] += e.tokens;
                if done[s] == seqs[s].prompt.len() {
                    generated[s] += 1;
                }
            } else {
                done[s] += 1;
                generated[s] += 1;
            }
        }
        steps.push(entries);
    }
    // Drop trailing empty steps (nothing arrived yet is not a step worth running).
    let steps: Vec<Vec<StepEntry>> = steps.into_iter().filter(|e| !e.is_empty()).collect();
    (steps, chunks)
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

/// verify_batching as a [`Spec`]: the drawn block operations, request trace and batched schedule.
struct BatchingSpec<'c> {
    ck: &'c super::checkpoint::Checkpoint,
    fam: &'c crate::ckb::ModelFamily,
    tol: Tolerance,
    serving: crate::manifest::Serving,
    n_seqs: usize,
    seed: u64,
    /// The report as far as it is known before the engine runs.
    report: BatchingReport,
    ops: Vec<BlockOp>,
    trace: Option<Trace>,
    seqs: Vec<PlannedSeq>,
    /// Prefill chunks per sequence in the schedule.
    chunks: Vec<usize>,
    tensors_path: std::path::PathBuf,
}

impl Spec for BatchingSpec<'_> {
    type Report = BatchingReport;

    fn unjudged(&self, gate: &Gate, why: String) -> BatchingReport {
        BatchingReport { error: why, rules: gate.findings.clone(), ..self.report.clone() }
    }

    fn commands(&mut self, _gate: &Gate, h: &Harness) -> Result<Commands> {
        let (seed, cfg, serving) = (self.seed, &self.ck.cfg, &self.serving);
        let report = &mut self.report;
        // 1. The block manager.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ crate::util::fnv1a("component.block_manager"));
        let (num_blocks, block_size, ops) = draw_block_ops(&mut rng);
        report.block_manager = BlockManagerResult { num_blocks, block_size, ops: ops.len(), ..Default::default() };
        let block_manager = Command::BlockManager { num_blocks, block_size, ops: ops.clone() };
        self.ops = ops;

        // 2. The scheduler on a request trace.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ crate::util::fnv1a("component.scheduler"));
        let trace = draw_trace(&mut rng);
        report.scheduler = SchedulerResult {
            num_blocks: trace.num_blocks,
            block_size: trace.block_size,
            max_seqs: trace.max_seqs,
            max_batch_tokens: trace.max_batch_tokens,
            max_context: trace.max_context,
            requests: trace.requests.len(),
            ..Default::default()
        };
        let scheduler = Command::Scheduler {
            num_blocks: trace.num_blocks,
            block_size: trace.block_size,
            max_seqs: trace.max_seqs,
            max_batch_tokens: trace.max_batch_tokens,
            max_context: trace.max_context,
            requests: trace.requests.clone(),
            aborts: trace.aborts.clone(),
            max_steps: trace.max_steps,
        };
        self.trace = Some(trace);

        // 3. The batched step on a continuous-batching schedule.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ crate::util::fnv1a("component.batched_step"));
        let context = serving.max_context.min(cfg.max_seq);
        let mut seqs = Vec::new();
        for _ in 0..self.n_seqs {
            let prompt_len = rng.random_range(1..=context.saturating_sub(2).clamp(1, 60));
            let new_tokens = rng.random_range(1..=(context - prompt_len).clamp(1, 16));
            let prompt: Vec<u32> = (0..prompt_len).map(|_| rng.random_range(0..cfg.vocab as u32)).collect();
            seqs.push(PlannedSeq { prompt, new_tokens, arrival: rng.random_range(0..=6) });
        }
        let max_seqs = serving.max_seqs.min(self.n_seqs).max(1);
        let step_budget = rng.random_range(max_seqs..=max_seqs + 40).min(serving.batch_tokens().max(max_seqs));
        let cap = rng.random_range(1..=24);
        let (steps, chunks) = schedule(&seqs, step_budget, max_seqs, cap);
        report.steps = steps.len();
        report.step_budget = step_budget;
        report.max_chunks_per_step = steps.iter().map(Vec::len).max().unwrap_or(0);
        // Physical blocks handed out in random order, with a few spare.
        let need: Vec<usize> =
            seqs.iter().map(|s| (s.prompt.len() + s.new_tokens).div_ceil(serving.block_size)).collect();
        let pool_size = need.iter().sum::<usize>() + rng.random_range(0..=4);
        let mut pool: Vec<u32> = (0..pool_size as u32).collect();
        pool.shuffle(&mut rng);
        let mut batch_seqs = Vec::new();
        let mut next = 0;
        for (s, n) in seqs.iter().zip(&need) {
            batch_seqs.push(BatchSeq {
                prompt: s.prompt.clone(),
                new_tokens: s.new_tokens,
                block_table: pool[next..next + n].to_vec(),
            });
            next += n;
        }
        self.tensors_path = h.output("batch.safetensors");
        let batch = Command::Batch {
            model: self.ck.path().to_path_buf(),
            num_blocks: pool_size,
            block_size: serving.block_size,
            seqs: batch_seqs,
            steps,
            tensors: self.tensors_path.clone(),
        };
        self.seqs = seqs;
        self.chunks = chunks;
        Ok(vec![(block_manager, vec![]), (scheduler, vec![]), (batch, vec![])])
    }

    fn model(&self) -> Option<&crate::beneath::HeldDir> {
        Some(&self.ck.held)
    }

    fn judge(&mut self, gate: &Gate, h: &Harness, called: Vec<Called>) -> Result<GateVerdict<BatchingReport>> {
        let ctx = gate.ctx;
        let (cfg, tol) = (&self.ck.cfg, &self.tol);
        let mut report = BatchingReport { rules: gate.findings.clone(), ..self.report.clone() };
        let not_run = |what: &str| format!("the {what} did not run: an earlier harness command did not finish");
        let mut called = called.into_iter();

        // 1. The block manager.
        let (num_blocks, block_size) = (report.block_manager.num_blocks, report.block_manager.block_size);
        match called.next().map(|c| c.ok("block manager", 1500)) {
            Some(Ok(Reply::BlockManager { results, tables, panic })) => {
                let mut v = check_block_ops(num_blocks, block_size, &self.ops, &results, &tables);
                if let Some(p) = panic {
                    v.insert(0, format!("the block manager panicked after {} operations: {p}", results.len()));
                }
                report.block_manager.passed = v.is_empty();
                report.block_manager.violations = v;
            }
            Some(Ok(other)) => report.block_manager.violations = vec![format!("unexpected reply {other:?}")],
            Some(Err(why)) => report.block_manager.violations = vec![crate::harness::explain(&why, &gate.engine)],
            None => report.block_manager.violations = vec![not_run("block manager")],
        }

        // 2. The scheduler.
        let trace = self.trace.as_ref().ok_or_else(|| Error::internal("verify_batching judged before it drew"))?;
        match called.next().map(|c| c.ok("scheduler", 1500)) {
            Some(Ok(Reply::Scheduler { steps, panic })) => {
                let mut v = check_trace(trace, &steps, &mut report.scheduler);
                if let Some(p) = panic {
                    v.insert(0, format!("the scheduler panicked at step {}: {p}", steps.len().saturating_sub(1)));
                    v.truncate(8);
                }
                report.scheduler.passed = v.is_empty();
                report.scheduler.violations = v;
            }
            Some(Ok(other)) => report.scheduler.violations = vec![format!("unexpected reply {other:?}")],
            Some(Err(why)) => report.scheduler.violations = vec![crate::harness::explain(&why, &gate.engine)],
            None => report.scheduler.violations = vec![not_run("scheduler")],
        }

        // 3. The batched step.
        let ran = match called.next().map(|c| c.ok("batched step", 1500)) {
            Some(Ok(Reply::Batch { panic: None, .. })) => true,
            Some(Ok(Reply::Batch { panic: Some(p), steps, .. })) => {
                report.error = format!("the engine panicked in the batched step after {steps} steps: {p}");
                false
            }
            Some(Ok(other)) => {
                report.error = format!("the harness answered the batched run with an unexpected reply: {other:?}");
                false
            }
            Some(Err(why)) => {
                report.error = crate::harness::explain(&why, &gate.engine);
                false
            }
            None => {
                report.error = not_run("batched step");
                false
            }
        };
        let out = if ran {
            h.output_words(&self.tensors_path).map(|(_, t)| t).unwrap_or_default()
        } else {
            Default::default()
        };
        let tensors = self.ck.tensors(&ctx.ckb, &report.dtype)?;
        // The reference is the family's graph, as every gate builds it.
        let mut reference = Reference::of_family(self.fam, cfg, tensors, &report.dtype)?;
        for (i, s) in self.seqs.iter().enumerate() {
            let (rows, want) = reference.greedy(&s.prompt, s.new_tokens)?;
            let got_tokens = out.get(&format!("tokens.{i}")).cloned().unwrap_or_default();
            let got: Vec<f32> = out
                .get(&format!("logits.{i}"))
                .map(|w| w.iter().map(|&b| f32::from_bits(b)).collect())
                .unwrap_or_default();
            let mut r = SequenceResult {
                prompt_len: s.prompt.len(),
                new_tokens: s.new_tokens,
                arrival: s.arrival,
                chunks: self.chunks[i],
                tokens_ok: got_tokens.len() == want.len(),
                logits_ok: got.len() == want.len() * cfg.vocab,
                steps: 0,
                first_mismatch: -1,
                tie_at: -1,
                max_abs_err: 0.0,
            };
            for (step, want_row) in rows.iter().enumerate() {
                let Some(got_row) = got.get(step * cfg.vocab..(step + 1) * cfg.vocab) else { break };
                r.steps = step + 1;
                let v = crate::oracle::compare(got_row, want_row, tol);
                r.max_abs_err = r.max_abs_err.max(v.max_abs_err);
                r.logits_ok &= v.ok;
                let (Some(&g), Some(&w)) = (got_tokens.get(step), want.get(step)) else { break };
                if g != w {
                    let best = want_row[w as usize];
                    let theirs = want_row.get(g as usize).copied().unwrap_or(f64::NEG_INFINITY);
                    if v.ok && best - theirs <= tol.atol + tol.rtol * best.abs() {
                        r.tie_at = step as i64;
                    } else {
                        r.tokens_ok = false;
                        r.first_mismatch = step as i64;
                    }
                    break;
                }
            }
            r.tokens_ok &= r.steps > 0;
            r.logits_ok &= r.steps > 0;
            report.sequences.push(r);
        }
        if ran && report.error.is_empty() && report.sequences.iter().any(|s| !s.logits_ok || !s.tokens_ok) {
            report.error = "a sequence's batched logits or tokens differ from its single-sequence reference".into();
        }
        report.passed = report.block_manager.passed
            && report.scheduler.passed
            && report.error.is_empty()
            && report.sequences.iter().all(|s| s.tokens_ok && s.logits_ok);
        let figures = BatchingFigures {
            gate: gate.common(),
            block_manager_ok: report.block_manager.passed,
            violations: report.block_manager.violations.len(),
            scheduler_ok: report.scheduler.passed,
            preemptions: report.scheduler.preemptions,
            sequences: report.sequences.len(),
            sequences_ok: report.sequences.iter().filter(|s| s.tokens_ok && s.logits_ok).count(),
            steps: report.steps,
            max_abs_err: report.sequences.iter().map(|s| s.max_abs_err).fold(0.0, f64::max),
        };
        Ok(GateVerdict { report, figures: Figures::Batching(figures) })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A correct block manager written here independently, to show the checker accepts it and
    /// catches each planted fault.
    fn run(num_blocks: usize, bs: usize, ops: &[BlockOp], fault: u8) -> (Vec<BlockOpResult>, Vec<(u64, Vec<u32>)>) {
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        let mut seqs: BTreeMap<u64, (usize, Vec<u32>)> = BTreeMap::new();
        let mut out = Vec::new();
        let mut ids = BTreeSet::new();
        for op in ops {
            let (ok, seq) = match *op {
                BlockOp::CanAllocate { n_tokens } => (n_tokens.div_ceil(bs) <= free.len(), None),
                BlockOp::Allocate { seq, n_tokens } => {
                    let need = n_tokens.div_ceil(bs);
                    let ok = !seqs.contains_key(&seq) && need <= free.len();
                    if ok {
                        let mut t: Vec<u32> = free.drain(..need).collect();
                        if fault == 1 && !t.is_empty() {
                            // Hands out a block without taking it from the free list.
                            free.insert(0, t[0]);
                            t.truncate(need);
                        }
                        seqs.insert(seq, (n_tokens, t));
                    }
                    (ok, Some(seq))
                }
                BlockOp::Append { seq } => {
                    let ok = match seqs.get_mut(&seq) {
                        Some((len, _)) if !(*len).is_multiple_of(bs) => {
                            *len += 1;
                            true
                        }
                        Some((len, t)) if !free.is_empty() => {
                            t.push(free.remove(0));
                            *len += 1;
                            true
                        }
                        _ => false,
                    };
                    (ok, Some(seq))
                }
                BlockOp::Free { seq } => {
                    if let Some((_, t)) = seqs.remove(&seq)
                        && fault != 2
                    {
                        // Fault 2 leaks the blocks of a freed sequence.
                        free.extend(t);
                    }
                    (true, Some(seq))
                }
            };
            if let Some(s) = seq {
                ids.insert(s);
            }
            let table = seq.and_then(|s| seqs.get(&s)).map(|(_, t)| t.clone()).unwrap_or_default();
            out.push(BlockOpResult { ok, free: free.len(), table });
        }
        let tables = ids.iter().map(|s| (*s, seqs.get(s).map(|(_, t)| t.clone()).unwrap_or_default())).collect();
        (out, tables)
    }

    #[test]
    fn block_manager_checker_accepts_a_correct_one_and_catches_faults() {
        for seed in 0..20 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (n, bs, ops) = draw_block_ops(&mut rng);
            let (r, t) = run(n, bs, &ops, 0);
            assert_eq!(check_block_ops(n, bs, &ops, &r, &t), Vec::<String>::new(), "seed {seed}");
        }
        let mut caught = [false; 3];
        for seed in 0..20 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (n, bs, ops) = draw_block_ops(&mut rng);
            for fault in 1..=2u8 {
                let (r, t) = run(n, bs, &ops, fault);
                let v = check_block_ops(n, bs, &ops, &r, &t);
                caught[fault as usize] |= v.iter().any(|m| {
                    if fault == 1 { m.contains("handed out again") } else { m.contains("num_free_blocks says") }
                });
            }
        }
        assert!(caught[1] && caught[2], "{caught:?}");
    }

    #[test]
    fn schedule_respects_budget_and_prefills_every_prompt_once_in_order() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let seqs: Vec<PlannedSeq> = (0..7)
            .map(|_| PlannedSeq {
                prompt: vec![1; rng.random_range(1..=50)],
                new_tokens: rng.random_range(1..=9),
                arrival: rng.random_range(0..=6),
            })
            .collect();
        let (steps, chunks) = schedule(&seqs, 20, 4, 8);
        let mut fed = vec![0usize; seqs.len()];
        let mut decodes = vec![0usize; seqs.len()];
        for step in &steps {
            assert!(step.iter().map(|e| e.tokens).sum::<usize>() <= 20);
            let distinct: BTreeSet<usize> = step.iter().map(|e| e.seq).collect();
            assert_eq!(distinct.len(), step.len(), "one chunk per sequence and step");
            assert!(distinct.len() <= 4);
            for e in step {
                if fed[e.seq] < seqs[e.seq].prompt.len() {
                    fed[e.seq] += e.tokens;
                    assert!(fed[e.seq] <= seqs[e.seq].prompt.len());
                } else {
                    assert_eq!(e.tokens, 1);
                    decodes[e.seq] += 1;
                }
            }
        }
        for (s, q) in seqs.iter().enumerate() {
            assert_eq!(fed[s], q.prompt.len());
            // The token after the prompt comes from the last prefill chunk; every other one from a decode.
            assert_eq!(decodes[s], q.new_tokens - 1);
            assert!(chunks[s] >= q.prompt.len().div_ceil(8), "seq {s}: {} chunks", chunks[s]);
        }
        // Prompts longer than the cap were chunked.
        assert!(seqs.iter().zip(&chunks).any(|(q, &c)| q.prompt.len() > 8 && c >= 2));
    }
}
