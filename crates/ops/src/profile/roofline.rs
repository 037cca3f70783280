//! Per-kernel decode profile: which kernels one decoded token calls on the model's real shapes, the
//! bytes and FLOPs of each call, and the verdict (the kernel that bounds decode).
//!
//! Bytes and FLOPs per call come from each kernel's `cost` in the kernel registry
//! (`oracle::kernels`); this module knows which calls one decoded token makes.
//!
//! Roofline (Williams, Waterman & Patterson 2009, CACM 52(4)): a call takes at least
//! `max(bytes / bandwidth, flops / peak)`; the fraction reported is that bound over the measured time.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use base::stats::Spread;
use model::ResolvedConfig;
use oracle::kernels::{self, Dims};

/// One kernel call shape of a decode step.
#[derive(Debug, Clone)]
pub struct Call {
    /// Kernel contract id.
    pub kernel: String,
    /// Where it is used, e.g. `q_proj, o_proj [288 x 288]`.
    pub label: String,
    /// Dimensions passed to the harness `time` command.
    pub dims: Dims,
    /// Calls per decoded token.
    pub per_token: usize,
    /// Bytes read and written per call (the kernel registry's cost).
    pub bytes: f64,
    /// FLOPs per call (the kernel registry's cost).
    pub flops: f64,
    /// Distinct buffers the harness cycles through, so the working set is the model's.
    pub copies: usize,
}

/// Bytes per stored weight of `dtype` (int8's per-row scale is counted separately).
pub fn weight_bytes(dtype: &str) -> f64 {
    match dtype {
        "bf16" | "f16" => 2.0,
        "int8" => 1.0,
        _ => 4.0,
    }
}

/// A call of `kernel` on `dims`, its cost from the kernel registry.
fn call(kernel: &str, label: String, dims: &[(&str, usize)], per_token: usize, copies: usize) -> Option<Call> {
    let dims: Dims = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let cost = (kernels::get(kernel)?.cost)(&dims);
    Some(Call { kernel: kernel.to_string(), label, dims, per_token, bytes: cost.bytes, flops: cost.flops, copies })
}

