//! Contract types. One TOML file in `contracts/` deserialises into one [`Contract`]; the JSON Schema
//! that every file is validated against is generated from these types (see [`contract_schema`]).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::family::{GraphRewrite, ModelFamily};

/// The kind of knowledge a contract holds. The id prefix must match (`kernel.`, `component.`, `model.`,
/// `platform.`, `failure.`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A numerical kernel with an oracle and server-owned tests.
    Kernel,
    /// A stateful or structural part of an engine (KV cache, sampler, tokenizer, weight loading).
    Component,
    /// A model family: config.json routing, weight names, and the kernels and components it needs.
    Model,
    /// A hardware platform: figures for the profiler and optimisation guidance.
    Platform,
    /// A known way to get a kernel or model wrong, with its symptom and detection.
    Failure,
    /// A rule the server enforces on engines (e.g. the zero-reference dependency deny list).
    Policy,
}

impl Kind {
    /// The id prefix every contract of this kind carries, e.g. `kernel` for `kernel.rms_norm`.
    pub fn prefix(self) -> &'static str {
        match self {
            Kind::Kernel => "kernel",
            Kind::Component => "component",
            Kind::Model => "model",
            Kind::Platform => "platform",
            Kind::Failure => "failure",
            Kind::Policy => "policy",
        }
    }
}

/// The build phases of an engine, in the order an agent builds them and the gates unlock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Numerical kernels, tested one by one against the oracle.
    Kernels,
    /// Reading config.json and the safetensors weights.
    WeightLoading,
    /// One transformer decoder layer (attention + MLP with residuals).
    DecoderLayer,
    /// All layers, final norm and lm_head: token in, logits out, with a KV cache.
    FullForward,
    /// Tokenizer, sampler and the decode loop.
    Generation,
    /// Several sequences per step: block manager, paged KV cache, batched forward, scheduler
    /// (planned only with serving constraints).
    Batching,
    /// The engine's binary and its OpenAI-compatible server (planned only with serving constraints).
    Serving,
    /// Speed on the target platform.
    Performance,
}

impl Phase {
    /// All phases in build order.
    pub const ALL: [Phase; 8] = [
        Phase::Kernels,
        Phase::WeightLoading,
        Phase::DecoderLayer,
        Phase::FullForward,
        Phase::Generation,
        Phase::Batching,
        Phase::Serving,
        Phase::Performance,
    ];

    /// The snake_case name used in files and reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Kernels => "kernels",
            Phase::WeightLoading => "weight_loading",
            Phase::DecoderLayer => "decoder_layer",
            Phase::FullForward => "full_forward",
            Phase::Generation => "generation",
            Phase::Batching => "batching",
            Phase::Serving => "serving",
            Phase::Performance => "performance",
        }
    }
}

/// Where a piece of knowledge comes from (paper, model card, specification, measurement).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Source {
    /// Short citation, e.g. "Zhang & Sennrich 2019, Root Mean Square Layer Normalization".
    pub title: String,
    /// Where to find it (arXiv id, URL or document section).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locator: Option<String>,
}

/// A tensor argument of a kernel, with a symbolic shape.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    /// Argument name as it appears in the Rust signature.
    pub name: String,
    /// Symbolic shape, outermost first, e.g. `["rows", "dim"]`; `[]` for a scalar.
    pub shape: Vec<String>,
    /// Element type, e.g. `f32`, `u32`, `usize`.
    pub dtype: String,
    /// What the tensor holds.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub doc: String,
}

/// A scalar parameter (eps, theta, ...).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Param {
    /// Name as it appears in the signature or config.json.
    pub name: String,
    /// Element type.
    pub dtype: String,
    /// The usual value, where there is one (as text, e.g. "1e-6"). With `config_key` set, the value an
    /// engine uses when config.json lacks that key; the lint requires it to equal the default every model
    /// family naming this kernel states for the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// The config.json key a model family supplies this parameter from (e.g. `rms_norm_eps` for
    /// RMSNorm's `eps`), where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_key: Option<String>,
    /// What it means and where its value comes from.
    pub doc: String,
}

