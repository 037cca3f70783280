//! profile_engine: prefill and decode tokens/s (median, min, max of several runs) and time per phase,
//! measured by the harness on a real checkpoint.

use std::path::Path;
use std::time::Instant;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Ctx, Report};
use crate::error::{Error, Result};
use crate::harness::{self, Budget};

/// What to profile.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ProfileRequest {
    /// Engine crate directory.
    pub engine: String,
    /// Hugging Face model directory.
    pub model: String,
    /// Prompt length in tokens for the prefill measurement (default 32).
    #[serde(default)]
    pub prompt_len: Option<usize>,
    /// Tokens decoded per run (default 64).
    #[serde(default)]
    pub new_tokens: Option<usize>,
    /// Weight dtype to build the engine for (f32, bf16, f16, int8); absent: the engine's own.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Runs; medians are over these (default 5).
    #[serde(default)]
    pub runs: Option<usize>,
}

/// Median, min and max of one figure over the runs.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, JsonSchema, PartialEq)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// Spread of a sample; all zeros for an empty one (nothing was measured).
    pub fn of(v: &[f64]) -> Spread {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        if s.is_empty() {
            return Spread { median: 0.0, min: 0.0, max: 0.0 };
        }
        let median = if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 };
        Spread { median, min: s[0], max: s[s.len() - 1] }
    }
}

/// Profile result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ProfileReport {
    /// Whether the profile ran.
    pub passed: bool,
    /// Weight dtype the engine was built for.
    pub dtype: String,
    /// Whether verify_generation last passed on exactly these sources (figures of an unverified
    /// engine are marked, never silently trusted).
    pub verified: bool,
    /// Prompt length used.
    pub prompt_len: usize,
    /// Tokens decoded per run.
    pub new_tokens: usize,
    /// Runs.
    pub runs: usize,
    /// Prefill tokens/s.
    pub prefill_tok_s: Spread,
    /// Decode tokens/s.
    pub decode_tok_s: Spread,
    /// Time to first token (prefill of the prompt), ms.
    pub first_token_ms: Spread,
    /// Model load time, ms.
    pub load_ms: f64,
    /// Bytes of weights read per decoded token at the engine's weight dtype (4 per f32 weight, 2 per
    /// bf16/f16, 1 per int8 plus one f32 scale per row; the embedding row itself is negligible).
    pub bytes_per_token: f64,
    /// Decode roofline: bandwidth (1 thread, the machine probe's DRAM median when probed, else the
    /// platform contract) / `bytes_per_token`, tokens/s.
    /// Models that fit in cache can exceed it.
    pub roofline_decode_tok_s: f64,
    /// Compute bound: platform peak f32 FLOP/s (all threads) / 2 FLOP per weight per token. No real
    /// engine exceeds it; a figure above it is reported as invalid, never as fast.
    pub compute_bound_tok_s: f64,
    /// Timed runs whose generated tokens were checked against the reference forward pass.
    pub runs_checked: usize,
    /// Whether every checked timed run generated the reference's tokens.
    pub outputs_ok: bool,
    /// Rule findings (check_rules); a blocking one stops the profile.
    pub rules: Vec<crate::guard::Finding>,
    /// Harness failure text, when it failed.
    pub error: String,
    /// Where the roofline figures come from and, when the engine's target platform is another
    /// architecture than this host's, that the timings are of the engine's portable path here.
    pub figures_from: String,
    /// When it passed: each staged candidate it ran under (family, target platform) and whether this
    /// evidence promoted it (see `ops::evolve::promote_on_evidence`). Empty otherwise.
    pub promotions: Vec<super::evolve::Promotion>,
}

