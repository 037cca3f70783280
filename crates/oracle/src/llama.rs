//! Reference forward pass of the dense decoder families in f64, built from the oracle kernels:
//! [`Reference`] runs the family contract's graph through `oracle::graph` (what the gates use), or
//! the hand-written pass below. Used by verify_generation as the expected logits and tokens. The same pass covers the other
//! dense decoder families (Mistral, Qwen2, Qwen3, Gemma) through the resolved config's `features`:
//! q/k/v biases, per-head q/k RMSNorm, sliding-window attention, GeGLU, `(1 + w)` RMSNorm, the
//! `sqrt(hidden)` embedding scale, RoPE scaling, and fused q/k/v and gate/up weight tensors (Phi-3's
//! layout, split into their row blocks at load). Without features the numbers are plain Llama's.

use super::families::{add_bias, rope_inv_freq, rope_pairs_with_freqs};
use super::graph::{GraphReference, Trace};
use super::kernels::{attention, embedding, linear, rms_norm, rope, silu_and_mul};
use super::mutants::{Mutation, Mutations};
use super::{AttnShape, argmax, widen};
use base::error::{Error, Result};
use ckb::ModelFamily;
use model::{ResolvedConfig, Tensors};

struct Layer {
    attn_norm: Vec<f64>,
    wq: Vec<f64>,
    wk: Vec<f64>,
    wv: Vec<f64>,
    wo: Vec<f64>,
    ffn_norm: Vec<f64>,
    w_gate: Vec<f64>,
    w_up: Vec<f64>,
    w_down: Vec<f64>,
    /// q/k/v projection biases (feature `qkv_bias`).
    bias: Option<[Vec<f64>; 3]>,
    /// Per-head RMSNorm weights of q and k, [head_dim] (feature `qk_norm`).
    qk_norm: Option<[Vec<f64>; 2]>,
}

/// Hands out a checkpoint tensor (shape, values) by name.
type TakeTensor<'a> = dyn Fn(&str) -> Option<(Vec<usize>, Vec<f32>)> + 'a;

/// The hand-written forward pass of the closed `features`, kept as the yardstick the graph
/// interpreter is held to (bit for bit, tests/it/graph.rs) and for configs built without a family
/// contract.
struct Handwritten {
    cfg: ResolvedConfig,
    embed: Vec<f64>,
    layers: Vec<Layer>,
    norm: Vec<f64>,
    lm_head: Option<Vec<f64>>,
    k_cache: Vec<Vec<f64>>,
    v_cache: Vec<Vec<f64>>,
    len: usize,
    /// RoPE inverse frequencies when config.json scales them (`rope_scaling`); None: plain RoPE.
    inv_freq: Option<Vec<f64>>,
    /// Factor on the embedding row: sqrt(hidden) rounded to f32 (feature `embed_scale_sqrt_hidden`), else 1.
    embed_scale: f64,
    /// Known-wrong variants applied by [`Reference::step`]; empty for the true forward pass.
    mutations: Mutations,
}

impl Handwritten {
    /// Build from a resolved config and the checkpoint's tensors, checking every shape.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Input`] naming a missing tensor or a shape that disagrees with config.json.
    pub fn new(cfg: &ResolvedConfig, tensors: &Tensors) -> Result<Handwritten> {
        Handwritten::with_weight_dtype(cfg, tensors, "f32")
    }

    /// As [`Reference::new`], on the weights an engine storing its 2-D tensors (embeddings,
    /// projections, lm_head) in `weight_dtype` computes with: bf16/f16 rounded to nearest even, or
    /// int8 quantised per row and dequantised (contracts kernel.linear_bf16, kernel.linear_f16,
    /// kernel.linear_int8). 1-D tensors (norm weights, biases) stay as stored. `f32`: as stored.
    ///
    /// # Errors
    /// As [`Reference::new`]; Usage for a dtype outside [`ckb::WEIGHT_DTYPES`].
    pub fn with_weight_dtype(cfg: &ResolvedConfig, tensors: &Tensors, weight_dtype: &str) -> Result<Handwritten> {
        Handwritten::build(cfg, weight_dtype, &|name| tensors.get(name).cloned())
    }