/// Accepted error of an engine's output against the f64 oracle, for one dtype:
/// `|got - want| <= atol + rtol * |want|` element by element.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    /// Absolute part.
    pub atol: f64,
    /// Relative part.
    pub rtol: f64,
    /// Why these numbers (accumulation order, reduction length K, unit roundoff of the dtype).
    pub reasoning: String,
}

/// A scale-aware logits tolerance: at each generation step the absolute tolerance is
/// `max(atol, factor * d)`, where `d` is the largest |difference| between the reference's logits
/// and the same reference's with every activation rounded to f32 (an engine's storage rounding),
/// teacher-forced on the same tokens. On ordinary checkpoints `d` is far below atol and nothing
/// changes; where large activations make f32 arithmetic inexact (a weight of 7e4, say), the
/// tolerance grows with the error any f32 engine must make there, not with the engine's.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RoundingMargin {
    /// The multiple of the reference's own f32 rounding error allowed (an engine also rounds
    /// inside every reduction, and accumulates in another order).
    pub factor: f64,
    /// Why this factor.
    pub reasoning: String,
}

/// One server-owned test case of a kernel: a named set of symbolic dimensions with their ranges.
/// Each run draws concrete sizes within the ranges from a fresh seed.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TestCase {
    /// Case name, e.g. "small", "gqa-long", "large-magnitude".
    pub name: String,
    /// Inclusive ranges per symbolic dimension, e.g. `{ dim = [1, 512] }`.
    pub dims: BTreeMap<String, [u64; 2]>,
    /// Scale of the random input values (uniform in [-scale, scale]); adversarial cases use large values.
    #[serde(default = "one")]
    pub scale: f64,
    /// What the case is meant to catch.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub doc: String,
    /// The name of a mutant of the kernel (a failure mode's `mutant`) this case must expose: cases
    /// are drawn again until that mutant's output differs from the oracle's (another index, or a
    /// value off by more than 1e-3 of its size), so the failure mode is caught on every run, not on
    /// the runs whose random draw happens to show it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exposes: Option<String>,
}

fn one() -> f64 {
    1.0
}

/// The part of an engine crate a contract fixes: the module and the Rust items the gates call.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RustApi {
    /// Module file of the engine crate, e.g. `kernels` for `src/kernels.rs`.
    pub module: String,
    /// The public items with `todo!()` bodies, exactly as the scaffold writes them.
    pub skeleton: String,
    /// Names of skeleton functions an engine may lack because they were added after it was
    /// scaffolded (e.g. `stop_tokens`). The signature rule checks such an item only when the engine
    /// defines a function of that name; the gates call it when present and otherwise use the
    /// server's own value and say so. Empty: every item is required.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub optional: Vec<String>,
}

/// A regex pre-tokenizer pattern a tokenizer contract covers, as data: tokenizer.json's
/// `Split` pattern (`{"Regex": ...}`, behavior `Isolated`, invert false) must equal `regex` exactly.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SplitPattern {
    /// Short name used in plans and messages, e.g. `llama3`.
    pub name: String,
    /// The pattern, character for character as tokenizer.json writes it.
    pub regex: String,
    /// Which tokenizers use it, and where the pattern is published.
    pub doc: String,
}

