//! Unit tests of verify_batching: the block-manager checker against an independent block manager
//! with planted faults, and the continuous-batching schedule.

use std::collections::{BTreeMap, BTreeSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use harness::protocol::{BlockOp, BlockOpResult};

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
            caught[fault as usize] |= v
                .iter()
                .any(|m| if fault == 1 { m.contains("handed out again") } else { m.contains("num_free_blocks says") });
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

/// A scheduler reply is tied to the trace: a run that recorded no step (or left out a request's
/// add at its arrival step) fails, where an empty record used to pass with nothing to check.
#[test]
fn a_scheduler_record_must_hold_the_trace_s_adds_and_aborts() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut trace = draw_trace(&mut rng);
    trace.requests[0].arrival = 0;
    let mut out = SchedulerResult::default();
    let v = check_trace(&trace, &[], &mut out);
    assert!(v.iter().any(|m| m.starts_with("the run recorded 0 steps and ended before")), "{v:?}");
    // One step recorded with no adds, where the trace's first requests arrive.
    let first: Vec<u64> = trace.requests.iter().filter(|r| r.arrival == 0).map(|r| r.id).collect();
    let v = check_trace(&trace, &[harness::protocol::SchedulerStep::default()], &mut out);
    assert!(!first.is_empty());
    assert_eq!(
        v[0],
        format!("step 0: the adds recorded are of requests []; the trace's arrivals at this step are {first:?}")
    );
}
