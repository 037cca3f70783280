//! serve_engine (CLI `metainfer load-test`): builds the engine's binary, starts its
//! OpenAI-compatible server on a loopback port (sandboxed, its process group killed when the gate
//! ends: `harness::ServerProcess`), runs a conformance battery, then a load test.
//!
//! The battery (component.openai_server): `/health` and `/v1/models`; greedy completions of drawn
//! prompts equal the f64 reference's greedy text, token count and finish reason (EOS honoured);
//! streaming equals non-streaming and ends with `[DONE]`; a stop string cuts the text before it with
//! finish_reason "stop"; chat completions answer in OpenAI's shape; bad requests (malformed JSON,
//! negative or absurd max_tokens, temperature, top_p, an unknown model, a prompt longer than the
//! context) are answered 4xx with an `{"error": {"message", "type"}}` body; the server is alive
//! afterwards and still answers greedy requests correctly; streaming requests on reused keep-alive
//! connections are answered as fast as on fresh ones (TCP_NODELAY, [`KEEP_ALIVE_EXCESS_MS`]).
//!
//! Split through a bundle (`write_bundle`, then `metainfer bundle run DIR` where the device is, then
//! `from_bundle`): the binary and the [`Plan`] (every request, drawn here; no expected answer)
//! travel; the server runs and the client sends the plan there ([`run_bundle`]); what came back
//! ([`Observed`]) is judged here against the reference, as a direct run's is.
//!
//! The load test: at each concurrency level, that many clients send streaming greedy completions of
//! drawn prompts back to back over pooled keep-alive connections, as real clients send them; it
//! checks every output under load against the reference and reports, from the answers equal to
//! the reference's, output tokens/s (the reference's token counts), requests/s, time to first
//! token (TTFT) and inter-token latency (ITL: per request, the time from its first to its last text
//! over its text tokens less one) at p50 and p99 (nearest rank) (`judge::level_figures`). Figures are measurements of this machine
//! under its current load; no test asserts them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::gate::{Gate, Runs, Spec, Tool, Verdict as GateVerdict};
use super::{Ctx, Report};
use base::error::{Context, Error, Result};
use harness::Budget;
use ledger::figures::{Figures, ServeFigures};
use oracle::llama::Reference;

mod battery;
mod checks;
mod client;
mod judge;
mod load;
mod runner;
#[cfg(test)]
mod tests;
mod wire;

pub use checks::{BURST, KEEP_ALIVE_EXCESS_MS, KEEP_ALIVE_ROUNDS};
pub use client::{MAX_ANSWER_BYTES, MAX_EVENT_LINE, MAX_STREAM_BYTES};
pub use runner::{ServeRun, run_bundle};
pub use wire::{Answered, Ask, LevelRun, Observed, Plan, Step, StreamAnswered};

/// What to serve and how hard to load it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServeRequest {
    /// Engine crate directory (its metainfer.toml must have a `[serving]` table; its binary takes
    /// `serve --model DIR --host H --port P`).
    pub engine: String,
    /// Hugging Face model directory with real weights.
    pub model: String,
    /// Concurrency levels of the load test, each 1..=64, at most 8 of them (default 1, 4, 16).
    #[serde(default)]
    pub concurrency: Option<Vec<usize>>,
    /// Requests per level (default twice the level's concurrency).
    #[serde(default)]
    pub requests: Option<usize>,
    /// New tokens per load-test request, 1..=256 (default 16).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Seed of the drawn prompts (below 2^53; a decimal string is accepted too); absent: fresh, reported.
    #[serde(default, deserialize_with = "base::util::de_seed")]
    pub seed: Option<u64>,
    /// Weight dtype to build the engine for; absent: the engine's own.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Do not run: build the engine's binary and draw every request here, and write them (no
    /// expected answer) as a bundle to this directory (new or empty), to run with
    /// `metainfer bundle run DIR` where the device is: the server starts there, the battery and
    /// the load test are sent there, and what came back is recorded in the bundle.
    #[serde(default)]
    pub write_bundle: Option<String>,
    /// Judge and record a bundle written by this gate and run elsewhere (`metainfer bundle run`),
    /// instead of serving here: the answers are compared with the reference here; the timing
    /// figures are the other machine's. The engine's sources must be the ones it was written from.
    #[serde(default)]
    pub from_bundle: Option<String>,
}