    /// As [`Reference::with_weight_dtype`], consuming the tensors: each f32 tensor is freed as soon
    /// as it is widened, so building holds the f64 copy plus one tensor (8 bytes per parameter at
    /// the peak instead of 12: for a 1.24B-parameter model about 9.9 GB instead of 14.8 GB).
    ///
    /// # Errors
    /// As [`Reference::with_weight_dtype`].
    pub fn from_tensors(cfg: &ResolvedConfig, tensors: Tensors, weight_dtype: &str) -> Result<Handwritten> {
        let cell = std::cell::RefCell::new(tensors);
        Handwritten::build(cfg, weight_dtype, &|name| cell.borrow_mut().remove(name))
    }

    /// Build from tensors handed out by name by `take` (each asked for at most once).
    fn build(cfg: &ResolvedConfig, weight_dtype: &str, take: &TakeTensor<'_>) -> Result<Handwritten> {
        if !ckb::WEIGHT_DTYPES.contains(&weight_dtype) {
            return Err(Error::usage(format!(
                "weight dtype `{weight_dtype}` unknown; use one of {}",
                ckb::WEIGHT_DTYPES.join(", ")
            )));
        }
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f64>> {
            let (s, v) = take(name).ok_or_else(|| {
                Error::input(format!("the checkpoint has no tensor `{name}` (required by {})", cfg.family))
            })?;
            if s != shape {
                return Err(Error::input(format!("tensor `{name}` has shape {s:?}, config.json implies {shape:?}")));
            }
            Ok(if shape.len() == 2 { super::dtypes::as_stored(&v, shape[1], weight_dtype) } else { widen(&v) })
        };
        let (h, hd, nh, nkv, ff) = (cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate);
        // Gemma's RMSNorm multiplies by (1 + w): fold the 1 into the stored weight once.
        let one_plus = cfg.has("rmsnorm_one_plus_w");
        let norm_w = |name: &str, n: usize| -> Result<Vec<f64>> {
            let w = get(name, &[n])?;
            Ok(if one_plus { w.iter().map(|x| 1.0 + x).collect() } else { w })
        };
        // Row blocks of a fused tensor: q | k | v for `fused_qkv` (Phi-3's qkv_proj), gate | up for
        // `fused_gate_up` (Phi-3's gate_up_proj). Rows are contiguous in a row-major [rows, cols]
        // tensor, so splitting is slicing; int8's per-row scales are unaffected.
        let split = |v: Vec<f64>, cols: usize, rows: &[usize]| -> Vec<Vec<f64>> {
            let mut at = 0;
            rows.iter()
                .map(|r| {
                    let part = v[at * cols..(at + r) * cols].to_vec();
                    at += r;
                    part
                })
                .collect()
        };
        let (qd, kvd) = (nh * hd, nkv * hd);
        let mut layers = Vec::new();
        for i in 0..cfg.n_layers {
            let p = format!("model.layers.{i}.");
            let [wq, wk, wv]: [Vec<f64>; 3] = if cfg.has("fused_qkv") {
                let w = get(&format!("{p}self_attn.qkv_proj.weight"), &[qd + 2 * kvd, h])?;
                split(w, h, &[qd, kvd, kvd]).try_into().expect("three parts")
            } else {
                [
                    get(&format!("{p}self_attn.q_proj.weight"), &[qd, h])?,
                    get(&format!("{p}self_attn.k_proj.weight"), &[kvd, h])?,
                    get(&format!("{p}self_attn.v_proj.weight"), &[kvd, h])?,
                ]
            };
            let [w_gate, w_up]: [Vec<f64>; 2] = if cfg.has("fused_gate_up") {
                let w = get(&format!("{p}mlp.gate_up_proj.weight"), &[2 * ff, h])?;
                split(w, h, &[ff, ff]).try_into().expect("two parts")
            } else {
                [get(&format!("{p}mlp.gate_proj.weight"), &[ff, h])?, get(&format!("{p}mlp.up_proj.weight"), &[ff, h])?]
            };
            let bias = match (cfg.has("qkv_bias"), cfg.has("fused_qkv")) {
                (false, _) => None,
                (true, true) => {
                    let b = get(&format!("{p}self_attn.qkv_proj.bias"), &[qd + 2 * kvd])?;
                    Some(split(b, 1, &[qd, kvd, kvd]).try_into().expect("three parts"))
                }
                (true, false) => Some([
                    get(&format!("{p}self_attn.q_proj.bias"), &[qd])?,
                    get(&format!("{p}self_attn.k_proj.bias"), &[kvd])?,
                    get(&format!("{p}self_attn.v_proj.bias"), &[kvd])?,
                ]),
            };
            let qk_norm = if cfg.has("qk_norm") {
                Some([
                    norm_w(&format!("{p}self_attn.q_norm.weight"), hd)?,
                    norm_w(&format!("{p}self_attn.k_norm.weight"), hd)?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                bias,
                qk_norm,
                attn_norm: norm_w(&format!("{p}input_layernorm.weight"), h)?,
                wq,
                wk,
                wv,
                wo: get(&format!("{p}self_attn.o_proj.weight"), &[h, qd])?,
                ffn_norm: norm_w(&format!("{p}post_attention_layernorm.weight"), h)?,
                w_gate,
                w_up,
                w_down: get(&format!("{p}mlp.down_proj.weight"), &[h, ff])?,
            });
        }
        // HF's tie rule: tied means the embedding is the output matrix, and a stored lm_head.weight is
        // ignored (model::tied_head_warning says when it differs).
        let lm_head = if cfg.tied {
            None
        } else {
            match take("lm_head.weight") {
                Some((s, v)) if s == [cfg.vocab, h] => Some(super::dtypes::as_stored(&v, h, weight_dtype)),
                Some((s, _)) => {
                    return Err(Error::input(format!(
                        "tensor `lm_head.weight` has shape {s:?}, config.json implies {:?}",
                        [cfg.vocab, h]
                    )));
                }
                None => {
                    return Err(Error::input(
                        "the checkpoint has no `lm_head.weight` and config.json does not set tie_word_embeddings",
                    ));
                }
            }
        };
        Ok(Handwritten {
            embed: get("model.embed_tokens.weight", &[cfg.vocab, h])?,
            norm: norm_w("model.norm.weight", h)?,
            lm_head,
            inv_freq: cfg.rope_scaling.as_ref().map(|s| rope_inv_freq(hd, cfg.rope_theta, Some(s))),
            embed_scale: if cfg.has("embed_scale_sqrt_hidden") { (h as f64).sqrt() as f32 as f64 } else { 1.0 },
            layers,
            k_cache: vec![Vec::new(); cfg.n_layers],
            v_cache: vec![Vec::new(); cfg.n_layers],
            len: 0,
            mutations: Mutations::NONE,
            cfg: cfg.clone(),
        })
    }

    /// Turn this reference into a mutant of the forward pass (or back into the true one with
    /// [`Mutations::NONE`]), and forget the cache. Used to name the mistake behind failing logits.
    pub fn set_mutations(&mut self, mutations: Mutations) {
        self.mutations = mutations;
        self.reset();
    }

    /// The mutations in force; empty for the true forward pass.
    pub fn mutations(&self) -> Mutations {
        self.mutations
    }

    /// The resolved config this reference was built from.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    /// Forget the cache.
    pub fn reset(&mut self) {
        self.k_cache.iter_mut().chain(self.v_cache.iter_mut()).for_each(Vec::clear);
        self.len = 0;
    }

    /// Run one token at the next position; return its logits [vocab].
    ///
    /// # Errors
    /// When the token is outside the vocabulary or the cache is full.
    pub fn step(&mut self, token: u32) -> Result<Vec<f64>> {
        let c = &self.cfg;
        if token as usize >= c.vocab {
            return Err(Error::usage(format!("token id {token} is outside the vocabulary ({})", c.vocab)));
        }
        if self.len >= c.max_seq {
            return Err(Error::usage(format!("sequence longer than max_position_embeddings {}", c.max_seq)));
        }
        let pos = self.len;
        let (h, hd, nh, nkv) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads);
        // Every kernel call goes through the dispatchers below, which run the true kernel unless a
        // mutation of it is in force (see `set_mutations`).
        let m = self.mutations;
        let mut x = embedding::core(
            &self.embed,
            h,
            &[token],
            embedding::Faults { off_by_one: m.has(Mutation::EmbeddingOffByOne) },
        );
        if self.embed_scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= self.embed_scale);
        }
        for (l, w) in self.layers.iter().enumerate() {
            let xn = norm(m, &x, &w.attn_norm, c.rms_norm_eps);
            let mut q = lin(m, &xn, &w.wq, 1, h, nh * hd);
            let mut k = lin(m, &xn, &w.wk, 1, h, nkv * hd);
            let mut v = lin(m, &xn, &w.wv, 1, h, nkv * hd);
            if let Some([bq, bk, bv]) = &w.bias {
                add_bias(&mut q, bq);
                add_bias(&mut k, bk);
                add_bias(&mut v, bv);
            }
            if let Some([qn, kn]) = &w.qk_norm {
                q = norm(m, &q, qn, c.rms_norm_eps);
                k = norm(m, &k, kn, c.rms_norm_eps);
            }
            if let Some(f) = &self.inv_freq {
                // Scaled frequencies, with the RoPE kernel's faults as its core has them.
                let adjacent = m.has(Mutation::RopeAdjacent);
                let default;
                let f = if m.has(Mutation::RopeThetaDefault) {
                    default = rope_inv_freq(hd, super::kernels::rope::DEFAULT_THETA, c.rope_scaling.as_ref());
                    &default
                } else {
                    f
                };
                rope_pairs_with_freqs(&mut q, pos, nh, hd, f, adjacent);
                rope_pairs_with_freqs(&mut k, pos, nkv, hd, f, adjacent);
                // YaRN's attention factor multiplies cos and sin (1 for the other scalings).
                let af = c.rope_scaling.as_ref().map_or(1.0, |s| s.attention_factor);
                q.iter_mut().chain(k.iter_mut()).for_each(|x| *x *= af);
            } else {
                rot(m, &mut q, pos, nh, hd, c.rope_theta);
                rot(m, &mut k, pos, nkv, hd, c.rope_theta);
            }
            if m.has(Mutation::KvPositionOffByOne) {
                // Row pos - 1 (0 at pos 0) gets this token's K/V; row pos stays unwritten (zero).
                let (width, row) = (nkv * hd, pos.saturating_sub(1) * nkv * hd);
                for (cache, new) in [(&mut self.k_cache[l], &k), (&mut self.v_cache[l], &v)] {
                    cache.resize((pos + 1) * width, 0.0);
                    cache[row..row + width].copy_from_slice(new);
                }
            } else {
                self.k_cache[l].extend_from_slice(&k);
                self.v_cache[l].extend_from_slice(&v);
            }
            // Sliding window: the query at pos sees positions max(0, pos - window + 1)..=pos only.
            let start = if c.sliding_window > 0 { (pos + 1).saturating_sub(c.sliding_window) } else { 0 };
            let shape = AttnShape { n_q: 1, kv_len: pos + 1 - start, n_heads: nh, n_kv_heads: nkv, head_dim: hd };
            let from = start * nkv * hd;
            let a = attend(m, &q, &self.k_cache[l][from..], &self.v_cache[l][from..], shape);
            let o = lin(m, &a, &w.wo, 1, nh * hd, h);
            x.iter_mut().zip(&o).for_each(|(xi, oi)| *xi += oi);
            let xn = norm(m, &x, &w.ffn_norm, c.rms_norm_eps);
            let g = lin(m, &xn, &w.w_gate, 1, h, c.intermediate);
            let u = lin(m, &xn, &w.w_up, 1, h, c.intermediate);
            let act = if c.has("gelu_tanh_mlp") {
                let f = super::kernels::gelu_tanh_and_mul::Faults { erf: m.has(Mutation::GeluErf) };
                super::kernels::gelu_tanh_and_mul::core(&g, &u, f)
            } else {
                silu_and_mul::core(&g, &u, silu_and_mul::Faults { swapped: m.has(Mutation::SiluSwapped) })
            };
            let d = lin(m, &act, &w.w_down, 1, c.intermediate, h);
            x.iter_mut().zip(&d).for_each(|(xi, di)| *xi += di);
        }
        let xn = norm(m, &x, &self.norm, c.rms_norm_eps);
        self.len += 1;
        Ok(lin(m, &xn, self.lm_head.as_ref().unwrap_or(&self.embed), 1, h, c.vocab))
    }
}

