//! The named presets: model shapes of real checkpoints (llama2.c's TinyStories models, Llama 3.2 1B,
//! Qwen3 0.6B, two Qwen3-MoE shapes) that synth writes with random weights.

use schemars::JsonSchema;
use serde::Serialize;

use base::error::{Error, Result};

/// A named model shape for speed and scale work: the sizes and settings of a real checkpoint, written
/// with random weights (timing does not depend on the values).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, JsonSchema)]
pub struct Preset {
    /// Name passed as `--preset`.
    pub name: &'static str,
    /// Family short name (one of [`FAMILIES`]).
    pub family: &'static str,
    /// hidden_size (llama2.c `dim`).
    pub hidden: usize,
    /// num_hidden_layers.
    pub layers: usize,
    /// num_attention_heads.
    pub heads: usize,
    /// num_key_value_heads.
    pub kv_heads: usize,
    /// head_dim; 0: hidden / heads.
    pub head_dim: usize,
    /// intermediate_size (the SwiGLU hidden width).
    pub intermediate: usize,
    /// vocab_size.
    pub vocab: usize,
    /// max_position_embeddings written (the context an engine allocates its KV cache for).
    pub max_seq: usize,
    /// rope_theta.
    pub rope_theta: f64,
    /// rms_norm_eps.
    pub rms_norm_eps: f64,
    /// Llama 3.1-style RoPE scaling (factor, low_freq_factor, high_freq_factor,
    /// original_max_position_embeddings), when the real config has it.
    pub llama3_scaling: Option<(f64, f64, f64, usize)>,
    /// Stored weight dtype: `f32`, `bf16` or `f16`.
    pub dtype: &'static str,
    /// Tokenizer: `spm` or `bytelevel`.
    pub tokenizer: &'static str,
    /// A mixture of experts: (experts, experts per token, one expert's width); (0, 0, 0) for a
    /// dense model. Such a preset is written from its family's contract (graph) like any family
    /// synth knows only by contract.
    pub experts: (usize, usize, usize),
    /// sliding_window written (positions); 0: none (null, or the family's default).
    pub sliding_window: usize,
}

