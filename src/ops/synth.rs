//! synth: a random-weight Hugging Face checkpoint of any covered family (config.json with the family's
//! real architectures, model_type and feature keys; generation_config.json; the weights in F32, BF16
//! or F16, in one model.safetensors or N shards with model.safetensors.index.json; a tokenizer.json
//! covering every token id: SentencePiece-style, or a byte-level BPE trained with HF `tokenizers`'
//! trainer). Small by default, for testing the oracle and engines of families whose real checkpoints
//! are large; or in a real model's shape ([`PRESETS`], up to Llama 3.2 1B), for speed and scale work.
//! Sizes are checked before anything is written; weights are drawn and written tensor by tensor (never
//! the whole model in memory); the checkpoint goes into a temporary directory beside `out` and is
//! renamed into place.
//!
//! The five built-in families (`FAMILIES`) have hand-written configs. Any other family is written from
//! its model contract (an established one or a staged candidate, see [`synth_in`]): config.json from
//! the contract's `architectures`, `model_types` and `config` keys, tensors from its `features`
//! (e.g. `fused_qkv` writes one `qkv_proj` tensor in place of q/k/v).

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::Report;
use crate::error::{Error, Result};

/// Families `synth` can write, by short name.
pub const FAMILIES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma"];

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
    },
];

/// The preset of this name.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] for an unknown name, listing the known ones.
pub fn preset(name: &str) -> Result<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        Error::usage(format!(
            "unknown preset `{name}`; synth knows: {}",
            PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// Sizes and family of the checkpoint to write. Unset sizes take the preset's values, or small
/// defaults without a preset.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct SynthRequest {
    /// Family: llama, mistral, qwen2, qwen3 or gemma (a `model.` prefix is accepted). May be empty with
    /// a preset, which sets llama.
    #[serde(default)]
    pub family: String,
    /// A named shape from [`PRESETS`] (`stories15m`, `stories42m`, `stories110m`); explicit sizes
    /// override its values.
    #[serde(default)]
    pub preset: Option<String>,
    /// Directory to create; must not exist or be empty.
    pub out: PathBuf,
    /// Seed of the weights.
    #[serde(default)]
    pub seed: u64,
    /// hidden_size (default 64).
    #[serde(default)]
    pub hidden: Option<usize>,
    /// num_hidden_layers (default 2).
    #[serde(default)]
    pub layers: Option<usize>,
    /// num_attention_heads (default 4).
    #[serde(default)]
    pub heads: Option<usize>,
    /// num_key_value_heads (default 2).
    #[serde(default)]
    pub kv_heads: Option<usize>,
    /// head_dim (default hidden / heads); written to config.json for qwen3, gemma and llama.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// vocab_size (default 128; at least 8).
    #[serde(default)]
    pub vocab: Option<usize>,
    /// intermediate_size (default 2 * hidden + 32).
    #[serde(default)]
    pub intermediate: Option<usize>,
    /// max_position_embeddings (default 64).
    #[serde(default)]
    pub max_seq: Option<usize>,
    /// mistral: sliding_window (default 8).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Mixture-of-experts families: the expert count (num_local_experts; default the family's
    /// example, 4).
    #[serde(default)]
    pub experts: Option<usize>,
    /// Mixture-of-experts families: experts per token (num_experts_per_tok; default the family's
    /// example or default, 2).
    #[serde(default)]
    pub experts_per_token: Option<usize>,
    /// Mixture-of-experts families whose experts have their own width (Qwen3-MoE's
    /// moe_intermediate_size; Mixtral's experts are intermediate_size wide).
    #[serde(default)]
    pub expert_intermediate: Option<usize>,
    /// Stored weight dtype: `f32`, `bf16` or `f16` (default the preset's, else f32). Values are drawn
    /// in f32 and rounded to nearest even.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Weight files: 1 writes model.safetensors; N > 1 writes model-0000i-of-0000N.safetensors of about
    /// equal size and model.safetensors.index.json (default 1).
    #[serde(default)]
    pub shards: Option<usize>,
    /// Tokenizer: `spm` (SentencePiece-style, character merges) or `bytelevel` (a byte-level BPE
    /// trained on generated text, with special tokens; Llama 3's split pattern and template for llama,
    /// Qwen2's and NFC for qwen families). Default the preset's, else spm.
    #[serde(default)]
    pub tokenizer: Option<String>,
}

/// How a synthetic checkpoint is stored: weight dtype, number of weight files, tokenizer kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Storage {
    /// `f32`, `bf16` or `f16`.
    pub dtype: String,
    /// Number of weight files (1: model.safetensors).
    pub shards: usize,
    /// `spm` or `bytelevel`.
    pub tokenizer: String,
}

impl Default for Storage {
    fn default() -> Storage {
        Storage { dtype: "f32".into(), shards: 1, tokenizer: "spm".into() }
    }
}

impl Storage {
    /// The storage a request asks for (its preset's where it says nothing), checked.
    ///
    /// # Errors
    /// [`crate::error::ErrorKind::Usage`] naming the flag: an unknown dtype or tokenizer, zero shards.
    pub fn of(req: &SynthRequest) -> Result<Storage> {
        let preset = req.preset.as_deref().map(preset).transpose()?;
        let dtype = req.dtype.clone().or(preset.map(|p| p.dtype.to_string())).unwrap_or_else(|| "f32".into());
        if !["f32", "bf16", "f16"].contains(&dtype.as_str()) {
            return Err(Error::usage(format!("--dtype {dtype}: synth stores f32, bf16 or f16")));
        }
        let shards = req.shards.unwrap_or(1);
        if !(1..=999).contains(&shards) {
            return Err(Error::usage(format!("--shards {shards} must be in 1..=999")));
        }
        let tokenizer =
            req.tokenizer.clone().or(preset.map(|p| p.tokenizer.to_string())).unwrap_or_else(|| "spm".into());
        if !["spm", "bytelevel"].contains(&tokenizer.as_str()) {
            return Err(Error::usage(format!("--tokenizer {tokenizer}: synth writes spm or bytelevel")));
        }
        Ok(Storage { dtype, shards, tokenizer })
    }

    /// Bytes per stored weight.
    pub fn bytes_per_weight(&self) -> usize {
        if self.dtype == "f32" { 4 } else { 2 }
    }

    /// config.json's `torch_dtype` for this storage.
    pub fn torch_dtype(&self) -> &'static str {
        match self.dtype.as_str() {
            "bf16" => "bfloat16",
            "f16" => "float16",
            _ => "float32",
        }
    }
}

/// What was written.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct SynthReport {
    /// The checkpoint directory.
    pub dir: String,
    /// Family short name.
    pub family: String,
    /// The config.json written.
    pub config: serde_json::Value,
    /// Number of tensors in model.safetensors.
    pub tensors: usize,
    /// Number of parameters.
    pub parameters: usize,
}

impl Report for SynthReport {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        format!(
            "wrote {} checkpoint to {}: {} tensors, {} parameters\n",
            self.family, self.dir, self.tensors, self.parameters
        )
    }
}

/// Largest checkpoint `synth` writes, in bytes of stored weights (8 GB, decimal): Llama 3.2 1B in
/// BF16 is 2.5 GB, in F32 4.9 GB; weights are streamed to disk tensor by tensor, so memory holds one
/// tensor at a time.
pub const MAX_BYTES: usize = 8_000_000_000;

/// Largest parameter count `synth` writes: [`MAX_BYTES`] of F32 (4 bytes each); at BF16/F16 twice as many.
pub const MAX_PARAMETERS: usize = MAX_BYTES / 4;