/// What a tokenizer contract covers of tokenizer.json, component by component (kind = component,
/// `[tokenizer]`). plan_engine describes a model's tokenizer.json as a list of component names
/// (`model BPE`, `normalizer NFC`, `pre_tokenizer Split(llama3)`, ...; `Sequence`s flattened) and
/// routes it to the contract covering every one, or names the ones no contract covers.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizerFamily {
    /// `model.type` values and BPE options covered: `BPE`, and `byte_fallback`, `fuse_unk`,
    /// `ignore_merges` when set to true in the file.
    pub model: Vec<String>,
    /// Normalizer types covered (none is always covered), e.g. `NFC`, `Prepend`, `Replace`.
    #[serde(default)]
    pub normalizers: Vec<String>,
    /// Pre-tokenizer types covered (none is always covered), e.g. `ByteLevel`, `Metaspace`;
    /// `Split` is covered through `split_patterns`.
    #[serde(default)]
    pub pre_tokenizers: Vec<String>,
    /// Regex patterns of `Split` covered (and the one `ByteLevel` with `use_regex: true` implies,
    /// named `gpt2`).
    #[serde(default)]
    pub split_patterns: Vec<SplitPattern>,
    /// Decoder types covered, e.g. `ByteLevel`, `Replace`, `ByteFallback`.
    pub decoders: Vec<String>,
    /// Post-processor types covered (none is always covered), e.g. `TemplateProcessing`, `ByteLevel`.
    #[serde(default)]
    pub post_processors: Vec<String>,
}

/// Platform specifics (kind = platform).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Platform {
    /// Target name used in constraints (`--target`).
    pub target: String,
    /// Dtypes the platform contracts cover.
    pub dtypes: Vec<String>,
    /// Memory read bandwidth per thread count in GB/s, measured or published (see `sources`).
    #[serde(default)]
    pub bandwidth_gbs: BTreeMap<String, f64>,
    /// Peak f32 GFLOP/s per thread count.
    #[serde(default)]
    pub peak_gflops_f32: BTreeMap<String, f64>,
    /// SIMD width in bits of the widest vector unit assumed (0 on a GPU platform).
    #[serde(default)]
    pub simd_bits: u32,
    /// CPU architecture as Rust's `std::env::consts::ARCH` names it (`x86_64`, `aarch64`), when the
    /// platform is one architecture. The gates run an engine on the server's own host: on a host of
    /// another architecture they exercise the engine's portable code path, and profile_engine takes
    /// its roofline figures from the host instead of this contract. Empty: the host's architecture.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub arch: String,
    /// Optimisation guidance, most effective first.
    pub guidance: Vec<String>,
    /// Guidance per kernel contract id (a dtype variant falls back to the kernel it replaces), with
    /// the measured effect where known; profile_engine quotes it for the kernel that bounds decode.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kernel_guidance: BTreeMap<String, Vec<String>>,
    /// Which signatures an engine on this platform exposes: `host` (the kernel contracts' `rust`
    /// skeletons, host slices) or `cuda` (their `cuda` skeletons: device buffers through cudarc, a
    /// stream). Default `host`.
    #[serde(default = "host_api", skip_serializing_if = "is_host_api")]
    pub api: String,
    /// Component contracts every engine on this platform implements besides its family's (e.g. the
    /// CUDA device handle and on-device decoding).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<String>,
    /// GPU figures (kind platform with `api = "cuda"`): device properties, peak rates, and per
    /// device model its memory and bandwidth, each figure with its source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Gpu>,
}

fn host_api() -> String {
    API_HOST.into()
}

fn is_host_api(s: &String) -> bool {
    s == API_HOST
}

/// [`Platform::api`] of host engines: host slices, the `rust` skeletons.
pub const API_HOST: &str = "host";
/// [`Platform::api`] of CUDA engines: device buffers and a stream, the `cuda` skeletons.
pub const API_CUDA: &str = "cuda";

/// One published or measured figure and where it comes from.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Figure {
    /// The value, in the unit its field names.
    pub value: f64,
    /// Where it comes from (datasheet, whitepaper, measurement with its date and machine).
    pub source: String,
}

