//! Model-family types: the config.json fields and weights a family reads, its forward pass as a
//! graph of named nodes over [`GRAPH_OPS`], its dtype policy, and rewrites of that graph (mutants).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::types::{RoundingMargin, Tolerance};

/// A config.json field a model family reads.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfigField {
    /// Key in config.json.
    pub key: String,
    /// Role in the engine, e.g. `hidden`, `n_heads`.
    pub role: String,
    /// Whether a config without it is refused.
    #[serde(default)]
    pub required: bool,
    /// The default the HF configuration class applies when the key is absent (as text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// Values the family covers, when only some are (e.g. hidden_act = ["silu"]). Empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub supported: Vec<String>,
    /// A value a published checkpoint of the family sets (as text), which synth writes instead of
    /// the default so that a synthetic checkpoint exercises the key (e.g. Granite's
    /// `residual_multiplier` = 0.22, where the default 1.0 would hide a missing multiply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub example: Option<String>,
    /// The JSON type config.json gives the key, when the role is not one of the fixed ones
    /// (`number`, the default: a number or null, null read as 0; `boolean`, `string`, `list`,
    /// `object`: read as typed by graph expressions). A value of another type is a gap at plan.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub value_type: Option<String>,
    /// A `list` with one entry per decoder layer (e.g. `layer_types`): a list of another length
    /// is refused at plan; its `example` is a repeating pattern (lint and synth repeat it to the
    /// number of layers).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub per_layer: bool,
}

/// The JSON types a [`ConfigField`]'s `type` may name.
pub const CONFIG_TYPES: &[&str] = &["number", "boolean", "string", "list", "object"];

/// A weight tensor of a model family. `{i}` stands for the layer index.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WeightSpec {
    /// Tensor name in model.safetensors, e.g. `model.layers.{i}.self_attn.q_proj.weight`.
    pub name: String,
    /// Role, e.g. `wq`.
    pub role: String,
    /// Symbolic shape in config roles, e.g. `["n_heads*head_dim", "hidden"]`.
    pub shape: Vec<String>,
    /// Absent in some checkpoints (e.g. `lm_head.weight` with tied embeddings).
    #[serde(default)]
    pub optional: bool,
    /// What to use when it is absent.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub doc: String,
}

/// Model-family specifics (kind = model).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelFamily {
    /// config.json `architectures` values routed to this family.
    pub architectures: Vec<String>,
    /// config.json `model_type` values routed to this family.
    pub model_types: Vec<String>,
    /// config.json fields the family reads.
    pub config: Vec<ConfigField>,
    /// config.json keys whose presence (non-null, non-false, not an empty list) means a feature this contract does not cover.
    #[serde(default)]
    pub unsupported_keys: Vec<String>,
    /// Forward-pass features beyond the Llama baseline that the family always has, each one of
    /// [`FAMILY_FEATURES`] (lint refuses any other: the reference forward pass would ignore it); the
    /// resolved config carries them to the oracle and the engine. Empty: plain Llama.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
    /// Weight tensors.
    pub weights: Vec<WeightSpec>,
    /// Kernel contract ids the family needs.
    pub kernels: Vec<String>,
    /// Component contract ids the family needs.
    pub components: Vec<String>,
    /// The forward pass in our own words.
    pub forward: String,
    /// Tolerance on logits of the end-to-end forward, per weight dtype (every one of
    /// [`WEIGHT_DTYPES`]; lint requires each, with its reasoning).
    pub logits_tolerance: BTreeMap<String, Tolerance>,
    /// The bound `ckb conformance` holds the reference's logits to against an independent
    /// implementation's (conformance vectors: transformers in f32 against this f64 reference), with
    /// its reasoning; absent: the f32 logits tolerance, and the report says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conformance: Option<Tolerance>,
    /// How the logits tolerance scales with this checkpoint's own f32 rounding error (absent: it
    /// does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding_margin: Option<RoundingMargin>,
    /// Which weights an engine stores at its weight dtype and which stay f32, and what the reference
    /// rounds (lint requires it of every family).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype_policy: Option<DtypePolicy>,
    /// The forward pass as data: what the reference interprets and an engine computes, node by
    /// node (see [`Graph`]). Lint checks it against `weights` and the kernel registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graph: Option<Graph>,
}