/// The config.json of a synthetic checkpoint, checked for sizes that make no sense.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] for an unknown family or preset, a family other than llama with a
/// preset, or absurd sizes (zero, too large, heads that do not divide, a checkpoint over
/// [`MAX_BYTES`]), saying which flag to change.
pub fn synth_config(req: &SynthRequest) -> Result<serde_json::Value> {
    let preset = req.preset.as_deref().map(preset).transpose()?;
    let family = req.family.strip_prefix("model.").unwrap_or(&req.family);
    let family = match (preset, family) {
        (Some(p), "") => p.family,
        (Some(p), f) if f == p.family => p.family,
        (Some(p), other) => {
            return Err(Error::usage(format!(
                "--preset {} is a {} shape and conflicts with --family {other}; drop --family or pass --family {}",
                p.name, p.family, p.family
            )));
        }
        (None, "") => {
            return Err(Error::usage(format!(
                "pass --family ({}) or --preset ({})",
                FAMILIES.join(", "),
                PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
            )));
        }
        (None, f) => f,
    };
    if !FAMILIES.contains(&family) {
        return Err(Error::usage(format!("unknown family `{}`; synth writes: {}", req.family, FAMILIES.join(", "))));
    }
    let storage = Storage::of(req)?;
    let tied = preset.is_some() || matches!(family, "qwen2" | "qwen3" | "gemma");
    let Sizes { hidden, layers, heads, kv, head_dim, vocab, inter, max_seq } =
        sizes(req, preset, tied, family, storage.bytes_per_weight())?;
    let check = |ok: bool, msg: String| if ok { Ok(()) } else { Err(Error::usage(msg)) };
    let specials = special_ids(&storage.tokenizer, family, vocab)?;
    let (arch, theta) = match family {
        "llama" => ("LlamaForCausalLM", 10_000.0),
        "mistral" => ("MistralForCausalLM", 10_000.0),
        "qwen2" => ("Qwen2ForCausalLM", 1_000_000.0),
        "qwen3" => ("Qwen3ForCausalLM", 1_000_000.0),
        _ => ("GemmaForCausalLM", 10_000.0),
    };
    let mut c = json!({
        "architectures": [arch],
        "model_type": family,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_seq,
        "rms_norm_eps": preset.map_or(1e-6, |p| p.rms_norm_eps),
        "rope_theta": preset.map_or(theta, |p| p.rope_theta),
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": specials.bos,
        "eos_token_id": specials.eos,
        "torch_dtype": storage.torch_dtype(),
    });
    let o = c.as_object_mut().expect("an object");
    if let Some((factor, low, high, orig)) = preset.and_then(|p| p.llama3_scaling) {
        o.insert(
            "rope_scaling".into(),
            json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": orig}),
        );
    }
    match family {
        "mistral" => {
            let w = req.sliding_window.unwrap_or(8);
            check(w >= 1, "--sliding-window must be at least 1".into())?;
            o.insert("sliding_window".into(), json!(w));
        }
        "qwen2" => {
            o.insert("use_sliding_window".into(), json!(false));
            o.insert("sliding_window".into(), json!(max_seq));
            o.insert("max_window_layers".into(), json!(layers));
        }
        "qwen3" => {
            o.insert("attention_bias".into(), json!(false));
            o.insert("use_sliding_window".into(), json!(false));
            o.insert("sliding_window".into(), serde_json::Value::Null);
        }
        "gemma" => {
            o.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
            o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            o.insert("attention_bias".into(), json!(false));
        }
        _ => {}
    }
    Ok(c)
}

/// Parameters of a checkpoint of these sizes, as [`synth_tensors`] writes it: per layer the q/k/v/o
/// projections, the three MLP matrices and two norms (plus qwen2's q/k/v biases and qwen3's q/k norms),
/// then the embedding, the final norm and, unless `tied`, lm_head.
#[allow(clippy::too_many_arguments)]
pub fn parameter_count(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
    tied: bool,
    family: &str,
) -> usize {
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let extra = match family {
        "qwen2" => q + 2 * kv,
        "qwen3" => 2 * head_dim,
        _ => 0,
    };
    let per_layer = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden + extra;
    layers * per_layer + vocab * hidden * if tied { 1 } else { 2 } + hidden
}

/// Standard normal draws (Box-Muller) scaled by `std`, around `mean`.
fn normal(rng: &mut rand_chacha::ChaCha8Rng, n: usize, mean: f32, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            let u2: f64 = rng.random::<f64>();
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            mean + std * z as f32
        })
        .collect()
}

/// The tensors of a synthetic checkpoint for `config` (as [`synth_config`] writes it) of a built-in
/// family: [`synth_tensors_with`] with the features of its model_type ([`builtin_features`]).
///
/// # Panics
/// When `config` lacks a size key (it comes from [`synth_config`]).
pub fn synth_tensors(config: &serde_json::Value, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let features = builtin_features(config["model_type"].as_str().unwrap_or("llama"));
    synth_tensors_with(config, &features, seed)
}

/// The tensors of a synthetic checkpoint for `config` and the family's `features`: name, shape, values.
/// Projections are N(0, 1/fan_in) so activations keep their scale through the layers; the embedding is
/// N(0, 0.2^2), so that logits spread over a few units; norm weights are near one (near zero with
/// `rmsnorm_one_plus_w`, Gemma's `1 + w`); biases (`qkv_bias`) are N(0, 0.25); `qk_norm` adds the
/// per-head norm weights. `fused_qkv` writes q, k and v (drawn as without it) as the row blocks of one
/// `self_attn.qkv_proj.weight` [(n_heads + 2 n_kv_heads) head_dim, hidden] (and biases as one
/// `qkv_proj.bias`); `fused_gate_up` writes gate and up as one `mlp.gate_up_proj.weight`
/// [2 intermediate, hidden]. So a fused checkpoint holds the same numbers as the unfused one of the
/// same seed. Holds every value at once: for large checkpoints [`write_checkpoint_opts`] streams the
/// same values tensor by tensor.
///
/// # Panics
/// When `config` lacks a size key (it comes from [`synth_config`] or [`synth_config_for`]).
pub fn synth_tensors_with(
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let plan = tensor_plan(config, features);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    plan.into_iter()
        .map(|t| {
            let values = t.draw(&mut rng);
            (t.name, t.shape, values)
        })
        .collect()
}

/// One tensor of a synthetic checkpoint: its name and shape, and the normal draws (count, mean, std)
/// whose values it holds, in order (a fused tensor holds several).
#[derive(Debug, Clone, PartialEq)]
struct PlannedTensor {
    name: String,
    shape: Vec<usize>,
    draws: Vec<(usize, f32, f32)>,
}

impl PlannedTensor {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// The values, drawn from `rng` in plan order (so a streamed checkpoint equals the in-memory one).
    fn draw(&self, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.len());
        for &(n, mean, std) in &self.draws {
            v.extend(normal(rng, n, mean, std));
        }
        v
    }
}

/// The tensors of a checkpoint in draw order, without their values (see [`synth_tensors_with`]).
fn tensor_plan(config: &serde_json::Value, features: &[String]) -> Vec<PlannedTensor> {
    let has = |f: &str| features.iter().any(|x| x == f);
    let u = |k: &str| config[k].as_u64().unwrap_or_else(|| panic!("config has {k}")) as usize;
    let (h, ff, nl, nh, nkv, hd, vocab) = (
        u("hidden_size"),
        u("intermediate_size"),
        u("num_hidden_layers"),
        u("num_attention_heads"),
        config["num_key_value_heads"].as_u64().map_or(u("num_attention_heads"), |v| v as usize),
        config["head_dim"].as_u64().map_or(u("hidden_size") / u("num_attention_heads"), |v| v as usize),
        u("vocab_size"),
    );
    let tied = config["tie_word_embeddings"].as_bool().unwrap_or(false);
    let norm_mean = if has("rmsnorm_one_plus_w") { 0.0 } else { 1.0 };
    let mut out: Vec<PlannedTensor> = Vec::new();
    let push = |out: &mut Vec<PlannedTensor>, name: String, shape: Vec<usize>, mean: f32, std: f32| {
        let n = shape.iter().product();
        out.push(PlannedTensor { name, shape, draws: vec![(n, mean, std)] });
    };
    // Replace the last `n` tensors by one with their rows stacked in order.
    let fuse = |out: &mut Vec<PlannedTensor>, n: usize, name: String| {
        let parts = out.split_off(out.len() - n);
        let cols: usize = parts[0].shape[1..].iter().product();
        let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
        let shape = if parts[0].shape.len() == 1 { vec![rows] } else { vec![rows, cols] };
        out.push(PlannedTensor { name, shape, draws: parts.into_iter().flat_map(|p| p.draws).collect() });
    };
    let proj = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    push(&mut out, "model.embed_tokens.weight".into(), vec![vocab, h], 0.0, 0.2);
    for i in 0..nl {
        let p = format!("model.layers.{i}.");
        push(&mut out, format!("{p}input_layernorm.weight"), vec![h], norm_mean, 0.1);
        push(&mut out, format!("{p}self_attn.q_proj.weight"), vec![nh * hd, h], 0.0, proj(h));
        push(&mut out, format!("{p}self_attn.k_proj.weight"), vec![nkv * hd, h], 0.0, proj(h));
        push(&mut out, format!("{p}self_attn.v_proj.weight"), vec![nkv * hd, h], 0.0, proj(h));
        if has("fused_qkv") {
            fuse(&mut out, 3, format!("{p}self_attn.qkv_proj.weight"));
        }
        if has("qkv_bias") {
            push(&mut out, format!("{p}self_attn.q_proj.bias"), vec![nh * hd], 0.0, 0.5);
            push(&mut out, format!("{p}self_attn.k_proj.bias"), vec![nkv * hd], 0.0, 0.5);
            push(&mut out, format!("{p}self_attn.v_proj.bias"), vec![nkv * hd], 0.0, 0.5);
            if has("fused_qkv") {
                fuse(&mut out, 3, format!("{p}self_attn.qkv_proj.bias"));
            }
        }
        if has("qk_norm") {
            push(&mut out, format!("{p}self_attn.q_norm.weight"), vec![hd], 1.0, 0.3);
            push(&mut out, format!("{p}self_attn.k_norm.weight"), vec![hd], 1.0, 0.3);
        }
        push(&mut out, format!("{p}self_attn.o_proj.weight"), vec![h, nh * hd], 0.0, proj(nh * hd));
        push(&mut out, format!("{p}post_attention_layernorm.weight"), vec![h], norm_mean, 0.1);
        push(&mut out, format!("{p}mlp.gate_proj.weight"), vec![ff, h], 0.0, proj(h));
        push(&mut out, format!("{p}mlp.up_proj.weight"), vec![ff, h], 0.0, proj(h));
        if has("fused_gate_up") {
            fuse(&mut out, 2, format!("{p}mlp.gate_up_proj.weight"));
        }
        push(&mut out, format!("{p}mlp.down_proj.weight"), vec![h, ff], 0.0, proj(ff));
    }
    push(&mut out, "model.norm.weight".into(), vec![h], norm_mean, 0.1);
    if !tied {
        push(&mut out, "lm_head.weight".into(), vec![vocab, h], 0.0, 0.2);
    }
    out
}

