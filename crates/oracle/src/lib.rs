//! Reference implementations in f64 of every kernel contract, and a reference forward pass for each
//! covered model family. Written from the contracts, independently of any engine; plain loops, no
//! tricks, so that they are easy to check by eye.
//!
//! The kernel registry ([`kernels`]) holds each kernel's drawing, faulted core, cost and harness
//! arms; the plain functions below are what the reference forward pass reads like.
//!
//! The modules: [`kernels`] (the registry), [`compare`](mod@compare) (the one comparator: a [`Verdict`]
//! with max abs/rel error, worst index, pass), [`diagnose`] (failure modes from mutants, for kernel
//! tests and generation), [`mutants`] (mutant names; model-level mutations), [`llama`] (the reference
//! forward pass, [`llama::Reference`]), [`graph`] (the reference as an interpreter of a family's graph,
//! with per-node traces), [`families`] (GeGLU, scaled RoPE, biases), [`moe`] (top-k routing and
//! weighted SwiGLU experts, written plainly), [`dtypes`] (exact widening of bf16/f16/int8 and the
//! load-time rounding an engine applies).
//!
//! Depends on `model` (resolved config and tensors), `ckb` (test case types), `util` and `error` only.

pub mod compare;
pub mod diagnose;
pub mod dtypes;
pub mod families;
pub mod graph;
pub mod kernels;
pub mod llama;
pub mod moe;
pub mod mutants;

pub use compare::{NonFinite, Side, UNWRITTEN, Verdict, compare, compare_prediction, judge, judge_prediction};
pub use families::gelu_tanh_and_mul;

/// What the oracle implements, for the CKB's load, propose and check: every kernel with a registry
/// entry and every mutant name (see [`ckb::Implemented`]).
pub fn implemented() -> ckb::Implemented {
    ckb::Implemented {
        kernels: kernels::ids().map(str::to_owned).collect(),
        mutants: mutants::names().into_iter().map(str::to_owned).collect(),
    }
}

/// Whether an oracle implements this kernel contract (it has an entry in [`kernels::REGISTRY`]).
/// `ckb check` refuses a kernel contract without one.
pub fn kernel_oracle_exists(id: &str) -> bool {
    kernels::get(id).is_some()
}

/// Embedding lookup. `table`: [vocab, dim]; `ids`: [n]; returns [n, dim]. (contract kernel.embedding)
///
/// # Panics
/// When an id is outside the table (the caller draws ids within the vocabulary).
pub fn embedding(table: &[f64], dim: usize, ids: &[u32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &id in ids {
        let row = id as usize * dim;
        out.extend_from_slice(&table[row..row + dim]);
    }
    out
}

/// RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) over rows of width `weight.len()`:
/// `y = x / sqrt(mean(x^2) + eps) * w`. `x`: [rows, dim]. (contract kernel.rms_norm)
pub fn rms_norm(x: &[f64], weight: &[f64], eps: f64) -> Vec<f64> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(v, w)| v * inv * w));
    }
    out
}

/// Rotary embedding with rotate-half pairing (HF Llama; Su et al. 2021, arXiv:2104.09864), in place.
/// `x`: [n_tokens, n_heads, head_dim]; pairs (j, j + head_dim/2), angle = pos * theta^(-2j/head_dim).
/// (contract kernel.rope)
pub fn rope(x: &mut [f64], positions: &[usize], n_heads: usize, head_dim: usize, theta: f64) {
    let half = head_dim / 2;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for j in 0..half {
                let freq = theta.powf(-2.0 * j as f64 / head_dim as f64);
                let (sin, cos) = (pos as f64 * freq).sin_cos();
                let a = x[base + j];
                let b = x[base + j + half];
                x[base + j] = a * cos - b * sin;
                x[base + j + half] = a * sin + b * cos;
            }
        }
    }
}

/// `y = x W^T`. `x`: [m, k]; `w`: [n, k]; returns [m, n]. (contract kernel.linear)
pub fn linear(x: &[f64], w: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
        }
    }
    out
}

