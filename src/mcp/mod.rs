//! The MCP server (rmcp, stdio). The only module that knows rmcp: it turns requests into ops calls
//! and reports into tool results (text content + structuredContent matching outputSchema).
//!
//! A failed gate is a normal result (`isError` false, `passed` false in the structured content); a
//! bad request is a tool error (`isError` true) whose text says what to fix.

#![allow(
    deprecated,
    reason = "MCP logging and roots are deprecated by SEP-2577 (protocol 2026-07-28), but the clients in use \
              (Claude Code, Gemini CLI, VS Code, Cursor) still rely on them"
)]

pub mod framing;
pub mod schema;

use std::sync::Arc;
use std::time::Duration;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, CompleteRequestParams, CompleteResult, CompletionInfo, ContentBlock, GetPromptRequestParams,
    GetPromptResponse, GetPromptResult, Implementation, ListPromptsResult, ListResourceTemplatesResult,
    ListResourcesResult, LoggingLevel, LoggingMessageNotificationParam, PaginatedRequestParams,
    ProgressNotificationParam, Prompt, PromptArgument, PromptMessage, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, Reference, Resource, ResourceContents, ResourceTemplate, Role, ServerCapabilities,
    ServerConfig, SetLevelRequestParams,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use serde::Serialize;

use crate::harness::Budget;
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
use crate::ops::{Ctx, Report};
use crate::options::{ServerOptions, Toolset};
use crate::probe::MachineProbe;
use schema::{input, output};

/// What the server tells an agent at initialisation: the order of work.
pub const INSTRUCTIONS: &str = "metainfer helps you build a compact LLM inference engine for exact constraints, proven \
against server-owned oracles. Order of work: 1) plan_engine with the model directory, target and dtype: it routes \
config.json to a model-family contract and lists the phases (kernels, weight_loading, decoder_layer, full_forward, \
generation, performance) with their contracts and gates. 2) lookup_contract {phase, family} before writing a phase: its \
contracts (math, shapes, tolerance, pseudocode), their failure modes and what they require, each once. Build only from these contracts; do not read or copy \
other inference frameworks. 3) scaffold_engine into an empty directory: it writes the crate with the fixed public \
signatures the gates call; keep them. 4) Implement kernels, then compile_engine and run_kernel_test until every \
kernel passes (inputs are drawn fresh each run; the seed replays one). 5) Implement weight loading, the decoder \
layer, the full forward with KV cache, the tokenizer and the greedy sampler, then verify_generation on the real \
checkpoint (tokenizer, logits and greedy tokens are compared with the reference; some prompts are random). \
6) profile_engine for tokens/s. Every call is recorded in the outcome ledger. Paths must lie in the directories \
list_allowed_directories names.";

/// Which tools the server offers (`serve --read-only`, `--toolsets`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposure {
    /// Only tools whose annotations say read-only.
    pub read_only: bool,
    /// Only these groups; empty: all.
    pub toolsets: Vec<Toolset>,
    /// Whether `--workspace` was given (else the client's MCP roots become the workspace).
    pub workspace_given: bool,
    /// `--model-dir` directories, kept beside the client's roots.
    pub model_dirs: Vec<std::path::PathBuf>,
}

impl Exposure {
    /// The exposure of a server started with these options.
    pub fn of(o: &ServerOptions) -> Exposure {
        Exposure {
            read_only: o.read_only,
            toolsets: o.toolsets.clone(),
            workspace_given: o.workspace.is_some(),
            model_dirs: o.model_dirs.clone(),
        }
    }
}

/// The toolset a tool belongs to.
pub fn toolset_of(tool: &str) -> Toolset {
    match tool {
        "scaffold_engine" | "compile_engine" | "check_rules" => Toolset::Build,
        "run_kernel_test" | "verify_generation" | "profile_engine" | "verify_batching" | "serve_engine" => {
            Toolset::Gates
        }
        _ => Toolset::Knowledge,
    }
}

