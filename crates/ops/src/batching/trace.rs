//! The scheduler test of verify_batching: the drawn request trace, and the check of the engine's
//! recorded steps against component.scheduler's invariants.

use std::collections::BTreeMap;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::SchedulerResult;
use harness::protocol::{SchedulerStep, TraceRequest};

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
    // One to one and a half full contexts: two long sequences running together usually exhaust it.
    let num_blocks = rng.random_range(per_seq..=per_seq + per_seq / 2);
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

/// Check the scheduler's recorded steps against the trace and the contract's invariants: every
/// request is added at its arrival step and every abort sent at its step, none before the run
/// ends; `add`
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
        // The steps are the trace's: each request added at its arrival step, each abort sent at
        // its step, in trace order (the harness drives them; a reply is not taken on its word).
        let arrivals: Vec<u64> = trace.requests.iter().filter(|r| r.arrival == si).map(|r| r.id).collect();
        let added: Vec<u64> = step.added.iter().map(|a| a.0).collect();
        if added != arrivals {
            note(format!(
                "the adds recorded are of requests {added:?}; the trace's arrivals at this step are {arrivals:?}"
            ));
        }
        let aborts: Vec<u64> = trace.aborts.iter().filter(|a| a.0 == si).map(|a| a.1).collect();
        let aborted: Vec<u64> = step.aborted.iter().map(|a| a.0).collect();
        if aborted != aborts {
            note(format!(
                "the aborts recorded are of requests {aborted:?}; the trace's aborts at this step are {aborts:?}"
            ));
        }
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
    let unsent: Vec<u64> = trace
        .requests
        .iter()
        .filter(|r| r.arrival >= steps.len())
        .map(|r| r.id)
        .chain(trace.aborts.iter().filter(|a| a.0 >= steps.len()).map(|a| a.1))
        .collect();
    if !unsent.is_empty() {
        bad.push(format!(
            "the run recorded {} steps and ended before the trace's requests or aborts {unsent:?} were sent",
            steps.len()
        ));
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
