//! Phases 3 and 4, the decoder (contract `model.llama` and the families that refine it: `model.mistral`,
//! `model.qwen2`, `model.qwen3`, `model.gemma`, Phi-3, OLMo-2, Granite, Gemma 2 and 3, Cohere,
//! StableLM, StarCoder2, OLMo, the mixture-of-experts `model.qwen3_moe` and `model.mixtral`, and
//! GPT-OSS with its attention sinks and clamped fused experts) with its KV cache
//! (`component.kv_cache`).
//! One token at a time: `forward` is the contracts' `math` line by line, calling the kernels;
//! `prefill` runs `forward` over the prompt. Weights, activations and the cache are f32.
//! `run_batch` is the batched step of `batch::step` (component.batched_step): the same layer
//! computations on the rows of several sequences at once over a paged KV cache, the
//! mixture-of-experts MLP grouped by expert.

use std::path::Path;

use crate::batch::{PagedKvCache, SeqChunk};
use crate::config::{Config, ExpertLayout, Moe};
use crate::kernels;
use crate::weights::{self, Tensors};

/// One norm's parameters: an RMSNorm's gain, or a LayerNorm's gain and bias (`layer_norm`), each
/// [dim] or empty where the family has none (OLMo's non-parametric LayerNorm has neither).
struct Norm {
    gain: Vec<f32>,
    bias: Vec<f32>,
}

/// One decoder layer's weights ([out_features, in_features] matrices) and its KV cache.
struct Layer {
    /// input_layernorm; `None` in families with `no_pre_norms` (OLMo-2).
    attn_norm: Option<Norm>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    /// q, k and v projection biases (`qkv_bias`).
    qkv_bias: Option<[Vec<f32>; 3]>,
    /// RMSNorm gains of every query and key head (`qk_norm`), [head_dim] each; or of the whole query
    /// and key projections (`qk_norm_whole`), [n_heads * head_dim] and [n_kv_heads * head_dim].
    qk_norm: Option<[Vec<f32>; 2]>,
    /// GPT-OSS (`attention_sinks`): each query head's sink logit, [n_heads].
    sinks: Option<Vec<f32>>,
    wo: Vec<f32>,
    /// o_proj's bias (`o_bias`: StarCoder2, GPT-OSS).
    o_bias: Option<Vec<f32>>,
    /// The MLP's pre-norm: post_attention_layernorm, or pre_feedforward_layernorm in families with
    /// `post_norms`; `None` with `no_pre_norms` or `parallel_block` (the MLP reads attn_norm's output).
    ffn_norm: Option<Norm>,
    /// RMSNorm gains of the attention and MLP outputs (`post_norms`): post_attention_layernorm and
    /// post_feedforward_layernorm.
    post_norms: Option<[Vec<f32>; 2]>,
    /// gate_proj, or c_fc in families with `fc_mlp` (then `w_up` is empty).
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    /// down_proj, or c_proj with `fc_mlp`.
    w_down: Vec<f32>,
    /// c_fc's and c_proj's biases (`fc_mlp`), [intermediate] and [hidden].
    fc_bias: Option<[Vec<f32>; 2]>,
    /// The mixture-of-experts MLP (Qwen3-MoE, Mixtral, GPT-OSS), for the dense w_gate, w_up and
    /// w_down (then empty).
    experts: Option<Experts>,
    /// Keys after RoPE and values of positions 0..len, [len, n_kv_heads, head_dim] each.
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
}

/// A mixture-of-experts MLP's weights (contracts `model.qwen3_moe`, `model.mixtral`; GPT-OSS): the
/// router and every expert's projections, stacked by expert at load (kernel.moe_experts' layout), or
/// as GPT-OSS stores them fused (kernel.moe_experts_clamped's).
struct Experts {
    /// The router, [n_experts, hidden]: `{module}.gate.weight` (GPT-OSS `{module}.router.weight`).
    router: Vec<f32>,
    /// GPT-OSS: the router's bias [n_experts]; empty otherwise.
    router_bias: Vec<f32>,
    /// Every expert's gate and up projections, [n_experts, inter, hidden]. GPT-OSS: `gate` is
    /// gate_up_proj [n_experts, hidden, 2 * inter] (input-major, gate and up interleaved) and `up`
    /// is empty.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Every expert's down projection, [n_experts, hidden, inter]; GPT-OSS: down_proj [n_experts,
    /// inter, hidden] (input-major).
    down: Vec<f32>,
    /// GPT-OSS: gate_up_proj_bias [n_experts, 2 * inter] and down_proj_bias [n_experts, hidden];
    /// empty otherwise.
    gate_up_bias: Vec<f32>,
    down_bias: Vec<f32>,
}

/// Activations of the token being run, allocated once at load.
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    heads: Vec<f32>,
    attn: Vec<f32>,
    out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    /// Router logits and routing weights [n_experts] (mixture of experts; empty otherwise).
    router: Vec<f32>,
    route: Vec<f32>,
    logits: Vec<f32>,
}

/// A loaded Llama-family model with its KV cache.
pub struct Model {
    cfg: Config,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    final_norm: Norm,
    /// [vocab, hidden]; `None`: the embedding matrix is the output projection (tied).
    lm_head: Option<Vec<f32>>,
    /// RoPE frequencies [rotary_dim / 2], scaled as config.json says (of the full-attention layers
    /// where the layer types differ).
    rope_freqs: Vec<f64>,
    /// Gemma 3: the sliding-window layers' RoPE frequencies (their own base).
    sliding_rope_freqs: Option<Vec<f64>>,
    s: Scratch,
    /// The expert groups of the last batched step ([`Model::expert_groups`]).
    expert_groups: Vec<Vec<(usize, usize)>>,
}

