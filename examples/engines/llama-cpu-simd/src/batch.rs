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
/// process ([`free_bytes`] over this machine's /proc and /sys/fs/cgroup), the rest left to the
/// weights' pages, the step's scratch and the system; None where nothing can be read (no cap).
pub fn kv_budget_bytes(_model: &Model) -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cgroup_file = |rel: &str| read(&format!("/sys/fs/cgroup/{}", rel.trim_start_matches('/')));
    free_bytes(read("/proc/meminfo").as_deref(), read("/proc/self/cgroup").as_deref(), cgroup_file).map(|b| b / 2)
}

/// Bytes free to this process: what the kernel reports available (`MemAvailable` in `meminfo`, kB),
/// and within a memory cgroup's limit (a container) no more than its limit less its usage. The
/// cgroup comes from `self_cgroup` (/proc/self/cgroup): v2's `0::PATH` line, read as
/// `PATH/memory.max` and `PATH/memory.current`, or v1's `N:...memory...:PATH` line, read as
/// `memory/PATH/memory.limit_in_bytes` and `memory/PATH/memory.usage_in_bytes`; `cgroup_file` reads a
/// file relative to the cgroup mount (/sys/fs/cgroup). Inside a cgroup namespace the path may not
/// exist under the mount, whose root then is the process's own group and is read instead. A limit of
/// `max` (v2) or one larger than available (v1's unlimited) leaves available. None where neither
/// figure can be read. Source: the kernel's admin guide, cgroup-v2.rst and cgroup-v1/memory.rst.
pub fn free_bytes(
    meminfo: Option<&str>,
    self_cgroup: Option<&str>,
    cgroup_file: impl Fn(&str) -> Option<String>,
) -> Option<u64> {
    let available = meminfo.and_then(|info| {
        let kb = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?.trim();
        kb.parse::<u64>().ok().map(|kb| kb * 1024)
    });
    let number = |path: String| cgroup_file(&path)?.trim().parse::<u64>().ok();
    // `root` is the controller's mount ("" for v2, "memory" for v1), `path` the group under it.
    let headroom = |root: &str, path: &str, limit: &str, usage: &str| {
        let file =
            |dir: &str, name: &str| [dir, name].iter().filter(|p| !p.is_empty()).copied().collect::<Vec<_>>().join("/");
        let at = |d: &str| Some(number(file(d, limit))?.saturating_sub(number(file(d, usage))?));
        at(&file(root, path)).or_else(|| at(root))
    };
    let cgroup = self_cgroup.and_then(|c| {
        c.lines().find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) =
                (fields.next()?, fields.next()?, fields.next()?.trim().trim_start_matches('/'));
            if controllers.is_empty() {
                headroom("", path, "memory.max", "memory.current")
            } else if controllers.split(',').any(|c| c == "memory") {
                headroom("memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes")
            } else {
                None
            }
        })
    });
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// Run every chunk through the model in one pass, writing K/V through the block tables;
/// returns the logits of each chunk's last token, [chunks.len(), vocab] in chunk order.
pub fn step(model: &mut crate::model::Model, cache: &mut PagedKvCache, chunks: &[SeqChunk]) -> Vec<f32> {
    Model::run_batch(model, cache, chunks)
}

#[cfg(test)]
mod tests {
    use super::free_bytes;
    use std::collections::HashMap;

    const MEMINFO: &str = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n";

    fn files(entries: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |p: &str| map.get(p).cloned()
    }

    /// 20,000,000 kB available is 20,480,000,000 bytes; a v2 limit of 8 GiB with 1 GiB used leaves
    /// 7 GiB, the smaller.
    #[test]
    fn cgroup_v2_limit_caps_what_the_kernel_reports_available() {
        let read = files(&[("svc/app/memory.max", "8589934592\n"), ("svc/app/memory.current", "1073741824\n")]);
        assert_eq!(free_bytes(Some(MEMINFO), Some("0::/svc/app\n"), &read), Some(7 << 30));
        // `max` is no limit; available stands.
        let read = files(&[("svc/app/memory.max", "max\n"), ("svc/app/memory.current", "1073741824\n")]);
        assert_eq!(free_bytes(Some(MEMINFO), Some("0::/svc/app\n"), &read), Some(20_480_000_000));
    }

    /// A v1 hierarchy names the memory controller among others; its limit less its usage caps.
    /// v1's unlimited (9223372036854771712, the page counter's maximum) leaves available.
    #[test]
    fn cgroup_v1_memory_controller_caps_too() {
        let own = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n";
        let read = files(&[
            ("memory/docker/abc/memory.limit_in_bytes", "4294967296"),
            ("memory/docker/abc/memory.usage_in_bytes", "1073741824"),
        ]);
        assert_eq!(free_bytes(Some(MEMINFO), Some(own), &read), Some(3 << 30));
        let read = files(&[
            ("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/docker/abc/memory.usage_in_bytes", "1073741824"),
        ]);
        assert_eq!(free_bytes(Some(MEMINFO), Some(own), &read), Some(20_480_000_000));
    }

    /// In a cgroup namespace the named path is absent under the mount, whose root is the group.
    #[test]
    fn a_namespaced_group_is_read_at_the_mount_root() {
        let read = files(&[("memory.max", "2147483648"), ("memory.current", "1073741824")]);
        assert_eq!(free_bytes(Some(MEMINFO), Some("0::/host/slice/x\n"), &read), Some(1 << 30));
        let read = files(&[("memory/memory.limit_in_bytes", "2147483648"), ("memory/memory.usage_in_bytes", "0")]);
        assert_eq!(free_bytes(None, Some("7:memory:/host/slice/x\n"), &read), Some(2 << 30));
    }

    /// Nothing readable gives no cap; meminfo alone gives available.
    #[test]
    fn nothing_readable_is_no_cap() {
        let none = files(&[]);
        assert_eq!(free_bytes(None, None, &none), None);
        assert_eq!(free_bytes(None, Some("0::/\n"), &none), None);
        assert_eq!(free_bytes(Some(MEMINFO), Some("0::/\n"), &none), Some(20_480_000_000));
    }
}
