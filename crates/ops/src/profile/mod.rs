//! profile_engine: prefill and decode tokens/s (median, min, max of several runs) and time per phase,
//! measured by the harness on a real checkpoint; then every kernel of a decode step timed on the
//! model's shapes (see [`roofline`]), the kernel that bounds decode with the platform
//! contract's guidance for it, and the change against the previous profile of the same engine.
//! The bytes a decoded token streams are the tensors the family's graph binds
//! (`synth::graph_parameters`, a mixture of experts counting only the experts it routes to), equal
//! to transformers' parameter counts (test
//! `conformance::graph_parameters_equal_transformers_parameter_counts`).
//!
//! Where decode time goes: the `profile` command also times decode steps through the engine's
//! `Model::forward_traced` (see `ops::localise`), attributing the time spent reaching each trace
//! point from the one before it to that point; [`roofline::point_costs`] gives each graph node's
//! bytes and FLOPs from the graph's weight bindings. The points' shares are of the traced decode
//! time, so they add up to at most 100%, and the bounding kernel is then the one the real forward
//! spends most in. Without `forward_traced` the kernels are timed alone and the report says so.
//!
//! The gates run an engine on the server's host. An engine whose `metainfer.toml` targets another
//! architecture's platform (e.g. a proposed `platform.cpu-aarch64`) is checked through its portable
//! code path here; profile_engine then takes its roofline from the host and says so (`figures_from`).

pub mod roofline;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::gate::{Gate, Tool};
use super::{Ctx, Report};
use base::error::{Error, Result};
use harness::Budget;

mod previous;
mod spec;
#[cfg(test)]
mod tests;

use spec::ProfileSpec;

/// What to profile.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    /// Threads the engine may use: the harness runs with RAYON_NUM_THREADS set to it, and the
    /// roofline uses the machine's figures at that count (default 1).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Runs; medians are over these (default 5).
    #[serde(default)]
    pub runs: Option<usize>,
    /// Do not run: build the harness and draw the inputs here, and write them as a bundle to this
    /// directory (new or empty), to run with `metainfer bundle run DIR` where the device is.
    #[serde(default)]
    pub write_bundle: Option<String>,
    /// Judge and record a bundle written by this gate and run elsewhere (`metainfer bundle run`),
    /// instead of running the engine here. The engine's sources must be the ones it was written from.
    #[serde(default)]
    pub from_bundle: Option<String>,
}

pub use base::stats::Spread;

