//! Serving: several sequences per forward pass over a paged KV cache (contract
//! component.batched_step). The cache is K and V of every layer in fixed-size blocks that the
//! block manager (`paged`) hands out; a step runs chunks of several sequences, each at its own
//! positions through its own block table. The pass itself is `Model::run_batch`, beside the
//! single-token forward whose layer computations it repeats row by row.

use crate::model::Model;

/// K and V of every layer in num_blocks blocks of block_size positions (component.batched_step).
pub struct PagedKvCache {
    pub(crate) block_size: usize,
    pub(crate) num_blocks: usize,
    /// Per layer: keys after RoPE, [num_blocks, block_size, n_kv_heads, head_dim].
    pub(crate) k: Vec<Vec<f32>>,
    /// Per layer: values, [num_blocks, block_size, n_kv_heads, head_dim].
    pub(crate) v: Vec<Vec<f32>>,
}

/// One sequence's part of a batched step: `tokens` at positions start.., its block table.
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub block_table: &'a [u32],
}

/// A paged KV cache for `model` with `num_blocks` blocks of `block_size` positions.
pub fn new_cache(model: &crate::model::Model, num_blocks: usize, block_size: usize) -> PagedKvCache {
    assert!(block_size > 0, "new_cache: block_size must be positive");
    let len = num_blocks * block_size * model.kv_dim();
    PagedKvCache {
        block_size,
        num_blocks,
        k: (0..model.n_layers()).map(|_| vec![0.0; len]).collect(),
        v: (0..model.n_layers()).map(|_| vec![0.0; len]).collect(),
    }
}

/// Run every chunk through the model in one pass, writing K/V through the block tables;
/// returns the logits of each chunk's last token, [chunks.len(), vocab] in chunk order.
pub fn step(model: &mut crate::model::Model, cache: &mut PagedKvCache, chunks: &[SeqChunk]) -> Vec<f32> {
    Model::run_batch(model, cache, chunks)
}