/// One check of the conformance battery.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Check {
    /// Short name (help, health, models, greedy, streaming, stop, chat, bad_requests, burst, alive,
    /// disconnect, keep_alive).
    pub name: String,
    /// Whether it passed.
    pub passed: bool,
    /// What was sent and seen; on failure, what differs.
    pub detail: String,
}

/// One concurrency level of the load test.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct LoadLevel {
    /// Clients sending at once.
    pub concurrency: usize,
    /// Requests sent.
    pub requests: usize,
    /// Requests answered completely (streamed to `[DONE]`).
    pub completed: usize,
    /// Completions whose text differs from the reference's greedy text and is reached by no path
    /// of it that takes near-ties (another token within 1e-3 of the greedy logit) where it leaves
    /// the greedy one.
    pub greedy_mismatches: usize,
    /// Completion tokens over the requests answered with the reference's text (the reference's
    /// token counts; the server's `usage` is not trusted).
    pub output_tokens: usize,
    /// Wall time of the level, seconds.
    pub seconds: f64,
    /// Output tokens per second of wall time.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Time to first token, median, milliseconds.
    pub ttft_ms_p50: f64,
    /// Time to first token, 99th percentile (nearest rank), milliseconds.
    pub ttft_ms_p99: f64,
    /// Inter-token latency, median, milliseconds: per request answered with the reference's text,
    /// the time from its first to its last streamed text over its tokens that carry text less one.
    pub itl_ms_p50: f64,
    /// Inter-token latency, 99th percentile, milliseconds.
    pub itl_ms_p99: f64,
    /// The first failures in words (at most 4).
    pub errors: Vec<String>,
}

/// serve_engine's result.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ServeReport {
    /// Whether every check passed and every load-test request completed with the reference's text.
    pub passed: bool,
    /// Seed of this run.
    pub seed: u64,
    /// Weight dtype the engine was built for and the reference ran at.
    pub dtype: String,
    /// Whether the server ran in the enforced sandbox.
    pub sandboxed: bool,
    /// The conformance battery, in order.
    pub checks: Vec<Check>,
    /// The load test, one entry per concurrency level.
    pub levels: Vec<LoadLevel>,
    /// Load average (1 minute) of the machine when the load test started; -1 when unknown.
    pub load_average: f64,
    /// What stopped the gate (build, no binary, server exit), "" when nothing did.
    pub error: String,
    /// Rule findings (check_rules); a blocking one stops the gate.
    pub rules: Vec<guard::Finding>,
    /// Judged from a bundle run elsewhere: who signed the run, or why the verdict is unattested
    /// (then it is no evidence); "" for a run here.
    #[serde(default)]
    pub attestation: String,
}

impl Report for ServeReport {
    fn passed(&self) -> bool {
        self.passed
    }
    fn bundle_written(&self) -> bool {
        crate::gate::wrote_bundle(&self.error)
    }
    fn text(&self) -> String {
        let ok = self.checks.iter().filter(|c| c.passed).count();
        let mut s = format!(
            "serve_engine {}: {ok}/{} conformance checks (seed {}, {} weights, sandboxed {})\n",
            if self.passed { "PASSED" } else { "FAILED" },
            self.checks.len(),
            self.seed,
            self.dtype,
            self.sandboxed
        );
        if !self.error.is_empty() {
            s += &format!("{}\n", self.error);
        }
        if !self.attestation.is_empty() {
            s += &format!("{}\n", self.attestation);
        }
        for c in &self.checks {
            s += &format!("{} {}: {}\n", if c.passed { "ok  " } else { "FAIL" }, c.name, c.detail);
        }
        if !self.levels.is_empty() {
            s += &format!(
                "load (machine load average {:.1}; medians and p99 over requests of this run):\n",
                self.load_average
            );
        }
        for l in &self.levels {
            s += &format!(
                "  concurrency {:>2}: {:>8.1} output tokens/s, {:>6.2} requests/s, TTFT p50 {:.1} ms p99 {:.1} ms, ITL p50 {:.1} ms p99 {:.1} ms; {}/{} completed, {} differ from the reference\n",
                l.concurrency,
                l.output_tokens_per_s,
                l.requests_per_s,
                l.ttft_ms_p50,
                l.ttft_ms_p99,
                l.itl_ms_p50,
                l.itl_ms_p99,
                l.completed,
                l.requests,
                l.greedy_mismatches
            );
            for e in &l.errors {
                s += &format!("    {e}\n");
            }
        }
        if let (Some(first), Some(last)) = (self.levels.first(), self.levels.last())
            && self.levels.len() > 1
            && first.output_tokens_per_s > 0.0
        {
            s += &format!(
                "throughput ratio concurrency {} / {}: {:.2}x\n",
                last.concurrency,
                first.concurrency,
                last.output_tokens_per_s / first.output_tokens_per_s
            );
        }
        s
    }
}