/// Profile result.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct ProfileReport {
    /// Whether the profile ran.
    pub passed: bool,
    /// For figures judged from a bundle: whether a trusted runner signed the run, or why they are
    /// unattested (recorded, never evidence); "" for a run made here.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub attestation: String,
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
    /// Each request value that was adjusted to fit the model's context or the limits, with why
    /// (e.g. `new_tokens 64 -> 32: 32 prompt tokens leave 32 of the model's 64 positions`).
    #[serde(default)]
    pub adjusted: Vec<String>,
    /// Prefill tokens/s.
    pub prefill_tok_s: Spread,
    /// Decode tokens/s.
    pub decode_tok_s: Spread,
    /// Time to first token (prefill of the prompt), ms.
    pub first_token_ms: Spread,
    /// Prefill tokens/s at a quarter, half and all of the prompt length.
    pub prefill_by_len: Vec<PrefillAt>,
    /// Peak resident set size of the engine's process over the profile, MB (Linux; 0 elsewhere).
    pub peak_rss_mb: f64,
    /// The machine's load beside the figures: the 1-minute load average (/proc/loadavg) just
    /// before the engine ran and just after, and the logical core count. A load near or above the
    /// core count means other work shared the cores and the timings are pessimistic. Empty where
    /// the OS does not report it.
    #[serde(default)]
    pub machine_load: Option<MachineLoad>,
    /// Model load time, ms.
    pub load_ms: f64,
    /// Bytes of weights read per decoded token at the engine's weight dtype (4 per f32 weight, 2 per
    /// bf16/f16, 1 per int8 plus one f32 scale per row; the embedding row itself is negligible).
    pub bytes_per_token: f64,
    /// For a mixture of experts, the share of the expert weights one decoded token reads (top_k of
    /// the experts per layer: Qwen3-30B-A3B 8 / 128); `bytes_per_token` counts only those. None for
    /// a dense family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_fraction: Option<f64>,
    /// Decode roofline: bandwidth at the run's thread count / `bytes_per_token`, tokens/s. The
    /// bandwidth is the machine probe's (`metainfer machine`) best read figure at the memory level
    /// that holds the decode working set (`roofline_level`: a model of a few MB is cache-resident
    /// and measured so), else the platform contract's DRAM figure, which models that fit in cache
    /// can exceed.
    pub roofline_decode_tok_s: f64,
    /// The memory level the roofline's bandwidth was measured at and why, e.g. `L3 (4 MiB): the
    /// decode working set of 0.4 MB is cache-resident`; empty when the figures are the platform
    /// contract's.
    #[serde(default)]
    pub roofline_level: String,
    /// Compute bound: platform peak f32 FLOP/s (all threads) / 2 FLOP per weight per token. No real
    /// engine exceeds it; a figure above it is reported as invalid, never as fast.
    pub compute_bound_tok_s: f64,
    /// Timed decode runs whose generated tokens were checked against the reference forward pass
    /// (every one of them).
    pub runs_checked: usize,
    /// Prefill-by-length runs whose chosen token was checked against the reference: a majority
    /// of each length's runs (n / 2 + 1 of n), drawn when the reply is judged, so that a median is
    /// an honest run's or a faked run is among those checked.
    #[serde(default)]
    pub prefill_runs_checked: usize,
    /// Traced runs whose generated tokens were checked against the reference: a majority of them
    /// drawn as for the prefill runs; 0 without a traced forward.
    #[serde(default)]
    pub traced_runs_checked: usize,
    /// Whether every checked timed run (decode, prefill by length, traced) generated the
    /// reference's tokens.
    pub outputs_ok: bool,
    /// Threads the engine ran with (RAYON_NUM_THREADS).
    pub threads: usize,
    /// Every kernel shape of one decode step, timed alone on the model's shapes; largest share first.
    pub kernels: Vec<roofline::KernelProfile>,
    /// The engine's real forward pass timed point by point (`Model::forward_traced`, decode steps
    /// after the prompt): time to reach each activation point of the family's graph from the one
    /// before, summed over layers, with its bytes and roofline fraction; largest share first. Empty
    /// when the engine has no traced forward (see `points_note`).
    #[serde(default)]
    pub points: Vec<roofline::PointProfile>,
    /// Decode tokens per second of the traced runs (the time the points share; tracing adds a
    /// clock read per point).
    #[serde(default)]
    pub traced_decode_tok_s: f64,
    /// Why `points` is empty, when it is.
    #[serde(default)]
    pub points_note: String,
    /// The kernel contract with the largest share of decode time: of the real forward's points
    /// when the engine traces (summed over the points running it), else of the kernels timed alone.
    pub bounding_kernel: String,
    /// Its share of the traced decode time (points), else of the summed kernel time of one token.
    pub bounding_share: f64,
    /// Summed kernel time per token over the measured decode time per token: the rest is spent
    /// outside the kernels (loop, copies, allocation).
    pub kernel_time_fraction: f64,
    /// The platform contract's guidance for the bounding kernel.
    pub guidance: Vec<String>,
    /// The previous passing profile of this engine directory at the same model, dtype, threads and
    /// lengths, when the ledger has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<PreviousProfile>,
    /// Rule findings (check_rules); a blocking one stops the profile.
    pub rules: Vec<guard::Finding>,
    /// Harness failure text, when it failed.
    pub error: String,
    /// Where the roofline figures come from and, when the engine's target platform is another
    /// architecture than this host's, that the timings are of the engine's portable path here.
    pub figures_from: String,
    /// The CUDA device the engine ran on and its roofline figures; absent for host engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceFigures>,
    /// When it passed: each staged candidate it ran under (family, target platform) and whether this
    /// evidence promoted it (see `ops::evolve::promote_on_evidence`). Empty otherwise.
    pub promotions: Vec<super::gate::Promotion>,
    /// Whether the engine's code (its build scripts and proc macros, the harness process) ran in
    /// the enforced sandbox; false where the kernel offers no Landlock ABI >= 6 or seccomp (the
    /// server logs why at start; `--require-sandbox` refuses to run instead).
    pub sandboxed: bool,
}

