//! synth: a random-weight Hugging Face checkpoint of any covered family (config.json with the family's
//! real architectures, model_type and feature keys; model.safetensors in F32; a BPE tokenizer.json
//! covering every token id). Small by default, for testing the oracle and engines of families whose real
//! checkpoints are large; or in a real model's shape ([`PRESETS`]), for speed work. Sizes are checked
//! before anything is written; the checkpoint goes into a temporary directory beside `out` and is
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

/// A named model shape for speed work: the sizes of a real checkpoint, written with random weights
/// (timing does not depend on the values). All presets are Llama-family shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Preset {
    /// Name passed as `--preset`.
    pub name: &'static str,
    /// hidden_size (llama2.c `dim`).
    pub hidden: usize,
    /// num_hidden_layers.
    pub layers: usize,
    /// num_attention_heads.
    pub heads: usize,
    /// num_key_value_heads.
    pub kv_heads: usize,
    /// intermediate_size (the SwiGLU hidden width).
    pub intermediate: usize,
    /// vocab_size.
    pub vocab: usize,
    /// max_position_embeddings (llama2.c `max_seq_len`, the context length).
    pub max_seq: usize,
}

/// The llama2.c TinyStories model shapes. Source: the model table of the llama2.c README (Karpathy 2023,
/// <https://github.com/karpathy/llama2.c>): dim, n_layers, n_heads, n_kv_heads and max context length of
/// stories15M, stories42M and stories110M, all with the 32000-token Llama 2 vocabulary. The intermediate
/// sizes follow llama2.c's `model.py` (`hidden_dim = 4 * dim`, times 2/3, rounded up to a multiple of
/// 32: 768, 1376, 2048). llama2.c shares the embedding with the output projection, so the presets are
/// written with `tie_word_embeddings = true` and `rms_norm_eps = 1e-5` (`ModelArgs.norm_eps`); tied,
/// they hold 15.2M, 41.7M and 109.5M parameters, as the names say.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "stories15m",
        hidden: 288,
        layers: 6,
        heads: 6,
        kv_heads: 6,
        intermediate: 768,
        vocab: 32000,
        max_seq: 256,
    },
    Preset {
        name: "stories42m",
        hidden: 512,
        layers: 8,
        heads: 8,
        kv_heads: 8,
        intermediate: 1376,
        vocab: 32000,
        max_seq: 1024,
    },
    Preset {
        name: "stories110m",
        hidden: 768,
        layers: 12,
        heads: 12,
        kv_heads: 12,
        intermediate: 2048,
        vocab: 32000,
        max_seq: 1024,
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

/// Largest checkpoint `synth` writes, in bytes of F32 weights (2 GB, decimal): enough for the presets
/// (stories110m is about 438 MB), small enough to write in seconds and to hold in memory.
pub const MAX_BYTES: usize = 2_000_000_000;

/// Largest parameter count `synth` writes: [`MAX_BYTES`] of F32 (4 bytes each).
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
        (Some(_), "" | "llama") => "llama",
        (Some(p), other) => {
            return Err(Error::usage(format!(
                "--preset {} is a llama shape and conflicts with --family {other}; drop --family or pass --family llama",
                p.name
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
    let tied = preset.is_some() || matches!(family, "qwen2" | "qwen3" | "gemma");
    let Sizes { hidden, layers, heads, kv, head_dim, vocab, inter, max_seq } = sizes(req, preset, tied, family)?;
    let check = |ok: bool, msg: String| if ok { Ok(()) } else { Err(Error::usage(msg)) };
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
        "rms_norm_eps": if preset.is_some() { 1e-5 } else { 1e-6 },
        "rope_theta": theta,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    let o = c.as_object_mut().expect("an object");
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
/// same seed.
///
/// # Panics
/// When `config` lacks a size key (it comes from [`synth_config`] or [`synth_config_for`]).
pub fn synth_tensors_with(
    config: &serde_json::Value,
    features: &[String],
    seed: u64,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
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
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let norm_mean = if has("rmsnorm_one_plus_w") { 0.0 } else { 1.0 };
    let mut out = Vec::new();
    type Out = Vec<(String, Vec<usize>, Vec<f32>)>;
    let push =
        |out: &mut Out, rng: &mut rand_chacha::ChaCha8Rng, name: String, shape: Vec<usize>, mean: f32, std: f32| {
            let n = shape.iter().product();
            out.push((name, shape, normal(rng, n, mean, std)));
        };
    // Replace the last `n` tensors by one with their rows stacked in order.
    let fuse = |out: &mut Out, n: usize, name: String| {
        let parts = out.split_off(out.len() - n);
        let cols: usize = parts[0].1[1..].iter().product();
        let rows: usize = parts.iter().map(|p| p.1[0]).sum();
        let shape = if parts[0].1.len() == 1 { vec![rows] } else { vec![rows, cols] };
        out.push((name, shape, parts.into_iter().flat_map(|p| p.2).collect()));
    };
    let proj = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    push(&mut out, &mut rng, "model.embed_tokens.weight".into(), vec![vocab, h], 0.0, 0.2);
    for i in 0..nl {
        let p = format!("model.layers.{i}.");
        push(&mut out, &mut rng, format!("{p}input_layernorm.weight"), vec![h], norm_mean, 0.1);
        push(&mut out, &mut rng, format!("{p}self_attn.q_proj.weight"), vec![nh * hd, h], 0.0, proj(h));
        push(&mut out, &mut rng, format!("{p}self_attn.k_proj.weight"), vec![nkv * hd, h], 0.0, proj(h));
        push(&mut out, &mut rng, format!("{p}self_attn.v_proj.weight"), vec![nkv * hd, h], 0.0, proj(h));
        if has("fused_qkv") {
            fuse(&mut out, 3, format!("{p}self_attn.qkv_proj.weight"));
        }
        if has("qkv_bias") {
            push(&mut out, &mut rng, format!("{p}self_attn.q_proj.bias"), vec![nh * hd], 0.0, 0.5);
            push(&mut out, &mut rng, format!("{p}self_attn.k_proj.bias"), vec![nkv * hd], 0.0, 0.5);
            push(&mut out, &mut rng, format!("{p}self_attn.v_proj.bias"), vec![nkv * hd], 0.0, 0.5);
            if has("fused_qkv") {
                fuse(&mut out, 3, format!("{p}self_attn.qkv_proj.bias"));
            }
        }
        if has("qk_norm") {
            push(&mut out, &mut rng, format!("{p}self_attn.q_norm.weight"), vec![hd], 1.0, 0.3);
            push(&mut out, &mut rng, format!("{p}self_attn.k_norm.weight"), vec![hd], 1.0, 0.3);
        }
        push(&mut out, &mut rng, format!("{p}self_attn.o_proj.weight"), vec![h, nh * hd], 0.0, proj(nh * hd));
        push(&mut out, &mut rng, format!("{p}post_attention_layernorm.weight"), vec![h], norm_mean, 0.1);
        push(&mut out, &mut rng, format!("{p}mlp.gate_proj.weight"), vec![ff, h], 0.0, proj(h));
        push(&mut out, &mut rng, format!("{p}mlp.up_proj.weight"), vec![ff, h], 0.0, proj(h));
        if has("fused_gate_up") {
            fuse(&mut out, 2, format!("{p}mlp.gate_up_proj.weight"));
        }
        push(&mut out, &mut rng, format!("{p}mlp.down_proj.weight"), vec![h, ff], 0.0, proj(ff));
    }
    push(&mut out, &mut rng, "model.norm.weight".into(), vec![h], norm_mean, 0.1);
    if !tied {
        push(&mut out, &mut rng, "lm_head.weight".into(), vec![vocab, h], 0.0, 0.2);
    }
    out
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
    if out.exists() {
        let empty = out.is_dir() && std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty {
            return Err(Error::usage(format!(
                "{} exists and is not an empty directory; pass a new --out",
                out.display()
            )));
        }
    }
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
    let cfg_text = serde_json::to_string_pretty(config).expect("json serialises");
    std::fs::write(tmp.path().join("config.json"), cfg_text).map_err(|e| io(out, e))?;
    let vocab = config["vocab_size"].as_u64().unwrap_or(0) as usize;
    let tok = serde_json::to_string_pretty(&synth_tokenizer(vocab)).expect("json serialises");
    std::fs::write(tmp.path().join("tokenizer.json"), tok).map_err(|e| io(out, e))?;
    let tensors = synth_tensors_with(config, features, seed);
    let (count, parameters) = (tensors.len(), tensors.iter().map(|t| t.2.len()).sum());
    // Converted tensor by tensor, so that only one tensor is held twice.
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.into_iter().map(|(n, s, v)| (n, s, v.into_iter().flat_map(f32::to_le_bytes).collect())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).expect("consistent view"),
            )
        })
        .collect();
    let st = tmp.path().join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st)
        .map_err(|e| Error::input(format!("cannot write {}: {e}", st.display())))?;
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
        config: config.clone(),
        tensors: count,
        parameters,
    })
}

