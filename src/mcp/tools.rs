//! The tools: one per skill, each with its title, input and output schemas and truthful
//! annotations, routed by rmcp's tool router to the ops call it makes.

use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, tool, tool_router};
use serde::Serialize;

use super::Server;
use super::schema::{input, output};
use crate::ops::Report;
use crate::ops::compile::{CompileReport, CompileRequest};
use crate::ops::evolve::{EvolveReport, EvolveRequest, ProposeReport, ProposeRequest};
use crate::ops::kernel_test::{KernelTestReport, KernelTestRequest};
use crate::ops::lookup::{LookupReport, LookupRequest};
use crate::ops::machine::MachineRequest;
use crate::ops::outcomes::{OutcomesReport, OutcomesRequest};
use crate::ops::plan::{PlanReport, PlanRequest};
use crate::ops::profile::{ProfileReport, ProfileRequest};
use crate::ops::report::{CkbReport, ReportRequest};
use crate::ops::rules::{RulesReport, RulesRequest};
use crate::ops::scaffold::{ScaffoldReport, ScaffoldRequest};
use crate::ops::verify::{VerifyReport, VerifyRequest};
use crate::probe::MachineProbe;

/// The directories path arguments may point into, as the server enforces them.
#[derive(Debug, Clone, Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct AllowedDirectories {
    /// Whether path arguments are confined at all (a `--workspace`, or the client's roots).
    pub confined: bool,
    /// The workspace: relative paths are taken relative to it. Empty when not confined.
    pub workspace: String,
    /// Further directories paths may point into (`--model-dir`, further roots).
    pub others: Vec<String>,
}

impl Report for AllowedDirectories {
    fn passed(&self) -> bool {
        true
    }
    fn text(&self) -> String {
        if !self.confined {
            return "not confined: any path on this machine is allowed; relative paths are taken relative to the server's working directory\n".into();
        }
        let mut s = format!("workspace: {} (relative paths are taken relative to it)\n", self.workspace);
        for o in &self.others {
            s += &format!("also allowed: {o}\n");
        }
        s + "Other paths are refused; the user can add one with `--model-dir DIR` (metainfer register ... --model-dir DIR --replace).\n"
    }
}

/// An empty request.
#[derive(Debug, Clone, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArguments {}

#[tool_router(vis = "pub(super)")]
impl Server {
    /// Plan an engine from constraints: routes the model's config.json to a model-family contract (or names the
    /// uncovered fields) and returns the build phases with their contracts and gates.
    #[tool(
        name = "plan_engine",
        title = "Plan an engine",
        input_schema = input::<PlanRequest>(),
        output_schema = output::<PlanReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn plan_engine(
        &self,
        Parameters(req): Parameters<PlanRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.quick(&rc, "plan_engine", move |ctx| crate::ops::plan::plan(ctx, &req)).await
    }

    /// Look up a contract by id (math, shapes, dtypes, tolerance, pseudocode, failure modes, Rust signature) or
    /// search the knowledge base by words.
    #[tool(
        name = "lookup_contract",
        title = "Look up contracts",
        input_schema = input::<LookupRequest>(),
        output_schema = output::<LookupReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn lookup_contract(
        &self,
        Parameters(req): Parameters<LookupRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.quick(&rc, "lookup_contract", move |ctx| crate::ops::lookup::lookup(ctx, &req)).await
    }

    /// List the outcome ledger, newest first: every tool call's result with its engine hash, contracts and
    /// figures. Paginated: pass `next_cursor` back as `cursor`.
    #[tool(
        name = "list_outcomes",
        title = "List recorded outcomes",
        input_schema = input::<OutcomesRequest>(),
        output_schema = output::<OutcomesReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn list_outcomes(
        &self,
        Parameters(req): Parameters<OutcomesRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.quick(&rc, "list_outcomes", move |ctx| crate::ops::outcomes::list(ctx, &req)).await
    }

    /// Report what the ledger says about the knowledge base: per contract attempts, first-try pass rate, attempts
    /// and time to green, frequent failure modes; the same per reference level; each engine's phase timeline; and
    /// the coverage matrix (family x platform x dtype).
    #[tool(
        name = "ckb_report",
        title = "Report on the knowledge base",
        input_schema = input::<ReportRequest>(),
        output_schema = output::<CkbReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn ckb_report(
        &self,
        Parameters(req): Parameters<ReportRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.quick(&rc, "ckb_report", move |ctx| crate::ops::report::report(ctx, &req)).await
    }