/// The roofline bandwidth from a machine probe: the best (max over runs) read bandwidth at
/// `threads` of the smallest probed memory level whose working set holds `working_set` bytes
/// (`probe::working_sets`, in order: L1, L2, L3, DRAM), GB/s, with that level's label. A roofline
/// is an upper bound, hence the max. None when the probe has no figure at this thread count.
pub fn roofline_level(probe: &probe::MachineProbe, working_set: f64, threads: usize) -> Option<(f64, String)> {
    let sets = probe::working_sets();
    let (label, _) = sets.iter().find(|(_, bytes)| *bytes as f64 >= working_set).or(sets.last())?;
    let best = |label: &str| {
        probe
            .figures
            .iter()
            .find(|f| f.threads == threads && f.what.strip_prefix("read ").is_some_and(|w| w.starts_with(label)))
            .map(|f| f.spread.max)
    };
    // The DRAM label carries this machine's size: match on the level name.
    let name = label.split(' ').next().unwrap_or(label);
    best(name).map(|bw| (bw, label.clone()))
}

/// The device of a CUDA engine's profile: the roofline is the platform contract's HBM bandwidth for
/// this device model, checked against a bandwidth probe run on the device.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct DeviceFigures {
    /// Device name as the driver reports it, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability, e.g. `9.0`.
    pub compute_capability: String,
    /// The platform contract's nominal HBM bandwidth for this device model, GB/s (0: not listed).
    pub hbm_gbs: f64,
    /// Device-to-device copy bandwidth measured on the device in the same run, GB/s.
    pub copy_gbs: f64,
    /// `copy_gbs / hbm_gbs`: a probe above about 1 means the contract's figure is wrong.
    pub probe_fraction: f64,
    /// Decode tokens/s over the HBM roofline (`roofline_decode_tok_s`).
    pub decode_fraction: f64,
}

/// Prefill speed at one prompt length.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PrefillAt {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens/s over the runs.
    pub tok_s: Spread,
}

/// The comparison with the previous profile.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct PreviousProfile {
    /// Its outcome id in the ledger.
    pub outcome: String,
    /// When it ran (RFC 3339).
    pub time: String,
    /// Its decode tokens/s.
    pub decode_tok_s: Spread,
    /// Change of the decode median, percent (negative: slower now).
    pub change_pct: f64,
    /// Slower beyond the noise measured in this call ([`is_regression`] on `interleaved`): only
    /// called when both builds ran here, alternately; never for identical sources, and never from
    /// figures of different calls alone (a loaded machine moves those by tens of percent).
    pub regression: bool,
    /// Whether the previous profile ran on these exact sources (same source hash): any change is
    /// the machine's noise.
    #[serde(default)]
    pub same_sources: bool,
    /// Both builds timed in this call, alternately (this one, the previous one, ...), when the
    /// previous build's harness was kept and the sources differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interleaved: Option<Interleaved>,
    /// How the comparison was made, or why no regression can be called.
    #[serde(default)]
    pub note: String,
}

/// Decode speed of this build and the previous one, measured alternately in one call.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Interleaved {
    /// Alternating pairs run (one decode run of each build per pair).
    pub pairs: usize,
    /// This build's decode tokens/s over the pairs.
    pub now_tok_s: Spread,
    /// The previous build's decode tokens/s over the pairs.
    pub before_tok_s: Spread,
}

/// Alternating pairs of decode runs for a regression check.
pub const INTERLEAVED_PAIRS: usize = 3;

/// The machine's load around a profile (see [`ProfileReport::machine_load`]).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct MachineLoad {
    /// 1-minute load average before the engine ran.
    pub before: f64,
    /// 1-minute load average after it ran (its own load included).
    pub after: f64,
    /// Logical cores.
    pub cores: usize,
}

/// The 1-minute load average from /proc/loadavg (Linux); None elsewhere.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// Whether `now` is slower than `before` beyond the noise (the rule of [`PreviousProfile::regression`]).
///
/// Both ranges must be apart (`now.max < before.min`) and the median must drop by more than the
/// noise, at least 3%. Throughput noise is multiplicative (a loaded core slows every token by a
/// factor), so spreads and the drop are compared as log ratios: the noise is twice the larger of
/// the spreads that could close the gap, ln(before.median / before.min) and
/// ln(now.max / now.median); the drop is ln(before.median / now.median). A fast outlier in the
/// earlier runs (one lucky run at 4x the median) widens neither, so it cannot hide a slowdown; and
/// earlier runs that fell to a third of their median on a loaded machine hide a 3x drop but not a
/// 30x one (a fractional drop can never exceed 100%, a log ratio can).
pub fn is_regression(before: &Spread, now: &Spread) -> bool {
    let ln_ratio = |a: f64, b: f64| if a > 0.0 && b > 0.0 { (a / b).ln() } else { 0.0 };
    let noise = 2.0 * ln_ratio(before.median, before.min).max(ln_ratio(now.max, now.median));
    let drop = ln_ratio(before.median, now.median);
    let floor = (1.0 / (1.0 - 0.03f64)).ln();
    now.max < before.min && drop > noise.max(floor)
}

