//! plan_engine: from constraints (model directory, target, dtype) to the phases in build order, each
//! with its contracts and the gates that check it, and goals in the family's own terms. Reads
//! config.json, generation_config.json, tokenizer.json (routed to a tokenizer contract) and the
//! weight files' headers when present (layout and stored dtypes; the values only for dtype f16, to find
//! a weight beyond its range).

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use base::error::{Context, Error, Result};
use ckb::{Kind, Phase, SkippedFile};
use model::tokenizer::TokenizerRoute;
use model::{self, Files, Gap, GenerationConfig, ResolvedConfig};

/// Constraints of the engine to build.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    /// Hugging Face model directory (config.json is read; weights are not needed to plan).
    pub model: String,
    /// Target platform name, e.g. `cpu`.
    #[serde(default = "default_target")]
    pub target: String,
    /// Weight and activation dtype, e.g. `f32`.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Platform contract id, where several share the target (`cuda`: `platform.cuda-sm90` for
    /// H100/H200, `platform.cuda-sm80` for A100); absent: the target's only platform.
    #[serde(default)]
    pub platform: Option<String>,
    /// Serving constraints (max_seqs, max_context, block_size, kv_blocks, max_batch_tokens,
    /// sampling): the plan then adds the batching and serving phases and checks that the KV cache
    /// holds the concurrency asked for. Absent: a batch-1 greedy library.
    #[serde(default)]
    pub serving: Option<manifest::Serving>,
}

fn default_target() -> String {
    "cpu".into()
}
fn default_dtype() -> String {
    "f32".into()
}

/// One phase of the build.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PhasePlan {
    /// Phase name, in build order: kernels, weight_loading, decoder_layer, full_forward, generation, performance.
    pub phase: String,
    /// Contract ids the phase implements.
    pub contracts: Vec<String>,
    /// Tools whose pass unlocks the next phase.
    pub gates: Vec<String>,
    /// What to build.
    pub goal: String,
}

/// The plan.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PlanReport {
    /// Whether the knowledge base covers these constraints: no gaps. A plan through a staged
    /// candidate is covered too, provisionally: `provisional` lists the candidates and
    /// `missing_evidence` what would promote each.
    pub covered: bool,
    /// Model-family contract id, "" when not routed.
    pub family: String,
    /// Platform contract id, "" when the target is not covered.
    pub platform: String,
    /// dtype asked for.
    pub dtype: String,
    /// The config as the engine must read it (defaults applied); absent when not covered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<ResolvedConfig>,
    /// Why the constraints are not covered: config.json fields, target or dtype.
    pub gaps: Vec<Gap>,
    /// Staged candidates (`id@version`) the plan routes through because no promoted contract covers
    /// the constraints: the engine can be scaffolded and gated under them, and a passing
    /// verify_generation (or verified profile_engine) promotes a platform, and a passing `ckb
    /// conformance` on an independent implementation's vectors promotes a model family. Empty when
    /// every contract is promoted.
    pub provisional: Vec<String>,
    /// For each staged candidate of `provisional`, in its order: the evidence that would promote
    /// it (a family: `ckb conformance` on vectors another implementation wrote; a platform: a
    /// passing verify_generation under it). Empty when not provisional.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_evidence: Vec<String>,
    /// Staged candidates (`id@version`) that claim this model's architecture but do not route it:
    /// an established family claims it too and routes first, so this plan (and every gate) is
    /// made for that family, not for the candidate. To change how the family computes, propose an
    /// amendment of the established contract (same id). Empty when none does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shadowed: Vec<String>,
    /// Phases in build order.
    pub phases: Vec<PhasePlan>,
    /// Contract files left out of the knowledge base as invalid (`--skip-invalid`), each with its
    /// reason; this plan was made without them. Empty when every file loaded.
    #[serde(default)]
    pub skipped_contracts: Vec<SkippedFile>,
    /// tokenizer.json routed to its tokenizer contract; absent when not covered (see `gaps`) or when
    /// the directory has no tokenizer.json (then not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerRoute>,
    /// The weight files as their headers describe them; absent when the directory has none yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsSummary>,
    /// Stop tokens and length limit (generation_config.json, else config.json).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationConfig>,
    /// With serving constraints: the KV cache they imply (absent without them or without a config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<KvCachePlan>,
}

