//! Phases 2-4: weight loading, one decoder layer, full forward with a KV cache.
use std::path::Path;

use serde::Deserialize;

use crate::kernels;
use crate::weights::{self, Matrix};

/// The subset of a Hugging Face `LlamaConfig` this engine reads.
#[derive(Deserialize)]
struct RawConfig {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
    head_dim: Option<usize>,
    hidden_act: Option<String>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers v5: `{rope_type, rope_theta, ...scaling keys}` in place of rope_theta + rope_scaling.
    rope_parameters: Option<serde_json::Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
}

/// Validated model dimensions.
#[derive(Clone, Debug)]
struct Config {
    hidden: usize,
    intermediate: usize,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    max_seq: usize,
    eps: f32,
    theta: f64,
    scaling: RopeScaling,
    tie_embeddings: bool,
}

/// RoPE frequency scaling (contract model.llama, `rope_scaling`; transformers' rope types).
#[derive(Clone, Debug, PartialEq)]
enum RopeScaling {
    /// rope_type "default": the frequencies theta^(-2j / head_dim) as they are.
    None,
    /// "linear": every frequency divided by `factor` (positional interpolation).
    Linear { factor: f64 },
    /// "llama3" (Llama 3.1 and later): by wavelength against `original_max_position_embeddings`:
    /// short wavelengths kept, long ones divided by `factor`, a smooth blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

impl RopeScaling {
    /// Scale one frequency (model.llama's math for each rope_type).
    fn apply(&self, freq: f64) -> f64 {
        match *self {
            RopeScaling::None => freq,
            RopeScaling::Linear { factor } => freq / factor,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let wavelength = 2.0 * std::f64::consts::PI / freq;
                if wavelength < original_max_position_embeddings / high_freq_factor {
                    freq
                } else if wavelength > original_max_position_embeddings / low_freq_factor {
                    freq / factor
                } else {
                    let s = (original_max_position_embeddings / wavelength - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    (1.0 - s) * freq / factor + s * freq
                }
            }
        }
    }
}

/// RoPE's base and scaling as HF reads them: transformers v5's `rope_parameters` first (its
/// `rope_theta` wins over a top-level one), else `rope_scaling` (legacy key `type` for `rope_type`)
/// with the top-level `rope_theta` (default 10000). A rope_type other than default, linear and
/// llama3, a key the rope_type does not read, per-layer-type parameters, or the two forms
/// disagreeing is an error naming the key.
fn resolve_rope(raw: &RawConfig) -> Result<(f64, RopeScaling), String> {
    use serde_json::Value;
    let params = raw.rope_parameters.as_ref().filter(|v| !v.is_null());
    let legacy = raw.rope_scaling.as_ref().filter(|v| !v.is_null());
    let (name, dict) = match (params, legacy) {
        (Some(p), _) => ("rope_parameters", p),
        (None, Some(l)) => ("rope_scaling", l),
        (None, None) => return Ok((raw.rope_theta.unwrap_or(10000.0), RopeScaling::None)),
    };
    let obj = dict.as_object().ok_or_else(|| format!("config.json: {name} must be an object, got {dict}"))?;
    if obj.values().any(Value::is_object) {
        return Err(format!("config.json: {name} holds per-layer-type parameters, not covered"));
    }
    let without_theta = |v: &Value| -> Value {
        let mut v = v.clone();
        if let Some(o) = v.as_object_mut() {
            o.remove("rope_theta");
            if let Some(t) = o.remove("type") {
                o.entry("rope_type").or_insert(t);
            }
        }
        v
    };
    if let (Some(p), Some(l)) = (params, legacy)
        && without_theta(p) != without_theta(l)
    {
        return Err(format!("config.json: rope_parameters {p} and rope_scaling {l} disagree"));
    }
    let rope_type = match obj.get("rope_type").or(obj.get("type")) {
        None => "default",
        Some(v) => v.as_str().ok_or_else(|| format!("config.json: {name}.rope_type must be a string, got {v}"))?,
    };
    let keys: &[&str] = match rope_type {
        "default" => &[],
        "linear" => &["factor"],
        "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
        other => {
            return Err(format!("config.json: {name}.rope_type {other:?} is not covered (default, linear, llama3)"));
        }
    };
    for key in obj.keys() {
        if !["rope_type", "type", "rope_theta"].contains(&key.as_str()) && !keys.contains(&key.as_str()) {
            return Err(format!("config.json: {name}.{key} is not a key of rope_type {rope_type:?}"));
        }
    }
    let number = |key: &str| -> Result<f64, String> {
        match obj.get(key) {
            Some(v) => v
                .as_f64()
                .filter(|x| *x > 0.0)
                .ok_or_else(|| format!("config.json: {name}.{key} must be a positive number, got {v}")),
            None => Err(format!("config.json: {name}.{key} is missing (rope_type {rope_type:?})")),
        }
    };
    let theta = match obj.get("rope_theta") {
        Some(_) if name == "rope_parameters" => number("rope_theta")?,
        _ => raw.rope_theta.unwrap_or(10000.0),
    };
    let scaling = match rope_type {
        "linear" => RopeScaling::Linear { factor: number("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")?,
        },
        _ => RopeScaling::None,
    };
    Ok((theta, scaling))
}

impl Config {
    fn from_raw(raw: RawConfig) -> Result<Config, String> {
        let n_heads = raw.num_attention_heads;
        let n_kv_heads = raw.num_key_value_heads.unwrap_or(n_heads);
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(format!(
                "config.json: num_attention_heads ({n_heads}) must be a positive multiple of num_key_value_heads ({n_kv_heads})"
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None => {
                if !raw.hidden_size.is_multiple_of(n_heads) {
                    return Err(format!(
                        "config.json: hidden_size ({}) is not divisible by num_attention_heads ({n_heads})",
                        raw.hidden_size
                    ));
                }
                raw.hidden_size / n_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(format!("config.json: head_dim ({head_dim}) must be even and positive"));
        }
        if raw.vocab_size == 0 || raw.hidden_size == 0 || raw.max_position_embeddings == 0 {
            return Err("config.json: vocab_size, hidden_size and max_position_embeddings must be positive".into());
        }
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(format!("config.json: unsupported hidden_act {act:?} (only \"silu\")"));
        }
        let (theta, scaling) = resolve_rope(&raw)?;
        if raw.attention_bias == Some(true) {
            return Err("config.json: unsupported attention_bias = true".into());
        }
        if raw.mlp_bias == Some(true) {
            return Err("config.json: unsupported mlp_bias = true".into());
        }
        Ok(Config {
            hidden: raw.hidden_size,
            intermediate: raw.intermediate_size,
            n_layers: raw.num_hidden_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab: raw.vocab_size,
            max_seq: raw.max_position_embeddings,
            eps: raw.rms_norm_eps as f32,
            theta,
            scaling,
            tie_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        })
    }

    fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Tokens run together in one pass of [`Model::prefill`]; scratch buffers hold this many rows.
const PREFILL_CHUNK: usize = 32;

/// Weights and KV cache of one decoder layer.
struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    ffn_norm: Vec<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
    /// [max_seq, n_kv_heads, head_dim]
    k_cache: Vec<f32>,
    /// [max_seq, n_kv_heads, head_dim]
    v_cache: Vec<f32>,
}

/// Buffers reused by every forward step, so the hot path never allocates. Row-major with up to
/// `PREFILL_CHUNK` rows (one per token).
struct Scratch {
    /// Residual stream [rows, hidden].
    x: Vec<f32>,
    /// Normalised activations [rows, hidden].
    h: Vec<f32>,
    /// Queries [rows, n_heads * head_dim].
    q: Vec<f32>,
    /// Attention output [rows, n_heads * head_dim].
    att: Vec<f32>,
    /// Attention scores [max_seq].
    scores: Vec<f32>,
    /// Projection back to the residual width [rows, hidden].
    proj: Vec<f32>,
    /// MLP gate [rows, intermediate].
    gate: Vec<f32>,
    /// MLP up [rows, intermediate].
    up: Vec<f32>,
    /// SwiGLU output [rows, intermediate].
    act: Vec<f32>,
    /// Rotary cos [rows, head_dim / 2].
    cos: Vec<f32>,
    /// Rotary sin [rows, head_dim / 2].
    sin: Vec<f32>,
    /// Output logits [vocab].
    logits: Vec<f32>,
}

/// A loaded Llama-family model with its KV cache.
pub struct Model {
    cfg: Config,
    /// The weight files, mapped; weight matrices may view into them.
    _map: weights::Files,
    /// [vocab, hidden]
    embed: Matrix,
    /// [hidden]
    final_norm: Vec<f32>,
    /// [vocab, hidden]; `None` means the output projection is tied to `embed`.
    lm_head: Option<Matrix>,
    layers: Vec<Layer>,
    /// Rotary frequencies theta^(-2j / head_dim) [head_dim / 2].
    rope_freq: Vec<f64>,
    scratch: Scratch,
    /// One past the highest cache position written since the last reset.
    cache_filled: usize,
}

impl Model {
    /// Load `config.json` and the weights (`model.safetensors`, or the shards
    /// `model.safetensors.index.json` names) from an HF model directory. Errors name the missing file/tensor.
    ///
    /// Weight matrices are stored in this build's format (f32 by default; bf16, f16 or int8 with
    /// the cargo feature of that name) and view the memory-mapped file directly when it already
    /// holds that format; 1-D tensors are f32.
    pub fn load(dir: &Path) -> Result<Model, String> {
        // Start the team of threads now, not in the first forward pass.
        crate::pool::global();
        let cfg_path = dir.join("config.json");
        let cfg_text =
            std::fs::read_to_string(&cfg_path).map_err(|e| format!("cannot read {}: {e}", cfg_path.display()))?;
        let raw: RawConfig =
            serde_json::from_str(&cfg_text).map_err(|e| format!("cannot parse {}: {e}", cfg_path.display()))?;
        let cfg = Config::from_raw(raw)?;

        let files = weights::open(dir)?;
        let st = weights::Checkpoint::parse(&files)?;

        let (d, qd, kvd, ff) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let matrix = |name: &str, rows: usize, cols: usize| st.matrix(name, rows, cols);
        let embed = matrix("model.embed_tokens.weight", cfg.vocab, d)?;
        let final_norm = st.vector("model.norm.weight", d)?;
        let has_head = st.has("lm_head.weight");
        let lm_head =
            if !cfg.tie_embeddings && has_head { Some(matrix("lm_head.weight", cfg.vocab, d)?) } else { None };

        let cache_len = cfg.max_seq * kvd;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: st.vector(&format!("{p}.input_layernorm.weight"), d)?,
                wq: matrix(&format!("{p}.self_attn.q_proj.weight"), qd, d)?,
                wk: matrix(&format!("{p}.self_attn.k_proj.weight"), kvd, d)?,
                wv: matrix(&format!("{p}.self_attn.v_proj.weight"), kvd, d)?,
                wo: matrix(&format!("{p}.self_attn.o_proj.weight"), d, qd)?,
                ffn_norm: st.vector(&format!("{p}.post_attention_layernorm.weight"), d)?,
                w_gate: matrix(&format!("{p}.mlp.gate_proj.weight"), ff, d)?,
                w_up: matrix(&format!("{p}.mlp.up_proj.weight"), ff, d)?,
                w_down: matrix(&format!("{p}.mlp.down_proj.weight"), d, ff)?,
                // Zeroed allocations are lazily backed by the OS, so a long context costs
                // memory only for the positions actually used.
                k_cache: vec![0.0; cache_len],
                v_cache: vec![0.0; cache_len],
            });
        }
        drop(st);