impl Model {
    /// Load `config.json` and the weights (`model.safetensors` or its shards) from an HF model directory. Errors name the missing file/tensor.
    pub fn load(dir: &Path) -> Result<Model, String> {
        let cfg = Config::load(dir)?;
        let mut w = weights::read(dir)?;
        let (h, v) = (cfg.hidden, cfg.vocab);
        let layers = (0..cfg.n_layers).map(|i| load_layer(&mut w, &cfg, i)).collect::<Result<Vec<_>, _>>()?;
        let embed = w.take("model.embed_tokens.weight", &[v, h])?;
        let final_norm = norm_of(&mut w, &cfg, "model.norm", h)?;
        // HF ties when the config says so; an untied checkpoint without lm_head also uses the embedding.
        let lm_head =
            if !cfg.tied && w.has("lm_head.weight") { Some(w.take("lm_head.weight", &[v, h])?) } else { None };
        let (q_dim, kv_dim) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        let s = Scratch {
            x: vec![0.0; h],
            normed: vec![0.0; h],
            q: vec![0.0; q_dim],
            k: vec![0.0; kv_dim],
            v: vec![0.0; kv_dim],
            heads: vec![0.0; q_dim],
            attn: vec![0.0; q_dim],
            out: vec![0.0; h],
            gate: vec![0.0; cfg.intermediate],
            up: vec![0.0; cfg.intermediate],
            act: vec![0.0; cfg.intermediate],
            router: vec![0.0; cfg.moe.as_ref().map_or(0, |m| m.n_experts)],
            route: vec![0.0; cfg.moe.as_ref().map_or(0, |m| m.n_experts)],
            logits: vec![0.0; v],
        };
        let sliding_rope_freqs = cfg.sliding_rope_theta.map(|theta| kernels::rope_freqs(theta, cfg.rotary_dim));
        Ok(Model {
            rope_freqs: cfg.rope_freqs(),
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            sliding_rope_freqs,
            s,
            expert_groups: Vec::new(),
        })
    }

    /// Vocabulary size (length of the logits vector).
    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    /// Maximum sequence length the KV cache holds (config max_position_embeddings).
    pub fn max_seq_len(&self) -> usize {
        self.cfg.max_seq
    }