/// The figures of one GPU architecture (a CUDA compute capability).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// CUDA compute capability, e.g. `9.0`; an engine's kernels are compiled for it.
    pub compute_capability: String,
    /// The architecture name NVRTC and nvcc take (`--gpu-architecture`), e.g. `sm_90`.
    pub arch: String,
    /// Streaming multiprocessors.
    pub sm_count: Figure,
    /// Level-2 cache, MiB.
    pub l2_mib: Figure,
    /// Shared memory per SM (configurable with L1), KiB.
    pub smem_per_sm_kib: Figure,
    /// Dense peak TFLOP/s by unit and dtype: `bf16_tensor`, `f16_tensor`, `tf32_tensor`, `f32` (CUDA cores).
    pub peak_tflops: BTreeMap<String, Figure>,
    /// Device models of this architecture, each with its memory and bandwidth.
    pub devices: Vec<GpuDevice>,
}

/// One device model of a GPU platform (memory differs between models of one architecture).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuDevice {
    /// Model name as the CUDA driver reports it, matched as a substring (e.g. `H200`).
    pub name: String,
    /// Device memory, GB.
    pub memory_gb: Figure,
    /// Nominal HBM bandwidth, GB/s: the decode roofline.
    pub hbm_gbs: Figure,
    /// Bandwidth measured on such a device (a device-to-device copy), GB/s, when one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_gbs: Option<Figure>,
}

impl Gpu {
    /// The device model whose `name` occurs in the driver's device name (e.g. `NVIDIA H200`).
    pub fn device(&self, reported: &str) -> Option<&GpuDevice> {
        self.devices.iter().find(|d| reported.contains(&d.name))
    }
}

/// The CUDA variant of a kernel contract's signature: the same math on device buffers (cudarc
/// `CudaView`/`CudaViewMut` on the engine's stream), with its launch mapping and its tolerances.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CudaApi {
    /// Module file of the engine crate, e.g. `kernels`.
    pub module: String,
    /// The public items with `todo!()` bodies, exactly as the scaffold writes them for `api = "cuda"`.
    pub skeleton: String,
    /// How the work maps onto threads, warps and blocks, in our own words.
    pub launch: String,
    /// Tolerance against the f64 oracle per activation dtype on the device (`f32`: f32 buffers,
    /// bf16 storage of the weights where the kernel says so, f32 accumulation), with the reasoning
    /// for the device's summation order and math functions.
    pub tolerance: BTreeMap<String, Tolerance>,
}

/// Failure-mode specifics (kind = failure).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FailureMode {
    /// What the gate sees.
    pub symptom: String,
    /// What is wrong in the code.
    pub root_cause: String,
    /// How the server tells it apart.
    pub detection: String,
    /// What to change.
    pub fix: String,
    /// Id of the oracle mutant that reproduces it, if one exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutant: Option<String>,
    /// A model-level mutant as a rewrite of the family's forward-pass graph (`[model.graph]`): the
    /// reference with this rewrite is what an engine with this failure computes. Tried by the
    /// diagnosis of verify_generation on the families of `applies_to` (and those listing this
    /// failure in `failure_modes`) whose graph has every node it names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite: Option<GraphRewrite>,
    /// Contract ids this failure mode belongs to.
    pub applies_to: Vec<String>,
}

/// One entry of a dependency deny list.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DenyEntry {
    /// Crate name, or a prefix pattern ending in `*` (e.g. `candle-*`).
    pub pattern: String,
    /// Why it is denied.
    pub reason: String,
}

/// Policy specifics (kind = policy).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Crates an engine may not depend on, directly or transitively.
    #[serde(default)]
    pub deny: Vec<DenyEntry>,
    /// Per target, the only crates an engine may depend on (stricter than the deny list); a target
    /// without an entry has no allow list.
    #[serde(default)]
    pub allow: BTreeMap<String, Vec<String>>,
    /// Per target, the crates an engine for it may depend on beyond general-purpose ones, each with
    /// why it is not an inference framework (e.g. cudarc for `cuda`: bindings of the driver, NVRTC
    /// and cuBLAS). A permitted pattern may not match a deny entry (lint).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub permit: BTreeMap<String, Vec<DenyEntry>>,
}