/// The tensors of a checkpoint of `contract`'s family for `config`, from its graph's weight
/// bindings (`[model.graph]`), in draw order, without their values: every `[[model.weights]]`
/// tensor a node reads (the `tied` alternative's own tensor only when config.json does not tie),
/// non-layer tensors declared before the first `{i}` one, then each layer's in declaration order,
/// then the rest; shapes from the declared shapes at the resolved config. Draws follow what each
/// tensor is to its node, with the figures of [`synth_tensors_with`]: an embedding table or the
/// logits' projection N(0, 0.2^2); a linear weight N(0, 1/columns), a row block of a fused tensor
/// drawn as its own tensor; a bias N(0, 0.25); an RMSNorm gain near one (std 0.1 over hidden, 0.3
/// over a head or projection), near zero with `gain = one_plus_w`. For the built-in families this
/// is the plan [`synth_tensors_with`] writes from their features (unit test).
///
/// # Errors
/// Usage when the contract is not a model family with a graph, or `config` does not resolve.
fn graph_plan(contract: &crate::ckb::Contract, config: &serde_json::Value) -> Result<Vec<PlannedTensor>> {
    let family =
        contract.model.as_ref().ok_or_else(|| Error::usage(format!("{} is not a model family", contract.id)))?;
    let graph = family
        .graph
        .as_ref()
        .ok_or_else(|| Error::usage(format!("{} has no [model.graph] to write a checkpoint from", contract.id)))?;
    let map = config.as_object().ok_or_else(|| Error::usage("config.json is not an object"))?;
    let cfg = crate::model::resolve(contract, map).map_err(|gaps| {
        Error::usage(format!(
            "the config does not resolve against {}: {}",
            contract.id,
            gaps.iter().map(|g| format!("{}: {}", g.field, g.reason)).collect::<Vec<_>>().join("; ")
        ))
    })?;
    let role = |r: &str| crate::oracle::graph::config_role(&cfg, r);
    // tensor pattern -> the draws of its row blocks, in node order (row offset, rows or all, mean, std).
    type RowBlocks = Vec<(usize, Option<usize>, f32, f32)>;
    let mut uses: std::collections::BTreeMap<&str, RowBlocks> = Default::default();
    // Expert weight pattern (`{e}`) -> the expert count of the moe_experts node binding it.
    let mut experts: std::collections::BTreeMap<&str, usize> = Default::default();
    let last = graph.epilogue.last().map(|n| n.name.as_str());
    for (block, nodes) in [("prologue", &graph.prologue), ("layer", &graph.layer), ("epilogue", &graph.epilogue)] {
        for n in nodes.iter() {
            let param = |k: &str| -> Result<Option<usize>> {
                n.params
                    .get(k)
                    .map(|e| crate::ckb::graph::eval_expr(e, &role).map(|v| v as usize))
                    .transpose()
                    .map_err(|m| Error::usage(format!("node `{}`: parameter `{k}`: {m}", n.name)))
            };
            for (slot, pattern) in &n.weights {
                if slot == "weight" && n.weights.contains_key("tied") && cfg.tied {
                    continue;
                }
                let shape = family.weights.iter().find(|w| &w.name == pattern).map(|w| w.shape.as_slice());
                let cols = shape.and_then(|s| s.get(1)).and_then(|d| crate::ckb::graph::eval_expr(d, &role).ok());
                let (mean, std) = match (n.op.as_str(), slot.as_str()) {
                    ("embedding", _) => (0.0, 0.2),
                    (_, "tied") => continue,
                    (_, "bias") => (0.0, 0.5),
                    ("rms_norm", _) => {
                        let mean = if n.params.get("gain").is_some_and(|g| g == "one_plus_w") { 0.0 } else { 1.0 };
                        let over_hidden = shape.is_some_and(|s| s.len() == 1 && s[0].trim() == "hidden");
                        (mean, if over_hidden { 0.1 } else { 0.3 })
                    }
                    _ if block == "epilogue" && Some(n.name.as_str()) == last => (0.0, 0.2),
                    _ => (0.0, 1.0 / (cols.unwrap_or(1.0) as f32).sqrt()),
                };
                if n.op == "moe_experts" {
                    experts.insert(pattern.as_str(), param("experts")?.unwrap_or(0));
                }
                let rows = param("rows")?;
                let offset = param("row_offset")?.unwrap_or(0);
                let entry = uses.entry(pattern.as_str()).or_default();
                if !entry.iter().any(|u| u.0 == offset) {
                    entry.push((offset, rows, mean, std));
                }
            }
        }
    }
    let first_layer = family.weights.iter().position(|w| w.name.contains("{i}")).unwrap_or(family.weights.len());
    let order: Vec<(&crate::ckb::WeightSpec, Option<usize>)> = family.weights[..first_layer]
        .iter()
        .filter(|w| !w.name.contains("{i}"))
        .map(|w| (w, None))
        .chain(
            (0..cfg.n_layers)
                .flat_map(|i| family.weights.iter().filter(|w| w.name.contains("{i}")).map(move |w| (w, Some(i)))),
        )
        .chain(family.weights[first_layer..].iter().filter(|w| !w.name.contains("{i}")).map(|w| (w, None)))
        .collect();
    let mut out = Vec::new();
    for (w, layer) in order {
        let Some(blocks) = uses.get(w.name.as_str()) else { continue };
        let shape: Vec<usize> = w
            .shape
            .iter()
            .map(|d| crate::ckb::graph::eval_expr(d, &role).map(|v| v as usize))
            .collect::<std::result::Result<_, _>>()
            .map_err(|m| Error::usage(format!("{}: shape of `{}`: {m}", contract.id, w.name)))?;
        let total = shape.first().copied().unwrap_or(1);
        let per_row: usize = shape[1..].iter().product();
        let mut blocks = blocks.clone();
        blocks.sort_by_key(|b| b.0);
        let draws_of = |blocks: &[(usize, Option<usize>, f32, f32)]| -> Vec<(usize, f32, f32)> {
            blocks
                .iter()
                .map(|&(offset, rows, mean, std)| (rows.unwrap_or(total - offset.min(total)) * per_row, mean, std))
                .collect()
        };
        let name = layer.map_or(w.name.clone(), |i| w.name.replace("{i}", &i.to_string()));
        match experts.get(w.name.as_str()) {
            // One tensor per expert, in expert order.
            Some(&count) => out.extend((0..count).map(|e| PlannedTensor {
                name: name.replace("{e}", &e.to_string()),
                shape: shape.clone(),
                draws: draws_of(&blocks),
            })),
            None => out.push(PlannedTensor { name, shape, draws: draws_of(&blocks) }),
        }
    }
    Ok(out)
}

