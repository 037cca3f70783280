//! The block-manager test of verify_batching: the drawn operations on a pool, and their check
//! against the server's own account of the pool.

use std::collections::BTreeMap;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use harness::protocol::{BlockOp, BlockOpResult};

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