impl DenyEntry {
    /// Whether a crate name matches this entry (exact, or prefix when the pattern ends in `*`).
    pub fn matches(&self, name: &str) -> bool {
        match self.pattern.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == self.pattern,
        }
    }
}

/// One contract of the knowledge base. Fields beyond the common ones are required by kind; the
/// lint in [`crate::lint`] says which.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Contract {
    /// Stable id, `<kind>.<name>`, e.g. `kernel.rms_norm`.
    pub id: String,
    /// Kind of contract; must match the id prefix.
    pub kind: Kind,
    /// Version, bumped on every amendment; outcomes record the version they ran under.
    pub version: u32,
    /// One-line summary.
    pub summary: String,
    /// Build phase this contract belongs to (kernels and components).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Exact semantics in notation.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub math: String,
    /// Inputs with symbolic shapes and dtypes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<TensorSpec>,
    /// Outputs with symbolic shapes and dtypes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<TensorSpec>,
    /// Scalar parameters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parameters: Vec<Param>,
    /// Tolerance per dtype against the f64 oracle.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tolerance: BTreeMap<String, Tolerance>,
    /// What must hold before a call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preconditions: Vec<String>,
    /// The Rust items the engine must expose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rust: Option<RustApi>,
    /// Pseudocode, in our own words.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pseudocode: String,
    /// Failure-mode contract ids.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failure_modes: Vec<String>,
    /// Server-owned test cases (kernels).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub test_cases: Vec<TestCase>,
    /// Other contract ids this one builds on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
    /// Where the knowledge comes from.
    pub sources: Vec<Source>,
    /// Model-family section (kind = model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelFamily>,
    /// Platform section (kind = platform).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// Failure-mode section (kind = failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureMode>,
    /// Policy section (kind = policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
    /// Weight-dtype variant section (kernels only): this kernel takes the place of another one in
    /// engines whose weights are stored in `weight_dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<KernelVariant>,
    /// Tokenizer section (components only): which tokenizer.json components this contract covers;
    /// plan routes a model's tokenizer to the contract covering all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerFamily>,
    /// The CUDA variant of the signature (kernels): what an engine on a platform with `api = "cuda"`
    /// exposes in place of `rust`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaApi>,
}

impl Contract {
    /// The Rust items an engine on a platform of `api` exposes for this contract: the `cuda`
    /// skeleton for [`API_CUDA`] where the contract has one, else `rust`.
    pub fn api_for(&self, api: &str) -> Option<RustApi> {
        match (&self.cuda, api) {
            (Some(c), API_CUDA) => Some(RustApi {
                module: c.module.clone(),
                skeleton: c.skeleton.clone(),
                optional: self.rust.as_ref().map(|r| r.optional.clone()).unwrap_or_default(),
            }),
            _ => self.rust.clone(),
        }
    }
}

/// Forward-pass features a model-family contract may list in `[model] features`, with what each one
/// changes against plain Llama. The reference forward pass (`oracle::llama`) and `model::resolve`
/// implement exactly these; a contract naming any other is refused by lint.
pub const FAMILY_FEATURES: &[(&str, &str)] = &[
    ("qkv_bias", "q, k and v projections add a bias (`self_attn.{q,k,v}_proj.bias`)"),
    ("qk_norm", "every query and key head is RMS-normalised before RoPE (`self_attn.{q,k}_norm.weight`, [head_dim])"),
    ("sliding_window", "attention sees only the last `sliding_window` positions (config.json; null: full attention)"),
    ("gelu_tanh_mlp", "the MLP gate uses tanh-approximated GELU instead of SiLU (GeGLU)"),
    ("rmsnorm_one_plus_w", "RMSNorm multiplies by (1 + w) instead of w"),
    ("embed_scale_sqrt_hidden", "the embedding row is multiplied by sqrt(hidden), rounded to f32"),
    (
        "fused_qkv",
        "q, k and v weights are one tensor `self_attn.qkv_proj.weight` of shape [(n_heads + 2 n_kv_heads) head_dim, hidden]: the q rows, then the k rows, then the v rows (with qkv_bias, `self_attn.qkv_proj.bias` in the same order)",
    ),
    (
        "fused_gate_up",
        "gate and up weights are one tensor `mlp.gate_up_proj.weight` of shape [2 intermediate, hidden]: the gate rows, then the up rows",
    ),
];

