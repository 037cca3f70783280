//! verify_batching as a gate spec: the three harness commands drawn from the seed, and their
//! judgement (block manager, scheduler, batched step against the single-sequence reference).

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{
    BatchingReport, BlockManagerResult, PlannedSeq, SchedulerResult, SequenceResult, Trace, check_block_ops,
    check_trace, draw_block_ops, draw_trace, schedule,
};
use crate::gate::{Commands, Gate, Harness, Spec, Verdict as GateVerdict};
use base::error::{Error, Result};
use ckb::Tolerance;
use harness::Called;
use harness::protocol::{BatchSeq, BlockOp, Command, Reply};
use ledger::figures::{BatchingFigures, Figures};
use oracle::llama::Reference;

/// verify_batching as a [`Spec`]: the drawn block operations, request trace and batched schedule.
pub(super) struct BatchingSpec<'c> {
    pub(super) ck: &'c crate::checkpoint::Checkpoint,
    pub(super) fam: &'c ckb::ModelFamily,
    pub(super) tol: Tolerance,
    pub(super) serving: manifest::Serving,
    pub(super) n_seqs: usize,
    pub(super) seed: u64,
    /// The report as far as it is known before the engine runs.
    pub(super) report: BatchingReport,
    pub(super) ops: Vec<BlockOp>,
    pub(super) trace: Option<Trace>,
    pub(super) seqs: Vec<PlannedSeq>,
    /// Prefill chunks per sequence in the schedule.
    pub(super) chunks: Vec<usize>,
    pub(super) tensors_path: std::path::PathBuf,
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
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ base::util::fnv1a("component.block_manager"));
        let (num_blocks, block_size, ops) = draw_block_ops(&mut rng);
        report.block_manager = BlockManagerResult { num_blocks, block_size, ops: ops.len(), ..Default::default() };
        let block_manager = Command::BlockManager { num_blocks, block_size, ops: ops.clone() };
        self.ops = ops;

        // 2. The scheduler on a request trace.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ base::util::fnv1a("component.scheduler"));
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
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ base::util::fnv1a("component.batched_step"));
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

    fn model(&self) -> Option<&base::beneath::HeldDir> {
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
            Some(Err(why)) => report.block_manager.violations = vec![harness::explain(&why, &gate.engine)],
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
            Some(Err(why)) => report.scheduler.violations = vec![harness::explain(&why, &gate.engine)],
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
                report.error = harness::explain(&why, &gate.engine);
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
        // The first non-finite logit (sequence, step, where): never a pass, and named.
        let mut non_finite = None;
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
                let v = oracle::compare(got_row, want_row, tol);
                if non_finite.is_none() {
                    non_finite = v.non_finite.map(|nf| (i, step, nf));
                }
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
            if let Some((seq, step, nf)) = non_finite {
                report.error += &format!(
                    "; sequence {seq}: {} of step {step}; a non-finite logit never passes",
                    nf.describe().replace("at index", "at token")
                );
            }
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