/// The metainfer MCP server.
#[derive(Clone)]
pub struct Server {
    /// The context calls run in; replaced when the client's roots change (no `--workspace`).
    ctx: Arc<std::sync::RwLock<Arc<Ctx>>>,
    exposure: Arc<Exposure>,
    /// Least severity of the log messages sent to the client (logging/setLevel).
    log_level: Arc<std::sync::Mutex<LoggingLevel>>,
    /// Fingerprint of the knowledge base the client last listed, to notify resources/list_changed.
    ckb_seen: Arc<std::sync::Mutex<String>>,
    /// Cancellation flags of the calls in flight, so that closing the session kills their children.
    running: Arc<std::sync::Mutex<Vec<Arc<std::sync::atomic::AtomicBool>>>>,
    /// Engine directories a call is working on: a second call on the same engine is refused.
    busy: Arc<std::sync::Mutex<std::collections::HashMap<String, &'static str>>>,
    /// The tools offered (narrowed by `--read-only` and `--toolsets`).
    tool_router: ToolRouter<Self>,
}

fn ok_result<R: Report + Serialize>(report: &R, max_text: usize) -> CallToolResult {
    let value = serde_json::to_value(report).expect("reports serialise");
    let size = crate::ops::page::json_len(&value);
    if size > max_text {
        tracing::warn!("structured result of {size} characters exceeds --max-output {max_text}");
    }
    let mut r = CallToolResult::success(vec![ContentBlock::text(crate::ops::bound_text(&report.text(), max_text))]);
    r.structured_content = Some(value);
    r
}

fn level_rank(l: LoggingLevel) -> u8 {
    match l {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

fn err_result(e: crate::error::Error) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(e.message)])
}

impl Server {
    /// The context calls run in now.
    fn ctx(&self) -> Arc<Ctx> {
        self.ctx.read().expect("not poisoned").clone()
    }

    /// Remember the client's name and version for the ledger: from its initialize request, or,
    /// for a client that skips initialization (the 2026 protocol's per-request metadata), from the
    /// request's `_meta` (`io.modelcontextprotocol/clientInfo`).
    fn note_client(&self, rc: &RequestContext<RoleServer>) {
        let info = rc.meta.client_info().or_else(|| rc.peer.peer_info().map(|i| i.client_info.clone()));
        if let Some(info) = info {
            let who = format!("{}/{}", info.name, info.version);
            let ctx = self.ctx();
            if let Ok(mut c) = ctx.client.write()
                && *c != who
            {
                *c = who;
            }
        }
    }

    fn to_result<R: Report + Serialize>(&self, r: crate::error::Result<R>) -> Result<CallToolResult, ErrorData> {
        Ok(match r {
            Ok(report) => ok_result(&report, self.ctx().max_output),
            Err(e) => err_result(e),
        })
    }

    /// Run a short operation off the async runtime (it reads files, which may be slow or large),
    /// under the call's time limit.
    async fn quick<R, F>(
        &self,
        rc: &RequestContext<RoleServer>,
        what: &'static str,
        f: F,
    ) -> Result<CallToolResult, ErrorData>
    where
        R: Report + Serialize + Send + 'static,
        F: FnOnce(&Ctx) -> crate::error::Result<R> + Send + 'static,
    {
        self.note_client(rc);
        let ctx = self.ctx();
        let limit = ctx.time_limit_s;
        let job = tokio::task::spawn_blocking(move || f(&ctx));
        match tokio::time::timeout(Duration::from_secs(limit), job).await {
            Ok(Ok(r)) => self.to_result(r),
            Ok(Err(e)) => Err(ErrorData::internal_error(format!("{what} failed inside the server: {e}"), None)),
            Err(_) => Ok(err_result(crate::error::Error::usage(format!(
                "{what} ran past the time limit of {limit} s and was abandoned"
            )))),
        }
    }