impl Report for ProfileReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn text(&self) -> String {
        if !self.passed && self.decode_tok_s.median == 0.0 {
            return format!("profile FAILED: {}", self.error);
        }
        let head = if self.passed { String::new() } else { format!("profile FAILED: {}\n", self.error) };
        head + &format!(
            "profile{}: decode {:.0} tok/s (min {:.0}, max {:.0}), prefill {:.0} tok/s (min {:.0}, max {:.0}) over {} runs\n\
             time to first token {:.2} ms ({} prompt tokens), load {:.1} ms; 1-thread bandwidth roofline {:.0} tok/s ({:.0}% of it)\n",
            if self.verified { "" } else { " (UNVERIFIED: verify_generation has not passed on these sources)" },
            self.decode_tok_s.median,
            self.decode_tok_s.min,
            self.decode_tok_s.max,
            self.prefill_tok_s.median,
            self.prefill_tok_s.min,
            self.prefill_tok_s.max,
            self.runs,
            self.first_token_ms.median,
            self.prompt_len,
            self.load_ms,
            self.roofline_decode_tok_s,
            100.0 * self.decode_tok_s.median / self.roofline_decode_tok_s
        ) + &format!("figures from {}\n", self.figures_from)
            + &self
                .promotions
                .iter()
                .map(|p| {
                    format!("{} {}: {}\n", if p.promoted { "promoted" } else { "not promoted" }, p.contract, p.message)
                })
                .collect::<String>()
    }
}