/// A BPE tokenizer.json in the layout of the BabyLlama checkpoint with exactly `vocab` entries, so
/// that every token id a model of that vocabulary can produce decodes: `<unk>`, `<s>`, `</s>`, `▁`
/// (space), then printable ASCII characters, as many as `vocab` leaves room for (character-level up to
/// 79 entries); beyond that, merged tokens fill the vocabulary, shortest first: a token of the previous
/// length (`▁` or a character to start with) followed by a character, each with its merge `"left right"`
/// in that order of rank. A 32000 vocabulary holds the 79 specials and characters, 5700 two-character
/// tokens and 26221 three-character ones (31921 merges).
pub fn synth_tokenizer(vocab: usize) -> serde_json::Value {
    const CHARS: &str = "etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ.,!?'\"-:;0123456789()";
    let mut entries: Vec<String> = ["<unk>", "<s>", "</s>", "\u{2581}"].iter().map(|s| s.to_string()).collect();
    entries.extend(CHARS.chars().map(|c| c.to_string()).take(vocab.saturating_sub(4)));
    let mut merges: Vec<String> = Vec::new();
    let mut known: std::collections::HashSet<String> = entries.iter().cloned().collect();
    let mut frontier: Vec<String> = entries[3.min(entries.len())..].to_vec();
    'fill: while entries.len() < vocab && !frontier.is_empty() {
        let mut next = Vec::new();
        for left in &frontier {
            for right in CHARS.chars() {
                if entries.len() >= vocab {
                    break 'fill;
                }
                let token = format!("{left}{right}");
                if known.insert(token.clone()) {
                    merges.push(format!("{left} {right}"));
                    entries.push(token.clone());
                    next.push(token);
                }
            }
        }
        frontier = next;
    }
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        entries.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let special = |id: usize, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_map, "merges": merges
        }
    })
}

/// Write `config` (possibly edited after [`synth_config`]), its tensors and a tokenizer into `out`,
/// atomically: everything goes to a temporary directory beside `out`, which is then renamed.
///
/// # Errors
/// When `out` exists and is not an empty directory, or a file cannot be written.
pub fn write_checkpoint(out: &Path, config: &serde_json::Value, seed: u64) -> Result<SynthReport> {
    let features = builtin_features(config["model_type"].as_str().unwrap_or("llama"));
    write_checkpoint_with(out, config, &features, seed)
}

/// As [`write_checkpoint`], with the tensors of a family with these `features` ([`synth_tensors_with`]).
///
/// # Errors
/// As [`write_checkpoint`].
pub fn write_checkpoint_with(
    out: &Path,
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
) -> Result<SynthReport> {
    write_checkpoint_opts(out, config, features, seed, &Storage::default())
}

/// As [`write_checkpoint_with`], stored as `storage` says: weights rounded to its dtype (nearest even)
/// in one file or `shards` files with an index, its tokenizer kind, and generation_config.json (the
/// config's bos and eos ids; the qwen families stop at `<|im_end|>` and `<|endoftext|>`). Tensors are
/// drawn and written one at a time, so memory holds one tensor however large the model.
///
/// # Errors
/// As [`write_checkpoint`]; more shards than tensors.
pub fn write_checkpoint_opts(
    out: &Path,
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
    storage: &Storage,
) -> Result<SynthReport> {
    write_planned(out, config, tensor_plan(config, features), seed, storage)
}

/// Write the checkpoint of `plan` (see [`write_checkpoint_opts`]).
fn write_planned(
    out: &Path,
    config: &serde_json::Value,
    plan: Vec<PlannedTensor>,
    seed: u64,
    storage: &Storage,
) -> Result<SynthReport> {
    if out.exists() {
        let empty = out.is_dir() && std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty {
            return Err(Error::usage(format!(
                "{} exists and is not an empty directory; pass a new --out",
                out.display()
            )));
        }
    }
    let params: usize = plan.iter().map(PlannedTensor::len).sum();
    if params.saturating_mul(storage.bytes_per_weight()) > MAX_BYTES {
        return Err(Error::usage(format!(
            "the checkpoint would hold {params} parameters, {:.2} GB of weights at {} bytes each, more than synth writes ({} GB); \
             choose smaller sizes (--hidden, --layers, --intermediate, --vocab, and for a mixture of experts --experts or --expert-intermediate) or --dtype bf16",
            (params * storage.bytes_per_weight()) as f64 / 1e9,
            storage.bytes_per_weight(),
            MAX_BYTES / 1_000_000_000
        )));
    }
    if storage.shards > plan.len() {
        return Err(Error::usage(format!(
            "--shards {} exceeds the checkpoint's {} tensors; every shard holds at least one",
            storage.shards,
            plan.len()
        )));
    }
    let vocab = config["vocab_size"].as_u64().unwrap_or(0) as usize;
    let model_type = config["model_type"].as_str().unwrap_or("llama");
    // The tokenizer first: training a large byte-level vocabulary is the other slow part, and a
    // failure should come before gigabytes are written.
    let tokenizer = match storage.tokenizer.as_str() {
        "bytelevel" => synth_bytelevel_tokenizer(vocab, bytelevel_style(model_type), seed)?,
        _ => synth_tokenizer(vocab),
    };
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::input(format!("cannot create {}: {e}", parent.display())))?;
    let io = |what: &Path, e: std::io::Error| Error::input(format!("cannot write {}: {e}", what.display()));
    // The parent resolved once: every later step goes through its handle (`/proc/self/fd/N`), so a
    // directory swapped for a symlink meanwhile cannot redirect the checkpoint.
    let held = crate::beneath::Dir::open(&parent)?;
    let name = out.file_name().ok_or_else(|| Error::usage(format!("{}: not a directory name", out.display())))?;
    let (parent, out_at) = (held.fd_path(), held.fd_path().join(name));
    let tmp = tempfile::Builder::new().prefix(".synth-").tempdir_in(&parent).map_err(|e| io(&parent, e))?;
    let mut config = config.clone();
    config["torch_dtype"] = json!(storage.torch_dtype());
    let cfg_text = serde_json::to_string_pretty(&config).expect("json serialises");
    std::fs::write(tmp.path().join("config.json"), cfg_text).map_err(|e| io(out, e))?;
    let mut generation = serde_json::Map::new();
    generation.insert("bos_token_id".into(), config["bos_token_id"].clone());
    let eos = match (model_type, storage.tokenizer.as_str(), config["eos_token_id"].as_u64()) {
        // Qwen's generation_config.json lists <|im_end|> and <|endoftext|>.
        ("qwen2" | "qwen3", "bytelevel", Some(e)) => json!([e, e.saturating_sub(2)]),
        _ => config["eos_token_id"].clone(),
    };
    generation.insert("eos_token_id".into(), eos);
    std::fs::write(
        tmp.path().join("generation_config.json"),
        serde_json::to_string_pretty(&generation).expect("json serialises"),
    )
    .map_err(|e| io(out, e))?;
    let tok = serde_json::to_string_pretty(&tokenizer).expect("json serialises");
    std::fs::write(tmp.path().join("tokenizer.json"), tok).map_err(|e| io(out, e))?;
    let parameters = write_weights(tmp.path(), &plan, seed, storage)?;
    if std::fs::symlink_metadata(&out_at).is_ok() {
        std::fs::remove_dir(&out_at).map_err(|e| io(out, e))?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, &out_at).map_err(|e| {
        let _ = std::fs::remove_dir_all(&kept);
        io(out, e)
    })?;
    Ok(SynthReport {
        dir: out.display().to_string(),
        family: config["model_type"].as_str().unwrap_or_default().into(),
        config,
        tensors: plan.len(),
        parameters,
    })
}