/// Weight dtypes an engine may store its 2-D weights in; activations and accumulation stay f32.
/// `int8` is weight-only symmetric quantisation with one f32 scale per output row.
pub const WEIGHT_DTYPES: &[&str] = &["f32", "bf16", "f16", "int8"];

/// A kernel that replaces another one for engines storing their weights in another dtype, e.g.
/// `kernel.linear_bf16` is `kernel.linear` for bf16 weights. Plans and the gates pick it from the
/// engine's dtype constraint.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KernelVariant {
    /// The kernel contract this one replaces, e.g. `kernel.linear`.
    pub of: String,
    /// Storage dtype of the weights this variant reads: one of [`WEIGHT_DTYPES`] other than `f32`.
    pub weight_dtype: String,
}

/// The JSON Schema (draft 2020-12) every contract file is validated against, generated from [`Contract`].
pub fn contract_schema() -> serde_json::Value {
    let mut settings = schemars::generate::SchemaSettings::draft2020_12();
    settings.inline_subschemas = true;
    let schema = settings.into_generator().into_root_schema_for::<Contract>();
    let mut v = serde_json::to_value(schema).expect("a generated schema serialises");
    portable(&mut v);
    // The graph language (ops, parameters, expression grammar) as an annotation JSON Schema
    // validators ignore: what `[model.graph]` may say, beyond its types.
    if let Some(o) = v.as_object_mut() {
        o.insert("x-graph-language".into(), super::graph::language());
    }
    v
}

/// Make a generated schema portable, recursively: no `$schema`/`$defs`, no null in type unions,
/// `anyOf`/`oneOf` with a null branch collapsed to the other branch (so errors point at the real
/// field), every array with `items`. Used for contract files (TOML has no null) and MCP tool schemas.
pub fn portable(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(o) => {
            o.remove("$schema");
            o.remove("$defs");
            o.remove("definitions");
            if o.get("default").is_some_and(Value::is_null) {
                o.remove("default");
            }
            // type: [T, "null"] -> T
            if let Some(Value::Array(types)) = o.get("type") {
                let kept: Vec<Value> = types.iter().filter(|t| t.as_str() != Some("null")).cloned().collect();
                let new = if kept.len() == 1 { kept[0].clone() } else { Value::Array(kept) };
                o.insert("type".into(), new);
            }
            // anyOf/oneOf [X, {type: null}] -> X merged in place
            for key in ["anyOf", "oneOf"] {
                if let Some(Value::Array(alts)) = o.get(key) {
                    let kept: Vec<Value> = alts
                        .iter()
                        .filter(|a| a.get("type").and_then(Value::as_str) != Some("null"))
                        .cloned()
                        .collect();
                    if kept.len() == 1 {
                        o.remove(key);
                        if let Value::Object(inner) = kept[0].clone() {
                            for (k, val) in inner {
                                o.entry(k).or_insert(val);
                            }
                        }
                    } else {
                        o.insert(key.into(), Value::Array(kept));
                    }
                }
            }
            if o.get("type").and_then(Value::as_str) == Some("array") && !o.contains_key("items") {
                o.insert("items".into(), serde_json::json!({}));
            }
            for (_, child) in o.iter_mut() {
                portable(child);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(portable),
        _ => {}
    }
}