/// The weight files of a checkpoint, from their headers.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct WeightsSummary {
    /// Sharded through model.safetensors.index.json.
    pub sharded: bool,
    /// Weight files.
    pub files: Vec<String>,
    /// Number of tensors.
    pub tensors: usize,
    /// Tensors per stored dtype (`F32`, `BF16`, `F16`).
    pub dtypes: std::collections::BTreeMap<String, usize>,
    /// Bytes of tensor data.
    pub bytes: u64,
}

/// The paged KV cache serving constraints imply for a model.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct KvCachePlan {
    /// Blocks in the pool.
    pub blocks: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Bytes of one block over all layers, K and V, f32: 2 * n_layers * block_size * n_kv_heads *
    /// head_dim * 4.
    pub bytes_per_block: u64,
    /// Bytes of the whole pool, MiB.
    pub total_mib: f64,
    /// Sequences of max_context tokens the pool holds at once (blocks / ceil(max_context / block_size)).
    pub full_sequences: usize,
}

impl Report for PlanReport {
    fn passed(&self) -> bool {
        self.covered
    }
    fn text(&self) -> String {
        let mut s = if self.covered && self.provisional.is_empty() {
            format!("covered: {} on {} in {}\n", self.family, self.platform, self.dtype)
        } else if self.covered {
            format!(
                "covered provisionally: {} on {} in {}, through staged candidate(s) {}; missing evidence: {}\n",
                self.family,
                self.platform,
                self.dtype,
                self.provisional.join(", "),
                self.missing_evidence.join("; ")
            )
        } else {
            format!("not covered ({} gap(s))\n", self.gaps.len())
        };
        if !self.shadowed.is_empty() {
            s += &format!(
                "note: staged candidate(s) {} claim this architecture too, but {} is established and routes first: the plan and the gates are for it; to change how the family computes, propose an amendment of {} (same id)\n",
                self.shadowed.join(", "),
                self.family,
                self.family
            );
        }
        for g in &self.gaps {
            s += &format!("  gap {}: {}\n", g.field, g.reason);
        }
        if let Some(c) = &self.config {
            s += &format!(
                "config: hidden {} intermediate {} layers {} heads {}/{} kv head_dim {} vocab {} max_seq {} eps {} theta {}{} tied {}\n",
                c.hidden,
                c.intermediate,
                c.n_layers,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim,
                c.vocab,
                c.max_seq,
                c.rms_norm_eps,
                c.rope_theta,
                c.rope_scaling
                    .as_ref()
                    .map(|r| format!(" rope_scaling {} factor {}", r.rope_type, r.factor))
                    .unwrap_or_default(),
                c.tied
            );
        }
        match &self.tokenizer {
            Some(t) => s += &format!("tokenizer: {} ({})\n", t.contract, t.parts.join(", ")),
            None if self.gaps.iter().all(|g| g.field != "tokenizer") => {
                s += "tokenizer: no tokenizer.json in the model directory, not checked\n";
            }
            None => {}
        }
        if let Some(w) = &self.weights {
            s += &format!(
                "weights: {} tensors in {} file(s){}, {:.1} MB, stored {:?}\n",
                w.tensors,
                w.files.len(),
                if w.sharded { " (sharded)" } else { "" },
                w.bytes as f64 / 1e6,
                w.dtypes
            );
        }
        if let Some(g) = &self.generation {
            s += &format!(
                "stop tokens: {:?} ({})\n",
                g.eos_token_ids,
                if g.source.is_empty() { "none stated" } else { &g.source }
            );
        }
        if let Some(kv) = &self.kv_cache {
            s += &format!(
                "kv cache: {} blocks of {} positions, {:.1} MiB (f32), holds {} sequences of max_context\n",
                kv.blocks, kv.block_size, kv.total_mib, kv.full_sequences
            );
        }
        for f in &self.skipped_contracts {
            s += &format!("skipped invalid contract file {f}\n");
        }
        for (i, p) in self.phases.iter().enumerate() {
            s += &format!(
                "{}. {}: {} | gates: {}\n   {}\n",
                i + 1,
                p.phase,
                p.contracts.join(", "),
                p.gates.join(", "),
                p.goal
            );
        }
        s
    }
}