/// Write a synthetic checkpoint of a built-in family ([`FAMILIES`]) for `req`.
///
/// # Errors
/// As [`synth_config`] and [`write_checkpoint`].
pub fn synth(req: &SynthRequest) -> Result<SynthReport> {
    let config = synth_config(req)?;
    write_checkpoint(&req.out, &config, req.seed)
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
fn sizes(req: &SynthRequest, preset: Option<&Preset>, tied: bool, family: &str) -> Result<Sizes> {
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
    let head_dim = match req.head_dim {
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
        params <= MAX_PARAMETERS,
        format!(
            "the checkpoint would hold {params} parameters, {:.2} GB of f32 weights, more than synth writes ({} GB); \
             choose smaller --hidden, --layers, --intermediate or --vocab",
            (params * 4) as f64 / 1e9,
            MAX_BYTES / 1_000_000_000
        ),
    )?;
    Ok(Sizes { hidden, layers, heads, kv, head_dim, vocab, inter, max_seq })
}

/// The config.json of a synthetic checkpoint of the family `contract` describes: its first
/// architecture and model_type, and every `config` key with a role synth knows (sizes from the
/// request; epsilon, RoPE base, tying and activation from the contract's defaults and supported
/// values; `sliding_window` and `rope_scaling` null unless asked for). `head_dim` is written only
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
    let literal = |d: Option<&str>| -> Option<serde_json::Value> {
        let d = d?.trim();
        d.parse::<f64>().ok().map(|x| json!(x)).or_else(|| d.parse::<bool>().ok().map(serde_json::Value::Bool))
    };
    let tied_default = m.config.iter().find(|f| f.role == "tied").and_then(|f| literal(f.default.as_deref()));
    let tied = tied_default.and_then(|v| v.as_bool()).unwrap_or(false);
    let z = sizes(req, None, tied, "")?;
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
            _ => match (f.supported.first(), literal(f.default.as_deref())) {
                (Some(s), _) => s.parse::<f64>().map_or_else(|_| json!(s), |x| json!(x)),
                (None, Some(v)) => v,
                (None, None) => continue,
            },
        };
        c.insert(f.key.clone(), v);
    }
    c.insert("bos_token_id".into(), json!(1));
    c.insert("eos_token_id".into(), json!(2));
    c.insert("torch_dtype".into(), json!("float32"));
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

/// Write a synthetic checkpoint for `req`: a built-in family as [`synth`] does, any other family
/// from its model contract in `ckb` (`model.<family>`, or the family whose model_types contain it;
/// a provisional candidate counts) with [`synth_config_for`] and the contract's features.
///
/// # Errors
/// A family neither built in nor in `ckb` (the message lists both), and as [`synth_config_for`] and
/// [`write_checkpoint`].
pub fn synth_in(ckb: &crate::ckb::Ckb, req: &SynthRequest) -> Result<SynthReport> {
    let family = req.family.strip_prefix("model.").unwrap_or(&req.family);
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
    let config = synth_config_for(contract, req)?;
    let features = &contract.model.as_ref().expect("model contract").features;
    let mut report = write_checkpoint_with(&req.out, &config, features, req.seed)?;
    report.family = family.to_string();
    Ok(report)
}
