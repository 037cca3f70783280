//! Phase 2, configuration: config.json read as the model-family contracts map it (`model.llama`,
//! `model.mistral`, `model.qwen2`, `model.qwen3`, `model.gemma`, `model.phi3`, `model.olmo2`,
//! `model.granite`, `model.gemma2`, `model.gemma3_text`, `model.cohere`, `model.stablelm`,
//! `model.starcoder2`, `model.olmo` and the mixture-of-experts families `model.qwen3_moe`,
//! `model.mixtral` and GPT-OSS (`gpt_oss`)). A family
//! is data here: its HF configuration class defaults, the keys it refuses and its forward-pass
//! features (the contracts' `features`). A value of the wrong type, or a setting no family here
//! covers, is an error that names the key.

use std::path::Path;

use serde_json::{Map, Value};

/// Forward-pass differences from plain Llama, named as in the model contracts' `features`.
#[derive(Debug, Clone, Copy)]
pub struct Features {
    /// `qkv_bias` (model.qwen2): learned biases added to the q, k and v projections.
    pub qkv_bias: bool,
    /// `qk_norm` (model.qwen3): RMSNorm of every query and key head (width head_dim) before RoPE.
    pub qk_norm: bool,
    /// `sliding_window` (model.mistral, Phi-3): attention sees the last `sliding_window` positions.
    pub sliding_window: bool,
    /// `gelu_tanh_mlp` (model.gemma): GeGLU with the tanh GELU (kernel.gelu_tanh_and_mul) for SwiGLU.
    pub gelu_tanh_mlp: bool,
    /// `rmsnorm_one_plus_w` (model.gemma): every RMSNorm gain is 1 + the stored weight.
    pub rmsnorm_one_plus_w: bool,
    /// `embed_scale_sqrt_hidden` (model.gemma): the embedding row is multiplied by sqrt(hidden_size).
    pub embed_scale_sqrt_hidden: bool,
    /// `fused_qkv` and `fused_gate_up` (Phi-3): one qkv_proj and one gate_up_proj tensor per layer.
    pub fused: bool,
    /// OLMo-2: RMSNorm of the whole query projection (width n_heads * head_dim, one mean square over
    /// all heads) and of the whole key projection (n_kv_heads * head_dim) before RoPE.
    pub qk_norm_whole: bool,
    /// OLMo-2 and Gemma 2: the attention output is RMSNormed with post_attention_layernorm and the MLP
    /// output with post_feedforward_layernorm before their residual adds; the MLP's pre-norm, if the
    /// family has one, is pre_feedforward_layernorm.
    pub post_norms: bool,
    /// OLMo-2: no pre-norms (no input_layernorm, none before the MLP): attention and MLP read the
    /// residual stream itself.
    pub no_pre_norms: bool,
    /// Granite: config.json's embedding_multiplier (embedding row), residual_multiplier (attention
    /// and MLP outputs before their residual adds), attention_multiplier (the attention scale, for
    /// 1 / sqrt(head_dim)) and logits_scaling (the logits are divided by it), each default 1.0.
    pub multipliers: bool,
    /// Gemma 2: attention scale query_pre_attn_scalar^(-1/2) (default 256); attention scores capped
    /// as cap * tanh(score / cap) with attn_logit_softcapping (default 50) before the softmax, the
    /// logits likewise with final_logit_softcapping (default 30); null: no cap.
    pub softcapping: bool,
    /// Gemma 2: the sliding window applies to the layers config.json's `layer_types` calls
    /// "sliding_attention", by default the even ones (0, 2, ...); the others attend to all positions.
    /// Gemma 3 likewise, by default every layer but each sixth (`Family::window_pattern`); GPT-OSS
    /// as Gemma 2.
    pub alternating_window: bool,
    /// Gemma 3: `rope_parameters` holds one RoPE dict per layer type (`full_attention`,
    /// `sliding_attention`); each layer rotates with its type's rope_theta.
    pub rope_by_layer_type: bool,
    /// Cohere, StableLM, StarCoder2, OLMo: every norm is a LayerNorm (kernel.layer_norm: the mean
    /// subtracted, divided by sqrt(biased variance + eps)) instead of an RMSNorm.
    pub layer_norm: bool,
    /// StableLM, StarCoder2: every LayerNorm also adds its bias (`<norm>.bias`).
    pub norm_bias: bool,
    /// OLMo: the LayerNorms are non-parametric (no gain, no bias, eps fixed at 1e-5); the checkpoint
    /// holds no norm tensors.
    pub norm_no_gain: bool,
    /// Cohere: attention and the MLP both read the same normed input (input_layernorm), and the
    /// layer's output is h + attention output + MLP output; no post_attention_layernorm.
    pub parallel_block: bool,
    /// Cohere: RoPE rotates the interleaved pairs (2j, 2j + 1) of each head (kernel.rotary).
    pub interleaved_rope: bool,
    /// StarCoder2: the MLP is not gated, c_proj(gelu_tanh(c_fc(x))) with biases on both (and o_proj
    /// has a bias, `o_bias`).
    pub fc_mlp: bool,
    /// StarCoder2, GPT-OSS: o_proj adds a learned bias `self_attn.o_proj.bias` [hidden].
    pub o_bias: bool,
    /// GPT-OSS: every query head h has a learned logit `self_attn.sinks[h]` that joins its softmax
    /// denominator without a value (kernel.attention_sinks): p_j = exp(s_j) / (sum_t exp(s_t) +
    /// exp(sink_h)).
    pub attention_sinks: bool,
}

