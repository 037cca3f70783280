//! Phase 7 (serving): continuous batching (component.scheduler). Which sequences run in the next
//! batched step and with how many tokens, under a token budget per step and the KV blocks of the
//! block manager; chunked prefill, decode, stop on EOS or max_tokens, abort, and preemption by
//! recomputation when blocks run out. Sampling is the caller's (`update` takes the tokens it drew,
//! as the contract's pseudocode has it), and so are stop strings (they need the text).
use std::collections::VecDeque;

use crate::paged::BlockManager;

/// One request as the scheduler sees it: token ids and limits.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller's id, unique among live requests.
    pub id: u64,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Most new tokens (>= 1).
    pub max_tokens: usize,
    /// Token ids that end the sequence (finish reason "stop").
    pub eos: Vec<u32>,
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An EOS id was drawn.
    Stop,
    /// max_tokens reached, or the context limit.
    Length,
}

/// What one step produced for one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A new token of request `id`.
    Token { id: u64, token: u32 },
    /// Request `id` finished (its blocks are free again).
    Finished { id: u64, finish: Finish },
}

/// One planned chunk of a step: `tokens` of request `id` at positions `start..`, its block table.
#[derive(Debug, Clone)]
pub struct Planned {
    pub id: u64,
    pub tokens: Vec<u32>,
    pub start: usize,
    pub block_table: Vec<u32>,
    /// Whether the chunk ends at the sequence's last token, so its logits give the next token.
    pub samples: bool,
}

struct Seq {
    req: Request,
    generated: Vec<u32>,
    /// Positions whose K/V are in the cache.
    cached: usize,
}

impl Seq {
    fn len(&self) -> usize {
        self.req.prompt.len() + self.generated.len()
    }
    fn token(&self, i: usize) -> u32 {
        let p = self.req.prompt.len();
        if i < p { self.req.prompt[i] } else { self.generated[i - p] }
    }
}

/// Continuous-batching scheduler over one block manager (component.scheduler).
pub struct Scheduler {
    blocks: BlockManager,
    block_size: usize,
    num_blocks: usize,
    max_seqs: usize,
    max_batch_tokens: usize,
    max_context: usize,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Preemptions so far.
    pub preemptions: u64,
}