/// Profile an engine.
///
/// # Errors
/// Not a crate, unreadable or uncovered model, outside the workspace, or the harness cannot start.
pub fn profile(ctx: &Ctx, req: &ProfileRequest, budget: &Budget) -> Result<ProfileReport> {
    let started = Instant::now();
    let live = ctx.live();
    let ctx = &*live;
    let dir = ctx.confine(Path::new(&req.engine), true)?;
    let model_dir = ctx.confine(Path::new(&req.model), true)?;
    let engine = ctx.workshop.engine(&dir)?;
    let target = ctx.target(&engine, req.dtype.as_deref())?;
    let cfg = crate::model::load_config(&ctx.ckb, &model_dir)?;
    let prompt_len = req.prompt_len.unwrap_or(32).clamp(1, cfg.max_seq.saturating_sub(1).max(1));
    let new_tokens = req.new_tokens.unwrap_or(64).clamp(1, cfg.max_seq - prompt_len);
    let runs = req.runs.unwrap_or(5).clamp(1, 100);
    let verified = crate::ledger::Ledger::open(&ctx.ledger)
        .and_then(|l| l.passed_on("verify_generation", &engine.hash, &target.dtype))
        .unwrap_or(false);
    let weights = (cfg.vocab * cfg.hidden * if cfg.tied { 1 } else { 2 })
        + cfg.n_layers
            * (cfg.hidden * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
                + 3 * cfg.hidden * cfg.intermediate
                + 2 * cfg.hidden)
        + cfg.hidden;
    // The embedding row read per token is negligible; lm_head (or the tied table) is read in full.
    let streamed = (weights - if cfg.tied { 0 } else { cfg.vocab * cfg.hidden }) as f64;
    let bytes_per_token = match target.dtype.as_str() {
        "bf16" | "f16" => 2.0 * streamed,
        // One f32 scale per row of hidden (or intermediate) weights: about 4 / hidden bytes each.
        "int8" => streamed * (1.0 + 4.0 / cfg.hidden as f64),
        _ => 4.0 * streamed,
    };
    // The engine's target platform gives the figures when it describes this host's architecture;
    // otherwise (an engine for another architecture, run here on its portable path) the host's
    // platform contract (`cpu`) does.
    let host = std::env::consts::ARCH;
    let target_platform = target.platform.as_deref().and_then(|id| ctx.ckb.get(id).ok());
    let other_arch = target_platform
        .and_then(|p| p.platform.as_ref())
        .filter(|p| !p.arch.is_empty() && p.arch != host)
        .map(|p| p.arch.clone());
    let figures_platform = match &other_arch {
        None => target_platform.or_else(|| ctx.ckb.platform_for("cpu")),
        Some(_) => ctx.ckb.platform_for("cpu"),
    };
    // This machine's own figures when `metainfer machine` probed it, else the platform contract's.
    let probe: Option<crate::probe::MachineProbe> = crate::ledger::Ledger::open(&ctx.ledger)
        .ok()
        .and_then(|l| l.probe(&crate::probe::fingerprint()).ok().flatten())
        .and_then(|v| serde_json::from_value(v).ok());
    let bandwidth = probe
        .as_ref()
        .and_then(|p| p.median("read DRAM", 1))
        .or_else(|| figures_platform.and_then(|p| p.platform.as_ref().and_then(|p| p.bandwidth_gbs.get("1").copied())))
        .unwrap_or(15.0);
    let roofline = bandwidth * 1e9 / bytes_per_token;
    // The compute bound must never understate: take the larger of the probe and the contract.
    let contract_peak = figures_platform
        .and_then(|p| p.platform.as_ref().and_then(|p| p.peak_gflops_f32.values().copied().reduce(f64::max)))
        .unwrap_or(128.0);
    let probe_peak = probe
        .as_ref()
        .map(|p| p.figures.iter().filter(|f| f.what.starts_with("peak")).map(|f| f.spread.max).fold(0.0, f64::max))
        .unwrap_or(0.0);
    let peak = contract_peak.max(probe_peak);
    let mut figures_from = match (&probe, figures_platform) {
        (Some(_), Some(p)) => format!("this machine's probe (metainfer machine), peak at least {}", p.id),
        (Some(_), None) => "this machine's probe (metainfer machine)".to_string(),
        (None, Some(p)) => p.id.clone(),
        (None, None) => "defaults (no platform contract for `cpu`)".to_string(),
    };
    if let (Some(arch), Some(id)) = (&other_arch, &target.platform) {
        figures_from += &format!(
            "; the engine targets {id} ({arch}) and ran on this {host} host: the gates exercised its portable code path, and these timings are not {arch} figures"
        );
    }
    let mut contract_ids: Vec<&str> = vec![cfg.family.as_str()];
    contract_ids.extend(target.platform.as_deref());
    let versioned = ctx.versioned(&contract_ids);
    let compute_bound = peak * 1e9 / (2.0 * weights as f64);
    let mut report = ProfileReport {
        passed: false,
        dtype: target.dtype.clone(),
        bytes_per_token,
        verified,
        prompt_len,
        new_tokens,
        runs,
        prefill_tok_s: Spread::of(&[]),
        decode_tok_s: Spread::of(&[]),
        first_token_ms: Spread::of(&[]),
        load_ms: 0.0,
        roofline_decode_tok_s: roofline,
        compute_bound_tok_s: compute_bound,
        runs_checked: 0,
        outputs_ok: false,
        rules: vec![],
        error: String::new(),
        figures_from,
        promotions: vec![],
    };
    let rules = super::rules::precheck(ctx, &engine, budget)?;
    report.rules = rules.findings.clone();
    if !rules.passed {
        report.error = super::rules::blocked_text(&rules);
        ctx.record(
            "profile_engine",
            Some(&engine),
            versioned.clone(),
            &report,
            serde_json::json!({"blocked": true, "dtype": target.dtype}),
            started,
        );
        return Ok(report);
    }
    let build = ctx.workshop.build_harness(&engine, &target.spec, budget)?;
    let Some(exe) = build.executable.clone().filter(|_| build.ok) else {
        report.error = format!(
            "the engine does not build with the harness:\n{}",
            super::Report::text(&super::compile::report_of(ctx, &engine, build, 0))
        );
        ctx.record(
            "profile_engine",
            Some(&engine),
            versioned.clone(),
            &report,
            serde_json::json!({"dtype": target.dtype}),
            started,
        );
        return Ok(report);
    };
    let run = harness::run(
        duct::cmd(
            &exe,
            [
                "profile".into(),
                model_dir.clone().into_os_string(),
                prompt_len.to_string().into(),
                new_tokens.to_string().into(),
                runs.to_string().into(),
            ] as [std::ffi::OsString; 5],
        ),
        budget,
    )?;
    if !run.ok() {
        report.error = format!("the engine's profile process {}", run.failure_text(2000));
        ctx.record(
            "profile_engine",
            Some(&engine),
            versioned.clone(),
            &report,
            serde_json::json!({"dtype": target.dtype}),
            started,
        );
        return Ok(report);
    }
    let v: serde_json::Value = serde_json::from_str(run.stdout.lines().last().unwrap_or_default())
        .map_err(|e| Error::internal(format!("harness profile output is not JSON: {e}")))?;
    let nums = |k: &str| -> Vec<f64> {
        v[k].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default()
    };
    let prefill: Vec<f64> = nums("prefill_s").iter().map(|s| prompt_len as f64 / s).collect();
    let decode: Vec<f64> = nums("decode_s_per_token").iter().map(|s| 1.0 / s).collect();
    let first: Vec<f64> = nums("first_token_s").iter().map(|s| s * 1e3).collect();
    report.prefill_tok_s = Spread::of(&prefill);
    report.decode_tok_s = Spread::of(&decode);
    report.first_token_ms = Spread::of(&first);
    report.load_ms = v["load_s"].as_f64().unwrap_or(0.0) * 1e3;
    // The timed runs' outputs: the first two are replayed through the reference forward pass.
    let tensors = crate::model::read_safetensors(&model_dir)?;
    let mut reference = crate::oracle::llama::Reference::with_weight_dtype(&cfg, &tensors, &target.dtype)?;
    let mut problems = Vec::new();
    report.outputs_ok = true;
    for r in v["runs"].as_array().map(Vec::as_slice).unwrap_or_default().iter().take(2) {
        let ids = |k: &str| -> Vec<u32> {
            r[k].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()).unwrap_or_default()
        };
        let (prompt, got) = (ids("prompt"), ids("tokens"));
        let (rows, want) = reference.greedy(&prompt, got.len().max(1))?;
        let agree = got.iter().zip(&want).zip(&rows).take_while(|((g, w), row)| {
            // A near-tie in the reference may go either way.
            g == w || row[**w as usize] - row.get(**g as usize).copied().unwrap_or(f64::NEG_INFINITY) <= 1e-3
        });
        if agree.count() < want.len() || got.len() != want.len() {
            report.outputs_ok = false;
        }
        report.runs_checked += 1;
    }
    if report.runs_checked == 0 || !report.outputs_ok {
        problems.push("the timed runs did not generate the reference's greedy tokens: the engine computes something else when timed".to_string());
    }
    if report.decode_tok_s.max > compute_bound || report.prefill_tok_s.max > compute_bound * 16.0 {
        problems.push(format!(
            "measured {:.0} tok/s decode is above the compute bound of {compute_bound:.0} tok/s: invalid, not fast",
            report.decode_tok_s.max
        ));
    }
    if !verified {
        problems.push(
            "phase order: verify_generation has not passed on these exact sources; figures are unverified".into(),
        );
    }
    report.error = problems.join("; ");
    report.passed = !decode.is_empty() && problems.is_empty();
    let figures = serde_json::json!({
        "dtype": target.dtype,
        "bytes_per_token": bytes_per_token,
        "decode_tok_s": report.decode_tok_s.median,
        "prefill_tok_s": report.prefill_tok_s.median,
        "roofline_decode_tok_s": roofline,
        "compute_bound_tok_s": compute_bound,
        "outputs_ok": report.outputs_ok,
        "verified": verified,
    });
    ctx.record("profile_engine", Some(&engine), versioned.clone(), &report, figures, started);
    if report.passed && verified {
        report.promotions = super::evolve::promote_on_evidence(ctx, "profile_engine", &versioned);
    }
    Ok(report)
}
