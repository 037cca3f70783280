// Serving commands of the generated harness, compiled in only for engines with serving constraints
// (metainfer.toml `[serving]`): they call the engine's block manager (src/paged.rs) and batched step
// (src/batch.rs) and scheduler (src/scheduler.rs), whose signatures the contracts fix.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use crate::protocol::{
    BatchSeq, BlockOp, BlockOpResult, PlannedChunk, Reply, SchedulerEvent, SchedulerStep, StepEntry, TraceRequest,
};
use crate::{Out, die, panic_text, write_tensors};

/// Apply the operations to a new block manager; record what it answers after each.
pub fn block_manager(num_blocks: usize, block_size: usize, ops: &[BlockOp]) -> Reply {
    let mut results = Vec::new();
    let mut ids: Vec<u64> = Vec::new();
    let run = catch_unwind(AssertUnwindSafe(|| {
        let mut bm = engine::paged::BlockManager::new(num_blocks, block_size);
        for op in ops {
            let (ok, seq) = match op {
                BlockOp::CanAllocate { n_tokens } => (bm.can_allocate(*n_tokens), None),
                BlockOp::Allocate { seq, n_tokens } => (bm.allocate(*seq, *n_tokens).is_ok(), Some(*seq)),
                BlockOp::Append { seq } => (bm.append_slot(*seq).is_ok(), Some(*seq)),
                BlockOp::Free { seq } => {
                    bm.free(*seq);
                    (true, Some(*seq))
                }
            };
            if let Some(s) = seq {
                if !ids.contains(&s) {
                    ids.push(s);
                }
            }
            let table = seq.map(|s| bm.block_table(s)).unwrap_or_default();
            results.push(BlockOpResult { ok, free: bm.num_free_blocks(), table });
        }
        ids.iter().map(|&s| (s, bm.block_table(s))).collect::<Vec<_>>()
    }));
    match run {
        Ok(tables) => Reply::BlockManager { results, tables, panic: None },
        Err(e) => Reply::BlockManager { results, tables: vec![], panic: Some(panic_text(e)) },
    }
}

/// Run the server's schedule through the engine's batched step with greedy sampling.
pub fn batch(dir: &Path, num_blocks: usize, block_size: usize, seqs: &[BatchSeq], steps: &[Vec<StepEntry>], tensors_path: &Path) -> Reply {
    let mut model = engine::model::Model::load(dir).unwrap_or_else(|e| die(&format!("model load: {e}")));
    let vocab = model.vocab_size();
    // Per sequence: positions cached so far, generated tokens, logit rows.
    let mut done = vec![0usize; seqs.len()];
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    let mut rows: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    let mut ran = 0;
    let run = catch_unwind(AssertUnwindSafe(|| {
        let mut cache = engine::batch::new_cache(&model, num_blocks, block_size);
        for step in steps {
            let mut inputs: Vec<Vec<u32>> = Vec::new();
            for e in step {
                let s = &seqs[e.seq];
                let pos = done[e.seq];
                if pos < s.prompt.len() {
                    inputs.push(s.prompt[pos..(pos + e.tokens).min(s.prompt.len())].to_vec());
                } else {
                    let last = *generated[e.seq].last().unwrap_or_else(|| die("decode entry before the prompt was done"));
                    inputs.push(vec![last]);
                }
            }
            let chunks: Vec<engine::batch::SeqChunk> = step
                .iter()
                .zip(&inputs)
                .map(|(e, t)| engine::batch::SeqChunk { tokens: t, start: done[e.seq], block_table: &seqs[e.seq].block_table })
                .collect();
            let logits = engine::batch::step(&mut model, &mut cache, &chunks);
            if logits.len() != step.len() * vocab {
                die(&format!("batch::step returned {} logits for {} chunks of vocab {vocab}", logits.len(), step.len()));
            }
            for (c, (e, t)) in step.iter().zip(&inputs).enumerate() {
                done[e.seq] += t.len();
                if done[e.seq] >= seqs[e.seq].prompt.len() {
                    let row = &logits[c * vocab..(c + 1) * vocab];
                    generated[e.seq].push(engine::generate::sample_greedy(row));
                    rows[e.seq].extend_from_slice(row);
                }
            }
            ran += 1;
        }
    }));
    let mut out = Vec::new();
    for s in 0..seqs.len() {
        out.push((format!("tokens.{s}"), Out::U(generated[s].clone())));
        out.push((format!("logits.{s}"), Out::F(rows[s].clone())));
    }
    write_tensors(tensors_path, &out);
    Reply::Batch { vocab, steps: ran, panic: run.err().map(panic_text) }
}