/// The calls of one decode step at context length `kv_len`, for an engine implementing `kernels`
/// (the plan's kernel set: its linear and activation kernels are the dtype's and family's).
/// `model_bytes`: bytes of weights streamed per token, which sets how many copies of each weight
/// matrix the harness cycles through (at most 256, and at most 1 GiB per shape).
pub fn decode_calls(
    cfg: &ResolvedConfig,
    kernels: &[String],
    dtype: &str,
    kv_len: usize,
    model_bytes: f64,
) -> Vec<Call> {
    let has = |k: &str| kernels.iter().any(|x| x == k);
    let (h, hd, nh, nkv, ff, l, vocab) =
        (cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate, cfg.n_layers, cfg.vocab);
    let copies_for = |bytes: f64| {
        let by_model = (model_bytes / bytes.max(1.0)).ceil() as usize;
        let by_memory = ((1u64 << 30) as f64 / bytes.max(1.0)) as usize;
        by_model.clamp(1, 256).min(by_memory.max(1))
    };
    let mut calls = Vec::new();
    let wb = weight_bytes(dtype) as usize;
    // A mixture of experts (the shipped MoE families' roles): (experts, top_k, expert width).
    let role = |r: &str| match cfg.role(r) {
        Some(ckb::graph::Val::Num(v)) => Some(v as usize),
        _ => None,
    };
    let moe = has("kernel.moe_experts").then(|| {
        (role("n_experts").unwrap_or(1), role("n_experts_per_tok").unwrap_or(1), role("moe_intermediate").unwrap_or(ff))
    });
    if has("kernel.embedding") {
        let dims = [("vocab", vocab), ("dim", h), ("weight_bytes", wb)];
        calls.extend(call("kernel.embedding", format!("embed_tokens row [{h}]"), &dims, 1, 1));
    }
    if has("kernel.rms_norm") {
        calls.extend(call(
            "kernel.rms_norm",
            format!("input/post-attention/final norm [{h}]"),
            &[("dim", h)],
            2 * l + 1,
            1,
        ));
        if cfg.has("qk_norm") {
            calls.extend(call(
                "kernel.rms_norm",
                format!("q/k per-head norm [{hd}]"),
                &[("dim", hd)],
                l * (nh + nkv),
                1,
            ));
        }
    }
    if has("kernel.rope") {
        for (who, heads) in [("q", nh), ("k", nkv)] {
            let dims = [("n_heads", heads), ("head_dim", hd)];
            calls.extend(call("kernel.rope", format!("{who} [{heads} x {hd}]"), &dims, l, 1));
        }
    }
    if let Some(linear) = kernels.iter().find(|k| *k == "kernel.linear" || k.starts_with("kernel.linear_")) {
        // (role, n, k, per token); projections with one shape are timed once.
        let mut shapes: Vec<(Vec<&str>, usize, usize, usize)> = Vec::new();
        let lm = if cfg.tied { "lm_head (tied embed_tokens)" } else { "lm_head" };
        let mlp: &[(&str, usize, usize, usize)] = match moe {
            // The experts are kernel.moe_experts' call; the router is a linear.
            Some((e, _, _)) => &[("router", e, h, l)],
            None => &[("gate_proj", ff, h, l), ("up_proj", ff, h, l), ("down_proj", h, ff, l)],
        };
        let attn = [
            ("q_proj", nh * hd, h, l),
            ("k_proj", nkv * hd, h, l),
            ("v_proj", nkv * hd, h, l),
            ("o_proj", h, nh * hd, l),
        ];
        for &(role, n, k, per) in attn.iter().chain(mlp).chain(&[(lm, vocab, h, 1)]) {
            match shapes.iter_mut().find(|s| s.1 == n && s.2 == k) {
                Some(s) => {
                    s.0.push(role);
                    s.3 += per;
                }
                None => shapes.push((vec![role], n, k, per)),
            }
        }
        for (roles, n, k, per) in shapes {
            let dims = [("m", 1), ("k", k), ("n", n)];
            let Some(mut c) = call(linear, format!("{} [{n} x {k}]", roles.join(", ")), &dims, per, 1) else {
                continue;
            };
            // The weights are what streams: every byte but x and y.
            c.copies = copies_for(c.bytes - 4.0 * (k + n) as f64);
            calls.push(c);
        }
    }
    if let Some((e, k, inter)) = moe {
        calls.extend(call(
            "kernel.moe_route",
            format!("router weights [{e}], top {k}"),
            &[("n_experts", e), ("top_k", k)],
            l,
            1,
        ));
        let dims = [("hidden", h), ("inter", inter), ("n_experts", e), ("top_k", k)];
        calls.extend(call("kernel.moe_experts", format!("{k} of {e} experts [{inter} x {h}]"), &dims, l, 1));
    }
    for act in ["kernel.silu_and_mul", "kernel.gelu_tanh_and_mul"] {
        if has(act) && moe.is_none() {
            calls.extend(call(act, format!("mlp activation [{ff}]"), &[("len", ff)], l, 1));
        }
    }
    if has("kernel.attention") {
        let dims = [("kv_len", kv_len), ("n_heads", nh), ("n_kv_heads", nkv), ("head_dim", hd)];
        calls.extend(call("kernel.attention", format!("kv_len {kv_len}, {nh}/{nkv} heads x {hd}"), &dims, l, l.max(1)));
    }
    if has("kernel.argmax") {
        calls.extend(call("kernel.argmax", format!("logits [{vocab}]"), &[("n", vocab)], 1, 1));
    }
    calls
}