/// RMSNorm, with the mutations of it in force.
fn norm(m: Mutations, x: &[f64], weight: &[f64], eps: f64) -> Vec<f64> {
    let f = rms_norm::Faults {
        eps_outside: m.has(Mutation::RmsNormEpsOutside),
        no_weight: m.has(Mutation::RmsNormNoWeight),
    };
    rms_norm::core(x, weight, eps, f)
}

/// `x W^T`, or `x W` under [`Mutation::LinearXw`].
fn lin(m: Mutations, x: &[f64], w: &[f64], rows: usize, k: usize, n: usize) -> Vec<f64> {
    linear::core(x, w, rows, k, n, linear::Faults { xw: m.has(Mutation::LinearXw) })
}

/// RoPE of one token at `pos`, with the mutations of it in force.
fn rot(m: Mutations, x: &mut [f64], pos: usize, heads: usize, head_dim: usize, theta: f64) {
    let f = rope::Faults { adjacent: m.has(Mutation::RopeAdjacent), theta_default: m.has(Mutation::RopeThetaDefault) };
    rope::core(x, &[pos], heads, head_dim, theta, f);
}

/// Attention, with the mutations of it in force (a missing mask has no effect on one query at the
/// last position, so it is not a model-level mutation).
fn attend(m: Mutations, q: &[f64], k: &[f64], v: &[f64], s: AttnShape) -> Vec<f64> {
    let f = attention::Faults {
        gqa_modulo: m.has(Mutation::GqaModulo),
        no_mask: false,
        no_scale: m.has(Mutation::AttentionNoScale),
        softmax_no_max: false,
    };
    attention::core(q, k, v, s, f)
}