/// The stored bytes of f32 values at `dtype`: F32 as is, BF16 and F16 rounded to nearest even.
fn stored_bytes(values: &[f32], dtype: &str) -> Vec<u8> {
    match dtype {
        "bf16" => values.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        "f16" => values.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Write the planned tensors into `dir`: model.safetensors, or `storage.shards` files
/// `model-0000i-of-0000N.safetensors` of about equal size (tensors in draw order, never split) plus
/// model.safetensors.index.json. Each file's header is written first (sizes are known from the
/// plan), then each tensor at its offset as it is drawn. Returns the parameter count.
fn write_weights(dir: &Path, plan: &[PlannedTensor], seed: u64, storage: &Storage) -> Result<usize> {
    use std::os::unix::fs::FileExt;
    let (dtype_name, width) = match storage.dtype.as_str() {
        "bf16" => ("BF16", 2),
        "f16" => ("F16", 2),
        _ => ("F32", 4),
    };
    let total: usize = plan.iter().map(|t| t.len() * width).sum();
    // Shard boundaries: a tensor goes to the shard where its first byte falls, tensors in order,
    // shards filled one after the other; late tensors move on early enough that no shard stays empty.
    let n = storage.shards;
    let mut groups: Vec<Vec<&PlannedTensor>> = vec![Vec::new(); n];
    let (mut shard, mut start) = (0usize, 0usize);
    for (i, t) in plan.iter().enumerate() {
        let must = n.saturating_sub(plan.len() - i);
        let want = (start * n / total.max(1)).min(n - 1).max(must);
        if want > shard && !groups[shard].is_empty() {
            shard += 1;
        }
        groups[shard].push(t);
        start += t.len() * width;
    }
    let names: Vec<String> = if n == 1 {
        vec![crate::model::weights::SINGLE_FILE.to_string()]
    } else {
        (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect()
    };
    let st_dtype = match dtype_name {
        "BF16" => safetensors::Dtype::BF16,
        "F16" => safetensors::Dtype::F16,
        _ => safetensors::Dtype::F32,
    };
    // Each file's header is what the safetensors writer makes of the same tensors (sorted by name,
    // offsets in that order, padded to 8 bytes), so a single F32 file is byte for byte what
    // `safetensors::serialize_to_file` writes; the data is then written at its offsets as drawn.
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    for (name, group) in names.iter().zip(&groups) {
        let path = dir.join(name);
        let mut sorted: Vec<&PlannedTensor> = group.clone();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        let mut offset = 0usize;
        let mut infos = Vec::new();
        let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for t in &sorted {
            let bytes = t.len() * width;
            infos.push((
                t.name.clone(),
                safetensors::tensor::TensorInfo {
                    dtype: st_dtype,
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + bytes),
                },
            ));
            at.insert(t.name.as_str(), offset);
            offset += bytes;
            weight_map.insert(t.name.clone(), json!(name));
        }
        let meta = safetensors::tensor::Metadata::new(None, infos)
            .map_err(|e| Error::internal(format!("{}: header: {e}", path.display())))?;
        let mut header = serde_json::to_vec(&meta).expect("a safetensors header serialises");
        header.resize(header.len().next_multiple_of(8), b' ');
        let io = |e: std::io::Error| Error::input(format!("cannot write {}: {e}", path.display()));
        let f = std::fs::File::create(&path).map_err(io)?;
        let data_start = 8 + header.len();
        f.set_len((data_start + offset) as u64).map_err(io)?;
        f.write_all_at(&(header.len() as u64).to_le_bytes(), 0).map_err(io)?;
        f.write_all_at(&header, 8).map_err(io)?;
        files.push((f, data_start, at));
    }
    // Draw in plan order (the order of the random stream), write where the header put each tensor.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut parameters = 0;
    for (group, (f, data_start, at)) in groups.iter().zip(&files) {
        for t in group {
            let values = t.draw(&mut rng);
            parameters += values.len();
            let off = (data_start + at[t.name.as_str()]) as u64;
            f.write_all_at(&stored_bytes(&values, &storage.dtype), off)
                .map_err(|e| Error::input(format!("cannot write {}: {e}", dir.display())))?;
        }
        f.sync_all().map_err(|e| Error::input(format!("cannot write {}: {e}", dir.display())))?;
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join(crate::model::weights::INDEX_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json serialises"))
            .map_err(|e| Error::input(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(parameters)
}

/// Write a synthetic checkpoint of a built-in family ([`FAMILIES`]) for `req`.
///
/// # Errors
/// As [`synth_config`] and [`write_checkpoint_opts`].
pub fn synth(req: &SynthRequest) -> Result<SynthReport> {
    let config = synth_config(req)?;
    let features = builtin_features(config["model_type"].as_str().unwrap_or("llama"));
    write_checkpoint_opts(&req.out, &config, &features, req.seed, &Storage::of(req)?)
}

/// The bos and eos ids of a synthetic tokenizer.
struct SpecialIds {
    bos: usize,
    eos: usize,
}

/// Special tokens of synth's byte-level tokenizers, placed at the end of the vocabulary as in the
/// real ones. llama3 style (Llama 3's names and order; 256 of them from a 4096 vocabulary on, as in
/// Llama 3's 128000..128256, else the first 10): `<|begin_of_text|>` (BOS), `<|end_of_text|>` (EOS),
/// reserved tokens, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`. qwen2 style (Qwen2's):
/// `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.
fn bytelevel_specials(style: &str, vocab: usize) -> Vec<String> {
    if style == "qwen2" {
        return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].iter().map(|s| s.to_string()).collect();
    }
    let n = if vocab >= 4096 { 256 } else { 10 };
    let mut reserved = 0;
    (0..n)
        .map(|i| match i {
            0 => "<|begin_of_text|>".to_string(),
            1 => "<|end_of_text|>".to_string(),
            6 => "<|start_header_id|>".to_string(),
            7 => "<|end_header_id|>".to_string(),
            9 => "<|eot_id|>".to_string(),
            _ => {
                reserved += 1;
                format!("<|reserved_special_token_{}|>", reserved - 1)
            }
        })
        .collect()
}

/// The byte-level style synth writes for a model_type: qwen2 (Qwen2's split pattern, NFC, no BOS)
/// for the qwen families, llama3 (Llama 3's pattern, ignore_merges, BOS template) otherwise.
fn bytelevel_style(model_type: &str) -> &'static str {
    if model_type.starts_with("qwen") { "qwen2" } else { "llama3" }
}

/// The bos and eos ids a tokenizer kind gives for this family and vocabulary.
fn special_ids(tokenizer: &str, family: &str, vocab: usize) -> Result<SpecialIds> {
    if tokenizer != "bytelevel" {
        return Ok(SpecialIds { bos: 1, eos: 2 });
    }
    let style = bytelevel_style(family);
    let specials = bytelevel_specials(style, vocab);
    let min = 256 + specials.len() + 1;
    if vocab < min {
        return Err(Error::usage(format!(
            "--vocab {vocab} is too small for --tokenizer bytelevel: 256 byte tokens, {} special tokens and at least one merge need {min}",
            specials.len()
        )));
    }
    let first = vocab - specials.len();
    Ok(match style {
        // <|endoftext|> is Qwen's bos_token_id in config.json; generation ends at <|im_end|>.
        "qwen2" => SpecialIds { bos: first, eos: first + 2 },
        _ => SpecialIds { bos: first, eos: first + 1 },
    })
}

/// GPT-2's byte-to-character table (contract component.tokenizer_bytelevel): printable bytes map to
/// themselves, the other 68 to U+0100.. in byte order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).expect("a Latin-1 code point")
        } else {
            next += 1;
            char::from_u32(0x100 + next - 1).expect("a code point below U+0144")
        };
    }
    table
}

/// Words of a generated training text for synth's byte-level BPE: pseudo-words from syllables (some
/// capitalised), numbers, punctuation runs and non-ASCII words (accents, Cyrillic, CJK, emoji), most
/// with a leading space, as the split patterns cut them. `distinct` words, the k-th used about
/// 1 + 400 / (k + 1) times (a Zipf-like frequency), so common merges are learned first.
fn training_words(seed: u64, distinct: usize) -> Vec<(String, u64)> {
    const ONSETS: &[&str] = &[
        "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "ch",
        "sh", "th", "pl", "gr",
    ];
    const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ea", "ou", "ai", "y"];
    const CODAS: &[&str] = &["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st", "nd"];
    const OTHER: &[&str] = &["é", "ü", "ñ", "ß", "ç", "при", "вет", "日本", "中文", "語", "😀", "—", "’", "“", "”"];
    const PUNCT: &[&str] = &[".", ",", "!", "?", ";", ":", "...", "(", ")", "\"", "'", "-", "\n", "\n\n", "  "];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x70_6b_65_6e);
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(distinct);
    let mut tries = 0;
    while out.len() < distinct && tries < distinct * 20 {
        tries += 1;
        let kind = rng.random_range(0..20);
        let mut w = String::new();
        if kind < 15 {
            for _ in 0..rng.random_range(1..=4) {
                w += ONSETS[rng.random_range(0..ONSETS.len())];
                w += VOWELS[rng.random_range(0..VOWELS.len())];
                w += CODAS[rng.random_range(0..CODAS.len())];
            }
            if rng.random_bool(0.15) {
                let mut c = w.chars();
                w = c.next().map(|f| f.to_uppercase().collect::<String>() + c.as_str()).unwrap_or_default();
            }
        } else if kind < 17 {
            w = rng.random_range(0..100_000u32).to_string();
        } else if kind < 18 {
            w = PUNCT[rng.random_range(0..PUNCT.len())].to_string();
        } else {
            for _ in 0..rng.random_range(1..=3) {
                w += OTHER[rng.random_range(0..OTHER.len())];
            }
        }
        if rng.random_bool(0.8) {
            w.insert(0, ' ');
        }
        if seen.insert(w.clone()) {
            let k = out.len() as u64;
            out.push((w, 1 + 400 / (k + 1)));
        }
    }
    out
}