/// The forward pass of one token of a model family as a graph: named nodes in order, each an
/// operation of [`GRAPH_OPS`] (a kernel of the registry or an elementwise primitive) with its inputs
/// and weight bindings. `prologue` runs once (embedding), `layer` once per decoder layer with `{i}`
/// in weight names bound to the layer index, `epilogue` once after the layers; the epilogue's last
/// node is the logits [vocab].
///
/// Inputs name earlier nodes of the same block, or: `token` (the token id, prologue only) and
/// `stream` (the residual stream entering the block: in `layer`, the prologue's last node for
/// layer 0 and the previous layer's last node after; in `epilogue`, the last layer's last node).
/// A node's output is known by its name; trace points are `<name>` in prologue and epilogue and
/// `layers.<i>.<name>` in the layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Graph {
    /// Nodes before the layers.
    pub prologue: Vec<GraphNode>,
    /// Nodes of one decoder layer, repeated `n_layers` times.
    pub layer: Vec<GraphNode>,
    /// Nodes after the layers; the last one yields the logits.
    pub epilogue: Vec<GraphNode>,
    /// Node names every traced forward (`Model::forward_traced`) must report, in whichever block
    /// they are (in every layer for a layer node); the other nodes are reported where computed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trace_required: Vec<String>,
}

/// One node of a [`Graph`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GraphNode {
    /// Name, unique in its block; the trace point of its output.
    pub name: String,
    /// Operation, one of [`GRAPH_OPS`].
    pub op: String,
    /// Inputs in the op's order: earlier node names, `token`, `stream`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<String>,
    /// Weight slot -> tensor name pattern (`{i}`: layer index), each a `[[model.weights]]` name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, String>,
    /// Parameter -> value: a number or an expression over config roles (`hidden`, `head_dim`,
    /// `n_heads`, `sliding_window`, ..., and any other role the family's `[[model.config]]`
    /// declares, e.g. `residual_multiplier`) and `layer` (the layer index, in `layer` nodes), with
    /// `+ - * / %`, `sqrt(..)` and `f32(..)` (round to f32).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
}

/// An operation a graph node may use.
#[derive(Debug, Clone, Copy)]
pub struct GraphOp {
    /// Op name, as a node's `op` spells it.
    pub name: &'static str,
    /// Inputs in order.
    pub inputs: &'static [&'static str],
    /// Weight slots (`?`: optional).
    pub weights: &'static [&'static str],
    /// Parameters (`?`: optional).
    pub params: &'static [&'static str],
    /// What it computes, and which kernel contract defines it.
    pub doc: &'static str,
    /// The kernel contract whose registry kernel it runs (its engine counterpart is tested by
    /// run_kernel_test); None for an elementwise primitive.
    pub kernel: Option<&'static str>,
}

/// Whether `op` is an attention op: it owns a KV cache per layer and takes a `window`.
pub fn is_attention(op: &str) -> bool {
    matches!(op, "attention" | "attention_sinks")
}

/// Whether `op` computes a mixture-of-experts layer's experts from a `moe_route` node's weights
/// (its `experts` parameter is the layer's expert count).
pub fn is_moe_experts(op: &str) -> bool {
    matches!(op, "moe_experts" | "moe_experts_clamped")
}