    /// A server over a context, offering the tools `exposure` allows.
    pub fn new(ctx: Ctx, exposure: Exposure) -> Server {
        let mut tool_router = Self::tool_router();
        for t in tool_router.list_all() {
            let read_only = t.annotations.as_ref().and_then(|a| a.read_only_hint).unwrap_or(false);
            let in_set = exposure.toolsets.is_empty() || exposure.toolsets.contains(&toolset_of(&t.name));
            if (exposure.read_only && !read_only) || !in_set {
                tool_router.remove_route(&t.name);
            }
        }
        let seen = ctx.ckb.fingerprint().to_string();
        Server {
            ctx: Arc::new(std::sync::RwLock::new(Arc::new(ctx))),
            exposure: Arc::new(exposure),
            log_level: Arc::new(std::sync::Mutex::new(LoggingLevel::Info)),
            ckb_seen: Arc::new(std::sync::Mutex::new(seen)),
            running: Default::default(),
            busy: Default::default(),
            tool_router,
        }
    }

    /// Send a log message to the client (notifications/message) when its level is enabled.
    async fn log(&self, peer: &rmcp::Peer<RoleServer>, level: LoggingLevel, data: String) {
        if level_rank(level) < level_rank(*self.log_level.lock().expect("not poisoned")) {
            return;
        }
        let _ = peer
            .notify_logging_message(
                LoggingMessageNotificationParam::new(level, serde_json::Value::String(data)).with_logger("metainfer"),
            )
            .await;
    }

    /// After a call that may have promoted a contract: when the knowledge base changed, tell the
    /// client that the resource list changed.
    async fn notify_if_ckb_changed(&self, peer: &rmcp::Peer<RoleServer>) {
        let now = self.ctx().live().ckb.fingerprint().to_string();
        let changed = {
            let mut seen = self.ckb_seen.lock().expect("not poisoned");
            let changed = *seen != now;
            *seen = now;
            changed
        };
        if changed {
            let _ = peer.notify_resource_list_changed().await;
            self.log(
                peer,
                LoggingLevel::Notice,
                "the knowledge base changed (a contract was promoted); resources/list is new".into(),
            )
            .await;
        }
    }

    /// Ask a client that offers roots for them, without holding up the session.
    fn spawn_adopt_roots(&self, peer: rmcp::Peer<RoleServer>) {
        let offers_roots = peer.peer_info().is_some_and(|i| i.capabilities.roots.is_some());
        if self.exposure.workspace_given || !offers_roots {
            return;
        }
        let server = self.clone();
        tokio::spawn(async move { server.adopt_roots(&peer).await });
    }

    /// Without `--workspace`: the client's roots (file URIs) become the workspace (the first) and
    /// further allowed directories (the rest, with the `--model-dir` directories).
    async fn adopt_roots(&self, peer: &rmcp::Peer<RoleServer>) {
        if self.exposure.workspace_given {
            return;
        }
        let roots = match peer.list_roots().await {
            Ok(r) => r.roots,
            Err(e) => {
                tracing::debug!("client offers no roots: {e}");
                return;
            }
        };
        let dirs: Vec<std::path::PathBuf> = roots
            .iter()
            .filter_map(|r| r.uri.strip_prefix("file://"))
            .map(|p| std::path::PathBuf::from(percent_decode(p)))
            .filter(|p| p.is_dir())
            .collect();
        let Some((first, rest)) = dirs.split_first() else { return };
        let ctx = self.ctx();
        let mut models: Vec<std::path::PathBuf> = rest.to_vec();
        models.extend(self.exposure.model_dirs.iter().cloned());
        let new = Ctx { workspace: first.canonicalize().ok(), models, ..(*ctx).clone() };
        tracing::info!("workspace from the client's roots: {}", first.display());
        *self.ctx.write().expect("not poisoned") = Arc::new(new);
    }