/// A model family: how its config.json is read.
#[derive(Clone, Copy)]
struct Family {
    model_type: &'static str,
    architecture: &'static str,
    features: Features,
    /// num_key_value_heads when absent; `None`: num_attention_heads.
    n_kv_heads: Option<usize>,
    /// head_dim when absent; `None`: hidden_size / num_attention_heads.
    head_dim: Option<usize>,
    max_seq: usize,
    tied: bool,
    /// sliding_window when absent (families with the feature); 0: no window.
    window: usize,
    /// Keys the family does not cover unless absent, null or false.
    refused: &'static [&'static str],
    /// Boolean keys the family covers only at the value given (when present and not null).
    fixed: &'static [(&'static str, bool)],
    /// The config key of the norms' epsilon and its default; `None`: fixed at the default (OLMo).
    norm_eps: (Option<&'static str>, f64),
    /// The activation key and the one value covered; `None`: the family's activation is fixed and
    /// the key is not read (GPT-OSS: GptOssExperts ignores hidden_act).
    activation: Option<(&'static str, &'static str)>,
    /// With `alternating_window` and no `layer_types`: layer i slides unless (i + 1) is a multiple
    /// of this (Gemma 2: 2, the even layers; Gemma 3: 6, five local layers to one global).
    window_pattern: usize,
    /// With `softcapping`: attn_logit_softcapping and final_logit_softcapping when absent.
    softcaps: (Option<f64>, Option<f64>),
    /// The default of `partial_rotary_factor`, the share of each head RoPE rotates (StableLM 0.25).
    partial_rotary_factor: f64,
    /// rope_theta when config.json gives none (the configuration class's `default_theta`).
    rope_theta: f64,
    /// The scaled rope_types covered besides "default" (Llama: linear and llama3; GPT-OSS: yarn).
    rope_types: &'static [&'static str],
    /// The RoPE scaling when config.json gives neither `rope_parameters` nor `rope_scaling` (the
    /// configuration class's default: GptOssConfig's YaRN); `None`: plain RoPE.
    default_rope: Option<RopeScaling>,
    /// Mixture-of-experts families: how their MLP is named and configured; `None`: a dense MLP.
    moe: Option<MoeFamily>,
}