/// The operations a graph node may use. Kernel ops run the registry's kernels (`oracle::kernels`).
pub const GRAPH_OPS: &[GraphOp] = &[
    GraphOp {
        name: "embedding",
        inputs: &["token"],
        weights: &["table"],
        params: &[],
        doc: "kernel.embedding: the token's row of `table` [vocab, width]",
        kernel: Some("kernel.embedding"),
    },
    GraphOp {
        name: "rms_norm",
        inputs: &["x"],
        weights: &["weight"],
        params: &["eps?", "gain?", "group?"],
        doc: "kernel.rms_norm over groups of len(weight) (per head when weight is [head_dim]); eps defaults to rms_norm_eps; gain `w` (default) or `one_plus_w` (multiply by 1 + w); `group` < len(weight): rows of `group` entries, each scaled by its own slice of the gain (a per-head norm with a whole-projection gain)",
        kernel: Some("kernel.rms_norm"),
    },
    GraphOp {
        name: "linear",
        inputs: &["x"],
        weights: &["weight", "bias?", "tied?"],
        params: &["row_offset?", "rows?"],
        doc: "kernel.linear: x W^T (+ bias), W = weight[row_offset .. row_offset + rows] (a row block of a fused tensor; default all rows); `tied` is used instead of `weight` when config.json ties the embeddings",
        kernel: Some("kernel.linear"),
    },
    GraphOp {
        name: "rope",
        inputs: &["x"],
        weights: &[],
        params: &["heads", "theta?", "scaling?"],
        doc: "kernel.rope at the token's position over `heads` heads of head_dim, half-split pairs (j, j + head_dim/2), base `theta` (default rope_theta; per node, e.g. `rope_parameters[layer_types[layer]].rope_theta` for a base per layer type), with config.json's rope_scaling (`scaling = 0`, a failure rewrite's: without it)",
        kernel: Some("kernel.rope"),
    },
    GraphOp {
        name: "rotary",
        inputs: &["x"],
        weights: &[],
        params: &["heads", "theta?", "rotary_dim?", "interleaved?", "scaling?"],
        doc: "kernel.rotary: RoPE over the first `rotary_dim` entries of each of `heads` heads (default head_dim; even; the rest passes through: partial rotary), pairs (j, j + rotary_dim/2) or, with `interleaved = 1`, (2j, 2j + 1), frequencies theta^(-2j/rotary_dim), base `theta` (default rope_theta), with config.json's rope_scaling over rotary_dim (`scaling = 0`: without it)",
        kernel: Some("kernel.rotary"),
    },
    GraphOp {
        name: "layer_norm",
        inputs: &["x"],
        weights: &["weight?", "bias?"],
        params: &["eps", "group?"],
        doc: "kernel.layer_norm over groups of len(weight) entries (or `group`, or the whole input when neither): (x - mean) / sqrt(biased variance + eps), times the gain and plus the bias when bound (neither: a non-parametric LayerNorm)",
        kernel: Some("kernel.layer_norm"),
    },
    GraphOp {
        name: "gelu_tanh",
        inputs: &["x"],
        weights: &[],
        params: &[],
        doc: "kernel.gelu_tanh: the tanh-approximated GELU of every element (a non-gated MLP's activation)",
        kernel: Some("kernel.gelu_tanh"),
    },
    GraphOp {
        name: "attention",
        inputs: &["q", "k", "v"],
        weights: &[],
        params: &["window?", "scale?", "softcap?", "kv_row?"],
        doc: "kernel.attention with this node's KV cache: q [n_heads*head_dim], k and v [n_kv_heads*head_dim] appended at the position; window > 0 sees only the last `window` positions; scores are q.k * scale (default 1/sqrt(head_dim)), then cap * tanh(score / cap) when softcap = cap > 0, before the softmax; `kv_row = r` (a failure rewrite's): every step's k and v written at row min(r, position) of a zero-filled cache instead",
        kernel: Some("kernel.attention"),
    },
    GraphOp {
        name: "attention_sinks",
        inputs: &["q", "k", "v"],
        weights: &["sinks"],
        params: &["window?", "kv_row?"],
        doc: "kernel.attention_sinks with this node's KV cache: as `attention` (window, kv_row; scale 1/sqrt(head_dim), no soft-cap) with the learned logit `sinks` [n_heads] of each query head added to its softmax's denominator (gpt-oss)",
        kernel: Some("kernel.attention_sinks"),
    },
    GraphOp {
        name: "silu_and_mul",
        inputs: &["gate", "up"],
        weights: &[],
        params: &[],
        doc: "kernel.silu_and_mul: silu(gate) * up",
        kernel: Some("kernel.silu_and_mul"),
    },
    GraphOp {
        name: "gelu_tanh_and_mul",
        inputs: &["gate", "up"],
        weights: &[],
        params: &[],
        doc: "kernel.gelu_tanh_and_mul: gelu_tanh(gate) * up",
        kernel: Some("kernel.gelu_tanh_and_mul"),
    },
    GraphOp {
        name: "moe_route",
        inputs: &["scores"],
        weights: &[],
        params: &["top_k", "renormalize"],
        doc: "kernel.moe_route: a mixture-of-experts router's weights from its logits `scores` [n_experts] (a `linear` node on the normed stream): softmax over all experts, the `top_k` largest kept (equal scores: lower index first), divided by their sum when `renormalize` is 1 (true); [n_experts], 0 for the experts not kept",
        kernel: Some("kernel.moe_route"),
    },
    GraphOp {
        name: "moe_experts",
        inputs: &["x", "route"],
        weights: &["gate", "up", "down"],
        params: &["experts"],
        doc: "kernel.moe_experts: sum over the experts e with route[e] != 0 of route[e] * down_e(silu(gate_e x) * up_e x); `experts` experts, whose weight names give the expert index as `{e}` (one tensor per expert: gate and up [inter, hidden], down [hidden, inter]); `route` is a moe_route node",
        kernel: Some("kernel.moe_experts"),
    },
    GraphOp {
        name: "moe_experts_clamped",
        inputs: &["x", "route"],
        weights: &["gate_up", "gate_up_bias", "down", "down_bias"],
        params: &["experts", "alpha", "limit"],
        doc: "kernel.moe_experts_clamped: gpt-oss's experts, sum over e with route[e] != 0 of route[e] * (a_e down[e] + down_bias[e]), a_e the clamped SwiGLU (up + 1) * gate * sigmoid(alpha gate) of the interleaved gate (even, <= limit) and up (odd, |up| <= limit) entries of x gate_up[e] + gate_up_bias[e]; fused 3-D tensors stored input-major: gate_up [experts, hidden, 2 inter], down [experts, inter, hidden], biases [experts, 2 inter] and [experts, hidden]",
        kernel: Some("kernel.moe_experts_clamped"),
    },
    GraphOp {
        name: "add",
        inputs: &["a", "b"],
        weights: &[],
        params: &[],
        doc: "elementwise a + b (a residual)",
        kernel: None,
    },
    GraphOp {
        name: "scale",
        inputs: &["x"],
        weights: &[],
        params: &["factor"],
        doc: "elementwise x * factor",
        kernel: None,
    },
    GraphOp {
        name: "softcap",
        inputs: &["x"],
        weights: &[],
        params: &["cap"],
        doc: "elementwise cap * tanh(x / cap); the identity when cap <= 0 (a null config value)",
        kernel: None,
    },
    GraphOp {
        name: "clamp",
        inputs: &["x"],
        weights: &[],
        params: &["limit"],
        doc: "elementwise min(max(x, -limit), limit) (OLMo's clip_qkv); the identity when limit <= 0 (a null config value)",
        kernel: None,
    },
];