/// Harness iterations per timed repetition: about 5 ms of work at 10 GB/s, at least one pass over
/// the copies.
pub fn iters_for(c: &Call) -> usize {
    ((5e-3 / (c.bytes.max(64.0) / 10e9)) as usize).clamp(c.copies, 200_000)
}

/// One kernel shape of the decode profile.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct KernelProfile {
    /// Kernel contract id.
    pub kernel: String,
    /// Where it is used and its shape.
    pub label: String,
    /// Calls per decoded token.
    pub calls_per_token: usize,
    /// Time per call in microseconds over the repetitions.
    pub time_us: Spread,
    /// Achieved bandwidth at the median time, GB/s.
    pub gb_s: f64,
    /// Achieved GFLOP/s at the median time.
    pub gflop_s: f64,
    /// Roofline bound over the median time (1.0 = at the bound; above 1 only when the data is
    /// served faster than the bandwidth assumed, e.g. from cache).
    pub roofline_fraction: f64,
    /// Share of the summed kernel time of one decoded token.
    pub share_of_decode: f64,
}

/// Turn timings (seconds per call, per repetition, in `calls` order) into profiles, sorted by share
/// of decode time, largest first. `bandwidth_gbs` and `peak_gflops` are the machine's at the thread
/// count used.
pub fn analyse(calls: &[Call], seconds: &[Vec<f64>], bandwidth_gbs: f64, peak_gflops: f64) -> Vec<KernelProfile> {
    let mut out: Vec<KernelProfile> = calls
        .iter()
        .zip(seconds)
        .map(|(c, s)| {
            let t = Spread::of(&s.iter().map(|x| x * 1e6).collect::<Vec<_>>());
            let secs = t.median * 1e-6;
            let bound = (c.bytes / (bandwidth_gbs * 1e9)).max(c.flops / (peak_gflops * 1e9));
            KernelProfile {
                kernel: c.kernel.clone(),
                label: c.label.clone(),
                calls_per_token: c.per_token,
                time_us: t,
                gb_s: if secs > 0.0 { c.bytes / secs / 1e9 } else { 0.0 },
                gflop_s: if secs > 0.0 { c.flops / secs / 1e9 } else { 0.0 },
                roofline_fraction: if secs > 0.0 { bound / secs } else { 0.0 },
                share_of_decode: secs * c.per_token as f64,
            }
        })
        .collect();
    let total: f64 = out.iter().map(|k| k.share_of_decode).sum();
    for k in &mut out {
        k.share_of_decode = if total > 0.0 { k.share_of_decode / total } else { 0.0 };
    }
    out.sort_by(|a, b| b.share_of_decode.total_cmp(&a.share_of_decode));
    out
}