/// The llama2.c TinyStories model shapes, and two current small models.
///
/// stories15m/42m/110m: the model table of the llama2.c README (Karpathy 2023,
/// <https://github.com/karpathy/llama2.c>): dim, n_layers, n_heads, n_kv_heads and max context length,
/// all with the 32000-token Llama 2 vocabulary. The intermediate sizes follow llama2.c's `model.py`
/// (`hidden_dim = 4 * dim`, times 2/3, rounded up to a multiple of 32: 768, 1376, 2048). llama2.c
/// shares the embedding with the output projection, so they are written tied with
/// `rms_norm_eps = 1e-5` (`ModelArgs.norm_eps`); tied, they hold 15.2M, 41.7M and 109.5M parameters.
///
/// llama3.2-1b: the config.json of meta-llama/Llama-3.2-1B (hidden 2048, 16 layers, 32 query and 8
/// KV heads of 64, intermediate 8192, vocabulary 128256, rope_theta 500000 with llama3 scaling
/// factor 32 / low 1 / high 4 / original 8192, rms_norm_eps 1e-5, tied, BF16): 1,235,814,400
/// parameters. qwen3-0.6b: the config.json of Qwen/Qwen3-0.6B (hidden 1024, 28 layers, 16 query and 8
/// KV heads of 128, intermediate 3072, vocabulary 151936, rope_theta 1e6, rms_norm_eps 1e-6, tied,
/// BF16): 596,049,920 parameters. Both are written with a 4096-position context instead of their real
/// 131072 and 40960: an engine allocates its KV cache for the whole context (at 131072 positions
/// Llama 3.2 1B's f32 cache alone would be 16 x 2 x 512 x 131072 x 4 B = 8.6 GB); `--max-seq` writes
/// more.
///
/// qwen3-moe-mini: Qwen/Qwen3-30B-A3B's mixture of experts scaled down (its config.json: hidden 2048,
/// 48 layers, 32 query and 4 KV heads of 128, 128 experts of width 768, 8 per token: a token reads
/// 1/16 of the expert weights), kept in proportion where it matters to decode: 8 query heads per KV
/// head, 1/16 of the experts per token (2 of 32), experts a third as wide as the hidden state;
/// hidden 256, 4 layers, heads of 32, vocabulary 4096, BF16: 12.2M parameters, of which a decoded
/// token reads 2.3M (lm_head included). qwen3-moe-1b-active: a Qwen3-MoE shape whose decoded token reads about 1B
/// weights (28 layers of hidden 2048, 16 query and 4 KV heads of 128, 4 of 16 experts of width 1024;
/// 32000-token vocabulary; 3.2B parameters in all, BF16: 6.5 GB), for decode speed at the size of
/// the small dense presets. Both are written from model.qwen3_moe's graph, with its defaults for the
/// RoPE base and epsilon.
///
/// gpt-oss-mini: openai/gpt-oss-20b scaled down (its config.json: hidden 2880, 24 layers, 64 query
/// and 8 KV heads of 64, 32 experts as wide as the hidden state, 4 per token: 1/8 of the expert
/// weights; a 128-position window on every other layer; YaRN factor 32 over 4096 positions), kept
/// in proportion where it matters to decode: 8 query heads per KV head, 4 of 32 experts, experts as
/// wide as the hidden state, the 128-position window; hidden 256, 4 layers, heads of 32, vocabulary
/// 4096, BF16: 27,988,640 parameters, of which a decoded token reads 4,833,952 (lm_head included).
/// Written from model.gpt_oss's graph (rope_parameters its example, YaRN).
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "stories15m",
        family: "llama",
        hidden: 288,
        layers: 6,
        heads: 6,
        kv_heads: 6,
        head_dim: 0,
        intermediate: 768,
        vocab: 32000,
        max_seq: 256,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        llama3_scaling: None,
        dtype: "f32",
        tokenizer: "spm",
        experts: (0, 0, 0),
        sliding_window: 0,
    },
    Preset {
        name: "stories42m",
        family: "llama",
        hidden: 512,
        layers: 8,
        heads: 8,
        kv_heads: 8,
        head_dim: 0,
        intermediate: 1376,
        vocab: 32000,
        max_seq: 1024,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        llama3_scaling: None,
        dtype: "f32",
        tokenizer: "spm",
        experts: (0, 0, 0),
        sliding_window: 0,
    },
    Preset {
        name: "stories110m",
        family: "llama",
        hidden: 768,
        layers: 12,
        heads: 12,
        kv_heads: 12,
        head_dim: 0,
        intermediate: 2048,
        vocab: 32000,
        max_seq: 1024,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        llama3_scaling: None,
        dtype: "f32",
        tokenizer: "spm",
        experts: (0, 0, 0),
        sliding_window: 0,
    },
    Preset {
        name: "llama3.2-1b",
        family: "llama",
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        intermediate: 8192,
        vocab: 128_256,
        max_seq: 4096,
        rope_theta: 500_000.0,
        rms_norm_eps: 1e-5,
        llama3_scaling: Some((32.0, 1.0, 4.0, 8192)),
        dtype: "bf16",
        tokenizer: "bytelevel",
        experts: (0, 0, 0),
        sliding_window: 0,
    },
    Preset {
        name: "qwen3-0.6b",
        family: "qwen3",
        hidden: 1024,
        layers: 28,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 3072,
        vocab: 151_936,
        max_seq: 4096,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        llama3_scaling: None,
        dtype: "bf16",
        tokenizer: "bytelevel",
        experts: (0, 0, 0),
        sliding_window: 0,
    },
    Preset {
        name: "qwen3-moe-mini",
        family: "qwen3_moe",
        hidden: 256,
        layers: 4,
        heads: 8,
        kv_heads: 1,
        head_dim: 32,
        intermediate: 768,
        vocab: 4096,
        max_seq: 1024,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        llama3_scaling: None,
        dtype: "bf16",
        tokenizer: "spm",
        experts: (32, 2, 96),
        sliding_window: 0,
    },
    Preset {
        name: "qwen3-moe-1b-active",
        family: "qwen3_moe",
        hidden: 2048,
        layers: 28,
        heads: 16,
        kv_heads: 4,
        head_dim: 128,
        intermediate: 6144,
        vocab: 32000,
        max_seq: 4096,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        llama3_scaling: None,
        dtype: "bf16",
        tokenizer: "spm",
        experts: (16, 4, 1024),
        sliding_window: 0,
    },
    Preset {
        name: "gpt-oss-mini",
        family: "gpt_oss",
        hidden: 256,
        layers: 4,
        heads: 8,
        kv_heads: 1,
        head_dim: 32,
        intermediate: 256,
        vocab: 4096,
        max_seq: 1024,
        rope_theta: 150_000.0,
        rms_norm_eps: 1e-5,
        llama3_scaling: None,
        dtype: "bf16",
        tokenizer: "spm",
        experts: (32, 4, 256),
        sliding_window: 128,
    },
];

/// The preset of this name.
///
/// # Errors
/// [`base::error::ErrorKind::Usage`] for an unknown name, listing the known ones.
pub fn preset(name: &str) -> Result<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        Error::usage(format!(
            "unknown preset `{name}`; synth knows: {}",
            PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
        ))
    })
}