    /// Forget all cached positions.
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            l.k_cache.clear();
            l.v_cache.clear();
        }
    }

    /// Run tokens at positions start_pos..start_pos+tokens.len(), writing their K/V into the cache;
    /// return the logits [vocab] of the last token.
    pub fn prefill(&mut self, tokens: &[u32], start_pos: usize) -> &[f32] {
        assert!(!tokens.is_empty(), "prefill: no tokens");
        for (i, &token) in tokens.iter().enumerate() {
            self.forward(token, start_pos + i);
        }
        &self.s.logits
    }

    /// Run one token at position `pos` (cache holds 0..pos), write its K/V at `pos`; return logits [vocab].
    pub fn forward(&mut self, token: u32, pos: usize) -> &[f32] {
        self.forward_traced(token, pos, &mut |_, _, _| {})
    }

    /// As `forward`, also calling `trace(layer, point, values)` for each activation point it computes,
    /// in order: `point` a node name of this contract's [model.graph] (`layer` None in the prologue and
    /// epilogue, Some(i) in decoder layer i), `values` that node's output for this token, f32, flattened.
    /// Report at least the graph's `trace_required` points; a step fused away may be left out.
    #[allow(clippy::type_complexity)]
    pub fn forward_traced(
        &mut self,
        token: u32,
        pos: usize,
        trace: &mut dyn FnMut(Option<usize>, &str, &[f32]),
    ) -> &[f32] {
        let Model { cfg: c, embed, layers, final_norm, lm_head, rope_freqs, sliding_rope_freqs, s, .. } = self;
        assert!(pos < c.max_seq, "forward: position {pos} is beyond max_position_embeddings {}", c.max_seq);
        assert!((token as usize) < c.vocab, "forward: token {token} is outside the vocabulary ({})", c.vocab);
        let (h, inter, eps) = (c.hidden, c.intermediate, c.rms_norm_eps);
        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        kernels::embedding(embed, h, &[token], &mut s.x);
        trace(None, "embed", &s.x);
        if c.features.embed_scale_sqrt_hidden {
            let scale = (h as f32).sqrt();
            s.x.iter_mut().for_each(|x| *x *= scale);
        }
        if let Some(m) = c.embedding_multiplier {
            s.x.iter_mut().for_each(|x| *x *= m);
        }
        if c.features.embed_scale_sqrt_hidden || c.embedding_multiplier.is_some() {
            trace(None, "embed_scale", &s.x);
        }
        for (i, l) in layers.iter_mut().enumerate() {
            let at = Some(i);
            // Attention block: x += o_proj(attention(rope(q), cache(rope(k), v))).
            let input = pre_norm(c, &s.x, l.attn_norm.as_ref(), &mut s.normed);
            if l.attn_norm.is_some() {
                trace(at, "attn_norm", input);
            }
            kernels::linear(input, &l.wq, 1, h, q_dim, &mut s.q);
            kernels::linear(input, &l.wk, 1, h, kv_dim, &mut s.k);
            kernels::linear(input, &l.wv, 1, h, kv_dim, &mut s.v);
            if let Some([bq, bk, bv]) = &l.qkv_bias {
                add(&mut s.q, bq);
                add(&mut s.k, bk);
                add(&mut s.v, bv);
            }
            trace(at, "q", &s.q);
            trace(at, "k", &s.k);
            trace(at, "v", &s.v);
            if let Some(limit) = c.clip_qkv {
                // OLMo: q, k and v clamped to [-clip_qkv, clip_qkv].
                for (x, name) in [(&mut s.q, "q_clip"), (&mut s.k, "k_clip"), (&mut s.v, "v_clip")] {
                    x.iter_mut().for_each(|v| *v = v.clamp(-limit, limit));
                    trace(at, name, x);
                }
            }
            if let Some([q_norm, k_norm]) = &l.qk_norm {
                norm_heads(&mut s.q, q_norm, eps, &mut s.heads);
                norm_heads(&mut s.k, k_norm, eps, &mut s.heads);
                trace(at, "q_norm", &s.q);
                trace(at, "k_norm", &s.k);
            }
            let rope_freqs = match sliding_rope_freqs {
                Some(local) if c.sliding(i) => &local[..],
                _ => &rope_freqs[..],
            };
            rotate(c, &mut s.q, pos, c.n_heads, rope_freqs);
            rotate(c, &mut s.k, pos, c.n_kv_heads, rope_freqs);
            trace(at, "q_rope", &s.q);
            trace(at, "k_rope", &s.k);
            store(&mut l.k_cache, pos, &s.k);
            store(&mut l.v_cache, pos, &s.v);
            let window = c.window(i);
            let first = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
            let (keys, values) = (&l.k_cache[first * kv_dim..], &l.v_cache[first * kv_dim..]);
            let kv_len = pos + 1 - first;
            let (n_heads, n_kv_heads, head_dim) = (c.n_heads, c.n_kv_heads, c.head_dim);
            match (&l.sinks, c.attention_scale, c.attn_softcap) {
                // GPT-OSS: each head's sink logit joins its softmax (scale 1/sqrt(head_dim); the
                // family has neither a scale nor a soft-cap).
                (Some(sinks), _, _) => kernels::attention_sinks(
                    &s.q,
                    keys,
                    values,
                    sinks,
                    1,
                    kv_len,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    &mut s.attn,
                ),
                // The kernel contract's attention (scale 1/sqrt(head_dim), no soft-cap).
                (None, None, None) => {
                    kernels::attention(&s.q, keys, values, 1, kv_len, n_heads, n_kv_heads, head_dim, &mut s.attn)
                }
                (None, scale, cap) => kernels::attention_with(
                    &s.q,
                    keys,
                    values,
                    1,
                    kv_len,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    scale.unwrap_or_else(|| 1.0 / (head_dim as f32).sqrt()),
                    cap,
                    &mut s.attn,
                ),
            }
            trace(at, "attn", &s.attn);
            kernels::linear(&s.attn, &l.wo, 1, q_dim, h, &mut s.out);
            if let Some(b) = &l.o_bias {
                add(&mut s.out, b);
            }
            trace(at, "o", &s.out);
            let [post_attn, post_ffn] =
                l.post_norms.as_ref().map(|[a, f]| [Some(&a[..]), Some(&f[..])]).unwrap_or_default();
            let names = ["o_norm", "o_scaled", "attn_residual"];
            let mut point = |name: &str, v: &[f32]| trace(at, name, v);
            residual(&mut s.x, &mut s.out, post_attn, c.residual_multiplier, eps, &mut s.normed, names, &mut point);
            // MLP block: x += down_proj(act(gate_proj(x)) * up_proj(x)). In the parallel block
            // (Cohere) it reads attention's normed input, still in s.normed.
            let input = if c.features.parallel_block {
                &s.normed[..]
            } else {
                pre_norm(c, &s.x, l.ffn_norm.as_ref(), &mut s.normed)
            };
            if l.ffn_norm.is_some() {
                trace(at, "mlp_norm", input);
            }
            if let (Some(moe), Some(m)) = (&l.experts, &c.moe) {
                // Qwen3-MoE, Mixtral, GPT-OSS: router logits (GPT-OSS: plus the router's bias; the
                // others' is empty and adds nothing), the top-k routing weights, and the weighted sum
                // of the selected experts (only they are read). GPT-OSS softmaxes the kept logits
                // only: the same weights as the softmax over all of them renormalised over the kept
                // (moe_route with `renormalize`).
                kernels::linear(input, &moe.router, 1, h, m.n_experts, &mut s.router);
                add(&mut s.router, &moe.router_bias);
                trace(at, "router", &s.router);
                kernels::moe_route(&s.router, m.top_k, m.renormalize, &mut s.route);
                trace(at, "route", &s.route);
                match m.layout {
                    ExpertLayout::Split { .. } => {
                        kernels::moe_experts(input, &s.route, &moe.gate, &moe.up, &moe.down, m.inter, &mut s.out)
                    }
                    ExpertLayout::Fused { alpha, limit } => kernels::moe_experts_clamped(
                        input,
                        &s.route,
                        &moe.gate,
                        &moe.gate_up_bias,
                        &moe.down,
                        &moe.down_bias,
                        m.inter,
                        alpha,
                        limit,
                        &mut s.out,
                    ),
                }
                trace(at, "experts", &s.out);
            } else if let Some([b_fc, b_proj]) = &l.fc_bias {
                // StarCoder2: c_proj(gelu_tanh(c_fc(x) + b_fc)) + b_proj, not gated.
                kernels::linear(input, &l.w_gate, 1, h, inter, &mut s.gate);
                add(&mut s.gate, b_fc);
                trace(at, "fc", &s.gate);
                kernels::gelu_tanh(&s.gate, &mut s.act);
                trace(at, "act", &s.act);
                kernels::linear(&s.act, &l.w_down, 1, inter, h, &mut s.out);
                add(&mut s.out, b_proj);
                trace(at, "proj", &s.out);
            } else {
                kernels::linear(input, &l.w_gate, 1, h, inter, &mut s.gate);
                kernels::linear(input, &l.w_up, 1, h, inter, &mut s.up);
                trace(at, "gate", &s.gate);
                trace(at, "up", &s.up);
                glu(c.features.gelu_tanh_mlp, &s.gate, &s.up, &mut s.act);
                trace(at, "act", &s.act);
                kernels::linear(&s.act, &l.w_down, 1, inter, h, &mut s.out);
                trace(at, "down", &s.out);
            }
            let names = ["down_norm", "down_scaled", "mlp_residual"];
            let mut point = |name: &str, v: &[f32]| trace(at, name, v);
            residual(&mut s.x, &mut s.out, post_ffn, c.residual_multiplier, eps, &mut s.normed, names, &mut point);
        }
        apply_norm(c, &s.x, final_norm, &mut s.normed);
        trace(None, "final_norm", &s.normed);
        kernels::linear(&s.normed, lm_head.as_deref().unwrap_or(embed), 1, h, c.vocab, &mut s.logits);
        if c.logits_scaling.is_some() || c.final_softcap.is_some() || c.logit_scale.is_some() {
            // Granite, Gemma 2 and Cohere name the projection `lm_head` and its scaled or capped
            // output `logits`.
            trace(None, "lm_head", &s.logits);
        }
        if let Some(d) = c.logits_scaling {
            s.logits.iter_mut().for_each(|x| *x /= d);
        }
        if let Some(m) = c.logit_scale {
            s.logits.iter_mut().for_each(|x| *x *= m);
        }
        if let Some(cap) = c.final_softcap {
            s.logits.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        trace(None, "logits", &s.logits);
        &s.logits
    }
}