/// The kernel contract with the largest summed share of decode time, and that share.
pub fn bounding_kernel(profiles: &[KernelProfile]) -> Option<(String, f64)> {
    let mut by: Vec<(String, f64)> = Vec::new();
    for p in profiles {
        match by.iter_mut().find(|(k, _)| *k == p.kernel) {
            Some(e) => e.1 += p.share_of_decode,
            None => by.push((p.kernel.clone(), p.share_of_decode)),
        }
    }
    by.into_iter().max_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ResolvedConfig {
        // The stories15M shape (llama2.c README): dim 288, 6 layers, 6 heads, vocab 32000, hidden 768.
        serde_json::from_value(serde_json::json!({
            "family": "model.llama", "hidden": 288, "intermediate": 768, "n_layers": 6, "n_heads": 6,
            "n_kv_heads": 6, "head_dim": 48, "vocab": 32000, "max_seq": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tied": true
        }))
        .unwrap()
    }

    #[test]
    fn linear_calls_cover_every_weight_once_per_token() {
        let c = cfg();
        let ks: Vec<String> = ["kernel.linear", "kernel.attention"].iter().map(|s| s.to_string()).collect();
        let calls = decode_calls(&c, &ks, "f32", 10, 6e7);
        let weights: f64 =
            calls.iter().filter(|c| c.kernel == "kernel.linear").map(|c| c.flops / 2.0 * c.per_token as f64).sum();
        // 6 layers x (4 x 288^2 + 3 x 288 x 768) + 32000 x 288 = 15,187,968 weights (stories15M
        // without the embedding lookup and norms).
        assert_eq!(weights, 15_187_968.0);
        // q, k, v and o share one shape: 4 calls per layer.
        let square = calls.iter().find(|c| c.label.starts_with("q_proj")).unwrap();
        assert_eq!(square.per_token, 24);
        assert!(square.label.contains("o_proj"), "{}", square.label);
    }

    #[test]
    fn verdict_sums_shapes_of_one_kernel() {
        let calls = vec![
            Call {
                kernel: "a".into(),
                label: "1".into(),
                dims: Dims::new(),
                per_token: 1,
                bytes: 1.0,
                flops: 0.0,
                copies: 1,
            },
            Call {
                kernel: "b".into(),
                label: "2".into(),
                dims: Dims::new(),
                per_token: 1,
                bytes: 1.0,
                flops: 0.0,
                copies: 1,
            },
            Call {
                kernel: "b".into(),
                label: "3".into(),
                dims: Dims::new(),
                per_token: 2,
                bytes: 1.0,
                flops: 0.0,
                copies: 1,
            },
        ];
        // a: 3 s; b: 2 s + 2 x 1 s = 4 s.
        let p = analyse(&calls, &[vec![3.0], vec![2.0], vec![1.0]], 10.0, 10.0);
        assert_eq!(p[0].kernel, "a");
        let (k, share) = bounding_kernel(&p).unwrap();
        assert_eq!(k, "b");
        assert!((share - 4.0 / 7.0).abs() < 1e-12);
    }
}

/// Bytes and FLOPs one decoded token spends at one activation point (a node of the family's
/// graph), summed over the layers it is in.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PointCost {
    /// Node name.
    pub node: String,
    /// Its op (`linear`, `attention`, ...).
    pub op: String,
    /// The kernel contract the op runs (`GraphOp::kernel`); empty for an elementwise primitive.
    pub kernel: String,
    /// Bytes of weights read (at the engine's dtype for matrices, f32 for vectors, as
    /// `quantization.keep_f32` keeps norm gains) plus, for attention, the f32 K and V rows read.
    pub bytes: f64,
    /// FLOPs: 2 per weight of a linear, 4 * kv_len * n_heads * head_dim for attention, one per
    /// output element otherwise.
    pub flops: f64,
}