    /// Cluster recurring failures in the ledger that no known failure mode explains, and stage one candidate
    /// failure-mode contract per cluster (with the outcome ids as evidence). Candidates never enter the knowledge
    /// base without promotion.
    #[tool(
        name = "evolve_knowledge",
        title = "Stage candidate failure modes",
        input_schema = input::<EvolveRequest>(),
        output_schema = output::<EvolveReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn evolve_knowledge(
        &self,
        Parameters(req): Parameters<EvolveRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.quick(&rc, "evolve_knowledge", move |ctx| crate::ops::evolve::evolve(ctx, &req)).await
    }

    /// Propose a new or amended contract (a model family, kernel, component, platform or failure mode) as TOML.
    /// It is validated (schema and lint, against the knowledge base) and staged; an amendment must bump the
    /// version. A new model family or platform routes provisionally at once: plan, lookup, scaffold and the gates
    /// use it. A platform is promoted into the CKB working copy (--ckb DIR) by a passing verify_generation (or
    /// verified profile_engine) under it; a model family only by a passing `metainfer ckb conformance DIR` on
    /// vectors its own implementation wrote (an engine written to the same contract is no evidence). Other
    /// proposals are promoted once the ledger holds evidence, or by a person.
    #[tool(
        name = "propose_contract",
        title = "Propose a contract",
        input_schema = input::<ProposeRequest>(),
        output_schema = output::<ProposeReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn propose_contract(
        &self,
        Parameters(req): Parameters<ProposeRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let r = self.quick(&rc, "propose_contract", move |ctx| crate::ops::evolve::propose(ctx, &req)).await;
        self.notify_if_ckb_changed(&rc.peer).await;
        r
    }