    /// Run a long, blocking operation off the async runtime with a time budget. Cancellation of the
    /// request kills its child processes; progress notifications are sent every few seconds when the
    /// client gave a progress token.
    async fn long<R, F>(
        &self,
        rc: RequestContext<RoleServer>,
        what: &'static str,
        engine: &str,
        f: F,
    ) -> Result<CallToolResult, ErrorData>
    where
        R: Report + Serialize + Send + 'static,
        F: FnOnce(&Ctx, &Budget) -> crate::error::Result<R> + Send + 'static,
    {
        // One call at a time per engine directory: builds and snapshots of one engine must not
        // interleave. Keyed by the path the call resolves to (relative to the workspace, links
        // resolved), so `eng` and `<workspace>/eng` are one engine.
        let key = self
            .ctx()
            .confine(std::path::Path::new(engine))
            .map(|d| d.path().display().to_string())
            .unwrap_or_else(|_| engine.to_string());
        {
            let mut busy = self.busy.lock().expect("not poisoned");
            if let Some(other) = busy.get(&key) {
                return Ok(err_result(crate::error::Error::usage(format!(
                    "{key} is busy with {other}; wait for that call to finish (or cancel it), then call {what} again"
                ))));
            }
            busy.insert(key.clone(), what);
        }
        struct Release(Arc<std::sync::Mutex<std::collections::HashMap<String, &'static str>>>, String);
        impl Drop for Release {
            fn drop(&mut self) {
                self.0.lock().expect("not poisoned").remove(&self.1);
            }
        }
        let _release = Release(self.busy.clone(), key);
        self.note_client(&rc);
        let time_limit_s = self.ctx().time_limit_s;
        let budget = Budget::secs(time_limit_s);
        let cancel = budget.cancel.clone();
        {
            let mut running = self.running.lock().expect("not poisoned");
            running.retain(|c| Arc::strong_count(c) > 1);
            running.push(cancel.clone());
        }
        let ctx = self.ctx();
        let b = budget.clone();
        self.log(&rc.peer, LoggingLevel::Info, format!("{what} started on {engine}")).await;
        let mut job = tokio::task::spawn_blocking(move || b.scope(|| f(&ctx, &b)));
        // The budget kills the call's children at its deadline; work in the server itself (the
        // reference forward pass, file reads) is abandoned a little later, its result dropped.
        let abandon = tokio::time::sleep(Duration::from_secs(time_limit_s.saturating_add(30)));
        tokio::pin!(abandon);
        let token = rc.meta.get_progress_token();
        let started = std::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(3));
        tick.tick().await;
        let mut n = 0.0;
        let result = loop {
            tokio::select! {
                r = &mut job => break r,
                _ = &mut abandon => {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Ok(err_result(crate::error::Error::usage(format!(
                        "{what} ran past the time limit of {time_limit_s} s and was abandoned; raise --time-limit or make the call smaller"
                    ))));
                }
                _ = rc.ct.cancelled() => {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                    // The job sees the flag, kills its child and returns shortly.
                    let _ = (&mut job).await;
                    self.log(&rc.peer, LoggingLevel::Notice, format!("{what} cancelled; recorded as cancelled")).await;
                    return Ok(err_result(crate::error::Error::usage(format!("{what} cancelled by the client; recorded in the ledger as cancelled"))));
                }
                _ = tick.tick() => {
                    if let Some(t) = &token {
                        n += 1.0;
                        let msg = format!("{what}: {:.0} s", started.elapsed().as_secs_f64());
                        let _ = rc.peer.notify_progress(ProgressNotificationParam::new(t.clone(), n).with_message(msg)).await;
                    }
                }
            }
        };
        self.log(
            &rc.peer,
            LoggingLevel::Info,
            format!("{what} finished after {:.1} s", started.elapsed().as_secs_f64()),
        )
        .await;
        self.notify_if_ckb_changed(&rc.peer).await;
        match result {
            Ok(r) => self.to_result(r),
            Err(e) => Err(ErrorData::internal_error(format!("{what} failed inside the server: {e}"), None)),
        }
    }
}

