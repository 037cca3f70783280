//! Mixture-of-experts routing and expert MLP, written plainly: the functions the reference forward
//! pass's kernels must equal bit for bit without faults (`kernels::moe_route`, `kernels::moe_experts`).
//!
//! Routing as Mixtral (Jiang et al. 2024, arXiv:2401.04088, eq. 1-2: softmax over the top-k router
//! logits, which equals the softmax over all experts renormalised over the kept ones) and Qwen3-MoE
//! (transformers `Qwen3MoeSparseMoeBlock`: softmax over all experts, the top-k kept, divided by their
//! sum when `norm_topk_prob`); expert MLP SwiGLU (Shazeer 2020, arXiv:2002.05202).

/// Routing weights of one token. `scores` [n_experts] are the router logits; the result [n_experts]
/// holds, for each of the `top_k` experts of largest softmax probability (on equal scores the lower
/// index first), its probability (divided by the kept ones' sum when `renormalize`), and 0 for every
/// other expert. `top_k` is at most n_experts (a larger one keeps every expert).
pub fn moe_route(scores: &[f64], top_k: usize, renormalize: bool) -> Vec<f64> {
    let probs = super::softmax(scores, scores.len().max(1));
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Stable: equal scores keep the lower index first.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let kept = &order[..top_k.min(order.len())];
    let sum: f64 = kept.iter().map(|&e| probs[e]).sum();
    let mut out = vec![0.0; scores.len()];
    for &e in kept {
        out[e] = if renormalize { probs[e] / sum } else { probs[e] };
    }
    out
}

/// The SwiGLU experts of one token, weighted by `route` [n_experts] (nonzero for the selected
/// experts): `sum_e route[e] * (silu(x G_e^T) * (x U_e^T)) D_e^T` over experts with route[e] != 0.
/// `x` [hidden]; `gate`, `up` [n_experts, inter, hidden] and `down` [n_experts, hidden, inter],
/// row-major and stacked by expert. Returns [hidden].
pub fn moe_experts(x: &[f64], route: &[f64], gate: &[f64], up: &[f64], down: &[f64], inter: usize) -> Vec<f64> {
    let hidden = x.len();
    let mut out = vec![0.0; hidden];
    for (e, &w) in route.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let at = e * inter * hidden;
        let g = super::linear(x, &gate[at..at + inter * hidden], 1, hidden, inter);
        let u = super::linear(x, &up[at..at + inter * hidden], 1, hidden, inter);
        let a = super::silu_and_mul(&g, &u);
        let y = super::linear(&a, &down[at..at + inter * hidden], 1, inter, hidden);
        out.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
    }
    out
}

/// gpt-oss's experts of one token (transformers `GptOssExperts`; OpenAI 2025, arXiv:2508.10925):
/// for each expert e with route[e] != 0, `y = x GU_e + b_e` [2 inter] with `GU_e` stored
/// input-major [hidden, 2 inter]; gate = y[0::2] clamped above at `limit`, up = y[1::2] clamped to
/// [-limit, limit] (interleaved); `a = (up + 1) * gate * sigmoid(alpha * gate)`;
/// `z = a D_e + c_e` with `D_e` input-major [inter, hidden]; out = sum_e route[e] * z.
/// `gate_up` [n_experts, hidden, 2 inter], `gate_up_bias` [n_experts, 2 inter], `down`
/// [n_experts, inter, hidden], `down_bias` [n_experts, hidden]. Returns [hidden].
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_clamped(
    x: &[f64],
    route: &[f64],
    gate_up: &[f64],
    gate_up_bias: &[f64],
    down: &[f64],
    down_bias: &[f64],
    inter: usize,
    alpha: f64,
    limit: f64,
) -> Vec<f64> {
    let hidden = x.len();
    let mut out = vec![0.0; hidden];
    for (e, &w) in route.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let gu = &gate_up[e * hidden * 2 * inter..][..hidden * 2 * inter];
        let y: Vec<f64> = (0..2 * inter)
            .map(|j| (0..hidden).map(|h| x[h] * gu[h * 2 * inter + j]).sum::<f64>() + gate_up_bias[e * 2 * inter + j])
            .collect();
        let a: Vec<f64> = (0..inter)
            .map(|j| {
                let gate = y[2 * j].min(limit);
                let up = y[2 * j + 1].clamp(-limit, limit);
                (up + 1.0) * (gate / (1.0 + (-alpha * gate).exp()))
            })
            .collect();
        let dn = &down[e * inter * hidden..][..inter * hidden];
        for (c, o) in out.iter_mut().enumerate() {
            let z = (0..inter).map(|j| a[j] * dn[j * hidden + c]).sum::<f64>() + down_bias[e * hidden + c];
            *o += w * z;
        }
    }
    out
}