/// A byte-level BPE tokenizer.json with exactly `vocab` entries, trained with HF `tokenizers`' BPE
/// trainer on generated text ([`training_words`]), in the layout of the real ones (contract
/// component.tokenizer_bytelevel): the 256 byte characters, learned merges (completed, if the text
/// offers fewer, by merges of a learned token with a byte character), then the special tokens;
/// `style` llama3 (Llama 3's split pattern from the contract, ignore_merges, a
/// `<|begin_of_text|>` template) or qwen2 (Qwen2's pattern, NFC, no template). Deterministic in
/// `seed`.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] for a vocabulary too small; Internal when training or the
/// check that HF loads the result fails.
pub fn synth_bytelevel_tokenizer(vocab: usize, style: &str, seed: u64) -> Result<serde_json::Value> {
    use tokenizers::Trainer;
    let specials = bytelevel_specials(style, vocab);
    let _ = special_ids("bytelevel", if style == "qwen2" { "qwen2" } else { "llama" }, vocab)?;
    let target = vocab - specials.len();
    let table = byte_chars();
    let map = |w: &str| -> String { w.bytes().map(|b| table[b as usize]).collect() };
    let words = training_words(seed, (target / 3).max(64));
    let mut trainer = tokenizers::models::bpe::BpeTrainerBuilder::new()
        .vocab_size(target)
        .min_frequency(0)
        .show_progress(false)
        .initial_alphabet(table.iter().copied().collect())
        .limit_alphabet(256)
        .build();
    let corpus: Vec<String> = words.iter().map(|(w, _)| map(w)).collect();
    let counts: std::collections::HashMap<&str, u64> =
        corpus.iter().map(String::as_str).zip(words.iter().map(|w| w.1)).collect();
    trainer
        .feed(corpus.iter(), |w| Ok(std::iter::repeat_n(w.to_string(), counts[w] as usize).collect()))
        .map_err(|e| Error::internal(format!("byte-level BPE training: {e}")))?;
    let mut model = tokenizers::models::bpe::BPE::default();
    trainer.train(&mut model).map_err(|e| Error::internal(format!("byte-level BPE training: {e}")))?;
    let trained = serde_json::to_value(&model).map_err(|e| Error::internal(format!("trained model: {e}")))?;
    // Vocabulary in id order, and merges as pairs.
    let mut entries: Vec<(String, u64)> = trained["vocab"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0))).collect())
        .unwrap_or_default();
    entries.sort_by_key(|e| e.1);
    let mut tokens: Vec<String> = entries.into_iter().map(|e| e.0).collect();
    let mut merges: Vec<(String, String)> = trained["merges"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| match m {
                    serde_json::Value::Array(p) => Some((p[0].as_str()?.to_string(), p[1].as_str()?.to_string())),
                    serde_json::Value::String(s) => s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    // Complete the vocabulary where the text offered fewer merges: learned token + byte character.
    let mut known: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut left = 256.min(tokens.len());
    'fill: while tokens.len() < target {
        let base = tokens[left % tokens.len()].clone();
        left += 1;
        for c in table.iter() {
            if tokens.len() >= target {
                break 'fill;
            }
            let t = format!("{base}{c}");
            if known.insert(t.clone()) {
                merges.push((base.clone(), c.to_string()));
                tokens.push(t);
            }
        }
    }
    tokens.truncate(target);
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let merges_json: Vec<serde_json::Value> = merges
        .iter()
        .filter(|(a, b)| known.contains(&format!("{a}{b}")) && vocab_map.contains_key(&format!("{a}{b}")))
        .map(|(a, b)| json!([a, b]))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"id": target + i, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let ckb = crate::ckb::Ckb::embedded().map_err(|e| Error::internal(format!("built-in CKB: {e}")))?;
    let regex = ckb
        .all()
        .filter_map(|c| c.tokenizer.as_ref())
        .flat_map(|t| t.split_patterns.iter())
        .find(|p| p.name == style)
        .map(|p| p.regex.clone())
        .ok_or_else(|| Error::internal(format!("no tokenizer contract has the split pattern `{style}`")))?;
    let byte_level = |prefix: bool, regex: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": !regex || prefix, "use_regex": regex});
    let post = if style == "qwen2" {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true})
    } else {
        let bos = &specials[0];
        json!({"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos.as_str(): {"id": bos, "ids": [target], "tokens": [bos]}}}
        ]})
    };
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": if style == "qwen2" { json!({"type": "NFC"}) } else { serde_json::Value::Null },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false, false)
        ]},
        "post_processor": post,
        "decoder": byte_level(true, true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": style != "qwen2",
            "vocab": vocab_map, "merges": merges_json
        }
    });
    // HF must load it, and it must round-trip text through its own vocabulary.
    let check: tokenizers::Tokenizer = serde_json::from_value(json.clone()).map_err(|e| {
        Error::internal(format!("the synthetic byte-level tokenizer does not load in HF tokenizers: {e}"))
    })?;
    let probe = "Once upon a time, 42 birds said “привет” 😀.\n";
    let ids = check.encode(probe, false).map_err(|e| Error::internal(format!("synthetic tokenizer: {e}")))?;
    let back = check.decode(ids.get_ids(), true).map_err(|e| Error::internal(format!("synthetic tokenizer: {e}")))?;
    if back != probe {
        return Err(Error::internal(format!("the synthetic byte-level tokenizer decodes {probe:?} as {back:?}")));
    }
    Ok(json)
}

/// Checked sizes of a synthetic checkpoint.
struct Sizes {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    vocab: usize,
    inter: usize,
    max_seq: usize,
}

/// The request's sizes, unset ones from the preset or small defaults, checked for values that make
/// no sense and for at most [`MAX_PARAMETERS`] parameters (`tied`: lm_head shares the embedding;
/// `family`: a built-in family's extra tensors, see [`parameter_count`]).
fn sizes(
    req: &SynthRequest,
    preset: Option<&Preset>,
    tied: bool,
    family: &str,
    bytes_per_weight: usize,
) -> Result<Sizes> {
    let hidden = req.hidden.or(preset.map(|p| p.hidden)).unwrap_or(64);
    let layers = req.layers.or(preset.map(|p| p.layers)).unwrap_or(2);
    let heads = req.heads.or(preset.map(|p| p.heads)).unwrap_or(4);
    let kv = req.kv_heads.or(preset.map(|p| p.kv_heads)).unwrap_or(2.min(heads));
    let vocab = req.vocab.or(preset.map(|p| p.vocab)).unwrap_or(128);
    let inter = req.intermediate.or(preset.map(|p| p.intermediate)).unwrap_or(2 * hidden + 32);
    let max_seq = req.max_seq.or(preset.map(|p| p.max_seq)).unwrap_or(64);
    let check = |ok: bool, msg: String| if ok { Ok(()) } else { Err(Error::usage(msg)) };
    check((1..=8192).contains(&hidden), format!("--hidden {hidden} must be in 1..=8192"))?;
    check((1..=64).contains(&layers), format!("--layers {layers} must be in 1..=64"))?;
    check((1..=128).contains(&heads), format!("--heads {heads} must be in 1..=128"))?;
    check(
        kv >= 1 && heads.is_multiple_of(kv),
        format!("--kv-heads {kv} must be at least 1 and divide --heads {heads}"),
    )?;
    check((8..=262_144).contains(&vocab), format!("--vocab {vocab} must be in 8..=262144"))?;
    check((1..=65_536).contains(&inter), format!("--intermediate {inter} must be in 1..=65536"))?;
    check((1..=1_048_576).contains(&max_seq), format!("--max-seq {max_seq} must be in 1..=1048576"))?;
    let head_dim = match req.head_dim.or(preset.map(|p| p.head_dim).filter(|d| *d > 0)) {
        Some(d) => d,
        None => {
            check(
                hidden.is_multiple_of(heads),
                format!("--hidden {hidden} is not a multiple of --heads {heads}; pass --head-dim"),
            )?;
            hidden / heads
        }
    };
    check(
        head_dim >= 2 && head_dim % 2 == 0 && head_dim <= 1024,
        format!("head_dim {head_dim} must be even, in 2..=1024 (RoPE pairs)"),
    )?;
    let params = parameter_count(hidden, layers, heads, kv, head_dim, inter, vocab, tied, family);
    check(
        params.saturating_mul(bytes_per_weight) <= MAX_BYTES,
        format!(
            "the checkpoint would hold {params} parameters, {:.2} GB of weights at {bytes_per_weight} bytes each, more than synth writes ({} GB); \
             choose smaller --hidden, --layers, --intermediate or --vocab (or --dtype bf16)",
            (params * bytes_per_weight) as f64 / 1e9,
            MAX_BYTES / 1_000_000_000
        ),
    )?;
    Ok(Sizes { hidden, layers, heads, kv, head_dim, vocab, inter, max_seq })
}