/// SiLU (Elfwing et al. 2017) of `gate` times `up`, element-wise. (contract kernel.silu_and_mul)
pub fn silu_and_mul(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter().zip(up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect()
}

/// Softmax over each row of width `n`, with the row maximum subtracted first. (contract kernel.softmax)
pub fn softmax(x: &[f64], n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = row.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        out.extend(exps.iter().map(|e| e / sum));
    }
    out
}

/// Shapes of one attention call (see contract kernel.attention).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// New query tokens.
    pub n_q: usize,
    /// Cache positions filled, including the new tokens.
    pub kv_len: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; `n_heads` is a multiple of it.
    pub n_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

/// Causal grouped-query attention (Vaswani et al. 2017; Ainslie et al. 2023, arXiv:2305.13245).
/// `q`: [n_q, n_heads, head_dim]; `k`, `v`: [kv_len, n_kv_heads, head_dim]; returns
/// [n_q, n_heads, head_dim]. Query i sits at position kv_len - n_q + i and sees positions 0..=that;
/// head h reads KV head h / (n_heads / n_kv_heads); scores scaled by 1/sqrt(head_dim).
/// (contract kernel.attention)
pub fn attention(q: &[f64], k: &[f64], v: &[f64], s: AttnShape) -> Vec<f64> {
    let AttnShape { n_q, kv_len, n_heads, n_kv_heads, head_dim } = s;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0.0; n_q * n_heads * head_dim];
    for i in 0..n_q {
        let pos = kv_len - n_q + i;
        for h in 0..n_heads {
            let kvh = h / group;
            let qv = &q[(i * n_heads + h) * head_dim..][..head_dim];
            let scores: Vec<f64> = (0..=pos)
                .map(|t| {
                    let kv = &k[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                    qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * scale
                })
                .collect();
            let p = softmax(&scores, scores.len());
            let o = &mut out[(i * n_heads + h) * head_dim..][..head_dim];
            for (t, pt) in p.iter().enumerate() {
                let vv = &v[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                for (oj, vj) in o.iter_mut().zip(vv) {
                    *oj += pt * vj;
                }
            }
        }
    }
    out
}

/// Causal grouped-query attention with a learned logit per query head in the softmax (gpt-oss's
/// attention sinks; Xiao et al. 2023, arXiv:2309.17453, with the sink a learned scalar as in
/// OpenAI's gpt-oss model card 2025): the scores of head h get `sinks[h]` appended before the softmax
/// and its probability dropped after, so the weights of the real positions sum to less than 1.
/// Shapes and masking as [`attention`]; `sinks` [n_heads]. (contract kernel.attention_sinks)
pub fn attention_sinks(q: &[f64], k: &[f64], v: &[f64], sinks: &[f64], s: AttnShape) -> Vec<f64> {
    let AttnShape { n_q, kv_len, n_heads, n_kv_heads, head_dim } = s;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0.0; n_q * n_heads * head_dim];
    for i in 0..n_q {
        let pos = kv_len - n_q + i;
        for h in 0..n_heads {
            let kvh = h / group;
            let qv = &q[(i * n_heads + h) * head_dim..][..head_dim];
            let mut scores: Vec<f64> = (0..=pos)
                .map(|t| {
                    let kv = &k[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                    qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * scale
                })
                .collect();
            scores.push(sinks[h]);
            let p = softmax(&scores, scores.len());
            let o = &mut out[(i * n_heads + h) * head_dim..][..head_dim];
            for (t, pt) in p[..=pos].iter().enumerate() {
                let vv = &v[(t * n_kv_heads + kvh) * head_dim..][..head_dim];
                for (oj, vj) in o.iter_mut().zip(vv) {
                    *oj += pt * vj;
                }
            }
        }
    }
    out
}

/// Largest gap between the reference's greedy logit and another token's at which an engine may
/// choose either: engines that compute in f32 (over f32 or bf16 weights) give logits within 1e-5 to
/// 1e-4 of the f64 reference's (the contracts' tolerances), so a gap under 1e-3 is a near-tie either
/// side may win. Used where
/// an engine's own tokens are judged (profile's timed runs, serve_engine's answers).
pub const GREEDY_TIE: f64 = 1e-3;

/// Index of the largest element, the first on ties. (contract kernel.argmax)
///
/// # Panics
/// On an empty slice.
pub fn argmax(x: &[f64]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// Widen f32 values to f64.
pub fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Sampling parameters of one request (contract kernel.sample). Neutral values switch a step off:
/// temperature 1, top_k 0, top_p 1, min_p 0, repetition_penalty 1, frequency and presence
/// penalties 0; temperature 0 is greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Divides the penalised logits; 0 means greedy (argmax, first on ties).
    pub temperature: f64,
    /// Keep the k highest-ranked tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the shortest rank prefix whose probability mass reaches top_p (the crossing token
    /// kept); 1 keeps all.
    pub top_p: f64,
    /// Drop tokens whose probability is below min_p times the top token's; 0 keeps all.
    pub min_p: f64,
    /// CTRL / HF repetition penalty r: a previous token's logit l becomes l / r if l > 0, else l * r.
    pub repetition_penalty: f64,
    /// OpenAI frequency penalty: subtracted once per previous occurrence.
    pub frequency_penalty: f64,
    /// OpenAI presence penalty: subtracted once when the token occurred at all.
    pub presence_penalty: f64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

/// The token kernel.sample draws from `logits` ([n], n >= 1) for the previous tokens `prev`, the
/// parameters `p` and the uniform number `u` in [0, 1), in the contract's order: penalties on the
/// raw logits (repetition, then frequency and presence), greedy when temperature is 0, else divide
/// by the temperature, rank by scaled logit (ties: lower id first), top-k, softmax over the kept
/// tokens, top-p (crossing token kept), min-p (relative to the top token), renormalise, and return
/// the first token in rank order whose cumulative probability exceeds u (the last kept one when
/// rounding leaves none). Sources: Keskar et al. 2019 (repetition penalty, arXiv:1909.05858),
/// OpenAI API reference (frequency and presence penalties), Fan et al. 2018 (top-k,
/// arXiv:1805.04833), Holtzman et al. 2020 (top-p, arXiv:1904.09751), Nguyen et al. 2024 (min-p,
/// arXiv:2407.01082).
///
/// # Panics
/// On empty logits.
pub fn sample(logits: &[f64], prev: &[u32], p: &SamplingParams, u: f64) -> usize {
    let n = logits.len();
    let mut count = vec![0usize; n];
    for &t in prev {
        if let Some(c) = count.get_mut(t as usize) {
            *c += 1;
        }
    }
    let mut l = logits.to_vec();
    for i in 0..n {
        if count[i] > 0 {
            l[i] = if l[i] > 0.0 { l[i] / p.repetition_penalty } else { l[i] * p.repetition_penalty };
            l[i] -= count[i] as f64 * p.frequency_penalty + p.presence_penalty;
        }
    }
    if p.temperature == 0.0 {
        return argmax(&l);
    }
    let z: Vec<f64> = l.iter().map(|v| v / p.temperature).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
    if p.top_k > 0 && p.top_k < n {
        order.truncate(p.top_k);
    }
    let top = z[order[0]];
    let e: Vec<f64> = order.iter().map(|&i| (z[i] - top).exp()).collect();
    let total: f64 = e.iter().sum();
    let probs: Vec<f64> = e.iter().map(|x| x / total).collect();
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut mass = 0.0;
        for (j, q) in probs.iter().enumerate() {
            mass += q;
            if mass >= p.top_p {
                keep = j + 1;
                break;
            }
        }
    }
    let kept: Vec<(usize, f64)> = order
        .iter()
        .zip(&probs)
        .take(keep)
        .filter(|(_, q)| p.min_p <= 0.0 || **q >= p.min_p * probs[0])
        .map(|(&i, &q)| (i, q))
        .collect();
    let mass: f64 = kept.iter().map(|(_, q)| q).sum();
    let mut cdf = 0.0;
    for &(i, q) in &kept {
        cdf += q / mass;
        if u < cdf {
            return i;
        }
    }
    kept.last().expect("the top token is always kept").0
}