/// Drive a new scheduler through the request trace: per step, arrivals, aborts, `schedule()`, then
/// `update()` with each sampling chunk's next scripted token as the sampled one.
#[allow(clippy::too_many_arguments)]
pub fn scheduler(
    num_blocks: usize,
    block_size: usize,
    max_seqs: usize,
    max_batch_tokens: usize,
    max_context: usize,
    requests: &[TraceRequest],
    aborts: &[(usize, u64)],
    max_steps: usize,
) -> Reply {
    let mut steps: Vec<SchedulerStep> = Vec::new();
    let last_arrival = requests.iter().map(|r| r.arrival).max().unwrap_or(0);
    let last_abort = aborts.iter().map(|a| a.0).max().unwrap_or(0);
    let run = catch_unwind(AssertUnwindSafe(|| {
        let mut s = engine::scheduler::Scheduler::new(num_blocks, block_size, max_seqs, max_batch_tokens, max_context);
        // Requests not yet resolved (refused, aborted or finished), and tokens sampled per id.
        let mut open: Vec<u64> = Vec::new();
        let mut sampled: std::collections::HashMap<u64, usize> = Default::default();
        for step in 0..max_steps {
            let mut rec = SchedulerStep::default();
            for r in requests.iter().filter(|r| r.arrival == step) {
                let req = engine::scheduler::Request {
                    id: r.id,
                    prompt: r.prompt.clone(),
                    max_tokens: r.max_tokens,
                    eos: r.eos.clone(),
                };
                let answer = s.add(req);
                if answer.is_ok() {
                    open.push(r.id);
                }
                rec.added.push((r.id, answer.err()));
            }
            for &(_, id) in aborts.iter().filter(|a| a.0 == step) {
                let ok = s.abort(id);
                open.retain(|&x| x != id);
                rec.aborted.push((id, ok));
            }
            steps.push(rec);
            let plan = s.schedule();
            let drawn: Vec<u32> = plan
                .iter()
                .filter(|p| p.samples)
                .map(|p| {
                    let n = *sampled.get(&p.id).unwrap_or(&0);
                    let script = requests.iter().find(|r| r.id == p.id).map(|r| r.script.as_slice()).unwrap_or(&[]);
                    script.get(n).copied().unwrap_or(0)
                })
                .collect();
            let events = s.update(&plan, &drawn);
            let last = steps.last_mut().expect("pushed above");
            last.plan = plan
                .iter()
                .map(|p| PlannedChunk {
                    id: p.id,
                    tokens: p.tokens.clone(),
                    start: p.start,
                    block_table: p.block_table.clone(),
                    samples: p.samples,
                })
                .collect();
            for e in &events {
                last.events.push(match e {
                    engine::scheduler::Event::Token { id, token } => {
                        *sampled.entry(*id).or_insert(0) += 1;
                        SchedulerEvent { id: *id, token: Some(*token), finish: None }
                    }
                    engine::scheduler::Event::Finished { id, finish } => {
                        open.retain(|x| x != id);
                        let why = match finish {
                            engine::scheduler::Finish::Stop => "stop",
                            engine::scheduler::Finish::Length => "length",
                        };
                        SchedulerEvent { id: *id, token: None, finish: Some(why.to_string()) }
                    }
                });
            }
            last.free_blocks = s.free_blocks();
            if open.is_empty() && step >= last_arrival && step >= last_abort {
                break;
            }
        }
    }));
    Reply::Scheduler { steps, panic: run.err().map(panic_text) }
}