/// Plan an engine.
///
/// # Errors
/// Unreadable model directory (missing config.json, bad JSON). An uncovered architecture is a
/// report with gaps, not an error.
pub fn plan(ctx: &Ctx, req: &PlanRequest) -> Result<PlanReport> {
    let started = std::time::Instant::now();
    let live = ctx.live();
    let ctx = &*live;
    let report = plan_only(ctx, req)?;
    let ids: Vec<&str> = report.phases.iter().flat_map(|p| p.contracts.iter().map(String::as_str)).collect();
    let figures = ledger::figures::Figures::Plan(ledger::figures::PlanFigures {
        family: report.family.clone(),
        gaps: report.gaps.iter().map(|g| g.field.clone()).collect(),
    });
    ctx.record("plan_engine", None, ctx.versioned(&ids), &report, figures, started);
    Ok(report)
}

/// [`plan`] without recording an outcome (used inside scaffold). Routes with `ctx` as given: pass
/// [`Ctx::live`] to include staged candidates.
///
/// # Errors
/// As [`plan`].
pub fn plan_only(ctx: &Ctx, req: &PlanRequest) -> Result<PlanReport> {
    let dir = ctx.confine_model(Path::new(&req.model))?;
    let config = model::read_config(&dir)?;
    let mut gaps = Vec::new();
    let family = match model::route(&ctx.ckb, &config) {
        Ok(c) => Some(c),
        Err(g) => {
            gaps.extend(g);
            None
        }
    };
    let resolved = family.and_then(|f| match model::resolve(f, &config) {
        Ok(r) => Some(r),
        Err(g) => {
            gaps.extend(g);
            None
        }
    });
    // What config.json says about each layer must be what the family's graph computes.
    if let (Some(f), Some(cfg)) = (family, &resolved)
        && let Some(m) = f.model.as_ref()
    {
        gaps.extend(super::preconditions::gaps(&f.id, m, cfg, &config));
    }
    // tokenizer.json: routed to a tokenizer contract before any code is written; its ids checked
    // against the vocabulary.
    // A directory without tokenizer.json (config only) plans without it, as without weights: a
    // missing file is not a gap in the knowledge base, and verify_generation names it.
    let tokenizer = if !dir.has("tokenizer.json") {
        None
    } else {
        let json = model::tokenizer::read_tokenizer_json(&dir)?;
        let checked = match &resolved {
            Some(cfg) => Some(model::tokenizer::check_ids(&dir.show("tokenizer.json"), &json, cfg.vocab)?),
            None => None,
        };
        match model::tokenizer::route_tokenizer(&ctx.ckb, &json) {
            Ok((c, parts)) => {
                let (vocab_entries, special_tokens) = checked.unwrap_or_default();
                Some(TokenizerRoute {
                    contract: c.id.clone(),
                    parts: parts.iter().map(ToString::to_string).collect(),
                    vocab_entries,
                    special_tokens,
                })
            }
            Err(g) => {
                gaps.extend(g);
                None
            }
        }
    };
    // Weights: the layout (single or sharded, every shard present and agreeing with the index) and
    // the stored dtypes against the family's dtype policy, from the headers only.
    let weights = if model::weights::has_weights(&dir) {
        let layout = model::weight_layout(&dir)?;
        if let (Some(f), Some(cfg)) = (family, &resolved) {
            model::check_dtype_policy(f, cfg, &config, &layout)?;
        }
        // f16 is the one weight dtype narrower in range than the checkpoint's BF16/F32: the values
        // are read (only then) to find a weight that would round to infinity.
        if req.dtype == "f16" && layout.tensors.values().any(|t| t.dtype != "F16") {
            let tensors = model::weights::read_layout(&dir, &layout)?;
            if let Err(e) = model::check_weight_range(&tensors, &req.dtype) {
                gaps.push(Gap { field: "dtype".into(), reason: e.message });
            }
        }
        Some(WeightsSummary {
            sharded: layout.sharded,
            files: layout.files.clone(),
            tensors: layout.tensors.len(),
            dtypes: layout.dtype_counts(),
            bytes: layout.data_bytes(),
        })
    } else {
        None
    };
    let generation = match &resolved {
        Some(cfg) => Some(model::read_generation_config(&dir, cfg.vocab)?),
        None => None,
    };
    let mut platform_gap = false;
    let platform = match ctx.ckb.platform_of(&req.target, req.platform.as_deref()) {
        Ok(p) => p,
        Err(reason) => {
            gaps.push(Gap { field: "platform".into(), reason });
            platform_gap = true;
            None
        }
    };
    let plat = platform.and_then(|p| p.platform.as_ref());
    let api = plat.map(|p| p.api.as_str()).unwrap_or(ckb::API_HOST);
    match platform {
        None if platform_gap => {}
        None => gaps.push(Gap {
            field: "target".into(),
            reason: format!(
                "no platform contract for target `{}`; covered: {}",
                req.target,
                ctx.ckb
                    .of_kind(Kind::Platform)
                    .map(|c| c.platform.as_ref().unwrap().target.clone())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
        Some(p) if !p.platform.as_ref().unwrap().dtypes.contains(&req.dtype) => gaps.push(Gap {
            field: "dtype".into(),
            reason: format!("{} covers dtypes {:?}, not `{}`", p.id, p.platform.as_ref().unwrap().dtypes, req.dtype),
        }),
        Some(_) => {}
    }
    let mut phases = Vec::new();
    if let Some(f) = family {
        let m = f.model.as_ref().unwrap();
        let mut kernels = match ctx.ckb.kernels_for(f, &req.dtype) {
            Ok(k) => k,
            Err(reason) => {
                gaps.push(Gap { field: "dtype".into(), reason });
                m.kernels.clone()
            }
        };
        let mut components = m.components.clone();
        if let Some(sv) = &req.serving {
            for k in super::serving_kernels(sv) {
                if !kernels.iter().any(|x| x == k) {
                    kernels.push(k.to_string());
                }
            }
            components.extend(super::SERVING_COMPONENTS.iter().map(|c| c.to_string()));
        }
        // A CUDA platform routes every kernel to its CUDA signature: each needs one.
        if api == ckb::API_CUDA {
            for k in &kernels {
                if ctx.ckb.get(k).map(|c| c.cuda.is_none()).unwrap_or(true) {
                    gaps.push(Gap {
                        field: "target".into(),
                        reason: format!(
                            "{k} has no CUDA signature ([cuda] section), so no CUDA engine can implement it"
                        ),
                    });
                }
            }
        }
        // The tokenizer component is the contract tokenizer.json routes to.
        let components = components.iter().map(|c| match &tokenizer {
            Some(t) if ctx.ckb.get(c).is_ok_and(|c| c.tokenizer.is_some()) => t.contract.as_str(),
            _ => c.as_str(),
        });
        let mut ids: Vec<&str> = kernels.iter().map(String::as_str).chain(components).collect();
        // The platform's own components (the CUDA device handle, on-device decoding).
        ids.extend(plat.iter().flat_map(|p| p.components.iter().map(String::as_str)));
        ids.push(&f.id);
        let goals =
            Goals::of(f, resolved.as_ref(), &req.dtype, tokenizer.as_ref(), weights.as_ref(), generation.as_ref());
        for phase in Phase::ALL {
            if matches!(phase, Phase::Batching | Phase::Serving) && req.serving.is_none() {
                continue;
            }
            let mut contracts: Vec<String> = ids
                .iter()
                .filter_map(|id| ctx.ckb.get(id).ok())
                .filter(|c| c.phase == Some(phase))
                .map(|c| c.id.clone())
                .collect();
            let (gates, goal): (&[&str], String) = match phase {
                Phase::Kernels => (
                    &["compile_engine", "run_kernel_test"],
                    "implement every kernel in src/kernels.rs; each is tested alone against the f64 oracle on fresh random inputs".into(),
                ),
                Phase::WeightLoading => (&["compile_engine", "verify_generation"], goals.weight_loading.clone()),
                Phase::DecoderLayer => (&["verify_generation"], goals.decoder_layer.clone()),
                Phase::FullForward => (&["verify_generation"], goals.full_forward.clone()),
                Phase::Generation => (&["verify_generation"], goals.generation.clone()),
                Phase::Performance => (
                    &["profile_engine"],
                    "prefill and decode tokens/s on the target; keep every earlier gate green".into(),
                ),
                Phase::Batching => (
                    &["run_kernel_test", "verify_batching"],
                    "paged KV cache, block manager and batched step (src/paged.rs, src/batch.rs), then the scheduler (src/scheduler.rs: budget, chunked prefill, preemption, finish reasons, every block freed): several sequences per step, each sequence's logits equal to its single-sequence forward".into(),
                ),
                Phase::Serving => (
                    &["serve_engine"],
                    "the engine's binary (src/main.rs): `generate` and `serve` with an OpenAI-compatible server; greedy completions equal the reference's under load".into(),
                ),
            };
            if matches!(phase, Phase::DecoderLayer | Phase::FullForward) {
                contracts.push(f.id.clone());
            }
            if let Some(p) = platform.filter(|_| phase == Phase::Performance) {
                contracts.push(p.id.clone());
            }
            phases.push(PhasePlan {
                phase: phase.name().into(),
                contracts,
                gates: gates.iter().map(|g| g.to_string()).collect(),
                goal,
            });
        }
    }
    let mut kv_cache = None;
    if let Some(sv) = &req.serving {
        if let Err(e) = sv.check() {
            gaps.push(Gap { field: "serving".into(), reason: e });
        } else if let Some(cfg) = &resolved {
            if sv.max_context > cfg.max_seq {
                gaps.push(Gap {
                    field: "serving.max_context".into(),
                    reason: format!(
                        "{} tokens is beyond the model's context (max_position_embeddings = {})",
                        sv.max_context, cfg.max_seq
                    ),
                });
            }
            let per_seq = sv.max_context.div_ceil(sv.block_size);
            let full = sv.blocks() / per_seq;
            if full < sv.max_seqs {
                gaps.push(Gap {
                    field: "serving.kv_blocks".into(),
                    reason: format!(
                        "{} blocks of {} positions hold {full} sequences of max_context = {} tokens, not max_seqs = {}: raise kv_blocks to {} or lower max_seqs or max_context",
                        sv.blocks(),
                        sv.block_size,
                        sv.max_context,
                        sv.max_seqs,
                        sv.max_seqs * per_seq
                    ),
                });
            }
            let bytes_per_block =
                2 * cfg.n_layers as u64 * sv.block_size as u64 * cfg.n_kv_heads as u64 * cfg.head_dim as u64 * 4;
            kv_cache = Some(KvCachePlan {
                blocks: sv.blocks(),
                block_size: sv.block_size,
                bytes_per_block,
                total_mib: (bytes_per_block as f64 * sv.blocks() as f64) / (1u64 << 20) as f64,
                full_sequences: full,
            });
        }
    }
    let provisional: Vec<String> = family
        .into_iter()
        .chain(platform)
        .filter(|c| ctx.ckb.is_provisional(&c.id))
        .map(|c| format!("{}@{}", c.id, c.version))
        .collect();
    let missing_evidence = provisional
        .iter()
        .map(|c| {
            if c.starts_with("model.") {
                format!(
                    "{c}: a passing `metainfer ckb conformance DIR` on vectors the model's own implementation wrote (scripts/conformance-vectors.py writes them with transformers); an engine written to the same contract is no evidence about the model"
                )
            } else {
                format!("{c}: a passing verify_generation (or verified profile_engine) of an engine under it")
            }
        })
        .collect();
    Ok(PlanReport {
        covered: gaps.is_empty(),
        provisional,
        missing_evidence,
        shadowed: model::shadowed(&ctx.ckb, &config),
        family: family.map(|f| f.id.clone()).unwrap_or_default(),
        platform: platform.map(|p| p.id.clone()).unwrap_or_default(),
        dtype: req.dtype.clone(),
        config: resolved,
        gaps,
        phases,
        skipped_contracts: ctx.ckb.skipped().to_vec(),
        tokenizer,
        weights,
        generation,
        kv_cache,
    })
}

/// The phase goals in the family's own terms: its norm, attention and MLP variants (the contract's
/// `features`, described by `ckb::FAMILY_FEATURES`, and its activation), its RoPE and tie rule, the
/// weight layout and dtype policy, the tokenizer contract and the stop tokens.
struct Goals {
    weight_loading: String,
    decoder_layer: String,
    full_forward: String,
    generation: String,
}

impl Goals {
    fn of(
        family: &ckb::Contract,
        cfg: Option<&ResolvedConfig>,
        dtype: &str,
        tokenizer: Option<&TokenizerRoute>,
        weights: Option<&WeightsSummary>,
        generation: Option<&GenerationConfig>,
    ) -> Goals {
        let m = family.model.as_ref().expect("model contract");
        let has = |f: &str| cfg.map_or(m.features.iter().any(|x| x == f), |c| c.has(f));
        let feature_text = |f: &str| {
            ckb::FAMILY_FEATURES.iter().find(|(k, _)| *k == f).map(|(k, d)| format!("{k}: {d}")).unwrap_or_default()
        };
        let act_field = m.config.iter().find(|c| c.role == "activation");
        let act_key = act_field.map_or("hidden_act", |c| c.key.as_str());
        let activation =
            act_field.and_then(|c| c.supported.first().cloned().or(c.default.clone())).unwrap_or_else(|| "silu".into());
        let norm = if has("rmsnorm_one_plus_w") { "RMSNorm with (1 + w) gains" } else { "RMSNorm" };
        let mut attn = vec![format!("pre-norm ({norm}) attention")];
        attn.push(if has("fused_qkv") {
            "q/k/v from one fused qkv_proj (q rows, then k, then v)".into()
        } else {
            "q/k/v projections".to_string()
        });
        if has("qkv_bias") {
            attn.push("plus their biases".into());
        }
        if has("qk_norm") {
            attn.push("per-head RMSNorm of q and k before RoPE".into());
        }
        let rope = match cfg {
            Some(c) => format!(
                "rotate-half RoPE with theta {}{}",
                c.rope_theta,
                c.rope_scaling
                    .as_ref()
                    .map(|s| format!(" and {} scaling (factor {})", s.rope_type, s.factor))
                    .unwrap_or_default()
            ),
            None => "rotate-half RoPE".into(),
        };
        attn.push(rope);
        attn.push(match cfg.map(|c| c.sliding_window).filter(|w| *w > 0) {
            Some(w) => format!("causal GQA over a KV cache, each query seeing the last {w} positions"),
            None => "causal GQA over a KV cache".into(),
        });
        let mlp = format!(
            "pre-norm {}-gated MLP ({act_key} {activation}{})",
            if has("gelu_tanh_mlp") { "tanh-GELU" } else { "SiLU" },
            if has("fused_gate_up") { ", gate and up from one fused gate_up_proj" } else { "" }
        );
        let listed: Vec<String> = m.features.iter().map(|f| feature_text(f)).filter(|t| !t.is_empty()).collect();
        let tolerance = m
            .logits_tolerance
            .get(dtype)
            .map(|t| format!("atol {} rtol {}", t.atol, t.rtol))
            .unwrap_or_else(|| "no tolerance stated".into());
        let tied = cfg.map(|c| c.tied).unwrap_or(false);
        let head = if tied {
            "the embedding matrix as the output matrix (tie_word_embeddings: an lm_head.weight in the file is ignored)"
        } else {
            "lm_head.weight"
        };
        // The family's graph is what it computes: the goals are rendered from it where it has one.
        let (decoder_layer, full_forward) = match &m.graph {
            Some(g) => (
                format!(
                    "one {} decoder layer as its graph computes it, node by node (`stream` = the residual stream in; \
                     the last node's output goes on): {}",
                    family.id,
                    graph_line(&g.layer)
                ) + &cfg
                    .and_then(|c| c.rope_scaling.as_ref())
                    .map(|r| format!("; RoPE with {} scaling of its frequencies (factor {})", r.rope_type, r.factor))
                    .unwrap_or_default(),
                format!(
                    "all layers of {}: the prologue {}, the layers, the epilogue {} (output matrix: {head}): Model::forward and \
                     Model::prefill give logits within the family's tolerance at {dtype} ({tolerance})",
                    family.id,
                    graph_line(&g.prologue),
                    graph_line(&g.epilogue),
                ),
            ),
            None => (
                format!(
                    "one {} decoder layer: {}, residual; {mlp}, residual{}",
                    family.id,
                    attn.join(", "),
                    if listed.is_empty() { String::new() } else { format!(". Family features: {}", listed.join("; ")) }
                ),
                format!(
                    "all layers of {}: embedding{}, the layers, final {norm}, then {head}: Model::forward and Model::prefill give logits within the family's tolerance at {dtype} ({tolerance})",
                    family.id,
                    if has("embed_scale_sqrt_hidden") { " scaled by sqrt(hidden) rounded to f32" } else { "" },
                ),
            ),
        };
        let layout = match weights {
            Some(w) if w.sharded => format!("the {} shards model.safetensors.index.json names", w.files.len()),
            Some(_) => "model.safetensors".into(),
            None => "model.safetensors (or the shards of model.safetensors.index.json)".into(),
        };
        let stored = weights
            .map(|w| w.dtypes.keys().cloned().collect::<Vec<_>>().join("/"))
            .unwrap_or_else(|| "F32/BF16/F16".into());
        let policy = m
            .dtype_policy
            .as_ref()
            .filter(|_| dtype != "f32")
            .map(|p| {
                format!(
                    "; at {dtype} store {} as {dtype} and keep {} in f32 (dtype_policy)",
                    p.at_weight_dtype.join(", "),
                    p.keep_f32.join(", ")
                )
            })
            .unwrap_or_default();
        let weight_loading = format!(
            "Model::load reads config.json and {layout} (stored {stored}, widened exactly); names and shapes checked against {}{policy}",
            family.id
        );
        let tok = tokenizer
            .map(|t| format!("{} ({})", t.contract, t.parts.join(", ")))
            .unwrap_or_else(|| "the routed tokenizer contract".into());
        let stops = match generation {
            Some(g) if !g.eos_token_ids.is_empty() => format!(
                "; generate::stop_tokens reads {:?} from {} and generation stops after one",
                g.eos_token_ids, g.source
            ),
            _ => "; generate::stop_tokens finds no eos_token_id, so generation runs to its length".into(),
        };
        let generation =
            format!("tokenizer matches HF tokenizers exactly: {tok}; greedy tokens match the reference exactly{stops}");
        Goals { weight_loading, decoder_layer, full_forward, generation }
    }
}

/// Graph nodes on one line, in order: `name = op(inputs) param=expression`, joined by "; " (the
/// weights each node reads are in the contract's graph, `lookup_contract`).
fn graph_line(nodes: &[ckb::GraphNode]) -> String {
    nodes
        .iter()
        .map(|n| {
            let params: String = n.params.iter().map(|(k, v)| format!(" {k}={v}")).collect();
            format!("{} = {}({}){params}", n.name, n.op, n.inputs.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The constraints as a scaffold records them in the engine's `metainfer.toml`.
pub fn constraints_toml(req: &PlanRequest, report: &PlanReport, level: super::ReferenceLevel) -> Result<String> {
    let cfg = report.config.as_ref().ok_or_else(|| Error::usage("constraints are not covered; run plan first"))?;
    // The platform id where the target has several (or one was named).
    let platform = if req.platform.is_some() || req.target == ckb::API_CUDA {
        format!("platform = {:?}\n", report.platform)
    } else {
        String::new()
    };
    let serving = match &req.serving {
        Some(s) => format!(
            "\n# Serving: several sequences per step over a paged KV cache, and an OpenAI-compatible server.\n[serving]\n{}",
            toml::to_string(s).internal_ctx(|| "serving constraints".to_owned())?
        ),
        None => String::new(),
    };
    Ok(format!(
        "# Constraints this engine was scaffolded for (written by metainfer scaffold).\nfamily = {:?}\ntarget = {:?}\ndtype = {:?}\nreference_level = {:?}\nmodel = {:?}\nhidden = {}\nn_layers = {}\nvocab = {}\n{platform}{serving}",
        report.family,
        req.target,
        req.dtype,
        level.name(),
        req.model,
        cfg.hidden,
        cfg.n_layers,
        cfg.vocab
    ))
}

/// The platform api (`host` or `cuda`) of a plan's platform.
pub fn api_of(ctx: &Ctx, report: &PlanReport) -> String {
    ctx.ckb
        .get(&report.platform)
        .ok()
        .and_then(|p| p.platform.as_ref())
        .map(|p| p.api.clone())
        .unwrap_or_else(|| ckb::API_HOST.to_string())
}
