//! Phase 6 (batching): the block manager of the paged KV cache (component.block_manager).
use std::collections::HashMap;

/// Fixed-size KV-cache blocks handed out to sequences (component.block_manager).
pub struct BlockManager {
    block_size: usize,
    /// Free physical blocks, used as a stack.
    free: Vec<u32>,
    /// Live sequences: (length in positions, block table).
    seqs: HashMap<u64, (usize, Vec<u32>)>,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` positions, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> BlockManager {
        assert!(block_size > 0, "block_size must be positive");
        // Popped from the end: block 0 is handed out first.
        BlockManager { block_size, free: (0..num_blocks as u32).rev().collect(), seqs: HashMap::new() }
    }

    /// Whether a new sequence of `n_tokens` positions fits: ceil(n_tokens / block_size) <= free blocks.
    pub fn can_allocate(&self, n_tokens: usize) -> bool {
        n_tokens.div_ceil(self.block_size) <= self.free.len()
    }

    /// Make `seq` live with `n_tokens` positions; Err (nothing changed) when it is live already or does not fit.
    pub fn allocate(&mut self, seq: u64, n_tokens: usize) -> Result<(), String> {
        if self.seqs.contains_key(&seq) {
            return Err(format!("sequence {seq} already holds blocks"));
        }
        let need = n_tokens.div_ceil(self.block_size);
        if need > self.free.len() {
            return Err(format!("{need} blocks needed for {n_tokens} positions, {} free", self.free.len()));
        }
        let table = self.free.split_off(self.free.len() - need);
        self.seqs.insert(seq, (n_tokens, table.into_iter().rev().collect()));
        Ok(())
    }

    /// Room for one more position of `seq` (a new block when its last one is full); Err (nothing changed) when no block is free or `seq` is unknown.
    pub fn append_slot(&mut self, seq: u64) -> Result<(), String> {
        let bs = self.block_size;
        let (len, table) = self.seqs.get_mut(&seq).ok_or_else(|| format!("sequence {seq} holds no blocks"))?;
        if (*len).is_multiple_of(bs) {
            let block = self.free.pop().ok_or_else(|| format!("no free block for position {len} of sequence {seq}"))?;
            table.push(block);
        }
        *len += 1;
        Ok(())
    }

    /// Return the blocks of `seq` to the pool; an unknown `seq` is ignored.
    pub fn free(&mut self, seq: u64) {
        if let Some((_, table)) = self.seqs.remove(&seq) {
            self.free.extend(table.into_iter().rev());
        }
    }

    /// Blocks not owned by any sequence.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Physical block ids of `seq` in logical order (empty when unknown).
    pub fn block_table(&self, seq: u64) -> Vec<u32> {
        self.seqs.get(&seq).map(|(_, t)| t.clone()).unwrap_or_default()
    }
}

/// The default size of a server's KV-cache pool, in blocks: `wanted` (max_seqs full contexts),
/// capped at the blocks of `block_bytes` bytes each that fit in `budget_bytes` (None: no cap), and
/// at least one. A Llama 3.2 1B (16 layers, 8 KV heads of 64, f32 cache) asked for 64 contexts of
/// its 131,072 positions wants 524,288 blocks of 16 positions, 1 MiB each: 512 GiB; the budget
/// keeps it to what the memory holds.
pub fn default_num_blocks(wanted: usize, block_bytes: usize, budget_bytes: Option<u64>) -> usize {
    let fit = budget_bytes.map_or(usize::MAX, |b| usize::try_from(b / block_bytes.max(1) as u64).unwrap_or(usize::MAX));
    wanted.min(fit).max(1)
}

#[cfg(test)]
mod tests {
    use super::default_num_blocks;

    /// Serving Llama 3.2 1B (its config.json: 16 layers, 8 KV heads, head_dim 64, 131,072 positions)
    /// at 64 sequences wants 64 × 131,072 / 16 = 524,288 blocks of 16 positions; a block holds
    /// 16 × 16 layers × (K and V) × 8 × 64 f32, 1 MiB, so a 60 GiB budget holds 61,440 of them.
    #[test]
    fn the_default_pool_is_max_seqs_contexts_as_far_as_the_budget_holds() {
        let block = 16 * 16 * 2 * 8 * 64 * 4;
        assert_eq!(block, 1 << 20);
        assert_eq!(default_num_blocks(524_288, block, Some(60 << 30)), 61_440);
        assert_eq!(default_num_blocks(524_288, block, None), 524_288);
        // 16 contexts of 256 positions fit whole.
        assert_eq!(default_num_blocks(256, block, Some(60 << 30)), 256);
        // Nothing to spare still gives one block (the scheduler refuses what does not fit).
        assert_eq!(default_num_blocks(256, block, Some(1000)), 1);
        assert_eq!(default_num_blocks(256, 0, Some(0)), 1);
    }
}