/// Run serve_engine.
///
/// # Errors
/// Not a crate, no `[serving]` table, bad levels, an unreadable model, a path outside the
/// workspace, or a process that cannot be started. An engine without a binary, one that does not
/// build, a server that dies or answers wrongly is a report.
pub fn serve_engine(ctx: &Ctx, req: &ServeRequest, budget: &Budget) -> Result<ServeReport> {
    let live = ctx.live();
    let ctx = &*live;
    let mut gate = Gate::open(ctx, Tool::Serve, &req.engine, req.dtype.as_deref(), budget)?;
    if gate.target.serving.is_none() {
        return Err(Error::usage(format!(
            "{}: metainfer.toml has no [serving] table; serve_engine checks engines built with serving constraints (scaffold with --max-seqs and --max-context)",
            gate.engine.dir.display()
        )));
    }
    let levels = req.concurrency.clone().unwrap_or_else(|| vec![1, 4, 16]);
    if levels.is_empty() || levels.len() > wire::MAX_LEVELS || levels.iter().any(|&c| c == 0 || c > 64) {
        return Err(Error::usage(format!(
            "concurrency levels must be 1..=64, at most {} of them, got {levels:?}",
            wire::MAX_LEVELS
        )));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens == 0 || max_tokens > 256 {
        return Err(Error::usage(format!("max_tokens must be 1..=256, got {max_tokens}")));
    }
    if req.requests == Some(0) || req.requests.is_some_and(|r| r > 1024) {
        return Err(Error::usage("requests must be 1..=1024".to_string()));
    }
    let ck = super::checkpoint::Checkpoint::open(ctx, &req.model)?;
    let cfg = &ck.cfg;
    gate.same_family(ck.path(), &cfg.family)?;
    gate.split(req.write_bundle.as_deref(), req.from_bundle.as_deref())?;
    let seed = gate.draw_seed(req.seed)?;
    gate.contracts(&[cfg.family.as_str(), "component.openai_server", "component.scheduler", "kernel.sample"]);
    let dtype = gate.target.dtype.clone();
    let report = ServeReport {
        passed: false,
        seed,
        dtype: dtype.clone(),
        sandboxed: false,
        checks: vec![],
        levels: vec![],
        load_average: -1.0,
        error: String::new(),
        rules: vec![],
        attestation: String::new(),
    };
    // The binary: with the engine's `server` feature when it declares one.
    let mut features = gate.target.spec.features.clone();
    let manifest_text = std::fs::read_to_string(gate.engine.build_dir.join("Cargo.toml")).unwrap_or_default();
    if manifest_text.parse::<toml::Table>().ok().and_then(|t| t.get("features")?.get("server").cloned()).is_some() {
        features.push("server".into());
    }
    // Everything sent is drawn now, from the seed and the tokenizer; the reference's answers are
    // computed when judging.
    let tok = ck.tokenizer()?;
    let draw = wire::Draw {
        seed,
        levels: &levels,
        requests: req.requests,
        max_tokens,
        max_context: cfg.max_seq,
        max_seqs: gate.target.serving.as_ref().map_or(16, |s| s.max_seqs),
    };
    let plan = draw.plan(|p| Ok(model::hf_encode(tok, p)?.len()))?;
    let mut spec = ServeSpec { ck: &ck, report, features, plan };
    gate.run(&mut spec)
}

/// serve_engine as a [`Spec`] that runs the engine's own binary, here or through a bundle: the
/// checkpoint, the plan of what is sent and the report as far as it is known before the binary
/// runs.
struct ServeSpec<'c> {
    ck: &'c super::checkpoint::Checkpoint,
    report: ServeReport,
    features: Vec<String>,
    plan: Plan,
}