/// The reference model with its f64 KV cache: the interpreter of the family contract's
/// `[model.graph]` ([`GraphReference`], what the gates run), or the hand-written forward pass of the
/// closed `features` (configs without a family contract at hand, and the yardstick the interpreter
/// is held to). Both give the same logits bit for bit on every family (tests/it/graph.rs).
pub struct Reference(Inner);

enum Inner {
    Graph(Box<GraphReference>),
    Handwritten(Box<Handwritten>),
}

impl Reference {
    /// The hand-written forward pass, from a resolved config and the checkpoint's tensors, checking
    /// every shape.
    ///
    /// # Errors
    /// [`base::error::ErrorKind::Input`] naming a missing tensor or a shape that disagrees with config.json.
    pub fn new(cfg: &ResolvedConfig, tensors: &Tensors) -> Result<Reference> {
        Ok(Reference(Inner::Handwritten(Box::new(Handwritten::new(cfg, tensors)?))))
    }

    /// As [`Reference::new`], on the weights an engine storing its 2-D tensors (embeddings,
    /// projections, lm_head) in `weight_dtype` computes with: bf16/f16 rounded to nearest even, or
    /// int8 quantised per row and dequantised (contracts kernel.linear_bf16, kernel.linear_f16,
    /// kernel.linear_int8). 1-D tensors (norm weights, biases) stay as stored. `f32`: as stored.
    ///
    /// # Errors
    /// As [`Reference::new`]; Usage for a dtype outside [`ckb::WEIGHT_DTYPES`].
    pub fn with_weight_dtype(cfg: &ResolvedConfig, tensors: &Tensors, weight_dtype: &str) -> Result<Reference> {
        Ok(Reference(Inner::Handwritten(Box::new(Handwritten::with_weight_dtype(cfg, tensors, weight_dtype)?))))
    }

