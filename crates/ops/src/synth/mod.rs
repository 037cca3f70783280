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
//! the contract's `architectures`, `model_types` and `config` keys (a key synth has no size for at
//! its `example` value, a published checkpoint's, so the synthetic checkpoint exercises it), tensors
//! from its graph's weight bindings (`tensors::graph_plan`: every tensor a node reads, drawn by what
//! it is to its node, a fused `qkv_proj` as its row blocks), or from its `features` when it has no
//! graph. For the built-in families and Phi-3 the graph plan is, tensor for tensor, the plan their
//! features give (a unit test).

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::Report;
use base::error::{Error, Result};

mod presets;
mod tensors;
#[cfg(test)]
mod tests;
mod tokenizer;
mod write;

pub use presets::{PRESETS, Preset, preset};
pub use tensors::{GraphParameters, graph_parameters, synth_tensors, synth_tensors_with};
pub use tokenizer::{synth_bytelevel_tokenizer, synth_tokenizer};
pub use write::{write_checkpoint, write_checkpoint_opts, write_checkpoint_with};

use tensors::graph_plan;
use tokenizer::special_ids;
use write::write_planned;

/// Families `synth` can write, by short name.
pub const FAMILIES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma"];

/// Sizes and family of the checkpoint to write. Unset sizes take the preset's values, or small
/// defaults without a preset.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    /// [`base::error::ErrorKind::Usage`] naming the flag: an unknown dtype or tokenizer, zero shards.
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
/// [`base::error::ErrorKind::Usage`] for an unknown family or preset, a family other than llama with a
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

/// Write a synthetic checkpoint of a built-in family ([`FAMILIES`]) for `req`.
///
/// # Errors
/// As [`synth_config`] and [`write_checkpoint_opts`].
pub fn synth(req: &SynthRequest) -> Result<SynthReport> {
    let config = synth_config(req)?;
    let features = builtin_features(config["model_type"].as_str().unwrap_or("llama"));
    write_checkpoint_opts(&req.out, &config, &features, req.seed, &Storage::of(req)?)
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
/// [`base::error::ErrorKind::Usage`] for absurd sizes (naming the flag), or when the config written
/// does not resolve against the contract (the gaps are listed).
pub fn synth_config_for(contract: &ckb::Contract, req: &SynthRequest) -> Result<serde_json::Value> {
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
    let resolved = |c: &serde_json::Map<String, serde_json::Value>| model::resolve(contract, c);
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
pub fn synth_contract(contract: &ckb::Contract, req: &SynthRequest) -> Result<SynthReport> {
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
pub fn synth_in(ckb: &ckb::Ckb, req: &SynthRequest) -> Result<SynthReport> {
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
            .of_kind(ckb::Kind::Model)
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
/// [`base::error::ErrorKind::Usage`] for an unknown preset, or a `--family` other than the preset's.
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
        sliding_window: req.sliding_window.or(Some(p.sliding_window).filter(|w| *w > 0)),
        dtype: req.dtype.clone().or(Some(p.dtype.to_string())),
        tokenizer: req.tokenizer.clone().or(Some(p.tokenizer.to_string())),
        ..req.clone()
    }))
}