/// How a family's weights are held by an engine whose weight dtype is not f32 (bf16, f16, int8), and
/// what the reference forward pass rounds so that it runs on the same numbers. Every weight role of
/// the family is in exactly one list. Checkpoints may store any tensor as F32, BF16 or F16; loading
/// widens exactly, then the engine rounds (or quantises) only the `at_weight_dtype` roles.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DtypePolicy {
    /// Weight roles (`[[model.weights]] role`) an engine stores at its weight dtype: the 2-D
    /// matrices (embedding, projections, lm_head). The reference rounds exactly these (bf16/f16
    /// to nearest even, int8 per row as kernel.linear_int8 defines).
    pub at_weight_dtype: Vec<String>,
    /// Weight roles an engine keeps in f32 at every weight dtype (norm gains, biases): widened
    /// exactly from storage, never rounded. A checkpoint whose config.json declares float32
    /// (`torch_dtype` or `dtype`) must store these as F32: a narrower one was rounded on export.
    pub keep_f32: Vec<String>,
    /// Why this split, with its numbers (unit roundoff of each dtype against the effect on logits).
    pub reasoning: String,
}

/// A rewrite of a family's forward-pass graph (a model-level mutant): nodes skipped, parameters
/// replaced, adjacent nodes computed in the opposite order, weights bound as a mistaken engine binds
/// them. Node names are those of `[model.graph]` (in any block; in `layer`, every layer's).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GraphRewrite {
    /// Nodes whose output is replaced by their first input (the node is not computed), e.g.
    /// `["q_norm", "k_norm"]` for a skipped q/k norm. A skipped node's output must have its first
    /// input's width (norms, scales, soft-caps).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skip: Vec<String>,
    /// `node.param` -> expression (as a graph parameter: config roles, `layer`), replacing or
    /// adding that parameter, e.g. `"attn.window" = "sliding_window + 1"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set: BTreeMap<String, String>,
    /// Pairs `[a, b]` of one-input nodes of the same block where b's input is a and nothing else
    /// reads a, computed in the opposite order: b's op on a's input, then a's op on that (e.g.
    /// `["q_norm", "q_rope"]`: the q norm applied after RoPE). Each output is traced under the
    /// name of the op that made it, in the new order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub swap: Vec<[String; 2]>,
    /// `node.slot` (a weight slot of the node's op: `weight`, `bias`, `table`) -> how a mistaken
    /// engine holds that tensor, one of [`WEIGHT_REWRITES`]: `drop` (an optional slot left unbound:
    /// a bias never added), `bf16` or `f16` (rounded to that format, nearest even), `raw` (the
    /// checkpoint's values without the graph's `gain = "one_plus_w"`), `tied` (the node's `tied`
    /// tensor, the input embedding, whatever config.json says; nodes without one are left as they
    /// are).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, String>,
    /// `op.slot` -> as `weights`, for every node of that op, e.g. `"rms_norm.weight" = "bf16"`
    /// (every RMSNorm gain rounded to bf16, whatever the nodes are called).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub op_weights: BTreeMap<String, String>,
}