impl Report for ProfileReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn bundle_written(&self) -> bool {
        crate::gate::wrote_bundle(&self.error)
    }
    fn text(&self) -> String {
        if !self.passed && self.decode_tok_s.median == 0.0 {
            return format!("profile FAILED: {}", self.error);
        }
        let mut head = if self.passed { String::new() } else { format!("profile FAILED: {}\n", self.error) };
        if !self.attestation.is_empty() {
            head += &format!("{}\n", self.attestation);
        }
        head + &format!(
            "profile{}: decode {:.0} tok/s (min {:.0}, max {:.0}), prefill {:.0} tok/s (min {:.0}, max {:.0}) over {} runs\n\
             time to first token {:.2} ms ({} prompt tokens), load {:.1} ms; {}-thread bandwidth roofline {:.0} tok/s ({:.0}% of it)\n",
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
            self.threads,
            self.roofline_decode_tok_s,
            100.0 * self.decode_tok_s.median / self.roofline_decode_tok_s
        ) + &format!(
            "prefill by prompt length: {}; peak RSS {:.1} MB\n",
            self.prefill_by_len
                .iter()
                .map(|p| format!("{} tokens {:.0} tok/s", p.prompt_len, p.tok_s.median))
                .collect::<Vec<_>>()
                .join(", "),
            self.peak_rss_mb
        ) + &format!(
            "outputs {} the reference's: {} of {} decode runs, {} of {} prefill-by-length runs, {} traced runs checked\n",
            if self.outputs_ok { "equal to" } else { "NOT equal to" },
            self.runs_checked,
            self.runs,
            self.prefill_runs_checked,
            self.runs * self.prefill_by_len.len(),
            self.traced_runs_checked
        ) + &format!("figures from {}\n", self.figures_from)
            + &self
                .expert_fraction
                .map(|f| {
                    format!(
                        "mixture of experts: a decoded token reads {:.1}% of the expert weights; {:.2} MB of weights per token\n",
                        100.0 * f,
                        self.bytes_per_token / 1e6
                    )
                })
                .unwrap_or_default()
            + &self
                .machine_load
                .as_ref()
                .map(|l| {
                    format!(
                        "machine load (1-min average) {:.2} before, {:.2} after, on {} cores\n",
                        l.before, l.after, l.cores
                    )
                })
                .unwrap_or_default()
            + &if self.roofline_level.is_empty() {
                String::new()
            } else {
                format!("roofline bandwidth measured at {}\n", self.roofline_level)
            }
            + &self.adjusted.iter().map(|a| format!("adjusted: {a}\n")).collect::<String>()
            + &self
                .promotions
                .iter()
                .map(|p| {
                    format!("{} {}: {}\n", if p.promoted { "promoted" } else { "not promoted" }, p.contract, p.message)
                })
                .collect::<String>()
            + &self.kernels_text()
    }
}