/// The cost of each node of `graph` per decoded token at context length `kv_len`, in graph order,
/// summed over the `n_layers` layers for layer nodes. Shapes are the family's `[[model.weights]]`
/// at `cfg`; a linear that reads a row block (`rows` parameter: Phi-3's fused projections) counts
/// those rows; a `moe_experts` node counts the top_k experts its router keeps. Unknown shapes count
/// as 0 bytes.
pub fn point_costs(
    graph: &ckb::Graph,
    family: &ckb::ModelFamily,
    cfg: &ResolvedConfig,
    dtype: &str,
    kv_len: usize,
) -> Vec<PointCost> {
    use ckb::graph::eval_expr;
    use oracle::graph::config_role;
    let role = |r: &str| config_role(cfg, r);
    let shape = |pattern: &str| -> Vec<usize> {
        let Some(w) = family.weights.iter().find(|w| w.name == pattern) else { return vec![] };
        w.shape.iter().map(|d| eval_expr(d, &role).map(|v| v as usize).unwrap_or(0)).collect()
    };
    let (hd, nh, nkv) = (cfg.head_dim as f64, cfg.n_heads as f64, cfg.n_kv_heads as f64);
    let mut out = Vec::new();
    for (nodes, times) in [(&graph.prologue, 1.0), (&graph.layer, cfg.n_layers as f64), (&graph.epilogue, 1.0)] {
        for n in nodes {
            let kernel = ckb::GRAPH_OPS.iter().find(|o| o.name == n.op).and_then(|o| o.kernel).unwrap_or("");
            let mut bytes = 0.0;
            let mut flops = 0.0;
            for (slot, pattern) in &n.weights {
                // A linear with a `tied` slot reads the embedding table when config.json ties
                // the embeddings, else its own weight: never both.
                let is_matrix = slot == "weight" || slot == "tied";
                if n.weights.contains_key("tied") && is_matrix && (slot == "tied") != cfg.tied {
                    continue;
                }
                let s = shape(pattern);
                let cols = s.last().copied().unwrap_or(0) as f64;
                let rows = match n.params.get("rows") {
                    Some(e) if is_matrix => eval_expr(e, &role).unwrap_or(0.0),
                    _ => s.iter().rev().skip(1).fold(1.0, |acc, &d| acc * d as f64),
                };
                let elements = if s.len() >= 2 { rows * cols } else { s.iter().fold(1.0, |acc, &d| acc * d as f64) };
                if n.op == "embedding" {
                    // One row of the table.
                    bytes += cols * weight_bytes(dtype);
                    continue;
                }
                // Matrices at the weight dtype, unless the dtype policy keeps their role in f32
                // (gpt-oss's 2-D expert biases); vectors in f32.
                let kept = family.keeps_f32(pattern);
                bytes += elements * if s.len() >= 2 && !kept { weight_bytes(dtype) } else { 4.0 };
                if n.op == "linear" && is_matrix {
                    flops += 2.0 * elements;
                }
            }
            if ckb::is_attention(&n.op) {
                bytes += 2.0 * kv_len as f64 * nkv * hd * 4.0;
                flops += 4.0 * kv_len as f64 * nh * hd;
            }
            if ckb::is_moe_experts(&n.op) {
                // The weights above are one expert's (`moe_experts`, a tensor per expert) or every
                // expert's (`moe_experts_clamped`, fused [experts, ...] tensors); a token reads the
                // top_k its router keeps (the `moe_route` node named as the second input), 2 FLOPs
                // per weight read.
                let top_k = n
                    .inputs
                    .get(1)
                    .and_then(|r| nodes.iter().find(|x| &x.name == r))
                    .and_then(|r| r.params.get("top_k"))
                    .and_then(|e| eval_expr(e, &role).ok())
                    .unwrap_or(1.0);
                let fused = n.op == "moe_experts_clamped";
                let experts = n.params.get("experts").and_then(|e| eval_expr(e, &role).ok()).unwrap_or(1.0);
                bytes *= if fused { top_k / experts.max(1.0) } else { top_k };
                flops = 2.0 * bytes / weight_bytes(dtype);
            }
            if flops == 0.0 {
                flops = cfg.hidden as f64;
            }
            out.push(PointCost {
                node: n.name.clone(),
                op: n.op.clone(),
                kernel: kernel.to_string(),
                bytes: bytes * times,
                flops: flops * times,
            });
        }
    }
    out
}

/// One activation point of the engine's real forward pass, timed there (`forward_traced`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PointProfile {
    /// Graph node name (summed over layers for layer nodes).
    pub point: String,
    /// Layers it was reported in per token (0: prologue or epilogue).
    pub layers: usize,
    /// The kernel contract its op runs; empty for an elementwise primitive or an unknown point.
    pub kernel: String,
    /// Time per decoded token spent reaching this point from the previous one, microseconds, over
    /// the runs.
    pub time_us: Spread,
    /// Its share of the traced decode time per token (medians); the shares sum to at most 1.
    pub share_of_decode: f64,
    /// Bytes per token at this point (see [`PointCost`]).
    pub bytes: f64,
    /// Achieved GB/s at the median time.
    pub gb_s: f64,
    /// Roofline bound (`max(bytes / bandwidth, flops / peak)`) over the median time; 0 for a point
    /// counted with another (`fused_into`).
    pub roofline_fraction: f64,
    /// The point this one is counted with: the engine computed both in one fused step (its bytes
    /// and FLOPs are added there); empty otherwise.
    #[serde(default)]
    pub fused_into: String,
    /// FLOPs per token at this point (see [`PointCost`]), including fused points'.
    #[serde(default)]
    pub flops: f64,
}