    /// As [`Reference::with_weight_dtype`], consuming the tensors (each freed once widened).
    ///
    /// # Errors
    /// As [`Reference::with_weight_dtype`].
    pub fn from_tensors(cfg: &ResolvedConfig, tensors: Tensors, weight_dtype: &str) -> Result<Reference> {
        Ok(Reference(Inner::Handwritten(Box::new(Handwritten::from_tensors(cfg, tensors, weight_dtype)?))))
    }

    /// The interpreter of `family`'s graph (consuming the tensors), or the hand-written forward
    /// pass when the family states no graph.
    ///
    /// # Errors
    /// As [`GraphReference::from_tensors`].
    pub fn of_family(
        family: &ModelFamily,
        cfg: &ResolvedConfig,
        tensors: Tensors,
        weight_dtype: &str,
    ) -> Result<Reference> {
        if family.graph.is_none() {
            return Reference::from_tensors(cfg, tensors, weight_dtype);
        }
        Ok(Reference(Inner::Graph(Box::new(GraphReference::from_tensors(family, cfg, tensors, weight_dtype)?))))
    }

    /// Whether this reference interprets the family's graph (and so can trace).
    pub fn is_graph(&self) -> bool {
        matches!(self.0, Inner::Graph(_))
    }

    /// Round every activation (each graph node's output, the KV cache with them) to f32 as an engine
    /// computing in f32 holds it (true), or compute in f64 (false, the reference); forget the cache.
    /// The difference between the two is the rounding error this checkpoint's activations cause in
    /// f32, which scales the logits tolerance where a family states a
    /// [`ckb::RoundingMargin`]. Ok(false) for the hand-written reference (no graph).
    pub fn set_f32_activations(&mut self, on: bool) -> bool {
        match &mut self.0 {
            Inner::Graph(r) => {
                r.set_f32_activations(on);
                true
            }
            Inner::Handwritten(_) => false,
        }
    }