impl ProfileReport {
    fn kernels_text(&self) -> String {
        let mut s = String::new();
        if let Some(p) = &self.previous {
            s += &format!(
                "previous profile {} ({}): decode {:.0} tok/s (min {:.0}, max {:.0}); change {:+.1}%{}\n",
                p.outcome,
                p.time,
                p.decode_tok_s.median,
                p.decode_tok_s.min,
                p.decode_tok_s.max,
                p.change_pct,
                if p.regression { " REGRESSION beyond the noise" } else { "" }
            );
            if !p.note.is_empty() {
                s += &format!("  {}\n", p.note);
            }
        }
        if !self.points.is_empty() {
            s += &format!(
                "the real forward, point by point ({} weights, {} thread(s); traced decode {:.0} tok/s, {:.0}% of the untraced):\n",
                self.dtype,
                self.threads,
                self.traced_decode_tok_s,
                if self.decode_tok_s.median > 0.0 {
                    100.0 * self.traced_decode_tok_s / self.decode_tok_s.median
                } else {
                    0.0
                }
            );
            for p in &self.points {
                let roofline = if p.fused_into.is_empty() {
                    format!("{:>7.1} GB/s  {:>4.0}% of roofline", p.gb_s, 100.0 * p.roofline_fraction)
                } else {
                    format!("fused: counted with {}", p.fused_into)
                };
                s += &format!(
                    "  {:>5.1}%  {:<16} {:<20} x{:<3} {:>9.2} us  {roofline}\n",
                    100.0 * p.share_of_decode,
                    p.point,
                    if p.kernel.is_empty() { "-" } else { &p.kernel },
                    p.layers.max(1),
                    p.time_us.median,
                );
            }
            if self.roofline_level.is_empty() && self.points.iter().any(|p| p.roofline_fraction > 1.0) {
                s += "  (above 100%: the roofline is the platform contract's bandwidth, not this machine's; run probe_machine to measure it at the model's working set)\n";
            }
            s += &format!(
                "  points add up to {:.0}% of the traced decode time\n",
                100.0 * self.points.iter().map(|p| p.share_of_decode).sum::<f64>()
            );
        } else if !self.points_note.is_empty() {
            s += &format!("{}\n", self.points_note);
        }
        if self.kernels.is_empty() {
            return s;
        }
        s += &format!(
            "kernels of one decode step timed alone ({} weights, {} thread(s)); their summed time is {:.0}% of the measured decode time:\n",
            self.dtype,
            self.threads,
            100.0 * self.kernel_time_fraction
        );
        for k in &self.kernels {
            s += &format!(
                "  {:>5.1}%  {:<20} {:<44} x{:<3} {:>9.2} us  {:>7.1} GB/s {:>7.1} GFLOP/s  {:>4.0}% of roofline\n",
                100.0 * k.share_of_decode,
                k.kernel,
                k.label,
                k.calls_per_token,
                k.time_us.median,
                k.gb_s,
                k.gflop_s,
                100.0 * k.roofline_fraction
            );
        }
        if !self.bounding_kernel.is_empty() {
            s += &format!(
                "verdict: {} bounds decode ({:.0}% of {})\n",
                self.bounding_kernel,
                100.0 * self.bounding_share,
                if self.points.is_empty() { "the kernels' time" } else { "the real forward's decode time" }
            );
            for g in &self.guidance {
                s += &format!("  guidance: {g}\n");
            }
        }
        s
    }
}