        let half = cfg.head_dim / 2;
        let rope_freq = (0..half).map(|j| cfg.scaling.apply(kernels::rope_freq(cfg.theta, j, cfg.head_dim))).collect();
        let rows = PREFILL_CHUNK;
        let scratch = Scratch {
            x: vec![0.0; rows * d],
            h: vec![0.0; rows * d],
            q: vec![0.0; rows * qd],
            att: vec![0.0; rows * qd],
            scores: vec![0.0; cfg.max_seq],
            proj: vec![0.0; rows * d],
            gate: vec![0.0; rows * ff],
            up: vec![0.0; rows * ff],
            act: vec![0.0; rows * ff],
            cos: vec![0.0; rows * half],
            sin: vec![0.0; rows * half],
            logits: vec![0.0; cfg.vocab],
        };
        Ok(Model { cfg, _map: files, embed, final_norm, lm_head, layers, rope_freq, scratch, cache_filled: 0 })
    }

    /// Vocabulary size (length of the logits vector).
    pub fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    /// Maximum sequence length the KV cache holds (config max_position_embeddings).
    pub fn max_seq_len(&self) -> usize {
        self.cfg.max_seq
    }

    /// K or V width of one position: n_kv_heads * head_dim.
    pub(crate) fn kv_dim(&self) -> usize {
        self.cfg.kv_dim()
    }

    /// Decoder layers.
    pub(crate) fn n_layers(&self) -> usize {
        self.cfg.n_layers
    }

    /// One pass over several sequences' chunks (component.batched_step): every projection and the
    /// MLP run on the rows of all chunks at once (one read of each weight matrix per step), RoPE
    /// at each row's own position, K/V written through each chunk's block table, paged attention,
    /// and the output projection on the last row of every chunk. Returns [chunks, vocab].
    ///
    /// # Panics
    /// On an empty chunk, a position beyond max_seq_len, a token outside the vocabulary, or a block
    /// table that does not cover a chunk's positions.
    pub(crate) fn run_batch(
        &mut self,
        cache: &mut crate::batch::PagedKvCache,
        chunks: &[crate::batch::SeqChunk],
    ) -> Vec<f32> {
        self.batch_pass(cache, chunks)
    }

    fn batch_pass(&mut self, cache: &mut crate::batch::PagedKvCache, chunks: &[crate::batch::SeqChunk]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (d, qd, kvd, ff) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let (hd, half, bs) = (cfg.head_dim, cfg.head_dim / 2, cache.block_size);
        let n = chunks.len();
        if n == 0 {
            return Vec::new();
        }
        let bps = chunks.iter().map(|c| c.block_table.len()).max().unwrap_or(0);
        let mut table = vec![u32::MAX; n * bps];
        let mut query_start = vec![0u32];
        let mut context_lens = Vec::with_capacity(n);
        // (position, physical slot) of every row.
        let mut rows_at: Vec<(usize, usize)> = Vec::new();
        for (c, chunk) in chunks.iter().enumerate() {
            let end = chunk.start + chunk.tokens.len();
            assert!(!chunk.tokens.is_empty(), "chunk {c} has no tokens");
            assert!(end <= cfg.max_seq, "chunk {c} reaches position {}, beyond max_seq_len {}", end - 1, cfg.max_seq);
            assert!(
                chunk.block_table.len() >= end.div_ceil(bs),
                "chunk {c}: block table of {} blocks does not cover {end} positions",
                chunk.block_table.len()
            );
            table[c * bps..c * bps + chunk.block_table.len()].copy_from_slice(chunk.block_table);
            for (j, &t) in chunk.tokens.iter().enumerate() {
                assert!((t as usize) < cfg.vocab, "token id {t} is outside the vocabulary ({})", cfg.vocab);
                let pos = chunk.start + j;
                let block = chunk.block_table[pos / bs] as usize;
                assert!(block < cache.num_blocks, "chunk {c}: block {block} is outside the cache");
                rows_at.push((pos, block * bs + pos % bs));
            }
            query_start.push(rows_at.len() as u32);
            context_lens.push(end as u32);
        }
        let rows = rows_at.len();
        let mut x = vec![0.0f32; rows * d];
        let mut h = vec![0.0f32; rows * d];
        let mut q = vec![0.0f32; rows * qd];
        let mut k_new = vec![0.0f32; rows * kvd];
        let mut v_new = vec![0.0f32; rows * kvd];
        let mut att = vec![0.0f32; rows * qd];
        let mut proj = vec![0.0f32; rows * d];
        let mut gate = vec![0.0f32; rows * ff];
        let mut up = vec![0.0f32; rows * ff];
        let mut act = vec![0.0f32; rows * ff];
        let mut cos = vec![0.0f32; rows * half];
        let mut sin = vec![0.0f32; rows * half];
        let mut r = 0;
        for chunk in chunks {
            for &t in chunk.tokens {
                self.embed.row_into(t as usize, &mut x[r * d..(r + 1) * d]);
                let (c, sn) = (&mut cos[r * half..(r + 1) * half], &mut sin[r * half..(r + 1) * half]);
                for ((c, sn), &f) in c.iter_mut().zip(sn.iter_mut()).zip(&self.rope_freq) {
                    (*c, *sn) = kernels::rope_cos_sin(rows_at[r].0, f);
                }
                r += 1;
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            kernels::rms_norm(&x, &layer.attn_norm, cfg.eps, &mut h);
            Matrix::linear_many(&h, rows, [&layer.wq, &layer.wk, &layer.wv], [&mut q, &mut k_new, &mut v_new]);
            let (kc, vc) = (&mut cache.k[l], &mut cache.v[l]);
            for (i, &(_, slot)) in rows_at.iter().enumerate() {
                let (c, sn) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
                kernels::rope_apply(&mut q[i * qd..(i + 1) * qd], hd, c, sn);
                kernels::rope_apply(&mut k_new[i * kvd..(i + 1) * kvd], hd, c, sn);
                kc[slot * kvd..(slot + 1) * kvd].copy_from_slice(&k_new[i * kvd..(i + 1) * kvd]);
                vc[slot * kvd..(slot + 1) * kvd].copy_from_slice(&v_new[i * kvd..(i + 1) * kvd]);
            }
            kernels::paged_attention(
                &q,
                kc,
                vc,
                &table,
                bps,
                &query_start,
                &context_lens,
                cfg.n_heads,
                cfg.n_kv_heads,
                hd,
                bs,
                &mut att,
            );
            layer.wo.linear(&att, rows, &mut proj);
            for (x, &p) in x.iter_mut().zip(proj.iter()) {
                *x += p;
            }
            kernels::rms_norm(&x, &layer.ffn_norm, cfg.eps, &mut h);
            Matrix::linear_many(&h, rows, [&layer.w_gate, &layer.w_up], [&mut gate, &mut up]);
            kernels::silu_and_mul(&gate, &up, &mut act);
            layer.w_down.linear(&act, rows, &mut proj);
            for (x, &p) in x.iter_mut().zip(proj.iter()) {
                *x += p;
            }
        }
        // The last row of every chunk through the final norm and the output projection, together.
        let mut last = vec![0.0f32; n * d];
        for c in 0..n {
            let row = query_start[c + 1] as usize - 1;
            last[c * d..(c + 1) * d].copy_from_slice(&x[row * d..(row + 1) * d]);
        }
        let mut normed = vec![0.0f32; n * d];
        kernels::rms_norm(&last, &self.final_norm, cfg.eps, &mut normed);
        let mut logits = vec![0.0f32; n * cfg.vocab];
        self.lm_head.as_ref().unwrap_or(&self.embed).linear(&normed, n, &mut logits);
        logits
    }

    /// Forget all cached positions.
    pub fn reset(&mut self) {
        let used = self.cache_filled * self.cfg.kv_dim();
        for layer in &mut self.layers {
            layer.k_cache[..used].fill(0.0);
            layer.v_cache[..used].fill(0.0);
        }
        self.cache_filled = 0;
        self.scratch.logits.fill(0.0);
    }

    /// Run tokens at positions start_pos..start_pos+tokens.len(), writing their K/V into the cache;
    /// return the logits [vocab] of the last token.
    ///
    /// Tokens are run in chunks of up to 32, each weight matrix applied to a whole chunk at once;
    /// every value is computed exactly as [`Model::forward`] would compute it for that token, so
    /// the result is bit-identical to calling it for each token. Only the last token's output
    /// projection is computed. With an empty `tokens` the cache is untouched and the logits buffer
    /// is returned as it stands.
    pub fn prefill(&mut self, tokens: &[u32], start_pos: usize) -> &[f32] {
        let n = tokens.len();
        let mut done = 0;
        while done < n {
            let take = (n - done).min(PREFILL_CHUNK);
            let last = done + take == n;
            self.run(&tokens[done..done + take], start_pos + done, last);
            done += take;
        }
        &self.scratch.logits
    }

    /// Run one token at position `pos` (cache holds 0..pos), write its K/V at `pos`; return logits [vocab].
    pub fn forward(&mut self, token: u32, pos: usize) -> &[f32] {
        self.run(&[token], pos, true);
        &self.scratch.logits
    }

    /// As `forward`, also calling `trace(layer, point, values)` for each activation point it computes,
    /// in order: `point` a node name of this contract's [model.graph] (`layer` None in the prologue and
    /// epilogue, Some(i) in decoder layer i), `values` that node's output for this token, f32, flattened.
    /// Report at least the graph's `trace_required` points; a step fused away may be left out.
    ///
    /// The q, k and v projections run as one fused product, so `q`, `k` and `v` are reported after
    /// it; `k` and `k_rope` are the cache row. The pass runs on the calling thread (a `trace` need
    /// not be `Send`), so with a pool of several threads each parallel product pays a wake-up that
    /// `forward` avoids.
    #[allow(clippy::type_complexity)]
    pub fn forward_traced(
        &mut self,
        token: u32,
        pos: usize,
        trace: &mut dyn FnMut(Option<usize>, &str, &[f32]),
    ) -> &[f32] {
        self.step(&[token], pos, true, trace);
        &self.scratch.logits
    }

    /// One decoder pass over `tokens` (at most `PREFILL_CHUNK`) at positions start..; computes the
    /// last token's logits only when `want_logits`.
    fn run(&mut self, tokens: &[u32], start: usize, want_logits: bool) {
        self.step(tokens, start, want_logits, &mut |_, _, _| {});
    }

    /// The pass itself; `trace` receives every point's rows (see `forward_traced`).
    #[allow(clippy::type_complexity)]
    fn step(
        &mut self,
        tokens: &[u32],
        start: usize,
        want_logits: bool,
        trace: &mut dyn FnMut(Option<usize>, &str, &[f32]),
    ) {
        let cfg = &self.cfg;
        let rows = tokens.len();
        assert!(rows <= PREFILL_CHUNK, "at most {PREFILL_CHUNK} tokens per step");
        assert!(
            start + rows <= cfg.max_seq,
            "position {} is outside the KV cache (max_seq_len {})",
            start + rows - 1,
            cfg.max_seq
        );
        for &token in tokens {
            assert!((token as usize) < cfg.vocab, "token id {token} is outside the vocabulary ({})", cfg.vocab);
        }
        let (d, qd, kvd, ff) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let (hd, half) = (cfg.head_dim, cfg.head_dim / 2);
        let s = &mut self.scratch;
        let x = &mut s.x[..rows * d];
        let h = &mut s.h[..rows * d];
        let q = &mut s.q[..rows * qd];
        let att = &mut s.att[..rows * qd];
        let proj = &mut s.proj[..rows * d];
        let gate = &mut s.gate[..rows * ff];
        let up = &mut s.up[..rows * ff];
        let act = &mut s.act[..rows * ff];
        let cos = &mut s.cos[..rows * half];
        let sin = &mut s.sin[..rows * half];

        for (i, &token) in tokens.iter().enumerate() {
            self.embed.row_into(token as usize, &mut x[i * d..(i + 1) * d]);
            let (c, sn) = (&mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
            for ((c, sn), &f) in c.iter_mut().zip(sn.iter_mut()).zip(&self.rope_freq) {
                (*c, *sn) = kernels::rope_cos_sin(start + i, f);
            }
        }
        trace(None, "embed", x);
        let kv_len = start + rows;
        for (li, layer) in self.layers.iter_mut().enumerate() {
            let at = Some(li);
            // Attention block.
            kernels::rms_norm(x, &layer.attn_norm, cfg.eps, h);
            trace(at, "attn_norm", h);
            let k_rows = &mut layer.k_cache[start * kvd..kv_len * kvd];
            let v_rows = &mut layer.v_cache[start * kvd..kv_len * kvd];
            Matrix::linear_many(h, rows, [&layer.wq, &layer.wk, &layer.wv], [&mut *q, k_rows, v_rows]);
            trace(at, "q", q);
            trace(at, "k", &layer.k_cache[start * kvd..kv_len * kvd]);
            trace(at, "v", &layer.v_cache[start * kvd..kv_len * kvd]);
            for i in 0..rows {
                let (c, sn) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
                kernels::rope_apply(&mut q[i * qd..(i + 1) * qd], hd, c, sn);
                let k_tok = &mut layer.k_cache[(start + i) * kvd..(start + i + 1) * kvd];
                kernels::rope_apply(k_tok, hd, c, sn);
            }
            trace(at, "q_rope", q);
            trace(at, "k_rope", &layer.k_cache[start * kvd..kv_len * kvd]);
            kernels::attention_with_scratch(
                q,
                &layer.k_cache[..kv_len * kvd],
                &layer.v_cache[..kv_len * kvd],
                rows,
                kv_len,
                cfg.n_heads,
                cfg.n_kv_heads,
                hd,
                att,
                &mut s.scores,
            );
            trace(at, "attn", att);
            layer.wo.linear(att, rows, proj);
            trace(at, "o", proj);
            for (x, &p) in x.iter_mut().zip(proj.iter()) {
                *x += p;
            }
            trace(at, "attn_residual", x);

            // MLP block.
            kernels::rms_norm(x, &layer.ffn_norm, cfg.eps, h);
            trace(at, "mlp_norm", h);
            Matrix::linear_many(h, rows, [&layer.w_gate, &layer.w_up], [&mut *gate, &mut *up]);
            trace(at, "gate", gate);
            trace(at, "up", up);
            kernels::silu_and_mul(gate, up, act);
            trace(at, "act", act);
            layer.w_down.linear(act, rows, proj);
            trace(at, "down", proj);
            for (x, &p) in x.iter_mut().zip(proj.iter()) {
                *x += p;
            }
            trace(at, "mlp_residual", x);
        }
        self.cache_filled = self.cache_filled.max(kv_len);

        if want_logits {
            let last = &x[(rows - 1) * d..rows * d];
            let h = &mut h[..d];
            kernels::rms_norm(last, &self.final_norm, cfg.eps, h);
            trace(None, "final_norm", h);
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            head.linear(h, 1, &mut s.logits);
            trace(None, "logits", &s.logits);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use safetensors::Dtype;
    use safetensors::tensor::TensorView;

    use super::*;

    const D: usize = 32;
    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HD: usize = 8;
    const FF: usize = 40;
    const VOCAB: usize = 50;
    const LAYERS: usize = 2;
    const MAX_SEQ: usize = 64;

    /// (name, shape, values) of every checkpoint tensor.
    type Weights = Vec<(String, Vec<usize>, Vec<f32>)>;

    /// Random weights by name, with their shapes, as the checkpoint holds them (f32).
    fn random_weights() -> Weights {
        let mut state = 0x1234_5678_9ABC_DEF0u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
        };
        let mut out = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, norm: bool| {
            let len = shape.iter().product();
            let data = (0..len).map(|_| if norm { 1.0 + next() } else { next() }).collect();
            out.push((name, shape, data));
        };
        add("model.embed_tokens.weight".into(), vec![VOCAB, D], false);
        add("model.norm.weight".into(), vec![D], true);
        add("lm_head.weight".into(), vec![VOCAB, D], false);
        for l in 0..LAYERS {
            let p = format!("model.layers.{l}");
            add(format!("{p}.input_layernorm.weight"), vec![D], true);
            add(format!("{p}.post_attention_layernorm.weight"), vec![D], true);
            add(format!("{p}.self_attn.q_proj.weight"), vec![HEADS * HD, D], false);
            add(format!("{p}.self_attn.k_proj.weight"), vec![KV_HEADS * HD, D], false);
            add(format!("{p}.self_attn.v_proj.weight"), vec![KV_HEADS * HD, D], false);
            add(format!("{p}.self_attn.o_proj.weight"), vec![D, HEADS * HD], false);
            add(format!("{p}.mlp.gate_proj.weight"), vec![FF, D], false);
            add(format!("{p}.mlp.up_proj.weight"), vec![FF, D], false);
            add(format!("{p}.mlp.down_proj.weight"), vec![D, FF], false);
        }
        out
    }

    fn write_model(tag: &str) -> (PathBuf, Weights) {
        let dir = std::env::temp_dir().join(format!("llama-cpu-simd-test-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({
            "hidden_size": D, "intermediate_size": FF, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
            "max_position_embeddings": MAX_SEQ, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": false, "hidden_act": "silu"
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let weights = random_weights();
        let bytes: Vec<Vec<u8>> =
            weights.iter().map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
        let views: Vec<(String, TensorView)> = weights
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        (dir, weights)
    }

    /// A weight matrix as this build stores it, widened back to f32.
    fn as_stored(w: &[f32], cols: usize) -> Vec<f32> {
        if cfg!(feature = "bf16") {
            w.iter().map(|&v| crate::quant::bf16_to_f32(crate::quant::f32_to_bf16(v))).collect()
        } else if cfg!(feature = "f16") {
            w.iter().map(|&v| crate::quant::f16_to_f32(crate::quant::f32_to_f16(v))).collect()
        } else if cfg!(feature = "int8") {
            let (q, scales) = crate::quant::quantize_int8(w, cols);
            q.iter().enumerate().map(|(i, &q)| q as f32 * scales[i / cols]).collect()
        } else {
            w.to_vec()
        }
    }

    /// Plain f64 forward pass over `tokens`; returns the logits of the last token.
    fn reference_logits(weights: &Weights, tokens: &[u32]) -> Vec<f64> {
        let w: HashMap<&str, Vec<f64>> = weights
            .iter()
            .map(|(n, s, d)| {
                let stored = if s.len() == 2 { as_stored(d, s[1]) } else { d.clone() };
                (n.as_str(), stored.iter().map(|&v| v as f64).collect())
            })
            .collect();
        let lin = |name: &str, x: &[f64], n: usize| -> Vec<f64> {
            let m = &w[name];
            let k = x.len();
            (0..n).map(|o| (0..k).map(|c| m[o * k + c] * x[c]).sum()).collect()
        };
        let norm = |name: &str, x: &[f64]| -> Vec<f64> {
            let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            x.iter().zip(&w[name]).map(|(v, g)| v * inv * g).collect()
        };
        let rope = |v: &mut [f64], pos: usize| {
            for head in v.chunks_mut(HD) {
                for j in 0..HD / 2 {
                    let angle = pos as f64 * 10000f64.powf(-((2 * j) as f64) / HD as f64);
                    let (s, c) = angle.sin_cos();
                    let (a, b) = (head[j], head[j + HD / 2]);
                    head[j] = a * c - b * s;
                    head[j + HD / 2] = a * s + b * c;
                }
            }
        };
        let mut keys = vec![Vec::new(); LAYERS];
        let mut values = vec![Vec::new(); LAYERS];
        let mut x = Vec::new();
        for (pos, &tok) in tokens.iter().enumerate() {
            let emb = &w["model.embed_tokens.weight"];
            x = emb[tok as usize * D..(tok as usize + 1) * D].to_vec();
            for l in 0..LAYERS {
                let p = format!("model.layers.{l}");
                let h = norm(&format!("{p}.input_layernorm.weight"), &x);
                let mut q = lin(&format!("{p}.self_attn.q_proj.weight"), &h, HEADS * HD);
                let mut k = lin(&format!("{p}.self_attn.k_proj.weight"), &h, KV_HEADS * HD);
                let v = lin(&format!("{p}.self_attn.v_proj.weight"), &h, KV_HEADS * HD);
                rope(&mut q, pos);
                rope(&mut k, pos);
                keys[l].push(k);
                values[l].push(v);
                let mut att = vec![0.0; HEADS * HD];
                for hh in 0..HEADS {
                    let kvh = hh / (HEADS / KV_HEADS);
                    let qh = &q[hh * HD..(hh + 1) * HD];
                    let scores: Vec<f64> = keys[l]
                        .iter()
                        .map(|k| {
                            let kh = &k[kvh * HD..(kvh + 1) * HD];
                            qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (HD as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = e.iter().sum();
                    for (t, v) in values[l].iter().enumerate() {
                        for c in 0..HD {
                            att[hh * HD + c] += e[t] / total * v[kvh * HD + c];
                        }
                    }
                }
                let o = lin(&format!("{p}.self_attn.o_proj.weight"), &att, D);
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h = norm(&format!("{p}.post_attention_layernorm.weight"), &x);
                let g = lin(&format!("{p}.mlp.gate_proj.weight"), &h, FF);
                let u = lin(&format!("{p}.mlp.up_proj.weight"), &h, FF);
                let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let dn = lin(&format!("{p}.mlp.down_proj.weight"), &a, D);
                x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
            }
        }
        let h = norm("model.norm.weight", &x);
        lin("lm_head.weight", &h, VOCAB)
    }

    #[test]
    fn forward_matches_f64_reference_and_prefill_matches_forward() {
        let (dir, weights) = write_model("model");
        let mut model = Model::load(&dir).unwrap();
        let tokens: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % VOCAB as u32).collect();

        let mut stepped = Vec::new();
        for (pos, &t) in tokens.iter().enumerate() {
            stepped = model.forward(t, pos).to_vec();
        }
        let want = reference_logits(&weights, &tokens);
        for (o, (&g, &w)) in stepped.iter().zip(&want).enumerate() {
            assert!((g as f64 - w).abs() <= 1e-4 + 1e-4 * w.abs(), "logit {o}: got {g}, want {w}");
        }
        let next_stepped = model.forward(5, tokens.len()).to_vec();

        model.reset();
        let prefilled = model.prefill(&tokens, 0).to_vec();
        let next_prefilled = model.forward(5, tokens.len()).to_vec();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&prefilled), bits(&stepped));
        assert_eq!(bits(&next_prefilled), bits(&next_stepped));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn batched_step_over_paged_cache_matches_prefill() {
        let (dir, _) = write_model("batch");
        let mut model = Model::load(&dir).unwrap();
        let a: Vec<u32> = (0..37).map(|i| (i * 5 + 1) % VOCAB as u32).collect();
        let b: Vec<u32> = (0..9).map(|i| (i * 3 + 2) % VOCAB as u32).collect();
        let mut cache = crate::batch::new_cache(&model, 13, 4);
        // Blocks handed out out of order and interleaved between the two sequences.
        let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..10).map(|i| 11 - i).collect(), vec![1, 0, 12]);
        let ta = &ta[..];
        // Step 1: a's first 20 tokens; step 2: a's other 17 beside all of b.
        crate::batch::step(
            &mut model,
            &mut cache,
            &[crate::batch::SeqChunk { tokens: &a[..20], start: 0, block_table: &ta[..5] }],
        );
        let out = crate::batch::step(
            &mut model,
            &mut cache,
            &[
                crate::batch::SeqChunk { tokens: &b, start: 0, block_table: &tb },
                crate::batch::SeqChunk { tokens: &a[20..], start: 20, block_table: ta },
            ],
        );
        for (c, tokens) in [(0, &b), (1, &a)] {
            model.reset();
            let want = model.prefill(tokens, 0).to_vec();
            let got = &out[c * VOCAB..(c + 1) * VOCAB];
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5 + 1e-5 * w.abs(), "chunk {c}: {g} vs {w}");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