    /// Write a compilable engine crate for the constraints into an empty directory: Cargo.toml, one module per
    /// phase, the fixed public signatures the gates call with their contract docs, and todo!() bodies.
    #[tool(
        name = "scaffold_engine",
        title = "Scaffold an engine crate",
        input_schema = input::<ScaffoldRequest>(),
        output_schema = output::<ScaffoldReport>(),
        annotations(read_only_hint = false, destructive_hint = true, idempotent_hint = false, open_world_hint = false)
    )]
    async fn scaffold_engine(
        &self,
        Parameters(req): Parameters<ScaffoldRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.quick(&rc, "scaffold_engine", move |ctx| crate::ops::scaffold::scaffold(ctx, &req)).await
    }

    /// Build the engine crate (release) and return compiler errors with file, line, code and a contract hint.
    #[tool(
        name = "compile_engine",
        title = "Compile the engine",
        input_schema = input::<CompileRequest>(),
        output_schema = output::<CompileReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = true, open_world_hint = true)
    )]
    async fn compile_engine(
        &self,
        Parameters(req): Parameters<CompileRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "compile_engine", &engine, move |ctx, b| crate::ops::compile::compile(ctx, &req, b)).await
    }

    /// Test the engine's kernels against the f64 oracle at each contract's tolerance, on inputs drawn from a
    /// fresh seed (reported; pass it back to replay). Per kernel: pass/fail, max abs/rel error, worst case.
    #[tool(
        name = "run_kernel_test",
        title = "Test the kernels against the oracles",
        input_schema = input::<KernelTestRequest>(),
        output_schema = output::<KernelTestReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = true)
    )]
    async fn run_kernel_test(
        &self,
        Parameters(req): Parameters<KernelTestRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "run_kernel_test", &engine, move |ctx, b| crate::ops::kernel_test::kernel_test(ctx, &req, b))
            .await
    }

    /// Verify end-to-end generation on a real checkpoint: the engine's tokenizer against HF tokenizers, greedy
    /// tokens exactly and per-step logits within tolerance against the reference forward pass. Some prompts are
    /// drawn at random on every run. A pass under a staged platform proposal promotes it into the CKB working copy;
    /// under a staged model family it says what evidence would (`ckb conformance`).
    #[tool(
        name = "verify_generation",
        title = "Verify generation on a real model",
        input_schema = input::<VerifyRequest>(),
        output_schema = output::<VerifyReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = true)
    )]
    async fn verify_generation(
        &self,
        Parameters(req): Parameters<VerifyRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "verify_generation", &engine, move |ctx, b| crate::ops::verify::verify(ctx, &req, b)).await
    }

    /// Verify an engine with serving constraints ([serving] in metainfer.toml): its block manager under a random
    /// operation sequence (no block owned twice, free count exact, tables only grow at their end) and its batched
    /// step: several sequences of different prompt lengths, arriving at different steps, on a continuous-batching
    /// schedule over one paged KV cache; every sequence's logits must equal its single-sequence reference within
    /// tolerance and its greedy tokens exactly. Drawn from a fresh seed on every run.
    #[tool(
        name = "verify_batching",
        title = "Verify batching over a paged KV cache",
        input_schema = input::<crate::ops::batching::BatchingRequest>(),
        output_schema = output::<crate::ops::batching::BatchingReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = true)
    )]
    async fn verify_batching(
        &self,
        Parameters(req): Parameters<crate::ops::batching::BatchingRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "verify_batching", &engine, move |ctx, b| crate::ops::batching::verify_batching(ctx, &req, b))
            .await
    }

    /// Build a serving engine's binary, start its OpenAI-compatible server on a loopback port (sandboxed, killed when
    /// the call ends) and test it: a conformance battery (greedy completions equal the reference's, streaming equals
    /// non-streaming and ends with [DONE], stop strings and EOS honoured, chat, bad requests answered 4xx in OpenAI's
    /// error shape, the server alive afterwards), then load at concurrency 1, 4 and 16 (configurable) reporting output
    /// tokens/s, requests/s, TTFT and ITL (p50, p99) with every output checked against the reference.
    #[tool(
        name = "serve_engine",
        title = "Serve an engine and load-test it",
        input_schema = input::<crate::ops::serve::ServeRequest>(),
        output_schema = output::<crate::ops::serve::ServeReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = true)
    )]
    async fn serve_engine(
        &self,
        Parameters(req): Parameters<crate::ops::serve::ServeRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "serve_engine", &engine, move |ctx, b| crate::ops::serve::serve_engine(ctx, &req, b)).await
    }

    /// Check the zero-reference and anti-fake rules on an engine: denied dependencies (full resolved graph),
    /// paths, includes and symlinks outside the crate, build scripts, changed gate signatures, hard-coded outputs,
    /// and fingerprint matches with registered reference code. Also run before every gate.
    #[tool(
        name = "check_rules",
        title = "Check the zero-reference and anti-fake rules",
        input_schema = input::<RulesRequest>(),
        output_schema = output::<RulesReport>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = true)
    )]
    async fn check_rules(
        &self,
        Parameters(req): Parameters<RulesRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "check_rules", &engine, move |ctx, b| crate::ops::rules::check_rules(ctx, &req, b)).await
    }

    /// Measure prefill and decode tokens/s (median, min, max over several runs), time to first token and load
    /// time, against the platform's bandwidth roofline. A verified pass under a staged platform proposal promotes it
    /// into the CKB working copy.
    #[tool(
        name = "profile_engine",
        title = "Profile tokens per second",
        input_schema = input::<ProfileRequest>(),
        output_schema = output::<ProfileReport>(),
        annotations(read_only_hint = false, destructive_hint = false, idempotent_hint = false, open_world_hint = true)
    )]
    async fn profile_engine(
        &self,
        Parameters(req): Parameters<ProfileRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let engine = req.engine.clone();
        self.long(rc, "profile_engine", &engine, move |ctx, b| crate::ops::profile::profile(ctx, &req, b)).await
    }

    /// Probe this machine: read bandwidth at L1, L2, L3 and DRAM working sets and peak f32 FLOP/s on 1..N
    /// threads (min, median, max), the roofline profile_engine compares an engine with. Cached per machine;
    /// `refresh` measures again (about a minute).
    #[tool(
        name = "probe_machine",
        title = "Probe this machine",
        input_schema = input::<MachineRequest>(),
        output_schema = output::<MachineProbe>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn probe_machine(
        &self,
        Parameters(req): Parameters<MachineRequest>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.long(rc, "probe_machine", "machine", move |ctx, _| crate::ops::machine::probe(ctx, &req, |_| {})).await
    }

    /// List the directories path arguments may point into: the workspace (relative paths are taken relative to
    /// it) and the model directories. A path elsewhere is refused.
    #[tool(
        name = "list_allowed_directories",
        title = "List allowed directories",
        input_schema = input::<NoArguments>(),
        output_schema = output::<AllowedDirectories>(),
        annotations(read_only_hint = true, destructive_hint = false, idempotent_hint = true, open_world_hint = false)
    )]
    async fn list_allowed_directories(
        &self,
        Parameters(_req): Parameters<NoArguments>,
        rc: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.note_client(&rc);
        let ctx = self.ctx();
        let report = AllowedDirectories {
            confined: ctx.workspace.is_some(),
            workspace: ctx.workspace.as_ref().map(|w| w.display().to_string()).unwrap_or_default(),
            others: ctx
                .models
                .iter()
                .map(|m| match m.canonicalize() {
                    Ok(real) => real.display().to_string(),
                    Err(e) => format!("{} (cannot be opened: {e}; it admits nothing)", m.display()),
                })
                .collect(),
        };
        self.to_result(Ok(report))
    }
}
