// Serving commands of the generated harness, compiled in only for engines with serving constraints
// (metainfer.toml `[serving]`): they call the engine's block manager (src/paged.rs) and batched step
// (src/batch.rs), whose signatures the contracts fix.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use crate::protocol::{BatchSeq, BlockOp, BlockOpResult, Reply, StepEntry};
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