/// The config.json of a synthetic checkpoint of the family `contract` describes: its first
/// architecture and model_type, and every `config` key with a role synth knows (sizes from the
/// request; epsilon, RoPE base, tying and activation from the contract's defaults and supported
/// values; `sliding_window` and `rope_scaling` null unless asked for; any other key at its
/// `example` value, else its first supported value, else its default). `head_dim` is written only
/// when the contract's default would not give the requested one.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] for absurd sizes (naming the flag), or when the config written
/// does not resolve against the contract (the gaps are listed).
pub fn synth_config_for(contract: &crate::ckb::Contract, req: &SynthRequest) -> Result<serde_json::Value> {
    let m = contract
        .model
        .as_ref()
        .ok_or_else(|| Error::usage(format!("{} is not a model-family contract", contract.id)))?;
    // A literal keeps its written form: "256" is the integer transformers' configuration classes
    // type it as (transformers 5 refuses 256.0 for query_pre_attn_scalar), "10000.0" a float.
    let literal = |d: Option<&str>| -> Option<serde_json::Value> { literal_value(d?) };
    let tied_default = m.config.iter().find(|f| f.role == "tied").and_then(|f| literal(f.default.as_deref()));
    let tied = tied_default.and_then(|v| v.as_bool()).unwrap_or(false);
    let storage = Storage::of(req)?;
    let z = sizes(req, None, tied, "", storage.bytes_per_weight())?;
    let experts = req.experts.unwrap_or(1);
    let bad = |flag: &str, v: usize, range: &str| Err(Error::usage(format!("--{flag} {v} must be in {range}")));
    if !(1..=1024).contains(&experts) {
        return bad("experts", experts, "1..=1024");
    }
    if let Some(k) = req.experts_per_token.filter(|k| !(1..=experts).contains(k)) {
        return bad("experts-per-token", k, &format!("1..=--experts ({experts})"));
    }
    if let Some(w) = req.expert_intermediate.filter(|w| !(1..=65_536).contains(w)) {
        return bad("expert-intermediate", w, "1..=65536");
    }
    let family_name = m.model_types.first().map(String::as_str).unwrap_or_default();
    let specials = special_ids(&storage.tokenizer, family_name, z.vocab)?;
    let mut c = serde_json::Map::new();
    c.insert("architectures".into(), json!([m.architectures.first().cloned().unwrap_or_default()]));
    c.insert("model_type".into(), json!(m.model_types.first().cloned().unwrap_or_default()));
    for f in &m.config {
        let v = match f.role.as_str() {
            "hidden" => json!(z.hidden),
            "intermediate" => json!(z.inter),
            "n_layers" => json!(z.layers),
            "n_heads" => json!(z.heads),
            "n_kv_heads" => json!(z.kv),
            "vocab" => json!(z.vocab),
            "max_seq" => json!(z.max_seq),
            "head_dim" => continue,
            "tied" => json!(tied),
            "activation" => json!(f.supported.first().cloned().or(f.default.clone()).unwrap_or_else(|| "silu".into())),
            "sliding_window" => req.sliding_window.map_or(serde_json::Value::Null, |w| json!(w)),
            "rope_scaling" => serde_json::Value::Null,
            "rms_norm_eps" => literal(f.default.as_deref()).unwrap_or(json!(1e-6)),
            "rope_theta" => literal(f.default.as_deref()).unwrap_or(json!(10_000.0)),
            "n_experts" if req.experts.is_some() => json!(req.experts),
            "n_experts_per_tok" if req.experts_per_token.is_some() => json!(req.experts_per_token),
            "moe_intermediate" if req.expert_intermediate.is_some() => json!(req.expert_intermediate),
            _ => match (literal(f.example.as_deref()), f.supported.first(), literal(f.default.as_deref())) {
                (Some(v), _, _) => v,
                (None, Some(s), _) => literal_value(s).unwrap_or_else(|| json!(s)),
                (None, None, Some(v)) => v,
                (None, None, None) => continue,
            },
        };
        // A per-layer list (layer_types) has one entry per layer: the example's pattern repeated.
        let v = match v {
            serde_json::Value::Array(pattern) if f.per_layer && !pattern.is_empty() => {
                json!(pattern.iter().cycle().take(z.layers).collect::<Vec<_>>())
            }
            v => v,
        };
        c.insert(f.key.clone(), v);
    }
    c.insert("bos_token_id".into(), json!(specials.bos));
    c.insert("eos_token_id".into(), json!(specials.eos));
    c.insert("torch_dtype".into(), json!(storage.torch_dtype()));
    let resolved = |c: &serde_json::Map<String, serde_json::Value>| crate::model::resolve(contract, c);
    if resolved(&c).map(|r| r.head_dim).ok() != Some(z.head_dim)
        && let Some(f) = m.config.iter().find(|f| f.role == "head_dim")
    {
        c.insert(f.key.clone(), json!(z.head_dim));
    }
    match resolved(&c) {
        Ok(r) if r.head_dim == z.head_dim => Ok(serde_json::Value::Object(c)),
        Ok(r) => Err(Error::usage(format!(
            "{} gives head_dim {} and has no head_dim key to set {}; pass sizes with hidden = heads * head_dim",
            contract.id, r.head_dim, z.head_dim
        ))),
        Err(gaps) => Err(Error::usage(format!(
            "the config synth wrote for {} does not resolve against it:\n{}",
            contract.id,
            gaps.iter().map(|g| format!("  {}: {}", g.field, g.reason)).collect::<Vec<_>>().join("\n")
        ))),
    }
}

/// A contract's default, example or supported value as config.json writes it, read as JSON: an
/// integer when written without a fraction or exponent ("256"), a float ("1e-6", "10000.0"), a
/// boolean, a list or an object (`layer_types`, `rope_parameters` examples); `None` for text that
/// is not JSON (a bare word such as `silu`, which the caller writes as a string).
fn literal_value(text: &str) -> Option<serde_json::Value> {
    serde_json::from_str(text.trim()).ok()
}

/// The parameters a family's graph binds on a config, counted in elements, from the same plan synth
/// writes checkpoints by (each weight's declared shape evaluated on the config; a tied head is the
/// table itself, counted once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraphParameters {
    /// Every bound tensor's elements (transformers' `num_parameters`).
    pub total: usize,
    /// The embedding table the prologue's `embedding` node reads.
    pub table: usize,
    /// Expert weights a decoded token does not read: per `moe_experts` node and layer, the
    /// (experts - top_k) experts its router (`moe_route`, `top_k`) leaves out. 0 for a dense family.
    pub idle_experts: usize,
    /// The share of the expert weights one token reads (top_k / experts; Qwen3-30B-A3B: 8 / 128);
    /// None for a dense family.
    pub expert_fraction: Option<f64>,
}

impl GraphParameters {
    /// The weights one decoded token reads: the total less the idle experts, less the table when
    /// the head is untied (one embedding row is read; tied, the table is the head).
    pub fn streamed(&self, tied: bool) -> usize {
        self.total - self.idle_experts - if tied { 0 } else { self.table }
    }
}