impl Scheduler {
    /// A scheduler over `num_blocks` blocks of `block_size` positions, at most `max_seqs` running
    /// sequences, `max_batch_tokens` tokens per step (>= max_seqs), contexts up to `max_context`.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        max_seqs: usize,
        max_batch_tokens: usize,
        max_context: usize,
    ) -> Scheduler {
        assert!(max_seqs > 0 && max_batch_tokens >= max_seqs, "max_batch_tokens must be >= max_seqs > 0");
        Scheduler {
            blocks: BlockManager::new(num_blocks, block_size),
            block_size,
            num_blocks,
            max_seqs,
            max_batch_tokens,
            max_context,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
        }
    }

    /// Queue a request. Err (nothing queued) when its prompt is empty, max_tokens is 0, prompt plus
    /// max_tokens exceeds max_context, or its whole context could never fit the block pool.
    pub fn add(&mut self, req: Request) -> Result<(), String> {
        let total = req.prompt.len() + req.max_tokens;
        if req.prompt.is_empty() || req.max_tokens == 0 {
            return Err("the prompt must have a token and max_tokens must be at least 1".into());
        }
        if total > self.max_context {
            return Err(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the context of {} tokens",
                req.prompt.len(),
                req.max_tokens,
                self.max_context
            ));
        }
        if total.div_ceil(self.block_size) > self.num_blocks {
            return Err(format!("{total} positions need more than the {} KV blocks of the pool", self.num_blocks));
        }
        self.waiting.push_back(Seq { req, generated: Vec::new(), cached: 0 });
        Ok(())
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Requests waiting and running.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// Blocks not owned by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.blocks.num_free_blocks()
    }

    /// Prompt and generated tokens of live request `id` (what a sampler's penalties look at).
    pub fn tokens(&self, id: u64) -> Option<Vec<u32>> {
        let s = self.running.iter().chain(&self.waiting).find(|s| s.req.id == id)?;
        Some((0..s.len()).map(|i| s.token(i)).collect())
    }

    /// Remove request `id` wherever it is and free its blocks; false when unknown.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
            self.running.remove(i);
            self.blocks.free(id);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.req.id == id) {
            self.waiting.remove(i);
            return true;
        }
        false
    }

    /// Blocks needed to grow a sequence from `cached` to `cached + n` positions.
    fn new_blocks(&self, cached: usize, n: usize) -> usize {
        (cached + n).div_ceil(self.block_size) - cached.div_ceil(self.block_size)
    }

    /// Reserve positions cached..cached+n of `id` (allocating it when cached is 0).
    fn grow(&mut self, id: u64, cached: usize, n: usize) {
        if cached == 0 {
            self.blocks.allocate(id, n).expect("checked by new_blocks");
        } else {
            for _ in 0..n {
                self.blocks.append_slot(id).expect("checked by new_blocks");
            }
        }
    }

    /// Preempt the most recently admitted running sequence: free its blocks, put it back at the head of
    /// waiting to be recomputed from its prompt and the tokens it generated.
    fn preempt_last(&mut self) {
        if let Some(mut s) = self.running.pop() {
            self.blocks.free(s.req.id);
            s.cached = 0;
            self.preemptions += 1;
            self.waiting.push_front(s);
        }
    }

    /// Plan the next step: decode of running sequences first (preempting from the back when no block
    /// is free), then prefill chunks of running then waiting sequences under the token budget.
    pub fn schedule(&mut self) -> Vec<Planned> {
        let mut budget = self.max_batch_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        // Decode: sequences with exactly one token not cached, past their prompt.
        let mut i = 0;
        while i < self.running.len() {
            let (id, cached, len) = {
                let s = &self.running[i];
                (s.req.id, s.cached, s.len())
            };
            if len - cached != 1 || cached < self.running[i].req.prompt.len() {
                i += 1;
                continue;
            }
            if self.new_blocks(cached, 1) > self.blocks.num_free_blocks() {
                self.preempt_last();
                continue; // the sequence at i is still there unless it was the last one
            }
            self.grow(id, cached, 1);
            budget -= 1;
            i += 1;
        }
        // The decode entries of sequences still running.
        for s in &self.running {
            if s.len() - s.cached == 1 && s.cached >= s.req.prompt.len() {
                plan.push(Planned {
                    id: s.req.id,
                    tokens: vec![s.token(s.cached)],
                    start: s.cached,
                    block_table: Vec::new(),
                    samples: true,
                });
            }
        }
        // Prefill: running sequences with prompt left, then waiting ones in FIFO order.
        for i in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let (id, cached, len) = {
                let s = &self.running[i];
                (s.req.id, s.cached, s.len())
            };
            if len - cached <= 1 && cached >= self.running[i].req.prompt.len() {
                continue;
            }
            let n = (len - cached).min(budget);
            if self.new_blocks(cached, n) > self.blocks.num_free_blocks() {
                continue;
            }
            self.grow(id, cached, n);
            budget -= n;
            let s = &self.running[i];
            plan.push(Planned {
                id,
                tokens: (cached..cached + n).map(|p| s.token(p)).collect(),
                start: cached,
                block_table: Vec::new(),
                samples: cached + n == len,
            });
        }
        while budget > 0 && self.running.len() < self.max_seqs {
            let Some(s) = self.waiting.front() else { break };
            let n = s.len().min(budget);
            if self.new_blocks(0, n) > self.blocks.num_free_blocks() {
                break;
            }
            let s = self.waiting.pop_front().expect("front exists");
            self.grow(s.req.id, 0, n);
            budget -= n;
            plan.push(Planned {
                id: s.req.id,
                tokens: (0..n).map(|p| s.token(p)).collect(),
                start: 0,
                block_table: Vec::new(),
                samples: n == s.len(),
            });
            self.running.push(s);
        }
        if plan.is_empty() && !self.running.is_empty() {
            // Every running sequence waits for blocks another holds: recompute the last one later.
            self.preempt_last();
            return self.schedule();
        }
        for p in &mut plan {
            p.block_table = self.blocks.block_table(p.id);
        }
        plan
    }

    /// Apply a step's results: `sampled[k]` is the token drawn for the k-th entry of `plan` with
    /// `samples` (plan order). Marks the planned positions cached, appends the sampled tokens, and
    /// finishes sequences on EOS, max_tokens or the context limit (freeing their blocks).
    pub fn update(&mut self, plan: &[Planned], sampled: &[u32]) -> Vec<Event> {
        let mut events = Vec::new();
        let mut next = sampled.iter();
        for p in plan {
            let token = if p.samples { next.next().copied() } else { None };
            let Some(i) = self.running.iter().position(|s| s.req.id == p.id) else { continue };
            let s = &mut self.running[i];
            s.cached = p.start + p.tokens.len();
            let Some(token) = token else { continue };
            s.generated.push(token);
            events.push(Event::Token { id: p.id, token });
            let finish = if s.req.eos.contains(&token) {
                Some(Finish::Stop)
            } else if s.generated.len() >= s.req.max_tokens || s.len() >= self.max_context {
                Some(Finish::Length)
            } else {
                None
            };
            if let Some(finish) = finish {
                self.running.remove(i);
                self.blocks.free(p.id);
                events.push(Event::Finished { id: p.id, finish });
            }
        }
        events
    }
}