/// Decode `%XX` escapes of a file URI's path.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

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
pub struct NoArguments {}

#[tool_router]
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
            others: ctx.models.iter().map(|m| m.canonicalize().unwrap_or(m.clone()).display().to_string()).collect(),
        };
        self.to_result(Ok(report))
    }
}

/// Resource URI of the coverage report.
pub const COVERAGE_URI: &str = "ckb://coverage";

/// Resource URI prefix of the plain example engine's files (`examples/engines/llama-cpu-plain`):
/// the template an engine of any covered family imitates, one plain function per kernel contract.
pub const PLAIN_ENGINE_URI: &str = "example://llama-cpu-plain/";

impl Server {
    /// Read one resource by URI: `ckb://contract/{id}` (TOML), `ckb://coverage` (Markdown),
    /// `skill://{name}` (SKILL.md text), `example://llama-cpu-plain/{path}` (the plain example
    /// engine's sources).
    fn resource(&self, uri: &str) -> Result<(String, &'static str), ErrorData> {
        if uri == COVERAGE_URI {
            return Ok((self.ctx().live().ckb.coverage_report(), "text/markdown"));
        }
        if let Some(id) = uri.strip_prefix("ckb://contract/") {
            let ctx = self.ctx();
            let live = ctx.live();
            let c = live.ckb.get(id).map_err(|e| ErrorData::resource_not_found(e.message, None))?;
            let text = toml::to_string_pretty(c).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
            return Ok((text, "application/toml"));
        }
        if let Some(name) = uri.strip_prefix("skill://") {
            let skills = crate::guide::skills().map_err(|e| ErrorData::internal_error(e.message, None))?;
            return skills.into_iter().find(|s| s.name == name).map(|s| (s.text, "text/markdown")).ok_or_else(|| {
                ErrorData::resource_not_found(format!("no skill `{name}`; resources/list names them"), None)
            });
        }
        if let Some(path) = uri.strip_prefix(PLAIN_ENGINE_URI) {
            return crate::ckb::embedded::PLAIN_ENGINE
                .iter()
                .find(|(p, _)| *p == path)
                .map(|(p, text)| {
                    (text.to_string(), if p.ends_with(".toml") { "application/toml" } else { "text/x-rust" })
                })
                .ok_or_else(|| {
                    ErrorData::resource_not_found(
                        format!("the plain example engine has no file `{path}`; resources/list names them"),
                        None,
                    )
                });
        }
        Err(ErrorData::resource_not_found(
            format!(
                "unknown resource `{uri}`; use ckb://contract/{{id}}, {COVERAGE_URI}, skill://{{name}} or {PLAIN_ENGINE_URI}{{path}}"
            ),
            None,
        ))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Server {
    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let mut out = vec![
            Resource::new(COVERAGE_URI, "ckb-coverage")
                .with_description("What the contract knowledge base covers: families, platforms, dtypes")
                .with_mime_type("text/markdown"),
        ];
        let ctx = self.ctx();
        let live = ctx.live();
        *self.ckb_seen.lock().expect("not poisoned") = live.ckb.fingerprint().to_string();
        for c in live.ckb.all() {
            out.push(
                Resource::new(format!("ckb://contract/{}", c.id), c.id.clone())
                    .with_description(c.summary.clone())
                    .with_mime_type("application/toml"),
            );
        }
        for s in crate::guide::skills().map_err(|e| ErrorData::internal_error(e.message, None))? {
            out.push(
                Resource::new(format!("skill://{}", s.name), s.name.clone())
                    .with_description(s.description)
                    .with_mime_type("text/markdown"),
            );
        }
        for (path, _) in crate::ckb::embedded::PLAIN_ENGINE {
            out.push(
                Resource::new(format!("{PLAIN_ENGINE_URI}{path}"), format!("llama-cpu-plain/{path}"))
                    .with_description(
                        "The plain example engine (every covered family, f32, one function per kernel contract): the template to imitate",
                    )
                    .with_mime_type(if path.ends_with(".toml") { "application/toml" } else { "text/x-rust" }),
            );
        }
        Ok(ListResourcesResult::with_all_items(out))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(ListResourceTemplatesResult::with_all_items(vec![
            ResourceTemplate::new("ckb://contract/{id}", "contract")
                .with_description("A contract of the knowledge base as TOML, e.g. ckb://contract/kernel.rope")
                .with_mime_type("application/toml"),
            ResourceTemplate::new("skill://{name}", "skill")
                .with_description("An agent skill (SKILL.md), e.g. skill://generate-engine")
                .with_mime_type("text/markdown"),
            ResourceTemplate::new(format!("{PLAIN_ENGINE_URI}{{path}}"), "plain-engine")
                .with_description(
                    "A source file of the plain example engine, the template engine, e.g. example://llama-cpu-plain/src/model.rs",
                ),
        ]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let (text, mime) = self.resource(&request.uri)?;
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, request.uri.clone()).with_mime_type(mime)]).into())
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        let prompts = crate::guide::prompts().map_err(|e| ErrorData::internal_error(e.message, None))?;
        Ok(ListPromptsResult::with_all_items(
            prompts
                .into_iter()
                .map(|p| {
                    let args = p
                        .arguments
                        .iter()
                        .map(|a| {
                            PromptArgument::new(&a.name).with_description(&a.description).with_required(a.required)
                        })
                        .collect();
                    Prompt::new(p.name, Some(p.description), Some(args))
                })
                .collect(),
        ))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        let prompts = crate::guide::prompts().map_err(|e| ErrorData::internal_error(e.message, None))?;
        let p = prompts.iter().find(|p| p.name == request.name).ok_or_else(|| {
            ErrorData::invalid_params(
                format!(
                    "no prompt `{}`; prompts: {}",
                    request.name,
                    prompts.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
                ),
                None,
            )
        })?;
        let args: std::collections::BTreeMap<String, String> = request
            .arguments
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string())))
            .collect();
        let text = p.render(&args).map_err(|e| ErrorData::invalid_params(e.message, None))?;
        Ok(GetPromptResult::new(vec![PromptMessage::new_text(Role::User, text)])
            .with_description(p.description.clone())
            .into())
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        let arg = request.argument.name.as_str();
        let prefix = request.argument.value.as_str();
        let values = match (&request.r#ref, arg) {
            (Reference::Resource(_), "id") | (Reference::Prompt(_), "kernel") => {
                self.contract_ids(prefix, arg == "kernel")
            }
            (Reference::Prompt(_), "engine" | "workspace") => self.paths(prefix, "metainfer.toml"),
            (Reference::Prompt(_), "model") => self.paths(prefix, "config.json"),
            (Reference::Prompt(_), "phase") => {
                crate::ckb::Phase::ALL.iter().map(|p| p.name().to_string()).filter(|p| p.starts_with(prefix)).collect()
            }
            (Reference::Prompt(_), "dtype") => {
                ["f32", "bf16", "f16", "int8"].iter().map(|d| d.to_string()).filter(|d| d.starts_with(prefix)).collect()
            }
            (Reference::Prompt(_), "target") => self
                .ctx()
                .ckb
                .of_kind(crate::ckb::Kind::Platform)
                .filter_map(|p| p.platform.as_ref().map(|x| x.target.clone()))
                .filter(|t| t.starts_with(prefix))
                .collect(),
            _ => vec![],
        };
        let total = values.len();
        let mut values = values;
        values.truncate(CompletionInfo::MAX_VALUES);
        let mut info = CompletionInfo::new(values).map_err(|e| ErrorData::internal_error(e, None))?;
        info.total = Some(total as u32);
        info.has_more = Some(total > CompletionInfo::MAX_VALUES);
        Ok(CompleteResult::new(info))
    }

    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        *self.log_level.lock().expect("not poisoned") = request.level;
        Ok(())
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.spawn_adopt_roots(context.peer);
    }

    async fn on_roots_list_changed(&self, context: NotificationContext<RoleServer>) {
        self.spawn_adopt_roots(context.peer);
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .enable_resources_list_changed()
                .enable_prompts()
                .enable_logging()
                .enable_completions()
                .build(),
        )
        .with_server_info(
            Implementation::new("metainfer", env!("CARGO_PKG_VERSION"))
                .with_title("metainfer: contracts, oracles and gates for custom LLM inference engines"),
        )
        .with_instructions(INSTRUCTIONS)
    }
}

