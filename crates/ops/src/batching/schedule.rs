//! The batched step's continuous-batching schedule: decode entries beside chunked prefills under a
//! token budget, drawn sequences arriving at different steps.

use harness::protocol::StepEntry;

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
