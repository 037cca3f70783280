//! Phases 2-4: weight loading, one decoder layer, full forward with a KV cache.
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::kernels;

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
    theta: f32,
    tie_embeddings: bool,
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
            return Err(format!(
                "config.json: head_dim ({head_dim}) must be even and positive"
            ));
        }
        if raw.vocab_size == 0 || raw.hidden_size == 0 || raw.max_position_embeddings == 0 {
            return Err(
                "config.json: vocab_size, hidden_size and max_position_embeddings must be positive"
                    .into(),
            );
        }
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(format!(
                "config.json: unsupported hidden_act {act:?} (only \"silu\")"
            ));
        }
        // A JSON null deserialises to None.
        if let Some(scaling) = &raw.rope_scaling {
            return Err(format!("config.json: unsupported rope_scaling {scaling}"));
        }
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
            theta: raw.rope_theta.unwrap_or(10000.0) as f32,
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

/// Weights and KV cache of one decoder layer.
struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
    /// [max_seq, n_kv_heads, head_dim]
    k_cache: Vec<f32>,
    /// [max_seq, n_kv_heads, head_dim]
    v_cache: Vec<f32>,
}

/// Buffers reused by every forward step, so the hot path never allocates.
struct Scratch {
    /// Residual stream [hidden].
    x: Vec<f32>,
    /// Normalised activations [hidden].
    h: Vec<f32>,
    /// Queries [n_heads * head_dim].
    q: Vec<f32>,
    /// Attention output [n_heads * head_dim].
    att: Vec<f32>,
    /// Attention scores [max_seq].
    scores: Vec<f32>,
    /// Projection back to the residual width [hidden].
    proj: Vec<f32>,
    /// MLP gate [intermediate].
    gate: Vec<f32>,
    /// MLP up [intermediate].
    up: Vec<f32>,
    /// SwiGLU output [intermediate].
    act: Vec<f32>,
    /// Output logits [vocab].
    logits: Vec<f32>,
}

/// A loaded Llama-family model with its KV cache.
pub struct Model {
    cfg: Config,
    /// [vocab, hidden]
    embed: Vec<f32>,
    /// [hidden]
    final_norm: Vec<f32>,
    /// [vocab, hidden]; `None` means the output projection is tied to `embed`.
    lm_head: Option<Vec<f32>>,
    layers: Vec<Layer>,
    scratch: Scratch,
    /// One past the highest cache position written since the last reset.
    cache_filled: usize,
}

/// Convert an IEEE half-precision bit pattern to f32.
fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits >> 15) as u32) << 31;
    let exp = ((bits >> 10) & 0x1f) as u32;
    let mant = (bits & 0x3ff) as u32;
    let out = if exp == 0 {
        if mant == 0 {
            sign
        } else {
            // Subnormal half: value = mant * 2^-24, exactly representable in f32.
            let v = mant as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (mant << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (mant << 13)
    };
    f32::from_bits(out)
}

/// Read tensor `name` from the checkpoint as f32, checking its shape.
fn load_tensor(st: &SafeTensors, name: &str, shape: &[usize]) -> Result<Vec<f32>, String> {
    let view = st
        .tensor(name)
        .map_err(|_| format!("model.safetensors: missing tensor {name}"))?;
    if view.shape() != shape {
        return Err(format!(
            "model.safetensors: tensor {name} has shape {:?}, expected {:?}",
            view.shape(),
            shape
        ));
    }
    let data = view.data();
    let out: Vec<f32> = match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        other => {
            return Err(format!(
                "model.safetensors: tensor {name} has unsupported dtype {other:?} (F32, BF16 or F16 expected)"
            ));
        }
    };
    let expected: usize = shape.iter().product();
    if out.len() != expected {
        return Err(format!(
            "model.safetensors: tensor {name} holds {} values, expected {expected}",
            out.len()
        ));
    }
    Ok(out)
}