/// Profiles of the points the engine reported, sorted by share, largest first. `traced_s` is the
/// traced decode seconds per token per run; `bandwidth_gbs` and `peak_gflops` the machine's at the
/// run's thread count and working set.
pub fn analyse_points(
    points: &[harness::protocol::PointTime],
    traced_s: &[f64],
    costs: &[PointCost],
    bandwidth_gbs: f64,
    peak_gflops: f64,
) -> Vec<PointProfile> {
    // Shares are means over the runs: in each run the points' times add up to at most the call's,
    // so their means do too (medians of parts need not add up to the median of the whole).
    let mean = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    let total = mean(traced_s);
    let mut out: Vec<PointProfile> = points
        .iter()
        .map(|p| {
            let t = Spread::of(&p.seconds.iter().map(|x| x * 1e6).collect::<Vec<_>>());
            let cost = costs.iter().find(|c| c.node == p.name);
            let (bytes, flops) = cost.map_or((0.0, 0.0), |c| (c.bytes, c.flops));
            PointProfile {
                point: p.name.clone(),
                layers: p.layers,
                kernel: cost.map(|c| c.kernel.clone()).unwrap_or_default(),
                time_us: t,
                share_of_decode: if total > 0.0 { mean(&p.seconds) / total } else { 0.0 },
                bytes,
                gb_s: 0.0,
                roofline_fraction: 0.0,
                fused_into: String::new(),
                flops,
            }
        })
        .collect();
    // A fused step (q, k and v from one product; gate and up) reports its points one after the
    // other: the time lands on the first, the later ones take next to none. A point of the same
    // kernel as the one before it, whose own time could not even read its bytes at the bandwidth,
    // is counted with that one.
    for k in 1..out.len() {
        let secs = out[k].time_us.median * 1e-6;
        let floor = out[k].bytes / (bandwidth_gbs * 1e9);
        let lead = (0..k).rev().find(|&j| out[j].fused_into.is_empty());
        if let Some(j) = lead
            && !out[k].kernel.is_empty()
            && out[k].kernel == out[j].kernel
            && secs < floor
        {
            let (b, f) = (out[k].bytes, out[k].flops);
            out[j].bytes += b;
            out[j].flops += f;
            out[k].fused_into = out[j].point.clone();
        }
    }
    for p in &mut out {
        let secs = p.time_us.median * 1e-6;
        if !p.fused_into.is_empty() || secs <= 0.0 {
            continue;
        }
        let bound = (p.bytes / (bandwidth_gbs * 1e9)).max(p.flops / (peak_gflops * 1e9));
        p.gb_s = p.bytes / secs / 1e9;
        p.roofline_fraction = bound / secs;
    }
    out.sort_by(|a, b| b.share_of_decode.total_cmp(&a.share_of_decode));
    out
}

/// The kernel with the largest summed share over the points (elementwise points, with no kernel,
/// are not counted), and that share.
pub fn bounding_kernel_of_points(points: &[PointProfile]) -> Option<(String, f64)> {
    let mut by: Vec<(String, f64)> = Vec::new();
    for p in points.iter().filter(|p| !p.kernel.is_empty()) {
        match by.iter_mut().find(|(k, _)| *k == p.kernel) {
            Some(e) => e.1 += p.share_of_decode,
            None => by.push((p.kernel.clone(), p.share_of_decode)),
        }
    }
    by.into_iter().max_by(|a, b| a.1.total_cmp(&b.1))
}