/// How a mixture-of-experts family (contracts `model.qwen3_moe`, `model.mixtral`; GPT-OSS) names its
/// MLP and reads its configuration: every layer's MLP `model.layers.{i}.{module}` is a router over
/// experts stored as `layout` says.
#[derive(Clone, Copy)]
struct MoeFamily {
    module: &'static str,
    /// The experts' tensors and activation; GPT-OSS's `alpha` and `limit` are the defaults of
    /// config.json's swiglu_alpha and swiglu_limit.
    layout: ExpertLayout,
    /// The config key of one expert's intermediate width and its default; `None`: intermediate_size.
    inter: Option<(&'static str, usize)>,
    /// The expert count when config.json gives none (num_local_experts, alias num_experts).
    n_experts: usize,
    /// num_experts_per_tok when absent.
    top_k: usize,
    /// `None`: the kept routing weights are always renormalised (Mixtral); else the boolean key that
    /// says so and its default (Qwen3-MoE: norm_topk_prob, false).
    renormalize: Option<(&'static str, bool)>,
    /// Qwen3-MoE: config.json's decoder_sparse_step and mlp_only_layers can make some layers dense;
    /// only every layer sparse (step 1, no MLP-only layers) is covered.
    sparse_step: bool,
}

/// How a mixture-of-experts family stores its experts and which activation they apply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertLayout {
    /// Qwen3-MoE, Mixtral: the router `{module}.gate.weight` [n_experts, hidden], no bias; one
    /// tensor per expert and projection, `{module}.experts.{e}.{name}.weight` in nn.Linear layout,
    /// `names` = (gate, up, down) ("gate_proj", "up_proj", "down_proj"; Mixtral "w1", "w3", "w2");
    /// SwiGLU experts without biases (kernel.moe_experts).
    Split { names: [&'static str; 3] },
    /// GPT-OSS: the router `{module}.router.weight` [n_experts, hidden] with its bias [n_experts];
    /// every expert fused into `{module}.experts.gate_up_proj` [n_experts, hidden, 2 * inter]
    /// (input-major, gate and up interleaved) and `{module}.experts.down_proj` [n_experts, inter,
    /// hidden] (input-major), each with a bias (`gate_up_proj_bias` [n_experts, 2 * inter],
    /// `down_proj_bias` [n_experts, hidden]); the clamped SwiGLU of kernel.moe_experts_clamped,
    /// (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g) with g = min(gate, limit).
    Fused { alpha: f32, limit: f32 },
}

/// A mixture-of-experts MLP as config.json sets it (Qwen3-MoE, Mixtral, GPT-OSS): the router's
/// logits over `n_experts` experts, softmax, the `top_k` largest kept (kernel.moe_route) and their
/// experts of width `inter` summed with those weights (kernel.moe_experts; GPT-OSS
/// kernel.moe_experts_clamped).
#[derive(Debug, Clone)]
pub struct Moe {
    /// num_local_experts (num_experts in published Qwen3-MoE configs).
    pub n_experts: usize,
    /// num_experts_per_tok: the experts run per token.
    pub top_k: usize,
    /// The kept weights are divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob).
    pub renormalize: bool,
    /// One expert's intermediate width (Qwen3-MoE: moe_intermediate_size; Mixtral, GPT-OSS:
    /// intermediate_size).
    pub inter: usize,
    /// The MLP's module name in tensor names ("mlp", "block_sparse_moe").
    pub module: &'static str,
    /// How the experts are stored and activated (GPT-OSS: alpha and limit as config.json sets them).
    pub layout: ExpertLayout,
}

/// Plain Llama (model.llama): no features, LlamaConfig's defaults. The other families state how
/// they differ from it.
const LLAMA: Family = Family {
    model_type: "llama",
    architecture: "LlamaForCausalLM",
    features: Features {
        qkv_bias: false,
        qk_norm: false,
        sliding_window: false,
        gelu_tanh_mlp: false,
        rmsnorm_one_plus_w: false,
        embed_scale_sqrt_hidden: false,
        fused: false,
        qk_norm_whole: false,
        post_norms: false,
        no_pre_norms: false,
        multipliers: false,
        softcapping: false,
        alternating_window: false,
        rope_by_layer_type: false,
        layer_norm: false,
        norm_bias: false,
        norm_no_gain: false,
        parallel_block: false,
        interleaved_rope: false,
        fc_mlp: false,
        o_bias: false,
        attention_sinks: false,
    },
    n_kv_heads: None,
    head_dim: None,
    max_seq: 2048,
    tied: false,
    window: 0,
    refused: &["attention_bias", "mlp_bias", "sliding_window"],
    fixed: &[],
    norm_eps: (Some("rms_norm_eps"), 1e-6),
    activation: Some(("hidden_act", "silu")),
    window_pattern: 0,
    softcaps: (None, None),
    partial_rotary_factor: 1.0,
    rope_theta: 10000.0,
    rope_types: &["linear", "llama3"],
    default_rope: None,
    moe: None,
};

/// The families, with the defaults their contracts state (`[[model.config]]` defaults).
const FAMILIES: &[Family] = &[
    LLAMA,
    Family {
        model_type: "mistral",
        architecture: "MistralForCausalLM",
        features: Features { sliding_window: true, ..LLAMA.features },
        n_kv_heads: Some(8),
        max_seq: 131072,
        window: 4096,
        refused: &["rope_scaling", "attention_bias", "mlp_bias"],
        ..LLAMA
    },
    Family {
        model_type: "qwen2",
        architecture: "Qwen2ForCausalLM",
        features: Features { qkv_bias: true, ..LLAMA.features },
        max_seq: 32768,
        refused: &["rope_scaling", "use_sliding_window"],
        ..LLAMA
    },
    Family {
        model_type: "qwen3",
        architecture: "Qwen3ForCausalLM",
        features: Features { qk_norm: true, ..LLAMA.features },
        head_dim: Some(128),
        max_seq: 32768,
        refused: &["rope_scaling", "use_sliding_window", "attention_bias"],
        ..LLAMA
    },
    Family {
        model_type: "gemma",
        architecture: "GemmaForCausalLM",
        features: Features {
            gelu_tanh_mlp: true,
            rmsnorm_one_plus_w: true,
            embed_scale_sqrt_hidden: true,
            ..LLAMA.features
        },
        head_dim: Some(256),
        max_seq: 8192,
        tied: true,
        refused: &["rope_scaling", "attention_bias"],
        activation: Some(("hidden_activation", "gelu_pytorch_tanh")),
        ..LLAMA
    },
    Family {
        model_type: "phi3",
        architecture: "Phi3ForCausalLM",
        features: Features { fused: true, sliding_window: true, ..LLAMA.features },
        max_seq: 4096,
        norm_eps: (Some("rms_norm_eps"), 1e-5),
        refused: &["rope_scaling"],
        ..LLAMA
    },
    Family {
        model_type: "olmo2",
        architecture: "Olmo2ForCausalLM",
        features: Features { qk_norm_whole: true, post_norms: true, no_pre_norms: true, ..LLAMA.features },
        norm_eps: (Some("rms_norm_eps"), 1e-5),
        refused: &["rope_scaling", "attention_bias"],
        ..LLAMA
    },
    Family {
        model_type: "granite",
        architecture: "GraniteForCausalLM",
        features: Features { multipliers: true, ..LLAMA.features },
        refused: &["rope_scaling", "attention_bias", "mlp_bias"],
        ..LLAMA
    },
    Family {
        model_type: "gemma2",
        architecture: "Gemma2ForCausalLM",
        features: Features {
            gelu_tanh_mlp: true,
            rmsnorm_one_plus_w: true,
            embed_scale_sqrt_hidden: true,
            post_norms: true,
            softcapping: true,
            sliding_window: true,
            alternating_window: true,
            ..LLAMA.features
        },
        head_dim: Some(256),
        max_seq: 8192,
        tied: true,
        window: 4096,
        refused: &["rope_scaling", "attention_bias"],
        activation: Some(("hidden_activation", "gelu_pytorch_tanh")),
        window_pattern: 2,
        softcaps: (Some(50.0), Some(30.0)),
        ..LLAMA
    },
    Family {
        model_type: "gemma3_text",
        architecture: "Gemma3ForCausalLM",
        features: Features {
            gelu_tanh_mlp: true,
            rmsnorm_one_plus_w: true,
            embed_scale_sqrt_hidden: true,
            qk_norm: true,
            post_norms: true,
            softcapping: true,
            sliding_window: true,
            alternating_window: true,
            rope_by_layer_type: true,
            ..LLAMA.features
        },
        head_dim: Some(256),
        max_seq: 131072,
        tied: true,
        window: 4096,
        refused: &["rope_scaling", "attention_bias", "use_bidirectional_attention"],
        activation: Some(("hidden_activation", "gelu_pytorch_tanh")),
        window_pattern: 6,
        ..LLAMA
    },
    Family {
        model_type: "cohere",
        architecture: "CohereForCausalLM",
        features: Features { layer_norm: true, parallel_block: true, interleaved_rope: true, ..LLAMA.features },
        max_seq: 8192,
        tied: true,
        refused: &["rope_scaling", "attention_bias", "use_qk_norm"],
        norm_eps: (Some("layer_norm_eps"), 1e-5),
        ..LLAMA
    },
    Family {
        model_type: "stablelm",
        architecture: "StableLmForCausalLM",
        features: Features { layer_norm: true, norm_bias: true, qkv_bias: true, ..LLAMA.features },
        max_seq: 4096,
        refused: &["rope_scaling", "qk_layernorm", "use_parallel_residual"],
        fixed: &[("use_qkv_bias", true)],
        norm_eps: (Some("layer_norm_eps"), 1e-5),
        partial_rotary_factor: 0.25,
        ..LLAMA
    },
    Family {
        model_type: "starcoder2",
        architecture: "Starcoder2ForCausalLM",
        features: Features {
            layer_norm: true,
            norm_bias: true,
            qkv_bias: true,
            fc_mlp: true,
            o_bias: true,
            sliding_window: true,
            ..LLAMA.features
        },
        max_seq: 4096,
        tied: true,
        refused: &["rope_scaling"],
        fixed: &[("use_bias", true)],
        norm_eps: (Some("norm_epsilon"), 1e-5),
        activation: Some(("hidden_act", "gelu_pytorch_tanh")),
        ..LLAMA
    },
    Family {
        model_type: "olmo",
        architecture: "OlmoForCausalLM",
        features: Features { layer_norm: true, norm_no_gain: true, ..LLAMA.features },
        refused: &["rope_scaling", "attention_bias"],
        norm_eps: (None, 1e-5),
        ..LLAMA
    },
    Family {
        // Qwen3MoeConfig: Qwen3's attention (head_dim from config.json, else hidden / heads as
        // Qwen3MoeAttention reads it), 4 KV heads, 128 experts of width 768, 8 per token.
        model_type: "qwen3_moe",
        architecture: "Qwen3MoeForCausalLM",
        features: Features { qk_norm: true, ..LLAMA.features },
        n_kv_heads: Some(4),
        max_seq: 32768,
        refused: &["rope_scaling", "use_sliding_window", "attention_bias"],
        moe: Some(MoeFamily {
            module: "mlp",
            layout: ExpertLayout::Split { names: ["gate_proj", "up_proj", "down_proj"] },
            inter: Some(("moe_intermediate_size", 768)),
            n_experts: 128,
            top_k: 8,
            renormalize: Some(("norm_topk_prob", false)),
            sparse_step: true,
        }),
        ..LLAMA
    },
    Family {
        // MixtralConfig: Mistral's attention (sliding_window default null), rope_theta 1e6,
        // rms_norm_eps 1e-5, 8 experts of width intermediate_size, 2 per token, renormalised.
        model_type: "mixtral",
        architecture: "MixtralForCausalLM",
        features: Features { sliding_window: true, ..LLAMA.features },
        n_kv_heads: Some(8),
        max_seq: 131072,
        refused: &["rope_scaling", "attention_bias", "mlp_bias"],
        norm_eps: (Some("rms_norm_eps"), 1e-5),
        rope_theta: 1_000_000.0,
        moe: Some(MoeFamily {
            module: "block_sparse_moe",
            layout: ExpertLayout::Split { names: ["w1", "w3", "w2"] },
            inter: None,
            n_experts: 8,
            top_k: 2,
            renormalize: None,
            sparse_step: false,
        }),
        ..LLAMA
    },
    Family {
        // GptOssConfig: q, k, v and o biases (attention_bias true), one sink logit per query head,
        // 8 KV heads of width 64, rms_norm_eps 1e-5, rope_theta 150000 with YaRN (factor 32,
        // beta_fast 32, beta_slow 1, no truncation, 4096 original positions) when config.json gives
        // no rope_parameters, a window of 128 on the even layers (layer_types), 128 fused experts
        // of width intermediate_size with the clamped SwiGLU (alpha 1.702, limit 7), 4 per token,
        // the kept router logits softmaxed (= all softmaxed, then renormalised). hidden_act is not
        // read. MXFP4 checkpoints (quantization_config) are refused: their experts are U8 blocks.
        model_type: "gpt_oss",
        architecture: "GptOssForCausalLM",
        features: Features {
            qkv_bias: true,
            o_bias: true,
            attention_sinks: true,
            sliding_window: true,
            alternating_window: true,
            ..LLAMA.features
        },
        n_kv_heads: Some(8),
        head_dim: Some(64),
        max_seq: 131072,
        window: 128,
        refused: &["quantization_config"],
        fixed: &[("attention_bias", true)],
        norm_eps: (Some("rms_norm_eps"), 1e-5),
        activation: None,
        window_pattern: 2,
        rope_theta: 150_000.0,
        rope_types: &["yarn"],
        default_rope: Some(RopeScaling::Yarn {
            factor: 32.0,
            attention_factor: GPT_OSS_YARN_ATTENTION_FACTOR,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096.0,
            truncate: false,
        }),
        moe: Some(MoeFamily {
            module: "mlp",
            layout: ExpertLayout::Fused { alpha: 1.702, limit: 7.0 },
            inter: None,
            n_experts: 128,
            top_k: 4,
            renormalize: None,
            sparse_step: false,
        }),
        ..LLAMA
    },
];

/// YaRN's default attention factor at GptOssConfig's factor 32: 0.1 ln 32 + 1 (`yarn_attention_factor`;
/// a constant because `f64::ln` is not const).
const GPT_OSS_YARN_ATTENTION_FACTOR: f64 = 1.346_573_590_279_972_7;

/// Gemma2Config's and Gemma3TextConfig's default query_pre_attn_scalar.
const GEMMA_QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
/// CohereConfig's default logit_scale.
const COHERE_LOGIT_SCALE: f64 = 0.0625;

/// RoPE frequency scaling from config.json `rope_scaling` (contract model.llama).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (positional interpolation).
    Linear { factor: f64 },
    /// Llama 3.1: frequencies scaled by wavelength against `original_max_position_embeddings`.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// YaRN (Peng et al. 2023; transformers' `_compute_yarn_parameters`, GPT-OSS): each frequency
    /// blended between itself (extrapolation) and itself / `factor` (interpolation) by a linear ramp
    /// over the rotation counts beta_fast..beta_slow within `original_max_position_embeddings`
    /// positions (`truncate`: the ramp's ends rounded to whole dimensions), and cos and sin both
    /// multiplied by `attention_factor` (config.json's, else 0.1 ln(factor) + 1 for factor > 1).
    Yarn {
        factor: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
    },
}

/// The model configuration the forward pass needs, defaults applied.
#[derive(Debug, Clone)]
pub struct Config {
    /// hidden_size: width of the residual stream.
    pub hidden: usize,
    /// intermediate_size: width of the MLP's hidden layer.
    pub intermediate: usize,
    /// num_hidden_layers.
    pub n_layers: usize,
    /// num_attention_heads: query heads.
    pub n_heads: usize,
    /// num_key_value_heads: key/value heads (GQA when fewer than n_heads).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// vocab_size: length of the logits.
    pub vocab: usize,
    /// max_position_embeddings: the most positions the KV cache holds.
    pub max_seq: usize,
    /// The norms' epsilon, inside the square root (rms_norm_eps; layer_norm_eps or norm_epsilon in
    /// the LayerNorm families).
    pub rms_norm_eps: f32,
    /// RoPE base theta (of the full-attention layers where the layer types differ).
    pub rope_theta: f64,
    /// Gemma 3: the RoPE base of the sliding-window layers (`rope_parameters.sliding_attention`).
    pub sliding_rope_theta: Option<f64>,
    /// The leading entries of each head RoPE rotates: head_dim * partial_rotary_factor, even.
    pub rotary_dim: usize,
    /// The output projection is the embedding matrix.
    pub tied: bool,
    /// Attention window in positions; 0: full causal attention.
    pub sliding_window: usize,
    /// Gemma 2, 3 and GPT-OSS (`alternating_window`): whether each layer uses `sliding_window`;
    /// `None`: all do.
    pub sliding_layers: Option<Vec<bool>>,
    pub rope_scaling: Option<RopeScaling>,
    pub features: Features,
    /// Attention scores are `attention_scale * q.k` (Granite's attention_multiplier, Gemma 2's
    /// query_pre_attn_scalar^(-1/2)); `None`: 1 / sqrt(head_dim).
    pub attention_scale: Option<f32>,
    /// Gemma 2's attn_logit_softcapping: scores become cap * tanh(score / cap) before the softmax.
    pub attn_softcap: Option<f32>,
    /// Gemma 2's final_logit_softcapping: logits become cap * tanh(logit / cap).
    pub final_softcap: Option<f32>,
    /// Granite's embedding_multiplier: the embedding row is multiplied by it.
    pub embedding_multiplier: Option<f32>,
    /// Granite's residual_multiplier: attention and MLP outputs are multiplied by it before their
    /// residual adds.
    pub residual_multiplier: Option<f32>,
    /// Granite's logits_scaling: the logits are divided by it.
    pub logits_scaling: Option<f32>,
    /// Cohere's logit_scale: the logits are multiplied by it.
    pub logit_scale: Option<f32>,
    /// OLMo's clip_qkv: q, k and v are clamped to [-clip_qkv, clip_qkv].
    pub clip_qkv: Option<f32>,
    /// Qwen3-MoE, Mixtral and GPT-OSS: every layer's MLP is a mixture of experts; `None`: a dense
    /// MLP.
    pub moe: Option<Moe>,
}

impl Config {
    /// Read `dir/config.json`. Errors name the file and the key at fault and say what is covered.
    pub fn load(dir: &Path) -> Result<Config, String> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: cannot read ({e})", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: not valid JSON ({e})", path.display()))?;
        let c = json.as_object().ok_or_else(|| format!("{}: must be a JSON object", path.display()))?;
        Config::from_json(c).map_err(|e| format!("config.json: {e}"))
    }

    /// The configuration of one parsed config.json object.
    pub fn from_json(c: &Map<String, Value>) -> Result<Config, String> {
        let family = family_of(c)?;
        for key in family.refused {
            if c.get(*key).is_some_and(|v| !v.is_null() && v != &Value::Bool(false)) {
                return Err(format!("`{key}` = {} is not covered for {}", c[*key], family.model_type));
            }
        }
        for (key, want) in family.fixed {
            match c.get(*key) {
                None | Some(Value::Null) => {}
                Some(v) if v == &Value::Bool(*want) => {}
                Some(v) => return Err(format!("`{key}` = {v} is not covered for {} (only {want})", family.model_type)),
            }
        }
        if let Some((activation, want)) = family.activation {
            match text(c, activation)? {
                Some(act) if act != want => {
                    return Err(format!("`{activation}` = {act:?} is not covered (only {want:?})"));
                }
                _ => {}
            }
        }
        let hidden = required(c, "hidden_size")?;
        let n_heads = required(c, "num_attention_heads")?;
        let n_kv_heads = count(c, "num_key_value_heads")?.or(family.n_kv_heads).unwrap_or(n_heads);
        let head_dim = count(c, "head_dim")?.or(family.head_dim).unwrap_or(hidden / n_heads);
        if !n_heads.is_multiple_of(n_kv_heads) || !head_dim.is_multiple_of(2) {
            return Err(format!(
                "num_attention_heads {n_heads} must be a multiple of num_key_value_heads {n_kv_heads}, and head_dim {head_dim} even"
            ));
        }
        let max_seq = count(c, "max_position_embeddings")?.unwrap_or(family.max_seq);
        let (rope_theta, sliding_rope_theta, rope_scaling) = rope(c, family, max_seq)?;
        let rotary_dim = rotary_dim(c, head_dim, family.partial_rotary_factor)?;
        if rope_scaling.is_some() && family.refused.contains(&"rope_scaling") {
            return Err(format!("RoPE scaling {rope_scaling:?} is not covered for {}", family.model_type));
        }
        let sliding_window = match (family.features.sliding_window, c.get("sliding_window")) {
            (false, _) | (true, Some(Value::Null)) => 0,
            (true, None) => family.window,
            (true, Some(_)) => required(c, "sliding_window")?,
        };
        let n_layers = required(c, "num_hidden_layers")?;
        let intermediate = required(c, "intermediate_size")?;
        let moe = match &family.moe {
            Some(m) => Some(moe(c, m, intermediate)?),
            None => None,
        };
        let f = family.features;
        let sliding_layers =
            if f.alternating_window { Some(sliding_layers(c, n_layers, family.window_pattern)?) } else { None };
        // Granite's multipliers, each default 1.0.
        let multiplier = |key: &str| -> Result<Option<f32>, String> {
            Ok(if f.multipliers { Some(positive(c, key)?.unwrap_or(1.0) as f32) } else { None })
        };
        // Gemma 2's and 3's caps: absent, the family's default; null, no cap.
        let cap = |key: &str, default: Option<f64>| -> Result<Option<f32>, String> {
            Ok(match c.get(key) {
                _ if !f.softcapping => None,
                None => default.map(|d| d as f32),
                Some(_) => positive(c, key)?.map(|v| v as f32),
            })
        };
        let attention_scale = if f.softcapping {
            let scalar = positive(c, "query_pre_attn_scalar")?.unwrap_or(GEMMA_QUERY_PRE_ATTN_SCALAR);
            Some(scalar.powf(-0.5) as f32)
        } else {
            multiplier("attention_multiplier")?
        };
        Ok(Config {
            hidden,
            intermediate,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab: required(c, "vocab_size")?,
            max_seq,
            rms_norm_eps: match family.norm_eps {
                (Some(key), default) => positive(c, key)?.unwrap_or(default) as f32,
                (None, fixed) => fixed as f32,
            },
            rope_theta,
            sliding_rope_theta,
            rotary_dim,
            tied: match c.get("tie_word_embeddings") {
                None | Some(Value::Null) => family.tied,
                Some(v) => {
                    v.as_bool().ok_or_else(|| format!("`tie_word_embeddings` must be true or false, got {v}"))?
                }
            },
            sliding_window,
            sliding_layers,
            rope_scaling,
            features: family.features,
            attention_scale,
            attn_softcap: cap("attn_logit_softcapping", family.softcaps.0)?,
            final_softcap: cap("final_logit_softcapping", family.softcaps.1)?,
            embedding_multiplier: multiplier("embedding_multiplier")?,
            residual_multiplier: multiplier("residual_multiplier")?,
            logits_scaling: multiplier("logits_scaling")?,
            logit_scale: if f.parallel_block {
                Some(number(c, "logit_scale")?.unwrap_or(COHERE_LOGIT_SCALE) as f32)
            } else {
                None
            },
            clip_qkv: if f.norm_no_gain { positive(c, "clip_qkv")?.map(|v| v as f32) } else { None },
            moe,
        })
    }

    /// Whether layer `layer` is a sliding-window layer (`layer_types`); false in families whose
    /// layers are all of one kind.
    pub fn sliding(&self, layer: usize) -> bool {
        self.sliding_layers.as_ref().is_some_and(|s| s[layer])
    }

    /// The attention window of layer `layer` in positions; 0: full causal attention.
    pub fn window(&self, layer: usize) -> usize {
        match &self.sliding_layers {
            Some(sliding) if !sliding[layer] => 0,
            _ => self.sliding_window,
        }
    }

    /// RoPE frequencies [rotary_dim / 2]: theta^(-2j / rotary_dim) (kernel.rope, kernel.rotary),
    /// then scaled as `rope_scaling` says (contract model.llama, math).
    pub fn rope_freqs(&self) -> Vec<f64> {
        let plain = crate::kernels::rope_freqs(self.rope_theta, self.rotary_dim);
        match self.rope_scaling {
            None => plain,
            Some(RopeScaling::Linear { factor }) => plain.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = original_max_position_embeddings;
                plain
                    .iter()
                    .map(|&f| {
                        let wavelength = 2.0 * std::f64::consts::PI / f;
                        if wavelength < old / high_freq_factor {
                            f
                        } else if wavelength > old / low_freq_factor {
                            f / factor
                        } else {
                            let s = (old / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * f / factor + s * f
                        }
                    })
                    .collect()
            }
            Some(RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                ..
            }) => {
                // transformers' _compute_yarn_parameters over dim = rotary_dim: the dimension
                // (fractional) at which a frequency turns n times within the original length,
                // corr(n) = dim ln(original / (2 pi n)) / (2 ln theta); a ramp from corr(beta_fast)
                // to corr(beta_slow) weights interpolation f / factor against extrapolation f.
                let dim = self.rotary_dim as f64;
                let corr = |turns: f64| {
                    dim * (original_max_position_embeddings / (turns * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.rope_theta.ln())
                };
                let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                plain
                    .iter()
                    .enumerate()
                    .map(|(j, &f)| {
                        let ramp = ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        f / factor * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        }
    }

    /// The factor RoPE multiplies cos and sin by: YaRN's attention factor, else 1.
    pub fn rope_attention_factor(&self) -> f32 {
        match self.rope_scaling {
            Some(RopeScaling::Yarn { attention_factor, .. }) => attention_factor as f32,
            _ => 1.0,
        }
    }
}

/// The family named by `architectures` or, failing that, `model_type`.
fn family_of(c: &Map<String, Value>) -> Result<&'static Family, String> {
    let archs: Vec<&str> =
        c.get("architectures").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let model_type = text(c, "model_type")?;
    FAMILIES
        .iter()
        .find(|f| archs.contains(&f.architecture))
        .or_else(|| FAMILIES.iter().find(|f| model_type == Some(f.model_type)))
        .ok_or_else(|| {
            let known: Vec<&str> = FAMILIES.iter().map(|f| f.architecture).collect();
            format!(
                "architectures {archs:?} / model_type {model_type:?} is not a covered family ({})",
                known.join(", ")
            )
        })
}

/// Gemma3TextConfig's RoPE bases when config.json gives none: the global (full-attention) layers'
/// and the local (sliding-window) layers'.
const GEMMA3_ROPE_THETA: (f64, f64) = (1_000_000.0, 10_000.0);

/// RoPE's base and scaling as HF reads them (contract model.llama): transformers v5's
/// `rope_parameters` (`{rope_type, rope_theta, ...}`) first, its rope_theta winning over a top-level
/// one; else `rope_scaling` (legacy `type` for `rope_type`) with the top-level `rope_theta` (default
/// the family's `rope_theta`: 10000, Mixtral's 1e6, GPT-OSS's 150000). Neither: the family's
/// `default_rope` (GPT-OSS's YaRN), else no scaling. rope_type "default" is no scaling; the family's
/// `rope_types` (linear and llama3; GPT-OSS: yarn) are read; another type, a key the type does not
/// read, or the two forms disagreeing is refused by name. With `rope_by_layer_type` (Gemma 3),
/// `rope_parameters` holds one such dict per layer type and the second value is the sliding layers'
/// base; unscaled types only. `max_seq` is max_position_embeddings (YaRN's default original length).
fn rope(
    c: &Map<String, Value>,
    family: &Family,
    max_seq: usize,
) -> Result<(f64, Option<f64>, Option<RopeScaling>), String> {
    if !family.features.rope_by_layer_type {
        let (theta, scaling) = rope_dict(c, family, max_seq)?;
        return Ok((theta, None, scaling));
    }
    let Some(p) = c.get("rope_parameters").filter(|v| !v.is_null()) else {
        let (global, local) = GEMMA3_ROPE_THETA;
        return Ok((number(c, "rope_theta")?.unwrap_or(global), Some(local), None));
    };
    let p = p.as_object().ok_or("`rope_parameters` must be an object or null")?;
    let theta = |kind: &str| -> Result<f64, String> {
        let t = p
            .get(kind)
            .and_then(Value::as_object)
            .ok_or_else(|| format!("`rope_parameters.{kind}` must be an object (one RoPE dict per layer type)"))?;
        match rope_dict(t, family, max_seq)? {
            (theta, None) => Ok(theta),
            (_, Some(s)) => Err(format!("`rope_parameters.{kind}` scaling {s:?} is not covered")),
        }
    };
    Ok((theta("full_attention")?, Some(theta("sliding_attention")?), None))
}

/// One RoPE dict as [`rope`] reads it: the base and the scaling of `c` (config.json, or one layer
/// type's dict).
fn rope_dict(c: &Map<String, Value>, family: &Family, max_seq: usize) -> Result<(f64, Option<RopeScaling>), String> {
    let params = c.get("rope_parameters").filter(|v| !v.is_null());
    let legacy = c.get("rope_scaling").filter(|v| !v.is_null());
    let top_theta = number(c, "rope_theta")?.unwrap_or(family.rope_theta);
    let (name, s) = match (params, legacy) {
        (Some(p), _) => ("rope_parameters", p),
        (None, Some(l)) => ("rope_scaling", l),
        (None, None) => return Ok((top_theta, family.default_rope)),
    };
    let s = s.as_object().ok_or_else(|| format!("`{name}` must be an object or null"))?;
    if s.values().any(Value::is_object) {
        return Err(format!("`{name}` with per-layer-type parameters is not covered"));
    }
    let scaling_keys = |m: &Map<String, Value>| -> Map<String, Value> {
        let mut m = m.clone();
        m.remove("rope_theta");
        if let Some(t) = m.remove("type") {
            m.entry("rope_type").or_insert(t);
        }
        m
    };
    if let (Some(Value::Object(p)), Some(Value::Object(l))) = (params, legacy)
        && scaling_keys(p) != scaling_keys(l)
    {
        return Err("`rope_parameters` and `rope_scaling` disagree".into());
    }
    let kind = text(s, "rope_type")?.or(text(s, "type")?).unwrap_or("default");
    if kind != "default" && !family.rope_types.contains(&kind) {
        let covered: Vec<&str> = std::iter::once("default").chain(family.rope_types.iter().copied()).collect();
        return Err(format!(
            "`{name}` type {kind:?} is not covered for {} ({})",
            family.model_type,
            covered.join(", ")
        ));
    }
    let allowed: &[&str] = match kind {
        "linear" => &["factor"],
        "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
        "yarn" => {
            &["factor", "attention_factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate"]
        }
        _ => &[],
    };
    if let Some(k) = s.keys().find(|k| {
        !["rope_type", "type", "rope_theta", "partial_rotary_factor"].contains(&k.as_str())
            && !allowed.contains(&k.as_str())
    }) {
        return Err(format!("`{name}.{k}` is not a key of rope_type {kind:?}"));
    }
    let theta = if name == "rope_parameters" { number(s, "rope_theta")?.unwrap_or(top_theta) } else { top_theta };
    // An optional positive number (absent or null: `None`), and a required one.
    let optional = |k: &str| match number(s, k)? {
        Some(v) if !(v > 0.0 && v.is_finite()) => Err(format!("`{name}.{k}` must be a positive number, got {v}")),
        v => Ok(v),
    };
    let key = |k: &str| optional(k)?.ok_or_else(|| format!("`{name}.{k}` must be a positive number"));
    let scaling = match kind {
        "linear" => Some(RopeScaling::Linear { factor: key("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: key("factor")?,
            low_freq_factor: key("low_freq_factor")?,
            high_freq_factor: key("high_freq_factor")?,
            original_max_position_embeddings: key("original_max_position_embeddings")?,
        }),
        "yarn" => {
            // transformers' _compute_yarn_parameters: beta_fast 32, beta_slow 1, truncate true and
            // the original length max_position_embeddings when absent.
            let factor = key("factor")?;
            Some(RopeScaling::Yarn {
                factor,
                attention_factor: optional("attention_factor")?.unwrap_or_else(|| yarn_attention_factor(factor)),
                beta_fast: optional("beta_fast")?.unwrap_or(32.0),
                beta_slow: optional("beta_slow")?.unwrap_or(1.0),
                original_max_position_embeddings: optional("original_max_position_embeddings")?
                    .unwrap_or(max_seq as f64),
                truncate: match s.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(v) => {
                        v.as_bool().ok_or_else(|| format!("`{name}.truncate` must be true or false, got {v}"))?
                    }
                },
            })
        }
        _ => None,
    };
    Ok((theta, scaling))
}

/// YaRN's attention factor when config.json gives none (Peng et al. 2023, eq. 22; transformers'
/// `get_mscale`): 0.1 ln(factor) + 1 for factor > 1, else 1.
pub fn yarn_attention_factor(factor: f64) -> f64 {
    if factor > 1.0 { 0.1 * factor.ln() + 1.0 } else { 1.0 }
}

/// The leading entries of each head that RoPE rotates (kernel.rotary): int(head_dim *
/// partial_rotary_factor), the factor read at the top level or in `rope_parameters` (transformers
/// v5 writes both; they must agree), default the family's. Refused unless even and at least 2.
fn rotary_dim(c: &Map<String, Value>, head_dim: usize, default: f64) -> Result<usize, String> {
    let top = number(c, "partial_rotary_factor")?;
    let nested = match c.get("rope_parameters") {
        Some(Value::Object(p)) => number(p, "partial_rotary_factor")?,
        _ => None,
    };
    if let (Some(a), Some(b)) = (top, nested)
        && a != b
    {
        return Err(format!("`partial_rotary_factor` {a} and `rope_parameters.partial_rotary_factor` {b} disagree"));
    }
    let factor = top.or(nested).unwrap_or(default);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(format!("`partial_rotary_factor` must be in (0, 1], got {factor}"));
    }
    let dim = (head_dim as f64 * factor) as usize;
    if dim < 2 || !dim.is_multiple_of(2) {
        return Err(format!(
            "head_dim {head_dim} * partial_rotary_factor {factor} = {dim} rotated entries; RoPE needs an even number, at least 2"
        ));
    }
    Ok(dim)
}

