//! Phase 6 (batching): several sequences per forward pass over a paged KV cache
//! (component.batched_step). The pass itself is `Model::run_batch`, beside the single-sequence one.
use crate::model::Model;

/// K and V of every layer in num_blocks blocks of block_size positions (component.batched_step).
pub struct PagedKvCache {
    pub(crate) block_size: usize,
    pub(crate) num_blocks: usize,
    /// Per layer: [num_blocks, block_size, n_kv_heads, head_dim].
    pub(crate) k: Vec<Vec<f32>>,
    /// Per layer: [num_blocks, block_size, n_kv_heads, head_dim].
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
    assert!(block_size > 0, "block_size must be positive");
    let len = num_blocks * block_size * model.kv_dim();
    // Zeroed allocations are backed lazily by the OS: blocks cost memory once written.
    PagedKvCache {
        block_size,
        num_blocks,
        k: (0..model.n_layers()).map(|_| vec![0.0; len]).collect(),
        v: (0..model.n_layers()).map(|_| vec![0.0; len]).collect(),
    }
}

/// Bytes of one block of [`PagedKvCache`] holding `block_size` positions: keys and values of every
/// layer in f32, block_size × n_layers × 2 × kv_dim × 4. At the Llama 3.2 1B shape (16 layers,
/// 8 KV heads of 64) a block of 16 positions is 1 MiB.
pub fn block_bytes(model: &Model, block_size: usize) -> usize {
    block_size * model.n_layers() * 2 * model.kv_dim() * std::mem::size_of::<f32>()
}

/// What the server's KV cache may take unless told (`--kv-blocks`): half of the memory free to this
/// process, the rest left to the weights' pages, the step's scratch and the system. Free is what the
/// kernel reports available (`MemAvailable` in /proc/meminfo, kB), and within a cgroup v2 memory
/// limit (a container) no more than `memory.max - memory.current` of the process's cgroup; None
/// where neither can be read (no cap).
pub fn kv_budget_bytes(_model: &Model) -> Option<u64> {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|info| {
        let kb = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?.trim();
        kb.parse::<u64>().ok().map(|kb| kb * 1024)
    });
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|c| {
        let path = c.lines().find_map(|l| l.strip_prefix("0::"))?.trim().to_string();
        let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok()?.trim().parse::<u64>().ok();
        Some(read("memory.max")?.saturating_sub(read("memory.current")?))
    });
    let free = match (available, cgroup) {
        (Some(a), Some(c)) => a.min(c),
        (a, c) => a.or(c)?,
    };
    Some(free / 2)
}

/// Run every chunk through the model in one pass, writing K/V through the block tables;
/// returns the logits of each chunk's last token, [chunks.len(), vocab] in chunk order.
pub fn step(model: &mut crate::model::Model, cache: &mut PagedKvCache, chunks: &[SeqChunk]) -> Vec<f32> {
    Model::run_batch(model, cache, chunks)
}