impl Server {
    /// Contract ids starting with `prefix` (kernels only with `kernels`), for completion.
    fn contract_ids(&self, prefix: &str, kernels: bool) -> Vec<String> {
        let ctx = self.ctx();
        let mut ids: Vec<String> = ctx
            .ckb
            .all()
            .filter(|c| !kernels || c.kind == crate::ckb::Kind::Kernel)
            .map(|c| c.id.clone())
            .filter(|id| id.starts_with(prefix) || (kernels && id.trim_start_matches("kernel.").starts_with(prefix)))
            .collect();
        ids.sort();
        ids
    }

    /// Directories under the workspace (and the allowed model directories) that hold `marker`
    /// (metainfer.toml for engines, config.json for models) and start with `prefix`, for
    /// completion; relative to the workspace where they lie in it. At most three levels deep.
    fn paths(&self, prefix: &str, marker: &str) -> Vec<String> {
        let ctx = self.ctx();
        let base = ctx.workspace.clone().unwrap_or_else(|| std::env::current_dir().unwrap_or_default());
        let mut out = Vec::new();
        for root in std::iter::once(&base).chain(&ctx.models) {
            for e in walkdir::WalkDir::new(root)
                .max_depth(3)
                .into_iter()
                .filter_entry(|e| {
                    let n = e.file_name().to_string_lossy();
                    e.depth() == 0 || !(n.starts_with('.') || n == "target" || n == "node_modules")
                })
                .filter_map(|e| e.ok())
            {
                if e.file_type().is_dir() && e.path().join(marker).is_file() {
                    let shown = match e.path().strip_prefix(&base) {
                        Ok(r) if !r.as_os_str().is_empty() => r.display().to_string(),
                        _ => e.path().display().to_string(),
                    };
                    if shown.starts_with(prefix) && !out.contains(&shown) {
                        out.push(shown);
                    }
                }
            }
        }
        out.sort();
        out
    }
}