/// A mixture-of-experts family's MLP settings (contracts `model.qwen3_moe`, `model.mixtral`,
/// `[[model.config]]`; GPT-OSS): the expert count from num_local_experts (transformers 5 writes it) or
/// num_experts (its alias, in published Qwen3-MoE configs), which must agree when both are given;
/// num_experts_per_tok in 1..=that count; the expert width; whether the kept weights are
/// renormalised; GPT-OSS's swiglu_alpha and swiglu_limit. Qwen3-MoE layers made dense by
/// decoder_sparse_step or mlp_only_layers are refused.
fn moe(c: &Map<String, Value>, m: &MoeFamily, intermediate: usize) -> Result<Moe, String> {
    let n_experts = match (count(c, "num_local_experts")?, count(c, "num_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!("`num_local_experts` {a} and `num_experts` {b} disagree"));
        }
        (a, b) => a.or(b).unwrap_or(m.n_experts),
    };
    let top_k = match c.get("num_experts_per_tok") {
        None | Some(Value::Null) => m.top_k,
        Some(v) => v
            .as_u64()
            .map(|k| k as usize)
            .ok_or_else(|| format!("`num_experts_per_tok` must be an integer, got {v}"))?,
    };
    if top_k == 0 || top_k > n_experts {
        return Err(format!("`num_experts_per_tok` = {top_k} must be in 1..={n_experts} (the expert count)"));
    }
    if m.sparse_step {
        if let Some(step) = count(c, "decoder_sparse_step")?.filter(|&s| s != 1) {
            return Err(format!("`decoder_sparse_step` = {step} is not covered (only 1: every layer sparse)"));
        }
        match c.get("mlp_only_layers") {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(v) => return Err(format!("`mlp_only_layers` = {v} is not covered (dense MLP layers; only [])")),
        }
    }
    let inter = match m.inter {
        Some((key, default)) => count(c, key)?.unwrap_or(default),
        None => intermediate,
    };
    let renormalize = match m.renormalize {
        None => true,
        Some((key, default)) => match c.get(key) {
            None | Some(Value::Null) => default,
            Some(v) => v.as_bool().ok_or_else(|| format!("`{key}` must be true or false, got {v}"))?,
        },
    };
    let layout = match m.layout {
        // GPT-OSS: config.json's swiglu_alpha and swiglu_limit (published exports write the limit)
        // over GptOssExperts' constants.
        ExpertLayout::Fused { alpha, limit } => ExpertLayout::Fused {
            alpha: positive(c, "swiglu_alpha")?.map_or(alpha, |v| v as f32),
            limit: positive(c, "swiglu_limit")?.map_or(limit, |v| v as f32),
        },
        split => split,
    };
    Ok(Moe { n_experts, top_k, renormalize, inter, module: m.module, layout })
}