/// The weight rewrites a [`GraphRewrite`] may give in `weights` and `op_weights`.
pub const WEIGHT_REWRITES: &[&str] = &["drop", "bf16", "f16", "raw", "tied"];

impl ModelFamily {
    /// Whether the tensor named by `pattern` (a `[[model.weights]]` name) stays f32 at every weight
    /// dtype: its role is in the dtype policy's `keep_f32` (norm gains, biases, sinks, including
    /// 2-D ones such as gpt-oss's per-expert biases). False for an unknown name or no policy.
    pub fn keeps_f32(&self, pattern: &str) -> bool {
        let role = self.weights.iter().find(|w| w.name == pattern).map(|w| w.role.as_str());
        self.dtype_policy.as_ref().is_some_and(|p| role.is_some_and(|r| p.keep_f32.iter().any(|k| k == r)))
    }
}

impl GraphRewrite {
    /// The rewrite in words, for a diagnosis: `skip q_norm, k_norm; attn.window = sliding_window + 1`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.skip.is_empty() {
            parts.push(format!("skip {}", self.skip.join(", ")));
        }
        parts.extend(self.set.iter().map(|(k, v)| format!("{k} = {v}")));
        parts.extend(self.swap.iter().map(|[a, b]| format!("{b} before {a}")));
        parts.extend(self.weights.iter().map(|(k, v)| format!("{k} {v}")));
        parts.extend(self.op_weights.iter().map(|(k, v)| format!("every {k} {v}")));
        parts.join("; ")
    }

    /// Whether it changes nothing (no part given).
    pub fn is_empty(&self) -> bool {
        self.skip.is_empty()
            && self.set.is_empty()
            && self.swap.is_empty()
            && self.weights.is_empty()
            && self.op_weights.is_empty()
    }

    /// Node names it mentions, each once (not the ops of `op_weights`).
    pub fn nodes(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        let keyed =
            self.set.keys().chain(self.weights.keys()).map(|k| k.split_once('.').map_or(k.as_str(), |(n, _)| n));
        for n in self.skip.iter().map(String::as_str).chain(self.swap.iter().flatten().map(String::as_str)).chain(keyed)
        {
            if !out.contains(&n) {
                out.push(n);
            }
        }
        out
    }
}