/// Serve MCP over stdin/stdout until the client closes stdin.
///
/// # Errors
/// When the transport fails to start.
pub async fn serve_stdio(ctx: Ctx, exposure: Exposure) -> crate::error::Result<()> {
    let server = Server::new(ctx, exposure);
    let running = server.running.clone();
    // rmcp reads and writes in-process pipes; `framing` sits between them and stdio, answering
    // lines that are not JSON with JSON-RPC's parse error.
    let (rmcp_in, to_rmcp) = tokio::io::duplex(1 << 20);
    let (from_rmcp, rmcp_out) = tokio::io::duplex(1 << 20);
    let framing = tokio::spawn(framing::run(tokio::io::stdin(), tokio::io::stdout(), from_rmcp, to_rmcp));
    let service = server
        .serve((rmcp_in, rmcp_out))
        .await
        .map_err(|e| crate::error::Error::internal(format!("MCP stdio transport: {e}")))?;
    let result = service.waiting().await;
    // rmcp's output is closed: the framing copies what is left and ends.
    let _ = tokio::time::timeout(Duration::from_secs(2), framing).await;
    // The client is gone: stop every call still in flight (their children are killed and reaped).
    for c in running.lock().expect("not poisoned").iter() {
        c.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    result.map_err(|e| crate::error::Error::internal(format!("MCP session ended with an error: {e}")))?;
    Ok(())
}
