//! One step of the graph reference: each block run node by node on the residual stream, every op
//! a registry kernel or an elementwise primitive, with the KV caches and the mutations applied.

use crate::AttnShape;
use crate::families::{rope_inv_freq, rope_pairs_with_freqs};
use crate::kernels::{
    attention, attention_sinks, embedding, gelu_tanh, gelu_tanh_and_mul, layer_norm, linear, moe_experts,
    moe_experts_clamped, moe_route, rms_norm, rope, rotary, silu_and_mul,
};
use crate::mutants::{Mutation, Mutations};
use model::ResolvedConfig;

use super::{Bound, Prepared, Src, Trace};

/// One step's execution state.
pub(super) struct Exec<'a> {
    pub(super) cfg: &'a ResolvedConfig,
    pub(super) store: &'a [Vec<f64>],
    pub(super) k_cache: &'a mut [Vec<f64>],
    pub(super) v_cache: &'a mut [Vec<f64>],
    pub(super) pos: usize,
    pub(super) token: u32,
    pub(super) inv_freq: Option<&'a [f64]>,
    pub(super) m: Mutations,
    pub(super) f32_activations: bool,
}

impl Exec<'_> {
    /// Run a block on the incoming stream; return its last node's output.
    pub(super) fn block(&mut self, nodes: &[Prepared], stream: Vec<f64>, trace: &mut Option<&mut Trace>) -> Vec<f64> {
        let mut vals: Vec<Vec<f64>> = Vec::with_capacity(nodes.len());
        for n in nodes {
            let ins: Vec<&[f64]> = n
                .inputs
                .iter()
                .map(|s| match *s {
                    Src::Stream => stream.as_slice(),
                    Src::Node(j) => vals[j].as_slice(),
                    Src::Token => &[],
                })
                .collect();
            // A swapped pair: the first runs the second's op on its own input, the second the
            // first's op on that; each output is traced under the name of the op that made it (as
            // an engine computing in that order reports it).
            let by = n.swap.map_or(n, |j| &nodes[j]);
            let mut out = self.node(by, &ins);
            if self.f32_activations {
                out.iter_mut().for_each(|v| *v = *v as f32 as f64);
            }
            if let Some(t) = trace.as_deref_mut() {
                t.push((by.trace.clone(), out.clone()));
            }
            vals.push(out);
        }
        vals.pop().unwrap_or(stream)
    }

    fn node(&mut self, n: &Prepared, ins: &[&[f64]]) -> Vec<f64> {
        let input = |i: usize| ins[i];
        if n.skip {
            return input(0).to_vec();
        }
        let (c, m) = (self.cfg, self.m);
        let slice = |b: &Bound| &self.store[b.at][b.offset * b.cols..(b.offset + b.rows) * b.cols];
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        match n.op.as_str() {
            "embedding" => {
                let w = n.weight.expect("table bound");
                let f = embedding::Faults { off_by_one: m.has(Mutation::EmbeddingOffByOne) };
                embedding::core(&self.store[w.at], w.cols, &[self.token], f)
            }
            "scale" => {
                let f = n.params["factor"];
                input(0).iter().map(|v| v * f).collect()
            }
            "softcap" => {
                let cap = n.params["cap"];
                if cap > 0.0 { input(0).iter().map(|v| cap * (v / cap).tanh()).collect() } else { input(0).to_vec() }
            }
            "add" => input(0).iter().zip(input(1)).map(|(a, b)| a + b).collect(),
            "rms_norm" => {
                let w = n.weight.expect("weight bound");
                let eps = n.params.get("eps").copied().unwrap_or(c.rms_norm_eps);
                let f = rms_norm::Faults {
                    eps_outside: m.has(Mutation::RmsNormEpsOutside),
                    no_weight: m.has(Mutation::RmsNormNoWeight),
                };
                let gain = slice(&w);
                match n.params.get("group").map(|g| *g as usize) {
                    // Rows of `group` entries, each with its own slice of a wider gain.
                    Some(g) if g > 0 && g < gain.len() && gain.len().is_multiple_of(g) => input(0)
                        .chunks(g)
                        .enumerate()
                        .flat_map(|(i, row)| {
                            let at = (i * g) % gain.len();
                            rms_norm::core(row, &gain[at..at + g], eps, f)
                        })
                        .collect(),
                    _ => rms_norm::core(input(0), gain, eps, f),
                }
            }
            "linear" => {
                let w = n.weight.expect("weight bound");
                let f = linear::Faults { xw: m.has(Mutation::LinearXw) };
                let mut y = linear::core(input(0), slice(&w), 1, w.cols, w.rows, f);
                if let Some(b) = &n.bias {
                    let bias = &self.store[b.at][w.offset..w.offset + w.rows];
                    y.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
                y
            }
            "rope" => {
                let heads = n.params["heads"] as usize;
                let theta = n.params.get("theta").copied().unwrap_or(c.rope_theta);
                let mut x = input(0).to_vec();
                // `scaling = 0` (a failure rewrite): config.json's rope_scaling ignored.
                let scaled = self.inv_freq.filter(|_| n.params.get("scaling") != Some(&0.0));
                let f = rope::Faults {
                    adjacent: m.has(Mutation::RopeAdjacent),
                    theta_default: m.has(Mutation::RopeThetaDefault),
                };
                match scaled {
                    // Scaled frequencies, with the kernel's faults as the kernel core has them.
                    Some(_) if f.theta_default || theta != c.rope_theta => {
                        let base = if f.theta_default { rope::DEFAULT_THETA } else { theta };
                        let freqs = rope_inv_freq(hd, base, c.rope_scaling.as_ref());
                        rope_pairs_with_freqs(&mut x, self.pos, heads, hd, &freqs, f.adjacent);
                    }
                    Some(freqs) => rope_pairs_with_freqs(&mut x, self.pos, heads, hd, freqs, f.adjacent),
                    None => rope::core(&mut x, &[self.pos], heads, hd, theta, f),
                }
                // YaRN's attention factor multiplies cos and sin (1 for the other scalings).
                if scaled.is_some() {
                    let af = c.rope_scaling.as_ref().map_or(1.0, |s| s.attention_factor);
                    x.iter_mut().for_each(|v| *v *= af);
                }
                x
            }
            "rotary" => {
                let heads = n.params["heads"] as usize;
                let theta = n.params.get("theta").copied().unwrap_or(c.rope_theta);
                let rot = n.params.get("rotary_dim").map_or(hd, |r| *r as usize);
                let interleaved = n.params.get("interleaved").is_some_and(|v| *v != 0.0);
                let mut x = input(0).to_vec();
                let scaling = c.rope_scaling.as_ref().filter(|_| n.params.get("scaling") != Some(&0.0));
                let base = if m.has(Mutation::RopeThetaDefault) { rope::DEFAULT_THETA } else { theta };
                // kernel.rope's adjacent-pairs mutation is not this kernel's: a wrong pairing
                // here is failure.rope-pairing-swapped's rewrite (`interleaved` set).
                let f = rotary::Faults {
                    freq_over_head_dim: m.has(Mutation::RotaryFreqOverHeadDim),
                    ..rotary::Faults::default()
                };
                match scaling {
                    Some(s) => {
                        let freqs = rope_inv_freq(rot, base, Some(s));
                        rotary::rotate(&mut x, self.pos, heads, hd, &freqs, interleaved != f.pairing_swapped);
                        // YaRN's attention factor scales the rotated entries only.
                        for head in x.chunks_mut(hd) {
                            head[..rot.min(hd)].iter_mut().for_each(|v| *v *= s.attention_factor);
                        }
                    }
                    None => rotary::core(&mut x, &[self.pos], heads, hd, rot, base, interleaved, f),
                }
                x
            }
            "layer_norm" => {
                let eps = n.params["eps"];
                let f =
                    layer_norm::Faults { no_mean: m.has(Mutation::LayerNormNoMean), ..layer_norm::Faults::default() };
                let gain = n.weight.map(|w| slice(&w));
                let bias = n.bias.map(|b| &self.store[b.at][b.offset..b.offset + b.rows]);
                let width = gain
                    .map(<[f64]>::len)
                    .or(bias.map(<[f64]>::len))
                    .or(n.params.get("group").map(|g| *g as usize))
                    .unwrap_or(input(0).len());
                layer_norm::core(input(0), width, gain.unwrap_or(&[]), bias.unwrap_or(&[]), eps, f)
            }
            "gelu_tanh" => gelu_tanh::core(input(0), gelu_tanh::Faults { erf: m.has(Mutation::GeluErf) }),
            "clamp" => {
                let l = n.params["limit"];
                if l > 0.0 { input(0).iter().map(|v| v.clamp(-l, l)).collect() } else { input(0).to_vec() }
            }
            "attention" | "attention_sinks" => {
                let (q, k, v) = (input(0), input(1), input(2));
                let pos = self.pos;
                let l = n.cache;
                // `kv_row` (a failure rewrite): every step's K/V written at that row.
                let fixed = n.params.get("kv_row").map(|r| (*r as usize).min(pos));
                if m.has(Mutation::KvPositionOffByOne) || fixed.is_some() {
                    let (width, row) = (nkv * hd, fixed.unwrap_or(pos.saturating_sub(1)) * nkv * hd);
                    for (cache, new) in [(&mut self.k_cache[l], k), (&mut self.v_cache[l], v)] {
                        cache.resize((pos + 1) * width, 0.0);
                        cache[row..row + width].copy_from_slice(new);
                    }
                } else {
                    self.k_cache[l].extend_from_slice(k);
                    self.v_cache[l].extend_from_slice(v);
                }
                let window = n.params.get("window").map_or(0, |w| *w as usize);
                let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
                let shape = AttnShape { n_q: 1, kv_len: pos + 1 - start, n_heads: nh, n_kv_heads: nkv, head_dim: hd };
                let from = start * nkv * hd;
                let f = attention::Faults {
                    gqa_modulo: m.has(Mutation::GqaModulo),
                    no_mask: false,
                    no_scale: m.has(Mutation::AttentionNoScale),
                    softmax_no_max: false,
                };
                let (keys, values) = (&self.k_cache[l][from..], &self.v_cache[l][from..]);
                if let Some(s) = n.slots.get("sinks") {
                    let scale = if f.no_scale { 1.0 } else { 1.0 / (hd as f64).sqrt() };
                    let f = attention_sinks::Faults { dropped: m.has(Mutation::SinksDropped), attention: f };
                    return attention_sinks::core(q, keys, values, slice(s), shape, scale, f);
                }
                match (n.params.get("scale"), n.params.get("softcap")) {
                    (None, None) => attention::core(q, keys, values, shape, f),
                    (scale, cap) => {
                        let scale = if f.no_scale { 1.0 } else { scale.copied().unwrap_or(1.0 / (hd as f64).sqrt()) };
                        attention::core_with(q, keys, values, shape, f, scale, cap.copied().unwrap_or(0.0))
                    }
                }
            }
            "moe_route" => {
                let f = moe_route::Faults {
                    no_renorm: m.has(Mutation::MoeNoRenorm),
                    softmax_over_topk: m.has(Mutation::MoeSoftmaxOverTopk),
                    ties_last: false,
                    off_by_one: m.has(Mutation::MoeExpertOffByOne),
                };
                let renormalize = n.params.get("renormalize").is_some_and(|r| *r != 0.0);
                moe_route::core(input(0), n.params["top_k"] as usize, renormalize, f)
            }
            "moe_experts" => {
                let [g, u, d] = n.experts.expect("experts bound");
                let count = n.params["experts"] as usize;
                let inter = g.rows / count.max(1);
                let f = moe_experts::Faults {
                    unweighted: m.has(Mutation::MoeUnweighted),
                    linear: linear::Faults { xw: m.has(Mutation::LinearXw) },
                    silu: silu_and_mul::Faults { swapped: m.has(Mutation::SiluSwapped) },
                };
                moe_experts::core(input(0), input(1), &self.store[g.at], &self.store[u.at], &self.store[d.at], inter, f)
            }
            "moe_experts_clamped" => {
                let t = |slot: &str| self.store[n.slots[slot].at].as_slice();
                let (x, count) = (input(0), n.params["experts"] as usize);
                let inter = t("down").len() / (count * x.len()).max(1);
                let f = moe_experts_clamped::Faults {
                    halves: m.has(Mutation::MoeGateUpHalves),
                    unclamped: m.has(Mutation::SwigluUnclamped),
                };
                let (alpha, limit) = (n.params["alpha"], n.params["limit"]);
                let (gu, gub, d, db) = (t("gate_up"), t("gate_up_bias"), t("down"), t("down_bias"));
                moe_experts_clamped::core(x, input(1), gu, gub, d, db, inter, alpha, limit, f)
            }
            "silu_and_mul" => {
                silu_and_mul::core(input(0), input(1), silu_and_mul::Faults { swapped: m.has(Mutation::SiluSwapped) })
            }
            "gelu_tanh_and_mul" => {
                gelu_tanh_and_mul::core(input(0), input(1), gelu_tanh_and_mul::Faults { erf: m.has(Mutation::GeluErf) })
            }
            other => unreachable!("lint refuses op `{other}`"),
        }
    }
}