/// Profile an engine.
///
/// # Errors
/// Not a crate, unreadable or uncovered model, outside the workspace, or the harness cannot start.
pub fn profile(ctx: &Ctx, req: &ProfileRequest, budget: &Budget) -> Result<ProfileReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::Profile, &req.engine, req.dtype.as_deref(), budget)?;
    let ck = crate::checkpoint::Checkpoint::open(ctx, &req.model)?;
    let cfg = &ck.cfg;
    let model_dir = ck.path().to_path_buf();
    let target = gate.target.clone();
    gate.same_family(&model_dir, &cfg.family)?;
    // Requests beyond the model's context or the run limit are adjusted, and the report says so.
    let max_seq = cfg.max_seq;
    let mut adjusted = Vec::new();
    let asked = req.prompt_len.unwrap_or(32);
    let prompt_len = asked.clamp(1, max_seq.saturating_sub(1).max(1));
    if prompt_len != asked {
        adjusted.push(format!(
            "prompt_len {asked} -> {prompt_len}: the model's context (config.json max_position_embeddings) is {max_seq} positions, and at least one is left to decode"
        ));
    }
    let asked = req.new_tokens.unwrap_or(64);
    let new_tokens = asked.clamp(1, max_seq.saturating_sub(prompt_len).max(1));
    if new_tokens != asked {
        adjusted.push(format!(
            "new_tokens {asked} -> {new_tokens}: {prompt_len} prompt tokens leave {} of the model's {max_seq} positions (config.json max_position_embeddings)",
            max_seq.saturating_sub(prompt_len)
        ));
    }
    let asked = req.runs.unwrap_or(5);
    let runs = asked.clamp(1, 100);
    if runs != asked {
        adjusted.push(format!("runs {asked} -> {runs}: runs are 1..=100"));
    }
    let verified = ledger::Ledger::open(&ctx.ledger)
        .and_then(|l| l.passed_on("verify_generation", &gate.engine.hash, &target.dtype))
        .unwrap_or(false);
    // The weights the family's graph binds on this config (no Llama shape assumed): the embedding
    // row read per token is negligible; lm_head (or the tied table) is read in full.
    let (family, fam) = ck.family(&ctx.ckb)?;
    let config = serde_json::Value::Object(ck.config.clone());
    // A mixture of experts reads only the experts its router selects (top_k of them per layer).
    let parameters = crate::synth::graph_parameters(family, &config)?;
    let streamed = parameters.streamed(cfg.tied) as f64;
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
    let probe: Option<probe::MachineProbe> = ledger::Ledger::open(&ctx.ledger)
        .ok()
        .and_then(|l| l.probe(&probe::fingerprint()).ok().flatten())
        .and_then(|v| serde_json::from_value(v).ok());
    let threads = req.threads.unwrap_or(1);
    if threads == 0 || threads > 1024 {
        return Err(Error::usage(format!("threads must be 1..=1024, got {threads}")));
    }
    let platform = figures_platform.and_then(|p| p.platform.as_ref());
    // A CUDA engine's device figures (HBM, L2, peaks) are its target platform contract's, whatever
    // this host is.
    let gpu = target_platform.and_then(|p| p.platform.as_ref()).and_then(|p| p.gpu.as_ref());
    let contract_bw = |n: usize| platform.and_then(|p| p.bandwidth_gbs.get(&n.to_string()).copied());
    let level = probe.as_ref().and_then(|p| roofline_level(p, bytes_per_token, threads));
    let bandwidth = level
        .as_ref()
        .map(|l| l.0)
        .or_else(|| contract_bw(threads))
        .or_else(|| contract_bw(1).map(|b| b * threads as f64))
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
    let roofline_level = level.map(|(_, label)| {
        let resident = if label.starts_with("DRAM") { "does not fit in cache" } else { "is cache-resident" };
        format!("{label}: the decode working set of {:.1} MB {resident}", bytes_per_token / 1e6)
    });
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
    gate.contracts(&contract_ids);
    let compute_bound = peak * 1e9 / (2.0 * (parameters.total - parameters.idle_experts) as f64);
    let mut report = ProfileReport {
        passed: false,
        attestation: gate.attestation_note(),
        adjusted,
        threads,
        kernels: vec![],
        points: vec![],
        traced_decode_tok_s: 0.0,
        points_note: String::new(),
        bounding_kernel: String::new(),
        bounding_share: 0.0,
        kernel_time_fraction: 0.0,
        guidance: vec![],
        previous: None,
        dtype: target.dtype.clone(),
        bytes_per_token,
        expert_fraction: parameters.expert_fraction,
        verified,
        prompt_len,
        new_tokens,
        runs,
        prefill_tok_s: Spread::of(&[]),
        decode_tok_s: Spread::of(&[]),
        first_token_ms: Spread::of(&[]),
        prefill_by_len: vec![],
        peak_rss_mb: 0.0,
        machine_load: None,
        load_ms: 0.0,
        roofline_decode_tok_s: roofline,
        compute_bound_tok_s: compute_bound,
        runs_checked: 0,
        prefill_runs_checked: 0,
        traced_runs_checked: 0,
        outputs_ok: false,
        sandboxed: ctx.workshop.sandboxed(),
        rules: vec![],
        error: String::new(),
        figures_from,
        roofline_level: roofline_level.unwrap_or_default(),
        promotions: vec![],
        device: None,
    };
    // Split before the build: a bundle is staged beside its destination, a bundle read back is not built.
    gate.split(req.write_bundle.as_deref(), req.from_bundle.as_deref())?;
    if gate.bundle.is_some() {
        report.figures_from += "; timings measured where the bundle ran (metainfer bundle run)";
    }
    // The timed prompts are drawn from it (a bundle read back carries the one it was written with).
    let seed = gate.draw_seed(None)?;
    let threads_env = vec![("RAYON_NUM_THREADS", threads.to_string())];
    // Every kernel of one decode step, timed alone on this model's shapes, at the middle of the
    // decoded span (sent with the profile, so that a bundle carries both).
    let kv_len = prompt_len + new_tokens / 2;
    let calls = roofline::decode_calls(cfg, &target.spec.kernels, &target.dtype, kv_len, bytes_per_token);
    let mut spec = ProfileSpec {
        ck: &ck,
        fam,
        report,
        threads_env,
        calls,
        kv_len,
        active: parameters.total - parameters.idle_experts,
        bytes_per_token,
        probe,
        platform,
        gpu,
        bandwidth,
        peak,
        verified,
        load_before: None,
        seed,
    };
    gate.run(&mut spec)
}