/// The batched step (component.batched_step), beside the single-token forward.
impl Model {
    /// Decoder layers (each with its K and V in a paged cache).
    pub(crate) fn n_layers(&self) -> usize {
        self.cfg.n_layers
    }

    /// Entries of one position's K (or V) row: n_kv_heads * head_dim.
    pub(crate) fn kv_dim(&self) -> usize {
        self.cfg.n_kv_heads * self.cfg.head_dim
    }

    /// The experts the last batched step ran, per layer: (expert, rows routed to it), in expert
    /// order, one entry per expert that any row of the step selected (empty without experts).
    pub fn expert_groups(&self) -> &[Vec<(usize, usize)>] {
        &self.expert_groups
    }

    /// Every chunk through the model in one pass over the paged cache `cache` (contract
    /// component.batched_step): the rows of all chunks, [rows, hidden], go through each layer
    /// together, row r being token j of chunk c at position start_c + j. Per layer: the attention
    /// input of every row, q, k and v as one product per projection over all rows (biases, clamps,
    /// q/k norms and RoPE per row at its own position, as `forward` does them), each row's K and V
    /// written to its slot through its chunk's block table, paged attention (each row sees its own
    /// sequence's positions up to its own, within the layer's window, with the family's scale,
    /// soft-cap or sinks), o_proj over all rows, the residual; then the MLP: dense, one product per
    /// matrix over all rows; a mixture of experts, every row's routing first, then each selected
    /// expert once over the rows routed to it (`experts_grouped`). The last row of each chunk goes
    /// through the final norm and the output projection. Every value is computed as `forward`
    /// computes it for that token, so each chunk's logits equal the single-sequence forward's.
    /// Returns [chunks.len(), vocab] in chunk order. The model's own KV cache is not touched.
    pub(crate) fn run_batch(&mut self, cache: &mut PagedKvCache, chunks: &[SeqChunk]) -> Vec<f32> {
        let Model { cfg: c, embed, layers, final_norm, lm_head, rope_freqs, sliding_rope_freqs, expert_groups, .. } =
            self;
        let (h, inter, eps, bs) = (c.hidden, c.intermediate, c.rms_norm_eps, cache.block_size);
        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        assert!(
            cache.k.len() == c.n_layers && cache.k[0].len() == cache.num_blocks * bs * kv_dim,
            "step: the cache was made for another model"
        );
        // Rows: every chunk's tokens in chunk order, with their positions and physical slots; the
        // block tables as rows of one [chunks, blocks_per_seq] table (u32::MAX past a table's end).
        let blocks_per_seq = chunks.iter().map(|ch| ch.block_table.len()).max().unwrap_or(0);
        let mut table = vec![u32::MAX; chunks.len() * blocks_per_seq];
        let (mut tokens, mut positions, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let (mut query_start, mut context_lens) = (vec![0u32], Vec::with_capacity(chunks.len()));
        for (i, ch) in chunks.iter().enumerate() {
            let end = ch.start + ch.tokens.len();
            assert!(!ch.tokens.is_empty(), "step: chunk {i} has no tokens");
            assert!(end <= c.max_seq, "step: chunk {i} reaches position {end}, beyond max_position_embeddings");
            assert!(
                ch.block_table.len() >= end.div_ceil(bs),
                "step: chunk {i}'s block table of {} blocks does not cover {end} positions",
                ch.block_table.len()
            );
            table[i * blocks_per_seq..][..ch.block_table.len()].copy_from_slice(ch.block_table);
            for (j, &token) in ch.tokens.iter().enumerate() {
                assert!((token as usize) < c.vocab, "step: token {token} is outside the vocabulary ({})", c.vocab);
                let pos = ch.start + j;
                let block = ch.block_table[pos / bs] as usize;
                assert!(block < cache.num_blocks, "step: chunk {i} names block {block}, beyond the cache");
                tokens.push(token);
                positions.push(pos);
                slots.push(block * bs + pos % bs);
            }
            query_start.push(tokens.len() as u32);
            context_lens.push(end as u32);
        }
        let rows = tokens.len();
        expert_groups.clear();
        if rows == 0 {
            return Vec::new();
        }
        let mut x = vec![0.0f32; rows * h];
        kernels::embedding(embed, h, &tokens, &mut x);
        if c.features.embed_scale_sqrt_hidden {
            let scale = (h as f32).sqrt();
            x.iter_mut().for_each(|x| *x *= scale);
        }
        if let Some(m) = c.embedding_multiplier {
            x.iter_mut().for_each(|x| *x *= m);
        }
        let (mut normed, mut mlp_in) = (vec![0.0f32; rows * h], vec![0.0f32; rows * h]);
        let (mut q, mut attn) = (vec![0.0f32; rows * q_dim], vec![0.0f32; rows * q_dim]);
        let (mut k, mut v) = (vec![0.0f32; rows * kv_dim], vec![0.0f32; rows * kv_dim]);
        let (mut gate, mut up, mut act) =
            (vec![0.0f32; rows * inter], vec![0.0f32; rows * inter], vec![0.0f32; rows * inter]);
        let (mut out, mut tmp, mut heads) = (vec![0.0f32; rows * h], vec![0.0f32; h], Vec::new());
        let shape = kernels::PagedShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size: bs,
            blocks_per_seq,
        };
        let no_trace = &mut |_: &str, _: &[f32]| {};
        for (i, l) in layers.iter().enumerate() {
            // Attention block: x += o_proj(attention(rope(q), paged cache(rope(k), v))).
            for (xr, nr) in x.chunks_exact(h).zip(normed.chunks_exact_mut(h)) {
                match &l.attn_norm {
                    Some(n) => apply_norm(c, xr, n, nr),
                    None => nr.copy_from_slice(xr),
                }
            }
            kernels::linear(&normed, &l.wq, rows, h, q_dim, &mut q);
            kernels::linear(&normed, &l.wk, rows, h, kv_dim, &mut k);
            kernels::linear(&normed, &l.wv, rows, h, kv_dim, &mut v);
            let rope_freqs = match sliding_rope_freqs {
                Some(local) if c.sliding(i) => &local[..],
                _ => &rope_freqs[..],
            };
            let (k_cache, v_cache) = (&mut cache.k[i], &mut cache.v[i]);
            for r in 0..rows {
                let (qr, kr, vr) =
                    (&mut q[r * q_dim..][..q_dim], &mut k[r * kv_dim..][..kv_dim], &mut v[r * kv_dim..][..kv_dim]);
                if let Some([bq, bk, bv]) = &l.qkv_bias {
                    add(qr, bq);
                    add(kr, bk);
                    add(vr, bv);
                }
                if let Some(limit) = c.clip_qkv {
                    for part in [&mut *qr, &mut *kr, &mut *vr] {
                        part.iter_mut().for_each(|v| *v = v.clamp(-limit, limit));
                    }
                }
                if let Some([q_norm, k_norm]) = &l.qk_norm {
                    norm_heads(qr, q_norm, eps, &mut heads);
                    norm_heads(kr, k_norm, eps, &mut heads);
                }
                rotate(c, qr, positions[r], c.n_heads, rope_freqs);
                rotate(c, kr, positions[r], c.n_kv_heads, rope_freqs);
                k_cache[slots[r] * kv_dim..][..kv_dim].copy_from_slice(kr);
                v_cache[slots[r] * kv_dim..][..kv_dim].copy_from_slice(vr);
            }
            // forward's choice of attention: GPT-OSS's sinks with the contract's scale, else the
            // family's scale and soft-cap.
            let default_scale = 1.0 / (c.head_dim as f32).sqrt();
            let scores = match &l.sinks {
                Some(sinks) => kernels::Scores { scale: default_scale, softcap: None, sinks: Some(sinks), window: 0 },
                None => kernels::Scores {
                    scale: c.attention_scale.unwrap_or(default_scale),
                    softcap: c.attn_softcap,
                    sinks: None,
                    window: 0,
                },
            };
            let scores = kernels::Scores { window: c.window(i), ..scores };
            kernels::paged_attention_with(
                &q,
                k_cache,
                v_cache,
                &table,
                &query_start,
                &context_lens,
                &shape,
                &scores,
                &mut attn,
            );
            kernels::linear(&attn, &l.wo, rows, q_dim, h, &mut out);
            let [post_attn, post_ffn] =
                l.post_norms.as_ref().map(|[a, f]| [Some(&a[..]), Some(&f[..])]).unwrap_or_default();
            for (xr, or) in x.chunks_exact_mut(h).zip(out.chunks_exact_mut(h)) {
                if let Some(b) = &l.o_bias {
                    add(or, b);
                }
                residual(xr, or, post_attn, c.residual_multiplier, eps, &mut tmp, [""; 3], no_trace);
            }
            // MLP block on every row; the parallel block (Cohere) reads attention's normed input.
            let input = if c.features.parallel_block {
                &normed[..]
            } else {
                for (xr, mr) in x.chunks_exact(h).zip(mlp_in.chunks_exact_mut(h)) {
                    match &l.ffn_norm {
                        Some(n) => apply_norm(c, xr, n, mr),
                        None => mr.copy_from_slice(xr),
                    }
                }
                &mlp_in[..]
            };
            if let (Some(moe), Some(m)) = (&l.experts, &c.moe) {
                expert_groups.push(experts_grouped(m, moe, input, rows, &mut out));
            } else if let Some([b_fc, b_proj]) = &l.fc_bias {
                kernels::linear(input, &l.w_gate, rows, h, inter, &mut gate);
                gate.chunks_exact_mut(inter).for_each(|g| add(g, b_fc));
                kernels::gelu_tanh(&gate, &mut act);
                kernels::linear(&act, &l.w_down, rows, inter, h, &mut out);
                out.chunks_exact_mut(h).for_each(|o| add(o, b_proj));
            } else {
                kernels::linear(input, &l.w_gate, rows, h, inter, &mut gate);
                kernels::linear(input, &l.w_up, rows, h, inter, &mut up);
                glu(c.features.gelu_tanh_mlp, &gate, &up, &mut act);
                kernels::linear(&act, &l.w_down, rows, inter, h, &mut out);
            }
            for (xr, or) in x.chunks_exact_mut(h).zip(out.chunks_exact_mut(h)) {
                residual(xr, or, post_ffn, c.residual_multiplier, eps, &mut tmp, [""; 3], no_trace);
            }
        }
        // The last row of each chunk: final norm, output projection, the family's logit scaling.
        let n = chunks.len();
        let mut last = vec![0.0f32; n * h];
        for (ch, lr) in last.chunks_exact_mut(h).enumerate() {
            let r = query_start[ch + 1] as usize - 1;
            apply_norm(c, &x[r * h..][..h], final_norm, lr);
        }
        let mut logits = vec![0.0f32; n * c.vocab];
        kernels::linear(&last, lm_head.as_deref().unwrap_or(embed), n, h, c.vocab, &mut logits);
        if let Some(d) = c.logits_scaling {
            logits.iter_mut().for_each(|x| *x /= d);
        }
        if let Some(m) = c.logit_scale {
            logits.iter_mut().for_each(|x| *x *= m);
        }
        if let Some(cap) = c.final_softcap {
            logits.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        logits
    }
}

/// The mixture-of-experts MLP of a batched step, grouped by expert (`model.qwen3_moe`,
/// `model.mixtral`, GPT-OSS). `input`: [rows, hidden]; `out`: [rows, hidden], overwritten.
/// First every row's routing weights (router logits plus the router's bias, kernel.moe_route), then
/// for each expert e that any row selected, in expert order: the inputs of its rows gathered, e run
/// once on all of them (`kernels::expert_swiglu` or `kernels::expert_clamped`: each of its weights
/// read once for the group), and route[r][e] times its output added to row r. Per row these are
/// kernel.moe_experts' (moe_experts_clamped's) terms in the same order, so each row's output is
/// what the single-token forward computes. Returns the groups: (expert, rows routed to it).
fn experts_grouped(m: &Moe, moe: &Experts, input: &[f32], rows: usize, out: &mut [f32]) -> Vec<(usize, usize)> {
    let (h, inter, n) = (input.len() / rows, m.inter, m.n_experts);
    let (mut router, mut route) = (vec![0.0f32; rows * n], vec![0.0f32; rows * n]);
    kernels::linear(input, &moe.router, rows, h, n, &mut router);
    for (logits, weights) in router.chunks_exact_mut(n).zip(route.chunks_exact_mut(n)) {
        add(logits, &moe.router_bias);
        kernels::moe_route(logits, m.top_k, m.renormalize, weights);
    }
    out.fill(0.0);
    let mut groups = Vec::new();
    for e in 0..n {
        let members: Vec<usize> = (0..rows).filter(|&r| route[r * n + e] != 0.0).collect();
        if members.is_empty() {
            continue;
        }
        let g = members.len();
        let mut xs = Vec::with_capacity(g * h);
        for &r in &members {
            xs.extend_from_slice(&input[r * h..][..h]);
        }
        let mut ys = vec![0.0f32; g * h];
        match m.layout {
            ExpertLayout::Split { .. } => {
                let size = inter * h;
                let (gate, up, down) =
                    (&moe.gate[e * size..][..size], &moe.up[e * size..][..size], &moe.down[e * size..][..size]);
                kernels::expert_swiglu(&xs, g, gate, up, down, inter, &mut ys);
            }
            ExpertLayout::Fused { alpha, limit } => {
                let gate_up = &moe.gate[e * h * 2 * inter..][..h * 2 * inter];
                let gate_up_bias = &moe.gate_up_bias[e * 2 * inter..][..2 * inter];
                let (down, down_bias) = (&moe.down[e * inter * h..][..inter * h], &moe.down_bias[e * h..][..h]);
                kernels::expert_clamped(&xs, g, gate_up, gate_up_bias, down, down_bias, inter, alpha, limit, &mut ys);
            }
        }
        for (&r, y) in members.iter().zip(ys.chunks_exact(h)) {
            let weight = route[r * n + e];
            for (o, v) in out[r * h..][..h].iter_mut().zip(y) {
                *o += weight * v;
            }
        }
        groups.push((e, g));
    }
    groups
}

/// Layer `i`'s weights, named and shaped as the family contract's `[[model.weights]]` say.
fn load_layer(w: &mut Tensors, c: &Config, i: usize) -> Result<Layer, String> {
    let name = |n: &str| format!("model.layers.{i}.{n}");
    let (h, inter, hd) = (c.hidden, c.intermediate, c.head_dim);
    let (q_dim, kv_dim) = (c.n_heads * hd, c.n_kv_heads * hd);
    let ([wq, wk, wv], [w_gate, w_up]) = if c.features.fc_mlp {
        // StarCoder2: c_fc and c_proj, not gated (w_up stays empty).
        let wq = w.take(&name("self_attn.q_proj.weight"), &[q_dim, h])?;
        let wk = w.take(&name("self_attn.k_proj.weight"), &[kv_dim, h])?;
        let wv = w.take(&name("self_attn.v_proj.weight"), &[kv_dim, h])?;
        ([wq, wk, wv], [w.take(&name("mlp.c_fc.weight"), &[inter, h])?, Vec::new()])
    } else if c.features.fused {
        // Phi-3: the rows of qkv_proj are q, then k, then v; those of gate_up_proj are gate, then up.
        let qkv = w.take(&name("self_attn.qkv_proj.weight"), &[q_dim + 2 * kv_dim, h])?;
        let gate_up = w.take(&name("mlp.gate_up_proj.weight"), &[2 * inter, h])?;
        (split_rows(&qkv, [q_dim, kv_dim, kv_dim], h), split_rows(&gate_up, [inter, inter], h))
    } else {
        let wq = w.take(&name("self_attn.q_proj.weight"), &[q_dim, h])?;
        let wk = w.take(&name("self_attn.k_proj.weight"), &[kv_dim, h])?;
        let wv = w.take(&name("self_attn.v_proj.weight"), &[kv_dim, h])?;
        if c.moe.is_some() {
            // Mixture of experts: no dense MLP (the experts are read by load_experts).
            ([wq, wk, wv], [Vec::new(), Vec::new()])
        } else {
            let w_gate = w.take(&name("mlp.gate_proj.weight"), &[inter, h])?;
            ([wq, wk, wv], [w_gate, w.take(&name("mlp.up_proj.weight"), &[inter, h])?])
        }
    };
    let qkv_bias = if c.features.qkv_bias {
        let bq = w.take(&name("self_attn.q_proj.bias"), &[q_dim])?;
        let bk = w.take(&name("self_attn.k_proj.bias"), &[kv_dim])?;
        Some([bq, bk, w.take(&name("self_attn.v_proj.bias"), &[kv_dim])?])
    } else {
        None
    };
    let qk_norm_dims = if c.features.qk_norm {
        Some((hd, hd))
    } else if c.features.qk_norm_whole {
        Some((q_dim, kv_dim))
    } else {
        None
    };
    let qk_norm = match qk_norm_dims {
        Some((q, k)) => {
            Some([norm(w, c, &name("self_attn.q_norm.weight"), q)?, norm(w, c, &name("self_attn.k_norm.weight"), k)?])
        }
        None => None,
    };
    let attn_norm = if c.features.no_pre_norms { None } else { Some(norm_of(w, c, &name("input_layernorm"), h)?) };
    let (ffn_norm, post_norms) = if c.features.parallel_block {
        (None, None)
    } else if c.features.post_norms {
        let ffn_norm =
            if c.features.no_pre_norms { None } else { Some(norm_of(w, c, &name("pre_feedforward_layernorm"), h)?) };
        let post_attn = norm(w, c, &name("post_attention_layernorm.weight"), h)?;
        (ffn_norm, Some([post_attn, norm(w, c, &name("post_feedforward_layernorm.weight"), h)?]))
    } else {
        (Some(norm_of(w, c, &name("post_attention_layernorm"), h)?), None)
    };
    let experts = match &c.moe {
        Some(m) => Some(load_experts(w, c, m, i)?),
        None => None,
    };
    let (w_down, fc_bias) = if experts.is_some() {
        (Vec::new(), None)
    } else if c.features.fc_mlp {
        let w_down = w.take(&name("mlp.c_proj.weight"), &[h, inter])?;
        let b_fc = w.take(&name("mlp.c_fc.bias"), &[inter])?;
        (w_down, Some([b_fc, w.take(&name("mlp.c_proj.bias"), &[h])?]))
    } else {
        (w.take(&name("mlp.down_proj.weight"), &[h, inter])?, None)
    };
    let o_bias = if c.features.o_bias { Some(w.take(&name("self_attn.o_proj.bias"), &[h])?) } else { None };
    let sinks = if c.features.attention_sinks { Some(w.take(&name("self_attn.sinks"), &[c.n_heads])?) } else { None };
    Ok(Layer {
        attn_norm,
        wq,
        wk,
        wv,
        qkv_bias,
        qk_norm,
        sinks,
        wo: w.take(&name("self_attn.o_proj.weight"), &[h, q_dim])?,
        o_bias,
        ffn_norm,
        post_norms,
        w_gate,
        w_up,
        w_down,
        fc_bias,
        experts,
        k_cache: Vec::new(),
        v_cache: Vec::new(),
    })
}

/// Layer `i`'s mixture-of-experts MLP (contracts `model.qwen3_moe`, `model.mixtral`,
/// `[[model.weights]]`): the router `model.layers.{i}.{module}.gate.weight` [n_experts, hidden] and
/// each expert e's `model.layers.{i}.{module}.experts.{e}.{gate,up,down}.weight` ([inter, hidden],
/// [inter, hidden], [hidden, inter]; Mixtral's w1, w3, w2), stacked by expert into one gate, one up
/// and one down buffer. GPT-OSS (`ExpertLayout::Fused`): the router `{module}.router.weight`
/// [n_experts, hidden] and `.bias` [n_experts], and the fused `{module}.experts.gate_up_proj`
/// [n_experts, hidden, 2 * inter], `gate_up_proj_bias` [n_experts, 2 * inter], `down_proj`
/// [n_experts, inter, hidden] and `down_proj_bias` [n_experts, hidden] as stored. A missing or
/// mis-shaped tensor is an error that names it.
fn load_experts(w: &mut Tensors, c: &Config, m: &Moe, i: usize) -> Result<Experts, String> {
    let (h, inter, n) = (c.hidden, m.inter, m.n_experts);
    let prefix = format!("model.layers.{i}.{}", m.module);
    let names = match m.layout {
        ExpertLayout::Split { names } => names,
        ExpertLayout::Fused { .. } => {
            let take = |w: &mut Tensors, name: &str, shape: &[usize]| w.take(&format!("{prefix}.{name}"), shape);
            return Ok(Experts {
                router: take(w, "router.weight", &[n, h])?,
                router_bias: take(w, "router.bias", &[n])?,
                gate: take(w, "experts.gate_up_proj", &[n, h, 2 * inter])?,
                up: Vec::new(),
                down: take(w, "experts.down_proj", &[n, inter, h])?,
                gate_up_bias: take(w, "experts.gate_up_proj_bias", &[n, 2 * inter])?,
                down_bias: take(w, "experts.down_proj_bias", &[n, h])?,
            });
        }
    };
    let router = w.take(&format!("{prefix}.gate.weight"), &[n, h])?;
    let [gate_name, up_name, down_name] = names;
    let (mut gate, mut up, mut down) =
        (Vec::with_capacity(n * inter * h), Vec::with_capacity(n * inter * h), Vec::with_capacity(n * h * inter));
    for e in 0..n {
        let expert = |name: &str| format!("{prefix}.experts.{e}.{name}.weight");
        gate.extend(w.take(&expert(gate_name), &[inter, h])?);
        up.extend(w.take(&expert(up_name), &[inter, h])?);
        down.extend(w.take(&expert(down_name), &[h, inter])?);
    }
    Ok(Experts { router, router_bias: Vec::new(), gate, up, down, gate_up_bias: Vec::new(), down_bias: Vec::new() })
}

/// An RMSNorm gain [dim]; stored as an offset from one in families with `rmsnorm_one_plus_w`
/// (Gemma), so 1 is added here, once.
fn norm(w: &mut Tensors, c: &Config, name: &str, dim: usize) -> Result<Vec<f32>, String> {
    let mut gain = w.take(name, &[dim])?;
    if c.features.rmsnorm_one_plus_w {
        gain.iter_mut().for_each(|g| *g += 1.0);
    }
    Ok(gain)
}

/// The norm `prefix` ("model.layers.{i}.input_layernorm", "model.norm"): its gain `prefix.weight`
/// (none in families with `norm_no_gain`) and, in families with `norm_bias`, its bias `prefix.bias`.
fn norm_of(w: &mut Tensors, c: &Config, prefix: &str, dim: usize) -> Result<Norm, String> {
    let gain = if c.features.norm_no_gain { Vec::new() } else { norm(w, c, &format!("{prefix}.weight"), dim)? };
    let bias = if c.features.norm_bias { w.take(&format!("{prefix}.bias"), &[dim])? } else { Vec::new() };
    Ok(Norm { gain, bias })
}

/// `x` [hidden] normed into `out`: a LayerNorm (kernel.layer_norm) in families with `layer_norm`,
/// else an RMSNorm (kernel.rms_norm), with the config's epsilon.
fn apply_norm(c: &Config, x: &[f32], n: &Norm, out: &mut [f32]) {
    if c.features.layer_norm {
        kernels::layer_norm(x, x.len(), &n.gain, &n.bias, c.rms_norm_eps, out);
    } else {
        kernels::rms_norm(x, &n.gain, c.rms_norm_eps, out);
    }
}

/// RoPE of one token's heads `x` [n_heads, head_dim] at `pos` with the layer's frequencies
/// [rotary_dim / 2]: kernel.rope's rotation, or kernel.rotary's where the family rotates only the
/// first rotary_dim entries of each head (StableLM) or interleaved pairs (Cohere). With YaRN
/// (GPT-OSS) cos and sin are both multiplied by its attention factor, that is the rotated entries.
fn rotate(c: &Config, x: &mut [f32], pos: usize, n_heads: usize, freqs: &[f64]) {
    if c.rotary_dim == c.head_dim && !c.features.interleaved_rope {
        kernels::rope_with_freqs(x, &[pos], n_heads, freqs);
    } else {
        kernels::rotary_with_freqs(x, &[pos], n_heads, c.head_dim, freqs, c.features.interleaved_rope);
    }
    let factor = c.rope_attention_factor();
    if factor != 1.0 {
        for head in x.chunks_exact_mut(c.head_dim) {
            head[..c.rotary_dim].iter_mut().for_each(|v| *v *= factor);
        }
    }
}

/// Consecutive row blocks of a row-major matrix with `cols` columns, `rows[j]` rows each.
fn split_rows<const N: usize>(m: &[f32], rows: [usize; N], cols: usize) -> [Vec<f32>; N] {
    let mut start = 0;
    rows.map(|r| {
        start += r;
        m[(start - r) * cols..start * cols].to_vec()
    })
}

/// x += y, elementwise (residual connections, biases).
fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// The input of an attention or MLP block: `x` normed with `norm` into `normed`, or `x` itself
/// in families without pre-norms (`no_pre_norms`).
fn pre_norm<'a>(c: &Config, x: &'a [f32], norm: Option<&Norm>, normed: &'a mut [f32]) -> &'a [f32] {
    match norm {
        Some(n) => {
            apply_norm(c, x, n, normed);
            normed
        }
        None => x,
    }
}

/// The residual add x += out of a block's output `out`, first RMSNormed with `post_norm`
/// (`post_norms`: OLMo-2, Gemma 2), then multiplied by `multiplier` (Granite's residual_multiplier);
/// `tmp` [len of out] holds a copy of out. Each step done is reported to `trace` under `names`
/// (post-norm, scaled, sum).
#[allow(clippy::too_many_arguments)]
fn residual(
    x: &mut [f32],
    out: &mut [f32],
    post_norm: Option<&[f32]>,
    multiplier: Option<f32>,
    eps: f32,
    tmp: &mut [f32],
    names: [&str; 3],
    trace: &mut dyn FnMut(&str, &[f32]),
) {
    if let Some(gain) = post_norm {
        tmp.copy_from_slice(out);
        kernels::rms_norm(tmp, gain, eps, out);
        trace(names[0], out);
    }
    if let Some(m) = multiplier {
        out.iter_mut().for_each(|v| *v *= m);
        trace(names[1], out);
    }
    add(x, out);
    trace(names[2], x);
}

/// RMSNorm of every head of `x` ([n_heads, head_dim]) with the gain `w` [head_dim], in place
/// (`qk_norm`); `tmp` holds a copy of x.
fn norm_heads(x: &mut [f32], w: &[f32], eps: f32, tmp: &mut Vec<f32>) {
    tmp.clear();
    tmp.extend_from_slice(x);
    kernels::rms_norm(tmp, w, eps, x);
}

/// Write one position's row into a cache holding rows 0..pos (component.kv_cache): rows beyond pos
/// are dropped, row pos is written.
fn store(cache: &mut Vec<f32>, pos: usize, row: &[f32]) {
    cache.resize(pos * row.len(), 0.0);
    cache.extend_from_slice(row);
}

/// The gated activation of the MLP, act = f(gate) * up: SwiGLU (kernel.silu_and_mul), or GeGLU
/// with the tanh GELU (kernel.gelu_tanh_and_mul) in families with `gelu_tanh_mlp`.
fn glu(gelu: bool, gate: &[f32], up: &[f32], act: &mut [f32]) {
    if gelu { kernels::gelu_tanh_and_mul(gate, up, act) } else { kernels::silu_and_mul(gate, up, act) }
}