    /// The logits of `tokens` fed one after another from position 0 (teacher-forced), one row per
    /// token; the reference is reset first and after.
    ///
    /// # Errors
    /// As [`Reference::step`].
    pub fn forced(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f64>>> {
        self.reset();
        let rows = tokens.iter().map(|&t| self.step(t)).collect::<Result<Vec<_>>>();
        self.reset();
        rows
    }

    /// Turn this reference into a mutant of the forward pass (or back into the true one with
    /// [`Mutations::NONE`]), and forget the cache. Used to name the mistake behind failing logits.
    pub fn set_mutations(&mut self, mutations: Mutations) {
        match &mut self.0 {
            Inner::Graph(r) => r.set_mutations(mutations),
            Inner::Handwritten(r) => r.set_mutations(mutations),
        }
    }

    /// Apply a graph rewrite (a model-level mutant) or restore the graph with None; see
    /// [`GraphReference::set_rewrite`]. Ok(false) when it does not apply: a node it names is not in
    /// the graph, or this reference is the hand-written one (no graph).
    ///
    /// # Errors
    /// As [`GraphReference::set_rewrite`].
    pub fn set_rewrite(&mut self, rewrite: Option<&ckb::GraphRewrite>) -> Result<bool> {
        match &mut self.0 {
            Inner::Graph(r) => r.set_rewrite(rewrite),
            Inner::Handwritten(_) => Ok(false),
        }
    }

    /// Whether the forward pass runs `op` (a [`ckb::GRAPH_OPS`] name): the graph's nodes, or
    /// for the hand-written Llama pass its fixed ops (no GeGLU, no soft-cap, no scale).
    pub fn has_op(&self, op: &str) -> bool {
        match &self.0 {
            Inner::Graph(r) => r.has_op(op),
            Inner::Handwritten(_) => {
                matches!(op, "embedding" | "rms_norm" | "linear" | "rope" | "attention" | "silu_and_mul" | "add")
            }
        }
    }

    /// Whether some router of the forward pass (a graph's `moe_route` node) renormalises its kept
    /// weights (`renormalize` true) or keeps them as the softmax gives them (false).
    pub fn has_router(&self, renormalize: bool) -> bool {
        match &self.0 {
            Inner::Graph(r) => r.has_router(renormalize),
            Inner::Handwritten(_) => false,
        }
    }

    /// Whether the forward pass rotates only part of each head (a graph's partial rotary node).
    pub fn has_partial_rotary(&self) -> bool {
        match &self.0 {
            Inner::Graph(r) => r.has_partial_rotary(),
            Inner::Handwritten(_) => false,
        }
    }

    /// The mutations in force; empty for the true forward pass.
    pub fn mutations(&self) -> Mutations {
        match &self.0 {
            Inner::Graph(r) => r.mutations(),
            Inner::Handwritten(r) => r.mutations(),
        }
    }

    /// The resolved config this reference was built from.
    pub fn config(&self) -> &ResolvedConfig {
        match &self.0 {
            Inner::Graph(r) => r.config(),
            Inner::Handwritten(r) => r.config(),
        }
    }

    /// Positions in the cache.
    pub fn position(&self) -> usize {
        match &self.0 {
            Inner::Graph(r) => r.position(),
            Inner::Handwritten(r) => r.len,
        }
    }

    /// Forget the cache.
    pub fn reset(&mut self) {
        match &mut self.0 {
            Inner::Graph(r) => r.reset(),
            Inner::Handwritten(r) => r.reset(),
        }
    }

    /// Run one token at the next position; return its logits [vocab].
    ///
    /// # Errors
    /// When the token is outside the vocabulary or the cache is full.
    pub fn step(&mut self, token: u32) -> Result<Vec<f64>> {
        match &mut self.0 {
            Inner::Graph(r) => r.step(token),
            Inner::Handwritten(r) => r.step(token),
        }
    }

    /// As [`Reference::step`], with every graph node's output by trace name
    /// ([`GraphReference::step_traced`]).
    ///
    /// # Errors
    /// As [`Reference::step`]; Usage when this reference was built without a graph.
    pub fn step_traced(&mut self, token: u32) -> Result<(Vec<f64>, Trace)> {
        match &mut self.0 {
            Inner::Graph(r) => r.step_traced(token),
            Inner::Handwritten(_) => {
                Err(Error::usage("this reference was built without the family's graph (Reference::of_family traces)"))
            }
        }
    }

    /// Greedy generation: feed `prompt`, then `max_new` argmax tokens (stopping at max_seq).
    /// Returns the logits after the last prompt token and after each generated token but the last,
    /// one row per generated token, and the generated ids: `logits[i]` chose `tokens[i]`.
    ///
    /// # Errors
    /// As [`Reference::step`]; an empty prompt; Input when a logit row the choice is made from holds
    /// NaN or an infinity (the reference proves nothing then: weights beyond the dtype's range).
    pub fn greedy(&mut self, prompt: &[u32], max_new: usize) -> Result<(Vec<Vec<f64>>, Vec<u32>)> {
        self.greedy_until(prompt, max_new, &[])
    }

    /// As [`Reference::greedy`], ending after the first generated token in `stop` (kept, as HF
    /// generate keeps the EOS token; contract component.sampler).
    ///
    /// # Errors
    /// As [`Reference::greedy`].
    pub fn greedy_until(&mut self, prompt: &[u32], max_new: usize, stop: &[u32]) -> Result<(Vec<Vec<f64>>, Vec<u32>)> {
        if prompt.is_empty() {
            return Err(Error::usage("the prompt encodes to no tokens"));
        }
        self.reset();
        let mut logits = Vec::new();
        for &t in prompt {
            logits = self.step(t)?;
        }
        let mut rows = Vec::new();
        let mut tokens = Vec::new();
        for i in 0..max_new {
            if let Some(at) = non_finite(&logits) {
                return Err(Error::input(format!(
                    "the reference computes a non-finite logit ({} at token {at}) at generation step {i} (position {}): its weights or activations overflow at this dtype, so no engine can be checked against it; check the checkpoint's weights for NaN/inf or values beyond the weight dtype's range, or choose a wider dtype",
                    logits[at],
                    self.position().saturating_sub(1)
                )));
            }
            let next = argmax(&logits) as u32;
            rows.push(logits);
            tokens.push(next);
            if stop.contains(&next) || i + 1 == max_new || self.position() >= self.config().max_seq {
                break;
            }
            logits = self.step(next)?;
        }
        Ok((rows, tokens))
    }

    /// Whether `got`, an engine's greedy tokens after `prompt` (the first chosen after the
    /// prefill), are greedy choices of this reference: each the argmax after the prompt and the
    /// engine's own earlier tokens, or a token whose logit is within `tie` of the argmax's (a
    /// near-tie may go either way, and the run is judged on from the engine's choice). An empty
    /// `got`, or one that runs past the context (max_seq), is not.
    ///
    /// # Errors
    /// As [`Reference::step`]; Input when a row the judgement reads holds NaN or an infinity.
    pub fn greedy_agrees(&mut self, prompt: &[u32], got: &[u32], tie: f64) -> Result<bool> {
        if got.is_empty() || prompt.is_empty() || prompt.len() + got.len() - 1 > self.config().max_seq {
            return Ok(false);
        }
        self.reset();
        let mut logits = Vec::new();
        for &t in prompt {
            logits = self.step(t)?;
        }
        for (i, &g) in got.iter().enumerate() {
            if let Some(at) = non_finite(&logits) {
                return Err(Error::input(format!(
                    "the reference computes a non-finite logit ({} at token {at}) at step {i} of the engine's run: its weights or activations overflow at this dtype, so no engine can be checked against it",
                    logits[at]
                )));
            }
            let best = argmax(&logits);
            let theirs = logits.get(g as usize).copied().unwrap_or(f64::NEG_INFINITY);
            if g as usize != best && logits[best] - theirs > tie {
                return Ok(false);
            }
            if i + 1 < got.len() {
                logits = self.step(g)?;
            }
        }
        Ok(true)
    }
}

/// The index of the first NaN or infinity in a logits row, if any.
fn non_finite(logits: &[f64]) -> Option<usize> {
    logits.iter().position(|v| !v.is_finite())
}