/// The parameters a family's graph binds on `config` ([`GraphParameters`]).
///
/// # Errors
/// As [`synth_config_for`]'s resolution: not a model family with a graph, or a config that does not
/// resolve against it.
pub fn graph_parameters(contract: &crate::ckb::Contract, config: &serde_json::Value) -> Result<GraphParameters> {
    let plan = graph_plan(contract, config)?;
    let family = contract.model.as_ref();
    let graph = family.and_then(|m| m.graph.as_ref());
    let tables: Vec<&String> = graph
        .into_iter()
        .flat_map(|g| g.prologue.iter())
        .filter(|n| n.op == "embedding")
        .flat_map(|n| n.weights.values())
        .collect();
    let total = plan.iter().map(PlannedTensor::len).sum();
    let table = plan.iter().filter(|t| tables.contains(&&t.name)).map(PlannedTensor::len).sum();
    let (mut idle_experts, mut expert_fraction) = (0, None);
    if let (Some(family), Some(graph)) = (family, graph) {
        let map = config.as_object().ok_or_else(|| Error::usage("config.json is not an object"))?;
        let cfg = crate::model::resolve(contract, map)
            .map_err(|_| Error::usage(format!("the config does not resolve against {}", contract.id)))?;
        let role = |r: &str| crate::oracle::graph::config_role(&cfg, r);
        let eval = |n: &crate::ckb::GraphNode, k: &str| {
            n.params.get(k).and_then(|e| crate::ckb::graph::eval_expr(e, &role).ok()).map(|v| v as usize)
        };
        for n in graph.layer.iter().filter(|n| n.op == "moe_experts") {
            let router = n.inputs.get(1).and_then(|r| graph.layer.iter().find(|x| &x.name == r));
            let (Some(count), Some(k)) = (eval(n, "experts"), router.and_then(|r| eval(r, "top_k"))) else {
                continue;
            };
            let per_expert: usize = n
                .weights
                .values()
                .filter_map(|p| family.weights.iter().find(|w| &w.name == p))
                .map(|w| -> usize {
                    w.shape.iter().map(|d| crate::ckb::graph::eval_expr(d, &role).unwrap_or(0.0) as usize).product()
                })
                .sum();
            idle_experts += count.saturating_sub(k) * per_expert * cfg.n_layers;
            expert_fraction = Some(k.min(count) as f64 / count.max(1) as f64);
        }
    }
    Ok(GraphParameters { total, table, idle_experts, expert_fraction })
}

/// The forward-pass features of a built-in family by its model_type, as its contract lists them
/// (what [`synth_tensors`] writes tensors for).
pub fn builtin_features(model_type: &str) -> Vec<String> {
    let f: &[&str] = match model_type {
        "mistral" => &["sliding_window"],
        "qwen2" => &["qkv_bias"],
        "qwen3" => &["qk_norm"],
        "gemma" => &["gelu_tanh_mlp", "rmsnorm_one_plus_w", "embed_scale_sqrt_hidden"],
        _ => &[],
    };
    f.iter().map(|s| s.to_string()).collect()
}

/// Write a synthetic checkpoint of the family `contract` describes (which need not be in any CKB: a
/// proposal's dry run uses it): config.json from [`synth_config_for`], tensors from its graph's
/// weight bindings (or from its features when it has no graph), stored as `req` says.
///
/// # Errors
/// As [`synth_config_for`] and [`write_checkpoint_opts`]; a graph whose shapes do not evaluate.
pub fn synth_contract(contract: &crate::ckb::Contract, req: &SynthRequest) -> Result<SynthReport> {
    let config = synth_config_for(contract, req)?;
    let model = contract.model.as_ref().expect("synth_config_for refuses other kinds");
    if model.graph.is_some() {
        write_planned(&req.out, &config, graph_plan(contract, &config)?, req.seed, &Storage::of(req)?)
    } else {
        write_checkpoint_opts(&req.out, &config, &model.features, req.seed, &Storage::of(req)?)
    }
}

/// Write a synthetic checkpoint for `req`: a built-in family as [`synth`] does, any other family
/// from its model contract in `ckb` (`model.<family>`, or the family whose model_types contain it;
/// a provisional candidate counts) with [`synth_config_for`] and the contract's features.
///
/// # Errors
/// A family neither built in nor in `ckb` (the message lists both), and as [`synth_config_for`] and
/// [`write_checkpoint`].
pub fn synth_in(ckb: &crate::ckb::Ckb, req: &SynthRequest) -> Result<SynthReport> {
    let family = req.family.strip_prefix("model.").unwrap_or(&req.family);
    if let Some(filled) = contract_preset_request(req)? {
        return synth_in(ckb, &filled);
    }
    if family.is_empty() || FAMILIES.contains(&family) || req.preset.is_some() {
        return synth(req);
    }
    let contract = ckb.get(&format!("model.{family}")).ok().or_else(|| ckb.family_for(&[], Some(family)));
    let Some(contract) = contract else {
        let known: Vec<String> = ckb
            .of_kind(crate::ckb::Kind::Model)
            .map(|c| c.id.trim_start_matches("model.").to_string())
            .filter(|f| !FAMILIES.contains(&f.as_str()))
            .collect();
        return Err(Error::usage(format!(
            "unknown family `{}`; synth writes: {}{}",
            req.family,
            FAMILIES.join(", "),
            if known.is_empty() { String::new() } else { format!(", and from their contracts: {}", known.join(", ")) }
        )));
    };
    let mut report = synth_contract(contract, req)?;
    report.family = family.to_string();
    Ok(report)
}

/// The request a preset of a family synth knows by contract only (a mixture of experts) stands
/// for: the preset's sizes fill the request's unset ones, and the family's contract writes it.
/// None for no preset or a preset of a built-in family.
///
/// # Errors
/// [`crate::error::ErrorKind::Usage`] for an unknown preset, or a `--family` other than the preset's.
pub fn contract_preset_request(req: &SynthRequest) -> Result<Option<SynthRequest>> {
    let Some(p) = req.preset.as_deref().map(preset).transpose()? else { return Ok(None) };
    if FAMILIES.contains(&p.family) {
        return Ok(None);
    }
    let family = req.family.strip_prefix("model.").unwrap_or(&req.family);
    if !family.is_empty() && family != p.family {
        return Err(Error::usage(format!(
            "--preset {} is a {} shape and conflicts with --family {family}; drop --family or pass --family {}",
            p.name, p.family, p.family
        )));
    }
    Ok(Some(SynthRequest {
        family: p.family.to_string(),
        preset: None,
        hidden: req.hidden.or(Some(p.hidden)),
        layers: req.layers.or(Some(p.layers)),
        heads: req.heads.or(Some(p.heads)),
        kv_heads: req.kv_heads.or(Some(p.kv_heads)),
        head_dim: req.head_dim.or(Some(p.head_dim).filter(|d| *d > 0)),
        vocab: req.vocab.or(Some(p.vocab)),
        intermediate: req.intermediate.or(Some(p.intermediate)),
        max_seq: req.max_seq.or(Some(p.max_seq)),
        experts: req.experts.or(Some(p.experts.0).filter(|e| *e > 0)),
        experts_per_token: req.experts_per_token.or(Some(p.experts.1).filter(|e| *e > 0)),
        expert_intermediate: req.expert_intermediate.or(Some(p.experts.2).filter(|e| *e > 0)),
        dtype: req.dtype.clone().or(Some(p.dtype.to_string())),
        tokenizer: req.tokenizer.clone().or(Some(p.tokenizer.to_string())),
        ..req.clone()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan written from a family's graph bindings is, tensor for tensor (name, shape, draws),
    /// the plan written from its features, for every built-in family tied and untied: so a family
    /// added as a contract gets its checkpoint the way the built-in ones always did.
    #[test]
    fn the_graph_plan_is_the_feature_plan_of_every_builtin_family() {
        let ckb = crate::ckb::Ckb::embedded().unwrap();
        for family in FAMILIES {
            for tied in [false, true] {
                let req = SynthRequest { family: family.to_string(), seed: 7, ..Default::default() };
                let mut config = synth_config(&req).unwrap();
                config["tie_word_embeddings"] = json!(tied);
                let contract = ckb.get(&format!("model.{family}")).unwrap();
                let want = tensor_plan(&config, &builtin_features(family));
                let got = graph_plan(contract, &config).unwrap();
                assert_eq!(got, want, "{family} tied={tied}");
                assert_eq!(got.iter().any(|t| t.name == "lm_head.weight"), !tied, "{family}");
            }
        }
        // Phi-3's fused tensors: one qkv_proj and one gate_up_proj, each drawn as its row blocks.
        let phi3: crate::ckb::Contract =
            toml::from_str(include_str!("../../tests/fixtures/evolution/model.phi3.toml")).unwrap();
        let config = synth_config_for(&phi3, &SynthRequest { family: "phi3".into(), ..Default::default() }).unwrap();
        let features = phi3.model.as_ref().unwrap().features.clone();
        assert!(features.contains(&"fused_qkv".to_string()));
        let got = graph_plan(&phi3, &config).unwrap();
        assert_eq!(got, tensor_plan(&config, &features));
        let qkv = got.iter().find(|t| t.name == "model.layers.0.self_attn.qkv_proj.weight").unwrap();
        assert_eq!(qkv.draws.len(), 3);
    }
}