impl Model {
    /// Load `config.json` and `model.safetensors` from an HF model directory. Errors name the missing file/tensor.
    pub fn load(dir: &Path) -> Result<Model, String> {
        let cfg_path = dir.join("config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| format!("cannot read {}: {e}", cfg_path.display()))?;
        let raw: RawConfig = serde_json::from_str(&cfg_text)
            .map_err(|e| format!("cannot parse {}: {e}", cfg_path.display()))?;
        let cfg = Config::from_raw(raw)?;

        let st_path = dir.join("model.safetensors");
        let bytes = std::fs::read(&st_path)
            .map_err(|e| format!("cannot read {}: {e}", st_path.display()))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| format!("cannot parse {}: {e}", st_path.display()))?;

        let (d, qd, kvd, ff) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let embed = load_tensor(&st, "model.embed_tokens.weight", &[cfg.vocab, d])?;
        let final_norm = load_tensor(&st, "model.norm.weight", &[d])?;
        let has_head = st.names().contains(&"lm_head.weight");
        let lm_head = if !cfg.tie_embeddings && has_head {
            Some(load_tensor(&st, "lm_head.weight", &[cfg.vocab, d])?)
        } else {
            None
        };

        let cache_len = cfg.max_seq * kvd;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: load_tensor(&st, &format!("{p}.input_layernorm.weight"), &[d])?,
                wq: load_tensor(&st, &format!("{p}.self_attn.q_proj.weight"), &[qd, d])?,
                wk: load_tensor(&st, &format!("{p}.self_attn.k_proj.weight"), &[kvd, d])?,
                wv: load_tensor(&st, &format!("{p}.self_attn.v_proj.weight"), &[kvd, d])?,
                wo: load_tensor(&st, &format!("{p}.self_attn.o_proj.weight"), &[d, qd])?,
                ffn_norm: load_tensor(&st, &format!("{p}.post_attention_layernorm.weight"), &[d])?,
                w_gate: load_tensor(&st, &format!("{p}.mlp.gate_proj.weight"), &[ff, d])?,
                w_up: load_tensor(&st, &format!("{p}.mlp.up_proj.weight"), &[ff, d])?,
                w_down: load_tensor(&st, &format!("{p}.mlp.down_proj.weight"), &[d, ff])?,
                // Zeroed allocations are lazily backed by the OS, so a long context costs
                // memory only for the positions actually used.
                k_cache: vec![0.0; cache_len],
                v_cache: vec![0.0; cache_len],
            });
        }

        let scratch = Scratch {
            x: vec![0.0; d],
            h: vec![0.0; d],
            q: vec![0.0; qd],
            att: vec![0.0; qd],
            scores: vec![0.0; cfg.max_seq],
            proj: vec![0.0; d],
            gate: vec![0.0; ff],
            up: vec![0.0; ff],
            act: vec![0.0; ff],
            logits: vec![0.0; cfg.vocab],
        };
        Ok(Model {
            cfg,
            embed,
            final_norm,
            lm_head,
            layers,
            scratch,
            cache_filled: 0,
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
    /// Tokens are run one at a time, so the result is bit-identical to calling [`Model::forward`]
    /// for each token; only the last token's output projection is computed. With an empty `tokens`
    /// the cache is untouched and the logits buffer is returned as it stands.
    pub fn prefill(&mut self, tokens: &[u32], start_pos: usize) -> &[f32] {
        let n = tokens.len();
        for (i, &tok) in tokens.iter().enumerate() {
            self.step(tok, start_pos + i, i + 1 == n);
        }
        &self.scratch.logits
    }

    /// Run one token at position `pos` (cache holds 0..pos), write its K/V at `pos`; return logits [vocab].
    pub fn forward(&mut self, token: u32, pos: usize) -> &[f32] {
        self.step(token, pos, true);
        &self.scratch.logits
    }

    /// One decoder pass for `token` at `pos`; computes logits only when `want_logits`.
    fn step(&mut self, token: u32, pos: usize, want_logits: bool) {
        let cfg = &self.cfg;
        assert!(
            pos < cfg.max_seq,
            "position {pos} is outside the KV cache (max_seq_len {})",
            cfg.max_seq
        );
        assert!(
            (token as usize) < cfg.vocab,
            "token id {token} is outside the vocabulary ({})",
            cfg.vocab
        );
        let (d, qd, kvd, ff) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let s = &mut self.scratch;
        let positions = [pos];

        kernels::embedding(&self.embed, d, &[token], &mut s.x);
        for layer in &mut self.layers {
            // Attention block.
            kernels::rms_norm(&s.x, &layer.attn_norm, cfg.eps, &mut s.h);
            kernels::linear(&s.h, &layer.wq, 1, d, qd, &mut s.q);
            let k_row = &mut layer.k_cache[pos * kvd..(pos + 1) * kvd];
            kernels::linear(&s.h, &layer.wk, 1, d, kvd, k_row);
            kernels::rope(k_row, &positions, cfg.n_kv_heads, cfg.head_dim, cfg.theta);
            let v_row = &mut layer.v_cache[pos * kvd..(pos + 1) * kvd];
            kernels::linear(&s.h, &layer.wv, 1, d, kvd, v_row);
            kernels::rope(&mut s.q, &positions, cfg.n_heads, cfg.head_dim, cfg.theta);
            let kv_len = pos + 1;
            kernels::attention_with_scratch(
                &s.q,
                &layer.k_cache[..kv_len * kvd],
                &layer.v_cache[..kv_len * kvd],
                1,
                kv_len,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                &mut s.att,
                &mut s.scores,
            );
            kernels::linear(&s.att, &layer.wo, 1, qd, d, &mut s.proj);
            for (x, &p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }

            // MLP block.
            kernels::rms_norm(&s.x, &layer.ffn_norm, cfg.eps, &mut s.h);
            kernels::linear(&s.h, &layer.w_gate, 1, d, ff, &mut s.gate);
            kernels::linear(&s.h, &layer.w_up, 1, d, ff, &mut s.up);
            kernels::silu_and_mul(&s.gate, &s.up, &mut s.act);
            kernels::linear(&s.act, &layer.w_down, 1, ff, d, &mut s.proj);
            for (x, &p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }
        }
        self.cache_filled = self.cache_filled.max(pos + 1);

        if want_logits {
            kernels::rms_norm(&s.x, &self.final_norm, cfg.eps, &mut s.h);
            let head = self.lm_head.as_deref().unwrap_or(&self.embed);
            kernels::linear(&s.h, head, 1, d, cfg.vocab, &mut s.logits);
        }
    }
}
