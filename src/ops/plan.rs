//! plan_engine: from constraints (model directory, target, dtype) to the phases in build order, each
//! with its contracts and the gates that check it. Reads config.json only; weights are not needed.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use crate::ckb::{Kind, Phase, SkippedFile};
use crate::error::{Error, Result};
use crate::model::{self, Gap, ResolvedConfig};

/// Constraints of the engine to build.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PlanRequest {
    /// Hugging Face model directory (config.json is read; weights are not needed to plan).
    pub model: String,
    /// Target platform name, e.g. `cpu`.
    #[serde(default = "default_target")]
    pub target: String,
    /// Weight and activation dtype, e.g. `f32`.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Serving constraints (max_seqs, max_context, block_size, kv_blocks, max_batch_tokens,
    /// sampling): the plan then adds the batching and serving phases and checks that the KV cache
    /// holds the concurrency asked for. Absent: a batch-1 greedy library.
    #[serde(default)]
    pub serving: Option<crate::manifest::Serving>,
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
    /// Whether the knowledge base covers these constraints: no gaps, and no contract the plan needs is
    /// only a staged candidate (see `provisional`).
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
    /// verify_generation (or verified profile_engine) promotes them. Empty when covered.
    pub provisional: Vec<String>,
    /// Phases in build order.
    pub phases: Vec<PhasePlan>,
    /// Contract files left out of the knowledge base as invalid (`--skip-invalid`), each with its
    /// reason; this plan was made without them. Empty when every file loaded.
    #[serde(default)]
    pub skipped_contracts: Vec<SkippedFile>,
    /// With serving constraints: the KV cache they imply (absent without them or without a config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<KvCachePlan>,
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
        let mut s = if self.covered {
            format!("covered: {} on {} in {}\n", self.family, self.platform, self.dtype)
        } else if self.gaps.is_empty() {
            format!(
                "covered provisionally: {} on {} in {}, through staged candidate(s) {}; a passing verify_generation under them promotes them\n",
                self.family,
                self.platform,
                self.dtype,
                self.provisional.join(", ")
            )
        } else {
            format!("not covered ({} gap(s))\n", self.gaps.len())
        };
        for g in &self.gaps {
            s += &format!("  gap {}: {}\n", g.field, g.reason);
        }
        if let Some(c) = &self.config {
            s += &format!(
                "config: hidden {} intermediate {} layers {} heads {}/{} kv head_dim {} vocab {} max_seq {} eps {} theta {} tied {}\n",
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
                c.tied
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
    let figures = crate::ledger::figures::Figures::Plan(crate::ledger::figures::PlanFigures {
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
    let dir = ctx.confine(Path::new(&req.model), true)?;
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
    let platform = ctx.ckb.platform_for(&req.target);
    match platform {
        None => gaps.push(Gap {
            field: "target".into(),
            reason: format!(
                "no platform contract for target `{}`; covered: {}",
                req.target,
                ctx.ckb
                    .of_kind(Kind::Platform)
                    .map(|c| c.platform.as_ref().unwrap().target.clone())
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
        let mut ids: Vec<&str> = kernels.iter().chain(&components).map(String::as_str).collect();
        ids.push(&f.id);
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
            let (gates, goal): (&[&str], &str) = match phase {
                Phase::Kernels => (
                    &["compile_engine", "run_kernel_test"],
                    "implement every kernel in src/kernels.rs; each is tested alone against the f64 oracle on fresh random inputs",
                ),
                Phase::WeightLoading => (
                    &["compile_engine", "verify_generation"],
                    "Model::load reads config.json and model.safetensors; shapes checked against the family contract",
                ),
                Phase::DecoderLayer => (
                    &["verify_generation"],
                    "one decoder layer: pre-norm attention with RoPE and KV cache, residual, pre-norm SiLU-gated MLP, residual",
                ),
                Phase::FullForward => (
                    &["verify_generation"],
                    "all layers, final norm, lm_head (tied or not): Model::forward and Model::prefill give logits within the family's tolerance",
                ),
                Phase::Generation => (
                    &["verify_generation"],
                    "tokenizer matches HF tokenizers exactly; greedy tokens match the reference exactly",
                ),
                Phase::Batching => (
                    &["run_kernel_test", "verify_batching"],
                    "paged KV cache, block manager and batched step (src/paged.rs, src/batch.rs), then the scheduler: several sequences per step, each sequence's logits equal to its single-sequence forward",
                ),
                Phase::Serving => (
                    &["serve_engine"],
                    "the engine's binary (src/main.rs): `generate` and `serve` with an OpenAI-compatible server; greedy completions equal the reference's under load",
                ),
                Phase::Performance => {
                    (&["profile_engine"], "prefill and decode tokens/s on the target; keep every earlier gate green")
                }
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
                goal: goal.into(),
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
    Ok(PlanReport {
        covered: gaps.is_empty() && provisional.is_empty(),
        provisional,
        family: family.map(|f| f.id.clone()).unwrap_or_default(),
        platform: platform.map(|p| p.id.clone()).unwrap_or_default(),
        dtype: req.dtype.clone(),
        config: resolved,
        gaps,
        phases,
        skipped_contracts: ctx.ckb.skipped().to_vec(),
        kv_cache,
    })
}

/// The constraints as a scaffold records them in the engine's `metainfer.toml`.
pub fn constraints_toml(req: &PlanRequest, report: &PlanReport, level: super::ReferenceLevel) -> Result<String> {
    let cfg = report.config.as_ref().ok_or_else(|| Error::usage("constraints are not covered; run plan first"))?;
    let serving = match &req.serving {
        Some(s) => format!(
            "\n# Serving: several sequences per step over a paged KV cache, and an OpenAI-compatible server.\n[serving]\n{}",
            toml::to_string(s).map_err(|e| Error::internal(format!("serving constraints: {e}")))?
        ),
        None => String::new(),
    };
    Ok(format!(
        "# Constraints this engine was scaffolded for (written by metainfer scaffold).\nfamily = {:?}\ntarget = {:?}\ndtype = {:?}\nreference_level = {:?}\nmodel = {:?}\nhidden = {}\nn_layers = {}\nvocab = {}\n{serving}",
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