impl ServeSpec<'_> {
    /// The reference's answers to the plan, with the near-tie paths to the server's answers in
    /// `seen`: the family's graph, as every gate builds it, stopping at the stop tokens every gate
    /// uses (`Checkpoint::generation`).
    fn expected(&self, gate: &Gate, seen: &Observed) -> Result<judge::Expected> {
        let (ctx, ck) = (gate.ctx, self.ck);
        let tensors = ck.tensors(&ctx.ckb, &self.report.dtype)?;
        let (_, fam) = ck.family(&ctx.ckb)?;
        let mut reference = Reference::of_family(fam, &ck.cfg, tensors, &self.report.dtype)?;
        let tok = ck.tokenizer()?;
        judge::expected(
            &self.plan,
            &ck.generation.eos_token_ids,
            |p| model::hf_encode(tok, p),
            |ids| model::hf_decode(tok, ids),
            |ids, n| reference.greedy_until(ids, n, &ck.generation.eos_token_ids),
            seen,
        )
    }

    /// The verdict on what the server answered.
    fn verdict(&self, gate: &Gate, want: &judge::Expected, seen: &Observed) -> GateVerdict<ServeReport> {
        let (checks, levels) = judge::judge(&self.plan, want, seen);
        let report = ServeReport {
            sandboxed: seen.sandboxed,
            checks,
            levels,
            load_average: seen.load_average,
            error: seen.error.clone(),
            rules: gate.findings.clone(),
            attestation: gate.attestation_note(),
            ..self.report.clone()
        };
        finish(gate, report)
    }
}

impl Spec for ServeSpec<'_> {
    type Report = ServeReport;

    fn runs(&self) -> Runs {
        Runs::Binary(self.features.clone())
    }

    fn unjudged(&self, gate: &Gate, why: String) -> ServeReport {
        ServeReport { error: why, rules: gate.findings.clone(), ..self.report.clone() }
    }

    fn model(&self) -> Option<&base::beneath::HeldDir> {
        Some(&self.ck.held)
    }

    fn plan(&mut self, _gate: &Gate) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(&self.plan).internal_ctx(|| "serve_engine's plan".to_owned())
    }

    fn judge_here(
        &mut self,
        gate: &Gate,
        exe: Option<&std::path::Path>,
        scratch: &std::path::Path,
    ) -> Result<GateVerdict<ServeReport>> {
        let exe = exe.ok_or_else(|| Error::internal("serve_engine judged without the engine's binary"))?;
        let grant = self.ck.held.grant();
        let reads: Vec<std::path::PathBuf> = grant.paths().into_iter().map(std::path::Path::to_path_buf).collect();
        let seen = battery::observe(&gate.ctx.workshop, exe, self.ck.path(), &reads, &self.plan, scratch, gate.budget)?;
        drop(grant);
        // The reference's answers, computed once the server has stopped (it never sees them).
        let want = self.expected(gate, &seen)?;
        Ok(self.verdict(gate, &want, &seen))
    }

    fn judge_observed(&mut self, gate: &Gate, observed: &[u8]) -> Result<GateVerdict<ServeReport>> {
        let seen: Observed = serde_json::from_slice(observed)
            .usage_ctx(|| "the bundle's observations do not parse: run the bundle again".to_owned())?;
        let want = self.expected(gate, &seen)?;
        Ok(self.verdict(gate, &want, &seen))
    }
}

/// Decide, record and return the report.
fn finish(gate: &Gate, mut report: ServeReport) -> GateVerdict<ServeReport> {
    let levels_ok = !report.levels.is_empty()
        && report.levels.iter().all(|l| l.completed == l.requests && l.greedy_mismatches == 0 && l.errors.is_empty());
    report.passed = report.error.is_empty() && report.checks.iter().all(|c| c.passed) && levels_ok;
    let figures = ServeFigures {
        gate: gate.common(),
        checks: report.checks.len(),
        checks_ok: report.checks.iter().filter(|c| c.passed).count(),
        concurrency: report.levels.iter().map(|l| l.concurrency).collect(),
        output_tokens_per_s: report.levels.iter().map(|l| l.output_tokens_per_s).collect(),
        ttft_ms_p99: report.levels.iter().map(|l| l.ttft_ms_p99).collect(),
        greedy_mismatches: report.levels.iter().map(|l| l.greedy_mismatches).sum(),
    };
    GateVerdict { report, figures: Figures::Serve(figures) }
}