/// Gemma 2's and 3's and GPT-OSS's sliding layers: config.json's `layer_types` ("sliding_attention"
/// or "full_attention" per layer) when present, else the configuration class's default: layer i
/// slides unless (i + 1) is a multiple of `pattern` (Gemma2Config, GptOssConfig: the even layers;
/// Gemma3TextConfig: `_sliding_window_pattern` 6, or as config.json gives it).
fn sliding_layers(c: &Map<String, Value>, n_layers: usize, pattern: usize) -> Result<Vec<bool>, String> {
    let Some(types) = c.get("layer_types").filter(|v| !v.is_null()) else {
        let pattern = count(c, "_sliding_window_pattern")?.unwrap_or(pattern);
        return Ok((0..n_layers).map(|i| !(i + 1).is_multiple_of(pattern)).collect());
    };
    let types = types
        .as_array()
        .filter(|t| t.len() == n_layers)
        .ok_or_else(|| format!("`layer_types` must be a list of num_hidden_layers ({n_layers}) strings"))?;
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(format!("`layer_types` holds {t}; only \"sliding_attention\" and \"full_attention\" are covered")),
        })
        .collect()
}

/// A positive number at `key` (absent or null: `None`).
fn positive(c: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match number(c, key)? {
        Some(v) if !(v > 0.0 && v.is_finite()) => Err(format!("`{key}` must be a positive number, got {v}")),
        v => Ok(v),
    }
}

/// A number at `key` (absent or null: `None`); any other type is an error naming the key.
fn number(c: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| format!("`{key}` must be a number, got {v}")),
    }
}

/// A positive integer at `key` (absent or null: `None`).
fn count(c: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(Some(n as usize)),
            _ => Err(format!("`{key}` must be a positive integer, got {v}")),
        },
    }
}

/// A positive integer that must be present.
fn required(c: &Map<String, Value>, key: &str) -> Result<usize, String> {
    count(c, key)?.ok_or_else(|| format!("`{key}` is missing"))
}

/// A string at `key` (absent or null: `None`).
fn text<'a>(c: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, String> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| format!("`{key}` must be a string, got {v}")),
    }
}
